"""rPDP-FL (Liu, Lou, Xiong, Liu, Meng, CCS 2024) as an in-process simulation (DESIGN.md §3.3).

Each round t = 1..T the server samples every client independently with probability λ (a round
may sample none: the global model is then unchanged); each sampled client runs τ local DP-SGD
steps through the pdpfast engine with record-level Poisson sampling at its per-record rates q_j
(``rpdp.sample_rates``: SCF + exact re-accounting), shared σ and C; the server averages the
sampled clients' model deltas weighted by their number of records n_k (FedAvg:
θ ← θ + Σ_k n_k Δ_k / Σ_k n_k over the clients that sent an update). Every client keeps a
per-record ledger (``FederatedLedger``) that keeps every record within its budget under the run's
threat model; its ε is reported under both.

``simulate(...)`` runs one configuration end to end; ``run_federated(...)`` runs given silos (the
building block the Flower front end shares: ``sampled_clients``, ``aggregate`` and ``Silo``).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from .._checks import check_flag, check_int, check_positive_per_record, warn_large_delta
from .budgets import sample_budgets
from .client import LocalUpdate, Silo, Weights, get_weights
from .config import FLConfig, draw_sampling_seed, sampled_clients
from .datasets import FederatedData, load_federated, model_factory
from .methods import METHODS


# ----------------------------------------------------------------------------------------------
# The server's two operations (shared with the Flower strategy)
# ----------------------------------------------------------------------------------------------
def initial_weights(model_fn: Callable[[], nn.Module], seed: int) -> Weights:
    """The global model of round 0 (torch's global RNG state is restored afterwards).

    Args:
        model_fn: builds the model.
        seed: ``torch.manual_seed`` for its initialization.
    Returns:
        its weights, float32 arrays in ``state_dict`` order.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        return get_weights(model_fn())


def aggregate(weights: Weights, updates: Sequence[LocalUpdate]) -> Weights:
    """FedAvg of model deltas weighted by client size: θ + Σ_k n_k Δ_k / Σ_k n_k.

    Summed in float64 in client-id order (the order results arrive in does not matter, so a
    Flower server gets the same bits as the simulation).

    Args:
        weights: θ, the global model's numpy arrays.
        updates: the sampled clients' ``LocalUpdate``s: deltas Δ_k and sizes n_k.
    Returns:
        the new global arrays (float32); ``weights`` unchanged when there is no update.
    """
    if not updates:
        return [w.copy() for w in weights]
    updates = sorted(updates, key=lambda u: u.client_id)
    total = float(sum(u.num_examples for u in updates))
    out = []
    for i, w in enumerate(weights):
        acc = np.zeros(w.shape, dtype=np.float64)
        for u in updates:
            acc += (u.num_examples / total) * u.delta[i].astype(np.float64)
        out.append((w.astype(np.float64) + acc).astype(w.dtype))
    return out


def evaluate(model_fn: Callable[[], nn.Module], weights: Weights, features: torch.Tensor,
             labels: torch.Tensor) -> tuple[float, float]:
    """Test the global model.

    Args:
        model_fn: builds the model.
        weights: its numpy arrays, in ``state_dict`` order.
        features: (n, ...) float32 test inputs.
        labels: (n,) int64 class indices.
    Returns:
        (mean cross-entropy loss in nats, accuracy in [0, 1]).
    """
    from .client import fresh_model, set_weights

    model = fresh_model(model_fn)
    set_weights(model, weights)
    model.eval()
    with torch.no_grad():
        logits = model(features)
        return (float(nn.functional.cross_entropy(logits, labels)),
                float((logits.argmax(1) == labels).float().mean()))


# ----------------------------------------------------------------------------------------------
# Result
# ----------------------------------------------------------------------------------------------
@dataclass
class FederatedResult:
    """One rPDP-FL run.

    Attributes:
        config: the run's settings (``FLConfig.to_dict()`` plus "dataset" and "clients").
        accuracy: (T+1,) float test accuracy in [0, 1] of the global model after each round (index 0:
            the initial model).
        loss: (T+1,) float mean test cross-entropy in nats, likewise.
        sampled, contributed: (T, M) bool, which clients each round sampled / which sent an update.
        budgets: (N,) float64 ε_i per training record.
        targets: (N,) float64 the ε each record was trained for (NaN: left out; ∞: no privacy).
        sample_rates: (N,) float64 q_i.
        epsilon_clients, epsilon_server: (N,) float64 ε spent under the "clients" and "server" threat
            models (∞ without privacy); the run's ``threat`` is the one its ledgers keep within the
            budgets (:attr:`epsilon`), the other is accounted for comparison.
        client_index: (N,) int64 the client of each record.
        clients: per-client statistics (``Silo.stats``), in client-id order.
        weights: the final global model (float32 arrays).
        info: extra fields of the runner (split, budgets, ...).
    """

    config: dict
    accuracy: np.ndarray
    loss: np.ndarray
    sampled: np.ndarray
    contributed: np.ndarray
    budgets: np.ndarray
    targets: np.ndarray
    sample_rates: np.ndarray
    epsilon_clients: np.ndarray
    epsilon_server: np.ndarray
    client_index: np.ndarray
    clients: list[dict]
    weights: Weights = field(repr=False)
    info: dict = field(default_factory=dict)

    @property
    def final_accuracy(self) -> float:
        """Test accuracy of the final global model, in [0, 1]."""
        return float(self.accuracy[-1])

    @property
    def epsilon(self) -> np.ndarray:
        """(N,) float64 ε spent per record under the run's threat model, the one its ledgers enforce
        (``epsilon_clients`` or ``epsilon_server``; the other is for comparison)."""
        return self.epsilon_server if self.config.get("threat") == "server" else self.epsilon_clients

    def within_budget(self) -> bool:
        """Whether every record stayed within its budget.

        Returns:
            True when no record's ε exceeds its budget under the run's threat model (:attr:`epsilon`).
        """
        return bool(np.all(self.epsilon <= self.budgets))

    def summary(self) -> dict:
        """Scalars for tables and JSON.

        Returns:
            a dict: "method", "final_accuracy", "best_accuracy", "records_trained" (q_i > 0),
            "records", "mean_sample_rate", "rounds_with_no_client", and
            "max_spent_fraction_clients" / "max_spent_fraction_server" (max_i ε_i / budget_i; ∞ when
            some ε is infinite).
        """
        trained = self.sample_rates > 0
        spent = lambda e: float(np.max(e / self.budgets)) if np.isfinite(e).all() else float("inf")  # noqa: E731
        return {"method": self.config["method"], "final_accuracy": self.final_accuracy,
                "best_accuracy": float(np.max(self.accuracy)), "records_trained": int(trained.sum()),
                "records": int(self.budgets.shape[0]), "mean_sample_rate": float(self.sample_rates.mean()),
                "rounds_with_no_client": int((~self.sampled.any(axis=1)).sum()),
                "max_spent_fraction_clients": spent(self.epsilon_clients),
                "max_spent_fraction_server": spent(self.epsilon_server)}

    def to_dict(self) -> dict:
        """The run as JSON-ready values (no weights).

        Returns:
            a dict: "config", "summary" (non-finite floats as strings), "accuracy", "loss",
            "clients_sampled_per_round", "clients" (per-client statistics), "budget_groups" (per
            distinct finite budget, when there are at most 16 distinct budgets: records, mean sample
            rate, max ε under each threat model) and "info".
        """
        groups = []
        finite = np.isfinite(self.budgets)
        levels = np.unique(self.budgets[finite]) if np.unique(self.budgets).shape[0] <= 16 else None
        if levels is not None:
            for b in levels:
                sel = self.budgets == b
                groups.append({"budget": float(b), "records": int(sel.sum()),
                               "sample_rate": float(self.sample_rates[sel].mean()),
                               "max_epsilon_clients": _json_float(self.epsilon_clients[sel].max()),
                               "max_epsilon_server": _json_float(self.epsilon_server[sel].max())})
        return {"config": self.config, "summary": {k: _json_float(v) for k, v in self.summary().items()},
                "accuracy": self.accuracy.tolist(), "loss": self.loss.tolist(),
                "clients_sampled_per_round": self.sampled.sum(axis=1).tolist(), "clients": self.clients,
                "budget_groups": groups, "info": self.info}

    def to_json(self, path) -> None:
        """Write :meth:`to_dict` as indented JSON.

        Args:
            path: the file to write (str or path-like).
        Returns:
            None.
        """
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)


