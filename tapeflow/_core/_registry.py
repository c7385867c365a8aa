"""The op registry: one definition per op, with its forward, VJP and check side by side.

An op is declared once with :func:`op`, which decorates its forward; the VJP and
the operand check are attached next to it::

    @op("mul", arity=2, exact=True, check=same_dtype_broadcast)
    def mul(x, y):
        return x * y

    @mul.defvjp
    def _(g, out, x, y):
        return unbroadcast(g * y, x.shape), unbroadcast(g * x, y.shape)

* ``fwd(*inputs, **attrs)`` computes the output with ``jax.numpy`` (or NumPy for
  exact rational object arrays, when the op is declared ``exact``).
* ``vjp(g, out, *inputs, **attrs)`` returns one cotangent per input. An op may
  leave it out, in which case its VJP is ``jax.vjp`` of the forward.
* ``check(specs, **attrs)`` looks only at shapes, dtypes and attributes and
  returns an error message (or ``None``). The output shape and dtype come from
  ``jax.eval_shape`` of the forward, once per cache key.

The forward's signature is also the op's public signature: its positional
parameters name the operands (a trailing ``b=None`` is an optional operand,
``*xs`` a variadic one), the remaining parameters are the attributes (annotated
with the types of :data:`ATTR_TYPES`), and the first paragraph of its docstring
is the op's one-line public summary (the rest are notes). :mod:`tapeflow._shell._functions`
builds ``tfl.<op>`` from exactly that.

Forward and VJP kernels are ``jax.jit``-compiled and cached per
``(op, attrs, shapes, dtypes)`` (plus, for VJPs, which inputs need a gradient),
so recording an op in eager mode costs one compiled dispatch. Inside an outer
``jax.jit`` the same kernels inline into the caller's trace. Runtime attributes' values
(:func:`op`'s ``runtime``) are passed traced: varying them compiles nothing. Caches are LRUs.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Container, Hashable, Iterable, Mapping, Sequence
from types import ModuleType
from typing import Literal, TypeAlias, get_args

import jax
import jax.numpy as jnp
import numpy as np

from . import _compile_log
from ._kernels import KernelCache, drop_kernels_of
from ._typing import Array, Attrs, AttrValue, PyTree, Shape

__all__ = [
    "REGISTRY",
    "Axes",
    "OpDef",
    "OpPrecision",
    "Padding",
    "Pair",
    "Reduction",
    "ShapeLike",
    "Spec",
    "attr_key",
    "definition",
    "kernel_cache_key",
    "logged_kernel",
    "normalize_attrs",
    "op",
    "ops",
    "register",
    "restore",
    "unregister",
]

Spec = tuple[tuple[int, ...], np.dtype]
"""Shape and dtype of one operand."""

REQUIRED: AttrValue = object()
"""Marker for an attribute without a default."""

OBJECT = np.dtype(object)

# --------------------------------------------------------------------------- attribute types

Axes: TypeAlias = int | Sequence[int]
"""One axis or several; negative axes count from the end."""

ShapeLike: TypeAlias = int | Sequence[int]
"""A target shape: an int (rank 1) or a sequence of ints."""

Pair: TypeAlias = int | tuple[int, int]
"""An int ``n`` (meaning ``(n, n)``) or a pair of ints, e.g. a 2-D stride."""

Padding: TypeAlias = int | tuple[int, int] | tuple[tuple[int, int], tuple[int, int]] | str
"""Convolution padding: an int, a pair, ``((top, bottom), (left, right))``, ``"SAME"`` or ``"VALID"``."""

Reduction: TypeAlias = Literal["mean", "sum", "none"]
"""How a loss reduces over its rows."""

OpPrecision: TypeAlias = Literal["compute", "float32", "layout"]
"""The dtype an op's float operands are computed in under a mixed-precision policy: the policy's compute dtype,
float32 (losses, reductions, normalizations) or their own (ops that move or select elements, or cast on purpose)."""

ATTR_TYPES = ("Axes", "ShapeLike", "Pair", "Padding", "Reduction")
"""The aliases above: with builtins, ``Sequence``, numpy.typing's ``DTypeLike`` and
``AttrValue`` they are what op forwards annotate attributes with (the stub
generator imports them into ``tapeflow/_functions.pyi``)."""


def fmt_spec(spec: Spec) -> str:
    shape, dtype = spec
    name = "rational" if dtype == OBJECT else str(dtype)
    return f"{name}[{','.join(map(str, shape))}]"


def is_float(dtype: np.dtype) -> bool:
    """Whether values of ``dtype`` can carry gradients (floating or exact rational)."""
    got = _IS_FLOAT.get(dtype)
    if got is None:
        got = _IS_FLOAT[dtype] = dtype == OBJECT or bool(jnp.issubdtype(dtype, jnp.inexact))
    return got


_IS_FLOAT: dict[np.dtype, bool] = {}


@dataclasses.dataclass(eq=False)
class OpDef:
    """One registered op. Create it with :func:`op`, never directly.

    ``operands`` names the operands in order (from the forward's signature; for
    a variadic op the one name of the operand sequence); the last
    ``arity[1] - arity[0]`` of them are optional. ``attr_types`` holds the
    annotation text of each attribute, ``doc`` the one-line public summary and
    ``notes`` the rest of the forward's docstring. ``public=False`` ops get no
    ``tfl.<name>`` function; ``aliases`` are further names of that function.
    ``runtime`` names the attributes passed to the kernels as traced scalars, ``precision`` its :data:`OpPrecision`.
    ``tangent=False``: no tangent in forward mode, although the forward would pass one (``stop_gradient``).
    ``user`` marks an op registered through :func:`tapeflow.lift` or
    :func:`tapeflow.defop` (it can be :func:`unregister` ed), and ``source`` is
    the function it was registered from (None for a built-in op).
    """

    name: str
    fwd: Callable[..., Array]
    check: Callable[..., str | None] | None
    arity: tuple[int, int | None]
    defaults: Mapping[str, AttrValue]
    nondiff: frozenset[int]
    exact: bool
    vjp: Callable[..., Sequence[Array | None]] | None = None
    doc: str = ""
    notes: str = ""
    operands: tuple[str, ...] = ()
    attr_types: Mapping[str, str] = dataclasses.field(default_factory=dict)
    public: bool = True
    aliases: tuple[str, ...] = ()
    runtime: frozenset[str] = frozenset()
    precision: OpPrecision = "compute"
    tangent: bool = True
    user: bool = False
    source: Callable[..., object] | None = None
    # (specs, attrs) -> [(k, lo, hi, skip)]: operand k holds positions in [lo, hi), or the value skip (None: no
    # such value; cross_entropy's ignore_index), checked when given as host data
    index_bounds: Callable[..., Sequence[tuple[int, int, int, int | None]]] | None = None
    # an out-of-range position is clamped (take, gather: debug_nans checks device values too); False: the op's
    # result is NaN there (cross_entropy), and the debug_nans search explains it
    index_clamps: bool = True

    @property
    def variadic(self) -> bool:
        """Whether the op takes any number of operands (its one operand name stands for all)."""
        return self.arity[1] is None

    @property
    def optional_operands(self) -> tuple[str, ...]:
        """Names of the trailing operands that may be left out."""
        return () if self.variadic else self.operands[self.arity[0] :]

    def defvjp(self, vjp: Callable[..., Sequence[Array | None]]) -> Callable[..., Sequence[Array | None]]:
        """Attach the VJP ``vjp(g, out, *inputs, **attrs) -> cotangents``."""
        self.vjp = vjp
        return vjp

    def __repr__(self) -> str:
        return f"<op {self.name}>"


REGISTRY: dict[str, OpDef] = {}


def op(
    name: str,
    *,
    arity: int | tuple[int, int | None] | None = None,
    attrs: Mapping[str, AttrValue] | None = None,
    nondiff: Sequence[int] = (),
    exact: bool = False,
    check: Callable[..., str | None] | None = None,
    public: bool = True,
    aliases: Sequence[str] = (),
    runtime: Sequence[str] = (),
    precision: OpPrecision = "compute",
    tangent: bool = True,
    user: Callable[..., object] | None = None,
    index_bounds: Callable[..., Sequence[tuple[int, int, int, int | None]]] | None = None,
    index_clamps: bool = True,
) -> Callable[[Callable[..., Array]], OpDef]:
    """Register the decorated function as the forward of op ``name``.

    ``arity`` is an exact count or ``(min, max)`` (``max=None``: variadic); when
    left out it is read from the forward's signature, and when given it must
    agree with it. ``attrs`` maps each allowed attribute to its default
    (``REQUIRED`` for none). ``nondiff`` lists input positions that never get a
    gradient (labels, indices). ``exact`` marks ops whose forward and VJP are
    exact on rational object arrays. ``public=False`` keeps the op out of the
    ``tfl.<name>`` functions; ``aliases`` are further names for its function.
    ``runtime`` lists attributes the output's shape and dtype never depend on: a
    number given for one reaches the kernels traced (:func:`kernel_key`), so the
    forward and VJP must not branch on it in Python. ``precision`` and ``tangent``
    are the :class:`OpDef` fields. ``index_bounds(specs, **attrs)`` names the operands that
    are positions into an axis, with their range ``[lo, hi)`` (and one value allowed
    besides, or None): a session checks such an
    operand given as host data (NumPy, a list) before it records, so an index out
    of range is an error there instead of a clamped row. ``index_clamps=True``: the
    forward clamps such a position, so under ``debug_nans`` a session reads device
    values too (a wait for the device) and a traced step flags them; ``False``:
    the result is NaN there, which the ``debug_nans`` search already names. ``user`` (the user's function) marks a user registration
    (:func:`tapeflow.lift`, :func:`tapeflow.defop`), which :func:`unregister` may remove again.
    """
    if precision not in get_args(OpPrecision):
        raise ValueError(f"op {name!r}: precision={precision!r} must be one of {get_args(OpPrecision)}")

    def deco(fwd: Callable[..., Array]) -> OpDef:
        defaults = dict(attrs or {})
        if bad := sorted(set(runtime) - set(defaults)):
            raise ValueError(f"op {name!r}: runtime={bad} names no attribute (attrs={list(defaults)})")
        operands, ar, attr_types = _read_signature(name, fwd, defaults)
        if arity is not None:
            lo, hi = (arity, arity) if isinstance(arity, int) else arity
            if (lo, hi) != ar and not (hi is None and ar[1] is None and lo >= ar[0]):
                raise ValueError(f"op {name!r}: arity={arity!r} disagrees with the forward's operands {operands}")
            ar = (lo, hi)
        summary, _, notes = inspect.cleandoc(fwd.__doc__ or "").partition("\n\n")
        d = OpDef(
            name=name,
            fwd=fwd,
            check=check,
            arity=ar,
            defaults=defaults,
            nondiff=frozenset(nondiff),
            exact=exact,
            doc=" ".join(summary.split()),
            notes=notes.strip(),
            operands=operands,
            attr_types=attr_types,
            public=public,
            aliases=tuple(aliases),
            runtime=frozenset(runtime),
            precision=precision,
            tangent=tangent,
            user=user is not None,
            source=user,
            index_bounds=index_bounds,
            index_clamps=index_clamps,
        )
        return register(d)

    return deco


def _read_signature(
    name: str, fwd: Callable[..., object], attrs: Mapping[str, object]
) -> tuple[tuple[str, ...], tuple[int, int | None], dict[str, str]]:
    """Operand names, arity and attribute annotations from the forward's signature."""
    P, params = inspect.Parameter, inspect.signature(fwd).parameters.values()
    names: list[str] = []
    types: dict[str, str] = {}
    n_opt, variadic = 0, False
    for p in params:
        if p.name in attrs:
            ann = p.annotation
            text = ann if isinstance(ann, str) else "" if ann is P.empty else inspect.formatannotation(ann)
            types[p.name] = "AttrValue" if text in ("", "Any", "typing.Any") else text
        elif p.kind is P.VAR_POSITIONAL:
            names.append(p.name)
            variadic = True
        elif p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD) and not variadic:
            if p.default is not P.empty and p.default is not None:
                raise ValueError(f"op {name!r}: operand {p.name!r} may only default to None (an optional operand)")
            if p.default is P.empty and n_opt:
                raise ValueError(f"op {name!r}: required operand {p.name!r} follows an optional one")
            n_opt += p.default is None
            names.append(p.name)
        elif p.kind is not P.VAR_KEYWORD:
            raise ValueError(f"op {name!r}: forward parameter {p.name!r} is not an attribute (attrs={list(attrs)})")
    has_kwargs = any(p.kind is P.VAR_KEYWORD for p in params)
    missing = [a for a in attrs if a not in types]
    if missing and not has_kwargs:
        raise ValueError(f"op {name!r}: the forward takes no attribute(s) {missing}")
    n = len(names)
    arity = (n - 1, None) if variadic else (n - n_opt, n)
    return tuple(names), arity, {a: types.get(a, "AttrValue") for a in attrs}


