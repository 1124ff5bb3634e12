"""Per-sample gradient norms and clipped weighted gradients of a linear map (DESIGN.md §2).

Shapes: a (B, T, d) layer inputs, o (B, T, p) gradients of the summed loss w.r.t. the outputs.
The per-sample weight gradient is G_i = o_iᵀ a_i (p × d); it is formed only where that costs less
than the norms and the clipped-sum GEMM without it (``prefer_per_sample``).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .. import _ext
from . import clip as clip_ops
from . import workspace
from .clip import PendingWeights, clip_scale, weights_to
from .dispatch import declare, use_triton

# A chunk of per-sample work holds at most this many elements (~128 MiB in fp32), so the direct
# path never materializes B·p·d floats at once on large layers.
_CHUNK_ELEMENTS = 1 << 25


def acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype per-sample norms accumulate in: fp32 for fp16/bf16/fp32, fp64 kept for float64 oracles.

    Args:
        tensors: the op's inputs.
    Returns:
        torch.float64 if any of ``tensors`` is float64, else torch.float32.
    """
    # a plain comparison, not torch.promote_types: this runs for every layer of every backward
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


# the last weights cast by ``weights_as``: (source, dtype, cast), the source held so its id is not reused
_LAST_CAST: list = [None, None, None]


