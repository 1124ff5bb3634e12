"""Per-sample gradients of normalization layers' affine parameters in one launch per call, or per
group of same-shape calls.

γ_i = Σ_t o_{i,t} ⊙ x̂_{i,t} and β_i = Σ_t o_{i,t}, x̂ the normalized input (x − mean)/√(var + ε)
(RMSNorm: x/√(mean(x²) + ε)). The torch references (``pdpfast.ops.norm``) take four ops per call:
x̂ formed again by a LayerNorm without affine, its product with o, and two sums over the positions,
so x̂ and o ⊙ x̂ each go to memory and back. Here one program per sample walks its positions a
tile of rows at a time: each row's mean and variance in registers, x̂ never stored, both sums
accumulated in fp32, and x and o read once. A BERT step has 25 LayerNorm calls, so this is 75
launches fewer per step, the host time that keeps an eager GPU step waiting (bench/README.md).

A program takes whole rows (the statistics need all of a row), so rows of up to ``MAX_N``
elements run here and longer ones run the reference. Where the batch alone gives the GPU enough
programs, one program per sample keeps the sums in registers and writes the gradients. Where it
does not (GPT-2's 8 samples of 512 positions, or BERT's 32 of 128, on a GPU of 132
multiprocessors), each sample's positions are split among programs (``_splits``): each writes
its fp32 partial sums, and torch's sum over the splits adds them (one op, cheaper for the host to
issue than a second Triton launch; two in fp16/bf16, whose result is rounded once to the output
dtype). Neither uses atomics, so the result is deterministic. One program per sample
ran 0.40-0.43x torch's reference at GPT-2's shapes and 0.71-0.88x at ViT-B/16's on an H200,
1.05-1.24x at BERT-base's (bench/results/bench_kernels-NVIDIA_H200.json, 2026-11-29): the time of
a program walking all 512 positions of its sample while most of the GPU idled.

Same-shape calls the clipping state holds (two a transformer block) take one launch, each program
reading its call's x and o at an offset from the first call's, from a table
(``layer_norm_per_sample_grads_grouped``); their n·B rows decide the splits.

GroupNorm and InstanceNorm (G = C) normalize over a group of channels and scale per channel: a
program per (sample, group) merges the group's mean and squared deviations tile by tile, then sums
each channel's o·(x − mean) and o (x read twice, o once; the statistics in fp32, as torch's CUDA
GroupNorm keeps them, of x less the group's first value). Same-shape calls (a ResNet stage's) take
one launch as LayerNorm's do (``group_norm_affine_grads_grouped``).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pdpfast.ops.dispatch import register
from pdpfast.ops.norm import (
    group_norm_affine_grads_grouped_reference,
    group_norm_affine_grads_reference,
    layer_norm_per_sample_grads_grouped_reference,
    layer_norm_per_sample_grads_reference,
    rms_norm_per_sample_grads_grouped_reference,
    rms_norm_per_sample_grads_reference,
)

from ._utils import KERNEL_DTYPES, block, device_guard, grouped_offsets, new_buffer

# The longest normalized row a program holds in registers (LLaMA-2-70B's width); longer rows run
# the reference.
MAX_N = 8192


@triton.jit
def _call_inputs(x_ptr, o_ptr, offsets_ptr, call, ALIGN_X: tl.constexpr, ALIGN_O: tl.constexpr):
    # a grouped launch's call c: its x and o start offsets[2c] and offsets[2c + 1] elements past the
    # first call's (multiples of ALIGN_X, ALIGN_O: 16 bytes)
    return (x_ptr + tl.multiple_of(tl.load(offsets_ptr + 2 * call), ALIGN_X),
            o_ptr + tl.multiple_of(tl.load(offsets_ptr + 2 * call + 1), ALIGN_O))


@triton.jit
def _norm_affine_grads_kernel(x_ptr, o_ptr, offsets_ptr, out_ptr, T, N, eps,
                              stride_xb, stride_xt, stride_ob, stride_ot, B, ROWS, SPLITS, PLANE, CALL_STRIDE,
                              SPLIT_STRIDE, CENTER: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr,
                              ALIGN_X: tl.constexpr, ALIGN_O: tl.constexpr,
                              BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    # program ((call, sample), split) sums positions [split·ROWS, (split + 1)·ROWS) of its sample
    # into row (split, call, sample) of out: the gradients themselves when SPLITS = 1, else fp32
    # partial sums (SPLIT_STRIDE apart) that torch adds; the bias's follow the weight's, PLANE
    # further, and each call's block CALL_STRIDE after the one before. GROUPED: calls of one shape
    # in one launch, call c's x and o starting offsets[2c] and offsets[2c + 1] elements past x_ptr
    # and o_ptr (multiples of ALIGN_X, ALIGN_O: 16 bytes); else one call (row = sample)
    pid = tl.program_id(0)
    row = pid // SPLITS
    split = pid % SPLITS
    sample = (row % B).to(tl.int64)
    if GROUPED:
        call = row // B
        x_ptr, o_ptr = _call_inputs(x_ptr, o_ptr, offsets_ptr, call, ALIGN_X, ALIGN_O)
        out_ptr += call.to(tl.int64) * CALL_STRIDE
    first = split * ROWS
    end = tl.minimum(first + ROWS, T)
    cols = tl.arange(0, BLOCK_N)
    in_n = cols < N
    acc_w = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(first, end, BLOCK_T):
        rows = start + tl.arange(0, BLOCK_T)
        inside = (rows < end)[:, None] & in_n[None, :]
        x = tl.load(x_ptr + sample * stride_xb + rows[:, None] * stride_xt + cols[None, :],
                    mask=inside, other=0.0).to(tl.float32)
        o = tl.load(o_ptr + sample * stride_ob + rows[:, None] * stride_ot + cols[None, :],
                    mask=inside, other=0.0).to(tl.float32)
        if CENTER:
            mean = tl.sum(x, axis=1) / N
            x = tl.where(inside, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / N + eps)
        acc_w += tl.sum(o * (x * rstd[:, None]), axis=0)
        if HAS_BIAS:
            acc_b += tl.sum(o, axis=0)
    base = out_ptr + split.to(tl.int64) * SPLIT_STRIDE + sample * N + cols
    tl.store(base, acc_w.to(out_ptr.dtype.element_ty), mask=in_n)
    if HAS_BIAS:
        tl.store(base + PLANE, acc_b.to(out_ptr.dtype.element_ty), mask=in_n)


# Programs a launch should give the GPU, per multiprocessor (a few resident at once hide latency)
PROGRAMS_PER_SM = 2
# The fewest positions a split takes: fewer would make the partial sums outweigh the rows
MIN_SPLIT_ROWS = 16
# Multiprocessors assumed off a GPU (the Triton interpreter): an H100's or H200's, so that the CPU
# takes the launches a GPU would (tests, ``bench_overhead --kernels stub``)
_INTERPRETER_SMS = 132
_SMS: dict = {}


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _SMS.get(index)
    if count is None:
        count = _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def _splits(B: int, T: int, max_block_t: int, device: torch.device) -> tuple[int, int, int]:
    """(splits, rows per split, rows per tile) of each sample's T positions: one split when the B
    programs of one per sample reach every multiprocessor or T is short, else enough for
    ``PROGRAMS_PER_SM`` per multiprocessor, each of at least ``MIN_SPLIT_ROWS`` positions and a
    whole number of tiles of at most ``max_block_t`` rows."""
    sms = _multiprocessors(device)
    splits = 1 if B >= sms else min(-(-PROGRAMS_PER_SM * sms // B), -(-T // MIN_SPLIT_ROWS))
    if splits <= 1:
        return 1, T, block(T, 1, max_block_t)
    per_split = -(-T // splits)
    block_t = block(per_split, 1, max_block_t)
    rows = -(-per_split // block_t) * block_t
    return -(-T // rows), rows, block_t


def _rows(t: torch.Tensor, N: int) -> torch.Tensor:
    """(B, T, N) rows of a call's x or o, the last dim contiguous (a copy where it is not)."""
    t = t.reshape(t.shape[0], -1, N)
    return t if t.stride(2) == 1 else t.contiguous()


