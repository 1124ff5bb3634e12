"""Each (q, z) point's own RDP order: found off the grid, and a parameter pushed to its budget there.

ε is a minimum over RDP orders α, and any single order gives a valid bound. A fixed grid of
orders can miss the minimum badly: for small q and z the RDP curve has a cliff just above the
optimal order (the k = α term of A_α, q^α e^{(α²−α)/2z²}, takes over), and the grid's best order
sits short of it. At q = 3·10⁻⁵, z = 0.75, T = 10⁴, δ = 10⁻⁵ the default grid's best order is
10.9 and the true optimum 11.6: ε is 6% lower there (the grid has nothing between 10.9 and 12).

So calibration certifies each distinct (q, z) at its own order:

* ``optimal_orders``: per point, minimize ε(α) over fractional α in a bracket (the grid's
  neighbours of its best order) by safeguarded Newton on ε'(α). log A_α and its first two
  α-derivatives come from one trapezoidal quadrature of A_α = E_u[(1 − q + q·e^{u/z − 1/2z²})^α]
  (the same integrand as ``_grid``'s fractional orders; d/dα log A_α is the mean and d²/dα² the
  variance of log(1 − q + q·e^{…}) under the integrand's weights), so a step costs one pass.
* ``polish``: alternate (a) the best order at the current parameter and (b) the largest rate /
  smallest noise multiplier whose ε *at that fixed order* meets the budget (a monotone 1-D root),
  until the parameter stops moving. (b) keeps every iterate certified: at the fixed order the
  budget holds by construction, and (a) can only lower ε further. Where that stalls short of the
  budget — at a fixed order ε jumps at the cliff, so (b) stops there, and at that parameter the
  cliff's order is already the best one, so (a) cannot move either — a root of the order-minimized
  ε(x) = min_α ε(x, α) (monotone and continuous in x) finishes the job: the optimum then lies at a
  lower order with a larger rate / smaller multiplier, where the cliff meets the budget.

``rdp_at`` is the one-step RDP at one order per point; the plan's ε and the ledger's (which
composes the same per-step values) both come from it, so they agree.
"""
from __future__ import annotations

import numpy as np

from . import _grid
from .roots import illinois
from .sgm import log_a_at, rdp_at

__all__ = ["log_a_at", "rdp_at", "eps_at", "optimal_orders", "polish"]

_ORDER_RTOL = 1e-7       # Newton stops once α moves by less than this (relative)
_PARAM_RTOL = 1e-6       # polish stops once the parameter moves by less than this (relative)
_STALL_RTOL = 1e-4       # ε this far below the budget after the alternation: it stalled at a cliff


def _conversion(alpha: np.ndarray, log_delta: float):
    """c(α) = −(log δ + log α)/(α − 1) + log((α − 1)/α) (Balle et al. 2020) and its first two derivatives."""
    v, u = alpha - 1.0, -log_delta - np.log(alpha)
    c = u / v + np.log(v / alpha)
    c1 = (-v / alpha - u) / v ** 2 + 1.0 / v - 1.0 / alpha
    c2 = 1.0 / (alpha ** 2 * v) + 2.0 / (alpha * v ** 2) + 2.0 * u / v ** 3 - 1.0 / v ** 2 + 1.0 / alpha ** 2
    return c, c1, c2


def eps_at(q, z, steps, delta, alpha) -> np.ndarray:
    """ε(δ) of ``steps`` SGM steps certified at order α_p of each point, clamped at 0 (as ``_grid``).

    ε_p = T·ρ(α_p) − (log δ + log α_p)/(α_p − 1) + log((α_p − 1)/α_p) (Balle et al. 2020).

    Args:
        q: (P,) float64 Poisson sample rates in [0, 1].
        z: (P,) float64 noise multipliers σ ≥ 0 (noise std / clip norm); may be (1,).
        steps: T, the number of steps.
        delta: δ in (0, 1).
        alpha: (P,) float64 orders α > 1, one per point.
    Returns:
        (P,) float64 ε ≥ 0.
    """
    alpha = np.asarray(alpha, dtype=np.float64)
    eps = float(steps) * rdp_at(q, z, alpha) + _conversion(alpha, np.log(delta))[0]
    return np.maximum(eps, 0.0)


def _eps_and_slopes(q, z, steps, delta, alpha):
    """(ε, dε/dα, d²ε/dα²) at α per point; 0 < q < 1, z > 0."""
    g, g1, g2 = log_a_at(q, z, alpha, derivatives=True)
    v = alpha - 1.0
    c, c1, c2 = _conversion(alpha, np.log(delta))
    t = float(steps)
    eps = t * g / v + c
    d1 = t * (g1 / v - g / v ** 2) + c1
    d2 = t * (g2 / v - 2.0 * g1 / v ** 2 + 2.0 * g / v ** 3) + c2
    return eps, d1, d2


