"""Gaussian noise for the clipped sum (DESIGN.md §1.4), reproducible from (seed, step)."""
from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .dispatch import pick

# CPU noise for this many elements or more is drawn on several threads (torch releases the GIL).
_PARALLEL_MIN_ELEMENTS = 1 << 18


def step_seed(seed: int, step: int, index: int | None = None) -> int:
    """A 63-bit seed for one step (and one tensor), independent across (seed, step, index)."""
    entropy = [int(seed), int(step)] + ([] if index is None else [int(index)])
    return int(np.random.SeedSequence(entropy).generate_state(2, np.uint64)[0] >> np.uint64(1))


@functools.lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="pdpfast-noise")


def add_noise_reference_(grads: list[torch.Tensor], std: float, seed: int, step: int) -> None:
    """g += N(0, std²) elementwise, in place, for every tensor in ``grads``.

    Tensor k draws from its own generator seeded by (seed, step, k), so the noise depends only on
    (seed, step) and the list's order, and CPU tensors can be filled on several threads at once.
    """
    if not grads or std == 0:
        return

    def fill(k: int) -> None:
        g = grads[k]
        generator = torch.Generator(device=g.device).manual_seed(step_seed(seed, step, k))
        g.add_(torch.randn(g.shape, generator=generator, device=g.device, dtype=g.dtype), alpha=std)

    on_cpu = all(g.device.type == "cpu" for g in grads)
    if on_cpu and len(grads) > 1 and sum(g.numel() for g in grads) >= _PARALLEL_MIN_ELEMENTS:
        list(_pool().map(fill, range(len(grads))))
    else:
        for k in range(len(grads)):
            fill(k)


def add_noise_(grads: list[torch.Tensor], std: float, seed: int, step: int) -> None:
    pick("add_noise_", add_noise_reference_, *grads)(grads, std, seed, step)
