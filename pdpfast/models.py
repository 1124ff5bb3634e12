"""Model builders for training and benchmarks: no weight downloads, everything from a config.

``resnet18_gn`` is ResNet-18 with GroupNorm in place of BatchNorm (BatchNorm has no per-sample
gradients) and torchvision's module names (conv1, bn1, layer1.0.conv1, ..., fc), so a torchvision
state_dict's convolution and linear weights load into it. ``bert``, ``gpt2``, ``llama`` and
``vit`` build Hugging Face models from configs with random initialization.
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ._checks import check_choice, check_flag, check_int, check_sizes
from .datasets import KINDS as INPUT_KINDS

TASKS = ("classification", "lm")


def _config(config_class, **fields):
    """A Hugging Face config, refusing a field it does not have: the config would keep a misspelled
    name (``hiden_size``) as an attribute that nothing reads, and build the default model."""
    defaults = config_class()
    # a few init arguments are kept under a private name (attn_implementation as _attn_implementation)
    unknown = sorted(k for k in fields if not (hasattr(defaults, k) or hasattr(defaults, f"_{k}")))
    if unknown:
        raise ValueError(f"{config_class.__name__} has no field {', '.join(map(repr, unknown))} (misspelled?); "
                         "see its documentation for the fields")
    return config_class(**fields)


def _norm(channels: int, groups: int = 32) -> nn.GroupNorm:
    return nn.GroupNorm(math.gcd(groups, channels), channels)


class BasicBlock(nn.Module):
    """ResNet's basic block with GroupNorm: two 3×3 convolutions and a shortcut (a 1×1 convolution
    and GroupNorm when the stride or the width changes).

    Args:
        inplanes: input channels.
        planes: output channels.
        stride: of the first convolution and the shortcut.
    """

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = _norm(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = _norm(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), _norm(planes))

    def forward(self, x):
        """relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)).

        Args:
            x: (B, inplanes, H, W) float feature maps.
        Returns:
            (B, planes, H / stride, W / stride) feature maps (sizes rounded up).
        """
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNetGN(nn.Module):
    """ResNet with GroupNorm in place of BatchNorm, torchvision's module names.

    Args:
        layers: the number of ``BasicBlock``s in each of the four stages, four ints ≥ 1.
        num_classes: K ≥ 1.
        cifar_stem: a 3×3 stride-1 first convolution and no max-pool (32×32 inputs); else ImageNet's
            7×7 stride-2 convolution and max-pool.
        width: the first stage's channels w ≥ 1; the stages have w, 2w, 4w, 8w (torchvision's
            ResNet: 64). A small width keeps every layer's shape and call while the arithmetic
            shrinks (``bench_overhead --model resnet18-w4`` times the host's work per step so).
    """

    def __init__(self, layers=(2, 2, 2, 2), num_classes: int = 10, cifar_stem: bool = True, width: int = 64):
        super().__init__()
        layers = check_sizes("layers", layers, length=4, form=" (blocks in each of the four stages)")
        num_classes = check_int("num_classes", num_classes, 1)
        width = check_int("width", width, 1)
        if check_flag("cifar_stem", cifar_stem):
            self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
            self.maxpool = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.bn1 = _norm(width)
        self.relu = nn.ReLU(inplace=True)
        inplanes, stages = width, []
        for i, blocks in enumerate(layers):
            planes = width << i
            stride = 1 if i == 0 else 2
            stage = [BasicBlock(inplanes, planes, stride)] + [BasicBlock(planes, planes) for _ in range(blocks - 1)]
            stages.append(nn.Sequential(*stage))
            inplanes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8 * width, num_classes)

    def forward(self, x):
        """Stem, four stages, global average pooling, the linear head.

        Args:
            x: (B, 3, H, W) float images.
        Returns:
            (B, K) logits.
        """
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18_gn(num_classes: int = 10, cifar_stem: bool = True, width: int = 64) -> ResNetGN:
    """ResNet-18 with GroupNorm in place of BatchNorm (per-sample gradients stay per sample).

    Args:
        num_classes: K; cifar_stem: a 3×3 stride-1 first convolution and no max-pool (32×32 inputs);
        width: the first stage's channels (``ResNetGN``).
    Returns:
        the model: images (B, 3, H, W) → logits (B, K).
    """
    return ResNetGN((2, 2, 2, 2), num_classes, cifar_stem, width)


def bert(size: str = "base", num_labels: int = 2, **overrides):
    """A Hugging Face BertForSequenceClassification, random init.

    Args:
        size: "base" (12×768), "tiny" (2×128) or "micro"; num_labels: K ≥ 1 (1: regression, as
            in Hugging Face); overrides: BertConfig fields.
    Returns:
        the model: input_ids (B, T) → logits (B, K).
    Raises:
        ValueError for an unknown size, num_labels < 1, or a field BertConfig does not have.
    """
    from transformers import BertConfig, BertForSequenceClassification

    sizes = {"base": {}, "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=512),
             "micro": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                           vocab_size=128, max_position_embeddings=64)}
    if size not in sizes:
        raise ValueError(f"size must be one of {sorted(sizes)}, got {size!r}")
    config = _config(BertConfig, num_labels=check_int("num_labels", num_labels, 1), **{**sizes[size], **overrides})
    config._attn_implementation = "eager"
    return BertForSequenceClassification(config)


def gpt2(size: str = "small", **overrides):
    """A Hugging Face GPT2LMHeadModel (lm_head tied to wte), random init.

    Args:
        size: "small" (12×768), "tiny" or "micro"; overrides: GPT2Config fields.
    Returns:
        the model: input_ids (B, T) → logits (B, T, V).
    Raises:
        ValueError for an unknown size or a field GPT2Config does not have.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    sizes = {"small": {}, "tiny": dict(n_embd=128, n_layer=2, n_head=2),
             "micro": dict(n_embd=32, n_layer=1, n_head=2, vocab_size=128, n_positions=64)}
    if size not in sizes:
        raise ValueError(f"size must be one of {sorted(sizes)}, got {size!r}")
    config = _config(GPT2Config, **{**sizes[size], **overrides})
    config._attn_implementation = "eager"
    return GPT2LMHeadModel(config)


def llama(size: str = "small", **overrides):
    """A Hugging Face LlamaForCausalLM (a Llama-style decoder: RMSNorm, rotary positions, grouped-query
    attention, SwiGLU; lm_head tied to the token embedding), random init.

    Args:
        size: "small" (SmolLM2-135M's shape: 30×576, 9 heads sharing 3 key/value heads, 49,152 tokens),
            "tiny" (2×128) or "micro" (1×32); overrides: LlamaConfig fields.
    Returns:
        the model: input_ids (B, T) → logits (B, T, V).
    Raises:
        ValueError for an unknown size or a field LlamaConfig does not have.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    small = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5,
                 tie_word_embeddings=True)
    sizes = {"small": small,
             "tiny": {**small, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
                      "num_attention_heads": 2, "num_key_value_heads": 1},
             "micro": {**small, "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}}
    if size not in sizes:
        raise ValueError(f"size must be one of {sorted(sizes)}, got {size!r}")
    config = _config(LlamaConfig, **{**sizes[size], **overrides})
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config)


def vit(size: str = "base", num_labels: int = 10, image_size: int | None = None, num_channels: int = 3,
        **overrides):
    """A Hugging Face ViTForImageClassification, random init.

    Args:
        size: "base" (ViT-B/16, 12×768, 224 px), "tiny" (2×128, 16 px patches of 32 px images) or
            "micro" (1×32, 4 px patches of 8 px); num_labels: K; image_size, num_channels: of the
            input; overrides: ViTConfig fields.
    Returns:
        the model: images (B, C, H, W) → logits (B, K).
    Raises:
        ValueError for an unknown size, an image size that is not a multiple of the patch size, a
        count < 1, or a field ViTConfig does not have.
    """
    from transformers import ViTConfig, ViTForImageClassification

    sizes = {"base": dict(image_size=224, patch_size=16),
             "tiny": dict(image_size=32, patch_size=8, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=512),
             "micro": dict(image_size=8, patch_size=4, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64)}
    if size not in sizes:
        raise ValueError(f"size must be one of {sorted(sizes)}, got {size!r}")
    options = {**sizes[size], **overrides}
    if image_size is not None:
        check_int("image_size", image_size, 1)
        if image_size % options["patch_size"]:
            raise ValueError(f"image_size {image_size} is not a multiple of the patch size {options['patch_size']}")
        options["image_size"] = image_size
    config = _config(ViTConfig, num_labels=check_int("num_labels", num_labels, 1),
                     num_channels=check_int("num_channels", num_channels, 1), **options)
    config._attn_implementation = "eager"
    return ViTForImageClassification(config)


# ----------------------------------------------------------------------------------------------
# Small models for user data, and a registry of every builder by name (the CLI's --model)
# ----------------------------------------------------------------------------------------------
def mlp(in_features: int, num_classes: int, hidden=(128,), activation: str = "tanh") -> nn.Sequential:
    """Flatten → [Linear → activation]* → Linear.

    Args:
        in_features: D ≥ 1 after flattening; num_classes: K ≥ 1; hidden: the hidden widths, a sequence
            of ints ≥ 1 (empty: a linear model); activation: "tanh" (DP-SGD's usual choice: bounded
            activations keep gradient norms small) or "relu".
    Returns:
        the model: (B, ...) → logits (B, K).
    Raises:
        TypeError for ``hidden`` that is not a sequence (a string, a bare number); ValueError for a
        size that is not an int ≥ 1, or another activation.
    """
    acts = {"tanh": nn.Tanh, "relu": nn.ReLU}
    if activation not in acts:
        raise ValueError(f"activation must be one of {sorted(acts)}, got {activation!r}")
    in_features, num_classes = check_int("in_features", in_features, 1), check_int("num_classes", num_classes, 1)
    layers, width = [nn.Flatten()], in_features
    for h in check_sizes("hidden", hidden, form=" (the hidden widths, e.g. (128,))"):
        layers += [nn.Linear(width, h), acts[activation]()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def cnn(in_channels: int, num_classes: int, width: int = 32) -> nn.Sequential:
    """A small GroupNorm CNN for images of any size: two conv/GroupNorm/ReLU blocks with pooling,
    a third conv, global average pooling and a linear head.

    Args:
        in_channels: C; num_classes: K; width: channels of the first block (each an int ≥ 1).
    Returns:
        the model: images (B, C, H, W) → logits (B, K).
    """
    in_channels, num_classes = check_int("in_channels", in_channels, 1), check_int("num_classes", num_classes, 1)
    w = check_int("width", width, 1)
    return nn.Sequential(
        nn.Conv2d(in_channels, w, 3, padding=1), _norm(w, 8), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True),
        nn.Conv2d(w, 2 * w, 3, padding=1), _norm(2 * w, 8), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True),
        nn.Conv2d(2 * w, 2 * w, 3, padding=1), _norm(2 * w, 8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * w, num_classes))


def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face causal language model, whose loss shifts the labels by one.

    Args:
        model: a module; a peft wrapper is judged by the model it wraps (one built without ``task_type``
            is a plain ``PeftModel``).
    Returns:
        True for a ``*ForCausalLM`` / ``*LMHeadModel`` class, else False.
    """
    get_base_model = getattr(model, "get_base_model", None)
    if callable(get_base_model):
        model = get_base_model()
    return type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))


