"""Every registered op: forward vs an independent plain-JAX reference, the VJP vs
``jax.vjp`` of that reference and vs central finite differences, and the
failure contract of ``record``.

``CASES`` must cover every op in ``tapeflow.REGISTRY``: a new op without a case
fails at collection time.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapeflow as tfl
from tapeflow._core._registry import fmt_spec
from tapeflow._ops._shape import normalize_index
from tapeflow._shell import _functions

assert jnp.zeros(()).dtype == jnp.float64, "tests/conftest.py must enable jax_enable_x64"

Gen = Callable[[np.random.Generator], np.ndarray]

# --------------------------------------------------------------------------- input generators


def N(*shape: int) -> Gen:
    """Standard normals."""
    return lambda rng: rng.standard_normal(shape)


def P(*shape: int) -> Gen:
    """Positive values in [0.5, 2] (log, sqrt, pow base, divisors)."""
    return lambda rng: rng.uniform(0.5, 2.0, shape)


def D(*shape: int, odd: bool = False) -> Gen:
    """Distinct values on a 0.2 grid plus small jitter: no ties, and never near a kink.

    Even grid: multiples of 0.2; ``odd=True``: odd tenths (never within 0.08 of 0 or
    of any even-grid value). Use even vs odd for the two sides of maximum/minimum.
    """

    def g(rng: np.random.Generator) -> np.ndarray:
        size = math.prod(shape)
        k = rng.choice(60, size, replace=False)
        v = (2 * k + (1 if odd else 0)) * 0.1 - 6.0 + rng.uniform(-0.02, 0.02, size)
        return v.reshape(shape)

    return g


def Z(*shape: int, lo: int = 0, hi: int = 3) -> Gen:
    """Small integers as floats (comparisons with equal entries)."""
    return lambda rng: rng.integers(lo, hi, shape).astype(np.float64)


def I(*shape: int, hi: int) -> Gen:  # noqa: E743
    """int32 indices in [0, hi)."""
    return lambda rng: rng.integers(0, hi, shape).astype(np.int32)


def Fix(values: Any, dtype: Any = np.int32) -> Gen:
    """A fixed array."""
    return lambda rng: np.asarray(values, dtype)


def B(*shape: int) -> Gen:
    """Random booleans."""
    return lambda rng: rng.random(shape) < 0.5


def M(*shape: int) -> Gen:
    """Random attention mask (True = attend) whose key 0 is always kept (no empty rows)."""

    def g(rng: np.random.Generator) -> np.ndarray:
        m = rng.random(shape) < 0.6
        m[..., 0] = True
        return m

    return g


@dataclasses.dataclass
class Case:
    inputs: tuple[Gen, ...]
    attrs: dict[str, Any]
    id: str
    fd: bool = True
    ref_attrs: dict[str, Any] | None = None  # attributes for the reference, when they differ

    @property
    def ref_kwargs(self) -> dict[str, Any]:
        return self.attrs if self.ref_attrs is None else self.ref_attrs


def c(
    *inputs: Gen,
    id: str,
    fd: bool = True,
    ref_attrs: dict[str, Any] | None = None,
    **attrs: Any,
) -> Case:
    return Case(inputs, attrs, id, fd, ref_attrs)


# --------------------------------------------------------------------------- references (plain JAX, not tapeflow)


def _red(loss: Any, reduction: str) -> Any:
    return {"mean": jnp.mean, "sum": jnp.sum, "none": lambda v: v}[reduction](loss)


def _pool_ref(x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, *, kind: str) -> Any:
    kh, kw = (kernel_size, kernel_size) if isinstance(kernel_size, int) else kernel_size
    stride = (kh, kw) if stride is None else stride
    sh, sw = (stride, stride) if isinstance(stride, int) else stride
    ph, pw = (padding, padding) if isinstance(padding, int) else padding
    fill = -jnp.inf if kind == "max" else 0.0
    xp = jnp.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=fill)
    oh = (xp.shape[2] - kh) // sh + 1
    ow = (xp.shape[3] - kw) // sw + 1
    parts = [
        xp[:, :, i : i + sh * (oh - 1) + 1 : sh, j : j + sw * (ow - 1) + 1 : sw] for i in range(kh) for j in range(kw)
    ]
    stack = jnp.stack(parts)
    return jnp.max(stack, axis=0) if kind == "max" else jnp.sum(stack, axis=0) / (kh * kw)


def _pair(v: Any) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


def _conv_pads(x: Any, w: Any, stride: Any, padding: Any, dilation: Any) -> list[tuple[int, int]]:
    if padding == "VALID":
        return [(0, 0), (0, 0)]
    if padding == "SAME":
        pads = []
        for n, k, s, d in zip(x.shape[2:], w.shape[2:], _pair(stride), _pair(dilation)):
            total = max((-(-n // s) - 1) * s + d * (k - 1) + 1 - n, 0)
            pads.append((total // 2, total - total // 2))
        return pads
    if isinstance(padding, int) or isinstance(padding[0], int):
        return [(p, p) for p in _pair(padding)]
    return [tuple(p) for p in padding]


def _conv_ref(
    x: Any, w: Any, b: Any = None, stride: Any = 1, padding: Any = 0, dilation: Any = 1, groups: int = 1
) -> Any:
    """Convolution as a sum over kernel offsets of strided slices times weights (no lax.conv:
    jax.vjp of lax.conv aborts XLA on CPU for some strided shapes)."""
    (sh, sw), (dh, dw) = _pair(stride), _pair(dilation)
    n, c, _, _ = x.shape
    o, cg, kh, kw = w.shape
    xp = jnp.pad(x, [(0, 0), (0, 0)] + _conv_pads(x, w, stride, padding, dilation))
    oh = (xp.shape[2] - dh * (kh - 1) - 1) // sh + 1
    ow = (xp.shape[3] - dw * (kw - 1) - 1) // sw + 1
    xg = xp.reshape(n, groups, cg, *xp.shape[2:])
    wg = w.reshape(groups, o // groups, cg, kh, kw)
    y = 0.0
    for a in range(kh):
        for bb in range(kw):
            patch = xg[:, :, :, a * dh : a * dh + (oh - 1) * sh + 1 : sh, bb * dw : bb * dw + (ow - 1) * sw + 1 : sw]
            y = y + jnp.einsum("ngchw,goc->ngohw", patch, wg[..., a, bb])
    y = y.reshape(n, o, oh, ow)
    return y if b is None else y + b.reshape(1, -1, 1, 1)


def _lax_conv_nhwc(
    x: Any, w: Any, b: Any = None, stride: Any = 1, padding: Any = 0, dilation: Any = 1, groups: int = 1
) -> Any:
    """Forward-only second reference: lax.conv in NHWC/HWIO layout."""
    pad = padding if isinstance(padding, str) else _conv_pads(x, w, stride, padding, dilation)
    y = jax.lax.conv_general_dilated(
        jnp.transpose(x, (0, 2, 3, 1)),
        jnp.transpose(w, (2, 3, 1, 0)),
        window_strides=_pair(stride),
        padding=pad,
        rhs_dilation=_pair(dilation),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=groups,
    )
    y = jnp.transpose(y, (0, 3, 1, 2))
    return y if b is None else y + b.reshape(1, -1, 1, 1)


def _attention_ref(q: Any, k: Any, v: Any, mask: Any = None, scale: Any = None, causal: bool = False) -> Any:
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = jnp.einsum("...qd,...kd->...qk", q, k) * scale
    keep = jnp.ones(s.shape[-2:], bool) if mask is None else mask
    if causal:
        keep = keep & jnp.tril(jnp.ones((q.shape[-2], k.shape[-2]), bool))
    p = jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1)
    return jnp.einsum("...qk,...kd->...qd", p, v)


def _layer_norm_ref(x: Any, w: Any = None, b: Any = None, axis: Any = -1, eps: float = 1e-5) -> Any:
    mu = jnp.mean(x, axis=axis, keepdims=True)
    var = jnp.var(x, axis=axis, keepdims=True)
    y = (x - mu) / jnp.sqrt(var + eps)
    if w is not None:
        y = y * w
    return y if b is None else y + b


def _take_ref(x: Any, i: Any, axis: int = 0) -> Any:
    n = x.shape[axis]
    return jnp.take(x, jnp.where(i < 0, i + n, i), axis=axis, mode="clip")


def _scatter_ref(x: Any, i: Any, u: Any, axis: int = 0) -> Any:
    return x.at[(slice(None),) * (axis % x.ndim) + (i,)].add(u)


def _ce_ref(logits: Any, labels: Any, reduction: str = "mean") -> Any:
    logp = jax.nn.log_softmax(logits, axis=-1)
    return _red(-jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0], reduction)


def _linear_ref(x: Any, w: Any, b: Any = None) -> Any:
    return x @ w if b is None else x @ w + b


def _linear_t_ref(x: Any, w: Any, b: Any = None) -> Any:
    return x @ w.T if b is None else x @ w.T + b


def _squeeze_ref(x: Any, axis: Any = None) -> Any:
    return jnp.squeeze(x, axis)


REFS: dict[str, Callable[..., Any]] = {
    # math
    "add": jnp.add,
    "sub": jnp.subtract,
    "mul": jnp.multiply,
    "div": jnp.divide,
    "neg": jnp.negative,
    "pow": jnp.power,
    "maximum": jnp.maximum,
    "minimum": jnp.minimum,
    "where": jnp.where,
    "exp": jnp.exp,
    "log": jnp.log,
    "sqrt": jnp.sqrt,
    "sin": jnp.sin,
    "cos": jnp.cos,
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
    "softplus": lambda x: jnp.logaddexp(x, 0.0),
    "abs": jnp.abs,
    "gelu": lambda x: 0.5 * x * (1 + jax.scipy.special.erf(x / np.sqrt(2.0))),
    "relu": lambda x: jnp.maximum(x, 0.0),
    "clamp": lambda x, lo=None, hi=None: jnp.clip(x, lo, hi),
    "stop_gradient": jax.lax.stop_gradient,
    "astype": lambda x, dtype: x.astype(dtype),
    "lt": jnp.less,
    "le": jnp.less_equal,
    "gt": jnp.greater,
    "ge": jnp.greater_equal,
    "eq": jnp.equal,
    "ne": jnp.not_equal,
    "sum": lambda x, axis=None, keepdims=False: jnp.sum(x, axis=axis, keepdims=keepdims),
    "mean": lambda x, axis=None, keepdims=False: jnp.mean(x, axis=axis, keepdims=keepdims),
    "max": lambda x, axis=None, keepdims=False: jnp.max(x, axis=axis, keepdims=keepdims),
    "matmul": jnp.matmul,
    "linear": _linear_ref,
    "linear_t": _linear_t_ref,
    # shape
    "reshape": lambda x, shape: jnp.reshape(x, shape),
    "transpose": lambda x, axes=None: jnp.transpose(x, axes),
    "permute": lambda x, axes: jnp.transpose(x, axes),
    "broadcast_to": lambda x, shape: jnp.broadcast_to(x, shape),
    "expand_dims": lambda x, axis: jnp.expand_dims(x, axis),
    "squeeze": _squeeze_ref,
    "concat": lambda *xs, axis=0: jnp.concatenate(xs, axis=axis),
    "index": lambda x, index: x[index],
    "take": _take_ref,
    "gather": lambda x, i: _take_ref(x, i, 0),
    "scatter_add": _scatter_ref,
    # nn
    "softmax": lambda x, axis=-1: jax.nn.softmax(x, axis=axis),
    "log_softmax": lambda x, axis=-1: jax.nn.log_softmax(x, axis=axis),
    "logsumexp": lambda x, axis=-1, keepdims=False: jax.scipy.special.logsumexp(x, axis=axis, keepdims=keepdims),
    "layer_norm": _layer_norm_ref,
    "cross_entropy": _ce_ref,
    "mse": lambda p, t, reduction="mean": _red((p - t) ** 2, reduction),
    "conv2d": _conv_ref,
    "max_pool2d": lambda x, **a: _pool_ref(x, **a, kind="max"),
    "avg_pool2d": lambda x, **a: _pool_ref(x, **a, kind="avg"),
    "attention": _attention_ref,
    # one step of a recorded backward (create_graph=True): jax.vjp of the node op's reference
    "vjp": lambda g, out, *xs, node_op, wrt, k, node_attrs=(): [
        ct for ct, m in zip(jax.vjp(lambda *v: REFS[node_op](*v, **dict(node_attrs)), *xs)[1](g), wrt) if m
    ][k],
}

# --------------------------------------------------------------------------- the case table


def _binary(gen: Callable[..., Gen] = N) -> list[Case]:
    return [
        c(gen(2, 3), gen(2, 3), id="same"),
        c(gen(2, 3), gen(3), id="bcast-row"),
        c(gen(2, 1, 3), gen(1, 4, 1), id="bcast-both"),
        c(gen(), gen(3), id="scalar"),
    ]


def _unary(gen: Callable[..., Gen] = N) -> list[Case]:
    return [c(gen(1, 4, 1), id="size1"), c(gen(), id="scalar")]


CASES: dict[str, list[Case]] = {
    "add": _binary(),
    "sub": _binary(),
    "mul": _binary(),
    "div": [
        c(N(2, 3), P(2, 3), id="same"),
        c(N(2, 1), P(1, 3), id="bcast"),
        c(N(3), P(), id="scalar-den"),
    ],
    "neg": _unary(),
    "pow": [
        c(P(2, 3), N(2, 3), id="same"),
        c(P(2, 1), N(3), id="bcast"),
        c(P(3), N(), id="scalar-exp"),
    ],
    "maximum": [
        c(D(2, 3), D(2, 3, odd=True), id="same"),
        c(D(2, 3), D(1, 3, odd=True), id="bcast"),
        c(D(4, 1, odd=True), D(1, 3), id="bcast-both"),
    ],
    "minimum": [
        c(D(2, 3), D(2, 3, odd=True), id="same"),
        c(D(2, 3, odd=True), D(3), id="bcast"),
        c(D(), D(2, 2, odd=True), id="scalar"),
    ],
    "where": [
        c(B(2, 3), N(2, 3), N(2, 3), id="same"),
        c(B(2, 1), N(3), N(2, 3), id="bcast"),
        c(B(3), N(), N(2, 3), id="scalar-x"),
    ],
    "exp": _unary(),
    "log": _unary(P),
    "sqrt": _unary(P),
    "sin": _unary(),
    "cos": _unary(),
    "tanh": _unary(),
    "sigmoid": _unary(),
    "softplus": _unary(),
    "gelu": _unary(),
    "abs": _unary(lambda *s: D(*s, odd=True)),
    "relu": _unary(lambda *s: D(*s, odd=True)),
    "clamp": [
        c(D(2, 5, odd=True), lo=-0.4, hi=0.6, id="both"),
        c(D(3, 4, odd=True), lo=-0.2, id="lo"),
        c(D(1, 6, odd=True), hi=1.0, id="hi"),
        c(D(2, 2, odd=True), id="none"),
    ],
    "stop_gradient": [c(N(2, 3), id="2x3", fd=False)],
    "astype": [
        c(N(2, 3), dtype=jnp.float32, id="f32", fd=False),
        c(N(3), dtype=jnp.float64, id="f64"),
    ],
    **{name: _binary(Z)[1:] for name in ("lt", "le", "gt", "ge", "eq", "ne")},
    "sum": [
        c(N(2, 3), id="all"),
        c(N(2, 3), axis=1, id="axis1"),
        c(N(2, 1, 3), axis=(0, 2), keepdims=True, id="tuple-keep"),
        c(N(), id="scalar"),
    ],
    "mean": [
        c(N(2, 3), id="all"),
        c(N(2, 3), axis=-1, keepdims=True, id="last-keep"),
        c(N(2, 1, 3), axis=(0, 1), id="tuple"),
    ],
    "max": [
        c(D(2, 3), id="all"),
        c(D(2, 3), axis=1, id="axis1"),
        c(D(2, 1, 3), axis=(0, 2), keepdims=True, id="tuple-keep"),
    ],
    "matmul": [
        c(N(2, 3), N(3, 4), id="mm"),
        c(N(3), N(3, 4), id="vec-mat"),
        c(N(2, 3), N(3), id="mat-vec"),
        c(N(3), N(3), id="dot"),
        c(N(3), N(2, 3, 4), id="vec-batched"),
        c(N(2, 5, 3), N(3), id="batched-vec"),
        c(N(2, 1, 2, 3), N(4, 3, 2), id="batch-bcast"),
    ],
    "linear": [
        c(N(2, 3), N(3, 4), id="nobias"),
        c(N(5, 2, 3), N(3, 4), N(4), id="batched-bias"),
        c(N(3), N(3, 2), N(2), id="vector"),
    ],
    "linear_t": [  # weight (out, in): PyTorch's layout
        c(N(2, 3), N(4, 3), id="nobias"),
        c(N(5, 2, 3), N(4, 3), N(4), id="batched-bias"),
        c(N(3), N(2, 3), N(2), id="vector"),
        c(N(2, 3), N(3, 3), N(), id="square-scalar-bias"),
    ],
    # ------------------------------------------------------------------ shape
    "reshape": [
        c(N(2, 3), shape=(3, 2), id="3x2"),
        c(N(2, 3), shape=(-1,), id="flat"),
        c(N(2, 1, 3), shape=(3, -1, 1), id="infer"),
        c(N(), shape=(1, 1), id="scalar"),
        c(N(4), shape=[2, 2], id="list"),
    ],
    "transpose": [
        c(N(2, 3), id="reverse"),
        c(N(2, 3, 4), axes=(1, 0, 2), id="axes"),
        c(N(2, 1, 4), axes=(-1, 0, 1), id="negative"),
    ],
    "permute": [
        c(N(2, 3, 4), axes=(2, 0, 1), id="3d"),
        c(N(1, 3), axes=(1, 0), id="2d"),
    ],
    "broadcast_to": [
        c(N(3), shape=(2, 3), id="lead"),
        c(N(2, 1), shape=(4, 2, 3), id="size1"),
        c(N(), shape=(2, 2), id="scalar"),
        c(N(1, 3), shape=(1, 3), id="noop"),
    ],
    "expand_dims": [
        c(N(2, 3), axis=0, id="front"),
        c(N(2, 3), axis=-1, id="back"),
        c(N(2, 3), axis=(0, 2), id="tuple"),
        c(N(), axis=0, id="scalar"),
    ],
    "squeeze": [
        c(N(1, 3, 1), id="all"),
        c(N(1, 3, 1), axis=0, id="axis0"),
        c(N(1, 3, 1), axis=(-1,), id="tuple"),
        c(N(2, 3), id="none-to-squeeze"),
    ],
    "concat": [
        c(N(2, 3), N(1, 3), id="axis0"),
        c(N(2, 3), N(2, 1), N(2, 2), axis=-1, id="three-last"),
        c(N(3), id="single"),
    ],
    "index": [
        c(N(4, 5), index=1, id="int"),
        c(N(4, 5), index=(slice(1, 3), -1), id="slice-neg"),
        c(N(4, 5), index=(Ellipsis, None, slice(None, None, -2)), id="ellipsis-newaxis-step"),
        c(N(3, 4, 2), index=(0, slice(1, None), None), id="mixed"),
        c(N(3, 4, 2), index=normalize_index((slice(None), 2)), ref_attrs={"index": (slice(None), 2)}, id="normalized"),
        c(N(4, 1), index=slice(None, 2), id="bare-slice"),
        c(N(3), index=(), id="empty"),
    ],
    "take": [
        c(N(5, 3), Fix([0, 4, -1, 0, 2]), id="repeat-neg"),
        c(N(2, 5), Fix([[1, 1], [3, 0]]), axis=1, id="2d-idx-axis1"),
        c(N(2, 3, 4), I(5, hi=4), axis=-1, id="last"),
        c(N(4), Fix([7, -9, 1]), id="clamped"),
        c(N(3, 2), Fix(2), id="scalar-idx"),
    ],
    "gather": [
        c(N(5, 3), Fix([4, 0, 0, 2]), id="rows"),
        c(N(4), I(2, 3, hi=4), id="2d-idx"),
        c(N(3, 1, 2), Fix(1), id="scalar-idx"),
    ],
    "scatter_add": [
        c(N(5, 3), Fix([0, 2, 0]), N(3, 3), id="repeat"),
        c(N(2, 4), Fix([[1, 3], [1, -1]]), N(2, 2, 2), axis=1, id="2d-idx-axis1"),
        c(N(4, 2), Fix([1, 6]), N(2, 1), id="bcast-dropped"),
    ],
    # ------------------------------------------------------------------ nn
    "softmax": [
        c(N(2, 3), id="last"),
        c(N(2, 3), axis=0, id="axis0"),
        c(N(2, 1, 3), axis=(0, 2), id="tuple"),
        c(N(3, 1), id="size1"),
    ],
    "log_softmax": [
        c(N(2, 3), id="last"),
        c(N(2, 3), axis=0, id="axis0"),
        c(N(4), id="vector"),
    ],
    "logsumexp": [
        c(N(2, 3), id="last"),
        c(N(2, 3), axis=0, keepdims=True, id="axis0-keep"),
        c(N(2, 1, 3), axis=None, id="all"),
        c(N(2, 1, 3), axis=(0, 2), id="tuple"),
    ],
    "layer_norm": [
        c(N(2, 5), id="plain"),
        c(N(2, 5), N(5), N(5), id="affine"),
        c(N(3, 2, 4), N(2, 4), N(2, 4), axis=(-2, -1), id="two-axes"),
        c(N(4, 6), N(6), eps=1e-3, id="weight-only"),
        c(N(2, 3), axis=1, id="positive-axis"),
    ],
    "cross_entropy": [
        c(N(4, 5), I(4, hi=5), id="mean"),
        c(N(4, 5), I(4, hi=5), reduction="sum", id="sum"),
        c(N(2, 3, 4), I(2, 3, hi=4), reduction="none", id="none-3d"),
        c(N(5), Fix(3), id="single-row"),
        c(N(3, 1), Fix([0, 0, 0]), id="one-class"),
    ],
    "mse": [
        c(N(2, 3), N(2, 3), id="mean"),
        c(N(2, 3), N(2, 3), reduction="sum", id="sum"),
        c(N(4), N(4), reduction="none", id="none"),
        c(N(), N(), id="scalar"),
    ],
    "conv2d": [
        c(N(2, 3, 5, 5), N(4, 3, 3, 3), id="plain"),
        c(N(1, 3, 5, 4), N(2, 3, 3, 3), N(2), padding=1, id="bias-pad"),
        # jax.vjp of lax.conv aborts XLA (CPU) on this one; the op's hand-written VJP must not
        c(N(1, 2, 6, 5), N(3, 2, 2, 3), stride=2, padding=(1, 0), id="stride"),
        c(N(1, 2, 6, 6), N(2, 2, 3, 2), dilation=(2, 1), id="dilation"),
        c(N(1, 4, 5, 4), N(6, 2, 3, 2), N(6), groups=2, padding="SAME", id="groups-same"),
        c(N(1, 1, 4, 4), N(1, 1, 2, 2), padding="VALID", stride=(1, 2), id="valid"),
        c(N(1, 1, 4, 4), N(2, 1, 2, 2), padding=((1, 0), (0, 2)), id="explicit-pad"),
    ],
    "max_pool2d": [
        c(D(1, 2, 4, 4), kernel_size=2, id="k2"),
        c(D(2, 1, 5, 5), kernel_size=3, stride=2, padding=1, id="k3s2p1"),
        c(D(1, 1, 4, 6), kernel_size=(2, 3), stride=(1, 2), id="rect"),
    ],
    "avg_pool2d": [
        c(N(1, 2, 4, 4), kernel_size=2, id="k2"),
        c(N(2, 1, 5, 5), kernel_size=3, stride=2, padding=1, id="k3s2p1"),
        c(N(1, 1, 4, 6), kernel_size=(2, 3), stride=(1, 2), id="rect"),
    ],
    "attention": [
        c(N(3, 4), N(5, 4), N(5, 2), id="plain"),
        c(N(2, 3, 4), N(2, 5, 4), N(2, 5, 3), M(3, 5), id="mask"),
        c(N(2, 1, 3, 4), N(1, 2, 5, 4), N(2, 5, 2), M(2, 1, 1, 5), id="bcast-batch"),
        c(N(4, 3), N(4, 3), N(4, 2), causal=True, id="causal"),
        c(N(2, 3, 4), N(2, 5, 4), N(2, 5, 2), M(2, 1, 5), causal=True, scale=0.3, id="causal-mask-scale"),
    ],
    "vjp": [  # operands: the cotangent, the node's output, the node's operands (VJPs that do not read the output)
        c(N(2, 3), N(2, 3), N(2, 3), N(3), node_op="mul", wrt=(True, True), k=1, id="mul-bcast-k1"),
        c(N(4), N(4), N(4), node_op="sin", wrt=(True,), k=0, id="sin"),
        c(N(2), N(2), N(2, 3), node_op="sum", node_attrs=(("axis", 1),), wrt=(True,), k=0, id="sum-axis"),
    ],
}

COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne")

_missing = sorted(n for n, d in tfl.REGISTRY.items() if not d.user and n not in CASES)
assert not _missing, f"ops without test cases in CASES: {_missing}"
_no_ref = sorted(set(CASES) - set(REFS))
assert not _no_ref, f"cases without a reference in REFS: {_no_ref}"

ALL = [(name, case) for name, cases in sorted(CASES.items()) for case in cases]
DIFF = [p for p in ALL if p[0] not in COMPARISONS]
CMP = [p for p in ALL if p[0] in COMPARISONS]


def _ids(params: list[tuple[str, Case]]) -> list[str]:
    return [f"{name}-{case.id}" for name, case in params]


# --------------------------------------------------------------------------- helpers


def _rng(*key: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32("/".join(key).encode()))


def _is_float(a: np.ndarray) -> bool:
    return np.issubdtype(a.dtype, np.floating)


def _run(name: str, xs: list[np.ndarray], attrs: dict[str, Any]) -> tuple[tfl.Tape, list[int], int]:
    t = tfl.Tape.empty()
    ids = []
    for x in xs:
        t, i = tfl.leaf(t, jnp.asarray(x), requires_grad=True)
        ids.append(i)
    t, r = tfl.record(t, name, ids, **attrs)
    assert r.is_ok, r.error
    return t, ids, r.value


def _diff_positions(name: str, xs: list[np.ndarray]) -> list[int]:
    nondiff = tfl.REGISTRY[name].nondiff
    return [i for i, x in enumerate(xs) if _is_float(x) and i not in nondiff]


# --------------------------------------------------------------------------- tests


def test_every_op_has_cases() -> None:
    builtin = [name for name, d in tfl.REGISTRY.items() if not d.user]  # ops users register are theirs to test
    assert set(builtin) <= set(CASES)
    assert all(CASES[name] for name in builtin)


@pytest.mark.parametrize(("name", "case"), DIFF, ids=_ids(DIFF))
def test_op_forward_and_vjp(name: str, case: Case) -> None:
    rng = _rng(name, case.id)
    xs = [g(rng) for g in case.inputs]
    t, ids, out_id = _run(name, xs, case.attrs)
    out = t.value(out_id)

    diff = _diff_positions(name, xs)
    seed = rng.standard_normal(out.shape).astype(out.dtype)
    ref = REFS[name]
    jxs = [jnp.asarray(x) for x in xs]

    @jax.jit  # one compile for the reference and its VJP: cheaper than eager dispatch op by op
    def ref_vjp(dxs: list[Any], s: Any) -> tuple[Any, Any]:
        def f(*d: Any) -> Any:
            full = list(jxs)
            for i, v in zip(diff, d):
                full[i] = v
            return ref(*full, **case.ref_kwargs)

        y, pull = jax.vjp(f, *dxs)
        return y, pull(s)

    expected, want = ref_vjp([jxs[i] for i in diff], jnp.asarray(seed))

    # forward vs the independent reference
    assert out.shape == expected.shape and out.dtype == expected.dtype
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-10, atol=1e-12)
    assert t[out_id].shape == out.shape and t[out_id].dtype == out.dtype

    # backward vs jax.vjp of the reference
    assert t[out_id].requires_grad == bool(diff)
    grads = tfl.backward(t, out_id, seed=seed)
    # integer / boolean / nondiff operands get no gradient
    assert set(grads) == {ids[i] for i in diff}
    for i, w in zip(diff, want):
        got = grads[ids[i]]
        assert got.shape == xs[i].shape and got.dtype == xs[i].dtype
        scale = float(np.max(np.abs(w))) if w.size else 0.0
        np.testing.assert_allclose(np.asarray(got), np.asarray(w), rtol=1e-6, atol=1e-9 * max(scale, 1.0))

    # backward vs central finite differences: <seed, J v> for random directions v
    if not case.fd:
        return

    def fwd(arrays: list[np.ndarray]) -> np.ndarray:
        tt, _, o = _run(name, arrays, case.attrs)
        return np.asarray(tt.value(o))

    eps = 1e-6
    s64 = np.asarray(seed, np.float64)
    for _ in range(2):
        dirs = {i: rng.standard_normal(xs[i].shape) for i in diff}
        plus = [x + eps * dirs[i] if i in dirs else x for i, x in enumerate(xs)]
        minus = [x - eps * dirs[i] if i in dirs else x for i, x in enumerate(xs)]
        fd = float(np.sum(s64 * (fwd(plus) - fwd(minus)))) / (2 * eps)
        an = sum(float(np.sum(np.asarray(grads[ids[i]]) * v)) for i, v in dirs.items())
        assert abs(fd - an) <= 1e-5 * max(1.0, abs(an)), (fd, an)


@pytest.mark.parametrize(("name", "case"), CMP, ids=_ids(CMP))
def test_comparison_forward_only(name: str, case: Case) -> None:
    rng = _rng(name, case.id)
    xs = [g(rng) for g in case.inputs]
    t, _, out_id = _run(name, xs, case.attrs)
    out = t.value(out_id)
    expected = REFS[name](*map(jnp.asarray, xs))
    assert out.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
    assert t[out_id].requires_grad is False
    assert t[out_id].dtype == np.dtype(bool)


@pytest.mark.parametrize("case", CASES["conv2d"], ids=[cc.id for cc in CASES["conv2d"]])
def test_conv2d_forward_matches_lax_conv(case: Case) -> None:
    rng = _rng("conv2d", case.id)
    xs = [g(rng) for g in case.inputs]
    t, _, out_id = _run("conv2d", xs, case.attrs)
    want = _lax_conv_nhwc(*map(jnp.asarray, xs), **case.attrs)
    np.testing.assert_allclose(np.asarray(t.value(out_id)), np.asarray(want), rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- failure contract


def f64(*shape: int) -> np.ndarray:
    return np.ones(shape, np.float64)


def f32(*shape: int) -> np.ndarray:
    return np.ones(shape, np.float32)


def i32(*shape: int) -> np.ndarray:
    return np.zeros(shape, np.int32)


def b_(*shape: int) -> np.ndarray:
    return np.ones(shape, bool)


FAILURES: list[tuple[str, str, list[np.ndarray], dict[str, Any], str]] = [
    # (id, op, operands, attrs, expected substring)
    # math
    ("add-bcast", "add", [f64(2, 3), f64(4)], {}, "do not broadcast"),
    ("mul-dtype", "mul", [f64(2), f32(2)], {}, "dtypes differ"),
    ("div-int", "div", [i32(2), i32(2)], {}, "floating dtype"),
    ("exp-int", "exp", [i32(3)], {}, "floating dtype"),
    ("where-cond", "where", [f64(2), f64(2), f64(2)], {}, "must be boolean"),
    ("clamp-order", "clamp", [f64(2)], {"lo": 1.0, "hi": 0.0}, "greater than"),
    ("sum-axis", "sum", [f64(2, 3)], {"axis": 2}, "out of range"),
    ("matmul-k", "matmul", [f64(2, 3), f64(4, 2)], {}, "contracting"),
    ("linear-in", "linear", [f64(2, 3), f64(4, 5)], {}, "features"),
    ("astype-dtype", "astype", [f64(2)], {"dtype": "nope"}, "not a dtype"),
    ("neg-arity", "neg", [f64(2), f64(2)], {}, "expects 1 operand"),
    ("relu-attr", "relu", [f64(2)], {"alpha": 0.1}, "unknown attribute"),
    ("lt-bcast", "lt", [f64(2), f64(3)], {}, "do not broadcast"),
    # shape
    ("reshape-size", "reshape", [f64(2, 3)], {"shape": (4, 2)}, "cannot reshape 6"),
    ("reshape-two-infer", "reshape", [f64(2, 3)], {"shape": (-1, -1)}, "more than one -1"),
    ("reshape-missing", "reshape", [f64(2, 3)], {}, "missing required attribute(s) shape"),
    ("transpose-perm", "transpose", [f64(2, 3)], {"axes": (0, 0)}, "not a permutation"),
    ("permute-none", "permute", [f64(2, 3)], {"axes": None}, "explicit axes"),
    ("broadcast-bad", "broadcast_to", [f64(2, 3)], {"shape": (3, 3)}, "cannot broadcast shape (2, 3)"),
    ("expand-range", "expand_dims", [f64(2, 3)], {"axis": 3}, "out of range"),
    ("squeeze-non1", "squeeze", [f64(2, 3)], {"axis": 1}, "size 3, not 1"),
    ("concat-shape", "concat", [f64(2, 3), f64(2, 4)], {}, "except axis=0"),
    ("concat-dtype", "concat", [f64(2), f32(2)], {}, "dtypes differ"),
    ("concat-rank", "concat", [f64(2, 3), f64(3)], {}, "same rank"),
    ("index-oob", "index", [f64(2, 3)], {"index": (0, 3)}, "out of bounds for axis 1"),
    ("index-too-many", "index", [f64(2)], {"index": (0, 0)}, "too many indices"),
    ("index-float", "index", [f64(2)], {"index": 0.5}, "take or gather"),
    ("index-two-ellipsis", "index", [f64(2)], {"index": (Ellipsis, Ellipsis)}, "single Ellipsis"),
    ("take-float-idx", "take", [f64(3), f64(2)], {}, "integer dtype"),
    ("take-axis", "take", [f64(3), i32(2)], {"axis": 1}, "out of range"),
    ("gather-bool-idx", "gather", [f64(3), b_(2)], {}, "boolean mask, not integer positions"),
    ("gather-scalar", "gather", [f64(), i32(2)], {}, "rank >= 1"),
    ("scatter-shape", "scatter_add", [f64(5, 3), i32(2), f64(3, 3)], {}, "(2, 3)"),
    ("scatter-dtype", "scatter_add", [f64(5, 3), i32(2), f32(2, 3)], {}, "dtypes differ"),
    ("scatter-idx", "scatter_add", [f64(5, 3), f64(2), f64(2, 3)], {}, "integer dtype"),
    # nn
    ("softmax-int", "softmax", [i32(2, 3)], {}, "floating dtype"),
    ("softmax-axis", "softmax", [f64(2, 3)], {"axis": 2}, "out of range"),
    ("log-softmax-scalar", "log_softmax", [f64()], {}, "out of range"),
    ("logsumexp-keepdims", "logsumexp", [f64(2, 3)], {"keepdims": "yes"}, "True or False"),
    ("layer-norm-weight", "layer_norm", [f64(2, 5), f64(4)], {}, "normalized shape (5,)"),
    ("layer-norm-axis", "layer_norm", [f64(2, 5)], {"axis": 0}, "trailing axes"),
    ("layer-norm-dtype", "layer_norm", [f64(2, 5), f32(5)], {}, "different dtypes"),
    ("ce-float-labels", "cross_entropy", [f64(4, 5), f64(4)], {}, "integer class indices"),
    ("ce-label-shape", "cross_entropy", [f64(4, 5), i32(5)], {}, "logits.shape[:-1] = (4,)"),
    ("ce-reduction", "cross_entropy", [f64(4, 5), i32(4)], {"reduction": "avg"}, "reduction='avg'"),
    ("mse-shape", "mse", [f64(2, 3), f64(3)], {}, "must match exactly"),
    (
        "conv-channels",
        "conv2d",
        [f64(1, 3, 5, 5), f64(2, 4, 3, 3)],
        {},
        "input has 3 channels but weight expects 4 (groups=1); weight shape is (O, C/groups, kH, kW)",
    ),
    ("conv-rank", "conv2d", [f64(3, 5, 5), f64(2, 3, 3, 3)], {}, "NCHW"),
    ("conv-bias", "conv2d", [f64(1, 3, 5, 5), f64(2, 3, 3, 3), f64(3)], {}, "bias must have shape (2,)"),
    ("conv-fit", "conv2d", [f64(1, 1, 2, 2), f64(1, 1, 3, 3)], {}, "does not fit"),
    ("conv-groups", "conv2d", [f64(1, 3, 5, 5), f64(2, 1, 3, 3)], {"groups": 2}, "must divide"),
    ("conv-padding", "conv2d", [f64(1, 1, 5, 5), f64(1, 1, 3, 3)], {"padding": "FULL"}, "SAME"),
    ("maxpool-rank", "max_pool2d", [f64(2, 4, 4)], {"kernel_size": 2}, "NCHW"),
    ("maxpool-missing", "max_pool2d", [f64(1, 1, 4, 4)], {}, "missing required attribute(s) kernel_size"),
    ("avgpool-pad", "avg_pool2d", [f64(1, 1, 4, 4)], {"kernel_size": 2, "padding": 2}, "at most half"),
    ("attention-d", "attention", [f64(3, 4), f64(5, 3), f64(5, 2)], {}, "feature size 4 but k has 3"),
    ("attention-lk", "attention", [f64(3, 4), f64(5, 4), f64(6, 2)], {}, "k has 5 keys but v has 6"),
    ("attention-mask-dtype", "attention", [f64(3, 4), f64(5, 4), f64(5, 2), f64(3, 5)], {}, "must be boolean"),
    ("attention-mask-shape", "attention", [f64(3, 4), f64(5, 4), f64(5, 2), b_(3, 4)], {}, "(3, 5)"),
]


@pytest.mark.parametrize(
    ("name", "operands", "attrs", "needle"), [f[1:] for f in FAILURES], ids=[f[0] for f in FAILURES]
)
def test_record_failure(name: str, operands: list[np.ndarray], attrs: dict[str, Any], needle: str) -> None:
    t = tfl.Tape.empty()
    ids = []
    for x in operands:
        t, i = tfl.leaf(t, jnp.asarray(x), requires_grad=True)
        ids.append(i)
    n = len(t)
    t2, r = tfl.record(t, name, ids, **attrs)
    assert t2 is t and len(t2) == n
    assert isinstance(r, tfl.Err)
    assert r.error.startswith(f"{name}: "), r.error
    for x in operands:
        assert fmt_spec((x.shape, x.dtype)) in r.error, r.error
    assert needle in r.error, r.error


def test_failures_cover_every_family() -> None:
    failing = {f[1] for f in FAILURES}
    for family in (
        {"add", "mul", "div", "exp", "where", "clamp", "sum", "matmul", "linear", "astype", "lt"},
        {"reshape", "transpose", "permute", "broadcast_to", "expand_dims", "squeeze", "concat", "index"},
        {"take", "gather", "scatter_add"},
        {"softmax", "log_softmax", "logsumexp", "layer_norm", "cross_entropy", "mse"},
        {"conv2d", "max_pool2d", "avg_pool2d", "attention"},
    ):
        assert family <= failing, family - failing


# --------------------------------------------------------------------------- op-specific behaviour


def test_normalize_index() -> None:
    assert normalize_index(2) == (2,)
    assert normalize_index(np.int64(2)) == (2,)
    assert normalize_index(None) == (None,)
    assert normalize_index(...) == (Ellipsis,)
    assert normalize_index(slice(1, None, 2)) == (("slice", 1, None, 2),)
    n = normalize_index((0, slice(None, 3), None, Ellipsis))
    assert n == (0, ("slice", None, 3, None), None, Ellipsis)
    assert normalize_index(n) == n
    assert normalize_index(("slice", 0, 2, None)) == (("slice", 0, 2, None),)
    hash(n)
    for bad in (np.array([0, 1]), jnp.array([0, 1]), [0, 1], True, 0.5, (0, [1])):
        with pytest.raises(TypeError):
            normalize_index(bad)
    with pytest.raises(IndexError):
        normalize_index((Ellipsis, 0, Ellipsis))
    with pytest.raises(ValueError):
        normalize_index(slice(None, None, 0))


def test_index_raw_and_normalized_agree() -> None:
    x = np.arange(24.0).reshape(2, 3, 4)
    for idx in [(1, slice(None, None, -1)), (Ellipsis, 2), (None, 0, slice(1, 3)), -1]:
        t, i = tfl.leaf(tfl.Tape.empty(), jnp.asarray(x))
        t, a = tfl.record(t, "index", (i,), index=idx)
        t, b = tfl.record(t, "index", (i,), index=normalize_index(idx))
        np.testing.assert_array_equal(t.value(a.value), x[idx])
        np.testing.assert_array_equal(t.value(b.value), x[idx])


def test_take_and_scatter_index_semantics() -> None:
    x = jnp.arange(4.0)
    t, xi = tfl.leaf(tfl.Tape.empty(), x, requires_grad=True)
    t, ii = tfl.leaf(t, jnp.array([-1, 9, -9, 1, 1], jnp.int32))
    t, r = tfl.record(t, "take", (xi, ii))
    np.testing.assert_array_equal(t.value(r.value), [3.0, 3.0, 0.0, 1.0, 1.0])  # wrap, clamp, clamp
    g = tfl.backward(t, r.value, seed=jnp.ones(5))
    np.testing.assert_array_equal(g[xi], [1.0, 2.0, 0.0, 2.0])  # repeats accumulate
    assert ii not in g

    t, ui = tfl.leaf(t, jnp.array([10.0, 20.0, 30.0, 40.0, 50.0]), requires_grad=True)
    t, s = tfl.record(t, "scatter_add", (xi, ii, ui))
    # -1 wraps to 3, 9 and -9 are dropped, 1 is repeated
    np.testing.assert_array_equal(t.value(s.value), [0.0, 1.0 + 40 + 50, 2.0, 3.0 + 10])
    g = tfl.backward(t, s.value, seed=jnp.array([1.0, 2.0, 3.0, 4.0]))
    np.testing.assert_array_equal(g[ui], [4.0, 0.0, 0.0, 2.0, 2.0])
    np.testing.assert_array_equal(g[xi], [1.0, 2.0, 3.0, 4.0])


def test_cross_entropy_bad_label_is_nan() -> None:
    t, lo = tfl.leaf(tfl.Tape.empty(), jnp.zeros((3, 4)), requires_grad=True)
    t, la = tfl.leaf(t, jnp.array([0, 4, -1], jnp.int32))
    t, r = tfl.record(t, "cross_entropy", (lo, la), reduction="none")
    v = np.asarray(t.value(r.value))
    assert np.isclose(v[0], np.log(4.0)) and np.isnan(v[1]) and np.isnan(v[2])
    g = np.asarray(tfl.backward(t, r.value, seed=jnp.ones(3))[lo])
    assert np.all(np.isfinite(g[0])) and np.all(np.isnan(g[1:]))


def test_attention_fully_masked_rows_are_zero_not_nan() -> None:
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 4)), rng.standard_normal((5, 4)), rng.standard_normal((5, 2))
    mask = np.ones((3, 5), bool)
    mask[1] = False
    t = tfl.Tape.empty()
    t, qi = tfl.leaf(t, jnp.asarray(q), requires_grad=True)
    t, ki = tfl.leaf(t, jnp.asarray(k), requires_grad=True)
    t, vi = tfl.leaf(t, jnp.asarray(v), requires_grad=True)
    t, mi = tfl.leaf(t, jnp.asarray(mask))
    t, r = tfl.record(t, "attention", (qi, ki, vi, mi))
    out = np.asarray(t.value(r.value))
    np.testing.assert_array_equal(out[1], 0.0)
    np.testing.assert_allclose(out[[0, 2]], np.asarray(_attention_ref(q[[0, 2]], k, v)), rtol=1e-10)
    g = tfl.backward(t, r.value, seed=jnp.asarray(rng.standard_normal((3, 2))))
    assert set(g) == {qi, ki, vi}
    for a in g.values():
        assert np.all(np.isfinite(np.asarray(a)))
    np.testing.assert_array_equal(np.asarray(g[qi])[1], 0.0)
    # causal on a query longer than the keys: rows past the end keep every key, none is empty
    t, r2 = tfl.record(t, "attention", (qi, ki, vi), causal=True)
    assert np.all(np.isfinite(np.asarray(t.value(r2.value))))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "mask"])
def test_attention_gradient_of_gradient_matches_jax(causal: bool) -> None:
    """The VJP reads the op's output: differentiating it again (create_graph) goes through that output too."""
    rng = np.random.default_rng(3)
    q, k, v, w = (rng.standard_normal((2, 5, 4)) for _ in range(4))
    mask = None
    if not causal:
        mask = rng.random((5, 5)) < 0.6
        mask[:, 0] = True  # no empty row: the reference's softmax would be NaN there
    with tfl.Session() as s:
        xs = [s.input(a, requires_grad=True) for a in (q, k, v)]
        out = tfl.attention(*xs, *(() if mask is None else (mask,)), causal=causal)
        gq = s.backward(tfl.sum(tfl.sin(out) * w), create_graph=True)[xs[0]]
        grads = s.backward(tfl.sum(gq * gq))
        got = [np.asarray(grads[x]) for x in xs]

    def loss(q: Any, k: Any, v: Any) -> Any:
        return jnp.sum(jnp.sin(_attention_ref(q, k, v, mask, causal=causal)) * w)

    want = jax.grad(lambda q, k, v: jnp.sum(jax.grad(loss)(q, k, v) ** 2), (0, 1, 2))(q, k, v)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, np.asarray(r), rtol=1e-9, atol=1e-12)


