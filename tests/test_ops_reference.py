"""The plain-torch reference ops of ``pdpfast.ops`` against materialized per-sample gradients.

Every squared norm is checked against ‖G_i‖² of a per-sample gradient G_i formed independently
(einsum, one-hot scatter, or ``torch.func`` on the torch op), and every clipped sum against
Σ_i w_i G_i, in float64.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, vmap

import pdpfast.ops.linear as linear_ops
from pdpfast.ops import conv as conv_ops
from pdpfast.ops import norm as norm_ops
from pdpfast.ops.clip import CLIP_EPS, clip_weights
from pdpfast.ops.embedding import (
    embedding_clipped_grad_reference,
    embedding_per_sample_grads,
    embedding_sq_norms,
    embedding_sq_norms_reference,
)
from pdpfast.ops.linear import (
    bias_sq_norms,
    bias_sq_norms_reference,
    linear_clipped_grads,
    linear_per_sample_grads,
    linear_weight_sq_norms,
    linear_weight_sq_norms_reference,
    use_gram,
)


def close(actual, expected, rtol=1e-10):
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=rtol * scale)


def sq(g):
    return g.flatten(1).pow(2).sum(1)


def weighted_sum(weights, per_sample):
    return torch.tensordot(weights, per_sample, dims=1)


# ------------------------------------------------------------------------------------------ linear

LINEAR_SHAPES = [(1, 1, 1, 1), (3, 1, 7, 5), (4, 2, 16, 12), (5, 7, 3, 4), (2, 33, 5, 9), (3, 6, 40, 2),
                 (1, 13, 17, 1), (0, 4, 3, 2)]  # (B, T, d, p)


def per_sample_linear(a, o):
    return torch.einsum("btp,btd->bpd", o, a)


@pytest.mark.parametrize("B,T,d,p", LINEAR_SHAPES + [(3, 64, 5, 4), (2, 71, 3, 6)])
@pytest.mark.parametrize("path", ["gram", "gram-split", "direct", "auto"])
def test_linear_norm_paths_agree_with_materialized(B, T, d, p, path, monkeypatch):
    a, o = torch.randn(B, T, d, dtype=torch.float64), torch.randn(B, T, p, dtype=torch.float64)
    if path != "auto":
        monkeypatch.setattr(linear_ops, "use_gram", lambda *args: path.startswith("gram"))
    if path.startswith("gram"):  # the Gram whole, or in blocks of half the positions (odd T included)
        monkeypatch.setattr(linear_ops, "split_gram", lambda B, T, *args: path == "gram-split" and T >= 2)
    expected = sq(per_sample_linear(a, o))
    close(linear_weight_sq_norms_reference(a, o), expected)
    close(linear_weight_sq_norms(a, o), expected)
    close(linear_per_sample_grads(a, o), per_sample_linear(a, o))


def test_use_gram_picks_the_cheaper_path():
    assert use_gram(4, 64, 64) and use_gram(16, 256, 128)
    assert not use_gram(64, 4, 4) and not use_gram(100, 3, 5)
    # per call: the same layer switches paths with the sequence length
    assert use_gram(2, 32, 32) and not use_gram(512, 32, 32)


def test_gram_splits_where_the_work_saved_outweighs_the_launches():
    """Split in halves of T, the Gram norm saves a quarter of its work for eleven launches: on a GPU
    only wide, long calls split (GPT-2 small's MLP at T = 512); BERT-base's (T = 128) stay whole."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not linear_ops.split_gram(32, 128, 768, 768, cuda) and not linear_ops.split_gram(32, 128, 768, 3072, cuda)
    assert linear_ops.split_gram(8, 512, 768, 3072, cuda)
    assert linear_ops.split_gram(32, 128, 768, 768, cpu) and linear_ops.split_gram(16, 128, 256, 256, cpu)
    assert not linear_ops.split_gram(4, 64, 16, 16, cpu)  # a few launches' worth of work saved
    assert not linear_ops.split_gram(1024, 63, 768, 768, cpu)  # too few positions to halve


@pytest.mark.parametrize("path", ["gram", "direct"])
def test_linear_norms_in_chunks(path, monkeypatch):
    """Chunking over samples (to bound memory) gives the same norms."""
    monkeypatch.setattr(linear_ops, "use_gram", lambda *args: path == "gram")
    monkeypatch.setattr(linear_ops, "_CHUNK_ELEMENTS", 50)
    a, o = torch.randn(7, 5, 6, dtype=torch.float64), torch.randn(7, 5, 4, dtype=torch.float64)
    close(linear_weight_sq_norms_reference(a, o), sq(per_sample_linear(a, o)))


@pytest.mark.parametrize("B,T,d,p", LINEAR_SHAPES)
def test_bias_norms_and_clipped_sums(B, T, d, p):
    a, o = torch.randn(B, T, d, dtype=torch.float64), torch.randn(B, T, p, dtype=torch.float64)
    w = torch.rand(B, dtype=torch.float64)
    close(bias_sq_norms_reference(o), sq(o.sum(1)))
    close(bias_sq_norms(o), sq(o.sum(1)))
    for need_weight in (True, False):  # the bias reuses the scaled o, or weighs Σ_t o_t itself
        grad_w, grad_b = linear_clipped_grads(a, o, w, need_weight, True)
        close(grad_b, weighted_sum(w, o.sum(1)))
        if need_weight:
            close(grad_w, weighted_sum(w, per_sample_linear(a, o)))
    grad_w, grad_b = linear_clipped_grads(a, o, None, True, True)
    close(grad_w, per_sample_linear(a, o).sum(0))
    close(grad_b, o.sum((0, 1)))
    close(linear_clipped_grads(a, o, w, True, False, transposed=True)[0], weighted_sum(w, per_sample_linear(a, o)).t())
    stacked_w, stacked_b = linear_ops.linear_clipped_grads_stacked(torch.stack([a, 2 * a]), torch.stack([o, o]), w,
                                                                   True, True)
    close(stacked_w[1], 2 * weighted_sum(w, per_sample_linear(a, o)))
    close(stacked_b[0], weighted_sum(w, o.sum(1)))
    with_bias = linear_ops.linear_sq_norms_reference(a, o, with_bias=True)
    close(with_bias, sq(per_sample_linear(a, o)) + sq(o.sum(1)))


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("path", ["gram", "direct"])
def test_linear_norms_accumulate_in_float32(dtype, rtol, path, monkeypatch):
    monkeypatch.setattr(linear_ops, "use_gram", lambda *args: path == "gram")
    a, o = torch.randn(3, 9, 7, dtype=dtype), torch.randn(3, 9, 5, dtype=dtype)
    norms = linear_weight_sq_norms_reference(a, o)
    assert norms.dtype == torch.float32
    # against the exact norms of the same (rounded) inputs
    close(norms, sq(per_sample_linear(a.double(), o.double())), rtol=rtol)
    assert bias_sq_norms_reference(o).dtype == torch.float32


# ------------------------------------------------------------------------------------------ embedding


def per_sample_embedding(ids, o, V, padding_idx):
    """G_i = onehot(ids_i)ᵀ o_i, with the padding row zeroed."""
    B = ids.shape[0]
    T = math.prod(ids.shape[1:])
    onehot = F.one_hot(ids.reshape(B, T), V).to(o.dtype)  # (B, T, V)
    g = torch.einsum("btv,btp->bvp", onehot, o.reshape(B, T, o.shape[-1]))
    if padding_idx is not None:
        g[:, padding_idx] = 0
    return g


EMBEDDING_CASES = [  # (B, ids shape, V, p, padding_idx, distinct tokens used)
    (4, (7,), 11, 5, None, 3),
    (4, (7,), 11, 5, 0, 3),
    (3, (9,), 6, 4, 5, 6),
    (5, (), 6, 3, 2, 6),
    (3, (2, 4), 9, 3, None, 4),
    (2, (6,), 1, 2, None, 1),
    (0, (3,), 5, 2, 1, 5),
    (1, (8,), 4, 3, None, 4),
    (6, (5,), 3, 2, 2, 3),  # every id up to V - 1: one sample's keys end where the next one's begin
]


@pytest.mark.parametrize("B,shape,V,p,padding_idx,used", EMBEDDING_CASES)
def test_embedding_norms_and_clipped_sum(B, shape, V, p, padding_idx, used):
    ids = torch.randint(0, used, (B, *shape))
    if padding_idx is not None and B:
        ids.view(-1)[::3] = padding_idx
    o = torch.randn(B, *shape, p, dtype=torch.float64)
    w = torch.rand(B, dtype=torch.float64)
    expected = per_sample_embedding(ids, o, V, padding_idx)
    close(embedding_sq_norms_reference(ids, o, V, padding_idx), sq(expected))
    close(embedding_sq_norms(ids, o, V, padding_idx), sq(expected))
    close(embedding_per_sample_grads(ids, o, V, padding_idx), expected)
    close(embedding_clipped_grad_reference(ids, o, w, V, padding_idx), weighted_sum(w, expected))
    close(embedding_clipped_grad_reference(ids, o, None, V, padding_idx), expected.sum(0))
    # added into a held tensor in place (a tied weight's other uses), which is returned
    held = torch.randn(B, V, p, dtype=torch.float64)
    before = held.clone()
    assert embedding_per_sample_grads(ids, o, V, padding_idx, out=held) is held
    close(held, before + expected)


def test_embedding_per_sample_grads_refuses_a_tensor_to_add_into_of_another_shape_or_dtype():
    ids, o = torch.randint(0, 5, (2, 3)), torch.randn(2, 3, 4)
    for out in (torch.zeros(2, 6, 4), torch.zeros(2, 5, 4, dtype=torch.float64)):
        with pytest.raises(ValueError, match="out must be"):
            embedding_per_sample_grads(ids, o, 5, None, out=out)


def test_embedding_norms_take_int32_ids_and_never_synchronise_with_the_host():
    """The norms' shapes do not depend on how many distinct tokens a batch holds (no torch.unique,
    no mask indexing): nothing waits for the device, and a CUDA graph can capture them."""
    from pdpfast.graphs import no_host_sync

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 6, (5, 9), generator=g)
    o = torch.randn(5, 9, 4, dtype=torch.float64, generator=g)
    expected = sq(per_sample_embedding(ids, o, 6, 1))
    with no_host_sync():
        got = embedding_sq_norms(ids.int(), o, 6, 1)
    close(got, expected)


