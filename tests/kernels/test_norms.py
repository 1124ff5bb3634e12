"""Per-sample squared norm kernels against float64 oracles and the torch references."""
from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton")

from pdpfast.kernels import norms  # noqa: E402
from pdpfast.ops.embedding import embedding_per_sample_grads, embedding_sq_norms_reference  # noqa: E402
from pdpfast.ops.linear import bias_sq_norms_reference, linear_per_sample_grads, linear_weight_sq_norms_reference  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PATHS = ["auto", "gram", "direct"]
# fp32 accumulation slack relative to the conditioning of the sum (see _linear_scale)
ACC_RTOL = 1e-5

# odd on purpose: B ∈ {1, 3}, T ∈ {1, 7, 33}, (d, p) from {1, 7, 65}
LINEAR_SHAPES = [(B, T, d, p) for B, T, (d, p) in itertools.product(
    (1, 3), (1, 7, 33), ((1, 7), (7, 65), (65, 1), (65, 65)))]
# several T-tiles: 2 (even: the doubled shift), 3 (odd), a long direct reduction, a wide d
MULTI_TILE_SHAPES = [(2, 65, 7, 9), (2, 129, 5, 3), (1, 513, 3, 2), (1, 7, 513, 3)]


def _linear_oracle(a, o):
    """Materialized per-sample gradients in float64."""
    return linear_per_sample_grads(a.double(), o.double()).pow(2).sum((1, 2))


def _linear_scale(a, o):
    """(Σ_t ‖a_t‖‖o_t‖)²: bounds Σ|Gram_a ⊙ Gram_o| and ‖Σ_t |o_t||a_t|ᵀ‖², so both paths'
    rounding errors are a small multiple of eps × this."""
    return (a.double().norm(dim=-1) * o.double().norm(dim=-1)).sum(-1).pow(2)


def _tensor_core_rtol(a, o) -> float:
    """fp16/bf16 tiles go to the tensor cores, whose fp32 accumulation truncates: over a reduction
    of length K the error can reach K·2⁻²³ of the sum, all in one direction (measured on an H100:
    2.3e-5 at K = 4096). The clipping state's rounding margin for fp16/bf16 (4u ≥ 2e-3) covers it."""
    if a.dtype not in (torch.float16, torch.bfloat16) or not a.is_cuda:
        return 0.0
    return max(a.shape[1], a.shape[2], o.shape[2]) * 2.0 ** -23


def _check_linear(tools, a, o, path, oracle=_linear_oracle):
    out = norms.linear_weight_sq_norms(a, o, path=path)
    assert out.dtype == torch.float32 and out.shape == (a.shape[0],)
    rtol = ACC_RTOL + _tensor_core_rtol(a, o)
    tools.check(out, linear_weight_sq_norms_reference(a, o), oracle(a, o),
                atol=rtol * _linear_scale(a, o) + 1e-30, what=f"linear {path} {tuple(a.shape)} {o.shape[-1]}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", LINEAR_SHAPES + MULTI_TILE_SHAPES, ids=str)
def test_linear_weight_sq_norms(tools, gen, shape, path, dtype):
    B, T, d, p = shape
    a = tools.randn(gen, B, T, d, dtype=dtype, device=tools.device)
    o = tools.randn(gen, B, T, p, dtype=dtype, device=tools.device)
    _check_linear(tools, a, o, path)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("path", ["auto", "gram", "direct"])
@pytest.mark.parametrize("shape", [(3, 1, 7, 5), (2, 65, 7, 9), (2, 33, 7, 65), (0, 7, 5, 3), (2, 0, 5, 3)], ids=str)
def test_linear_sq_norms_parts_are_the_launchs_partial_sums(tools, gen, shape, path, with_bias):
    """parts=True returns the launch's per-program partial sums, (B, K), unsummed: their row sums
    are the norms (the same additions in another order), and no sum is launched for them."""
    B, T, d, p = shape
    a = tools.randn(gen, B, T, d, device=tools.device)
    o = tools.randn(gen, B, T, p, device=tools.device)
    whole = norms.linear_weight_sq_norms(a, o, path=path, with_bias=with_bias)
    partial = norms.linear_weight_sq_norms(a, o, path=path, with_bias=with_bias, parts=True)
    assert partial.dim() == 2 and partial.shape[0] == B and partial.dtype == torch.float32
    torch.testing.assert_close(partial.sum(1), whole, rtol=1e-5, atol=1e-6 * (float(whole.abs().max()) if B else 1.0))
    if path == "gram" and T == 65:
        assert partial.shape[1] == 4  # two tiles of T, two shifts each: four programs per sample


