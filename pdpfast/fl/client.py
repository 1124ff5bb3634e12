"""One rPDP-FL client ("silo"): its records, their budgets, sampling rates and ledger, and the
local DP-SGD it runs when the server samples it (DESIGN.md §3.3).

The same ``Silo`` runs inside the in-process simulation and inside the Flower client, so both
paths train, account and drop records identically.
"""
from __future__ import annotations

import functools
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from .._checks import check_positive_per_record
from ..accounting import rpdp
from .config import FLConfig, draw_noise_seed, local_seed
from .ledger import FederatedLedger
from .methods import target_budgets

Weights = list[np.ndarray]


def get_weights(model: nn.Module) -> Weights:
    """The model's state as Flower's NDArrays.

    Args:
        model: any module.
    Returns:
        copies of its ``state_dict`` tensors as numpy arrays (float32 for float32 models), in order.
    """
    return [t.detach().cpu().numpy().copy() for t in model.state_dict().values()]


def set_weights(model: nn.Module, weights: Weights) -> None:
    """Load arrays into a model.

    Args:
        model: the module, changed in place.
        weights: numpy arrays in ``state_dict`` order, as :func:`get_weights` gives.
    Returns:
        None; the model's ``state_dict`` tensors are replaced by ``weights``.
    Raises:
        ValueError when their number differs from the model's tensors.
    """
    keys = list(model.state_dict().keys())
    if len(keys) != len(weights):
        raise ValueError(f"the model has {len(keys)} tensors, got {len(weights)} arrays")
    model.load_state_dict(OrderedDict((k, torch.from_numpy(np.asarray(w))) for k, w in zip(keys, weights)))


@dataclass
class LocalUpdate:
    """What a sampled client sends back to the server.

    Attributes:
        client_id: the sender's index, 0..M−1.
        delta: Δ = local model − global model, float32 numpy arrays in ``state_dict`` order.
        num_examples: n_k, the client's number of records (its FedAvg weight).
    """

    client_id: int
    delta: Weights
    num_examples: int


def fresh_model(model_fn: Callable[[], nn.Module]) -> nn.Module:
    """Build a model without consuming torch's global RNG (its initial values are overwritten).

    Args:
        model_fn: builds the model.
    Returns:
        ``model_fn()``.
    """
    with torch.random.fork_rng(devices=[]):
        return model_fn()


def calibrate_rates(targets: np.ndarray, config: FLConfig) -> np.ndarray:
    """Per-record sampling rates for the targets a method gives the records.

    Args:
        targets: (n,) float64 target ε per record (NaN: left out, ∞: no privacy).
        config: the run's settings (σ, δ, τ, T, λ, threat, conversion).
    Returns:
        (n,) q_j in [0, 1]: ``rpdp.sample_rates`` (SCF + exact re-accounting) for finite targets,
        0 for records left out, 1 without privacy.
    """
    q = np.zeros(targets.shape[0])
    q[np.isposinf(targets)] = 1.0
    train = np.isfinite(targets)
    if train.any():
        key = tuple(sorted(config.accounting_kwargs().items())) + (("threat", config.threat),)
        q[train] = rpdp.sample_rates(targets[train], threat=config.threat, estimator=_scf_estimator(key),
                                     **config.accounting_kwargs())
    return q


@functools.lru_cache(maxsize=32)
def _scf_estimator(key: tuple) -> rpdp.SCFEstimator:
    """The SCF fit of one setting, shared by every client of a federation (it depends only on the
    public (σ, δ, τ, T, λ, threat, conversion), not on any client's budgets)."""
    # The fit only gives sample_rates its starting points: every rate is then re-accounted exactly,
    # so a fit that did not converge changes no rate, and its warning (in about half of the plausible
    # settings) tells the user nothing to act on.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="SCF fit did not converge")
        return rpdp.fit_scf(**dict(key))


