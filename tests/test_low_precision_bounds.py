"""Privacy property: in fp16/bf16 a record's rounded clipped contribution stays within its bound c_i
even where the terms of its per-sample gradient cancel, for every layer family whose clipped sum
scales terms one by one (positions, pixels, repeated tokens) and every clipping style.

A clipped sum Σ_t round(w·o_t)·a_tᵀ rounds each term relative to |w·o_t|, not to the (small) sum,
so a fixed relative margin cannot cover a record whose terms nearly cancel. The rules bound that
rounding per record (``LayerRule.rounding``) or scale in fp32; these tests build such records
(o = [1, -1 + eps] on equal inputs, the worst case for a relative margin) and measure.
"""
import pytest
import torch
from torch import nn

import pdpfast
from pdpfast import clipping
from pdpfast.functional import clipped_gradients
from pdpfast.nn.rules import LayerRule, low_precision

STYLES = [dict(mode="bk", clipping="flat"), dict(mode="bk", clipping="per_layer"), dict(mode="ghost", clipping="flat")]
STYLE_IDS = ["bk", "per_layer", "ghost"]
DTYPES = [torch.bfloat16, torch.float16]


def _ones(module):
    for p in module.parameters():
        nn.init.ones_(p) if p.dim() > 1 or p.numel() == 1 else nn.init.zeros_(p)
    return module


class _TwoLinear(nn.Module):
    """Two layers, each with a cancelling record: flat clipping adds their rounding bounds."""

    def __init__(self):
        super().__init__()
        self.a, self.b = _ones(nn.Linear(1, 1, bias=False)), _ones(nn.Linear(1, 1, bias=False))

    def forward(self, x):
        return torch.cat([self.a(x), self.b(x)], -1)


def _hf_conv1d():
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D
    return _ones(Conv1D(1, 1))


# name -> (module factory, input factory (dtype), number of output values per record)
CASES = {
    "linear": (lambda: _ones(nn.Linear(1, 1, bias=False)), lambda dt: torch.ones(1, 2, 1, dtype=dt)),
    "linear_bias": (lambda: _ones(nn.Linear(1, 1)), lambda dt: torch.ones(1, 2, 1, dtype=dt)),
    "hf_conv1d": (_hf_conv1d, lambda dt: torch.ones(1, 2, 1, dtype=dt)),
    "two_linear": (_TwoLinear, lambda dt: torch.ones(1, 2, 1, dtype=dt)),
    # stacked in depth: the first layer's output gradients come through the second's backward
    "two_deep": (lambda: nn.Sequential(_ones(nn.Linear(1, 1, bias=False)), _ones(nn.Linear(1, 1, bias=False))),
                 lambda dt: torch.ones(1, 2, 1, dtype=dt)),
    "conv2d": (lambda: _ones(nn.Conv2d(1, 1, 2, stride=2, bias=False)), lambda dt: torch.ones(1, 1, 2, 4, dtype=dt)),
    "conv1d_bias": (lambda: _ones(nn.Conv1d(2, 1, 1)), lambda dt: torch.ones(1, 2, 2, dtype=dt)),
    # depthwise: each group's two positions cancel (its bound sums over the groups)
    "conv2d_depthwise": (lambda: _ones(nn.Conv2d(2, 2, 2, stride=2, groups=2, bias=False)),
                         lambda dt: torch.ones(1, 2, 2, 4, dtype=dt)),
    "conv2d_groups_bias": (lambda: _ones(nn.Conv2d(4, 2, 2, stride=2, groups=2)),
                           lambda dt: torch.ones(1, 4, 2, 4, dtype=dt)),
    "embedding_repeated_token": (lambda: _ones(nn.Embedding(3, 1)), lambda dt: torch.tensor([[1, 1]])),
    # one bag, its entries weighted 1 and -1 + eps: the per-entry rows w·s_j·o cancel
    "embedding_bag": (lambda: _ones(nn.EmbeddingBag(3, 1, mode="sum")),
                      lambda dt: (torch.tensor([[1, 1]]), None, torch.tensor([[1.0, -1.0 + _eps(dt)]], dtype=dt))),
}


