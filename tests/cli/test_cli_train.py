"""`pdpfast train` end to end: data formats, methods, checkpoint/resume of the ledger, bad inputs."""
import json
import shutil
import sys
import types

import numpy as np
import pytest
import torch
from conftest import outputs, run_module

from pdpfast.accounting import IndividualAccountant

SMALL = ("--epochs", 1, "--batch-size", 40, "--quiet", "--noise-seed", 0)   # a fixed noise seed: reproducible


def _summary(path):
    return json.loads(path.read_text())


def _assert_within_budgets(summary):
    for row in summary["groups"]:
        assert row["max_ratio"] <= 1.0, row
        assert row["max_spent"] <= row["high"], row


@pytest.mark.parametrize("method", ["sample", "scale", "hybrid", "dpsgd", "pdp"])
def test_train_on_csv_with_a_budget_column_spends_within_budgets(cli, data_dir, tmp_path, method):
    rc, out, err = cli("train", "--data", data_dir / "digits.csv", "--label-column", "digit", "--budget-column", "eps",
                       "--method", method, "--checkpoint", tmp_path / "ck.pt", "--out-json", tmp_path / "s.json",
                       *SMALL)
    assert rc == 0, err
    assert "ε spent per budget group" in out and "test: accuracy" in out
    summary = _summary(tmp_path / "s.json")
    assert [r["budget"] for r in summary["groups"]] == ["1", "2", "3"]
    _assert_within_budgets(summary)
    spent = {r["budget"]: r["max_spent"] for r in summary["groups"]}
    if method == "dpsgd":
        assert max(spent.values()) <= 1.0
    else:
        assert spent["3"] > 2.0          # a record with budget 3 spends more than DP-SGD would let it
    checkpoint = torch.load(tmp_path / "ck.pt", weights_only=False)
    assert checkpoint["extra"]["model_config"]["name"] == "mlp"
    assert checkpoint["extra"]["train_args"]["method"] == method
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_train_with_the_pld_accountant_spends_within_budgets(cli, data_dir, tmp_path):
    # the ledger follows the plan's accountant: an RDP ledger reported a PLD plan at 1.1-1.6x
    rc, out, err = cli("train", "--data", data_dir / "x.npy", "--labels", data_dir / "y.npy", "--budgets",
                       data_dir / "budgets.npy", "--accountant", "pld", "--out-json", tmp_path / "s.json", *SMALL)
    assert rc == 0, err
    summary = _summary(tmp_path / "s.json")
    _assert_within_budgets(summary)
    assert min(r["max_ratio"] for r in summary["groups"]) >= 0.98


@pytest.mark.parametrize("budgets", ["budgets.npy", "budgets.txt", "budgets.csv"])
def test_train_on_numpy_with_a_budgets_file(cli, data_dir, tmp_path, budgets):
    rc, out, err = cli("train", "--data", data_dir / "x.npy", "--labels", data_dir / "y.npy", "--budgets",
                       data_dir / budgets, "--out-json", tmp_path / "s.json", "--clipping", "per_layer", *SMALL)
    assert rc == 0, err
    _assert_within_budgets(_summary(tmp_path / "s.json"))


def test_train_cnn_on_features_viewed_as_images_in_ghost_mode(cli, data_dir, tmp_path):
    rc, out, err = cli("train", "--data", data_dir / "x.npy", "--labels", data_dir / "y.npy", "--budgets",
                       data_dir / "budgets.npy", "--model", "cnn", "--image-shape", "1,8,8", "--mode", "ghost",
                       "--out-json", tmp_path / "s.json", *SMALL)
    assert rc == 0, err
    _assert_within_budgets(_summary(tmp_path / "s.json"))


@pytest.mark.parametrize("model", ["bert-micro", "gpt2-micro", "llama-micro"])
def test_train_transformers_on_token_ids(cli, data_dir, tmp_path, model):
    rc, out, err = cli("train", "--data", data_dir / "tokens.npz", "--model", model, "--epochs", 1, "--batch-size", 8,
                       "--out-json", tmp_path / "s.json", "--quiet")
    assert rc == 0, err
    summary = _summary(tmp_path / "s.json")
    _assert_within_budgets(summary)
    assert ("accuracy" if model.startswith("bert") else "perplexity") in summary["test"]