def test_embedding_repeated_tokens_add_before_squaring():
    """‖G_i‖² sums the output gradients of a repeated token first: ‖o_1 + o_2‖², not ‖o_1‖² + ‖o_2‖²."""
    ids = torch.tensor([[3, 3]])
    o = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]], dtype=torch.float64)
    assert embedding_sq_norms_reference(ids, o, 5, None).item() == pytest.approx(4.0)
    assert embedding_sq_norms_reference(ids, o, 5, 3).item() == 0.0


# ------------------------------------------------------------------------------------------ conv

CONV_CASES = {
    "conv1d": lambda: nn.Conv1d(3, 4, 3, stride=2, padding=1),
    "conv1d-same-even": lambda: nn.Conv1d(2, 3, 4, padding="same"),
    "conv1d-depthwise-dilation": lambda: nn.Conv1d(3, 6, 3, groups=3, dilation=2, padding_mode="reflect", padding=2),
    "conv2d": lambda: nn.Conv2d(3, 5, 3, stride=2, padding=1),
    "conv2d-rect-same": lambda: nn.Conv2d(2, 4, (2, 3), padding="same", dilation=(2, 1)),
    "conv2d-groups-nobias": lambda: nn.Conv2d(4, 6, 3, groups=2, stride=(1, 2), bias=False, padding_mode="circular",
                                              padding=1),
    "conv2d-1x1": lambda: nn.Conv2d(3, 2, 1),
}


