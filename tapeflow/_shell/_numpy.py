"""``tfl.numpy``: the differentiable functions of ``jax.numpy`` (and of ``jax.numpy.linalg``, some of ``jax.nn`` and ``jax.scipy.special``) on tapes.

Each function here mirrors the ``jax.numpy`` function of the same name and
takes the same arguments: arrays (Tensors, Params, arrays, Python numbers) as
operands, Python values (ints, tuples, strings, dtypes, None) as static
arguments. Called with at least one Tensor or Param it records an op on that
session; called on plain arrays it is the ``jax.numpy`` function itself.

Where tapeflow has a built-in op for the same call (``add``, ``exp``, ``sum``
with ``axis``/``keepdims``, ``reshape``, ``matmul``, ...) the built-in op is
recorded (its hand-written VJP and its name); otherwise the function is
:func:`~tapeflow.lift` ed on first use, as op ``"tfl.numpy.<name>"`` (forward
``jax.jit``, VJP ``jax.vjp``, kernels cached per shapes and static arguments,
shape errors at record time). Integer and boolean results (``argmax``, ``less``,
``isnan``) are recorded as non-differentiable nodes.

The supported functions are listed once, in the tables ``_NUMPY``, ``_NN``,
``_SPECIAL`` and ``_LINALG`` below; functions whose output shape depends on the
data cannot be recorded and are named in :data:`UNSUPPORTED` with the reason (so
are the data-dependent forms of supported ones: ``where`` takes exactly three
operands, never the one-argument ``nonzero`` form). The ``jax.nn``,
``jax.scipy.special`` and ``jax.numpy.linalg`` mirrors are the namespaces
:data:`nn`, :data:`special` and :data:`linalg` (and the dicts :data:`NN`,
:data:`SPECIAL`, :data:`LINALG`; the linalg functions left out are in
:data:`LINALG_UNSUPPORTED`). A function with several results (``slogdet``,
``qr``, ``svd``, ``eigh``) returns jax's named tuple of Tensors, one node each.

>>> import jax.numpy as jnp, tapeflow as tfl
>>> from tapeflow._shell import _numpy as tnp
>>> with tfl.Session() as s:
...     x = s.input(jnp.array([1.0, 2.0, 3.0]), requires_grad=True)
...     y = tnp.cumsum(x)
...     g = s.backward(tnp.sum(y))
...     y.value.tolist(), g[x].tolist()
([1.0, 3.0, 6.0], [3.0, 2.0, 1.0])
>>> tnp.cumsum(jnp.array([1.0, 2.0])).tolist()  # plain arrays: just jax.numpy
[1.0, 3.0]
>>> with tfl.Session() as s:
...     a = s.input(jnp.array([[3.0, 0.0], [4.0, 2.0]]), requires_grad=True)
...     n = tfl.numpy.linalg.norm(a, axis=0)  # the columns' Euclidean norms
...     sign, logdet = tfl.numpy.linalg.slogdet(a)
...     g = s.backward(tfl.sum(n))
...     n.value.tolist(), round(float(logdet.value), 4), [[round(v, 4) for v in r] for r in g[a].tolist()]
([5.0, 2.0], 1.7918, [[0.6, 0.0], [0.8, 1.0]])
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeAlias, TypeGuard, cast

import jax
import jax.numpy as jnp
import jax.scipy.special as jsp

from .._core import _registry as R
from .._core._result import TapeError
from .._core._typing import PyTree
from ._extend import lift
from ._params import Param
from ._tensor import Operand, Tensor, apply

_P = inspect.Parameter
_HANDLES = (Tensor, Param)
_PREFIX = "tfl.numpy."  # op names: "tfl.numpy.cumsum" (apart from "jax.numpy.cumsum", tfl.lift(jnp.cumsum)'s default)
_PRESENT = "present"  # the static of an op with optional operands: which of them the call gave

Operands: TypeAlias = "list[Operand | None]"
"""A call's operands, one per declared operand (None where an optional one is left out)."""

Statics: TypeAlias = dict[str, object]
"""Static arguments by name (a call's, lists frozen to tuples, or a function's defaults): ints, tuples, strings,
dtypes, None."""

Builtin: TypeAlias = Callable[[Operands, Statics], Tensor | None]
"""``builtin(operands, statics) -> Tensor | None``: the built-in op for this call, or None where it does not fit.

``operands`` has one entry per declared operand (None where an optional one is left out), ``statics`` only
the static arguments the call gave with a value other than the ``jax.numpy`` default."""


