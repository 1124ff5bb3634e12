"""Whole models against the float64 oracle: an MLP, a GroupNorm CNN, a small transformer, a Linear
called twice, tied weights, and tiny random Hugging Face BERT and GPT-2 (no downloads).

Each model is converted in place and run through ``clipped_gradients`` in every schedule; per-sample
gradients of the oracle come from a copy of the model taken before conversion.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pdpfast
from pdpfast.clipping import ClippingState

B = 6


# ------------------------------------------------------------------------------------------ models


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(7, 13), nn.ReLU(inplace=True), nn.Linear(13, 5, bias=False),
                                 nn.ReLU(inplace=True), nn.Linear(5, 3))

    def forward(self, x):
        return self.net(x)


class GroupNormCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1), nn.GroupNorm(2, 6), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(6, 8, 3, stride=2, padding="valid"), nn.GroupNorm(4, 8), nn.ReLU(),
            nn.Conv2d(8, 8, 2, padding="same", groups=8, bias=False), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.features(x))


class TinyTransformer(nn.Module):
    """Token + position embeddings (position ids of shape (1, T), broadcast over the batch), one
    pre-LN block with attention written from Linear layers and softmax, an MLP, and an LM head."""

    def __init__(self, vocab=13, d=8, heads=2, max_len=8):
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.tok = nn.Embedding(vocab, d, padding_idx=0)
        self.pos = nn.Embedding(max_len, d)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.proj = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 3 * d), nn.Linear(3 * d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        b, t = ids.shape
        positions = torch.arange(t, device=ids.device).unsqueeze(0)
        h = self.tok(ids) + self.pos(positions)
        x = self.ln1(h)
        q, k, v = (f(x).view(b, t, self.heads, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
        attention = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        h = h + self.proj((attention @ v).transpose(1, 2).reshape(b, t, self.heads * self.head_dim))
        h = h + self.fc2(F.gelu(self.fc1(self.ln2(h))))
        return self.head(self.ln_f(h))


class LinearTwice(nn.Module):
    """The same Linear applied twice in one forward (and reachable under two names)."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(5, 5)
        self.alias = self.shared
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        return self.out(self.alias(torch.tanh(self.shared(x))))


class TiedLM(nn.Module):
    """An LM head tied to the input embedding, with its own bias: one clipping group of two layers."""

    def __init__(self, vocab=11, d=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.lm_head = nn.Linear(d, vocab)
        self.lm_head.weight = self.emb.weight

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.mix(self.emb(ids))))


def ce_loss(logits, labels):
    return F.cross_entropy(logits, labels, reduction="none")


def lm_loss(logits, targets):
    """Per-sample token cross-entropy summed over positions; targets −100 are ignored (padding)."""
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none", ignore_index=-100).sum(1)


def ragged_ids(vocab, t, low=1):
    """(B, t) token ids with trailing padding (id 0, target −100) of random lengths ≥ 2."""
    ids = torch.randint(low, vocab, (B, t))
    lengths = torch.randint(2, t + 1, (B,))
    pad = torch.arange(t).unsqueeze(0) >= lengths.unsqueeze(1)
    ids[pad] = 0
    targets = torch.randint(1, vocab, (B, t))
    targets[pad] = -100
    return ids, targets, pad


def make_case(name):
    if name == "mlp":
        model = MLP()
        return model, (torch.randn(B, 7),), (torch.randint(0, 3, (B,)),), ce_loss
    if name == "groupnorm_cnn":
        model = GroupNormCNN()
        return model, (torch.randn(B, 3, 10, 9),), (torch.randint(0, 4, (B,)),), ce_loss
    if name == "transformer":
        ids, targets, _ = ragged_ids(13, 7)
        ids[:, 1] = ids[:, 0]  # a token repeated within every sample
        return TinyTransformer(), (ids,), (targets,), lm_loss
    if name == "linear_twice":
        return LinearTwice(), (torch.randn(B, 4, 5),), (torch.randint(0, 3, (B, 4)),), \
            lambda out, y: F.cross_entropy(out.transpose(1, 2), y, reduction="none").sum(1)
    if name == "tied_lm":
        ids = torch.randint(0, 4, (B, 5))
        return TiedLM(), (ids,), (torch.randint(0, 11, (B, 5)),), lm_loss
    raise ValueError(name)


def floats_to_double(tensors):
    return tuple(t.double() if t.is_floating_point() else t for t in tensors)


SMALL_MODELS = ["mlp", "groupnorm_cnn", "transformer", "linear_twice", "tied_lm"]


