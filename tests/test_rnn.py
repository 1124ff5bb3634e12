"""``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU`` (``pdpfast.nn.DPRNN`` etc.) against the float64 oracle.

The parameter grid follows Opacus's DP RNN tests: mode, layers, bidirectional, bias, an initial
state, dropout 0; the private forward equals torch's; sequence-first and projections are refused.
"""
from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

import pdpfast

B, T, D, H = 3, 4, 5, 6
KINDS = {"rnn-tanh": (nn.RNN, {}), "rnn-relu": (nn.RNN, dict(nonlinearity="relu")), "lstm": (nn.LSTM, {}),
         "gru": (nn.GRU, {})}
GRID = [(kind, layers, bidirectional, bias, with_state)
        for kind, (layers, bidirectional), bias, with_state in itertools.product(
            KINDS, [(1, False), (2, True)], [True, False], [False, True])
        if bias or not with_state]


class Recurrent(nn.Module):
    def __init__(self, kind, layers, bidirectional, bias):
        super().__init__()
        cls, options = KINDS[kind]
        self.rnn = cls(D, H, num_layers=layers, bidirectional=bidirectional, bias=bias, batch_first=True, **options)
        self.lstm = cls is nn.LSTM
        self.head = nn.Linear(H * (2 if bidirectional else 1), 3)

    def forward(self, x, h0=None):
        state = None if h0 is None else ((h0, torch.tanh(h0)) if self.lstm else h0)
        out, _ = self.rnn(x, state)
        return self.head(out[:, -1] + out.mean(1))


def ce_loss(logits, labels):
    return nn.functional.cross_entropy(logits, labels, reduction="none")


def case(kind, layers, bidirectional, bias, with_state):
    torch.manual_seed(4)
    reference = Recurrent(kind, layers, bidirectional, bias).double()
    model = pdpfast.nn.convert(copy.deepcopy(reference))
    inputs = (torch.randn(B, T, D, dtype=torch.float64),)
    if with_state:  # h0 is (layers·dirs, B, H): batch in dim 1, so it enters as a model input (B, ...)
        inputs += (torch.randn(B, layers * (2 if bidirectional else 1), H, dtype=torch.float64),)
    return reference, model, inputs


class StateFirst(nn.Module):
    """Feeds h0 given per sample (B, L·dirs, H) to the layer as (L·dirs, B, H)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, h0=None):
        return self.inner(x, None if h0 is None else h0.transpose(0, 1).contiguous())


@pytest.mark.parametrize("kind,layers,bidirectional,bias,with_state", GRID,
                         ids=[f"{k}-l{n}-{'bi' if b else 'uni'}-{'bias' if bb else 'nobias'}"
                              f"{'-h0' if s else ''}" for k, n, b, bb, s in GRID])
def test_recurrent_layer_matches_oracle(kind, layers, bidirectional, bias, with_state, style, oracle):
    reference, model, inputs = case(kind, layers, bidirectional, bias, with_state)
    reference, model = StateFirst(reference), StateFirst(model)
    result, _ = oracle.check(model, ce_loss, inputs, (torch.randint(0, 3, (B,)),), reference=reference,
                             method="loop", **style)
    assert "inner.rnn.weight_hh_l0" in result.grads


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("steps,frozen", [(1, False), (3, True)], ids=["T1", "recurrent-frozen"])
def test_calls_of_one_recurrent_layer_are_clipped_together_when_none_repeats(kind, steps, frozen, style, oracle):
    """A recurrent layer is one clipping group whose projections are separate calls. With one time
    step, or frozen recurrent weights, no parameter is used twice, yet per-layer clipping must clip
    the group's sum over the calls (clipped one by one, a record contributed up to √calls · c_i)."""
    reference, model, inputs = case(kind, 2, True, True, True)
    inputs = (inputs[0][:, :steps].contiguous(), inputs[1])
    for net in (reference, model):
        for name, p in net.rnn.named_parameters():
            p.requires_grad_(not (frozen and "_hh_" in name))
    reference, model = StateFirst(reference), StateFirst(model)
    result, _ = oracle.check(model, ce_loss, inputs, (torch.randint(0, 3, (B,)),), reference=reference,
                             method="loop", **style)
    assert ("inner.rnn.weight_hh_l0" in result.grads) is not frozen


@pytest.mark.parametrize("kind", list(KINDS))
def test_one_sample_and_no_sample(kind, style, oracle):
    """B = 1 against the oracle (two bidirectional layers from an initial state), and B = 0."""
    reference, model, inputs = case(kind, 2, True, True, True)
    reference, model = StateFirst(reference), StateFirst(model)
    targets = (torch.randint(0, 3, (B,)),)
    oracle.check_one(model, ce_loss, inputs, targets, reference=reference, method="loop", clipped=True, **style)
    oracle.check_empty(model, ce_loss, inputs, targets, **style)


@pytest.mark.parametrize("kind", list(KINDS))
def test_private_forward_equals_torch(kind):
    reference, model, inputs = case(kind, 2, True, True, False)
    labels = torch.randint(0, 3, (B,))
    seen = []

    def capture(out):
        seen.append(out.detach())
        return ce_loss(out, labels)

    pdpfast.functional.clipped_gradients(model, capture, *inputs, clip_norms=torch.ones(B))
    with torch.no_grad():
        torch.testing.assert_close(seen[0], reference(*inputs), rtol=1e-12, atol=1e-12)


def test_sequence_first_and_projections_are_refused():
    with pytest.raises(ValueError, match="proj_size"):
        pdpfast.nn.convert(nn.Sequential(nn.LSTM(D, H, proj_size=2, batch_first=True)))
    model = pdpfast.nn.convert(nn.Sequential(nn.GRU(D, H)))
    with pytest.raises(ValueError, match="batch_first=False"):
        pdpfast.clipping.ClippingState(model)


def test_packed_sequences_are_refused_in_a_private_batch():
    model = pdpfast.nn.convert(nn.LSTM(D, H, batch_first=True).double())
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(B, T, D, dtype=torch.float64), [4, 3, 2],
                                               batch_first=True)
    state = pdpfast.clipping.ClippingState(model)
    with state.attached():
        state.begin_batch(torch.ones(B))
        with pytest.raises(ValueError, match="PackedSequence"):
            model(packed)
