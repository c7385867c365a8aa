"""Repeated blocks traced once: a stretch of a recording that repeats one block of ops runs block by block.

A transformer's blocks, a ResNet stage's blocks, an unrolled recurrence: the
recording holds the same ops, attributes, shapes and wiring once per block,
only over other Params. Traced unrolled, every copy is traced and lowered
again. :func:`find_runs` finds such a *run* of ``blocks`` blocks of ``length``
nodes in a recording; :class:`Forward` computes it by one traced function of
the block (``jax.jit`` of it, traced once), called once per block, and
:func:`backward` sweeps it back by one traced function of the block's reverse
sweep, each node differentiated by its own op's VJP exactly as
:func:`tapeflow._core._backward.backward` does unrolled. The model's code is
not touched; nothing of it is restructured.

A block ``k`` reads three kinds of values: its own nodes, the nodes of block
``k - 1`` (the *carries*: block 0 reads the nodes before the run that play
their part) and nodes before the run that every block reads (*shared*: a
mask, a position table). A recording is run block by block only where every
block is wired the same way, so the calls compute what the unrolled program
computes, op for op; XLA inlines them before it optimizes, so the program is
the unrolled one bit for bit, and XLA's own compile is as long as before.

Lazy sessions' programs use it (:mod:`tapeflow._shell._lazy`) unless
:func:`set_block_loops` turned it off (or ``TAPEFLOW_BLOCK_LOOPS=0``).

>>> import jax.numpy as jnp
>>> from tapeflow import leaf, record
>>> t, x = leaf(Tape.empty(), jnp.ones(3), requires_grad=True)
>>> pending = set()
>>> for k in range(4):                       # 4 blocks: a weight, then 8 ops
...     t, w = leaf(t, jnp.full(3, k + 1.0), requires_grad=True)
...     for op, args in [("mul", "xw"), ("tanh", "x")] * 4:
...         t, r = record(t, op, tuple(x if a == "x" else w for a in args))
...         x = r.value
...         pending.add(x)
>>> [(r.start, r.length, r.blocks, r.carries) for r in find_runs(list(t.nodes), pending)]
[(1, 9, 4, (8,))]
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Sequence
from typing import NamedTuple

import jax
import numpy as np

from . import _env
from . import _registry as R
from ._backward import (
    add_cotangents,
    first_cotangents,
    node_cotangents,
    pull_mask,
    root_and_seed,
    sweep_range,
    wanted,
    zeros_like_spec,
)
from ._backward import backward as tape_backward
from ._node import Node
from ._tape import Tape, node_kernel
from ._typing import Array, ArrayLike, NodeId

__all__ = [
    "MIN_BLOCK_OPS",
    "Forward",
    "Run",
    "backward",
    "block_loops_enabled",
    "computed_backward",
    "find_runs",
    "set_block_loops",
]

MIN_BLOCK_OPS = 8
"""The fewest ops a block must have to be run as one function: a transformer or a ResNet block, not a stack of
two-op layers (a small MLP), whose unrolled program traces fast anyway."""

_MAX_VERIFIED = 64  # candidate runs checked for their wiring per recording (the best ones first)
_MAX_SHIFTS = 64  # where a block may start within a candidate's first period

IN, CARRY, SHARED = 0, 1, 2
"""What an operand of a block's node is: a node of the same block, of the block before, or before the run."""

_enabled = _env.switch("TAPEFLOW_BLOCK_LOOPS", True)


def set_block_loops(enabled: bool) -> bool:
    """Trace repeated blocks once in programs built from now on (on by default); returns the previous setting.

    With it on, a lazy session's program computes a stretch of the recording
    that repeats one block of ops over other Params (a transformer's blocks) by
    one traced function of the block, called per block, forward and backward;
    off, every block is traced again. The results are the same bit for bit.
    ``TAPEFLOW_BLOCK_LOOPS=0`` starts a process with it off.

    >>> import tapeflow as tfl
    >>> before = tfl.set_block_loops(False)
    >>> tfl.set_block_loops(before)
    False
    """
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"set_block_loops: expected True or False, got {enabled!r}")
    old, _enabled = _enabled, enabled
    return old


