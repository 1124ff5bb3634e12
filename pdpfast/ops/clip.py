"""Clip weights from per-sample squared norms (DESIGN.md §1.3)."""
from __future__ import annotations

import torch

from .dispatch import pick

CLIP_EPS = 1e-6


def clip_weights_reference(sq_norms: torch.Tensor, clip_norms: torch.Tensor, mask: torch.Tensor | None = None,
                           automatic_gamma: float | None = None) -> torch.Tensor:
    """w_i = m_i · min(1, c_i / (‖g_i‖ + 1e-6)), or m_i · c_i / (‖g_i‖ + γ) with automatic clipping.

    sq_norms: (B,) or (K, B) squared norms (K clipping groups); clip_norms: (B,) or (K, B) bounds
    broadcast against them; mask: (B,) 0/1. Returns weights shaped like ``sq_norms``.
    """
    norms = sq_norms.clamp_min(0).sqrt()
    clip_norms = clip_norms.to(norms.dtype)
    if automatic_gamma is None:
        weights = (clip_norms / (norms + CLIP_EPS)).clamp(max=1.0)
    else:
        weights = clip_norms / (norms + automatic_gamma)
    if mask is not None:
        weights = weights * mask.to(weights.dtype)
    return weights


def clip_weights(sq_norms, clip_norms, mask=None, automatic_gamma=None):
    fn = pick("clip_weights", clip_weights_reference, sq_norms, clip_norms)
    return fn(sq_norms, clip_norms, mask, automatic_gamma)