def register(d: OpDef) -> OpDef:
    """Add op ``d`` under its name and return it (:func:`op` calls it); a taken name is a ``ValueError``."""
    if d.name in REGISTRY:
        raise ValueError(f"op {d.name!r} is already registered")
    REGISTRY[d.name] = d
    return d


def unregister(name: str, *, keep_kernels: bool = False) -> OpDef:
    """Remove the user-registered op ``name`` and every compiled kernel that mentions it; returns its OpDef.

    A built-in op cannot be removed (``ValueError``); an unknown name is a ``KeyError``.
    Tapes that recorded the op keep their values, but no longer differentiate through it.
    ``keep_kernels=True`` leaves them to a later ``drop_kernels_of`` (a finalizer may run inside a cache operation).

    >>> d = op("doc_unregister_twice", user=lambda x: 2 * x)(lambda x: 2 * x)
    >>> unregister("doc_unregister_twice") is d, "doc_unregister_twice" in REGISTRY
    (True, False)
    """
    d = REGISTRY.get(name)
    if d is None:
        raise KeyError(f"no op {name!r} is registered")
    if not d.user:
        raise ValueError(f"{name!r} is a built-in op; only ops registered with tfl.lift or tfl.defop can be removed")
    del REGISTRY[name]
    if not keep_kernels:
        drop_kernels_of({name})  # forwards, VJPs, and the caches of layers above (JVPs, recorded VJPs, ...)
    return d