@pytest.mark.parametrize("path", PATHS)
def test_linear_weight_sq_norms_empty_batch(tools, path):
    a = torch.randn(0, 7, 5, device=tools.device)
    o = torch.randn(0, 7, 3, device=tools.device)
    out = norms.linear_weight_sq_norms(a, o, path=path)
    assert out.shape == (0,) and out.dtype == torch.float32


@pytest.mark.parametrize("path", ["gram", "direct"])
def test_linear_weight_sq_norms_empty_sequence(tools, path):
    a = torch.randn(2, 0, 5, device=tools.device)
    o = torch.randn(2, 0, 3, device=tools.device)
    assert torch.equal(norms.linear_weight_sq_norms(a, o, path=path).cpu(), torch.zeros(2))


@pytest.mark.parametrize("path", PATHS)
def test_linear_weight_sq_norms_non_contiguous(tools, gen, path):
    B, T, d, p = 3, 33, 7, 9
    # strided rows with a contiguous last dim (kept as is) and a transposed layout (copied)
    a = tools.randn(gen, B, T, 2 * d, device=tools.device)[..., :d]
    o = tools.randn(gen, B, p, T, device=tools.device).transpose(1, 2)
    assert not a.is_contiguous() and not o.is_contiguous()
    _check_linear(tools, a, o, path)


def test_linear_weight_sq_norms_mixed_dtypes(tools, gen):
    a = tools.randn(gen, 3, 7, 9, dtype=torch.float16, device=tools.device)
    o = tools.randn(gen, 3, 7, 5, dtype=torch.bfloat16, device=tools.device)
    out = norms.linear_weight_sq_norms(a, o)
    tools.check(out, linear_weight_sq_norms_reference(a, o), _linear_oracle(a, o),
                atol=ACC_RTOL * _linear_scale(a, o), what="fp16 × bf16")


def test_linear_weight_sq_norms_float64_runs_reference(tools, gen):
    a = tools.randn(gen, 3, 7, 9, dtype=torch.float64, device=tools.device)
    o = tools.randn(gen, 3, 7, 5, dtype=torch.float64, device=tools.device)
    out = norms.linear_weight_sq_norms(a, o)
    assert out.dtype == torch.float64
    assert torch.equal(out, linear_weight_sq_norms_reference(a, o))


def test_linear_weight_sq_norms_rejects_unknown_path(tools):
    with pytest.raises(ValueError, match="path"):
        norms.linear_weight_sq_norms(torch.ones(1, 1, 1), torch.ones(1, 1, 1), path="ghost")


def test_outputs_are_poisoned_under_test():
    """The NaN poisoning the comparisons rely on is active."""
    from pdpfast.kernels import _utils
    assert _utils.POISON_OUTPUTS
    assert torch.isnan(_utils.new_buffer((4,), torch.float32, "cpu")).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", [(64, 512, 1024, 1024), (32, 2048, 768, 3072), (256, 1, 4096, 4096),
                                   (16, 4096, 64, 64), (7, 513, 513, 7)], ids=str)
def test_linear_weight_sq_norms_gpu_sizes(tools, gen, shape, path, dtype):
    B, T, d, p = shape
    a = tools.randn(gen, B, T, d, dtype=dtype, device=tools.device)
    o = tools.randn(gen, B, T, p, dtype=dtype, device=tools.device)
    # the float64 reference (chunked) as the oracle: materialized gradients would not fit
    _check_linear(tools, a, o, path, oracle=lambda a, o: linear_weight_sq_norms_reference(a.double(), o.double()))


# ----------------------------------------------------------------------------------------------
# bias
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(0, 7, 5), (1, 1, 1), (3, 7, 65), (3, 33, 7), (2, 65, 300)], ids=str)
def test_bias_sq_norms(tools, gen, shape, dtype):
    o = tools.randn(gen, *shape, dtype=dtype, device=tools.device)
    oracle = o.double().sum(1).pow(2).sum(-1)
    scale = o.double().abs().sum(1).pow(2).sum(-1)
    out = norms.bias_sq_norms(o)
    assert out.dtype == torch.float32
    tools.check(out, bias_sq_norms_reference(o), oracle, atol=ACC_RTOL * scale, what=f"bias {shape}")


