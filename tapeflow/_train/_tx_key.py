"""Which optax transformations compile to the same update: a structural key of a ``GradientTransformation``.

Two calls of ``optax.adam(1e-3)`` build two transformations whose ``init`` and
``update`` are different closure objects over equal values. Keyed by
identity, every new :class:`~tapeflow.Optimizer` (a restored model, a
re-created optimizer in a notebook cell) would trace and compile its update
again. :func:`structural_key` keys a transformation by what its trace can
depend on instead:

* a Python function by its code object, its module globals (by identity), its
  defaults and the values in its closure cells, recursively;
* ``functools.partial`` and bound methods by their parts; tuples (so
  ``NamedTuple`` s such as the transformation itself), lists and dicts by
  their elements;
* numbers, strings, ``None``, NumPy scalars and small arrays (at most
  :data:`MAX_ARRAY_SIZE` elements) by value, with their types;
* anything else (classes, modules, jitted functions, large arrays, user
  objects) by identity: the key then holds the object, so an id is never
  reused while a key names it.

This is as strict as ``jax.jit`` is for a function it has traced: values a
transformation closes over are compile-time constants of its update, so a
transformation that closes over an object and reads it later must be
rebuilt (or given a new object) when that object changes.

>>> import optax
>>> structural_key(optax.adam(1e-3)) == structural_key(optax.adam(1e-3))
True
>>> structural_key(optax.adam(1e-3)) == structural_key(optax.adam(2e-3))
False
"""

from __future__ import annotations

import functools
import types
from collections.abc import Hashable

import jax
import numpy as np

__all__ = ["MAX_ARRAY_SIZE", "structural_key"]

MAX_ARRAY_SIZE = 4096
"""Arrays a transformation closes over with at most this many elements are keyed by value (larger: by identity)."""

_MAX_DEPTH = 200  # deeper than any optax chain: past it the whole transformation is keyed by identity
_VALUES = (bool, int, float, complex, str, bytes, type(None), type(Ellipsis))


class _Same:
    """Compares equal only to a wrapper of the very same object (which it keeps alive)."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        return f"same({type(self.obj).__name__} at {id(self.obj):#x})"


class _TooDeep(Exception):
    pass


def structural_key(tx: object) -> Hashable:
    """A hashable key equal for two transformations that trace to the same update (see the module docstring)."""
    try:
        return ("tx", _key(tx, {}, 0))
    except _TooDeep:
        return ("tx", _Same(tx))


def _key(obj: object, seen: dict[int, int], depth: int) -> Hashable:
    if depth > _MAX_DEPTH:
        raise _TooDeep
    t = type(obj)
    if t in _VALUES:
        return (t, obj)
    if isinstance(obj, np.generic):
        return ("scalar", obj.dtype.str, obj.tobytes())
    if isinstance(obj, np.dtype):
        return ("dtype", obj.str)
    if isinstance(obj, (np.ndarray, jax.Array)) and not isinstance(obj, jax.core.Tracer):
        if obj.size <= MAX_ARRAY_SIZE and not (isinstance(obj, jax.Array) and obj.is_deleted()):
            a = np.asarray(obj)
            if a.dtype != object:
                return ("array", a.dtype.str, a.shape, a.tobytes())
        return _Same(obj)
    oid = id(obj)
    if oid in seen:  # a cycle (a closure that refers to itself) or a shared part: named by first visit
        return ("ref", seen[oid])
    seen[oid] = len(seen)
    d = depth + 1
    if t is types.FunctionType:
        fn: types.FunctionType = obj  # type: ignore[assignment]
        cells = tuple(_cell(c, seen, d) for c in fn.__closure__ or ())
        return (
            "function",
            fn.__code__,
            _Same(fn.__globals__),
            _key(fn.__defaults__, seen, d),
            _key(fn.__kwdefaults__, seen, d),
            cells,
        )
    if t is functools.partial:
        p: functools.partial[object] = obj  # type: ignore[assignment]
        return ("partial", _key(p.func, seen, d), _key(p.args, seen, d), _key(p.keywords, seen, d))
    if t is types.MethodType:
        m: types.MethodType = obj  # type: ignore[assignment]
        return ("method", _key(m.__func__, seen, d), _key(m.__self__, seen, d))
    if isinstance(obj, tuple):  # NamedTuples too: the transformation, optax states and masks
        return (t, tuple(_key(x, seen, d) for x in obj))
    if t is list:
        return (t, tuple(_key(x, seen, d) for x in obj))  # type: ignore[attr-defined]
    if t is dict:
        return (t, tuple((_key(k, seen, d), _key(v, seen, d)) for k, v in obj.items()))  # type: ignore[attr-defined]
    return _Same(obj)


def _cell(cell: types.CellType, seen: dict[int, int], depth: int) -> Hashable:
    try:
        contents = cell.cell_contents
    except ValueError:  # an empty cell (a name bound later in the enclosing function)
        return ("empty",)
    return _key(contents, seen, depth)
