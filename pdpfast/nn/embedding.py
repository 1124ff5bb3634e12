"""``nn.Embedding`` (``padding_idx``): exact per-sample norms over the tokens a sample contains,
repeated tokens included (``pdpfast.ops.embedding``); ``nn.EmbeddingBag`` (sum, mean)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import embedding as emb_ops
from ..ops.linear import acc_dtype
from .layers import DPModule
from .rules import LayerRule, exact_scaling, register_layer


class DPEmbedding(DPModule, nn.Embedding):
    """``nn.Embedding`` with per-sample clipping; exact norms over the tokens a sample contains.

    Args:
        num_embeddings, embedding_dim, padding_idx, device, dtype, ...: as ``nn.Embedding``
            (weight (V, d) with V = num_embeddings; the ``padding_idx`` row gets no gradient);
            ``convert`` makes one from an existing layer. ``max_norm``, ``scale_grad_by_freq`` and
            ``sparse`` must keep their defaults (``unsupported_options``).

    ``forward(ids)``: ids (B, ...) int64 (or int32) token ids in [0, V) → (B, ..., d) in the weight's dtype.
    """

    @classmethod
    def unsupported_options(cls, module):
        """Why ``module`` cannot be converted, or None.

        Args:
            module: an ``nn.Embedding``.
        Returns:
            the reason for ``max_norm`` set (rows renormalized in place from the batch's tokens),
            ``scale_grad_by_freq`` (batch-wide token counts) or ``sparse=True``; None otherwise.
        """
        if module.max_norm is not None:
            return (f"max_norm={module.max_norm} renormalizes table rows in place from the batch's tokens; "
                    "set max_norm=None")
        if module.scale_grad_by_freq:
            return ("scale_grad_by_freq=True scales gradients by batch-wide token counts; "
                    "set scale_grad_by_freq=False")
        if module.sparse:
            return "sparse=True (sparse gradients) is not supported; set sparse=False"
        return None

    def _compute(self, x, p):
        return F.embedding(x, p["weight"], self.padding_idx)


def _embedding_per_sample(m, ids, o):
    return {"weight": emb_ops.embedding_per_sample_grads(ids, o, m.num_embeddings, m.padding_idx)}


def _embedding_add_per_sample(m, ids, o, names, into):
    emb_ops.embedding_per_sample_grads(ids, o, m.num_embeddings, m.padding_idx, out=into["weight"])


def _embedding_sq_norms(m, ids, o, names):
    return emb_ops.embedding_sq_norms(ids, o, m.num_embeddings, m.padding_idx)


def _embedding_clipped(m, ids, o, weights, names):
    return {"weight": emb_ops.embedding_clipped_grad_reference(ids, o, weights, m.num_embeddings, m.padding_idx)}


register_layer(nn.Embedding, DPEmbedding, LayerRule(_embedding_per_sample, _embedding_sq_norms, _embedding_clipped,
                                                     add_per_sample_grads=_embedding_add_per_sample,
                                                     rounding=exact_scaling))  # scaled in fp32


class DPEmbeddingBag(DPModule, nn.EmbeddingBag):
    """``nn.EmbeddingBag`` with mode "sum" or "mean" (``per_sample_weights``, ``padding_idx``,
    2-D input or 1-D input with ``offsets``, one bag per sample).

    In a private batch the bags are laid out as (B, L) ids and weights (0 for padding and
    ``padding_idx`` entries, 1/|bag| for "mean"), so every mode is one weighted sum: sample i's
    gradient puts w_ij·o_i on row ids_ij, its squared norm is ‖o_i‖² Σ_u (Σ_{j: ids_ij = u} w_ij)².

    Args:
        num_embeddings, embedding_dim, mode, padding_idx, include_last_offset, device, dtype, ...: as
            ``nn.EmbeddingBag`` (weight (V, d)); ``convert`` makes one from an existing layer. ``mode``
            must be "sum" or "mean"; ``max_norm``, ``scale_grad_by_freq`` and ``sparse`` keep their defaults.
    """

    @classmethod
    def unsupported_options(cls, module):
        """Why ``module`` cannot be converted, or None.

        Args:
            module: an ``nn.EmbeddingBag``.
        Returns:
            the reason for ``mode="max"`` or for any option ``DPEmbedding`` refuses; None otherwise.
        """
        if module.mode == "max":
            return "mode='max' is not supported (its gradient follows per-dimension maxima); use 'sum' or 'mean'"
        return DPEmbedding.unsupported_options(module)

    def forward(self, input, offsets=None, per_sample_weights=None):
        """One reduced bag per sample: Σ_j w_ij W[ids_ij] (w_ij = 1/|bag| for "mean").

        Args:
            input: (B, L) int token ids, one bag per row (``offsets`` None); or 1-D (N,) ids of all bags
                concatenated, with ``offsets``.
            offsets: None for 2-D input; for 1-D input, (B,) int start of each bag in ``input``
                ((B + 1,) with ``include_last_offset``, the last entry being N).
            per_sample_weights: None, or float weights of ``input``'s shape (mode "sum" only).
        Returns:
            (B, d) in the weight's dtype.
        Raises:
            ValueError in a private batch: ``per_sample_weights`` with mode "mean", ``offsets`` with 2-D
            input, 1-D input without ``offsets``, ``offsets`` that are not a 1-D integer tensor starting at
            0, non-decreasing and at most len(input) (with ``include_last_offset``, at least one value), or
            input of another rank (outside one, ``nn.EmbeddingBag`` checks its own arguments).
        """
        state = self._pdpfast_state
        if state is None or not self.training or not torch.is_grad_enabled():
            return super(DPModule, self).forward(input, offsets, per_sample_weights)
        return state.forward(self, self._bags(input, offsets, per_sample_weights))

    def _bags(self, ids, offsets, per_sample_weights):
        """(ids (B, L), weights (B, L)) for any input form (1-D input costs one host sync: the
        longest bag, read with the checks of ``offsets``)."""
        if per_sample_weights is not None and self.mode != "sum":
            raise ValueError(f"per_sample_weights are only supported for mode='sum', not mode={self.mode!r}")
        if ids.dim() == 2:
            if offsets is not None:
                raise ValueError("offsets must be None for 2-D input (one bag per row)")
            valid = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
            weights = per_sample_weights
        elif ids.dim() == 1:
            if offsets is None:
                raise ValueError("1-D input needs offsets (one bag per sample)")
            starts, lengths, L = self._checked_bag_lengths(ids, offsets)
            B = starts.numel()
            row = torch.repeat_interleave(torch.arange(B, device=ids.device), lengths)
            col = torch.arange(row.numel(), device=ids.device) - starts[row]
            padded = ids.new_zeros(B, L)
            padded[row, col] = ids[: row.numel()]
            valid = torch.zeros(B, L, dtype=torch.bool, device=ids.device)
            valid[row, col] = True
            if per_sample_weights is not None:
                weights = per_sample_weights.new_zeros(B, L)
                weights[row, col] = per_sample_weights[: row.numel()]
            else:
                weights = None
            ids = padded
        else:
            raise ValueError(f"EmbeddingBag input must be 1-D (with offsets) or 2-D, got {ids.dim()}-D")
        if self.padding_idx is not None:
            valid = valid & (ids != self.padding_idx)
        dtype = self.weight.dtype
        w = valid.to(dtype) if weights is None else weights.to(dtype) * valid
        if self.mode == "mean":
            w = w / valid.sum(1, keepdim=True).clamp_min(1).to(dtype)
        return ids, w

    def _checked_bag_lengths(self, ids, offsets):
        """Each bag's start and length from 1-D ``offsets``, checked against ``nn.EmbeddingBag``'s layout.

        Unchecked, offsets not starting at 0 would silently give other bags than they name (the layout
        below reads bag i as ids[starts[i]:starts[i + 1]] and the first bag from ids[0]), and decreasing
        ones would fail inside ``repeat_interleave``. The values checked are read in the same host read
        as the longest bag, which the (B, L) layout needs anyway: the checks add no synchronisation.

        Args:
            ids: (N,) the ids of all bags concatenated.
            offsets: (B,) start of each bag in ``ids``, or (B + 1,) with ``include_last_offset``, the
                last value being len(ids) (torch's CSR layout; torch's own kernels disagree on ids past
                a smaller last value, float32 dropping them and float64 adding them to the last bag, so
                no reading of them would match torch's forward outside a private batch).
        Returns:
            (starts (B,), lengths (B,), L): L the longest bag's length, at least 1 so that bags that
            are all empty still get a (B, 1) layout (weight 0) that ``F.embedding_bag`` accepts.
        Raises:
            ValueError: ``offsets`` not a 1-D int64/int32 tensor, empty with ``include_last_offset``,
                not starting at 0, with a value past len(input), decreasing, or with
                ``include_last_offset`` a last value other than len(input).
        """
        is_tensor = isinstance(offsets, torch.Tensor)
        if not is_tensor or offsets.dim() != 1 or offsets.dtype not in (torch.int64, torch.int32):
            got = f"a {offsets.dim()}-D {offsets.dtype} tensor" if is_tensor else type(offsets).__name__
            raise ValueError(f"offsets must be a 1-D int64 or int32 tensor (the start of each bag in input), got {got}")
        if self.include_last_offset and offsets.numel() == 0:
            raise ValueError("offsets must hold at least one value with include_last_offset=True "
                             "(its last value ends the last bag), got an empty tensor")
        starts = offsets[:-1] if self.include_last_offset else offsets
        if offsets.numel() == 0:
            return starts, starts, 1
        end = offsets[-1:] if self.include_last_offset else offsets.new_tensor([ids.numel()])
        lengths = torch.cat([starts[1:], end]) - starts
        steps = offsets[1:] - offsets[:-1]
        zero = offsets.new_zeros(())
        first, last, smallest_step, longest = torch.stack([
            offsets[0], offsets[-1], steps.min() if steps.numel() else zero,
            lengths.max() if lengths.numel() else zero]).tolist()  # the one host read
        if first != 0:
            raise ValueError(f"offsets must start at 0 (the first bag starts at input[0]), got offsets[0] = {first}")
        if last > ids.numel():
            raise ValueError(f"offsets must be at most len(input) = {ids.numel()}, got offsets[-1] = {last}")
        if smallest_step < 0:
            raise ValueError("offsets must be non-decreasing (bag i is input[offsets[i]:offsets[i + 1]]), "
                             f"got a step of {smallest_step}")
        if self.include_last_offset and last != ids.numel():
            raise ValueError(f"offsets must end with len(input) = {ids.numel()} with include_last_offset=True "
                             f"(the end of the last bag), got offsets[-1] = {last}")
        return starts, lengths, max(longest, 1)

    def _compute(self, x, p):
        ids, w = x
        return F.embedding_bag(ids, p["weight"], mode="sum", per_sample_weights=w)


def _bag_per_sample(m, x, o):
    ids, w = x
    B, d = o.shape
    grads = o.new_zeros(B, m.num_embeddings, d)
    rows = torch.arange(B, device=o.device).unsqueeze(1).expand_as(ids)
    grads.index_put_((rows, ids), w.unsqueeze(-1) * o.unsqueeze(1), accumulate=True)
    return {"weight": grads}


def _bag_sq_norms(m, x, o, names):
    ids, w = x
    B, L = ids.shape
    # coefficient of o_i on table row u: Σ_j w_ij over the bag's entries equal to u
    acc = torch.float64 if o.dtype == torch.float64 else torch.float32
    rows = emb_ops.same_token_rows(ids, m.num_embeddings)
    coef = torch.zeros(B * L, dtype=acc, device=o.device).index_add_(0, rows, w.reshape(-1).to(acc))
    return coef.view(B, L).pow(2).sum(1) * o.to(acc).pow(2).sum(1)


def _bag_clipped(m, x, o, weights, names):
    ids, w = x
    # scaled and added in fp32 for fp16/bf16, rounded once (as ``embedding_clipped_grad_reference``)
    acc = acc_dtype(o)
    scale = w.to(acc) if weights is None else w.to(acc) * weights.to(acc).unsqueeze(1)
    rows = (scale.unsqueeze(-1) * o.to(acc).unsqueeze(1)).flatten(0, 1)
    grad = torch.zeros(m.num_embeddings, o.shape[1], dtype=acc, device=o.device).index_add_(0, ids.flatten(), rows)
    return {"weight": grad.to(o.dtype)}


register_layer(nn.EmbeddingBag, DPEmbeddingBag, LayerRule(_bag_per_sample, _bag_sq_norms, _bag_clipped,
                                                          rounding=exact_scaling))  # scaled in fp32
