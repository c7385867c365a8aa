"""Opening the registry: any JAX function as an op (:func:`lift`), or a hand-written VJP (:func:`defop`).

A lifted or user-defined op is an ordinary registry entry: it is checked with
``jax.eval_shape`` before anything is recorded (a failed check, or a function
that raises while traced, leaves the tape unchanged and names the op and the
operand shapes), its forward and VJP are ``jax.jit``-compiled and cached per
(shapes, dtypes, static arguments), and the pure core records it with
``tfl.record(tape, name, inputs, **static)``.

A function that returns several arrays (a tuple, a dict, any pytree) records one
node per output leaf: the op takes an extra attribute ``output`` (the index of
the leaf in ``jax.tree_util.tree_leaves`` order), and on a session the lifted
function returns the same pytree of handles. In eager mode each output node runs
the function once (under ``jax.jit`` XLA merges the copies).

>>> import jax.numpy as jnp, tapeflow as tfl
>>> t, x = tfl.leaf(tfl.Tape.empty(), jnp.array([1.0, 2.0]), requires_grad=True)
>>> cube = tfl.lift(lambda v: v**3, name="doc_cube_lifted")
>>> t, y = tfl.record(t, "doc_cube_lifted", (x,))
>>> tfl.backward(t, y.value, seed=jnp.ones(2))[x].tolist()
[3.0, 12.0]
>>> # (the doctests leave the registry as they found it)
>>> R.unregister("doc_cube_lifted").name
'doc_cube_lifted'
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import TypeAlias, overload

import jax
import jax.numpy as jnp

from .._core import _registry as R
from .._core._fnkey import same_function
from .._core._result import TapeError
from .._core._typing import Array, Attrs, AttrValue, PyTree
from ._params import Param
from ._tensor import Operand, Tensor, session_of

__all__ = ["defop", "lift"]

JaxFn: TypeAlias = Callable[..., PyTree]
"""A JAX-traceable function of arrays (positional) and static Python values (keyword)."""

VjpFn: TypeAlias = Callable[..., object]
"""``vjp(g, out, *operands, **attrs)``: one cotangent per operand (None for a non-differentiable one); checked on return."""

CheckFn: TypeAlias = Callable[..., "str | None"]
"""``check(specs, **attrs)``: an error message for bad operand shapes/dtypes or attributes, else None."""

_P = inspect.Parameter
_HANDLES = (Tensor, Param)
_OUTPUT = "output"  # the attribute that picks one output leaf of a lifted function


# --------------------------------------------------------------------------- names


def _register(name: object, source: Callable[..., object], replace: bool, make: Callable[[str], R.OpDef]) -> R.OpDef:
    """Register op ``name`` with ``make(name)``, in place of an earlier user registration if allowed.

    Built-in names are refused; a taken user name is refused unless ``source`` is
    the function registered there (or computes the same function now:
    :func:`~tapeflow._core._fnkey.same_function`, the rule that also decides which
    optimizers share a compiled update) or ``replace`` is true. Then the old op
    and its kernels go, and if ``make`` raises, the old op is put back (:func:`~tapeflow._core._registry.restore`).
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"op name must be a non-empty string, got {name!r}")
    old = R.REGISTRY.get(name)
    if old is not None:
        if not old.user:
            raise TapeError(f"{name!r} is a built-in op; pick another name for your op")
        if not replace and not same_function(old.source, source):
            raise TapeError(
                f"op {name!r} is already registered with a different function ({old.source!r}); pass replace=True "
                "to redefine it, or choose another name"
            )
        R.unregister(name)
    try:
        return make(name)
    except BaseException:
        if old is not None:
            R.restore(old)  # also in place of the new op if it was registered, then refused
        elif name in R.REGISTRY:  # registered, then refused (e.g. a bad nondiff_argnums)
            R.unregister(name)
        raise


# --------------------------------------------------------------------------- lift


