"""Fast exact ε evaluation on grids and inversion of monotone ε curves (calibration's engine).

Calibrating a million distinct budgets cannot afford an RDP evaluation per record, so every
inversion here works on a *curve*: ε evaluated exactly at a few thousand parameter values (sample
rates at a fixed noise multiplier, or noise multipliers at a fixed sample rate), then read off by
rounding each budget to the safe side of the grid (floor in q, ceil in z). A grid point's ε is an
exact accounting of that very parameter, so the result never overshoots; consecutive grid points
differ by a ratio ≤ ``ratio`` in ε, which bounds the waste. Few distinct targets are then refined
to the exact root (vectorized regula falsi), still keeping the safe side of every bracket.

Speed comes from two facts:
* the optimal order moves monotonically and slowly along such a curve, so after a coarse pass over
  all orders every other point only needs a window of a few orders (any subset of orders gives a
  valid bound; a window whose optimum lands on its edge is widened and re-evaluated);
* fractional orders are evaluated by the trapezoidal rule on A_α = E_{u~N(0,1)}[(1 − q +
  q·e^{u/z − 1/(2z²)})^α], which converges exponentially for this analytic integrand (strip of
  half-width πz around the real axis) and agrees with the Opacus series to ~1e-16 in A_α, at a
  fixed cost, instead of the series whose tail decays only polynomially when q is large
  (thousands of terms). Integer orders use the all-positive-terms sum of ``sgm.log_a_int``; the
  math of one step (``rdp_one_step``) lives in the leaf ``sgm``.
"""
from __future__ import annotations

import numpy as np

from .roots import illinois
from .sgm import eps_from_rdp, rdp_one_step

MARGIN = 1e-7          # certify ε ≤ budget·(1 − MARGIN); covers other accountants' rounding
Q_FLOOR = 1e-12        # smallest sampling rate a calibration will hand out
Z_MAX = 1e6            # largest noise multiplier a calibration will search
Z_FLOOR = 0.05         # smallest one (quadrature cost grows as 1/z²; below it ε is huge anyway)


def eps_masked(q, z, steps, delta, orders, mask=None):
    """ε(δ) of ``steps`` SGM steps at points (q_p, z_p): min over the orders selected by ``mask``.

    ε is clamped at 0: the conversion of Balle et al. can go negative for tiny RDP and large δ
    (Opacus reports that as is), which as a guarantee means (0, δ).

    Args:
        q: (P,) float64 Poisson sample rates in [0, 1] (either q or z may be (1,)).
        z: (P,) float64 noise multipliers σ ≥ 0 (noise std / clip norm).
        steps: T, the number of steps (RDP is multiplied by it).
        delta: δ in (0, 1).
        orders: (n,) float64 RDP orders α > 1.
        mask: (P, n) bool, the (point, order) pairs evaluated; None: all orders.
    Returns:
        (eps, idx): eps (P,) float64 ε ≥ 0; idx (P,) intp index into ``orders`` of the minimizing order.
    """
    rdp = rdp_one_step(q, z, orders, mask) * float(steps)
    eps, idx = eps_from_rdp(orders, rdp, delta)
    return np.maximum(eps, 0.0), idx


def _window_mask(lo: np.ndarray, hi: np.ndarray, n: int) -> np.ndarray:
    cols = np.arange(n)
    return (cols >= lo[:, None]) & (cols <= hi[:, None])


