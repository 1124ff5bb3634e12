"""LayerNorm / RMSNorm per-sample affine gradient kernel against float64 oracles and the torch references."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

pytest.importorskip("triton")

from pdpfast.kernels import norm_grads  # noqa: E402
from pdpfast.ops import dispatch  # noqa: E402
from pdpfast.ops import norm as norm_ops  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (input shape, normalized shape): odd sizes, one position (2-D input), several row tiles of the
# loop (BLOCK_T = 4096 // BLOCK_N rows at most: 33 positions at N = 768 take nine), N = 1 (x̂ = 0),
# a two-dim normalized shape, a row of two N-blocks' worth (1500 → 2048). Positions split among
# programs (``_splits``, with the 132 multiprocessors assumed off a GPU): 33 at N = 768 in three
# splits of three tiles; 70 in five of 16 (the last of six); 50 at N = 24 in four of one 16-row tile
SHAPES = [((1, 1, 5), (5,)), ((3, 7, 33), (33,)), ((2, 9), (9,)), ((2, 33, 768), (768,)), ((3, 4, 1), (1,)),
          ((2, 3, 4, 6), (4, 6)), ((1, 5, 1500), (1500,)), ((1, 70, 768), (768,)), ((2, 50, 24), (24,))]


def _oracle(x, o, shape, eps, center):
    """(Σ_t o ⊙ x̂, Σ_t o) per sample in float64, x̂ by torch's own normalization in float64."""
    x64, o64 = x.double(), o.double()
    x_hat = (nn.functional.layer_norm(x64, shape, None, None, eps) if center
             else nn.functional.rms_norm(x64, shape, None, eps))
    middle = list(range(1, x.dim() - len(shape)))
    weight, bias = x_hat * o64, o64
    return (weight.sum(middle), bias.sum(middle)) if middle else (weight, bias)


def _atol(x, o, shape, dtype):
    """fp32 accumulation over the positions (Σ_t |o|·|x̂| ≤ Σ_t |o|·√N) plus one rounding to the output dtype."""
    middle = list(range(1, x.dim() - len(shape)))
    scale = o.double().abs() * (torch.tensor(shape).prod().double().sqrt())
    scale = scale.sum(middle) if middle else scale
    return (1e-5 + torch.finfo(dtype).eps) * scale + 1e-30


