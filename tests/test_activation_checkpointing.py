"""Activation checkpointing inside a private batch (``torch.utils.checkpoint``), against the float64
oracle; Hugging Face's ``gradient_checkpointing_enable()`` is in ``test_models.py``.

torch's non-reentrant checkpoint (``use_reentrant=False``) replays a block's forward inside the
backward to refill the saved tensors of the graph the forward built: the clipped sums are the
oracle's in every clipping style, and the replay counts no second use of the block's parameters
(which would form their per-sample gradients). A reentrant checkpoint (``use_reentrant=True``)
records its block only inside the backward, after other layers were clipped without it: refused.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import pdpfast
from pdpfast.clipping import ClippingState
from pdpfast.functional import clipped_gradients

B = 5


class Scale(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.gamma = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.gamma


pdpfast.nn.register_module(Scale, pdpfast.nn.DPLayerScale)


class Blocks(nn.Module):
    """A sequence model whose block holds a Linear it shares with the tail, a GRU (partial calls),
    a LayerNorm and a layer scale (a broadcast host). ``where`` runs under a checkpoint: "block", "tail"
    (the last layers), "all" (the whole forward, whose input needs no gradient) or None."""

    def __init__(self, d_in=3, d=6, classes=3):
        super().__init__()
        self.embed = nn.Linear(d_in, d)
        self.shared = nn.Linear(d, d)
        self.gru = nn.GRU(d, d, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.scale = Scale(d)
        self.head = nn.Linear(d, classes)
        self.where, self.use_reentrant = None, False

    def block(self, h):
        h, _ = self.gru(torch.tanh(self.shared(h)))
        return self.scale(self.norm(h))

    def tail(self, h):  # ends in an op that saves its output: the backward replays the tail before any layer reports
        return torch.tanh(self.head(torch.tanh(self.shared(h)).mean(1)))

    def _run(self, where, fn, h):
        return checkpoint(fn, h, use_reentrant=self.use_reentrant) if self.where == where else fn(h)

    def _forward(self, x):
        return self._run("tail", self.tail, self._run("block", self.block, self.embed(x)))

    def forward(self, x):
        return self._run("all", self._forward, x)


def ce_loss(outputs, labels):
    return nn.functional.cross_entropy(outputs, labels, reduction="none")


def case(where, use_reentrant=False):
    """(model converted and checkpointed at ``where``, its plain float64 reference, inputs, targets)."""
    reference = Blocks().double()
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0, 0.5)
    model = pdpfast.nn.convert(copy.deepcopy(reference))
    model.where, model.use_reentrant = where, use_reentrant
    return model, reference, (torch.randn(B, 4, 3, dtype=torch.float64),), (torch.randint(0, 3, (B,)),)


@pytest.mark.parametrize("where", ["block", "tail", "all"])
def test_activation_checkpointing_gives_the_same_clipped_sums_as_the_oracle(where, style, oracle):
    """Before: exact with book-keeping and per-layer clipping, and refused with ghost clipping, whose
    first backward saw the replay as a second forward into the batch ("already computed")."""
    model, reference, inputs, targets = case(where)
    oracle.check(model, ce_loss, inputs, targets, reference=reference, method="loop", **style)


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_checkpointing_forms_no_per_sample_gradients_that_the_same_model_without_it_does_not(clipping, monkeypatch):
    """The replay is not counted as a second use of the block's parameters. Before, every parameter of a
    checkpointed block looked reused under book-keeping, and had its B × |θ| per-sample gradient formed
    (every layer of a checkpointed Hugging Face GPT-2 or BERT): what checkpointing is used to save."""
    formed = []
    materialize = ClippingState._materialize

    def spy(self, layer, names, *args, **kwargs):
        formed.append((layer.name, names))
        return materialize(self, layer, names, *args, **kwargs)

    monkeypatch.setattr(ClippingState, "_materialize", spy)
    seen = {}
    for where in (None, "block"):
        model, reference, inputs, targets = case(where)
        formed.clear()
        clipped_gradients(model, lambda out: ce_loss(out, *targets), *inputs, clip_norms=torch.ones(B),
                          clipping=clipping)
        seen[where] = sorted(formed)
    assert seen["block"] == seen[None]


@pytest.mark.parametrize("where", ["block", "tail"])
@pytest.mark.parametrize("style", [dict(mode="bk"), dict(mode="ghost"), dict(clipping="per_layer")],
                         ids=["bk", "ghost", "per_layer"])
def test_reentrant_activation_checkpointing_is_refused_naming_use_reentrant_false(style, where):
    """A reentrant checkpoint runs its block under no_grad and records it only in the backward. Before,
    with a Linear used in the block and after it, a record's released contribution reached 1.15× its
    bound (flat: the two uses' norms added as if separate), and 1.41× with per-layer clipping of a Linear
    used twice in the block; with the block last, its nested backward closed the batch before the other
    layers reported ("a second backward")."""
    model, reference, inputs, targets = case(where, use_reentrant=True)
    with pytest.raises(RuntimeError, match=r"use_reentrant=True.*Pass use_reentrant=False"):
        clipped_gradients(model, lambda out: ce_loss(out, *targets), *inputs, clip_norms=torch.ones(B), **style)


def test_a_replayed_block_after_the_step_is_refused_as_a_backward_without_a_batch():
    """A backward through a checkpointed graph whose batch was stepped: the replay, the first thing that
    backward runs, says so (before: that a private forward needs an open batch, from the loader)."""
    model, reference, inputs, targets = case("all")
    state = ClippingState(model)
    with state.attached():
        state.begin_batch(torch.ones(B))
        loss = ce_loss(model(*inputs), *targets).sum()
        state.end_draw()
        with pytest.raises(RuntimeError, match="no open batch"):
            loss.backward()