def _layout(
    fn: Callable[..., object], static: tuple[str, ...]
) -> tuple[inspect.Signature, list[tuple[str, str, object]] | None]:
    """The op forward's signature for ``fn``, and how to call ``fn`` from the forward's arguments.

    Operands are ``fn``'s leading positional parameters without a default (then
    those defaulting to None: optional operands) and its ``*args``; a positional
    parameter with another default ends them (``fn`` keeps that default). The
    ``static`` parameters become keyword-only attributes, after ``output``. The
    second result is None when ``fn(*operands, **static)`` calls ``fn`` right;
    else it lists the leading positional slots, ``(kind, name, default)`` with
    kind ``"operand"``, ``"static"`` or ``"default"``, to fill before the rest.
    """
    if _OUTPUT in static:
        raise TypeError(f"{_OUTPUT!r} is reserved (it picks an output leaf); rename that static argument of {fn!r}")
    try:
        sig: inspect.Signature | None = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    operands: list[_P] = []
    statics: dict[str, _P] = {}
    slots: list[tuple[str, str, object]] = []
    var_kw = sig is None
    done = False  # a positional parameter with a non-None default ends the operands
    for p in sig.parameters.values() if sig is not None else ():
        positional = p.kind in (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)
        if p.name in static:
            if p.kind in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD):
                raise TypeError(f"static_argnames names {p.name!r}, a variadic parameter of {fn!r}")
            default = R.REQUIRED if p.default is _P.empty else p.default
            statics[p.name] = _P(p.name, _P.KEYWORD_ONLY, default=default)
            if positional:
                slots.append(("static", p.name, p.default))
        elif p.kind is _P.VAR_POSITIONAL:
            if not done:
                operands.append(_P(p.name, _P.VAR_POSITIONAL))
            done = True
        elif positional:
            if not done and p.default in (_P.empty, None):
                operands.append(_P(p.name, _P.POSITIONAL_ONLY, default=p.default))
                slots.append(("operand", p.name, p.default))
            else:
                done = True
                slots.append(("default", p.name, p.default))
        elif p.kind is _P.KEYWORD_ONLY and p.default is _P.empty:
            raise TypeError(
                f"{fn!r}: keyword-only parameter {p.name!r} has no default; name it in static_argnames (a "
                "hashable Python value) or give it a default"
            )
        var_kw = var_kw or p.kind is _P.VAR_KEYWORD
    if sig is None:  # a builtin without a signature: any number of operands
        operands.append(_P("xs", _P.VAR_POSITIONAL))
    missing = [s for s in static if s not in statics]
    if missing and not var_kw:
        raise TypeError(f"static_argnames {missing} are not parameters of {fn!r}")
    statics.update((s, _P(s, _P.KEYWORD_ONLY, default=R.REQUIRED)) for s in missing)
    # statics passed by keyword are fine unless one must be positional: positional-only or before an operand
    var_operands = any(p.kind is _P.VAR_POSITIONAL for p in operands)
    must = [
        i
        for i, (kind, name, _) in enumerate(slots)
        if kind == "static"
        and (
            var_operands
            or any(k == "operand" for k, _, _ in slots[i:])
            or (sig is not None and sig.parameters[name].kind is _P.POSITIONAL_ONLY)
        )
    ]
    lead = slots[: must[-1] + 1] if must else None
    output = _P(_OUTPUT, _P.KEYWORD_ONLY, default=0, annotation="int")
    return inspect.Signature([*operands, output, *statics.values()]), lead


def _caller(fn: Callable[..., PyTree], lead: list[tuple[str, str, object]] | None) -> Callable[..., PyTree]:
    """``call(xs, kw)``: ``fn`` applied to operands ``xs`` and static arguments ``kw``."""
    if lead is None:
        return lambda xs, kw: fn(*xs, **kw)

    def call(xs: tuple[Array, ...], kw: dict[str, object]) -> PyTree:
        kw = dict(kw)
        rest = iter(xs)
        args: list[object] = []
        for kind, name, default in lead:
            if kind == "static":
                args.append(kw.pop(name))
            elif kind == "operand":
                args.append(next(rest, None))  # a missing operand is optional: its default is None
            else:
                args.append(default)
        return fn(*args, *rest, **kw)

    return call


