"""Calibration time vs number of distinct budgets, for each method.

    python -m bench.bench_calibration [--sizes 1000 10000 100000 1000000] [--repeats 3]

Budgets: N distinct values uniform in [1, 10], δ = 1e-5, T = 1000 steps, mean rate q = 0.01.
One warm-up call, then ``--repeats`` timed calls per (method, N); the median is reported. The
baseline, in the same process, is the per-budget bisection of the reference implementations
(Opacus's ``get_noise_multiplier`` for each distinct budget, as IDP-SGD's code does): it is timed
on a few budgets and reported per budget, and extrapolated (marked so) to N.

With each plan it also times what follows calibration at that many distinct budgets: loading the
plan (``PrivacyPlan.from_json``, which accounts every group again) and a training step's
accounting by the plan's ledger (``would_exceed`` then ``step``, the engine's check and charge;
the median over ``LEDGER_STEPS`` steps after the first).

Writes bench/results/calibration_cpu.json (one row per measurement) and
bench/results/calibration_time.png (log-log time vs N).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path

import numpy as np
import scipy

RESULTS = Path(__file__).resolve().parent / "results"
DELTA, STEPS, RATE = 1e-5, 1000, 0.01
LEDGER_STEPS = 50
METHODS = ("sample", "scale", "hybrid")


def _environment() -> dict:
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:   # the accounting layer does not need torch
        torch_version = None
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    return {"device": "cpu", "cpu": platform.processor() or platform.machine(), "cpu_model": model,
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "numpy": np.__version__, "scipy": scipy.__version__,
            "torch": torch_version, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _budgets(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(1.0, 10.0, n)


def bench_pdpfast(sizes, repeats) -> list:
    from pdpfast.accounting import calibrate

    calibrate(_budgets(1000), delta=DELTA, steps=STEPS, sample_rate=RATE)          # warm-up
    rows = []
    for n in sizes:
        budgets = _budgets(n)
        for method in METHODS:
            times, plan = [], None
            for _ in range(repeats):
                t0 = time.perf_counter()
                plan = calibrate(budgets, delta=DELTA, steps=STEPS, sample_rate=RATE, method=method)
                times.append(time.perf_counter() - t0)
            used = plan.epsilons() / budgets
            rows.append({"benchmark": "calibration", "provider": "pdpfast", "method": method, "N": n,
                         "distinct_budgets": int(np.unique(budgets).size), "seconds": statistics.median(times),
                         "all_seconds": times, "repeats": repeats, "noise_multiplier": plan.noise_multiplier,
                         "mean_sample_rate": float(plan.sample_rates.mean()),
                         "mean_clip_norm": float(plan.clip_norms.mean()),
                         "max_eps_over_budget": float(used.max()), "min_eps_over_budget": float(used.min())})
            print(f"pdpfast  {method:7s} N={n:>8d}  {rows[-1]['seconds']:.3f} s  (eps/budget in "
                  f"[{used.min():.4f}, {used.max():.7f}])", flush=True)
            rows += _after_calibration(plan, budgets, method)
    return rows


def _after_calibration(plan, budgets, method) -> list:
    """Rows for loading ``plan`` and for one step of its ledger's check and charge."""
    from pdpfast.accounting import PrivacyPlan
    from pdpfast.accounting.ledger import ledger_for_plan

    text = plan.to_json()
    t0 = time.perf_counter()
    PrivacyPlan.from_json(text)
    load = time.perf_counter() - t0
    ledger = ledger_for_plan(plan, budgets)
    t0 = time.perf_counter()
    ledger.would_exceed(DELTA)
    ledger.step()
    first = time.perf_counter() - t0
    times = []
    for _ in range(LEDGER_STEPS):
        t0 = time.perf_counter()
        ledger.would_exceed(DELTA)
        ledger.step()
        times.append(time.perf_counter() - t0)
    common = {"provider": "pdpfast", "method": method, "N": len(budgets), "distinct_budgets": len(plan.budget_values),
              "ledger_rows": int(ledger.group_rates.shape[0])}
    print(f"         {'':7s} {'':10s} plan load {load:.3f} s, ledger step {statistics.median(times) * 1e3:.2f} ms "
          f"(first {first:.2f} s, {common['ledger_rows']} rows)", flush=True)
    return [{"benchmark": "plan_load", **common, "seconds": load},
            {"benchmark": "ledger_step", **common, "seconds": statistics.median(times), "first_step_seconds": first,
             "all_seconds": times}]


def bench_baseline(n_budgets: int, sizes) -> list:
    """Per-budget bisection (Opacus get_noise_multiplier), the cost the grid inversion removes."""
    from opacus.accountants.utils import get_noise_multiplier

    budgets = _budgets(n_budgets, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        for e in budgets:
            get_noise_multiplier(target_epsilon=float(e), target_delta=DELTA, sample_rate=RATE, steps=STEPS)
        per_budget = (time.perf_counter() - t0) / n_budgets
    print(f"baseline opacus bisection: {per_budget:.3f} s per budget (timed on {n_budgets})", flush=True)
    rows = [{"benchmark": "calibration", "provider": "opacus_bisection_per_budget", "method": "scale",
             "N": n_budgets, "seconds": per_budget * n_budgets, "seconds_per_budget": per_budget,
             "extrapolated": False}]
    rows += [{"benchmark": "calibration", "provider": "opacus_bisection_per_budget", "method": "scale", "N": n,
              "seconds": per_budget * n, "seconds_per_budget": per_budget, "extrapolated": True} for n in sizes]
    return rows


def plot(rows, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for method, marker in zip(METHODS, "osd"):
        pts = sorted((r["N"], r["seconds"]) for r in rows
                     if r["benchmark"] == "calibration" and r["provider"] == "pdpfast" and r["method"] == method)
        ax.plot(*zip(*pts), marker=marker, label=f"pdpfast {method}")
    base = sorted((r["N"], r["seconds"]) for r in rows if r["provider"] != "pdpfast" and r["extrapolated"])
    if base:
        ax.plot(*zip(*base), "k:", label="per-budget bisection (Opacus), extrapolated")
    ax.axhline(2.0, color="grey", lw=0.8, ls="--", label="2 s target")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("distinct budgets N")
    ax.set_ylabel("calibration time [s] (median)")
    env = rows[0]
    ax.set_title(f"calibrate(): δ=1e-5, T={STEPS}, q={RATE}; CPU x{env.get('cpu_count')}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10_000, 100_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline-budgets", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "calibration_cpu.json")
    parser.add_argument("--plot", type=Path, default=RESULTS / "calibration_time.png")
    args = parser.parse_args(argv)
    env = _environment()
    rows = bench_pdpfast(args.sizes, args.repeats)
    if args.baseline_budgets > 0:
        rows += bench_baseline(args.baseline_budgets, args.sizes)
    for r in rows:
        r.update(env)
    per_budget = next((r["seconds_per_budget"] for r in rows if r["provider"] != "pdpfast"), None)
    if per_budget:
        for r in rows:
            if r["benchmark"] == "calibration" and r["provider"] == "pdpfast":
                r["speedup_vs_bisection_extrapolated"] = per_budget * r["N"] / r["seconds"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    plot(rows, args.plot)
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
