"""Calibration methods under PLD: Sample, Scale and hybrid, each registered for accountant "pld".

Each distinct budget is solved by scalar root-finding on PLD ε (``pld.pld_sample_rate_from``,
``pld.pld_noise_multiplier_from``) started from the RDP solution (RDP ε ≥ PLD ε, so an RDP-feasible
parameter is always a PLD-feasible starting point). A PLD costs ~0.1 s per (q, z) pair, so many
distinct budgets are first binned down into classes (``bin_budgets_down``).
"""
from __future__ import annotations

import math

import numpy as np

from .. import _grid
from ..pld import MAX_PAIRS, VALUE_DISCRETIZATION, pld_epsilon, pld_noise_multiplier_from, pld_sample_rate_from
from ..roots import illinois
from . import rdp
from .problem import MEAN_SLACK, Problem, Solution, budget_error, harmonic_sigma, register_method, renormalize_capped

__all__ = ["bin_budgets_down", "sample", "scale", "hybrid"]

# Sample's search for σ runs on PLDs this coarse (a composition at small q costs up to ~20x less),
# then searches at each finer one start from the last answer and need only a few steps there;
# every ε the plan reports is certified at VALUE_DISCRETIZATION.
SEARCH_DISCRETIZATIONS = (3e-3,)


def bin_budgets_down(values, max_classes: int = MAX_PAIRS, target_loss: float = 0.005):
    """Budget classes for PLD calibration of many distinct budgets (one PLD per class).

    Each budget is served by the largest class value ≤ it (never above its budget), with the fewest
    classes whose relative loss 1 − class/budget is ≤ ``target_loss``; if that needs more than
    ``max_classes``, the loss is raised (bisection) until ``max_classes`` suffice.

    Args:
        values: (G,) sorted distinct budgets ε > 0.
        max_classes: most classes K allowed (default ``pld.MAX_PAIRS``, the PLD accountant's limit).
        target_loss: the relative loss aimed at, in [0, 1).
    Returns:
        (class values (K,) float64 ascending, class index of each value (G,) int, the largest
        relative loss over the values, a float).
    """
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


def _eps_groups(problem: Problem, rates, zs):
    """Guaranteed PLD ε of each group at its final (q, z); a group the final rounding pushed over
    its budget (PLD is not smooth at the discretization scale) gets its z raised a little."""
    eps = np.array([pld_epsilon(q, z, problem.steps, problem.delta) for q, z in zip(rates, zs)])
    for k in np.flatnonzero(eps > problem.values * (1 - _grid.MARGIN)):
        while eps[k] > problem.values[k] * (1 - _grid.MARGIN):
            zs[k] *= 1.0001
            eps[k] = pld_epsilon(rates[k], zs[k], problem.steps, problem.delta)
    return eps


def _sample_pld(problem: Problem, sigma_hi, guess, vdi, shrink, growth):
    """σ with mean PLD rate q (to 0.2%), searched at discretization ``vdi`` from ``sigma_hi``
    (mean rate ≥ q there, else σ is raised until it is) and rate guesses ``guess``; σ moves by
    factors ``shrink`` while bracketing, rates by ``growth``. Returns (σ, rates, d log mean / d log σ)."""
    q = problem.sample_rate
    guess = np.asarray(guess, dtype=np.float64).copy()

    def rates_at(sigma):
        out = np.empty(problem.values.shape[0])
        for k, (t, g) in enumerate(zip(problem.values, guess)):
            out[k] = pld_sample_rate_from(float(t), problem.delta, sigma, problem.steps, float(min(1.0, g)), vdi,
                                          growth)[0]
        return out

    def g(sigma):
        r = rates_at(sigma)
        return math.log(problem.mean(r) / q), r

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


_MEAN_WINDOW = math.log1p(MEAN_SLACK)  # log of the accepted mean rate's ratio to q


def _sample_pld_fine(problem: Problem, sigma, guess, slope, vdi):
    """A search at discretization ``vdi`` started from a coarser one's answer: secant steps on
    log mean(log σ) (the first with the coarse search's slope), aiming at the middle of the accepted
    window; the bracketing search if that does not land in it."""
    q = problem.sample_rate
    guess = np.asarray(guess, dtype=np.float64).copy()
    prev = None
    for _ in range(6):
        rates = np.array([pld_sample_rate_from(float(t), problem.delta, sigma, problem.steps, float(min(1.0, g_)),
                                               vdi, 1.03)[0]
                          for t, g_ in zip(problem.values, guess)])
        g = math.log(problem.mean(rates) / q)
        if 0.0 <= g <= _MEAN_WINDOW:
            return sigma, rates, slope
        if prev is not None and g != prev[1] and sigma != prev[0]:
            slope = max((g - prev[1]) / math.log(sigma / prev[0]), 1e-3)
        prev = (sigma, g)
        step = -(g - 0.5 * _MEAN_WINDOW) / max(slope, 1e-3)
        sigma *= math.exp(step)
        guess = np.minimum(1.0, rates * math.exp(step * slope))
    return _sample_pld(problem, sigma, guess, vdi, 0.98, 1.03)


