"""Privacy properties of rPDP-FL: no record ever exceeds its budget under the run's threat model."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import pdpfast.fl as fl
from pdpfast.accounting import rpdp
from pdpfast.fl.simulation import run_federated

FAST = dict(dataset="breast_cancer", clients=4, rounds=6, local_steps=4, client_rate=0.5)


@pytest.mark.parametrize("threat", ["clients", "server"])
@pytest.mark.parametrize("budgets", ["ThreeLevels", "BoundedPareto", "BoundedMixGauss"])
@pytest.mark.parametrize("method", ["rpdp", "minimum", "dropout"])
def test_every_record_epsilon_within_budget_under_the_runs_threat_model(budgets, method, threat):
    res = fl.simulate(budgets=budgets, method=method, threat=threat, seed=3, **FAST)
    spent = res.epsilon_server if threat == "server" else res.epsilon_clients
    np.testing.assert_array_equal(res.epsilon, spent)
    assert np.all(spent <= res.budgets)
    trained = np.isfinite(res.targets)
    assert np.all(spent[trained] <= res.targets[trained])
    assert res.within_budget()
    if method == "dropout":   # left-out records are never drawn and spend nothing
        assert np.all(res.sample_rates[~trained] == 0) and np.all(res.epsilon_clients[~trained] == 0)


def test_under_threat_clients_no_record_leaves_for_how_often_its_client_was_sampled():
    """The "clients" analysis treats the client sampling as secret, so whether a record is dropped may
    not depend on it: before, the "server" count dropped the records of a client sampled 19 or 20 times
    in 30 rounds (λ = 0.5), whose rates were calibrated, under "clients", for all 30."""
    res = fl.simulate("breast_cancer", clients=3, rounds=30, local_steps=3, client_rate=0.5, seed=1, noise_seed=0,
                      sampling_seed=4)
    assert res.sampled.sum(0).max() > 15        # a client sampled more often than λ·T
    assert [c["records_active_at_end"] for c in res.clients] == [c["records_trained"] for c in res.clients]
    assert np.all(res.epsilon_clients <= res.budgets) and res.within_budget()


def test_under_threat_server_a_client_sampled_at_most_lambda_t_times_keeps_its_records():
    """Rates are calibrated for λ·T·ρ^τ under "server"; before, the "clients" bound T·ρ^{τ,λ}, which is
    larger, was enforced too, and every record left before round T whatever its client's sampling."""
    res = fl.simulate("breast_cancer", clients=3, rounds=30, local_steps=3, client_rate=0.5, threat="server", seed=1,
                      noise_seed=0, sampling_seed=4)
    rare = [c for c in res.clients if c["rounds_sampled"] <= 15]
    assert rare, "some client should be sampled at most λ·T = 15 times"
    for c in rare:
        assert c["records_active_at_end"] == c["records_trained"]
    assert np.all(res.epsilon_server <= res.budgets) and res.within_budget()


def test_dropout_with_equal_budgets_trains_every_record():
    """Before: the mean of 1437 × 0.7 is 0.7000000000000001, above every budget: no record trained."""
    res = fl.simulate("digits", clients=3, budgets=np.full(1437, 0.7), method="dropout", rounds=2, local_steps=2,
                      noise_seed=0, sampling_seed=0)
    assert res.summary()["records_trained"] == 1437 and np.all(res.targets <= 0.7)


def test_rpdp_spends_each_budget_almost_exactly_over_the_planned_rounds():
    """SCF + exact re-accounting: after T rounds every record's "clients" ε is just below its budget."""
    res = fl.simulate(budgets="BoundedPareto", method="rpdp", seed=1, **FAST)
    partial = res.sample_rates < 1
    ratio = res.epsilon_clients[partial] / res.budgets[partial]
    assert ratio.max() <= 1 and ratio.min() >= 0.99


def _ledger(threat_rates, budgets, conversion="standard", client_rate=0.5, threat="clients"):
    return fl.FederatedLedger(threat_rates, budgets, noise_multiplier=2.0, local_steps=5, client_rate=client_rate,
                              delta=1e-5, conversion=conversion, threat=threat)


@pytest.mark.parametrize("conversion", ["standard", "improved"])
def test_ledger_epsilon_equals_rpdp_epsilon(conversion):
    rng = np.random.default_rng(0)
    q = rng.uniform(0.001, 0.6, 50)
    led = _ledger(q, np.full(50, np.inf), conversion)
    sampled = rng.random(12) < 0.5
    for t, s in enumerate(sampled, start=1):
        led.begin_round(t, bool(s))
        led.end_round(bool(s))
    kw = dict(noise_multiplier=2.0, delta=1e-5, local_steps=5, conversion=conversion)
    want_clients = rpdp.epsilon(q, rounds=12, client_rate=0.5, threat="clients", **kw)
    want_server = rpdp.epsilon(q, rounds=int(sampled.sum()), client_rate=1.0, threat="server", **kw)
    np.testing.assert_allclose(led.epsilons("clients"), want_clients, rtol=1e-12)
    np.testing.assert_allclose(led.epsilons("server"), want_server, rtol=1e-12)


