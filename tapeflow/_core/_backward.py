"""The reverse-mode sweep over a :class:`~tapeflow.Tape`: pure, and jit-compatible.

:func:`backward` walks the tape from a root node back to its leaves, calling
each op's compiled VJP from the registry; :func:`add_cotangents` is the one
place two cotangents of one node are added.

:func:`backward_graph` is the same sweep *recorded on the tape*: each VJP is
applied as the op ``"vjp"`` (whose own VJP is ``jax.vjp`` of it) and each sum
of cotangents as an ``"add"``, so the gradients are nodes that can be
differentiated again (PyTorch's ``create_graph=True``).

>>> import jax.numpy as jnp
>>> from tapeflow import leaf, record
>>> t, x = leaf(Tape.empty(), jnp.array(3.0), requires_grad=True)
>>> t, y = record(t, "mul", (x, x))
>>> t, y = record(t, "mul", (y.value, x))          # x ** 3
>>> t2, g = backward_graph(t, y.value, wrt=[x])      # g[x] is the node of 3 x ** 2
>>> float(t2[g[x]].value), float(backward(t2, g[x])[x])
(27.0, 18.0)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeAlias, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from . import _registry as R
from ._checks import is_int
from ._result import Err, TapeError
from ._tape import Node, Tape, leaf, node_id, record
from ._typing import Array, ArrayLike, AttrValue, NodeId

__all__ = [
    "Hook",
    "add_cotangents",
    "backward",
    "backward_graph",
    "first_cotangents",
    "node_cotangents",
    "pull_mask",
    "root_and_seed",
    "run_hooks",
    "sweep",
    "sweep_range",
    "wanted",
    "zeros_like_spec",
]

_add = jax.jit(jnp.add)
_ONE: dict[np.dtype, np.ndarray] = {}

C = TypeVar("C")
"""A cotangent: an array (:func:`backward`) or the node id holding it (:func:`backward_graph`)."""

Hook: TypeAlias = Callable[[C], "C | None"]
"""``hook(cotangent) -> replacement | None``, called once with a node's complete cotangent."""

GraphHook: TypeAlias = Callable[[Tape, NodeId], "tuple[Tape, NodeId] | None"]
"""A hook of :func:`backward_graph`: ``(tape, cotangent id) -> (tape, replacement id) | None``."""


def add_cotangents(a: Array, b: Array) -> Array:
    """``a + b`` for two cotangents of one node: a compiled add, or NumPy's for exact rationals."""
    if isinstance(a, np.ndarray) and a.dtype == R.OBJECT:
        return a + b
    return _add(a, b)


def run_hooks(hooks: Sequence[Hook[C]], g: C, what: str) -> C:
    """Pass the cotangent ``g`` of ``what`` through ``hooks`` in order; one returning a value replaces it.

    A replacement must have ``g``'s shape and dtype (and be an array when ``g`` is
    one, a Tensor when ``g`` is one); anything else is a :class:`TapeError`.

    >>> import jax.numpy as jnp
    >>> run_hooks([lambda g: None, lambda g: 2 * g], jnp.ones(2), "x").tolist()
    [2.0, 2.0]
    """
    for h in tuple(hooks):
        r = h(g)
        if r is None:
            continue
        shape, dtype = tuple(getattr(r, "shape", ())), getattr(r, "dtype", None)
        if type(r) is not type(g) and not (isinstance(r, jax.Array) and isinstance(g, (jax.Array, np.ndarray))):
            raise TapeError(
                f"hook {h!r} on {what} returned a {type(r).__name__}; return None or a replacement of the same "
                f"kind as the cotangent it got ({type(g).__name__})"
            )
        if shape != tuple(g.shape) or np.dtype(dtype) != np.dtype(g.dtype):  # type: ignore[attr-defined]
            raise TapeError(
                f"hook {h!r} on {what} returned shape {shape} {dtype}; the cotangent is "
                f"{tuple(g.shape)} {g.dtype}: return None or an array of that shape and dtype"  # type: ignore[attr-defined]
            )
        g = r
    return g


def zeros_like_spec(spec: R.Spec) -> Array:
    """Zeros of ``spec``'s shape and dtype: exact rational zeros for the object dtype, else a ``jax.Array``."""
    shape, dtype = spec
    if dtype == R.OBJECT:
        from fractions import Fraction

        z = np.empty(shape, dtype=object)
        z[...] = Fraction(0)
        return z
    return jnp.zeros(shape, dtype)


