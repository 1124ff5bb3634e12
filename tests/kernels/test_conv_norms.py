"""Fused conv weight-norm kernels against float64 torch.func per-sample gradients.

The oracle differentiates the module itself (its own padding, padding_mode, stride, dilation,
groups) per sample in float64; the kernels see ``conv_pad``'s padded input, as the DP layers pass
it. Tolerance: kernel error ≤ 2 × the torch reference's error at the same dtype + fp32
accumulation slack (``ACC_RTOL`` × the sum's conditioning), as in test_norms.py.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

pytest.importorskip("triton")

from pdpfast.kernels import conv_norms  # noqa: E402
from pdpfast.ops import conv as conv_ops  # noqa: E402
from pdpfast.ops import dispatch  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ACC_RTOL = 1e-5

# (module factory, per-sample input shape): odd channel counts (1, 3, 7), 5×7 images, every option
CASES = {
    "2d-1x1": (lambda: nn.Conv2d(3, 7, 1), (3, 5, 7)),
    "2d-3x3-pad1": (lambda: nn.Conv2d(3, 7, 3, padding=1), (3, 5, 7)),
    "2d-one-channel": (lambda: nn.Conv2d(1, 1, 3, bias=False), (1, 5, 7)),
    "2d-stride2": (lambda: nn.Conv2d(7, 3, 3, stride=2, padding=1), (7, 5, 7)),
    "2d-1x1-stride2": (lambda: nn.Conv2d(3, 7, 1, stride=2, bias=False), (3, 5, 7)),
    "2d-asym-stride-dilation": (lambda: nn.Conv2d(3, 7, (2, 3), stride=(2, 1), dilation=(2, 1), padding=(1, 2)),
                                (3, 5, 7)),
    "2d-same-dilation2": (lambda: nn.Conv2d(3, 3, 3, padding="same", dilation=2), (3, 5, 7)),
    "2d-groups3": (lambda: nn.Conv2d(3, 6, 3, groups=3, padding=1), (3, 5, 7)),
    "2d-depthwise7": (lambda: nn.Conv2d(7, 7, 3, groups=7, padding=1, bias=False), (7, 5, 7)),
    "2d-reflect": (lambda: nn.Conv2d(3, 7, 3, padding=1, padding_mode="reflect"), (3, 5, 7)),
    "2d-replicate-same": (lambda: nn.Conv2d(3, 7, (3, 2), padding="same", padding_mode="replicate"), (3, 5, 7)),
    "2d-circular": (lambda: nn.Conv2d(7, 3, 3, padding=(2, 1), padding_mode="circular", dilation=(2, 1)),
                    (7, 5, 7)),
    # several tiles on every axis: K = 9·9 = 81, p = 70, L = 81 (two 64-row Gram tiles: the even case)
    "2d-multi-tile": (lambda: nn.Conv2d(9, 70, 3, padding=1), (9, 9, 9)),
    "1d-k3": (lambda: nn.Conv1d(3, 7, 3), (3, 11)),
    "1d-stride-dilation": (lambda: nn.Conv1d(7, 3, 5, stride=2, dilation=2, padding=3), (7, 11)),
    "1d-same-circular-groups": (lambda: nn.Conv1d(3, 3, 3, padding="same", padding_mode="circular", groups=3),
                                (3, 11)),
    "1d-replicate-one-channel": (lambda: nn.Conv1d(1, 7, 4, padding=2, padding_mode="replicate"), (1, 11)),
    # L = 150: three Gram tiles (the odd case) and five direct reduction steps
    "1d-long": (lambda: nn.Conv1d(3, 5, 3, padding=1), (3, 150)),
}


def _make(name, seed=0):
    torch.manual_seed(seed)
    factory, shape = CASES[name]
    return factory(), shape


def _inputs(gen, module, shape, B, dtype, tools):
    """(x, x_pad, o) rounded to ``dtype``; x_pad padded in float64 (exact) then cast."""
    x = tools.randn(gen, B, *shape, dtype=dtype)
    x_pad = conv_ops.conv_pad(x.double(), module).to(dtype)
    conv = F.conv1d if isinstance(module, nn.Conv1d) else F.conv2d
    y = conv(x_pad.double(), module.weight.double(), None, module.stride, 0, module.dilation, module.groups)
    o = tools.randn(gen, *y.shape, dtype=dtype)
    return x, x_pad.to(tools.device), o.to(tools.device)


def per_sample_sq_norms_oracle(module, x, o):
    """‖∂⟨module(x_i), o_i⟩/∂W‖² per sample by torch.func in float64 (the module pads itself)."""
    m64 = copy.deepcopy(module).double()
    weight = m64.weight.detach()

    def inner(w, xi, oi):
        return (functional_call(m64, {"weight": w}, (xi.unsqueeze(0),)) * oi.unsqueeze(0)).sum()

    grads = vmap(grad(inner), in_dims=(None, 0, 0))(weight, x.double().cpu(), o.double().cpu())
    return grads.flatten(1).pow(2).sum(1)


def _scale(x_pad, o, module):
    """Σ_groups (Σ_t ‖a_t‖‖o_t‖)²: bounds both paths' sums of absolute terms (see test_norms.py)."""
    a, out = conv_ops.conv_as_linear(x_pad.double().cpu(), o.double().cpu(), module)
    return (a.norm(dim=-1) * out.norm(dim=-1)).sum(-1).pow(2).view(x_pad.shape[0], module.groups).sum(1)


