"""Normalization layers: ``nn.LayerNorm``, ``GroupNorm``, ``RMSNorm``, ``InstanceNorm1d/2d/3d``, and
modules that compute an RMSNorm under another name (``DPRMSNormForm``: Hugging Face's).

Each normalizes every sample on its own, so its affine parameters have exact per-sample gradients
as small as the parameters themselves (``pdpfast.ops.norm``): they are formed directly. BatchNorm
is not here: it mixes the samples of a batch (``convert`` refuses it).
"""
from __future__ import annotations

import functools
import inspect
import math
import numbers

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import norm as norm_ops
from .layers import DPModule
from .rules import LayerRule, Stacked, register_form, register_layer, register_rule


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


class _WeightAndEps:
    """What an RMSNorm form's forward reads of its module (``DPRMSNormForm``): ``weight`` and
    ``variance_epsilon``. Its forward runs on one of these, so it computes on the weight it is given."""

    __slots__ = ("weight", "variance_epsilon")

    def __init__(self, weight, variance_epsilon):
        self.weight, self.variance_epsilon = weight, variance_epsilon


def _takes_one_input(forward) -> bool:
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(params) == 2 and all(p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty for p in params)


@functools.cache
def _computes_rms_norm(forward) -> bool:
    """Whether ``forward(module, x)``, reading only the module's ``weight`` and ``variance_epsilon``,
    computes ``weight · x / sqrt(mean(x², -1) + eps)``: float32 probes of two shapes, a random weight
    (so ``1 + weight`` or ``weight²`` differ) and an ε large enough to matter."""
    gen = torch.Generator().manual_seed(0)
    for shape in ((2, 3, 8), (1, 8)):
        x = torch.randn(shape, generator=gen) * 0.5
        weight, eps = torch.randn(8, generator=gen), 0.25
        try:
            with torch.no_grad():
                out = forward(_WeightAndEps(weight, eps), x)
        except Exception:  # reads something else of its module, or fails on the probe: not this form
            return False
        if not (isinstance(out, torch.Tensor) and out.shape == x.shape and out.dtype == x.dtype
                and torch.allclose(out, F.rms_norm(x, (8,), weight, eps), rtol=1e-5, atol=1e-6)):
            return False
    return True


@functools.cache
def _own_forward(cls: type):
    """The forward of the first class in ``cls``'s MRO that is not a DP class: the module's own."""
    return next(vars(c)["forward"] for c in cls.__mro__ if not issubclass(c, DPModule) and "forward" in vars(c))


class DPRMSNormForm(DPModule):
    """A module whose forward is an RMSNorm's without being ``nn.RMSNorm``: Hugging Face copies
    Llama's ``weight * (x / sqrt(mean(x²) + variance_epsilon))`` (normalized in float32) into each
    model family under the family's own name (``LlamaRMSNorm``, ``MistralRMSNorm``,
    ``Qwen2RMSNorm``, ``T5LayerNorm``, ... about 150 classes in transformers 5).

    ``convert`` mixes it into the module's own class when ``recognizes(module)``: what the module's
    forward computes is checked, not its name. The private forward is the module's own forward run on
    the detached weight, so outputs are the model's bit for bit; the weight's per-sample gradient is
    Σ_t o_t ⊙ x̂_t, as ``nn.RMSNorm``'s. Forms that compute something else (Gemma's ``1 + weight``, a
    gated norm taking a second input) are not recognized and stay refused by name.
    """

    @property
    def normalized_shape(self) -> tuple:
        """The weight's shape: the trailing dims normalized (read by the per-sample rule)."""
        return tuple(self._parameters["weight"].shape)

    @property
    def eps(self) -> float:
        """``variance_epsilon``, the ε added to the mean square (read by the per-sample rule)."""
        return float(self.variance_epsilon)

    @classmethod
    def recognizes(cls, module: nn.Module) -> bool:
        """Whether ``module`` computes an RMSNorm and can be trained as one.

        Args:
            module: a module of a class with no registered DP class.
        Returns:
            True for a leaf module whose one parameter is a 1-D ``weight``, with a real, finite
            ``variance_epsilon`` ≥ 0, whose forward takes one input and computes ``weight · x /
            sqrt(mean(x², -1) + variance_epsilon)`` on float32 probes (checked once per forward).
        """
        eps = getattr(module, "variance_epsilon", None)
        if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 <= eps < math.inf:
            return False
        if next(module.children(), None) is not None:
            return False
        params = dict(module.named_parameters(recurse=False))
        if list(params) != ["weight"] or params["weight"].dim() != 1:
            return False
        forward = _own_forward(type(module))
        return _takes_one_input(forward) and _computes_rms_norm(forward)

    def _compute(self, x, p):
        return _own_forward(type(self))(_WeightAndEps(p["weight"], self.variance_epsilon), x)


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
def _rms_norm_form_grads(x, o, module) -> dict:
    # x̂ as the module's own forward forms it (Llama's normalizes in float32 whatever x's dtype): its
    # output at a weight of ones, so the per-sample gradient is autograd's of that forward
    if x.dtype != torch.float64:
        return norm_ops.rms_norm_per_sample_grads(x, o, module)
    weight = module._parameters["weight"]
    x_hat = _own_forward(type(module))(_WeightAndEps(torch.ones_like(weight), module.variance_epsilon), x)
    per_position = x_hat * o  # (B, ..., d): summed over the positions between
    middle = tuple(range(1, per_position.dim() - 1))
    return {"weight": per_position.sum(middle) if middle else per_position}  # sum(()) would sum everything


register_rule(DPRMSNormForm, rule=_norm_rule(_rms_norm_form_grads, lambda m: (tuple(m.normalized_shape), m.eps)))
register_form(DPRMSNormForm)
register_layer((nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d), DPInstanceNorm,
               _norm_rule(norm_ops.instance_norm_per_sample_grads, lambda m: (m.num_features, m.eps),
                          stacks=_torch_route))
