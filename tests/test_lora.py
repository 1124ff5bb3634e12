"""LoRA / PEFT: DP fine-tuning of a frozen base with ``peft`` adapters, exact against the oracle.

The adapters are ordinary ``nn.Linear`` layers inside peft's LoRA wrappers, so ``convert`` makes
them DP layers; the frozen base layers run their plain forward (no per-sample work at all).
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pdpfast
from pdpfast.clipping import ClippingState

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

B, T, VOCAB = 5, 7, 40


class Logits(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


def ce_loss(logits, labels):
    return nn.functional.cross_entropy(logits, labels, reduction="none")


def lm_loss(logits, ids):
    per_token = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    return per_token.view(ids.shape[0], -1).mean(1)


def _adapt(model, **lora):
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **lora))
    with torch.no_grad():  # peft starts B at zero; give the adapters a real gradient path
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    return adapted


def bert_lora():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                     attn_implementation="eager")
    model = _adapt(transformers.BertForSequenceClassification(config), target_modules=["query", "value"],
                   modules_to_save=["classifier"])
    return Logits(model), torch.randint(0, 3, (B,)), ce_loss


def gpt2_lora():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    model = _adapt(transformers.GPT2LMHeadModel(config), target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
    return Logits(model), None, lm_loss


CASES = {"bert": bert_lora, "gpt2": gpt2_lora}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    torch.manual_seed(7)
    reference, labels, loss = CASES[request.param]()
    reference = reference.double().train()
    ids = torch.randint(1, VOCAB, (B, T))
    targets = (labels if labels is not None else ids,)
    return reference, pdpfast.nn.convert(copy.deepcopy(reference)), (ids,), targets, loss


def test_lora_adapters_match_oracle(case, style, oracle):
    reference, model, inputs, targets, loss = case
    result, _ = oracle.check(model, loss, inputs, targets, reference=reference, method="loop", **style)
    assert result.grads and all("lora_" in n or "modules_to_save" in n for n in result.grads)


def test_lora_adapters_match_oracle_for_one_sample(case, style, oracle):
    """(Hugging Face models cannot run an empty batch; B = 0 is tested on the small models.)"""
    reference, model, inputs, targets, loss = case
    oracle.check_one(model, loss, inputs, targets, reference=reference, method="loop", clipped=True, **style)


def test_only_the_adapters_are_clipping_groups(case):
    _, model, *_ = case
    state = ClippingState(model, clipping="per_layer")
    assert state.group_names and all("lora_" in n or "modules_to_save" in n for n in state.group_names)


def test_frozen_base_layers_do_no_per_sample_work(case, monkeypatch):
    """Only adapter layers (and the trainable head) reach the clipping state's backward."""
    _, model, inputs, targets, loss = case
    seen = []
    original = ClippingState.on_backward

    def spy(self, call, x, o):
        seen.append(call[0].name)
        return original(self, call, x, o)

    monkeypatch.setattr(ClippingState, "on_backward", spy)
    pdpfast.functional.clipped_gradients(model, lambda out: loss(out, *targets), *inputs, clip_norms=torch.ones(B))
    assert seen and all("lora_" in n or "modules_to_save" in n for n in seen)
