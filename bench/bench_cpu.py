"""Step time of pdpfast (bk, ghost, per-layer) vs non-private training vs Opacus 1.6 (hooks, ghost), CPU.

A small transformer (4 layers, d=256, T=128, batch 16) and a GroupNorm CNN (CIFAR-shaped, batch 64);
``--models resnet18`` adds ResNet-18 with GroupNorm (CIFAR, batch 32). One process, providers
interleaved round by round, medians, ratios to the non-private step of the same run.

    python -m bench.bench_cpu [--repeats 15] [--models transformer,cnn] [--out bench/results/cpu_step_time.json]
    python -m bench.bench_cpu --repeats 5 --providers "non-private,pdpfast bk" --threads 1   # a quick look
    python -m bench.bench_cpu --models resnet18 --repeats 5 --allocator retain --out bench/results/cpu_resnet18.json

On a shared machine, threads of another job stall each multi-threaded op here; one thread and
CPU time (``--threads 1 --clock cpu``) give ratios that depend far less on the load.
``--allocator retain`` keeps freed memory in the process (``pdpfast._malloc.retain_freed_memory``): the
page faults of re-mapped activations, which depend on the process's allocation history and made
the non-private CNN step vary ~2x between runs, are then gone from every provider alike, and
the ratios measure computation. Each row records its page faults per step, and each provider's own
peak of allocated memory (its model copy, state and the high point of a step; the profiler's
allocation events, ``bench.harness.own_peak_memory``).
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

from bench.harness import PROVIDERS, environment, measure, with_ratios, write_rows
from bench.models import TinyTransformer, groupnorm_cnn
from pdpfast._malloc import retain_freed_memory
from pdpfast.models import resnet18_gn

CONFIGS = {"transformer": dict(batch=16, seq=128), "cnn": dict(batch=64, seq=None),
           "resnet18": dict(batch=32, seq=None)}  # resnet18: not run by default (a minute a provider)


def _case(name: str, batch: int, seq: int | None):
    g = torch.Generator().manual_seed(0)
    if name == "transformer":
        return (TinyTransformer(seq=seq), (torch.randint(0, 1000, (batch, seq), generator=g),),
                torch.randint(0, 2, (batch,), generator=g))
    model = resnet18_gn() if name == "resnet18" else groupnorm_cnn()
    return model, (torch.randn(batch, 3, 32, 32, generator=g),), torch.randint(0, 10, (batch,), generator=g)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--models", default="transformer,cnn")
    parser.add_argument("--out", default="bench/results/cpu_step_time.json")
    parser.add_argument("--providers", default=",".join(n for n in PROVIDERS if not n.endswith(" graph")),
                        help="comma-separated; the \"... graph\" providers need CUDA")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: the process's CPU time, steadier than wall time on a shared machine")
    parser.add_argument("--allocator", choices=("default", "retain"), default="default",
                        help="retain: glibc keeps freed memory (no page faults of re-mapped activations)")
    args = parser.parse_args(argv)
    if args.allocator == "retain":
        retain_freed_memory()
    if args.threads:
        torch.set_num_threads(args.threads)
    providers = {name: PROVIDERS[name] for name in args.providers.split(",")}
    torch.manual_seed(0)
    env, rows = environment(torch.device("cpu")), []
    loss = lambda out, y: nn.functional.cross_entropy(out, y, reduction="none")  # noqa: E731
    for name in args.models.split(","):
        cfg = CONFIGS[name]
        model, inputs, y = _case(name, cfg["batch"], cfg["seq"])
        results = with_ratios(measure(model, inputs, y, loss, repeats=args.repeats, providers=providers,
                                           clock=args.clock), cfg["batch"])
        for provider, r in results.items():
            rows.append({"benchmark": "cpu_step_time", "model": name, "provider": provider, **cfg, **r, **env,
                         "repeats": args.repeats, "clock": args.clock, "allocator": args.allocator})
    write_rows(args.out, rows)
    print("| model | provider | median step (ms) | × non-private | page faults / step | peak MiB | × memory |\n"
          "|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if "median_ms" in r:
            print(f"| {r['model']} | {r['provider']} | {r['median_ms']:.1f} | {r['time_ratio_vs_nonprivate']:.2f} "
                  f"| {r.get('page_faults_per_step', float('nan')):.0f} | {r['peak_memory_mb']:.1f} "
                  f"| {r.get('memory_ratio_vs_nonprivate', float('nan')):.2f} |")
        else:
            print(f"| {r['model']} | {r['provider']} | {r['error']} | | | | |")
    print(f"device: {env['device']}, torch {env['torch']}, opacus {env['opacus']}, {env['date']}, "
          f"allocator {args.allocator}, clock {args.clock}; "
          f"written to {args.out}")


if __name__ == "__main__":
    main()
