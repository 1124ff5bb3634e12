"""Clip weights from per-sample squared norms (DESIGN.md §1.3): the one definition of the formula."""
from __future__ import annotations

import torch

CLIP_EPS = 1e-6


def clip_weights(sq_norms: torch.Tensor, clip_norms: torch.Tensor, mask: torch.Tensor | None = None,
                 automatic_gamma: float | None = None, loss_scale: float = 1.0) -> torch.Tensor:
    """w_i = m_i · min(1, c_i / (‖g_i‖ + 1e-6)), or m_i · c_i / (‖g_i‖ + γ) with automatic clipping.

    With a loss scale s the norms are of gradients scaled down by s (a mean loss over s rows) and the
    result multiplies those gradients, so s·w_i is returned, computed as min(s, c_i / (√sq + ε/s)):
    five tensor ops, no host synchronisation.

    Args:
        sq_norms: (B,) or (K, B) float per-sample squared norms ‖g_i‖² (K clipping groups); negative
            rounding errors count as 0.
        clip_norms: the bounds c_i ≥ 0 in the units of ‖g_i‖, (B,) or (K, B): any shape that broadcasts
            against ``sq_norms``; cast to its dtype. Masked rows may carry bound 0 instead of a mask.
        mask: None, or (B,) 0/1 (any dtype) that zeroes the weights of padded rows.
        automatic_gamma: None for standard clipping, γ > 0 for automatic clipping c_i / (‖g_i‖ + γ).
        loss_scale: s ≥ 0, the rows a mean loss divides by (1.0 for a summed loss); 0 (an empty batch
            under a mean loss) gives all-zero weights.
    Returns:
        the weights s·w_i, shaped like ``sq_norms`` and ``clip_norms`` broadcast together (like
        ``sq_norms`` when s = 0), in ``sq_norms``' dtype.
    """
    if loss_scale == 0:  # an empty batch under a mean loss: nothing to weigh
        return torch.zeros_like(sq_norms)
    clip_norms = clip_norms.to(sq_norms.dtype) if clip_norms.dtype != sq_norms.dtype else clip_norms
    root = sq_norms.clamp_min(0).sqrt_()
    # in place where the bounds do not broadcast the result larger (torch.broadcast_shapes is a
    # Python function that costs more than the division on small tensors)
    out = root if root.shape == clip_norms.shape else None
    if automatic_gamma is None:
        weights = torch.div(clip_norms, root.add_(CLIP_EPS / loss_scale), out=out).clamp_(max=loss_scale)
    else:
        weights = torch.div(clip_norms, root.add_(automatic_gamma / loss_scale), out=out)
    if mask is not None:
        weights = weights * mask.to(weights.dtype)
    return weights
