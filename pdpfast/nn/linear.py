"""Linear layers: ``nn.Linear`` and Hugging Face's ``Conv1D`` (GPT-2), with one rule for both.

Per-sample norms by the Gram or the direct form (``pdpfast.ops.linear``); the clipped sum is the
weight-gradient GEMM on row-scaled output gradients (whose rounding in a low precision the rule
bounds, ``linear_rounding``); same-shape calls stack into one batch.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import linear as lin_ops
from . import layers
from .layers import DPModule
from .rules import Grouped, LayerRule, Stacked, register_layer, scaling_roundoff


class _FlatLinear(DPModule):
    """Linear maps on (B, ..., d) inputs compute on the flattened (B·T, d) input: F.linear on a
    3-D input returns a view, and a view passing through DPLayerFunction (which marks its input
    modified in place) would make autograd copy every output gradient (CopySlices).

    A private call is one C++ call (``pdpfast._C.linear_call``: the GEMM on detached parameters, the
    backward's hook, the view) where nothing else could see its ops (``layers.plain_call``). Else, and
    without the extension, the Python route (``DPModule._record``), whose ops and results are the same."""

    _transposed = False  # the weight is stored (d, p) (Hugging Face's Conv1D)

    def _linear(self, x, p):
        raise NotImplementedError

    def _record(self, x, params, buffers, call, trainable):
        linear_call = layers._LINEAR_CALL
        if linear_call is None or not layers.plain_call(x, params, buffers):
            return super()._record(x, params, buffers, call, trainable)
        out = linear_call(x, params["weight"], params["bias"], self._transposed, layers.LayerCall(call, x))
        if out.requires_grad:  # hooked, with x's leading dims
            return out
        # nothing before the layer needs a gradient: the parameters make autograd reach it (record_call)
        return self._unflatten(layers.DPLayerFunction.apply(out, x, call, *trainable), x)

    def _compute(self, x, p):
        return self._linear(x.reshape(-1, x.shape[-1]), p)

    def _unflatten(self, out, x):
        return out.view(*x.shape[:-1], out.shape[-1])


class DPLinear(_FlatLinear, nn.Linear):
    """``nn.Linear`` with per-sample clipping: y = x Wᵀ + b on inputs with any leading dims.

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear`` (weight (out_features,
            in_features), bias (out_features,)); ``convert`` makes one from an existing layer.

    ``forward(x)``: x (B, ..., in_features) float → (B, ..., out_features), x's float dtype (or autocast's).
    """

    def _linear(self, x, p):
        return F.linear(x, p["weight"], p.get("bias"))


class DPConv1D(_FlatLinear):
    """Hugging Face's ``transformers.pytorch_utils.Conv1D`` (GPT-2): y = x W + b with W (in, out).

    Never constructed directly: ``convert`` turns a ``Conv1D(nf, nx)`` (weight (nx, nf), bias (nf,))
    into a subclass of both, keeping its parameters.

    ``forward(x)``: x (B, ..., nx) float → (B, ..., nf), x's float dtype (or autocast's).
    """

    _transposed = True

    def _linear(self, x, p):
        return F.linear(x, p["weight"].t(), p.get("bias"))


def as_btd(x: torch.Tensor, o: torch.Tensor):
    """A linear call's input and output gradient as (B, T, ·) tensors.

    Args:
        x: the input, (B, ..., d).
        o: the output gradient, (B·T, p) (any shape with B·T·p elements, e.g. (B, ..., p)).
    Returns:
        (x as (B, T, d), o as (B, T, p)), T the product of the middle dims of x (1 for 2-D inputs);
        x itself when 3-D, else views where the layout allows (``reshape``).
    """
    if x.dim() == 3:  # (B, T, d) already (a transformer's calls): no view made (~1 µs, several times a call)
        B, T = x.shape[0], x.shape[1]
    else:
        B, T = x.shape[0], math.prod(x.shape[1:-1])
        x = x.reshape(B, T, x.shape[-1])
    return x, o.reshape(B, T, o.shape[-1])


def linear_rounding(a: torch.Tensor, o: torch.Tensor, with_weight: bool, with_bias: bool):
    """The ``LayerRule.rounding`` of a linear call: u·Σ_t ‖o_t‖·√(‖a_t‖² + 1) (the bias a weight on
    a constant 1), u the roundoff of the clipped sum's row scaling (``scaling_roundoff``; cuBLAS may
    take TF32 where ``torch.backends.cuda.matmul.allow_tf32``).

    Args:
        a: (B, T, d) inputs; o: (B, T, p) output gradients (B may be n·B for stacked calls).
        with_weight, with_bias: which of W and b the clipped sum computes.
    Returns:
        (B,) fp32 (fp64 for fp64 calls), or None where the sum rounds no more than fp32.
    """
    u = scaling_roundoff(o, "matmul")
    if not u:
        return None
    return lin_ops.scaled_sum_rounding(a if with_weight else None, o, with_bias, u)


def linear_sq_norms_rounding(a: torch.Tensor, o: torch.Tensor, with_weight: bool, with_bias: bool,
                             parts: bool = False):
    """(per-sample squared norms, ``linear_rounding``) of a linear call, from one launch where the
    norm kernel runs (``pdpfast.ops.linear.linear_sq_norms_rounding``).

    Args:
        a: (B, T, d) inputs; o: (B, T, p) output gradients (B may be n·B for stacked calls).
        with_weight, with_bias: which of W and b the call trains.
        parts: the caller sums the rows of sq and rho (``pdpfast.ops.linear.linear_sq_norms``): each may
            be (B, K) partial sums.
    Returns:
        (sq, rho): (B,) fp32 (fp64 for fp64 calls) each (or (B, K), with ``parts``); rho None where the
        sum rounds no more than fp32.
    """
    u = scaling_roundoff(o, "matmul")
    if not with_weight:
        sq = lin_ops.bias_sq_norms(o)
        return sq, (lin_ops.scaled_sum_rounding(None, o, with_bias, u) if u else None)
    if not u:
        return lin_ops.linear_sq_norms(a, o, with_bias=with_bias, parts=parts), None
    return lin_ops.linear_sq_norms_rounding(a, o, with_bias, u, parts)


def linear_rule(transposed: bool = False, weight: str = "weight", bias: str = "bias") -> LayerRule:
    """The rule of y = x Wᵀ + b on (B, ..., d) inputs (output gradient (B·T, p)).

    Norms by the Gram or the direct form, clipped sums by one GEMM on row-scaled output gradients,
    same-shape calls stacked, and per-sample gradients formed where they are small next to the call.

    Args:
        transposed: W is stored (in, out) = (d, p), as in Hugging Face's Conv1D; False: (out, in) = (p, d).
        weight: the name of the module's W parameter (e.g. ``in_proj_weight`` of attention).
        bias: the name of its b parameter, (p,) (the module may have none).
    Returns:
        a ``LayerRule`` (per-sample gradients {weight: (B, *W.shape), bias: (B, p)}).
    """
    def small_per_sample(m, x, o, kept: bool) -> bool:  # formed where they pay (``prefer_per_sample``)
        B, d, p = x.shape[0], x.shape[-1], o.shape[-1]
        return lin_ops.prefer_per_sample(
            B * getattr(m, weight).numel(), x, o, kept=kept,
            norm_cost=lambda: lin_ops.norm_madds(B, math.prod(x.shape[1:-1]), d, p, o.device))

    def per_sample(m, x, o):
        a, g = as_btd(x, o)
        # Conv1D stores W as (in, out): its per-sample gradients a_iᵀ o_i come from the same bmm
        # with the operands swapped, laid out as the weight is, never through a transpose copy
        grads = lin_ops.linear_per_sample_grads(g, a) if transposed else lin_ops.linear_per_sample_grads(a, g)
        out = {weight: grads}
        if getattr(m, bias, None) is not None:
            out[bias] = g.sum(1)
        return out

    def sq_norms(m, x, o, names, parts=False):
        a, g = as_btd(x, o)
        if weight in names:
            return lin_ops.linear_sq_norms(a, g, with_bias=bias in names, parts=parts)
        return lin_ops.bias_sq_norms(g)

    def clipped(m, x, o, weights, names):
        a, g = as_btd(x, o)
        grad_w, grad_b = lin_ops.linear_clipped_grads(a, g, weights, weight in names, bias in names, transposed)
        return {n: grad for n, grad in ((weight, grad_w), (bias, grad_b)) if grad is not None}

    def rounding(m, x, o, names):
        return linear_rounding(*as_btd(x, o), weight in names, bias in names)

    def sq_norms_rounding(m, x, o, names, parts=False):
        return linear_sq_norms_rounding(*as_btd(x, o), weight in names, bias in names, parts)

    # same-shape calls (the projections of every transformer block) stack into one batch
    def key(m, x, o, names):
        if not x.is_floating_point():
            return None
        return x.shape, o.shape, o.dtype, o.device, weight in names, bias in names

    def stack(calls):  # (n, B, T, d), (n, B, T, p): one copy each, shapes fixed by the key
        B, T = calls[0][1].shape[0], math.prod(calls[0][1].shape[1:-1])
        d, p = calls[0][1].shape[-1], calls[0][2].shape[-1]
        n = len(calls)
        a = torch.stack([x for _, x, _, _ in calls]).view(n, B, T, d)
        g = torch.stack([o for _, _, o, _ in calls]).view(n, B, T, p)
        return a, g

    def stacked_sq_norms(calls):
        a, g = stack(calls)
        n, B, T, d = a.shape
        names = calls[0][3]
        g = g.view(n * B, T, g.shape[-1])
        if weight in names:
            return lin_ops.linear_sq_norms(a.view(n * B, T, d), g, with_bias=bias in names).view(n, B)
        return lin_ops.bias_sq_norms(g).view(n, B)

    def stacked_clipped(calls, weights):
        a, g = stack(calls)
        names = calls[0][3]
        grad_w, grad_b = lin_ops.linear_clipped_grads_stacked(a, g, weights, weight in names, bias in names,
                                                              transposed)
        per_call = [(n, grad.unbind(0)) for n, grad in ((weight, grad_w), (bias, grad_b)) if grad is not None]
        return [{n: grads[i] for n, grads in per_call} for i in range(len(calls))]

    def stacked_rounding(calls):
        a, g = stack(calls)
        n, B, T, d = a.shape
        names = calls[0][3]
        rho = linear_rounding(a.view(n * B, T, d), g.view(n * B, T, g.shape[-1]), weight in names, bias in names)
        return None if rho is None else rho.view(n, B)

    def stacked_sq_norms_rounding(calls):  # one stacking copy for both
        a, g = stack(calls)
        n, B, T, d = a.shape
        names = calls[0][3]
        sq, rho = linear_sq_norms_rounding(a.view(n * B, T, d), g.view(n * B, T, g.shape[-1]), weight in names,
                                           bias in names)
        return sq.view(n, B), (None if rho is None else rho.view(n, B))

    stacked = Stacked(key, stacked_sq_norms, stacked_clipped, stacked_rounding, stacked_sq_norms_rounding)

    # large calls of one batch and sequence length (every projection of a transformer) take one norm
    # launch; those whose widths or strides are not all multiples of 16 take another (the launch's
    # loads are vectorized only where every call's are), and one whose tensors do not start on 16-byte
    # boundaries its own (the launch reads every call at an aligned offset)
    def group_key(m, x, o, names):
        if weight not in names or not x.is_floating_point():
            return None
        a, g = as_btd(x, o)
        if not lin_ops.groups_norms(a, g) or a.data_ptr() % 16 or g.data_ptr() % 16:
            return None
        aligned = not (a.shape[2] % 16 or g.shape[2] % 16 or a.stride(0) % 16 or a.stride(1) % 16
                       or g.stride(0) % 16 or g.stride(1) % 16)
        return a.shape[:2], aligned, g.dtype, g.device, bias in names

    def grouped_norms_and_rounding(calls, bound):
        names = calls[0][3]
        pairs = [as_btd(x, o) for _, x, o, _ in calls]
        u = scaling_roundoff(pairs[0][1], "matmul") if bound else 0.0
        return lin_ops.linear_sq_norms_grouped(pairs, bias in names, u)

    def clipped_into(m, x, o, weights, names):  # the sums added into .grad in one C++ call where it runs
        params = m._parameters
        return lin_ops.linear_clipped_into(x, o, weights, params[weight] if weight in names else None,
                                           params[bias] if bias in names else None, transposed)

    def grouped_clipped_into(calls, weights):  # the calls of one key: their routes checked once
        names = calls[0][3]
        return lin_ops.linear_clipped_into_calls(
            [(x, o, m._parameters[weight], m._parameters[bias] if bias in names else None) for m, x, o, _ in calls],
            weights, transposed)

    return LayerRule(per_sample, sq_norms, clipped, stacked, small_per_sample, rounding=rounding,
                     sq_norms_rounding=sq_norms_rounding, norm_parts=True, pending_weights=True,
                     grouped=Grouped(group_key, grouped_norms_and_rounding, clipped_into=grouped_clipped_into),
                     clipped_into=clipped_into)


register_layer(nn.Linear, DPLinear, linear_rule())
# by qualified name: transformers is never imported here
register_layer("transformers.pytorch_utils.Conv1D", DPConv1D, linear_rule(transposed=True))
