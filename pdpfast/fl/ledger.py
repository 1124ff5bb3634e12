"""Per-record budget ledger of one rPDP-FL client, under both threat models (DESIGN.md §3.3).

Every record j of a client has a fixed sampling rate q_j for as long as it takes part; a record
that leaves (budget exhausted) has q = 0 from then on. Its RDP is therefore a count of rounds
times a per-round RDP, under each threat model (Liu et al., CCS 2024, Thms. 2-3):

* "clients" — other clients and third parties see the global models. The per-round bound already
  includes the amplification by client sampling, ρ^{τ,λ}(α) = log(1 − λ + λ·e^{(α−1)ρ^τ(α)})/(α−1),
  so a record is charged ρ^{τ,λ} in **every** round it takes part in, whether or not its client
  is sampled (charging only sampled rounds would make the charge depend on the secret coin).
* "server" — an honest-but-curious server sees the updates of the clients it sampled, so it
  knows which rounds a client took part in: a record is charged ρ^τ(α) = τ·ρ_SGM(α; q_j, σ) only
  in rounds its client was sampled. This is the exact composition over the realized rounds; the
  paper's λ·T·ρ^τ is its expectation over the client sampling.

Both are accounted; the ledger enforces the run's threat model's. Before each round it drops every
record whose ε under that model after the round would exceed its budget (under "clients" every
round, under "server" when the client is sampled); after the round it charges the records that took
part. ε uses the conversion of ``rpdp.epsilon`` and equals ``rpdp.epsilon(q_j, rounds=n, ...)`` for
a record charged n rounds (tested).

Why only one: under "clients" a drop must not depend on whether the client was sampled (the
analysis treats that as secret), so the "server" count, which does, may not trigger one; the
server is trusted there. Under "server" the guarantee against the server covers the other
clients and third parties too (they see a function of what the server sees), so the "clients"
bound is not needed, and enforcing it would end every record early: rates calibrated for
λ·T·ρ^τ reach T·ρ^{τ,λ} ≥ λ·T·ρ^τ before T. With rates calibrated for the planned T rounds
(``rpdp.sample_rates``) the "clients" check never fires within T; the "server" check fires only
when a client is sampled more often than λ·T allows for that record.
"""
from __future__ import annotations

import zipfile

import numpy as np

from .._checks import as_float_array, check_delta, check_in_range, check_int, holds_whole_numbers
from .._io import atomic_write
from ..accounting.rpdp import client_sampled_rdp, rdp_to_epsilon, remembered
from ..accounting.sgm import DEFAULT_ORDERS, as_orders, distinct_rows, rdp_one_step
from .config import CONVERSIONS, THREATS


def round_rdp(sample_rates, *, noise_multiplier: float, local_steps: int, client_rate: float,
              orders=None) -> dict[str, np.ndarray]:
    """RDP of ONE round per sampling rate, under both threat models.

    "server": ρ^τ(α) = τ·ρ_SGM(α; q, σ). "clients": log(1 − λ + λ·e^{(α−1)ρ^τ})/(α−1), the one
    ``rpdp.client_sampled_rdp`` (0 for q = 0).

    Args:
        sample_rates: (P,) float q in [0, 1] (a scalar is taken as (1,)).
        noise_multiplier: σ of local DP-SGD.
        local_steps: τ, DP-SGD steps per round.
        client_rate: λ ∈ (0, 1], the probability a client is sampled in a round.
        orders: the RDP orders α > 1, (n,) (default ``DEFAULT_ORDERS``).
    Returns:
        {"clients": (P, n) float64, "server": (P, n) float64}, the RDP of one round at each order.
    Raises:
        ValueError (TypeError for a non-number) for a rate outside [0, 1] or a setting out of range.
    """
    orders = as_orders(DEFAULT_ORDERS if orders is None else orders)[0]
    q = _check_rates(as_float_array("sample_rates", sample_rates).ravel())
    noise_multiplier, local_steps, client_rate = _check_round(noise_multiplier, local_steps, client_rate)
    rho_local = local_steps * rdp_one_step(q, np.array([noise_multiplier]), orders)
    rho_clients = np.where(q[:, None] == 0.0, 0.0, client_sampled_rdp(rho_local, orders, client_rate))
    return {"clients": rho_clients, "server": rho_local}


def _check_rates(q: np.ndarray) -> np.ndarray:
    if np.any(~np.isfinite(q)) or np.any((q < 0) | (q > 1)):
        raise ValueError("sample_rates must lie in [0, 1]")
    return q