def test_bias_sq_norms_non_contiguous(tools, gen):
    o = tools.randn(gen, 3, 9, 33, device=tools.device).transpose(1, 2)
    tools.check(norms.bias_sq_norms(o), bias_sq_norms_reference(o), bias_sq_norms_reference(o.double()),
                atol=ACC_RTOL * o.double().abs().sum(1).pow(2).sum(-1), what="bias transposed")


# ----------------------------------------------------------------------------------------------
# embedding
# ----------------------------------------------------------------------------------------------
def _embedding_oracle(ids, o, num_embeddings, padding_idx):
    return embedding_per_sample_grads(ids, o.double(), num_embeddings, padding_idx).pow(2).sum((1, 2))


def _check_embedding(tools, ids, o, num_embeddings, padding_idx, what):
    out = norms.embedding_sq_norms(ids, o, num_embeddings, padding_idx)
    assert out.dtype == torch.float32 and out.shape == (ids.shape[0],)
    scale = o.double().norm(dim=-1).reshape(ids.shape[0], -1).sum(-1).pow(2)  # bounds Σ|⟨o_s, o_t⟩|
    tools.check(out, embedding_sq_norms_reference(ids, o, num_embeddings, padding_idx),
                _embedding_oracle(ids, o, num_embeddings, padding_idx), atol=ACC_RTOL * scale, what=what)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("padding_idx", [None, 0, 3])
@pytest.mark.parametrize("shape", [(1, 1, 1, 5), (3, 7, 65, 4), (3, 33, 7, 50), (2, 65, 9, 3), (2, 130, 17, 6)],
                         ids=str)
def test_embedding_sq_norms(tools, gen, shape, padding_idx, dtype):
    """(B, T, p, V): small vocabularies force repeated tokens, also across T-tiles."""
    B, T, p, V = shape
    ids = torch.randint(0, V, (B, T), generator=gen).to(tools.device)
    o = tools.randn(gen, B, T, p, dtype=dtype, device=tools.device)
    _check_embedding(tools, ids, o, V, padding_idx, what=f"embedding {shape} pad={padding_idx}")


def test_embedding_sq_norms_one_token_spans_many_tiles(tools, gen):
    """A token repeated more than a T-tile (the walk across tiles) and all-padding samples."""
    B, T, p, V = 3, 200, 7, 4
    ids = torch.randint(0, V, (B, T), generator=gen)
    ids[0] = 2                    # one token everywhere
    ids[1, :150] = 1              # a long run plus noise
    ids[2] = 0                    # all padding → exactly zero
    ids = ids.to(tools.device)
    o = tools.randn(gen, B, T, p, device=tools.device)
    _check_embedding(tools, ids, o, V, 0, what="long runs")
    assert norms.embedding_sq_norms(ids, o, V, 0)[2].item() == 0.0


def test_embedding_sq_norms_extra_dims_and_int32(tools, gen):
    ids = torch.randint(0, 5, (3, 2, 4), generator=gen, dtype=torch.int32).to(tools.device)
    o = tools.randn(gen, 3, 2, 4, 6, device=tools.device)
    out = norms.embedding_sq_norms(ids, o, 5, 1)
    ids64 = ids.long().reshape(3, -1)
    tools.check(out, embedding_sq_norms_reference(ids64, o.reshape(3, 8, 6), 5, 1),
                _embedding_oracle(ids64, o.reshape(3, 8, 6), 5, 1), atol=1e-5, what="extra dims")


def test_embedding_sq_norms_empty_batch(tools):
    out = norms.embedding_sq_norms(torch.zeros(0, 7, dtype=torch.long, device=tools.device),
                                   torch.randn(0, 7, 3, device=tools.device), 10, None)
    assert out.shape == (0,)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_embedding_sq_norms_gpu_sizes(tools, gen, dtype):
    B, T, p, V = 64, 1024, 768, 1000
    ids = torch.randint(0, V, (B, T), generator=gen).to(tools.device)
    o = tools.randn(gen, B, T, p, dtype=dtype, device=tools.device)
    _check_embedding(tools, ids, o, V, 0, what="gpu embedding")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", [(3, 1, 7, 5), (3, 7, 65, 7), (2, 33, 7, 65), (1, 65, 9, 3), (0, 7, 5, 3)], ids=str)
