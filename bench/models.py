"""Benchmark models, defined once so pdpfast and Opacus train exactly the same network."""
from __future__ import annotations

import math

import torch
from torch import nn


class Attention(nn.Module):
    """Multi-head self-attention from Linear layers (both engines support Linear)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        B, T, d = x.shape
        h = self.heads
        split = lambda t: t.view(B, T, h, d // h).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // h), dim=-1)
        return self.out((att @ v).transpose(1, 2).reshape(B, T, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """Token + position embeddings, pre-LN blocks, mean-pooled classification head."""

    def __init__(self, vocab: int = 1000, d: int = 256, layers: int = 4, heads: int = 4, seq: int = 128,
                 classes: int = 2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*(Block(d, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device).repeat(ids.shape[0], 1)  # contiguous: Opacus ghost needs it
        x = self.blocks(self.tok(ids) + self.pos(pos))
        return self.head(self.ln(x).mean(1))


def groupnorm_cnn(classes: int = 10) -> nn.Module:
    """A CIFAR-shaped CNN with GroupNorm (no BatchNorm: it has no per-sample gradients)."""
    def block(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.ReLU()]

    return nn.Sequential(*block(3, 32), *block(32, 32), nn.MaxPool2d(2), *block(32, 64), *block(64, 64),
                         nn.MaxPool2d(2), *block(64, 128), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(128, classes))