@pytest.mark.parametrize("name", SMALL_MODELS)
def test_model_matches_oracle(name, style, oracle):
    reference, inputs, targets, loss = make_case(name)
    with torch.no_grad():
        for p in reference.parameters():
            if p.dim() == 1:  # biases, and norm layers off their identity init
                p.normal_(0, 0.3)
    reference = reference.double()
    model = pdpfast.nn.convert(copy.deepcopy(reference))
    oracle.check(model, loss, floats_to_double(inputs), targets, reference=reference, **style)


@pytest.mark.parametrize("name", SMALL_MODELS)
def test_private_forward_matches_the_original(name, oracle):
    """Inside a private batch the converted model computes the original's outputs."""
    reference, inputs, targets, loss = make_case(name)
    reference = reference.double()
    model = pdpfast.nn.convert(copy.deepcopy(reference))
    inputs = floats_to_double(inputs)
    seen = []

    def capture(outputs):
        seen.append(outputs.detach().clone())
        return loss(outputs, *targets)

    pdpfast.functional.clipped_gradients(model, capture, *inputs, clip_norms=torch.ones(B))
    with torch.no_grad():
        torch.testing.assert_close(seen[0], reference(*inputs), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(model(*inputs), reference(*inputs), rtol=0, atol=0)


def test_oracle_methods_agree_on_the_transformer(oracle):
    reference, inputs, targets, loss = make_case("transformer")
    reference = reference.double()
    by_vmap = oracle.per_sample_grads(reference, loss, inputs, targets, method="vmap")
    by_loop = oracle.per_sample_grads(reference, loss, inputs, targets, method="loop")
    for n in by_vmap:
        oracle.assert_close(by_loop[n], by_vmap[n], n)


@pytest.mark.parametrize("name", SMALL_MODELS)
def test_empty_batch_of_a_model(name, style, oracle):
    model, inputs, targets, loss = make_case(name)
    model = pdpfast.nn.convert(model.double())
    inputs, targets = tuple(t[:0] for t in floats_to_double(inputs)), tuple(t[:0] for t in targets)
    result = oracle.run(model, loss, inputs, targets, clip_norms=torch.ones(0), **style)
    assert result.norms.shape == (0,)
    assert set(result.grads) == set(oracle.trainable(model))
    assert all(not g.any() for g in result.grads.values())


def test_tied_weights_form_one_clipping_group(oracle):
    model = pdpfast.nn.convert(TiedLM().double())
    state = ClippingState(model, clipping="per_layer")
    assert state.group_names == [g.name for g in oracle.groups(model)] == ["emb", "mix"]
    (tied,) = [g for g in oracle.groups(model) if g.name == "emb"]
    assert tied.param_names == ["emb.weight", "lm_head.bias"]
    with pytest.raises(ValueError, match="layer_shares"):  # two groups, not three
        ClippingState(model, clipping="per_layer", layer_shares=[0.6, 0.48, 0.64])
    # naming either member of a group gives the group's share
    ClippingState(model, clipping="per_layer", layer_shares={"lm_head": 0.6, "mix": 0.8})


def test_linear_twice_is_one_group(oracle):
    model = pdpfast.nn.convert(LinearTwice().double())
    assert ClippingState(model, clipping="per_layer").group_names == ["shared", "out"]


class TiedEveryWay(nn.Module):
    """One table used three times, so a backward meets each way of adding a use: a late embedding
    lookup first (it forms the held per-sample tensor), the tied LM head (formed, then added), the
    first lookup (its tokens' rows scattered into the held tensor)."""

    def __init__(self, vocab=11, d=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.emb.weight

    def forward(self, ids):
        logits = self.lm_head(torch.tanh(self.emb(ids)))
        return logits + self.emb(ids.flip(1)).sum(-1, keepdim=True)


def test_a_weight_used_three_ways_equals_the_oracle(style, oracle):
    torch.manual_seed(0)
    reference = TiedEveryWay().double()
    model = pdpfast.nn.convert(copy.deepcopy(reference))
    ids = torch.randint(0, 11, (B, 5))
    oracle.check(model, lm_loss, (ids,), (torch.randint(0, 11, (B, 5)),), reference=reference, **style)


@pytest.mark.parametrize("mode,clipping", [("bk", "flat"), ("bk", "per_layer"), ("ghost", "flat")])
def test_tied_weights_hold_one_per_sample_tensor(mode, clipping):
    """A tied embedding and LM head hold one B×V×d tensor of per-sample gradients: the embedding's
    tokens are added into the LM head's in place. Before, the embedding formed its own dense B×V×d
    tensor and the sum a third (1.2 GB each for GPT-2 small in fp32), which made ghost clipping's
    peak 1.25× the non-private step's on GPT-2. Measured with the allocator's events on the CPU."""
    from bench.harness import own_peak_memory

    torch.manual_seed(0)
    vocab, d, batch, T = 4096, 64, 4, 8
    model = pdpfast.nn.convert(TiedLM(vocab, d))
    ids, targets = torch.randint(0, vocab, (batch, T)), torch.randint(0, vocab, (batch, T))
    one = batch * vocab * d * 4  # bytes of one (B, V, d) fp32 tensor: 4 MiB
    run = lambda: pdpfast.functional.clipped_gradients(  # noqa: E731
        model, lambda out: lm_loss(out, targets), ids, clip_norms=torch.ones(batch), mode=mode, clipping=clipping)
    run()  # first-call allocations (caches, lazily built state) out of the way
    with own_peak_memory(torch.device("cpu")) as peak:
        run()
    # the held tensor (4 MiB), activations (B·T·V logits: 0.5 MiB) and the parameters' gradients:
    # 1.3-1.4 tensors measured; before, 3.0-3.1 (the embedding's dense tensor and the sum besides)
    assert peak["bytes"] < 1.7 * one, (peak["bytes"] / one)


# ------------------------------------------------------------------------------ Hugging Face models


def _hf_config_kwargs():
    return dict(attn_implementation="eager", bos_token_id=1, eos_token_id=2, pad_token_id=0)


class HFClassifier(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, attention_mask, token_type_ids):
        return self.model(input_ids=ids, attention_mask=attention_mask, token_type_ids=token_type_ids).logits


class HFCausalLM(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, attention_mask):
        return self.model(input_ids=ids, attention_mask=attention_mask, use_cache=False).logits


def shifted_lm_loss(logits, targets):
    return lm_loss(logits[:, :-1], targets[:, 1:])


def _bert():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=37, max_position_embeddings=16, type_vocab_size=2, num_labels=3,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **_hf_config_kwargs())
    model = HFClassifier(BertForSequenceClassification(config))
    ids, _, pad = ragged_ids(50, 9)
    token_types = (torch.arange(9) >= 4).long().expand(B, 9).clone()
    inputs = (ids, (~pad).long(), token_types)
    return model, inputs, (torch.randint(0, 3, (B,)),), ce_loss


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=2, n_inner=40,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **_hf_config_kwargs())
    lm = GPT2LMHeadModel(config)
    assert lm.lm_head.weight is lm.transformer.wte.weight  # tied
    ids, targets, pad = ragged_ids(50, 10)
    ids[:, 2] = ids[:, 1]
    return HFCausalLM(lm), (ids, (~pad).long()), (torch.where(pad, -100, ids),), shifted_lm_loss


