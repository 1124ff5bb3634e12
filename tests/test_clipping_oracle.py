"""clipped_gradients against the float64 oracle (tests/conftest.py), one layer type at a time, and
the engine's contract: batch sizes 0 and 1, masks, frozen parameters, per-layer shares, bad input.

Every case builds its layer in float64 with random parameters, runs one private batch through
``pdpfast.functional.clipped_gradients`` and compares norms, clip weights and clipped sums with
the ones formed from per-sample gradients that ``torch.func`` computes on the same layer.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import pdpfast
from pdpfast.clipping import ClippingState
from pdpfast.functional import clipped_gradients
from pdpfast.ops.linear import use_gram

B = 5


def sq_loss(outputs, target):
    """Per-sample ½‖y_i − t_i‖² (B,)."""
    return 0.5 * (outputs - target).pow(2).flatten(1).sum(1)


def randomize_(module: nn.Module) -> nn.Module:
    """Random values for every parameter (norm layers start at weight 1 / bias 0)."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.5)
    return module


def floats(*shape):
    return torch.randn(B, *shape, dtype=torch.float64)


def ids(high, *shape, low=0):
    return torch.randint(low, high, (B, *shape))


class SelfAttention(nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True, **options)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


class Outputs(nn.Module):
    """A recurrent layer's output sequence (its final state dropped)."""

    def __init__(self, layer: nn.RNNBase):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)[0]


def hf(name: str, **extra) -> nn.Module:
    """A Hugging Face vision module of the families pdpfast registers, on 8×8 images in 4×4 patches."""
    transformers = pytest.importorskip("transformers")
    config_class, module_path = {
        "ViTEmbeddings": ("ViTConfig", "vit.modeling_vit"), "DeiTEmbeddings": ("DeiTConfig", "deit.modeling_deit"),
        "Dinov2Embeddings": ("Dinov2Config", "dinov2.modeling_dinov2"),
        "Dinov2LayerScale": ("Dinov2Config", "dinov2.modeling_dinov2")}[name]
    import importlib

    config = getattr(transformers, config_class)(image_size=8, patch_size=4, num_channels=3, hidden_size=8,
                                                 num_hidden_layers=1, num_attention_heads=2, **extra)
    module = getattr(importlib.import_module(f"transformers.models.{module_path}"), name)(config)
    if name == "Dinov2Embeddings":  # its mask token is used as mask_token.expand(B, T, -1): not batch-aligned
        module.mask_token.requires_grad_(False)
    return module


def hf_conv1d(nf: int, nx: int) -> nn.Module:
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    return Conv1D(nf, nx)


