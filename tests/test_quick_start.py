"""The quick start's torch install (``setup.py``): on a machine without an NVIDIA GPU it asks for the CPU
build of torch 2.13.0, never for a multi-GB CUDA build it does not need."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup_script():
    spec = importlib.util.spec_from_file_location("pdpfast_setup_script", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only: main() runs under __main__
    return module


def test_without_a_gpu_torch_is_pinned_and_taken_from_the_cpu_index_when_it_answers(setup_script):
    asked = []
    args = setup_script._torch_requirement(False, lambda: asked.append(1) or True)
    assert args == ["torch==2.13.0", "--extra-index-url", setup_script.CPU_TORCH_INDEX]
    assert setup_script.CPU_TORCH_INDEX.endswith("/whl/cpu") and asked == [1]


def test_without_a_gpu_or_the_cpu_index_torch_is_still_pinned(setup_script):
    assert setup_script._torch_requirement(False, lambda: False) == ["torch==2.13.0"]


def test_with_a_gpu_any_torch_build_is_taken_and_the_index_is_not_asked(setup_script):
    def never():
        raise AssertionError("the CPU index was asked on a machine with a GPU")
    assert setup_script._torch_requirement(True, never) == ["torch"]


def test_an_index_that_does_not_resolve_does_not_answer(setup_script):
    assert setup_script._answers("http://pdpfast-no-such-host.invalid/whl/cpu/torch/", timeout=2.0) is False
