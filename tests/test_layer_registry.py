"""``register_layer``: one call makes a new layer family convertible and exact against the oracle.

The family here is a layer pdpfast does not ship, an elementwise scale y = x ⊙ s with s (d,)
broadcast over the leading dims; its per-sample gradient is Σ over the sample's positions of x ⊙ o.
Nothing but the registration below tells pdpfast about it.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pdpfast.nn import DPModule, LayerRule, convert, register_layer, register_module, register_rule, rule_for
from pdpfast.nn.rules import registered_layers, rule_for_class

B = 5


class ElementwiseScale(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.scale


class DPElementwiseScale(DPModule, ElementwiseScale):
    def _compute(self, x, p):
        return x * p["scale"]


def _scale_per_sample(m, x, o):
    return {"scale": (x * o).reshape(x.shape[0], -1, x.shape[-1]).sum(1)}


SCALE_RULE = LayerRule(_scale_per_sample)
register_layer(ElementwiseScale, DPElementwiseScale, SCALE_RULE)


class ScaleByName(nn.Module):
    """Stands for a layer of an optional library: registered by its qualified name, its DP class
    not a subclass of it (as Hugging Face's Conv1D)."""

    def __init__(self, d: int):
        super().__init__()
        self.gain = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.gain


class DPScaleByName(DPModule):
    def _compute(self, x, p):
        return x * p["gain"]


register_layer(f"{ScaleByName.__module__}.{ScaleByName.__qualname__}", DPScaleByName,
               LayerRule(lambda m, x, o: {"gain": (x * o).reshape(x.shape[0], -1, x.shape[-1]).sum(1)}))


def sq_loss(outputs, target):
    return 0.5 * (outputs - target).pow(2).flatten(1).sum(1)


def _case(*layers, positions=3):
    reference = nn.Sequential(nn.Linear(4, 6), *layers, nn.Tanh(), nn.Linear(6, 3)).double()
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(B, positions, 4, dtype=torch.float64)
    with torch.no_grad():
        target = torch.randn_like(reference(x))
    return reference, x, target


def test_register_layer_alone_makes_convert_swap_and_clipping_exact(style, oracle):
    reference, x, target = _case(ElementwiseScale(6))
    model = convert(copy.deepcopy(reference))
    assert type(model[1]) is DPElementwiseScale and rule_for(model[1]) is SCALE_RULE
    oracle.check(model, sq_loss, (x,), (target,), reference=reference, **style)


def test_a_layer_registered_by_qualified_name_converts_and_is_exact(style, oracle):
    reference, x, target = _case(ScaleByName(6), positions=1)
    model = convert(copy.deepcopy(reference))
    assert isinstance(model[1], DPScaleByName) and isinstance(model[1], ScaleByName)  # the user's class kept
    oracle.check(model, sq_loss, (x,), (target,), reference=reference, **style)


def test_the_registered_rule_matches_micro_batched_per_sample_grads(oracle):
    """The toy rule itself, against the oracle's micro-batching (one backward per sample)."""
    reference, x, target = _case(ElementwiseScale(6))
    model = convert(copy.deepcopy(reference))
    by_loop = oracle.per_sample_grads(reference, sq_loss, (x,), (target,), method="loop")
    by_vmap = oracle.per_sample_grads(reference, sq_loss, (x,), (target,), method="vmap")
    oracle.assert_close(by_loop["1.scale"], by_vmap["1.scale"], "1.scale")
    oracle.check(model, sq_loss, (x,), (target,), reference=reference, method="loop")


def test_subclasses_of_a_registered_layer_follow_the_mro():
    class KeepsForward(ElementwiseScale):
        pass

    class OwnForward(ElementwiseScale):
        def forward(self, x):
            return 2 * x * self.scale

    model = convert(nn.Sequential(KeepsForward(3)))
    assert isinstance(model[0], DPElementwiseScale) and isinstance(model[0], KeepsForward)
    with pytest.raises(ValueError, match="OwnForward"):  # its math is unknown to the rule
        convert(nn.Sequential(OwnForward(3)))


def test_a_registration_after_a_lookup_is_seen():
    class Late(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.scale

    class DPLate(DPModule, Late):
        def _compute(self, x, p):
            return x * p["scale"]

    with pytest.raises(ValueError, match="no private version"):
        convert(nn.Sequential(Late()))
    # the two-call form that register_layer replaces still works, in either order
    register_module(Late, DPLate)
    register_rule(DPLate, rule=SCALE_RULE)
    assert isinstance(convert(nn.Sequential(Late()))[0], DPLate)


def test_a_dp_class_refuses_options_it_cannot_train_privately():
    class Flagged(ElementwiseScale):
        def __init__(self, d, leaky):
            super().__init__(d)
            self.leaky = leaky

    class DPFlagged(DPModule, Flagged):
        @classmethod
        def unsupported_options(cls, module):
            return "leaky=True is refused" if module.leaky else None

        def _compute(self, x, p):
            return x * p["scale"]

    register_layer(Flagged, DPFlagged, SCALE_RULE)
    model = nn.Sequential(Flagged(3, leaky=True), Flagged(3, leaky=False))
    with pytest.raises(ValueError, match=r"0 \(Flagged: leaky=True is refused\)"):
        convert(model)
    assert not any(isinstance(m, DPModule) for m in model.modules())  # nothing changed on error
    assert isinstance(convert(nn.Sequential(Flagged(3, leaky=False)))[0], DPFlagged)


def test_register_layer_refuses_what_would_be_silently_wrong():
    class Other(DPModule, ElementwiseScale):
        pass

    with pytest.raises(ValueError, match="already convert to another DP class"):
        register_layer(ElementwiseScale, Other, SCALE_RULE)
    with pytest.raises(ValueError, match="already convert to another DP class"):
        register_layer(nn.Linear, Other, SCALE_RULE)
    with pytest.raises(ValueError, match="has no rule"):
        register_layer(type("Unregistered", (nn.Module,), {}), Other)
    with pytest.raises(ValueError, match="already registered"):
        register_layer(type("Fresh", (nn.Module,), {}), DPElementwiseScale, LayerRule(_scale_per_sample))
    with pytest.raises(TypeError, match="DPModule"):
        register_layer(type("Fresh", (nn.Module,), {}), ElementwiseScale, SCALE_RULE)
    with pytest.raises(TypeError, match="nn.Module"):
        register_layer(int, DPElementwiseScale, SCALE_RULE)
    with pytest.raises(ValueError, match="qualified name"):
        register_layer("ElementwiseScale", DPElementwiseScale, SCALE_RULE)
    assert registered_layers()[ElementwiseScale] is DPElementwiseScale  # unchanged by the refusals
    register_layer(ElementwiseScale, DPElementwiseScale, SCALE_RULE)  # the same registration again is fine


def test_every_registered_layer_has_a_rule():
    layers = registered_layers()
    for torch_class in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding, nn.LayerNorm, nn.GroupNorm,
                        nn.RMSNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
                        "transformers.pytorch_utils.Conv1D"):
        assert torch_class in layers, torch_class
    for torch_class, dp_class in layers.items():
        assert issubclass(dp_class, DPModule), torch_class
        assert rule_for_class(dp_class) is not None, torch_class


def test_register_rule_refuses_what_is_not_a_dp_class_or_a_rule():
    """A later private step failed deep (AttributeError on None) after these were accepted."""
    with pytest.raises(TypeError, match="rule must be a pdpfast.nn.LayerRule, got None"):
        register_rule(DPElementwiseScale, rule=None, replace=True)
    with pytest.raises(TypeError, match="types must be subclasses of pdpfast.nn.DPModule.*ElementwiseScale"):
        register_rule(ElementwiseScale, rule=SCALE_RULE)
    with pytest.raises(TypeError, match="at least one DP class"):
        register_rule(rule=SCALE_RULE)
    assert rule_for_class(DPElementwiseScale) is SCALE_RULE  # nothing was replaced


def test_a_dp_module_built_directly_without_a_rule_is_refused_by_name():
    class DPNoRule(DPModule, ElementwiseScale):  # never registered
        def _compute(self, x, p):
            return x * p["scale"]

    from pdpfast.clipping import ClippingState

    model = nn.Sequential(DPNoRule(3))
    with pytest.raises(ValueError, match=r"0 \(DPNoRule: no per-sample rule is registered for DPNoRule"):
        ClippingState(model)
    with pytest.raises(ValueError, match="no per-sample rule"):
        convert(model)


def test_register_form_refuses_what_could_not_recognize_or_train_a_module():
    from pdpfast.nn import register_form
    from pdpfast.nn.rules import registered_forms

    class NoRecognizer(DPModule):
        pass

    class NoRule(DPModule):
        @classmethod
        def recognizes(cls, module):
            return False

    before = registered_forms()
    with pytest.raises(TypeError, match="dp_class must be a subclass of pdpfast.nn.DPModule"):
        register_form(nn.Linear)
    with pytest.raises(TypeError, match="NoRecognizer has no classmethod recognizes"):
        register_form(NoRecognizer)
    with pytest.raises(ValueError, match="NoRule has no rule"):
        register_form(NoRule)
    assert registered_forms() == before
