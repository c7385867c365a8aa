"""Record once, replay after: a session's recording of the last step, matched op by op by the next one.

A training loop records the same ops on the same Params step after step.
While a lazy session (or an eager one, for the ops XLA computes) records, each :meth:`Session.apply <tapeflow.Session.apply>`
call notes an :class:`Event`: the op, its attributes, what each operand was (a
handle's node id, a Param by identity with its storage and trainable flag, a
Python number), the recording context, and the nodes the call appended (leaves
for Params and numbers, then the op's node). At ``reset`` the events become the
session's :class:`Outline`.

In the next recording an ``apply`` whose call matches the outline's event at the
same tape position, while every node recorded so far matched the outline too
(:attr:`Outline.matched` counts them; a node appended outside ``apply``, an
input or a random draw, is compared with the outline's node at its position),
appends the event's nodes again with this call's values: each Param use reads
its storage now, a number is the same constant, the op's node is pending (an
eager session runs the event's kernel at once: :meth:`Event.compute`). It
skips the op check, because a matching call was checked in the step that
recorded it and would be checked the same way: the same op definition, the same
attributes and the same operand specs (an operand node at a matched position
has the outline's spec). Anything else (another op, another Param or number, a
changed storage or trainable flag, a redefined op, ``no_grad``, a mixed-precision
policy, an exact-rational value) takes the normal path, which records exactly
what an eager or a normal lazy session records; the outline stops matching from
there. Handles, generations, Param snapshots, the RNG counter and failure
atomicity are those of the normal path by construction: the replayed call checks
its handles first and builds the same nodes.

An event that has replayed once matches by code written out for it (its
operand tests and node constructors, no loop over operand kinds): the same
answer as :meth:`Event.match` for every call, at about half the cost.

>>> import jax.numpy as jnp, tapeflow as tfl
>>> w = tfl.Param(jnp.ones(3))
>>> s = tfl.Session(lazy=True)
>>> for step in range(2):   # the second step replays the first one's recording
...     with s:
...         y = tfl.sum(s.input(jnp.arange(3.0)) * w)
...         print(float(y), s.recording[y.id].op)
3.0 sum
3.0 sum
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from itertools import islice
from typing import Any, cast

import jax
import numpy as np

from .._core import _registry as R
from .._core._device import concrete_array_type, device_of
from .._core._node import PENDING, Node
from .._core._result import TapeError
from .._core._tape import Tape, append_nodes, fill_pending, kernel_failed
from .._core._typing import Array, NodeId, Shape
from ._lazy import BackwardPlan, Ref, Structure, weak
from ._params import Param
from ._tensor import Tensor

__all__ = [
    "ARRAY",
    "HOST",
    "PARAM",
    "SCALAR",
    "TENSOR",
    "Event",
    "HostLeaf",
    "Lane",
    "Outline",
    "node_key",
    "registered_outside",
    "same_scalar",
]

TENSOR, PARAM, SCALAR, ARRAY, HOST = 0, 1, 2, 3, 4
"""What an operand of an :class:`Event` was: a handle (its node id), a Param (by identity), a Python number, a
``jax.Array`` on the session's device or a NumPy array (by shape and dtype: a batch of ids given to ``take``)."""

HostLeaf = Callable[["Event", int, np.ndarray], "Array"]
"""``host(event, k, array)``: operand ``k`` of a replayed call given as a NumPy array, as the session's normal path
makes its leaf's value (converted and placed; a position operand's ids checked against their range: raises)."""

# what an event's appended node is: the op's node, a Param use, a number's leaf, an array operand's leaf
_OP, _USE, _CONST, _ARR = 0, 1, 2, 3


NodeArgs = tuple[Any, ...]
"""A node's constructor arguments ``(op, attrs, parents, value, requires_grad, shape, dtype, spec, opdef)``."""

NodeKey = tuple[object, ...]
"""A node's static part as the outline compares it: ``(opdef, attrs, parents, requires_grad, spec)``."""


def node_key(nd: Node) -> NodeKey:
    """What a node recorded outside ``apply`` must equal at its position for the outline to keep matching."""
    return (nd.opdef, nd.attrs, nd.parents, nd.requires_grad, nd.spec)