def root_and_seed(tape: Tape, root: object, seed: ArrayLike | None) -> tuple[int, Array]:
    """Validate ``root`` (a node id or ``Ok``) and ``seed``; the seed defaults to 1 for a scalar root."""
    root = node_id(tape, root, "backward", "root")
    rnode = tape[root]
    if seed is None:
        if rnode.shape != ():
            raise TapeError(
                f"backward: root #{root} has shape {rnode.shape}; a non-scalar root needs an explicit "
                "seed (a cotangent of the same shape), e.g. backward(tape, root, seed=jnp.ones(shape))"
            )
        if rnode.dtype == R.OBJECT:
            from fractions import Fraction

            return root, np.asarray(Fraction(1), dtype=object)
        one = _ONE.get(rnode.dtype)
        if one is None:  # NumPy, not jnp: also safe to reuse when backward runs under jit
            one = _ONE[rnode.dtype] = np.ones((), rnode.dtype)
        return root, one
    if tuple(np.shape(seed)) != rnode.shape:
        raise TapeError(f"backward: seed has shape {tuple(np.shape(seed))} but root #{root} has shape {rnode.shape}")
    if not (isinstance(seed, np.ndarray) and seed.dtype == R.OBJECT):
        seed = jnp.asarray(seed, rnode.dtype)
    return root, seed


def wanted(tape: Tape, wrt: Iterable[NodeId] | None) -> set[int] | None:
    if wrt is None:
        return None
    n, want = len(tape), set()
    for w in wrt:
        if not is_int(w) or not 0 <= int(w) < n:
            raise TapeError(f"backward: wrt id {w!r} is out of range for a tape of {n} node(s)")
        want.add(int(w))
    return want


def sweep(
    nodes: Sequence[Node],
    root: int,
    seed: C,
    want: set[int] | None,
    pull: Callable[[int, Node, C, tuple[bool, ...]], Sequence[C]],
    add: Callable[[C, C], C],
    hooks: Mapping[NodeId, Sequence[Hook[C]]] | None,
) -> dict[NodeId, C]:
    """The one reverse sweep: ``pull(i, node, g, mask)`` gives the masked parents' cotangents, ``add`` sums two.

    Each node's cotangent is complete when the sweep reaches it (every consumer
    has a larger id); its hooks then see it, in registration order, and may
    replace it. Interior cotangents are dropped once the sweep has passed them.
    """
    result: dict[NodeId, C] = {}
    cot = first_cotangents(nodes, root, seed, want)
    sweep_range(nodes, root, 0, cot, result, want, pull, add, hooks)
    return result


def first_cotangents(nodes: Sequence[Node], root: int, seed: C, want: set[int] | None) -> dict[NodeId, C]:
    """The cotangents a sweep from ``root`` starts with: the seed, unless nothing asks for the root's."""
    return {root: seed} if nodes[root].requires_grad or (want and root in want) else {}


def sweep_range(
    nodes: Sequence[Node],
    hi: int,
    lo: int,
    cot: dict[NodeId, C],
    result: dict[NodeId, C],
    want: set[int] | None,
    pull: Callable[[int, Node, C, tuple[bool, ...]], Sequence[C]],
    add: Callable[[C, C], C],
    hooks: Mapping[NodeId, Sequence[Hook[C]]] | None,
) -> None:
    """Nodes ``hi`` down to ``lo`` of :func:`sweep`: pops their cotangents from ``cot``, adds their parents'.

    A requested node's complete cotangent goes to ``result``. A caller that
    sweeps some stretches of the tape another way (a loop over repeated blocks:
    :mod:`tapeflow._core._blocks`) calls this for the stretches between them.
    """
    for i in range(hi, lo - 1, -1):
        if not cot:
            return
        g = cot.pop(i, None)
        if g is None:
            continue
        if hooks and i in hooks:
            for h in tuple(hooks[i]):
                r = h(g)
                if r is not None:
                    g = r  # the hook checked it
        nd = nodes[i]
        if want is None:
            if nd.op is None:
                if nd.requires_grad:
                    result[i] = g
                continue
        elif i in want:
            result[i] = g
        if nd.op is None or not nd.requires_grad:
            continue
        parents = nd.parents
        mask = pull_mask(nodes, i)
        if not any(mask):
            continue
        cts = pull(i, nd, g, mask)
        k = 0
        for p, m in zip(parents, mask):
            if not m:
                continue
            ct = cts[k]
            k += 1
            prev = cot.get(p)
            cot[p] = ct if prev is None else add(prev, ct)