def _torch_reference(x_pad, o, module, monkeypatch):
    """What plain torch achieves at the inputs' dtype (kernels disabled inside)."""
    with monkeypatch.context() as patch:
        patch.setenv("PDPFAST_DISABLE_TRITON", "1")
        return conv_ops.conv_weight_sq_norms_reference(x_pad.cpu(), o.cpu(), module)


def _check(tools, module, x, x_pad, o, path, monkeypatch, what):
    out = conv_norms.conv_weight_sq_norms(x_pad, o, module, path=path)
    assert out.dtype == torch.float32 and out.shape == (x.shape[0],), what
    tools.check(out, _torch_reference(x_pad, o, module, monkeypatch), per_sample_sq_norms_oracle(module, x, o),
                atol=ACC_RTOL * _scale(x_pad, o, module) + 1e-30, what=what)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["direct", "gram"])
@pytest.mark.parametrize("name", list(CASES))
def test_conv_weight_sq_norms(tools, gen, name, path, dtype, monkeypatch):
    module, shape = _make(name)
    x, x_pad, o = _inputs(gen, module, shape, 3, dtype, tools)
    _check(tools, module, x, x_pad, o, path, monkeypatch, f"{name} {path} {dtype}")


def _random_conv(seed: int):
    """(module, per-sample input shape, batch): a Conv1d/Conv2d no one chose, drawn from ``seed``
    (groups, odd channel counts, kernel, stride, dilation, padding ints / "same" / "valid", mode)."""
    import random

    r = random.Random(seed)
    dim, groups = r.choice([1, 2]), r.choice([1, 1, 2, 3])
    c_in, c_out = groups * r.choice([1, 2, 3, 5]), groups * r.choice([1, 2, 3, 9, 33])
    kernel = tuple(r.randint(1, 4) for _ in range(dim))
    dilation = tuple(r.randint(1, 3) for _ in range(dim))
    size = tuple(r.randint(d * (k - 1) + 1, 13) for k, d in zip(kernel, dilation))
    mode = r.choice(["zeros", "zeros", "reflect", "replicate", "circular"])
    if r.random() < 0.3:
        padding, stride = r.choice(["same", "valid"]), 1
    else:  # padding modes other than zeros need padding < size
        padding = tuple(min(r.randint(0, 3), n - 1) for n in size)
        stride = tuple(r.randint(1, 3) for _ in range(dim))
    conv = nn.Conv1d if dim == 1 else nn.Conv2d
    module = conv(c_in, c_out, kernel, stride=stride, padding=padding, dilation=dilation, groups=groups,
                  bias=r.random() < 0.5, padding_mode=mode)
    return module, (c_in, *size), r.choice([1, 2, 3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", ["auto", "direct", "gram"])
@pytest.mark.parametrize("seed", range(24))
def test_conv_weight_sq_norms_random_configurations(tools, gen, seed, path, dtype, monkeypatch):
    module, shape, B = _random_conv(seed)
    x, x_pad, o = _inputs(gen, module, shape, B, dtype, tools)
    _check(tools, module, x, x_pad, o, path, monkeypatch, f"{module} B={B} {path} {dtype}")


def _unpadded(gen, module, shape, B, dtype, tools):
    """(x, x_pad, o, padding) for a module whose zero padding the kernel can apply itself (symmetric
    zeros, ``own_padding``); None for one whose input ``conv_pad`` must pad."""
    from pdpfast.nn.conv import _DPConv

    padding = _DPConv.own_padding(module)
    if padding is None:
        return None
    x, x_pad, o = _inputs(gen, module, shape, B, dtype, tools)
    return x.to(tools.device), x_pad, o, padding


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["direct", "gram"])
@pytest.mark.parametrize("case", [*CASES, *(f"random-{seed}" for seed in range(24))])
def test_padding_applied_by_masking_equals_a_padded_copy_bit_for_bit(tools, gen, case, path, dtype):
    """``padding=``: the kernel reads the unpadded input, taps in the padding masked to zero, so the
    DP layers need no padded copy of each conv input; the products and their order are the padded
    copy's, so the norms are the same bits (and the partial sums, ``parts``, sum to them)."""
    if case.startswith("random-"):
        module, shape, B = _random_conv(int(case.split("-")[1]))
    else:
        (module, shape), B = _make(case), 3
    got = _unpadded(gen, module, shape, B, dtype, tools)
    if got is None:
        pytest.skip("padding modes and asymmetric 'same' pad the input first (conv_pad)")
    x, x_pad, o, padding = got
    expected = conv_norms.conv_weight_sq_norms(x_pad, o, module, path)
    assert torch.equal(conv_norms.conv_weight_sq_norms(x, o, module, path, padding=padding), expected)
    parts = conv_norms.conv_weight_sq_norms(x, o, module, path, padding=padding, parts=True)
    assert parts.dim() == 2 and parts.shape[0] == B and parts.dtype == torch.float32
    assert torch.equal(parts.sum(1), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("padded", [False, True], ids=["masked-padding", "padded-copy"])
@pytest.mark.parametrize("name", ["2d-3x3-pad1", "2d-stride2", "2d-groups3", "2d-multi-tile", "1d-stride-dilation",
                                  "1d-long", "2d-reflect"])
def test_a_grouped_launch_equals_each_calls_own_launch_bit_for_bit(tools, gen, name, padded, dtype):
    """``conv_sq_norms_grouped``: n calls of one shape in one launch, each found at its offset from
    the first call's tensors (before it in memory too: views of one tensor, in reverse order), give the
    partial sums each call's own launch gives, the norms' and (with u) ρ's."""
    module, shape = _make(name)
    B, n = 3, 4
    own = None if padded else _DPConv_own_padding(module)
    if own is None and not padded:
        pytest.skip("this layer's input is padded first (conv_pad)")
    x = tools.randn(gen, n, B, *shape, dtype=dtype, device=tools.device)
    if padded:
        x = torch.stack([conv_ops.conv_pad(x[c].double(), module).to(dtype) for c in range(n)])
    padded_shape = conv_ops.conv_pad(x[0].double(), module).shape if not padded else x[0].shape
    conv = F.conv1d if isinstance(module, nn.Conv1d) else F.conv2d
    out_shape = conv(torch.zeros(padded_shape, dtype=torch.float64), module.weight.double(), None, module.stride, 0,
                     module.dilation, module.groups).shape
    o = tools.randn(gen, n, *out_shape, dtype=dtype, device=tools.device)
    calls = [(x[c], o[c]) for c in reversed(range(n))]  # later calls before the first one in memory
    grouped, no_rho = conv_norms.conv_sq_norms_grouped(calls, module, own)
    assert isinstance(grouped, torch.Tensor) and grouped.shape[:2] == (n, B) and no_rho is None
    sq, rho = conv_norms.conv_sq_norms_grouped(calls, module, own, 2.0 ** -8, True)
    assert torch.equal(sq, grouped) and rho.shape[:2] == (n, B)
    for c, (xc, oc) in enumerate(calls):
        assert torch.equal(grouped[c], conv_norms.conv_weight_sq_norms(xc, oc, module, padding=own, parts=True))
        own_sq, own_rho = conv_norms.conv_sq_norms_rounding(xc, oc, module, True, 2.0 ** -8, padding=own, parts=True)
        assert torch.equal(sq[c], own_sq) and torch.equal(rho[c], own_rho)


def _DPConv_own_padding(module):
    from pdpfast.nn.conv import _DPConv

    return _DPConv.own_padding(module)


def test_grouped_calls_that_do_not_match_take_their_own_launches(tools, gen):
    """Calls of other shapes or strides than the first one's are not read at an offset: each takes its own
    launch (a list of their partial sums), and an empty batch gives zeros."""
    module, shape = _make("2d-3x3-pad1")
    x = tools.randn(gen, 3, *shape, device=tools.device)
    o = tools.randn(gen, 3, 7, *shape[1:], device=tools.device)
    calls = [(x, o), (x[:2], o[:2]), (x.to(memory_format=torch.channels_last), o)]
    got, rho = conv_norms.conv_sq_norms_grouped(calls, module, (1, 1), 2.0 ** -8)
    assert isinstance(got, list) and len(got) == 3 and isinstance(rho, list) and len(rho) == 3
    for (xc, oc), g, r in zip(calls, got, rho):
        assert torch.equal(g, conv_norms.conv_weight_sq_norms(xc, oc, module, padding=(1, 1), parts=True))
        assert torch.equal(r, conv_norms.conv_sq_norms_rounding(xc, oc, module, False, 2.0 ** -8, padding=(1, 1),
                                                                parts=True)[1])
    empty, empty_rho = conv_norms.conv_sq_norms_grouped([(x[:0], o[:0])] * 2, module, (1, 1), 2.0 ** -8)
    assert empty.shape == empty_rho.shape == (2, 0, 1)


U = 2.0 ** -8


def rounding_oracle(module, x_pad, o, with_bias, u=U):
    """ρ_i = u·Σ_g Σ_q ‖o_{q,g}‖·√(‖a_{q,g}‖² [+ 1]) per sample in float64, from the unfolded padded input
    (rows per sample and group)."""
    a, out = conv_ops.conv_as_linear(x_pad.double().cpu(), o.double().cpu(), module)
    sq_a = a.pow(2).sum(-1) + (1.0 if with_bias else 0.0)
    return u * (sq_a.sqrt() * out.norm(dim=-1)).sum(-1).view(x_pad.shape[0], module.groups).sum(1)


def _check_rounding(tools, module, x, x_pad, o, path, with_bias, padding, what):
    """Norms and ρ from one launch: the norms the same bits as the norm launch's, ρ against float64
    (a grouped convolution's summed over its groups)."""
    sq, rho = conv_norms.conv_sq_norms_rounding(x, o, module, with_bias, U, padding, path=path)
    assert sq.dtype == rho.dtype == torch.float32 and sq.shape == rho.shape == (x.shape[0],), what
    assert torch.equal(sq, conv_norms.conv_weight_sq_norms(x, o, module, path, padding=padding)), what
    torch.testing.assert_close(rho.double().cpu(), rounding_oracle(module, x_pad, o, with_bias),
                               rtol=ACC_RTOL + _tensor_core_rtol(x, o, module), atol=0, msg=what)


def _tensor_core_rtol(x, o, module) -> float:
    """On a GPU the Gram path's fp16/bf16 diagonals come from the tensor cores, whose fp32 accumulation
    truncates: up to (reduction length)·2⁻²³ of a sum, in one direction (as in test_norms.py); the
    clipping state's margin for fp16/bf16 (4u ≥ 2e-3) covers it."""
    if not x.is_cuda or torch.promote_types(x.dtype, o.dtype) not in (torch.float16, torch.bfloat16):
        return 0.0
    return max(x.shape[1] * math.prod(module.kernel_size), o.shape[1]) * 2.0 ** -23


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["direct", "gram"])
@pytest.mark.parametrize("case", [*CASES, *(f"random-{seed}" for seed in range(24))])
def test_rounding_bound_from_the_norm_launch_against_float64(tools, gen, case, path, dtype):
    """``conv_sq_norms_rounding``: ρ_i from the norm kernel's own launch (the Gram path off its Grams'
    diagonals, the direct path from a chunk of positions per program), with and without the bias's
    column, on the padded copy and with the padding masked, equals u·Σ_q ‖o_q‖·√(‖a_q‖² [+ 1])."""
    if case.startswith("random-"):
        module, shape, B = _random_conv(int(case.split("-")[1]))
    else:
        (module, shape), B = _make(case), 3
    x, x_pad, o = _inputs(gen, module, shape, B, dtype, tools)
    _check_rounding(tools, module, x_pad, x_pad, o, path, True, None, f"{case} {path} {dtype} padded copy")
    got = _unpadded(gen, module, shape, B, dtype, tools)
    if got is not None:
        x, x_pad, o, padding = got
        _check_rounding(tools, module, x, x_pad, o, path, False, padding, f"{case} {path} {dtype} masked")


@pytest.mark.parametrize("path", ["direct", "gram"])
@pytest.mark.parametrize("name", ["2d-3x3-pad1", "2d-multi-tile", "1d-long", "2d-groups3"])
def test_rounding_bound_parts_are_the_launchs_partial_sums(tools, gen, name, path):
    """parts=True: ρ comes as the launch's (B, K) partial sums beside the norms' (B, K), whose row sums
    are the summed results."""
    module, shape = _make(name)
    x, x_pad, o, padding = _unpadded(gen, module, shape, 3, torch.bfloat16, tools)
    sq, rho = conv_norms.conv_sq_norms_rounding(x, o, module, True, U, padding, path=path)
    sq_parts, rho_parts = conv_norms.conv_sq_norms_rounding(x, o, module, True, U, padding, True, path=path)
    assert sq_parts.dim() == 2 and sq_parts.shape[0] == 3 and torch.equal(sq_parts.sum(1), sq)
    assert rho_parts.shape == sq_parts.shape
    torch.testing.assert_close(rho_parts.sum(1), rho, rtol=1e-6, atol=0)


@pytest.mark.parametrize("path", ["direct", "gram"])
def test_rounding_bound_on_empty_single_sample_channels_last_and_mixed_dtype_calls(tools, gen, path):
    module, shape = _make("2d-stride2")
    for B in (0, 1):
        x, x_pad, o, padding = _unpadded(gen, module, shape, B, torch.bfloat16, tools)
        _check_rounding(tools, module, x, x_pad, o, path, True, padding, f"B={B}")
        sq, rho = conv_norms.conv_sq_norms_rounding(x, o, module, True, U, padding, True, path=path)
        assert sq.shape[0] == rho.shape[0] == B
    x, x_pad, o, padding = _unpadded(gen, module, shape, 3, torch.float32, tools)
    x_cl, o_cl = x.to(memory_format=torch.channels_last), o.to(memory_format=torch.channels_last)
    _check_rounding(tools, module, x_cl, x_pad, o_cl, path, False, padding, "channels_last")
    # autocast: an fp32 input beside a bf16 output gradient meet in fp32
    _check_rounding(tools, module, x, x_pad, o.bfloat16().float(), path, False, padding, "fp32")
    sq, rho = conv_norms.conv_sq_norms_rounding(x, o.bfloat16(), module, False, U, padding, path=path)
    torch.testing.assert_close(rho.double().cpu(), rounding_oracle(module, x_pad, o.bfloat16(), False), rtol=ACC_RTOL,
                               atol=0)


def test_rounding_bound_adds_no_launch_to_the_conv_norm_kernel(tools, gen):
    """ρ costs no operation beyond the norms' own: as many ops and Triton launches for both as for the
    norms alone (five more ops on the torch route: two reductions, a one-channel convolution, a square
    root and a batched dot)."""
    module, shape = _make("2d-3x3-pad1")
    x, _, o, padding = _unpadded(gen, module, shape, 3, torch.bfloat16, tools)
    with tools.op_log() as norms_only:
        conv_norms.conv_weight_sq_norms(x, o, module, padding=padding, parts=True)
    with tools.op_log() as both:
        conv_norms.conv_sq_norms_rounding(x, o, module, True, U, padding=padding, parts=True)
    assert len(norms_only.launches) == len(both.launches) == 1
    assert both.ops == norms_only.ops, (both.ops, norms_only.ops)


def test_padding_given_as_numpy_ints_is_applied_by_masking(tools, gen):
    """A module built with numpy ints keeps them in its padding (torch accepts them): the kernel takes them."""
    import numpy as np

    module, shape = _make("2d-stride2")
    x, x_pad, o, padding = _unpadded(gen, module, shape, 2, torch.float32, tools)
    numpy_padding = tuple(np.int64(p) for p in padding)
    assert torch.equal(conv_norms.conv_weight_sq_norms(x, o, module, padding=numpy_padding),
                       conv_norms.conv_weight_sq_norms(x_pad, o, module))


def test_padding_applied_by_masking_against_the_oracle_on_empty_and_single_sample_batches(tools, gen, monkeypatch):
    module, shape = _make("2d-stride2")
    for B in (0, 1):
        x, x_pad, o, padding = _unpadded(gen, module, shape, B, torch.float32, tools)
        out = conv_norms.conv_weight_sq_norms(x, o, module, padding=padding)
        assert out.shape == (B,)
        if B:
            tools.check(out, _torch_reference(x_pad, o, module, monkeypatch), per_sample_sq_norms_oracle(module, x, o),
                        atol=ACC_RTOL * _scale(x_pad, o, module) + 1e-30, what="B=1, masked padding")
        parts = conv_norms.conv_weight_sq_norms(x, o, module, padding=padding, parts=True)
        assert parts.shape[0] == B and parts.dim() == 2


@pytest.mark.parametrize("padding", [(1,), (1, -1), (1.0, 1), (True, 1), "same"])
def test_a_padding_that_is_not_one_int_per_spatial_dim_is_refused(tools, gen, padding):
    module, shape = _make("2d-3x3-pad1")
    x, _, o = _inputs(gen, module, shape, 2, torch.float32, tools)
    with pytest.raises(ValueError, match="padding must be None or 2 int"):
        conv_norms.conv_weight_sq_norms(x.to(tools.device), o, module, padding=padding)


@pytest.mark.parametrize("path", ["auto", "direct", "gram"])
@pytest.mark.parametrize("name", ["2d-3x3-pad1", "2d-groups3", "1d-stride-dilation"])
def test_conv_weight_sq_norms_single_sample(tools, gen, name, path, monkeypatch):
    module, shape = _make(name)
    x, x_pad, o = _inputs(gen, module, shape, 1, torch.float32, tools)
    _check(tools, module, x, x_pad, o, path, monkeypatch, f"{name} B=1 {path}")


@pytest.mark.parametrize("path", ["auto", "direct", "gram"])
@pytest.mark.parametrize("name", ["2d-3x3-pad1", "1d-k3"])
def test_conv_weight_sq_norms_empty_batch(tools, gen, name, path):
    module, shape = _make(name)
    _, x_pad, o = _inputs(gen, module, shape, 0, torch.float32, tools)
    out = conv_norms.conv_weight_sq_norms(x_pad, o, module, path=path)
    assert out.shape == (0,) and out.dtype == torch.float32


@pytest.mark.parametrize("name", list(CASES))
def test_conv_weight_sq_norms_auto(tools, gen, name, monkeypatch):
    module, shape = _make(name)
    x, x_pad, o = _inputs(gen, module, shape, 3, torch.float32, tools)
    _check(tools, module, x, x_pad, o, "auto", monkeypatch, f"{name} auto")


@pytest.mark.parametrize("path", ["direct", "gram"])
def test_conv_weight_sq_norms_channels_last_and_strided(tools, gen, path, monkeypatch):
    """Any strides: channels_last tensors (unit channel stride) and a sliced, non-contiguous o."""
    module, shape = _make("2d-stride2")
    x, x_pad, o = _inputs(gen, module, shape, 3, torch.float32, tools)
    x_cl, o_cl = x_pad.to(memory_format=torch.channels_last), o.to(memory_format=torch.channels_last)
    assert x_cl.stride(1) == 1 and not o_cl.is_contiguous()
    _check(tools, module, x, x_cl, o_cl, path, monkeypatch, f"channels_last {path}")
    wide = tools.randn(gen, o.shape[0], o.shape[1], o.shape[2], 2 * o.shape[3], device=tools.device)
    o_sliced = wide[..., ::2]
    assert not o_sliced.is_contiguous()
    _check(tools, module, x, x_pad, o_sliced, path, monkeypatch, f"sliced o {path}")


def test_conv_weight_sq_norms_mixed_dtypes(tools, gen, monkeypatch):
    """Autocast keeps the fp32 input beside a bf16 output gradient: they meet in fp32."""
    module, shape = _make("2d-3x3-pad1")
    x, x_pad, o = _inputs(gen, module, shape, 3, torch.bfloat16, tools)
    _check(tools, module, x, x_pad.float(), o, "auto", monkeypatch, "fp32 × bf16")


def test_conv_weight_sq_norms_float64_runs_reference(tools, gen):
    module, shape = _make("2d-groups3")
    _, x_pad, o = _inputs(gen, module, shape, 3, torch.float64, tools)
    out = conv_norms.conv_weight_sq_norms(x_pad, o, module)
    assert out.dtype == torch.float64
    assert torch.equal(out, conv_ops.conv_weight_sq_norms_reference(x_pad, o, module))


def test_conv_weight_sq_norms_rejects_bad_arguments(tools, gen):
    module, shape = _make("2d-3x3-pad1")
    _, x_pad, o = _inputs(gen, module, shape, 2, torch.float32, tools)
    with pytest.raises(ValueError, match="path"):
        conv_norms.conv_weight_sq_norms(x_pad, o, module, path="ghost")
    with pytest.raises(ValueError, match="conv_pad"):  # the unpadded input
        conv_norms.conv_weight_sq_norms(x_pad[..., 1:-1, 1:-1], o, module)


def test_kernel_path_never_materializes_per_sample_grads(tools, gen, monkeypatch):
    """Issue 12 item 3: nothing of size B × |W| (and no im2col) on the dispatched kernel path."""
    registered = dispatch.registered()["conv_weight_sq_norms"].kernel  # the fused launcher, not the reference
    assert registered.__qualname__ == conv_norms.conv_weight_sq_norms.__qualname__
    assert registered is not conv_ops.conv_weight_sq_norms_reference

    def forbidden(*args, **kwargs):
        raise AssertionError("the kernel path must not materialize per-sample gradients or unfold")

    module, shape = _make("2d-multi-tile")
    x, x_pad, o = _inputs(gen, module, shape, 3, torch.float32, tools)
    expected = per_sample_sq_norms_oracle(module, x, o)
    monkeypatch.setattr(conv_ops, "_per_sample_grad_chunks", forbidden)
    monkeypatch.setattr(conv_ops, "conv_as_linear", forbidden)
    monkeypatch.setattr(F, "unfold", forbidden)
    monkeypatch.setattr(conv_ops, "_UNFOLD_LIMIT", 0)  # the reference would take the per-sample path
    out = conv_ops.conv_weight_sq_norms(x_pad, o, module)  # through pick(), as the DP layers call it
    torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-5, atol=0)


