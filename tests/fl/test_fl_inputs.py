"""Bad input gives a clear ValueError naming the argument."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import pdpfast.fl as fl
from pdpfast.fl.cli import main

SMALL = dict(dataset="breast_cancer", clients=3, rounds=1, local_steps=1)


@pytest.mark.parametrize("client_rate", [0.0, -0.2, 1.5, float("nan")])
def test_client_rate_outside_unit_interval(client_rate):
    with pytest.raises(ValueError, match=r"client_rate must lie in \(0, 1\]"):
        fl.FLConfig(client_rate=client_rate)
    with pytest.raises(ValueError, match="client_rate"):
        fl.simulate(client_rate=client_rate, **SMALL)


@pytest.mark.parametrize("client_rate", ["half", "0.5", True])
def test_client_rate_that_is_not_a_number(client_rate):
    with pytest.raises(TypeError, match="client_rate must be a number"):
        fl.FLConfig(client_rate=client_rate)
    with pytest.raises(TypeError, match="client_rate"):
        fl.simulate(client_rate=client_rate, **SMALL)


def test_budgets_of_wrong_length():
    data = fl.load_federated("breast_cancer", 3, "iid")
    n = data.y_train.shape[0]
    with pytest.raises(ValueError, match=rf"budgets must have one value per training record \({n}\)"):
        fl.simulate(budgets=np.ones(n - 1), **SMALL)
    per_client = [np.ones(data.records_of(k).shape[0]) for k in range(3)]
    per_client[2] = per_client[2][:-3]
    with pytest.raises(ValueError, match=r"budgets\[2\] has .* client 2 holds"):
        fl.simulate(budgets=per_client, **SMALL)
    with pytest.raises(ValueError, match="budgets has 2 per-client arrays but there are 3 clients"):
        fl.simulate(budgets=per_client[:2], **SMALL)
    x, y = data.client_data(0)
    with pytest.raises(ValueError, match=r"budgets of client 0 must have one value per record"):
        fl.Silo(0, x, y, np.ones(len(y) + 1), config=fl.FLConfig(), model_fn=fl.model_factory("breast_cancer"))


@pytest.mark.parametrize("bad", [0.0, -1.0, np.nan, np.inf])
def test_budgets_not_positive_finite(bad):
    n = fl.load_federated("breast_cancer", 3, "iid").y_train.shape[0]
    budgets = np.ones(n)
    budgets[5] = bad
    with pytest.raises(ValueError, match="budgets must be finite and > 0"):
        fl.simulate(budgets=budgets, **SMALL)


def test_client_with_no_data():
    empty_x, empty_y = torch.zeros(0, 30), torch.zeros(0, dtype=torch.int64)
    with pytest.raises(ValueError, match="client 3 has no data"):
        fl.Silo(3, empty_x, empty_y, np.zeros(0), config=fl.FLConfig(), model_fn=fl.model_factory("breast_cancer"))
    with pytest.raises(ValueError, match="no data"):
        fl.partition(np.array([0, 1, 0, 1]), 5, "iid")
    with pytest.raises(ValueError, match=r"split='dirichlet' leaves client\(s\) .* with no data"):
        fl.partition(np.repeat([0, 1], 6), 10, "dirichlet", dirichlet_alpha=0.01)


def test_unknown_budget_distribution():
    with pytest.raises(ValueError, match="budgets must be one of 'ThreeLevels', 'BoundedPareto', 'BoundedMixGauss'"):
        fl.simulate(budgets="Uniform", **SMALL)
    with pytest.raises(ValueError, match="budgets must be one of"):
        fl.sample_budgets("threelevels", 10)


@pytest.mark.parametrize("kwargs, name", [
    ({"method": "fedprox"}, "method"), ({"split": "shards"}, "split"), ({"dataset": "mnist"}, "dataset"),
    ({"rounds": 0}, "rounds"), ({"local_steps": 2.5}, "local_steps"), ({"noise_multiplier": 0}, "noise_multiplier"),
    ({"delta": 1.0}, "delta"), ({"threat": "everyone"}, "threat"), ({"clients": 0}, "clients"),
])
def test_other_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        fl.simulate(**(SMALL | kwargs))


def test_unreachable_budget_is_reported():
    with pytest.raises(ValueError, match="below the smallest reachable epsilon"):
        fl.simulate(budgets="ThreeLevels", noise_multiplier=0.5, **SMALL)


def test_cli_reports_errors_with_exit_code_2(capsys):
    assert main(["simulate", "--client-rate", "0", "--rounds", "1", "--quiet", "--no-plot"]) == 2
    assert "--client-rate must lie in (0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize("alpha", [0.0, -1.0, float("nan"), float("inf")])
@pytest.mark.parametrize("split", ["iid", "dirichlet"])
def test_a_dirichlet_alpha_out_of_range_is_refused_whatever_the_split(split, alpha):
    """α used to be read only by the dirichlet split: with another split a bad one passed unnoticed."""
    with pytest.raises(ValueError, match="dirichlet_alpha must be a finite number > 0"):
        fl.partition(np.repeat([0, 1], 6), 2, split, dirichlet_alpha=alpha)


LEDGER = dict(noise_multiplier=1.0, local_steps=2, client_rate=1.0, delta=1e-5)


@pytest.mark.parametrize("name,value,error", [
    ("delta", 1.5, ValueError), ("delta", 10.0, ValueError), ("delta", 0.0, ValueError),
    ("delta", float("inf"), ValueError),
    ("delta", True, TypeError), ("delta", "1e-5", TypeError),
    ("local_steps", 0, ValueError), ("local_steps", -1, ValueError), ("local_steps", 2.7, ValueError),
    ("local_steps", "2", ValueError),
    ("client_rate", float("nan"), ValueError), ("client_rate", 0.0, ValueError), ("client_rate", 1.5, ValueError),
    ("client_rate", "0.5", TypeError),
    ("noise_multiplier", -1.0, ValueError), ("noise_multiplier", float("nan"), ValueError)])
def test_the_federated_ledger_refuses_settings_that_would_under_charge(name, value, error):
    """δ = 1.5 gave negative ε (a budget-1 record trained 16 rounds worth ε ≈ 23 at δ = 1e-5), τ = 0
    charged nothing, λ = NaN made ε NaN and the record was never dropped."""
    from pdpfast.fl.ledger import FederatedLedger, round_rdp

    with pytest.raises(error, match=name):
        FederatedLedger([0.5], [1.0], **(LEDGER | {name: value}))
    if name != "delta":
        with pytest.raises(error, match=name):
            round_rdp([0.5], **{k: v for k, v in (LEDGER | {name: value}).items() if k != "delta"})


@pytest.mark.parametrize("rates", [[1.5], [-0.1], [float("nan")]])
def test_round_rdp_refuses_rates_outside_the_unit_interval(rates):
    from pdpfast.fl.ledger import round_rdp

    with pytest.raises(ValueError, match=r"sample_rates must lie in \[0, 1\]"):
        round_rdp(rates, noise_multiplier=1.0, local_steps=1, client_rate=0.5)


def test_a_refused_round_leaves_the_ledger_as_it_was_and_an_endless_advance_is_refused():
    from pdpfast.fl.ledger import FederatedLedger

    ledger = FederatedLedger([0.5], [100.0], **LEDGER)
    before = {k: np.copy(v) for k, v in ledger.state_dict().items()}
    for bad in (1.5, float("inf"), True):
        with pytest.raises((TypeError, ValueError), match="server_round"):
            ledger.begin_round(bad, sampled=True)
    with pytest.raises(ValueError, match="server_round"):
        ledger.advance_to(float("inf"))
    after = ledger.state_dict()
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_a_refused_replayed_round_is_not_counted_as_a_round_the_client_was_sampled_in(federation):
    """``Silo.fit`` counted the round in ``rounds_sampled`` before its ledger refused it as already seen."""
    data, budgets = federation
    silo = fl.build_silo(data, budgets, fl.FLConfig(rounds=4, local_steps=1, noise_multiplier=2.0), 0)
    weights = fl.get_weights(fl.model_factory("breast_cancer")())
    silo.fit(weights, 2)
    for _ in range(3):
        with pytest.raises(ValueError, match="server_round 2 was already seen"):
            silo.fit(weights, 2)
    assert silo.rounds_sampled == silo.rounds_contributed == silo.stats()["rounds_sampled"] == 1


def test_cli_simulate_passes_the_noise_seed_given_and_none_without(monkeypatch):
    assert _first_simulate_call(monkeypatch, ["--methods", "rpdp", "--noise-seed", "3"])["noise_seed"] == 3
    assert _first_simulate_call(monkeypatch, ["--methods", "rpdp"])["noise_seed"] is None


@pytest.mark.parametrize("noise_seed, error", [(-1, ValueError), (1.5, ValueError), ("3", ValueError),
                                               (2 ** 63, ValueError)])
def test_a_noise_seed_that_is_not_an_int_of_at_least_zero_is_refused(noise_seed, error):
    with pytest.raises(error, match="noise_seed must be an int"):
        fl.simulate(noise_seed=noise_seed, **SMALL)


def test_a_scf_fit_that_does_not_converge_does_not_warn_since_every_rate_is_reaccounted_exactly():
    """The fit only seeds the exact search of each rate; its warning fired in 124 of 270 plausible settings."""
    import warnings

    from pdpfast.accounting import rpdp
    from pdpfast.fl.client import calibrate_rates

    setting = dict(noise_multiplier=1.0, delta=1.234e-4, local_steps=3, rounds=5, client_rate=0.5)
    with pytest.warns(UserWarning, match="SCF fit did not converge"):
        rpdp.fit_scf(**setting)
    config = fl.FLConfig(**setting)
    budgets = np.array([2.0, 5.0, 20.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rates = calibrate_rates(budgets, config)
        direct = rpdp.sample_rates(budgets, **setting)  # fits its own estimator
    np.testing.assert_array_equal(direct, rates)
    eps = rpdp.epsilon(rates, threat=config.threat, **config.accounting_kwargs())
    assert np.all(eps <= budgets) and np.all((eps >= 0.99 * budgets) | (rates == 1))


@pytest.mark.parametrize("key,value", [("rounds_charged", np.array([0.9])), ("rounds_seen", np.float64(2.5)),
                                       ("participations", np.array([np.nan]))])
def test_a_ledger_state_with_fractional_counts_is_refused_not_truncated(key, value):
    from pdpfast.fl.ledger import FederatedLedger

    ledger = FederatedLedger([0.5], [100.0], **LEDGER)
    ledger.advance_to(3)
    state = ledger.state_dict() | {key: value}
    with pytest.raises(ValueError, match=f"{key} must hold whole counts"):
        ledger.load_state_dict(state)
    with pytest.raises(ValueError, match="lacks rounds_seen"):
        ledger.load_state_dict({k: v for k, v in ledger.state_dict().items() if k != "rounds_seen"})


@pytest.mark.parametrize("change", [dict(rounds_seen=np.int64(50)), dict(active=np.array([True, True]))],
                         ids=["active-not-charged-every-round", "rate-0-active"])
def test_a_ledger_state_that_cannot_be_a_history_is_refused(change):
    """Before: a state with rounds_seen 50 and rounds_charged 0 for an active record was accepted (its ε
    read 0 after 50 rounds), as was an active record of rate 0."""
    from pdpfast.fl.ledger import FederatedLedger

    ledger = FederatedLedger([0.5, 0.0], [100.0, 1.0], **LEDGER)
    ledger.advance_to(3)
    with pytest.raises(ValueError, match="cannot be a history"):
        ledger.load_state_dict(ledger.state_dict() | change)
    assert ledger.rounds_seen == 3


def test_a_ledger_state_saved_under_the_other_threat_model_is_refused():
    from pdpfast.fl.ledger import FederatedLedger

    saved = FederatedLedger([0.5], [100.0], **LEDGER, threat="server").state_dict()
    with pytest.raises(ValueError, match="saved for other threat"):
        FederatedLedger([0.5], [100.0], **LEDGER).load_state_dict(saved)


def test_silos_built_for_another_client_rate_are_refused_by_the_run():
    """Silos built for λ = 0.2 and run at λ = 1 were sampled every round while their ledgers charged
    rounds at λ = 0.2: ε was reported 0.72 against 1.31 spent."""
    from pdpfast.fl.simulation import run_federated

    data = fl.load_federated("breast_cancer", 2, "iid", seed=0)
    budgets = np.full(data.y_train.shape[0], 1.0)
    silos = [fl.build_silo(data, budgets, fl.FLConfig(rounds=2, local_steps=1, client_rate=0.2), k) for k in range(2)]
    with pytest.raises(ValueError, match=r"client_rate λ = 0.2, but this run samples clients at λ = 1"):
        run_federated(silos, fl.model_factory("breast_cancer"), data.x_test, data.y_test,
                      fl.FLConfig(rounds=2, local_steps=1, client_rate=1.0))


def test_per_client_budgets_and_federation_budgets_are_checked_like_flat_ones():
    from pdpfast.fl.methods import target_budgets
    from pdpfast.fl.simulation import resolve_budgets

    data = fl.load_federated("breast_cancer", 2, "iid", seed=0)
    flags = [np.ones(data.records_of(k).shape[0], dtype=bool) for k in range(2)]
    with pytest.raises(TypeError, match=r"budgets\[0\]"):
        resolve_budgets(flags, data)
    for federation in ([1.0, float("nan")], [1.0, -1.0], [[1.0]], [True, True]):
        with pytest.raises((TypeError, ValueError), match="federation"):
            target_budgets("minimum", [1.0], federation)


def test_config_numbers_are_python_numbers_so_results_serialize():
    config = fl.FLConfig(rounds=np.int64(2), delta=np.float64(1e-5), client_rate=np.float32(0.5), seed=np.int64(1))
    assert type(config.rounds) is int and type(config.delta) is float and type(config.seed) is int
    import json

    json.dumps(config.to_dict())
    from pdpfast.fl.flower import config_to_argv

    assert "np." not in " ".join(config_to_argv(config))


@pytest.mark.parametrize("args", [(0, 1, 3, float("nan")), (0, 1, 3, 0.0), (0, 1, 3, "0.5"), (-1, 1, 3, 0.5),
                                  (0, 0, 3, 0.5), (0, 1.5, 3, 0.5), (0, 1, 0, 0.5)])
def test_sampled_clients_refuses_what_would_sample_nobody_or_everybody(args):
    from pdpfast.fl.config import sampled_clients

    with pytest.raises((TypeError, ValueError)):
        sampled_clients(*args)


# ---------------------------------------------------------------------------------------------- probe fixes
@pytest.mark.parametrize("split", ["iid", "label", "dirichlet"])
@pytest.mark.parametrize("labels, error, message", [
    (np.zeros((12, 2), dtype=np.int64), ValueError,
     r"labels must be 1-D \(one class label per record\), got shape \(12, 2\)"),
    (np.zeros((12, 1), dtype=np.int64), ValueError, r"labels must be 1-D .* got shape \(12, 1\)"),
    (np.int64(3), ValueError, r"labels must be 1-D .* got shape \(\)"),
    (np.repeat([0.0, 1.5], 6), TypeError, "labels must be integer class labels, got dtype float64"),
    (np.repeat([True, False], 6), TypeError, "labels must be integer class labels, got dtype bool"),
    (["a", "b"] * 6, TypeError, "labels must be integer class labels"),
    ([[0, 1], [1]] * 6, TypeError, "labels must be a 1-D array of integer class labels"),
])
def test_partition_refuses_labels_that_are_not_one_integer_per_record(split, labels, error, message):
    """2-D labels failed deep inside numpy (np.lexsort, np.split) or, with split iid, passed unread."""
    with pytest.raises(error, match=message):
        fl.partition(labels, 2, split)


def test_partition_takes_integer_labels_as_a_list_or_a_tensor():
    labels = np.repeat([0, 1, 2], 4)
    want = fl.partition(labels, 2, "label", seed=3)
    np.testing.assert_array_equal(fl.partition(labels.tolist(), 2, "label", seed=3), want)
    np.testing.assert_array_equal(fl.partition(torch.from_numpy(labels), 2, "label", seed=3), want)
    np.testing.assert_array_equal(fl.partition(labels.astype(np.uint8), 2, "label", seed=3), want)


@pytest.fixture(scope="module")
def federation():
    data = fl.load_federated("breast_cancer", 3, "iid", seed=0)
    return data, np.ones(data.y_train.shape[0])


def test_build_silo_refuses_budgets_that_are_not_one_per_training_record(federation):
    """build_silo indexes the whole training set's budgets with the client's record indices: budgets of the
    client's own length failed with an IndexError (or silently took the wrong records when long enough)."""
    data, budgets = federation
    n, own = budgets.shape[0], data.records_of(1).shape[0]
    config = fl.FLConfig(rounds=1, local_steps=1, method="nonprivate")
    for bad in (budgets[:own], budgets[:-1], np.ones(n + 1), np.ones((n, 1))):
        with pytest.raises(ValueError, match=rf"budgets must have one value per training record of the federation "
                                             rf"\({n}\), got shape \({bad.shape[0]},"):
            fl.build_silo(data, bad, config, 1)
    with pytest.raises(ValueError, match="budgets must be finite and > 0"):
        fl.build_silo(data, np.where(np.arange(n) == 4, np.nan, budgets), config, 1)
    with pytest.raises(TypeError, match="budgets must be numbers"):
        fl.build_silo(data, ["1.0"] * n, config, 1)
    silo = fl.build_silo(data, torch.ones(n, dtype=torch.float64), config, 1)   # a tensor is an array too
    assert silo.num_records == own


