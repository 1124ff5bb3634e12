"""The clip-weight op of ``pdpfast._C`` (``csrc/clip.cpp``) against the torch formula it replaces.

The clipping state computes clip weights once per layer call (per-layer clipping) or once per
batch; the C++ op computes them in one call instead of five tensor ops. Each of its steps is
correctly rounded in the tensor's dtype; torch's CPU square root is not (it differs in the last bit
for a few percent of float32 inputs). The op equals correctly rounded arithmetic bit for bit, and
the two routes agree to 4 eps relative, with NaN and infinities in the same places: each rounds
three steps (≤ eps/2 each) and torch's root may be one ulp further off, so their results differ by
less than 4 eps (2.2 eps the most seen, over 5.4 million inputs per dtype).
"""
from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

from pdpfast import _ext
from pdpfast.ops.clip import (
    CLIP_EPS,
    PendingWeights,
    clip_scale,
    clip_scale_route,
    clip_weights,
    clip_weights_reference,
    clip_weights_route,
    weights_to,
)

needs_op = pytest.mark.skipif(_ext.missing("clip_weights", "clip.cpp") is not None,
                              reason=str(_ext.missing("clip_weights", "clip.cpp")))
needs_scale = pytest.mark.skipif(_ext.missing("clip_scale", "clip.cpp") is not None,
                                 reason=str(_ext.missing("clip_scale", "clip.cpp")))


def _inputs(shape, dtype, g):
    """Squared norms spanning many magnitudes, with rounding-negative, zero, NaN and inf entries,
    and bounds with zeros (masked rows) and a huge one."""
    sq = torch.exp(torch.randn(shape, generator=g, dtype=torch.float64) * 6).to(dtype)
    bounds = (torch.rand(shape, generator=g, dtype=torch.float64) * 3).to(dtype)
    flat_sq, flat_b = sq.view(-1), bounds.view(-1)
    for i, v in enumerate([-1e-7, 0.0, math.nan, math.inf, -0.0, 1e-30][: flat_sq.numel()]):
        flat_sq[i] = v
    if flat_b.numel() > 3:
        flat_b[1::4] = 0.0
        flat_b[-1] = 1e30
    return sq, bounds