def eps_windowed(q, z, steps, delta, orders, lo, hi):
    """ε(δ) at points (q_p, z_p), minimized over a per-point window of order indices [lo_p, hi_p].

    Where the optimum lands on an inner edge of the window, orders beyond that edge are added (6, 12,
    24, ... at a time) until it does not, so the result is the all-orders minimum over any unimodal
    stretch of orders.

    Args:
        q: (P,) float64 Poisson sample rates in [0, 1].
        z: (P,) or (1,) float64 noise multipliers σ ≥ 0 (noise std / clip norm).
        steps: T, the number of steps.
        delta: δ in (0, 1).
        orders: (n,) float64 RDP orders α > 1, ascending.
        lo, hi: (P,) int order indices bounding each point's first window (clipped to [0, n − 1];
            the arrays passed are not modified).
    Returns:
        (eps, idx): eps (P,) float64 ε ≥ 0; idx (P,) intp index into ``orders`` of the minimizing order.
    """
    n = orders.shape[0]
    lo, hi = np.clip(lo, 0, n - 1).astype(np.intp), np.clip(hi, 0, n - 1).astype(np.intp)
    eps, idx = eps_masked(q, z, steps, delta, orders, _window_mask(lo, hi, n))
    z_all = np.broadcast_to(np.asarray(z, dtype=np.float64), (np.shape(q)[0],))
    width = 6
    while True:
        down = (idx == lo) & (lo > 0)
        up = (idx == hi) & (hi < n - 1)
        todo = np.flatnonzero(down | up)
        if todo.size == 0:
            return eps, idx
        d = down[todo]
        u = up[todo] & ~d          # a one-order window at an edge: widen downwards first
        new_lo = np.where(d, np.maximum(0, lo[todo] - width), hi[todo] + 1)
        new_hi = np.where(d, lo[todo] - 1, np.minimum(n - 1, hi[todo] + width))
        e2, i2 = eps_masked(q[todo], z_all[todo], steps, delta, orders, _window_mask(new_lo, new_hi, n))
        better = e2 < eps[todo]
        eps[todo[better]], idx[todo[better]] = e2[better], i2[better]
        lo[todo[d]] = new_lo[d]
        hi[todo[u]] = new_hi[u]
        # a point whose optimum did not move beyond the old edge is done: mark it interior
        stay = todo[~better]
        lo[stay], hi[stay] = np.minimum(lo[stay], idx[stay] - 1), np.maximum(hi[stay], idx[stay] + 1)
        lo[stay] = np.where(idx[stay] == 0, 0, lo[stay])
        hi[stay] = np.where(idx[stay] == n - 1, n - 1, hi[stay])
        width *= 2