def _json_float(v):
    if isinstance(v, (float, np.floating)):
        v = float(v)
        return v if np.isfinite(v) else str(v)
    return v


# ----------------------------------------------------------------------------------------------
# Building a federation
# ----------------------------------------------------------------------------------------------
def resolve_budgets(budgets, data: FederatedData, seed: int = 0) -> np.ndarray:
    """The per-record budgets of the training set.

    Args:
        budgets: a distribution name (drawn per record with ``seed``), an (N,) array, or a list of
            M per-client arrays (client k's in the order of ``data.records_of(k)``).
        data: the federation.
        seed: of the draw.
    Returns:
        (N,) float64 ε_i, each finite and > 0.
    Raises:
        ValueError for an unknown name, arrays of the wrong lengths, or a budget not finite and > 0.
    """
    n = int(data.y_train.shape[0])
    if isinstance(budgets, str):
        return sample_budgets(budgets, n, seed)
    if isinstance(budgets, (list, tuple)) and budgets and all(np.ndim(b) == 1 for b in budgets):
        if len(budgets) != data.num_clients:
            raise ValueError(f"budgets has {len(budgets)} per-client arrays but there are {data.num_clients} clients")
        out = np.empty(n)
        for k, b in enumerate(budgets):
            idx = data.records_of(k)
            if len(b) != idx.shape[0]:
                raise ValueError(f"budgets[{k}] has {len(b)} values but client {k} holds {idx.shape[0]} records")
            # each array as a flat one is checked: a bool or a numeric string is not a budget
            out[idx] = check_positive_per_record(f"budgets[{k}]", b, idx.shape[0], records="record of the client")
        budgets = out
    return check_positive_per_record("budgets", budgets, n, records="training record")


