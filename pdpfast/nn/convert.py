"""``convert(model)``: swap supported layers for their DP versions, in place.

The swap changes each module's class to a DP subclass of its own class, so every Parameter object,
buffer, hook and attribute stays where it was (an optimizer built before conversion keeps working).
"""
from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import UninitializedParameter
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from .._checks import check_int
from . import rules
from .layers import DPModule


def _dp_class_for(cls: type) -> type | None:
    """The DP class ``convert`` swaps ``cls`` for: the registration (``rules.register_layer``) of
    the first class of its MRO that has one, or None."""
    return _dp_class_cached(cls, rules.generation())


@functools.cache
def _dp_class_cached(cls: type, generation: int) -> type | None:
    # ``generation``: part of the key only, so a registration after a lookup is seen
    for base in cls.__mro__:
        dp = rules.dp_class_registered(base)
        if dp is None:
            continue
        if cls.forward is not base.forward:  # its own forward around the registered layer's: see _scan
            if _own_forward_refusal(cls, base, dp):
                return None
            # a DP class that is a mixin (HF's Conv1D) or covers several classes (InstanceNorm1d/2d/3d)
            # joins the registered class first, so that it comes before that class's forward
            return _subclass_over(dp if issubclass(dp, base) else _subclass(dp, base), cls)
        return dp if issubclass(dp, cls) else _subclass(dp, cls)
    return None


@functools.cache
def _subclass(dp: type, cls: type) -> type:
    # keep the user's class in the MRO (isinstance checks, its extra methods); one class per pair,
    # however often the registry changes
    return type(f"DP{cls.__name__}", (dp, cls), {"__module__": dp.__module__})


@functools.cache
def _subclass_over(dp: type, cls: type) -> type:
    # the DP class below the user's class in the MRO: the subclass's own forward runs, and its
    # super().forward(...) is the DP layer's private forward (Gemma's, BART's scaled token embedding;
    # BART's learned positions, which compute their position ids first)
    return type(f"DP{cls.__name__}", (cls, dp), {"__module__": dp.__module__, "_pdpfast_own_forward": True})


# The parameters a subclass with its own forward may have: those the registered layers' rules clip
# (weight, bias). A parameter of its own would be used outside the private forward (refused there,
# as an unclipped gradient): convert names it instead.
_OWN_FORWARD_PARAMS = frozenset({"weight", "bias"})


def _where(base: type) -> str:
    return f"{'nn' if base.__module__.startswith('torch.nn.') else base.__module__}.{base.__qualname__}"


@functools.cache
def _own_forward_refusal(cls: type, base: type, dp: type) -> str:
    """Why subclass ``cls`` (with its own forward) of registered class ``base`` cannot take DP class
    ``dp`` after it in its MRO ("; ..." to follow its parameters' names), or "": the subclass defines
    a name the DP class defines (``_prepare``, ``_compute``, ...), which, coming first in the MRO,
    would replace the private forward's own and train something else.
    """
    own = {n for k in dp.__mro__ if k not in base.__mro__ for n in vars(k) if not n.startswith("__")}
    theirs = {n for k in cls.__mro__ if k not in base.__mro__ for n in vars(k) if not n.startswith("__")}
    clash = sorted((own & theirs) - {"forward"})
    if clash:
        return (f"; a subclass of {_where(base)} with its own forward that defines {', '.join(clash)}, "
                f"which the private forward of {dp.__name__} uses: rename them")
    return ""


def _own_forward_over(cls: type) -> str:
    """The reason ``_own_forward_refusal`` gives for ``cls``, or "" (a class no rule knows needs none)."""
    for base in cls.__mro__[1:]:
        dp = rules.dp_class_registered(base)
        if dp is not None:
            return _own_forward_refusal(cls, base, dp) if cls.forward is not base.forward else ""
    return ""


def _own_forward_problem(module: nn.Module) -> str | None:
    """Why a module whose class has its own forward (``_subclass_over``) cannot be swapped: trainable
    parameters other than those its registered layer's rule clips. Its forward's use of them is
    checked when it runs: a parameter used outside the private forward (not through
    ``super().forward``) gets an ordinary gradient, which the clipping state refuses in the
    backward, naming it."""
    unknown = [n for n, p in module._parameters.items()
               if p is not None and p.requires_grad and n not in _OWN_FORWARD_PARAMS]
    if unknown:
        base = next(b for b in type(module).__mro__[1:] if rules.dp_class_registered(b) is not None)
        return (f"{', '.join(unknown)}: a subclass of {_where(base)} with its own forward and trainable "
                f"parameters the {base.__qualname__} rule does not clip")
    return None


def _path(name: str) -> str:
    return name or "<model>"


_UNSUPPORTED = ("pdpfast has no private version of these modules with trainable parameters (freeze them "
                "with requires_grad_(False), or replace them): ")


