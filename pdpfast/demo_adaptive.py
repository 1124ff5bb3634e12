"""``pdpfast demo --adaptive``: fixed vs adaptive clipping and fixed vs decaying noise, on digits.

The demo task of ``pdpfast.demo`` (three privacy groups, ε = 1 / 2 / 3, δ = 1e-5) trained with IDP
Sample, Scale and hybrid in these variants, over seeds:

* ``fixed`` — the calibrated plan as is (reference clip C = 1, constant σ);
* ``adaptive`` — quantile clipping, the groups' bounds moving together (Scale's ratios kept);
* ``adaptive-per-group`` — quantile clipping, each group on its own;
* ``decay`` — σ_t = σ₀·exp(−kt) with k = ln 2 / T (σ halves over the run), σ₀ calibrated;
* ``fixed C=0.05`` / ``adaptive C=0.05`` — the same two with a badly chosen initial bound.

Every run's ε per group comes from the engine's ledger (which includes the counts' cost).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from ._checks import check_flag
from .demo import (
    DELTA,
    GROUP_EPSILONS,
    accuracy,
    capped_batch_size,
    check_method_names,
    demo_task,
    make_model,
    torch_threads,
)
from .loop import Task, private_steps

METHODS = ("sample", "scale", "hybrid")
VARIANTS = ("fixed", "adaptive", "adaptive-per-group", "decay", "fixed C=0.05", "adaptive C=0.05")


@dataclass
class AdaptiveRun:
    """One run of the adaptive demo.

    Attributes:
        method: "sample", "scale" or "hybrid".
        variant: one of ``VARIANTS``.
        seed: of the run.
        accuracy: final test accuracy, in [0, 1].
        seconds: wall time of the run.
        epsilons: budget → largest ε spent in the group (ledger).
        final_clip_norms: each group's total clip bound at the end.
    """

    method: str
    variant: str
    seed: int
    accuracy: float
    seconds: float
    epsilons: dict = field(default_factory=dict)
    final_clip_norms: list = field(default_factory=list)


def _settings(variant: str, steps: int):
    from .accounting.schedules import ExponentialDecay
    from .adaptive import QuantileClipping

    clip = 0.05 if variant.endswith("C=0.05") else 1.0
    adaptive = None
    if variant.startswith("adaptive"):
        # count_share 0.05: a group of ~40 expected members needs a count noise well below 40
        adaptive = QuantileClipping(target_quantile=0.5, learning_rate=0.2, count_share=0.05,
                                    per_group=variant == "adaptive-per-group")
    schedule = ExponentialDecay(math.log(2.0) / steps) if variant == "decay" else None
    return clip, adaptive, schedule


def train_variant(data, budgets, *, method: str, variant: str, epochs: int, batch_size: int, lr: float,
                  seed: int) -> AdaptiveRun:
    """One run of an adaptive variant.

    Args:
        data: from ``demo.load_digits_split``.
        budgets: (N,) float64 ε_i.
        method: "sample" / "scale" / "hybrid".
        variant: one of VARIANTS.
        epochs, batch_size (expected), lr, seed: of the run.
    Returns:
        :class:`AdaptiveRun`: accuracy, seconds, ε per group (ledger), final clip bounds per group.
    """
    import pdpfast

    x_tr, y_tr, x_te, y_te = data
    batch_size = capped_batch_size(batch_size, len(x_tr))
    sample_rate = batch_size / len(x_tr)
    steps = epochs * round(1 / sample_rate)
    clip, adaptive, schedule = _settings(variant, steps)
    torch.manual_seed(seed)
    model, start = make_model(), time.perf_counter()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    engine = pdpfast.PrivacyEngine(seed=seed)
    model, opt, loader = engine.make_private_with_budgets(
        module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(x_tr, y_tr), batch_size=batch_size),
        budgets=budgets, delta=DELTA, steps=steps, method=method, sample_rate=sample_rate, max_grad_norm=clip,
        loss_reduction="sum", noise_schedule=schedule, adaptive_clipping=adaptive)
    # a bound of C scales the noisy mean gradient by ~C where it clips: lr·C stays comparable
    task = Task()
    private_steps(engine, model, opt, loader, task, task.criterion(), until=steps)
    spent = engine.epsilons()
    bounds = engine.adaptive.group_clip_norms if engine.adaptive is not None else engine.plan.group_clip_norms
    run = AdaptiveRun(method, variant, seed, accuracy(model, x_te, y_te), time.perf_counter() - start,
                      {float(b): float(spent[budgets == b].max()) for b in np.unique(budgets)},
                      [float(c) for c in bounds])
    engine.detach()
    return run


def run_adaptive_demo(*, epochs: int = 10, batch_size: int = 128, lr: float = 0.2, seeds=(0, 1, 2),
                      methods=METHODS, variants=VARIANTS, threads: int | None = 1, progress: bool = True):
    """The adaptive demo.

    Args:
        epochs, batch_size, lr: of every run.
        seeds, methods, variants: one run per combination.
        threads: torch threads (1 by default).
        progress: print a line per run.
    Returns:
        [AdaptiveRun] for every (method, variant, seed).
    Raises:
        ValueError for an unknown or repeated method or variant, no method or variant, or as
        ``demo.demo_task``. A batch size above the training records is capped (q = 1) with a warning.
    """
    methods = check_method_names("methods", methods, METHODS)
    variants = check_method_names("variants", variants, VARIANTS)
    check_flag("progress", progress)
    data, budgets = demo_task(epochs, seeds, batch_size=batch_size, lr=lr, threads=threads)
    batch_size = capped_batch_size(batch_size, len(data[0]))
    runs = []
    with torch_threads(threads):
        for method in methods:
            for variant in variants:
                for seed in seeds:
                    runs.append(train_variant(data, budgets, method=method, variant=variant, epochs=epochs,
                                              batch_size=batch_size, lr=lr, seed=seed))
                    if progress:
                        r = runs[-1]
                        print(f"  {method:>6} {variant:<19} seed {seed}: accuracy {r.accuracy:.3f} "
                              f"({r.seconds:.1f}s)", flush=True)
    return runs


def format_adaptive(runs) -> str:
    """The adaptive demo's table.

    Args:
        runs: from :func:`run_adaptive_demo`.
    Returns:
        a text table, one line per (method, variant): accuracy mean ± std over seeds, largest ε spent
        per group (worst seed), final clip bounds (mean over seeds).
    """
    lines = [f"{'method':<7} {'variant':<19} {'test accuracy':>15}   "
             f"{'ε spent (budget ' + '/'.join(f'{e:g}' for e in GROUP_EPSILONS) + ')':<26} final clip bounds"]
    keys = list(dict.fromkeys((r.method, r.variant) for r in runs))
    for method, variant in keys:
        rs = [r for r in runs if r.method == method and r.variant == variant]
        acc = np.array([r.accuracy for r in rs])
        spent = "/".join(f"{max(r.epsilons[b] for r in rs):.3f}" for b in sorted(rs[0].epsilons))
        bounds = "/".join(f"{np.mean([r.final_clip_norms[g] for r in rs]):.2f}"
                          for g in range(len(rs[0].final_clip_norms)))
        lines.append(f"{method:<7} {variant:<19} {acc.mean():>8.3f} ± {acc.std():.3f}   {spent:<26} {bounds}")
    return "\n".join(lines)


def adaptive_json(runs) -> dict:
    """The adaptive demo's results as JSON.

    Args:
        runs: from :func:`run_adaptive_demo`.
    Returns:
        a JSON-able dict of the groups (budgets, δ) and runs (budgets as string keys).
    """
    return {"groups": {"epsilons": GROUP_EPSILONS, "delta": DELTA},
            "runs": [asdict(r) | {"epsilons": {str(k): v for k, v in r.epsilons.items()}} for r in runs]}


def save_adaptive_plot(runs, path) -> None:
    """Plot the adaptive demo.

    Args:
        runs: from :func:`run_adaptive_demo`, at least one.
        path: the image (written atomically, in the format its suffix names): grouped bars of test
            accuracy (mean ± std over seeds) per method and variant.
    Returns:
        None.
    Raises:
        ValueError for no runs, or naming ``path`` as :func:`pdpfast.plots.check_image_path` does.
    """
    from .plots import check_image_path, figure, save_figure

    if len(runs) == 0:
        raise ValueError("runs is empty: there is nothing to plot")
    image_format = check_image_path(path)
    methods = list(dict.fromkeys(r.method for r in runs))
    variants = list(dict.fromkeys(r.variant for r in runs))
    with figure(figsize=(9, 4.5)) as (fig, ax):
        width = 0.8 / len(variants)
        for j, variant in enumerate(variants):
            means, stds = [], []
            for method in methods:
                acc = [r.accuracy for r in runs if r.method == method and r.variant == variant]
                means.append(np.mean(acc))
                stds.append(np.std(acc))
            ax.bar(np.arange(len(methods)) + (j - (len(variants) - 1) / 2) * width, means, width, yerr=stds,
                   label=variant, capsize=2)
        ax.set_xticks(np.arange(len(methods)), [f"IDP {m.capitalize()}" for m in methods])
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0, 1)
        ax.set_title("digits, ε = 1/2/3: fixed vs adaptive clipping, fixed vs decaying noise")
        ax.legend(fontsize=8, ncol=3, loc="lower center")
        save_figure(fig, path, image_format)