EXACT: list[tuple[str, int, dict[str, Any], Callable[..., Any]]] = [
    ("reshape", 1, {"shape": (3, 2)}, lambda x: x.reshape(3, 2)),
    ("transpose", 1, {}, lambda x: x.T),
    ("permute", 1, {"axes": (1, 0)}, lambda x: x.transpose(1, 0)),
    ("broadcast_to", 1, {"shape": (2, 2, 3)}, lambda x: np.broadcast_to(x, (2, 2, 3))),
    ("expand_dims", 1, {"axis": 1}, lambda x: x[:, None]),
    ("squeeze", 1, {}, lambda x: x),
    ("concat", 2, {"axis": 1}, lambda x, y: np.concatenate([x, y], axis=1)),
    ("index", 1, {"index": (slice(None, None, -1), 1)}, lambda x: x[::-1, 1]),
]


@pytest.mark.parametrize(("name", "arity", "attrs", "np_fn"), EXACT, ids=[e[0] for e in EXACT])
def test_shape_ops_are_exact_on_rationals(
    name: str, arity: int, attrs: dict[str, Any], np_fn: Callable[..., Any]
) -> None:
    def frac(k: int) -> np.ndarray:
        a = np.empty((2, 3), dtype=object)
        a[...] = [[Fraction(i + k, 3 + i * j) for j in range(3)] for i in range(2)]
        return a

    xs = [frac(k) for k in range(arity)]
    t = tfl.Tape.empty()
    ids = []
    for x in xs:
        t, i = tfl.leaf(t, x, requires_grad=True)
        ids.append(i)
    t, r = tfl.record(t, name, ids, **attrs)
    assert r.is_ok, r.error
    out = t.value(r.value)
    want = np_fn(*xs)
    assert out.dtype == object and out.shape == want.shape
    assert (out == want).all()
    seed = np.array([Fraction(k + 1, 7) for k in range(out.size)], dtype=object).reshape(out.shape)
    g = tfl.backward(t, r.value, seed=seed)
    # <seed, f(x)> is linear in x: the cotangent of each x is exact and f^T(seed)
    for i, x in zip(ids, xs):
        assert g[i].shape == x.shape and g[i].dtype == object
    total = sum(Fraction(s) * Fraction(o) for s, o in zip(seed.ravel(), out.ravel()))
    assert sum(Fraction(a) * Fraction(b) for i, x in zip(ids, xs) for a, b in zip(g[i].ravel(), x.ravel())) == total


