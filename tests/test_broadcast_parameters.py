"""Parameters outside layers (``pdpfast.nn.broadcast``): class tokens, position embeddings, layer scale.

Exact against the float64 oracle in every clipping style on a timm-style vision transformer whose
top-level module holds ``cls_token`` and ``pos_embed`` (registered by the user) and uses a layer
scale; refusals name the module and what to do. Hugging Face ViT, DeiT and DINOv2 are in
``test_models.py``.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pdpfast
from pdpfast.clipping import ClippingState

B = 5


class LayerScale(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.gamma = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.gamma


class TinyViT(nn.Module):
    """Patchify conv, class token, position embedding, one pre-norm block with layer scale, head."""

    def __init__(self, d=8, patches=4, classes=3):
        super().__init__()
        self.patch = nn.Conv2d(3, d, kernel_size=4, stride=4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d))
        self.pos_embed = nn.Parameter(torch.randn(1, patches + 1, d))
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.scale = LayerScale(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = x + self.scale(self.fc(self.norm(x)).tanh())
        return self.head(x[:, 0])


pdpfast.nn.register_broadcast_host(TinyViT, "cls_token", "pos_embed")
pdpfast.nn.register_module(LayerScale, pdpfast.nn.DPLayerScale)


def ce_loss(outputs, labels):
    return nn.functional.cross_entropy(outputs, labels, reduction="none")


def case(batch=B):
    reference = TinyViT().double()
    model = pdpfast.nn.convert(copy.deepcopy(reference))
    x = torch.randn(batch, 3, 8, 8, dtype=torch.float64)
    return model, reference, (x,), (torch.randint(0, 3, (batch,)),)


def test_class_token_position_embedding_and_layer_scale_match_oracle(style, oracle):
    model, reference, inputs, targets = case()
    assert isinstance(model, pdpfast.nn.DPBroadcastHost) and isinstance(model.scale, pdpfast.nn.DPLayerScale)
    result, _ = oracle.check(model, ce_loss, inputs, targets, reference=reference, **style)
    assert {"cls_token", "pos_embed", "scale.gamma"} <= set(result.grads)


def test_host_parameters_form_one_clipping_group(oracle):
    model, *_ = case()
    state = ClippingState(model, clipping="per_layer")
    assert state.group_names == [g.name for g in oracle.groups(model)]
    assert "<model>" in state.group_names  # cls_token and pos_embed, clipped together


def test_batch_of_one(style, oracle):
    model, reference, inputs, targets = case(batch=1)
    oracle.check(model, ce_loss, inputs, targets, reference=reference, mask=None, **style)


def test_empty_batch(style, oracle):
    model, _, inputs, targets = case(batch=0)
    result = oracle.run(model, ce_loss, inputs, targets, clip_norms=torch.ones(0), **style)
    assert result.norms.shape == (0,)
    for name in ("cls_token", "pos_embed", "scale.gamma"):
        assert not result.grads[name].any()


def test_frozen_broadcast_parameter_is_left_alone(oracle):
    model, reference, inputs, targets = case()
    for m in (model, reference):
        m.pos_embed.requires_grad_(False)
    result, _ = oracle.check(model, ce_loss, inputs, targets, reference=reference)
    assert "pos_embed" not in result.grads and "cls_token" in result.grads


def test_outside_a_private_batch_the_host_is_the_original_module():
    model, reference, inputs, _ = case()
    with torch.no_grad():
        torch.testing.assert_close(model(*inputs), reference(*inputs), rtol=0, atol=0)


class Unregistered(nn.Module):
    def __init__(self):
        super().__init__()
        self.token = nn.Parameter(torch.zeros(1, 1, 4))

    def forward(self, x):
        return x + self.token


def test_unregistered_parameter_outside_layers_is_refused_by_name():
    model = nn.Sequential(nn.Linear(4, 4), Unregistered())
    with pytest.raises(ValueError, match=r"1 \(Unregistered: token\)"):
        pdpfast.nn.convert(model)


class TwoTokens(nn.Module):
    def __init__(self, shape=(1, 1, 4)):
        super().__init__()
        self.token = nn.Parameter(torch.zeros(*shape))
        self.other = nn.Parameter(torch.zeros(1, 1, 4))

    def forward(self, x):
        return x + self.token + self.other


def test_host_with_an_unregistered_trainable_parameter_is_refused():
    pdpfast.nn.register_broadcast_host(TwoTokens, "token")
    with pytest.raises(ValueError, match="other are not registered as batch-broadcast"):
        pdpfast.nn.convert(nn.Sequential(nn.Linear(4, 4), TwoTokens()))


def test_broadcast_parameter_without_a_leading_one_is_refused():
    pdpfast.nn.register_broadcast_host(TwoTokens, "token", "other")
    with pytest.raises(ValueError, match=r"leading dim of size 1; got token \(4, 4\)"):
        pdpfast.nn.convert(nn.Sequential(nn.Linear(4, 4), TwoTokens(shape=(4, 4))))


class NotAligned(nn.Module):
    """Reshapes its (1, d) token to (d,): not batch-aligned. (Registration is a promise: a forward that
    indexes ``token[0]`` would run and be wrong, which is why hosts are never inferred.)"""

    def __init__(self):
        super().__init__()
        self.token = nn.Parameter(torch.randn(1, 3))

    def forward(self, x):
        return x + self.token.reshape(3)


def test_a_host_that_is_not_batch_aligned_fails_loudly():
    pdpfast.nn.register_broadcast_host(NotAligned, "token")
    model = pdpfast.nn.convert(nn.Sequential(nn.Linear(3, 3), NotAligned()).double())
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"1 \(.*NotAligned\) failed in a private forward.*not batch-aligned"):
        pdpfast.functional.clipped_gradients(model, lambda out: out.pow(2).sum(1), x, clip_norms=torch.ones(4))


def test_register_broadcast_host_checks_its_arguments():
    with pytest.raises(TypeError, match="module_class"):
        pdpfast.nn.register_broadcast_host(3, "token")
    with pytest.raises(TypeError, match="names of the batch-broadcast parameters"):
        pdpfast.nn.register_broadcast_host(TwoTokens)


def test_register_broadcast_host_refuses_names_that_are_not_parameter_names():
    with pytest.raises(ValueError, match=r"names must be parameter names.*'embeddings.cls_token'"):
        pdpfast.nn.register_broadcast_host(TwoTokens, "embeddings.cls_token")
    with pytest.raises(ValueError, match="names are given more than once"):
        pdpfast.nn.register_broadcast_host(TwoTokens, "token", "token")


class PReLUHost(nn.PReLU):
    pass


def test_a_host_registered_with_a_name_it_does_not_have_is_refused_by_name():
    """Only an instance tells whether a name is the host's; convert refuses a name it lacks entirely
    (a name set to None, like ViT's unused mask token, is fine)."""
    pdpfast.nn.register_broadcast_host(PReLUHost, "nonexistent_attr")
    with pytest.raises(ValueError, match=r"0 \(PReLUHost: registered batch-broadcast names nonexistent_attr "
                                         r"are not attributes"):
        pdpfast.nn.convert(nn.Sequential(PReLUHost(3)))


class TokenAndUnusedMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.token = nn.Parameter(torch.zeros(1, 1, 4))
        self.mask_token = None  # as ViT's without use_mask_token

    def forward(self, x):
        return x + self.token


def test_a_registered_name_set_to_none_is_accepted():
    pdpfast.nn.register_broadcast_host(TokenAndUnusedMask, "token", "mask_token")
    model = pdpfast.nn.convert(nn.Sequential(nn.Linear(4, 4), TokenAndUnusedMask()))
    ClippingState(model)
