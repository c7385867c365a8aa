"""Module-level op functions: ``tfl.relu(h)``, ``tfl.matmul(a, b)``, ...

Each one records a registry op on the operands' session (see
:func:`tapeflow.apply`). Operands may be :class:`~tapeflow.Tensor` handles,
:class:`~tapeflow.Param` s, numbers or arrays.

>>> import jax.numpy as jnp, tapeflow as tfl
>>> with tfl.Session() as s:
...     x = s.input(jnp.array([-1.0, 2.0]))
...     tfl.relu(x).value.tolist()
[0.0, 2.0]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._registry import is_float
from ._result import TapeError
from ._session import Tensor, _session_of, apply

__all__ = [
    "add", "sub", "mul", "div", "neg", "pow", "abs", "sqrt", "exp", "log", "sin", "cos", "tanh",
    "sigmoid", "relu", "gelu", "softplus", "clamp", "maximum", "minimum", "where", "sum", "mean",
    "max", "reshape", "transpose", "permute", "broadcast_to", "expand_dims", "squeeze", "concat",
    "take", "gather", "scatter_add", "matmul", "linear", "softmax", "log_softmax", "logsumexp",
    "layer_norm", "cross_entropy", "mse", "conv2d", "max_pool2d", "avg_pool2d", "attention",
    "scaled_dot_product_attention", "stop_gradient", "astype", "dropout", "lt", "le", "gt", "ge",
    "eq", "ne",
]

_builtin_max = max

T = Any  # Tensor | Param | number | array


def add(x: T, y: T) -> Tensor:
    """``x + y`` with broadcasting."""
    return apply("add", x, y)


def sub(x: T, y: T) -> Tensor:
    """``x - y`` with broadcasting."""
    return apply("sub", x, y)


def mul(x: T, y: T) -> Tensor:
    """``x * y`` with broadcasting."""
    return apply("mul", x, y)


def div(x: T, y: T) -> Tensor:
    """``x / y`` with broadcasting."""
    return apply("div", x, y)


def neg(x: T) -> Tensor:
    """``-x``."""
    return apply("neg", x)


def pow(x: T, y: T) -> Tensor:  # noqa: A001
    """``x ** y``."""
    return apply("pow", x, y)


def abs(x: T) -> Tensor:  # noqa: A001
    """``|x|``."""
    return apply("abs", x)


def sqrt(x: T) -> Tensor:
    """Square root."""
    return apply("sqrt", x)


def exp(x: T) -> Tensor:
    """Exponential."""
    return apply("exp", x)


def log(x: T) -> Tensor:
    """Natural logarithm."""
    return apply("log", x)


def sin(x: T) -> Tensor:
    """Sine."""
    return apply("sin", x)


def cos(x: T) -> Tensor:
    """Cosine."""
    return apply("cos", x)


def tanh(x: T) -> Tensor:
    """Hyperbolic tangent."""
    return apply("tanh", x)


def sigmoid(x: T) -> Tensor:
    """Logistic sigmoid."""
    return apply("sigmoid", x)


def relu(x: T) -> Tensor:
    """``max(x, 0)``."""
    return apply("relu", x)


def gelu(x: T) -> Tensor:
    """GELU (exact erf form)."""
    return apply("gelu", x)


def softplus(x: T) -> Tensor:
    """``log(1 + exp(x))``."""
    return apply("softplus", x)


def clamp(x: T, lo: float | None = None, hi: float | None = None) -> Tensor:
    """Clip to ``[lo, hi]``."""
    return apply("clamp", x, lo=lo, hi=hi)


def maximum(x: T, y: T) -> Tensor:
    """Elementwise maximum."""
    return apply("maximum", x, y)


def minimum(x: T, y: T) -> Tensor:
    """Elementwise minimum."""
    return apply("minimum", x, y)


def where(cond: T, x: T, y: T) -> Tensor:
    """``x`` where ``cond`` (boolean) else ``y``."""
    return apply("where", cond, x, y)


def sum(x: T, axis: Any = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """Sum over ``axis`` (None: all axes)."""
    return apply("sum", x, axis=_ax(axis), keepdims=keepdims)


def mean(x: T, axis: Any = None, keepdims: bool = False) -> Tensor:
    """Mean over ``axis`` (None: all axes)."""
    return apply("mean", x, axis=_ax(axis), keepdims=keepdims)


def max(x: T, axis: Any = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """Maximum over ``axis`` (None: all axes)."""
    return apply("max", x, axis=_ax(axis), keepdims=keepdims)


def _ax(axis: Any) -> Any:
    return tuple(axis) if isinstance(axis, list) else axis


def reshape(x: T, shape: Any) -> Tensor:
    """Reshape (one dimension may be -1)."""
    return apply("reshape", x, shape=tuple(shape) if not isinstance(shape, int) else (shape,))


def transpose(x: T, axes: Any = None) -> Tensor:
    """Permute axes (None: reverse them)."""
    return apply("transpose", x, axes=None if axes is None else tuple(axes))


def permute(x: T, axes: Any) -> Tensor:
    """Permute axes into the order ``axes``."""
    return apply("permute", x, axes=tuple(axes))


def broadcast_to(x: T, shape: Any) -> Tensor:
    """Broadcast to ``shape``."""
    return apply("broadcast_to", x, shape=tuple(shape))


def expand_dims(x: T, axis: int) -> Tensor:
    """Insert a size-1 axis at ``axis``."""
    return apply("expand_dims", x, axis=axis)


def squeeze(x: T, axis: Any = None) -> Tensor:
    """Remove size-1 axes (all, or the ones named)."""
    return apply("squeeze", x, axis=_ax(axis))


def concat(xs: Any, axis: int = 0) -> Tensor:
    """Concatenate a sequence of tensors along ``axis``."""
    return apply("concat", *xs, axis=axis)


def take(x: T, indices: T, axis: int = 0) -> Tensor:
    """Pick entries along ``axis`` by integer ``indices`` (repeats accumulate in the gradient)."""
    return apply("take", x, indices, axis=axis)


def gather(x: T, indices: T) -> Tensor:
    """``x[indices]`` for an integer array of indices along axis 0."""
    return apply("gather", x, indices)


def scatter_add(x: T, indices: T, updates: T, axis: int = 0) -> Tensor:
    """``x`` with ``updates`` added at ``indices`` along ``axis`` (repeats accumulate)."""
    return apply("scatter_add", x, indices, updates, axis=axis)


def matmul(x: T, y: T) -> Tensor:
    """Matrix product with batching and broadcasting."""
    return apply("matmul", x, y)


def linear(x: T, w: T, b: T | None = None) -> Tensor:
    """``x @ w + b`` with ``w`` of shape ``(in, out)``."""
    return apply("linear", x, w) if b is None else apply("linear", x, w, b)


def softmax(x: T, axis: int = -1) -> Tensor:
    """Softmax along ``axis``."""
    return apply("softmax", x, axis=axis)


def log_softmax(x: T, axis: int = -1) -> Tensor:
    """Log-softmax along ``axis``."""
    return apply("log_softmax", x, axis=axis)


def logsumexp(x: T, axis: int = -1, keepdims: bool = False) -> Tensor:
    """``log(sum(exp(x)))`` along ``axis``, computed stably."""
    return apply("logsumexp", x, axis=axis, keepdims=keepdims)


def layer_norm(x: T, weight: T | None = None, bias: T | None = None, axis: Any = -1, eps: float = 1e-5) -> Tensor:
    """Layer normalization over trailing ``axis`` with optional affine ``weight``/``bias``."""
    ops = [x] + [o for o in (weight, bias) if o is not None]
    if bias is not None and weight is None:
        raise TapeError("layer_norm: a bias needs a weight (pass weight=ones to use a bias alone)")
    return apply("layer_norm", *ops, axis=_ax(axis), eps=float(eps))


def cross_entropy(logits: T, labels: T, reduction: str = "mean") -> Tensor:
    """Softmax cross-entropy of ``logits (..., C)`` against integer ``labels (...)``."""
    return apply("cross_entropy", logits, labels, reduction=reduction)


def mse(pred: T, target: T, reduction: str = "mean") -> Tensor:
    """Mean squared error."""
    return apply("mse", pred, target, reduction=reduction)


def conv2d(x: T, w: T, b: T | None = None, stride: Any = 1, padding: Any = 0, dilation: Any = 1, groups: int = 1) -> Tensor:
    """2-D convolution, NCHW input and OIHW weight."""
    ops = [x, w] if b is None else [x, w, b]
    return apply("conv2d", *ops, stride=_ax(stride), padding=_ax(padding), dilation=_ax(dilation), groups=groups)


def max_pool2d(x: T, kernel_size: Any, stride: Any = None, padding: Any = 0) -> Tensor:
    """2-D max pooling over NCHW input."""
    return apply("max_pool2d", x, kernel_size=_ax(kernel_size), stride=_ax(stride), padding=_ax(padding))


def avg_pool2d(x: T, kernel_size: Any, stride: Any = None, padding: Any = 0) -> Tensor:
    """2-D average pooling over NCHW input."""
    return apply("avg_pool2d", x, kernel_size=_ax(kernel_size), stride=_ax(stride), padding=_ax(padding))


def attention(q: T, k: T, v: T, mask: T | None = None, scale: float | None = None, causal: bool = False) -> Tensor:
    """Scaled dot-product attention; ``mask`` is boolean (True = attend)."""
    ops = [q, k, v] if mask is None else [q, k, v, mask]
    return apply("attention", *ops, scale=None if scale is None else float(scale), causal=bool(causal))


scaled_dot_product_attention = attention


def stop_gradient(x: T) -> Tensor:
    """Identity that blocks gradients."""
    return apply("stop_gradient", x)


def astype(x: T, dtype: Any) -> Tensor:
    """Cast to ``dtype``."""
    return apply("astype", x, dtype=np.dtype(dtype))


def dropout(x: Tensor, rate: float, training: bool | None = None) -> Tensor:
    """Inverted dropout: zero each entry with probability ``rate``, scale the rest by ``1/(1-rate)``.

    Uses the session's seeded RNG (one counter step per call). It is the identity
    when ``rate == 0``, in an inference session, or when ``training=False``.
    """
    if not 0.0 <= float(rate) < 1.0:
        raise TapeError(f"dropout: rate must be in [0, 1), got {rate}")
    s = _session_of((x,), "dropout")
    if isinstance(x, Tensor):
        s.check(x)
    if training is None:
        training = s.grad_enabled
    if not training or rate == 0.0:
        return x if isinstance(x, Tensor) else apply("stop_gradient", x)
    if not is_float(np.dtype(x.dtype)):
        # checked before drawing: a rejected call must not advance the RNG counter
        raise TapeError(f"dropout: operand has dtype {x.dtype}, expected a floating dtype; cast it first with tfl.astype")
    keep = 1.0 - float(rate)
    shape = x.shape
    mask = s.bernoulli_mask(shape, keep)
    return where(mask, x * (1.0 / keep), 0.0)


def _cmp(name: str, doc: str) -> Any:
    def f(x: T, y: T) -> Tensor:
        return apply(name, x, y)

    f.__name__ = f.__qualname__ = name
    f.__doc__ = doc
    return f


lt = _cmp("lt", "``x < y`` (boolean, no gradient).")
le = _cmp("le", "``x <= y`` (boolean, no gradient).")
gt = _cmp("gt", "``x > y`` (boolean, no gradient).")
ge = _cmp("ge", "``x >= y`` (boolean, no gradient).")
eq = _cmp("eq", "``x == y`` (boolean, no gradient).")
ne = _cmp("ne", "``x != y`` (boolean, no gradient).")

del _builtin_max
