"""rPDP-FL on Flower (``flwr``): a client wrapping a silo and a strategy doing client-level
Poisson sampling and FedAvg (DESIGN.md §3.3).

* ``PDPClient``: a Flower ``NumPyClient`` around a ``Silo`` (its records, budgets, sampling rates,
  ledger, secret noise seed and the pdpfast engine). ``fit`` first checks the server's public
  settings (sent with every fit) against its own and refuses a fit when they differ, then runs the
  silo's round: ledger pre-check, τ local DP-SGD steps, ledger charge, and returns the model
  *delta*; a client with no budget left returns no update (``num_examples = 0``, ``contributed = 0``).
* ``PoissonFedAvg``: a Flower ``Strategy``. Each round it samples every client independently with
  probability λ (``sampled_clients`` of its secret sampling seed: not Flower's fixed-fraction
  sampling; a round may sample none, and the global model then stays as it is) and averages the
  deltas weighted by client size (``aggregate``: the same function, in the same client-id order, as
  the simulation). Clients are
  identified by the ``client_id`` they report through ``get_properties``, not by Flower's
  connection ids, so the draws do not depend on the order in which clients connect; a client that
  reports other settings than the server's is refused there.
* ``run_inprocess``: Flower's own ``Server`` loop with the clients called directly in this
  process (no network, no Ray); ``serve`` / ``run_client``: separate server and client processes
  over gRPC (Flower's deprecated-but-shipped ``start_server`` / ``start_client``);
  ``launch_local``: one server and M client processes on 127.0.0.1, bounded in time.
* ``run_ray_simulation``: Flower's own simulation engine (``flwr.simulation.run_simulation``,
  Ray backend; needs ``pip install "flwr[simulation]"``). Its ClientApps are stateless (rebuilt for
  every message, in any Ray actor), so each silo's ledger lives in a file (``PDPClient``'s
  ``ledger_path``) that is loaded before and written after every round.

Telemetry: Flower sends usage events to telemetry.flower.ai unless FLWR_TELEMETRY_ENABLED=0;
importing this module sets that default (an explicit setting in the environment wins).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

import numpy as np  # noqa: E402

try:  # graceful absence: the rest of pdpfast.fl works without flwr
    import flwr  # noqa: F401
    from flwr.client import NumPyClient
    from flwr.common import DisconnectRes, FitIns, GetPropertiesIns, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server import Server, ServerConfig, SimpleClientManager
    from flwr.server.client_proxy import ClientProxy
    from flwr.server.strategy import Strategy
except ImportError as exc:   # pragma: no cover - exercised only without flwr
    FLWR_IMPORT_ERROR: str | None = (f"Flower is not installed ({exc}); install it with `pip install flwr`")
    NumPyClient = Strategy = ClientProxy = Server = object
else:
    FLWR_IMPORT_ERROR = None

from .._checks import check_int, check_positive  # noqa: E402
from .client import LocalUpdate, Silo, Weights  # noqa: E402
from .config import PRIVATE_FIELDS, FLConfig, draw_sampling_seed, sampled_clients, settings_differences  # noqa: E402
from .simulation import aggregate, build_silo, collect_result, evaluate, initial_weights, resolve_budgets  # noqa: E402


def _require_flwr() -> None:
    if FLWR_IMPORT_ERROR is not None:
        raise ImportError(FLWR_IMPORT_ERROR)


# ----------------------------------------------------------------------------------------------
# Client
# ----------------------------------------------------------------------------------------------
def _config_int(config: Mapping, key: str, minimum: int, meaning: str) -> int:
    if key not in config:
        raise ValueError(f"config lacks {key!r} ({meaning}, which PoissonFedAvg.configure_fit sends); its keys are "
                         f"{sorted(map(str, config))}")
    return check_int(f"config[{key!r}]", config[key], minimum)


class PDPClient(NumPyClient):
    """Flower client of one silo. ``fit`` expects the config ``PoissonFedAvg.configure_fit`` sends:
    "server_round" (1-based), "last_update_round" and the run's public settings (``FLConfig``'s fields).

    Args:
        silo: the client's ``Silo`` (records, budgets, sampling rates, ledger, secret noise seed).
        ledger_path: optional .npz file of the silo's ledger: loaded at start if it exists, and
            written after every round before the update is returned (charge before release), so a
            client that restarts never forgets what its records spent. Without one, a restarted
            client's fresh ledger has forgotten the rounds it took part in: ``fit`` then refuses under
            threat "server" and warns under "clients" (see ``fit``).
    Raises:
        ImportError when Flower is not installed.
    """

    def __init__(self, silo: Silo, ledger_path: str | os.PathLike | None = None):
        _require_flwr()
        self.silo = silo
        self.last_round = 0
        self.ledger_path = ledger_path
        if ledger_path is not None and silo.ledger is not None and Path(ledger_path).exists():
            silo.ledger.load(ledger_path)

    def get_properties(self, config):
        """Flower's ``NumPyClient.get_properties``: how the strategy learns who this client is.

        Args:
            config: the server's request (unused).
        Returns:
            {"client_id": the silo's id 0..M−1, "num_examples": its number of records n} and its public
            settings (``FLConfig.to_dict()``), which the strategy checks against its own.
        """
        return {"client_id": self.silo.client_id, "num_examples": self.silo.num_records} | self.silo.config.to_dict()

    def get_parameters(self, config):
        """Flower's ``NumPyClient.get_parameters``: refused, the strategy holds the initial model.

        Args:
            config: the server's request (unused).
        Returns:
            never; it always raises.
        Raises:
            RuntimeError, always.
        """
        raise RuntimeError("PDPClient has no model of its own: the strategy provides the initial parameters")

    def fit(self, parameters, config):
        """Flower's ``NumPyClient.fit``: the silo's round (ledger pre-check, τ local DP-SGD steps,
        ledger charge), the ledger saved to ``ledger_path`` before the update leaves.

        Args:
            parameters: the global model's arrays, in ``state_dict`` order.
            config: the server's fit config: "server_round" (1-based), "last_update_round" (the last round
                the server received an update from this client, 0 for none) and every ``FLConfig`` field.
        Returns:
            (delta arrays (float32, local − global), num_examples n, {"client_id": k, "contributed": 1}),
            or ([], 0, {"client_id": k, "contributed": 0}) when no record has budget left.
        Raises:
            Before the silo or its ledger changes: TypeError when ``config`` is not a dict; ValueError
            when it lacks "server_round" or that is not an int ≥ 1, when the server's settings differ
            from the silo's (naming each: its ledger would account another protocol than the one run),
            or, under threat "server", when the server received an update from this client in a round
            its ledger has not seen (the ledger was lost, e.g. a restart without ``ledger_path``: the
            records' participations are forgotten). Under threat "clients" the latter only warns
            (RuntimeWarning): that bound charges every round whether sampled or not, so it still
            holds; only the reported "server" ε under-counts.
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a dict (Flower's fit config) with 'server_round', "
                            f"got {type(config).__name__}")
        server_round = _config_int(config, "server_round", 1, "the 1-based round")
        if not any(name in config for name in self.silo.config.to_dict()):
            raise ValueError(f"config carries none of the run's settings (FLConfig's fields, which "
                             f"PoissonFedAvg.configure_fit sends); its keys are {sorted(map(str, config))}")
        differences = settings_differences(self.silo.config, config)
        if differences:
            raise ValueError(f"client {self.silo.client_id} refuses round {server_round}: the server's settings "
                             f"differ from this client's ({'; '.join(differences)}; server's vs client's): its "
                             "ledger would account another protocol than the one run; start both with the same "
                             "settings")
        self._check_ledger_history(_config_int(config, "last_update_round", 0,
                                               "the last round the server received this client's update in"))
        self.last_round = server_round
        update = self.silo.fit([np.asarray(array) for array in parameters], server_round)
        if self.ledger_path is not None and self.silo.ledger is not None:
            self.silo.ledger.save(self.ledger_path)
        if update is None:
            return [], 0, {"client_id": self.silo.client_id, "contributed": 0}
        return update.delta, update.num_examples, {"client_id": self.silo.client_id, "contributed": 1}

    def _check_ledger_history(self, last_update_round: int) -> None:
        ledger = self.silo.ledger
        if ledger is None or last_update_round <= ledger.rounds_seen:
            return
        message = (f"client {self.silo.client_id}: the server received this client's update in round "
                   f"{last_update_round}, but its ledger has seen rounds only up to {ledger.rounds_seen}: the "
                   "ledger of the earlier rounds was lost (a restart without --ledger / ledger_path?), and "
                   "the rounds its records took part in are forgotten")
        if self.silo.config.threat == "server":
            raise ValueError(message + "; under threat 'server' its records could overspend their budgets: "
                             "resume the client with its ledger file")
        warnings.warn(message + "; the 'clients' bound still holds (every round is charged), the reported "
                      "'server' ε under-counts", RuntimeWarning, stacklevel=3)

    def evaluate(self, parameters, config):
        """Flower's ``NumPyClient.evaluate``: no client-side evaluation (the server evaluates centrally).

        Args:
            parameters: the global model's arrays (unused).
            config: the server's evaluate config (unused).
        Returns:
            (0.0, 0, {}): loss, number of examples, metrics.
        """
        return 0.0, 0, {}


# ----------------------------------------------------------------------------------------------
# Strategy
# ----------------------------------------------------------------------------------------------
class PoissonFedAvg(Strategy):
    """Client-level Poisson sampling with probability λ and size-weighted FedAvg of deltas.

    Args:
        num_clients: M ≥ 1, the clients the federation expects.
        config: the run's ``FLConfig`` (λ = client_rate, seed, rounds).
        initial: the round-0 global weights (numpy arrays in ``state_dict`` order).
        evaluate_fn: optional ``weights -> (loss, accuracy)`` for centralized evaluation after every round.
        wait_timeout: seconds ``configure_fit`` waits for all M clients to connect (and for each
            ``get_properties`` reply).
        sampling_seed: the server's secret seed of the client sampling (``draw_sampling_seed``: None,
            the default, draws a fresh one from ``os.urandom``; an int only for experiments, and never
            sent to a client).
    Attributes:
        sampled, contributed: rounds × M lists of bool, which clients each round sampled / which sent
            an update.
        accuracy, loss: lists of floats, index 0 the initial model (filled only with ``evaluate_fn``).
        failures: number of failed client calls per round (0 for a round that sampled no client).
        last_update_round: (M,) list of int, the last round each client's update was received in (0: none);
            sent to it with every fit, so a client whose ledger forgot that round notices.
        weights: the latest global model's arrays.
    Raises:
        ImportError when Flower is not installed; ValueError when ``num_clients`` < 1 or ``wait_timeout``
        is not a finite number > 0.
    """

    def __init__(self, *, num_clients: int, config: FLConfig, initial: Weights,
                 evaluate_fn: Callable[[Weights], tuple[float, float]] | None = None, wait_timeout: float = 120.0,
                 sampling_seed: int | None = None):
        _require_flwr()
        self._sampling_seed = draw_sampling_seed(sampling_seed)
        self.num_clients, self.config, self.initial = check_int("num_clients", num_clients, 1), config, initial
        self.evaluate_fn, self.wait_timeout = evaluate_fn, check_positive("wait_timeout", wait_timeout)
        self._proxies: dict[int, ClientProxy] = {}
        self._current: Weights | None = None
        self.sampled: list[list[bool]] = []
        self.contributed: list[list[bool]] = []
        self.accuracy: list[float] = []
        self.loss: list[float] = []
        self.failures: list[int] = []
        self.last_update_round: list[int] = [0] * self.num_clients
        self._round = 0
        self.weights: Weights = initial

    def __repr__(self) -> str:
        return f"PoissonFedAvg(num_clients={self.num_clients}, client_rate={self.config.client_rate})"

    def initialize_parameters(self, client_manager):
        """Flower's ``Strategy.initialize_parameters``: the round-0 model is ``initial``.

        Args:
            client_manager: Flower's client manager (unused).
        Returns:
            ``initial`` as Flower ``Parameters``.
        """
        return ndarrays_to_parameters(self.initial)

    def _clients(self, client_manager) -> dict[int, ClientProxy]:
        """client_id → proxy, asking each newly connected proxy for its ``client_id``."""
        if not client_manager.wait_for(self.num_clients, timeout=int(self.wait_timeout)):
            raise TimeoutError(f"only {client_manager.num_available()} of {self.num_clients} clients connected "
                               f"within {self.wait_timeout:g} s")
        known = {p.cid for p in self._proxies.values()}
        for cid, proxy in sorted(client_manager.all().items()):
            if cid in known:
                continue
            res = proxy.get_properties(GetPropertiesIns(config={}), timeout=self.wait_timeout, group_id=0)
            client_id = int(res.properties["client_id"])
            if not 0 <= client_id < self.num_clients:
                raise ValueError(f"a client reported client_id={client_id}, outside [0, {self.num_clients})")
            differences = settings_differences(self.config, res.properties)
            if differences:
                raise ValueError(f"client {client_id} runs with other settings than the server "
                                 f"({'; '.join(differences)}; client's vs server's): its ledger would account "
                                 "another protocol than the one run; start both with the same settings")
            self._proxies[client_id] = proxy
        missing = sorted(set(range(self.num_clients)) - set(self._proxies))
        if missing:
            raise RuntimeError(f"no connected client reported client_id {missing}")
        return self._proxies

    def configure_fit(self, server_round, parameters, client_manager):
        """Flower's ``Strategy.configure_fit``: client-level Poisson sampling of round ``server_round``.

        Waits for all M clients, then samples each independently with probability λ
        (``sampled_clients``, a function of the secret sampling seed and the round); records the draw in
        ``sampled``, an all-False row in ``contributed`` and no failure yet, and keeps the global model for
        ``aggregate_fit``.

        Args:
            server_round: t, 1-based.
            parameters: the global model (Flower ``Parameters``).
            client_manager: Flower's client manager, asked for the connected proxies.
        Returns:
            a list of (ClientProxy, FitIns) for the sampled clients, in client-id order (possibly
            empty); the FitIns config holds "server_round", "last_update_round" (the client's, from
            ``last_update_round``) and the run's public settings (``FLConfig.to_dict()``: a client
            refuses a fit under other settings than its own).
        Raises:
            TimeoutError when fewer than M clients connect within ``wait_timeout``; ValueError when a
            client reports an id outside [0, M) or other settings than ``config``; RuntimeError when
            some id is not reported by any.
        """
        proxies = self._clients(client_manager)
        self._current = parameters_to_ndarrays(parameters)
        self._round = int(server_round)
        chosen = sampled_clients(self._sampling_seed, server_round, self.num_clients, self.config.client_rate)
        self.sampled.append(chosen.tolist())
        self.contributed.append([False] * self.num_clients)
        self.failures.append(0)     # Flower calls aggregate_fit only for a round that sampled a client
        settings = {"server_round": int(server_round)} | self.config.to_dict()
        return [(proxies[k], FitIns(parameters, settings | {"last_update_round": self.last_update_round[k]}))
                for k in np.flatnonzero(chosen)]

    def aggregate_fit(self, server_round, results, failures):
        """Flower's ``Strategy.aggregate_fit``: FedAvg of the deltas of the clients that contributed.

        Args:
            server_round: t, 1-based (unused: the round is the one ``configure_fit`` last set up).
            results: a list of (ClientProxy, FitRes) whose metrics carry "client_id" and "contributed".
            failures: the failed client calls (counted in ``failures``).
        Returns:
            (the new global model as Flower ``Parameters``, {"clients_contributed": number of updates});
            ``contributed``, ``last_update_round`` and ``failures`` are updated in place.
        """
        # A failed client contributes nothing this round (its ledger already charged it, if it ran).
        self.failures[-1] = len(failures)
        updates = []
        for _, res in results:
            if int(res.metrics.get("contributed", 0)):
                k = int(res.metrics["client_id"])
                updates.append(LocalUpdate(k, parameters_to_ndarrays(res.parameters), int(res.num_examples)))
                self.contributed[-1][k] = True
                self.last_update_round[k] = self._round
        new = aggregate(self._current, updates)
        return ndarrays_to_parameters(new), {"clients_contributed": len(updates)}

    def configure_evaluate(self, server_round, parameters, client_manager):
        """Flower's ``Strategy.configure_evaluate``: no client is asked to evaluate.

        Args:
            server_round, parameters, client_manager: Flower's (unused).
        Returns:
            [] (centralized evaluation only, in ``evaluate``).
        """
        return []   # centralized evaluation only (``evaluate``)

    def aggregate_evaluate(self, server_round, results, failures):
        """Flower's ``Strategy.aggregate_evaluate``: nothing to aggregate (no client evaluates).

        Args:
            server_round, results, failures: Flower's (unused).
        Returns:
            (None, {}).
        """
        return None, {}

    def evaluate(self, server_round, parameters):
        """Flower's ``Strategy.evaluate``: centralized evaluation of the global model after a round.

        Args:
            server_round: t (0: the initial model, before round 1).
            parameters: the global model (Flower ``Parameters``), kept in ``weights``.
        Returns:
            None without ``evaluate_fn``; else (loss, {"accuracy": accuracy}), also appended to
            ``loss`` / ``accuracy`` the first time round t is evaluated.
        """
        self.weights = parameters_to_ndarrays(parameters)    # the latest global model
        if self.evaluate_fn is None:
            return None
        loss, acc = self.evaluate_fn(self.weights)
        if server_round == len(self.accuracy):    # round 0 is evaluated before round 1, and so on
            self.accuracy.append(acc)
            self.loss.append(loss)
        return loss, {"accuracy": acc}


# ----------------------------------------------------------------------------------------------
# In process: Flower's Server loop, clients called directly
# ----------------------------------------------------------------------------------------------
class _DirectProxy(ClientProxy):
    """A ``ClientProxy`` that calls a Flower ``Client`` in this process (no transport)."""

    def __init__(self, cid: str, client):
        super().__init__(cid)
        self.client = client

    def get_properties(self, ins, timeout, group_id):
        return self.client.get_properties(ins)

    def get_parameters(self, ins, timeout, group_id):
        return self.client.get_parameters(ins)

    def fit(self, ins, timeout, group_id):
        return self.client.fit(ins)

    def evaluate(self, ins, timeout, group_id):
        return self.client.evaluate(ins)

    def reconnect(self, ins, timeout, group_id):
        return DisconnectRes(reason="")


def _federation(dataset, clients, split, budgets, config: FLConfig, dirichlet_alpha):
    from .datasets import load_federated

    data = load_federated(dataset, clients, split, seed=config.seed, dirichlet_alpha=dirichlet_alpha)
    return data, resolve_budgets(budgets, data, config.seed)


def run_inprocess(dataset: str = "digits", clients: int = 5, split: str = "iid", budgets="ThreeLevels", *,
                  config: FLConfig, dirichlet_alpha: float = 0.5, noise_seed: int | None = None,
                  sampling_seed: int | None = None):
    """rPDP-FL through Flower's ``Server`` with ``PoissonFedAvg`` and ``PDPClient``s called in this
    process, one at a time (``max_workers = 1``).

    Args:
        dataset: "digits" or "breast_cancer".
        clients: M.
        split: "iid", "label" or "dirichlet".
        budgets: a distribution name, an (N,) array over the training set, or a list of M per-client
            arrays (as ``resolve_budgets``).
        config: the run's settings.
        dirichlet_alpha: α of the "dirichlet" split.
        noise_seed: the clients' secret seed of their noise and record draws (as ``simulate``'s: None,
            the default, draws one per client from ``os.urandom``; an int only for experiments).
        sampling_seed: the server's secret seed of the client sampling (as ``simulate``'s).
    Returns:
        a ``FederatedResult`` like ``simulate`` (with the same ``noise_seed`` and ``sampling_seed``, the
        same bits).
    Raises:
        ImportError when Flower is not installed.
    """
    _require_flwr()
    from .datasets import model_factory

    data, per_record = _federation(dataset, clients, split, budgets, config, dirichlet_alpha)
    model_fn = model_factory(dataset)
    silos = [build_silo(data, per_record, config, k, noise_seed) for k in range(data.num_clients)]
    manager = SimpleClientManager()
    # register in reverse order under opaque ids: the strategy must rely on get_properties only
    for silo in reversed(silos):
        manager.register(_DirectProxy(f"node-{1000 - silo.client_id}", PDPClient(silo).to_client()))
    strategy = PoissonFedAvg(num_clients=data.num_clients, config=config,
                             initial=initial_weights(model_fn, config.seed),
                             evaluate_fn=lambda w: evaluate(model_fn, w, data.x_test, data.y_test), wait_timeout=5,
                             sampling_seed=sampling_seed)
    server = Server(client_manager=manager, strategy=strategy)
    server.max_workers = 1
    server.fit(num_rounds=config.rounds, timeout=None)
    for silo in silos:
        silo.finish(config.rounds)
    run = {"weights": parameters_to_ndarrays(server.parameters), "accuracy": np.array(strategy.accuracy),
           "loss": np.array(strategy.loss), "sampled": np.array(strategy.sampled, dtype=bool),
           "contributed": np.array(strategy.contributed, dtype=bool)}
    return collect_result(silos, data, per_record, config, run, {"runner": "flower-inprocess", "split": split})


# ----------------------------------------------------------------------------------------------
# Flower's simulation engine (Ray)
# ----------------------------------------------------------------------------------------------
def run_ray_simulation(dataset: str = "digits", clients: int = 5, split: str = "iid", budgets: str = "ThreeLevels", *,
                       config: FLConfig, dirichlet_alpha: float = 0.5, ledger_dir: str | os.PathLike | None = None,
                       ray_init_args: dict | None = None, noise_seed: int | None = None,
                       sampling_seed: int | None = None):
    """rPDP-FL on Flower's Ray simulation engine: M virtual SuperNodes, one ClientApp each (its
    ``partition-id`` is the client id), the ``PoissonFedAvg`` strategy in a ServerApp.

    Args:
        dataset: "digits" or "breast_cancer".
        clients: M.
        split: "iid", "label" or "dirichlet".
        budgets: a distribution name (the ClientApps rebuild the budgets from it).
        config: the run's settings.
        dirichlet_alpha: α of the "dirichlet" split.
        ledger_dir: the folder of the silos' ledger files ``client<k>.npz`` (default: a new temporary one).
        ray_init_args: passed to ``ray.init``, over the default of 2 CPUs and no dashboard.
        noise_seed: the clients' secret seed of their noise and record draws (as ``simulate``'s: None,
            the default, draws one per client and message from ``os.urandom``; an int only for experiments).
        sampling_seed: the server's secret seed of the client sampling (as ``simulate``'s).
    Returns:
        a ``FederatedResult`` like ``simulate`` (per-record ε read back from the silos' ledger files).
    Raises:
        ImportError without Flower or Ray; ValueError when ``budgets`` is not a name; RuntimeError when
        the simulation stops before T rounds.
    """
    _require_flwr()
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise ImportError('Flower\'s simulation engine needs Ray: pip install "flwr[simulation]"')
    from flwr.client import ClientApp
    from flwr.server import ServerApp, ServerAppComponents
    from flwr.simulation import run_simulation

    from .datasets import model_factory

    if not isinstance(budgets, str):
        raise ValueError("budgets must be a distribution name for run_ray_simulation (ClientApps rebuild them)")
    ledger_dir = Path(ledger_dir or tempfile.mkdtemp(prefix="pdpfast-fl-ledgers-"))
    ledger_dir.mkdir(parents=True, exist_ok=True)
    data, per_record = _federation(dataset, clients, split, budgets, config, dirichlet_alpha)
    model_fn = model_factory(dataset)
    strategy = PoissonFedAvg(num_clients=clients, config=config, initial=initial_weights(model_fn, config.seed),
                             evaluate_fn=lambda w: evaluate(model_fn, w, data.x_test, data.y_test), wait_timeout=300,
                             sampling_seed=sampling_seed)
    client_app = ClientApp(client_fn=_RayClientFn(dataset, clients, split, budgets, config, dirichlet_alpha,
                                                  str(ledger_dir), noise_seed))
    server_app = ServerApp(server_fn=lambda context: ServerAppComponents(
        strategy=strategy, config=ServerConfig(num_rounds=config.rounds)))
    init_args = {"num_cpus": 2, "include_dashboard": False} | (ray_init_args or {})
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": init_args})
    if len(strategy.accuracy) != config.rounds + 1:
        raise RuntimeError(f"the Flower simulation stopped after {len(strategy.accuracy) - 1} of {config.rounds} "
                           "rounds")
    silos = [build_silo(data, per_record, config, k) for k in range(clients)]
    for silo in silos:
        path = ledger_dir / f"client{silo.client_id}.npz"
        if silo.ledger is not None and path.exists():
            silo.ledger.load(path)
        silo.rounds_sampled = int(np.array(strategy.sampled, dtype=bool)[:, silo.client_id].sum())
        silo.rounds_contributed = int(np.array(strategy.contributed, dtype=bool)[:, silo.client_id].sum())
        silo.finish(config.rounds)
    run = {"weights": strategy.weights, "accuracy": np.array(strategy.accuracy), "loss": np.array(strategy.loss),
           "sampled": np.array(strategy.sampled, dtype=bool), "contributed": np.array(strategy.contributed, dtype=bool)}
    return collect_result(silos, data, per_record, config, run, {"runner": "flower-ray", "split": split})


class _RayClientFn:
    """client_fn of the ClientApp (picklable for Ray): the silo of ``partition-id``, its ledger
    resumed from and saved to ``<ledger_dir>/client<k>.npz``. ClientApps are rebuilt for every
    message, so without a noise seed every round's silo draws a fresh secret one."""

    def __init__(self, dataset, clients, split, budgets, config, dirichlet_alpha, ledger_dir, noise_seed):
        self.args = (dataset, clients, split, budgets, config, dirichlet_alpha)
        self.ledger_dir, self.noise_seed = ledger_dir, noise_seed

    def __call__(self, context):
        k = int(context.node_config["partition-id"])
        data, per_record = _federation(*self.args)
        silo = build_silo(data, per_record, self.args[4], k, self.noise_seed)
        return PDPClient(silo, Path(self.ledger_dir) / f"client{k}.npz").to_client()


# ----------------------------------------------------------------------------------------------
# Separate processes over gRPC
# ----------------------------------------------------------------------------------------------
def serve(address: str, *, dataset: str = "digits", clients: int = 5, split: str = "iid", config: FLConfig,
          dirichlet_alpha: float = 0.5, out: str | os.PathLike | None = None, wait_timeout: float = 120.0,
          round_timeout: float | None = 300.0, sampling_seed: int | None = None) -> dict:
    """Run the Flower server of an rPDP-FL federation at ``address`` (e.g. "127.0.0.1:8080") until
    T rounds are done.

    Args:
        address: host:port.
        dataset, clients, split, dirichlet_alpha: the federation.
        config: the run's settings.
        out: the JSON to write (accuracy per round, sampled / contributed clients; the final global
            weights beside it with suffix .npz); None writes nothing.
        wait_timeout: seconds to wait for the clients.
        round_timeout: seconds to wait for one round (None: no limit).
        sampling_seed: the server's secret seed of the client sampling (``PoissonFedAvg``'s: None, the
            default, draws a fresh one from ``os.urandom``; an int only for experiments).
    Returns:
        the JSON dict ("config", "accuracy", "loss", "sampled", "contributed", "failures"), plus
        "weights" (the final global arrays).
    Raises:
        ImportError when Flower is not installed; ValueError for a timeout that is not a finite number > 0,
        or as :func:`~pdpfast.fl.load_federated`.
    """
    _require_flwr()
    from flwr.server import start_server

    check_positive("wait_timeout", wait_timeout)
    if round_timeout is not None:
        check_positive("round_timeout", round_timeout)

    from .datasets import load_federated, model_factory

    data = load_federated(dataset, clients, split, seed=config.seed, dirichlet_alpha=dirichlet_alpha)
    model_fn = model_factory(dataset)
    strategy = PoissonFedAvg(num_clients=clients, config=config, initial=initial_weights(model_fn, config.seed),
                             evaluate_fn=lambda w: evaluate(model_fn, w, data.x_test, data.y_test),
                             wait_timeout=wait_timeout, sampling_seed=sampling_seed)
    server = _ClosingServer(client_manager=SimpleClientManager(), strategy=strategy)
    server.max_workers = clients
    start_server(server_address=address, server=server,
                 config=ServerConfig(num_rounds=config.rounds, round_timeout=round_timeout))
    report = {"config": config.to_dict() | {"dataset": dataset, "clients": clients, "split": split},
              "accuracy": strategy.accuracy, "loss": strategy.loss, "sampled": strategy.sampled,
              "contributed": strategy.contributed, "failures": strategy.failures}
    if out is not None:
        Path(out).write_text(json.dumps(report, indent=2))
        np.savez(Path(out).with_suffix(".npz"), *strategy.weights)
    report["weights"] = strategy.weights
    return report


class _ClosingServer(Server):
    """Flower's ``Server`` that, when a round fails (a client with other settings, a timeout), first
    tells the connected clients to disconnect: ``start_server`` stops its gRPC server only after a
    run that ends well, and the clients' open streams would keep the process from ever exiting."""

    def fit(self, num_rounds, timeout):
        try:
            return super().fit(num_rounds, timeout)
        except BaseException:
            self.disconnect_all_clients(timeout=10)
            raise


def run_client(address: str, client_id: int, *, dataset: str = "digits", clients: int = 5, split: str = "iid",
               budgets="ThreeLevels", config: FLConfig, dirichlet_alpha: float = 0.5,
               out: str | os.PathLike | None = None, max_wait_time: float = 120.0,
               ledger_path: str | os.PathLike | None = None, noise_seed: int | None = None) -> dict:
    """Run client ``client_id`` of the federation against the Flower server at ``address``.

    The client builds its own silo from the shared, seeded split (a stand-in for a silo's own
    data). When the server ends the run it accounts the remaining rounds and writes ``out``.

    Args:
        address: the server's host:port.
        client_id: k, 0..M−1.
        dataset, clients, split, budgets, dirichlet_alpha: the federation (as :func:`run_inprocess`).
        config: the run's settings.
        out: the JSON to write (per-record budgets and ε under both threat models, and its statistics;
            these stay on the client's side); None writes nothing.
        max_wait_time: seconds to keep trying to reach the server.
        ledger_path: see ``PDPClient``.
        noise_seed: this client's secret seed of its noise and record draws (``Silo``'s; None, the
            default: a fresh secret from ``os.urandom``; an int only for experiments). Never sent.
    Returns:
        that dict: "client_id", "budgets", "sample_rates", "epsilon_clients", "epsilon_server" (lists
        of n floats), "threat" (the model whose ε the ledger kept within the budgets) and "stats"
        (``Silo.stats``).
    Raises:
        ImportError when Flower is not installed; ValueError for a ``client_id`` outside [0, M) or a
        ``max_wait_time`` that is not a finite number > 0.
    """
    _require_flwr()
    from flwr.client import start_client

    check_positive("max_wait_time", max_wait_time)

    data, per_record = _federation(dataset, clients, split, budgets, config, dirichlet_alpha)
    silo = build_silo(data, per_record, config, client_id, noise_seed)
    start_client(server_address=address, client=PDPClient(silo, ledger_path).to_client(), insecure=True,
                 max_wait_time=max_wait_time)
    silo.finish(config.rounds)
    report = {"client_id": client_id, "budgets": silo.budgets.tolist(), "sample_rates": silo.sample_rates.tolist(),
              "epsilon_clients": silo.epsilons("clients").tolist(), "epsilon_server": silo.epsilons("server").tolist(),
              "threat": config.threat, "stats": silo.stats()}
    if out is not None:
        Path(out).write_text(json.dumps(report, allow_nan=True))
    return report


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now.

    Args:
        host: the interface.
    Returns:
        a port number free on it now (the OS's choice; another process may take it before it is used).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch_local(*, dataset: str = "digits", clients: int = 3, split: str = "iid", budgets: str = "ThreeLevels",
                 config: FLConfig, dirichlet_alpha: float = 0.5, timeout: float = 300.0,
                 workdir: str | os.PathLike | None = None, python: str | None = None,
                 noise_seed: int | None = None, sampling_seed: int | None = None) -> dict:
    """Start one server and ``clients`` client processes on 127.0.0.1 (a free port) and wait for
    them (at most ``timeout`` seconds, then kill them all).

    Args:
        dataset, clients, split, budgets, dirichlet_alpha: the federation (``budgets`` a distribution name).
        config: the settings.
        timeout: seconds for the whole run.
        workdir: for logs and outputs, made if missing (a new temporary one by default).
        python: the interpreter of the processes (default this one).
        noise_seed: passed to the client processes only (``--noise-seed``; they are the clients),
            never to the server; None (the default): each client process draws its own secret one.
        sampling_seed: passed to the server process only (``--sampling-seed``), never to a client;
            None (the default): the server draws its own secret one.
    Returns:
        {"server": ..., "clients": [...], "address": ..., "workdir": ...}, the first two read from the
        processes' JSON outputs (the server's with its final "weights").
    Raises:
        ImportError when Flower is not installed; ValueError when ``budgets`` is not a name, ``timeout``
        not a finite number > 0, a workdir that cannot be made, or as :func:`~pdpfast.fl.load_federated`;
        RuntimeError, with the logs, when a process fails or the time runs out.
    """
    _require_flwr()
    if not isinstance(budgets, str):
        raise ValueError("budgets must be a distribution name for launch_local (processes rebuild them)")
    check_positive("timeout", timeout)
    client_argv = [] if noise_seed is None else ["--noise-seed", str(check_int("noise_seed", noise_seed, 0))]
    server_argv = [] if sampling_seed is None else ["--sampling-seed",
                                                    str(check_int("sampling_seed", sampling_seed, 0))]
    if not config.private and noise_seed is not None:   # the processes refuse what the baseline would not read
        raise ValueError(f"noise_seed is for the private methods; method {config.method!r} adds no noise")
    if config.private:
        client_argv = ["--budgets", budgets, *client_argv]
    # the federation is checked here, where its errors name the argument, not in a process's log
    _federation(dataset, clients, split, budgets, config, dirichlet_alpha)
    workdir = Path(workdir or tempfile.mkdtemp(prefix="pdpfast-fl-"))
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"workdir {str(workdir)!r} cannot be made a directory: {exc.strerror or exc}") from exc
    address = f"127.0.0.1:{free_port()}"
    common = ["--dataset", dataset, "--clients", str(clients), "--split", split,
              *(["--dirichlet-alpha", str(dirichlet_alpha)] if split == "dirichlet" else []), *config_to_argv(config)]
    env = os.environ | {"FLWR_TELEMETRY_ENABLED": os.environ.get("FLWR_TELEMETRY_ENABLED", "0"),
                        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                       os.environ.get("PYTHONPATH", "")])}
    py = python or sys.executable
    procs, logs = [], []

    def start(name, args):
        log = open(workdir / f"{name}.log", "w")
        logs.append(log)
        procs.append((name, subprocess.Popen([py, "-m", "pdpfast.fl", *args], stdout=log, stderr=subprocess.STDOUT,
                                             env=env)))

    wait = str(max(10.0, timeout - 5))
    start("server", ["server", "--address", address, "--out", str(workdir / "server.json"),
                     "--wait-timeout", wait, *common, *server_argv])
    for k in range(clients):
        start(f"client{k}", ["client", "--address", address, "--client-id", str(k),
                             "--out", str(workdir / f"client{k}.json"), "--max-wait-time", wait, *common,
                             *client_argv])
    deadline = time.monotonic() + timeout
    try:
        for _name, process in procs:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"Flower processes did not finish within {timeout:g} s; logs in {workdir}:\n"
                           + _tails(workdir)) from None
    finally:
        for _, process in procs:
            if process.poll() is None:
                process.kill()
                process.wait()
        for log in logs:
            log.close()
    bad = [(name, process.returncode) for name, process in procs if process.returncode != 0]
    if bad:
        raise RuntimeError(f"Flower processes failed {bad}; logs in {workdir}:\n" + _tails(workdir))
    server = json.loads((workdir / "server.json").read_text())
    with np.load(workdir / "server.npz") as z:
        server["weights"] = [z[f"arr_{i}"] for i in range(len(z.files))]
    client_reports = [json.loads((workdir / f"client{k}.json").read_text()) for k in range(clients)]
    return {"server": server, "clients": client_reports, "address": address, "workdir": str(workdir)}


def _tails(workdir: Path, n: int = 30) -> str:
    parts = []
    for log in sorted(workdir.glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()[-n:]
        parts.append(f"--- {log.name} ---\n" + "\n".join(lines))
    return "\n".join(parts)


def config_to_argv(config: FLConfig) -> list[str]:
    """The command-line flags of a configuration (for the server and client processes).

    Args:
        config: the run's settings.
    Returns:
        a list of str, ``--<field> <value>`` for every field (floats by ``repr``, so they round-trip);
        for the nonprivate method, none of the privacy fields (``PRIVATE_FIELDS``: the processes refuse
        them, and take their defaults).
    Raises:
        ValueError for the nonprivate method with a privacy field other than its default (it would be lost).
    """
    argv, defaults = [], FLConfig()
    for key, value in config.to_dict().items():
        if not config.private and key in PRIVATE_FIELDS:
            if value != getattr(defaults, key):
                raise ValueError(f"config.{key}={value!r} is for the private methods; method {config.method!r} "
                                 "does not read it (leave it at its default)")
            continue
        argv += [f"--{key.replace('_', '-')}", repr(value) if isinstance(value, float) else str(value)]
    return argv
