"""Functional entry point: the clipped per-sample gradient sum of one batch."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ._checks import as_per_sample
from .clipping import ClippingState


@dataclass
class ClippedGradients:
    """What ``clipped_gradients`` returns.

    Args:
        grads: {parameter name: Σ_i w_i g_i}, each of its parameter's shape and dtype (no noise, no
            normalization; zeros for a trainable parameter no record reached).
        norms: (B,) per-sample gradient norms ‖g_i‖ before clipping (total over all parameters), in
            units of the per-sample loss's gradient.
        weights: (B,) flat clip weights w_i (None for per-layer clipping, where each group has its own).
    """

    grads: dict[str, torch.Tensor]
    norms: torch.Tensor
    weights: torch.Tensor | None = None


def clipped_gradients(model: nn.Module, loss_fn: Callable, *inputs, clip_norms, mask=None,
                      clipping: str = "flat", mode: str = "bk", layer_shares=None,
                      automatic_gamma: float | None = None) -> ClippedGradients:
    """Σ_i w_i g_i for one batch, with per-sample clip bounds.

    The model's existing ``.grad`` fields are left as they were.

    Args:
        model: converted with ``pdpfast.nn.convert``, in training mode; ``model(*inputs)`` is batch-first.
        loss_fn: ``loss_fn(outputs)`` → per-sample losses, a (B,) tensor (not reduced).
        *inputs: the batch, tensors of B rows each (non-tensor arguments are passed through).
        clip_norms: (B,) bounds c_i > 0, a 1-D tensor or array (it sets B; a Python number is refused).
        mask: optional (B,) 0/1; rows with 0 contribute nothing (padding of fixed-shape batches).
        clipping: "flat" | "per_layer".
        mode: "bk" | "ghost".
        layer_shares: per-layer shares C_k (Σ C_k² = 1), as ``ClippingState``'s.
        automatic_gamma: γ > 0 for automatic clipping, w_i = c_i/(‖g_i‖+γ); None for standard clipping.
    Returns:
        ``ClippedGradients``: {parameter name: Σ_i w_i g_i} (no noise, no normalization), the (B,)
        per-sample norms ‖g_i‖ and the (B,) clip weights w_i (None for per-layer clipping).
    Raises:
        ValueError for an input whose dim 0 is not B, a DP layer with trainable parameters in eval mode,
        losses not of shape (B,), bad clip norms or mask, and what ``ClippingState`` refuses (an unknown
        mode or clipping, bad shares, an unconverted model); TypeError for a scalar ``clip_norms``.
    """
    clip_norms = as_per_sample("clip_norms", clip_norms)
    for k, x in enumerate(inputs):
        # the batch size comes from clip_norms; a mismatched input would otherwise be broadcast
        # (a 1-row input looks like a (1, T) position tensor to the DP layers) or fail deep inside
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] != clip_norms.shape[0]:
            raise ValueError(f"clip_norms has {clip_norms.shape[0]} values (one per sample) but input {k} has "
                             f"shape {tuple(x.shape)}; inputs must be batch-first with one row per sample")
    state = ClippingState(model, mode=mode, clipping=clipping, layer_shares=layer_shares,
                          automatic_gamma=automatic_gamma)
    # a DP layer in eval mode runs as the plain torch layer (so evaluation needs no batch), and its
    # weights would get ordinary, unclipped gradients: refuse rather than leak
    in_eval = [name or "<model>" for name, m in model.named_modules()
               if m in state.layers and not m.training and any(p.requires_grad for p in m.parameters(recurse=False))]
    if in_eval:
        raise ValueError("clipped_gradients needs the model in training mode (model.train()): DP layers in eval "
                         "mode compute ordinary, unclipped gradients. Layers in eval mode: " + ", ".join(in_eval))
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    saved = {n: p.grad for n, p in params.items()}
    for p in params.values():
        p.grad = None
    try:
        with state.attached():
            state.begin_batch(clip_norms, mask)
            losses = loss_fn(model(*inputs))
            if not isinstance(losses, torch.Tensor) or losses.shape != (state.batch_size,):
                shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
                raise ValueError(f"loss_fn must return per-sample losses of shape ({state.batch_size},), got {shape}")
            if mode == "ghost":
                state.ghost_backward(losses)
            else:
                losses.sum().backward()
        grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in params.items()}
        weights = getattr(state, "last_weights", None) if clipping == "flat" else None
        # no DP layer reached: every norm is 0, on the losses' device
        norms = state.last_norms if state.last_norms is not None else torch.zeros(state.batch_size,
                                                                                  device=losses.device)
        return ClippedGradients(grads, norms, weights)
    finally:
        for n, p in params.items():
            p.grad = saved[n]