def restore(d: OpDef) -> OpDef:
    """Put user op ``d`` back (undoing :func:`unregister` or a failed replacement), in place of any user op there since.

    >>> d = unregister(op("doc_restore", user=abs)(abs).name)
    >>> new = op("doc_restore", user=round)(round)   # registered in its place
    >>> restore(d) is REGISTRY["doc_restore"], unregister("doc_restore") is d
    (True, True)
    """
    now = REGISTRY.get(d.name)
    if not d.user or (now is not None and not now.user):
        raise ValueError(f"{d.name!r} is a built-in op; only ops registered with tfl.lift or tfl.defop can be restored")
    REGISTRY[d.name] = d
    if now is not None and now is not d:
        drop_kernels_of({d.name})  # compiled for the op that held the name
    return d


def ops() -> list[str]:
    """Names of every registered op, sorted."""
    return sorted(REGISTRY)


def normalize_attrs(attrs: Mapping[str, object]) -> Attrs:
    """The canonical form of an op's attributes: ``(name, value)`` pairs sorted by name.

    Lists become tuples (recursively, as do tuples of lists), a slice becomes
    ``("slice", start, stop, step)``, a mapping becomes its sorted ``(key,
    value)`` pairs, a NumPy scalar becomes the equal Python scalar
    (``np.int64(1) -> 1``, ``np.float32(x) -> float(x)``), and a ``dtype``
    attribute given as anything ``np.dtype`` accepts becomes that ``np.dtype``.
    Other values pass through; an unhashable one (a set, an array) makes hashing
    the result fail, for the caller to report. Equal values of different types
    (``True``, ``1``, ``1.0``) stay distinct (:func:`attr_key` keys by type too).

    >>> normalize_attrs({"axis": [0, [1]], "dtype": "float32", "index": slice(1, None)})
    (('axis', (0, (1,))), ('dtype', dtype('float32')), ('index', ('slice', 1, None, None)))
    >>> normalize_attrs({"axis": np.int64(1), "keepdims": np.bool_(True)})
    (('axis', 1), ('keepdims', True))
    """
    return tuple(sorted((k, _normalize_value(k, v)) for k, v in attrs.items()))


