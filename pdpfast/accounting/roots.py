"""The one root finder of the accounting package: Illinois regula falsi, vectorized over independent
problems. A leaf: numpy only, nothing of pdpfast imported.

Every monotone inversion that must stay on the safe side of its root uses it: the grid engine's
exact refinement (``_grid.refine``, hence the RDP calibrations, ``orders.polish`` and ``rpdp``),
PLD's root-finding in a noise multiplier and a sampling rate (``pld``), and PLD Sample's shared σ
(``calibration.pld``). The caller owns the search variable (a log-parameter), the residual the
interpolation steers by, and which side of the root a point is accepted on; this module owns the
step.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["Bracket", "illinois"]


@dataclass
class Bracket:
    """P brackets of the search variable (Illinois halves a residual whose end is retained twice in a row).

    Attributes:
        kept: (P,) float64 the accepted end (the answer so far).
        other: (P,) float64 the rejected end.
        r_kept: (P,) float64 the residual at ``kept`` (possibly halved).
        r_other: (P,) float64 the residual at ``other`` (possibly halved).
    """
    kept: np.ndarray
    other: np.ndarray
    r_kept: np.ndarray
    r_other: np.ndarray


def illinois(evaluate: Callable, kept, other, r_kept, r_other, active: Callable, max_iter: int) -> Bracket:
    """Illinois regula falsi on P independent brackets.

    Args:
        evaluate(x, which, bracket) -> (residual (k,), accepted (k,) bool): evaluates problems
            ``which`` (k,) at their new points x (k,); an accepted point replaces the kept end, any
            other the other end. The caller records there what it needs of the point (its ε, its
            optimal order, ...).
        kept, other, r_kept, r_other: (P,) the two ends (search variable) and their residuals.
        active(which, bracket) -> (k,) bool: which of problems ``which`` still need a step; asked
            of all problems first, then after each step of those that took it.
        max_iter: at most this many steps per problem.
    Returns:
        the final :class:`Bracket` (the kept ends are always points that were evaluated, or the
        starting ones).
    """
    b = Bracket(*(np.array(v, dtype=np.float64, ndmin=1) for v in (kept, other, r_kept, r_other)))
    side = np.zeros(b.kept.shape[0], dtype=np.int8)
    run = np.flatnonzero(active(np.arange(b.kept.shape[0]), b))
    for _ in range(max_iter):
        if run.size == 0:
            break
        a = run
        lk, lo = b.kept[a], b.other[a]
        with np.errstate(invalid="ignore", divide="ignore"):
            x = lk - b.r_kept[a] * (lo - lk) / (b.r_other[a] - b.r_kept[a])
        bad = ~np.isfinite(x) | (x <= np.minimum(lk, lo)) | (x >= np.maximum(lk, lo))
        x = np.where(bad, 0.5 * (lk + lo), x)
        r, ok = evaluate(x, a, b)
        s_ok, s_bad = a[ok], a[~ok]
        # Illinois: halve the residual of an end that is retained twice in a row
        b.r_other[s_ok[side[s_ok] == 1]] *= 0.5
        b.r_kept[s_bad[side[s_bad] == -1]] *= 0.5
        b.kept[s_ok], b.r_kept[s_ok] = x[ok], r[ok]
        b.other[s_bad], b.r_other[s_bad] = x[~ok], r[~ok]
        side[s_ok], side[s_bad] = 1, -1
        run = a[active(a, b)]
    return b