# (layer, input) builders: each returns a module and its batch of inputs. Every registered layer
# family has at least one (``test_every_registered_layer_family_has_a_case``).
LAYERS = {
    # Linear: 2-D (T = 1), 3-D and 4-D inputs, with and without bias, both norm paths
    "linear-2d": lambda: (nn.Linear(7, 5), floats(7)),
    "linear-2d-nobias": lambda: (nn.Linear(7, 5, bias=False), floats(7)),
    "linear-3d-gram": lambda: (nn.Linear(16, 12), floats(3, 16)),
    "linear-3d-direct": lambda: (nn.Linear(3, 4), floats(20, 3)),
    "linear-3d-direct-nobias": lambda: (nn.Linear(3, 4, bias=False), floats(13, 3)),
    "linear-4d-direct": lambda: (nn.Linear(6, 5), floats(2, 3, 6)),
    "linear-4d-gram": lambda: (nn.Linear(20, 16), floats(2, 2, 20)),
    # Conv1d
    "conv1d-stride-pad": lambda: (nn.Conv1d(3, 4, 3, stride=2, padding=1), floats(3, 11)),
    "conv1d-same-even": lambda: (nn.Conv1d(2, 3, 4, padding="same"), floats(2, 9)),
    "conv1d-same-odd-dilation": lambda: (nn.Conv1d(2, 3, 3, padding="same", dilation=3), floats(2, 10)),
    "conv1d-valid-depthwise": lambda: (nn.Conv1d(3, 6, 5, groups=3, padding="valid"), floats(3, 12)),
    "conv1d-reflect-dilation": lambda: (nn.Conv1d(2, 3, 3, padding=2, dilation=2, padding_mode="reflect"),
                                        floats(2, 10)),
    "conv1d-circular-groups-nobias": lambda: (nn.Conv1d(4, 4, 3, padding=1, groups=2, bias=False,
                                                        padding_mode="circular"), floats(4, 7)),
    # a grouped 1×1 convolution's im2col is a view of a non-contiguous input, not a copy
    "conv1d-1x1-groups-transposed-input": lambda: (nn.Conv1d(4, 6, 1, groups=2), floats(7, 4).transpose(1, 2)),
    # Conv2d
    "conv2d-stride-pad": lambda: (nn.Conv2d(3, 5, 3, stride=2, padding=1), floats(3, 9, 7)),
    "conv2d-same-odd-dilation": lambda: (nn.Conv2d(2, 4, 3, padding="same", dilation=2), floats(2, 8, 9)),
    "conv2d-same-even": lambda: (nn.Conv2d(2, 3, (2, 4), padding="same"), floats(2, 7, 8)),
    "conv2d-valid-rect-stride": lambda: (nn.Conv2d(3, 4, (2, 3), stride=(2, 1), padding="valid"), floats(3, 7, 6)),
    "conv2d-groups": lambda: (nn.Conv2d(4, 6, 3, groups=2, padding=(1, 0)), floats(4, 6, 5)),
    "conv2d-depthwise-nobias": lambda: (nn.Conv2d(4, 4, 3, groups=4, padding=1, bias=False), floats(4, 5, 5)),
    "conv2d-1x1-groups-channels-last": lambda: (nn.Conv2d(4, 6, 1, stride=2, groups=2),
                                                floats(4, 5, 5).to(memory_format=torch.channels_last)),
    "conv2d-reflect": lambda: (nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"), floats(2, 6, 5)),
    "conv2d-circular-stride": lambda: (nn.Conv2d(2, 3, 3, stride=2, padding=(2, 1), padding_mode="circular"),
                                       floats(2, 7, 6)),
    "conv2d-replicate-dilation": lambda: (nn.Conv2d(2, 3, 2, padding=1, dilation=2, padding_mode="replicate"),
                                          floats(2, 5, 6)),
    # Conv3d
    "conv3d-stride-pad": lambda: (nn.Conv3d(2, 3, (2, 3, 2), stride=(1, 2, 1), padding=1), floats(2, 4, 5, 3)),
    "conv3d-same-groups-nobias": lambda: (nn.Conv3d(4, 4, 3, padding="same", groups=2, bias=False), floats(4, 3, 4, 3)),
    "conv3d-replicate-dilation": lambda: (nn.Conv3d(2, 2, 2, padding=1, dilation=2, padding_mode="replicate"),
                                          floats(2, 4, 3, 4)),
    # Embedding: few distinct tokens so they repeat within a sample
    "embedding": lambda: (nn.Embedding(11, 5), ids(4, 7)),
    "embedding-padding": lambda: (nn.Embedding(11, 5, padding_idx=0), ids(4, 7)),
    "embedding-padding-last": lambda: (nn.Embedding(11, 5, padding_idx=-1), ids(11, 9, low=8)),
    "embedding-1d": lambda: (nn.Embedding(6, 4, padding_idx=2), ids(6)),
    "embedding-3d": lambda: (nn.Embedding(9, 3), ids(5, 2, 4)),
    # norms
    "layernorm-2d-shape": lambda: (nn.LayerNorm((3, 4)), floats(5, 3, 4)),
    "layernorm-nobias": lambda: (nn.LayerNorm(6, bias=False), floats(4, 6)),
    "layernorm-2d-input": lambda: (nn.LayerNorm(6), floats(6)),
    "layernorm-noaffine": lambda: (nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6, elementwise_affine=False)),
                                   floats(3, 6)),
    "groupnorm-2d": lambda: (nn.GroupNorm(2, 6), floats(6, 4, 5)),
    "groupnorm-1d": lambda: (nn.GroupNorm(3, 6), floats(6, 7)),
    "groupnorm-no-spatial": lambda: (nn.GroupNorm(2, 4), floats(4)),
    "groupnorm-noaffine": lambda: (nn.Sequential(nn.Conv1d(3, 4, 3), nn.GroupNorm(2, 4, affine=False)),
                                   floats(3, 8)),
    "instancenorm1d": lambda: (nn.Sequential(nn.Conv1d(2, 3, 3), nn.InstanceNorm1d(3, affine=True)), floats(2, 9)),
    "instancenorm2d": lambda: (nn.InstanceNorm2d(3, affine=True), floats(3, 4, 5)),
    "instancenorm3d-noaffine": lambda: (nn.Sequential(nn.Conv3d(2, 3, 2), nn.InstanceNorm3d(3)), floats(2, 3, 4, 3)),
    "rmsnorm-2d-shape": lambda: (nn.RMSNorm((3, 4)), floats(2, 3, 4)),
    "rmsnorm-eps": lambda: (nn.RMSNorm(5, eps=1e-5), floats(5)),
    "rmsnorm-noaffine": lambda: (nn.Sequential(nn.Linear(5, 5), nn.RMSNorm(5, elementwise_affine=False)),
                                 floats(3, 5)),
    # attention, bags, recurrent layers
    "multihead-attention": lambda: (SelfAttention(), floats(4, 8)),
    "multihead-attention-nobias": lambda: (SelfAttention(bias=False), floats(3, 8)),
    "embedding-bag-mean-padding": lambda: (nn.EmbeddingBag(11, 5, mode="mean", padding_idx=0), ids(4, 6)),
    "rnn-2-layers-bidirectional": lambda: (Outputs(nn.RNN(4, 5, num_layers=2, bidirectional=True, batch_first=True)),
                                           floats(3, 4)),
    "lstm": lambda: (Outputs(nn.LSTM(4, 5, batch_first=True)), floats(3, 4)),
    "gru-nobias": lambda: (Outputs(nn.GRU(4, 5, bias=False, batch_first=True)), floats(3, 4)),
    # Hugging Face: GPT-2's Conv1D, the vision models' embeddings (batch-broadcast tokens) and layer scale
    "hf-conv1d": lambda: (hf_conv1d(6, 4), floats(3, 4)),
    "hf-vit-embeddings": lambda: (hf("ViTEmbeddings"), floats(3, 8, 8)),
    "hf-deit-embeddings": lambda: (hf("DeiTEmbeddings"), floats(3, 8, 8)),
    "hf-dinov2-embeddings": lambda: (hf("Dinov2Embeddings"), floats(3, 8, 8)),
    "hf-dinov2-layer-scale": lambda: (hf("Dinov2LayerScale", layerscale_value=0.5), floats(3, 8)),
    # Llama's RMSNorm, an RMSNorm form (recognized by its forward; it normalizes in float32)
    "hf-llama-rmsnorm": lambda: (hf_llama_rms_norm(), floats(3, 6)),
}


def hf_llama_rms_norm() -> nn.Module:
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(6, eps=0.1)
    return nn.Sequential(nn.Linear(6, 6), norm)  # its input varies with x: float32 rounding is then visible


def build(name):
    layer, x = LAYERS[name]()
    reference = randomize_(layer).double()
    model = pdpfast.nn.convert(copy.deepcopy(reference))
    with torch.no_grad():
        target = torch.randn_like(reference(x))
    return model, reference, x, target


def test_every_registered_layer_family_has_a_case():
    """Each family ``convert`` knows (``registered_layers``) is built by some LAYERS case, and each form
    it recognizes (``registered_forms``) is converted from one, so the
    oracle tests over LAYERS (any batch, one sample, none, all masked) cover it."""
    import importlib

    from pdpfast.nn.rules import registered_forms, registered_layers

    built = set()
    for name in LAYERS:
        layer, _ = LAYERS[name]()
        built |= {type(m) for m in layer.modules()}
    missing = []
    for key in registered_layers():
        if isinstance(key, str):
            module, _, cls = key.rpartition(".")
            if module.split(".")[0] in ("tests", "conftest") or module.startswith("test_"):
                continue  # registered by another test module
            key = getattr(importlib.import_module(module), cls)
        elif key.__module__.split(".")[0] in ("tests", "conftest") or key.__module__.startswith("test_"):
            continue
        if not any(issubclass(t, key) for t in built):
            missing.append(f"{key.__module__}.{key.__qualname__}")
    assert not missing, f"registered layer families with no case in LAYERS: {missing}"
    converted = {type(m) for name in LAYERS for m in pdpfast.nn.convert(LAYERS[name]()[0]).modules()}
    missing = [form.__name__ for form in registered_forms() if not any(issubclass(t, form) for t in converted)]
    assert not missing, f"forms convert recognizes with no case in LAYERS: {missing}"


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_matches_oracle(name, style, oracle):
    model, reference, x, target = build(name)
    oracle.check(model, sq_loss, (x,), (target,), reference=reference, **style)