def _normalize_value(name: str, v: object) -> AttrValue:
    if type(v) in (float, int, bool, str, type(None)) and name != "dtype":
        return v  # already canonical (the common case)
    if name == "dtype" and v is not None and not isinstance(v, np.dtype):
        try:
            return np.dtype(v)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            pass  # not a dtype: the op's check names the problem
    return _freeze_value(v)


def _freeze_value(v: object) -> AttrValue:
    if isinstance(v, (list, tuple)):
        return tuple(_freeze_value(x) for x in v)
    if isinstance(v, slice):
        return ("slice", _freeze_value(v.start), _freeze_value(v.stop), _freeze_value(v.step))
    if isinstance(v, Mapping):  # keys sorted by repr: keys of mixed types (1, "a") sort too
        return tuple(sorted(((k, _freeze_value(x)) for k, x in v.items()), key=lambda kv: repr(kv[0])))
    if isinstance(v, (np.bool_, np.integer, np.floating)):
        return v.item()
    return v


def attr_key(items: Iterable[tuple[str, object]]) -> KernelKey:
    """The kernel-cache key of attributes ``items`` (``(name, value)`` pairs): sorted by name, typed.

    Each value is keyed with its exact type, recursively through tuples, so
    ``True``, ``1``, ``1.0`` and ``np.int64(1)`` are four keys although Python
    hashes them alike: whether an attribute is accepted never depends on which
    equal value was cached first. ``record``'s fast path and
    :func:`~tapeflow._core._tape.check_op` key raw attributes with it; :func:`get_fwd`
    keys the :func:`normalize_attrs` form (:func:`kernel_key`).

    >>> attr_key({"axis": True}.items()) == attr_key({"axis": 1}.items())
    False
    >>> key = attr_key({"keepdims": False, "axis": (0, 1)}.items())
    >>> key  # doctest: +NORMALIZE_WHITESPACE
    (('axis', ((<class 'int'>, <class 'int'>), (0, 1))),
     ('keepdims', <class 'bool'>, False))
    """
    out: list[tuple[object, ...]] = []
    for k, v in items:
        t = type(v)
        if t is tuple:
            out.append((k, _typed_tuple(v)))  # type: ignore[arg-type]
        elif t is float and _negative_zero(v):
            out.append((k, t, v, _NEG_ZERO))  # -0.0 == 0.0, but a kernel may tell them apart (1 / x)
        else:
            out.append((k, t, v))
    out.sort()
    return tuple(out)


