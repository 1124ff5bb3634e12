"""The main job: individualized DP-SGD on scikit-learn's digits (shipped with scikit-learn, no download).

Records fall into three privacy groups (34% / 43% / 23% with ε = 1 / 2 / 3, δ = 1e-5). Standard
DP-SGD must give everyone the strictest budget, ε = 1; individualized DP-SGD calibrates each
group's sample rate and clip bound to its own budget (IDP Sample, Scale, hybrid), and PDP-SGD
trains several rounds on budget-dependent subsets. The demo trains all of them and non-private
training on the same data over a few seeds, and reports test accuracy, the ε each group spent
(from the engine's per-record ledger, grouped by budget) and wall time; ``save_plots`` draws test
accuracy against step per method and ε spent per group over training.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ._checks import check_flag, check_int, check_positive

GROUP_FRACTIONS = (0.34, 0.43, 0.23)
GROUP_EPSILONS = (1.0, 2.0, 3.0)
DELTA = 1e-5
METHODS = ("dpsgd", "sample", "scale", "hybrid", "pdp")
NAMES = {"non-private": "non-private", "dpsgd": "DP-SGD (ε=1 for all)", "sample": "IDP Sample",
         "scale": "IDP Scale", "hybrid": "IDP hybrid", "pdp": "PDP-SGD"}


def check_method_names(name: str, given, known, *, allow_empty: bool = False) -> tuple:
    """Check a choice of methods (or variants) before any run starts.

    Args:
        name: the argument, as the message names it ("methods"); given: a sequence of names (not one
            string, which would read as its characters); known: the allowed names; allow_empty: whether
            no name at all is a valid choice.
    Returns:
        the names, as a tuple in the given order.
    Raises:
        TypeError for a string or a non-sequence; ValueError naming ``name`` for unknown names, a name
        given twice (its runs would be mixed into one), or no name when ``allow_empty`` is false.
    """
    if isinstance(given, (str, bytes)) or not hasattr(given, "__iter__"):
        raise TypeError(f"{name} must be a sequence of names from {', '.join(known)}, got {given!r}")
    names = tuple(given)
    unknown = [m for m in names if m not in known]
    if unknown:
        raise ValueError(f"{name}: unknown {', '.join(map(str, unknown))}; choose from {', '.join(known)}")
    twice = [m for m in dict.fromkeys(names) if names.count(m) > 1]
    if twice:
        raise ValueError(f"{name} must name each once; repeated: {', '.join(twice)}")
    if not names and not allow_empty:
        raise ValueError(f"{name} must not be empty; choose from {', '.join(known)}")
    return names


def capped_batch_size(batch_size: int, n: int) -> int:
    """The expected batch size, at most the number of records: like ``pdpfast train``, a batch size
    above the data caps the sampling rate at q = 1 (every record in every step), with a warning.

    Args:
        batch_size: the expected batch size asked for (checked by the caller); n: the records.
    Returns:
        min(batch_size, n).
    """
    if batch_size > n:
        warnings.warn(f"batch_size {batch_size} exceeds the {n} training records: the sampling rate is capped at "
                      f"q = 1 (every record in every step, expected batch {n})", stacklevel=3)
        return n
    return batch_size


def load_digits_split(seed: int = 0):
    """scikit-learn's digits, split.

    Args:
        seed: of the stratified 80/20 split.
    Returns:
        (x_train (N, 64) float32 in [0, 1], y_train (N,) int64, x_test, y_test).
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x / 16.0, y, test_size=0.2, random_state=seed, stratify=y)
    as_x = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    return as_x(x_tr), torch.tensor(y_tr), as_x(x_te), torch.tensor(y_te)


def assign_budgets(n: int, seed: int = 0) -> np.ndarray:
    """The demo's per-record budgets, assigned at random (data-independent).

    Args:
        n: the number of records.
        seed: of the assignment.
    Returns:
        (n,) float64 ε_i: GROUP_EPSILONS in the proportions GROUP_FRACTIONS.
    """
    rng = np.random.default_rng(seed)
    sizes = np.floor(np.array(GROUP_FRACTIONS) * n).astype(int)
    sizes[-1] = n - sizes[:-1].sum()
    return rng.permutation(np.repeat(GROUP_EPSILONS, sizes))


def make_model() -> nn.Module:
    """The demo's model.

    Returns:
        an MLP, (B, 64) float32 inputs → 128 (tanh) → (B, 10) logits.
    """
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))


