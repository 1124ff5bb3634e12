"""Every op a family of ``pdpfast.ops`` declares is declared by importing the package, without the
kernels: a script that names an op (``bench/bench_kernels.py``) must not depend on something else
having imported its family first. Each check runs in a fresh interpreter, as a user's script does."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _fresh_python(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PDPFAST_DISABLE_TRITON")}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _declared_in_sources() -> set[str]:
    names = set()
    for path in (ROOT / "pdpfast" / "ops").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "declare":
                names.add(node.args[0].value)
    return names


def test_importing_pdpfast_ops_declares_every_op_of_every_family():
    declared = _declared_in_sources()
    assert {"linear_weight_sq_norms", "layer_norm_per_sample_grads", "group_norm_affine_grads"} <= declared
    run = _fresh_python("-c", "import json, pdpfast.ops, sys; from pdpfast.ops import dispatch; "
                              "print(json.dumps(sorted(dispatch._OPS))); "
                              "print('pdpfast.kernels' in sys.modules)")
    assert run.returncode == 0, run.stderr
    ops, kernels_imported = run.stdout.splitlines()
    assert set(json.loads(ops)) == declared
    assert kernels_imported == "False"  # declared by the families themselves, not by loading the kernels


@pytest.mark.parametrize("script", sorted(p.stem for p in (ROOT / "bench").glob("bench_*.py")))
def test_every_benchmark_starts_in_a_fresh_interpreter(script):
    """Each benchmark's module-level set-up (``bench_kernels`` names every op it times) runs, and
    its options print, with nothing imported before it: as on a lent GPU, where a crash at import
    costs a call of device time."""
    run = _fresh_python("-m", f"bench.{script}", "--help")
    assert run.returncode == 0, run.stderr
    assert "usage:" in run.stdout
