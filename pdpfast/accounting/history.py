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
    """Class decorator: ``create_accountant(name)`` builds this accountant."""
    def deco(cls):
        _ACCOUNTANTS[name] = cls
        return cls
    return deco


def create_accountant(mechanism: str) -> HistoryAccountant:
    """A fresh accountant by name: "rdp" or "pld"."""
    if mechanism not in _ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {', '.join(map(repr, sorted(_ACCOUNTANTS)))}, got {mechanism!r}")
    return _ACCOUNTANTS[mechanism]()


class HistoryAccountant:
    """The history every uniform accountant keeps: consecutive steps with the same (z, q) share
    one entry (noise_multiplier, sample_rate, num_steps)."""

    name = ""

    def __init__(self):
        self.history: list[tuple[float, float, int]] = []

    @classmethod
    def mechanism(cls) -> str:
        return cls.name

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Compose one Poisson-subsampled Gaussian step (rate q = sample_rate, multiplier z)."""
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
        return sum(entry[2] for entry in self.history)

    def get_epsilon(self, delta: float, **kwargs) -> float:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"mechanism": self.name, "history": [list(entry) for entry in self.history]}

    def load_state_dict(self, state: dict) -> None:
        if state.get("mechanism") != self.name:
            raise ValueError(f"the saved accountant is {state.get('mechanism')!r}, this one is {self.name!r}")
        self.history = [(float(z), float(q), int(n)) for z, q, n in state["history"]]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(history={self.history})"


@register_accountant("rdp")
class RDPAccountant(HistoryAccountant):
    """RDP of the history (additive over entries), converted to (ε, δ) at the best order.

    orders: RDP orders α (default ``DEFAULT_ORDERS``: Opacus's grid extended to α = 512, so ε equals
    Opacus's wherever Opacus's optimum lies inside its grid and is lower, still valid, elsewhere).
    """

    name = "rdp"

    def __init__(self, orders=None):
        super().__init__()
        self.orders = as_orders(DEFAULT_ORDERS if orders is None else orders)[0]

    def get_privacy_spent(self, *, delta: float, alphas=None) -> tuple[float, float]:
        """(ε, best order α) at ``delta``; (0, nan) before the first step."""
        delta = check_delta("delta", delta)
        if not self.history:
            return 0.0, float("nan")
        orders = self.orders if alphas is None else as_orders(alphas)[0]
        rdp = sum(compute_rdp(q, z, n, orders) for z, q, n in self.history)
        eps, best = get_privacy_spent(orders, rdp, delta)
        return float(eps), float(best)

    def get_epsilon(self, delta: float, alphas=None, **kwargs) -> float:
        return self.get_privacy_spent(delta=delta, alphas=alphas)[0]


@register_accountant("pld")
class PLDAccountant(HistoryAccountant):
    """Privacy loss distribution of the composed history (tighter than RDP; an upper bound)."""

    name = "pld"

    def get_epsilon(self, delta: float, **kwargs) -> float:
        delta = check_delta("delta", delta)
        return pld.pld_epsilon_composed(self.history, delta) if self.history else 0.0
