"""End to end: the dispatching ops run the kernels, and PDPFAST_DISABLE_TRITON=1 runs the references."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import pdpfast.kernels as kernels  # noqa: E402
from pdpfast import ops  # noqa: E402
from pdpfast.ops import dispatch  # noqa: E402

def test_every_op_has_a_registered_kernel():
    registered = dispatch.registered()
    assert set(registered) == dispatch.OPS
    for name in dispatch.OPS:
        assert registered[name] is getattr(kernels, name), name


def test_an_unknown_op_name_is_an_error_not_a_silent_fallback():
    with pytest.raises(ValueError, match="unknown op"):
        dispatch.register("linear_weight_sq_norm")
    with pytest.raises(ValueError, match="unknown op"):
        dispatch.pick("bias_sq_norm", None, torch.zeros(1))


def test_every_op_has_a_benchmark():
    from bench.bench_kernels import BENCHMARKS

    assert set(BENCHMARKS) == dispatch.OPS


def test_linear_weight_sq_norms_dispatch_and_switch(tools, gen, monkeypatch):
    monkeypatch.delenv("PDPFAST_DISABLE_TRITON", raising=False)
    a = tools.randn(gen, 3, 33, 65, dtype=torch.bfloat16, device=tools.device)
    o = tools.randn(gen, 3, 33, 7, dtype=torch.bfloat16, device=tools.device)
    assert dispatch.use_triton(a, o)
    with_kernel = ops.linear_weight_sq_norms(a, o)
    assert torch.equal(with_kernel, kernels.linear_weight_sq_norms(a, o))

    monkeypatch.setenv("PDPFAST_DISABLE_TRITON", "1")
    assert not dispatch.use_triton(a, o)
    assert dispatch.pick("linear_weight_sq_norms", ops.linear_weight_sq_norms_reference, a, o) \
        is ops.linear_weight_sq_norms_reference
    with_reference = ops.linear_weight_sq_norms(a, o)
    assert torch.equal(with_reference, ops.linear_weight_sq_norms_reference(a, o))
    torch.testing.assert_close(with_kernel, with_reference, rtol=1e-5, atol=0)
    monkeypatch.delenv("PDPFAST_DISABLE_TRITON", raising=False)  # fp32: cuBLAS's Gram was measured faster
    assert dispatch.pick("linear_weight_sq_norms", ops.linear_weight_sq_norms_reference, a.float(), o.float()) \
        is ops.linear_weight_sq_norms_reference


def test_every_dispatching_op_agrees_with_its_reference(tools, gen, monkeypatch):
    a = tools.randn(gen, 3, 7, 9, device=tools.device)
    o = tools.randn(gen, 3, 7, 5, device=tools.device)
    ids = torch.randint(0, 4, (3, 7), generator=gen).to(tools.device)
    calls = {
        "bias_sq_norms": lambda: ops.bias_sq_norms(o),
        "embedding_sq_norms": lambda: ops.embedding_sq_norms(ids, o, 4, 0),
        "linear_sq_norms": lambda: ops.linear_sq_norms(a, o, with_bias=True),
    }
    for name, call in calls.items():
        monkeypatch.delenv("PDPFAST_DISABLE_TRITON", raising=False)
        fast = call()
        monkeypatch.setenv("PDPFAST_DISABLE_TRITON", "1")
        slow = call()
        torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-6, msg=name)

    monkeypatch.delenv("PDPFAST_DISABLE_TRITON", raising=False)
    g = torch.zeros(1000, device=tools.device)
    ops.add_noise_([g], 1.0, 1, 2)
    reproduced = torch.zeros(1000, device=tools.device)
    kernels.add_noise_([reproduced], 1.0, 1, 2)
    assert torch.equal(g, reproduced)  # the kernel's stream, not torch's


def test_dispatch_never_picks_a_kernel_measured_slower_than_torch(tools, monkeypatch):
    """bias_sq_norms: the kernel only for fp16/bf16 sequences, where it was measured faster."""
    monkeypatch.delenv("PDPFAST_DISABLE_TRITON", raising=False)
    reference = ops.linear.bias_sq_norms_reference
    on = lambda *shape, dtype: torch.zeros(*shape, dtype=dtype, device=tools.device)  # noqa: E731
    assert dispatch.pick("bias_sq_norms", reference, on(2, 8, 4, dtype=torch.float32)) is reference
    assert dispatch.pick("bias_sq_norms", reference, on(2, 1, 4, dtype=torch.bfloat16)) is reference
    assert dispatch.pick("bias_sq_norms", reference, on(2, 8, 4, dtype=torch.bfloat16)) is kernels.bias_sq_norms