def _as_grads(out: torch.Tensor, with_bias: bool) -> dict:
    return {"weight": out[0], "bias": out[-1]} if with_bias else {"weight": out[0]}


def _run(x3: torch.Tensor, o3: torch.Tensor, offsets: torch.Tensor | None, n: int, out: torch.Tensor, eps: float,
         center: bool, with_bias: bool) -> None:
    """One launch writing ``out`` ((n, planes, B, N) contiguous) from n calls of (B, T, N) rows, call
    c's at ``offsets`` (``grouped_offsets``) past the first call's x3 and o3 (None: n = 1)."""
    B, T, N = x3.shape
    block_n = block(N, 16, MAX_N)
    # the calls' programs share the GPU: n·B rows decide the splits
    splits, rows, block_t = _splits(n * B, T, max(1, 4096 // block_n), x3.device)
    M = out.numel()
    # SPLITS > 1: fp32 partial sums, (splits, n, planes, B, N), added by torch
    into = out if splits == 1 else new_buffer((splits, M), torch.float32, x3.device)
    grouped = offsets is not None
    with device_guard(x3):
        _norm_affine_grads_kernel[(n * B * splits,)](
            x3, o3, offsets if grouped else x3, into, T, N, eps, x3.stride(0), x3.stride(1), o3.stride(0),
            o3.stride(1), B, rows, splits, B * N, M // n, M, CENTER=center, HAS_BIAS=with_bias, GROUPED=grouped,
            ALIGN_X=16 // x3.element_size() if grouped else 1, ALIGN_O=16 // o3.element_size() if grouped else 1,
            BLOCK_T=block_t, BLOCK_N=block_n, num_warps=4 if block_n <= 1024 else 8 if block_n <= 4096 else 16)
    if splits > 1:  # torch's sum over dim 0: a fixed order (no atomics), one rounding to x's dtype
        if out.dtype == torch.float32:
            torch.sum(into, 0, out=out.view(M))
        else:
            out.view(M).copy_(into.sum(0))


def _launch(x: torch.Tensor, o: torch.Tensor, shape: tuple, eps: float, center: bool, with_bias: bool) -> dict:
    B, N = x.shape[0], math.prod(shape)
    # both outputs in one allocation (x and o share a dtype here): an allocator call fewer per call
    out = new_buffer((2 if with_bias else 1, B, *shape), x.dtype, x.device)
    if B:
        _run(_rows(x, N), _rows(o, N), None, 1, out, eps, center, with_bias)
    return _as_grads(out, with_bias)


def _launch_grouped(calls: list, shape: tuple, eps: float, center: bool, with_bias: bool) -> list | None:
    """The calls' per-sample gradients from one launch, each call's as ``_launch`` gives them (views
    of one (n, planes, B, *shape) buffer); None where they cannot share one: an empty batch, calls
    whose inputs do not all have the first one's shape and dtype, rows whose last dim is not
    contiguous, or rows that do not all match the first call's strides or do not all start on 16-byte
    boundaries (``grouped_offsets``)."""
    x0, N = calls[0][0], math.prod(shape)
    B = x0.shape[0]
    if not B or not all(x.shape == x0.shape and _same_dtypes(x, o) for x, o in calls):
        return None
    rows = [(x.reshape(B, -1, N), o.reshape(B, -1, N)) for x, o in calls]
    if any(x.stride(2) != 1 or o.stride(2) != 1 for x, o in rows):
        return None
    offsets = grouped_offsets(rows, 16)
    if offsets is None:
        return None
    n = len(calls)
    out = new_buffer((n, 2 if with_bias else 1, B, *shape), x0.dtype, x0.device)
    _run(*rows[0], offsets, n, out, eps, center, with_bias)
    return [_as_grads(block, with_bias) for block in out.unbind(0)]


def _same_dtypes(x: torch.Tensor, o: torch.Tensor) -> bool:
    """The kernels' inputs: fp32/fp16/bf16, x and o alike (autocast casts x to o's dtype first)."""
    return x.dtype in KERNEL_DTYPES and o.dtype == x.dtype and o.shape == x.shape


def _first_call_dtypes(x: torch.Tensor, o: torch.Tensor, *others: torch.Tensor) -> bool:
    """A grouped launch's inputs, decided on the first call's (the launcher checks the others)."""
    return _same_dtypes(x, o)


def _runs_here(x: torch.Tensor, o: torch.Tensor, shape: tuple) -> bool:
    return _same_dtypes(x, o) and 0 < math.prod(shape) <= MAX_N


@register("layer_norm_per_sample_grads", when=_same_dtypes)
def layer_norm_per_sample_grads(x: torch.Tensor, o: torch.Tensor, module) -> dict[str, torch.Tensor]:
    """A LayerNorm's per-sample affine gradients in one launch.

    Args:
        x: (B, ..., *normalized_shape) the layer's input, fp32/fp16/bf16, any strides.
        o: like ``x``, the gradient w.r.t. the layer's output, of ``x``'s dtype.
        module: supplies ``normalized_shape``, ``eps`` and ``bias`` (None: no bias gradient).
    Returns:
        {"weight": (B, *normalized_shape)}, plus "bias" when the module has one, in ``x``'s dtype,
        summed in fp32. Other dtypes, mixed dtypes and rows longer than ``MAX_N`` run
        ``pdpfast.ops.norm.layer_norm_per_sample_grads_reference``.
    """
    shape = tuple(module.normalized_shape)
    if not _runs_here(x, o, shape):
        return layer_norm_per_sample_grads_reference(x, o, module)
    return _launch(x, o, shape, module.eps, True, getattr(module, "bias", None) is not None)


@register("rms_norm_per_sample_grads", when=_same_dtypes)
def rms_norm_per_sample_grads(x: torch.Tensor, o: torch.Tensor, module) -> dict[str, torch.Tensor]:
    """An RMSNorm's per-sample weight gradient in one launch (the LayerNorm kernel, not centred).

    Args:
        x: (B, ..., *normalized_shape) the layer's input, fp32/fp16/bf16, any strides.
        o: like ``x``, the gradient w.r.t. the layer's output, of ``x``'s dtype.
        module: supplies ``normalized_shape`` and ``eps`` (None: fp32's ``torch.finfo`` eps for fp32,
            fp16 and bf16 alike, as ``torch.nn.functional.rms_norm``, which computes them in fp32).
    Returns:
        {"weight": (B, *normalized_shape)} in ``x``'s dtype, summed in fp32. Other dtypes, mixed
        dtypes and rows longer than ``MAX_N`` run ``pdpfast.ops.norm.rms_norm_per_sample_grads_reference``.
    """
    shape = tuple(module.normalized_shape)
    if not _runs_here(x, o, shape):
        return rms_norm_per_sample_grads_reference(x, o, module)
    return _launch(x, o, shape, _rms_eps(module), False, False)


def _rms_eps(module) -> float:
    # torch's default eps is its compute type's: fp32 for half inputs too (fp16's, 1e-3, would shrink
    # the normalized rows of small RMS and every gradient with them)
    return module.eps if module.eps is not None else torch.finfo(torch.float32).eps


@register("layer_norm_per_sample_grads_grouped", when=_first_call_dtypes)
def layer_norm_per_sample_grads_grouped(calls: list, module) -> list:
    """The per-sample affine gradients of n LayerNorm calls of one module configuration, shape,
    strides and dtype, from one launch: program ((call, sample), split) finds its call's x and o
    at an offset from the first call's, read from a table of the n calls' offsets.

    One launch instead of n: a Triton launch took an H200's host ~0.1 ms against a few µs of GPU
    time at BERT-base's LayerNorm calls, and a transformer step has two such calls a block.

    Args:
        calls: n ≥ 1 pairs (x, o) as ``layer_norm_per_sample_grads`` takes them, of one shape, strides
            and dtype (the caller groups them so).
        module: supplies ``normalized_shape``, ``eps`` and ``bias`` for every call.
    Returns:
        a list of n dicts, call c's what ``layer_norm_per_sample_grads`` gives it (views of one
        buffer). Calls that cannot share a launch (``_launch_grouped``) and rows longer than
        ``MAX_N`` run ``pdpfast.ops.norm.layer_norm_per_sample_grads_grouped_reference`` (one launch each).
    """
    shape = tuple(module.normalized_shape)
    grads = None
    if _runs_here(*calls[0], shape):
        grads = _launch_grouped(calls, shape, module.eps, True, getattr(module, "bias", None) is not None)
    return layer_norm_per_sample_grads_grouped_reference(calls, module) if grads is None else grads


@register("rms_norm_per_sample_grads_grouped", when=_first_call_dtypes)
def rms_norm_per_sample_grads_grouped(calls: list, module) -> list:
    """``layer_norm_per_sample_grads_grouped`` for RMSNorm calls (the kernel not centred).

    Args:
        calls: n ≥ 1 pairs (x, o) as ``rms_norm_per_sample_grads`` takes them, of one shape, strides
            and dtype.
        module: supplies ``normalized_shape`` and ``eps`` (as ``rms_norm_per_sample_grads``).
    Returns:
        a list of n dicts {"weight": (B, *normalized_shape)}, as ``rms_norm_per_sample_grads`` gives
        each call's; else ``pdpfast.ops.norm.rms_norm_per_sample_grads_grouped_reference``.
    """
    shape = tuple(module.normalized_shape)
    grads = None
    if _runs_here(*calls[0], shape):
        grads = _launch_grouped(calls, shape, _rms_eps(module), False, False)
    return rms_norm_per_sample_grads_grouped_reference(calls, module) if grads is None else grads


# ----------------------------------------------------------------------------------------------
# GroupNorm / InstanceNorm: γ_{i,c} = Σ_s o_{i,c,s} x̂_{i,c,s}, β_{i,c} = Σ_s o_{i,c,s}, x̂ normalized
# over the (C/G)·S values of the channel's group
# ----------------------------------------------------------------------------------------------
@triton.jit
def _group_norm_affine_grads_kernel(x_ptr, o_ptr, offsets_ptr, weight_ptr, bias_ptr, C, S, CPG, eps,
                                    stride_xb, stride_xc, stride_ob, stride_oc, B, CALL_STRIDE,
                                    HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr, ALIGN_X: tl.constexpr,
                                    ALIGN_O: tl.constexpr, ONE_TILE: tl.constexpr, BLOCK_C: tl.constexpr,
                                    BLOCK_S: tl.constexpr):
    # program ((call, sample), group). GROUPED: calls of one shape in one launch, call c's x and o
    # starting offsets[2c] and offsets[2c + 1] elements past x_ptr and o_ptr (multiples of ALIGN_X,
    # ALIGN_O: 16 bytes), its gradients CALL_STRIDE past the first call's; else one call (row = sample).
    # ONE_TILE: the group is one tile (CPG ≤ BLOCK_C, S ≤ BLOCK_S), read once
    pid = tl.program_id(0)
    groups = C // CPG
    row = pid // groups
    sample = (row % B).to(tl.int64)
    if GROUPED:
        call = row // B
        x_ptr, o_ptr = _call_inputs(x_ptr, o_ptr, offsets_ptr, call, ALIGN_X, ALIGN_O)
        weight_ptr += call.to(tl.int64) * CALL_STRIDE
        bias_ptr += call.to(tl.int64) * CALL_STRIDE
    first = (pid % groups) * CPG
    x_base = x_ptr + sample * stride_xb + first * stride_xc
    o_base = o_ptr + sample * stride_ob + first * stride_oc
    rc = tl.arange(0, BLOCK_C)
    rs = tl.arange(0, BLOCK_S)
    # every statistic of x − shift, shift the mean of the group's first tile (in fp32): x far from zero
    # (a mean of 100, say) would otherwise leave the mean rounded to x's ulp, and x − mean in pass 2
    # off by as much, which is most of a deviation where a group's values nearly coincide. A value
    # of the group would do that too, but x − shift rounds to the ulp of its size, and one value
    # may be an outlier; a mean lies among the values
    inside = (rc < CPG)[:, None] & (rs < S)[None, :]
    x = tl.load(x_base + rc[:, None] * stride_xc + rs[None, :], mask=inside, other=0.0).to(tl.float32)
    count = tl.sum(tl.sum(inside.to(tl.float32), axis=1), axis=0)
    shift = tl.sum(tl.sum(x, axis=1), axis=0) / count
    if ONE_TILE:  # (ResNet's groups: up to 2 channels × 1024 positions) the loops' arithmetic, x read once
        x = tl.where(inside, x - shift, 0.0)
        mean = tl.sum(tl.sum(x, axis=1), axis=0) / count
        deviation = tl.where(inside, x - mean, 0.0)
        correction = tl.sum(tl.sum(deviation, axis=1), axis=0) / count
        mean += correction
        deviation = tl.where(inside, deviation - correction, 0.0)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(tl.sum(deviation * deviation, axis=1), axis=0) / count + eps)
        o = tl.load(o_base + rc[:, None] * stride_oc + rs[None, :], mask=inside, other=0.0).to(tl.float32)
        in_c = rc < CPG
        out = sample * C + first + rc
        tl.store(weight_ptr + out, (tl.sum(o * tl.where(inside, x - mean, 0.0), axis=1) * rstd).to(
            weight_ptr.dtype.element_ty), mask=in_c)
        if HAS_BIAS:
            tl.store(bias_ptr + out, tl.sum(o, axis=1).to(bias_ptr.dtype.element_ty), mask=in_c)
        return
    # pass 1: the group's mean and sum of squared deviations, tile by tile (Chan et al.'s merge of
    # (count, mean, M2): no E[x²] − E[x]² cancellation)
    n = 0.0
    mean = 0.0
    m2 = 0.0
    for c0 in range(0, CPG, BLOCK_C):
        channels = c0 + rc
        for s0 in range(0, S, BLOCK_S):
            positions = s0 + rs
            inside = (channels < CPG)[:, None] & (positions < S)[None, :]
            x = tl.load(x_base + channels[:, None] * stride_xc + positions[None, :], mask=inside,
                        other=0.0).to(tl.float32)
            x = tl.where(inside, x - shift, 0.0)
            count = tl.sum(tl.sum(inside.to(tl.float32), axis=1), axis=0)
            tile_mean = tl.sum(tl.sum(x, axis=1), axis=0) / count
            deviation = tl.where(inside, x - tile_mean, 0.0)
            # corrected two-pass: the deviations' own sum fixes the rounding of the first sum
            correction = tl.sum(tl.sum(deviation, axis=1), axis=0) / count
            tile_mean += correction
            deviation = tl.where(inside, deviation - correction, 0.0)
            tile_m2 = tl.sum(tl.sum(deviation * deviation, axis=1), axis=0)
            delta = tile_mean - mean
            total = n + count
            mean += delta * (count / total)
            m2 += tile_m2 + delta * delta * (n * count / total)
            n = total
    rstd = 1.0 / tl.sqrt_rn(m2 / n + eps)
    # pass 2: per channel, Σ_s o·(x − mean) (scaled by rstd at the end) and Σ_s o
    for c0 in range(0, CPG, BLOCK_C):
        channels = c0 + rc
        in_c = channels < CPG
        acc_w = tl.zeros([BLOCK_C], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_C], dtype=tl.float32)
        for s0 in range(0, S, BLOCK_S):
            positions = s0 + rs
            inside = in_c[:, None] & (positions < S)[None, :]
            x = tl.load(x_base + channels[:, None] * stride_xc + positions[None, :], mask=inside,
                        other=0.0).to(tl.float32)
            o = tl.load(o_base + channels[:, None] * stride_oc + positions[None, :], mask=inside,
                        other=0.0).to(tl.float32)
            acc_w += tl.sum(o * tl.where(inside, (x - shift) - mean, 0.0), axis=1)
            if HAS_BIAS:
                acc_b += tl.sum(o, axis=1)
        out = sample * C + first + channels
        tl.store(weight_ptr + out, (acc_w * rstd).to(weight_ptr.dtype.element_ty), mask=in_c)
        if HAS_BIAS:
            tl.store(bias_ptr + out, acc_b.to(bias_ptr.dtype.element_ty), mask=in_c)