def _correctly_rounded(sq, bounds, offset, cap):
    """min(cap, c / (√max(sq, 0) + offset)) with each float32 step rounded once: float64 holds every
    float32 sum exactly, and its square root and quotient round to the same float32 as a correctly
    rounded float32 operation (53 ≥ 2·24 + 2 bits)."""
    f32 = np.float32
    s = sq.numpy().astype(np.float64)
    root = np.sqrt(np.where(s < 0, 0.0, s)).astype(f32).astype(np.float64)
    denominator = (root + np.float64(f32(offset))).astype(f32).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        w = (bounds.numpy().astype(np.float64) / denominator).astype(f32)
    return torch.from_numpy(np.where(w > f32(cap), f32(cap), w))


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(0,), (1,), (37,), (4, 9), (3000,)])
@pytest.mark.parametrize("loss_scale", [1.0, 7.0, 0.25])
@pytest.mark.parametrize("gamma", [None, 0.01])
def test_cpp_clip_weights_equal_the_torch_formula_to_rounding(dtype, shape, loss_scale, gamma):
    # a seed fixed across runs (``hash`` of a str changes with every interpreter)
    g = torch.Generator().manual_seed(zlib.crc32(repr((dtype, shape, loss_scale, gamma)).encode()))
    sq, bounds = _inputs(shape, dtype, g)
    assert clip_weights_route(sq, bounds) == "C++ kernel"
    got = clip_weights(sq, bounds, None, gamma, loss_scale)
    expected = clip_weights_reference(sq, bounds, None, gamma, loss_scale)
    assert got.dtype == dtype and got.shape == sq.shape
    assert torch.equal(got.isnan(), expected.isnan())
    ok = ~expected.isnan()
    assert torch.equal(got[ok].isinf(), expected[ok].isinf()) and torch.equal(got[ok] == 0, expected[ok] == 0)
    torch.testing.assert_close(got[ok], expected[ok], rtol=4 * torch.finfo(dtype).eps, atol=0)
    if dtype == torch.float32:
        offset = (CLIP_EPS if gamma is None else gamma) / loss_scale
        exact = _correctly_rounded(sq, bounds, offset, loss_scale if gamma is None else math.inf)
        assert torch.equal(got.isnan(), exact.isnan()) and torch.equal(got[ok], exact[ok])


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(0,), (1,), (37,), (4, 9)])
@pytest.mark.parametrize("gamma", [None, 0.01])
def test_cpp_clip_weights_with_a_rounding_bound_equal_the_torch_formula(dtype, shape, gamma):
    """c_i / (‖g_i‖ + ρ_i + offset): one more correctly rounded step on the C++ route, one more op on torch's."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((dtype, shape, gamma, "rho")).encode()))
    sq, bounds = _inputs(shape, dtype, g)
    rho = (torch.rand(shape, generator=g, dtype=torch.float64) * sq.double().clamp_min(0).sqrt().nan_to_num(
        posinf=1.0) * 0.1).to(dtype)
    assert clip_weights_route(sq, bounds, None, rho) == "C++ kernel"
    got = clip_weights(sq, bounds, None, gamma, 3.0, rho)
    expected = clip_weights_reference(sq, bounds, None, gamma, 3.0, rho)
    assert torch.equal(got.isnan(), expected.isnan())
    ok = ~expected.isnan()
    torch.testing.assert_close(got[ok], expected[ok], rtol=5 * torch.finfo(dtype).eps, atol=0)
    # and ρ = 0 is no bound at all
    torch.testing.assert_close(clip_weights(sq, bounds, None, gamma, 3.0, torch.zeros_like(sq)),
                               clip_weights(sq, bounds, None, gamma, 3.0), rtol=0, atol=0, equal_nan=True)


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(0,), (1,), (37,), (4, 9)])
@pytest.mark.parametrize("parts", [0, 1, 4, 7])
@pytest.mark.parametrize("with_rho", [False, True])
def test_cpp_clip_weights_from_partial_sums_equal_the_formula_on_their_sum(dtype, shape, parts, with_rho):
    """parts=True: the squared norms arrive as (..., K) partial sums (a norm kernel's per-program
    sums) and the op adds them up first, in the same call; the weights equal the formula on the
    summed norms, up to the sums' different order (K roundings at most)."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((dtype, shape, parts, with_rho, "parts")).encode()))
    sq, bounds = _inputs(shape, dtype, g)
    split = (torch.rand(*shape, parts, generator=g, dtype=torch.float64) + 0.1).to(dtype)
    partial = sq.unsqueeze(-1) * split / split.sum(-1, keepdim=True) if parts else torch.zeros(*shape, 0, dtype=dtype)
    rho = (torch.rand(shape, generator=g, dtype=torch.float64) * 0.1).to(dtype) if with_rho else None
    assert clip_weights_route(partial, bounds, None, rho, parts=True) == "C++ kernel"
    got = clip_weights(partial, bounds, None, None, 3.0, rho, parts=True)
    expected = clip_weights_reference(partial.sum(-1), bounds, None, None, 3.0, rho)
    assert got.shape == bounds.shape and got.dtype == dtype
    assert torch.equal(got.isnan(), expected.isnan())
    ok = ~expected.isnan()
    torch.testing.assert_close(got[ok], expected[ok], rtol=(parts + 5) * torch.finfo(dtype).eps, atol=0)


@needs_op
def test_cpp_clip_weights_sum_partial_sums_of_either_sign():
    """A Gram norm's partial sums of off-diagonal tiles can be negative; only their sum is a squared
    norm. Sums exact in float32: [3, -1, -2] is 0 (weight s), [8, 1, -5] is 4 (weight c/2)."""
    partial = torch.tensor([[3.0, -1.0, -2.0], [8.0, 1.0, -5.0], [1.0, 0.0, 0.0]])
    bounds = torch.tensor([1.0, 1.0, 0.5])
    got = clip_weights(partial, bounds, loss_scale=2.0, parts=True)
    torch.testing.assert_close(got, torch.tensor([2.0, 1.0 / (2.0 + CLIP_EPS / 2), 0.5 / (1.0 + CLIP_EPS / 2)]))