_NESTED = object()  # marks a typed tuple that holds tuples, or a -0.0
_NEG_ZERO = "-0.0"  # marks a key of -0.0 (equal to 0.0 and hashed alike, so keyed apart by this mark)


def _typed_tuple(v: tuple[object, ...]) -> tuple[object, ...]:
    """A flat tuple as ``(element types, v)``; a nested one (or one holding -0.0) as ``(_NESTED, typed element, ...)``."""
    ts = tuple(map(type, v))
    if tuple in ts or (float in ts and any(map(_negative_zero, v))):
        return (_NESTED, *[_typed_tuple(x) if type(x) is tuple else _typed_scalar(x) for x in v])
    return (ts, v)


def _typed_scalar(x: object) -> tuple[object, ...]:
    return (float, x, _NEG_ZERO) if _negative_zero(x) else (type(x), x)


def _negative_zero(x: object) -> bool:
    """``x`` is the float -0.0 (which equals 0.0 and hashes alike)."""
    return type(x) is float and x == 0.0 and math.copysign(1.0, x) < 0.0


# --------------------------------------------------------------------------- kernels

KernelKey: TypeAlias = tuple[tuple[object, ...], ...]  # the attributes' part of a kernel-cache key
RuntimeValues: TypeAlias = dict[str, int | float]  # runtime attribute values: traced keyword arguments of a kernel


