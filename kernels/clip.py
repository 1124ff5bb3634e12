"""Clip weights from per-sample squared norms in one launch (DESIGN.md §1.3).

Reference: ``pdpfast.ops.clip.clip_weights_reference``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdpfast.ops.clip import CLIP_EPS, clip_weights_reference

from ._utils import device_guard, new_buffer


@triton.jit
def _clip_weights_kernel(
        sq_norms_ptr, clip_norms_ptr, mask_ptr, out_ptr, N, COLS,
        stride_sq_r, stride_sq_c, stride_clip_r, stride_clip_c, stride_mask_r, stride_mask_c,
        eps, gamma,
        HAS_MASK: tl.constexpr, AUTOMATIC: tl.constexpr, BLOCK: tl.constexpr):
    # All inputs are viewed as (rows, COLS) with broadcast dims carried by zero strides, so a (B,)
    # mask or (B,) bounds against (K, B) norms need no expanded copy.
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = idx < N
    row = idx // COLS
    col = idx - row * COLS
    sq = tl.load(sq_norms_ptr + row * stride_sq_r + col * stride_sq_c, mask=valid, other=0.0).to(tl.float32)
    clip = tl.load(clip_norms_ptr + row * stride_clip_r + col * stride_clip_c, mask=valid, other=0.0).to(tl.float32)
    norm = tl.sqrt_rn(tl.maximum(sq, 0.0))
    if AUTOMATIC:
        # automatic clipping / normalization: w = c / (‖g‖ + γ)
        weight = tl.div_rn(clip, norm + gamma)
    else:
        # flat clipping: w = min(1, c / (‖g‖ + 1e-6))
        weight = tl.minimum(tl.div_rn(clip, norm + eps), 1.0)
    if HAS_MASK:
        m = tl.load(mask_ptr + row * stride_mask_r + col * stride_mask_c, mask=valid, other=0)
        weight = weight * m.to(tl.float32)
    tl.store(out_ptr + idx, weight.to(out_ptr.dtype.element_ty), mask=valid)


def _as_rows(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``x`` broadcast to ``shape`` and viewed as (rows, last dim); a view for ≤ 2-D shapes."""
    x = x.expand(shape)
    if len(shape) == 0:
        return x.reshape(1, 1)
    if len(shape) == 1:
        return x.unsqueeze(0)
    return x.reshape(-1, shape[-1])


def clip_weights(sq_norms: torch.Tensor, clip_norms: torch.Tensor, mask: torch.Tensor | None = None,
                 automatic_gamma: float | None = None) -> torch.Tensor:
    """Per-sample (or per-group) clip weights, like ``clip_weights_reference``, in one launch.

    sq_norms: (B,) or (K, B) squared norms; clip_norms: bounds broadcast against them (e.g. (B,)
    or (K, B)); mask: (B,) 0/1 (bool or float) or None; automatic_gamma: γ of automatic clipping or
    None for flat clipping. Returns weights shaped like the broadcast of the inputs, in
    ``sq_norms.dtype`` (fp32/fp16/bf16 computed in fp32; fp64 runs the reference).
    """
    if sq_norms.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return clip_weights_reference(sq_norms, clip_norms, mask, automatic_gamma)
    if not torch.is_tensor(clip_norms):
        clip_norms = torch.as_tensor(clip_norms, dtype=torch.float32, device=sq_norms.device)
    shape = torch.broadcast_shapes(sq_norms.shape, clip_norms.shape, *(() if mask is None else (mask.shape,)))
    out = new_buffer(shape, sq_norms.dtype, sq_norms.device)
    if out.numel() == 0:
        return out
    sq_rows = _as_rows(sq_norms, shape)
    clip_rows = _as_rows(clip_norms, shape)
    mask_rows = _as_rows(mask, shape) if mask is not None else sq_rows
    n = out.numel()
    BLOCK = 1024
    with device_guard(sq_norms):
        _clip_weights_kernel[(triton.cdiv(n, BLOCK),)](
            sq_rows, clip_rows, mask_rows, out, n, sq_rows.shape[1],
            *sq_rows.stride(), *clip_rows.stride(), *mask_rows.stride(),
            CLIP_EPS, 0.0 if automatic_gamma is None else float(automatic_gamma),
            HAS_MASK=mask is not None, AUTOMATIC=automatic_gamma is not None, BLOCK=BLOCK, num_warps=4)
    return out
