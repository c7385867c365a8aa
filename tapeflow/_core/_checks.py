"""Checks shared by the op modules: integer, dtype, broadcasting and axis tests.

The checks return None when their input is valid, else a message that names
the problem and the fix (the registry prefixes the op name and appends the
operand specs); ``is_*`` and ``broadcasts_to`` are predicates, ``int_tuple``,
``as_int``, ``int_pair``, ``norm_axis`` and ``norm_axes`` normalize attributes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeGuard, cast

import jax.numpy as jnp
import numpy as np

from ._registry import Spec, broadcast_shapes, fmt_spec, is_float


def is_int(v: object) -> bool:
    """Whether ``v`` is a Python or NumPy integer (bools are not)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def as_int(v: object) -> int | None:
    """``v`` as a Python int when it is an integer as :func:`is_int`, else None."""
    return int(cast(int, v)) if is_int(v) else None


def is_number(v: object) -> TypeGuard[int | np.integer | float | np.floating]:
    """Whether ``v`` is a real Python or NumPy number: an int as :func:`is_int` (bools are not), or a float."""
    return is_int(v) or isinstance(v, (float, np.floating))


def is_finite_number(v: object) -> TypeGuard[int | np.integer | float | np.floating]:
    """Whether ``v`` is a number as :func:`is_number` that is neither NaN nor infinite."""
    return is_int(v) or (isinstance(v, (float, np.floating)) and math.isfinite(v))


def bool_error(name: str, v: object) -> str | None:
    """Message if attribute ``name`` is not ``True`` or ``False`` (a NumPy bool is one; ``1`` and ``0`` are not)."""
    if isinstance(v, (bool, np.bool_)):
        return None
    return f"attribute {name}={v!r} must be True or False"


def as_dtype(v: object) -> np.dtype | None:
    """The NumPy dtype ``v`` names (``"float32"``, ``jnp.bfloat16``, a dtype), or None when it names none.

    >>> as_dtype("bfloat16"), as_dtype("not a dtype")
    (dtype(bfloat16), None)
    """
    try:
        return np.dtype(v)  # type: ignore[call-overload]  # any object: the TypeError is the answer "no dtype"
    except TypeError:
        return None


def is_floating_dtype(dt: np.dtype) -> bool:
    """Whether ``dt`` is a floating dtype (bfloat16 and float8 types included)."""
    return bool(jnp.issubdtype(dt, jnp.floating))


def is_int_dtype(dt: np.dtype) -> bool:
    """Whether ``dt`` is an integer dtype (exact rationals, bools and floats are not)."""
    return dt != np.dtype(object) and bool(jnp.issubdtype(dt, jnp.integer))


def int_tuple(v: object) -> tuple[int, ...] | None:
    """``v`` as a tuple of ints (an int is a 1-tuple), or None if it is not one."""
    if (n := as_int(v)) is not None:
        return (n,)
    if isinstance(v, (tuple, list)) and all(is_int(a) for a in v):
        return tuple(int(a) for a in v)
    return None


def int_pair(v: object) -> tuple[int, int] | None:
    """``v`` as a pair of ints (an int ``n`` is ``(n, n)``; a 2-tuple or 2-list of ints), or None if it is not one."""
    if (n := as_int(v)) is not None:
        return (n, n)
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(is_int(a) for a in v):
        return (int(v[0]), int(v[1]))
    return None


def checked_pair(v: object) -> tuple[int, int]:
    """:func:`int_pair` of an attribute the op's check already accepted (a kernel's view of it)."""
    p = int_pair(v)
    if p is None:
        raise ValueError(f"expected an int or a pair of ints, got {v!r}")
    return p


def float_operands(specs: Sequence[Spec], which: Sequence[int] | None = None) -> str | None:
    """Message if an operand listed in ``which`` (default: all) has no floating (or exact rational) dtype."""
    for i in range(len(specs)) if which is None else which:
        dt = specs[i][1]
        if not is_float(dt):  # exact rationals pass here; the registry then names the exact ops
            return (
                f"operand #{i} has dtype {dt}, expected a floating dtype; cast it first with the astype op, "
                'e.g. tfl.astype(x, jnp.float32) or record(tape, "astype", (x,), dtype=jnp.float32)'
            )
    return None


