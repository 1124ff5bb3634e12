"""Per-record privacy budget distributions of the rPDP-FL paper (Liu et al., CCS 2024, §6.1).

Budgets are data-independent: every draw depends only on (distribution, number of records, seed),
never on the records themselves (DESIGN.md §3.2).

* ``ThreeLevels``: each record independently ε = 0.1 / 1 / 5 with probability 0.7 / 0.2 / 0.1.
* ``BoundedPareto``: Pareto type I with shape 1 and scale (lower bound) 0.1, ε = 0.1 / U, clipped
  to [0.1, 10].
* ``BoundedMixGauss``: a mixture with weights 0.7 / 0.2 / 0.1 of Gaussians centered at 0.1 / 1 / 5
  with standard deviation 10% of the center (0.01 / 0.1 / 0.5), clipped to [0.1, 10].
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

LEVELS = (0.1, 1.0, 5.0)
LEVEL_WEIGHTS = (0.7, 0.2, 0.1)
BOUNDS = (0.1, 10.0)
MIX_RELATIVE_STD = 0.1

_DISTRIBUTIONS: dict[str, Callable[[int, np.random.Generator], np.ndarray]] = {}


def register_distribution(name: str):
    """Decorator: register a budget distribution.

    Args:
        name: what ``sample_budgets`` and ``--budgets`` call it.
    Returns:
        a decorator taking ``fn(n, rng) -> (n,) float64 budgets`` and returning it unchanged.
    """
    def wrap(fn):
        _DISTRIBUTIONS[name] = fn
        return fn
    return wrap


@register_distribution("ThreeLevels")
def _three_levels(n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.choice(np.array(LEVELS), size=n, p=LEVEL_WEIGHTS)


@register_distribution("BoundedPareto")
def _bounded_pareto(n: int, rng: np.random.Generator) -> np.ndarray:
    # inverse CDF of Pareto(shape 1, scale 0.1): x = 0.1 / U, U uniform on (0, 1]
    u = 1.0 - rng.random(n)
    return np.clip(BOUNDS[0] / u, *BOUNDS)


@register_distribution("BoundedMixGauss")
def _bounded_mix_gauss(n: int, rng: np.random.Generator) -> np.ndarray:
    centers = np.array(LEVELS)
    component = rng.choice(len(LEVELS), size=n, p=LEVEL_WEIGHTS)
    draws = rng.normal(centers[component], MIX_RELATIVE_STD * centers[component])
    return np.clip(draws, *BOUNDS)


def distributions() -> tuple[str, ...]:
    """The registered budget distributions.

    Returns:
        their names, a tuple of str.
    """
    return tuple(_DISTRIBUTIONS)


def sample_budgets(distribution: str, n: int, seed: int = 0) -> np.ndarray:
    """Draw per-record budgets (data-independent).

    Args:
        distribution: a registered name (see the module docstring).
        n: the number of records (int ≥ 0).
        seed: of the draw.
    Returns:
        (n,) float64 ε_j > 0.
    Raises:
        ValueError for an unknown name or a bad ``n``.
    """
    if distribution not in _DISTRIBUTIONS:
        raise ValueError(f"budgets must be one of {', '.join(map(repr, _DISTRIBUTIONS))} or an array of "
                         f"per-record budgets, got {distribution!r}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be an int ≥ 0, got {n!r}")
    rng = np.random.default_rng([0xB0D6E7, int(seed)])
    return _DISTRIBUTIONS[distribution](int(n), rng).astype(np.float64)