# --------------------------------------------------------------------------- generated op functions (tfl.<op>)

PUBLIC = [name for name in tfl.ops() if tfl.REGISTRY[name].public]
PUBLIC_CASES = [(name, case) for name, case in ALL if tfl.REGISTRY[name].public]


def _torch_functions() -> dict[str, Callable[..., Any]]:
    """``tfl.<name>`` bound from the PyTorch surface table (its names and aliases), by name."""
    from tapeflow._shell._surface import entries

    return {n: e.fn for name, e in entries("tfl").items() for n in (name, *e.aliases)}


def test_public_op_functions_exist_and_are_exported() -> None:
    torch_fns = _torch_functions()
    for name in tfl.ops():
        d = tfl.REGISTRY[name]
        assert hasattr(_functions, name) == d.public, name
        if not d.public:
            assert not hasattr(tfl, name), name
            continue
        for alias in d.aliases:
            assert getattr(_functions, alias) is getattr(_functions, name)
        for n in (name, *d.aliases):
            # tfl.<n> is the op's generated function unless PyTorch has the name: then the table's entry
            assert getattr(tfl, n) is torch_fns.get(n, getattr(_functions, n)), n
    assert set(_functions.__all__) <= set(tfl.__all__)
    aliases = {a for n in PUBLIC for a in tfl.REGISTRY[n].aliases}
    assert set(_functions.__all__) == set(PUBLIC) | aliases | {"dropout"}
    with tfl.Session() as s:  # every op stays reachable by name, whatever tfl.<name> means
        x = s.input(jnp.ones((2, 3)))
        assert tfl.apply("transpose", x, axes=(1, 0)).shape == (3, 2)
        assert tfl.apply("max", x, axis=1).shape == (2,)


