"""``bench/gpu.sh lease`` on a stand-in machine: a ``python3`` on the PATH that only logs what it is
asked and sleeps, so the script's order, deadline and returned files are checked without a GPU (a
broken step would otherwise first show itself on a lent GPU, whose minutes are counted)."""
from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# what the stand-in python3 does for each command gpu.sh runs: log it, sleep, and write what the real
# one writes (the extension, a benchmark's JSON)
FAKE_PYTHON = """#!/bin/bash
echo "$*" >> "$CALLS"
case "$*" in
  *setup.py*) sleep "${BUILD_SLEEP:-0}"; touch pdpfast/_C.cpython-312-x86_64-linux-gnu.so ;;
  *bench_e2e*--dtype\\ fp32*) echo '[]' > bench/results/e2e_fake_fp32.json ;;
  *bench_e2e*--dtype\\ bf16*) echo '[]' > bench/results/e2e_fake_bf16.json ;;
  *pytest*) echo "1 passed" ;;
  -c*) echo "$0" ;;
esac
exit 0
"""


@pytest.fixture
def stand_in(tmp_path):
    """(repository copy, environment) where ``python3`` is the stand-in and ``$OUT`` a fresh folder."""
    if shutil.which("bash") is None or shutil.which("timeout") is None:
        pytest.skip("needs bash and coreutils' timeout")
    repo = tmp_path / "repo"
    for folder in ("bench/results", "pdpfast", "kernels", "csrc"):
        (repo / folder).mkdir(parents=True)
    shutil.copy(ROOT / "bench" / "gpu.sh", repo / "bench" / "gpu.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out), LOGS=str(tmp_path / "logs"),
               CALLS=str(tmp_path / "calls.txt"))
    return repo, env


def _lease(repo: Path, env: dict, **extra) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "bench/gpu.sh", "lease"], cwd=repo, env={**env, **extra}, capture_output=True,
                          text=True, timeout=120)


def test_gpu_lease_runs_the_build_then_the_issues_targets_then_the_tests_and_returns_one_archive(stand_in):
    repo, env = stand_in
    done = _lease(repo, env)
    assert done.returncode == 0, done.stdout + done.stderr
    calls = Path(env["CALLS"]).read_text().splitlines()
    steps = [c for c in calls if c.startswith(("-m", "setup.py"))]
    assert [s.split()[1] if s.startswith("-m") else s.split()[0] for s in steps] == [
        "setup.py", "pytest", "bench.profile_step", "bench.profile_step", "bench.bench_e2e", "bench.bench_e2e",
        "pytest", "bench.bench_kernels"]
    assert "--model bert --dtype bf16" in steps[2] and "--model gpt2 --dtype bf16" in steps[3]
    assert "--dtype bf16 --models bert,gpt2" in steps[4] and "--dtype fp32" in steps[5]
    from bench.harness import PROVIDERS

    providers = steps[4].split("--providers ", 1)[1].split(",")
    assert set(providers) <= set(PROVIDERS)          # a misspelt provider would cost a lent GPU's run
    for provider in ("non-private graph", "pdpfast bk graph", "pdpfast per-layer graph", "opacus hooks"):
        assert provider in providers
    assert steps[1].endswith("tests/test_cuda.py") and steps[6].endswith("tests/kernels")
    out = Path(env["OUT"])
    # at most three files come back: the archive and the extension
    assert sorted(p.name for p in out.iterdir()) == ["_C.cpython-312-x86_64-linux-gnu.so", "gpu-run.tgz"]
    with tarfile.open(out / "gpu-run.tgz") as archive:
        names = archive.getnames()
    assert "results/1/e2e_fake_fp32.json" in names and "results/1/e2e_fake_bf16.json" in names
    assert "logs/build.log" in names and "logs/kernel_tests.log" in names


def test_a_second_gpu_script_run_in_one_device_call_returns_both_runs_results(stand_in):
    """Two runs in one device call (``gpu.sh overhead; gpu.sh e2e-bf16``) return each run's JSON,
    results/1/ and results/2/ (the second once reset the first's); the next call (an emptied $OUT)
    starts afresh."""
    repo, env = stand_in

    def run(step):
        done = subprocess.run(["bash", "bench/gpu.sh", step], cwd=repo, env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        with tarfile.open(Path(env["OUT"]) / "gpu-run.tgz") as archive:
            return sorted(n for n in archive.getnames() if n.endswith(".json"))

    assert run("e2e-fp32") == ["results/1/e2e_fake_fp32.json"]
    assert run("e2e-bf16") == ["results/1/e2e_fake_fp32.json", "results/2/e2e_fake_bf16.json"]
    (Path(env["OUT"]) / "gpu-run.tgz").unlink()  # the device empties $OUT before each call
    assert run("e2e-bf16") == ["results/1/e2e_fake_bf16.json"]


def test_gpu_lease_stops_a_step_at_its_deadline_and_names_the_steps_it_skipped(stand_in):
    repo, env = stand_in
    done = _lease(repo, env, LEASE_SECONDS="3", LEASE_MIN_STEP="1", BUILD_SLEEP="30")
    assert done.returncode == 1
    assert "STOPPED at the lease's deadline" in done.stdout
    assert ("skipped at the lease's deadline: engine_tests profile_bert profile_gpt2 e2e_bf16 e2e_fp32 kernel_tests "
            "bench_kernels") in done.stdout
    calls = Path(env["CALLS"]).read_text()
    assert "bench_e2e" not in calls and "pytest" not in calls
    # what the stopped run had written still comes back
    with tarfile.open(Path(env["OUT"]) / "gpu-run.tgz") as archive:
        assert "logs/build.log" in archive.getnames()
