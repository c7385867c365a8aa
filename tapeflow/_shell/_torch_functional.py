"""``torch.nn.functional``'s functions, declared in the surface table (:mod:`._surface`), bound as ``tfl.nn.functional``.

Each function takes PyTorch's arguments (layouts too: ``conv2d`` weights are
``(out, in / groups, kh, kw)``, ``linear`` weights ``(out, in)``, class
scores on dimension 1 for ``cross_entropy``) and records built-in ops, or a
lifted JAX function, on its operands' session. Where PyTorch returns int64 or
float64, tapeflow returns int32 or float32 (JAX runs without x64).

>>> import jax.numpy as jnp, tapeflow as tfl
>>> import tapeflow.nn.functional as F
>>> with tfl.Session() as s:
...     x = s.input(jnp.ones((2, 3, 8)))
...     y = F.conv1d(x, jnp.ones((4, 3, 3)), padding="same")
...     y.shape, F.linear(x, jnp.ones((5, 8))).shape
((2, 4, 8), (2, 3, 5))
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np

from .._core._result import TapeError
from .._core._typing import Array, Shape
from . import _functions
from ._extend import lift
from ._params import Param
from ._surface import torch_entry
from ._tensor import Operand, Tensor, apply, operand_shape, record_op, session_of

__all__ = [
    "adaptive_avg_pool1d",
    "adaptive_avg_pool2d",
    "avg_pool1d",
    "avg_pool2d",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "conv1d",
    "conv2d",
    "conv_transpose2d",
    "cosine_similarity",
    "cross_entropy",
    "dropout",
    "elu",
    "embedding",
    "gelu",
    "group_norm",
    "huber_loss",
    "interpolate",
    "kl_div",
    "l1_loss",
    "layer_norm",
    "leaky_relu",
    "linear",
    "max_pool1d",
    "max_pool2d",
    "mse_loss",
    "nll_loss",
    "normalize",
    "one_hot",
    "pad",
    "relu",
    "rms_norm",
    "scaled_dot_product_attention",
    "silu",
    "smooth_l1_loss",
    "softplus",
]

IntOrTuple = int | Sequence[int]
"""PyTorch's ``_size_any_t``: one int for every spatial dimension, or one per dimension."""

# --------------------------------------------------------------------------- helpers


def _dtype(x: Operand) -> np.dtype:
    if type(x) is Tensor:  # the common operand: its dtype is a NumPy dtype already
        return x.dtype
    got = getattr(x, "dtype", None)
    if got is None or type(got).__module__ == "torch":  # a CPU torch tensor: its dtype is torch's own type
        return np.asarray(x).dtype
    return np.dtype(got)


def _shape(x: Operand) -> Shape:
    """:func:`operand_shape`, read straight off a Tensor or a Param (whose shapes are tuples of ints already)."""
    return x.shape if type(x) is Tensor or type(x) is Param else operand_shape(x)


_ISA: dict[tuple[np.dtype, type], bool] = {}


def _isa(dt: np.dtype, kind: type) -> bool:
    """``jnp.issubdtype(dt, kind)``, remembered per pair (entries ask it on every call, of few distinct dtypes)."""
    key = (dt, kind)
    got = _ISA.get(key)
    if got is None:
        got = _ISA[key] = bool(jnp.issubdtype(dt, kind))
    return got


def _is_float(x: Operand) -> bool:
    return _isa(_dtype(x), jnp.floating)


def _ints(op: str, name: str, v: object, n: int, least: int) -> tuple[int, ...]:
    """``v`` (an int, or a sequence of ``n`` ints) as ``n`` ints, each at least ``least``."""
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        out = (int(v),) * n
    elif (
        isinstance(v, (tuple, list))
        and len(v) in (1, n)
        and all(isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in v)
    ):
        out = tuple(int(a) for a in v) * (n if len(v) == 1 else 1)
    else:
        raise TypeError(f"{op}: {name}={v!r} must be an int or a sequence of {n} ints")
    if builtins.min(out) < least:
        raise ValueError(f"{op}: {name}={v!r} must be at least {least}")
    return out


def _batched(op: str, x: Operand, spatial: int) -> tuple[Operand, bool]:
    """``x`` with a batch axis (PyTorch's unbatched ``(C, *spatial)`` input gets one), and whether one was added."""
    nd = len(_shape(x))
    if nd == spatial + 2:
        return x, False
    if nd == spatial + 1:
        return apply("expand_dims", x, axis=0), True
    want = ", ".join(("C", "L") if spatial == 1 else ("C", "H", "W"))
    raise ValueError(
        f"{op}: input must have shape (N, {want}) or unbatched ({want}), got {_shape(x)} ({nd} dimensions)"
    )


def _unbatched(y: Tensor, added: bool) -> Tensor:
    return apply("squeeze", y, axis=0) if added else y


# PyTorch CPU computes these in int64; tapeflow's ops are float-only and int32 (no x64) would wrap where int64 does not
_INT_CONV = "integer convolution: the conv ops take floating inputs only; cast the input and weight to float"
_INT_MATMUL = "integer linear: the linear_t op takes floating inputs only; cast the input and weight to float"
_INT_AVG = (
    "integer average pooling: PyTorch truncates each window's mean toward zero in the input's integer dtype; "
    "tapeflow pools floats only, cast to float (and back with .long() for PyTorch's truncation)"
)


def _float_input(op: str, x: Operand, what: str = "input") -> None:
    if not _is_float(x):
        raise TapeError(f"{op}: {what} has dtype {_dtype(x)}, expected a floating dtype; cast it with .float()")


# --------------------------------------------------------------------------- linear


@torch_entry(
    bind=("tfl", "F"),
    records="op:linear_t",
    opinfo=("nn.functional.linear",),
    gaps={"int64[": _INT_MATMUL},
)
def linear(input: Operand, weight: Operand, bias: Operand | None = None) -> Tensor:
    """``input @ weight.T + bias`` with ``weight`` of shape ``(out_features, in_features)``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.ones((2, 3)))
    ...     tfl.linear(x, jnp.ones((4, 3)), jnp.ones(4)).tolist()[0]
    [4.0, 4.0, 4.0, 4.0]
    """
    if len(_shape(weight)) == 1:  # PyTorch's vector weight: one output, no output dimension
        y = apply("matmul", input, weight)
        return y if bias is None else apply("add", y, bias)
    return apply("linear_t", input, weight) if bias is None else apply("linear_t", input, weight, bias)


# --------------------------------------------------------------------------- convolution