# --------------------------------------------------------------------------- built-in ops that fit a call


def _all_given(ops: Operands) -> TypeGuard[list[Operand]]:
    return all(o is not None for o in ops)


def _required(ops: Operands) -> list[Operand]:
    """The operands of a function whose table row declares none optional: the call gave every one."""
    return cast("list[Operand]", ops)


def _same(opname: str) -> Builtin:
    """The built-in op ``opname`` on all operands, when no static argument is given."""

    def use(ops: Operands, kw: Statics) -> Tensor | None:
        if kw or not _all_given(ops):
            return None
        return apply(opname, *ops)

    return use


def _keywords(opname: str, allowed: Mapping[str, str]) -> Builtin:
    """The built-in op on one operand, when the given statics are among ``allowed`` (jnp name -> op attribute)."""

    def use(ops: Operands, kw: Statics) -> Tensor | None:
        if any(k not in allowed for k in kw) or not _all_given(ops):
            return None
        return apply(opname, *ops, **{allowed[k]: v for k, v in kw.items()})

    return use


def _clip(ops: Operands, kw: Statics) -> Tensor | None:
    x, lo, hi = ops
    if kw or not all(v is None or type(v) in (int, float) for v in (lo, hi)):
        return None
    return apply("clamp", cast("Operand", x), lo=lo, hi=hi)  # arr is required: only min/max may be None


def _concat(ops: Operands, kw: Statics) -> Tensor | None:
    axis = kw.get("axis", 0)
    if set(kw) - {"axis"} or type(axis) is not int or not ops:
        return None
    return apply("concat", *_required(ops), axis=axis)


def _transpose(ops: Operands, kw: Statics) -> Tensor | None:
    return None if set(kw) - {"axes"} else apply("transpose", _required(ops)[0], axes=kw.get("axes"))


def _reshape(ops: Operands, kw: Statics) -> Tensor | None:
    if set(kw) - {"shape"} or "shape" not in kw:
        return None
    return apply("reshape", _required(ops)[0], shape=kw["shape"])


def _take(ops: Operands, kw: Statics) -> Tensor | None:
    a, indices = _required(ops)
    axis = kw.get("axis")
    if set(kw) - {"axis"} or not (axis is None or type(axis) is int):
        return None
    if axis is None:  # jnp.take's default: positions in the flattened array
        return apply("take", apply("reshape", a, shape=(-1,)), indices, axis=0)
    return apply("take", a, indices, axis=axis)


_FINAL: frozenset[Builtin] = frozenset((_take,))
"""Built-ins whose refusal stands (no lifted fallback)."""


def _gelu(ops: Operands, kw: Statics) -> Tensor | None:
    approximate = kw.get("approximate", True)  # jax.nn.gelu's default: the tanh form
    if set(kw) - {"approximate"} or not isinstance(approximate, bool):
        return None
    return apply("gelu", _required(ops)[0], approximate="tanh" if approximate else "none")


# --------------------------------------------------------------------------- the tables

# (name, operands, statics[, built-in]): operands are space-separated names, "?" marks an optional one (None:
# left out), "*" a sequence of operands; statics are the names of the static arguments (their defaults are the
# jax function's own). A function a name maps to is looked up in the table's module.
_Row: TypeAlias = tuple[str, str, tuple[str, ...]] | tuple[str, str, tuple[str, ...], Builtin | None]

_UNARY_FLOAT = [
    "exp",
    "exp2",
    "expm1",
    "log",
    "log2",
    "log10",
    "log1p",
    "sin",
    "cos",
    "tan",
    "arcsin",
    "arccos",
    "arctan",
    "sinh",
    "cosh",
    "arcsinh",
    "arccosh",
    "arctanh",
    "sqrt",
    "cbrt",
    "square",
    "reciprocal",
    "positive",
    "fabs",
    "sinc",
    "deg2rad",
    "rad2deg",
    "degrees",
    "radians",
    "i0",
]
_BINARY = [
    "float_power",
    "hypot",
    "arctan2",
    "logaddexp",
    "logaddexp2",
    "copysign",
    "fmax",
    "fmin",
    "remainder",
    "fmod",
    "mod",
    "heaviside",
]
_ROUNDING = ["sign", "floor", "ceil", "rint", "trunc"]  # float results, zero gradient
_PREDICATES = ["isnan", "isinf", "isfinite", "signbit", "isneginf", "isposinf", "logical_not"]  # boolean results
_COMPARISONS = {"equal": "eq", "not_equal": "ne", "less": "lt", "less_equal": "le", "greater": "gt"}
_COMPARISONS["greater_equal"] = "ge"
_BUILTIN_UNARY = {"exp": "exp", "log": "log", "sin": "sin", "cos": "cos", "tanh": "tanh", "sqrt": "sqrt"}
_BUILTIN_UNARY |= {"abs": "abs", "absolute": "abs", "negative": "neg"}
_BUILTIN_BINARY = {"add": "add", "subtract": "sub", "multiply": "mul", "divide": "div", "true_divide": "div"}
_BUILTIN_BINARY |= {"power": "pow", "pow": "pow", "maximum": "maximum", "minimum": "minimum", "matmul": "matmul"}
_REDUCE = ("axis", "dtype", "keepdims")
_AXIS_KEEP = {"axis": "axis", "keepdims": "keepdims"}

