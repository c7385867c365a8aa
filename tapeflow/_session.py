"""The Session shell: the only mutable layer of tapeflow.

A :class:`Session` holds one :class:`~tapeflow.Tape` value and replaces it as
ops are recorded; it also owns the generation counter that makes old
:class:`Tensor` handles stale after :meth:`Session.reset`, a process-unique
owner id, a seeded RNG counter, the parameter leaves of the current recording,
the backend audit, and the device.

>>> import jax.numpy as jnp, tapeflow as tfl
>>> w = tfl.Param(jnp.ones((3, 2)), name="w")
>>> with tfl.Session(seed=0) as s:
...     x = s.input(jnp.ones((4, 3)))
...     loss = tfl.mean(tfl.relu(x @ w) ** 2)
...     grads = s.backward(loss)
...     grads[w].shape
(3, 2)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import math
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _registry as R
from ._device import resolve_device
from ._params import Param, Storage, canonical_indices
from ._result import TapeError
from ._tape import Tape, _accum, _freeze, backward as _tape_backward, leaf, record

__all__ = [
    "Session",
    "Tensor",
    "Grads",
    "ParameterGroup",
    "current_session",
    "apply",
    "RationalFallbackWarning",
]

_owner_counter = itertools.count(1)
_owner_lock = threading.Lock()
_CURRENT: contextvars.ContextVar[Session | None] = contextvars.ContextVar("tapeflow_session", default=None)


class RationalFallbackWarning(UserWarning):
    """Values without a native JAX dtype (exact rationals) are computed on the CPU with NumPy."""


def current_session() -> Session | None:
    """The session made current by the innermost ``with Session(...)`` block, or None."""
    return _CURRENT.get()


def _next_owner() -> int:
    with _owner_lock:
        return next(_owner_counter)


# --------------------------------------------------------------------------- handles


class Tensor:
    """A handle to one node of a session's current recording.

    It carries (owner, generation, node id) plus the node's shape and dtype. Any
    use checks that the handle belongs to its session's *current* generation.
    Operators build new recorded ops: ``+ - * / @ ** -x abs(x)``, comparisons
    (boolean, no gradient), ``.T``, indexing and slicing, and
    ``.sum/.mean/.max/.reshape/.transpose``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> s = tfl.Session()
    >>> x = s.input(jnp.arange(6.0).reshape(2, 3))
    >>> y = (x * 2).sum(axis=1)
    >>> y.shape, float(y[0])
    ((2,), 6.0)
    """

    __slots__ = ("_session", "_owner", "_generation", "id", "shape", "dtype", "__weakref__")
    __array_priority__ = 1000
    __hash__ = object.__hash__

    def __init__(self, session: Session | None, owner: int, generation: int, id: int, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self._session = session
        self._owner = owner
        self._generation = generation
        self.id = id
        self.shape = shape
        self.dtype = dtype

    # -- identity --------------------------------------------------------------
    @property
    def owner(self) -> int:
        return self._owner

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def session(self) -> Session | None:
        return self._session

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def node(self) -> Any:
        """The recorded :class:`~tapeflow.Node` this handle points at."""
        s = _check_handle(self, self._session)
        return s._tape[self.id]

    @property
    def value(self) -> Any:
        """The forward value (a ``jax.Array``; a NumPy object array for exact rationals)."""
        return self.node.value

    @property
    def op(self) -> str | None:
        return self.node.op

    @property
    def requires_grad(self) -> bool:
        return bool(self.node.requires_grad)

    def numpy(self) -> np.ndarray:
        return np.asarray(self.value)

    def item(self) -> Any:
        return self.numpy().item()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.value, dtype=dtype)

    def __float__(self) -> float:
        if self.shape not in ((), (1,)):
            raise TypeError(f"float() needs a tensor with one element, got shape {self.shape}")
        return float(np.asarray(self.value).reshape(()))

    def __int__(self) -> int:
        return int(float(self))

    def __bool__(self) -> bool:
        if self.shape not in ((), (1,)):
            raise TypeError(f"the truth value of a tensor of shape {self.shape} is ambiguous; use .value.any() or .value.all()")
        return bool(np.asarray(self.value).reshape(()))

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __repr__(self) -> str:
        spec = R.fmt_spec((self.shape, self.dtype))
        s = self._session
        if s is None or s.owner != self._owner:
            state = "no session" if s is None else "foreign"
            return f"Tensor({spec}, id={self.id}, gen={self._generation}, {state})"
        if s.generation != self._generation:
            return f"Tensor({spec}, id={self.id}, gen={self._generation}, stale)"
        nd = s._tape[self.id]
        op = "leaf" if nd.op is None else nd.op
        grad = ", requires_grad" if nd.requires_grad else ""
        return f"Tensor({spec}, op={op}, id={self.id}, gen={self._generation}{grad})"

    # -- operators -------------------------------------------------------------
    def __add__(self, o: Any) -> Tensor:
        return apply("add", self, o)

    def __radd__(self, o: Any) -> Tensor:
        return apply("add", o, self)

    def __sub__(self, o: Any) -> Tensor:
        return apply("sub", self, o)

    def __rsub__(self, o: Any) -> Tensor:
        return apply("sub", o, self)

    def __mul__(self, o: Any) -> Tensor:
        return apply("mul", self, o)

    def __rmul__(self, o: Any) -> Tensor:
        return apply("mul", o, self)

    def __truediv__(self, o: Any) -> Tensor:
        return apply("div", self, o)

    def __rtruediv__(self, o: Any) -> Tensor:
        return apply("div", o, self)

    def __matmul__(self, o: Any) -> Tensor:
        return apply("matmul", self, o)

    def __rmatmul__(self, o: Any) -> Tensor:
        return apply("matmul", o, self)

    def __pow__(self, o: Any) -> Tensor:
        return apply("pow", self, o)

    def __rpow__(self, o: Any) -> Tensor:
        return apply("pow", o, self)

    def __neg__(self) -> Tensor:
        return apply("neg", self)

    def __pos__(self) -> Tensor:
        return self

    def __abs__(self) -> Tensor:
        return apply("abs", self)

    def __lt__(self, o: Any) -> Tensor:
        return apply("lt", self, o)

    def __le__(self, o: Any) -> Tensor:
        return apply("le", self, o)

    def __gt__(self, o: Any) -> Tensor:
        return apply("gt", self, o)

    def __ge__(self, o: Any) -> Tensor:
        return apply("ge", self, o)

    def __eq__(self, o: Any) -> Tensor:  # type: ignore[override]
        return apply("eq", self, o)

    def __ne__(self, o: Any) -> Tensor:  # type: ignore[override]
        return apply("ne", self, o)

    def __getitem__(self, idx: Any) -> Tensor:
        return getitem(self, idx)

    @property
    def T(self) -> Tensor:
        return apply("transpose", self)

    def sum(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        return apply("sum", self, axis=_axis(axis), keepdims=keepdims)

    def mean(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        return apply("mean", self, axis=_axis(axis), keepdims=keepdims)

    def max(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        return apply("max", self, axis=_axis(axis), keepdims=keepdims)

    def reshape(self, *shape: Any) -> Tensor:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return apply("reshape", self, shape=tuple(shape))

    def transpose(self, *axes: Any) -> Tensor:
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        return apply("transpose", self, axes=tuple(axes) if axes else None)

    def astype(self, dtype: Any) -> Tensor:
        return apply("astype", self, dtype=np.dtype(dtype))

    def detach(self) -> Tensor:
        s = _check_handle(self, self._session)
        return s.detach(self)


def _axis(axis: Any) -> Any:
    if isinstance(axis, list):
        return tuple(axis)
    return axis


def getitem(x: Tensor, idx: Any) -> Tensor:
    """``x[idx]``: basic indexing records ``index``; an integer array or Tensor index records ``take``."""
    if isinstance(idx, (Tensor, np.ndarray, jax.Array, list)):
        return apply("take", x, idx, axis=0)
    from ._ops_shape import normalize_index

    return apply("index", x, index=normalize_index(idx))


# --------------------------------------------------------------------------- handle checks


def _check_handle(h: Tensor, s: Session | None) -> Session:
    """Raise unless ``h`` belongs to ``s`` and to its current generation."""
    hs = h._session
    if hs is None:
        raise TapeError(
            "tensor handle has no owning session (it was not produced by a Session op); "
            "create tensors with session.input(...) or session ops"
        )
    if s is None:
        s = hs
    if h._owner != s._owner:
        raise TapeError(
            f"tensor handle belongs to a different session (owner {h._owner}, this session is owner {s._owner}); "
            "handles cannot be mixed across sessions: pass the value with session.input(handle.value)"
        )
    if h._generation != s._generation:
        raise TapeError(
            f"stale tensor handle from generation {h._generation}; current generation is {s._generation} "
            "(Session.reset() invalidates handles recorded before it)"
        )
    return s


# --------------------------------------------------------------------------- groups and gradients


@dataclasses.dataclass(frozen=True)
class ParameterGroup:
    """The trainable parameter leaves of one recording that share one storage.

    ``id`` is the first leaf (the optimizer key), ``leaves`` are in recording
    order, ``parameter`` is the record used at the first leaf, ``storage`` its
    storage (None for a registration without a storage descriptor).
    """

    id: int
    parameter: Any
    leaves: tuple[int, ...]
    storage: Storage | None

    @property
    def shared(self) -> bool:
        return len(self.leaves) > 1


def group_parameter_leaves(params_by_leaf: Mapping[int, Any], storage_by_leaf: Mapping[int, Storage]) -> list[ParameterGroup]:
    """Group registrations by storage identity, in recording order, without reading tensor data.

    Registrations without a storage descriptor stay separate groups.
    """
    leaf_ids = sorted(params_by_leaf)
    canon = canonical_indices([storage_by_leaf.get(i) for i in leaf_ids])
    members: dict[int, list[int]] = {}
    order: list[int] = []
    for pos, c in enumerate(canon):
        key = pos if c is None else c
        if key not in members:
            members[key] = []
            order.append(key)
        members[key].append(leaf_ids[pos])
    groups = []
    for key in order:
        leaves = members[key]
        first = leaves[0]
        groups.append(ParameterGroup(first, params_by_leaf[first], tuple(leaves), storage_by_leaf.get(first)))
    return groups


def sum_in_leaf_order(parts: Sequence[Any]) -> Any:
    """Sum the cotangents of one storage's leaves in recording order.

    A single cotangent is returned as the very same array (no copy, no add). The
    optimizer and ``grads[param]`` both use this, so their sums are bit-identical.
    """
    g = parts[0]
    for extra in parts[1:]:
        g = _accum(g, extra)
    return g


def _release(arrays: Any, keep: Sequence[Any] = ()) -> int:
    """Delete device buffers of ``arrays`` (skipping those in ``keep``); returns how many."""
    n = 0
    keep_ids = {id(k) for k in keep}
    for a in arrays:
        if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) and id(a) not in keep_ids:
            try:
                if not a.is_deleted():
                    a.delete()
                    n += 1
            except Exception:
                pass
    return n


class Grads(Mapping[Any, Any]):
    """The result of :meth:`Session.backward`.

    * ``grads[param]``: the gradient of a :class:`Param`, summed over every leaf
      of its storage in recording order (a singleton is handed through as the
      very same array).
    * ``grads[tensor]`` / ``grads[node_id]``: the raw cotangent of one leaf.
    * ``grads.groups``: the :class:`ParameterGroup` s of the recording.

    It owns its buffers: use it as a context manager (or call :meth:`release`)
    to free them; releasing twice is safe.
    """

    def __init__(
        self,
        by_leaf: dict[int, Any],
        groups: list[ParameterGroup],
        owner: int,
        generation: int,
        keep: Sequence[Any] = (),
    ) -> None:
        self.by_leaf = by_leaf
        self.groups = groups
        self.owner = owner
        self.generation = generation
        self._group_of_storage: dict[int, ParameterGroup] = {}
        for g in groups:
            if g.storage is not None:
                self._group_of_storage[id(g.storage)] = g
        self._sums: dict[int, Any] = {}
        self._keep = list(keep)
        self._param_leaves = {i for g in groups for i in g.leaves}
        self.released = False

    # -- gradient per group ----------------------------------------------------
    def group_gradient(self, group: ParameterGroup) -> Any:
        """The summed gradient of ``group`` (the leaf's own array for a singleton)."""
        self._check_live()
        if len(group.leaves) == 1:
            return self.by_leaf.get(group.leaves[0])
        got = self._sums.get(group.id)
        if got is None:
            parts = [self.by_leaf[i] for i in group.leaves if i in self.by_leaf]
            if not parts:
                return None
            got = sum_in_leaf_order(parts)
            self._sums[group.id] = got
        return got

    def _check_live(self) -> None:
        if self.released:
            raise TapeError("these gradients were released (Grads.release() or the end of its with block); run backward again")

    def _key_to_group(self, key: Any) -> ParameterGroup | None:
        if isinstance(key, Param):
            return self._group_of_storage.get(id(key.storage))
        if isinstance(key, Storage):
            return self._group_of_storage.get(id(key))
        return None

    def __getitem__(self, key: Any) -> Any:
        self._check_live()
        if isinstance(key, (Param, Storage)):
            g = self._key_to_group(key)
            val = None if g is None else self.group_gradient(g)
            if val is None:
                raise KeyError(
                    f"{key!r} was not used as a trainable parameter in this recording, so it has no gradient; "
                    "grads.get(param) returns None instead of raising"
                )
            return val
        if isinstance(key, Tensor):
            if key._owner != self.owner or key._generation != self.generation:
                raise KeyError(f"{key!r} does not belong to the recording these gradients came from")
            key = key.id
        if isinstance(key, (int, np.integer)) and int(key) in self.by_leaf:
            return self.by_leaf[int(key)]
        raise KeyError(f"no gradient for {key!r}: it is not a leaf that requires grad and was reached from the loss")

    def __contains__(self, key: object) -> bool:
        try:
            self[key]
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[int]:
        self._check_live()
        return iter(self.by_leaf)

    def __len__(self) -> int:
        self._check_live()
        return len(self.by_leaf)

    def params(self) -> list[tuple[Any, Any]]:
        """``(parameter, gradient)`` for each group, in recording order."""
        out = []
        for g in self.groups:
            v = self.group_gradient(g)
            if v is not None:
                out.append((g.parameter, v))
        return out

    def consume(self, groups: Sequence[ParameterGroup]) -> None:
        """Free the buffers of ``groups`` (an optimizer has used them).

        Once every parameter group is consumed the whole object is released, so
        two optimizers over disjoint parameters can share one ``Grads``.
        """
        if self.released:
            return
        arrays = []
        for g in groups:
            arrays += [self.by_leaf.pop(i) for i in g.leaves if i in self.by_leaf]
            if g.id in self._sums:
                arrays.append(self._sums.pop(g.id))
            self._param_leaves.difference_update(g.leaves)
        _release(arrays, keep=self._keep)
        if not self._param_leaves:
            self.release()

    def release(self) -> None:
        """Free the device buffers these gradients own (idempotent)."""
        if self.released:
            return
        self.released = True
        _release(list(self.by_leaf.values()) + list(self._sums.values()), keep=self._keep)
        self.by_leaf = {}
        self._sums = {}

    def __enter__(self) -> Grads:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else f"{len(self.by_leaf)} leaves, {len(self.groups)} parameter groups"
        return f"Grads({state})"


# --------------------------------------------------------------------------- the session


class Session:
    """An eager recording context: one tape, handles, parameters, RNG and a device.

    Parameters
    ----------
    device:
        ``"cpu"``, ``"gpu"``/``"cuda"``, ``"gpu:N"``, a ``jax.Device``, or None for
        JAX's default device (the GPU when JAX has one, else the CPU). An absent
        device is an error here, never a silent fallback.
    seed:
        Seed of the session's random tensors; draw ``k`` uses ``fold_in(key(seed), k)``.
    grad_enabled:
        False makes an inference session: values are computed, nothing requires
        grad, no VJP is compiled, and :meth:`backward` raises.
    show_backend:
        Print the kernel/platform that runs each op the first time it is used.

    Examples
    --------
    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> s = tfl.Session(seed=0)
    >>> x = s.input(jnp.ones(3), requires_grad=True)
    >>> g = s.backward((x * x).sum())
    >>> g[x].tolist()
    [2.0, 2.0, 2.0]
    >>> s.reset(); s.generation, len(s.tape)
    (1, 0)
    """

    def __init__(self, device: Any = None, seed: int = 0, grad_enabled: bool = True, show_backend: bool = False) -> None:
        self.device: jax.Device = resolve_device(device) if device is not None else jax.devices()[0]
        self._seed = int(seed)
        self.grad_enabled = bool(grad_enabled)
        self.show_backend = bool(show_backend)
        self._owner = _next_owner()
        self._ref = weakref.ref(self)
        self._generation = 0
        self._rng_counter = 0
        self._tape = Tape.empty(self.device)
        self._params_by_leaf: dict[int, Any] = {}
        self._storage_by_leaf: dict[int, Storage] = {}
        self.selected_backends: list[tuple[str, str]] = []
        self._backend_seen: set[str] = set()
        self._rational_warned = False
        self._tokens: list[contextvars.Token[Session | None]] = []
        self._overrides: dict[int, Any] | None = None  # storage id -> value (functional bridge)
        self._base_key: Any = None
        self._default_device = self.device == jax.devices()[0]
        self._constants: dict[Any, Any] = {}

    # -- read-only state -------------------------------------------------------
    @property
    def owner(self) -> int:
        """Process-unique id of this session (kept across resets)."""
        return self._owner

    @property
    def generation(self) -> int:
        """Number of resets so far; handles from older generations are stale."""
        return self._generation

    @property
    def rng_counter(self) -> int:
        """Number of random tensors drawn so far (kept across resets)."""
        return self._rng_counter

    @property
    def seed(self) -> int:
        """Seed of the session's random tensors (see :meth:`set_rng_state`)."""
        return self._seed

    def set_rng_state(self, seed: int | None = None, counter: int | None = None) -> None:
        """Set the RNG seed and/or counter, e.g. to continue a restored run.

        >>> s = Session(seed=1)
        >>> a = s.normal((2,)).value
        >>> s.set_rng_state(seed=1, counter=0)
        >>> bool((s.normal((2,)).value == a).all())
        True
        """
        if seed is not None:
            self._seed = int(seed)
            self._base_key = None
        if counter is not None:
            if int(counter) < 0:
                raise ValueError(f"rng counter must be >= 0, got {counter}")
            self._rng_counter = int(counter)

    @property
    def tape(self) -> Tape:
        """The current tape value (immutable; a new one after every op)."""
        return self._tape

    def __repr__(self) -> str:
        kind = "" if self.grad_enabled else ", inference"
        return (
            f"Session(owner={self._owner}, generation={self._generation}, nodes={len(self._tape)}, "
            f"device={self.device}, rng_counter={self._rng_counter}{kind})"
        )

    # -- context ---------------------------------------------------------------
    def __enter__(self) -> Session:
        self._tokens.append(_CURRENT.set(self))
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.reset()
        finally:
            _CURRENT.reset(self._tokens.pop())

    @contextlib.contextmanager
    def _as_current(self) -> Iterator[Session]:
        """Make this the current session without resetting it afterwards."""
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)

    # -- handles ---------------------------------------------------------------
    def _handle(self, node_id: int) -> Tensor:
        nd = self._tape[node_id]
        return Tensor(self, self._owner, self._generation, node_id, nd.shape, nd.dtype)

    def check(self, h: Tensor) -> None:
        """Raise if ``h`` is not a live handle of this session."""
        _check_handle(h, self)

    # -- leaves ----------------------------------------------------------------
    def _prepare_value(self, x: Any) -> Any:
        """Session policy for a value entering the tape; ``leaf`` does the placement itself."""
        if isinstance(x, np.ndarray) and x.dtype == R.OBJECT:
            self._warn_rational()
            return x
        if not isinstance(x, jax.Array):  # host data: convert here so dtypes are JAX's
            # Uncommitted on the default device, like parameter values created with jnp:
            # kernels then see one placement for every operand and compile once.
            return jnp.asarray(x) if self._default_device else jax.device_put(x, self.device)
        return x  # a jax.Array (or tracer): leaf() moves it if needed, keeping sharded arrays as they are

    def _warn_rational(self) -> None:
        if not self._rational_warned:
            self._rational_warned = True
            warnings.warn(
                f"exact rational values have no native JAX dtype; session {self._owner} computes them on the CPU "
                f"with NumPy (requested device: {self.device})",
                RationalFallbackWarning,
                stacklevel=4,
            )

    def _commit_leaf(self, value: Any, requires_grad: bool) -> Tensor:
        t, i = leaf(self._tape, value, requires_grad=requires_grad and self.grad_enabled)
        self._tape = t
        _LAST[0] = self._ref
        return self._handle(i)

    def input(self, x: Any, requires_grad: bool = False) -> Tensor:
        """Record ``x`` (array-like; integer and boolean too) as a leaf; gradient only if asked."""
        if isinstance(x, Tensor):
            x = _check_handle(x, self)._tape[x.id].value
        h = self._commit_leaf(self._prepare_value(x), requires_grad)
        return h

    def const(self, x: Any) -> Tensor:
        """Record a constant leaf (never requires grad)."""
        return self.input(x, requires_grad=False)

    def detach(self, h: Tensor) -> Tensor:
        """A new leaf holding ``h``'s value, cut off from the recording's gradients."""
        _check_handle(h, self)
        return self._commit_leaf(self._tape[h.id].value, False)

    def _param_value(self, p: Param) -> Any:
        if p._bound is not None:
            return p._bound
        st = p.storage
        if self._overrides is not None:
            v = self._overrides.get(id(st))
            if v is not None:
                return v
        if st.dtype == R.OBJECT:
            self._warn_rational()
        return st.read(self.device)

    def use(self, p: Param) -> Tensor:
        """Record one use of ``p``: a new leaf holding its current value."""
        if not isinstance(p, Param):
            raise TypeError(f"Session.use expects a Param, got {type(p).__name__}")
        h = self._commit_leaf(self._param_value(p), p.trainable)
        self._register_param_leaf(h.id, p, p.storage)
        return h

    def _register_param_leaf(self, leaf_id: int, p: Any, storage: Storage | None) -> None:
        self._params_by_leaf[leaf_id] = p
        if storage is not None:
            self._storage_by_leaf[leaf_id] = storage

    def register_parameter_leaf(self, h: Tensor, parameter: Any, storage: Storage | None = None) -> None:
        """Mark an existing leaf as a parameter registration (advanced).

        ``storage`` is its identity descriptor; without one the registration is
        grouped alone. A descriptor whose shape or dtype disagrees with the leaf
        is rejected and nothing changes.
        """
        _check_handle(h, self)
        nd = self._tape[h.id]
        if nd.op is not None:
            raise TapeError(f"node #{h.id} is the output of {nd.op!r}, not a leaf; only leaves can be parameter registrations")
        if storage is not None and (storage.shape != nd.shape or storage.dtype != nd.dtype):
            raise TapeError(
                f"storage {storage!r} does not match leaf #{h.id} of {R.fmt_spec(nd.spec)}; "
                "a parameter registration's storage must have the leaf's shape and dtype"
            )
        self._register_param_leaf(h.id, parameter, storage)

    # -- ops -------------------------------------------------------------------
    def _apply(self, opname: str, operands: Sequence[Any], attrs: dict[str, Any]) -> Tensor:
        """Check every handle, then record ``opname``; on any failure nothing changes."""
        # 1. handles, left to right
        for o in operands:
            if type(o) is Tensor:
                _check_handle(o, self)
        nodes = self._tape._buf.nodes
        # 2. operand specs without touching the tape
        plan: list[Any] = []
        specs: list[R.Spec] = []
        ref_dtype = None  # dtype given to Python-number operands
        for o in operands:
            if isinstance(o, (Tensor, Param)) and o.dtype != np.dtype(bool):
                ref_dtype = o.dtype
                break
        for o in operands:
            if type(o) is Tensor:
                nd = nodes[o.id]
                plan.append(o.id)
                specs.append((nd.shape, nd.dtype))
            elif isinstance(o, Param):
                plan.append(o)
                specs.append((o.shape, o.dtype))
            else:
                v = self._constant(o, ref_dtype, opname)
                plan.append(("const", v))
                specs.append((tuple(np.shape(v)), np.dtype(v.dtype)))
        akey = tuple(sorted(attrs.items())) if attrs else ()
        try:
            hash(akey)
        except TypeError:
            akey = _freeze(attrs)
            try:
                hash(akey)
            except TypeError as e:
                raise TapeError(
                    f"{opname}: attribute values must be hashable constants ({e}) (operands: {R.describe(specs)})"
                ) from None
        if opname not in R.REGISTRY:
            raise TapeError(f"unknown op {opname!r}")
        entry = R.get_fwd(opname, akey, tuple(specs))
        if type(entry) is str:
            raise TapeError(f"{opname}: {entry} (operands: {R.describe(specs)})")
        # 3. leaves and the op on a local tape value; commit only on success
        t = self._tape
        ids: list[int] = []
        new_params: list[tuple[int, Param]] = []
        for p in plan:
            if type(p) is int:
                ids.append(p)
            elif isinstance(p, Param):
                t, i = leaf(t, self._param_value(p), requires_grad=p.trainable and self.grad_enabled)
                new_params.append((i, p))
                ids.append(i)
            else:
                t, i = leaf(t, p[1], requires_grad=False)
                ids.append(i)
        t, r = record(t, opname, ids, **attrs)
        if not r.is_ok:
            raise TapeError(r.error)
        self._tape = t
        _LAST[0] = self._ref
        for i, p in new_params:
            self._register_param_leaf(i, p, p.storage)
        if opname not in self._backend_seen:
            self._audit(opname, t[r.value].dtype)
        return self._handle(r.value)

    def _constant(self, o: Any, ref_dtype: Any, opname: str) -> Any:
        if isinstance(o, (bool, int, float)) and not isinstance(o, np.ndarray):
            if ref_dtype is not None and ref_dtype == R.OBJECT:
                from fractions import Fraction

                return np.asarray(Fraction(o), dtype=object)
            if isinstance(o, bool):
                dt = np.dtype(bool)
            elif ref_dtype is not None and (isinstance(o, int) or R.is_float(ref_dtype)):
                dt = ref_dtype
            else:
                dt = np.dtype(np.float32) if isinstance(o, float) else np.dtype(np.int32)
            key = (type(o), o, math.copysign(1.0, o), dt)
            c = self._constants.get(key)
            if c is None:
                c = np.asarray(o, dtype=dt)
                # uncommitted on the default device, so it also mixes with sharded tracers under jit
                c = jnp.asarray(c) if self._default_device else jax.device_put(c, self.device)
                if len(self._constants) < 1024:
                    self._constants[key] = c
            return c
        if isinstance(o, np.ndarray) and o.dtype == R.OBJECT:
            self._warn_rational()
            return o
        if isinstance(o, (np.ndarray, jax.Array, list, tuple, np.generic)):
            return self._prepare_value(np.asarray(o) if isinstance(o, (list, tuple)) else o)
        raise TapeError(
            f"{opname}: operand of type {type(o).__name__} is not supported; "
            "use a Tensor, a Param, a number or an array"
        )

    def _audit(self, opname: str, dtype: np.dtype) -> None:
        self._backend_seen.add(opname)
        kernel = "numpy-exact (cpu)" if dtype == R.OBJECT else f"xla:{self.device.platform}"
        self.selected_backends.append((opname, kernel))
        if self.show_backend:
            print(f"[tapeflow] {opname}: {kernel}", file=sys.stderr)

    # -- randomness ------------------------------------------------------------
    def _next_key(self) -> Any:
        if self._base_key is None:
            self._base_key = jax.random.PRNGKey(self._seed)
        k = jax.random.fold_in(self._base_key, self._rng_counter)
        self._rng_counter += 1
        return k

    def _random(self, fn: Any, shape: Any, dtype: Any) -> Tensor:
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        if any(not isinstance(d, (int, np.integer)) or d < 0 for d in shape):
            raise TapeError(f"random tensor shape must be non-negative integers, got {shape}")
        v = _random_kernel(fn, shape, np.dtype(dtype) if dtype is not None else None)(self._next_key())
        h = self._commit_leaf(self._prepare_value(v), False)
        return h

    def rand_uniform(self, shape: Any, dtype: Any = jnp.float32, low: float = 0.0, high: float = 1.0) -> Tensor:
        """Uniform ``[low, high)`` samples (a constant leaf); advances the RNG counter once."""
        return self._random(("uniform", float(low), float(high)), shape, dtype)

    def normal(self, shape: Any, dtype: Any = jnp.float32) -> Tensor:
        """Standard normal samples (a constant leaf); advances the RNG counter once."""
        return self._random(("normal",), shape, dtype)

    def bernoulli_mask(self, shape: Any, keep_prob: float) -> Tensor:
        """Boolean mask, True with probability ``keep_prob``; advances the RNG counter once."""
        if not 0.0 <= float(keep_prob) <= 1.0:
            raise TapeError(f"bernoulli_mask: keep_prob must be in [0, 1], got {keep_prob}")
        return self._random(("bernoulli", float(keep_prob)), shape, None)

    def random_key(self) -> Any:
        """A fresh ``jax.random`` key derived from (seed, counter); advances the counter once."""
        return self._next_key()

    # -- backward --------------------------------------------------------------
    def parameter_groups(self) -> list[ParameterGroup]:
        """Trainable parameter leaves of this recording grouped by storage identity."""
        return group_parameter_leaves(self._trainable_params(), self._storage_by_leaf)

    def _trainable_params(self) -> dict[int, Any]:
        nodes = self._tape._buf.nodes
        return {i: p for i, p in self._params_by_leaf.items() if nodes[i].requires_grad}

    def backward(self, loss: Tensor, seed: Any = None) -> Grads:
        """Gradients of ``loss`` wrt every leaf that requires grad, as a :class:`Grads`."""
        if not isinstance(loss, Tensor):
            raise TypeError(f"Session.backward expects a Tensor handle, got {type(loss).__name__}")
        _check_handle(loss, self)
        if not self.grad_enabled:
            raise TapeError(
                "backward: this is an inference session (grad_enabled=False); it records no gradients. "
                "Open a Session(grad_enabled=True) to train"
            )
        # every trainable leaf gets a gradient (zeros when the loss does not reach it)
        nodes = self._tape._buf.nodes
        wrt = [i for i in range(loss.id + 1) if nodes[i].op is None and nodes[i].requires_grad]
        wrt += [i for i in self._params_by_leaf if i > loss.id and nodes[i].requires_grad]
        by_leaf = _tape_backward(self._tape, loss.id, seed=seed, wrt=wrt)
        return Grads(by_leaf, self.parameter_groups(), self._owner, self._generation, keep=() if seed is None else (seed,))

    # -- reset -----------------------------------------------------------------
    def reset(self) -> None:
        """Drop the recording, invalidate its handles and free the buffers it owns.

        Keeps the owner id, the RNG counter, the backend audit and any optimizer
        state. Buffers of parameter leaves and of arrays passed in by the user are
        never freed, nor is any buffer still referenced outside the tape.
        """
        self._release_intermediates()
        self._tape = Tape.empty(self.device)
        self._params_by_leaf = {}
        self._storage_by_leaf = {}
        self._generation += 1

    def _release_intermediates(self) -> None:
        buf = self._tape._buf
        # Another Tape value (a fork, or a tape the user kept) shares these nodes:
        # their values must stay valid, so leave freeing to the garbage collector.
        # References: self._tape._buf, `buf`, getrefcount's argument; and for the
        # current Tape object itself (which the user may hold as `s.tape`):
        # self._tape and getrefcount's argument.
        if sys.getrefcount(buf) > 3 or sys.getrefcount(self._tape) > 2:
            return
        nodes = buf.nodes
        leaf_vals = {id(nd.value) for nd in nodes if nd.op is None}
        getrefcount = sys.getrefcount
        for nd in nodes:
            if nd.op is None:
                continue
            v = nd.value
            if type(v) is not jax.Array and not isinstance(v, jax.Array):
                continue
            if isinstance(v, jax.core.Tracer) or id(v) in leaf_vals:
                continue
            # referenced only by this node (+ local + argument): the tape owns it
            if getrefcount(v) <= 3:
                try:
                    v.delete()
                except Exception:
                    pass
            del v


