"""pdpfast: individualized differential privacy for PyTorch training.

Two roles:

* ``python3 setup.py demo | test | bench`` — the quick start. Creates ``.venv`` next to this file
  (once), installs pdpfast and what it needs into it, then runs the main job, the test suite or
  the CPU benchmark inside it. On a machine without an NVIDIA GPU torch is pinned to 2.13.0 and
  taken from PyTorch's CPU index when that index answers (a CPU build pip finds on disk, as on CI,
  serves as well), so no multi-GB CUDA wheel is pulled.
* an ordinary setuptools script (``pip install --no-build-isolation -e .``): installs the
  ``pdpfast`` package, maps ``kernels/`` to ``pdpfast.kernels`` and builds the optional C++/CUDA
  extension ``pdpfast._C`` from ``csrc/``. A failed extension build never fails the install: the
  package falls back to plain torch and ``python -m pdpfast.info`` says why.
"""
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
RUNTIME = ["numpy", "scipy", "tqdm", "matplotlib", "scikit-learn", "dp-accounting"]
TESTING = ["pytest", "pytest-benchmark", "opacus==1.6.*", "transformers", "accelerate", "datasets", "peft", "triton",
           "flwr", "ruff==0.17.6"]  # ruff pinned: a new release may add checks that fail an unchanged tree
# `python3 setup.py test` lints first (settings in pyproject.toml); arguments after it go to both pytest runs.
LINT = ["-m", "ruff", "check", "pdpfast", "tests", "bench", "kernels", "setup.py"]
# Each quick command: the runs it makes inside the venv, as (arguments, extra environment).
# The Triton kernels are tested in a process of their own: TRITON_INTERPRET=1 must be set before
# Triton defines them, and would route every op of the other tests through the slow interpreter.
QUICK_COMMANDS = {
    "demo": [(["-m", "pdpfast", "demo"], {})],
    "test": [(LINT, {}),
             (["-m", "pytest", "-q", "tests", "--ignore=tests/kernels"], {}),
             (["-m", "pytest", "-q", "tests/kernels"], {"TRITON_INTERPRET": "1"})],
    "bench": [(["-m", "bench.bench_cpu"], {})],
}


# Where torch's CPU builds are published: with it as an extra index, pip prefers 2.13.0+cpu to the
# CUDA build of 2.13.0 on PyPI (a local version sorts above the plain one).
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


def _answers(url: str, timeout: float = 5.0) -> bool:
    import urllib.request
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
        return True
    except (OSError, ValueError):
        return False


def _torch_requirement(has_gpu: bool, cpu_index_answers) -> list[str]:
    """pip arguments that install torch: any build with a GPU; else 2.13.0, from the CPU index when it answers."""
    if has_gpu:
        return ["torch"]
    return ["torch==2.13.0"] + (["--extra-index-url", CPU_TORCH_INDEX] if cpu_index_answers() else [])


def _has_nvidia_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None and subprocess.call(
        ["nvidia-smi", "-L"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) == 0


def _bootstrap(command: str, extra_args: list[str]) -> int:
    python = VENV / "bin" / "python"
    # the stamp names the requirements, so a venv made before one was added installs it
    wanted = RUNTIME + (TESTING if command in ("test", "bench") else [])
    stamp = VENV / f".pdpfast-{command}-{zlib.crc32(' '.join(wanted).encode()):08x}-installed"
    if not python.exists():
        subprocess.check_call([sys.executable, "-m", "venv", str(VENV)])
    if not stamp.exists():
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        torch_req = _torch_requirement(_has_nvidia_gpu(), lambda: _answers(CPU_TORCH_INDEX + "/torch/"))
        # torch first and alone: every later requirement then sees it installed and adds nothing
        subprocess.check_call(pip + torch_req)
        subprocess.check_call(pip + wanted)
        subprocess.check_call(pip + ["--no-build-isolation", "--no-deps", "-e", str(ROOT)])
        stamp.touch()
    status = 0
    for args, extra_env in QUICK_COMMANDS[command]:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **extra_env)
        extra = [] if args is LINT else extra_args
        status = subprocess.call([str(python), *args, *extra], cwd=ROOT, env=env) or status
    return status


def _extensions():
    """The C++ (and, with a CUDA toolkit and a CUDA torch, CUDA) extension, if torch is importable."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return [], {}
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cpp"))
    if not sources:
        return [], {}
    cuda_sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cu"))
    use_cuda = bool(cuda_sources) and torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    cxx = ["-O3", "-fopenmp", "-std=c++17"]
    if use_cuda:
        ext = cpp_extension.CUDAExtension(
            "pdpfast._C", sources + cuda_sources, define_macros=[("PDPFAST_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3"]}, extra_link_args=["-fopenmp"])
    else:
        ext = cpp_extension.CppExtension("pdpfast._C", sources, extra_compile_args=cxx, extra_link_args=["-fopenmp"])

    class OptionalBuildExt(cpp_extension.BuildExtension):
        def run(self):
            try:
                super().run()
            except Exception as exc:  # the package works without the extension
                print(f"pdpfast: building the C++ extension failed ({exc}); using the torch fallback")

    # ninja compiles the sources in parallel (MAX_JOBS of them): on a lent GPU machine, whose minutes are
    # counted, the two CUDA files no longer wait for each other; without ninja, one after another
    return [ext], {"build_ext": OptionalBuildExt.with_options(use_ninja=cpp_extension.is_ninja_available())}


def main():
    if len(sys.argv) >= 2 and sys.argv[1] in QUICK_COMMANDS:
        sys.exit(_bootstrap(sys.argv[1], sys.argv[2:]))
    from setuptools import setup

    ext_modules, cmdclass = _extensions()
    packages = ["pdpfast"] + [
        "pdpfast." + str(p.relative_to(ROOT / "pdpfast")).replace(os.sep, ".")
        for p in sorted((ROOT / "pdpfast").rglob("*")) if p.is_dir() and (p / "__init__.py").exists()]
    setup(
        name="pdpfast",
        version="0.1.0",
        description="Individualized differential privacy for PyTorch: per-record budgets, fused clipping",
        python_requires=">=3.10",
        packages=packages + ["pdpfast.kernels"],
        package_dir={"pdpfast": "pdpfast", "pdpfast.kernels": "kernels"},
        install_requires=["torch>=2.4", *RUNTIME],
        extras_require={"test": TESTING, "fl": ["flwr"], "transformers": ["transformers", "accelerate"]},
        ext_modules=ext_modules,
        cmdclass=cmdclass,
        entry_points={"console_scripts": ["pdpfast=pdpfast.cli:main"]},
    )


if __name__ == "__main__":
    main()
