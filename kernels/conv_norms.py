"""Per-sample squared weight-gradient norms of Conv1d / Conv2d, unfolded implicitly (DESIGN.md §2).

For sample i and group g the weight gradient is G_i = Σ_t o_{i,t} a_{i,t}ᵀ (p_g × K with
K = C_in/G · kh · kw), where a_{i,t} is the receptive field of output position t — the row t of
im2col(x_i). Neither G_i nor im2col(x_i) is ever written: the kernels load a_{i,t} straight from
the padded input by index arithmetic,

    a_{i,t}[k] = x_pad[i, g·C_in/G + c, oh·s_h + r·d_h, ow·s_w + q·d_w],   t = (oh, ow), k = (c, r, q),

so a tile of im2col is one gather (row offsets from t, column offsets from k, added). Padding is
already in ``x_pad`` (``pdpfast.ops.conv.conv_pad``: ints, "same", every padding_mode), so the
kernels see zero padding only and never test bounds beyond the tile masks.

Two exact forms, chosen per layer by a cost model (``conv_norm_costs``), as fastDP's mixed ghost
clipping chooses per layer between ghost norms and per-sample gradients — here both are kernels:

- *direct*: program (i, g, p-tile, k-tile) accumulates the (BLOCK_P × BLOCK_K) tile of G_i in
  fp32 registers with ``tl.dot`` over the L output positions and writes Σ tile² as one partial.
  Work ≈ 2·L·K·p_g per sample — the same FLOPs as the non-private weight gradient of that sample.
- *Gram* (ghost): ‖G_i‖² = Σ_{s,t} (a_s·a_t)(o_s·o_t); program (i, g, tile pair {s, t}) forms the
  two (BLOCK_T × BLOCK_T) Gram tiles in registers and writes Σ of their product. Work ≈ L²·(K+p_g)
  per sample: far cheaper when L is small and channels wide (the last ResNet stages).

Partials go to a (B, n_programs_per_sample) fp32 buffer that torch sums: no atomics, deterministic.
Memory: that buffer only (B × a few thousand floats at most) — nothing of size B × |W| and no
unfolded input. Reference: ``pdpfast.ops.conv.conv_weight_sq_norms_reference``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdpfast.ops.conv import as_conv2d, conv_weight_sq_norms_reference

from ._utils import KERNEL_DTYPES, _dot, block, device_guard, dot_flags, new_buffer, sum_partials


@triton.jit
def _patch_column_offsets(cols_k, group, C_IN_G, KHW, KW, DIL_H, DIL_W, stride_xc, stride_xh, stride_xw):
    """Offsets of im2col columns k = (c, r, q) inside one sample's padded input."""
    channel = cols_k // KHW
    within = cols_k % KHW
    r = within // KW
    q = within % KW
    return (group * C_IN_G + channel) * stride_xc + r * DIL_H * stride_xh + q * DIL_W * stride_xw


