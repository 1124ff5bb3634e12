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

from .._checks import (
    as_float_array,
    check_choice,
    check_delta,
    check_epsilons,
    check_int,
    check_nonnegative,
    check_positive,
    check_positive_integer,
    check_rate,
)
from .rdp import get_noise_multiplier
from .sgm import as_orders

__all__ = ["RoundPlan", "UnmeetableThreshold", "amplified_epsilon", "charge", "charge_delta", "meetable_round",
           "round_plan", "sampling_probabilities", "schedule", "select_threshold", "threshold_losses"]

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


def _weights(w1, w2) -> tuple[float, float]:
    """The "fixed" loss's weights, each a finite number ≥ 0 (not a bool or a string)."""
    return check_nonnegative("w1", w1), check_nonnegative("w2", w2)


def _threshold(threshold) -> float:
    """τ, a finite number > 0 (True would read as τ = 1, "2" as 2)."""
    return check_positive("threshold", threshold)


def _sampled(sampled, rule, n: int):
    """The records that pay under ``rule``: None (every record) or the checked (n,) bool mask.

    ``sampled`` is checked whenever given, under rule "all" too (a caller that keeps its draw passes it
    either way); only rule "sampled" uses it."""
    check_choice("rule", rule, _RULES)
    if sampled is None:
        if rule == "sampled":
            raise ValueError("rule='sampled' needs the sampled mask")
        return None
    raw = np.asarray(sampled)
    if raw.dtype != bool:   # "False" cast to bool is True; 0.5 and 2 are not a draw
        raise TypeError(f"sampled must be a bool array (one True/False per record), got dtype {raw.dtype}")
    mask = raw.ravel()
    if mask.shape != (n,):   # one value would broadcast to every record
        raise ValueError(f"sampled must have one value per record ({n},), got shape {raw.shape}")
    return mask if rule == "sampled" else None


def _log_expm1(x: np.ndarray) -> np.ndarray:
    """log(e^x − 1) for x > 0, without overflow (e^x is inf beyond x ≈ 709)."""
    return x + np.log(-np.expm1(-x))