def same_scalar(a: object, b: object) -> bool:
    """``a`` and ``b`` are the same Python number (type, value and the sign of a zero: ``-0.0`` is not ``0.0``)."""
    if type(a) is not type(b) or a != b:
        return False
    return a != 0 or type(a) is not float or math.copysign(1.0, a) == math.copysign(1.0, cast(float, b))


class Event:
    """One ``apply`` call of a recording (a lazy one, or an eager one XLA computes), and the nodes it appended
    (values left out)."""

    __slots__ = (
        "_fast", "attrs", "checked", "hosts", "kernel", "kinds", "lane", "opdef", "opname", "out", "plan", "refs",
        "storages", "tracked", "trainable", "uses",
    )  # fmt: skip

    def __init__(
        self,
        opname: str,
        opdef: R.OpDef,
        attrs: Hashable,
        kinds: tuple[int, ...],
        refs: tuple[object, ...],
        storages: tuple[Ref | None, ...],
        trainable: tuple[bool, ...],
        tracked: bool,
        plan: tuple[tuple[int, NodeArgs, int], ...],
        checked: tuple[tuple[R.Spec, ...], dict[str, object]] = ((), {}),
        kernel: Callable[..., Array] | None = None,
    ) -> None:
        self.opname = opname
        self.opdef = opdef
        self.attrs = attrs  # the call's attributes as the op check keys them (typed: 1, 1.0 and True differ)
        self.kinds = kinds  # per operand: TENSOR, PARAM or SCALAR
        # per operand: the node id, the Param (a weak reference: an outline outlives the recording, and must not
        # keep a dropped model's arrays alive), the number
        self.refs = refs
        self.storages = storages  # per operand: the Param's storage when recorded (a weak reference)
        self.trainable = trainable  # per operand: the Param's trainable flag when recorded
        self.tracked = tracked  # gradients were recorded (grad_enabled and no no_grad block)
        # per appended node: (_OP, _USE or _CONST, what rebuilds it, operand): an op node's Node arguments, a
        # Param use's (requires_grad, shape, dtype, spec), a number's leaf itself (as the value argument)
        self.plan = plan
        self.checked = checked  # the operand specs and normalized attributes the op check saw (for host ids)
        self.kernel = kernel  # the op's compiled forward for these operand specs (an eager replay runs it)
        # per NumPy operand (HOST): the bytes of its last values, the leaf value they made and its device
        # (Recorder.host_leaf reuses it for the same bytes)
        self.hosts: dict[int, tuple[bytes, Array, jax.Device | None]] = {}
        op = plan[-1][1]  # the op's node comes last
        self.out: tuple[Shape, np.dtype] = (op[5], op[6])  # its shape and dtype (the handle's)
        # ``(offset, operand)`` of each Param leaf among the appended nodes
        self.uses = tuple((j, k) for j, (code, _, k) in enumerate(plan) if code == _USE)
        # this event's match with its tests written out, made when it first replays (a training loop replays
        # one event per op per step)
        self._fast: Replay | None = None
        # :meth:`match` for a :class:`Lane`, called as ``ev.lane(opname, operands, attrs, tracked, device, vals,
        # host)`` with the call's attributes as given (a mapping, not yet keyed): on a match it appends the values of the leaves the call records (each Param use reads its
        # storage now, a number's constant, an array operand) to ``vals`` and answers True; nodes are built later.
        # The code written out for this event (the same tests as ``_fast``), made on the first call.
        self.lane: LaneMatch = self._first_lane

    def _first_lane(self, *call: Any) -> bool:
        """:attr:`lane`'s first call (a :data:`LaneMatch` call): writes out its code, which answers this call and
        every later one."""
        fn = self.lane = _specialized(self, lane=True)
        return bool(fn(*call))

    def replay(self, *call: Any) -> tuple[list[Node], list[tuple[int, Param]]] | None:
        """:meth:`match` (the same arguments): by the code generated for this event once it has replayed (the same
        answer, faster)."""
        fast = self._fast
        if fast is not None:
            return fast(*call)
        got = self.match(*call)
        if got is not None:
            self._fast = cast(Replay, _specialized(self))
        return got

    def match(
        self,
        opname: str,
        operands: Sequence[object],
        attrs: Hashable,
        tracked: bool,
        device: jax.Device,
        host: HostLeaf | None = None,
    ) -> tuple[list[Node], list[tuple[int, Param]]] | None:
        """If a call of ``opname`` with these operands, attributes and context is this event again: the nodes to
        append (each Param use reads its storage now) and ``(offset, Param)`` for each Param leaf among them;
        else None (the call is recorded the normal way). A NumPy operand's leaf value comes from ``host`` (None:
        such a call does not match)."""
        if opname != self.opname or tracked is not self.tracked or attrs != self.attrs:
            return None
        if len(operands) != len(self.kinds) or R.REGISTRY.get(opname) is not self.opdef:  # or redefined since
            return None
        for o, kind, r, st, tr in zip(operands, self.kinds, self.refs, self.storages, self.trainable):
            if kind == TENSOR:
                if type(o) is not Tensor or o.id != r:
                    return None
            elif kind == PARAM:
                # (an event holds no bound Param, and a Param's binding is fixed at creation: identity covers it)
                if o is not cast(Ref, r)() or o.storage is not cast(Ref, st)() or o.trainable is not tr:  # type: ignore[attr-defined]
                    return None
            elif kind == ARRAY:  # placed on the device already: its leaf holds it as it is
                if type(o) is not concrete_array_type() or (o.shape, o.dtype) != r or device_of(o) is not device:  # type: ignore[attr-defined]
                    return None
            elif kind == HOST:
                if type(o) is not np.ndarray or (o.shape, o.dtype) != r or host is None:
                    return None
            elif type(o) is not type(r) or o != r or (o == 0 and not same_scalar(o, r)):
                return None
        made = {k: host(self, k, o) for k, (o, kind) in enumerate(zip(operands, self.kinds)) if kind == HOST}  # type: ignore[misc, arg-type]
        leaves = [
            cast(Param, operands[k]).storage.read(device)
            if code == _USE
            else made[k]
            if k in made
            else operands[k]
            if code == _ARR
            else args[3].value
            for code, args, k in self.plan[:-1]
        ]
        return self.nodes(leaves), [(j, cast(Param, operands[k])) for j, k in self.uses]

    def compute(self, new: list[Node], tape: Tape) -> None:
        """Run the op of a replayed call now (an eager session's): its kernel on its operands' values, the nodes
        of ``tape`` and the leaves among ``new`` (the nodes :meth:`replay` made), into its node, the last of
        ``new``. A failing kernel raises :class:`TapeError` as the normal path does, and nothing is appended."""
        op = new[-1]
        n0 = len(tape)
        ins = [tape[p] if p < n0 else new[p - n0] for p in op.parents]
        try:
            out = cast("Callable[..., Array]", self.kernel)(*[nd.value for nd in ins])
        except Exception as e:  # a kernel failure (device, numerics, ...)
            raise TapeError(kernel_failed(self.opname, ins, e)) from None
        new[-1] = Node(op.op, op.attrs, op.parents, out, op.requires_grad, op.shape, op.dtype, op.spec, op.opdef)

    def nodes(self, leaves: Iterable[Array], value: Array = PENDING) -> list[Node]:
        """The nodes this event appends, given its leaves' values in order (each Param use's, each array
        operand's, each number's) and the op's (``PENDING`` until a program computed it)."""
        out: list[Node] = []
        it = iter(leaves)
        for code, args, _ in self.plan:  # each node from its template's arguments: only the values are new
            if code == _OP:
                out.append(Node(*args) if value is PENDING else Node(*(*args[:3], value, *args[4:])))
            elif code == _CONST:
                next(it)
                out.append(args[3])  # a number's constant leaf: the same immutable node
            else:
                out.append(Node(None, (), (), next(it), *args))
        return out

    @staticmethod
    def of(
        opname: str,
        opdef: R.OpDef,
        attrs: Hashable,
        operands: Sequence[object],
        tracked: bool,
        nodes: Sequence[Node],
        sources: Sequence[int],
        checked: tuple[tuple[R.Spec, ...], dict[str, object]] = ((), {}),
        kernel: Callable[..., Array] | None = None,
    ) -> Event | None:
        """The event of a call whose appended ``nodes`` hold operand ``sources[j]`` (-1: the op's node); None if
        the call cannot be replayed (an operand that is neither a handle, a Param, a Python number, a
        ``jax.Array`` its leaf holds as it is nor a NumPy array of numbers). ``checked``: the operand specs
        and normalized attributes the op was checked with; ``kernel``: its compiled forward for them."""
        kinds: list[int] = []
        refs: list[object] = []
        storages: list[Ref | None] = []
        trainable: list[bool] = []
        leaves = dict(zip(sources, nodes))  # operand position -> the leaf recorded for it
        for k, o in enumerate(operands):
            if type(o) is Tensor:
                kinds.append(TENSOR)
                refs.append(o.id)
            elif isinstance(o, Param):
                if o.bound:
                    return None  # a pytree view of a Param records its bound value: not replayed
                kinds.append(PARAM)
                refs.append(weak(o))
                storages.append(weak(o.storage))
                trainable.append(o.trainable)
                continue
            elif type(o) in (int, float, bool):
                kinds.append(SCALAR)
                refs.append(o)
            elif type(o) is concrete_array_type() and k in leaves and leaves[k].value is o:
                kinds.append(ARRAY)
                refs.append(leaves[k].spec)
            elif type(o) is np.ndarray and o.dtype.kind in "biuf" and k in leaves:
                kinds.append(HOST)
                refs.append((o.shape, o.dtype))
            else:
                return None
            storages.append(None)
            trainable.append(False)
        plan = tuple(
            (_OP, _arguments(nd, PENDING), k)
            if k < 0
            else (_CONST, (None, (), (), nd, False, (), None, None, None), k)
            if kinds[k] == SCALAR
            else (_USE if kinds[k] == PARAM else _ARR, (nd.requires_grad, nd.shape, nd.dtype, nd.spec), k)
            for nd, k in zip(nodes, sources)
        )
        return Event(
            opname,
            opdef,
            attrs,
            tuple(kinds),
            tuple(refs),
            tuple(storages),
            tuple(trainable),
            tracked,
            plan,
            checked,
            kernel,
        )


