"""PDP-SGD: multi-round personalized sampling on top of the engine ((Φ, Δ)-PDP; DESIGN.md §3.4).

Heo, Seo, Whang. Each round R = 1..k:

1. a threshold τ_R on the records' *remaining* budgets (``pdp.select_threshold``: the fixed loss
   w1·waste_u + w2·waste_s, or the adaptive one);
2. the round's subset: record i kept with probability π_i = (e^{ε_i} − 1)/(e^{τ_R} − 1) if its
   remaining ε_i < τ_R, else 1 (records with nothing left: 0), drawn with randomness seeded by
   (seed, R) only — never by the data. The seed is secret (drawn from ``os.urandom`` unless given):
   whoever knows it can recompute every round's subset, Poisson draws and noise;
3. DP-SGD on the subset through a fresh :class:`~pdpfast.PrivacyEngine`: Poisson rate q inside the
   subset (fixed, or B / Σ_i π_i for a constant expected batch B), σ_R calibrated so the round's
   steps are (τ_R, δ)-DP (the engine's plan and RDP ledger refuse any step beyond that);
   ``engine.detach()`` afterwards releases the model's layers;
4. the round is charged *before* it trains (charge before release): ``pdp.charge(..., rule)``;
   by default rule "all" charges every record its round guarantee min(ε_i, τ_R) whether or not it
   was kept, so the schedule of thresholds depends only on the budgets. ``rule="sampled"`` is the
   paper's rule (only kept records pay), offered for reproducing the paper: it makes later rounds
   depend on who was sampled. δ_i grows by π_i·δ (or δ) per round, so δ_i ≤ k·δ.

By the sampling mechanism (Jorgensen et al. 2015), a round whose subset training is (ε_R, δ)-DP is
(log(1 + π_i(e^{ε_R} − 1)), π_i·δ)-DP for record i; with the engine's ledger ε_R ≤ τ_R this is
≤ min(ε_i, τ_R), what the round charges. ``ledger_epsilons`` sums these amplified ledger values.

With rounds = 1 this is the "DP-SGD + Sampling" baseline.
"""
from __future__ import annotations

import copy
import os
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

from ._checks import (
    as_float_array,
    check_budgets,
    check_choice,
    check_delta,
    check_flag,
    check_int,
    check_nonnegative,
    check_positive,
    check_rate,
)
from ._io import atomic_write
from .accounting import pdp
from .loop import Task, pin_memory_for, private_steps

__all__ = ["PDPResult", "PDPSGD", "RoundRecord", "train_pdp_sgd"]


@dataclass
class RoundRecord:
    """One finished round.

    Attributes:
        round: its index R, 0-based.
        threshold: τ_R.
        noise_multiplier: σ_R of the round's plan (NaN when no record was kept: no step was taken).
        subset_size: records kept.
        alive: records with budget left before it.
        steps: optimizer steps it took.
        engine_epsilon: ε the round's engine ledger spent at δ (≤ τ_R).
        first_step: global step at which it started.
        sample_rate: q_R, the Poisson rate inside the subset.
    """

    round: int
    threshold: float
    noise_multiplier: float
    subset_size: int
    alive: int
    steps: int
    engine_epsilon: float
    first_step: int
    sample_rate: float = float("nan")


@dataclass
class PDPResult:
    """What a PDP-SGD run spent, per record.

    Attributes:
        epsilons: (N,) float64 ε charged (budget − remaining: the sum of round guarantees).
        deltas: (N,) float64 δ_i.
        remaining: (N,) float64 remaining budgets.
        ledger_epsilons: (N,) float64 Σ_R log(1 + π_i(e^{ε_R} − 1)) from the engines' RDP ledgers
            (≤ epsilons).
        rounds: one :class:`RoundRecord` per finished round.
    """

    epsilons: np.ndarray
    deltas: np.ndarray
    remaining: np.ndarray
    ledger_epsilons: np.ndarray
    rounds: list = field(default_factory=list)