HAND_WRITTEN = {"attention": ("dropout", "training")}
"""Op functions written by hand (to draw a random operand): their extra keyword-only parameters."""


@pytest.mark.parametrize("name", PUBLIC)
def test_op_function_signature_matches_opdef(name: str) -> None:
    import inspect

    from tapeflow._core._registry import REQUIRED

    d = tfl.REGISTRY[name]
    f = getattr(_functions, name)  # tfl.<name> may be PyTorch's function of that name
    assert (f.__name__, f.__qualname__, f.__module__) == (name, name, "tapeflow")
    assert f.__doc__ and f"``{name}``" in f.__doc__
    assert f.__doc__.startswith(d.doc.rstrip(".")), "an op function's summary starts with its op's"
    params = list(inspect.signature(f).parameters.values())
    if name in HAND_WRITTEN:  # the op's operands and attributes (a drawn operand left out), then its own keywords
        extra = HAND_WRITTEN[name]
        assert [p.name for p in params[-len(extra) :]] == list(extra)
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[-len(extra) :])
        drawn = [n for n in d.optional_operands if n not in {p.name for p in params}]
        assert drawn == ["keep"]
        params = params[: -len(extra)]
        d_operands = [n for n in d.operands if n not in drawn]
        d_defaults = {k: v for k, v in d.defaults.items() if k not in extra}
        assert [p.name for p in params] == [*d_operands, *d_defaults]
        for p in params:
            assert p.default == d_defaults.get(
                p.name, None if p.name in d.optional_operands else inspect.Parameter.empty
            )
        return
    # then PyTorch's dim= / keepdim=, keyword only, for an axis / keepdims attribute that has a default
    torch_names = [
        t for n, t in (("axis", "dim"), ("keepdims", "keepdim")) if d.defaults.get(n, REQUIRED) is not REQUIRED
    ]
    assert [p.name for p in params] == [*d.operands, *d.defaults, *torch_names]
    empty = inspect.Parameter.empty
    for p in params[: len(d.operands)]:
        assert p.default is (None if p.name in d.optional_operands else empty), p
        assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    for p in params[len(d.operands) : len(params) - len(torch_names)]:
        want = d.defaults[p.name]
        assert p.default is empty if want is REQUIRED else p.default == want, p
        assert p.annotation == d.attr_types[p.name]
    for p in params[len(params) - len(torch_names) :]:
        assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is None, p