def _sample_pld_rates(problem: Problem):
    """σ and rates with mean exactly q under PLD: a coarse search from the RDP plan (RDP-feasible,
    so PLD rates at its σ are ≥ its rates), then finer ones, each from the last answer."""
    start = rdp.sample(problem)
    sigma, rh, slope = _sample_pld(problem, start.sigma, start.sample_rates, SEARCH_DISCRETIZATIONS[0], 0.85, 1.5)
    for vdi in SEARCH_DISCRETIZATIONS[1:] + (VALUE_DISCRETIZATION,):
        sigma, rh, slope = _sample_pld_fine(problem, sigma, rh, slope, vdi)
    q = problem.sample_rate
    capped = rh >= 1.0
    mass = float(np.dot(problem.counts[~capped], rh[~capped]))
    want = problem.n * q - float(problem.counts[capped].sum())
    if want <= 0 or mass <= 0:
        raise budget_error("Sample", float(problem.values[-1]), "records at sample rate 1 alone exceed the mean "
                            "sample_rate", sample_rate=q)
    return sigma, renormalize_capped(rh, problem.counts, q)


@register_method("sample", accountant="pld")
def sample(problem: Problem) -> Solution:
    """IDP-Sample under PLD: one σ, per-budget rates whose mean is exactly ``problem.sample_rate``,
    searched from the RDP plan (``rdp.sample``).

    Args:
        problem: the problem on its U distinct budgets (at most a few dozen: one PLD per budget).
    Returns:
        Solution: rates (U,) in (0, 1], noise multipliers (U,) all σ, PLD ε (U,) ≤ budgets, σ; no
        orders (None).
    Raises:
        ValueError naming a budget that cannot be met.
    """
    sigma, rates = _sample_pld_rates(problem)
    eps = np.array([pld_epsilon(q, sigma, problem.steps, problem.delta) for q in rates])
    # the shared σ cannot move per group: a group the final rescaling left over budget (PLD is
    # not smooth at the discretization scale) gets its rate lowered a little instead
    for k in np.flatnonzero(eps > problem.values * (1 - _grid.MARGIN)):
        while eps[k] > problem.values[k] * (1 - _grid.MARGIN):
            rates[k] *= 0.9999
            eps[k] = pld_epsilon(rates[k], sigma, problem.steps, problem.delta)
    return Solution(rates, np.full(rates.shape[0], sigma), eps, sigma)


def _noises_at(problem: Problem, rates, method):
    zs = np.empty(rates.shape[0])
    for k, (t, r) in enumerate(zip(problem.values, rates)):
        try:
            z_rdp = float(_grid.solve_noise(float(r), problem.steps, problem.delta, np.array([t]),
                                            problem.orders)[0][0])
        except _grid.BudgetError as err:
            raise budget_error(method, float(t), str(err), sample_rate=float(r), steps=problem.steps,
                                delta=problem.delta) from None
        zs[k] = pld_noise_multiplier_from(float(t), problem.delta, float(r), problem.steps, z_rdp)[0]
    return zs


@register_method("scale", accountant="pld")
def scale(problem: Problem) -> Solution:
    """IDP-Scale under PLD: every rate ``problem.sample_rate``, per budget the smallest noise multiplier
    meeting it (searched from the RDP one), σ their harmonic mean (``harmonic_sigma``).

    Args:
        problem: the problem on its U distinct budgets (at most a few dozen: one PLD per budget).
    Returns:
        Solution: rates (U,) all q, effective noise multipliers (U,), PLD ε (U,) ≤ budgets, σ; no
        orders (None).
    Raises:
        ValueError naming a budget no z ≤ 1e6 meets.
    """
    rates = np.full(problem.values.shape[0], problem.sample_rate)
    zs = _noises_at(problem, rates, "Scale")
    return Solution(rates, zs, _eps_groups(problem, rates, zs), harmonic_sigma(problem, zs))


@register_method("hybrid", accountant="pld")
def hybrid(problem: Problem) -> Solution:
    """IDP-hybrid under PLD: PLD Sample's rates moved towards q by λ = ``problem.hybrid_weight``
    (renormalized to mean q), then noise multipliers and σ as in Scale.

    Args:
        problem: the problem on its U distinct budgets (at most a few dozen: one PLD per budget).
    Returns:
        Solution: rates (U,) with mean q, effective noise multipliers (U,), PLD ε (U,) ≤ budgets,
        σ; no orders (None).
    Raises:
        ValueError naming a budget that cannot be met.
    """
    _, rates_s = _sample_pld_rates(problem)
    q = problem.sample_rate
    rates = renormalize_capped(q * (rates_s / q) ** problem.hybrid_weight, problem.counts, q)
    zs = _noises_at(problem, rates, "hybrid")
    return Solution(rates, zs, _eps_groups(problem, rates, zs), harmonic_sigma(problem, zs))
