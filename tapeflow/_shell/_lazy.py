"""Lazy sessions: record now, compute when a value is needed, one compiled program per step.

A ``Session(lazy=True)`` checks every op exactly as an eager session does (the
output shape and dtype come from the op's cached check, so every error is
raised at record time with the same message and the tape unchanged), but it
stores :data:`~tapeflow._core._tape.PENDING` instead of running the kernel. Values
are computed by compiled *programs* of the whole recording:

* reading a value (``.value``, ``float()``, printing, ``numpy()``, a state
  write, ``jvp``) runs one **forward program** computing every pending node;
* ``backward`` returns :class:`~tapeflow.Grads` whose arrays are computed, when
  first read, by one **gradient program** (the pending forward, the reverse
  sweep of :mod:`tapeflow._core._backward`, and the root's value);
* an :meth:`Optimizer.step <tapeflow.Optimizer.step>` over lazy Grads nobody
  read runs one **step program**: forward, backward, the per-storage sums of
  :class:`~tapeflow.Grads` and the optimizer's pure :meth:`~tapeflow.Optimizer.update`,
  as :func:`~tapeflow.train_step` does.

A program is a pure function of the values the recording already holds
(inputs, per-use parameter snapshots, constants, random draws, values computed
earlier): they are always arguments, never constants baked into it. Programs
are cached (a bounded LRU, ``"lazy"`` in :func:`~tapeflow.kernel_cache_info`)
by the recording's *structure*: each node's op definition (the
:class:`~tapeflow.OpDef` itself, so a redefined op never meets a program of
its old definition), attributes, parents, shape, dtype and ``requires_grad``,
interned once per node as it is first keyed, plus which nodes are still
pending and what the program returns. The intern table starts over when full;
every structure names the table's epoch, so ids of two epochs never meet.

>>> import jax.numpy as jnp, tapeflow as tfl
>>> with tfl.Session(lazy=True) as s:
...     x = s.input(jnp.arange(3.0), requires_grad=True)
...     y = tfl.sum(x * x)
...     y.node.op, s.tape[y.id].value.tolist()   # reading computes every pending node
('sum', 5.0)
"""

from __future__ import annotations

import bisect
import operator
import threading
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from itertools import compress, repeat
from typing import NamedTuple, Protocol, TypeAlias, TypeVar, cast

import jax
import jax.numpy as jnp

from .._core import _blocks, _compile_log, _env
from .._core import _registry as R
from .._core._compile_log import SigEntry
from .._core._kernels import KernelCache
from .._core._tape import PENDING, Tape, fill_pending, with_values
from .._core._tiered import maybe_tiered
from .._core._typing import Array, Attrs, NodeId, OptState
from ._grads import ParameterGroup, ParameterRecord
from ._params import Storage

__all__ = [
    "BackwardPlan",
    "Deferred",
    "LazyGrads",
    "LazyRecording",
    "ParameterGroups",
    "ProgramKey",
    "Ref",
    "lazy_default",
    "materialize",
    "traced_gradients",
    "weak",
]


def lazy_default(flag: bool | None) -> bool:
    """``flag``, or (None) what the environment variable ``TAPEFLOW_LAZY`` says: lazy unless it is ``0``.

    Unset or empty means lazy (the default of :class:`~tapeflow.Session`);
    ``0`` / ``false`` / ``no`` / ``off`` mean op-by-op execution, for debugging
    with a debugger stepping through each op; another value is refused.

    >>> lazy_default(True), lazy_default(False)
    (True, False)
    """
    if flag is not None:
        return bool(flag)
    return _env.switch("TAPEFLOW_LAZY", True)


_PROGRAMS = KernelCache("lazy", opaque=True)  # compiled programs, keyed by (kind, structure, pending nodes, ...)
_CHECKED = KernelCache("lazy_checked", opaque=True)  # structures whose backward was traced (shapes only)
NodeKey: TypeAlias = tuple["R.OpDef | None", "R.KernelKey | Attrs", tuple[int, ...], bool, R.Spec]
"""What a lazy structure keys a node by: ``(op definition, attrs, parents, requires_grad, spec)``, the attributes
typed as a kernel cache keys them (so -0.0 is not 0.0)."""

