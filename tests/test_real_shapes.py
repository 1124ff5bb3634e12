"""Every clipping mode against the float64 oracle at the widths of the models pdpfast is measured
on: one block of BERT-base, of GPT-2 small and of ResNet-18-GN's last stage, each at its real
width (768 features, 12 heads, 3,072 hidden; 512 channels) with a short sequence or a small
feature map so that the oracle's per-sample gradients (micro-batching) stay cheap on a CPU.

Routes depend on sizes: the Gram or direct norm by the layers' widths, stacked or separate calls
and per-sample gradients formed or not by the calls' bytes. At these widths the norms take the
full models' paths. The short inputs would still stack some calls and form some gradients, so each
case also runs on the route of a full-size call (``full-size-calls``: every call on its own,
nothing formed, as ``bench_overhead --route large`` does).
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pdpfast
from pdpfast.models import BasicBlock

B = 3


def ce_loss(logits, labels):
    if not isinstance(logits, torch.Tensor):  # a Hugging Face model's output
        logits = logits.logits
    return nn.functional.cross_entropy(logits, labels, reduction="none")


def bert_base_block():
    from pdpfast.models import bert

    model = bert("base", num_hidden_layers=1, vocab_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0, attn_implementation="eager")
    return model, (torch.randint(0, 64, (B, 16)),), (torch.randint(0, 2, (B,)),), ce_loss


def gpt2_small_block():
    from pdpfast.models import gpt2

    model = gpt2("small", n_layer=1, vocab_size=64, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                 attn_implementation="eager")
    ids = torch.randint(0, 64, (B, 16))

    def lm_loss(outputs, ids):  # next-token loss per sample, over the tied embedding and head
        per_token = ce_loss(outputs.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        return per_token.view(ids.shape[0], -1).mean(1)
    return model, (ids,), (ids,), lm_loss


def resnet18_last_stage():
    model = nn.Sequential(BasicBlock(256, 512, stride=2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10))
    return model, (torch.randn(B, 256, 4, 4),), (torch.randint(0, 10, (B,)),), ce_loss


CASES = {"bert-base-block": bert_base_block, "gpt2-small-block": gpt2_small_block,
         "resnet18-gn-last-stage": resnet18_last_stage}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    pytest.importorskip("transformers")
    torch.manual_seed(11)
    reference, inputs, targets, loss = CASES[request.param]()
    reference = reference.double().train()
    inputs = tuple(t.double() if t.is_floating_point() else t for t in inputs)
    return reference, pdpfast.nn.convert(copy.deepcopy(reference)), inputs, targets, loss


@pytest.mark.parametrize("route", ["by-size", "full-size-calls"])
def test_full_width_block_matches_oracle(case, route, style, oracle, request):
    if route == "full-size-calls":
        request.getfixturevalue("full_size_calls")
    reference, model, inputs, targets, loss = case
    oracle.check(model, loss, inputs, targets, reference=reference, method="loop", **style)