@dataclass
class RunResult:
    """One training run of the demo.

    Attributes:
        method: "non-private" or one of ``METHODS``.
        accuracy: final test accuracy, in [0, 1].
        seconds: wall time of the run (training and the curves' evaluations).
        epsilons: budget → largest ε spent in that group (ledger; PDP-SGD: the charged round
            guarantees); None without privacy.
        steps: the steps at which the curves were taken.
        accuracies: test accuracy at those steps.
        epsilon_curve: budget → [largest ε spent in the group at those steps].
    """

    method: str
    accuracy: float
    seconds: float
    epsilons: dict[float, float] | None = None
    steps: list = field(default_factory=list)
    accuracies: list = field(default_factory=list)
    epsilon_curve: dict = field(default_factory=dict)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Test accuracy, in eval mode (the model's training mode is restored).

    Args:
        model: the classifier, (N, 64) → (N, 10) logits.
        x: (N, 64) float32 inputs.
        y: (N,) int64 labels.
    Returns:
        the fraction of argmax hits, a float in [0, 1].
    """
    was_training = model.training
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    model.train(was_training)
    return acc


class _Recorder:
    """Test accuracy and ε per group every ``every`` steps (and at step 0 and the end)."""

    def __init__(self, result: RunResult, model, data, budgets, every: int, spent=None):
        self.result, self.model, self.data, self.budgets, self.every, self.spent = (
            result, model, data, budgets, every, spent)
        self.groups = np.unique(budgets) if budgets is not None else []
        self.take(0)

    def take(self, step: int) -> None:
        r = self.result
        if r.steps and r.steps[-1] == step:
            return
        r.steps.append(step)
        r.accuracies.append(accuracy(self.model, self.data[2], self.data[3]))
        if self.spent is not None:
            eps = self.spent() if step > 0 else np.zeros_like(self.budgets)
            for b in self.groups:
                r.epsilon_curve.setdefault(float(b), []).append(float(eps[self.budgets == b].max()))

    def __call__(self, step: int, loss: float = 0.0) -> bool:
        if step % self.every == 0:
            self.take(step)
        return False


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=False, disable=not enabled)


def _with_bar(bar, fn):
    def hook(step, loss=0.0):
        bar.update(1)
        return fn(step, loss)
    return hook


def train_nonprivate(data, *, epochs: int, batch_size: int, lr: float, seed: int, eval_every: int = 10,
                     progress: bool = False) -> RunResult:
    """One non-private run of the demo's model (the accuracy to aim at).

    Args:
        data: from :func:`load_digits_split`.
        epochs, batch_size, lr, seed: of plain SGD (momentum 0.9, shuffled batches).
        eval_every: steps between points of the accuracy curve.
        progress: show a bar.
    Returns:
        :class:`RunResult` (ε None: no privacy).
    """
    x_tr, y_tr, x_te, y_te = data
    torch.manual_seed(seed)
    model, start = make_model(), time.perf_counter()
    result = RunResult("non-private", 0.0, 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loader = DataLoader(TensorDataset(x_tr, y_tr), batch_size=batch_size, shuffle=True)
    record = _Recorder(result, model, data, None, eval_every)
    bar, step = _progress(epochs * len(loader), f"{'non-private':>11} s{seed}", progress), 0
    for _ in range(epochs):
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
            step += 1
            bar.update(1)
            record(step)
    bar.close()
    record.take(step)
    result.accuracy, result.seconds = accuracy(model, x_te, y_te), time.perf_counter() - start
    return result


def train_private(data, budgets: np.ndarray, *, method: str, epochs: int, batch_size: int, lr: float,
                  seed: int, max_grad_norm: float = 1.0, progress: bool = False, eval_every: int = 10,
                  rounds: int = 2, pdp_loss: str = "fixed", accountant: str = "rdp") -> RunResult:
    """One private run of the demo's model.

    Args:
        data: from :func:`load_digits_split`.
        budgets: (N,) float64 ε_i.
        method: "sample" / "scale" / "hybrid" (IDP through ``make_private_with_budgets``), "dpsgd"
            (every record at the smallest budget) or "pdp" (PDP-SGD, ``rounds`` rounds, thresholds
            by ``pdp_loss``).
        epochs, batch_size (expected), lr, seed, max_grad_norm: of the run.
        progress, eval_every: as in :func:`train_nonprivate`.
        rounds: PDP-SGD's number of rounds.
        pdp_loss: PDP-SGD's threshold loss ("fixed", "adaptive" or "harmonic"; see
            :class:`pdpfast.pdp_sgd.PDPSGD`).
        accountant: "rdp" or "pld", what calibrates (and accounts) the plans of DP-SGD and the IDP methods
            (PDP-SGD's rounds keep their own RDP guarantees).
    Returns:
        :class:`RunResult` with ε per group from the per-record ledger.
    """
    from .loop import Task, private_engine, private_steps

    x_tr, y_tr, x_te, y_te = data
    n = len(x_tr)
    batch_size = capped_batch_size(batch_size, n)
    sample_rate = batch_size / n
    steps = epochs * round(1 / sample_rate)
    torch.manual_seed(seed)
    model, start = make_model(), time.perf_counter()
    result = RunResult(method, 0.0, 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    dataset, task = TensorDataset(x_tr, y_tr), Task()
    if method == "pdp":
        from .pdp_sgd import PDPSGD

        # each round: epochs/rounds expected passes over its subset, at the same expected batch
        driver = PDPSGD(model, dataset, budgets, optimizer=opt, delta=DELTA, rounds=rounds,
                        epochs_per_round=epochs / rounds, expected_batch_size=batch_size, task=task,
                        max_grad_norm=max_grad_norm, seed=seed, loss=pdp_loss)
        bar = _progress(driver.total_steps, f"{method:>11} s{seed}", progress)
        record = _Recorder(result, model, data, budgets, eval_every, driver.epsilons_now)
        out = driver.run(on_step=_with_bar(bar, record))
        final_step, spent = driver.steps, out.epsilons        # charged round guarantees (≥ the ledger's)
    else:
        bar = _progress(steps, f"{method:>11} s{seed}", progress)
        engine, model, opt, loader, criterion = private_engine(
            method, model, opt, dataset, budgets, delta=DELTA, steps=steps, sample_rate=sample_rate,
            batch_size=batch_size, task=task, max_grad_norm=max_grad_norm, seed=seed, accountant=accountant)
        record = _Recorder(result, model, data, budgets, eval_every, engine.epsilons)
        private_steps(engine, model, opt, loader, task, criterion, until=engine.plan.steps,
                      on_step=_with_bar(bar, record))
        final_step, spent = engine.steps, engine.epsilons()
        engine.detach()
    bar.close()
    record.take(final_step)
    result.epsilons = {float(b): float(spent[budgets == b].max()) for b in np.unique(budgets)}
    result.accuracy, result.seconds = accuracy(model, x_te, y_te), time.perf_counter() - start
    return result


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run the block with ``torch.set_num_threads(n)``, restoring torch's setting after it (the demo,
    the audit and ``fl simulate``'s ``--threads``).

    Args:
        n: the thread count, an int ≥ 1, checked by the caller; None or 0 leaves torch's setting.
    Returns:
        a context manager (it yields None).
    """
    if not n:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def demo_task(epochs, seeds, *, batch_size=128, lr=0.2, threads=1):
    """The demo's data and budgets, after checking the run's settings.

    Args:
        epochs: a positive int.
        seeds: a non-empty sequence of ints ≥ 0 (all checked here, before the first run).
        batch_size: a positive int; lr: a finite number > 0; threads: None or an int ≥ 0.
    Returns:
        (data from :func:`load_digits_split`, (N,) budgets from :func:`assign_budgets`).
    Raises:
        ValueError (TypeError for a non-number) naming the setting that is out of range, or for no seeds.
    """
    epochs = check_int("epochs", epochs, 1)
    check_int("batch_size", batch_size, 1)
    check_positive("lr", lr)
    if threads is not None:
        check_int("threads", threads, 0)
    if isinstance(seeds, (str, bytes)) or not hasattr(seeds, "__len__"):
        raise TypeError(f"seeds must be a sequence of ints ≥ 0 (one run per seed), got {seeds!r}")
    if len(seeds) == 0:
        raise ValueError("seeds must not be empty")
    for i, seed in enumerate(seeds):
        check_int(f"seeds[{i}]", seed, 0)
    data = load_digits_split()
    return data, assign_budgets(len(data[0]))


def run_demo(*, epochs: int = 10, batch_size: int = 128, lr: float = 0.2, seeds=(0, 1, 2), methods=METHODS,
             progress: bool = True, rounds: int = 2, threads: int | None = 1,
             eval_every: int | None = None, accountant: str = "rdp") -> dict[str, list[RunResult]]:
    """The whole demo.

    Args:
        epochs, batch_size, lr, rounds: of every run (non-private runs use lr / 5).
        seeds: one run per seed and method.
        methods: which private methods.
        progress: bars.
        threads: torch threads for the run (1 by default: the model is tiny, and more threads only
            contend on a shared machine); None or 0 leaves torch's setting.
        eval_every: steps between curve points, an int ≥ 1 (None, the default: about 60 points per run).
        accountant: "rdp" or "pld" for the plans of DP-SGD and the IDP methods.
    Returns:
        {method: [RunResult per seed]}, "non-private" first.
    Raises:
        ValueError for an unknown or repeated method (none: only the non-private runs), an unknown accountant,
        rounds or eval_every below 1, or as :func:`demo_task`. A batch size above the training records is
        capped (q = 1) with a warning, as in ``pdpfast train``.
    """
    methods = check_method_names("methods", methods, METHODS, allow_empty=True)
    if accountant not in ("rdp", "pld"):
        raise ValueError(f"accountant must be 'rdp' or 'pld', got {accountant!r}")
    check_flag("progress", progress)
    check_int("rounds", rounds, 1)
    if eval_every is not None:
        check_int("eval_every", eval_every, 1)
    data, budgets = demo_task(epochs, seeds, batch_size=batch_size, lr=lr, threads=threads)
    batch_size = capped_batch_size(batch_size, len(data[0]))
    steps = epochs * round(len(data[0]) / batch_size)
    every = eval_every or max(1, steps // 60)
    results: dict[str, list[RunResult]] = {"non-private": []}
    with torch_threads(threads):
        for seed in seeds:
            results["non-private"].append(train_nonprivate(data, epochs=epochs, batch_size=batch_size, lr=lr / 5,
                                                           seed=seed, eval_every=every, progress=progress))
            for method in methods:
                results.setdefault(method, []).append(
                    train_private(data, budgets, method=method, epochs=epochs, batch_size=batch_size, lr=lr,
                                  seed=seed, progress=progress, eval_every=every, rounds=rounds,
                                  accountant=accountant))
    return results


def format_results(results: dict[str, list[RunResult]]) -> str:
    """The demo's table.

    Args:
        results: from :func:`run_demo`.
    Returns:
        text: test accuracy (mean ± std over seeds), the largest ε any record of each group spent
        (ledger, worst seed) against the group's budget, and mean wall time per run in seconds.
    """
    budgets = sorted({b for runs in results.values() for r in runs if r.epsilons for b in r.epsilons})
    spent_head = f"ε spent per group (budget {'/'.join(f'{b:g}' for b in budgets)})" if budgets else "ε spent"
    width = max(len(spent_head), 16)
    lines = [f"{'method':<22} {'test accuracy':>15}   {spent_head:<{width}} {'time/run':>9}"]
    for method, runs in results.items():
        acc = np.array([r.accuracy for r in runs])
        if runs[0].epsilons:
            worst = {b: max(r.epsilons[b] for r in runs) for b in runs[0].epsilons}
            spent = "/".join(f"{worst[b]:.3f}" for b in sorted(worst))
        else:
            spent = "∞ (no privacy)"
        secs = np.mean([r.seconds for r in runs])
        lines.append(f"{NAMES.get(method, method):<22} {acc.mean():>8.3f} ± {acc.std():.3f}   {spent:<{width}} "
                     f"{secs:>8.1f}s")
    return "\n".join(lines)


def results_json(results: dict[str, list[RunResult]]) -> dict:
    """The demo's results as JSON.

    Args:
        results: from :func:`run_demo`.
    Returns:
        a JSON-able dict: "groups" (fractions, budgets, δ) and "runs": per method, per seed accuracy,
        seconds, ε per group and the curves (budgets as string keys).
    """
    from dataclasses import asdict

    return {"groups": {"fractions": GROUP_FRACTIONS, "epsilons": GROUP_EPSILONS, "delta": DELTA},
            "runs": {m: [asdict(r) | {"epsilons": {str(k): v for k, v in (r.epsilons or {}).items()},
                                       "epsilon_curve": {str(k): v for k, v in r.epsilon_curve.items()}}
                         for r in runs] for m, runs in results.items()}}


def save_plots(results: dict[str, list[RunResult]], accuracy_path, epsilon_path) -> None:
    """Write the demo's two plots.

    Args:
        results: from :func:`run_demo`.
        accuracy_path: the image of test accuracy vs step per method (mean ± std over seeds).
        epsilon_path: the image of ε spent per group over training (first seed, ledger) per private
            method, with each group's budget dashed.
    Returns:
        None.
    """
    from . import plots

    curves = {NAMES.get(m, m): [(r.steps, r.accuracies) for r in runs] for m, runs in results.items()}
    plots.accuracy_curves(curves, accuracy_path, title="digits: test accuracy during training")
    eps = {NAMES.get(m, m): (runs[0].steps, runs[0].epsilon_curve) for m, runs in results.items()
           if runs[0].epsilon_curve}
    plots.epsilon_curves(eps, epsilon_path,
                         title="ε spent per privacy group (max over the group, per-record ledger)")