def test_train_bert_on_a_text_column_with_the_hashing_tokenizer(cli, tmp_path):
    rng = np.random.default_rng(0)
    words = ["good", "bad", "plot", "actor", "fine", "dull"]
    rows = [f"{' '.join(rng.choice(words, 5))},{'pos' if i % 2 else 'neg'},{1.0 + i % 3}" for i in range(40)]
    (tmp_path / "reviews.csv").write_text("text,label,eps\n" + "\n".join(rows) + "\n")
    rc, out, err = cli("train", "--data", tmp_path / "reviews.csv", "--text-column", "text", "--label-column", "label",
                       "--budget-column", "eps", "--model", "bert-micro", "--max-length", 8, "--epochs", 1,
                       "--batch-size", 8, "--quiet")
    assert rc == 0, err


def test_train_on_a_hugging_face_dataset(cli, tmp_path, monkeypatch):
    """`--hf-dataset` through a stand-in for the `datasets` package (no download)."""
    rng = np.random.default_rng(0)
    table = {"text": [" ".join(rng.choice(["a", "b", "c", "d"], 4)) for _ in range(30)],
             "label": rng.integers(0, 2, 30).tolist(), "eps": rng.choice([0.5, 2.0], 30).tolist()}

    class FakeDataset:
        column_names = list(table)
        features = {}

        def __len__(self):
            return 30

        def __getitem__(self, column):
            return table[column]

    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda name, config=None, split="train": FakeDataset()
    monkeypatch.setitem(sys.modules, "datasets", fake)
    rc, out, err = cli("train", "--hf-dataset", "someone/reviews", "--text-column", "text", "--budget-column", "eps",
                       "--model", "bert-micro", "--max-length", 6, "--epochs", 1, "--batch-size", 6,
                       "--out-json", tmp_path / "s.json", "--quiet")
    assert rc == 0, err
    assert "hf:someone/reviews" in out
    _assert_within_budgets(_summary(tmp_path / "s.json"))


def _ledger_epsilons(checkpoint_path, delta=1e-5):
    checkpoint = torch.load(checkpoint_path, weights_only=False)
    if "pdp" in checkpoint["extra"]:
        state = checkpoint["extra"]["pdp"]
        return np.r_[state["budgets"] - state["remaining"], state["ledger_eps"], state["spent_delta"]], checkpoint
    ledger = IndividualAccountant.__new__(IndividualAccountant)
    ledger.load_state_dict(checkpoint["engine"]["ledger"])
    return ledger.epsilons(delta), checkpoint


@pytest.mark.parametrize("method,stop", [("hybrid", 7), ("pdp", 5), ("pdp", 12)])   # pdp: 11 + 3 steps in 2 rounds
def test_checkpoint_then_resume_continues_the_ledger_exactly(cli, data_dir, tmp_path, method, stop):
    common = ("train", "--data", data_dir / "x.npy", "--labels", data_dir / "y.npy", "--budgets",
              data_dir / "budgets.npy", "--method", method, "--epochs", 4, "--batch-size", 40, "--quiet",
              "--noise-seed", 1)
    assert cli(*common, "--checkpoint", tmp_path / "whole.pt")[0] == 0
    rc, out, _ = cli(*common, "--checkpoint", tmp_path / "part.pt", "--stop-after-steps", stop, "--checkpoint-every", 3)
    assert rc == 0 and f"stopped after step {stop} of" in out
    before, _ = _ledger_epsilons(tmp_path / "part.pt")
    rc, out, err = cli(*common, "--resume", tmp_path / "part.pt")
    assert rc == 0, err
    assert "resumed from" in out and f"at step {stop} of" in out
    whole, whole_ckpt = _ledger_epsilons(tmp_path / "whole.pt")
    resumed, resumed_ckpt = _ledger_epsilons(tmp_path / "part.pt")
    assert not np.array_equal(before, whole)          # the interrupted run had not spent everything yet
    np.testing.assert_allclose(resumed, whole, rtol=1e-12, atol=0)
    for name, value in whole_ckpt["model"].items():
        torch.testing.assert_close(resumed_ckpt["model"][name], value, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["scale", "pdp"])
