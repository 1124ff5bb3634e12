"""``ModuleValidator``: will a model train privately, and a copy of it that will (Opacus 1.6's API).

``validate`` lists what ``PrivacyEngine.make_private`` would refuse: BatchNorm (it mixes the samples
of a batch, so no per-sample gradient exists), modules with trainable parameters that have no DP
version (or options that leak, e.g. InstanceNorm with running statistics) and modules that lay
tensors out sequence-first. ``fix`` returns a copy with the fixable ones replaced.
"""
from __future__ import annotations

import copy

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from ._checks import check_flag
from .nn.convert import replace_batchnorm, unsupported_modules

__all__ = ["ModuleValidator", "UnsupportedModuleError"]


class UnsupportedModuleError(ValueError):
    """A model (or one of its modules) that cannot be trained privately; the message says why."""


class ModuleValidator:
    """Checks and fixes models for private training, with the methods of Opacus's ``ModuleValidator``."""

    @classmethod
    def validate(cls, module: nn.Module, *, strict: bool = False) -> list[UnsupportedModuleError]:
        """What ``make_private`` would refuse in ``module``: BatchNorm, modules without a DP version (or
        with options it refuses) and sequence-first modules.

        Args:
            module: the model to check (not changed).
            strict: raise instead of returning the problems.
        Returns:
            a list with one ``UnsupportedModuleError`` per problem ("name (Type: why)"); empty when the
            model can be trained privately.
        Raises:
            TypeError when ``module`` is not an ``nn.Module`` or ``strict`` not a bool;
            UnsupportedModuleError listing every problem when ``strict=True`` and there is one.
        """
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        check_flag("strict", strict)
        problems = list(unsupported_modules(module))
        problems += [f"{name or '<model>'} ({type(m).__name__}: batch_first=False; DP layers need batch-first "
                     "tensors, construct it with batch_first=True)"
                     for name, m in module.named_modules() if getattr(m, "batch_first", None) is False]
        errors = [UnsupportedModuleError(p) for p in problems]
        if strict and errors:
            raise UnsupportedModuleError("the model cannot be trained privately: " + "; ".join(problems))
        return errors

    @classmethod
    def is_valid(cls, module: nn.Module) -> bool:
        """Whether ``module`` can be trained privately as it is.

        Args:
            module: the model to check.
        Returns:
            True when ``validate`` finds no problem.
        Raises:
            TypeError when ``module`` is not an ``nn.Module``.
        """
        return not cls.validate(module, strict=False)

    @classmethod
    def fix(cls, module: nn.Module, **kwargs) -> nn.Module:
        """A deep copy of ``module`` with BatchNorm replaced by GroupNorm(gcd(32, C), C) and
        InstanceNorm running statistics turned off; the original is left as it was.

        Args:
            module: the model (a root that is itself a BatchNorm is replaced too).
            **kwargs: ``max_groups`` (default 32) of the GroupNorm replacing a BatchNorm
                (``pdpfast.nn.replace_batchnorm``); nothing else.
        Returns:
            the fixed copy. Problems it cannot fix (modules without a DP version, sequence-first
            modules) remain; ``fix_and_validate`` refuses them.
        Raises:
            TypeError for another keyword argument or a ``module`` that is not an ``nn.Module``.
        """
        unknown = set(kwargs) - {"max_groups"}
        if unknown:
            raise TypeError(f"fix() got unexpected keyword arguments {sorted(unknown)}")
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        module = copy.deepcopy(module)
        if isinstance(module, _BatchNorm):  # the root itself: nothing holds it to swap in place
            wrapper = replace_batchnorm(nn.Sequential(module), **kwargs)
            return wrapper[0]
        replace_batchnorm(module, **kwargs)
        for m in module.modules():
            if isinstance(m, _InstanceNorm) and m.track_running_stats:
                # per-sample statistics in training either way; the running ones leak the batch's data
                m.track_running_stats = False
                m.running_mean = m.running_var = m.num_batches_tracked = None
        return module

    @classmethod
    def fix_and_validate(cls, module: nn.Module, **kwargs) -> nn.Module:
        """``fix(module)``, then ``validate(strict=True)`` on the copy.

        Args:
            module: the model (left as it was).
            **kwargs: passed to ``fix`` (``max_groups``).
        Returns:
            the fixed copy, which can be trained privately.
        Raises:
            TypeError as ``fix``; UnsupportedModuleError listing what the copy still cannot train.
        """
        fixed = cls.fix(module, **kwargs)
        cls.validate(fixed, strict=True)
        return fixed