def test_an_extension_built_before_the_parts_argument_sums_them_in_torch(monkeypatch):
    """A stale ``pdpfast._C`` (built before ``parts`` existed) is not called with it: torch sums the
    partial sums, the formula follows, and the route says to rebuild."""
    import pdpfast.ops.clip as clip_ops

    monkeypatch.setattr(clip_ops, "_TAKES_PARTS", False)
    partial, bounds = torch.tensor([[1.0, 3.0], [0.25, 0.0]]), torch.tensor([1.0, 3.0])
    if _ext.missing("clip_weights", "clip.cpp") is None:
        assert "rebuild" in clip_weights_route(partial, bounds, parts=True)
    torch.testing.assert_close(clip_weights(partial, bounds, parts=True),
                               torch.tensor([1.0 / (2.0 + CLIP_EPS), 1.0]))


@needs_op
def test_cpp_clip_weights_keep_norm_plus_rounding_bound_within_the_clip_bound():
    """w_i·(‖g_i‖ + ρ_i) ≤ s·c_i up to the rounding of the weight: a record's rounded contribution,
    within w_i·(‖g_i‖ + ρ_i) of zero, stays within its bound."""
    g = torch.Generator().manual_seed(12)
    sq = torch.exp(torch.randn(10_000, generator=g) * 8)
    rho = sq.sqrt() * torch.rand(10_000, generator=g)
    bounds = torch.rand(10_000, generator=g) * 5
    w = clip_weights(sq, bounds, loss_scale=2.0, rounding=rho)
    eps = torch.finfo(torch.float32).eps
    assert (w.double() * (sq.double().sqrt() + rho.double()) <= 2.0 * bounds.double() * (1 + 3 * eps)).all()


@needs_op
def test_cpp_clip_weights_keep_every_clipped_norm_within_its_bound():
    """w_i·‖g_i‖ ≤ s·c_i up to the rounding of the weight: the property clipping exists for."""
    g = torch.Generator().manual_seed(11)
    sq = torch.exp(torch.randn(10_000, generator=g) * 8)
    bounds = torch.rand(10_000, generator=g) * 5
    for s in (1.0, 32.0):
        w = clip_weights(sq, bounds, loss_scale=s)
        eps = torch.finfo(torch.float32).eps
        assert (w.double() * sq.double().sqrt() <= s * bounds.double() * (1 + 2 * eps)).all()
        assert (w <= s).all() and (w >= 0).all()


def test_clip_weights_route_says_why_it_takes_torch():
    sq, bounds = torch.rand(5), torch.rand(5)
    if _ext.missing("clip_weights", "clip.cpp") is not None:
        assert clip_weights_route(sq, bounds).startswith("torch (")
        return
    assert clip_weights_route(sq, bounds) == "C++ kernel"
    assert "mask" in clip_weights_route(sq, bounds, torch.ones(5))
    assert "broadcast" in clip_weights_route(torch.rand(3, 5), bounds)
    assert "dtype" in clip_weights_route(sq, bounds.double())
    assert "bfloat16" in clip_weights_route(sq.bfloat16(), bounds.bfloat16())
    assert "rounding" in clip_weights_route(sq, bounds, None, torch.rand(3))
    assert clip_weights_route(sq, bounds, None, torch.rand(5)) == "C++ kernel"
    assert "grad" in clip_weights_route(sq.requires_grad_(), bounds)
    with torch.no_grad():  # as in a backward: nothing the C++ op returns could be differentiated
        assert clip_weights_route(sq, bounds) == "C++ kernel"
    assert clip_weights_route(torch.rand(5, 3), bounds, parts=True) == "C++ kernel"
    assert "broadcast" in clip_weights_route(torch.rand(3, 5), bounds, parts=True)


def test_an_extension_built_before_the_rounding_argument_takes_the_torch_route(monkeypatch):
    """A stale ``pdpfast._C`` (built before ``rounding`` existed) is not called with it: the torch
    route computes the same weights and the route says to rebuild."""
    import pdpfast.ops.clip as clip_ops

    monkeypatch.setattr(clip_ops, "_TAKES_ROUNDING", False)
    sq, bounds, rho = torch.tensor([4.0, 1.0]), torch.tensor([1.0, 3.0]), torch.tensor([1.0, 0.5])
    if _ext.missing("clip_weights", "clip.cpp") is None:
        assert "rebuild" in clip_weights_route(sq, bounds, None, rho)
    torch.testing.assert_close(clip_weights(sq, bounds, rounding=rho), torch.tensor([1.0 / 3.0, 1.0]))


