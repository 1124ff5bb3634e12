"""Where an eager training step's host time goes, part by part, on the device it runs on.

``bench_e2e`` says how long a step takes and ``bench_overhead`` how its host time compares with the
non-private step's; this says which part of pdpfast spends it. Each provider's step runs with timers
around pdpfast's parts (host time, ``time.perf_counter``: on a GPU the kernels run asynchronously, so
this is the time the host spends issuing them) and, for a few steps, under ``torch.profiler``, which
adds the top torch ops by their own host time and the CUDA runtime calls, synchronising ones included
(``cudaStreamSynchronize``, ``cudaMemcpy``, ``cudaHostAlloc``, ``cudaFree``, ...):

    python -m bench.profile_step --device cuda --model bert --dtype bf16      # BERT-base (32, 128)
    python -m bench.profile_step --device cuda --model gpt2 --dtype bf16      # GPT-2 small (8, 512)
    python -m bench.profile_step --model bert-12x16 --route large --kernels stub   # the CPU's stand-in
    python -m bench.profile_step --model resnet18-w4 --route large --kernels stub  # ResNet-18-GN's calls

Parts (milliseconds a step, medians over ``--steps``; inclusive, so they nest):

- ``step``: the whole step (forward, backward, clipping, noise, optimizer step).
- ``dp forward``: the DP layers' private forwards (``ClippingState.forward``), their own computation included.
- ``backward hooks``: each DP layer call's backward (``ClippingState.on_backward``), with the norms,
  clip weights and clipped sums it computes there (per-layer clipping) or holds for later.
- ``end of backward``: the work queued to the end of the backward (``_finish_flat``,
  ``_finish_per_layer``: book-keeping's grouped norms and clipped sums, per-layer's held calls).
- ``optimizer step``: the optimizer's step (noise, the update).
- ``triton launches`` and ``extension calls``: every Triton kernel launch (``JITFunction.run``) and call
  of ``pdpfast._C``, wherever they are; with their counts a step.
- ``run flushes`` and ``allocator reads``: per-layer clipping's flushes of a held run of calls
  (``ClippingState._flush_run``, one norm launch each) and its reads of the device's allocated bytes
  (``pdpfast.clipping._allocated_bytes``, which let a run go on), with their counts a step.
- ``tables built`` / ``tables reused``: the grouped launches' device tables a step
  (``kernels._utils.table_on``: reused where a step repeats the last one's layout).

On a GPU the step ends with a synchronisation (outside the timers), so a step never waits for the
previous one's kernels: what is left is host work, and any wait inside the step itself (a
synchronising runtime call, in the profiler's list). ``--kernels stub`` on a CPU times the GPU's
kernel route with no-op launches (``bench_overhead``), where the model is small enough for a step to
be host work. JSON rows go to ``bench/results/profile_<device>_<model>_<dtype>.json``.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import functools
import statistics
import time

import torch

from .bench_overhead import extension_functions
from .harness import PROVIDERS, environment, write_rows

PARTS = ("step", "dp forward", "backward hooks", "end of backward", "optimizer step", "triton launches",
         "extension calls", "run flushes", "allocator reads")
DEFAULT_PROVIDERS = "non-private,pdpfast bk,pdpfast per-layer"
COUNTS = ("dp forward", "backward hooks", "triton launches", "extension calls", "run flushes", "allocator reads",
          "tables built", "tables reused")
# the CUDA runtime (and driver) calls a profile lists (the ones that can stop the host are the point)
RUNTIME_PREFIX = "cu"


class Timers:
    """Host time and count per part, for the step being timed (``take()`` returns and resets them).
    Nested calls of one part (a recursive forward) count once, at the outermost."""

    def __init__(self):
        self.ms, self.calls, self._depth = collections.Counter(), collections.Counter(), collections.Counter()

    def wrap(self, part: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if self._depth[part]:
                return fn(*args, **kwargs)
            self._depth[part] += 1
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ms[part] += (time.perf_counter() - t) * 1e3
                self.calls[part] += 1
                self._depth[part] -= 1
        return timed

    def take(self) -> tuple[dict, dict]:
        ms, calls = dict(self.ms), dict(self.calls)
        self.ms.clear()
        self.calls.clear()
        return ms, calls


@contextlib.contextmanager
def timed_parts(timers: Timers):
    """Wrap pdpfast's parts (module docstring) in ``timers``; undone on exit."""
    import pdpfast.clipping as clipping
    import pdpfast.optimizer as optimizer
    from pdpfast import _ext

    patches = [(clipping.ClippingState, "forward", "dp forward"),
               (clipping.ClippingState, "on_backward", "backward hooks"),
               (clipping.ClippingState, "_finish_flat", "end of backward"),
               (clipping.ClippingState, "_finish_per_layer", "end of backward"),
               (clipping, "_allocated_bytes", "allocator reads"),
               (optimizer.DPOptimizer, "step", "optimizer step"),
               (torch.optim.SGD, "step", "optimizer step")]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
        patches += [(JITFunction, "run", "triton launches"), (InterpretedFunction, "run", "triton launches")]
    except ImportError:  # no Triton: no launches
        pass
    patches += [(_ext._C, n, "extension calls") for n in extension_functions()]
    saved = [(owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name))
             for owner, name, _ in patches]
    try:
        for owner, name, part in patches:
            setattr(owner, name, timers.wrap(part, getattr(owner, name)))
        flush = clipping.ClippingState.__dict__["_flush_run"]
        saved.append((clipping.ClippingState, "_flush_run", flush))
        clipping.ClippingState._flush_run = _held_runs_only(timers.wrap("run flushes", flush), flush)
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def _held_runs_only(timed, flush):
    """``ClippingState._flush_run`` timed and counted where it has a run to flush (it is called at
    every call that does not join the held run, mostly with none)."""
    @functools.wraps(flush)
    def flush_run(self):
        return timed(self) if self._run else flush(self)
    return flush_run


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _table_stats() -> dict:
    """``table_on``'s lookups so far, summed over the names the kernels were imported under (from a
    checkout on ``sys.path``, both ``pdpfast.kernels`` and ``kernels``)."""
    import sys

    stats, seen = collections.Counter(), set()
    for name in ("pdpfast.kernels._utils", "kernels._utils"):
        utils = sys.modules.get(name)
        if utils is not None and id(utils.TABLE_STATS) not in seen:
            seen.add(id(utils.TABLE_STATS))
            stats.update(utils.TABLE_STATS)
    return stats


