"""Typed signatures of the op functions ``tfl.relu``, ``tfl.sum``, ...

Generated from the op registry by ``python docs/_ext/gen_stubs.py``; do not edit.
"""

from collections.abc import Sequence

from numpy.typing import DTypeLike

from .._core._registry import Axes, Padding, Pair, Reduction, ShapeLike
from ._tensor import Operand, Tensor

__all__ = [
    "abs",
    "add",
    "astype",
    "attention",
    "avg_pool2d",
    "broadcast_to",
    "clamp",
    "concat",
    "conv2d",
    "cos",
    "cross_entropy",
    "div",
    "dropout",
    "eq",
    "exp",
    "expand_dims",
    "gather",
    "ge",
    "gelu",
    "gt",
    "layer_norm",
    "le",
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
    "permute",
    "pow",
    "relu",
    "reshape",
    "scaled_dot_product_attention",
    "scatter_add",
    "sigmoid",
    "sin",
    "softmax",
    "softplus",
    "sqrt",
    "squeeze",
    "stop_gradient",
    "sub",
    "sum",
    "take",
    "tanh",
    "transpose",
    "where",
]


def abs(x: Operand) -> Tensor:
    """Elementwise absolute value (gradient sign(x), 0 at 0).

    Operand ``x``: a Tensor, Param, number or array. Records the ``abs`` op.
    """


def add(x: Operand, y: Operand) -> Tensor:
    """Elementwise ``x + y`` with broadcasting.

    Operands ``x``, ``y``: Tensors, Params, numbers or arrays. Records the ``add`` op.
    """


def astype(x: Operand, dtype: DTypeLike) -> Tensor:
    """Cast to ``dtype``; the gradient is cast back (none flows into integer inputs).

    Operand ``x``: a Tensor, Param, number or array. Records the ``astype`` op.
    """


def attention(
    q: Operand,
    k: Operand,
    v: Operand,
    mask: Operand | None = None,
    scale: float | None = None,
    causal: bool = False,
    *,
    dropout: float = 0.0,
    training: bool | None = None,
) -> Tensor:
    """Scaled dot-product attention ``softmax(q @ k^T * scale) @ v``.

    ``q`` (..., Lq, D), ``k`` (..., Lk, D), ``v`` (..., Lk, Dv); batch dims
    broadcast. ``scale`` defaults to ``1/sqrt(D)``. ``mask`` is boolean,
    broadcastable to (..., Lq, Lk), True = attend; it gets no gradient.
    ``causal=True`` additionally keeps key ``j`` for query ``i`` only when
    ``j <= i`` (top-left aligned, as ``jax.nn.dot_product_attention``). A query
    row with every key masked attends to nothing: its output is 0 and it
    passes zero gradient (never NaN). ``dropout=p`` drops attention weights
    after the softmax with probability ``p`` and scales the rest by
    ``1 / (1 - p)``, as ``torch.nn.functional.scaled_dot_product_attention``'s
    ``dropout_p``; the boolean ``keep`` operand (True = kept) is drawn from the
    session's RNG by ``tfl.attention``. The VJP recomputes the softmax.

    Records the ``attention`` op. As :func:`dropout`, the dropout is off when
    ``dropout == 0``, in an inference session, or when ``training=False``; a
    call that is refused draws nothing from the RNG.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session(seed=0) as s:
    ...     q = s.input(jnp.ones((2, 4, 8)))
    ...     tfl.attention(q, q, q, causal=True, dropout=0.1).shape
    (2, 4, 8)
    """


def avg_pool2d(
    x: Operand,
    kernel_size: Pair,
    stride: Pair | None = None,
    padding: Pair = 0,
) -> Tensor:
    """Mean over ``kernel_size`` windows of ``x`` (N, C, H, W); ``stride`` defaults to ``kernel_size``.

    Operand ``x``: a Tensor, Param, number or array. Records the ``avg_pool2d`` op.

    Zero padding counts in the mean (the divisor is always kH * kW). Via
    ``jax.lax.reduce_window``; the VJP is derived from ``jax.vjp`` of this forward.
    """


def broadcast_to(x: Operand, shape: ShapeLike) -> Tensor:
    """Broadcast ``x`` to ``shape`` with NumPy rules; the VJP sums over the broadcast axes.

    Operand ``x``: a Tensor, Param, number or array. Records the ``broadcast_to`` op.
    """


