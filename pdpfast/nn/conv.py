"""Convolutions: ``nn.Conv1d``/``Conv2d``/``Conv3d`` (stride, padding incl. "same", dilation,
groups, padding modes), one rule for all three (``pdpfast.ops.conv``).

A layer whose padding is symmetric zeros lets its convolution pad (no copy of the input) and its
rule's ops apply the same padding; any other padding (modes, asymmetric "same") pads the input
itself (``_prepare``), so the rule sees the padded input and every padding mode is exact.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import conv as conv_ops
from ..ops import linear as lin_ops
from .layers import DPModule
from .rules import Grouped, LayerRule, register_layer, scaling_roundoff


class _DPConv(DPModule):
    """Pads in the convolution itself where it can (zero padding, the same on both sides of each
    dim: the usual case), so the input is kept as it is; otherwise (padding modes, "same" with an
    even kernel) ``_prepare`` pads the input and the convolution runs unpadded."""

    _conv = None  # F.conv1d / conv2d / conv3d

    def own_padding(self) -> tuple[int, ...] | None:
        """The zero padding the layer's convolution applies itself.

        Returns:
            a tuple of ints, one per spatial dim (the same on both sides), when the padding is
            symmetric zeros; None when the input is padded beforehand instead (``conv_ops.conv_pad``:
            padding modes other than "zeros", or asymmetric "same" padding).
        """
        pads, mode, padding = self._reversed_padding_repeated_twice, self.padding_mode, self.padding
        known = self.__dict__.get("_own_padding")  # asked ~5 times a call: kept while the padding stays
        if known is not None and known[0] is pads and known[1] == mode and known[2] == padding:
            return known[3]
        own = None
        if mode == "zeros" and not isinstance(padding, str):
            # what torch's forward pads with in this mode: ``self.padding`` (set after construction too)
            own = tuple(padding) if isinstance(padding, (tuple, list)) else (padding,) * len(self.kernel_size)
        elif mode == "zeros" and all(pads[k] == pads[k + 1] for k in range(0, len(pads), 2)):
            own = tuple(reversed(pads[0::2]))
        self.__dict__["_own_padding"] = (pads, mode, padding, own)
        return own

    def _prepare(self, x):
        return x if self.own_padding() is not None else conv_ops.conv_pad(x, self)

    def _compute(self, x, p):
        return type(self)._conv(x, p["weight"], p.get("bias"), self.stride, self.own_padding() or 0, self.dilation,
                                self.groups)


class DPConv1d(_DPConv, nn.Conv1d):
    """``nn.Conv1d`` with per-sample clipping (stride, padding incl. "same", dilation, groups, padding modes).

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode,
            device, dtype: as ``nn.Conv1d`` (weight (C_out, C_in / groups, k), bias (C_out,));
            ``convert`` makes one from an existing layer.

    ``forward(x)``: x (B, C_in, L) float → (B, C_out, L_out).
    """

    _conv = F.conv1d


class DPConv2d(_DPConv, nn.Conv2d):
    """``nn.Conv2d`` with per-sample clipping (stride, padding incl. "same", dilation, groups, padding modes).

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode,
            device, dtype: as ``nn.Conv2d`` (weight (C_out, C_in / groups, k_h, k_w), bias (C_out,));
            ``convert`` makes one from an existing layer.

    ``forward(x)``: x (B, C_in, H, W) float → (B, C_out, H_out, W_out).
    """

    _conv = F.conv2d


class DPConv3d(_DPConv, nn.Conv3d):
    """``nn.Conv3d`` with per-sample clipping (stride, padding incl. "same", dilation, groups, padding modes).

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode,
            device, dtype: as ``nn.Conv3d`` (weight (C_out, C_in / groups, k_d, k_h, k_w), bias (C_out,));
            ``convert`` makes one from an existing layer.

    ``forward(x)``: x (B, C_in, D, H, W) float → (B, C_out, D_out, H_out, W_out).
    """

    _conv = F.conv3d


def _conv_per_sample(m, x, o):
    out = {"weight": conv_ops.conv_per_sample_grads(x, o, m, m.own_padding())}
    if m.bias is not None:
        out["bias"] = o.flatten(2).sum(-1)
    return out


def _conv_sq_norms(m, x, o, names, parts: bool = False):
    """(B,) squared norms; with ``parts``, the weight's as the kernel's (B, n) partial sums where it
    runs, the bias's a column beside them (one op either way: the sum or the concatenation)."""
    total = conv_ops.conv_weight_sq_norms(x, o, m, m.own_padding(), parts) if "weight" in names else None
    if "bias" not in names:
        return total
    bias = conv_ops.conv_bias_sq_norms(o)
    return bias if total is None else _plus_bias(total, bias)


