"""The tapeflow side of the PyTorch and Flax interop tests: one CNN and one tied-embedding language model."""

from __future__ import annotations

import jax

import tapeflow as tfl
from tapeflow import nn

V, D, H, L = 11, 8, 2, 7  # vocabulary, width, heads, sequence length of the language model


class CNN(nn.Module):
    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = nn.Conv2d(3, 8, 3, key=k1, padding=1, bias=False)  # BatchNorm follows
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, key=k2)
        self.fc = nn.Linear(16 * 2 * 2, 10, key=k3)

    def forward(self, x):
        x = tfl.max_pool2d(tfl.relu(self.bn(self.conv1(x))), 2)
        x = tfl.avg_pool2d(tfl.relu(self.conv2(x)), 2)
        return self.fc(tfl.reshape(x, (x.shape[0], -1)))


class LM(nn.Module):
    def __init__(self, key, tied=True):
        k1, k2, k3 = jax.random.split(key, 3)
        self.emb = nn.Embedding(V, D, key=k1)
        self.attn = nn.MultiHeadAttention(D, H, key=k2, causal=True)
        self.ln = nn.LayerNorm(D)
        self.head = self.emb.tied_output() if tied else nn.Linear(D, V, key=k3, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(self.ln(h + self.attn(h)))