@pytest.mark.parametrize("stacking", ["every-call-alone", "every-call-stacked"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_matches_oracle_whether_calls_stack_or_not(name, style, oracle, stacking, monkeypatch):
    """Small same-shape calls are stacked (one launch for n layers), large ones computed alone:
    both routes equal the oracle, whatever the size threshold (here forced to each extreme)."""
    import pdpfast.clipping

    monkeypatch.setattr(pdpfast.clipping, "SMALL_CALL_BYTES", 0 if stacking == "every-call-alone" else 1 << 40)
    monkeypatch.setattr(pdpfast.clipping, "STACK_BYTES", 1 << 40 if stacking == "every-call-stacked" else 0)
    model, reference, x, target = build(name)
    model = nn.Sequential(model, copy.deepcopy(model)) if _repeats_shape(model, x) else model
    reference = nn.Sequential(reference, copy.deepcopy(reference)) if _repeats_shape(reference, x) else reference
    oracle.check(model, sq_loss, (x,), (target,), reference=reference, **style)


@pytest.mark.parametrize("route", ["per-sample-gradients", "norms-and-clipped-sums"])
@pytest.mark.parametrize("name", [n for n in LAYERS if n.startswith(("linear", "conv"))])
def test_layer_matches_oracle_whether_per_sample_gradients_are_formed_or_not(name, route, style, oracle, monkeypatch):
    """Without kernels, a linear or conv call whose per-sample gradients are small forms them once
    (norms and clipped sum from them); a large one computes norms and a clipped-sum GEMM instead.
    Both routes equal the oracle, whatever the threshold (here forced to each extreme); calls are
    computed alone (not stacked), so the route is the one under test."""
    import pdpfast.clipping
    import pdpfast.ops.conv as conv_ops
    import pdpfast.ops.linear as linear_ops
    from pdpfast.ops import workspace

    monkeypatch.setattr(pdpfast.clipping, "SMALL_CALL_BYTES", 0)
    formed = route == "per-sample-gradients"
    monkeypatch.setattr(linear_ops, "MATERIALIZE_RATIO", 1 << 40 if formed else 0)
    monkeypatch.setattr(linear_ops, "MATERIALIZE_MIN_ELEMENTS", 0)
    monkeypatch.setattr(conv_ops, "_GRAM_FRACTION", 0.0)  # a cheap implicit Gram would veto forming them
    monkeypatch.setattr(workspace, "MIN_BYTES", 0)  # pool even these small buffers
    model, reference, x, target = build(name)
    oracle.check(model, sq_loss, (x,), (target,), reference=reference, **style)
    oracle.check(model, sq_loss, (x,), (target,), reference=reference, **style)  # a second batch reuses buffers


def random_conv(seed: int):
    """A convolution no one chose: rank, groups, channels, kernel, stride, dilation, padding (ints,
    "same", "valid") and padding mode drawn from ``seed``, with a batch of 1-5 inputs it fits, their
    channels stored first or last."""
    import random

    r = random.Random(seed)
    dim, groups = r.choice([1, 2, 3]), r.choice([1, 1, 2, 3])
    c_in, c_out = groups * r.choice([1, 2, 3, 17]), groups * r.choice([1, 2, 3, 9])
    kernel = tuple(r.randint(1, 3) for _ in range(dim))
    dilation = tuple(r.randint(1, 2) for _ in range(dim))
    size = tuple(r.randint(d * (k - 1) + 1, 8) for k, d in zip(kernel, dilation))
    mode = r.choice(["zeros", "zeros", "reflect", "replicate", "circular"])
    if mode == "zeros" and r.random() < 0.3:
        padding, stride = r.choice(["same", "valid"]), 1
    else:  # padding modes other than zeros need padding < size
        padding = tuple(min(r.randint(0, 2), n - 1) for n in size)
        stride = tuple(r.randint(1, 3) for _ in range(dim))
    conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dim - 1]
    layer = conv(c_in, c_out, kernel, stride=stride, padding=padding, dilation=dilation, groups=groups,
                 bias=r.random() < 0.7, padding_mode=mode)
    x = torch.randn(r.choice([1, 2, 3, 5]), c_in, *size, dtype=torch.float64)
    if r.random() < 0.3:  # channels stored last (a channels_last image, a transposed sequence)
        x = x.movedim(1, -1).contiguous().movedim(-1, 1)
    return layer, x


@pytest.mark.parametrize("route", ["default", "every-call-alone", "no-per-sample-gradients"])
@pytest.mark.parametrize("seed", range(40))
def test_random_convolutions_match_the_oracle_on_every_route(seed, route, style, oracle, monkeypatch):
    """Beside the chosen cases above: 40 random configurations, each on the route its size picks,
    computed alone, and with no per-sample gradient formed (the GPU's route)."""
    import pdpfast.clipping
    import pdpfast.ops.linear as linear_ops

    if route != "default":
        monkeypatch.setattr(pdpfast.clipping, "SMALL_CALL_BYTES", 0)
    if route == "no-per-sample-gradients":
        monkeypatch.setattr(linear_ops, "MATERIALIZE_RATIO", 0)
        monkeypatch.setattr(linear_ops, "MATERIALIZE_MIN_ELEMENTS", 0)
    layer, x = random_conv(seed)
    reference = randomize_(layer).double()
    model = pdpfast.nn.convert(copy.deepcopy(reference))
    with torch.no_grad():
        target = torch.randn_like(reference(x))
    oracle.check(model, sq_loss, (x,), (target,), reference=reference, **style)


def _repeats_shape(model, x) -> bool:
    """Whether model(model(x)) is defined: then two copies in a row give same-shape calls to stack."""
    try:
        with torch.no_grad():
            return model(x).shape == x.shape and x.is_floating_point()
    except Exception:
        return False


@pytest.mark.parametrize("name", ["linear-3d-gram", "conv2d-groups", "embedding-padding", "layernorm-2d-shape",
                                  "groupnorm-2d", "rmsnorm-2d-shape"])
def test_oracle_vmap_agrees_with_micro_batching(name, oracle):
    """The two ways the oracle computes per-sample gradients agree (the oracle checks itself)."""
    model, reference, x, target = build(name)
    by_vmap = oracle.per_sample_grads(reference, sq_loss, (x,), (target,), method="vmap")
    by_loop = oracle.per_sample_grads(model, sq_loss, (x,), (target,), method="loop")
    assert set(by_vmap) == set(by_loop)
    for n in by_vmap:
        oracle.assert_close(by_loop[n], by_vmap[n], n)


@pytest.mark.parametrize("name,gram", [("linear-3d-gram", True), ("linear-4d-gram", True),
                                       ("linear-3d-direct", False), ("linear-4d-direct", False)])
def test_linear_cases_take_the_intended_norm_path(name, gram):
    """The Linear cases above exercise both exact norm computations of ops.linear."""
    layer, x = LAYERS[name]()
    T = math.prod(x.shape[1:-1])
    assert use_gram(T, layer.in_features, layer.out_features) is gram


@pytest.mark.parametrize("name", ["linear-3d-gram", "conv2d-stride-pad", "embedding-padding", "groupnorm-2d"])
def test_float32_matches_oracle(name, oracle):
    """float32 layers: same results as the float64 oracle up to float32 rounding."""
    model, reference, x, target = build(name)
    per_sample = oracle.per_sample_grads(reference, sq_loss, (x,), (target,))
    bounds = oracle.bounds(oracle.expected(reference, per_sample, torch.ones(B)).norms)
    mask = oracle.random_mask(B)
    expected = oracle.expected(reference, per_sample, bounds, mask)
    model.float()
    x32 = x.float() if x.is_floating_point() else x
    result = oracle.run(model, sq_loss, (x32,), (target.float(),), clip_norms=bounds.float(), mask=mask)
    torch.testing.assert_close(result.norms.double(), expected.norms, rtol=1e-4, atol=1e-5)
    for n, g in expected.grads.items():
        assert result.grads[n].dtype == torch.float32
        torch.testing.assert_close(result.grads[n].double(), g, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------ a small MLP for the contract


def mlp():
    reference = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 7, bias=False), nn.ReLU(),
                              nn.Linear(7, 3)).double()
    return pdpfast.nn.convert(copy.deepcopy(reference)), reference


