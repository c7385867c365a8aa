"""Shape, indexing, gather and scatter ops of the registry.

Each op is one block: the forward (decorated with :func:`~tapeflow._core._registry.op`),
its VJP (``@<op>.defvjp``) and its check (``check=`` argument). The pure
data-movement ops (reshape, transpose, permute, broadcast_to, expand_dims,
squeeze, concat, index) are ``exact``: they also run on exact rational (object)
arrays through NumPy.

Index attributes must be hashable, so :func:`normalize_index` turns a Python
index (ints, slices, ``None``, ``Ellipsis``, or a tuple of them) into a tuple of
ints, ``None``, ``Ellipsis`` and ``("slice", start, stop, step)`` items.
Integer-array indexing goes through the ``take``, ``gather`` and
``scatter_add`` ops, whose indices are operands (nodes) rather than attributes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import EllipsisType
from typing import TypeAlias

import jax.numpy as jnp
import numpy as np

from .._core._checks import (
    as_int,
    axes_error,
    axis_error,
    broadcasts_to,
    int_tuple,
    is_int,
    is_int_dtype,
    norm_axis,
    same_dtype,
)
from .._core._registry import REQUIRED, Axes, ShapeLike, Spec, op, unbroadcast, xp_of
from .._core._typing import Array, AttrValue

__all__ = ["normalize_index"]

# --------------------------------------------------------------------------- shared helpers


def _int_operand(specs: tuple[Spec, ...], i: int, what: str) -> str | None:
    dt = specs[i][1]
    if dt == np.dtype(bool):  # a mask is not a list of positions: casting it would pick rows 0 and 1, silently
        return (
            f"{what} (operand #{i}) is a boolean mask, not integer positions; select with x[mask] on a session "
            "tensor (eager or lazy), or keep the shape with tfl.where(mask, x, 0) (what compiled steps need)"
        )
    if not is_int_dtype(dt):
        return (
            f"{what} (operand #{i}) must have an integer dtype, got {dt}; "
            "build it with jnp.asarray(..., jnp.int32) or cast it with the astype op"
        )
    return None


# --------------------------------------------------------------------------- reshape


def _reshape_check(specs: tuple[Spec, ...], shape: object) -> str | None:
    want = int_tuple(shape)
    if want is None:
        return f"attribute shape={shape!r} must be an int or a tuple of ints"
    size = math.prod(specs[0][0])
    if sum(1 for s in want if s == -1) > 1:
        return f"shape={want} has more than one -1; at most one dimension can be inferred"
    if any(s < -1 for s in want):
        return f"shape={want} has a negative dimension; only -1 (inferred) is allowed"
    known = math.prod(s for s in want if s != -1)
    if -1 in want:
        if known == 0 or size % known:
            return f"cannot infer the -1 in shape={want} for {size} element(s): {size} is not a multiple of {known}"
    elif known != size:
        return f"cannot reshape {size} element(s) into shape={want} ({known} element(s))"
    return None


@op("reshape", arity=1, attrs={"shape": REQUIRED}, exact=True, check=_reshape_check, precision="layout")
def reshape(x: Array, shape: ShapeLike) -> Array:
    """Reshape to ``shape`` (an int or tuple of ints; one entry may be -1, inferred)."""
    return xp_of(x).reshape(x, shape)


@reshape.defvjp
def _reshape_vjp(g: Array, out: Array, x: Array, shape: ShapeLike) -> tuple[Array]:
    return (xp_of(g).reshape(g, x.shape),)


# --------------------------------------------------------------------------- transpose / permute


def _perm(axes: Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    if axes is None:
        return tuple(reversed(range(ndim)))
    return tuple(int(a) % ndim for a in axes)


def _perm_check(specs: tuple[Spec, ...], axes: object) -> str | None:
    ndim = len(specs[0][0])
    if axes is None:
        return None
    t = int_tuple(axes)
    if t is None or is_int(axes):
        return f"attribute axes={axes!r} must be None or a tuple of ints (a permutation of 0..{ndim - 1})"
    if len(t) != ndim or axes_error(t, ndim) is not None:
        return (
            f"axes={t} is not a permutation of the {ndim} axes of the operand; "
            f"give each of 0..{ndim - 1} exactly once (negative axes count from the end)"
        )
    return None


def _permute_check(specs: tuple[Spec, ...], axes: object) -> str | None:
    if axes is None:
        return "permute needs an explicit axes tuple; use the transpose op to reverse all axes"
    return _perm_check(specs, axes)


def _transpose(x: Array, axes: Sequence[int] | None) -> Array:
    return xp_of(x).transpose(x, _perm(axes, x.ndim))


def _transpose_vjp(g: Array, out: Array, x: Array, axes: Sequence[int] | None) -> tuple[Array]:
    inv = tuple(int(i) for i in np.argsort(_perm(axes, x.ndim)))
    return (xp_of(g).transpose(g, inv),)


@op("transpose", arity=1, attrs={"axes": None}, exact=True, check=_perm_check, precision="layout")
def transpose(x: Array, axes: Sequence[int] | None) -> Array:
    """Permute the axes: ``axes`` is a permutation of ``range(x.ndim)``, None (default) reverses them."""
    return _transpose(x, axes)


@op("permute", arity=1, attrs={"axes": REQUIRED}, exact=True, check=_permute_check, precision="layout")
def permute(x: Array, axes: Sequence[int]) -> Array:
    """Permute the axes by ``axes`` (required; same semantics as ``transpose``)."""
    return _transpose(x, axes)


transpose.defvjp(_transpose_vjp)
permute.defvjp(_transpose_vjp)


# --------------------------------------------------------------------------- broadcast_to / expand_dims / squeeze


def _broadcast_to_check(specs: tuple[Spec, ...], shape: object) -> str | None:
    want = int_tuple(shape)
    if want is None or any(s < 0 for s in want):
        return f"attribute shape={shape!r} must be an int or a tuple of non-negative ints"
    have = specs[0][0]
    if not broadcasts_to(have, want):
        return (
            f"cannot broadcast shape {have} to {want}: aligned from the right, each dimension "
            "must equal the target or be 1 (reshape or expand_dims first to insert axes)"
        )
    return None


@op("broadcast_to", arity=1, attrs={"shape": REQUIRED}, exact=True, check=_broadcast_to_check, precision="layout")
def broadcast_to(x: Array, shape: ShapeLike) -> Array:
    """Broadcast ``x`` to ``shape`` with NumPy rules; the VJP sums over the broadcast axes."""
    return xp_of(x).broadcast_to(x, int_tuple(shape))


@broadcast_to.defvjp
def _broadcast_to_vjp(g: Array, out: Array, x: Array, shape: ShapeLike) -> tuple[Array]:
    return (unbroadcast(g, x.shape),)


def _expand_dims_check(specs: tuple[Spec, ...], axis: object) -> str | None:
    t = int_tuple(axis)
    ndim = len(specs[0][0]) + (len(t) if t is not None else 0)
    if err := axes_error(axis, ndim, of="the result"):
        return f"{err}; expand_dims axes are positions in the result"
    return None


@op("expand_dims", arity=1, attrs={"axis": REQUIRED}, exact=True, check=_expand_dims_check, precision="layout")
def expand_dims(x: Array, axis: Axes) -> Array:
    """Insert size-1 axes at ``axis`` (an int or tuple, positions in the result)."""
    return xp_of(x).expand_dims(x, int_tuple(axis))


def _reshape_back_vjp(g: Array, out: Array, x: Array, **_: object) -> tuple[Array]:
    return (xp_of(g).reshape(g, x.shape),)


expand_dims.defvjp(_reshape_back_vjp)


def _squeeze_check(specs: tuple[Spec, ...], axis: object) -> str | None:
    if axis is None:
        return None
    shape = specs[0][0]
    if err := axes_error(axis, len(shape)):
        return err
    for a in int_tuple(axis) or ():
        if shape[a] != 1:
            return (
                f"cannot squeeze axis {a}: it has size {shape[a]}, not 1 "
                "(squeeze only removes size-1 axes; use index or sum to drop others)"
            )
    return None


@op("squeeze", arity=1, attrs={"axis": None}, exact=True, check=_squeeze_check, precision="layout")
def squeeze(x: Array, axis: Axes | None) -> Array:
    """Remove size-1 axes: those named by ``axis`` (each must have size 1), or all of them if None."""
    return xp_of(x).squeeze(x, axis=None if axis is None else int_tuple(axis))


squeeze.defvjp(_reshape_back_vjp)


# --------------------------------------------------------------------------- concat


def _concat_check(specs: tuple[Spec, ...], axis: object) -> str | None:
    if err := same_dtype(specs):
        return err
    first = specs[0][0]
    if len(first) == 0:
        return "cannot concatenate scalars; give operands rank >= 1 (expand_dims or reshape them)"
    if err := axis_error(axis, len(first)):
        return err
    ax = norm_axis(axis, len(first))
    for i, (s, _) in enumerate(specs):
        if len(s) != len(first):
            return f"operand #{i} has rank {len(s)} but operand #0 has rank {len(first)}; all must have the same rank"
        if s[:ax] + s[ax + 1 :] != first[:ax] + first[ax + 1 :]:
            return (
                f"operand #{i} has shape {s} but operand #0 has shape {first}; "
                f"shapes must match on every axis except axis={axis}"
            )
    return None


@op("concat", arity=(1, None), attrs={"axis": 0}, exact=True, check=_concat_check)
def concat(*xs: Array, axis: int) -> Array:
    """Concatenate the sequence of operands ``xs`` along ``axis`` (same dtype, same shape except along ``axis``)."""
    return xp_of(xs[0]).concatenate(xs, axis=axis)


@concat.defvjp
def _concat_vjp(g: Array, out: Array, *xs: Array, axis: int) -> tuple[Array, ...]:
    ax = axis % g.ndim
    cuts = np.cumsum([x.shape[ax] for x in xs])[:-1].tolist()
    return tuple(xp_of(g).split(g, cuts, axis=ax))


# --------------------------------------------------------------------------- basic indexing


IndexItem: TypeAlias = int | EllipsisType | tuple[str, int | None, int | None, int | None] | None
"""One item of a normalized basic index (:func:`normalize_index`); a slice is ``("slice", start, stop, step)``."""


def _norm_item(v: object) -> IndexItem:
    if v is None or v is Ellipsis:
        return v
    if (n := as_int(v)) is not None:
        return n
    if isinstance(v, slice):
        v = ("slice", v.start, v.stop, v.step)
    if isinstance(v, tuple) and len(v) == 4 and v[0] == "slice":
        parts = v[1:]
        if not all(p is None or is_int(p) for p in parts):
            raise TypeError(f"slice bounds must be ints or None, got {v!r}")
        if parts[2] == 0:
            raise ValueError("slice step cannot be zero")
        start, stop, step = (None if p is None else int(p) for p in parts)
        return ("slice", start, stop, step)
    if isinstance(v, (bool, np.bool_)):
        raise TypeError("boolean indices are not supported; use the where op, or take with integer indices")
    raise TypeError(
        f"unsupported index item of type {type(v).__name__}: basic indexing takes ints, slices, "
        "None and Ellipsis; use the take or gather op for integer-array indices"
    )


def normalize_index(idx: object) -> tuple[IndexItem, ...]:
    """A hashable form of a basic index, for the ``index`` op's ``index`` attribute.

    ``idx`` is an int, a slice, ``None`` (new axis), ``Ellipsis``, or a tuple of
    them. The result is a tuple whose items are ints, ``None``, ``Ellipsis`` and
    ``("slice", start, stop, step)``. Already normalized input is returned as is
    (a bare ``("slice", a, b, c)`` is one slice). Arrays, lists and booleans
    raise ``TypeError``: gather with integer arrays through the ``take`` or
    ``gather`` op. More than one ``Ellipsis`` raises ``IndexError``.

    >>> normalize_index((0, slice(1, None), None, ...))
    (0, ('slice', 1, None, None), None, Ellipsis)
    >>> normalize_index(2)
    (2,)
    """
    if isinstance(idx, tuple) and not (len(idx) == 4 and idx[0] == "slice"):
        items = idx
    else:
        items = (idx,)
    out = tuple(_norm_item(v) for v in items)
    if sum(1 for v in out if v is Ellipsis) > 1:
        raise IndexError("an index can only have a single Ellipsis (...)")
    return out


def to_python_index(idx: object) -> tuple[int | slice | EllipsisType | None, ...]:
    """The inverse of :func:`normalize_index`: ``("slice", a, b, c)`` items back to ``slice(a, b, c)``."""
    return tuple(slice(*v[1:]) if isinstance(v, tuple) else v for v in normalize_index(idx))


def _index_check(specs: tuple[Spec, ...], index: object) -> str | None:
    try:
        idx = normalize_index(index)
    except (TypeError, ValueError, IndexError) as e:
        return f"invalid index {index!r}: {e}"
    shape = specs[0][0]
    used = sum(1 for v in idx if v is not None and v is not Ellipsis)
    if used > len(shape):
        return f"too many indices: {used} index item(s) for an operand of rank {len(shape)}"
    # walk the operand's axes: items before an Ellipsis from the left, after it from the right
    pos: list[int] = []
    k = 0
    for v in idx:
        if v is Ellipsis:
            break
        pos.append(k)
        k += v is not None
    if Ellipsis in idx:
        tail = idx[idx.index(Ellipsis) + 1 :]
        k = len(shape) - sum(1 for v in tail if v is not None)
        for v in tail:
            pos.append(k)
            k += v is not None
    axes_items = [(p, v) for p, v in zip(pos, (w for w in idx if w is not Ellipsis))]
    for p, v in axes_items:
        if isinstance(v, int) and not -shape[p] <= v < shape[p]:  # normalized: a Python int
            return f"index {v} is out of bounds for axis {p} of size {shape[p]}"
    return None


# public=False: x[...] records it
@op("index", arity=1, attrs={"index": REQUIRED}, exact=True, check=_index_check, public=False, precision="layout")
def index(x: Array, index: AttrValue) -> Array:
    """Basic indexing ``x[index]`` with ints, slices, None and Ellipsis (see :func:`normalize_index`).

    record() turns a list attribute into a tuple, so ``index=[0, 1]`` means
    ``x[0, 1]``; integer-array (fancy) indexing is the ``take``/``gather`` ops.
    Out-of-bounds integer items are rejected at record time. The VJP scatters
    the cotangent into zeros of ``x``'s shape.
    """
    return x[to_python_index(index)]


@index.defvjp
def _index_vjp(g: Array, out: Array, x: Array, index: AttrValue) -> tuple[Array]:
    idx = to_python_index(index)
    if xp_of(g) is np:
        z = 0 * x
        z[idx] = g  # a basic index selects each element at most once
        return (z,)
    return (jnp.zeros(x.shape, g.dtype).at[idx].add(g),)


# --------------------------------------------------------------------------- take / gather


def _take_check(specs: tuple[Spec, ...], axis: object = 0) -> str | None:
    if err := _int_operand(specs, 1, "indices"):
        return err
    shape = specs[0][0]
    if len(shape) == 0:
        return "cannot take from a scalar; the operand needs rank >= 1"
    if err := axis_error(axis, len(shape)):
        return err
    n = shape[norm_axis(axis, len(shape))]
    if n == 0 and math.prod(specs[1][0]) > 0:
        return f"cannot take from axis {axis} of size 0"
    return None


def _clip_indices(indices: Array, n: int) -> Array:
    """NumPy-style negative indices (``-n <= i < 0`` count from the end), then clamp to ``[0, n-1]``."""
    i = jnp.where(indices < 0, indices + n, indices)
    return jnp.clip(i, 0, max(n - 1, 0))


def _take(x: Array, indices: Array, axis: int) -> Array:
    ax = axis % x.ndim
    return jnp.take(x, _clip_indices(indices, x.shape[ax]), axis=ax, mode="clip")


def _take_vjp(g: Array, out: Array, x: Array, indices: Array, axis: int = 0) -> tuple[Array, None]:
    ax = axis % x.ndim
    where = (slice(None),) * ax + (_clip_indices(indices, x.shape[ax]),)
    return jnp.zeros(x.shape, g.dtype).at[where].add(g), None


def _take_bounds(specs: tuple[Spec, ...], axis: int = 0) -> list[tuple[int, int, int, int | None]]:
    shape = specs[0][0]
    n = shape[axis % len(shape)] if shape else 0
    return [(1, -n, n, None)] if shape else []  # NumPy's range: negative positions count from the end


@op(
    "take",
    arity=2,
    attrs={"axis": 0},
    nondiff=(1,),
    check=_take_check,
    precision="layout",
    index_bounds=_take_bounds,
)
def take(x: Array, indices: Array, axis: int) -> Array:
    """Select entries of ``x`` along ``axis`` at integer ``indices`` (any shape), as ``jnp.take``.

    The result has shape ``x.shape[:axis] + indices.shape + x.shape[axis+1:]``.
    Negative indices count from the end (NumPy style). Indices given as host
    data (NumPy, a list) are checked when recorded: one out of ``[-n, n)`` is an
    error there; indices computed on a device are clamped to ``[0, n-1]`` (checking
    them would wait for the device). The
    VJP adds the cotangent into zeros at the same indices, so repeated indices
    accumulate. ``indices`` gets no gradient.
    """
    return _take(x, indices, axis)


take.defvjp(_take_vjp)


@op("gather", arity=2, nondiff=(1,), check=_take_check, precision="layout", index_bounds=_take_bounds)
def gather(x: Array, indices: Array) -> Array:
    """``x[indices]`` for an integer array ``indices``: rows of ``x`` along axis 0 (``take`` with axis=0).

    Same index semantics as ``take``: negative indices count from the end,
    out-of-range ones are clamped; repeated indices accumulate in the VJP.
    """
    return _take(x, indices, 0)


gather.defvjp(_take_vjp)


# --------------------------------------------------------------------------- scatter_add


def _scatter_shape(x: tuple[int, ...], idx: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return x[:axis] + idx + x[axis + 1 :]


def _scatter_add_check(specs: tuple[Spec, ...], axis: object) -> str | None:
    if err := _int_operand(specs, 1, "indices"):
        return err
    if err := same_dtype((specs[0], specs[2]), "x (#0) and updates (#2)"):
        return err
    shape = specs[0][0]
    if len(shape) == 0:
        return "cannot scatter into a scalar; x needs rank >= 1"
    if err := axis_error(axis, len(shape)):
        return err
    want = _scatter_shape(shape, specs[1][0], norm_axis(axis, len(shape)))
    upd = specs[2][0]
    if not broadcasts_to(upd, want):
        return (
            f"updates have shape {upd} but must broadcast to x.shape[:axis] + indices.shape + x.shape[axis+1:] = {want}"
        )
    return None


def _scatter_where(ndim: int, axis: int, indices: Array) -> tuple[Array, ...]:
    return (slice(None),) * (axis % ndim) + (indices,)


@op("scatter_add", arity=3, attrs={"axis": 0}, nondiff=(1,), check=_scatter_add_check)
def scatter_add(x: Array, indices: Array, updates: Array, axis: int) -> Array:
    """``x`` with ``updates`` added at integer ``indices`` along ``axis`` (``x.at[..., indices].add``).

    ``updates`` must broadcast to ``x.shape[:axis] + indices.shape + x.shape[axis+1:]``.
    Repeated indices accumulate; negative indices count from the end; updates
    at indices still out of range are dropped (JAX's scatter semantics), and
    get a zero gradient. The VJP is ``g`` for ``x`` and ``g`` taken at
    ``indices`` for ``updates``; ``indices`` gets no gradient.
    """
    return x.at[_scatter_where(x.ndim, axis, indices)].add(updates)


@scatter_add.defvjp
def _scatter_add_vjp(
    g: Array, out: Array, x: Array, indices: Array, updates: Array, axis: int
) -> tuple[Array, None, Array]:
    ax = axis % x.ndim
    gu = jnp.take(g, indices, axis=ax, mode="fill", fill_value=0)
    return g, None, unbroadcast(gu, updates.shape)
