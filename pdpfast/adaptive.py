"""Adaptive DP-SGD with individual budgets: per-group quantile clipping and noise schedules.

Quantile clipping (Andrew, Thakkar, McMahan & Ramaswamy, "Differentially Private Learning with
Adaptive Clipping", NeurIPS 2021, Alg. 1). Every step each clip bound C moves geometrically
towards the γ-quantile of the gradient norms it clips:

    C ← C · exp(−η (b̄ − γ)),   b̄ = (Σ_{i ∈ batch} (b_i − ½) + N(0, σ_b²)) / E + ½,

with b_i = 1 if ‖g_i‖ ≤ C (record i was not clipped) and E the *expected* number of records the
count covers (Σ q_i over them: a constant, never the realized count). Centering the bits makes
the count's sensitivity ½ under adding or removing a record. Per layer (He et al., "Exploring the
limits of differentially private deep learning with group-wise clipping", ICLR 2023) every
clipping group k of ``clipping="per_layer"`` has its own bound and its own bit, so a record
contributes K bits and the counts' L2 sensitivity is ½√K.

Privacy of the pair (gradient sum, counts). Both are Gaussian queries on the same Poisson sample,
i.e. one subsampled Gaussian mechanism whose noise multiplier z satisfies

    z^-2 = z_grad^-2 + (s_count / σ_b)^2          (Andrew et al., Thm. 1; s_count = ½ gives
                                                   (z_grad^-2 + (2σ_b)^-2)^-1/2).

The plan's per-record effective multiplier z_i (calibrated from the budgets as usual, and what
the ledger charges) is the pair's: a share ``count_share`` f of the precision z^-2 goes to the
counts and the rest to the gradient, z_grad = z/√(1−f) and σ_b = s_count·z/√f (``split_noise``).

IDP. Under Scale every privacy group g has its own bound c_g and multiplier z_g = σC/c_g. Two
ways to adapt:

* ``per_group=False`` (default) — the bounds move together: one factor s (per layer: s_k) from
  one count over all groups, c_g(t) = s·c_g(0), so Scale's ratios and every z_g stay as planned
  and the noise std follows, σ·C·s. The count's noise must satisfy the group with the largest
  z_g (each group's pair is then at least its planned z_g).
* ``per_group=True`` — each group tracks the quantile of its own members' norms with its own
  count (a record is in one group, so the group counts together still have sensitivity ½√K, and
  group g's count noise is s_count·z_g/√f). The groups' ratios drift, so the noise std is set to
  max_g z_g·c_g(t)/√(1−f): every group keeps at least its planned z_g, the group that drifted
  up sets the noise for all, and the others get more privacy than they pay for.

Either way each step's multiplier for record i is at least the planned z_i·h(t), a bound fixed
before training, so the ledger charges exactly the plan (adaptive composition of steps each
within a fixed RDP bound) and ``PrivacyBudgetExceeded`` guards every step as before.

Noise schedules (``pdpfast.accounting.schedules``): step t uses σ₀·h(t); before every step the
ledger's multipliers are set to z_i·h(t), so the refusal check and the charge use that step's σ.
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ._checks import as_float_array, check_int, check_positive

__all__ = ["QuantileClipping", "GeometricQuantileTracker", "split_noise", "pair_noise_multiplier",
           "AdaptiveTraining"]


def _number(name: str, value, low: float, high: float, *, low_open=False, high_open=False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    v = float(value)
    below = v <= low if low_open else v < low
    above = v >= high if high_open else v > high
    if not math.isfinite(v) or below or above:
        raise ValueError(f"{name} must lie in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}, "
                         f"got {value!r}")
    return v


def _nonnegative_array(name: str, values) -> np.ndarray:
    v = as_float_array(name, values)   # not bools, nor strings numpy would read
    if not np.all(np.isfinite(v)) or np.any(v < 0):
        raise ValueError(f"{name} must be finite and ≥ 0, got {values!r}")
    return v


@dataclass(frozen=True)
class QuantileClipping:
    """Settings of per-group quantile clipping.

    Args:
        target_quantile: γ in (0, 1), the fraction of each group's members that should be unclipped
            (Andrew et al.'s default 0.5: the median norm).
        learning_rate: η > 0 of the geometric update, at most 1e3 (default 0.2, Andrew et al.'s).
        count_share: f in (0, 1), the share of each step's privacy (of z^-2) spent on the counts
            (default 0.01: the gradient noise grows by 1/√(1 − f) ≈ 0.5%).
        per_group: False: the groups' bounds move together (Scale's ratios kept); True: each group
            adapts on its own.
    Raises:
        TypeError for a value that is not a number (``per_group``: not a bool); ValueError for a number
        out of range.
    """

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_share: float = 0.01
    per_group: bool = False

    def __post_init__(self):
        _number("target_quantile", self.target_quantile, 0.0, 1.0, low_open=True, high_open=True)
        _number("learning_rate", self.learning_rate, 0.0, 1e3, low_open=True)
        _number("count_share", self.count_share, 0.0, 1.0, low_open=True, high_open=True)
        if not isinstance(self.per_group, bool):
            raise TypeError(f"per_group must be a bool, got {type(self.per_group).__name__}")


def split_noise(noise_multiplier, count_share: float, count_sensitivity: float = 0.5):
    """Split a noise multiplier between the gradient and the count of unclipped records.

    Args:
        noise_multiplier: z, the pair's effective multiplier (a float or an array of any shape).
        count_share: f in (0, 1), the share of the precision z^-2 spent on the count.
        count_sensitivity: s, the count's L2 sensitivity (½ for one centered bit per record).
    Returns:
        (z_grad, σ_count), float64 arrays of z's shape (0-d for a float): z_grad = z/√(1−f),
        σ_count = s·z/√f.
    Raises:
        TypeError when ``count_share`` or ``count_sensitivity`` is not a number; ValueError when f is
        outside (0, 1), s is not a finite number > 0 (a count of sensitivity 0 would be released
        unnoised), or a z is negative or not finite.
    """
    f = _number("count_share", count_share, 0.0, 1.0, low_open=True, high_open=True)
    count_sensitivity = check_positive("count_sensitivity", count_sensitivity)
    z = _nonnegative_array("noise_multiplier", noise_multiplier)
    return z / math.sqrt(1.0 - f), count_sensitivity * z / math.sqrt(f)


def pair_noise_multiplier(grad_noise_multiplier, count_std, count_sensitivity: float = 0.5):
    """Effective noise multiplier of a Gaussian gradient query released with a Gaussian count on
    the same sample (Andrew et al., Thm. 1).

    Args:
        grad_noise_multiplier: z_grad, the gradient query's noise multiplier (a float or an array).
        count_std: σ_count, the count's noise std (a float or an array).
        count_sensitivity: s, the count's L2 sensitivity (½ for one centered bit per record).
    Returns:
        z = (z_grad^-2 + (s/σ_count)^2)^-1/2, float64, broadcast over the arrays.
    Raises:
        ValueError for a negative or non-finite z_grad or σ_count, or s not a finite number > 0.
    """
    count_sensitivity = check_positive("count_sensitivity", count_sensitivity)
    zg = _nonnegative_array("grad_noise_multiplier", grad_noise_multiplier)
    sc = _nonnegative_array("count_std", count_std)
    return 1.0 / np.sqrt(zg ** -2.0 + (count_sensitivity / sc) ** 2)


# bounds a float32 gradient can be clipped to: its norms and squared norms neither under- nor overflow
_BOUND_RANGE = (1e-30, 1e30)


class GeometricQuantileTracker:
    """Clip bounds that follow a target quantile: C ← C·exp(−η(b̄ − γ)) (Andrew et al., Alg. 1).

    Args:
        bounds: initial bounds > 0 (finite), any shape S (e.g. (G, K) groups × layers), kept as a
            float64 copy in ``self.bounds``.
        target_quantile: γ in (0, 1).
        learning_rate: η in (0, 1e3].
    Raises:
        ValueError for bounds that are empty or not finite and > 0, or γ / η out of range; TypeError for
        bounds, γ or η that are not numbers.
    """

    def __init__(self, bounds, target_quantile: float, learning_rate: float):
        self.bounds = np.array(as_float_array("bounds", bounds))  # a copy; not strings numpy would read
        if self.bounds.size == 0:
            raise ValueError("bounds is empty: there is no clip bound to track")
        if np.any(~np.isfinite(self.bounds)) or np.any(self.bounds <= 0):
            raise ValueError("bounds must be finite and > 0")
        self.target_quantile = _number("target_quantile", target_quantile, 0.0, 1.0, low_open=True, high_open=True)
        self.learning_rate = _number("learning_rate", learning_rate, 0.0, 1e3, low_open=True)

    def unclipped_fraction(self, noisy_centered_count, expected_count) -> np.ndarray:
        """b̄ = count / E + ½, the noised fraction of unclipped records.

        Args:
            noisy_centered_count: Σ(b_i − ½) + noise, shape S (or broadcastable to it).
            expected_count: E, the expected number of records behind each count (a constant), shape S.
        Returns:
            float64 array of the broadcast shape; may leave [0, 1] (it is noised).
        Raises:
            ValueError for an E that is not finite and > 0 (the fraction, and the bounds, would be NaN or
            0 or ∞).
        """
        expected = np.asarray(expected_count, dtype=np.float64)
        if not np.all(np.isfinite(expected)) or np.any(expected <= 0):
            raise ValueError(f"expected_count must be finite and > 0, got {expected_count!r}")
        return np.asarray(noisy_centered_count, dtype=np.float64) / expected + 0.5

    def update(self, noisy_centered_count, expected_count) -> np.ndarray:
        """One geometric step of every bound: C ← C·exp(−η(b̄ − γ)), b̄ from ``unclipped_fraction``.

        Args:
            noisy_centered_count: Σ(b_i − ½) + noise per bound, shape S.
            expected_count: E per bound, shape S.
        Returns:
            the new bounds, float64 of shape S (also stored in ``self.bounds``).
        Raises:
            ValueError for counts that do not broadcast to the bounds' shape, a count that is NaN or infinite
            (the bound would become NaN, 0 or ∞), or a step that would take a bound outside [1e-30, 1e30]
            (float32 norms and bounds under- or overflow there; a learning rate too large for the counts'
            noise does it); the bounds are left as they were.
        """
        b = self.unclipped_fraction(noisy_centered_count, expected_count)
        # a few numbers per step (groups × layers): checking them costs nothing next to the step
        try:
            fits = np.broadcast_shapes(b.shape, self.bounds.shape) == self.bounds.shape
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(f"noisy_centered_count must have the bounds' shape {self.bounds.shape} (one count per "
                             f"bound), got {b.shape}")
        if not np.isfinite(b).all():
            raise ValueError(f"noisy_centered_count must be finite, got {noisy_centered_count!r}")
        bounds = self.bounds * np.exp(-self.learning_rate * (b - self.target_quantile))
        if not ((bounds >= _BOUND_RANGE[0]) & (bounds <= _BOUND_RANGE[1])).all():   # NaN fails too
            raise ValueError(
                f"the clip bounds would leave [{_BOUND_RANGE[0]:g}, {_BOUND_RANGE[1]:g}] (from {self.bounds.min():.3g}–"
                f"{self.bounds.max():.3g} to {bounds.min():.3g}–{bounds.max():.3g}) at learning_rate "
                f"{self.learning_rate:g}: the noised fraction of unclipped records was {b.min():.3g}–{b.max():.3g}; "
                "use a smaller learning_rate (Andrew et al.'s is 0.2)")
        self.bounds = bounds
        return self.bounds


class AdaptiveHistory(Sequence):
    """Every step's clip bounds and noise of an ``AdaptiveTraining`` run: ``history[t]`` is a dict "step",
    "clip_norms" ((G,) float64, the groups' total clip bounds), "noise_std" (of the gradient sum) and,
    with adaptive clipping, "count_std" (the counts' noise stds: (G,) per group, else (1,)).

    Kept as what sets the bounds, not as G numbers per step: nothing with fixed bounds (a noise
    schedule alone), the K shared factors of ``per_group=False``, the (G, K) bounds of ``per_group=True``
    (which are G numbers a step by nature). A run over many privacy groups (distinct per-record
    budgets: G up to the number of records) then keeps a few numbers per step, where a list of G
    floats per step grew by gigabytes over a long run; the dicts are built when read.

    Args:
        initial_bounds: (G, K) the plan's bounds per group and clipping group.
    """

    def __init__(self, initial_bounds: np.ndarray):
        self._initial = initial_bounds
        self._steps: list[int] = []
        self._noise: list[float] = []
        self._bounds: list[np.ndarray | None] = []   # None: the initial bounds; (K,) factors; (G, K) bounds
        self._count: list[np.ndarray | None] = []

    def append(self, step: int, noise_std: float, bounds, count_std) -> None:
        """Record one step.

        Args:
            step: the step's index; noise_std: the gradient sum's noise std.
            bounds: its bounds as ``AdaptiveTraining`` holds them: None (the plan's), (K,) shared factors or
                (G, K) per-group bounds; kept by reference, so never written in place afterwards.
            count_std: its counts' noise stds, or None without adaptive clipping.
        Returns:
            None.
        """
        self._steps.append(int(step))
        self._noise.append(float(noise_std))
        self._bounds.append(bounds)
        self._count.append(count_std)

    def __len__(self) -> int:
        return len(self._steps)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = range(len(self))[index]  # negative indices, and IndexError past the end
        bounds = self._bounds[index]
        if bounds is None:
            bounds = self._initial
        elif bounds.ndim == 1:
            bounds = self._initial * bounds[None, :]
        record = {"step": self._steps[index], "clip_norms": np.sqrt(np.sum(bounds ** 2, axis=1)),
                  "noise_std": self._noise[index]}
        if self._count[index] is not None:
            record["count_std"] = self._count[index]
        return record

    def __repr__(self) -> str:
        return f"AdaptiveHistory({len(self)} steps)"

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the history (as held: a few numbers per step).

        Returns:
            a dict: "steps" (int64), "noise_std" (float64), "bounds" and "count_std" (lists, one entry
            per step, as ``append`` took them).
        """
        return {"steps": np.asarray(self._steps, dtype=np.int64),
                "noise_std": np.asarray(self._noise, dtype=np.float64),
                "bounds": list(self._bounds), "count_std": list(self._count)}

    @staticmethod
    def check_state(state: dict) -> tuple:
        """Check a saved history (``state_dict``), changing nothing.

        Args:
            state: as ``state_dict`` returns it.
        Returns:
            (steps, noise_std, bounds, count_std) as lists.
        Raises:
            ValueError when its four entries do not hold one value per step.
        """
        steps, noise = np.asarray(state["steps"], dtype=np.int64), np.asarray(state["noise_std"], dtype=np.float64)
        bounds, count = list(state["bounds"]), list(state["count_std"])
        if steps.ndim != 1 or noise.ndim != 1 or not (len(steps) == len(noise) == len(bounds) == len(count)):
            raise ValueError("adaptive history: steps, noise_std, bounds and count_std must hold one entry per step, "
                             f"got {steps.size}, {noise.size}, {len(bounds)} and {len(count)}")
        return steps.tolist(), noise.tolist(), bounds, count

    def load_state_dict(self, state: dict) -> None:
        """Replace the history by a saved one (``state_dict``).

        Args:
            state: as ``state_dict`` returns it.
        Returns:
            None.
        Raises:
            ValueError as ``check_state`` (nothing changed).
        """
        self._steps, self._noise, self._bounds, self._count = self.check_state(state)


class AdaptiveTraining:
    """Attached by ``PrivacyEngine.make_private_with_budgets(adaptive_clipping=..., noise_schedule=...)``:
    sets each step's clip bounds, noise and ledger multipliers. ``history`` (an ``AdaptiveHistory``) gives,
    per step, a dict: "step", "clip_norms" (the groups' total clip bounds, G floats), "noise_std" (of
    the gradient sum) and, with adaptive clipping, "count_std" (the counts' noise stds).

    Args:
        engine: the PrivacyEngine (after ``make_private``).
        plan: its PrivacyPlan (a ScheduledPlan for a schedule) over G privacy groups.
        clipping: QuantileClipping, or None for fixed bounds.
        factors: (T,) noise factors h(t), or None (constant noise); steps past T use h(T − 1).
        seed: the seed of the counts' noise (an int); None draws one from ``os.urandom``.
    Raises:
        TypeError when ``clipping`` is neither a QuantileClipping nor None; ValueError for factors that
        are not a non-empty (T,) array of finite numbers > 0, or a seed that is not an int ≥ 0.
    """

    def __init__(self, engine, plan, *, clipping: QuantileClipping | None = None, factors=None, seed=None):
        if clipping is not None and not isinstance(clipping, QuantileClipping):
            raise TypeError(f"adaptive_clipping must be a QuantileClipping, got {type(clipping).__name__}")
        if factors is not None:
            f = as_float_array("factors", factors)
            if f.ndim != 1 or f.size == 0 or not np.all(np.isfinite(f)) or np.any(f <= 0):
                raise ValueError(f"factors must be a non-empty (T,) array of finite numbers > 0, got {factors!r}")
        if seed is not None:
            check_int("seed", seed, 0)
        state = engine.state
        self.engine, self.plan, self.clipping = engine, plan, clipping
        self.factors = None if factors is None else np.asarray(factors, dtype=np.float64)
        self.group_of = np.asarray(plan.group_index, dtype=np.int64)
        self._group_of_t = torch.from_numpy(self.group_of)
        self.num_groups = int(plan.budget_values.shape[0])
        self.per_layer = state.clipping == "per_layer"
        shares = state.shares.numpy() if self.per_layer else np.ones(1)
        self.num_layers = int(shares.shape[0])
        self.initial_bounds = plan.group_clip_norms[:, None] * shares[None, :]           # (G, K)
        self.base_noise = plan.group_noise_multipliers                                 # (G,) z_g at h = 1
        self.expected = np.bincount(self.group_of, weights=plan.sample_rates, minlength=self.num_groups)
        self.count_sensitivity = 0.5 * math.sqrt(self.num_layers)
        self._counts = np.zeros((self.num_groups, self.num_layers))
        self._rows: torch.Tensor | None = None
        self.history = AdaptiveHistory(self.initial_bounds)
        self.seed = int.from_bytes(os.urandom(7), "little") if seed is None else int(seed)
        if clipping is not None:
            start = self.initial_bounds if clipping.per_group else np.ones(self.num_layers)
            self.tracker = GeometricQuantileTracker(start, clipping.target_quantile, clipping.learning_rate)
        self._bounds_tensor = torch.from_numpy(self.initial_bounds.copy())

    # ------------------------------------------------------------------ wiring
    def attach(self) -> AdaptiveTraining:
        """Hook into the engine: with adaptive clipping, the batches' clip bounds and the counts after
        each backward; always, each step's noise (pre-step) and the bounds' update and history
        (post-step); the ledger's multipliers are set for the next step.

        Returns:
            self.
        """
        engine = self.engine
        if self.clipping is not None:
            engine.batch_clip_norms = self.batch_clip_norms
            engine.state.keep_group_norms = self.per_layer
            engine.state.post_backward_hooks.append(self._count)
            # a refused step closes its draw unreleased, and zero_grad() discards one: its counts go with it
            # (added to the next draw's, a record in both would count twice in one release)
            engine.optimizer.refused_step_hooks.append(self._drop_counts)
            engine.optimizer.post_zero_grad_hooks.append(self._drop_counts)
        engine.optimizer.pre_step_hooks.append(self._set_step_noise)
        engine.optimizer.post_step_hooks.append(self._after_step)
        self._set_ledger(engine.optimizer.steps)
        return self

    # ------------------------------------------------------------------ bounds
    @property
    def bounds(self) -> np.ndarray:
        """(G, K) current clip bound of every group (and clipping group k; K = 1 for flat)."""
        if self.clipping is None:
            return self.initial_bounds
        if self.clipping.per_group:
            return self.tracker.bounds
        return self.initial_bounds * self.tracker.bounds[None, :]

    @property
    def group_clip_norms(self) -> np.ndarray:
        """(G,) each group's total sensitivity sqrt(Σ_k c_{g,k}²) now."""
        return np.sqrt(np.sum(self.bounds ** 2, axis=1))

    def batch_clip_norms(self, indices: torch.Tensor) -> torch.Tensor:
        """The current clip bounds of a batch's records (set as the engine's ``batch_clip_norms``,
        through which every batch opens: the loader's and those of ``records()``). The records' groups
        are kept for the counts of the batch's backward.

        Args:
            indices: (B,) int64 dataset indices of the batch's records.
        Returns:
            float64 bounds: (B,) for flat clipping, (K, B) for per-layer clipping (row k clipping group k).
        """
        self._rows = self._group_of_t[indices]
        rows = self._bounds_tensor[self._rows]                        # (B, K)
        return rows[:, 0].contiguous() if not self.per_layer else rows.t().contiguous()

    def _count(self, state) -> None:
        """After each physical batch's backward: Σ (b_i − ½) over its members, per group (and layer)."""
        if self._rows is None:
            return
        norms = state.last_group_norms if self.per_layer else state.last_norms[None, :]
        bounds = state.clip_norms if self.per_layer else state.clip_norms[None, :]
        bits = (norms.detach().double().cpu() <= bounds.double().cpu()).double() - 0.5     # (K, B)
        if state.mask is not None:
            bits = bits * state.mask.double().cpu()[None, :]
        counts = torch.zeros(self.num_groups, self.num_layers, dtype=torch.float64)
        counts.index_add_(0, self._rows, bits.t())
        self._counts += counts.numpy()

    def _drop_counts(self, optimizer=None) -> None:
        self._counts[:] = 0.0

    # ------------------------------------------------------------------ steps
    def _factor(self, step: int) -> float:
        if self.factors is None:
            return 1.0
        return float(self.factors[min(step, self.factors.shape[0] - 1)])

    def _set_ledger(self, step: int) -> None:
        ledger = getattr(self.engine, "accountant", None)
        if self.factors is None or ledger is None:
            return
        rows = self._plan_noise_of_rows(ledger)
        if rows is None:
            ledger.set_rates(noise_multipliers=self.plan.noise_multipliers * self._factor(step))
        else:   # the same values, one per row: no pass over the N records every step
            ledger.set_group_noise(rows * self._factor(step))

    def _plan_noise_of_rows(self, ledger) -> np.ndarray | None:
        """(G,) the plan's z_i of each ledger row's records, when every row's records share one (the rows of a
        plan's ledger do); None otherwise. Found once per set of rows."""
        kept = self.__dict__.get("_row_noise")
        if kept is not None and kept[0] is ledger.group_of:
            return kept[1]
        rows = None
        if hasattr(ledger, "set_group_noise"):
            ids, starts = ledger.group_members()
            counts = np.diff(starts)
            z = self.plan.noise_multipliers[ids]
            if counts.all() and np.array_equal(z, np.repeat(z[starts[:-1]], counts)):
                rows = z[starts[:-1]]
        self._row_noise = (ledger.group_of, rows)
        return rows

    def _grad_inflation(self) -> float:
        return 1.0 if self.clipping is None else 1.0 / math.sqrt(1.0 - self.clipping.count_share)

    def _set_step_noise(self, optimizer) -> None:
        """Before the noise of step t: σ_t/√(1−f) and the reference bound at which every group's
        gradient multiplier is at least z_g·h(t)/√(1−f)."""
        t = optimizer.steps
        ratio = self.group_clip_norms / self.plan.group_clip_norms
        optimizer._set_step_noise(self.plan.noise_multiplier * self._factor(t) * self._grad_inflation(),
                                  self.plan.max_grad_norm * float(ratio.max()))

    def _after_step(self, optimizer) -> None:
        t = optimizer.steps - 1                                   # the step just taken
        # the bounds the step used (the tracker replaces its array at each update, never writes into it)
        bounds = None if self.clipping is None else self.tracker.bounds
        count_std = None if self.clipping is None else self._count_std(t)
        try:
            if count_std is not None:
                self._update_bounds(t, count_std)
        finally:
            # the step is released and charged even where the update refused its bounds (the tracker's
            # ValueError, which leaves them as they were): its counts go, and the history and the
            # ledger's multipliers move on, so that a run the caller continues stays consistent
            self._drop_counts()
            self.history.append(t, optimizer.noise_std, bounds, count_std)
            self._set_ledger(optimizer.steps)

    def _count_std(self, t: int) -> np.ndarray:
        """The noise stds of step t's counts: (G,) per group, else (1,)."""
        z_t = self.base_noise * self._factor(t)                                        # (G,)
        if self.clipping.per_group:
            return split_noise(z_t, self.clipping.count_share, self.count_sensitivity)[1]
        return np.atleast_1d(split_noise(float(z_t.max()), self.clipping.count_share, self.count_sensitivity)[1])

    def _update_bounds(self, t: int, count_std: np.ndarray) -> None:
        rng = np.random.default_rng([self.seed, t])
        if self.clipping.per_group:
            noisy = self._counts + rng.normal(size=self._counts.shape) * count_std[:, None]
            self.tracker.update(noisy, np.broadcast_to(self.expected[:, None], noisy.shape))
        else:
            noisy = self._counts.sum(0) + rng.normal(size=self.num_layers) * count_std
            self.tracker.update(noisy, np.full(self.num_layers, self.expected.sum()))
        self._bounds_tensor = torch.from_numpy(self.bounds.copy())

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict:
        """The state a checkpoint needs to resume the adaptation.

        Returns:
            a dict: "bounds" (the tracker's float64 bounds, a copy; None without adaptive clipping),
            "seed" (int) and "history" (``AdaptiveHistory.state_dict``: a resumed run's ``history[t]``
            is still step t's).
        """
        return {"bounds": None if self.clipping is None else self.tracker.bounds.copy(), "seed": self.seed,
                "history": self.history.state_dict()}

    def check_state(self, state: dict) -> np.ndarray | None:
        """Check what ``load_state_dict`` would restore, changing nothing (the engine checks a whole
        checkpoint before it restores any of it).

        Args:
            state: a dict with "seed" and "bounds", as ``state_dict()`` returns it.
        Returns:
            the bounds to restore (float64, the tracker's shape), or None where there are none
            (no adaptive clipping, or none saved).
        Raises:
            ValueError for bounds not of the tracker's shape or not all finite and > 0, or a history
            (``AdaptiveHistory.check_state``) not of one entry per step.
        """
        int(state["seed"])  # a missing or non-integer seed fails here, before anything changes
        if state.get("history") is not None:
            AdaptiveHistory.check_state(state["history"])
        if self.clipping is None or state.get("bounds") is None:
            return None
        bounds = np.array(state["bounds"], dtype=np.float64)
        if bounds.shape != self.tracker.bounds.shape or not (np.isfinite(bounds).all() and (bounds > 0).all()):
            raise ValueError(f"adaptive clipping state: bounds must be {self.tracker.bounds.shape} finite values "
                             f"> 0, got shape {bounds.shape}")
        return bounds

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict()`` returned and reset the ledger's multipliers for the engine's step.

        Args:
            state: a dict with "seed" and "bounds" (bounds ignored when None or without adaptive clipping),
                and "history" (absent from checkpoints of before it was kept: then the history starts
                at the resumed step).
        Returns:
            None.
        Raises:
            ValueError as ``check_state`` (nothing changed).
        """
        bounds = self.check_state(state)
        seed = state["seed"]
        seed = check_int("seed", seed.item() if isinstance(seed, np.ndarray) and seed.ndim == 0 else seed, 0)
        if state.get("history") is not None:
            self.history.load_state_dict(state["history"])
        if bounds is not None:
            self.tracker.bounds = bounds
            self._bounds_tensor = torch.from_numpy(self.bounds.copy())
        self.seed = seed
        self._set_ledger(self.engine.optimizer.steps)