def kernel_key(
    d: OpDef, items: Sequence[tuple[str, AttrValue]], traced: Container[str] | None = None
) -> tuple[KernelKey, RuntimeValues]:
    """:func:`attr_key` of op ``d``'s attributes ``items``, less the values of runtime attributes.

    A float or int32-range int given for a runtime attribute (``traced``, default ``d.runtime``)
    is keyed by a ``(name, type)`` pair and returned to pass to the kernel.

    >>> kernel_key(REGISTRY["clamp"], (("hi", None), ("lo", 0.5)))
    ((('hi', <class 'NoneType'>, None), ('lo', <class 'float'>)), {'lo': 0.5})
    """
    runtime = d.runtime if traced is None else traced
    rt = {k: v for k, v in items if k in runtime and (type(v) is float or (type(v) is int and -(2**31) <= v < 2**31))}
    if not rt:
        return attr_key(items), rt
    return tuple(sorted([*attr_key([i for i in items if i[0] not in rt]), *((k, type(v)) for k, v in rt.items())])), rt


@dataclasses.dataclass(eq=False, slots=True)
class FwdEntry:
    """A checked, compiled forward for one cache key; never mutated (not frozen: cheaper to create).

    ``opdef`` is the definition it was built from: every node it records keeps it."""

    opdef: OpDef
    fn: Callable[..., Array]
    shape: tuple[int, ...]
    dtype: np.dtype
    attrs: Attrs
    diff: tuple[int, ...]  # input positions that can carry a gradient
    differentiable: bool  # output dtype can carry a gradient
    spec: Spec = ((), OBJECT)  # (shape, dtype) of the output, shared by every node it makes
    runtime: tuple[str, ...] = ()  # attributes ``fn`` takes as keyword arguments


_FWD_CACHE = KernelCache("fwd")
FWD_KERNELS = _FWD_CACHE  # checked forwards by their full key: check_op's fast path gets, and marks while crowded
_VJP_CACHE = KernelCache("vjp")
_JIT_FWD = KernelCache("fwd_jit")  # one jitted forward per (op, attrs), shared by its shapes


def _attr_error(d: OpDef, attrs: Mapping[str, AttrValue]) -> str | None:
    if unknown := sorted(set(attrs) - set(d.defaults)):
        return f"unknown attribute(s) {', '.join(unknown)}; allowed: {', '.join(sorted(d.defaults)) or 'none'}"
    if missing := sorted(k for k, v in d.defaults.items() if v is REQUIRED and k not in attrs):
        return f"missing required attribute(s) {', '.join(missing)}"
    return None


def _check_error(d: OpDef, specs: tuple[Spec, ...], full: Mapping[str, AttrValue]) -> str | None:
    try:
        return None if d.check is None else d.check(specs, **full)
    except Exception as e:  # a check must not raise, but never let it escape
        return f"invalid operands or attributes ({type(e).__name__}: {e})"


def describe(specs: Sequence[Spec]) -> str:
    return ", ".join(f"#{i} {fmt_spec(s)}" for i, s in enumerate(specs)) or "none"


