"""Argument checks shared across the package: one place for "is this a valid choice / number /
probability / per-record array", so every entry point refuses the same inputs with the same words.

A leaf module: it imports numpy, torch and the standard library, nothing of pdpfast, so the math
(``pdpfast.accounting``), the engine and the front ends can all use it. Each check raises
ValueError (TypeError where the value is not even of the right kind) with a message that names the
argument, and returns the value in the form the caller computes with.

Naming: ``check_*`` validates and returns the value (converted to float / int / array);
``as_*`` also broadcasts a scalar to the per-record or per-sample shape.
"""
from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["as_per_record", "as_per_sample", "check_budgets", "check_choice", "check_delta", "check_epsilons",
           "check_in_range", "check_int", "check_positive_integer", "check_rate"]


# ---------------------------------------------------------------------------------------------- scalars
def check_choice(name: str, value, choices) -> None:
    """Raise ValueError unless ``value`` is one of ``choices`` (a tuple of the allowed values)."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def check_int(name: str, value, minimum: int) -> int:
    """``value`` as an int ≥ ``minimum``; a bool or a float (even 2.0) is refused."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int ≥ {minimum}, got {value!r}")
    return int(value)


def check_positive_integer(name: str, value) -> int:
    """``value`` as an int ≥ 1; an integral float (2.0) is accepted, a bool is not."""
    if isinstance(value, bool) or not float(value).is_integer() or float(value) < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_in_range(name: str, value, *, low: float, high: float = math.inf, low_open: bool = True,
                   high_open: bool = False) -> float:
    """``value`` as a finite float in the interval from ``low`` to ``high`` (open or closed at
    each end, as given; default (low, ∞)). The message writes the interval out, e.g. "(0, 1]"."""
    lo, hi = "(" if low_open else "[", ")" if high_open or high == math.inf else "]"
    where = f"{name} must lie in {lo}{low:g}, {high:g}{hi}"
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}, got {value!r} (not a number)") from None
    too_low = v <= low if low_open else v < low
    too_high = v >= high if high_open else v > high
    if not math.isfinite(v) or too_low or too_high:
        raise ValueError(f"{where}, got {value!r}")
    return v


def check_delta(name: str, value) -> float:
    """δ of an (ε, δ) guarantee: a float in (0, 1). TypeError if not a number."""
    return _in_unit_interval(name, value, one_allowed=False)


def check_rate(name: str, value) -> float:
    """A Poisson sampling rate q: a float in (0, 1]. TypeError if not a number."""
    return _in_unit_interval(name, value, one_allowed=True)


def _in_unit_interval(name: str, value, *, one_allowed: bool) -> float:
    interval = "(0, 1]" if one_allowed else "(0, 1)"
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number in {interval}, got {value!r}") from None
    if not (0.0 < v <= 1.0 if one_allowed else 0.0 < v < 1.0):
        raise ValueError(f"{name} must lie in {interval}, got {value!r}")
    return v


# ---------------------------------------------------------------------------------------------- arrays
def check_epsilons(name: str, values) -> np.ndarray:
    """Privacy budgets ε of any shape: a non-empty float64 array, every entry finite and > 0."""
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be numbers (scalar or array), got {type(values).__name__}") from None
    if arr.size == 0:
        raise ValueError(f"{name} is empty")
    bad = ~np.isfinite(arr) | (arr <= 0)
    if bad.any():
        first = arr.ravel()[np.flatnonzero(bad.ravel())[0]]
        raise ValueError(f"{name} must be finite and > 0; {int(bad.sum())} entries are not (e.g. {first})")
    return arr


def check_budgets(values, n: int | None, what: str = "budgets") -> np.ndarray:
    """Per-record budgets read from a user's data: (N,) float64, each finite and > 0 (a column
    vector (N, 1) is accepted). ``n``: the number of records they must match (None: any). The
    messages name the first bad record, for a user fixing a file."""
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be numbers") from None
    if arr.ndim == 2 and 1 in arr.shape:
        arr = arr.ravel()
    if arr.ndim != 1:
        raise ValueError(f"{what} must be one ε per record (1-D), got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{what} is empty")
    bad = ~np.isfinite(arr)
    if bad.any():
        raise ValueError(f"{what} has a missing or non-finite value at record {int(np.flatnonzero(bad)[0])} "
                         f"({float(arr[bad][0])!r}); every record needs a budget ε > 0")
    bad = arr <= 0
    if bad.any():
        raise ValueError(f"{what} has a value ≤ 0 at record {int(np.flatnonzero(bad)[0])} ({float(arr[bad][0]):g}); "
                         "every budget ε must be > 0")
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"{what} has {arr.shape[0]} values but the data have {n} records")
    return arr


def as_per_record(name: str, values, n: int, *, low: float, high: float | None = None,
                  low_inclusive: bool = True) -> np.ndarray:
    """(n,) float64 from a scalar or an array (or tensor) of n values, each finite and in
    [low, high] (or (low, high] with ``low_inclusive=False``; no upper bound when high is None)."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    arr = np.asarray(values, dtype=np.float64) if not np.isscalar(values) else np.full(n, float(values))
    if arr.ndim != 1 or arr.shape[0] != n:
        raise ValueError(f"{name} must be a number or have one value per record ({n}), got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} must be finite; found NaN or inf")
    below = arr < low if low_inclusive else arr <= low
    if below.any() or (high is not None and (arr > high).any()):
        bound = f"[{low}, {high}]" if high is not None else (f"≥ {low}" if low_inclusive else f"> {low}")
        raise ValueError(f"{name} must be {bound}; found values in [{arr.min():g}, {arr.max():g}]")
    return arr


def as_per_sample(name: str, values, batch_size: int | None = None, *, positive: bool = True) -> torch.Tensor:
    """A (B,) tensor of one batch's per-sample values (float, or float64 from ints / bools),
    checked: 1-D, of length ``batch_size`` B when given, finite, and > 0 if ``positive``. A
    Python number is broadcast to (B,) float32 (and needs ``batch_size``)."""
    if isinstance(values, (int, float)) and not isinstance(values, bool):
        if batch_size is None:
            raise TypeError(f"{name} must be a 1-D tensor or array of per-sample values")
        values = torch.full((batch_size,), float(values))
    t = torch.as_tensor(values)
    if not (t.is_floating_point() or t.dtype in (torch.bool, torch.int64, torch.int32)):
        raise TypeError(f"{name} must hold real numbers, got dtype {t.dtype}")
    t = t.double() if not t.is_floating_point() else t
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D (one value per sample), got shape {tuple(t.shape)}")
    if batch_size is not None and t.shape[0] != batch_size:
        raise ValueError(f"{name} has {t.shape[0]} values but the batch has {batch_size} samples")
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} must be finite; found NaN or inf")
    if positive and (t <= 0).any():
        raise ValueError(f"{name} must be > 0; found {t.min().item():g}")
    return t
