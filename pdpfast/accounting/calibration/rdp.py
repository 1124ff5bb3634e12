"""Calibration methods under RDP: Sample, Scale and hybrid, each registered for accountant "rdp".

Methods (Boenisch et al., "Have it your way: Individualized privacy assignment for DP-SGD",
NeurIPS 2023):

* ``"sample"`` (Alg. 2): one σ; q_i the largest rate meeting ε_i at σ; σ solved so that
  mean_i q_i = sample_rate; c_i = C.
* ``"scale"`` (Alg. 3): q_i = sample_rate; σ_p the smallest multiplier meeting ε_p;
  σ = (mean_i 1/σ_{p(i)})^{-1}; c_i = σ·C/σ_{p(i)} (mean c_i = C, effective multiplier σ_{p(i)}).
* ``"hybrid"`` (App. D.6): q_i(λ) = q·(q_i^Sample/q)^λ renormalized to mean q (capped at 1), z_i
  solving ε(q_i, z_i) = ε_i, then σ and c_i as in Scale.

Everything runs on the distinct budgets, and on curves of exactly accounted points (see
``_grid``): no record is ever given a (q_i, z_i) whose accounted ε exceeds its budget. Each
distinct budget is certified at its own RDP order (``orders.polish``).
"""
from __future__ import annotations

import numpy as np
from scipy import interpolate, optimize

from .. import _grid
from ..orders import eps_at, polish
from .problem import (
    MEAN_SLACK,
    Problem,
    Solution,
    budget_error,
    harmonic_sigma,
    register_method,
    renormalize_capped,
    spread_message,
)

__all__ = ["sample", "scale", "hybrid"]

_WASTE = 1e-3           # ... unless that cut leaves a record more than 0.1% under its budget
_FALLBACK_SPENT = 0.998  # a σ whose mean rate the search could not close in on, if every budget spends this
_GRID_RATIO = 1e-3      # many budgets: consecutive ε of the grid they are read off differ by ≤ 0.1%
_STEEP = 1.5            # Sample's cut to mean q spares rates whose ε is steeper in q than q^1.5 (when it can)


# ----------------------------------------------------------------------------------------------
# Sample
# ----------------------------------------------------------------------------------------------
def _compress(values, counts, n_bins=4096):
    """≤ n_bins weighted representatives of the budgets, for the smooth surrogate of the mean."""
    if values.shape[0] <= n_bins:
        return values, counts.astype(np.float64)
    logv = np.log(values)
    edges = np.linspace(logv[0], logv[-1], n_bins + 1)
    b = np.clip(np.searchsorted(edges, logv, side="right") - 1, 0, n_bins - 1)
    w = np.bincount(b, weights=counts, minlength=n_bins)
    m = np.bincount(b, weights=counts * logv, minlength=n_bins)
    keep = w > 0
    return np.exp(m[keep] / w[keep]), w[keep]


class _SpreadError(ValueError):
    """IDP-Sample failed because the budgets are too far apart for one shared noise multiplier."""


def _own_orders(free: str, problem: Problem, q, z, idx, targets, key):
    """``polish`` once per run of equal ``key`` (non-decreasing): each run's parameter pushed to the
    smallest budget of the run at the run's own RDP order. Returns (q, z, ε, order), each (U,)."""
    first, run = _runs(key)
    z = np.broadcast_to(z, q.shape)
    q1, z1, e1, a1 = polish(free, q[first], z[first], problem.steps, problem.delta, problem.orders, idx[first],
                            targets[first])
    if np.any(e1 > targets[first]):      # polish certifies every iterate: never pass silently
        raise RuntimeError("internal error: a certified epsilon exceeds its budget")
    return q1[run], z1[run], e1[run], a1[run]


