"""The one place that decides which implementation an op runs.

Every op that can run a kernel is declared once, next to its plain-torch reference, in its
family's file under :mod:`pdpfast.ops` (``_BIAS_SQ_NORMS = declare("bias_sq_norms",
bias_sq_norms_reference)``); its entry point asks the returned :class:`Op` which implementation to
run. A faster implementation (a Triton kernel in ``pdpfast.kernels``) registers itself under the
op's name with :func:`register` when its module is imported; :meth:`Op.pick` returns it when
:func:`use_triton` holds for the op's tensors (and its ``when``), else the reference. No op carries
its own ad-hoc device checks. Registering under a name no op declared raises
:class:`RegistrationError` at import, so a typo can never silently fall back to the reference.
Tests, benchmarks and ``pdpfast info`` iterate over :func:`registered`.
"""
from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch


class RegistrationError(ValueError):
    """A kernel registered under an undeclared op name, or an op or kernel registered twice."""


@dataclass
class Op:
    """One dispatching op: ``reference`` always works; ``kernel`` (with ``when``) is registered by
    ``pdpfast.kernels`` and runs where :func:`use_triton` holds and ``when(*tensors)`` is true.

    Args:
        name: the op's name, as kernels register under it (e.g. "bias_sq_norms").
        reference: the plain-torch implementation, run wherever the kernel is not.
        kernel: the registered fast implementation (same signature as ``reference``), or None.
        when: ``when(*tensors) -> bool``, the inputs on which ``kernel`` should run; None: all of them.
    """

    name: str
    reference: Callable
    kernel: Callable | None = None
    when: Callable[..., bool] | None = None

    def pick(self, *tensors: torch.Tensor) -> Callable:
        """The implementation to run on ``tensors``: the registered kernel or the reference.

        Args:
            tensors: the op's tensor inputs the choice depends on (device, dtype, shape).
        Returns:
            ``self.kernel`` when :func:`use_triton` holds for ``tensors`` and ``when`` (if any) accepts
            them, else ``self.reference``.
        """
        # use_triton first: it imports pdpfast.kernels, which is what registers the kernel
        if use_triton(*tensors) and self.kernel is not None and (self.when is None or self.when(*tensors)):
            return self.kernel
        return self.reference


_OPS: dict[str, Op] = {}


def declare(name: str, reference: Callable) -> Op:
    """Declare the dispatching op ``name`` with its plain-torch ``reference`` (once, at import).

    Args:
        name: the op's name, under which a kernel may later register.
        reference: the plain-torch implementation.
    Returns:
        the new :class:`Op`, with no kernel yet.
    Raises:
        RegistrationError if an op of that name is already declared.
    """
    if name in _OPS:
        raise RegistrationError(f"op {name!r} is already declared (by {_OPS[name].reference.__module__})")
    _OPS[name] = Op(name, reference)
    return _OPS[name]


def op(name: str) -> Op:
    """The declared op ``name``.

    Args:
        name: an op name given to :func:`declare`.
    Returns:
        its :class:`Op`.
    Raises:
        RegistrationError for a name no op declared.
    """
    if name not in _OPS:
        raise RegistrationError(f"unknown op {name!r}; ops that dispatch: {sorted(_OPS)}")
    return _OPS[name]