def _check_round(noise_multiplier, local_steps, client_rate) -> tuple[float, int, float]:
    """(σ, τ, λ) of a round, checked as ``FLConfig`` checks them: a σ ≤ 0, τ = 0 or λ = NaN would
    charge nothing, or NaN, and a record would never be dropped."""
    return (check_in_range("noise_multiplier", noise_multiplier, low=0.0), check_int("local_steps", local_steps, 1),
            check_in_range("client_rate", client_rate, low=0.0, high=1.0))


_ROUND_MEMO: dict = {}   # (σ, τ, λ, orders) → {q: (clients row, server row)}


def _remembered_round_rdp(rates: np.ndarray, *, noise_multiplier, local_steps, client_rate, orders) -> dict:
    """``round_rdp`` of distinct rates, each remembered per setting: the clients of a federation
    with many distinct budgets read their rates off the same exact grid (``rpdp.sample_rates``), so
    all but the first compute (nearly) nothing."""
    def compute(missing):
        rows = round_rdp(missing, noise_multiplier=noise_multiplier, local_steps=local_steps,
                         client_rate=client_rate, orders=orders)
        return zip(rows["clients"], rows["server"])

    key = (float(noise_multiplier), int(local_steps), float(client_rate), orders.tobytes())
    # at most ~90 MB of rows: refined (not grid) rates are new for every client
    found = remembered(_ROUND_MEMO, key, rates, compute, 1 << 15)
    shape = (len(found), orders.shape[0])
    return {"clients": np.array([c for c, _ in found]).reshape(shape),
            "server": np.array([s for _, s in found]).reshape(shape)}


def _same_setting(saved, ours) -> bool:
    saved, ours = np.asarray(saved), np.asarray(ours)
    if ours.dtype.kind == "U":
        return saved.dtype.kind == "U" and saved.shape == ours.shape and bool(np.all(saved == ours))
    return saved.dtype.kind in "iuf" and np.array_equal(saved, ours)


