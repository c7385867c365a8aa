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
import functools
import itertools
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal, Self, cast

import jax
import jax.numpy as jnp
import numpy as np

from .._core import _registry as R
from .._core._backward import GraphHook, Hook, backward_graph, root_and_seed, run_hooks
from .._core._backward import backward as _tape_backward
from .._core._device import concrete_array_type, default_device, device_of, resolve_device
from .._core._jvp import jvp_keys
from .._core._nonfinite import Origin
from .._core._precision import Precision, cast_operands
from .._core._registry import attr_key as _attr_key
from .._core._result import Err, TapeError
from .._core._tape import PENDING, Node, Tape, append_node, append_nodes, append_op, check_op, leaf, place
from .._core._typing import Array, ArrayLike, DeviceLike, DTypeLike, NodeId, PRNGKey
from . import _render
from ._debug import NonFiniteCheck, Sites, debug_nans_default
from ._gradctl import GradControls
from ._grads import Grads, ParameterGroup, ParameterRecord, group_parameter_leaves
from ._lazy import BackwardPlan, LazyGrads, LazyRecording, ParameterGroups, Structure, materialize
from ._params import Param, Storage
from ._random import RNG_SEED_RANGE, RandomKind, RandomStream, rng_int
from ._replay import Event, Lane, Outline, node_key, registered_outside
from ._state import StateLog, check_state_cell
from ._tensor import Operand, RemovableHandle, Tensor, check_handle, note_recorded, pop_current, push_current
from ._values import COMPLEX_HINT, ParamSource, RationalFallbackWarning, ValuePolicy, read_host_inputs

__all__ = ["Mode", "RationalFallbackWarning", "Session", "TapeGrowthWarning", "block_session", "traced_session"]

Mode = Literal["eager", "lazy", "traced"]
"""How a session records: ``"eager"`` runs each op at once; ``"lazy"`` records now and computes when a value
is read (``Session(lazy=True)``); ``"traced"`` is the session :func:`~tapeflow.value_and_grad` and
:func:`~tapeflow.train_step` trace, whose Param uses record the step's parameter values and whose state
writes are only recorded."""

_BOOL = np.dtype(bool)
_owner_counter = itertools.count(1)
_owner_lock = threading.Lock()


def _next_owner() -> int:
    with _owner_lock:
        return next(_owner_counter)


def check_host_indices(
    d: R.OpDef, specs: tuple[R.Spec, ...], attrs: dict[str, object], host: dict[int, object]
) -> None:
    """Raise :class:`TapeError` if a position operand of ``d`` given as host data is out of its axis's range.

    Only host data is looked at (NumPy arrays, lists, other frameworks' CPU
    arrays): a device array's values would cost a wait for the device.
    """
    assert d.index_bounds is not None
    for k, lo, hi, skip in d.index_bounds(specs, **attrs):
        if k not in host:
            continue
        a = np.asarray(host[k])
        if skip is not None and a.dtype.kind in "iu":
            a = a[a != skip]  # e.g. cross_entropy's ignore_index: rows that count for nothing
        if a.size == 0 or a.dtype.kind not in "iu":
            continue
        least, most = int(a.min()), int(a.max())
        if least < lo or most >= hi:
            bad = most if most >= hi else least
            raise TapeError(
                f"{d.name}: operand #{k} ({d.operands[k] if k < len(d.operands) else 'indices'}) holds {bad}, out of "
                f"range (valid: {lo} to {hi - 1}); nothing was recorded. Check the ids or labels against the "
                "table's size (an Embedding's num_embeddings, the number of classes)"
            )


_HOST_MEMO_SIZE = 1 << 16  # elements: a replayed NumPy operand at most this large is compared with its last one


def _checks_device_indices(opname: str) -> bool:
    """Whether ``debug_nans`` reads op ``opname``'s device positions (ops that clamp an out-of-range one)."""
    d = R.REGISTRY.get(opname)
    return d is not None and d.index_bounds is not None and d.index_clamps


class TapeGrowthWarning(UserWarning):
    """A session recorded another training step without a reset (its tape keeps growing)."""


def _note_step(ref: weakref.ref[Session], generation: int) -> None:
    """An optimizer stepped from the gradients of ``ref``'s recording ``generation``."""
    s = ref()
    if s is not None:
        s._stepped = max(s._stepped, generation)