def _reparametrized(module: nn.Module) -> str | None:
    """Why a layer whose parameter is recomputed at every forward cannot be swapped, or None.

    A DP layer's private forward computes on its registered parameters (``module._parameters``) by
    the torch layer's names; a reparametrized one (``torch.nn.utils.parametrize``, or the forward
    pre-hooks of ``torch.nn.utils.weight_norm`` / ``spectral_norm``) has ``weight_g``/``weight_v``,
    ``weight_orig`` or ``parametrizations.weight.original*`` there instead of ``weight``: every private
    forward failed with ``KeyError: 'weight'``, frozen or not, and its per-sample rule knows nothing of
    the reparametrization's gradient."""
    if parametrize.is_parametrized(module):
        names = list(module.parametrizations.keys())
        return (f"{', '.join(names)} parametrized with torch.nn.utils.parametrize (e.g. parametrizations.weight_norm), "
                "which its private forward and per-sample rule do not follow; fold it in with "
                f"torch.nn.utils.parametrize.remove_parametrizations(module, {names[0]!r}) before converting")
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, (WeightNorm, SpectralNorm)):
            kind = "weight_norm" if isinstance(hook, WeightNorm) else "spectral_norm"
            return (f"{hook.name} is recomputed by torch.nn.utils.{kind} in a forward pre-hook, which its private "
                    f"forward and per-sample rule do not follow; fold it in with torch.nn.utils.remove_{kind}(module) "
                    "before converting")
    return None


def layer_problem(module: nn.Module, dp_class: type) -> str | None:
    """Why ``dp_class`` cannot train ``module`` privately, or None: the one check of a layer's options.

    ``convert`` runs it before swapping a torch module and on every module that already is a DP layer
    (built directly, or converted before); ``ClippingState`` runs it on every DP layer of the model it
    is given. Construction time only, never in a forward or backward.

    Args:
        module: the module (a torch module ``convert`` would swap, or a DP layer).
        dp_class: its DP class (``type(module)`` for a DP layer).
    Returns:
        a one-line reason: uninitialized (lazy) parameters, a reparametrized parameter (``_reparametrized``:
        weight norm, spectral norm, ``torch.nn.utils.parametrize``), no per-sample rule registered for
        ``dp_class``, or ``dp_class.unsupported_options(module)`` (an option its private forward would
        ignore or train wrongly); None when ``dp_class`` trains ``module`` exactly.
    """
    if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
        lazy = [n for n, p in module._parameters.items() if isinstance(p, UninitializedParameter)]
        eager = getattr(module, "cls_to_become", None)
        instead = f"nn.{eager.__name__}" if isinstance(eager, type) else "a layer built with its sizes"
        return (f"uninitialized (lazy) parameters {', '.join(lazy)}: initialize it with a forward pass first, "
                f"or use {instead}")
    reparametrized = _reparametrized(module)
    if reparametrized:
        return reparametrized
    if rules.rule_for_class(dp_class) is None:
        return f"no per-sample rule is registered for {dp_class.__name__} (pdpfast.nn.register_rule)"
    return dp_class.unsupported_options(module)


def refuse_unsupported_layers(layers: Iterable[nn.Module], names: Mapping[nn.Module, str]) -> None:
    """Refuse the DP layers that ``layer_problem`` refuses (``ClippingState`` calls this once, when built).

    Args:
        layers: the model's DP layers (``DPModule`` instances).
        names: each layer's path in the model ("<model>" for the model itself).
    Returns:
        None.
    Raises:
        ValueError in ``convert``'s wording, naming every such layer by path, class and reason.
    """
    problems = [f"{names[m]} ({type(m).__name__}: {problem})" for m in layers
                if (problem := layer_problem(m, type(m)))]
    if problems:
        raise ValueError(_UNSUPPORTED + "; ".join(problems))


def _scan(model: nn.Module):
    """(BatchNorm modules, modules with trainable parameters and no DP version or options their DP
    class refuses (DP layers included), planned swaps)."""
    batchnorms, unsupported, swaps = [], [], []
    for name, module in model.named_modules():
        is_dp = isinstance(module, DPModule)
        if not is_dp and isinstance(module, _BatchNorm):
            batchnorms.append(f"{_path(name)} ({type(module).__name__})")
            continue
        dp_class = type(module) if is_dp else _dp_class_for(type(module))
        own_forward = not is_dp and dp_class is not None and dp_class.__dict__.get("_pdpfast_own_forward", False)
        if (dp_class is None or own_forward) and not is_dp:  # (a form is a DP class: is_dp modules never reach it)
            # a form (an RMSNorm computed by hand, say) runs the module's own forward privately: it wins
            form = rules.dp_class_by_form(module)
            if form is not None:
                dp_class, own_forward = _subclass(form, type(module)), False
        trainable = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        if dp_class is None:
            if trainable:
                why = _own_forward_over(type(module))
                unsupported.append(f"{_path(name)} ({type(module).__name__}: {', '.join(trainable)}{why})")
            continue
        if own_forward:
            if not trainable:
                continue  # frozen: left as it is (a quantized layer's forward, say, need not be the layer's)
            problem = _own_forward_problem(module)
            if problem:
                unsupported.append(f"{_path(name)} ({type(module).__name__}: {problem})")
                continue
        problem = layer_problem(module, dp_class)
        if problem:
            unsupported.append(f"{_path(name)} ({type(module).__name__}: {problem})")
        elif not is_dp:
            swaps.append((module, dp_class))
    return batchnorms, unsupported, swaps


