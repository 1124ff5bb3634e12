"""Clip weights from per-sample squared norms (DESIGN.md §1.3): the one definition of the formula.

Where ``pdpfast._C`` has it, the formula runs as one call (``csrc/clip.cpp``, and ``clip_cuda.cu``
on a GPU) instead of five tensor ops: per-layer clipping computes weights once per layer call, and
on B values each op is all launch cost. Its steps are correctly rounded; torch's CPU square root is
not always, so the routes agree to 4 eps relative (``tests/test_clip_weights.py``).

A call's weights may also be left uncomputed (``PendingWeights``) for the op that applies them:
``clip_scale`` computes them and scales a tensor's rows by them in one call, which is how per-layer
clipping weighs a linear call (three ops become one: the weights, their cast to a low precision,
the row scaling of the clipped sum).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .. import _ext

CLIP_EPS = 1e-6

_C = _ext._C
_FUSED_MISSING = _ext.missing("clip_weights", "clip.cpp")
_FUSED_DTYPES = (torch.float32, torch.float64)
_SCALE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)  # of x in clip_scale
_FUSED = "C++ kernel"
_TAKES_ROUNDING = getattr(_C, "clip_takes_rounding", False)
_TAKES_PARTS = getattr(_C, "clip_takes_parts", False)
# clip_scale came with rounding bounds as partial sums too (in both ops)
_SCALE_MISSING = _ext.missing("clip_scale", "clip.cpp")
_REBUILD = "rebuild with `pip install --no-build-isolation -e .`"


def _requires_grad(*tensors) -> bool:
    """Whether grad mode is on and one of ``tensors`` (None counts as not) requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``target`` without enlarging it."""
    return len(shape) <= len(target) and all(a in (1, b) for a, b in zip(reversed(shape), reversed(target)))


def weights_to(weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Clip weights cast to the dtype of the gradients they scale: to nearest, except fp16 toward zero.

    Below fp16's smallest normal (2^-14, a record whose gradient is ~10^4x its bound) fp16 rounds in
    absolute steps of 2^-24: a weight rounded to nearest could grow by 2^-25, and times the record's
    unclipped gradient ‖g_i‖ ≈ c_i / w_i that is 2^-25 / w_i of c_i (19% at w_i = 1e-7), beyond any
    relative margin. Rounded toward zero it never grows: w̃_i ≤ w_i, so w̃_i‖g_i‖ ≤ c_i. bf16 (fp32's
    exponent range) and wider dtypes round to nearest, the fixed margin covering them.
    ``csrc/clip_weight.h``'s ``weight_as`` is the C++ twin.

    Args:
        weights: (B,) or any shape, w_i ≥ 0 in fp32 or fp64.
        dtype: the gradients' dtype.
    Returns:
        the weights in ``dtype`` (``weights`` itself where already of it).
    """
    if weights.dtype == dtype:
        return weights
    cast = weights.to(dtype)
    if dtype != torch.float16:
        return cast
    grew = cast.to(weights.dtype) > weights  # exact: fp16 widens exactly
    return torch.where(grew, torch.nextafter(cast, cast.new_zeros(())), cast)


