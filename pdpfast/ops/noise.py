"""Gaussian noise for the clipped sum (DESIGN.md §1.4), reproducible from (seed, step)."""
from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import torch

from .dispatch import declare

# CPU noise for this many elements or more is drawn on several threads (torch releases the GIL).
_PARALLEL_MIN_ELEMENTS = 1 << 18


_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def step_seed(seed: int, step: int, index: int | None = None) -> int:
    """A 63-bit seed for one step (and one tensor), independent across (seed, step, index).

    SplitMix64 absorbs each word in turn (a few hundred ns: this runs once per tensor per step)."""
    z = 0
    for word in (seed, step) if index is None else (seed, step, index):
        z = _splitmix64(z ^ (int(word) & _MASK64))
    return z >> 1


@functools.lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="pdpfast-noise")


# Tensors with at least this many elements draw from their own generator (and may be filled on
# several threads); smaller ones share one draw per (device, dtype), so a model with hundreds of
# small tensors costs a few generator set-ups per step, not hundreds.
_OWN_GENERATOR_MIN_ELEMENTS = 1 << 16


def add_noise_reference_(grads: list[torch.Tensor], std: float, seed: int, step: int) -> None:
    """g += N(0, std²) elementwise, in place, for every tensor in ``grads``.

    Tensor k of ≥ 2^16 elements draws from a generator seeded by (seed, step, k); the smaller ones
    draw, in list order, from one generator per (device, dtype) group j seeded by
    (seed, step, len(grads) + j). The noise depends only on (seed, step) and the list.
    """
    if not grads or std == 0:
        return
    n = len(grads)

    def generator(device, index: int) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(step_seed(seed, step, index))

    def fill(k: int) -> None:
        g = grads[k]
        g.add_(torch.randn(g.shape, generator=generator(g.device, k), device=g.device, dtype=g.dtype), alpha=std)

    large = [k for k in range(n) if grads[k].numel() >= _OWN_GENERATOR_MIN_ELEMENTS]
    small: dict[tuple, list[torch.Tensor]] = {}
    for k in range(n):
        if grads[k].numel() < _OWN_GENERATOR_MIN_ELEMENTS:
            small.setdefault((grads[k].device, grads[k].dtype), []).append(grads[k])
    for j, ((device, dtype), group) in enumerate(small.items()):
        draw = torch.randn(sum(g.numel() for g in group), generator=generator(device, n + j), device=device,
                           dtype=dtype)
        torch._foreach_add_(group, [c.view(g.shape) for c, g in zip(draw.split([g.numel() for g in group]), group)],
                            alpha=std)
    on_cpu = all(grads[k].device.type == "cpu" for k in large)
    if on_cpu and len(large) > 1 and sum(grads[k].numel() for k in large) >= _PARALLEL_MIN_ELEMENTS:
        list(_pool().map(fill, large))
    else:
        for k in large:
            fill(k)


_ADD_NOISE = declare("add_noise_", add_noise_reference_)


def add_noise_(grads: list[torch.Tensor], std: float, seed: int, step: int) -> None:
    _ADD_NOISE.pick(*grads)(grads, std, seed, step)