def conv_input(module, B):
    spatial = (9,) if isinstance(module, nn.Conv1d) else (7, 8)
    return torch.randn(B, module.in_channels, *spatial, dtype=torch.float64)


def per_sample_conv(module, x_pad, o):
    """(weight, bias) per-sample gradients of ⟨conv(x_pad_i), o_i⟩ by torch.func."""
    conv = F.conv1d if isinstance(module, nn.Conv1d) else F.conv2d

    def inner(weight, bias, x, out_grad):
        y = conv(x.unsqueeze(0), weight, bias, module.stride, 0, module.dilation, module.groups)
        return (y * out_grad.unsqueeze(0)).sum()

    bias = module.bias if module.bias is not None else torch.zeros(module.out_channels, dtype=torch.float64)
    return vmap(grad(inner, argnums=(0, 1)), in_dims=(None, None, 0, 0))(module.weight.detach(), bias.detach(),
                                                                          x_pad, o)


def force_conv_norm_path(monkeypatch, path):
    """Make the CPU reference take ``path`` for every convolution it can (norms and per-sample gradients)."""
    # implicit Gram wherever it applies (Conv1d/2d), or never
    monkeypatch.setattr(conv_ops, "_GRAM_FRACTION", float("inf") if path == "implicit-gram" else 0.0)
    # grouped-backward: the path large convolutions take
    monkeypatch.setattr(conv_ops, "_UNFOLD_LIMIT", 0 if path == "grouped-backward" else 1 << 40)
    # per-sample gradients by im2col and a batched GEMM (tiny fan-ins on a CPU): for every layer, or never
    bmm = path == "unfold-bmm"
    monkeypatch.setattr(conv_ops, "_BMM_MAX_FAN_IN", 1 << 40 if bmm else -1)


CONV_NORM_PATHS = ["unfold", "grouped-backward", "implicit-gram", "unfold-bmm"]


@pytest.mark.parametrize("name", list(CONV_CASES))
@pytest.mark.parametrize("B", [1, 4])
@pytest.mark.parametrize("path", CONV_NORM_PATHS)
def test_conv_norms_and_clipped_sums(name, B, path, monkeypatch):
    force_conv_norm_path(monkeypatch, path)
    module = CONV_CASES[name]().double()
    x = conv_input(module, B)
    x_pad = conv_ops.conv_pad(x, module)
    # the padded input reproduces the module's own output with padding 0
    conv = F.conv1d if isinstance(module, nn.Conv1d) else F.conv2d
    y = conv(x_pad, module.weight, module.bias, module.stride, 0, module.dilation, module.groups)
    close(y.detach(), module(x).detach())
    o = torch.randn_like(y).detach()
    gw, gb = per_sample_conv(module, x_pad, o)
    w = torch.rand(B, dtype=torch.float64)
    close(conv_ops.conv_weight_sq_norms(x_pad, o, module), sq(gw))
    close(conv_ops.conv_bias_sq_norms(o), sq(gb))
    close(conv_ops.conv_per_sample_grads(x_pad, o, module), gw)
    grad_w, grad_b = conv_ops.conv_clipped_grads(x_pad, o, w, module)
    close(grad_w, weighted_sum(w, gw))
    close(grad_b, weighted_sum(w, gb))
    grad_w, grad_b = conv_ops.conv_clipped_grads(x_pad, o, None, module)
    close(grad_w, gw.sum(0))
    close(grad_b, gb.sum(0))


ZERO_PADDED_CONVS = {
    "conv1d": CONV_CASES["conv1d"],
    "conv2d": CONV_CASES["conv2d"],
    "conv2d-same-odd-dilated": lambda: nn.Conv2d(3, 4, 3, padding="same", dilation=2, groups=1),
    "conv2d-asym-pad-groups": lambda: nn.Conv2d(4, 6, (3, 5), padding=(1, 2), groups=2, stride=(2, 1)),
    "conv3d": lambda: nn.Conv3d(2, 3, 3, padding=1, stride=(1, 2, 1)),
}


@pytest.mark.parametrize("name", list(ZERO_PADDED_CONVS))
@pytest.mark.parametrize("path", CONV_NORM_PATHS)
def test_conv_ops_pad_themselves_exactly_as_conv_pad(name, path, monkeypatch):
    """A DP conv with symmetric zero padding keeps its input unpadded (no copy) and hands its
    padding to the ops: every op equals the same op on the padded input."""
    from pdpfast.nn.conv import DPConv1d, DPConv2d, DPConv3d

    force_conv_norm_path(monkeypatch, path)
    module = ZERO_PADDED_CONVS[name]().double()
    dp_class = {1: DPConv1d, 2: DPConv2d, 3: DPConv3d}[module.weight.dim() - 2]
    padding = dp_class.own_padding(module)
    assert padding is not None and any(padding)
    spatial = {1: (9,), 2: (7, 8), 3: (5, 6, 4)}[module.weight.dim() - 2]
    x = torch.randn(3, module.in_channels, *spatial, dtype=torch.float64)
    x_pad = conv_ops.conv_pad(x, module)
    o = torch.randn_like(module(x)).detach()
    w = torch.rand(3, dtype=torch.float64)
    close(conv_ops.conv_weight_sq_norms(x, o, module, padding), conv_ops.conv_weight_sq_norms(x_pad, o, module))
    close(conv_ops.conv_per_sample_grads(x, o, module, padding), conv_ops.conv_per_sample_grads(x_pad, o, module))
    for a, b in zip(conv_ops.conv_clipped_grads(x, o, w, module, padding=padding),
                    conv_ops.conv_clipped_grads(x_pad, o, w, module)):
        close(a, b)


