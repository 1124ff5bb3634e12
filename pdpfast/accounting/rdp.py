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

from .._checks import (
    as_float_array,
    check_choice,
    check_delta,
    check_epsilons,
    check_positive,
    check_positive_integer,
    check_rate,
)
from . import _grid
from .sgm import DEFAULT_ORDERS, OPACUS_ORDERS, as_orders, check_rdp, distinct_rows, eps_from_rdp, rdp_one_step_series

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
        steps: number of steps, a whole number ≥ 0 (RDP composes additively).
        orders: RDP orders α > 1 (sequence), or one scalar order; None: ``DEFAULT_ORDERS``.
    Returns:
        float64 array of shape broadcast(q, noise_multiplier) + (len(orders),); without the last
        axis when ``orders`` is a scalar. Can be inf (noise_multiplier = 0).
    Raises:
        TypeError for values that are not numbers (a string such as "0.1" included, or a bool);
        ValueError for q outside [0, 1], a noise multiplier < 0 or NaN, q and noise_multiplier of
        shapes that do not broadcast, or steps that are not one whole number ≥ 0 (1.5, [1, 2]).
    """
    orders_arr, scalar_order = as_orders(DEFAULT_ORDERS if orders is None else orders)
    q = as_float_array("q", q)
    z = as_float_array("noise_multiplier", noise_multiplier)
    if np.any(~np.isfinite(q)) or np.any((q < 0) | (q > 1)):
        raise ValueError("q (sample rate) must lie in [0, 1]")
    if np.any(np.isnan(z)) or np.any(z < 0):
        raise ValueError("noise_multiplier must be >= 0")
    steps = _whole_steps(steps)
    try:
        shape = np.broadcast_shapes(q.shape, z.shape)
    except ValueError:
        raise ValueError(f"q and noise_multiplier must be broadcastable against each other, got shapes {q.shape} "
                         f"and {z.shape}") from None
    qb, zb = (np.ascontiguousarray(a).ravel() + 0.0 for a in np.broadcast_arrays(q, z))
    first, inverse = distinct_rows(qb, zb)             # evaluate each distinct (q, z) pair once
    rdp = rdp_one_step_series(qb[first], zb[first], orders_arr)[inverse]
    rdp = rdp * steps if steps != 0 else np.zeros_like(rdp)   # zero steps spend nothing
    rdp = rdp.reshape(shape + (orders_arr.shape[0],))
    return rdp[..., 0] if scalar_order else rdp


def _whole_steps(steps) -> float:
    """A step count given to ``compute_rdp``: one whole number ≥ 0 (2.9 steps must not be charged as 2.9,
    nor truncated to 2 by a caller that accounts in ints)."""
    arr = as_float_array("steps", steps)   # TypeError for "10" or True
    if arr.ndim != 0:
        raise ValueError(f"steps must be one whole number of steps ≥ 0, got shape {arr.shape}")
    value = float(arr)
    if not (math.isfinite(value) and value >= 0 and value.is_integer()):
        raise ValueError(f"steps must be a finite whole number >= 0, got {steps!r}")
    return value


def _delta_array(name: str, delta) -> np.ndarray:
    """δ given as a number or an array of them, each in (0, 1)."""
    d = np.asarray(delta)
    if d.dtype.kind not in "iuf":  # not text numpy would read as a number, nor bools
        raise TypeError(f"{name} must be a number in (0, 1) (or an array of them), got {delta!r}")
    d = d.astype(np.float64)
    if np.any(~((d > 0) & (d < 1))):
        raise ValueError(f"{name} must lie in (0, 1), got {delta}")
    return d


# ----------------------------------------------------------------------------------------------
# Public: conversion to (ε, δ)
# ----------------------------------------------------------------------------------------------
def get_privacy_spent(orders, rdp, delta):
    """(ε, optimal order) from RDP values, the improved conversion of Opacus's ``get_privacy_spent``
    (Balle et al. 2020, Thm. 21): ε = min_α ρ(α) − (log δ + log α)/(α − 1) + log((α − 1)/α).

    Args:
        orders: (n,) orders α > 1 (inf allowed), or one order.
        rdp: (..., n) RDP values ≥ 0 (vectorized over leading dimensions); NaN entries are skipped,
            values down to −1e-9 are read as rounding of 0.
        delta: target δ in (0, 1), scalar or broadcastable to rdp.shape[:-1].
    Returns:
        (eps, best_order): arrays of shape rdp.shape[:-1] (Python floats for 1-D rdp). Where every
        RDP value is NaN: (inf, nan). Warns when the optimum sits at the edge of the grid.
    Raises:
        TypeError for orders, rdp or delta that are not numbers (strings, bools, None); ValueError for
        empty orders or an order that is not > 1 (NaN included: it is not skipped), a negative RDP
        value (it would lower ε; −inf too), orders and rdp of different lengths, or δ outside (0, 1).
    """
    orders_arr = as_orders(orders)[0]
    rdp = np.atleast_1d(check_rdp("rdp", rdp, allow_nan=True))
    if rdp.shape[-1] != orders_arr.shape[0]:
        raise ValueError(f"orders ({orders_arr.shape[0]}) and rdp (last dim {rdp.shape[-1]}) must have "
                         "the same length")
    eps, idx = eps_from_rdp(orders_arr, rdp, _delta_array("delta", delta))
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
        steps: number of steps T, a whole number ≥ 0.
        delta: δ in (0, 1), scalar or broadcastable to broadcast(q, noise_multiplier).
        orders: RDP orders α > 1 (sequence or one scalar); None: ``DEFAULT_ORDERS``.
    Returns:
        float64 array of shape broadcast(q, noise_multiplier) (0-d for scalars): ε, not clamped at 0
        (it can be < 0 for tiny RDP and large δ); inf where σ = 0 < q.
    Raises:
        TypeError for values that are not numbers; ValueError for δ outside (0, 1) (δ = 2 gave
        ε = −10), or from ``compute_rdp`` for q outside [0, 1], σ < 0, bad steps or an order ≤ 1.
    """
    d = _delta_array("delta", delta)
    orders_arr, _ = as_orders(DEFAULT_ORDERS if orders is None else orders)
    rdp = compute_rdp(q, noise_multiplier, steps, orders_arr)
    return eps_from_rdp(orders_arr, rdp, d)[0]


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
        orders: RDP orders (default ``DEFAULT_ORDERS``); "rdp" only (the PLD accountant has none).
    Returns:
        σ with the shape of target_epsilon (a float for a scalar). ε(σ) ≤ target always. With at
        most 4096 distinct targets σ is the exact root (ε within 1e-9 relative of the target);
        beyond that it is rounded up to a grid on which consecutive ε differ by ≤ 0.05%.
    Raises:
        ValueError naming the argument for invalid input (``orders`` given with accountant "pld",
        where it would be ignored, included), or a budget no σ ≤ 1e6 meets.
    """
    check_choice("accountant", accountant, ("rdp", "pld"))
    eps = check_epsilons("target_epsilon", target_epsilon)
    delta = check_delta("target_delta", target_delta)
    q = check_rate("sample_rate", sample_rate)
    steps = check_positive_integer("steps", steps)
    if accountant == "pld":
        if orders is not None:
            raise ValueError("orders are RDP orders: accountant='pld' uses none (pass orders=None)")
        from .pld import pld_noise_multiplier
        flat = np.array([pld_noise_multiplier(e, delta, q, steps) for e in eps.ravel()])
        return float(flat[0]) if eps.ndim == 0 else flat.reshape(eps.shape)
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
        TypeError for an argument that is not a number (None, a bool, a string such as "1.0");
        ValueError for one out of range, or if a budget needs q below 1e-12 (too small for this σ and T).
    """
    eps = check_epsilons("target_epsilon", target_epsilon)
    delta = check_delta("target_delta", target_delta)
    z = check_positive("noise_multiplier", noise_multiplier)
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