def test_clip_weights_with_a_mask_or_broadcast_bounds_equal_the_formula():
    """The routes the C++ op does not take still compute the one formula (``clip_weights_reference``)."""
    sq = torch.tensor([[4.0, 0.25, 9.0], [1.0, 16.0, 0.0]])
    bounds = torch.tensor([1.0, 2.0, 1.0])
    mask = torch.tensor([1.0, 0.0, 1.0])
    got = clip_weights(sq, bounds, mask, loss_scale=2.0)
    expected = torch.minimum(torch.tensor(2.0), bounds / (sq.sqrt() + CLIP_EPS / 2)) * mask
    torch.testing.assert_close(got, expected)
    assert torch.equal(clip_weights(sq, bounds, loss_scale=0.0), torch.zeros_like(sq))


def test_clip_weights_refuse_bounds_or_rounding_that_would_enlarge_the_weights():
    """Bounds of shape (B, 1) against (B,) norms used to give a (B, B) matrix of weights: one record's
    weight per pair of records, which no caller means. Now a ValueError, as for a rounding bound that
    does not fit the norms; bounds and rounding that broadcast to the norms' shape still work."""
    sq = torch.tensor([4.0, 1.0, 9.0])
    with pytest.raises(ValueError, match=r"clip_norms of shape \(3, 1\) broadcast the weights to \(3, 3\)"):
        clip_weights(sq, torch.ones(3, 1))
    with pytest.raises(ValueError, match=r"rounding must be shaped like sq_norms .*\(3, 1\)"):
        clip_weights(sq, torch.ones(3), rounding=torch.zeros(3, 1))
    with pytest.raises(ValueError, match="rounding must be shaped like sq_norms"):
        clip_weights(torch.rand(2, 3, 4), torch.ones(2, 3), rounding=torch.zeros(3, 2), parts=True)
    grouped = torch.tensor([[4.0, 1.0, 9.0], [1.0, 0.25, 4.0]])
    torch.testing.assert_close(clip_weights(grouped, torch.ones(3), rounding=torch.zeros(3)),
                               clip_weights(grouped, torch.ones(2, 3), rounding=torch.zeros(2, 3)))
    torch.testing.assert_close(clip_weights(sq, torch.tensor(2.0)), clip_weights(sq, torch.full((3,), 2.0)))


def test_clip_scale_refuses_bounds_that_are_not_one_per_row():
    """(K, B) bounds give (K, B) weights: no one weight per row of x to scale it by. This used to reach
    torch's own shape error from the product."""
    g = torch.Generator().manual_seed(7)
    weights = _pending(5, 3, torch.float32, g, None, None, 1.0)
    grouped = weights._replace(clip_norms=weights.clip_norms.expand(2, 5), sq_norms=weights.sq_norms.expand(2, 5, 3))
    with pytest.raises(ValueError, match=r"one weight per row, \(B,\) = \(5,\), got weights of shape \(2, 5\)"):
        clip_scale(torch.randn(5, 4), grouped)
    with pytest.raises(ValueError, match="one weight per row"):
        clip_scale(torch.randn(4, 4), weights)


@needs_op
def test_cpp_clip_weights_refuse_mismatched_inputs_clearly():
    from pdpfast import _C

    with pytest.raises(RuntimeError, match="must match"):
        _C.clip_weights(torch.rand(3), torch.rand(4), CLIP_EPS, 1.0)
    with pytest.raises(RuntimeError, match="one dtype"):
        _C.clip_weights(torch.rand(3), torch.rand(3).double(), CLIP_EPS, 1.0)
    with pytest.raises(RuntimeError, match="float32 or float64"):
        _C.clip_weights(torch.rand(3).half(), torch.rand(3).half(), CLIP_EPS, 1.0)
    with pytest.raises(RuntimeError, match="rounding must have"):
        _C.clip_weights(torch.rand(3), torch.rand(3), CLIP_EPS, 1.0, torch.rand(4))
    with pytest.raises(RuntimeError, match="plus a dim of partial sums"):
        _C.clip_weights(torch.rand(3), torch.rand(3), CLIP_EPS, 1.0, None, True)
    with pytest.raises(RuntimeError, match="plus a dim of partial sums"):
        _C.clip_weights(torch.rand(4, 2), torch.rand(3), CLIP_EPS, 1.0, None, True)