def clamp(x: Operand, lo: float | None = None, hi: float | None = None) -> Tensor:
    """Clip ``x`` to ``[lo, hi]`` (either bound may be None); gradient passes inside the range.

    Operand ``x``: a Tensor, Param, number or array. Records the ``clamp`` op.
    """


def concat(xs: Sequence[Operand], axis: int = 0, *, dim: int | None = None) -> Tensor:
    """Concatenate the sequence of operands ``xs`` along ``axis`` (same dtype, same shape except along ``axis``).

    Operand ``xs`` is a sequence of Tensors, Params, numbers or arrays. Records the
    ``concat`` op.
    """


def conv2d(
    x: Operand,
    w: Operand,
    b: Operand | None = None,
    stride: Pair = 1,
    padding: Padding = 0,
    dilation: Pair = 1,
    groups: int = 1,
) -> Tensor:
    """2-D convolution (cross-correlation) of ``x`` (N, C, H, W) with ``w`` (O, C/groups, kH, kW), plus an optional bias ``b`` (O,).

    Operands ``x``, ``w``, optional ``b``: Tensors, Params, numbers or arrays. Records the
    ``conv2d`` op.

    ``stride`` and ``dilation`` are an int or a pair; ``padding`` is an int, a
    pair, ``((top, bottom), (left, right))``, ``"SAME"`` or ``"VALID"``. The
    forward is ``jax.lax.conv_general_dilated``. The VJP is hand-written from
    strided slices, einsums and pads, not derived: XLA's CPU compiler aborts
    the process on the transposed convolution that ``jax.vjp`` emits for some
    strided shapes (e.g. x (1, 1, 6, 5), w (1, 1, 2, 3), stride 2, padding (1, 0)).
    """


def cos(x: Operand) -> Tensor:
    """Elementwise cosine.

    Operand ``x``: a Tensor, Param, number or array. Records the ``cos`` op.
    """


def cross_entropy(
    logits: Operand,
    labels: Operand,
    reduction: Reduction = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
) -> Tensor:
    """Softmax cross-entropy of ``logits`` (..., C) against integer ``labels`` (...), as PyTorch's.

    Operands ``logits``, ``labels``: Tensors, Params, numbers or arrays. No gradient flows
    to ``labels``. Records the ``cross_entropy`` op.

    Per row ``-sum(q * log_softmax(logits))`` with ``q`` the one-hot label
    (with ``label_smoothing`` e: ``(1 - e) * one_hot + e / C``), reduced by
    ``reduction`` ("mean" over the rows that count, "sum", or "none" for shape
    ``labels.shape``). Rows whose label is ``ignore_index`` (default -100)
    count for nothing: loss and gradient 0, left out of the mean. A label
    outside ``[0, C)`` that is not ``ignore_index`` gives a NaN loss (and NaN
    gradient) for its row, so bad labels never pass silently. ``labels`` get
    no gradient.
    """


def div(x: Operand, y: Operand) -> Tensor:
    """Elementwise ``x / y`` with broadcasting (floating operands).

    Operands ``x``, ``y``: Tensors, Params, numbers or arrays. Records the ``div`` op.
    """


def dropout(x: Tensor, rate: float, training: bool | None = None) -> Tensor:
    """Inverted dropout: zero each entry with probability ``rate``, scale the rest by ``1/(1-rate)``.

    Uses the session's seeded RNG (one counter step per call). It is the identity
    when ``rate == 0``, in an inference session, or when ``training=False``.
    A composite of ``bernoulli_mask``, ``mul`` and ``where``, not a registry op.
    """


def eq(x: Operand, y: Operand) -> Tensor:
    """Elementwise comparison ``x == y`` with broadcasting (boolean result, no gradient).

    Operands ``x``, ``y``: Tensors, Params, numbers or arrays. Records the ``eq`` op.
    """


def exp(x: Operand) -> Tensor:
    """Elementwise exponential.

    Operand ``x``: a Tensor, Param, number or array. Records the ``exp`` op.
    """


def expand_dims(x: Operand, axis: Axes) -> Tensor:
    """Insert size-1 axes at ``axis`` (an int or tuple, positions in the result).

    Operand ``x``: a Tensor, Param, number or array. Records the ``expand_dims`` op.
    """


