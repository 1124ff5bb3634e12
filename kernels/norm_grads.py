"""Per-sample gradients of LayerNorm and RMSNorm weights (and LayerNorm biases) in one launch.

γ_i = Σ_t o_{i,t} ⊙ x̂_{i,t} and β_i = Σ_t o_{i,t}, x̂ the normalized input (x − mean)/√(var + ε)
(RMSNorm: x/√(mean(x²) + ε)). The torch references (``pdpfast.ops.norm``) take four ops per call:
x̂ formed again by a LayerNorm without affine, its product with o, and two sums over the positions,
so x̂ and o ⊙ x̂ each go to memory and back. Here one program per sample walks its positions a
tile of rows at a time: each row's mean and variance in registers, x̂ never stored, both sums
accumulated in fp32, and x and o read once. A BERT step has 25 LayerNorm calls, so this is 75
launches fewer per step, the host time that keeps an eager GPU step waiting (bench/README.md).

A program takes whole rows (the statistics need all of a row), so rows of up to ``MAX_N``
elements run here and longer ones run the reference. One program per sample keeps the sums in
registers, with no partial sums to add afterwards and no atomics (deterministic); a batch smaller
than the GPU's count of multiprocessors leaves some idle (``bench_kernels`` times it against the
reference at BERT's, ViT's and GPT-2's shapes).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdpfast.ops.dispatch import register
from pdpfast.ops.norm import layer_norm_per_sample_grads_reference, rms_norm_per_sample_grads_reference

from ._utils import KERNEL_DTYPES, block, device_guard, new_buffer

# The longest normalized row a program holds in registers (LLaMA-2-70B's width); longer rows run
# the reference.
MAX_N = 8192


@triton.jit
def _norm_affine_grads_kernel(x_ptr, o_ptr, weight_ptr, bias_ptr, T, N, eps,
                              stride_xb, stride_xt, stride_ob, stride_ot,
                              CENTER: tl.constexpr, HAS_BIAS: tl.constexpr,
                              BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    sample = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    in_n = cols < N
    acc_w = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, T, BLOCK_T):
        rows = start + tl.arange(0, BLOCK_T)
        inside = (rows < T)[:, None] & in_n[None, :]
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
    tl.store(weight_ptr + sample * N + cols, acc_w.to(weight_ptr.dtype.element_ty), mask=in_n)
    if HAS_BIAS:
        tl.store(bias_ptr + sample * N + cols, acc_b.to(bias_ptr.dtype.element_ty), mask=in_n)


def _launch(x: torch.Tensor, o: torch.Tensor, shape: tuple, eps: float, center: bool, with_bias: bool) -> dict:
    B, N = x.shape[0], 1
    for n in shape:
        N *= n
    # both outputs in one allocation (x and o share a dtype here): an allocator call fewer per call
    out = new_buffer((2 if with_bias else 1, B, *shape), x.dtype, x.device)
    weight, bias = out[0], out[-1]
    if B:
        x3, o3 = x.reshape(B, -1, N), o.reshape(B, -1, N)
        x3 = x3 if x3.stride(2) == 1 else x3.contiguous()
        o3 = o3 if o3.stride(2) == 1 else o3.contiguous()
        T, block_n = x3.shape[1], block(N, 16, MAX_N)
        with device_guard(x):
            _norm_affine_grads_kernel[(B,)](
                x3, o3, weight, bias, T, N, eps, x3.stride(0), x3.stride(1), o3.stride(0), o3.stride(1),
                CENTER=center, HAS_BIAS=with_bias, BLOCK_T=block(T, 1, max(1, 4096 // block_n)), BLOCK_N=block_n,
                num_warps=4 if block_n <= 1024 else 8 if block_n <= 4096 else 16)
    return {"weight": weight, "bias": bias} if with_bias else {"weight": weight}


def _runs_here(x: torch.Tensor, o: torch.Tensor, shape: tuple) -> bool:
    n = 1
    for s in shape:
        n *= s
    return x.dtype in KERNEL_DTYPES and o.dtype == x.dtype and o.shape == x.shape and 0 < n <= MAX_N


@register("layer_norm_per_sample_grads")
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


@register("rms_norm_per_sample_grads")
def rms_norm_per_sample_grads(x: torch.Tensor, o: torch.Tensor, module) -> dict[str, torch.Tensor]:
    """An RMSNorm's per-sample weight gradient in one launch (the LayerNorm kernel, not centred).

    Args:
        x: (B, ..., *normalized_shape) the layer's input, fp32/fp16/bf16, any strides.
        o: like ``x``, the gradient w.r.t. the layer's output, of ``x``'s dtype.
        module: supplies ``normalized_shape`` and ``eps`` (None: ``torch.finfo(x.dtype).eps``, as
            ``torch.nn.functional.rms_norm``).
    Returns:
        {"weight": (B, *normalized_shape)} in ``x``'s dtype, summed in fp32. Other dtypes, mixed
        dtypes and rows longer than ``MAX_N`` run ``pdpfast.ops.norm.rms_norm_per_sample_grads_reference``.
    """
    shape = tuple(module.normalized_shape)
    if not _runs_here(x, o, shape):
        return rms_norm_per_sample_grads_reference(x, o, module)
    eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
    return _launch(x, o, shape, eps, False, False)
