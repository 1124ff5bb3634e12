"""Tighter accounting through privacy loss distributions (Google's ``dp_accounting``): ε of
Poisson-subsampled Gaussian runs and its inversions, numbers in, numbers out.

One PLD is built per distinct (q, z) pair (``PoissonSampledDpEvent(q, GaussianDpEvent(z))``
self-composed T times, pessimistic discretization, so ε is an upper bound). That costs ~0.1 s per
pair, so PLD accounting is offered where the number of distinct pairs is small (≤ ``MAX_PAIRS``).
The inversions (``pld_noise_multiplier``, ``pld_sample_rate``) are scalar root-finding started from
the RDP answer (RDP ε ≥ PLD ε, so an RDP-feasible parameter is always a PLD-feasible starting
point); the ``_from`` variants take the start, as calibration under PLD does
(``calibration.pld``, which builds on this module and is never imported by it).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from .._checks import (
    as_float_array,
    check_delta,
    check_in_range,
    check_int,
    check_nonnegative,
    check_number,
    check_positive,
    check_positive_integer,
    check_rate,
)
from . import _grid
from .roots import illinois
from .sgm import DEFAULT_ORDERS, distinct_rows

__all__ = ["MAX_PAIRS", "VALUE_DISCRETIZATION", "check_discretization", "pld_epsilon", "pld_epsilon_composed",
           "epsilons", "pld_noise_multiplier", "pld_noise_multiplier_from", "pld_sample_rate", "pld_sample_rate_from"]

MAX_PAIRS = 64                  # most distinct (q, z) pairs accounted (one PLD each)
VALUE_DISCRETIZATION = 1e-3     # dp_accounting's default is 1e-4: ~8x slower, ε lower by ~1e-4
_RTOL = 2e-4                    # root-finding stops once ε is within this of the target (safe side)


def check_discretization(value) -> float:
    """Check a PLD's value_discretization_interval.

    Args:
        value: the interval, a finite number > 0 (not a bool or a string).
    Returns:
        float(value).
    Raises:
        TypeError if not a number; ValueError if not finite and > 0.
    """
    return check_positive("value_discretization_interval", value)


def _rate(name: str, value) -> float:
    """A Poisson rate q in [0, 1] (0: nothing spent), not a bool or a string."""
    return check_in_range(name, value, low=0.0, high=1.0, low_open=False)


def _count(name: str, value) -> int:
    """A step count ≥ 0 of a history entry: a whole number (2.5 would be truncated to 2)."""
    v = check_number(name, value)
    if not (math.isfinite(v) and v.is_integer() and v >= 0):
        raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
    return int(v)


def _pld_epsilon_checked(q: float, z: float, steps: int, delta: float, vdi: float) -> float:
    try:
        return _pld_epsilon_cached(q, z, steps, delta, vdi)
    except OverflowError:   # dp_accounting's discretization overflows for an interval ≳ 1e3
        raise ValueError(f"value_discretization_interval={vdi:g} is too coarse for this PLD (overflow); use a "
                         f"small interval such as {VALUE_DISCRETIZATION:g}") from None


@functools.lru_cache(maxsize=8192)
def _pld_epsilon_cached(q: float, z: float, steps: int, delta: float, vdi: float) -> float:
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    if q == 0.0:
        return 0.0
    if z == 0.0:
        return math.inf
    gaussian = dp_accounting.GaussianDpEvent(z)
    event = gaussian if q == 1.0 else dp_accounting.PoissonSampledDpEvent(q, gaussian)
    accountant = PLDAccountant(value_discretization_interval=vdi)
    accountant.compose(event, steps)
    return float(accountant.get_epsilon(delta))


def pld_epsilon(q: float, z: float, steps: int, delta: float, value_discretization_interval=VALUE_DISCRETIZATION):
    """ε(δ) of T steps of the Poisson-subsampled Gaussian by PLD (cached per argument tuple).

    Args:
        q: Poisson rate in [0, 1] (0: ε = 0; 1: the Gaussian alone).
        z: noise multiplier, finite and ≥ 0 (noise std in units of the clip norm; 0: ε = inf).
        steps: T, a positive integer (2.9 is refused, not truncated to 2).
        delta: δ in (0, 1).
        value_discretization_interval: of the PLD, finite and > 0 (pessimistic, so ε is an upper bound).
    Returns:
        ε, a float.
    Raises:
        TypeError for an argument that is not a number (a bool or a string included); ValueError for
        one out of range, or an interval too coarse for dp_accounting.
    """
    return _pld_epsilon_checked(_rate("q", q), check_nonnegative("z", z), check_positive_integer("steps", steps),
                                check_delta("delta", delta), check_discretization(value_discretization_interval))


def pld_epsilon_composed(history, delta: float, value_discretization_interval=VALUE_DISCRETIZATION) -> float:
    """ε(δ) by PLD of a composition of Poisson-subsampled Gaussian runs.

    Args:
        history: (noise_multiplier, sample_rate, steps) entries, composed in order (an Opacus
            accountant's ``history``): noise_multiplier finite and ≥ 0, sample_rate in [0, 1], steps a
            whole number ≥ 0; entries with no steps or rate 0 add nothing.
        delta: δ in (0, 1).
        value_discretization_interval: of the PLD, finite and > 0 (pessimistic, so ε is an upper bound).
    Returns:
        ε, a float (0.0 for an empty history; one entry is ``pld_epsilon`` of it, cached).
    Raises:
        TypeError for an entry that is not three numbers, or a δ / interval that is not a number;
        ValueError for a value out of range (a negative or fractional step count included: −5 steps were
        dropped, 2.5 truncated to 2).
    """
    delta = check_delta("delta", delta)
    vdi = check_discretization(value_discretization_interval)
    entries = []
    for k, entry in enumerate(history):
        if not isinstance(entry, (tuple, list, np.ndarray)) or len(entry) != 3:
            raise TypeError(f"history[{k}] must be (noise_multiplier, sample_rate, steps), got {entry!r}")
        z = check_nonnegative(f"history[{k}] noise_multiplier", entry[0])
        q = _rate(f"history[{k}] sample_rate", entry[1])
        n = _count(f"history[{k}] steps", entry[2])
        if n > 0 and q > 0.0:
            entries.append((z, q, n))
    if not entries:
        return 0.0
    if len(entries) == 1:
        z, q, n = entries[0]
        return _pld_epsilon_checked(q, z, n, delta, vdi)
    if any(z == 0.0 for z, _, _ in entries):
        return math.inf
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    try:
        accountant = PLDAccountant(value_discretization_interval=vdi)
        for z, q, n in entries:
            gaussian = dp_accounting.GaussianDpEvent(z)
            accountant.compose(gaussian if q == 1.0 else dp_accounting.PoissonSampledDpEvent(q, gaussian), n)
        return float(accountant.get_epsilon(delta))
    except OverflowError:
        raise ValueError(f"value_discretization_interval={vdi:g} is too coarse for this PLD (overflow)") from None


def epsilons(sample_rates, noise_multipliers, steps, delta, max_pairs=MAX_PAIRS) -> np.ndarray:
    """PLD ε per record, computed once per distinct (q_i, z_i) pair.

    Args:
        sample_rates: Poisson rates q_i in [0, 1], usually (N,) (any shape).
        noise_multipliers: effective noise multipliers z_i, finite and ≥ 0, broadcast to ``sample_rates``.
        steps: T, a positive int.
        delta: δ in (0, 1).
        max_pairs: most distinct pairs accepted (each costs a PLD, ~0.1 s), an int ≥ 1.
    Returns:
        float64 ε with the shape of ``sample_rates``.
    Raises:
        TypeError for values that are not numbers; ValueError for one out of range, noise multipliers
        that do not broadcast to the rates, or more than ``max_pairs`` distinct pairs.
    """
    q = as_float_array("sample_rates", sample_rates)
    z = as_float_array("noise_multipliers", noise_multipliers)
    steps = check_positive_integer("steps", steps)
    delta = check_delta("delta", delta)
    max_pairs = check_int("max_pairs", max_pairs, 1)
    if not np.all(np.isfinite(q) & (q >= 0) & (q <= 1)):
        raise ValueError("sample_rates must lie in [0, 1]")
    if not np.all(np.isfinite(z) & (z >= 0)):
        raise ValueError("noise_multipliers must be finite and >= 0")
    try:
        z = np.broadcast_to(z, q.shape)
    except ValueError:
        raise ValueError(f"noise_multipliers (shape {z.shape}) must broadcast to sample_rates (shape {q.shape})"
                         ) from None
    qf, zf = q.ravel() + 0.0, z.ravel() + 0.0            # + 0.0: −0.0 and 0.0 are one value
    first, inverse = distinct_rows(qf, zf)
    if first.shape[0] > max_pairs:
        raise ValueError(f"PLD accounting supports at most {max_pairs} distinct (sample_rate, noise_multiplier) "
                         f"pairs, got {first.shape[0]}; use the RDP accountant")
    eps = np.array([_pld_epsilon_checked(float(a), float(b), steps, delta, VALUE_DISCRETIZATION)
                    for a, b in zip(qf[first], zf[first])])
    return eps[inverse].reshape(q.shape)


def _root(f, safe, unsafe, target, rtol=_RTOL, max_iter=60):
    """Illinois regula falsi (``roots.illinois``) in log-parameter space on a monotone f; ``safe``
    has f ≤ goal, ``unsafe`` f > goal. Returns (safe parameter, its f): always an evaluated point."""
    goal = target * (1.0 - _grid.MARGIN)
    fs, fu = f(safe), f(unsafe)
    best = [safe, fs]

    def residual(fx):
        return math.log(fx / goal) if fx > 0 else -50.0

    def step(x, _, __):
        px = math.exp(float(x[0]))
        fx = f(px)
        if fx <= goal:
            best[:] = [px, fx]
        return np.array([residual(fx)]), np.array([fx <= goal])

    def active(_, b):
        return np.array([not (best[1] >= goal * (1 - rtol) or abs(b.other[0] - b.kept[0]) < 1e-12)])

    illinois(step, math.log(safe), math.log(unsafe), residual(fs), math.log(fu / goal), active, max_iter)
    return best[0], best[1]


def pld_noise_multiplier(target_epsilon, delta, sample_rate, steps):
    """Smallest noise multiplier meeting a budget under PLD, searched from the RDP answer.

    Args:
        target_epsilon: the budget ε > 0 (float).
        delta: δ in (0, 1).
        sample_rate: Poisson rate q in (0, 1].
        steps: T, a positive int.
    Returns:
        z (float, in units of the clip norm) with PLD ε(q, z, T) ≤ target_epsilon, within 0.02% of
        it in ε.
    Raises:
        TypeError for an argument that is not a number; ValueError for one out of range (ε = 0 and
        δ = 0 included), or a budget no noise multiplier ≤ 1e6 meets.
    """
    t, delta, sample_rate, steps = _problem(target_epsilon, delta, sample_rate, steps, "sample_rate", check_rate)
    z_rdp = float(_grid.solve_noise(sample_rate, steps, delta, np.array([t]), _grid_orders())[0][0])
    return pld_noise_multiplier_from(t, delta, sample_rate, steps, z_rdp)[0]


def pld_noise_multiplier_from(target_epsilon, delta, sample_rate, steps, start):
    """``pld_noise_multiplier`` searched from a given noise multiplier (calibration starts from its
    RDP plan: RDP ε ≥ PLD ε, so an RDP-feasible z is PLD-feasible unless the PLD's rounding bites).

    Args:
        target_epsilon: the budget ε > 0 (float).
        delta: δ in (0, 1).
        sample_rate: Poisson rate q in (0, 1].
        steps: T, a positive int.
        start: z > 0 expected to meet the budget (raised by 5% steps until it does).
    Returns:
        (z, ε), floats: the smallest z found with PLD ε(q, z, T) ≤ target_epsilon·(1 − margin)
        (within 0.02% in ε) and that ε; always an evaluated point. The search stops at z = 0.05
        (``_grid.Z_FLOOR``, RDP calibration's floor too) unless ``start`` is already below it.
    Raises:
        TypeError for an argument that is not a number; ValueError for one out of range.
    """
    target_epsilon, delta, sample_rate, steps = _problem(target_epsilon, delta, sample_rate, steps, "sample_rate",
                                                         check_rate)
    start = check_positive("start", start)
    f = lambda z: _pld_epsilon_checked(sample_rate, float(z), steps, delta, VALUE_DISCRETIZATION)   # noqa: E731
    goal = target_epsilon * (1 - _grid.MARGIN)
    floor = _grid.Z_FLOOR            # as RDP calibration: below it a PLD is costly (14 s at z = 0.015)
    if delta >= -math.expm1(steps * math.log1p(-sample_rate)) and start > floor and f(floor) <= goal:
        # 1 − (1 − q)^T ≤ δ bounds the total variation distance of T subsampled steps, whatever z:
        # ε is 0 for every noise multiplier, so the search would only walk down to the floor
        return floor, f(floor)
    z_safe = start
    while f(z_safe) > goal:          # the RDP start is feasible unless rounding bites: step up
        z_safe *= 1.05
    if z_safe <= floor:
        return z_safe, f(z_safe)
    z_unsafe = z_safe
    while f(z_unsafe) <= goal:
        if z_unsafe <= floor:        # even the floor meets the budget: stop there
            return z_unsafe, f(z_unsafe)
        z_unsafe = max(z_unsafe * 0.7, floor)
    w, e = _root(lambda w: f(1.0 / w), 1.0 / z_safe, 1.0 / z_unsafe, target_epsilon)
    return 1.0 / w, e


def pld_sample_rate(target_epsilon, delta, noise_multiplier, steps):
    """Largest sampling rate meeting a budget under PLD, searched from the RDP answer.

    Args:
        target_epsilon: the budget ε > 0 (float).
        delta: δ in (0, 1).
        noise_multiplier: z > 0, finite (noise std in units of the clip norm).
        steps: T, a positive int.
    Returns:
        q ≤ 1 (float) with PLD ε(q, z, T) ≤ target_epsilon, within 0.02% of it in ε.
    Raises:
        TypeError for an argument that is not a number; ValueError for one out of range, or a budget
        that needs a rate below 1e-12.
    """
    t, delta, noise_multiplier, steps = _problem(target_epsilon, delta, noise_multiplier, steps, "noise_multiplier",
                                                 check_positive)
    q_rdp = float(_grid.solve_rate(noise_multiplier, steps, delta, np.array([t]), _grid_orders())[0][0])
    return pld_sample_rate_from(t, delta, noise_multiplier, steps, q_rdp)[0]


def pld_sample_rate_from(target_epsilon, delta, noise_multiplier, steps, start,
                         value_discretization_interval=VALUE_DISCRETIZATION, growth=1.5):
    """``pld_sample_rate`` searched from a given rate, at a given discretization (a close start:
    a small ``growth``, fewer PLD compositions; calibration's search for σ runs on coarse PLDs).

    Args:
        target_epsilon: the budget ε > 0 (float).
        delta: δ in (0, 1).
        noise_multiplier: z > 0.
        steps: T, a positive int.
        start: a rate in (0, 1] expected within a factor ``growth`` of the answer.
        value_discretization_interval: of the PLDs composed (coarser: faster, looser), finite and > 0.
        growth: factor > 1 by which the search moves the rate while bracketing.
    Returns:
        (q, ε), floats: the largest q ≤ 1 found with PLD ε(q, z, T) ≤ target_epsilon·(1 − margin)
        (within 0.02% in ε) and that ε; always an evaluated point.
    Raises:
        TypeError for an argument that is not a number; ValueError for one out of range.
    """
    target_epsilon, delta, noise_multiplier, steps = _problem(target_epsilon, delta, noise_multiplier, steps,
                                                              "noise_multiplier", check_positive)
    start = check_in_range("start", start, low=0.0, high=1.0)
    value_discretization_interval = check_discretization(value_discretization_interval)
    growth = check_in_range("growth", growth, low=1.0)
    f = lambda q: _pld_epsilon_checked(float(q), noise_multiplier, steps, delta,   # noqa: E731
                                       value_discretization_interval)
    goal = target_epsilon * (1 - _grid.MARGIN)
    q_safe = start
    while f(q_safe) > goal:
        q_safe /= growth
    if q_safe >= 1.0 or f(1.0) <= goal:
        return 1.0, f(1.0)
    q_unsafe = q_safe
    while f(q_unsafe) <= goal:
        q_unsafe = min(1.0, q_unsafe * growth)
    return _root(f, q_safe, q_unsafe, target_epsilon)


def _problem(target_epsilon, delta, param, steps, name, check):
    """(ε, δ, the given parameter, T) of an inversion, each checked (``check(name, param)`` for the
    parameter: the rate or the noise multiplier)."""
    return (check_positive("target_epsilon", target_epsilon), check_delta("delta", delta), check(name, param),
            check_positive_integer("steps", steps))


def _grid_orders():
    return np.asarray(DEFAULT_ORDERS, dtype=np.float64)
