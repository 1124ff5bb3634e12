"""Rényi DP of the Poisson-subsampled Gaussian mechanism (SGM), vectorized.

Numbers in, numbers out: no state lives here (the ledger holds state).

* ``compute_rdp`` agrees with Opacus 1.6 / TF Privacy (same series, same truncation rule for
  fractional orders), but broadcasts over arrays of sampling rates and noise multipliers and never
  loops in Python over records.
* The math lives in the leaf ``sgm``. Integer orders use the identity A_α = 1 + Σ_{k≥2}
  C(α,k)(1−q)^{α−k} q^k (e^{(k²−k)/2z²} − 1) (the binomial terms without the exponential sum to
  one), so every term is positive and log A_α = softplus(log Σ_{k≥2} ...) is accurate to a few ulps
  even when A_α − 1 is 1e-12. The Opacus loop evaluates log Σ_{k≥0} directly and loses those digits
  to cancellation: the two agree to 1e-10 relative wherever Opacus itself is accurate to that
  level, and within Opacus's own rounding error (about 1e-16 absolute per step in ρ) elsewhere.
* Fractional orders use the two-sided series of Mironov, Talwar & Zhang (2019, §3.3) with the
  Opacus stopping rule (stop after the first term index whose two terms are both below e^-30).
"""
from __future__ import annotations

import math
import warnings

import numpy as np

from .._checks import as_float_array, check_delta, check_epsilons, check_positive_integer, check_rate
from . import _grid
from .sgm import DEFAULT_ORDERS, OPACUS_ORDERS, as_orders, distinct_rows, eps_from_rdp, rdp_one_step_series

__all__ = ["DEFAULT_ORDERS", "OPACUS_ORDERS", "compute_rdp", "get_privacy_spent", "get_noise_multiplier",
           "get_sample_rate", "epsilon"]


# ----------------------------------------------------------------------------------------------
# Public: RDP
# ----------------------------------------------------------------------------------------------
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
    Raises:
        TypeError for values that are not numbers (a string such as "0.1" included); ValueError for q
        outside [0, 1], a noise multiplier < 0 or NaN, or steps < 0.
    """
    orders_arr, scalar_order = as_orders(orders)
    q = as_float_array("q", q)
    z = as_float_array("noise_multiplier", noise_multiplier)
    if np.any(~np.isfinite(q)) or np.any((q < 0) | (q > 1)):
        raise ValueError("q (sample rate) must lie in [0, 1]")
    if np.any(np.isnan(z)) or np.any(z < 0):
        raise ValueError("noise_multiplier must be >= 0")
    steps = float(as_float_array("steps", steps))
    if not steps >= 0 or not math.isfinite(steps):
        raise ValueError(f"steps must be a finite number >= 0, got {steps}")
    shape = np.broadcast_shapes(q.shape, z.shape)
    qb, zb = (np.ascontiguousarray(a).ravel() + 0.0 for a in np.broadcast_arrays(q, z))
    first, inverse = distinct_rows(qb, zb)             # evaluate each distinct (q, z) pair once
    rdp = rdp_one_step_series(qb[first], zb[first], orders_arr)[inverse]
    rdp = rdp * steps if steps != 0 else np.zeros_like(rdp)   # zero steps spend nothing
    rdp = rdp.reshape(shape + (orders_arr.shape[0],))
    return rdp[..., 0] if scalar_order else rdp


# ----------------------------------------------------------------------------------------------
# Public: conversion to (ε, δ)
# ----------------------------------------------------------------------------------------------
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
    d = np.asarray(delta)
    if d.dtype.kind not in "iuf":  # not text numpy would read as a number, nor bools
        raise TypeError(f"delta must be a number in (0, 1) (or an array of them), got {delta!r}")
    d = d.astype(np.float64)
    if np.any(~((d > 0) & (d < 1))):
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    eps, idx = eps_from_rdp(orders_arr, rdp, d)
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
    """ε(δ) of ``steps`` SGM steps: min_α T·ρ(α; q, σ) − (log δ + log α)/(α − 1) + log((α − 1)/α).

    Vectorized over q and noise_multiplier; unlike ``get_privacy_spent`` it gives no warning when the
    optimum sits at the edge of the orders.

    Args:
        q: Poisson sample rate(s) in [0, 1]; scalar or array.
        noise_multiplier: σ ≥ 0 (noise std / clip norm); scalar or array broadcastable with q.
        steps: number of steps T (≥ 0).
        delta: δ in (0, 1) (not checked), scalar or broadcastable to broadcast(q, noise_multiplier).
        orders: RDP orders α > 1 (sequence or one scalar).
    Returns:
        float64 array of shape broadcast(q, noise_multiplier) (0-d for scalars): ε, not clamped at 0
        (it can be < 0 for tiny RDP and large δ); inf where σ = 0 < q.
    Raises:
        ValueError from ``compute_rdp`` for q outside [0, 1], σ < 0, steps < 0 or an order ≤ 1.
    """
    orders_arr, _ = as_orders(orders)
    rdp = compute_rdp(q, noise_multiplier, steps, orders_arr)
    return eps_from_rdp(orders_arr, rdp, delta)[0]


# ----------------------------------------------------------------------------------------------
# Public: inversions (the grid engine lives in _grid)
# ----------------------------------------------------------------------------------------------
def _orders_or_default(orders) -> np.ndarray:
    return as_orders(DEFAULT_ORDERS if orders is None else orders)[0]


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
    eps = check_epsilons("target_epsilon", target_epsilon)
    delta = check_delta("target_delta", target_delta)
    q = check_rate("sample_rate", sample_rate)
    steps = check_positive_integer("steps", steps)
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
    eps = check_epsilons("target_epsilon", target_epsilon)
    delta = check_delta("target_delta", target_delta)
    z = float(noise_multiplier)
    if not (np.isfinite(z) and z > 0):
        raise ValueError(f"noise_multiplier must be finite and > 0, got {noise_multiplier!r}")
    steps = check_positive_integer("steps", steps)
    orders_arr = _orders_or_default(orders)
    uniq, inverse = np.unique(eps.ravel(), return_inverse=True)
    try:
        q = _grid.solve_rate(z, steps, delta, uniq, orders_arr)[0]
    except _grid.BudgetError as err:
        raise ValueError(f"target_epsilon={err.budget} cannot be met with noise_multiplier={z}, "
                         f"steps={steps}, delta={delta}: {err}") from None
    out = q[inverse].reshape(eps.shape)
    return float(out) if eps.ndim == 0 else out
