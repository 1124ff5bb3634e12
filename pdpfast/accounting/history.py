"""Accountants of a uniform DP-SGD run, with Opacus 1.6's interface: a ``history`` of
(noise_multiplier, sample_rate, num_steps) entries, ``step``, ``get_epsilon(delta)``, ``mechanism()``.

Every record of such a run has the same (q, z), so one history describes them all; runs with
per-record rates or bounds are accounted by the per-record ledgers (``ledger.py``). The math is the
package's own: RDP through ``rdp.compute_rdp`` and the improved conversion of ``rdp.get_privacy_spent``
(Balle et al. 2020), PLD through ``pld`` (Google's ``dp_accounting``, pessimistic discretization).
"""
from __future__ import annotations

import numpy as np

from .._checks import check_delta
from . import pld
from .rdp import compute_rdp, get_privacy_spent
from .sgm import DEFAULT_ORDERS, as_orders

__all__ = ["HistoryAccountant", "PLDAccountant", "RDPAccountant", "create_accountant", "register_accountant"]

_ACCOUNTANTS: dict[str, type] = {}


def register_accountant(name: str):
    """Class decorator: ``create_accountant(name)`` builds this accountant.

    Args:
        name: the accountant's name, as ``create_accountant`` takes it ("rdp", "pld", ...).
    Returns:
        the decorator; it stores the class under ``name``, replacing any earlier one, and returns the
        class unchanged.
    """
    def deco(cls):
        _ACCOUNTANTS[name] = cls
        return cls
    return deco


def create_accountant(mechanism: str) -> HistoryAccountant:
    """A fresh accountant by name.

    Args:
        mechanism: a name given to ``register_accountant``: "rdp" or "pld" built in.
    Returns:
        a new :class:`HistoryAccountant` of that kind, built with default arguments, with an empty history.
    Raises:
        ValueError for an unknown name.
    """
    if mechanism not in _ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {', '.join(map(repr, sorted(_ACCOUNTANTS)))}, got {mechanism!r}")
    return _ACCOUNTANTS[mechanism]()


