"""Normalization layers: ``nn.LayerNorm``, ``GroupNorm``, ``RMSNorm`` and ``InstanceNorm1d/2d/3d``.

Each normalizes every sample on its own, so its affine parameters have exact per-sample gradients
as small as the parameters themselves (``pdpfast.ops.norm``): they are formed directly. BatchNorm
is not here: it mixes the samples of a batch (``convert`` refuses it).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import norm as norm_ops
from .layers import DPModule
from .rules import LayerRule, Stacked, register_layer


class DPLayerNorm(DPModule, nn.LayerNorm):
    """``nn.LayerNorm`` with per-sample clipping of its affine parameters.

    Args:
        normalized_shape, eps, elementwise_affine, bias, device, dtype: as ``nn.LayerNorm`` (weight and
            bias of shape ``normalized_shape``); ``convert`` makes one from an existing layer.

    ``forward(x)``: x (B, ..., *normalized_shape) float → the same shape and dtype.
    """

    def _compute(self, x, p):
        return F.layer_norm(x, self.normalized_shape, p.get("weight"), p.get("bias"), self.eps)


class DPGroupNorm(DPModule, nn.GroupNorm):
    """``nn.GroupNorm`` with per-sample clipping of its affine parameters (each sample normalized on its own).

    Args:
        num_groups, num_channels, eps, affine, device, dtype: as ``nn.GroupNorm`` (weight and bias (C,));
            ``convert`` makes one from an existing layer.

    ``forward(x)``: x (B, C, *) float → the same shape and dtype.
    """

    def _compute(self, x, p):
        return F.group_norm(x, self.num_groups, p.get("weight"), p.get("bias"), self.eps)


class DPRMSNorm(DPModule, nn.RMSNorm):
    """``nn.RMSNorm`` with per-sample clipping of its weight.

    Args:
        normalized_shape, eps, elementwise_affine, device, dtype: as ``nn.RMSNorm`` (weight of shape
            ``normalized_shape``); ``convert`` makes one from an existing layer.

    ``forward(x)``: x (B, ..., *normalized_shape) float → the same shape and dtype.
    """

    def _compute(self, x, p):
        return F.rms_norm(x, self.normalized_shape, p.get("weight"), self.eps)


class DPInstanceNorm(DPModule, nn.modules.instancenorm._InstanceNorm):
    """InstanceNorm1d/2d/3d with ``track_running_stats=False`` (``convert`` refuses running stats:
    they would be updated from the batch's data outside any privacy accounting).

    Args:
        num_features, eps, momentum, affine, track_running_stats, device, dtype: as
            ``nn.InstanceNorm1d/2d/3d`` (weight and bias (C,) when ``affine``); ``convert`` makes one
            from an existing layer. ``track_running_stats`` must be False.

    ``forward(x)``: x (B, C, L), (B, C, H, W) or (B, C, D, H, W) float → the same shape and dtype,
    always normalized with each sample's own statistics.
    """

    @classmethod
    def unsupported_options(cls, module):
        """Why ``module`` cannot be converted, or None.

        Args:
            module: an ``nn.InstanceNorm1d/2d/3d``.
        Returns:
            the reason when it tracks running statistics; None otherwise.
        """
        if module.track_running_stats:
            return ("track_running_stats=True updates running statistics from the batch's data, outside any "
                    "privacy accounting; set track_running_stats=False (training normalizes each sample on its own)")
        return None

    def _compute(self, x, p):
        if x.shape[0] == 0:  # torch's instance_norm fails on an empty batch (an empty Poisson draw); the
            # same normalization as GroupNorm with one channel a group returns its empty output
            return F.group_norm(x, x.shape[1], p.get("weight"), p.get("bias"), self.eps)
        return F.instance_norm(x, None, None, p.get("weight"), p.get("bias"), True, 0.0, self.eps)


def _norm_rule(per_sample_grads, config, stacks=None) -> LayerRule:
    """Normalization layers: per-sample gradients as small as the parameters, formed directly.

    Their math is per sample, so n same-shape calls stack along the batch: one normalization over
    (n·B, ...) forms every call's per-sample gradients. ``config(module)``: what the math reads
    from the module (calls stack only when it is equal). ``stacks(x, o)``: False for calls whose
    route costs one op anyway (GroupNorm's C++ kernel on a CPU, its Triton kernel on a GPU), where
    stacking would only copy x and o.
    """
    def per_sample(m, x, o):  # the ops take (x, o, module) like the other ops
        return per_sample_grads(x, o, m)

    def key(m, x, o, names):
        if stacks is not None and not stacks(x, o):
            return None
        return type(m), config(m), x.shape, o.shape, o.dtype, o.device, names

    def stacked_grads(calls) -> list:
        n, B = len(calls), calls[0][1].shape[0]
        x = torch.stack([c[1] for c in calls]).flatten(0, 1)
        o = torch.stack([c[2] for c in calls]).flatten(0, 1)
        grads = per_sample(calls[0][0], x, o)
        return [(name, grads[name].reshape(n, B, math.prod(grads[name].shape[1:]))) for name in calls[0][3]]

    def stacked_sq_norms(calls):
        total = None
        for _, g in stacked_grads(calls):
            sq = (g if g.dtype in (torch.float32, torch.float64) else g.float()).pow(2).sum(2)
            total = sq if total is None else total.add_(sq)
        return total

    def stacked_clipped(calls, weights):  # weights (B,) shared or (n, B) per call
        w = weights.unsqueeze(-2)  # (1, B) or (n, 1, B): a batched row vector
        per_name = [(name, torch.matmul(w.to(g.dtype), g).flatten(0, -2).unbind(0))
                    for name, g in stacked_grads(calls)]
        return [{name: grads[i] for name, grads in per_name} for i in range(len(calls))]

    return LayerRule(per_sample, stacked=Stacked(key, stacked_sq_norms, stacked_clipped))


register_layer(nn.LayerNorm, DPLayerNorm, _norm_rule(norm_ops.layer_norm_per_sample_grads,
                                                     lambda m: (tuple(m.normalized_shape), m.eps)))


def _torch_route(x, o) -> bool:
    return not norm_ops.group_norm_in_one_op(x, o)


register_layer(nn.GroupNorm, DPGroupNorm, _norm_rule(norm_ops.group_norm_per_sample_grads,
                                                     lambda m: (m.num_groups, m.eps), stacks=_torch_route))
register_layer(nn.RMSNorm, DPRMSNorm, _norm_rule(norm_ops.rms_norm_per_sample_grads,
                                                 lambda m: (tuple(m.normalized_shape), m.eps)))
register_layer((nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d), DPInstanceNorm,
               _norm_rule(norm_ops.instance_norm_per_sample_grads, lambda m: (m.num_features, m.eps),
                          stacks=_torch_route))