def _eps(dtype):
    return 2.0 ** (-7 if dtype == torch.bfloat16 else -10)  # -1 + eps is exact in the dtype


def _worst_ratio(case, style, dtype, small_call_bytes=None, monkeypatch=None):
    """max over clip bounds below the record's norm of ‖rounded contribution‖ / c (fp64 norms)."""
    make_module, make_input = CASES[case]
    eps = _eps(dtype)
    if small_call_bytes is not None:
        monkeypatch.setattr(clipping, "SMALL_CALL_BYTES", small_call_bytes)
    worst = 0.0
    for c in torch.linspace(0.05 * eps, 0.99 * eps, 25).tolist():  # every record is clipped
        model = pdpfast.nn.convert(make_module().to(dtype))
        inputs = make_input(dtype)
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)

        def losses(out):
            flat = out.float().reshape(1, -1)  # the record's outputs: o = 1, -1 + eps, 1, ... on them
            if flat.shape[1] == 1:
                return flat.sum(1)
            return (flat * torch.tensor([1.0, -1.0 + eps]).repeat(flat.shape[1] // 2)).sum(1)

        result = clipped_gradients(model, losses, *inputs, clip_norms=torch.tensor([c]), **style)
        norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in result.grads.values())))
        worst = max(worst, norm / c)
    return worst


@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_cancelling_record_stays_within_bound(case, style, dtype):
    worst = _worst_ratio(case, style, dtype)
    assert worst <= 1.0
    # not vacuous: the record contributes (ghost's second backward may round a repeated token's
    # scaled rows to an exact cancellation, a contribution of 0)
    assert worst > 0.3 or (style["mode"] == "ghost" and case.startswith("embedding"))


@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_random_records_whose_position_pairs_cancel_stay_within_bound(style, dtype):
    """Fresh random records of a wider layer (d = 8, p = 4, T = 6): positions come in pairs with the
    same input and output gradients o and -(1 - δ)·o, so each record's gradient is a small remainder
    of large terms; each clipped to a random fraction of its fp64 norm, 30 trials."""
    g = torch.Generator().manual_seed(7)
    worst = 0.0
    for _trial in range(30):
        a = torch.randn(1, 3, 8, generator=g)
        x = torch.cat([a, a], 1).to(dtype)  # (1, 6, 8): positions t and t + 3 read the same input
        signs = torch.randn(1, 3, 4, generator=g)
        delta = 2.0 ** -int(torch.randint(3, 9, (), generator=g))
        coef = torch.cat([signs, -(1 - delta) * signs], 1)  # the loss's o: o_{t+3} = -(1 - δ) o_t
        exact = clipped_gradients(pdpfast.nn.convert(nn.Linear(8, 4).double()),
                                  lambda out: (out * coef.double()).sum((1, 2)), x.double(),
                                  clip_norms=torch.tensor([1e9])).norms  # fp64, unclipped
        c = exact.float() * (0.05 + 0.85 * torch.rand(1, generator=g))
        model = pdpfast.nn.convert(nn.Linear(8, 4).to(dtype))
        result = clipped_gradients(model, lambda out: (out.float() * coef).sum((1, 2)), x, clip_norms=c, **style)
        norm = float(torch.sqrt(sum(v.double().pow(2).sum() for v in result.grads.values())))
        worst = max(worst, norm / float(c))
    assert worst <= 1.0
    assert worst > 0.5  # the bound costs signal here (every term cancels), not all of it