_NUMPY: list[_Row] = [
    *[(n, "x", (), _same(_BUILTIN_UNARY[n]) if n in _BUILTIN_UNARY else None) for n in _UNARY_FLOAT],
    ("tanh", "x", (), _same("tanh")),
    ("abs", "x", (), _same("abs")),
    ("absolute", "x", (), _same("abs")),
    ("negative", "x", (), _same("neg")),
    *[(n, "x", ()) for n in _ROUNDING],
    ("round", "x", ("decimals",)),
    ("around", "x", ("decimals",)),
    ("nan_to_num", "x", ("nan", "posinf", "neginf")),
    *[(n, "x", ()) for n in _PREDICATES],
    *[(n, "x y", (), _same(op)) for n, op in _BUILTIN_BINARY.items()],
    *[(n, "x y", ()) for n in _BINARY],
    *[(n, "x y", (), _same(op)) for n, op in _COMPARISONS.items()],
    *[(n, "x y", ()) for n in ("logical_and", "logical_or", "logical_xor")],
    ("clip", "arr min? max?", (), _clip),
    ("where", "condition x y", (), _same("where")),
    # reductions
    ("sum", "a", _REDUCE, _keywords("sum", _AXIS_KEEP)),
    ("mean", "a", _REDUCE, _keywords("mean", _AXIS_KEEP)),
    ("max", "a", ("axis", "keepdims"), _keywords("max", _AXIS_KEEP)),
    ("amax", "a", ("axis", "keepdims"), _keywords("max", _AXIS_KEEP)),
    ("min", "a", ("axis", "keepdims")),
    ("amin", "a", ("axis", "keepdims")),
    ("prod", "a", _REDUCE),
    ("ptp", "a", ("axis", "keepdims")),
    ("var", "a", ("axis", "dtype", "ddof", "keepdims")),
    ("std", "a", ("axis", "dtype", "ddof", "keepdims")),
    ("median", "a", ("axis", "keepdims")),
    ("average", "a weights?", ("axis", "keepdims")),
    ("quantile", "a q", ("axis", "method", "keepdims")),
    ("percentile", "a q", ("axis", "method", "keepdims")),
    *[(n, "a", _REDUCE) for n in ("nansum", "nanmean", "nanprod")],
    *[(n, "a", ("axis", "keepdims")) for n in ("nanmax", "nanmin")],
    *[(n, "a", ("axis", "dtype", "ddof", "keepdims")) for n in ("nanvar", "nanstd")],
    *[(n, "a", ("axis", "dtype")) for n in ("cumsum", "cumprod", "nancumsum", "nancumprod")],
    ("all", "a", ("axis", "keepdims")),
    ("any", "a", ("axis", "keepdims")),
    ("count_nonzero", "a", ("axis", "keepdims")),
    ("argmax", "a", ("axis", "keepdims")),
    ("argmin", "a", ("axis", "keepdims")),
    ("argsort", "a", ("axis", "stable", "descending")),
    ("sort", "a", ("axis", "stable", "descending")),
    ("diff", "a", ("n", "axis")),
    # linear algebra
    *[(n, "a b", ()) for n in ("dot", "vdot", "inner", "outer", "kron")],
    ("tensordot", "a b", ("axes",)),
    ("einsum", "*operands", ("subscripts",)),
    ("trace", "a", ("offset", "axis1", "axis2")),
    ("diagonal", "a", ("offset", "axis1", "axis2")),
    ("diag", "v", ("k",)),
    ("tril", "m", ("k",)),
    ("triu", "m", ("k",)),
    ("cross", "a b", ("axisa", "axisb", "axisc", "axis")),
    ("convolve", "a v", ("mode",)),
    ("correlate", "a v", ("mode",)),
    ("polyval", "p x", ()),
    ("interp", "x xp fp", ()),
    # shapes
    ("reshape", "a", ("shape", "order"), _reshape),
    ("ravel", "a", ("order",)),
    ("transpose", "a", ("axes",), _transpose),
    ("permute_dims", "a", ("axes",), _keywords("permute", {"axes": "axes"})),
    ("swapaxes", "a", ("axis1", "axis2")),
    ("moveaxis", "a", ("source", "destination")),
    ("expand_dims", "a", ("axis",), _keywords("expand_dims", {"axis": "axis"})),
    ("squeeze", "a", ("axis",), _keywords("squeeze", {"axis": "axis"})),
    ("broadcast_to", "array", ("shape",), _keywords("broadcast_to", {"shape": "shape"})),
    ("flip", "m", ("axis",)),
    ("fliplr", "m", ()),
    ("flipud", "m", ()),
    ("roll", "a", ("shift", "axis")),
    ("rot90", "m", ("k", "axes")),
    ("tile", "A", ("reps",)),
    ("repeat", "a", ("repeats", "axis", "total_repeat_length")),
    ("pad", "array", ("pad_width", "mode")),
    ("concatenate", "*arrays", ("axis",), _concat),
    *[(n, "*arrays", ("axis",)) for n in ("stack",)],
    *[(n, "*tup", ()) for n in ("hstack", "vstack", "dstack", "column_stack")],
    ("split", "ary", ("indices_or_sections", "axis")),
    ("array_split", "ary", ("indices_or_sections", "axis")),
    ("atleast_1d", "x", ()),
    ("atleast_2d", "x", ()),
    ("atleast_3d", "x", ()),
    ("take", "a indices", ("axis", "mode"), _take),
    ("take_along_axis", "arr indices", ("axis", "mode")),
    ("astype", "x", ("dtype",), _keywords("astype", {"dtype": "dtype"})),
    ("zeros_like", "a", ("dtype",)),
    ("ones_like", "a", ("dtype",)),
    ("full_like", "a fill_value", ("dtype",)),
]