def test_the_extension_loads_whatever_module_is_imported_first():
    """``pdpfast._C`` links against torch's libraries: imported before torch it failed to load
    (libc10.so not found), and every user of the extension silently took its torch route. A fresh
    interpreter importing ``pdpfast._ext`` first must see the extension as this process does."""
    import subprocess
    import sys

    probe = "import pdpfast._ext as e; print(e._IMPORT_ERROR)"
    fresh = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert fresh == str(_ext._IMPORT_ERROR)


@needs_scale
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("parts", [0, 1, 4])
def test_cpp_clip_weights_take_rounding_bounds_as_partial_sums_too(dtype, parts):
    """With parts, ρ may arrive as (B, K) partial sums as well (the linear norm kernel writes both):
    summed in the same call, they give the weights of their sum."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((dtype, parts, "rho parts")).encode()))
    sq, bounds = _inputs((37,), dtype, g)
    partial_sq = torch.cat([sq.unsqueeze(1), torch.zeros(37, max(parts - 1, 0), dtype=dtype)], 1)[:, :parts]
    rho = (torch.rand(37, parts, generator=g, dtype=torch.float64) * 0.1).to(dtype)
    assert clip_weights_route(partial_sq, bounds, None, rho, parts=True) == "C++ kernel"
    got = clip_weights(partial_sq, bounds, None, None, 3.0, rho, parts=True)
    expected = clip_weights_reference(partial_sq.sum(-1), bounds, None, None, 3.0, rho.sum(-1))
    assert torch.equal(got.isnan(), expected.isnan())
    ok = ~expected.isnan()
    torch.testing.assert_close(got[ok], expected[ok], rtol=(parts + 5) * torch.finfo(dtype).eps, atol=0)


def _pending(B, K, acc, g, rho, gamma, loss_scale):
    """PendingWeights of B rows: norms as K partial sums (K = None: summed), ρ summed, as partial sums, or none."""
    sq, bounds = _inputs((B,), acc, g)
    sq = sq.clamp(max=1e6).nan_to_num(0.0)  # finite norms: the products below stay comparable
    if K is not None:
        split = (torch.rand(B, K, generator=g, dtype=torch.float64) + 0.1).to(acc)
        sq = sq.unsqueeze(1) * split / split.sum(1, keepdim=True) if K else torch.zeros(B, 0, dtype=acc)
    rounding = None
    if rho == "summed":
        rounding = (torch.rand(B, generator=g, dtype=torch.float64) * 0.1).to(acc)
    elif rho == "parts":
        rounding = (torch.rand(B, max(K, 1), generator=g, dtype=torch.float64) * 0.1).to(acc)
    return PendingWeights(sq, bounds, gamma, loss_scale, rounding, K is not None)


@needs_scale
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("row", [(), (7,), (3, 5), (0,), (2, 3000)])
@pytest.mark.parametrize("K, rho", [(None, None), (None, "summed"), (0, None), (1, "parts"), (4, None),
                                    (4, "summed"), (4, "parts")])
@pytest.mark.parametrize("gamma, loss_scale", [(None, 1.0), (None, 7.0), (0.01, 2.0)])
def test_cpp_clip_scale_equals_the_weights_cast_and_the_row_product_bit_for_bit(dtype, row, K, rho, gamma,
                                                                                 loss_scale):
    """One call computes the weights, rounds them to x's dtype and scales x's rows, each product
    rounded once: bit for bit what ``clip_weights`` (the same C++ formula), ``weights_to(w, x.dtype)``
    (toward zero in fp16) and torch's ``x * w`` give, for every dtype per-layer clipping computes
    clipped sums in."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((dtype, row, K, rho, gamma, loss_scale)).encode()))
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    for B in (0, 1, 6):
        weights = _pending(B, K, acc, g, rho, gamma, loss_scale)
        x = torch.randn(B, *row, generator=g, dtype=torch.float64).mul_(10).to(dtype)
        assert clip_scale_route(x, weights) == "C++ kernel"
        scaled, w = clip_scale(x, weights)
        expected_w = weights_to(weights.tensor(), dtype)
        assert w.dtype == dtype and w.shape == (B,) and scaled.shape == x.shape and scaled.dtype == dtype
        assert torch.equal(w, expected_w)
        assert torch.equal(scaled, x * expected_w.view(-1, *[1] * len(row)))