def ce_loss(outputs, labels):
    return nn.functional.cross_entropy(outputs, labels, reduction="none")


@pytest.mark.parametrize("clipped", [True, False], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("mask", [None, 1.0], ids=["nomask", "mask1"])
def test_batch_of_one(clipped, mask, style, oracle):
    model, reference = mlp()
    x, y = torch.randn(1, 6, dtype=torch.float64), torch.randint(0, 3, (1,))
    per_sample = oracle.per_sample_grads(reference, ce_loss, (x,), (y,))
    norms = oracle.expected(reference, per_sample, torch.ones(1)).norms
    bounds = oracle.bounds(norms, torch.tensor([clipped]))
    result, expected = oracle.check(model, ce_loss, (x,), (y,), reference=reference, clip_norms=bounds,
                                    mask=None if mask is None else torch.tensor([mask]), **style)
    if clipped and style.get("automatic_gamma") is None and style["clipping"] == "flat":
        total = torch.sqrt(sum(g.pow(2).sum() for g in result.grads.values()))
        assert total == pytest.approx(float(bounds[0]) * float(norms[0]) / (float(norms[0]) + 1e-6), rel=1e-9)


@pytest.mark.parametrize("clipped", [True, False], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_batch_of_one(name, clipped, style, oracle):
    """B = 1 for every layer case: one sample's norms, weights and clipped gradients."""
    model, reference, x, target = build(name)
    oracle.check_one(model, sq_loss, (x,), (target,), reference=reference, clipped=clipped, **style)


@pytest.mark.parametrize("name", ["mlp", *LAYERS])
def test_empty_batch(name, style, oracle):
    """B = 0 for every layer case: norms of shape (0,), every gradient zero (and present)."""
    if name == "mlp":
        model, _ = mlp()
        x, target = torch.randn(0, 6, dtype=torch.float64), torch.randn(0, 3, dtype=torch.float64)
    else:
        model, _, x, target = build(name)
    oracle.check_empty(model, sq_loss, (x,), (target,), **style)


def test_all_masked_batch_gives_zero_gradients_and_true_norms(style, oracle):
    model, reference = mlp()
    x, y = torch.randn(B, 6, dtype=torch.float64), torch.randint(0, 3, (B,))
    result, expected = oracle.check(model, ce_loss, (x,), (y,), reference=reference, mask=torch.zeros(B), **style)
    assert all(not g.any() for g in result.grads.values())
    assert (result.norms > 0).all()


@pytest.mark.parametrize("name", list(LAYERS))
def test_all_masked_batch_of_every_layer_gives_zero_gradients_and_true_norms(name, style, oracle):
    model, reference, x, target = build(name)
    result, _ = oracle.check(model, sq_loss, (x,), (target,), reference=reference, mask=torch.zeros(B), **style)
    assert all(not g.any() for g in result.grads.values())


def test_masked_rows_do_not_change_the_sum(oracle):
    """Padding a batch with m_i = 0 rows (any content) gives the clipped sum of the real rows."""
    model, _ = mlp()
    x, y = torch.randn(B, 6, dtype=torch.float64), torch.randint(0, 3, (B,))
    bounds = torch.rand(B, dtype=torch.float64) + 0.1
    real = oracle.run(model, ce_loss, (x,), (y,), clip_norms=bounds)
    pad_x, pad_y = torch.randn(3, 6, dtype=torch.float64) * 100, torch.randint(0, 3, (3,))
    padded = oracle.run(model, ce_loss, (torch.cat([x, pad_x]),), (torch.cat([y, pad_y]),),
                        clip_norms=torch.cat([bounds, torch.rand(3, dtype=torch.float64) + 0.1]),
                        mask=torch.cat([torch.ones(B), torch.zeros(3)]))
    for n, g in real.grads.items():
        oracle.assert_close(padded.grads[n], g, n)
    oracle.assert_close(padded.norms[:B], real.norms, "norms")


def test_weights_are_reported_for_flat_clipping_only(oracle):
    model, reference = mlp()
    x, y = torch.randn(B, 6, dtype=torch.float64), torch.randint(0, 3, (B,))
    for mode in ("bk", "ghost"):
        result, expected = oracle.check(model, ce_loss, (x,), (y,), reference=reference, mode=mode)
        assert result.weights is not None
        oracle.assert_close(result.weights, expected.weights, "weights")
    result, _ = oracle.check(model, ce_loss, (x,), (y,), reference=reference, clipping="per_layer")
    assert result.weights is None


def test_existing_grads_are_left_as_they_were(style, oracle):
    model, reference = mlp()
    before = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = before[n].clone()
    x, y = torch.randn(B, 6, dtype=torch.float64), torch.randint(0, 3, (B,))
    oracle.check(model, ce_loss, (x,), (y,), reference=reference, **style)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, before[n]), n


def test_repeated_batches_do_not_leak_state(style, oracle):
    """A second batch (other size) right after a first gives its own exact result."""
    model, reference = mlp()
    for batch in (B, 3, 1, B + 2):
        x, y = torch.randn(batch, 6, dtype=torch.float64), torch.randint(0, 3, (batch,))
        oracle.check(model, ce_loss, (x,), (y,), reference=reference, **style)


# ------------------------------------------------------------------------ frozen parameters


def test_frozen_layer_is_excluded_from_grads_and_norms(style, oracle):
    model, reference = mlp()
    for m in (model, reference):
        m[0].requires_grad_(False)
        m[4].bias.requires_grad_(False)
    x, y = torch.randn(B, 6, dtype=torch.float64), torch.randint(0, 3, (B,))
    result, _ = oracle.check(model, ce_loss, (x,), (y,), reference=reference, **style)
    assert set(result.grads) == {"2.weight", "4.weight"}


def test_frozen_layer_takes_no_per_layer_share(oracle):
    """Per-layer clipping: K counts only layers with trainable parameters, so a frozen layer does not
    shrink the other layers' shares 1/√K."""
    model, reference = mlp()
    for m in (model, reference):
        m[0].requires_grad_(False)
    state = ClippingState(model, clipping="per_layer")
    assert state.group_names == [g.name for g in oracle.groups(model)] == ["2", "4"]
    torch.testing.assert_close(state.shares, torch.full((2,), 2 ** -0.5, dtype=torch.float64))


def test_frozen_unsupported_module_is_allowed(oracle):
    """A module pdpfast cannot privatize is fine once frozen: it costs nothing and is not clipped."""
    class Scale(nn.Module):  # a custom module with its own parameter, frozen
        def __init__(self):
            super().__init__()
            self.alpha = nn.Parameter(torch.randn(6, dtype=torch.float64), requires_grad=False)

        def forward(self, h):
            return h * self.alpha

    reference = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), Scale(), nn.Linear(6, 2)).double()
    model = pdpfast.nn.convert(copy.deepcopy(reference))
    x, t = torch.randn(B, 4, dtype=torch.float64), torch.randn(B, 2, dtype=torch.float64)
    result, _ = oracle.check(model, sq_loss, (x,), (t,), reference=reference)
    assert "2.alpha" not in result.grads


