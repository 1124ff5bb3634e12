"""Every registered DP layer family runs its private step without a host synchronisation.

Forward, backward, per-sample norms, clip weights and clipped sums of each family run under
``pdpfast.graphs.no_host_sync`` (which raises on ``.item()``, ``bool(t)``, ``nonzero``,
``torch.unique``, boolean-mask indexing, ...), in every clipping mode (``MODES``: book-keeping flat
and per-layer, ghost, automatic clipping, per-group bounds with each group's norms kept, a bf16
autocast forward): on CUDA nothing then waits for the device, and a CUDA graph can capture the step.
Each test runs two physical batches, the second adding into ``.grad``; their bounds and mask (a
padded row included) are opened outside the guard, as the engine opens them (``begin_batch`` checks
them on the host).

``CASES`` holds, for each key of ``pdpfast.nn.rules.registered_layers()`` and each form of
``registered_forms()``, small models that use the
family with the options that take different code paths (strides, groups, padding modes, padding
indices, masks, tied or reused parameters, ...); a family registered later without a case fails
``test_every_registered_layer_family_has_a_case`` by name. Each model ends in a parameter-free head,
so the family's own layers hold every trainable parameter (HF ``ViTEmbeddings`` and the like also
hold their patch convolution).

``ROUTES`` push the calls of a small model through the clipping state's other routes, which the
defaults keep for larger layers or other devices: no stacking of small calls, norms from the rules'
formulas instead of formed per-sample gradients, torch's routes instead of the ``pdpfast._C`` kernels
(GroupNorm / InstanceNorm gradients, clip weights), batches cut into one-sample chunks, per-layer
stacks flushed after every call.

Not here: EmbeddingBag's 1-D input with offsets (see ``CASES``), and what only a GPU shows (e.g. a
copy from pageable host memory inside the step, which the guard cannot see on a CPU).
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pdpfast
import pdpfast.clipping
from pdpfast.graphs import no_host_sync
from pdpfast.nn.rules import registered_forms, registered_layers
from pdpfast.ops import clip as clip_ops
from pdpfast.ops import conv as conv_ops
from pdpfast.ops import linear as lin_ops
from pdpfast.ops import norm as norm_ops

B = 4
CLASSES = 3
MASK = torch.tensor([1.0, 1.0, 0.0, 1.0])  # row 2 is a padded row: its clip weight must be 0
PADDED_ROW = 2


class Probe(nn.Module):
    """The layers of one family, ``body(self, *inputs)``, then a head without parameters to 3 logits."""

    def __init__(self, body: Callable | None = None, **layers: nn.Module):
        super().__init__()
        for name, layer in layers.items():
            self.add_module(name, layer)
        self.body = body if body is not None else (lambda m, x: m.layer(x))

    def forward(self, *inputs):
        out = self.body(self, *inputs)
        return F.adaptive_avg_pool1d(out.flatten(1).unsqueeze(1), CLASSES).squeeze(1)


def probe(body: Callable | None = None, **layers: nn.Module) -> Callable[[], nn.Module]:
    """A factory of fresh probes: ``convert`` changes layers in place, so each test gets copies."""
    return lambda: Probe(body, **copy.deepcopy(layers))


def randn(*shape: int) -> Callable[[], tuple]:
    return lambda: (torch.randn(*shape),)


# ---------------------------------------------------------------------------------------------- cases


def ids_with_repeats(vocab: int, *shape: int, padding_idx: int | None = None) -> torch.Tensor:
    ids = torch.randint(1, vocab, (B, *shape))
    flat = ids.view(B, -1)
    flat[:, 1] = flat[:, 0]  # a repeated token in every sample
    if padding_idx is not None:
        flat[:, -1] = padding_idx  # a padding token in every sample
        flat[0, :] = padding_idx   # a sample of padding only
    return ids


def tied_embedding_and_head() -> nn.Module:
    emb, head = nn.Embedding(10, 4, padding_idx=0), nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # one parameter, two layers: clipped from its formed per-sample gradients
    return Probe(lambda m, ids: m.head(torch.tanh(m.emb(ids))), emb=emb, head=head)


def token_and_position_embeddings() -> nn.Module:
    # position ids of shape (1, T) are expanded to the batch by the clipping state
    return Probe(lambda m, ids, positions: m.tok(ids) + m.pos(positions), tok=nn.Embedding(10, 4),
                 pos=nn.Embedding(6, 4))


def frozen(factory: Callable[[], nn.Module], prefix: str) -> Callable[[], nn.Module]:
    """``factory``'s model with the parameters whose names start with ``prefix`` frozen (BitFit-like)."""
    def build():
        model = factory()
        for name, p in model.named_parameters():
            if name.rsplit(".", 1)[-1].startswith(prefix):
                p.requires_grad_(False)
        return model
    return build


