"""Model builders for training and benchmarks: no weight downloads, everything from a config.

``resnet18_gn`` is ResNet-18 with GroupNorm in place of BatchNorm (BatchNorm has no per-sample
gradients) and torchvision's module names (conv1, bn1, layer1.0.conv1, ..., fc), so a torchvision
state_dict's convolution and linear weights load into it. ``bert`` and ``gpt2`` build Hugging
Face models from configs with random initialization.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def _norm(channels: int, groups: int = 32) -> nn.GroupNorm:
    return nn.GroupNorm(math.gcd(groups, channels), channels)


class BasicBlock(nn.Module):
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
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNetGN(nn.Module):
    """ResNet with GroupNorm. cifar_stem: a 3×3 stride-1 first convolution and no max-pool (32×32 inputs)."""

    def __init__(self, layers=(2, 2, 2, 2), num_classes: int = 10, cifar_stem: bool = True):
        super().__init__()
        if cifar_stem:
            self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
            self.maxpool = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.bn1 = _norm(64)
        self.relu = nn.ReLU(inplace=True)
        inplanes, stages = 64, []
        for i, (planes, blocks) in enumerate(zip((64, 128, 256, 512), layers)):
            stride = 1 if i == 0 else 2
            stage = [BasicBlock(inplanes, planes, stride)] + [BasicBlock(planes, planes) for _ in range(blocks - 1)]
            stages.append(nn.Sequential(*stage))
            inplanes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18_gn(num_classes: int = 10, cifar_stem: bool = True) -> ResNetGN:
    return ResNetGN((2, 2, 2, 2), num_classes, cifar_stem)


def bert(size: str = "base", num_labels: int = 2, **overrides):
    """BertForSequenceClassification, random init. size: "base" (12×768), "tiny" (2×128) or "micro"."""
    from transformers import BertConfig, BertForSequenceClassification

    sizes = {"base": {}, "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=512),
             "micro": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                           vocab_size=128, max_position_embeddings=64)}
    if size not in sizes:
        raise ValueError(f"size must be one of {sorted(sizes)}, got {size!r}")
    config = BertConfig(num_labels=num_labels, **{**sizes[size], **overrides})
    config._attn_implementation = "eager"
    return BertForSequenceClassification(config)


def gpt2(size: str = "small", **overrides):
    """GPT2LMHeadModel (lm_head tied to wte), random init. size: "small" (12×768), "tiny" or "micro"."""
    from transformers import GPT2Config, GPT2LMHeadModel

    sizes = {"small": {}, "tiny": dict(n_embd=128, n_layer=2, n_head=2),
             "micro": dict(n_embd=32, n_layer=1, n_head=2, vocab_size=128, n_positions=64)}
    if size not in sizes:
        raise ValueError(f"size must be one of {sorted(sizes)}, got {size!r}")
    config = GPT2Config(**{**sizes[size], **overrides})
    config._attn_implementation = "eager"
    return GPT2LMHeadModel(config)
