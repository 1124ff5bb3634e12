"""Rényi DP of the Poisson-subsampled Gaussian mechanism (SGM), vectorized.

Numbers in, numbers out: no state lives here (the ledger holds state).

* ``compute_rdp`` agrees with Opacus 1.6 / TF Privacy (same series, same truncation rule for
  fractional orders), but broadcasts over arrays of sampling rates and noise multipliers and never
  loops in Python over records.
* Integer orders use the identity A_α = 1 + Σ_{k≥2} C(α,k)(1−q)^{α−k} q^k (e^{(k²−k)/2z²} − 1)
  (the binomial terms without the exponential sum to one), so every term is positive and
  log A_α = softplus(log Σ_{k≥2} ...) is accurate to a few ulps even when A_α − 1 is 1e-12. The
  Opacus loop evaluates log Σ_{k≥0} directly and loses those digits to cancellation: the two agree
  to 1e-10 relative wherever Opacus itself is accurate to that level, and within Opacus's own
  rounding error (about 1e-16 absolute per step in ρ) elsewhere.
* Fractional orders use the two-sided series of Mironov, Talwar & Zhang (2019, §3.3) with the
  Opacus stopping rule (stop after the first term index whose two terms are both below e^-30).
"""
from __future__ import annotations

import functools
import math
import warnings

import numpy as np
from scipy import special

__all__ = ["DEFAULT_ORDERS", "OPACUS_ORDERS", "compute_rdp", "get_privacy_spent", "get_noise_multiplier",
           "get_sample_rate", "epsilon"]

# Opacus's default grid (RDPAccountant.DEFAULT_ALPHAS) ...
OPACUS_ORDERS: tuple = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
# ... extended to large orders: small individual budgets (ε ≈ 0.05-0.3 at δ = 1e-5) are optimal at
# α in the hundreds, and the optimum must not sit at the edge of the grid.
DEFAULT_ORDERS: tuple = OPACUS_ORDERS + (64, 72, 80, 88, 96, 112, 128, 144, 160, 192, 224, 256, 320, 384,
                                         448, 512)

_CHUNK = 1 << 20            # elements per temporary (P × terms) array
_MAX_SERIES_TERMS = 10 ** 7  # fractional series: more terms than this means no convergence
_SCALAR_TAIL = 16           # finish series with this few elements left in scalar arithmetic


# ----------------------------------------------------------------------------------------------
# log A_α, integer orders
# ----------------------------------------------------------------------------------------------
def _log_expm1(x: np.ndarray) -> np.ndarray:
    """log(e^x − 1) for x > 0 without overflow."""
    x = np.asarray(x, dtype=np.float64)
    big = x > 30.0
    with np.errstate(divide="ignore"):
        small = np.log(np.expm1(np.where(big, 1.0, x)))
    return np.where(big, x + np.log1p(-np.exp(-np.where(big, x, 30.0))), small)


@functools.lru_cache(maxsize=1024)
def _log_binom_int(alpha: int) -> np.ndarray:
    """log C(α, k) for k = 0..α (cached; read-only)."""
    k = np.arange(alpha + 1, dtype=np.float64)
    if alpha <= 1000:       # exact binomials fit in float64: log of them is correct to an ulp
        out = np.log(special.binom(alpha, k))
    else:
        out = special.gammaln(alpha + 1.0) - special.gammaln(k + 1.0) - special.gammaln(alpha - k + 1.0)
    out.flags.writeable = False
    return out


