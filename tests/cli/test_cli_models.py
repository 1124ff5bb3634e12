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
                                     lambda: models.vit("tiny"), lambda: models.llama("micro")],
                         ids=["resnet18-gn", "bert-micro", "gpt2-micro", "bert-tiny", "vit-tiny", "llama-micro"])
def test_convert_keeps_every_parameter_of_each_model(builder):
    model = builder()
    params = dict(model.named_parameters())
    pdpfast.nn.convert(model)
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(p is params[n] for n, p in model.named_parameters())


def test_one_private_step_resnet18_gn():
    model = models.resnet18_gn(num_classes=4)
    _one_private_step(model, torch.randn(6, 3, 16, 16), torch.randint(0, 4, (6,)), Task())


def test_resnet_width_sets_every_stage_and_keeps_the_layers():
    narrow, full = models.resnet18_gn(num_classes=4, width=4), models.resnet18_gn(num_classes=4)
    assert [n for n, _ in narrow.named_modules()] == [n for n, _ in full.named_modules()]
    assert [narrow.conv1.out_channels, narrow.layer2[0].conv1.out_channels, narrow.layer4[1].conv2.out_channels,
            narrow.fc.in_features] == [4, 8, 32, 32]
    assert narrow(torch.randn(2, 3, 8, 8)).shape == (2, 4)
    _one_private_step(narrow, torch.randn(6, 3, 8, 8), torch.randint(0, 4, (6,)), Task())


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
def test_one_private_step_llama_micro(mode):
    model = models.llama("micro")
    assert Task.for_model("llama-micro") == Task("lm", "gpt2")  # token ids alone, as GPT-2's
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


# ---------------------------------------------------------------------------------------------- bad input
_INPUTS = {"mlp": ((4,), "features"), "bert-micro": ((8,), "tokens"), "gpt2-micro": ((8,), "tokens")}


def _build(name="mlp", **kwargs):
    shape, kind = _INPUTS.get(name, ((3, 8, 8), "image"))
    kwargs.setdefault("input_shape", shape)
    kwargs.setdefault("input_kind", kind)
    return models.build_model(name, **kwargs)


@pytest.mark.parametrize("hidden,error,match", [("64", TypeError, "hidden must be a sequence of ints"),
                                                (64, TypeError, "hidden must be a sequence of ints"),
                                                ((2.7,), ValueError, r"hidden\[0\] must be an int ≥ 1, got 2.7"),
                                                ((8, 0), ValueError, r"hidden\[1\] must be an int ≥ 1, got 0"),
                                                ((-5,), ValueError, r"hidden\[0\] must be an int ≥ 1")])
def test_mlp_widths_it_would_coerce_are_refused(hidden, error, match):
    """'64' used to build widths (6, 4), 2.7 a width of 2."""
    with pytest.raises(error, match=match):
        _build(hidden=hidden)


@pytest.mark.parametrize("num_classes", [2.7, "3", True, 0, 1, -3])
def test_a_classifier_needs_an_int_number_of_classes_of_at_least_two(num_classes):
    with pytest.raises(ValueError, match="num_classes must be an int ≥ 2"):
        _build(num_classes=num_classes)


def test_a_language_model_takes_one_class_since_it_reads_no_labels():
    assert _build("gpt2-micro", num_classes=1, vocab_size=100).config.vocab_size == 128


@pytest.mark.parametrize("builder,name", [(lambda: models.mlp(4, 0), "num_classes"),
                                          (lambda: models.mlp(0, 2), "in_features"),
                                          (lambda: models.cnn(3, 2, width=-1), "width"),
                                          (lambda: models.resnet18_gn(-1), "num_classes"),
                                          (lambda: models.resnet18_gn(width=0), "width"),
                                          (lambda: models.bert("micro", num_labels=0), "num_labels"),
                                          (lambda: models.vit("micro", image_size=0), "image_size")])
def test_the_builders_refuse_sizes_below_one_by_name(builder, name):
    with pytest.raises(ValueError, match=f"{name} must be an int ≥ 1"):
        builder()


