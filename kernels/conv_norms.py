"""Per-sample squared weight-gradient norms of Conv1d / Conv2d, unfolded implicitly (DESIGN.md §2).

For sample i and group g the weight gradient is G_i = Σ_t o_{i,t} a_{i,t}ᵀ (p_g × K with
K = C_in/G · kh · kw), where a_{i,t} is the receptive field of output position t — the row t of
im2col(x_i). Neither G_i nor im2col(x_i) is ever written: the kernels load a_{i,t} straight from
the padded input by index arithmetic,

    a_{i,t}[k] = x_pad[i, g·C_in/G + c, oh·s_h + r·d_h, ow·s_w + q·d_w],   t = (oh, ow), k = (c, r, q),

so a tile of im2col is one gather (row offsets from t, column offsets from k, added). Padding is
either already in ``x_pad`` (``pdpfast.ops.conv.conv_pad``: "same", every padding_mode) or, for
the usual symmetric zero padding (``padding=``), applied by the kernels themselves: a tap at
(oh·s_h − p_h + r·d_h, ow·s_w − p_w + q·d_w) outside the unpadded input is a masked load that reads
0, the value a padded copy holds there, so the products and the norms are that copy's bit for bit,
without the copy (one launch and one pass over the input a call).

Two exact forms, chosen per layer by a cost model (``conv_norm_costs``), as fastDP's mixed ghost
clipping chooses per layer between ghost norms and per-sample gradients — here both are kernels:

- *direct*: program (i, g, p-tile, k-tile) accumulates the (BLOCK_P × BLOCK_K) tile of G_i in
  fp32 registers with ``tl.dot`` over the L output positions and writes Σ tile² as one partial.
  Work ≈ 2·L·K·p_g per sample — the same FLOPs as the non-private weight gradient of that sample.
- *Gram* (ghost): ‖G_i‖² = Σ_{s,t} (a_s·a_t)(o_s·o_t); program (i, g, tile pair {s, t}) forms the
  two (BLOCK_T × BLOCK_T) Gram tiles in registers and writes Σ of their product. Work ≈ L²·(K+p_g)
  per sample: far cheaper when L is small and channels wide (the last ResNet stages).

Partials go to a (B, programs per sample) fp32 buffer that torch sums: no atomics, deterministic.
Memory: that buffer only — direct: |W|/(BLOCK_P·BLOCK_K) floats per sample (288 for a 512→512
3×3 layer, 1/8192 of its per-sample gradient); Gram: G·n_t(n_t/2+1) — nothing of size B × |W| and
no unfolded input. Reference: ``pdpfast.ops.conv.conv_weight_sq_norms_reference``.

The same launch gives, where asked (``conv_sq_norms_rounding``, ``ROUNDING``), the call's rounding
bound ρ_i = u·Σ_q ‖o_q‖·√(‖a_q‖² [+ 1]) (``pdpfast.ops.conv.conv_scaled_sum_rounding``, whose torch
route is five more launches a call): the Gram path reads ‖a_q‖² and ‖o_q‖² off its Grams' diagonals
(the programs of shift 0), the direct path's programs each sum one chunk of the sample's positions
from whole rows they load for it (no tile of the norm holds a whole row). Its partial sums go to a
second (B, programs) block of the buffer (which then doubles), zero from the programs that hold none.
A grouped convolution's programs each hold one group: its ρ sums over them.

Measured on one H100 (ResNet-18 CIFAR layers, batch 256, GPU time by CUDA-graph replay, against
the previous path, timed with its launches): bf16 0.013-0.14 ms a layer (direct on the 32/16 px
stages, Gram on 8/4 px) against 0.3-11 ms; fp32 0.05-1.5 ms against 0.4-7.8 ms, except the
stride-1 3×3 layers at 32 and 16 px, where exact fp32 FMA products
(``_utils.FP32_DOT_PRECISION="ieee"``) lost to cuDNN's TF32 per-sample gradients (1.46 vs 0.49 ms
and 0.98 vs 0.70 ms). The cost model picked the faster form on 21 of 22 (layer, dtype) cases; the
miss was a 5% tie.

fp32 on a GPU now follows torch's policy for convolutions: where ``torch.backends.cudnn.allow_tf32``
lets cuDNN multiply in TF32 (torch's default), the kernels do too (one TF32 tensor-core product),
and clipping's bounds keep the TF32 margin that covers both the norms and cuDNN's clipped sum
(``pdpfast.clipping.rounding_margin``); with it off, they are near-fp32 tf32x3 products
(``_utils.FP32_DOT_PRECISION``). H100, 2026-11-24
(``bench_kernels --quick --dtypes fp32 --ops conv_weight_sq_norms``): layer1 0.20 ms (exact 1.55,
cuDNN's per-sample path 0.60), layer2 0.19 (1.03, 0.72), layer3 0.16 (Gram; 0.52, 0.48), layer4
0.12 (Gram; 0.30, 0.30); ResNet-18-GN's fp32 bk step went from 0.42× to 0.57× non-private.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdpfast.ops.conv import conv_sq_norms_rounding_reference
from pdpfast.ops.dispatch import register
from pdpfast.ops.linear import TF32_SLACK, tf32_allowed

from ._utils import KERNEL_DTYPES, _dot, block, cdiv, device_guard, dot_flags, grouped_offsets, new_buffer, sum_partials


@triton.jit
def _patch_column_offsets(cols_k, group, C_IN_G, tap_xh, tap_xw, stride_xc, KHW: tl.constexpr, KW: tl.constexpr):
    """Offsets of im2col columns k = (c, r, q) inside one sample's padded input
    (tap_x* = dilation × the input's stride along that axis)."""
    channel = cols_k // KHW
    within = cols_k % KHW
    return (group * C_IN_G + channel) * stride_xc + (within // KW) * tap_xh + (within % KW) * tap_xw


@triton.jit
def _padded_rows(oh, ow, STRIDE_H, STRIDE_W, PAD_H, PAD_W):
    """(ih, iw) of the top-left tap of output positions (oh, ow) in the unpadded input (< 0 in the padding)."""
    return oh * STRIDE_H - PAD_H, ow * STRIDE_W - PAD_W


@triton.jit
def _tap_shifts(cols_k, DIL_H, DIL_W, KHW: tl.constexpr, KW: tl.constexpr):
    """(Δh, Δw) of im2col columns k = (c, r, q) from their position's top-left tap."""
    within = cols_k % KHW
    return (within // KW) * DIL_H, (within % KW) * DIL_W


@triton.jit
def _inside(ih, iw, H, W):
    """Where (ih, iw) lies in the unpadded input: outside, a load reads the zero padding (masked)."""
    return (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)


@triton.jit
def _call_tensors(x_ptr, o_ptr, offsets_ptr, row, BATCH):
    """(x, o, sample) of row = call·B + sample of a grouped launch (``conv_sq_norms_grouped``)."""
    call = row // BATCH
    return (x_ptr + tl.load(offsets_ptr + 2 * call), o_ptr + tl.load(offsets_ptr + 2 * call + 1),
            row - call * BATCH)


@triton.jit
def _conv_direct_sq_norms_kernel(
        x_ptr, o_ptr, partial_ptr, C_IN_G, P_G, K, L, OW,
        stride_xb, stride_xc, step_xh, step_xw, tap_xh, tap_xw,
        stride_ob, stride_oc, stride_oh, stride_ow, N_GROUPS, N_TILES_P, N_TILES_K,
        H, W, STRIDE_H, STRIDE_W, DIL_H, DIL_W, PAD_H, PAD_W, ORIGIN, offsets_ptr, BATCH, N_PARTIALS, U,
        KHW: tl.constexpr, KW: tl.constexpr,
        BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, PADDED: tl.constexpr,
        GROUPED: tl.constexpr, ROUNDING: tl.constexpr, HAS_BIAS: tl.constexpr,
        DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # step_x* = conv stride × input stride: the move in x from one output position to the next;
    # PADDED: x is unpadded, a tap in the zero padding (PAD_H, PAD_W) is masked, and ORIGIN (the
    # padding's offset, PAD_H·stride_h + PAD_W·stride_w) shifts every offset back into x.
    # ROUNDING: the sample's N_TILES_P·N_TILES_K programs also split its output positions in as many
    # chunks, and each writes U·Σ_q ‖o_q‖·√(‖a_q‖² [+ 1]) of its chunk N_PARTIALS further on
    # (``_rounding_terms``: its own loads of whole rows, which no tile of the norm holds)
    pid = tl.program_id(0)
    tile_k = pid % N_TILES_K
    tile_p = (pid // N_TILES_K) % N_TILES_P
    group = (pid // (N_TILES_K * N_TILES_P)) % N_GROUPS
    sample = (pid // (N_TILES_K * N_TILES_P * N_GROUPS)).to(tl.int64)
    if GROUPED:  # row (call, sample): the call's tensors start offsets[2·call], offsets[2·call + 1] past x's, o's
        x_ptr, o_ptr, sample = _call_tensors(x_ptr, o_ptr, offsets_ptr, sample, BATCH)

    cols_p = tile_p * BLOCK_P + tl.arange(0, BLOCK_P)
    cols_k = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
    in_p = cols_p < P_G
    in_k = cols_k < K
    offs_k = _patch_column_offsets(cols_k, group, C_IN_G, tap_xh, tap_xw, stride_xc, KHW, KW)
    x_base = x_ptr + sample * stride_xb - ORIGIN
    o_base = o_ptr + sample * stride_ob + (group * P_G + cols_p[:, None]) * stride_oc
    if PADDED:
        dh, dw = _tap_shifts(cols_k, DIL_H, DIL_W, KHW, KW)

    grad = tl.zeros([BLOCK_P, BLOCK_K], dtype=tl.float32)
    for start in range(0, L, BLOCK_L):
        rows = start + tl.arange(0, BLOCK_L)
        in_l = rows < L
        oh = rows // OW
        ow = rows % OW
        y = tl.load(o_base + (oh * stride_oh + ow * stride_ow)[None, :],
                    mask=in_p[:, None] & in_l[None, :], other=0.0)                       # (P, L)
        x_mask = in_l[:, None] & in_k[None, :]
        if PADDED:
            ih, iw = _padded_rows(oh, ow, STRIDE_H, STRIDE_W, PAD_H, PAD_W)
            x_mask = x_mask & _inside(ih[:, None] + dh[None, :], iw[:, None] + dw[None, :], H, W)
        x = tl.load(x_base + (oh * step_xh + ow * step_xw)[:, None] + offs_k[None, :],
                    mask=x_mask, other=0.0)                                              # (L, K)
        grad = _dot(y, x, grad, DOT_PRECISION, UPCAST)
    tl.store(partial_ptr + pid, tl.sum(tl.sum(grad * grad, axis=1), axis=0))
    if ROUNDING:
        chunk = tl.cdiv(L, N_TILES_P * N_TILES_K)
        lo = (tile_p * N_TILES_K + tile_k) * chunk
        terms = _rounding_terms(x_base, o_ptr + sample * stride_ob + group * P_G * stride_oc, lo,
                                tl.minimum(lo + chunk, L), group, C_IN_G, P_G, K, OW, stride_xc, step_xh, step_xw,
                                tap_xh, tap_xw, stride_oc, stride_oh, stride_ow, H, W, STRIDE_H, STRIDE_W, DIL_H,
                                DIL_W, PAD_H, PAD_W, KHW, KW, BLOCK_L, BLOCK_K, BLOCK_P, PADDED, HAS_BIAS)
        tl.store(partial_ptr + N_PARTIALS + pid, U * terms)


@triton.jit
def _rounding_terms(x_base, o_base, lo, hi, group, C_IN_G, P_G, K, OW, stride_xc, step_xh, step_xw, tap_xh, tap_xw,
                    stride_oc, stride_oh, stride_ow, H, W, STRIDE_H, STRIDE_W, DIL_H, DIL_W, PAD_H, PAD_W,
                    KHW: tl.constexpr, KW: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_P: tl.constexpr, PADDED: tl.constexpr, HAS_BIAS: tl.constexpr):
    # Σ_q ‖o_q‖·√(‖a_q‖² [+ 1]) over output positions q in [lo, hi) of one sample and group: whole
    # patch rows a_q (every column k) and output-gradient rows o_q (every channel of the group),
    # squared and summed in fp32 (no tensor-core product), square roots correctly rounded
    terms = tl.zeros([BLOCK_L], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_L):
        rows = start + tl.arange(0, BLOCK_L)
        in_l = rows < hi
        oh = rows // OW
        ow = rows % OW
        if PADDED:
            ih, iw = _padded_rows(oh, ow, STRIDE_H, STRIDE_W, PAD_H, PAD_W)
        sq_a = tl.zeros([BLOCK_L], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            mask = in_l[:, None] & (cols < K)[None, :]
            if PADDED:
                dh, dw = _tap_shifts(cols, DIL_H, DIL_W, KHW, KW)
                mask = mask & _inside(ih[:, None] + dh[None, :], iw[:, None] + dw[None, :], H, W)
            offs_k = _patch_column_offsets(cols, group, C_IN_G, tap_xh, tap_xw, stride_xc, KHW, KW)
            a = tl.load(x_base + (oh * step_xh + ow * step_xw)[:, None] + offs_k[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            sq_a += tl.sum(a * a, axis=1)
        sq_o = tl.zeros([BLOCK_L], dtype=tl.float32)
        for p0 in range(0, P_G, BLOCK_P):
            cols = p0 + tl.arange(0, BLOCK_P)
            y = tl.load(o_base + (oh * stride_oh + ow * stride_ow)[:, None] + cols[None, :] * stride_oc,
                        mask=in_l[:, None] & (cols < P_G)[None, :], other=0.0).to(tl.float32)
            sq_o += tl.sum(y * y, axis=1)
        if HAS_BIAS:
            sq_a += 1.0
        # rows past hi: sq_o = 0, no term
        terms += tl.sqrt_rn(sq_a) * tl.sqrt_rn(sq_o)  # correctly rounded: tl.sqrt is approximate on a GPU
    return tl.sum(terms, axis=0)


@triton.jit
def _conv_gram_sq_norms_kernel(
        x_ptr, o_ptr, partial_ptr, C_IN_G, P_G, K, L, OW,
        stride_xb, stride_xc, step_xh, step_xw, tap_xh, tap_xw,
        stride_ob, stride_oc, stride_oh, stride_ow, N_GROUPS, N_TILES, N_SHIFTS,
        H, W, STRIDE_H, STRIDE_W, DIL_H, DIL_W, PAD_H, PAD_W, ORIGIN, offsets_ptr, BATCH, N_PARTIALS, U,
        KHW: tl.constexpr, KW: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, PADDED: tl.constexpr,
        GROUPED: tl.constexpr, ROUNDING: tl.constexpr, HAS_BIAS: tl.constexpr,
        DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # Both Grams are symmetric, so each unordered tile pair {s, t} is visited once: program
    # (sample, group, s, shift) takes t = (s + shift) mod n; for an even n the shift n/2 meets each
    # pair twice and one copy is dropped (as in kernels/norms.py's linear Gram kernel).
    # ROUNDING: the diagonal programs (shift 0) also write U·Σ_q ‖o_q‖·√(‖a_q‖² [+ 1]) of their
    # tile's rows, read off the Grams' diagonals, N_PARTIALS further on (0 from the other programs).
    pid = tl.program_id(0)
    shift = pid % N_SHIFTS
    tile_s = (pid // N_SHIFTS) % N_TILES
    group = (pid // (N_SHIFTS * N_TILES)) % N_GROUPS
    sample = (pid // (N_SHIFTS * N_TILES * N_GROUPS)).to(tl.int64)
    if GROUPED:
        x_ptr, o_ptr, sample = _call_tensors(x_ptr, o_ptr, offsets_ptr, sample, BATCH)
    tile_t = (tile_s + shift) % N_TILES
    keep = (2 * shift != N_TILES) | (tile_s < shift)

    rows_s = tile_s * BLOCK_T + tl.arange(0, BLOCK_T)
    rows_t = tile_t * BLOCK_T + tl.arange(0, BLOCK_T)
    in_s = rows_s < L
    in_t = rows_t < L
    oh_s = rows_s // OW
    ow_s = rows_s % OW
    oh_t = rows_t // OW
    ow_t = rows_t % OW
    product = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
    terms = tl.zeros([BLOCK_T], dtype=tl.float32)
    if keep:
        x_base = x_ptr + sample * stride_xb - ORIGIN
        offs_s = oh_s * step_xh + ow_s * step_xw
        offs_t = oh_t * step_xh + ow_t * step_xw
        ih_s, iw_s = _padded_rows(oh_s, ow_s, STRIDE_H, STRIDE_W, PAD_H, PAD_W)
        ih_t, iw_t = _padded_rows(oh_t, ow_t, STRIDE_H, STRIDE_W, PAD_H, PAD_W)
        gram_a = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            in_k = cols < K
            offs_k = _patch_column_offsets(cols, group, C_IN_G, tap_xh, tap_xw, stride_xc, KHW, KW)
            s_mask = in_s[:, None] & in_k[None, :]
            t_mask = in_k[:, None] & in_t[None, :]
            if PADDED:
                dh, dw = _tap_shifts(cols, DIL_H, DIL_W, KHW, KW)
                s_mask = s_mask & _inside(ih_s[:, None] + dh[None, :], iw_s[:, None] + dw[None, :], H, W)
                t_mask = t_mask & _inside(dh[:, None] + ih_t[None, :], dw[:, None] + iw_t[None, :], H, W)
            x_s = tl.load(x_base + offs_s[:, None] + offs_k[None, :], mask=s_mask, other=0.0)
            x_t = tl.load(x_base + offs_k[:, None] + offs_t[None, :], mask=t_mask, other=0.0)
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
        if ROUNDING:
            if shift == 0:  # rows_s = rows_t: the diagonals hold ‖a_q‖² and ‖o_q‖² (0 past L)
                on_diag = rows_s[:, None] == rows_t[None, :]
                sq_a = tl.sum(tl.where(on_diag, gram_a, 0.0), axis=1)
                sq_o = tl.sum(tl.where(on_diag, gram_o, 0.0), axis=1)
                if HAS_BIAS:
                    sq_a += 1.0
                terms = tl.sqrt_rn(sq_a) * tl.sqrt_rn(sq_o)
    tl.store(partial_ptr + pid, tl.sum(tl.sum(product, axis=1), axis=0))
    if ROUNDING:
        tl.store(partial_ptr + N_PARTIALS + pid, U * tl.sum(terms, axis=0))


# ----------------------------------------------------------------------------------------------
# Cost model
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConvNormGeometry:
    """One conv layer call as the kernels see it (all per group).

    Args:
        batch: B, samples in the call.
        groups: G, the convolution's groups.
        positions: L, output positions per sample (OH·OW).
        patch: K = C_in/G · kh · kw, the length of one im2col row.
        out_channels: p_g = C_out/G, output channels per group.
    """
    batch: int
    groups: int
    positions: int
    patch: int
    out_channels: int


@dataclass(frozen=True)
class PathCost:
    """The cost of one kernel path on one call, as ``conv_norm_costs`` counts it.

    Args:
        flops: 2 × the multiply-adds the kernel issues (padded tiles included).
        bytes: bytes its tiles load (re-reads by other programs included; mostly L2 hits).
        programs: programs the launch runs (the grid size).
        serial_steps: loop iterations one program runs.
        seconds: the estimated time on one H100 (``_H100`` below), in seconds.
    """
    flops: float
    bytes: float
    programs: int
    serial_steps: int
    seconds: float


# One H100 SXM as these kernels see it, fitted to their measured times on the ResNet-18 CIFAR
# layers (batch 256; bench_kernels): the throughput the kernels reach, not the data-sheet peaks.
# fp32 runs tl.dot with input_precision="ieee" on the FMA units, fp16/bf16 on the tensor cores.
# A tile load gathers through L1/L2 (each input element is re-read by up to kh·kw patch columns
# and by every p-tile), so tile bytes move at an L2-like rate. Each loop step of a program waits
# about a memory latency (nothing to overlap it with when a program has few steps), and every
# program costs a fixed launch/reduction/store overhead, which decides for small L.
_H100 = {
    "flops_per_s": {torch.float32: 25e12, "tf32": 150e12, torch.float16: 300e12, torch.bfloat16: 300e12},
    "tile_bytes_per_s": 20e12,
    "step_latency_s": 1.0e-6,
    "program_overhead_s": 15e-9,
    "resident_programs": 132 * 4,
}


def _direct_blocks(geo: ConvNormGeometry, dtype: torch.dtype):
    """(BLOCK_L, BLOCK_K, BLOCK_P) of the direct kernel. H100 sweep (ResNet-18 layers): 128-wide
    p-tiles beat 64 by 15-35% from 128 channels up, in fp32 too; fp32 prefers 32-row steps."""
    return (block(geo.positions, 16, 32 if dtype == torch.float32 else 64), block(geo.patch, 16, 64),
            block(geo.out_channels, 16, 128))


def _gram_blocks(geo: ConvNormGeometry, dtype: torch.dtype):
    """(BLOCK_T, BLOCK_K, BLOCK_P) of the Gram kernel."""
    return block(geo.positions, 16, 64), block(geo.patch, 16, 64), block(geo.out_channels, 16, 64)


def _estimate(flops, nbytes, programs, steps, dtype, tf32=False) -> float:
    hw = _H100
    waves = cdiv(programs, hw["resident_programs"])
    rate = hw["flops_per_s"]["tf32"] if tf32 and dtype == torch.float32 else \
        hw["flops_per_s"].get(dtype, hw["flops_per_s"][torch.float32])
    return (flops / rate
            + nbytes / hw["tile_bytes_per_s"] + waves * steps * hw["step_latency_s"]
            + programs * hw["program_overhead_s"])


def conv_norm_costs(geo: ConvNormGeometry, dtype: torch.dtype, tf32: bool = False) -> dict[str, PathCost]:
    """FLOPs, bytes, programs, serial steps and an H100 time estimate of each kernel path,
    counted on the tiles the kernel actually runs.

    direct: per (sample, group) n_p·n_k programs, each ⌈L/BLOCK_L⌉ steps of a (BLOCK_P × BLOCK_L)
    · (BLOCK_L × BLOCK_K) product; the patch tile is re-read by every p-tile and the
    output-gradient tile by every k-tile. Gram: per (sample, group) n_t(n_t+1)/2 tile pairs, each
    ⌈K/BLOCK_K⌉ + ⌈p/BLOCK_P⌉ steps of (BLOCK_T × BLOCK_*) · (BLOCK_* × BLOCK_T) products, loading
    four row tiles per step.

    Args:
        geo: the call's geometry (``conv_geometry``).
        dtype: the tiles' dtype (fp32/fp16/bf16): sets the element size and the FLOP rate.
        tf32: fp32 tiles multiply as TF32 on the tensor cores (the rate assumed, not fitted: half of bf16's).
    Returns:
        {"direct": PathCost, "gram": PathCost}.
    """
    elt = torch.finfo(dtype).bits // 8
    per_sample = geo.batch * geo.groups

    bl, bk, bp = _direct_blocks(geo, dtype)
    n_l, n_k, n_p = cdiv(geo.positions, bl), cdiv(geo.patch, bk), cdiv(geo.out_channels, bp)
    programs = per_sample * n_p * n_k
    flops = 2.0 * programs * bp * bk * (n_l * bl + 1)
    nbytes = float(programs * elt * n_l * bl * (bk + bp))
    direct = PathCost(flops, nbytes, programs, n_l, _estimate(flops, nbytes, programs, n_l, dtype, tf32))

    bt, bk, bp = _gram_blocks(geo, dtype)
    n_t = cdiv(geo.positions, bt)
    pairs = per_sample * n_t * (n_t + 1) // 2
    n_k, n_p = cdiv(geo.patch, bk), cdiv(geo.out_channels, bp)
    programs = per_sample * n_t * (n_t // 2 + 1)
    flops = 2.0 * pairs * bt * bt * (n_k * bk + n_p * bp + 1)
    nbytes = float(pairs * elt * 2 * bt * (n_k * bk + n_p * bp))
    gram = PathCost(flops, nbytes, programs, n_k + n_p, _estimate(flops, nbytes, programs, n_k + n_p, dtype, tf32))
    return {"direct": direct, "gram": gram}


def choose_path(geo: ConvNormGeometry, dtype: torch.dtype, tf32: bool = False) -> str:
    """The kernel path with the smaller estimated time; ties go to direct (no L² term to grow).

    Args:
        geo: the call's geometry (``conv_geometry``).
        dtype: the tiles' dtype.
        tf32: as in ``conv_norm_costs``.
    Returns:
        "gram" or "direct".
    """
    costs = conv_norm_costs(geo, dtype, tf32)
    return "gram" if costs["gram"].seconds < costs["direct"].seconds else "direct"


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------
def _pair(v) -> tuple[int, int]:
    return (1, v[0]) if len(v) == 1 else (v[0], v[1])


def _geometry(x_shape, o_shape, kernel, stride, dilation, groups) -> ConvNormGeometry:
    B, C_in, H, W = x_shape if len(x_shape) == 4 else (x_shape[0], x_shape[1], 1, x_shape[2])
    C_out, OH, OW = o_shape[1:] if len(o_shape) == 4 else (o_shape[1], 1, o_shape[2])
    if o_shape[0] != B or C_in % groups or C_out % groups:
        raise ValueError(f"conv norms: input {tuple(x_shape)}, output gradient {tuple(o_shape)} and "
                         f"groups={groups} do not fit together")
    want = tuple((n - d * (k - 1) - 1) // s + 1 for n, k, s, d in zip((H, W), kernel, stride, dilation))
    if (OH, OW) != want:
        raise ValueError(f"conv norms: output gradient {tuple(o_shape)} does not match the padded input "
                         f"{tuple(x_shape)} (expected spatial size {want}); pass conv_pad(x), or x unpadded with "
                         "padding= the zero padding the layer applies")
    return ConvNormGeometry(B, groups, OH * OW, C_in // groups * kernel[0] * kernel[1], C_out // groups)


def conv_geometry(x_pad: torch.Tensor, o: torch.Tensor, module) -> ConvNormGeometry:
    """Shape checks and the geometry of one call (Conv1d or Conv2d tensors).

    Args:
        x_pad: (B, C_in, [H,] W) the input already padded by ``conv_pad``.
        o: (B, C_out, [OH,] OW) the gradient w.r.t. the convolution output.
        module: supplies ``kernel_size``, ``stride``, ``dilation`` and ``groups``.
    Returns:
        the call's ``ConvNormGeometry``.
    Raises:
        ValueError when the batch sizes differ, a channel count is not divisible by ``groups``, or
        ``o``'s spatial size is not the one ``x_pad`` gives (e.g. an unpadded input).
    """
    return _geometry(tuple(x_pad.shape), tuple(o.shape), _pair(module.kernel_size), _pair(module.stride),
                     _pair(module.dilation), module.groups)


@dataclass(frozen=True)
class _Launch:
    kernel: object
    batch: int
    columns: int         # programs (= partial sums) per sample
    args: tuple          # the scalar arguments after (x, o, partials)
    meta: dict           # constexprs and launch options


@functools.lru_cache(maxsize=4096)
def _plan(x_shape, x_stride, o_shape, o_stride, dtype, kernel, stride, dilation, groups, path, tf32,
          padding=(0, 0)) -> _Launch:
    """Everything about a launch that depends only on shapes, strides and the layer: computed
    once per layer geometry, so a call costs one dictionary lookup on the host besides the launch.
    ``padding``: (p_h, p_w), the zero padding the kernel applies to the unpadded x by masking."""
    height, width = (1, x_shape[2]) if len(x_shape) == 3 else x_shape[2:]
    padded = (*x_shape[:-2], height + 2 * padding[0], width + 2 * padding[1]) if len(x_shape) == 4 else \
        (*x_shape[:-1], width + 2 * padding[1])
    geo = _geometry(padded, o_shape, kernel, stride, dilation, groups)
    if path == "auto":
        path = choose_path(geo, dtype, tf32)
    if len(x_shape) == 3:  # Conv1d: a height of 1, whose strides are never multiplied by anything but 0
        x_stride = (x_stride[0], x_stride[1], 0, x_stride[2])
        o_stride = (o_stride[0], o_stride[1], 0, o_stride[2])
    sxb, sxc, sxh, sxw = x_stride
    args = (geo.patch // (kernel[0] * kernel[1]), geo.out_channels, geo.patch, geo.positions, o_shape[-1],
            sxb, sxc, stride[0] * sxh, stride[1] * sxw, dilation[0] * sxh, dilation[1] * sxw, *o_stride, groups)
    masked = (height, width, *stride, *dilation, *padding, padding[0] * sxh + padding[1] * sxw)
    meta = {"KHW": kernel[0] * kernel[1], "KW": kernel[1], "PADDED": any(padding), "num_warps": 4}
    if path == "direct":
        block_l, block_k, block_p = _direct_blocks(geo, dtype)
        n_p, n_k = cdiv(geo.out_channels, block_p), cdiv(geo.patch, block_k)
        return _Launch(_conv_direct_sq_norms_kernel, geo.batch, groups * n_p * n_k, args + (n_p, n_k) + masked,
                       dict(meta, BLOCK_L=block_l, BLOCK_K=block_k, BLOCK_P=block_p))
    block_t, block_k, block_p = _gram_blocks(geo, dtype)
    n_tiles = cdiv(geo.positions, block_t)
    n_shifts = n_tiles // 2 + 1
    return _Launch(_conv_gram_sq_norms_kernel, geo.batch, groups * n_tiles * n_shifts,
                   args + (n_tiles, n_shifts) + masked, dict(meta, BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_P=block_p))


def _launch(plan: _Launch, x0: torch.Tensor, o0: torch.Tensor, rows: int, offsets, tf32: bool, u: float,
            with_bias: bool) -> tuple:
    """Run ``plan`` for ``rows`` samples (n calls × B in a grouped launch, read at ``offsets``; None: one
    call). Returns (sq, rho): (rows, programs) fp32 partial sums each, rho None without ``u``."""
    flags = dot_flags(x0.dtype, tf32)
    if u and x0.dtype == torch.float32 and flags["DOT_PRECISION"] == "tf32":
        # the Gram path reads ρ's row norms off TF32 products (operands cut to 2^-10); the direct path
        # takes no product for ρ and gets the slack too (a larger bound: the safe side)
        u *= TF32_SLACK
    rounding = bool(u)
    partials = new_buffer(((2 if rounding else 1) * rows, plan.columns), torch.float32, x0.device)
    if not partials.numel():  # an empty batch (or no output positions: a zero gradient)
        zeros = torch.zeros(2 if rounding else 1, rows, 1, dtype=torch.float32, device=x0.device)
        return zeros[0], (zeros[1] if rounding else None)
    with device_guard(x0):
        plan.kernel[(rows * plan.columns,)](
            x0, o0, partials, *plan.args, partials if offsets is None else offsets, plan.batch,
            rows * plan.columns, float(u), **plan.meta, GROUPED=offsets is not None, ROUNDING=rounding,
            HAS_BIAS=with_bias, **flags)
    return (partials[:rows], partials[rows:]) if rounding else (partials, None)


def _plan_of(x: torch.Tensor, o: torch.Tensor, module, path: str, pads: tuple, tf32: bool) -> _Launch:
    return _plan(tuple(x.shape), x.stride(), tuple(o.shape), o.stride(), x.dtype, _pair(module.kernel_size),
                 _pair(module.stride), _pair(module.dilation), module.groups, path, tf32, pads)


def _common_dtype(x: torch.Tensor, o: torch.Tensor) -> tuple:
    """(x, o) in one dot operand type (autocast keeps fp32 inputs beside bf16 gradients)."""
    if x.dtype != o.dtype:
        common = torch.promote_types(x.dtype, o.dtype)
        x, o = x.to(common), o.to(common)
    return x, o


def _runs_kernel(x: torch.Tensor, o: torch.Tensor) -> bool:
    return x.dim() in (3, 4) and o.dim() == x.dim() and x.dtype in KERNEL_DTYPES and o.dtype in KERNEL_DTYPES


@register("conv_weight_sq_norms")
def conv_weight_sq_norms(x_pad: torch.Tensor, o: torch.Tensor, module, path: str = "auto", *, padding=None,
                         parts: bool = False) -> torch.Tensor:
    """‖∂ℓ_i/∂W‖²_F per sample of a Conv1d/Conv2d weight, the unfolding done inside the kernel.

    Memory: a (B, programs per sample) fp32 buffer of partial sums; never the per-sample gradients
    nor the unfolded input, nor (``padding``) a padded copy of the input.

    Args:
        x_pad: (B, C_in, [H,] W) the input already padded by ``conv_pad``, or with ``padding`` still
            to apply; fp32/fp16/bf16, any strides (channels_last too); mixed dtypes meet in their
            promoted dtype.
        o: (B, C_out, [OH,] OW) the gradient of the summed loss w.r.t. the convolution output,
            fp32/fp16/bf16, any strides.
        module: supplies kernel_size, stride, dilation and groups (any object with those attributes).
        path: "auto" (the cheaper of the two by ``conv_norm_costs``), "direct" or "gram".
        padding: None, or the zero padding still to apply to ``x_pad``, one int ≥ 0 per spatial dim
            (the same on both sides): the kernel reads taps in it as zeros (masked loads), so no
            padded copy is made (one launch and one pass over the input fewer per call).
        parts: return the (B, programs) partial sums the launch wrote, whose rows sum to the norms
            (the caller sums them with other layers', once: ``LayerRule.norm_parts``), not (B,).
    Returns:
        (B,) fp32 (with ``parts``, (B, n) fp32), accumulated in fp32. float64 (and any rank other
        than Conv1d/Conv2d) runs ``conv_weight_sq_norms_reference`` and returns its (B,) result.
    Raises:
        ValueError for an unknown ``path``, a ``padding`` that is not one int ≥ 0 per spatial dim,
        or tensors whose shapes do not fit (``conv_geometry``).
    """
    return conv_sq_norms_rounding(x_pad, o, module, False, 0.0, padding, parts, path=path)[0]


@register("conv_sq_norms_rounding")
def conv_sq_norms_rounding(x_pad: torch.Tensor, o: torch.Tensor, module, with_bias: bool, u: float, padding=None,
                           parts: bool = False, *, path: str = "auto") -> tuple:
    """A conv call's per-sample squared weight norms and its clipped sum's rounding bound
    ρ_i = u·Σ_q ‖o_q‖·√(‖a_q‖² [+ 1]) (``pdpfast.ops.conv.conv_scaled_sum_rounding``) from one launch:
    on the Gram path ρ's row norms come off the Grams' diagonals, on the direct path each program also
    sums one chunk of the sample's output positions. One launch where the torch route of ρ takes five
    (two reductions, a one-channel convolution, a square root and a batched dot).

    Args:
        x_pad, o, module, path, padding, parts: as in ``conv_weight_sq_norms``; with ``parts`` ρ comes as
            (B, n) partial sums too, of the norms' n.
        with_bias: the bias is among the call's parameters (its column of ones in ‖a_q‖² + 1; its own
            norms are not included: ``conv_bias_sq_norms``).
        u: the unit roundoff of the clipped sum's row scaling (``pdpfast.nn.rules.scaling_roundoff``);
            0: no ρ (None).
    Returns:
        (sq, rho): each (B,) fp32, or (B, n) with ``parts``; rho None where ``u`` is 0. float64 and
        other ranks take the references (then (B,) whatever ``parts``). For a grouped convolution ρ
        sums over its groups (each program's are one group's), as the reference does.
    Raises:
        as ``conv_weight_sq_norms``.
    """
    if path not in ("auto", "gram", "direct"):
        raise ValueError(f"path must be 'auto', 'gram' or 'direct', got {path!r}")
    if not _runs_kernel(x_pad, o):
        return conv_sq_norms_rounding_reference(x_pad, o, module, with_bias, u, padding)
    pads = _paddings(padding, x_pad.dim() - 2)
    x_pad, o = _common_dtype(x_pad, o)
    # fp32 on a GPU follows torch's policy for convolutions: TF32 products where cuDNN may use them
    # (torch.backends.cudnn.allow_tf32, on by default), exact ones otherwise
    tf32 = x_pad.is_cuda and tf32_allowed("conv")
    plan = _plan_of(x_pad, o, module, path, pads, tf32)
    sq, rho = _launch(plan, x_pad, o, plan.batch, None, tf32, u, with_bias)
    if parts:
        return sq, rho
    return sum_partials(sq), (None if rho is None else sum_partials(rho))


def _groups_conv_norms(x: torch.Tensor, o: torch.Tensor, *others: torch.Tensor) -> bool:
    """Where calls' norms group into one launch: Conv1d/Conv2d calls whose input and output gradient
    share one kernel dtype, decided on the first call's (x, o) (the launcher checks that the others
    match its shapes and strides)."""
    return x.dim() in (3, 4) and o.dim() == x.dim() and x.dtype in KERNEL_DTYPES and o.dtype == x.dtype


@register("conv_sq_norms_grouped", when=_groups_conv_norms)
def conv_sq_norms_grouped(calls: list, module, padding=None, u: float = 0.0, with_bias: bool = False) -> tuple:
    """``conv_sq_norms_rounding(..., parts=True)`` of n calls of one layer shape from one launch: program
    ((call, sample), ...) finds its call's input and output gradient at an offset from the first call's,
    read from a table of the n calls' offsets. One launch instead of n: a norm launch costs ~0.1 ms of
    host time on an H200 (bench/README.md, "session 38"), and a ResNet's stages repeat their convolutions.

    Args:
        calls: n ≥ 1 pairs (x, o) of one shape, strides, dtype and device: inputs (unpadded where
            ``padding`` is given) and output gradients of convolutions with ``module``'s kernel size,
            stride, dilation and groups.
        module: supplies those (the first call's layer).
        padding: as in ``conv_weight_sq_norms``.
        u, with_bias: as in ``conv_sq_norms_rounding``; u = 0: no ρ.
    Returns:
        (sq, rho): (n, B, K) fp32 partial sums each, row c what call c's own launch writes with ``parts``;
        rho None where ``u`` is 0. Calls that do not all match the first one's shapes, strides, dtype and
        device, or whose tensors do not start on a whole element, run one launch each (then lists of n
        (B, K_c) partial sums).
    """
    x0, o0 = calls[0]
    offsets = grouped_offsets(calls, x0.element_size())
    if offsets is None:
        each = [conv_sq_norms_rounding(x, o, module, with_bias, u, padding=padding, parts=True) for x, o in calls]
        return [_as_parts(sq) for sq, _ in each], (None if not u else [_as_parts(rho) for _, rho in each])
    tf32 = x0.is_cuda and tf32_allowed("conv")
    plan = _plan_of(x0, o0, module, "auto", _paddings(padding, x0.dim() - 2), tf32)
    n = len(calls)
    sq, rho = _launch(plan, x0, o0, n * plan.batch, offsets, tf32, u, with_bias)
    sq = sq.view(n, plan.batch, sq.shape[1])
    return sq, (None if rho is None else rho.view(n, plan.batch, rho.shape[1]))


def _as_parts(sq: torch.Tensor) -> torch.Tensor:
    return sq.unsqueeze(1) if sq.dim() == 1 else sq


def _paddings(padding, n: int) -> tuple[int, int]:
    """(p_h, p_w) of ``conv_weight_sq_norms``' ``padding`` for n spatial dims (Conv1d: p_h = 0)."""
    if padding is None:
        return (0, 0)
    try:  # ints of any integer type (a module built with numpy ints keeps them)
        pads = tuple(operator.index(p) for p in padding if not isinstance(p, bool))
    except TypeError:
        pads = ()
    if len(pads) != n or len(padding) != n or any(p < 0 for p in pads):
        raise ValueError(f"padding must be None or {n} int(s) ≥ 0 (one per spatial dim), got {padding!r}")
    return (0, pads[0]) if n == 1 else pads