def test_ledger_drops_records_before_they_would_exceed_budget_server_threat():
    """Calibrated for T = 10 rounds under "clients"; a client sampled in every round overshoots the
    server-side bound unless the ledger drops records: it must, and nobody goes over."""
    budgets = np.array([0.5, 1.0, 2.0, 5.0] * 5)
    kw = dict(noise_multiplier=2.0, delta=1e-5, local_steps=5, rounds=10, client_rate=0.5)
    q = rpdp.sample_rates(budgets, threat="clients", **kw)
    led = _ledger(q, budgets, threat="server")
    for t in range(1, 11):
        rates = led.begin_round(t, sampled=True)
        led.end_round(sampled=True)
        assert np.all(led.epsilons("server") <= budgets)
        assert np.all(rates[~led.active] == 0)
    assert not led.active.all(), "a client sampled every round must exhaust some records' server-side budget"


@pytest.mark.parametrize("threat", ["clients", "server"])
def test_ledger_enforces_only_its_threat_models_bound(threat):
    """Under "clients" which records take part never depends on the client's sampling (the same
    records leave whether it was sampled every round or never); under "server" it does."""
    budgets = np.array([0.5, 1.0, 2.0, 5.0] * 5)
    q = rpdp.sample_rates(budgets, threat=threat, noise_multiplier=2.0, delta=1e-5, local_steps=5, rounds=10,
                          client_rate=0.5)
    histories = []
    for sampled in (True, False):
        led, active = _ledger(q, budgets, threat=threat), []
        for t in range(1, 21):   # twice the planned rounds: budgets run out
            led.begin_round(t, sampled=sampled)
            led.end_round(sampled=sampled)
            active.append(led.active.copy())
            assert np.all(led.epsilons(threat) <= budgets)
        histories.append(np.array(active))
    if threat == "clients":
        np.testing.assert_array_equal(histories[0], histories[1])
        assert not histories[0][-1].all()
    else:
        assert not histories[0][-1].all() and histories[1][-1].all()


def test_ledger_unsampled_rounds_charge_clients_threat_only():
    led = _ledger(np.array([0.1, 0.2]), np.array([np.inf, np.inf]))
    led.advance_to(4)
    assert led.rounds_charged.tolist() == [4, 4] and led.participations.tolist() == [0, 0]
    assert np.all(led.epsilons("server") == 0) and np.all(led.epsilons("clients") > 0)
    with pytest.raises(ValueError, match="server_round"):
        led.begin_round(3, sampled=True)


def test_exhausted_client_stops_contributing():
    """Silos planned for T = 2 rounds, run for 5 with λ = 1: from round 3 on every record's budget
    is spent, no client sends an update and the global model no longer changes."""
    data = fl.load_federated("breast_cancer", 3, "iid", seed=0)
    budgets = np.random.default_rng(0).uniform(0.2, 0.5, data.y_train.shape[0])
    planned = fl.FLConfig(rounds=2, local_steps=3, client_rate=1.0)
    silos = [fl.build_silo(data, budgets, planned, k) for k in range(3)]
    assert all(np.all((s.sample_rates > 0) & (s.sample_rates < 1)) for s in silos)
    longer = fl.FLConfig(rounds=5, local_steps=3, client_rate=1.0)
    seen = []
    run = run_federated(silos, fl.model_factory("breast_cancer"), data.x_test, data.y_test, longer,
                        on_round=lambda t, w: seen.append([a.copy() for a in w]))
    assert run["sampled"].all()
    assert run["contributed"][:2].all() and not run["contributed"][2:].any()
    for later in seen[2:]:
        assert all(np.array_equal(a, b) for a, b in zip(seen[1], later))
    for silo in silos:
        assert silo.ledger.exhausted and silo.rounds_contributed == 2 and silo.rounds_sampled == 5
        assert np.all(silo.epsilons("clients") <= silo.budgets) and np.all(silo.epsilons("server") <= silo.budgets)
        assert silo.fit([np.zeros(1)], 6) is None      # still refuses, without touching the model


def test_nonprivate_baseline_reports_no_guarantee():
    res = fl.simulate(method="nonprivate", **FAST)
    assert np.all(np.isposinf(res.epsilon_clients)) and not res.within_budget()


def test_training_does_not_touch_global_torch_rng():
    state = torch.random.get_rng_state()
    fl.simulate(method="rpdp", **(FAST | {"rounds": 2}))
    assert torch.equal(state, torch.random.get_rng_state())


def _ledger_after_three_rounds(q, b):
    led = _ledger(q, b)
    for t, sampled in [(1, True), (2, False), (3, True)]:
        led.begin_round(t, sampled)
        led.end_round(sampled)
    return led


