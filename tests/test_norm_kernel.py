"""The C++ GroupNorm / InstanceNorm per-sample gradient kernel (``csrc/norms.cpp``) against the
float64 oracle (``torch.func``) and against the torch route it replaces on the CPU."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from pdpfast.ops import norm as norm_ops

HAS_KERNEL = norm_ops.group_norm_kernel(torch.zeros(1, 1), torch.zeros(1, 1)) == "C++ kernel"
needs_kernel = pytest.mark.skipif(not HAS_KERNEL, reason=norm_ops.group_norm_kernel(torch.zeros(1, 1),
                                                                                 torch.zeros(1, 1)))

CASES = {  # name: (module factory, per-sample shape)
    "groupnorm-2d": (lambda: nn.GroupNorm(4, 8), (8, 5, 3)),
    "groupnorm-1d": (lambda: nn.GroupNorm(2, 6), (6, 7)),
    "groupnorm-3d": (lambda: nn.GroupNorm(3, 6), (6, 2, 3, 2)),
    "groupnorm-no-spatial": (lambda: nn.GroupNorm(3, 6), (6,)),
    "groupnorm-one-group": (lambda: nn.GroupNorm(1, 5), (5, 4, 4)),
    "groupnorm-group-per-channel": (lambda: nn.GroupNorm(6, 6), (6, 9)),
    "groupnorm-eps": (lambda: nn.GroupNorm(2, 4, eps=0.3), (4, 3, 3)),
    "instancenorm1d": (lambda: nn.InstanceNorm1d(3, affine=True), (3, 10)),
    "instancenorm2d": (lambda: nn.InstanceNorm2d(4, affine=True), (4, 5, 6)),
    "instancenorm3d": (lambda: nn.InstanceNorm3d(2, affine=True), (2, 3, 4, 2)),
}


def _op(module):
    return norm_ops.group_norm_per_sample_grads if isinstance(module, nn.GroupNorm) else \
        norm_ops.instance_norm_per_sample_grads


def _oracle(module, x, o) -> dict:
    """Per-sample gradients of Σ out·o by torch.func, in float64."""
    m = copy.deepcopy(module).double()
    params = {n: p.detach() for n, p in m.named_parameters()}

    def inner(params, xi, oi):
        return (functional_call(m, params, (xi.unsqueeze(0),)) * oi.unsqueeze(0)).sum()

    return vmap(grad(inner), in_dims=(None, 0, 0))(params, x.double(), o.double())


def _assert_fp32_matches_oracle(module, x, o) -> None:
    got = norm_ops.group_norm_per_sample_grads(x, o, module)
    expected = _oracle(module, x, o)
    for n in ("weight", "bias"):
        torch.testing.assert_close(got[n].double(), expected[n], rtol=1e-5, atol=1e-5)


def _module(name, bias=True):
    module = CASES[name][0]()
    if not bias:
        module.bias = None
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    return module


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_float64_oracle(name, bias, dtype):
    module = _module(name, bias).to(dtype)
    shape = CASES[name][1]
    x = torch.randn(6, *shape, dtype=dtype) * 3 + 2  # off-centre, so the mean matters
    o = torch.randn(6, *shape, dtype=dtype)
    got = _op(module)(x, o, module)
    expected = _oracle(module, x, o)
    assert sorted(got) == sorted(expected)
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    for n, g in got.items():
        assert g.dtype == dtype and g.shape == expected[n].shape
        torch.testing.assert_close(g.double(), expected[n], rtol=rtol, atol=rtol * float(expected[n].abs().max()))


@needs_kernel
@pytest.mark.parametrize("B", [0, 1, 33])
def test_kernel_equals_the_torch_route(B, monkeypatch):
    """Empty, single-sample and odd batches, large enough to be split across threads."""
    module = _module("groupnorm-2d")
    x, o = torch.randn(B, 8, 17, 9), torch.randn(B, 8, 17, 9)
    got = norm_ops.group_norm_per_sample_grads(x, o, module)
    monkeypatch.setattr(norm_ops, "_CPP_MISSING", "the torch route, forced by the test")
    expected = norm_ops.group_norm_per_sample_grads(x, o, module)
    for n in ("weight", "bias"):
        assert got[n].shape == (B, 8)
        torch.testing.assert_close(got[n], expected[n], rtol=1e-4, atol=1e-4)


@needs_kernel
def test_kernel_reads_non_contiguous_inputs():
    module = _module("groupnorm-2d")
    x = torch.randn(5, 8, 6, 7).to(memory_format=torch.channels_last)
    o = torch.randn(5, 8, 7, 6).transpose(2, 3)
    _assert_fp32_matches_oracle(module, x, o)


@needs_kernel
def test_a_poisoned_sample_leaves_the_others_exact():
    """A NaN in one sample's input or output gradient reaches only that sample's gradients."""
    module = _module("groupnorm-2d")
    x, o = torch.randn(4, 8, 5, 3), torch.randn(4, 8, 5, 3)
    clean = norm_ops.group_norm_per_sample_grads(x, o, module)
    x[1, 0, 2, 1] = float("nan")
    o[3, 7, 0, 0] = float("nan")
    got = norm_ops.group_norm_per_sample_grads(x, o, module)
    # x's NaN is in channel 0: group 0's statistics (channels 0 and 1) carry it, the other groups do not
    assert got["weight"][1, :2].isnan().all()
    torch.testing.assert_close(got["weight"][1, 2:], clean["weight"][1, 2:], rtol=0, atol=0)
    for n in ("weight", "bias"):
        torch.testing.assert_close(got[n][[0, 2]], clean[n][[0, 2]], rtol=0, atol=0)
    assert got["weight"][3, 7].isnan() and got["bias"][3, 7].isnan()
    torch.testing.assert_close(got["bias"][3, :7], clean["bias"][3, :7], rtol=0, atol=0)


def test_the_route_is_named():
    cpu32, meta = torch.zeros(2, 4), torch.zeros(2, 4, device="meta")
    assert norm_ops.group_norm_kernel(cpu32, cpu32) == "C++ kernel" or not HAS_KERNEL
    assert norm_ops.group_norm_kernel(cpu32.bfloat16(), cpu32.bfloat16()).startswith("torch (")
    assert norm_ops.group_norm_kernel(cpu32, cpu32.double()).startswith("torch (")
    assert norm_ops.group_norm_kernel(meta, meta).startswith("torch (")


def test_without_the_extension_the_torch_route_runs(monkeypatch):
    monkeypatch.setattr(norm_ops, "_CPP_MISSING", "pretend the extension failed to build")
    assert norm_ops.group_norm_kernel(torch.zeros(2, 4), torch.zeros(2, 4)) == \
        "torch (pretend the extension failed to build)"
    module = _module("groupnorm-2d")
    x, o = torch.randn(3, 8, 5, 3), torch.randn(3, 8, 5, 3)
    _assert_fp32_matches_oracle(module, x, o)


@needs_kernel
def test_kernel_calls_do_not_stack_their_inputs():
    """Same-shape GroupNorm calls on the kernel are not stacked (that would copy x and o for no saved op)."""
    from pdpfast.nn.norms import DPGroupNorm
    from pdpfast.nn.rules import rule_for_class

    key = rule_for_class(DPGroupNorm).stacked.key
    m = nn.GroupNorm(2, 4)
    x = torch.zeros(3, 4, 5)
    assert key(m, x, x, ("weight",)) is None
    assert key(m, x.bfloat16(), x.bfloat16(), ("weight",)) is not None  # the torch route still stacks
