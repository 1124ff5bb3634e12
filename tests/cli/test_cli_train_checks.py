"""`pdpfast train` / `calibrate` say what is wrong or surprising instead of going on silently:
float labels, a batch larger than the data, δ ≥ 1/N, budgets too spread for one σ, bad numbers."""
import json

import numpy as np
import pytest
from conftest import outputs

SMALL = ("--epochs", 1, "--batch-size", 40, "--quiet", "--noise-seed", 0)   # a fixed noise seed: reproducible


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


def test_a_labels_file_of_another_length_is_named_not_the_data(cli, data_dir, tmp_path):
    np.save(tmp_path / "ys.npy", np.load(data_dir / "y.npy")[:-1])
    message = cli.fails("train", "--data", data_dir / "x.npy", "--labels", tmp_path / "ys.npy", "--budgets",
                        data_dir / "budgets.npy", *SMALL)
    assert f"--labels file {str(tmp_path / 'ys.npy')!r} has 359 labels for the 360 records" in message, message


def test_a_missing_float_label_names_its_record_not_regression(cli, data_dir, tmp_path):
    """NaN is how a float array marks a missing value: the record is named, as a missing budget's is."""
    labels = np.load(data_dir / "y.npy").astype(np.float64)
    labels[359] = np.nan
    np.save(tmp_path / "y.npy", labels)
    message = cli.fails("train", "--data", data_dir / "x.npy", "--labels", tmp_path / "y.npy", "--budgets",
                        data_dir / "budgets.npy", *SMALL)
    assert "has a missing or non-finite label at record 359 (nan)" in message and "regression" not in message


# at q = 1 Sample cannot raise the larger budgets' rates; Scale and hybrid (whose rates are all 1
# too) spend them through larger clip bounds
@pytest.mark.parametrize("method,under_spending", [("sample", ("ε=2", "ε=3")), ("scale", ()), ("hybrid", ())])
def test_batch_size_above_the_records_warns_and_names_the_groups_that_under_spend(cli, data_dir, tmp_path, method,
                                                                                  under_spending):
    rc, out, err = cli("train", *_npy(data_dir), "--budgets", data_dir / "budgets.npy", "--method", method,
                       "--epochs", 1, "--batch-size", 1000, "--quiet", "--out-json", tmp_path / "s.json")
    assert rc == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("pdpfast train: warning:")]
    assert any("--batch-size 1000" in w and "288" in w and "q = 1" in w for w in warnings), err
    under = [w for w in warnings if "under-spend" in w]
    spent = {row["budget"]: row["max_ratio"] for row in json.loads((tmp_path / "s.json").read_text())["groups"]}
    assert {f"ε={b}" for b, ratio in spent.items() if ratio < 0.99} == set(under_spending)
    if under_spending:
        assert len(under) == 1 and all(g in under[0] for g in under_spending) and "ε=1 " not in under[0], err
    else:
        assert not under, err


def test_calibrate_with_batch_size_above_the_records_warns_and_names_the_groups_that_under_spend(cli, data_dir,
                                                                                                  tmp_path):
    rc, out, err = cli("calibrate", data_dir / "budgets.npy", "--epochs", 1, "--batch-size", 1000, "--out",
                       tmp_path / "plan.json")
    assert rc == 0, err
    lines = err.strip().splitlines()
    assert any("--batch-size 1000" in line and "360" in line and "q = 1" in line for line in lines), err
    under = [line for line in lines if "under-spend" in line]
    assert len(under) == 1 and "ε=2" in under[0] and "ε=3" in under[0] and "ε=1 " not in under[0], err


def test_batch_size_within_the_records_gives_no_warning(cli, data_dir):
    rc, _, err = cli("train", *_npy(data_dir), "--budgets", data_dir / "budgets.npy", "--stop-after-steps", 1, *SMALL)
    assert rc == 0 and "warning" not in err, err