@pytest.mark.parametrize("client_id, message", [(3, r"client_id must lie in \[0, 3\), got 3"),
                                                (-1, "client_id must be an int ≥ 0, got -1"),
                                                (1.0, "client_id must be an int ≥ 0, got 1.0"),
                                                (True, "client_id must be an int ≥ 0, got True")])
def test_build_silo_refuses_a_client_id_that_is_not_a_client(federation, client_id, message):
    data, budgets = federation
    with pytest.raises(ValueError, match=message):
        fl.build_silo(data, budgets, fl.FLConfig(rounds=1, local_steps=1, method="nonprivate"), client_id)


FIT_SETTINGS = fl.FLConfig(rounds=2, local_steps=1, noise_multiplier=1.0)


@pytest.mark.parametrize("config, error, message", [
    ({}, ValueError, r"config lacks 'server_round' .*its keys are \[\]"),
    ({"num_rounds": 3}, ValueError, r"config lacks 'server_round' .*its keys are \['num_rounds'\]"),
    (None, TypeError, "config must be a dict"),
    ({"server_round": 0}, ValueError, r"config\['server_round'\] must be an int ≥ 1, got 0"),
    ({"server_round": "1"}, ValueError, r"config\['server_round'\] must be an int ≥ 1, got '1'"),
    ({"server_round": 1}, ValueError, r"config carries none of the run's settings .*its keys are \['server_round'\]"),
    ({"server_round": 1, "rounds": 2}, ValueError,
     r"the server's settings differ from this client's \(local_steps: missing vs 1;"),
    ({"server_round": 1} | FIT_SETTINGS.to_dict(), ValueError, "config lacks 'last_update_round'"),
    ({"server_round": 1, "last_update_round": -1} | FIT_SETTINGS.to_dict(), ValueError,
     r"config\['last_update_round'\] must be an int ≥ 0, got -1"),
])
def test_flower_client_fit_names_a_missing_or_bad_server_round(federation, config, error, message):
    """``PDPClient.fit`` without "server_round" failed with a bare KeyError; the refusal comes before the
    silo or its ledger changes."""
    pytest.importorskip("flwr", reason="Flower (flwr) is not installed")
    from pdpfast.fl.flower import PDPClient

    data, budgets = federation
    silo = fl.build_silo(data, budgets, FIT_SETTINGS, 0)
    client = PDPClient(silo)
    before = {k: np.copy(v) for k, v in silo.ledger.state_dict().items()}
    weights = fl.get_weights(fl.model_factory("breast_cancer")())
    with pytest.raises(error, match=message):
        client.fit(weights, config)
    assert client.last_round == 0 and silo.rounds_sampled == 0
    assert all(np.array_equal(before[k], v) for k, v in silo.ledger.state_dict().items())
    delta, n, metrics = client.fit(weights, {"server_round": 1, "last_update_round": 0} | FIT_SETTINGS.to_dict())
    assert n == silo.num_records and metrics == {"client_id": 0, "contributed": 1}