_NN: list[_Row] = [
    ("relu", "x", (), _same("relu")),
    ("sigmoid", "x", (), _same("sigmoid")),
    ("softplus", "x", (), _same("softplus")),
    ("gelu", "x", ("approximate",), _gelu),
    ("softmax", "x", ("axis",), _keywords("softmax", {"axis": "axis"})),
    ("log_softmax", "x", ("axis",), _keywords("log_softmax", {"axis": "axis"})),
    ("logsumexp", "a", ("axis", "keepdims"), _keywords("logsumexp", _AXIS_KEEP)),
    *[(n, "x", ()) for n in ("relu6", "soft_sign", "silu", "swish", "log_sigmoid", "hard_tanh", "selu")],
    ("leaky_relu", "x", ("negative_slope",)),
    ("elu", "x", ("alpha",)),
    ("celu", "x", ("alpha",)),
    ("glu", "x", ("axis",)),
    ("standardize", "x", ("axis", "epsilon")),
]

_SPECIAL: list[_Row] = [
    *[(n, "x", ()) for n in ("erf", "erfc", "erfinv", "gammaln", "digamma", "logit", "expit", "entr")],
    *[(n, "x", ()) for n in ("ndtr", "ndtri", "log_ndtr", "i0e", "i1e")],
    ("xlogy", "x y", ()),
    ("xlog1py", "x y", ()),
    ("betaln", "a b", ()),
    ("logsumexp", "a", ("axis", "keepdims"), _keywords("logsumexp", _AXIS_KEEP)),
]

_LINALG: list[_Row] = [
    ("norm", "x", ("ord", "axis", "keepdims")),
    ("vector_norm", "x", ("ord", "axis", "keepdims")),
    ("matrix_norm", "x", ("ord", "keepdims")),
    ("det", "a", ()),
    ("slogdet", "a", ("method",)),  # (sign, logabsdet): one node each
    ("inv", "a", ()),
    ("pinv", "a", ("rtol", "hermitian")),
    ("solve", "a b", ()),
    ("lstsq", "a b", ("rcond",)),  # (x, residuals, rank, singular values); rank is an integer node
    ("tensorsolve", "a b", ("axes",)),
    ("tensorinv", "a", ("ind",)),
    ("cholesky", "a", ("upper", "symmetrize_input")),
    ("qr", "a", ("mode",)),
    ("svd", "a", ("full_matrices", "compute_uv", "hermitian")),
    ("svdvals", "x", ()),
    ("eigh", "a", ("UPLO", "symmetrize_input")),
    ("eigvalsh", "a", ("UPLO", "symmetrize_input")),
    ("cond", "x", ("p",)),
    ("matrix_rank", "M", ("rtol", "hermitian")),
    ("matrix_power", "a", ("n",)),
    ("matmul", "x1 x2", (), _same("matmul")),
    ("multi_dot", "*arrays", ()),
    ("matrix_transpose", "x", ()),
    ("trace", "x", ("offset", "dtype")),
    ("diagonal", "x", ("offset",)),
    ("outer", "x1 x2", ()),
    ("cross", "x1 x2", ("axis",)),
    ("vecdot", "x1 x2", ("axis",)),
    ("tensordot", "x1 x2", ("axes",)),
]

