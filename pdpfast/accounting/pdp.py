"""PDP-SGD: multi-round personalized sampling, (Φ, Δ)-PDP (DESIGN.md §3.4).

Heo, Seo, Whang. The sampling mechanism of Jorgensen et al. (2015) on top of a (τ, δ)-DP
algorithm keeps record i with probability π_i = (e^{ε_i} − 1)/(e^τ − 1) if ε_i < τ, else 1; the
result is (ε_i, π_i·δ)-DP for record i. Each round R picks a threshold τ_R on the remaining
budgets, trains on the sampled subset with σ_R calibrated for (τ_R, δ), then charges the round.

Pure functions: numbers in, numbers out. The ledger of remaining budgets is the caller's.

Charging rules:
* ``"all"`` (default): every record is charged its round guarantee min(ε_i, τ) — records below
  τ spend their whole remaining ε_i, the others τ — whether or not it was sampled. The schedule
  of thresholds then depends only on the budgets, never on which records were drawn.
* ``"sampled"``: the paper's rule, charging only the records that were sampled. Later rounds
  then depend on who was sampled (the sampling outcome leaks into the thresholds and subsets),
  which the (ε_i, π_i·δ) guarantee of a single round does not account for; offered only for
  reproducing the paper.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._checks import as_float_array, check_delta, check_epsilons, check_positive_integer, check_rate
from .rdp import get_noise_multiplier

__all__ = ["RoundPlan", "charge", "charge_delta", "round_plan", "sampling_probabilities", "schedule",
           "select_threshold", "threshold_losses"]

_LOSSES = ("fixed", "adaptive", "harmonic")
_RULES = ("all", "sampled")


def _budgets(budgets, allow_zero=False) -> np.ndarray:
    arr = as_float_array("budgets", budgets).ravel()
    if arr.size == 0:
        raise ValueError("budgets is empty")
    if allow_zero:
        if np.any(~np.isfinite(arr)) or np.any(arr < 0):
            raise ValueError("budgets (remaining) must be finite and >= 0")
        return arr
    return check_epsilons("budgets", arr)


def _wastes(sorted_eps: np.ndarray, taus: np.ndarray):
    """(waste_u, waste_s) at each candidate τ from prefix sums over the sorted budgets.

    waste_u(τ) = Σ_{ε_i<τ} ε_i(1 − π_i) = S1 − S2/(e^τ − 1), S1 = Σ ε_i, S2 = Σ ε_i(e^{ε_i} − 1);
    waste_s(τ) = Σ_{ε_i>τ} (ε_i − τ)."""
    c1 = np.r_[0.0, np.cumsum(sorted_eps)]
    c2 = np.r_[0.0, np.cumsum(sorted_eps * np.expm1(sorted_eps))]
    below = np.searchsorted(sorted_eps, taus, side="left")             # count of ε_i < τ
    above_from = np.searchsorted(sorted_eps, taus, side="right")       # first ε_i > τ
    waste_u = c1[below] - c2[below] / np.expm1(taus)
    n = sorted_eps.shape[0]
    waste_s = (c1[n] - c1[above_from]) - taus * (n - above_from)
    return np.maximum(waste_u, 0.0), np.maximum(waste_s, 0.0)


def threshold_losses(budgets, taus, loss="fixed", w1=0.7, w2=0.3) -> np.ndarray:
    """Estimated waste at each candidate threshold τ.

    With waste_u(τ) = Σ_{ε_i<τ} ε_i(1 − π_i) (the budget records below τ lose to not being sampled)
    and waste_s(τ) = Σ_{ε_i>τ} (ε_i − τ) (the budget records above τ leave unspent), the losses are:

    * "fixed": w1·waste_u + w2·waste_s (the paper's loss_f).
    * "adaptive": max(waste_u/U, waste_s/S), U = waste_u(max ε) and S = waste_s(min ε) the largest
      value each waste takes over [min ε, max ε]: the threshold that balances the two wastes, each
      relative to its own scale, with no weights to choose. ``select_threshold`` evaluates it at
      the distinct budgets only: a threshold just below a budget leaves its records a sliver of
      budget (ε_i − τ) that a later round can only spend at a huge noise multiplier (on the demo,
      τ = 1.974 instead of 2 costs PDP-SGD most of its accuracy).
    * "harmonic": 2·waste_u·waste_s/(waste_u + waste_s), loss_a as printed in the PDP-SGD paper.
      waste_u vanishes at τ = min ε, so this loss is minimized there whatever the budgets (every
      record at the smallest budget: DP-SGD); kept only to show that, not as a choice.

    Args:
        budgets: (N,) ε_i > 0 (any shape; flattened).
        taus: candidate thresholds τ > 0, an array of any shape.
        loss: "fixed", "adaptive" or "harmonic".
        w1, w2: the weights of waste_u and waste_s ("fixed" only).
    Returns:
        float64 losses with the shape of ``taus``.
    Raises:
        ValueError for an unknown ``loss`` or a budget that is not finite and > 0.
    """
    if loss not in _LOSSES:
        raise ValueError(f"loss must be one of {_LOSSES}, got {loss!r}")
    eps = np.sort(_budgets(budgets))
    taus = np.asarray(taus, dtype=np.float64)
    wu, ws = _wastes(eps, taus)
    if loss == "fixed":
        return w1 * wu + w2 * ws
    if loss == "adaptive":
        top_u = float(_wastes(eps, eps[-1:])[0][0])
        top_s = float(_wastes(eps, eps[:1])[1][0])
        return np.maximum(wu / top_u if top_u > 0 else 0.0, ws / top_s if top_s > 0 else 0.0)
    total = wu + ws
    return np.where(total > 0, 2.0 * wu * ws / np.where(total > 0, total, 1.0), 0.0)


def select_threshold(budgets, loss="fixed", w1=0.7, w2=0.3, resolution=2048) -> float:
    """The threshold τ ∈ [min ε, max ε] minimizing the estimated waste (``threshold_losses``).

    Candidates: every distinct budget and (except for "adaptive") ``resolution`` + 1 evenly spaced
    values in between (the loss is smooth between budgets). Ties resolve to the smallest τ.

    Args:
        budgets: (N,) ε_i > 0 (any shape; flattened).
        loss: "fixed", "adaptive" or "harmonic" (see ``threshold_losses``).
        w1, w2: the weights of the "fixed" loss, finite and ≥ 0.
        resolution: evenly spaced intervals between min ε and max ε (int).
    Returns:
        τ, a float (ε units).
    Raises:
        ValueError for a bad budget, weight or ``loss``.
    """
    eps = _budgets(budgets)
    for name, w in (("w1", w1), ("w2", w2)):
        if not (np.isfinite(w) and w >= 0):
            raise ValueError(f"{name} must be finite and >= 0, got {w!r}")
    lo, hi = float(eps.min()), float(eps.max())
    taus = np.unique(eps)
    if loss != "adaptive":  # see threshold_losses: the adaptive balance is read at the budgets only
        taus = np.unique(np.r_[taus, np.linspace(lo, hi, int(resolution) + 1)])
    losses = threshold_losses(eps, taus, loss, w1, w2)
    return float(taus[int(np.argmin(losses))])


def sampling_probabilities(budgets, threshold) -> np.ndarray:
    """π_i = (e^{ε_i} − 1)/(e^τ − 1) where ε_i < τ, else 1 (Jorgensen et al. 2015).

    Args:
        budgets: (N,) remaining ε_i ≥ 0 (any shape; flattened); ε_i = 0 gives π_i = 0.
        threshold: τ > 0 (ε units).
    Returns:
        (N,) float64 keep probabilities π_i in [0, 1].
    Raises:
        ValueError if a budget is not finite and ≥ 0, or τ is not finite and > 0.
    """
    eps = _budgets(budgets, allow_zero=True)
    tau = float(threshold)
    if not (np.isfinite(tau) and tau > 0):
        raise ValueError(f"threshold must be finite and > 0, got {threshold!r}")
    return np.where(eps < tau, np.expm1(eps) / np.expm1(tau), 1.0)


@dataclass(frozen=True)
class RoundPlan:
    """One PDP-SGD round: its threshold, keep probabilities, noise and each record's round guarantee.

    Attributes:
        threshold: τ_R (ε units).
        probabilities: (N,) float64 keep probabilities π_i in [0, 1] (0 for records with nothing left).
        noise_multiplier: σ_R (noise std / clip norm) giving (τ_R, δ)-DP over the round's ``steps`` at
            Poisson rate ``sample_rate`` inside the kept subset.
        steps: the round's number of steps (int).
        sample_rate: Poisson rate q in (0, 1] inside the kept subset.
        epsilons: (N,) float64 each record's round ε, min(ε_i, τ_R) (0 for records with nothing left).
        deltas: (N,) float64 each record's round δ: π_i·δ where ε_i < τ_R, else δ (0 for records with
            nothing left).
    """

    threshold: float
    probabilities: np.ndarray
    noise_multiplier: float
    steps: int
    sample_rate: float
    epsilons: np.ndarray
    deltas: np.ndarray


def round_plan(remaining, *, delta, steps, sample_rate, loss="fixed", w1=0.7, w2=0.3, threshold=None,
               orders=None) -> RoundPlan:
    """Plan a round on the remaining budgets (records with nothing left get π = 0).

    Args:
        remaining: (N,) remaining ε_i ≥ 0 (any shape; flattened).
        delta: δ in (0, 1) of the round's (τ_R, δ)-DP training.
        steps: the round's number of steps (positive int).
        sample_rate: Poisson rate q in (0, 1] inside the kept subset.
        loss, w1, w2: how τ_R is chosen on the records with budget left (``select_threshold``).
        threshold: τ_R > 0 to use instead of choosing one (None: choose).
        orders: RDP orders used to solve σ_R (default ``DEFAULT_ORDERS``).
    Returns:
        the :class:`RoundPlan`.
    Raises:
        ValueError for a bad argument, when no record has budget left, or when τ_R cannot be met
        (``get_noise_multiplier``).
    """
    rem = _budgets(remaining, allow_zero=True)
    delta = check_delta("delta", delta)
    steps = check_positive_integer("steps", steps)
    q = check_rate("sample_rate", sample_rate)
    alive = rem > 0
    if not alive.any():
        raise ValueError("remaining: no record has budget left")
    tau = select_threshold(rem[alive], loss, w1, w2) if threshold is None else float(threshold)
    pi = np.where(alive, sampling_probabilities(rem, tau), 0.0)
    sigma = float(get_noise_multiplier(tau, delta, q, steps, orders=orders))
    eps = np.where(alive, np.minimum(rem, tau), 0.0)
    deltas = np.where(alive, np.where(rem < tau, pi, 1.0) * delta, 0.0)
    return RoundPlan(tau, pi, sigma, steps, q, eps, deltas)


def charge(remaining, threshold, sampled=None, rule="all") -> np.ndarray:
    """Remaining budgets after a round with threshold τ.

    Args:
        remaining: (N,) remaining ε_i ≥ 0 before the round (any shape; flattened).
        threshold: τ > 0 (ε units).
        sampled: (N,) bool, which records were sampled (rule "sampled" only).
        rule: "all": every record pays min(ε_i, τ) (records below τ pay their remaining ε_i, the
            others τ); "sampled": only records with ``sampled`` True pay (the paper's rule).
    Returns:
        (N,) float64 remaining ε_i ≥ 0, a new array.
    Raises:
        ValueError for a bad budget or τ, an unknown rule, or a missing or misshaped ``sampled``.
    """
    rem = _budgets(remaining, allow_zero=True)
    tau = float(threshold)
    if not (np.isfinite(tau) and tau > 0):
        raise ValueError(f"threshold must be finite and > 0, got {threshold!r}")
    pay = np.minimum(rem, tau)
    if rule == "all":
        return np.maximum(rem - pay, 0.0)
    if rule == "sampled":
        if sampled is None:
            raise ValueError("rule='sampled' needs the sampled mask")
        mask = np.asarray(sampled, dtype=bool).ravel()
        if mask.shape != rem.shape:
            raise ValueError(f"sampled must have shape {rem.shape}, got {mask.shape}")
        return np.maximum(rem - np.where(mask, pay, 0.0), 0.0)
    raise ValueError(f"rule must be one of {_RULES}, got {rule!r}")


def charge_delta(spent_delta, remaining, threshold, delta, sampled=None, rule="all") -> np.ndarray:
    """δ_i spent after the round: + π_i·δ for records below τ, + δ for the others.

    Records with nothing left pay nothing; with rule "sampled" only sampled records pay. After k
    rounds δ_i ≤ k·δ.

    Args:
        spent_delta: δ_i spent so far, a scalar or (N,).
        remaining: (N,) remaining ε_i ≥ 0 before the round (any shape; flattened).
        threshold: τ > 0 of the round (ε units).
        delta: δ in (0, 1) of the round.
        sampled: (N,) bool, which records were sampled (rule "sampled" only).
        rule: "all" or "sampled" (as in ``charge``).
    Returns:
        (N,) float64 δ_i spent after the round, a new array.
    Raises:
        ValueError for a bad budget, τ or δ, an unknown rule, or a missing ``sampled``.
    """
    rem = _budgets(remaining, allow_zero=True)
    spent = np.asarray(spent_delta, dtype=np.float64).ravel() * np.ones_like(rem)
    d = check_delta("delta", delta)
    pi = sampling_probabilities(rem, threshold)
    pay = np.where(rem > 0, np.where(rem < float(threshold), pi, 1.0) * d, 0.0)
    if rule == "sampled":
        if sampled is None:
            raise ValueError("rule='sampled' needs the sampled mask")
        pay = np.where(np.asarray(sampled, dtype=bool).ravel(), pay, 0.0)
    elif rule != "all":
        raise ValueError(f"rule must be one of {_RULES}, got {rule!r}")
    return spent + pay


def schedule(budgets, rounds, *, delta, steps_per_round, sample_rate, loss="fixed", w1=0.7, w2=0.3,
             orders=None) -> list:
    """All rounds of PDP-SGD under rule "all" (data-independent, so plannable up front).

    With rounds = 1 this is the "DP-SGD + Sampling" baseline.

    Args:
        budgets: (N,) ε_i > 0 (any shape; flattened).
        rounds: the most rounds (positive int).
        delta: δ in (0, 1) of each round.
        steps_per_round: steps of each round (positive int).
        sample_rate: Poisson rate q in (0, 1] inside each round's kept subset.
        loss, w1, w2: how each round's threshold is chosen (``select_threshold``).
        orders: RDP orders used to solve each round's σ (default ``DEFAULT_ORDERS``).
    Returns:
        a list of :class:`RoundPlan`, at most ``rounds`` long, stopping early when every budget is spent.
    Raises:
        ValueError for a bad argument (see ``round_plan``).
    """
    rem = _budgets(budgets)
    plans = []
    for _ in range(check_positive_integer("rounds", rounds)):
        if not np.any(rem > 0):
            break
        plan = round_plan(rem, delta=delta, steps=steps_per_round, sample_rate=sample_rate, loss=loss, w1=w1,
                          w2=w2, orders=orders)
        plans.append(plan)
        rem = charge(rem, plan.threshold)
    return plans
