"""Clipped weighted gradient GEMM against float64 oracles and the torch reference."""
from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton")

from pdpfast.kernels import grad  # noqa: E402
from pdpfast.ops.linear import linear_clipped_grad_reference, linear_per_sample_grads  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(B, T, d, p) for B, T, (d, p) in itertools.product(
    (0, 1, 3), (1, 7, 33), ((1, 7), (65, 1), (7, 65), (65, 65)))] + [(2, 200, 9, 3)]


def _oracle(a, o, weights):
    """Σ_i w_i G_i from materialized float64 per-sample gradients."""
    per_sample = linear_per_sample_grads(a.double(), o.double())
    if weights is None:
        return per_sample.sum(0)
    return (per_sample * weights.double().view(-1, 1, 1)).sum(0)


def _atol(a, o, weights, dtype):
    """eps(dtype) × Σ_i |w_i| Σ_t |o_t||a_t|ᵀ: the conditioning of each output element."""
    w = torch.ones(a.shape[0], dtype=torch.float64, device=a.device) if weights is None else weights.double()
    scale = torch.einsum("b,btp,btd->pd", w.abs(), o.double().abs(), a.double().abs())
    return 2 * torch.finfo(dtype).eps * scale + 1e-30


def _check(tools, a, o, weights, split_k=None, what=""):
    out = grad.linear_clipped_grad(a, o, weights, split_k=split_k)
    assert out.dtype == o.dtype and out.shape == (o.shape[-1], a.shape[-1])
    tools.check(out, linear_clipped_grad_reference(a, o, weights), _oracle(a, o, weights),
                atol=_atol(a, o, weights, o.dtype), what=what)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_linear_clipped_grad(tools, gen, shape, weighted, dtype):
    B, T, d, p = shape
    a = tools.randn(gen, B, T, d, dtype=dtype, device=tools.device)
    o = tools.randn(gen, B, T, p, dtype=dtype, device=tools.device)
    weights = torch.rand(B, generator=gen).to(tools.device) if weighted else None
    _check(tools, a, o, weights, what=f"grad {shape} weighted={weighted}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("split_k", [1, 2, 3, 1000])
def test_linear_clipped_grad_split_k(tools, gen, split_k, dtype):
    """Forced split-K reductions (fp32 partials summed by torch), uneven splits included."""
    a = tools.randn(gen, 5, 41, 20, dtype=dtype, device=tools.device)
    o = tools.randn(gen, 5, 41, 9, dtype=dtype, device=tools.device)
    weights = torch.rand(5, generator=gen).to(tools.device)
    _check(tools, a, o, weights, split_k=split_k, what=f"split_k={split_k}")


def test_linear_clipped_grad_masked_records_contribute_nothing(tools, gen):
    a = tools.randn(gen, 4, 7, 9, device=tools.device)
    o = tools.randn(gen, 4, 7, 5, device=tools.device)
    weights = torch.tensor([0.5, 0.0, 1.0, 0.0], device=tools.device)
    full = grad.linear_clipped_grad(a, o, weights)
    kept = grad.linear_clipped_grad(a[[0, 2]], o[[0, 2]], weights[[0, 2]])
    torch.testing.assert_close(full, kept)


def test_linear_clipped_grad_2d_and_non_contiguous(tools, gen):
    a = tools.randn(gen, 6, 13, device=tools.device)
    o = tools.randn(gen, 6, 5, device=tools.device)
    w = torch.rand(6, generator=gen).to(tools.device)
    out = grad.linear_clipped_grad(a, o, w)
    # (B, d) inputs mean T = 1; the reference takes them as (B, 1, d)
    tools.check(out, linear_clipped_grad_reference(a[:, None], o[:, None], w), (o.double() * w.double()[:, None]).t() @ a.double(),
                atol=1e-5, what="2-D")
    a3 = tools.randn(gen, 3, 13, 7, device=tools.device).transpose(1, 2)   # (3, 7, 13) transposed
    o3 = tools.randn(gen, 3, 7, 2 * 5, device=tools.device)[..., ::2]     # strided last dim
    _check(tools, a3, o3, w[:3], what="non-contiguous")


def test_linear_clipped_grad_float64_runs_reference(tools, gen):
    a = tools.randn(gen, 3, 7, 9, dtype=torch.float64, device=tools.device)
    o = tools.randn(gen, 3, 7, 5, dtype=torch.float64, device=tools.device)
    w = torch.rand(3, generator=gen, dtype=torch.float64).to(tools.device)
    assert torch.equal(grad.linear_clipped_grad(a, o, w), linear_clipped_grad_reference(a, o, w))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(64, 512, 1024, 1024), (1024, 1, 4096, 4096), (8, 4096, 64, 64)], ids=str)
def test_linear_clipped_grad_gpu_sizes(tools, gen, shape, dtype):
    B, T, d, p = shape
    a = tools.randn(gen, B, T, d, dtype=dtype, device=tools.device)
    o = tools.randn(gen, B, T, p, dtype=dtype, device=tools.device)
    w = torch.rand(B, generator=gen).to(tools.device)
    out = grad.linear_clipped_grad(a, o, w)
    oracle = linear_clipped_grad_reference(a.double(), o.double(), w.double())
    tools.check(out, linear_clipped_grad_reference(a, o, w), oracle, atol=_atol(a, o, w, dtype), what="gpu grad")