@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
@pytest.mark.parametrize("layer", [nn.GRU, nn.LSTM, nn.RNN], ids=["gru", "lstm", "rnn"])
def test_recurrent_layer_in_bf16_stays_within_bound(layer, style):
    """A recurrent layer's projections sum over time steps; their rule bounds that sum's rounding too."""
    g = torch.Generator().manual_seed(3)
    worst = 0.0
    for _trial in range(10):
        torch.manual_seed(int(torch.randint(0, 2**31, (), generator=g)))
        model = pdpfast.nn.convert(layer(3, 4, batch_first=True).to(torch.bfloat16))
        x = torch.randn(1, 5, 3, generator=g).to(torch.bfloat16)
        c = 1e-3  # below every record's norm here
        result = clipped_gradients(model, lambda out: out[0].float().sum((1, 2)), x, clip_norms=torch.tensor([c]),
                                   **style)
        worst = max(worst, float(torch.sqrt(sum(v.double().pow(2).sum() for v in result.grads.values()))) / c)
    assert 0.9 < worst <= 1.0


@pytest.mark.parametrize("style", STYLES[:2], ids=STYLE_IDS[:2])
@pytest.mark.parametrize("case", ["linear_bias", "two_linear"])
def test_cancelling_record_stays_within_bound_when_calls_do_not_stack(case, style, monkeypatch):
    """Calls too large to stack take the rule's own rounding bound, not the stack's."""
    assert _worst_ratio(case, style, torch.bfloat16, small_call_bytes=0, monkeypatch=monkeypatch) <= 1.0


@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
@pytest.mark.parametrize("case", ["conv2d", "conv1d_bias", "conv2d_depthwise", "conv2d_groups_bias"])
def test_cancelling_conv_record_stays_within_bound_where_no_per_sample_gradient_is_formed(case, style, monkeypatch):
    """Convolutions whose norms come from their formulas (as a GPU's, and large calls on a CPU), not from
    formed per-sample gradients, clip with their rule's ρ (a grouped convolution's summed over its
    groups): the cancelling record stays within its bound, and the bound is what kept it there."""
    import pdpfast.ops.conv as conv_ops
    import pdpfast.ops.linear as lin_ops

    for name in ("MATERIALIZE_RATIO", "MATERIALIZE_MIN_ELEMENTS"):
        monkeypatch.setattr(lin_ops, name, 0)
    monkeypatch.setattr(conv_ops, "implicit_gram_pays", lambda *args: True)
    bounds = []
    rounding = conv_ops.conv_scaled_sum_rounding
    monkeypatch.setattr(conv_ops, "conv_scaled_sum_rounding", lambda *args: (bounds.append(1), rounding(*args))[1])
    worst = _worst_ratio(case, style, torch.bfloat16, small_call_bytes=0, monkeypatch=monkeypatch)
    assert bounds, "the call formed its per-sample gradients: no bound was exercised"
    assert 0.3 < worst <= 1.0


def test_rounding_bound_costs_nothing_where_terms_do_not_cancel():
    """One position per record (T = 1): ρ_i = u·‖g_i‖, so the bound loses only ~u of the signal."""
    torch.manual_seed(0)
    model = pdpfast.nn.convert(nn.Linear(8, 4).to(torch.bfloat16))
    x = torch.randn(1, 8).to(torch.bfloat16) * 10
    result = clipped_gradients(model, lambda out: out.float().pow(2).sum(1), x, clip_norms=torch.tensor([0.5]))
    norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in result.grads.values())))
    assert 0.5 * (1 - 6 * 2.0 ** -8) <= norm <= 0.5


def test_rule_without_rounding_bound_forms_per_sample_gradients_in_low_precision():
    """A registered rule with norm formulas but no ``rounding``: its clipped sum's rounding is
    unknown, so in fp16/bf16 its calls form per-sample gradients (whose weighted sum rounds
    relative to g_i); in fp32 on the CPU they keep the formulas."""
    rule = LayerRule(lambda m, x, o: {}, sq_norms=lambda m, x, o, names: x.new_zeros(x.shape[0]))
    x = torch.ones(2, 3)
    assert rule.materializes_call(None, x, x.to(torch.bfloat16))
    assert rule.materializes_call(None, x, x.to(torch.float16))
    assert not rule.materializes_call(None, x, x)
    assert low_precision(x.to(torch.bfloat16)) and not low_precision(x)


# ------------------------------------------------------------------ the bounds against brute force


