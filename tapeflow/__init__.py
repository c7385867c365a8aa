"""tapeflow: an eager, define-by-run autograd tape for JAX.

>>> import jax.numpy as jnp, tapeflow as tfl
>>> t, x = tfl.leaf(tfl.Tape.empty(), jnp.array(2.0), requires_grad=True)
>>> t, y = tfl.record(t, "mul", (x, x))
>>> float(tfl.backward(t, y.value)[x])
4.0
"""

from . import _ops_math  # noqa: F401  (registers ops)
from . import _ops_shape, _ops_nn  # noqa: F401
from ._registry import OpDef, REGISTRY, clear_kernel_caches, kernel_cache_info, ops
from ._result import Err, Ok, Result, TapeError
from ._tape import Node, Tape, backward, keep_tape_on_error, leaf, record
from ._optim import Optimizer
from ._checkpoint import CheckpointError, restore, save
from ._functional import TrainStep, param_values, train_step, value_and_grad
from ._params import Param, Storage, canonical_indices, tie
from ._grads import Grads, ParameterGroup
from ._session import RationalFallbackWarning, Session
from ._tensor import Tensor, apply, current_session, last_recorded_session
from ._functions import (  # every public op, generated from the registry, plus dropout
    abs, add, astype, attention, avg_pool2d, broadcast_to, clamp, concat, conv2d, cos,
    cross_entropy, div, dropout, eq, exp, expand_dims, gather, ge, gelu, gt, layer_norm, le, linear,
    log, log_softmax, logsumexp, lt, matmul, max, max_pool2d, maximum, mean, minimum, mse, mul, ne,
    neg, permute, pow, relu, reshape, scaled_dot_product_attention, scatter_add, sigmoid, sin,
    softmax, softplus, sqrt, squeeze, stop_gradient, sub, sum, take, tanh, transpose, where,
)
from . import nn  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "restore",
    "save",
    "Err",
    "Grads",
    "Optimizer",
    "TrainStep",
    "param_values",
    "train_step",
    "value_and_grad",
    "Param",
    "ParameterGroup",
    "RationalFallbackWarning",
    "Session",
    "Storage",
    "Tensor",
    "apply",
    "canonical_indices",
    "current_session",
    "last_recorded_session",
    "tie",
    "Node",
    "Ok",
    "OpDef",
    "REGISTRY",
    "Result",
    "Tape",
    "TapeError",
    "backward",
    "clear_kernel_caches",
    "keep_tape_on_error",
    "kernel_cache_info",
    "leaf",
    "ops",
    "record",
    # op functions (tapeflow._functions)
    "abs", "add", "astype", "attention", "avg_pool2d", "broadcast_to", "clamp", "concat", "conv2d",
    "cos", "cross_entropy", "div", "dropout", "eq", "exp", "expand_dims", "gather", "ge", "gelu",
    "gt", "layer_norm", "le", "linear", "log", "log_softmax", "logsumexp", "lt", "matmul", "max",
    "max_pool2d", "maximum", "mean", "minimum", "mse", "mul", "ne", "neg", "permute", "pow", "relu",
    "reshape", "scaled_dot_product_attention", "scatter_add", "sigmoid", "sin", "softmax",
    "softplus", "sqrt", "squeeze", "stop_gradient", "sub", "sum", "take", "tanh", "transpose",
    "where",
]
