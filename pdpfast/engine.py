"""PrivacyEngine: turn an ordinary training loop into individualized DP-SGD (DESIGN.md §1)."""
from __future__ import annotations

import copy
import math

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from ._io import atomic_write
from .clipping import ClippingState, Phase, check_choice
from .data import DPDataLoader, PhysicalBatch, as_per_record
from .distributed import inner_module, plan_fingerprint, unwrap
from .nn.convert import convert
from .optimizer import DPOptimizer


class PrivacyBudgetExceeded(RuntimeError):
    """Raised by ``optimizer.step()`` when the step would take a record past its budget."""


class DPLoss:
    """The loss of a ghost-mode step: ``backward()`` runs the two passes over per-sample losses."""

    def __init__(self, per_sample: torch.Tensor, state: ClippingState, reduction: str):
        self.per_sample = per_sample
        self._state = state
        self.value = (per_sample.mean() if reduction == "mean" else per_sample.sum()).detach()

    def backward(self) -> None:
        self._state.ghost_backward(self.per_sample)

    def item(self) -> float:
        return self.value.item()

    def detach(self) -> torch.Tensor:
        return self.value

    def __float__(self) -> float:
        return self.item()

    def __repr__(self) -> str:
        return f"DPLoss({self.value.item():.6g})"


class DPCriterion:
    """Wraps a torch loss module so it returns a ``DPLoss`` built from per-sample losses."""

    def __init__(self, criterion: nn.Module, state: ClippingState, reduction: str):
        if not hasattr(criterion, "reduction"):
            raise TypeError("criterion must be a torch loss module with a `reduction` attribute "
                            f"(e.g. nn.CrossEntropyLoss()), got {type(criterion).__name__}")
        self.criterion = copy.copy(criterion)
        self.criterion.reduction = "none"
        self.state, self.reduction = state, reduction

    def __call__(self, *args, **kwargs) -> DPLoss:
        per_sample = self.criterion(*args, **kwargs)
        B = self.state.batch_size
        if per_sample.dim() > 1:  # e.g. token-level losses (B, T): one loss per record
            per_sample = per_sample.reshape(B, -1)
            per_sample = per_sample.mean(1) if self.reduction == "mean" else per_sample.sum(1)
        return DPLoss(per_sample, self.state, self.reduction)


