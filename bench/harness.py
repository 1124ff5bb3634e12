"""Providers and timing shared by the benchmarks: one model, one batch, every engine, same process.

A provider turns (model, inputs, targets, per-sample loss) into a ``step()`` closure doing one full
training step (forward, backward, clipping, noise, optimizer). ``measure`` interleaves providers
round by round so machine noise hits them alike, times with CUDA events on GPU, and records each
provider's own peak memory in a separate pass (``own_peak_memory``).
"""
from __future__ import annotations

import contextlib
import copy
import datetime
import gc
import json
import platform
import statistics
import sys
import time
import warnings

try:
    import resource
except ImportError:  # not on Windows: no page-fault counts there
    resource = None
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

PerSampleLoss = Callable[[object, torch.Tensor], torch.Tensor]  # (model output, targets) -> (B,)


def _mean_loss(loss: PerSampleLoss):
    return lambda out, y: loss(out, y).mean()


def _tensors(inputs):
    return list(inputs.values()) if isinstance(inputs, dict) else list(inputs)


def call(model, inputs):
    """inputs: a tuple of positional tensors or a dict of keyword tensors."""
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def nonprivate(model, inputs, y, loss: PerSampleLoss):
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step():
        _mean_loss(loss)(call(model, inputs), y).backward()
        opt.step()
        opt.zero_grad()
    return step


def pdpfast_provider(mode: str, clipping: str):
    def make(model, inputs, y, loss: PerSampleLoss):
        from pdpfast.clipping import ClippingState
        from pdpfast.nn import convert
        from pdpfast.optimizer import DPOptimizer

        convert(model)
        state = ClippingState(model, mode=mode, clipping=clipping)
        state.attach()
        B = y.shape[0]
        opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4), noise_multiplier=1.0, max_grad_norm=1.0,
                          expected_batch_size=B, seed=0)
        clip_norms = torch.ones(B)

        def step():
            if mode == "ghost":
                state.begin_batch(clip_norms)
                state.ghost_backward(loss(call(model, inputs), y))
            else:
                state.begin_batch(clip_norms, loss_scale=B)
                _mean_loss(loss)(call(model, inputs), y).backward()
            opt.step()
            opt.zero_grad()
        return step
    return make


def nonprivate_graph(model, inputs, y, loss: PerSampleLoss):
    """The non-private step captured whole in one CUDA graph (torch's recipe): what graphs buy
    without privacy, beside what they buy pdpfast."""
    device = y.device
    if device.type != "cuda":
        raise ValueError("CUDA graphs need a CUDA device")
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            _mean_loss(loss)(call(model, inputs), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _mean_loss(loss)(call(model, inputs), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    def step():
        # the graph reads and writes the model's and optimizer's memory without holding them: this
        # closure does, else the next provider's gc.collect() and empty_cache() free it under the graph
        # (an illegal memory access in the timed rounds, seen on an H100)
        graph.replay()
        return model, opt
    return step


def pdpfast_graph_provider(clipping: str):
    """pdpfast's step captured in CUDA graphs (``pdpfast.graphs.PrivateStep``), bounds on the host
    opened per step as the engine's loader opens them."""
    def make(model, inputs, y, loss: PerSampleLoss):
        from pdpfast.clipping import ClippingState
        from pdpfast.graphs import PrivateStep
        from pdpfast.nn import convert
        from pdpfast.optimizer import DPOptimizer

        if y.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        convert(model)
        state = ClippingState(model, mode="bk", clipping=clipping)
        state.attach()
        B = y.shape[0]
        opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4), noise_multiplier=1.0, max_grad_norm=1.0,
                          expected_batch_size=B, seed=0)
        clip_norms, mask = torch.ones(B, dtype=torch.float64), torch.ones(B)
        private_step = PrivateStep(state, opt, lambda inputs, y: _mean_loss(loss)(call(model, inputs), y),
                                   cuda_graph=True)

        def step():
            state.begin_batch(clip_norms, mask, loss_scale=B)
            private_step(inputs, y)
        return step
    return make


class _PerSampleCriterion(nn.Module):
    """A loss module for Opacus's ghost mode, which calls it with reduction='none'."""

    def __init__(self, loss: PerSampleLoss):
        super().__init__()
        self.loss, self.reduction = loss, "mean"

    def forward(self, out, y):
        per_sample = self.loss(out, y)
        return per_sample if self.reduction == "none" else per_sample.mean()