_STATE_KEYS = ("config", "budgets", "remaining", "spent_delta", "ledger_eps", "round", "current", "history",
               "completed_steps", "finished", "optimizer")
_CURRENT_KEYS = ("threshold", "probabilities", "sample_rate", "steps", "kept", "payers", "alive", "first_step",
                 "engine")


def _check_settings(model, dataset, optimizer, *, task, max_grad_norm, w1, w2, seed, mode, clipping,
                    physical_batch_size, min_remaining) -> None:
    """Everything the rounds' engines would refuse only after round 0 was charged, refused before."""
    from .clipping import check_clipping_options, refuse_sequence_first
    from .data import map_style_length
    from .nn.convert import convert, unsupported_modules

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    map_style_length(dataset)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    params = {id(p) for p in model.parameters()}
    if any(id(p) not in params for group in optimizer.param_groups for p in group["params"]):
        raise ValueError("optimizer holds parameters that are not the model's: build it from model.parameters()")
    if task is not None and not isinstance(task, Task):
        raise TypeError(f"task must be a pdpfast.loop.Task or None, got {type(task).__name__}")
    check_positive("max_grad_norm", max_grad_norm)
    check_nonnegative("w1", w1)
    check_nonnegative("w2", w2)
    if seed is not None:
        check_int("seed", seed, 0)
    check_clipping_options(mode, clipping)
    if physical_batch_size is not None:
        check_int("physical_batch_size", physical_batch_size, 1)
    check_nonnegative("min_remaining", min_remaining)
    if unsupported_modules(model):
        convert(model)  # raises the message that names every such module, and changes nothing
    refuse_sequence_first(model)


