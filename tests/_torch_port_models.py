"""Three everyday PyTorch models and their tapeflow ports, for ``test_torch_ports.py``.

Each model is written twice with the same source: once at module level with tapeflow's
PyTorch names (``from tapeflow import nn``, ``import tapeflow.nn.functional as F`` and
``tfl.<fn>``), once inside :func:`torch_models` with PyTorch's own (``torch.nn``,
``torch.nn.functional``, ``torch.<fn>``). The two class bodies differ only in ``tfl.``
versus ``torch.`` (``test_torch_ports.py`` checks it), so a port is the PyTorch source
with its imports changed.

* :class:`MobileNet`: a stem convolution, two depthwise-separable blocks (a depthwise
  ``Conv2d(groups=channels)`` and a 1x1 pointwise ``Conv2d``, each followed by
  ``BatchNorm2d`` and ``ReLU``), ``AdaptiveAvgPool2d(1)``, ``Flatten`` and a ``Linear`` head.
* :class:`TransformerClassifier`: token and learned position embeddings, a two-layer
  ``TransformerEncoder`` given a ``src_key_padding_mask`` made from the padding token,
  a mean over the positions that are not padding, and a ``Linear`` head.
* :class:`LSTMLanguageModel`: an ``Embedding``, a two-layer ``batch_first`` ``LSTM`` and
  a ``Linear`` decoder whose weight is the embedding's weight (PyTorch's tying idiom).
"""

from __future__ import annotations

from types import SimpleNamespace

import tapeflow as tfl
import tapeflow.nn.functional as F
from tapeflow import nn

IMAGE = (4, 3, 16, 16)  # MobileNet input: batch, channels, height, width
CLASSES = 10
VOCAB, PAD, SEQ, LABELS = 13, 0, 7, 3  # TransformerClassifier: vocabulary, padding token, length, labels
LM_VOCAB, LM_HIDDEN, LM_SEQ = 11, 12, 5  # LSTMLanguageModel: vocabulary, width (tied: embedding = decoder), length

MODEL_NAMES = ("DepthwiseSeparable", "MobileNet", "TransformerClassifier", "LSTMLanguageModel")
"""The classes written twice, in the order they are defined (``DepthwiseSeparable`` is MobileNet's block)."""


class DepthwiseSeparable(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.depthwise = nn.Conv2d(cin, cin, 3, stride=stride, padding=1, groups=cin, bias=False)
        self.bn1 = nn.BatchNorm2d(cin)
        self.pointwise = nn.Conv2d(cin, cout, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()

    def forward(self, x):
        x = self.relu(self.bn1(self.depthwise(x)))
        return self.relu(self.bn2(self.pointwise(x)))


class MobileNet(nn.Module):
    def __init__(self, num_classes=CLASSES):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(),
        )
        self.blocks = nn.Sequential(DepthwiseSeparable(8, 16, 1), DepthwiseSeparable(16, 32, 2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.classifier = nn.Linear(32, num_classes)

    def forward(self, x):
        return self.classifier(self.flatten(self.pool(self.blocks(self.stem(x)))))

    def loss(self, logits, y):
        return F.cross_entropy(logits, y)


class TransformerClassifier(nn.Module):
    def __init__(self, vocab=VOCAB, d_model=32, max_len=SEQ, num_classes=LABELS, pad=PAD):
        super().__init__()
        self.pad = pad
        self.embed = nn.Embedding(vocab, d_model, padding_idx=pad)
        self.pos = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, ids):
        padding = ids == self.pad  # (B, T), True where a token is padding
        positions = tfl.arange(ids.shape[1])
        h = self.embed(ids) + self.pos(positions)
        h = self.encoder(h, src_key_padding_mask=padding)
        keep = (ids != self.pad).unsqueeze(-1).float()
        pooled = (h * keep).sum(dim=1) / keep.sum(dim=1)
        return self.head(pooled)

    def loss(self, logits, y):
        return F.cross_entropy(logits, y)


class LSTMLanguageModel(nn.Module):
    def __init__(self, vocab=LM_VOCAB, hidden=LM_HIDDEN):
        super().__init__()
        self.vocab = vocab
        self.encoder = nn.Embedding(vocab, hidden)
        self.rnn = nn.LSTM(hidden, hidden, num_layers=2, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab)
        self.decoder.weight = self.encoder.weight  # tied: one tensor under two names

    def forward(self, ids):
        output, (h, c) = self.rnn(self.encoder(ids))
        return self.decoder(output)

    def loss(self, logits, targets):
        return F.cross_entropy(logits.view(-1, self.vocab), targets.view(-1))


def torch_models():
    """PyTorch's originals: the same class bodies as above, with ``torch`` where tapeflow's are ``tfl``."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class DepthwiseSeparable(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.depthwise = nn.Conv2d(cin, cin, 3, stride=stride, padding=1, groups=cin, bias=False)
            self.bn1 = nn.BatchNorm2d(cin)
            self.pointwise = nn.Conv2d(cin, cout, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU()

        def forward(self, x):
            x = self.relu(self.bn1(self.depthwise(x)))
            return self.relu(self.bn2(self.pointwise(x)))

    class MobileNet(nn.Module):
        def __init__(self, num_classes=CLASSES):
            super().__init__()
            self.stem = nn.Sequential(
                nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False),
                nn.BatchNorm2d(8),
                nn.ReLU(),
            )
            self.blocks = nn.Sequential(DepthwiseSeparable(8, 16, 1), DepthwiseSeparable(16, 32, 2))
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.flatten = nn.Flatten()
            self.classifier = nn.Linear(32, num_classes)

        def forward(self, x):
            return self.classifier(self.flatten(self.pool(self.blocks(self.stem(x)))))

        def loss(self, logits, y):
            return F.cross_entropy(logits, y)

    class TransformerClassifier(nn.Module):
        def __init__(self, vocab=VOCAB, d_model=32, max_len=SEQ, num_classes=LABELS, pad=PAD):
            super().__init__()
            self.pad = pad
            self.embed = nn.Embedding(vocab, d_model, padding_idx=pad)
            self.pos = nn.Embedding(max_len, d_model)
            layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, num_layers=2)
            self.head = nn.Linear(d_model, num_classes)

        def forward(self, ids):
            padding = ids == self.pad  # (B, T), True where a token is padding
            positions = torch.arange(ids.shape[1])
            h = self.embed(ids) + self.pos(positions)
            h = self.encoder(h, src_key_padding_mask=padding)
            keep = (ids != self.pad).unsqueeze(-1).float()
            pooled = (h * keep).sum(dim=1) / keep.sum(dim=1)
            return self.head(pooled)

        def loss(self, logits, y):
            return F.cross_entropy(logits, y)

    class LSTMLanguageModel(nn.Module):
        def __init__(self, vocab=LM_VOCAB, hidden=LM_HIDDEN):
            super().__init__()
            self.vocab = vocab
            self.encoder = nn.Embedding(vocab, hidden)
            self.rnn = nn.LSTM(hidden, hidden, num_layers=2, batch_first=True)
            self.decoder = nn.Linear(hidden, vocab)
            self.decoder.weight = self.encoder.weight  # tied: one tensor under two names

        def forward(self, ids):
            output, (h, c) = self.rnn(self.encoder(ids))
            return self.decoder(output)

        def loss(self, logits, targets):
            return F.cross_entropy(logits.view(-1, self.vocab), targets.view(-1))

    return SimpleNamespace(
        DepthwiseSeparable=DepthwiseSeparable,
        MobileNet=MobileNet,
        TransformerClassifier=TransformerClassifier,
        LSTMLanguageModel=LSTMLanguageModel,
    )
