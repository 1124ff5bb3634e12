"""``linear_clipped_into`` (``csrc/linear_sums.cpp``): a linear call's clipped sums added into its
parameters' ``.grad`` in one call of ``pdpfast._C``. It runs the ops the Python route runs
(``linear_clipped_grads``, then ``ClippingState._accumulate_param``), so it must give the same bits,
on fresh random inputs, in every dtype, with weights computed or pending, into a gradient that
exists or not; and the engine must give the same steps with it as without it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pdpfast import _ext
from pdpfast.clipping import ClippingState
from pdpfast.nn.linear import as_btd
from pdpfast.ops import linear as lin_ops
from pdpfast.ops.clip import PendingWeights

pytestmark = pytest.mark.skipif(_ext.missing("linear_clipped_into", "linear_sums.cpp") is not None,
                                reason="pdpfast._C without csrc/linear_sums.cpp")

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _no_grad():
    """As inside a backward (where the engine runs it), grad mode off."""
    with torch.no_grad():
        yield


def python_route(x, o, weights, weight, bias, transposed):
    a, g = as_btd(x, o)
    grad_w, grad_b = lin_ops.linear_clipped_grads(a, g, weights, weight is not None, bias is not None, transposed)
    for p, grad in ((weight, grad_w), (bias, grad_b)):
        if grad is not None:
            ClippingState._accumulate_param(p, grad)


def params(d, p, dtype, transposed, with_weight, with_bias, with_grad, seed):
    g = torch.Generator().manual_seed(seed)
    made = []
    for wanted, shape in ((with_weight, (d, p) if transposed else (p, d)), (with_bias, (p,))):
        if not wanted:
            made.append(None)
            continue
        t = nn.Parameter(torch.randn(*shape, generator=g).to(dtype))
        if with_grad:
            t.grad = torch.randn(*shape, generator=g).to(dtype)
        made.append(t)
    return made


def clone(p):
    if p is None:
        return None
    c = nn.Parameter(p.detach().clone())
    c.grad = None if p.grad is None else p.grad.clone()
    return c


def pending(B, acc, seed, gamma=None, loss_scale=1.0, rounding=False, parts=0):
    g = torch.Generator().manual_seed(seed)
    sq = torch.rand(*((B, parts) if parts else (B,)), generator=g, dtype=acc) * 3
    bounds = torch.rand(B, generator=g, dtype=acc) + 0.1
    rho = None
    if rounding:
        rho = torch.rand(*((B, parts) if parts else (B,)), generator=g, dtype=acc) * 1e-3
    return PendingWeights(sq, bounds, gamma, loss_scale, rho, bool(parts))


def assert_same(run, ref):
    for a, b in zip(run, ref):
        if a is None:
            assert b is None
            continue
        assert a.grad.dtype == b.grad.dtype and a.grad.shape == b.grad.shape
        assert torch.equal(a.grad, b.grad), (a.grad - b.grad).abs().max()


SHAPES = [((4, 5), 8, 3), ((4, 5), 3, 8), ((3,), 6, 6), ((2, 2, 3), 4, 7), ((1, 4), 5, 2), ((0, 4), 5, 2),
          ((), 1, 3)]  # the last: a 1-D input (1,), which the Python route reads as B = d = 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead, d, p", SHAPES)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("trained", ["weight+bias", "weight", "bias"])
@pytest.mark.parametrize("with_grad", [False, True])
def test_computed_weights_give_the_python_routes_bits(dtype, lead, d, p, transposed, trained, with_grad):
    seed = hash((str(dtype), lead, d, p, transposed, trained, with_grad)) % 2**31
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, d, generator=g).to(dtype)
    B = x.shape[0]
    o = torch.randn(x[..., 0].numel(), p, generator=g).to(dtype)  # (B·T, p), as the flat linear's backward
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    weights = torch.rand(B, generator=g, dtype=acc)
    made = params(d, p, dtype, transposed, "weight" in trained, "bias" in trained, with_grad, seed)
    ref = [clone(t) for t in made]
    assert lin_ops.linear_clipped_into(x, o, weights, *made, transposed)
    python_route(x, o, weights, *ref, transposed)
    assert_same(made, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead, d, p", SHAPES)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("variant", ["plain", "rounding", "parts", "parts+rounding", "automatic", "loss scale"])
def test_pending_weights_give_the_python_routes_bits(dtype, lead, d, p, transposed, variant):
    seed = hash((str(dtype), lead, d, p, transposed, variant)) % 2**31
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, d, generator=g).to(dtype)
    B = x.shape[0]
    o = torch.randn(x[..., 0].numel(), p, generator=g).to(dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    weights = pending(B, acc, seed, gamma=0.01 if variant == "automatic" else None,
                      loss_scale=7.0 if variant == "loss scale" else 1.0, rounding="rounding" in variant,
                      parts=3 if "parts" in variant else 0)
    made = params(d, p, dtype, transposed, True, True, False, seed)
    ref = [clone(t) for t in made]
    assert lin_ops.linear_clipped_into(x, o, weights, *made, transposed)
    python_route(x, o, weights, *ref, transposed)
    assert_same(made, ref)


@pytest.mark.parametrize("pending_weights", [False, True])
def test_gradients_of_another_dtype_are_cast_to_the_parameters(pending_weights):
    """Under autocast a layer's output gradient is bf16 and its fp32 parameters take the sums cast."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 6, generator=g).bfloat16()
    o = torch.randn(12, 5, generator=g).bfloat16()
    weights = pending(3, torch.float32, 5) if pending_weights else torch.rand(3, generator=g)
    made = params(6, 5, torch.float32, False, True, True, True, 5)
    ref = [clone(t) for t in made]
    assert lin_ops.linear_clipped_into(x, o, weights, *made)
    python_route(x, o, weights, *ref, False)
    assert_same(made, ref)
    assert made[0].grad.dtype == torch.float32


