"""Gaussian noise for the clipped sum (DESIGN.md §1.4), reproducible from (seed, step)."""
from __future__ import annotations

import collections
import functools
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ..sampling import GOLDEN_GAMMA, as_int64, logical_shift_right, mix64_, mix64_int, mix64_np_
from .dispatch import declare

# CPU noise for this many elements or more is drawn on several threads (torch releases the GIL).
# Those threads only draw (torch's CPU normal_ is serial); the main thread adds. A thread that ran a
# parallel torch op (add_ on a large tensor) would own an OpenMP team of its own, and from then on
# libgomp sees more threads than cores and stops spin-waiting between parallel regions: every later
# multi-threaded op of the process pays a wake-up. Measured on 2 cores: after one private transformer
# step had added noise on the pool, a GroupNorm CNN's non-private step was 12% slower and its
# private step 30% slower, for the rest of the process.
_PARALLEL_MIN_ELEMENTS = 1 << 18


_MASK64 = (1 << 64) - 1


def step_seed(seed: int, step: int, index: int | None = None) -> int:
    """A 63-bit seed for one step (and one tensor), independent across (seed, step, index).

    SplitMix64 absorbs each word in turn: z ← mix64((z ⊕ word) + γ) from z = 0, then z >> 1 (a few
    hundred ns: this runs once per tensor per step). ``step_seed_tensor`` is the same function on the
    device.

    Args:
        seed: the noise seed, an int (taken modulo 2^64).
        step: the optimizer step, an int (taken modulo 2^64).
        index: None, or the tensor's index, a third word absorbed after ``step``.
    Returns:
        an int in [0, 2^63).
    """
    z = 0
    for word in (seed, step) if index is None else (seed, step, index):
        z = mix64_int((z ^ (int(word) & _MASK64)) + GOLDEN_GAMMA)
    return z >> 1


def step_seed_tensor(seed_and_step: torch.Tensor) -> torch.Tensor:
    """``step_seed(seed, step)`` computed on ``seed_and_step``'s device, equal to the host value bit for bit.

    A captured CUDA graph reads the step from device memory, so its noise follows (seed, step)
    replay after replay with no host value baked in (``pdpfast.graphs``).

    Args:
        seed_and_step: (2,) int64 tensor holding (seed, step) as uint64 bits (``seed_and_step_tensor``).
    Returns:
        a () int64 tensor on the same device, in [0, 2^63).
    """
    golden = as_int64(GOLDEN_GAMMA)
    z = seed_and_step[0].clone()  # 0 ⊕ seed
    mix64_(z.add_(golden))
    z ^= seed_and_step[1]
    mix64_(z.add_(golden))
    return logical_shift_right(z, 1)


def seed_and_step_tensor(seed: int, step: int, device) -> torch.Tensor:
    """(seed, step) as ``step_seed_tensor`` takes them.

    Args:
        seed: the noise seed, an int (its low 64 bits are kept).
        step: the optimizer step, an int (its low 64 bits are kept).
        device: where the tensor is made.
    Returns:
        a (2,) int64 tensor on ``device``, each word's uint64 bits read as int64.
    """
    return torch.tensor([as_int64(seed), as_int64(step)], dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="pdpfast-noise")