def _brute_linear(a, o, with_weight, with_bias):
    B, T = o.shape[:2]
    out = torch.zeros(B, dtype=torch.float64)
    for i in range(B):
        for t in range(T):
            size = (a[i, t].double().pow(2).sum() if with_weight else 0.0) + (1.0 if with_bias else 0.0)
            out[i] += o[i, t].double().norm() * torch.as_tensor(size, dtype=torch.float64).sqrt()
    return out


@pytest.mark.parametrize("B,T", [(0, 3), (1, 1), (3, 5), (2, 0)])
@pytest.mark.parametrize("with_weight,with_bias", [(True, True), (True, False), (False, True)])
def test_linear_rounding_bound_is_u_times_sum_of_position_norm_products(B, T, with_weight, with_bias):
    from pdpfast.nn.linear import linear_rounding

    g = torch.Generator().manual_seed(B * 10 + T)
    a = torch.randn(B, T, 6, generator=g).to(torch.bfloat16)
    o = torch.randn(B, T, 4, generator=g).to(torch.bfloat16)
    rho = linear_rounding(a, o, with_weight, with_bias)
    assert rho.dtype == torch.float32 and rho.shape == (B,)
    torch.testing.assert_close(rho.double(), 2.0 ** -8 * _brute_linear(a, o, with_weight, with_bias),
                               rtol=1e-5, atol=0)
    assert linear_rounding(a.float(), o.float(), with_weight, with_bias) is None  # fp32 on a CPU: none


@pytest.mark.parametrize("conv", [
    dict(kernel_size=3, padding=1), dict(kernel_size=(2, 3), stride=2), dict(kernel_size=3, dilation=2, padding=2),
    dict(kernel_size=1), dict(kernel_size=3, groups=2, padding=1)], ids=str)
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_rounding_bound_reads_each_output_positions_input_patch(conv, with_bias):
    """u·Σ_g Σ_q ‖o_{q,g}‖·√(‖patch_{q,g}‖² + 1): the patch norms from unfold (brute force), each group's
    output channels against its input channels."""
    g = torch.Generator().manual_seed(0)
    layer = pdpfast.nn.convert(nn.Conv2d(4, 6, bias=with_bias, **conv).to(torch.float16))
    x = torch.randn(3, 4, 7, 9, generator=g).to(torch.float16)
    o = torch.randn(layer(x).shape, generator=g).to(torch.float16)
    names = ("weight", "bias") if with_bias else ("weight",)
    rho = layer_rounding(layer, x, o, names)
    k = layer.kernel_size
    patches = nn.functional.unfold(x.double(), k, dilation=layer.dilation, padding=layer.padding,
                                   stride=layer.stride)  # (B, C·kh·kw, Q)
    G = layer.groups
    size = patches.unflatten(1, (G, -1)).pow(2).sum(2) + (1.0 if with_bias else 0.0)  # (B, G, Q)
    expected = 2.0 ** -11 * (o.double().flatten(2).unflatten(1, (G, -1)).norm(dim=2) * size.sqrt()).sum((1, 2))
    torch.testing.assert_close(rho.double(), expected, rtol=1e-5, atol=0)


def test_a_rounding_bound_from_tf32_products_grows_so_that_it_stays_a_bound(monkeypatch):
    """cuBLAS (torch.backends.cuda.matmul.allow_tf32) and cuDNN (cudnn.allow_tf32, on by default)
    may compute the bound's own sums from TF32 products, each operand rounded to 10 bits: the bound
    grows by TF32_SLACK there, and only there (CUDA fp32 with TF32 allowed). The CUDA test
    ``test_cuda_rounding_bounds_under_tf32_never_fall_below_the_exact_bound`` measures it."""
    from types import SimpleNamespace

    import pdpfast.ops.linear as linear_ops

    assert linear_ops.TF32_SLACK >= (1 + 2.0 ** -10) ** 2  # two operands each rounded by at most 2^-10
    fp32_cuda = SimpleNamespace(is_cuda=True, dtype=torch.float32)
    for allowed in (True, False):
        monkeypatch.setattr(linear_ops, "tf32_allowed", lambda kind, allowed=allowed: allowed)
        assert linear_ops.tf32_slack(fp32_cuda, "matmul") == (linear_ops.TF32_SLACK if allowed else 1.0)
        assert linear_ops.tf32_slack(fp32_cuda, "conv") == (linear_ops.TF32_SLACK if allowed else 1.0)
        assert linear_ops.tf32_slack(SimpleNamespace(is_cuda=True, dtype=torch.float64), "matmul") == 1.0
        assert linear_ops.tf32_slack(torch.ones(1), "conv") == 1.0  # the CPU never takes TF32


