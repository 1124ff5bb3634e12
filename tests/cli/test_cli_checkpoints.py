"""`pdpfast train` checkpoints and outputs: no silent overwrite, a fingerprint of the data, no stale
temporaries, a final checkpoint on Ctrl-C / SIGTERM, output paths checked before any work."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import REPO, outputs

import pdpfast.pdp_sgd
import pdpfast.train
from pdpfast.accounting import IndividualAccountant

SMALL = ("--epochs", 1, "--batch-size", 40, "--quiet", "--noise-seed", 0)   # a fixed noise seed: reproducible


def _npy_args(data_dir, x=None, y=None):
    return ("--data", x or data_dir / "x.npy", "--labels", y or data_dir / "y.npy", "--budgets",
            data_dir / "budgets.npy")


def _ledger_epsilons(checkpoint, delta=1e-5):
    ledger = IndividualAccountant.__new__(IndividualAccountant)
    ledger.load_state_dict(checkpoint["engine"]["ledger"])
    return ledger.epsilons(delta)


def _steps(checkpoint_path):
    checkpoint = torch.load(checkpoint_path, weights_only=False)
    return int(checkpoint["engine"]["optimizer"]["steps"])


def test_fresh_train_refuses_to_overwrite_existing_checkpoint(cli, data_dir, tmp_path):
    ck = tmp_path / "run.pt"
    assert cli("train", *_npy_args(data_dir), "--checkpoint", ck, "--stop-after-steps", 2, *SMALL)[0] == 0
    before = ck.read_bytes()
    message = cli.fails("train", *_npy_args(data_dir), "--checkpoint", ck, *SMALL)
    assert "--checkpoint" in message and "--resume" in message and "--overwrite" in message
    assert ck.read_bytes() == before                  # its ledger is untouched
    assert outputs(tmp_path) == ["run.pt"]


def test_resume_refuses_to_write_over_another_existing_checkpoint(cli, data_dir, tmp_path):
    assert cli("train", *_npy_args(data_dir), "--checkpoint", tmp_path / "a.pt", "--stop-after-steps", 2,
               *SMALL)[0] == 0
    assert cli("train", *_npy_args(data_dir), "--checkpoint", tmp_path / "b.pt", "--stop-after-steps", 1,
               *SMALL)[0] == 0
    before = (tmp_path / "b.pt").read_bytes()
    message = cli.fails("train", *_npy_args(data_dir), "--resume", tmp_path / "a.pt", "--checkpoint",
                        tmp_path / "b.pt", *SMALL)
    assert "--overwrite" in message
    assert (tmp_path / "b.pt").read_bytes() == before


def test_overwrite_starts_a_fresh_run_over_an_existing_checkpoint(cli, data_dir, tmp_path):
    ck = tmp_path / "run.pt"
    assert cli("train", *_npy_args(data_dir), "--checkpoint", ck, "--stop-after-steps", 2, *SMALL)[0] == 0
    rc, out, err = cli("train", *_npy_args(data_dir), "--checkpoint", ck, "--overwrite", *SMALL)
    assert rc == 0, err
    assert _steps(ck) == 7                            # a whole fresh epoch: 288 records at q = 40/288, 7 steps
    assert "resumed" not in out


@pytest.mark.parametrize("what", ["features", "labels"])
def test_resume_refuses_checkpoint_of_other_features_or_labels(cli, data_dir, tmp_path, what):
    ck = tmp_path / "run.pt"
    assert cli("train", *_npy_args(data_dir), "--checkpoint", ck, "--stop-after-steps", 2, *SMALL)[0] == 0
    x, y = np.load(data_dir / "x.npy"), np.load(data_dir / "y.npy")
    if what == "features":          # same N, shape, budgets and labels; one value changed
        x = x.copy()
        x[3, 7] += 0.5
    else:
        y = y.copy()
        y[[3, 4]] = y[[4, 3]] if y[3] != y[4] else (y[[3, 4]] + 1) % 10
    np.save(tmp_path / "x2.npy", x)
    np.save(tmp_path / "y2.npy", y)
    before = ck.read_bytes()
    message = cli.fails("train", *_npy_args(data_dir, tmp_path / "x2.npy", tmp_path / "y2.npy"), "--resume", ck,
                        *SMALL)
    assert what in message
    assert ck.read_bytes() == before


def test_stale_checkpoint_temporaries_are_removed_on_the_next_start(cli, data_dir, tmp_path):
    ck = tmp_path / "run.pt"
    stale = [tmp_path / ".run.pt-k1ll3d_x.tmp", tmp_path / ".s.json.abc123_z.json"]   # atomic writes cut by kill -9
    for path in stale:
        path.write_bytes(b"half a checkpoint")
    (tmp_path / "other.tmp").write_text("not ours")
    rc, _, err = cli("train", *_npy_args(data_dir), "--checkpoint", ck, "--out-json", tmp_path / "s.json",
                     "--stop-after-steps", 1, *SMALL)
    assert rc == 0, err
    assert outputs(tmp_path) == ["other.tmp", "run.pt", "s.json"]


def _raise_signal_at(monkeypatch, signum, at_step):
    """Deliver ``signum`` to this process right after optimizer step ``at_step`` (as a user would)."""
    real = pdpfast.train.private_steps

    def private_steps(*args, on_step=None, **kwargs):
        def hook(step, loss):
            if step == at_step:
                signal.raise_signal(signum)
            return on_step(step, loss)
        return real(*args, on_step=hook, **kwargs)

    monkeypatch.setattr(pdpfast.train, "private_steps", private_steps)
    monkeypatch.setattr(pdpfast.pdp_sgd, "private_steps", private_steps)


@pytest.mark.parametrize("method", ["hybrid", "pdp"])
def test_ctrl_c_writes_a_final_checkpoint_that_resumes_exactly(cli, data_dir, tmp_path, monkeypatch, method):
    common = ("train", *_npy_args(data_dir), "--method", method, "--epochs", 2, "--batch-size", 40, "--quiet",
              "--noise-seed", 1)
    assert cli(*common, "--checkpoint", tmp_path / "whole.pt")[0] == 0
    with monkeypatch.context() as patch:
        _raise_signal_at(patch, signal.SIGINT, 4)
        rc, out, err = cli(*common, "--checkpoint", tmp_path / "part.pt", "--out-json", tmp_path / "s.json")
    assert rc == 128 + signal.SIGINT
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdpfast train: interrupted"), err
    assert "step 4" in lines[0] and "--resume" in lines[0]
    assert not (tmp_path / "s.json").exists()         # a stopped command writes no summary
    part = torch.load(tmp_path / "part.pt", weights_only=False)
    assert part["extra"]["interrupted"] is True
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    rc, out, err = cli(*common, "--resume", tmp_path / "part.pt")
    assert rc == 0, err
    assert "at step 4 of" in out
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    resumed = torch.load(tmp_path / "part.pt", weights_only=False)
    for name, value in whole["model"].items():
        torch.testing.assert_close(resumed["model"][name], value, rtol=0, atol=0)
    if method == "pdp":
        np.testing.assert_array_equal(resumed["extra"]["pdp"]["remaining"], whole["extra"]["pdp"]["remaining"])
    else:
        np.testing.assert_array_equal(_ledger_epsilons(resumed), _ledger_epsilons(whole))


def test_sigterm_writes_a_final_checkpoint(data_dir, tmp_path):
    ck = tmp_path / "run.pt"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = (*_npy_args(data_dir), "--epochs", 400, "--batch-size", 40, "--quiet", "--checkpoint", ck,
            "--checkpoint-every", 2)
    proc = subprocess.Popen([sys.executable, "-m", "pdpfast", "train", *map(str, args)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ck.exists():                        # training runs: its first periodic checkpoint is there
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "interrupted (SIGTERM)" in err and "--resume" in err
    steps = _steps(ck)
    assert steps >= 2
    checkpoint = torch.load(ck, weights_only=False)
    assert checkpoint["extra"]["interrupted"] is True
    assert checkpoint["engine"]["loader"]["next_step"] == steps      # consistent: the draws taken are the steps taken
    assert outputs(tmp_path) == ["run.pt"]


@pytest.mark.parametrize("case", ["checkpoint is a directory", "out-json under a file", "checkpoint under a file",
                                  "same path twice", "resume is a directory"])
def test_output_paths_are_validated_before_training_starts(cli, data_dir, tmp_path, monkeypatch, case):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_dir").mkdir()
    args = {
        "checkpoint is a directory": ("--checkpoint", tmp_path / "a_dir"),
        "out-json under a file": ("--out-json", tmp_path / "a_file" / "s.json"),
        "checkpoint under a file": ("--checkpoint", tmp_path / "a_file" / "sub" / "run.pt"),
        "same path twice": ("--checkpoint", tmp_path / "o", "--out-json", tmp_path / "o"),
        "resume is a directory": ("--resume", tmp_path / "a_dir"),
    }[case]

    def too_late(cfg):
        raise AssertionError("the data were loaded before the output paths were checked")

    monkeypatch.setattr(pdpfast.train, "load_training_data", too_late)
    before = outputs(tmp_path)
    message = cli.fails("train", *_npy_args(data_dir), *args, *SMALL)
    assert ("--checkpoint" in message or "--out-json" in message or "--resume" in message), message
    assert outputs(tmp_path) == before


def test_calibrate_with_a_directory_as_plot_writes_nothing(cli, data_dir, tmp_path):
    (tmp_path / "plots").mkdir()
    before = outputs(tmp_path)
    message = cli.fails("calibrate", data_dir / "budgets.npy", "--steps", 5, "--sample-rate", 0.1, "--out",
                        tmp_path / "plan.json", "--plot", tmp_path / "plots")
    assert "--plot" in message and "directory" in message
    assert outputs(tmp_path) == before


def test_resume_with_another_optimizer_names_the_option(cli, data_dir, tmp_path):
    ck = tmp_path / "run.pt"
    assert cli("train", *_npy_args(data_dir), "--checkpoint", ck, "--stop-after-steps", 2, *SMALL)[0] == 0
    message = cli.fails("train", *_npy_args(data_dir), "--resume", ck, "--optimizer", "adam", *SMALL)
    assert "--optimizer" in message and "sgd" in message and "adam" in message


@pytest.mark.parametrize("command,args", [("demo", ("--out", "a_file")),
                                          ("bench", ("--suite", "cpu", "--out", "a_dir")),
                                          ("bench", ("--suite", "cpu", "--out", "r.json", "--plot", "r.json"))])
def test_other_commands_check_their_output_paths_before_any_work(cli, tmp_path, monkeypatch, command, args):
    import pdpfast.demo

    def too_late(*a, **k):
        raise AssertionError("work started before the output paths were checked")

    monkeypatch.setattr(pdpfast.demo, "run_demo", too_late)
    monkeypatch.setattr("pdpfast.cli._import_bench", too_late)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_dir").mkdir()
    before = outputs(tmp_path)
    message = cli.fails(command, *args)
    assert "--out" in message or "--plot" in message, message
    assert outputs(tmp_path) == before


def test_resume_refuses_a_checkpoint_without_a_data_fingerprint(cli, data_dir, tmp_path):
    """A checkpoint from before features and labels were hashed cannot be checked: refused."""
    ck = tmp_path / "run.pt"
    assert cli("train", *_npy_args(data_dir), "--checkpoint", ck, "--stop-after-steps", 2, *SMALL)[0] == 0
    checkpoint = torch.load(ck, weights_only=False)
    for key in ("features_sha256", "labels_sha256"):
        del checkpoint["extra"]["data"][key]
    torch.save(checkpoint, ck)
    message = cli.fails("train", *_npy_args(data_dir), "--resume", ck, *SMALL)
    assert "fingerprint" in message and "without --resume" in message


def test_a_second_signal_stops_at_once_and_handlers_are_restored():
    from pdpfast import launch
    from pdpfast.train import _StopOnSignal

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(KeyboardInterrupt):
        with _StopOnSignal() as stop:
            signal.raise_signal(signal.SIGTERM)      # the first: finish the step, then stop
            assert stop.received == signal.SIGTERM
            launch._LAST_STOP[0] -= 2 * launch.SAME_STOP_S   # a second later (sooner, it is the same request)
            signal.raise_signal(signal.SIGINT)       # the second: now
            pytest.fail("the second signal did not interrupt")
    assert {s: signal.getsignal(s) for s in before} == before


def test_resuming_a_finished_run_says_so_instead_of_a_throughput(cli, data_dir, tmp_path):
    ck = tmp_path / "run.pt"
    args = (*_npy_args(data_dir), "--epochs", 1, "--batch-size", 40)
    assert cli("train", *args, "--checkpoint", ck, "--quiet")[0] == 0
    rc, out, err = cli("train", *args, "--resume", ck)
    assert rc == 0, err
    assert "done: the run had finished (7 steps); nothing left to train" in out
    assert "records/s" not in out
    assert _steps(ck) == 7


def test_checkpoints_that_saved_the_old_default_hybrid_weight_for_other_methods_still_resume(cli, data_dir, tmp_path):
    """Until 2026-11-25 every checkpoint saved λ = 0.5, whatever the method; λ is now None unless
    the method is hybrid, and a resume compares the λ each run reads."""
    ck = tmp_path / "run.pt"
    assert cli("train", *_npy_args(data_dir), "--checkpoint", ck, "--stop-after-steps", 2, *SMALL)[0] == 0
    checkpoint = torch.load(ck, weights_only=False)
    assert checkpoint["extra"]["train_args"]["hybrid_weight"] is None
    checkpoint["extra"]["train_args"]["hybrid_weight"] = 0.5
    torch.save(checkpoint, ck)
    rc, _, err = cli("train", *_npy_args(data_dir), "--resume", ck, "--stop-after-steps", 1, *SMALL)
    assert rc == 0, err
    assert _steps(ck) == 3          # two steps, then one more


def test_a_hybrid_run_resumes_only_with_the_hybrid_weight_it_was_made_with(cli, data_dir, tmp_path):
    ck = tmp_path / "run.pt"
    hybrid = ("--method", "hybrid")
    assert cli("train", *_npy_args(data_dir), *hybrid, "--checkpoint", ck, "--stop-after-steps", 2, *SMALL)[0] == 0
    message = cli.fails("train", *_npy_args(data_dir), *hybrid, "--hybrid-weight", 0.3, "--resume", ck, *SMALL)
    assert "--hybrid-weight 0.5" in message and "0.3" in message
    rc, _, err = cli("train", *_npy_args(data_dir), *hybrid, "--hybrid-weight", 0.5, "--resume", ck,
                     "--stop-after-steps", 3, *SMALL)
    assert rc == 0, err


def test_a_second_signal_within_a_second_is_the_same_stop_and_one_during_a_checkpoint_write_waits_for_it():
    """A scheduler signals every process of a job, so a rank of --nproc hears one stop twice at once;
    and a stop at once cut through torch.save (an abort, "write to closed file", seen once)."""
    from pdpfast import launch
    from pdpfast.train import _StopOnSignal

    with _StopOnSignal() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert stop.received == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)      # the same request, again: no KeyboardInterrupt
        time.sleep(0.01)
        launch._LAST_STOP[0] -= 2 * launch.SAME_STOP_S   # as if a second had passed
        written = False
        with pytest.raises(KeyboardInterrupt):
            with stop.saving():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.01)
                written = True                    # the write went on to its end
        assert written
        with pytest.raises(KeyboardInterrupt):    # outside a write: at once
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_that_an_import_turns_into_another_error_is_still_an_interruption(cli, monkeypatch):
    """numpy's import turns a KeyboardInterrupt that lands in it into an ImportError: the command
    remembers the Ctrl-C and ends as interrupted (one line, status 130), not with that error's
    traceback, and gives SIGINT its handler back."""
    import pdpfast.cli

    def parser_whose_import_is_interrupted():
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt as exc:
            raise ImportError("PyCapsule_Import could not import module \"datetime\"") from exc

    monkeypatch.setattr(pdpfast.cli, "build_parser", parser_whose_import_is_interrupted)
    rc, out, err = cli("train", "--epochs", 1)
    assert rc == 128 + signal.SIGINT and err.strip() == "pdpfast train: interrupted", err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_while_the_first_is_handled_is_the_same_interruption(cli, monkeypatch):
    """A second SIGINT within a second of the first (a double press, or the copy a launcher hands on)
    used to raise inside the handling of the first (while its line was written), with a traceback."""
    import pdpfast.cli
    from pdpfast import launch

    def second_press_while_reporting(line):
        signal.raise_signal(signal.SIGINT)
        return False

    monkeypatch.setattr(pdpfast.cli, "build_parser", lambda: signal.raise_signal(signal.SIGINT))
    monkeypatch.setattr(launch, "report_ending", second_press_while_reporting)
    rc, out, err = cli("train", "--epochs", 1)
    assert rc == 128 + signal.SIGINT and err.strip() == "pdpfast train: interrupted", err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler        # in-process: given back
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.parametrize("extra", [5, {"train_args": 5}, "damaged data", "damaged model config"])
def test_resume_of_a_file_with_a_foreign_structure_says_it_is_not_a_train_checkpoint(cli, data_dir, tmp_path, extra):
    """A dict whose `extra`, `train_args`, `data` or `model_config` is not what `pdpfast train` writes is named
    as not its checkpoint (was a TypeError from inside the checks, or "predates fingerprints")."""
    ck = tmp_path / "run.pt"
    if isinstance(extra, str):
        assert cli("train", *_npy_args(data_dir), "--checkpoint", ck, "--stop-after-steps", 2, *SMALL)[0] == 0
        checkpoint = torch.load(ck, weights_only=False)
        checkpoint["extra"]["data" if extra == "damaged data" else "model_config"] = "x"
        torch.save(checkpoint, ck)
    else:
        torch.save({"extra": extra}, ck)
    message = cli.fails("train", *_npy_args(data_dir), "--resume", ck, *SMALL)
    assert f"{str(ck)!r} is not a `pdpfast train` checkpoint" in message, message


def test_save_model_writes_the_weights_alone_which_load_into_the_model_and_hold_no_seed(cli, data_dir, tmp_path):
    """The checkpoint was the only file holding the trained model, and it holds the noise seeds (which undo
    the noise) and hashes of the data: --save-model writes what may be published."""
    ck, weights = tmp_path / "run.pt", tmp_path / "model.pt"
    rc, out, err = cli("train", *_npy_args(data_dir), "--checkpoint", ck, "--save-model", weights, *SMALL)
    assert rc == 0, err
    assert f"model weights (nothing else) written to {weights}" in out
    saved = torch.load(weights, weights_only=True)              # tensors only: loads without unpickling code
    checkpoint = torch.load(ck, weights_only=False)
    assert saved.keys() == checkpoint["model"].keys()
    for name, value in checkpoint["model"].items():
        assert torch.equal(saved[name], value)
    message = cli.fails("train", *_npy_args(data_dir), "--checkpoint", tmp_path / "b.pt", "--save-model",
                        tmp_path / "b.pt", *SMALL)
    assert "--checkpoint and --save-model name the same file" in message


@pytest.mark.parametrize("damage", ["engine", "model", "torch_rng"])
def test_resume_of_a_checkpoint_with_a_damaged_state_names_it_in_one_line(cli, data_dir, tmp_path, damage):
    """An engine entry that is not a dict was an AttributeError traceback (status 1); a damaged torch_rng
    torch's words without the checkpoint's name."""
    ck = tmp_path / "run.pt"
    assert cli("train", *_npy_args(data_dir), "--checkpoint", ck, "--stop-after-steps", 2, *SMALL)[0] == 0
    checkpoint = torch.load(ck, weights_only=False)
    if damage == "torch_rng":
        checkpoint["extra"]["torch_rng"] = torch.zeros(3, dtype=torch.uint8)
    else:
        checkpoint[damage] = "not a dict"
    torch.save(checkpoint, ck)
    message = cli.fails("train", *_npy_args(data_dir), "--resume", ck, *SMALL)
    assert f"the checkpoint {str(ck)!r} is damaged: its {damage} is not what `pdpfast train` writes" in message


def test_resume_with_another_model_configuration_names_the_option_and_both_values(cli, data_dir, tmp_path):
    ck = tmp_path / "run.pt"
    assert cli("train", *_npy_args(data_dir), "--checkpoint", ck, "--stop-after-steps", 2, *SMALL)[0] == 0
    message = cli.fails("train", *_npy_args(data_dir), "--resume", ck, "--hidden", "64", *SMALL)
    assert "--hidden 128 in the checkpoint, 64 in this run" in message, message
