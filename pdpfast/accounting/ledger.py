"""Per-record privacy ledgers: what each record has spent so far, by the accountant of its plan.

``IndividualAccountant`` keeps the RDP history of every record (below); ``PLDIndividualAccountant``
counts the whole-dataset steps of records grouped by (q, z) and converts them to ε through
privacy loss distributions. ``ledger_for_plan`` picks the ledger that matches a plan's
``accountant``: a ledger of another accountant would report ε the plan never promised (an RDP
ledger reports a PLD plan's records at 1.1-1.6x their budgets, though the PLD guarantee holds).

Both ledgers persist the same way.

RDP ledger
----------

Records whose whole history is identical (same (q, z) at every step so far) share one row of
accumulated RDP; ``group_of[i]`` maps record i to its row. Besides the shared grid of orders,
a record may carry its own order (``record_orders``: a calibrated plan's ``group_orders``, found
off the grid for its (q, z)); its row accumulates RDP at that order too, so the ledger certifies
at the very order the plan did and reports the plan's ε. A step that changes some records'
(q, z) (a new plan, a record dropping out with q = 0, a ``record_ids`` subset) splits rows, never
merges them. RDP per step is evaluated once per distinct (q, z) pair with the same engine as
calibration (integer orders exact, fractional orders by quadrature; within ~1e-16 per step of
the Opacus series).

PLD ledger
----------

A PLD is not additive like RDP: ε after T steps needs the T-fold composition. The ledger
therefore stores only the number of whole-dataset steps taken and each record's (q, z) group,
and computes ε_g(T) = PLD of T self-compositions of the Poisson-subsampled Gaussian
(``pld.pld_epsilon``, pessimistic discretization, so an upper bound) when asked, once per
(group, T, δ). ``would_exceed`` needs no per-step computation: a record's true ε grows with the
number of steps (T steps are a post-processing of T + 1), so one PLD at the plan's step count
(``horizon``), within budget, certifies every count up to it.

Persistence is crash-safe: ``save`` writes a temporary file in the same directory, fsyncs it,
``os.replace``s it over the target and fsyncs the directory, so the file on disk is always a
complete ledger, old or new. Charge before release: call ``step`` and ``save`` before the model
update that spends the budget leaves the process, so a crash can only over-count spending.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from .._checks import (
    as_float_array,
    as_per_record,
    check_delta,
    check_int,
    check_positive_integer,
    holds_whole_numbers,
)
from .._io import atomic_write
from . import pld
from .sgm import DEFAULT_ORDERS, as_orders, distinct_rows, eps_from_rdp, rdp_at, rdp_one_step

__all__ = ["IndividualAccountant", "PLDIndividualAccountant", "ledger_for_plan", "register_ledger"]

_FORMAT_VERSION = 1
_PAIR_CACHE_SIZE = 1 << 16   # distinct (q, z) rows of one-step RDP the RDP ledger caches
_PAIR_CHUNK = 1 << 14        # pairs per rdp_one_step call when there are more than it caches
_ANCHOR_REACH = 128          # steps ``would_exceed`` bounds ε over from one exact evaluation
_ROUNDOFF = np.finfo(np.float64).eps / 2


def _pair_keys(q: np.ndarray, z: np.ndarray):
    """(distinct (q, z) pairs (P, 2), index of each element's pair)."""
    first, ids = distinct_rows(q + 0.0, z + 0.0)     # + 0.0: −0.0 and 0.0 are one value
    return np.stack([q[first], z[first]], axis=1), ids


def _check_rates(q, z):
    if np.any(~np.isfinite(q)) or np.any((q < 0) | (q > 1)):
        raise ValueError("sample_rates must lie in [0, 1]")
    if np.any(np.isnan(z)) or np.any(z < 0):
        raise ValueError("noise_multipliers must be >= 0")


def _per_record(sample_rates, noise_multipliers):
    """(N,) q and (N,) z, broadcast against each other (a number or one value stands for every record)
    and validated."""
    q = np.atleast_1d(as_float_array("sample_rates", sample_rates))
    z = np.atleast_1d(as_float_array("noise_multipliers", noise_multipliers))
    if q.ndim != 1 or z.ndim != 1 or (q.shape[0] != z.shape[0] and 1 not in (q.shape[0], z.shape[0])):
        raise ValueError(f"sample_rates and noise_multipliers must be numbers or 1-D with one value per record "
                         f"(the same length), got shapes {q.shape} and {z.shape}")
    n = max(q.shape[0], z.shape[0])
    q, z = np.broadcast_to(q, (n,)).copy(), np.broadcast_to(z, (n,)).copy()
    _check_rates(q, z)
    return q, z


def _whole(name: str, value, ndim: int) -> np.ndarray:
    """A count read from a ledger state: whole numbers (an int dtype, or floats without a fraction) of
    ``ndim`` dimensions, as int64. A count cast to int would drop its fraction (4.9 steps loading as 4
    under-reports; a group index 1.5 read as 1 moves the record to another row)."""
    v = np.asarray(value)
    if not holds_whole_numbers(v):
        shown = repr(v.item()) if v.ndim == 0 else f"{v.dtype} values"
        raise ValueError(f"ledger state: {name} must hold whole numbers, got {shown}")
    if v.ndim != ndim:
        raise ValueError(f"ledger state: {name} must be {'one number' if ndim == 0 else f'{ndim}-D'}, got shape "
                         f"{v.shape}")
    return v.astype(np.int64)


def _state_values(state, keys, ledger: str, accountant: str) -> None:
    """Refuse a state that is not a mapping, was written by another accountant's ledger (said first
    when the state names its accountant: its keys differ too), or lacks any of ``keys`` (all named at
    once; a state without a name is an RDP ledger's of an earlier version)."""
    if not isinstance(state, Mapping):
        raise TypeError(f"ledger state must be a dict as state_dict() returns it (or a loaded .npz), got "
                        f"{type(state).__name__}")
    if "accountant" in state:
        _check_accountant(state, accountant)
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"ledger state lacks {', '.join(missing)}: not a state_dict() of a {ledger}")
    _check_accountant(state, accountant)


