"""Individualized per-sample clipping of one batch: book-keeping, ghost and per-layer (DESIGN.md §1-2).

A ``ClippingState`` is attached to a converted model. For each batch it is told the records'
clip bounds c_i (and a 0/1 mask for padded rows), then sees every DP layer's forward and backward:

* ``mode="bk"`` (book-keeping, one backward): each layer's backward records its per-sample squared
  norms and keeps (input, output gradient); a callback at the end of the backward forms the clip
  weights w_i from the total norms and writes Σ_i w_i g_i into ``param.grad`` with one GEMM per layer.
* ``mode="ghost"`` (two backwards): the first only computes norms, the second runs on Σ_i w_i ℓ_i.
  It needs per-sample losses, so it is driven by ``ghost_backward`` (the wrapped criterion).
* ``clipping="per_layer"`` (one backward): clipping group k gets the bound c_i·C_k with Σ_k C_k² = 1
  and clips the moment its own norms are known.

A parameter used more than once in a forward (tied embeddings, a module called twice) has per-sample
gradients that are sums over its uses, so norms of the uses do not add: such parameters fall back
to accumulating their materialized per-sample gradients, which is exact.
"""
from __future__ import annotations

import functools
import math
from contextlib import contextmanager
from typing import Mapping, Sequence

import torch
from torch import nn

from .nn.layers import DPLayerFunction, DPModule
from .nn.rules import rule_for
from .ops.clip import clip_weights

MODES = ("bk", "ghost")
CLIPPINGS = ("flat", "per_layer")