def clip_weights_route(sq_norms: torch.Tensor, clip_norms: torch.Tensor, mask: torch.Tensor | None = None,
                       rounding: torch.Tensor | None = None, parts: bool = False) -> str:
    """Which route ``clip_weights`` takes for these tensors.

    Args:
        sq_norms, clip_norms, mask, rounding, parts: as in ``clip_weights``.
    Returns:
        "C++ kernel" when ``pdpfast._C`` computes the weights in one call (``sq_norms`` (less its
        last dim, with ``parts``), ``clip_norms`` and ``rounding`` of one shape and dtype, fp32 or
        fp64, no separate mask, CPU tensors or CUDA tensors with a CUDA build, none requiring grad
        while grad mode is on); otherwise "torch (<why>)".
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
        rounding_parts = parts and rounding.dim() == sq_norms.dim()
        if rounding_parts and _SCALE_MISSING is not None:
            return f"torch (pdpfast._C predates rounding bounds as partial sums; {_REBUILD})"
        if (rounding.shape[:-1] if rounding_parts else rounding.shape) != clip_norms.shape or \
                rounding.dtype != sq_norms.dtype:
            return "torch (a rounding bound of another shape or dtype)"
    if sq_norms.dtype not in _FUSED_DTYPES:
        return f"torch (dtype {sq_norms.dtype})"
    if _requires_grad(sq_norms, clip_norms, rounding):
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
            to ``sq_norms``' shape (not to a larger one: a ValueError); cast to its dtype. Masked rows may
            carry bound 0 instead of a mask.
        mask: None, or (B,) 0/1 (any dtype) that zeroes the weights of padded rows.
        automatic_gamma: None for standard clipping, γ > 0 for automatic clipping c_i / (‖g_i‖ + γ).
        loss_scale: s ≥ 0, the rows a mean loss divides by (1.0 for a summed loss); 0 (an empty batch
            under a mean loss) gives all-zero weights.
        rounding: None, or ρ_i ≥ 0 in the units of ‖g_i‖, shaped like ``sq_norms`` (with ``parts``,
            like it or like it less its last dim: partial sums or not), or broadcasting to that shape.
        parts: ``sq_norms`` has one more trailing dim than the norms, (..., K): partial sums (a norm
            kernel's per-program sums), added up here, in the same call on the C++ route.
    Returns:
        the weights s·w_i, shaped like ``sq_norms`` (the summed norms, with ``parts``), in its dtype.
    """
    if parts and sq_norms.dim() < clip_norms.dim() + 1:
        raise ValueError(f"parts=True: sq_norms must have clip_norms' dims and a trailing dim of partial sums, got "
                         f"sq_norms of shape {tuple(sq_norms.shape)} and clip_norms of shape {tuple(clip_norms.shape)}")
    if loss_scale != 0 and clip_weights_route(sq_norms, clip_norms, mask, rounding, parts) == _FUSED:
        if automatic_gamma is None:
            return _C.clip_weights(sq_norms, clip_norms, CLIP_EPS / loss_scale, loss_scale, rounding, parts)
        return _C.clip_weights(sq_norms, clip_norms, automatic_gamma / loss_scale, math.inf, rounding, parts)
    # (the C++ route takes equal shapes alone: ``clip_weights_route``)
    if rounding is not None and rounding.shape != sq_norms.shape and \
            not _broadcasts_to(rounding.shape, sq_norms.shape[:-1] if parts else sq_norms.shape):
        raise ValueError(f"rounding must be shaped like sq_norms{' (or like it less its last dim)' if parts else ''} "
                         f"or broadcast to that shape, got rounding of shape {tuple(rounding.shape)} and sq_norms of "
                         f"shape {tuple(sq_norms.shape)}")
    if parts:
        if rounding is not None and rounding.dim() == sq_norms.dim():
            rounding = rounding.sum(-1)
        sq_norms = sq_norms.sum(-1)
    return clip_weights_reference(sq_norms, clip_norms, mask, automatic_gamma, loss_scale, rounding)


class PendingWeights(NamedTuple):
    """Clip weights not yet computed: ``clip_weights``' arguments (no mask: the bounds carry it),
    for the op that applies them to compute them in the same call (``clip_scale``). Per-layer
    clipping hands a call's weights over this way: that call's clipped sum is their only use.

    ``tensor()`` computes them apart, for a rule that needs them as a tensor.
    """

    sq_norms: torch.Tensor
    clip_norms: torch.Tensor
    automatic_gamma: float | None = None
    loss_scale: float = 1.0
    rounding: torch.Tensor | None = None
    parts: bool = False

    def tensor(self) -> torch.Tensor:
        """The weights, computed apart.

        Returns:
            s·w_i, as ``clip_weights`` returns them for these arguments.
        """
        return clip_weights(self.sq_norms, self.clip_norms, None, self.automatic_gamma, self.loss_scale,
                            self.rounding, self.parts)


def clip_scale_route(x: torch.Tensor, weights: PendingWeights) -> str:
    """Which route ``clip_scale`` takes.

    Args:
        x, weights: as in ``clip_scale``.
    Returns:
        "C++ kernel" where ``pdpfast._C.clip_scale`` computes the weights and scales ``x`` in one call
        (``clip_weights_route`` holds with (B,) bounds, x float32/float64/float16/bfloat16 on the norms'
        device, the norms float64 for a float64 x, else float32, nothing requiring grad while grad mode
        is on: a backward runs without it); otherwise "torch (<why>)".
    """
    if _SCALE_MISSING is not None:
        return f"torch ({_SCALE_MISSING})"
    if weights.loss_scale == 0:
        return "torch (loss scale 0: an empty batch under a mean loss, all-zero weights)"
    route = clip_weights_route(weights.sq_norms, weights.clip_norms, None, weights.rounding, weights.parts)
    if route != _FUSED:
        return route
    if weights.clip_norms.dim() != 1 or x.dim() == 0 or x.shape[0] != weights.clip_norms.shape[0]:
        return "torch (bounds that are not one per row of x)"
    if x.dtype not in _SCALE_DTYPES:
        return f"torch (x of dtype {x.dtype})"
    if weights.sq_norms.dtype != (torch.float64 if x.dtype == torch.float64 else torch.float32):
        return "torch (norms of another precision than x's products)"
    if x.device != weights.sq_norms.device:
        return "torch (x on another device than its norms)"
    if x.requires_grad and torch.is_grad_enabled():  # (a layer's saved input does, in its backward)
        return "torch (x requires grad: the C++ op has no backward)"
    return _FUSED


