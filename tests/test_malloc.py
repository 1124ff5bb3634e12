"""The CPU allocator settings ``pdpfast train`` applies (``pdpfast._malloc``): freed memory is kept in
the process instead of being faulted in again on every step, and a user's own choice wins."""
import platform
import subprocess
import sys

import pytest

from pdpfast import _malloc

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

_FAULTS = """
import resource, sys, torch
from torch import nn
from pdpfast import _malloc
if sys.argv[1] == "retain":
    _malloc.retain_freed_memory()
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
                      nn.GroupNorm(8, 32), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
def step():
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


def _faults_per_step(setting: str) -> float:
    done = subprocess.run([sys.executable, "-c", _FAULTS, setting], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.split()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_retained_memory_is_not_faulted_in_again_each_step():
    default, retained = _faults_per_step("default"), _faults_per_step("retain")
    # a small CNN's training step: glibc hands its activations back and faults ~10,000 pages in again
    assert default > 2000
    assert retained < default / 10


@pytest.mark.parametrize("name", ["MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_"])
def test_the_users_malloc_settings_are_left_alone(monkeypatch, name):
    calls = []
    monkeypatch.setattr(_malloc, "retain_freed_memory", lambda: calls.append(1))
    monkeypatch.setenv(name, "1048576")
    assert _malloc.retain_unless_configured() == f"user settings ({name})"
    assert not calls


@pytest.mark.parametrize("allocator", ["jemalloc", "tcmalloc", "mimalloc"])
def test_a_preloaded_allocator_is_left_alone(monkeypatch, allocator):
    calls = []
    monkeypatch.setattr(_malloc, "retain_freed_memory", lambda: calls.append(1))
    for name in _malloc._USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LD_PRELOAD", f"/usr/lib/x86_64-linux-gnu/lib{allocator}.so.2")
    assert _malloc.retain_unless_configured() == f"preloaded {allocator}"
    assert not calls


def test_without_glibc_nothing_is_changed_and_it_says_so(monkeypatch):
    def refuse():
        raise RuntimeError("retain_freed_memory needs glibc (mallopt)")

    monkeypatch.setattr(_malloc, "retain_freed_memory", refuse)
    for name in (*_malloc._USER_SETTINGS, "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    assert _malloc.retain_unless_configured() == "not glibc"