def build_silo(data: FederatedData, budgets: np.ndarray, config: FLConfig, client_id: int,
               noise_seed: int | None = None) -> Silo:
    """One client of the federation (what a Flower client process builds for itself).

    Args:
        data: the federation.
        budgets: (N,) float64 ε_i of the whole training set (all clients' records, as
            :func:`resolve_budgets` gives them; the silo takes its own by ``data.records_of``).
        config: the run's settings.
        client_id: 0..M−1.
        noise_seed: the client's secret seed of its noise and record draws (``Silo``'s; None: a fresh
            secret from ``os.urandom``).
    Returns:
        its :class:`Silo` (records, budgets, sampling rates, ledger).
    Raises:
        ValueError for a ``client_id`` outside [0, M), ``budgets`` that are not N finite values > 0
        (TypeError for values that are not numbers), or a ``noise_seed`` that is not None nor an int ≥ 0.
    """
    check_int("client_id", client_id, 0)
    if client_id >= data.num_clients:
        raise ValueError(f"client_id must lie in [0, {data.num_clients}), got {client_id!r}")
    n = int(data.y_train.shape[0])
    budgets = check_positive_per_record("budgets", budgets, n, records="training record of the federation")
    x, y = data.client_data(client_id)
    return Silo(client_id, x, y, budgets[data.records_of(client_id)], config=config,
                model_fn=model_factory(data.name), federation_budgets=budgets, noise_seed=noise_seed)


