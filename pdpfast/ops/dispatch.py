"""The one place that decides which implementation an op runs.

Every op in :mod:`pdpfast.ops` has a plain-torch reference. A faster implementation (a Triton
kernel from ``pdpfast.kernels``) registers itself under the op's name with :func:`register`;
:func:`pick` returns it when :func:`use_triton` holds for the op's tensors, else the reference.
No op carries its own ad-hoc device checks.
"""
from __future__ import annotations

import functools
import importlib
import os
from typing import Callable

import torch

# Every op that can run a kernel, named once: registering or picking any other name is an error,
# so a typo can never silently fall back to the reference. Tests, `pdpfast info` and
# bench/bench_kernels.py iterate over this set.
OPS = frozenset({"linear_weight_sq_norms", "bias_sq_norms", "conv_weight_sq_norms", "embedding_sq_norms",
                 "add_noise_"})

_KERNELS: dict[str, Callable] = {}
_WHEN: dict[str, Callable[..., bool]] = {}


def _known(name: str) -> str:
    if name not in OPS:
        raise ValueError(f"unknown op {name!r}; ops that dispatch: {sorted(OPS)}")
    return name


def register(name: str, when: Callable[..., bool] | None = None) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as the fast implementation of op ``name``.

    ``when(*tensors)``: the inputs on which the kernel beats the torch reference (as measured by
    ``bench/bench_kernels.py``); elsewhere ``pick`` returns the reference. None: everywhere.
    """

    _known(name)

    def wrap(fn: Callable) -> Callable:
        _KERNELS[name] = fn
        if when is None:
            _WHEN.pop(name, None)
        else:
            _WHEN[name] = when
        return fn

    return wrap


def triton_disabled() -> bool:
    return os.environ.get("PDPFAST_DISABLE_TRITON", "0") not in ("", "0")


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def triton_import_error() -> str | None:
    """None when Triton and pdpfast's kernels import, else the reason they do not."""
    try:
        importlib.import_module("triton")
        importlib.import_module("pdpfast.kernels")
    except Exception as exc:  # ImportError, or a broken Triton install
        return f"{type(exc).__name__}: {exc}"
    return None


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the Triton kernels should run on ``tensors``.

    Kernels run when the user has not set ``PDPFAST_DISABLE_TRITON=1``, Triton and the kernels
    import, and either every tensor is on a CUDA device or ``TRITON_INTERPRET=1`` is set (tests on
    the CPU; Triton reads that variable when the kernels are defined, so it must be set before
    ``pdpfast.kernels`` is first imported). Device checks come first so a CPU run never imports
    Triton.
    """
    if not (tensors and all(t.is_cuda for t in tensors)) and not triton_interpret():
        return False
    if triton_disabled():
        return False
    return triton_import_error() is None


def pick(name: str, reference: Callable, *tensors: torch.Tensor) -> Callable:
    """The implementation of op ``name`` to run on ``tensors``: a registered kernel or ``reference``."""
    _known(name)
    if use_triton(*tensors):
        kernel = _KERNELS.get(name)
        if kernel is not None:
            when = _WHEN.get(name)
            if when is None or when(*tensors):
                return kernel
    return reference


def registered() -> dict[str, Callable]:
    """Ops with a registered fast implementation (imports the kernels if possible)."""
    triton_import_error()
    return dict(_KERNELS)
