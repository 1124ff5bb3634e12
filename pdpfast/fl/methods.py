"""rPDP-FL and its baselines as one small registry: what budget each record is trained for.

A method maps the budgets of a client's records (and the budgets of the whole federation, a
public, data-independent summary) to per-record *target* budgets: the ε the sampling rates are
calibrated for and the ledger enforces. NaN means the record is left out of training (q = 0).

* ``rpdp``: every record at its own budget (personalized; Liu et al., CCS 2024).
* ``minimum``: uniform DP, every record at the smallest budget of the federation.
* ``dropout``: uniform DP at the mean budget of the federation; records whose budget is below the
  mean are left out.
* ``nonprivate``: FedAvg without clipping or noise (no guarantee; ε = ∞).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .._checks import as_budget_vector


@dataclass(frozen=True)
class Method:
    """One way of turning budgets into per-record targets.

    Attributes:
        name: what ``FLConfig.method`` and ``--method`` call it.
        private: whether it trains with clipping, noise and a ledger.
        targets: ``targets(budgets (n,), federation (N,)) -> (n,)`` float64 target ε per record
            (NaN: left out; ∞: no privacy).
        description: one line for help texts.
    """

    name: str
    private: bool
    targets: Callable[[np.ndarray, np.ndarray], np.ndarray]   # (budgets (n,), federation (N,)) -> (n,)
    description: str


METHODS: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    """Register a method (a later one of the same name replaces it).

    Args:
        method: a :class:`Method` (its name, its targets).
    Returns:
        it, now in ``METHODS``.
    """
    METHODS[method.name] = method
    return method


def _own(budgets, federation):
    return np.asarray(budgets, dtype=np.float64).copy()


def _minimum(budgets, federation):
    return np.full(np.shape(budgets), float(np.min(federation)))


def _dropout(budgets, federation):
    # the mean of equal budgets can round above them (np.mean of 1437 × 0.7 is 0.7000000000000001),
    # which would leave every record out; no mean lies above the largest budget
    mean = min(float(np.mean(federation)), float(np.max(federation)))
    b = np.asarray(budgets, dtype=np.float64)
    return np.where(b >= mean, mean, np.nan)


def _unbounded(budgets, federation):
    return np.full(np.shape(budgets), np.inf)


register_method(Method("rpdp", True, _own, "rPDP-FL: each record at its own budget"))
register_method(Method("minimum", True, _minimum, "uniform DP at the smallest budget"))
register_method(Method("dropout", True, _dropout, "uniform DP at the mean budget, records below it left out"))
register_method(Method("nonprivate", False, _unbounded, "FedAvg without clipping or noise"))


def target_budgets(method: str, budgets, federation) -> np.ndarray:
    """The ε each record is trained for under a method.

    Args:
        method: a registered method ("rpdp", "minimum", "dropout", "nonprivate").
        budgets: (n,) the client's ε_j.
        federation: (N,) every record's ε_j, for federation-wide baselines.
    Returns:
        (n,) float64 target ε per record (NaN: left out; ∞: no privacy).
    Raises:
        ValueError for an unregistered method, or budgets (either) that are not a flat array of finite
        numbers > 0 (a NaN in ``federation`` would silently leave a client training nothing).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))}, got {method!r}")
    return METHODS[method].targets(as_budget_vector("budgets", budgets), as_budget_vector("federation", federation))
