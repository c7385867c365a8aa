"""The immutable tape: a persistent, jit-compatible pytree of recorded nodes.

A :class:`Tape` value never changes. :func:`leaf` and :func:`record` return a new
tape that shares every earlier node with the old one. Appending is amortized
O(1): consecutive tapes share one growing node buffer, and the first append to
an *older* tape (a fork) copies the node references up to its length into a
fresh buffer, so both continuations stay valid. ``tape.nodes`` reads them
(:class:`NodeView`, no copy).

One exception, and only one: :func:`fill_pending` writes a node's value in
place. A lazy session records a node's shape and dtype with the value
:data:`PENDING`, computes it once later, and stores it there, so every tape
value sharing that node sees it; nothing else about a node ever changes.

>>> import jax.numpy as jnp, tapeflow as tfl
>>> t0 = tfl.Tape.empty()
>>> t1, x = tfl.leaf(t0, jnp.array([1.0, 2.0]), requires_grad=True)
>>> t2, r = tfl.record(t1, "mul", (x, x))
>>> len(t0), len(t1), len(t2)
(0, 1, 2)
>>> t3, bad = tfl.record(t2, "matmul", (x, x, x))
>>> t3 is t2, bad.is_ok
(True, False)
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from itertools import islice
from typing import TypeAlias, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from . import _registry as R
from . import _treescope
from ._checks import is_int
from ._device import concrete_array_type, device_of, resolve_device
from ._node import PENDING, Node, NodeMeta, NodeView
from ._result import Err, Ok, TapeError
from ._typing import Array, ArrayLike, AttrValue, DeviceLike

T = TypeVar("T")

__all__ = [
    "PENDING",
    "Node",
    "NodeView",
    "Tape",
    "append_node",
    "append_nodes",
    "append_op",
    "check_op",
    "computed_values",
    "fill_pending",
    "keep_tape_on_error",
    "kernel_failed",
    "leaf",
    "node_id",
    "node_kernel",
    "place",
    "record",
    "with_values",
]


_new_object = object.__new__


class _Buffer:
    """A node list shared by consecutive tape values; forks copy references."""

    __slots__ = ("nodes",)

    def __init__(self, nodes: list[Node]) -> None:
        self.nodes = nodes


class Tape:
    """An immutable sequence of recorded nodes; a JAX pytree whose leaves are node values.

    Build one with :meth:`Tape.empty`, then thread it through :func:`leaf` and
    :func:`record`. ``len(tape)`` is the node count, ``tape[i]`` the i-th
    :class:`Node`, ``tape.nodes`` all of them (a read-only :class:`NodeView`).
    A tape can be passed into and returned from ``jax.jit``.
    In Jupyter a tape displays as an HTML table of its nodes (``_repr_html_``);
    :meth:`to_dot` gives Graphviz text.

    >>> import jax, jax.numpy as jnp
    >>> t, x = leaf(Tape.empty(), jnp.ones(3), requires_grad=True)
    >>> t, y = record(t, "exp", (x,))
    >>> len(t), t[1].op, t[1].parents
    (2, 'exp', (0,))
    >>> len(jax.tree_util.tree_leaves(t))   # node values are the pytree leaves
    2
    """

    __slots__ = ("__weakref__", "_buf", "_n", "device")

    _buf: _Buffer
    _n: int
    device: jax.Device | None

    def __init__(self) -> None:
        raise TypeError("use Tape.empty(device=None) to create a tape")

    @classmethod
    def _make(cls, buf: _Buffer, n: int, device: jax.Device | None) -> Tape:
        t = object.__new__(cls)
        t._buf = buf
        t._n = n
        t.device = device
        return t

    @classmethod
    def empty(cls, device: DeviceLike = None) -> Tape:
        """A tape with no nodes whose leaves are placed on ``device`` (default: JAX's default).

        ``device`` is ``None``, ``"cpu"``, ``"gpu"``/``"cuda"`` or a ``jax.Device``.

        >>> Tape.empty().device is None
        True
        """
        return cls._make(_Buffer([]), 0, None if device is None else resolve_device(device))

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> Node:
        if type(i) is int and 0 <= i < self._n:
            return self._buf.nodes[i]
        return NodeView(self._buf.nodes, self._n)[i]  # the view's rule for other ids (NumPy integers, errors)

    def __iter__(self) -> Iterator[Node]:
        return islice(self._buf.nodes, self._n)

    @property
    def nodes(self) -> NodeView:
        """This tape's nodes as a read-only sequence: no copy, ``tape.nodes[i] is tape[i]``.

        >>> import jax.numpy as jnp
        >>> t, x = leaf(Tape.empty(), jnp.ones(2))
        >>> t2, y = record(t, "exp", (x,))
        >>> [nd.op for nd in t2.nodes], len(t.nodes)   # t's view stops at t's own nodes
        ([None, 'exp'], 1)
        """
        return NodeView(self._buf.nodes, self._n)

    def value(self, i: int) -> Array:
        """The forward value of node ``i``."""
        return self[i].value

    def __repr__(self) -> str:
        dev = "" if self.device is None else f", device={self.device}"
        return f"Tape(len={self._n}{dev})"

    def __treescope_repr__(
        self, path: str | None, subtree_renderer: _treescope.SubtreeRenderer
    ) -> _treescope.Rendering:
        return _treescope.render_tape(self, path, subtree_renderer)  # treescope picture (tapeflow[viz])

    def to_dot(self, labels: Mapping[int, str] | None = None, storages: Mapping[int, str] | None = None) -> str:
        """Graphviz DOT text for the tape (render with ``dot -Tsvg``).

        ``labels`` names leaves (node id -> name, e.g. a Param's name) and
        ``storages`` the storage a leaf reads (node id -> storage label): each
        storage is drawn once, as a cylinder, with a dashed edge from every leaf
        that reads it pointing into it: the way its gradient flows, the leaves'
        cotangents into the storage. A storage read by more than one leaf is
        *tied*, its edges say "cotangents summed" and its leaves are marked
        ``tied``. A legend then tells the solid arrows (values, forward) from
        the dashed ones (cotangents, backward).
        :meth:`Session.to_dot <tapeflow.Session.to_dot>` fills both from its
        Params.

        >>> import jax.numpy as jnp
        >>> t, x = leaf(Tape.empty(), jnp.ones(2, "float32"), requires_grad=True)
        >>> t, r = record(t, "exp", (x,))
        >>> print(t.to_dot().splitlines()[0])
        digraph tape {
        >>> dot = t.to_dot(labels={0: "W"}, storages={0: "W storage"})
        >>> print([ln for ln in dot.splitlines() if ln.startswith("  n0 [")][0])
          n0 [label="#0 leaf W\\nfloat32[2]", style=filled, fillcolor="#e8f0fe"];
        """
        labels = labels or {}
        storages = storages or {}
        readers = _treescope.storage_readers(storages)
        tied = {i for ids in readers.values() if len(ids) > 1 for i in ids}
        lines = [
            "digraph tape {",
            "  rankdir=LR;",
            '  node [shape=box, fontname="monospace", fontsize=14];',
            '  edge [fontname="monospace", fontsize=14];',
        ]
        for i, nd in enumerate(self):
            what = "leaf" if nd.op is None else nd.op
            name = labels.get(i)
            head = f"#{i} {what}" + ("" if name is None else f" {_dot_escape(name)}") + (" (tied)" if i in tied else "")
            style = ', style=filled, fillcolor="#e8f0fe"' if nd.requires_grad else ""
            lines.append(f'  n{i} [label="{head}\\n{R.fmt_spec(nd.spec)}"{style}];')
            for p in nd.parents:
                lines.append(f"  n{p} -> n{i};")
        for k, (storage, ids) in enumerate(readers.items()):
            lines.append(f'  s{k} [label="{_dot_escape(storage)}", shape=cylinder, style=filled, fillcolor="#fde7d9"];')
            note = ', label="cotangents summed"' if len(ids) > 1 else ""
            for i in ids:
                # dir=back: the arrow points into the storage (backward) while the storage stays
                # ranked above the leaves that read it (forward)
                lines.append(f'  s{k} -> n{i} [dir=back, style=dashed, color="#c2410c"{note}];')
        if readers:
            lines.append(
                '  legend [shape=note, color="#888888", label="solid arrows: values, forward\\l'
                'dashed arrows: cotangents, backward,\\linto the storage a leaf read\\l"];'
            )
            lines.append("  {rank=same; s0; legend;}")
        lines.append("}")
        return "\n".join(lines)

    def _repr_html_(
        self, limit: int = 20, labels: Mapping[int, str] | None = None, storages: Mapping[int, str] | None = None
    ) -> str:
        """Rich display in Jupyter: an HTML table of the nodes (the first and last ``limit`` of a long tape).

        ``labels`` and ``storages`` are :meth:`to_dot`'s: given, the table has a
        ``name`` and a ``storage`` column (a storage read by two leaves: ``tied``).

        >>> import jax.numpy as jnp
        >>> t, x = leaf(Tape.empty(), jnp.ones(2), requires_grad=True)
        >>> "<td>W</td><td>W storage</td>" in t._repr_html_(labels={0: "W"}, storages={0: "W storage"})
        True
        """
        from html import escape

        n = self._n
        named = bool(labels or storages)
        labels = labels or {}
        storages = storages or {}
        readers = _treescope.storage_readers(storages)
        ids = list(range(n)) if n <= 2 * limit else list(range(limit)) + [-1] + list(range(n - limit, n))
        dev = "" if self.device is None else f", device={self.device}"
        extra = "<th>name</th><th>storage</th>" if named else ""
        rows = [
            f"<table><caption>Tape: {n} node{'' if n == 1 else 's'}{escape(dev)}</caption>",
            f"<tr><th>id</th><th>op</th>{extra}<th>parents</th><th>shape/dtype</th><th>requires_grad</th></tr>",
        ]
        nodes = self._buf.nodes
        for i in ids:
            if i < 0:
                rows.append(f'<tr><td colspan="{7 if named else 5}">&hellip; {n - 2 * limit} more &hellip;</td></tr>')
                continue
            nd = nodes[i]
            op = "leaf" if nd.op is None else nd.op
            parents = ", ".join(map(str, nd.parents))
            cells = ""
            if named:
                st = storages.get(i)
                st_text = "" if st is None else st + (" (tied)" if len(readers[st]) > 1 else "")
                cells = f"<td>{escape(labels.get(i, ''))}</td><td>{escape(st_text)}</td>"
            rows.append(
                f"<tr><td>{i}</td><td>{escape(op)}</td>{cells}<td>{parents}</td>"
                f"<td>{escape(R.fmt_spec(nd.spec))}</td><td>{nd.requires_grad}</td></tr>"
            )
        rows.append("</table>")
        return "\n".join(rows)


def _dot_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def computed_values(nodes: Sequence[Node], pending: Container[int], given: Iterable[Array], where: str) -> list[Array]:
    """Every node's value: a ``pending`` node's computed from its parents with its own ``opdef``, the others from ``given``.

    ``given`` holds the values of the nodes that are not pending, in node
    order. Runs eagerly, or inside a trace (a lazy program). A node that can no
    longer be computed raises :class:`TapeError` naming ``where``.

    >>> import jax.numpy as jnp
    >>> t, x = leaf(Tape.empty(), jnp.ones(2))
    >>> t, y = record(t, "exp", (x,))
    >>> [v.tolist() for v in computed_values(list(t.nodes), {1}, [jnp.zeros(2)], "doc")]
    [[0.0, 0.0], [1.0, 1.0]]
    """
    values: list[Array] = []
    it = iter(given)
    for i, nd in enumerate(nodes):
        if i in pending:
            values.append(node_kernel(nodes, i, where)(*[values[p] for p in nd.parents]))
        else:
            values.append(next(it))
    return values


def node_kernel(nodes: Sequence[Node], i: int, where: str) -> Callable[..., Array]:
    """The compiled forward of op node ``i`` (its own ``opdef``'s, for its parents' specs), taking their values.

    A node that can no longer be computed raises :class:`TapeError` naming ``where``.

    >>> import jax.numpy as jnp
    >>> t, x = leaf(Tape.empty(), jnp.ones(2))
    >>> t, y = record(t, "exp", (x,))
    >>> node_kernel(list(t.nodes), 1, "doc")(jnp.zeros(2)).tolist()
    [1.0, 1.0]
    """
    nd = nodes[i]
    assert nd.opdef is not None
    entry = R.get_fwd(nd.opdef, nd.attrs, tuple([nodes[p].spec for p in nd.parents]))  # its own definition
    if isinstance(entry, str):
        raise TapeError(f"{where}: cannot compute node #{i}: {nd.op}: {entry}")
    return entry.fn


def with_values(tape: Tape, values: Sequence[Array | None]) -> Tape:
    """A tape with ``tape``'s nodes (ops, attributes, parents, specs) holding ``values`` instead.

    A lazy session's programs rebuild a recording this way: with ``None`` values
    (the structure they keep) and with the values they trace.

    >>> import jax.numpy as jnp
    >>> t, x = leaf(Tape.empty(), jnp.ones(2))
    >>> with_values(t, [jnp.zeros(2)])[0].value.tolist()
    [0.0, 0.0]
    """
    nodes = [
        Node(nd.op, nd.attrs, nd.parents, v, nd.requires_grad, nd.shape, nd.dtype, nd.spec, nd.opdef)
        for nd, v in zip(tape, values, strict=True)
    ]
    return Tape._make(_Buffer(nodes), tape._n, tape.device)


_Aux: TypeAlias = "tuple[jax.Device | None, tuple[NodeMeta, ...]]"
"""A tape's pytree structure: its device and each node's static part."""


def _flatten(t: Tape) -> tuple[list[Array], _Aux]:
    nodes = t._buf.nodes
    n = t._n
    return [nodes[i].value for i in range(n)], (t.device, tuple(nodes[i].meta for i in range(n)))


def _unflatten(aux: _Aux, values: Iterable[Array]) -> Tape:
    device, metas = aux
    out: list[Node] = []
    for (op, attrs, parents, rg, shape, dtype, opdef), v in zip(metas, values):
        out.append(Node(op, attrs, parents, v, rg, shape, dtype, None, opdef))
    return Tape._make(_Buffer(out), len(out), device)


jax.tree_util.register_pytree_node(Tape, _flatten, _unflatten)


# --------------------------------------------------------------------------- recording


def _append(tape: Tape, node: Node) -> Tape:
    """``tape`` with ``node`` appended (unchecked: the last step of every append)."""
    buf = tape._buf
    n = tape._n
    nodes = buf.nodes
    # Lock-free: list.append is atomic, and the append that lands in slot n owns
    # it. Whoever finds another node there (a concurrent continuation of the same
    # tape) or finds the buffer already longer (an older tape) forks instead.
    if len(nodes) == n:
        nodes.append(node)
        if nodes[n] is not node:
            buf = _Buffer(nodes[:n] + [node])
    else:
        buf = _Buffer(nodes[:n] + [node])
    t = _new_object(Tape)  # Tape._make, inlined (this is on the per-op hot path)
    t._buf = buf
    t._n = n + 1
    t.device = tape.device
    return t


def append_node(tape: Tape, node: Node) -> tuple[Tape, int]:
    """Append a :class:`Node` built by the caller, as it is; returns ``(new_tape, node_id)``.

    :func:`leaf` and :func:`record` check and convert what they append; this (for
    a session's leaves, whose values it placed itself) checks only that ``node``
    is a Node whose parents are ids of ``tape``.

    >>> import jax.numpy as jnp, numpy as np
    >>> v = jnp.ones(2)
    >>> t, i = append_node(Tape.empty(), Node(None, (), (), v, True, (2,), np.dtype("float32")))
    >>> i, t[i].requires_grad
    (0, True)
    """
    if type(node) is not Node:
        raise TypeError(
            f"append_node: expected a Node, got {type(node).__name__}; build a Node, or append a value with leaf()"
        )
    n = tape._n
    if node.parents and not all(type(p) is int and 0 <= p < n for p in node.parents):
        raise TapeError(
            f"append_node: {node!r} has parents {node.parents} but the tape has {n} node(s); "
            "a node's parents are ids of nodes already on the tape"
        )
    return _append(tape, node), n


def append_nodes(tape: Tape, nodes: Sequence[Node]) -> Tape:
    """``tape`` with ``nodes`` appended as they are, unchecked: the caller built them for exactly this tape.

    For a lazy session's replayed recording (:mod:`tapeflow._shell._replay`), whose
    nodes repeat ones recorded and checked at the same positions before; every
    other caller appends with :func:`append_node`, :func:`leaf` or :func:`record`.
    """
    buf = tape._buf
    m = tape._n
    lst = buf.nodes
    for k, nd in enumerate(nodes):  # as _append: the append that lands in slot m owns it, else fork
        if len(lst) == m:
            lst.append(nd)
            if lst[m] is nd:
                m += 1
                continue
        buf = _Buffer(lst[:m] + list(nodes[k:]))
        m += len(nodes) - k
        break
    t = _new_object(Tape)
    t._buf = buf
    t._n = m
    t.device = tape.device
    return t


def fill_pending(tape: Tape, ids: Sequence[int], values: Sequence[Array]) -> None:
    """Store ``values[k]`` in node ``ids[k]`` of ``tape`` where it still waits for its value: the one in-place write.

    A node waits while it holds :data:`PENDING` (a lazy session recorded it
    and a program has computed it now) or the NumPy copy of a lazy session's
    host input (``values`` then holds it as a ``jax.Array``). Every tape value
    that shares the node sees the value from then on, so a value is computed
    once. A node that holds its value already keeps it. A value whose shape or
    dtype is not its node's raises :class:`TapeError`, and nothing is written.

    >>> import jax.numpy as jnp
    >>> t, x = leaf(Tape.empty(), jnp.zeros(2))
    >>> entry = check_op("exp", {}, (t[x].spec,))
    >>> t, y = append_op(t, "exp", entry, (x,), [t[x]], lazy=True)   # recorded, not computed
    >>> t[y.value].value is PENDING
    True
    >>> fill_pending(t, [y.value], [jnp.exp(t[x].value)])
    >>> t[y.value].value.tolist()
    [1.0, 1.0]
    """
    todo: list[tuple[Node, Array]] = []
    concrete = concrete_array_type()
    for i, v in zip(ids, values, strict=True):
        nd = tape[i]
        old = nd.value
        if not (old is PENDING or (type(old) is np.ndarray and nd.dtype != R.OBJECT)):
            continue
        if type(v) is concrete and v.shape == nd.shape and v.dtype == nd.dtype:  # type: ignore[attr-defined]
            # a program's output, as recorded
            todo.append((nd, v))
            continue
        spec = (tuple(np.shape(v)), np.dtype(v.dtype))
        if spec != nd.spec:
            raise TapeError(
                f"fill_pending: node #{i} ({nd!r}) cannot hold a value of {R.fmt_spec(spec)}; "
                "pass the value computed for that node"
            )
        todo.append((nd, v))
    for nd, v in todo:
        nd.value = v


def place(value: ArrayLike, device: jax.Device | None) -> Array:
    """``value`` as a tape holds it: placed on ``device``, or uncommitted on JAX's default device (None).

    The one placement rule: exact rationals (NumPy object arrays) and tracers
    stay as they are; a ``jax.Array`` already on ``device``, or sharded over
    several devices, keeps its placement; anything else is put on ``device``
    (committed), or converted with JAX's dtypes and left uncommitted on the
    default device when ``device`` is None (NumPy data by a copy, never a
    compiled program: ``jnp.asarray`` would compile one per shape). A session passes None for its
    default device, so kernels see one placement for every operand.

    >>> import numpy as np
    >>> place(np.ones(2), None).dtype, place(np.ones(2), jax.devices()[0]).committed
    (dtype('float32'), True)
    """
    if isinstance(value, np.ndarray) and value.dtype == R.OBJECT:
        return value
    if isinstance(value, jax.core.Tracer):
        return value
    if device is not None:
        if isinstance(value, jax.Array):
            d = device_of(value)
            if d == device or (d is None and len(value.devices()) > 1):  # already there, or sharded: keep its sharding
                return value
        return jax.device_put(value, device)
    if isinstance(value, jax.Array):
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        # what jnp.asarray makes of it (JAX's dtype, uncommitted) without a compiled copy per shape; copied on the
        # host first: device_put reads its source after it returned, so a caller reusing its buffer (a data
        # loader) would change what was recorded
        return jax.device_put(np.array(value))
    return jnp.asarray(value)


def leaf(tape: Tape, value: ArrayLike, requires_grad: bool = False) -> tuple[Tape, int]:
    """Append a leaf holding ``value``; returns ``(new_tape, node_id)``.

    Integer and boolean leaves never require grad, whatever ``requires_grad`` says.
    A ``value`` that is not an array of numbers (a string, an arbitrary object)
    raises ``TypeError``; ``tape`` is a value, so nothing was appended to it.

    >>> import jax.numpy as jnp
    >>> t, i = leaf(Tape.empty(), jnp.zeros(3), requires_grad=True)
    >>> i, t[i].requires_grad
    (0, True)
    >>> leaf(t, "abc")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    TypeError: leaf: 'abc' (str) is not an array of numbers; pass a NumPy ...
    """
    dev = tape.device
    if type(value) is concrete_array_type() and (dev is None or device_of(value) is dev):  # placed already
        v: Array = value
        dtype = v.dtype
        node = Node(None, (), (), v, bool(requires_grad) and R.is_float(dtype), v.shape, dtype)
        return _append(tape, node), tape._n
    try:
        v = place(value, dev)
    except TypeError:
        raise TypeError(
            f"leaf: {value!r:.80} ({type(value).__name__}) is not an array of numbers; "
            "pass a NumPy or JAX array or a Python number"
        ) from None
    dtype = np.dtype(v.dtype)
    node = Node(None, (), (), v, bool(requires_grad) and R.is_float(dtype), tuple(v.shape), dtype)
    return _append(tape, node), tape._n


def node_id(tape: Tape, i: object, where: str, what: str) -> int:
    """``i`` (an int or an ``Ok`` holding one) as a node id of ``tape``, else a TapeError naming ``where``/``what``.

    >>> import jax.numpy as jnp
    >>> t, x = leaf(Tape.empty(), jnp.ones(2))
    >>> node_id(t, Ok(x), "backward", "root")
    0
    >>> node_id(t, 3, "backward", "root")
    Traceback (most recent call last):
    tapeflow._core._result.TapeError: backward: root 3 is out of range for a tape of 1 node(s)
    """
    if isinstance(i, Ok):
        i = i.value
    if not is_int(i):
        raise TapeError(f"{where}: {what} must be a node id (int), got {i!r:.80}")
    j = int(i)  # type: ignore[call-overload]
    if not 0 <= j < tape._n:
        raise TapeError(f"{where}: {what} {j} is out of range for a tape of {tape._n} node(s)")
    return j


def _operands_note(tape: Tape, inputs: Iterable[int]) -> str:
    """`` (operands: ...)`` for an error message, or ``""`` when ``inputs`` are not all node ids."""
    try:
        ids = tuple(inputs)
        if not all(is_int(i) for i in ids):
            return ""
        return f" (operands: {R.describe(tuple(tape[i].spec for i in ids))})"
    except Exception:
        return ""


def record(tape: Tape, op: str, inputs: Sequence[int], **attrs: AttrValue) -> tuple[Tape, Ok[int] | Err]:
    """Apply registered op ``op`` to the nodes ``inputs``; returns ``(tape, Ok(id) | Err(msg))``.

    On success the tape is a new tape with one more node. On any failure
    (unknown op, wrong arity, bad node id, shape/dtype mismatch, bad attribute,
    failure of the kernel itself) the tape returned **is** ``tape`` and nothing
    was appended; this function never raises for bad input.

    >>> import jax.numpy as jnp
    >>> t, a = leaf(Tape.empty(), jnp.ones((2, 3)))
    >>> t, b = leaf(t, jnp.ones((4,)))
    >>> t2, r = record(t, "add", (a, b))
    >>> t2 is t, r.error.split(":")[0]
    (True, 'add')
    """
    nodes = tape._buf.nodes
    n = tape._n
    # Fast path: plain in-range ids and a kernel already checked and compiled for
    # this (op, attrs, shapes, dtypes). Anything else takes the checked path.
    entry = None
    ins: list[Node] = []
    if type(inputs) is tuple or type(inputs) is list:
        for i in inputs:
            if type(i) is not int or not 0 <= i < n:
                break
            ins.append(nodes[i])
        else:
            if len(ins) == 2:
                specs: tuple[R.Spec, ...] = (ins[0].spec, ins[1].spec)
            elif len(ins) == 1:
                specs = (ins[0].spec,)
            else:
                specs = tuple([nd.spec for nd in ins])
            try:
                entry = _fwd_hit((op, _attr_key(attrs.items()) if attrs else (), specs))
            except TypeError:  # unhashable attribute or op name
                entry = None
    if entry is None or entry.dtype is R.OBJECT:
        checked = _check(tape, op, inputs, attrs)
        if isinstance(checked, Err):
            return tape, checked
        ids, ins, entry = checked
    else:
        ids = tuple(inputs)
    return append_op(tape, op, entry, ids, ins)


def append_op(
    tape: Tape,
    op: str,
    entry: R.FwdEntry,
    ids: tuple[int, ...],
    ins: list[Node] | None,
    requires_grad: bool = True,
    lazy: bool = False,
) -> tuple[Tape, Ok[int] | Err]:
    """Run a checked kernel on the nodes ``ins`` (ids ``ids``; None: read them from ``tape``) and append its output node.

    ``entry`` comes from :func:`check_op` for exactly these operand specs. Only a
    failure of the kernel itself is left to report, as an ``Err`` with ``tape``
    unchanged. ``requires_grad=False`` records the node untracked (``no_grad``).
    ``lazy=True`` runs no kernel: the node's value is :data:`PENDING` until a lazy
    session computes it (its shape and dtype are known from the check).
    """
    n = tape._n
    if ins is None:
        nodes = tape._buf.nodes
        ins = [nodes[i] for i in ids]  # ids come from the caller's check: all below n
    try:
        if lazy:
            out = PENDING
        elif len(ins) == 2:
            out = entry.fn(ins[0].value, ins[1].value)
        elif len(ins) == 1:
            out = entry.fn(ins[0].value)
        else:
            out = entry.fn(*[nd.value for nd in ins])
    except Exception as e:  # a kernel failure (device, numerics of exact arrays, ...)
        return tape, Err(kernel_failed(op, ins, e))
    rg = False
    if entry.differentiable and requires_grad:
        for i in entry.diff:
            if ins[i].requires_grad:
                rg = True
                break
    if entry.dtype is R.OBJECT:
        shape = tuple(np.shape(out))
        if not isinstance(out, np.ndarray):
            out = np.asarray(out, dtype=object)
        node = Node(op, entry.attrs, ids, out, rg, shape, R.OBJECT, None, entry.opdef)
    else:
        node = Node(op, entry.attrs, ids, out, rg, entry.shape, entry.dtype, entry.spec, entry.opdef)
    return _append(tape, node), (_OKS[n] if n < _N_OKS else Ok(n))


def kernel_failed(op: str, ins: Sequence[Node], e: Exception) -> str:
    """The message of op ``op``'s kernel raising ``e`` on the operand nodes ``ins`` (every path that runs one)."""
    return f"{op}: kernel failed ({type(e).__name__}: {e}) (operands: {R.describe([nd.spec for nd in ins])})"


def _check(
    tape: Tape, op: str, inputs: Sequence[int], attrs: dict[str, AttrValue]
) -> Err | tuple[tuple[int, ...], list[Node], R.FwdEntry]:
    """Every check of ``record``, with a readable error for each failure."""
    d = R.REGISTRY.get(op) if isinstance(op, str) else None
    if d is None:
        return Err(_unknown_op(op, _operands_note(tape, inputs)))
    nodes = tape._buf.nodes
    n = tape._n
    try:
        ids = tuple(inputs)
    except TypeError:
        return Err(f"{op}: inputs must be a sequence of node ids, got {type(inputs).__name__}")
    for i in ids:
        if type(i) is not int or not 0 <= i < n:
            if is_int(i) and 0 <= int(i) < n:
                continue
            return Err(
                f"{op}: operand {i!r} is not a node id of this tape (valid ids are 0..{n - 1})"
                if n
                else f"{op}: operand {i!r} is not a node id: the tape is empty"
            )
    ids = tuple(int(i) for i in ids)
    ins = [nodes[i] for i in ids]
    entry = check_op(op, attrs, tuple([nd.spec for nd in ins]))
    if isinstance(entry, str):
        return Err(entry)
    return ids, ins, entry


def _unknown_op(op: object, operands_note: str) -> str:
    return f"unknown op {op!r}{operands_note}; registered ops: {', '.join(R.ops())}"


def check_op(op: str, attrs: dict[str, AttrValue], specs: tuple[R.Spec, ...]) -> R.FwdEntry | str:
    """The one check of an op application: name, attributes and operand specs.

    Returns the checked, compiled kernel entry, or the complete error message
    (naming the op, the problem, the fix and the operands). ``record`` and
    :meth:`Session.apply <tapeflow.Session.apply>` both call it, so an op is
    checked once and its errors read the same on both paths.

    >>> import numpy as np
    >>> check_op("add", {}, (((2,), np.dtype("float32")), ((3,), np.dtype("float32")))).split(":")[0]
    'add'
    """
    d = R.REGISTRY.get(op) if isinstance(op, str) else None
    if d is None:
        return _unknown_op(op, f" (operands: {R.describe(specs)})")
    if attrs:
        # fast path: attributes given in normalized form hit the cache as they are
        # (the key is typed: True, 1 and 1.0 never find each other's entry)
        try:
            key: tuple[object, ...] = (op, _attr_key(attrs.items()), specs)
            hit = _fwd_get(key)
        except TypeError:  # unhashable: needs normalizing
            hit = None
        if hit is not None:
            if _FWD.crowded:
                _FWD.hit(key)
            return hit
        akey = R.normalize_attrs(attrs)
        try:
            hash(akey)
        except TypeError as e:
            return f"{op}: attribute values must be hashable constants ({e}) (operands: {R.describe(specs)})"
    else:
        key = (op, (), specs)
        hit = _fwd_get(key)
        if hit is not None and not hit.runtime:
            if _FWD.crowded:
                _FWD.hit(key)
            return hit
        akey = ()
    entry = R.get_fwd(op, akey, specs)
    if type(entry) is str:
        return f"{op}: {entry} (operands: {R.describe(specs)})"
    return entry


_FWD = R.FWD_KERNELS
_fwd_hit = _FWD.hit
_fwd_get = _FWD.get  # check_op's plain dict get: it marks recency (KernelCache.hit) only while the cache is crowded
_attr_key = R.attr_key
_N_OKS = 1 << 14
_OKS = [Ok(i) for i in range(_N_OKS)]  # Ok is immutable: small results are shared


def keep_tape_on_error(
    t0: Tape, result: tuple[Tape, Ok[T] | Err] | Ok[T] | Err | Exception
) -> tuple[Tape, Ok[T] | Err]:
    """Pair a constructor's result with the tape to keep afterwards.

    On success that is the extended tape; on failure it is ``t0``, the tape the
    constructor started from, so a failed step never leaves a half-built tape::

        t, r = keep_tape_on_error(t0, record(t0, "relu", (x,)))

    ``result`` may be ``(tape, Ok | Err)``, a bare ``Err``, or an exception
    (caught by the caller), which becomes an ``Err``.

    >>> t0 = Tape.empty()
    >>> t, r = keep_tape_on_error(t0, Err("boom"))
    >>> t is t0, r
    (True, Err('boom'))
    """
    if isinstance(result, BaseException):
        return t0, Err(f"{type(result).__name__}: {result}")
    if isinstance(result, (Ok, Err)):
        return t0, result
    t, r = result
    if r.is_ok:
        return t, r
    return t0, r
