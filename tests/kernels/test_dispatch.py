"""Dispatch: every op is declared once with its reference, kernels register themselves under those
names (a typo raises at import), and the tests and benchmarks iterate over what is registered."""
from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("triton")

import pdpfast.kernels as kernels  # noqa: E402
from pdpfast import ops  # noqa: E402
from pdpfast.ops import dispatch  # noqa: E402

KERNEL_OPS = sorted(name for name, op in dispatch.registered().items() if op.kernel is not None)


def test_every_declared_op_has_a_reference_and_a_kernel_of_its_own_name():
    registered = dispatch.registered()
    assert registered and KERNEL_OPS == sorted(registered)
    for name, op in registered.items():
        assert op.name == name
        assert callable(op.reference) and op.reference.__module__.startswith("pdpfast.ops."), name
        assert op.kernel is getattr(kernels, name), name  # the launcher is named after its op
        assert op.kernel.__module__.startswith("pdpfast.kernels."), name  # registered by its own file


def test_a_kernel_registered_under_an_unknown_op_name_raises():
    with pytest.raises(dispatch.RegistrationError, match="unknown op"):
        dispatch.register("linear_weight_sq_norm")
    with pytest.raises(dispatch.RegistrationError, match="unknown op"):
        dispatch.pick("bias_sq_norm", torch.zeros(1))
    assert issubclass(dispatch.RegistrationError, ValueError)


