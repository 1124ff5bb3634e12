"""Calibration: from individual budgets ε_i to a training plan (shared σ, per-record q_i and c_i).

``calibrate`` is the entry point; the methods it dispatches to live in a registry
(``problem.register_method``, keyed by (method, accountant)):

* ``problem``: what a method takes (``Problem``, on the distinct budgets) and returns
  (``Solution``), the registry, and the pieces the methods share (a leaf);
* ``rdp``: Sample, Scale and hybrid under RDP (Boenisch et al., NeurIPS 2023, Alg. 2, Alg. 3,
  App. D.6);
* ``pld``: the same three under PLD, started from the RDP ones (``accounting.pld`` gives the ε
  functions and inversions they solve with; it never imports this package).

Importing this package registers the built-in methods, so every method is in the registry
whenever ``calibrate`` can be called.
"""
from __future__ import annotations

import warnings

from ..._checks import (
    as_budget_vector,
    check_delta,
    check_in_range,
    check_int,
    check_positive,
    check_positive_integer,
    check_rate,
)
from ..plan import GroupSummary, PrivacyPlan
from ..pld import MAX_PAIRS
from ..sgm import DEFAULT_ORDERS, as_orders
from . import pld, rdp  # noqa: F401 — importing them registers the built-in methods
from .pld import bin_budgets_down
from .problem import METHODS, Problem, Solution, hybrid_weight_of, register_method, warn_rarely_drawn

__all__ = ["calibrate", "register_method", "Problem", "Solution", "PrivacyPlan", "GroupSummary"]


def calibrate(budgets, *, delta, steps, sample_rate, method="sample", max_grad_norm=1.0, hybrid_weight=None,
              accountant="rdp", orders=None, pld_classes: int = MAX_PAIRS) -> PrivacyPlan:
    """Turn per-record budgets into a :class:`PrivacyPlan`.

    Args:
        budgets: (N,) per-record ε_i > 0, an array, list or torch tensor (a few distinct values
            or N distinct ones).
        delta: δ in (0, 1), shared by all records.
        steps: number of training steps T (positive integer).
        sample_rate: target mean Poisson rate q in (0, 1] (expected batch size / N).
        method: "sample", "scale", "hybrid", or a name given to ``register_method``.
        max_grad_norm: reference clip norm C > 0 (the plan's mean clip norm for Scale/hybrid).
        hybrid_weight: λ in [0, 1] for "hybrid" (0 = Scale, 1 = Sample; None: 0.5). Refused with
            "sample" and "scale", which would ignore it.
        accountant: "rdp" or "pld" (dp_accounting privacy loss distributions).
        orders: RDP orders, floats > 1 (default ``DEFAULT_ORDERS``).
        pld_classes: PLD only, most distinct budgets solved (positive int, default
            ``pld.MAX_PAIRS`` = 64). With more distinct budgets, each is served from the largest of
            ``pld_classes`` class values below it (``calibration.pld.bin_budgets_down``: the fewest
            classes losing ≤ 0.5% of any budget, a warning when more would be needed); the plan's
            ``budget_values`` are then the class values. The time grows with the classes.
    Returns:
        PrivacyPlan whose ``epsilons()`` are exact accountings of each record's (q_i, σC/c_i, T):
        never above the budget, and ≥ 99.8% of it unless q_i = 1. Under RDP each group is
        certified at its own RDP order (``plan.group_orders``, fractional; ``ledger_for_plan``
        accounts at them); under PLD ``group_orders`` is None.
    Raises:
        ValueError / TypeError naming the bad argument; ValueError naming a budget that cannot be met.
    """
    arr = as_budget_vector("budgets", budgets)
    delta = check_delta("delta", delta)
    steps = check_positive_integer("steps", steps)
    q = check_rate("sample_rate", sample_rate)
    c = check_positive("max_grad_norm", max_grad_norm)
    names = sorted({m for m, _ in METHODS})
    if method not in names:
        raise ValueError(f"method must be one of {names}, got {method!r}")
    lam = check_in_range("hybrid_weight", hybrid_weight_of(method, hybrid_weight), low=0.0, high=1.0, low_open=False)
    if accountant not in ("rdp", "pld"):
        raise ValueError(f"accountant must be 'rdp' or 'pld', got {accountant!r}")
    orders_arr = as_orders(DEFAULT_ORDERS if orders is None else orders)[0]
    pld_classes = check_int("pld_classes", pld_classes, 1)
    problem = Problem(arr, delta, steps, q, c, lam, orders_arr)
    if accountant == "pld":
        if problem.values.shape[0] > pld_classes:
            # one PLD per class: budgets are served by the largest class value below them
            class_values, class_of, loss = bin_budgets_down(problem.values, pld_classes)
            if loss > 0.005:
                warnings.warn(f"accountant='pld' with {problem.values.shape[0]} distinct budgets: {pld_classes} PLD "
                              f"classes give up to {loss:.2%} of a budget; pass pld_classes= (cost ∝ classes) "
                              "for a finer binning", stacklevel=2)
            problem = Problem(class_values[class_of][problem.inverse], delta, steps, q, c, lam, orders_arr)
    sol = METHODS[(method, accountant)](problem)
    clip_u = sol.sigma * c / sol.noise_multipliers
    group_orders = sol.orders
    if group_orders is not None:
        edge = (group_orders <= orders_arr[0]) | (group_orders >= orders_arr[-1])
        if edge.any():
            warnings.warn(f"the optimal RDP order of {int(edge.sum())} budget group(s) (e.g. epsilon="
                          f"{problem.values[edge][0]:.4g}) is at the edge of the order grid "
                          f"[{orders_arr[0]:g}, {orders_arr[-1]:g}]; their guarantee is valid but loose: "
                          "pass orders= with a wider range to tighten it", stacklevel=2)
    warn_rarely_drawn(problem.values, problem.counts, sol.sample_rates, steps)
    return PrivacyPlan.from_groups(method=method, accountant=accountant, noise_multiplier=sol.sigma,
                                   max_grad_norm=c, steps=steps, delta=delta, budget_values=problem.values,
                                   group_index=problem.inverse, counts=problem.counts,
                                   group_sample_rates=sol.sample_rates, group_clip_norms=clip_u,
                                   group_epsilons=sol.epsilons, orders=tuple(float(o) for o in orders_arr),
                                   group_orders=group_orders)