@needs_scale
def test_cpp_clip_scale_scales_a_non_contiguous_tensor_and_leaves_it_alone():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, 5, generator=g).transpose(1, 2)  # (4, 5, 6), not contiguous
    before = x.clone()
    weights = PendingWeights(torch.rand(4, generator=g) * 9, torch.rand(4, generator=g), None, 1.0)
    scaled, w = clip_scale(x, weights)
    assert torch.equal(x, before)
    assert torch.equal(scaled, x * weights.tensor().view(-1, 1, 1))


def test_clip_scale_without_the_op_computes_the_same_weights_and_products(monkeypatch):
    """A ``pdpfast._C`` built before ``clip_scale`` (or none): the weights come from ``clip_weights``
    and torch scales the rows, the route saying to rebuild; an empty batch under a mean loss
    (s = 0) weighs nothing on either route."""
    import pdpfast.ops.clip as clip_ops

    g = torch.Generator().manual_seed(5)
    weights = _pending(6, 4, torch.float32, g, "parts", None, 3.0)
    x = torch.randn(6, 8, 3, generator=g).bfloat16()
    fused = clip_scale(x, weights)
    monkeypatch.setattr(clip_ops, "_SCALE_MISSING", "pdpfast._C has no clip_scale (rebuild)")
    assert "rebuild" in clip_scale_route(x, weights)
    scaled, w = clip_scale(x, weights)
    expected_w = weights.tensor().bfloat16()
    assert torch.equal(w, expected_w) and torch.equal(scaled, x * expected_w.view(-1, 1, 1))
    if _ext.missing("clip_scale", "clip.cpp") is None:
        assert torch.equal(fused[0], scaled) and torch.equal(fused[1], w)
    # and rounding bounds as partial sums reach the torch formula summed
    assert "rebuild" in clip_weights_route(weights.sq_norms, weights.clip_norms, None, weights.rounding, parts=True)
    monkeypatch.undo()
    empty = weights._replace(loss_scale=0.0)
    scaled, w = clip_scale(x, empty)
    assert not scaled.any() and not w.any()


def test_clip_scale_route_says_why_it_takes_torch():
    g = torch.Generator().manual_seed(6)
    weights = _pending(5, 3, torch.float32, g, None, None, 1.0)
    x = torch.randn(5, 4)
    if _ext.missing("clip_scale", "clip.cpp") is not None:
        assert clip_scale_route(x, weights).startswith("torch (")
        return
    assert clip_scale_route(x, weights) == "C++ kernel"
    assert "one per row" in clip_scale_route(torch.randn(4, 4), weights)
    assert "one per row" in clip_scale_route(x, weights._replace(clip_norms=weights.clip_norms.expand(2, 5),
                                                                 sq_norms=weights.sq_norms.expand(2, 5, 3)))
    assert "dtype" in clip_scale_route(x.int(), weights)
    assert "precision" in clip_scale_route(x.double(), weights)
    assert "grad" in clip_scale_route(x.requires_grad_(), weights)
    assert "broadcast" in clip_scale_route(x, weights._replace(clip_norms=torch.rand(1)))


@needs_scale
def test_clip_scale_takes_the_cpp_op_for_a_saved_input_inside_a_backward():
    """A layer's saved input requires grad, but its backward runs with grad mode off: the C++ op
    (one call) scales its rows, as the torch route would, and the result requires no grad."""
    g = torch.Generator().manual_seed(7)
    weights = _pending(5, 3, torch.float32, g, None, None, 1.0)
    x = torch.randn(5, 4, generator=g).requires_grad_()
    with torch.no_grad():
        assert clip_scale_route(x, weights) == "C++ kernel"
        scaled, w = clip_scale(x, weights)
    assert not scaled.requires_grad
    torch.testing.assert_close(scaled, x.detach() * weights.tensor().unsqueeze(1), rtol=0, atol=0)
    torch.testing.assert_close(w, weights.tensor(), rtol=0, atol=0)