def attention(**options) -> nn.MultiheadAttention:
    return nn.MultiheadAttention(8, 2, batch_first=True, **options)


def self_attention(m, x, key_padding_mask=None, attn_mask=None, **options):
    out, weights = m.layer(x, x, x, key_padding_mask=key_padding_mask, attn_mask=attn_mask, **options)
    return out if weights is None else out + weights.flatten(1)[:, :8].unsqueeze(1)


def key_padding_mask(T: int) -> torch.Tensor:
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, -2:] = True
    mask[3, -1] = True
    return mask


def recurrent(m, x, *state):
    out, _ = m.layer(x, (state[0], state[1]) if len(state) == 2 else (state[0] if state else None))
    return out[:, -1] + out.mean(1)


def hf_config(config_name: str, **extra):
    import transformers

    return getattr(transformers, config_name)(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=24, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **extra)


def randomized_tokens(module: nn.Module) -> nn.Module:
    with torch.no_grad():  # HF starts some tokens at zero: give them a real spread
        for p in module.parameters():
            p.normal_(0.0, 0.5)
    return module


def vit_embeddings(use_mask_token: bool = False) -> nn.Module:
    from transformers.models.vit.modeling_vit import ViTEmbeddings

    emb = randomized_tokens(ViTEmbeddings(hf_config("ViTConfig"), use_mask_token=use_mask_token))
    if use_mask_token:
        return Probe(lambda m, pixels, masked: m.layer(pixels, bool_masked_pos=masked), layer=emb)
    return Probe(layer=emb)


def deit_embeddings() -> nn.Module:
    from transformers.models.deit.modeling_deit import DeiTEmbeddings

    return Probe(layer=randomized_tokens(DeiTEmbeddings(hf_config("DeiTConfig"))))


def dinov2_embeddings() -> nn.Module:
    from transformers.models.dinov2.modeling_dinov2 import Dinov2Embeddings

    emb = randomized_tokens(Dinov2Embeddings(hf_config("Dinov2Config")))
    emb.mask_token.requires_grad_(False)  # (1, d), used as mask_token.expand(B, T, -1): not batch-aligned
    return Probe(layer=emb)


def dinov2_layer_scale() -> nn.Module:
    from transformers.models.dinov2.modeling_dinov2 import Dinov2LayerScale

    return Probe(layer=Dinov2LayerScale(hf_config("Dinov2Config", layerscale_value=0.5)))


def hf_conv1d(*shapes: tuple[int, int]) -> Callable[[], nn.Module]:
    def build():
        from transformers.pytorch_utils import Conv1D

        layers = {f"c{i}": Conv1D(nf, nx) for i, (nf, nx) in enumerate(shapes)}

        def body(m, x):
            for i in range(len(shapes)):
                x = torch.tanh(getattr(m, f"c{i}")(x))
            return x
        return Probe(body, **layers)
    return build