# ------------------------------------------------------------------------ per-layer shares


def test_per_layer_groups_and_default_shares(oracle):
    model, _ = mlp()
    state = ClippingState(model, clipping="per_layer")
    assert state.group_names == [g.name for g in oracle.groups(model)] == ["0", "2", "4"]
    torch.testing.assert_close(state.shares, torch.full((3,), 3 ** -0.5, dtype=torch.float64))


def test_per_layer_sensitivity_never_exceeds_the_bound(oracle):
    """Per-layer clipping keeps each record's clipped gradient within c_i (Σ_k C_k² = 1)."""
    model, reference = mlp()
    x, y = torch.randn(1, 6, dtype=torch.float64) * 10, torch.randint(0, 3, (1,))
    bounds = torch.tensor([1e-3], dtype=torch.float64)
    for shares in (None, {"0": 0.6, "2": 0.48, "4": math.sqrt(1 - 0.36 - 0.48 ** 2)}):
        result = oracle.run(model, ce_loss, (x,), (y,), clip_norms=bounds, clipping="per_layer",
                            layer_shares=shares)
        total = torch.sqrt(sum(g.pow(2).sum() for g in result.grads.values()))
        assert total <= bounds[0] * (1 + 1e-9)


@pytest.mark.parametrize("as_sequence", [False, True], ids=["dict", "sequence"])
@pytest.mark.parametrize("automatic_gamma", [None, 0.1])
def test_user_given_layer_shares(as_sequence, automatic_gamma, oracle):
    model, reference = mlp()
    raw = torch.rand(3, dtype=torch.float64) + 0.2
    shares = (raw / raw.norm()).tolist()
    layer_shares = shares if as_sequence else dict(zip(["4", "0", "2"], [shares[2], shares[0], shares[1]]))
    x, y = torch.randn(B, 6, dtype=torch.float64), torch.randint(0, 3, (B,))
    _, expected = oracle.check(model, ce_loss, (x,), (y,), reference=reference, clipping="per_layer",
                               layer_shares=layer_shares, automatic_gamma=automatic_gamma, mask=None,
                               clip_norms=torch.full((B,), 1e-2))
    # unequal shares really change the result (else this test would pass with shares ignored)
    per_sample = oracle.per_sample_grads(reference, ce_loss, (x,), (y,))
    equal = oracle.expected(reference, per_sample, torch.full((B,), 1e-2), clipping="per_layer",
                            automatic_gamma=automatic_gamma)
    assert not torch.allclose(equal.grads["0.weight"], expected.grads["0.weight"])