def weights_as(weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Clip weights in ``dtype``, cast once per backward: book-keeping hands the same (B,) weights to
    every layer call, and in a low precision each call would otherwise cast them again (one launch
    a call).

    Args:
        weights: (B,) clip weights w_i.
        dtype: the dtype of the call's gradients.
    Returns:
        ``weights`` where already of ``dtype``, else ``weights_to(weights, dtype)`` (toward zero in
        fp16, ``pdpfast.ops.clip.weights_to``; the tensor returned for the same ``weights`` and
        ``dtype`` before, where there is one).
    """
    if weights.dtype == dtype:
        return weights
    source, cast_dtype, cast = _LAST_CAST
    if source is weights and cast_dtype == dtype:
        return cast
    cast = weights_to(weights, dtype)
    _LAST_CAST[:] = weights, dtype, cast
    return cast


def gram_cost(T: int, d: int, p: int) -> int:
    """Multiply-adds per sample of the Gram (ghost) norm: two T×T Grams and their inner product.

    Args:
        T: positions (rows) per sample; d: input features; p: output features.
    Returns:
        T²·(d + p + 1), an int.
    """
    return T * T * (d + p + 1)


def direct_cost(T: int, d: int, p: int) -> int:
    """Multiply-adds per sample of the direct norm: materialize G_i = o_iᵀ a_i and square it.

    Args:
        T: positions (rows) per sample; d: input features; p: output features.
    Returns:
        T·d·p + d·p, an int.
    """
    return T * d * p + d * p


def use_gram(T: int, d: int, p: int) -> bool:
    """Per call (T varies between calls), the cheaper of the two exact norm computations.

    Args:
        T: positions (rows) per sample; d: input features; p: output features.
    Returns:
        True when the Gram norm costs fewer multiply-adds than the direct one (``gram_cost`` <
        ``direct_cost``; a tie goes to direct).
    """
    return gram_cost(T, d, p) < direct_cost(T, d, p)


# The norm kernels' Gram path multiplies T×T tiles on the tensor cores and gets more of the GPU's
# pace per multiply-add than their direct path. On an H200 (bench_kernels-NVIDIA_H200.json,
# 2026-11-29), at GPT-2 small's 768→768 calls (B, T, d, p) = (8, 512, 768, 768), where the Gram form
# takes 1.33× the direct form's multiply-adds, the Gram path ran 1.24× (bf16: 0.083 ms against
# 0.103) and 1.38× (fp32, tf32x3: 0.134 against 0.184) faster than the direct one, and faster than
# torch's reference (0.249 and 0.168 ms) where the direct one was not (fp32). No measured shape had
# the direct path ahead of the Gram path where both ran: the kernels take the Gram path up to this
# ratio of multiply-adds, below the ~1.65-1.8 the H200 puts the break-even at.
KERNEL_GRAM_RATIO = 1.5


def kernel_uses_gram(T: int, d: int, p: int) -> bool:
    """Whether the norm kernels (``pdpfast.kernels.norms``) take their Gram path for a call with
    T > 1: the Gram form's multiply-adds below ``KERNEL_GRAM_RATIO`` times the direct form's.

    Args:
        T: positions (rows) per sample; d: input features; p: output features.
    Returns:
        a bool (``use_gram`` weighs the two forms as the CPU's reference computes them).
    """
    return gram_cost(T, d, p) < KERNEL_GRAM_RATIO * direct_cost(T, d, p)


# Without the kernels (the CPU path), a layer call's per-sample gradients are formed and kept when
# they hold at most this many times the values book-keeping keeps for the call anyway (its input
# and output gradient). Their norms then cost one pass over them, and the clipped sum becomes the
# B×|W| product w·G instead of a second GEMM-sized pass over the activations (B·T·d·p multiply-adds
# for a linear layer): one GEMM-sized pass per layer instead of two. The bound also keeps the
# per-sample GEMMs large enough to run near a GEMM's pace (d·p ≤ 4·T·(d + p) for a linear layer).
MATERIALIZE_RATIO = 4
# ... or when they are this small whatever the activations (32 MiB in fp32: e.g. the last
# convolutions of a CNN, whose weights outweigh their few output positions). Either way, at most
# ``workspace.MAX_BYTES`` of them are kept at once; later calls of the backward take the other route.
MATERIALIZE_MIN_ELEMENTS = 1 << 23


# On a GPU (where the kernels run), per-layer clipping may still form a call's per-sample gradients:
# it clips them at once and frees them, so they never add up over layers. They then replace the
# norm's multiply-adds (B·min(Gram, direct), Gram split or not) with three passes over B·|W| values
# (written by the per-sample GEMM, read by the norm, read by the weighted sum, which replaces the
# clipped-sum GEMM of the same multiply-adds as the per-sample one). Which is faster depends on
# how many FLOPs the GPU does in the time it moves a byte: about 20 in fp32 without tensor cores
# and 10 in fp64 (H100 SXM datasheet: 67 and 34 TFLOP/s, 3.35 TB/s). In fp16/bf16 the datasheet's
# ~300 (989 TFLOP/s) is more than the norm kernels reach: the captured times of both routes on an
# H100 (``python -m bench.bench_kernels --ops per_layer_route``, 2026-11-24) put the balance where
# the picks are right between 107 (GPT-2's 3072→768 call, T = 512: norms 0.091 ms, per-sample
# 0.142) and 171 (its 768→768 call: norms 0.087 ms on the direct path, per-sample 0.061); 128.
# It picks forming them for GPT-2's fp32 calls (T = 512) and its bf16 768→768 call, and nowhere
# for BERT-base (T = 128).
GPU_FLOPS_PER_BYTE = {torch.float32: 20, torch.float16: 128, torch.bfloat16: 128, torch.float64: 10}
# Those picks weigh GPU time alone. An eager step's host issues every op as well, and forming a call's
# per-sample gradients takes ~9.6 more ops than its norms and clipped sum do (GPT-2 small at batch 8
# in bf16, counted on the CPU with the GPU's kernel choices: per-layer's step issues 1,233 launches
# with its twelve 768→768 calls formed, 1,118 with them in its norm launches; bk's 1,130), ~220 µs of
# host time at the H200 host's ~23 µs an op, where forming saves that call 26 µs of GPU time
# (captured, H200: 0.054 against 0.080 ms). Which side limits a step depends on its dtype: the eager
# fp32 steps of BERT-base and GPT-2 small are GPU-bound (H200, 2026-11-30: 0.93-0.94× the non-private
# step), their bf16 steps host-bound (0.62-0.73: per-layer's GPT-2 step took 51.6 ms of host time,
# 8.5 more than bk's). So where the host is the limit (an eager step in a low precision), forming
# must also save the host time of those ops, here in the bytes the GPU moves meanwhile (9 ops × 23 µs
# at the H100's 3.35 TB/s); in a CUDA graph's capture, whose replays issue no op from the host (it
# asks every call afresh: ``ClippingState._route``), and in fp32 and fp64, GPU time alone decides.
HOST_BOUND_DTYPES = frozenset({torch.float16, torch.bfloat16})
FORM_HOST_BYTES = int(9 * 23e-6 * 3.35e12)


def norm_madds(B: int, T: int, d: int, p: int, device: torch.device) -> int:
    """Multiply-adds of a call's exact norms as ``linear_sq_norms_reference`` computes them.

    Args:
        B: samples; T: positions per sample; d: input features; p: output features; device: where
            the products run (the Gram form is split on a GPU only for large calls, ``split_gram``).
    Returns:
        B·min(``gram_cost``, ``direct_cost``), the Gram's three quarters when ``split_gram`` splits it.
    """
    if T == 1:
        return B * (d + p)
    if not use_gram(T, d, p):
        return B * direct_cost(T, d, p)
    cost = B * gram_cost(T, d, p)
    return 3 * cost // 4 if split_gram(B, T, d, p, device) else cost


def prefer_per_sample(per_sample_elements: int, x: torch.Tensor, o: torch.Tensor, *, kept: bool = True,
                      norm_cost: Callable[[], int] | None = None) -> bool:
    """Whether a call whose per-sample gradients take ``per_sample_elements`` values (B·|W|) should
    form them.

    Without the kernels (the CPU path): where they are small next to the call (``MATERIALIZE_RATIO``).
    Where a kernel computes the norms (a GPU): never when they would be kept to the end of the
    backward (book-keeping: memory is the scarce resource, and the fused norm kernels form no
    per-sample gradient); when they are clipped at once and freed (per-layer clipping), where the
    norm's multiply-adds take longer than three passes over them (``GPU_FLOPS_PER_BYTE``) and, in an
    eager step of a low precision, than the host's extra ops as well (``FORM_HOST_BYTES``).

    Args:
        per_sample_elements: B·|W|, the number of values of the call's per-sample gradients.
        x: the layer call's input (any shape), kept by book-keeping anyway.
        o: the gradient w.r.t. the call's output (any shape); its element size prices the gradients.
        kept: they would be kept until every layer's norms are known (flat clipping); False: clipped
            and freed at once (per-layer clipping).
        norm_cost: () → multiply-adds of the call's norms without them (``norm_madds``), called only
            where the kernels run; None: unknown (then never formed on a GPU).
    Returns:
        False where they would take ``workspace.lent_bytes()`` (CPU) past ``workspace.MAX_BYTES``;
        where the kernels run (``use_triton(x, o)``), ``not kept`` and 2·``norm_cost()`` >
        (3·``per_sample_elements``·(element size) + h)·``GPU_FLOPS_PER_BYTE``, h =
        ``FORM_HOST_BYTES`` for a ``HOST_BOUND_DTYPES`` o outside a CUDA graph's capture, else 0; else whether
        ``per_sample_elements`` ≤ max(``MATERIALIZE_MIN_ELEMENTS``, ``MATERIALIZE_RATIO`` · (x.numel() + o.numel())).
    """
    nbytes = per_sample_elements * o.element_size()
    if use_triton(x, o):  # never where they would be kept; else where the norm costs more (``kept`` first)
        if kept or norm_cost is None or o.dtype not in GPU_FLOPS_PER_BYTE:
            return False
        host = FORM_HOST_BYTES if o.dtype in HOST_BOUND_DTYPES and not _capturing(o) else 0
        if 2 * norm_cost() <= (3 * nbytes + host) * GPU_FLOPS_PER_BYTE[o.dtype]:
            return False
    elif per_sample_elements > max(MATERIALIZE_MIN_ELEMENTS, MATERIALIZE_RATIO * (x.numel() + o.numel())):
        return False
    return workspace.lent_bytes() + nbytes <= workspace.MAX_BYTES


def _capturing(o: torch.Tensor) -> bool:
    """Whether ``o``'s device is capturing a CUDA graph on its current stream (its replays issue no op
    from the host: ``prefer_per_sample`` weighs GPU time alone there, ``groups_norms`` shares no launch)."""
    return o.is_cuda and torch.cuda.is_current_stream_capturing()


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def linear_weight_sq_norms_reference(a: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """‖o_iᵀ a_i‖²_F per sample, in plain torch (the weight only; see ``linear_sq_norms_reference``).

    Args:
        a: (B, T, d) layer inputs.
        o: (B, T, p) gradients of the summed loss w.r.t. the layer outputs.
    Returns:
        (B,) in the accumulation dtype (``acc_dtype``: fp32, or fp64 for fp64 inputs).
    """
    return linear_sq_norms_reference(a, o, with_bias=False)


def linear_sq_norms_reference(a: torch.Tensor, o: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
    """‖o_iᵀ a_i‖²_F (+ ‖Σ_t o_{i,t}‖² with_bias) per sample, in plain torch.

    The bias is a weight on a constant input 1, so its norm joins the weight's in the same Gram:
    ‖G_i‖² + ‖b_i‖² = Σ_{s,t} (a_i a_iᵀ + 1)_{st} (o_i o_iᵀ)_{st}, and (‖a_i‖² + 1)‖o_i‖² for T = 1.
    Per call, the Gram or the direct form (``use_gram``), over chunks of samples when the batch's
    work would exceed ``_CHUNK_ELEMENTS`` values at once.

    Args:
        a: (B, T, d) layer inputs.
        o: (B, T, p) gradients of the summed loss w.r.t. the layer outputs.
        with_bias: add the bias's ‖Σ_t o_{i,t}‖².
    Returns:
        (B,) in the accumulation dtype (``acc_dtype``: fp32, or fp64 for fp64 inputs).
    """
    B, T, d = a.shape
    p = o.shape[-1]
    dtype = acc_dtype(a, o)
    if B == 0:
        return torch.empty(0, dtype=dtype, device=a.device)
    if T == 1:  # ‖o aᵀ‖² = ‖o‖²‖a‖² for a rank-one per-sample gradient
        sq_a = _as(a[:, 0], dtype).pow(2).sum(-1)
        return (sq_a.add_(1.0) if with_bias else sq_a).mul_(_as(o[:, 0], dtype).pow(2).sum(-1))
    gram = use_gram(T, d, p)
    per_sample = 2 * T * T if gram else d * p

    def norms(a, o):
        a, o = _as(a, dtype), _as(o, dtype)
        if gram:
            return _gram_sq_norms(a, o, with_bias)
        out = torch.bmm(o.transpose(1, 2), a).pow(2).sum((1, 2))
        return out.add_(o.sum(1).pow(2).sum(-1)) if with_bias else out

    if B * per_sample <= _CHUNK_ELEMENTS:  # the usual case: one chunk, no copy
        return norms(a, o)
    out = torch.empty(B, dtype=dtype, device=a.device)
    for s in workspace.batch_chunks(B, per_sample, _CHUNK_ELEMENTS):
        out[s] = norms(a[s], o[s])
    return out


# Split in halves of T, the Gram norm forms three of its four blocks: a quarter fewer multiply-adds
# for eleven more launches (fifteen: nine products and their sums, instead of three and one). It
# pays where the work saved outweighs their host time: a launch issued from Python costs tens of µs
# of host time on a GPU machine (the non-private BERT-base step issues 882 kernels in 33 ms on the
# H100's host, bench/README.md), in which cuBLAS does ~10⁸-10⁹ fp32 multiply-adds, and ~1-2 µs on a
# CPU core, ~10⁵. Minimum multiply-adds saved per call, by device type (an estimate, not measured):
SPLIT_GRAM_MIN_SAVED = {"cuda": 1 << 30, "cpu": 1 << 20}


def split_gram(B: int, T: int, d: int, p: int, device: torch.device) -> bool:
    """Whether a call's Gram norm is formed in blocks of half the positions (``_gram_sq_norms``).

    Args:
        B: samples; T: positions per sample; d: input features; p: output features;
        device: where the products run.
    Returns:
        True when T ≥ 64 and the multiply-adds saved, B·T²·(d + p + 1)/4, reach
        ``SPLIT_GRAM_MIN_SAVED`` for the device's type (the CPU's value for any other type). On a
        GPU this keeps BERT-base's calls (T = 128) whole, where the step is host-bound, and splits
        GPT-2's wide ones (T = 512).
    """
    saved = B * T * T * (d + p + 1) // 4
    return T >= 64 and saved >= SPLIT_GRAM_MIN_SAVED.get(device.type, SPLIT_GRAM_MIN_SAVED["cpu"])


def _gram_sq_norms(a: torch.Tensor, o: torch.Tensor, with_bias: bool = False) -> torch.Tensor:
    """Σ_{s,t} (a aᵀ [+ 1])_{st} (o oᵀ)_{st} per sample. Both Grams are symmetric, so with T split in
    halves (where ``split_gram`` says it pays) only three of the four blocks are formed (the
    off-diagonal one counts twice)."""
    B, T = a.shape[0], a.shape[1]

    def block(x, y, u, v):
        gram_a = torch.bmm(x, y.transpose(1, 2))
        if with_bias:
            gram_a.add_(1.0)
        gram_o = torch.bmm(u, v.transpose(1, 2))
        # Σ_st of the elementwise product as one batched dot product
        return torch.bmm(gram_a.view(B, 1, -1), gram_o.view(B, -1, 1)).view(B)

    if not split_gram(B, T, a.shape[2], o.shape[2], a.device):
        return block(a, a, o, o)
    h = T // 2
    a1, a2, o1, o2 = a[:, :h], a[:, h:], o[:, :h], o[:, h:]
    return block(a1, a1, o1, o1) + 2 * block(a1, a2, o1, o2) + block(a2, a2, o2, o2)


def bias_sq_norms_reference(o: torch.Tensor) -> torch.Tensor:
    """‖Σ_t o_{i,t}‖² per sample, the squared norm of a linear layer's bias gradient, in plain torch.

    Args:
        o: (B, T, p) gradients of the summed loss w.r.t. the layer outputs.
    Returns:
        (B,) in the accumulation dtype (``acc_dtype``: fp32, or fp64 for fp64 ``o``).
    """
    return _as(o, acc_dtype(o)).sum(1).pow(2).sum(-1)


def linear_sq_norms_rounding_reference(a: torch.Tensor, o: torch.Tensor, with_bias: bool, u: float):
    """(``linear_sq_norms(a, o, with_bias)``, ``scaled_sum_rounding(a, o, with_bias, u)``), computed apart.

    Args:
        a: (B, T, d) layer inputs.
        o: (B, T, p) gradients of the summed loss w.r.t. the layer outputs.
        with_bias: the bias is among the call's parameters.
        u: the unit roundoff of the clipped sum's row scaling.
    Returns:
        (sq, rho), each (B,) in the accumulation dtype (``acc_dtype``).
    """
    return linear_sq_norms(a, o, with_bias), scaled_sum_rounding(a, o, with_bias, u)


def linear_sq_norms_grouped_reference(calls: list, with_bias: bool, u: float = 0.0):
    """Squared norms (and rounding bounds) of n linear calls of one batch, sequence length and dtype,
    one call at a time.

    Args:
        calls: n ≥ 1 pairs (a (B, T, d) inputs, o (B, T, p) output gradients) of one B, T and dtype.
        with_bias: the calls' bias is among their parameters.
        u: the unit roundoff of the clipped sums' row scaling; 0: no rounding bound.
    Returns:
        (sq, rho): (n, B, 1) each, row c call c's per-sample squared norms and its ρ_i
        (``scaled_sum_rounding``); rho None where ``u`` is 0.
    """
    if u:
        pairs = [linear_sq_norms_rounding(a, o, with_bias, u) for a, o in calls]
        return torch.stack([sq for sq, _ in pairs]).unsqueeze(2), torch.stack([rho for _, rho in pairs]).unsqueeze(2)
    return torch.stack([linear_sq_norms(a, o, with_bias) for a, o in calls]).unsqueeze(2), None


_LINEAR_WEIGHT_SQ_NORMS = declare("linear_weight_sq_norms", linear_weight_sq_norms_reference)
_BIAS_SQ_NORMS = declare("bias_sq_norms", bias_sq_norms_reference)
_LINEAR_SQ_NORMS_ROUNDING = declare("linear_sq_norms_rounding", linear_sq_norms_rounding_reference)
_LINEAR_SQ_NORMS_GROUPED = declare("linear_sq_norms_grouped", linear_sq_norms_grouped_reference)


def groups_norms(a: torch.Tensor, o: torch.Tensor) -> bool:
    """Whether a linear call's norms would take the grouped kernel (``linear_sq_norms_grouped``):
    where the norm kernel's Gram path runs (on a GPU, or under ``TRITON_INTERPRET=1``), outside a
    CUDA graph capture (the launch copies the calls' offsets from the host: a captured step has no
    host work to save anyway).

    Args:
        a: (B, T, d) the call's input; o: (B, T, p) its output gradient.
    Returns:
        a bool.
    """
    if _LINEAR_SQ_NORMS_GROUPED.pick(a, o) is _LINEAR_SQ_NORMS_GROUPED.reference:
        return False
    return not _capturing(o)


def linear_sq_norms_grouped(calls: list, with_bias: bool, u: float = 0.0):
    """Squared norms (and rounding bounds) of n linear calls of one batch, sequence length and dtype,
    of any widths, from one kernel launch where ``groups_norms`` holds for them, instead of one per call.

    Args:
        calls: n ≥ 1 pairs (a (B, T, d) inputs, o (B, T, p) output gradients) of one B, T and dtype.
        with_bias: the calls' bias is among their parameters.
        u: the unit roundoff of the clipped sums' row scaling (``pdpfast.nn.rules.scaling_roundoff``);
            0: no rounding bound.
    Returns:
        (sq, rho): (n, B, K) partial sums each, row c what call c alone would give with ``parts``
        (``linear_sq_norms_rounding``): sums over K are its per-sample squared norms and its ρ_i
        (K = 1 from the reference); rho None where ``u`` is 0.
    """
    a, o = calls[0]
    return _LINEAR_SQ_NORMS_GROUPED.pick(a, o)(calls, with_bias, u)


def linear_weight_sq_norms(a: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """‖o_iᵀ a_i‖²_F per sample: the kernel where it is registered to win (fp16/bf16 on CUDA), else the reference.

    Args:
        a: (B, T, d) layer inputs.
        o: (B, T, p) gradients of the summed loss w.r.t. the layer outputs.
    Returns:
        (B,) fp32 (fp64 for fp64 inputs).
    """
    return _LINEAR_WEIGHT_SQ_NORMS.pick(a, o)(a, o)


def bias_sq_norms(o: torch.Tensor) -> torch.Tensor:
    """‖Σ_t o_{i,t}‖² per sample: the kernel where it is registered to win, else the reference.

    Args:
        o: (B, T, p) gradients of the summed loss w.r.t. the layer outputs.
    Returns:
        (B,) fp32 (fp64 for fp64 ``o``).
    """
    return _BIAS_SQ_NORMS.pick(o)(o)


def linear_sq_norms(a: torch.Tensor, o: torch.Tensor, with_bias: bool, parts: bool = False) -> torch.Tensor:
    """Per-sample squared norm of a linear layer's weight (+ bias) gradient, dispatched like
    ``linear_weight_sq_norms``.

    Both forms take the bias into the weight's Gram (``linear_sq_norms_reference``; the kernel does
    it in the same launch on its rank-one and Gram paths).

    Args:
        a: (B, T, d) layer inputs.
        o: (B, T, p) gradients of the summed loss w.r.t. the layer outputs.
        with_bias: add the bias's ‖Σ_t o_{i,t}‖².
        parts: the caller sums the result's rows itself (book-keeping sums every layer's partial
            sums at once, at the end of the backward): the kernel's per-program partial sums are
            returned as they are, saving a launch per call.
    Returns:
        (B,) fp32 (fp64 for fp64 inputs); with ``parts``, (B, K) whose row sums are those norms
        (K = 1 where the reference runs).
    """
    fn = _LINEAR_WEIGHT_SQ_NORMS.pick(a, o)
    if fn is _LINEAR_WEIGHT_SQ_NORMS.reference:
        sq = linear_sq_norms_reference(a, o, with_bias)
        return sq.unsqueeze(1) if parts else sq
    return fn(a, o, with_bias=with_bias, parts=parts)


def linear_sq_norms_rounding(a: torch.Tensor, o: torch.Tensor, with_bias: bool, u: float, parts: bool = False):
    """A linear call's per-sample squared norms and its clipped sum's rounding bound at once: one
    launch where the norm kernel's rank-one or Gram path runs (it reads the row norms ρ needs off
    its Grams' diagonals), else the two apart (``linear_sq_norms_rounding_reference``).

    Args:
        a: (B, T, d) layer inputs.
        o: (B, T, p) gradients of the summed loss w.r.t. the layer outputs.
        with_bias: the bias is among the call's parameters (its norm added, and its constant input 1
            in ρ's √(‖a_t‖² + 1)).
        u: the unit roundoff of the clipped sum's row scaling (``pdpfast.nn.rules.scaling_roundoff``).
        parts: the caller sums the results' rows itself (as in ``linear_sq_norms``): where the kernel
            runs, both are returned as its (B, K) per-program partial sums, saving the launch that sums them.
    Returns:
        (sq, rho): ``linear_sq_norms(a, o, with_bias)`` and ``scaled_sum_rounding(a, o, with_bias, u)``,
        each (B,) fp32 (fp64 for fp64 inputs); with ``parts``, each (B, K) where the kernel runs.
    """
    fn = _LINEAR_SQ_NORMS_ROUNDING.pick(a, o)
    if fn is _LINEAR_SQ_NORMS_ROUNDING.reference:
        return fn(a, o, with_bias, u)
    return fn(a, o, with_bias, u, parts=parts)


def linear_clipped_grads(a: torch.Tensor, o: torch.Tensor, weights: torch.Tensor | PendingWeights | None,
                         need_weight: bool = True, need_bias: bool = False, transposed: bool = False):
    """(Σ_i w_i o_iᵀ a_i, Σ_i w_i Σ_t o_{i,t}): the clipped weight and bias gradients of a linear layer.

    The weight gradient is the ordinary weight-gradient GEMM (cuBLAS on a GPU) over the B·T rows
    once one operand's rows are scaled by their sample's w_i: the narrower one is scaled, and the
    bias reuses it when it is o. ``transposed`` returns the (d, p) weight gradient (Hugging Face's
    Conv1D) from the same GEMM with its operands swapped, never through a transpose copy.

    Args:
        a: (B, T, d) layer inputs (also (B, d), or (B, ..., d) matching ``o``).
        o: (B, T, p) gradients of the summed loss w.r.t. the layer outputs, same dtype as ``a``.
        weights: (B,) clip weights w_i, or None for the plain sums, or ``PendingWeights``: computed
            by the op that scales the rows (``pdpfast.ops.clip.clip_scale``).
        need_weight: compute the weight gradient.
        need_bias: compute the bias gradient.
        transposed: the weight gradient as (d, p) instead of (p, d).
    Returns:
        (grad_w, grad_b): grad_w (p, d) ((d, p) when ``transposed``) and grad_b (p,), in ``o``'s dtype;
        each None when not needed.
    """
    d, p = a.shape[-1], o.shape[-1]
    scale_o = weights is not None and (p <= d or not need_weight)
    if isinstance(weights, PendingWeights):  # computed and applied in one op
        scaled, weights = clip_scale(o if scale_o else a, weights)
        o, a = (scaled, a) if scale_o else (o, scaled)
    elif weights is not None:
        w = weights_as(weights, o.dtype).view(-1, *([1] * (o.dim() - 1)))
        o, a = (o * w, a) if scale_o else (o, a * w)
    a2, o2 = a.reshape(-1, d), o.reshape(-1, p)
    grad_w = grad_b = None
    if need_weight:
        grad_w = a2.t().mm(o2) if transposed else o2.t().mm(a2)
    if need_bias and (weights is None or scale_o):
        grad_b = o2.sum(0)
    elif need_bias:
        per_sample = o.flatten(1, -2).sum(1) if o.dim() > 2 else o  # (B, p): Σ_t o_{i,t}
        grad_b = weights_as(weights, o.dtype) @ per_sample
    return grad_w, grad_b


_INTO_MISSING = _ext.missing("linear_clipped_into", "linear_sums.cpp")


def linear_clipped_into_route() -> str:
    """Where ``linear_clipped_into`` runs (``pdpfast info``).

    Returns:
        "C++ (pdpfast._C)", or "Python (<why>)" where the extension lacks it (every call then takes
        ``linear_clipped_grads``).
    """
    return "C++ (pdpfast._C)" if _INTO_MISSING is None else f"Python ({_INTO_MISSING})"


def linear_clipped_into(x: torch.Tensor, o: torch.Tensor, weights: torch.Tensor | PendingWeights | None,
                        weight: torch.Tensor | None, bias: torch.Tensor | None, transposed: bool = False) -> bool:
    """``linear_clipped_grads`` with the sums added into ``weight.grad`` and ``bias.grad`` as the clipping
    state adds them (cast to the parameter's dtype, set where it has none), in one call of
    ``pdpfast._C`` (``csrc/linear_sums.cpp``): the same torch ops in the same order, so the same bits,
    with none of the Python between them. A book-keeping backward runs it for every linear call, per-layer
    clipping once per call; the host time it saves is the interpreter's, per call.

    Args:
        x: the call's input, (B, ..., d), in ``o``'s dtype.
        o: its output gradient, B·T·p values ((B·T, p) or (B, ..., p)).
        weights: (B,) clip weights (any float dtype: cast to ``o``'s as ``weights_as`` casts), or
            ``PendingWeights`` (then computed by the op that scales the rows, ``clip_scale``).
        weight, bias: the parameters whose clipped sums are wanted ((p, d), or (d, p) when
            ``transposed``; (p,)), each None where the call does not train it.
        transposed: the weight is stored (d, p) (Hugging Face's Conv1D).
    Returns:
        True where it ran; False where the extension lacks it, grad mode is on (a backward with
        ``create_graph=True``), ``weights`` is None, x and o differ in dtype, or pending weights'
        ``clip_scale`` would not take its C++ route (``clip_scale_route``): nothing was done, and the
        caller runs ``linear_clipped_grads``.
    """
    if _INTO_MISSING is not None or weights is None or torch.is_grad_enabled() or x.dtype != o.dtype:
        return False
    if isinstance(weights, PendingWeights):
        # (x has the B rows the route checks, in o's dtype; it is on o's device)
        if clip_ops.clip_scale_route(x, weights) != clip_ops._FUSED:
            return False
        _ext._C.linear_clip_scale_into(x, o, weight, bias, transposed, *clip_ops.fused_scale_args(weights))
    else:
        _ext._C.linear_clipped_into(x, o, weight, bias, transposed, weights_as(weights, o.dtype))
    return True


def linear_clipped_into_calls(calls: list, weights: list, transposed: bool = False) -> bool:
    """``linear_clipped_into`` for several calls at once: the calls of one group key
    (``pdpfast.nn.rules.Grouped``), whose routes are checked on the first call alone, and no Python
    between the calls' ``pdpfast._C`` ops. Each call's ops and their order are those of its own
    ``linear_clipped_into``, so the same bits. Per-layer clipping runs it for a run of consecutive
    calls, book-keeping for each group at the end of its backward.

    Args:
        calls: [(x, o, weight, bias)], as in ``linear_clipped_into``; all of one dtype (x in o's) and
            device, and of one batch size.
        weights: one per call, all (B,) tensors or all ``PendingWeights`` of norms of one dtype and
            layout (one launch's); a tensor may recur (book-keeping's one set of weights).
        transposed: the weights are stored (d, p) (Hugging Face's Conv1D).
    Returns:
        True where it ran; False, with nothing done, where the first call would not take the C++ route
        (``linear_clipped_into``'s conditions): each call then takes its own.
    """
    x, o = calls[0][0], calls[0][1]
    w = weights[0]
    if _INTO_MISSING is not None or w is None or torch.is_grad_enabled() or x.dtype != o.dtype:
        return False
    if isinstance(w, PendingWeights):
        if clip_ops.clip_scale_route(x, w) != clip_ops._FUSED:
            return False
        into = _ext._C.linear_clip_scale_into
        for (x, o, weight, bias), w in zip(calls, weights):
            into(x, o, weight, bias, transposed, *clip_ops.fused_scale_args(w))
        return True
    into, dtype = _ext._C.linear_clipped_into, o.dtype
    for (x, o, weight, bias), w in zip(calls, weights):
        into(x, o, weight, bias, transposed, weights_as(w, dtype))
    return True


_ONE = torch.ones(())  # a 0-dim CPU tensor: ops on any device take it as a scalar, with no copy


def scaled_sum_rounding(a: torch.Tensor | None, o: torch.Tensor, with_bias: bool, u: float) -> torch.Tensor:
    """u·Σ_t ‖o_t‖·√(‖a_t‖² + [with_bias]) per sample: a clipped sum that rounds each scaled row
    w_i·o_t (or w_i·a_t) to a relative u is within w_i times this of w_i·g_i.

    Args:
        a: (B, T, d) layer inputs, or None when only the bias's sum is computed (then u·Σ_t ‖o_t‖).
        o: (B, T, p) output gradients.
        with_bias: the sum includes the bias (a weight on a constant input 1).
        u: the unit roundoff of the scaling.
    Returns:
        (B,) in the accumulation dtype (``acc_dtype``); four or five ops (this runs for every layer
        call of a low-precision backward), no (B, T, ·) temporary.
    """
    acc = acc_dtype(o)
    terms = torch.linalg.vector_norm(o, dim=-1, dtype=acc)  # (B, T)
    if a is None:
        return terms.sum(-1).mul_(u)
    size = torch.linalg.vector_norm(a, dim=-1, dtype=acc)
    if with_bias:
        size = torch.hypot(size, _ONE)
    return scaled_row_dot(terms, size, u)


# A rounding bound computed from TF32 products (each operand rounded to 10 bits: by at most 2^-10
# relative, truncated) can come out low by (1 + 2^-10)^2 - 1 < 2^-8.9 relative: scaled by this, a bound
# stays a bound (the linear norm kernel's fused ρ, and the torch routes where cuBLAS or cuDNN take TF32).
TF32_SLACK = 1 + 2.0 ** -8


def tf32_allowed(kind: str) -> bool:
    """Whether torch lets fp32 products take TF32 on a GPU.

    Reads torch's legacy flag (``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``)
    or, where a user set the newer ``fp32_precision`` settings (torch ≥ 2.9), which make reading the
    legacy flag raise, those: "ieee" is no, "tf32" yes, "none" their parent's. Unknown: yes (a bound
    then grows, the safe side).

    Args:
        kind: "matmul" (cuBLAS GEMMs) or "conv" (cuDNN convolutions).
    Returns:
        a bool.
    """
    backends = torch.backends
    legacy = backends.cuda.matmul if kind == "matmul" else backends.cudnn
    try:
        return bool(legacy.allow_tf32)
    except RuntimeError:  # the fp32_precision settings are in use (mixing them with the legacy flag raises)
        pass
    chain = (backends.cuda.matmul,) if kind == "matmul" else (getattr(backends.cudnn, "conv", None), backends.cudnn)
    for holder in (*chain, backends):
        precision = getattr(holder, "fp32_precision", "none")
        if precision in ("ieee", "tf32"):
            return precision == "tf32"
    return True


def tf32_slack(t: torch.Tensor, kind: str) -> float:
    """The factor a rounding bound computed by products on ``t`` needs (``TF32_SLACK``), or 1.0.

    Args:
        t: a tensor the products read (its dtype and device).
        kind: which products: "matmul" (cuBLAS) or "conv" (cuDNN) (``tf32_allowed``, read only for
            CUDA fp32).
    Returns:
        ``TF32_SLACK`` for CUDA fp32 where torch lets those products take TF32, else 1.0.
    """
    return TF32_SLACK if t.is_cuda and t.dtype == torch.float32 and tf32_allowed(kind) else 1.0


def scaled_row_dot(x: torch.Tensor, y: torch.Tensor, u: float) -> torch.Tensor:
    """u·Σ_t x_{i,t} y_{i,t} per row i, in one op (a batched GEMM whose α is u), never below it: where
    the GEMM may take TF32 the scale grows by ``TF32_SLACK`` (the result is a rounding bound).

    Args:
        x, y: (B, T) of one dtype and device, ≥ 0.
        u: the scale.
    Returns:
        (B,).
    """
    if x.shape[1] == 0:
        return x.new_zeros(x.shape[0])
    u *= tf32_slack(x, "matmul")
    # β = 0: baddbmm ignores its input, which need only broadcast to (B, 1, 1)
    return torch.baddbmm(x[:, None, :1], x.unsqueeze(1), y.unsqueeze(2), beta=0, alpha=u).view(x.shape[0])


def linear_clipped_grads_stacked(a: torch.Tensor, o: torch.Tensor, weights: torch.Tensor, need_weight: bool,
                                 need_bias: bool, transposed: bool = False):
    """``linear_clipped_grads`` of n same-shape layer calls at once: one batched GEMM (cuBLAS) for the
    n weight gradients.

    Args:
        a: (n, B, T, d) the calls' inputs, stacked (viewed as (n, B·T, d): contiguous).
        o: (n, B, T, p) the gradients w.r.t. their outputs, stacked.
        weights: (B,) clip weights shared by the calls, or (n, B) one row per call.
        need_weight: compute the weight gradients.
        need_bias: compute the bias gradients.
        transposed: weight gradients as (d, p) instead of (p, d).
    Returns:
        (grad_w, grad_b): grad_w (n, p, d) ((n, d, p) when ``transposed``) and grad_b (n, p), in ``o``'s
        dtype; each None when not needed.
    """
    n, B, T, d = a.shape
    p = o.shape[-1]
    w = weights_as(weights, o.dtype)
    scaled = (o * w.view(n if w.dim() == 2 else 1, B, 1, 1)).view(n, B * T, p)
    a = a.view(n, B * T, d)
    grad_w = None
    if need_weight:
        grad_w = torch.bmm(a.transpose(1, 2), scaled) if transposed else torch.bmm(scaled.transpose(1, 2), a)
    return grad_w, scaled.sum(1) if need_bias else None


def linear_per_sample_grads(a: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """Materialized per-sample weight gradients o_iᵀ a_i, in a buffer of ``workspace`` (the clipping
    state returns it when done).

    Args:
        a: (B, T, d) layer inputs.
        o: (B, T, p) gradients of the summed loss w.r.t. the layer outputs.
    Returns:
        (B, p, d) in the promoted dtype of ``a`` and ``o``, on ``o``'s device. (Called as (o, a), it
        gives the (B, d, p) gradients of a weight stored (in, out).)
    """
    out = workspace.empty((a.shape[0], o.shape[-1], a.shape[-1]), torch.promote_types(a.dtype, o.dtype), o.device)
    return torch.bmm(o.transpose(1, 2), a, out=out)
