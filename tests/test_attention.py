"""``nn.MultiheadAttention`` (``pdpfast.nn.DPMultiheadAttention``) against the float64 oracle.

Self-attention (one packed projection), cross-attention with key = value and with three
different inputs (materialized per-sample gradients), masks of every kind, need_weights, bias on
or off, and ``nn.TransformerEncoderLayer`` built on it; Opacus's own test grid (embed dims,
heads, bias, kdim/vdim) drives the refusals.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pdpfast

B, T, S, E, H = 4, 5, 6, 8, 2


class SelfAttention(nn.Module):
    def __init__(self, bias=True, masks=None):
        super().__init__()
        self.attn = nn.MultiheadAttention(E, H, bias=bias, batch_first=True)
        self.head = nn.Linear(E, 3)
        self.masks = masks or {}

    def forward(self, x, key_padding_mask=None):
        out, weights = self.attn(x, x, x, key_padding_mask=key_padding_mask, **self.masks)
        if weights is not None:  # the returned weights are part of the function being differentiated
            out = out + weights.flatten(1)[:, :E].reshape(-1, 1, E)
        return self.head(out.mean(1))


class CrossAttention(nn.Module):
    def __init__(self, same_kv: bool):
        super().__init__()
        self.attn = nn.MultiheadAttention(E, H, batch_first=True)
        self.same_kv = same_kv
        self.head = nn.Linear(E, 3)

    def forward(self, q, kv):
        value = kv if self.same_kv else kv.flip(1) * 0.5
        out, _ = self.attn(q, kv, value, need_weights=False)
        return self.head(out.mean(1))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=12, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(E, 3)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
        return self.head(self.encoder(x, mask=mask, is_causal=True).mean(1))


def ce_loss(logits, labels):
    return nn.functional.cross_entropy(logits, labels, reduction="none")


def padding_mask(kind):
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, -2:] = True
    mask[2, -1] = True
    return mask if kind == "bool" else torch.zeros(B, T, dtype=torch.float64).masked_fill(mask, -1e4)


CASES = {
    "self": lambda: (SelfAttention(), (torch.randn(B, T, E),)),
    "self-no-bias": lambda: (SelfAttention(bias=False), (torch.randn(B, T, E),)),
    "self-padding-bool": lambda: (SelfAttention(), (torch.randn(B, T, E), padding_mask("bool"))),
    "self-padding-float-no-average": lambda: (SelfAttention(masks=dict(average_attn_weights=False)),
                                              (torch.randn(B, T, E), padding_mask("float"))),
    "self-causal": lambda: (SelfAttention(masks=dict(attn_mask=torch.ones(T, T, dtype=torch.bool).triu(1),
                                                     need_weights=False)), (torch.randn(B, T, E),)),
    "cross-same-kv": lambda: (CrossAttention(same_kv=True), (torch.randn(B, T, E), torch.randn(B, S, E))),
    "cross-three-inputs": lambda: (CrossAttention(same_kv=False), (torch.randn(B, T, E), torch.randn(B, S, E))),
    "encoder-layer": lambda: (Encoder(), (torch.randn(B, T, E),)),
}


def case(name):
    torch.manual_seed(3)
    reference, inputs = CASES[name]()
    reference = reference.double().train()
    inputs = tuple(t.double() if t.is_floating_point() else t for t in inputs)
    return reference, pdpfast.nn.convert(copy.deepcopy(reference)), inputs, (torch.randint(0, 3, (B,)),)


@pytest.mark.parametrize("name", list(CASES))
def test_multihead_attention_matches_oracle(name, style, oracle):
    reference, model, inputs, targets = case(name)
    assert any(isinstance(m, pdpfast.nn.DPMultiheadAttention) for m in model.modules())
    result, _ = oracle.check(model, ce_loss, inputs, targets, reference=reference, method="loop", **style)
    assert any("in_proj_weight" in n for n in result.grads)


@pytest.mark.parametrize("name", ["self-padding-bool", "cross-three-inputs", "encoder-layer"])
def test_private_forward_equals_torch(name):
    reference, model, inputs, targets = case(name)
    seen = []

    def capture(out):
        seen.append(out.detach())
        return ce_loss(out, *targets)

    pdpfast.functional.clipped_gradients(model, capture, *inputs, clip_norms=torch.ones(B))
    with torch.no_grad():
        torch.testing.assert_close(seen[0], reference(*inputs), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["self", "encoder-layer"])
def test_batch_of_one_and_empty_batch(name, style, oracle):
    reference, model, inputs, targets = case(name)
    oracle.check_one(model, ce_loss, inputs, targets, reference=reference, method="loop", clipped=True, **style)
    oracle.check_empty(model, ce_loss, inputs, targets, **style)


@pytest.mark.parametrize("options,message", [
    (dict(add_bias_kv=True), "add_bias_kv"),
    (dict(add_zero_attn=True), "add_zero_attn"),
    (dict(kdim=5, vdim=7), r"kdim/vdim .*kdim=5, vdim=7"),
])
def test_unsupported_options_are_refused_by_name(options, message):
    model = nn.Sequential(nn.MultiheadAttention(E, H, batch_first=True, **options))
    with pytest.raises(ValueError, match=message):
        pdpfast.nn.convert(model)


def test_sequence_first_attention_is_refused():
    model = pdpfast.nn.convert(nn.Sequential(nn.MultiheadAttention(E, H)))  # batch_first=False
    with pytest.raises(ValueError, match="batch_first=False"):
        pdpfast.clipping.ClippingState(model)


class DirectAttention(nn.Module):
    """Self-attention with the DP classes built directly, not by ``convert``."""

    def __init__(self):
        super().__init__()
        self.attn = pdpfast.nn.DPMultiheadAttention(E, H, batch_first=True)
        self.head = pdpfast.nn.DPLinear(E, 3)

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))


def test_a_dp_attention_built_directly_needs_convert_for_its_out_proj_and_then_equals_the_oracle(oracle):
    torch.manual_seed(3)
    model = DirectAttention().double()
    with pytest.raises(ValueError, match=r"call pdpfast.nn.convert\(model\) first. Modules: attn.out_proj"):
        pdpfast.clipping.ClippingState(model)
    reference = copy.deepcopy(model)
    pdpfast.nn.convert(model)
    assert isinstance(model.attn.out_proj, pdpfast.nn.DPLinear)
    inputs, targets = (torch.randn(B, T, E, dtype=torch.float64),), (torch.randint(0, 3, (B,)),)
    oracle.check(model, ce_loss, inputs, targets, reference=reference, method="loop")


def test_is_causal_without_attn_mask_is_refused_so_training_and_evaluation_compute_one_function():
    """torch reads ``is_causal`` only as a hint about ``attn_mask``: it refuses the hint alone in training,
    and its forward in eval / under no_grad ignores it and attends everywhere. A private forward that
    made its own causal mask would train another function than the one evaluated; it refuses instead,
    and with the causal mask passed it computes what the evaluated model computes."""
    torch.manual_seed(3)
    mask = nn.Transformer.generate_square_subsequent_mask(T, dtype=torch.float64)
    refused = pdpfast.nn.convert(SelfAttention(masks=dict(is_causal=True, need_weights=False)).double())
    masked = pdpfast.nn.convert(SelfAttention(masks=dict(is_causal=True, attn_mask=mask, need_weights=False)).double())
    masked.load_state_dict(refused.state_dict())
    x, labels = torch.randn(B, T, E, dtype=torch.float64), torch.randint(0, 3, (B,))
    with pytest.raises(ValueError, match=r"is_causal=True needs attn_mask .*generate_square_subsequent_mask"):
        pdpfast.functional.clipped_gradients(refused, lambda out: ce_loss(out, labels), x, clip_norms=torch.ones(B))
    seen = []

    def capture(out):
        seen.append(out.detach())
        return ce_loss(out, labels)

    pdpfast.functional.clipped_gradients(masked, capture, x, clip_norms=torch.ones(B))
    with torch.no_grad():
        torch.testing.assert_close(seen[0], masked.eval()(x), rtol=1e-12, atol=1e-12)
