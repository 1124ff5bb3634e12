"""Gaussian noise for the clipped sum (DESIGN.md §1.4), reproducible from (seed, step)."""
from __future__ import annotations

import numpy as np
import torch

from .dispatch import pick


def step_seed(seed: int, step: int) -> int:
    """A 63-bit seed for one step, independent across (seed, step) pairs."""
    return int(np.random.SeedSequence([int(seed), int(step)]).generate_state(2, np.uint64)[0] >> np.uint64(1))


def add_noise_reference_(grads: list[torch.Tensor], std: float, seed: int, step: int) -> None:
    """g += N(0, std²) elementwise, in place, for every tensor in ``grads``."""
    if not grads or std == 0:
        return
    generator = torch.Generator(device=grads[0].device).manual_seed(step_seed(seed, step))
    for g in grads:
        g.add_(torch.randn(g.shape, generator=generator, device=g.device, dtype=g.dtype), alpha=std)


def add_noise_(grads: list[torch.Tensor], std: float, seed: int, step: int) -> None:
    pick("add_noise_", add_noise_reference_, *grads)(grads, std, seed, step)
