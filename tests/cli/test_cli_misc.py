"""The command line's shape: help, usage errors as one line, info, and the `fl` hook."""
import pytest


def test_help_lists_every_command(cli):
    rc, out, _ = cli("--help")
    assert rc == 0
    for command in ("demo", "train", "calibrate", "bench", "info", "fl"):
        assert command in out


def test_no_command_is_a_one_line_usage_error(cli):
    rc, out, err = cli()
    assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith("pdpfast: error:")


def test_info_reports_the_implementations(cli):
    rc, out, _ = cli("info")
    assert rc == 0 and "pdpfast" in out and "torch" in out
    assert "poisson_sample" in out and "group_norm (CPU)" in out and "clip_weights (CPU)" in out
    assert "clip_scale (CPU)" in out
    assert "poisson_sample (loader, CPU)" in out
    # the C++ routes of the host's hot path, or why they fall back to Python
    for route in ("linear_clipped_into", "layer call hooks", "linear layer calls", "noise launch plan"):
        line = next(line for line in out.splitlines() if line.strip().startswith(route))
        assert "C++ (pdpfast._C)" in line or "Python (" in line or "register_prehook (" in line


def test_fl_subcommand_comes_from_pdpfast_fl_when_it_imports(cli):
    pytest.importorskip("pdpfast.fl.cli")
    rc, out, _ = cli("fl", "--help")
    assert rc == 0 and "simulate" in out


def test_fl_subcommand_says_why_when_the_federated_front_end_is_missing(cli, monkeypatch):
    fl_cli = pytest.importorskip("pdpfast.fl.cli")

    def broken(subparsers):
        raise ImportError("No module named 'flwr'")

    monkeypatch.setattr(fl_cli, "add_subparser", broken)
    message = cli.fails("fl", "simulate", "--rounds", 3)
    assert "could not be loaded" in message and "flwr" in message



@pytest.mark.parametrize("args,option", [(("simulate", "--rounds", 0), "--rounds"),
                                         (("simulate", "--client-rate", 2), "--client-rate"),
                                         (("simulate", "--clients", 0), "--clients")])
def test_an_error_the_api_raises_names_the_option_the_user_typed(cli, args, option):
    """``fl simulate --rounds 0`` failed with "rounds must be …", the API's name, not the option's."""
    pytest.importorskip("pdpfast.fl.cli")
    message = cli.fails("fl", *args)
    assert f"error: {option} must" in message, message


def test_the_standalone_fl_command_names_options_too(capsys):
    fl_cli = pytest.importorskip("pdpfast.fl.cli")
    assert fl_cli.main(["simulate", "--rounds", "0"]) == 2
    assert "error: --rounds must be an int ≥ 1" in capsys.readouterr().err


def test_an_audit_with_fewer_than_two_canaries_per_group_is_refused_before_it_starts(cli):
    message = cli.fails("audit", "--canaries", 5, "--quiet")
    assert "--canaries must be at least 6 (2 per privacy group), got 5" in message


@pytest.mark.parametrize("args,option", [(("demo", "--lr", "nan"), "--lr"),
                                         (("demo", "--lr", -1), "--lr"),
                                         (("demo", "--adaptive", "--lr", 0), "--lr"),
                                         (("demo", "--threads", -1), "--threads"),
                                         (("audit", "--seed", -1), "--seed"),
                                         (("audit", "--threads", -1), "--threads"),
                                         (("audit", "--seed", 2 ** 40), "--seed"),
                                         (("audit", "--methods", ""), "--methods"),
                                         (("audit", "--methods", "sample,sample"), "--methods"),
                                         (("fl", "simulate", "--split", "dirichlet", "--dirichlet-alpha", 0),
                                          "--dirichlet-alpha"),
                                         (("fl", "simulate", "--split", "dirichlet", "--dirichlet-alpha", "nan"),
                                          "--dirichlet-alpha")])