# torch's CPU generator is an mt19937 whose ``manual_seed`` keeps only the low 32 bits of a seed: two
# (step, tensor) seeds that agree there would draw the same noise (with seed 0, steps 18539 and 147295
# of one tensor did), and the difference of those two releases would carry no noise at all. A CPU
# generator is therefore given its whole state (624 words) from all 63 bits of the seed.
_MT_WORDS = 624
_MT_STATE_OFFSET = 24      # bytes before the words in ``get_state()``: initial seed, left, seeded, next
_GAMMAS = np.arange(1, _MT_WORDS // 2 + 1, dtype=np.uint64) * np.uint64(GOLDEN_GAMMA)     # k·γ mod 2^64


def _mt19937_words(seed: int) -> np.ndarray:
    """(624,) uint64 words in [0, 2^32): the halves of SplitMix64 outputs mix64(seed + k·γ), k = 1..312.
    The first two are the halves of a bijection of the seed, so distinct seeds give distinct states;
    every word depends on all of the seed's bits."""
    z = mix64_np_(_GAMMAS + np.uint64(seed))
    words = np.empty(_MT_WORDS, dtype=np.uint64)
    words[0::2], words[1::2] = z & np.uint64(0xFFFFFFFF), z >> np.uint64(32)
    return words


@functools.lru_cache(maxsize=1)
def _mt_state_layout_known() -> bool:
    """Whether ``torch.Generator().get_state()`` is laid out as this module writes it: the words that
    ``manual_seed(s)`` sets (mt19937's initialization from s) at ``_MT_STATE_OFFSET``, after left = 1 and
    seeded = 1. Checked once: another torch could lay it out otherwise (then numpy draws the noise)."""
    seed = 12345
    words = [seed]
    for i in range(1, _MT_WORDS):
        words.append((1812433253 * (words[-1] ^ (words[-1] >> 30)) + i) & 0xFFFFFFFF)
    state = torch.Generator().manual_seed(seed).get_state()
    if state.dtype != torch.uint8 or state.numel() < _MT_STATE_OFFSET + 8 * _MT_WORDS:
        return False
    head = state[8:16].view(torch.int32).tolist()
    seeded = state[_MT_STATE_OFFSET:_MT_STATE_OFFSET + 8 * _MT_WORDS].view(torch.int64).tolist()
    return head == [1, 1] and seeded == words


@functools.lru_cache(maxsize=1)
def _seeded_state() -> np.ndarray:
    # a freshly seeded generator's state bytes (no cached normals, left = 1), filled in with numpy:
    # no torch op per generator (they would count as launches of the step)
    return torch.Generator().manual_seed(0).get_state().numpy().copy()


# both asked at import, not inside the first step: they read a CPU generator's state (.tolist(),
# .numpy()), which a step body guarded against host reads (``pdpfast.graphs.no_host_sync``) refuses
_mt_state_layout_known()
_seeded_state()


def _cpu_normal(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """N(0, 1) of ``shape`` and ``dtype`` on the CPU from a generator that follows all 63 bits of ``seed``:
    torch's mt19937 with its whole state written from the seed, or, where its state's layout is not the
    one known here, numpy's PCG64 (full 128-bit seeding, slower)."""
    if _mt_state_layout_known():
        state = _seeded_state().copy()
        state[_MT_STATE_OFFSET:_MT_STATE_OFFSET + 8 * _MT_WORDS].view(np.uint64)[:] = _mt19937_words(seed)
        generator = torch.Generator()
        generator.set_state(torch.from_numpy(state))
        return torch.randn(shape, generator=generator, dtype=dtype)
    draw = np.random.Generator(np.random.PCG64(seed)).standard_normal(
        math.prod(shape), dtype=np.float64 if dtype == torch.float64 else np.float32)
    return torch.from_numpy(draw).reshape(shape).to(dtype)


# Tensors with at least this many elements draw from their own generator (and may be filled on
# several threads); smaller ones share one draw per (device, dtype), so a model with hundreds of
# small tensors costs a few generator set-ups per step, not hundreds.
_OWN_GENERATOR_MIN_ELEMENTS = 1 << 16


def add_noise_reference_(grads: list[torch.Tensor], std: float, seed: int, step: int, *,
                         device_seed: torch.Tensor | None = None, keep: list | None = None) -> None:
    """g += N(0, std²) elementwise, in place, for every tensor in ``grads``, with torch's generators
    (on the CPU an mt19937 whose whole state follows the 63-bit seed, ``_cpu_normal``: ``manual_seed``
    alone would keep 32 bits of it, and two steps could draw the same noise).

    Tensor k of ≥ 2^16 elements draws from a generator seeded by (seed, step, k); the smaller ones
    draw, in list order, from one generator per (device, dtype) group j seeded by
    (seed, step, len(grads) + j). The noise depends only on (seed, step) and the list.

    Args:
        grads: floating tensors of any shapes and devices, changed in place.
        std: the noise standard deviation σ·C, in the gradients' units (0: nothing is added).
        seed: the noise seed (int).
        step: the optimizer step (int).
        device_seed: must be None: torch's generators are seeded on the host, so the reference refuses
            a device-side seed (it is for the kernel, ``add_noise_``).
        keep: unused here (for the kernel's signature).
    Returns:
        None.
    Raises:
        RuntimeError if ``device_seed`` is given; TypeError for a tensor that is not floating-point.
    """
    if device_seed is not None:
        raise RuntimeError("noise from a device-side step counter (a captured CUDA graph) needs the Triton noise "
                           "kernel; it is not available here (pdpfast.ops.dispatch.triton_import_error(), or "
                           "PDPFAST_DISABLE_TRITON is set)")
    if not grads or std == 0:
        return
    n = len(grads)

    def normal(shape, device, dtype, index: int) -> torch.Tensor:
        if not dtype.is_floating_point:
            raise TypeError(f"noise is added to floating-point gradients, got a {dtype} tensor")
        seed_k = step_seed(seed, step, index)
        if device.type == "cpu":
            return _cpu_normal(shape, dtype, seed_k)
        generator = torch.Generator(device=device).manual_seed(seed_k)     # CUDA's Philox keeps all 64 bits
        return torch.randn(shape, generator=generator, device=device, dtype=dtype)

    def draw(k: int) -> torch.Tensor:
        g = grads[k]
        return normal(g.shape, g.device, g.dtype, k)

    large = [k for k in range(n) if grads[k].numel() >= _OWN_GENERATOR_MIN_ELEMENTS]
    small: dict[tuple, list[torch.Tensor]] = {}
    for k in range(n):
        if grads[k].numel() < _OWN_GENERATOR_MIN_ELEMENTS:
            small.setdefault((grads[k].device, grads[k].dtype), []).append(grads[k])
    for j, ((device, dtype), group) in enumerate(small.items()):
        shared = normal((sum(g.numel() for g in group),), device, dtype, n + j)
        torch._foreach_add_(group, [c.view(g.shape) for c, g in zip(shared.split([g.numel() for g in group]), group)],
                            alpha=std)
    on_cpu = all(grads[k].device.type == "cpu" for k in large)
    if on_cpu and len(large) > 1 and sum(grads[k].numel() for k in large) >= _PARALLEL_MIN_ELEMENTS:
        # the pool draws ahead, at most two draws per thread in flight; this thread adds, in order
        pool, window, pending = _pool(), 2 * max(1, torch.get_num_threads()), collections.deque()
        for k in large:
            pending.append((k, pool.submit(draw, k)))
            if len(pending) > window:
                done, noise = pending.popleft()
                grads[done].add_(noise.result(), alpha=std)
        for done, noise in pending:
            grads[done].add_(noise.result(), alpha=std)
    else:
        for k in large:
            grads[k].add_(draw(k), alpha=std)


_ADD_NOISE = declare("add_noise_", add_noise_reference_)


def add_noise_(grads: list[torch.Tensor], std: float, seed: int, step: int, *,
               device_seed: torch.Tensor | None = None, keep: list | None = None) -> None:
    """g += N(0, std²) in place for every g in ``grads``, from (seed, step): the kernel on CUDA.

    Args:
        grads: floating tensors of any shapes, changed in place.
        std: the noise standard deviation σ·C, in the gradients' units (0: nothing is added).
        seed: the noise seed (int).
        step: the optimizer step (int).
        device_seed: None, or ``step_seed_tensor(...)`` on the grads' device, read by the kernel at run
            time instead of (seed, step) (the same noise: a CUDA graph replays it with a new step).
        keep: None, or a list that receives the tensors the launch reads besides the grads, for a
            step body that may be captured in a CUDA graph (which must keep them alive; see
            ``kernels.noise.add_noise_``).
    Returns:
        None.
    Raises:
        RuntimeError if ``device_seed`` is given where the kernel does not run; TypeError from the kernel
        for a non-floating tensor.
    """
    _ADD_NOISE.pick(*grads)(grads, std, seed, step, device_seed=device_seed, keep=keep)


# Pinned host tensors set aside for copies a CUDA graph capture records (a capture refuses a copy
# from pageable memory, and pinning is refused while a stream captures), by shape: eager runs of a
# step body set them aside, a capture takes one and keeps it, a dropped graph gives its back.
_PINNED: dict[tuple, list] = {}
_PINNED_PER_SHAPE = 4


def set_aside_pinned(shape: tuple) -> None:
    """Outside a capture: make sure a pinned int64 host tensor of ``shape`` waits for a capture.

    Args:
        shape: the tensor's shape.
    Returns:
        None.
    """
    spares = _PINNED.setdefault(tuple(shape), [])
    if len(spares) < _PINNED_PER_SHAPE:
        spares.append(torch.empty(shape, dtype=torch.int64, pin_memory=True))


def take_pinned(shape: tuple) -> torch.Tensor:
    """Inside a capture: a pinned int64 host tensor of ``shape`` set aside before it.

    Args:
        shape: the tensor's shape.
    Returns:
        the tensor, the caller's from now on (a graph that reads it must keep it).
    Raises:
        RuntimeError when none was set aside (the body never ran eagerly before its capture).
    """
    spares = _PINNED.get(tuple(shape))
    if not spares:
        raise RuntimeError("a copy inside a CUDA graph capture needs a pinned host buffer set aside by an eager run "
                           "of the same step body first (pdpfast.graphs rehearses every body before its capture)")
    return spares.pop()


def release_pinned(keep: list) -> None:
    """Give the pinned host tensors of a dropped graph's ``keep`` list back for later captures.

    Args:
        keep: what the graph's noise launches read (``add_noise_``'s ``keep``); emptied.
    Returns:
        None.
    """
    for t in keep:
        if t.device.type == "cpu" and t.is_pinned():
            spares = _PINNED.setdefault(tuple(t.shape), [])
            if len(spares) < _PINNED_PER_SHAPE:
                spares.append(t)
    keep.clear()