def test_dp_conv_pads_its_input_only_where_the_convolution_cannot():
    from pdpfast.nn.conv import DPConv1d, DPConv2d

    assert DPConv2d.own_padding(nn.Conv2d(3, 4, 3, padding=1)) == (1, 1)
    assert DPConv1d.own_padding(nn.Conv1d(3, 4, 5, padding="same")) == (2,)
    assert DPConv2d.own_padding(nn.Conv2d(3, 4, 2, padding="same")) is None  # asymmetric
    assert DPConv2d.own_padding(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")) is None


@pytest.mark.parametrize("channels,side,stride,expected", [
    (512, 4, 1, True), (256, 8, 1, True), (64, 8, 1, True),       # few positions, wide channels
    (64, 32, 1, False), (64, 16, 1, False), (3, 32, 1, False),    # many positions
    (128, 16, 2, False),                                          # a stride-2 stage entry: a near tie
])
def test_conv_reference_takes_the_implicit_gram_where_it_is_cheap(channels, side, stride, expected):
    """The CPU norm routes by multiply-adds: the implicit Gram for the late ResNet stages, never
    for the early ones, where its P² term dwarfs the direct form."""
    module = nn.Conv2d(channels, 2 * channels if stride == 2 else channels, 3, padding=1, stride=stride)
    out_side = (side - 1) // stride + 1
    gram, direct = conv_ops._implicit_gram_costs((64, channels, side + 2, side + 2),
                                                 (64, module.out_channels, out_side, out_side), module)
    assert (gram <= conv_ops._GRAM_FRACTION * direct) is expected


def test_conv_calls_with_a_cheap_implicit_gram_form_no_per_sample_gradients():
    """Book-keeping forms a small conv layer's per-sample gradients, unless the implicit Gram gives
    its norms for less (then nothing of size B × |W| is kept for it)."""
    from pdpfast.nn import convert
    from pdpfast.nn.rules import rule_for

    wide_late, narrow_early = convert(nn.Sequential(nn.Conv2d(64, 128, 3, padding=1), nn.Conv2d(3, 8, 3, padding=1)))
    rule = rule_for(wide_late)
    x, o = torch.randn(4, 64, 8, 8), torch.randn(4, 128, 8, 8)
    assert conv_ops.implicit_gram_pays(x, o, wide_late, wide_late.own_padding())
    assert not rule.materializes_call(wide_late, x, o)
    x, o = torch.randn(4, 3, 8, 8), torch.randn(4, 8, 8, 8)
    assert not conv_ops.implicit_gram_pays(x, o, narrow_early, narrow_early.own_padding())
    assert rule.materializes_call(narrow_early, x, o)


@pytest.mark.parametrize("name", ["conv1d", "conv2d-groups-nobias"])
def test_conv_empty_batch(name):
    module = CONV_CASES[name]().double()
    x_pad = conv_ops.conv_pad(conv_input(module, 0), module)
    conv = F.conv1d if isinstance(module, nn.Conv1d) else F.conv2d
    o = conv(x_pad, module.weight, None, module.stride, 0, module.dilation, module.groups).detach()
    assert conv_ops.conv_weight_sq_norms(x_pad, o, module).shape == (0,)
    assert conv_ops.conv_per_sample_grads(x_pad, o, module).shape == (0, *module.weight.shape)
    grad_w, _ = conv_ops.conv_clipped_grads(x_pad, o, torch.ones(0, dtype=torch.float64), module)
    assert grad_w.shape == module.weight.shape and not grad_w.any()


# ------------------------------------------------------------------------------------------ norm layers

NORM_CASES = {
    "layernorm": (lambda: nn.LayerNorm((3, 4)), (5, 3, 4)),
    "layernorm-nobias": (lambda: nn.LayerNorm(6, bias=False), (6,)),
    "groupnorm": (lambda: nn.GroupNorm(2, 6), (6, 4, 3)),
    "groupnorm-no-spatial": (lambda: nn.GroupNorm(3, 6), (6,)),
    "rmsnorm": (lambda: nn.RMSNorm((2, 5)), (3, 2, 5)),
    "rmsnorm-eps": (lambda: nn.RMSNorm(4, eps=1e-3), (4,)),
}
NORM_OPS = {nn.LayerNorm: norm_ops.layer_norm_per_sample_grads, nn.GroupNorm: norm_ops.group_norm_per_sample_grads,
            nn.RMSNorm: norm_ops.rms_norm_per_sample_grads}


@pytest.mark.parametrize("chunk", [None, 1, 40], ids=["whole-batch", "sample-by-sample", "chunks-of-samples"])
@pytest.mark.parametrize("name", list(NORM_CASES))
def test_norm_layer_per_sample_grads(name, chunk, monkeypatch):
    if chunk is not None:  # CPU batches are taken a few samples at a time: any chunking is exact
        monkeypatch.setattr(norm_ops, "_CPU_CHUNK_ELEMENTS", chunk)
        # the torch route (the C++ GroupNorm kernel, when built, has its own tests: test_norm_kernel.py)
        monkeypatch.setattr(norm_ops, "_CPP_MISSING", "the torch route, forced by the test")
    build, shape = NORM_CASES[name]
    module = build().double()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    x = torch.randn(7, *shape, dtype=torch.float64)
    o = torch.randn(7, *shape, dtype=torch.float64)
    names = [n for n, _ in module.named_parameters()]
    params = {n: p.detach() for n, p in module.named_parameters()}

    def inner(params, xi, oi):
        return (torch.func.functional_call(module, params, (xi.unsqueeze(0),)) * oi.unsqueeze(0)).sum()

    expected = vmap(grad(inner), in_dims=(None, 0, 0))(params, x, o)
    got = NORM_OPS[type(module)](x, o, module)
    assert sorted(got) == sorted(names)
    for n in names:
        close(got[n], expected[n])


# ------------------------------------------------------------------------------------------ clip weights


def test_clip_weights_formula():
    norms = torch.tensor([0.0, 0.5, 1.0, 2.0, 4.0, 3.0], dtype=torch.float64)
    bounds = torch.tensor([1.0, 1.0, 1.0, 1.0, 2.0, 0.5], dtype=torch.float64)
    expected = [min(1.0, c / (n + CLIP_EPS)) for n, c in zip(norms.tolist(), bounds.tolist())]
    got = clip_weights(norms ** 2, bounds)
    close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-15)
    assert got[0] == 1.0 and got[1] == 1.0  # unclipped samples keep weight exactly 1
    assert got[2] < 1.0  # ‖g‖ = c: the 1e-6 makes the clipped norm strictly below c
    clipped = got * norms
    assert (clipped <= bounds).all()