Replay = Callable[
    [str, Sequence[object], Hashable, bool, jax.Device, "HostLeaf | None"],
    "tuple[list[Node], list[tuple[int, Param]]] | None",
]
"""An event's match: ``replay(opname, operands, attrs, tracked, device, host)`` as :meth:`Event.match` answers it."""

LaneMatch = Callable[
    [str, Sequence[object], Mapping[str, object], bool, jax.Device, list[Array], "HostLeaf | None"], bool
]
"""An event's match on a lane: ``lane(opname, operands, attrs, tracked, device, vals, host)`` (see :attr:`Event.lane`);
``attrs`` as the call gave them, compared with the event's key by code written for it."""

_MISSING = object()  # an attribute the call did not give


def _other_attrs(attrs: Mapping[str, object], key: Hashable) -> bool:
    """Whether the attributes ``attrs`` key other than ``key`` (:func:`~tapeflow._core._registry.attr_key`);
    attributes that cannot be keyed are other."""
    try:
        return R.attr_key(attrs.items()) != key
    except TypeError:
        return True


def _attr_tests(key: tuple[tuple[object, ...], ...], ns: dict[str, object]) -> str:
    """A test, written out, that is true when a call's attributes ``attrs`` (a mapping) key other than ``key``.

    Each attribute is compared by its exact type and value, as :func:`~tapeflow._core._registry.attr_key` keys it:
    a float zero by its sign too, a tuple of ints (or bools, strings) by its elements' types. Any other tuple
    is compared by the whole key (a -0.0 in a tuple of floats keys apart from 0.0)."""
    if not key:
        return "attrs"
    tests = [f"len(attrs) != {len(key)}"]
    for i, e in enumerate(key):
        ns[f"AN{i}"] = e[0]
        a = f"(a{i} := attrs.get(AN{i}, MISSING))"
        if len(e) == 4:  # -0.0
            tests.append(f"type({a}) is not float or a{i} != 0.0 or copysign(1.0, a{i}) > 0.0")
        elif len(e) == 3:
            ns[f"AT{i}"], ns[f"AV{i}"] = e[1], e[2]
            test = f"type({a}) is not AT{i} or (a{i} is not AV{i} and a{i} != AV{i})"
            if e[1] is float and e[2] == 0.0:
                test += f" or copysign(1.0, a{i}) < 0.0"
            tests.append(test)
        else:
            typed = cast(tuple[object, ...], e[1])
            ts = typed[0]
            if type(ts) is not tuple or any(t in (float, complex, tuple) for t in ts):
                return "other_attrs(attrs, ATTRS)"
            ns[f"ATS{i}"], ns[f"AV{i}"] = ts, typed[1]
            tests.append(
                f"type({a}) is not tuple or (a{i} is not AV{i} and a{i} != AV{i}) or tuple(map(type, a{i})) != ATS{i}"
            )
    return " or ".join(f"({t})" for t in tests)


