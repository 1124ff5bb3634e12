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
from ..ops.clip import weights_to
from .layers import DPModule
from .rules import Grouped, LayerRule, Stacked, register_form, register_layer, register_rule


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


_EPS_NAMES = ("variance_epsilon", "eps")  # what Hugging Face's norms call their ε


@functools.cache
def _module_class(cls: type) -> type:
    """The first class in ``cls``'s MRO that is not a DP class: the module's own."""
    return next(c for c in cls.__mro__ if not issubclass(c, DPModule))


def _eps_name(module: nn.Module) -> str | None:
    """The one ε attribute of ``module`` (``_EPS_NAMES``) that is a real, finite number ≥ 0, or None."""
    names = [n for n in _EPS_NAMES if n in vars(module)]
    if len(names) != 1:
        return None
    eps = vars(module)[names[0]]
    return names[0] if isinstance(eps, numbers.Real) and not isinstance(eps, bool) and 0 <= eps < math.inf else None


def _bare(cls: type, weight: torch.Tensor, eps_name: str, eps: float) -> nn.Module:
    """An instance of ``cls`` that holds ``weight`` and its ε and nothing else: its forward (and the
    helper methods it calls, e.g. Gemma's ``_norm``) can read nothing more, not even ``training``."""
    bare = object.__new__(cls)
    bare.__dict__.update({"_parameters": {"weight": weight}, "_buffers": {}, "_modules": {}, eps_name: eps})
    return bare


def _takes_one_input(forward) -> bool:
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(params) == 2 and all(p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty for p in params)


@functools.cache
def _computes_rms_norm(cls: type, eps_name: str) -> bool:
    """Whether ``cls``'s forward, reading only ``weight`` and its ε, is ``f(w) = c + w · x /
    sqrt(mean(x², -1) + ε)`` with ``c`` not depending on w: ``f(w) − f(0)`` equals ``nn.RMSNorm``'s
    output for two random weights (so ``weight²`` differs), float32 probes of two shapes and an ε
    large enough to matter. Llama's form has c = 0, Gemma's ``(1 + weight)`` c = x̂."""
    if not _takes_one_input(cls.forward):
        return False
    gen = torch.Generator().manual_seed(0)
    for shape in ((2, 3, 8), (1, 8)):
        x = torch.randn(shape, generator=gen) * 0.5
        eps = 0.25
        try:
            with torch.no_grad():
                base = cls.forward(_bare(cls, torch.zeros(8), eps_name, eps), x)
                for _ in range(2):
                    weight = torch.randn(8, generator=gen)
                    out = cls.forward(_bare(cls, weight, eps_name, eps), x)
                    if not (isinstance(out, torch.Tensor) and out.shape == x.shape and out.dtype == x.dtype
                            and torch.allclose(out - base, F.rms_norm(x, (8,), weight, eps), rtol=1e-5,
                                               atol=1e-6)):
                        return False
        except Exception:  # reads something else of its module, or fails on the probe: not this form
            return False
    return True