def _log_a_int(log_q: np.ndarray, log1m_q: np.ndarray, inv_2z2: np.ndarray, alpha: int) -> np.ndarray:
    """log A_α for integer α ≥ 2; inputs (P,) (inv_2z2 may be (1,) when z is shared). Returns (P,)."""
    k = np.arange(2, alpha + 1, dtype=np.float64)
    log_coef = _log_binom_int(alpha)[2:]
    p = max(log_q.shape[0], inv_2z2.shape[0])
    out = np.empty(p)
    step = max(1, _CHUNK // len(k))
    shared_z = inv_2z2.shape[0] == 1
    if shared_z:
        log_bump = _log_expm1((k * k - k) * inv_2z2[0])                     # (K,)
    for s in range(0, p, step):
        e = slice(s, min(p, s + step))
        lq = log_q[e] if log_q.shape[0] > 1 else log_q
        l1 = log1m_q[e] if log1m_q.shape[0] > 1 else log1m_q
        bump = log_bump[None, :] if shared_z else _log_expm1((k * k - k)[None, :] * inv_2z2[e, None])
        terms = log_coef + k * lq[:, None] + (alpha - k) * l1[:, None] + bump
        top = terms.max(axis=1)
        top = np.where(np.isfinite(top), top, 0.0)
        log_b = top + np.log(np.exp(terms - top[:, None]).sum(axis=1))
        out[e] = np.logaddexp(0.0, log_b)
    return out


# ----------------------------------------------------------------------------------------------
# log A_α, fractional orders (two-sided series, Mironov et al. 2019 §3.3)
# ----------------------------------------------------------------------------------------------
def _log_sub(log_x: np.ndarray, log_y: np.ndarray) -> np.ndarray:
    """log(e^x − e^y) for x ≥ y, elementwise, with the conventions of Opacus's ``_log_sub``."""
    d = log_x - log_y
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        out = np.log(np.expm1(np.minimum(d, 700.0))) + log_y
    out = np.where(d > 700.0, log_x, out)
    out = np.where(np.isneginf(log_y), log_x, out)
    return np.where(d == 0.0, -np.inf, out)


def _log_a_frac(log_q: np.ndarray, log1m_q: np.ndarray, sigma: np.ndarray, alphas: np.ndarray) -> np.ndarray:
    """log A_α for fractional α. log_q, log1m_q, sigma: (P,); alphas: (F,). Returns (P, F)."""
    p, f = max(log_q.shape[0], sigma.shape[0]), alphas.shape[0]
    log_q, log1m_q, sigma = (np.broadcast_to(a, (p,)) for a in (log_q, log1m_q, sigma))
    z0 = sigma ** 2 * (log1m_q - log_q) + 0.5          # sigma² log(1/q − 1) + 1/2
    # Flattened (record, order) elements; the loop over series index i only touches elements
    # whose series has not stopped yet.
    rec = np.repeat(np.arange(p), f)
    ordr = np.tile(np.arange(f), p)
    log_a0 = np.full(p * f, -np.inf)
    log_a1 = np.full(p * f, -np.inf)
    live = np.arange(p * f)
    i = 0
    while live.size > _SCALAR_TAIL:
        r, o = rec[live], ordr[live]
        coef = special.binom(alphas, i)                  # (F,)
        with np.errstate(divide="ignore"):
            log_coef = np.log(np.abs(coef))[o]
        positive = (coef > 0)[o]
        j = alphas[o] - i
        lq, l1, sg, zz = log_q[r], log1m_q[r], sigma[r], z0[r]
        log_t0 = log_coef + i * lq + j * l1
        log_t1 = log_coef + j * lq + i * l1
        # log(1/2 erfc(x/√2)) = log Φ(−x)
        log_e0 = special.log_ndtr((zz - i) / sg)
        log_e1 = special.log_ndtr((j - zz) / sg)
        inv = 1.0 / (2.0 * sg ** 2)
        log_s0 = log_t0 + (i * i - i) * inv + log_e0
        log_s1 = log_t1 + (j * j - j) * inv + log_e1
        a0, a1 = log_a0[live], log_a1[live]
        log_a0[live] = np.where(positive, np.logaddexp(a0, log_s0), _log_sub(a0, log_s0))
        log_a1[live] = np.where(positive, np.logaddexp(a1, log_s1), _log_sub(a1, log_s1))
        live = live[~(np.maximum(log_s0, log_s1) < -30.0)]
        i += 1
    # The few series left are the slowly converging ones (large q, α near 1: their tails decay
    # only polynomially, thousands of terms): scalar arithmetic is faster there.
    for e in live:
        r, o = rec[e], ordr[e]
        log_a0[e], log_a1[e] = _log_a_frac_tail(float(log_q[r]), float(log1m_q[r]), float(sigma[r]),
                                                float(z0[r]), float(alphas[o]), i, log_a0[e], log_a1[e])
    return np.logaddexp(log_a0, log_a1).reshape(p, f)


def _log_a_frac_tail(log_q, log1m_q, sigma, z0, alpha, start, log_a0, log_a1):
    """Continue one fractional series from term ``start`` (scalar version of the loop above)."""
    inv = 1.0 / (2.0 * sigma ** 2)
    for i in range(start, _MAX_SERIES_TERMS):
        coef = special.binom(alpha, i)
        log_coef = math.log(abs(coef)) if coef != 0 else -math.inf
        j = alpha - i
        log_s0 = log_coef + i * log_q + j * log1m_q + (i * i - i) * inv + special.log_ndtr((z0 - i) / sigma)
        log_s1 = log_coef + j * log_q + i * log1m_q + (j * j - j) * inv + special.log_ndtr((j - z0) / sigma)
        if coef > 0:
            log_a0, log_a1 = np.logaddexp(log_a0, log_s0), np.logaddexp(log_a1, log_s1)
        else:
            log_a0, log_a1 = _log_sub_scalar(log_a0, log_s0), _log_sub_scalar(log_a1, log_s1)
        if max(log_s0, log_s1) < -30.0:
            return log_a0, log_a1
    warnings.warn(f"RDP series for fractional order {alpha} did not converge; that order is excluded")
    return math.inf, math.inf


def _log_sub_scalar(log_x: float, log_y: float) -> float:
    if log_y == -math.inf:
        return log_x
    if log_x == log_y:
        return -math.inf
    d = log_x - log_y
    if d > 700.0:
        return log_x
    return math.log(math.expm1(d)) + log_y if d > 0 else math.nan


def distinct_rows(*cols):
    """(first element of each distinct row, row id of each element) for equal-length 1-D columns.

    One lexsort instead of np.unique(axis=0), which is several times slower at 10^6 rows."""
    n = cols[0].shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.intp), np.zeros(0, dtype=np.intp)
    order = np.lexsort(cols[::-1])
    change = np.zeros(n, dtype=bool)
    change[0] = True
    for c in cols:
        sc = c[order]
        change[1:] |= sc[1:] != sc[:-1]
    ids = np.empty(n, dtype=np.intp)
    ids[order] = np.cumsum(change) - 1
    return order[change], ids