def _specialized(ev: Event, lane: bool = False) -> Any:
    """:meth:`Event.match` for ``ev`` alone, its tests and nodes written out (no loop over operand kinds).

    Generated once per event, the first time it replays, as ``dataclasses`` writes its
    methods: every value the code compares with or builds from is a name bound in its
    namespace (never text spliced into the source), except operand positions and node ids.
    ``lane=True``: :attr:`Event.lane`'s match (the same tests; it appends the leaves' values
    to ``vals`` and answers True, or False).
    """
    ns: dict[str, object] = {
        "Node": Node, "Tensor": Tensor, "REGISTRY": R.REGISTRY, "same_scalar": same_scalar,
        "CONCRETE": concrete_array_type(), "device_of": device_of, "NDARRAY": np.ndarray, "EV": ev,
        "OPNAME": ev.opname, "OPDEF": ev.opdef, "ATTRS": ev.attrs, "TRACKED": ev.tracked, "MISSING": _MISSING,
        "copysign": math.copysign, "other_attrs": _other_attrs,
    }  # fmt: skip
    n = len(ev.kinds)
    names = "".join(f"o{k}, " for k in range(n))
    miss = "        return False" if lane else "        return None"
    # a lane's call gives its attributes as they are: tested here, not keyed first (most calls give a few plain
    # ones, which a key's sort and typed copy cost more than the rest of the match)
    differ = f"({_attr_tests(cast(tuple[tuple[object, ...], ...], ev.attrs), ns)})" if lane else "attrs != ATTRS"
    body = [
        f"    if opname != OPNAME or tracked is not TRACKED or {differ} or len(operands) != {n}:",
        miss,
        "    if REGISTRY.get(opname) is not OPDEF:  # redefined since",
        miss,
    ]
    if n:
        body.append(f"    {names}= operands")
    for k, (kind, r) in enumerate(zip(ev.kinds, ev.refs)):
        if kind == TENSOR:
            body.append(f"    if type(o{k}) is not Tensor or o{k}.id != {int(cast(int, r))}:")
        elif kind == PARAM:
            ns[f"P{k}"], ns[f"S{k}"], ns[f"T{k}"] = r, ev.storages[k], ev.trainable[k]
            body.append(
                f"    if o{k} is not P{k}() or (s{k} := o{k}.storage) is not S{k}() or o{k}.trainable is not T{k}:"
            )
        elif kind == ARRAY:
            ns[f"R{k}"] = r
            body.append(
                f"    if type(o{k}) is not CONCRETE or (o{k}.shape, o{k}.dtype) != R{k} or device_of(o{k}) is not device:"
            )
        elif kind == HOST:
            ns[f"R{k}"] = r
            body.append(f"    if type(o{k}) is not NDARRAY or (o{k}.shape, o{k}.dtype) != R{k} or host is None:")
        else:
            ns[f"R{k}"], ns[f"K{k}"] = r, type(r)
            body.append(
                f"    if type(o{k}) is not K{k} or o{k} != R{k} or (o{k} == 0 and not same_scalar(o{k}, R{k})):"
            )
        body.append(miss)
    # a NumPy operand's leaf value, made (and its ids checked: this may raise) once every test has passed
    body += [f"    h{k} = host(EV, {k}, o{k})" for k, kind in enumerate(ev.kinds) if kind == HOST]
    nodes: list[str] = []
    uses: list[str] = []
    values: list[str] = []
    for j, (code, args, k) in enumerate(ev.plan):
        ns[f"A{j}"] = args
        if code == _OP:
            nodes.append(f"Node(*A{j})")
        elif code == _USE:
            uses.append(f"({j}, o{k})")
            nodes.append(f"Node(None, (), (), s{k}.read(device), *A{j})")
            values.append(f"s{k}.read(device)")
        elif code == _ARR:
            v = f"h{k}" if ev.kinds[k] == HOST else f"o{k}"
            nodes.append(f"Node(None, (), (), {v}, *A{j})")
            values.append(v)
        else:
            ns[f"C{j}"], ns[f"V{j}"] = args[3], args[3].value
            nodes.append(f"C{j}")
            values.append(f"V{j}")
    if lane:
        # every value is read before ``vals`` changes (a read that raises leaves the lane as it was)
        if len(values) == 1:
            body.append(f"    vals.append({values[0]})")
        elif values:
            body.append(f"    vals.extend(({', '.join(values)},))")
        body.append("    return True")
        src = "def lane(opname, operands, attrs, tracked, device, vals, host=None):\n" + "\n".join(body) + "\n"
        exec(compile(src, f"<tapeflow lane of {ev.opname}>", "exec"), ns)
        return ns["lane"]
    body.append(f"    return [{', '.join(nodes)}], [{', '.join(uses)}]")
    src = "def replay(opname, operands, attrs, tracked, device, host=None):\n" + "\n".join(body) + "\n"
    exec(compile(src, f"<tapeflow replay of {ev.opname}>", "exec"), ns)
    return ns["replay"]