def test_reference_path_squares_per_sample_grads_chunk_by_chunk(gen, monkeypatch):
    """The CPU reference also holds at most one chunk of per-sample gradients, never B × |W|."""
    module = nn.Conv2d(3, 4, 3, padding=1).double()
    x_pad = conv_ops.conv_pad(torch.randn(5, 3, 5, 7, generator=gen, dtype=torch.float64), module)
    o = torch.randn(5, 4, 5, 7, generator=gen, dtype=torch.float64)
    monkeypatch.setattr(conv_ops, "_UNFOLD_LIMIT", 0)
    monkeypatch.setattr(conv_ops, "_GRAM_FRACTION", 0.0)
    monkeypatch.setattr(conv_ops, "_CHUNK_ELEMENTS", 2 * module.weight.numel())
    sizes = []
    chunks = conv_ops._per_sample_grad_chunks

    def spy(*args):
        for samples, grads in chunks(*args):
            sizes.append(grads.shape[0])
            yield samples, grads

    monkeypatch.setattr(conv_ops, "_per_sample_grad_chunks", spy)
    out = conv_ops.conv_weight_sq_norms_reference(x_pad, o, module)
    assert sizes == [1, 2, 2]  # even chunks: no chunk beyond the budget, none needlessly short
    torch.testing.assert_close(out, per_sample_sq_norms_oracle(module, x_pad[..., 1:-1, 1:-1], o))