def test_delta_at_least_one_over_n_warns(cli, data_dir, tmp_path):
    rc, _, err = cli("train", *_npy(data_dir), "--budgets", data_dir / "budgets.npy", "--delta", 0.01,
                     "--stop-after-steps", 1, *SMALL)
    assert rc == 0, err
    assert "pdpfast train: warning: --delta 0.01 ≥ 1/N" in err and "288" in err
    assert err.count("≥ 1/N") == 1, err     # the engine's own warning is not repeated
    rc, _, err = cli("calibrate", data_dir / "budgets.npy", "--delta", 0.01, "--steps", 5, "--sample-rate", 0.1,
                     "--out", tmp_path / "plan.json")
    assert rc == 0, err
    assert "pdpfast calibrate: warning: --delta 0.01 ≥ 1/N" in err and "360" in err


@pytest.mark.parametrize("method", ["sample", "hybrid"])
def test_calibration_failing_on_the_spread_of_budgets_says_why_and_suggests_scale(cli, tmp_path, method):
    # no Sample plan exists: a mean rate of 0.5 keeps the nine ε=500 records at rate ≤ 0.5/0.9, so
    # σ ≤ 0.28, where ε=0.01 would need a rate below the 1e-12 floor
    np.save(tmp_path / "b.npy", np.r_[0.01, np.full(9, 500.0)])
    message = cli.fails("calibrate", tmp_path / "b.npy", "--steps", 100, "--sample-rate", 0.5, "--method", method,
                        "--out", tmp_path / "plan.json")
    assert "spread" in message and "scale" in message, message
    if method == "hybrid":
        assert "hybrid" in message, message
    assert outputs(tmp_path) == ["b.npy"]
    rc, _, err = cli("calibrate", tmp_path / "b.npy", "--steps", 100, "--sample-rate", 0.5, "--method", "scale",
                     "--out", tmp_path / "plan.json")
    assert rc == 0, err                                # the suggestion works


@pytest.mark.parametrize("option,value,expected", [
    ("--epsilon", "inf", "finite"), ("--epsilon", "nan", "finite"), ("--hidden", "0", "positive"),
    ("--hidden", "64,-3", "positive"), ("--seed", "-1", "≥ 0"), ("--physical-batch-size", "0", "positive"),
    ("--threads", "-2", "positive"), ("--momentum", "-0.5", "momentum"), ("--test-fraction", "1.5", "[0, 1)")])
def test_bad_numbers_get_a_message_naming_the_option(cli, data_dir, tmp_path, option, value, expected):
    budget = () if option == "--epsilon" else ("--budgets", data_dir / "budgets.npy")
    message = cli.fails("train", *_npy(data_dir), *budget, option, value, "--checkpoint", tmp_path / "ck.pt", *SMALL)
    assert option in message and expected in message, message
    assert outputs(tmp_path) == []


def test_a_hybrid_weight_given_with_another_method_is_refused_not_ignored(cli, data_dir, tmp_path):
    message = cli.fails("train", *_npy(data_dir), "--budgets", data_dir / "budgets.npy", "--method", "scale",
                        "--hybrid-weight", 0.3, "--out-json", tmp_path / "s.json", *SMALL)
    assert "--hybrid-weight is for --method hybrid (this is --method scale)" in message
    assert not (tmp_path / "s.json").exists()
    rc, _, err = cli("train", *_npy(data_dir), "--budgets", data_dir / "budgets.npy", "--method", "hybrid",
                     "--hybrid-weight", 0.3, "--stop-after-steps", 1, *SMALL)
    assert rc == 0, err


def test_the_python_train_config_refuses_a_hybrid_weight_with_another_method_as_the_cli_does(data_dir):
    from pdpfast.train import TrainConfig, run

    cfg = TrainConfig(data=str(data_dir / "x.npy"), labels=str(data_dir / "y.npy"),
                      budgets=str(data_dir / "budgets.npy"), method="sample", hybrid_weight=0.3, quiet=True)
    with pytest.raises(ValueError, match=r"--hybrid-weight is for --method hybrid \(this is --method sample\)"):
        run(cfg)