def _check_accountant(state: dict, expected: str) -> None:
    # states written before the PLD ledger existed carry no name: they are RDP ledgers
    saved = str(state.get("accountant", "rdp"))
    if saved != expected:
        raise ValueError(f"this ledger state was written by accountant='{saved}', not accountant='{expected}'; "
                         "load it into the ledger of its own accountant (see ledger_for_plan)")


def _fixed_budgets(budgets, n: int):
    """(n,) ε_i > 0 as the ledger's own read-only copy, or None: the ledger keeps per-row summaries of
    them (the smallest budget of each row), which a budget changed in place would leave stale."""
    if budgets is None:
        return None
    fixed = as_per_record("budgets", budgets, n, low=0.0, low_inclusive=False).copy()
    fixed.flags.writeable = False
    return fixed


_LEDGERS: dict = {}


def register_ledger(accountant: str):
    """Class decorator: the ledger for plans calibrated with ``accountant`` (``ledger_for_plan``).

    Args:
        accountant: the plans' accountant, "rdp" or "pld" (the class provides ``for_plan(plan, budgets)``).
    Returns:
        the decorator; it stores the class under ``accountant``, replacing any earlier one, and returns
        the class unchanged.
    """
    def deco(cls):
        _LEDGERS[accountant] = cls
        return cls
    return deco


def ledger_for_plan(plan, budgets=None):
    """A fresh ledger that accounts ``plan``'s records with the plan's own accountant.

    Args:
        plan: a :class:`PrivacyPlan` (its ``accountant`` picks the ledger).
        budgets: (N,) ε_i (or one scalar) for ``would_exceed`` and ``remaining`` (default: the
            budgets the plan was calibrated for).
    Returns:
        an :class:`IndividualAccountant` ("rdp") or :class:`PLDIndividualAccountant` ("pld") with no
        step taken.
    Raises:
        TypeError if ``plan`` is not a plan (None, a string, a dict); ValueError if no ledger is
        registered for the plan's accountant.
    """
    if not isinstance(getattr(plan, "accountant", None), str):
        raise TypeError(f"plan must be a PrivacyPlan (what calibrate returns), got {type(plan).__name__}")
    if plan.accountant not in _LEDGERS:
        raise ValueError(f"no ledger for accountant {plan.accountant!r}; known: {sorted(_LEDGERS)}")
    return _LEDGERS[plan.accountant].for_plan(plan, plan.budgets if budgets is None else budgets)


def _per_id(name: str, values, n_given: int, first: np.ndarray, where: np.ndarray):
    """Per-id values reordered to the sorted unique ids (``np.unique(ids, return_index=True,
    return_inverse=True)`` gave ``first`` and ``where``); a scalar or None passes through.

    Args:
        name: the argument, as messages name it.
        values: None, a scalar, or one value per id as given (n_given,).
        n_given: how many ids were given (duplicates included).
        first, where: from ``np.unique`` of the given ids.
    Returns:
        None, the scalar, or (U,) float64 values of the sorted unique ids.
    Raises:
        ValueError for another length or more than one dimension, or an id given twice with different values.
    """
    if values is None or np.ndim(values) == 0:
        return values
    v = as_float_array(name, values)  # numbers only: a True rate would read as q = 1
    if v.ndim != 1 or v.shape[0] != n_given:
        raise ValueError(f"{name} must be a scalar or one value per entry of record_ids ({n_given}), got "
                         f"{v.shape[0]}")
    if not np.array_equal(v, v[first][where], equal_nan=True):  # (a NaN is refused with the rates)
        raise ValueError(f"record_ids names a record twice with different {name}")
    return v[first]


