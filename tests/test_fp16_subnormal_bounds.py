"""Privacy property: in fp16 a record whose gradient is 10⁵-10⁷× its bound (clip weight w_i below
fp16's smallest normal, 6.1e-5) keeps its rounded clipped contribution within c_i.

Below 2⁻¹⁴ fp16 rounds in absolute steps of 2⁻²⁴, not relative ones: a weight rounded to fp16 to
nearest can grow by far more than the relative margin covers (1.19× c_i at w ≈ 1e-7). The weights are
cast to fp16 toward zero (``pdpfast.ops.clip.weights_to``); these tests build such records and measure.
The products w_i·o_t stored in fp16 are not bounded in that range: a record whose terms cancel still
exceeds its bound (the known gap the README states, pinned by a strict xfail).
"""
import pytest
import torch
from torch import nn

import pdpfast
from pdpfast.functional import clipped_gradients

STYLES = [dict(mode="bk", clipping="flat"), dict(mode="bk", clipping="per_layer"), dict(mode="ghost", clipping="flat")]
STYLE_IDS = ["bk", "per_layer", "ghost"]


class _Tiny(nn.Module):
    """A layer whose per-sample gradients are formed (LayerNorm) next to a linear one."""

    def __init__(self):
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(6), nn.Linear(6, 3)

    def forward(self, x):
        return self.proj(self.norm(x))


# name -> (module factory, input factory (generator) in fp16)
CASES = {
    "linear": (lambda: nn.Linear(16, 4), lambda g: torch.randn(1, 24, 16, generator=g)),
    "linear_wide_out": (lambda: nn.Linear(4, 16), lambda g: torch.randn(1, 24, 4, generator=g)),
    "linear_no_bias": (lambda: nn.Linear(16, 4, bias=False), lambda g: torch.randn(1, 24, 16, generator=g)),
    "conv2d": (lambda: nn.Conv2d(3, 4, 3, padding=1), lambda g: torch.randn(1, 3, 6, 6, generator=g)),
    "embedding": (lambda: nn.Embedding(10, 8), lambda g: torch.randint(0, 10, (1, 24), generator=g)),
    "layer_norm_and_linear": (_Tiny, lambda g: torch.randn(1, 24, 6, generator=g)),
}


def _worst_ratio(case, style, weights):
    """max over fresh random records of ‖rounded fp16 contribution‖ / c, with c = w·‖g‖ (fp64 norms)
    for each w of ``weights``: the record's gradient is 1/w times its bound."""
    make_module, make_input = CASES[case]
    g = torch.Generator().manual_seed(11)
    worst = 0.0
    for trial in range(4):
        torch.manual_seed(trial)
        reference = make_module()
        x = make_input(g)
        x = x if not x.is_floating_point() else x.half()
        coef = None
        out_shape = reference(x if not x.is_floating_point() else x.float()).shape
        coef = torch.randn(out_shape, generator=g) * 50  # o of a few tens: large products, fp16 finite
        exact = clipped_gradients(pdpfast.nn.convert(_copy(reference).double()),
                                  lambda out: (out * coef.double()).flatten(1).sum(1),
                                  x if not x.is_floating_point() else x.double(),
                                  clip_norms=torch.tensor([1e30])).norms  # fp64, unclipped
        for w in weights:
            c = exact.float() * w
            model = pdpfast.nn.convert(_copy(reference).half())
            result = clipped_gradients(model, lambda out: (out.float() * coef).flatten(1).sum(1), x,
                                       clip_norms=c, **style)
            norm = float(torch.sqrt(sum(v.double().pow(2).sum() for v in result.grads.values())))
            worst = max(worst, norm / float(c))
    return worst


def _copy(module):
    import copy
    return copy.deepcopy(module)


@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
@pytest.mark.parametrize("case", list(CASES))
def test_fp16_record_with_subnormal_clip_weight_stays_within_bound(case, style):
    worst = _worst_ratio(case, style, [3e-5, 1e-5, 3e-6, 1e-6, 3e-7, 1e-7])
    assert worst <= 1.0
    assert worst > 0.2  # not vacuous: the record still contributes


def _cancelling_ratio(v, eps, c, style):
    """A record of two positions on input 1 with o = v, -(1 - eps)·v: ‖g‖ = eps·v, and each scaled
    w·o_t of the clipped sum lies in fp16's subnormal range for these bounds."""
    layer = nn.Linear(1, 1, bias=False)
    nn.init.ones_(layer.weight)
    model = pdpfast.nn.convert(layer.half())
    coef = torch.tensor([[v, -v * (1 - eps)]])
    result = clipped_gradients(model, lambda out: (out.float().reshape(1, -1) * coef).sum(1),
                               torch.ones(1, 2, 1, dtype=torch.float16), clip_norms=torch.tensor([c]), **style)
    return float(torch.sqrt(sum(g.double().pow(2).sum() for g in result.grads.values()))) / c


@pytest.mark.xfail(strict=True, reason="known gap (README, Mixed precision): the scaled terms' absolute rounding "
                                       "in fp16's subnormal range is not bounded; a bound for every term cost "
                                       "ordinary fp16 records a quarter of their bound at GPT-2's sizes")
@pytest.mark.parametrize("style", STYLES, ids=STYLE_IDS)
def test_fp16_cancelling_record_with_subnormal_scaled_terms_stays_within_bound(style, monkeypatch):
    """Each scaled w·o_t stored in fp16 is within u·|w·o_t| + 2⁻²⁵; on a record whose terms cancel the
    absolute part dwarfs the sum (1.6× c_i measured). On the clipped sum's GEMM route."""
    monkeypatch.setattr(pdpfast.ops.linear, "prefer_per_sample", lambda *args, **kwargs: False)
    worst = 0.0
    for eps in (2.0 ** -4, 2.0 ** -6):
        for v in (1.0, 3.0, 17.0, 100.0):
            for w in torch.logspace(-7.2, -4.5, 25).tolist():
                worst = max(worst, _cancelling_ratio(v, eps, eps * v * w, style))
    assert worst <= 1.0
