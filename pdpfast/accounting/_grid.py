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
  (thousands of terms). Integer orders use the all-positive-terms sum of ``rdp._log_a_int``.
"""
from __future__ import annotations

import numpy as np
from scipy import special

from .rdp import _eps_from_rdp, _log_a_int

MARGIN = 1e-7          # certify ε ≤ budget·(1 − MARGIN); covers other accountants' rounding
Q_FLOOR = 1e-12        # smallest sampling rate a calibration will hand out
Z_MAX = 1e6            # largest noise multiplier a calibration will search
_QUAD_WIDTH = 13.0     # Gaussian tails beyond 13 std are < e^-84 of the mass
_ROWS_CHUNK = 1 << 20  # elements per temporary (points × quadrature nodes) array


def _is_integer_order(orders: np.ndarray) -> np.ndarray:
    return np.array([float(a).is_integer() for a in orders])


def _logsumexp_rows(x: np.ndarray) -> np.ndarray:
    """log Σ_j exp(x[:, j]) (plain numpy: scipy's version costs more in overhead than in math here)."""
    m = x.max(axis=1)
    m = np.where(np.isfinite(m), m, 0.0)
    return m + np.log(np.exp(x - m[:, None]).sum(axis=1))


def _log_a_quadrature(q: np.ndarray, z: np.ndarray, alphas: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """log A_α by the trapezoidal rule; q, z: (P,); alphas: (F,); mask (P, F). Returns (P, F), inf off-mask.

    Nodes u = −13 + m·h on [−13, α_max/z + 13] with h = min(0.5, 0.4·z): the integrand is two
    Gaussian bumps (at 0 and α/z) joined smoothly, analytic in a strip of half-width πz."""
    out = np.full(mask.shape, np.inf)
    h = np.minimum(0.5, 0.4 * z)
    n_nodes = np.ceil((alphas.max() / z + 2 * _QUAD_WIDTH) / h).astype(np.int64) + 1
    # points needing similar node counts are processed together (padding ≤ 2×)
    bucket = np.ceil(np.log2(n_nodes)).astype(np.int64)
    logit = np.log(q) - np.log1p(-q)
    for b in np.unique(bucket):
        pts = np.flatnonzero(bucket == b)
        n_b = int(n_nodes[pts].max())
        step = max(1, _ROWS_CHUNK // n_b)
        for s in range(0, pts.shape[0], step):
            e = pts[s:s + step]
            u = -_QUAD_WIDTH + np.arange(n_b) * h[e, None]
            base = np.log1p(-q[e])[:, None] + np.logaddexp(0.0, u / z[e, None] - 0.5 / z[e, None] ** 2
                                                           + logit[e, None])
            gauss = -0.5 * u * u
            log_w = np.log(h[e] / np.sqrt(2.0 * np.pi))
            for f in range(alphas.shape[0]):
                rows = np.flatnonzero(mask[e, f])
                if rows.size:
                    out[e[rows], f] = _logsumexp_rows(gauss[rows] + alphas[f] * base[rows]) + log_w[rows]
    return out


def rdp_one_step(q: np.ndarray, z: np.ndarray, orders: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """RDP of one SGM step at the (point, order) pairs selected by ``mask``; +inf elsewhere.

    q, z: (P,) float64 (z may be (1,)); orders: (n,); mask: (P, n) bool or None (all).
    """
    p = q.shape[0]
    z = np.broadcast_to(z, (p,))
    n = orders.shape[0]
    mask = np.ones((p, n), dtype=bool) if mask is None else mask
    out = np.full((p, n), np.inf)
    zero, full = q == 0.0, q == 1.0
    no_noise = (z == 0.0) & ~zero
    out[zero] = 0.0
    fz = full & ~no_noise
    if fz.any():
        out[fz] = orders[None, :] / (2.0 * z[fz, None] ** 2)
    general = np.flatnonzero(~(zero | full | no_noise))
    if general.size == 0:
        return np.where(mask, out, np.inf)
    qg, zg, mg = q[general], z[general], mask[general]
    log_q, log1m_q = np.log(qg), np.log1p(-qg)
    shared = bool(np.all(zg == zg[0]))
    inv_2z2 = 1.0 / (2.0 * (zg[:1] if shared else zg) ** 2)
    is_int = _is_integer_order(orders)
    sub = np.full((general.size, n), np.inf)
    for col in np.flatnonzero(is_int & mg.any(axis=0)):
        rows = np.flatnonzero(mg[:, col])
        alpha = int(orders[col])
        zz = inv_2z2 if shared else inv_2z2[rows]
        sub[rows, col] = _log_a_int(log_q[rows], log1m_q[rows], zz, alpha) / (alpha - 1)
    frac = np.flatnonzero(~is_int & mg.any(axis=0))
    if frac.size:
        rows = np.flatnonzero(mg[:, frac].any(axis=1))
        la = _log_a_quadrature(qg[rows], zg[rows], orders[frac], mg[np.ix_(rows, frac)])
        sub[np.ix_(rows, frac)] = la / (orders[frac] - 1.0)
    out[general] = sub
    return np.where(mask, out, np.inf)


def eps_masked(q, z, steps, delta, orders, mask=None):
    """(ε (P,), index of the optimal order (P,)) over the orders selected by mask."""
    rdp = rdp_one_step(q, z, orders, mask) * float(steps)
    return _eps_from_rdp(orders, rdp, delta)


def _window_mask(lo: np.ndarray, hi: np.ndarray, n: int) -> np.ndarray:
    cols = np.arange(n)
    return (cols >= lo[:, None]) & (cols <= hi[:, None])


def eps_windowed(q, z, steps, delta, orders, lo, hi):
    """ε with a per-point window of order indices [lo, hi]; windows whose optimum lands on an
    inner edge are widened until it does not (so the result equals the all-orders minimum over
    any unimodal stretch of orders)."""
    n = orders.shape[0]
    lo, hi = np.clip(lo, 0, n - 1).astype(np.intp), np.clip(hi, 0, n - 1).astype(np.intp)
    eps, idx = eps_masked(q, z, steps, delta, orders, _window_mask(lo, hi, n))
    todo = np.flatnonzero(((idx == lo) & (lo > 0)) | ((idx == hi) & (hi < n - 1)))
    while todo.size:
        lo[todo] = np.maximum(0, lo[todo] - 6)
        hi[todo] = np.minimum(n - 1, hi[todo] + 6)
        zt = z if np.ndim(z) == 0 or np.shape(z)[0] == 1 else z[todo]
        e2, i2 = eps_masked(q[todo], zt, steps, delta, orders, _window_mask(lo[todo], hi[todo], n))
        eps[todo], idx[todo] = e2, i2
        todo = todo[((i2 == lo[todo]) & (lo[todo] > 0)) | ((i2 == hi[todo]) & (hi[todo] < n - 1))]
    return eps, idx


def eps_curve(q, z, steps, delta, orders):
    """ε at points (q_p, z_p) ordered along a path on which ε is monotone (so is the optimal
    order): a coarse pass over all orders, then finer levels with windows from their neighbors."""
    q = np.asarray(q, dtype=np.float64)
    p = q.shape[0]
    z = np.broadcast_to(np.asarray(z, dtype=np.float64), (p,))
    n = orders.shape[0]
    eps = np.empty(p)
    idx = np.empty(p, dtype=np.intp)
    stride = max(1, p // 24)
    done = np.unique(np.r_[np.arange(0, p, stride), p - 1])
    eps[done], idx[done] = eps_masked(q[done], z[done], steps, delta, orders)
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
    """A monotone curve of exactly accounted points. ``param`` ascending; ``eps`` its ε;
    ``order_idx`` the optimal order index per point; ``increasing``: ε increases with param."""

    def __init__(self, param, eps, order_idx, increasing: bool):
        self.param, self.eps, self.order_idx, self.increasing = param, eps, order_idx, increasing

    def safe_index(self, budgets: np.ndarray) -> np.ndarray:
        """Per budget, the index of the best grid point whose ε ≤ budget·(1 − MARGIN)
        (largest q / smallest z); -1 where none qualifies."""
        b = budgets * (1.0 - MARGIN)
        if self.increasing:
            ref = np.maximum.accumulate(self.eps)        # ref ≥ eps: reading it off stays safe
            return np.searchsorted(ref, b, side="right") - 1
        ref = np.maximum.accumulate(self.eps[::-1])[::-1]
        first = np.searchsorted(-ref, -b, side="left")   # first index with ref ≤ b
        return np.where(first >= ref.shape[0], -1, first)

    def interpolate(self, budgets: np.ndarray) -> np.ndarray:
        """Approximate inverse (log-log linear interpolation): a smooth surrogate, not safe."""
        le = np.log(np.maximum.accumulate(self.eps) if self.increasing
                    else np.maximum.accumulate(self.eps[::-1])[::-1])
        lp = np.log(self.param)
        if not self.increasing:
            le, lp = le[::-1], lp[::-1]
        le = le + np.arange(le.shape[0]) * 1e-15   # strictly increasing for np.interp
        return np.exp(np.interp(np.log(budgets), le, lp))


def _fine_points(coarse_p, coarse_e, a, b, ratio, log_scale_floor=1e-300):
    """Log-spaced points on [p_a, p_b] so consecutive ε differ by ≤ ratio (from the coarse
    elasticity |d log ε / d log p| with a safety factor)."""
    pa, pb = coarse_p[a], coarse_p[b]
    if pb <= pa:
        return np.array([pa])
    le = np.log(np.maximum(coarse_e[a:b + 1], log_scale_floor))
    lp = np.log(coarse_p[a:b + 1])
    elasticity = np.max(np.abs(np.diff(le)) / np.diff(lp)) if b > a else 1.0
    elasticity = max(float(elasticity), 0.05) * 1.3
    n = int(np.ceil(np.log(pb / pa) * elasticity / np.log(ratio))) + 1
    return np.geomspace(pa, pb, max(n, 2))


def q_curve(z, steps, delta, eps_lo, eps_hi, orders, ratio=1.002, n_coarse=49, q_lo=Q_FLOOR):
    """ε(q) at fixed z over the sampling rates whose ε spans [eps_lo, eps_hi] (q ≤ 1).

    The first grid point has ε ≤ eps_lo unless even q_lo (1e-12) cannot meet eps_lo; the last is
    q = 1 or has ε ≥ eps_hi."""
    coarse = np.geomspace(q_lo, 1.0, n_coarse)
    ce, ci = eps_curve(coarse, np.array([z]), steps, delta, orders)
    ce = np.maximum.accumulate(ce)
    a = max(0, int(np.searchsorted(ce, eps_lo * (1 - MARGIN), side="right")) - 1)
    b = min(n_coarse - 1, int(np.searchsorted(ce, eps_hi, side="left")))
    b = max(b, min(a + 1, n_coarse - 1))
    if ratio is None:                   # coarse curve only
        return Curve(coarse, ce, ci, True)
    fine = _fine_points(coarse, ce, a, b, ratio)
    if b == n_coarse - 1:
        fine[-1] = 1.0
    fe, fi = eps_curve(fine, np.array([z]), steps, delta, orders)
    return Curve(fine, fe, fi, True)


def z_curve(q, steps, delta, eps_lo, eps_hi, orders, ratio=1.002, n_coarse=49, z_lo=0.05, z_hi=Z_MAX):
    """ε(z) at fixed q over the noise multipliers whose ε spans [eps_lo, eps_hi] (z ascending,
    ε descending). The last grid point has ε ≤ eps_lo unless even z_hi cannot meet it."""
    coarse = np.geomspace(z_lo, z_hi, n_coarse)
    ce, ci = eps_curve(np.full(n_coarse, float(q)), coarse, steps, delta, orders)
    ce = np.maximum.accumulate(ce[::-1])[::-1]
    hi_i = min(n_coarse - 1, int(np.searchsorted(-ce, -eps_lo * (1 - MARGIN), side="left")))
    lo_i = max(0, min(int(np.searchsorted(-ce, -eps_hi, side="right")) - 1, hi_i - 1))
    if ratio is None:
        return Curve(coarse, ce, ci, False)
    fine = _fine_points(coarse, ce, lo_i, hi_i, ratio)
    fe, fi = eps_curve(np.full(fine.shape[0], float(q)), fine, steps, delta, orders)
    return Curve(fine, fe, fi, False)


# ----------------------------------------------------------------------------------------------
# Exact refinement of few targets
# ----------------------------------------------------------------------------------------------
def refine(evaluate, safe, unsafe, eps_safe, idx_safe, idx_unsafe, eps_unsafe, targets, rtol=1e-9,
           max_iter=60):
    """Vectorized Illinois regula falsi in log-parameter space on a monotone ε.

    ``evaluate(params, lo, hi) -> (eps, idx)`` evaluates points with order windows [lo, hi].
    ``safe`` (ε = eps_safe ≤ target·(1 − MARGIN)) and ``unsafe`` (ε above it) bracket each root.
    Stops when the safe end's ε is within rtol of the goal or the bracket is 1e-12 wide. Returns
    (safe params, their ε, their optimal order index): always parameters that were evaluated."""
    goal = targets * (1.0 - MARGIN)
    ps = safe.astype(np.float64).copy()
    ls, lu = np.log(ps), np.log(unsafe)
    fs, fu = np.log(eps_safe) - np.log(goal), np.log(eps_unsafe) - np.log(goal)
    es, is_, iu = eps_safe.astype(np.float64).copy(), idx_safe.copy(), idx_unsafe.copy()
    side = np.zeros(ps.shape[0], dtype=np.int8)
    active = np.flatnonzero((es < goal * (1 - rtol)) & (np.abs(lu - ls) > 1e-12))
    for _ in range(max_iter):
        if active.size == 0:
            break
        a = active
        with np.errstate(invalid="ignore", divide="ignore"):
            x = ls[a] - fs[a] * (lu[a] - ls[a]) / (fu[a] - fs[a])
        bad = ~np.isfinite(x) | (x <= np.minimum(ls[a], lu[a])) | (x >= np.maximum(ls[a], lu[a]))
        x = np.where(bad, 0.5 * (ls[a] + lu[a]), x)
        px = np.exp(x)
        e, i = evaluate(px, np.minimum(is_[a], iu[a]) - 1, np.maximum(is_[a], iu[a]) + 1)
        fx = np.log(e) - np.log(goal[a])
        ok = fx <= 0
        s_ok, s_bad = a[ok], a[~ok]
        # Illinois: halve the residual of an end that is retained twice in a row
        fu[s_ok[side[s_ok] == 1]] *= 0.5
        fs[s_bad[side[s_bad] == -1]] *= 0.5
        ps[s_ok], ls[s_ok], fs[s_ok], es[s_ok], is_[s_ok] = px[ok], x[ok], fx[ok], e[ok], i[ok]
        lu[s_bad], fu[s_bad], iu[s_bad] = x[~ok], fx[~ok], i[~ok]
        side[s_ok], side[s_bad] = 1, -1
        active = a[(es[a] < goal[a] * (1 - rtol)) & (np.abs(lu[a] - ls[a]) > 1e-12)]
    return ps, es, is_