def _check(tools, x, o, module, center, what):
    shape = tuple(module.normalized_shape)
    # torch's default RMSNorm eps is its compute type's: fp32's for fp16 and bf16 inputs too
    eps = module.eps if module.eps is not None else torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps
    launcher = norm_grads.layer_norm_per_sample_grads if center else norm_grads.rms_norm_per_sample_grads
    reference = (norm_ops.layer_norm_per_sample_grads_reference if center
                 else norm_ops.rms_norm_per_sample_grads_reference)
    out, ref = launcher(x, o, module), reference(x, o, module)
    weight, bias = _oracle(x, o, shape, eps, center)
    assert set(out) == set(ref), what
    assert out["weight"].dtype == x.dtype and out["weight"].shape == (x.shape[0], *shape), what
    atol = _atol(x, o, shape, x.dtype)
    tools.check(out["weight"], ref["weight"], weight, atol=atol, what=f"{what} weight")
    if "bias" in out:
        assert out["bias"].dtype == o.dtype, what
        tools.check(out["bias"], ref["bias"], bias, atol=atol, what=f"{what} bias")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_per_sample_grads(tools, gen, shapes, bias, dtype):
    x_shape, shape = shapes
    x = tools.randn(gen, *x_shape, dtype=dtype, device=tools.device) * 3 + 1
    o = tools.randn(gen, *x_shape, dtype=dtype, device=tools.device)
    module = nn.LayerNorm(shape, eps=1e-5, bias=bias)
    _check(tools, x, o, module, True, f"layer norm {x_shape} {dtype} bias={bias}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
@pytest.mark.parametrize("eps", [None, 1e-6])
def test_rms_norm_per_sample_grads(tools, gen, shapes, eps, dtype):
    x_shape, shape = shapes
    x = tools.randn(gen, *x_shape, dtype=dtype, device=tools.device) * 3 + 1
    o = tools.randn(gen, *x_shape, dtype=dtype, device=tools.device)
    _check(tools, x, o, nn.RMSNorm(shape, eps=eps), False, f"rms norm {x_shape} {dtype} eps={eps}")


def test_positions_are_split_among_programs_where_the_batch_leaves_the_gpu_idle(monkeypatch):
    """One program per sample where the batch reaches every multiprocessor; else each sample's
    positions split among programs, at least MIN_SPLIT_ROWS each, a whole number of row tiles."""
    cpu = torch.device("cpu")
    assert norm_grads._splits(8, 512, 4, cpu) == (32, 16, 4)     # GPT-2 small at (8, 512, 768)
    assert norm_grads._splits(32, 128, 4, cpu) == (8, 16, 4)     # BERT-base at (32, 128, 768)
    assert norm_grads._splits(64, 197, 4, cpu) == (5, 40, 4)     # ViT-B/16: four splits of 40, one of 37
    assert norm_grads._splits(256, 128, 4, cpu) == (1, 128, 4)   # a batch of one program per multiprocessor
    assert norm_grads._splits(2, 9, 128, cpu) == (1, 9, 16)      # too short to split
    monkeypatch.setattr(norm_grads, "_INTERPRETER_SMS", 4)
    assert norm_grads._splits(1, 100, 128, cpu) == (7, 16, 16)   # 8 programs wanted, 16 rows each at least


@pytest.mark.parametrize("sms", [1, 4, 1000])
@pytest.mark.parametrize("center", [True, False])
def test_split_and_unsplit_launches_equal_the_oracle_and_repeat_bit_for_bit(tools, gen, monkeypatch, sms, center):
    """The same rows summed by one program per sample (sms = 1), in a few splits and in many: each
    equals the float64 oracle (1, 3 and 5 splits of 70 positions), and a second call returns the
    same bits (no atomics)."""
    monkeypatch.setattr(norm_grads, "_multiprocessors", lambda device: sms)  # (a GPU's own count too)
    x = tools.randn(gen, 3, 70, 48, dtype=torch.bfloat16, device=tools.device) * 2 - 1
    o = tools.randn(gen, 3, 70, 48, dtype=torch.bfloat16, device=tools.device)
    module = nn.LayerNorm(48) if center else nn.RMSNorm(48)
    _check(tools, x, o, module, center, f"sms={sms} center={center}")
    launcher = norm_grads.layer_norm_per_sample_grads if center else norm_grads.rms_norm_per_sample_grads
    first, again = launcher(x, o, module), launcher(x, o, module)
    for key in first:
        assert torch.equal(first[key], again[key]), key


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_default_eps_is_torchs_for_rows_of_small_rms(tools, gen, dtype):
    # RMS ~ 1e-2: mean(x²) ~ 1e-4, where fp16's eps (1e-3) in place of torch's fp32 one shrank the
    # normalized rows, and every weight gradient, about threefold
    x = tools.randn(gen, 3, 4, 16, dtype=dtype, device=tools.device) * 1e-2
    o = tools.randn(gen, 3, 4, 16, dtype=dtype, device=tools.device)
    _check(tools, x, o, nn.RMSNorm(16), False, f"rms norm of small rows {dtype}")


def test_rows_far_from_zero_are_centred_before_squaring(tools, gen):
    """x = 1000 + noise: the variance of each row in registers (two passes over it), not E[x²] − E[x]²,
    whose cancellation would lose every digit of an fp32 variance of ~1 at a mean of 1000."""
    x = 1000 + tools.randn(gen, 2, 6, 40, device=tools.device)
    o = tools.randn(gen, 2, 6, 40, device=tools.device)
    _check(tools, x, o, nn.LayerNorm(40), True, "offset rows")


def test_strided_inputs(tools, gen):
    """A transposed input (last dim not contiguous) and a sliced one (rows of a wider buffer)."""
    module = nn.LayerNorm(9)
    x = tools.randn(gen, 3, 9, 5, device=tools.device).transpose(1, 2)
    o = tools.randn(gen, 3, 5, 9, device=tools.device)
    _check(tools, x, o, module, True, "transposed x")
    wide = tools.randn(gen, 3, 5, 20, device=tools.device)
    _check(tools, wide[..., 4:13], o, module, True, "sliced x")


@pytest.mark.parametrize("x_shape", [(0, 4, 8), (0, 8), (2, 0, 8)], ids=str)
def test_empty_batches_and_empty_sequences(tools, x_shape):
    """No sample: (0, N) outputs and no launch; samples without positions: zero gradients."""
    x = torch.zeros(x_shape, device=tools.device)
    for module, launcher in ((nn.LayerNorm(8), norm_grads.layer_norm_per_sample_grads),
                             (nn.RMSNorm(8), norm_grads.rms_norm_per_sample_grads)):
        out = launcher(x, x.clone(), module)
        for g in out.values():
            assert g.shape == (x_shape[0], 8) and torch.equal(g, torch.zeros_like(g)), (x_shape, type(module))


def test_rows_too_long_or_mixed_dtypes_run_the_reference(tools, gen, monkeypatch):
    """Rows longer than MAX_N (they would not fit a program's registers) and an input and output
    gradient of different dtypes take the reference, with the reference's result."""
    calls = []
    reference = norm_grads.layer_norm_per_sample_grads_reference
    monkeypatch.setattr(norm_grads, "layer_norm_per_sample_grads_reference",
                        lambda *args: (calls.append(1), reference(*args))[1])
    monkeypatch.setattr(norm_grads, "MAX_N", 16)
    module = nn.LayerNorm(33)
    x, o = tools.randn(gen, 2, 3, 33, device=tools.device), tools.randn(gen, 2, 3, 33, device=tools.device)
    out = norm_grads.layer_norm_per_sample_grads(x, o, module)
    assert calls == [1] and torch.equal(out["weight"], reference(x, o, module)["weight"])
    monkeypatch.setattr(norm_grads, "MAX_N", 8192)
    norm_grads.layer_norm_per_sample_grads(x, o.to(torch.bfloat16), module)
    assert calls == [1, 1]


def test_the_ops_dispatch_to_the_kernel(tools, gen, monkeypatch):
    """``pdpfast.ops.norm``'s entry points run the kernel where the kernels run, the reference with
    PDPFAST_DISABLE_TRITON=1, and agree."""
    monkeypatch.delenv("PDPFAST_DISABLE_TRITON", raising=False)
    x, o = tools.randn(gen, 2, 5, 12, device=tools.device), tools.randn(gen, 2, 5, 12, device=tools.device)
    for name, module in (("layer_norm_per_sample_grads", nn.LayerNorm(12)),
                         ("rms_norm_per_sample_grads", nn.RMSNorm(12))):
        op = dispatch.op(name)
        assert op.pick(x, o) is getattr(norm_grads, name), name
        fast = getattr(norm_ops, name)(x, o, module)
        monkeypatch.setenv("PDPFAST_DISABLE_TRITON", "1")
        assert op.pick(x, o) is op.reference, name
        slow = getattr(norm_ops, name)(x, o, module)
        monkeypatch.delenv("PDPFAST_DISABLE_TRITON")
        for key in slow:
            torch.testing.assert_close(fast[key], slow[key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}")


def _same_shape_calls(tools, gen, n, x_shape, dtype, misaligned=False):
    """n (x, o) calls of one shape: the first n − 1 views into one buffer each, in slots of whole
    16-byte blocks (call 0 in the last slot, so the other calls' offsets past it are negative), the
    last tensors of their own; ``misaligned``: the views start one element past a 16-byte boundary."""
    size, shift = math.prod(x_shape), 1 if misaligned else 0
    slot = -(-size // 8) * 8  # 8 elements: 16 bytes in fp16/bf16, 32 in fp32
    buf_x = tools.randn(gen, n * slot + 8, dtype=dtype, device=tools.device) * 3 + 1
    buf_o = tools.randn(gen, n * slot + 8, dtype=dtype, device=tools.device)
    slots = [n - 2, *range(n - 2)] if n > 1 else []
    calls = [(buf_x[shift + i * slot:][:size].view(x_shape), buf_o[shift + i * slot:][:size].view(x_shape))
             for i in slots]
    calls.append((tools.randn(gen, *x_shape, dtype=dtype, device=tools.device) * 3 + 1,
                   tools.randn(gen, *x_shape, dtype=dtype, device=tools.device)))
    return calls


NORM_MODULES = {"layer norm": lambda shape: nn.LayerNorm(shape, eps=1e-5),
                "layer norm, no bias": lambda shape: nn.LayerNorm(shape, eps=1e-5, bias=False),
                "rms norm": lambda shape: nn.RMSNorm(shape)}


def _grouped_launcher(module):
    center = isinstance(module, nn.LayerNorm)
    return center, (norm_grads.layer_norm_per_sample_grads_grouped if center
                    else norm_grads.rms_norm_per_sample_grads_grouped)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(NORM_MODULES))
@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("shapes", [((2, 33, 768), (768,)), ((3, 7, 33), (33,)), ((2, 9), (9,)),
                                    ((2, 3, 4, 6), (4, 6))], ids=str)
def test_same_shape_calls_take_one_launch_and_each_equals_the_oracle(tools, gen, shapes, n, kind, dtype):
    """n calls of one shape (a transformer's LayerNorms) in one launch, each program reading its call's
    x and o at an offset from the first call's: each call's gradients equal the float64 oracle and the
    reference as its own launch's do, and are the launch's (n, planes, B, ...) buffer's views."""
    x_shape, shape = shapes
    module = NORM_MODULES[kind](shape)
    center, launcher = _grouped_launcher(module)
    calls = _same_shape_calls(tools, gen, n, x_shape, dtype)
    with tools.op_log() as log:
        grads = launcher(calls, module)
    assert len(log.launches) == 1 and len(grads) == n
    eps = module.eps if module.eps is not None else torch.finfo(torch.float32).eps
    reference = (norm_ops.layer_norm_per_sample_grads_reference if center
                 else norm_ops.rms_norm_per_sample_grads_reference)
    for c, ((x, o), got) in enumerate(zip(calls, grads)):
        ref = reference(x, o, module)
        assert set(got) == set(ref) and got["weight"].shape == (x_shape[0], *shape) and got["weight"].dtype == dtype
        weight, bias = _oracle(x, o, shape, eps, center)
        atol = _atol(x, o, shape, dtype)
        tools.check(got["weight"], ref["weight"], weight, atol=atol, what=f"{kind} call {c} weight")
        if "bias" in got:
            tools.check(got["bias"], ref["bias"], bias, atol=atol, what=f"{kind} call {c} bias")
    if n > 1:
        assert grads[1]["weight"].data_ptr() > grads[0]["weight"].data_ptr()  # views of one buffer


@pytest.mark.parametrize("center", [True, False])
def test_grouped_calls_split_positions_by_all_their_rows_and_repeat_bit_for_bit(tools, gen, monkeypatch, center):
    """The calls' programs share the GPU, so their splits of each sample's positions follow n·B rows:
    one program per (call, sample) where those reach every multiprocessor, though one call's B would
    split. Both ways each call equals the oracle, and a second launch returns the same bits."""
    monkeypatch.setattr(norm_grads, "_multiprocessors", lambda device: 8)  # (a GPU's own count too)
    calls = _same_shape_calls(tools, gen, 4, (3, 70, 48), torch.bfloat16)
    module = nn.LayerNorm(48) if center else nn.RMSNorm(48)
    _, launcher = _grouped_launcher(module)
    device = calls[0][0].device
    assert norm_grads._splits(3, 70, 64, device)[0] > 1 and norm_grads._splits(12, 70, 64, device)[0] == 1
    with tools.op_log() as log:
        first = launcher(calls, module)
    assert len(log.launches) == 1 and "sum" not in log.ops  # one split: no partial sums to add
    for (x, o), got in zip(calls, first):
        own = (norm_grads.layer_norm_per_sample_grads if center else norm_grads.rms_norm_per_sample_grads)(x, o, module)
        for key in got:  # summed in other orders, both within fp32 accumulation and one bf16 rounding
            torch.testing.assert_close(got[key].float(), own[key].float(), rtol=2 ** -7, atol=2 ** -7 * 48)
        _check(tools, x, o, module, center, f"grouped center={center}")
    again = launcher(calls, module)
    for got, repeat in zip(first, again):
        for key in got:
            assert torch.equal(got[key], repeat[key]), key


def test_grouped_calls_that_cannot_share_a_launch_take_one_each(tools, gen, monkeypatch):
    """Views that do not start on 16-byte boundaries, calls whose strides, dtypes or batch sizes
    differ from the first one's (the kernel reads every call with the first one's), rows whose last dim is not
    contiguous, an empty batch and rows too long for a program take the reference, one launch a
    call, with its results."""
    seen = []
    reference = norm_grads.layer_norm_per_sample_grads_grouped_reference
    monkeypatch.setattr(norm_grads, "layer_norm_per_sample_grads_grouped_reference",
                        lambda calls, module: (seen.append(len(calls)), reference(calls, module))[1])
    module = nn.LayerNorm(16)
    misaligned = _same_shape_calls(tools, gen, 3, (2, 5, 16), torch.float32, misaligned=True)
    assert misaligned[0][0].data_ptr() % 16
    x, o = tools.randn(gen, 2, 5, 16, device=tools.device), tools.randn(gen, 2, 5, 16, device=tools.device)
    cases = {"misaligned": misaligned,
             "other strides": [(x, o), (tools.randn(gen, 5, 2, 16, device=tools.device).transpose(0, 1), o)],
             "other dtype": [(x, o), (x.bfloat16(), o.bfloat16())],
             "other batch size": [(x, o), (x.reshape(5, 2, 16).clone(), o.reshape(5, 2, 16).clone())],
             "last dim strided": [(tools.randn(gen, 2, 16, 5, device=tools.device).transpose(1, 2), o)] * 2,
             "empty batch": [(torch.zeros(0, 5, 16, device=tools.device),) * 2] * 2}
    for what, calls in cases.items():
        seen.clear()
        got = norm_grads.layer_norm_per_sample_grads_grouped(calls, module)
        assert seen == [len(calls)], what
        for (cx, co), g in zip(calls, got):
            own = norm_ops.layer_norm_per_sample_grads(cx, co, module)
            for key in own:
                assert torch.equal(g[key], own[key]), (what, key)
    seen.clear()
    monkeypatch.setattr(norm_grads, "MAX_N", 8)
    norm_grads.layer_norm_per_sample_grads_grouped([(x, o), (x.clone(), o.clone())], module)
    assert seen == [2]


def test_grouped_ops_dispatch_to_the_kernel_where_it_runs(tools, gen, monkeypatch):
    """``pdpfast.ops.norm.groups_norm_grads`` holds where the kernel runs and not with
    PDPFAST_DISABLE_TRITON=1 (the calls then take the reference's one launch each, and the clipping
    state forms each call's gradients at once instead of holding it); the ops agree both ways."""
    monkeypatch.delenv("PDPFAST_DISABLE_TRITON", raising=False)
    calls = _same_shape_calls(tools, gen, 3, (2, 5, 12), torch.float32)
    assert norm_ops.groups_norm_grads(*calls[0])
    for name, module in (("layer_norm_per_sample_grads_grouped", nn.LayerNorm(12)),
                         ("rms_norm_per_sample_grads_grouped", nn.RMSNorm(12))):
        op = dispatch.op(name)
        assert op.pick(*calls[0]) is getattr(norm_grads, name), name
        fast = getattr(norm_ops, name)(calls, module)
        monkeypatch.setenv("PDPFAST_DISABLE_TRITON", "1")
        assert op.pick(*calls[0]) is op.reference and not norm_ops.groups_norm_grads(*calls[0]), name
        slow = getattr(norm_ops, name)(calls, module)
        monkeypatch.delenv("PDPFAST_DISABLE_TRITON")
        for f, s in zip(fast, slow):
            for key in s:
                torch.testing.assert_close(f[key], s[key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}")


def _group_oracle(x, o, num_groups, eps):
    x_hat = nn.functional.group_norm(x.double(), num_groups, None, None, eps)
    spatial = list(range(2, x.dim()))
    weight, bias = x_hat * o.double(), o.double()
    return (weight.sum(spatial), bias.sum(spatial)) if spatial else (weight, bias)


# (input shape, groups): ResNet-18-GN's first stage (two channels a group, 32×32 positions: one
# tile) and last (16 channels of 4×4), one position per channel ((B, C) input), Conv1d- and
# Conv3d-shaped inputs, instance norm (G = C), one sample, a group of one tile of 128 channels,
# groups of several channel tiles and of several position tiles (the loops, not the one-tile path)
GROUP_SHAPES = [((2, 64, 32, 32), 32), ((2, 512, 4, 4), 32), ((2, 6), 3), ((3, 8, 5, 7), 4), ((2, 4, 9), 2),
                ((2, 3, 2, 3, 4), 3), ((1, 16, 4, 4), 16), ((2, 256, 3, 3), 2), ((2, 512, 3, 3), 1),
                ((2, 4, 40, 40), 2)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shapes", GROUP_SHAPES, ids=str)
@pytest.mark.parametrize("bias", [True, False])
def test_group_norm_affine_grads(tools, gen, shapes, bias, dtype):
    """Against float64 at inputs far from zero (mean 100, deviation 3): the group's statistics are
    merged tile by tile from deviations, not from E[x²] − E[x]²."""
    x_shape, groups = shapes
    x = tools.randn(gen, *x_shape, dtype=dtype, device=tools.device) * 3 + 100
    o = tools.randn(gen, *x_shape, dtype=dtype, device=tools.device)
    out = norm_grads.group_norm_affine_grads(x, o, groups, 1e-5, bias)
    ref = norm_ops.group_norm_affine_grads_reference(x, o, groups, 1e-5, bias)
    weight, bias_grad = _group_oracle(x, o, groups, 1e-5)
    assert set(out) == set(ref) and out["weight"].shape == weight.shape and out["weight"].dtype == dtype
    spatial = list(range(2, x.dim()))
    scale = o.double().abs().sum(spatial) if spatial else o.double().abs()
    atol = (1e-5 + torch.finfo(dtype).eps) * scale * 2 + 1e-30  # x̂ of a few ulps of the mean, summed
    what = f"group norm {x_shape} G={groups} {dtype}"
    tools.check(out["weight"], ref["weight"], weight, atol=atol, what=f"{what} weight")
    if bias:
        tools.check(out["bias"], ref["bias"], bias_grad, atol=atol, what=f"{what} bias")


@pytest.mark.parametrize("shape", [(3, 8), (3, 8, 2, 2)], ids=str)
def test_group_norm_groups_of_nearly_equal_values_far_from_zero(tools, gen, shape):
    """Groups whose values lie within a few sqrt(ε) of each other at 100: x̂ then hangs on differences
    of a few of x's ulps, which a mean rounded to x's ulp would swamp (the kernel's statistics are of
    x − the group's first value). Each call's gradients are within fp32's rounding of the float64
    oracle."""
    x = 100 + tools.randn(gen, *shape, device=tools.device) * 3e-3
    o = tools.randn(gen, *shape, device=tools.device)
    out = norm_grads.group_norm_affine_grads(x, o, 4, 1e-5, True)
    weight, bias = _group_oracle(x, o, 4, 1e-5)
    spatial = list(range(2, x.dim()))
    scale = o.double().abs().sum(spatial) if spatial else o.double().abs()
    assert ((out["weight"].double() - weight).abs() <= 1e-5 * scale).all()
    torch.testing.assert_close(out["bias"].double(), bias, rtol=1e-6, atol=1e-6)


def test_group_norm_empty_inputs_and_channels_last(tools, gen):
    """No sample, no position (zero gradients, not the reference's NaN) and a channels-last input."""
    for shape in [(0, 4, 3, 3), (2, 4, 0)]:
        out = norm_grads.group_norm_affine_grads(torch.zeros(shape, device=tools.device),
                                                 torch.zeros(shape, device=tools.device), 2, 1e-5, True)
        for g in out.values():
            assert g.shape == shape[:2] and torch.equal(g, torch.zeros_like(g)), shape
    x = tools.randn(gen, 2, 8, 5, 5, device=tools.device).to(memory_format=torch.channels_last)
    o = tools.randn(gen, 2, 8, 5, 5, device=tools.device)
    out = norm_grads.group_norm_affine_grads(x, o, 4, 1e-5, True)
    weight, bias = _group_oracle(x, o, 4, 1e-5)
    torch.testing.assert_close(out["weight"].double(), weight, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["bias"].double(), bias, rtol=1e-5, atol=1e-5)


def test_group_and_instance_norm_layers_dispatch_to_the_kernel(tools, gen, monkeypatch):
    """GroupNorm and InstanceNorm layers reach the kernel through ``pdpfast.ops.norm`` (G = C for
    InstanceNorm), and their calls no longer stack (one launch each already)."""
    monkeypatch.delenv("PDPFAST_DISABLE_TRITON", raising=False)
    x, o = tools.randn(gen, 2, 6, 4, 4, device=tools.device), tools.randn(gen, 2, 6, 4, 4, device=tools.device)
    assert norm_ops.group_norm_in_one_op(x, o)
    calls = []
    kernel = norm_grads.group_norm_affine_grads
    monkeypatch.setattr(dispatch.op("group_norm_affine_grads"), "kernel",
                        lambda *args: (calls.append(args[2]), kernel(*args))[1])
    for module, groups in ((nn.GroupNorm(3, 6), 3), (nn.InstanceNorm2d(6, affine=True), 6)):
        fast = (norm_ops.group_norm_per_sample_grads if groups == 3 else norm_ops.instance_norm_per_sample_grads)(
            x, o, module)
        assert calls[-1] == groups
        expected = norm_ops.group_norm_affine_grads_reference(x, o, groups, module.eps, True)
        for key in expected:
            torch.testing.assert_close(fast[key], expected[key], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shapes", [GROUP_SHAPES[0], GROUP_SHAPES[2], GROUP_SHAPES[3], GROUP_SHAPES[5],
                                    GROUP_SHAPES[6], GROUP_SHAPES[7], GROUP_SHAPES[8], GROUP_SHAPES[9]], ids=str)
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_same_shape_group_norm_calls_take_one_launch_and_each_equals_the_oracle(tools, gen, shapes, n, bias, dtype):
    """n GroupNorm calls of one shape (a ResNet stage's) in one launch, each program reading its call's
    x and o at an offset from the first call's: each call's gradients are its own launch's bits,
    equal the float64 oracle as those do, and are views of the launch's (n, planes, B, C) buffer."""
    x_shape, groups = shapes
    calls = [(x * 3 + 100, o) for x, o in _same_shape_calls(tools, gen, n, x_shape, dtype)]  # far from zero
    with tools.op_log() as log:
        grads = norm_grads.group_norm_affine_grads_grouped(calls, groups, 1e-5, bias)
    assert len(log.launches) == 1 and len(grads) == n
    spatial = list(range(2, len(x_shape)))
    for c, ((x, o), got) in enumerate(zip(calls, grads)):
        own = norm_grads.group_norm_affine_grads(x, o, groups, 1e-5, bias)
        assert set(got) == set(own) == ({"weight", "bias"} if bias else {"weight"})
        for key in own:
            assert got[key].dtype == dtype and torch.equal(got[key], own[key]), (c, key)
        weight, bias_grad = _group_oracle(x, o, groups, 1e-5)
        scale = o.double().abs().sum(spatial) if spatial else o.double().abs()
        atol = (1e-5 + torch.finfo(dtype).eps) * scale * 2 + 1e-30
        ref = norm_ops.group_norm_affine_grads_reference(x, o, groups, 1e-5, bias)
        tools.check(got["weight"], ref["weight"], weight, atol=atol, what=f"call {c} weight")
        if bias:
            tools.check(got["bias"], ref["bias"], bias_grad, atol=atol, what=f"call {c} bias")
    if n > 1:
        assert grads[1]["weight"].data_ptr() > grads[0]["weight"].data_ptr()  # views of one buffer


def test_group_norm_calls_that_cannot_share_a_launch_take_one_each(tools, gen, monkeypatch):
    """GroupNorm calls whose views start off 16-byte boundaries, whose strides, dtypes or batch sizes
    differ from the first one's, whose positions are not contiguous, and calls with no sample or no
    position take the reference (one launch a call), with its results."""
    seen = []
    reference = norm_grads.group_norm_affine_grads_grouped_reference
    monkeypatch.setattr(norm_grads, "group_norm_affine_grads_grouped_reference",
                        lambda calls, *args: (seen.append(len(calls)), reference(calls, *args))[1])
    misaligned = _same_shape_calls(tools, gen, 3, (2, 4, 3, 3), torch.float32, misaligned=True)
    assert misaligned[0][0].data_ptr() % 16
    x, o = tools.randn(gen, 2, 4, 3, 3, device=tools.device), tools.randn(gen, 2, 4, 3, 3, device=tools.device)
    cases = {"misaligned": misaligned,
             "other strides": [(x, o), (x.to(memory_format=torch.channels_last), o)],
             "other dtype": [(x, o), (x.bfloat16(), o.bfloat16())],
             "other batch size": [(x, o), (x.reshape(1, 8, 3, 3).clone(), o.reshape(1, 8, 3, 3).clone())],
             "positions strided": [(x.to(memory_format=torch.channels_last), o)] * 2,
             "empty batch": [(torch.zeros(0, 4, 3, 3, device=tools.device),) * 2] * 2,
             "no positions": [(torch.zeros(2, 4, 0, device=tools.device),) * 2] * 2}
    for what, calls in cases.items():
        seen.clear()
        got = norm_grads.group_norm_affine_grads_grouped(calls, 2, 1e-5, True)
        assert seen == [len(calls)], what
        for (cx, co), g in zip(calls, got):
            own = norm_ops.group_norm_affine_grads(cx, co, 2, 1e-5, True)
            for key in own:
                assert torch.equal(g[key], own[key]), (what, key)


def test_grouped_group_and_instance_norm_ops_dispatch_to_the_kernel_where_it_runs(tools, gen, monkeypatch):
    """``groups_norm_grads(..., "group_norm")`` holds where the kernel runs and not with
    PDPFAST_DISABLE_TRITON=1; GroupNorm and InstanceNorm (G = C) calls agree both ways."""
    monkeypatch.delenv("PDPFAST_DISABLE_TRITON", raising=False)
    calls = _same_shape_calls(tools, gen, 3, (2, 6, 4, 4), torch.float32)
    op = dispatch.op("group_norm_affine_grads_grouped")
    assert norm_ops.groups_norm_grads(*calls[0], "group_norm")
    for module, grouped in ((nn.GroupNorm(3, 6), norm_ops.group_norm_per_sample_grads_grouped),
                            (nn.InstanceNorm2d(6, affine=True), norm_ops.instance_norm_per_sample_grads_grouped)):
        assert op.pick(*calls[0]) is norm_grads.group_norm_affine_grads_grouped
        fast = grouped(calls, module)
        monkeypatch.setenv("PDPFAST_DISABLE_TRITON", "1")
        assert op.pick(*calls[0]) is op.reference and not norm_ops.groups_norm_grads(*calls[0], "group_norm")
        slow = grouped(calls, module)
        monkeypatch.delenv("PDPFAST_DISABLE_TRITON")
        for (x, o), f, s in zip(calls, fast, slow):
            groups = module.num_groups if isinstance(module, nn.GroupNorm) else 6
            expected = norm_ops.group_norm_affine_grads_reference(x, o, groups, module.eps, True)
            for key in expected:
                torch.testing.assert_close(f[key], expected[key], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(s[key], expected[key], rtol=1e-5, atol=1e-5)


def test_calls_a_grouped_launch_would_turn_down_are_not_held_for_one(tools, gen, monkeypatch):
    """``groups_norm_grads`` says no where the grouped launch would take the reference anyway, so the
    clipping state does not hold such a call for nothing: x or o off a 16-byte boundary, channels-last
    GroupNorm inputs (positions not contiguous), a LayerNorm input whose last dim is strided. Inputs
    whose only non-contiguous dims have size 1 still group."""
    monkeypatch.delenv("PDPFAST_DISABLE_TRITON", raising=False)
    x, o = tools.randn(gen, 2, 8, 4, 4, device=tools.device), tools.randn(gen, 2, 8, 4, 4, device=tools.device)
    assert norm_ops.groups_norm_grads(x, o, "group_norm")
    off = tools.randn(gen, 2 * 8 * 16 + 1, device=tools.device)[1:].view(2, 8, 4, 4)  # 4 bytes past a boundary
    assert off.data_ptr() % 16
    assert not norm_ops.groups_norm_grads(off, o, "group_norm")
    assert not norm_ops.groups_norm_grads(x, off, "group_norm")
    last = x.to(memory_format=torch.channels_last)
    assert not norm_ops.groups_norm_grads(last, o, "group_norm")
    assert not norm_ops.groups_norm_grads(x, o.to(memory_format=torch.channels_last), "group_norm")
    one = tools.randn(gen, 2, 8, 1, 1, device=tools.device).to(memory_format=torch.channels_last)
    assert norm_ops.groups_norm_grads(one, one, "group_norm")  # 1×1 positions: contiguous whatever the strides
    rows = tools.randn(gen, 2, 5, 12, device=tools.device)
    assert norm_ops.groups_norm_grads(rows, rows)
    strided = tools.randn(gen, 2, 12, 5, device=tools.device).transpose(1, 2)
    assert not norm_ops.groups_norm_grads(strided, rows) and not norm_ops.groups_norm_grads(rows, strided)
