"""The Session shell: the only mutable layer of tapeflow.

A :class:`Session` is a facade over its parts, one job each: its
:class:`~tapeflow._shell._recorder.Recorder` turns calls into nodes (the tape,
the Param leaves, the replay of the last recording), its
:class:`~tapeflow._shell._leaves.Leaves` place values and append them as
leaves, its :class:`~tapeflow._shell._planner.BackwardPlanner` checks and runs
backwards, its ``RandomStream``, ``StateLog`` and ``GradControls`` hold the
random stream, the state writes, the hooks and ``no_grad`` blocks. The session itself is the identity every handle is
checked against: the owner id, the generation counter that makes old
:class:`~tapeflow.Tensor` handles stale after :meth:`Session.reset`, the thread,
the mode and the device. Handles and operators live in ``_tensor.py``,
gradients and the tied-weight sum in ``_grads.py``.

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

import contextvars
import itertools
import threading
import weakref
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Literal, Self

import jax
import jax.numpy as jnp

from .._core._backward import Hook
from .._core._device import default_device, resolve_device
from .._core._nonfinite import Origin
from .._core._precision import Precision
from .._core._result import TapeError
from .._core._tape import Node, Tape
from .._core._treescope import Rendering, SubtreeRenderer
from .._core._typing import Array, ArrayLike, DeviceLike, DTypeLike, NodeId, PRNGKey
from . import _render
from ._debug import debug_nans_default
from ._gradctl import GradControls, NoGrad, tangent
from ._grads import Grads, ParameterGroup, ParameterRecord
from ._lazy import LazyRecording, lazy_default
from ._leaves import Leaves
from ._params import Param, Storage
from ._planner import BackwardPlanner, TapeGrowthWarning
from ._random import RNG_SEED_RANGE, RandomKind, RandomStream, rng_int
from ._recorder import Recorder
from ._replay import Outline
from ._state import StateLog, check_state_cell
from ._tensor import Operand, RemovableHandle, Tensor, check_handle, pop_current, push_current
from ._values import ParamSource, RationalFallbackWarning, ValuePolicy

__all__ = ["Mode", "RationalFallbackWarning", "Session", "TapeGrowthWarning", "block_session", "traced_session"]

Mode = Literal["eager", "lazy", "traced"]
"""How a session records: ``"eager"`` runs each op at once; ``"lazy"`` records now and computes when a value
is read (``Session(lazy=True)``); ``"traced"`` is the session :func:`~tapeflow.value_and_grad` and
:func:`~tapeflow.train_step` trace, whose Param uses record the step's parameter values and whose state
writes are only recorded; it records lazily too (op by op under ``debug_nans``), and its forward and
backward are traced from the recording into the caller's program."""

_owner_counter = itertools.count(1)
_owner_lock = threading.Lock()


