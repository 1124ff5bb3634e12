"""Shared helpers for the command-line tests: small data files and an in-process CLI runner."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
GROUP_EPSILONS = (1.0, 2.0, 3.0)


class CLI:
    """Runs ``pdpfast.cli.main`` in process and captures (exit status, stdout, stderr)."""

    def __init__(self, capsys):
        self.capsys = capsys

    def __call__(self, *args):
        from pdpfast.cli import main

        self.capsys.readouterr()
        rc = main([str(a) for a in args])
        out, err = self.capsys.readouterr()
        return rc, out, err

    def fails(self, command: str, *args) -> str:
        """Asserts the one-line failure contract; returns the message."""
        rc, out, err = self(command, *args)
        assert rc != 0, out
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith(f"pdpfast {command}: error: "), err
        return lines[0]


@pytest.fixture
def cli(capsys) -> CLI:
    return CLI(capsys)


def run_module(*args, cwd=None, timeout=180):
    """``python -m pdpfast ...`` in a subprocess (the installed entry point's code path)."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "pdpfast", *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """A 360-record slice of scikit-learn's digits as CSV (with a budget column), .npy and .npz,
    and its budgets as .npy / .txt / .csv, plus token-id data for the transformer models."""
    from sklearn.datasets import load_digits

    d = tmp_path_factory.mktemp("data")
    x, y = load_digits(return_X_y=True)
    x, y = (x[:360] / 16.0).astype(np.float32), y[:360]
    budgets = np.random.default_rng(0).permutation(np.repeat(GROUP_EPSILONS, [122, 155, 83]))
    with open(d / "digits.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([f"p{i}" for i in range(64)] + ["digit", "eps"])
        for row, label, eps in zip(x, y, budgets):
            w.writerow([f"{v:g}" for v in row] + [int(label), eps])
    np.save(d / "x.npy", x)
    np.save(d / "y.npy", y)
    np.save(d / "budgets.npy", budgets)
    np.savetxt(d / "budgets.txt", budgets)
    with open(d / "budgets.csv", "w", newline="") as f:
        f.write("epsilon\n" + "\n".join(f"{b:g}" for b in budgets) + "\n")
    rng = np.random.default_rng(1)
    ids = rng.integers(2, 128, (48, 12))
    np.savez(d / "tokens.npz", x=ids, y=rng.integers(0, 2, 48), budgets=rng.choice([1.0, 4.0], 48))
    return d


def outputs(directory: Path) -> list[str]:
    return sorted(p.name for p in Path(directory).iterdir())