@needs_scale
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_layer_clipping_scales_a_widening_layers_saved_input_in_one_op(dtype, monkeypatch):
    """A widening linear call (p > d) scales its input's rows, the narrower operand: inside the
    backward that saved input requires grad, and grad mode is off, so per-layer clipping still
    computes its weights and the product in the C++ op (no weights computed apart), with the
    gradients the torch route gives bit for bit."""
    import torch.nn as nn

    import pdpfast
    import pdpfast.clipping as clipping_module
    import pdpfast.ops.clip as clip_ops
    import pdpfast.ops.linear as lin_ops
    from pdpfast.clipping import ClippingState

    monkeypatch.setattr(clipping_module, "SMALL_CALL_BYTES", 0)  # each call on its own: a full-size model's route
    monkeypatch.setattr(lin_ops, "MATERIALIZE_RATIO", 0)
    monkeypatch.setattr(lin_ops, "MATERIALIZE_MIN_ELEMENTS", 0)
    torch.manual_seed(3)
    B, T, d = 4, 5, 8
    model = pdpfast.nn.convert(nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, 4 * d)).to(dtype))
    x = torch.randn(B, T, d, dtype=dtype)
    apart = []
    tensor = PendingWeights.tensor

    def spy_tensor(self):
        apart.append(tuple(self.clip_norms.shape))
        return tensor(self)

    def run():
        state = ClippingState(model, clipping="per_layer")
        with state.attached():
            state.begin_batch(torch.linspace(0.05, 2.0, B))
            model(x).float().pow(2).mean((1, 2)).sum().backward()
            state.end_draw()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return grads

    monkeypatch.setattr(PendingWeights, "tensor", spy_tensor)
    grads = run()
    assert apart == [], apart  # both calls' weights computed in the op that applies them
    monkeypatch.setattr(clip_ops, "clip_scale_route", lambda x, weights: "torch (forced)")
    reference = run()
    assert len(apart) == 2, apart
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name], rtol=0, atol=0, msg=name)


@needs_scale
def test_cpp_clip_scale_refuses_mismatched_inputs_clearly():
    from pdpfast import _C

    sq, bounds = torch.rand(3), torch.rand(3)
    with pytest.raises(RuntimeError, match="B = 3 rows"):
        _C.clip_scale(torch.rand(4, 2), sq, bounds, CLIP_EPS, 1.0)
    with pytest.raises(RuntimeError, match=r"must be \(B,\)"):
        _C.clip_scale(torch.rand(3, 2), sq.expand(2, 3), bounds.expand(2, 3), CLIP_EPS, 1.0)
    with pytest.raises(RuntimeError, match="must be Float"):
        _C.clip_scale(torch.rand(3, 2), sq.double(), bounds.double(), CLIP_EPS, 1.0)
    with pytest.raises(RuntimeError, match="bfloat16"):
        _C.clip_scale(torch.ones(3, 2, dtype=torch.int32), sq, bounds, CLIP_EPS, 1.0)
    with pytest.raises(RuntimeError, match="rounding must have"):
        _C.clip_scale(torch.rand(3, 2), sq, bounds, CLIP_EPS, 1.0, torch.rand(3, 2))  # partial ρ without parts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d, p", [(8, 3), (3, 8)])