class DPRMSNormForm(DPModule):
    """A module whose forward is an RMSNorm's without being ``nn.RMSNorm``: Hugging Face copies
    Llama's ``weight * (x / sqrt(mean(x²) + variance_epsilon))`` (normalized in float32) into each
    model family under the family's own name (``LlamaRMSNorm``, ``MistralRMSNorm``,
    ``Qwen2RMSNorm``, ``T5LayerNorm``, ... about 140 classes in transformers 5.24), and Gemma's norms
    scale by ``1 + weight`` (the same per-sample gradient: the weight enters with slope x̂).

    ``convert`` mixes it into the module's own class when ``recognizes(module)``: what the module's
    forward computes is checked, not its name. The private forward is the module's own forward run on
    the detached weight, so outputs are the model's bit for bit; the weight's per-sample gradient is
    Σ_t o_t ⊙ x̂_t as ``nn.RMSNorm``'s (one kernel launch on a GPU), and in float64 autograd's of the
    module's own forward, sample by sample (``torch.func``), which may compute in float32 (Llama's x̂,
    Gemma's output) where ``nn.RMSNorm`` would not. Forms that compute something else (a weight
    squared, a mean subtracted, a gated norm taking a second input, a forward reading ``training``)
    are not recognized and stay refused by name.
    """

    @property
    def normalized_shape(self) -> tuple:
        """The weight's shape: the trailing dims normalized (read by the per-sample rule)."""
        return tuple(self._parameters["weight"].shape)

    @property
    def eps(self) -> float:
        """The ε added to the mean square (``variance_epsilon`` or ``eps``; read by the per-sample rule)."""
        return float(vars(self)[_eps_name(self)])

    @classmethod
    def recognizes(cls, module: nn.Module) -> bool:
        """Whether ``module`` computes an RMSNorm and can be trained as one.

        Args:
            module: a module of a class with no registered DP class.
        Returns:
            True for a leaf module whose one parameter is a 1-D ``weight``, with one ε attribute
            (``variance_epsilon`` or ``eps``: a real, finite number ≥ 0), whose forward takes one input
            and, reading nothing but the weight and ε, computes ``c + weight · x / sqrt(mean(x², -1) + ε)``
            (c independent of the weight) on float32 probes (checked once per class).
        """
        eps_name = _eps_name(module)
        if eps_name is None or next(module.children(), None) is not None:
            return False
        params = dict(module.named_parameters(recurse=False))
        if list(params) != ["weight"] or params["weight"].dim() != 1:
            return False
        return _computes_rms_norm(_module_class(type(module)), eps_name)

    def _own(self, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The module's own forward of ``x`` with ``weight`` in place of its weight."""
        cls, name = _module_class(type(self)), _eps_name(self)
        return cls.forward(_bare(cls, weight, name, vars(self)[name]), x)

    def _compute(self, x, p):
        return self._own(p["weight"], x)


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


def _norm_rule(per_sample_grads, config, stacks=None, grouped_grads=None, family="layer_norm") -> LayerRule:
    """Normalization layers: per-sample gradients as small as the parameters, formed directly.

    Their math is per sample, so n same-shape calls stack along the batch: one normalization over
    (n·B, ...) forms every call's per-sample gradients. ``config(module)``: what the math reads
    from the module (calls stack only when it is equal). ``stacks(x, o)``: False for calls whose
    route costs one op anyway (GroupNorm's C++ kernel on a CPU, its Triton kernel on a GPU), where
    stacking would only copy x and o. ``grouped_grads(calls, module)``: the per-sample gradients of
    n large calls (x, o) of one configuration, shape and strides from one launch, without copying
    them (``Grouped``), where ``pdpfast.ops.norm.groups_norm_grads`` says the kernel of ``family``
    runs.
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
        per_name = [(name, torch.matmul(weights_to(w, g.dtype), g).flatten(0, -2).unbind(0))
                    for name, g in stacked_grads(calls)]
        return [{name: grads[i] for name, grads in per_name} for i in range(len(calls))]

    grouped = None
    if grouped_grads is not None:
        def settings(m):  # what of the module one launch reads from its first call's for all
            return type(m), config(m), getattr(m, "bias", None) is not None

        def group_key(m, x, o, names):
            if not norm_ops.groups_norm_grads(x, o, family):
                return None
            return settings(m), x.shape, x.stride(), o.shape, o.stride(), o.dtype, o.device, names

        def grouped_per_sample(calls):
            m0 = calls[0][0]
            if any(settings(m) != settings(m0) for m, _, _, _ in calls):  # e.g. an ε changed since the
                return [per_sample(m, x, o) for m, x, o, _ in calls]     # engine kept the key: apart
            return grouped_grads([(x, o) for _, x, o, _ in calls], m0)
        grouped = Grouped(group_key, per_sample_grads=grouped_per_sample)

    return LayerRule(per_sample, stacked=Stacked(key, stacked_sq_norms, stacked_clipped), grouped=grouped)


register_layer(nn.LayerNorm, DPLayerNorm, _norm_rule(norm_ops.layer_norm_per_sample_grads,
                                                     lambda m: (tuple(m.normalized_shape), m.eps),
                                                     grouped_grads=norm_ops.layer_norm_per_sample_grads_grouped))


def _torch_route(x, o) -> bool:
    return not norm_ops.group_norm_in_one_op(x, o)


register_layer(nn.GroupNorm, DPGroupNorm, _norm_rule(norm_ops.group_norm_per_sample_grads,
                                                     lambda m: (m.num_groups, m.eps), stacks=_torch_route,
                                                     grouped_grads=norm_ops.group_norm_per_sample_grads_grouped,
                                                     family="group_norm"))
register_layer(nn.RMSNorm, DPRMSNorm, _norm_rule(norm_ops.rms_norm_per_sample_grads,
                                                 lambda m: (tuple(m.normalized_shape), m.eps),
                                                 grouped_grads=norm_ops.rms_norm_per_sample_grads_grouped))
def _rms_norm_form_grads(x, o, module) -> dict:
    # nn.RMSNorm's op (one launch on a GPU: the forms' own forwards take about eight), which computes
    # x̂ in float32 for float32 and lower precisions as the forms do, up to roundings. In float64,
    # autograd's per-sample gradient of the module's own forward (a vector-Jacobian product per
    # sample): the forms may compute in float32 even then (Llama's x̂, Gemma's whole output), which
    # nn.RMSNorm's op would not.
    if x.dtype != torch.float64:
        return norm_ops.rms_norm_per_sample_grads(x, o, module)
    weight = module._parameters["weight"].detach()

    def one_sample(x_i, o_i):
        return torch.func.vjp(lambda w: module._own(w, x_i), weight)[1](o_i)[0]
    return {"weight": torch.func.vmap(one_sample)(x, o)}


# (grouped: the kernel's calls only, never float64's)
register_rule(DPRMSNormForm, rule=_norm_rule(_rms_norm_form_grads, lambda m: (tuple(m.normalized_shape), m.eps),
                                             grouped_grads=norm_ops.rms_norm_per_sample_grads_grouped))
register_form(DPRMSNormForm)
register_layer((nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d), DPInstanceNorm,
               _norm_rule(norm_ops.instance_norm_per_sample_grads, lambda m: (m.num_features, m.eps),
                          stacks=_torch_route, grouped_grads=norm_ops.instance_norm_per_sample_grads_grouped,
                          family="group_norm"))
