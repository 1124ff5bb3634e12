"""Kernel tests: run under the Triton interpreter on the CPU, or on a CUDA device.

    cd /work/main && TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/kernels

TRITON_INTERPRET must be set before Python starts (Triton reads it when the kernels are defined).
Without Triton every test here is skipped; without TRITON_INTERPRET=1 and without CUDA too.
Tests marked ``gpu`` (large sizes) run only on CUDA.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _triton_error() -> str | None:
    try:
        importlib.import_module("triton")
    except Exception as exc:  # ImportError or a broken install
        return f"triton is not importable ({type(exc).__name__}: {exc})"
    return None


def _load_kernels():
    """``pdpfast.kernels``, loaded from ``kernels/`` when the package is not installed (no
    editable install yet): setup.py maps that directory to ``pdpfast.kernels``."""
    try:
        return importlib.import_module("pdpfast.kernels")
    except ModuleNotFoundError as exc:
        if exc.name not in ("pdpfast.kernels",):
            raise
    import pdpfast
    spec = importlib.util.spec_from_file_location(
        "pdpfast.kernels", ROOT / "kernels" / "__init__.py", submodule_search_locations=[str(ROOT / "kernels")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["pdpfast.kernels"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["pdpfast.kernels"]
        raise
    pdpfast.kernels = module
    return module


TRITON_ERROR = _triton_error()
if TRITON_ERROR is None:
    _load_kernels()
    from pdpfast.kernels import _utils as _kernel_utils
    from pdpfast.ops import dispatch as _dispatch

    _dispatch.triton_import_error.cache_clear()  # in case it was asked before the fallback load
    # every launcher allocates its outputs and partial buffers through new_buffer: fill them with
    # NaN so an element a kernel forgets to write fails the comparison loudly
    _kernel_utils.POISON_OUTPUTS = True


def _interpreter_patches_the_language_once_per_launch() -> None:
    """The Triton interpreter (3.x) patches the language modules again at every device-function call
    inside a kernel (``InterpretedFunction.__call__``: ``tl.sum``, ``tl.zeros``, our helpers), though
    they are already patched for the running launch: ``inspect.getmembers`` over the language each
    time, about a third of these tests' time. Here a call inside a launch skips the patch when every
    language module its function sees was patched since the launch began (by the launch or by an
    earlier call in it: Triton never undoes a call's patch). Launches patch and restore as Triton
    does; a Triton without these names is left alone."""
    if not INTERPRET or TRITON_ERROR is not None:
        return
    from triton.runtime import interpreter

    patch, executor = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if patch is None or executor is None or not hasattr(interpreter, "_LangPatchScope"):
        return
    launches: list[set] = []  # per running launch (innermost last): the language modules patched in it

    def languages(fn) -> set:
        return {id(v) for v in fn.__globals__.values()
                if isinstance(v, types.ModuleType) and v.__name__ in ("triton.language", "triton.language.core")}

    def patch_lang(fn):
        seen = languages(fn)
        if launches and launches[-1] and seen <= launches[-1]:
            return interpreter._LangPatchScope()  # patched already: nothing to do, nothing to restore
        scope = patch(fn)
        if launches:
            launches[-1] |= seen
        return scope

    run = executor.__call__

    def launch(self, *args, **kwargs):
        launches.append(set())
        try:
            return run(self, *args, **kwargs)
        finally:
            launches.pop()

    interpreter._patch_lang = patch_lang
    executor.__call__ = launch


_interpreter_patches_the_language_once_per_launch()

if TRITON_ERROR is not None:
    SKIP_REASON = TRITON_ERROR
elif not (INTERPRET or torch.cuda.is_available()):
    SKIP_REASON = "kernel tests need TRITON_INTERPRET=1 (CPU) or a CUDA device"
else:
    SKIP_REASON = None

DEVICE = "cuda" if (torch.cuda.is_available() and not INTERPRET) else "cpu"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (sizes too large for the interpreter)")


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    for item in items:
        if here not in Path(str(item.fspath)).resolve().parents:
            continue
        if SKIP_REASON is not None:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))
        elif item.get_closest_marker("gpu") is not None and DEVICE != "cuda":
            item.add_marker(pytest.mark.skip(reason="gpu test: needs CUDA without TRITON_INTERPRET"))


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture
def gen() -> torch.Generator:
    """A fixed-seed generator: fresh random inputs per test that reproduce on failure."""
    return torch.Generator().manual_seed(1234)


def _randn(gen, *shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


def assert_as_accurate_as_torch(kernel_out, torch_out, oracle, atol, factor=2.0, what=""):
    """flash-attention's rule: max |kernel − oracle| ≤ factor · max |torch − oracle| + atol.

    ``oracle`` is float64 math on the same (already rounded) inputs; ``torch_out`` is what the
    torch reference achieves at the tested precision; ``atol`` may be a tensor shaped like the
    output (per-element scale-aware slack).
    """
    kernel_out, torch_out, oracle = kernel_out.detach().cpu(), torch_out.detach().cpu(), oracle.detach().cpu()
    assert kernel_out.shape == oracle.shape, f"{what}: shape {tuple(kernel_out.shape)} != {tuple(oracle.shape)}"
    assert torch.isfinite(kernel_out).all(), f"{what}: non-finite output (an element left unwritten?)"
    if oracle.numel() == 0:
        return
    kernel_err = (kernel_out.double() - oracle.double()).abs()
    torch_err = (torch_out.double() - oracle.double()).abs().max()
    atol = torch.as_tensor(atol, dtype=torch.float64).cpu()
    bound = factor * torch_err + atol
    worst = (kernel_err - bound).argmax()
    assert (kernel_err <= bound).all(), (
        f"{what}: kernel error {kernel_err.flatten()[worst]:.3e} > {factor}×torch error {torch_err:.3e} "
        f"+ atol {atol.expand_as(kernel_err).flatten()[worst]:.3e}")


class OpLog(TorchDispatchMode):
    """``with OpLog() as log``: ``log.ops``, the names of the aten ops dispatched inside, views (which
    launch nothing) left out; ``log.launches``, the Triton kernels launched inside (compiled or
    interpreted), one entry a launch."""

    def __init__(self):
        super().__init__()
        self.ops, self.launches = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        self._saved = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}
        for cls, run in self._saved.items():
            cls.run = lambda fn, *args, _run=run, **kwargs: (self.launches.append(fn), _run(fn, *args, **kwargs))[1]
        return super().__enter__()

    def __exit__(self, *exc):
        for cls, run in self._saved.items():
            cls.run = run
        return super().__exit__(*exc)


@pytest.fixture
def tools():
    return SimpleNamespace(randn=_randn, check=assert_as_accurate_as_torch, device=DEVICE, interpret=INTERPRET,
                           op_log=OpLog)


@pytest.fixture(autouse=True)
def no_tf32(exact_fp32):
    """On a GPU, fp32 tiles multiply as TF32 where torch lets cuDNN or cuBLAS (cuDNN's default): the
    kernel tests check the near-fp32 products against fp32 references (``exact_fp32``, tests/conftest.py),
    and the TF32 route by name (``test_conv_norms.py::test_fp32_products_follow_cudnns_tf32_policy``)."""
    yield
