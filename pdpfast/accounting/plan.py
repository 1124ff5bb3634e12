"""The output of calibration: a plan of per-record sampling rates and clip norms under one σ."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from .._checks import check_int

__all__ = ["GroupSummary", "PrivacyPlan"]

_FORMAT_VERSION = 1


@dataclass(frozen=True)
class GroupSummary:
    """All records sharing one budget.

    Attributes:
        epsilon: the budget ε.
        size: number of records (int).
        sample_rate: their Poisson rate q in (0, 1].
        clip_norm: their clip bound c > 0.
        noise_multiplier: their effective z = σ·C/c (noise std / their clip norm).
        guaranteed_epsilon: exact accounting of (q, z, steps) at the plan's δ by the plan's accountant
            (≤ epsilon; the other accountant may give more, e.g. RDP of a PLD plan).
    """

    epsilon: float
    size: int
    sample_rate: float
    clip_norm: float
    noise_multiplier: float
    guaranteed_epsilon: float


@dataclass(eq=False)
class PrivacyPlan:
    """Per-record sampling rates and clip norms under a shared noise multiplier.

    Stored per distinct budget ("group") with a per-record ``group_index``; ``sample_rates`` and
    ``clip_norms`` are the expanded (N,) float64 arrays. Training adds noise N(0, σ²C²) with
    σ = ``noise_multiplier`` and C = ``max_grad_norm`` to the clipped sum and divides by
    ``expected_batch_size`` = Σ_i q_i; record i is then accounted at (q_i, σC/c_i, steps).

    Attributes:
        method: the calibration method ("sample", "scale", "hybrid", or a registered name).
        accountant: "rdp" or "pld", the accountant the plan was calibrated and is audited with.
        noise_multiplier: σ, noise std / C (float).
        max_grad_norm: C, the reference clip norm > 0 (float).
        steps: T, the number of steps (int).
        delta: δ in (0, 1).
        budget_values: (G,) float64 distinct budgets ε_g, ascending.
        group_index: (N,) int64 index of each record's group.
        group_sizes: (G,) int64 records per group.
        group_sample_rates: (G,) float64 Poisson rates q_g in (0, 1].
        group_clip_norms: (G,) float64 clip norms c_g > 0.
        group_epsilons: (G,) float64 guaranteed ε_g ≤ budget_values.
        orders: the RDP orders of the calibration (tuple of floats; empty when unknown).
        group_orders: (G,) float64 RDP order certifying each group's ε (fractional), or None (PLD).
        sample_rates: (N,) float64 q_i, expanded from the groups (not an init argument).
        clip_norms: (N,) float64 c_i, expanded from the groups (not an init argument).
    """

    method: str
    accountant: str
    noise_multiplier: float
    max_grad_norm: float
    steps: int
    delta: float
    budget_values: np.ndarray        # (G,) distinct budgets, ascending
    group_index: np.ndarray          # (N,) index into the group arrays
    group_sizes: np.ndarray          # (G,)
    group_sample_rates: np.ndarray   # (G,)
    group_clip_norms: np.ndarray     # (G,)
    group_epsilons: np.ndarray       # (G,) guaranteed ε
    orders: tuple = ()
    group_orders: np.ndarray | None = None    # (G,) RDP order certifying each group's ε (None: PLD)
    sample_rates: np.ndarray = field(init=False, repr=False)
    clip_norms: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        self.group_index = np.asarray(self.group_index, dtype=np.int64)
        for name in ("budget_values", "group_sample_rates", "group_clip_norms", "group_epsilons"):
            setattr(self, name, np.asarray(getattr(self, name), dtype=np.float64))
        self.group_sizes = np.asarray(self.group_sizes, dtype=np.int64)
        if self.group_orders is not None:
            self.group_orders = np.asarray(self.group_orders, dtype=np.float64)
        self._check()
        self.sample_rates = self.group_sample_rates[self.group_index]
        self.clip_norms = self.group_clip_norms[self.group_index]

    def _check(self) -> None:
        """Refuse a plan that cannot be what calibration made, before anything trains on it or audits
        with it: a plan read from a file (``from_dict``, ``from_json``, a checkpoint) is checked as
        one built in memory.

        Raises:
            ValueError naming the field: σ not finite and ≥ 0; C not finite and > 0; steps < 1; δ
            outside (0, 1); group arrays not all (G,); budgets not finite and > 0; a rate outside
            [0, 1]; a clip norm not finite and > 0; a guaranteed ε not finite, < 0 or above its
            budget; a group_index outside [0, G) or group sizes that do not count it; an RDP order
            (``orders``, ``group_orders``) not > 1.
        """
        if not (np.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise ValueError(f"plan: noise_multiplier must be finite and >= 0, got {self.noise_multiplier!r}")
        if not (np.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ValueError(f"plan: max_grad_norm must be finite and > 0, got {self.max_grad_norm!r}")
        if self.steps < 1:
            raise ValueError(f"plan: steps must be >= 1, got {self.steps}")
        if not 0 < self.delta < 1:
            raise ValueError(f"plan: delta must lie in (0, 1), got {self.delta!r}")
        g = self.budget_values.shape
        for name in ("budget_values", "group_sizes", "group_sample_rates", "group_clip_norms", "group_epsilons"):
            if getattr(self, name).shape != g or len(g) != 1:
                raise ValueError(f"plan: {name} must have one value per group ({g[0] if g else '?'} groups), got shape "
                                 f"{getattr(self, name).shape}")
        budgets, eps = self.budget_values, self.group_epsilons
        if not (np.isfinite(budgets).all() and (budgets > 0).all()):
            raise ValueError("plan: budgets (groups' epsilon) must be finite and > 0")
        q = self.group_sample_rates
        if not (np.isfinite(q).all() and ((q >= 0) & (q <= 1)).all()):
            raise ValueError("plan: sample rates must lie in [0, 1]")
        c = self.group_clip_norms
        if not (np.isfinite(c).all() and (c > 0).all()):
            raise ValueError("plan: clip norms must be finite and > 0")
        if not (np.isfinite(eps).all() and (eps >= 0).all() and (eps <= budgets).all()):
            raise ValueError("plan: every group's guaranteed epsilon must be finite, >= 0 and within its budget")
        index = self.group_index
        if index.ndim != 1 or (index.size and (index.min() < 0 or index.max() >= g[0])):
            raise ValueError("plan: group_index out of range")
        if not np.array_equal(np.bincount(index, minlength=g[0]), self.group_sizes):
            raise ValueError("plan: group sizes do not match group_index")
        if any(not o > 1 for o in self.orders):
            raise ValueError(f"plan: RDP orders must all be > 1, got {self.orders}")
        if self.group_orders is not None and (self.group_orders.shape != g or not (self.group_orders > 1).all()):
            raise ValueError("plan: group_orders must be one RDP order > 1 per group")

    @classmethod
    def from_groups(cls, *, method, accountant, noise_multiplier, max_grad_norm, steps, delta, budget_values,
                    group_index, counts, group_sample_rates, group_clip_norms, group_epsilons, orders=(),
                    group_orders=None):
        """Build a plan from per-group arrays (what calibration computes).

        Args:
            method, accountant, orders, group_orders: as the attributes of the same names.
            noise_multiplier: σ (noise std / C), converted to float.
            max_grad_norm: C > 0, converted to float.
            steps: T, converted to int.
            delta: δ in (0, 1), converted to float.
            budget_values: (G,) distinct budgets ε_g, ascending.
            group_index: (N,) index of each record's group.
            counts: (G,) records per group (the plan's ``group_sizes``).
            group_sample_rates: (G,) Poisson rates q_g in (0, 1].
            group_clip_norms: (G,) clip norms c_g > 0.
            group_epsilons: (G,) guaranteed ε_g.
        Returns:
            the plan (an instance of ``cls``).
        """
        return cls(method=method, accountant=accountant, noise_multiplier=float(noise_multiplier),
                   max_grad_norm=float(max_grad_norm), steps=int(steps), delta=float(delta),
                   budget_values=budget_values, group_index=group_index, group_sizes=counts,
                   group_sample_rates=group_sample_rates, group_clip_norms=group_clip_norms,
                   group_epsilons=group_epsilons, orders=tuple(orders), group_orders=group_orders)

    # ------------------------------------------------------------------ per-record views
    @property
    def num_records(self) -> int:
        """N, the number of records."""
        return int(self.group_index.shape[0])

    @property
    def budgets(self) -> np.ndarray:
        """(N,) the budgets the plan was calibrated for."""
        return self.budget_values[self.group_index]

    @property
    def expected_batch_size(self) -> float:
        """Σ_i q_i: the constant normalizer of the noisy gradient (never the realized batch size)."""
        return float(np.dot(self.group_sizes, self.group_sample_rates))

    @property
    def group_noise_multipliers(self) -> np.ndarray:
        """(G,) effective noise multiplier σ·C/c of each group."""
        return self.noise_multiplier * self.max_grad_norm / self.group_clip_norms

    @property
    def noise_multipliers(self) -> np.ndarray:
        """(N,) effective noise multiplier σ·C/c_i of each record."""
        return self.group_noise_multipliers[self.group_index]

    def epsilons(self) -> np.ndarray:
        """Guaranteed ε of each record under the plan, by ``self.accountant`` ("rdp" or "pld").

        Audit spending with the same accountant: ``ledger_for_plan(plan)``.

        Returns:
            (N,) float64 ε_i, each ≤ its budget.
        """
        return self.group_epsilons[self.group_index]

    @property
    def at_order_edge(self) -> np.ndarray:
        """(G,) bool: groups whose certifying RDP order is the first or last of ``orders`` (a valid
        but possibly loose bound: widen the orders to tighten it)."""
        if self.group_orders is None or not self.orders:
            return np.zeros(len(self.budget_values), dtype=bool)
        return (self.group_orders == self.orders[0]) | (self.group_orders == self.orders[-1])

    @cached_property
    def groups(self) -> list:
        """One :class:`GroupSummary` per distinct budget, ascending (computed once, then cached).

        Returns:
            a list of G :class:`GroupSummary`.
        """
        z = self.group_noise_multipliers
        return [GroupSummary(float(e), int(n), float(q), float(c), float(zz), float(g)) for e, n, q, c, zz, g in
                zip(self.budget_values, self.group_sizes, self.group_sample_rates, self.group_clip_norms, z,
                    self.group_epsilons)]

    # ------------------------------------------------------------------ display / persistence
    def summary(self, max_rows: int = 20) -> str:
        """A printable table: the plan's constants, then one row per group (elided in the middle).

        Args:
            max_rows: most group rows shown, an int ≥ 1; with more groups the first
                ``(max_rows + 1) // 2`` and the last ``max_rows // 2`` are shown around a "..." row.
        Returns:
            the table, a str.
        Raises:
            ValueError for ``max_rows`` < 1 (a table with no group in it).
        """
        check_int("max_rows", max_rows, 1)
        head = (f"PrivacyPlan(method={self.method}, accountant={self.accountant}) for {self.num_records} records, "
                f"{len(self.budget_values)} distinct budgets\n"
                f"  noise multiplier sigma = {self.noise_multiplier:.6g}, reference clip C = {self.max_grad_norm:.6g}, "
                f"steps = {self.steps}, delta = {self.delta:.3g}\n"
                f"  mean sample rate = {self.expected_batch_size / self.num_records:.6g}, "
                f"expected batch size = {self.expected_batch_size:.6g}, "
                f"mean clip norm = {float(np.dot(self.group_sizes, self.group_clip_norms)) / self.num_records:.6g}\n")
        cols = ("epsilon", "size", "sample_rate", "clip_norm", "noise_mult", "guaranteed_eps", "used")
        lines = ["  " + " ".join(f"{c:>14}" for c in cols)]
        g = len(self.budget_values)
        rows = list(range(g)) if g <= max_rows else list(range((max_rows + 1) // 2)) + [-1] + list(
            range(g - max_rows // 2, g))
        z = self.group_noise_multipliers
        for r in rows:
            if r < 0:
                lines.append("  " + " ".join(f"{'...':>14}" for _ in cols))
                continue
            used = self.group_epsilons[r] / self.budget_values[r]
            lines.append("  " + " ".join([f"{self.budget_values[r]:>14.6g}", f"{self.group_sizes[r]:>14d}",
                                          f"{self.group_sample_rates[r]:>14.6g}", f"{self.group_clip_norms[r]:>14.6g}",
                                          f"{z[r]:>14.6g}", f"{self.group_epsilons[r]:>14.6g}", f"{used:>13.2%} "]))
        return head + "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def to_dict(self) -> dict:
        """The plan as a JSON-able dict (floats round-trip exactly through ``json``).

        Returns:
            a dict of plain Python values: the constants, ``format_version``, the group arrays under
            "groups" and ``group_index``; ``sample_rates`` / ``clip_norms`` are rebuilt on load.
        """
        return {
            "format_version": _FORMAT_VERSION, "method": self.method, "accountant": self.accountant,
            "noise_multiplier": self.noise_multiplier, "max_grad_norm": self.max_grad_norm, "steps": self.steps,
            "delta": self.delta, "orders": list(self.orders),
            "groups": {"epsilon": self.budget_values.tolist(), "size": self.group_sizes.tolist(),
                       "sample_rate": self.group_sample_rates.tolist(), "clip_norm": self.group_clip_norms.tolist(),
                       "guaranteed_epsilon": self.group_epsilons.tolist()},
            "group_index": self.group_index.tolist(),
            "group_orders": None if self.group_orders is None else self.group_orders.tolist(),
        }

    @classmethod
    def from_dict(cls, d: dict) -> PrivacyPlan:
        """The plan ``to_dict`` wrote.

        Args:
            d: a dict as ``to_dict`` returns it.
        Returns:
            the plan (an instance of ``cls``).
        Raises:
            ValueError for another ``format_version``, or a plan calibration cannot have made (``_check``:
            e.g. a NaN σ, a rate above 1, a guaranteed ε above its budget, group sizes that do not
            count ``group_index``; ``_reaccount``: stored guarantees its settings do not give);
            KeyError for a missing entry; TypeError for ``d`` not a dict; ValueError for a
            ``ScheduledPlan``'s dict read as a ``PrivacyPlan`` (its schedule would be dropped).
        """
        plan = cls._read(d)
        if d.get("noise_factors") is not None and cls is PrivacyPlan:
            raise ValueError("plan: this dict has noise_factors, a noise schedule: read it with "
                             "pdpfast.accounting.schedules.ScheduledPlan.from_dict (as a PrivacyPlan its schedule "
                             "would be dropped)")
        plan._reaccount()
        return plan

    @classmethod
    def _read(cls, d: dict) -> PrivacyPlan:
        """``from_dict`` without re-accounting (a subclass re-accounts with its own fields)."""
        if not isinstance(d, dict):
            raise TypeError(f"a plan dict (as to_dict returns) was expected, got {type(d).__name__}")
        if d.get("format_version") != _FORMAT_VERSION:
            raise ValueError(f"unsupported plan format_version {d.get('format_version')!r}")
        g = d["groups"]
        index = np.asarray(d["group_index"], dtype=np.int64)
        sizes = np.asarray(g["size"], dtype=np.int64)
        return cls.from_groups(method=d["method"], accountant=d["accountant"], noise_multiplier=d["noise_multiplier"],
                               max_grad_norm=d["max_grad_norm"], steps=d["steps"], delta=d["delta"],
                               budget_values=g["epsilon"], group_index=index, counts=sizes,
                               group_sample_rates=g["sample_rate"], group_clip_norms=g["clip_norm"],
                               group_epsilons=g["guaranteed_epsilon"], orders=d.get("orders", ()),
                               group_orders=d.get("group_orders"))

    def _reaccount(self) -> None:
        """Account every group again from the plan's settings (σ, C, rates, clip norms, steps, δ) with
        its own ledger, and refuse a plan whose stored guarantees are not what they give: a plan read
        from a file could otherwise report the ε of settings since changed (σ set to 0, a rate to 1).

        Raises:
            ValueError naming the first group whose re-accounted ε exceeds its budget or its stored
            guaranteed ε (by more than 10⁻⁶ relative). Cost: one ledger evaluation (~2 s for 10⁶
            distinct budgets on 2 cores).
        """
        self._refuse_changed(self._group_epsilons_again())

    def _group_epsilons_again(self) -> np.ndarray:
        """(G,) each group's ε accounted from the plan's settings by its own ledger."""
        from .ledger import ledger_for_plan

        ledger = ledger_for_plan(self)
        ledger.step(self.steps)
        worst = np.full(self.budget_values.shape[0], -np.inf)
        np.maximum.at(worst, self.group_index, ledger.epsilons(self.delta))  # one pass, not one per group
        return np.where(self.group_sizes > 0, worst, self.group_epsilons)

    def _refuse_changed(self, again: np.ndarray) -> None:
        # more than stated: below is harmless (the ledger may certify a group at a better order than
        # calibration's, by up to ~3e-5 relative at 10^5 distinct budgets); NaN is refused
        fine = (again <= self.budget_values) & (again <= self.group_epsilons * (1 + 1e-6) + 1e-12)
        if not fine.all():
            k = int(np.argmin(fine))
            budget, stored, eps = self.budget_values[k], self.group_epsilons[k], float(again[k])
            raise ValueError(f"plan: the group with budget {budget:g} re-accounts to ε = {eps:.8g} from the "
                             f"plan's noise multiplier, rates, clip norms and steps, but the plan states "
                             f"{stored:.8g}: it was changed after calibration; calibrate again")

    def to_json(self) -> str:
        """The plan as JSON text.

        Returns:
            ``json.dumps(self.to_dict())``, a str.
        """
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> PrivacyPlan:
        """The plan ``to_json`` wrote.

        Args:
            text: JSON text as ``to_json`` returns it.
        Returns:
            the plan (an instance of ``cls``).
        Raises:
            as ``from_dict``; json.JSONDecodeError for text that is not JSON.
        """
        return cls.from_dict(json.loads(text))