def test_ledger_state_survives_a_restart(tmp_path):
    q, b = np.array([0.05, 0.3, 0.0]), np.array([1.0, 2.0, 1.0])
    led = _ledger_after_three_rounds(q, b)
    led.save(tmp_path / "ledger.npz")
    again = _ledger(q, b)
    again.load(tmp_path / "ledger.npz")
    for threat in ("clients", "server"):
        np.testing.assert_array_equal(again.epsilons(threat), led.epsilons(threat))
    assert again.rounds_seen == 3
    with pytest.raises(ValueError, match="server_round"):
        again.begin_round(3, True)
    with pytest.raises(ValueError, match="saved for other budgets"):
        _ledger(q, b * 2).load(tmp_path / "ledger.npz")


@pytest.mark.parametrize("content", ["truncated", "garbage", "one array"])
def test_a_damaged_ledger_file_is_refused_naming_it(tmp_path, content):
    """A truncated file was zipfile's BadZipFile (a traceback in `pdpfast fl client --ledger`), a foreign one
    numpy's advice to load it with allow_pickle."""
    q, b = np.array([0.05, 0.3]), np.array([1.0, 2.0])
    _ledger_after_three_rounds(q, b).save(tmp_path / "ledger.npz")
    path = tmp_path / "damaged.npz"
    if content == "truncated":
        path.write_bytes((tmp_path / "ledger.npz").read_bytes()[:200])
    elif content == "garbage":
        path.write_bytes(b"hello")
    else:
        with open(path, "wb") as f:
            np.save(f, np.zeros(3))
    led = _ledger(q, b)
    with pytest.raises(ValueError, match="the ledger file .*damaged.npz' cannot be read: it is truncated, or not"):
        led.load(path)
    assert led.rounds_seen == 0


@pytest.mark.parametrize("name, value", [("noise_multiplier", 3.0), ("local_steps", 2), ("client_rate", 0.4),
                                         ("delta", 1e-4), ("conversion", "improved")])
def test_a_ledger_state_saved_under_other_settings_is_refused_by_name(tmp_path, name, value):
    """A client's ledger file loaded under another σ (rates q = 1 alike) re-valued 4 rounds at σ = 0.7 as
    rounds at σ = 3: ε_server reported 11.27 where 49.74 was spent."""
    q, b = np.array([1.0, 1.0]), np.array([300.0, 300.0])
    kw = dict(noise_multiplier=2.0, local_steps=5, client_rate=0.5, delta=1e-5, conversion="standard")
    _ledger_after_three_rounds(q, b).save(tmp_path / "ledger.npz")
    other = fl.FederatedLedger(q, b, **(kw | {name: value}))
    before = other.state_dict()
    with pytest.raises(ValueError, match=rf"ledger state was saved for other {name} \("):
        other.load(tmp_path / "ledger.npz")
    assert other.rounds_seen == 0 and all(np.array_equal(before[k], v) for k, v in other.state_dict().items())


def test_a_ledger_state_without_its_settings_is_refused():
    """A state that does not say what its counts were charged under cannot be checked against this ledger."""
    q, b = np.array([0.3]), np.array([5.0])
    state = _ledger_after_three_rounds(q, b).state_dict()
    del state["noise_multiplier"]
    with pytest.raises(ValueError, match="ledger state lacks noise_multiplier"):
        _ledger(q, b).load_state_dict(state)


def _weights_after(noise_seed):
    res = fl.simulate(method="rpdp", seed=2, noise_seed=noise_seed, **(FAST | {"rounds": 2, "client_rate": 1.0}))
    return res.weights


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def test_the_servers_public_information_does_not_determine_a_clients_noise():
    """The local DP-SGD seed was a function of the public (seed, round, client): a server re-ran a client's
    training on a zero-gradient model and subtracted its noise exactly. Without a noise seed every client
    draws a secret one, so the same public settings train other models; a given noise seed reproduces."""
    assert not _same(_weights_after(None), _weights_after(None))
    assert _same(_weights_after(5), _weights_after(5))
    assert not _same(_weights_after(5), _weights_after(6))


@pytest.mark.parametrize("damage", [
    lambda s: s.update(rounds_charged=s["rounds_charged"] - 5),                # negative: spending forgotten
    lambda s: s.update(participations=s["rounds_charged"] + 1),               # more participations than rounds
    lambda s: s.update(rounds_charged=s["rounds_charged"] + s["rounds_seen"]),  # charged for rounds never seen
    lambda s: s.update(active=s["active"][:2]),                                # not one per record
    lambda s: s.update(rounds_seen=np.int64(-1)),
], ids=["negative charges", "participations past charges", "charges past rounds", "short active", "negative rounds"])
def test_a_ledger_state_that_cannot_be_a_history_is_refused_and_the_ledger_unchanged(damage):
    q, b = np.array([0.05, 0.3, 0.2]), np.array([1.0, 2.0, 1.0])
    led = _ledger_after_three_rounds(q, b)
    before = led.state_dict()
    state = led.state_dict()
    damage(state)
    with pytest.raises(ValueError, match="ledger state"):
        led.load_state_dict(state)
    for key, value in before.items():
        np.testing.assert_array_equal(led.state_dict()[key], value)
    assert led.rounds_seen == 3 and led.rounds_charged.max() == 3