# ----------------------------------------------------------------------------------------------
# cost model
# ----------------------------------------------------------------------------------------------
def _resnet_geometry(channels, side, batch=256, k=3):
    return conv_norms.ConvNormGeometry(batch, 1, side * side, channels * k * k, channels)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cost_model_picks_gram_late_and_direct_early(dtype):
    """Few positions, wide channels → Gram (ResNet-18 stages 3–4); many positions → direct."""
    assert conv_norms.choose_path(_resnet_geometry(512, 4), dtype) == "gram"
    assert conv_norms.choose_path(_resnet_geometry(256, 8), dtype) == "gram"
    assert conv_norms.choose_path(_resnet_geometry(64, 32), dtype) == "direct"
    assert conv_norms.choose_path(_resnet_geometry(128, 16), dtype) == "direct"


def test_cost_model_counts_at_least_the_exact_work():
    geo = conv_norms.ConvNormGeometry(3, 2, 35, 27, 7)
    costs = conv_norms.conv_norm_costs(geo, torch.float32)
    assert costs["direct"].flops >= 2 * 3 * 2 * 35 * 27 * 7
    assert costs["gram"].flops >= 3 * 2 * 35 * 35 * (27 + 7)
    assert all(c.seconds > 0 and c.bytes > 0 and c.programs > 0 for c in costs.values())