class _RecordLedger:
    """What every per-record ledger shares: records grouped by distinct (q_i, z_i) (``group_of``,
    ``group_rates``, ``group_noise``), and atomic save / load of its ``state_dict``."""

    @property
    def num_records(self) -> int:
        """N, the number of records."""
        return int(self.group_of.shape[0])

    @property
    def sample_rates(self) -> np.ndarray:
        """(N,) current q_i."""
        return self.group_rates[self.group_of]

    @property
    def noise_multipliers(self) -> np.ndarray:
        """(N,) current z_i."""
        return self.group_noise[self.group_of]

    def save(self, path) -> None:
        """Atomically write the ledger to ``path`` (.npz): temp file in the same directory,
        fsync, os.replace, fsync the directory. The file is never left half-written.

        Args:
            path: the file to write (str or path-like).
        Returns:
            None; the file holds ``state_dict()``.
        """
        atomic_write(path, lambda f: np.savez(f, **self.state_dict()))

    @classmethod
    def load(cls, path):
        """A ledger read from a file ``save`` wrote.

        Args:
            path: the .npz file (str or path-like).
        Returns:
            a new ledger of this class.
        Raises:
            ValueError if the file was written by another accountant's ledger or is inconsistent
            (see ``load_state_dict``).
        """
        with np.load(os.fspath(path), allow_pickle=False) as data:
            state = {k: data[k] for k in data.files}
        obj = cls.__new__(cls)
        obj.load_state_dict(state)
        return obj

    def would_exceed(self, delta, n=1) -> np.ndarray:
        """Records whose ε after ``n`` more steps at their current (q, z) would exceed their budget.

        Args:
            delta: δ in (0, 1).
            n: the number of further steps (positive int).
        Returns:
            (N,) bool, True where ε_i would exceed its budget (``exceeding``'s records).
        Raises:
            ValueError without ``budgets``, for n not a positive integer or δ outside (0, 1).
        """
        over = np.zeros(self.num_records, dtype=bool)
        over[self.exceeding(delta, n)] = True
        return over

    def _members(self):
        """((N,) record ids ordered by row, (G + 1,) where each row's ids start in it, (G,) the smallest
        budget of each row's members (inf for a row without members)), kept until rows or budgets are
        replaced. Row g's records are ``ids[starts[g]:starts[g + 1]]``, ascending."""
        cached = self.__dict__.get("_member_index")
        if cached is not None and cached[0] is self.group_of and cached[1] is self.budgets:
            return cached[2]
        rows = self.group_rates.shape[0]
        # a stable sort of 16-bit keys is numpy's radix sort (10^7 records: 0.15-0.3 s instead of 0.6-1.3)
        keys = self.group_of.astype(np.uint16) if rows <= 1 << 16 else self.group_of
        ids = np.argsort(keys, kind="stable")
        counts = np.bincount(self.group_of, minlength=rows)
        starts = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        smallest = np.full(rows, np.inf)
        if self.budgets is not None and ids.size:
            held = counts > 0
            smallest[held] = np.minimum.reduceat(self.budgets[ids], starts[:-1][held])
        self._member_index = (self.group_of, self.budgets, (ids, starts, smallest))
        return self._member_index[2]

    def _members_of(self, rows: np.ndarray) -> np.ndarray:
        """The records of ``rows`` (sorted distinct row indices), row after row: O(their number), not O(N)."""
        ids, starts, _ = self._members()
        counts = starts[rows + 1] - starts[rows]
        ends = np.cumsum(counts)
        return ids[np.repeat(starts[rows] - ends + counts, counts) + np.arange(ends[-1] if ends.size else 0)]

    def remaining(self, delta) -> np.ndarray:
        """Budget left per record: max(ε_i − spent, 0).

        Args:
            delta: δ in (0, 1).
        Returns:
            (N,) float64 ≥ 0.
        Raises:
            ValueError without ``budgets`` or for δ outside (0, 1).
        """
        if self.budgets is None:
            raise ValueError(f"remaining needs budgets (pass budgets= to {type(self).__name__})")
        return np.maximum(self.budgets - self.epsilons(delta), 0.0)

    def _record_state(self) -> dict:
        """The entries of ``state_dict`` every ledger writes: "accountant", "format_version",
        "group_of" (N,), "group_rates" / "group_noise" (G,), "steps_taken", "budgets" ((N,), or (0,)
        with "has_budgets" False); copies."""
        return {"accountant": np.str_(self.name), "format_version": np.int64(_FORMAT_VERSION),
                "group_of": self.group_of.copy(), "group_rates": self.group_rates.copy(),
                "group_noise": self.group_noise.copy(), "steps_taken": np.int64(self.steps_taken),
                "budgets": np.zeros(0) if self.budgets is None else self.budgets.copy(),
                "has_budgets": np.bool_(self.budgets is not None)}

    _RECORD_KEYS = ("format_version", "group_of", "group_rates", "group_noise", "steps_taken", "budgets",
                    "has_budgets")

    def _checked_record_state(self, state: dict, keys: tuple = ()) -> dict:
        """The entries of ``_record_state`` read back from ``state`` and checked, nothing assigned
        yet: a state that fails any check leaves the ledger as it was. A corrupt file must never
        load as a ledger that under-reports spending or compares against broken budgets (a NaN
        budget would never be exceeded).

        Args:
            state: what ``state_dict`` wrote; keys: the entries the ledger's own ``load_state_dict``
                needs besides the shared ones (all missing ones are named at once).
        Returns:
            {"group_of", "group_rates", "group_noise", "steps_taken", "budgets"} (budgets None
            without them).
        Raises:
            TypeError if ``state`` is not a dict (or loaded .npz), or holds values that are not
            numbers; ValueError if it lacks an entry, was written by another accountant's ledger or
            another format_version; if group_rates and group_noise are not two 1-D arrays of one
            length, or hold a q outside [0, 1] or a z < 0 or NaN; if group_of or steps_taken are
            not whole numbers (4.9 steps would load as 4), group_of indexes past the groups or
            steps_taken < 0; if has_budgets is not True or False; or if budgets are not one finite
            ε > 0 per record.
        """
        _state_values(state, self._RECORD_KEYS + tuple(keys), type(self).__name__, self.name)
        if int(_whole("format_version", state["format_version"], 0)) != _FORMAT_VERSION:
            raise ValueError(f"unsupported ledger format_version {state['format_version']!r}")
        group_of = _whole("group_of", state["group_of"], 1)
        group_rates = as_float_array("ledger state: group_rates", state["group_rates"])
        group_noise = as_float_array("ledger state: group_noise", state["group_noise"])
        if group_rates.shape != group_noise.shape or group_rates.ndim != 1:
            raise ValueError("ledger state: group_rates and group_noise do not match")
        if group_of.size and (group_of.min() < 0 or group_of.max() >= group_rates.shape[0]):
            raise ValueError("ledger state: group_of out of range")
        _check_rates(group_rates, group_noise)
        steps_taken = int(_whole("steps_taken", state["steps_taken"], 0))
        if steps_taken < 0:
            raise ValueError(f"ledger state: steps_taken must be >= 0, got {steps_taken}")
        has_budgets = np.asarray(state["has_budgets"])
        if has_budgets.dtype != bool or has_budgets.ndim != 0:   # "no" would read as True
            raise ValueError(f"ledger state: has_budgets must be True or False, got {state['has_budgets']!r}")
        budgets = None
        if bool(has_budgets):
            if np.shape(state["budgets"]) != group_of.shape:
                raise ValueError("ledger state: budgets do not match group_of")
            budgets = _fixed_budgets(state["budgets"], group_of.shape[0])   # checked, and the ledger's own copy
        # copies: the ledger adds into its arrays in place, and must not write into the caller's state
        return {"group_of": group_of.copy(), "group_rates": group_rates.copy(), "group_noise": group_noise.copy(),
                "steps_taken": steps_taken, "budgets": budgets}