LINALG_UNSUPPORTED: dict[str, str] = {
    "eig": "complex eigenvalues and eigenvectors of a general matrix: tfl.numpy has no op that takes a complex "
    "result back to a real loss, and JAX refuses eigenvector derivatives of non-symmetric matrices; "
    "use eigh for a symmetric matrix",
    "eigvals": "complex eigenvalues of a general matrix (no op takes them back to a real loss); "
    "use eigvalsh for a symmetric matrix",
}
"""``jax.numpy.linalg`` functions that :data:`linalg` does not record, each with the reason."""

UNSUPPORTED: dict[str, str] = {
    "nonzero": "the output shape depends on the values (how many entries are nonzero)",
    "flatnonzero": "the output shape depends on the values",
    "argwhere": "the output shape depends on the values",
    "unique": "the output shape depends on the values (how many distinct entries)",
    "unique_values": "the output shape depends on the values",
    "unique_counts": "the output shape depends on the values",
    "extract": "the output shape depends on the condition's values (boolean indexing)",
    "compress": "the output shape depends on the condition's values (boolean indexing)",
    "select": "condlist/choicelist are lists of arrays; use where",
    "piecewise": "takes a list of Python functions",
    "histogram": "piecewise constant in its input: no gradient, and bin edges returned as a second array",
    "bincount": "the output length depends on the values unless length= is given; integer input only",
    "meshgrid": "returns a list whose length depends on the argument count; use broadcast_to",
    "linspace": "creates an array from Python numbers: not an operation on tensors",
    "arange": "creates an array from Python numbers: not an operation on tensors",
    "zeros": "creates an array from a shape: not an operation on tensors (use zeros_like)",
    "ones": "creates an array from a shape: not an operation on tensors (use ones_like)",
    "empty": "creates an array from a shape: not an operation on tensors",
    "eye": "creates an array from a shape: not an operation on tensors",
    "array": "creates an array from Python data: use s.input(...)",
    "asarray": "creates an array from Python data: use s.input(...)",
}
"""``jax.numpy`` functions that cannot be recorded on a tape, each with the reason."""


# --------------------------------------------------------------------------- the functions


@dataclass(frozen=True)
class _Spec:
    name: str  # the function's name in its namespace
    source: Callable[..., PyTree]  # the jax function it mirrors
    qualname: str  # "jax.numpy.cumsum"
    operands: tuple[str, ...]  # declared operand names
    optional: frozenset[str]
    sequence: bool  # one operand, a sequence of arrays
    statics: Statics  # static name -> the jax function's default
    builtin: Builtin | None
    positional: tuple[str, ...] = ()  # statics the jax function takes positional-only (after the operands)


def _parameters(fn: Callable[..., object]) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}


def _spec(module: types.ModuleType, prefix: str, row: _Row) -> _Spec:
    name, operands, statics = row[0], row[1].split(), tuple(row[2])
    builtin = row[3] if len(row) > 3 else None
    fn = getattr(module, name)
    sequence = len(operands) == 1 and operands[0].startswith("*")
    names = tuple(o.lstrip("*").rstrip("?") for o in operands)
    optional = frozenset(o.rstrip("?") for o in operands if o.endswith("?"))
    params = _parameters(fn)
    positional = tuple(n for n, p in params.items() if n in statics and p.kind is _P.POSITIONAL_ONLY)
    # each static's default is the jax function's own (REQUIRED where it has none)
    defaults = {
        n: R.REQUIRED if n not in params or params[n].default is _P.empty else params[n].default for n in statics
    }
    return _Spec(name, fn, f"{prefix}.{name}", names, optional, sequence, defaults, builtin, positional)