def test_clip_weights_mask_and_automatic():
    sq_norms = torch.rand(7, dtype=torch.float64) * 4
    bounds = torch.rand(7, dtype=torch.float64) + 0.5
    mask = torch.tensor([1, 0, 1, 1, 0, 0, 1], dtype=torch.float64)
    norms = sq_norms.sqrt()
    close(clip_weights(sq_norms, bounds, mask),
          mask * torch.clamp(bounds / (norms + CLIP_EPS), max=1.0), rtol=1e-15)
    close(clip_weights(sq_norms, bounds, mask, automatic_gamma=0.01),
          mask * bounds / (norms + 0.01), rtol=1e-15)
    # automatic clipping does not cap at 1: small gradients are scaled up towards c_i
    tiny = clip_weights(torch.tensor([1e-6], dtype=torch.float64), torch.tensor([1.0]), None, 0.01)
    assert tiny.item() > 1.0
    # masked rows are exactly zero even when their norm is inf/huge
    got = clip_weights(torch.tensor([1e300, 1.0], dtype=torch.float64), torch.ones(2), torch.tensor([0, 1]))
    assert got[0] == 0.0 and got[1] == pytest.approx(1 / (1 + CLIP_EPS))


def test_clip_weights_for_groups_broadcast_over_bounds():
    """Per-layer clipping: (K, B) group norms against bounds c_i·C_k."""
    K, B = 3, 5
    sq_norms = torch.rand(K, B, dtype=torch.float64)
    shares = torch.tensor([0.6, 0.48, 0.64], dtype=torch.float64)
    c = torch.rand(B, dtype=torch.float64) + 0.2
    bounds = shares[:, None] * c[None, :]
    mask = (torch.rand(B) < 0.5).double()
    got = clip_weights(sq_norms, bounds, mask)
    assert got.shape == (K, B)
    for k in range(K):
        close(got[k], clip_weights(sq_norms[k], c * shares[k], mask), rtol=1e-15)
    # each record's total clipped norm ≤ c_i when Σ C_k² = 1
    assert math.isclose(float((shares ** 2).sum()), 1.0)
    total = ((got * sq_norms.sqrt()) ** 2).sum(0).sqrt()
    assert (total <= c * (1 + 1e-12)).all()


def test_clip_weights_dtypes():
    sq_norms = torch.rand(4)
    assert clip_weights(sq_norms, torch.ones(4, dtype=torch.float64)).dtype == torch.float32
    assert clip_weights(sq_norms.double(), torch.ones(4)).dtype == torch.float64
    assert clip_weights(torch.zeros(0), torch.ones(0)).shape == (0,)


@pytest.mark.parametrize("automatic_gamma", [None, 0.3])
def test_clip_weights_of_norms_that_require_grad_follow_the_formula_and_backpropagate(automatic_gamma):
    # inputs that require grad take the torch route because the C++ op has no backward; that route
    # used out= and in-place ops autograd refuses
    sq = torch.tensor([0.25, 4.0, 0.0, 9.0], dtype=torch.float64, requires_grad=True)
    bounds = torch.tensor([1.0, 1.0, 0.5, 0.0], dtype=torch.float64)
    rounding = torch.full((4,), 0.01, dtype=torch.float64)
    w = clip_weights(sq, bounds, automatic_gamma=automatic_gamma, loss_scale=2.0, rounding=rounding)
    root = sq.detach().sqrt() + 0.01
    expected = (bounds / (root + CLIP_EPS / 2)).clamp(max=2.0) if automatic_gamma is None else \
        bounds / (root + automatic_gamma / 2)
    torch.testing.assert_close(w.detach(), expected)
    w.sum().backward()
    assert sq.grad is not None and torch.isfinite(sq.grad[[0, 1, 3]]).all()