def _randomize_norms_(model):
    # RMSNorm weights start at ones: give them a spread, so a rule that ignored them would show
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.5)
    return model


def _llama_style(config_class, model_class, **extra):
    # a Llama-style decoder: Hugging Face's own RMSNorm class (DPRMSNormForm), rotary positions,
    # grouped-query attention, SwiGLU, tied embeddings
    config = config_class(vocab_size=50, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                          tie_word_embeddings=True, rms_norm_eps=0.1, **extra, **_hf_config_kwargs())
    lm = _randomize_norms_(model_class(config))
    ids, targets, pad = ragged_ids(50, 10)
    return HFCausalLM(lm), (ids, (~pad).long()), (torch.where(pad, -100, ids),), shifted_lm_loss


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return _llama_style(LlamaConfig, LlamaForCausalLM)


def _gemma():  # RMSNorms scaling by 1 + weight; its scaled token embedding (its own forward) tied to the head
    from transformers import GemmaConfig, GemmaForCausalLM

    model, inputs, targets, loss = _llama_style(GemmaConfig, GemmaForCausalLM, head_dim=8)
    embedding = model.model.model.embed_tokens
    assert type(embedding).forward is not nn.Embedding.forward and float(embedding.embed_scale) != 1.0
    return model, inputs, targets, loss