def test_a_typo_in_a_kernel_file_raises_at_its_import(tmp_path, monkeypatch):
    (tmp_path / "pdpfast_typo_kernel.py").write_text(
        "from pdpfast.ops.dispatch import register\n\n"
        "@register('bias_sq_norm')\n"
        "def bias_sq_norms(o):\n"
        "    return o\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(dispatch.RegistrationError, match="unknown op 'bias_sq_norm'"):
        __import__("pdpfast_typo_kernel")


def test_a_registration_error_is_not_taken_for_a_missing_triton(monkeypatch):
    """A broken Triton falls back to the references; a broken registration must not."""

    def import_module(name):
        if name == "pdpfast.kernels":
            raise dispatch.RegistrationError("unknown op 'bias_sq_norm'")
        return __import__(name)

    dispatch.triton_import_error.cache_clear()
    monkeypatch.setattr(dispatch, "importlib", types.SimpleNamespace(import_module=import_module))
    try:
        with pytest.raises(dispatch.RegistrationError):
            dispatch.triton_import_error()
    finally:
        monkeypatch.undo()
        dispatch.triton_import_error.cache_clear()
    assert dispatch.triton_import_error() is None


def test_an_op_has_one_reference_and_one_kernel():
    op = dispatch.op("bias_sq_norms")
    kernel, when = op.kernel, op.when
    with pytest.raises(dispatch.RegistrationError, match="already declared"):
        dispatch.declare("bias_sq_norms", lambda o: o)
    with pytest.raises(dispatch.RegistrationError, match="already has the kernel"):
        dispatch.register("bias_sq_norms")(lambda o: o)
    dispatch.register("bias_sq_norms", when=when)(kernel)  # the same launcher again (a reload) is fine
    assert (op.reference, op.kernel, op.when) == (ops.linear.bias_sq_norms_reference, kernel, when)


def test_every_kernel_has_a_benchmark():
    from bench.bench_kernels import BENCHMARKS, benchmark, kernel_ops

    assert kernel_ops() == KERNEL_OPS
    assert sorted(BENCHMARKS) == KERNEL_OPS
    with pytest.raises(dispatch.RegistrationError, match="unknown op"):
        benchmark("bias_sq_norm")


# Inputs on which each op's kernel runs (its ``when`` holds), and how its output is compared with
# the reference's. Every op with a kernel needs an entry: test_every_kernel_agrees_with_its_reference
# runs over the registry, so a new kernel without one fails there, by name.
def _noise_alike(kernel_grads, reference_grads):
    # not the same stream (Philox vs torch's generator): both i.i.d. N(0, 1) here
    k, r = torch.cat([g.flatten() for g in kernel_grads]), torch.cat([g.flatten() for g in reference_grads])
    assert abs(k.mean().item()) < 0.1 and abs(k.std().item() - 1) < 0.1, (k.mean(), k.std())
    assert abs(r.mean().item()) < 0.1 and abs(r.std().item() - 1) < 0.1, (r.mean(), r.std())


def _linear_case(tools, gen):
    return (tools.randn(gen, 3, 33, 65, dtype=torch.bfloat16, device=tools.device),
            tools.randn(gen, 3, 33, 7, dtype=torch.bfloat16, device=tools.device)), None


def _linear_rounding_case(tools, gen):  # a Gram-path call: norms and ρ from one launch
    return (tools.randn(gen, 3, 7, 65, dtype=torch.bfloat16, device=tools.device),
            tools.randn(gen, 3, 7, 65, dtype=torch.bfloat16, device=tools.device), True, 2.0 ** -8), None


def _linear_grouped_case(tools, gen):  # four Gram-path calls of one shape, one launch
    calls = [[tools.randn(gen, 3, 7, 64, dtype=torch.bfloat16, device=tools.device),
              tools.randn(gen, 3, 7, 64, dtype=torch.bfloat16, device=tools.device)] for _ in range(4)]

    def alike(fast, slow):  # the kernel's (n, B, K) partial sums, the reference's (n, B, 1) norms and ρ
        torch.testing.assert_close(fast[0].sum(2), slow[0].sum(2), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fast[1].sum(2), slow[1].sum(2), rtol=1e-5, atol=0)
    return (calls, True, 2.0 ** -8), alike


def _conv_case(tools, gen):
    module = torch.nn.Conv2d(3, 5, 3, stride=2, padding=1).to(tools.device)
    x_pad = ops.conv.conv_pad(tools.randn(gen, 2, 3, 9, 7, device=tools.device), module)
    return (x_pad, tools.randn(gen, 2, 5, 5, 4, device=tools.device), module), None


def _conv_grouped_case(tools, gen):  # three calls of one shape (two of them views of one tensor), one launch
    module = torch.nn.Conv2d(3, 5, 3, stride=2, padding=1).to(tools.device)
    xs = tools.randn(gen, 2, 2, 3, 9, 7, device=tools.device)
    calls = [[xs[0], tools.randn(gen, 2, 5, 5, 4, device=tools.device)],
             [tools.randn(gen, 2, 3, 9, 7, device=tools.device), tools.randn(gen, 2, 5, 5, 4, device=tools.device)],
             [xs[1], tools.randn(gen, 2, 5, 5, 4, device=tools.device)]]

    def alike(fast, slow):  # the kernel's (n, B, K) partial sums, the reference's (n, B, 1) norms and ρ
        torch.testing.assert_close(fast[0].sum(2), slow[0].sum(2), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fast[1].sum(2), slow[1].sum(2), rtol=1e-5, atol=0)
    return (calls, module, (1, 1), 2.0 ** -8, True), alike


def _conv_rounding_case(tools, gen):  # a masked-padding call with a bias: norms and ρ from one launch
    module = torch.nn.Conv2d(3, 5, 3, stride=2, padding=1).to(tools.device)
    return (tools.randn(gen, 2, 3, 9, 7, dtype=torch.bfloat16, device=tools.device),
            tools.randn(gen, 2, 5, 5, 4, dtype=torch.bfloat16, device=tools.device), module, True, 2.0 ** -8,
            (1, 1)), None


def _bias_case(tools, gen):
    return (tools.randn(gen, 3, 7, 5, dtype=torch.bfloat16, device=tools.device),), None


def _embedding_case(tools, gen):
    ids = torch.randint(0, 4, (3, 7), generator=gen).to(tools.device)
    return (ids, tools.randn(gen, 3, 7, 5, device=tools.device), 4, 0), None


def _layer_norm_case(tools, gen):
    x = tools.randn(gen, 3, 7, 33, device=tools.device)
    return (x, tools.randn(gen, 3, 7, 33, device=tools.device), torch.nn.LayerNorm(33)), None


def _rms_norm_case(tools, gen):
    x = tools.randn(gen, 3, 7, 33, device=tools.device)
    return (x, tools.randn(gen, 3, 7, 33, device=tools.device), torch.nn.RMSNorm(33)), None


def _norm_grouped_case(module):
    def case(tools, gen):  # three calls of one shape, one launch
        calls = [[tools.randn(gen, 3, 7, 33, device=tools.device), tools.randn(gen, 3, 7, 33, device=tools.device)]
                 for _ in range(3)]

        def alike(fast, slow):  # a list of per-call dicts each
            assert len(fast) == len(slow) == 3
            for f, s in zip(fast, slow):
                torch.testing.assert_close(f, s, rtol=1e-4, atol=1e-5)
        return (calls, module), alike
    return case


def _group_norm_case(tools, gen):
    x = tools.randn(gen, 3, 8, 5, 5, device=tools.device)
    return (x, tools.randn(gen, 3, 8, 5, 5, device=tools.device), 4, 1e-5, True), None


def _group_norm_grouped_case(tools, gen):  # three calls of one shape, one launch
    calls = [[tools.randn(gen, 3, 8, 5, 5, device=tools.device), tools.randn(gen, 3, 8, 5, 5, device=tools.device)]
             for _ in range(3)]

    def alike(fast, slow):  # a list of per-call dicts each
        assert len(fast) == len(slow) == 3
        for f, s in zip(fast, slow):
            torch.testing.assert_close(f, s, rtol=1e-4, atol=1e-5)
    return (calls, 4, 1e-5, True), alike


def _noise_case(tools, gen):
    grads = [torch.zeros(5000, device=tools.device), torch.zeros(3, 7, device=tools.device)]
    return (grads, 1.0, 1, 2), _noise_alike


CASES = {
    "linear_weight_sq_norms": _linear_case,
    "linear_sq_norms_rounding": _linear_rounding_case,
    "linear_sq_norms_grouped": _linear_grouped_case,
    "conv_weight_sq_norms": _conv_case,
    "conv_sq_norms_rounding": _conv_rounding_case,
    "conv_sq_norms_grouped": _conv_grouped_case,
    "bias_sq_norms": _bias_case,
    "embedding_sq_norms": _embedding_case,
    "group_norm_affine_grads": _group_norm_case,
    "group_norm_affine_grads_grouped": _group_norm_grouped_case,
    "layer_norm_per_sample_grads": _layer_norm_case,
    "rms_norm_per_sample_grads": _rms_norm_case,
    "layer_norm_per_sample_grads_grouped": _norm_grouped_case(torch.nn.LayerNorm(33)),
    "rms_norm_per_sample_grads_grouped": _norm_grouped_case(torch.nn.RMSNorm(33)),
    "add_noise_": _noise_case,
}


def _clone(arg):
    if isinstance(arg, torch.Tensor):
        return arg.clone()
    if isinstance(arg, (list, tuple)):
        return type(arg)(_clone(a) for a in arg)
    return arg


def _tensors(args):
    for arg in args:
        if isinstance(arg, torch.Tensor):
            yield arg
        elif isinstance(arg, list):
            yield from _tensors(arg)


@pytest.mark.parametrize("name", KERNEL_OPS)
def test_every_kernel_agrees_with_its_reference(name, tools, gen, monkeypatch):
    if name not in CASES:
        pytest.fail(f"the kernel of {name!r} has no case in CASES: add inputs on which it runs")
    op = dispatch.op(name)
    args, compare = CASES[name](tools, gen)
    tensors = list(_tensors(args))
    monkeypatch.delenv("PDPFAST_DISABLE_TRITON", raising=False)
    assert op.pick(*tensors) is op.kernel, f"{name}: the case does not exercise the kernel"
    monkeypatch.setenv("PDPFAST_DISABLE_TRITON", "1")
    assert op.pick(*tensors) is op.reference
    kernel_args, reference_args = _clone(args), _clone(args)
    fast, slow = op.kernel(*kernel_args), op.reference(*reference_args)
    if fast is None:  # in place: what changed is the first argument
        fast, slow = kernel_args[0], reference_args[0]
    if compare is None:
        torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5, msg=name)
    else:
        compare(fast, slow)


