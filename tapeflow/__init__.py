"""tapeflow: an eager, define-by-run autograd tape for JAX.

>>> import jax.numpy as jnp, tapeflow as tfl
>>> t, x = tfl.leaf(tfl.Tape.empty(), jnp.array(2.0), requires_grad=True)
>>> t, y = tfl.record(t, "mul", (x, x))
>>> float(tfl.backward(t, y.value)[x])
4.0
"""

import sys as _sys

from . import nn  # noqa: F401
from ._core import _compile_cache, _compile_log
from ._core._backward import backward, backward_graph
from ._core._compile_cache import cache_dir, set_cache_dir
from ._core._compile_log import CompileLog, CompileRecord, RecompileWarning, compile_log, set_recompile_warning
from ._core._jvp import jvp
from ._core._kernels import clear_kernel_caches, kernel_cache_info, set_kernel_cache_size
from ._core._nonfinite import NonFiniteError, Origin, nonfinite_origin
from ._core._precision import dynamic_loss_scale
from ._core._registry import REGISTRY, OpDef, ops
from ._core._result import Err, Ok, Result, TapeError
from ._core._tape import Node, Tape, keep_tape_on_error, leaf, record
from ._core._tiered import set_tiered_compilation
from ._serialization._checkpoint import CheckpointError, restore, save
from ._shell import _numpy as numpy
from ._shell._commit import StateWriteError
from ._shell._extend import defop, lift
from ._shell._functions import (  # every public op, generated from the registry, plus dropout
    abs,
    add,
    astype,
    attention,
    avg_pool2d,
    broadcast_to,
    clamp,
    concat,
    conv2d,
    cos,
    cross_entropy,
    div,
    dropout,
    eq,
    exp,
    expand_dims,
    gather,
    ge,
    gelu,
    gt,
    layer_norm,
    le,
    linear,
    log,
    log_softmax,
    logsumexp,
    lt,
    matmul,
    max,
    max_pool2d,
    maximum,
    mean,
    minimum,
    mse,
    mul,
    ne,
    neg,
    permute,
    pow,
    relu,
    reshape,
    scaled_dot_product_attention,
    scatter_add,
    sigmoid,
    sin,
    softmax,
    softplus,
    sqrt,
    squeeze,
    stop_gradient,
    sub,
    sum,
    take,
    tanh,
    transpose,
    where,
)
from ._shell._grads import Grads, ParameterGroup, clip_grad_norm
from ._shell._params import Param, Storage, canonical_indices, tie
from ._shell._remat import checkpoint
from ._shell._session import RationalFallbackWarning, Session, TapeGrowthWarning
from ._shell._tensor import RemovableHandle, Tensor, apply, current_session, last_recorded_session
from ._shell._torch_names import arange, chunk, full, ones, split, stack, zeros
from ._train._functional import StepStats, TrainStep, param_values, train_step, value_and_grad
from ._train._optim import Optimizer

__version__ = "0.1.0"

__all__ = [
    "REGISTRY",
    "CheckpointError",
    "CompileLog",
    "CompileRecord",
    "Err",
    "Grads",
    "Node",
    "NonFiniteError",
    "Ok",
    "OpDef",
    "Optimizer",
    "Origin",
    "Param",
    "ParameterGroup",
    "RationalFallbackWarning",
    "RecompileWarning",
    "RemovableHandle",
    "Result",
    "Session",
    "StateWriteError",
    "StepStats",
    "Storage",
    "Tape",
    "TapeError",
    "TapeGrowthWarning",
    "Tensor",
    "TrainStep",
    # op functions (tapeflow._shell._functions)
    "abs",
    "add",
    "apply",
    "arange",
    "astype",
    "attention",
    "avg_pool2d",
    "backward",
    "backward_graph",
    "broadcast_to",
    "cache_dir",
    "canonical_indices",
    "checkpoint",
    "chunk",
    "clamp",
    "clear_kernel_caches",
    "clip_grad_norm",
    "compile_log",
    "concat",
    "conv2d",
    "cos",
    "cross_entropy",
    "current_session",
    "defop",
    "div",
    "dropout",
    "dynamic_loss_scale",
    "eq",
    "exp",
    "expand_dims",
    "full",
    "gather",
    "ge",
    "gelu",
    "gt",
    "jvp",
    "keep_tape_on_error",
    "kernel_cache_info",
    "last_recorded_session",
    "layer_norm",
    "le",
    "leaf",
    "lift",
    "linear",
    "log",
    "log_softmax",
    "logsumexp",
    "lt",
    "matmul",
    "max",
    "max_pool2d",
    "maximum",
    "mean",
    "minimum",
    "mse",
    "mul",
    "ne",
    "neg",
    "nonfinite_origin",
    "numpy",
    "ones",
    "ops",
    "param_values",
    "permute",
    "pow",
    "record",
    "relu",
    "reshape",
    "restore",
    "save",
    "scaled_dot_product_attention",
    "scatter_add",
    "set_cache_dir",
    "set_kernel_cache_size",
    "set_recompile_warning",
    "set_tiered_compilation",
    "sigmoid",
    "sin",
    "softmax",
    "softplus",
    "split",
    "sqrt",
    "squeeze",
    "stack",
    "stop_gradient",
    "sub",
    "sum",
    "take",
    "tanh",
    "tie",
    "train_step",
    "transpose",
    "value_and_grad",
    "where",
    "zeros",
]

_compile_cache.setup_from_environment()  # the persistent compilation cache (TAPEFLOW_CACHE_DIR); starts no backend
_sys.modules.setdefault(__name__ + ".numpy", numpy)  # `import tapeflow.numpy` / `from tapeflow.numpy import cumsum`
_compile_log.install()  # every compile explained (TAPEFLOW_EXPLAIN_COMPILES); starts no backend