def _bart():  # BART's decoder: a scaled token embedding (√d) and learned positions, both with their own forward
    from transformers import BartConfig, BartForCausalLM

    config = BartConfig(vocab_size=50, d_model=32, decoder_layers=2, decoder_attention_heads=2, decoder_ffn_dim=40,
                        encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=40, max_position_embeddings=16,
                        scale_embedding=True, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                        decoder_layerdrop=0.0, is_decoder=True, is_encoder_decoder=False,
                        decoder_start_token_id=2, **_hf_config_kwargs())
    lm = BartForCausalLM(config)
    decoder = lm.model.decoder
    assert float(decoder.embed_tokens.embed_scale) != 1.0
    assert type(decoder.embed_positions).forward is not nn.Embedding.forward
    ids, targets, pad = ragged_ids(50, 10)
    return HFCausalLM(_randomize_tokens_(lm)), (ids, (~pad).long()), (torch.where(pad, -100, ids),), shifted_lm_loss


def _qwen3():  # RMSNorms on each head's queries and keys too: (B, T, heads, head_dim) inputs
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _llama_style(Qwen3Config, Qwen3ForCausalLM, head_dim=8)


class HFImageClassifier(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixels):
        return self.model(pixel_values=pixels).logits


def _vision_config(config_class, **extra):
    return config_class(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=24, num_labels=3, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, attn_implementation="eager", **extra)


def _randomize_tokens_(model):
    # HF initializes tokens and position embeddings with zeros or a small spread: give them a real one
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "token" in name or "position_embeddings" in name or "lambda" in name:
                p.normal_(0.0, 0.5)
    return model


def _vision_case(model):
    pixels = torch.randn(B, 3, 8, 8)
    return HFImageClassifier(_randomize_tokens_(model)), (pixels,), (torch.randint(0, 3, (B,)),), ce_loss


def _vit():
    from transformers import ViTConfig, ViTForImageClassification

    return _vision_case(ViTForImageClassification(_vision_config(ViTConfig)))


def _deit():
    from transformers import DeiTConfig, DeiTForImageClassificationWithTeacher

    return _vision_case(DeiTForImageClassificationWithTeacher(_vision_config(DeiTConfig)))


def _dinov2():
    from transformers import Dinov2Config, Dinov2ForImageClassification

    model = Dinov2ForImageClassification(_vision_config(Dinov2Config, layerscale_value=0.5))
    model.dinov2.embeddings.mask_token.requires_grad_(False)  # masked image modeling only: frozen here
    return _vision_case(model)


HF_BUILDERS = {"bert": _bert, "gpt2": _gpt2, "llama": _llama, "qwen3": _qwen3, "gemma": _gemma, "bart": _bart,
               "vit": _vit, "deit": _deit, "dinov2": _dinov2}


@pytest.fixture(scope="module", params=list(HF_BUILDERS))
def hf_case(request, oracle):
    """A converted tiny HF model, its batch and the oracle's per-sample gradients (computed once)."""
    pytest.importorskip("transformers")
    torch.manual_seed(1234)
    reference, inputs, targets, loss = HF_BUILDERS[request.param]()
    reference = reference.double().train()
    model = pdpfast.nn.convert(copy.deepcopy(reference))
    per_sample = oracle.per_sample_grads(reference, loss, inputs, targets, method="loop")
    return dict(name=request.param, model=model, reference=reference, inputs=inputs, targets=targets, loss=loss,
                per_sample=per_sample)


def test_hf_model_matches_oracle(hf_case, style, oracle):
    c = hf_case
    per_sample, reference = c["per_sample"], c["reference"]
    clip_norms = oracle.bounds(oracle.expected(reference, per_sample, torch.ones(B)).norms)
    mask = oracle.random_mask(B)
    options = {k: style[k] for k in ("clipping", "automatic_gamma") if k in style}
    expected = oracle.expected(reference, per_sample, clip_norms, mask, **options)
    result = oracle.run(c["model"], c["loss"], c["inputs"], c["targets"], clip_norms=clip_norms, mask=mask, **style)
    oracle.assert_matches(result, expected)


@pytest.mark.parametrize("style", [dict(mode="bk"), dict(mode="ghost"), dict(clipping="per_layer")],
                         ids=["bk", "ghost", "per_layer"])
def test_hf_gradient_checkpointing_gives_the_same_clipped_sums_as_the_oracle(hf_case, style, oracle):
    """``gradient_checkpointing_enable()`` (``activation_checkpointing_enable()`` since transformers 5:
    torch's non-reentrant checkpoint around every layer) replays each layer in the backward. Before:
    ghost clipping refused the replay as a second forward, and book-keeping formed every checkpointed
    layer's per-sample gradients (counting the replay as a second use): exact, at the memory
    checkpointing is meant to save."""
    c = hf_case
    model = copy.deepcopy(c["model"])
    hf = model.model
    (getattr(hf, "activation_checkpointing_enable", None) or hf.gradient_checkpointing_enable)()
    model.train()
    per_sample, reference = c["per_sample"], c["reference"]
    clip_norms = oracle.bounds(oracle.expected(reference, per_sample, torch.ones(B)).norms)
    expected = oracle.expected(reference, per_sample, clip_norms, None, **{k: v for k, v in style.items()
                                                                          if k == "clipping"})
    result = oracle.run(model, c["loss"], c["inputs"], c["targets"], clip_norms=clip_norms, **style)
    oracle.assert_matches(result, expected)