def _arguments(nd: Node, value: object) -> NodeArgs:
    """What rebuilds ``nd`` with ``value``: ``Node(*args)`` (its static part is the template's)."""
    return (nd.op, nd.attrs, nd.parents, value, nd.requires_grad, nd.shape, nd.dtype, nd.spec, nd.opdef)


class Outline:
    """The last recording of a session as events by tape position, and how far the current one matched it.

    ``keys`` are the recorded nodes' static parts (for nodes appended outside
    ``apply``); ``events[n]`` is the ``apply`` call that started at position
    ``n``. ``matched`` is the length of the current recording's prefix that
    equals the outline (the replay fast path runs only at its end).
    """

    __slots__ = ("_pending", "epoch", "events", "interned", "keys", "matched", "plan", "registered", "struct", "tape")

    def __init__(self, events: dict[NodeId, Event], keys: list[NodeKey]) -> None:
        self.events = events
        self.keys = keys
        self.matched = 0
        self.tape: Tape | None = None  # the tape value whose nodes all match (None: the current one does not)
        self.interned: list[int] = []  # the recording's lazy structure ids (of intern epoch ``epoch``)
        self.epoch = -1
        # the backward plan a backward of a whole replay of this outline used (its checks held for exactly these
        # nodes, Params and storages), and the structure it was for: what a lane's backward reuses
        self.plan: BackwardPlan | None = None
        self.struct: Structure | None = None
        # positions of Param leaves recorded outside ``apply`` (``Session.use``, ``register_parameter_leaf``): a
        # lane never matches an input there (its backward takes the plan's parameter groups as they are)
        self.registered: frozenset[NodeId] = frozenset()
        self._pending: tuple[dict[NodeId, Event], tuple[NodeId, ...]] | None = None

    @property
    def pending(self) -> tuple[NodeId, ...]:
        """The ids of the events' op nodes, in order (the pending nodes of a recording a lane replayed whole)."""
        got = self._pending
        if got is None or got[0] is not self.events:
            ids = tuple(n + len(ev.plan) - 1 for n, ev in sorted(self.events.items()))
            got = self._pending = (self.events, ids)
        return got[1]

    def follow(self, tape: Tape) -> None:
        """``tape`` is the session's tape now: extend the matched prefix over the nodes that equal the outline's."""
        n = len(tape)
        i = self.matched
        if n <= i:
            self.matched = n  # the tape went back (a failed backward put an older one back)
        else:
            keys = self.keys
            m = min(n, len(keys))
            nodes = tape.nodes
            while i < m and node_key(nodes[i]) == keys[i]:
                i += 1
            self.matched = i
        self.tape = tape if self.matched == n else None

    def start(self, tape: Tape) -> None:
        """A new recording starts on the empty ``tape``."""
        self.matched = 0
        self.tape = tape

    def structure_hint(self, n: int, epoch: int) -> list[int] | None:
        """The interned structure ids of a recording whose first ``n`` nodes all matched (None: unknown)."""
        if self.matched >= n and self.epoch == epoch and len(self.interned) >= n:
            return self.interned[:n]
        return None