def _rates_at(problem: Problem, sigma: float, own_orders: bool = True):
    """Safe rates of every distinct budget at σ, each at its own RDP order (or at the grid's best
    order without ``own_orders``): (q, ε, grid order index, order), each (U,)."""
    try:
        # without own orders the rates only shape hybrid's (which solves its own noise per cell): a
        # coarser grid there gives fewer cells
        rates, eps, idx = _grid.solve_rate(sigma, problem.steps, problem.delta, problem.values, problem.orders,
                                           ratio=_GRID_RATIO if own_orders else 2 * _GRID_RATIO)
        if not own_orders:
            return rates, eps, idx, problem.orders[idx]
        rates, _, eps, alpha = _own_orders("rate", problem, rates, np.array([sigma]), idx, problem.values, rates)
        return rates, eps, idx, alpha
    except _grid.BudgetError as err:
        # σ lies below the smallest budget's own σ at rate q (probes stay in [σ_lo, σ_hi]): only
        # the large budgets, whose records reach rate 1 quickly, pull the mean rate up to q at so
        # low a noise (``spread_message``).
        raise _SpreadError(spread_message("Sample", err.budget, problem.values, problem.sample_rate, sigma,
                                          f"this budget cannot be met there ({err})", steps=problem.steps,
                                          delta=problem.delta)) from None


def _one(problem: Problem, method: str, budget: float, *, sample_rate=None, noise_multiplier=None):
    """(parameter, order index) for one budget: the noise at a rate, or the rate at a noise."""
    try:
        if noise_multiplier is None:
            z, _, i = _grid.solve_noise(sample_rate, problem.steps, problem.delta, np.array([budget]), problem.orders)
            return float(z[0]), int(i[0])
        r, _, i = _grid.solve_rate(noise_multiplier, problem.steps, problem.delta, np.array([budget]), problem.orders)
        return float(r[0]), int(i[0])
    except _grid.BudgetError as err:
        ctx = {"sample_rate": sample_rate} if noise_multiplier is None else {"noise_multiplier": noise_multiplier}
        raise budget_error(method, err.budget, str(err), steps=problem.steps, delta=problem.delta, **ctx) from None


def _runs(sorted_keys: np.ndarray):
    """(first index of each run, run id per element) of a non-decreasing array, without sorting."""
    if sorted_keys.shape[0] and np.all(sorted_keys[1:] >= sorted_keys[:-1]):
        change = np.flatnonzero(sorted_keys[1:] != sorted_keys[:-1]) + 1
        first = np.r_[0, change]
        run = np.zeros(sorted_keys.shape[0], dtype=np.intp)
        run[change] = 1
        return first, np.cumsum(run)
    _, first, run = np.unique(sorted_keys, return_index=True, return_inverse=True)
    return first, run


def _refuse_spread(problem: Problem, sigma_lo: float) -> None:
    """Refuse at once budgets too far apart for Sample: below σ_f, where the smallest budget's rate
    reaches the floor, that budget fails; rates grow with σ, so if the mean rate at σ_f is already
    above q, no σ gives mean q. (The search would otherwise probe down to there, slowly.)"""
    if problem.values.shape[0] == 1:
        return
    sigma_f = _one(problem, "Sample", problem.values[0], sample_rate=_grid.Q_FLOOR)[0]
    if sigma_f <= sigma_lo:
        return
    try:
        rates = _grid.solve_rate(sigma_f, problem.steps, problem.delta, problem.values, problem.orders,
                                 ratio=_GRID_RATIO)[0]
    except _grid.BudgetError:       # rounding at the very edge: the search decides
        return
    if problem.mean(rates) > problem.sample_rate * (1.0 + MEAN_SLACK):
        raise _SpreadError(spread_message(
            "Sample", problem.values[0], problem.values, problem.sample_rate, sigma_f,
            f"below it this budget would need a sample rate below {_grid.Q_FLOOR:g}, and there the mean rate is "
            f"already {problem.mean(rates):.4g}", steps=problem.steps, delta=problem.delta))
    capped = rates >= 1.0
    if np.any(capped) and float(problem.counts[capped].sum()) >= problem.n * problem.sample_rate * (1 - 1e-9):
        # the records at rate 1 there fill the mean alone: the mean reaches q only once they leave
        # rate 1, below σ_1; if that is below σ_f too, the smallest budget fails there (the search,
        # probing ever smaller σ, took minutes to find that out)
        big = float(problem.values[capped].min())
        sigma_1 = _one(problem, "Sample", big, sample_rate=1.0)[0]
        if sigma_1 <= sigma_f:
            raise _SpreadError(spread_message(
                "Sample", problem.values[0], problem.values, problem.sample_rate, sigma_f,
                f"below it this budget would need a sample rate below {_grid.Q_FLOOR:g}, while the records with "
                f"budgets ≥ {big:g} sit at rate 1 down to noise multiplier {sigma_1:.4g} and alone fill the mean rate",
                steps=problem.steps, delta=problem.delta))