_RANDOM_KERNELS: dict[Any, Any] = {}


def _random_kernel(kind: tuple[Any, ...], shape: tuple[int, ...], dtype: np.dtype | None) -> Any:
    key = (kind, shape, dtype)
    fn = _RANDOM_KERNELS.get(key)
    if fn is None:
        name = kind[0]
        if name == "uniform":
            lo, hi = kind[1], kind[2]

            def f(k: Any) -> Any:
                return jax.random.uniform(k, shape, dtype, lo, hi)
        elif name == "normal":

            def f(k: Any) -> Any:
                return jax.random.normal(k, shape, dtype)
        else:
            p = kind[1]

            def f(k: Any) -> Any:
                return jax.random.bernoulli(k, p, shape)

        fn = _RANDOM_KERNELS[key] = jax.jit(f)
    return fn


# --------------------------------------------------------------------------- dispatch


def _session_of(operands: Sequence[Any], opname: str) -> Session:
    for o in operands:
        if type(o) is Tensor or isinstance(o, Tensor):
            s = o._session
            if s is None:
                _check_handle(o, None)  # raises the ownerless-handle error
            assert s is not None
            return s
    s = _CURRENT.get()
    if s is None:
        s = _last_recorded()
    if s is None:
        raise TapeError(
            f"{opname}: no session to record on: none of the operands is a Tensor, no session is current, "
            "and no session has recorded anything yet. Use `with tfl.Session() as s:` or pass a tensor "
            "from s.input(...)"
        )
    return s


