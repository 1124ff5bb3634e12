"""Flower front end: the same global model, draws and per-record accounting as the simulation.

Flower's scheduling does not get in the way of bit-equality: clients are identified by the
``client_id`` they report, client sampling is a pure function of (seed, round), local training is
seeded per (noise seed, round, client), and the strategy aggregates in client-id order whatever the
order the results arrive in. So with a noise seed given (the clients' secret, fixed here for the
test) the tests compare final weights bit for bit.
"""
from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest

flwr = pytest.importorskip("flwr", reason="Flower (flwr) is not installed: pip install flwr")

import pdpfast.fl as fl  # noqa: E402
from pdpfast.fl.flower import PoissonFedAvg, launch_local, run_inprocess  # noqa: E402

FEDERATION = dict(dataset="breast_cancer", clients=4, split="label", budgets="BoundedMixGauss")
NOISE_SEED = 17   # the clients' secret, fixed so that two paths can be compared bit for bit
SAMPLING_SEED = 29   # the server's secret, likewise


def _same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_flower_inprocess_equals_simulation_bitwise():
    config = fl.FLConfig(rounds=5, local_steps=3, client_rate=0.5, seed=4)
    flower = run_inprocess(config=config, noise_seed=NOISE_SEED, sampling_seed=SAMPLING_SEED, **FEDERATION)
    sim = fl.simulate(**FEDERATION, **config.to_dict(), noise_seed=NOISE_SEED, sampling_seed=SAMPLING_SEED)
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
    res = run_inprocess(config=config, sampling_seed=5, **FEDERATION)
    want = np.stack([fl.sampled_clients(5, t, 4, 0.25) for t in range(1, 13)])
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
    out = launch_local(config=config, timeout=240, workdir=tmp_path, noise_seed=NOISE_SEED,
                       sampling_seed=SAMPLING_SEED, **federation)
    sim = fl.simulate(**federation, **config.to_dict(), noise_seed=NOISE_SEED, sampling_seed=SAMPLING_SEED)
    server = out["server"]
    assert _same(server["weights"], sim.weights)
    np.testing.assert_array_equal(np.array(server["sampled"]), sim.sampled)
    np.testing.assert_allclose(server["accuracy"], sim.accuracy, rtol=0, atol=0)
    for report in out["clients"]:
        idx = sim.client_index == report["client_id"]
        np.testing.assert_array_equal(report["epsilon_clients"], sim.epsilon_clients[idx])
        np.testing.assert_array_equal(report["epsilon_server"], sim.epsilon_server[idx])
        assert report["threat"] == "clients"
        assert np.all(np.array(report["epsilon_clients"]) <= np.array(report["budgets"]))
    assert os.path.exists(tmp_path / "server.log")
    assert "noise_seed" not in server["config"]


def test_flower_ray_simulation_engine_equals_simulation_bitwise(tmp_path):
    """Flower's own simulation engine (Ray backend, stateless ClientApps whose ledgers live in
    files): the same global model and per-record ε as the in-process simulation."""
    pytest.importorskip("ray", reason='Flower\'s simulation engine needs Ray: pip install "flwr[simulation]"')
    from pdpfast.fl.flower import run_ray_simulation

    config = fl.FLConfig(rounds=3, local_steps=3, client_rate=0.7, seed=1)
    federation = FEDERATION | {"clients": 3}
    ray_res = run_ray_simulation(config=config, ledger_dir=tmp_path, noise_seed=NOISE_SEED,
                                 sampling_seed=SAMPLING_SEED, **federation)
    sim = fl.simulate(**federation, **config.to_dict(), noise_seed=NOISE_SEED, sampling_seed=SAMPLING_SEED)
    assert _same(ray_res.weights, sim.weights)
    np.testing.assert_array_equal(ray_res.sampled, sim.sampled)
    np.testing.assert_array_equal(ray_res.epsilon_clients, sim.epsilon_clients)
    np.testing.assert_array_equal(ray_res.epsilon_server, sim.epsilon_server)


