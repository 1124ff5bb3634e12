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
    o = o.reshape(B, ids.shape[1], o.shape[-1]).to(dtype)
    sample = torch.arange(B, device=ids.device).unsqueeze(1).expand_as(ids)
    keys = sample * num_embeddings + ids
    rows = o
    if padding_idx is not None:
        keep = ids != padding_idx
        keys, rows = keys[keep], o[keep]
    else:
        keys, rows = keys.reshape(-1), o.reshape(-1, o.shape[-1])
    unique, inverse = torch.unique(keys, return_inverse=True)
    summed = torch.zeros(unique.numel(), o.shape[-1], dtype=dtype, device=o.device)
    summed.index_add_(0, inverse, rows)
    out = torch.zeros(B, dtype=dtype, device=o.device)
    return out.index_add_(0, unique // num_embeddings, summed.pow(2).sum(-1))


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
    """
    B, p = ids.shape[0], o.shape[-1]
    ids = ids.reshape(B, math.prod(ids.shape[1:]))
    o = o.reshape(B, ids.shape[1], p)
    if weights is not None:
        o = o * weights.to(o.dtype).view(-1, 1, 1)
    ids, o = ids.reshape(-1), o.reshape(-1, p)
    out = torch.zeros(num_embeddings, p, dtype=o.dtype, device=o.device).index_add_(0, ids, o)
    if padding_idx is not None:  # the padding row gets no gradient (zeroed, not masked: no host sync)
        out[padding_idx] = 0
    return out


def embedding_per_sample_grads(ids, o, num_embeddings, padding_idx) -> torch.Tensor:
    """Materialized per-sample gradients G_i of the embedding table: for tied parameters and oracles only.

    Args:
        ids: (B, T) integer token ids in [0, num_embeddings) (or any (B, ...) shape, flattened per sample).
        o: (B, T, p) gradients of the summed loss w.r.t. the embedding outputs (or (B, ..., p)).
        num_embeddings: V, the table's number of rows.
        padding_idx: the token id that gets no gradient (its row stays 0), or None.
    Returns:
        (B, V, p) in ``o``'s dtype, a fresh tensor (B·V·p values: large for a real vocabulary).
    """
    B, p = ids.shape[0], o.shape[-1]
    ids = ids.reshape(B, math.prod(ids.shape[1:]))
    o = o.reshape(B, ids.shape[1], p)
    out = torch.zeros(B, num_embeddings, p, dtype=o.dtype, device=o.device)
    if padding_idx is not None:
        o = o * (ids != padding_idx).unsqueeze(-1).to(o.dtype)
    return out.scatter_add_(1, ids.unsqueeze(-1).expand(-1, -1, p), o)