@pytest.mark.parametrize("shape,error,match", [("4", TypeError, "input_shape must be a sequence of ints"),
                                               (4, TypeError, "input_shape must be a sequence of ints"),
                                               ((2.5,), ValueError, r"input_shape\[0\] must be an int ≥ 1"),
                                               ((0,), ValueError, r"input_shape\[0\] must be an int ≥ 1"),
                                               ((), ValueError, "input_shape is empty")])
def test_an_input_shape_that_is_not_positive_ints_is_refused(shape, error, match):
    with pytest.raises(error, match=match):
        _build(input_shape=shape)


@pytest.mark.parametrize("name,shape,match", [("resnet18-gn", (3,), r"3 entries \(C, H, W\)"),
                                              ("vit-micro", (3, 8), r"3 entries \(C, H, W\)"),
                                              ("cnn", (3, 8, 8, 2), r"3 entries \(C, H, W\)"),
                                              ("cnn", (0, 8, 8), r"input_shape\[0\] must be an int ≥ 1"),
                                              ("bert-micro", (4, 4), r"1 entry \(T,\)")])
def test_an_input_shape_of_the_wrong_length_for_its_kind_is_refused(name, shape, match):
    with pytest.raises(ValueError, match=match):
        _build(name, input_shape=shape)


@pytest.mark.parametrize("layers,error,match", [((0, 2, 2, 2), ValueError, r"layers\[0\] must be an int ≥ 1"),
                                                ((2, 2), ValueError, "layers must have 4 entries"),
                                                (2, TypeError, "layers must be a sequence of ints")])
def test_resnet_layers_must_be_four_positive_block_counts(layers, error, match):
    """(0, 2, 2, 2) used to build one block in the first stage."""
    with pytest.raises(error, match=match):
        _build("resnet18-gn", layers=layers)


@pytest.mark.parametrize("name,options,match", [
    ("mlp", dict(widht=3), "model 'mlp' has no option 'widht'"),
    ("cnn", dict(hidden=(3,)), "model 'cnn' has no option 'hidden'"),
    ("bert-micro", dict(hiden_size=8), "BertConfig has no field 'hiden_size'"),
    ("gpt2-micro", dict(n_embdd=8), "GPT2Config has no field 'n_embdd'")])
def test_an_option_the_model_does_not_read_is_refused_naming_it(name, options, match):
    """A misspelled Hugging Face field was kept by the config and the default model built."""
    with pytest.raises(ValueError, match=match):
        _build(name, **options)


@pytest.mark.parametrize("vocab_size", [0, -5, "200", 200.5])
def test_a_vocabulary_size_that_is_not_a_positive_int_is_refused(vocab_size):
    with pytest.raises(ValueError, match="vocab_size must be an int ≥ 1"):
        _build("bert-micro", vocab_size=vocab_size)


def test_a_vocabulary_size_is_accepted_by_models_that_do_not_read_it():
    """`pdpfast train` passes the data's vocab_size for every model; only token models compare it."""
    assert _build(vocab_size=10)(torch.randn(2, 4)).shape == (2, 2)


@pytest.mark.parametrize("input_kind", ["bogus", None])
def test_an_unknown_input_kind_names_the_argument_and_its_choices(input_kind):
    with pytest.raises(ValueError, match="input_kind must be one of 'features', 'image', 'tokens'"):
        _build(input_kind=input_kind)


@pytest.mark.parametrize("name", [["mlp"], None])
def test_a_model_name_that_is_not_a_string_is_refused(name):
    with pytest.raises(TypeError, match="model name must be a string"):
        models.model_spec(name)


@pytest.mark.parametrize("options,error,match", [(dict(inputs="features"), TypeError, "inputs must be a tuple"),
                                                 (dict(inputs=("text",)), ValueError, "inputs must be one of"),
                                                 (dict(inputs=("features",), task="regress"), ValueError,
                                                  "task must be one of 'classification', 'lm'")])
def test_register_model_refuses_inputs_or_a_task_it_would_misread(options, error, match):
    """inputs="features" used to register the kinds 'f', 'e', 'a', ..."""
    with pytest.raises(error, match=match):
        models.register_model("probe-model", **options)
    assert "probe-model" not in models.model_names()