def profile_providers(model, inputs, y, loss, providers: dict, *, steps: int, warmup: int,
                      profiled_steps: int, top: int) -> dict:
    """{provider: {"parts_ms": {part: median ms a step}, "counts": {...} a step, "top_ops": [...],
    "runtime_calls": {...}} | {"error": ...}}: providers interleaved step by step (as ``harness.measure``)."""
    device = y.device
    timers = Timers()
    made, results = {}, {}
    for name, make in providers.items():
        try:
            step = make(copy.deepcopy(model), inputs, y, loss)
            for _ in range(warmup):
                step()
            _sync(device)
            made[name] = step
        except Exception as exc:  # e.g. a provider that needs a GPU: reported, the others go on
            results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    per_step = {name: [] for name in made}
    with timed_parts(timers):
        step_part = timers.wrap("step", lambda step: step())
        for _ in range(steps):
            for name, step in made.items():
                tables = _table_stats()
                timers.take()
                step_part(step)
                ms, calls = timers.take()
                _sync(device)
                after = _table_stats()
                calls["tables built"] = after.get("builds", 0) - tables.get("builds", 0)
                calls["tables reused"] = after.get("hits", 0) - tables.get("hits", 0)
                per_step[name].append((ms, calls))
    for name, rows in per_step.items():
        parts = {p: statistics.median(ms.get(p, 0.0) for ms, _ in rows) for p in PARTS}
        counts = {k: statistics.median(c.get(k, 0) for _, c in rows) for k in COUNTS}
        results[name] = {"parts_ms": parts, "counts": counts, **_profiled(made[name], device, profiled_steps, top)}
    return results