@triton.jit
def _conv_direct_sq_norms_kernel(
        x_ptr, o_ptr, partial_ptr, C_IN_G, P_G, K, L, OW, KHW, KW,
        stride_xb, stride_xc, stride_xh, stride_xw, stride_ob, stride_oc, stride_oh, stride_ow,
        STRIDE_H, STRIDE_W, DIL_H, DIL_W, N_GROUPS, N_TILES_P, N_TILES_K,
        BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
        DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    tile_k = pid % N_TILES_K
    tile_p = (pid // N_TILES_K) % N_TILES_P
    group = (pid // (N_TILES_K * N_TILES_P)) % N_GROUPS
    sample = (pid // (N_TILES_K * N_TILES_P * N_GROUPS)).to(tl.int64)

    cols_p = tile_p * BLOCK_P + tl.arange(0, BLOCK_P)
    cols_k = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
    in_p = cols_p < P_G
    in_k = cols_k < K
    offs_k = _patch_column_offsets(cols_k, group, C_IN_G, KHW, KW, DIL_H, DIL_W, stride_xc, stride_xh, stride_xw)
    x_base = x_ptr + sample * stride_xb
    o_base = o_ptr + sample * stride_ob + (group * P_G + cols_p[:, None]) * stride_oc

    grad = tl.zeros([BLOCK_P, BLOCK_K], dtype=tl.float32)
    for start in range(0, L, BLOCK_L):
        rows = start + tl.arange(0, BLOCK_L)
        in_l = rows < L
        oh = rows // OW
        ow = rows % OW
        y = tl.load(o_base + (oh * stride_oh + ow * stride_ow)[None, :],
                    mask=in_p[:, None] & in_l[None, :], other=0.0)                       # (P, L)
        offs_l = oh * STRIDE_H * stride_xh + ow * STRIDE_W * stride_xw
        x = tl.load(x_base + offs_l[:, None] + offs_k[None, :],
                    mask=in_l[:, None] & in_k[None, :], other=0.0)                       # (L, K)
        grad = _dot(y, x, grad, DOT_PRECISION, UPCAST)
    tl.store(partial_ptr + pid, tl.sum(tl.sum(grad * grad, axis=1), axis=0))


@triton.jit
def _conv_gram_sq_norms_kernel(
        x_ptr, o_ptr, partial_ptr, C_IN_G, P_G, K, L, OW, KHW, KW,
        stride_xb, stride_xc, stride_xh, stride_xw, stride_ob, stride_oc, stride_oh, stride_ow,
        STRIDE_H, STRIDE_W, DIL_H, DIL_W, N_GROUPS, N_TILES, N_SHIFTS,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
        DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # Both Grams are symmetric, so each unordered tile pair {s, t} is visited once: program
    # (sample, group, s, shift) takes t = (s + shift) mod n; for an even n the shift n/2 meets each
    # pair twice and one copy is dropped (as in kernels/norms.py's linear Gram kernel).
    pid = tl.program_id(0)
    shift = pid % N_SHIFTS
    tile_s = (pid // N_SHIFTS) % N_TILES
    group = (pid // (N_SHIFTS * N_TILES)) % N_GROUPS
    sample = (pid // (N_SHIFTS * N_TILES * N_GROUPS)).to(tl.int64)
    tile_t = (tile_s + shift) % N_TILES
    keep = (2 * shift != N_TILES) | (tile_s < shift)

    rows_s = tile_s * BLOCK_T + tl.arange(0, BLOCK_T)
    rows_t = tile_t * BLOCK_T + tl.arange(0, BLOCK_T)
    in_s = rows_s < L
    in_t = rows_t < L
    oh_s, ow_s = rows_s // OW, rows_s % OW
    oh_t, ow_t = rows_t // OW, rows_t % OW
    product = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
    if keep:
        x_base = x_ptr + sample * stride_xb
        offs_s = oh_s * STRIDE_H * stride_xh + ow_s * STRIDE_W * stride_xw
        offs_t = oh_t * STRIDE_H * stride_xh + ow_t * STRIDE_W * stride_xw
        gram_a = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            in_k = cols < K
            offs_k = _patch_column_offsets(cols, group, C_IN_G, KHW, KW, DIL_H, DIL_W,
                                           stride_xc, stride_xh, stride_xw)
            x_s = tl.load(x_base + offs_s[:, None] + offs_k[None, :], mask=in_s[:, None] & in_k[None, :], other=0.0)
            x_t = tl.load(x_base + offs_k[:, None] + offs_t[None, :], mask=in_k[:, None] & in_t[None, :], other=0.0)
            gram_a = _dot(x_s, x_t, gram_a, DOT_PRECISION, UPCAST)
        o_base = o_ptr + sample * stride_ob + group * P_G * stride_oc
        pos_s = oh_s * stride_oh + ow_s * stride_ow
        pos_t = oh_t * stride_oh + ow_t * stride_ow
        gram_o = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
        for start in range(0, P_G, BLOCK_P):
            cols = start + tl.arange(0, BLOCK_P)
            in_p = cols < P_G
            y_s = tl.load(o_base + pos_s[:, None] + cols[None, :] * stride_oc,
                          mask=in_s[:, None] & in_p[None, :], other=0.0)
            y_t = tl.load(o_base + cols[:, None] * stride_oc + pos_t[None, :],
                          mask=in_p[:, None] & in_t[None, :], other=0.0)
            gram_o = _dot(y_s, y_t, gram_o, DOT_PRECISION, UPCAST)
        # an off-diagonal pair stands for (s, t) and (t, s)
        product = gram_a * gram_o * tl.where(shift == 0, 1.0, 2.0)
    tl.store(partial_ptr + pid, tl.sum(tl.sum(product, axis=1), axis=0))


# ----------------------------------------------------------------------------------------------
# Cost model
# ----------------------------------------------------------------------------------------------
# Roofline of one H100 SXM, rounded to what dense Triton kernels reach: fp32 with
# input_precision="ieee" runs on the FMA units (no tensor cores); fp16/bf16 on the tensor cores.
# Only the ratio of the two paths' estimates matters for the choice.
_PEAK_FLOPS = {torch.float32: 40e12, torch.float16: 500e12, torch.bfloat16: 500e12}
_PEAK_BYTES_PER_S = 2.5e12


@dataclass(frozen=True)
class ConvNormGeometry:
    """One conv layer call as the kernels see it (all per group)."""
    batch: int
    groups: int
    positions: int       # L: output positions per sample (OH·OW)
    patch: int           # K: C_in/G · kh · kw, one im2col row
    out_channels: int    # p_g: C_out/G


@dataclass(frozen=True)
class PathCost:
    flops: float         # multiply-adds × 2 the kernel issues (padded tiles included)
    bytes: float         # bytes its tiles load (re-reads of the same data by other programs included)
    seconds: float       # roofline estimate on an H100: flops/peak + bytes/bandwidth
    programs: int


def _direct_blocks(geo: ConvNormGeometry, dtype: torch.dtype):
    return (block(geo.positions, 16, 32 if dtype == torch.float32 else 64), block(geo.patch, 16, 64),
            block(geo.out_channels, 16, 64))


def _gram_blocks(geo: ConvNormGeometry, dtype: torch.dtype):
    return block(geo.positions, 16, 64), block(geo.patch, 16, 64), block(geo.out_channels, 16, 64)


def _gram_pairs(n_tiles: int) -> int:
    """Tile pairs a Gram program grid visits per (sample, group) (the dropped duplicates excluded)."""
    return n_tiles * (n_tiles + 1) // 2


def conv_norm_costs(geo: ConvNormGeometry, dtype: torch.dtype) -> dict[str, PathCost]:
    """FLOPs, bytes and an H100 roofline time of each kernel path, counted on the tiles it runs.

    direct: per (sample, group) n_p·n_k programs, each a (BLOCK_P × L) · (L × BLOCK_K) product; the
    input patch tile is re-read by every p-tile and the output-gradient tile by every k-tile.
    Gram: per (sample, group) n_t(n_t+1)/2 tile pairs, each two (BLOCK_T × K) · (K × BLOCK_T) and
    (BLOCK_T × p) · (p × BLOCK_T) products loading four row tiles.
    """
    elt = torch.finfo(dtype).bits // 8
    per_sample = geo.batch * geo.groups
    peak = _PEAK_FLOPS.get(dtype, _PEAK_FLOPS[torch.float32])

    bl, bk, bp = _direct_blocks(geo, dtype)
    n_l, n_k, n_p = triton.cdiv(geo.positions, bl), triton.cdiv(geo.patch, bk), triton.cdiv(geo.out_channels, bp)
    flops = 2.0 * per_sample * (n_p * bp) * (n_k * bk) * (n_l * bl + 1)
    nbytes = float(per_sample * elt * n_l * bl * (n_p * n_k * bk + n_k * n_p * bp))
    direct = PathCost(flops, nbytes, flops / peak + nbytes / _PEAK_BYTES_PER_S, per_sample * n_p * n_k)

    bt, bk, bp = _gram_blocks(geo, dtype)
    n_t = triton.cdiv(geo.positions, bt)
    pairs = _gram_pairs(n_t)
    k_pad, p_pad = triton.cdiv(geo.patch, bk) * bk, triton.cdiv(geo.out_channels, bp) * bp
    flops = 2.0 * per_sample * pairs * bt * bt * (k_pad + p_pad + 1)
    nbytes = float(per_sample * elt * pairs * 2 * bt * (k_pad + p_pad))
    gram = PathCost(flops, nbytes, flops / peak + nbytes / _PEAK_BYTES_PER_S,
                    per_sample * n_t * (n_t // 2 + 1))
    return {"direct": direct, "gram": gram}


def choose_path(geo: ConvNormGeometry, dtype: torch.dtype) -> str:
    """The kernel path with the smaller estimated time; ties go to direct (no T² term to grow)."""
    costs = conv_norm_costs(geo, dtype)
    return "gram" if costs["gram"].seconds < costs["direct"].seconds else "direct"


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------
def conv_geometry(x_pad: torch.Tensor, o: torch.Tensor, module) -> ConvNormGeometry:
    """Shape checks and the geometry of one call (Conv1d or Conv2d tensors)."""
    x4, o4, kernel, stride, dilation = as_conv2d(x_pad, o, module)
    B, C_in, H, W = x4.shape
    G = module.groups
    C_out, OH, OW = o4.shape[1:]
    if o4.shape[0] != B or C_in % G or C_out % G:
        raise ValueError(f"conv norms: input {tuple(x_pad.shape)}, output gradient {tuple(o.shape)} and "
                         f"groups={G} do not fit together")
    want = tuple((n - d * (k - 1) - 1) // s + 1 for n, k, s, d in zip((H, W), kernel, stride, dilation))
    if (OH, OW) != want:
        raise ValueError(f"conv norms: output gradient {tuple(o.shape)} does not match the padded input "
                         f"{tuple(x_pad.shape)} (expected spatial size {want}); pass conv_pad(x)")
    return ConvNormGeometry(B, G, OH * OW, C_in // G * kernel[0] * kernel[1], C_out // G)


def conv_weight_sq_norms(x_pad: torch.Tensor, o: torch.Tensor, module, path: str = "auto") -> torch.Tensor:
    """‖∂ℓ_i/∂W‖²_F per sample of a Conv1d/Conv2d weight, the unfolding done inside the kernel.

    x_pad: (B, C_in, [H,] W) the input already padded by ``conv_pad``; o: (B, C_out, [OH,] OW) the
    gradient of the summed loss w.r.t. the convolution output; ``module`` supplies kernel_size,
    stride, dilation and groups (any object with those attributes). fp32/fp16/bf16, any strides
    (channels_last too), fp32 accumulation; returns (B,) fp32. ``path``: "auto" (the cheaper of the
    two by ``conv_norm_costs``), "direct" or "gram". Memory: a (B, programs per sample) fp32
    buffer of partial sums; never the per-sample gradients nor the unfolded input.
    float64 (and any rank other than Conv1d/Conv2d) runs ``conv_weight_sq_norms_reference``.
    """
    if path not in ("auto", "gram", "direct"):
        raise ValueError(f"path must be 'auto', 'gram' or 'direct', got {path!r}")
    if (x_pad.dim() not in (3, 4) or o.dim() != x_pad.dim() or x_pad.dtype not in KERNEL_DTYPES
            or o.dtype not in KERNEL_DTYPES):
        return conv_weight_sq_norms_reference(x_pad, o, module)
    geo = conv_geometry(x_pad, o, module)
    if geo.batch == 0:
        return torch.zeros(0, dtype=torch.float32, device=o.device)
    if x_pad.dtype != o.dtype:  # one dot operand type (autocast keeps fp32 inputs beside bf16 grads)
        common = torch.promote_types(x_pad.dtype, o.dtype)
        x_pad, o = x_pad.to(common), o.to(common)
    x4, o4, kernel, stride, dilation = as_conv2d(x_pad, o, module)
    if path == "auto":
        path = choose_path(geo, x4.dtype)
    common_args = (geo.patch // (kernel[0] * kernel[1]), geo.out_channels, geo.patch, geo.positions, o4.shape[3],
                   kernel[0] * kernel[1], kernel[1], *x4.stride(), *o4.stride(), *stride, *dilation, geo.groups)
    flags = dot_flags(x4.dtype)
    with device_guard(x4):
        if path == "direct":
            block_l, block_k, block_p = _direct_blocks(geo, x4.dtype)
            n_p, n_k = triton.cdiv(geo.out_channels, block_p), triton.cdiv(geo.patch, block_k)
            partials = new_buffer((geo.batch, geo.groups * n_p * n_k), torch.float32, x4.device)
            _conv_direct_sq_norms_kernel[(partials.numel(),)](
                x4, o4, partials, *common_args, n_p, n_k,
                BLOCK_L=block_l, BLOCK_K=block_k, BLOCK_P=block_p, num_warps=4, **flags)
        else:
            block_t, block_k, block_p = _gram_blocks(geo, x4.dtype)
            n_tiles = triton.cdiv(geo.positions, block_t)
            n_shifts = n_tiles // 2 + 1
            partials = new_buffer((geo.batch, geo.groups * n_tiles * n_shifts), torch.float32, x4.device)
            if not partials.numel():  # no output positions: the gradient is zero
                return torch.zeros(geo.batch, dtype=torch.float32, device=x4.device)
            _conv_gram_sq_norms_kernel[(partials.numel(),)](
                x4, o4, partials, *common_args, n_tiles, n_shifts,
                BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_P=block_p, num_warps=4, **flags)
    return sum_partials(partials)