@overload
def lift(
    fn: JaxFn, *, name: str | None = None, static_argnames: Sequence[str] | str = (), replace: bool = False
) -> Callable[..., PyTree]: ...
@overload
def lift(
    fn: None = None, *, name: str | None = None, static_argnames: Sequence[str] | str = (), replace: bool = False
) -> Callable[[JaxFn], Callable[..., PyTree]]: ...
def lift(
    fn: JaxFn | None = None,
    *,
    name: str | None = None,
    static_argnames: Sequence[str] | str = (),
    replace: bool = False,
) -> Callable[..., PyTree] | Callable[[JaxFn], Callable[..., PyTree]]:
    """Make the JAX function ``fn`` an op: on session tensors it records, on arrays it just runs ``fn``.

    ``fn`` takes arrays positionally (its operands: the positional parameters
    without a default, then those defaulting to None, or ``*args``) and, by
    keyword, the static arguments named in ``static_argnames`` (hashable Python
    values: each distinct value compiles its own kernels). The forward is ``fn``
    under ``jax.jit`` and the gradient is ``jax.vjp`` of ``fn``, so a
    ``jax.custom_vjp`` / ``jax.custom_jvp`` function keeps its own rule. If ``fn``
    returns a pytree of arrays, each leaf is its own node and the lifted function
    returns the same pytree of handles.

    The op is registered as ``name`` (default: ``fn``'s module and qualified
    name, e.g. ``"jax.numpy.tanh"``), so the pure core records it with
    ``tfl.record(tape, name, inputs, **static)`` (``output=k`` for leaf ``k``).
    Built-in op names cannot be taken. Registering a different function under a
    taken name is an error unless ``replace=True``; registering the same function
    again (a re-run notebook cell) replaces it quietly. Usable as a decorator,
    with or without arguments; the lifted function's ``op`` is its
    :class:`~tapeflow.OpDef`.

    >>> import jax, jax.numpy as jnp, tapeflow as tfl
    >>> softplus = tfl.lift(jax.nn.softplus, name="doc_softplus")
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([0.0, 1.0]), requires_grad=True)
    ...     g = s.backward(tfl.sum(softplus(x)))
    ...     [round(v, 4) for v in g[x].tolist()]
    [0.5, 0.7311]
    >>> @tfl.lift(name="doc_minmax")
    ... def minmax(x):
    ...     return jnp.min(x), jnp.max(x)
    >>> with tfl.Session() as s:
    ...     lo, hi = minmax(s.input(jnp.array([3.0, -1.0, 2.0])))
    ...     float(lo), float(hi)
    (-1.0, 3.0)
    >>> float(minmax(jnp.array([3.0, -1.0]))[1])  # plain arrays: just the function
    3.0
    >>> # (the doctests leave the registry as they found it)
    >>> for op in ("doc_softplus", "doc_minmax"):
    ...     _ = R.unregister(op)
    """
    static = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    if fn is None:

        def deco(f: JaxFn) -> Callable[..., PyTree]:
            return lift(f, name=name, static_argnames=static, replace=replace)

        return deco
    if not callable(fn):
        raise TypeError(f"lift expects a function, got {type(fn).__name__}")
    if name is None:
        qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
        if not isinstance(qual, str):
            raise TypeError(f"lift: {fn!r} has no __qualname__ to name its op by; pass name=...")
        module = getattr(fn, "__module__", None)
        name = f"{module}.{qual}" if isinstance(module, str) else qual
    sig, lead = _layout(fn, static)
    call = _caller(fn, lead)
    statics = {p.name: p.default for p in sig.parameters.values() if p.name in static}
    static_set = frozenset(static)
    multi = False  # set once fn has returned anything but a single array (then outputs are looked up)

    def forward(*xs: Array, output: int = 0, **kw: object) -> Array:
        nonlocal multi
        leaves, treedef = jax.tree_util.tree_flatten(call(xs, kw))
        if not _single(treedef):
            multi = True
        if output >= len(leaves):
            raise IndexError(f"output={output}, but the function returns {len(leaves)} array(s)")
        return leaves[output]

    forward.__signature__ = sig  # type: ignore[attr-defined]
    forward.__doc__ = inspect.getdoc(fn) or f"The lifted function {name}."

    def make(opname: str) -> R.OpDef:
        return R.op(opname, attrs={_OUTPUT: 0, **statics}, check=_check_output, public=False, user=fn)(forward)

    d = _register(name, fn, replace, make)
    opname = d.name
    structures: dict[object, tuple[jax.tree_util.PyTreeDef, int]] = {}

    def outputs(specs: tuple[R.Spec, ...], attrs: Attrs) -> tuple[jax.tree_util.PyTreeDef, int]:
        key = (specs, R.attr_key(attrs))
        got = structures.get(key)
        if got is None:
            kw = dict(attrs)
            out = jax.eval_shape(lambda *xs: call(xs, kw), *(jax.ShapeDtypeStruct(s, t) for s, t in specs))
            leaves, treedef = jax.tree_util.tree_flatten(out)
            got = structures[key] = (treedef, len(leaves))
        return got

    @functools.wraps(fn, updated=())
    def lifted(*args: Operand, **kwargs: AttrValue) -> PyTree:
        if kwargs and not static_set.issuperset(kwargs):
            unknown = sorted(set(kwargs) - static_set)
            raise TypeError(
                f"{opname}: keyword argument(s) {unknown} are not static arguments of the lifted op; pass arrays "
                f"positionally, or name them in lift(..., static_argnames=...) (now {list(static)})"
            )
        for a in args:
            if isinstance(a, _HANDLES):
                break
        else:
            return call(args, kwargs)  # plain arrays (or tracers): just the function
        s = session_of(args, opname)
        first = s.apply(opname, *args, **kwargs)  # output leaf 0: checked, or nothing recorded
        if not multi:
            return first
        nd = s.node(first)
        attrs = tuple(kv for kv in nd.attrs if kv[0] != _OUTPUT)
        treedef, n = outputs(tuple(s.tape[i].spec for i in nd.parents), attrs)
        if _single(treedef):
            return first
        # the other outputs read the very operand nodes the first one recorded (a Param: the same leaf)
        operands = [s.handle(i) for i in nd.parents]
        rest = [s.apply(opname, *operands, output=k, **kwargs) for k in range(1, n)]
        return jax.tree_util.tree_unflatten(treedef, [first, *rest])

    lifted.op = d  # type: ignore[attr-defined]
    return lifted