def local_train(model_fn: Callable[[], nn.Module], weights: Weights, features: torch.Tensor, labels: torch.Tensor,
                sample_rates: np.ndarray, config: FLConfig, seed: int) -> tuple[Weights, np.ndarray]:
    """τ local steps from ``weights``.

    Private methods: DP-SGD through the pdpfast engine, record j drawn with probability q_j each
    step, clip bound C, noise N(0, σ²C²), normalization by the expected batch Σ q_j; the draws and
    the noise are seeded by ``seed``. ``nonprivate``: τ full-batch gradient steps. torch's global
    RNG is left as it was (torch's DataLoader draws a base seed from it on every iteration).

    Args:
        model_fn: builds the model.
        weights: the global model's numpy arrays, in ``state_dict`` order.
        features: (n, ...) float32 inputs of the client's records.
        labels: (n,) int64 class indices.
        sample_rates: (n,) float64 q_j in [0, 1] (0: the record is never drawn).
        config: the run's settings (τ, σ, C, lr, mode, clipping, method).
        seed: of this round's draws and noise (int ≥ 0): ``local_seed`` of the client's secret noise seed.
    Returns:
        (new weights: numpy arrays in ``state_dict`` order, (n,) int64 times each record was drawn).
    """
    with torch.random.fork_rng(devices=[]):
        return _local_train(model_fn, weights, features, labels, sample_rates, config, seed)


def _local_train(model_fn, weights, features, labels, sample_rates, config, seed):
    from ..engine import PrivacyEngine
    from ..loop import Task, private_steps

    model = fresh_model(model_fn)
    set_weights(model, weights)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    draws = np.zeros(features.shape[0], dtype=np.int64)
    if not config.private:
        for _ in range(config.local_steps):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(features), labels).backward()
            optimizer.step()
        draws += config.local_steps
        return get_weights(model), draws
    engine = PrivacyEngine(seed=seed)
    criterion = nn.CrossEntropyLoss()
    made = engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(TensorDataset(features, labels), batch_size=1),
        noise_multiplier=config.noise_multiplier, max_grad_norm=config.max_grad_norm, sample_rates=sample_rates,
        mode=config.mode, clipping=config.clipping, criterion=criterion if config.mode == "ghost" else None,
        steps_per_epoch=config.local_steps)
    loader = made.data_loader

    def count_draw(step, loss):   # one draw per step: the loader's current batch is the whole draw
        np.add.at(draws, loader.current.indices.numpy(), 1)

    try:
        # τ steps = one pass over the loader (steps_per_epoch=τ), the mean loss of the draw (torch's default)
        private_steps(engine, made.module, made.optimizer, loader, Task(),
                      made.criterion if config.mode == "ghost" else criterion, until=config.local_steps,
                      on_step=count_draw)
    finally:
        engine.detach()
    return get_weights(made.module), draws


