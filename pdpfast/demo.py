"""The main job: individualized DP-SGD on scikit-learn's digits (shipped with scikit-learn, no download).

Records fall into three privacy groups (34% / 43% / 23% with ε = 1 / 2 / 3, δ = 1e-5). Standard
DP-SGD must give everyone the strictest budget, ε = 1; individualized DP-SGD calibrates each
group's sample rate and clip bound to its own budget. The demo trains non-private, DP-SGD at ε = 1
and the individualized methods on the same data and prints test accuracy side by side.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

GROUP_FRACTIONS = (0.34, 0.43, 0.23)
GROUP_EPSILONS = (1.0, 2.0, 3.0)
DELTA = 1e-5


def load_digits_split(seed: int = 0):
    """(x_train, y_train, x_test, y_test) float32 / int64 tensors, a stratified 80/20 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x / 16.0, y, test_size=0.2, random_state=seed, stratify=y)
    as_x = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    return as_x(x_tr), torch.tensor(y_tr), as_x(x_te), torch.tensor(y_te)


def assign_budgets(n: int, seed: int = 0) -> np.ndarray:
    """(n,) per-record ε: groups of the demo's fractions, assigned at random (data-independent)."""
    rng = np.random.default_rng(seed)
    sizes = np.floor(np.array(GROUP_FRACTIONS) * n).astype(int)
    sizes[-1] = n - sizes[:-1].sum()
    return rng.permutation(np.repeat(GROUP_EPSILONS, sizes))


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))


@dataclass
class RunResult:
    method: str
    accuracy: float
    seconds: float
    epsilons: dict[float, float] | None = None  # budget → largest guaranteed ε in that group


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def train_nonprivate(data, *, epochs: int, batch_size: int, lr: float, seed: int) -> RunResult:
    x_tr, y_tr, x_te, y_te = data
    torch.manual_seed(seed)
    model, start = make_model(), time.perf_counter()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loader = DataLoader(TensorDataset(x_tr, y_tr), batch_size=batch_size, shuffle=True)
    for _ in range(epochs):
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
    return RunResult("non-private", accuracy(model, x_te, y_te), time.perf_counter() - start)


def train_private(data, budgets: np.ndarray, *, method: str, epochs: int, batch_size: int, lr: float,
                  seed: int, max_grad_norm: float = 1.0, progress: bool = False) -> RunResult:
    """One individualized DP-SGD run; ``method`` is a calibration method or "dpsgd" (min budget for all)."""
    import pdpfast

    x_tr, y_tr, x_te, y_te = data
    n = len(x_tr)
    sample_rate = batch_size / n
    steps = epochs * round(1 / sample_rate)
    if method == "dpsgd":
        plan_budgets, plan_method = np.full(n, budgets.min()), "sample"
    else:
        plan_budgets, plan_method = budgets, method
    plan = pdpfast.calibrate(plan_budgets, delta=DELTA, steps=steps, sample_rate=sample_rate, method=plan_method,
                             max_grad_norm=max_grad_norm)
    torch.manual_seed(seed)
    model, start = make_model(), time.perf_counter()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    engine = pdpfast.PrivacyEngine(seed=seed)
    model, opt, loader = engine.make_private(
        module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(x_tr, y_tr), batch_size=batch_size),
        noise_multiplier=plan.noise_multiplier, max_grad_norm=plan.max_grad_norm,
        sample_rates=plan.sample_rates, clip_norms=plan.clip_norms, steps_per_epoch=steps // epochs)
    bar = _progress(total=steps, desc=f"{method:>7}", enabled=progress)
    for _ in range(epochs):
        for xb, yb in loader:
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
            opt.zero_grad()
            bar.update(1)
    bar.close()
    spent = plan.epsilons()
    per_group = {float(b): float(spent[budgets == b].max()) for b in np.unique(budgets)}
    return RunResult(method, accuracy(model, x_te, y_te), time.perf_counter() - start, per_group)


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=False, disable=not enabled)


def run_demo(*, epochs: int = 10, batch_size: int = 64, lr: float = 0.5, seeds=(0, 1, 2),
             methods=("dpsgd", "sample", "scale", "hybrid"), progress: bool = True) -> dict[str, list[RunResult]]:
    data = load_digits_split()
    budgets = assign_budgets(len(data[0]))
    results: dict[str, list[RunResult]] = {"non-private": []}
    for seed in seeds:
        results["non-private"].append(train_nonprivate(data, epochs=epochs, batch_size=batch_size, lr=lr / 5, seed=seed))
        for method in methods:
            results.setdefault(method, []).append(
                train_private(data, budgets, method=method, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed,
                              progress=progress))
    return results


def format_results(results: dict[str, list[RunResult]]) -> str:
    names = {"non-private": "non-private", "dpsgd": "DP-SGD (ε=1 for all)", "sample": "IDP Sample",
             "scale": "IDP Scale", "hybrid": "IDP hybrid"}
    lines = [f"{'method':<22} {'test accuracy':>15} {'ε spent per group (budget 1/2/3)':>34} {'time/run':>9}"]
    for method, runs in results.items():
        acc = np.array([r.accuracy for r in runs])
        eps = runs[0].epsilons
        spent = "/".join(f"{eps[b]:.2f}" for b in sorted(eps)) if eps else "∞ (no privacy)"
        secs = np.mean([r.seconds for r in runs])
        lines.append(f"{names.get(method, method):<22} {acc.mean():>8.3f} ± {acc.std():.3f} {spent:>34} {secs:>8.1f}s")
    return "\n".join(lines)
