"""Noise schedules σ_t = σ₀·h(t) and their exact RDP accounting and calibration.

A schedule is a shape h(t) > 0 over the steps t = 0..T−1 (the decays listed by Monir, Fauzan &
Ghinita's review of adaptive DP-SGD: time-based, exponential, step, polynomial; or a user
function); σ₀ is the scale that calibration finds from the budgets. Record i is then accounted
at (q_i, z_i·h(t)) in step t, with z_i = σ₀C/c_i its base effective multiplier, and its RDP is
the sum over the steps (RDP composes step by step, Mironov 2017, Prop. 1):

    ρ_i(α) = Σ_t ρ_SGM(α; q_i, z_i·h(t)).

Numbers in, numbers out, like ``rdp``: the per-record ledger (``IndividualAccountant``) replays the
same sum one step at a time, and the engine sets each step's multipliers from ``h``.

Calibration (``calibrate_scheduled``) solves the methods of ``calibration.rdp`` with the scheduled
composition in place of T equal steps, on the distinct budgets:

* Scale: per budget the smallest base multiplier ζ_p meeting ε_p at rate q; σ₀ = (mean_i 1/ζ_{p(i)})^{-1};
  c_p = σ₀C/ζ_p.
* Sample: one σ₀; per budget the largest rate meeting ε_p under σ₀·h; σ₀ is the root of
  mean_i q_i(σ₀) = q.
* Hybrid: Sample's rates moved towards q by λ (as in ``calibration.rdp``), then ζ_p per budget, as Scale.

Roots are found by bisection in log space that always keeps the side whose accounted ε is within
the budget, over a window of orders that follows each budget's optimum (a window can only
overstate ε); the reported ε is then recomputed over all orders.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import optimize

from .._checks import as_float_array, check_delta, check_epsilons, check_number, check_positive_integer, check_rate
from . import _grid
from .calibration.problem import MEAN_SLACK, hybrid_weight_of, renormalize_capped, spread_message, warn_rarely_drawn
from .plan import PrivacyPlan
from .sgm import DEFAULT_ORDERS, as_orders, eps_from_rdp, rdp_one_step

__all__ = ["NoiseSchedule", "ConstantNoise", "TimeDecay", "ExponentialDecay", "StepDecay", "PolynomialDecay",
           "FunctionSchedule", "ScheduledPlan", "as_schedule", "scheduled_rdp", "scheduled_epsilons",
           "calibrate_scheduled"]

_BISECT_ITERS = 44      # log-space bisection: 2^-44 of a log range of ≤ 40 is ~2e-12 relative
_WINDOW = 8             # orders either side of the last optimum in the solvers' window


def _check_number(name: str, value, *, low=None, low_inclusive=True, high=None) -> float:
    v = check_number(name, value)  # not a bool, nor a string float() would read
    if not math.isfinite(v) or (low is not None and (v < low or (v == low and not low_inclusive))) or (
            high is not None and v > high):
        bound = "" if low is None else (f" {'≥' if low_inclusive else '>'} {low:g}")
        bound += "" if high is None else f" and ≤ {high:g}"
        raise ValueError(f"{name} must be a finite number{bound}, got {value!r}")
    return v


# ----------------------------------------------------------------------------------------------
# Schedules
# ----------------------------------------------------------------------------------------------
class NoiseSchedule:
    """The shape h(t) of σ_t = σ₀·h(t). Subclasses define ``factor(t)`` on an int array of steps."""

    def factor(self, t: np.ndarray) -> np.ndarray:
        """The shape h(t) at steps t (each subclass implements it; ``factors`` checks the result).

        Args:
            t: (T,) int64 step indices (0-based).
        Returns:
            (T,) float64 h(t), expected finite and > 0.
        Raises:
            NotImplementedError here.
        """
        raise NotImplementedError

    def factors(self, steps: int) -> np.ndarray:
        """h(0..steps−1), checked.

        Args:
            steps: T, the number of steps (positive int).
        Returns:
            (steps,) float64 h(t), each finite and > 0.
        Raises:
            ValueError for steps not a positive integer, a result of another shape, or a factor that is
            not finite and > 0 (naming the first such step).
        """
        steps = check_positive_integer("steps", steps)
        h = np.asarray(self.factor(np.arange(steps, dtype=np.int64)), dtype=np.float64)
        if h.shape != (steps,):
            raise ValueError(f"{self!r}: the schedule must give one factor per step, got shape {h.shape}")
        bad = ~np.isfinite(h) | (h <= 0)
        if bad.any():
            t = int(np.flatnonzero(bad)[0])
            raise ValueError(f"{self!r}: the noise factor must be finite and > 0 at every step; "
                             f"step {t} gives {h[t]!r}")
        return h

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class ConstantNoise(NoiseSchedule):
    """h(t) = 1: the fixed σ of plain DP-SGD."""

    def factor(self, t):
        """h(t) = 1.

        Args:
            t: (T,) int64 step indices (0-based).
        Returns:
            (T,) float64 h(t).
        """
        return np.ones(t.shape[0])


class TimeDecay(NoiseSchedule):
    """Time-based decay h(t) = 1/(1 + k·t), k ≥ 0."""

    def __init__(self, k: float):
        self.k = _check_number("k", k, low=0.0)

    def factor(self, t):
        """h(t) = 1/(1 + k·t).

        Args:
            t: (T,) int64 step indices (0-based).
        Returns:
            (T,) float64 h(t).
        """
        return 1.0 / (1.0 + self.k * t)


class ExponentialDecay(NoiseSchedule):
    """Exponential decay h(t) = exp(−k·t), k ≥ 0."""

    def __init__(self, k: float):
        self.k = _check_number("k", k, low=0.0)

    def factor(self, t):
        """h(t) = exp(−k·t).

        Args:
            t: (T,) int64 step indices (0-based).
        Returns:
            (T,) float64 h(t).
        """
        return np.exp(-self.k * t)


class StepDecay(NoiseSchedule):
    """Step decay h(t) = k^⌊t/period⌋: the noise is multiplied by k every ``period`` steps (0 < k)."""

    def __init__(self, k: float, period: int):
        self.k = _check_number("k", k, low=0.0, low_inclusive=False)
        self.period = check_positive_integer("period", period)

    def factor(self, t):
        """h(t) = k^⌊t/period⌋.

        Args:
            t: (T,) int64 step indices (0-based).
        Returns:
            (T,) float64 h(t).
        """
        return self.k ** (t // self.period).astype(np.float64)


class PolynomialDecay(NoiseSchedule):
    """Polynomial decay h(t) = (1 − r)(1 − min(t, period)/period)^k + r, from 1 to r = σ_end/σ₀.

    The end is given as the fraction ``end_fraction`` r ∈ (0, 1] of σ₀ (not as an absolute σ_end)
    so that the shape does not depend on the scale calibration finds."""

    def __init__(self, period: int, power: float = 1.0, end_fraction: float = 0.5):
        self.period = check_positive_integer("period", period)
        self.power = _check_number("power", power, low=0.0, low_inclusive=False)
        self.end_fraction = _check_number("end_fraction", end_fraction, low=0.0, low_inclusive=False, high=1.0)

    def factor(self, t):
        """h(t) = (1 − r)(1 − min(t, period)/period)^power + r.

        Args:
            t: (T,) int64 step indices (0-based).
        Returns:
            (T,) float64 h(t).
        """
        r = self.end_fraction
        return (1.0 - r) * (1.0 - np.minimum(t, self.period) / self.period) ** self.power + r


class FunctionSchedule(NoiseSchedule):
    """h(t) = fn(t) for a user function of the step index t (int) returning a number > 0."""

    def __init__(self, fn: Callable[[int], float]):
        if not callable(fn):
            raise TypeError(f"fn must be callable (step -> noise factor), got {type(fn).__name__}")
        self.fn = fn

    def factor(self, t):
        """h(t) = fn(t), one call per step.

        Args:
            t: (T,) int64 step indices (0-based).
        Returns:
            (T,) float64 h(t).
        Raises:
            TypeError naming ``noise_schedule`` and the step where fn returns something other than a
            number (an array, None, a string).
        """
        return np.array([check_number(f"noise_schedule({int(s)})", self.fn(int(s))) for s in t], dtype=np.float64)


_BY_NAME = {"constant": ConstantNoise, "time": TimeDecay, "exponential": ExponentialDecay, "step": StepDecay,
            "polynomial": PolynomialDecay}


def as_schedule(schedule) -> NoiseSchedule:
    """A ``NoiseSchedule`` from one, a callable h(t), or a spec string.

    Args:
        schedule: a :class:`NoiseSchedule` (returned as is); a callable step (int) -> factor > 0
            (wrapped in :class:`FunctionSchedule`); or a spec string "name:arg,arg" whose arguments
            are the class's in order (e.g. "exponential:0.005", "step:0.7,50", "polynomial:200,2,0.4",
            "time:0.01", "constant").
    Returns:
        the :class:`NoiseSchedule`.
    Raises:
        ValueError for an unknown name or bad arguments in a spec string; TypeError for anything else.
    """
    if isinstance(schedule, NoiseSchedule):
        return schedule
    if isinstance(schedule, str):
        name, _, args = schedule.partition(":")
        if name not in _BY_NAME:
            raise ValueError(f"noise_schedule: unknown schedule {name!r}; choose from {sorted(_BY_NAME)}")
        try:  # the spec's numbers as floats: a period checks as a positive integer (50.0, not 50.9)
            values = [float(a) for a in args.split(",") if a.strip()]
            return _BY_NAME[name](*values)
        except (TypeError, ValueError) as err:
            raise ValueError(f"noise_schedule {schedule!r}: {err}") from None
    if callable(schedule):
        return FunctionSchedule(schedule)
    raise TypeError(f"noise_schedule must be a NoiseSchedule, a callable step -> factor or a spec string, "
                    f"got {type(schedule).__name__}")


# ----------------------------------------------------------------------------------------------
# Accounting
# ----------------------------------------------------------------------------------------------
def _distinct_factors(factors: np.ndarray):
    values, counts = np.unique(np.asarray(factors, dtype=np.float64), return_counts=True)
    return values, counts.astype(np.float64)


def _rdp_sum(q: np.ndarray, z0: np.ndarray, values: np.ndarray, counts: np.ndarray, orders: np.ndarray,
             mask: np.ndarray | None = None) -> np.ndarray:
    """(G, n) Σ_t ρ(α; q_g, z0_g·h_t), the steps given as distinct factors ``values`` with ``counts``.
    mask (G, n): orders to evaluate (+inf elsewhere)."""
    g, u = q.shape[0], values.shape[0]
    qq = np.repeat(q, u)
    zz = (z0[:, None] * values[None, :]).ravel()
    m = None if mask is None else np.repeat(mask, u, axis=0)
    rdp = rdp_one_step(qq, zz, orders, m).reshape(g, u, orders.shape[0])
    with np.errstate(invalid="ignore"):
        return np.einsum("gun,u->gn", rdp, counts)


def scheduled_rdp(sample_rates, noise_multipliers, factors, orders=DEFAULT_ORDERS) -> np.ndarray:
    """RDP of a run whose step t is the Poisson-subsampled Gaussian at (q, z·h(t)): Σ_t ρ(α; q, z·h(t)).

    Args:
        sample_rates: (G,) Poisson rates q in [0, 1].
        noise_multipliers: (G,) base multipliers z ≥ 0 (noise std / clip norm), broadcast with q.
        factors: (T,) h(t) > 0, one per step.
        orders: RDP orders α > 1 (default ``DEFAULT_ORDERS``).
    Returns:
        (G, len(orders)) float64 RDP of the whole run.
    Raises:
        ValueError for a rate outside [0, 1], a multiplier < 0, bad factors or an order ≤ 1.
    """
    q, z = (np.atleast_1d(as_float_array(name, v)) for name, v in (("sample_rates", sample_rates),
                                                                   ("noise_multipliers", noise_multipliers)))
    if q.ndim != 1 or z.ndim != 1 or (q.shape != z.shape and 1 not in (q.size, z.size)):
        raise ValueError(f"sample_rates and noise_multipliers must be 1-D of one length (or one a scalar), got "
                         f"shapes {q.shape} and {z.shape}")
    q, z = np.broadcast_arrays(q, z)
    if np.any(~np.isfinite(q)) or np.any((q < 0) | (q > 1)):
        raise ValueError("sample_rates must lie in [0, 1]")
    if np.any(np.isnan(z)) or np.any(z < 0):
        raise ValueError("noise_multipliers must be >= 0")
    h = np.asarray(factors, dtype=np.float64)
    if h.ndim != 1 or h.size == 0 or np.any(~np.isfinite(h)) or np.any(h <= 0):
        raise ValueError("factors must be a non-empty 1-D array of finite numbers > 0")
    orders_arr = as_orders(orders)[0]
    values, counts = _distinct_factors(h)
    return _rdp_sum(q.copy(), z.copy(), values, counts, orders_arr)


def scheduled_epsilons(sample_rates, noise_multipliers, factors, delta, orders=DEFAULT_ORDERS) -> np.ndarray:
    """ε(δ) of ``scheduled_rdp`` (the conversion of ``get_privacy_spent``, clamped at 0).

    Args:
        sample_rates, noise_multipliers, factors, orders: as in ``scheduled_rdp``.
        delta: δ in (0, 1).
    Returns:
        (G,) float64 ε ≥ 0.
    Raises:
        ValueError as ``scheduled_rdp``, or for δ outside (0, 1).
    """
    orders_arr = as_orders(orders)[0]
    rdp = scheduled_rdp(sample_rates, noise_multipliers, factors, orders_arr)
    return np.maximum(eps_from_rdp(orders_arr, rdp, check_delta("delta", delta))[0], 0.0)


# ----------------------------------------------------------------------------------------------
# Solvers on the distinct budgets
# ----------------------------------------------------------------------------------------------
class _Scheduled:
    """ε of groups (q_g, z_g·h), over a window of orders that follows each group's optimum."""

    def __init__(self, factors, delta, orders):
        self.values, self.counts = _distinct_factors(factors)
        self.delta, self.orders = delta, orders
        self.center: np.ndarray | None = None

    def _mask(self, g: int) -> np.ndarray | None:
        if self.center is None or self.center.shape[0] != g:
            return None
        cols = np.arange(self.orders.shape[0])
        return np.abs(cols[None, :] - self.center[:, None]) <= _WINDOW

    def eps(self, q, z, *, exact: bool = False):
        """(ε (G,), optimal order index (G,)); ``exact``: over all orders."""
        g = q.shape[0]
        mask = None if exact else self._mask(g)
        rdp = _rdp_sum(q, z, self.values, self.counts, self.orders, mask)
        eps, idx = eps_from_rdp(self.orders, rdp, self.delta)
        center = self.center
        for _ in range(self.orders.shape[0] // _WINDOW + 1):
            if mask is None:
                break
            # an optimum on the window's edge may lie beyond it: move those groups' windows there
            edge = (np.abs(idx - center) >= _WINDOW) & (idx > 0) & (idx < self.orders.shape[0] - 1)
            if not edge.any():
                break
            rows = np.flatnonzero(edge)
            center = center.copy()
            center[rows] = idx[rows]
            cols = np.arange(self.orders.shape[0])
            sub = np.abs(cols[None, :] - center[rows, None]) <= _WINDOW
            e2, i2 = eps_from_rdp(self.orders, _rdp_sum(q[rows], z[rows], self.values, self.counts, self.orders,
                                                         sub), self.delta)
            eps[rows], idx[rows] = np.minimum(eps[rows], e2), np.where(e2 < eps[rows], i2, idx[rows])
        self.center = idx.copy()
        return np.maximum(eps, 0.0), idx


def _bisect(evaluate, lo, hi, targets, increasing: bool, iters: int = _BISECT_ITERS):
    """Per group, the end of [lo, hi] on the safe side of ε(x) = target: the largest safe x when ε
    increases in x, the smallest when it decreases. ``lo``/``hi`` must be safe / unsafe
    (increasing) or unsafe / safe (decreasing).

    Regula falsi in (log x, log ε) with the Illinois modification (log ε is smooth in log x, so a
    handful of steps suffice), every few steps a plain bisection to guarantee progress; stops when
    the safe end is within 1e-9 of the target or the bracket is 1e-12 wide."""
    limit = targets * (1.0 - _grid.MARGIN)
    log_t = np.log(limit)
    safe_x, unsafe_x = (np.log(lo), np.log(hi)) if increasing else (np.log(hi), np.log(lo))
    safe_f = np.log(np.maximum(evaluate(np.exp(safe_x))[0], 1e-300)) - log_t       # ≤ 0
    unsafe_f = np.log(np.maximum(evaluate(np.exp(unsafe_x))[0], 1e-300)) - log_t   # > 0 (or 0)
    side = np.zeros(lo.shape[0], dtype=np.int8)   # which end moved last (Illinois halving)
    for it in range(4 * iters):
        done = (safe_f >= np.log1p(-1e-9)) | (np.abs(unsafe_x - safe_x) <= 1e-12)
        if done.all():
            break
        denom = unsafe_f - safe_f
        with np.errstate(invalid="ignore", divide="ignore"):
            x = safe_x - safe_f * (unsafe_x - safe_x) / denom
        ok_x = np.isfinite(x) & (np.minimum(safe_x, unsafe_x) < x) & (x < np.maximum(safe_x, unsafe_x))
        if it % 4 == 3:
            ok_x[:] = False
        x = np.where(ok_x, x, 0.5 * (safe_x + unsafe_x))
        x = np.where(done, safe_x, x)
        f = np.log(np.maximum(evaluate(np.exp(x))[0], 1e-300)) - log_t
        good = (f <= 0) & ~done
        bad = (f > 0) & ~done
        # Illinois: an end kept twice in a row has its function value halved
        unsafe_f = np.where(good & (side == 1), unsafe_f * 0.5, unsafe_f)
        safe_f = np.where(bad & (side == -1), safe_f * 0.5, safe_f)
        safe_x, safe_f = np.where(good, x, safe_x), np.where(good, f, safe_f)
        unsafe_x, unsafe_f = np.where(bad, x, unsafe_x), np.where(bad, f, unsafe_f)
        side = np.where(good, 1, np.where(bad, -1, side)).astype(np.int8)
    # halved values are surrogates: the safe end itself was accounted (ε ≤ limit) when it was set
    return np.exp(safe_x)


def _solve_noise(s: _Scheduled, rates, targets, method: str):
    """(G,) smallest base multipliers with scheduled ε ≤ target at ``rates``."""
    limit = targets * (1.0 - _grid.MARGIN)
    hi, lo = np.full(rates.shape[0], 1.0), np.full(rates.shape[0], np.nan)
    for _ in range(60):                       # bracket: lo unsafe, hi safe, a factor 4 apart
        ok = s.eps(rates, hi)[0] <= limit
        lo = np.where(ok & np.isnan(lo), hi / 4.0, np.where(ok, lo, hi))
        hi = np.where(ok, hi, hi * 4.0)
        if ok.all():
            break
    else:
        raise ValueError(f"IDP-{method} with a noise schedule: budget epsilon={targets[~ok][0]:.6g} is not met "
                         f"even at base noise multiplier {hi.max():.3g}")
    for _ in range(60):                       # lo must be unsafe (or at the floor, where ε is huge anyway)
        low_ok = (s.eps(rates, lo)[0] <= limit) & (lo > _grid.Z_FLOOR)
        if not low_ok.any():
            break
        hi, lo = np.where(low_ok, lo, hi), np.where(low_ok, np.maximum(lo / 4.0, _grid.Z_FLOOR), lo)
    return _bisect(lambda z: s.eps(rates, z), lo, hi, targets, increasing=False)


def _solve_rates(s: _Scheduled, sigma0: float, targets, method: str, guess=None):
    """(G,) largest rates ≤ 1 with scheduled ε ≤ target under base multiplier σ₀ (``guess``: rates
    near the answer, e.g. of a nearby σ₀, to start from a narrow bracket)."""
    g = targets.shape[0]
    z = np.full(g, sigma0)
    limit = targets * (1.0 - _grid.MARGIN)
    start = np.full(g, 0.1) if guess is None else np.clip(guess, _grid.Q_FLOOR, 1.0)
    lo, hi = np.maximum(start / 1.25, _grid.Q_FLOOR), np.minimum(start * 1.25, 1.0)
    for _ in range(60):                       # bracket: lo safe, hi unsafe or 1
        lo_bad = s.eps(lo, z)[0] > limit
        if np.any(lo_bad & (lo <= _grid.Q_FLOOR)):
            bad = targets[lo_bad & (lo <= _grid.Q_FLOOR)][0]
            raise ValueError(f"budget epsilon={bad:.6g} cannot be met by IDP-{method} with this noise schedule at "
                             f"base noise_multiplier={sigma0:.6g}, even at sample rate {_grid.Q_FLOOR:g}")
        hi_ok = (s.eps(hi, z)[0] <= limit) & (hi < 1.0)
        if not lo_bad.any() and not hi_ok.any():
            break
        # an unsafe lo becomes hi and moves down; a safe hi becomes lo and moves up
        lo, hi = (np.where(lo_bad, np.maximum(lo / 4.0, _grid.Q_FLOOR), np.where(hi_ok, hi, lo)),
                  np.where(lo_bad, lo, np.where(hi_ok, np.minimum(hi * 4.0, 1.0), hi)))
    full = (hi >= 1.0) & (s.eps(np.ones(g), z)[0] <= limit)
    rates = _bisect(lambda r: s.eps(r, z), lo, hi, targets, increasing=True,
                    iters=_iters(np.max(np.log(hi / lo))))
    return np.where(full, 1.0, rates)


def _iters(log_range: float) -> int:
    """Bisection steps that shrink a log-space bracket of width ``log_range`` to 1e-11."""
    return int(np.clip(np.ceil(np.log2(max(log_range, 1e-11) / 1e-11)), 1, _BISECT_ITERS))


def _sample(s: _Scheduled, values, counts, q, method="Sample"):
    """(σ₀, rates (U,)) with mean rate q under σ₀·h (rates rounded down, then the uncapped ones
    scaled so the mean is exactly q where it came out above)."""
    n = counts.sum()
    ends = _solve_noise(s, np.full(2, q), values[[0, -1]], method)
    sigma_hi, sigma_lo = float(ends[0]), float(ends[1])
    if values.shape[0] == 1 or q == 1.0 or sigma_hi <= sigma_lo:
        return sigma_hi, np.full(values.shape[0], q)

    last = {}

    def mean_gap(log_sigma):
        rates = last["rates"] = _solve_rates(s, float(np.exp(log_sigma)), values, method, last.get("rates"))
        return float(np.log(np.dot(counts, rates) / n) - np.log(q))

    # below σ_f the smallest budget's rate would fall under the floor: the root lies above it, or
    # (when the mean rate there is already above q) nowhere
    sigma_f = float(_solve_noise(s, np.array([_grid.Q_FLOOR]), values[:1], method)[0]) * (1.0 + 1e-9)
    if sigma_f > sigma_lo:
        sigma_lo = sigma_f
        mean_f = float(np.dot(counts, _solve_rates(s, sigma_f, values, method)) / n)
        if mean_f > q * (1.0 + MEAN_SLACK):
            raise ValueError(spread_message(
                method, float(values[0]), values, q, sigma_f, f"below it this budget would need a sample rate "
                f"below {_grid.Q_FLOOR:g}, and there the mean rate is already {mean_f:.4g}",
                steps=int(s.counts.sum()), delta=s.delta) + " (noise_multiplier is the schedule's base)")
    a, b = np.log(sigma_lo), np.log(sigma_hi)
    fa, fb = mean_gap(a), mean_gap(b)
    if fa >= 0:
        root = a
    elif fb <= 0:
        root = b
    else:
        root = optimize.brentq(mean_gap, a, b, xtol=1e-10, rtol=1e-12)
    sigma = float(np.exp(root))
    rates = _solve_rates(s, sigma, values, method, last.get("rates"))
    mean = float(np.dot(counts, rates) / n)
    if mean > q:
        rates = np.minimum(rates, renormalize_capped(rates, counts, q))   # only ever lowered
    return sigma, rates


@dataclass(eq=False)
class ScheduledPlan(PrivacyPlan):
    """A ``PrivacyPlan`` whose noise follows σ_t = σ₀·h(t): ``noise_multiplier`` is σ₀.

    Record i's multiplier in step t is ``noise_multipliers[i] * noise_factors[t]``; ``epsilons()``
    accounts that whole sequence. Its other fields are :class:`PrivacyPlan`'s.

    Attributes:
        noise_factors: (steps,) float64 h(t) > 0 (required: a constant noise is a ``PrivacyPlan``).
        schedule_name: the schedule's repr (str).
    """

    noise_factors: np.ndarray | None = None
    schedule_name: str = ""

    def __post_init__(self):
        super().__post_init__()
        if self.noise_factors is None:
            raise ValueError("plan: a ScheduledPlan needs noise_factors (one h(t) per step); a plan with a constant "
                             "noise is a PrivacyPlan")
        h = self.noise_factors = np.asarray(self.noise_factors, dtype=np.float64)
        if h.shape != (self.steps,) or not (np.isfinite(h).all() and (h > 0).all()):
            raise ValueError(f"plan: noise_factors must be {self.steps} finite values > 0 (one per step), got "
                             f"shape {h.shape}")

    def noise_multiplier_at(self, step: int) -> float:
        """σ_t = σ₀·h(t) of step t (the base multiplier; record i's is ``noise_multipliers[i]·h(t)``).

        Args:
            step: t, the step index (0-based int, < steps).
        Returns:
            σ_t, a float (noise std / C).
        """
        return float(self.noise_multiplier * self.noise_factors[step])

    def summary(self, max_rows: int = 20) -> str:
        """``PrivacyPlan.summary`` plus a line on the noise schedule (h at the first and last step).

        Args:
            max_rows: most group rows shown (as ``PrivacyPlan.summary``).
        Returns:
            the table, a str.
        """
        h = self.noise_factors
        return (super().summary(max_rows) + f"\n  noise schedule {self.schedule_name}: sigma_t = sigma0 * h(t), "
                f"h from {h[0]:.4g} (t=0) to {h[-1]:.4g} (t={h.shape[0] - 1})")

    def to_dict(self) -> dict:
        """``PrivacyPlan.to_dict`` plus the schedule.

        Returns:
            a JSON-able dict, with "noise_factors" (a list) and "schedule" (the name) added.
        """
        return super().to_dict() | {"noise_factors": self.noise_factors.tolist(), "schedule": self.schedule_name}

    @classmethod
    def from_dict(cls, d: dict) -> ScheduledPlan:
        """The plan ``to_dict`` wrote.

        Args:
            d: a dict as ``to_dict`` returns it.
        Returns:
            the :class:`ScheduledPlan`.
        Raises:
            as ``PrivacyPlan.from_dict``; ValueError for a dict without "noise_factors".
        """
        base = PrivacyPlan._read(d)
        if d.get("noise_factors") is None:
            raise ValueError("plan: this dict has no noise_factors; a plan with a constant noise is read with "
                             "PrivacyPlan.from_dict")
        fields = {k: getattr(base, k) for k in ("method", "accountant", "noise_multiplier", "max_grad_norm", "steps",
                                                 "delta", "budget_values", "group_index", "group_sizes",
                                                 "group_sample_rates", "group_clip_norms", "group_epsilons",
                                                 "orders", "group_orders")}
        plan = cls(**fields, noise_factors=d["noise_factors"], schedule_name=d.get("schedule", ""))
        plan._reaccount()
        return plan

    def _group_epsilons_again(self) -> np.ndarray:
        """(G,) each group's ε accounted again over the whole schedule, as calibration certified it."""
        scheduled = _Scheduled(self.noise_factors, self.delta, as_orders(self.orders or DEFAULT_ORDERS)[0])
        return scheduled.eps(self.group_sample_rates, self.group_noise_multipliers, exact=True)[0]


def calibrate_scheduled(budgets, *, delta, steps, sample_rate, noise_schedule, method="sample", max_grad_norm=1.0,
                        hybrid_weight=None, orders=None) -> ScheduledPlan:
    """Calibrate per-record (q_i, c_i) and the scale σ₀ of a noise schedule from budgets.

    Cost grows with the number of distinct budgets times distinct factors h(t); it is meant for
    group budgets (a few to a few hundred distinct values).

    Args:
        budgets: (N,) ε_i > 0.
        delta: δ in (0, 1).
        steps: T, the number of steps (positive int).
        sample_rate: the target mean Poisson rate q in (0, 1].
        noise_schedule: a ``NoiseSchedule``, callable h(t) or spec string (``as_schedule``).
        method: "sample" | "scale" | "hybrid".
        max_grad_norm: the reference clip norm C > 0.
        hybrid_weight: λ in [0, 1] ("hybrid" only, refused with the others; 0 = Scale; None: 0.5).
        orders: RDP orders α > 1 (default ``DEFAULT_ORDERS``).
    Returns:
        ScheduledPlan (accountant "rdp") whose ``epsilons()`` are the exact scheduled RDP
        accounting of every record, ≤ its budget.
    Raises:
        ValueError / TypeError naming a bad argument; ValueError naming a budget that cannot be met;
        RuntimeError (an internal error) if a certified ε exceeded its budget.
    """

    schedule = as_schedule(noise_schedule)
    arr = check_epsilons("budgets", budgets)
    if arr.ndim != 1:
        raise ValueError(f"budgets must be 1-D (one epsilon per record), got shape {arr.shape}")
    delta = check_delta("delta", delta)
    steps = check_positive_integer("steps", steps)
    q = check_rate("sample_rate", sample_rate)
    c = _check_number("max_grad_norm", max_grad_norm, low=0.0, low_inclusive=False)
    if method not in ("sample", "scale", "hybrid"):
        raise ValueError(f"method must be one of ['hybrid', 'sample', 'scale'], got {method!r}")
    lam = _check_number("hybrid_weight", hybrid_weight_of(method, hybrid_weight), low=0.0, high=1.0)
    orders_arr = as_orders(DEFAULT_ORDERS if orders is None else orders)[0]
    factors = schedule.factors(steps)
    values, inverse, counts = np.unique(arr, return_inverse=True, return_counts=True)
    s = _Scheduled(factors, delta, orders_arr)
    name = method.capitalize()
    if method == "scale" or (method == "hybrid" and lam == 0.0):
        rates = np.full(values.shape[0], q)
        zeta = _solve_noise(s, rates, values, name)
    elif method == "sample":
        sigma0, rates = _sample(s, values, counts, q)
        zeta = np.full(values.shape[0], sigma0)
    else:
        _, rates_s = _sample(s, values, counts, q, "hybrid")
        rates = renormalize_capped(q * (rates_s / q) ** lam, counts, q)
        zeta = _solve_noise(s, rates, values, "hybrid")
    sigma0 = float(np.sum(counts) / np.dot(counts, 1.0 / zeta))
    clip = sigma0 * c / zeta
    eps, idx = s.eps(rates, zeta, exact=True)
    if np.any(eps > values):      # the solvers keep the safe side: never pass silently
        raise RuntimeError("internal error: a scheduled plan's certified epsilon exceeds its budget")
    warn_rarely_drawn(values, counts, rates, steps)
    return ScheduledPlan(method=method, accountant="rdp", noise_multiplier=sigma0, max_grad_norm=c, steps=steps,
                         delta=delta, budget_values=values, group_index=inverse, group_sizes=counts,
                         group_sample_rates=rates, group_clip_norms=clip, group_epsilons=eps,
                         orders=tuple(float(o) for o in orders_arr), group_orders=orders_arr[idx],
                         noise_factors=factors, schedule_name=repr(schedule))
