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
import warnings

import numpy as np
import torch

__all__ = ["as_budget_vector", "as_per_record", "as_per_sample", "check_budgets", "check_choice", "check_delta",
           "check_epsilons", "check_flag", "check_in_range", "check_int", "check_nonnegative", "check_number",
           "check_positive", "check_positive_integer", "check_positive_per_record", "check_rate"]


# ---------------------------------------------------------------------------------------------- scalars
def check_choice(name: str, value, choices) -> None:
    """Check that a value is one of the allowed choices.

    Args:
        name: the argument, as the message names it; value: what was given; choices: a tuple of the allowed
            values.
    Returns:
        None.
    Raises:
        ValueError unless ``value`` is one of them.
    """
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def check_int(name: str, value, minimum: int, maximum: int = 2 ** 63 - 1) -> int:
    """Check an int with a lower bound (and an upper one: by default the largest int64, so a seed,
    a step or a count that torch or numpy would overflow on is refused here, by name).

    Args:
        name; value: an int (a bool or a float, even 2.0, is refused); minimum: the least allowed;
            maximum: the largest allowed (default 2**63 - 1).
    Returns:
        int(value).
    Raises:
        ValueError ("an int ≥ minimum", or "an int in [minimum, maximum]" above the maximum).
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int ≥ {minimum}, got {value!r}")
    if value > maximum:
        top = "2**63 - 1 (the largest int64)" if maximum == 2 ** 63 - 1 else str(maximum)
        raise ValueError(f"{name} must be an int in [{minimum}, {top}], got {value!r}")
    return int(value)


def check_sizes(name: str, values, *, length: int | None = None, form: str = "") -> tuple[int, ...]:
    """Check a sequence of ints ≥ 1 (layer widths, blocks per stage, a record's shape).

    Args:
        name; values: a list, tuple or 1-D array of ints (a string, whose characters would be read as
            digits, a bare number, a float that int() would truncate, 0 or a negative entry is refused);
        length: the number of entries required (None: any); form: what the entries mean, for messages.
    Returns:
        the entries as a tuple of ints.
    Raises:
        TypeError for a value that is not a sequence; ValueError for a wrong length or a bad entry.
    """
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a sequence of ints{form}, got {type(values).__name__} {values!r}")
    values = tuple(values)
    if length is not None and len(values) != length:
        raise ValueError(f"{name} must have {length} entr{'y' if length == 1 else 'ies'}{form}, got {values!r}")
    return tuple(check_int(f"{name}[{i}]", v, 1) for i, v in enumerate(values))


def as_device(name: str, value) -> torch.device:
    """Check a device given as a ``torch.device`` or a string such as "cpu" or "cuda:0".

    Args:
        name; value: a ``torch.device`` or a device string.
    Returns:
        the ``torch.device``.
    Raises:
        TypeError for another type (an int, whose meaning torch ties to the current accelerator, is
        refused); ValueError for a string torch does not read as a device.
    """
    if isinstance(value, torch.device):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a torch.device or a string such as 'cpu' or 'cuda:0', "
                        f"got {type(value).__name__} {value!r}")
    try:
        return torch.device(value)
    except (RuntimeError, ValueError):
        raise ValueError(f"{name} must name a device such as 'cpu', 'cuda' or 'cuda:0', got {value!r}") from None


def check_positive_integer(name: str, value) -> int:
    """Check a positive integer (a count of steps, rounds).

    Args:
        name; value: an int ≥ 1 (an integral float such as 2.0 is accepted, a bool or a string is not).
    Returns:
        int(value).
    Raises:
        TypeError for a value that is not a number, ValueError ("a positive integer") otherwise.
    """
    if not _is_number(value):
        raise TypeError(f"{name} must be a positive integer, got {type(value).__name__} {value!r}")
    if not float(value).is_integer() or float(value) < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_in_range(name: str, value, *, low: float, high: float = math.inf, low_open: bool = True,
                   high_open: bool = False) -> float:
    """Check a finite number inside an interval.

    Args:
        name; value: a number; low, high: the interval's ends (default (low, ∞)); low_open, high_open: whether
            each end is excluded.
    Returns:
        float(value), finite and inside.
    Raises:
        TypeError if not a number (``check_number``); ValueError naming the interval, e.g. "must lie
        in (0, 1]".
    """
    lo, hi = "(" if low_open else "[", ")" if high_open or high == math.inf else "]"
    where = f"{name} must lie in {lo}{low:g}, {high:g}{hi}"
    v = check_number(name, value)  # not a string float() would read, nor a bool
    too_low = v <= low if low_open else v < low
    too_high = v >= high if high_open else v > high
    if not math.isfinite(v) or too_low or too_high:
        raise ValueError(f"{where}, got {value!r}")
    return v


def _is_number(value) -> bool:
    """An int, a float or a numpy scalar of either: not a bool, a string float() would read, a
    tensor or an array."""
    return not isinstance(value, (bool, np.bool_)) and isinstance(value, (int, float, np.integer, np.floating))


def is_cpu_rng_state(value) -> bool:
    """Whether ``value`` could be ``torch.get_rng_state()``'s (a tensor of its dtype and shape): what a
    checkpoint's saved random state must be before ``torch.set_rng_state`` is given it.

    Args:
        value: anything read from a checkpoint.
    Returns:
        True or False.
    """
    like = torch.get_rng_state()
    return isinstance(value, torch.Tensor) and value.dtype == like.dtype and value.shape == like.shape


def check_number(name: str, value) -> float:
    """Check that a value is a real number (not a bool, a string or a tensor of several values).

    Args:
        name: the argument, as the message names it.
        value: an int, a float or a numpy scalar.
    Returns:
        float(value) (possibly NaN or infinite: the range checks below refuse those).
    Raises:
        TypeError naming ``name`` otherwise.
    """
    if not _is_number(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


def check_positive(name: str, value) -> float:
    """Check a finite number > 0.

    Args:
        name: the argument, as the message names it.
        value: a clip bound, a batch size, a threshold.
    Returns:
        float(value), finite and > 0.
    Raises:
        TypeError if not a number (``check_number``), ValueError ("a finite number > 0").
    """
    v = check_number(name, value)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return v


def check_nonnegative(name: str, value) -> float:
    """Check a finite number ≥ 0.

    Args:
        name: the argument, as the message names it.
        value: a noise multiplier σ (0: no noise), a weight decay.
    Returns:
        float(value), finite and ≥ 0.
    Raises:
        TypeError if not a number (``check_number``), ValueError ("a finite number ≥ 0").
    """
    v = check_number(name, value)
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"{name} must be a finite number ≥ 0, got {value!r}")
    return v


def check_flag(name: str, value) -> bool:
    """Check a switch given as True or False (not 0/1, not a string: a typo there would pass silently).

    Args:
        name: the argument, as the message names it.
        value: True or False.
    Returns:
        ``value``.
    Raises:
        TypeError otherwise.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_delta(name: str, value) -> float:
    """Check δ of an (ε, δ) guarantee.

    Args:
        name; value: δ of an (ε, δ) guarantee.
    Returns:
        float(value) in (0, 1).
    Raises:
        TypeError if not a number, ValueError outside (0, 1).
    """
    return _in_unit_interval(name, value, one_allowed=False)


def check_rate(name: str, value) -> float:
    """Check a Poisson sampling rate.

    Args:
        name; value: a Poisson sampling rate q.
    Returns:
        float(value) in (0, 1].
    Raises:
        TypeError if not a number, ValueError outside (0, 1].
    """
    return _in_unit_interval(name, value, one_allowed=True)


def _in_unit_interval(name: str, value, *, one_allowed: bool) -> float:
    interval = "(0, 1]" if one_allowed else "(0, 1)"
    if not _is_number(value):  # not a string float() would read ("1e-5"), nor a bool
        raise TypeError(f"{name} must be a number in {interval}, got {type(value).__name__} {value!r}")
    v = float(value)
    if not (0.0 < v <= 1.0 if one_allowed else 0.0 < v < 1.0):
        raise ValueError(f"{name} must lie in {interval}, got {value!r}")
    return v


# ---------------------------------------------------------------------------------------------- arrays
def holds_whole_numbers(values: np.ndarray) -> bool:
    """Whether an array read back from a saved state holds whole numbers an int64 keeps exactly: an
    int dtype, or finite floats without a fraction below 2⁶² (a state that went through JSON). A
    count cast to int would drop its fraction, and 4.9 steps would load as 4.

    Args:
        values: an array of any dtype and shape.
    Returns:
        True or False (False for bools, strings and objects).
    """
    if values.dtype.kind in "iu":
        return True
    return values.dtype.kind == "f" and bool(np.all(np.isfinite(values) & (values == np.round(values))
                                                    & (np.abs(values) < 2.0 ** 62)))


def as_float_array(name: str, values) -> np.ndarray:
    """Numbers given as a scalar, a sequence or an array (a CPU tensor too), as float64.

    Args:
        name: the argument, as the message names it.
        values: ints or floats of any shape.
    Returns:
        a float64 array (``values`` itself when it is one).
    Raises:
        TypeError for strings numpy would read as numbers ("1"), bools, or anything else that is not
        ints or floats.
    """
    raw = values if isinstance(values, np.ndarray) else np.asarray(values)
    if raw.dtype.kind not in "iuf":
        raise TypeError(f"{name} must be numbers (scalar or array), got {type(values).__name__} of {raw.dtype}")
    return raw.astype(np.float64, copy=False)


def check_epsilons(name: str, values) -> np.ndarray:
    """Check privacy budgets ε of any shape.

    Args:
        name; values: privacy budgets ε, a scalar or an array of any shape.
    Returns:
        them as a non-empty float64 array, every entry finite and > 0.
    Raises:
        TypeError if not numbers, ValueError if empty or an entry is not finite and > 0 (the message counts
            them).
    """
    arr = as_float_array(name, values)
    if arr.size == 0:
        raise ValueError(f"{name} is empty")
    bad = ~np.isfinite(arr) | (arr <= 0)
    if bad.any():
        first = arr.ravel()[np.flatnonzero(bad.ravel())[0]]
        raise ValueError(f"{name} must be finite and > 0; {int(bad.sum())} entries are not (e.g. {first})")
    return arr


def as_budget_vector(name: str, values) -> np.ndarray:
    """Per-record budgets given to the API: one ε_i per record, as an array, a list or a torch tensor.

    Args:
        name: the argument, as the message names it.
        values: (N,) ε_i, an array, a list or a torch tensor (moved to the host).
    Returns:
        (N,) float64 ε_i, each finite and > 0 (``check_epsilons``).
    Raises:
        TypeError for None or values that are not numbers; ValueError if not 1-D, empty, or an entry is not
            finite and > 0.
    """
    if values is None:
        raise TypeError(f"{name} must be an array of per-record epsilons, got None")
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    arr = check_epsilons(name, values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one epsilon per record), got shape {arr.shape}")
    return arr


def check_budgets(values, n: int | None, what: str = "budgets") -> np.ndarray:
    """Per-record budgets read from a user's data; the messages name the first bad record, for a
    user fixing a file.

    Args:
        values: (N,) or a column (N, 1) of ε_i: an array, a list (None in it marks a missing value)
            or a CPU tensor. n: the number of records they must match (None: any).
            what: how the messages name them ("budgets in 'b.txt'").
    Returns:
        (N,) float64 ε_i, each finite and > 0.
    Raises:
        TypeError for None (budgets are required), strings (numpy would read "1" as 1.0), complex
        numbers or other objects, or ``n`` not an int ≥ 0; ValueError for booleans (True would read as
        ε = 1), another shape, no values, a missing, non-finite or ≤ 0 value (naming its record), or
        another count than ``n``.
    """
    if values is None:
        raise TypeError(f"{what} are required (one ε per record), got None")
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    try:
        raw = np.asarray(values)
    except ValueError:      # rows of different lengths
        raise ValueError(f"{what} must be one ε per record (1-D), got rows of different lengths") from None
    if raw.dtype.kind == "O":  # a list holding None (a missing value, e.g. from a Hugging Face column) or objects
        if not all(v is None or _is_number(v) for v in raw.ravel()):
            first = next(v for v in raw.ravel() if not (v is None or _is_number(v)))
            raise TypeError(f"{what} must be numbers, got {type(first).__name__} {first!r}")
        raw = np.array([math.nan if v is None else float(v) for v in raw.ravel()]).reshape(raw.shape)
    if raw.dtype.kind == "b":  # True would read as ε = 1
        raise ValueError(f"{what} must be numbers, not booleans")
    if raw.dtype.kind not in "iuf":
        kind = {"U": "strings", "S": "strings", "c": "complex numbers"}.get(raw.dtype.kind, f"dtype {raw.dtype}")
        raise TypeError(f"{what} must be real numbers, got {kind}")
    arr = raw.astype(np.float64, copy=False)
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
    if n is not None and arr.shape[0] != check_int("n (the number of records)", n, 0):
        raise ValueError(f"{what} has {arr.shape[0]} values but the data have {n} records")
    return arr


def check_positive_per_record(name: str, values, n: int, *, records: str = "record") -> np.ndarray:
    """Per-record values a program built (so the messages are short), e.g. a client's budgets.

    Args:
        name; values: (n,) numbers; n: how many; records: what one value belongs to, as the shape
            message says it ("record", "training record").
    Returns:
        (n,) float64, every value finite and > 0.
    """
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    arr = as_float_array(name, values)  # not strings numpy would read ("1.0"), nor bools
    if arr.ndim != 1 or arr.shape[0] != n:
        raise ValueError(f"{name} must have one value per {records} ({n}), got shape {arr.shape}")
    if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        raise ValueError(f"{name} must be finite and > 0")
    return arr


def as_per_record(name: str, values, n: int, *, low: float, high: float | None = None,
                  low_inclusive: bool = True) -> np.ndarray:
    """A per-record quantity (sampling rates q_i, clip bounds c_i).

    Args:
        name; values: a scalar (the same for every record) or an array / tensor of n values;
            n: the number of records; low, high: bounds (high None: none); low_inclusive: whether
            ``low`` itself is allowed.
    Returns:
        (n,) float64, each finite and in [low, high] (or (low, high]).
    Raises:
        TypeError for values that are not numbers (``as_float_array``, ``check_number``); ValueError
        for another length than n, or a value not finite or outside the bounds.
    """
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    # numbers only: not strings numpy would read ("0.1"), nor bools
    arr = as_float_array(name, values) if not np.isscalar(values) else np.full(n, check_number(name, values))
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
    """One batch's per-sample values (clip bounds, a padding mask).

    Args:
        name; values: a 1-D tensor / array, or a Python number (broadcast to (B,) float32, which
            needs ``batch_size``); batch_size: B, the length they must have (None: any);
            positive: whether every value must be > 0.
    Returns:
        (B,) tensor: float as given, or float64 from ints / bools; finite.
    Raises:
        TypeError for values that are not numbers (strings; booleans where ``positive``); ValueError
        for another shape or length, a value not finite, or (``positive``) ≤ 0.
    """
    if isinstance(values, (int, float)) and not isinstance(values, bool):
        if batch_size is None:
            raise TypeError(f"{name} must be a 1-D tensor or array of per-sample values")
        values = torch.full((batch_size,), float(values))
    try:
        t = torch.as_tensor(values)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name} must be a 1-D tensor or array of numbers, got {type(values).__name__}") from None
    if not (t.is_floating_point() or t.dtype in (torch.bool, torch.int64, torch.int32)):
        raise TypeError(f"{name} must hold real numbers, got dtype {t.dtype}")
    if positive and t.dtype == torch.bool:  # True would read as a bound of 1
        raise TypeError(f"{name} must hold numbers, not booleans")
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


class LargeDeltaWarning(UserWarning):
    """δ ≥ 1/N: a mechanism may then publish a few records in the clear and still be (ε, δ)-DP."""


def large_delta_message(delta: float, n: int, name: str = "delta") -> str | None:
    """What to say when δ ≥ 1/N for N records (None when δ < 1/N).

    Args:
        delta: δ in (0, 1); n: the number of records; name: the argument or option, for the message.
    Returns:
        the warning's text, or None.
    """
    if n > 0 and delta >= 1.0 / n:
        return (f"{name} {delta:g} ≥ 1/N = 1/{n}: a mechanism with such a δ may publish a few records in the clear; "
                f"use δ well below 1/N (e.g. {10 ** math.floor(math.log10(0.1 / n)):g})")
    return None


def warn_large_delta(delta: float, n: int, name: str = "delta") -> None:
    """Warn (``LargeDeltaWarning``) when δ ≥ 1/N for N records (``large_delta_message``).

    Args:
        delta: δ in (0, 1); n: the number of records; name: the argument, for the message.
    Returns:
        None.
    """
    text = large_delta_message(delta, n, name)
    if text is not None:
        warnings.warn(text, LargeDeltaWarning, stacklevel=3)