def test_hf_model_structure(hf_case, oracle):
    """Every trainable parameter is covered; GPT-2's tied wte / lm_head is one parameter in one group."""
    model = hf_case["model"]
    state = ClippingState(model, clipping="per_layer")
    assert state.group_names == [g.name for g in oracle.groups(model)]
    if hf_case["name"] == "gpt2":
        lm = model.model
        assert lm.lm_head.weight is lm.transformer.wte.weight
        assert isinstance(lm.lm_head, pdpfast.nn.DPModule) and isinstance(lm.transformer.wte, pdpfast.nn.DPModule)
        (group,) = [g for g in oracle.groups(model) if "model.lm_head" in g.module_names]
        assert group.module_names == ["model.transformer.wte", "model.lm_head"]
        result = oracle.run(model, hf_case["loss"], hf_case["inputs"], hf_case["targets"], clip_norms=torch.ones(B))
        assert "model.lm_head.weight" not in result.grads and "model.transformer.wte.weight" in result.grads


def test_hf_private_forward_matches_the_original(hf_case):
    c = hf_case
    seen = []

    def capture(outputs):
        seen.append(outputs.detach().clone())
        return c["loss"](outputs, *c["targets"])

    pdpfast.functional.clipped_gradients(c["model"], capture, *c["inputs"], clip_norms=torch.ones(B))
    with torch.no_grad():
        expected = c["reference"](*c["inputs"])
        torch.testing.assert_close(seen[0], expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(c["model"](*c["inputs"]), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("clipped", [True, False], ids=["clipped", "unclipped"])
def test_hf_batch_of_one(hf_case, clipped, style, oracle):
    """(The HF models themselves cannot run an empty batch; B = 0 is tested on the small models.)"""
    c = hf_case
    one = tuple(t[:1] for t in c["inputs"]), tuple(t[:1] for t in c["targets"])
    per_sample = {n: g[:1] for n, g in c["per_sample"].items()}
    norms = oracle.expected(c["reference"], per_sample, torch.ones(1)).norms
    bounds = oracle.bounds(norms, torch.tensor([clipped]))
    options = {k: style[k] for k in ("clipping", "automatic_gamma") if k in style}
    expected = oracle.expected(c["reference"], per_sample, bounds, **options)
    result = oracle.run(c["model"], c["loss"], *one, clip_norms=bounds, **style)
    oracle.assert_matches(result, expected)


# ------------------------------------------------------------------------------------------ build_model's refusals


def test_a_language_model_of_one_token_sequences_is_refused_naming_input_shape_and_max_length():
    """Before: built, then the first step died in the loss ("shape '[2]' is invalid for input of size 0")."""
    from pdpfast.models import build_model

    with pytest.raises(ValueError, match=r"input_shape \(1,\).*at least 2 tokens \(--max-length ≥ 2"):
        build_model("gpt2-micro", input_shape=(1,), num_classes=1, input_kind="tokens")
    assert build_model("gpt2-micro", input_shape=(2,), num_classes=1, input_kind="tokens").config.n_positions == 64


@pytest.mark.parametrize("name,option,sets_it", [
    ("bert-micro", dict(num_labels=5), "num_classes"), ("vit-micro", dict(num_labels=5), "num_classes"),
    ("vit-micro", dict(num_channels=1), "input_shape"), ("vit-micro", dict(image_size=8), "input_shape"),
    ("gpt2-micro", dict(size="tiny"), "name"), ("bert-micro", dict(size="tiny"), "name"),
    ("vit-micro", dict(size="tiny"), "name")])
def test_an_option_build_model_sets_itself_is_refused_naming_what_sets_it(name, option, sets_it):
    """Before: TypeError "got multiple values for keyword argument"."""
    from pdpfast.models import build_model

    shape, kind = ((3, 8, 8), "image") if name.startswith("vit") else ((8,), "tokens")
    with pytest.raises(ValueError, match=f"takes no option '{next(iter(option))}': .*{sets_it}"):
        build_model(name, input_shape=shape, num_classes=3, input_kind=kind, **option)