def _signature(spec: _Spec) -> inspect.Signature:
    """The public signature: the operands positionally, then the statics (with the jax function's defaults)."""
    params: list[_P] = []
    if spec.name == "einsum":  # einsum(subscripts, *operands)
        params = [_P("subscripts", _P.POSITIONAL_OR_KEYWORD), _P("operands", _P.VAR_POSITIONAL, annotation="Operand")]
        return inspect.Signature(params, return_annotation="Tensor")
    if spec.sequence:
        params.append(_P(spec.operands[0], _P.POSITIONAL_OR_KEYWORD, annotation="Sequence[Operand]"))
    else:
        for o in spec.operands:
            optional = o in spec.optional
            ann = "Operand | None" if optional else "Operand"
            params.append(_P(o, _P.POSITIONAL_OR_KEYWORD, default=None if optional else _P.empty, annotation=ann))
    keyword_only = False  # a required static after a parameter with a default: it and the rest by keyword only
    for n, d in spec.statics.items():
        if d is R.REQUIRED and params and params[-1].default is not _P.empty:
            keyword_only = True
        kind = _P.KEYWORD_ONLY if keyword_only else _P.POSITIONAL_OR_KEYWORD
        params.append(_P(n, kind) if d is R.REQUIRED else _P(n, kind, default=d))
    return inspect.Signature(params, return_annotation="Tensor")


def _pure(spec: _Spec) -> Callable[..., PyTree]:
    """The function lifted for ``spec``: operands positionally (given ones only), statics by keyword."""
    fn, sequence, slots, positional = spec.source, spec.sequence, spec.operands, spec.positional
    optional = bool(spec.optional)

    if spec.name == "einsum":

        def pure(*xs: jax.Array, **kw: object) -> PyTree:
            return fn(kw.pop("subscripts"), *xs, **kw)

    elif sequence:

        def pure(*xs: jax.Array, **kw: object) -> PyTree:
            return fn(xs, **kw)

    elif optional:
        required = [o for o in slots if o not in spec.optional]

        def pure(*xs: jax.Array, **kw: object) -> PyTree:
            present = cast("tuple[bool, ...]", kw.pop(_PRESENT))
            rest = iter(xs)
            given = {o: next(rest) for o, p in zip(slots, present) if p}
            lead = [given.pop(o) for o in required] + [kw.pop(n) for n in positional]
            return fn(*lead, **given, **kw)  # optional operands by keyword

    elif positional:

        def pure(*xs: jax.Array, **kw: object) -> PyTree:
            return fn(*xs, *[kw.pop(n) for n in positional], **kw)

    else:

        def pure(*xs: jax.Array, **kw: object) -> PyTree:
            return fn(*xs, **kw)

    statics = dict(spec.statics)
    if optional:
        statics[_PRESENT] = (True,) * len(slots)
    params = [_P("xs", _P.VAR_POSITIONAL)]
    params += [_P(n, _P.KEYWORD_ONLY, default=d) for n, d in statics.items()]
    pure.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    pure.__doc__ = f"``{spec.qualname}`` on the operands ``xs``, static arguments by keyword."
    pure.__qualname__ = pure.__name__ = spec.name
    pure.__module__ = __name__
    return pure


def _freeze(v: object) -> object:
    """A static argument as a hashable value: lists become tuples (recursively)."""
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    return v


_NUMBERS = (int, float, bool)


def _weak_numbers(ops: Operands) -> Operands:
    """Python numbers as arrays of the dtype JAX's weak typing gives them next to the other operands.

    A session makes a number operand an array of its own (its first handle operand's dtype, else the default
    float dtype); the lifted function would then promote with that array, where ``jax.numpy`` promotes with
    a weakly typed number (``int64 * 1.5`` is float64 under x64, never float32).
    """
    if not any(type(o) in _NUMBERS for o in ops):
        return ops
    dtypes = [o.dtype for o in ops if o is not None and type(o) not in _NUMBERS and hasattr(o, "dtype")]
    return [jnp.asarray(o, jnp.result_type(*dtypes, o)) if type(o) in _NUMBERS else o for o in ops]


def _is_default(v: object, d: object) -> bool:
    try:
        return type(v) is type(d) and bool(v == d)
    except Exception:
        return False


