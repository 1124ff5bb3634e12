"""PrivacyEngine: turn an ordinary training loop into individualized DP-SGD (DESIGN.md §1)."""
from __future__ import annotations

import copy
import math

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from .clipping import ClippingState, check_choice
from .data import DPDataLoader, PhysicalBatch, as_per_record
from .nn.convert import convert
from .optimizer import DPOptimizer


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

        convert(module)
        self.state = ClippingState(module, mode=mode, clipping=clipping, layer_shares=layer_shares,
                                   automatic_gamma=automatic_gamma)
        self.state.attach()
        self.data_loader = DPDataLoader.from_data_loader(
            data_loader, self.sample_rates, physical_batch_size=physical_batch_size, seed=self.seed,
            steps_per_epoch=steps_per_epoch)
        self.optimizer = DPOptimizer(optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                                     expected_batch_size=self.data_loader.expected_batch_size,
                                     seed=None if self.seed is None else self.seed + 1)
        self._clip_norms_tensor = torch.from_numpy(self.clip_norms)
        self._at_boundary = True
        self.optimizer.at_step_boundary = lambda: self._at_boundary
        self.data_loader.on_batch = self._on_batch
        if mode == "ghost":
            return module, self.optimizer, DPCriterion(criterion, self.state, loss_reduction), self.data_loader
        return module, self.optimizer, self.data_loader

    def _on_batch(self, batch: PhysicalBatch) -> None:
        rows = batch.indices.numel()
        scale = rows if self.loss_reduction == "mean" and self.mode != "ghost" else 1.0
        self.state.begin_batch(self._clip_norms_tensor[batch.indices], batch.mask, loss_scale=scale)
        self._at_boundary = batch.is_last

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