def test_linear_weight_sq_norms_dispatch_and_switch(tools, gen, monkeypatch):
    monkeypatch.delenv("PDPFAST_DISABLE_TRITON", raising=False)
    a = tools.randn(gen, 3, 33, 65, dtype=torch.bfloat16, device=tools.device)
    o = tools.randn(gen, 3, 33, 7, dtype=torch.bfloat16, device=tools.device)
    assert dispatch.use_triton(a, o)
    with_kernel = ops.linear_weight_sq_norms(a, o)
    assert torch.equal(with_kernel, kernels.linear_weight_sq_norms(a, o))

    monkeypatch.setenv("PDPFAST_DISABLE_TRITON", "1")
    assert not dispatch.use_triton(a, o)
    assert dispatch.pick("linear_weight_sq_norms", a, o) is ops.linear_weight_sq_norms_reference
    with_reference = ops.linear_weight_sq_norms(a, o)
    assert torch.equal(with_reference, ops.linear_weight_sq_norms_reference(a, o))
    torch.testing.assert_close(with_kernel, with_reference, rtol=1e-5, atol=0)
    monkeypatch.delenv("PDPFAST_DISABLE_TRITON", raising=False)
    # fp32: cuBLAS's batched GEMM where the direct path is cheaper (here), the kernel's tf32x3 Gram
    # where the Gram is (few positions, wide layers) and the rank-one kernel at T = 1: as measured
    assert dispatch.pick("linear_weight_sq_norms", a.float(), o.float()) is ops.linear_weight_sq_norms_reference
    wide = tools.randn(gen, 3, 8, 96, device=tools.device), tools.randn(gen, 3, 8, 80, device=tools.device)
    assert dispatch.pick("linear_weight_sq_norms", *wide) is kernels.linear_weight_sq_norms
    assert dispatch.pick("linear_weight_sq_norms", a[:, :1].float(), o[:, :1].float()) is kernels.linear_weight_sq_norms