def test_the_noise_seed_is_secret_unless_given_and_a_resume_keeps_the_runs_own(cli, data_dir, tmp_path, method):
    """Before: --seed (default 0) also seeded the Poisson draws and the noise, so anyone could recompute
    and remove the noise of a released model. Now two runs with the same --seed differ; a resume goes on
    with the checkpoint's own noise seed; a given --noise-seed reproduces a run."""
    common = ("train", "--data", data_dir / "x.npy", "--labels", data_dir / "y.npy", "--budgets",
              data_dir / "budgets.npy", "--method", method, "--epochs", 1, "--batch-size", 40, "--quiet")

    def weights(path):
        return torch.cat([v.flatten().double() for v in torch.load(path, weights_only=False)["model"].values()])

    for name in ("a", "b"):
        assert cli(*common, "--checkpoint", tmp_path / f"{name}.pt")[0] == 0
    assert not torch.equal(weights(tmp_path / "a.pt"), weights(tmp_path / "b.pt"))
    for name in ("c", "d"):
        assert cli(*common, "--noise-seed", 4, "--checkpoint", tmp_path / f"{name}.pt")[0] == 0
    assert torch.equal(weights(tmp_path / "c.pt"), weights(tmp_path / "d.pt"))
    assert cli(*common, "--checkpoint", tmp_path / "part.pt", "--stop-after-steps", 2)[0] == 0
    rc, out, err = cli(*common, "--resume", tmp_path / "part.pt")
    assert rc == 0 and "resumed from" in out, err
    message = cli.fails(*common, "--noise-seed", 4, "--resume", tmp_path / "part.pt")
    assert "--noise-seed None" in message


def test_a_resume_takes_the_new_lr_and_momentum_and_keeps_the_optimizer_state(cli, data_dir, tmp_path):
    """Before: --lr and --momentum were accepted on --resume and ignored (the checkpoint's were loaded)."""
    common = ("train", "--data", data_dir / "x.npy", "--labels", data_dir / "y.npy", "--budgets",
              data_dir / "budgets.npy", "--epochs", 2, "--batch-size", 40, "--quiet", "--noise-seed", 2)
    assert cli(*common, "--checkpoint", tmp_path / "c.pt", "--stop-after-steps", 2)[0] == 0
    for name, extra in (("same", ()), ("slow", ("--lr", 0.001, "--momentum", 0.0))):
        shutil.copy(tmp_path / "c.pt", tmp_path / f"{name}.pt")
        path = tmp_path / f"{name}.pt"
        rc, out, err = cli(*common, *extra, "--resume", path, "--checkpoint", path)
        assert rc == 0, err
    saved = torch.load(tmp_path / "slow.pt", weights_only=False)
    group = saved["engine"]["optimizer"]["optimizer"]["param_groups"][0]
    assert group["lr"] == 0.001 and group["momentum"] == 0.0
    same = torch.load(tmp_path / "same.pt", weights_only=False)["model"]
    assert any(not torch.equal(same[k], v) for k, v in saved["model"].items())


def test_two_continuations_of_one_checkpoint_with_other_learning_rates_share_no_noise(cli, data_dir, tmp_path):
    """The noise of step t came from (the checkpoint's seed, t): a continuation with another --lr added
    the same noise as the run that wrote the checkpoint going on, and the difference of their updates
    was noise-free (std 0.0006 where independent noise gives 0.058). A continuation that changes --lr,
    --momentum or --precision now derives its own seeds; one that changes nothing still goes on
    bit-identically."""
    common = ("train", "--data", data_dir / "x.npy", "--labels", data_dir / "y.npy", "--budgets",
              data_dir / "budgets.npy", "--epochs", 2, "--batch-size", 40, "--quiet", "--momentum", 0)

    def weights(path):
        return torch.cat([v.flatten().double() for v in torch.load(path, weights_only=False)["model"].values()])

    def seeds(path):
        engine = torch.load(path, weights_only=False)["engine"]
        return engine["optimizer"]["seed"], engine["loader"]["seed"]

    assert cli(*common, "--lr", 0.1, "--checkpoint", tmp_path / "c.pt", "--stop-after-steps", 2)[0] == 0
    updates = {}
    for name, lr in (("same", 0.1), ("again", 0.1), ("other", 0.3)):
        path = tmp_path / f"{name}.pt"
        shutil.copy(tmp_path / "c.pt", path)
        rc, out, err = cli(*common, "--lr", lr, "--resume", path, "--checkpoint", path, "--stop-after-steps", 1)
        assert rc == 0, err
        assert ("--lr 0.1 → 0.3: this continuation draws its own records and noise" in out) == (name == "other")
        after_one = weights(path)
        assert cli(*common, "--lr", lr, "--resume", path, "--checkpoint", path, "--stop-after-steps", 1)[0] == 0
        updates[name] = (after_one - weights(path)) / lr               # step 3's noisy mean gradient
    assert seeds(tmp_path / "same.pt") == seeds(tmp_path / "c.pt")
    assert seeds(tmp_path / "other.pt") != seeds(tmp_path / "c.pt")
    torch.testing.assert_close(updates["again"], updates["same"], rtol=0, atol=0)   # the same continuation
    # independent noise: the difference has about √2 times one update's noise, not a fraction of it
    assert (updates["other"] - updates["same"]).std() > 0.8 * updates["same"].std()


