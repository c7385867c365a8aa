"""Recorded nodes: :class:`Node`, the :data:`PENDING` marker of a lazy value, and :class:`NodeView`.

A :class:`~tapeflow.Tape` is a sequence of nodes; ``tape.nodes`` is a
:class:`NodeView` of exactly its own nodes, read-only and made without a copy.

>>> import jax.numpy as jnp, tapeflow as tfl
>>> t, x = tfl.leaf(tfl.Tape.empty(), jnp.ones(2), requires_grad=True)
>>> t.nodes[x]
Node(leaf, float32[2], requires_grad=True)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice
from typing import TypeAlias, overload

import numpy as np

from . import _registry as R
from ._checks import is_int
from ._typing import Array, Attrs, Shape

__all__ = ["PENDING", "Node", "NodeMeta", "NodeView"]

NodeMeta: TypeAlias = tuple[str | None, Attrs, tuple[int, ...], bool, Shape, np.dtype, "R.OpDef | None"]
"""A node's static part: ``(op, attrs, parents, requires_grad, shape, dtype, opdef)``."""


class _Pending:
    """The value of a node a lazy session recorded but has not computed yet (see ``tapeflow._shell._lazy``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<pending>"


PENDING: Array = _Pending()  # one marker object in a node's value slot: ``node.value is PENDING``


class Node:
    """One recorded value: a leaf (``op is None``) or the output of an op.

    ``op``, ``attrs``, ``parents``, ``requires_grad``, ``shape``, ``dtype`` and
    ``opdef`` are static (they are part of the tape's pytree structure); ``value``
    is the array. ``opdef`` is the :class:`~tapeflow.OpDef` the node was recorded
    with (None for a leaf): its forward, VJP and tangent are what computes and
    differentiates the node, even after ``op`` was redefined (``replace=True``)
    or unregistered. Left out, it is the op registered as ``op`` now.
    """

    __slots__ = ("attrs", "dtype", "op", "opdef", "parents", "requires_grad", "shape", "spec", "value")

    def __init__(
        self,
        op: str | None,
        attrs: Attrs,
        parents: tuple[int, ...],
        value: Array,
        requires_grad: bool,
        shape: tuple[int, ...],
        dtype: np.dtype,
        spec: R.Spec | None = None,
        opdef: R.OpDef | None = None,
    ) -> None:
        self.op = op
        self.opdef = R.REGISTRY.get(op) if opdef is None and op is not None else opdef
        self.attrs = attrs
        self.parents = parents
        self.value = value
        self.requires_grad = requires_grad
        self.shape = shape
        self.dtype = dtype
        self.spec: R.Spec = (shape, dtype) if spec is None else spec  # (shape, dtype), the cache-key part

    @property
    def meta(self) -> NodeMeta:
        """The static part of the node (its share of the tape's pytree structure)."""
        return (self.op, self.attrs, self.parents, self.requires_grad, self.shape, self.dtype, self.opdef)

    def __repr__(self) -> str:
        what = "leaf" if self.op is None else f"{self.op}{self.parents}"
        return f"Node({what}, {R.fmt_spec(self.spec)}, requires_grad={self.requires_grad})"


class NodeView(Sequence[Node]):
    """The nodes of one tape value (``tape.nodes``): read-only, ``len(tape)`` long, made in O(1) without a copy.

    ``view[i]`` is ``tape[i]`` (``i`` is a node id, so a negative one is out of
    range); a slice gives a new list. Later tapes that share the buffer add
    nodes the view never shows.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> t, x = tfl.leaf(tfl.Tape.empty(), jnp.ones(2))
    >>> t, y = tfl.record(t, "exp", (x,))
    >>> nodes = t.nodes
    >>> len(nodes), nodes[1].parents, [nd.op for nd in nodes[:1]]
    (2, (0,), [None])
    """

    __slots__ = ("_n", "_nodes")

    def __init__(self, nodes: list[Node], n: int) -> None:
        self._nodes = nodes  # a buffer the tape shares with its continuations: only the first n are its own
        self._n = n

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> Node: ...
    @overload
    def __getitem__(self, i: slice) -> list[Node]: ...
    def __getitem__(self, i: int | slice) -> Node | list[Node]:
        if type(i) is int and 0 <= i < self._n:
            return self._nodes[i]
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)
            if step == 1:
                return self._nodes[start:stop]
            return [self._nodes[k] for k in range(start, stop, step)]  # indices() gave in-range ids
        if not is_int(i) or not 0 <= int(i) < self._n:
            raise IndexError(f"node id {i!r} is out of range for a tape of {self._n} node(s)")
        return self._nodes[int(i)]  # a NumPy integer id

    def __iter__(self) -> Iterator[Node]:
        return islice(self._nodes, self._n)

    def __repr__(self) -> str:
        return f"NodeView(len={self._n})"