@dataclass(frozen=True)
class ModelSpec:
    """A registered builder.

    Attributes:
        name: the model's name (``--model``).
        build: ``build(input_shape, num_classes, vocab_size, **options) -> nn.Module``; its optional
            ``set_by_arguments`` attribute names the options that ``build_model``'s own arguments set
            (refused as options).
        inputs: the input kinds it accepts ("features" (N, d) float, "image" (N, C, H, W) float,
            "tokens" (N, T) int64 ids).
        task: "classification" (logits (B, classes)) or "lm" (next-token logits (B, T, vocab), labels
            unused).
        help: one line for ``--help``.
        vocab_size: token models: the size of the embedding table (None: none of its own).
    """

    name: str
    build: Callable[..., nn.Module]
    inputs: tuple
    task: str = "classification"
    help: str = ""
    vocab_size: int | None = None


_MODELS: dict[str, ModelSpec] = {}


def register_model(name: str, *, inputs, task: str = "classification", help: str = "", vocab_size: int | None = None):
    """Decorator: register a model builder for ``pdpfast train --model``.

    Args:
        name: the model's name; inputs: the input kinds it takes, a tuple of ``INPUT_KINDS``; task:
            "classification" or "lm"; help: one line for ``--help``; vocab_size: its own vocabulary,
            if it has one.
    Returns:
        a decorator taking ``fn(input_shape, num_classes, vocab_size, **options) -> nn.Module``.
    Raises:
        TypeError for a name that is not a string, or ``inputs`` given as one string (its letters would
        be read as kinds); ValueError for an unknown input kind or task, or a vocab_size < 1.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    if isinstance(inputs, str) or not hasattr(inputs, "__iter__"):
        raise TypeError(f"inputs must be a tuple of input kinds, e.g. ('features',), got {inputs!r}")
    inputs = tuple(inputs)
    if not inputs:
        raise ValueError("inputs must name at least one input kind")
    for kind in inputs:
        check_choice("inputs", kind, INPUT_KINDS)
    check_choice("task", task, TASKS)
    if vocab_size is not None:
        check_int("vocab_size", vocab_size, 1)

    def deco(fn):
        _MODELS[name] = ModelSpec(name, fn, inputs, task, help, vocab_size)
        return fn
    return deco


def model_names() -> list[str]:
    """The registered models.

    Returns:
        their names, a sorted list of str.
    """
    return sorted(_MODELS)


def model_spec(name: str) -> ModelSpec:
    """The spec of a registered model.

    Args:
        name: a registered model.
    Returns:
        its ``ModelSpec`` (inputs, task, vocabulary).
    Raises:
        TypeError for a name that is not a string; ValueError naming the choices for an unknown name.
    """
    if not isinstance(name, str):
        raise TypeError(f"model name must be a string, got {type(name).__name__} {name!r}")
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(model_names())}")
    return _MODELS[name]


# one record's shape for each input kind that fixes its length ("features" may be (D,) or (D1, D2, ...))
_SHAPES = {"image": (3, " (C, H, W) for image inputs"), "tokens": (1, " (T,), the sequence length, for token inputs")}


def build_model(name: str, *, input_shape, num_classes: int = 2, vocab_size: int | None = None,
                input_kind: str = "features", **options) -> nn.Module:
    """Build a registered model for data of ``input_kind`` with per-record shape ``input_shape``.

    Deterministic given torch's RNG state; the same (name, arguments) rebuild the same
    architecture, which is what a checkpoint stores (``model_config``).

    Args:
        name: a registered model; input_shape: one record's shape, ints ≥ 1 ((C, H, W) for images,
            (T,) for tokens, T ≥ 2 for a language model); num_classes: K, an int ≥ 2 for a classifier (a
            language model does not read it; ≥ 1 there); vocab_size: the data's vocabulary, 1 + the
            largest token id of token inputs. It does not size the model: a token model's vocabulary
            is fixed by its name (``model_spec(name).vocab_size``), and vocab_size is only checked
            against it (a larger one is refused); the other models do not read it, so a caller may
            pass the data's value, or None, for any model. input_kind: one of ``INPUT_KINDS``;
            options: the builder's own (``hidden`` / ``activation`` for mlp, ``width`` for cnn,
            ``layers`` for resnet18-gn, config fields for the Hugging Face models, except those set
            by the arguments above: ``num_labels`` (num_classes), ``num_channels`` / ``image_size``
            (input_shape) and ``size`` (the model name)).
    Returns:
        the model.
    Raises:
        TypeError for an input_shape that is not a sequence; ValueError for an unknown model, input
        kind or option, an option the arguments above set, inputs the model does not take, a shape
        of the wrong length or with an entry < 1, a language model's sequences of one token,
        num_classes or vocab_size out of range (every check before anything is built).
    """
    spec = model_spec(name)
    check_choice("input_kind", input_kind, INPUT_KINDS)
    shape = check_sizes("input_shape", input_shape)
    if not shape:
        raise ValueError("input_shape is empty; give one record's shape, e.g. (D,) for D features")
    if input_kind not in spec.inputs:
        raise ValueError(f"model {name!r} takes {' or '.join(spec.inputs)} inputs, but the data are {input_kind} "
                         f"of shape {shape}" + (" (pass --image-shape C,H,W to view flat features as "
                                                "images)" if input_kind == "features" else ""))
    if input_kind in _SHAPES:
        shape = check_sizes("input_shape", shape, length=_SHAPES[input_kind][0], form=_SHAPES[input_kind][1])
    if spec.task == "lm" and shape[0] < 2:
        raise ValueError(f"input_shape {shape}: model {name!r} is a language model, trained to predict each token "
                         "from the ones before it, so it needs sequences of at least 2 tokens (--max-length ≥ 2 for "
                         "text; token arrays of at least 2 columns)")
    num_classes = check_int("num_classes", num_classes, 2 if spec.task == "classification" else 1)
    if vocab_size is not None:
        vocab_size = check_int("vocab_size", vocab_size, 1)
    params = inspect.signature(spec.build).parameters
    set_here = sorted(set(options) & set(getattr(spec.build, "set_by_arguments", ())))
    if set_here:
        raise ValueError(f"model {name!r} takes no option {set_here[0]!r}: {_SET_BY_ARGUMENTS[set_here[0]]}")
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):      # Hugging Face builders check their fields
        own = [p for p in params if p not in ("input_shape", "num_classes", "vocab_size")]
        unknown = sorted(set(options) - set(own))
        if unknown:
            raise ValueError(f"model {name!r} has no option {', '.join(map(repr, unknown))}; its options: "
                             f"{', '.join(own) or 'none'}")
    return spec.build(shape, num_classes, vocab_size, **options)


@register_model("mlp", inputs=("features", "image"), help="MLP on flat features (images are flattened)")
def _build_mlp(input_shape, num_classes, vocab_size, hidden=(128,), activation="tanh"):
    return mlp(math.prod(input_shape), num_classes, hidden, activation)


@register_model("cnn", inputs=("image",), help="small GroupNorm CNN")
def _build_cnn(input_shape, num_classes, vocab_size, width=32):
    return cnn(input_shape[0], num_classes, width)


@register_model("resnet18-gn", inputs=("image",), help="ResNet-18 with GroupNorm (CIFAR stem below 64 px)")
def _build_resnet(input_shape, num_classes, vocab_size, layers=(2, 2, 2, 2)):
    channels, height = input_shape[0], input_shape[1]
    model = ResNetGN(layers, num_classes, cifar_stem=height < 64)
    if channels != 3:     # same stem, other input channels (e.g. grey-scale images)
        old = model.conv1
        model.conv1 = nn.Conv2d(channels, old.out_channels, old.kernel_size, old.stride, old.padding, bias=False)
    return model


# config fields of the Hugging Face builders that build_model's own arguments set (an option would be passed twice)
_SET_BY_ARGUMENTS = {
    "num_labels": "the number of labels is num_classes; pass num_classes instead",
    "num_channels": "the image channels are C of input_shape (C, H, W); pass input_shape instead",
    "image_size": "the image size is H = W of input_shape (C, H, W); pass input_shape instead",
    "size": "the size is part of the model's name; build the model of that size by name instead (e.g. 'gpt2-tiny', "
            "'bert-micro', 'vit-base')"}


def _token_model(builder, size):
    def build(input_shape, num_classes, vocab_size, **overrides):
        length = input_shape[0]
        if builder is bert:
            model = bert(size, num_labels=num_classes, **overrides)
        else:
            model = builder(size, **overrides)
        positions = model.config.n_positions if builder is gpt2 else model.config.max_position_embeddings
        if vocab_size is not None and vocab_size > model.config.vocab_size:
            raise ValueError(f"token ids go up to {vocab_size - 1}, but the model's vocabulary has "
                             f"{model.config.vocab_size} entries")
        if length > positions:
            raise ValueError(f"sequences of {length} tokens are longer than the model's {positions} positions")
        return model
    build.set_by_arguments = ("size", "num_labels") if builder is bert else ("size",)
    return build


for _size in ("micro", "tiny", "base"):
    register_model(f"bert-{_size}", inputs=("tokens",), vocab_size=128 if _size == "micro" else 30522,
                   help=f"Hugging Face BERT ({_size}) for sequence classification, random init")(
        _token_model(bert, _size))
for _name, _size in (("gpt2", "small"), ("gpt2-tiny", "tiny"), ("gpt2-micro", "micro")):
    register_model(_name, inputs=("tokens",), task="lm", vocab_size=128 if _size == "micro" else 50257,
                   help=f"Hugging Face GPT-2 ({_size}) language model, random init")(_token_model(gpt2, _size))
for _name, _size in (("llama", "small"), ("llama-tiny", "tiny"), ("llama-micro", "micro")):
    register_model(_name, inputs=("tokens",), task="lm", vocab_size=128 if _size == "micro" else 49152,
                   help=f"Hugging Face Llama-style decoder ({_size}; small = SmolLM2-135M's shape) language model, "
                        "random init")(_token_model(llama, _size))


def _vit_model(size):
    def build(input_shape, num_classes, vocab_size, **overrides):
        channels, height, width = input_shape
        if height != width:
            raise ValueError(f"ViT takes square images; got {height}×{width}")
        return vit(size, num_labels=num_classes, image_size=height, num_channels=channels, **overrides)
    build.set_by_arguments = ("size", "num_labels", "num_channels", "image_size")
    return build


for _size in ("micro", "tiny", "base"):
    register_model(f"vit-{_size}", inputs=("image",),
                   help=f"Hugging Face ViT ({_size}; base = ViT-B/16) for image classification, random init")(
        _vit_model(_size))