def _single(treedef: jax.tree_util.PyTreeDef) -> bool:
    """Whether ``treedef`` is one bare array (not a tuple or dict of one)."""
    return treedef.num_leaves == 1 and treedef.num_nodes == 1


def _check_output(specs: tuple[R.Spec, ...], output: object = 0, **kw: object) -> str | None:
    if type(output) is not int or output < 0:
        return f"attribute output={output!r} must be a non-negative int (the index of an output leaf)"
    return None


# --------------------------------------------------------------------------- defop


def _checked_vjp(name: str, vjp: VjpFn) -> Callable[..., tuple[Array, ...]]:
    """``vjp`` returning exactly one cotangent per operand, of the operand's shape and dtype (None: zeros).

    A Python number takes its operand's dtype (as JAX's weak typing would); an array of another dtype is an
    error, never a cast: a gradient that came back bfloat16 or truncated to int32 is a bug in the VJP.
    """

    def checked(g: Array, out: Array, *xs: Array, **attrs: AttrValue) -> tuple[Array, ...]:
        cts = vjp(g, out, *xs, **attrs)
        if not isinstance(cts, (tuple, list)):
            if len(xs) != 1:
                raise TypeError(
                    f"{name}: the vjp must return a tuple of {len(xs)} cotangents, one per operand; "
                    f"got {type(cts).__name__}"
                )
            cts = (cts,)
        if len(cts) != len(xs):
            raise TypeError(f"{name}: the vjp returned {len(cts)} cotangent(s) for {len(xs)} operand(s)")
        fixed = []
        for i, (c, x) in enumerate(zip(cts, xs)):
            if c is None:
                c = jnp.zeros_like(x)
            elif jnp.shape(c) != jnp.shape(x):
                raise ValueError(
                    f"{name}: the vjp's cotangent #{i} has shape {jnp.shape(c)}, but operand #{i} has shape "
                    f"{jnp.shape(x)}"
                )
            elif isinstance(c, (int, float)):
                c = jnp.asarray(c, x.dtype)
            elif (got := jnp.result_type(c)) != x.dtype:
                raise TypeError(
                    f"{name}: the vjp's cotangent #{i} is {got}, but operand #{i} is {x.dtype}; return the "
                    f"cotangent in its operand's dtype (e.g. .astype(x.dtype)), or None where none flows"
                )
            fixed.append(c)
        return tuple(fixed)

    return checked