class PDPSGD:
    """The PDP-SGD driver, resumable round by round and step by step.

    Args:
        model: trained in place.
        dataset: map-style, N records yielding (x, y).
        budgets: (N,) ε_i > 0.
        optimizer: a torch optimizer over the model's parameters (kept across rounds; each round's
            engine wraps it).
        delta: δ of each round's (τ_R, δ) guarantee (δ_i ≤ rounds·δ).
        rounds: k ≥ 1.
        steps_per_round: optimizer steps in every round, or
        epochs_per_round: E, giving round R round(E / q_R) steps (E expected passes over its subset,
            so a round on a small subset takes few steps and needs little noise for its τ_R); exactly
            one of the two.
        sample_rate: the Poisson rate q in (0, 1] inside every round's subset, or
        expected_batch_size: B, giving q_R = min(1, B / Σ_i π_i) (the subset's expected size Σ_i π_i
            is a function of the budgets, not of which records were drawn, so q_R is data-independent
            and every round has the same expected batch); exactly one of the two.
        task: a :class:`pdpfast.loop.Task` (default: classification, ``model(x)`` → logits).
        max_grad_norm: C, the clip bound of every round's plan.
        loss, w1, w2: the threshold loss ("fixed", "adaptive" or the paper's degenerate "harmonic"; see
            ``pdpfast.accounting.pdp.threshold_losses``) and its weights.
        rule: "all" (default: every record with budget left pays its round guarantee) or "sampled"
            (the paper's: only kept records pay).
        seed: of the rounds' subset draws and of their engines (their Poisson draws and noise), an int in
            [0, 2**63), or None (default): a secret one from ``os.urandom``, kept in ``state_dict()`` so a
            resumed run goes on with it. Give one only to reproduce an experiment: whoever knows it can
            recompute the draws and the noise, and so remove it.
        mode, clipping, physical_batch_size: passed to each round's engine.
        min_remaining: a remaining budget at or below this counts as exhausted (finite, ≥ 0).
    Raises:
        TypeError for a model, dataset, optimizer or task of the wrong kind, or budgets / settings that are
        not numbers; ValueError for a bad budget, δ, count, rate, rule, loss, weight, seed, clip bound,
        mode, clipping or min_remaining, an optimizer over other parameters than the model's, a model the
        engine cannot make private, or when not exactly one of each pair above is given. Every setting is
        checked here, before any round charges the budgets.
    """

    def __init__(self, model: nn.Module, dataset, budgets, *, optimizer: torch.optim.Optimizer, delta: float,
                 rounds: int, steps_per_round: int | None = None, epochs_per_round: float | None = None,
                 sample_rate: float | None = None,
                 expected_batch_size: float | None = None,
                 task: Task | None = None, max_grad_norm: float = 1.0, loss: str = "fixed", w1: float = 0.7,
                 w2: float = 0.3, rule: str = "all", seed: int | None = None, mode: str = "bk", clipping: str = "flat",
                 physical_batch_size: int | None = None, min_remaining: float = 1e-9):
        _check_settings(model, dataset, optimizer, task=task, max_grad_norm=max_grad_norm, w1=w1, w2=w2, seed=seed,
                        mode=mode, clipping=clipping, physical_batch_size=physical_batch_size,
                        min_remaining=min_remaining)
        self.model, self.dataset, self.optimizer = model, dataset, optimizer
        if isinstance(budgets, torch.Tensor):
            budgets = budgets.detach().cpu().numpy()
        # numbers only (not strings numpy would read, "1"); check_budgets names the first bad record
        self.budgets = check_budgets(as_float_array("budgets", budgets), len(dataset), "budgets")
        check_int("rounds", rounds, 1)
        if steps_per_round is not None:
            check_int("steps_per_round", steps_per_round, 1)
        if float(min_remaining) >= self.budgets.max():
            raise ValueError(f"min_remaining={min_remaining!r} is not below the largest budget "
                             f"({self.budgets.max():g}): every record would count as exhausted and nothing train")
        below = int((self.budgets <= float(min_remaining)).sum())
        if below:
            warnings.warn(f"{below} record(s) have a budget at or below min_remaining={min_remaining!r} and never "
                          "train (they count as exhausted from the start, charged nothing)", UserWarning, stacklevel=2)
        if (steps_per_round is None) == (epochs_per_round is None):
            raise ValueError("give exactly one of steps_per_round and epochs_per_round")
        if epochs_per_round is not None:
            check_positive("epochs_per_round", epochs_per_round)
        if (sample_rate is None) == (expected_batch_size is None):
            raise ValueError("give exactly one of sample_rate (the same q in every round) and expected_batch_size "
                             "(q_R = B / Σ_i π_i in round R)")
        if sample_rate is not None:
            check_rate("sample_rate", sample_rate)
        if expected_batch_size is not None:
            check_positive("expected_batch_size", expected_batch_size)
        check_choice("rule", rule, ("all", "sampled"))
        check_choice("loss", loss, ("fixed", "adaptive", "harmonic"))
        self.delta, self.rounds = check_delta("delta", delta), int(rounds)
        self.steps_per_round = None if steps_per_round is None else int(steps_per_round)
        self.epochs_per_round = None if epochs_per_round is None else float(epochs_per_round)
        self.sample_rate = None if sample_rate is None else float(sample_rate)
        self.expected_batch_size = None if expected_batch_size is None else float(expected_batch_size)
        self.rule, self.loss, self.w1, self.w2 = rule, loss, float(w1), float(w2)
        self._seed_given = seed is not None
        self.seed = int(seed) if self._seed_given else int.from_bytes(os.urandom(7), "little")
        self.mode, self.clipping = mode, clipping
        self.physical_batch_size = None if physical_batch_size is None else int(physical_batch_size)
        self.max_grad_norm = float(max_grad_norm)
        self.min_remaining = float(min_remaining)
        self.task = task or Task()
        n = self.budgets.shape[0]
        self.remaining = self.budgets.copy()
        self.spent_delta = np.zeros(n)
        self.ledger_eps = np.zeros(n)
        self.round = 0                  # the round in progress, or the next one
        self.current: dict | None = None
        self.history: list[RoundRecord] = []
        self.completed_steps = 0
        self.finished = False
        self._engine = None

    # ------------------------------------------------------------------ progress
    @property
    def total_steps(self) -> int:
        """Steps of a full run: exact under rule "all" (the schedule depends only on the budgets),
        an estimate under rule "sampled"."""
        if getattr(self, "_total_steps", None) is None:
            rem, total = self.budgets.copy(), 0
            for _ in range(self.rounds):
                alive = np.where(rem > self.min_remaining, rem, 0.0)
                plan, left_out = pdp.meetable_round(alive, self._plan)
                if plan is None:
                    break
                total += plan.steps
                rem = pdp.charge(np.where(left_out, 0.0, alive), plan.threshold)
            self._total_steps = total
        return self._total_steps

    def _threshold(self, rem: np.ndarray):
        """(τ_R, π (N,), q_R) for remaining budgets ``rem`` (zeros: no budget left)."""
        threshold = pdp.select_threshold(rem[rem > 0], self.loss, self.w1, self.w2)
        probabilities = np.where(rem > 0, pdp.sampling_probabilities(rem, threshold), 0.0)
        # q_R from the budgets alone (Σ π_i, not the drawn subset's size), so it is data-independent
        q = self.sample_rate or min(1.0, self.expected_batch_size / float(probabilities.sum()))
        return threshold, probabilities, q

    def _plan(self, rem: np.ndarray):
        """The round plan on remaining budgets ``rem`` (raises ``pdp.UnmeetableThreshold``)."""
        threshold, _, q = self._threshold(rem)
        return pdp.round_plan(rem, delta=self.delta, steps=self._steps_for(q), sample_rate=q, threshold=threshold)

    def _steps_for(self, sample_rate: float) -> int:
        if self.steps_per_round is not None:
            return self.steps_per_round
        return max(1, round(self.epochs_per_round / sample_rate))

    @property
    def steps(self) -> int:
        """Optimizer steps taken so far, over all rounds."""
        in_round = 0
        if self._engine is not None:
            in_round = self._engine.steps
        elif self.current is not None and self.current.get("engine") is not None:
            in_round = int(self.current["engine"]["optimizer"]["steps"])
        return self.completed_steps + in_round

    def epsilons_now(self) -> np.ndarray:
        """ε spent by the steps taken so far: finished rounds' amplified ledger ε plus the current
        round's (π_i-amplified) engine ledger.

        Returns:
            (N,) float64 ε per record.
        """
        eps = self.ledger_eps.copy()
        if self._engine is not None and self._engine.steps > 0:
            eps += self._amplified(float(self._engine.epsilons().max()))
        return eps

    def _amplified(self, engine_epsilon: float) -> np.ndarray:
        cur = self.current
        payers = np.zeros_like(self.ledger_eps, dtype=bool)
        payers[cur["payers"]] = True
        return np.where(payers, pdp.amplified_epsilon(cur["probabilities"], engine_epsilon), 0.0)

    # ------------------------------------------------------------------ rounds
    def _begin_round(self) -> bool:
        rem = np.where(self.remaining > self.min_remaining, self.remaining, 0.0)
        plan, left_out = pdp.meetable_round(rem, self._plan)
        if left_out.any():
            warnings.warn(f"{int(left_out.sum())} record(s) with a remaining budget of at most "
                          f"{rem[left_out].max():.3g} take no further part: no noise multiplier meets so small a "
                          f"budget over a round at δ={self.delta:g} (they keep it, charged nothing more)",
                          UserWarning, stacklevel=3)
        if plan is None:
            return False
        rem = np.where(left_out, 0.0, rem)
        q, steps = plan.sample_rate, plan.steps
        # data-independent randomness: a function of (seed, round) only
        draws = np.random.default_rng([self.seed, 0x9D95, self.round]).random(rem.shape[0])
        kept = draws < plan.probabilities
        # charge before release: the ledger pays for the round before the round trains
        self.spent_delta = pdp.charge_delta(self.spent_delta, rem, plan.threshold, self.delta, sampled=kept,
                                            rule=self.rule)
        # records out of the round (exhausted, or left out) keep what they have: charged nothing
        self.remaining = np.where(rem > 0, pdp.charge(rem, plan.threshold, sampled=kept, rule=self.rule),
                                  self.remaining)
        payers = kept if self.rule == "sampled" else rem > 0
        self.current = {"threshold": plan.threshold, "probabilities": plan.probabilities, "sample_rate": q,
                        "steps": steps,
                        "kept": np.flatnonzero(kept), "payers": np.flatnonzero(payers),
                        "alive": int((rem > 0).sum()), "first_step": self.completed_steps, "engine": None}
        return True

    def _round_engine(self):
        import pdpfast

        cur = self.current
        engine = pdpfast.PrivacyEngine(seed=int(np.random.SeedSequence([self.seed, self.round]).generate_state(1)[0]))
        criterion = self.task.criterion()
        subset = Subset(self.dataset, cur["kept"].tolist())
        # the subset's training is uniform DP-SGD at (τ_R, δ): q for everyone, σ_R for τ_R
        made = engine.make_private_with_budgets(
            module=self.model, optimizer=self.optimizer,
            data_loader=DataLoader(subset, pin_memory=pin_memory_for(self.model)),
            budgets=np.full(len(subset), cur["threshold"]), delta=self.delta, steps=cur["steps"],
            method="scale", sample_rate=cur["sample_rate"], max_grad_norm=self.max_grad_norm, clipping=self.clipping,
            mode=self.mode, loss_reduction="sum", physical_batch_size=self.physical_batch_size,
            criterion=criterion if self.mode == "ghost" else None)
        if cur["engine"] is not None:
            engine.load_state_dict(cur["engine"])
        # ghost mode wraps the loss (its two backward passes); otherwise the task's own loss is used as it is
        return engine, made.optimizer, made.data_loader, made.criterion if self.mode == "ghost" else criterion

    def _finish_round(self, engine_epsilon: float, sigma: float) -> None:
        cur = self.current
        self.ledger_eps += self._amplified(engine_epsilon)
        self.history.append(RoundRecord(self.round, float(cur["threshold"]), float(sigma), int(len(cur["kept"])),
                                        cur["alive"], cur["steps"], float(engine_epsilon),
                                        int(cur["first_step"]), float(cur["sample_rate"])))
        self.completed_steps += cur["steps"]
        self.current, self.round = None, self.round + 1

    def run(self, on_step=None, max_steps: int | None = None) -> PDPResult:
        """Train the remaining rounds (or ``max_steps`` more steps, then stop resumably).

        Args:
            on_step: ``on_step(global_step, loss)`` after every optimizer step (loss: the mean
                per-record loss of the draw); returning True stops after that step, resumably.
            max_steps: the most optimizer steps this call takes, an int ≥ 0 (None: to the end).
        Returns:
            :class:`PDPResult` of the rounds so far: (N,) ε charged, δ_i, remaining ε, ledger ε.
        Raises:
            TypeError for an ``on_step`` that is not callable; ValueError for a ``max_steps`` that is not an
            int ≥ 0. Both are checked before a round is charged.
        """
        if on_step is not None and not callable(on_step):
            raise TypeError(f"on_step must be callable (on_step(global_step, loss)) or None, got "
                            f"{type(on_step).__name__}")
        stop_at = None if max_steps is None else self.steps + check_int("max_steps", max_steps, 0)
        stopped = False
        exhausted = False
        while self.round < self.rounds and not stopped:
            if self.current is None and not self._begin_round():
                exhausted = True     # no record can take part any more
                break
            if len(self.current["kept"]) == 0:        # nobody drawn: the round takes no step, releases nothing
                self.current["steps"] = 0
                self._finish_round(0.0, float("nan"))
                continue
            engine, optimizer, loader, criterion = self._round_engine()
            self._engine = engine
            offset = self.completed_steps
            round_steps = self.current["steps"]
            until = round_steps if stop_at is None else min(round_steps, stop_at - offset)
            halt = []

            def step_hook(step, loss, offset=offset, halt=halt):   # this round's offset and flag
                if on_step is not None and on_step(offset + step, loss):
                    halt.append(True)
                    return True
                return False

            try:
                if until > engine.steps:
                    private_steps(engine, self.model, optimizer, loader, self.task, criterion, until=until,
                                  on_step=step_hook)
                if engine.steps >= round_steps:
                    eps = float(engine.epsilons().max())
                    self._engine = None
                    self._finish_round(eps, engine.plan.noise_multiplier)
                else:
                    self.current["engine"] = engine.state_dict()
                    self._engine = None
                    stopped = True
                stopped = stopped or bool(halt)
            finally:
                if self._engine is not None:           # an exception: keep the round's state resumable
                    self.current["engine"] = engine.state_dict()
                    self._engine = None
                engine.detach()
        if self.round >= self.rounds or exhausted or (self.current is None and
                                                      not np.any(self.remaining > self.min_remaining)):
            self.finished = True
        return self.result()

    def result(self) -> PDPResult:
        """The outcome so far.

        Returns:
            the :class:`PDPResult` of the steps taken so far (arrays (N,), ε in nats).
        """
        return PDPResult(self.budgets - self.remaining, self.spent_delta.copy(), self.remaining.copy(),
                         self.epsilons_now(), list(self.history))

    # ------------------------------------------------------------------ persistence
    def _config(self) -> dict:
        return {"delta": self.delta, "rounds": self.rounds, "steps_per_round": self.steps_per_round,
                "epochs_per_round": self.epochs_per_round,
                "sample_rate": self.sample_rate, "expected_batch_size": self.expected_batch_size, "rule": self.rule,
                "loss": self.loss, "w1": self.w1, "w2": self.w2,
                "seed": self.seed, "max_grad_norm": self.max_grad_norm}

    def state_dict(self) -> dict:
        """The driver's state: ledger (remaining, δ_i, amplified ε), round, the round in progress
        (with its engine's state) and the optimizer's state. Model weights are not included.

        Returns:
            a dict: "format_version" (1), "config" (the settings), "budgets", "remaining",
            "spent_delta", "ledger_eps" ((N,) float64 copies), "round", "current", "history" (dicts),
            "completed_steps", "finished" and "optimizer" (its ``state_dict``).
        """
        current = None
        if self.current is not None:       # a snapshot: later steps must not change what was returned
            current = copy.deepcopy({**self.current, "engine": None})
            engine = self._engine.state_dict() if self._engine is not None else self.current["engine"]
            current["engine"] = copy.deepcopy(engine)
        return {"format_version": 1, "config": self._config(), "budgets": self.budgets.copy(),
                "remaining": self.remaining.copy(), "spent_delta": self.spent_delta.copy(),
                "ledger_eps": self.ledger_eps.copy(), "round": self.round, "current": current,
                "history": [vars(r).copy() for r in self.history], "completed_steps": self.completed_steps,
                "finished": self.finished, "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Resume from what ``state_dict()`` returned.

        Args:
            state: a dict with the keys of ``state_dict()``.
        Returns:
            None; the driver's state and the optimizer's are replaced.
        Raises:
            TypeError when ``state`` is not a dict or its ``finished`` is not True or False; ValueError when
            it is not a PDP-SGD state (a missing key is named), was saved with other settings or budgets, or
            holds spending or progress that cannot be (a remaining budget outside [0, budget], negative or
            non-finite spent δ or ledger ε, arrays not one per record, a round outside [0, rounds], negative
            completed steps, a round in progress that is not one), or was saved before the steps this driver
            has taken (their noise would be released twice); the driver is then unchanged.
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be the dict state_dict() returned, got {type(state).__name__}")
        if state.get("format_version") != 1:
            raise ValueError("not a PDP-SGD state (format_version)")
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"not a PDP-SGD state: missing {', '.join(missing)}")
        if not isinstance(state["config"], dict):
            raise ValueError("PDP-SGD state: config must be a dict of the settings")
        config = self._config()
        if not self._seed_given and "seed" in state["config"]:   # a drawn seed: the run's own is restored
            config["seed"] = check_int("PDP-SGD state: config['seed']", state["config"]["seed"], 0)
        if state["config"] != config:
            diff = sorted(k for k in config if state["config"].get(k) != config[k])
            raise ValueError(f"the checkpoint's PDP-SGD settings differ from this run's ({', '.join(diff)}); resume "
                             "with the same ones")
        if not np.array_equal(np.asarray(state["budgets"]), self.budgets):
            raise ValueError("the checkpoint's budgets differ from this run's; resume with the same budgets")
        remaining = np.asarray(state["remaining"], dtype=np.float64).copy()
        spent_delta = np.asarray(state["spent_delta"], dtype=np.float64).copy()
        ledger_eps = np.asarray(state["ledger_eps"], dtype=np.float64).copy()
        # a record's remaining budget above its budget, or negative spending, would let it overspend
        n = self.budgets.shape
        if remaining.shape != n or spent_delta.shape != n or ledger_eps.shape != n:
            raise ValueError("PDP-SGD state: remaining, spent_delta and ledger_eps must hold one value per record "
                             f"({n[0]})")
        if not (np.isfinite(remaining).all() and (remaining >= 0).all() and (remaining <= self.budgets).all()):
            raise ValueError("PDP-SGD state: every remaining budget must lie in [0, its budget]")
        if not (np.isfinite(spent_delta).all() and (spent_delta >= 0).all()
                and np.isfinite(ledger_eps).all() and (ledger_eps >= 0).all()):
            raise ValueError("PDP-SGD state: spent_delta and ledger_eps must be finite and >= 0")
        round_ = check_int("PDP-SGD state: round", state["round"], 0, self.rounds)
        completed_steps = check_int("PDP-SGD state: completed_steps", state["completed_steps"], 0)
        finished = check_flag("PDP-SGD state: finished", state["finished"])
        current = state["current"]
        if current is not None:
            if round_ >= self.rounds:
                raise ValueError("PDP-SGD state: a round in progress after the last round")
            self._check_current(current)
        try:
            history = [RoundRecord(**r) for r in state["history"]]
        except TypeError as e:
            raise ValueError(f"PDP-SGD state: history must be a list of round records ({e})") from None
        steps = completed_steps + (0 if current is None or current["engine"] is None
                                   else int(current["engine"]["optimizer"]["steps"]))
        if steps < self.steps:
            # the re-run steps would draw the same records and noise as the released ones (the same seed
            # and step), on other weights: their difference cancels the noise
            raise ValueError(f"PDP-SGD state: it was saved after {steps} steps and this run has taken {self.steps}; "
                             "loading it would release those steps again with the same noise. Resume a new run "
                             "from its latest checkpoint")
        current = copy.deepcopy(current)
        self.optimizer.load_state_dict(state["optimizer"])
        self.remaining, self.spent_delta, self.ledger_eps = remaining, spent_delta, ledger_eps
        self.round, self.current, self.history = round_, current, history
        self.completed_steps, self.finished = completed_steps, finished
        self.seed = int(state["config"]["seed"])

    def _check_current(self, current) -> None:
        """Refuse a round in progress (``state["current"]``) that ``_begin_round`` could not have made."""
        if not isinstance(current, dict):
            raise ValueError(f"PDP-SGD state: current must be None or a dict, got {type(current).__name__}")
        missing = [key for key in _CURRENT_KEYS if key not in current]
        if missing:
            raise ValueError(f"PDP-SGD state: the round in progress (current) lacks {', '.join(missing)}")
        n = self.budgets.shape[0]
        check_positive("PDP-SGD state: current['threshold']", current["threshold"])
        check_rate("PDP-SGD state: current['sample_rate']", current["sample_rate"])
        check_int("PDP-SGD state: current['steps']", current["steps"], 0)
        check_int("PDP-SGD state: current['alive']", current["alive"], 0, n)
        check_int("PDP-SGD state: current['first_step']", current["first_step"], 0)
        probabilities = as_float_array("PDP-SGD state: current['probabilities']", current["probabilities"])
        if probabilities.shape != (n,) or not ((probabilities >= 0) & (probabilities <= 1)).all():
            raise ValueError(f"PDP-SGD state: current['probabilities'] must be {n} values in [0, 1]")
        for key in ("kept", "payers"):
            idx = np.asarray(current[key])
            if idx.ndim != 1 or (idx.size and (idx.dtype.kind not in "iu" or idx.min() < 0 or idx.max() >= n)):
                raise ValueError(f"PDP-SGD state: current[{key!r}] must be record indices in [0, {n})")
        if current["engine"] is not None and not isinstance(current["engine"], dict):
            raise ValueError("PDP-SGD state: current['engine'] must be None or the round engine's state dict")

    def save_checkpoint(self, path, **extra) -> None:
        """Atomically write model weights and the driver's state (``extra["pdp"]``) to ``path``, in
        the layout of ``PrivacyEngine.save_checkpoint``.

        Args:
            path: the file (str or path-like).
            **extra: more entries to keep in the checkpoint's "extra" dict.
        Returns:
            None.
        """
        payload = {"model": self.model.state_dict(), "engine": None, "extra": {**extra, "pdp": self.state_dict()}}
        atomic_write(path, lambda f: torch.save(payload, f))

    def load_checkpoint_state(self, checkpoint: dict) -> dict:
        """Restore from what ``save_checkpoint`` wrote.

        Args:
            checkpoint: the dict, already loaded with ``torch.load``.
        Returns:
            the checkpoint's "extra" dict (with "pdp").
        Raises:
            ValueError when it holds no PDP-SGD state, or as :meth:`load_state_dict`.
        """
        if "pdp" not in checkpoint.get("extra", {}):
            raise ValueError("the checkpoint holds no PDP-SGD state (was it made with another --method?)")
        self.load_state_dict(checkpoint["extra"]["pdp"])
        self.model.load_state_dict(checkpoint["model"])
        return checkpoint["extra"]


