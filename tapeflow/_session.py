"""The Session shell: the only mutable layer of tapeflow.

A :class:`Session` holds one :class:`~tapeflow.Tape` value and replaces it as
ops are recorded. It also owns the generation counter that makes old
:class:`~tapeflow.Tensor` handles stale after :meth:`Session.reset`, a
process-unique owner id, a seeded RNG counter, the parameter leaves of the
current recording, the backend audit, and the device. Handles and operators
live in ``_tensor.py``, gradients and the tied-weight sum in ``_grads.py``.

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
import itertools
import math
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _registry as R
from ._device import default_device, resolve_device
from ._grads import Grads, ParameterGroup, ParameterRecord, group_parameter_leaves
from ._params import COMPLEX_HINT, Param, Storage, check_fits_without_x64, check_value_kind
from ._random import RNG_COUNTER_RANGE, RNG_SEED_RANGE, draw, rng_int
from ._result import Err, TapeError
from ._tape import Node, Tape, append_op, check_op, leaf
from ._tape import backward as _tape_backward
from ._tensor import Operand, Tensor, check_handle, note_recorded, pop_current, push_current
from ._typing import Array, ArrayLike, DeviceLike, DTypeLike, NodeId, PRNGKey

__all__ = ["RationalFallbackWarning", "Session"]

_owner_counter = itertools.count(1)
_owner_lock = threading.Lock()


class RationalFallbackWarning(UserWarning):
    """Values without a native JAX dtype (exact rationals) are computed on the CPU with NumPy."""


def _next_owner() -> int:
    with _owner_lock:
        return next(_owner_counter)


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
    param_values:
        Values to record for these storages instead of their current values (the
        functional bridge passes the traced parameter values this way).
    rng_key:
        A ``jax.random`` key to derive random tensors from instead of ``seed``.
    check_same_thread:
        True (default): the session and its handles may be used only from the
        thread that created it; another thread gets a :class:`TapeError` (as
        :mod:`sqlite3` does). False lifts the check: you then serialize every use
        yourself.

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

    def __init__(
        self,
        device: DeviceLike = None,
        seed: int = 0,
        grad_enabled: bool = True,
        show_backend: bool = False,
        *,
        param_values: Mapping[Storage, Array] | None = None,
        rng_key: PRNGKey | None = None,
        check_same_thread: bool = True,
    ) -> None:
        self._thread: int | None = threading.get_ident() if check_same_thread else None
        self.device: jax.Device = resolve_device(device) if device is not None else default_device()
        self._seed = int(seed)
        self.grad_enabled = bool(grad_enabled)
        self.show_backend = bool(show_backend)
        self._owner = _next_owner()
        self._ref = weakref.ref(self)
        self._generation = 0
        self._rng_counter = 0
        self._tape = Tape.empty(self.device)
        self._params_by_leaf: dict[NodeId, ParameterRecord] = {}
        self._storage_by_leaf: dict[NodeId, Storage] = {}
        self.selected_backends: list[tuple[str, str]] = []
        self._backend_seen: set[str] = set()
        self._rational_warned = False
        self._tokens: list[contextvars.Token[Session | None]] = []
        self._param_values: dict[Storage, Array] | None = None if param_values is None else dict(param_values)
        self._unlisted: list[Storage] = []
        self._base_key: PRNGKey | None = rng_key
        self._default_device = self.device == default_device()
        self._constants: dict[tuple[Any, ...], Array] = {}

    # -- thread ownership ------------------------------------------------------
    def check_thread(self) -> None:
        """Raise :class:`TapeError` if the calling thread may not use this session.

        A session belongs to the thread that created it (unless it was created with
        ``check_same_thread=False``). Every recording, read of a handle, backward,
        draw and reset checks it first, so a call from another thread changes nothing.
        """
        t = self._thread
        if t is not None and t != threading.get_ident():
            raise TapeError(
                f"Session owner {self._owner} was created in thread {t} and cannot be used from thread "
                f"{threading.get_ident()} (nor can its tensor handles). Open one session per thread, or create it "
                "with Session(check_same_thread=False) and serialize every use yourself"
            )

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
        self.check_thread()
        new_seed = None if seed is None else rng_int("seed", seed, RNG_SEED_RANGE)
        new_counter = None if counter is None else rng_int("counter", counter, RNG_COUNTER_RANGE)
        if new_seed is not None:
            self._seed = new_seed
            self._base_key = None
        if new_counter is not None:
            self._rng_counter = new_counter

    @property
    def unlisted_storages(self) -> tuple[Storage, ...]:
        """Storages a recording read at their current value because ``param_values`` did not list them.

        The compiled training step passes these as runtime arguments from its next
        call on, so a frozen table or another optimizer's parameter is never baked
        into a program as a constant.
        """
        return tuple(self._unlisted)

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
        self.check_thread()
        self._tokens.append(push_current(self))
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.reset()
        finally:
            pop_current(self._tokens.pop())

    @contextlib.contextmanager
    def as_current(self) -> Iterator[Session]:
        """Make this the current session for a block, without resetting it afterwards.

        >>> import tapeflow as tfl
        >>> s = tfl.Session()
        >>> with s.as_current():
        ...     tfl.current_session() is s
        True
        """
        token = push_current(self)
        try:
            yield self
        finally:
            pop_current(token)

    # -- handles ---------------------------------------------------------------
    def _handle(self, node_id: NodeId) -> Tensor:
        nd = self._tape[node_id]
        return Tensor(self, self._owner, self._generation, node_id, nd.shape, nd.dtype)

    def handle(self, node_id: NodeId) -> Tensor:
        """A handle of node ``node_id`` of the current recording (e.g. a parent of a node you hold).

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> s = tfl.Session()
        >>> y = s.input(jnp.ones(2)) * 3.0
        >>> [s.handle(i).op for i in y.node.parents]
        [None, None]
        """
        self.check_thread()
        if type(node_id) is not int or not 0 <= node_id < len(self._tape):
            raise TapeError(f"Session.handle: no node {node_id!r} in this recording of {len(self._tape)} node(s)")
        return self._handle(node_id)

    def check(self, h: Tensor) -> None:
        """Raise if ``h`` is not a live handle of this session."""
        check_handle(h, self)

    def node(self, h: Tensor) -> Node:
        """The recorded node behind the live handle ``h`` (raises for a stale or foreign one)."""
        check_handle(h, self)
        return self._tape[h.id]

    # -- leaves ----------------------------------------------------------------
    def _prepare_value(self, x: ArrayLike, where: str = "Session.input") -> Array:
        """Session policy for a value entering the tape; ``leaf`` does the placement itself."""
        check_value_kind(x, where)
        if isinstance(x, np.ndarray) and x.dtype == R.OBJECT:
            self._warn_rational()
            return x
        if not isinstance(x, jax.Array):  # host data: convert here so dtypes are JAX's
            check_fits_without_x64(x, where)
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

    def _commit(self, t: Tape) -> None:
        """Install ``t`` as the current tape (the one place the session's tape changes between resets)."""
        self.check_thread()
        self._tape = t
        note_recorded(self._ref)

    def _commit_leaf(self, value: Array, requires_grad: bool) -> Tensor:
        t, i = leaf(self._tape, value, requires_grad=requires_grad and self.grad_enabled)
        self._commit(t)
        return self._handle(i)

    def input(self, x: ArrayLike | Tensor, requires_grad: bool = False) -> Tensor:
        """Record ``x`` (array-like; integer and boolean too) as a leaf; gradient only if asked."""
        if isinstance(x, Tensor):
            x = self.node(x).value
        return self._commit_leaf(self._prepare_value(x), requires_grad)

    def const(self, x: ArrayLike) -> Tensor:
        """Record a constant leaf (never requires grad)."""
        return self.input(x, requires_grad=False)

    def detach(self, h: Tensor) -> Tensor:
        """A new leaf holding ``h``'s value, cut off from the recording's gradients."""
        return self._commit_leaf(self.node(h).value, False)

    def _param_value(self, p: Param) -> Array:
        if p.bound:  # a view rebuilt by a JAX transformation carries its own value
            return p.value
        st = p.storage
        if self._param_values is not None:
            v = self._param_values.get(st)
            if v is not None:
                return v
            if st not in self._unlisted:
                self._unlisted.append(st)
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

    def _register_param_leaf(self, leaf_id: NodeId, p: ParameterRecord, storage: Storage | None) -> None:
        self._params_by_leaf[leaf_id] = p
        if storage is not None:
            self._storage_by_leaf[leaf_id] = storage

    def register_parameter_leaf(self, h: Tensor, parameter: ParameterRecord, storage: Storage | None = None) -> None:
        """Mark an existing leaf as a parameter registration (advanced).

        ``storage`` is its identity descriptor; without one the registration is
        grouped alone. A descriptor whose shape or dtype disagrees with the leaf
        is rejected and nothing changes.
        """
        nd = self.node(h)
        if nd.op is not None:
            raise TapeError(
                f"node #{h.id} is the output of {nd.op!r}, not a leaf; only leaves can be parameter registrations"
            )
        if storage is not None and (storage.shape != nd.shape or storage.dtype != nd.dtype):
            raise TapeError(
                f"storage {storage!r} does not match leaf #{h.id} of {R.fmt_spec(nd.spec)}; "
                "a parameter registration's storage must have the leaf's shape and dtype"
            )
        self._register_param_leaf(h.id, parameter, storage)

    # -- ops -------------------------------------------------------------------
    def apply(self, opname: str, *operands: Operand, **attrs: Any) -> Tensor:
        """Record registered op ``opname`` on this session; on any failure nothing changes.

        Handles are checked left to right (a foreign handle is reported before a
        stale one), then the op is checked once against the operands' shapes and
        dtypes (:func:`tapeflow._tape.check_op`, the same check as ``record``),
        and only then are Param and constant operands recorded as leaves.

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> s = tfl.Session()
        >>> s.apply("mul", s.input(jnp.arange(3.0)), 2.0).value.tolist()
        [0.0, 2.0, 4.0]
        """
        self.check_thread()
        for o in operands:
            if type(o) is Tensor:
                check_handle(o, self)
        nodes = self._tape._buf.nodes
        plan: list[NodeId | Param | Array] = []
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
                specs.append(nd.spec)
            elif isinstance(o, Param):
                plan.append(o)
                specs.append((o.shape, o.dtype))
            else:
                v = self._constant(o, ref_dtype, opname)
                plan.append(v)
                specs.append((tuple(np.shape(v)), np.dtype(v.dtype)))
        entry = check_op(opname, attrs, tuple(specs))
        if isinstance(entry, str):
            raise TapeError(entry)
        # leaves and the op on a local tape value; commit only on success
        t = self._tape
        ids: list[NodeId] = []
        new_params: list[tuple[NodeId, Param]] = []
        for p in plan:
            if type(p) is int:
                ids.append(p)
            elif isinstance(p, Param):
                t, i = leaf(t, self._param_value(p), requires_grad=p.trainable and self.grad_enabled)
                new_params.append((i, p))
                ids.append(i)
            else:
                t, i = leaf(t, p, requires_grad=False)
                ids.append(i)
        all_nodes = t._buf.nodes
        t, r = append_op(t, opname, entry, tuple(ids), [all_nodes[i] for i in ids])
        if isinstance(r, Err):
            raise TapeError(r.error)
        self._commit(t)
        for i, p in new_params:
            self._register_param_leaf(i, p, p.storage)
        if opname not in self._backend_seen:
            self._audit(opname, t[r.value].dtype)
        return self._handle(r.value)

    def _constant(self, o: object, ref_dtype: np.dtype | None, opname: str) -> Array:
        if isinstance(o, complex):
            raise TapeError(f"{opname}: {COMPLEX_HINT}")
        if isinstance(o, (bool, int, float)):
            if ref_dtype is not None and ref_dtype == R.OBJECT:
                from fractions import Fraction

                return np.asarray(Fraction(o), dtype=object)
            dt: np.dtype
            if isinstance(o, bool):
                dt = np.dtype(bool)
            elif ref_dtype is not None and (isinstance(o, int) or R.is_float(ref_dtype)):
                dt = ref_dtype
            else:
                dt = np.dtype(np.float32) if isinstance(o, float) else np.dtype(np.int32)
            key = (type(o), o, math.copysign(1.0, o), dt)
            c = self._constants.get(key)
            if c is None:
                try:
                    c = np.asarray(o, dtype=dt)
                except OverflowError:
                    raise TapeError(
                        f"{opname}: the constant {o} does not fit the operand dtype {dt}; cast explicitly "
                        '(e.g. x.astype("int64")) or turn on 64-bit values: jax.config.update("jax_enable_x64", True)'
                    ) from None
                # uncommitted on the default device, so it also mixes with sharded tracers under jit
                c = jnp.asarray(c) if self._default_device else jax.device_put(c, self.device)
                if len(self._constants) < 1024:
                    self._constants[key] = c
            return c
        if isinstance(o, (np.ndarray, jax.Array, list, tuple, np.generic)):
            return self._prepare_value(np.asarray(o) if isinstance(o, (list, tuple)) else o, opname)
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
    def _key(self) -> PRNGKey:
        """The key of the next draw, ``fold_in(key(seed), counter)``; does not advance the counter."""
        if self._base_key is None:
            self._base_key = jax.random.PRNGKey(self._seed)
        c = self._rng_counter
        if c < 2**32:
            return jax.random.fold_in(self._base_key, c)
        return jax.random.fold_in(jax.random.fold_in(self._base_key, c >> 32), c & 0xFFFFFFFF)  # fold_in takes uint32

    def _next_key(self) -> PRNGKey:
        k = self._key()
        self._rng_counter += 1
        return k

    def _random(self, method: str, kind: tuple[Any, ...], shape: int | tuple[int, ...], dtype: DTypeLike) -> Tensor:
        # every check before the draw: a rejected call advances no counter and records nothing
        self.check_thread()
        if isinstance(shape, (int, np.integer)) and not isinstance(shape, (bool, np.bool_)):
            shape = (shape,)
        if not isinstance(shape, (tuple, list)) or any(
            not isinstance(d, (int, np.integer)) or isinstance(d, (bool, np.bool_)) or d < 0 for d in shape
        ):
            raise TapeError(f"{method}: random tensor shape must be non-negative integers, got {shape!r}")
        dt = None
        if dtype is not None:
            try:
                dt = np.dtype(dtype)
            except TypeError:
                raise TapeError(f"{method}: {dtype!r} is not a dtype; use a floating dtype such as float32") from None
            if not jnp.issubdtype(dt, jnp.floating):
                raise TapeError(f"{method}: dtype {dt} is not supported; use a floating dtype such as float32")
        v = draw(kind, tuple(int(d) for d in shape), dt, self._key())
        self._rng_counter += 1
        return self._commit_leaf(self._prepare_value(v), False)

    def rand_uniform(
        self, shape: int | tuple[int, ...], dtype: DTypeLike = jnp.float32, low: float = 0.0, high: float = 1.0
    ) -> Tensor:
        """Uniform ``[low, high)`` samples (a constant leaf); advances the RNG counter once."""
        return self._random("rand_uniform", ("uniform", float(low), float(high)), shape, dtype)

    def normal(self, shape: int | tuple[int, ...], dtype: DTypeLike = jnp.float32) -> Tensor:
        """Standard normal samples (a constant leaf); advances the RNG counter once."""
        return self._random("normal", ("normal",), shape, dtype)

    def bernoulli_mask(self, shape: int | tuple[int, ...], keep_prob: float) -> Tensor:
        """Boolean mask, True with probability ``keep_prob``; advances the RNG counter once."""
        if not 0.0 <= float(keep_prob) <= 1.0:
            raise TapeError(f"bernoulli_mask: keep_prob must be in [0, 1], got {keep_prob}")
        return self._random("bernoulli_mask", ("bernoulli", float(keep_prob)), shape, None)

    def random_key(self) -> PRNGKey:
        """A fresh ``jax.random`` key derived from (seed, counter); advances the counter once."""
        self.check_thread()
        return self._next_key()

    # -- backward --------------------------------------------------------------
    def parameter_groups(self) -> list[ParameterGroup]:
        """Trainable parameter leaves of this recording grouped by storage identity."""
        self.check_thread()
        nodes = self._tape._buf.nodes
        trainable = {i: p for i, p in self._params_by_leaf.items() if nodes[i].requires_grad}
        return group_parameter_leaves(trainable, self._storage_by_leaf)

    def backward(self, loss: Tensor, seed: Array | None = None) -> Grads:
        """Gradients of ``loss`` wrt every leaf that requires grad, as a :class:`~tapeflow.Grads`."""
        if not isinstance(loss, Tensor):
            raise TypeError(f"Session.backward expects a Tensor handle, got {type(loss).__name__}")
        check_handle(loss, self)
        if not self.grad_enabled:
            raise TapeError(
                "backward: this is an inference session (grad_enabled=False); it records no gradients. "
                "Open a Session(grad_enabled=True) to train"
            )
        if seed is not None and jnp.iscomplexobj(seed):
            raise TapeError(f"backward: {COMPLEX_HINT}")
        # every trainable leaf gets a gradient (zeros when the loss does not reach it)
        nodes = self._tape._buf.nodes
        wrt = [i for i in range(loss.id + 1) if nodes[i].op is None and nodes[i].requires_grad]
        wrt += [i for i in self._params_by_leaf if i > loss.id and nodes[i].requires_grad]
        by_leaf = _tape_backward(self._tape, loss.id, seed=seed, wrt=wrt)
        return Grads(by_leaf, self.parameter_groups(), self._owner, self._generation)

    # -- reset -----------------------------------------------------------------
    def reset(self) -> None:
        """Drop the recording and invalidate its handles.

        Keeps the owner id, the RNG counter, the backend audit and any optimizer
        state. The session lets go of every value it recorded; JAX frees each
        buffer as soon as nothing else refers to it, so a value the user still
        holds (``h.value``, a ``Tape`` kept or forked, another session's leaf)
        stays valid, and nothing else outlives the reset.
        """
        self.check_thread()
        self._tape = Tape.empty(self.device)
        self._params_by_leaf = {}
        self._storage_by_leaf = {}
        self._generation += 1
