"""Conv1d / Conv2d per-sample norms and clipped gradients (DESIGN.md §2).

Unfolding (im2col) turns a convolution into the linear case: per group g, a_i ∈ R^{L×(C_in/G·k)}
and o_i ∈ R^{L×(C_out/G)} with L output positions, and the per-sample squared norm is the sum over
groups of the linear norms. The clipped sum needs no unfolding: it is the ordinary weight gradient
of the convolution with output-gradient rows scaled by w_i.

Inputs are the padded activations (``conv_pad``), so stride, dilation, groups, padding="same"
and every padding_mode reduce to one unfold with zero padding — or, with ``padding=`` (symmetric
zero padding per spatial dim), the unpadded activations: the DP layers keep those where the
convolution can pad itself, since a padded copy of every conv input costs a full pass (and its
gradient another) on a CPU. The ops then pad inside their own routines (unfold, the weight-gradient
routine), and so does the fused kernel (masked loads: taps in the padding read as zeros).

``conv_weight_sq_norms`` dispatches (``pdpfast.ops.dispatch``): on CUDA (and under
``TRITON_INTERPRET=1``) the fused kernel ``pdpfast.kernels.conv_norms.conv_weight_sq_norms`` does
the unfolding inside the kernel and materializes neither per-sample gradients nor the unfolded
input; elsewhere ``conv_weight_sq_norms_reference`` runs.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import workspace
from .clip import PendingWeights, clip_scale
from .dispatch import declare
from .linear import acc_dtype, linear_weight_sq_norms, scaled_row_dot, tf32_slack, weights_as


def conv_pad(x: torch.Tensor, module: torch.nn.modules.conv._ConvNd) -> torch.Tensor:
    """The input padded exactly as ``module`` pads it (ints, "same", "valid", any padding_mode).

    Args:
        x: (B, C_in, *spatial) the convolution's input.
        module: the convolution (its ``_reversed_padding_repeated_twice`` and ``padding_mode``).
    Returns:
        (B, C_in, *padded spatial), a padded copy in ``x``'s dtype, or ``x`` itself when the module
        does not pad.
    """
    pads = module._reversed_padding_repeated_twice
    if not any(pads):
        return x
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(x, pads, mode=mode)


def as_conv2d(x: torch.Tensor, o: torch.Tensor, module):
    """Conv1d tensors as Conv2d ones with a height of 1 (views, no copy).

    Args:
        x: (B, C_in, W) (Conv1d) or (B, C_in, H, W) (Conv2d) input.
        o: (B, C_out, OW) or (B, C_out, OH, OW), the gradient w.r.t. the convolution output.
        module: supplies ``kernel_size``, ``stride`` and ``dilation``.
    Returns:
        (x, o, kernel_size, stride, dilation): x (B, C_in, H, W) and o (B, C_out, OH, OW) (H = OH = 1
        for Conv1d), each of the last three a pair (1, k) for Conv1d.
    """
    if x.dim() == 3:
        return x.unsqueeze(2), o.unsqueeze(2), (1, *module.kernel_size), (1, *module.stride), (1, *module.dilation)
    return x, o, module.kernel_size, module.stride, module.dilation


def _padding(padding, n: int) -> list[int]:
    """The zero padding still to apply, one int per spatial dim (none: [0] * n)."""
    return [0] * n if padding is None else [int(v) for v in padding]


def pad_input(x: torch.Tensor, padding) -> torch.Tensor:
    """``x`` with ``padding`` (symmetric zeros, one int per spatial dim, or None) applied.

    Args:
        x: (B, C, *spatial).
        padding: None, or one int ≥ 0 per spatial dim, the zeros added on both sides of that dim.
    Returns:
        (B, C, *padded spatial), a copy; ``x`` itself when there is nothing to pad.
    """
    if padding is None or not any(padding):
        return x
    return F.pad(x, [v for v in reversed(padding) for _ in range(2)])


def conv_as_linear(x_pad: torch.Tensor, o: torch.Tensor, module, padding=None):
    """(a, o) of the equivalent linear layers, one per (sample, group), by im2col (``F.unfold``).

    Args:
        x_pad: (B, C_in, [H,] W) Conv1d/Conv2d input, padded by ``conv_pad`` (or not, see ``padding``).
        o: (B, C_out, [OH,] OW) gradient of the summed loss w.r.t. the convolution output.
        module: supplies ``groups`` G, ``kernel_size``, ``stride`` and ``dilation``.
        padding: zero padding still to apply to ``x_pad`` (see the module docstring), or None.
    Returns:
        (a, o): a (B·G, L, d_g) in ``x_pad``'s dtype and o (B·G, L, p_g) in ``o``'s dtype, with L = OH·OW
        output positions, d_g = C_in/G · kh·kw and p_g = C_out/G; row b·G + g is sample b, group g.
    """
    B, G = x_pad.shape[0], module.groups
    cols, o2 = _unfold(x_pad, o, module, padding)
    L, d_g, p_g = cols.shape[-1], cols.shape[1] // G, o.shape[1] // G
    a = cols.reshape(B, G, d_g, L).transpose(2, 3).reshape(B * G, L, d_g)
    out = o2.reshape(B, G, p_g, L).transpose(2, 3).reshape(B * G, L, p_g)
    return a, out


def _unfold(x_pad, o, module, padding=None):
    """(cols (B, C_in·kh·kw, L), o (B, C_out, L) as a view): im2col of a Conv1d/2d input, rows ordered
    as the weight's (C_in/G, kh, kw) within each group, as ``F.unfold`` orders them.

    The columns are one strided view of the padded input (kernel offsets and output positions are
    both steps through it) copied once: on a CPU 5-10x faster than ``F.unfold`` (batch 64, 3 x 32 x 32,
    3x3: 0.17 against 1.8 ms on one thread).
    """
    x2, o2, kernel, stride, dilation = as_conv2d(pad_input(x_pad, padding), o, module)
    B, C, OH, OW = x2.shape[0], x2.shape[1], o2.shape[2], o2.shape[3]
    sB, sC, sH, sW = x2.stride()
    cols = x2.as_strided((B, C, *kernel, OH, OW), (sB, sC, dilation[0] * sH, dilation[1] * sW, stride[0] * sH,
                                                   stride[1] * sW), x2.storage_offset())
    return cols.reshape(B, C * kernel[0] * kernel[1], OH * OW), o2.flatten(2)


# Above this many unfolded elements per batch, CPU im2col is slower than letting the
# convolution's own weight-gradient routine produce per-sample gradients (measured on the
# GroupNorm CNN benchmark: 3-13x for 32-64 channel layers at 16-32 px).
_UNFOLD_LIMIT = 1 << 22
# The implicit Gram norm is taken where its multiply-adds are at most this fraction of the direct
# form's: its batched GEMMs are small (P×C_g by C_g×P), so it needs a margin. One thread, batch 64:
# 64->128 at 8 px (a quarter of the direct work) 4.0 ms against 5.9-7.0 for the other routes;
# 256->256 at 8 px 8 ms and 512->512 at 4 px 2 ms, where the weight gradient alone takes 25-28 ms;
# 128->256 stride 2 at 16 px (0.76 of the direct work) no faster, so it is left to the others.
_GRAM_FRACTION = 0.5


def _implicit_gram_costs(x_shape, o_shape, module) -> tuple[int, int]:
    """(implicit Gram, direct) multiply-adds per sample of one Conv1d/Conv2d call.

    Args:
        x_shape: the padded input's shape (B, C_in, [H_p,] W_p); o_shape: the output gradient's.
        module: supplies ``groups`` and ``kernel_size``.
    Returns:
        (G·(P²·C_g + L²·p_g + k·L²), G·L·C_g·k·p_g): P padded input positions, L output positions,
        k = kh·kw taps, C_g and p_g the input and output channels of a group.
    """
    G, k = module.groups, math.prod(module.kernel_size)
    P, L = math.prod(x_shape[2:]), math.prod(o_shape[2:])
    C_g, p_g = x_shape[1] // G, o_shape[1] // G
    return G * (P * P * C_g + L * L * (p_g + k)), G * L * C_g * k * p_g


def implicit_gram_pays(x_pad: torch.Tensor, o: torch.Tensor, module, padding=None) -> bool:
    """Whether the CPU norms of this call take the implicit Gram form (``_implicit_gram_sq_norms``).

    Args:
        x_pad: (B, C_in, *spatial) Conv1d/2d/3d input, padded by ``conv_pad`` (or not, see ``padding``).
        o: (B, C_out, *out_spatial) the output gradient.
        module: supplies ``groups`` and ``kernel_size``.
        padding: None, or one int per spatial dim, the zero padding still to apply to ``x_pad``.
    Returns:
        True for a non-empty Conv1d/Conv2d call whose implicit Gram costs at most ``_GRAM_FRACTION``
        of the direct form's multiply-adds (``_implicit_gram_costs``); False otherwise (Conv3d too).
    """
    if x_pad.shape[0] == 0 or x_pad.dim() == 5:
        return False
    shape = x_pad.shape if padding is None else (*x_pad.shape[:2], *(n + 2 * v for n, v in zip(x_pad.shape[2:],
                                                                                                 padding)))
    gram, direct = _implicit_gram_costs(shape, o.shape, module)
    return gram <= _GRAM_FRACTION * direct


def _implicit_gram_sq_norms(x_pad, o, module, padding=None) -> torch.Tensor:
    """‖∂ℓ_i/∂W‖² = Σ_{s,t} (a_s·a_t)(o_s·o_t) with the Gram of the unfolded input formed without
    unfolding: with M = XᵀX the Gram of the padded input's positions (P × P, C_g deep), the patches
    of output positions s and t at tap (r, q) are the positions s + (r, q) and t + (r, q), so
    a_s·a_t = Σ_(r,q) M[s + (r, q), t + (r, q)], a sum of k strided blocks of M. Work per sample:
    P²·C_g + L²·p_g instead of im2col's L²·C_g·k; it pays for few positions and wide channels (the
    late stages of a ResNet). Conv1d and Conv2d, any stride, dilation and groups.
    """
    x2, o2, kernel, stride, dilation = as_conv2d(pad_input(x_pad, padding), o, module)
    B, C, H, W = x2.shape
    G, OH, OW = module.groups, o2.shape[2], o2.shape[3]
    C_g, p_g = C // G, o2.shape[1] // G
    dtype = torch.promote_types(o.dtype, torch.float32)
    out = torch.empty(B, dtype=dtype, device=o.device)
    taps = [(slice(r * dilation[0], r * dilation[0] + (OH - 1) * stride[0] + 1, stride[0]),
             slice(q * dilation[1], q * dilation[1] + (OW - 1) * stride[1] + 1, stride[1]))
            for r in range(kernel[0]) for q in range(kernel[1])]
    for samples in workspace.batch_chunks(B, G * (H * W) ** 2, _CHUNK_ELEMENTS):
        b = samples.stop - samples.start
        xg = x2[samples].to(dtype).reshape(b * G, C_g, H * W)
        M = torch.bmm(xg.transpose(1, 2), xg).view(b * G, H, W, H, W)
        gram_a = None
        for rows, cols in taps:
            block = M[:, rows, cols, rows, cols]
            gram_a = block.contiguous() if gram_a is None else gram_a.add_(block)
        og = o2[samples].to(dtype).reshape(b * G, p_g, OH * OW)
        gram_o = torch.bmm(og.transpose(1, 2), og)
        # Σ_st of the elementwise product as one batched dot product
        out[samples] = torch.bmm(gram_a.view(b * G, 1, -1), gram_o.view(b * G, -1, 1)).view(b, G).sum(1)
    return out


def conv_weight_sq_norms_reference(x_pad: torch.Tensor, o: torch.Tensor, module, padding=None) -> torch.Tensor:
    """‖∂ℓ_i/∂W‖²_F per sample, in plain torch.

    Layers with few positions and wide channels (Conv1d/2d): the implicit Gram form
    (``_implicit_gram_sq_norms``), where it costs at most ``_GRAM_FRACTION`` of the direct form's
    multiply-adds. Other small layers: im2col (``F.unfold``, B·C_in·k·L elements) and the linear
    norms per group. Larger ones (and Conv3d, which torch cannot unfold): per-sample gradients from
    the convolution's own weight-gradient routine with the batch as groups, squared and summed one
    chunk of samples at a time, so at most ``_CHUNK_ELEMENTS`` gradient values (not B × |W|) exist
    at once. The kernel path (``pdpfast.kernels.conv_norms``) materializes neither.

    Args:
        x_pad: (B, C_in, *spatial) Conv1d/2d/3d input padded by ``conv_pad`` (or unpadded, with
            ``padding`` the symmetric zero padding to apply).
        o: (B, C_out, *out_spatial) gradient of the summed loss w.r.t. the convolution output.
        module: supplies ``weight``, ``groups``, ``kernel_size``, ``stride`` and ``dilation``.
        padding: None, or one int per spatial dim, the zero padding still to apply to ``x_pad``.
    Returns:
        (B,) in the accumulation dtype (fp32, or fp64 for fp64 inputs).
    """
    B = x_pad.shape[0]
    if implicit_gram_pays(x_pad, o, module, padding):
        return _implicit_gram_sq_norms(x_pad, o, module, padding)
    # Conv3d has no unfold in torch: its per-sample gradients come chunk by chunk, as large layers'
    if B == 0 or x_pad.dim() == 5 or x_pad[0].numel() * B * math.prod(module.kernel_size) > _UNFOLD_LIMIT:
        dtype = torch.promote_types(o.dtype, torch.float32)
        out = torch.empty(B, dtype=dtype, device=o.device)
        for samples, grads in _per_sample_grad_chunks(x_pad, o, module, padding):
            out[samples] = grads.flatten(1).to(dtype).pow(2).sum(1)
        return out
    a, out = conv_as_linear(x_pad, o, module, padding)
    return linear_weight_sq_norms(a, out).view(B, module.groups).sum(1)


_CONV_WEIGHT_SQ_NORMS = declare("conv_weight_sq_norms", conv_weight_sq_norms_reference)


def conv_weight_sq_norms(x_pad: torch.Tensor, o: torch.Tensor, module, padding=None,
                         parts: bool = False) -> torch.Tensor:
    """‖∂ℓ_i/∂W‖²_F per sample: the fused kernel on CUDA, else ``conv_weight_sq_norms_reference``.

    Args:
        x_pad, o, module: as in ``conv_weight_sq_norms_reference``.
        padding: zero padding still to apply to ``x_pad``, or None (the kernel applies it by masking:
            no padded copy).
        parts: the caller sums the rows itself: the kernel's (B, n) partial sums may be returned.
    Returns:
        (B,) fp32 (fp64 for fp64 inputs), or with ``parts`` (B, n) partial sums from the kernel.
    """
    fn = _CONV_WEIGHT_SQ_NORMS.pick(x_pad, o)
    if fn is _CONV_WEIGHT_SQ_NORMS.reference:
        return fn(x_pad, o, module, padding)
    return fn(x_pad, o, module, padding=padding, parts=parts)


def conv_sq_norms_rounding_reference(x_pad: torch.Tensor, o: torch.Tensor, module, with_bias: bool, u: float,
                                     padding=None, parts: bool = False) -> tuple:
    """(``conv_weight_sq_norms_reference``, ``conv_scaled_sum_rounding`` of the weight [and bias]): a
    call's norms and its rounding bound, computed apart.

    Args:
        x_pad, o, module, padding: as in ``conv_weight_sq_norms_reference``.
        with_bias: the bias is among the call's parameters (ρ's √(‖patch‖² + 1)).
        u: the unit roundoff of the clipped sum's row scaling; 0: no ρ (None).
        parts: ignored (the reference sums its rows).
    Returns:
        (sq, rho), (B,) each in the accumulation dtype; rho None where ``u`` is 0.
    """
    return (conv_weight_sq_norms_reference(x_pad, o, module, padding),
            conv_scaled_sum_rounding(x_pad, o, module, True, with_bias, padding, u) if u else None)


_CONV_SQ_NORMS_ROUNDING = declare("conv_sq_norms_rounding", conv_sq_norms_rounding_reference)


def conv_sq_norms_rounding(x_pad: torch.Tensor, o: torch.Tensor, module, with_bias: bool, u: float, padding=None,
                           parts: bool = False) -> tuple:
    """A conv call's per-sample squared weight norms and its rounding bound ρ_i: from the norm kernel's
    launch on CUDA (``pdpfast.kernels.conv_norms.conv_sq_norms_rounding``), else from
    ``conv_sq_norms_rounding_reference``.

    Args:
        x_pad, o, module, padding, parts: as in ``conv_weight_sq_norms``.
        with_bias, u: as in ``conv_sq_norms_rounding_reference``.
    Returns:
        (sq, rho): (B,) each (fp32; fp64 for fp64 inputs), or (B, n) partial sums each from the kernel with
        ``parts``; rho None where ``u`` is 0.
    """
    fn = _CONV_SQ_NORMS_ROUNDING.pick(x_pad, o)
    if fn is _CONV_SQ_NORMS_ROUNDING.reference:
        return fn(x_pad, o, module, with_bias, u, padding)
    return fn(x_pad, o, module, with_bias, u, padding=padding, parts=parts)


def conv_sq_norms_grouped_reference(calls: list, module, padding=None, u: float = 0.0,
                                    with_bias: bool = False) -> tuple:
    """``conv_sq_norms_rounding`` of n same-shape calls of one layer geometry, one call at a time.

    Args:
        calls: n ≥ 1 pairs (x, o), as ``conv_weight_sq_norms``' x_pad and o.
        module, padding: as there (the calls share them).
        u, with_bias: as in ``conv_sq_norms_rounding``.
    Returns:
        (sq, rho), (n, B, 1) each: row c call c's per-sample squared norms and ρ (as partial sums of one
        column); rho None where ``u`` is 0.
    """
    each = [conv_sq_norms_rounding(x, o, module, with_bias, u, padding) for x, o in calls]
    sq = torch.stack([sq for sq, _ in each]).unsqueeze(2)
    return sq, (torch.stack([rho for _, rho in each]).unsqueeze(2) if u else None)


_CONV_SQ_NORMS_GROUPED = declare("conv_sq_norms_grouped", conv_sq_norms_grouped_reference)


def groups_conv_norms(x: torch.Tensor, o: torch.Tensor) -> bool:
    """Whether a conv call's norms would take the grouped kernel (``conv_sq_norms_grouped``):
    where the norm kernel runs (on a GPU, or under ``TRITON_INTERPRET=1``), outside a CUDA graph
    capture (the launch copies the calls' offsets from the host: a captured step has no host work to
    save anyway).

    Args:
        x: the call's input (unpadded or padded, as the layer keeps it); o: its output gradient.
    Returns:
        a bool.
    """
    if _CONV_SQ_NORMS_GROUPED.pick(x, o) is _CONV_SQ_NORMS_GROUPED.reference:
        return False
    return not (o.is_cuda and torch.cuda.is_current_stream_capturing())


def conv_sq_norms_grouped(calls: list, module, padding=None, u: float = 0.0, with_bias: bool = False) -> tuple:
    """Per-sample squared weight norms (and, with ``u``, rounding bounds) of n conv calls of one shape,
    strides, dtype and layer geometry, from one kernel launch where ``groups_conv_norms`` holds for
    them, instead of one per call.

    Args:
        calls: n ≥ 1 pairs (x, o) of one shape, strides and dtype.
        module: supplies the calls' kernel size, stride, dilation and groups.
        padding: the zero padding still to apply to every x, or None.
        u, with_bias: as in ``conv_sq_norms_rounding``.
    Returns:
        (sq, rho): (n, B, K) partial sums each (fp32; fp64 for fp64 calls on the reference), row c summing
        to call c's norms and ρ (lists of n (B, K_c) where the kernel runs them one by one); rho None
        where ``u`` is 0.
    """
    x, o = calls[0]
    return _CONV_SQ_NORMS_GROUPED.pick(x, o)(calls, module, padding, u, with_bias)


def conv_bias_sq_norms(o: torch.Tensor) -> torch.Tensor:
    """‖∂ℓ_i/∂b‖² = Σ_c (Σ_positions o_{i,c})² per sample, the squared norm of a convolution's bias gradient.

    Args:
        o: (B, C_out, *out_spatial) gradient of the summed loss w.r.t. the convolution output.
    Returns:
        (B,) fp32 (fp64 for fp64 ``o``).
    """
    return o.flatten(2).sum(-1).to(torch.promote_types(o.dtype, torch.float32)).pow(2).sum(-1)


def conv_clipped_grads(x_pad, o, weights, module, need_weight=True, need_bias=True, padding=None):
    """(Σ_i w_i ∂ℓ_i/∂W, Σ_i w_i ∂ℓ_i/∂b) through the convolution's own weight-gradient routine.

    Args:
        x_pad: (B, C_in, *spatial) Conv1d/2d/3d input padded by ``conv_pad`` (or not, see ``padding``).
        o: (B, C_out, *out_spatial) gradient of the summed loss w.r.t. the convolution output.
        weights: (B,) clip weights w_i, ``PendingWeights`` (computed and applied to o's rows in one op,
            ``clip_scale``), or None for the plain sums.
        module: supplies ``weight``, ``groups``, ``stride`` and ``dilation``.
        need_weight: compute the weight gradient.
        need_bias: compute the bias gradient.
        padding: zero padding still to apply to ``x_pad`` (the routine applies it), or None.
    Returns:
        (grad_w, grad_b): grad_w shaped like ``module.weight``, (C_out, C_in/G, *kernel_size), and
        grad_b (C_out,), both in ``o``'s dtype; each None when not needed.
    """
    if isinstance(weights, PendingWeights) and o.is_contiguous():
        o, _ = clip_scale(o, weights)
    elif weights is not None:  # (a row scaling keeps o's memory format: channels_last stays so)
        w = weights.tensor() if isinstance(weights, PendingWeights) else weights
        o = o * weights_as(w, o.dtype).view(-1, *([1] * (o.dim() - 1)))
    n = x_pad.dim() - 2
    grad_w = None
    if need_weight:
        _, grad_w, _ = torch.ops.aten.convolution_backward(
            o, x_pad, module.weight.detach().to(o.dtype), None, list(module.stride), _padding(padding, n),
            list(module.dilation), False, [0] * n, module.groups, [False, True, False])
    grad_b = o.sum([0, *range(2, o.dim())]) if need_bias else None
    return grad_w, grad_b


_CONV_FN = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


_BOXES: dict = {}  # (groups, kernel size, dtype, device) -> the all-ones (groups, 1, *kernel) weight


def conv_scaled_sum_rounding(x_pad, o, module, need_weight, need_bias, padding, u: float) -> torch.Tensor:
    """u·Σ_g Σ_q ‖o_{q,g}‖·√(‖patch_{q,g}‖² + [need_bias]) per sample, over output positions q and the
    convolution's groups g (o_{q,g}: group g's output channels at q; patch_{q,g}: the input values they
    read, group g's input channels): a clipped sum that rounds each scaled w_i·o_q to a relative u is
    within w_i times this of w_i·g_i (group g's block of the weight gradient, Σ_q o_{q,g} patch_{q,g}ᵀ,
    is within u·w_i·Σ_q ‖o_{q,g}‖‖patch_{q,g}‖ of its own, and the blocks' errors add at most).
    Without the weight, u·Σ_q ‖o_q‖ (the bias's sum over positions).

    ‖patch_{q,g}‖² is the group-summed squared input convolved with a box of the kernel's size, stride
    and dilation: two reductions and a convolution of one channel a group, nothing of the unfolded
    input's size.

    Args:
        x_pad, o, module, need_weight, need_bias, padding: as in ``conv_clipped_grads``.
        u: the unit roundoff of the scaling.
    Returns:
        (B,) in the accumulation dtype (fp32, fp64 for fp64 inputs).
    """
    acc = acc_dtype(x_pad, o)
    if not need_weight:
        return torch.linalg.vector_norm(o, dim=1, dtype=acc).flatten(1).sum(1).mul_(u)
    n, groups = x_pad.dim() - 2, module.groups
    key = (groups, tuple(module.kernel_size), acc, x_pad.device)
    box = _BOXES.get(key)
    if box is None:
        box = _BOXES[key] = torch.ones((groups, 1, *module.kernel_size), dtype=acc, device=x_pad.device)
    terms = torch.linalg.vector_norm(o.unflatten(1, (groups, -1)), dim=2, dtype=acc).flatten(1)  # (B, G·positions)
    sq = torch.linalg.vector_norm(x_pad.unflatten(1, (groups, -1)), dim=2, dtype=acc).square_()  # (B, G, *spatial)
    patch = _CONV_FN[n](sq, box, None, module.stride, _padding(padding, n), module.dilation, groups).flatten(1)
    if need_bias:
        patch = patch.add_(1)
    u *= tf32_slack(sq, "conv")  # the box's sums may come from TF32 products
    return scaled_row_dot(terms, patch.sqrt_(), u)  # patch: sums of squares, never negative


# On a CPU, per-sample gradients of a layer with a fan-in C_in/G·k of at most this many (an RGB
# input's 3x3 first layer) come from im2col (``_unfold``) and one batched GEMM: the grouped
# weight-gradient routine gives each sample's group too little work. One op, 32 px, 1 / 2 threads:
# batch 64 3->32 3.4 -> 2.2 / 2.5 -> 1.0 ms, 3->64 4.3 -> 4.1 / 2.9 -> 2.0 ms, batch 32 3->64
# 2.1 -> 1.7 / 1.4 -> 0.8 ms, 1->32 at 28 px 0.9 -> 0.6 / 0.7 -> 0.3 ms. At fan-in 72 (8->32) the
# GEMM is already 1.4-1.6x slower than the grouped routine, at 144 and more 3.5-7x.
_BMM_MAX_FAN_IN = 27


def _per_sample_grads_by_bmm(x_pad, module) -> bool:
    """Whether ``conv_per_sample_grads`` takes im2col and a batched GEMM (see ``_BMM_MAX_FAN_IN``)."""
    return x_pad.device.type == "cpu" and x_pad.dim() in (3, 4) and module.weight[0].numel() <= _BMM_MAX_FAN_IN


# Per-sample gradient values held at once by the reference paths (~128 MiB in fp32).
_CHUNK_ELEMENTS = 1 << 25
# On a CPU, chunks of 2 MiB of fp32 gradients per thread: the grouped weight-gradient routine runs
# 1.5-2.5x faster on a few samples at a time than on 64 (measured on the GroupNorm CNN's layers),
# but a chunk of a single sample of a wide layer (64->128 3x3: 74K weights) falls to torch's slow
# convolution path, and every chunk is a synchronisation point of the threads. GroupNorm CNN bk step
# against 2^17 (128K), interleaved in one process, 2026-11-23: 2^19 was 2-7% faster in each of four
# runs (1 and 2 threads); 2^21 was 13% slower on one thread.
_CPU_CHUNK_ELEMENTS = 1 << 19


def _per_sample_grad_chunks(x_pad, o, module, padding=None):
    """(slice of samples, their (b, *weight.shape) gradients), chunk by chunk.

    The batch becomes b·G convolution groups, so the convolution's own weight-gradient kernel
    computes every sample's gradient of a chunk in one call.
    """
    B, w = x_pad.shape[0], module.weight
    n = x_pad.dim() - 2
    on_cpu = o.device.type == "cpu"
    chunk = min(_CHUNK_ELEMENTS, _CPU_CHUNK_ELEMENTS * torch.get_num_threads()) if on_cpu else _CHUNK_ELEMENTS
    for samples in workspace.batch_chunks(B, w.numel(), chunk):
        b = samples.stop - samples.start
        xs = x_pad[samples].reshape(1, b * x_pad.shape[1], *x_pad.shape[2:])
        os = o[samples].reshape(1, b * o.shape[1], *o.shape[2:])
        weight = torch.empty(b * w.shape[0], *w.shape[1:], dtype=o.dtype, device=o.device)
        _, grad, _ = torch.ops.aten.convolution_backward(
            os, xs.to(o.dtype), weight, None, list(module.stride), _padding(padding, n), list(module.dilation), False,
            [0] * n, b * module.groups, [False, True, False])
        yield samples, grad.view(b, *w.shape)


def conv_per_sample_grads(x_pad, o, module, padding=None) -> torch.Tensor:
    """Materialized per-sample weight gradients ∂ℓ_i/∂W (tied parameters, small layers, oracles).

    Args:
        x_pad: (B, C_in, *spatial) Conv1d/2d/3d input padded by ``conv_pad`` (or not, see ``padding``).
        o: (B, C_out, *out_spatial) gradient of the summed loss w.r.t. the convolution output.
        module: supplies ``weight``, ``groups``, ``stride`` and ``dilation``.
        padding: zero padding still to apply to ``x_pad``, or None.
    Returns:
        (B, *weight.shape) in ``o``'s dtype, in a buffer of ``workspace`` (the clipping state returns
        it when done).
    """
    w = module.weight
    B, G = x_pad.shape[0], module.groups
    out = workspace.empty((B, *w.shape), o.dtype, o.device)
    if not _per_sample_grads_by_bmm(x_pad, module):
        for samples, grads in _per_sample_grad_chunks(x_pad, o, module, padding):
            out[samples] = grads
        return out
    L = math.prod(o.shape[2:])
    for samples in workspace.batch_chunks(B, w[0].numel() * G * L, _CHUNK_ELEMENTS):
        b = samples.stop - samples.start
        cols, o2 = _unfold(x_pad[samples], o[samples], module, padding)
        # (b·G, d_g, L) @ (b·G, L, p_g): each sample's and group's fan-in × outputs gradient
        grads = torch.bmm(cols.to(o.dtype).reshape(b * G, -1, L), o2.reshape(b * G, -1, L).transpose(1, 2))
        out[samples] = grads.view(b, G, *grads.shape[1:]).transpose(2, 3).reshape(b, *w.shape)
    return out