class _Function:
    """One function of the namespace: ``jax.numpy`` on arrays, a built-in or lifted op on tensors."""

    def __init__(self, spec: _Spec, opname: str) -> None:
        self.spec = spec
        self.opname = opname
        self.sig = _signature(spec)
        self.lifted: Callable[..., PyTree] | None = None
        self.pure = _pure(spec)

    def lift(self) -> Callable[..., PyTree]:
        """The lifted op, registered on first use (again if it was unregistered since)."""
        f = self.lifted
        if f is None or R.REGISTRY.get(self.opname) is not f.op:  # type: ignore[attr-defined]
            statics = [*self.spec.statics, *([_PRESENT] if self.spec.optional else [])]
            f = self.lifted = lift(self.pure, name=self.opname, static_argnames=statics)
        return f

    def __call__(self, *args: object, **kwargs: object) -> PyTree:
        return self.call(args, kwargs, always=False)

    def call(self, args: tuple[object, ...], kwargs: dict[str, object], *, always: bool) -> PyTree:
        """The call; with ``always``, operands that are all plain arrays record on the current session too."""
        spec = self.spec
        try:
            bound = self.sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{spec.qualname}: {e}") from None
        given = bound.arguments
        if spec.name == "einsum":
            ops: Operands = list(given.get("operands", ()))
        elif spec.sequence:
            seq = given[spec.operands[0]]
            if isinstance(seq, _HANDLES) or hasattr(seq, "shape"):
                ops = [seq]  # one array: jax.numpy splits it along its first axis
            else:
                ops = list(seq)
        else:
            ops = [given.get(o) for o in spec.operands]
        statics = {k: _freeze(v) for k, v in given.items() if k in spec.statics}
        handles = any(isinstance(o, _HANDLES) for o in ops)
        if not handles and not always:
            return self.plain(ops, statics)  # plain arrays (or tracers): just the jax function
        if (
            spec.sequence
            and spec.name != "einsum"
            and len(ops) == 1
            and not isinstance(given[spec.operands[0]], (list, tuple))
        ):
            raise TapeError(f"{self.opname}: {spec.operands[0]} must be a sequence of operands (a list or tuple)")
        if spec.builtin is not None:
            changed = {k: v for k, v in statics.items() if not _is_default(v, spec.statics[k])}
            try:
                out = spec.builtin(ops, changed)
            except TapeError:
                if spec.builtin in _FINAL:
                    raise  # its refusal is the answer (take's positions out of range: the lifted one would clamp)
                out = None  # the built-in op refused (e.g. integer operands): the lifted one decides
            if out is not None:
                return out
        if any(isinstance(v, (list, dict, set)) for v in statics.values()):
            raise TapeError(f"{self.opname}: static arguments must be hashable Python values, got {statics!r}")
        f = self.lift()
        ops = _weak_numbers(ops)
        if not handles:  # `always`: the op records on the session apply picks (lifted() would just compute)
            f = functools.partial(apply, self.opname)
        if spec.optional:
            present = tuple(o is not None for o in ops)
            return f(*[o for o in ops if o is not None], present=present, **statics)
        return f(*ops, **statics)

    def plain(self, ops: Operands, statics: Statics) -> PyTree:
        spec = self.spec
        if spec.name == "einsum":
            return spec.source(statics.pop("subscripts"), *ops, **statics)
        if spec.sequence:
            return spec.source(ops, **statics)
        required = [o for o, o_name in zip(ops, spec.operands) if o_name not in spec.optional]
        optional = {n: o for o, n in zip(ops, spec.operands) if n in spec.optional and o is not None}
        statics = dict(statics)
        lead = [statics.pop(n, spec.statics[n]) for n in spec.positional]  # left out: the default
        return spec.source(*required, *lead, **optional, **statics)


def _doc(spec: _Spec, opname: str, source_doc: str | None) -> str:
    summary = (source_doc or "").strip().split("\n\n")[0]
    summary = " ".join(summary.split())
    lines = [f"``{spec.qualname}`` on tapeflow Tensors, Params and arrays."]
    if summary:
        lines.append(f"{spec.qualname}: {summary}")
    how = (
        f"On plain arrays this is ``{spec.qualname}`` itself; with a Tensor or Param operand it records "
        + ("a built-in op where the call fits one, else " if spec.builtin is not None else "")
        + f"the lifted op ``{opname!r}``."
    )
    lines.append(how)
    if spec.statics:
        lines.append("Static arguments (Python values): " + ", ".join(f"``{n}``" for n in spec.statics) + ".")
    return "\n\n".join(lines)


def _make(spec: _Spec, opname: str) -> Callable[..., PyTree]:
    impl = _Function(spec, opname)

    def function(*args: object, **kwargs: object) -> PyTree:
        return impl(*args, **kwargs)

    function.__signature__ = impl.sig  # type: ignore[attr-defined]
    function.__name__ = function.__qualname__ = spec.name
    function.__module__ = "tapeflow.numpy"
    function.__doc__ = _doc(spec, opname, getattr(spec.source, "__doc__", None))
    function.__wrapped_jax__ = spec.source  # type: ignore[attr-defined]
    function.impl = impl  # type: ignore[attr-defined]
    return function