@pytest.mark.parametrize(("name", "case"), PUBLIC_CASES, ids=_ids(PUBLIC_CASES))
def test_op_function_records_its_op(name: str, case: Case) -> None:
    xs = [g(_rng(name, case.id)) for g in case.inputs]
    t, _, out = _run(name, xs, case.attrs)
    with tfl.Session() as s:
        hs = [s.input(jnp.asarray(x)) for x in xs]
        f = getattr(_functions, name)
        h = f(hs, **case.attrs) if tfl.REGISTRY[name].variadic else f(*hs, **case.attrs)
        assert h.op == name
        assert h.node.parents == tuple(x.id for x in hs)
        np.testing.assert_array_equal(np.asarray(h.value), np.asarray(t.value(out)))


def test_op_functions_normalize_attributes_once() -> None:
    from tapeflow._core._registry import normalize_attrs

    assert normalize_attrs({"b": [1, [2, 3]], "a": slice(None, 2), "dtype": "float32"}) == (
        ("a", ("slice", None, 2, None)),
        ("b", (1, (2, 3))),
        ("dtype", np.dtype("float32")),
    )
    assert normalize_attrs({"dtype": "nope"}) == (("dtype", "nope"),)  # the op's check reports it
    with tfl.Session() as s:
        x = s.input(jnp.ones((2, 3, 4)))
        assert dict(tfl.sum(x, axis=[0, 2]).node.attrs)["axis"] == (0, 2)
        assert dict(tfl.astype(x, "float32").node.attrs)["dtype"] == np.dtype("float32")
        y = tfl.apply("conv2d", jnp.ones((1, 1, 4, 4)), jnp.ones((1, 1, 2, 2)), padding=[[1, 0], [0, 1]])
        assert dict(y.node.attrs)["padding"] == ((1, 0), (0, 1))
    t, a = tfl.leaf(tfl.Tape.empty(), jnp.ones(3))
    t, r = tfl.record(t, "astype", (a,), dtype=jnp.float32)
    assert r.is_ok and dict(t[r.value].attrs)["dtype"] == np.dtype("float32")