@pytest.fixture
def fp32_precision_settings():
    """torch ≥ 2.9's fp32_precision settings, restored after (setting them makes reading the legacy
    allow_tf32 flags raise until they are back)."""
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    saved = matmul.fp32_precision, conv.fp32_precision
    yield matmul, conv
    matmul.fp32_precision, conv.fp32_precision = saved


def test_tf32_settings_are_read_from_torchs_fp32_precision_api_too(fp32_precision_settings):
    from pdpfast.ops.linear import tf32_allowed

    matmul, conv = fp32_precision_settings
    assert tf32_allowed("matmul") == torch.backends.cuda.matmul.allow_tf32  # the legacy flags, untouched
    assert tf32_allowed("conv") == torch.backends.cudnn.allow_tf32
    matmul.fp32_precision, conv.fp32_precision = "tf32", "ieee"
    with pytest.raises(RuntimeError):
        bool(torch.backends.cuda.matmul.allow_tf32)  # what torch does: pdpfast must not read it then
    assert tf32_allowed("matmul") is True and tf32_allowed("conv") is False
    matmul.fp32_precision, conv.fp32_precision = "ieee", "tf32"
    assert tf32_allowed("matmul") is False and tf32_allowed("conv") is True


@pytest.mark.parametrize("kind", ["conv", "linear"])
def test_low_precision_layers_train_under_torchs_fp32_precision_api(kind, fp32_precision_settings, monkeypatch):
    """Before: a bf16 model's rounding bounds read torch.backends.cuda.matmul.allow_tf32, which raises
    once a user sets torch.backends.cuda.matmul.fp32_precision (torch ≥ 2.9), even on a CPU."""
    import pdpfast.ops.linear as linear_ops

    monkeypatch.setattr(clipping, "SMALL_CALL_BYTES", 0)  # the norm route: the bounds are computed
    monkeypatch.setattr(linear_ops, "MATERIALIZE_RATIO", 0)
    monkeypatch.setattr(linear_ops, "MATERIALIZE_MIN_ELEMENTS", 0)
    matmul, conv = fp32_precision_settings
    matmul.fp32_precision = conv.fp32_precision = "tf32"
    torch.manual_seed(0)
    if kind == "conv":
        net, x = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 2, 3)), torch.randn(4, 3, 8, 8)
    else:
        net, x = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2)), torch.randn(4, 7, 6)
    model = pdpfast.nn.convert(net.to(torch.bfloat16))
    result = clipped_gradients(model, lambda out: out.float().pow(2).flatten(1).sum(1), x.to(torch.bfloat16),
                               clip_norms=torch.ones(4))
    assert torch.isfinite(result.norms).all() and (result.norms > 0).all()


def test_conv1d_rounding_bound_matches_its_conv2d_twin():
    g = torch.Generator().manual_seed(1)
    c1 = pdpfast.nn.convert(nn.Conv1d(3, 5, 3, stride=2, padding=1).to(torch.bfloat16))
    c2 = pdpfast.nn.convert(nn.Conv2d(3, 5, (1, 3), stride=(1, 2), padding=(0, 1)).to(torch.bfloat16))
    x = torch.randn(2, 3, 11, generator=g).to(torch.bfloat16)
    o = torch.randn(c1(x).shape, generator=g).to(torch.bfloat16)
    names = ("weight", "bias")
    torch.testing.assert_close(layer_rounding(c1, x, o, names),
                               layer_rounding(c2, x.unsqueeze(2), o.unsqueeze(2), names), rtol=1e-6, atol=0)