class _Current:
    """:meth:`Session.as_current`'s block: the session is current inside it (a class, not a generator: it wraps
    every step of a loop)."""

    __slots__ = ("session", "token")

    def __init__(self, session: Session) -> None:
        self.session = session

    def __enter__(self) -> Session:
        self.token = push_current(self.session)
        return self.session

    def __exit__(self, *exc: object) -> None:
        pop_current(self.token)


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
    check_same_thread:
        True (default): the session and its handles may be used only from the
        thread that created it; another thread gets a :class:`TapeError` (as
        :mod:`sqlite3` does). False lifts the check: you then serialize every use
        yourself.
    compute_dtype:
        Mixed precision (e.g. ``jnp.bfloat16``): parameters keep their dtype and
        each op's float operands are cast (recorded ``astype`` nodes) to this
        dtype, losses and reductions to float32; see :mod:`tapeflow._core._precision`.
    lazy:
        True records ops without running them: values are computed when read,
        and a backward plus an optimizer step run as one compiled program per
        step, cached by the recording's structure (:mod:`tapeflow._shell._lazy`).
        Errors are still raised at record time. Exact-rational ops run eagerly.
        None (default): False.
    debug_nans:
        True checks every backward's loss and gradients for NaN and infinity
        (one fused check) and raises :class:`~tapeflow.NonFiniteError`, with
        nothing updated, naming the op, node, line and module that made the
        first non-finite value (see :mod:`tapeflow._core._nonfinite`). Each op
        notes the line that recorded it. None (default): the environment
        variable ``TAPEFLOW_DEBUG_NANS``.

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
        check_same_thread: bool = True,
        compute_dtype: DTypeLike | None = None,
        lazy: bool = False,
        debug_nans: bool | None = None,
    ) -> None:
        self._setup(
            resolve_device(device) if device is not None else default_device(),
            rng_int("seed", seed, RNG_SEED_RANGE, "Session"),
            grad_enabled=grad_enabled,
            show_backend=show_backend,
            check_same_thread=check_same_thread,
            compute_dtype=compute_dtype,
            mode="lazy" if lazy else "eager",
            debug_nans=debug_nans_default(debug_nans),
        )

    def _setup(
        self,
        device: jax.Device,
        seed: int,
        *,
        grad_enabled: bool,
        show_backend: bool,
        check_same_thread: bool,
        compute_dtype: DTypeLike | None,
        mode: Mode,
        key: PRNGKey | None = None,
        params: ParamSource | None = None,
        debug_nans: bool = False,
    ) -> None:
        """Every field of a session; the public constructor and the private factories below all end here."""
        self._thread: int | None = threading.get_ident() if check_same_thread else None
        self.device: jax.Device = device
        self.grad_enabled = bool(grad_enabled)
        self.show_backend = bool(show_backend)
        self._mode: Mode = mode
        self._owner = _next_owner()
        self._ref = weakref.ref(self)
        self._generation = 0
        self._lane: Lane | None = None  # a replay that has built no nodes yet (see _tape)
        self._tape = Tape.empty(self.device)
        self._params_by_leaf: dict[NodeId, ParameterRecord] = {}
        self._storage_by_leaf: dict[NodeId, Storage] = {}
        self.selected_backends: list[tuple[str, str]] = []
        self._backend_seen: set[str] = set()
        self._tokens: list[contextvars.Token[Session | None]] = []
        # what ended each recent generation (True: the exit of a ``with s:`` block, False: a reset() call), so a
        # stale handle's error names the reset the user made; bounded, oldest forgotten first
        self._ended_by_exit: dict[int, bool] = {}
        self._exiting = False
        self.precision = None if compute_dtype is None else Precision(compute_dtype)  # mixed precision policy
        # the parts: how values enter, where Param uses read, the random stream, state writes, grad controls
        self._values = ValuePolicy(self.device, self._owner)
        self._param_source = params  # None: every use records its storage's value (the fast path in apply)
        self._rng = RandomStream(seed, key)
        self._state_log = StateLog()  # assign_state's writes in this recording
        self._grad = GradControls()
        self._lazy = LazyRecording()  # the structure of a lazy recording (unused by other modes)
        self._outline: Outline | None = None  # the last recording (lazy, or eager), replayed while it matches
        self._events: dict[NodeId, Event] = {}  # the apply calls of this recording (the next outline)
        self._unfit: Structure | None = None  # a structure whose backward failed to trace as one program
        self._stepped = -1  # the generation an optimizer last stepped from (a backward after that: no reset)
        self._warned_growth = False
        self._eagerly = 0  # open recording_eagerly blocks: a lazy session runs its ops at once inside them
        self.debug_nans = debug_nans
        self._sites: Sites | None = Sites() if debug_nans else None  # debug_nans: where each node was recorded
        self._index_flags: list[Array] = []  # debug_nans, traced: "every index of this op is in range", per op

    # -- the tape ----------------------------------------------------------------
    @property
    def _tape(self) -> Tape:
        """The current tape value. A lazy session replaying its outline on a :class:`Lane` builds the nodes now
        (the first read of the recording, or a call the outline does not hold) and goes on node by node."""
        if self._lane is not None:
            self._flush()
        return self._tape_now

    @_tape.setter
    def _tape(self, t: Tape) -> None:
        self._tape_now = t

    def _flush(self) -> None:
        """Turn the lane into nodes: the tape, Param leaves and events a node-by-node replay would have made."""
        lane = cast(Lane, self._lane)
        t = lane.tape()
        self._lane = None
        pbl, sbl = self._params_by_leaf, self._storage_by_leaf
        for i, p in lane.uses:
            pbl[i] = p
            sbl[i] = p.storage
        events = self._events
        for n, ev in lane.starts:
            events[n] = ev
        ol = lane.outline
        if ol is self._outline:
            ol.matched, ol.tape = len(t), t
        self._tape_now = t

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
    def unlisted_storages(self) -> tuple[Storage, ...]:
        """Storages a traced recording read at their current value because the step's values did not list them.

        The compiled training step passes these as runtime arguments from its next
        call on, so a frozen table or another optimizer's parameter is never baked
        into a program as a constant. Empty for a session that is not traced.

        >>> import tapeflow as tfl
        >>> tfl.Session().unlisted_storages
        ()
        """
        src = self._param_source
        return tuple(src.unlisted) if src is not None else ()

    @property
    def lazy(self) -> bool:
        """Whether this session records lazily (``Session(lazy=True)``).

        >>> import tapeflow as tfl
        >>> tfl.Session(lazy=True).lazy, tfl.Session().lazy
        (True, False)
        """
        return self._mode == "lazy"

    @property
    def mode(self) -> Mode:
        """How this session records: ``"eager"``, ``"lazy"`` or ``"traced"`` (see :data:`Mode`).

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> tfl.Session().mode, tfl.Session(lazy=True).mode
        ('eager', 'lazy')
        >>> modes = []
        >>> def loss_fn(s):
        ...     modes.append(s.mode)
        ...     return tfl.sum(s.input(jnp.ones(2)))
        >>> _ = tfl.value_and_grad(loss_fn)({})
        >>> modes
        ['traced']
        """
        return self._mode

    @property
    def tape(self) -> Tape:
        """The current tape value (immutable; a new one after every op; a lazy session computes its values first)."""
        self.materialize()
        return self._tape

    @property
    def recording(self) -> Tape:
        """The current tape value as recorded: a lazy session's uncomputed nodes hold ``PENDING`` (nothing is computed).

        For what a node *is* (op, shape, dtype, ``requires_grad``) without paying
        for its value; :attr:`tape` computes the values first.

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> s = tfl.Session(lazy=True)
        >>> y = s.input(jnp.ones(2)) * 2.0
        >>> s.recording[y.id].op, s.recording[y.id].shape
        ('mul', (2,))
        """
        return self._tape

    def materialize(self) -> None:
        """Compute every value a lazy session has recorded but not computed (one compiled program); else nothing.

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> s = tfl.Session(lazy=True)
        >>> y = s.input(jnp.ones(2)) * 2.0
        >>> z = y + 1.0
        >>> s.materialize()  # one program computes y and z; reading them is then free
        >>> y.value.tolist(), z.value.tolist()
        ([2.0, 2.0], [3.0, 3.0])
        """
        if self._mode == "lazy":
            self.check_thread()
            t = self._tape
            materialize(self._lazy, t)
            read_host_inputs(t, [i for i, nd in enumerate(t.nodes) if type(nd.value) is np.ndarray])

    def __repr__(self) -> str:
        kind = "" if self.grad_enabled else ", inference"
        return (
            f"Session(owner={self._owner}, generation={self._generation}, nodes={len(self._tape)}, "
            f"device={self.device}, rng_counter={self._rng.counter}{kind})"
        )

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        return _render.render_session(self, path, subtree_renderer)  # treescope picture (tapeflow[viz])

    # -- context ---------------------------------------------------------------
    def __enter__(self) -> Session:
        self.check_thread()
        self._tokens.append(push_current(self))
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._exiting = True
            self.reset()
        finally:
            self._exiting = False
            pop_current(self._tokens.pop())

    def stale_reason(self, generation: int) -> str:
        """What invalidated handles of ``generation`` (an older one): the end of a ``with`` block or a reset().

        The stale-handle error quotes it; the last 64 generations are remembered.

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> s = tfl.Session()
        >>> with s:
        ...     x = s.input(jnp.ones(2))
        >>> s.stale_reason(x.generation).startswith("the `with s:` block")
        True
        """
        by_exit = self._ended_by_exit.get(generation)
        if by_exit is None:
            return "a Session.reset() or the end of a `with s:` block invalidated handles recorded before it"
        if by_exit:
            return (
                "the `with s:` block it was recorded in has ended, and leaving the block resets the session, "
                "which invalidates its handles: read what you need inside the block (float(loss), loss.value)"
            )
        return "Session.reset() invalidates handles recorded before it"

    def as_current(self) -> AbstractContextManager[Session]:
        """Make this the current session for a block, without resetting it afterwards.

        >>> import tapeflow as tfl
        >>> s = tfl.Session()
        >>> with s.as_current():
        ...     tfl.current_session() is s
        True
        """
        return _Current(self)

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
        """The recorded node behind the live handle ``h`` (raises for a stale or foreign one), with its value."""
        check_handle(h, self)
        nd = self._tape[h.id]
        v = nd.value
        if v is PENDING:
            materialize(self._lazy, self._tape)  # only a lazy session has pending nodes
        elif type(v) is np.ndarray:
            read_host_inputs(self._tape, (h.id,))
        return nd

    def value(self, h: Tensor) -> Array:
        """The value of the live handle ``h`` (``node(h).value``); a lane's value that a program computed already
        (the loss of a fused step) is read without building the recording's nodes.

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> s = tfl.Session()
        >>> s.value(s.input(jnp.ones(2)) * 2.0).tolist()
        [2.0, 2.0]
        """
        lane = self._lane
        if lane is not None:
            check_handle(h, self)
            v = lane.filled.get(h.id)
            if v is not None:
                return v
        return self.node(h).value

    # -- leaves ----------------------------------------------------------------
    def _commit(self, t: Tape) -> None:
        """Install ``t`` as the current tape (the one place the session's tape changes between resets)."""
        self.check_thread()
        self._install(t)

    def _install(self, t: Tape) -> None:
        """:meth:`_commit` after its thread check (``record_op`` checked the thread at its first line)."""
        if self._mode == "lazy":
            lz = self._lazy
            n = len(t)
            if n < len(lz.keys):
                lz.truncate(n)  # a failed backward put an older tape back
            elif n and t[n - 1].dtype is R.OBJECT:
                lz.exact = True  # exact rationals: backward runs eagerly
            ol = self._outline
            if ol is not None:
                ol.follow(t)  # nodes recorded outside the replay fast path still match the outline?
        else:
            if len(t) < self._lazy.checked or len(t) < len(self._lazy.keys):  # an eager session keys its structure
                self._lazy.truncate(len(t))  # for a compiled backward: a failed one put an older tape back
            ol = self._outline
            if ol is not None:
                ol.follow(t)
        if self._sites is not None:
            self._sites.note(len(self._tape), len(t))
        self._tape_now = t  # (what the _tape setter does, without the property call)
        note_recorded(self._ref)

    def _commit_leaf(self, value: Array, requires_grad: bool) -> Tensor:
        t, i = leaf(self._tape, value, requires_grad=requires_grad and self.grad_enabled and not self._grad.depth)
        self._commit(t)
        return self._handle(i)

    def input(self, x: ArrayLike | Tensor, requires_grad: bool = False) -> Tensor:
        """Record ``x`` (array-like; integer and boolean too) as a leaf; gradient only if asked."""
        if type(x) is concrete_array_type():  # a jax.Array: leaf() places it
            dt = cast(Array, x).dtype
            if dt.kind != "c":
                if self._lane is not None:
                    dev = self._tape_now.device
                    if dev is None or device_of(x) is dev:  # placed already: the leaf holds it as it is
                        got = self._lane_leaf(cast(Array, x), dt, requires_grad)
                        if got is not None:
                            return got
                return self._commit_leaf(cast(Array, x), requires_grad)
        if isinstance(x, Tensor):
            x = self.node(x).value
        v = self._values.prepare(x, host=self._mode == "lazy")
        if type(v) is np.ndarray and v.dtype != R.OBJECT:  # a lazy session's host input (read as a jax.Array)
            dt = np.dtype(v.dtype)
            if self._lane is not None:
                got = self._lane_leaf(v, dt, requires_grad)
                if got is not None:
                    return got
            t, i = append_node(self._tape, Node(None, (), (), v, self._leaf_grad(requires_grad, dt), v.shape, dt))
            self._commit(t)
            return self._handle(i)
        return self._commit_leaf(v, requires_grad)

    def _leaf_grad(self, requires_grad: bool, dt: np.dtype) -> bool:
        """Whether an input leaf of dtype ``dt`` records gradients: asked for, gradients on here, a float."""
        return bool(requires_grad) and self.grad_enabled and not self._grad.depth and R.is_float(dt)

    def _lane_leaf(self, v: Array | np.ndarray, dt: np.dtype, requires_grad: bool) -> Tensor | None:
        """An input leaf holding ``v`` (as :meth:`input` records it) on the lane, if the outline has one here."""
        self.check_thread()
        lane = cast(Lane, self._lane)
        ol, n = lane.outline, lane.pos
        spec = (tuple(v.shape), dt)
        if (
            n >= len(ol.keys)
            or n in ol.events
            or n in ol.registered  # the outline's leaf here was a Param's (``use``): this input is not
            or ol.keys[n] != (None, (), (), self._leaf_grad(requires_grad, dt), spec)
        ):
            return None
        lane.vals.append(v)
        lane.pos = n + 1
        note_recorded(self._ref)
        return Tensor(self, self._owner, self._generation, n, spec[0], dt)

    def const(self, x: ArrayLike) -> Tensor:
        """Record a constant leaf (never requires grad)."""
        return self.input(x, requires_grad=False)

    def detach(self, h: Tensor) -> Tensor:
        """A new leaf holding ``h``'s value, cut off from the recording's gradients."""
        return self._commit_leaf(self.node(h).value, False)

    def _param_value(self, p: Param) -> Array:
        src = self._param_source
        if src is not None:
            v = src.read(p)
            if v is not None:
                return v
        if p.bound:  # a view rebuilt by a JAX transformation carries its own value
            return p.value
        st = p.storage
        if st.dtype == R.OBJECT:
            self._values.warn_rational()
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
    def _check_device_indices(
        self,
        d: R.OpDef,
        specs: tuple[R.Spec, ...],
        attrs: dict[str, object],
        operands: tuple[Operand, ...],
        plan: list[NodeId | Param | Array],
        host: dict[int, object] | None,
    ) -> None:
        """debug_nans: the index check of device values too (a wait for the device; a traced value adds a flag).

        A value JAX traces cannot be read: its check joins the step's finite
        check (:meth:`index_guard`), and the host run that explains a refused
        step reads it and raises here.
        """
        for k, lo, hi, skip in d.index_bounds(specs, **attrs) if d.index_bounds is not None else ():
            o = operands[k]
            if (host is not None and k in host) or isinstance(o, Param):
                continue
            if type(o) is Tensor:
                v = o.value  # a lazy session computes it
            else:
                v = plan[k]
            if not isinstance(v, jax.Array) or not jnp.issubdtype(v.dtype, jnp.integer):
                continue
            if isinstance(v, jax.core.Tracer):
                ok = (v >= lo) & (v < hi)
                self._index_flags.append(jnp.all(ok if skip is None else ok | (v == skip)))
            else:
                check_host_indices(d, specs, attrs, {k: np.asarray(v)})

    def index_guard(self, value: Array) -> Array:
        """``value``, or NaN where an index this trace recorded is out of range (``debug_nans``; else ``value``).

        :func:`~tapeflow.train_step` and :func:`~tapeflow.value_and_grad` check
        this in place of the loss: a bad index refuses the step as a non-finite
        loss would, and the host run that explains the refusal names the op.

        >>> import jax, jax.numpy as jnp, tapeflow as tfl
        >>> s = tfl.Session()
        >>> s.index_guard(jnp.float32(2.0)).tolist()
        2.0
        """
        if not self._index_flags:
            return value
        ok = jnp.all(jnp.stack(self._index_flags))
        return jnp.where(ok, value, jnp.asarray(jnp.nan, value.dtype))

    def apply(self, opname: str, *operands: Operand, **attrs: Any) -> Tensor:
        """Record registered op ``opname`` on this session; on any failure nothing changes.

        Handles are checked left to right (a foreign handle is reported before a
        stale one), then the op is checked once against the operands' shapes and
        dtypes (:func:`tapeflow._core._tape.check_op`, the same check as ``record``),
        and only then are Param and constant operands recorded as leaves.

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> s = tfl.Session()
        >>> s.apply("mul", s.input(jnp.arange(3.0)), 2.0).value.tolist()
        [0.0, 2.0, 4.0]
        """
        return self.record_op(opname, operands, attrs)

    def record_op(self, opname: str, operands: tuple[Operand, ...], attrs: dict[str, object]) -> Tensor:
        """:meth:`apply` with the operands as a tuple and the attributes as a dict (what ``tfl.<op>`` calls).

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> s = tfl.Session()
        >>> s.record_op("sum", (s.input(jnp.arange(3.0)),), {"axis": 0}).value.tolist()
        3.0
        """
        if self._thread is not None and self._thread != threading.get_ident():
            self.check_thread()  # raises
        owner, gen = self._owner, self._generation
        for o in operands:
            if type(o) is Tensor and (o._owner != owner or o._generation != gen):
                check_handle(o, self)  # raises: foreign before stale, left to right
        lane = self._lane
        if lane is not None:  # replaying with no nodes built: the outline's call again? (else the nodes are built)
            ev = lane.outline.events.get(lane.pos)
            if (
                ev is not None
                and not self._eagerly
                and self.precision is None
                and self._param_source is None
                and not self.debug_nans
            ):
                try:
                    akey = _attr_key(attrs.items()) if attrs else ()
                except TypeError:
                    akey = None
                tracked = self.grad_enabled and not self._grad.depth
                if ev.lane(opname, operands, akey, tracked, self.device, lane.vals, self._host_leaf):
                    if ev.uses:
                        lane.held.append(operands)
                    n = lane.pos = lane.pos + len(ev.plan)
                    note_recorded(self._ref)
                    shape, dtype = ev.out
                    return Tensor(self, owner, gen, n - 1, shape, dtype)
        t0 = self._tape
        ol = self._outline
        # the last recording's call, again? (a session without a policy whose Params read their storages)
        if (
            ol is not None
            and ol.tape is t0
            and not self._eagerly
            and self.precision is None
            and not (self.debug_nans and _checks_device_indices(opname))  # replay checks no index
        ):
            n0 = ol.matched
            ev = ol.events.get(n0)
            if ev is not None and self._param_source is None:
                try:
                    akey = _attr_key(attrs.items()) if attrs else ()
                except TypeError:
                    akey = None
                tracked = self.grad_enabled and not self._grad.depth
                got = ev.replay(opname, operands, akey, tracked, self.device, self._host_leaf)
                if got is not None:
                    new, params = got
                    if self._mode == "eager":
                        ev.compute(new, t0)  # the op runs at its line, as in the normal path
                    t = append_nodes(t0, new)
                    if self._sites is not None:
                        self._sites.note(len(t0), len(t))
                    self._tape = ol.tape = t
                    note_recorded(self._ref)
                    ol.matched = n = n0 + len(new)
                    self._events[n0] = ev
                    if params:
                        pbl, sbl = self._params_by_leaf, self._storage_by_leaf
                        for j, prm in params:
                            pbl[n0 + j] = prm
                            sbl[n0 + j] = prm.storage
                    out = new[-1]
                    return Tensor(self, owner, gen, n - 1, out.shape, out.dtype)
        plan: list[NodeId | Param | Array] = []
        specs: list[R.Spec] = []
        host: dict[int, object] | None = None  # operands given as host data, by position
        ref_dtype: np.dtype | None = None  # dtype given to Python-number operands (set on first need)
        for o in operands:
            if type(o) is Tensor:
                plan.append(o.id)
                specs.append(t0[o.id].spec)
            elif isinstance(o, Param):
                plan.append(o)
                specs.append((o.shape, o.dtype))
            else:
                if ref_dtype is None:
                    for x in operands:
                        if isinstance(x, (Tensor, Param)) and x.dtype != _BOOL:
                            ref_dtype = x.dtype
                            break
                v = self._values.constant(o, ref_dtype, opname)
                if not isinstance(o, (jax.Array, int, float)):  # host data: an index it holds can be checked now
                    host = host or {}
                    host[len(plan)] = o
                plan.append(v)
                specs.append((tuple(v.shape), np.dtype(v.dtype)))
        casts = self.precision.targets(opname, specs) if self.precision is not None else None
        if casts is not None:  # the op is checked with the dtypes it will compute in
            specs = [(sh, dt if c is None else c) for (sh, dt), c in zip(specs, casts)]
        entry = check_op(opname, attrs, tuple(specs))
        if isinstance(entry, str):
            raise TapeError(entry)
        if (host is not None or self.debug_nans) and entry.opdef.index_bounds is not None:  # cheap test first
            if host is not None:
                check_host_indices(entry.opdef, tuple(specs), dict(entry.attrs), host)
            if self.debug_nans and entry.opdef.index_clamps:
                self._check_device_indices(entry.opdef, tuple(specs), dict(entry.attrs), operands, plan, host)
        lazy = self._mode == "lazy" and not self._eagerly
        if lazy and entry.dtype is R.OBJECT:  # exact rationals stay eager (NumPy objects, not XLA)
            lazy = False
            self.materialize()
        # leaves and the op on a local tape value; commit only on success
        t = self._tape
        ids: list[NodeId] = []
        new_params: list[tuple[NodeId, Param]] = []
        grad_on = not self._grad.depth
        tracked = self.grad_enabled and grad_on
        direct = self._param_source is None
        # the call's event for the next recording to replay (a lazy op, or an eager one XLA computes; Params read
        # directly, no policy); a session notes events from its second recording on (a session used once pays
        # nothing for replay)
        note = (
            (lazy or (self._mode == "eager" and entry.dtype is not R.OBJECT))
            and direct
            and self._generation
            and self.precision is None
        )
        sources: list[int] | None = [] if note else None
        for k, p in enumerate(plan):
            if type(p) is int:
                ids.append(p)
            elif isinstance(p, Param):
                st = p.storage
                if direct and not p.bound and st.dtype is not R.OBJECT:
                    # the storage's value on this device: placed already, so the leaf is made directly
                    rg = p.trainable and tracked and R.is_float(st.dtype)
                    t, i = append_node(t, Node(None, (), (), st.read(self.device), rg, st.shape, st.dtype))
                else:
                    t, i = leaf(t, self._param_value(p), requires_grad=p.trainable and tracked)
                    sources = None
                new_params.append((i, p))
                ids.append(i)
                if sources is not None:
                    sources.append(k)
            else:
                t, i = leaf(t, p, requires_grad=False)
                ids.append(i)
                if sources is not None:
                    sources.append(k)
        if casts is not None:
            t, ids = cast_operands(t, ids, casts, grad_on, lazy)
        t, r = append_op(t, opname, entry, tuple(ids), None, grad_on, lazy)
        if isinstance(r, Err):
            raise TapeError(r.error)
        self._install(t)
        for i, p in new_params:
            self._register_param_leaf(i, p, p.storage)
        if opname not in self._backend_seen:
            self._audit(opname, entry.dtype)
        if sources is not None:
            self._note_event(opname, entry, attrs, operands, tracked, t, len(t0), sources, tuple(specs))
        nd = t[r.value]
        return Tensor(self, owner, gen, r.value, nd.shape, nd.dtype)

    def _note_event(
        self,
        opname: str,
        entry: R.FwdEntry,
        attrs: dict[str, object],
        operands: tuple[Operand, ...],
        tracked: bool,
        t: Tape,
        n0: int,
        sources: list[int],
        specs: tuple[R.Spec, ...],
    ) -> None:
        """Note the call that appended nodes ``n0..`` of ``t`` as an event of this recording (the next outline)."""
        try:
            akey = _attr_key(attrs.items()) if attrs else ()
            hash(akey)
        except TypeError:
            return  # an unhashable attribute: not replayed
        checked = (specs, dict(entry.attrs))
        ev = Event.of(opname, entry.opdef, akey, operands, tracked, t.nodes[n0:], [*sources, -1], checked, entry.fn)
        if ev is not None:
            self._events[n0] = ev

    def _host_leaf(self, ev: Event, k: int, o: np.ndarray) -> Array:
        """Operand ``k`` of a replayed call of ``ev``, a NumPy array, as the normal path makes its leaf's value:
        converted and placed as a constant, a position operand's ids checked against their range first.

        The same values as at the event's last call (``np.arange(n)`` positions, a fixed index table: compared
        byte for byte, the event having matched shape and dtype) give the value made then, which was converted,
        checked against the same operand specs and placed the same way; the array itself is never kept, only
        a copy of its bytes, so an array edited in place is converted again."""
        dev = self._tape_now.device
        data = o.tobytes() if o.size <= _HOST_MEMO_SIZE else None
        if data is not None:
            last = ev.hosts.get(k)
            if last is not None and last[0] == data and last[2] is dev and not last[1].is_deleted():
                return last[1]
        v = self._values.constant(o, None, ev.opname)
        d = ev.opdef
        if d.index_bounds is not None:
            specs, attrs = ev.checked
            check_host_indices(d, specs, attrs, {k: o})
        placed = cast(Array, place(v, dev))
        if data is not None and type(placed) is concrete_array_type():
            ev.hosts[k] = (data, placed, dev)
        return placed

    def _audit(self, opname: str, dtype: np.dtype) -> None:
        self._backend_seen.add(opname)
        kernel = "numpy-exact (cpu)" if dtype == R.OBJECT else f"xla:{self.device.platform}"
        self.selected_backends.append((opname, kernel))
        if self.show_backend:
            print(f"[tapeflow] {opname}: {kernel}", file=sys.stderr)

    # -- backward --------------------------------------------------------------
    def parameter_groups(self) -> list[ParameterGroup]:
        """Trainable parameter leaves of this recording grouped by storage identity."""
        self.check_thread()
        nodes = self._tape.nodes
        trainable = {i: p for i, p in self._params_by_leaf.items() if nodes[i].requires_grad}
        return group_parameter_leaves(trainable, self._storage_by_leaf)

    def backward(
        self,
        loss: Tensor,
        seed: Array | None = None,
        *,
        wrt: Sequence[Tensor] = (),
        create_graph: bool = False,
    ) -> Grads:
        """Gradients of ``loss`` wrt every leaf that requires grad (and each handle in ``wrt``), as a :class:`~tapeflow.Grads`.

        * ``wrt``: further handles of this recording, interior nodes included,
          whose cotangents ``grads[h]`` also returns (zeros when ``loss`` does
          not reach them), like PyTorch's ``retain_grad``. Each must require
          grad (a leaf recorded with ``requires_grad=True``, or a node computed
          from one); any other raises :class:`TapeError`.
        * ``create_graph=True``: the backward pass is recorded on this tape, so
          every gradient is a Tensor that can be used in further ops and
          differentiated again (``grads[W]`` of a tied Param is one recorded sum).
        * Hooks (:meth:`Tensor.register_hook`, :meth:`Param.register_hook`) run
          here; if one raises, the tape is as before and no gradients are returned.

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> with tfl.Session() as s:
        ...     x = s.input(jnp.array(3.0), requires_grad=True)
        ...     h = x * x
        ...     g = s.backward(h * x, wrt=[h], create_graph=True)
        ...     float(g[h]), float(g[x]), float(s.backward(g[x])[x])    # x, 3x^2, 6x
        (3.0, 27.0, 18.0)
        """
        if not isinstance(loss, Tensor):
            raise TypeError(f"Session.backward expects a Tensor handle, got {type(loss).__name__}")
        check_handle(loss, self)
        if self._lane is not None and seed is None and not wrt and not create_graph:
            laned = self._lane_backward(loss)
            if laned is not None:
                return laned
        if not self.grad_enabled:
            raise TapeError(
                "backward: this is an inference session (grad_enabled=False); it records no gradients. "
                "Open a Session(grad_enabled=True) to train"
            )
        if seed is not None and jnp.iscomplexobj(seed):
            raise TapeError(f"backward: {COMPLEX_HINT}")
        for k, h in enumerate(wrt):
            if not isinstance(h, Tensor):
                raise TypeError(f"backward: wrt takes Tensor handles of this session, got {type(h).__name__}")
            check_handle(h, self)
            # the sweep stops at nodes that need no gradient: their cotangent would read as zeros
            nd = self._tape.nodes[h.id]
            if not nd.requires_grad and nd.op is None:
                raise TapeError(
                    f"backward: wrt[{k}] {h!r} was recorded without requires_grad, so the loss has no gradient "
                    "wrt it (it would read as zeros); record it with s.input(..., requires_grad=True)"
                )
            if not nd.requires_grad:
                raise TapeError(
                    f"backward: wrt[{k}] {h!r} depends on no leaf that requires grad, so the loss has no gradient "
                    "wrt it (it would read as zeros); record the inputs it is computed from with "
                    "s.input(..., requires_grad=True)"
                )
        if self._stepped == self._generation and not self._warned_growth:
            self._warn_growth()
        old = self._tape
        hooks: dict[NodeId, list[Any]] = {
            i: [self._hook_call(i, fn, create_graph) for fn in fns] for i, fns in self._grad.hooks.items() if fns
        }
        lazy = self._mode == "lazy" and not (create_graph or hooks or self._lazy.exact)
        # an eager session's backward runs as one compiled program (fused with the optimizer step that consumes
        # it) whenever its structure allows, decided by the structure alone (see _compiles_backward)
        lz, ol = self._lazy, self._outline
        if ol is not None and len(lz.keys) < len(old) and (lazy or self._mode == "eager"):
            hint = ol.structure_hint(len(old), lz.epoch)
            if hint is not None:
                lz.keys = hint  # a replayed recording's structure is the outline's
        compiled = self._mode == "eager" and not (create_graph or hooks) and self._compiles_backward(old)
        program = lazy or compiled
        plan: BackwardPlan | None = None
        if program:  # the same structure, Params and request as the last backward: what it worked out holds
            struct = lz.structure(old)
            wrt_ids = tuple(h.id for h in wrt)
            plan = self._lazy.plan
            if plan is None or not plan.matches(
                struct, loss.id, seed, wrt_ids, self._params_by_leaf, self._storage_by_leaf
            ):
                plan = None
        kept = None if plan is None else plan.groups()
        if plan is not None and kept is not None:
            ids, groups = plan.ids, kept
        else:
            plan = None
            # every trainable leaf gets a gradient (zeros when the loss does not reach it)
            nodes = old.nodes
            ids = [i for i, nd in enumerate(nodes[: loss.id + 1]) if nd.op is None and nd.requires_grad]
            ids += [i for i in self._params_by_leaf if i > loss.id and nodes[i].requires_grad]
            ids += [h.id for h in wrt]
            groups = ParameterGroups(self.parameter_groups())
        if not lazy:
            self.materialize()  # the sweep below reads every value
        by_leaf: dict[NodeId, Any] | LazyGrads
        try:
            if program and plan is None:
                checked = root_and_seed(old, loss.id, seed)[1]  # root and seed checked now, as eagerly
                pending = LazyGrads(struct, old, loss.id, None if seed is None else checked, ids)
                try:
                    pending.check()
                except Exception:
                    if not compiled:
                        raise
                    program = False  # what fails to trace as one program runs op by op (a failing VJP raises there)
                    self._unfit = struct
                if program and seed is None:
                    self._lazy.plan = BackwardPlan.of(
                        struct, loss.id, wrt_ids, self._params_by_leaf, self._storage_by_leaf, ids, groups
                    )
            if program:  # computed on first read, or fused into the optimizer step that consumes them
                by_leaf = pending if plan is None else LazyGrads(struct, old, loss.id, None, ids)  # plan: checked
            elif create_graph:
                with self._recording_eagerly():  # the sweep and the hooks read values
                    t, by_id = backward_graph(old, loss.id, seed, ids, hooks)
                self._commit(t)
                by_leaf = {i: self._handle(j) for i, j in by_id.items()}
            else:
                by_leaf = _tape_backward(old, loss.id, seed=seed, wrt=ids, hooks=hooks)
            check = self._nonfinite_check(old, loss.id, seed)
            if check is not None and check.debug and compiled and program:
                # an eager session's backward raises at its line under debug_nans, compiled or not: the
                # gradients are computed now (not fused into the optimizer step) and checked below
                by_leaf = cast(LazyGrads, by_leaf).resolve()
                program = False
            if check is not None and check.debug and not program:
                got = cast(dict[NodeId, Any], by_leaf).values()
                check.verify([self.node(h).value for h in got] if create_graph else list(got), "backward")
            grads = Grads(by_leaf, groups, self._owner, self._generation)
            grads.on_step = functools.partial(_note_step, self._ref, self._generation)
            grads.check = check
            self._state_log.attach(grads)
            for group in grads.groups:
                if group.storage is not None and group.storage.hooks:
                    g = grads.group_gradient(group)
                    grads.set_group_gradient(group, run_hooks(group.storage.hooks, g, repr(group.parameter)))
        except BaseException:
            self._commit(old)  # hooks may have recorded on the tape: none of it happened
            raise
        ol = self._outline
        if lazy and seed is None and not wrt and ol is not None and ol.tape is old and ol.matched == len(ol.keys):
            # a whole replay of the outline: the next one, on a lane, may reuse this backward's plan as it is
            ol.plan, ol.struct = self._lazy.plan, struct
        return grads

    def _lane_backward(self, loss: Tensor) -> Grads | None:
        """:meth:`backward` of a lane that replayed the whole outline, by the plan its last backward used (the
        same Grads, groups and lazy gradients); None: the normal path (which builds the nodes)."""
        lane = cast(Lane, self._lane)
        ol = lane.outline
        plan = ol.plan
        groups = None if plan is None else plan.groups()
        if (
            plan is None
            or groups is None
            or plan is not self._lazy.plan
            or plan.root != loss.id
            or plan.wrt
            or not lane.whole
            or not self.grad_enabled
            or self.debug_nans
            or self._stepped == self._generation
            or any(self._grad.hooks.values())
        ):
            return None
        for group in groups:
            if group.storage is not None and group.storage.hooks:
                return None
        grads = Grads(
            LazyGrads(cast(Structure, ol.struct), lane, loss.id, None, plan.ids),
            groups,
            self._owner,
            self._generation,
        )
        grads.on_step = functools.partial(_note_step, self._ref, self._generation)
        self._state_log.attach(grads)
        return grads

    def _warn_growth(self) -> None:
        """A second training step on one recording: the tape (and the memory it holds) grows with every step."""
        self._warned_growth = True
        warnings.warn(
            f"Session: backward of another training step on the same recording ({len(self._tape)} nodes, growing "
            "with every step): an optimizer already stepped from this recording's gradients. A session keeps "
            "every op until it is reset (PyTorch frees its graph after backward), so each step gets slower and "
            "holds more memory. Reset once per step: wrap the step in `with s:` (it resets on exit), or call "
            "s.reset() after opt.step(...)",
            TapeGrowthWarning,
            stacklevel=3,
        )

    def _nonfinite_check(self, tape: Tape, root: NodeId, seed: Array | None) -> NonFiniteCheck | None:
        """How this backward's non-finite gradients are checked (debug_nans) and explained (also for check_finite).

        An eager session's tape holds every forward value, so an optimizer's
        ``check_finite`` refusal can name the origin at no cost; a lazy session's
        would have to recompute it, which only ``debug_nans`` asks for.
        """
        if self._mode == "traced" or (not self.debug_nans and self._mode != "eager"):
            return None  # a traced session's caller (train_step, value_and_grad) checks its program's outputs
        return NonFiniteCheck(self.debug_nans, tape, root, seed, self._sites, self._params_by_leaf)

    def nonfinite_origin(self, loss: Tensor, seed: Array | None = None) -> Origin | None:
        """Where the first non-finite value reaching ``loss`` or its gradients was made (None: all finite).

        The search of :func:`tapeflow.nonfinite_origin` on this recording, with the
        Param names, and (``debug_nans=True``) each op's line and module path.

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> s = tfl.Session()
        >>> x = s.input(jnp.array([1.0, 0.0]))
        >>> o = s.nonfinite_origin(tfl.sum(tfl.log(x)))
        >>> o.phase, o.op, o.node
        ('forward', 'log', 1)
        """
        check_handle(loss, self)
        self.materialize()
        return NonFiniteCheck(self.debug_nans, self._tape, loss.id, seed, self._sites, self._params_by_leaf).explain()

    def _compiles_backward(self, tape: Tape) -> bool:
        """Whether this eager backward of ``tape`` runs as one compiled program.

        Decided by the recording alone, never by what the session ran before: a
        run restored from a checkpoint into a new session then takes the same
        path at every step as the uninterrupted run, so it continues bit for bit
        (the op-by-op sweep and the program round differently). Op by op: a
        recording :meth:`LazyRecording.compiled_structure` refuses, a block's
        session, and a structure whose backward failed to trace (it fails again).
        """
        struct = self._lazy.compiled_structure(tape)
        return struct is not None and self._param_source is None and struct != self._unfit

    # -- reset -----------------------------------------------------------------
    def reset(self) -> None:
        """Drop the recording and invalidate its handles.

        Keeps the owner id, the RNG counter, the backend audit and any optimizer
        state. The session lets go of every value it recorded; JAX frees each
        buffer as soon as nothing else refers to it, so a value the user still
        holds (``h.value``, a ``Tape`` kept or forked, another session's leaf)
        stays valid, and nothing else outlives the reset but the constants the
        session reuses: Python numbers' values, and the last value each NumPy
        operand of its outline's calls made (see ``_host_leaf``).
        """
        self.check_thread()
        lane = self._lane
        if lane is not None and lane.pos == len(lane.outline.keys):
            self._lane = None  # the whole outline again, its nodes never built: it stays the outline as it is
        elif self._mode != "traced":
            self._keep_outline()
        self._tape = Tape.empty(self.device)
        ol = self._outline
        if ol is not None:
            ol.start(self._tape_now)
            if self._mode == "lazy" and self._sites is None:
                self._lane = Lane(ol, self._tape_now)  # the next recording replays on a lane while it matches
        self._params_by_leaf = {}
        self._storage_by_leaf = {}
        self._grad.clear()
        self._state_log = StateLog()
        if self._sites is not None:
            self._sites = Sites()
        if self._mode != "traced":
            self._lazy = LazyRecording(self._lazy.plan)  # pending values nobody read are dropped with the tape
        ended = self._ended_by_exit
        ended[self._generation] = self._exiting
        if len(ended) > 64:
            del ended[next(iter(ended))]
        self._generation += 1

    def _keep_outline(self) -> None:
        """Make this recording the outline the next one replays (kept as it is when this one matched it whole)."""
        t, ol, lz = self._tape, self._outline, self._lazy
        n = len(t)
        if n and self._events:
            if ol is None or not (ol.matched == n == len(ol.keys)):
                ol = self._outline = Outline(self._events, [node_key(nd) for nd in t.nodes])
            else:
                ol.events = self._events
                plan = ol.plan
                if plan is not None and not plan.same_params(self._params_by_leaf, self._storage_by_leaf):
                    # a step with no backward of its own (an evaluation) had other Param leaves than the plan
                    # a lane's backward would reuse: the next whole replay works its plan out again
                    ol.plan = ol.struct = None
            ol.registered = registered_outside(self._events, self._params_by_leaf)
            if len(lz.keys) == n:
                ol.interned, ol.epoch = lz.keys, lz.epoch
        self._events = {}

    # -- random tensors (the session's RandomStream) ---------------------------
    @property
    def rng_counter(self) -> int:
        """Number of random tensors drawn so far (kept across resets).

        >>> import tapeflow as tfl
        >>> s = tfl.Session()
        >>> _ = s.normal(2); s.rng_counter
        1
        """
        return self._rng.counter

    @property
    def seed(self) -> int:
        """Seed of the session's random tensors (see :meth:`set_rng_state`).

        >>> import tapeflow as tfl
        >>> tfl.Session(seed=3).seed
        3
        """
        return self._rng.seed

    def set_rng_state(self, seed: int | None = None, counter: int | None = None) -> None:
        """Set the RNG seed and/or counter, e.g. to continue a restored run.

        >>> import tapeflow as tfl
        >>> s = tfl.Session(seed=1)
        >>> a = s.normal((2,)).value
        >>> s.set_rng_state(seed=1, counter=0)
        >>> bool((s.normal((2,)).value == a).all())
        True
        """
        self.check_thread()
        self._rng.set_state(seed, counter)

    def _random(self, method: str, kind: RandomKind, shape: int | tuple[int, ...], dtype: DTypeLike | None) -> Tensor:
        # every check before the draw: a rejected call advances no counter and records nothing
        self.check_thread()
        return self._commit_leaf(self._rng.draw(method, kind, shape, dtype), False)

    def rand_uniform(
        self, shape: int | tuple[int, ...], dtype: DTypeLike = jnp.float32, low: float = 0.0, high: float = 1.0
    ) -> Tensor:
        """Uniform ``[low, high)`` samples (a constant leaf); advances the RNG counter once.

        >>> import tapeflow as tfl
        >>> u = tfl.Session(seed=0).rand_uniform((3,), low=2.0, high=3.0)
        >>> u.shape, bool(((u.value >= 2.0) & (u.value < 3.0)).all())
        ((3,), True)
        """
        return self._random("rand_uniform", ("uniform", float(low), float(high)), shape, dtype)

    def normal(self, shape: int | tuple[int, ...], dtype: DTypeLike = jnp.float32) -> Tensor:
        """Standard normal samples (a constant leaf); advances the RNG counter once.

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> tfl.Session(seed=0).normal((2, 3), jnp.bfloat16).dtype
        dtype(bfloat16)
        """
        return self._random("normal", ("normal",), shape, dtype)

    def bernoulli_mask(self, shape: int | tuple[int, ...], keep_prob: float) -> Tensor:
        """Boolean mask, True with probability ``keep_prob``; advances the RNG counter once.

        >>> import tapeflow as tfl
        >>> tfl.Session(seed=0).bernoulli_mask(4, 1.0).value.tolist()
        [True, True, True, True]
        """
        if not 0.0 <= float(keep_prob) <= 1.0:
            raise TapeError(f"bernoulli_mask: keep_prob must be in [0, 1], got {keep_prob}")
        return self._random("bernoulli_mask", ("bernoulli", float(keep_prob)), shape, None)

    def random_key(self) -> PRNGKey:
        """A fresh ``jax.random`` key derived from (seed, counter); advances the counter once.

        >>> import tapeflow as tfl
        >>> s = tfl.Session(seed=0)
        >>> bool((s.random_key() != s.random_key()).any()), s.rng_counter
        (True, 2)
        """
        self.check_thread()
        return self._rng.next_key("random_key")

    # -- state cells (the session's StateLog) ----------------------------------
    @property
    def state_writes(self) -> Mapping[Storage, Array]:
        """The state cells this recording assigned, ``storage -> new value``, in first-write order (a copy).

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> n = tfl.Param(jnp.zeros(()), trainable=False)
        >>> with tfl.Session() as s:
        ...     s.assign_state(n, 2.0)
        ...     [float(v) for v in s.state_writes.values()]
        [2.0]
        """
        return dict(self._state_log.new)

    def assign_state(self, param: Param, value: Tensor | ArrayLike) -> None:
        """Set the state cell ``param`` (a non-trainable Param, e.g. a running mean) to ``value``.

        ``value`` (a Tensor of this session, or an array) must have the cell's
        shape; it is cast to the cell's dtype and is not part of any gradient.
        An eager (or lazy) session writes the storage now (later uses see the new
        value); if an :meth:`Optimizer.step <tapeflow.Optimizer.step>` over this
        recording's gradients fails, the old value is put back. A traced
        session (inside :func:`~tapeflow.value_and_grad` / :func:`~tapeflow.train_step`)
        only records it: later uses in the same recording see it, and
        ``train_step`` installs it with the parameters when the step succeeds.

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> mean = tfl.Param(jnp.zeros(2), name="running_mean", trainable=False)
        >>> with tfl.Session() as s:
        ...     s.assign_state(mean, s.use(mean) * 0.9 + jnp.array([1.0, 2.0]) * 0.1)
        >>> [round(v, 2) for v in mean.value.tolist()]
        [0.1, 0.2]
        """
        self.check_thread()
        cell = check_state_cell(param)
        v = self.node(value).value if isinstance(value, Tensor) else value
        traced = self._mode == "traced"
        new = self._state_log.assign(cell, v, eager=not traced)
        if traced:
            src = self._param_source
            assert src is not None  # a traced session always records the step's values
            src.write(cell.storage, new)  # later uses in this recording read the new value

    # -- gradient controls (the session's GradControls) ------------------------
    def register_hook(self, h: Tensor, fn: Hook) -> RemovableHandle:
        """Call ``fn(cotangent)`` when a backward reaches ``h``; see :meth:`Tensor.register_hook`.

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> with tfl.Session() as s:
        ...     x = s.input(jnp.ones(2), requires_grad=True)
        ...     _ = s.register_hook(x, lambda g: g * 3.0)
        ...     s.backward(tfl.sum(x))[x].tolist()
        [3.0, 3.0]
        """
        check_handle(h, self)
        return self._grad.register(h.id, fn)

    def _hook_call(self, i: NodeId, fn: Hook, graph: bool) -> Hook | GraphHook:
        """``fn`` as the sweep calls it: arrays in, checked arrays out; or, recording, ``(tape, id)`` in and out."""
        nd = self._tape[i]
        if not graph:
            return lambda g: run_hooks([fn], g, f"node #{i} ({nd.op or 'leaf'})")

        def call(t: Tape, gid: NodeId) -> tuple[Tape, NodeId]:
            self._commit(t)  # the hook records on the tape the sweep has built so far
            r = run_hooks([fn], self._handle(gid), f"node #{i} ({nd.op or 'leaf'})")
            if isinstance(r, Tensor):
                check_handle(r, self)
                return self._tape, r.id
            return self._tape, gid

        return call

    @contextlib.contextmanager
    def no_grad(self) -> Iterator[Self]:
        """Record without gradient tracking inside the block (ops and leaves get ``requires_grad=False``).

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> with tfl.Session() as s:
        ...     w = s.input(jnp.ones(2), requires_grad=True)
        ...     with s.no_grad():
        ...         frozen = w * 2.0
        ...     frozen.requires_grad, (w * 2.0).requires_grad
        (False, True)
        """
        self.check_thread()
        with self._grad.paused():
            yield self

    @contextlib.contextmanager
    def _recording_eagerly(self) -> Iterator[None]:
        """Run every op recorded inside the block at once, even in a lazy session (a recorded backward reads values)."""
        self._eagerly += 1
        try:
            yield
        finally:
            self._eagerly -= 1

    def jvp(self, output: Tensor, tangents: Mapping[Tensor | Param, ArrayLike]) -> Array:
        """The tangent of ``output`` given tangents of live handles and of Params (a Param's reaches all its uses).

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> s, w = tfl.Session(), tfl.Param(jnp.array([1.0, 2.0]))
        >>> x = s.input(jnp.array([3.0, 4.0]))
        >>> float(s.jvp(tfl.sum(x * w), {x: jnp.ones(2), w: jnp.array([1.0, 0.0])}))
        6.0
        """
        for k in (output, *tangents):
            if isinstance(k, Tensor):
                check_handle(k, self)
            elif not (isinstance(k, Param) and isinstance(output, Tensor)):  # output: a Tensor, keys: also Params
                raise TypeError(f"Session.jvp takes a Tensor output and Tensor or Param keys, got {type(k).__name__}")
        self.materialize()  # the tangent sweep reads the forward values
        return jvp_keys(self._tape, output.id, tangents, self._storage_by_leaf)

    # -- views -----------------------------------------------------------------
    def leaf_names(self) -> dict[NodeId, str]:
        """The Param leaves of this recording by node id: the name of the Param each leaf is a use of.

        A Param without a name is shown as ``param``. The labels
        :meth:`to_dot`, the HTML table and the treescope picture draw.

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> W = tfl.Param(jnp.ones((3, 2)), name="W")
        >>> W_dec = tfl.tie(W, name="W_dec")
        >>> s = tfl.Session()
        >>> h = s.input(jnp.ones((1, 3))) @ W
        >>> y = h @ W_dec.T
        >>> s.leaf_names()
        {1: 'W', 3: 'W_dec'}
        """
        self.check_thread()
        if self._lane is not None:
            self._flush()  # a lane registers its Param leaves as it builds their nodes
        return _render.leaf_names(self._params_by_leaf)

    def leaf_storages(self) -> dict[NodeId, str]:
        """The storage each Param leaf reads, by node id: ``"<name> storage"``, named after its first use.

        Leaves of one storage (a :func:`tfl.tie <tapeflow.tie>`, or one Param
        used twice) get the same label, so a label read by two leaves marks a
        tied use; two storages whose first uses share a name are told apart by
        a number (``"w storage (2)"``).

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> W = tfl.Param(jnp.ones((3, 2)), name="W")
        >>> s = tfl.Session()
        >>> h = s.input(jnp.ones((1, 3))) @ W
        >>> y = h @ tfl.tie(W, name="W_dec").T
        >>> s.leaf_storages()
        {1: 'W storage', 3: 'W storage'}
        """
        names = self.leaf_names()
        return _render.storage_labels(names, group_parameter_leaves(self._params_by_leaf, self._storage_by_leaf))

    def to_dot(self) -> str:
        """Graphviz DOT text of this recording, with Param leaves named and the storages they read drawn.

        :meth:`Tape.to_dot <tapeflow.Tape.to_dot>` with ``labels=``:meth:`leaf_names`
        and ``storages=``:meth:`leaf_storages`: a tied storage has a dashed edge
        to each of its leaves, "cotangents summed". Nothing is computed: a lazy
        session draws its recording.

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> W = tfl.Param(jnp.ones((3, 2)), name="W")
        >>> s = tfl.Session()
        >>> h = s.input(jnp.ones((1, 3))) @ W
        >>> y = h @ tfl.tie(W, name="W_dec").T
        >>> [ln.strip() for ln in s.to_dot().splitlines() if "W storage" in ln][0]
        's0 [label="W storage", shape=cylinder, style=filled, fillcolor="#fde7d9"];'
        """
        return _render.session_dot(self)


