"""What a calibration method takes and returns, the registry of methods, and the pieces the RDP
methods (``calibration``) and the PLD ones (``pld``) share. Imports nothing of the package."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["Problem", "Solution", "METHODS", "register_method", "budget_error", "renormalize_capped"]


class Problem:
    """Calibration inputs on the distinct budgets."""

    def __init__(self, budgets, delta, steps, sample_rate, max_grad_norm, hybrid_weight, orders):
        self.budgets = budgets                                  # (N,)
        self.values, self.inverse, self.counts = np.unique(budgets, return_inverse=True, return_counts=True)
        self.n = budgets.shape[0]
        self.delta, self.steps, self.sample_rate = delta, steps, sample_rate
        self.max_grad_norm, self.hybrid_weight, self.orders = max_grad_norm, hybrid_weight, orders
        self.noise_range = None     # (σ for the largest budget, σ for the smallest) at the mean rate

    def mean(self, per_value: np.ndarray) -> float:
        return float(np.dot(self.counts, per_value) / self.n)


class Solution:
    """Per distinct budget: sample rate, effective noise multiplier, certified ε; shared σ."""

    def __init__(self, sample_rates, noise_multipliers, epsilons, sigma, orders=None):
        self.sample_rates, self.noise_multipliers, self.epsilons, self.sigma = (
            sample_rates, noise_multipliers, epsilons, sigma)
        self.orders = orders            # (U,) the RDP order certifying each ε (RDP only; fractional)


METHODS: dict[tuple[str, str], Callable[[Problem], Solution]] = {}


def register_method(name: str, accountant: str = "rdp"):
    """Register a calibration method: ``fn(problem) -> Solution`` under (name, accountant)."""
    def deco(fn):
        METHODS[(name, accountant)] = fn
        return fn
    return deco


def budget_error(method: str, budget: float, why: str, **ctx) -> ValueError:
    where = ", ".join(f"{k}={v:.6g}" for k, v in ctx.items())
    return ValueError(f"budget epsilon={budget:.6g} cannot be met by IDP-{method} ({where}): {why}")


def renormalize_capped(rates: np.ndarray, counts: np.ndarray, q: float) -> np.ndarray:
    """Scale rates to weighted mean q, capping at 1 and re-scaling the rest until stable (the one
    renormalisation: Sample's final cut to mean q, hybrid's rates, the scheduled plans')."""
    rates = rates.astype(np.float64).copy()
    n = counts.sum()
    for _ in range(rates.shape[0] + 1):
        capped = rates >= 1.0
        free_mass = np.dot(counts[~capped], rates[~capped])
        want = n * q - counts[capped].sum()
        if free_mass <= 0:
            break
        rates[~capped] *= want / free_mass
        if not np.any(rates[~capped] > 1.0):
            break
        rates = np.minimum(rates, 1.0)
    return np.minimum(rates, 1.0)