class PrivacyEngine:
    """Makes (model, optimizer, data loader) private with per-record sample rates and clip bounds.

    After ``make_private`` an ordinary loop
    ``loss = criterion(model(x), y); loss.backward(); optimizer.step(); optimizer.zero_grad()``
    performs individualized DP-SGD: weighted Poisson sampling with rates q_i, per-sample clipping
    to c_i, noise N(0, σ²C²) once per step and normalization by the expected batch size Σ_i q_i.
    """

    def __init__(self, *, seed: int | None = None):
        self.seed = seed
        self.distributed = None  # a DistributedContext when the model is DDP-wrapped
        self.state: ClippingState | None = None
        self.optimizer: DPOptimizer | None = None
        self.data_loader: DPDataLoader | None = None

    def make_private(self, *, module: nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader,
                     noise_multiplier: float, max_grad_norm: float, sample_rates=None, clip_norms=None,
                     clipping: str = "flat", mode: str = "bk", criterion: nn.Module | None = None,
                     loss_reduction: str = "mean", layer_shares=None, automatic_gamma: float | None = None,
                     physical_batch_size: int | None = None, steps_per_epoch: int | None = None):
        """Returns (module, optimizer, data_loader), or (module, optimizer, criterion, data_loader)
        for ``mode="ghost"`` (which needs ``criterion``: a torch loss module).

        sample_rates: q_i, a float or (N,) in [0, 1] (default 1/len(data_loader), Opacus's).
        clip_norms: c_i, (N,) > 0 (default: max_grad_norm for every record). max_grad_norm: the
        reference bound C of the noise N(0, σ²C²). loss_reduction: "mean" if the loss is the batch
        mean of per-sample losses (torch's default), "sum" if it is their sum.
        """
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if not isinstance(data_loader, DataLoader):
            raise TypeError(f"data_loader must be a torch DataLoader, got {type(data_loader).__name__}")
        check_choice("loss_reduction", loss_reduction, ("mean", "sum"))
        if not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
            raise ValueError(f"max_grad_norm must be a finite number > 0, got {max_grad_norm!r}")
        if mode == "ghost" and criterion is None:
            raise ValueError("mode='ghost' needs criterion= (a torch loss module): its two backward passes "
                             "need per-sample losses")
        if self.state is not None:
            raise RuntimeError("this PrivacyEngine already made a model private; use one engine per model")
        n = len(data_loader.dataset)
        if sample_rates is None:
            sample_rates = 1.0 / len(data_loader)
        self.sample_rates = as_per_record("sample_rates", sample_rates, n, low=0.0, high=1.0)
        clip_norms = max_grad_norm if clip_norms is None else clip_norms
        self.clip_norms = as_per_record("clip_norms", clip_norms, n, low=0.0, low_inclusive=False)
        self.noise_multiplier, self.max_grad_norm = float(noise_multiplier), float(max_grad_norm)
        self.mode, self.loss_reduction = mode, loss_reduction

        inner, self.distributed = unwrap(module)  # a DDP-wrapped model: see pdpfast.distributed
        seed, shard = self.seed, {}
        if self.distributed is not None:
            seed = self.seed = self.distributed.agree_seed(self.seed)
            self.distributed.check_same("privacy plan (sample rates, clip bounds, noise)", plan_fingerprint(
                self.sample_rates, self.clip_norms, self.noise_multiplier, self.max_grad_norm))
            shard = dict(rank=self.distributed.rank, world_size=self.distributed.world_size)
        convert(inner)
        self.state = ClippingState(inner, mode=mode, clipping=clipping, layer_shares=layer_shares,
                                   automatic_gamma=automatic_gamma)
        self.state.attach()
        self.data_loader = DPDataLoader.from_data_loader(
            data_loader, self.sample_rates, physical_batch_size=physical_batch_size, seed=seed,
            steps_per_epoch=steps_per_epoch, **shard)
        self.optimizer = DPOptimizer(optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                                     expected_batch_size=self.data_loader.expected_batch_size,
                                     seed=None if seed is None else seed + 1)
        if self.distributed is not None:
            self.optimizer.reduce_grads = self.distributed.all_reduce_sum_
        self._clip_norms_tensor = torch.from_numpy(self.clip_norms)
        self._at_boundary = True
        self.optimizer.at_step_boundary = lambda: self._at_boundary
        self.optimizer.may_zero_grad = self._may_zero_grad
        self.optimizer.post_step_hooks.append(lambda _: self.state.end_draw())
        self.optimizer.post_zero_grad_hooks.append(self._after_zero_grad)
        self.data_loader.on_batch = self._on_batch
        if mode == "ghost":
            return module, self.optimizer, DPCriterion(criterion, self.state, loss_reduction), self.data_loader
        return module, self.optimizer, self.data_loader

    def _on_batch(self, batch: PhysicalBatch) -> None:
        # a draw opens its batches here; optimizer.step() (or zero_grad() discarding it) closes it
        rows = batch.indices.numel()
        scale = rows if self.loss_reduction == "mean" and self.mode != "ghost" else 1.0
        self.state.begin_batch(self.batch_clip_norms(batch.indices), batch.mask, loss_scale=scale, draw=batch.step)
        self._at_boundary = batch.is_last

    def batch_clip_norms(self, indices: torch.Tensor) -> torch.Tensor:
        """The clip bounds of a physical batch's rows, (B,) (an extension point: adaptive clipping
        replaces it on the instance to move the bounds between steps, (K, B) per layer)."""
        return self._clip_norms_tensor[indices]

    def _may_zero_grad(self) -> bool:
        """zero_grad() must not drop the clipped sums of a draw's earlier physical batches: it acts
        when no draw is in progress, or once the draw's last batch has been through backward."""
        return not self.state.pending or (self._at_boundary and self.state.phase is Phase.CLIPPED)

    def _after_zero_grad(self, _) -> None:
        if self.state.pending:  # the draw's gradients were discarded, not released: close it
            self.state.end_draw()

    def make_private_with_budgets(self, *, module: nn.Module, optimizer: torch.optim.Optimizer,
                                  data_loader: DataLoader, budgets, delta: float, epochs: int | None = None,
                                  steps: int | None = None, method: str = "sample", sample_rate: float | None = None,
                                  max_grad_norm: float = 1.0, hybrid_weight: float = 0.5, accountant: str = "rdp",
                                  noise_schedule=None, adaptive_clipping=None, **kwargs):
        """Calibrate per-record (q_i, c_i, σ) from budgets ε_i and make the training private with them.

        budgets: (N,) ε_i > 0, one per record of ``data_loader.dataset``; delta: δ in (0, 1); the
        run is ``epochs`` passes (in expectation) or ``steps`` optimizer steps; sample_rate: mean
        Poisson rate (default: batch_size / N of ``data_loader``); method: "sample" | "scale" |
        "hybrid" (see ``pdpfast.calibrate``). Other keyword arguments go to ``make_private``.

        The engine keeps a per-record ledger of the plan's own accountant (``accountant``: "rdp" or
        "pld"; ``engine.accountant.name`` says which): ``optimizer.step()`` raises
        PrivacyBudgetExceeded rather than take a step that would take any record past its budget,
        and ``engine.epsilons()`` is every record's ε spent so far, by that accountant.

        noise_schedule: σ_t = σ₀·h(t) (a ``pdpfast.accounting.schedules.NoiseSchedule``, a callable
        h(t) or a spec string such as "exponential:0.01"; RDP only): calibration finds σ₀ and the
        ledger charges every step's σ_t. adaptive_clipping: a ``pdpfast.adaptive.QuantileClipping``:
        the groups' clip bounds follow a quantile of their gradient norms, the noised counts paid
        from the plan's own multipliers. ``engine.adaptive`` then holds the per-step history.
        """
        from .accounting import calibrate, ledger_for_plan

        for key in ("noise_multiplier", "sample_rates", "clip_norms", "steps_per_epoch"):
            if key in kwargs:
                raise TypeError(f"make_private_with_budgets sets {key} from the plan; do not pass it")
        n = len(data_loader.dataset)
        budgets = np.asarray(budgets, dtype=np.float64)
        if budgets.ndim != 1 or budgets.shape[0] != n:
            raise ValueError(f"budgets must have one ε per record of the dataset ({n}), got shape {budgets.shape}")
        if sample_rate is None:
            sample_rate = 1.0 / len(data_loader)
        steps_per_epoch = max(1, round(1.0 / sample_rate))
        if (epochs is None) == (steps is None):
            raise ValueError("give exactly one of epochs= and steps=")
        if epochs is not None:
            if not isinstance(epochs, int) or epochs <= 0:
                raise ValueError(f"epochs must be a positive int, got {epochs!r}")
            steps = epochs * steps_per_epoch
        if noise_schedule is None:
            self.plan = calibrate(budgets, delta=delta, steps=steps, sample_rate=sample_rate, method=method,
                                  max_grad_norm=max_grad_norm, hybrid_weight=hybrid_weight, accountant=accountant)
        else:
            from .accounting.schedules import calibrate_scheduled

            if accountant != "rdp":
                raise ValueError(f"noise_schedule needs accountant='rdp' (the ledger composes each step's σ_t in RDP), "
                                 f"got accountant={accountant!r}")
            self.plan = calibrate_scheduled(budgets, delta=delta, steps=steps, sample_rate=sample_rate,
                                            noise_schedule=noise_schedule, method=method,
                                            max_grad_norm=max_grad_norm, hybrid_weight=hybrid_weight)
        self.delta, self.budgets = float(delta), budgets
        out = self.make_private(module=module, optimizer=optimizer, data_loader=data_loader,
                                noise_multiplier=self.plan.noise_multiplier, max_grad_norm=self.plan.max_grad_norm,
                                sample_rates=self.plan.sample_rates, clip_norms=self.plan.clip_norms,
                                steps_per_epoch=min(steps_per_epoch, steps), **kwargs)
        # the ledger must use the accountant that certified the plan: an RDP ledger of a PLD plan
        # reports every record at 1.1-1.6x its budget although the PLD guarantee holds
        self.accountant = ledger_for_plan(self.plan, budgets)
        self.optimizer.pre_step_hooks.append(self._refuse_overspending)
        self.optimizer.post_step_hooks.append(lambda _: self.accountant.step())
        self.adaptive = None
        if noise_schedule is not None or adaptive_clipping is not None:
            from .adaptive import AdaptiveTraining

            if adaptive_clipping is not None and self.distributed is not None:
                raise ValueError("adaptive_clipping is not supported with DistributedDataParallel (the counts of "
                                 "unclipped records would need an all-reduce)")
            self.adaptive = AdaptiveTraining(self, self.plan, clipping=adaptive_clipping,
                                             factors=getattr(self.plan, "noise_factors", None),
                                             seed=None if self.seed is None else self.seed + 2).attach()
        return out

    def _refuse_overspending(self, optimizer: DPOptimizer) -> None:
        # The plan certifies ε ≤ ε_i for plan.steps steps under its accountant; the ledger (same
        # accountant) additionally refuses any step that would take a record past its budget.
        if optimizer.steps >= self.plan.steps:
            raise PrivacyBudgetExceeded(
                f"the plan allows {self.plan.steps} steps and all have been taken; a further step would spend "
                "more than the records' budgets")
        over = self.accountant.would_exceed(self.delta, 1)
        if over.any():
            raise PrivacyBudgetExceeded(f"one more step would take {int(over.sum())} record(s) past their budget "
                                        f"under the {self.accountant.name.upper()} ledger "
                                        f"(first: record {int(np.flatnonzero(over)[0])})")

    def epsilons(self) -> np.ndarray:
        """(N,) ε each record has spent so far, at the plan's δ, by the ledger of the plan's accountant
        (``engine.accountant.name``: "rdp" or "pld"), so it is ≤ the budgets the plan was made for."""
        if getattr(self, "accountant", None) is None:
            raise RuntimeError("epsilons() needs the ledger of make_private_with_budgets")
        return self.accountant.epsilons(self.delta)

    def state_dict(self) -> dict:
        """Everything needed to resume: optimizer (with its step count and noise seed), the loader's
        next draw, the plan and the ledger. Model weights are saved by ``save_checkpoint``."""
        state = {"optimizer": self.optimizer.state_dict(),
                 "loader": {"seed": self.data_loader.seed, "next_step": self.data_loader.next_step}}
        if getattr(self, "accountant", None) is not None:
            state.update(plan=self.plan.to_dict(), ledger=self.accountant.state_dict(), delta=self.delta)
        if getattr(self, "adaptive", None) is not None:
            state["adaptive"] = self.adaptive.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        # check everything privacy-related before changing anything: a refused checkpoint leaves
        # the engine as it was
        ledger = None
        if "ledger" in state:
            if getattr(self, "accountant", None) is None:
                raise RuntimeError("the checkpoint holds a privacy ledger: resume with make_private_with_budgets")
            from .accounting import ledger_for_plan

            saved = type(self.plan).from_dict(state["plan"])
            if saved.accountant != self.plan.accountant:
                raise ValueError(f"the checkpoint's privacy plan was certified with accountant='{saved.accountant}', "
                                 f"this engine's with accountant='{self.plan.accountant}'; resume with the same "
                                 "accountant")
            if not (np.array_equal(self.plan.sample_rates, saved.sample_rates)
                    and np.array_equal(self.plan.clip_norms, saved.clip_norms)
                    and self.plan.noise_multiplier == saved.noise_multiplier and self.plan.steps == saved.steps):
                raise ValueError("the checkpoint's privacy plan differs from this engine's; resume with the same "
                                 "budgets, delta, steps and method")
            ledger = ledger_for_plan(self.plan, self.accountant.budgets)
            if self.plan.accountant == "pld" and "accountant" not in state["ledger"]:
                # written before PLD plans had a PLD ledger: an RDP ledger that the engine only ever
                # stepped over the whole dataset, so its step count is the whole history
                taken = int(state["ledger"]["steps_taken"])
                if taken:
                    ledger.step(taken)
            else:
                ledger.load_state_dict(state["ledger"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.data_loader.seed = int(state["loader"]["seed"])
        self.data_loader.next_step = int(state["loader"]["next_step"])
        if ledger is not None:
            self.accountant = ledger
        if getattr(self, "adaptive", None) is not None and "adaptive" in state:
            self.adaptive.load_state_dict(state["adaptive"])

    def save_checkpoint(self, path, module: nn.Module, **extra) -> None:
        """Atomically write model weights and the engine's state (incl. the ledger) to ``path``: a
        crash leaves the previous checkpoint or the new one, never a half-written file."""
        module = inner_module(module)
        state = {"model": module.state_dict(), "engine": self.state_dict(), "extra": extra}
        if self.distributed is None or self.distributed.rank == 0:  # every rank holds the same state
            atomic_write(path, lambda f: torch.save(state, f))
        if self.distributed is not None:
            self.distributed.barrier()  # no rank reads or replaces it before it is complete

    def load_checkpoint(self, path, module: nn.Module) -> dict:
        """Restore what ``save_checkpoint`` wrote; returns its ``extra`` fields."""
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        module = inner_module(module)
        module.load_state_dict(checkpoint["model"])
        self.load_state_dict(checkpoint["engine"])
        return checkpoint["extra"]

    @property
    def steps(self) -> int:
        """Optimizer steps taken (each one a Poisson draw composed in the accounting)."""
        return 0 if self.optimizer is None else self.optimizer.steps

    @property
    def expected_batch_size(self) -> float:
        return float(np.sum(self.sample_rates))

    def detach(self) -> None:
        """Return the model's DP layers to plain torch behaviour."""
        if self.state is not None:
            self.state.detach()
