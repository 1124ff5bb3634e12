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