# ----------------------------------------------------------------------------------------------
# Public: RDP
# ----------------------------------------------------------------------------------------------
def _as_orders(orders) -> tuple[np.ndarray, bool]:
    scalar = np.ndim(orders) == 0
    arr = np.atleast_1d(np.asarray(orders, dtype=np.float64))
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"orders must be a non-empty 1-D sequence, got shape {np.shape(orders)}")
    if not np.all(arr > 1.0):
        raise ValueError(f"orders must all be > 1 (finite or inf), got min {arr.min()}")
    return arr, scalar


def _rdp_unchecked(q: np.ndarray, z: np.ndarray, orders: np.ndarray) -> np.ndarray:
    """RDP of ONE step; q, z: (P,) (either may be (1,)); orders (n,). Returns (P, n)."""
    p = max(q.shape[0], z.shape[0])
    q, z = np.broadcast_to(q, (p,)), np.broadcast_to(z, (p,))
    out = np.empty((p, orders.shape[0]))
    zero = q == 0.0
    no_noise = (z == 0.0) & ~zero
    full = (q == 1.0) & ~no_noise
    general = ~(zero | no_noise | full)
    out[zero] = 0.0
    out[no_noise] = np.inf
    with np.errstate(divide="ignore"):
        out[full] = orders[None, :] / (2.0 * z[full, None] ** 2)
    if general.any():
        out[general] = _rdp_general(q[general], z[general], orders)
    return out