def test_declines_where_the_python_route_must_run():
    """Nothing is done (False) for a plain sum (weights None), in grad mode (a backward with
    create_graph=True, whose sums keep their graph), or where clip_scale would not take its C++ route."""
    x, o = torch.randn(2, 3, 4), torch.randn(6, 5)
    weight = nn.Parameter(torch.randn(5, 4))
    assert not lin_ops.linear_clipped_into(x, o, None, weight, None)
    with torch.enable_grad():  # (the fixture turned it off)
        assert not lin_ops.linear_clipped_into(x, o, torch.rand(2), weight, None)
    zero_scale = PendingWeights(torch.rand(2), torch.rand(2), None, 0.0)  # clip_scale's torch route
    assert not lin_ops.linear_clipped_into(x, o, zero_scale, weight, None)
    # x of another dtype than o: the Python route scales the operand it asks clip_scale's route about
    bias = nn.Parameter(torch.zeros(5, dtype=torch.float64))
    assert not lin_ops.linear_clipped_into(x, o.double(), PendingWeights(torch.rand(2), torch.rand(2)), None, bias)
    assert weight.grad is None and bias.grad is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("weighting", ["computed", "shared", "pending", "pending+parts+rounding"])
def test_calls_of_one_key_give_each_calls_own_bits(dtype, transposed, weighting):
    """``linear_clipped_into_calls``: calls of one batch and sequence length, of mixed widths, with and
    without bias and with a .grad or not, get the bits each call's ``linear_clipped_into`` gives."""
    seed = hash((str(dtype), transposed, weighting)) % 2**31
    g = torch.Generator().manual_seed(seed)
    B, T = 3, 4
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    widths = [(5, 8, True, False), (8, 5, False, True), (6, 6, True, True), (1, 3, True, False)]
    shared = torch.rand(B, generator=g, dtype=acc)
    calls, refs, weights = [], [], []
    for c, (d, p, with_bias, with_grad) in enumerate(widths):
        x = torch.randn(B, T, d, generator=g).to(dtype)
        o = torch.randn(B * T, p, generator=g).to(dtype)
        weight, bias = params(d, p, dtype, transposed, True, with_bias, with_grad, seed + c)
        calls.append((x, o, weight, bias))
        refs.append((x, o, clone(weight), clone(bias)))
        if weighting == "shared":
            weights.append(shared)
        elif weighting == "computed":
            weights.append(torch.rand(B, generator=g, dtype=acc))
        else:
            weights.append(pending(B, acc, seed + c, rounding="rounding" in weighting,
                                   parts=2 if "parts" in weighting else 0))
    assert lin_ops.linear_clipped_into_calls(calls, weights, transposed)
    for (x, o, weight, bias), w in zip(refs, weights):
        assert lin_ops.linear_clipped_into(x, o, w, weight, bias, transposed)
    for (_, _, *made), (_, _, *ref) in zip(calls, refs):
        assert_same(made, ref)