class Parallel(nn.Module):
    """Copies of one layer on the same input, outputs summed: same-shape calls of different
    clipping groups, which stack into one launch per op."""

    def __init__(self, layer: nn.Module, copies: int):
        super().__init__()
        self.copies = nn.ModuleList([layer] + [randomize_(copy.deepcopy(layer)) for _ in range(copies - 1)])

    def forward(self, x):
        return sum(layer(x) for layer in self.copies)


@pytest.mark.parametrize("stacking", ["every-call-stacked", "every-call-alone"])
@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("style", ["per_layer", "per_layer-automatic"], indirect=True)
def test_unequal_layer_shares_reach_each_group_of_every_layer_family(name, stacking, style, oracle, monkeypatch):
    """Unequal shares C_k, each group's own: with the default (equal) shares every group's bounds
    c_i·C_k are alike, so a call clipped against another group's row would go unseen. Three copies
    of each layer case make same-shape calls of three groups, stacked into one clip-weight
    computation (their rows gathered by group) or each computed alone."""
    import pdpfast.clipping

    monkeypatch.setattr(pdpfast.clipping, "SMALL_CALL_BYTES", 0 if stacking == "every-call-alone" else 1 << 40)
    monkeypatch.setattr(pdpfast.clipping, "STACK_BYTES", 1 << 40 if stacking == "every-call-stacked" else 0)
    layer, x = LAYERS[name]()
    reference = Parallel(randomize_(layer), 3).double()
    model = pdpfast.nn.convert(copy.deepcopy(reference))
    with torch.no_grad():
        target = torch.randn_like(reference(x))
    groups = oracle.groups(reference)
    assert len(groups) >= 3
    raw = 0.2 + torch.rand(len(groups), dtype=torch.float64)
    shares = {g.module_names[0]: float(s) for g, s in zip(groups, raw / raw.norm())}
    per_sample = oracle.per_sample_grads(reference, sq_loss, (x,), (target,))
    clip_norms = 0.5 * oracle.bounds(oracle.expected(reference, per_sample, torch.ones(B)).norms)
    _, expected = oracle.check(model, sq_loss, (x,), (target,), reference=reference, clip_norms=clip_norms,
                               layer_shares=shares, **style)
    equal = oracle.expected(reference, per_sample, clip_norms, clipping="per_layer",
                            automatic_gamma=style.get("automatic_gamma"))
    assert any(not torch.allclose(equal.grads[n], g) for n, g in expected.grads.items())  # the shares matter


# ------------------------------------------------------------------------ bad input


def _bad_call(model, **kwargs):
    x, y = torch.randn(B, 6, dtype=torch.float64), torch.randint(0, 3, (B,))
    kwargs.setdefault("clip_norms", torch.ones(B))
    return clipped_gradients(model, lambda out: ce_loss(out, y), x, **kwargs)


@pytest.mark.parametrize("clip_norms,error,match", [
    (torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0]), ValueError, "clip_norms"),
    (torch.tensor([1.0, -2.0, 1.0, 1.0, 1.0]), ValueError, "clip_norms"),
    (torch.tensor([1.0, float("nan"), 1.0, 1.0, 1.0]), ValueError, "clip_norms"),
    (torch.tensor([1.0, float("inf"), 1.0, 1.0, 1.0]), ValueError, "clip_norms"),
    (torch.ones(4), ValueError, "clip_norms"),
    (torch.ones(6), ValueError, "clip_norms"),
    (torch.ones(1), ValueError, "clip_norms"),
    (torch.ones(B, 1), ValueError, "clip_norms"),
    (torch.tensor(1.0), ValueError, "clip_norms"),
    (1.0, TypeError, "clip_norms"),
    (torch.ones(B, dtype=torch.complex64), TypeError, "clip_norms"),
], ids=["zero", "negative", "nan", "inf", "short", "long", "one", "2d", "0d", "scalar", "complex"])
def test_bad_clip_norms(clip_norms, error, match):
    model, _ = mlp()
    with pytest.raises(error, match=match):
        _bad_call(model, clip_norms=clip_norms)


def test_one_row_input_is_not_broadcast_to_the_batch():
    """A 1-row input with B clip norms is an error, not B copies of one sample (DP layers broadcast a
    (1, T) tensor such as position ids; the batch's own inputs must not be)."""
    model, _ = mlp()
    with pytest.raises(ValueError, match="clip_norms"):
        clipped_gradients(model, lambda out: out.sum(1), torch.randn(1, 6, dtype=torch.float64),
                          clip_norms=torch.ones(B))


@pytest.mark.parametrize("mask,match", [
    (torch.tensor([1.0, 0.5, 1.0, 0.0, 1.0]), "mask"),
    (torch.tensor([1.0, 2.0, 1.0, 0.0, 1.0]), "mask"),
    (torch.tensor([1.0, -1.0, 1.0, 0.0, 1.0]), "mask"),
    (torch.tensor([1.0, float("nan"), 1.0, 0.0, 1.0]), "mask"),
    (torch.ones(4), "mask"),
    (torch.ones(B, 1), "mask"),
], ids=["half", "two", "minus-one", "nan", "short", "2d"])
def test_bad_mask(mask, match):
    model, _ = mlp()
    with pytest.raises(ValueError, match=match):
        _bad_call(model, mask=mask)


def test_bool_and_integer_masks_are_accepted(oracle):
    model, reference = mlp()
    x, y = torch.randn(B, 6, dtype=torch.float64), torch.randint(0, 3, (B,))
    mask = oracle.random_mask(B)
    expected, _ = oracle.check(model, ce_loss, (x,), (y,), reference=reference, mask=mask,
                               clip_norms=torch.full((B,), 0.3))
    for as_type in (torch.bool, torch.int64):
        result = oracle.run(model, ce_loss, (x,), (y,), clip_norms=torch.full((B,), 0.3), mask=mask.to(as_type))
        for n, g in expected.grads.items():
            oracle.assert_close(result.grads[n], g, n)


@pytest.mark.parametrize("loss_fn,match", [
    (lambda out: out.sum(), "loss_fn"),
    (lambda out: out, "loss_fn"),
    (lambda out: out.sum(1)[:-1], "loss_fn"),
    (lambda out: out.detach().sum().item(), "loss_fn"),
], ids=["scalar", "2d", "short", "python-float"])
def test_loss_fn_must_return_per_sample_losses(loss_fn, match):
    model, _ = mlp()
    x = torch.randn(B, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match=match):
        clipped_gradients(model, loss_fn, x, clip_norms=torch.ones(B))


