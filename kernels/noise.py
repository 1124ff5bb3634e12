"""In-place Gaussian noise on a list of gradients, reproducible from (seed, step) (DESIGN.md §1.4).

One launch per (device, dtype) group of tensors — a single launch for the usual all-fp32 or
all-bf16 parameter list. The launch gets a small table (address, numel, first Philox counter,
first block) of its tensors; each program binary-searches the table for the tensor its block
belongs to. Element e of the j-th tensor in the list draws from the Philox counter range
reserved for that tensor, so the noise depends only on (seed, step), the list's shapes and
``NOISE_BLOCK`` — not on how tensors are grouped or on the device.

Not bitwise equal to ``pdpfast.ops.noise.add_noise_reference_`` (torch's generator); both draw
i.i.d. N(0, std²) per element.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdpfast import _ext
from pdpfast.ops.dispatch import register
from pdpfast.ops.noise import set_aside_pinned, step_seed, take_pinned

from ._utils import cdiv, device_guard, table_on

# Fixed, not tuned: the noise stream is a function of the block size.
NOISE_BLOCK = 4096


@triton.jit
def _add_noise_chunk(ptr, idx, numel, noise, std, COMPUTE_FP64: tl.constexpr):
    valid = idx < numel
    g = tl.load(ptr + idx, mask=valid, other=0.0)
    if COMPUTE_FP64:
        g = g + (noise * std).to(tl.float64)
    else:
        g = g.to(tl.float32) + noise * std
    tl.store(ptr + idx, g.to(ptr.dtype.element_ty), mask=valid)


@triton.jit(do_not_specialize=["seed"])
def _add_noise_kernel(first_ptr, table_ptr, n_tensors, seed, std,
                      SEARCH_STEPS: tl.constexpr, COMPUTE_FP64: tl.constexpr, BLOCK: tl.constexpr,
                      SEED_FROM_PTR: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    if SEED_FROM_PTR:  # a captured graph: the step's seed is read at run time, not baked in at capture
        seed = tl.load(seed)
    # table rows: 0 address, 1 numel, 2 first Philox counter, 3 first block (ascending)
    lo = pid * 0
    hi = lo + n_tensors
    for _ in tl.static_range(SEARCH_STEPS):  # largest j with first_block[j] <= pid
        mid = (lo + hi) // 2
        right = tl.load(table_ptr + 3 * n_tensors + mid) <= pid
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    ptr = tl.load(table_ptr + lo).to(first_ptr.dtype)
    numel = tl.load(table_ptr + n_tensors + lo)
    counter_base = tl.load(table_ptr + 2 * n_tensors + lo)
    local_block = pid - tl.load(table_ptr + 3 * n_tensors + lo)

    # one Philox call yields four normals: counter c serves the four elements c + k·BLOCK/4 of
    # the block, k = 0..3, so every element of every tensor uses its own (counter, lane)
    QUARTER: tl.constexpr = BLOCK // 4
    lanes = tl.arange(0, QUARTER)
    n0, n1, n2, n3 = tl.randn4x(seed, counter_base + local_block * QUARTER + lanes)
    idx = local_block * BLOCK + lanes
    _add_noise_chunk(ptr, idx, numel, n0, std, COMPUTE_FP64)
    _add_noise_chunk(ptr, idx + QUARTER, numel, n1, std, COMPUTE_FP64)
    _add_noise_chunk(ptr, idx + 2 * QUARTER, numel, n2, std, COMPUTE_FP64)
    _add_noise_chunk(ptr, idx + 3 * QUARTER, numel, n3, std, COMPUTE_FP64)


def _kept_table(values: list, device: torch.device, keep: list) -> torch.Tensor:
    """The table (``_groups``' values, (4, m) flat) int64 on ``device``, not cached: copied by a
    queued copy from a host tensor that ``keep`` holds with it. A CUDA graph capture records the copy
    and repeats it from that tensor at every replay, so on CUDA it is pinned (a capture refuses a copy
    from pageable memory): inside a capture, a pinned buffer an eager run of the same body set aside
    (pinning is not allowed while a stream captures), filled on the host."""
    host = torch.tensor(values, dtype=torch.int64).view(4, -1)
    staging = host
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            staging = take_pinned(host.shape)
            staging.copy_(host)
        else:
            staging = host.pin_memory()
            set_aside_pinned(host.shape)
    table = torch.empty(host.shape, dtype=torch.int64, device=device)
    table.copy_(staging, non_blocking=True)
    keep += (staging, table)
    return table


_NOISE_GROUPS = None if _ext.missing("noise_groups", "noise_plan.cpp") else _ext._C.noise_groups


def _groups(grads: list[torch.Tensor]) -> tuple[list, list]:
    """The launch plan: (groups, writebacks). One group per (device, dtype), in order of first
    appearance: (its first tensor, its table's values, its blocks, its tensors). The table is (4, m)
    flat, m the group's tensors with any elements: addresses, numels, first Philox counters, first
    blocks. Tensor j of the list reserves ``blocks(j) · NOISE_BLOCK / 4`` counters after tensor j-1's,
    whatever its group. A non-contiguous tensor is noised in a contiguous copy, written back after
    the launch: writebacks are (tensor, copy). Built by ``pdpfast._C.noise_groups`` where the
    extension has it (the same plan), here otherwise."""
    if _NOISE_GROUPS is not None:
        planned = _NOISE_GROUPS(grads, NOISE_BLOCK)
        if planned is not None:  # (None: a tensor is not floating point, refused below with its dtype)
            return planned
    quarter = NOISE_BLOCK // 4
    members: dict[tuple, list] = {}
    writebacks = []
    counter = 0
    for g in grads:
        if not g.is_floating_point():
            raise TypeError(f"add_noise_ needs floating tensors, got {g.dtype}")
        n_blocks = cdiv(g.numel(), NOISE_BLOCK)
        if n_blocks:
            target = g
            if not g.is_contiguous():
                target = g.contiguous()
                writebacks.append((g, target))
            members.setdefault((g.device, g.dtype), []).append((target, counter, n_blocks))
        counter += n_blocks * quarter
    groups = []
    for group in members.values():
        first_blocks, blocks = [], 0
        for _, _, n_blocks in group:
            first_blocks.append(blocks)
            blocks += n_blocks
        values = [t.data_ptr() for t, _, _ in group] + [t.numel() for t, _, _ in group] + \
            [c for _, c, _ in group] + first_blocks
        groups.append((group[0][0], values, blocks, len(group)))
    return groups, writebacks


@register("add_noise_")
def add_noise_(grads: list[torch.Tensor], std: float, seed: int, step: int, *,
               device_seed: torch.Tensor | None = None, keep: list | None = None) -> None:
    """g += std · N(0, 1) elementwise, in place, for every tensor in ``grads``.

    One launch per (device, dtype) group; g + std·n is formed in fp32 (fp64 for fp64 tensors) and
    rounded once to the tensor's dtype.

    Args:
        grads: floating tensors of any shapes (fp64/fp32/fp16/bf16; non-contiguous ones go through a
            contiguous copy that is written back).
        std: noise standard deviation σ·C, in the gradients' units (0: nothing is added).
        seed, step: the stream, via ``pdpfast.ops.noise.step_seed`` (ints).
        device_seed: None, or a () int64 tensor on the grads' device holding ``step_seed(seed, step)``
            (``pdpfast.ops.noise.step_seed_tensor``), read by the kernel instead of (seed, step): the
            same noise, for a CUDA graph that replays the launch step after step.
        keep: None (eager steps: the tables are cached by address), or a list for a step body that
            may be captured (``pdpfast.graphs``): each table is then built afresh, copied from a
            (pinned, on CUDA) host tensor by a queued copy, and the list receives both tensors.
            Inside a CUDA graph capture the copy is recorded and repeated from that host tensor at
            every replay, so gradients made inside the capture, whose addresses no earlier run
            knew, get their table; the capture needs an eager run of its body before it.
    Returns:
        None.
    Raises:
        TypeError for a tensor that is not floating point; RuntimeError if a table has to be built
        during CUDA graph capture without ``keep``.
    """
    if not grads or std == 0:
        return
    philox_seed = step_seed(seed, step) if device_seed is None else device_seed
    groups, writebacks = _groups(grads)
    for first, values, blocks, n in groups:
        # (cached by content: it only depends on addresses, sizes and counters)
        table = table_on(values, first.device) if keep is None else _kept_table(values, first.device, keep)
        with device_guard(first):
            _add_noise_kernel[(blocks,)](
                first, table, n, philox_seed, float(std),
                SEARCH_STEPS=max(1, (n - 1).bit_length()), COMPUTE_FP64=first.dtype == torch.float64,
                BLOCK=NOISE_BLOCK, SEED_FROM_PTR=device_seed is not None, num_warps=8)
    for g, target in writebacks:
        g.copy_(target)
