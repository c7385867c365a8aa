"""How a call becomes nodes: a session's recording, and the three paths a call can take onto it.

A :class:`Recorder` is the part of a :class:`~tapeflow.Session` that owns the
recording: the tape value, the Param leaves and the storages they read, the
lazy structure key, the outline of the last recording and the lane replaying
it, the ``debug_nans`` sites, and the backend audit. Every ``apply`` reaches it
as one call of :attr:`Recorder.path`, a :data:`Path` chosen ahead of the call
from one description of the session's state (:class:`Conditions`, made again
only when a setting changes: ``precision``, ``debug_nans``, ``grad_enabled``, a
``no_grad`` block, a block that records eagerly, a reset):

* :func:`lane_path`: a lazy session replaying its outline with no nodes built
  (``tapeflow._shell._replay.Lane``): the call's leaf values are kept, nothing
  else happens;
* :func:`replay_path`: the outline's call at the same position again: the
  event's nodes are appended with this call's values, the op check skipped;
* :func:`normal_path`: every check, the leaves and the op on a local tape
  value, installed only when everything passed, and the call noted as an event
  for the next recording's outline.

A fast path that does not match hands the call on (the lane builds its nodes
first), so the normal path is always the answer of last resort.

>>> import jax.numpy as jnp, tapeflow as tfl
>>> s = tfl.Session(lazy=True)
>>> for step in range(3):
...     with s:
...         y = tfl.sum(s.input(jnp.ones(3)) * 2.0)
...         print(float(y), end=" ")
6.0 6.0 6.0
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeAlias, cast

import jax
import jax.numpy as jnp
import numpy as np

from .._core import _registry as R
from .._core._device import concrete_array_type, device_of
from .._core._precision import Precision, cast_operands
from .._core._registry import attr_key
from .._core._result import Err, TapeError
from .._core._tape import PENDING, Node, Tape, append_node, append_nodes, append_op, check_op, leaf, place
from .._core._typing import Array, NodeId
from ._debug import Sites
from ._gradctl import GradControls
from ._grads import ParameterGroup, ParameterRecord, group_parameter_leaves
from ._lazy import LazyRecording, materialize
from ._params import Param, Storage
from ._replay import Event, Lane, Outline, node_key, registered_outside
from ._tensor import Operand, Tensor, note_recorded
from ._values import ParamSource, ValuePolicy, read_host_inputs

if TYPE_CHECKING:
    from ._session import Mode, Session

__all__ = [
    "Conditions",
    "Path",
    "Recorder",
    "check_host_indices",
    "lane_path",
    "normal_path",
    "replay_path",
]

_BOOL = np.dtype(bool)
_HOST_MEMO_SIZE = 1 << 16  # elements: a replayed NumPy operand at most this large is compared with its last one

Path: TypeAlias = Callable[["Recorder", "Session", str, tuple[Operand, ...], dict[str, object]], Tensor]
"""How a call is recorded: ``path(recorder, session, opname, operands, attrs)`` appends its nodes and returns the
handle of the op's node (the session checked the thread and the handles first)."""


def check_host_indices(
    d: R.OpDef, specs: tuple[R.Spec, ...], attrs: dict[str, object], host: dict[int, object]
) -> None:
    """Raise :class:`TapeError` if a position operand of ``d`` given as host data is out of its axis's range.

    Only host data is looked at (NumPy arrays, lists, other frameworks' CPU
    arrays): a device array's values would cost a wait for the device.

    >>> import numpy as np, tapeflow as tfl
    >>> d = tfl.REGISTRY["take"]
    >>> specs = (((4, 2), np.dtype("float32")), ((1,), np.dtype("int32")))
    >>> check_host_indices(d, specs, {"axis": 0}, {1: np.array([7])})
    Traceback (most recent call last):
    tapeflow._core._result.TapeError: take: operand #1 (indices) holds 7, out of range (valid: -4 to 3); ...
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


def _checks_device_indices(opname: str) -> bool:
    """Whether ``debug_nans`` reads op ``opname``'s device positions (ops that clamp an out-of-range one)."""
    d = R.REGISTRY.get(opname)
    return d is not None and d.index_bounds is not None and d.index_clamps


