"""Drop-in DP modules: the torch layers with a private forward.

Each class subclasses the torch layer it replaces, so parameters, state_dict names, hooks and
isinstance checks are untouched. Outside a private batch (no ``ClippingState`` attached, eval mode
or grad disabled) they are exactly the torch layer. In a private batch the forward runs with
detached parameters, so autograd computes input gradients as usual but no weight-gradient GEMM,
and the output passes through ``DPLayerFunction``, whose backward hands (input, output gradient)
to the clipping state: per-sample norms and clipped sums come from the layer's rule.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import conv as conv_ops
from ..ops import embedding as emb_ops
from ..ops import linear as lin_ops
from ..ops import norm as norm_ops
from .rules import LayerRule, Stacked, register_rule


class DPLayerFunction(torch.autograd.Function):
    """Identity on ``out`` whose backward reports (x, ∂L/∂out) for one call of a DP layer.

    ``params`` are inputs only so autograd reaches this node even when nothing else requires a
    gradient (first layer); their gradients are written by the clipping state, so None is returned.
    """

    @staticmethod
    def forward(ctx, out, x, call, *params):
        ctx.call = call
        ctx.save_for_backward(x)
        # in place in autograd's eyes, so later in-place ops (ReLU(inplace=True)) stay legal
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        layer = ctx.call[0]
        layer.state.on_backward(ctx.call, x, grad_out)
        return (grad_out, None, None) + (None,) * (len(ctx.needs_input_grad) - 3)


class DPModule:
    """Mixin of every DP layer. ``_pdpfast_state`` is set by ``ClippingState.attach``."""

    _pdpfast_state = None

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        """The input as the layer's rule needs it (e.g. padded for convolutions)."""
        return x

    def _compute(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        raise NotImplementedError

    def _unflatten(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The layer's output from what ``_compute`` returned (see DPLinear)."""
        return out

    def forward(self, x):
        state = self._pdpfast_state
        if state is None or not self.training or not torch.is_grad_enabled():
            x = self._prepare(x)
            return self._unflatten(self._compute(x, dict(self.named_parameters(recurse=False))), x)
        return state.forward(self, x)


class _FlatLinear(DPModule):
    """Linear maps on (B, ..., d) inputs compute on the flattened (B·T, d) input: F.linear on a
    3-D input returns a view, and a view passing through DPLayerFunction (which marks its input
    modified in place) would make autograd copy every output gradient (CopySlices)."""

    def _linear(self, x, p):
        raise NotImplementedError

    def _compute(self, x, p):
        return self._linear(x.reshape(-1, x.shape[-1]), p)

    def _unflatten(self, out, x):
        return out.view(*x.shape[:-1], out.shape[-1])


class DPLinear(_FlatLinear, nn.Linear):
    def _linear(self, x, p):
        return F.linear(x, p["weight"], p.get("bias"))


class DPConv1d(DPModule, nn.Conv1d):
    def _prepare(self, x):
        return conv_ops.conv_pad(x, self)

    def _compute(self, x, p):
        return F.conv1d(x, p["weight"], p.get("bias"), self.stride, 0, self.dilation, self.groups)


class DPConv2d(DPModule, nn.Conv2d):
    def _prepare(self, x):
        return conv_ops.conv_pad(x, self)

    def _compute(self, x, p):
        return F.conv2d(x, p["weight"], p.get("bias"), self.stride, 0, self.dilation, self.groups)


class DPConv3d(DPModule, nn.Conv3d):
    def _prepare(self, x):
        return conv_ops.conv_pad(x, self)

    def _compute(self, x, p):
        return F.conv3d(x, p["weight"], p.get("bias"), self.stride, 0, self.dilation, self.groups)


class DPInstanceNorm(DPModule, nn.modules.instancenorm._InstanceNorm):
    """InstanceNorm1d/2d/3d with ``track_running_stats=False`` (``convert`` refuses running stats:
    they would be updated from the batch's data outside any privacy accounting)."""

    def _compute(self, x, p):
        return F.instance_norm(x, None, None, p.get("weight"), p.get("bias"), True, 0.0, self.eps)


class DPEmbedding(DPModule, nn.Embedding):
    def _compute(self, x, p):
        return F.embedding(x, p["weight"], self.padding_idx)


class DPLayerNorm(DPModule, nn.LayerNorm):
    def _compute(self, x, p):
        return F.layer_norm(x, self.normalized_shape, p.get("weight"), p.get("bias"), self.eps)


class DPGroupNorm(DPModule, nn.GroupNorm):
    def _compute(self, x, p):
        return F.group_norm(x, self.num_groups, p.get("weight"), p.get("bias"), self.eps)


class DPRMSNorm(DPModule, nn.RMSNorm):
    def _compute(self, x, p):
        return F.rms_norm(x, self.normalized_shape, p.get("weight"), self.eps)


class DPConv1D(_FlatLinear):
    """Hugging Face's ``transformers.pytorch_utils.Conv1D`` (GPT-2): y = x W + b with W (in, out)."""

    def _linear(self, x, p):
        return F.linear(x, p["weight"].t(), p.get("bias"))


# ----------------------------------------------------------------------------- rules


def _as_btd(x: torch.Tensor, o: torch.Tensor):
    """Input (B, ..., d) and output gradient (B·T, p) as (B, T, d) and (B, T, p), T the product of
    the middle dims of x (1 for 2-D inputs)."""
    B, T = x.shape[0], math.prod(x.shape[1:-1])
    return x.reshape(B, T, x.shape[-1]), o.reshape(B, T, o.shape[-1])


def _small_per_sample_weight(m, x, o) -> bool:
    """Linear and conv calls form per-sample gradients where they are small (``prefer_per_sample``)."""
    return lin_ops.prefer_per_sample(x.shape[0] * m.weight.numel(), x, o)


def _linear_rule(transposed: bool) -> LayerRule:
    def per_sample(m, x, o):
        a, g = _as_btd(x, o)
        # Conv1D stores W as (in, out): its per-sample gradients a_iᵀ o_i come from the same bmm
        # with the operands swapped, laid out as the weight is, never through a transpose copy
        grads = lin_ops.linear_per_sample_grads(g, a) if transposed else lin_ops.linear_per_sample_grads(a, g)
        out = {"weight": grads}
        if getattr(m, "bias", None) is not None:
            out["bias"] = g.sum(1)
        return out

    def sq_norms(m, x, o, names):
        a, g = _as_btd(x, o)
        if "weight" in names:
            return lin_ops.linear_sq_norms(a, g, with_bias="bias" in names)
        return lin_ops.bias_sq_norms(g)

    def clipped(m, x, o, weights, names):
        a, g = _as_btd(x, o)
        grad_w, grad_b = lin_ops.linear_clipped_grads(a, g, weights, "weight" in names, "bias" in names, transposed)
        return {n: grad for n, grad in (("weight", grad_w), ("bias", grad_b)) if grad is not None}

    # same-shape calls (the projections of every transformer block) stack into one batch
    def key(m, x, o, names):
        if not x.is_floating_point():
            return None
        return x.shape, o.shape, o.dtype, o.device, "weight" in names, "bias" in names

    def stack(calls):  # (n, B, T, d), (n, B, T, p): one copy each, shapes fixed by the key
        B, T, d, p = calls[0][1].shape[0], math.prod(calls[0][1].shape[1:-1]), calls[0][1].shape[-1], calls[0][2].shape[-1]
        n = len(calls)
        a = torch.stack([x for _, x, _, _ in calls]).view(n, B, T, d)
        g = torch.stack([o for _, _, o, _ in calls]).view(n, B, T, p)
        return a, g

    def stacked_sq_norms(calls):
        a, g = stack(calls)
        n, B, T, d = a.shape
        names = calls[0][3]
        g = g.view(n * B, T, g.shape[-1])
        if "weight" in names:
            return lin_ops.linear_sq_norms(a.view(n * B, T, d), g, with_bias="bias" in names).view(n, B)
        return lin_ops.bias_sq_norms(g).view(n, B)

    def stacked_clipped(calls, weights):
        a, g = stack(calls)
        names = calls[0][3]
        grad_w, grad_b = lin_ops.linear_clipped_grads_stacked(a, g, weights, "weight" in names, "bias" in names,
                                                              transposed)
        per_call = [(n, grad.unbind(0)) for n, grad in (("weight", grad_w), ("bias", grad_b)) if grad is not None]
        return [{n: grads[i] for n, grads in per_call} for i in range(len(calls))]

    return LayerRule(per_sample, sq_norms, clipped, Stacked(key, stacked_sq_norms, stacked_clipped),
                     _small_per_sample_weight)


def _conv_per_sample(m, x, o):
    out = {"weight": conv_ops.conv_per_sample_grads(x, o, m)}
    if m.bias is not None:
        out["bias"] = o.flatten(2).sum(-1)
    return out


def _conv_sq_norms(m, x, o, names):
    total = conv_ops.conv_weight_sq_norms(x, o, m) if "weight" in names else None
    if "bias" in names:
        bias = conv_ops.conv_bias_sq_norms(o)
        total = bias if total is None else total.add_(bias)
    return total


def _conv_clipped(m, x, o, weights, names):
    grad_w, grad_b = conv_ops.conv_clipped_grads(x, o, weights, m, "weight" in names, "bias" in names)
    return {n: g for n, g in (("weight", grad_w), ("bias", grad_b)) if n in names}


def _embedding_per_sample(m, ids, o):
    return {"weight": emb_ops.embedding_per_sample_grads(ids, o, m.num_embeddings, m.padding_idx)}


def _embedding_sq_norms(m, ids, o, names):
    return emb_ops.embedding_sq_norms(ids, o, m.num_embeddings, m.padding_idx)


def _embedding_clipped(m, ids, o, weights, names):
    return {"weight": emb_ops.embedding_clipped_grad_reference(ids, o, weights, m.num_embeddings, m.padding_idx)}


register_rule(DPLinear, rule=_linear_rule(transposed=False))
register_rule(DPConv1D, rule=_linear_rule(transposed=True))
register_rule(DPConv1d, DPConv2d, DPConv3d, rule=LayerRule(_conv_per_sample, _conv_sq_norms, _conv_clipped,
                                                            materialize_when=_small_per_sample_weight))
register_rule(DPEmbedding, rule=LayerRule(_embedding_per_sample, _embedding_sq_norms, _embedding_clipped))


def _norm_rule(per_sample_grads, config) -> LayerRule:
    """Normalization layers: per-sample gradients as small as the parameters, formed directly.

    Their math is per sample, so n same-shape calls stack along the batch: one normalization over
    (n·B, ...) forms every call's per-sample gradients. ``config(module)``: what the math reads
    from the module (calls stack only when it is equal).
    """
    def per_sample(m, x, o):  # the ops take (x, o, module) like the other ops
        return per_sample_grads(x, o, m)

    def key(m, x, o, names):
        return type(m), config(m), x.shape, o.shape, o.dtype, o.device, names

    def stacked_grads(calls) -> list:
        n, B = len(calls), calls[0][1].shape[0]
        x = torch.stack([c[1] for c in calls]).flatten(0, 1)
        o = torch.stack([c[2] for c in calls]).flatten(0, 1)
        grads = per_sample(calls[0][0], x, o)
        return [(name, grads[name].reshape(n, B, math.prod(grads[name].shape[1:]))) for name in calls[0][3]]

    def stacked_sq_norms(calls):
        total = None
        for _, g in stacked_grads(calls):
            sq = (g if g.dtype in (torch.float32, torch.float64) else g.float()).pow(2).sum(2)
            total = sq if total is None else total.add_(sq)
        return total

    def stacked_clipped(calls, weights):  # weights (B,) shared or (n, B) per call
        w = weights.unsqueeze(-2)  # (1, B) or (n, 1, B): a batched row vector
        per_name = [(name, torch.matmul(w.to(g.dtype), g).flatten(0, -2).unbind(0))
                    for name, g in stacked_grads(calls)]
        return [{name: grads[i] for name, grads in per_name} for i in range(len(calls))]

    return LayerRule(per_sample, stacked=Stacked(key, stacked_sq_norms, stacked_clipped))


register_rule(DPLayerNorm, rule=_norm_rule(norm_ops.layer_norm_per_sample_grads,
                                           lambda m: (tuple(m.normalized_shape), m.eps)))
register_rule(DPGroupNorm, rule=_norm_rule(norm_ops.group_norm_per_sample_grads, lambda m: (m.num_groups, m.eps)))
register_rule(DPInstanceNorm, rule=_norm_rule(norm_ops.instance_norm_per_sample_grads,
                                              lambda m: (m.num_features, m.eps)))
register_rule(DPRMSNorm, rule=_norm_rule(norm_ops.rms_norm_per_sample_grads,
                                         lambda m: (tuple(m.normalized_shape), m.eps)))