@pytest.mark.parametrize("kwargs,match", [
    (dict(clipping="layerwise"), "clipping"),
    (dict(clipping="Flat"), "clipping"),
    (dict(mode="opacus"), "mode"),
    (dict(mode=None), "mode"),
    (dict(clipping="per_layer", mode="ghost"), "ghost"),
    (dict(clipping="per_layer", layer_shares=[0.5, 0.5, 0.5]), "layer_shares"),
    (dict(clipping="per_layer", layer_shares={"0": 0.5, "2": 0.5, "4": 0.5}), "layer_shares"),
    (dict(clipping="per_layer", layer_shares={"0": 0.6, "2": 0.48, "9": 0.64}), "layer_shares"),
    (dict(clipping="per_layer", layer_shares={"0": 0.6, "2": 0.8}), "layer_shares"),
    (dict(clipping="per_layer", layer_shares=[0.6, 0.8]), "layer_shares"),
    (dict(clipping="per_layer", layer_shares=[1.0, 0.0, 0.0]), "layer_shares"),
    (dict(clipping="per_layer", layer_shares=[-0.6, 0.48, 0.64]), "layer_shares"),
    (dict(clipping="flat", layer_shares=[0.6, 0.48, 0.64]), "layer_shares"),
    (dict(automatic_gamma=0.0), "automatic_gamma"),
    (dict(automatic_gamma=-1.0), "automatic_gamma"),
    (dict(automatic_gamma=float("nan")), "automatic_gamma"),
], ids=["clipping-unknown", "clipping-case", "mode-unknown", "mode-none", "per-layer-ghost", "shares-sum",
        "shares-dict-sum", "shares-unknown-module", "shares-missing-group", "shares-wrong-length", "shares-zero",
        "shares-negative", "shares-with-flat", "gamma-zero", "gamma-negative", "gamma-nan"])
def test_bad_options(kwargs, match):
    model, _ = mlp()
    with pytest.raises(ValueError, match=match):
        _bad_call(model, **kwargs)


def test_unconverted_model_is_refused():
    model = nn.Sequential(nn.Linear(6, 3)).double()
    with pytest.raises(ValueError, match="convert"):
        _bad_call(model)


def test_errors_leave_the_model_usable(oracle):
    """A failed call (bad loss) detaches the engine: the model still runs plain and privately."""
    model, reference = mlp()
    x, y = torch.randn(B, 6, dtype=torch.float64), torch.randint(0, 3, (B,))
    with pytest.raises(ValueError, match="loss_fn"):
        clipped_gradients(model, lambda out: out.sum(), x, clip_norms=torch.ones(B))
    assert all(p.grad is None for p in model.parameters())
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    oracle.check(model, ce_loss, (x,), (y,), reference=reference)


# ------------------------------------------------------------------------ partial freezing, misuse


@pytest.mark.parametrize("name", ["linear-3d-gram", "linear-3d-direct", "conv2d-groups", "conv1d-stride-pad",
                                  "layernorm-2d-shape", "groupnorm-2d"])
@pytest.mark.parametrize("frozen", ["weight", "bias"])
def test_partially_frozen_layer(name, frozen, style, oracle):
    """A layer whose weight (or bias) is frozen: only the other parameter is clipped and returned."""
    model, reference, x, target = build(name)
    for m in (model, reference):
        getattr(m, frozen).requires_grad_(False)
    result, _ = oracle.check(model, sq_loss, (x,), (target,), reference=reference, **style)
    assert set(result.grads) == {"bias" if frozen == "weight" else "weight"}


def _as_buffer(module: nn.Module, name: str) -> nn.Module:
    """``module`` with its parameter ``name`` kept as a buffer of random values: a frozen weight or bias
    as ``torch.nn.utils.parametrize.remove_parametrizations`` leaves a frozen parametrization."""
    value = torch.randn_like(getattr(module, name).detach())
    delattr(module, name)
    module.register_buffer(name, value)
    return module


def _attention_with_buffer(name):
    layer = SelfAttention()
    _as_buffer(layer.attn, name)
    return layer


# (layer with a buffer where torch's layer has a parameter, input)
BUFFERED = {
    "linear-bias": lambda: (_as_buffer(nn.Linear(5, 4), "bias"), floats(3, 5)),
    "linear-weight": lambda: (nn.Sequential(nn.Linear(5, 5), nn.Tanh(), _as_buffer(nn.Linear(5, 4), "weight")),
                              floats(3, 5)),
    "conv2d-weight": lambda: (nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(),
                                            _as_buffer(nn.Conv2d(3, 3, 2, groups=3), "weight")), floats(2, 5, 4)),
    "embedding-weight": lambda: (nn.Sequential(_as_buffer(nn.Embedding(7, 4), "weight"), nn.Linear(4, 3)), ids(7, 5)),
    "layernorm-weight": lambda: (_as_buffer(nn.LayerNorm(6), "weight"), floats(3, 6)),
    "groupnorm-bias": lambda: (_as_buffer(nn.GroupNorm(2, 4), "bias"), floats(4, 5)),
    "attention-in-proj-bias": lambda: (_attention_with_buffer("in_proj_bias"), floats(3, 8)),
}


@pytest.mark.parametrize("name", list(BUFFERED))
def test_a_weight_or_bias_kept_as_a_buffer_is_used_as_torch_uses_it(name, style, oracle):
    """torch's forward reads a layer's weight or bias as ``self.<name>``, a parameter or a buffer; the DP
    layers read their parameters only, so a converted layer dropped a buffer bias (Linear, GroupNorm: no
    bias), dropped a buffer weight (LayerNorm: weight 1) or failed (KeyError: 'weight'), outside a private
    batch and in it (the clipped gradients of another function than the model's)."""
    layer, x = BUFFERED[name]()
    reference = randomize_(layer).double()
    model = pdpfast.nn.convert(copy.deepcopy(reference))
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
        target = torch.randn_like(reference(x))
    oracle.check(model, sq_loss, (x,), (target,), reference=reference, **style)


