"""Neural-network modules for tapeflow: :class:`Module` and common layers.

Modules discover their :class:`~tapeflow.Param` s from attributes in
definition order, list each storage once (tied and shared parameters
included), and only record ops, so they run eagerly in a
:class:`~tapeflow.Session` and compiled in :func:`~tapeflow.train_step`.

>>> import jax, jax.numpy as jnp, optax, tapeflow as tfl
>>> emb = tfl.nn.Embedding(16, 8, key=jax.random.key(0))
>>> model = tfl.nn.Sequential(emb, tfl.nn.LayerNorm(8), emb.tied_output())
>>> [n for n, _ in model.named_parameters()]
['0.weight', '1.weight', '1.bias']
>>> len(model.parameter_records())
4
>>> opt = tfl.Optimizer(optax.adam(1e-2), model)
>>> step = tfl.train_step(lambda s, ids: tfl.cross_entropy(model(ids), ids), opt)
>>> loss = step(jnp.array([1, 2, 3]))
"""

from . import _init as init
from ._groups import NO_DECAY_MODULES, decay_mask, param_labels
from ._interop import load_nnx_state, load_state_dict, nnx_state, state_dict
from ._layers import (
    MLP,
    Conv2d,
    Dropout,
    Embedding,
    LayerNorm,
    Linear,
    MultiHeadAttention,
    Sequential,
    TiedLinear,
)
from ._module import Module
from ._norm import BatchNorm1d, BatchNorm2d
from ._recurrent import GRUCell, LSTMCell
from ._summary import Summary, SummaryRow, summary

__all__ = [
    "MLP",
    "NO_DECAY_MODULES",
    "BatchNorm1d",
    "BatchNorm2d",
    "Conv2d",
    "Dropout",
    "Embedding",
    "GRUCell",
    "LSTMCell",
    "LayerNorm",
    "Linear",
    "Module",
    "MultiHeadAttention",
    "Sequential",
    "Summary",
    "SummaryRow",
    "TiedLinear",
    "decay_mask",
    "init",
    "load_nnx_state",
    "load_state_dict",
    "nnx_state",
    "param_labels",
    "state_dict",
    "summary",
]
