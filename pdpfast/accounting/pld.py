"""Tighter accounting through privacy loss distributions (Google's ``dp_accounting``).

One PLD is built per distinct (q, z) pair (``PoissonSampledDpEvent(q, GaussianDpEvent(z))``
self-composed T times, pessimistic discretization, so ε is an upper bound). That costs ~0.1 s per
pair, so PLD accounting is offered where the number of distinct pairs is small (≤ 64), and
calibration under PLD solves each group by scalar root-finding started from the RDP solution
(RDP ε ≥ PLD ε, so an RDP-feasible parameter is always a PLD-feasible starting point).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from . import _grid
from .problem import METHODS, Problem, Solution, budget_error, register_method, renormalize_capped
from .roots import illinois
from .sgm import DEFAULT_ORDERS, distinct_rows

__all__ = ["MAX_PAIRS", "bin_budgets_down", "pld_epsilon", "pld_epsilon_composed", "epsilons", "pld_noise_multiplier",
           "pld_noise_multiplier_from", "pld_sample_rate", "pld_sample_rate_from"]

MAX_PAIRS = 64
VALUE_DISCRETIZATION = 1e-3     # dp_accounting's default is 1e-4: ~8x slower, ε lower by ~1e-4
# Sample's search for σ runs on PLDs this coarse (a composition at small q costs up to ~20x less),
# then searches at each finer one start from the last answer and need only a few steps there;
# every ε the plan reports is certified at VALUE_DISCRETIZATION.
SEARCH_DISCRETIZATIONS = (3e-3,)
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
    """ε(δ) of T steps of the Poisson-subsampled Gaussian (rate q, noise multiplier z) by PLD."""
    return _pld_epsilon_cached(float(q), float(z), int(steps), float(delta), float(value_discretization_interval))


def pld_epsilon_composed(history, delta: float, value_discretization_interval=VALUE_DISCRETIZATION) -> float:
    """ε(δ) by PLD of a composition of Poisson-subsampled Gaussian runs.

    history: (noise_multiplier, sample_rate, steps) entries, composed in order (an Opacus
    accountant's ``history``). One entry is ``pld_epsilon`` of it (cached)."""
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
    """(N,) PLD ε per record, computed once per distinct (q_i, z_i) pair (at most ``max_pairs``)."""
    q = np.asarray(sample_rates, dtype=np.float64)
    z = np.broadcast_to(np.asarray(noise_multipliers, dtype=np.float64), q.shape)
    qf, zf = q.ravel() + 0.0, z.ravel() + 0.0            # + 0.0: −0.0 and 0.0 are one value
    first, inverse = distinct_rows(qf, zf)
    if first.shape[0] > max_pairs:
        raise ValueError(f"PLD accounting supports at most {max_pairs} distinct (sample_rate, noise_multiplier) "
                         f"pairs, got {first.shape[0]}; use the RDP accountant")
    eps = np.array([pld_epsilon(a, b, steps, delta) for a, b in zip(qf[first], zf[first])])
    return eps[inverse].reshape(q.shape)


def bin_budgets_down(values, max_classes: int = MAX_PAIRS, target_loss: float = 0.005):
    """Budget classes for PLD calibration of many distinct budgets: each budget is served by the
    largest class value ≤ it (never above its budget), with the fewest classes whose relative loss
    1 − class/budget is ≤ ``target_loss``; if that needs more than ``max_classes``, the loss is
    raised (bisection) until ``max_classes`` suffice.

    values: sorted distinct budgets. Returns (class values (K,), class of each value (G,), the
    largest relative loss)."""
    values = np.asarray(values, dtype=np.float64)

    def classes(loss):
        starts, k = [0], 0
        while True:  # the next class starts at the first budget the current one serves too poorly
            k = int(np.searchsorted(values, values[k] / (1.0 - loss), side="right"))
            if k >= values.shape[0]:
                return starts
            starts.append(k)

    loss = float(target_loss)
    starts = classes(loss)
    if len(starts) > max_classes:
        lo, hi = loss, 1.0 - float(values[0] / values[-1]) + 1e-12
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if len(classes(mid)) > max_classes:
                lo = mid
            else:
                hi = mid
        starts = classes(hi)
    class_values = values[starts]
    class_of = np.searchsorted(class_values, values, side="right") - 1
    return class_values, class_of, float(np.max(1.0 - class_values[class_of] / values))


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


# ----------------------------------------------------------------------------------------------
# Calibration methods under PLD
# ----------------------------------------------------------------------------------------------
def _eps_groups(p: Problem, rates, zs):
    """Guaranteed PLD ε of each group at its final (q, z); a group the final rounding pushed over
    its budget (PLD is not smooth at the discretization scale) gets its z raised a little."""
    eps = np.array([pld_epsilon(q, z, p.steps, p.delta) for q, z in zip(rates, zs)])
    for k in np.flatnonzero(eps > p.values * (1 - _grid.MARGIN)):
        while eps[k] > p.values[k] * (1 - _grid.MARGIN):
            zs[k] *= 1.0001
            eps[k] = pld_epsilon(rates[k], zs[k], p.steps, p.delta)
    return eps


def _sample_pld(p: Problem, sigma_hi, guess, vdi, shrink, growth):
    """σ with mean PLD rate q (to 0.2%), searched at discretization ``vdi`` from ``sigma_hi``
    (mean rate ≥ q there, else σ is raised until it is) and rate guesses ``guess``; σ moves by
    factors ``shrink`` while bracketing, rates by ``growth``. Returns (σ, rates, d log mean / d log σ)."""
    q = p.sample_rate
    guess = np.asarray(guess, dtype=np.float64).copy()

    def rates_at(sigma):
        out = np.empty(p.values.shape[0])
        for k, (t, g) in enumerate(zip(p.values, guess)):
            out[k] = pld_sample_rate_from(float(t), p.delta, sigma, p.steps, float(min(1.0, g)), vdi, growth)[0]
        return out

    def g(sigma):
        r = rates_at(sigma)
        return math.log(p.mean(r) / q), r

    gh, rh = g(sigma_hi)
    while gh < 0:               # a start from another discretization may sit just below the root
        sigma_hi /= shrink
        guess = rh / shrink
        gh, rh = g(sigma_hi)
    # bracket: walk σ down until the mean drops below q
    sigma_lo, gl = sigma_hi, gh
    while gl >= 0:
        sigma_lo *= shrink
        guess *= shrink
        gl, _ = g(sigma_lo)
    rates_hi = [rh]        # the rates at the kept (high) end

    def step(x, _, b):
        nonlocal guess
        x = float(x[0])
        guess = np.minimum(1.0, rates_hi[0] * math.exp(x - float(b.kept[0])))
        gx, rx = g(math.exp(x))
        if gx >= 0:
            rates_hi[0] = rx
        return np.array([gx]), np.array([gx >= 0])

    b = illinois(step, math.log(sigma_hi), math.log(sigma_lo), gh, gl,
                 lambda _, b: np.array([not b.r_kept[0] <= _MEAN_WINDOW]), 40)
    lh, ll, gh, gl = (float(v[0]) for v in (b.kept, b.other, b.r_kept, b.r_other))
    # a first slope for the fine search (the residuals may be Illinois-halved: it corrects it)
    slope = (gh - gl) / (lh - ll) if lh != ll else 1.0
    return math.exp(lh), rates_hi[0], slope


_MEAN_WINDOW = math.log1p(2e-3)     # accept a mean rate in [q, q·1.002] before scaling it down to q


def _sample_pld_fine(p: Problem, sigma, guess, slope, vdi):
    """A search at discretization ``vdi`` started from a coarser one's answer: secant steps on
    log mean(log σ) (the first with the coarse search's slope), aiming at the middle of the accepted
    window; the bracketing search if that does not land in it."""
    q = p.sample_rate
    guess = np.asarray(guess, dtype=np.float64).copy()
    prev = None
    for _ in range(6):
        rates = np.array([pld_sample_rate_from(float(t), p.delta, sigma, p.steps, float(min(1.0, g_)), vdi, 1.03)[0]
                          for t, g_ in zip(p.values, guess)])
        g = math.log(p.mean(rates) / q)
        if 0.0 <= g <= _MEAN_WINDOW:
            return sigma, rates, slope
        if prev is not None and g != prev[1] and sigma != prev[0]:
            slope = max((g - prev[1]) / math.log(sigma / prev[0]), 1e-3)
        prev = (sigma, g)
        step = -(g - 0.5 * _MEAN_WINDOW) / max(slope, 1e-3)
        sigma *= math.exp(step)
        guess = np.minimum(1.0, rates * math.exp(step * slope))
    return _sample_pld(p, sigma, guess, vdi, 0.98, 1.03)


def _sample_pld_rates(p: Problem):
    """σ and rates with mean exactly q under PLD: a coarse search from the RDP plan (RDP-feasible,
    so PLD rates at its σ are ≥ its rates), then finer ones, each from the last answer."""
    start = METHODS[("sample", "rdp")](p)
    sigma, rh, slope = _sample_pld(p, start.sigma, start.sample_rates, SEARCH_DISCRETIZATIONS[0], 0.85, 1.5)
    for vdi in SEARCH_DISCRETIZATIONS[1:] + (VALUE_DISCRETIZATION,):
        sigma, rh, slope = _sample_pld_fine(p, sigma, rh, slope, vdi)
    q = p.sample_rate
    capped = rh >= 1.0
    mass = float(np.dot(p.counts[~capped], rh[~capped]))
    want = p.n * q - float(p.counts[capped].sum())
    if want <= 0 or mass <= 0:
        raise budget_error("Sample", float(p.values[-1]), "records at sample rate 1 alone exceed the mean "
                            "sample_rate", sample_rate=q)
    return sigma, renormalize_capped(rh, p.counts, q)


@register_method("sample", accountant="pld")
def _sample(p: Problem) -> Solution:
    sigma, rates = _sample_pld_rates(p)
    eps = np.array([pld_epsilon(q, sigma, p.steps, p.delta) for q in rates])
    # the shared σ cannot move per group: a group the final rescaling left over budget (PLD is
    # not smooth at the discretization scale) gets its rate lowered a little instead
    for k in np.flatnonzero(eps > p.values * (1 - _grid.MARGIN)):
        while eps[k] > p.values[k] * (1 - _grid.MARGIN):
            rates[k] *= 0.9999
            eps[k] = pld_epsilon(rates[k], sigma, p.steps, p.delta)
    return Solution(rates, np.full(rates.shape[0], sigma), eps, sigma)


def _noises_at(p: Problem, rates, method):
    zs = np.empty(rates.shape[0])
    for k, (t, r) in enumerate(zip(p.values, rates)):
        try:
            z_rdp = float(_grid.solve_noise(float(r), p.steps, p.delta, np.array([t]), p.orders)[0][0])
        except _grid.BudgetError as err:
            raise budget_error(method, float(t), str(err), sample_rate=float(r), steps=p.steps,
                                delta=p.delta) from None
        zs[k] = pld_noise_multiplier_from(float(t), p.delta, float(r), p.steps, z_rdp)[0]
    return zs


@register_method("scale", accountant="pld")
def _scale(p: Problem) -> Solution:
    rates = np.full(p.values.shape[0], p.sample_rate)
    zs = _noises_at(p, rates, "Scale")
    return Solution(rates, zs, _eps_groups(p, rates, zs), float(p.n / np.dot(p.counts, 1.0 / zs)))


@register_method("hybrid", accountant="pld")
def _hybrid(p: Problem) -> Solution:
    _, rates_s = _sample_pld_rates(p)
    q = p.sample_rate
    rates = renormalize_capped(q * (rates_s / q) ** p.hybrid_weight, p.counts, q)
    zs = _noises_at(p, rates, "hybrid")
    return Solution(rates, zs, _eps_groups(p, rates, zs), float(p.n / np.dot(p.counts, 1.0 / zs)))