def _profiled(step, device: torch.device, steps: int, top: int) -> dict:
    """The top torch ops by their own host time and the CUDA runtime calls, a step, from ``torch.profiler``."""
    from torch.profiler import ProfilerActivity, profile

    if steps <= 0:
        return {}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
            _sync(device)
    ops, runtime = [], {}
    host = torch.autograd.DeviceType.CPU
    for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total):
        name = e.key
        if getattr(e, "device_type", host) != host:  # a kernel's run on the GPU, not a host call
            continue
        row = {"name": name, "calls": e.count / steps, "self_host_ms": e.self_cpu_time_total / 1e3 / steps}
        if name.startswith(RUNTIME_PREFIX) and not name.startswith("cudnn"):
            runtime[name] = {k: row[k] for k in ("calls", "self_host_ms")}
        elif name.startswith("aten::") and len(ops) < top:
            ops.append(row)
    return {"top_ops": ops, "runtime_calls": runtime}


def _print(results: dict, top: int) -> None:
    names = list(results)
    print("| part (ms a step) | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for part in PARTS:
        cells = [f"{r['parts_ms'][part]:.2f}" if "parts_ms" in r else "" for r in results.values()]
        print(f"| {part} | " + " | ".join(cells) + " |")
    for key in COUNTS:
        cells = [f"{r['counts'][key]:g}" if "counts" in r else "" for r in results.values()]
        print(f"| {key} (count) | " + " | ".join(cells) + " |")
    for name, r in results.items():
        if "error" in r:
            print(f"\n{name}: {r['error']}")
            continue
        if r.get("runtime_calls"):
            calls = sorted(r["runtime_calls"].items(), key=lambda kv: -kv[1]["self_host_ms"])
            print(f"\n{name}, CUDA runtime calls a step: " +
                  ", ".join(f"{k} {v['calls']:g} ({v['self_host_ms']:.2f} ms)" for k, v in calls))
        if r.get("top_ops"):
            print(f"{name}, top {top} torch ops by own host time a step: " +
                  ", ".join(f"{o['name'][6:]} {o['calls']:g} ({o['self_host_ms']:.2f} ms)" for o in r["top_ops"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bert",
                        help="a bench_e2e model (bert, gpt2, llama, ...: full size) or one of bench_overhead's "
                             "stand-ins (bert-12x16, llama-12x16, resnet18-w4)")
    parser.add_argument("--size", default="full", help="bench_e2e's --size (full, or tiny for a quick check)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--providers", default=DEFAULT_PROVIDERS)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profiled-steps", type=int, default=3, help="steps under torch.profiler (0: none)")
    parser.add_argument("--top", type=int, default=12, help="torch ops listed")
    parser.add_argument("--route", choices=("model", "large"), default="model",
                        help="large: every call takes a full-size model's route (bench_overhead --route)")
    parser.add_argument("--kernels", choices=("run", "stub"), default="run",
                        help="stub: the GPU's kernel choices with no-op launches, on a CPU (bench_overhead --kernels)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from . import bench_overhead

    if args.kernels == "stub":
        bench_overhead.stub_kernel_launches()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if args.model in bench_overhead.STAND_INS:
        model, inputs, y, loss = bench_overhead.in_dtype(bench_overhead.STAND_INS[args.model](device), dtype)
        batch, seq = y.shape[0], (None if args.model == "resnet18-w4" else 8)
    else:
        from .bench_e2e import build

        model, inputs, y, loss, batch, seq = build(args.model, args.size, device, dtype)
    providers = {name: PROVIDERS[name] for name in args.providers.split(",")}
    with bench_overhead.large_call_route() if args.route == "large" else contextlib.nullcontext() as device_bytes:
        results = profile_providers(model, inputs, y, loss, providers, steps=args.steps, warmup=args.warmup,
                                    profiled_steps=args.profiled_steps, top=args.top)
    env = environment(device)
    rows = [{"benchmark": "step_profile", "model": args.model, "size": args.size, "batch": batch, "seq": seq,
             "dtype": args.dtype, "route": args.route, "kernels": args.kernels, "provider": name, **r, **env,
             "steps": args.steps, **({"device_bytes": device_bytes} if device_bytes else {})}
            for name, r in results.items()]
    _print(results, args.top)
    out = args.out or f"bench/results/profile_{device.type}_{args.model.replace('-', '_')}_{args.dtype}.json"
    out = write_rows(out, rows)
    print(f"\ndevice: {env['device']}, torch {env['torch']}, {env['date']}; written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