class HistoryAccountant:
    """The history every uniform accountant keeps: consecutive steps with the same (z, q) share
    one entry (noise_multiplier, sample_rate, num_steps).

    Attributes:
        history: list of (noise_multiplier z ≥ 0 (noise std / clip norm), sample_rate q in [0, 1],
            num_steps) tuples (float, float, int), in the order taken.
        name: the class's registered name ("" here; "rdp", "pld" in the subclasses).
    """

    name = ""

    def __init__(self):
        self.history: list[tuple[float, float, int]] = []

    @classmethod
    def mechanism(cls) -> str:
        """The accountant's name, as Opacus's ``mechanism()``.

        Returns:
            ``cls.name``, a str ("rdp", "pld").
        """
        return cls.name

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Compose one Poisson-subsampled Gaussian step (rate q = sample_rate, multiplier z).

        Args:
            noise_multiplier: z, noise std / clip norm, a finite float ≥ 0.
            sample_rate: q, the Poisson rate in [0, 1].
        Returns:
            None; the history is extended in place (the last entry's count grows when (z, q) repeats).
        Raises:
            ValueError for z not finite and ≥ 0, or q outside [0, 1].
        """
        z, q = float(noise_multiplier), float(sample_rate)
        if not (z >= 0 and np.isfinite(z)):
            raise ValueError(f"noise_multiplier must be a finite number ≥ 0, got {noise_multiplier!r}")
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"sample_rate must lie in [0, 1], got {sample_rate!r}")
        if self.history and self.history[-1][:2] == (z, q):
            self.history[-1] = (z, q, self.history[-1][2] + 1)
        else:
            self.history.append((z, q, 1))

    def __len__(self) -> int:
        return len(self.history)

    @property
    def steps_taken(self) -> int:
        """Steps composed so far, over all history entries."""
        return sum(entry[2] for entry in self.history)

    def get_epsilon(self, delta: float, **kwargs) -> float:
        """ε(δ) spent by the history (each subclass implements it).

        Args:
            delta: δ in (0, 1).
            kwargs: accountant-specific options.
        Returns:
            ε, a float.
        Raises:
            NotImplementedError here.
        """
        raise NotImplementedError

    def state_dict(self) -> dict:
        """The accountant's state, for ``load_state_dict``.

        Returns:
            {"mechanism": name, "history": a list of [z, q, num_steps] lists}.
        """
        return {"mechanism": self.name, "history": [list(entry) for entry in self.history]}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state written by ``state_dict`` of an accountant of the same kind.

        Args:
            state: a dict as ``state_dict`` returns it.
        Returns:
            None; the history is replaced in place.
        Raises:
            ValueError if the state was written by an accountant of another name, or holds an entry
            that cannot be a step (z NaN or < 0, q outside [0, 1], a step count < 1); the history is
            then unchanged.
        """
        if state.get("mechanism") != self.name:
            raise ValueError(f"the saved accountant is {state.get('mechanism')!r}, this one is {self.name!r}")
        history = [(float(z), float(q), int(n)) for z, q, n in state["history"]]
        for z, q, n in history:
            if not (z >= 0 and 0 <= q <= 1 and n >= 1):  # (NaN fails every comparison)
                raise ValueError(f"accountant state: the entry (noise_multiplier={z}, sample_rate={q}, steps={n}) "
                                 "cannot be a step; need noise_multiplier >= 0, sample_rate in [0, 1], steps >= 1")
        self.history = history

    def __repr__(self) -> str:
        return f"{type(self).__name__}(history={self.history})"


@register_accountant("rdp")
class RDPAccountant(HistoryAccountant):
    """RDP of the history (additive over entries), converted to (ε, δ) at the best order.

    Args:
        orders: RDP orders α > 1 (default ``DEFAULT_ORDERS``: Opacus's grid extended to α = 512, so ε
            equals Opacus's wherever Opacus's optimum lies inside its grid and is lower, still valid,
            elsewhere).
    """

    name = "rdp"

    def __init__(self, orders=None):
        super().__init__()
        self.orders = as_orders(DEFAULT_ORDERS if orders is None else orders)[0]

    def get_privacy_spent(self, *, delta: float, alphas=None) -> tuple[float, float]:
        """(ε, best order α) at ``delta``, by the improved conversion of ``rdp.get_privacy_spent``.

        Args:
            delta: δ in (0, 1).
            alphas: RDP orders α > 1 to use instead of ``self.orders`` (None: ``self.orders``).
        Returns:
            (ε, α), floats; (0.0, nan) before the first step. Warns when the optimum sits at the edge
            of the orders.
        Raises:
            ValueError (TypeError if not a number) for δ outside (0, 1); ValueError for an order ≤ 1.
        """
        delta = check_delta("delta", delta)
        if not self.history:
            return 0.0, float("nan")
        orders = self.orders if alphas is None else as_orders(alphas)[0]
        rdp = sum(compute_rdp(q, z, n, orders) for z, q, n in self.history)
        eps, best = get_privacy_spent(orders, rdp, delta)
        return float(eps), float(best)

    def get_epsilon(self, delta: float, alphas=None, **kwargs) -> float:
        """ε(δ) of the history (``get_privacy_spent`` without the order).

        Args:
            delta: δ in (0, 1).
            alphas: RDP orders α > 1 to use instead of ``self.orders`` (None: ``self.orders``).
            kwargs: ignored (Opacus's interface).
        Returns:
            ε, a float (0.0 before the first step).
        Raises:
            ValueError (TypeError if not a number) for δ outside (0, 1); ValueError for an order ≤ 1.
        """
        return self.get_privacy_spent(delta=delta, alphas=alphas)[0]


@register_accountant("pld")
class PLDAccountant(HistoryAccountant):
    """Privacy loss distribution of the composed history (tighter than RDP; an upper bound)."""

    name = "pld"

    def get_epsilon(self, delta: float, **kwargs) -> float:
        """ε(δ) of the composed history by PLD (``pld.pld_epsilon_composed``, an upper bound).

        Args:
            delta: δ in (0, 1).
            kwargs: ignored (Opacus's interface).
        Returns:
            ε, a float (0.0 before the first step).
        Raises:
            ValueError (TypeError if not a number) for δ outside (0, 1).
        """
        delta = check_delta("delta", delta)
        return pld.pld_epsilon_composed(self.history, delta) if self.history else 0.0