def test_op_function_operand_rules() -> None:
    with tfl.Session() as s:
        x, b = s.input(jnp.ones((2, 4))), s.input(jnp.zeros(4))
        # the registry's generated functions (tfl.layer_norm and tfl.linear are PyTorch's now)
        assert _functions.layer_norm(x, b).node.parents == (x.id, b.id)  # weight alone
        with pytest.raises(tfl.TapeError, match="layer_norm: bias needs weight"):
            _functions.layer_norm(x, bias=b)
        assert _functions.linear(x, jnp.ones((4, 3)), None).node.parents[0] == x.id
        assert len(_functions.linear(x, jnp.ones((4, 3)), jnp.ones(3)).node.parents) == 3
        assert tfl.concat((h for h in (x, x)), axis=0).shape == (4, 4)  # any iterable
        with pytest.raises(TypeError, match="cat: tensors must be a sequence of tensors"):
            tfl.concat(x)
        with pytest.raises(TypeError):
            tfl.reshape(x)  # a required attribute has no default


def test_op_registration_reads_and_checks_the_forward_signature() -> None:
    from tapeflow._core._registry import op

    def two(x: Any, y: Any = None, *, k: int) -> Any:
        return x

    with pytest.raises(ValueError, match="arity=1 disagrees"):
        op("_test_bad_arity", arity=1, attrs={"k": 0})(two)
    with pytest.raises(ValueError, match="takes no attribute"):
        op("_test_missing_attr", attrs={"k": 0, "j": 1})(two)
    with pytest.raises(ValueError, match=r"neither|not an attribute"):
        op("_test_unknown_kw")(two)
    with pytest.raises(ValueError, match="may only default to None"):
        op("_test_default")(lambda x, y=1: x)
    assert not any(n.startswith("_test_") for n in tfl.REGISTRY)  # a rejected op is not registered