def optimal_orders(q, z, steps, delta, start, lo, hi, max_iter=60):
    """Per point, the order in [lo, hi] minimizing ε, by Newton on dε/dα safeguarded by bisection.

    Points with q ∈ {0, 1} (or z = 0) keep ``start`` (no optimum inside: ε is monotone in α there
    up to the conversion, which the grid already resolved).

    Args:
        q: (P,) float64 Poisson sample rates in [0, 1].
        z: (P,) float64 noise multipliers σ ≥ 0 (noise std / clip norm); may be (1,).
        steps: T, the number of steps.
        delta: δ in (0, 1).
        start: (P,) float64 a good first guess in [lo, hi] (the grid's best order); clipped to it.
        lo, hi: (P,) float64 the bracket of orders α > 1 searched (the arrays passed are not modified).
        max_iter: the most Newton / bisection steps.
    Returns:
        (eps, alpha), each (P,) float64: the best order evaluated and its ε (a valid bound even if
        ε(α) were not unimodal there).
    """
    q = np.asarray(q, dtype=np.float64)
    p = q.shape[0]
    z = np.broadcast_to(np.asarray(z, dtype=np.float64), (p,))
    x = np.clip(np.asarray(start, dtype=np.float64), lo, hi).copy()
    lo, hi = np.asarray(lo, dtype=np.float64).copy(), np.asarray(hi, dtype=np.float64).copy()
    best_eps, best_alpha = np.full(p, np.inf), x.copy()
    general = np.flatnonzero((q > 0.0) & (q < 1.0) & (z > 0.0))
    edge = np.setdiff1d(np.arange(p), general)
    if edge.size:
        best_eps[edge] = eps_at(q[edge], z[edge], steps, delta, x[edge])
    active = general
    for _ in range(max_iter):
        if active.size == 0:
            break
        e, d1, d2 = _eps_and_slopes(q[active], z[active], steps, delta, x[active])
        better = e < best_eps[active]
        best_eps[active[better]], best_alpha[active[better]] = e[better], x[active][better]
        rising = ~np.isfinite(e) | (d1 > 0)            # the minimum lies to the left of x
        hi[active[rising]] = x[active[rising]]
        lo[active[~rising]] = x[active[~rising]]
        with np.errstate(divide="ignore", invalid="ignore"):
            step = np.where((d2 > 0) & np.isfinite(e), x[active] - d1 / d2, np.nan)
        a, b = lo[active], hi[active]
        inside = (step > a) & (step < b)
        new = np.where(inside, step, 0.5 * (a + b))
        moved = np.abs(new - x[active]) > _ORDER_RTOL * x[active]
        keep = moved & (b - a > _ORDER_RTOL * x[active])
        x[active] = new
        active = active[keep]
    return best_eps, best_alpha


def _fixed_order_root(free, q, z, steps, delta, alpha, goal, ceiling, eps_start=None, first_factor=None):
    """The largest rate (free = "rate") / smallest noise multiplier (free = "noise") whose ε at the
    fixed order α is ≤ goal, starting from a point that meets it. Returns (parameter, ε), (P,) each.

    At a fixed order ε is monotone in either parameter; regula falsi runs in log space on the
    increasing parameter (q, or 1/z), bracketed by steps that grow until the budget breaks."""
    to_param = (lambda x: x) if free == "rate" else (lambda x: 1.0 / x)

    def evaluate(x, _lo, _hi, which):
        qq, zz = (x, z[which]) if free == "rate" else (q[which], 1.0 / x)
        return eps_at(qq, zz, steps, delta, alpha[which]), np.zeros(x.shape[0], dtype=np.intp)

    start = q if free == "rate" else 1.0 / z
    p = start.shape[0]
    everyone = np.arange(p)
    safe = start.copy()
    e_safe = evaluate(start, None, None, everyone)[0] if eps_start is None else eps_start.copy()
    unsafe, e_unsafe = np.full(p, np.nan), np.full(p, np.nan)
    factor = 1.0 + np.clip(2.0 * (goal / np.maximum(e_safe, 1e-300) - 1.0), 1e-5, 1.0)
    if first_factor is not None:        # a close guess of the root's factor: step just past it
        factor = np.maximum(first_factor * (1.0 + 1e-4), 1.0 + 1e-5)
    todo = np.flatnonzero(safe < ceiling)
    for _ in range(64):
        if todo.size == 0:
            break
        trial = np.minimum(safe[todo] * factor[todo], ceiling)
        e = evaluate(trial, None, None, todo)[0]
        ok = e <= goal[todo]
        safe[todo[ok]], e_safe[todo[ok]] = trial[ok], e[ok]
        unsafe[todo[~ok]], e_unsafe[todo[~ok]] = trial[~ok], e[~ok]
        factor[todo] = factor[todo] ** 2
        todo = todo[ok & (trial < ceiling)]
    bracketed = np.flatnonzero(~np.isnan(unsafe))
    if bracketed.size:
        zeros = np.zeros(bracketed.size, dtype=np.intp)
        # refine() certifies against target·(1 − MARGIN): hand it the goal divided back
        safe[bracketed], e_safe[bracketed], _ = _grid.refine(
            lambda x, lo, hi, which: evaluate(x, lo, hi, bracketed[which]), safe[bracketed], unsafe[bracketed],
            e_safe[bracketed], zeros, zeros, e_unsafe[bracketed], goal[bracketed] / (1.0 - _grid.MARGIN), rtol=1e-5)
    return to_param(safe), e_safe