def test_launch_local_gives_the_noise_seed_to_the_clients_only_and_the_sampling_seed_to_the_server_only(
        tmp_path, monkeypatch):
    """The noise seed is the clients' secret, the sampling seed the server's; the budgets only the
    clients read."""
    import subprocess

    started = []

    class Stop(Exception):
        pass

    def popen(argv, **kwargs):
        started.append(argv)
        if len(started) == 3:    # the server and two clients: enough to see every kind of process
            raise Stop
        return None              # never waited for: the third start stops the launch

    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(Stop):
        launch_local(config=fl.FLConfig(rounds=1, local_steps=1), noise_seed=5, sampling_seed=8, workdir=tmp_path,
                     **(FEDERATION | {"clients": 2}))
    server, *clients = started
    assert server[3] == "server" and "--noise-seed" not in server and "--budgets" not in server
    assert server[server.index("--sampling-seed") + 1] == "8"
    for argv in clients:
        assert argv[3] == "client" and argv[argv.index("--noise-seed") + 1] == "5" and "--sampling-seed" not in argv


SMALL = fl.FLConfig(rounds=4, local_steps=2, client_rate=0.5, noise_multiplier=1.5, seed=0)


@pytest.fixture(scope="module")
def small_federation():
    data = fl.load_federated("breast_cancer", 2, "iid", seed=0)
    return data, np.full(data.y_train.shape[0], 3.0)


def _fit_config(config, server_round, last_update_round=0):
    return {"server_round": server_round, "last_update_round": last_update_round} | config.to_dict()


@pytest.mark.parametrize("split", ["iid", "label", "dirichlet"])
def test_launch_local_passes_the_dirichlet_alpha_only_to_a_dirichlet_split(tmp_path, monkeypatch, split):
    """The processes refuse --dirichlet-alpha with another split (it would be unread)."""
    import subprocess

    started = []

    class Stop(Exception):
        pass

    def popen(argv, **kwargs):
        started.append(argv)
        raise Stop

    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(Stop):
        launch_local(config=fl.FLConfig(rounds=1, local_steps=1), workdir=tmp_path / "new" / "run", dirichlet_alpha=3.0,
                     **(FEDERATION | {"clients": 2, "split": split}))
    (server,) = started
    assert (tmp_path / "new" / "run").is_dir()      # the workdir is made
    if split == "dirichlet":
        assert server[server.index("--dirichlet-alpha") + 1] == "3.0"
    else:
        assert "--dirichlet-alpha" not in server


def test_launch_local_refuses_a_workdir_under_a_file(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="workdir .* cannot be made a directory"):
        launch_local(config=fl.FLConfig(rounds=1, local_steps=1), workdir=tmp_path / "file" / "run", **FEDERATION)


def test_the_fit_config_carries_the_public_settings_and_no_noise_or_sampling_seed():
    """What a client checks its own settings against; the noise seed is the clients' secret, the
    sampling seed the server's."""
    config = replace(SMALL, client_rate=1.0)

    class Proxy:
        cid = "x"

        def get_properties(self, ins, timeout, group_id):
            return type("R", (), {"properties": {"client_id": 0, "num_examples": 1} | config.to_dict()})()

    class Manager:
        def wait_for(self, n, timeout):
            return True

        def all(self):
            return {"x": Proxy()}

    strategy = PoissonFedAvg(num_clients=1, config=config, initial=[np.zeros(1, np.float32)])
    parameters = flwr.common.ndarrays_to_parameters([np.zeros(1, np.float32)])
    strategy = PoissonFedAvg(num_clients=1, config=config, initial=[np.zeros(1, np.float32)], sampling_seed=123)
    [(_, ins)] = strategy.configure_fit(1, parameters, Manager())
    assert ins.config == _fit_config(config, 1) and not any("seed" in k and k != "seed" for k in ins.config)
    assert 123 not in ins.config.values()


@pytest.mark.parametrize("name, value", [("client_rate", 0.9), ("rounds", 6), ("noise_multiplier", 2.0),
                                         ("threat", "server"), ("delta", 1e-5), ("method", "minimum")])