def gather(x: Operand, indices: Operand) -> Tensor:
    """``x[indices]`` for an integer array ``indices``: rows of ``x`` along axis 0 (``take`` with axis=0).

    Operands ``x``, ``indices``: Tensors, Params, numbers or arrays. No gradient flows to
    ``indices``. Records the ``gather`` op.

    Same index semantics as ``take``: negative indices count from the end,
    out-of-range ones are clamped; repeated indices accumulate in the VJP.
    """


def ge(x: Operand, y: Operand) -> Tensor:
    """Elementwise comparison ``x >= y`` with broadcasting (boolean result, no gradient).

    Operands ``x``, ``y``: Tensors, Params, numbers or arrays. Records the ``ge`` op.
    """


def gelu(x: Operand, approximate: str | bool = "none") -> Tensor:
    """Elementwise GELU: exact ``x * Phi(x)`` (``approximate="none"``, the default, as in PyTorch) or its tanh form.

    Operand ``x``: a Tensor, Param, number or array. Records the ``gelu`` op.

    ``approximate="tanh"`` (or ``True``, ``jax.nn.gelu``'s default) is
    ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))``, GPT-2's form.
    """


def gt(x: Operand, y: Operand) -> Tensor:
    """Elementwise comparison ``x > y`` with broadcasting (boolean result, no gradient).

    Operands ``x``, ``y``: Tensors, Params, numbers or arrays. Records the ``gt`` op.
    """


def layer_norm(
    x: Operand,
    weight: Operand | None = None,
    bias: Operand | None = None,
    axis: Axes = -1,
    eps: float = 1e-05,
    *,
    dim: Axes | None = None,
) -> Tensor:
    """Layer normalization ``(x - mean) / sqrt(var + eps) * weight + bias`` over the trailing ``axis`` (int or tuple).

    Operands ``x``, optional ``weight``, optional ``bias``: Tensors, Params, numbers or
    arrays. Optional operands fill in order (``bias`` needs ``weight``). Records the
    ``layer_norm`` op.

    ``var`` is the biased variance; ``weight`` and ``bias`` are optional (give
    ``weight`` alone, or both) and have the normalized trailing shape.
    """


def le(x: Operand, y: Operand) -> Tensor:
    """Elementwise comparison ``x <= y`` with broadcasting (boolean result, no gradient).

    Operands ``x``, ``y``: Tensors, Params, numbers or arrays. Records the ``le`` op.
    """


def linear(x: Operand, w: Operand, b: Operand | None = None) -> Tensor:
    """``x @ w + b`` with ``w`` of shape ``(in, out)`` and an optional bias ``b`` of shape ``(out,)``.

    Operands ``x``, ``w``, optional ``b``: Tensors, Params, numbers or arrays. Records the
    ``linear`` op.
    """


def log(x: Operand) -> Tensor:
    """Elementwise natural logarithm.

    Operand ``x``: a Tensor, Param, number or array. Records the ``log`` op.
    """


def log_softmax(x: Operand, axis: Axes = -1, *, dim: Axes | None = None) -> Tensor:
    """``x - logsumexp(x)`` over ``axis`` (int or tuple), shifted by the max for stability.

    Operand ``x``: a Tensor, Param, number or array. Records the ``log_softmax`` op.
    """


def logsumexp(
    x: Operand,
    axis: Axes | None = -1,
    keepdims: bool = False,
    *,
    dim: Axes | None = None,
    keepdim: bool | None = None,
) -> Tensor:
    """``log(sum(exp(x)))`` over ``axis`` (int, tuple or None for all), shifted by the max for stability.

    Operand ``x``: a Tensor, Param, number or array. Records the ``logsumexp`` op.
    """


def lt(x: Operand, y: Operand) -> Tensor:
    """Elementwise comparison ``x < y`` with broadcasting (boolean result, no gradient).

    Operands ``x``, ``y``: Tensors, Params, numbers or arrays. Records the ``lt`` op.
    """


def matmul(x: Operand, y: Operand) -> Tensor:
    """Matrix product with NumPy semantics (batching and broadcasting of leading dims).

    Operands ``x``, ``y``: Tensors, Params, numbers or arrays. Records the ``matmul`` op.
    """


