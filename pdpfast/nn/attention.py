"""``nn.MultiheadAttention``: its input projection as a DP linear call, the rest in plain torch.

nn.MultiheadAttention hands its parameters to ``F.multi_head_attention_forward``, which no
per-sample rule can see into. ``DPMultiheadAttention`` keeps the module, its parameters and their
names, and computes the same function in the open during a private forward:

* the packed input projection [q; k; v] = x W_inᵀ + b_in is one call of the linear rule on
  (``in_proj_weight``, ``in_proj_bias``). Self-attention (query is key is value, as in
  ``nn.TransformerEncoderLayer``) projects once. When query, key and value differ, each is
  projected with the whole packed weight and its block kept: the per-sample gradient is then a sum
  over uses, formed exactly (materialized, B × 3E × E) — more memory, same result;
* ``out_proj`` is called as a module, so it is an ordinary DP linear layer;
* attention itself (masks, dropout, head averaging of the returned weights) has no parameters.

Supported: ``key_padding_mask`` and ``attn_mask`` (bool or float),
``is_causal`` as torch's hint that ``attn_mask`` is causal (so with an ``attn_mask``, as torch
requires), ``need_weights`` / ``average_attn_weights``, dropout. Refused by ``convert`` (with the
reason): ``add_bias_kv``, ``add_zero_attn`` and key/value dims other than ``embed_dim``; and, like
every module laid out (T, B, ...), ``batch_first=False`` is refused by the engine (a model that
passes (T, B, E) tensors between its layers would make every DP layer clip per position).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .layers import DPModule
from .linear import linear_rule
from .rules import register_layer


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A bool mask (True = not allowed) as -inf where True; a float mask as it is."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


class DPMultiheadAttention(DPModule, nn.MultiheadAttention):
    """``nn.MultiheadAttention`` with per-sample clipping of its input and output projections.

    Args:
        embed_dim, num_heads, dropout, bias, device, dtype: as ``nn.MultiheadAttention`` (E = embed_dim,
            H = num_heads; in_proj_weight (3E, E), in_proj_bias (3E,)); ``convert`` makes one from an
            existing layer. ``batch_first`` must be True; ``add_bias_kv``, ``add_zero_attn`` and
            ``kdim``/``vdim`` other than E are refused (``unsupported_options``).
    """

    @classmethod
    def unsupported_options(cls, module):
        """Why ``module`` cannot be converted, or None.

        Args:
            module: an ``nn.MultiheadAttention``.
        Returns:
            the reason for ``add_bias_kv=True``, ``add_zero_attn=True`` or key/value dims other than
            ``embed_dim``; None otherwise (``batch_first=False`` is refused by the engine, not here).
        """
        if module.bias_k is not None:
            return "add_bias_kv=True is not supported; use add_bias_kv=False"
        if module.add_zero_attn:
            return "add_zero_attn=True is not supported; use add_zero_attn=False"
        if not module._qkv_same_embed_dim:
            return (f"kdim/vdim other than embed_dim are not supported (kdim={module.kdim}, vdim={module.vdim}, "
                    f"embed_dim={module.embed_dim}: separate q/k/v projection weights); use kdim=vdim=None")
        return None

    def _compute(self, x, p):  # the packed input projection, on the flattened (B·T, E) input
        return F.linear(x.reshape(-1, x.shape[-1]), p["in_proj_weight"], p.get("in_proj_bias"))

    def _unflatten(self, out, x):
        return out.view(*x.shape[:-1], out.shape[-1])

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        """Scaled dot-product attention softmax(q kᵀ/√(E/H) + mask) v over H heads, then ``out_proj``.

        Outside a private batch this is ``nn.MultiheadAttention.forward`` (all its input forms).

        Args:
            query: (B, T, E) float.
            key: (B, S, E), the same dtype (may be ``query`` itself: self-attention projects once).
            value: (B, S, E) (may be ``key`` itself).
            key_padding_mask: None, or (B, S): bool (True = key position ignored) or float (added to
                the scores).
            need_weights: whether to return the attention weights.
            attn_mask: None, or (T, S) or (B·H, T, S): bool (True = not allowed) or float (added).
            average_attn_weights: average the returned weights over the heads.
            is_causal: a hint that ``attn_mask`` is causal, as in torch: it needs ``attn_mask``, which
                alone decides the masking.
        Returns:
            (output (B, T, E), weights): weights (B, T, S) averaged over heads, (B, H, T, S) with
            ``average_attn_weights=False``, or None without ``need_weights``; after dropout, as torch
            returns them.
        Raises:
            ValueError in a private batch for inputs that are not batched (3-D), or for ``is_causal=True``
            without ``attn_mask`` (torch refuses it in training, and its forward outside a private batch,
            in eval or under no_grad, ignores the hint and attends to every position: a mask made here
            would train another function than the one evaluated).
        """
        state = self._pdpfast_state
        if state is None or not self.training or not torch.is_grad_enabled():
            return super(DPModule, self).forward(query, key, value, key_padding_mask=key_padding_mask,
                                                 need_weights=need_weights, attn_mask=attn_mask,
                                                 average_attn_weights=average_attn_weights, is_causal=is_causal)
        if query.dim() != 3:
            raise ValueError("DPMultiheadAttention needs batched (3-D) inputs in a private batch")
        if is_causal and attn_mask is None:
            raise ValueError("is_causal=True needs attn_mask (torch reads is_causal only as a hint that attn_mask "
                             "is causal); pass a causal attn_mask, e.g. "
                             "torch.nn.Transformer.generate_square_subsequent_mask(T), is_causal=True staying its hint")
        E = self.embed_dim
        project = lambda x: state.forward(self, x)  # noqa: E731
        if query is key and key is value:
            q, k, v = project(query).split(E, dim=-1)
        elif key is value:
            q = project(query)[..., :E]
            k, v = project(key)[..., E:].split(E, dim=-1)
        else:
            q, k, v = project(query)[..., :E], project(key)[..., E:2 * E], project(value)[..., 2 * E:]
        out, weights = self._attend(q, k, v, key_padding_mask, attn_mask, need_weights)
        out = self.out_proj(out)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        return out, weights

    def _attend(self, q, k, v, key_padding_mask, attn_mask, need_weights):
        B, T, E = q.shape
        S, H = k.shape[1], self.num_heads
        d = E // H
        q, k, v = (t.reshape(B, t.shape[1], H, d).transpose(1, 2) for t in (q, k, v))  # (B, H, ·, d)
        bias = _additive(attn_mask, q.dtype)
        if bias is not None and bias.dim() == 3:  # (B·H, T, S)
            bias = bias.view(B, H, T, S)
        padding = _additive(key_padding_mask, q.dtype)
        if padding is not None:
            padding = padding.view(B, 1, 1, S)
            bias = padding if bias is None else bias + padding
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d)
        if bias is not None:
            scores = scores + bias
        probs = torch.softmax(scores, dim=-1)
        if self.dropout > 0.0:
            probs = F.dropout(probs, p=self.dropout)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(B, T, E)
        return out, (probs if need_weights else None)


register_layer(nn.MultiheadAttention, DPMultiheadAttention,
               linear_rule(weight="in_proj_weight", bias="in_proj_bias"))