class Silo:
    """One client of rPDP-FL.

    Args:
        client_id: its index 0..M−1.
        features: (n, ...) float tensor of its records (n ≥ 1).
        labels: (n,) int64 class indices.
        budgets: (n,) ε_j > 0 of its records (data-independent).
        config: the run's ``FLConfig``.
        model_fn: builds the (untrained) model.
        federation_budgets: (N,) the budgets of all records of all clients, for the baselines that need
            a federation-wide minimum or mean (default: ``budgets``).
        noise_seed: the client's secret seed of its local DP-SGD (record draws and noise; with the round
            and the client id, ``local_seed``). None (the default): a fresh secret from ``os.urandom``.
            An int makes the run reproducible, but whoever knows it can recompute the noise and the
            draws and remove them from the client's updates: keep it secret, or use it only for
            experiments. It is never sent to the server.
    Attributes:
        sample_rates: (n,) float64 q_j in [0, 1].
        targets: (n,) float64 the ε each record is trained for (NaN: left out; ∞: no privacy).
        ledger: the ``FederatedLedger``, None without privacy.
        draw_counts: (n,) int64 how often each record was drawn by local DP-SGD (local statistics,
            never sent to the server).
        rounds_sampled, rounds_contributed: rounds the server sampled this client in / it sent an update in.
    Raises:
        ValueError when the client has no record, when labels and features differ in length, when
        budgets are not n finite values > 0, or for a noise_seed that is not None nor an int ≥ 0.
    """

    def __init__(self, client_id: int, features: torch.Tensor, labels: torch.Tensor, budgets, *, config: FLConfig,
                 model_fn: Callable[[], nn.Module], federation_budgets=None, noise_seed: int | None = None):
        n = int(features.shape[0])
        if n == 0:
            raise ValueError(f"client {client_id} has no data (0 records): every client needs at least one record")
        if labels.shape[0] != n:
            raise ValueError(f"labels of client {client_id} has {labels.shape[0]} values but features has {n} rows")
        self.client_id, self.config, self.model_fn = int(client_id), config, model_fn
        self._noise_seed = draw_noise_seed(noise_seed)   # secret: never in stats(), never sent
        self.features, self.labels = features, labels
        self.budgets = check_positive_per_record(f"budgets of client {client_id}", budgets, n)
        federation = self.budgets if federation_budgets is None else np.asarray(federation_budgets, dtype=np.float64)
        self.targets = target_budgets(config.method, self.budgets, federation)
        self.sample_rates = calibrate_rates(self.targets, config)
        self.ledger = None
        if config.private:
            self.ledger = FederatedLedger(
                self.sample_rates, np.where(np.isfinite(self.targets), self.targets, self.budgets),
                noise_multiplier=config.noise_multiplier, local_steps=config.local_steps,
                client_rate=config.client_rate, delta=config.delta, conversion=config.conversion, threat=config.threat)
        self.draw_counts = np.zeros(n, dtype=np.int64)
        self.rounds_sampled = 0
        self.rounds_contributed = 0

    @property
    def num_records(self) -> int:
        """n, the client's number of records."""
        return int(self.features.shape[0])

    def fit(self, weights: Weights, server_round: int) -> LocalUpdate | None:
        """Run round ``server_round`` as a sampled client: pre-check the ledger, train τ local steps
        from the global ``weights``, charge the ledger, return the update.

        Args:
            weights: the global model's numpy arrays, in ``state_dict`` order.
            server_round: t, 1-based; rounds skipped since the last call are accounted by the ledger
                as rounds this client was not sampled in.
        Returns:
            the ``LocalUpdate`` (float32 delta, n records), or None when no record has budget left (the
            client stops contributing; the round is still recorded in the ledger). Updates
            ``draw_counts``, ``rounds_sampled``, ``rounds_contributed`` and the ledger in place.
        Raises:
            ValueError when ``server_round`` was already seen by the ledger (nothing is counted then).
        """
        rates = self.sample_rates if self.ledger is None else self.ledger.begin_round(server_round, sampled=True)
        self.rounds_sampled += 1
        if not rates.any():
            self.ledger.end_round(sampled=True)
            return None
        new, draws = local_train(self.model_fn, weights, self.features, self.labels, rates, self.config,
                                 local_seed(self._noise_seed, server_round, self.client_id))
        if self.ledger is not None:   # charge before the update leaves the client
            self.ledger.end_round(sampled=True)
        self.draw_counts += draws
        self.rounds_contributed += 1
        delta = [(a - b).astype(np.float32) for a, b in zip(new, weights)]
        return LocalUpdate(self.client_id, delta, self.num_records)

    def finish(self, rounds: int) -> None:
        """Account the rounds after the last one this client was sampled in, up to ``rounds``.

        Args:
            rounds: T, the last round of the run (1-based).
        Returns:
            None; the ledger (if any) charges those rounds as rounds the client was not sampled in.
        """
        if self.ledger is not None:
            self.ledger.advance_to(rounds)

    def epsilons(self, threat: str) -> np.ndarray:
        """ε spent by each record under a threat model.

        Args:
            threat: "clients" or "server".
        Returns:
            (n,) float64 ε per record (∞ without privacy; 0 if never trained).
        Raises:
            ValueError for another ``threat`` (with privacy).
        """
        if self.ledger is None:
            return np.full(self.num_records, np.inf)
        return self.ledger.epsilons(threat)

    def stats(self) -> dict:
        """Per-client summary (counts and ratios only; no per-record values).

        Returns:
            a dict: "client_id", "records", "records_trained" (q_j > 0), "mean_sample_rate",
            "rounds_sampled", "rounds_contributed", and with privacy "records_active_at_end" and
            "max_spent_fraction_clients" / "max_spent_fraction_server" (max_j ε_j / budget_j).
        """
        out = {"client_id": self.client_id, "records": self.num_records,
               "records_trained": int((self.sample_rates > 0).sum()),
               "mean_sample_rate": float(self.sample_rates.mean()),
               "rounds_sampled": self.rounds_sampled, "rounds_contributed": self.rounds_contributed}
        if self.ledger is not None:
            out["records_active_at_end"] = int(self.ledger.active.sum())
            for threat in ("clients", "server"):
                out[f"max_spent_fraction_{threat}"] = float(np.max(self.ledger.epsilons(threat) / self.budgets))
        return out
