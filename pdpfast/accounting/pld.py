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

from . import _grid
from .roots import illinois
from .sgm import DEFAULT_ORDERS, distinct_rows

__all__ = ["MAX_PAIRS", "VALUE_DISCRETIZATION", "pld_epsilon", "pld_epsilon_composed", "epsilons",
           "pld_noise_multiplier", "pld_noise_multiplier_from", "pld_sample_rate", "pld_sample_rate_from"]

MAX_PAIRS = 64                  # most distinct (q, z) pairs accounted (one PLD each)
VALUE_DISCRETIZATION = 1e-3     # dp_accounting's default is 1e-4: ~8x slower, ε lower by ~1e-4
_RTOL = 2e-4                    # root-finding stops once ε is within this of the target (safe side)


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
        z: noise multiplier ≥ 0 (noise std in units of the clip norm; 0: ε = inf).
        steps: T, a positive int.
        delta: δ in (0, 1).
        value_discretization_interval: of the PLD (pessimistic, so ε is an upper bound).
    Returns:
        ε, a float.
    """
    return _pld_epsilon_cached(float(q), float(z), int(steps), float(delta), float(value_discretization_interval))


def pld_epsilon_composed(history, delta: float, value_discretization_interval=VALUE_DISCRETIZATION) -> float:
    """ε(δ) by PLD of a composition of Poisson-subsampled Gaussian runs.

    Args:
        history: (noise_multiplier, sample_rate, steps) entries, composed in order (an Opacus
            accountant's ``history``); entries with no steps or rate 0 add nothing.
        delta: δ in (0, 1).
        value_discretization_interval: of the PLD (pessimistic, so ε is an upper bound).
    Returns:
        ε, a float (0.0 for an empty history; one entry is ``pld_epsilon`` of it, cached).
    """
    entries = [(float(z), float(q), int(n)) for z, q, n in history if n > 0 and q > 0.0]
    if not entries:
        return 0.0
    if len(entries) == 1:
        z, q, n = entries[0]
        return pld_epsilon(q, z, n, delta, value_discretization_interval)
    if any(z == 0.0 for z, _, _ in entries):
        return math.inf
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    accountant = PLDAccountant(value_discretization_interval=value_discretization_interval)
    for z, q, n in entries:
        gaussian = dp_accounting.GaussianDpEvent(z)
        accountant.compose(gaussian if q == 1.0 else dp_accounting.PoissonSampledDpEvent(q, gaussian), n)
    return float(accountant.get_epsilon(delta))


def epsilons(sample_rates, noise_multipliers, steps, delta, max_pairs=MAX_PAIRS) -> np.ndarray:
    """PLD ε per record, computed once per distinct (q_i, z_i) pair.

    Args:
        sample_rates: Poisson rates q_i in [0, 1], usually (N,) (any shape).
        noise_multipliers: effective noise multipliers z_i ≥ 0, broadcast to ``sample_rates``.
        steps: T, a positive int.
        delta: δ in (0, 1).
        max_pairs: most distinct pairs accepted (each costs a PLD, ~0.1 s).
    Returns:
        float64 ε with the shape of ``sample_rates``.
    Raises:
        ValueError if there are more than ``max_pairs`` distinct pairs.
    """
    q = np.asarray(sample_rates, dtype=np.float64)
    z = np.broadcast_to(np.asarray(noise_multipliers, dtype=np.float64), q.shape)
    qf, zf = q.ravel() + 0.0, z.ravel() + 0.0            # + 0.0: −0.0 and 0.0 are one value
    first, inverse = distinct_rows(qf, zf)
    if first.shape[0] > max_pairs:
        raise ValueError(f"PLD accounting supports at most {max_pairs} distinct (sample_rate, noise_multiplier) "
                         f"pairs, got {first.shape[0]}; use the RDP accountant")
    eps = np.array([pld_epsilon(a, b, steps, delta) for a, b in zip(qf[first], zf[first])])
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
    """
    t = float(target_epsilon)
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
        (within 0.02% in ε) and that ε; always an evaluated point.
    """
    f = lambda z: pld_epsilon(sample_rate, z, steps, delta)   # noqa: E731
    goal = target_epsilon * (1 - _grid.MARGIN)
    z_safe = start
    while f(z_safe) > goal:          # the RDP start is feasible unless rounding bites: step up
        z_safe *= 1.05
    z_unsafe = z_safe
    while f(z_unsafe) <= goal:
        z_unsafe *= 0.7
        if z_unsafe < 1e-2:
            return z_safe, f(z_safe)
    w, e = _root(lambda w: f(1.0 / w), 1.0 / z_safe, 1.0 / z_unsafe, target_epsilon)
    return 1.0 / w, e


def pld_sample_rate(target_epsilon, delta, noise_multiplier, steps):
    """Largest sampling rate meeting a budget under PLD, searched from the RDP answer.

    Args:
        target_epsilon: the budget ε > 0 (float).
        delta: δ in (0, 1).
        noise_multiplier: z > 0 (noise std in units of the clip norm).
        steps: T, a positive int.
    Returns:
        q ≤ 1 (float) with PLD ε(q, z, T) ≤ target_epsilon, within 0.02% of it in ε.
    """
    t = float(target_epsilon)
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
        value_discretization_interval: of the PLDs composed (coarser: faster, looser).
        growth: factor > 1 by which the search moves the rate while bracketing.
    Returns:
        (q, ε), floats: the largest q ≤ 1 found with PLD ε(q, z, T) ≤ target_epsilon·(1 − margin)
        (within 0.02% in ε) and that ε; always an evaluated point.
    """
    f = lambda q: pld_epsilon(q, noise_multiplier, steps, delta, value_discretization_interval)   # noqa: E731
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


def _grid_orders():
    return np.asarray(DEFAULT_ORDERS, dtype=np.float64)