def eps_curve(q, z, steps, delta, orders, window=None):
    """ε(δ) at points (q_p, z_p) ordered along a path on which ε is monotone (so is the optimal order).

    A coarse pass (every ~P/24-th point) over all orders (or over ``window``, widened where the
    optimum lands on its edge), then finer levels with windows from their neighbors.

    Args:
        q: (P,) float64 Poisson sample rates in [0, 1], in path order.
        z: (P,) or (1,) float64 noise multipliers σ ≥ 0 (noise std / clip norm), in path order.
        steps: T, the number of steps.
        delta: δ in (0, 1).
        orders: (n,) float64 RDP orders α > 1, ascending.
        window: (lo, hi) order indices for the coarse pass; None: all orders.
    Returns:
        (eps, idx): eps (P,) float64 ε ≥ 0; idx (P,) intp index into ``orders`` of each point's optimal order.
    """
    q = np.asarray(q, dtype=np.float64)
    p = q.shape[0]
    z = np.broadcast_to(np.asarray(z, dtype=np.float64), (p,))
    eps = np.empty(p)
    idx = np.empty(p, dtype=np.intp)
    stride = max(1, p // 24)
    done = np.unique(np.r_[np.arange(0, p, stride), p - 1])
    if window is None:
        eps[done], idx[done] = eps_masked(q[done], z[done], steps, delta, orders)
    else:
        lo, hi = np.full(done.size, window[0]), np.full(done.size, window[1])
        eps[done], idx[done] = eps_windowed(q[done], z[done], steps, delta, orders, lo, hi)
    pad = 2
    while done.size < p:
        stride = max(1, stride // 8)
        new = np.setdiff1d(np.arange(0, p, stride), done, assume_unique=False)
        pos = np.searchsorted(done, new)
        left, right = done[pos - 1], done[np.minimum(pos, done.size - 1)]
        lo = np.minimum(idx[left], idx[right]) - pad
        hi = np.maximum(idx[left], idx[right]) + pad
        eps[new], idx[new] = eps_windowed(q[new], z[new], steps, delta, orders, lo, hi)
        done = np.union1d(done, new)
        pad = 1
    return eps, idx


# ----------------------------------------------------------------------------------------------
# Curves: ε(q) at a fixed z, ε(z) at a fixed q
# ----------------------------------------------------------------------------------------------
class Curve:
    """A monotone curve of exactly accounted points: ε(q) at a fixed z, or ε(z) at a fixed q.

    Args:
        param: (K,) float64 parameter values (sample rates q or noise multipliers z), ascending.
        eps: (K,) float64 the exact ε of each point.
        order_idx: (K,) intp index of each point's optimal RDP order.
        increasing: True when ε increases with ``param`` (ε(q)), False when it decreases (ε(z)).
    """

    def __init__(self, param, eps, order_idx, increasing: bool):
        self.param, self.eps, self.order_idx, self.increasing = param, eps, order_idx, increasing

    def safe_index(self, budgets: np.ndarray) -> np.ndarray:
        """Per budget, the index of the best grid point whose ε ≤ budget·(1 − MARGIN) (largest q / smallest z).

        Args:
            budgets: (U,) float64 ε targets > 0.
        Returns:
            (U,) intp indices into ``param``; -1 where no point qualifies.
        """
        b = budgets * (1.0 - MARGIN)
        if self.increasing:
            ref = np.maximum.accumulate(self.eps)        # ref ≥ eps: reading it off stays safe
            return np.searchsorted(ref, b, side="right") - 1
        ref = np.maximum.accumulate(self.eps[::-1])[::-1]
        first = np.searchsorted(-ref, -b, side="left")   # first index with ref ≤ b
        return np.where(first >= ref.shape[0], -1, first)

    def interpolate(self, budgets: np.ndarray) -> np.ndarray:
        """Approximate inverse ε ↦ parameter by log-log linear interpolation: a smooth surrogate, not safe.

        Args:
            budgets: (U,) float64 ε values > 0.
        Returns:
            (U,) float64 parameter values (clamped to the curve's ends); their ε may exceed the budgets.
        """
        le = np.log(np.maximum.accumulate(self.eps) if self.increasing
                    else np.maximum.accumulate(self.eps[::-1])[::-1])
        lp = np.log(self.param)
        if not self.increasing:
            le, lp = le[::-1], lp[::-1]
        le = le + np.arange(le.shape[0]) * 1e-15   # strictly increasing for np.interp
        return np.exp(np.interp(np.log(budgets), le, lp))


def fine_points(coarse_p, coarse_e, a, b, ratio, floor):
    """Log-spaced points on [p_a, p_b] so consecutive ε differ by ≤ ratio.

    The spacing comes from the coarse elasticity |d log ε / d log p| with a safety factor 1.3 (at
    least 0.05); ε below ``floor`` is not resolved.

    Args:
        coarse_p: (K,) float64 parameters > 0, ascending.
        coarse_e: (K,) float64 their ε.
        a, b: int indices (a ≤ b) of the stretch of ``coarse_p`` to fill.
        ratio: the largest ratio > 1 wanted between consecutive ε.
        floor: ε below this is clamped to it when estimating the elasticity.
    Returns:
        (M,) float64 log-spaced points from p_a to p_b, M ≥ 2; [p_a] alone when p_b ≤ p_a.
    """
    pa, pb = coarse_p[a], coarse_p[b]
    if pb <= pa:
        return np.array([pa])
    le = np.log(np.maximum(coarse_e[a:b + 1], floor))
    lp = np.log(coarse_p[a:b + 1])
    elasticity = np.max(np.abs(np.diff(le)) / np.diff(lp)) if b > a else 1.0
    elasticity = max(float(elasticity), 0.05) * 1.3
    n = int(np.ceil(np.log(pb / pa) * elasticity / np.log(ratio))) + 1
    return np.geomspace(pa, pb, max(n, 2))


def _close_gaps(points, eps, idx, evaluate, ratio, floor, max_rounds=16):
    """Insert points into cells whose two ends' ε differ by more than ``ratio`` (the coarse
    elasticity can miss a steep stretch, e.g. where the optimal order jumps between sparse large
    orders) until none does or the cells are 1e-9 wide. ε below ``floor`` (no budget there) is
    not resolved. ``evaluate(params, lo, hi)``."""
    for _ in range(max_rounds):
        e = np.maximum(eps, floor)
        gap = np.maximum(e[1:], e[:-1]) / np.minimum(e[1:], e[:-1])
        bad = np.flatnonzero((gap > ratio) & (points[1:] > points[:-1] * (1 + 1e-9)))
        if bad.size == 0:
            break
        k = np.minimum(64, np.ceil(np.log(gap[bad]) / np.log(ratio))).astype(np.intp)
        cell = np.repeat(bad, k)
        t = (np.arange(cell.shape[0]) - np.repeat(np.cumsum(k) - k, k) + 1) / np.repeat(k + 1, k)
        lp = np.log(points)
        new = np.exp(lp[cell] + t * (lp[cell + 1] - lp[cell]))
        lo = np.minimum(idx[cell], idx[cell + 1]) - 2
        hi = np.maximum(idx[cell], idx[cell + 1]) + 2
        e_new, i_new = evaluate(new, lo, hi)
        order = np.argsort(np.r_[points, new], kind="stable")
        points, eps, idx = np.r_[points, new][order], np.r_[eps, e_new][order], np.r_[idx, i_new][order]
    return points, eps, idx


def q_curve(z, steps, delta, eps_lo, eps_hi, orders, ratio=1.002, n_coarse=49, q_lo=Q_FLOOR):
    """ε(q) at fixed z over the sampling rates whose ε spans [eps_lo, eps_hi] (q ≤ 1).

    The first grid point has ε ≤ eps_lo unless even q_lo (1e-12) cannot meet eps_lo; the last is
    q = 1 or has ε ≥ eps_hi.

    Args:
        z: the noise multiplier σ > 0 (noise std / clip norm), a float.
        steps: T, the number of steps.
        delta: δ in (0, 1).
        eps_lo, eps_hi: the range of ε to cover (floats > 0).
        orders: (n,) float64 RDP orders α > 1, ascending.
        ratio: the largest ratio > 1 between consecutive ε of the fine grid; None: the coarse curve only.
        n_coarse: points of the coarse log-spaced grid on [q_lo, 1].
        q_lo: the smallest rate considered, in (0, 1).
    Returns:
        an increasing :class:`Curve` over q (its ε is the running maximum on the coarse curve).
    """
    coarse = np.geomspace(q_lo, 1.0, n_coarse)
    ce, ci = eps_curve(coarse, np.array([z]), steps, delta, orders)
    ce = np.maximum.accumulate(ce)
    a = max(0, int(np.searchsorted(ce, eps_lo * (1 - MARGIN), side="right")) - 1)
    b = min(n_coarse - 1, int(np.searchsorted(ce, eps_hi, side="left")))
    b = max(b, min(a + 1, n_coarse - 1))
    if ratio is None:                   # coarse curve only
        return Curve(coarse, ce, ci, True)
    fine = fine_points(coarse, ce, a, b, ratio, 0.5 * eps_lo)
    if b == n_coarse - 1:
        fine[-1] = 1.0
    fe, fi = eps_curve(fine, np.array([z]), steps, delta, orders)
    fine, fe, fi = _close_gaps(fine, fe, fi, lambda qs, lo, hi: eps_windowed(qs, np.array([z]), steps, delta,
                                                                           orders, lo, hi), ratio, 0.5 * eps_lo)
    return Curve(fine, fe, fi, True)


def z_curve(q, steps, delta, eps_lo, eps_hi, orders, ratio=1.002, z_lo=Z_FLOOR, z_hi=Z_MAX):
    """ε(z) at fixed q over the noise multipliers whose ε spans [eps_lo, eps_hi] (z ascending, ε descending).

    The last grid point has ε ≤ eps_lo unless even z_hi cannot meet it.

    Args:
        q: the Poisson sample rate in (0, 1], a float.
        steps: T, the number of steps.
        delta: δ in (0, 1).
        eps_lo, eps_hi: the range of ε to cover (floats > 0).
        orders: (n,) float64 RDP orders α > 1, ascending.
        ratio: the largest ratio > 1 between consecutive ε of the fine grid; None: the coarse curve only.
        z_lo, z_hi: the range of noise multipliers (σ = noise std / clip norm) searched.
    Returns:
        a decreasing :class:`Curve` over z (its ε is the running maximum from the right on the coarse curve).
    """
    # Coarse scan from z = 0.3 up (ratio 1.5); below 0.3 (costly quadrature) only when needed.
    coarse = np.geomspace(0.3, z_hi, 36)
    qs = np.full(coarse.shape[0], float(q))
    ce, ci = eps_curve(qs, coarse, steps, delta, orders)
    if ce[0] < eps_hi and z_lo < 0.3:
        low = np.geomspace(z_lo, 0.3, 6)[:-1]
        le, li = eps_curve(np.full(low.shape[0], float(q)), low, steps, delta, orders)
        coarse, ce, ci = np.r_[low, coarse], np.r_[le, ce], np.r_[li, ci]
    n_coarse = coarse.shape[0]
    ce = np.maximum.accumulate(ce[::-1])[::-1]
    hi_i = min(n_coarse - 1, int(np.searchsorted(-ce, -eps_lo * (1 - MARGIN), side="left")))
    lo_i = max(0, min(int(np.searchsorted(-ce, -eps_hi, side="right")) - 1, hi_i - 1))
    if ratio is None:
        return Curve(coarse, ce, ci, False)
    fine = fine_points(coarse, ce, lo_i, hi_i, ratio, 0.5 * eps_lo)
    fe, fi = eps_curve(np.full(fine.shape[0], float(q)), fine, steps, delta, orders)
    fine, fe, fi = _close_gaps(fine, fe, fi, lambda zs, lo, hi: eps_windowed(np.full(zs.shape[0], float(q)), zs,
                                                                           steps, delta, orders, lo, hi), ratio,
                               0.5 * eps_lo)
    return Curve(fine, fe, fi, False)


# ----------------------------------------------------------------------------------------------
# Exact refinement of few targets
# ----------------------------------------------------------------------------------------------
def refine(evaluate, safe, unsafe, eps_safe, idx_safe, idx_unsafe, eps_unsafe, targets, rtol=1e-9,
           max_iter=60):
    """Root of ε(p) = target·(1 − MARGIN) on the safe side, per target: Illinois regula falsi
    (``roots.illinois``) in log-parameter space on a monotone ε.

    Stops when the safe end's ε is within rtol of the goal or the bracket is 1e-12 wide (in log p).

    Args:
        evaluate: ``evaluate(params, lo, hi, which) -> (eps, idx)`` evaluates the targets ``which``
            (k,) at params (k,) with order windows [lo, hi] (k,), returning ε (k,) and the optimal
            order index (k,).
        safe: (R,) float64 parameters > 0 with ε = eps_safe ≤ target·(1 − MARGIN).
        unsafe: (R,) float64 parameters > 0 with ε = eps_unsafe above it; with ``safe`` it brackets each root.
        eps_safe, eps_unsafe: (R,) float64 the ε at the two ends.
        idx_safe, idx_unsafe: (R,) int optimal order indices at the two ends (they set the windows).
        targets: (R,) float64 budgets ε > 0.
        rtol: relative tolerance of the safe end's ε below the goal.
        max_iter: the most steps per target.
    Returns:
        (params, eps, idx), each (R,), new arrays: the safe parameters, their ε and their optimal order
        index; always parameters that were evaluated (or the starting safe ends).
    """
    goal = targets * (1.0 - MARGIN)
    ps = safe.astype(np.float64).copy()
    es, is_, iu = eps_safe.astype(np.float64).copy(), idx_safe.copy(), idx_unsafe.copy()

    def step(x, a, _):
        px = np.exp(x)
        e, i = evaluate(px, np.minimum(is_[a], iu[a]) - 1, np.maximum(is_[a], iu[a]) + 1, a)
        ok = e <= goal[a]          # the safe test itself is direct: logs only steer the interpolation
        ps[a[ok]], es[a[ok]], is_[a[ok]] = px[ok], e[ok], i[ok]
        iu[a[~ok]] = i[~ok]
        with np.errstate(divide="ignore"):  # ε = 0 (large δ, tiny rates): log −inf steers like any other
            return np.log(e) - np.log(goal[a]), ok

    def active(a, b):
        return (es[a] < goal[a] * (1 - rtol)) & (np.abs(b.other[a] - b.kept[a]) > 1e-12)

    with np.errstate(divide="ignore"):
        start_safe, start_unsafe = np.log(eps_safe) - np.log(goal), np.log(eps_unsafe) - np.log(goal)
    illinois(step, np.log(ps), np.log(unsafe), start_safe, start_unsafe, active, max_iter)
    return ps, es, is_


# ----------------------------------------------------------------------------------------------
# Inversions used by the public functions and by calibration
# ----------------------------------------------------------------------------------------------
REFINE_MAX = 4096      # up to this many distinct targets are refined to the exact root


class BudgetError(ValueError):
    """A budget that no admissible parameter meets; ``budget`` names the first offender."""

    def __init__(self, message: str, budget: float):
        super().__init__(message)
        self.budget = budget


def noise_limit_message(budget, delta, orders) -> str:
    """Why no noise multiplier ≤ ``Z_MAX`` meets ``budget``, naming the orders when they are the limit.

    As z → ∞ the RDP vanishes and ε tends to the conversion term alone, min_α (−log δ − log α)/(α − 1)
    + log((α − 1)/α) (Balle et al. 2020), which only larger orders lower: a budget at or below it
    cannot be met by any noise with these orders, however large.

    Args:
        budget: the budget ε > 0 that was not met.
        delta: δ in (0, 1).
        orders: (n,) float64 RDP orders α > 1, ascending.
    Returns:
        the reason, as a sentence fragment.
    """
    a = np.asarray(orders, dtype=np.float64)
    floor = float(np.min((-np.log(delta) - np.log(a)) / (a - 1.0) + np.log((a - 1.0) / a)))
    text = f"it would need a noise multiplier above {Z_MAX:g}"
    if budget * (1.0 - MARGIN) <= floor * (1.0 + 1e-3):
        text += (f"; the largest RDP order, {a[-1]:g}, is what limits it: with these orders ε cannot go below "
                 f"{floor:.4g} at delta={delta:g} whatever the noise, so pass orders= with larger orders "
                 f"(e.g. up to {a[-1] * 8:g}; pdpfast.calibrate takes them)")
    return text


def solve_rate(z, steps, delta, targets, orders, ratio=0.0005):
    """Largest q ≤ 1 with ε(q; z) ≤ target·(1 − MARGIN) for sorted distinct ``targets``.

    Few targets (≤ ``REFINE_MAX``): exact roots; many: a grid whose consecutive ε differ by ≤ 1 + ratio,
    read off downwards.

    Args:
        z: the noise multiplier σ > 0 (noise std / clip norm), a float.
        steps: T, the number of steps.
        delta: δ in (0, 1).
        targets: (U,) float64 budgets ε > 0, ascending and distinct.
        orders: (n,) float64 RDP orders α > 1, ascending.
        ratio: grid resolution for many targets (consecutive ε within a factor 1 + ratio).
    Returns:
        (q, eps, idx), each (U,): rates in (0, 1], their exact ε, their optimal order index.
    Raises:
        BudgetError naming the first target that would need a rate below ``Q_FLOOR``.
    """
    few = targets.shape[0] <= REFINE_MAX
    curve = q_curve(z, steps, delta, targets[0], targets[-1], orders, ratio=None if few else 1.0 + ratio)
    j = curve.safe_index(targets)
    if np.any(j < 0):
        raise BudgetError(f"it would need a sample rate below {Q_FLOOR:g}", float(targets[j < 0][0]))
    q, eps, idx = curve.param[j].copy(), curve.eps[j].copy(), curve.order_idx[j].copy()
    need = (j < curve.param.shape[0] - 1) & (q < 1.0)
    if few and need.any():
        k = j[need]

        def evaluate(qs, lo, hi, _):
            return eps_windowed(qs, np.array([z]), steps, delta, orders, lo, hi)

        q[need], eps[need], idx[need] = refine(evaluate, curve.param[k], curve.param[k + 1], curve.eps[k],
                                               curve.order_idx[k], curve.order_idx[k + 1], curve.eps[k + 1],
                                               targets[need])
    return q, eps, idx


def solve_noise(q, steps, delta, targets, orders, ratio=0.0005):
    """Smallest z with ε(q; z) ≤ target·(1 − MARGIN) for sorted distinct ``targets``.

    Exact roots for few targets (≤ ``REFINE_MAX``), a grid rounded upwards for many.

    Args:
        q: the Poisson sample rate in (0, 1], a float.
        steps: T, the number of steps.
        delta: δ in (0, 1).
        targets: (U,) float64 budgets ε > 0, ascending and distinct.
        orders: (n,) float64 RDP orders α > 1, ascending.
        ratio: grid resolution for many targets (consecutive ε within a factor 1 + ratio).
    Returns:
        (z, eps, idx), each (U,): noise multipliers σ (noise std / clip norm), their exact ε, their
        optimal order index.
    Raises:
        BudgetError naming the first target that would need a noise multiplier above ``Z_MAX``.
    """
    few = targets.shape[0] <= REFINE_MAX
    curve = z_curve(q, steps, delta, targets[0], targets[-1], orders, ratio=None if few else 1.0 + ratio)
    j = curve.safe_index(targets)
    if np.any(j < 0):
        budget = float(targets[j < 0][0])
        raise BudgetError(noise_limit_message(budget, delta, orders), budget)
    z, eps, idx = curve.param[j].copy(), curve.eps[j].copy(), curve.order_idx[j].copy()
    need = j > 0
    if few and need.any():
        k = j[need]

        def evaluate(zs, lo, hi, _):
            return eps_windowed(np.full(zs.shape[0], float(q)), zs, steps, delta, orders, lo, hi)

        z[need], eps[need], idx[need] = refine(evaluate, curve.param[k], curve.param[k - 1], curve.eps[k],
                                               curve.order_idx[k], curve.order_idx[k - 1], curve.eps[k - 1],
                                               targets[need])
    return z, eps, idx


def noise_guess_table(q_axis, z_axis, steps, delta, orders, window):
    """A coarse exact table ε(q, z) on log-spaced axes, to start per-pair noise solves.

    Args:
        q_axis: (nq,) float64 sample rates in (0, 1], ascending (log-spaced).
        z_axis: (nz,) float64 noise multipliers σ > 0 (noise std / clip norm), ascending, nz ≥ 2.
        steps: T, the number of steps.
        delta: δ in (0, 1).
        orders: (n,) float64 RDP orders α > 1, ascending.
        window: (lo, hi) order indices for each column's coarse pass (``eps_curve``), or None.
    Returns:
        a function ``guess(sample_rates (G,), targets (G,)) -> (z (G,) float64, order index (G,) intp)``
        that interpolates log ε linearly in log q, then inverts it in log z (extrapolating off the table).
    """
    lq, lz = np.log(q_axis), np.log(z_axis)
    nq, nz = lq.shape[0], lz.shape[0]
    eps = np.empty((nq, nz))
    idx = np.empty((nq, nz), dtype=np.intp)
    for k in range(nz):
        eps[:, k], idx[:, k] = eps_curve(q_axis, np.array([z_axis[k]]), steps, delta, orders, window=window)
    le = np.log(eps)

    def guess(sample_rates, targets):
        lr, lt = np.log(sample_rates), np.log(targets)
        col = np.stack([np.interp(lr, lq, le[:, k]) for k in range(nz)], axis=1)     # (G, nz), ↓ in k
        k = np.clip((col > lt[:, None]).sum(axis=1) - 1, 0, nz - 2)
        rows = np.arange(lr.shape[0])
        e0, e1 = col[rows, k], col[rows, k + 1]
        with np.errstate(invalid="ignore", divide="ignore"):
            t = np.where(e0 != e1, (e0 - lt) / (e0 - e1), 0.5)
        z = np.exp(lz[k] + np.clip(t, -3.0, 4.0) * (lz[k + 1] - lz[k]))
        iq = np.clip(np.searchsorted(lq, lr), 0, nq - 1)
        return z, idx[iq, np.clip(k + (t > 0.5), 0, nz - 1)]

    return guess


def solve_noise_pairs(sample_rates, targets, steps, delta, orders, guess, guess_idx, rtol=1e-9, pilots=24):
    """Smallest z_g with ε(q_g; z_g) ≤ target_g·(1 − MARGIN) for G pairs (q_g, target_g).

    When the pairs are ordered along a path (as calibration's cells are), a few evenly spaced
    pilots are solved first and interpolated to start the rest within ~1e-4.

    Args:
        sample_rates: (G,) float64 Poisson rates q_g in (0, 1].
        targets: (G,) float64 budgets ε > 0.
        steps: T, the number of steps.
        delta: δ in (0, 1).
        orders: (n,) float64 RDP orders α > 1, ascending.
        guess: (G,) float64 starting noise multipliers σ > 0 (noise std / clip norm).
        guess_idx: (G,) int, about the optimal order index at ``guess``.
        rtol: relative tolerance of the safe end's ε below the goal (``refine``).
        pilots: how many pilot pairs to solve first when G > 4·pilots (0: none).
    Returns:
        (z, eps, idx), each (G,): noise multipliers, their exact ε and optimal order index.
    Raises:
        BudgetError naming the first target that would need a noise multiplier above ``Z_MAX``.
    """
    goal = targets * (1.0 - MARGIN)
    g = targets.shape[0]
    factor = 1.02
    if pilots and g > 4 * pilots:
        at = np.unique(np.linspace(0, g - 1, pilots).round().astype(np.intp))
        zp, _, ip = solve_noise_pairs(sample_rates[at], targets[at], steps, delta, orders, guess[at],
                                      guess_idx[at], rtol=1e-6, pilots=0)
        guess = np.exp(np.interp(np.arange(g), at, np.log(zp)))
        guess_idx = np.round(np.interp(np.arange(g), at, ip)).astype(np.intp)
        factor = 1.001
    z0 = guess.astype(np.float64)
    e0, i0 = eps_windowed(sample_rates, z0, steps, delta, orders, guess_idx - 4, guess_idx + 4)
    ok0 = e0 <= goal
    safe, unsafe = np.where(ok0, z0, np.nan), np.where(ok0, np.nan, z0)
    e_s, e_u = np.where(ok0, e0, np.nan), np.where(ok0, np.nan, e0)
    i_s, i_u = i0.copy(), i0.copy()
    for _ in range(200):       # bracket: walk away from the guess in growing steps
        up = np.flatnonzero(np.isnan(safe))
        down = np.flatnonzero(np.isnan(unsafe) & (np.nan_to_num(safe, nan=np.inf) > Z_FLOOR))
        if up.size == 0 and down.size == 0:
            break
        sel = np.r_[up, down]
        zt = np.r_[unsafe[up] * factor, safe[down] / factor]
        if np.any(zt[:up.size] > Z_MAX):
            bad = up[zt[:up.size] > Z_MAX][0]
            raise BudgetError(noise_limit_message(float(targets[bad]), delta, orders), float(targets[bad]))
        ii = np.r_[i_u[up], i_s[down]]
        e2, i2 = eps_windowed(sample_rates[sel], zt, steps, delta, orders, ii - 2, ii + 2)
        ok = e2 <= goal[sel]
        s_ok, s_bad = sel[ok], sel[~ok]
        safe[s_ok], e_s[s_ok], i_s[s_ok] = zt[ok], e2[ok], i2[ok]
        unsafe[s_bad], e_u[s_bad], i_u[s_bad] = zt[~ok], e2[~ok], i2[~ok]
        factor = min(4.0, factor ** 2.5)
    out_z, out_e, out_i = safe.copy(), e_s.copy(), i_s.copy()
    todo = np.flatnonzero(~np.isnan(unsafe))   # the rest sit at the z floor, already safe
    if todo.size:
        # refine wants ε increasing in its parameter; in z it decreases: refine in w = 1/z
        def evaluate(w, lo, hi, which):
            return eps_windowed(sample_rates[todo[which]], 1.0 / w, steps, delta, orders, lo, hi)

        w, e, i = refine(evaluate, 1.0 / safe[todo], 1.0 / unsafe[todo], e_s[todo], i_s[todo], i_u[todo],
                         e_u[todo], targets[todo], rtol=rtol)
        kept = w == 1.0 / safe[todo]      # never moved: return the very z that was evaluated
        out_z[todo] = np.where(kept, safe[todo], 1.0 / w)
        out_e[todo], out_i[todo] = e, i
    return out_z, out_e, out_i