def test_a_pdp_run_resumed_with_another_learning_rate_is_refused(cli, data_dir, tmp_path):
    common = ("train", "--data", data_dir / "x.npy", "--labels", data_dir / "y.npy", "--budgets",
              data_dir / "budgets.npy", "--method", "pdp", "--epochs", 2, "--batch-size", 40, "--quiet")
    assert cli(*common, "--checkpoint", tmp_path / "c.pt", "--stop-after-steps", 2)[0] == 0
    message = cli.fails(*common, "--lr", 0.01, "--resume", tmp_path / "c.pt", "--checkpoint", tmp_path / "d.pt")
    assert "PDP-SGD run resumes with the checkpoint's settings (--lr 0.1 → 0.01)" in message


def test_resume_with_other_budgets_is_refused(cli, data_dir, tmp_path):
    common = ("train", "--data", data_dir / "x.npy", "--labels", data_dir / "y.npy", *SMALL)
    assert cli(*common, "--budgets", data_dir / "budgets.npy", "--checkpoint", tmp_path / "c.pt",
               "--stop-after-steps", 2)[0] == 0
    message = cli.fails("train", *common[1:], "--epsilon", 1.0, "--resume", tmp_path / "c.pt")
    assert "budgets" in message


def test_train_runs_as_a_module_in_a_subprocess(data_dir, tmp_path):
    result = run_module("train", "--data", data_dir / "digits.csv", "--label-column", "digit", "--budget-column",
                        "eps", "--method", "scale", "--out-json", tmp_path / "s.json", *SMALL, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "ε spent per budget group" in result.stdout
    _assert_within_budgets(_summary(tmp_path / "s.json"))


def _write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", ["missing budgets file", "budgets file a directory", "NaN budget", "zero budget",
                                  "negative budget", "empty budget", "too few budgets", "malformed budgets file",
                                  "unknown model", "unknown method", "budgets twice", "no budgets", "missing data",
                                  "missing labels", "unknown label column", "bad image shape", "cnn on flat features"])
def test_bad_input_fails_in_one_line_and_leaves_no_output(cli, data_dir, tmp_path, case):
    work = tmp_path / "work"
    work.mkdir()
    csv_lines = (data_dir / "digits.csv").read_text().splitlines()

    def csv_with_budget(value):
        rows = [line.split(",") for line in csv_lines]
        rows[5][-1] = value
        return _write(work / "d.csv", "\n".join(",".join(r) for r in rows) + "\n")

    npy = ("--data", data_dir / "x.npy", "--labels", data_dir / "y.npy")
    args = {
        "missing budgets file": (*npy, "--budgets", work / "nope.npy"),
        "budgets file a directory": (*npy, "--budgets", work),
        "NaN budget": ("--data", csv_with_budget("nan"), "--label-column", "digit", "--budget-column", "eps"),
        "zero budget": ("--data", csv_with_budget("0"), "--label-column", "digit", "--budget-column", "eps"),
        "negative budget": ("--data", csv_with_budget("-1"), "--label-column", "digit", "--budget-column", "eps"),
        "empty budget": ("--data", csv_with_budget(""), "--label-column", "digit", "--budget-column", "eps"),
        "too few budgets": (*npy, "--budgets", _write(work / "b.txt", "1\n2\n3\n")),
        "malformed budgets file": (*npy, "--budgets", _write(work / "b.csv", "eps\n1\ntwo\n")),
        "unknown model": (*npy, "--budgets", data_dir / "budgets.npy", "--model", "resnet9000"),
        "unknown method": (*npy, "--budgets", data_dir / "budgets.npy", "--method", "magic"),
        "budgets twice": ("--data", data_dir / "digits.csv", "--label-column", "digit", "--budget-column", "eps",
                          "--budgets", data_dir / "budgets.npy"),
        "no budgets": npy,
        "missing data": ("--data", work / "none.csv", "--label-column", "y", "--epsilon", 1),
        "missing labels": ("--data", data_dir / "x.npy", "--labels", work / "none.npy", "--epsilon", 1),
        "unknown label column": ("--data", data_dir / "digits.csv", "--label-column", "y", "--budget-column", "eps"),
        "bad image shape": (*npy, "--epsilon", 1, "--model", "cnn", "--image-shape", "3,8,8"),
        "cnn on flat features": (*npy, "--epsilon", 1, "--model", "cnn"),
    }[case]
    before = outputs(work)
    cli.fails("train", *args, "--checkpoint", work / "ck.pt", "--out-json", work / "s.json", *SMALL)
    assert outputs(work) == before