def _solve_sample(problem: Problem, own_orders: bool = True):
    """σ and safe rates whose mean is exactly sample_rate, each certified at its own RDP order (at the
    grid's without ``own_orders``). Returns (σ, q_u, ε_u, grid order index_u, order_u)."""
    q = problem.sample_rate
    try:        # σ_hi: every q_i ≥ q there (smallest budget at q); σ_lo: every q_i ≤ q (largest budget)
        ends, _, ends_idx = _grid.solve_noise(q, problem.steps, problem.delta, problem.values[[0, -1]], problem.orders)
    except _grid.BudgetError as err:
        raise budget_error("Sample", err.budget, str(err), sample_rate=q, steps=problem.steps,
                           delta=problem.delta) from None
    (sigma_hi, sigma_lo), (idx_min, idx_max) = ends.tolist(), ends_idx.tolist()
    problem.noise_range = (sigma_lo, sigma_hi)
    _refuse_spread(problem, sigma_lo)
    if problem.values.shape[0] == 1 or q == 1.0:
        # one budget: q_i = q for all; q = 1: every rate must be 1, the smallest budget sets σ
        u = problem.values.shape[0]
        _, sigma, _, alpha = polish("noise", np.array([q]), np.array([sigma_hi]), problem.steps, problem.delta,
                                    problem.orders, np.array([idx_min]), problem.values[:1])
        rates, idx = np.full(u, q), np.full(u, idx_min)
        eps = np.full(u, eps_at(np.array([q]), sigma, problem.steps, problem.delta, alpha)[0])
        return float(sigma[0]), rates, eps, idx, np.full(u, alpha[0])
    # The surrogate: a fixed grid of rates spanning every budget's rate for σ in [σ_lo, σ_hi],
    # exact ε there (orders near the relevant ones), monotone cubic interpolation in log-log.
    try:
        r_min, _ = _one(problem, "Sample", problem.values[0], noise_multiplier=sigma_lo)
    except ValueError:          # infeasible at σ_lo need not mean infeasible at the solution
        r_min = 1.5 * _grid.Q_FLOOR
    r_max, _ = _one(problem, "Sample", problem.values[-1], noise_multiplier=sigma_hi)
    grid = np.geomspace(r_min / 1.5, min(1.0, 1.5 * r_max), 32)
    window = (max(0, idx_max - 6), idx_min + 6)
    rep_values, rep_weights = _compress(problem.values, problem.counts)
    log_rep = np.log(rep_values)

    curves = {}     # σ → its ε curve: brentq re-evaluates the bracket ends solve() has just evaluated

    def surrogate(sigma):
        if sigma not in curves:
            curves[sigma] = _grid.eps_curve(grid, np.array([sigma]), problem.steps, problem.delta, problem.orders,
                                            window=window)[0]
        e = curves[sigma]
        le = np.log(np.maximum(np.maximum.accumulate(e), 1e-300)) + np.arange(e.shape[0]) * 1e-12
        f = interpolate.PchipInterpolator(le, np.log(grid), extrapolate=True)
        # A budget below the curve's smallest ε needs a rate below the grid's smallest (or none at
        # this σ): read it as that smallest rate. PCHIP's cubic extrapolation there is unbounded: for
        # {1000, 1} at q = 0.6, T = 1 it gave ε = 1 a rate near 1 at σ = 0.05, where it has none, so
        # the bracket chased a root below the noise floor (quadrature at 1/z² nodes: 43 s).
        rates = np.where(log_rep >= le[-1], grid[-1], np.exp(np.minimum(0.0, f(np.maximum(log_rep, le[0])))))
        return float(np.dot(rep_weights, rates) / problem.n)

    def solve(correction, target, upper):
        lo, hi = np.log(sigma_lo), np.log(min(sigma_hi, upper))
        g = lambda ls, t: np.log(correction * surrogate(np.exp(ls))) - np.log(t)   # noqa: E731
        glo, ghi = g(lo, target), g(hi, target)
        if np.isfinite(upper) and ghi < 0:
            # the aim is out of reach below the cap boundary: aim half way between q and the top
            reach = correction * surrogate(np.exp(hi))
            if reach <= q:
                return float(np.exp(hi))
            target = 0.5 * (q + reach)
            glo, ghi = g(lo, target), g(hi, target)
        if not glo < 0 < ghi:
            # The exact root lies in [σ_lo, σ_hi] (every rate ≤ q at σ_lo, ≥ q at σ_hi), so a surrogate
            # root outside it is the surrogate's error: propose the end it points to and let the exact
            # bracket decide. (Widening beyond the ends walked below the noise floor, where each curve
            # costs quadrature at 1/z² nodes, or past σ_hi until scipy's brentq refused "f(a) and f(b)
            # must have different signs", as the user's error.)
            return float(np.exp(lo if glo >= 0 else hi))
        return float(np.exp(optimize.brentq(lambda ls: g(ls, target), lo, hi, xtol=1e-9, rtol=1e-12)))

    # Aim a little above q: the exact rates are rounded down (to a grid for many budgets). The
    # surrogate proposes σ (rescaled by the last exact/surrogate ratio); the exact mean, monotone
    # in σ, keeps a bracket that overrides proposals falling outside it (the surrogate can be
    # poor where ε(q) is nearly flat and kinked by switches between sparse large orders).
    # few budgets: exact rates, cheap to re-solve, so ask for a closer mean (less cut, less waste)
    slack = MEAN_SLACK if problem.values.shape[0] > 256 else 0.1 * MEAN_SLACK
    aim = q * (1.0 + 0.5 * slack)
    upper, correction = np.inf, 1.0
    below, above = 0.0, np.inf         # exact bracket: mean(below) < q ≤ mean(above)
    sigma = solve(correction, aim, upper)
    spread_error, fallback, filled, misses, same_side, last_below = None, None, None, 0, 0, None
    for _ in range(120):
        try:
            rates, eps, idx, alpha = _rates_at(problem, sigma, own_orders)
        except _SpreadError as err:
            # Some budget would need a rate below the floor: the probe σ is below the root (rates grow
            # with σ, and at σ_hi the smallest budget meets rate q). Bisect upwards instead of failing:
            # the surrogate can propose such a σ when the budgets are far apart.
            spread_error = err
            below = max(below, sigma)
            sigma = float(np.sqrt(below * above)) if np.isfinite(above) else min(2.0 * sigma, sigma_hi)
            continue
        mean = problem.mean(rates)
        capped = rates >= 1.0
        if own_orders and q <= mean <= q * (1.0 + MEAN_SLACK) and not np.all(capped):
            # a fallback should the search not close in: where ε(q) is nearly flat (small q and ε, at
            # the order cliff) the rates jump with σ by more than the slack left, so no σ may give a
            # mean within it; the cut of the least wasteful such σ still certifies every budget
            trial = _cut_to_mean(problem, sigma, rates, eps, alpha)
            eps_t = _certify_rates(problem, sigma, trial, alpha)
            spent = float(np.min((eps_t / problem.values)[~capped]))
            if fallback is None or spent > fallback[0]:
                fallback = (spent, (sigma, trial, eps_t, idx, alpha))
        if float(problem.counts[capped].sum()) >= problem.n * q * (1 - 1e-9):
            # Records at rate 1 alone fill the mean: the root lies below the σ at which the
            # smallest of their budgets stops fitting at q = 1 (there its rate leaves 1).
            b = float(problem.values[capped].min())
            upper = min(upper, _one(problem, "Sample", b, sample_rate=1.0)[0] * (1 - 1e-9))
            filled = (b, sigma)
            above = min(above, sigma)
            sigma = solve(correction, aim, upper)
            continue
        if q <= mean <= q * (1.0 + slack):
            # Lower the uncapped rates so the mean is exactly q (ε only decreases: monotone in q).
            trial = _cut_to_mean(problem, sigma, rates, eps, alpha)
            eps_t = _certify_rates(problem, sigma, trial, alpha)
            # Where ε is very elastic in q (small σ, many steps) even a 0.1% cut wastes budget:
            # then demand a closer mean before cutting.
            # (rates that only shape hybrid's sit on a coarser grid: judge their cut alone)
            waste = _WASTE if own_orders else _WASTE + 2 * _GRID_RATIO
            if slack < 1e-10 or np.all((eps_t >= (1 - waste) * problem.values) | capped):
                return sigma, trial, eps_t, idx, alpha
            slack *= 0.1
            aim = q * (1.0 + 0.5 * slack)
        if mean < q:
            below = max(below, sigma)
        else:
            above = min(above, sigma)
        # probes creeping up on the root from one side (the surrogate, rescaled at each probe, keeps
        # undershooting where ε is flat or clamped at 0: δ = 0.01, T = 1) count as misses too
        same_side = same_side + 1 if (mean < q) == last_below else 0
        last_below = mean < q
        if misses < 2 and same_side < 2:
            correction = mean / surrogate(sigma)
            sigma = solve(correction, aim, upper)
        if misses >= 2 or same_side >= 2 or not below < sigma < above:
            # bisect (in log σ) the exact bracket, closed by the search's own ends where no probe has
            # yet: every rate is ≥ q at σ_hi and ≤ q at σ_lo (a step of 1% from one side took
            # hundreds of probes when the budgets are far apart). After two misses the surrogate,
            # whose every proposal costs more than an exact probe, is not asked again.
            misses += 1
            lo_end = below if below > 0 else sigma_lo
            hi_end = above if np.isfinite(above) else sigma_hi
            sigma = float(np.sqrt(lo_end * hi_end))
            same_side = 0
        else:
            misses = 0
    if fallback is not None and fallback[0] >= _FALLBACK_SPENT:
        return fallback[1]
    if spread_error is not None:
        raise spread_error
    if filled is not None:
        raise _SpreadError(spread_message(
            "Sample", problem.values[0], problem.values, q, filled[1],
            f"the records with budgets ≥ {filled[0]:g} sit at rate 1 there and alone fill the mean rate, and no noise "
            "multiplier below it, where they leave rate 1, was found to give this budget's records the rest",
            steps=problem.steps, delta=problem.delta))
    raise RuntimeError(f"IDP-Sample: could not match mean sample rate {q} (last mean {mean})")