def _order_minimized_root(free, q, z, steps, delta, alpha, eps, goal, ceiling, alpha_min, alpha_max, rtol=1e-5):
    """The largest rate / smallest noise multiplier x whose ε minimized over orders in
    [max(α_p/2, alpha_min), min(1.1·α_p, alpha_max)] meets goal, from a point (q, z) at order α with
    ε ≤ goal. Returns (q, z, ε, α), new (P,) arrays; every point returned was evaluated at its α."""
    q, z, alpha, eps = q.copy(), z.copy(), alpha.copy(), eps.copy()
    lo_a, hi_a = np.maximum(alpha / 2.0, alpha_min), np.minimum(alpha * 1.1, alpha_max)
    x = q.copy() if free == "rate" else 1.0 / z

    def evaluate(xs, which):
        qq, zz = (xs, z[which]) if free == "rate" else (q[which], 1.0 / xs)
        return optimal_orders(qq, zz, steps, delta, alpha[which], lo_a[which], hi_a[which])

    def record(xs, which, e, a):
        ok = e <= goal[which]
        w = which[ok]
        x[w], eps[w], alpha[w] = xs[ok], e[ok], a[ok]
        return ok

    # bracket: grow x until the order-minimized ε breaks the goal (or x reaches the ceiling)
    unsafe, e_unsafe = np.full(x.shape[0], np.nan), np.full(x.shape[0], np.nan)
    factor = 1.0 + np.clip(2.0 * (goal / np.maximum(eps, 1e-300) - 1.0), 1e-5, 1.0)
    todo = np.flatnonzero(x < ceiling)
    for _ in range(64):
        if todo.size == 0:
            break
        trial = np.minimum(x[todo] * factor[todo], ceiling)
        e, a = evaluate(trial, todo)
        ok = record(trial, todo, e, a)
        unsafe[todo[~ok]], e_unsafe[todo[~ok]] = trial[~ok], e[~ok]
        factor[todo] = factor[todo] ** 2
        todo = todo[ok & (trial < ceiling)]
    bracketed = np.flatnonzero(~np.isnan(unsafe))
    if bracketed.size:
        def step(lx, which, _):
            xs = np.exp(lx)
            e, a = evaluate(xs, bracketed[which])
            return np.log(np.maximum(e, 1e-300)) - np.log(goal[bracketed[which]]), record(xs, bracketed[which], e, a)

        def active(which, b):
            k = bracketed[which]
            return (eps[k] < goal[k] * (1 - rtol)) & (np.abs(b.other[which] - b.kept[which]) > 1e-12)

        b = bracketed
        illinois(step, np.log(x[b]), np.log(unsafe[b]), np.log(np.maximum(eps[b], 1e-300)) - np.log(goal[b]),
                 np.log(e_unsafe[b]) - np.log(goal[b]), active, 60)
    if free == "rate":
        q = x
    else:
        z = 1.0 / x
    return q, z, eps, alpha