@register("group_norm_affine_grads", when=_same_dtypes)
def group_norm_affine_grads(x: torch.Tensor, o: torch.Tensor, num_groups: int, eps: float,
                            with_bias: bool) -> dict[str, torch.Tensor]:
    """A GroupNorm's (or InstanceNorm's, G = C) per-sample affine gradients in one launch: a program
    per (sample, group) reads x twice (the statistics, then the sums) and o once; x once where the
    group fits one tile (2,048 values: every group of ResNet-18-GN).

    Args:
        x: (B, C, *spatial) the layer's input (or (B, C)), fp32/fp16/bf16, any strides.
        o: like ``x``, of ``x``'s dtype, the gradient w.r.t. the layer's output.
        num_groups: G, dividing C; eps: the layer's ε; with_bias: also the bias's gradient.
    Returns:
        {"weight": (B, C)}, plus "bias" with ``with_bias``, in ``x``'s dtype, summed in fp32. Other
        dtypes run ``pdpfast.ops.norm.group_norm_affine_grads_reference``.
    """
    if not _same_dtypes(x, o):
        return group_norm_affine_grads_reference(x, o, num_groups, eps, with_bias)
    B, C = x.shape[0], x.shape[1]
    out = new_buffer((2 if with_bias else 1, B, C), x.dtype, x.device)
    S = x[0, 0].numel() if B and C else 0
    if B and C and not S:  # no positions: nothing to sum
        out.zero_()
    elif B and C:
        _group_norm_run(*_channel_rows(x, o, S), None, 1, out, num_groups, eps, with_bias)
    return _as_grads(out, with_bias)


