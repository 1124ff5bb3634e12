"""Clipped weighted weight gradient of a linear map in one GEMM (DESIGN.md §2, last bullet).

Σ_i w_i o_iᵀ a_i = Σ_{i,t} (w_i o_{i,t}) a_{i,t}ᵀ: the ordinary weight-gradient GEMM over the B·T
rows, each output-gradient row scaled by its sample's weight as it is loaded, so there is no
extra pass over memory and no per-sample gradient.

Reference: ``pdpfast.ops.linear.linear_clipped_grad_reference``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdpfast.ops.linear import linear_clipped_grad_reference

from ._utils import LOW_PRECISION, _dot, block, device_guard, dot_flags, new_buffer, sm_count


@triton.jit
def _linear_clipped_grad_kernel(
        a_ptr, o_ptr, w_ptr, out_ptr, T, D, P, ROWS, ROWS_PER_SPLIT,
        stride_ab, stride_at, stride_ad, stride_ob, stride_ot, stride_op,
        stride_out_s, stride_out_p, stride_out_d, N_TILES_D,
        HAS_WEIGHTS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    tile_p = pid // N_TILES_D
    tile_d = pid % N_TILES_D
    cols_p = tile_p * BLOCK_P + tl.arange(0, BLOCK_P)
    cols_d = tile_d * BLOCK_D + tl.arange(0, BLOCK_D)
    in_p = cols_p < P
    in_d = cols_d < D
    row_start = split.to(tl.int64) * ROWS_PER_SPLIT
    row_end = tl.minimum(row_start + ROWS_PER_SPLIT, ROWS)
    acc = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
    for start in range(row_start, row_end, BLOCK_K):
        rows = start + tl.arange(0, BLOCK_K)
        in_k = rows < row_end
        sample = rows // T
        t = rows - sample * T
        y_t = tl.load(o_ptr + sample[None, :] * stride_ob + t[None, :] * stride_ot + cols_p[:, None] * stride_op,
                      mask=in_p[:, None] & in_k[None, :], other=0.0)
        if HAS_WEIGHTS:
            w = tl.load(w_ptr + sample, mask=in_k, other=0.0).to(tl.float32)
            y_t = (y_t.to(tl.float32) * w[None, :]).to(o_ptr.dtype.element_ty)
        x = tl.load(a_ptr + sample[:, None] * stride_ab + t[:, None] * stride_at + cols_d[None, :] * stride_ad,
                    mask=in_k[:, None] & in_d[None, :], other=0.0)
        acc = _dot(y_t, x, acc, DOT_PRECISION, UPCAST)
    out = out_ptr + split * stride_out_s + cols_p[:, None] * stride_out_p + cols_d[None, :] * stride_out_d
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=in_p[:, None] & in_d[None, :])


def _tiles(dtype: torch.dtype, P: int, D: int) -> tuple[int, int, int, int]:
    """(BLOCK_P, BLOCK_D, BLOCK_K, num_warps): 128×128 tensor-core tiles for large fp16/bf16
    GEMMs, 64×64 otherwise (fp32 "ieee" dots run on the FMA units and want smaller tiles)."""
    if dtype in LOW_PRECISION and P >= 128 and D >= 128:
        return 128, 128, 64, 8
    return block(P, 16, 64), block(D, 16, 64), 32, 4


def linear_clipped_grad(a: torch.Tensor, o: torch.Tensor, weights: torch.Tensor | None,
                        split_k: int | None = None) -> torch.Tensor:
    """Σ_i w_i o_iᵀ a_i as one GEMM: a (B, T, d), o (B, T, p), weights (B,) or None → (p, d).

    Output in ``o.dtype`` with fp32 accumulation (fp64: reference). ``split_k`` splits the B·T
    reduction over that many programs per output tile (fp32 partials summed by torch); by default
    it is chosen so that small (p, d) outputs with long reductions still fill the GPU.
    """
    if o.dtype not in (torch.float32, torch.float16, torch.bfloat16) or a.dim() < 2 or o.dim() < 2:
        return linear_clipped_grad_reference(a, o, weights)
    D, P = a.shape[-1], o.shape[-1]
    if a.dim() == 2:  # (B, d): one row per sample
        a, o = a.unsqueeze(1), o.reshape(o.shape[0], 1, P)
    elif a.dim() > 3:
        a, o = a.reshape(a.shape[0], -1, D), o.reshape(o.shape[0], -1, P)
    if a.shape[:2] != o.shape[:2]:
        raise ValueError(f"a {tuple(a.shape)} and o {tuple(o.shape)} disagree on their leading dims")
    a = a.to(o.dtype)
    if D > 1 and a.stride(-1) != 1:
        a = a.contiguous()
    if P > 1 and o.stride(-1) != 1:
        o = o.contiguous()
    B, T = a.shape[0], a.shape[1]
    rows = B * T
    if weights is not None:
        weights = weights.reshape(-1)
        if weights.numel() != B:
            raise ValueError(f"weights has {weights.numel()} entries for {B} samples")
        weights = weights.contiguous()
    if P == 0 or D == 0:
        return torch.zeros(P, D, dtype=o.dtype, device=o.device)
    block_p, block_d, block_k, num_warps = _tiles(o.dtype, P, D)
    n_p, n_d = triton.cdiv(P, block_p), triton.cdiv(D, block_d)
    if split_k is None:
        # enough programs for ~2 waves, but every split keeps ≥ 8 K-steps of work
        split_k = max(1, min(triton.cdiv(2 * sm_count(o.device), n_p * n_d), rows // (8 * block_k)))
    split_k = max(1, min(int(split_k), triton.cdiv(rows, block_k) if rows else 1, 65535))
    rows_per_split = triton.cdiv(triton.cdiv(rows, split_k), block_k) * block_k if rows else block_k
    split_k = triton.cdiv(rows, rows_per_split) if rows else 1
    if split_k == 1:
        out = new_buffer((1, P, D), o.dtype, o.device)
    else:
        out = new_buffer((split_k, P, D), torch.float32, o.device)
    with device_guard(o):
        _linear_clipped_grad_kernel[(n_p * n_d, split_k)](
            a, o, weights if weights is not None else o, out, T, D, P, rows, rows_per_split,
            a.stride(0), a.stride(1), a.stride(2), o.stride(0), o.stride(1), o.stride(2),
            out.stride(0), out.stride(1), out.stride(2), n_d,
            HAS_WEIGHTS=weights is not None, BLOCK_P=block_p, BLOCK_D=block_d, BLOCK_K=block_k,
            num_warps=num_warps, **dot_flags(o.dtype))
    if split_k == 1:
        return out[0]
    return out.sum(0).to(o.dtype)
