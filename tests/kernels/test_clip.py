"""Clip-weight kernel against the torch reference (flat and automatic clipping, masks, groups)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pdpfast.kernels import clip  # noqa: E402
from pdpfast.ops.clip import clip_weights_reference  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(gen, sq_shape, clip_shape, mask_kind, dtype, device):
    # squared norms spanning "far below" to "far above" the bounds, exact zeros included
    sq = (torch.rand(sq_shape, generator=gen) * 4).pow(4)
    sq.view(-1)[:: 5] = 0.0
    clip_norms = torch.rand(clip_shape, generator=gen) * 3 + 0.1
    B = sq_shape[-1] if sq_shape else 1
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, generator=gen) < 0.7
    elif mask_kind == "float":
        mask = (torch.rand(B, generator=gen) < 0.7).float()
    return (sq.to(device=device, dtype=dtype), clip_norms.to(device),
            None if mask is None else mask.to(device))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gamma", [None, 0.01])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
@pytest.mark.parametrize("shapes", [((1,), (1,)), ((7,), (7,)), ((1537,), (1537,)), ((3, 65), (65,)),
                                    ((3, 65), (3, 65)), ((3, 65), (3, 1)), ((4,), ())], ids=str)
def test_clip_weights(tools, gen, shapes, mask_kind, gamma, dtype):
    sq, clip_norms, mask = _inputs(gen, *shapes, mask_kind, dtype, tools.device)
    out = clip.clip_weights(sq, clip_norms, mask, gamma)
    assert out.dtype == dtype and out.shape == torch.broadcast_shapes(sq.shape, clip_norms.shape)
    oracle = clip_weights_reference(sq.double(), clip_norms.double(), mask, gamma)
    tools.check(out, clip_weights_reference(sq, clip_norms, mask, gamma), oracle,
                atol=2 * torch.finfo(dtype).eps * oracle.abs(), what=f"clip {shapes} {mask_kind} {gamma}")


def test_clip_weights_properties(tools):
    """Flat clipping never scales up, masked-out records get exactly 0, zero norms get weight 1."""
    sq = torch.tensor([0.0, 0.25, 4.0, 100.0, 4.0], device=tools.device)
    clip_norms = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0], device=tools.device)
    mask = torch.tensor([1, 1, 1, 1, 0], device=tools.device)
    w = clip.clip_weights(sq, clip_norms, mask, None).cpu()
    assert w[0] == 1.0 and w[1] == 1.0 and w[4] == 0.0
    assert (w <= 1.0).all()
    # clipped norms never exceed the bound: w·‖g‖ ≤ c
    assert (w * sq.cpu().sqrt() <= clip_norms.cpu() + 1e-6).all()


def test_clip_weights_empty(tools):
    out = clip.clip_weights(torch.zeros(0, device=tools.device), torch.zeros(0, device=tools.device), None, None)
    assert out.shape == (0,)


def test_clip_weights_float64_runs_reference(tools, gen):
    sq, clip_norms, mask = _inputs(gen, (9,), (9,), "float", torch.float64, tools.device)
    assert torch.equal(clip.clip_weights(sq, clip_norms.double(), mask, None),
                       clip_weights_reference(sq, clip_norms.double(), mask, None))


@pytest.mark.gpu
def test_clip_weights_gpu_sizes(tools, gen):
    sq, clip_norms, mask = _inputs(gen, (8, 1 << 20), (1 << 20,), "bool", torch.float32, tools.device)
    tools.check(clip.clip_weights(sq, clip_norms, mask, None), clip_weights_reference(sq, clip_norms, mask, None),
                clip_weights_reference(sq.double(), clip_norms.double(), mask, None), atol=2e-7, what="gpu clip")
