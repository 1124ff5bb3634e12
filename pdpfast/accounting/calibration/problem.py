"""What a calibration method takes and returns, the registry of methods, and the pieces the RDP
methods (``calibration.rdp``), the PLD ones (``calibration.pld``) and the scheduled plans
(``schedules``) share. Imports nothing of the package."""
from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np

__all__ = ["Problem", "Solution", "METHODS", "MEAN_SLACK", "register_method", "budget_error", "spread_message",
           "hybrid_weight_of", "DEFAULT_HYBRID_WEIGHT", "harmonic_sigma", "renormalize_capped", "RARE",
           "warn_rarely_drawn"]


class Problem:
    """Calibration inputs on the distinct budgets.

    Args:
        budgets: (N,) float64 per-record ε_i > 0, checked.
        delta: δ in (0, 1).
        steps: T, a positive int.
        sample_rate: the target mean Poisson rate q in (0, 1].
        max_grad_norm: the reference clip norm C > 0.
        hybrid_weight: λ in [0, 1] (hybrid only).
        orders: (A,) float64 ascending RDP orders.

    ``values`` (U,) are the distinct budgets ascending, ``inverse`` (N,) each record's index into
    them and ``counts`` (U,) how many records share each; methods solve on the U values.
    """

    def __init__(self, budgets, delta, steps, sample_rate, max_grad_norm, hybrid_weight, orders):
        self.budgets = budgets                                  # (N,)
        self.values, self.inverse, self.counts = np.unique(budgets, return_inverse=True, return_counts=True)
        self.n = budgets.shape[0]
        self.delta, self.steps, self.sample_rate = delta, steps, sample_rate
        self.max_grad_norm, self.hybrid_weight, self.orders = max_grad_norm, hybrid_weight, orders
        self.noise_range = None     # (σ for the largest budget, σ for the smallest) at the mean rate

    def mean(self, per_value: np.ndarray) -> float:
        """Mean over the N records of a per-budget quantity: Σ_u counts_u·x_u / N.

        Args:
            per_value: (U,) float64, one value per distinct budget.
        Returns:
            the mean, a float.
        """
        return float(np.dot(self.counts, per_value) / self.n)


class Solution:
    """Per distinct budget: sample rate, effective noise multiplier, certified ε; shared σ.

    Args:
        sample_rates: (U,) float64 Poisson rates q_u in (0, 1].
        noise_multipliers: (U,) float64 effective z_u = σC/c_u (the clip norm is c_u = σC/z_u).
        epsilons: (U,) float64 certified ε_u ≤ the budgets.
        sigma: the shared noise multiplier σ (float).
        orders: (U,) float64 RDP order certifying each ε (fractional), or None (PLD).
    """

    def __init__(self, sample_rates, noise_multipliers, epsilons, sigma, orders=None):
        self.sample_rates, self.noise_multipliers, self.epsilons, self.sigma = (
            sample_rates, noise_multipliers, epsilons, sigma)
        self.orders = orders


# IDP-Sample (both accountants) accepts a mean sample rate in [q, q·(1 + MEAN_SLACK)] and then
# scales the rates down to mean q exactly (which only lowers every record's ε).
MEAN_SLACK = 2e-3

METHODS: dict[tuple[str, str], Callable[[Problem], Solution]] = {}


def register_method(name: str, accountant: str = "rdp"):
    """Register a calibration method ``fn(problem) -> Solution`` (a decorator).

    Args:
        name: the method's name, as ``calibrate(method=...)`` takes it.
        accountant: the accountant it solves under, "rdp" or "pld".
    Returns:
        The decorator; it stores ``fn`` under (name, accountant), replacing any earlier one, and
        returns ``fn`` unchanged.
    """
    def deco(fn):
        METHODS[(name, accountant)] = fn
        return fn
    return deco


def budget_error(method: str, budget: float, why: str, **ctx) -> ValueError:
    """The one wording of "this budget cannot be met".

    Args:
        method: the method's display name ("Sample", "Scale", "hybrid").
        budget: the ε that fails.
        why: the reason, a sentence fragment.
        ctx: the numbers it failed at (sample_rate=, steps=, ...), shown with 6 significant digits.
    Returns:
        The ValueError to raise.
    """
    where = ", ".join(f"{k}={v:.6g}" for k, v in ctx.items())
    return ValueError(f"budget epsilon={budget:.6g} cannot be met by IDP-{method} ({where}): {why}")


DEFAULT_HYBRID_WEIGHT = 0.5      # λ of "hybrid" when none is given: halfway between Scale and Sample


def hybrid_weight_of(method: str, hybrid_weight) -> object:
    """λ for ``method``: None means 0.5; a λ given with "sample" or "scale", which do not read it,
    is refused rather than ignored (a registered method may read ``Problem.hybrid_weight``).

    Args:
        method: the method's name.
        hybrid_weight: λ as given (None: not given).
    Returns:
        λ, unchecked (the caller checks its range).
    Raises:
        ValueError for a λ given with "sample" or "scale".
    """
    if hybrid_weight is None:
        return DEFAULT_HYBRID_WEIGHT
    if method in ("sample", "scale"):
        raise ValueError(f"hybrid_weight is for method='hybrid' (0 = Scale, 1 = Sample); method={method!r} "
                         f"would ignore hybrid_weight={hybrid_weight!r}")
    return hybrid_weight