THREADS_RUN = dict(dataset="breast_cancer", clients=2, rounds=2, local_steps=2, client_rate=1.0, seed=1, noise_seed=1,
                   sampling_seed=1)


@pytest.mark.parametrize("method", ["rpdp", "nonprivate"])
def test_simulate_result_does_not_depend_on_the_thread_count(method):
    one = fl.simulate(method=method, threads=1, **THREADS_RUN)
    two = fl.simulate(method=method, threads=2, **THREADS_RUN)
    for a, b in zip(one.weights, two.weights):   # full-batch GEMMs may round differently across threads
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(one.loss, two.loss, rtol=1e-5)
    np.testing.assert_array_equal(one.sampled, two.sampled)
    np.testing.assert_array_equal(one.sample_rates, two.sample_rates)
    np.testing.assert_array_equal(one.epsilon_clients, two.epsilon_clients)
    np.testing.assert_array_equal(one.epsilon_server, two.epsilon_server)


@pytest.mark.parametrize("threads, error", [(-1, ValueError), (1.5, ValueError), (True, ValueError),
                                            ("2", ValueError)])
def test_simulate_refuses_a_thread_count_that_is_not_an_int_of_at_least_zero(threads, error):
    with pytest.raises(error, match=rf"threads must be an int ≥ 0, got {threads!r}"):
        fl.simulate(threads=threads, **THREADS_RUN)