def _rdp_general(q: np.ndarray, z: np.ndarray, orders: np.ndarray) -> np.ndarray:
    """0 < q < 1, z > 0: (P,) each. Returns (P, n)."""
    # One shared noise multiplier (the common case in calibration) lets terms that depend only
    # on z be computed once.
    if z.shape[0] > 1 and np.all(z == z[0]):
        z = z[:1]
    log_q, log1m_q = np.log(q), np.log1p(-q)
    inv_2z2 = 1.0 / (2.0 * z ** 2)
    out = np.empty((max(q.shape[0], z.shape[0]), orders.shape[0]))
    is_int = np.array([float(a).is_integer() for a in orders])
    finite = np.isfinite(orders)
    for col in np.flatnonzero(is_int & finite):
        alpha = int(orders[col])
        out[:, col] = _log_a_int(log_q, log1m_q, inv_2z2, alpha) / (alpha - 1)
    frac = np.flatnonzero(~is_int & finite)
    if frac.size:
        step = max(1, _CHUNK // (8 * frac.size))
        p = out.shape[0]
        for s in range(0, p, step):
            e = slice(s, min(p, s + step))
            zz = z if z.shape[0] == 1 else z[e]
            out[e, frac] = _log_a_frac(log_q[e], log1m_q[e], zz, orders[frac]) / (orders[frac] - 1.0)
    out[:, ~finite] = np.inf
    return out


def compute_rdp(q, noise_multiplier, steps, orders=DEFAULT_ORDERS) -> np.ndarray:
    """RDP of the Poisson-subsampled Gaussian mechanism composed over ``steps`` steps.

    Args:
        q: sampling rate(s) in [0, 1]; scalar or array.
        noise_multiplier: noise std / L2 sensitivity, ≥ 0; scalar or array broadcastable with q.
        steps: number of steps (≥ 0; RDP composes additively).
        orders: RDP orders α > 1 (sequence), or one scalar order.
    Returns:
        float64 array of shape broadcast(q, noise_multiplier) + (len(orders),); without the last
        axis when ``orders`` is a scalar. Can be inf (noise_multiplier = 0).
    """
    orders_arr, scalar_order = _as_orders(orders)
    q = np.asarray(q, dtype=np.float64)
    z = np.asarray(noise_multiplier, dtype=np.float64)
    if np.any(~np.isfinite(q)) or np.any((q < 0) | (q > 1)):
        raise ValueError("q (sample rate) must lie in [0, 1]")
    if np.any(np.isnan(z)) or np.any(z < 0):
        raise ValueError("noise_multiplier must be >= 0")
    steps = float(steps)
    if not steps >= 0 or not math.isfinite(steps):
        raise ValueError(f"steps must be a finite number >= 0, got {steps}")
    shape = np.broadcast_shapes(q.shape, z.shape)
    qb, zb = (np.ascontiguousarray(a).ravel() + 0.0 for a in np.broadcast_arrays(q, z))
    first, inverse = distinct_rows(qb, zb)             # evaluate each distinct (q, z) pair once
    rdp = _rdp_unchecked(qb[first], zb[first], orders_arr)[inverse]
    rdp = rdp * steps if steps != 0 else np.zeros_like(rdp)   # zero steps spend nothing
    rdp = rdp.reshape(shape + (orders_arr.shape[0],))
    return rdp[..., 0] if scalar_order else rdp


# ----------------------------------------------------------------------------------------------
# Public: conversion to (ε, δ)
# ----------------------------------------------------------------------------------------------
def _eps_from_rdp(orders: np.ndarray, rdp: np.ndarray, delta) -> tuple[np.ndarray, np.ndarray]:
    """Balle et al. (2020, Thm. 21) conversion, minimized over orders. rdp: (..., n).

    Returns (eps (...), index of the optimal order (...), -1 where every entry is NaN)."""
    log_delta = np.log(np.asarray(delta, dtype=np.float64))[..., None]
    with np.errstate(invalid="ignore", divide="ignore"):
        eps = rdp - (log_delta + np.log(orders)) / (orders - 1.0) + np.log((orders - 1.0) / orders)
    all_nan = np.all(np.isnan(eps), axis=-1)
    idx = np.argmin(np.where(np.isnan(eps), np.inf, eps), axis=-1)
    best = np.take_along_axis(eps, idx[..., None], axis=-1)[..., 0]
    best = np.where(all_nan, np.inf, best)
    idx = np.where(all_nan, -1, idx)
    return best, idx


def get_privacy_spent(orders, rdp, delta):
    """(ε, optimal order) from RDP values, the improved conversion of Opacus's ``get_privacy_spent``
    (Balle et al. 2020, Thm. 21): ε = min_α ρ(α) − (log δ + log α)/(α − 1) + log((α − 1)/α).

    Args:
        orders: (n,) orders α.
        rdp: (..., n) RDP values (vectorized over leading dimensions).
        delta: target δ in (0, 1), scalar or broadcastable to rdp.shape[:-1].
    Returns:
        (eps, best_order): arrays of shape rdp.shape[:-1] (Python floats for 1-D rdp). Where every
        RDP value is NaN: (inf, nan). Warns when the optimum sits at the edge of the grid.
    """
    orders_arr = np.atleast_1d(np.asarray(orders, dtype=np.float64))
    rdp = np.atleast_1d(np.asarray(rdp, dtype=np.float64))
    if rdp.shape[-1] != orders_arr.shape[0]:
        raise ValueError(f"orders ({orders_arr.shape[0]}) and rdp (last dim {rdp.shape[-1]}) must have "
                         "the same length")
    d = np.asarray(delta, dtype=np.float64)
    if np.any(~((d > 0) & (d < 1))):
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    eps, idx = _eps_from_rdp(orders_arr, rdp, d)
    at_edge = (idx == 0) | (idx == orders_arr.shape[0] - 1)
    if np.any(at_edge):
        where = "smallest" if np.any(idx == 0) else "largest"
        warnings.warn(f"Optimal order is the {where} alpha for {int(at_edge.sum())} of {at_edge.size} "
                      "entries. Please consider expanding the range of alphas to get a tighter privacy "
                      "bound.", stacklevel=2)
    best_order = np.where(idx >= 0, orders_arr[np.maximum(idx, 0)], np.nan)
    if rdp.ndim == 1:
        return float(eps), float(best_order)
    return eps, best_order


def epsilon(q, noise_multiplier, steps, delta, orders=DEFAULT_ORDERS) -> np.ndarray:
    """ε(δ) of ``steps`` SGM steps, broadcast over q and noise_multiplier (no edge warning)."""
    orders_arr, _ = _as_orders(orders)
    rdp = compute_rdp(q, noise_multiplier, steps, orders_arr)
    return _eps_from_rdp(orders_arr, rdp, delta)[0]


# ----------------------------------------------------------------------------------------------
# Public: inversions (the grid engine lives in _grid; imported lazily, it imports this module)
# ----------------------------------------------------------------------------------------------
def check_positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not float(value).is_integer() or float(value) < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_delta(delta, name: str = "delta") -> float:
    try:
        d = float(delta)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number in (0, 1), got {delta!r}") from None
    if not 0.0 < d < 1.0:
        raise ValueError(f"{name} must lie in (0, 1), got {delta!r}")
    return d


def check_epsilons(eps, name: str) -> np.ndarray:
    try:
        arr = np.asarray(eps, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be numbers (scalar or array), got {type(eps).__name__}") from None
    if arr.size == 0:
        raise ValueError(f"{name} is empty")
    bad = ~np.isfinite(arr) | (arr <= 0)
    if bad.any():
        first = arr.ravel()[np.flatnonzero(bad.ravel())[0]]
        raise ValueError(f"{name} must be finite and > 0; {int(bad.sum())} entries are not (e.g. {first})")
    return arr


def check_rate(rate, name: str = "sample_rate") -> float:
    try:
        r = float(rate)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number in (0, 1], got {rate!r}") from None
    if not 0.0 < r <= 1.0:
        raise ValueError(f"{name} must lie in (0, 1], got {rate!r}")
    return r


def _orders_or_default(orders) -> np.ndarray:
    return _as_orders(DEFAULT_ORDERS if orders is None else orders)[0]


def get_noise_multiplier(target_epsilon, target_delta, sample_rate, steps, accountant="rdp", orders=None):
    """Smallest noise multiplier σ with ε(σ) ≤ target_epsilon for ``steps`` steps at Poisson rate
    ``sample_rate`` (ε(σ) is decreasing in σ).

    Args:
        target_epsilon: scalar or array of budgets (vectorized; duplicates are solved once).
        target_delta: δ in (0, 1).
        sample_rate: q in (0, 1].
        steps: positive integer T.
        accountant: "rdp" (vectorized) or "pld" (dp_accounting, one root-finding per target).
        orders: RDP orders (default ``DEFAULT_ORDERS``).
    Returns:
        σ with the shape of target_epsilon (a float for a scalar). ε(σ) ≤ target always. With at
        most 4096 distinct targets σ is the exact root (ε within 1e-9 relative of the target);
        beyond that it is rounded up to a grid on which consecutive ε differ by ≤ 0.05%.
    Raises:
        ValueError naming the argument for invalid input, or a budget no σ ≤ 1e6 meets.
    """
    from . import _grid

    eps = check_epsilons(target_epsilon, "target_epsilon")
    delta = check_delta(target_delta, "target_delta")
    q = check_rate(sample_rate, "sample_rate")
    steps = check_positive_int(steps, "steps")
    if accountant == "pld":
        from .pld import pld_noise_multiplier
        flat = np.array([pld_noise_multiplier(e, delta, q, steps) for e in eps.ravel()])
        return float(flat[0]) if eps.ndim == 0 else flat.reshape(eps.shape)
    if accountant != "rdp":
        raise ValueError(f"accountant must be 'rdp' or 'pld', got {accountant!r}")
    orders_arr = _orders_or_default(orders)
    uniq, inverse = np.unique(eps.ravel(), return_inverse=True)
    try:
        z = _grid.solve_noise(q, steps, delta, uniq, orders_arr)[0]
    except _grid.BudgetError as err:
        raise ValueError(f"target_epsilon={err.budget} cannot be met at sample_rate={q}, steps={steps}, "
                         f"delta={delta}: {err}") from None
    out = z[inverse].reshape(eps.shape)
    return float(out) if eps.ndim == 0 else out


def get_sample_rate(target_epsilon, target_delta, noise_multiplier, steps, orders=None):
    """Largest Poisson sampling rate q ≤ 1 with ε(q) ≤ target_epsilon at noise multiplier σ for
    ``steps`` steps (ε(q) is increasing in q).

    Args:
        target_epsilon: scalar or array of budgets, up to ~10^6 entries (vectorized).
        target_delta: δ in (0, 1).
        noise_multiplier: σ > 0.
        steps: positive integer T.
        orders: RDP orders (default ``DEFAULT_ORDERS``).
    Returns:
        q with the shape of target_epsilon (float for a scalar), in (0, 1]; q = 1 where even q = 1
        meets the budget. ε(q) ≤ target always: at most 4096 distinct targets are refined to the
        exact root (1e-9 relative in ε), more are rounded down to a grid on which consecutive ε
        differ by ≤ 0.05%.
    Raises:
        ValueError if a budget needs q below 1e-12 (too small for this σ and T).
    """
    from . import _grid

    eps = check_epsilons(target_epsilon, "target_epsilon")
    delta = check_delta(target_delta, "target_delta")
    z = float(noise_multiplier)
    if not (np.isfinite(z) and z > 0):
        raise ValueError(f"noise_multiplier must be finite and > 0, got {noise_multiplier!r}")
    steps = check_positive_int(steps, "steps")
    orders_arr = _orders_or_default(orders)
    uniq, inverse = np.unique(eps.ravel(), return_inverse=True)
    try:
        q = _grid.solve_rate(z, steps, delta, uniq, orders_arr)[0]
    except _grid.BudgetError as err:
        raise ValueError(f"target_epsilon={err.budget} cannot be met with noise_multiplier={z}, "
                         f"steps={steps}, delta={delta}: {err}") from None
    out = q[inverse].reshape(eps.shape)
    return float(out) if eps.ndim == 0 else out