_LAST: list[weakref.ref[Session] | None] = [None]


def _last_recorded() -> Session | None:
    """The session that recorded the latest leaf or op in this process (if it is still alive).

    Lets an op on Params alone (``w.T``) record on the session the surrounding code
    uses even outside a ``with`` block; mixing its result with another session's
    handles is then reported as a session mismatch.
    """
    ref = _LAST[0]
    return None if ref is None else ref()


def apply(opname: str, *operands: Any, **attrs: Any) -> Tensor:
    """Record registered op ``opname`` on the operands' session and return the new handle.

    Operands may be :class:`Tensor` handles, :class:`Param` s (each recorded as a
    fresh leaf), numbers or arrays (constant leaves). The session is that of the
    first Tensor operand, else the current session.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     y = tfl.apply("add", s.input(jnp.ones(2)), 1.0)
    ...     y.value.tolist()
    [2.0, 2.0]
    """
    s = _session_of(operands, opname)
    return s._apply(opname, operands, attrs)


# A Param used in an expression records a fresh leaf on the operands' (or the
# current) session, so it shares the Tensor operators.
for _name in (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__matmul__", "__rmatmul__", "__pow__", "__rpow__", "__neg__", "__abs__", "__getitem__",
    "T", "sum", "mean", "max", "reshape", "transpose", "astype",
):
    setattr(Param, _name, Tensor.__dict__[_name])
del _name