def fused_scale_args(weights: PendingWeights) -> tuple:
    """The arguments after x of ``pdpfast._C.clip_scale`` (and of the C++ ops that call it) for these
    weights.

    Args:
        weights: the rows' ``PendingWeights``.
    Returns:
        (sq_norms, clip_norms, offset, cap, rounding, parts): s·w_i computed as min(cap, c_i / (√sq +
        offset)), with offset ε/s and cap s, or with automatic clipping γ/s and no cap (inf).
    """
    sq, bounds, gamma, s, rounding, parts = weights
    if gamma is None:
        return sq, bounds, CLIP_EPS / s, s, rounding, parts
    return sq, bounds, gamma / s, math.inf, rounding, parts


def clip_scale(x: torch.Tensor, weights: PendingWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """x_i · w_i for every row i, with the weights computed in the same call: one op of
    ``pdpfast._C`` (``clip_scale_route``) where three ran (the weights, their cast to x's dtype, the
    product), no host synchronisation.

    Args:
        x: (B, ...) the tensor whose rows are scaled (a linear call's output gradients or inputs).
        weights: the B rows' ``PendingWeights``, (B,) bounds.
    Returns:
        (scaled, w): scaled like x (contiguous) and w (B,) the weights s·w_i in x's dtype (``weights_to``:
        toward zero in fp16), each product x·w rounded once: what ``x * weights_to(weights.tensor(),
        x.dtype)`` gives, bit for bit, where the weights are computed alike (``clip_weights_route``).
    """
    if clip_scale_route(x, weights) == _FUSED:
        return _C.clip_scale(x, *fused_scale_args(weights))
    w = weights.tensor()
    if w.dim() != 1 or x.dim() == 0 or w.shape[0] != x.shape[0]:
        rows = x.shape[0] if x.dim() else "?"
        raise ValueError(f"clip_scale weighs the rows of x: it needs one weight per row, (B,) = ({rows},), "
                         f"got weights of shape {tuple(w.shape)} (from clip_norms of shape "
                         f"{tuple(weights.clip_norms.shape)}) for x of shape {tuple(x.shape)}")
    w = weights_to(w, x.dtype)
    return (x * w.view(-1, *([1] * (x.dim() - 1)))).contiguous(), w


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
    if sq_norms.dtype == torch.float16:
        # ε/s underflows in fp16 for s ≳ 34: a masked row's 0 / 0 would be NaN (fp32 inside, fp16 out)
        return weights_to(clip_weights_reference(sq_norms.float(), clip_norms, mask, automatic_gamma, loss_scale,
                                                 rounding), torch.float16)
    clip_norms = clip_norms.to(sq_norms.dtype) if clip_norms.dtype != sq_norms.dtype else clip_norms
    if _requires_grad(sq_norms, clip_norms, rounding):
        # out of place, for autograd (the in-place ops below serve the no-grad route)
        root = sq_norms.clamp_min(0).sqrt()
        if rounding is not None:
            root = root + rounding.to(root.dtype)
        if automatic_gamma is None:
            weights = (clip_norms / (root + CLIP_EPS / loss_scale)).clamp(max=loss_scale)
        else:
            weights = clip_norms / (root + automatic_gamma / loss_scale)
        return weights if mask is None else weights * mask.to(weights.dtype)
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
    if out is None and weights.shape != root.shape:
        raise ValueError(f"clip_norms of shape {tuple(clip_norms.shape)} broadcast the weights to "
                         f"{tuple(weights.shape)}, larger than sq_norms' {tuple(root.shape)}: give one bound per "
                         f"norm, or bounds that broadcast to the norms' shape")
    if mask is not None:
        weights = weights * mask.to(weights.dtype)
    return weights
