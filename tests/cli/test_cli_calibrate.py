"""`pdpfast calibrate`: budgets file → plan summary, plan JSON and histogram PNG; bad inputs."""
import numpy as np
import pytest
from conftest import outputs, run_module

from pdpfast.accounting import PrivacyPlan


@pytest.mark.parametrize("budgets,method", [("budgets.npy", "sample"), ("budgets.txt", "scale"),
                                            ("budgets.csv", "hybrid")])
def test_calibrate_writes_the_plan_and_its_histograms(cli, data_dir, tmp_path, budgets, method):
    rc, out, err = cli("calibrate", data_dir / budgets, "--epochs", 3, "--batch-size", 40, "--method", method,
                       "--out", tmp_path / "plans" / "plan.json")
    assert rc == 0, err
    assert f"PrivacyPlan(method={method}" in out and "guaranteed_eps" in out
    plan = PrivacyPlan.from_json((tmp_path / "plans" / "plan.json").read_text())
    expected = np.load(data_dir / "budgets.npy")
    assert np.array_equal(plan.budgets, expected)
    assert np.all(plan.epsilons() <= expected)
    assert plan.steps == 3 * round(360 / 40)
    png = (tmp_path / "plans" / "plan.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert outputs(tmp_path / "plans") == ["plan.json", "plan.png"]


def test_calibrate_csv_column_and_explicit_options(cli, tmp_path):
    (tmp_path / "people.csv").write_text("id,eps\n" + "\n".join(f"{i},{0.5 + (i % 4)}" for i in range(200)) + "\n")
    rc, out, err = cli("calibrate", tmp_path / "people.csv", "--column", "eps", "--steps", 50, "--sample-rate", 0.1,
                       "--delta", 1e-6, "--max-grad-norm", 2.0, "--out", tmp_path / "p.json", "--plot",
                       tmp_path / "hist.png")
    assert rc == 0, err
    plan = PrivacyPlan.from_json((tmp_path / "p.json").read_text())
    assert plan.delta == 1e-6 and plan.max_grad_norm == 2.0 and plan.steps == 50
    assert (tmp_path / "hist.png").stat().st_size > 0


def test_calibrate_runs_as_a_module_in_a_subprocess(data_dir, tmp_path):
    result = run_module("calibrate", data_dir / "budgets.txt", "--steps", 20, "--sample-rate", 0.1, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "plan.json").exists() and (tmp_path / "plan.png").exists()


@pytest.mark.parametrize("case", ["missing file", "nan", "zero", "letters", "empty", "no steps", "both steps",
                                  "bad extension", "multi-column csv", "bad delta", "rate and batch size",
                                  "zero batch size", "zero epochs", "hybrid weight of sample", "column of npy",
                                  "boolean budgets", "no rows"])
def test_calibrate_bad_input_fails_in_one_line_and_writes_nothing(cli, tmp_path, case):
    work = tmp_path / "w"
    work.mkdir()
    files = {"nan": "1\nnan\n2\n", "zero": "1\n0\n", "letters": "1\nabc\n", "empty": "\n"}
    if case in files:
        (work / "b.txt").write_text(files[case])
    (work / "b.npy").write_bytes(b"")
    np.save(work / "ok.npy", np.ones(10))
    (work / "two.csv").write_text("a,b\n1,2\n")
    (work / "b.json").write_text("[1, 2]")
    args = {
        "missing file": (work / "none.txt", "--steps", 5, "--sample-rate", 0.1),
        "nan": (work / "b.txt", "--steps", 5, "--sample-rate", 0.1),
        "zero": (work / "b.txt", "--steps", 5, "--sample-rate", 0.1),
        "letters": (work / "b.txt", "--steps", 5, "--sample-rate", 0.1),
        "empty": (work / "b.txt", "--steps", 5, "--sample-rate", 0.1),
        "no steps": (work / "ok.npy", "--sample-rate", 0.1),
        "both steps": (work / "ok.npy", "--steps", 5, "--epochs", 1, "--sample-rate", 0.1),
        "bad extension": (work / "b.json", "--steps", 5, "--sample-rate", 0.1),
        "multi-column csv": (work / "two.csv", "--steps", 5, "--sample-rate", 0.1),
        "bad delta": (work / "ok.npy", "--steps", 5, "--sample-rate", 0.1, "--delta", 2),
        # options that would be ignored, and the messages that name the option given
        "rate and batch size": (work / "ok.npy", "--steps", 5, "--sample-rate", 0.5, "--batch-size", 8),
        "zero batch size": (work / "ok.npy", "--steps", 5, "--batch-size", 0),
        "zero epochs": (work / "ok.npy", "--epochs", 0, "--sample-rate", 0.1),
        "hybrid weight of sample": (work / "ok.npy", "--steps", 5, "--sample-rate", 0.1, "--hybrid-weight", 0.2),
        "column of npy": (work / "ok.npy", "--steps", 5, "--sample-rate", 0.1, "--column", "eps"),
        "boolean budgets": (work / "flags.npy", "--steps", 5, "--sample-rate", 0.1),  # True would read as ε = 1
        "no rows": (work / "ok.npy", "--steps", 5, "--sample-rate", 0.1, "--max-rows", 0),   # refused before it works
    }[case]
    np.save(work / "flags.npy", np.ones(10, dtype=bool))
    names = {"rate and batch size": "--batch-size", "zero batch size": "--batch-size", "zero epochs": "--epochs",
             "hybrid weight of sample": "--hybrid-weight", "column of npy": "--column", "boolean budgets": "booleans",
             "multi-column csv": "(--column)", "no rows": "--max-rows must be a positive integer"}
    before = outputs(work)
    message = cli.fails("calibrate", *args, "--out", work / "plan.json")
    assert names.get(case, "") in message
    assert outputs(work) == before


@pytest.mark.parametrize("plot", ["hist.xyz", "hist"])
def test_a_plot_path_whose_suffix_names_no_image_format_is_refused_before_calibrating(cli, data_dir, tmp_path,
                                                                                        monkeypatch, plot):
    import pdpfast

    def too_late(*a, **k):
        raise AssertionError("calibration started before --plot was checked")

    monkeypatch.setattr(pdpfast, "calibrate", too_late)
    message = cli.fails("calibrate", data_dir / "budgets.npy", "--steps", 5, "--sample-rate", 0.1, "--out",
                        tmp_path / "p.json", "--plot", tmp_path / plot)
    assert "--plot" in message and "suffix" in message
    assert outputs(tmp_path) == []