def test_settings_that_used_to_train_or_fail_inside_a_library_are_refused_by_option(cli, args, option, tmp_path):
    """``demo --lr nan`` trained on NaN weights, ``fl simulate --dirichlet-alpha 0`` ran an iid split with
    the bad α unread, and ``audit --seed -1`` failed inside scikit-learn."""
    if args[0] == "fl":
        pytest.importorskip("pdpfast.fl.cli")
    message = cli.fails(*args, "--out", tmp_path / "never", "--quiet")
    assert f"error: {option} must" in message, message
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("args,option", [(("fl", "server", "--wait-timeout", -1), "--wait-timeout"),
                                         (("fl", "server", "--wait-timeout", "nan"), "--wait-timeout"),
                                         (("fl", "client", "--client-id", 0, "--max-wait-time", 0), "--max-wait-time"),
                                         (("fl", "launch", "--timeout", 0), "--timeout"),
                                         (("fl", "launch", "--clients", 0), "--clients"),
                                         (("fl", "launch", "--split", "dirichlet", "--dirichlet-alpha", -1),
                                          "--dirichlet-alpha")])
def test_flower_processes_refuse_bad_settings_before_they_open_a_port_or_start_a_process(cli, args, option):
    """A server with ``--wait-timeout -1`` used to start and wait; ``fl launch --clients 0`` started the
    server and reported its error from the server's log."""
    pytest.importorskip("flwr")
    pytest.importorskip("pdpfast.fl.cli")
    message = cli.fails(*args)
    assert f"error: {option} must" in message, message
    assert "Flower processes failed" not in message


@pytest.mark.parametrize("command", ["simulate", "launch", "server", "flower"])
@pytest.mark.parametrize("split", ["iid", "label"])
def test_a_dirichlet_alpha_for_another_split_is_refused_rather_than_unread(cli, command, split):
    """Before: ``fl simulate --split iid --dirichlet-alpha 0.1`` ran the iid split, the α unread."""
    pytest.importorskip("pdpfast.fl.cli")
    if command != "simulate":
        pytest.importorskip("flwr")
    message = cli.fails("fl", command, "--split", split, "--dirichlet-alpha", 0.1)
    assert f"error: --dirichlet-alpha is for --split dirichlet (this is --split {split}" in message, message


def test_python_names_inside_an_error_become_the_options_of_the_command_that_ran():
    from pdpfast._options import as_option_words
    from pdpfast.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["calibrate", "b.npy"])
    assert as_option_words(parser, args, "a hybrid_weight of 2 with sample_rate=0.5 and max_grad_norm") == \
        "a --hybrid-weight of 2 with --sample-rate=0.5 and --max-grad-norm"
    # a path, an unknown name and a name of another command stay as written
    text = "/data/max_grad_norm.csv: unknown_name, dirichlet_alpha"
    assert as_option_words(parser, args, text) == text


def test_a_split_that_leaves_a_client_empty_names_the_option_to_change(cli):
    pytest.importorskip("pdpfast.fl.cli")
    message = cli.fails("fl", "simulate", "--split", "dirichlet", "--dirichlet-alpha", 0.01, "--clients", 40)
    assert "a larger --dirichlet-alpha" in message, message


def test_an_audit_out_under_a_file_is_refused_before_training(cli, tmp_path):
    """It used to train, then fail with "[Errno 20] Not a directory", naming no option."""
    (tmp_path / "ok.csv").write_text("x")
    message = cli.fails("audit", "--methods", "sample", "--epochs", 1, "--canaries", 6, "--quiet",
                        "--out", tmp_path / "ok.csv" / "sub")
    assert "--out" in message and "is a file, not a directory" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.csv"]


@pytest.mark.parametrize("values,expected", [
    (["sample", "scale"], ["sample", "scale"]), (["sample,scale"], ["sample", "scale"]),
    (["sample, scale", "hybrid"], ["sample", "scale", "hybrid"]), (["nonprivate"], ["non-private"]),
    (["Non_Private,DPSGD"], ["non-private", "dpsgd"]), (["bogus"], ["bogus"]), ([""], []), (None, None)])
def test_method_lists_are_read_as_words_or_comma_separated_in_either_spelling(values, expected):
    """Before: demo and audit took only "a,b", fl simulate only "a b"; "nonprivate" and "non-private" each
    worked in one command only."""
    from pdpfast._options import method_words

    assert method_words(values, ("non-private", "dpsgd", "sample", "scale", "hybrid")) == expected


def test_audit_methods_given_as_words_in_the_other_spelling_are_refused_only_when_unknown(cli, tmp_path):
    message = cli.fails("audit", "--methods", "sample", "nonprivate", "bogus", "--quiet", "--out", tmp_path / "a")
    assert "--methods: unknown bogus" in message
    message = cli.fails("audit", "--methods", "sample", "non_private", "sample,", "--quiet", "--out", tmp_path / "a")
    assert "--methods must name each once; repeated: sample" in message
