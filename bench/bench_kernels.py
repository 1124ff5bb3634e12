"""Per-kernel micro-benchmark of pdpfast's Triton kernels against their torch references (GPU).

    python -m bench.bench_kernels [--quick] [--ops linear_weight_sq_norms,conv_weight_sq_norms] [--dtypes bf16,fp32]
    python -m bench.bench_kernels --ops conv_weight_sq_norms --dtypes bf16,fp32   # ResNet-18 conv layers

The ops are those with a registered kernel (``pdpfast.ops.dispatch.registered()``), the ops of
the compiled extension ``pdpfast._C`` that run on CUDA (``clip_weights``, ``clip_scale``) and per-layer clipping's
two routes for a linear call (``per_layer_route``: which one the cost model picks, and what each
costs on this GPU); each kernel has one
benchmark function here, registered under the op's name with ``@benchmark(name)`` (an undeclared
name raises at import), which times the op's registered kernel against its registered reference.
For every op and shape: median time over CUDA-event-timed repeats (after warm-up) of the Triton
launcher and of the plain-torch reference in the same process, the bytes each must move at least
and the FLOPs of the algorithm, achieved GB/s and TFLOP/s, and the speed-up over the reference.
Rows go to stdout as a table and to ``bench/results/bench_kernels-<device>.json`` with the device,
torch, triton and CUDA versions. Without a CUDA device the script says so and exits (status 1):
the kernels are exercised on the CPU by the tests under TRITON_INTERPRET=1, which says nothing
about speed.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pdpfast.ops import dispatch

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class Row:
    benchmark: str
    provider: str          # "triton", "C++" (an op of pdpfast._C) or "torch"
    shape: str
    dtype: str
    variant: str           # kernel path / option benchmarked
    median_ms: float
    gbps: float            # minimum bytes moved / time
    tflops: float          # algorithm FLOPs / time (0 when not meaningful)
    speedup_vs_torch: float | None = None
    peak_extra_mib: float | None = None   # memory allocated above the inputs while it runs (where measured)
    graph_ms: float | None = None         # GPU time alone: CUDA-graph replay, no host launch cost (where measured)
    max_rel_err: float | None = None      # max over the batch of |result - float64| / float64 (where measured)


BENCHMARKS: dict[str, Callable] = {}


def benchmark(name: str):
    """Decorator: ``fn(rows, op, dtype_name, quick, reps)`` benchmarks the kernel of the op ``name``
    (``op``: its ``dispatch.Op``, whose ``kernel`` and ``reference`` it times)."""
    dispatch.op(name)  # an undeclared name raises here, at import

    def wrap(fn):
        BENCHMARKS[name] = fn
        return fn

    return wrap


def kernel_ops() -> list[str]:
    """The ops with a registered kernel (imports the kernels)."""
    return sorted(name for name, op in dispatch.registered().items() if op.kernel is not None)


def cuda_time_ms(fn: Callable[[], object], warmup_ms: float = 25.0, reps: int = 50) -> float:
    """Median of ``reps`` CUDA-event timings, after ~``warmup_ms`` of warm-up (compilation included)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    for _ in range(max(1, int(warmup_ms / max(start.elapsed_time(end), 1e-3)))):
        fn()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cuda_graph_ms(fn: Callable[[], object], calls: int = 20, replays: int = 10) -> float | None:
    """GPU time of one call of ``fn`` with the host taken out: ``calls`` calls captured in one CUDA
    graph, replayed ``replays`` times. Small kernels are host-bound when launched from Python
    (~0.06-0.1 ms a launch); this says what they cost inside a busy backward pass. None when
    ``fn`` cannot be captured."""
    try:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        torch.cuda.synchronize()
    except Exception:  # e.g. a host sync inside fn
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (replays * calls)


@contextlib.contextmanager
def fp32_dot_precision(precision: str):
    """The Triton kernels' ``tl.dot`` precision for fp32 tiles while the block runs ("ieee": exact
    fp32 on the FMA units; "tf32x3": three TF32 tensor-core products, near-fp32; "tf32": one, which
    the conv-norm kernel takes where ``torch.backends.cudnn.allow_tf32`` lets cuDNN, as by default).
    Under "ieee" and "tf32x3" cuDNN's TF32 is off, so every kernel runs at the precision named."""
    from pdpfast.kernels import _utils

    saved = _utils.FP32_DOT_PRECISION, torch.backends.cudnn.allow_tf32
    if precision == "tf32":
        torch.backends.cudnn.allow_tf32 = True
    else:
        _utils.FP32_DOT_PRECISION, torch.backends.cudnn.allow_tf32 = precision, False
    try:
        yield
    finally:
        _utils.FP32_DOT_PRECISION, torch.backends.cudnn.allow_tf32 = saved


def max_rel_err(result: torch.Tensor, exact: torch.Tensor) -> float:
    """max_i |result_i - exact_i| / exact_i: how far a kernel's per-sample norms are from float64's."""
    exact = exact.double()
    return float(((result.double() - exact).abs() / exact.clamp_min(1e-300)).max())