def traced_session(
    overrides: Mapping[Storage, Array],
    key: PRNGKey | None,
    compute_dtype: DTypeLike | None = None,
    debug_nans: bool = False,
) -> Session:
    """The session :func:`~tapeflow.value_and_grad` and :func:`~tapeflow.train_step` trace (mode ``"traced"``).

    A use of a storage in ``overrides`` records its value there (the step's
    parameter tracers); any other use reads the storage and is listed in
    :attr:`Session.unlisted_storages`; a state write only records the new value.
    Random tensors derive from ``key`` (None: seed 0). On JAX's default device.
    ``debug_nans`` notes each op's line (the search after a non-finite step).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> w = tfl.Param(jnp.ones(2))
    >>> s = traced_session({w.storage: jnp.full(2, 4.0)}, None)
    >>> s.mode, (s.use(w) * 1.0).value.tolist()
    ('traced', [4.0, 4.0])
    """
    s = Session.__new__(Session)
    s._setup(
        default_device(),
        0,
        grad_enabled=True,
        show_backend=False,
        check_same_thread=True,
        compute_dtype=compute_dtype,
        mode="traced",
        key=key,
        params=ParamSource(dict(overrides)),
        debug_nans=debug_nans,
    )
    return s


def block_session(
    device: jax.Device | None,
    params: ParamSource,
    key: PRNGKey | None,
    grad_enabled: bool,
    compute_dtype: DTypeLike | None = None,
) -> Session:
    """An eager session whose Param uses read ``params`` first: the private session a checkpointed block runs on.

    Usable from any thread (a block's kernels may run anywhere); random
    tensors derive from ``key`` (None: seed 0); on ``device`` (None: JAX's default).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> w = tfl.Param(jnp.ones(2))
    >>> source = ParamSource({w.storage: jnp.zeros(2)})
    >>> s = block_session(None, source, None, grad_enabled=True)
    >>> s.mode, s.use(w).value.tolist()
    ('eager', [0.0, 0.0])
    """
    s = Session.__new__(Session)
    s._setup(
        device if device is not None else default_device(),
        0,
        grad_enabled=grad_enabled,
        show_backend=False,
        check_same_thread=False,
        compute_dtype=compute_dtype,
        mode="eager",
        key=key,
        params=params,
    )
    return s
