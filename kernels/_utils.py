"""Helpers shared by the kernel launchers: block sizes, dot precision, output allocation."""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from pdpfast.ops.dispatch import triton_interpret

# Tests set this to True: freshly allocated outputs and partial buffers are then filled with NaN,
# so a kernel that forgets to write an element fails loudly instead of returning stale memory.
POISON_OUTPUTS = False

# tl.dot precision for fp32 tiles where torch allows no TF32 (a launcher passes ``tf32=True`` where it
# does). "tf32x3": three TF32 tensor-core products (each operand split into two TF32 halves, the
# lo·lo product dropped), near-fp32: on an H100 (bench_kernels, 2026-11-24) linear Gram norms
# 7e-7 from float64 (exact fp32 products: 3e-7) at 0.86 ms against cuBLAS fp32's 1.63 at
# (32, 512, 1024, 4096), and 4.0 ms with exact FMA products. Clip bounds keep a margin for it
# (``pdpfast.clipping.rounding_margin``). "ieee" (exact, on the FMA units) remains for tests and
# for bench_kernels' comparison.
FP32_DOT_PRECISION = "tf32x3"

LOW_PRECISION = (torch.float16, torch.bfloat16)

# Grouped launches' tables (``table_on``), by (device, values): slices of one int64 buffer a device
# (its arena), allocated once. A BERT-base step with per-layer clipping makes ~25 tables of ~3,000
# entries together, a step's noise tables (``pdpfast.kernels.noise``) among them.
TABLE_ARENA_ENTRIES = 1 << 16  # (512 KiB a device)
_TABLES: dict = {}
_ARENAS: dict = {}  # device -> [buffer, entries in use]
TABLE_STATS = {"hits": 0, "builds": 0}  # lookups of ``table_on`` since import (tests, benchmarks)
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def new_buffer(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An output the kernel must fully write (NaN-poisoned under tests).

    Args:
        shape: the buffer's shape (a tuple of ints).
        dtype: its dtype.
        device: its device.
    Returns:
        an uninitialized tensor, or one filled with NaN when ``POISON_OUTPUTS`` is set.
    """
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for ints, in plain Python: ``triton.cdiv`` is a constexpr function whose host call
    unwraps its arguments (~1.4 µs against ~0.03), and launchers call it per layer per step.

    Args:
        a: an int ≥ 0; b: an int > 0.
    Returns:
        an int.
    """
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ ``n`` (1 for n ≤ 1), in plain Python (see ``cdiv``).

    Args:
        n: an int.
    Returns:
        an int.
    """
    return 1 << (n - 1).bit_length() if n > 1 else 1


def block(n: int, lo: int, hi: int) -> int:
    """A power-of-two block covering ``n`` when it can, clamped to [lo, hi].

    Args:
        n: the extent to cover (elements along one dim); values < 1 count as 1.
        lo: the smallest block, a power of two.
        hi: the largest block, a power of two.
    Returns:
        max(lo, min(hi, next_power_of_2(n))), an int.
    """
    return max(lo, min(hi, next_power_of_2(n)))


def dot_flags(dtype: torch.dtype, tf32: bool = False) -> dict:
    """Constexprs of ``_dot``: input precision, and whether to upcast operands to fp32 first.

    The Triton interpreter multiplies bf16 tiles as their raw uint16 bit patterns (triton 3.x
    stores bf16 as uint16 in numpy), so under TRITON_INTERPRET=1 bf16 tiles are upcast to fp32
    before ``tl.dot``; the products of bf16 values are exact in fp32, so the result is the same
    math. On a GPU bf16 tiles go to the tensor cores as they are.

    Args:
        dtype: the dtype of the tiles the kernel multiplies.
        tf32: fp32 tiles go to the tensor cores as TF32 (one product): for a launcher whose caller
            allowed it the way torch allows cuDNN's TF32 convolutions (and whose clip bounds keep the
            TF32 margin, ``pdpfast.clipping.rounding_margin``).
    Returns:
        {"DOT_PRECISION": "tf32" for fp32 with ``tf32``, else ``FP32_DOT_PRECISION`` for fp32, else
        "tf32"; "UPCAST": True only for bf16 under the interpreter}, passed as keyword arguments of
        the launch.
    """
    return {
        "DOT_PRECISION": ("tf32" if tf32 else FP32_DOT_PRECISION) if dtype == torch.float32 else "tf32",
        "UPCAST": dtype == torch.bfloat16 and triton_interpret(),  # the environment read only for bf16
    }


def device_guard(t: torch.Tensor):
    """Launch on the tensors' own GPU, not the current one.

    Args:
        t: a tensor of the launch.
    Returns:
        a context manager: ``torch.cuda.device(t.device)`` for a CUDA tensor on another GPU than the
        current one, else a no-op.
    """
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _NO_GUARD  # on the current GPU (nearly always): switching to it would cost host time per launch


_NO_GUARD = contextlib.nullcontext()


def grouped_offsets(calls: list, align: int) -> torch.Tensor | None:
    """The offsets table of one launch over n same-layout calls (a grouped launch): each program reads
    its call's tensors at an offset from the first call's.

    Args:
        calls: n ≥ 1 pairs (a, o) of tensors.
        align: the byte boundary every tensor must start on (16: the kernel assumes aligned rows).
    Returns:
        (2n,) int64 on the calls' device (queued from pinned memory), call c's a and o starting
        offsets[2c] and offsets[2c + 1] elements past the first call's; None unless every call has the
        first one's shapes and strides, all tensors one dtype and device, and every start is aligned
        (the calls then take a launch each).
    """
    a0, o0 = calls[0]
    if not all(a.shape == a0.shape and o.shape == o0.shape and a.stride() == a0.stride() and
               o.stride() == o0.stride() and a.dtype == o.dtype == a0.dtype and a.device == o.device == a0.device
               for a, o in calls):
        return None
    size, ptrs = a0.element_size(), [(a.data_ptr(), o.data_ptr()) for a, o in calls]
    if any(p % align for pair in ptrs for p in pair):
        return None
    return table_on([(p - p0) // size for pair in ptrs for p, p0 in zip(pair, ptrs[0])], a0.device)


def table_on(values: list, device: torch.device) -> torch.Tensor:
    """A grouped launch's table on its device, cached by content.

    A table holds offsets between the calls' tensors, their widths and strides. A step of fixed
    shapes makes the same allocations in the same order every time, so torch's caching allocator
    hands out the same addresses and the step's tables repeat: a cached one is reused instead of
    being built anew (on a GPU a host tensor made in pinned memory and a queued copy, 2 host ops per
    grouped launch). Tables are slices of one buffer a device, allocated once: a table allocated on its own
    would stay in the caching allocator's pool of small blocks, where it would move the next step's
    small tensors, and so their tables, elsewhere (a miss that makes the next one). When a new table
    no longer fits, the device's cached tables are dropped with their buffer, which goes back to
    torch's allocator (it reuses a block only on the stream that allocated it, after what that
    stream queued), and a new buffer is taken.

    A table is valid until the next ``table_on`` on its device (a new table may drop it): launch the
    kernel that reads it first. Like any tensor read on a stream other than its own without
    ``record_stream``, a table is ordered only on the stream current when it was built; pdpfast
    launches its grouped kernels on the backward's stream.

    Args:
        values: the table's ints, flat; device: the launch's device.
    Returns:
        (len(values),) int64 on ``device``: on a GPU queued from pinned memory, not waited for.
    Raises:
        RuntimeError inside a CUDA graph capture, cached or not: a graph would keep reading a slice a
        later table may overwrite, and a new one's host copy cannot be captured (``pdpfast.graphs``
        keeps one launch per call).
    """
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():  # (a cached table too: it may be rewritten)
        raise RuntimeError("a grouped launch's table is asked for inside a CUDA graph capture: launch the calls one by "
                           "one there (pdpfast.graphs turns ClippingState.group_calls off while it captures)")
    key = (device, tuple(values))
    table = _TABLES.get(key)
    if table is not None:
        TABLE_STATS["hits"] += 1
        return table
    cuda = device.type == "cuda"
    host = torch.tensor(values, dtype=torch.int64, pin_memory=cuda)  # (made pinned: no second host copy)
    n = len(values)
    start = _arena_start(device, n)
    if start is None:  # (larger than the arena: a table of its own, not cached)
        table = torch.empty(n, dtype=torch.int64, device=device)
    else:
        table = _ARENAS[device][0][start:start + n]
        _TABLES[key] = table
    table.copy_(host, non_blocking=True)
    TABLE_STATS["builds"] += 1
    return table


def _arena_start(device: torch.device, n: int) -> int | None:
    """Where ``device``'s arena holds the next table of n entries (16-byte aligned, as Triton assumes
    of pointers); when it is full, a new arena, the device's cached tables dropped with the old one;
    None when n exceeds an arena."""
    if n > TABLE_ARENA_ENTRIES:
        return None
    arena = _ARENAS.get(device)
    if arena is None or arena[1] + n > arena[0].numel():
        _drop_tables(device)
        arena = _ARENAS[device] = [torch.empty(TABLE_ARENA_ENTRIES, dtype=torch.int64, device=device), 0]
    start = arena[1]
    arena[1] = start + n + (n & 1)
    return start


def _drop_tables(device: torch.device) -> None:
    for key in [key for key in _TABLES if key[0] == device]:
        del _TABLES[key]


def sum_partials(partials: torch.Tensor) -> torch.Tensor:
    """Per-sample sums of per-program partial sums, deterministic (no atomics).

    Args:
        partials: (B, n) fp32, one column per program of a sample.
    Returns:
        (B,) in ``partials``' dtype: a view of its only column when n = 1, else a fresh sum.
    """
    if partials.shape[1] == 1:
        return partials.view(partials.shape[0])
    return partials.sum(1)


@triton.jit
def _dot(x, y, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + x @ y with fp32 accumulation (see ``dot_flags``)."""
    if UPCAST:
        x = x.to(tl.float32)
        y = y.to(tl.float32)
    return tl.dot(x, y, acc, input_precision=DOT_PRECISION)
