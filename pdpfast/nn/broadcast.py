"""Parameters outside layers: class tokens, position embeddings and layer-scale factors.

Vision transformers keep some parameters in modules that are not layers: a class token
concatenated to every sample's patch sequence, position embeddings added to every sample, a
layer-scale vector multiplying every activation. Each has an exact, cheap per-sample gradient.

* **Batch-broadcast parameters** (shape (1, ...), used as if they were one row of a batch): inside
  a private forward the host module sees each such parameter as the (B, ...) tensor
  ``p.expand(B, ...)``, so autograd delivers the gradient of that tensor — row i is sample i's
  gradient of p, summed over every use of p in the host's forward. ``broadcast_parameters(*names)``
  makes a host class; ``register_broadcast_host`` registers one for ``convert``. Only register a
  module whose forward uses these parameters batch-aligned (row i of the expanded tensor only ever
  meets sample i: ``expand(batch_size, ...)``, concatenation along a non-batch dim, a broadcast
  add). A forward that indexes dim 0 (``p[0]``) or reshapes it away would mix samples; shapes
  usually expose this (a clear error names the module), which is why hosts are registered
  explicitly and never guessed.
* **Layer scale** (``DPLayerScale``): a leaf module computing ``x * γ`` with γ broadcast over the
  leading dims; the per-sample gradient of γ is ``x ⊙ ∂L/∂y`` summed to γ's shape.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops.linear import weights_as
from .layers import DPModule
from .rules import LayerRule, exact_scaling, register_layer, register_rule


class BroadcastParameterFunction(torch.autograd.Function):
    """(1, ...) parameter → (B, ...) expanded view whose backward reports the per-sample gradient
    (B, ...) to the clipping state. The parameter itself gets no autograd gradient."""

    @staticmethod
    def forward(ctx, param, batch_size, call):
        """The parameter as one row per sample.

        Args:
            param: the (1, ...) parameter.
            batch_size: B, an int.
            call: (the clipping state's record of the host, (the parameter's name,)).
        Returns:
            (B, ...) ``param.detach().expand(B, ...)``, a view (no copy).
        """
        ctx.call = call
        return param.detach().expand(batch_size, *param.shape[1:])

    @staticmethod
    def backward(ctx, grad):
        """Report the (B, ...) gradient, row i sample i's gradient of the parameter, to the clipping state.

        Args:
            grad: (B, ...), ∂L/∂ of the expanded tensor.
        Returns:
            (None, None, None): the parameter gets no autograd gradient (the state writes its clipped sum).
        """
        layer = ctx.call[0]
        layer.state.on_backward(ctx.call, grad.new_empty(0), grad)
        return None, None, None


class DPBroadcastHost(DPModule):
    """Mixin of a module whose own trainable parameters are batch-broadcast (see module docstring).

    Made by ``broadcast_parameters(*names)`` and mixed into the host's class by ``convert``; the
    host keeps its own constructor and forward.

    Attributes:
        broadcast_names: the parameters that are batch-broadcast, each of shape (1, ...); ``convert``
            refuses a host with any other trainable parameter of its own (its per-sample gradient would
            be unknown).
    """

    broadcast_names: tuple[str, ...] = ()

    @classmethod
    def unsupported_options(cls, module):
        """Why ``module`` cannot host ``cls.broadcast_names`` (``check_broadcast_host``), or None.

        Args:
            module: the host module ``convert`` would swap.
        Returns:
            a reason string, or None.
        """
        return check_broadcast_host(cls.broadcast_names, module)

    def forward(self, *args, **kwargs):
        """The host's own forward; in a private batch with each broadcast parameter seen as (B, ...).

        Args:
            *args, **kwargs: the host forward's arguments (batch-first tensors of B rows).
        Returns:
            what the host's forward returns.
        Raises:
            RuntimeError in a private batch unless a batch is open, or (naming the parameters) when the
            host's forward fails with them expanded to (B, ...) (``ClippingState.broadcast_forward``).
        """
        host_forward = super(DPModule, self).forward  # the host class's own forward (after the mixins)
        state = self._pdpfast_state
        if state is None or not self.training or not torch.is_grad_enabled():
            return host_forward(*args, **kwargs)
        return state.broadcast_forward(self, host_forward, args, kwargs)


def broadcast_parameters(*names: str) -> type:
    """A ``DPBroadcastHost`` class for modules whose batch-broadcast parameters are ``names``.

    Args:
        *names: the parameter names (non-empty strings), at least one.
    Returns:
        a new ``DPBroadcastHost`` subclass with ``broadcast_names = names``.
    Raises:
        TypeError when no name is given or a name is not a non-empty string; ValueError for a name that
        is not a parameter name (a Python identifier) or is given twice.
    """
    if not names or not all(isinstance(n, str) and n for n in names):
        raise TypeError("broadcast_parameters needs the names of the batch-broadcast parameters")
    odd = [n for n in names if not n.isidentifier()]
    if odd:
        raise ValueError(f"names must be parameter names of the host (identifiers, no dots), got {odd}")
    if len(set(names)) != len(names):
        raise ValueError(f"names are given more than once: {list(names)}")
    return type("DPBroadcastHost", (DPBroadcastHost,), {"broadcast_names": tuple(names)})


def _broadcast_per_sample(module, x, o):
    # one call is one parameter (its name comes with the call); every name maps to the call's o
    return {n: o for n in module.broadcast_names}


def _broadcast_sq_norms(module, x, o, names):
    return (o if o.dtype in (torch.float32, torch.float64) else o.float()).flatten(1).pow(2).sum(1)


def _broadcast_clipped(module, x, o, weights, names):
    flat = o.flatten(1)
    grad = flat.sum(0) if weights is None else weights_as(weights, o.dtype) @ flat
    return {names[0]: grad}


# the per-sample gradient is o itself: the clipped sum weighs it as formed
register_rule(DPBroadcastHost, rule=LayerRule(_broadcast_per_sample, _broadcast_sq_norms, _broadcast_clipped,
                                              rounding=exact_scaling))


class DPLayerScale(DPModule):
    """A leaf module computing ``x * γ`` (γ its one trainable parameter, broadcast against x's
    trailing dims), e.g. Hugging Face's ``Dinov2LayerScale``.

    Mixed into the host's class by ``convert``, which keeps its constructor. ``forward(x)``:
    x (B, ..., *γ.shape) float → x * γ, the same shape; γ's per-sample gradient is x ⊙ ∂L/∂y summed
    to γ's shape.
    """

    @classmethod
    def unsupported_options(cls, module):
        """Why ``module`` cannot be converted, or None.

        Args:
            module: the layer-scale module ``convert`` would swap.
        Returns:
            the reason when it does not have exactly one parameter (trainable or not); None otherwise.
        """
        own = [n for n, _ in module.named_parameters(recurse=False)]
        return None if len(own) == 1 else f"a layer scale has exactly one parameter; got {own}"

    def _scale_name(self) -> str:
        (name,) = [n for n, p in self.named_parameters(recurse=False)]
        return name

    def _compute(self, x, p):
        return x * p[self._scale_name()]


def _layer_scale_per_sample(module, x, o):
    name = module._scale_name()
    shape = module._parameters[name].shape
    B = x.shape[0]
    lead = x.dim() - 1 - len(shape)
    if lead < 0:
        raise ValueError(f"layer scale {name} of shape {tuple(shape)} has more dims than its per-sample input")
    per_sample = (x * o).sum_to_size(B, *(1,) * lead, *shape)
    return {name: per_sample.reshape(B, *shape)}




def check_broadcast_host(broadcast_names: tuple, module) -> str | None:
    """Why ``module`` cannot host the batch-broadcast parameters ``broadcast_names``.

    Args:
        broadcast_names: a tuple of the parameter names registered as batch-broadcast.
        module: the would-be host.
    Returns:
        a reason string when a name of ``broadcast_names`` is no attribute of the module at all (a
        parameter set to None, like an unused mask token, is fine), one of its own trainable parameters
        is not in ``broadcast_names``, or a trainable broadcast parameter is 0-D or its dim 0 is not of
        size 1; None when it can host them.
    """
    missing = [n for n in broadcast_names if not hasattr(module, n)]
    if missing:
        return (f"registered batch-broadcast names {', '.join(missing)} are not attributes of the module "
                "(check the names given to pdpfast.nn.register_broadcast_host)")
    own = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
    others = [n for n in own if n not in broadcast_names]
    if others:
        return (f"trainable parameters {', '.join(others)} are not registered as batch-broadcast "
                "(freeze them, or register them with pdpfast.nn.register_broadcast_host)")
    wrong = [f"{n} {tuple(p.shape)}" for n, p in own.items() if p.dim() == 0 or p.shape[0] != 1]
    # (a (1, d) parameter used as p.expand(B, T, -1), like DINOv2's mask token, also has a leading 1
    # but is not batch-aligned: that is why hosts are registered by name, never inferred)
    if wrong:
        return "batch-broadcast parameters must have a leading dim of size 1; got " + ", ".join(wrong)
    return None


def register_broadcast_host(module_class: type | str, *names: str) -> None:
    """Make ``convert`` treat ``module_class`` as a host of batch-broadcast parameters.

    Exact per sample when its forward uses them batch-aligned (see the module docstring). A later
    registration of the same class replaces the earlier one.

    Args:
        module_class: an ``nn.Module`` subclass, or its qualified name (``"module.Class"``; the library is
            not imported).
        *names: its batch-broadcast parameters, each of shape (1, ...): class tokens, position
            embeddings, register tokens.
    Returns:
        None.
    Raises:
        TypeError for a ``module_class`` that is neither, or bad ``names`` (``broadcast_parameters``);
        ValueError for a class name without a module path, or ``names`` that are not identifiers or
        repeat. Whether the names are the host's parameters is only known from an instance: ``convert``
        refuses a host that has no attribute of a registered name.
    """
    if not (isinstance(module_class, str) or (isinstance(module_class, type) and issubclass(module_class, nn.Module))):
        raise TypeError(f"module_class must be an nn.Module subclass or its qualified name, got {module_class!r}")
    register_layer(module_class, broadcast_parameters(*names), replace=True)


# vision transformers: class / distillation / mask tokens and position embeddings, and layer scale
register_broadcast_host("transformers.models.vit.modeling_vit.ViTEmbeddings",
                        "cls_token", "mask_token", "position_embeddings")
register_broadcast_host("transformers.models.deit.modeling_deit.DeiTEmbeddings",
                        "cls_token", "distillation_token", "mask_token", "position_embeddings")
# DINOv2's (1, d) mask token is used as mask_token.expand(B, T, -1): not batch-aligned, so not listed
register_broadcast_host("transformers.models.dinov2.modeling_dinov2.Dinov2Embeddings", "cls_token",
                        "position_embeddings")
register_layer("transformers.models.dinov2.modeling_dinov2.Dinov2LayerScale", DPLayerScale,
               LayerRule(_layer_scale_per_sample))