def build_fwd(d: OpDef, attrs: Attrs, specs: tuple[Spec, ...]) -> FwdEntry | str:
    """Check operands and compile the forward (given runtime attributes: keyword arguments of ``fn``), or say why not."""
    (lo, hi), n = d.arity, len(specs)
    if n < lo or (hi is not None and n > hi):
        want = str(lo) if lo == hi else f"{lo} to {hi if hi is not None else 'any number of'}"
        return f"expects {want} operand(s), got {n}"
    given = dict(attrs)
    full = {**d.defaults, **given}
    if msg := _attr_error(d, given) or _check_error(d, specs, full):
        return msg
    full_t = tuple(sorted(full.items()))
    rt = kernel_key(d, attrs)[1]
    static = {k: v for k, v in full.items() if k not in rt}
    diff = tuple(i for i in range(n) if i not in d.nondiff and is_float(specs[i][1]))
    fwd = functools.partial(d.fwd, **static)
    if any(s[1] == OBJECT for s in specs):
        if not d.exact:
            exact_ops = ", ".join(k for k, v in sorted(REGISTRY.items()) if v.exact)
            return f"exact rational (object) operands are not supported by this op; ops that are exact on rationals: {exact_ops}"
        return FwdEntry(d, fwd, (), OBJECT, full_t, diff, True, runtime=tuple(rt))
    try:
        out = jax.eval_shape(fwd, *(jax.ShapeDtypeStruct(s, t) for s, t in specs), **rt)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"operands rejected by the forward ({type(e).__name__}: {first})"
    if not isinstance(out, jax.ShapeDtypeStruct):
        return "forward must return a single array"
    jkey = kernel_cache_key(d, kernel_key(d, full_t, rt)[0])  # traced: the values given, not defaults
    fn: Callable[..., Array] | None = _JIT_FWD.hit(jkey)
    if fn is None:
        fn = jax.jit(logged_kernel(fwd, d.name, "op kernel", static))
        _JIT_FWD.put(jkey, fn)
    shape, dtype = tuple(out.shape), np.dtype(out.dtype)
    return FwdEntry(d, fn, shape, dtype, full_t, diff, is_float(dtype), (shape, dtype), tuple(rt))


def logged_kernel(
    fn: Callable[..., PyTree], op: str, kind: str, static: Mapping[str, AttrValue]
) -> Callable[..., PyTree]:
    """``fn`` as a kernel to jit, named after ``op``, that tells the compile log what it is when traced."""
    attrs = tuple((k, "static value", v) for k, v in sorted(static.items()))

    def kernel(*xs: Array, **rt: AttrValue) -> PyTree:
        sig = [*_compile_log.arrays([(f"operand {i}", x) for i, x in enumerate(xs)]), *attrs]
        # one function per op, attributes and operand shapes but the first axis of those with two or more: a
        # model has a kernel per layer shape by design, one kernel compiled for many batch sizes is the recompile
        # to warn about
        rest = tuple((sh if len(sh) < 2 else (None, *sh[1:]), jnp.result_type(x)) for x in xs for sh in [jnp.shape(x)])
        _compile_log.traced(kernel.__name__, f"{kind} {op}", (kind, op, attrs, rest), sig, group="kernels")
        return fn(*xs, **rt)

    kernel.__name__ = kernel.__qualname__ = f"{op}_{kind.split()[0].lower()}"
    return kernel


def definition(op: str | OpDef) -> OpDef:
    """The definition ``op`` names: the op registered under a name, or an :class:`OpDef` as it is (a node's own)."""
    return REGISTRY[op] if type(op) is str else op  # type: ignore[return-value]


def reference(d: OpDef) -> str | OpDef:
    """How an attribute names definition ``d`` (a recorded VJP's ``node_op``): its name while registered, else ``d``."""
    return d.name if REGISTRY.get(d.name) is d else d


def kernel_cache_key(d: OpDef, *rest: Hashable) -> tuple[Hashable, ...]:
    """The kernel-cache key of definition ``d``: ``(name, *rest)`` while ``d`` is registered, else ``d`` appended.

    The one rule that keeps the kernels of two definitions of one name apart: a node recorded before
    its op was redefined or unregistered still computes, differentiates and pushes tangents with its own
    definition, and never finds (or leaves) a kernel under the key of the definition that holds the name now.
    """
    key = (d.name, *rest)
    return key if REGISTRY.get(d.name) is d else (*key, d)