def _trainable(module: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def as_per_sample(name: str, values, batch_size: int | None = None, *, positive: bool = True) -> torch.Tensor:
    """A (B,) float tensor from ``values``, checked: finite, > 0 if ``positive``, of length B."""
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


class ClippingState:
    """Per-model state of private backward passes. See the module docstring for the modes.

    model: converted with ``pdpfast.nn.convert``. layer_shares (per-layer clipping only): None for
    equal shares 1/√K over the K clipping groups, or a mapping from module name to C_k, or a
    sequence of K values in ``self.group_names`` order; Σ C_k² must be 1. automatic_gamma: None for
    standard clipping, γ > 0 for automatic clipping w_i = c_i / (‖g_i‖ + γ).
    """

    def __init__(self, model: nn.Module, *, mode: str = "bk", clipping: str = "flat",
                 layer_shares: Mapping[str, float] | Sequence[float] | None = None,
                 automatic_gamma: float | None = None):
        check_choice("mode", mode, MODES)
        check_choice("clipping", clipping, CLIPPINGS)
        if clipping == "per_layer" and mode == "ghost":
            raise ValueError("clipping='per_layer' clips inside one backward; mode='ghost' does not apply "
                             "to it (use mode='bk', the default)")
        if layer_shares is not None and clipping != "per_layer":
            raise ValueError("layer_shares applies only to clipping='per_layer'")
        if automatic_gamma is not None and not (automatic_gamma > 0 and math.isfinite(automatic_gamma)):
            raise ValueError(f"automatic_gamma must be a positive number or None, got {automatic_gamma!r}")
        self.model, self.mode, self.clipping, self.automatic_gamma = model, mode, clipping, automatic_gamma
        self._names = {m: name or "<model>" for name, m in model.named_modules()}
        self.layers = [m for m in model.modules() if isinstance(m, DPModule)]
        loose = [f"{self._names[m]} ({type(m).__name__})" for m in model.modules()
                 if not isinstance(m, DPModule) and _trainable(m)]
        if loose:
            raise ValueError("the model has trainable parameters outside DP layers; call "
                             "pdpfast.nn.convert(model) first. Modules: " + "; ".join(loose))
        if not any(_trainable(m) for m in self.layers):
            raise ValueError("the model has no trainable parameters in DP layers; call pdpfast.nn.convert(model)")
        self._build_groups()
        self.shares = self._resolve_shares(layer_shares) if clipping == "per_layer" else None
        self._guards: list = []
        self.batch_size: int | None = None
        self.last_norms: torch.Tensor | None = None
        self._reset_batch()

    # ------------------------------------------------------------------ structure

    def _build_groups(self) -> None:
        """Clipping groups: one per DP layer, merged where layers share a parameter (tied weights).

        Only trainable parameters count: a frozen layer is never clipped, so giving it a group
        would shrink every other group's share 1/√K for nothing."""
        parent = list(range(len(self.layers)))

        def find(i):
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        owner: dict[nn.Parameter, int] = {}
        for i, m in enumerate(self.layers):
            for p in _trainable(m).values():
                if p in owner:
                    parent[find(i)] = find(owner[p])
                owner[p] = i
        roots: dict[int, int] = {}
        self._group_of: dict[nn.Module, int] = {}
        self.group_names: list[str] = []
        self._group_params: list[list[nn.Parameter]] = []
        for i, m in enumerate(self.layers):
            if not _trainable(m):
                continue
            r = find(i)
            if r not in roots:
                roots[r] = len(self.group_names)
                self.group_names.append(self._names[m])
                self._group_params.append([])
            k = roots[r]
            self._group_of[m] = k
            for p in _trainable(m).values():
                if not any(p is q for q in self._group_params[k]):
                    self._group_params[k].append(p)

    def _resolve_shares(self, layer_shares) -> torch.Tensor:
        K = len(self.group_names)
        if layer_shares is None:
            return torch.full((K,), 1.0 / math.sqrt(K), dtype=torch.float64)
        if isinstance(layer_shares, Mapping):
            by_name = {}
            for name, share in layer_shares.items():
                module = dict(self.model.named_modules()).get(name)
                if module is None or module not in self._group_of:
                    raise ValueError(f"layer_shares names {name!r}, which is not a DP layer with trainable parameters; "
                                     f"clipping groups: {self.group_names}")
                by_name[self._group_of[module]] = float(share)
            missing = [self.group_names[k] for k in range(K) if k not in by_name]
            if missing:
                raise ValueError(f"layer_shares gives no share for the clipping groups {missing}")
            shares = torch.tensor([by_name[k] for k in range(K)], dtype=torch.float64)
        else:
            shares = torch.as_tensor(list(layer_shares), dtype=torch.float64)
            if shares.shape != (K,):
                raise ValueError(f"layer_shares must have one value per clipping group ({K}: {self.group_names}), "
                                 f"got {tuple(shares.shape)}")
        if not torch.isfinite(shares).all() or (shares <= 0).any():
            raise ValueError("layer_shares must be positive and finite")
        total = float((shares ** 2).sum())
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"layer_shares must satisfy Σ C_k² = 1 so each record's total sensitivity stays "
                             f"≤ c_i; got Σ C_k² = {total:.6g} (divide the shares by {math.sqrt(total):.6g})")
        return shares

    @contextmanager
    def attached(self):
        self.attach()
        try:
            yield self
        finally:
            self.detach()

    def attach(self) -> None:
        for m in self.layers:
            if m._pdpfast_state is not None and m._pdpfast_state is not self:
                raise RuntimeError(f"{self._names[m]} is already attached to another pdpfast engine")
            m._pdpfast_state = self
        if not self._guards:
            # DP layers hand autograd detached parameters, so a trainable parameter receives an autograd
            # gradient only through a use outside its layer's private forward; that gradient is unclipped
            self._guards = [p.register_hook(functools.partial(self._refuse_plain_grad, name))
                            for name, p in self.model.named_parameters() if p.requires_grad]

    def detach(self) -> None:
        for m in self.layers:
            if m._pdpfast_state is self:
                m._pdpfast_state = None
        for handle in self._guards:
            handle.remove()
        self._guards = []

    @staticmethod
    def _refuse_plain_grad(name: str, grad) -> None:
        if grad is not None:
            raise RuntimeError(
                f"parameter {name} received an ordinary, unclipped gradient in a private backward: it is used "
                "outside its DP layer's private forward (e.g. F.linear(x, layer.weight), or a DP layer in eval "
                "mode). Use it through its module (share the Parameter between modules to tie weights), or "
                "freeze it")

    # ------------------------------------------------------------------ one batch

    def _reset_batch(self) -> None:
        self._uses: dict[nn.Parameter, int] = {}
        self._reset_backward()

    def _reset_backward(self) -> None:
        self._sq: torch.Tensor | float = 0.0
        self._group_sq: dict[int, torch.Tensor] = {}
        self._tape: list = []
        self._materialized: dict[nn.Parameter, torch.Tensor] = {}
        self._queued = False
        self._phase = "ghost" if self.mode == "ghost" else self.clipping

    def begin_batch(self, clip_norms, mask=None, loss_scale: float = 1.0) -> None:
        """Start a batch of B = len(clip_norms) samples (padded rows have mask 0).

        loss_scale: how much the backward's output gradients are scaled down relative to
        per-sample losses (B for a loss that is the batch mean, 1 for a sum).
        """
        self.clip_norms = as_per_sample("clip_norms", clip_norms)
        self.batch_size = int(self.clip_norms.shape[0])
        self.mask = None if mask is None else as_per_sample("mask", mask, self.batch_size, positive=False)
        if self.mask is not None and not ((self.mask == 0) | (self.mask == 1)).all():
            raise ValueError("mask must hold only 0 and 1")
        self.loss_scale = float(loss_scale)
        self._reset_batch()

    def forward(self, module: DPModule, x: torch.Tensor) -> torch.Tensor:
        if self.batch_size is None:
            raise RuntimeError("a private forward needs a batch: iterate the data loader returned by "
                               "PrivacyEngine.make_private, or use pdpfast.functional.clipped_gradients")
        x = self._batch_first(module, x)
        prepared = module._prepare(x)
        params = dict(module.named_parameters(recurse=False))
        trainable = [p for p in params.values() if p.requires_grad]
        if not trainable:
            return module._unflatten(module._compute(prepared, params), prepared)
        for p in trainable:
            self._uses[p] = self._uses.get(p, 0) + 1
        out = module._compute(prepared, {n: p.detach() for n, p in params.items()})
        return module._unflatten(DPLayerFunction.apply(out, prepared, (self, module), *trainable), prepared)

    def _batch_first(self, module, x: torch.Tensor) -> torch.Tensor:
        B = self.batch_size
        n = x.shape[0] if x.dim() else None
        if n == B:
            return x
        if n == 1:  # e.g. position ids of shape (1, T) broadcast over the batch: make it per sample
            return x.expand(B, *x.shape[1:])
        raise ValueError(f"{self._names[module]} got an input of shape {tuple(x.shape)} but the batch has {B} "
                         "samples; DP layers need batch-first inputs (e.g. batch_first=True)")

    # ------------------------------------------------------------------ backward

    def on_backward(self, module: DPModule, x: torch.Tensor, o: torch.Tensor) -> None:
        phase = self._phase
        if phase == "ghost":
            raise RuntimeError("mode='ghost' needs two backward passes over per-sample losses: call backward() "
                               "on the loss returned by the criterion that make_private returned "
                               "(or use pdpfast.functional.clipped_gradients)")
        rule = rule_for(module)
        params = _trainable(module)
        # gradients arriving through views (e.g. attention's head split) are often strided; one copy
        # here instead of one in every reshape of every rule
        o = o.contiguous()
        if phase == "ghost_grads":  # the loss is already Σ w_i ℓ_i: plain gradients are the clipped sum
            self._accumulate(module, rule.clipped(module, x, o, None, tuple(params)))
            return
        if phase == "per_layer":
            k = self._group_of[module]
            reused = any(self._uses.get(p, 0) > 1 for p in self._group_params[k])
            deferred = list(params) if reused or rule.sq_norms is None else []
        elif rule.sq_norms is None:  # per-sample grads as small as the parameters: form them once
            deferred = list(params)
        else:
            deferred = [n for n, p in params.items() if self._uses.get(p, 0) > 1]
        if deferred:
            per_sample = rule.per_sample_grads(module, x, o)
            for n in deferred:
                p, g = params[n], per_sample[n]
                self._materialized[p] = g if p not in self._materialized else self._materialized[p] + g
        normal = tuple(n for n in params if n not in deferred)
        if normal:
            sq = sum(rule.norms(module, x, o, normal).values())
            if phase == "per_layer":
                k = self._group_of[module]
                self._group_sq[k] = sq + self._group_sq.get(k, 0.0)
                weights = self._weights(sq, self.shares[k])
                self._accumulate(module, rule.clipped(module, x, o, weights, normal))
            else:
                self._sq = self._sq + sq
                if phase == "flat":
                    self._tape.append((module, x, o, normal))
        if phase in ("flat", "per_layer") and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _weights(self, sq: torch.Tensor, share=None) -> torch.Tensor:
        """Clip weights applied to the backward's output gradients (loss scale folded in)."""
        s = self.loss_scale
        bounds = self.clip_norms.to(sq.device, sq.dtype)  # c_i·C_k in the norms' precision, not the input's
        if share is not None:
            bounds = bounds * float(share)
        mask = None if self.mask is None else self.mask.to(sq.device)
        return clip_weights(sq * (s * s), bounds, mask, self.automatic_gamma) * s

    def _materialized_sq(self, params) -> torch.Tensor | float:
        total = 0.0
        for p in params:
            g = self._materialized[p]
            total = total + g.flatten(1).to(torch.promote_types(g.dtype, torch.float32)).pow(2).sum(1)
        return total

    def _total_sq(self) -> torch.Tensor:
        total = self._sq + self._materialized_sq(list(self._materialized))
        if isinstance(total, float):  # no layer saw this batch's backward
            total = torch.zeros(self.batch_size, dtype=torch.float64)
        return total

    def _finish(self) -> None:
        """End of a backward (flat bk or per-layer): the clipped sums that needed every norm."""
        s = self.loss_scale
        if self._phase == "flat":
            total = self._total_sq()
            weights = self._weights(total)
            for module, x, o, names in self._tape:
                self._accumulate(module, rule_for(module).clipped(module, x, o, weights, names))
            for p, g in self._materialized.items():
                self._accumulate_param(p, torch.tensordot(weights.to(g.dtype), g, dims=1))
            self.last_weights = weights / s
        else:
            for k, params in enumerate(self._group_params):
                done = [p for p in params if p in self._materialized]
                if not done:
                    continue
                sq = self._materialized_sq(done)
                self._group_sq[k] = sq
                weights = self._weights(sq, self.shares[k])
                for p in done:
                    g = self._materialized[p]
                    self._accumulate_param(p, torch.tensordot(weights.to(g.dtype), g, dims=1))
            total = sum(self._group_sq.values()) if self._group_sq else torch.zeros(self.batch_size)
        self.last_norms = total.sqrt() * s
        self._reset_backward()

    def ghost_backward(self, losses: torch.Tensor) -> None:
        """Two backwards over per-sample losses (B,): norms, then Σ_i w_i ℓ_i."""
        if self.mode != "ghost":
            raise RuntimeError("ghost_backward is for mode='ghost'")
        if losses.dim() != 1 or losses.shape[0] != self.batch_size:
            raise ValueError(f"per-sample losses must have shape ({self.batch_size},), got {tuple(losses.shape)}")
        self._phase = "ghost_norms"
        try:
            losses.sum().backward(retain_graph=True)
            total = self._total_sq()
            weights = self._weights(total)
            self.last_norms, self.last_weights = total.sqrt(), weights
            self._materialized = {}
            self._phase = "ghost_grads"
            (losses * weights.to(losses.device, losses.dtype)).sum().backward()
        finally:
            self._reset_backward()

    # ------------------------------------------------------------------ gradients

    def _accumulate(self, module: nn.Module, grads: dict) -> None:
        for name, g in grads.items():
            self._accumulate_param(getattr(module, name), g)

    @staticmethod
    @torch.no_grad()
    def _accumulate_param(p: nn.Parameter, g: torch.Tensor) -> None:
        g = g.detach().to(p.dtype).reshape(p.shape)
        if p.grad is None:
            p.grad = g.clone() if g.data_ptr() == p.data_ptr() else g.contiguous()
        else:
            p.grad.add_(g)