def opacus_provider(grad_sample_mode: str):
    def make(model, inputs, y, loss: PerSampleLoss):
        from opacus import PrivacyEngine
        from torch.utils.data import DataLoader, TensorDataset

        # what a user does to make Opacus accept a stock model: no in-place activations (its backward
        # hooks forbid them); pdpfast needs neither change
        for m in model.modules():
            if hasattr(m, "inplace") and isinstance(m, (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.Hardtanh)):
                m.inplace = False
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        loader = DataLoader(TensorDataset(*_tensors(inputs), y), batch_size=y.shape[0])
        criterion = _PerSampleCriterion(loss)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = PrivacyEngine().make_private(module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0,
                                               max_grad_norm=1.0, poisson_sampling=False, criterion=criterion,
                                               grad_sample_mode=grad_sample_mode)
        model, opt = out[0], out[1]
        criterion = out[2] if grad_sample_mode == "ghost" else criterion

        def step():
            with warnings.catch_warnings():
                # torch's note, each step, that Opacus's full backward hooks fire on the first layer, whose
                # inputs need no gradient: expected there, and it buried the benchmark's table
                warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
                criterion(call(model, inputs), y).backward()
            opt.step()
            opt.zero_grad()
        return step
    return make


PROVIDERS = {
    "non-private": nonprivate,
    "pdpfast bk": pdpfast_provider("bk", "flat"),
    "pdpfast ghost": pdpfast_provider("ghost", "flat"),
    "pdpfast per-layer": pdpfast_provider("bk", "per_layer"),
    "non-private graph": nonprivate_graph,
    "pdpfast bk graph": pdpfast_graph_provider("flat"),
    "pdpfast per-layer graph": pdpfast_graph_provider("per_layer"),
    "opacus hooks": opacus_provider("hooks"),
    "opacus ghost": opacus_provider("ghost"),
}


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0


# what torch's profiler writes to the process's stderr from C++ at every start and stop (kineto's
# "USDT:" markers, which no log level turns off) and about memory allocated before it started
_PROFILER_LINES = ("USDT:", "STAGE:")
_PROFILER_WARNING = "allocated before the profiling started"


@contextlib.contextmanager
def _without_profiler_lines():
    """Run the block with file descriptor 2 sent to a temporary file, then write what it received back
    to stderr, less the profiler's own lines: a `pdpfast bench` printed 24 of them around its table."""
    import os
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().decode(errors="replace").splitlines(keepends=True)
                    if not line.startswith(_PROFILER_LINES) and _PROFILER_WARNING not in line]
            sys.stderr.write("".join(kept))
            sys.stderr.flush()