def test_calls_of_one_key_decline_where_the_first_call_would():
    """Where the first call would not take the C++ route (grad mode on, pending weights off its route,
    x in another dtype than o), nothing is done: each call then takes its own route."""
    g = torch.Generator().manual_seed(6)
    x, o = torch.randn(2, 3, 4, generator=g), torch.randn(6, 5, generator=g)
    weight = nn.Parameter(torch.randn(5, 4, generator=g))
    w = torch.rand(2, generator=g)
    with torch.enable_grad():
        assert not lin_ops.linear_clipped_into_calls([(x, o, weight, None)], [w])
    bounds_per_row = PendingWeights(torch.rand(2, 1), torch.rand(2, 1))  # (B, 1) bounds: not clip_scale's
    assert not lin_ops.linear_clipped_into_calls([(x, o, weight, None)], [bounds_per_row])
    assert not lin_ops.linear_clipped_into_calls([(x, o.double(), weight, None)], [w])
    assert weight.grad is None


def _transformer(seed):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=40, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False),
                         nn.Linear(16, 3))


@pytest.mark.parametrize("mode, clipping", [("bk", "flat"), ("bk", "per_layer"), ("ghost", "flat")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_engine_steps_are_the_same_with_and_without_it(mode, clipping, dtype, monkeypatch):
    """Every clipping mode on a full-size model's route (each call on its own) writes the same
    clipped sums whether the calls' sums are added in C++ or in Python."""
    import pdpfast
    import pdpfast.clipping as clipping_module

    monkeypatch.setattr(clipping_module, "SMALL_CALL_BYTES", 0)
    monkeypatch.setattr(lin_ops, "MATERIALIZE_RATIO", 0)
    monkeypatch.setattr(lin_ops, "MATERIALIZE_MIN_ELEMENTS", 0)
    B = 5
    x = torch.randn(B, 6, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    calls = []
    into = lin_ops.linear_clipped_into

    def spy(*args):
        calls.append(into(*args))
        return calls[-1]

    monkeypatch.setattr(lin_ops, "linear_clipped_into", spy)

    def run():
        model = pdpfast.nn.convert(_transformer(0).to(dtype))
        state = ClippingState(model, mode=mode, clipping=clipping)
        with state.attached():
            state.begin_batch(torch.linspace(0.05, 2.0, B), loss_scale=1 if mode == "ghost" else B)
            losses = model(x).float().pow(2).mean((1, 2))
            if mode == "ghost":  # (summed per-sample losses: loss scale 1)
                state.ghost_backward(losses)
            else:
                losses.mean().backward()
            state.end_draw()
        return {n: p.grad for n, p in model.named_parameters()}

    with torch.enable_grad():
        fast = run()
    assert calls and all(calls), calls  # every linear call took the C++ route
    monkeypatch.setattr(lin_ops, "_INTO_MISSING", "off for the test")
    calls.clear()
    with torch.enable_grad():
        slow = run()
    assert calls and not any(calls)
    assert fast.keys() == slow.keys()
    for name in fast:
        assert torch.equal(fast[name], slow[name]), name


def test_it_is_declared_in_the_extension_with_its_source():
    """Both entry points are in the built extension (a stale build would run the Python route, slower)."""
    for name in ("linear_clipped_into", "linear_clip_scale_into"):
        assert callable(getattr(_ext._C, name, None)), name


def test_a_one_record_batch_through_a_one_feature_layer_on_a_1d_input():
    """A batch of one record may reach ``nn.Linear(1, p)`` as a (1,) tensor: the Python route reads it as
    B = d = 1, and so does the C++ one (ghost clipping's second pass takes it at any size)."""
    import pdpfast

    grads = []
    for missing in (None, "off for the test"):
        torch.manual_seed(0)
        model = pdpfast.nn.convert(nn.Sequential(nn.Linear(1, 3)))
        calls = []
        into, saved = lin_ops.linear_clipped_into, lin_ops._INTO_MISSING
        lin_ops._INTO_MISSING = missing
        lin_ops.linear_clipped_into = lambda *args: calls.append(into(*args)) or calls[-1]
        try:
            state = ClippingState(model, mode="ghost")
            with torch.enable_grad(), state.attached():
                state.begin_batch(torch.ones(1))
                state.ghost_backward(model(torch.tensor([3.0])).pow(2).sum().reshape(1))
                state.end_draw()
        finally:
            lin_ops._INTO_MISSING, lin_ops.linear_clipped_into = saved, into
        assert calls == [missing is None]
        grads.append([p.grad for p in model.parameters()])
    for fast, slow in zip(*grads):
        assert torch.equal(fast, slow)
