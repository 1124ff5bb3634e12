"""Reused CPU buffers for the per-sample gradients book-keeping keeps until the end of a backward.

A layer whose per-sample gradients are small (``linear.prefer_per_sample``) forms them once and
keeps them until every layer's norms are known. Fresh memory for them every step is costly on a
CPU: the allocator returns a freed block of many MiB to the kernel, and the next step takes a page
fault per 4 KiB to get it back (about 2 µs each in a VM: ~100 ms per step for the 200 MB of a
small transformer, a fifth of its non-private step). The clipping state hands buffers back with
``recycle`` once it has used them; ``empty`` lends them out again.

A Poisson batch has a new size at every step, so a buffer is lent for any shape it can hold: the
request is a view of the smallest pooled buffer (of its dtype and device) that holds it and is at
most ``REUSE_SLACK`` times its size. A new buffer is made only for a batch larger than every one
before it (a new maximum, ever rarer as a run goes on). The pool keeps at most as many buffers as were
ever lent at once (the backward's peak), the most recently returned, and at most ``MAX_BYTES``: a run
whose shapes drift does not pile up buffers for sizes it no longer asks for.

Only buffers this module lent are taken back, so a tensor someone else may still hold (an output
gradient, a view) is never reused. ``clear`` frees the pool.
"""
from __future__ import annotations

import bisect
import itertools
import weakref

import torch

# Buffers smaller than this come from the allocator's own free lists quickly: not pooled.
MIN_BYTES = 1 << 20
# Most bytes the pool keeps between uses; a buffer returned beyond it is freed. Also the most bytes
# lent at once that ``linear.prefer_per_sample`` lets book-keeping keep (beyond it, layers compute
# norms and clipped sums without forming per-sample gradients).
MAX_BYTES = 1 << 30
# A pooled buffer serves a request of at least 1/REUSE_SLACK of its size.
REUSE_SLACK = 2

# (dtype, device) → [(elements, returned at, buffer)] ready to lend, by size: flat buffers
_free: dict[tuple, list[tuple[int, int, torch.Tensor]]] = {}
# id of a lent view → (the view, bytes of its buffer, its buffer, its key): lent by ``empty``, not returned
_lent: dict[int, tuple[weakref.ref, int, torch.Tensor, tuple | None]] = {}
_lent_count: dict[tuple, int] = {}   # pooled-size buffers lent now, per key
_peak: dict[tuple, int] = {}         # most of them ever lent at once (since ``clear``)
_ticks = itertools.count()           # return order: the pool drops the buffer that has waited longest
_free_bytes = 0
_lent_bytes = 0


def lent_bytes() -> int:
    """Bytes of CPU buffers lent by ``empty`` and neither returned nor freed.

    Returns:
        an int ≥ 0, in bytes of the lent buffers (a request served by a larger buffer counts all of it;
        ``linear.prefer_per_sample`` forms no more per-sample gradients that would take it past
        ``MAX_BYTES``).
    """
    return _lent_bytes


def _forget(ident: int) -> None:
    global _lent_bytes
    if _lent is None:  # a lent tensor freed at interpreter exit, after this module's globals
        return
    entry = _lent.pop(ident, None)
    if entry is not None:
        _lent_bytes -= entry[1]
        if entry[3] is not None:
            _lent_count[entry[3]] -= 1


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized contiguous tensor, from the pool when a buffer that holds it was recycled.

    A CPU tensor is lent (counted in ``lent_bytes`` until ``recycle`` takes it back or it is freed); on
    any other device this is plain ``torch.empty``.

    Args:
        shape: the tensor's shape (any sequence of ints).
        dtype: its dtype.
        device: its device.
    Returns:
        a contiguous tensor of ``shape``, ``dtype`` and ``device`` with arbitrary contents (a view of a
        pooled buffer, at its start, when it is at least ``MIN_BYTES``).
    """
    global _free_bytes, _lent_bytes
    shape, device = torch.Size(shape), torch.device(device)
    n = shape.numel()
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    key = None
    if n * dtype.itemsize >= MIN_BYTES:
        key = (dtype, device)
        ready = _free.get(key, ())
        at = bisect.bisect_left(ready, (n,))  # the smallest that holds n elements
        if at < len(ready) and ready[at][0] <= REUSE_SLACK * n:
            size, _, buffer = ready.pop(at)
            _free_bytes -= size * dtype.itemsize
        else:
            buffer = torch.empty(n, dtype=dtype, device=device)
        view = buffer[:n].view(shape)
        _lent_count[key] = count = _lent_count.get(key, 0) + 1
        _peak[key] = max(_peak.get(key, 0), count)
    else:
        view = buffer = torch.empty(shape, dtype=dtype, device=device)
    ident, nbytes = id(view), buffer.numel() * dtype.itemsize
    _lent[ident] = (weakref.ref(view, lambda _, ident=ident: _forget(ident)), nbytes, buffer, key)
    _lent_bytes += nbytes
    return view


def recycle(tensors) -> None:
    """Take back buffers lent by ``empty`` whose caller is done with them; others are ignored.

    A returned buffer of at least ``MIN_BYTES`` is pooled; the pool then drops the buffers that have
    waited longest while it holds more than the most ever lent at once, or more than ``MAX_BYTES``.

    Args:
        tensors: an iterable of tensors; only the tensors ``empty`` returned (not views of them) are
            taken back.
    Returns:
        None.
    """
    global _free_bytes
    for t in tensors:
        entry = _lent.get(id(t))
        if entry is None or entry[0]() is not t:
            continue
        _forget(id(t))
        _, nbytes, buffer, key = entry
        if key is None:
            continue
        ready = _free.setdefault(key, [])
        bisect.insort(ready, (buffer.numel(), next(_ticks), buffer))  # (a tick is never equal: no tensor compared)
        _free_bytes += nbytes
        while ready and (len(ready) > _peak[key] or _free_bytes > MAX_BYTES):
            oldest = min(range(len(ready)), key=lambda i: ready[i][1])
            size, _, dropped = ready.pop(oldest)
            _free_bytes -= size * dropped.element_size()


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
    _peak.clear()
    _peak.update(_lent_count)  # buffers still lent may come back
    _free_bytes = 0