def train_pdp_sgd(model: nn.Module, dataset, budgets, *, delta: float, rounds: int, steps_per_round: int | None = None,
                  epochs_per_round: float | None = None,
                  sample_rate: float | None = None, expected_batch_size: float | None = None,
                  optimizer: torch.optim.Optimizer | None = None, lr: float | None = None,
                  on_step=None, **kwargs) -> PDPResult:
    """Train ``model`` in place with PDP-SGD.

    Args:
        model: trained in place. dataset: N records yielding (x, y). budgets: (N,) ε_i > 0.
        delta: δ in (0, 1) of each round. rounds: k ≥ 1. steps_per_round or epochs_per_round: the
            length of a round. sample_rate: q in (0, 1] in every round, or expected_batch_size: B
            records per step (q_R = B / Σ_i π_i). optimizer: default SGD(lr, momentum 0.9).
        lr: the default optimizer's learning rate (None: 0.1); refused with ``optimizer`` (which has its own).
        on_step: ``on_step(global_step, loss)`` after every optimizer step; True stops.
        **kwargs: to :class:`PDPSGD` (task, loss, rule, seed, mode, clipping, ...).
    Returns:
        :class:`PDPResult`: per record (N,) ε spent and δ_i, remaining budgets, ledger ε.
    Raises:
        ValueError for ``lr`` given with ``optimizer``; as :class:`PDPSGD` and ``run`` otherwise.
    """
    if optimizer is None:
        lr = 0.1 if lr is None else check_positive("lr", lr)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr, momentum=0.9)
    elif lr is not None:
        raise ValueError("lr sets the default optimizer's learning rate; with optimizer= given, set the rate on "
                         "that optimizer (lr would be ignored)")
    driver = PDPSGD(model, dataset, budgets, optimizer=optimizer, delta=delta, rounds=rounds,
                    steps_per_round=steps_per_round, epochs_per_round=epochs_per_round, sample_rate=sample_rate,
                    expected_batch_size=expected_batch_size, **kwargs)
    return driver.run(on_step=on_step)