def test_gpt2_768_to_768_calls_take_the_kernels_gram_path(tools):
    """At GPT-2's 768→768 calls (T = 512) the Gram form takes 1.33× the direct form's multiply-adds;
    on an H200 the kernel's Gram path still ran 1.24-1.38× faster than its direct path, and 1.26×
    cuBLAS in fp32, so the kernel takes it (fp32 too); at T = 1024 (2.67×) the direct form wins."""
    from pdpfast.ops.linear import kernel_uses_gram, use_gram

    assert kernel_uses_gram(512, 768, 768) and not use_gram(512, 768, 768)
    assert not kernel_uses_gram(1024, 768, 768)
    a, o = (torch.empty(1, 512, 768, device=tools.device) for _ in range(2))  # (where the kernels run)
    assert dispatch.pick("linear_weight_sq_norms", a, o) is kernels.linear_weight_sq_norms
    assert dispatch.pick("linear_sq_norms_rounding", a, o) is kernels.linear_sq_norms_rounding
    long_a, long_o = (torch.empty(1, 1024, 768, device=tools.device) for _ in range(2))
    assert dispatch.pick("linear_weight_sq_norms", long_a, long_o) is ops.linear_weight_sq_norms_reference


def test_linear_sq_norms_with_bias_through_the_kernel(tools, gen, monkeypatch):
    """The kernel takes the bias into the weight's launch; the reference into the weight's Gram."""
    a = tools.randn(gen, 3, 7, 9, dtype=torch.bfloat16, device=tools.device)
    o = tools.randn(gen, 3, 7, 5, dtype=torch.bfloat16, device=tools.device)
    monkeypatch.delenv("PDPFAST_DISABLE_TRITON", raising=False)
    fast = ops.linear_sq_norms(a, o, with_bias=True)
    monkeypatch.setenv("PDPFAST_DISABLE_TRITON", "1")
    slow = ops.linear_sq_norms(a, o, with_bias=True)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-6)


def test_add_noise_runs_the_kernels_stream(tools, monkeypatch):
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
    assert dispatch.pick("bias_sq_norms", on(2, 8, 4, dtype=torch.float32)) is reference
    assert dispatch.pick("bias_sq_norms", on(2, 1, 4, dtype=torch.bfloat16)) is reference
    assert dispatch.pick("bias_sq_norms", on(2, 8, 4, dtype=torch.bfloat16)) is kernels.bias_sq_norms


def test_the_benchmarks_fp32_precision_switch_reaches_the_launch_and_is_restored():
    """bench_kernels times fp32 kernels with exact products beside the default tf32x3 ones: the
    switch must reach the constexpr the launch gets, and come back even when the block raises."""
    from bench.bench_kernels import fp32_dot_precision, max_rel_err
    from pdpfast.kernels import _utils

    assert _utils.dot_flags(torch.float32)["DOT_PRECISION"] == "tf32x3"
    assert _utils.dot_flags(torch.float32, tf32=True)["DOT_PRECISION"] == "tf32"
    with pytest.raises(KeyError), fp32_dot_precision("ieee"):
        assert _utils.dot_flags(torch.float32)["DOT_PRECISION"] == "ieee"
        assert _utils.dot_flags(torch.bfloat16)["DOT_PRECISION"] == "tf32"  # low precision is unaffected
        raise KeyError
    assert _utils.dot_flags(torch.float32)["DOT_PRECISION"] == "tf32x3"
    exact = torch.tensor([1.0, 4.0, 0.0], dtype=torch.float64)
    assert max_rel_err(torch.tensor([1.0, 5.0, 0.0]), exact) == pytest.approx(0.25)


def test_host_block_arithmetic_equals_tritons():
    """The launchers' plain-Python cdiv and next_power_of_2 (Triton's are constexpr functions, slow
    on the host) give Triton's results: the grids and blocks they size are unchanged."""
    import triton

    from pdpfast.kernels import _utils

    for n in [0, 1, 2, 3, 4, 5, 7, 8, 9, 63, 64, 65, 127, 128, 129, 1000, 4096, 4097, (1 << 31) + 1]:
        assert _utils.next_power_of_2(n) == triton.next_power_of_2(max(n, 1)), n
        for b in [1, 2, 3, 16, 64, 1024]:
            assert _utils.cdiv(n, b) == triton.cdiv(n, b), (n, b)
    assert _utils.block(0, 16, 64) == 16 and _utils.block(100, 16, 64) == 64 and _utils.block(33, 16, 64) == 64