@pytest.mark.parametrize("loss_scale", [1.0, 34.0, 256.0, 4096.0])
def test_fp16_norms_of_masked_rows_weigh_zero_at_every_loss_scale(loss_scale):
    # ε/s underflowed in fp16 for s ≳ 34, and a masked row's 0 / 0 made its weight NaN
    w = clip_weights(torch.tensor([0.0, 4.0], dtype=torch.float16), torch.tensor([0.0, 1.0], dtype=torch.float16),
                     loss_scale=loss_scale)
    assert w.dtype == torch.float16 and w[0].item() == 0.0
    assert w[1].item() == pytest.approx(min(loss_scale, 0.5), rel=1e-3)


def test_partial_sums_without_their_trailing_dim_are_refused_not_summed_over_the_records():
    sq, bounds = torch.tensor([0.01, 0.01, 100.0]), torch.ones(3)
    with pytest.raises(ValueError, match=r"parts=True: sq_norms must have clip_norms' dims and a trailing dim of "
                                         r"partial sums, got sq_norms of shape \(3,\)"):
        clip_weights(sq, bounds, parts=True)
    torch.testing.assert_close(clip_weights(sq[:, None], bounds, parts=True), clip_weights(sq, bounds))


def test_clip_scale_of_an_empty_mean_loss_batch_reports_its_route_and_is_contiguous():
    from pdpfast.ops.clip import PendingWeights, clip_scale, clip_scale_route

    x = torch.randn(6, 4).t()                          # (4, 6), not contiguous
    weights = PendingWeights(torch.ones(4), torch.ones(4), None, 0.0, None, False)
    assert clip_scale_route(x, weights).startswith("torch (loss scale 0")
    scaled, w = clip_scale(x, weights)
    assert scaled.is_contiguous() and not scaled.any() and not w.any()


@pytest.mark.parametrize("shape", [(2, 4, 0), (2, 4, 3, 0)])
def test_group_norm_of_inputs_without_positions_has_zero_gradients_on_every_route(shape):
    x, o = torch.randn(shape), torch.randn(shape)
    assert norm_ops.group_norm_kernel(x, o).startswith("torch (no positions")
    grads = norm_ops.group_norm_affine_grads(x, o, 2, 1e-5, True)
    assert all(torch.equal(g, torch.zeros(2, 4)) for g in grads.values())


# ------------------------------------------------------------------------------------------ noise (CPU)
def test_reference_noise_drawn_on_threads_equals_noise_drawn_in_turn(monkeypatch):
    """The pool only draws ahead: each tensor's noise comes from its own (seed, step, index)
    generator, so the result is bitwise that of drawing one tensor after another."""
    from pdpfast.ops import noise

    shapes = [(1 << 16,), (300, 400), (5,), (1 << 17,)] + [(70_000,)] * 6  # more tensors than the draw window
    noisy = []
    for parallel_min in (0, 1 << 60):
        monkeypatch.setattr(noise, "_PARALLEL_MIN_ELEMENTS", parallel_min)
        grads = [torch.full(s, 2.0) for s in shapes]
        noise.add_noise_reference_(grads, 0.5, seed=3, step=9)
        noisy.append(grads)
    for threaded, in_turn in zip(*noisy):
        assert torch.equal(threaded, in_turn)
    assert all(not torch.equal(g, torch.full_like(g, 2.0)) for g in noisy[0])


@pytest.mark.parametrize("layout_known", [True, False])
def test_cpu_noise_of_steps_whose_seeds_share_their_low_32_bits_is_not_the_same_noise(monkeypatch, layout_known):
    """torch's CPU generator keeps 32 bits of a seed: with seed 0, one tensor's (step, index) seeds of steps
    18539 and 147295 agree there, and their noise was bit for bit the same, so the difference of the
    two released updates carried none. The whole generator state now follows all 63 bits (numpy's
    PCG64 draws where torch's state layout is not the one known)."""
    from pdpfast.ops import noise

    monkeypatch.setattr(noise, "_mt_state_layout_known", lambda: layout_known)
    a, b = noise.step_seed(0, 18539, 0), noise.step_seed(0, 147295, 0)
    assert a != b and a & 0xFFFFFFFF == b & 0xFFFFFFFF      # the collision manual_seed alone would see
    first, second = torch.zeros(1 << 16), torch.zeros(1 << 16)
    noise.add_noise_reference_([first], 1.0, seed=0, step=18539)
    noise.add_noise_reference_([second], 1.0, seed=0, step=147295)
    assert abs(float(torch.corrcoef(torch.stack([first, second]))[0, 1])) < 0.02     # independent draws
    again = torch.zeros(1 << 16)
    noise.add_noise_reference_([again], 1.0, seed=0, step=18539)
    assert torch.equal(first, again)                                                   # still reproducible
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        z = noise._cpu_normal((1 << 18,), dtype, 2**62 + 5).double()
        assert abs(z.mean().item()) < 0.01 and abs(z.std().item() - 1) < 0.01
    assert not torch.equal(noise._cpu_normal((64,), torch.float32, 12345),
                           noise._cpu_normal((64,), torch.float32, 12345 + (7 << 32)))


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64])
def test_cpu_noise_refuses_a_tensor_that_is_not_floating_point(dtype):
    from pdpfast.ops import noise

    with pytest.raises(TypeError, match=f"floating-point gradients, got a {dtype} tensor"):
        noise.add_noise_reference_([torch.zeros(4, dtype=dtype)], 1.0, seed=0, step=0)