def _next_owner() -> int:
    with _owner_lock:
        return next(_owner_counter)


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
        False runs each op at once (op by op: step through it in a debugger).
        None (default): the environment variable ``TAPEFLOW_LAZY`` (``0``:
        False), else True.
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
        lazy: bool | None = None,
        debug_nans: bool | None = None,
    ) -> None:
        self._setup(
            resolve_device(device) if device is not None else default_device(),
            rng_int("seed", seed, RNG_SEED_RANGE, "Session"),
            grad_enabled=grad_enabled,
            show_backend=show_backend,
            check_same_thread=check_same_thread,
            compute_dtype=compute_dtype,
            mode="lazy" if lazy_default(lazy) else "eager",
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
        # the identity every handle and call is checked against
        self._thread: int | None = threading.get_ident() if check_same_thread else None
        self.device: jax.Device = device
        self._mode: Mode = mode
        self._owner = _next_owner()
        self._ref = weakref.ref(self)
        self._generation = 0
        self._tokens: list[contextvars.Token[Session | None]] = []
        # what ended each recent generation (True: the exit of a ``with s:`` block, False: a reset() call), so a
        # stale handle's error names the reset the user made; bounded, oldest forgotten first
        self._ended_by_exit: dict[int, bool] = {}
        self._exiting = False
        # the parts: how values enter, where Param uses read, the random stream, state writes, grad controls, the
        # recording (how a call becomes nodes) and the backward planner
        self._values = ValuePolicy(self.device, self._owner)
        self._param_source = params  # None: every use records its storage's value
        self._rng = RandomStream(seed, key)
        self._state_log = StateLog()  # assign_state's writes in this recording
        self._grad = GradControls()
        precision = None if compute_dtype is None else Precision(compute_dtype)  # the mixed precision policy
        self._recorder = Recorder(
            owner=self._owner, ref=self._ref, device=device, mode=mode, values=self._values, source=params,
            grad=self._grad, precision=precision, debug_nans=debug_nans, grad_enabled=bool(grad_enabled),
            show_backend=bool(show_backend),
        )  # fmt: skip
        self._planner = BackwardPlanner(self._recorder, self._grad)
        self._leaves = Leaves(self._recorder, self._values, host=mode == "lazy")

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
        >>> tfl.Session().lazy, tfl.Session(lazy=False).lazy
        (True, False)
        """
        return self._mode == "lazy"

    @property
    def mode(self) -> Mode:
        """How this session records: ``"eager"``, ``"lazy"`` or ``"traced"`` (see :data:`Mode`).

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> tfl.Session(lazy=False).mode, tfl.Session().mode
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
        return self._recorder.tape

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
        return self._recorder.tape

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
        if self._mode != "eager":  # a traced session records lazily too (see Conditions.defers)
            self.check_thread()
            self._recorder.materialize()

    # -- settings (each change describes the recorder's conditions again) ------
    @property
    def precision(self) -> Precision | None:
        """The mixed-precision policy (``Session(compute_dtype=...)``), or None: every op in its operands' dtypes.

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> bf16 = tfl.Session(compute_dtype=jnp.bfloat16)
        >>> tfl.Session().precision is None, bf16.precision is not None
        (True, True)
        """
        return self._recorder.precision

    @precision.setter
    def precision(self, policy: Precision | None) -> None:
        self._recorder.precision = policy
        self._recorder.retune()

    @property
    def debug_nans(self) -> bool:
        """Whether every backward's loss and gradients are checked for NaN and infinity (``Session(debug_nans=...)``).

        >>> import tapeflow as tfl
        >>> tfl.Session(debug_nans=True).debug_nans
        True
        """
        return self._recorder.debug_nans

    @debug_nans.setter
    def debug_nans(self, on: bool) -> None:
        self._recorder.debug_nans = on
        self._recorder.retune()

    @property
    def grad_enabled(self) -> bool:
        """Whether this session records gradients (False: an inference session, ``Session(grad_enabled=False)``).

        >>> import tapeflow as tfl
        >>> tfl.Session().grad_enabled, tfl.Session(grad_enabled=False).grad_enabled
        (True, False)
        """
        return self._recorder.grad_enabled

    @grad_enabled.setter
    def grad_enabled(self, on: bool) -> None:
        self._recorder.grad_enabled = on
        self._recorder.retune()

    @property
    def show_backend(self) -> bool:
        """Whether the kernel/platform that runs each op is printed the first time it is used.

        >>> import tapeflow as tfl
        >>> tfl.Session().show_backend
        False
        """
        return self._recorder.show_backend

    @show_backend.setter
    def show_backend(self, on: bool) -> None:
        self._recorder.show_backend = on

    @property
    def selected_backends(self) -> list[tuple[str, str]]:
        """``(op, kernel)`` of each op the first time this session recorded it (kept across resets).

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> s = tfl.Session()
        >>> _ = s.input(jnp.ones(2)) * 2.0
        >>> s.selected_backends[0][0], s.selected_backends[0][1].startswith("xla:")
        ('mul', True)
        """
        return self._recorder.backends

    def __repr__(self) -> str:
        kind = "" if self.grad_enabled else ", inference"
        return (
            f"Session(owner={self._owner}, generation={self._generation}, nodes={len(self._recorder.tape)}, "
            f"device={self.device}, rng_counter={self._rng.counter}{kind})"
        )

    def __treescope_repr__(self, path: str | None, subtree_renderer: SubtreeRenderer) -> Rendering:
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
    def handle(self, node_id: NodeId) -> Tensor:
        """A handle of node ``node_id`` of the current recording (e.g. a parent of a node you hold).

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> s = tfl.Session()
        >>> y = s.input(jnp.ones(2)) * 3.0
        >>> [s.handle(i).op for i in y.node.parents]
        [None, None]
        """
        self.check_thread()
        n = len(self._recorder.tape)
        if type(node_id) is not int or not 0 <= node_id < n:
            raise TapeError(f"Session.handle: no node {node_id!r} in this recording of {n} node(s)")
        return self._leaves.handle(self, node_id)

    def check(self, h: Tensor) -> None:
        """Raise if ``h`` is not a live handle of this session."""
        check_handle(h, self)

    def node(self, h: Tensor) -> Node:
        """The recorded node behind the live handle ``h`` (raises for a stale or foreign one), with its value."""
        check_handle(h, self)
        return self._recorder.node(h.id)

    def value(self, h: Tensor) -> Array:
        """The value of the live handle ``h`` (``node(h).value``); a lane's value that a program computed already
        (the loss of a fused step) is read without building the recording's nodes.

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> s = tfl.Session()
        >>> s.value(s.input(jnp.ones(2)) * 2.0).tolist()
        [2.0, 2.0]
        """
        check_handle(h, self)
        return self._recorder.value(h.id)

    # -- leaves (the session's Leaves) ------------------------------------------
    def input(self, x: ArrayLike | Tensor, requires_grad: bool = False) -> Tensor:
        """Record ``x`` (array-like; integer and boolean too) as a leaf; gradient only if asked."""
        return self._leaves.input(self, x, requires_grad)

    def const(self, x: ArrayLike) -> Tensor:
        """Record a constant leaf (never requires grad)."""
        return self.input(x, requires_grad=False)

    def detach(self, h: Tensor) -> Tensor:
        """A new leaf holding ``h``'s value, cut off from the recording's gradients."""
        return self._leaves.value(self, self.node(h).value, False)

    def use(self, p: Param) -> Tensor:
        """Record one use of ``p``: a new leaf holding its current value."""
        return self._leaves.use(self, p)

    def register_parameter_leaf(self, h: Tensor, parameter: ParameterRecord, storage: Storage | None = None) -> None:
        """Mark an existing leaf as a parameter registration (advanced).

        ``storage`` is its identity descriptor; without one the registration is
        grouped alone. A descriptor whose shape or dtype disagrees with the leaf
        is rejected and nothing changes.
        """
        self._leaves.mark(self, h, parameter, storage)

    # -- ops (the session's Recorder) ------------------------------------------
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
        return self._recorder.index_guard(value)

    def apply(self, opname: str, *operands: Operand, **attrs: object) -> Tensor:
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

        The call's thread and handles are checked here; then the recorder's
        path for the session's state records it (a lane, the outline's replay
        or the normal path: see :mod:`tapeflow._shell._recorder`).

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
        rec = self._recorder
        return rec.path(rec, self, opname, operands, attrs)

    # -- backward (the session's BackwardPlanner) ------------------------------
    def parameter_groups(self) -> list[ParameterGroup]:
        """Trainable parameter leaves of this recording grouped by storage identity."""
        self.check_thread()
        return self._recorder.parameter_groups()

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
        planner = self._planner
        planner.check(self, loss, seed, wrt)
        return planner.backward(self, loss.id, seed, tuple(h.id for h in wrt), create_graph, self._state_log)

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
        return self._planner.origin(loss.id, seed)

    # -- reset -----------------------------------------------------------------
    def reset(self) -> None:
        """Drop the recording and invalidate its handles.

        Keeps the owner id, the RNG counter, the backend audit and any optimizer
        state. The session lets go of every value it recorded; JAX frees each
        buffer as soon as nothing else refers to it, so a value the user still
        holds (``h.value``, a ``Tape`` kept or forked, another session's leaf)
        stays valid, and nothing else outlives the reset but the constants the
        session reuses: Python numbers' values, and the last value each NumPy
        operand of its outline's calls made (see ``Recorder.host_leaf``).
        """
        self.check_thread()
        self._recorder.restart(self._generation + 1)
        self._grad.clear()
        self._state_log = StateLog()
        ended = self._ended_by_exit
        ended[self._generation] = self._exiting
        if len(ended) > 64:
            del ended[next(iter(ended))]
        self._generation += 1

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
        return self._leaves.value(self, self._rng.draw(method, kind, shape, dtype), False)

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
        cell = check_state_cell(param)  # before a lazy value is computed for it
        v = self.node(value).value if isinstance(value, Tensor) else value
        self._state_log.assign_cell(cell, v, self._param_source if self._mode == "traced" else None)

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

    def no_grad(self) -> AbstractContextManager[Self]:
        """Record without gradient tracking inside the block (ops and leaves get ``requires_grad=False``).

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> with tfl.Session() as s:
        ...     w = s.input(jnp.ones(2), requires_grad=True)
        ...     with s.no_grad():
        ...         frozen = w * 2.0
        ...     frozen.requires_grad, (w * 2.0).requires_grad
        (False, True)
        """
        return NoGrad(self, self._grad, self.check_thread, self._recorder.retune)

    def jvp(self, output: Tensor, tangents: Mapping[Tensor | Param, ArrayLike]) -> Array:
        """The tangent of ``output`` given tangents of live handles and of Params (a Param's reaches all its uses).

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> s, w = tfl.Session(), tfl.Param(jnp.array([1.0, 2.0]))
        >>> x = s.input(jnp.array([3.0, 4.0]))
        >>> float(s.jvp(tfl.sum(x * w), {x: jnp.ones(2), w: jnp.array([1.0, 0.0])}))
        6.0
        """
        return tangent(self, output, tangents, self._recorder.storage_by_leaf)

    # -- pictures (the bodies live in _render.py) ------------------------------
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
        return _render.leaf_names(self._recorder.param_leaves())

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
        return _render.storage_labels(names, self._recorder.storage_groups())

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

    # -- the recording's parts, read by tests and when debugging ---------------
    @property
    def _tape(self) -> Tape:
        return self._recorder.tape

    @property
    def _lazy(self) -> LazyRecording:
        return self._recorder.lazy

    @property
    def _outline(self) -> Outline | None:
        return self._recorder.outline

    @property
    def _params_by_leaf(self) -> dict[NodeId, ParameterRecord]:
        return self._recorder.params_by_leaf


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