def _cut_to_mean(problem: Problem, sigma: float, rates: np.ndarray, eps: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """Rates lowered to mean exactly q (every ε only falls), cutting only where ε is not steep in q.
    A small budget's rate can sit where ε, at its order, grows like q^α (the order cliff): there the
    mean's 0.1% cut would waste several % of the budget, while its rate barely moves the mean. Such
    rates (elasticity d log ε / d log q above ``_STEEP``) keep their value when the others can absorb
    the cut; otherwise every rate is cut alike. ``eps``: the certified ε of ``rates`` at ``alpha``."""
    q = problem.sample_rate
    first, run = _runs(rates)
    # ε at 0.1% less, beside each rate's certified ε (``eps``, at the same σ and order)
    lower = eps_at(rates[first] * (1 - 1e-3), np.array([sigma]), problem.steps, problem.delta, alpha[first])
    with np.errstate(divide="ignore", invalid="ignore"):
        steep = (np.log(eps[first]) - np.log(lower)) / -np.log1p(-1e-3) > _STEEP
    keep = steep[run] & (rates < 1.0)
    cut = ~keep
    rest_mass = float(np.dot(problem.counts[cut], rates[cut]))
    want = problem.n * q - float(np.dot(problem.counts[keep], rates[keep]))
    # the others must have rates below 1 to absorb the cut (renormalize_capped holds rate 1 fixed: with
    # only capped rates left to cut, nothing was cut and the mean stayed above q, e.g. 0.90003 for 0.9)
    if (not np.any(keep) or not np.any(cut & (rates < 1.0)) or rest_mass <= 0 or want <= 0
            or want < 0.9 * rest_mass):
        return renormalize_capped(rates, problem.counts, q)
    out = rates.astype(np.float64).copy()
    out[cut] = renormalize_capped(rates[cut], problem.counts[cut], want / float(problem.counts[cut].sum()))
    return out


def _certify_rates(problem: Problem, sigma, rates, alpha):
    """Exact ε at each distinct rate at the order that certified a higher rate (at a fixed order ε
    is monotone in q, so it still certifies; the cut is ≤ 0.2%, too small to move the optimal
    order); check every budget holds. Returns ε (U,)."""
    first, run = _runs(rates)
    eps = eps_at(rates[first], np.array([sigma]), problem.steps, problem.delta, alpha[first])[run]
    # impossible by monotonicity: never pass silently. The rate search stopped at ε ≤ budget·(1 − MARGIN)
    # by its own evaluation of ε; this one, at the same order, can differ in the last bits (a rate kept
    # from the search read 6e-16 above, 2,000 budgets at δ = 0.01), hence the 1e-12: still 1e-7 below it.
    if np.any(eps > problem.values * (1 - _grid.MARGIN) * (1 + 1e-12)):
        raise RuntimeError("internal error: a certified epsilon exceeds its budget")
    return eps


@register_method("sample")
def sample(problem: Problem) -> Solution:
    """IDP-Sample under RDP: one σ, per-budget rates whose mean is exactly ``problem.sample_rate``.

    Args:
        problem: the problem on its U distinct budgets.
    Returns:
        Solution: rates (U,) in (0, 1], noise multipliers (U,) all σ, ε (U,) ≤ budgets, σ, and the
        RDP order (U,) certifying each ε.
    Raises:
        ValueError naming a budget that cannot be met (or budgets spread too far for one σ).
    """
    sigma, rates, eps, _, alpha = _solve_sample(problem)
    return Solution(rates, np.full(rates.shape[0], sigma), eps, sigma, alpha)


# ----------------------------------------------------------------------------------------------
# Scale
# ----------------------------------------------------------------------------------------------
@register_method("scale")
def scale(problem: Problem) -> Solution:
    """IDP-Scale under RDP: every rate ``problem.sample_rate``, per budget the smallest noise multiplier
    meeting it, σ their harmonic mean (``harmonic_sigma``).

    Args:
        problem: the problem on its U distinct budgets.
    Returns:
        Solution: rates (U,) all q, effective noise multipliers z_u (U,), ε (U,) ≤ budgets, σ, and
        the RDP order (U,) certifying each ε.
    Raises:
        ValueError naming a budget no z ≤ 1e6 meets.
    """
    q = problem.sample_rate
    try:
        z_u, _, idx = _grid.solve_noise(q, problem.steps, problem.delta, problem.values, problem.orders,
                                        ratio=_GRID_RATIO)
    except _grid.BudgetError as err:
        raise budget_error("Scale", err.budget, str(err), sample_rate=q, steps=problem.steps,
                           delta=problem.delta) from None
    rates = np.full(z_u.shape[0], q)
    _, z_u, eps, alpha = _own_orders("noise", problem, rates, z_u, idx, problem.values, -z_u)
    return Solution(rates, z_u, eps, harmonic_sigma(problem, z_u), alpha)


# ----------------------------------------------------------------------------------------------
# Hybrid
# ----------------------------------------------------------------------------------------------
@register_method("hybrid")
def hybrid(problem: Problem) -> Solution:
    """IDP-hybrid under RDP: Sample's rates moved towards q by λ = ``problem.hybrid_weight`` (renormalized
    to mean q), per budget the smallest noise multiplier at its rate, σ as in Scale.

    Args:
        problem: the problem on its U distinct budgets.
    Returns:
        Solution: rates (U,) with mean q, effective noise multipliers (U,), ε (U,) ≤ budgets, σ,
        and the RDP order (U,) certifying each ε.
    Raises:
        ValueError naming a budget that cannot be met, or why Sample's rates do not exist.
    """
    lam, q = problem.hybrid_weight, problem.sample_rate
    if lam == 0.0:      # q_i(0) = q for all: exactly Scale (and no need for Sample's rates to exist)
        return scale(problem)
    try:            # hybrid interpolates from Sample's rates: say so, not only "IDP-Sample"
        # Sample's rates set the shape of hybrid's (λ = 1: Sample's rates). With many budgets the
        # grid's orders are good enough for a shape, and polishing them would double the time.
        sigma_s, rates_s, _, idx_s, _ = _solve_sample(problem, own_orders=problem.values.shape[0] <= _grid.REFINE_MAX)
    except _SpreadError as err:
        raise _SpreadError(f"IDP-hybrid (hybrid_weight={lam:g}) starts from IDP-Sample's rates, which fail here: "
                           f"{err}; hybrid_weight=0 is Scale") from None
    except ValueError as err:
        raise ValueError(f"IDP-hybrid (hybrid_weight={lam:g}) starts from IDP-Sample's rates: {err}") from None
    rates = renormalize_capped(q * (rates_s / q) ** lam, problem.counts, q)
    # Distinct budgets sharing a rate and within a factor 1 + _GRID_RATIO of each other form a cell, solved
    # for its smallest budget (many budgets on the Sample grid share a rate; few are each their own cell).
    if problem.values.shape[0] <= _grid.REFINE_MAX:
        first, cell_of = np.arange(problem.values.shape[0]), np.arange(problem.values.shape[0])
    else:
        bucket = np.floor(np.log(problem.values) / np.log1p(_GRID_RATIO)).astype(np.int64)
        bucket -= bucket.min()
        _, rate_run = _runs(rates)
        first, cell_of = _runs(rate_run.astype(np.int64) * (int(bucket.max()) + 1) + bucket)
    cells, targets = rates[first], problem.values[first]
    # Start from the Sample multiplier, scaled by the rate change (ε ≈ f(q/z) for small q);
    # solve_noise_pairs refines that on a few pilot cells before doing them all.
    z_lo, z_hi = min(problem.noise_range[0], sigma_s) / 2, max(problem.noise_range[1], sigma_s) * 2
    guess, guess_idx = np.clip(sigma_s * cells / rates_s[first], z_lo, z_hi), idx_s[first]
    try:
        z_c, eps_c, idx_c = _grid.solve_noise_pairs(cells, targets, problem.steps, problem.delta, problem.orders, guess,
                                                    guess_idx, rtol=1e-5)      # _own_orders finishes the root
    except _grid.BudgetError as err:
        raise budget_error("hybrid", err.budget, str(err), sample_rate=q, steps=problem.steps,
                           delta=problem.delta) from None
    _, z_c, eps_c, alpha_c = _own_orders("noise", problem, cells, z_c, idx_c, targets, np.arange(cells.shape[0]))
    z_u = z_c[cell_of]
    return Solution(rates, z_u, eps_c[cell_of], harmonic_sigma(problem, z_u), alpha_c[cell_of])