def register(name: str, when: Callable[..., bool] | None = None) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as the fast implementation of op ``name``.

    Registering the same launcher (same qualified name and file) again, as happens when the kernels'
    module is imported under a second name, keeps the first and is not an error.

    Args:
        name: a declared op's name.
        when: ``when(*tensors) -> bool``, the inputs on which the kernel beats the torch reference (as
            measured by ``bench/bench_kernels.py``); elsewhere ``pick`` returns the reference. None:
            everywhere.
    Returns:
        the decorator, which returns ``fn`` unchanged.
    Raises:
        RegistrationError at once (when the kernel's module is imported) if no op ``name`` is declared,
        and from the decorator if the op already has a different kernel.
    """

    target = op(name)

    def wrap(fn: Callable) -> Callable:
        old = target.kernel
        if old is not None:
            if _source(old) != _source(fn):
                raise RegistrationError(f"op {name!r} already has the kernel {old.__module__}.{old.__qualname__}")
            # the same launcher from the same file, loaded again: transformers imports a top-level
            # package named ``kernels``, which the repository's kernels/ is when its root is on
            # sys.path (the tests). Keep the first.
            return fn
        target.kernel, target.when = fn, when
        return fn

    return wrap


def _source(fn: Callable) -> tuple:
    code = getattr(fn, "__code__", None)
    return fn.__qualname__, os.path.realpath(code.co_filename) if code is not None else fn.__module__


def triton_disabled() -> bool:
    """Whether the user turned the kernels off.

    Returns:
        True when ``PDPFAST_DISABLE_TRITON`` is set to anything but "" or "0".
    """
    return os.environ.get("PDPFAST_DISABLE_TRITON", "0") not in ("", "0")


@functools.cache
def triton_interpret() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (the tests).

    Read once, at the first call: Triton reads ``TRITON_INTERPRET`` when it defines a kernel, so a
    later change could not make the kernels interpreted or compiled anyway (and every op's
    dispatch on the CPU asks, ~1 µs an environment read).

    Returns:
        True when ``TRITON_INTERPRET`` is set to anything but "" or "0".
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def triton_import_error() -> str | None:
    """Why Triton or pdpfast's kernels cannot be used, if they cannot (tried once, then cached).

    Importing ``pdpfast.kernels`` is what registers every kernel with its op.

    Returns:
        None when Triton and ``pdpfast.kernels`` import, else "<ExceptionType>: <message>" of the failure.
    Raises:
        RegistrationError from ``pdpfast.kernels`` (a bug in a kernel's registration, never hidden).
    """
    try:
        importlib.import_module("triton")
        importlib.import_module("pdpfast.kernels")
    except RegistrationError:
        raise  # a bug in pdpfast.kernels, not a missing Triton: never hide it behind the reference
    except Exception as exc:  # ImportError, or a broken Triton install
        return f"{type(exc).__name__}: {exc}"
    return None


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels should run on ``tensors``.

    Kernels run when the user has not set ``PDPFAST_DISABLE_TRITON=1``, Triton and the kernels
    import, and either every tensor is on a CUDA device or ``TRITON_INTERPRET=1`` is set (tests on
    the CPU; Triton reads that variable when the kernels are defined, so it must be set before
    ``pdpfast.kernels`` is first imported). Device checks come first so a CPU run never imports
    Triton.

    Args:
        tensors: the op's tensor inputs; with none, only ``TRITON_INTERPRET=1`` can make it True.
    Returns:
        a bool.
    """
    if not (tensors and all(t.is_cuda for t in tensors)) and not triton_interpret():
        return False
    if triton_disabled():
        return False
    return triton_import_error() is None


def pick(name: str, *tensors: torch.Tensor) -> Callable:
    """The implementation of op ``name`` to run on ``tensors``: its registered kernel or its reference.

    Args:
        name: a declared op's name.
        tensors: the op's tensor inputs (see :meth:`Op.pick`).
    Returns:
        the callable to run.
    Raises:
        RegistrationError for a name no op declared.
    """
    return op(name).pick(*tensors)


def registered(load_kernels: bool = True) -> dict[str, Op]:
    """Every declared op by name, with its reference and the kernel registered for it, if any.

    Args:
        load_kernels: import the kernels first (when they can be imported), so each op's kernel is
            known; False leaves Triton unimported (kernels may then be missing).
    Returns:
        a new dict {op name: :class:`Op`} (the :class:`Op` objects are the live ones).
    Raises:
        RegistrationError from importing the kernels (see :func:`triton_import_error`).
    """
    if load_kernels:
        triton_import_error()
    return dict(_OPS)