def _plus_bias(sq: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The weight's squared norms ``sq`` with the bias's ``bias`` (B,): added to (B,) norms, a column
    beside (B, n) partial sums."""
    if sq.dim() == 2:
        return torch.cat([sq, bias.to(sq.dtype).unsqueeze(1)], 1)
    return sq.add_(bias)


def _conv_sq_norms_rounding(m, x, o, names, parts: bool = False):
    """(sq, ρ or None) of one call: the weight's norms and ρ from one launch where the kernel runs
    (``conv_sq_norms_rounding``), the bias's norms a column beside them (ρ then summed: its partial
    sums have no column for the bias)."""
    u = scaling_roundoff(o, "conv")  # the weight gradient is cuDNN's, in TF32 for fp32 where torch lets cuDNN
    if not u or "weight" not in names:
        return _conv_sq_norms(m, x, o, names, parts), _conv_rounding(m, x, o, names)
    sq, rho = conv_ops.conv_sq_norms_rounding(x, o, m, "bias" in names, u, m.own_padding(), parts)
    return _with_bias(sq, rho, o, names)


def _with_bias(sq: torch.Tensor, rho: torch.Tensor | None, o: torch.Tensor, names) -> tuple:
    """(sq, rho) of a call's weight with its bias's norms added (``_plus_bias``) where the call has it,
    and rho then as (B,) (no partial sum of it goes with the bias's column)."""
    if "bias" not in names:
        return sq, rho
    return _plus_bias(sq, conv_ops.conv_bias_sq_norms(o)), (rho if rho is None or rho.dim() == 1 else rho.sum(1))


def _conv_clipped(m, x, o, weights, names):
    grad_w, grad_b = conv_ops.conv_clipped_grads(x, o, weights, m, "weight" in names, "bias" in names,
                                                 m.own_padding())
    return {n: g for n, g in (("weight", grad_w), ("bias", grad_b)) if n in names}


def _conv_rounding(m, x, o, names):
    u = scaling_roundoff(o, "conv")
    if not u:
        return None
    return conv_ops.conv_scaled_sum_rounding(x, o, m, "weight" in names, "bias" in names, m.own_padding(), u)


def _small_per_sample_weight(m, x, o, kept: bool) -> bool:
    """Conv calls form per-sample gradients where they are small next to the call (``prefer_per_sample``),
    unless the implicit Gram gives their norms for less: then norms and one weight gradient on scaled
    output gradients beat forming them (GroupNorm CNN's 64->128 layer at 8 px: its bk step 1-2%
    faster on 1 and 2 threads, interleaved A/B), and nothing of size B × |W| is kept. On a GPU never,
    kept or not (``kept`` is not used): the fused conv norm kernels form nothing, and no cost model of
    forming them there has been checked against a GPU."""
    return (lin_ops.prefer_per_sample(x.shape[0] * m.weight.numel(), x, o)
            and not conv_ops.implicit_gram_pays(x, o, m, m.own_padding()))


def _conv_group_key(m, x, o, names):
    """Calls whose norms share one launch (``Grouped``): the weight's, of one shape, strides, dtype,
    device and layer geometry (a ResNet stage's repeated convolutions), where the kernel runs."""
    if "weight" not in names or not conv_ops.groups_conv_norms(x, o):  # (which asks for one kernel dtype)
        return None
    return x.shape, x.stride(), o.shape, o.stride(), o.dtype, o.device, _geometry(m), "bias" in names


def _geometry(m) -> tuple:
    """What of a conv module its norms read beside its tensors (a grouped launch reads the first call's)."""
    return m.kernel_size, m.stride, m.dilation, m.groups, m.own_padding()


def _conv_grouped_norms_and_rounding(calls, bound):
    """(sq, rho) of n calls of one ``_conv_group_key`` from one launch: sq[c] call c's (B, K) partial sums
    (its bias's a column beside them), rho[c] its ρ (likewise, or (B,) beside a bias), or rho None. Calls
    whose modules' geometries disagree (one changed since the engine kept its key: its dilation and
    padding together, say, which leave the shapes as they were) take their own launches."""
    m0, _, o0, names = calls[0]
    if any(_geometry(m) != _geometry(m0) for m, _, _, _ in calls[1:]):
        each = [_CONV_RULE.norms_and_rounding(m, x, o, n, bound=bound, parts=True) for m, x, o, n in calls]
        rho = [r for _, r in each]
        return [sq for sq, _ in each], (None if all(r is None for r in rho) else rho)
    u = scaling_roundoff(o0, "conv") if bound else 0.0
    sq, rho = conv_ops.conv_sq_norms_grouped([(x, o) for _, x, o, _ in calls], m0, m0.own_padding(), u,
                                             "bias" in names)
    if "bias" not in names:
        return sq, rho
    pairs = [_with_bias(s, None if rho is None else rho[c], calls[c][2], names) for c, s in enumerate(sq)]
    return [s for s, _ in pairs], (None if rho is None else [r for _, r in pairs])


_CONV_RULE = LayerRule(_conv_per_sample, _conv_sq_norms, _conv_clipped, materialize_when=_small_per_sample_weight,
                       rounding=_conv_rounding, sq_norms_rounding=_conv_sq_norms_rounding, norm_parts=True,
                       pending_weights=True, grouped=Grouped(_conv_group_key, _conv_grouped_norms_and_rounding))
register_layer(nn.Conv1d, DPConv1d, _CONV_RULE)
register_layer(nn.Conv2d, DPConv2d, _CONV_RULE)
register_layer(nn.Conv3d, DPConv3d, _CONV_RULE)