def max(
    x: Operand,
    axis: Axes | None = None,
    keepdims: bool = False,
    *,
    dim: Axes | None = None,
    keepdim: bool | None = None,
) -> Tensor:
    """Maximum over ``axis``; ties share the gradient equally (as ``jax.grad``).

    Operand ``x``: a Tensor, Param, number or array. Records the ``max`` op.
    """


def max_pool2d(
    x: Operand,
    kernel_size: Pair,
    stride: Pair | None = None,
    padding: Pair = 0,
) -> Tensor:
    """Max over ``kernel_size`` windows of ``x`` (N, C, H, W); ``stride`` defaults to ``kernel_size``.

    Operand ``x``: a Tensor, Param, number or array. Records the ``max_pool2d`` op.

    Padding is implicit ``-inf``. Via ``jax.lax.reduce_window``; the VJP is
    derived from ``jax.vjp`` of this forward (on ties the gradient goes to one
    of the maximal elements).
    """


def maximum(x: Operand, y: Operand) -> Tensor:
    """Elementwise maximum; ties send half the gradient to each side (as ``jax.grad``).

    Operands ``x``, ``y``: Tensors, Params, numbers or arrays. Records the ``maximum`` op.
    """


def mean(
    x: Operand,
    axis: Axes | None = None,
    keepdims: bool = False,
    *,
    dim: Axes | None = None,
    keepdim: bool | None = None,
) -> Tensor:
    """Mean over ``axis`` (an int, a tuple, or None for all).

    Operand ``x``: a Tensor, Param, number or array. Records the ``mean`` op.
    """


def minimum(x: Operand, y: Operand) -> Tensor:
    """Elementwise minimum; ties send half the gradient to each side (as ``jax.grad``).

    Operands ``x``, ``y``: Tensors, Params, numbers or arrays. Records the ``minimum`` op.
    """


def mse(pred: Operand, target: Operand, reduction: Reduction = "mean") -> Tensor:
    """Squared error ``(pred - target) ** 2`` (same shapes), reduced by "mean", "sum" or "none".

    Operands ``pred``, ``target``: Tensors, Params, numbers or arrays. Records the ``mse``
    op.
    """


def mul(x: Operand, y: Operand) -> Tensor:
    """Elementwise ``x * y`` with broadcasting.

    Operands ``x``, ``y``: Tensors, Params, numbers or arrays. Records the ``mul`` op.
    """


def ne(x: Operand, y: Operand) -> Tensor:
    """Elementwise comparison ``x != y`` with broadcasting (boolean result, no gradient).

    Operands ``x``, ``y``: Tensors, Params, numbers or arrays. Records the ``ne`` op.
    """


def neg(x: Operand) -> Tensor:
    """Elementwise ``-x``.

    Operand ``x``: a Tensor, Param, number or array. Records the ``neg`` op.
    """


def permute(x: Operand, axes: Sequence[int]) -> Tensor:
    """Permute the axes by ``axes`` (required; same semantics as ``transpose``).

    Operand ``x``: a Tensor, Param, number or array. Records the ``permute`` op.
    """


def pow(x: Operand, y: Operand) -> Tensor:
    """Elementwise ``x ** y``; the gradient wrt ``y`` uses ``log(x)`` where ``x > 0``.

    Operands ``x``, ``y``: Tensors, Params, numbers or arrays. Records the ``pow`` op.
    """


def relu(x: Operand) -> Tensor:
    """Elementwise ``max(x, 0)`` (NaN propagates, as in ``jax.nn.relu``); the gradient at 0 is 0.

    Operand ``x``: a Tensor, Param, number or array. Records the ``relu`` op.
    """


def reshape(x: Operand, shape: ShapeLike) -> Tensor:
    """Reshape to ``shape`` (an int or tuple of ints; one entry may be -1, inferred).

    Operand ``x``: a Tensor, Param, number or array. Records the ``reshape`` op.
    """


scaled_dot_product_attention = attention