def _bench_pair(rows, benchmark, shape, dtype_name, variant, triton_fn, torch_fn, nbytes, flops, reps):
    ms_triton = cuda_time_ms(triton_fn, reps=reps)
    ms_torch = cuda_time_ms(torch_fn, reps=reps) if torch_fn is not None else None
    for provider, ms in (("triton", ms_triton), ("torch", ms_torch)):
        if ms is None:
            continue
        rows.append(Row(benchmark, provider, str(shape), dtype_name, variant, ms, nbytes / ms / 1e6,
                        flops / ms / 1e9 if flops else 0.0,
                        (ms_torch / ms_triton) if (provider == "triton" and ms_torch) else None))


@benchmark("linear_weight_sq_norms")
def bench_linear_norms(rows, op, dtype_name, quick, reps):
    """Each path of the kernel (for fp32 at its default ``tf32x3`` products and with exact ones,
    ``ieee``) against the reference, with every kernel row's largest relative error against float64
    norms."""
    from pdpfast.ops.linear import kernel_uses_gram

    dtype = DTYPES[dtype_name]
    # (8, 512, 768, 768): GPT-2 small's 768→768 calls, where the Gram form takes 1.33× the direct
    # form's multiply-adds ("auto" took the direct path there until the H200's rows of 2026-11-29)
    shapes = [(256, 1, 4096, 4096), (64, 128, 768, 768), (32, 512, 1024, 4096), (8, 512, 768, 768),
              (16, 2048, 768, 768), (8, 4096, 64, 64)]
    if quick:
        shapes = shapes[:4]
    for B, T, d, p in shapes:
        a = torch.randn(B, T, d, device="cuda", dtype=dtype)
        o = torch.randn(B, T, p, device="cuda", dtype=dtype)
        exact = op.reference(a.double(), o.double())
        nbytes = (a.numel() + o.numel()) * a.element_size() + 4 * B
        auto = "rank_one" if T == 1 else ("gram" if kernel_uses_gram(T, d, p) else "direct")
        flops = {"rank_one": 2 * B * (d + p), "gram": 2 * B * T * T * (d + p + 1),
                 "direct": 2 * B * T * d * p + 2 * B * d * p}
        default = "tf32x3" if dtype == torch.float32 else "ieee"  # the launcher's fp32 default
        variants = [(path, default) for path in ("auto", "gram", "direct")]
        if dtype == torch.float32:
            variants += [("gram", "ieee"), ("direct", "ieee")]
        for path, precision in variants:
            chosen = auto if path == "auto" else path
            name = f"{path}->{chosen}" if precision == default else f"{path} {precision}"
            with fp32_dot_precision(precision):
                _bench_pair(rows, op.name, (B, T, d, p), dtype_name, name,
                            lambda path=path: op.kernel(a, o, path=path),
                            (lambda: op.reference(a, o)) if path == "auto" else None,
                            nbytes, flops[chosen], reps)
                next(r for r in reversed(rows) if r.provider == "triton").max_rel_err = \
                    max_rel_err(op.kernel(a, o, path=path), exact)
        a = o = exact = None


@benchmark("linear_sq_norms_rounding")
def bench_linear_norms_rounding(rows, op, dtype_name, quick, reps):
    """A linear call's norms and low-precision rounding bound from one launch (the Gram and rank-one
    paths), against the reference's two computations (the norm, torch's four ops of the bound), at
    BERT-base's and GPT-2's Gram-path calls and a rank-one head. ``graph_ms`` is the GPU's time
    alone; ``median_ms`` includes the host's launches, which the fusion saves."""
    dtype = DTYPES[dtype_name]
    u = 2.0 ** -8
    shapes = [(32, 128, 768, 768), (32, 128, 768, 3072), (8, 512, 768, 2304), (32, 1, 768, 2)]
    if quick:
        shapes = shapes[::2]
    for B, T, d, p in shapes:
        a = torch.randn(B, T, d, device="cuda", dtype=dtype)
        o = torch.randn(B, T, p, device="cuda", dtype=dtype)
        nbytes = (a.numel() + o.numel()) * a.element_size() + 8 * B
        flops = 2 * B * (d + p) if T == 1 else 2 * B * T * T * (d + p + 1)
        _bench_pair(rows, op.name, (B, T, d, p), dtype_name, "fused", lambda: op.kernel(a, o, True, u),
                    lambda: op.reference(a, o, True, u), nbytes, flops, reps)
        for r in rows[-2:]:
            r.graph_ms = cuda_graph_ms((lambda: op.kernel(a, o, True, u)) if r.provider == "triton"
                                       else (lambda: op.reference(a, o, True, u)))
        a = o = None