def block_loops_enabled() -> bool:
    """Whether programs built now trace repeated blocks once (:func:`set_block_loops`)."""
    return _enabled


class Run(NamedTuple):
    """``blocks`` blocks of ``length`` nodes from node ``start``, each wired as ``links`` says.

    ``links[j]`` gives, per operand of the block's node ``j``, ``(IN, position)``,
    ``(CARRY, position in the block before)`` or ``(SHARED, node id)``;
    ``carries`` are the positions a block hands to the next, ``init`` the nodes
    before the run that block 0 reads in their place; ``pending[j]`` says whether
    node ``j`` is computed (else its values are given, one per block).
    """

    start: int
    length: int
    blocks: int
    links: tuple[tuple[tuple[int, int], ...], ...]
    carries: tuple[int, ...]
    init: tuple[int, ...]
    pending: tuple[bool, ...]

    @property
    def stop(self) -> int:
        """The first node after the run."""
        return self.start + self.length * self.blocks


def _link(b: int, length: int, k: int, p: int) -> tuple[int, int] | None:
    base = b + k * length
    if p >= base:
        return (IN, p - base)
    if k >= 1 and p >= base - length:
        return (CARRY, p - base + length)
    if p < b:
        return (SHARED, p)
    return None  # a node two or more blocks back: not a run


def _wiring(nodes: Sequence[Node], b: int, length: int, kmax: int, pending: Container[int]) -> Run | None:
    """The run of up to ``kmax`` blocks from ``b`` whose wiring block 1 shows (None: fewer than two blocks)."""
    if kmax < 2:
        return None
    links = []
    for j in range(length):
        wires = []
        for p in nodes[b + length + j].parents:
            lk = _link(b, length, 1, p)
            if lk is None:
                return None
            wires.append(lk)
        links.append(tuple(wires))
    carries = sorted({r for ls in links for kind, r in ls if kind == CARRY})
    init: dict[int, int] = {}
    for j, ls in enumerate(links):  # block 0: its carries come from before the run
        for (kind, r), p in zip(ls, nodes[b + j].parents):
            if (kind == IN and p != b + r) or (kind == SHARED and p != r):
                return None
            if kind == CARRY:
                src = nodes[b + r]
                if p >= b or init.setdefault(r, p) != p:
                    return None
                if nodes[p].spec != src.spec or nodes[p].requires_grad != src.requires_grad:
                    return None
    count = 2
    while count < kmax:
        base = b + count * length
        if any(
            _link(b, length, count, p) != lk for j, ls in enumerate(links) for lk, p in zip(ls, nodes[base + j].parents)
        ):
            break
        count += 1
    return Run(
        b,
        length,
        count,
        tuple(links),
        tuple(carries),
        tuple(init[r] for r in carries),
        tuple(b + j in pending for j in range(length)),
    )


