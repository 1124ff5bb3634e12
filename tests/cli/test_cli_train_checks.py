"""`pdpfast train` / `calibrate` say what is wrong or surprising instead of going on silently:
float labels, a batch larger than the data, δ ≥ 1/N, budgets too spread for one σ, bad numbers."""
import json

import numpy as np
import pytest
from conftest import outputs

SMALL = ("--epochs", 1, "--batch-size", 40, "--quiet")


def _npy(data_dir):
    return ("--data", data_dir / "x.npy", "--labels", data_dir / "y.npy")


def test_float_labels_are_refused_not_trained_as_hundreds_of_classes(cli, data_dir, tmp_path):
    targets = np.random.default_rng(0).normal(size=360)          # a regression target: 360 distinct values
    np.save(tmp_path / "t.npy", targets)
    message = cli.fails("train", "--data", data_dir / "x.npy", "--labels", tmp_path / "t.npy", "--budgets",
                        data_dir / "budgets.npy", "--out-json", tmp_path / "s.json", *SMALL)
    assert "labels" in message and "integer" in message and "regression" in message
    assert not (tmp_path / "s.json").exists()


def test_float_labels_holding_whole_numbers_are_classes(cli, data_dir, tmp_path):
    np.save(tmp_path / "y.npy", np.load(data_dir / "y.npy").astype(np.float64))   # 3.0, 7.0, ...
    rc, _, err = cli("train", "--data", data_dir / "x.npy", "--labels", tmp_path / "y.npy", "--budgets",
                     data_dir / "budgets.npy", "--stop-after-steps", 1, *SMALL)
    assert rc == 0, err


@pytest.mark.parametrize("method", ["sample", "hybrid"])
def test_calibration_failing_on_the_spread_of_budgets_says_why_and_suggests_scale(cli, tmp_path, method):
    np.save(tmp_path / "b.npy", np.repeat([0.01, 500.0], 50))
    message = cli.fails("calibrate", tmp_path / "b.npy", "--steps", 100, "--sample-rate", 0.5, "--method", method,
                        "--out", tmp_path / "plan.json")
    assert "spread" in message and "scale" in message, message
    if method == "hybrid":
        assert "hybrid" in message, message
    assert outputs(tmp_path) == ["b.npy"]
    rc, _, err = cli("calibrate", tmp_path / "b.npy", "--steps", 100, "--sample-rate", 0.5, "--method", "scale",
                     "--out", tmp_path / "plan.json")
    assert rc == 0, err                                # the suggestion works