@benchmark("linear_sq_norms_grouped")
def bench_linear_norms_grouped(rows, op, dtype_name, quick, reps):
    """The norms and rounding bounds of a model's linear calls of one batch and sequence length from
    one launch (book-keeping computes them together at the end of the backward), against one launch
    per call (the reference, each call on the fused kernel): BERT-base's 48 768→768 calls, all its 72
    projections (the 768→3072 and 3072→768 ones too: calls of different widths share the launch) and
    GPT-2's 48. ``median_ms`` includes the host's launches, which grouping saves; ``graph_ms``, the
    GPU's time, is the reference's only (the grouped launch copies its table from the host, which a
    capture refuses; its programs are the per-call launches' programs in one grid)."""
    dtype = DTYPES[dtype_name]
    u = 2.0 ** -8
    shapes = [("bert-base 48 x 768->768", 32, 128, [(768, 768)] * 48),
              ("bert-base 72 projections", 32, 128, [(768, 768)] * 48 + [(768, 3072), (3072, 768)] * 12),
              ("gpt2-small 48 projections", 8, 512, [(768, 2304), (768, 768), (768, 3072), (3072, 768)] * 12)]
    if quick:
        shapes = shapes[1:2]
    for name, B, T, widths in shapes:
        calls = [(torch.randn(B, T, d, device="cuda", dtype=dtype), torch.randn(B, T, p, device="cuda", dtype=dtype))
                 for d, p in widths]
        nbytes = sum((a.numel() + o.numel()) * a.element_size() for a, o in calls) + 8 * B * len(calls)
        flops = sum(2 * B * T * T * (d + p + 1) for d, p in widths)
        _bench_pair(rows, op.name, name, dtype_name, f"{len(calls)} calls", lambda: op.kernel(calls, True, u),
                    lambda: op.reference(calls, True, u), nbytes, flops, reps)
        rows[-1].graph_ms = cuda_graph_ms(lambda: op.reference(calls, True, u))
        calls = None


# ResNet-18 on CIFAR-10 (batch 256): every distinct conv shape, (C_in, C_out, input side, kernel, stride).
RESNET18_CIFAR_CONVS = [
    ("stem", 3, 64, 32, 3, 1),
    ("layer1 3x3", 64, 64, 32, 3, 1),
    ("layer2 3x3 s2", 64, 128, 32, 3, 2), ("layer2 1x1 s2", 64, 128, 32, 1, 2), ("layer2 3x3", 128, 128, 16, 3, 1),
    ("layer3 3x3 s2", 128, 256, 16, 3, 2), ("layer3 1x1 s2", 128, 256, 16, 1, 2), ("layer3 3x3", 256, 256, 8, 3, 1),
    ("layer4 3x3 s2", 256, 512, 8, 3, 2), ("layer4 1x1 s2", 256, 512, 8, 1, 2), ("layer4 3x3", 512, 512, 4, 3, 1),
]


@benchmark("conv_sq_norms_grouped")
def bench_conv_norms_grouped(rows, op, dtype_name, quick, reps, batch=256):
    """The norms and rounding bounds of a ResNet stage's same-shape convolutions from one launch
    (book-keeping at the end of the backward, per-layer clipping for a run of them), against one launch
    per call (the reference: each call on the kernel), ResNet-18 CIFAR's stride-1 3×3 calls, the input
    unpadded (the kernels pad by masking). ``median_ms`` includes the host's launches, which grouping
    saves; ``graph_ms`` is the reference's only (the grouped launch copies its offsets from the host)."""
    dtype = DTYPES[dtype_name]
    u = 2.0 ** -8
    stages = [(4, 64, 32), (3, 128, 16), (3, 256, 8), (3, 512, 4)]  # (calls, channels, side)
    if quick:
        stages = stages[::2]
    for n, c, side in stages:
        module = torch.nn.Conv2d(c, c, 3, padding=1, bias=False).to("cuda", dtype)
        calls = [(torch.randn(batch, c, side, side, device="cuda", dtype=dtype),
                  torch.randn(batch, c, side, side, device="cuda", dtype=dtype)) for _ in range(n)]
        nbytes = sum((x.numel() + o.numel()) * x.element_size() for x, o in calls)
        flops = 2 * n * batch * side * side * 9 * c * c
        _bench_pair(rows, op.name, f"{n} calls B={batch} {c}->{c} {side}px k3", dtype_name, f"{n} calls",
                    lambda: op.kernel(calls, module, (1, 1), u), lambda: op.reference(calls, module, (1, 1), u),
                    nbytes, flops, reps)
        rows[-1].graph_ms = cuda_graph_ms(lambda: op.reference(calls, module, (1, 1), u))
        calls = None