def _wastes(sorted_eps: np.ndarray, taus: np.ndarray):
    """(waste_u, waste_s) at each candidate τ from prefix sums over the sorted budgets.

    waste_u(τ) = Σ_{ε_i<τ} ε_i(1 − π_i) = S1 − S2/(e^τ − 1), S1 = Σ ε_i, S2 = Σ ε_i(e^{ε_i} − 1);
    waste_s(τ) = Σ_{ε_i>τ} (ε_i − τ). S2 is summed in log space: its terms overflow for ε_i > 709."""
    c1 = np.r_[0.0, np.cumsum(sorted_eps)]
    log_c2 = np.logaddexp.accumulate(np.r_[-np.inf, np.log(sorted_eps) + _log_expm1(sorted_eps)])
    below = np.searchsorted(sorted_eps, taus, side="left")             # count of ε_i < τ
    above_from = np.searchsorted(sorted_eps, taus, side="right")       # first ε_i > τ
    waste_u = c1[below] - np.exp(log_c2[below] - _log_expm1(taus))
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
        taus: candidate thresholds τ > 0 (finite), an array of any shape.
        loss: "fixed", "adaptive" or "harmonic".
        w1, w2: the weights of waste_u and waste_s, finite and ≥ 0 (used by "fixed" only).
    Returns:
        float64 losses with the shape of ``taus``.
    Raises:
        TypeError for taus or weights that are not numbers; ValueError for an unknown ``loss``, a
        budget that is not finite and > 0, a τ that is not finite and > 0, or a negative weight.
    """
    if loss not in _LOSSES:
        raise ValueError(f"loss must be one of {_LOSSES}, got {loss!r}")
    w1, w2 = _weights(w1, w2)
    eps = np.sort(_budgets(budgets))
    taus = as_float_array("taus", taus)
    if not np.all(np.isfinite(taus) & (taus > 0)):   # τ = 0 gave NaN, τ < 0 garbage
        raise ValueError(f"taus must be finite and > 0, got min {taus.min()}")
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
        resolution: evenly spaced intervals between min ε and max ε (an int ≥ 1).
    Returns:
        τ, a float (ε units).
    Raises:
        TypeError for a weight that is not a number; ValueError for a bad budget, weight,
        ``resolution`` or ``loss``.
    """
    eps = _budgets(budgets)
    w1, w2 = _weights(w1, w2)
    resolution = check_int("resolution", resolution, 1)   # 2.7 was read as 2, -5 failed inside numpy
    lo, hi = float(eps.min()), float(eps.max())
    taus = np.unique(eps)
    if loss != "adaptive":  # see threshold_losses: the adaptive balance is read at the budgets only
        taus = np.unique(np.r_[taus, np.linspace(lo, hi, resolution + 1)])
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
        TypeError if τ is not a number (a bool or a string included); ValueError if a budget is not
        finite and ≥ 0, or τ is not finite and > 0.
    """
    eps = _budgets(budgets, allow_zero=True)
    tau = _threshold(threshold)
    # (e^ε − 1)/(e^τ − 1) as e^{ε−τ}(1 − e^{−ε})/(1 − e^{−τ}): the same value, finite beyond ε ≈ 709
    ratio = np.exp(np.minimum(eps - tau, 0.0)) * np.expm1(-eps) / np.expm1(-tau)
    return np.where(eps < tau, ratio, 1.0)


def amplified_epsilon(probabilities, epsilon: float) -> np.ndarray:
    """ε of a record kept with probability π in a subset whose training is ε-DP: log(1 + π(e^ε − 1))
    (the sampling mechanism's amplification), computed without overflow for large ε.

    Args:
        probabilities: π_i in [0, 1], an array of any shape.
        epsilon: ε ≥ 0 of the subset's training (finite).
    Returns:
        float64 ε_i of the shape of ``probabilities`` (0 where π_i = 0).
    """
    p = np.asarray(probabilities, dtype=np.float64)
    e = float(epsilon)
    if e <= 1.0:
        return np.log1p(p * np.expm1(e))
    # = ε + log(π + (1 − π)e^{−ε}) (for π > 0), whose terms stay finite for any ε
    safe = np.where(p > 0, p, 1.0)
    return np.where(p > 0, e + np.log(safe + (1.0 - safe) * np.exp(-e)), 0.0)


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


class UnmeetableThreshold(ValueError):
    """A round's threshold τ_R that no noise multiplier meets over its steps (``threshold``: τ_R)."""

    def __init__(self, message: str, threshold: float):
        super().__init__(message)
        self.threshold = threshold


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
        TypeError for an argument that is not a number; ValueError for a bad argument (``loss``, w1
        and w2 are checked with a ``threshold`` given too) or when no record has budget left;
        :class:`UnmeetableThreshold` (a ValueError) when τ_R cannot be met (``get_noise_multiplier``).
    """
    rem = _budgets(remaining, allow_zero=True)
    delta = check_delta("delta", delta)
    steps = check_positive_integer("steps", steps)
    q = check_rate("sample_rate", sample_rate)
    check_choice("loss", loss, _LOSSES)
    w1, w2 = _weights(w1, w2)
    tau = None if threshold is None else _threshold(threshold)
    alive = rem > 0
    if not alive.any():
        raise ValueError("remaining: no record has budget left")
    tau = select_threshold(rem[alive], loss, w1, w2) if tau is None else tau
    pi = np.where(alive, sampling_probabilities(rem, tau), 0.0)
    if orders is not None:
        as_orders(orders)   # bad orders are the caller's error, not an unmeetable τ
    try:
        sigma = float(get_noise_multiplier(tau, delta, q, steps, orders=orders))
    except ValueError as err:
        raise UnmeetableThreshold(str(err), tau) from err
    eps = np.where(alive, np.minimum(rem, tau), 0.0)
    deltas = np.where(alive, np.where(rem < tau, pi, 1.0) * delta, 0.0)
    return RoundPlan(tau, pi, sigma, steps, q, eps, deltas)


def charge(remaining, threshold, sampled=None, rule="all") -> np.ndarray:
    """Remaining budgets after a round with threshold τ.

    Args:
        remaining: (N,) remaining ε_i ≥ 0 before the round (any shape; flattened).
        threshold: τ > 0 (ε units).
        sampled: (N,) bool, which records were sampled; needed by rule "sampled". Under rule "all" it
            may be given (a caller keeps its draw either way) and is checked, but does not change the
            charge: every record pays.
        rule: "all": every record pays min(ε_i, τ) (records below τ pay their remaining ε_i, the
            others τ); "sampled": only records with ``sampled`` True pay (the paper's rule).
    Returns:
        (N,) float64 remaining ε_i ≥ 0, a new array.
    Raises:
        TypeError for a τ that is not a number or a ``sampled`` that is not bool; ValueError for a bad
        budget or τ, an unknown rule, or a missing or misshaped ``sampled``.
    """
    rem = _budgets(remaining, allow_zero=True)
    tau = _threshold(threshold)
    mask = _sampled(sampled, rule, rem.shape[0])
    pay = np.minimum(rem, tau)
    if mask is None:
        return np.maximum(rem - pay, 0.0)
    return np.maximum(rem - np.where(mask, pay, 0.0), 0.0)


def charge_delta(spent_delta, remaining, threshold, delta, sampled=None, rule="all") -> np.ndarray:
    """δ_i spent after the round: + π_i·δ for records below τ, + δ for the others.

    Records with nothing left pay nothing; with rule "sampled" only sampled records pay. After k
    rounds δ_i ≤ k·δ.

    Args:
        spent_delta: δ_i spent so far, finite and ≥ 0: a number or (N,).
        remaining: (N,) remaining ε_i ≥ 0 before the round (any shape; flattened).
        threshold: τ > 0 of the round (ε units).
        delta: δ in (0, 1) of the round.
        sampled: (N,) bool, which records were sampled (as in ``charge``: needed by rule "sampled",
            checked but not used under rule "all").
        rule: "all" or "sampled" (as in ``charge``).
    Returns:
        (N,) float64 δ_i spent after the round, a new array.
    Raises:
        TypeError for a spent_delta or τ that is not numbers (a bool, a string) or a ``sampled`` that is
        not bool; ValueError for a bad budget, τ or δ, a spent_delta that is negative, not finite or
        of another length than the records, an unknown rule, or a missing or misshaped ``sampled``.
    """
    rem = _budgets(remaining, allow_zero=True)
    given = as_float_array("spent_delta", spent_delta)
    if given.ndim > 1 or (given.ndim == 1 and given.shape != rem.shape):   # (1,) is not "every record" either
        raise ValueError(f"spent_delta must be a number or one δ_i per record ({rem.shape[0]},), got shape "
                         f"{given.shape}")
    if not np.all(np.isfinite(given) & (given >= 0)):   # NaN or −1 would make every δ_i meaningless
        raise ValueError("spent_delta must be finite and >= 0")
    d = check_delta("delta", delta)
    tau = _threshold(threshold)
    mask = _sampled(sampled, rule, rem.shape[0])
    pi = sampling_probabilities(rem, tau)
    pay = np.where(rem > 0, np.where(rem < tau, pi, 1.0) * d, 0.0)
    if mask is not None:
        pay = np.where(mask, pay, 0.0)
    return given + pay


def meetable_round(remaining, plan_for):
    """Plan a round, leaving out the budgets that no round can meet.

    A remaining budget at or below a threshold τ that no noise multiplier meets over a round (a
    leftover sliver after earlier rounds, or a tiny budget) cannot be spent: such records take no
    further part, as if exhausted (they keep what is left, charged nothing more), and the round is
    planned again on the others.

    Args:
        remaining: (N,) remaining ε_i ≥ 0.
        plan_for: ``plan_for(remaining) -> RoundPlan`` (``round_plan`` with the round's settings),
            raising :class:`UnmeetableThreshold`.
    Returns:
        (plan, left_out): the round's plan, or None when no record can take part any more, and (N,)
        bool, the records left out here for a budget no round can meet.
    """
    rem = np.asarray(remaining, dtype=np.float64).copy()
    left_out = np.zeros(rem.shape, dtype=bool)
    while np.any(rem > 0):
        try:
            return plan_for(rem), left_out
        except UnmeetableThreshold as err:
            out = (rem > 0) & (rem <= err.threshold)
            left_out |= out
            rem[out] = 0.0
    return None, left_out


def schedule(budgets, rounds, *, delta, steps_per_round, sample_rate, loss="fixed", w1=0.7, w2=0.3,
             orders=None) -> list:
    """All rounds of PDP-SGD under rule "all" (data-independent, so plannable up front).

    With rounds = 1 this is the "DP-SGD + Sampling" baseline. A budget (or what is left of it) that no
    round can meet is left out (``meetable_round``): its record takes no further part.

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
        plan, left_out = meetable_round(rem, lambda r: round_plan(
            r, delta=delta, steps=steps_per_round, sample_rate=sample_rate, loss=loss, w1=w1, w2=w2, orders=orders))
        if plan is None:
            break
        plans.append(plan)
        rem = charge(np.where(left_out, 0.0, rem), plan.threshold)
    return plans