def pull_mask(nodes: Sequence[Node], i: int) -> tuple[bool, ...]:
    """Which operands of op node ``i`` get a cotangent: those that require grad, less its op's ``nondiff`` ones."""
    nd = nodes[i]
    mask = tuple(nodes[p].requires_grad for p in nd.parents)
    if not any(mask):
        return mask
    d = nd.opdef  # the definition the node was recorded with, never the name's current one
    if d is None:
        raise TapeError(
            f"backward: node #{i} records op {nd.op!r}, which is not registered; record it with a registered op"
        )
    if d.nondiff:
        mask = tuple(m and j not in d.nondiff for j, m in enumerate(mask))
    return mask


def node_cotangents(
    nodes: Sequence[Node], values: Sequence[Array] | None, i: int, g: Array, mask: tuple[bool, ...]
) -> Sequence[Array]:
    """The cotangents of node ``i``'s masked operands, given its cotangent ``g``: its own ``opdef``'s VJP.

    The forward values are ``values`` (by node id), or the nodes' own when None.
    """
    nd = nodes[i]
    assert nd.opdef is not None  # the sweep pulls through op nodes only
    parents = nd.parents
    specs = tuple([(nodes[p].shape, nodes[p].dtype) for p in parents])
    fn = R.get_vjp(nd.opdef, nd.attrs, specs, mask)
    if values is None:
        return fn(g, nd.value, *[nodes[p].value for p in parents])
    return fn(g, values[i], *[values[p] for p in parents])


def backward(
    tape: Tape,
    root: int,
    seed: ArrayLike | None = None,
    wrt: Iterable[NodeId] | None = None,
    hooks: Mapping[NodeId, Sequence[Hook[Array]]] | None = None,
) -> dict[NodeId, Array]:
    """Reverse-mode sweep from node ``root``; returns ``{node_id: cotangent}``.

    * ``seed`` defaults to 1 for a scalar root; a non-scalar root needs one.
    * By default the result holds every leaf that requires grad and is reached
      from ``root``. ``wrt`` selects node ids instead (leaves or interior nodes);
      a requested node that is not reached gets zeros of its shape.
    * Cotangents of a node with several consumers are summed; the cotangent of
      an interior node is dropped as soon as the sweep has passed it.
    * ``hooks`` maps node ids to functions called with that node's complete
      cotangent before it flows on; one that returns an array replaces it.
    * Pure: works on a tape whose values are tracers inside ``jax.jit``.

    >>> import jax.numpy as jnp
    >>> from tapeflow import leaf, record
    >>> t, x = leaf(Tape.empty(), jnp.array(3.0), requires_grad=True)
    >>> t, y = record(t, "mul", (x, x))
    >>> float(backward(t, y.value)[x])
    6.0
    """
    root, seed_v = root_and_seed(tape, root, seed)
    want = wanted(tape, wrt)
    nodes = list(tape.nodes)  # a list: the sweep reads each node several times

    def pull(i: int, nd: Node, g: Array, mask: tuple[bool, ...]) -> Sequence[Array]:
        return node_cotangents(nodes, None, i, g, mask)

    result = sweep(nodes, root, seed_v, want, pull, add_cotangents, hooks)
    if want is not None:
        for w in want:
            if w not in result:
                result[w] = zeros_like_spec(nodes[w].spec)
    return result


# --------------------------------------------------------------------------- recorded backward


def _vjp_check(specs: tuple[R.Spec, ...], node_op: object, node_attrs: object, wrt: object, k: object) -> str | None:
    op, attrs = node_op, node_attrs
    d = node_op if isinstance(node_op, R.OpDef) else R.REGISTRY.get(op) if isinstance(op, str) else None
    if d is None:
        return f"node_op={op!r} is neither a registered op's name nor an OpDef"
    op = d.name
    n = len(specs) - 2
    if not (isinstance(wrt, tuple) and len(wrt) == n and all(type(m) is bool for m in wrt)):
        return f"wrt={wrt!r} must be a tuple of {n} bools (which operands of {op} get a cotangent)"
    if type(k) is not int or not 0 <= k < sum(wrt):
        return f"k={k!r} must index one of the {sum(wrt)} cotangents of {op}"
    if not isinstance(attrs, tuple):
        return f"node_attrs={attrs!r} must be the normalized attributes of the {op} node"
    e = R.get_fwd(d, tuple(sorted({**d.defaults, **dict(attrs)}.items())), specs[2:])
    if isinstance(e, str):
        return f"the {op} node's operands or attributes are invalid: {e}"
    if specs[0] != e.spec or specs[1] != e.spec:
        want = R.fmt_spec(e.spec)
        return f"the cotangent and the output must both be {want} (the {op} node's output), got {R.describe(specs[:2])}"
    return None