# ----------------------------------------------------------------------------------------------
# GPU sizes (ResNet-18 CIFAR layers at a small batch) and memory
# ----------------------------------------------------------------------------------------------
RESNET_LAYERS = {  # (C_in, C_out, side, kernel, stride)
    "64ch-32px": (64, 64, 32, 3, 1), "128ch-16px-stride2": (64, 128, 32, 3, 2),
    "128ch-downsample-1x1": (64, 128, 32, 1, 2), "256ch-8px": (256, 256, 8, 3, 1), "512ch-4px": (512, 512, 4, 3, 1),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["auto", "direct", "gram"])
@pytest.mark.parametrize("layer", list(RESNET_LAYERS))
def test_conv_weight_sq_norms_gpu_sizes(tools, gen, layer, path, dtype, monkeypatch):
    C_in, C_out, side, k, stride = RESNET_LAYERS[layer]
    module = nn.Conv2d(C_in, C_out, k, stride=stride, padding=k // 2, bias=False)
    B = 8
    x = tools.randn(gen, B, C_in, side, side, dtype=dtype)
    x_pad = conv_ops.conv_pad(x.double(), module).to(dtype).to(tools.device)
    y = F.conv2d(x_pad.double().cpu(), module.weight.double(), None, module.stride)
    o = tools.randn(gen, *y.shape, dtype=dtype).to(tools.device)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = conv_norms.conv_weight_sq_norms(x_pad, o, module, path=path)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < B * module.weight.numel() * 2 // 4, f"{extra} bytes: per-sample gradients materialized?"
    oracle = conv_ops.conv_weight_sq_norms_reference(x_pad.double(), o.double(), module.double())
    tools.check(out, _torch_reference(x_pad, o, module.float(), monkeypatch), oracle,
                atol=ACC_RTOL * _scale(x_pad, o, module), what=f"{layer} {path} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["direct", "gram"])
@pytest.mark.parametrize("layer", list(RESNET_LAYERS))
def test_rounding_bound_from_the_norm_launch_at_gpu_sizes(tools, gen, layer, path, dtype):
    """ResNet-18's layers, masked padding, both paths: ρ against float64, the norms the norm launch's bits."""
    C_in, C_out, side, k, stride = RESNET_LAYERS[layer]
    module = nn.Conv2d(C_in, C_out, k, stride=stride, padding=k // 2, bias=False)
    x, x_pad, o, padding = _unpadded(gen, module, (C_in, side, side), 8, dtype, tools)
    _check_rounding(tools, module, x, x_pad, o, path, False, padding, f"{layer} {path} {dtype}")


@pytest.mark.parametrize("allow_tf32", [False, True])
@pytest.mark.parametrize("path", ["direct", "gram"])
def test_fp32_products_follow_cudnns_tf32_policy(tools, gen, path, allow_tf32, monkeypatch):
    """fp32 tiles go to the tensor cores as one TF32 product only on a GPU and only where torch lets
    cuDNN's convolutions use TF32 (clipping's bounds then keep the TF32 margin; otherwise tf32x3,
    near-fp32, or exact under the interpreter); the norms stay within TF32's
    rounding (operands to 11 significant bits: 2^-10 relative on each product, so 4·2^-10 of the
    sum of absolute terms on a squared norm, with room) of the float64 oracle."""
    torch.backends.cudnn.allow_tf32 = allow_tf32
    seen = []
    flags = conv_norms.dot_flags
    monkeypatch.setattr(conv_norms, "dot_flags", lambda dtype, tf32=False: seen.append(tf32) or flags(dtype, tf32))
    module, shape = _make("2d-multi-tile")
    x, x_pad, o = _inputs(gen, module, shape, 3, torch.float32, tools)
    out = conv_norms.conv_weight_sq_norms(x_pad, o, module, path=path)
    assert seen == [allow_tf32 and x_pad.is_cuda]
    scale = _scale(x_pad, o, module)
    err = (out.double().cpu() - per_sample_sq_norms_oracle(module, x, o)).abs()
    assert (err <= (4 * 2.0 ** -10 if seen[0] else ACC_RTOL) * scale).all()
