"""A Hugging Face model's own loss over token labels inside a private batch.

``model(input_ids, labels=labels).loss`` of a language model (or a token classifier) is the mean over
every labelled token of the batch. pdpfast reads a loss as the mean over the rows of per-record losses
(``loss_reduction="mean"``), so each record's gradient would carry a factor set by the other records'
token counts: its clipped contribution no longer bounds what it changes in the noised sum. A backward
through such a loss is refused when the rows have different numbers of labelled tokens (labels on the
CPU), warned about once where they cannot be counted without stopping the host (a GPU), and exact when
every row has as many: then it is the mean of per-record means.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import pdpfast
from pdpfast import engine as engine_module

transformers = pytest.importorskip("transformers")
from pdpfast.integrations.transformers import default_per_sample_loss  # noqa: E402

N, T, V = 24, 8, 30


def _private(labels):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=V, n_positions=T, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    model.config._attn_implementation = "eager"
    ids = torch.randint(0, V, (N, T), generator=torch.Generator().manual_seed(1))
    engine = pdpfast.PrivacyEngine(seed=0)
    model, optimizer, loader = engine.make_private_with_budgets(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(ids, labels(ids)), batch_size=8), budgets=np.repeat([1.0, 4.0], N // 2),
        delta=1e-5, steps=3, method="hybrid")
    return engine, model, optimizer, loader


def _ragged(ids):
    """Record j has 2 + j % (T - 1) real tokens (the rest -100): rows of a batch differ."""
    length = 2 + torch.arange(N) % (T - 1)
    return torch.where(torch.arange(T) < length[:, None], ids, -100)


def _first_batch_of_several_rows(loader):
    for x, y in loader:
        if len(x) >= 2:
            return x, y
        raise AssertionError("the seeded draw changed: pick a seed whose first draw has rows")


def test_a_token_mean_loss_over_records_with_different_token_counts_is_refused_before_anything_is_clipped():
    engine, model, optimizer, loader = _private(_ragged)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _first_batch_of_several_rows(loader)
    with pytest.raises(RuntimeError, match=r"GPT2LMHeadModel's own loss .* mean over every labelled token of the "
                                           r"batch \(here \d+ to \d+ a record\).*default_per_sample_loss"):
        model(input_ids=x, labels=y).loss.backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert engine.steps == 0


def test_per_record_losses_from_the_same_forward_are_not_refused():
    engine, model, optimizer, loader = _private(_ragged)
    for x, y in loader:
        out = model(input_ids=x, labels=y)  # labels given out of habit; the loss is formed per record
        default_per_sample_loss(model)(out, y).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert engine.steps == 3 and np.all(engine.epsilons() <= np.repeat([1.0, 4.0], N // 2))


def test_a_token_mean_loss_over_records_with_as_many_tokens_is_the_mean_of_per_record_means():
    grads = []
    for own in (True, False):
        engine, model, optimizer, loader = _private(lambda ids: ids)
        x, y = _first_batch_of_several_rows(loader)
        out = model(input_ids=x, labels=y)
        (out.loss if own else default_per_sample_loss(model)(out, y).mean()).backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_where_labels_cannot_be_counted_on_the_host_a_token_mean_loss_is_warned_about_once(monkeypatch):
    monkeypatch.setattr(engine_module, "_COUNTED_ON_HOST", ())  # as labels on a GPU
    engine, model, optimizer, loader = _private(_ragged)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in loader:
            model(input_ids=x, labels=y).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    said = [str(w.message) for w in caught if "own loss" in str(w.message)]
    assert engine.steps == 3 and len(said) == 1
    assert said[0].startswith("GPT2LMHeadModel's own loss (its labels= argument) is the mean over every labelled "
                              "token of the batch: ")


def _private_mixture_of_experts(output_router_logits: bool):
    """A Mixtral of 4 experts, experts and router frozen (convert has no rule for their 3-D parameters,
    and says to freeze them), every row with as many labelled tokens."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=T, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=output_router_logits, router_aux_loss_coef=1.0, attn_implementation="eager",
        experts_implementation="eager")
    model = transformers.MixtralForCausalLM(config)
    for name, p in model.named_parameters():
        if ".experts." in name or ".gate." in name:
            p.requires_grad_(False)
    ids = torch.randint(0, V, (N, T), generator=torch.Generator().manual_seed(1))
    engine = pdpfast.PrivacyEngine(seed=0)
    model, optimizer, loader = engine.make_private_with_budgets(
        module=model, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
        data_loader=DataLoader(TensorDataset(ids, ids), batch_size=8), budgets=np.repeat([1.0, 4.0], N // 2),
        delta=1e-5, steps=3, method="hybrid")
    return engine, model, optimizer, loader


@pytest.mark.parametrize("own", [True, False], ids=["own-loss", "added-to-per-record-losses"])
def test_a_mixture_of_experts_load_balancing_loss_over_the_whole_batch_is_refused(own):
    """Its aux_loss is a statistic of the batch's routing: one record moves the others' gradients
    through it (the audit measured 3e-4 relative at Mixtral's default coefficient), though every row
    has as many labelled tokens. Refused whether the model's own loss adds it or the user does."""
    engine, model, optimizer, loader = _private_mixture_of_experts(output_router_logits=True)
    x, y = _first_batch_of_several_rows(loader)
    out = model(input_ids=x, labels=y)
    loss = out.loss if own else default_per_sample_loss(model)(out, y).mean() + 0.01 * out.aux_loss
    with pytest.raises(RuntimeError, match=r"MixtralForCausalLM's aux_loss is a statistic of the whole batch.*"
                                           r"output_router_logits=False"):
        loss.backward()
    assert all(p.grad is None for p in model.parameters()) and engine.steps == 0


def test_a_mixture_of_experts_trained_on_per_record_losses_is_not_refused():
    for output_router_logits in (True, False):  # computed and not used, or not computed
        engine, model, optimizer, loader = _private_mixture_of_experts(output_router_logits)
        for x, y in loader:
            out = model(input_ids=x, labels=y)
            (default_per_sample_loss(model)(out, y).mean() if output_router_logits else out.loss).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert engine.steps == 3 and np.all(engine.epsilons() <= np.repeat([1.0, 4.0], N // 2))