@contextlib.contextmanager
def own_peak_memory(device: torch.device):
    """Yields a dict whose "bytes" is set on exit to the peak of what the block allocated and had not
    yet freed: its own high-water mark, whatever else the process holds (other providers' models,
    the base model, the inputs).

    On CUDA from the caching allocator's statistics (the allocated count before the block is
    subtracted from its peak); on the CPU from the profiler's allocation events, summed in order.
    """
    out = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield out
        torch.cuda.synchronize(device)
        out["bytes"] = torch.cuda.max_memory_allocated(device) - before
        return
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with _without_profiler_lines(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield out
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            f = e.extra_fields
            events.append((e.start_time_ns, f.alloc_size < 0, f.ptr, f.alloc_size))
    # only the block's own blocks count: a free of memory allocated before it is skipped
    held, total, peak = {}, 0, 0
    for _, _, ptr, size in sorted(events):
        if size > 0:
            held[ptr] = size
            total += size
            peak = max(peak, total)
        elif ptr in held:
            total -= held.pop(ptr)
    out["bytes"] = peak


# Steps inside a provider's memory window: a captured step (``pdpfast.graphs.PrivateStep``, two
# eager warm-up steps) is captured in its third, and its graphs' memory must be counted
MEMORY_STEPS = 3


def measure(base: nn.Module, inputs: tuple, y: torch.Tensor, loss: PerSampleLoss, *, repeats: int, warmup: int = 3,
            providers: dict | None = None, clock: str = "wall") -> dict[str, dict]:
    """{provider: {"median_ms", "peak_memory_mb", "page_faults_per_step" (CPU only) | "error"}} for one
    model and batch.

    Peak memory is each provider's own (``own_peak_memory``): its copy of the model, its optimizer
    and engine state and the high point of its first ``MEMORY_STEPS`` steps, not what the providers built before
    it still hold. (Before 2026-11-24 it was the device's whole allocated peak, which counted every
    earlier provider's model: the H100 rows of 2026-11-23 in bench/README.md.)

    clock (CPU only): "wall", or "cpu" for the process's CPU time (all its threads), which other
    jobs on a shared machine disturb far less than wall time (they still share caches and memory).
    Page faults per step (median of the process's minor faults during each timed step) say how much
    of a CPU step was the kernel handing memory back (see ``pdpfast._malloc.retain_freed_memory``).
    """
    timer = time.process_time if clock == "cpu" and y.device.type != "cuda" else time.perf_counter
    device = y.device
    steps, results = {}, {}
    for name, make in (providers or PROVIDERS).items():
        # what earlier providers dropped is freed now, and pdpfast's CPU buffer pool starts empty
        # (a provider reusing another's pooled buffers would not count them as its own)
        gc.collect()
        workspace = sys.modules.get("pdpfast.ops.workspace")
        if workspace is not None:
            workspace.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            # peak memory of this provider alone (model, optimizer state, its first steps), before the timing
            with own_peak_memory(device) as peak:
                model = copy.deepcopy(base)
                steps[name] = make(model, inputs, y, loss)
                for _ in range(MEMORY_STEPS):  # a provider that fails does so here, not in the timed rounds
                    steps[name]()
            results[name] = {"peak_memory_mb": peak["bytes"] / 2**20}
        except Exception as exc:  # e.g. a layer Opacus does not support: report it, keep going
            steps.pop(name, None)
            results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    times = {name: [] for name in steps}
    host = {name: [] for name in steps}
    faults = {name: [] for name in steps}
    for r in range(warmup + repeats):
        for name, step in steps.items():
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                t = time.perf_counter()
                step()
                # the host's time to issue the step: close to the step time when the GPU waits on it
                issued = time.perf_counter() - t
                end.record()
                end.synchronize()
                elapsed = start.elapsed_time(end) / 1e3
                if r >= warmup:
                    host[name].append(issued)
            else:
                f, t = _minor_faults(), timer()
                step()
                elapsed = timer() - t
                if r >= warmup:
                    faults[name].append(_minor_faults() - f)
            if r >= warmup:
                times[name].append(elapsed)
    for name, ts in times.items():
        results[name]["median_ms"] = statistics.median(ts) * 1e3
        if host[name]:
            results[name]["host_ms"] = statistics.median(host[name]) * 1e3
        if faults[name] and resource is not None:
            results[name]["page_faults_per_step"] = statistics.median(faults[name])
    return results


def with_ratios(results: dict[str, dict], batch: int) -> dict[str, dict]:
    base = results.get("non-private", {})
    for r in results.values():
        if "median_ms" in r:
            r["throughput_samples_per_s"] = batch / (r["median_ms"] / 1e3)
            if "median_ms" in base:
                r["time_ratio_vs_nonprivate"] = r["median_ms"] / base["median_ms"]
                r["throughput_ratio_vs_nonprivate"] = base["median_ms"] / r["median_ms"]
            if "peak_memory_mb" in r and "peak_memory_mb" in base:
                r["memory_ratio_vs_nonprivate"] = r["peak_memory_mb"] / base["peak_memory_mb"]
    return results


def write_rows(out, rows: list) -> Path:
    """Write benchmark rows as JSON to ``out`` (its folder made if missing).

    Args:
        out: a path (str or Path).
        rows: JSON-serializable dicts.
    Returns:
        the Path written.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    return out


def environment(device: torch.device) -> dict:
    versions = {"torch": torch.__version__, "python": platform.python_version(),
                "date": datetime.date.today().isoformat()}
    for name in ("opacus", "triton", "transformers"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    if device.type == "cuda":
        versions["device"] = torch.cuda.get_device_name(device)
        versions["cuda"] = torch.version.cuda
    else:
        versions["device"] = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    return versions