Structure: TypeAlias = tuple[int, ...]
"""A recording's key: the intern table's epoch, then one interned id per node."""

_META_IDS: dict[NodeKey, int] = {}  # node meta -> small int, so a structure key is a tuple of ints
_META_LIMIT = 1 << 20
_epoch = 0  # how often the table started over: an id means something only within its epoch
_intern_lock = threading.Lock()

S = TypeVar("S")
"""What a step returns (the optimizer's step outcome)."""

F = TypeVar("F", bound=Callable[..., object])


StepFn: TypeAlias = Callable[..., S]
"""A step over the slots' cotangents, ``(parts, values, state, loss=None) -> outcome``: the optimizer's
:func:`tapeflow._train._step.step` (``loss``, the root's value, when it checks it: ``debug_nans``); hashable,
and equal for two optimizers whose steps trace to the same program."""


def _intern(meta: NodeKey) -> int:
    global _epoch
    i = _META_IDS.get(meta)
    if i is None:
        with _intern_lock:
            if len(_META_IDS) >= _META_LIMIT:  # bounded: start over in a new epoch
                _META_IDS.clear()
                _PROGRAMS.clear()
                _CHECKED.clear()
                _epoch += 1  # after the clear: a reader that saw the old epoch finds it changed and re-keys
            i = _META_IDS.setdefault(meta, len(_META_IDS))
    return i


Ref: TypeAlias = Callable[[], object]
"""How a plan names a Param or a storage: calling it gives the object, or None once it was freed."""