def get_fwd(op: str | OpDef, attrs: Attrs, specs: tuple[Spec, ...]) -> FwdEntry | str:
    """Cached :func:`build_fwd` of normalized ``attrs``, keyed by :func:`kernel_key`, bound to runtime values.

    ``op`` is a registered name or a definition (a node's: see :func:`kernel_cache_key`).
    A rejected call (never cached) leaves the caches as they were, LRU order included.
    """
    d = definition(op)
    akey, rt = kernel_key(d, attrs) if attrs else ((), {})
    key = kernel_cache_key(d, akey, specs)
    e: FwdEntry | None = _FWD_CACHE.get(key)
    if e is None:
        built = build_fwd(d, attrs, specs)
        if isinstance(built, str):
            return built
        _FWD_CACHE.put(key, e := built)
    if e.runtime:  # check this call's values, then bind them
        full = {**d.defaults, **dict(attrs)}
        if msg := _check_error(d, specs, full):
            return msg
        fn = functools.partial(e.fn, **{k: full[k] for k in e.runtime})
        e = FwdEntry(d, fn, e.shape, e.dtype, tuple(sorted(full.items())), e.diff, e.differentiable, e.spec)
    _FWD_CACHE.hit(key)
    return e


def _derived_vjp(d: OpDef, attrs: dict[str, AttrValue], mask: tuple[bool, ...]) -> Callable[..., tuple[Array, ...]]:
    def vjp(g: Array, out: Array, *xs: Array, **rt: int | float | jax.Array) -> tuple[Array, ...]:
        pos = [i for i, m in enumerate(mask) if m]

        def f(*dx: Array) -> Array:
            full = list(xs)
            for i, v in zip(pos, dx):
                full[i] = v
            return d.fwd(*full, **attrs, **rt)

        _, pull = jax.vjp(f, *(xs[i] for i in pos))
        return tuple(pull(g))

    return vjp


def get_vjp(
    op: str | OpDef, attrs: Attrs, specs: tuple[Spec, ...], mask: tuple[bool, ...]
) -> Callable[..., tuple[Array, ...]]:
    """Compiled ``(g, out, *inputs) -> cotangents of the masked inputs``, bound to runtime values in ``attrs``.

    ``op`` is a registered name or a definition (a node's: see :func:`kernel_cache_key`)."""
    d = definition(op)
    akey, rt = kernel_key(d, attrs) if attrs else ((), {})
    key = kernel_cache_key(d, akey, specs, mask)
    fn = _VJP_CACHE.hit(key)
    if fn is None:
        static = {k: v for k, v in attrs if k not in rt}
        if d.vjp is None:
            body = _derived_vjp(d, static, mask)
        else:
            user = d.vjp

            def body(g: Array, out: Array, *xs: Array, **rt: int | float | jax.Array) -> tuple[Array, ...]:
                cts = user(g, out, *xs, **static, **rt)
                return tuple(c for c, m in zip(cts, mask) if m)

        fn = body if any(s[1] == OBJECT for s in specs) else jax.jit(logged_kernel(body, d.name, "VJP kernel", static))
        _VJP_CACHE.put(key, fn)
    return functools.partial(fn, **rt) if rt else fn


# --------------------------------------------------------------------------- helpers for op definitions


def xp_of(x: Array) -> ModuleType:
    """The array namespace for ``x``: NumPy for exact object arrays, else ``jax.numpy``."""
    return np if isinstance(x, np.ndarray) and x.dtype == OBJECT else jnp


def unbroadcast(g: Array, shape: Shape) -> Array:
    """Sum ``g`` over the axes along which an operand of ``shape`` was broadcast."""
    gshape = tuple(g.shape)
    if gshape == tuple(shape):
        return g
    lead = len(gshape) - len(shape)
    axes = tuple(range(lead)) + tuple(i + lead for i, s in enumerate(shape) if s == 1 and gshape[i + lead] != 1)
    xp = xp_of(g)
    if axes:
        g = xp.sum(g, axis=axes)
    return xp.reshape(g, shape)


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...] | None:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        return None
