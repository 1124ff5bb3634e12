"""Reused CPU buffers for the per-sample gradients book-keeping keeps until the end of a backward.

A layer whose per-sample gradients are small (``linear.prefer_per_sample``) forms them once and
keeps them until every layer's norms are known. Fresh memory for them every step is costly on a
CPU: the allocator returns a freed block of many MiB to the kernel, and the next step takes a page
fault per 4 KiB to get it back (about 2 µs each in a VM: ~100 ms per step for the 200 MB of a
small transformer, a fifth of its non-private step). The clipping state hands buffers back with
``recycle`` once it has used them; ``empty`` gives them out again for the same shape.

Only buffers this module lent are taken back, so a tensor someone else may still hold (an output
gradient, a view) is never reused. What the pool holds between steps is what the previous
backward used at its peak, at most ``MAX_BYTES``; ``clear`` frees it.
"""
from __future__ import annotations

import weakref

import torch

# Buffers smaller than this come from the allocator's own free lists quickly: not pooled.
MIN_BYTES = 1 << 20
# Most bytes the pool keeps between uses; a buffer returned beyond it is freed. Also the most bytes
# lent at once that ``linear.prefer_per_sample`` lets book-keeping keep (beyond it, layers compute
# norms and clipped sums without forming per-sample gradients).
MAX_BYTES = 1 << 30

_free: dict[tuple, list[torch.Tensor]] = {}        # (shape, dtype, device) → buffers ready to lend
_lent: dict[int, tuple[weakref.ref, int]] = {}     # id → (buffer, bytes): lent by ``empty``, not returned
_free_bytes = 0
_lent_bytes = 0


def lent_bytes() -> int:
    """Bytes of CPU buffers lent by ``empty`` and neither returned nor freed.

    Returns:
        an int ≥ 0, in bytes (``linear.prefer_per_sample`` forms no more per-sample gradients that
        would take it past ``MAX_BYTES``).
    """
    return _lent_bytes


def _forget(ident: int) -> None:
    global _lent_bytes
    entry = _lent.pop(ident, None)
    if entry is not None:
        _lent_bytes -= entry[1]


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized contiguous tensor, from the pool when one of this shape was recycled.

    A CPU tensor is lent (counted in ``lent_bytes`` until ``recycle`` takes it back or it is freed);
    on any other device this is plain ``torch.empty``.

    Args:
        shape: the tensor's shape (any sequence of ints).
        dtype: its dtype.
        device: its device.
    Returns:
        a tensor of ``shape``, ``dtype`` and ``device`` with arbitrary contents.
    """
    global _free_bytes, _lent_bytes
    shape, device = torch.Size(shape), torch.device(device)
    nbytes = shape.numel() * dtype.itemsize
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    ready = _free.get((shape, dtype, device)) if nbytes >= MIN_BYTES else None
    if ready:
        buffer = ready.pop()
        _free_bytes -= nbytes
    else:
        buffer = torch.empty(shape, dtype=dtype, device=device)
    ident = id(buffer)
    _lent[ident] = (weakref.ref(buffer, lambda _, ident=ident: _forget(ident)), nbytes)
    _lent_bytes += nbytes
    return buffer


def recycle(tensors) -> None:
    """Take back buffers lent by ``empty`` whose caller is done with them; others are ignored.

    A returned buffer of at least ``MIN_BYTES`` is pooled while the pool holds at most ``MAX_BYTES``;
    the others are only forgotten (freed once nothing references them).

    Args:
        tensors: an iterable of tensors; only the buffers ``empty`` lent themselves (not views of
            them) are taken back.
    Returns:
        None.
    """
    global _free_bytes
    for t in tensors:
        entry = _lent.get(id(t))
        if entry is None or entry[0]() is not t:
            continue
        _forget(id(t))
        nbytes = t.numel() * t.element_size()
        if MIN_BYTES <= nbytes and _free_bytes + nbytes <= MAX_BYTES:
            _free.setdefault((t.shape, t.dtype, t.device), []).append(t)
            _free_bytes += nbytes


def batch_chunks(B: int, per_sample: int, budget: int) -> list[slice]:
    """The batch cut into chunks of at most ``budget`` elements of per-sample work, as even as possible.

    Even chunks (sizes differing by at most one) keep every chunk as large as the budget allows: a
    greedy cut leaves a short last chunk, and a one-sample chunk can fall to a slow kernel (torch's
    convolution weight gradient with one group does, on a CPU).

    Args:
        B: the batch size (≥ 0).
        per_sample: elements of work per sample (≥ 1; 0 is taken as 1).
        budget: most elements per chunk; a chunk holds at least one sample whatever the budget.
    Returns:
        a list of ``slice(start, stop)`` covering ``range(B)`` in order; ``[slice(0, B)]`` when the
        batch fits, and an empty list for B = 0.
    """
    per_chunk = max(1, budget // max(1, per_sample))
    n = -(-B // per_chunk)  # ceil
    return [slice(k * B // n, (k + 1) * B // n) for k in range(n)]


def clear() -> None:
    """Free every pooled buffer (buffers still lent stay with their holders).

    Returns:
        None.
    """
    global _free_bytes
    _free.clear()
    _free_bytes = 0
