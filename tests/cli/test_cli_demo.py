"""`pdpfast demo`: every method, per-group ε from the ledger within budget, plots and the table."""
import json

import numpy as np
import pytest

from pdpfast.demo import GROUP_EPSILONS, METHODS, format_results, run_demo


@pytest.fixture(scope="module")
def tiny_demo():
    return run_demo(epochs=1, seeds=(0,), progress=False)


def test_demo_per_group_epsilon_never_exceeds_its_budget(tiny_demo):
    assert list(tiny_demo) == ["non-private", *METHODS]
    for method in METHODS:
        (run,) = tiny_demo[method]
        assert set(run.epsilons) == set(GROUP_EPSILONS)
        for budget, spent in run.epsilons.items():
            assert spent <= budget, (method, budget, spent)
            curve = np.asarray(run.epsilon_curve[budget])
            assert np.all(curve <= budget) and np.all(np.diff(curve) >= -1e-12), (method, budget)
        if method == "dpsgd":       # standard DP-SGD: everyone at the smallest budget
            assert max(run.epsilons.values()) <= min(GROUP_EPSILONS)
        else:                       # the individualized methods spend (nearly) each group's own budget
            assert all(spent >= 0.95 * budget for budget, spent in run.epsilons.items()), (method, run.epsilons)
        assert 0.0 <= run.accuracy <= 1.0 and run.steps[0] == 0 and len(run.steps) == len(run.accuracies)


def test_demo_table_has_every_method_with_accuracy_and_epsilon_per_group(tiny_demo):
    table = format_results(tiny_demo)
    lines = table.splitlines()
    assert "budget 1/2/3" in lines[0]
    for name in ("non-private", "DP-SGD (ε=1 for all)", "IDP Sample", "IDP Scale", "IDP hybrid", "PDP-SGD"):
        assert any(line.startswith(name) for line in lines), name
    assert "∞ (no privacy)" in table and " ± " in table


def test_demo_command_writes_plots_and_results(cli, tmp_path):
    out = tmp_path / "demo"
    rc, stdout, _ = cli("demo", "--epochs", 1, "--seeds", 1, "--methods", "dpsgd,scale,pdp", "--out", out, "--quiet")
    assert rc == 0
    assert "IDP Scale" in stdout and "PDP-SGD" in stdout and "IDP Sample" not in stdout
    for name in ("accuracy.png", "epsilon.png"):
        data = (out / name).read_bytes()
        assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((out / "results.json").read_text())
    assert set(results["runs"]) == {"non-private", "dpsgd", "scale", "pdp"}
    assert not [p for p in out.iterdir() if p.name.startswith(".")]     # no temporary files left


def test_demo_bad_method_fails_in_one_line_and_writes_nothing(cli, tmp_path):
    message = cli.fails("demo", "--methods", "sample,bogus", "--out", tmp_path / "never", "--quiet")
    assert "bogus" in message
    assert not (tmp_path / "never").exists()


def test_demo_accountant_option_calibrates_and_accounts_with_pld(cli, tmp_path):
    out = tmp_path / "demo_pld"
    rc, stdout, _ = cli("demo", "--epochs", 1, "--seeds", 1, "--methods", "scale", "--accountant", "pld", "--out", out,
                        "--quiet")
    assert rc == 0 and "IDP Scale" in stdout
    spent = json.loads((out / "results.json").read_text())["runs"]["scale"][0]["epsilons"]
    for budget, eps in spent.items():       # the PLD ledger's spending: within budget, and nearly all of it
        assert 0.95 * float(budget) <= eps <= float(budget)
    message = cli.fails("demo", "--accountant", "bogus", "--out", tmp_path / "never", "--quiet")
    assert "accountant" in message
    with pytest.raises(ValueError, match="accountant"):
        run_demo(epochs=1, seeds=(0,), methods=("scale",), accountant="moments")


@pytest.mark.parametrize("args,expected", [
    (("--adaptive", "--methods", "bogus"), "--methods: unknown bogus"),        # ran all three adaptive methods
    (("--adaptive", "--methods", "dpsgd,scale"), "--methods: dpsgd has no adaptive variant"),
    (("--adaptive", "--rounds", 3), "--rounds is for PDP-SGD"),                 # read by nothing
    (("--adaptive", "--accountant", "pld"), "--accountant is not read by --adaptive"),
    (("--methods", ""), "--methods must not be empty"),                                 # ran only the non-private runs
    (("--methods", "sample,sample"), "--methods must name each once; repeated: sample"),
    (("--methods", "sample", "--rounds", 3), "--rounds is for PDP-SGD (method pdp)"),
    (("--rounds", 0), "--rounds must be a positive integer")])
def test_demo_options_that_would_be_ignored_or_repeat_a_run_are_refused_before_it_starts(cli, tmp_path, args,
                                                                                       expected):
    message = cli.fails("demo", *args, "--out", tmp_path / "never", "--quiet")
    assert expected in message, message
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("adaptive", [(), ("--adaptive",)])
def test_demo_out_under_a_file_is_refused_before_training(cli, tmp_path, adaptive):
    """It used to train every run, then fail with "[Errno 20] Not a directory", naming no option."""
    (tmp_path / "ok.csv").write_text("x")
    message = cli.fails("demo", *adaptive, "--epochs", 1, "--seeds", 1, "--methods", "sample", "--quiet",
                        "--out", tmp_path / "ok.csv" / "sub")
    assert "--out" in message and "is a file, not a directory" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.csv"]


def test_demo_batch_size_above_the_records_caps_q_at_1_with_a_warning_as_train_does(cli, tmp_path):
    """It used to fail after the non-private runs with "sample_rate must lie in (0, 1], got 69.59"."""
    rc, _, err = cli("demo", "--batch-size", 100000, "--epochs", 1, "--seeds", 1, "--methods", "sample", "--quiet",
                     "--out", tmp_path / "demo")
    assert rc == 0
    assert err.strip() == ("pdpfast demo: warning: --batch-size 100000 exceeds the 1437 training records: the sampling "
                           "rate is capped at q = 1 (every record in every step, expected batch 1437)")


@pytest.mark.parametrize("kwargs,name", [(dict(rounds=0, methods=("pdp",)), "rounds"),    # ZeroDivisionError
                                         (dict(seeds=(0, "a")), r"seeds\[1\]"), (dict(seeds=(-1,)), r"seeds\[0\]"),
                                         (dict(seeds=3), "seeds"), (dict(eval_every=0), "eval_every"),
                                         (dict(eval_every=-5), "eval_every"),          # were replaced silently
                                         (dict(methods=("sample", "sample")), "methods"),
                                         (dict(methods="sample"), "methods")])
def test_run_demo_refuses_bad_settings_before_the_first_run(kwargs, name, monkeypatch):
    import pdpfast.demo

    def trains(*args, **kw):
        raise AssertionError("a training run started")

    monkeypatch.setattr(pdpfast.demo, "train_nonprivate", trains)
    with pytest.raises((TypeError, ValueError), match=name):
        run_demo(**(dict(epochs=1, seeds=(0,), progress=False) | kwargs))