class CopiedRMSNorm(nn.Module):
    """Hugging Face's RMSNorm, which each model family copies under its own name (``LlamaRMSNorm``)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d).normal_(1.0, 0.5))
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        hidden_states = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def two_calls(first: str = "a", second: str = "b"):
    return lambda m, x: getattr(m, second)(torch.tanh(getattr(m, first)(x)))


# family → {variant: (model factory, inputs factory)}; the inputs are model(*inputs), batch-first.
CASES: dict[type | str, dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple]]]] = {
    nn.Linear: {
        "2d-input-rank-one": (probe(layer=nn.Linear(6, 5)), randn(B, 6)),
        "3d-input-direct-norms-no-bias": (probe(layer=nn.Linear(4, 3, bias=False)), randn(B, 7, 4)),
        "3d-input-gram-norms": (probe(layer=nn.Linear(24, 24)), randn(B, 3, 24)),
        "4d-input": (probe(layer=nn.Linear(5, 4)), randn(B, 2, 3, 5)),
        # 1 MiB of per-sample gradients: pooled by the workspace and lent again to the second batch
        "long-sequence-split-gram": (probe(layer=nn.Linear(256, 256)), randn(B, 64, 256)),
        "same-shape-calls-stacked": (probe(two_calls(), a=nn.Linear(8, 8), b=nn.Linear(8, 8)), randn(B, 3, 8)),
        "one-layer-called-twice": (probe(two_calls("layer", "layer"), layer=nn.Linear(6, 6)), randn(B, 2, 6)),
        "bias-only-trainable-same-shape-calls": (
            frozen(probe(two_calls(), a=nn.Linear(8, 8), b=nn.Linear(8, 8)), "weight"), randn(B, 3, 8)),
    },
    nn.MultiheadAttention: {
        "self-bool-key-padding-need-weights": (
            probe(self_attention, layer=attention()), lambda: (torch.randn(B, 5, 8), key_padding_mask(5))),
        "self-float-per-head-mask-no-bias": (
            probe(self_attention, layer=attention(bias=False)),
            lambda: (torch.randn(B, 5, 8), None, torch.randn(B * 2, 5, 5))),
        "self-is-causal-no-weights": (
            probe(lambda m, x: self_attention(m, x, is_causal=True, need_weights=False,
                                              attn_mask=nn.Transformer.generate_square_subsequent_mask(
                                                  x.shape[1], device=x.device)),
                  layer=attention()),
            randn(B, 5, 8)),
        "self-per-head-weights": (
            probe(lambda m, x: self_attention(m, x, average_attn_weights=False), layer=attention()),
            randn(B, 5, 8)),
        "cross-key-is-value": (
            probe(lambda m, q, kv: m.layer(q, kv, kv, need_weights=False)[0], layer=attention()),
            lambda: (torch.randn(B, 5, 8), torch.randn(B, 6, 8))),
        "cross-three-inputs": (
            probe(lambda m, q, kv: m.layer(q, kv, kv.flip(1) * 0.5)[0], layer=attention()),
            lambda: (torch.randn(B, 5, 8), torch.randn(B, 6, 8))),
        "self-dropout": (probe(self_attention, layer=attention(dropout=0.25)), randn(B, 5, 8)),
    },
    nn.Conv1d: {
        "stride-dilation": (probe(layer=nn.Conv1d(3, 6, 3, stride=2, dilation=2)), randn(B, 3, 12)),
        "groups-same-reflect": (probe(layer=nn.Conv1d(4, 8, 3, groups=2, padding="same", padding_mode="reflect")),
                                randn(B, 4, 9)),
        "same-even-kernel": (probe(layer=nn.Conv1d(4, 4, 4, padding="same")), randn(B, 4, 9)),
        "circular-wide-no-bias": (probe(layer=nn.Conv1d(12, 12, 3, padding=1, padding_mode="circular", bias=False)),
                                  randn(B, 12, 10)),
        "one-layer-called-twice": (probe(two_calls("layer", "layer"), layer=nn.Conv1d(4, 4, 3, padding=1)),
                                   randn(B, 4, 8)),
    },
    nn.Conv2d: {
        "rgb-stride-padding": (probe(layer=nn.Conv2d(3, 8, 3, stride=2, padding=1)), randn(B, 3, 8, 8)),
        "groups-dilation-reflect": (
            probe(layer=nn.Conv2d(8, 8, 3, groups=2, dilation=2, padding=2, padding_mode="reflect")),
            randn(B, 8, 6, 6)),
        "same-circular-no-bias": (
            probe(layer=nn.Conv2d(4, 6, (3, 2), padding="same", padding_mode="circular", bias=False)),
            randn(B, 4, 5, 5)),
        "wide-few-positions-implicit-gram": (probe(layer=nn.Conv2d(16, 16, 3, padding=1)), randn(B, 16, 2, 2)),
        "same-shape-calls": (probe(two_calls(), a=nn.Conv2d(4, 4, 3, padding=1), b=nn.Conv2d(4, 4, 3, padding=1)),
                             randn(B, 4, 5, 5)),
        "bias-only-trainable": (frozen(probe(layer=nn.Conv2d(3, 4, 3)), "weight"), randn(B, 3, 5, 5)),
    },
    nn.Conv3d: {
        "stride-padding": (probe(layer=nn.Conv3d(2, 4, 3, stride=2, padding=1)), randn(B, 2, 5, 5, 5)),
        "groups-same-circular": (
            probe(layer=nn.Conv3d(4, 4, 3, groups=2, padding="same", padding_mode="circular")),
            randn(B, 4, 3, 4, 4)),
        "dilation-replicate-no-bias": (
            probe(layer=nn.Conv3d(2, 3, 2, dilation=2, padding=1, padding_mode="replicate", bias=False)),
            randn(B, 2, 4, 4, 4)),
    },
    nn.Embedding: {
        "padding-idx-repeated-tokens": (probe(layer=nn.Embedding(10, 4, padding_idx=0)),
                                        lambda: (ids_with_repeats(10, 6, padding_idx=0),)),
        "3d-int32-ids": (probe(layer=nn.Embedding(10, 4)), lambda: (ids_with_repeats(10, 3, 2).int(),)),
        "tied-to-a-linear-head-padding-idx": (tied_embedding_and_head,
                                              lambda: (ids_with_repeats(10, 5, padding_idx=0),)),
        "position-ids-of-one-row": (token_and_position_embeddings,
                                    lambda: (ids_with_repeats(10, 6), torch.arange(6).unsqueeze(0))),
    },
    # 1-D input with offsets is left out: it reads its longest bag once in the forward (documented in
    # DPEmbeddingBag._bags: ``int(lengths.max())`` and ``repeat_interleave`` by the lengths)
    nn.EmbeddingBag: {
        "2d-sum-per-sample-weights": (
            probe(lambda m, ids, w: m.layer(ids, per_sample_weights=w), layer=nn.EmbeddingBag(10, 4, mode="sum")),
            lambda: (ids_with_repeats(10, 5), torch.rand(B, 5))),
        "2d-mean-padding-idx": (probe(layer=nn.EmbeddingBag(10, 4, mode="mean", padding_idx=0)),
                                lambda: (ids_with_repeats(10, 6, padding_idx=0),)),
        "one-table-two-bags": (
            probe(lambda m, a, b: m.layer(a) * m.layer(b), layer=nn.EmbeddingBag(10, 4, mode="mean")),
            lambda: (ids_with_repeats(10, 5), ids_with_repeats(10, 3))),
    },
    nn.LayerNorm: {
        "3d-input": (probe(layer=nn.LayerNorm(6)), randn(B, 5, 6)),
        "2d-shape-no-bias": (probe(layer=nn.LayerNorm((3, 4), bias=False)), randn(B, 2, 3, 4)),
        "same-shape-calls-stacked": (probe(two_calls(), a=nn.LayerNorm(6), b=nn.LayerNorm(6)), randn(B, 5, 6)),
    },
    nn.GroupNorm: {
        "4d-input": (probe(layer=nn.GroupNorm(2, 6)), randn(B, 6, 3, 3)),
        "2d-input-no-spatial": (probe(layer=nn.GroupNorm(3, 6)), randn(B, 6)),
        "same-shape-calls": (probe(two_calls(), a=nn.GroupNorm(2, 4), b=nn.GroupNorm(2, 4)), randn(B, 4, 5)),
    },
    nn.RMSNorm: {
        "3d-input": (probe(layer=nn.RMSNorm(6)), randn(B, 5, 6)),
        "2d-shape-eps": (probe(layer=nn.RMSNorm((2, 6), eps=1e-5)), randn(B, 3, 2, 6)),
    },
    pdpfast.nn.DPRMSNormForm: {  # a form: recognized by its forward
        "3d-input": (probe(layer=CopiedRMSNorm(6)), randn(B, 5, 6)),
        "same-shape-calls": (probe(two_calls(), a=CopiedRMSNorm(6), b=CopiedRMSNorm(6)), randn(B, 5, 6)),
    },
    nn.InstanceNorm1d: {"affine": (probe(layer=nn.InstanceNorm1d(4, affine=True)), randn(B, 4, 7))},
    nn.InstanceNorm2d: {"affine": (probe(layer=nn.InstanceNorm2d(4, affine=True)), randn(B, 4, 3, 3))},
    nn.InstanceNorm3d: {"affine": (probe(layer=nn.InstanceNorm3d(3, affine=True)), randn(B, 3, 2, 3, 3))},
    nn.RNN: {
        "tanh-2-layers-bidirectional": (
            probe(recurrent, layer=nn.RNN(4, 5, num_layers=2, bidirectional=True, batch_first=True)),
            randn(B, 4, 4)),
        "relu-no-bias-with-h0": (
            probe(recurrent, layer=nn.RNN(4, 5, nonlinearity="relu", bias=False, batch_first=True)),
            lambda: (torch.randn(B, 4, 4), torch.randn(1, B, 5))),
    },
    nn.LSTM: {
        "2-layers-dropout-with-state": (
            probe(recurrent, layer=nn.LSTM(4, 5, num_layers=2, dropout=0.25, batch_first=True)),
            lambda: (torch.randn(B, 4, 4), torch.randn(2, B, 5), torch.randn(2, B, 5))),
        "bidirectional": (probe(recurrent, layer=nn.LSTM(4, 5, bidirectional=True, batch_first=True)),
                          randn(B, 3, 4)),
    },
    nn.GRU: {
        "1-layer": (probe(recurrent, layer=nn.GRU(4, 5, batch_first=True)), randn(B, 4, 4)),
        "2-layers-bidirectional-no-bias": (
            probe(recurrent, layer=nn.GRU(4, 5, num_layers=2, bidirectional=True, bias=False, batch_first=True)),
            randn(B, 3, 4)),
        "bias-only-trainable": (frozen(probe(recurrent, layer=nn.GRU(4, 5, batch_first=True)), "weight"),
                                randn(B, 4, 4)),
    },
    "transformers.pytorch_utils.Conv1D": {
        "3d-input": (hf_conv1d((6, 4)), randn(B, 5, 4)),
        "same-shape-calls-stacked": (hf_conv1d((8, 8), (8, 8)), randn(B, 3, 8)),
    },
    "transformers.models.vit.modeling_vit.ViTEmbeddings": {
        "class-token-position-embeddings": (vit_embeddings, randn(B, 3, 8, 8)),
        "mask-token": (lambda: vit_embeddings(use_mask_token=True),
                       lambda: (torch.randn(B, 3, 8, 8), torch.rand(B, 4) < 0.5)),
    },
    "transformers.models.deit.modeling_deit.DeiTEmbeddings": {
        "class-and-distillation-tokens": (deit_embeddings, randn(B, 3, 8, 8)),
    },
    "transformers.models.dinov2.modeling_dinov2.Dinov2Embeddings": {
        "frozen-mask-token": (dinov2_embeddings, randn(B, 3, 8, 8)),
    },
    "transformers.models.dinov2.modeling_dinov2.Dinov2LayerScale": {
        "3d-input": (dinov2_layer_scale, randn(B, 5, 16)),
    },
}


# ---------------------------------------------------------------------------------------------- modes and routes

@dataclass(frozen=True)
class Mode:
    state: dict                 # ClippingState options
    group_bounds: bool = False  # (K, B) bounds, one row per clipping group, and every group's norms kept
    autocast: bool = False      # the forward under CPU autocast to bfloat16


MODES = {
    "bk-flat": Mode(dict(mode="bk", clipping="flat")),
    "bk-per_layer": Mode(dict(mode="bk", clipping="per_layer")),
    "ghost-flat": Mode(dict(mode="ghost", clipping="flat")),
    "bk-flat-automatic": Mode(dict(mode="bk", clipping="flat", automatic_gamma=0.01)),
    "bk-per_layer-group-bounds": Mode(dict(mode="bk", clipping="per_layer"), group_bounds=True),
    "bk-flat-bf16-autocast": Mode(dict(mode="bk", clipping="flat"), autocast=True),
    "bk-per_layer-bf16-autocast": Mode(dict(mode="bk", clipping="per_layer"), autocast=True),
    "ghost-flat-bf16-autocast": Mode(dict(mode="ghost", clipping="flat"), autocast=True),
}

# the compiled extension's kernels off: torch's routes, as where pdpfast._C lacks them
_NO_EXTENSION = ((norm_ops, "_CPP_MISSING", "switched off by the test"),
                 (clip_ops, "_FUSED_MISSING", "switched off by the test"))
# name → (module, attribute, value) patches
ROUTES = {
    "default": (),
    # every call on its own: per-sample gradients formed where small, packed at the end of the backward
    "unstacked": ((pdpfast.clipping, "SMALL_CALL_BYTES", 0),),
    # every call on its own, norms from the rules' formulas (as where the GPU kernels run), nothing
    # packed, no extension kernels, and every batch cut into one-sample chunks
    "norm-formulas-chunked": (
        (pdpfast.clipping, "SMALL_CALL_BYTES", 0), (pdpfast.clipping, "PACK_BYTES", 0),
        (lin_ops, "MATERIALIZE_MIN_ELEMENTS", 0), (lin_ops, "MATERIALIZE_RATIO", 0), *_NO_EXTENSION,
        (lin_ops, "_CHUNK_ELEMENTS", 1), (conv_ops, "_CHUNK_ELEMENTS", 1), (conv_ops, "_CPU_CHUNK_ELEMENTS", 1),
        (norm_ops, "_CPU_CHUNK_ELEMENTS", 1)),
    # small calls stacked (GroupNorm / InstanceNorm too: no extension kernels) in stacks of one call
    # (per-layer clipping flushes them after every call)
    "stacks-flushed": ((pdpfast.clipping, "STACK_BYTES", 1), *_NO_EXTENSION),
}
# ghost clipping computes every call's norms on its own: stacking does not apply to it
COMBINATIONS = [
    *((mode, route) for mode in ("bk-flat", "bk-per_layer") for route in ROUTES),
    ("ghost-flat", "default"), ("ghost-flat", "norm-formulas-chunked"),
    ("bk-flat-automatic", "default"), ("bk-flat-automatic", "stacks-flushed"),
    ("bk-per_layer-group-bounds", "default"), ("bk-per_layer-group-bounds", "stacks-flushed"),
    ("bk-flat-bf16-autocast", "default"), ("bk-flat-bf16-autocast", "norm-formulas-chunked"),
    ("bk-per_layer-bf16-autocast", "default"), ("ghost-flat-bf16-autocast", "default"),
]


def family_name(key) -> str:
    return key.rsplit(".", 1)[-1] if isinstance(key, str) else key.__name__


PARAMS = [pytest.param(key, variant, mode, route, id=f"{family_name(key)}-{variant}-{mode}-{route}")
          for key, variants in CASES.items() for variant in variants for mode, route in COMBINATIONS]


# ---------------------------------------------------------------------------------------------- tests


def _test_only(key) -> bool:
    """Registrations that other test modules make at import time (their classes live in tests)."""
    module = key.rsplit(".", 1)[0] if isinstance(key, str) else key.__module__
    top = module.split(".")[0]
    return top in ("tests", "conftest") or top.startswith("test_")


def test_every_registered_layer_family_has_a_case():
    registered = [key for key in [*registered_layers(), *registered_forms()] if not _test_only(key)]
    missing = [f"{key.__module__}.{key.__qualname__}" if isinstance(key, type) else key
               for key in registered if not CASES.get(key)]
    assert not missing, f"registered layer families without a no-host-sync case in CASES: {missing}"
    stale = [family_name(key) for key in CASES if key not in registered]
    assert not stale, f"CASES names families that are not registered (any more): {stale}"


@pytest.mark.parametrize(("key", "variant", "mode", "route"), PARAMS)
def test_private_step_of_a_layer_family_never_synchronises_with_the_host(key, variant, mode, route, monkeypatch):
    """Two physical batches (the second adds into ``.grad`` and reuses what the first cached), each
    opened outside the guard and run inside it: forward, backward, norms, weights, clipped sums."""
    if isinstance(key, str):
        pytest.importorskip("transformers")
    for module, name, value in ROUTES[route]:
        monkeypatch.setattr(module, name, value)  # raises if the attribute is gone: update ROUTES
    build, make_inputs = CASES[key][variant]
    model = pdpfast.nn.convert(build()).train()
    dp_class = registered_layers().get(key, key)  # a form is its own DP class
    assert any(isinstance(m, dp_class) for m in model.modules()), f"the case builds no {dp_class.__name__}"
    inputs, labels = make_inputs(), torch.randint(0, CLASSES, (B,))
    spec = MODES[mode]
    ghost = spec.state["mode"] == "ghost"

    state = pdpfast.clipping.ClippingState(model, **spec.state)
    state.keep_group_norms = spec.group_bounds
    state.attach()
    try:
        for _ in range(2):
            bounds = torch.rand(len(state.group_names), B) if spec.group_bounds else torch.rand(B)
            bounds = bounds.double() + 0.5
            # opened outside the guard: begin_batch checks the host's bounds and mask on the host
            if ghost:
                state.begin_batch(bounds, MASK)
            else:
                state.begin_batch(bounds, MASK, loss_scale=B)
            with no_host_sync():
                with torch.autocast("cpu", dtype=torch.bfloat16) if spec.autocast else contextlib.nullcontext():
                    logits = model(*inputs)
                losses = F.cross_entropy(logits.float(), labels, reduction="none")
                if ghost:
                    state.ghost_backward(losses)
                else:
                    losses.mean().backward()
    finally:
        state.detach()

    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable
    for name, p in trainable.items():
        assert p.grad is not None, f"{name} got no clipped gradient"
        assert p.grad.shape == p.shape and torch.isfinite(p.grad).all(), name
    assert any(p.grad.abs().sum() > 0 for p in trainable.values())
    norms = state.last_norms
    assert norms.shape == (B,) and torch.isfinite(norms).all() and (norms >= 0).all()
    if spec.state["clipping"] == "flat":
        weights = state.last_weights
        assert weights.shape == (B,) and torch.isfinite(weights).all()
        assert weights[PADDED_ROW] == 0 and (weights >= 0).all()
    if spec.group_bounds:
        group_norms = state.last_group_norms
        assert group_norms.shape == (len(state.group_names), B) and torch.isfinite(group_norms).all()