def test_a_client_refuses_a_fit_under_other_settings_than_its_own(small_federation, name, value):
    """A server at λ = 0.9 ran to the end with clients built for λ = 0.2: their ledgers amplified by 0.2."""
    from pdpfast.fl.flower import PDPClient

    data, budgets = small_federation
    silo = fl.build_silo(data, budgets, SMALL, 0)
    client = PDPClient(silo)
    server = replace(SMALL, **{name: value})
    weights = fl.get_weights(fl.model_factory("breast_cancer")())
    with pytest.raises(ValueError, match=rf"server's settings differ from this client's \({name}: {value!r} vs"):
        client.fit(weights, _fit_config(server, 1))
    assert silo.rounds_sampled == 0 and silo.ledger.rounds_seen == 0


def test_the_strategy_refuses_a_client_that_reports_other_settings(small_federation):
    """Over gRPC the mismatch stops the server at the first round, before any client trains."""
    from flwr.server import Server, SimpleClientManager

    from pdpfast.fl.flower import PDPClient, _DirectProxy

    data, budgets = small_federation
    manager = SimpleClientManager()
    for k in range(2):
        client_config = replace(SMALL, client_rate=0.2)
        manager.register(_DirectProxy(f"n{k}", PDPClient(fl.build_silo(data, budgets, client_config, k)).to_client()))
    strategy = PoissonFedAvg(num_clients=2, config=SMALL, initial=[np.zeros(1, np.float32)], wait_timeout=5)
    server = Server(client_manager=manager, strategy=strategy)
    with pytest.raises(ValueError, match=r"client 0 runs with other settings than the server \(client_rate: 0.2 vs"):
        server.fit(num_rounds=SMALL.rounds, timeout=None)
    assert strategy.sampled == []


@pytest.mark.parametrize("threat", ["server", "clients"])
def test_a_client_restarted_without_its_ledger_is_refused_under_threat_server_and_warned_under_clients(
        small_federation, threat, tmp_path):
    """A client restarted without --ledger started a fresh ledger: its earlier participations were
    forgotten and the "server" ε reported too low. The server says in which round it last received the
    client's update; a ledger that has not seen that round was lost. Under "clients" every round is
    charged whether sampled or not, so that bound still holds: a warning only."""
    from pdpfast.fl.flower import PDPClient

    data, budgets = small_federation
    config = replace(SMALL, threat=threat)
    weights = fl.get_weights(fl.model_factory("breast_cancer")())
    first = PDPClient(fl.build_silo(data, budgets, config, 0), tmp_path / "silo0.npz")
    first.fit(weights, _fit_config(config, 1))
    restarted = PDPClient(fl.build_silo(data, budgets, config, 0))
    if threat == "server":
        with pytest.raises(ValueError, match="server received this client's update in round 1, but its ledger has "
                                             "seen rounds only up to 0"):
            restarted.fit(weights, _fit_config(config, 3, last_update_round=1))
        assert restarted.silo.ledger.rounds_seen == 0
    else:
        with pytest.warns(RuntimeWarning, match="the 'clients' bound still holds"):
            restarted.fit(weights, _fit_config(config, 3, last_update_round=1))
    resumed = PDPClient(fl.build_silo(data, budgets, config, 0), tmp_path / "silo0.npz")
    resumed.fit(weights, _fit_config(config, 3, last_update_round=1))    # with its ledger: no complaint
    fresh = PDPClient(fl.build_silo(data, budgets, config, 1))            # never sampled before: none either
    fresh.fit(weights, _fit_config(config, 3))
    assert resumed.silo.ledger.rounds_seen == fresh.silo.ledger.rounds_seen == 3


@pytest.mark.parametrize("command", [["flower"], ["server"], ["client", "--client-id", "0"], ["launch"]])
def test_every_command_refuses_a_privacy_option_the_nonprivate_method_would_ignore(command, capsys):
    """``fl flower --method nonprivate --noise-multiplier 0.01`` ran, where ``fl simulate`` refused it."""
    from pdpfast.fl.cli import main

    assert main([*command, "--method", "nonprivate", "--noise-multiplier", "0.01"]) == 2
    err = capsys.readouterr().err
    assert "error: --noise-multiplier is for the private methods (rpdp, minimum, dropout); --method nonprivate" in err


