"""Per-sample squared gradient norms of linear and embedding layers (DESIGN.md §2).

Every kernel reduces its per-sample quantity in registers and writes one fp32 partial sum per
program to a small (B, n_programs_per_sample) buffer that torch sums; no per-sample gradient and no
Gram matrix ever reaches memory, and the reduction is deterministic (no atomics).

References: ``pdpfast.ops.linear.linear_sq_norms_reference`` (weight, or weight + bias),
``bias_sq_norms_reference`` and ``pdpfast.ops.embedding.embedding_sq_norms_reference``.

Each launcher registers itself under its op's name (``pdpfast.ops.dispatch.register``), with where
it was measured faster (bench/results/bench_kernels-NVIDIA_H100_80GB_HBM3.json, 2026-11-23/24, and
bench_kernels-NVIDIA_H200.json, 2026-11-29):

- linear norms win in fp16/bf16 (1.4-7.6x); in fp32 on the rank-one and Gram paths, whose tf32x3
  products beat cuBLAS's fp32 GEMMs (1.2-1.9x), not on the direct path (0.92x on an H200 at GPT-2's
  768→768 calls), which runs the reference there. The Gram path is taken up to 1.5× the direct
  form's multiply-adds (``pdpfast.ops.linear.kernel_uses_gram``: it ran 1.24-1.38x faster than
  the direct path at 1.33×);
- the bias kernel wins only on fp16/bf16 sequences (1.5-1.7x at (64, 512, 1024)); torch's three ops
  win in fp32 (0.4-0.6x) and on one-row samples (0.8-1.0x);
- embedding norms win everywhere measured (1.7-4.5x).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdpfast.ops.dispatch import register
from pdpfast.ops.embedding import embedding_sq_norms_reference
from pdpfast.ops.linear import (
    TF32_SLACK,
    bias_sq_norms_reference,
    kernel_uses_gram,
    linear_sq_norms_grouped_reference,
    linear_sq_norms_reference,
    linear_sq_norms_rounding_reference,
    tf32_allowed,
)

from ._utils import KERNEL_DTYPES, _dot, block, cdiv, device_guard, dot_flags, new_buffer, sum_partials, table_on

_LOW_PRECISION = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# Linear, Gram ("ghost") path: ‖G_i‖² = Σ_{s,t} (a_i a_iᵀ)_{st} (o_i o_iᵀ)_{st}
# ----------------------------------------------------------------------------------------------
@triton.jit
def _gram_pair(a_base, o_base, T, D, P, stride_at, stride_ad, stride_ot, stride_op, tile_s, shift, N_TILES,
               BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
               DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, HAS_BIAS: tl.constexpr, ROUNDING: tl.constexpr):
    # One sample's tile pair {s, t = (s + shift) mod n} of Σ_{s,t} (a aᵀ)_{st} (o oᵀ)_{st}, and with
    # ROUNDING, on the diagonal pair (shift 0), Σ_t ‖o_t‖·√(‖a_t‖² [+ 1]) over tile s's rows.
    # Both Grams are symmetric, so only tile pairs {s, t} are visited, each once: shifts 0..n//2
    # cover every unordered pair once, except that for an even n the shift n/2 meets each pair
    # twice; one copy is dropped.
    tile_t = (tile_s + shift) % N_TILES
    keep = (2 * shift != N_TILES) | (tile_s < shift)
    rows_s = tile_s * BLOCK_T + tl.arange(0, BLOCK_T)
    rows_t = tile_t * BLOCK_T + tl.arange(0, BLOCK_T)
    in_s = rows_s < T
    in_t = rows_t < T
    product = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
    terms = tl.zeros([BLOCK_T], dtype=tl.float32)
    if keep:
        gram_a = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
        for start in range(0, D, BLOCK_D):
            cols = start + tl.arange(0, BLOCK_D)
            in_d = cols < D
            x_s = tl.load(a_base + rows_s[:, None] * stride_at + cols[None, :] * stride_ad,
                          mask=in_s[:, None] & in_d[None, :], other=0.0)
            x_t = tl.load(a_base + cols[:, None] * stride_ad + rows_t[None, :] * stride_at,
                          mask=in_d[:, None] & in_t[None, :], other=0.0)
            gram_a = _dot(x_s, x_t, gram_a, DOT_PRECISION, UPCAST)
        gram_o = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
        for start in range(0, P, BLOCK_P):
            cols = start + tl.arange(0, BLOCK_P)
            in_p = cols < P
            y_s = tl.load(o_base + rows_s[:, None] * stride_ot + cols[None, :] * stride_op,
                          mask=in_s[:, None] & in_p[None, :], other=0.0)
            y_t = tl.load(o_base + cols[:, None] * stride_op + rows_t[None, :] * stride_ot,
                          mask=in_p[:, None] & in_t[None, :], other=0.0)
            gram_o = _dot(y_s, y_t, gram_o, DOT_PRECISION, UPCAST)
        if HAS_BIAS:  # the bias is a weight on a constant input 1: ‖b_i‖² = Σ_st (o oᵀ)_st joins as a aᵀ + 1
            gram_a = gram_a + 1.0  # (rows past T have gram_o = 0: they still add nothing)
        # an off-diagonal pair stands for (s, t) and (t, s)
        product = gram_a * gram_o * tl.where(shift == 0, 1.0, 2.0)
        if ROUNDING:
            if shift == 0:  # rows_s = rows_t: the diagonals hold ‖a_t‖² (+ 1) and ‖o_t‖²
                on_diag = rows_s[:, None] == rows_t[None, :]
                sq_a = tl.sum(tl.where(on_diag, gram_a, 0.0), axis=1)
                sq_o = tl.sum(tl.where(on_diag, gram_o, 0.0), axis=1)
                terms = tl.sqrt_rn(sq_a) * tl.sqrt_rn(sq_o)  # correctly rounded: tl.sqrt is approximate on a GPU
    return tl.sum(tl.sum(product, axis=1), axis=0), tl.sum(terms, axis=0)


@triton.jit
def _linear_gram_sq_norms_kernel(
        a_ptr, o_ptr, partial_ptr, T, D, P,
        stride_ab, stride_at, stride_ad, stride_ob, stride_ot, stride_op,
        N_TILES, N_SHIFTS, N_PARTIALS, U,
        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
        DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, HAS_BIAS: tl.constexpr, ROUNDING: tl.constexpr):
    # program (sample, s, shift) takes the tile pair {s, (s + shift) mod n} (``_gram_pair``).
    # ROUNDING: the diagonal programs (shift 0) also write U·Σ_t ‖o_t‖·√(‖a_t‖² [+ 1]) of their
    # rows, read off the Grams' diagonals, N_PARTIALS further on (0 from the other programs).
    pid = tl.program_id(0)
    shift = pid % N_SHIFTS
    tile_s = (pid // N_SHIFTS) % N_TILES
    sample = (pid // (N_SHIFTS * N_TILES)).to(tl.int64)
    norm, terms = _gram_pair(a_ptr + sample * stride_ab, o_ptr + sample * stride_ob, T, D, P, stride_at, stride_ad,
                             stride_ot, stride_op, tile_s, shift, N_TILES, BLOCK_T, BLOCK_D, BLOCK_P, DOT_PRECISION,
                             UPCAST, HAS_BIAS, ROUNDING)
    tl.store(partial_ptr + pid, norm)
    if ROUNDING:
        tl.store(partial_ptr + N_PARTIALS + pid, U * terms)


@triton.jit
def _linear_gram_sq_norms_grouped_kernel(
        a_ptr, o_ptr, table_ptr, partial_ptr, T, N_TILES, N_SHIFTS, B, N_PARTIALS, U,
        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, ALIGN_A: tl.constexpr,
        ALIGN_O: tl.constexpr, DIV16: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
        HAS_BIAS: tl.constexpr, ROUNDING: tl.constexpr):
    # Calls of one (B, T) in one launch, of any widths: row c of the (n, 8) table holds call c's input
    # and output gradient offsets past a_ptr and o_ptr (multiples of ALIGN_A, ALIGN_O: 16 bytes), its
    # d and p, and its tensors' batch and row strides (their last dims are contiguous). DIV16: those
    # widths and strides are all multiples of 16, which a per-call launch's specialization would have
    # told the compiler. Program ((c, sample), s, shift) writes at its own index, so the partial sums
    # are (n, B, K), K = N_TILES·N_SHIFTS: row c is what call c's own launch would write.
    pid = tl.program_id(0)
    shift = pid % N_SHIFTS
    tile_s = (pid // N_SHIFTS) % N_TILES
    row = pid // (N_SHIFTS * N_TILES)
    call = row // B
    sample = (row % B).to(tl.int64)
    entry = table_ptr + 8 * call
    a_offset = tl.multiple_of(tl.load(entry), ALIGN_A)
    o_offset = tl.multiple_of(tl.load(entry + 1), ALIGN_O)
    D = tl.load(entry + 2).to(tl.int32)
    P = tl.load(entry + 3).to(tl.int32)
    stride_ab = tl.load(entry + 4)
    stride_at = tl.load(entry + 5).to(tl.int32)
    stride_ob = tl.load(entry + 6)
    stride_ot = tl.load(entry + 7).to(tl.int32)
    if DIV16:
        D = tl.multiple_of(D, 16)
        P = tl.multiple_of(P, 16)
        stride_ab = tl.multiple_of(stride_ab, 16)
        stride_at = tl.multiple_of(stride_at, 16)
        stride_ob = tl.multiple_of(stride_ob, 16)
        stride_ot = tl.multiple_of(stride_ot, 16)
    norm, terms = _gram_pair(a_ptr + a_offset + sample * stride_ab, o_ptr + o_offset + sample * stride_ob, T, D, P,
                             stride_at, 1, stride_ot, 1, tile_s, shift, N_TILES, BLOCK_T, BLOCK_D, BLOCK_P,
                             DOT_PRECISION, UPCAST, HAS_BIAS, ROUNDING)
    tl.store(partial_ptr + pid, norm)
    if ROUNDING:
        tl.store(partial_ptr + N_PARTIALS + pid, U * terms)


# ----------------------------------------------------------------------------------------------
# Linear, direct path: ‖G_i‖² with G_i = o_iᵀ a_i formed tile by tile in registers
# ----------------------------------------------------------------------------------------------
@triton.jit
def _linear_direct_sq_norms_kernel(
        a_ptr, o_ptr, partial_ptr, T, D, P,
        stride_ab, stride_at, stride_ad, stride_ob, stride_ot, stride_op,
        N_TILES_P, N_TILES_D,
        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
        DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    tile_d = pid % N_TILES_D
    tile_p = (pid // N_TILES_D) % N_TILES_P
    sample = (pid // (N_TILES_D * N_TILES_P)).to(tl.int64)
    cols_p = tile_p * BLOCK_P + tl.arange(0, BLOCK_P)
    cols_d = tile_d * BLOCK_D + tl.arange(0, BLOCK_D)
    in_p = cols_p < P
    in_d = cols_d < D
    a_base = a_ptr + sample * stride_ab
    o_base = o_ptr + sample * stride_ob
    grad = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
    for start in range(0, T, BLOCK_T):
        rows = start + tl.arange(0, BLOCK_T)
        in_t = rows < T
        y_t = tl.load(o_base + cols_p[:, None] * stride_op + rows[None, :] * stride_ot,
                      mask=in_p[:, None] & in_t[None, :], other=0.0)
        x = tl.load(a_base + rows[:, None] * stride_at + cols_d[None, :] * stride_ad,
                    mask=in_t[:, None] & in_d[None, :], other=0.0)
        grad = _dot(y_t, x, grad, DOT_PRECISION, UPCAST)
    tl.store(partial_ptr + pid, tl.sum(tl.sum(grad * grad, axis=1), axis=0))


# ----------------------------------------------------------------------------------------------
# Linear, rank one (T = 1): ‖o aᵀ‖² = ‖a‖² ‖o‖², the 1×1 case of the Gram identity
# ----------------------------------------------------------------------------------------------
@triton.jit
def _rank_one_sq_norms_kernel(a_ptr, o_ptr, out_ptr, B, D, P, stride_ab, stride_ad, stride_ob, stride_op, U,
                              BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, ROUNDING: tl.constexpr):
    # ROUNDING: also U·‖o‖·√(‖a‖² [+ 1]) = U·√(the squared norm), B further on
    sample = tl.program_id(0).to(tl.int64)
    acc_a = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, D, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(a_ptr + sample * stride_ab + cols * stride_ad, mask=cols < D, other=0.0).to(tl.float32)
        acc_a += x * x
    acc_o = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, P, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        y = tl.load(o_ptr + sample * stride_ob + cols * stride_op, mask=cols < P, other=0.0).to(tl.float32)
        acc_o += y * y
    sq_a = tl.sum(acc_a, axis=0)
    if HAS_BIAS:  # (‖a‖² + 1)‖o‖²: the bias's ‖o‖² in the same launch
        sq_a = sq_a + 1.0
    sq = sq_a * tl.sum(acc_o, axis=0)
    tl.store(out_ptr + sample, sq)
    if ROUNDING:
        tl.store(out_ptr + B + sample, U * tl.sqrt_rn(sq))  # correctly rounded, as above


def _strides(x: torch.Tensor):
    return x.stride(0), x.stride(1), x.stride(2)


def _unit_inner(x: torch.Tensor) -> torch.Tensor:
    """Keep any layout whose last dim is contiguous (coalesced loads); copy the others."""
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


def _kernel_wins(a: torch.Tensor, o: torch.Tensor) -> bool:
    """Where the kernel was measured faster than torch (H100, bench_kernels): fp16/bf16 always;
    fp32 on the rank-one (T = 1) and Gram paths (tf32x3 products against cuBLAS's fp32 GEMMs:
    1.1-1.9x), not on the direct path (cuBLAS's batched GEMM forms o_iᵀa_i faster)."""
    if o.dtype in _LOW_PRECISION:
        return True
    if o.dtype != torch.float32 or o.dim() != 3:
        return False
    T = o.shape[1]
    return T == 1 or kernel_uses_gram(T, a.shape[-1], o.shape[-1])


@register("linear_weight_sq_norms", when=_kernel_wins)
def linear_weight_sq_norms(a: torch.Tensor, o: torch.Tensor, path: str = "auto",
                           with_bias: bool = False, parts: bool = False) -> torch.Tensor:
    """‖o_iᵀ a_i‖²_F per sample, never forming o_iᵀ a_i nor the T×T Grams in memory.

    Args:
        a: (B, T, d) layer inputs, fp32/fp16/bf16, any strides (a copy where the last dim is not
            contiguous); mixed dtypes meet in their promoted dtype.
        o: (B, T, p) gradients of the summed loss w.r.t. the layer outputs, fp32/fp16/bf16.
        path: "auto" (T = 1 → rank-one kernel, else the cheaper of Gram and direct by
            ``pdpfast.ops.linear.kernel_uses_gram``), or "gram" / "direct" to force one.
        with_bias: add the bias's ‖Σ_t o_{i,t}‖² — in the same launch on the rank-one and Gram
            paths (one launch per layer, not two), by the bias kernel on the direct path.
        parts: return the launch's per-program partial sums, (B, K), unsummed: the caller sums
            every layer's at once (book-keeping, once per backward) instead of one sum per layer.
    Returns:
        (B,) fp32, accumulated in fp32 ((B, K) with ``parts``, whose row sums are the norms). Other
        dtypes (fp64) or ranks run ``pdpfast.ops.linear.linear_sq_norms_reference`` and return its
        result ((B, 1) with ``parts``).
    Raises:
        ValueError for an unknown ``path``, or ``a`` and ``o`` that disagree on (B, T).
    """
    if path not in ("auto", "gram", "direct"):
        raise ValueError(f"path must be 'auto', 'gram' or 'direct', got {path!r}")
    if a.dim() != 3 or o.dim() != 3 or a.dtype not in KERNEL_DTYPES or o.dtype not in KERNEL_DTYPES:
        sq = linear_sq_norms_reference(a, o, with_bias)
        return sq.unsqueeze(1) if parts else sq
    return _linear_norms(a, o, path, with_bias, None, parts)[0]


def _fuses_rounding(a: torch.Tensor, o: torch.Tensor) -> bool:
    """Where ``linear_sq_norms_rounding`` runs: where the norm kernel wins (``_kernel_wins``) on
    its rank-one and Gram paths, whose launch also computes ρ."""
    if a.dim() != 3 or o.dim() != 3 or a.dtype not in KERNEL_DTYPES or not _kernel_wins(a, o):
        return False
    T = o.shape[1]
    return T == 1 or kernel_uses_gram(T, a.shape[-1], o.shape[-1])


@register("linear_sq_norms_rounding", when=_fuses_rounding)
def linear_sq_norms_rounding(a: torch.Tensor, o: torch.Tensor, with_bias: bool, u: float, parts: bool = False):
    """A linear call's per-sample squared norms (weight, + bias ``with_bias``) and its clipped sum's
    rounding bound ρ_i = u·Σ_t ‖o_t‖·√(‖a_t‖² [+ 1]) from one launch: the Gram path reads ‖a_t‖²
    and ‖o_t‖² off its Grams' diagonals, the rank-one path takes ρ_i = u·‖g_i‖.

    Args:
        a: (B, T, d) layer inputs, fp32/fp16/bf16 (as ``linear_weight_sq_norms``).
        o: (B, T, p) output gradients.
        with_bias: the bias is among the call's parameters.
        u: the unit roundoff of the clipped sum's row scaling (``pdpfast.nn.rules.scaling_roundoff``).
        parts: return the launch's per-program partial sums of both, (B, K) each, unsummed.
    Returns:
        (sq, rho), each (B,) fp32 ((B, K) with ``parts``, whose row sums they are). Calls on the direct
        path (or of other dtypes) compute them apart (``pdpfast.ops.linear.linear_sq_norms_rounding_reference``),
        summed whatever ``parts``.
    """
    if not _fuses_rounding(a, o):
        return linear_sq_norms_rounding_reference(a, o, with_bias, u)
    return _linear_norms(a, o, "rank_one" if o.shape[1] == 1 else "gram", with_bias, u, parts)


def _flags_and_roundoff(a: torch.Tensor, u: float | None) -> tuple[dict, float | None]:
    """(``dot_flags`` of a launch on ``a``, its rounding bound's roundoff ``u`` or None): fp32 takes one
    TF32 product where torch lets matmuls use TF32 (the bounds then keep its margin), and ρ's row norms
    ‖a_t‖², ‖o_t‖² then come from TF32 products (operands truncated to 2^-10): u grows so that a bound
    stays a bound."""
    flags = dot_flags(a.dtype, tf32=a.is_cuda and tf32_allowed("matmul"))
    if u and a.dtype == torch.float32 and flags["DOT_PRECISION"] == "tf32":
        u *= TF32_SLACK
    return flags, u


def _gram_tiles(T: int) -> tuple[int, int, int]:
    """(rows per tile, tiles, shifts) of the Gram path's programs over T positions (``_gram_pair``)."""
    block_t = block(T, 16, 64)
    n_tiles = cdiv(T, block_t)
    return block_t, n_tiles, (n_tiles // 2 + 1 if n_tiles else 0)


def _linear_norms(a: torch.Tensor, o: torch.Tensor, path: str, with_bias: bool, u: float | None,
                  parts: bool = False):
    """(sq, rho): the launches of ``linear_weight_sq_norms``; rho (``linear_sq_norms_rounding``) when
    ``u`` is given (rank-one and Gram paths only), else None. ``parts``: sq (and rho) as the (B, K)
    partial sums the launch wrote, not summed here."""
    B, T, D = a.shape
    P = o.shape[-1]
    if o.shape[:2] != a.shape[:2]:
        raise ValueError(f"a {tuple(a.shape)} and o {tuple(o.shape)} disagree on (B, T)")
    if a.dtype != o.dtype:  # one dot operand type; fp16 × bf16 meet in fp32
        common = torch.promote_types(a.dtype, o.dtype)
        a, o = a.to(common), o.to(common)
    a, o = _unit_inner(a), _unit_inner(o)
    rounding = u is not None
    if B == 0:
        empty = torch.zeros(0, dtype=torch.float32, device=a.device)
        if parts:
            empty = empty.view(0, 1)
        return empty, (empty if rounding else None)
    flags, u = _flags_and_roundoff(a, u)
    if path == "auto":
        path = "rank_one" if T == 1 else ("gram" if kernel_uses_gram(T, D, P) else "direct")
    n_out = 2 if rounding else 1
    with device_guard(a):
        if path == "rank_one":
            out = new_buffer((n_out, B), torch.float32, a.device)
            _rank_one_sq_norms_kernel[(B,)](
                a, o, out, B, D, P, a.stride(0), a.stride(2), o.stride(0), o.stride(2), u or 0.0,
                BLOCK=block(max(D, P), 16, 1024), HAS_BIAS=with_bias, ROUNDING=rounding, num_warps=4)
            if parts:
                out = out.unsqueeze(2)
            return out[0], (out[1] if rounding else None)
        if path == "gram":
            block_t, n_tiles, n_shifts = _gram_tiles(T)
            partials = new_buffer((n_out * B, n_tiles * n_shifts), torch.float32, a.device)
            n = B * n_tiles * n_shifts  # programs; their ρ partials follow their norms' (T = 0: none, sums 0)
            if n:
                _linear_gram_sq_norms_kernel[(n,)](
                    a, o, partials, T, D, P, *_strides(a), *_strides(o), n_tiles, n_shifts, n, u or 0.0,
                    BLOCK_T=block_t, BLOCK_D=block(D, 16, 64), BLOCK_P=block(P, 16, 64), HAS_BIAS=with_bias,
                    ROUNDING=rounding, num_warps=4, **flags)
            if parts:
                return (partials[:B], partials[B:]) if rounding else (partials, None)
            out = sum_partials(partials)
            return (out[:B], out[B:]) if rounding else (out, None)
        if rounding:
            raise ValueError(f"the rounding bound is fused on the rank-one and Gram paths only, not {path!r}")
        block_p, block_d = block(P, 16, 64), block(D, 16, 64)
        n_p, n_d = cdiv(P, block_p), cdiv(D, block_d)
        partials = new_buffer((B, n_p * n_d), torch.float32, a.device)
        if partials.numel():
            _linear_direct_sq_norms_kernel[(partials.numel(),)](
                a, o, partials, T, D, P, *_strides(a), *_strides(o), n_p, n_d,
                BLOCK_T=block(T, 16, 32 if a.dtype == torch.float32 else 64), BLOCK_D=block_d, BLOCK_P=block_p,
                num_warps=4, **flags)
        if parts:
            return (torch.cat([partials, bias_sq_norms(o).unsqueeze(1)], 1) if with_bias else partials), None
        out = sum_partials(partials)
        return (out.add_(bias_sq_norms(o)) if with_bias else out), None


def _gram_groups(a: torch.Tensor, o: torch.Tensor, *others: torch.Tensor) -> bool:
    """Where calls' norms group into one launch: the Gram path of ``linear_weight_sq_norms`` on
    tensors whose last dim is contiguous (the per-call launcher copies the others first), decided on
    the first call's (a, o) (the launcher checks that the others match it)."""
    if a.dim() != 3 or o.dim() != 3 or a.dtype not in KERNEL_DTYPES or o.dtype != a.dtype:
        return False
    if (a.shape[-1] > 1 and a.stride(-1) != 1) or (o.shape[-1] > 1 and o.stride(-1) != 1):
        return False
    T = o.shape[1]
    return T > 1 and kernel_uses_gram(T, a.shape[-1], o.shape[-1])


# (the table's widths and row strides are read as int32)
_INT32_MAX = 2 ** 31 - 1


def _call_table(calls: list) -> tuple[torch.Tensor, bool] | None:
    """The (n, 8) table of a grouped launch (``_linear_gram_sq_norms_grouped_kernel``) and whether its
    widths and strides are all multiples of 16; None unless every call has the first one's B and T,
    dtype and device, contiguous last dims, 16-byte aligned tensors and int32 widths and row strides.
    (A loop over the calls on every grouped launch: each value read once, the checks on all of them
    folded into two running ORs.)"""
    a0, o0 = calls[0]
    B, T = a0.shape[:2]
    dtype, device = a0.dtype, a0.get_device()
    size, pa0, po0 = a0.element_size(), a0.data_ptr(), o0.data_ptr()
    values = []
    every = narrow = 0  # ORs of all widths and strides (divisibility), and of those read as int32
    for a, o in calls:
        (b_a, t_a, d), (b_o, t_o, p) = a.shape, o.shape
        (sab, sat, sad), (sob, sot, sop) = a.stride(), o.stride()
        if (b_a != B or t_a != T or b_o != B or t_o != T or a.dtype != dtype or o.dtype != dtype or
                a.get_device() != device or o.get_device() != device or (d > 1 and sad != 1) or (p > 1 and sop != 1)):
            return None
        pa, po = a.data_ptr(), o.data_ptr()
        if (pa | po) % 16:
            return None
        values += ((pa - pa0) // size, (po - po0) // size, d, p, sab, sat, sob, sot)
        narrow |= d | p | sat | sot
        every |= narrow | sab | sob
    if narrow > _INT32_MAX:  # (every value ≥ 0: the OR passes 2³¹ - 1 only where one does)
        return None
    return table_on(values, a0.device), every % 16 == 0


@register("linear_sq_norms_grouped", when=_gram_groups)
def linear_sq_norms_grouped(calls: list, with_bias: bool, u: float = 0.0):
    """Squared norms (and rounding bounds) of n linear calls of one batch, sequence length and dtype
    on the Gram path, of any widths, from one launch: program ((call, sample), s, shift) finds its
    call's tensors at an offset from the first call's, and its widths and strides, in a table of the
    n calls.

    One launch instead of n: on an H200 a norm kernel's launch took ~0.13-0.17 ms of host time
    against 0.01-0.04 ms of GPU time at BERT's and GPT-2's calls (bench_kernels-NVIDIA_H200.json,
    eager against graph times), so an eager step's many calls were host-bound. The launch takes the
    widest call's tiles (64 columns from a width of 64 up: every call of a full-size model).

    Args:
        calls: n ≥ 1 pairs (a (B, T, d) inputs, o (B, T, p) output gradients) of one B, T and dtype,
            fp32/fp16/bf16.
        with_bias: the calls' bias is among their parameters.
        u: the unit roundoff of the clipped sums' row scaling; 0: no rounding bound.
    Returns:
        (sq, rho): (n, B, K) fp32 each, K set by T, the launch's partial sums, row c what call c's own
        launch writes (``linear_sq_norms_rounding(..., parts=True)``; to fp32 summation where its tiles
        are narrower than the widest call's): sums over K are its per-sample
        squared norms and its ρ_i; rho None where ``u`` is 0. Calls of another dtype or device than
        the first one's, whose last dims are strided, or whose tensors do not all start on 16-byte
        boundaries, run the reference (one launch each; it needs one B and T, as the caller groups them).
    """
    a0, o0 = calls[0]
    B, T = a0.shape[:2]
    found = _call_table(calls) if B else None
    if found is None:
        return linear_sq_norms_grouped_reference(calls, with_bias, u)
    table, div16 = found
    n = len(calls)
    block_d = block(max(a.shape[-1] for a, _ in calls), 16, 64)
    block_p = block(max(o.shape[-1] for _, o in calls), 16, 64)
    rounding = bool(u)
    flags, u = _flags_and_roundoff(a0, u)
    block_t, n_tiles, n_shifts = _gram_tiles(T)
    K = n_tiles * n_shifts
    programs = B * n * K
    partials = new_buffer(((2 if rounding else 1) * programs,), torch.float32, a0.device)
    with device_guard(a0):
        _linear_gram_sq_norms_grouped_kernel[(programs,)](
            a0, o0, table, partials, T, n_tiles, n_shifts, B, programs, u or 0.0, BLOCK_T=block_t,
            BLOCK_D=block_d, BLOCK_P=block_p, ALIGN_A=16 // a0.element_size(), ALIGN_O=16 // o0.element_size(),
            DIV16=div16, HAS_BIAS=with_bias, ROUNDING=rounding, num_warps=4, **flags)
    return partials[:programs].view(n, B, K), (partials[programs:].view(n, B, K) if rounding else None)


# ----------------------------------------------------------------------------------------------
# Bias: ‖Σ_t o_{i,t}‖²
# ----------------------------------------------------------------------------------------------
@triton.jit
def _bias_sq_norms_kernel(o_ptr, partial_ptr, T, P, stride_ob, stride_ot, stride_op, N_TILES_P,
                          BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr):
    pid = tl.program_id(0)
    tile_p = pid % N_TILES_P
    sample = (pid // N_TILES_P).to(tl.int64)
    cols = tile_p * BLOCK_P + tl.arange(0, BLOCK_P)
    in_p = cols < P
    grad = tl.zeros([BLOCK_P], dtype=tl.float32)
    for start in range(0, T, BLOCK_T):
        rows = start + tl.arange(0, BLOCK_T)
        y = tl.load(o_ptr + sample * stride_ob + rows[:, None] * stride_ot + cols[None, :] * stride_op,
                    mask=(rows < T)[:, None] & in_p[None, :], other=0.0)
        grad += tl.sum(y.to(tl.float32), axis=0)
    tl.store(partial_ptr + pid, tl.sum(grad * grad, axis=0))


@register("bias_sq_norms", when=lambda o: o.dim() == 3 and o.shape[1] > 1 and o.dtype in _LOW_PRECISION)
def bias_sq_norms(o: torch.Tensor) -> torch.Tensor:
    """‖Σ_t o_{i,t}‖² per sample, the squared norm of a linear layer's bias gradient.

    Args:
        o: (B, T, p) gradients of the summed loss w.r.t. the layer outputs, fp32/fp16/bf16, any strides.
    Returns:
        (B,) fp32, accumulated in fp32. Other dtypes (fp64) or ranks run
        ``pdpfast.ops.linear.bias_sq_norms_reference``.
    """
    if o.dim() != 3 or o.dtype not in KERNEL_DTYPES:
        return bias_sq_norms_reference(o)
    o = _unit_inner(o)
    B, T, P = o.shape
    block_p = block(P, 16, 256)
    n_p = cdiv(P, block_p)
    partials = new_buffer((B, n_p), torch.float32, o.device)
    if partials.numel():
        with device_guard(o):
            _bias_sq_norms_kernel[(partials.numel(),)](
                o, partials, T, P, *_strides(o), n_p, BLOCK_T=block(T, 1, 32), BLOCK_P=block_p, num_warps=4)
    return sum_partials(partials)


# ----------------------------------------------------------------------------------------------
# Embedding: Σ_{v ∈ tokens(i)} ‖Σ_{t: x_{i,t}=v} o_{i,t}‖² = Σ_{s,t} [x_s = x_t] ⟨o_s, o_t⟩
# ----------------------------------------------------------------------------------------------
@triton.jit
def _embedding_sq_norms_kernel(
        ids_ptr, perm_ptr, o_ptr, partial_ptr, T, P,
        stride_ob, stride_ot, stride_op, N_TILES,
        BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
        DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # ids arrive sorted within each sample (perm maps a sorted position back to its row of o), and
    # padding tokens carry distinct negative ids. Equal ids are then contiguous: tile s can only
    # share a token with a later tile t if the last id of s equals the first id of t (and then
    # with every tile in between), so the walk over t stops at the first tile where that fails.
    # Work: the diagonal tiles plus the tiles a repeated token spans, not all T² pairs.
    pid = tl.program_id(0)
    tile_s = pid % N_TILES
    sample = (pid // N_TILES).to(tl.int64)
    ids_base = ids_ptr + sample * T
    perm_base = perm_ptr + sample * T
    o_base = o_ptr + sample * stride_ob
    rows_s = tile_s * BLOCK_T + tl.arange(0, BLOCK_T)
    in_s = rows_s < T
    ids_s = tl.load(ids_base + rows_s, mask=in_s, other=-1)
    pos_s = tl.load(perm_base + rows_s, mask=in_s, other=0)
    last_s = tl.load(ids_base + tl.minimum(tile_s * BLOCK_T + BLOCK_T, T) - 1)

    total = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
    tile_t = tile_s
    more = tile_s < N_TILES
    while more:
        rows_t = tile_t * BLOCK_T + tl.arange(0, BLOCK_T)
        in_t = rows_t < T
        ids_t = tl.load(ids_base + rows_t, mask=in_t, other=-1)
        pos_t = tl.load(perm_base + rows_t, mask=in_t, other=0)
        # masked-out rows and padding tokens have negative ids and never count
        same = (ids_s[:, None] == ids_t[None, :]) & (ids_s[:, None] >= 0)
        if tl.max(tl.max(same.to(tl.int32), axis=1), axis=0) > 0:
            inner = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
            for start in range(0, P, BLOCK_P):
                cols = start + tl.arange(0, BLOCK_P)
                in_p = cols < P
                y_s = tl.load(o_base + pos_s[:, None] * stride_ot + cols[None, :] * stride_op,
                              mask=in_s[:, None] & in_p[None, :], other=0.0)
                y_t = tl.load(o_base + cols[:, None] * stride_op + pos_t[None, :] * stride_ot,
                              mask=in_p[:, None] & in_t[None, :], other=0.0)
                inner = _dot(y_s, y_t, inner, DOT_PRECISION, UPCAST)
            # an off-diagonal tile pair stands for (s, t) and (t, s)
            total += tl.where(same, inner, 0.0) * tl.where(tile_t == tile_s, 1.0, 2.0)
        tile_t += 1
        first_t = tl.load(ids_base + tile_t * BLOCK_T, mask=tile_t < N_TILES, other=-1)
        more = (tile_t < N_TILES) & (first_t == last_s) & (last_s >= 0)
    tl.store(partial_ptr + pid, tl.sum(tl.sum(total, axis=1), axis=0))


@register("embedding_sq_norms")
def embedding_sq_norms(ids: torch.Tensor, o: torch.Tensor, num_embeddings: int,
                       padding_idx: int | None) -> torch.Tensor:
    """Exact per-sample squared norms of an embedding table's gradient,
    Σ_{v ∈ tokens(i)} ‖Σ_{t: x_{i,t}=v} o_{i,t}‖².

    Args:
        ids: (B, T) integer token ids (any (B, ...) shape, read as (B, T)).
        o: (B, T, p) gradients of the summed loss w.r.t. the embedding outputs (or (B, ..., p)),
            fp32/fp16/bf16.
        num_embeddings: V, the table's rows: unused by the kernel (kept for the op signature).
        padding_idx: tokens equal to it contribute nothing; None: every token counts.
    Returns:
        (B,) fp32, accumulated in fp32. Other dtypes of ``o`` (fp64) run
        ``pdpfast.ops.embedding.embedding_sq_norms_reference``.
    """
    if o.dtype not in KERNEL_DTYPES:
        return embedding_sq_norms_reference(ids, o, num_embeddings, padding_idx)
    B = ids.shape[0]
    if B == 0:
        return torch.zeros(0, dtype=torch.float32, device=o.device)
    ids = ids.reshape(B, -1)
    T = ids.shape[1]
    o = _unit_inner(o.reshape(B, T, -1))
    P = o.shape[-1]
    ids = ids.to(torch.int64)
    if padding_idx is not None:
        # each padding token gets its own negative id: it then matches nothing, itself included
        unique_negative = -1 - torch.arange(T, device=ids.device, dtype=torch.int64).expand(B, T)
        ids = torch.where(ids == padding_idx, unique_negative, ids)
    sorted_ids, perm = torch.sort(ids, dim=1)
    sorted_ids, perm = sorted_ids.contiguous(), perm.contiguous()
    block_t = block(T, 16, 64)
    n_tiles = cdiv(T, block_t)
    partials = new_buffer((B, n_tiles), torch.float32, o.device)
    if partials.numel():
        with device_guard(o):
            _embedding_sq_norms_kernel[(partials.numel(),)](
                sorted_ids, perm, o, partials, T, P, *_strides(o), n_tiles,
                BLOCK_T=block_t, BLOCK_P=block(P, 16, 64), num_warps=4, **dot_flags(o.dtype))
    return sum_partials(partials)