def unsupported_modules(model: nn.Module) -> list[str]:
    """What ``convert(model)`` would refuse. Changes nothing.

    Args:
        model: the model to check.
    Returns:
        a list of str, one "name (Type: why)" entry per module: every BatchNorm, then every module with
        trainable parameters that has no DP version or options its DP version refuses (``layer_problem``;
        DP layers already in the model included); [] when ``convert`` would succeed.
    """
    batchnorms, unsupported, _ = _scan(model)
    return [f"{b[:-1]}: mixes the samples of a batch, use GroupNorm)" for b in batchnorms] + unsupported


def convert(model: nn.Module) -> nn.Module:
    """Swap every supported layer of ``model`` for its DP version, in place.

    Supported: every registered layer family (``pdpfast.nn.register_layer``): Linear (any leading
    dims), Conv1d, Conv2d, Conv3d (stride, padding incl. "same", dilation, groups, padding modes),
    Embedding (padding_idx), EmbeddingBag (sum, mean), LayerNorm, GroupNorm, RMSNorm,
    InstanceNorm1d/2d/3d (without running statistics), MultiheadAttention, RNN/LSTM/GRU, Hugging
    Face's Conv1D, and hosts of batch-broadcast parameters (ViT/DeiT/DINOv2 embeddings, layer
    scale; ``register_broadcast_host``). Modules without trainable parameters of their own are left
    alone; frozen parameters cost nothing. A swap changes the module's class only: parameters,
    buffers, hooks and attributes stay, so an optimizer built before keeps working.

    Args:
        model: the model (``nn.Module``), changed in place.
    Returns:
        ``model`` itself.
    Raises:
        TypeError when ``model`` is not an ``nn.Module``. ValueError naming every BatchNorm (it mixes the
        samples of a batch, so no per-sample gradient exists; use GroupNorm, e.g.
        ``pdpfast.nn.replace_batchnorm``) or, in one message, every module with trainable parameters that
        has no DP version, or options its DP version refuses (``layer_problem``: also checked on modules
        that already are DP layers, e.g. built directly), or lazy parameters not yet initialized.
        Nothing is changed on error.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    batchnorms, unsupported, swaps = _scan(model)
    if batchnorms:
        raise ValueError(
            "BatchNorm cannot be trained with differential privacy: it normalizes each sample with "
            "statistics of the whole batch, so one record's gradient depends on the others and no "
            "per-sample gradient exists. Replace it with GroupNorm (pdpfast.nn.replace_batchnorm(model) "
            "does this, e.g. nn.GroupNorm(min(32, C), C)). BatchNorm modules: " + "; ".join(batchnorms))
    if unsupported:
        raise ValueError(_UNSUPPORTED + "; ".join(unsupported))
    for module, dp_class in swaps:
        module.__class__ = dp_class
    return model


def replace_batchnorm(model: nn.Module, max_groups: int = 32) -> nn.Module:
    """Replace every BatchNorm1d/2d/3d with GroupNorm(gcd(max_groups, C), C), in place.

    The new layer starts from the identity affine transform (weight 1, bias 0); running statistics
    are dropped, since GroupNorm normalizes each sample on its own.

    Args:
        model: the model, changed in place. Only children are replaced: a ``model`` that is itself a
            BatchNorm is returned unchanged (``ModuleValidator.fix`` handles that case).
        max_groups: the most groups a GroupNorm gets (an int); C channels get gcd(max_groups, C).
    Returns:
        ``model`` itself. Each GroupNorm keeps the BatchNorm's ``eps`` and ``affine`` and its device
        (its parameters are in the default dtype).
    Raises:
        TypeError when ``model`` is not an ``nn.Module``; ValueError when ``max_groups`` is not an int ≥ 1.
    """
    import math

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    max_groups = check_int("max_groups", max_groups, 1)
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, _BatchNorm):
                C = child.num_features
                like = next(iter([*child.parameters(), *child.buffers()]), None)
                gn = nn.GroupNorm(math.gcd(max_groups, C), C, eps=child.eps, affine=child.affine)
                if like is not None:
                    gn.to(like.device)
                setattr(module, child_name, gn)
    return model