def _table(module: types.ModuleType, prefix: str, rows: list[_Row], opprefix: str) -> dict[str, Callable[..., PyTree]]:
    out: dict[str, Callable[..., PyTree]] = {}
    for row in rows:
        spec = _spec(module, prefix, row)
        out[spec.name] = _make(spec, opprefix + spec.name)
    return out


class Namespace(types.SimpleNamespace):
    """A read-only group of functions (``tfl.numpy.nn``, ``tfl.numpy.special``, ``tfl.numpy.linalg``).

    ``dir()`` lists them; a name in ``unsupported`` raises AttributeError with its reason.

    >>> ns = Namespace("demo", {"one": lambda: 1}, unsupported={"two": "not here"})
    >>> ns.one(), dir(ns)
    (1, ['one'])
    """

    def __init__(
        self,
        name: str,
        functions: Mapping[str, Callable[..., PyTree]],
        unsupported: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(**functions)
        object.__setattr__(self, "__name__", name)
        object.__setattr__(self, "_unsupported", dict(unsupported or {}))

    def __getattr__(self, name: str) -> object:
        why = vars(self).get("_unsupported", {}).get(name)
        if why is not None:
            raise AttributeError(f"{self.__name__}.{name} is not supported: {why}")
        raise AttributeError(f"{self.__name__} has no attribute {name!r}")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{self.__name__} is read-only")

    def __dir__(self) -> list[str]:
        return sorted(k for k in vars(self) if not k.startswith("_"))

    def __repr__(self) -> str:
        return f"<namespace {self.__name__}: {len(self.__dir__())} functions>"


FUNCTIONS: dict[str, Callable[..., PyTree]] = _table(jnp, "jax.numpy", _NUMPY, _PREFIX)
"""The ``jax.numpy`` mirrors by name (also module attributes)."""
NN: dict[str, Callable[..., PyTree]] = _table(jax.nn, "jax.nn", _NN, _PREFIX + "nn.")
"""The ``jax.nn`` mirrors by name (also ``nn.<name>``)."""
SPECIAL: dict[str, Callable[..., PyTree]] = _table(jsp, "jax.scipy.special", _SPECIAL, _PREFIX + "special.")
"""The ``jax.scipy.special`` mirrors by name (also ``special.<name>``)."""

LINALG: dict[str, Callable[..., PyTree]] = _table(jnp.linalg, "jax.numpy.linalg", _LINALG, _PREFIX + "linalg.")
"""The ``jax.numpy.linalg`` mirrors by name (also ``linalg.<name>``)."""

nn = Namespace("tfl.numpy.nn", NN)
special = Namespace("tfl.numpy.special", SPECIAL)
linalg = Namespace("tfl.numpy.linalg", LINALG, LINALG_UNSUPPORTED)

# the functions are served by the module's __getattr__, not put in its globals: many (sum, any, abs, round, ...)
# are builtins' names, which the code above must keep


def record(name: str, *args: object, **kwargs: object) -> Tensor:
    """``tfl.numpy.<name>(*args, **kwargs)`` recorded as an op even when no operand is a Tensor or Param.

    Then it records on the session :func:`~tapeflow.apply` picks (the current
    one): the PyTorch-named functions build on this, since ``torch.<fn>`` of
    plain data still gives a tensor.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     record("cumsum", jnp.array([1.0, 2.0]), axis=0).tolist()
    [1.0, 3.0]
    """
    impl: _Function = FUNCTIONS[name].impl  # type: ignore[attr-defined]
    out: Tensor = impl.call(args, kwargs, always=True)
    return out


__all__ = sorted(
    [*FUNCTIONS, "nn", "special", "linalg", "UNSUPPORTED", "LINALG_UNSUPPORTED", "FUNCTIONS", "NN", "SPECIAL"]
    + ["LINALG", "record"]
)


def __dir__() -> list[str]:
    return list(__all__)


def __getattr__(name: str) -> object:
    f = FUNCTIONS.get(name)
    if f is not None:
        return f
    if name in UNSUPPORTED:
        raise AttributeError(f"tfl.numpy.{name} is not supported: {UNSUPPORTED[name]}")
    raise AttributeError(f"module 'tfl.numpy' has no attribute {name!r}")