class DeadBranch(nn.Module):
    """A DP layer whose output never reaches the loss: zero gradient, no norm."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 3), nn.Linear(4, 2)

    def forward(self, x):
        self.unused(x)
        return self.used(x)


def test_layer_outside_the_loss_gets_zero_gradient(style, oracle):
    reference = DeadBranch().double()
    model = pdpfast.nn.convert(copy.deepcopy(reference))
    x, t = torch.randn(B, 4, dtype=torch.float64), torch.randn(B, 3, dtype=torch.float64)
    result, _ = oracle.check(model, sq_loss, (x,), (t,), reference=reference, **style)
    assert not result.grads["unused.weight"].any() and not result.grads["unused.bias"].any()


class DirectUse(nn.Module):
    """Uses an embedding table directly as an output projection (not through a DP layer)."""

    def __init__(self):
        super().__init__()
        self.emb, self.mix = nn.Embedding(7, 4), nn.Linear(4, 4)

    def forward(self, ids):
        return nn.functional.linear(torch.tanh(self.mix(self.emb(ids))), self.emb.weight)


def test_parameter_used_outside_its_dp_layer_is_refused(style):
    """A parameter used outside its layer's private forward would get an unclipped gradient."""
    model = pdpfast.nn.convert(DirectUse().double())
    ids = torch.randint(0, 7, (B, 3))
    with pytest.raises(RuntimeError, match="emb.weight"):
        clipped_gradients(model, lambda out: out.pow(2).flatten(1).sum(1), ids, clip_norms=torch.ones(B), **style)
    assert all(p.grad is None for p in model.parameters())
    model(ids).sum().backward()  # the guard is gone once the call is over
    assert model.emb.weight.grad is not None


def test_model_in_eval_mode_is_refused(style):
    """DP layers in eval mode run as plain torch layers: their gradients would be unclipped."""
    model, _ = mlp()
    model[2].eval()
    with pytest.raises(ValueError, match="train"):
        _bad_call(model, **style)


@pytest.mark.parametrize("path", ["grouped-backward", "implicit-gram", "unfold-bmm"])
def test_cpu_conv_norm_paths_match_oracle(style, oracle, monkeypatch, path):
    """Large convolutions take per-sample gradients from the grouped conv backward instead of
    unfolding; few positions and wide channels take the implicit Gram norm; tiny fan-ins take per-sample
    gradients from im2col and a batched GEMM."""
    import pdpfast.ops.conv as conv_ops

    monkeypatch.setattr(conv_ops, "_UNFOLD_LIMIT", 0)
    monkeypatch.setattr(conv_ops, "_GRAM_FRACTION", float("inf") if path == "implicit-gram" else 0.0)
    monkeypatch.setattr(conv_ops, "_BMM_MAX_FAN_IN", 1 << 40 if path == "unfold-bmm" else -1)
    for name in ("conv2d-groups", "conv2d-circular-stride", "conv1d-same-even", "conv2d-depthwise-nobias"):
        model, reference, x, target = build(name)
        oracle.check(model, sq_loss, (x,), (target,), reference=reference, **style)


def test_small_formed_gradients_are_packed_and_equal_the_oracle(style, oracle, monkeypatch):
    """Normalization layers' per-sample gradients (and other small formed ones) are clipped together
    at the end of the backward: one concatenation, norms per clipping group from one product, one
    clip-weight computation, one weighted sum. Several groups of different widths, each call computed
    alone (as a large model's are), equal the oracle in every mode."""
    import pdpfast.clipping

    monkeypatch.setattr(pdpfast.clipping, "SMALL_CALL_BYTES", 0)
    packed = []
    accumulate = pdpfast.clipping.ClippingState._accumulate_packed
    monkeypatch.setattr(pdpfast.clipping.ClippingState, "_accumulate_packed",
                        lambda self, params, summed: (packed.append(len(params)), accumulate(self, params, summed)))
    reference = randomize_(nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 4),
                                         nn.LayerNorm(4), nn.GroupNorm(2, 4), nn.RMSNorm(4))).double()
    model = pdpfast.nn.convert(copy.deepcopy(reference))
    x = torch.randn(7, 5, dtype=torch.float64)
    with torch.no_grad():
        target = torch.randn_like(reference(x))
    oracle.check(model, sq_loss, (x,), (target,), reference=reference, **style)
    if style["mode"] == "bk":  # ghost mode's clipped sums come from its second backward
        assert packed and max(packed) >= 5, packed  # γ and β of three norms, the RMSNorm's γ


def test_gpu_route_forms_per_sample_gradients_for_per_layer_clipping_only_where_norms_cost_more(style, oracle,
                                                                                                monkeypatch):
    """Where the kernels run (a GPU: faked here by ``prefer_per_sample``'s device test), per-layer
    clipping forms a linear call's per-sample gradients, clips them at once and frees them, when its
    norm costs more multiply-adds than three passes over them at the device's FLOP/byte balance
    (a long sequence through a narrow layer); book-keeping, which would keep them to the end of the
    backward, and ghost clipping never form them there. Every style equals the oracle."""
    import pdpfast.clipping
    import pdpfast.ops.linear as linear_ops

    monkeypatch.setattr(pdpfast.clipping, "SMALL_CALL_BYTES", 0)
    monkeypatch.setattr(linear_ops, "use_triton", lambda *tensors: True)
    formed = []
    per_sample = linear_ops.linear_per_sample_grads
    monkeypatch.setattr(linear_ops, "linear_per_sample_grads",
                        lambda a, o: (formed.append(a.shape), per_sample(a, o))[1])
    long, short = 128, 4  # norm multiply-adds > 1.5·8 bytes·GPU_FLOPS_PER_BYTE[fp64]·d·p for T = long only
    reference = randomize_(nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Unflatten(1, (short, long // short)),
                                         nn.Flatten(2), nn.Linear(2 * long // short, 3))).double()
    model = pdpfast.nn.convert(copy.deepcopy(reference))
    x = torch.randn(B, long, 2, dtype=torch.float64)
    with torch.no_grad():
        target = torch.randn_like(reference(x))
    oracle.check(model, sq_loss, (x,), (target,), reference=reference, **style)
    assert set(formed) == ({(B, long, 2)} if style["clipping"] == "per_layer" else set()), formed
