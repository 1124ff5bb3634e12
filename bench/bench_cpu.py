"""Step time of pdpfast (bk, ghost, per-layer) vs non-private training vs Opacus 1.6 (hooks, ghost).

One process, the same model, data and optimizer for every provider; providers are interleaved
round by round so machine noise hits all of them alike; medians are reported with the ratio to
the non-private step measured in the same run.

    python -m bench.bench_cpu [--repeats 15] [--models transformer,cnn] [--out bench/results/cpu_step_time.json]
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from bench.models import TinyTransformer, groupnorm_cnn


def _inputs(model_name: str, batch: int, seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if model_name == "transformer":
        return TinyTransformer(seq=seq), torch.randint(0, 1000, (batch, seq), generator=g), torch.randint(0, 2, (batch,), generator=g)
    return groupnorm_cnn(), torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)


def _nonprivate(model, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return step


def _pdpfast(model, x, y, mode, clipping):
    from pdpfast.clipping import ClippingState
    from pdpfast.nn import convert
    from pdpfast.optimizer import DPOptimizer

    convert(model)
    state = ClippingState(model, mode=mode, clipping=clipping)
    state.attach()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), noise_multiplier=1.0, max_grad_norm=1.0,
                      expected_batch_size=len(x), seed=0)
    clip_norms = torch.full((len(x),), 1.0)

    def step():
        if mode == "ghost":
            state.begin_batch(clip_norms)
            state.ghost_backward(nn.functional.cross_entropy(model(x), y, reduction="none"))
        else:
            state.begin_batch(clip_norms, loss_scale=len(x))
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return step


def _opacus(model, x, y, grad_sample_mode):
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
    criterion = nn.CrossEntropyLoss()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = PrivacyEngine().make_private(module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0,
                                           max_grad_norm=1.0, poisson_sampling=False, criterion=criterion,
                                           grad_sample_mode=grad_sample_mode)
    model, opt = out[0], out[1]
    criterion = out[2] if grad_sample_mode == "ghost" else criterion

    def step():
        criterion(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return step


PROVIDERS = {
    "non-private": _nonprivate,
    "pdpfast bk": lambda m, x, y: _pdpfast(m, x, y, "bk", "flat"),
    "pdpfast ghost": lambda m, x, y: _pdpfast(m, x, y, "ghost", "flat"),
    "pdpfast per-layer": lambda m, x, y: _pdpfast(m, x, y, "bk", "per_layer"),
    "opacus hooks": lambda m, x, y: _opacus(m, x, y, "hooks"),
    "opacus ghost": lambda m, x, y: _opacus(m, x, y, "ghost"),
}


def measure(model_name: str, batch: int, seq: int, repeats: int, warmup: int = 3) -> list[dict]:
    base, x, y = _inputs(model_name, batch, seq)
    steps = {}
    for name, make in PROVIDERS.items():
        model = copy.deepcopy(base)
        steps[name] = make(model, x, y)
    times = {name: [] for name in steps}
    for r in range(warmup + repeats):
        for name, step in steps.items():
            t = time.perf_counter()
            step()
            if r >= warmup:
                times[name].append(time.perf_counter() - t)
    base_ms = statistics.median(times["non-private"]) * 1e3
    rows = []
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        rows.append({"benchmark": "step_time", "model": model_name, "provider": name, "batch": batch,
                     "seq": seq if model_name == "transformer" else None, "median_ms": round(ms, 2),
                     "ratio_vs_nonprivate": round(ms / base_ms, 3), "repeats": repeats})
    return rows


def environment() -> dict:
    import numpy
    try:
        import opacus
        opacus_version = opacus.__version__
    except ImportError:
        opacus_version = None
    return {"device": f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
            "torch": torch.__version__, "opacus": opacus_version, "numpy": numpy.__version__,
            "python": platform.python_version(), "date": datetime.date.today().isoformat()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--models", default="transformer,cnn")
    parser.add_argument("--out", default="bench/results/cpu_step_time.json")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    configs = {"transformer": (16, 128), "cnn": (64, None)}
    env, rows = environment(), []
    for name in args.models.split(","):
        batch, seq = configs[name]
        rows += [dict(r, **env) for r in measure(name, batch, seq or 0, args.repeats)]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"| model | provider | median step (ms) | × non-private |\n|---|---|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['provider']} | {r['median_ms']:.1f} | {r['ratio_vs_nonprivate']:.2f} |")
    print(f"device: {env['device']}, torch {env['torch']}, opacus {env['opacus']}, {env['date']}; written to {args.out}")


if __name__ == "__main__":
    main()
