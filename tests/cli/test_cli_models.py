"""The models `pdpfast train` offers: convert works on each, and one private step trains each."""
import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

import pdpfast
from pdpfast import models
from pdpfast.train import Task, private_engine, private_steps


def _one_private_step(model, inputs, labels, task, mode="bk"):
    n = inputs.shape[0]
    budgets = np.r_[np.full(n // 2, 1.0), np.full(n - n // 2, 4.0)]
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    engine, model, optimizer, loader, criterion = private_engine(
        "hybrid", model, optimizer, TensorDataset(inputs, labels), budgets, delta=1e-5, steps=1, sample_rate=0.5,
        batch_size=n // 2, task=task, mode=mode, seed=0)
    private_steps(engine, model, optimizer, loader, task, criterion, until=1)
    assert engine.steps == 1
    assert np.all(engine.epsilons() <= budgets) and np.all(engine.epsilons() > 0)
    changed = [not torch.equal(a, b) for a, b in zip(before, model.parameters())]
    assert all(changed)                                   # every trainable parameter got noise + clipped grads
    engine.detach()
    return model


@pytest.mark.parametrize("builder", [lambda: models.resnet18_gn(), lambda: models.bert("micro"),
                                     lambda: models.gpt2("micro"), lambda: models.bert("tiny"),
                                     lambda: models.vit("tiny")],
                         ids=["resnet18-gn", "bert-micro", "gpt2-micro", "bert-tiny", "vit-tiny"])
def test_convert_keeps_every_parameter_of_each_model(builder):
    model = builder()
    params = dict(model.named_parameters())
    pdpfast.nn.convert(model)
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(p is params[n] for n, p in model.named_parameters())


def test_one_private_step_resnet18_gn():
    model = models.resnet18_gn(num_classes=4)
    _one_private_step(model, torch.randn(6, 3, 16, 16), torch.randint(0, 4, (6,)), Task())


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_one_private_step_bert_micro(mode):
    model = models.bert("micro", num_labels=3)
    ids = torch.randint(1, model.config.vocab_size, (8, 10))
    _one_private_step(model, ids, torch.randint(0, 3, (8,)), Task("classification", "bert"), mode)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_one_private_step_gpt2_micro(mode):
    model = models.gpt2("micro")
    ids = torch.randint(0, model.config.vocab_size, (8, 10))
    _one_private_step(model, ids, torch.zeros(8, dtype=torch.long), Task("lm", "gpt2"), mode)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_one_private_step_vit_micro(mode):
    """cls_token and position embeddings are trained privately too (they live outside any layer)."""
    model = models.build_model("vit-micro", input_shape=(1, 8, 8), num_classes=3, input_kind="image")
    _one_private_step(model, torch.randn(8, 1, 8, 8), torch.randint(0, 3, (8,)), Task.for_model("vit-micro"), mode)


def test_registry_builds_each_model_for_its_inputs():
    assert set(models.model_names()) >= {"mlp", "cnn", "resnet18-gn", "bert-tiny", "bert-base", "gpt2"}
    mlp = models.build_model("mlp", input_shape=(64,), num_classes=10, hidden=[32, 16])
    assert mlp(torch.randn(2, 64)).shape == (2, 10)
    cnn = models.build_model("cnn", input_shape=(1, 8, 8), num_classes=10, input_kind="image", width=8)
    assert cnn(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    grey = models.build_model("resnet18-gn", input_shape=(1, 16, 16), num_classes=5, input_kind="image")
    assert grey(torch.randn(2, 1, 16, 16)).shape == (2, 5)
    bert = models.build_model("bert-micro", input_shape=(12,), num_classes=2, vocab_size=100, input_kind="tokens")
    assert bert(torch.randint(0, 100, (2, 12))).logits.shape == (2, 2)
    vit = models.build_model("vit-tiny", input_shape=(3, 16, 16), num_classes=4, input_kind="image")
    assert vit(torch.randn(2, 3, 16, 16)).logits.shape == (2, 4)
    with pytest.raises(ValueError, match="square"):
        models.build_model("vit-micro", input_shape=(3, 8, 12), input_kind="image")
    with pytest.raises(ValueError, match="unknown model"):
        models.build_model("vgg", input_shape=(3,))
    with pytest.raises(ValueError, match="image"):
        models.build_model("cnn", input_shape=(64,), input_kind="features")
    with pytest.raises(ValueError, match="vocabulary"):
        models.build_model("bert-micro", input_shape=(12,), vocab_size=1000, input_kind="tokens")
    with pytest.raises(ValueError, match="positions"):
        models.build_model("gpt2-micro", input_shape=(65,), vocab_size=100, input_kind="tokens")


def test_readme_bert_example_spends_within_budgets(tmp_path):
    """The README's Hugging Face loop (loss from ``labels=``, mean reduction), at micro size."""
    from torch.utils.data import DataLoader

    n, seq, epochs = 48, 8, 2
    model = models.bert("micro", num_labels=2)
    ids = torch.randint(1, model.config.vocab_size, (n, seq))
    mask, labels = torch.ones(n, seq, dtype=torch.long), torch.randint(0, 2, (n,))
    budgets = np.random.default_rng(0).choice([1.0, 3.0, 8.0], size=n)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
    engine = pdpfast.PrivacyEngine(seed=0)
    model, optimizer, loader = engine.make_private_with_budgets(
        module=model, optimizer=optimizer, data_loader=DataLoader(TensorDataset(ids, mask, labels), batch_size=8),
        budgets=budgets, delta=1e-5, epochs=epochs, method="hybrid")
    for _ in range(epochs):
        for x, m, y in loader:
            model(input_ids=x, attention_mask=m, labels=y).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    spent = engine.epsilons()
    assert engine.steps == engine.plan.steps and np.all(spent <= budgets) and np.all(spent >= 0.9 * budgets)
    engine.save_checkpoint(tmp_path / "bert.pt", model)
    assert (tmp_path / "bert.pt").stat().st_size > 0