@register_ledger("rdp")
class IndividualAccountant(_RecordLedger):
    """RDP ledger of N records under Poisson-subsampled Gaussian steps.

    Records of equal (q_i, z_i) share one row of accumulated RDP, so cost follows the number of
    distinct pairs G: a calibrated plan's (a few thousand rows for 10^5 distinct budgets: about
    2.5 ms a step with ``would_exceed``, which re-evaluates every row only every few dozen steps).
    Arbitrary per-record rates make G = N: the first step then computes one-step RDP for every pair
    (~0.15 ms each: 2.5 minutes and ~10 GB for 10^6 distinct pairs on one core).

    Args:
        sample_rates: (N,) or scalar q_i in [0, 1].
        noise_multipliers: (N,) or scalar effective z_i = σC/c_i ≥ 0.
        orders: RDP orders (default ``DEFAULT_ORDERS``).
        budgets: optional (N,) ε_i, for ``would_exceed`` and ``remaining``.
        record_orders: optional one more RDP order per record (> 1, finite; NaN: none), a number or (N,),
            accounted alongside ``orders``: a calibrated plan's own order of each record's group.

    Raises:
        TypeError for arguments that are not numbers (strings, bools); ValueError for a rate, noise
        multiplier, order or budget out of range, or arrays of another length than the records.
    """

    name = "rdp"

    def __init__(self, sample_rates, noise_multipliers, orders=None, budgets=None, record_orders=None):
        q, z = _per_record(sample_rates, noise_multipliers)
        self.orders = as_orders(DEFAULT_ORDERS if orders is None else orders)[0]
        self.budgets = _fixed_budgets(budgets, q.shape[0])
        own = np.full(q.shape[0], np.nan)
        if record_orders is not None:
            given = as_float_array("record_orders", record_orders)
            if given.ndim > 1 or (given.ndim == 1 and given.shape != q.shape):
                raise ValueError(f"record_orders must be a number or one order per record ({q.shape[0]}), got shape "
                                 f"{given.shape}")
            own = np.broadcast_to(given, q.shape).copy()
            if np.any(~np.isnan(own) & ~(own > 1.0)) or np.any(np.isinf(own)):
                raise ValueError("record_orders must be finite and > 1 (NaN for none)")
        first, inverse = distinct_rows(q + 0.0, z + 0.0, np.nan_to_num(own, nan=0.0))
        self.group_of = inverse.astype(np.int64)                  # (N,) record → history row
        self.group_rates = q[first].copy()                        # (G,) current q of each row
        self.group_noise = z[first].copy()                        # (G,) current z of each row
        self.group_rdp = np.zeros((first.shape[0], self.orders.shape[0]))   # (G, n_orders)
        self.group_own_order = own[first].copy()                  # (G,) the row's own order (NaN: none)
        self.group_own_rdp = np.zeros(first.shape[0])             # (G,) its RDP at that order
        self.steps_taken = 0

    @classmethod
    def for_plan(cls, plan, budgets) -> IndividualAccountant:
        """The RDP ledger of an RDP plan's records, certified at the plan's own orders.

        Args:
            plan: a :class:`PrivacyPlan` (its per-record q_i and z_i = σC/c_i, its ``orders`` (default
                orders when empty) and each record's group order).
            budgets: (N,) ε_i (or one scalar), or None.
        Returns:
            the :class:`IndividualAccountant`, no step taken.
        """
        own = None if plan.group_orders is None else plan.group_orders[plan.group_index]
        return cls(plan.sample_rates, plan.noise_multipliers, orders=plan.orders or None, budgets=budgets,
                   record_orders=own)

    # ------------------------------------------------------------------ composition
    def _rdp_per_step(self, rates, noises) -> np.ndarray:
        """(len(rates), n_orders) RDP of one step per (q, z), each distinct pair computed once
        and, when there are few, cached (training repeats the same pairs every step)."""
        cache = self.__dict__.setdefault("_pair_cache", {})
        if not len(rates):  # a step no record takes part in (record_ids empty): nothing to charge
            return np.zeros((0, self.orders.shape[0]))
        pairs, inverse = _pair_keys(rates, noises)
        if pairs.shape[0] > _PAIR_CACHE_SIZE // 4:
            # e.g. 10^6 records of distinct budgets: a dict of a million rows would take gigabytes for a
            # result ``_current_step_rdp`` keeps anyway; computed in chunks, bounding the work memory
            rows = np.empty((pairs.shape[0], self.orders.shape[0]))
            for start in range(0, pairs.shape[0], _PAIR_CHUNK):
                part = pairs[start:start + _PAIR_CHUNK]
                rows[start:start + _PAIR_CHUNK] = rdp_one_step(part[:, 0].copy(), part[:, 1].copy(), self.orders)
            return rows[inverse]
        keys = list(map(tuple, pairs.tolist()))
        missing = [k for k in keys if k not in cache]
        if missing and cache and len(missing) == len(keys):
            # none seen before (a noise schedule gives every step new multipliers): computed, not cached,
            # or the cache would fill with pairs that never come back
            return rdp_one_step(pairs[:, 0].copy(), pairs[:, 1].copy(), self.orders)[inverse]
        if missing:
            arr = np.array(missing, dtype=np.float64)
            rows = rdp_one_step(arr[:, 0].copy(), arr[:, 1].copy(), self.orders)
            if len(cache) + len(missing) > _PAIR_CACHE_SIZE:
                cache.clear()
            cache.update(zip(missing, rows))
        return np.stack([cache[k] for k in keys])[inverse]

    def step(self, n=1, *, sample_rates=None, noise_multipliers=None, record_ids=None):
        """Compose ``n`` steps.

        Without arguments every record takes n steps at its current (q_i, z_i). ``sample_rates`` /
        ``noise_multipliers`` set new current values first (they persist). With ``record_ids`` only
        those records take part in these steps; the others are charged nothing (as with q = 0).

        Args:
            n: the number of steps (positive int).
            sample_rates, noise_multipliers: new current (q_i, z_i), as in ``set_rates``; None: keep.
            record_ids: ints in [0, N) (one id or 1-D), the records taking part; None: all.
        Returns:
            self, updated in place.
        Raises:
            ValueError for n not a positive integer, ids of more than one dimension or out of range, or a
            rate / multiplier out of range or of another length than the records; TypeError for ids that
            are not integers (a boolean mask: pass ``np.flatnonzero(mask)``).
        """
        n = check_positive_integer("n", n)
        ids = self._set_rates(sample_rates, noise_multipliers, record_ids)
        if ids is None:
            grid, own = self._current_step_rdp()
            if n == 1:  # the same sums (1 * x is x) without a (G, n_orders) temporary every training step
                self.group_rdp += grid
                self.group_own_rdp += own
            else:
                self.group_rdp += n * grid
                self.group_own_rdp += n * own
        else:
            # participating records leave their rows (a row is split when only part of it steps)
            self._split(ids, self.group_rates[self.group_of[ids]], self.group_noise[self.group_of[ids]])
            rows = np.unique(self.group_of[ids])
            self.group_rdp[rows] += n * self._rdp_per_step(self.group_rates[rows], self.group_noise[rows])
            self.group_own_rdp[rows] += n * self._own_rdp_per_step(rows)
        self.steps_taken += n
        return self

    def set_rates(self, *, sample_rates=None, noise_multipliers=None, record_ids=None):
        """Set the current (q, z) of every record (or of ``record_ids``) without taking a step: what
        the next ``step()`` and ``would_exceed`` use (a noise schedule sets each step's z this way
        before the step is checked and charged).

        Args:
            sample_rates: new q_i in [0, 1]: a scalar, (N,) without ``record_ids``, or one per entry of
                ``record_ids`` in its order (an id given twice must repeat its value); None: keep.
            noise_multipliers: new z_i ≥ 0 (noise std / the record's clip norm), same shapes; None: keep.
            record_ids: ints in [0, N), the records to update; None: all.
        Returns:
            self, updated in place.
        Raises:
            ValueError for an id out of range or a rate / multiplier out of range or of another length;
            TypeError for ids that are not integers.
        """
        self._set_rates(sample_rates, noise_multipliers, record_ids)
        return self

    def _set_rates(self, sample_rates, noise_multipliers, record_ids) -> np.ndarray | None:
        """``set_rates``'s work; returns the record ids, sorted and unique (None: all records).

        Per-id values follow the ids as given (not their sorted order); an id named twice must
        carry the same values both times.
        """
        if record_ids is None:
            ids = None
        else:
            raw = np.asarray(record_ids)
            if raw.ndim > 1:   # [[0, 1]] was flattened: ids are one list of records
                raise ValueError(f"record_ids must be one id or a 1-D sequence of ids, got shape {raw.shape}")
            if raw.size and (raw.dtype == bool or not np.issubdtype(raw.dtype, np.integer)):
                # a boolean mask read as ids 0 and 1 would charge two records in place of the masked ones
                raise TypeError(f"record_ids must be integer record indices, got dtype {raw.dtype} (for a boolean "
                                "mask of the records taking part, pass np.flatnonzero(mask))")
            given = raw.astype(np.int64).ravel()
            ids, first, where = np.unique(given, return_index=True, return_inverse=True)
            if ids.size and (ids[0] < 0 or ids[-1] >= self.num_records):
                raise ValueError(f"record_ids must lie in [0, {self.num_records})")
            sample_rates = _per_id("sample_rates", sample_rates, given.size, first, where)
            noise_multipliers = _per_id("noise_multipliers", noise_multipliers, given.size, first, where)
        if sample_rates is not None or noise_multipliers is not None:
            self._update_rates(sample_rates, noise_multipliers, ids)
        return ids

    def group_members(self) -> tuple[np.ndarray, np.ndarray]:
        """Which records each row of accumulated RDP holds (kept until the rows change).

        Returns:
            ((N,) int64 record ids ordered by row, (G + 1,) int64 offsets): row g's records are
            ``ids[starts[g]:starts[g + 1]]``, ascending.
        """
        ids, starts, _ = self._members()
        return ids, starts

    def set_group_noise(self, noise_multipliers):
        """Give every row's records one new current z at once: what ``set_rates(noise_multipliers=z)``
        does when the members of each row get one value, in O(G) instead of reading N records (a noise
        schedule sets every record's z_i·h(t) before each step).

        Args:
            noise_multipliers: (G,) z ≥ 0 of the rows (``group_noise``'s order).
        Returns:
            self, updated in place.
        Raises:
            ValueError for another length or a negative or NaN value; TypeError for values that are not numbers.
        """
        z = as_float_array("noise_multipliers", noise_multipliers)
        if z.shape != self.group_noise.shape:
            raise ValueError(f"noise_multipliers must be one value per row ({self.group_noise.shape[0]}), got shape "
                             f"{z.shape}")
        _check_rates(self.group_rates, z)
        self.group_noise = z + 0.0    # + 0.0 as set_rates: −0.0 and 0.0 are one value
        self.__dict__.pop("_step_rdp", None)
        return self

    def _own_rdp_per_step(self, rows) -> np.ndarray:
        """(len(rows),) RDP of one step of each row at its own order (0 where it has none)."""
        own = self.group_own_order[rows]
        out = np.zeros(own.shape[0])
        has = ~np.isnan(own)
        if has.any():
            out[has] = rdp_at(self.group_rates[rows][has], self.group_noise[rows][has], own[has])
        return out

    def _current_step_rdp(self):
        """((G, n_orders), (G,)) RDP of one step of every row at its current (q, z) at the grid and
        at its own order, kept until rows change (a training loop calls ``step()`` once per step)."""
        cached = self.__dict__.get("_step_rdp")
        if cached is None or cached[0].shape[0] != self.group_rates.shape[0]:
            rows = np.arange(self.group_rates.shape[0])
            cached = self._step_rdp = (self._rdp_per_step(self.group_rates, self.group_noise),
                                       self._own_rdp_per_step(rows))
        return cached

    def _update_rates(self, sample_rates, noise_multipliers, ids):
        sel = np.arange(self.num_records) if ids is None else ids

        def per_record(name, values, current):
            if values is None:
                return current[self.group_of[sel]]
            v = as_float_array(name, values)
            if v.ndim > 1 or (v.ndim == 1 and v.shape[0] not in (1, sel.shape[0])):
                raise ValueError(f"{name} must be a scalar or one value per record ({sel.shape[0]}), got shape "
                                 f"{v.shape}")
            return np.broadcast_to(v, sel.shape).copy()

        q = per_record("sample_rates", sample_rates, self.group_rates)
        z = per_record("noise_multipliers", noise_multipliers, self.group_noise)
        _check_rates(q, z)
        if ids is None:  # every record: when each row's members get one value (a noise schedule
            # scaling every z, a new scalar rate), the rows stay as they are: no sort of N records
            row_q, row_z = self.group_rates.copy(), self.group_noise.copy()
            row_q[self.group_of], row_z[self.group_of] = q + 0.0, z + 0.0
            if np.array_equal(row_q[self.group_of], q) and np.array_equal(row_z[self.group_of], z):
                self.group_rates, self.group_noise = row_q, row_z
                self.__dict__.pop("_step_rdp", None)
                return
        self._split(sel, q, z)

    def _split(self, sel, q, z):
        """Give records ``sel`` the current (q, z), splitting rows whose members now differ
        (or of which only some are in ``sel``)."""
        g = self.num_records
        key_q = self.group_rates[self.group_of].copy()
        key_z = self.group_noise[self.group_of].copy()
        member = np.zeros(g, dtype=np.int8)
        key_q[sel], key_z[sel], member[sel] = q, z, 1
        self.__dict__.pop("_step_rdp", None)
        first, inverse = distinct_rows(self.group_of, member, key_q + 0.0, key_z + 0.0)
        self.group_rdp = self.group_rdp[self.group_of[first]].copy()
        self.group_own_order = self.group_own_order[self.group_of[first]].copy()
        self.group_own_rdp = self.group_own_rdp[self.group_of[first]].copy()
        self.group_rates, self.group_noise = key_q[first].copy(), key_z[first].copy()
        self.group_of = inverse.astype(np.int64)

    # ------------------------------------------------------------------ queries
    def rdp(self) -> np.ndarray:
        """Accumulated RDP of every record at the grid ``orders`` (materialized: prefer ``epsilons``).

        Returns:
            (N, n_orders) float64 RDP (the records' own orders are not included), a new array.
        """
        return self.group_rdp[self.group_of]

    def _group_eps(self, delta, extra_steps=0, rows=None):
        """(ε, index of the optimal order) of each row (of ``rows``; None: all) after ``extra_steps``
        more steps at its current (q, z); index n_orders is the row's own order, -1 none."""
        sel = slice(None) if rows is None else rows
        rdp, own = self.group_rdp[sel], self.group_own_rdp[sel]
        if extra_steps:
            grid, own_step = self._current_step_rdp()
            rdp, own = rdp + extra_steps * grid[sel], own + extra_steps * own_step[sel]
        # each row's own order is one more column (NaN where it has none: never the minimum)
        orders = np.concatenate([np.broadcast_to(self.orders, rdp.shape), self.group_own_order[sel, None]], axis=1)
        return eps_from_rdp(orders, np.concatenate([rdp, own[:, None]], axis=1), check_delta("delta", delta))

    def epsilons(self, delta) -> np.ndarray:
        """ε_i(δ) spent so far (the conversion of ``get_privacy_spent``, over the grid and each record's own order).

        Args:
            delta: δ in (0, 1).
        Returns:
            (N,) float64 ε_i ≥ 0; 0 before any step (and for records charged nothing so far).
        Raises:
            ValueError (TypeError if not a number) for δ outside (0, 1).
        """
        eps = np.maximum(self._group_eps(delta)[0], 0.0)
        eps = np.where(np.all(self.group_rdp == 0, axis=1), 0.0, eps)
        return eps[self.group_of]

    def exceeding(self, delta, n=1) -> np.ndarray:
        """The records whose ε after ``n`` more steps at their current (q, z) would exceed their budget.

        Work per call follows the rows G, not the records N: a record is read only when its row's ε
        passes the row's tightest budget, so a training step where every record is clear reads none.

        Args:
            delta: δ in (0, 1).
            n: the number of further steps (positive int).
        Returns:
            (k,) int64 record ids, ascending (empty when no record would exceed).
        Raises:
            ValueError without ``budgets``, for n not a positive integer or δ outside (0, 1).
        """
        if self.budgets is None:
            raise ValueError("would_exceed needs budgets (pass budgets= to IndividualAccountant)")
        n = check_positive_integer("n", n)
        delta = check_delta("delta", delta)
        per_step = self._current_step_rdp()   # a new object whenever rows or rates change
        target = self.steps_taken + n
        _, _, smallest = self._members()
        anchor = self.__dict__.get("_anchor")
        if (anchor is not None and anchor[0] is per_step and anchor[1] == delta
                and 0 <= target - anchor[2] <= _ANCHOR_REACH):
            # A row's ε after k more steps at the same (q, z) is at most its ε at the anchor plus k
            # times its one-step RDP at the order optimal there (ε is a minimum over orders of lines
            # in the step count), plus a margin for the rounding of the sums. A row whose bound is below
            # its tightest member's budget clears all its members; the others are evaluated exactly, as
            # the full evaluation would, and only the members of a row whose exact ε passes its tightest
            # budget are compared one by one: the answer is the same.
            _, _, at, eps0, slope, scale = anchor
            k = target - at
            with np.errstate(invalid="ignore"):
                bound = eps0 + k * slope + 16 * (k + 4) * _ROUNDOFF * (scale + k * slope)
            unclear = np.flatnonzero(~(bound < smallest))   # NaN (no finite order) is unclear
            if 4 * unclear.size <= smallest.shape[0]:
                exact = np.full(smallest.shape[0], np.nan)
                if unclear.size:
                    exact[unclear] = self._group_eps(delta, extra_steps=n, rows=unclear)[0]
                return self._over(exact, smallest)
        # every row exactly, and a new anchor here (the old one's lines have drifted above the budgets)
        eps, best = self._group_eps(delta, extra_steps=n)
        self._anchor = (per_step, delta, target, eps, *self._tangents(eps, best, n))
        return self._over(eps, smallest)

    def _over(self, eps: np.ndarray, smallest: np.ndarray) -> np.ndarray:
        """Ascending ids of the records with ε above their budget, given (G,) ε of the rows (NaN: none over)
        and their tightest budgets: only the members of rows whose ε passes their tightest budget are read."""
        members = self._members_of(np.flatnonzero(eps > smallest))
        return np.sort(members[eps[self.group_of[members]] > self.budgets[members]])

    def _tangents(self, eps, best, n):
        """((G,), (G,)) each row's one-step RDP at its optimal order ``best`` (inf where it has none)
        and the magnitude of the terms its ε sums (for the rounding margin)."""
        grid, own_step = self._current_step_rdp()
        rows, col = np.arange(best.shape[0]), np.clip(best, 0, self.orders.shape[0] - 1)
        own = best == self.orders.shape[0]
        slope = np.where(own, own_step, grid[rows, col])
        slope[best < 0] = np.inf
        with np.errstate(invalid="ignore"):
            rdp = np.where(own, self.group_own_rdp, self.group_rdp[rows, col]) + n * slope
            return slope, np.abs(rdp) + np.abs(eps - rdp)

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict:
        """The ledger's state as numpy values (what ``save`` writes to .npz).

        Returns:
            a dict of copies: "accountant", "format_version", "orders" (n_orders,), "group_of" (N,),
            "group_rates" / "group_noise" / "group_own_order" / "group_own_rdp" (G,), "group_rdp"
            (G, n_orders), "steps_taken", "budgets" ((N,), or (0,) with "has_budgets" False).
        """
        return {**self._record_state(), "orders": self.orders.copy(), "group_rdp": self.group_rdp.copy(),
                "group_own_order": self.group_own_order.copy(), "group_own_rdp": self.group_own_rdp.copy()}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state written by ``state_dict`` (states without an accountant name or own orders,
        written by earlier versions, are RDP ledgers without own orders).

        Args:
            state: a dict (or loaded .npz) as ``state_dict`` returns it.
        Returns:
            None; the ledger's state is replaced in place and its caches cleared.
        Raises:
            TypeError / ValueError for a state ``_checked_record_state`` refuses (not a dict, an entry
            missing, ...), or whose orders are not all > 1, whose group_rdp is not (groups, orders) of
            values ≥ 0 (inf allowed), or whose own orders (NaN: none, else finite and > 1) and their
            RDP (≥ 0) are not one per group; the ledger is then unchanged.
        """
        records = self._checked_record_state(state, ("orders", "group_rdp"))
        g = records["group_rates"].shape[0]
        orders = as_orders(state["orders"])[0]
        group_rdp = as_float_array("ledger state: group_rdp", state["group_rdp"])
        if group_rdp.shape != (g, orders.shape[0]):
            raise ValueError(f"ledger state: group_rdp has shape {group_rdp.shape}, expected (groups, orders) = "
                             f"({g}, {orders.shape[0]})")
        # states written before rows had their own order: none
        own_order = as_float_array("ledger state: group_own_order", state.get("group_own_order", np.full(g, np.nan)))
        own_rdp = as_float_array("ledger state: group_own_rdp", state.get("group_own_rdp", np.zeros(g)))
        if own_order.shape != (g,) or own_rdp.shape != (g,):
            raise ValueError("ledger state: group_own_order / group_own_rdp do not match group_rdp")
        if np.any(~np.isnan(own_order) & ~((own_order > 1.0) & np.isfinite(own_order))):
            raise ValueError("ledger state: group_own_order must be finite and > 1 (NaN for none)")
        if np.any(np.isnan(group_rdp) | (group_rdp < 0)) or np.any(np.isnan(own_rdp) | (own_rdp < 0)):
            raise ValueError("ledger state: accumulated RDP must be >= 0 (inf allowed), found a negative or NaN value")
        self.__dict__.pop("_pair_cache", None)
        self.__dict__.pop("_step_rdp", None)
        self.__dict__.update(records)
        self.orders, self.group_rdp = orders.copy(), group_rdp.copy()
        self.group_own_order, self.group_own_rdp = own_order.copy(), own_rdp.copy()



@register_ledger("pld")
class PLDIndividualAccountant(_RecordLedger):
    """PLD ledger of N records under whole-dataset Poisson-subsampled Gaussian steps.

    Records with equal (q_i, z_i) form one group; ε of a group after T steps is computed with
    Google's ``dp_accounting`` (see ``pld.pld_epsilon``) on demand and cached per (T, δ): about
    0.1 s per group at a new T, nothing per ``step``. For subsets of records or rates that change
    during training use the RDP ``IndividualAccountant``.

    Args:
        sample_rates: (N,) or scalar q_i in [0, 1].
        noise_multipliers: (N,) or scalar effective z_i = σC/c_i ≥ 0.
        budgets: optional (N,) ε_i, for ``would_exceed`` and ``remaining``.
        horizon: optional step count up to which every record is expected to stay within its budget
            (a plan's ``steps``): ``would_exceed`` checks it once per group instead of every step.
        value_discretization_interval: of the PLD, a finite number > 0 (default
            ``pld.VALUE_DISCRETIZATION``, as in calibration: the ledger then reproduces the plan's
            guaranteed ε exactly).
        max_pairs: most distinct (q, z) groups accepted, an int ≥ 1 (default ``pld.MAX_PAIRS``).

    Raises:
        TypeError for arguments that are not numbers (strings, bools); ValueError for a rate out of
        [0, 1], a noise multiplier that is not finite and ≥ 0 (a PLD of z = inf cannot be built),
        budgets, horizon, value_discretization_interval or max_pairs out of range, or more groups than
        ``max_pairs``.
    """

    name = "pld"

    def __init__(self, sample_rates, noise_multipliers, budgets=None, *, horizon=None,
                 value_discretization_interval=None, max_pairs=None):
        q, z = _per_record(sample_rates, noise_multipliers)
        if not np.all(np.isfinite(z)):
            raise ValueError("noise_multipliers must be finite for the PLD ledger (a PLD of z = inf cannot be built)")
        vdi = pld.VALUE_DISCRETIZATION if value_discretization_interval is None else value_discretization_interval
        vdi = pld.check_discretization(vdi)
        pairs, inverse = _pair_keys(q, z)
        max_pairs = pld.MAX_PAIRS if max_pairs is None else check_int("max_pairs", max_pairs, 1)
        if pairs.shape[0] > max_pairs:
            raise ValueError(f"the PLD ledger accounts at most {max_pairs} distinct (sample_rate, noise_multiplier) "
                             f"pairs, got {pairs.shape[0]}; use the RDP IndividualAccountant")
        self.group_of = inverse.astype(np.int64)                  # (N,) record → group
        self.group_rates = pairs[:, 0].copy()                     # (G,) q of each group
        self.group_noise = pairs[:, 1].copy()                     # (G,) z of each group
        self.budgets = _fixed_budgets(budgets, q.shape[0])
        self.horizon = None if horizon is None else check_positive_integer("horizon", horizon)
        self.value_discretization_interval = vdi
        self.steps_taken = 0
        self._reset_caches()

    @classmethod
    def for_plan(cls, plan, budgets) -> PLDIndividualAccountant:
        """The PLD ledger of a PLD plan's records, with the plan's ``steps`` as ``horizon``.

        Args:
            plan: a :class:`PrivacyPlan` (its per-record q_i and z_i = σC/c_i, and ``steps``).
            budgets: (N,) ε_i (or one scalar), or None.
        Returns:
            the :class:`PLDIndividualAccountant`, no step taken; it accepts as many (q, z) groups as
            the plan has distinct budgets (at least ``pld.MAX_PAIRS``).
        """
        # as many pairs as the plan made (``calibrate(pld_classes=...)``): each was certified there
        return cls(plan.sample_rates, plan.noise_multipliers, budgets=budgets, horizon=plan.steps,
                   max_pairs=max(pld.MAX_PAIRS, len(plan.budget_values)))

    def _reset_caches(self):
        self._certified = {}    # δ → (G,) int64: a step count up to which every member is within budget
        if self.budgets is None:
            self._group_budget = None
        else:                   # the tightest budget in each group decides whether all members are safe
            self._group_budget = self._members()[2]

    # ------------------------------------------------------------------ composition
    def step(self, n=1, *, sample_rates=None, noise_multipliers=None, record_ids=None):
        """Compose ``n`` steps of every record at its (q_i, z_i): a counter, no PLD work.

        Args:
            n: the number of steps (positive int).
            sample_rates, noise_multipliers, record_ids: must be None (the RDP ledger's options).
        Returns:
            self, updated in place.
        Raises:
            NotImplementedError if any of sample_rates, noise_multipliers or record_ids is given;
            ValueError for n not a positive integer.
        """
        if sample_rates is not None or noise_multipliers is not None or record_ids is not None:
            raise NotImplementedError("the PLD ledger composes whole-dataset steps at fixed (q_i, z_i); for subsets "
                                      "of records or changing rates use the RDP IndividualAccountant")
        self.steps_taken += check_positive_integer("n", n)
        return self

    # ------------------------------------------------------------------ queries
    def _epsilon(self, group: int, steps: int, delta: float) -> float:
        if steps == 0:
            return 0.0
        return pld.pld_epsilon(self.group_rates[group], self.group_noise[group], steps, delta,
                               self.value_discretization_interval)

    def epsilons(self, delta) -> np.ndarray:
        """ε_i(δ) spent so far by PLD (``pld.pld_epsilon``, cached per (q, z, steps, δ)).

        Args:
            delta: δ in (0, 1).
        Returns:
            (N,) float64 ε_i (0 before any step).
        Raises:
            ValueError (TypeError if not a number) for δ outside (0, 1).
        """
        delta = check_delta("delta", delta)
        eps = np.array([self._epsilon(g, self.steps_taken, delta) for g in range(self.group_rates.shape[0])])
        return eps[self.group_of] if eps.size else np.zeros(self.num_records)

    def exceeding(self, delta, n=1) -> np.ndarray:
        """The records whose ε after ``n`` more steps would exceed their budget.

        With a ``horizon`` this costs one PLD per group for the whole run: a group within its tightest
        budget at the horizon is certified for every step count up to it (remembered per δ). A step
        whose groups are all certified does O(G) work, none per record.

        Args:
            delta: δ in (0, 1).
            n: the number of further steps (positive int).
        Returns:
            (k,) int64 record ids, ascending (empty when no record would exceed).
        Raises:
            ValueError without ``budgets``, for n not a positive integer or δ outside (0, 1).
        """
        if self.budgets is None:
            raise ValueError("would_exceed needs budgets (pass budgets= to PLDIndividualAccountant)")
        delta = check_delta("delta", delta)
        steps = self.steps_taken + check_positive_integer("n", n)
        certified = self._certified.setdefault(delta, np.zeros(self.group_rates.shape[0], dtype=np.int64))
        over = []
        for g in np.flatnonzero(certified < steps):
            probes = [steps] if self.horizon is None or steps > self.horizon else [self.horizon, steps]
            for probe in probes:
                eps = self._epsilon(g, probe, delta)
                if eps <= self._group_budget[g]:
                    # true ε is monotone in the step count: every count ≤ probe is within budget
                    certified[g] = probe
                    break
            else:       # eps is ε at `steps`, over the tightest budget: judge each member by its own
                members = self._members_of(np.array([g]))
                over.append(members[eps > self.budgets[members]])
        return np.sort(np.concatenate(over)) if over else np.zeros(0, dtype=np.int64)

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict:
        """The ledger's state as numpy values (what ``save`` writes to .npz).

        Returns:
            a dict of copies: "accountant", "format_version", "group_of" (N,), "group_rates" /
            "group_noise" (G,), "steps_taken", "budgets" ((N,), or (0,) with "has_budgets" False),
            "horizon" (0: none), "value_discretization_interval".
        """
        return {**self._record_state(), "horizon": np.int64(0 if self.horizon is None else self.horizon),
                "value_discretization_interval": np.float64(self.value_discretization_interval)}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state written by ``state_dict``.

        Args:
            state: a dict (or loaded .npz) as ``state_dict`` returns it.
        Returns:
            None; the ledger's state is replaced in place and its caches cleared.
        Raises:
            TypeError / ValueError for a state ``_checked_record_state`` refuses (not a dict, an entry
            missing, steps_taken not a whole number, ...), a noise multiplier that is not finite, or whose
            horizon is not a whole number ≥ 0 or value_discretization_interval not finite and > 0; the
            ledger is then unchanged.
        """
        records = self._checked_record_state(state, ("horizon", "value_discretization_interval"))
        if not np.all(np.isfinite(records["group_noise"])):
            raise ValueError("ledger state: noise_multipliers must be finite for the PLD ledger")
        horizon = int(_whole("horizon", state["horizon"], 0))
        if horizon < 0:
            raise ValueError(f"ledger state: horizon must be >= 0 (0: none), got {horizon}")
        vdi = as_float_array("ledger state: value_discretization_interval", state["value_discretization_interval"])
        if vdi.ndim != 0 or not (float(vdi) > 0 and np.isfinite(vdi)):
            raise ValueError(f"ledger state: value_discretization_interval must be finite and > 0, got {vdi!r}")
        vdi = float(vdi)
        self.__dict__.update(records)
        self.horizon = horizon or None
        self.value_discretization_interval = vdi
        self._reset_caches()