@pytest.mark.parametrize("need_weight, need_bias", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("transposed", [False, True])
def test_linear_clipped_grads_from_pending_weights_equal_those_from_the_weights(dtype, d, p, need_weight, need_bias,
                                                                                transposed):
    """A linear call's clipped sum with its weights computed by the op that scales its rows equals
    the sum with the weights computed first, bit for bit, whichever operand is scaled (the narrower:
    o for p ≤ d, else a, the bias then weighing Σ_t o_t by the returned weights)."""
    from pdpfast.ops.linear import linear_clipped_grads

    g = torch.Generator().manual_seed(zlib.crc32(repr((dtype, d, p, need_weight, need_bias, transposed)).encode()))
    B, T = 5, 4
    a = torch.randn(B, T, d, generator=g).to(dtype)
    o = torch.randn(B, T, p, generator=g).to(dtype)
    weights = _pending(B, 3, torch.float32, g, "parts" if dtype == torch.bfloat16 else None, None, 4.0)
    got = linear_clipped_grads(a, o, weights, need_weight, need_bias, transposed)
    expected = linear_clipped_grads(a, o, weights.tensor(), need_weight, need_bias, transposed)
    for x, y in zip(got, expected):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x, y)


def test_per_layer_clipping_weighs_a_large_linear_call_in_the_op_that_scales_it(monkeypatch):
    """Per-layer clipping of a linear call that is neither stacked nor formed per sample hands the
    call its weights uncomputed (``LayerRule.pending_weights``): one ``clip_scale`` per call, and
    the clipped gradients equal those of the weights computed first. (Where ``pdpfast._C`` has it, the
    call's whole clipped sum is one C++ call, ``linear_clipped_into``, that runs ``clip_scale`` inside.)"""
    import pdpfast
    import pdpfast.clipping as clipping_module
    import pdpfast.ops.clip as clip_ops
    import pdpfast.ops.linear as lin_ops
    from pdpfast.clipping import ClippingState

    monkeypatch.setattr(clipping_module, "SMALL_CALL_BYTES", 0)
    monkeypatch.setattr(lin_ops, "MATERIALIZE_RATIO", 0)
    monkeypatch.setattr(lin_ops, "MATERIALIZE_MIN_ELEMENTS", 0)
    routes = []
    route = clip_ops.clip_scale_route

    def spy(x, weights):
        routes.append(route(x, weights))
        return routes[-1]

    monkeypatch.setattr(clip_ops, "clip_scale_route", spy)
    torch.manual_seed(0)
    model = pdpfast.nn.convert(torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 4)))
    x = torch.randn(5, 7, 6)

    def run():
        state = ClippingState(model, clipping="per_layer")
        with state.attached():
            state.begin_batch(torch.linspace(0.05, 2.0, 5))
            model(x).pow(2).sum().backward()
            state.end_draw()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return grads

    grads = run()
    fused = "C++ kernel" if _ext.missing("clip_scale", "clip.cpp") is None else routes[0]
    assert routes == [fused, fused]
    monkeypatch.setattr(clip_ops, "_SCALE_MISSING", "stale")  # the weights first, then torch's product
    expected = run()
    assert len(routes) > 2 and set(routes[2:]) == {"torch (stale)"}
    for name in expected:
        assert torch.equal(grads[name], expected[name]), name


def test_fp16_weights_round_toward_zero_and_other_dtypes_to_nearest():
    """Below fp16's smallest normal a weight rounded to nearest could grow by 2^-25, which times an
    unclipped gradient exceeds the bound: fp16 weights never grow, on the torch and the C++ route."""
    g = torch.Generator().manual_seed(5)
    w = torch.cat([torch.logspace(-9, 0, 200, dtype=torch.float64).float(), torch.rand(56, generator=g),
                   torch.tensor([0.0, 1.0, 7e4])])
    half = weights_to(w, torch.float16)
    assert half.dtype == torch.float16 and (half.float() <= w).all()
    step = torch.where(w < 2.0 ** -14, 2.0 ** -24, w * 2.0 ** -10)  # one step at most (and 65504 above it)
    assert ((w - half.float()) <= step)[:-1].all() and half[-1] == 65504
    assert torch.equal(weights_to(w, torch.bfloat16), w.to(torch.bfloat16))
    assert weights_to(w, torch.float32) is w
    if _ext.missing("clip_scale", "clip.cpp") is None:
        sq = (torch.ones_like(w) / w.clamp_min(1e-30)).square()
        pending = PendingWeights(sq, torch.ones_like(w), None, 1.0)
        x = torch.ones(w.shape[0], 3, dtype=torch.float16)
        scaled, cpp = clip_scale(x, pending)
        assert torch.equal(cpp, weights_to(pending.tensor(), torch.float16))