def test_linear_sq_norms_with_bias_in_one_launch(tools, gen, shape, path, dtype):
    """‖G_i‖² + ‖Σ_t o_{i,t}‖²: the bias joins the weight's Gram (a aᵀ + 1) or rank-one ((‖a‖²+1)‖o‖²)."""
    from pdpfast.ops.linear import linear_sq_norms_reference

    B, T, d, p = shape
    a = tools.randn(gen, B, T, d, dtype=dtype, device=tools.device)
    o = tools.randn(gen, B, T, p, dtype=dtype, device=tools.device)
    out = norms.linear_weight_sq_norms(a, o, path=path, with_bias=True)
    oracle = _linear_oracle(a, o) + o.double().sum(1).pow(2).sum(-1)
    scale = _linear_scale(a, o) + o.double().abs().sum(1).pow(2).sum(-1)
    tools.check(out, linear_sq_norms_reference(a, o, True), oracle,
                atol=(ACC_RTOL + _tensor_core_rtol(a, o)) * scale + 1e-30, what=f"linear+bias {path} {shape}")


def _rounding_oracle(a, o, with_bias, u):
    """u·Σ_t ‖o_t‖·√(‖a_t‖² [+ 1]) in float64."""
    size = a.double().pow(2).sum(-1) + (1.0 if with_bias else 0.0)
    return u * (o.double().norm(dim=-1) * size.sqrt()).sum(-1)