class Conditions:
    """The one description of a session's state that decides how its calls are recorded.

    Made from the settings (:meth:`Recorder.retune`) whenever one changes, and
    read by every call instead of the settings themselves, so each condition is
    stated once, here:

    * ``tracked``: gradients are recorded (``grad_enabled`` and no ``no_grad`` block); ``grad_on``: no
      ``no_grad`` block;
    * ``defers``: the recording may hold ops not run yet (a lazy session; a traced one, unless ``debug_nans``
      notes each op's index check as it records); ``lazy``: ops are recorded without running (``defers``,
      outside a block that records eagerly);
    * ``direct``: every Param use reads its storage (no ``ParamSource``);
    * ``replay``: the outline's call may be replayed (recorded directly, no mixed precision, not eagerly);
      ``checks_indices``: ``debug_nans`` is on, so an op whose index check reads device values is not;
    * ``lane``: a lane may go on without nodes (``replay``, and no ``debug_nans``);
    * ``notes``: calls are noted as events for the next recording's outline (a lazy op or an eager one,
      recorded directly, without mixed precision, from a session's second recording on: a session used
      once pays nothing for replay).

    >>> c = Conditions("lazy", generation=1, precision=None, direct=True, debug_nans=False, grad_enabled=True)
    >>> c.lane, c.replay, c.notes, c.tracked
    (True, True, True, True)
    >>> c = Conditions("eager", generation=1, precision=None, direct=True, debug_nans=True, grad_enabled=True)
    >>> c.lane, c.replay, c.checks_indices
    (False, True, True)
    """

    __slots__ = ("checks_indices", "defers", "direct", "grad_on", "lane", "lazy", "notes", "replay", "tracked")

    def __init__(
        self,
        mode: Mode,
        generation: int,
        precision: Precision | None,
        direct: bool,
        debug_nans: bool,
        grad_enabled: bool,
        grad_depth: int = 0,
        eagerly: int = 0,
    ) -> None:
        self.grad_on = not grad_depth
        self.tracked = grad_enabled and not grad_depth
        self.defers = mode == "lazy" or (mode == "traced" and not debug_nans)
        self.lazy = self.defers and not eagerly
        self.direct = direct
        self.replay = not eagerly and precision is None and direct
        self.checks_indices = debug_nans
        self.lane = self.replay and not debug_nans
        self.notes = bool((self.lazy or mode == "eager") and direct and generation and precision is None)