def _channel_rows(x: torch.Tensor, o: torch.Tensor, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, C, S) views of a GroupNorm call's x and o, each channel's S positions contiguous (a copy
    where they are not)."""
    B, C = x.shape[0], x.shape[1]
    x3, o3 = x.reshape(B, C, S), o.reshape(B, C, S)
    x3 = x3 if x3.stride(2) == 1 or S == 1 else x3.contiguous()
    o3 = o3 if o3.stride(2) == 1 or S == 1 else o3.contiguous()
    return x3, o3


def _group_norm_run(x3: torch.Tensor, o3: torch.Tensor, offsets: torch.Tensor | None, n: int, out: torch.Tensor,
                    num_groups: int, eps: float, with_bias: bool) -> None:
    """One launch writing ``out`` ((n, planes, B, C) contiguous, or (planes, B, C) for n = 1) from n
    calls of (B, C, S) rows, call c's at ``offsets`` (``grouped_offsets``) past the first call's x3
    and o3 (None: n = 1)."""
    B, C, S = x3.shape
    cpg = C // num_groups
    block_s = block(S, 16, 1024)
    block_c = block(cpg, 1, max(1, 2048 // block_s))
    grouped = offsets is not None
    weight, bias = out.view(n, -1, B, C)[0, 0], out.view(n, -1, B, C)[0, -1]
    with device_guard(x3):
        _group_norm_affine_grads_kernel[(n * B * num_groups,)](
            x3, o3, offsets if grouped else x3, weight, bias, C, S, cpg, eps, x3.stride(0), x3.stride(1),
            o3.stride(0), o3.stride(1), B, out.numel() // n, HAS_BIAS=with_bias, GROUPED=grouped,
            ALIGN_X=16 // x3.element_size() if grouped else 1, ALIGN_O=16 // o3.element_size() if grouped else 1,
            ONE_TILE=cpg <= block_c and S <= block_s, BLOCK_C=block_c, BLOCK_S=block_s, num_warps=4)


@register("group_norm_affine_grads_grouped", when=_first_call_dtypes)
def group_norm_affine_grads_grouped(calls: list, num_groups: int, eps: float, with_bias: bool) -> list:
    """The per-sample affine gradients of n GroupNorm (or InstanceNorm) calls of one configuration,
    shape, strides and dtype, from one launch: program ((call, sample), group) finds its call's x and
    o at an offset from the first call's, read from a table of the n calls' offsets.

    One launch instead of n: a ResNet's GroupNorm calls come in runs of one shape (five a stage in
    ResNet-18), and a Triton launch took an H200's host ~0.1 ms.

    Args:
        calls: n ≥ 1 pairs (x, o) as ``group_norm_affine_grads`` takes them, of one shape, strides and
            dtype (the caller groups them so).
        num_groups, eps, with_bias: as in ``group_norm_affine_grads``, for every call.
    Returns:
        a list of n dicts, call c's what ``group_norm_affine_grads`` gives it (views of one buffer).
        Calls that cannot share a launch (an empty batch or no positions, calls not all of the first
        one's shape and dtype, positions not contiguous, strides not all the first call's, or a
        start off a 16-byte boundary: ``grouped_offsets``) run
        ``pdpfast.ops.norm.group_norm_affine_grads_grouped_reference`` (one launch each).
    """
    x0 = calls[0][0]
    B, C = x0.shape[0], x0.shape[1]
    S = x0[0, 0].numel() if B and C else 0
    if S and all(x.shape == x0.shape and _same_dtypes(x, o) for x, o in calls):
        rows = [(x.reshape(B, C, S), o.reshape(B, C, S)) for x, o in calls]
        offsets = None
        if S == 1 or all(x.stride(2) == 1 and o.stride(2) == 1 for x, o in rows):
            offsets = grouped_offsets(rows, 16)
        if offsets is not None:
            n = len(calls)
            out = new_buffer((n, 2 if with_bias else 1, B, C), x0.dtype, x0.device)
            _group_norm_run(*rows[0], offsets, n, out, num_groups, eps, with_bias)
            return [_as_grads(block, with_bias) for block in out.unbind(0)]
    return group_norm_affine_grads_grouped_reference(calls, num_groups, eps, with_bias)