def same_dtype(specs: Sequence[Spec], what: str = "operand") -> str | None:
    """Message if ``specs`` do not all share one dtype; ``what`` names them in the message."""
    if len({dt for _, dt in specs}) > 1:
        return (
            f"{what} dtypes differ ({', '.join(fmt_spec(s) for s in specs)}); tapeflow does not promote "
            "implicitly between different dtypes: cast them to one dtype with the astype op"
        )
    return None


def float_check(specs: Sequence[Spec], which: Sequence[int] | None = None) -> str | None:
    """Message if an operand in ``which`` (default: all) is not floating, or those operands' dtypes differ."""
    listed = list(specs) if which is None else [specs[i] for i in which]
    return float_operands(specs, which) or same_dtype(listed, "floating operand")


def broadcast(specs: Sequence[Spec]) -> str | None:
    """Message if the operands' shapes do not broadcast together (NumPy rules)."""
    if broadcast_shapes(*(s for s, _ in specs)) is None:
        return (
            f"shapes {' and '.join(str(s) for s, _ in specs)} do not broadcast together: aligned from the "
            "right, each dimension must match or be 1 (reshape or broadcast_to an operand first)"
        )
    return None


def broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts to exactly ``target`` (one way: ``target`` is not changed)."""
    return len(shape) <= len(target) and broadcast_shapes(shape, target) == tuple(target)


def _range_error(a: int, ndim: int, of: str) -> str | None:
    """Message if axis ``a`` (negative counts from the end) is out of range for rank ``ndim``."""
    if -ndim <= a < ndim:
        return None
    valid = f"valid: {-ndim}..{ndim - 1}" if ndim else "it has no axes"
    return f"axis {a} is out of range for {of} of rank {ndim} ({valid})"


def axis_error(axis: object, ndim: int, of: str = "an operand") -> str | None:
    """Message if ``axis`` is not a single int naming an axis of rank ``ndim`` (negative counts from the end)."""
    a = as_int(axis)
    if a is None:
        return f"attribute axis={axis!r} must be an int"
    return _range_error(a, ndim, of)


def norm_axis(axis: object, ndim: int) -> int:
    """The non-negative axis named by the single int ``axis`` of rank ``ndim`` (``ValueError`` as :func:`axis_error`)."""
    a = as_int(axis)
    if a is None or _range_error(a, ndim, "an operand"):
        raise ValueError(axis_error(axis, ndim))
    return a % ndim


def axes_error(axis: object, ndim: int, *, none_ok: bool = False, of: str = "an operand") -> str | None:
    """Message if ``axis`` (int or tuple of ints; None = all if ``none_ok``) is not distinct axes of rank ``ndim``."""
    if axis is None and none_ok:
        return None
    t = int_tuple(axis)
    if t is None:
        kinds = "an int, a tuple of ints or None" if none_ok else "an int or a tuple of ints"
        return f"attribute axis={axis!r} must be {kinds}"
    for a in t:
        if err := _range_error(a, ndim, of):
            return err
    norm = [a % ndim for a in t]
    for k in norm:
        if norm.count(k) > 1:
            return (
                f"axis={t} names axis {k} more than once for {of} of rank {ndim} "
                "(negative axes count from the end); give each axis once"
            )
    return None


def norm_axes(axis: object, ndim: int) -> tuple[int, ...]:
    """The sorted non-negative axes named by ``axis`` (an int, a tuple of ints, or None = all) of rank ``ndim``."""
    if err := axes_error(axis, ndim, none_ok=True):
        raise ValueError(err)
    return tuple(range(ndim)) if axis is None else tuple(sorted(a % ndim for a in int_tuple(axis) or ()))