def test_client_sampling_is_the_servers_secret_not_a_function_of_the_public_seed():
    """Before: sampled_clients(seed, t) of the public seed, which every client receives, so any client
    could compute every other's rounds, and the "clients" ε (amplified by client sampling) did not hold
    against them."""
    config = fl.FLConfig(rounds=20, local_steps=1, client_rate=0.5, seed=0)
    draws = [PoissonFedAvg(num_clients=6, config=config, initial=[np.zeros(1, np.float32)])._sampling_seed
             for _ in range(2)]
    assert draws[0] != draws[1]                # a fresh secret per server
    secret = np.stack([fl.sampled_clients(draws[0], t, 6, 0.5) for t in range(1, 21)])
    public = np.stack([fl.sampled_clients(config.seed, t, 6, 0.5) for t in range(1, 21)])
    assert not np.array_equal(secret, public)
    a = fl.simulate(**FEDERATION, rounds=6, local_steps=1, seed=1, noise_seed=0)
    b = fl.simulate(**FEDERATION, rounds=6, local_steps=1, seed=1, noise_seed=0)
    assert not np.array_equal(a.sampled, b.sampled) and a.info["sampling_seed"] == "secret (os.urandom)"
    c = fl.simulate(**FEDERATION, rounds=6, local_steps=1, seed=2, noise_seed=0, sampling_seed=3)
    d = fl.simulate(**FEDERATION, rounds=6, local_steps=1, seed=1, noise_seed=0, sampling_seed=3)
    np.testing.assert_array_equal(c.sampled, d.sampled)     # the public seed does not enter


def test_the_server_counts_failures_in_every_round_also_one_that_sampled_nobody(monkeypatch):
    """Before: ``failures`` had one entry per round that sampled a client (Flower skips aggregate_fit
    for the others), though documented per round."""
    strategies = []
    init = PoissonFedAvg.__init__

    def keep(self, **kwargs):
        init(self, **kwargs)
        strategies.append(self)

    monkeypatch.setattr(PoissonFedAvg, "__init__", keep)
    res = run_inprocess(config=fl.FLConfig(rounds=12, local_steps=1, client_rate=0.25, seed=0), sampling_seed=5,
                        **FEDERATION)
    assert (res.sampled.sum(1) == 0).any()
    assert strategies[0].failures == [0] * 12


@pytest.mark.parametrize("argv,message", [
    (["server", "--budgets", "BoundedPareto"], "--budgets is read by the clients"),
    (["client", "--client-id", "0", "--method", "nonprivate", "--ledger", "x.npz"],
     "--ledger is for the private methods")])
def test_flower_processes_refuse_what_they_would_not_read(argv, message, capsys):
    """Before: the server accepted --budgets (the clients draw them) and a nonprivate client --ledger
    (it never wrote one)."""
    from pdpfast.fl.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_launch_local_of_the_nonprivate_baseline_passes_no_privacy_setting(tmp_path, monkeypatch):
    """Before: it passed --budgets and every privacy field, which the processes refuse for nonprivate,
    so every launch of the baseline failed."""
    import subprocess

    started = []

    class Stop(Exception):
        pass

    def popen(argv, **kwargs):
        started.append(argv)
        if len(started) == 2:
            raise Stop

    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(Stop):
        launch_local(config=fl.FLConfig(rounds=1, local_steps=1, method="nonprivate"), workdir=tmp_path,
                     **(FEDERATION | {"clients": 2}))
    from pdpfast.fl.cli import _fill

    for argv in started:
        flags = {a for a in argv if a.startswith("--")}
        assert not flags & {"--budgets", "--noise-multiplier", "--max-grad-norm", "--delta", "--threat", "--mode"}
        parser = __import__("argparse").ArgumentParser()
        _fill(parser)
        args = parser.parse_args(argv[3:])
        from pdpfast.fl.cli import _private_only_given

        _private_only_given(args)       # what the process checks first: nothing refused
    with pytest.raises(ValueError, match="noise_seed is for the private methods"):
        launch_local(config=fl.FLConfig(method="nonprivate"), noise_seed=1, workdir=tmp_path, **FEDERATION)
    with pytest.raises(ValueError, match="config.noise_multiplier=2.0 is for the private methods"):
        launch_local(config=fl.FLConfig(method="nonprivate", noise_multiplier=2.0), workdir=tmp_path, **FEDERATION)