@pytest.mark.parametrize("shape", ["0", "-1,-2,4", "1,8", "1,8,8,1", "0,8,8"])
def test_an_image_shape_that_is_not_three_positive_ints_is_refused_before_the_data_load(cli, data_dir, shape):
    message = cli.fails("train", *_npy(data_dir), "--budgets", data_dir / "budgets.npy", "--model", "cnn",
                        f"--image-shape={shape}", *SMALL)
    assert f"--image-shape must be three positive ints C,H,W (e.g. 1,8,8), got '{shape}'" in message


@pytest.mark.parametrize("extra,option", [(("--label-column", "y"), "--label-column"),
                                          (("--text-column", "text"), "--text-column"),
                                          (("--hf-split", "test"), "--hf-split"),
                                          (("--hf-config", "plain"), "--hf-config"),
                                          (("--tokenizer", "bert-base-uncased"), "--tokenizer")])
def test_an_option_the_data_source_does_not_read_is_refused_not_ignored(cli, data_dir, tmp_path, extra, option):
    """``--label-column y`` beside NumPy data, or ``--hf-split test`` beside a file, used to train as if
    they had not been given."""
    message = cli.fails("train", *_npy(data_dir), "--budgets", data_dir / "budgets.npy", *extra,
                        "--out-json", tmp_path / "s.json", *SMALL)
    assert f"{option} applies to" in message and "ignored" in message, message
    assert not (tmp_path / "s.json").exists()


def test_labels_beside_an_npz_that_holds_its_own_are_refused(cli, tmp_path, data_dir):
    x, y = np.load(data_dir / "x.npy"), np.load(data_dir / "y.npy")
    np.savez(tmp_path / "d.npz", x=x, y=y)
    message = cli.fails("train", "--data", tmp_path / "d.npz", "--labels", data_dir / "y.npy", "--budgets",
                        data_dir / "budgets.npy", *SMALL)
    assert "--labels applies to a .npy --data" in message


def test_a_language_model_given_labels_is_refused_and_labels_in_its_data_are_named_unread(cli, data_dir, tmp_path):
    """GPT-2 trains on next-token loss: labels given to it used to be dropped without a word."""
    message = cli.fails("train", "--data", data_dir / "x.npy", "--labels", data_dir / "y.npy", "--budgets",
                        data_dir / "budgets.npy", "--model", "gpt2-micro", *SMALL)
    assert "--labels: --model gpt2-micro is a language model" in message and "reads no labels" in message
    rc, _, err = cli("train", "--data", data_dir / "tokens.npz", "--model", "gpt2-micro", "--stop-after-steps", 1,
                     "--epochs", 1, "--batch-size", 8, "--quiet")
    assert rc == 0, err
    assert "warning: --model gpt2-micro is a language model" in err and "are not read" in err, err


@pytest.mark.parametrize("command,output", [("calibrate", "--out"), ("train", "--out-json"), ("train", "--checkpoint")])
def test_an_output_that_names_an_input_file_is_refused_and_the_input_kept(cli, data_dir, tmp_path, command, output):
    """``calibrate b.npy --out b.npy`` used to replace the budgets with the plan's JSON, status 0."""
    budgets = tmp_path / "b.npy"
    budgets.write_bytes((data_dir / "budgets.npy").read_bytes())
    if command == "calibrate":
        message = cli.fails("calibrate", budgets, "--steps", 10, "--sample-rate", 0.1, "--out", budgets)
        named = "budgets"
    else:
        message = cli.fails("train", *_npy(data_dir), "--budgets", budgets, output, budgets, *SMALL)
        named = "--budgets"
    assert f"{output} " in message and f"is the {named} input file" in message, message
    assert budgets.read_bytes() == (data_dir / "budgets.npy").read_bytes()