# ----------------------------------------------------------------------------------------------
# Running it
# ----------------------------------------------------------------------------------------------
def run_federated(silos: Sequence[Silo], model_fn: Callable[[], nn.Module], test_features: torch.Tensor,
                  test_labels: torch.Tensor, config: FLConfig, *, progress: bool = False,
                  on_round: Callable[[int, Weights], None] | None = None, sampling_seed: int | None = None) -> dict:
    """Run T rounds over ``silos``: sample clients, let each sampled silo fit, FedAvg the updates,
    evaluate; then account every silo's rounds up to T.

    Args:
        silos: the M clients, indexed by client id 0..M−1 (changed in place: ledgers, counters).
        model_fn: builds the model.
        test_features: (n, ...) float32 inputs of the server's test set.
        test_labels: (n,) int64 class indices.
        config: the run's settings.
        progress: show a progress bar.
        on_round: optional ``on_round(t, weights)`` after every round t = 1..T.
        sampling_seed: the server's secret seed of the client sampling (``draw_sampling_seed``: None,
            the default, draws a fresh one from ``os.urandom``; an int only for experiments).
    Returns:
        a dict: "weights" (the final global arrays), "accuracy" / "loss" (T+1,) float (index 0: the
        initial model), "sampled" / "contributed" (T, M) bool.
    Raises:
        ValueError when the silos are not in client-id order, there is none, or a silo was built
        for another client rate λ than ``config``'s (its ledger would account another sampling).
    """
    from tqdm.auto import tqdm

    if any(s.client_id != k for k, s in enumerate(silos)):
        raise ValueError("silos must be given in client-id order 0..M−1")
    # the run samples clients at its own λ; a silo's ledger amplifies by its config's λ ("clients")
    other = [s.client_id for s in silos if s.config.client_rate != config.client_rate]
    if other:
        raise ValueError(f"silo(s) {other} were built for client_rate λ = {silos[other[0]].config.client_rate:g}, but "
                         f"this run samples clients at λ = {config.client_rate:g}: their ledgers would under- or "
                         "over-charge; build them with this run's config (more rounds than planned are fine: the "
                         "ledgers drop records as budgets run out)")
    M, T = len(silos), config.rounds
    if M == 0:
        raise ValueError("clients must be ≥ 1")
    check_flag("progress", progress)
    sampling_seed = draw_sampling_seed(sampling_seed)
    weights = initial_weights(model_fn, config.seed)
    loss, acc = np.zeros(T + 1), np.zeros(T + 1)
    loss[0], acc[0] = evaluate(model_fn, weights, test_features, test_labels)
    sampled, contributed = np.zeros((T, M), dtype=bool), np.zeros((T, M), dtype=bool)
    bar = tqdm(range(1, T + 1), desc=f"{config.method:>10}", leave=False, disable=not progress)
    for t in bar:
        sampled[t - 1] = sampled_clients(sampling_seed, t, M, config.client_rate)
        updates = []
        for k in np.flatnonzero(sampled[t - 1]):
            update = silos[k].fit(weights, t)
            if update is not None:
                updates.append(update)
                contributed[t - 1, k] = True
        weights = aggregate(weights, updates)
        loss[t], acc[t] = evaluate(model_fn, weights, test_features, test_labels)
        bar.set_postfix(acc=f"{acc[t]:.3f}", clients=len(updates))
        if on_round is not None:
            on_round(t, weights)
    for silo in silos:
        silo.finish(T)
    return {"weights": weights, "accuracy": acc, "loss": loss, "sampled": sampled, "contributed": contributed}


def collect_result(silos: Sequence[Silo], data: FederatedData, budgets: np.ndarray, config: FLConfig,
                   run: dict, info: dict | None = None) -> FederatedResult:
    """Gather per-record and per-client outcomes.

    Args:
        silos: the M clients after the run.
        data: the federation.
        budgets: (N,) float64 ε_i of the training set.
        config: the run's settings.
        run: its history, as :func:`run_federated` returns it ("weights", "accuracy", "loss",
            "sampled", "contributed").
        info: extra fields to keep.
    Returns:
        the ``FederatedResult``.
    """
    n = budgets.shape[0]
    targets, rates, eps_c, eps_s = (np.empty(n) for _ in range(4))
    for silo in silos:
        idx = data.records_of(silo.client_id)
        targets[idx], rates[idx] = silo.targets, silo.sample_rates
        eps_c[idx], eps_s[idx] = silo.epsilons("clients"), silo.epsilons("server")
    cfg = config.to_dict() | {"dataset": data.name, "clients": data.num_clients}
    return FederatedResult(cfg, run["accuracy"], run["loss"], run["sampled"], run["contributed"], budgets,
                           targets, rates, eps_c, eps_s, data.client_index.copy(), [s.stats() for s in silos],
                           run["weights"], info or {})