def spread_message(method: str, budget: float, values: np.ndarray, sample_rate: float, noise_multiplier: float,
                   why: str, **ctx) -> str:
    """The one wording of "the budgets are too far apart for IDP-Sample's one shared noise multiplier".

    Sample's rates grow with σ; the σ whose mean rate is q can lie so low that a small budget's
    records would need a rate below the floor there, while the large budgets' records, at rate 1
    already, hold the mean above q at every σ where it fits. Scale varies c_i, not q_i: no such limit.

    Args:
        method: the display name ("Sample", "hybrid").
        budget: the ε that cannot be met at ``noise_multiplier``.
        values: (U,) the distinct budgets, ascending.
        sample_rate: q, the mean rate sought.
        noise_multiplier: the σ (base σ₀ under a schedule) where the search stopped.
        why: what fails at that σ, a sentence fragment.
        ctx: further numbers (steps=, delta=), shown with 6 significant digits.
    Returns:
        the message, a str.
    """
    where = ", ".join(f"{k}={v:.6g}" for k, v in ctx.items())
    return (f"budget epsilon={budget:.6g} cannot be met by IDP-{method}: the budgets are spread too far "
            f"({values[0]:.4g} to {values[-1]:.4g}) for one shared noise multiplier. Its search for the one that "
            f"gives a mean sample rate of {sample_rate:.6g} stopped at noise_multiplier={noise_multiplier:.6g}: {why} "
            f"({where}); use method 'scale' (per-record clip norms, any spread), or a larger sample rate (the "
            "large budgets' records, at rate 1 or near it, then fill less of the mean)")


def harmonic_sigma(problem: Problem, noise_multipliers: np.ndarray) -> float:
    """The shared σ of Scale and hybrid: σ = (mean_i 1/z_{u(i)})^{-1} over the records, so that the
    clip norms c_u = σC/z_u average C (Boenisch et al. 2023, Alg. 3).

    Args:
        problem: the problem (its ``counts`` weight the distinct budgets).
        noise_multipliers: (U,) float64 effective noise multipliers z_u > 0.
    Returns:
        σ, a float.
    """
    return float(problem.n / np.dot(problem.counts, 1.0 / noise_multipliers))


def renormalize_capped(rates: np.ndarray, counts: np.ndarray, q: float) -> np.ndarray:
    """Scale rates to weighted mean q, capping at 1 and re-scaling the rest until stable (the one
    renormalisation: Sample's final cut to mean q, hybrid's rates, the scheduled plans').

    Args:
        rates: (U,) rates ≥ 0 per distinct budget.
        counts: (U,) records per distinct budget (the weights).
        q: the target weighted mean in (0, 1].
    Returns:
        (U,) float64 rates in [0, 1], a new array.
    """
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


RARE = 0.01     # a budget group drawn at all with a probability below this over training is warned about


def warn_rarely_drawn(values, counts, rates, steps) -> None:
    """Warn when the records of some budget group are drawn at all with probability below ``RARE`` (1%)
    over training: 1 − (1 − q_g)^T < 0.01 (about q_g·T < 0.01). The one check for every calibration
    (``calibrate``, ``schedules.calibrate_scheduled``), called just before the plan is returned.

    Such a plan is private and valid, but those records will almost surely never train the model. It
    usually means their budgets are far below the others': Sample met each budget by lowering its rate
    (rates like 1e-11 beside budgets three orders of magnitude larger).

    Args:
        values: (U,) float64 the distinct budgets.
        counts: (U,) records per distinct budget.
        rates: (U,) float64 each group's Poisson sample rate in [0, 1].
        steps: T, the number of steps (positive int).
    Returns:
        None; issues one ``UserWarning`` naming how many records in how many groups, and the worst group
        (its ε, rate and probability of being drawn at all), attributed to the calibration's caller.
    """
    rates = np.asarray(rates, dtype=np.float64)
    with np.errstate(divide="ignore"):      # q = 1: log1p(-1) = -inf, drawn = 1
        drawn = -np.expm1(steps * np.log1p(-np.minimum(rates, 1.0)))     # 1 - (1 - q)^T
    rare = drawn < RARE
    if rare.any():
        worst = int(np.argmin(drawn))
        # per-record rates (Sample, hybrid) made them rare: Scale draws every record at sample_rate
        scale = ", or use method 'scale' (every record drawn at sample_rate)" if np.ptp(rates) > 0 else ""
        warnings.warn(f"{int(np.asarray(counts)[rare].sum())} record(s) in {int(rare.sum())} budget group(s) are "
                      f"drawn at all with probability below {RARE:.0%} in {steps} steps (epsilon={values[worst]:.4g}: "
                      f"sample rate {rates[worst]:.3g}, probability {drawn[worst]:.3g}): they will almost surely not "
                      f"train the model. Raise their budgets (or the steps or sample_rate), or leave them out{scale}",
                      stacklevel=3)