@pytest.mark.parametrize("extra,expected", [
    (("--optimizer", "adam", "--momentum", 0.9), "--momentum is for --optimizer sgd"),
    (("--method", "pdp", "--accountant", "pld"), "--accountant is for --method sample/scale/hybrid/dpsgd"),
    (("--model", "cnn", "--image-shape", "1,8,8", "--hidden", 64), "--hidden is for --model mlp"),
    (("--image-shape", "1,8,8"), "--image-shape is for image models"),
    (("--max-length", 10), "--max-length applies to text"),
    (("--overwrite",), "--overwrite replaces an existing --checkpoint; no --checkpoint is given"),
    (("--mode", "ghost", "--clipping", "per_layer"), "--clipping per_layer clips inside one backward; --mode ghost")])
def test_an_option_this_run_would_not_read_is_refused_not_ignored(cli, data_dir, tmp_path, extra, expected):
    """Each of these trained as if the option had not been given (Adam has no momentum, PDP-SGD's
    rounds are accounted with RDP whatever --accountant says, ...)."""
    message = cli.fails("train", *_npy(data_dir), "--budgets", data_dir / "budgets.npy", *extra,
                        "--out-json", tmp_path / "s.json", *SMALL)
    assert expected in message, message
    assert not (tmp_path / "s.json").exists()


def test_overwrite_with_a_resume_of_the_same_checkpoint_is_refused_not_ignored(cli, data_dir, tmp_path):
    common = (*_npy(data_dir), "--budgets", data_dir / "budgets.npy", "--checkpoint", tmp_path / "c.pt")
    rc, out, err = cli("train", *common, "--stop-after-steps", 1, *SMALL)
    assert rc == 0, err
    message = cli.fails("train", *common, "--resume", tmp_path / "c.pt", "--overwrite", *SMALL)
    assert "--overwrite with --resume of the same checkpoint would be ignored" in message


def test_a_run_stopped_without_a_checkpoint_does_not_offer_a_resume(cli, data_dir):
    rc, out, err = cli("train", *_npy(data_dir), "--budgets", data_dir / "budgets.npy", "--stop-after-steps", 1,
                       "--epochs", 1, "--batch-size", 40, "--noise-seed", 0)
    assert rc == 0, err
    said = out + err
    assert "stopped after step 1 of" in said and "no --checkpoint was given, so it cannot be continued" in said
    assert "--resume None" not in said


def test_a_record_whose_gradient_overflows_stops_the_run_with_one_line_not_a_traceback(cli, tmp_path):
    """A feature of 1e30 is a float32, so the loader takes it, but its squared norm overflows: the
    clipping refuses the batch (FloatingPointError), which used to end the command in a traceback."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3))
    x[3, 0] = 1e30
    rows = ["a,b,c,y,eps"] + [f"{a:.17g},{b:.17g},{c:.17g},{int(a > 0)},{e}"
                              for (a, b, c), e in zip(x, rng.choice([1.0, 2.0], 40))]
    (tmp_path / "big.csv").write_text("\n".join(rows) + "\n")
    rc, out, err = cli("train", "--data", tmp_path / "big.csv", "--label-column", "y", "--budget-column", "eps",
                       "--batch-size", 40, "--epochs", 1, "--test-fraction", 0, "--quiet", "--noise-seed", 0,
                       "--out-json", tmp_path / "s.json")
    assert rc == 2 and "Traceback" not in err, err
    assert "pdpfast train: error: 1 record(s) (dataset records [3] (0-based;" in err and "NaN or inf" in err
    assert not (tmp_path / "s.json").exists()


def test_a_resume_file_that_is_not_a_checkpoint_is_named_by_resume(cli, data_dir, tmp_path):
    (tmp_path / "plan.json").write_text("{}")
    message = cli.fails("train", *_npy(data_dir), "--budgets", data_dir / "budgets.npy", "--resume",
                        tmp_path / "plan.json", *SMALL)
    assert "--resume" in message and "cannot be read as a checkpoint" in message and "--checkpoint" not in message