class Recorder:
    """A session's recording and how calls are recorded on it (see the module docstring).

    The session makes one per session and keeps it across resets
    (:meth:`restart` starts the next recording). The settings the calls depend
    on (``precision``, ``debug_nans``, ``grad_enabled``) are its attributes; the
    session writes them and then calls :meth:`retune`.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> s = tfl.Session()
    >>> y = s.input(jnp.ones(2)) * 3.0
    >>> [nd.op for nd in s.recording.nodes]
    [None, None, 'mul']
    """

    __slots__ = (
        "backends", "conditions", "debug_nans", "device", "eagerly_depth", "events", "generation", "grad",
        "grad_enabled", "index_flags", "lane", "lazy", "mode", "now", "outline", "owner", "params_by_leaf", "path",
        "precision", "ref", "seen", "show_backend", "sites", "source", "storage_by_leaf", "values",
    )  # fmt: skip

    def __init__(
        self,
        *,
        owner: int,
        ref: weakref.ref[Session],
        device: jax.Device,
        mode: Mode,
        values: ValuePolicy,
        source: ParamSource | None,
        grad: GradControls,
        precision: Precision | None,
        debug_nans: bool,
        grad_enabled: bool,
        show_backend: bool,
    ) -> None:
        # what the session is: fixed for its life (the generation changes at each restart)
        self.owner, self.ref, self.device, self.mode, self.generation = owner, ref, device, mode, 0
        self.values = values  # how a value enters the session
        self.source = source  # None: every Param use records its storage's value
        self.grad = grad  # the session's grad controls (their no_grad depth is a condition)
        # the settings calls depend on (written by the session, then retune())
        self.precision, self.debug_nans, self.grad_enabled = precision, debug_nans, grad_enabled
        self.eagerly_depth = 0  # open eagerly() blocks: a lazy session runs its ops at once inside them
        # the recording
        self.now = Tape.empty(device)  # the tape value as installed (a lane's nodes not built: see ``tape``)
        self.lane: Lane | None = None  # a replay that has built no nodes yet
        self.params_by_leaf: dict[NodeId, ParameterRecord] = {}
        self.storage_by_leaf: dict[NodeId, Storage] = {}
        self.lazy = (
            LazyRecording()
        )  # the structure of the recording (a lazy one's programs, an eager compiled backward)
        self.outline: Outline | None = None  # the last recording (lazy, or eager), replayed while it matches
        self.events: dict[NodeId, Event] = {}  # the apply calls of this recording (the next outline)
        self.sites: Sites | None = Sites() if debug_nans else None  # debug_nans: where each node was recorded
        self.index_flags: list[Array] = []  # debug_nans, traced: "every index of this op is in range", per op
        # the backend audit: each op's kernel the first time it is recorded (kept across resets)
        self.backends: list[tuple[str, str]] = []
        self.seen: set[str] = set()
        self.show_backend = show_backend
        self.conditions: Conditions
        self.path: Path
        self.retune()

    # -- the one description and the path it chooses ---------------------------------------------------------
    def retune(self) -> None:
        """Describe the session's state again (a setting changed) and choose the path of the next call."""
        self.conditions = Conditions(
            self.mode,
            self.generation,
            self.precision,
            self.source is None,
            self.debug_nans,
            self.grad_enabled,
            self.grad.depth,
            self.eagerly_depth,
        )
        self.choose()

    def choose(self) -> None:
        """The path of the next call, from the conditions and what the recording holds (a lane, an outline)."""
        c = self.conditions
        if self.lane is not None and c.lane:
            self.path = lane_path
        elif self.outline is not None and c.replay:
            self.path = replay_path
        else:
            self.path = normal_path

    @contextlib.contextmanager
    def eagerly(self) -> Iterator[None]:
        """Run every op recorded inside the block at once, even in a lazy session (a recorded backward reads values)."""
        self.eagerly_depth += 1
        self.retune()
        try:
            yield
        finally:
            self.eagerly_depth -= 1
            self.retune()

    # -- the tape ---------------------------------------------------------------------------------------------
    @property
    def tape(self) -> Tape:
        """The current tape value. A lane's nodes are built now (the first read of the recording, or a call the
        outline does not hold), and the recording goes on node by node."""
        if self.lane is not None:
            self.flush()
        return self.now

    def flush(self) -> None:
        """Turn the lane (if any) into nodes: the tape, Param leaves and events a node-by-node replay would have
        made."""
        lane = self.lane
        if lane is None:
            return
        t = lane.tape()
        self.lane = None
        pbl, sbl = self.params_by_leaf, self.storage_by_leaf
        for i, p in lane.uses:
            pbl[i] = p
            sbl[i] = p.storage
        events = self.events
        for n, ev in lane.starts:
            events[n] = ev
        ol = lane.outline
        if ol is self.outline:
            ol.matched, ol.tape = len(t), t
        self.now = t
        self.choose()

    def install(self, t: Tape) -> None:
        """Make ``t`` the current tape (the one place it changes between restarts; the caller checked the thread)."""
        if self.conditions.defers:
            lz = self.lazy
            n = len(t)
            if n < len(lz.keys):
                lz.truncate(n)  # a failed backward put an older tape back
            elif n and t[n - 1].dtype is R.OBJECT:
                lz.exact = True  # exact rationals: backward runs eagerly
            ol = self.outline
            if ol is not None:
                ol.follow(t)  # nodes recorded outside the replay fast path still match the outline?
        else:
            if len(t) < self.lazy.checked or len(t) < len(self.lazy.keys):  # an eager session keys its structure
                self.lazy.truncate(len(t))  # for a compiled backward: a failed one put an older tape back
            ol = self.outline
            if ol is not None:
                ol.follow(t)
        if self.sites is not None:
            self.sites.note(len(self.tape), len(t))
        self.now = t
        note_recorded(self.ref)

    def node(self, i: NodeId) -> Node:
        """Node ``i`` of the recording with its value computed (a lazy recording's program, a host input read)."""
        t = self.tape
        nd = t[i]
        v = nd.value
        if v is PENDING:
            materialize(self.lazy, t, self.mode == "traced")  # only a lazy or traced session has pending nodes
        elif type(v) is np.ndarray:
            read_host_inputs(t, (i,))
        return nd

    def value(self, i: NodeId) -> Array:
        """The value of node ``i``; one a lane's program computed already (the loss of a fused step) is read
        without building the recording's nodes."""
        lane = self.lane
        if lane is not None:
            v = lane.filled.get(i)
            if v is not None:
                return v
        return self.node(i).value

    def materialize(self) -> None:
        """Compute every value of a lazy recording that is not computed yet (one compiled program)."""
        t = self.tape
        materialize(self.lazy, t, self.mode == "traced")
        read_host_inputs(t, [i for i, nd in enumerate(t.nodes) if type(nd.value) is np.ndarray])

    # -- leaves -----------------------------------------------------------------------------------------------
    def leaf_grad(self, requires_grad: bool, dt: np.dtype) -> bool:
        """Whether an input leaf of dtype ``dt`` records gradients: asked for, gradients on here, a float."""
        return bool(requires_grad) and self.conditions.tracked and R.is_float(dt)

    def lane_leaf(self, s: Session, v: Array | np.ndarray, dt: np.dtype, requires_grad: bool) -> Tensor | None:
        """An input leaf holding ``v`` (as ``Session.input`` records it) on the lane, if the outline has one here."""
        s.check_thread()
        lane = self.lane
        assert lane is not None  # (asked only while there is one)
        ol, n = lane.outline, lane.pos
        spec = (v.shape, dt)  # a jax.Array's or an ndarray's shape: a tuple of ints
        if (
            n >= len(ol.keys)
            or n in ol.events
            or n in ol.registered  # the outline's leaf here was a Param's (``use``): this input is not
            or ol.keys[n] != (None, (), (), bool(requires_grad) and self.leaf_grad(requires_grad, dt), spec)
        ):
            return None
        lane.vals.append(v)
        lane.pos = n + 1
        note_recorded(self.ref)
        return Tensor(s, self.owner, self.generation, n, spec[0], dt)

    def lane_input(self, s: Session, x: Array, requires_grad: bool) -> Tensor | None:
        """A ``jax.Array`` input on the lane (:meth:`lane_leaf`) when ``x`` lives on the recording's device (the
        leaf holds it as it is); None: the normal input path. A complex array never matches, the outline holding
        no complex leaf."""
        dev = self.now.device
        if dev is not None and device_of(x) is not dev:
            return None
        return self.lane_leaf(s, x, x.dtype, requires_grad)

    def param_value(self, p: Param) -> Array:
        """The value a use of ``p`` records: the session's source's, a view's own, or its storage's here."""
        src = self.source
        if src is not None:
            v = src.read(p)
            if v is not None:
                return v
        if p.bound:  # a view rebuilt by a JAX transformation carries its own value
            return p.value
        st = p.storage
        if st.dtype == R.OBJECT:
            self.values.warn_rational()
        return st.read(self.device)

    def register(self, leaf_id: NodeId, p: ParameterRecord, storage: Storage | None) -> None:
        """Leaf ``leaf_id`` is a use of ``p`` reading ``storage`` (None: grouped alone)."""
        self.params_by_leaf[leaf_id] = p
        if storage is not None:
            self.storage_by_leaf[leaf_id] = storage

    def param_leaves(self) -> dict[NodeId, ParameterRecord]:
        """The Param leaves of the recording by node id (a lane's registered as its nodes are built now)."""
        self.flush()
        return self.params_by_leaf

    def storage_groups(self) -> list[ParameterGroup]:
        """Every Param leaf of the recording grouped by the storage it reads (trainable or not)."""
        return group_parameter_leaves(self.param_leaves(), self.storage_by_leaf)

    def parameter_groups(self) -> list[ParameterGroup]:
        """Trainable parameter leaves of this recording grouped by storage identity."""
        nodes = self.tape.nodes
        trainable = {i: p for i, p in self.params_by_leaf.items() if nodes[i].requires_grad}
        return group_parameter_leaves(trainable, self.storage_by_leaf)

    def host_leaf(self, ev: Event, k: int, o: np.ndarray) -> Array:
        """Operand ``k`` of a replayed call of ``ev``, a NumPy array, as the normal path makes its leaf's value:
        converted and placed as a constant, a position operand's ids checked against their range first.

        The same values as at the event's last call (``np.arange(n)`` positions, a fixed index table: compared
        byte for byte, the event having matched shape and dtype) give the value made then, which was converted,
        checked against the same operand specs and placed the same way; the array itself is never kept, only
        a copy of its bytes, so an array edited in place is converted again."""
        dev = self.now.device
        data = o.tobytes() if o.size <= _HOST_MEMO_SIZE else None
        if data is not None:
            last = ev.hosts.get(k)
            if last is not None and last[0] == data and last[2] is dev and not last[1].is_deleted():
                return last[1]
        v = self.values.constant(o, None, ev.opname)
        d = ev.opdef
        if d.index_bounds is not None:
            specs, attrs = ev.checked
            check_host_indices(d, specs, attrs, {k: o})
        placed = cast(Array, place(v, dev))
        if data is not None and type(placed) is concrete_array_type():
            ev.hosts[k] = (data, placed, dev)
        return placed

    # -- what the normal path notes ---------------------------------------------------------------------------
    def check_device_indices(
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
        check (``Session.index_guard``), and the host run that explains a
        refused step reads it and raises here.
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
                self.index_flags.append(jnp.all(ok if skip is None else ok | (v == skip)))
            else:
                check_host_indices(d, specs, attrs, {k: np.asarray(v)})

    def index_guard(self, value: Array) -> Array:
        """``value``, or NaN where an index this trace recorded is out of range (see
        :meth:`Session.index_guard <tapeflow.Session.index_guard>`)."""
        flags = self.index_flags
        if not flags:
            return value
        ok = jnp.all(jnp.stack(flags))
        return jnp.where(ok, value, jnp.asarray(jnp.nan, value.dtype))

    def audit(self, opname: str, dtype: np.dtype) -> None:
        """Note the kernel that runs ``opname`` (its first recording in this session)."""
        self.seen.add(opname)
        kernel = "numpy-exact (cpu)" if dtype == R.OBJECT else f"xla:{self.device.platform}"
        self.backends.append((opname, kernel))
        if self.show_backend:
            print(f"[tapeflow] {opname}: {kernel}", file=sys.stderr)

    def note_event(
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
            akey = attr_key(attrs.items()) if attrs else ()
            hash(akey)
        except TypeError:
            return  # an unhashable attribute: not replayed
        checked = (specs, dict(entry.attrs))
        ev = Event.of(opname, entry.opdef, akey, operands, tracked, t.nodes[n0:], [*sources, -1], checked, entry.fn)
        if ev is not None:
            self.events[n0] = ev

    # -- between recordings -----------------------------------------------------------------------------------
    def restart(self, generation: int) -> None:
        """Start recording ``generation`` on an empty tape: this recording becomes the outline the next one
        replays (a lazy one on a lane), and its leaves and sites are dropped."""
        lane = self.lane
        if lane is not None and lane.pos == len(lane.outline.keys):
            self.lane = None  # the whole outline again, its nodes never built: it stays the outline as it is
        elif self.mode != "traced":
            self.keep_outline()
        self.now = Tape.empty(self.device)
        ol = self.outline
        if ol is not None:
            ol.start(self.now)
            if self.mode == "lazy" and self.sites is None:
                self.lane = Lane(ol, self.now)  # the next recording replays on a lane while it matches
        self.params_by_leaf = {}
        self.storage_by_leaf = {}
        if self.sites is not None:
            self.sites = Sites()
        if self.mode != "traced":
            self.lazy = LazyRecording(self.lazy.plan)  # pending values nobody read are dropped with the tape
        first, self.generation = not self.generation, generation
        if first:
            self.retune()  # events are noted from the second recording on
        else:
            self.choose()  # a new lane, or an outline to replay

    def keep_outline(self) -> None:
        """Make this recording the outline the next one replays (kept as it is when this one matched it whole)."""
        t, ol, lz = self.tape, self.outline, self.lazy
        n = len(t)
        if n and self.events:
            if ol is None or not (ol.matched == n == len(ol.keys)):
                ol = self.outline = Outline(self.events, [node_key(nd) for nd in t.nodes])
            else:
                ol.events = self.events
                plan = ol.plan
                if plan is not None and not plan.same_params(self.params_by_leaf, self.storage_by_leaf):
                    # a step with no backward of its own (an evaluation) had other Param leaves than the plan
                    # a lane's backward would reuse: the next whole replay works its plan out again
                    ol.plan = ol.struct = None
            ol.registered = registered_outside(self.events, self.params_by_leaf)
            if len(lz.keys) == n:
                ol.interned, ol.epoch = lz.keys, lz.epoch
        self.events = {}


# -- the paths --------------------------------------------------------------------------------------------------


def lane_path(
    rec: Recorder, s: Session, opname: str, operands: tuple[Operand, ...], attrs: dict[str, object]
) -> Tensor:
    """The outline's call again on a lane: its leaves' values are kept, no node is built; else the nodes are built
    and the call goes on to the path chosen then."""
    lane = rec.lane
    assert lane is not None  # (this path is chosen only while there is one)
    ev = lane.outline.events.get(lane.pos)
    if ev is not None and ev.lane(
        opname, operands, attrs, rec.conditions.tracked, rec.device, lane.vals, rec.host_leaf
    ):
        if ev.uses:
            lane.held.append(operands)
        n = lane.pos = lane.pos + len(ev.plan)
        note_recorded(rec.ref)
        shape, dtype = ev.out
        return Tensor(s, rec.owner, rec.generation, n - 1, shape, dtype)
    rec.flush()
    return rec.path(rec, s, opname, operands, attrs)


def replay_path(
    rec: Recorder, s: Session, opname: str, operands: tuple[Operand, ...], attrs: dict[str, object]
) -> Tensor:
    """The outline's call at this position again, while every node so far matched: its nodes appended with this
    call's values, the op check skipped (an eager session runs the event's kernel now); else the normal path."""
    t0 = rec.tape
    ol = rec.outline
    assert ol is not None  # (this path is chosen only while there is one)
    c = rec.conditions
    if ol.tape is t0 and not (c.checks_indices and _checks_device_indices(opname)):  # replay checks no index
        n0 = ol.matched
        ev = ol.events.get(n0)
        if ev is not None:
            try:
                akey = attr_key(attrs.items()) if attrs else ()
            except TypeError:
                akey = None
            got = ev.replay(opname, operands, akey, c.tracked, rec.device, rec.host_leaf)
            if got is not None:
                new, params = got
                if rec.mode == "eager":
                    ev.compute(new, t0)  # the op runs at its line, as in the normal path
                t = append_nodes(t0, new)
                if rec.sites is not None:
                    rec.sites.note(len(t0), len(t))
                rec.now = ol.tape = t
                note_recorded(rec.ref)
                ol.matched = n = n0 + len(new)
                rec.events[n0] = ev
                if params:
                    pbl, sbl = rec.params_by_leaf, rec.storage_by_leaf
                    for j, prm in params:
                        pbl[n0 + j] = prm
                        sbl[n0 + j] = prm.storage
                out = new[-1]
                return Tensor(s, rec.owner, rec.generation, n - 1, out.shape, out.dtype)
    return normal_path(rec, s, opname, operands, attrs)


def normal_path(
    rec: Recorder, s: Session, opname: str, operands: tuple[Operand, ...], attrs: dict[str, object]
) -> Tensor:
    """Every check (operands, op, indices), then the leaves and the op on a local tape value, installed only when
    all of it succeeded; the call is noted as an event for the next recording to replay."""
    t0 = rec.tape
    c = rec.conditions
    # 1. the operands: a handle's node, a Param (recorded below), a constant's value
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
            v = rec.values.constant(o, ref_dtype, opname)
            if not isinstance(o, (jax.Array, int, float)):  # host data: an index it holds can be checked now
                host = host or {}
                host[len(plan)] = o
            plan.append(v)
            specs.append((tuple(v.shape), np.dtype(v.dtype)))
    # 2. the op check, with the dtypes it will compute in, and its index checks
    precision = rec.precision
    casts = precision.targets(opname, specs) if precision is not None else None
    if casts is not None:
        specs = [(sh, dt if k is None else k) for (sh, dt), k in zip(specs, casts)]
    entry = check_op(opname, attrs, tuple(specs))
    if isinstance(entry, str):
        raise TapeError(entry)
    if (host is not None or c.checks_indices) and entry.opdef.index_bounds is not None:  # cheap test first
        if host is not None:
            check_host_indices(entry.opdef, tuple(specs), dict(entry.attrs), host)
        if c.checks_indices and entry.opdef.index_clamps:
            rec.check_device_indices(entry.opdef, tuple(specs), dict(entry.attrs), operands, plan, host)
    lazy = c.lazy
    if lazy and entry.dtype is R.OBJECT:  # exact rationals stay eager (NumPy objects, not XLA)
        lazy = False
        rec.materialize()
    # 3. leaves and the op on a local tape value
    t = rec.tape
    ids: list[NodeId] = []
    new_params: list[tuple[NodeId, Param]] = []
    grad_on, tracked, direct = c.grad_on, c.tracked, c.direct
    sources: list[int] | None = [] if c.notes and entry.dtype is not R.OBJECT else None  # the event's leaves
    for k, p in enumerate(plan):
        if type(p) is int:
            ids.append(p)
        elif isinstance(p, Param):
            st = p.storage
            if direct and not p.bound and st.dtype is not R.OBJECT:
                # the storage's value on this device: placed already, so the leaf is made directly
                rg = p.trainable and tracked and R.is_float(st.dtype)
                t, i = append_node(t, Node(None, (), (), st.read(rec.device), rg, st.shape, st.dtype))
            else:
                t, i = leaf(t, rec.param_value(p), requires_grad=p.trainable and tracked)
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
    # 4. commit: everything succeeded
    rec.install(t)
    for i, p in new_params:
        rec.register(i, p, p.storage)
    if opname not in rec.seen:
        rec.audit(opname, entry.dtype)
    if sources is not None:
        rec.note_event(opname, entry, attrs, operands, tracked, t, len(t0), sources, tuple(specs))
    nd = t[r.value]
    return Tensor(s, rec.owner, rec.generation, r.value, nd.shape, nd.dtype)