def layer_rounding(layer, x, o, names):
    from pdpfast.nn.rules import rule_for

    return rule_for(layer).norms_and_rounding(layer, x, o, names, bound=True)[1]


def test_last_rounding_reports_the_bound_where_a_layer_rounds():
    """``ClippingState.last_rounding``: ρ_i of the last backward in bf16; None in fp32 on a CPU."""
    from pdpfast.clipping import ClippingState

    for dtype, expect in ((torch.bfloat16, True), (torch.float32, False)):
        model = pdpfast.nn.convert(nn.Linear(5, 3).to(dtype))
        state = ClippingState(model)
        with state.attached():
            state.begin_batch(torch.ones(2))
            model(torch.randn(2, 4, 5).to(dtype)).float().sum().backward()
            rho, norms = state.last_rounding, state.last_norms
            state.end_draw()
        if expect:
            assert rho.shape == (2,) and (rho > 0).all() and (rho < norms).all()
        else:
            assert rho is None


def test_layers_rounding_bounds_combine_in_quadrature_after_summing_each_layers_partial_sums():
    """Book-keeping keeps each layer's ρ as the norm kernel left it, (B,) or (B, K) partial sums,
    and combines them at the end of the backward: a layer's ρ is the sum of its partial sums, the
    layers' add in quadrature (their errors lie in different coordinates). Layers of one K are
    summed together, whatever their order; a fp64 first layer keeps fp64."""
    g = torch.Generator().manual_seed(0)
    B = 5
    parts = [torch.rand(B, 4, generator=g), torch.rand(B, generator=g), torch.rand(B, 1, generator=g),
             torch.rand(B, 4, generator=g), torch.rand(B, 7, generator=g).double(), torch.rand(B, generator=g)]
    expected = torch.stack([p.double().sum(1) if p.dim() == 2 else p.double() for p in parts]).pow(2).sum(0).sqrt()
    got = clipping._in_quadrature(parts)
    assert got.shape == (B,) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=0)
    assert clipping._in_quadrature([parts[4]] + parts[:4]).dtype == torch.float64
    # one layer: its own ρ (its partial sums summed; a single column is a view)
    torch.testing.assert_close(clipping._in_quadrature(parts[:1]), parts[0].sum(1))
    assert clipping._in_quadrature(parts[2:3])._base is parts[2]


@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
def test_backward_inside_autocast_keeps_a_cancelling_record_within_bound(style, monkeypatch):
    """``loss.backward()`` inside ``torch.autocast``: the norms' products must not run in bf16. A
    record reading one input at two positions with output gradients o and -(1 - 2⁻⁵)·o has a small
    true norm; rounded to bf16, its Gram entries cancel to 0 and the record kept 4× its bound."""
    import pdpfast.ops.linear

    monkeypatch.setattr(pdpfast.ops.linear, "MATERIALIZE_MIN_ELEMENTS", 0)   # Gram norms at this size
    d, p = 16, 16
    model = pdpfast.nn.convert(nn.Linear(d, p, bias=False))
    g = torch.Generator().manual_seed(1)
    for _ in range(10):
        a = torch.randn(1, 1, d, generator=g).to(torch.bfloat16).float()
        o = torch.randn(1, 1, p, generator=g).to(torch.bfloat16).float()
        coef = torch.cat([o, -(1 - 2.0 ** -5) * o], 1).to(torch.bfloat16).float()
        x = torch.cat([a, a], 1)
        true = float((coef[0].double().T @ x[0].to(torch.bfloat16).double()).norm())
        c = 0.1 * true
        with torch.autocast("cpu", dtype=torch.bfloat16):
            result = clipped_gradients(model, lambda out: (out.float() * coef).sum((1, 2)), x,
                                       clip_norms=torch.tensor([c]), **style)
        contribution = torch.sqrt(sum(grad.double().pow(2).sum() for grad in result.grads.values()))
        assert float(contribution) <= c * (1 + 1e-6)
        assert result.norms.dtype == torch.float32
