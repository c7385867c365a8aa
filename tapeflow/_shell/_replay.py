"""Record once, replay after: a lazy session's recording of the last step, matched op by op by the next one.

A training loop records the same ops on the same Params step after step.
While a lazy session records, each :meth:`Session.apply <tapeflow.Session.apply>`
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
its storage now, a number is the same constant, the op's node is pending. It
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

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any, cast

import jax

from .._core import _registry as R
from .._core._node import PENDING, Node
from .._core._tape import Tape
from .._core._typing import NodeId
from ._params import Param, Storage
from ._tensor import Tensor

__all__ = ["PARAM", "SCALAR", "TENSOR", "Event", "Outline", "node_key", "same_scalar"]

TENSOR, PARAM, SCALAR = 0, 1, 2
"""What an operand of an :class:`Event` was: a handle (its node id), a Param (by identity), a Python number."""

_OP, _USE, _CONST = 0, 1, 2  # what an event's appended node is: the op's node, a Param use, a number's leaf


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
    """One ``apply`` call of a lazy recording, and the nodes it appended (values left out)."""

    __slots__ = ("_fast", "attrs", "kinds", "opdef", "opname", "plan", "refs", "storages", "tracked", "trainable")

    def __init__(
        self,
        opname: str,
        opdef: R.OpDef,
        attrs: Hashable,
        kinds: tuple[int, ...],
        refs: tuple[object, ...],
        storages: tuple[Storage | None, ...],
        trainable: tuple[bool, ...],
        tracked: bool,
        plan: tuple[tuple[int, NodeArgs, int], ...],
    ) -> None:
        self.opname = opname
        self.opdef = opdef
        self.attrs = attrs  # the call's attributes as the op check keys them (typed: 1, 1.0 and True differ)
        self.kinds = kinds  # per operand: TENSOR, PARAM or SCALAR
        self.refs = refs  # per operand: the node id, the Param, the number
        self.storages = storages  # per operand: the Param's storage when recorded
        self.trainable = trainable  # per operand: the Param's trainable flag when recorded
        self.tracked = tracked  # gradients were recorded (grad_enabled and no no_grad block)
        # per appended node: (_OP, _USE or _CONST, what rebuilds it, operand): an op node's Node arguments, a
        # Param use's (requires_grad, shape, dtype, spec), a number's leaf itself (as the value argument)
        self.plan = plan
        # this event's match with its tests written out, made when it first replays (a training loop replays
        # one event per op per step)
        self._fast: Replay | None = None

    def replay(
        self, opname: str, operands: Sequence[object], attrs: Hashable, tracked: bool, device: jax.Device
    ) -> tuple[list[Node], list[tuple[int, Param]]] | None:
        """:meth:`match`: by the code generated for this event once it has replayed (the same answer, faster)."""
        fast = self._fast
        if fast is not None:
            return fast(opname, operands, attrs, tracked, device)
        got = self.match(opname, operands, attrs, tracked, device)
        if got is not None:
            self._fast = _specialized(self)
        return got

    def match(
        self, opname: str, operands: Sequence[object], attrs: Hashable, tracked: bool, device: jax.Device
    ) -> tuple[list[Node], list[tuple[int, Param]]] | None:
        """If a call of ``opname`` with these operands, attributes and context is this event again: the nodes to
        append (each Param use reads its storage now) and ``(offset, Param)`` for each Param leaf among them;
        else None (the call is recorded the normal way)."""
        if opname != self.opname or tracked is not self.tracked or attrs != self.attrs:
            return None
        if len(operands) != len(self.kinds) or R.REGISTRY.get(opname) is not self.opdef:  # or redefined since
            return None
        for o, kind, r, st, tr in zip(operands, self.kinds, self.refs, self.storages, self.trainable):
            if kind == TENSOR:
                if type(o) is not Tensor or o.id != r:
                    return None
            elif kind == PARAM:
                if o is not r or o.storage is not st or o.trainable is not tr or o.bound:  # type: ignore[attr-defined]
                    return None
            elif type(o) is not type(r) or o != r or (o == 0 and not same_scalar(o, r)):
                return None
        out: list[Node] = []
        params: list[tuple[int, Param]] = []
        for code, args, k in self.plan:  # each node from its template's arguments: only a use's value is new
            if code == _OP:
                out.append(Node(*args))
            elif code == _USE:
                p = cast(Param, operands[k])
                params.append((len(out), p))
                rg, shape, dtype, spec = args  # a leaf's
                out.append(Node(None, (), (), p.storage.read(device), rg, shape, dtype, spec))
            else:
                out.append(args[3])  # a number's constant leaf: the same immutable node
        return out, params

    @staticmethod
    def of(
        opname: str,
        opdef: R.OpDef,
        attrs: Hashable,
        operands: Sequence[object],
        tracked: bool,
        nodes: Sequence[Node],
        sources: Sequence[int],
    ) -> Event | None:
        """The event of a call whose appended ``nodes`` hold operand ``sources[j]`` (-1: the op's node); None if
        the call cannot be replayed (an operand that is neither a handle, a Param nor a Python number)."""
        kinds: list[int] = []
        refs: list[object] = []
        storages: list[Storage | None] = []
        trainable: list[bool] = []
        for o in operands:
            if type(o) is Tensor:
                kinds.append(TENSOR)
                refs.append(o.id)
            elif isinstance(o, Param):
                kinds.append(PARAM)
                refs.append(o)
                storages.append(o.storage)
                trainable.append(o.trainable)
                continue
            elif type(o) in (int, float, bool):
                kinds.append(SCALAR)
                refs.append(o)
            else:
                return None
            storages.append(None)
            trainable.append(False)
        plan = tuple(
            (_OP, _arguments(nd, PENDING), k)
            if k < 0
            else (_CONST, (None, (), (), nd, False, (), None, None, None), k)
            if kinds[k] == SCALAR
            else (_USE, (nd.requires_grad, nd.shape, nd.dtype, nd.spec), k)
            for nd, k in zip(nodes, sources)
        )
        return Event(opname, opdef, attrs, tuple(kinds), tuple(refs), tuple(storages), tuple(trainable), tracked, plan)


Replay = Callable[
    [str, Sequence[object], Hashable, bool, jax.Device], "tuple[list[Node], list[tuple[int, Param]]] | None"
]
"""An event's match: ``replay(opname, operands, attrs, tracked, device)`` as :meth:`Event.match` answers it."""


def _specialized(ev: Event) -> Replay:
    """:meth:`Event.match` for ``ev`` alone, its tests and nodes written out (no loop over operand kinds).

    Generated once per event, the first time it replays, as ``dataclasses`` writes its
    methods: every value the code compares with or builds from is a name bound in its
    namespace (never text spliced into the source), except operand positions and node ids.
    """
    ns: dict[str, object] = {
        "Node": Node, "Tensor": Tensor, "REGISTRY": R.REGISTRY, "same_scalar": same_scalar,
        "OPNAME": ev.opname, "OPDEF": ev.opdef, "ATTRS": ev.attrs, "TRACKED": ev.tracked,
    }  # fmt: skip
    n = len(ev.kinds)
    names = "".join(f"o{k}, " for k in range(n))
    body = [
        f"    if opname != OPNAME or tracked is not TRACKED or attrs != ATTRS or len(operands) != {n}:",
        "        return None",
        "    if REGISTRY.get(opname) is not OPDEF:  # redefined since",
        "        return None",
    ]
    if n:
        body.append(f"    {names}= operands")
    for k, (kind, r) in enumerate(zip(ev.kinds, ev.refs)):
        if kind == TENSOR:
            body.append(f"    if type(o{k}) is not Tensor or o{k}.id != {int(cast(int, r))}:")
        elif kind == PARAM:
            ns[f"P{k}"], ns[f"S{k}"], ns[f"T{k}"] = r, ev.storages[k], ev.trainable[k]
            body.append(
                f"    if o{k} is not P{k} or o{k}.storage is not S{k} or o{k}.trainable is not T{k} or o{k}.bound:"
            )
        else:
            ns[f"R{k}"], ns[f"K{k}"] = r, type(r)
            body.append(
                f"    if type(o{k}) is not K{k} or o{k} != R{k} or (o{k} == 0 and not same_scalar(o{k}, R{k})):"
            )
        body.append("        return None")
    nodes: list[str] = []
    uses: list[str] = []
    for j, (code, args, k) in enumerate(ev.plan):
        ns[f"A{j}"] = args
        if code == _OP:
            nodes.append(f"Node(*A{j})")
        elif code == _USE:
            uses.append(f"({j}, o{k})")
            nodes.append(f"Node(None, (), (), S{k}.read(device), *A{j})")
        else:
            ns[f"C{j}"] = args[3]
            nodes.append(f"C{j}")
    body.append(f"    return [{', '.join(nodes)}], [{', '.join(uses)}]")
    src = "def replay(opname, operands, attrs, tracked, device):\n" + "\n".join(body) + "\n"
    exec(compile(src, f"<tapeflow replay of {ev.opname}>", "exec"), ns)
    return cast(Replay, ns["replay"])


def _arguments(nd: Node, value: object) -> NodeArgs:
    """What rebuilds ``nd`` with ``value``: ``Node(*args)`` (its static part is the template's)."""
    return (nd.op, nd.attrs, nd.parents, value, nd.requires_grad, nd.shape, nd.dtype, nd.spec, nd.opdef)


class Outline:
    """The last recording of a lazy session as events by tape position, and how far the current one matched it.

    ``keys`` are the recorded nodes' static parts (for nodes appended outside
    ``apply``); ``events[n]`` is the ``apply`` call that started at position
    ``n``. ``matched`` is the length of the current recording's prefix that
    equals the outline (the replay fast path runs only at its end).
    """

    __slots__ = ("epoch", "events", "interned", "keys", "matched", "tape")

    def __init__(self, events: dict[NodeId, Event], keys: list[NodeKey]) -> None:
        self.events = events
        self.keys = keys
        self.matched = 0
        self.tape: Tape | None = None  # the tape value whose nodes all match (None: the current one does not)
        self.interned: list[int] = []  # the recording's lazy structure ids (of intern epoch ``epoch``)
        self.epoch = -1

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