@pytest.mark.parametrize("entry", ["fl", "pdpfast"])
def test_cli_simulate_threads_sets_torch_threads_for_the_run_and_restores_them(entry, monkeypatch, capsys):
    import pdpfast.cli
    import pdpfast.fl.simulation as simulation

    original = torch.get_num_threads()
    outside = 3 if original != 3 else 2
    seen = []
    run_federated = simulation.run_federated

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return run_federated(*args, **kwargs)

    monkeypatch.setattr(simulation, "run_federated", spy)
    argv = ["simulate", "--dataset", "breast_cancer", "--clients", "2", "--rounds", "1", "--local-steps", "1",
            "--methods", "nonprivate", "--quiet", "--no-plot"]
    torch.set_num_threads(outside)
    try:
        rc = main([*argv, "--threads", "1"]) if entry == "fl" else pdpfast.cli.main(["fl", *argv, "--threads", "1"])
        assert (rc, seen, torch.get_num_threads()) == (0, [1], outside)
        seen.clear()   # without --threads, or with 0: torch's own setting
        assert main(argv) == 0 and main([*argv, "--threads", "0"]) == 0
        assert seen == [outside, outside] and torch.get_num_threads() == outside
    finally:
        torch.set_num_threads(original)


@pytest.mark.parametrize("entry, prefix", [("fl", "pdpfast fl simulate: error: "), ("pdpfast", "pdpfast fl: error: ")])
def test_cli_simulate_refuses_a_negative_thread_count_by_option(entry, prefix, capsys):
    import pdpfast.cli

    argv = ["simulate", "--threads", "-1", "--quiet", "--no-plot"]
    assert (main(argv) if entry == "fl" else pdpfast.cli.main(["fl", *argv])) == 2
    assert capsys.readouterr().err.strip() == prefix + "--threads must be an int ≥ 0, got -1"


