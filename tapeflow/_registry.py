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

Forward and VJP kernels are ``jax.jit``-compiled and cached per
``(op, attrs, shapes, dtypes)`` (plus, for VJPs, which inputs need a gradient),
so recording an op in eager mode costs one compiled dispatch. Inside an outer
``jax.jit`` the same kernels inline into the caller's trace.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "OpDef",
    "Spec",
    "op",
    "REGISTRY",
    "ops",
    "kernel_cache_info",
    "clear_kernel_caches",
]

Spec = tuple[tuple[int, ...], np.dtype]
"""Shape and dtype of one operand."""

REQUIRED: Any = object()
"""Marker for an attribute without a default."""

OBJECT = np.dtype(object)


def fmt_spec(spec: Spec) -> str:
    shape, dtype = spec
    name = "rational" if dtype == OBJECT else str(dtype)
    return f"{name}[{','.join(map(str, shape))}]"


def is_float(dtype: np.dtype) -> bool:
    """Whether values of ``dtype`` can carry gradients (floating or exact rational)."""
    return dtype == OBJECT or jnp.issubdtype(dtype, jnp.inexact)


@dataclasses.dataclass(eq=False)
class OpDef:
    """One registered op. Create it with :func:`op`, never directly."""

    name: str
    fwd: Callable[..., Any]
    check: Callable[..., str | None] | None
    arity: tuple[int, int | None]
    defaults: Mapping[str, Any]
    nondiff: frozenset[int]
    exact: bool
    vjp: Callable[..., Sequence[Any]] | None = None
    doc: str = ""

    def defvjp(self, vjp: Callable[..., Sequence[Any]]) -> Callable[..., Sequence[Any]]:
        """Attach the VJP ``vjp(g, out, *inputs, **attrs) -> cotangents``."""
        self.vjp = vjp
        return vjp

    def __repr__(self) -> str:
        return f"<op {self.name}>"


REGISTRY: dict[str, OpDef] = {}


def op(
    name: str,
    *,
    arity: int | tuple[int, int | None],
    attrs: Mapping[str, Any] | None = None,
    nondiff: Sequence[int] = (),
    exact: bool = False,
    check: Callable[..., str | None] | None = None,
) -> Callable[[Callable[..., Any]], OpDef]:
    """Register the decorated function as the forward of op ``name``.

    ``arity`` is an exact count or ``(min, max)`` (``max=None``: variadic).
    ``attrs`` maps each allowed attribute to its default (``REQUIRED`` for none).
    ``nondiff`` lists input positions that never get a gradient (labels, indices).
    ``exact`` marks ops whose forward and VJP are exact on rational object arrays.
    """

    def deco(fwd: Callable[..., Any]) -> OpDef:
        if name in REGISTRY:
            raise ValueError(f"op {name!r} is already registered")
        ar = (arity, arity) if isinstance(arity, int) else arity
        d = OpDef(
            name=name,
            fwd=fwd,
            check=check,
            arity=ar,
            defaults=dict(attrs or {}),
            nondiff=frozenset(nondiff),
            exact=exact,
            doc=(fwd.__doc__ or "").strip(),
        )
        REGISTRY[name] = d
        return d

    return deco


def ops() -> list[str]:
    """Names of every registered op, sorted."""
    return sorted(REGISTRY)


# --------------------------------------------------------------------------- kernels


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
class FwdEntry:
    """A checked, compiled forward for one cache key."""

    fn: Callable[..., Any]
    shape: tuple[int, ...]
    dtype: np.dtype
    attrs: tuple[tuple[str, Any], ...]
    diff: tuple[int, ...]  # input positions that can carry a gradient
    differentiable: bool  # output dtype can carry a gradient
    spec: Spec = ((), OBJECT)  # (shape, dtype) of the output, shared by every node it makes


_FWD_CACHE: dict[Any, FwdEntry] = {}
_VJP_CACHE: dict[Any, Callable[..., Any]] = {}
_JIT_FWD: dict[Any, Callable[..., Any]] = {}


def kernel_cache_info() -> dict[str, int]:
    """Number of cached forward and VJP kernels (keys: ``"fwd"``, ``"vjp"``).

    >>> import tapeflow as tfl
    >>> sorted(tfl.kernel_cache_info())
    ['fwd', 'vjp']
    """
    return {"fwd": len(_FWD_CACHE), "vjp": len(_VJP_CACHE)}


def clear_kernel_caches() -> None:
    """Drop every cached kernel (they are rebuilt on next use)."""
    _FWD_CACHE.clear()
    _VJP_CACHE.clear()
    _JIT_FWD.clear()


def _attr_error(d: OpDef, attrs: Mapping[str, Any]) -> str | None:
    unknown = sorted(set(attrs) - set(d.defaults))
    if unknown:
        allowed = ", ".join(sorted(d.defaults)) or "none"
        return f"unknown attribute(s) {', '.join(unknown)}; allowed: {allowed}"
    missing = sorted(k for k, v in d.defaults.items() if v is REQUIRED and k not in attrs)
    if missing:
        return f"missing required attribute(s) {', '.join(missing)}"
    return None