def polish(free, q, z, steps, delta, orders, idx, targets, rounds=6, pilots=64):
    """Push each point's free parameter to its budget at the point's own optimal order.

    Many points ordered along a path (calibration's curves): the optimal order moves slowly and
    continuously along it, so only ``pilots`` evenly spaced points search for their order; the
    others take the order interpolated between their pilots and only solve the fixed-order root
    (their ε is still exact at that order; what a slightly-off order costs is second order).

    Args:
        free: "rate" (raise q_p, at most 1) or "noise" (lower z_p, at least ``_grid.Z_FLOOR``).
        q: (P,) float64 Poisson sample rates in [0, 1].
        z: (P,) float64 noise multipliers σ (noise std / clip norm), or (1,); (q_p, z_p) must meet
            ε ≤ target·(1 − MARGIN) on the grid ``orders`` at order index ``idx``.
        steps: T, the number of steps.
        delta: δ in (0, 1).
        orders: (n,) float64 the grid of RDP orders α > 1, ascending.
        idx: (P,) int index into ``orders`` of each point's best grid order.
        targets: (P,) float64 budgets ε > 0.
        rounds: the most alternations (best order, fixed-order root) per point.
        pilots: how many points search for their order when P > 4·pilots (0: every point does).
    Returns:
        (q, z, eps, alpha), each (P,) float64, new arrays: ε is the exact accounting of (q_p, z_p) at
        order α_p and never above target·(1 − MARGIN).
    """
    q = np.asarray(q, dtype=np.float64).copy()
    p = q.shape[0]
    z = np.broadcast_to(np.asarray(z, dtype=np.float64), (p,)).copy()
    goal = np.asarray(targets, dtype=np.float64) * (1.0 - _grid.MARGIN)
    if pilots and p > 4 * pilots:
        at = np.unique(np.linspace(0, p - 1, pilots).round().astype(np.intp))
        q_p, z_p, _, alpha_p = polish(free, q[at], z[at], steps, delta, orders, idx[at], targets[at], rounds, 0)
        alpha = np.exp(np.interp(np.arange(p), at, np.log(alpha_p)))
        # how far the pilots' increasing parameter (q, or 1/z) moved: the others move about as far
        moved = q_p / q[at] if free == "rate" else z[at] / z_p
        factor = np.exp(np.interp(np.arange(p), at, np.log(moved)))
        eps = eps_at(q, z, steps, delta, alpha)
        grid_alpha = orders[idx]
        off = eps > goal              # interpolated order worse than the grid's here: keep the grid's
        alpha[off] = grid_alpha[off]
        eps[off] = eps_at(q[off], z[off], steps, delta, alpha[off])
        todo = np.flatnonzero((eps < goal * (1 - 1e-6)) & ((q < 1.0) if free == "rate" else (z > _grid.Z_FLOOR))
                              & (q > 0.0))
        if todo.size:
            new, eps[todo] = _fixed_order_root(free, q[todo], z[todo], steps, delta, alpha[todo], goal[todo],
                                               1.0 if free == "rate" else 1.0 / _grid.Z_FLOOR, eps[todo],
                                               factor[todo])
            if free == "rate":
                q[todo] = new
            else:
                z[todo] = new
        return _unstall(free, q, z, steps, delta, orders, eps, alpha, goal)
    n = orders.shape[0]
    lo, hi = orders[np.maximum(idx - 1, 0)], orders[np.minimum(idx + 1, n - 1)]
    eps, alpha = optimal_orders(q, z, steps, delta, orders[idx], lo, hi)
    ceiling = 1.0 if free == "rate" else 1.0 / _grid.Z_FLOOR
    active = np.flatnonzero((eps < goal * (1 - 1e-6)) & ((q < 1.0) if free == "rate" else (z > _grid.Z_FLOOR))
                            & (q > 0.0))
    for _ in range(rounds):
        if active.size == 0:
            break
        a = active
        new, e = _fixed_order_root(free, q[a], z[a], steps, delta, alpha[a], goal[a], ceiling)
        old = q[a] if free == "rate" else z[a]
        if free == "rate":
            q[a] = new
        else:
            z[a] = new
        eps[a] = e
        # the optimal order moves with the parameter: look for it near the current one
        # (within the grid's range: an optimum at its edge stays there, and is reported as such)
        e2, a2 = optimal_orders(q[a], z[a], steps, delta, alpha[a], np.maximum(alpha[a] / 1.1, orders[0]),
                                np.minimum(alpha[a] * 1.1, orders[-1]))
        better = e2 < eps[a]
        eps[a[better]], alpha[a[better]] = e2[better], a2[better]
        active = a[(np.abs(new / old - 1.0) > _PARAM_RTOL) & better & (eps[a] < goal[a] * (1 - 1e-6))]
    return _unstall(free, q, z, steps, delta, orders, eps, alpha, goal)


def _unstall(free, q, z, steps, delta, orders, eps, alpha, goal):
    """Points still short of their goal after a fixed-order root (stalled at a cliff): finish them
    with the order-minimized root. Updates and returns (q, z, eps, alpha)."""
    stalled = np.flatnonzero((eps < goal * (1 - _STALL_RTOL)) & (q > 0.0)
                             & ((q < 1.0) if free == "rate" else (z > _grid.Z_FLOOR)))
    if stalled.size:
        s = stalled
        ceiling = 1.0 if free == "rate" else 1.0 / _grid.Z_FLOOR
        q[s], z[s], eps[s], alpha[s] = _order_minimized_root(free, q[s], z[s], steps, delta, alpha[s], eps[s], goal[s],
                                                             ceiling, orders[0], orders[-1])
    return q, z, eps, alpha