class _Stop(Exception):
    """Raised by a stand-in for simulate, after recording what it was given."""


@pytest.mark.parametrize("option, value", [("--budgets", "BoundedPareto"), ("--noise-multiplier", "2"),
                                           ("--max-grad-norm", "0.5"), ("--delta", "1e-5"), ("--threat", "server"),
                                           ("--conversion", "improved"), ("--mode", "ghost"),
                                           ("--clipping", "per_layer"), ("--noise-seed", "3")])
def test_cli_nonprivate_alone_refuses_a_privacy_option_it_would_ignore(option, value, monkeypatch, capsys):
    """``fl simulate --methods nonprivate --noise-multiplier 2`` ran the baseline with σ unread; with a private
    method beside it the option is that method's, and passed on."""
    assert main(["simulate", "--methods", "nonprivate", option, value, "--quiet", "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert f"error: {option} is for the private methods (rpdp, minimum, dropout); --methods nonprivate" in err

    given = _first_simulate_call(monkeypatch, ["--methods", "minimum", "nonprivate", option, value])
    name = option[2:].replace("-", "_")
    assert str(given[name]) == str(type(given[name])(value))


def _first_simulate_call(monkeypatch, argv) -> dict:
    """The keyword arguments ``fl simulate`` passes to ``simulate`` for its first method (not run)."""
    import pdpfast.fl.simulation as simulation

    given = []

    def stand_in(**kwargs):
        given.append(kwargs)
        raise _Stop

    monkeypatch.setattr(simulation, "simulate", stand_in)
    with pytest.raises(_Stop):
        main(["simulate", *argv, "--quiet", "--no-plot"])
    return given[0]


def test_cli_nonprivate_alone_runs_with_the_default_privacy_settings(monkeypatch):
    given = _first_simulate_call(monkeypatch, ["--methods", "nonprivate"])
    defaults = fl.FLConfig(method="nonprivate").to_dict() | {"budgets": "ThreeLevels"}
    assert {k: given[k] for k in defaults} == defaults


@pytest.mark.parametrize("argv,first", [(["non-private,minimum"], "nonprivate"), (["Minimum,", "rpdp"], "minimum")])
def test_simulate_methods_are_read_as_words_or_comma_separated_in_either_spelling(monkeypatch, argv, first):
    """Before: only words, and only "nonprivate" (``pdpfast demo`` and ``audit`` say "non-private")."""
    assert _first_simulate_call(monkeypatch, ["--methods", *argv])["method"] == first


@pytest.mark.parametrize("argv,message", [(["rpdp,bogus"], "--methods: unknown bogus"),
                                          (["rpdp", "RPDP"], "--methods lists rpdp more than once")])
def test_simulate_refuses_unknown_or_repeated_methods_by_option(capsys, argv, message):
    assert main(["simulate", "--methods", *argv, "--quiet", "--no-plot"]) == 2
    assert message in capsys.readouterr().err
