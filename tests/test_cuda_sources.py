"""The CUDA sources of ``pdpfast._C`` compile and link together where nvcc is present, even with a
CPU-only torch (skipped without nvcc).

``setup.py`` builds them only with a CUDA torch, which the CPU machines this suite runs on lack, so
without this test a CUDA source could break unseen until a GPU machine builds it. Each ``csrc/*.cu``
and each ``csrc/*.cpp`` with a CUDA path (``PDPFAST_WITH_CUDA``) is compiled for the H100
(``sm_90``); then every ``pdpfast::`` function one object needs must be defined by another, which
catches a declaration in a ``.cpp`` file that does not match its definition in the ``.cu`` file.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NVCC = shutil.which("nvcc")

pytestmark = pytest.mark.skipif(NVCC is None, reason="needs nvcc (a CUDA toolkit)")


def _includes(tmp_path: Path) -> list[str]:
    from torch.utils import cpp_extension

    paths = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    generated = Path(cpp_extension.include_paths()[0]) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    if not generated.exists():
        # a CPU-only torch ships c10/cuda but not this header its CMake generates: a stand-in with
        # the one definition a shared-library build of c10_cuda makes
        stand_in = tmp_path / "include" / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
        stand_in.parent.mkdir(parents=True)
        stand_in.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        paths.insert(0, str(tmp_path / "include"))
    return [f"-I{p}" for p in paths]


def _compile(source: Path, out: Path, includes: list[str]) -> subprocess.CompletedProcess:
    flags = ["-std=c++17", "-O1", "-DPDPFAST_WITH_CUDA=1", "-DTORCH_EXTENSION_NAME=_C", "-w"]
    if source.suffix == ".cu":
        flags += ["-arch=sm_90", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC"]
    else:
        flags += ["-Xcompiler", "-fPIC,-fopenmp"]
    return subprocess.run([NVCC, *flags, *includes, "-c", str(source), "-o", str(out)],
                          capture_output=True, text=True, timeout=600)


def _symbols(obj: Path, which: str) -> set[str]:
    listed = subprocess.run(["nm", "-C", which, str(obj)], capture_output=True, text=True, check=True).stdout
    # "[address] type name", the demangled name with spaces in it ("at::Tensor const&")
    return {m.group(1) for m in re.finditer(r"^\s*(?:[0-9a-fA-F]+\s+)?[A-Za-z]\s+(.+)$", listed, re.MULTILINE)}


def test_cuda_sources_compile_and_their_declarations_match_their_definitions(tmp_path):
    sources = sorted((ROOT / "csrc").glob("*.cu"))
    sources += [p for p in sorted((ROOT / "csrc").glob("*.cpp")) if "PDPFAST_WITH_CUDA" in p.read_text()]
    assert any(p.suffix == ".cu" for p in sources), "csrc/ has no CUDA source"
    includes = _includes(tmp_path)
    objects = {p: tmp_path / f"{p.name}.o" for p in sources}
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(sources, pool.map(lambda p: _compile(p, objects[p], includes), sources)))
    failed = {p.name: r.stderr[-3000:] for p, r in results.items() if r.returncode != 0}
    assert not failed, failed
    defined = set().union(*(_symbols(o, "--defined-only") for o in objects.values()))
    needed = set().union(*(_symbols(o, "--undefined-only") for o in objects.values()))
    # a function declared in one csrc/ file and defined in another: each must be there, same signature
    own = {name for name in needed if name.startswith("pdpfast::")}
    assert own, "no cross-file call found: the test compiled the wrong files"
    assert own <= defined, sorted(own - defined)
