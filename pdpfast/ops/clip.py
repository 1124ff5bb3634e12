"""Clip weights from per-sample squared norms (DESIGN.md §1.3): the one definition of the formula.

Where ``pdpfast._C`` has it, the formula runs as one call (``csrc/clip.cpp``, and ``clip_cuda.cu``
on a GPU) instead of five tensor ops: per-layer clipping computes weights once per layer call, and
on B values each op is all launch cost. Its steps are correctly rounded; torch's CPU square root is
not always, so the routes agree to 4 eps relative (``tests/test_clip_weights.py``).
"""
from __future__ import annotations

import math

import torch

from .. import _ext

CLIP_EPS = 1e-6

_C = _ext._C
_FUSED_MISSING = _ext.missing("clip_weights", "clip.cpp")
_FUSED_DTYPES = (torch.float32, torch.float64)
_FUSED = "C++ kernel"
_TAKES_ROUNDING = getattr(_C, "clip_takes_rounding", False)
_TAKES_PARTS = getattr(_C, "clip_takes_parts", False)
_REBUILD = "rebuild with `pip install --no-build-isolation -e .`"


def clip_weights_route(sq_norms: torch.Tensor, clip_norms: torch.Tensor, mask: torch.Tensor | None = None,
                       rounding: torch.Tensor | None = None, parts: bool = False) -> str:
    """Which route ``clip_weights`` takes for these tensors.

    Args:
        sq_norms, clip_norms, mask, rounding, parts: as in ``clip_weights``.
    Returns:
        "C++ kernel" when ``pdpfast._C`` computes the weights in one call (``sq_norms`` (less its
        last dim, with ``parts``), ``clip_norms`` and ``rounding`` of one shape and dtype, fp32 or
        fp64, no separate mask, CPU tensors or CUDA tensors with a CUDA build); otherwise
        "torch (<why>)".
    """
    if _FUSED_MISSING is not None:
        return f"torch ({_FUSED_MISSING})"
    if mask is not None:
        return "torch (a separate mask: the engine folds it into the bounds)"
    if parts and not _TAKES_PARTS:
        return f"torch (pdpfast._C predates the parts argument; {_REBUILD})"
    if (sq_norms.shape[:-1] if parts else sq_norms.shape) != clip_norms.shape or sq_norms.dtype != clip_norms.dtype:
        return "torch (bounds that broadcast or have another dtype)"
    if rounding is not None:
        if not _TAKES_ROUNDING:
            return f"torch (pdpfast._C predates the rounding argument; {_REBUILD})"
        if rounding.shape != clip_norms.shape or rounding.dtype != sq_norms.dtype:
            return "torch (a rounding bound of another shape or dtype)"
    if sq_norms.dtype not in _FUSED_DTYPES:
        return f"torch (dtype {sq_norms.dtype})"
    if sq_norms.requires_grad or clip_norms.requires_grad:
        return "torch (inputs that require grad: the C++ op has no backward)"
    if sq_norms.device.type == "cuda" and not _C.clip_with_cuda:
        return "torch (pdpfast._C was built without CUDA)"
    if sq_norms.device.type not in ("cpu", "cuda"):
        return f"torch (device {sq_norms.device.type})"
    return _FUSED


def clip_weights(sq_norms: torch.Tensor, clip_norms: torch.Tensor, mask: torch.Tensor | None = None,
                 automatic_gamma: float | None = None, loss_scale: float = 1.0,
                 rounding: torch.Tensor | None = None, parts: bool = False) -> torch.Tensor:
    """w_i = m_i · min(1, c_i / (‖g_i‖ + ρ_i + 1e-6)), or m_i · c_i / (‖g_i‖ + ρ_i + γ) with automatic clipping.

    ρ_i (``rounding``, 0 when None) bounds how far a low-precision clipped sum's rounding can take
    record i's contribution from w_i·g_i (``pdpfast.nn.rules.LayerRule.rounding``): with it the
    rounded contribution stays within c_i.

    With a loss scale s the norms are of gradients scaled down by s (a mean loss over s rows) and the
    result multiplies those gradients, so s·w_i is returned, computed as min(s, c_i / (√sq + ε/s)):
    one call of ``pdpfast._C`` (``clip_weights_route``) or five tensor ops, no host synchronisation.

    Args:
        sq_norms: (B,) or (K, B) float per-sample squared norms ‖g_i‖² (K clipping groups); negative
            rounding errors count as 0.
        clip_norms: the bounds c_i ≥ 0 in the units of ‖g_i‖, (B,) or (K, B): any shape that broadcasts
            against ``sq_norms``; cast to its dtype. Masked rows may carry bound 0 instead of a mask.
        mask: None, or (B,) 0/1 (any dtype) that zeroes the weights of padded rows.
        automatic_gamma: None for standard clipping, γ > 0 for automatic clipping c_i / (‖g_i‖ + γ).
        loss_scale: s ≥ 0, the rows a mean loss divides by (1.0 for a summed loss); 0 (an empty batch
            under a mean loss) gives all-zero weights.
        rounding: None, or ρ_i ≥ 0 in the units of ‖g_i‖, shaped like ``sq_norms`` (less its last
            dim, with ``parts``).
        parts: ``sq_norms`` has one more trailing dim than the norms, (..., K): partial sums (a norm
            kernel's per-program sums), added up here, in the same call on the C++ route.
    Returns:
        the weights s·w_i, shaped like ``sq_norms`` (the summed norms, with ``parts``) and
        ``clip_norms`` broadcast together (like those norms when s = 0), in ``sq_norms``' dtype.
    """
    if loss_scale != 0 and clip_weights_route(sq_norms, clip_norms, mask, rounding, parts) == _FUSED:
        if automatic_gamma is None:
            return _C.clip_weights(sq_norms, clip_norms, CLIP_EPS / loss_scale, loss_scale, rounding, parts)
        return _C.clip_weights(sq_norms, clip_norms, automatic_gamma / loss_scale, math.inf, rounding, parts)
    if parts:
        sq_norms = sq_norms.sum(-1)
    return clip_weights_reference(sq_norms, clip_norms, mask, automatic_gamma, loss_scale, rounding)


def clip_weights_reference(sq_norms: torch.Tensor, clip_norms: torch.Tensor, mask: torch.Tensor | None = None,
                           automatic_gamma: float | None = None, loss_scale: float = 1.0,
                           rounding: torch.Tensor | None = None) -> torch.Tensor:
    """``clip_weights`` in five torch ops (six with ``rounding``), on any inputs: the route where the
    C++ op does not apply.

    Args:
        sq_norms, clip_norms, mask, automatic_gamma, loss_scale, rounding: as in ``clip_weights``.
    Returns:
        the weights s·w_i, as ``clip_weights``.
    """
    if loss_scale == 0:  # an empty batch under a mean loss: nothing to weigh
        return torch.zeros_like(sq_norms)
    clip_norms = clip_norms.to(sq_norms.dtype) if clip_norms.dtype != sq_norms.dtype else clip_norms
    root = sq_norms.clamp_min(0).sqrt_()
    if rounding is not None:
        root = root.add_(rounding.to(root.dtype))
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