def simulate(dataset: str = "digits", clients: int = 5, split: str = "iid", budgets="ThreeLevels",
             method: str = "rpdp", *, rounds: int = 40, local_steps: int = 10, client_rate: float = 0.5,
             noise_multiplier: float = 4.0, max_grad_norm: float = 1.0, delta: float = 1e-4, lr: float = 0.05,
             threat: str = "clients", conversion: str = "standard", mode: str = "bk", clipping: str = "flat",
             dirichlet_alpha: float = 0.5, seed: int = 0, noise_seed: int | None = None,
             sampling_seed: int | None = None, progress: bool = False, threads: int | None = None) -> FederatedResult:
    """Simulate rPDP-FL (or a baseline) in process and return a ``FederatedResult``.

    Args:
        dataset: "digits" or "breast_cancer". clients: M. split: "iid", "label" or "dirichlet".
        budgets: "ThreeLevels", "BoundedPareto", "BoundedMixGauss" (drawn per record with
            ``seed``), an (N,) array over the training set, or a list of M per-client arrays.
        method: "rpdp", "minimum", "dropout" or "nonprivate". rounds: T; local_steps: τ;
            client_rate: λ ∈ (0, 1]; noise_multiplier: σ; max_grad_norm: C; the rest as in ``FLConfig``.
            With method "nonprivate" the privacy settings (σ, C, δ, threat, conversion, mode,
            clipping, budgets, noise_seed) are checked but not used.
        seed: the public seed (model initialization, split, budget draws).
        noise_seed: the clients' secret seed of their noise and record draws. None (the default):
            every client draws its own from ``os.urandom`` for this run, so two runs differ even with
            the same ``seed``. An int makes the local training reproducible bit for bit, but whoever
            knows it can recompute every client's noise and remove it from their updates: only for
            experiments.
        sampling_seed: the server's secret seed of the client sampling. None (the default): a fresh
            one from ``os.urandom``. An int (only for experiments) fixes which clients each round
            samples; whoever knows it knows every client's rounds, and the "clients" ε, which
            amplifies by client sampling, does not hold against them. With both seeds given, the
            run equals the Flower paths given the same ones, bit for bit.
        threads: torch threads for the run (``torch.set_num_threads``, restored afterwards); None or 0
            (the default) leaves torch's setting. The result does not depend on it beyond float rounding.
    Returns:
        the ``FederatedResult``: accuracy per round, (N,) ε spent per record under both threat
        models, per-client statistics.
    Raises:
        ValueError (TypeError for a value of the wrong kind) naming the argument that is out of range.
    """
    from ..demo import torch_threads

    if threads is not None:
        check_int("threads", threads, 0)
    if noise_seed is not None:
        check_int("noise_seed", noise_seed, 0)
    if sampling_seed is not None:
        check_int("sampling_seed", sampling_seed, 0)
    config = FLConfig(rounds=rounds, local_steps=local_steps, client_rate=client_rate,
                      noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, delta=delta, lr=lr,
                      method=method, threat=threat, conversion=conversion, mode=mode, clipping=clipping, seed=seed)
    data = load_federated(dataset, clients, split, seed=seed, dirichlet_alpha=dirichlet_alpha)
    per_record = resolve_budgets(budgets, data, seed)
    if METHODS[method].private:
        warn_large_delta(config.delta, len(per_record))
    with torch_threads(threads):
        silos = [build_silo(data, per_record, config, k, noise_seed) for k in range(data.num_clients)]
        run = run_federated(silos, model_factory(dataset), data.x_test, data.y_test, config, progress=progress,
                            sampling_seed=sampling_seed)
    info = {"split": split, "budgets": budgets if isinstance(budgets, str) else "custom",
            "aggregation": "FedAvg of model deltas weighted by client size n_k, over the clients that sent one",
            "noise_seed": "secret (os.urandom, per client)" if noise_seed is None else noise_seed,
            "sampling_seed": "secret (os.urandom)" if sampling_seed is None else sampling_seed}
    return collect_result(silos, data, per_record, config, run, info)