def scatter_add(
    x: Operand,
    indices: Operand,
    updates: Operand,
    axis: int = 0,
    *,
    dim: int | None = None,
) -> Tensor:
    """``x`` with ``updates`` added at integer ``indices`` along ``axis`` (``x.at[..., indices].add``).

    Operands ``x``, ``indices``, ``updates``: Tensors, Params, numbers or arrays. No
    gradient flows to ``indices``. Records the ``scatter_add`` op.

    ``updates`` must broadcast to ``x.shape[:axis] + indices.shape + x.shape[axis+1:]``.
    Repeated indices accumulate; negative indices count from the end; updates
    at indices still out of range are dropped (JAX's scatter semantics), and
    get a zero gradient. The VJP is ``g`` for ``x`` and ``g`` taken at
    ``indices`` for ``updates``; ``indices`` gets no gradient.
    """


def sigmoid(x: Operand) -> Tensor:
    """Elementwise logistic sigmoid.

    Operand ``x``: a Tensor, Param, number or array. Records the ``sigmoid`` op.
    """


def sin(x: Operand) -> Tensor:
    """Elementwise sine.

    Operand ``x``: a Tensor, Param, number or array. Records the ``sin`` op.
    """


def softmax(x: Operand, axis: Axes = -1, *, dim: Axes | None = None) -> Tensor:
    """``exp(x) / sum(exp(x))`` over ``axis`` (int or tuple), computed as ``exp(x - max)`` for stability.

    Operand ``x``: a Tensor, Param, number or array. Records the ``softmax`` op.
    """


def softplus(x: Operand) -> Tensor:
    """Elementwise ``log(1 + exp(x))``.

    Operand ``x``: a Tensor, Param, number or array. Records the ``softplus`` op.
    """


def sqrt(x: Operand) -> Tensor:
    """Elementwise square root.

    Operand ``x``: a Tensor, Param, number or array. Records the ``sqrt`` op.
    """


def squeeze(x: Operand, axis: Axes | None = None, *, dim: Axes | None = None) -> Tensor:
    """Remove size-1 axes: those named by ``axis`` (each must have size 1), or all of them if None.

    Operand ``x``: a Tensor, Param, number or array. Records the ``squeeze`` op.
    """


def stop_gradient(x: Operand) -> Tensor:
    """Identity whose output never carries a gradient to ``x``.

    Operand ``x``: a Tensor, Param, number or array. Records the ``stop_gradient`` op.
    """


def sub(x: Operand, y: Operand) -> Tensor:
    """Elementwise ``x - y`` with broadcasting.

    Operands ``x``, ``y``: Tensors, Params, numbers or arrays. Records the ``sub`` op.
    """


def sum(
    x: Operand,
    axis: Axes | None = None,
    keepdims: bool = False,
    *,
    dim: Axes | None = None,
    keepdim: bool | None = None,
) -> Tensor:
    """Sum over ``axis`` (an int, a tuple, or None for all).

    Operand ``x``: a Tensor, Param, number or array. Records the ``sum`` op.
    """


def take(x: Operand, indices: Operand, axis: int = 0, *, dim: int | None = None) -> Tensor:
    """Select entries of ``x`` along ``axis`` at integer ``indices`` (any shape), as ``jnp.take``.

    Operands ``x``, ``indices``: Tensors, Params, numbers or arrays. No gradient flows to
    ``indices``. Records the ``take`` op.

    The result has shape ``x.shape[:axis] + indices.shape + x.shape[axis+1:]``.
    Negative indices count from the end (NumPy style). Indices given as host
    data (NumPy, a list) are checked when recorded: one out of ``[-n, n)`` is an
    error there; indices computed on a device are clamped to ``[0, n-1]`` (checking
    them would wait for the device). The
    VJP adds the cotangent into zeros at the same indices, so repeated indices
    accumulate. ``indices`` gets no gradient.
    """


def tanh(x: Operand) -> Tensor:
    """Elementwise hyperbolic tangent.

    Operand ``x``: a Tensor, Param, number or array. Records the ``tanh`` op.
    """


def transpose(x: Operand, axes: Sequence[int] | None = None) -> Tensor:
    """Permute the axes: ``axes`` is a permutation of ``range(x.ndim)``, None (default) reverses them.

    Operand ``x``: a Tensor, Param, number or array. Records the ``transpose`` op.
    """


def where(cond: Operand, x: Operand, y: Operand) -> Tensor:
    """``x`` where ``cond`` else ``y`` (``cond`` boolean, no gradient).

    Operands ``cond``, ``x``, ``y``: Tensors, Params, numbers or arrays. No gradient flows
    to ``cond``. Records the ``where`` op.
    """