# T = 1 (rank one), one tile, two tiles (the doubled shift), three tiles: every one on the Gram path
FUSED_SHAPES = [(3, 1, 7, 5), (0, 1, 4, 4), (2, 7, 65, 7), (2, 65, 200, 200), (1, 129, 300, 280), (3, 0, 5, 4)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("shape", FUSED_SHAPES, ids=str)
def test_linear_sq_norms_rounding_in_one_launch(tools, gen, shape, with_bias, dtype):
    """The norms and ρ_i = u·Σ_t ‖o_t‖√(‖a_t‖² [+ 1]) from one launch (ρ's row norms off the Grams'
    diagonals), each against float64."""
    from pdpfast.ops.linear import kernel_uses_gram, linear_sq_norms_reference

    B, T, d, p = shape
    assert T <= 1 or kernel_uses_gram(T, d, p)  # the shapes exercise the fused paths, not the fallback
    a = tools.randn(gen, B, T, d, dtype=dtype, device=tools.device)
    o = tools.randn(gen, B, T, p, dtype=dtype, device=tools.device)
    u = 2.0 ** -8
    sq, rho = norms.linear_sq_norms_rounding(a, o, with_bias, u)
    assert sq.dtype == rho.dtype == torch.float32 and sq.shape == rho.shape == (B,)
    oracle = _linear_oracle(a, o) + (o.double().sum(1).pow(2).sum(-1) if with_bias else 0.0)
    scale = _linear_scale(a, o) + (o.double().abs().sum(1).pow(2).sum(-1) if with_bias else 0.0)
    tools.check(sq, linear_sq_norms_reference(a, o, with_bias), oracle,
                atol=(ACC_RTOL + _tensor_core_rtol(a, o)) * scale + 1e-30, what=f"fused norms {shape}")
    expected = _rounding_oracle(a, o, with_bias, u)
    torch.testing.assert_close(rho.double().cpu(), expected.cpu(), rtol=ACC_RTOL + _tensor_core_rtol(a, o), atol=0)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("shape", FUSED_SHAPES + [(2, 33, 7, 65)], ids=str)
def test_linear_sq_norms_rounding_parts_are_the_launchs_partial_sums(tools, gen, shape, with_bias):
    """parts=True returns the norms' and ρ's per-program partial sums, (B, K) each, unsummed (the
    launch writes both side by side): their row sums are the summed results. Where the two are
    computed apart (the direct path), they come summed, (B,), whatever ``parts``."""
    from pdpfast.ops.linear import kernel_uses_gram

    B, T, d, p = shape
    a = tools.randn(gen, B, T, d, dtype=torch.bfloat16, device=tools.device)
    o = tools.randn(gen, B, T, p, dtype=torch.bfloat16, device=tools.device)
    u = 2.0 ** -8
    sq, rho = norms.linear_sq_norms_rounding(a, o, with_bias, u)
    sq_parts, rho_parts = norms.linear_sq_norms_rounding(a, o, with_bias, u, parts=True)
    if T > 1 and not kernel_uses_gram(T, d, p):
        assert sq_parts.shape == rho_parts.shape == (B,)
        assert torch.equal(sq_parts, sq) and torch.equal(rho_parts, rho)
        return
    assert sq_parts.dim() == rho_parts.dim() == 2 and sq_parts.shape == rho_parts.shape and sq_parts.shape[0] == B
    if T == 65:
        assert sq_parts.shape[1] == 4  # two tiles of T, two shifts each: four programs per sample
    scale = float(sq.abs().max()) if B else 1.0
    torch.testing.assert_close(sq_parts.sum(1), sq, rtol=1e-5, atol=1e-6 * scale)
    torch.testing.assert_close(rho_parts.sum(1), rho, rtol=1e-5, atol=0)


@pytest.mark.parametrize("shape", [(2, 33, 7, 65), (2, 12, 6, 300)], ids=str)
def test_linear_sq_norms_rounding_on_the_direct_path_computes_them_apart(tools, gen, shape):
    """Where the direct norm is cheaper, ρ needs the rows' norms the direct kernel never forms: the
    two are computed apart, and equal the references."""
    from pdpfast.ops.linear import kernel_uses_gram, linear_sq_norms_reference, scaled_sum_rounding

    B, T, d, p = shape
    assert not kernel_uses_gram(T, d, p)
    a = tools.randn(gen, B, T, d, dtype=torch.bfloat16, device=tools.device)
    o = tools.randn(gen, B, T, p, dtype=torch.bfloat16, device=tools.device)
    sq, rho = norms.linear_sq_norms_rounding(a, o, True, 2.0 ** -8)
    torch.testing.assert_close(sq, linear_sq_norms_reference(a, o, True), rtol=1e-4, atol=0)
    torch.testing.assert_close(rho, scaled_sum_rounding(a, o, True, 2.0 ** -8), rtol=1e-5, atol=0)


@pytest.mark.parametrize("T", [1, 7])
def test_rounding_bound_adds_no_launch_to_the_norm_kernel(tools, gen, T):
    """On the kernels' rank-one and Gram paths ρ costs no operation beyond the norms' own: the
    host issues as many ops for both as for the norms alone (four more without the fusion). Views
    launch nothing and are not counted."""
    from pdpfast.ops import linear as lin_ops

    a = tools.randn(gen, 4, T, 16, dtype=torch.bfloat16, device=tools.device)
    o = tools.randn(gen, 4, T, 16, dtype=torch.bfloat16, device=tools.device)
    with tools.op_log() as norms_only:
        lin_ops.linear_sq_norms(a, o, with_bias=True)
    with tools.op_log() as both:
        lin_ops.linear_sq_norms_rounding(a, o, True, 2.0 ** -8)
    with tools.op_log() as apart:
        lin_ops.linear_sq_norms_rounding_reference(a, o, True, 2.0 ** -8)
    assert both.ops == norms_only.ops
    assert len(apart.ops) >= len(both.ops) + 3


def _grouped_calls(tools, gen, n, shape, dtype, misaligned=False):
    """n calls of one shape: the first ones views into one buffer (offsets past the first call, some
    of them negative), the last a tensor of its own; ``misaligned``: the views start 2 elements apart
    from 16-byte boundaries."""
    B, T, d, p = shape
    shift = 1 if misaligned else 0
    buf_a = tools.randn(gen, n * B * T * d + 8, dtype=dtype, device=tools.device)
    buf_o = tools.randn(gen, n * B * T * p + 8, dtype=dtype, device=tools.device)
    # call 0 is the last slot of the buffers, so the others lie before it
    order = [n - 2, *range(n - 2)] if n > 1 else []
    calls = [(buf_a[shift + i * B * T * d:][:B * T * d].view(B, T, d), buf_o[i * B * T * p:][:B * T * p].view(B, T, p))
             for i in order]
    calls.append((tools.randn(gen, B, T, d, dtype=dtype, device=tools.device),
                  tools.randn(gen, B, T, p, dtype=dtype, device=tools.device)))
    return calls


# Gram-path shapes (the kernel groups only those): one T-tile, two (K = 4), wide d and p
GROUPED_SHAPES = [(3, 7, 64, 64), (2, 65, 200, 136), (1, 2, 520, 8)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("u", [0.0, 2.0 ** -8])
@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("shape", GROUPED_SHAPES, ids=str)
def test_grouped_linear_norms_equal_one_launch_per_call(tools, gen, shape, n, u, with_bias, dtype):
    """One launch for n same-shape calls gives each call's norms as its own launch does (the same
    programs, at an offset from the first call's tensors), their sum within fp32 summation of the
    float64 oracle, and each call's ρ bit for bit."""
    from pdpfast.ops.linear import kernel_uses_gram, linear_sq_norms_grouped_reference, linear_sq_norms_reference

    B, T, d, p = shape
    assert kernel_uses_gram(T, d, p)
    calls = _grouped_calls(tools, gen, n, shape, dtype)
    sq, rho = norms.linear_sq_norms_grouped(calls, with_bias, u)
    K = 1 if T <= 64 else 4
    assert sq.dtype == torch.float32 and sq.shape == (n, B, K) and sq[n - 1].is_contiguous()
    ref_sq, ref_rho = linear_sq_norms_grouped_reference(calls, with_bias, u)
    assert ref_sq.shape == (n, B, 1)
    for c, (a, o) in enumerate(calls):
        exact = linear_sq_norms_reference(a.double(), o.double(), with_bias)
        scale = _linear_scale(a, o) + (o.double().sum(1).norm(dim=-1) ** 2 if with_bias else 0)
        rtol = ACC_RTOL + _tensor_core_rtol(a, o)
        tools.check(sq[c].sum(1), ref_sq[c, :, 0], exact, atol=rtol * scale + 1e-30, what=f"call {c} {shape} {dtype}")
    if u:  # each call's ρ partial sums are its own launch's (parts=True), summed as the reference sums them
        assert rho.shape == (n, B, K) and torch.equal(rho.sum(2), ref_rho[..., 0])
        assert torch.equal(rho[0], norms.linear_sq_norms_rounding(*calls[0], with_bias, u, parts=True)[1].view(B, K))
    else:
        assert rho is None and ref_rho is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", [7, 65])
def test_calls_of_different_widths_share_a_launch(tools, gen, T, dtype):
    """Calls of one (B, T) and dtype but of different widths (a transformer block's projections, some
    widths not multiples of 16, so the launch gives the compiler no divisibility hint, and some under
    one tile) take one launch, with the widest call's tiles; each call's norms and ρ equal its own
    launch's to fp32 summation, and the float64 oracle as ``test_grouped_linear_norms_equal_one_launch_per_call``."""
    from pdpfast.ops.linear import kernel_uses_gram, linear_sq_norms_reference

    B, u = 2, 2.0 ** -8
    widths = [(64, 192), (200, 136), (256, 72), (120, 200)] if T > 64 else [(64, 128), (16, 32), (72, 40), (128, 64)]
    calls = [(tools.randn(gen, B, T, d, dtype=dtype, device=tools.device),
              tools.randn(gen, B, T, p, dtype=dtype, device=tools.device)) for d, p in widths]
    assert all(kernel_uses_gram(T, d, p) for d, p in widths)
    with tools.op_log() as log:
        sq, rho = norms.linear_sq_norms_grouped(calls, True, u)
    assert len(log.launches) == 1
    K = 1 if T <= 64 else 4
    assert sq.shape == rho.shape == (len(calls), B, K)
    for c, (a, o) in enumerate(calls):
        own_sq, own_rho = norms.linear_sq_norms_rounding(a, o, True, u, parts=True)
        torch.testing.assert_close(sq[c].sum(1), own_sq.sum(1), rtol=1e-5, atol=0)
        torch.testing.assert_close(rho[c].sum(1), own_rho.sum(1), rtol=1e-5, atol=0)
        exact = linear_sq_norms_reference(a.double(), o.double(), True)
        scale = _linear_scale(a, o) + o.double().sum(1).norm(dim=-1) ** 2
        rtol = ACC_RTOL + _tensor_core_rtol(a, o)
        tools.check(sq[c].sum(1), own_sq.sum(1), exact, atol=rtol * scale + 1e-30, what=f"call {c} {widths[c]} {dtype}")


def test_grouped_launch_tables_are_built_once_per_layout_and_reused(tools, gen, monkeypatch):
    """A step of fixed shapes lays its tensors out alike every time (torch's caching allocator), so a
    grouped launch's table (offsets, widths, strides) is built once and reused: the same calls give
    the same table object and the same norms; another layout builds its own. Tables are slices of
    one buffer a device, 16-byte aligned; when it is full the device's tables are dropped with it
    for a new one; a table larger than it is built on its own, not kept."""
    from pdpfast.kernels import _utils

    monkeypatch.setattr(_utils, "_TABLES", {})
    monkeypatch.setattr(_utils, "_ARENAS", {})
    monkeypatch.setattr(_utils, "TABLE_STATS", {"hits": 0, "builds": 0})
    tables = []
    table_on = _utils.table_on
    monkeypatch.setattr(norms, "table_on", lambda values, device: tables.append(table_on(values, device)) or tables[-1])
    calls = _grouped_calls(tools, gen, 4, (2, 9, 64, 48), torch.float32)
    first = norms.linear_sq_norms_grouped(calls, True, 2.0 ** -8)
    second = norms.linear_sq_norms_grouped(calls, True, 2.0 ** -8)
    assert tables[0] is tables[1] and _utils.TABLE_STATS == {"hits": 1, "builds": 1}
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    norms.linear_sq_norms_grouped(calls[::-1], True)  # other offsets: a table of its own
    assert tables[2] is not tables[0] and _utils.TABLE_STATS == {"hits": 1, "builds": 2}
    assert torch.equal(tables[0].cpu(), torch.tensor(tables[0].tolist()))
    device = calls[0][0].device  # (with its index: "cuda:0", as the launches key it)
    arena = _utils._ARENAS[device][0]
    assert all(t.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr() for t in tables)
    monkeypatch.setattr(_utils, "TABLE_ARENA_ENTRIES", 8)
    monkeypatch.setattr(_utils, "_ARENAS", {})
    odd = _utils.table_on([1, 2, 3], device)
    assert _utils.table_on([4, 5], device).data_ptr() == odd.data_ptr() + 32  # (3 entries, then aligned to 16 bytes)
    assert _utils.table_on([1, 2, 3], device) is odd and list(_utils._TABLES) == [(device, (1, 2, 3)), (device, (4, 5))]
    full = _utils.table_on([6, 7, 8], device)  # no room left: a new arena, the old tables dropped
    assert _utils._ARENAS[device][0].data_ptr() == full.data_ptr() and list(_utils._TABLES) == [(device, (6, 7, 8))]
    assert full.tolist() == [6, 7, 8] and odd.tolist() == [1, 2, 3]
    large = _utils.table_on(list(range(9)), device)
    assert large.tolist() == list(range(9)) and list(_utils._TABLES) == [(device, (6, 7, 8))]


def test_grouped_linear_norms_of_misaligned_mismatched_or_empty_calls_run_one_launch_each(tools, gen, monkeypatch):
    """Calls whose tensors do not all start on 16-byte boundaries (the table's offsets would break the
    kernel's alignment assumption), calls whose shapes or strides differ from the first one's (the
    kernel reads every call with the first one's) and empty batches take the reference, with its
    results."""
    from pdpfast.ops import linear as lin_ops

    seen = []
    reference = lin_ops.linear_sq_norms_grouped_reference
    monkeypatch.setattr(norms, "linear_sq_norms_grouped_reference",
                        lambda *args: (seen.append(len(args[0])), reference(*args))[1])
    calls = _grouped_calls(tools, gen, 3, (2, 7, 64, 64), torch.bfloat16, misaligned=True)
    assert calls[1][0].data_ptr() % 16
    sq, rho = norms.linear_sq_norms_grouped(calls, True, 2.0 ** -8)
    assert seen == [3] and sq.shape == rho.shape == (3, 2, 1)
    # calls that do not match the first one's shape or strides (the engine never groups them: its
    # group keys carry both): the launcher checks, and runs one launch each
    seen.clear()
    a, o = tools.randn(gen, 2, 9, 64, device=tools.device), tools.randn(gen, 2, 9, 64, device=tools.device)
    for other in [(tools.randn(gen, 2, 64, 9, device=tools.device).transpose(1, 2), o),
                  (tools.randn(gen, 2, 18, 64, device=tools.device), tools.randn(gen, 2, 18, 64, device=tools.device))]:
        sq, _ = norms.linear_sq_norms_grouped([(a, o), other], False)
        assert seen[-1] == 2 and sq.shape == (2, 2, 1)
        ref = reference([(a, o), other], False)[0]
        assert torch.equal(sq, ref)
    seen.clear()
    empty = [(torch.zeros(0, 7, 64, device=tools.device), torch.zeros(0, 7, 64, device=tools.device))] * 2
    sq, rho = norms.linear_sq_norms_grouped(empty, False)
    assert seen == [2] and sq.shape == (2, 0, 1) and rho is None
