"""Embedding per-sample norms and clipped gradients (DESIGN.md §2).

The per-sample gradient of an embedding table has rows only at the tokens the sample contains, and
a token repeated within a sample adds its output gradients into the same row:
‖G_i‖² = Σ_{v ∈ tokens(i)} ‖Σ_{t: x_{i,t}=v} o_{i,t}‖². Padding indices get no gradient.
"""
from __future__ import annotations

import math

import torch

from .dispatch import declare
from .linear import acc_dtype


def same_token_rows(ids: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    """A row index per token where the tokens of the same id in the same sample meet.

    The row is the position where the token's id first occurs among its sample's sorted ids, offset
    by the sample's first row: sample i's rows lie in [iT, (i+1)T). Every shape is static (B·T rows,
    some unused), so nothing waits for the device as ``torch.unique`` would (its output size is the
    number of distinct tokens); a CUDA graph can capture it.

    Args:
        ids: (B, T) integer ids in [0, num_embeddings).
        num_embeddings: V.
    Returns:
        (B·T,) int64 rows in [0, B·T), in the order of ``ids.reshape(-1)``.
    """
    B = ids.shape[0]
    keys = ids + torch.arange(0, B * num_embeddings, num_embeddings, device=ids.device).unsqueeze(1)
    keys = keys.reshape(-1)
    return torch.searchsorted(keys.sort().values, keys)


def embedding_sq_norms_reference(ids: torch.Tensor, o: torch.Tensor, num_embeddings: int,
                                 padding_idx: int | None) -> torch.Tensor:
    """‖G_i‖² = Σ_{v ∈ tokens(i)} ‖Σ_{t: x_{i,t}=v} o_{i,t}‖² per sample, in plain torch (exact).

    Args:
        ids: (B, T) integer token ids in [0, num_embeddings) (any (B, ...) shape, read as (B, T) with
            T the product of its trailing dims).
        o: (B, T, p) gradients of the summed loss w.r.t. the embedding outputs (or (B, ..., p) matching ``ids``).
        num_embeddings: V, the table's number of rows.
        padding_idx: the token id that gets no gradient, or None.
    Returns:
        (B,) squared norms (repeated tokens summed first), fp32 (fp64 for fp64 ``o``).
    """
    B = ids.shape[0]
    dtype = acc_dtype(o)
    ids = ids.reshape(B, math.prod(ids.shape[1:]))
    T, p = ids.shape[1], o.shape[-1]
    o = o.reshape(B, T, p).to(dtype)
    if padding_idx is not None:  # padding adds nothing (zeroed by masked_fill: a mask index would sync)
        o = o.masked_fill((ids == padding_idx).unsqueeze(-1), 0)
    rows = same_token_rows(ids, num_embeddings)
    summed = torch.zeros(B * T, p, dtype=dtype, device=o.device).index_add_(0, rows, o.reshape(B * T, p))
    return summed.view(B, T, p).pow(2).sum((1, 2))


_EMBEDDING_SQ_NORMS = declare("embedding_sq_norms", embedding_sq_norms_reference)


def embedding_sq_norms(ids, o, num_embeddings, padding_idx):
    """Per-sample squared norms of an embedding table's gradient: the kernel on CUDA, else the reference.

    Args:
        ids, o, num_embeddings, padding_idx: as in ``embedding_sq_norms_reference``.
    Returns:
        (B,) fp32 (fp64 for fp64 ``o``, which runs the reference).
    """
    return _EMBEDDING_SQ_NORMS.pick(o)(ids, o, num_embeddings, padding_idx)


def embedding_clipped_grad_reference(ids: torch.Tensor, o: torch.Tensor, weights: torch.Tensor | None,
                                     num_embeddings: int, padding_idx: int | None) -> torch.Tensor:
    """Σ_i w_i G_i: rows of o scaled by w_i, scattered into the (V, p) table.

    Args:
        ids: (B, T) integer token ids in [0, num_embeddings) (or any (B, ...) shape, flattened per sample).
        o: (B, T, p) gradients of the summed loss w.r.t. the embedding outputs (or (B, ..., p)).
        weights: (B,) clip weights w_i, or None for the plain sum Σ_i G_i.
        num_embeddings: V, the table's number of rows.
        padding_idx: the token id whose row gets no gradient (zeroed), or None.
    Returns:
        (V, p) gradient of the table, in ``o``'s dtype, on ``o``'s device.

    fp16/bf16 rows are scaled and added in fp32, rounded once at the end: scaled in their own dtype,
    each w_i·o_t would round relative to itself, and a token repeated with gradients that cancel
    could push a record past its bound (rows added in bf16 also lose the small to the large).
    """
    B, p = ids.shape[0], o.shape[-1]
    dtype = o.dtype
    acc = acc_dtype(o)
    ids = ids.reshape(B, math.prod(ids.shape[1:]))
    o = o.reshape(B, ids.shape[1], p).to(acc)
    if weights is not None:
        o = o * weights.to(acc).view(-1, 1, 1)
    ids, o = ids.reshape(-1), o.reshape(-1, p)
    out = torch.zeros(num_embeddings, p, dtype=acc, device=o.device).index_add_(0, ids, o)
    if padding_idx is not None:  # the padding row gets no gradient (zeroed, not masked: no host sync)
        out[padding_idx] = 0
    return out.to(dtype)


def embedding_per_sample_grads(ids, o, num_embeddings, padding_idx, out: torch.Tensor | None = None) -> torch.Tensor:
    """Materialized per-sample gradients G_i of the embedding table: for tied parameters and oracles only.

    Args:
        ids: (B, T) integer token ids in [0, num_embeddings) (or any (B, ...) shape, flattened per sample).
        o: (B, T, p) gradients of the summed loss w.r.t. the embedding outputs (or (B, ..., p)).
        num_embeddings: V, the table's number of rows.
        padding_idx: the token id that gets no gradient (its row stays 0), or None.
        out: a (B, V, p) tensor of ``o``'s dtype to add them into in place (a tied weight's per-sample
            gradients of its other uses), or None.
    Returns:
        (B, V, p) in ``o``'s dtype: ``out`` plus G_i, or a fresh tensor (B·V·p values: large for a real
        vocabulary).
    """
    B, p = ids.shape[0], o.shape[-1]
    ids = ids.reshape(B, math.prod(ids.shape[1:]))
    o = o.reshape(B, ids.shape[1], p)
    if out is None:
        out = torch.zeros(B, num_embeddings, p, dtype=o.dtype, device=o.device)
    elif out.shape != (B, num_embeddings, p) or out.dtype != o.dtype:
        raise ValueError(f"out must be {(B, num_embeddings, p)} of dtype {o.dtype}, got {tuple(out.shape)} {out.dtype}")
    if padding_idx is not None:
        o = o * (ids != padding_idx).unsqueeze(-1).to(o.dtype)
    return out.scatter_add_(1, ids.unsqueeze(-1).expand(-1, -1, p), o)
