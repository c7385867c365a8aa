"""Whether two functions (or optax transformations) compute the same thing now: one structural key.

Two calls of ``optax.adam(1e-3)`` build two transformations whose ``init`` and
``update`` are different closure objects over equal values. Keyed by
identity, every new :class:`~tapeflow.Optimizer` (a restored model, a
re-created optimizer in a notebook cell) would trace and compile its update
again, and a re-run notebook cell could not register its ``tfl.lift`` op
again. :func:`structural_key` keys an object by what a trace of it can depend
on instead, and :func:`same_function` compares two functions by that key:

* a Python function by its module, qualified name, code object, defaults,
  the values in its closure cells, and the *current* values of the globals its
  code names (its own code and the code objects nested in it), recursively;
  a global that is a module, class or other object is keyed by identity and
  by the current values of the attributes the code names (``Config.lr``,
  ``cfg.LR``): a schedule that reads a global which has since changed is a
  different function;
* a wrapper with ``__wrapped__`` (``jax.jit``, ``jax.custom_vjp``,
  ``jax.custom_jvp``, ...) by its type, what it wraps and its
  ``fwd``/``bwd``/``jvp`` rules and ``nondiff_argnums``;
* ``functools.partial`` and bound methods by their parts; tuples (so
  ``NamedTuple`` s such as a transformation itself), lists and dicts by
  their elements;
* numbers, strings, ``None``, NumPy scalars and small arrays (at most
  :data:`MAX_ARRAY_SIZE` elements) by value, with their types;
* anything else (classes, modules, large arrays, user objects) by identity:
  the key then holds the object, so an id is never reused while a key names it.

A key is taken when an optimizer is made (or an op registered): like
``jax.jit`` for a function it has traced, a transformation already built keeps
the update it compiled; a new one built after a global changed gets its own.
What a function reads through an object it holds (an attribute of an attribute,
an item of a user object) is not followed: such a transformation must be
rebuilt with a new object when that object changes.

>>> import optax
>>> structural_key(optax.adam(1e-3)) == structural_key(optax.adam(1e-3))
True
>>> structural_key(optax.adam(1e-3)) == structural_key(optax.adam(2e-3))
False
>>> LR = 0.1
>>> def schedule(count):
...     return LR
>>> before = structural_key(optax.sgd(schedule))
>>> LR = 0.5
>>> structural_key(optax.sgd(schedule)) == before
False
"""

from __future__ import annotations

import functools
import types
from collections.abc import Hashable

import jax
import numpy as np

__all__ = ["MAX_ARRAY_SIZE", "same_function", "structural_key"]

MAX_ARRAY_SIZE = 4096
"""Arrays a key reads with at most this many elements are keyed by value (larger: by identity)."""

_MAX_DEPTH = 200  # deeper than any optax chain: past it the whole object is keyed by identity
_VALUES = (bool, int, float, complex, str, bytes, type(None), type(Ellipsis))
_RULES = ("fwd", "bwd", "jvp", "nondiff_argnums")  # what a jax.custom_vjp / custom_jvp adds to the function it wraps


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


def structural_key(obj: object) -> Hashable:
    """A hashable key equal for two objects that trace to the same computation now (see the module docstring)."""
    try:
        return ("tx", _key(obj, {}, 0))
    except _TooDeep:
        return ("tx", _Same(obj))


def same_function(a: object, b: object) -> bool:
    """Whether ``b`` is ``a``, or computes the same function now (a re-run notebook cell, an equal closure).

    >>> def scale(k):
    ...     return lambda x: x * k
    >>> same_function(scale(2.0), scale(2.0)), same_function(scale(2.0), scale(3.0))
    (True, False)
    """
    if a is b:
        return True
    try:
        return bool(structural_key(a) == structural_key(b))
    except Exception:  # a value whose comparison fails (an array's ==): not provably the same
        return False


@functools.lru_cache(maxsize=4096)
def _names(code: types.CodeType) -> tuple[str, ...]:
    """The global and attribute names ``code`` and the code objects nested in it read, sorted."""
    found: set[str] = set()
    todo = [code]
    while todo:
        c = todo.pop()
        found.update(c.co_names)
        todo.extend(x for x in c.co_consts if isinstance(x, types.CodeType))
    return tuple(sorted(found))


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
        names = _names(fn.__code__)
        return (
            "function",
            fn.__module__,
            fn.__qualname__,
            fn.__code__,
            _key(fn.__defaults__, seen, d),
            _key(fn.__kwdefaults__, seen, d),
            cells,
            tuple(_global(n, fn.__globals__, names, seen, d) for n in names),
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
    if not isinstance(obj, type) and _wrapped(obj) is not None:
        rules = tuple(_key(getattr(obj, r, None), seen, d) for r in _RULES)
        return ("wrapped", t, _key(_wrapped(obj), seen, d), rules)
    return _Same(obj)


def _wrapped(obj: object) -> object:
    try:
        return obj.__dict__.get("__wrapped__") if hasattr(obj, "__dict__") else getattr(obj, "__wrapped__", None)
    except Exception:
        return None


def _global(name: str, scope: dict[str, object], names: tuple[str, ...], seen: dict[int, int], depth: int) -> Hashable:
    """The current value of global ``name`` as a function reading ``names`` sees it (None: not a global)."""
    if name not in scope:
        return None  # an attribute name, a builtin, or a global not defined yet
    value = scope[name]
    if isinstance(value, (types.FunctionType, functools.partial, types.MethodType)) or _plain(value):
        return (name, _key(value, seen, depth))
    if not isinstance(value, type) and _wrapped(value) is not None:  # a jitted or custom_vjp global
        return (name, _key(value, seen, depth))
    if isinstance(value, (types.BuiltinFunctionType, types.WrapperDescriptorType)):
        return (name, _Same(value))
    return (name, _Same(value), _attributes(value, names, seen, depth))


def _attributes(ns: object, names: tuple[str, ...], seen: dict[int, int], depth: int) -> Hashable:
    """The attributes of module, class or object ``ns`` that ``names`` name, as found without running code.

    Plain values (numbers, strings, small arrays, containers of them) by value;
    anything else by identity, so rebinding ``module.f`` or ``Config.rate`` gives
    another key, while a library module's functions are never walked.
    """
    dicts: list[object] = []
    if isinstance(ns, type):
        dicts = [vars(k) for k in ns.__mro__]
    else:
        own = getattr(ns, "__dict__", None)
        if isinstance(own, dict):
            dicts.append(own)
        if not isinstance(ns, types.ModuleType):
            dicts.extend(vars(k) for k in type(ns).__mro__)
    out = []
    for n in names:
        for mapping in dicts:
            if n in mapping:  # type: ignore[operator]
                v = mapping[n]  # type: ignore[index]
                out.append((n, _key(v, seen, depth) if _plain(v) else _Same(v)))
                break
    return tuple(out)


def _plain(value: object, depth: int = 0) -> bool:
    """A number, string, NumPy scalar, dtype or array, or a tuple, list or dict of them (a constant a key reads by value)."""
    if type(value) in _VALUES or isinstance(value, (np.generic, np.dtype, np.ndarray, jax.Array)):
        return True
    if depth < 8 and isinstance(value, (tuple, list)) and type(value) in (tuple, list):
        return all(_plain(x, depth + 1) for x in value)
    if depth < 8 and isinstance(value, dict) and type(value) is dict:
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _cell(cell: types.CellType, seen: dict[int, int], depth: int) -> Hashable:
    try:
        contents = cell.cell_contents
    except ValueError:  # an empty cell (a name bound later in the enclosing function)
        return ("empty",)
    return _key(contents, seen, depth)
