"""Flower front end: the same global model, draws and per-record accounting as the simulation.

Flower's scheduling does not get in the way of bit-equality: clients are identified by the
``client_id`` they report, client sampling is a pure function of (seed, round), local training is
seeded per (seed, round, client), and the strategy aggregates in client-id order whatever the
order the results arrive in. So the tests compare final weights bit for bit.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

flwr = pytest.importorskip("flwr", reason="Flower (flwr) is not installed: pip install flwr")

import pdpfast.fl as fl  # noqa: E402
from pdpfast.fl.flower import PoissonFedAvg, launch_local, run_inprocess  # noqa: E402

FEDERATION = dict(dataset="breast_cancer", clients=4, split="label", budgets="BoundedMixGauss")


def _same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_flower_inprocess_equals_simulation_bitwise():
    config = fl.FLConfig(rounds=5, local_steps=3, client_rate=0.5, seed=4)
    flower = run_inprocess(config=config, **FEDERATION)
    sim = fl.simulate(**FEDERATION, **{k: v for k, v in config.to_dict().items()})
    assert _same(flower.weights, sim.weights)
    np.testing.assert_array_equal(flower.accuracy, sim.accuracy)
    np.testing.assert_array_equal(flower.sampled, sim.sampled)
    np.testing.assert_array_equal(flower.contributed, sim.contributed)
    np.testing.assert_array_equal(flower.epsilon_clients, sim.epsilon_clients)
    np.testing.assert_array_equal(flower.epsilon_server, sim.epsilon_server)
    assert flower.within_budget()


def test_strategy_samples_clients_by_poisson_not_fixed_fraction():
    """λ = 0.25 with 4 clients: rounds with 0, 1, 2, ... clients all occur; an empty round keeps
    the global model (Flower cancels the round: configure_fit returned nothing)."""
    config = fl.FLConfig(rounds=12, local_steps=2, client_rate=0.25, seed=0)
    res = run_inprocess(config=config, **FEDERATION)
    want = np.stack([fl.sampled_clients(0, t, 4, 0.25) for t in range(1, 13)])
    np.testing.assert_array_equal(res.sampled, want)
    counts = res.sampled.sum(1)
    assert (counts == 0).any() and len(set(counts.tolist())) >= 3
    for t in np.flatnonzero(counts == 0):
        assert res.accuracy[t + 1] == res.accuracy[t]


def test_strategy_rejects_unknown_client_ids():
    class Proxy:
        cid = "x"

        def get_properties(self, ins, timeout, group_id):
            return type("R", (), {"properties": {"client_id": 7}})()

    class Manager:
        def wait_for(self, n, timeout):
            return True

        def all(self):
            return {"x": Proxy()}

        def num_available(self):
            return 1

    strategy = PoissonFedAvg(num_clients=1, config=fl.FLConfig(), initial=[np.zeros(1, np.float32)])
    with pytest.raises(ValueError, match="client_id=7"):
        strategy.configure_fit(1, None, Manager())


def test_flower_server_and_client_processes_on_loopback_match_simulation(tmp_path):
    """One server and 3 client processes over gRPC on 127.0.0.1 (a free port), 3 rounds, bounded
    by a timeout: the final global model, the accuracy curve, the client draws and every record's
    ε (reported by the client processes) equal the in-process simulation's."""
    config = fl.FLConfig(rounds=3, local_steps=3, client_rate=0.7, seed=1)
    federation = FEDERATION | {"clients": 3}
    out = launch_local(config=config, timeout=240, workdir=tmp_path, **federation)
    sim = fl.simulate(**federation, **{k: v for k, v in config.to_dict().items()})
    server = out["server"]
    assert _same(server["weights"], sim.weights)
    np.testing.assert_array_equal(np.array(server["sampled"]), sim.sampled)
    np.testing.assert_allclose(server["accuracy"], sim.accuracy, rtol=0, atol=0)
    for report in out["clients"]:
        idx = sim.client_index == report["client_id"]
        np.testing.assert_array_equal(report["epsilon_clients"], sim.epsilon_clients[idx])
        np.testing.assert_array_equal(report["epsilon_server"], sim.epsilon_server[idx])
        assert np.all(np.array(report["epsilon_server"]) <= np.array(report["budgets"]))
        assert np.all(np.array(report["epsilon_clients"]) <= np.array(report["budgets"]))
    assert os.path.exists(tmp_path / "server.log")


def test_flower_ray_simulation_engine_equals_simulation_bitwise(tmp_path):
    """Flower's own simulation engine (Ray backend, stateless ClientApps whose ledgers live in
    files): the same global model and per-record ε as the in-process simulation."""
    pytest.importorskip("ray", reason='Flower\'s simulation engine needs Ray: pip install "flwr[simulation]"')
    from pdpfast.fl.flower import run_ray_simulation

    config = fl.FLConfig(rounds=3, local_steps=3, client_rate=0.7, seed=1)
    federation = FEDERATION | {"clients": 3}
    ray_res = run_ray_simulation(config=config, ledger_dir=tmp_path, **federation)
    sim = fl.simulate(**federation, **{k: v for k, v in config.to_dict().items()})
    assert _same(ray_res.weights, sim.weights)
    np.testing.assert_array_equal(ray_res.sampled, sim.sampled)
    np.testing.assert_array_equal(ray_res.epsilon_clients, sim.epsilon_clients)
    np.testing.assert_array_equal(ray_res.epsilon_server, sim.epsilon_server)