def find_runs(nodes: Sequence[Node], pending: Container[int], min_ops: int = MIN_BLOCK_OPS) -> tuple[Run, ...]:
    """The runs of repeated blocks in ``nodes`` worth tracing once, in node order, none overlapping.

    A block is a stretch of nodes whose ops, attributes, specs,
    ``requires_grad`` and pending state repeat at a fixed period, wired alike in
    every block (see :class:`Run`), with at least ``min_ops`` pending ops. The
    runs that leave the fewest ops to compile are taken first.
    """
    n = len(nodes)
    if n < 2 * min_ops:
        return ()
    intern: dict[tuple[object, ...], int] = {}
    toks = np.empty(n, np.int64)
    computed = np.zeros(n + 1, np.int64)
    for i, nd in enumerate(nodes):
        a, pend = nd.attrs, i in pending
        key = (nd.opdef, R.attr_key(a) if a else a, nd.requires_grad, nd.spec, pend, len(nd.parents))
        toks[i] = intern.setdefault(key, len(intern))
        computed[i + 1] = computed[i] + pend
    candidates: list[tuple[int, int, int, int]] = []
    for length in range(min_ops, n // 2 + 1):
        same = np.concatenate(([False], toks[:-length] == toks[length:], [False]))
        edges = np.flatnonzero(np.diff(same.view(np.int8)))
        for s, e in zip(edges[::2], edges[1::2]):
            if e - s < length:
                continue
            ops = int(computed[s + length] - computed[s])  # the same for every block of a periodic stretch
            if ops < min_ops:
                continue
            end = int(e) + length  # nodes s .. end - 1 repeat with this period
            candidates.append((((end - s) // length - 1) * ops, length, int(s), end))
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    runs: list[Run] = []
    for _, length, s, end in candidates[:_MAX_VERIFIED]:
        if any(s < o.stop and o.start < end for o in runs):
            continue
        best: Run | None = None
        for b in range(s, s + min(length, _MAX_SHIFTS)):  # where a block starts: its wiring holds for the most blocks
            k = (end - b) // length
            if k < 2 or (best is not None and k <= best.blocks):
                break
            r = _wiring(nodes, b, length, k, pending)
            if r is not None and (best is None or r.blocks > best.blocks):
                best = r
        if best is not None:  # inside s .. end, which no run taken overlaps
            runs.append(best)
    return tuple(sorted(runs))


class Forward:
    """Every node's value inside a trace: pending nodes computed, each block of a run by one traced function.

    ``given`` holds the values of the nodes that are not pending, in node
    order (as :func:`tapeflow._core._tape.computed_values` takes them). A run's
    blocks are computed by one function of the block (``jax.jit`` of it, traced
    once), called once per block with that block's values.
    """

    def __init__(
        self, nodes: Sequence[Node], pending: Container[int], given: Sequence[Array], runs: Sequence[Run], where: str
    ) -> None:
        self.nodes, self.runs, self.where = nodes, tuple(runs), where
        self.values: list[Array] = []
        starts = {r.start: r for r in self.runs}
        it = iter(given)
        values = self.values
        i, n = 0, len(nodes)
        while i < n:
            run = starts.get(i)
            if run is not None:
                self._loop(run, it)
                i = run.stop
                continue
            if i in pending:
                values.append(node_kernel(nodes, i, where)(*[values[p] for p in nodes[i].parents]))
            else:
                values.append(next(it))
            i += 1

    @classmethod
    def computed(cls, nodes: Sequence[Node], runs: Sequence[Run]) -> Forward:
        """The values ``nodes`` already hold (a traced session computed each op as it recorded it), over ``runs``."""
        self = cls.__new__(cls)
        self.nodes, self.runs, self.where = nodes, tuple(runs), ""
        self.values = [nd.value for nd in nodes]
        return self

    def __getitem__(self, i: int) -> Array:
        return self.values[i]

    def carry_in(self, run: Run, k: int) -> tuple[Array, ...]:
        """The carries block ``k`` of ``run`` read: the nodes before the run for block 0, else block ``k - 1``'s."""
        if k == 0:
            return tuple(self.values[p] for p in run.init)
        base = run.start + (k - 1) * run.length
        return tuple(self.values[base + r] for r in run.carries)

    def shared(self, run: Run) -> dict[int, Array]:
        """The values of the nodes before ``run`` that every block reads."""
        return {r: self.values[r] for ls in run.links for kind, r in ls if kind == SHARED}

    def _loop(self, run: Run, given: Iterator[Array]) -> None:
        nodes, b, L, links, carries = self.nodes, run.start, run.length, run.links, run.carries
        fns = {j: node_kernel(nodes, b + j, self.where) for j in range(L) if run.pending[j]}
        shared = self.shared(run)
        names = tuple(shared)

        def block(carry: tuple[Array, ...], xs: tuple[Array, ...], ext: tuple[Array, ...]) -> tuple[Array, ...]:
            prev, outside = dict(zip(carries, carry)), dict(zip(names, ext))
            local: list[Array] = []
            it = iter(xs)
            for j in range(L):
                if j in fns:
                    local.append(fns[j](*_operands(links[j], local, prev, outside)))
                else:
                    local.append(next(it))
            return tuple(local)

        call = jax.jit(block)  # traced once, called per block: one function in the program, not one per block
        ext = tuple(shared[r] for r in names)
        carry = self.carry_in(run, 0)
        given_of = sum(not p for p in run.pending)
        for _ in range(run.blocks):
            out = call(carry, tuple(next(given) for _ in range(given_of)), ext)
            self.values.extend(out)
            carry = tuple(out[r] for r in carries)


def backward(
    tape: Tape,
    values: Forward,
    root: int,
    seed: ArrayLike | None,
    wrt: Sequence[NodeId],
) -> dict[NodeId, Array]:
    """:func:`tapeflow._core._backward.backward` of ``tape`` (a skeleton) over ``values``, a run block by block.

    Each block of a run is swept back by one traced function of the block
    (called once per block, last first). A run is swept node by node instead
    when the root is inside it or ``wrt`` asks for one of its op nodes.
    """
    root, seed_v = root_and_seed(tape, root, seed)
    want = wanted(tape, wrt)
    assert want is not None
    nodes = values.nodes

    def pull(i: int, nd: Node, g: Array, mask: tuple[bool, ...]) -> Sequence[Array]:
        return node_cotangents(nodes, values.values, i, g, mask)

    result: dict[NodeId, Array] = {}
    cot = first_cotangents(nodes, root, seed_v, want)
    hi = root
    for run in reversed(values.runs):
        if run.stop > root or any(nodes[i].op is not None for i in want if run.start <= i < run.stop):
            continue
        sweep_range(nodes, hi, run.stop, cot, result, want, pull, add_cotangents, None)
        _reverse_loop(values, run, cot, result, want)
        hi = run.start - 1
    sweep_range(nodes, hi, 0, cot, result, want, pull, add_cotangents, None)
    for w in want:
        if w not in result:
            result[w] = zeros_like_spec(nodes[w].spec)
    return result


def computed_backward(tape: Tape, root: int, seed: ArrayLike | None, wrt: Sequence[NodeId]) -> dict[NodeId, Array]:
    """:func:`tapeflow._core._backward.backward` of a recording whose every value is computed, inside a trace.

    A traced session under ``debug_nans`` (``train_step``, ``value_and_grad``)
    computes each op as it records it, so its forward is traced op by op; its
    reverse sweep is traced block by block here, each run's block by one traced
    function, unless :func:`set_block_loops` turned that off or the recording
    repeats no block.
    The cotangents are :func:`~tapeflow._core._backward.backward`'s (XLA inlines
    the calls: bit for bit).

    >>> import jax, jax.numpy as jnp
    >>> from tapeflow import leaf, record
    >>> def f(v):
    ...     t, x = leaf(Tape.empty(), v, requires_grad=True)
    ...     h = x
    ...     for k in range(3):                     # 3 blocks of 8 ops
    ...         for op in ["sin", "cos"] * 4:
    ...             t, r = record(t, op, (h,))
    ...             h = r.value
    ...     t, y = record(t, "sum", (h,))
    ...     return computed_backward(t, y.value, None, [x])[x]
    >>> bool(jnp.allclose(jax.jit(f)(jnp.ones(2)), jax.grad(lambda v: jnp.sum(
    ...     jax.lax.fori_loop(0, 12, lambda i, h: jnp.cos(jnp.sin(h)), v)))(jnp.ones(2))))
    True
    """
    nodes = list(tape.nodes)
    runs = find_runs(nodes, {i for i, nd in enumerate(nodes) if nd.op is not None}) if _enabled else ()
    if not runs:
        return tape_backward(tape, root, seed, wrt)
    return backward(tape, Forward.computed(nodes, runs), root, seed, wrt)


def _reverse_loop(
    values: Forward, run: Run, cot: dict[NodeId, Array], result: dict[NodeId, Array], want: set[int]
) -> None:
    """Sweep ``run`` back block by block (the last first): pops its nodes' cotangents, adds those of what it read."""
    nodes, b, L, K = values.nodes, run.start, run.length, run.blocks
    block = [nodes[b + j] for j in range(L)]
    links, carries = run.links, run.carries
    came = sorted({(i - b) % L for i in cot if b <= i < run.stop})  # positions something after the run read
    shared = values.shared(run)
    names = tuple(shared)
    summed = tuple(r for r in names if nodes[r].requires_grad)
    leaves = tuple(j for j in range(L) if block[j].op is None and block[j].requires_grad)
    masks = {j: pull_mask(nodes, b + j) for j in range(L) if block[j].op is not None and block[j].requires_grad}
    vjps = {
        j: R.get_vjp(block[j].opdef, block[j].attrs, tuple([nodes[p].spec for p in block[j].parents]), m)  # type: ignore[arg-type]
        for j, m in masks.items()
        if any(m)
    }

    def step(
        after: tuple[Array, ...],
        inc: tuple[Array, ...],
        vals: tuple[Array, ...],
        prev_vals: tuple[Array, ...],
        ext: tuple[Array, ...],
    ) -> tuple[tuple[Array, ...], tuple[Array, ...], tuple[Array, ...]]:
        prev, outside = dict(zip(carries, prev_vals)), dict(zip(names, ext))
        local: dict[int, Array] = dict(zip(came, inc))
        for r, g in zip(carries, after):
            _add_into(local, r, g)
        back: dict[int, Array] = {}
        acc: dict[int, Array] = {}
        got: dict[int, Array] = {}
        for j in range(L - 1, -1, -1):
            g = local.pop(j, None)
            if g is None:
                continue
            if j in leaves:
                got[j] = g
            fn = vjps.get(j)
            if fn is None:
                continue
            cts = iter(fn(g, vals[j], *_operands(links[j], vals, prev, outside)))
            for (kind, r), m in zip(links[j], masks[j]):
                if not m:
                    continue
                _add_into(local if kind == IN else back if kind == CARRY else acc, r, next(cts))
        return (
            tuple(back[r] if r in back else _zeros(block[r]) for r in carries),
            tuple(acc[r] if r in acc else _zeros(nodes[r]) for r in summed),
            tuple(got[j] if j in got else _zeros(block[j]) for j in leaves),
        )

    call = jax.jit(step)  # traced once, called per block
    ext = tuple(shared[r] for r in names)
    after = tuple(_zeros(block[r]) for r in carries)
    for k in range(K - 1, -1, -1):
        base = b + k * L
        inc = tuple(_pop_or_zeros(cot, base + j, block[j]) for j in came)
        after, parts, got = call(after, inc, tuple(values.values[base : base + L]), values.carry_in(run, k), ext)
        for r, g in zip(summed, parts):  # consumers after the run, then the later blocks, added first
            _add_into(cot, r, g)
        for j, g in zip(leaves, got):
            if base + j in want:
                result[base + j] = g
    for p, g in zip(run.init, after):
        if nodes[p].requires_grad:
            _add_into(cot, p, g)


def _operands(
    wires: tuple[tuple[int, int], ...],
    own: Sequence[Array],
    prev: dict[int, Array],
    outside: dict[int, Array],
) -> list[Array]:
    """What a block's node reads, by its ``wires``: its block's ``own`` nodes, the carries of the block before
    (``prev``) and the nodes before the run (``outside``)."""
    return [own[r] if kind == IN else prev[r] if kind == CARRY else outside[r] for kind, r in wires]


def _add_into(cot: dict[int, Array], i: int, g: Array) -> None:
    """Add the cotangent ``g`` to ``cot[i]`` (the first one is kept as it is), with the sweep's one addition."""
    prev = cot.get(i)
    cot[i] = g if prev is None else add_cotangents(prev, g)


def _zeros(nd: Node) -> Array:
    return zeros_like_spec(nd.spec)


def _pop_or_zeros(cot: dict[NodeId, Array], i: int, nd: Node) -> Array:
    g = cot.pop(i, None)
    return _zeros(nd) if g is None else g
