"""Neural-network modules for tapeflow: :class:`Module` and ``torch.nn``'s layers, with PyTorch's arguments.

Layers take PyTorch's constructor arguments and keep PyTorch's parameter
names, layouts and state-dict keys (``Linear.weight`` is ``(out, in)``), so a
PyTorch ``state_dict`` loads with :meth:`Module.load_state_dict`. A layer
needs no ``key=``: without one it draws from the default seed stream
(:func:`tfl.nn.init.manual_seed <tapeflow.nn.init.manual_seed>`).

Modules discover their :class:`~tapeflow.Param` s from attributes in
definition order, list each storage once (tied and shared parameters
included), and only record ops, so they run eagerly in a
:class:`~tapeflow.Session`, in a lazy session and compiled in :func:`~tapeflow.train_step`.

>>> import jax.numpy as jnp, optax, tapeflow as tfl
>>> emb = tfl.nn.Embedding(16, 8)
>>> model = tfl.nn.Sequential(emb, tfl.nn.LayerNorm(8), emb.tied_output())
>>> [n for n, _ in model.named_parameters()]
['0.weight', '1.weight', '1.bias']
>>> len(model.parameter_records())
4
>>> opt = tfl.Optimizer(optax.adam(1e-2), model)
>>> def loss_fn(s, ids):
...     return tfl.cross_entropy(model(ids), ids)
>>> step = tfl.train_step(loss_fn, opt)
>>> loss = step(jnp.array([1, 2, 3]))
"""

from . import _init as init
from ._activation import ELU, GELU, LeakyReLU, LogSoftmax, ReLU, Sigmoid, SiLU, Softmax, Softplus, Tanh
from ._container import ModuleDict, ModuleList, Sequential
from ._conv import (
    AdaptiveAvgPool1d,
    AdaptiveAvgPool2d,
    AvgPool1d,
    AvgPool2d,
    Conv1d,
    Conv2d,
    ConvTranspose2d,
    MaxPool1d,
    MaxPool2d,
    Upsample,
)
from ._groups import NO_DECAY_MODULES, decay_mask, param_labels
from ._interop import load_nnx_state, load_state_dict, nnx_state, state_dict
from ._layers import MLP, Dropout, Embedding, Flatten, Identity, Linear, MultiHeadAttention, TiedLinear, Unflatten
from ._loss import (
    BCELoss,
    BCEWithLogitsLoss,
    CrossEntropyLoss,
    HuberLoss,
    KLDivLoss,
    L1Loss,
    MSELoss,
    NLLLoss,
    SmoothL1Loss,
)
from ._module import Module
from ._norm import BatchNorm1d, BatchNorm2d, GroupNorm, LayerNorm, RMSNorm
from ._recurrent import GRU, LSTM, GRUCell, LSTMCell
from ._summary import Summary, SummaryRow, summary
from ._transformer import MultiheadAttention, TransformerEncoder, TransformerEncoderLayer

__all__ = [
    "ELU",
    "GELU",
    "GRU",
    "LSTM",
    "MLP",
    "NO_DECAY_MODULES",
    "AdaptiveAvgPool1d",
    "AdaptiveAvgPool2d",
    "AvgPool1d",
    "AvgPool2d",
    "BCELoss",
    "BCEWithLogitsLoss",
    "BatchNorm1d",
    "BatchNorm2d",
    "Conv1d",
    "Conv2d",
    "ConvTranspose2d",
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "Flatten",
    "GRUCell",
    "GroupNorm",
    "HuberLoss",
    "Identity",
    "KLDivLoss",
    "L1Loss",
    "LSTMCell",
    "LayerNorm",
    "LeakyReLU",
    "Linear",
    "LogSoftmax",
    "MSELoss",
    "MaxPool1d",
    "MaxPool2d",
    "Module",
    "ModuleDict",
    "ModuleList",
    "MultiHeadAttention",
    "MultiheadAttention",
    "NLLLoss",
    "RMSNorm",
    "ReLU",
    "Sequential",
    "SiLU",
    "Sigmoid",
    "SmoothL1Loss",
    "Softmax",
    "Softplus",
    "Summary",
    "SummaryRow",
    "Tanh",
    "TiedLinear",
    "TransformerEncoder",
    "TransformerEncoderLayer",
    "Unflatten",
    "Upsample",
    "decay_mask",
    "init",
    "load_nnx_state",
    "load_state_dict",
    "nnx_state",
    "param_labels",
    "state_dict",
    "summary",
]