@benchmark("conv_sq_norms_rounding")
def bench_conv_norms_rounding(rows, op, dtype_name, quick, reps, batch=256):
    """A conv call's norms and low-precision rounding bound from one launch (the direct path sums a chunk
    of positions per program, the Gram path reads the Grams' diagonals), against the reference's two
    computations (the norms, torch's five ops of the bound), at ResNet-18 CIFAR's layers, the input
    unpadded. ``graph_ms`` is the GPU's time alone; ``median_ms`` includes the host's launches, which
    the fusion saves. The kernel rows' variant names the path and the GPU time of the norm launch alone."""
    from pdpfast.kernels import conv_norms
    from pdpfast.ops import conv as conv_ops

    dtype = DTYPES[dtype_name]
    u = 2.0 ** -8
    shapes = RESNET18_CIFAR_CONVS[1::3] if quick else RESNET18_CIFAR_CONVS
    for name, c_in, c_out, side, k, stride in shapes:
        module = torch.nn.Conv2d(c_in, c_out, k, stride=stride, padding=k // 2, bias=False).to("cuda", dtype)
        pad = (k // 2, k // 2)
        x = torch.randn(batch, c_in, side, side, device="cuda", dtype=dtype)
        out_side = (side + 2 * (k // 2) - k) // stride + 1
        o = torch.randn(batch, c_out, out_side, out_side, device="cuda", dtype=dtype)
        nbytes = (x.numel() + o.numel()) * x.element_size()
        flops = 2 * batch * out_side * out_side * c_in * k * k * c_out
        path = conv_norms.choose_path(conv_norms.conv_geometry(conv_ops.conv_pad(x, module), o, module), dtype,
                                      tf32=dtype == torch.float32)
        norms_only = cuda_graph_ms(lambda: conv_norms.conv_weight_sq_norms(x, o, module, padding=pad, parts=True))

        def fused():
            return op.kernel(x, o, module, False, u, padding=pad, parts=True)

        def apart():
            return op.reference(x, o, module, False, u, pad)
        _bench_pair(rows, op.name, f"{name} B={batch} {c_in}->{c_out} {side}px k{k} s{stride}", dtype_name,
                    f"fused {path}, norms alone {norms_only:.3f} ms", fused, apart, nbytes, flops, reps)
        for r in rows[-2:]:
            r.graph_ms = cuda_graph_ms(fused if r.provider == "triton" else apart)
        x = o = None


def _peak_extra_mib(fn) -> float:
    """Memory allocated above what was live before one call of ``fn``."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2 ** 20


@benchmark("conv_weight_sq_norms")
def bench_conv_norms(rows, op, dtype_name, quick, reps, batch=256):
    """Per-sample conv weight norms: the fused kernels (auto, and each path forced, with the cost
    model's estimate in the variant) against the current torch path (``*_reference``: im2col for
    small layers, else per-sample gradients from a batch-grouped cuDNN weight gradient), and the
    non-private weight gradient of the same layer as the floor. Speed-up is against the reference;
    ``graph_ms`` is the GPU time alone (CUDA graph), which decides inside a busy backward pass."""
    from pdpfast.kernels import conv_norms
    from pdpfast.ops import conv as conv_ops

    dtype = DTYPES[dtype_name]
    shapes = RESNET18_CIFAR_CONVS[1::3] if quick else RESNET18_CIFAR_CONVS
    for name, c_in, c_out, side, k, stride in shapes:
        module = torch.nn.Conv2d(c_in, c_out, k, stride=stride, padding=k // 2, bias=False).to("cuda", dtype)
        x_pad = conv_ops.conv_pad(torch.randn(batch, c_in, side, side, device="cuda", dtype=dtype), module)
        out_side = (side + 2 * (k // 2) - k) // stride + 1
        o = torch.randn(batch, c_out, out_side, out_side, device="cuda", dtype=dtype)
        geo = conv_norms.conv_geometry(x_pad, o, module)
        costs = conv_norms.conv_norm_costs(geo, dtype, tf32=dtype == torch.float32)
        chosen = conv_norms.choose_path(geo, dtype, tf32=dtype == torch.float32)
        shape = f"{name} B={batch} {c_in}->{c_out} {side}px k{k} s{stride}"
        nbytes = (x_pad.numel() + o.numel()) * x_pad.element_size()
        exact_flops = 2 * batch * geo.positions * geo.patch * geo.out_channels

        def measure(fn):
            ms = cuda_time_ms(fn, reps=reps)
            return ms, _peak_extra_mib(fn), cuda_graph_ms(fn)

        def reference():
            return op.reference(x_pad, o, module)

        ms_torch, mib, graph = measure(reference)
        unfolds = x_pad[0].numel() * batch * k * k <= conv_ops._UNFOLD_LIMIT
        rows.append(Row(op.name, "torch", shape, dtype_name,
                        "reference: " + ("unfold" if unfolds else "per-sample wgrad"), ms_torch,
                        nbytes / ms_torch / 1e6, exact_flops / ms_torch / 1e9, None, mib, graph))
        exact = op.reference(x_pad.double(), o.double(), module)
        # the default precision first: for fp32, TF32 products as cuDNN's default allows them
        default = "tf32" if dtype == torch.float32 else "ieee"
        variants = [(path, default) for path in ("auto", "direct", "gram")]
        if dtype == torch.float32:  # the same paths exact, and near-fp32 on the tensor cores
            variants += [("direct", "ieee"), ("gram", "ieee"), ("direct", "tf32x3"), ("gram", "tf32x3")]
        for path, precision in variants:
            used = chosen if path == "auto" else path
            name = f"{path}->{used} est={costs[used].seconds * 1e3:.3f}ms" if precision == default else \
                f"{path} {precision}"
            with fp32_dot_precision(precision):
                ms, mib, graph = measure(lambda path=path: op.kernel(x_pad, o, module, path=path))
                err = max_rel_err(op.kernel(x_pad, o, module, path=path), exact)
            rows.append(Row(op.name, "triton", shape, dtype_name, name, ms, nbytes / ms / 1e6,
                            costs[used].flops / ms / 1e9, ms_torch / ms, mib, graph, err))
        exact = None
        ms, mib, graph = measure(lambda: conv_ops.conv_clipped_grads(x_pad, o, None, module, need_bias=False))
        rows.append(Row(op.name, "torch", shape, dtype_name, "non-private wgrad (floor)", ms,
                        nbytes / ms / 1e6, exact_flops / ms / 1e9, ms_torch / ms, mib, graph))
        x_pad = o = None     # free this shape's tensors before the next one's (the closures above share them)


@benchmark("bias_sq_norms")
def bench_bias_norms(rows, op, dtype_name, quick, reps):
    dtype = DTYPES[dtype_name]
    for B, T, p in [(256, 1, 4096), (64, 512, 1024), (16, 2048, 4096)][: 2 if quick else None]:
        o = torch.randn(B, T, p, device="cuda", dtype=dtype)
        _bench_pair(rows, op.name, (B, T, p), dtype_name, "", lambda: op.kernel(o),
                    lambda: op.reference(o), o.numel() * o.element_size(), 0, reps)


@benchmark("embedding_sq_norms")
def bench_embedding_norms(rows, op, dtype_name, quick, reps):
    dtype = DTYPES[dtype_name]
    for B, T, p, V in [(64, 512, 768, 50257), (32, 2048, 1024, 32000), (64, 512, 768, 100)][: 1 if quick else None]:
        ids = torch.randint(0, V, (B, T), device="cuda")
        ids[:, T - T // 4:] = 0  # right padding
        o = torch.randn(B, T, p, device="cuda", dtype=dtype)
        _bench_pair(rows, op.name, (B, T, p, V), dtype_name, "padding_idx=0",
                    lambda: op.kernel(ids, o, V, 0),
                    lambda: op.reference(ids, o, V, 0),
                    o.numel() * o.element_size() + ids.numel() * 8, 0, reps)


def bench_clip_weights(rows, dtype_names, quick, reps):
    """The clip-weight op of ``pdpfast._C`` (``csrc/clip_cuda.cu``, one launch) against its five torch
    ops, at the sizes a backward asks for (one call per layer call in per-layer clipping): all
    launch cost, so the graph column (GPU time alone) is given too."""
    from pdpfast import _ext
    from pdpfast.ops.clip import clip_weights, clip_weights_reference

    if _ext.missing("clip_weights", "clip.cpp") is not None or not _ext._C.clip_with_cuda:
        print("bench_kernels: pdpfast._C has no CUDA clip_weights (build it with `python setup.py build_ext "
              "--inplace` on this machine)", file=sys.stderr)
        return
    for B in (32, 256, 4096):
        sq = torch.rand(B, device="cuda") * 4
        bounds = torch.rand(B, device="cuda")
        fns = {"C++": lambda: clip_weights(sq, bounds, loss_scale=B),
               "torch": lambda: clip_weights_reference(sq, bounds, loss_scale=B)}
        ms = {name: cuda_time_ms(fn, reps=reps) for name, fn in fns.items()}
        for name, fn in fns.items():
            speedup = ms["torch"] / ms["C++"] if name == "C++" else None
            rows.append(Row("clip_weights", name, str((B,)), "fp32", "loss_scale=B", ms[name],
                            3 * B * 4 / ms[name] / 1e6, 0.0, speedup, graph_ms=cuda_graph_ms(fn)))


def bench_clip_scale(rows, dtype_names, quick, reps):
    """Per-layer clipping's weighing of one linear call: the clip-scale op of ``pdpfast._C``
    (``csrc/clip_cuda.cu``: the norms' and ρ's partial sums summed, the weights computed, rounded to
    the gradients' dtype and applied to the rows, one launch) against the route it replaced (the
    clip-weight op, the weights' cast, torch's row product; one or two launches more), at the
    output gradients of BERT-base's and GPT-2's calls. Memory-bound: GB/s of the row scaling's
    read and write; the graph column is GPU time alone."""
    from pdpfast import _ext
    from pdpfast.ops.clip import PendingWeights, clip_scale, clip_weights

    if _ext.missing("clip_scale", "clip.cpp") is not None or not _ext._C.clip_with_cuda:
        print("bench_kernels: pdpfast._C has no CUDA clip_scale (build it with `python setup.py build_ext "
              "--inplace` on this machine)", file=sys.stderr)
        return
    shapes = [("bert-base", 32, 128, 768), ("bert-base", 32, 128, 3072), ("gpt2-small", 8, 512, 768)]
    for dtype_name in dtype_names:
        dtype = DTYPES[dtype_name]
        for model, B, T, p in shapes[:1] if quick else shapes:
            o = torch.randn(B, T, p, device="cuda", dtype=dtype)
            sq, rho = torch.rand(B, 4, device="cuda") * 4, torch.rand(B, 4, device="cuda") * 1e-3
            rho = rho if dtype != torch.float32 else None
            bounds = torch.rand(B, device="cuda")
            weights = PendingWeights(sq, bounds, None, float(B), rho, True)

            def apart():
                w = clip_weights(sq, bounds, None, None, float(B), rho, True)
                return o * (w if w.dtype == dtype else w.to(dtype)).view(-1, 1, 1)

            fns = {"C++": lambda: clip_scale(o, weights), "torch": apart}
            ms = {name: cuda_time_ms(fn, reps=reps) for name, fn in fns.items()}
            for name, fn in fns.items():
                speedup = ms["torch"] / ms["C++"] if name == "C++" else None
                variant = "one op" if name == "C++" else "clip_weights + cast + product"
                rows.append(Row("clip_scale", name, f"{model} {(B, T, p)}", dtype_name, variant, ms[name],
                                2 * o.numel() * o.element_size() / ms[name] / 1e6, 0.0, speedup,
                                graph_ms=cuda_graph_ms(fn)))


def bench_per_layer_route(rows, dtype_names, quick, reps):
    """Per-layer clipping of one linear call (weight and bias), the two exact routes on this GPU:
    "norms+GEMM" (the norm kernels or Gram/direct products, clip weights, the clipped-sum GEMM on
    row-scaled output gradients) against "per-sample" (the per-sample gradients formed by one
    batched GEMM, their norms, clip weights, a weighted sum; freed at once). The variant names
    what ``pdpfast.ops.linear.prefer_per_sample`` picks at that shape in an eager step (its FLOP/byte
    model, ``GPU_FLOPS_PER_BYTE``, and in fp16/bf16 the host's extra ops of forming, ``FORM_HOST_BYTES``;
    a capture weighs the GPU's time alone): a row whose pick is slower in ``graph_ms`` where the
    host does not count (fp32), or in ``median_ms`` where it does, says the model is wrong there."""
    from pdpfast.nn.rules import sq_norms_of, weighted_sum
    from pdpfast.ops import linear as lin_ops
    from pdpfast.ops.clip import PendingWeights, clip_weights

    shapes = [("bert-base", 32, 128, 768, 768), ("bert-base", 32, 128, 768, 3072),
              ("gpt2-small", 8, 512, 768, 2304), ("gpt2-small", 8, 512, 768, 768),
              ("gpt2-small", 8, 512, 768, 3072), ("gpt2-small", 8, 512, 3072, 768)]
    for dtype_name in dtype_names:
        dtype = DTYPES[dtype_name]
        for model, B, T, d, p in shapes[1::2] if quick else shapes:
            a = torch.randn(B, T, d, device="cuda", dtype=dtype)
            o = torch.randn(B, T, p, device="cuda", dtype=dtype) / (T * d) ** 0.5
            bounds = torch.full((B,), 1.0, device="cuda")

            def norms_and_gemm():  # as per-layer clipping runs it: partial sums, weights applied by clip_scale
                sq = lin_ops.linear_sq_norms(a, o, with_bias=True, parts=True)
                return lin_ops.linear_clipped_grads(a, o, PendingWeights(sq, bounds, parts=True), True, True)

            def per_sample():
                g, g_bias = lin_ops.linear_per_sample_grads(a, o), o.sum(1)
                w = clip_weights(sq_norms_of([g, g_bias]), bounds)
                return weighted_sum(w, g), weighted_sum(w, g_bias)

            picks = lin_ops.prefer_per_sample(B * d * p, a, o, kept=False,
                                              norm_cost=lambda: lin_ops.norm_madds(B, T, d, p, a.device))
            routes = {"norms+GEMM": norms_and_gemm, "per-sample": per_sample}
            ms = {name: cuda_time_ms(fn, reps=reps) for name, fn in routes.items()}
            for name, fn in routes.items():
                picked = " (picked)" if (name == "per-sample") == picks else ""
                speedup = ms["norms+GEMM"] / ms[name] if name == "per-sample" else None
                rows.append(Row("per_layer_route", "pdpfast", f"{model} {(B, T, d, p)}", dtype_name, name + picked,
                                ms[name], 0.0, 2 * B * T * d * p / ms[name] / 1e9, speedup,
                                peak_extra_mib=_peak_extra_mib(fn), graph_ms=cuda_graph_ms(fn, calls=5, replays=5)))


def _bench_norm_grads(rows, op, dtype_name, quick, reps, module_of):
    """One launch against the reference's four ops, at BERT-base's, ViT-B/16's and GPT-2's
    LayerNorm calls and a LLaMA-7B-wide one (the kernel takes a program per sample: GPT-2's batch
    of 8 is the one that leaves most of the GPU idle)."""
    dtype = DTYPES[dtype_name]
    shapes = [("bert-base", 32, 128, 768), ("vit-b16", 64, 197, 768), ("gpt2-small", 8, 512, 768),
              ("llama-7b width", 4, 512, 4096)]
    for model, B, T, N in shapes[: 3 if quick else None]:
        x = torch.randn(B, T, N, device="cuda", dtype=dtype)
        o = torch.randn(B, T, N, device="cuda", dtype=dtype)
        module = module_of(N).to("cuda")
        _bench_pair(rows, op.name, f"{model} {(B, T, N)}", dtype_name, "", lambda: op.kernel(x, o, module),
                    lambda: op.reference(x, o, module), 2 * x.numel() * x.element_size(), 0, reps)


@benchmark("layer_norm_per_sample_grads")
def bench_layer_norm_grads(rows, op, dtype_name, quick, reps):
    _bench_norm_grads(rows, op, dtype_name, quick, reps, lambda n: torch.nn.LayerNorm(n))


@benchmark("rms_norm_per_sample_grads")
def bench_rms_norm_grads(rows, op, dtype_name, quick, reps):
    _bench_norm_grads(rows, op, dtype_name, quick, reps, lambda n: torch.nn.RMSNorm(n, eps=1e-6))


def _bench_norm_grads_grouped(rows, op, dtype_name, quick, reps, module_of):
    """A transformer's same-shape LayerNorm (RMSNorm) calls from one launch (book-keeping forms their
    per-sample gradients together at the end of the backward), against one launch per call (the
    reference: each call on the kernel): BERT-base's 25 calls and GPT-2's 25. ``median_ms`` includes
    the host's launches, which grouping saves; ``graph_ms`` is the reference's only (the grouped
    launch copies its offsets from the host, which a capture refuses)."""
    dtype = DTYPES[dtype_name]
    shapes = [("bert-base", 25, 32, 128, 768), ("gpt2-small", 25, 8, 512, 768)]
    for model, n, B, T, N in shapes[: 1 if quick else None]:
        calls = [(torch.randn(B, T, N, device="cuda", dtype=dtype), torch.randn(B, T, N, device="cuda", dtype=dtype))
                 for _ in range(n)]
        module = module_of(N).to("cuda")
        _bench_pair(rows, op.name, f"{model} {n} x {(B, T, N)}", dtype_name, f"{n} calls",
                    lambda: op.kernel(calls, module), lambda: op.reference(calls, module),
                    2 * n * B * T * N * calls[0][0].element_size(), 0, reps)
        rows[-1].graph_ms = cuda_graph_ms(lambda: op.reference(calls, module))
        calls = None


@benchmark("layer_norm_per_sample_grads_grouped")
def bench_layer_norm_grads_grouped(rows, op, dtype_name, quick, reps):
    _bench_norm_grads_grouped(rows, op, dtype_name, quick, reps, lambda n: torch.nn.LayerNorm(n))


@benchmark("rms_norm_per_sample_grads_grouped")
def bench_rms_norm_grads_grouped(rows, op, dtype_name, quick, reps):
    _bench_norm_grads_grouped(rows, op, dtype_name, quick, reps, lambda n: torch.nn.RMSNorm(n, eps=1e-6))


@benchmark("group_norm_affine_grads")
def bench_group_norm_grads(rows, op, dtype_name, quick, reps):
    """One launch against the reference's four ops at ResNet-18-GN's CIFAR stages (batch 256, 32
    groups): 64 channels of 32×32 positions down to 512 of 4×4."""
    dtype = DTYPES[dtype_name]
    for C, H in [(64, 32), (128, 16), (256, 8), (512, 4)][: 2 if quick else None]:
        x = torch.randn(256, C, H, H, device="cuda", dtype=dtype)
        o = torch.randn(256, C, H, H, device="cuda", dtype=dtype)
        _bench_pair(rows, op.name, f"resnet18-gn {(256, C, H, H)}", dtype_name, "32 groups",
                    lambda: op.kernel(x, o, 32, 1e-5, True), lambda: op.reference(x, o, 32, 1e-5, True),
                    2 * x.numel() * x.element_size(), 0, reps)


@benchmark("group_norm_affine_grads_grouped")
def bench_group_norm_grads_grouped(rows, op, dtype_name, quick, reps):
    """A ResNet-18-GN stage's five same-shape GroupNorm calls (CIFAR, batch 256, 32 groups) from one
    launch, against one launch per call (the reference: each call on the kernel). ``median_ms``
    includes the host's launches, which grouping saves; ``graph_ms`` is the reference's only (the
    grouped launch copies its offsets from the host, which a capture refuses)."""
    dtype = DTYPES[dtype_name]
    for C, H in [(256, 8), (512, 4), (64, 32), (128, 16)][: 2 if quick else None]:
        calls = [(torch.randn(256, C, H, H, device="cuda", dtype=dtype),
                  torch.randn(256, C, H, H, device="cuda", dtype=dtype)) for _ in range(5)]
        _bench_pair(rows, op.name, f"resnet18-gn 5 x {(256, C, H, H)}", dtype_name, "5 calls, 32 groups",
                    lambda: op.kernel(calls, 32, 1e-5, True), lambda: op.reference(calls, 32, 1e-5, True),
                    2 * 5 * calls[0][0].numel() * calls[0][0].element_size(), 0, reps)
        rows[-1].graph_ms = cuda_graph_ms(lambda: op.reference(calls, 32, 1e-5, True))
        calls = None


# Benchmarks of what is not a registered Triton kernel: ops of the compiled extension ``pdpfast._C``
# and the per-layer route choice; ``fn(rows, dtype_names, quick, reps)``.
EXTENSION_BENCHMARKS = {"clip_weights": bench_clip_weights, "clip_scale": bench_clip_scale,
                        "per_layer_route": bench_per_layer_route}


@benchmark("add_noise_")
def bench_noise(rows, op, dtype_name, quick, reps):
    dtype = DTYPES[dtype_name]
    # a GPT-2-small-like parameter list (~124M values) and one large matrix
    gpt2 = [(50257, 768), (1024, 768)] + [(768, 2304), (2304,), (768, 768), (768,), (768, 3072), (3072,),
                                         (3072, 768), (768,), (768,), (768,), (768,), (768,)] * 12
    for name, shapes in [("gpt2-small", gpt2), ("one 8192x8192", [(8192, 8192)])][: 1 if quick else None]:
        grads = [torch.zeros(s, device="cuda", dtype=dtype) for s in shapes]
        numel = sum(g.numel() for g in grads)
        step = iter(range(1 << 30))
        _bench_pair(rows, op.name, (name, len(grads), numel), dtype_name, "one launch",
                    lambda: op.kernel(grads, 1.0, 0, next(step)),
                    lambda: op.reference(grads, 1.0, 0, next(step)),
                    2 * numel * grads[0].element_size(), 0, reps)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--ops", default=None, help="comma-separated subset of the ops with a kernel "
                        "(default: all of them): " + ", ".join(sorted(BENCHMARKS) + sorted(EXTENSION_BENCHMARKS)))
    parser.add_argument("--dtypes", default="bf16", help="comma-separated subset of fp32, fp16, bf16")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/...)")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device here, so there is nothing to time. The Triton kernels run on "
              "NVIDIA GPUs; on the CPU they are only checked for correctness by the tests "
              "(TRITON_INTERPRET=1 python -m pytest tests/kernels).", file=sys.stderr)
        return 1
    try:
        import triton

        import pdpfast.kernels  # noqa: F401
    except Exception as exc:
        print(f"bench_kernels: the Triton kernels do not import ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 1

    with_kernel = kernel_ops()
    unbenchmarked = set(with_kernel) - set(BENCHMARKS)
    if unbenchmarked:
        print(f"bench_kernels: no benchmark for the kernels of {sorted(unbenchmarked)}; add one with "
              "@benchmark(name)", file=sys.stderr)
    selected = args.ops.split(",") if args.ops else [name for name in with_kernel if name in BENCHMARKS]
    extension = [name for name in EXTENSION_BENCHMARKS if not args.ops or name in selected]
    selected = [name for name in selected if name not in EXTENSION_BENCHMARKS]
    unknown = set(selected) - (set(with_kernel) & set(BENCHMARKS))
    if unknown:
        parser.error(f"no kernel or no benchmark for: {sorted(unknown)}")
    torch.manual_seed(0)
    rows: list[Row] = []
    for name in selected:
        for dtype_name in args.dtypes.split(","):
            BENCHMARKS[name](rows, dispatch.op(name), dtype_name, args.quick, args.reps)
            torch.cuda.empty_cache()
    for name in extension:
        EXTENSION_BENCHMARKS[name](rows, args.dtypes.split(","), args.quick, args.reps)

    header = f"{'benchmark':24} {'provider':8} {'dtype':5} {'shape':28} {'variant':18} {'ms':>9} {'GB/s':>8} " \
             f"{'TFLOP/s':>8} {'speedup':>8} {'MiB':>8} {'graph ms':>9} {'rel err':>8}"
    print(header)
    for r in rows:
        speedup = f"{r.speedup_vs_torch:8.2f}" if r.speedup_vs_torch else " " * 8
        mib = f"{r.peak_extra_mib:8.1f}" if r.peak_extra_mib is not None else " " * 8
        graph = f"{r.graph_ms:9.4f}" if r.graph_ms is not None else " " * 9
        err = f"{r.max_rel_err:8.1e}" if r.max_rel_err is not None else ""
        print(f"{r.benchmark:24} {r.provider:8} {r.dtype:5} {r.shape:28} {r.variant:18} {r.median_ms:9.4f} "
              f"{r.gbps:8.1f} {r.tflops:8.2f} {speedup} {mib} {graph} {err}")

    device_name = torch.cuda.get_device_name()
    meta = {
        "device": device_name, "torch": torch.__version__, "triton": triton.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "timing": f"CUDA events, median of {args.reps} after warm-up",
    }
    out = args.out or RESULTS / f"bench_kernels-{re.sub(r'[^A-Za-z0-9]+', '_', device_name).strip('_')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
