"""Elementwise, reduction and matrix ops of the registry.

Each op is one block: the forward (decorated with :func:`~tapeflow._core._registry.op`),
its VJP (``@<op>.defvjp``) and its check (``check=`` argument). Ops marked
``exact=True`` also run on exact rational (object) arrays through NumPy.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import DTypeLike

from .._core._checks import (
    as_dtype,
    axes_error,
    bool_error,
    broadcast,
    float_operands,
    is_number,
    norm_axes,
    same_dtype,
)
from .._core._registry import REQUIRED, Axes, OpPrecision, Spec, broadcast_shapes, op, unbroadcast, xp_of
from .._core._typing import Array

# --------------------------------------------------------------------------- checks


def binary_check(specs: tuple[Spec, ...], **_: object) -> str | None:
    """Same dtype and broadcastable shapes."""
    return same_dtype(specs) or broadcast(specs)


def binary_float_check(specs: tuple[Spec, ...], **_: object) -> str | None:
    return float_operands(specs) or binary_check(specs)


def _reduce_check(specs: tuple[Spec, ...], axis: object = None, keepdims: object = False) -> str | None:
    return axes_error(axis, len(specs[0][0]), none_ok=True) or bool_error("keepdims", keepdims)


# --------------------------------------------------------------------------- arithmetic


@op("add", arity=2, exact=True, check=binary_check)
def add(x: Array, y: Array) -> Array:
    """Elementwise ``x + y`` with broadcasting."""
    return x + y


@add.defvjp
def _add_vjp(g: Array, out: Array, x: Array, y: Array) -> tuple[Array, Array]:
    return unbroadcast(g, x.shape), unbroadcast(g, y.shape)


@op("sub", arity=2, exact=True, check=binary_check)
def sub(x: Array, y: Array) -> Array:
    """Elementwise ``x - y`` with broadcasting."""
    return x - y


@sub.defvjp
def _sub_vjp(g: Array, out: Array, x: Array, y: Array) -> tuple[Array, Array]:
    return unbroadcast(g, x.shape), unbroadcast(-g, y.shape)


@op("mul", arity=2, exact=True, check=binary_check)
def mul(x: Array, y: Array) -> Array:
    """Elementwise ``x * y`` with broadcasting."""
    return x * y


@mul.defvjp
def _mul_vjp(g: Array, out: Array, x: Array, y: Array) -> tuple[Array, Array]:
    return unbroadcast(g * y, x.shape), unbroadcast(g * x, y.shape)


@op("div", arity=2, exact=True, check=binary_float_check)
def div(x: Array, y: Array) -> Array:
    """Elementwise ``x / y`` with broadcasting (floating operands)."""
    return x / y


@div.defvjp
def _div_vjp(g: Array, out: Array, x: Array, y: Array) -> tuple[Array, Array]:
    gx = g / y
    return unbroadcast(gx, x.shape), unbroadcast(-gx * out, y.shape)


@op("neg", arity=1, exact=True)
def neg(x: Array) -> Array:
    """Elementwise ``-x``."""
    return -x


@neg.defvjp
def _neg_vjp(g: Array, out: Array, x: Array) -> tuple[Array]:
    return (-g,)


@op("pow", arity=2, check=binary_float_check, precision="float32")
def pow(x: Array, y: Array) -> Array:
    """Elementwise ``x ** y``; the gradient wrt ``y`` uses ``log(x)`` where ``x > 0``."""
    return x**y


@pow.defvjp
def _pow_vjp(g: Array, out: Array, x: Array, y: Array) -> tuple[Array, Array]:
    gx = g * y * jnp.where(y == 0, 1.0, x ** jnp.where(y == 0, 1.0, y - 1)).astype(x.dtype)
    safe = jnp.where(x > 0, x, 1.0)
    gy = g * jnp.where(x > 0, out * jnp.log(safe), 0.0).astype(out.dtype)
    return unbroadcast(gx, x.shape), unbroadcast(gy, y.shape)


def _select_vjp(g: Array, x: Array, y: Array, x_wins: Array, y_wins: Array) -> tuple[Array, Array]:
    """VJP of an elementwise pick of ``x`` or ``y``: ``g`` to the winner, half to each side on a tie (as ``jax.grad``)."""
    xp = xp_of(g)
    tie = xp.where(x == y, g / 2, 0 * g)
    return unbroadcast(xp.where(x_wins, g, tie), x.shape), unbroadcast(xp.where(y_wins, g, tie), y.shape)


@op("maximum", arity=2, exact=True, check=binary_check)
def maximum(x: Array, y: Array) -> Array:
    """Elementwise maximum; ties send half the gradient to each side (as ``jax.grad``)."""
    return xp_of(x).maximum(x, y)


@maximum.defvjp
def _maximum_vjp(g: Array, out: Array, x: Array, y: Array) -> tuple[Array, Array]:
    return _select_vjp(g, x, y, x > y, y > x)


@op("minimum", arity=2, exact=True, check=binary_check)
def minimum(x: Array, y: Array) -> Array:
    """Elementwise minimum; ties send half the gradient to each side (as ``jax.grad``)."""
    return xp_of(x).minimum(x, y)


@minimum.defvjp
def _minimum_vjp(g: Array, out: Array, x: Array, y: Array) -> tuple[Array, Array]:
    return _select_vjp(g, x, y, x < y, y < x)


def _where_check(specs: tuple[Spec, ...], **_: object) -> str | None:
    if specs[0][1] != np.dtype(bool):
        return f"condition #0 must be boolean, got {specs[0][1]}; build it with a comparison such as x > 0"
    return binary_check(specs[1:]) or broadcast(specs)


@op("where", arity=3, nondiff=(0,), exact=True, check=_where_check)
def where(cond: Array, x: Array, y: Array) -> Array:
    """``x`` where ``cond`` else ``y`` (``cond`` boolean, no gradient)."""
    return xp_of(x).where(cond, x, y)


@where.defvjp
def _where_vjp(g: Array, out: Array, cond: Array, x: Array, y: Array) -> tuple[Array, Array, Array]:
    xp = xp_of(g)
    z = 0 * g
    return None, unbroadcast(xp.where(cond, g, z), x.shape), unbroadcast(xp.where(cond, z, g), y.shape)


# --------------------------------------------------------------------------- unary math


def _unary(
    name: str,
    fwd: Callable[[Array], Array],
    deriv: Callable[[Array, Array], Array],
    doc: str,
    precision: OpPrecision = "compute",
) -> None:
    """Register a float unary op whose VJP is ``g * deriv(x, out)``."""

    def f(x: Array) -> Array:
        return fwd(x)

    f.__doc__ = doc
    d = op(name, arity=1, check=float_operands, precision=precision)(f)

    def vjp(g: Array, out: Array, x: Array) -> tuple[Array]:
        return ((g * deriv(x, out)).astype(g.dtype),)

    d.defvjp(vjp)


def _softplus_deriv(x: Array, out: Array) -> Array:
    return jax.nn.sigmoid(x)


# exp, log, softplus and pow compute in float32 under a policy, as on torch.autocast's float32 list:
# in bfloat16, log(1.001) is 0 and exp loses all but 3 significant digits
_unary("exp", jnp.exp, lambda x, out: out, "Elementwise exponential.", "float32")
_unary("log", jnp.log, lambda x, out: 1 / x, "Elementwise natural logarithm.", "float32")
_unary("sqrt", jnp.sqrt, lambda x, out: 0.5 / out, "Elementwise square root.")
_unary("sin", jnp.sin, lambda x, out: jnp.cos(x), "Elementwise sine.")
_unary("cos", jnp.cos, lambda x, out: -jnp.sin(x), "Elementwise cosine.")
_unary("tanh", jnp.tanh, lambda x, out: 1 - out * out, "Elementwise hyperbolic tangent.")
_unary("sigmoid", jax.nn.sigmoid, lambda x, out: out * (1 - out), "Elementwise logistic sigmoid.")
_unary("softplus", jax.nn.softplus, _softplus_deriv, "Elementwise ``log(1 + exp(x))``.", "float32")
_unary("abs", jnp.abs, lambda x, out: jnp.sign(x), "Elementwise absolute value (gradient sign(x), 0 at 0).")


def _gelu_tanh(approximate: object) -> bool:
    """True for the tanh form (``"tanh"``, or ``True`` as in ``jax.nn.gelu``), False for the exact one."""
    return approximate is True or approximate == "tanh"


def _gelu_check(specs: tuple[Spec, ...], approximate: object = "none") -> str | None:
    if err := float_operands(specs):
        return err
    if isinstance(approximate, (bool, np.bool_)) or (isinstance(approximate, str) and approximate in ("none", "tanh")):
        return None
    return f"attribute approximate={approximate!r} must be 'none' (exact erf form) or 'tanh', as in PyTorch"


@op("gelu", arity=1, attrs={"approximate": "none"}, check=_gelu_check)
def gelu(x: Array, approximate: str | bool) -> Array:
    """Elementwise GELU: exact ``x * Phi(x)`` (``approximate="none"``, the default, as in PyTorch) or its tanh form.

    ``approximate="tanh"`` (or ``True``, ``jax.nn.gelu``'s default) is
    ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))``, GPT-2's form.
    """
    return jax.nn.gelu(x, approximate=_gelu_tanh(approximate))


@gelu.defvjp
def _gelu_vjp(g: Array, out: Array, x: Array, approximate: str | bool) -> tuple[Array]:
    if _gelu_tanh(approximate):
        c = jnp.sqrt(2 / jnp.pi).astype(x.dtype)
        x2 = x * x
        t = jnp.tanh(c * (x + 0.044715 * x2 * x))
        d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x2)
    else:
        phi = jnp.exp(-0.5 * x * x) / jnp.sqrt(2 * jnp.pi).astype(x.dtype)
        cdf = 0.5 * (1 + jax.lax.erf(x / jnp.sqrt(2.0).astype(x.dtype)))
        d = cdf + x * phi
    return ((g * d).astype(g.dtype),)


@op("relu", arity=1, exact=True, check=float_operands)
def relu(x: Array) -> Array:
    """Elementwise ``max(x, 0)`` (NaN propagates, as in ``jax.nn.relu``); the gradient at 0 is 0."""
    if xp_of(x) is np:  # exact rationals
        return np.where(x > 0, x, np.asarray(Fraction(0), dtype=object))
    return jnp.maximum(x, jnp.zeros((), x.dtype))


@relu.defvjp
def _relu_vjp(g: Array, out: Array, x: Array) -> tuple[Array]:
    xp = xp_of(g)
    return (xp.where(x > 0, g, 0 * g),)


def _clamp_check(specs: tuple[Spec, ...], lo: object = None, hi: object = None) -> str | None:
    if err := float_operands(specs):
        return err
    for name, v in (("lo", lo), ("hi", hi)):
        if v is not None and not is_number(v):
            return f"attribute {name} must be a number or None, got {v!r}"
        if v is not None and v != v:
            return f"attribute {name}={v!r} is NaN; give a number (an infinite bound is allowed) or None for no bound"
    if is_number(lo) and is_number(hi) and lo > hi:
        return f"lo={lo} is greater than hi={hi}"
    return None


@op("clamp", arity=1, attrs={"lo": None, "hi": None}, check=_clamp_check, runtime=("lo", "hi"))
def clamp(x: Array, lo: float | None, hi: float | None) -> Array:
    """Clip ``x`` to ``[lo, hi]`` (either bound may be None); gradient passes inside the range."""
    return jnp.clip(x, lo, hi)


@clamp.defvjp
def _clamp_vjp(
    g: Array, out: Array, x: Array, lo: float | jax.Array | None, hi: float | jax.Array | None
) -> tuple[Array]:
    inside = jnp.ones(x.shape, bool)
    if lo is not None:
        inside = inside & (x >= lo)
    if hi is not None:
        inside = inside & (x <= hi)
    return (jnp.where(inside, g, 0.0).astype(g.dtype),)


@op("stop_gradient", arity=1, exact=True, precision="layout", tangent=False)
def stop_gradient(x: Array) -> Array:
    """Identity whose output never carries a gradient to ``x``."""
    return x


@stop_gradient.defvjp
def _stop_gradient_vjp(g: Array, out: Array, x: Array) -> tuple[Array]:
    return (0 * g,)


def _astype_check(specs: tuple[Spec, ...], dtype: object) -> str | None:
    return f"attribute dtype={dtype!r} is not a dtype" if as_dtype(dtype) is None else None


@op("astype", arity=1, attrs={"dtype": REQUIRED}, check=_astype_check, precision="layout")
def astype(x: Array, dtype: DTypeLike) -> Array:
    """Cast to ``dtype``; the gradient is cast back (none flows into integer inputs)."""
    return x.astype(dtype)


@astype.defvjp
def _astype_vjp(g: Array, out: Array, x: Array, dtype: DTypeLike) -> tuple[Array]:
    return (g.astype(x.dtype),)


def _cmp(name: str, symbol: str, fn: Callable[[Array, Array], Array]) -> None:
    def f(x: Array, y: Array) -> Array:
        return fn(x, y)

    f.__doc__ = f"Elementwise comparison ``x {symbol} y`` with broadcasting (boolean result, no gradient)."
    op(name, arity=2, exact=True, check=binary_check)(f)


_cmp("lt", "<", lambda x, y: x < y)
_cmp("le", "<=", lambda x, y: x <= y)
_cmp("gt", ">", lambda x, y: x > y)
_cmp("ge", ">=", lambda x, y: x >= y)
_cmp("eq", "==", lambda x, y: x == y)
_cmp("ne", "!=", lambda x, y: x != y)


# --------------------------------------------------------------------------- reductions


def _expand(g: Array, shape: tuple[int, ...], axis: Axes | None, keepdims: bool) -> Array:
    """Reshape a reduced cotangent so it broadcasts against the input of ``shape``."""
    if keepdims:
        return g
    axes = norm_axes(axis, len(shape))
    kshape = tuple(1 if i in axes else s for i, s in enumerate(shape))
    return xp_of(g).reshape(g, kshape)


@op("sum", arity=1, attrs={"axis": None, "keepdims": False}, exact=True, check=_reduce_check, precision="float32")
def sum_(x: Array, axis: Axes | None, keepdims: bool) -> Array:
    """Sum over ``axis`` (an int, a tuple, or None for all)."""
    return xp_of(x).sum(x, axis=axis, keepdims=keepdims)


@sum_.defvjp
def _sum_vjp(g: Array, out: Array, x: Array, axis: Axes | None, keepdims: bool) -> tuple[Array]:
    xp = xp_of(g)
    return (xp.broadcast_to(_expand(g, x.shape, axis, keepdims), x.shape),)


@op("mean", arity=1, attrs={"axis": None, "keepdims": False}, exact=True, check=_reduce_check, precision="float32")
def mean(x: Array, axis: Axes | None, keepdims: bool) -> Array:
    """Mean over ``axis`` (an int, a tuple, or None for all)."""
    xp = xp_of(x)
    if xp is np:
        count = int(np.prod([x.shape[a] for a in norm_axes(axis, x.ndim)], dtype=np.int64))
        return np.sum(x, axis=axis, keepdims=keepdims) / count
    return jnp.mean(x, axis=axis, keepdims=keepdims)


@mean.defvjp
def _mean_vjp(g: Array, out: Array, x: Array, axis: Axes | None, keepdims: bool) -> tuple[Array]:
    xp = xp_of(g)
    count = int(np.prod([x.shape[a] for a in norm_axes(axis, x.ndim)], dtype=np.int64))
    return (xp.broadcast_to(_expand(g, x.shape, axis, keepdims), x.shape) / count,)


@op("max", arity=1, attrs={"axis": None, "keepdims": False}, check=_reduce_check)
def max_(x: Array, axis: Axes | None, keepdims: bool) -> Array:
    """Maximum over ``axis``; ties share the gradient equally (as ``jax.grad``)."""
    return jnp.max(x, axis=axis, keepdims=keepdims)


@max_.defvjp
def _max_vjp(g: Array, out: Array, x: Array, axis: Axes | None, keepdims: bool) -> tuple[Array]:
    o = _expand(out, x.shape, axis, keepdims)
    gg = _expand(g, x.shape, axis, keepdims)
    hit = (x == o).astype(g.dtype)
    count = jnp.sum(hit, axis=norm_axes(axis, x.ndim), keepdims=True)
    return (hit * gg / count,)


# --------------------------------------------------------------------------- matrix products


def _matmul_check(specs: tuple[Spec, ...], **_attrs: object) -> str | None:
    (a, _), (b, _) = specs
    if err := same_dtype(specs):
        return err
    if len(a) == 0 or len(b) == 0:
        return "matmul needs operands of rank >= 1, got a scalar"
    k1 = a[-1]
    k2 = b[-2] if len(b) >= 2 else b[0]
    if k1 != k2:
        return f"contracting dimensions differ: {a} @ {b} contracts {k1} with {k2}"
    if (len(a) > 2 or len(b) > 2) and broadcast_shapes(
        a[:-2] if len(a) >= 2 else (), b[:-2] if len(b) >= 2 else ()
    ) is None:
        return f"batch dimensions of {a} and {b} do not broadcast"
    return None


@op("matmul", arity=2, exact=True, check=_matmul_check)
def matmul(x: Array, y: Array) -> Array:
    """Matrix product with NumPy semantics (batching and broadcasting of leading dims)."""
    return x @ y


def _contract(a: Array, b: Array, a_axes: tuple[int, ...], b_axes: tuple[int, ...]) -> Array:
    """``a`` and ``b`` contracted over the given axes, with no transposed copy of either (``lax.dot_general``).

    A VJP written ``x.T @ g`` makes XLA materialize ``x.T`` first; ``dot_general`` reads both operands as they
    are. The result's axes are ``a``'s free axes, then ``b``'s.
    """
    return jax.lax.dot_general(a, b, ((a_axes, b_axes), ((), ())))


@matmul.defvjp
def _matmul_vjp(g: Array, out: Array, x: Array, y: Array) -> tuple[Array, Array]:
    xp = xp_of(g)
    if xp is jnp and x.ndim == 2 and y.ndim == 2:  # (m, k) @ (k, n): g (m, n)
        return _contract(g, y, (1,), (1,)), _contract(x, g, (0,), (0,))
    if x.ndim == 1 and y.ndim == 1:  # inner product: g is a scalar
        return g * y, g * x
    x2 = x if x.ndim > 1 else x[None, :]
    y2 = y if y.ndim > 1 else y[:, None]
    g2 = g
    if x.ndim == 1:
        g2 = xp.expand_dims(g2, -2)
    if y.ndim == 1:
        g2 = xp.expand_dims(g2, -1)
    gx = g2 @ xp.swapaxes(y2, -1, -2)
    gy = xp.swapaxes(x2, -1, -2) @ g2
    if x.ndim == 1:
        gx = xp.reshape(unbroadcast(gx, (1,) + tuple(x.shape)), x.shape) if gx.ndim > 2 else gx[..., 0, :]
    if y.ndim == 1:
        gy = xp.reshape(unbroadcast(gy, tuple(y.shape) + (1,)), y.shape) if gy.ndim > 2 else gy[..., :, 0]
    return unbroadcast(gx, x.shape), unbroadcast(gy, y.shape)


def _linear_check(specs: tuple[Spec, ...], **_: object) -> str | None:
    if err := float_operands(specs) or same_dtype(specs):
        return err
    x, w = specs[0][0], specs[1][0]
    if len(x) < 1 or len(w) != 2:
        return f"linear expects x of rank >= 1 and w of shape (in, out); got x{x}, w{w}"
    if x[-1] != w[0]:
        return f"x has {x[-1]} features but w expects {w[0]} (w shape (in, out) = {w})"
    if len(specs) == 3 and specs[2][0] not in ((w[1],), ()):
        return f"bias must have shape ({w[1]},), got {specs[2][0]}"
    return None


@op("linear", arity=(2, 3), check=_linear_check)
def linear(x: Array, w: Array, b: Array = None) -> Array:
    """``x @ w + b`` with ``w`` of shape ``(in, out)`` and an optional bias ``b`` of shape ``(out,)``."""
    y = x @ w
    return y if b is None else y + b


@linear.defvjp
def _linear_vjp(g: Array, out: Array, x: Array, w: Array, b: Array = None) -> tuple[Array, ...]:
    gx = _contract(g, w, (g.ndim - 1,), (1,))  # g @ w.T
    lead = tuple(range(x.ndim - 1))
    gw = _contract(x, g, lead, lead)  # x.T @ g over every leading axis: (in, out)
    if b is None:
        return gx, gw
    return gx, gw, unbroadcast(g, b.shape)