@R.op(
    "vjp",
    attrs={"node_op": R.REQUIRED, "node_attrs": (), "wrt": R.REQUIRED, "k": 0},
    check=_vjp_check,
    public=False,
    precision="layout",
)
def _vjp_forward(g: Array, out: Array, *xs: Array, node_op: str | R.OpDef, node_attrs: tuple[tuple[str, AttrValue], ...], wrt: tuple[bool, ...], k: int) -> Array:  # fmt: skip
    """Cotangent ``k`` of the operands of a ``node_op`` node (attributes ``node_attrs``): one step of a recorded backward.

    ``node_op`` is the op's name, or its :class:`~tapeflow.OpDef` when the node's definition no longer holds the name.

    Its operands are the cotangent ``g`` of the node, the node's output ``out``
    and the node's operands; ``wrt`` marks the operands that get a cotangent.
    Recorded by ``backward(..., create_graph=True)``; its own VJP is ``jax.vjp``
    of this function, so a gradient can be differentiated again.
    """
    specs = tuple([(tuple(x.shape), np.dtype(x.dtype)) for x in xs])
    d = R.definition(node_op)
    full = tuple(sorted({**d.defaults, **dict(node_attrs)}.items()))  # a node's attrs are full
    return R.get_vjp(d, full, specs, wrt)(g, out, *xs)[k]


def _record(tape: Tape, op: str, ids: tuple[int, ...], **attrs: AttrValue) -> tuple[Tape, int]:
    t, r = record(tape, op, ids, **attrs)
    if isinstance(r, Err):
        raise TapeError(f"backward(create_graph=True): {r.error}")
    return t, r.value


def backward_graph(
    tape: Tape,
    root: int,
    seed: ArrayLike | None = None,
    wrt: Iterable[NodeId] | None = None,
    hooks: Mapping[NodeId, Sequence[GraphHook]] | None = None,
) -> tuple[Tape, dict[NodeId, NodeId]]:
    """:func:`backward` recorded on the tape: returns ``(new_tape, {node_id: id of its cotangent node})``.

    Same arguments and the same sums as :func:`backward`, but every VJP is
    recorded as a ``"vjp"`` node and every sum as an ``"add"`` node (the seed
    and the zeros of unreached ``wrt`` nodes as constant leaves), so the
    cotangents can be used in further ops and differentiated again. A hook
    gets ``(tape so far, cotangent id)`` and returns None or a longer tape and
    the id that replaces the cotangent. On an error it raises :class:`TapeError`; the
    ``tape`` passed in is a value and was not changed.
    """
    root, seed_v = root_and_seed(tape, root, seed)
    want = wanted(tape, wrt)
    t, seed_id = leaf(tape, seed_v)
    nodes = list(tape.nodes)  # the original tape's, as a list: the sweep reads each node several times, none it records

    def pull(i: int, nd: Node, g: int, mask: tuple[bool, ...]) -> Sequence[int]:
        nonlocal t
        assert nd.opdef is not None
        ref = R.reference(nd.opdef)
        out = []
        for k in range(sum(mask)):
            t, c = _record(t, "vjp", (g, i, *nd.parents), node_op=ref, node_attrs=nd.attrs, wrt=mask, k=k)
            out.append(c)
        return out

    def add(a: int, b: int) -> int:
        nonlocal t
        t, c = _record(t, "add", (a, b))
        return c

    def on_tape(h: GraphHook) -> Hook[int]:
        def call(gid: int) -> int | None:
            nonlocal t
            r = h(t, gid)
            if r is None:
                return None
            t, new = r
            return new

        return call

    wrapped = {i: [on_tape(h) for h in hs] for i, hs in hooks.items()} if hooks else None
    result = sweep(nodes, root, seed_id, want, pull, add, wrapped)
    if want is not None:
        for w in sorted(want - set(result)):
            t, result[w] = leaf(t, zeros_like_spec(nodes[w].spec))
    return t, result