class _Kept:
    """A :data:`Ref` to an object that takes no weak reference (a registration of an advanced user): held as it is."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __call__(self) -> object:
        return self.obj


def weak(obj: object) -> Ref:
    """A weak reference to ``obj`` where it takes one (a :class:`_Kept` else).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> w = tfl.Param(jnp.ones(2))
    >>> weak(w)() is w
    True
    """
    try:
        return weakref.ref(obj)
    except TypeError:
        return _Kept(obj)


class ParameterGroups(list[ParameterGroup]):
    """The parameter groups of a backward: a list a plan can refer to weakly (see :class:`BackwardPlan`)."""


class BackwardPlan(NamedTuple):
    """What a lazy ``backward`` worked out for one recording, reused while the next one is the same.

    Valid for a recording of the same structure (every node's op, attributes,
    parents, spec and ``requires_grad``), root, ``wrt`` handles and default seed
    whose parameter leaves register the very same Params and storages: then the
    requested ids, the parameter groups and the checks of the root, the seed and
    the VJPs (traced once) are those of the plan.

    A session keeps its plan across steps, and a notebook rebuilds its model in
    the same session: the plan names the Params, storages and groups weakly, so a
    dropped model's arrays are freed (a freed Param no longer matches). The groups
    live as long as the Grads or the optimizer's fused step that use them;
    :meth:`groups` makes them again from the plan's layout when they went.
    """

    struct: Structure
    root: NodeId
    wrt: tuple[NodeId, ...]
    params: dict[NodeId, Ref]
    storages: dict[NodeId, Ref]
    ids: list[NodeId]
    layout: tuple[tuple[NodeId, Ref, tuple[NodeId, ...], Ref | None], ...]  # per group: id, Param, leaves, storage
    made: list[Callable[[], ParameterGroups | None]]  # the groups last handed out (a weak reference)

    @classmethod
    def of(
        cls,
        struct: Structure,
        root: NodeId,
        wrt: tuple[NodeId, ...],
        params: Mapping[NodeId, ParameterRecord],
        storages: Mapping[NodeId, Storage],
        ids: list[NodeId],
        groups: ParameterGroups,
    ) -> BackwardPlan:
        return cls(
            struct,
            root,
            wrt,
            {i: weak(p) for i, p in params.items()},
            {i: weak(st) for i, st in storages.items()},
            ids,
            tuple((g.id, weak(g.parameter), g.leaves, None if g.storage is None else weak(g.storage)) for g in groups),
            [weakref.ref(groups)],
        )

    def groups(self) -> ParameterGroups | None:
        """The plan's parameter groups: the ones last handed out while something holds them (the optimizer's
        fused step keys its slot mapping by their identity), else made again; None: a Param of the plan was freed.
        """
        got = self.made[0]()
        if got is not None:
            return got
        out = ParameterGroups()
        for i, p, leaves, st in self.layout:
            prm, sto = p(), None if st is None else st()
            if prm is None or (st is not None and sto is None):
                return None
            out.append(ParameterGroup(i, prm, leaves, cast("Storage | None", sto)))
        self.made[0] = weakref.ref(out)
        return out

    def matches(
        self,
        struct: Structure,
        root: NodeId,
        seed: object,
        wrt: tuple[NodeId, ...],
        params: Mapping[NodeId, ParameterRecord],
        storages: Mapping[NodeId, Storage],
    ) -> bool:
        """Whether this plan holds for a backward of ``root`` over a recording of ``struct`` (Params by identity)."""
        if seed is not None or root != self.root or wrt != self.wrt or struct != self.struct:
            return False
        return self.same_params(params, storages)

    def same_params(self, params: Mapping[NodeId, ParameterRecord], storages: Mapping[NodeId, Storage]) -> bool:
        """Whether the leaves ``params`` and ``storages`` register are the plan's: the very same Params and
        storages at the same leaves (by identity; a freed one matches nothing)."""
        mine, st = self.params, self.storages
        if len(params) != len(mine) or len(storages) != len(st):
            return False
        # the very same Params and storages at the same leaves (identity, compared without a Python loop body)
        return all(map(operator.is_, map(params.get, mine), map(operator.call, mine.values()))) and all(
            map(operator.is_, map(storages.get, st), map(operator.call, st.values()))
        )


class LazyRecording:
    """The structure key of a lazy session's recording, extended as nodes are first keyed.

    ``plan`` is the last backward's :class:`BackwardPlan` (kept across resets).
    """

    __slots__ = ("checked", "epoch", "exact", "keys", "plan")

    def __init__(self, plan: BackwardPlan | None = None) -> None:
        self.keys: list[int] = []
        self.epoch = _epoch  # the intern table's epoch that ``keys`` belong to
        self.exact = False  # the recording holds exact-rational values (NumPy objects): it is computed eagerly
        self.checked = 0  # nodes that :meth:`compiled_structure` found fit for one program
        self.plan = plan

    def truncate(self, n: int) -> None:
        """The tape went back to ``n`` nodes (a failed backward put the old tape back)."""
        if len(self.keys) > n:
            del self.keys[n:]
        self.checked = min(self.checked, n)

    def compiled_structure(self, tape: Tape) -> Structure | None:
        """:meth:`structure` of an eager recording whose backward may run as one program; None: it may not.

        None for a recording of exact rationals or tracers, or one that holds a
        checkpointed block (its op must go when its wrapper does, and a node
        keyed here, like a cached program, would keep it). Each node is looked
        at once, before it is keyed.

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> s = tfl.Session(lazy=False)
        >>> h = tfl.sum(s.input(jnp.ones(2)))
        >>> LazyRecording().compiled_structure(s.recording) is not None
        True
        """
        nodes = tape.nodes
        tracer, exact = jax.core.Tracer, R.OBJECT
        for nd in nodes[self.checked :]:
            d = nd.opdef
            if nd.dtype is exact or (isinstance(nd.value, tracer) if d is None else d.user and not d.public):
                return None
        self.checked = len(nodes)
        return self.structure(tape)

    def structure(self, tape: Tape) -> Structure:
        """The interned structure of ``tape``: its epoch, then each node's id (a node keyed once, when first seen).

        Keys of one structure all come from one epoch of the table: when the table
        started over since this recording was keyed, or while it keys, it keys every
        node again.
        """
        n = len(tape)
        while True:
            epoch = _epoch
            if self.epoch != epoch:
                self.keys, self.epoch = [], epoch
            keys = self.keys
            for nd in tape.nodes[len(keys) :]:
                a = nd.attrs
                keys.append(_intern((nd.opdef, R.attr_key(a) if a else a, nd.parents, nd.requires_grad, nd.spec)))
            if _epoch == epoch:
                return (epoch, *keys) if len(keys) == n else (epoch, *keys[:n])


def _split(tape: Tape) -> tuple[tuple[NodeId, ...], list[Array]]:
    """The pending node ids of ``tape`` and the values of all the others, in node order."""
    values = [nd.value for nd in tape]
    waiting = list(map(operator.is_, values, repeat(PENDING)))  # no Python-level loop body: once per step
    return tuple(compress(range(len(values)), waiting)), list(compress(values, map(operator.not_, waiting)))


def _given_offsets(pending: tuple[NodeId, ...], slots: tuple[tuple[NodeId, ...] | None, ...]) -> tuple[int, ...]:
    """Per slot, where its first leaf's value is in the program's ``given`` values (-1: an unused slot).

    ``given`` holds every value that is not pending, in node order. The last answer is kept: every replayed
    step of one recording asks the same question.
    """
    global _last_offsets
    last = _last_offsets
    if last is not None and last[0] == pending and last[1] == slots:
        return last[2]
    offsets = tuple(-1 if ls is None else ls[0] - bisect.bisect_left(pending, ls[0]) for ls in slots)
    _last_offsets = (pending, slots, offsets)
    return offsets


_last_offsets: tuple[tuple[NodeId, ...], tuple[tuple[NodeId, ...] | None, ...], tuple[int, ...]] | None = None

# the parts of the last step program run with every slot passed as its first leaf (LazyGrads.step): structure,
# pending ids, the optimizer's slot leaves and step (by identity), loss flag, root, ids, the alias, the key
_last_step: tuple[object, ...] | None = None


def _program_key(key: Hashable) -> Hashable:
    """Where the program for ``key`` is cached: a program traced with block loops off is another program."""
    return key if _blocks.block_loops_enabled() else ("unrolled", key)


def _cached_program(key: Hashable) -> Callable[..., tuple[object, Array]] | None:
    """The program :func:`_program` finds for ``key`` without building one (None: not cached, or evicted)."""
    return cast("Callable[..., tuple[object, Array]] | None", _PROGRAMS.hit(_program_key(key)))


def _replay(skel: Tape, pending: frozenset[NodeId], given: Sequence[Array]) -> _blocks.Forward:
    """Inside a trace: every node's value of ``skel``, the pending ones computed from ``given`` (the others').

    A stretch that repeats one block of ops runs as a loop (:mod:`tapeflow._core._blocks`) unless
    :func:`~tapeflow.set_block_loops` turned that off.
    """
    nodes = list(skel.nodes)
    runs = _blocks.find_runs(nodes, pending) if _blocks.block_loops_enabled() else ()
    return _blocks.Forward(nodes, pending, given, runs, "lazy session")


def _skeleton(tape: Tape) -> Tape:
    """``tape`` without values (a program keeps only the structure, never the first call's arrays)."""
    return with_values(tape, [None] * len(tape))


def _log_trace(
    name: str, what: str, skel: Tape, pending: tuple[NodeId, ...], state: object = None, step: Hashable = None
) -> None:
    """Tell the compile log (while ``name`` is traced) what compiles: counted per recording without its shapes.

    The signature is the shape and dtype of every leaf, each node's attributes and (a step
    program) the optimizer state's leaves with their weak types, so a recompile names the input
    whose shape changed (a new batch size), the attribute or the state leaf. A step program is
    counted per update rule too (``step``: equal for equal optax structures and hyperparameters):
    another optimizer's program is a first compile of its own, not a new signature of the last one.
    """
    nodes = skel.nodes
    ops = tuple((nd.op, nd.opdef, nd.parents, nd.requires_grad) for nd in nodes)

    def signature() -> list[SigEntry]:
        sig: list[SigEntry] = []
        for i, nd in enumerate(nodes):
            if nd.op is None:
                sig.append((f"input node {i}", "shape", nd.shape))
                sig.append((f"input node {i}", "dtype", str(nd.dtype)))
            else:
                sig += [(f"node {i} ({nd.op}) attribute {k}", "static value", v) for k, v in nd.attrs]
        return sig + _compile_log.tree_signature(state, "optimizer state leaf")

    # the rule by its hash: the log's bounded table of keys must not hold an optimizer (nor its Params)
    key = (name, ops, pending) if step is None else (name, ops, pending, hash(step))
    _compile_log.traced(name, f"{what} ({len(nodes)} nodes)", key, signature)


class ProgramKey:
    """A program's cache key: its parts hashed once (a cache hit hashes its key twice, to find it and to mark
    it recently used, and a step's key has a hundred parts: the structure, the pending ids, the slots).

    >>> ProgramKey(("step", (0, 1))) == ProgramKey(("step", (0, 1)))
    True
    """

    __slots__ = ("_hash", "parts")

    def __init__(self, parts: tuple[Hashable, ...]) -> None:
        self.parts = parts
        self._hash = hash(parts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return type(other) is ProgramKey and other._hash == self._hash and other.parts == self.parts


def _program(key: Hashable, build: Callable[[], F], static_argnums: tuple[int, ...] = ()) -> F:
    key = _program_key(key)
    fn = _PROGRAMS.hit(key)
    if fn is None:
        fn = cast(F, maybe_tiered(build(), static_argnums))  # tiered compilation, when it is on
        _PROGRAMS.put(key, fn)
    return fn


def materialize(rec: LazyRecording, tape: Tape, inline: bool = False) -> None:
    """Compute every pending node of ``tape`` with one compiled forward program; store the values in the nodes.

    Nodes are shared by every tape value that contains them, so a value is
    computed once (:func:`~tapeflow._core._tape.fill_pending`) and then read like an eager one.
    ``inline``: a traced session's recording, whose values are tracers of the caller's program: the forward is
    traced into it, neither cached nor compiled on its own.
    """
    pending, given = _split(tape)
    if not pending:
        return
    if inline:
        replayed = _replay(tape, frozenset(pending), given)
        fill_pending(tape, pending, [replayed[i] for i in pending])
        return
    struct = rec.structure(tape)

    def build() -> Callable[[list[Array]], list[Array]]:
        skel, pend = _skeleton(tape), frozenset(pending)

        def lazy_forward_program(given: list[Array]) -> list[Array]:
            _log_trace("lazy_forward_program", "lazy forward program", skel, pending)
            replayed = _replay(skel, pend, given)
            return [replayed[i] for i in pending]

        return jax.jit(lazy_forward_program)

    outs = _program(("forward", struct, pending), build)(given)
    fill_pending(tape, pending, outs)


def traced_gradients(tape: Tape, root: NodeId, seed: Array | None, ids: Sequence[NodeId]) -> dict[NodeId, Array]:
    """A traced session's backward, inside the caller's trace: the pending forward and the reverse sweep.

    ``train_step`` and ``value_and_grad`` record lazily as a lazy session does,
    so their program is traced from the recording as a lazy session's gradient
    program is, repeated blocks once each (:mod:`tapeflow._core._blocks`),
    straight into the caller's program (nothing cached or compiled on its
    own). A recording computed as it was made (``debug_nans``) is swept as it is.
    """
    pending, given = _split(tape)
    if not pending:
        return _blocks.computed_backward(tape, root, seed, ids)
    by_leaf, value = _gradients(tape, frozenset(pending), given, seed, root, tuple(ids))
    fill_pending(tape, (root,), (value,))  # the root's value: the caller returns it
    return by_leaf


def _gradients(
    skel: Tape, pend: frozenset[NodeId], given: list[Array], seed: Array | None, root: NodeId, ids: tuple[NodeId, ...]
) -> tuple[dict[NodeId, Array], Array]:
    """Inside a trace: the pending forward, then the reverse sweep; ``({id: cotangent}, root value)``."""
    values = _replay(skel, pend, given)
    return _blocks.backward(skel, values, root, seed, ids), values[root]


class Deferred(Protocol):
    """A recording whose nodes are built when first read (a lazy session's lane: :class:`tapeflow._shell._replay.Lane`)."""

    def tape(self) -> Tape:
        """The recording's nodes (built once)."""
        ...

    def values(self) -> tuple[tuple[NodeId, ...], list[Array]] | None:
        """The pending ids and the other nodes' values without building them; None: use :meth:`tape`."""
        ...

    def leaf_value(self, i: NodeId) -> Array:
        """Leaf ``i``'s value (while :meth:`values` answers)."""
        ...

    def fill(self, i: NodeId, value: Array) -> None:
        """Pending node ``i``'s computed value."""
        ...


class LazyGrads:
    """The gradients of one lazy ``backward``, computed when first needed (see :class:`~tapeflow.Grads`).

    Holds the recording it was taken from (a tape, or a :class:`Deferred` one whose
    nodes are built only if something needs them: its values are the programs'
    arguments), the root, the seed and the requested ids. Programs keep only the
    structure (:func:`_skeleton`), never a step's arrays.
    """

    __slots__ = ("ids", "recording", "root", "seed", "struct")

    def __init__(
        self,
        struct: Structure,
        recording: Tape | Deferred,
        root: NodeId,
        seed: Array | None,
        ids: Sequence[NodeId],
    ):
        self.recording, self.root, self.seed, self.ids = recording, root, seed, tuple(ids)
        self.struct = struct  # LazyRecording.structure of the recording's tape

    @property
    def tape(self) -> Tape:
        """The recording as a tape (a deferred one's nodes are built now)."""
        rec = self.recording
        return rec if type(rec) is Tape else cast(Deferred, rec).tape()

    def _values(self) -> tuple[tuple[NodeId, ...], list[Array]]:
        """The pending node ids and the values of all the others, in node order (what a program takes)."""
        rec = self.recording
        if type(rec) is not Tape:
            got = cast(Deferred, rec).values()
            if got is not None:
                return got
        return _split(self.tape)

    def leaf_value(self, i: NodeId) -> Array:
        """The value of leaf ``i`` of the recording (a deferred one's, without building its nodes if it can)."""
        rec = self.recording
        if type(rec) is Tape:
            return rec[i].value
        deferred = cast(Deferred, rec)
        return deferred.leaf_value(i) if deferred.values() is not None else deferred.tape()[i].value

    def _key(self, kind: str, pending: tuple[NodeId, ...], *extra: Hashable) -> ProgramKey:
        seed = None if self.seed is None else (tuple(jnp.shape(self.seed)), jnp.result_type(self.seed))
        return ProgramKey((kind, self.struct, pending, self.root, self.ids, seed, *extra))

    def _set_root(self, value: Array) -> None:
        rec = self.recording
        if type(rec) is Tape:
            fill_pending(rec, (self.root,), (value,))  # kept only while the root still waits for it
        else:
            cast(Deferred, rec).fill(self.root, value)

    def _gradients_fn(self, pending: tuple[NodeId, ...]) -> Callable[..., tuple[list[Array], Array]]:
        skel, pend, root, ids = _skeleton(self.tape), frozenset(pending), self.root, self.ids

        def lazy_gradient_program(given: list[Array], seed: Array | None) -> tuple[list[Array], Array]:
            _log_trace("lazy_gradient_program", "gradient program", skel, pending)
            by_leaf, value = _gradients(skel, pend, given, seed, root, ids)
            return [by_leaf[i] for i in ids], value

        return lazy_gradient_program

    def check(self) -> None:
        """Trace the backward once per structure (shapes only), so what fails in a VJP fails in ``backward``.

        An eager backward runs every VJP at once; a lazy one would otherwise
        report a failing VJP (a user op's wrong cotangent, a checkpointed block
        that reads other parameters) only when the gradients are computed.
        """
        pending, given = self._values()
        key = self._key("grad", pending)
        if _CHECKED.hit(key) is None:
            jax.eval_shape(self._gradients_fn(pending), given, self.seed)
            _CHECKED.put(key, True)

    def resolve(self) -> dict[NodeId, Array]:
        """Run the gradient program: ``{id: cotangent}`` for every requested id (and keep the root's value)."""
        pending, given = self._values()
        key = self._key("grad", pending)
        cts, root = _program(key, lambda: jax.jit(self._gradients_fn(pending)))(given, self.seed)
        self._set_root(root)
        return dict(zip(self.ids, cts))

    def step(
        self,
        slot_leaves: Sequence[tuple[NodeId, ...] | None],
        step_fn: StepFn[S],
        values: list[Array],
        state: OptState,
        with_loss: bool = False,
    ) -> S:
        """Run the step program: the pending forward, the reverse sweep, then ``step_fn``; returns what it returns.

        ``slot_leaves[k]`` are the leaves (in recording order) whose cotangents
        update slot ``k`` (None: unused); ``step_fn(parts, values, state)`` is
        :func:`tapeflow._train._step.step` for one optimizer (part of the program's
        key), given each slot's cotangents; ``with_loss`` also hands it the root's
        value (``loss=``, for ``debug_nans``).
        """
        pending, given = self._values()
        global _last_step
        last = _last_step
        if (
            last is not None
            and last[0] is self.struct
            and last[1] is pending
            and last[2] is slot_leaves
            and last[3] is step_fn
            and last[4] is with_loss
            and last[5] == self.root
            and last[6] == self.ids
            and self.seed is None
            and all(map(operator.is_, map(given.__getitem__, cast("tuple[int, ...]", last[7])), values))
        ):
            # the step of the last call again, every slot its first leaf's snapshot: the same alias and key
            # (compared by identity: the parts are the outline's and the optimizer's, unchanged between steps)
            fn = _cached_program(last[8])
            if fn is not None:
                got, root = fn(given, None, [], state, step_fn)
                self._set_root(root)
                return cast(S, got)
        slots = tuple(slot_leaves)
        # a slot whose current value is its first leaf's snapshot (the usual step) is passed once, as that leaf
        alias = tuple(-1 if k < 0 or given[k] is not v else k for k, v in zip(_given_offsets(pending, slots), values))
        rest = [v for v, a in zip(values, alias) if a < 0]

        def build() -> Callable[[list[Array], Array | None, list[Array], OptState, StepFn[S]], tuple[S, Array]]:
            skel, pend, root, ids = _skeleton(self.tape), frozenset(pending), self.root, self.ids

            def lazy_step_program(
                given: list[Array], seed: Array | None, rest: list[Array], state: OptState, step_fn: StepFn[S]
            ) -> tuple[S, Array]:
                _log_trace("lazy_step_program", "lazy step program", skel, pending, state, step_fn)
                by_leaf, value = _gradients(skel, pend, given, seed, root, ids)
                parts = [None if ls is None else tuple(by_leaf[i] for i in ls) for ls in slots]
                others = iter(rest)
                values = [given[a] if a >= 0 else next(others) for a in alias]
                return step_fn(parts, values, state, loss=value if with_loss else None), value

            # the step is a static argument: a program traced for one optimizer serves every equal step
            # (the same optax structure and slots), and a retrace runs the caller's own
            return jax.jit(lazy_step_program, static_argnums=4)

        key = self._key("step", pending, slots, alias, step_fn, with_loss)
        out, root = _program(key, build, (4,))(given, self.seed, rest, state, step_fn)
        self._set_root(root)
        if self.seed is None and -1 not in alias:
            _last_step = (self.struct, pending, slot_leaves, step_fn, with_loss, self.root, self.ids, alias, key)
        return out