class FederatedLedger:
    """Per-record rPDP-FL ledger of one client.

    Args:
        sample_rates: (n,) q_j in [0, 1] (0: the record never takes part).
        budgets: (n,) the ε each record must not exceed (> 0; ∞ allowed).
        noise_multiplier, local_steps, client_rate, delta, conversion, threat: as in ``FLConfig``
            (``threat``: the model whose ε the ledger keeps within the budgets).
        orders: the RDP orders α > 1 (default ``DEFAULT_ORDERS``).
    Attributes:
        active: (n,) bool, the records that still take part.
        rounds_charged: (n,) int64 rounds charged under "clients".
        participations: (n,) int64 rounds charged under "server".
        rounds_seen: the last round seen (int, 0 before the first).
    Raises:
        ValueError when the shapes differ, a rate lies outside [0, 1], a budget is NaN or ≤ 0, δ lies
        outside (0, 1), σ, τ or λ is out of range (as ``FLConfig`` checks them), or the conversion or
        threat is unknown.
    """

    def __init__(self, sample_rates, budgets, *, noise_multiplier: float, local_steps: int, client_rate: float,
                 delta: float, conversion: str = "standard", threat: str = "clients", orders=None):
        q = as_float_array("sample_rates", sample_rates).ravel()
        b = as_float_array("budgets", budgets).ravel()
        if q.shape != b.shape:
            raise ValueError(f"budgets has {b.shape[0]} values but sample_rates has {q.shape[0]}")
        _check_rates(q)
        noise_multiplier, local_steps, client_rate = _check_round(noise_multiplier, local_steps, client_rate)
        delta = check_delta("delta", delta)
        if np.any(np.isnan(b)) or np.any(b <= 0):
            raise ValueError("budgets must be > 0 (use q = 0 for records that never take part)")
        if conversion not in CONVERSIONS:
            raise ValueError(f"conversion must be one of {CONVERSIONS}, got {conversion!r}")
        if threat not in THREATS:
            raise ValueError(f"threat must be one of {THREATS}, got {threat!r}")
        self.sample_rates, self.budgets = q, b
        self.noise_multiplier, self.local_steps, self.client_rate = noise_multiplier, local_steps, client_rate
        self.delta, self.conversion, self.threat = float(delta), conversion, threat
        self.orders = as_orders(DEFAULT_ORDERS if orders is None else orders)[0]
        # one round's RDP per distinct rate, computed once (the costly part of accounting)
        distinct, self._rate_index = np.unique(q, return_inverse=True)
        self._round_rdp = _remembered_round_rdp(distinct, noise_multiplier=noise_multiplier,
                                                local_steps=local_steps, client_rate=client_rate, orders=self.orders)
        self.active = q > 0
        self.rounds_charged = np.zeros(q.shape[0], dtype=np.int64)
        self.participations = np.zeros(q.shape[0], dtype=np.int64)
        self.rounds_seen = 0

    @property
    def num_records(self) -> int:
        """n, the client's number of records."""
        return int(self.sample_rates.shape[0])

    def _epsilon_at(self, threat: str, counts: np.ndarray) -> np.ndarray:
        """(n,) ε of each record after ``counts`` rounds under ``threat`` (each distinct
        (rate, count) pair converted once)."""
        out = np.zeros(self.num_records)
        charged = counts > 0
        if not charged.any():
            return out
        rate, count = self._rate_index[charged], counts[charged]
        first, inverse = distinct_rows(rate, count)
        rdp = count[first, None] * self._round_rdp[threat][rate[first]]
        out[charged] = rdp_to_epsilon(self.orders, rdp, self.delta, self.conversion)[0][inverse]
        return out

    def epsilons(self, threat: str) -> np.ndarray:
        """ε spent so far by every record under a threat model.

        Args:
            threat: "clients" or "server".
        Returns:
            (n,) float64 ε per record (0 for a record never charged).
        Raises:
            ValueError for another ``threat``.
        """
        if threat not in THREATS:
            raise ValueError(f"threat must be one of {THREATS}, got {threat!r}")
        counts = self.rounds_charged if threat == "clients" else self.participations
        return self._epsilon_at(threat, counts)

    def begin_round(self, server_round: int, sampled: bool) -> np.ndarray:
        """Pre-check of a round: drop the records whose ε after it would exceed their budget under the
        ledger's threat model.

        Rounds skipped since the last call are accounted first, as rounds in which the client was
        not sampled. Under "clients" the check runs every round, under "server" only when ``sampled``.

        Args:
            server_round: t, 1-based; the round after ``rounds_seen``, or later.
            sampled: whether the server sampled this client in round t.
        Returns:
            (n,) float64 sampling rates of this round (q_j for records taking part, 0 for the others);
            ``active`` is updated in place.
        Raises:
            ValueError (TypeError for a non-int) when ``server_round`` was already seen or is not an int;
            the ledger is then unchanged.
        """
        check_int("server_round", server_round, 1)
        if server_round <= self.rounds_seen:
            raise ValueError(f"server_round {server_round} was already seen (last round {self.rounds_seen})")
        self.advance_to(server_round - 1)
        if self.threat == "clients":
            self._drop("clients", self.rounds_charged + 1)
        elif sampled:
            self._drop("server", self.participations + 1)
        return np.where(self.active, self.sample_rates, 0.0)

    def end_round(self, sampled: bool) -> None:
        """Charge the round just run to the records that took part (checked by ``begin_round``).

        Args:
            sampled: whether the client was sampled in it (then it is charged under "server" too).
        Returns:
            None; ``rounds_charged`` (and ``participations``) of the active records and ``rounds_seen``
            grow by one.
        """
        self.rounds_charged[self.active] += 1
        if sampled:
            self.participations[self.active] += 1
        self.rounds_seen += 1

    def advance_to(self, server_round: int) -> None:
        """Account every round up to ``server_round`` not seen yet as a round the client was not
        sampled in (charged under "clients" only).

        Args:
            server_round: the last round to account (1-based; nothing happens for a round already seen).
        Returns:
            None; the state advances in place, records dropping out as their budgets run out.
        Raises:
            TypeError / ValueError for a round that is not an int ≥ 0 (an infinite one would never end).
        """
        check_int("server_round", server_round, 0)
        while self.rounds_seen < server_round:
            self.begin_round(self.rounds_seen + 1, sampled=False)
            self.end_round(sampled=False)

    def _drop(self, threat: str, counts: np.ndarray) -> None:
        over = self.active & (self._epsilon_at(threat, np.where(self.active, counts, 0)) > self.budgets)
        self.active &= ~over

    def _settings(self) -> dict:
        """What the counts mean: a count of rounds is worth ε only under the σ, τ, λ, δ, conversion
        and orders it was charged at (and for these rates and budgets), and which records are still
        active depends on the threat model enforced."""
        return {"sample_rates": self.sample_rates, "budgets": self.budgets,
                "noise_multiplier": np.float64(self.noise_multiplier), "local_steps": np.int64(self.local_steps),
                "client_rate": np.float64(self.client_rate), "delta": np.float64(self.delta),
                "conversion": np.str_(self.conversion), "threat": np.str_(self.threat), "orders": self.orders}

    def state_dict(self) -> dict:
        """The mutable state and the settings it was charged under (the per-round RDP is rebuilt
        from them).

        Returns:
            a dict of numpy values (copies): "active", "rounds_charged", "participations",
            "rounds_seen", and the settings ``load_state_dict`` checks: "sample_rates", "budgets",
            "noise_multiplier", "local_steps", "client_rate", "delta", "conversion", "threat", "orders".
        """
        return {"active": self.active.copy(), "rounds_charged": self.rounds_charged.copy(),
                "participations": self.participations.copy(), "rounds_seen": np.int64(self.rounds_seen)} | {
                    k: np.copy(v) for k, v in self._settings().items()}

    def load_state_dict(self, state: dict) -> None:
        """Resume from what ``state_dict()`` returned.

        Args:
            state: a dict with the keys of ``state_dict()``.
        Returns:
            None; the ledger's state is replaced by copies of the saved one.
        Raises:
            ValueError when the state lacks a key, was saved under other settings (naming them: other
            sample rates or budgets, σ, τ, λ, δ, conversion, threat or orders, under which its counts are
            worth another ε), or its counts cannot be a history (not one per record, negative, more
            participations than rounds charged, more rounds charged than seen, an active record not
            charged every round seen, or a record never drawn (q = 0) active): such a state would
            misreport spending. The ledger is then unchanged.
        """
        settings = self._settings()
        missing = [k for k in ("active", "rounds_charged", "participations", "rounds_seen", *settings)
                   if k not in state]
        if missing:
            raise ValueError(f"ledger state lacks {', '.join(missing)}: not a state_dict() of a FederatedLedger "
                             "(of this version, which records the settings its counts were charged under)")
        other = [k if np.ndim(v) else f"{k} ({np.asarray(state[k]).tolist()!r} saved, {v.tolist()!r} here)"
                 for k, v in settings.items() if not _same_setting(state[k], v)]
        if other:
            raise ValueError(f"ledger state was saved for other {', '.join(other)}: its counts are worth another ε "
                             "under this ledger's settings; resume it with the settings it was saved with")
        counts = {k: np.asarray(state[k]) for k in ("rounds_charged", "participations", "rounds_seen")}
        for k, v in counts.items():  # a float count cast to int would drop its fraction and under-report
            if not holds_whole_numbers(v):
                raise ValueError(f"ledger state: {k} must hold whole counts, got {v.dtype} values")
        active = np.asarray(state["active"], dtype=bool).copy()
        charged = counts["rounds_charged"].astype(np.int64)
        participations = counts["participations"].astype(np.int64)
        seen = int(counts["rounds_seen"])
        n = self.budgets.shape
        if active.shape != n or charged.shape != n or participations.shape != n:
            raise ValueError(f"ledger state: active, rounds_charged and participations must hold one value per record "
                             f"({n[0]})")
        if seen < 0 or (participations < 0).any() or (participations > charged).any() or (charged > seen).any():
            raise ValueError("ledger state: the counts cannot be a history (need 0 <= participations <= rounds_charged "
                             "<= rounds_seen)")
        # a record takes part from round 1 until it is dropped, charged every round meanwhile
        if (active & (charged != seen)).any() or (active & (self.sample_rates == 0)).any():
            raise ValueError("ledger state: the counts cannot be a history (an active record is charged every round "
                             "seen, and a record of rate 0 is never active)")
        self.active, self.rounds_charged, self.participations, self.rounds_seen = active, charged, participations, seen

    def save(self, path) -> None:
        """Write the state to a file atomically: never left half-written.

        Args:
            path: the .npz file (str or path-like).
        Returns:
            None.
        """
        atomic_write(path, lambda f: np.savez(f, **self.state_dict()))

    def load(self, path) -> None:
        """Resume from a file that :meth:`save` wrote.

        Args:
            path: the .npz file (str or path-like).
        Returns:
            None; as :meth:`load_state_dict`.
        Raises:
            FileNotFoundError for a missing file; ValueError naming the file for one that cannot be read
            as a saved ledger (truncated, not an .npz), and as :meth:`load_state_dict` (a state saved
            under other settings, or that cannot be a history).
        """
        state = None
        try:
            data = np.load(path, allow_pickle=False)
            if isinstance(data, np.lib.npyio.NpzFile):
                with data:
                    state = {k: data[k] for k in data.files}
        except FileNotFoundError:
            raise
        except (OSError, ValueError, EOFError, zipfile.BadZipFile):   # truncated, or not an .npz
            pass
        if state is None:
            raise ValueError(f"the ledger file {str(path)!r} cannot be read: it is truncated, or not a ledger that "
                             "save() wrote (an .npz of its arrays)")
        self.load_state_dict(state)

    @property
    def exhausted(self) -> bool:
        """True when no record can take part any more."""
        return not self.active.any()