def test_the_cpu_generator_state_layout_is_the_one_the_noise_writes():
    # on this torch the fast route (torch's mt19937, its state written whole) is the one taken
    from pdpfast.ops import noise

    assert noise._mt_state_layout_known()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_reference_noise_threads_never_start_openmp_teams():
    """Threads that ran a parallel torch op own an OpenMP team; libgomp then sees more threads than
    cores and stops spin-waiting, which slowed every later multi-threaded op of the process (12-30%
    on 2 cores). The noise pool's threads only draw: the process gains the pool's threads, no more."""
    script = """
import os, torch
from pdpfast.ops import noise
torch.set_num_threads(2)
torch.ones(1 << 20).add_(1)  # the main thread's team exists before counting
before = len(os.listdir("/proc/self/task"))
for step in range(3):
    noise.add_noise_reference_([torch.zeros(1 << 19) for _ in range(4)], 1.0, seed=0, step=step)
print(len(os.listdir("/proc/self/task")) - before)
"""
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert int(out.stdout.split()[-1]) <= 2  # the pool's two threads


# ------------------------------------------------------------------------------------------ workspace


@pytest.mark.parametrize("B,per_sample,budget", [(64, 73728, 1 << 19), (64, 864, 1 << 20), (5, 3, 6), (7, 10, 1),
                                                   (1, 5, 1), (0, 5, 10), (10, 0, 3)])
def test_batch_chunks_cover_the_batch_evenly_within_the_budget(B, per_sample, budget):
    from pdpfast.ops import workspace

    chunks = workspace.batch_chunks(B, per_sample, budget)
    sizes = [s.stop - s.start for s in chunks]
    assert [i for s in chunks for i in range(s.start, s.stop)] == list(range(B))  # in order, no gap or overlap
    assert all(size >= 1 for size in sizes)
    per_chunk = max(1, budget // max(1, per_sample))  # a chunk holds one sample whatever the budget
    assert all(size <= per_chunk for size in sizes)
    assert len(chunks) == -(-B // per_chunk)  # no more chunks than the budget needs
    assert not sizes or max(sizes) - min(sizes) <= 1


def test_workspace_reuses_only_buffers_it_lent_and_got_back(monkeypatch):
    from pdpfast.ops import workspace

    monkeypatch.setattr(workspace, "MIN_BYTES", 0)
    workspace.clear()
    a = workspace.empty((3, 4), torch.float32, "cpu")
    held = workspace.empty((3, 4), torch.float32, "cpu")
    assert a.data_ptr() != held.data_ptr()
    assert a.shape == (3, 4) and a.is_contiguous() and a.storage_offset() == 0
    workspace.recycle([a, torch.empty(3, 4), held.view(12)])  # a foreign tensor and a view are ignored
    again = workspace.empty((3, 4), torch.float32, "cpu")
    assert again.data_ptr() == a.data_ptr()
    fresh = workspace.empty((3, 4), torch.float32, "cpu")
    assert fresh.data_ptr() not in (held.data_ptr(), again.data_ptr())  # held was never returned
    assert workspace.empty((4, 3), torch.float32, "cpu").shape == (4, 3)
    workspace.recycle([fresh])
    assert workspace.empty((3, 4), torch.float64, "cpu").dtype == torch.float64  # keyed by dtype too
    workspace.clear()


def test_workspace_keeps_at_most_max_bytes(monkeypatch):
    from pdpfast.ops import workspace

    monkeypatch.setattr(workspace, "MIN_BYTES", 0)
    monkeypatch.setattr(workspace, "MAX_BYTES", 100)
    workspace.clear()
    big, small = workspace.empty((200,), torch.uint8, "cpu"), workspace.empty((50,), torch.uint8, "cpu")
    big_ptr, small_ptr = big.data_ptr(), small.data_ptr()
    workspace.recycle([big, small])
    assert workspace._free_bytes <= 100
    assert workspace.empty((200,), torch.uint8, "cpu").data_ptr() != big_ptr
    assert workspace.empty((50,), torch.uint8, "cpu").data_ptr() == small_ptr
    workspace.clear()


def test_workspace_over_poisson_batch_sizes_reuses_its_buffers_and_keeps_only_the_backwards_peak(monkeypatch):
    """Each step lends two buffers per layer shape at once (sizes set by a Poisson batch size, new at every
    step) and takes them back: the pool serves most steps from buffers it already has, and never holds
    more buffers than were lent at once, nor a buffer for sizes the run stopped asking for."""
    from pdpfast.ops import workspace

    monkeypatch.setattr(workspace, "MIN_BYTES", 0)
    workspace.clear()
    sizes = np.random.default_rng(0).poisson(64, 200)
    sizes[100:] += 200  # the batches grow for good: the small buffers go stale
    made, empty = [], torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: made.append(args) or empty(*args, **kwargs))
    for B in sizes:
        lent = [workspace.empty((int(B), 16, 8), torch.float32, "cpu") for _ in range(2)]
        lent += [workspace.empty((int(B), 3, 8), torch.float32, "cpu") for _ in range(2)]
        for t in lent:
            assert t.shape[0] == B and t.is_contiguous()
            t.fill_(float(B))
        assert len({t.data_ptr() for t in lent}) == 4  # none lent twice at once
        assert all(float(t.min()) == float(t.max()) == float(B) for t in lent)  # no two overlap
        workspace.recycle(lent)
        ready = workspace._free[(torch.float32, torch.device("cpu"))]
        assert len(ready) <= 4
    # a fresh buffer only when a batch outgrew every one before it (38 of 800 here; 272 when buffers were
    # pooled by exact shape, and all 272 kept)
    assert len(made) <= 60
    assert min(size for size, _, _ in ready) >= 3 * 8 * 200  # nothing kept for the first 100 steps' sizes
    workspace.clear()


def test_per_sample_gradients_are_formed_within_the_workspace_budget(monkeypatch):
    from pdpfast.ops import workspace

    a, o = torch.randn(4, 8, 5), torch.randn(4, 8, 3)
    base = workspace.lent_bytes()
    monkeypatch.setattr(workspace, "MAX_BYTES", base + 2 * 4 * 15 * 4)  # room for two (4, 3, 5) fp32 buffers
    assert linear_ops.prefer_per_sample(4 * 15, a, o)
    held = [linear_ops.linear_per_sample_grads(a, o) for _ in range(2)]
    assert workspace.lent_bytes() == base + 2 * 4 * 15 * 4
    assert not linear_ops.prefer_per_sample(4 * 15, a, o)  # a third would exceed the budget
    workspace.recycle(held[:1])
    del held
    assert linear_ops.prefer_per_sample(4 * 15, a, o)



@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model,B,T,calls", [
    ("bert-base", 32, 128, [(768, 768), (768, 3072), (3072, 768)]),
    ("gpt2-small", 8, 512, [(768, 2304), (768, 768), (768, 3072), (3072, 768)])])
