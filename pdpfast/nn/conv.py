"""Convolutions: ``nn.Conv1d``/``Conv2d``/``Conv3d`` (stride, padding incl. "same", dilation,
groups, padding modes), one rule for all three (``pdpfast.ops.conv``).

The layer pads its input itself (``_prepare``), so the rule sees the padded input and every
padding mode is exact.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from ..ops import conv as conv_ops
from ..ops import linear as lin_ops
from .layers import DPModule
from .rules import LayerRule, register_layer


class DPConv1d(DPModule, nn.Conv1d):
    def _prepare(self, x):
        return conv_ops.conv_pad(x, self)

    def _compute(self, x, p):
        return F.conv1d(x, p["weight"], p.get("bias"), self.stride, 0, self.dilation, self.groups)


class DPConv2d(DPModule, nn.Conv2d):
    def _prepare(self, x):
        return conv_ops.conv_pad(x, self)

    def _compute(self, x, p):
        return F.conv2d(x, p["weight"], p.get("bias"), self.stride, 0, self.dilation, self.groups)


class DPConv3d(DPModule, nn.Conv3d):
    def _prepare(self, x):
        return conv_ops.conv_pad(x, self)

    def _compute(self, x, p):
        return F.conv3d(x, p["weight"], p.get("bias"), self.stride, 0, self.dilation, self.groups)


def _conv_per_sample(m, x, o):
    out = {"weight": conv_ops.conv_per_sample_grads(x, o, m)}
    if m.bias is not None:
        out["bias"] = o.flatten(2).sum(-1)
    return out


def _conv_sq_norms(m, x, o, names):
    total = conv_ops.conv_weight_sq_norms(x, o, m) if "weight" in names else None
    if "bias" in names:
        bias = conv_ops.conv_bias_sq_norms(o)
        total = bias if total is None else total.add_(bias)
    return total


def _conv_clipped(m, x, o, weights, names):
    grad_w, grad_b = conv_ops.conv_clipped_grads(x, o, weights, m, "weight" in names, "bias" in names)
    return {n: g for n, g in (("weight", grad_w), ("bias", grad_b)) if n in names}


def _small_per_sample_weight(m, x, o) -> bool:
    """Conv calls form per-sample gradients where they are small next to the call (``prefer_per_sample``)."""
    return lin_ops.prefer_per_sample(x.shape[0] * m.weight.numel(), x, o)


_CONV_RULE = LayerRule(_conv_per_sample, _conv_sq_norms, _conv_clipped, materialize_when=_small_per_sample_weight)
register_layer(nn.Conv1d, DPConv1d, _CONV_RULE)
register_layer(nn.Conv2d, DPConv2d, _CONV_RULE)
register_layer(nn.Conv3d, DPConv3d, _CONV_RULE)