def defop(
    name: str,
    forward: Callable[..., Array],
    vjp: VjpFn | None,
    *,
    check: CheckFn | None = None,
    nondiff_argnums: Sequence[int] = (),
    doc: str | None = None,
    replace: bool = False,
) -> R.OpDef:
    """Register op ``name`` with a hand-written VJP; returns its :class:`~tapeflow.OpDef`.

    ``forward(*operands, **attrs)``: its positional parameters are the operands
    (one defaulting to None is optional, ``*xs`` takes any number), its
    keyword-only parameters the attributes (hashable Python values; with a
    default, or required). ``vjp(g, out, *operands, **attrs)`` returns one
    cotangent per operand, each of its operand's shape (None where none flows);
    ``vjp=None`` derives it with ``jax.vjp`` of ``forward``. Keep the VJP written
    in ``jax.numpy`` so that it can be differentiated again. ``check(specs,
    **attrs)`` gets each operand's ``(shape, dtype)`` and returns an error
    message or None; it runs before ``jax.eval_shape`` of the forward, and either
    failing leaves the tape unchanged. ``nondiff_argnums`` are operand positions
    that never get a gradient; ``doc`` replaces ``forward``'s docstring as the
    op's description. Name rules are those of :func:`lift`. Record the op with
    ``tfl.apply(name, ...)`` on a session or ``tfl.record(tape, name, ids,
    **attrs)`` on the pure core.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> def cube(x, *, scale=1.0):
    ...     return scale * x**3
    >>> def cube_vjp(g, out, x, *, scale=1.0):
    ...     return (g * 3 * scale * x**2,)
    >>> d = tfl.defop("doc_cube", cube, cube_vjp)
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array(2.0), requires_grad=True)
    ...     float(s.backward(tfl.apply("doc_cube", x, scale=0.5))[x])
    6.0
    >>> R.unregister("doc_cube") is d  # leave the registry as it was
    True
    """
    if not callable(forward):
        raise TypeError(f"defop({name!r}): forward must be a function, got {type(forward).__name__}")
    if vjp is not None and not callable(vjp):
        raise TypeError(f"defop({name!r}): vjp must be a function or None, got {type(vjp).__name__}")
    if check is not None and not callable(check):
        raise TypeError(f"defop({name!r}): check must be a function or None, got {type(check).__name__}")
    nondiff = tuple(nondiff_argnums)
    if not all(type(i) is int and i >= 0 for i in nondiff):
        raise TypeError(f"defop({name!r}): nondiff_argnums must be non-negative ints, got {nondiff!r}")
    sig = inspect.signature(forward)
    attrs = {
        p.name: (R.REQUIRED if p.default is _P.empty else p.default)
        for p in sig.parameters.values()
        if p.kind is _P.KEYWORD_ONLY
    }
    fwd = forward
    if doc is not None:

        def fwd(*a: Array, **k: AttrValue) -> Array:
            return forward(*a, **k)

        fwd.__signature__ = sig  # type: ignore[attr-defined]
        fwd.__doc__ = doc

    def make(opname: str) -> R.OpDef:
        d = R.op(opname, attrs=attrs, nondiff=nondiff, check=check, public=False, user=forward)(fwd)
        hi = d.arity[1]
        if hi is not None and any(i >= hi for i in nondiff):
            raise ValueError(f"defop({opname!r}): nondiff_argnums {nondiff} out of range for {hi} operand(s)")
        if vjp is not None:
            d.defvjp(_checked_vjp(opname, vjp))
        return d

    return _register(name, forward, replace, make)