def registered_outside(events: dict[NodeId, Event], params: Iterable[NodeId]) -> frozenset[NodeId]:
    """The Param leaves among ``params`` (node ids) that no event of ``events`` appended (recorded outside
    ``apply``: by ``Session.use`` or ``register_parameter_leaf``)."""
    uses = {n + j for n, ev in events.items() for j, _ in ev.uses}
    return frozenset(i for i in params if i not in uses)


class Lane:
    """A lazy recording that replays its outline while nothing reads it: values only, nodes built when read.

    While every call of a recording matches the outline, building its nodes is
    wasted work in a training loop that only steps: the program takes the leaves'
    values, and the structure is the outline's. A lane keeps just those values
    (:attr:`vals`: each input, Param use, number and array operand leaf, in node order) and how
    far it got (:attr:`pos`). The session builds the nodes (:meth:`tape`, the
    very nodes the node-by-node replay would have appended) the moment anything
    reads its tape or records what the outline does not hold, and goes on from
    there as a replay; a backward of the whole outline and the fused optimizer
    step take :meth:`values` instead. A program's result for a node
    (:meth:`fill`: the root's value) waits in :attr:`filled` until then, and is
    read from there (:meth:`Session.value <tapeflow.Session.value>`).
    """

    __slots__ = ("base", "built", "filled", "held", "outline", "pos", "starts", "uses", "vals")

    def __init__(self, outline: Outline, base: Tape) -> None:
        self.outline = outline
        self.base = base  # the empty tape the recording started on
        self.pos = 0  # how many nodes the recording holds (every one matched the outline)
        self.vals: list[Array] = []  # the leaves' values in node order
        self.filled: dict[NodeId, Array] = {}  # op nodes a program computed while the nodes were not built
        self.built: Tape | None = None
        self.starts: list[tuple[NodeId, Event]] = []  # set by tape(): the events replayed, by position
        self.uses: list[tuple[NodeId, Param]] = []  # set by tape(): the Param leaves
        # the operands of each replayed call that used a Param: this recording holds its Params (the outline
        # names them weakly), as a recording whose nodes are built does
        self.held: list[Sequence[object]] = []

    @property
    def whole(self) -> bool:
        """The recording is the whole outline (nothing built, nothing computed yet)."""
        return self.pos == len(self.outline.keys) and self.built is None and not self.filled

    def values(self) -> tuple[tuple[NodeId, ...], list[Array]] | None:
        """The pending node ids and every other node's value in node order (a program's ``given``), for a
        recording that is the whole outline; None: use :meth:`tape`."""
        return (self.outline.pending, self.vals) if self.whole else None

    def leaf_value(self, i: NodeId) -> Array:
        """The value of leaf ``i`` of a recording that is the whole outline."""
        return self.vals[i - bisect.bisect_left(self.outline.pending, i)]

    def fill(self, i: NodeId, value: Array) -> None:
        """Node ``i`` (pending) has been computed: its value, now or when the nodes are built."""
        if self.built is None:
            self.filled.setdefault(i, value)
        else:
            fill_pending(self.built, (i,), (value,))

    def tape(self) -> Tape:
        """The recording as nodes on :attr:`base` (built once: every later call returns the same tape)."""
        t = self.built
        if t is not None:
            return t
        ol, filled = self.outline, self.filled
        events, keys = ol.events, ol.keys
        vals = iter(self.vals)
        out: list[Node] = []
        starts: list[tuple[NodeId, Event]] = []
        uses: list[tuple[NodeId, Param]] = []
        n = 0  # the base is empty: node ids are outline positions
        while n < self.pos:
            ev = events.get(n)
            if ev is None:  # an input leaf
                rg, spec = keys[n][3], cast(R.Spec, keys[n][4])
                out.append(Node(None, (), (), next(vals), cast(bool, rg), spec[0], spec[1], spec))
                n += 1
                continue
            starts.append((n, ev))
            size = len(ev.plan)
            out += ev.nodes(islice(vals, size - 1), filled.get(n + size - 1, PENDING))
            uses += [(n + j, cast(Param, cast(Ref, ev.refs[k])())) for j, k in ev.uses]
            n += size
        t = self.built = append_nodes(self.base, out)
        self.starts, self.uses = starts, uses
        return t