def test_gpu_per_layer_route_at_real_shapes(model, B, T, calls, dtype, captured, monkeypatch):
    """The GPU's cost model (``prefer_per_sample`` where the kernels run) at real models' calls: per-layer
    clipping forms GPT-2's fp32 per-sample gradients (T = 512: the norm costs 2.7-4.3× three passes
    over them), eager or captured; in bf16 those of its 768→768 call only (whose norm takes the direct
    path: 1.3×; its other calls' Gram norms 0.8-0.9×, as measured on an H100), and only in a CUDA
    graph's capture: an eager bf16 step is host-bound, and forming them takes the host more ops than
    the GPU time it saves (``FORM_HOST_BYTES``). Never BERT-base's (T = 128); book-keeping never forms
    them on a GPU."""
    monkeypatch.setattr(linear_ops, "use_triton", lambda *tensors: True)
    monkeypatch.setattr(linear_ops, "_capturing", lambda o: captured)
    x, o = torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype)
    cuda = torch.device("cuda")  # only read by split_gram; nothing is allocated there
    for d, p in calls:
        cost = lambda: linear_ops.norm_madds(B, T, d, p, cuda)  # noqa: E731
        per_layer = linear_ops.prefer_per_sample(B * d * p, x, o, kept=False, norm_cost=cost)
        expected = model == "gpt2-small" and (dtype == torch.float32 or ((d, p) == (768, 768) and captured))
        assert per_layer is expected, (d, p)
        assert not linear_ops.prefer_per_sample(B * d * p, x, o, kept=True, norm_cost=cost)
        assert not linear_ops.prefer_per_sample(B * d * p, x, o, kept=False)  # cost unknown: never


def test_an_eager_low_precision_call_forms_its_per_sample_gradients_only_where_they_save_the_host_ops_too(
        monkeypatch):
    """Eager, in bf16, per-layer clipping forms a call's per-sample gradients once the GPU time they save
    covers the host's extra ops (``FORM_HOST_BYTES`` of the GPU's traffic) and not before; in fp32,
    and in a capture, once they save GPU time."""
    monkeypatch.setattr(linear_ops, "use_triton", lambda *tensors: True)
    elements = 1000
    for dtype in (torch.bfloat16, torch.float32):
        x, o = torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype)
        rate = linear_ops.GPU_FLOPS_PER_BYTE[dtype]
        nbytes = elements * o.element_size()
        for captured in (False, True):
            monkeypatch.setattr(linear_ops, "_capturing", lambda o, _c=captured: _c)
            host = linear_ops.FORM_HOST_BYTES if dtype == torch.bfloat16 and not captured else 0
            edge = (3 * nbytes + host) * rate // 2  # 2·madds = (3·bytes + host)·rate
            assert not linear_ops.prefer_per_sample(elements, x, o, kept=False, norm_cost=lambda: edge)
            assert linear_ops.prefer_per_sample(elements, x, o, kept=False, norm_cost=lambda: edge + 1), \
                (dtype, captured)


def test_norm_madds_counts_the_form_the_reference_computes():
    """``norm_madds`` is the rank-one, Gram (whole or split in halves) or direct form's multiply-adds."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert linear_ops.norm_madds(4, 1, 7, 5, cpu) == 4 * (7 + 5)
    assert linear_ops.use_gram(16, 64, 64) and not linear_ops.split_gram(2, 16, 64, 64, cpu)
    assert linear_ops.norm_madds(2, 16, 64, 64, cpu) == 2 * linear_ops.gram_cost(16, 64, 64)
    assert linear_ops.split_gram(8, 512, 768, 3072, cuda)
    assert linear_ops.norm_madds(8, 512, 768, 3072, cuda) == 3 * 8 * linear_ops.gram_cost(512, 768, 3072) // 4
    assert not linear_ops.use_gram(512, 768, 768)
    assert linear_ops.norm_madds(8, 512, 768, 768, cuda) == 8 * linear_ops.direct_cost(512, 768, 768)


def test_weights_as_casts_the_same_weights_once():
    """Book-keeping hands every layer call the same clip weights: in bf16 they are cast once per
    backward, and new weights (the next backward) are cast afresh, never served stale."""
    w = torch.tensor([0.5, 1.0, 0.25])
    first = linear_ops.weights_as(w, torch.bfloat16)
    assert first.dtype == torch.bfloat16 and torch.equal(first.float(), w)
    assert linear_ops.weights_as(w, torch.bfloat16) is first
    assert linear_ops.weights_as(w, torch.float32) is w
    half = linear_ops.weights_as(w, torch.float16)
    assert half.dtype == torch.float16 and linear_ops.weights_as(w, torch.bfloat16) is not first
    fresh = torch.tensor([0.125, 2.0, 1.0])
    assert torch.equal(linear_ops.weights_as(fresh, torch.bfloat16).float(), fresh)