def describe(specs: Sequence[Spec]) -> str:
    return ", ".join(f"#{i} {fmt_spec(s)}" for i, s in enumerate(specs)) or "none"


def build_fwd(d: OpDef, attrs: tuple[tuple[str, Any], ...], specs: tuple[Spec, ...]) -> FwdEntry | str:
    """Check operands and compile the forward; return an entry or an error message."""
    lo, hi = d.arity
    n = len(specs)
    if n < lo or (hi is not None and n > hi):
        want = str(lo) if lo == hi else f"{lo} to {hi if hi is not None else 'any number of'}"
        return f"expects {want} operand(s), got {n}"
    given = dict(attrs)
    msg = _attr_error(d, given)
    if msg:
        return msg
    full = {**d.defaults, **given}
    if d.check is not None:
        try:
            msg = d.check(specs, **full)
        except Exception as e:  # a check must not raise, but never let it escape
            msg = f"invalid operands or attributes ({type(e).__name__}: {e})"
        if msg:
            return msg
    full_t = tuple(sorted(full.items()))
    diff = tuple(i for i in range(n) if i not in d.nondiff and is_float(specs[i][1]))
    if any(s[1] == OBJECT for s in specs):
        if not d.exact:
            exact_ops = ", ".join(k for k, v in sorted(REGISTRY.items()) if v.exact)
            return (
                "exact rational (object) operands are not supported by this op; "
                f"ops that are exact on rationals: {exact_ops}"
            )
        fn = functools.partial(d.fwd, **full)
        return FwdEntry(fn, (), OBJECT, full_t, diff, True)
    fwd = functools.partial(d.fwd, **full)
    try:
        out = jax.eval_shape(fwd, *(jax.ShapeDtypeStruct(s, t) for s, t in specs))
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"operands rejected by the forward ({type(e).__name__}: {first})"
    if not isinstance(out, jax.ShapeDtypeStruct):
        return "forward must return a single array"
    fn = _JIT_FWD.get((d.name, full_t))
    if fn is None:
        fn = _JIT_FWD[(d.name, full_t)] = jax.jit(fwd)
    shape, dtype = tuple(out.shape), np.dtype(out.dtype)
    return FwdEntry(fn, shape, dtype, full_t, diff, is_float(dtype), (shape, dtype))


def get_fwd(name: str, attrs: tuple[tuple[str, Any], ...], specs: tuple[Spec, ...]) -> FwdEntry | str:
    """Cached :func:`build_fwd`. Errors are not cached: a rejected call leaves the caches as they were."""
    key = (name, attrs, specs)
    e = _FWD_CACHE.get(key)
    if e is None:
        e = build_fwd(REGISTRY[name], attrs, specs)
        if type(e) is not str:
            _FWD_CACHE[key] = e
    return e


def _derived_vjp(d: OpDef, attrs: dict[str, Any], mask: tuple[bool, ...]) -> Callable[..., Any]:
    def vjp(g: Any, out: Any, *xs: Any) -> tuple[Any, ...]:
        pos = [i for i, m in enumerate(mask) if m]

        def f(*dx: Any) -> Any:
            full = list(xs)
            for i, v in zip(pos, dx):
                full[i] = v
            return d.fwd(*full, **attrs)

        _, pull = jax.vjp(f, *(xs[i] for i in pos))
        return tuple(pull(g))

    return vjp


def get_vjp(
    name: str, attrs: tuple[tuple[str, Any], ...], specs: tuple[Spec, ...], mask: tuple[bool, ...]
) -> Callable[..., Any]:
    """Compiled ``(g, out, *inputs) -> cotangents of the masked inputs`` for one key."""
    key = (name, attrs, specs, mask)
    fn = _VJP_CACHE.get(key)
    if fn is None:
        d = REGISTRY[name]
        full = dict(attrs)
        if d.vjp is None:
            body = _derived_vjp(d, full, mask)
        else:
            user = d.vjp

            def body(g: Any, out: Any, *xs: Any) -> tuple[Any, ...]:
                cts = user(g, out, *xs, **full)
                return tuple(c for c, m in zip(cts, mask) if m)

        if any(s[1] == OBJECT for s in specs):
            fn = body
        else:
            fn = jax.jit(body)
        _VJP_CACHE[key] = fn
    return fn


# --------------------------------------------------------------------------- helpers for op definitions


def xp_of(x: Any) -> Any:
    """The array namespace for ``x``: NumPy for exact object arrays, else ``jax.numpy``."""
    return np if isinstance(x, np.ndarray) and x.dtype == OBJECT else jnp


def unbroadcast(g: Any, shape: tuple[int, ...]) -> Any:
    """Sum ``g`` over the axes along which an operand of ``shape`` was broadcast."""
    gshape = tuple(g.shape)
    if gshape == tuple(shape):
        return g
    lead = len(gshape) - len(shape)
    axes = tuple(range(lead)) + tuple(
        i + lead for i, s in enumerate(shape) if s == 1 and gshape[i + lead] != 1
    )
    xp = xp_of(g)
    if axes:
        g = xp.sum(g, axis=axes)
    return xp.reshape(g, shape)


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...] | None:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        return None