def _conv_padding(
    op: str, padding: str | IntOrTuple, k: tuple[int, ...], st: tuple[int, ...], dl: tuple[int, ...]
) -> tuple[tuple[int, int], ...]:
    """PyTorch's ``padding`` (ints, ``"same"`` or ``"valid"``) as explicit ``(lo, hi)`` pairs per spatial dim."""
    n = len(k)
    if isinstance(padding, str):
        if padding == "valid":
            return ((0, 0),) * n
        if padding == "same":
            if builtins.max(st) != 1:
                raise ValueError(f'{op}: padding="same" is not supported for strided convolutions (stride={st})')
            # PyTorch puts the odd extra padding on the high side
            return tuple(((d * (kk - 1)) // 2, d * (kk - 1) - (d * (kk - 1)) // 2) for kk, d in zip(k, dl))
        raise ValueError(f'{op}: padding={padding!r} must be "same", "valid", an int or a sequence of {n} ints')
    return tuple((p, p) for p in _ints(op, "padding", padding, n, 0))


def _conv_weight_check(op: str, x: Operand, weight: Operand, spatial: int, groups: int) -> None:
    ws, xs = _shape(weight), _shape(x)
    if len(xs) not in (spatial + 1, spatial + 2):
        want = ", ".join(("C", "L") if spatial == 1 else ("C", "H", "W"))
        raise ValueError(f"{op}: input must have shape (N, {want}) or unbatched ({want}), got {xs}")
    if len(ws) != spatial + 2:
        raise ValueError(
            f"{op}: weight must have shape (out_channels, in_channels/groups, {', '.join('k' * spatial)}), got {ws}"
        )
    if not isinstance(groups, (int, np.integer)) or isinstance(groups, bool) or groups < 1:
        raise ValueError(f"{op}: groups={groups!r} must be a positive int")
    c = xs[1] if len(xs) == spatial + 2 else xs[0]
    if ws[1] * groups != c or ws[0] % groups:
        raise ValueError(
            f"{op}: input has {c} channels but weight {ws} with groups={groups} expects {ws[1] * groups} "
            f"(weight is (out_channels, in_channels/groups, ...) and groups must divide out_channels {ws[0]})"
        )


@torch_entry(bind=("F",), records="op:conv2d", opinfo=("nn.functional.conv1d",), gaps={"int64[": _INT_CONV})
def conv1d(
    input: Operand,
    weight: Operand,
    bias: Operand | None = None,
    stride: IntOrTuple = 1,
    padding: str | IntOrTuple = 0,
    dilation: IntOrTuple = 1,
    groups: int = 1,
) -> Tensor:
    """1-D convolution of ``input`` (N, C, L) or (C, L) with ``weight`` (out, C/groups, k), as a 2-D one of height 1.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> import tapeflow.nn.functional as F
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.ones((1, 2, 5)))
    ...     F.conv1d(x, jnp.ones((3, 2, 3)), stride=2).tolist()[0][0]
    [6.0, 6.0]
    """
    _conv_weight_check("conv1d", input, weight, 1, groups)
    _float_input("conv1d", input)
    (k,) = _shape(weight)[2:]
    st = _ints("conv1d", "stride", stride, 1, 1)
    dl = _ints("conv1d", "dilation", dilation, 1, 1)
    ((lo, hi),) = _conv_padding("conv1d", padding, (k,), st, dl)
    x, added = _batched("conv1d", input, 1)
    x4 = apply("expand_dims", x, axis=2)
    w4 = apply("expand_dims", weight, axis=2)
    attrs = {"stride": (1, st[0]), "padding": ((0, 0), (lo, hi)), "dilation": (1, dl[0]), "groups": int(groups)}
    y = apply("conv2d", x4, w4, **attrs) if bias is None else apply("conv2d", x4, w4, bias, **attrs)
    return _unbatched(apply("squeeze", y, axis=2), added)


@torch_entry(bind=("tfl", "F"), records="op:conv2d", opinfo=("nn.functional.conv2d",), gaps={"int64[": _INT_CONV})
def conv2d(
    input: Operand,
    weight: Operand,
    bias: Operand | None = None,
    stride: IntOrTuple = 1,
    padding: str | IntOrTuple = 0,
    dilation: IntOrTuple = 1,
    groups: int = 1,
) -> Tensor:
    """2-D convolution of ``input`` (N, C, H, W) or (C, H, W) with ``weight`` (out, C/groups, kh, kw).

    ``padding`` is an int, a pair, ``"same"`` (stride 1 only; an odd extra pad
    goes below and right, as PyTorch) or ``"valid"``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.ones((1, 4, 5, 5)))
    ...     tfl.conv2d(x, jnp.ones((6, 2, 3, 3)), groups=2, padding="same").shape
    (1, 6, 5, 5)
    """
    _conv_weight_check("conv2d", input, weight, 2, groups)
    _float_input("conv2d", input)
    k = _shape(weight)[2:]
    st = _ints("conv2d", "stride", stride, 2, 1)
    dl = _ints("conv2d", "dilation", dilation, 2, 1)
    pads = _conv_padding("conv2d", padding, k, st, dl)
    x, added = _batched("conv2d", input, 2)
    attrs = {"stride": st, "padding": pads, "dilation": dl, "groups": int(groups)}
    y = apply("conv2d", x, weight, **attrs) if bias is None else apply("conv2d", x, weight, bias, **attrs)
    return _unbatched(y, added)


def _dilate_pad(x: Array, *, config: tuple[tuple[int, int, int], ...]) -> Array:
    """``x`` spread by ``jax.lax.pad`` (zeros between entries, low/high pads, negative ones crop)."""
    return jax.lax.pad(x, jnp.zeros((), x.dtype), config)


def _transposed_weight(w: Array, *, groups: int) -> Array:
    """A ``conv_transpose`` weight (in, out/groups, kh, kw) as the flipped ``conv2d`` weight (out, in/groups, kh, kw)."""
    cin, og, kh, kw = w.shape
    w = (
        w.reshape(groups, cin // groups, og, kh, kw)
        .transpose(0, 2, 1, 3, 4)
        .reshape(groups * og, cin // groups, kh, kw)
    )
    return w[:, :, ::-1, ::-1]


# The transposed convolution is a stride-1 convolution of the input spread by the stride: both parts have
# VJPs that XLA's CPU compiler handles for every shape (jax.vjp of lhs_dilation convolutions does not).
_dilate_pad_op = lift(_dilate_pad, name="torch.nn.functional.conv_transpose2d.spread", static_argnames=("config",))
_transposed_weight_op = lift(
    _transposed_weight, name="torch.nn.functional.conv_transpose2d.weight", static_argnames=("groups",)
)


@torch_entry(bind=("F",), records="lifted", opinfo=("nn.functional.conv_transpose2d",), gaps={"int64[": _INT_CONV})
def conv_transpose2d(
    input: Operand,
    weight: Operand,
    bias: Operand | None = None,
    stride: IntOrTuple = 1,
    padding: IntOrTuple = 0,
    output_padding: IntOrTuple = 0,
    groups: int = 1,
    dilation: IntOrTuple = 1,
) -> Tensor:
    """Transposed 2-D convolution of ``input`` (N, C, H, W) with ``weight`` (C, out/groups, kh, kw).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> import tapeflow.nn.functional as F
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.ones((1, 2, 3, 3)))
    ...     w = jnp.ones((2, 4, 3, 3))
    ...     F.conv_transpose2d(x, w, stride=2, padding=1).shape
    (1, 4, 5, 5)
    """
    op = "conv_transpose2d"
    ws, xs = _shape(weight), _shape(input)
    if len(ws) != 4:
        raise ValueError(f"{op}: weight must have shape (in_channels, out_channels/groups, kh, kw), got {ws}")
    if not isinstance(groups, (int, np.integer)) or isinstance(groups, bool) or groups < 1:
        raise ValueError(f"{op}: groups={groups!r} must be a positive int")
    st = _ints(op, "stride", stride, 2, 1)
    dl = _ints(op, "dilation", dilation, 2, 1)
    pd = _ints(op, "padding", padding, 2, 0)
    op_ = _ints(op, "output_padding", output_padding, 2, 0)
    if any(o >= builtins.max(s, d) for o, s, d in zip(op_, st, dl)):
        raise ValueError(
            f"{op}: output_padding={op_} must be smaller than either stride {st} or dilation {dl} in each dimension"
        )
    c = xs[1] if len(xs) == 4 else xs[0] if len(xs) == 3 else -1
    if c != ws[0] or ws[0] % groups:
        raise ValueError(
            f"{op}: input {xs} has {c} channels but weight {ws} expects {ws[0]} "
            f"(weight is (in_channels, out_channels/groups, kh, kw); groups={groups} must divide in_channels)"
        )
    _float_input(op, input)
    x, added = _batched(op, input, 2)
    config = ((0, 0, 0), (0, 0, 0)) + tuple(
        (d * (k - 1) - p, d * (k - 1) - p + o, s - 1) for k, s, d, p, o in zip(ws[2:], st, dl, pd, op_)
    )
    spread = _dilate_pad_op(x, config=config)
    w = _transposed_weight_op(weight, groups=int(groups))
    attrs = {"stride": 1, "padding": 0, "dilation": dl, "groups": int(groups)}
    y = apply("conv2d", spread, w, **attrs) if bias is None else apply("conv2d", spread, w, bias, **attrs)
    return _unbatched(y, added)


# --------------------------------------------------------------------------- pooling


def _pool_args(
    op: str, n: int, kernel_size: IntOrTuple, stride: IntOrTuple | None, padding: IntOrTuple, dilation: IntOrTuple
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    k = _ints(op, "kernel_size", kernel_size, n, 1)
    st = (
        k if stride is None or (isinstance(stride, (list, tuple)) and not stride) else _ints(op, "stride", stride, n, 1)
    )
    pd = _ints(op, "padding", padding, n, 0)
    dl = _ints(op, "dilation", dilation, n, 1)
    if any(2 * p > kk for p, kk in zip(pd, k)):
        raise ValueError(f"{op}: padding={pd} should be at most half of the kernel size {k}")
    return k, st, pd, dl


def _pool_out(op: str, size: Shape, k: Shape, st: Shape, pd: Shape, dl: Shape, ceil_mode: bool) -> tuple[int, ...]:
    """PyTorch's pooled sizes (with ``ceil_mode``, a last window must start inside the input or its left pad)."""
    out = []
    for n, kk, s, p, d in zip(size, k, st, pd, dl):
        span = n + 2 * p - d * (kk - 1) - 1
        o = (-(-span // s) if ceil_mode else span // s) + 1
        if ceil_mode and (o - 1) * s >= n + p:
            o -= 1
        if o < 1:
            raise ValueError(
                f"{op}: the window (kernel_size={k}, dilation={dl}) does not fit the input of spatial size {size} "
                f"with padding {pd}: the output would be empty"
            )
        out.append(o)
    return tuple(out)


def _lowest(dtype: np.dtype) -> np.ndarray:
    """The padding no entry is below: ``-inf``, or an integer dtype's minimum (PyTorch max-pools integers too)."""
    if _isa(dtype, jnp.floating):
        return np.array(-np.inf, dtype)
    return np.array(jnp.iinfo(dtype).min, dtype)


def _max_pool(x: Array, *, window: Shape, strides: Shape, pads: tuple[tuple[int, int], ...], dilation: Shape) -> Array:
    init = _lowest(x.dtype)  # a concrete init value lets JAX differentiate the max window
    full = ((0, 0), (0, 0)) + pads
    if all(d == 1 for d in dilation):
        return jax.lax.reduce_window(x, init, jax.lax.max, (1, 1) + window, (1, 1) + strides, full)
    # JAX has no VJP for dilated max windows: gather each window's taps, and take the first maximum (PyTorch's)
    xp = jax.lax.pad(x, init, tuple((lo, hi, 0) for lo, hi in full))
    out = [(n - d * (k - 1) - 1) // s + 1 for n, k, s, d in zip(xp.shape[2:], window, strides, dilation)]
    taps = []
    for offs in np.ndindex(*window):
        start = (0, 0) + tuple(o * d for o, d in zip(offs, dilation))
        stop = xp.shape[:2] + tuple(b + (m - 1) * s + 1 for b, m, s in zip(start[2:], out, strides))
        taps.append(jax.lax.slice(xp, start, stop, (1, 1) + strides))
    stacked = jnp.stack(taps)
    first = jnp.argmax(stacked, axis=0)
    return jnp.take_along_axis(stacked, first[None], axis=0)[0]


def _max_pool_indices(
    x: Array, *, window: Shape, strides: Shape, pads: tuple[tuple[int, int], ...], dilation: Shape
) -> Array:
    """Where each window's (first) maximum sits, as an index into the flattened spatial dims of the unpadded input."""
    spatial = x.shape[2:]
    where = jnp.arange(math.prod(spatial), dtype=jnp.int32).reshape(spatial)
    full = tuple((lo, hi, 0) for lo, hi in pads)
    xp = jax.lax.pad(x, _lowest(x.dtype), ((0, 0, 0), (0, 0, 0)) + full)
    wp = jax.lax.pad(where, np.int32(-1), full)
    out = [(n - d * (k - 1) - 1) // s + 1 for n, k, s, d in zip(xp.shape[2:], window, strides, dilation)]
    values, places = [], []
    for offs in np.ndindex(*window):
        start = tuple(o * d for o, d in zip(offs, dilation))
        stop = tuple(b + (m - 1) * s + 1 for b, m, s in zip(start, out, strides))
        values.append(jax.lax.slice(xp, (0, 0) + start, xp.shape[:2] + stop, (1, 1) + strides))
        places.append(jax.lax.slice(wp, start, stop, strides))
    first = jnp.argmax(jnp.stack(values), axis=0)  # NaN counts as the maximum, as PyTorch's
    return jnp.take_along_axis(jnp.stack(places)[:, None, None], first[None], axis=0)[0]


def _avg_pool(
    x: Array,
    *,
    window: Shape,
    strides: Shape,
    pads: tuple[tuple[int, int], ...],
    divisor: int | None,
    include_pad: bool,
) -> Array:
    """Sums over windows, divided as PyTorch's ``avg_pool``: by ``divisor``, else by the window's count of entries.

    ``pads`` holds per spatial dim ``(padding, padding + ceil extra)``: the count includes the padding
    when ``include_pad``, but never the extra cells ``ceil_mode`` adds past the padded input.
    """
    zero = np.zeros((), x.dtype)
    full = ((0, 0), (0, 0)) + pads
    dims, strd = (1, 1) + window, (1, 1) + strides
    s = jax.lax.reduce_window(x, zero, jax.lax.add, dims, strd, full)
    if divisor is not None:
        return s / np.asarray(divisor, x.dtype)
    spatial = x.shape[2:]
    if include_pad:
        ones = np.ones(tuple(n + 2 * p for n, (p, _) in zip(spatial, pads)), x.dtype)
        cfg = tuple((0, hi - p, 0) for p, hi in pads)
    else:
        ones = np.ones(spatial, x.dtype)
        cfg = tuple((p, hi, 0) for p, hi in pads)
    counts = jax.lax.reduce_window(jax.lax.pad(ones, zero, cfg), zero, jax.lax.add, window, strides, "VALID")
    return s / counts


_max_pool_op = lift(
    _max_pool, name="torch.nn.functional.max_pool", static_argnames=("window", "strides", "pads", "dilation")
)
_max_pool_indices_op = lift(
    _max_pool_indices,
    name="torch.nn.functional.max_pool.indices",
    static_argnames=("window", "strides", "pads", "dilation"),
)
_avg_pool_op = lift(
    _avg_pool,
    name="torch.nn.functional.avg_pool",
    static_argnames=("window", "strides", "pads", "divisor", "include_pad"),
)


def _max_pool_nd(
    op: str,
    n: int,
    input: Operand,
    kernel_size: IntOrTuple,
    stride: IntOrTuple | None,
    padding: IntOrTuple,
    dilation: IntOrTuple,
    ceil_mode: bool,
    return_indices: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    k, st, pd, dl = _pool_args(op, n, kernel_size, stride, padding, dilation)
    x, added = _batched(op, input, n)
    if _dtype(x) == np.bool_:
        raise TapeError(f"{op}: input has dtype bool; cast it to a number first, e.g. with .float()")
    size = _shape(x)[2:]
    out = _pool_out(op, size, k, st, pd, dl, bool(ceil_mode))
    if n == 1:
        x = apply("expand_dims", x, axis=2)
        k, st, pd, dl, size, out = (1, *k), (1, *st), (0, *pd), (1, *dl), (1, *size), (1, *out)
    hi = tuple((o - 1) * s + d * (kk - 1) + 1 - m - p for o, s, d, kk, m, p in zip(out, st, dl, k, size, pd))
    plain = out == tuple((m + 2 * p - kk) // s + 1 for m, p, kk, s in zip(size, pd, k, st))
    if _is_float(x) and all(d == 1 for d in dl) and plain:  # the built-in op pools floats only
        y = apply("max_pool2d", x, kernel_size=k, stride=st, padding=pd)
    else:
        y = _max_pool_op(x, window=k, strides=st, pads=tuple(zip(pd, hi)), dilation=dl)
    if n == 1:
        y = apply("squeeze", y, axis=2)
    if not return_indices:
        return _unbatched(y, added)
    i = _max_pool_indices_op(x, window=k, strides=st, pads=tuple(zip(pd, hi)), dilation=dl)
    if n == 1:
        i = apply("squeeze", i, axis=2)
    return _unbatched(y, added), _unbatched(i, added)


@torch_entry(bind=("F",), records="op:max_pool2d", opinfo=("nn.functional.max_pool1d",))
def max_pool1d(
    input: Operand,
    kernel_size: IntOrTuple,
    stride: IntOrTuple | None = None,
    padding: IntOrTuple = 0,
    dilation: IntOrTuple = 1,
    ceil_mode: bool = False,
    return_indices: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Max over windows of ``input`` (N, C, L) or (C, L); ``stride`` defaults to ``kernel_size``.

    ``return_indices=True`` returns ``(values, indices)``: each maximum's index
    into the input's flattened spatial dims (int32; PyTorch's is int64).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> import tapeflow.nn.functional as F
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.arange(5.0).reshape(1, 1, 5))
    ...     F.max_pool1d(x, 2, ceil_mode=True).tolist()
    [[[1.0, 3.0, 4.0]]]
    """
    return _max_pool_nd("max_pool1d", 1, input, kernel_size, stride, padding, dilation, ceil_mode, return_indices)


@torch_entry(bind=("tfl", "F"), records="op:max_pool2d", opinfo=("nn.functional.max_pool2d",))
def max_pool2d(
    input: Operand,
    kernel_size: IntOrTuple,
    stride: IntOrTuple | None = None,
    padding: IntOrTuple = 0,
    dilation: IntOrTuple = 1,
    ceil_mode: bool = False,
    return_indices: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Max over windows of ``input`` (N, C, H, W) or (C, H, W); ``stride`` defaults to ``kernel_size``.

    ``return_indices=True`` returns ``(values, indices)``: each maximum's index
    into the input's flattened spatial dims (int32; PyTorch's is int64).

    Padding is ``-inf``. The built-in
    ``max_pool2d`` op records the plain cases, a lifted window reduction the
    ones with ``dilation`` or ``ceil_mode``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.arange(16.0).reshape(1, 1, 4, 4))
    ...     tfl.max_pool2d(x, 2).tolist()
    [[[[5.0, 7.0], [13.0, 15.0]]]]
    """
    return _max_pool_nd("max_pool2d", 2, input, kernel_size, stride, padding, dilation, ceil_mode, return_indices)


def _avg_pool_nd(
    op: str,
    n: int,
    input: Operand,
    kernel_size: IntOrTuple,
    stride: IntOrTuple | None,
    padding: IntOrTuple,
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
) -> Tensor:
    k, st, pd, _ = _pool_args(op, n, kernel_size, stride, padding, 1)
    if divisor_override is not None and (not isinstance(divisor_override, int) or divisor_override == 0):
        raise ValueError(f"{op}: divisor_override={divisor_override!r} must be None or a non-zero int")
    x, added = _batched(op, input, n)
    _float_input(op, x)
    size = _shape(x)[2:]
    out = _pool_out(op, size, k, st, pd, (1,) * n, bool(ceil_mode))
    if n == 1:
        x = apply("expand_dims", x, axis=2)
        k, st, pd, size, out = (1, *k), (1, *st), (0, *pd), (1, *size), (1, *out)
    floor = tuple((m + 2 * p - kk) // s + 1 for m, p, kk, s in zip(size, pd, k, st))
    if divisor_override is None and out == floor and (count_include_pad or not any(pd)):
        y = apply("avg_pool2d", x, kernel_size=k, stride=st, padding=pd)
    else:
        hi = tuple(builtins.max((o - 1) * s + kk - m - p, p) for o, s, kk, m, p in zip(out, st, k, size, pd))
        y = _avg_pool_op(
            x,
            window=k,
            strides=st,
            pads=tuple(zip(pd, hi)),
            divisor=divisor_override,
            include_pad=bool(count_include_pad),
        )
    if n == 1:
        y = apply("squeeze", y, axis=2)
    return _unbatched(y, added)


@torch_entry(bind=("F",), records="op:avg_pool2d", opinfo=("nn.functional.avg_pool1d",), gaps={"int64[": _INT_AVG})
def avg_pool1d(
    input: Operand,
    kernel_size: IntOrTuple,
    stride: IntOrTuple | None = None,
    padding: IntOrTuple = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
) -> Tensor:
    """Mean over windows of ``input`` (N, C, L) or (C, L); ``stride`` defaults to ``kernel_size``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> import tapeflow.nn.functional as F
    >>> with tfl.Session() as s:
    ...     F.avg_pool1d(s.input(jnp.arange(4.0).reshape(1, 1, 4)), 2).tolist()
    [[[0.5, 2.5]]]
    """
    return _avg_pool_nd("avg_pool1d", 1, input, kernel_size, stride, padding, ceil_mode, count_include_pad, None)


@torch_entry(
    bind=("tfl", "F"), records="op:avg_pool2d", opinfo=("nn.functional.avg_pool2d",), gaps={"int64[": _INT_AVG}
)
def avg_pool2d(
    input: Operand,
    kernel_size: IntOrTuple,
    stride: IntOrTuple | None = None,
    padding: IntOrTuple = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
) -> Tensor:
    """Mean over windows of ``input`` (N, C, H, W) or (C, H, W); ``stride`` defaults to ``kernel_size``.

    The divisor is ``divisor_override``, else the window's size counting the
    zero padding (``count_include_pad=True``) or only the input's entries.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.ones((1, 1, 3, 3)))
    ...     tfl.avg_pool2d(x, 2, padding=1, count_include_pad=False).tolist()
    [[[[1.0, 1.0], [1.0, 1.0]]]]
    """
    return _avg_pool_nd(
        "avg_pool2d", 2, input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
    )


def _adaptive_matrix(n: int, out: int) -> np.ndarray:
    """The (out, n) averaging matrix of PyTorch's adaptive pooling bins ``[floor(i n / out), ceil((i+1) n / out))``."""
    a = np.zeros((out, n), np.float32)
    for i in range(out):
        lo, hi = (i * n) // out, -(-((i + 1) * n) // out)
        a[i, lo:hi] = 1.0 / (hi - lo)
    return a


def _adaptive_sizes(op: str, output_size: int | Sequence[int | None] | None, size: Shape) -> tuple[int, ...]:
    n = len(size)
    given: list[int | None] = (
        list(output_size) if isinstance(output_size, (tuple, list)) else [cast("int | None", output_size)] * n
    )
    if len(given) != n:
        raise ValueError(f"{op}: output_size={output_size!r} must be an int or a sequence of {n}")
    out = tuple(m if o is None else int(o) for o, m in zip(given, size))
    if builtins.min(out) < 1:
        raise ValueError(f"{op}: output_size={output_size!r} must be positive")
    return out


@torch_entry(bind=("F",), records="ops:matmul", opinfo=("nn.functional.adaptive_avg_pool1d",))
def adaptive_avg_pool1d(input: Operand, output_size: int | Sequence[int]) -> Tensor:
    """Mean over ``output_size`` bins along the last dimension of ``input`` (N, C, L) or (C, L), as PyTorch's bins.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> import tapeflow.nn.functional as F
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.arange(5.0).reshape(1, 5))
    ...     F.adaptive_avg_pool1d(x, 2).tolist()
    [[1.0, 3.0]]
    """
    xs = _shape(input)
    if len(xs) not in (2, 3):
        raise ValueError(f"adaptive_avg_pool1d: input must be (N, C, L) or (C, L), got shape {xs}")
    _float_input("adaptive_avg_pool1d", input)
    (o,) = _adaptive_sizes("adaptive_avg_pool1d", output_size, xs[-1:])
    a = _adaptive_matrix(xs[-1], o).T.astype(_dtype(input))
    return apply("matmul", input, a)


@torch_entry(bind=("F",), records="ops:matmul", opinfo=("nn.functional.adaptive_avg_pool2d",))
def adaptive_avg_pool2d(input: Operand, output_size: int | Sequence[int | None] | None) -> Tensor:
    """Mean over an ``output_size`` grid of bins of ``input`` (N, C, H, W) or (C, H, W) (None keeps a size).

    Recorded as two matmuls with constant averaging matrices (the bins are separable).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> import tapeflow.nn.functional as F
    >>> with tfl.Session() as s:
    ...     F.adaptive_avg_pool2d(s.input(jnp.ones((2, 3, 5, 7))), 1).shape
    (2, 3, 1, 1)
    """
    xs = _shape(input)
    if len(xs) not in (3, 4):
        raise ValueError(f"adaptive_avg_pool2d: input must be (N, C, H, W) or (C, H, W), got shape {xs}")
    _float_input("adaptive_avg_pool2d", input)
    oh, ow = _adaptive_sizes("adaptive_avg_pool2d", output_size, xs[-2:])
    dt = _dtype(input)
    if (oh, ow) == (1, 1):  # global average pooling: one reduction
        return apply("mean", input, axis=(-2, -1), keepdims=True)
    if (oh, ow) == xs[-2:]:
        return apply("reshape", input, shape=xs)
    if ow == xs[-1]:
        return apply("matmul", _adaptive_matrix(xs[-2], oh).astype(dt), input)
    y = apply("matmul", input, _adaptive_matrix(xs[-1], ow).T.astype(dt))
    return y if oh == xs[-2] else apply("matmul", _adaptive_matrix(xs[-2], oh).astype(dt), y)


# --------------------------------------------------------------------------- embedding and normalization


@torch_entry(bind=("F",), records="ops:gather,where,stop_gradient", opinfo=("nn.functional.embedding",))
def embedding(
    input: Operand,
    weight: Operand,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> Tensor:
    """Rows of ``weight`` (num_embeddings, dim) at the integer ``input`` indices; ``padding_idx``'s row gets no gradient.

    ``max_norm`` (which rewrites rows of the weight in place in PyTorch) and
    ``scale_grad_by_freq`` are refused; ``sparse=True`` gives the same dense gradient.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> import tapeflow.nn.functional as F
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([[0, 2]]))
    ...     F.embedding(x, jnp.arange(6.0).reshape(3, 2)).tolist()
    [[[0.0, 1.0], [4.0, 5.0]]]
    """
    if max_norm is not None:
        raise NotImplementedError(
            "embedding: max_norm is not supported (PyTorch renormalizes the weight's rows in place); "
            "renormalize the weight yourself before the lookup, e.g. w / clamp(norm(w, dim=1), min=max_norm)"
        )
    if scale_grad_by_freq:
        raise NotImplementedError("embedding: scale_grad_by_freq=True is not supported; pass False")
    ws = _shape(weight)
    if len(ws) != 2:
        raise ValueError(f"embedding: weight must have shape (num_embeddings, embedding_dim), got {ws}")
    if not _isa(_dtype(input), jnp.integer):
        raise TypeError(f"embedding: input must hold integer indices, got dtype {_dtype(input)}")
    rows = apply("gather", weight, input)
    if padding_idx is None:
        return rows
    if not -ws[0] <= padding_idx < ws[0]:
        raise ValueError(f"embedding: padding_idx={padding_idx} must be within num_embeddings ({ws[0]})")
    pad = apply("expand_dims", apply("eq", input, padding_idx % ws[0]), axis=-1)
    return apply("where", pad, apply("stop_gradient", rows), rows)


def _standardize(x: Array, *, axes: tuple[int, ...], eps: float) -> Array:
    """``(x - mean) / sqrt(var + eps)`` over ``axes`` (biased variance), for any ``eps``: PyTorch takes a negative one."""
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + jnp.asarray(eps, x.dtype))


# the built-in layer_norm op refuses a negative eps; this one records the same formula for it
_standardize_op = lift(_standardize, name="torch.nn.functional.layer_norm.any_eps", static_argnames=("axes", "eps"))


def _normalized_axes(op: str, input: Operand, normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    ns = (int(normalized_shape),) if isinstance(normalized_shape, (int, np.integer)) else tuple(normalized_shape)
    xs = _shape(input)
    if not ns or len(ns) > len(xs) or xs[len(xs) - len(ns) :] != ns:
        raise ValueError(f"{op}: normalized_shape={list(ns)} must be the trailing dimensions of the input's shape {xs}")
    return tuple(range(-len(ns), 0))


@torch_entry(bind=("tfl", "F"), records="op:layer_norm", opinfo=("nn.functional.layer_norm",))
def layer_norm(
    input: Operand,
    normalized_shape: int | Sequence[int],
    weight: Operand | None = None,
    bias: Operand | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """Normalize over the trailing ``normalized_shape`` dims (biased variance), then ``* weight + bias``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([[1.0, 3.0]]))
    ...     [round(v, 4) for v in tfl.layer_norm(x, (2,)).tolist()[0]]
    [-1.0, 1.0]
    """
    axes = _normalized_axes("layer_norm", input, normalized_shape)
    axis = axes[0] if len(axes) == 1 else axes
    if float(eps) < 0:
        y = _standardize_op(input, axes=axes, eps=float(eps))
        y = y if weight is None else apply("mul", y, weight)
        return y if bias is None else apply("add", y, bias)
    if weight is None:
        y = apply("layer_norm", input, axis=axis, eps=float(eps))
        return y if bias is None else apply("add", y, bias)
    if bias is None:
        return apply("layer_norm", input, weight, axis=axis, eps=float(eps))
    return apply("layer_norm", input, weight, bias, axis=axis, eps=float(eps))


@torch_entry(bind=("F",), records="ops:reshape,layer_norm,mul,add", opinfo=("nn.functional.group_norm",))
def group_norm(
    input: Operand, num_groups: int, weight: Operand | None = None, bias: Operand | None = None, eps: float = 1e-5
) -> Tensor:
    """Normalize ``input`` (N, C, *) over each of ``num_groups`` channel groups, then per-channel ``* weight + bias``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> import tapeflow.nn.functional as F
    >>> with tfl.Session() as s:
    ...     F.group_norm(s.input(jnp.arange(8.0).reshape(1, 4, 2)), 2).shape
    (1, 4, 2)
    """
    xs = _shape(input)
    if len(xs) < 2 or not isinstance(num_groups, int) or num_groups < 1 or xs[1] % num_groups:
        raise ValueError(f"group_norm: input {xs} must be (N, C, *) with C divisible by num_groups={num_groups!r}")
    _float_input("group_norm", input)
    # the group size is spelled out: -1 is ambiguous for an empty batch
    y = apply("reshape", input, shape=(xs[0], num_groups, math.prod(xs[1:]) // num_groups))
    if float(eps) < 0:
        y = _standardize_op(y, axes=(-1,), eps=float(eps))
    else:
        y = apply("layer_norm", y, axis=-1, eps=float(eps))
    y = apply("reshape", y, shape=xs)
    per_channel = (xs[1],) + (1,) * (len(xs) - 2)
    if weight is not None:
        y = apply("mul", y, apply("reshape", weight, shape=per_channel))
    if bias is not None:
        y = apply("add", y, apply("reshape", bias, shape=per_channel))
    return y


@torch_entry(bind=("F",), records="ops:mul,mean,add,sqrt,div", opinfo=("nn.functional.rms_norm",))
def rms_norm(
    input: Operand, normalized_shape: int | Sequence[int], weight: Operand | None = None, eps: float | None = None
) -> Tensor:
    """``input / sqrt(mean(input**2) + eps) * weight`` over the trailing ``normalized_shape`` dims.

    ``eps`` defaults to the input dtype's machine epsilon, as PyTorch.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> import tapeflow.nn.functional as F
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([[3.0, 4.0]]))
    ...     [round(v, 4) for v in F.rms_norm(x, [2]).tolist()[0]]
    [0.8485, 1.1314]
    """
    axes = _normalized_axes("rms_norm", input, normalized_shape)
    _float_input("rms_norm", input)
    e = float(jnp.finfo(_dtype(input)).eps) if eps is None else float(eps)
    ms = apply("mean", apply("mul", input, input), axis=axes, keepdims=True)
    y = apply("div", input, apply("sqrt", apply("add", ms, e)))
    return y if weight is None else apply("mul", y, weight)


# --------------------------------------------------------------------------- dropout and attention


@torch_entry(bind=("tfl", "F"), records="ops:where,mul", opinfo=("nn.functional.dropout",))
def dropout(input: Operand, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    """Zero each entry with probability ``p`` and scale the rest by ``1 / (1 - p)``; the identity unless ``training``.

    The mask is drawn from the session's seeded RNG (one counter step per call).
    As PyTorch, ``training`` defaults to True: pass ``training=False`` (or use
    :class:`tfl.nn.Dropout`, which follows the module's mode) at evaluation.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session(seed=0) as s:
    ...     x = s.input(jnp.ones(4))
    ...     kept = tfl.dropout(x, 0.5, training=False).tolist()
    ...     kept, sorted(set(tfl.dropout(x).tolist())) <= [0.0, 2.0]
    ([1.0, 1.0, 1.0, 1.0], True)
    """
    if isinstance(p, bool) or not isinstance(p, (int, float, np.floating)) or not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"dropout: probability has to be between 0 and 1, but got p={p!r}")
    if not training:  # the input itself, as PyTorch (a Param or an array: recorded, keeping its gradient)
        return input if isinstance(input, Tensor) else apply("reshape", input, shape=_shape(input))
    if float(p) == 1.0:
        _float_input("dropout", input)
        return apply("mul", input, 0.0)  # PyTorch's p=1: every entry dropped (NaN stays NaN, as input * 0)
    # _functions.dropout is the one home of the mask draw; it takes any operand, as every op function does
    return _functions.dropout(cast(Tensor, input), float(p), training=True)


def _float_mask_attention(
    q: Array, k: Array, v: Array, mask: Array, keep: Array = None, *, scale: float, dropout: float
) -> Array:
    s = (q @ jnp.swapaxes(k, -1, -2)) * jnp.asarray(scale, q.dtype) + mask
    top = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    e = jnp.exp(s - jnp.where(jnp.isfinite(top), top, jnp.zeros((), s.dtype)))
    den = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(den > 0, den, jnp.ones((), s.dtype))  # a row masked everywhere (-inf) attends to nothing
    if keep is not None:
        p = jnp.where(keep, p / jnp.asarray(1.0 - dropout, p.dtype), jnp.zeros((), p.dtype))
    return p @ v


_float_mask_attention_op = lift(
    _float_mask_attention,
    name="torch.nn.functional.scaled_dot_product_attention.additive",
    static_argnames=("scale", "dropout"),
)


@torch_entry(bind=("tfl", "F"), records="op:attention", opinfo=("nn.functional.scaled_dot_product_attention",))
def scaled_dot_product_attention(
    query: Operand,
    key: Operand,
    value: Operand,
    attn_mask: Operand | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``softmax(query @ key^T * scale + mask) @ value``, with PyTorch's masks, causal flag and dropout.

    ``attn_mask`` is boolean (True = attend) or a float mask added to the
    scores; ``is_causal`` keeps key ``j`` for query ``i`` when ``j <= i``.
    ``dropout_p`` drops attention weights whenever it is non-zero (PyTorch's
    function has no training flag). A query row that attends to no key gives
    zeros, as PyTorch's. ``enable_gqa`` repeats the key/value heads to match the query's.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     q = s.input(jnp.ones((1, 2, 3, 4)))
    ...     tfl.scaled_dot_product_attention(q, q, q, is_causal=True).shape
    (1, 2, 3, 4)
    """
    op = "scaled_dot_product_attention"
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"{op}: dropout_p={dropout_p!r} must be in [0, 1)")
    if is_causal and attn_mask is not None:
        raise ValueError(f"{op}: pass attn_mask or is_causal=True, not both (fold the causal mask into attn_mask)")
    qs, ks, vs = _shape(query), _shape(key), _shape(value)
    if enable_gqa and len(qs) >= 3 and ks[-3] != qs[-3]:
        if qs[-3] % ks[-3] or ks[-3] != vs[-3]:
            raise ValueError(
                f"{op}: enable_gqa needs the query heads ({qs[-3]}) to be a multiple of the key/value heads "
                f"({ks[-3]}, {vs[-3]})"
            )
        rep = np.repeat(np.arange(ks[-3]), qs[-3] // ks[-3]).astype(np.int32)
        key = apply("take", key, rep, axis=len(ks) - 3)
        value = apply("take", value, rep, axis=len(vs) - 3)
    if attn_mask is None or _dtype(attn_mask) == np.dtype(bool):
        return _functions.attention(
            query, key, value, attn_mask, scale, bool(is_causal), dropout=float(dropout_p), training=True
        )
    for name, x in (("query", query), ("key", key), ("value", value), ("attn_mask", attn_mask)):
        _float_input(op, x, name)
    sc = 1.0 / math.sqrt(qs[-1]) if scale is None else float(scale)
    if not dropout_p:
        return _float_mask_attention_op(query, key, value, attn_mask, scale=sc, dropout=0.0)
    s = session_of((query, key, value, attn_mask), op)
    batch = np.broadcast_shapes(qs[:-2], _shape(key)[:-2], _shape(attn_mask)[:-2])
    keep = s.bernoulli_mask(batch + (qs[-2], _shape(key)[-2]), 1.0 - float(dropout_p))
    return _float_mask_attention_op(query, key, value, attn_mask, keep, scale=sc, dropout=float(dropout_p))


# --------------------------------------------------------------------------- activations


@torch_entry(bind=("method", "tfl", "F"), records="op:relu", opinfo=("nn.functional.relu",))
def relu(input: Operand, inplace: bool = False) -> Tensor:
    """``max(input, 0)`` elementwise (``inplace`` is accepted and ignored: tensors are values).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.relu(s.input(jnp.array([-1.0, 2.0]))).tolist()
    [0.0, 2.0]
    """
    if type(input) is Tensor and _isa(input.dtype, jnp.floating):  # the common call, the op as it is
        return record_op("relu", (input,), {})
    dt = _dtype(input)
    if _isa(dt, jnp.integer) or dt == np.bool_:  # PyTorch clamps integers too; they carry no gradient
        return apply("maximum", input, np.zeros((), dt))
    return apply("relu", input)


@torch_entry(bind=("tfl", "F"), records="op:gelu", opinfo=("nn.functional.gelu",))
def gelu(input: Operand, approximate: str = "none") -> Tensor:
    """GELU: ``input * Phi(input)`` (``approximate="none"``) or its tanh approximation (``"tanh"``).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     round(float(tfl.gelu(s.input(jnp.array(1.0)))), 4)
    0.8413
    """
    if approximate not in ("none", "tanh"):
        raise ValueError(f'gelu: approximate={approximate!r} must be "none" or "tanh"')
    return apply("gelu", input, approximate=approximate)


@torch_entry(bind=("F",), records="ops:sigmoid,mul", opinfo=("nn.functional.silu",))
def silu(input: Operand, inplace: bool = False) -> Tensor:
    """``input * sigmoid(input)`` elementwise (``inplace`` is accepted and ignored).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> import tapeflow.nn.functional as F
    >>> with tfl.Session() as s:
    ...     round(float(F.silu(s.input(jnp.array(1.0)))), 4)
    0.7311
    """
    return apply("mul", input, apply("sigmoid", input))


def _elu(x: Array, *, alpha: float) -> Array:
    neg = jnp.where(x > 0, jnp.zeros((), x.dtype), x)  # expm1 only sees non-positive values: no inf in the gradient
    return jnp.where(x > 0, x, jnp.asarray(alpha, x.dtype) * jnp.expm1(neg))


def _leaky_relu(x: Array, *, negative_slope: float) -> Array:
    # PyTorch's slope at 0 is the negative one (x > 0 picks the identity)
    return jnp.where(x > 0, x, x * jnp.asarray(negative_slope, x.dtype))


def _softplus(x: Array, *, beta: float, threshold: float) -> Array:
    bx = x * jnp.asarray(beta, x.dtype)
    over = bx > threshold
    soft = jnp.log1p(jnp.exp(jnp.where(over, jnp.zeros((), x.dtype), bx))) / jnp.asarray(beta, x.dtype)
    return jnp.where(over, x, soft)


_elu_op = lift(_elu, name="torch.nn.functional.elu", static_argnames=("alpha",))
_leaky_relu_op = lift(_leaky_relu, name="torch.nn.functional.leaky_relu", static_argnames=("negative_slope",))
_softplus_op = lift(_softplus, name="torch.nn.functional.softplus", static_argnames=("beta", "threshold"))


@torch_entry(bind=("F",), records="lifted", opinfo=("nn.functional.elu",))
def elu(input: Operand, alpha: float = 1.0, inplace: bool = False) -> Tensor:
    """``input`` where positive, else ``alpha * (exp(input) - 1)``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> import tapeflow.nn.functional as F
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([-1.0, 2.0]))
    ...     [round(v, 4) for v in F.elu(x).tolist()]
    [-0.6321, 2.0]
    """
    _float_input("elu", input)
    return _elu_op(input, alpha=float(alpha))


@torch_entry(bind=("F",), records="lifted", opinfo=("nn.functional.leaky_relu",))
def leaky_relu(input: Operand, negative_slope: float = 0.01, inplace: bool = False) -> Tensor:
    """``input`` where positive, else ``negative_slope * input``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> import tapeflow.nn.functional as F
    >>> with tfl.Session() as s:
    ...     F.leaky_relu(s.input(jnp.array([-2.0, 2.0])), 0.5).tolist()
    [-1.0, 2.0]
    """
    _float_input("leaky_relu", input)
    return _leaky_relu_op(input, negative_slope=float(negative_slope))


@torch_entry(bind=("tfl", "F"), records="op:softplus", opinfo=("nn.functional.softplus",))
def softplus(input: Operand, beta: float = 1.0, threshold: float = 20.0) -> Tensor:
    """``log(1 + exp(beta * input)) / beta``, and ``input`` itself where ``beta * input > threshold``.

    The defaults record the built-in ``softplus`` op (identical in float32 past the threshold).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     round(float(tfl.softplus(s.input(jnp.array(0.0)))), 4)
    0.6931
    """
    if beta == 1.0 and threshold == 20.0 and _dtype(input) == np.dtype(np.float32):
        return apply("softplus", input)
    _float_input("softplus", input)
    return _softplus_op(input, beta=float(beta), threshold=float(threshold))


@torch_entry(bind=("F",), records="ops:expand_dims,eq,astype", opinfo=("nn.functional.one_hot",))
def one_hot(tensor: Operand, num_classes: int = -1) -> Tensor:
    """Integer class indices as one-hot rows of ``num_classes`` entries (int32, PyTorch's int64).

    ``num_classes=-1`` reads the values (one more than the largest), so it is
    refused inside a compiled step; indices are checked to lie in
    ``[0, num_classes)`` whenever their values exist.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> import tapeflow.nn.functional as F
    >>> with tfl.Session() as s:
    ...     F.one_hot(s.input(jnp.array([0, 2]))).tolist()
    [[1, 0, 0], [0, 0, 1]]
    """
    if not _isa(_dtype(tensor), jnp.integer):
        raise TypeError(f"one_hot: tensor must hold integer class indices, got dtype {_dtype(tensor)}")
    if not isinstance(num_classes, (int, np.integer)) or num_classes < -1:
        raise ValueError(f"one_hot: num_classes={num_classes!r} must be -1 (inferred) or a non-negative int")
    v = tensor.value if isinstance(tensor, Tensor) else np.asarray(tensor)
    if isinstance(v, jax.core.Tracer):
        if num_classes == -1:
            raise TapeError(
                "one_hot: num_classes=-1 reads the values, which do not exist inside a compiled step; "
                "pass num_classes explicitly"
            )
    else:
        host = np.asarray(v)
        if num_classes == -1:
            if host.size == 0:
                raise ValueError("one_hot: cannot infer num_classes from an empty tensor; pass num_classes")
            num_classes = int(host.max()) + 1
        if host.size and (host.min() < 0 or host.max() >= num_classes):
            raise ValueError(
                f"one_hot: class values must lie in [0, num_classes={num_classes}), got values in "
                f"[{host.min()}, {host.max()}]"
            )
    classes = np.arange(int(num_classes), dtype=_dtype(tensor))
    return apply("astype", apply("eq", apply("expand_dims", tensor, axis=-1), classes), dtype=np.dtype(np.int32))


def _pnorm(x: Array, p: float, axis: int) -> Array:
    """The ``p``-norm over ``axis`` (keepdims) whose gradient at a zero vector is 0, as PyTorch's."""
    a = jnp.abs(x)
    if p == math.inf:
        return jnp.max(a, axis=axis, keepdims=True)
    if p == 0:
        return jnp.sum((x != 0).astype(x.dtype), axis=axis, keepdims=True)
    if p == 1:
        return jnp.sum(a, axis=axis, keepdims=True)
    s = jnp.sum(a**p if p != 2 else x * x, axis=axis, keepdims=True)
    pos = s > 0
    return jnp.where(pos, jnp.where(pos, s, jnp.ones((), s.dtype)) ** (1.0 / p), jnp.zeros((), s.dtype))


def _normalize(x: Array, *, p: float, dim: int, eps: float) -> Array:
    return x / jnp.maximum(_pnorm(x, p, dim), jnp.asarray(eps, x.dtype))


def _cosine_similarity(x1: Array, x2: Array, *, dim: int, eps: float) -> Array:
    x1, x2 = jnp.broadcast_arrays(x1, x2)
    e = jnp.asarray(eps, x1.dtype)
    n1, n2 = _pnorm(x1, 2.0, dim), _pnorm(x2, 2.0, dim)
    # PyTorch clamps the norms' values without touching their gradients
    n1 = n1 + jax.lax.stop_gradient(jnp.maximum(n1, e) - n1)
    n2 = n2 + jax.lax.stop_gradient(jnp.maximum(n2, e) - n2)
    return jnp.sum((x1 / n1) * (x2 / n2), axis=dim)


_normalize_op = lift(_normalize, name="torch.nn.functional.normalize", static_argnames=("p", "dim", "eps"))
_cosine_similarity_op = lift(
    _cosine_similarity, name="torch.nn.functional.cosine_similarity", static_argnames=("dim", "eps")
)


def _axis(op: str, dim: int, ndim: int) -> int:
    n = builtins.max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"{op}: dim={dim} is out of range for a tensor with {ndim} dimensions")
    return dim % n


@torch_entry(bind=("F",), records="lifted", opinfo=("nn.functional.normalize",))
def normalize(input: Operand, p: float = 2.0, dim: int = 1, eps: float = 1e-12, out: Operand | None = None) -> Tensor:
    """``input / max(norm_p(input, dim), eps)``: unit ``p``-norm vectors along ``dim``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> import tapeflow.nn.functional as F
    >>> with tfl.Session() as s:
    ...     F.normalize(s.input(jnp.array([[3.0, 4.0]]))).tolist()
    [[0.6000000238418579, 0.800000011920929]]
    """
    if out is not None:
        raise TypeError("normalize: out= is not supported (tensors are values); use the returned tensor")
    _float_input("normalize", input)
    d = _axis("normalize", dim, len(_shape(input)))
    if not _shape(input):  # PyTorch reads a 0-d input as one vector of one entry
        y = _normalize_op(apply("reshape", input, shape=(1,)), p=float(p), dim=0, eps=float(eps))
        return apply("reshape", y, shape=())
    return _normalize_op(input, p=float(p), dim=d, eps=float(eps))


@torch_entry(bind=("F",), records="lifted", opinfo=("nn.functional.cosine_similarity",))
def cosine_similarity(x1: Operand, x2: Operand, dim: int = 1, eps: float = 1e-8) -> Tensor:
    """Cosine of the angle between ``x1`` and ``x2`` along ``dim`` (broadcast), norms clamped to ``eps``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> import tapeflow.nn.functional as F
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([[1.0, 0.0]]))
    ...     F.cosine_similarity(x, jnp.array([[1.0, 1.0]])).tolist()
    [0.7071067690849304]
    """
    _float_input("cosine_similarity", x1, "x1")
    _float_input("cosine_similarity", x2, "x2")
    shape = np.broadcast_shapes(_shape(x1), _shape(x2))
    d = _axis("cosine_similarity", dim, len(shape))
    if not shape:  # PyTorch reads 0-d inputs as vectors of one entry
        one = [apply("reshape", x, shape=(1,)) for x in (x1, x2)]
        return apply("reshape", _cosine_similarity_op(*one, dim=0, eps=float(eps)), shape=())
    return _cosine_similarity_op(x1, x2, dim=d, eps=float(eps))


def _pad(x: Array, *, widths: tuple[tuple[int, int], ...], mode: str, value: float) -> Array:
    if mode == "circular":  # PyTorch crops by the negative pads first, then wraps the cropped dim
        for ax, ((lo, hi), m) in enumerate(zip(widths, x.shape)):
            start, stop = builtins.max(-lo, 0), m - builtins.max(-hi, 0)
            lo, hi = builtins.max(lo, 0), builtins.max(hi, 0)
            if (start, stop, lo, hi) != (0, m, 0, 0):
                x = jnp.take(x, start + (np.arange(stop - start + lo + hi) - lo) % (stop - start), axis=ax)
        return x
    if mode == "constant":
        return jax.lax.pad(x, jnp.asarray(value, x.dtype), tuple((lo, hi, 0) for lo, hi in widths))
    return jnp.pad(x, widths, mode={"reflect": "reflect", "replicate": "edge", "circular": "wrap"}[mode])


_pad_op = lift(_pad, name="torch.nn.functional.pad", static_argnames=("widths", "mode", "value"))


@torch_entry(
    bind=("F",),
    records="lifted",
    opinfo=(
        "nn.functional.pad.constant",
        "nn.functional.pad.reflect",
        "nn.functional.pad.replicate",
        "nn.functional.pad.circular",
    ),
)
def pad(input: Operand, pad: Sequence[int], mode: str = "constant", value: float | None = None) -> Tensor:
    """Pad the last ``len(pad) // 2`` dims: ``pad`` is ``(left, right)`` of the last dim, then of the one before, ...

    ``mode`` is ``"constant"`` (``value``, default 0; negative pads crop),
    ``"reflect"``, ``"replicate"`` or ``"circular"``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> import tapeflow.nn.functional as F
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([[1.0, 2.0, 3.0]]))
    ...     F.pad(x, (2, 1), mode="reflect").tolist()
    [[3.0, 2.0, 1.0, 2.0, 3.0, 2.0]]
    """
    xs = _shape(input)
    pads = list(pad)
    if len(pads) % 2 or len(pads) // 2 > len(xs) or not all(isinstance(p, (int, np.integer)) for p in pads):
        raise ValueError(
            f"pad: pad={tuple(pad)} must be an even number of ints, at most 2 per dimension of the input {xs}"
        )
    n = len(pads) // 2
    widths = [(0, 0)] * (len(xs) - n) + [(int(pads[2 * i]), int(pads[2 * i + 1])) for i in reversed(range(n))]
    if mode == "constant":
        for (lo, hi), m in zip(widths, xs):
            if m + lo + hi < 0:
                raise ValueError(f"pad: pad={tuple(pad)} crops more than the input {xs} holds")
        return _pad_op(input, widths=tuple(widths), mode=mode, value=0.0 if value is None else float(value))
    if mode not in ("reflect", "replicate", "circular"):
        raise NotImplementedError(
            f'pad: mode={mode!r} is not supported; use "constant", "reflect", "replicate" or "circular"'
        )
    if value is not None:
        raise ValueError(f'pad: mode "{mode}" does not take a value argument')
    if len(xs) not in (n + 1, n + 2) or n > 3:
        raise NotImplementedError(
            f'pad: mode "{mode}" pads the last 1 to 3 dims of a batched or unbatched input; '
            f"pad={tuple(pad)} does not fit an input of shape {xs}"
        )
    for (lo, hi), m in zip(widths[len(xs) - n :], xs[len(xs) - n :]):
        if (lo < 0 or hi < 0) and mode != "circular":
            raise NotImplementedError(f'pad: mode "{mode}" with negative pads is not supported; crop by indexing')
        if m + lo + hi < 1:
            raise ValueError(f"pad: pad={tuple(pad)} crops more than the input {xs} holds")
        limit = m - 1 if mode == "reflect" else m if mode == "circular" else None
        if limit is not None and builtins.max(lo, hi) > limit:
            raise ValueError(
                f'pad: mode "{mode}" pads {(lo, hi)} on a dimension of size {m}: each pad must be at most {limit}'
            )
    return _pad_op(input, widths=tuple(widths), mode=mode, value=0.0)


def _interp_axis(
    n: int, out: int, scale_factor: float | None, mode: str, align_corners: bool
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[float, ...]]:
    """Per output index of one axis: the two source indices and the weight of the second, as PyTorch computes them."""
    dst = np.arange(out, dtype=np.float32)
    if mode in ("nearest", "nearest-exact"):
        scale = np.float32(1.0 / scale_factor) if scale_factor else np.float32(n) / np.float32(out)
        shift = np.float32(0.5) if mode == "nearest-exact" else np.float32(0.0)
        i0 = np.minimum(np.floor((dst + shift) * scale).astype(np.int64), n - 1)
        return tuple(i0.tolist()), tuple(i0.tolist()), (0.0,) * out
    if align_corners:
        scale = np.float32((n - 1) / (out - 1)) if out > 1 else np.float32(0.0)
        src = dst * scale
    else:
        scale = np.float32(1.0 / scale_factor) if scale_factor else np.float32(n) / np.float32(out)
        src = np.maximum(scale * (dst + np.float32(0.5)) - np.float32(0.5), np.float32(0.0))
    i0 = np.minimum(np.floor(src).astype(np.int64), n - 1)
    i1 = np.minimum(i0 + 1, n - 1)
    lam = (src - i0.astype(np.float32)).astype(np.float32)
    return tuple(i0.tolist()), tuple(i1.tolist()), tuple(float(v) for v in lam)


def _interpolate(
    x: Array, *, axes: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[float, ...]], ...], linear: bool
) -> Array:
    # the last spatial axis first, as PyTorch's separable kernels
    for k in reversed(range(len(axes))):
        i0, i1, lam = axes[k]
        ax = x.ndim - len(axes) + k
        a = jnp.take(x, np.asarray(i0, np.int32), axis=ax)
        if linear:
            shape = [1] * x.ndim
            shape[ax] = len(lam)
            l1 = np.asarray(lam, np.float32).reshape(shape).astype(x.dtype)
            b = jnp.take(x, np.asarray(i1, np.int32), axis=ax)
            a = a * (1 - l1) + b * l1
        x = a
    return x


_interpolate_op = lift(_interpolate, name="torch.nn.functional.interpolate", static_argnames=("axes", "linear"))


@torch_entry(
    bind=("F",),
    records="lifted",
    opinfo=(
        "nn.functional.interpolate.nearest",
        "nn.functional.interpolate.bilinear",
        "nn.functional.interpolate.linear",
        "nn.functional.interpolate.trilinear",
    ),
)
def interpolate(
    input: Operand,
    size: int | Sequence[int] | None = None,
    scale_factor: float | Sequence[float] | None = None,
    mode: str = "nearest",
    align_corners: bool | None = None,
    recompute_scale_factor: bool | None = None,
    antialias: bool = False,
) -> Tensor:
    """Resize ``input`` (N, C, L), (N, C, H, W) or (N, C, D, H, W) to ``size``, or by ``scale_factor``, as PyTorch.

    ``mode`` is ``"nearest"``, ``"nearest-exact"``, ``"linear"`` (3-D),
    ``"bilinear"`` (4-D), ``"trilinear"`` (5-D) or ``"area"`` (adaptive average
    pooling, 3-D and 4-D inputs).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> import tapeflow.nn.functional as F
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([[[0.0, 1.0]]]))
    ...     F.interpolate(x, scale_factor=2, mode="linear").tolist()
    [[[0.0, 0.25, 0.75, 1.0]]]
    """
    op = "interpolate"
    xs = _shape(input)
    spatial = len(xs) - 2
    if spatial not in (1, 2, 3):
        raise NotImplementedError(f"{op}: input must be (N, C, L), (N, C, H, W) or (N, C, D, H, W), got shape {xs}")
    if antialias:
        raise NotImplementedError(f"{op}: antialias=True is not supported")
    linear_modes = {"linear": 1, "bilinear": 2, "trilinear": 3}
    if mode not in ("nearest", "nearest-exact", "area") and mode not in linear_modes:
        raise NotImplementedError(
            f"{op}: mode={mode!r} is not supported; "
            'use "nearest", "nearest-exact", "linear", "bilinear", "trilinear" or "area"'
        )
    if mode == "area" and spatial == 3:
        raise NotImplementedError(f'{op}: mode "area" on a 5-D input {xs} is not supported (no adaptive_avg_pool3d)')
    if mode in linear_modes and linear_modes[mode] != spatial:
        raise ValueError(f'{op}: mode "{mode}" needs a {linear_modes[mode] + 2}-D input, got shape {xs}')
    if align_corners is not None and mode not in linear_modes:
        raise ValueError(f"{op}: align_corners only applies to the linear modes, not {mode!r}")
    if (size is None) == (scale_factor is None):
        raise ValueError(f"{op}: pass exactly one of size and scale_factor")
    _float_input(op, input)
    scales: tuple[float | None, ...]
    if size is not None:
        out = _ints(op, "size", size, spatial, 1)
        scales = (None,) * spatial
    else:
        given = list(scale_factor) if isinstance(scale_factor, (tuple, list)) else [scale_factor] * spatial
        if len(given) != spatial or not all(isinstance(f, (int, float)) and f > 0 for f in given):
            raise ValueError(f"{op}: scale_factor={scale_factor!r} must be a positive number or {spatial} of them")
        sf = [float(cast(float, f)) for f in given]
        out = tuple(math.floor(m * f) for m, f in zip(xs[2:], sf))
        scales = (None,) * spatial if recompute_scale_factor else tuple(sf)
    if mode == "area":
        return (adaptive_avg_pool1d if spatial == 1 else adaptive_avg_pool2d)(input, out)
    axes = tuple(_interp_axis(m, o, f, mode, bool(align_corners)) for m, o, f in zip(xs[2:], out, scales))
    return _interpolate_op(input, axes=axes, linear=mode in linear_modes)


# --------------------------------------------------------------------------- losses


def _reduction(op: str, size_average: bool | None, reduce: bool | None, reduction: str) -> str:
    """PyTorch's reduction, from the deprecated ``size_average`` / ``reduce`` flags when either is given."""
    if size_average is not None or reduce is not None:
        if reduce is False:
            return "none"
        return "sum" if size_average is False else "mean"
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f'{op}: reduction={reduction!r} must be "mean", "sum" or "none"')
    return reduction


def _reduced(loss: Array, reduction: str) -> Array:
    if reduction == "mean":
        return jnp.mean(loss)
    return jnp.sum(loss) if reduction == "sum" else loss


def _class_dim(x: Array) -> int:
    return 1 if x.ndim >= 2 else 0


def _nll(
    logp: Array, target: Array, weight: Array = None, *, ignore_index: int, reduction: str, smoothing: float
) -> Array:
    """PyTorch's ``nll_loss`` of log-probabilities (classes on dim 1), plus ``cross_entropy``'s label smoothing.

    A target outside ``[0, C)`` that is not ``ignore_index`` gives a NaN loss for its entry.
    """
    cd = _class_dim(logp)
    c = logp.shape[cd]
    lp = jnp.moveaxis(logp, cd, -1)
    keep = target != ignore_index
    valid = ((target >= 0) & (target < c)) | ~keep
    safe = jnp.where(keep & valid, target, 0)
    picked = jnp.take_along_axis(lp, safe[..., None], axis=-1)[..., 0]
    zero = jnp.zeros((), logp.dtype)
    w = jnp.ones((), logp.dtype) if weight is None else jax.lax.stop_gradient(weight)[safe]
    w = jnp.where(keep, w, zero)
    loss = jnp.where(valid, -picked * w, jnp.asarray(jnp.nan, logp.dtype))
    total = jnp.sum(w) if weight is not None else jnp.sum(keep).astype(logp.dtype)
    out = jnp.sum(loss) / total if reduction == "mean" else _reduced(loss, reduction)
    if not smoothing:
        return out
    per_class = lp if weight is None else lp * jax.lax.stop_gradient(weight)
    smooth = jnp.where(keep, -jnp.sum(per_class, axis=-1), zero)
    smooth = jnp.sum(smooth) / total if reduction == "mean" else _reduced(smooth, reduction)
    return (1 - smoothing) * out + smooth * (smoothing / c)


def _soft_ce(x: Array, target: Array, weight: Array = None, *, reduction: str, smoothing: float) -> Array:
    """PyTorch's ``cross_entropy`` against class probabilities (same shape as ``x``, classes on dim 1)."""
    cd = _class_dim(x)
    c = x.shape[cd]
    lp = jax.nn.log_softmax(x, axis=cd)
    t = target * (1 - smoothing) + smoothing / c if smoothing else target
    if weight is not None:
        lp = lp * weight.reshape((c,) + (1,) * (x.ndim - cd - 1))
    loss = -jnp.sum(lp * t, axis=cd)
    if reduction == "mean":
        return jnp.sum(loss) / jnp.asarray(x.size // c if c else 0, x.dtype)
    return _reduced(loss, reduction)


_nll_op = lift(_nll, name="torch.nn.functional.nll_loss", static_argnames=("ignore_index", "reduction", "smoothing"))
_soft_ce_op = lift(
    _soft_ce, name="torch.nn.functional.cross_entropy.probabilities", static_argnames=("reduction", "smoothing")
)


def _class_target_check(op: str, input: Operand, target: Operand, weight: Operand | None) -> int:
    """The number of classes, after checking PyTorch's shapes: input (N, C, d...) or (C,), target (N, d...) or ()."""
    xs, ts = _shape(input), _shape(target)
    if not xs:
        raise ValueError(f"{op}: input must have a class dimension: (C,), (N, C) or (N, C, d1, ...), got shape ()")
    cd = 1 if len(xs) >= 2 else 0
    if ts != xs[:cd] + xs[cd + 1 :]:
        raise ValueError(
            f"{op}: target of shape {ts} does not match input {xs}: class indices need input.shape without "
            f"dim {cd} ({xs[:cd] + xs[cd + 1 :]})"
        )
    if weight is not None and _shape(weight) != (xs[cd],):
        raise ValueError(f"{op}: weight must have shape ({xs[cd]},) (one per class), got {_shape(weight)}")
    _float_input(op, input)
    return xs[cd]


@torch_entry(bind=("F",), records="lifted", opinfo=("nn.functional.nll_loss",))
def nll_loss(
    input: Operand,
    target: Operand,
    weight: Operand | None = None,
    size_average: bool | None = None,
    ignore_index: int = -100,
    reduce: bool | None = None,
    reduction: str = "mean",
) -> Tensor:
    """Negative log-likelihood of log-probabilities ``input`` (classes on dim 1) at integer ``target`` classes.

    ``"mean"`` divides by the summed ``weight`` of the targets that are not
    ``ignore_index``; ``weight`` gets no gradient (PyTorch refuses one that
    requires it). A target out of range gives a NaN loss (PyTorch raises).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> import tapeflow.nn.functional as F
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.log(jnp.array([[0.5, 0.5], [0.25, 0.75]])))
    ...     float(F.nll_loss(x, jnp.array([0, 1])))
    0.4904146194458008
    """
    red = _reduction("nll_loss", size_average, reduce, reduction)
    if not _isa(_dtype(target), jnp.integer):
        raise TypeError(f"nll_loss: target must hold integer class indices, got dtype {_dtype(target)}")
    _class_target_check("nll_loss", input, target, weight)
    operands = (input, target) if weight is None else (input, target, weight)
    return _nll_op(*operands, ignore_index=int(ignore_index), reduction=red, smoothing=0.0)


_REDUCTIONS = frozenset(("mean", "sum", "none"))
# (input shape, dtype, target shape, dtype) of Tensor operands that passed cross_entropy's checks of class-index
# targets and record the op as they are (no permute): a later call with these specs and plain arguments (a str
# reduction, an int ignore_index, a float label_smoothing in [0, 1]) records the op at once, as those checks would
_PLAIN_CLASS_TARGETS: set[tuple[Shape, np.dtype, Shape, np.dtype]] = set()
_REMEMBERED = 1024  # at most this many specs (a few per model as a rule)


@torch_entry(bind=("tfl", "F"), records="op:cross_entropy", opinfo=("nn.functional.cross_entropy",))
def cross_entropy(
    input: Operand,
    target: Operand,
    weight: Operand | None = None,
    size_average: bool | None = None,
    ignore_index: int = -100,
    reduce: bool | None = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """Softmax cross-entropy of scores ``input`` (classes on dim 1: (N, C), (N, C, d1, ...) or (C,)).

    ``target`` is integer class indices (``input.shape`` without dim 1) or
    class probabilities (``input``'s shape). ``weight`` weighs the classes,
    ``ignore_index`` drops entries, ``label_smoothing`` mixes in the uniform
    distribution, as PyTorch. Unweighted class targets record the built-in
    ``cross_entropy`` op (classes moved last). A target out of range gives a
    NaN loss (PyTorch raises).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.zeros((2, 4)))
    ...     float(tfl.cross_entropy(x, jnp.array([1, 3])))
    1.3862943649291992
    """
    if (
        type(input) is Tensor
        and type(target) is Tensor
        and weight is None
        and size_average is None
        and reduce is None
        and type(ignore_index) is int
        and type(label_smoothing) is float
        and 0.0 <= label_smoothing <= 1.0
        and type(reduction) is str
        and reduction in _REDUCTIONS
        and (input.shape, input.dtype, target.shape, target.dtype) in _PLAIN_CLASS_TARGETS
    ):  # the checks below passed for these specs, and these arguments are what they hand the op
        attrs = {"reduction": reduction, "ignore_index": ignore_index, "label_smoothing": label_smoothing}
        return record_op("cross_entropy", (input, target), attrs)
    op = "cross_entropy"
    red = _reduction(op, size_average, reduce, reduction)
    ls = float(label_smoothing)
    if not 0.0 <= ls <= 1.0:
        raise ValueError(f"{op}: label_smoothing={label_smoothing!r} must be in [0, 1]")
    xs = _shape(input)
    if _isa(_dtype(target), jnp.floating):
        if _shape(target) != xs:
            raise ValueError(f"{op}: class-probability target {_shape(target)} must have the input's shape {xs}")
        if weight is not None and (not xs or _shape(weight) != (xs[1 if len(xs) >= 2 else 0],)):
            raise ValueError(f"{op}: weight must have shape (C,) (one per class), got {_shape(weight)}")
        _float_input(op, input)
        operands = (input, target) if weight is None else (input, target, weight)
        return _soft_ce_op(*operands, reduction=red, smoothing=ls)
    if not _isa(_dtype(target), jnp.integer):
        raise TypeError(
            f"{op}: target must be integer class indices or float class probabilities, got {_dtype(target)}"
        )
    _class_target_check(op, input, target, weight)
    if weight is None:
        if len(xs) <= 2 and type(input) is Tensor and type(target) is Tensor:
            if len(_PLAIN_CLASS_TARGETS) >= _REMEMBERED:  # a loop over ever new batch sizes: start again
                _PLAIN_CLASS_TARGETS.clear()
            _PLAIN_CLASS_TARGETS.add((input.shape, input.dtype, target.shape, target.dtype))
        x = input
        if len(xs) > 2:  # the op wants classes last
            x = apply("permute", input, axes=(0, *range(2, len(xs)), 1))
        return apply("cross_entropy", x, target, reduction=red, ignore_index=int(ignore_index), label_smoothing=ls)
    logp = apply("log_softmax", input, axis=1 if len(xs) >= 2 else 0)
    return _nll_op(logp, target, weight, ignore_index=int(ignore_index), reduction=red, smoothing=ls)


def _weighted(loss: Array, weight: Array, reduction: str, by_weight: bool) -> Array:
    loss = loss * weight
    if reduction == "mean" and by_weight:
        return jnp.sum(loss) / jnp.sum(jnp.broadcast_to(weight, loss.shape))
    return _reduced(loss, reduction)


def _pointwise_loss(
    x: Array, t: Array, weight: Array = None, *, kind: str, reduction: str, beta: float, by_weight: bool
) -> Array:
    d = x - t
    z = jnp.abs(d)
    if kind == "mse":
        loss = d * d
    elif kind == "l1":
        loss = z
    elif kind == "smooth_l1":
        b = jnp.asarray(beta, x.dtype)
        loss = z if beta == 0 else jnp.where(z < b, 0.5 * d * d / b, z - 0.5 * b)
    else:  # huber
        b = jnp.asarray(beta, x.dtype)
        loss = jnp.where(z < b, 0.5 * d * d, b * (z - 0.5 * b))
    if weight is None:
        return _reduced(loss, reduction)
    return _weighted(loss, weight, reduction, by_weight)


_pointwise_loss_op = lift(
    _pointwise_loss,
    name="torch.nn.functional.pointwise_loss",
    static_argnames=("kind", "reduction", "beta", "by_weight"),
)


def _pair_check(op: str, input: Operand, target: Operand, weight: Operand | None) -> None:
    _float_input(op, input)
    _float_input(op, target, "target")
    try:
        shape = np.broadcast_shapes(_shape(input), _shape(target))
    except ValueError:
        raise ValueError(f"{op}: input {_shape(input)} and target {_shape(target)} do not broadcast together") from None
    if weight is not None and _shape(weight) != shape:
        raise ValueError(f"{op}: weight {_shape(weight)} must have the size of the input {shape}")


def _pointwise(
    op: str, input: Operand, target: Operand, weight: Operand | None, reduction: str, beta: float, by_weight: bool
) -> Tensor:
    _pair_check(op, input, target, weight)
    operands = (input, target) if weight is None else (input, target, weight)
    kind = op.removesuffix("_loss")
    return _pointwise_loss_op(*operands, kind=kind, reduction=reduction, beta=float(beta), by_weight=by_weight)


@torch_entry(bind=("F",), records="op:mse", opinfo=("nn.functional.mse_loss",))
def mse_loss(
    input: Operand,
    target: Operand,
    size_average: bool | None = None,
    reduce: bool | None = None,
    reduction: str = "mean",
    weight: Operand | None = None,
) -> Tensor:
    """Squared error ``(input - target) ** 2`` (broadcast), reduced; with ``weight``, a weighted mean.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> import tapeflow.nn.functional as F
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([1.0, 3.0]))
    ...     float(F.mse_loss(x, jnp.array([0.0, 0.0])))
    5.0
    """
    red = _reduction("mse_loss", size_average, reduce, reduction)
    if weight is None and _shape(input) == _shape(target) and _is_float(input) and _dtype(input) == _dtype(target):
        return apply("mse", input, target, reduction=red)
    return _pointwise("mse_loss", input, target, weight, red, 0.0, True)


@torch_entry(bind=("F",), records="lifted", opinfo=("nn.functional.l1_loss",))
def l1_loss(
    input: Operand,
    target: Operand,
    size_average: bool | None = None,
    reduce: bool | None = None,
    reduction: str = "mean",
    weight: Operand | None = None,
) -> Tensor:
    """Absolute error ``|input - target|`` (broadcast), reduced; with ``weight``, a weighted mean.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> import tapeflow.nn.functional as F
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([1.0, -3.0]))
    ...     float(F.l1_loss(x, jnp.array([0.0, 0.0])))
    2.0
    """
    red = _reduction("l1_loss", size_average, reduce, reduction)
    return _pointwise("l1_loss", input, target, weight, red, 0.0, True)


@torch_entry(bind=("F",), records="lifted", opinfo=("nn.functional.smooth_l1_loss",))
def smooth_l1_loss(
    input: Operand,
    target: Operand,
    size_average: bool | None = None,
    reduce: bool | None = None,
    reduction: str = "mean",
    beta: float = 1.0,
) -> Tensor:
    """``0.5 d**2 / beta`` where ``|d| < beta``, else ``|d| - beta / 2``, for ``d = input - target``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> import tapeflow.nn.functional as F
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([0.5, 3.0]))
    ...     F.smooth_l1_loss(x, jnp.zeros(2), reduction="none").tolist()
    [0.125, 2.5]
    """
    red = _reduction("smooth_l1_loss", size_average, reduce, reduction)
    if beta < 0:
        raise ValueError(f"smooth_l1_loss: beta={beta} must be non-negative")
    return _pointwise("smooth_l1_loss", input, target, None, red, beta, False)


@torch_entry(bind=("F",), records="lifted", opinfo=("nn.functional.huber_loss",))
def huber_loss(
    input: Operand, target: Operand, reduction: str = "mean", delta: float = 1.0, weight: Operand | None = None
) -> Tensor:
    """``0.5 d**2`` where ``|d| < delta``, else ``delta * (|d| - delta / 2)``, for ``d = input - target``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> import tapeflow.nn.functional as F
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([0.5, 3.0]))
    ...     F.huber_loss(x, jnp.zeros(2), reduction="none").tolist()
    [0.125, 2.5]
    """
    red = _reduction("huber_loss", None, None, reduction)
    if delta <= 0:
        raise ValueError(f"huber_loss: delta={delta} must be positive")
    return _pointwise("huber_loss", input, target, weight, red, delta, False)


def _bce(x: Array, t: Array, weight: Array = None, *, reduction: str) -> Array:
    floor = jnp.asarray(-100.0, x.dtype)  # PyTorch clamps the logs, so a 0 or 1 probability stays finite
    loss = -(t * jnp.maximum(jnp.log(x), floor) + (1 - t) * jnp.maximum(jnp.log1p(-x), floor))
    return _reduced(loss if weight is None else loss * jax.lax.stop_gradient(weight), reduction)


def _bce_logits(x: Array, t: Array, weight: Array, pos_weight: Array = None, *, reduction: str) -> Array:
    # as PyTorch, the weights are constants: no gradient flows to them
    lw = 1 if pos_weight is None else 1 + (jax.lax.stop_gradient(pos_weight) - 1) * t
    loss = (1 - t) * x + lw * jax.nn.softplus(-x)
    return _reduced(loss * jax.lax.stop_gradient(weight), reduction)


_bce_op = lift(_bce, name="torch.nn.functional.binary_cross_entropy", static_argnames=("reduction",))
_bce_logits_op = lift(
    _bce_logits, name="torch.nn.functional.binary_cross_entropy_with_logits", static_argnames=("reduction",)
)


@torch_entry(bind=("F",), records="lifted", opinfo=("nn.functional.binary_cross_entropy",))
def binary_cross_entropy(
    input: Operand,
    target: Operand,
    weight: Operand | None = None,
    size_average: bool | None = None,
    reduce: bool | None = None,
    reduction: str = "mean",
) -> Tensor:
    """``-(target * log(input) + (1 - target) * log(1 - input))`` of probabilities, logs clamped at -100.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> import tapeflow.nn.functional as F
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([0.5]))
    ...     round(float(F.binary_cross_entropy(x, jnp.array([1.0]))), 4)
    0.6931
    """
    red = _reduction("binary_cross_entropy", size_average, reduce, reduction)
    if _shape(target) != _shape(input):
        raise ValueError(f"binary_cross_entropy: target {_shape(target)} must have the input's shape {_shape(input)}")
    _pair_check("binary_cross_entropy", input, target, None)
    operands = (input, target) if weight is None else (input, target, weight)
    return _bce_op(*operands, reduction=red)


@torch_entry(bind=("F",), records="lifted", opinfo=("nn.functional.binary_cross_entropy_with_logits",))
def binary_cross_entropy_with_logits(
    input: Operand,
    target: Operand,
    weight: Operand | None = None,
    size_average: bool | None = None,
    reduce: bool | None = None,
    reduction: str = "mean",
    pos_weight: Operand | None = None,
) -> Tensor:
    """Binary cross-entropy of ``sigmoid(input)``, computed stably from the logits; ``pos_weight`` weighs positives.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> import tapeflow.nn.functional as F
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([0.0]))
    ...     loss = F.binary_cross_entropy_with_logits(x, jnp.array([1.0]))
    ...     round(float(loss), 4)
    0.6931
    """
    op = "binary_cross_entropy_with_logits"
    red = _reduction(op, size_average, reduce, reduction)
    if _shape(target) != _shape(input):
        raise ValueError(f"{op}: target {_shape(target)} must have the input's shape {_shape(input)}")
    _pair_check(op, input, target, None)
    w = 1.0 if weight is None else weight
    operands = (input, target, w) if pos_weight is None else (input, target, w, pos_weight)
    return _bce_logits_op(*operands, reduction=red)


def _kl_div(x: Array, t: Array, *, reduction: str, log_target: bool) -> Array:
    if log_target:
        loss = jnp.exp(t) * (t - x)
    else:
        pos = t > 0  # xlogy: an entry with target 0 contributes 0
        loss = jnp.where(pos, t * jnp.log(jnp.where(pos, t, jnp.ones((), t.dtype))), jnp.zeros((), t.dtype)) - t * x
    if reduction == "batchmean":
        return jnp.sum(loss) / (x.shape[0] if x.ndim else 1)
    return _reduced(loss, reduction)


_kl_div_op = lift(_kl_div, name="torch.nn.functional.kl_div", static_argnames=("reduction", "log_target"))


@torch_entry(bind=("F",), records="lifted", opinfo=("nn.functional.kl_div",))
def kl_div(
    input: Operand,
    target: Operand,
    size_average: bool | None = None,
    reduce: bool | None = None,
    reduction: str = "mean",
    log_target: bool = False,
) -> Tensor:
    """KL divergence ``target * (log(target) - input)`` of log-probabilities ``input``; ``"batchmean"`` divides by N.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> import tapeflow.nn.functional as F
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.log(jnp.array([[0.5, 0.5]])))
    ...     float(F.kl_div(x, jnp.array([[0.5, 0.5]]), reduction="batchmean"))
    0.0
    """
    op = "kl_div"
    red = "batchmean" if reduction == "batchmean" and size_average is None and reduce is None else None
    red = red or _reduction(op, size_average, reduce, reduction)
    _pair_check(op, input, target, None)
    return _kl_div_op(input, target, reduction=red, log_target=bool(log_target))
