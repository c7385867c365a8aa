"""Gradients of one recording: parameter groups, per-storage sums, and buffer ownership.

This module is **the one home** of the tied-weight rule: the cotangents of all
leaves that share one :class:`~tapeflow.Storage` are summed in recording order
by :func:`sum_in_leaf_order`. ``grads[param]``, :meth:`Grads.storage_gradients`
(used by :func:`~tapeflow.value_and_grad` and :func:`~tapeflow.train_step`) and
:class:`~tapeflow.Optimizer` all reach it through :meth:`Grads.group_gradient`,
so their sums are bit-identical.

>>> import jax.numpy as jnp, tapeflow as tfl
>>> w = tfl.Param(jnp.array(2.0), name="w")
>>> w2 = tfl.tie(w, name="w2")
>>> with tfl.Session() as s:
...     g = s.backward(w * 3.0 + w2 * 4.0)     # two leaves, one storage
...     float(g[w]), [len(grp.leaves) for grp in g.groups]
(7.0, [2])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol, TypeAlias, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from .._core._backward import add_cotangents
from .._core._checks import is_number
from .._core._result import TapeError
from .._core._typing import Array, NodeId
from ._debug import NonFiniteCheck
from ._params import Param, Storage, canonical_indices
from ._tensor import Tensor

__all__ = [
    "ConsumedGradientError",
    "Grads",
    "ParameterGroup",
    "clip_grad_norm",
    "group_parameter_leaves",
    "sum_in_leaf_order",
]

ParameterRecord: TypeAlias = object
"""What a session registered for a parameter leaf: a :class:`~tapeflow.Param`, or any object for advanced registrations."""

GradKey: TypeAlias = "Param | Storage | Tensor | NodeId"
"""What ``grads[...]`` accepts: a Param or Storage (summed per storage), a Tensor handle or a node id (one leaf)."""


@dataclasses.dataclass(frozen=True)
class ParameterGroup:
    """The trainable parameter leaves of one recording that share one storage.

    ``id`` is the first leaf (the optimizer key), ``leaves`` are in recording
    order, ``parameter`` is the record used at the first leaf, ``storage`` its
    storage (None for a registration without a storage descriptor).
    """

    id: int
    parameter: ParameterRecord
    leaves: tuple[int, ...]
    storage: Storage | None

    @property
    def shared(self) -> bool:
        return len(self.leaves) > 1


def group_parameter_leaves(
    params_by_leaf: Mapping[NodeId, ParameterRecord], storage_by_leaf: Mapping[NodeId, Storage]
) -> list[ParameterGroup]:
    """Group registrations by storage identity, in recording order, without reading tensor data.

    Registrations without a storage descriptor stay separate groups.
    """
    leaf_ids = sorted(params_by_leaf)
    canon = canonical_indices([storage_by_leaf.get(i) for i in leaf_ids])
    members: dict[int, list[int]] = {}
    order: list[int] = []
    for pos, c in enumerate(canon):
        key = pos if c is None else c
        if key not in members:
            members[key] = []
            order.append(key)
        members[key].append(leaf_ids[pos])
    groups = []
    for key in order:
        leaves = members[key]
        first = leaves[0]
        groups.append(ParameterGroup(first, params_by_leaf[first], tuple(leaves), storage_by_leaf.get(first)))
    return groups


def sum_in_leaf_order(parts: Sequence[Array]) -> Array:
    """Sum the cotangents of one storage's leaves in recording order.

    A single cotangent is returned as the very same array (no copy, no add). The
    optimizer and ``grads[param]`` both use this, so their sums are bit-identical.
    """
    g = parts[0]
    for extra in parts[1:]:
        # recorded gradients (backward(create_graph=True)) are Tensors: their sum is recorded too
        g = g + extra if isinstance(g, Tensor) else add_cotangents(g, extra)
    return g


class PendingGradients(Protocol):
    """Gradients a lazy session computes on first read (:class:`tapeflow._shell._lazy.LazyGrads`)."""

    def resolve(self) -> dict[NodeId, Array]: ...


class Grads(Mapping[GradKey, Array]):
    """The result of :meth:`Session.backward`.

    * ``grads[param]``: the gradient of a :class:`Param`, summed over every leaf
      of its storage in recording order (a singleton is handed through as the
      very same array).
    * ``grads[tensor]`` / ``grads[node_id]``: the raw cotangent of one leaf.
    * ``grads.groups``: the :class:`ParameterGroup` s of the recording.
    * ``g1 + g2``, ``sum([g1, g2])``, ``g * 0.5``, ``g / k``: per-storage
      gradients added and scaled (gradient accumulation: several ``backward``
      calls, then one ``opt.step(total)``). The result is a ``Grads`` of no
      recording: one entry per storage, read with ``grads[param]``; a tied
      weight stays one entry, its uses summed.
    * :meth:`global_norm`: the L2 norm over every storage, a tied one counted once.

    It holds its buffers until released: use it as a context manager (or call
    :meth:`release`); releasing twice is safe. Releasing drops the references,
    so JAX frees every buffer nobody else holds, and never one the user kept.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> w = tfl.Param(jnp.array([1.0, 2.0]), name="w")
    >>> s = tfl.Session()
    >>> total = 0
    >>> for x in (1.0, 3.0):       # two microbatches, one step
    ...     with s:
    ...         total = total + s.backward(tfl.sum(w * x))
    >>> (total / 2)[w].tolist(), round(float(total.global_norm()) ** 2, 3)
    ([2.0, 2.0], 32.0)
    """

    def __init__(
        self,
        by_leaf: dict[NodeId, Array] | PendingGradients,
        groups: list[ParameterGroup],
        owner: int,
        generation: int,
    ) -> None:
        # a lazy session's gradients are computed when first read (or fused into an optimizer step)
        self.pending: PendingGradients | None = None
        if isinstance(by_leaf, dict):
            self._by_leaf = by_leaf
        else:
            self.pending, self._by_leaf = by_leaf, {}
        self.groups = groups
        self.owner = owner
        self.generation = generation
        self._by_storage: dict[int, ParameterGroup] | None = None  # made on first lookup (a fused step needs none)
        self._sums: dict[NodeId, Array] = {}
        # leaves an optimizer can consume (made on the first consume): a registration without a storage has
        # nothing to update, so it never holds the other groups' buffers past the last optimizer step
        self._param_leaves: set[NodeId] | None = None
        self.released = False
        self.on_step: Callable[[], None] | None = None  # what an optimizer step over these gradients tells
        self._consumed: set[NodeId] = set()
        # how non-finite gradients are checked and explained (set by the session's backward; None: not at all)
        self.check: NonFiniteCheck | None = None
        # the state logs of the recordings these gradients came from (eager state writes a failed optimizer
        # step puts back; tapeflow._shell._state reads them); a sum or a scaled copy carries its operands'
        self.state_logs: tuple[object, ...] = ()

    @property
    def by_leaf(self) -> dict[NodeId, Array]:
        """``{leaf id: cotangent}`` (a lazy session's are computed here, on first read)."""
        if self.pending is not None:
            got = self.pending.resolve()
            if self.check is not None and self.check.debug:
                self.check.verify(list(got.values()), "grads")  # raises with the gradients still pending
            self._by_leaf = got
            self.pending = None
        return self._by_leaf

    # -- gradient per group ----------------------------------------------------
    def group_gradient(self, group: ParameterGroup) -> Array | None:
        """The summed gradient of ``group`` (the leaf's own array for a singleton)."""
        self._check_live()
        got = self._sums.get(group.id)
        if got is None and len(group.leaves) == 1:
            return self.by_leaf.get(group.leaves[0])
        if got is None:
            parts = [self.by_leaf[i] for i in group.leaves if i in self.by_leaf]
            if not parts:
                return None
            got = sum_in_leaf_order(parts)
            self._sums[group.id] = got
        return got

    def group_value(self, group: ParameterGroup) -> Array | None:
        """:meth:`group_gradient` as an array: a recorded (``create_graph``) gradient gives its value."""
        g = self.group_gradient(group)
        return g.value if isinstance(g, Tensor) else g

    def leaf_values(self, group: ParameterGroup) -> tuple[Array, ...]:
        """The cotangent array of each leaf of ``group`` (values of recorded gradients), in leaf order."""
        return tuple(v.value if isinstance(v, Tensor) else v for v in (self.by_leaf[i] for i in group.leaves))

    def set_group_gradient(self, group: ParameterGroup, value: Array) -> None:
        """Make ``value`` the gradient of ``group`` (what a Param hook returned); read by every consumer."""
        self._check_live()
        self._sums[group.id] = value

    def storage_gradients(self, storages: Sequence[Storage]) -> list[Array | None]:
        """One summed gradient per storage, in the order given (None: the recording did not use it).

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> a, b = tfl.Param(jnp.array(1.0)), tfl.Param(jnp.array(1.0))
        >>> with tfl.Session() as s:
        ...     g = s.backward(a * 2.0 + tfl.tie(a) * 3.0)
        ...     per_storage = g.storage_gradients([a.storage, b.storage])
        ...     [None if v is None else float(v) for v in per_storage]
        [5.0, None]
        """
        out: list[Array | None] = []
        for st in storages:
            g = self._group_of_storage.get(id(st))
            out.append(None if g is None else self.group_gradient(g))
        return out

    @property
    def _group_of_storage(self) -> dict[int, ParameterGroup]:
        """``{id(storage): its group}``, made once per Grads when first needed."""
        by = self._by_storage
        if by is None:
            by = self._by_storage = {id(g.storage): g for g in self.groups if g.storage is not None}
        return by

    def _check_live(self) -> None:
        if self.released:
            raise TapeError(
                "these gradients were released (Grads.release() or the end of its with block); run backward again"
            )

    def group_of(self, key: object) -> ParameterGroup | None:
        """The parameter group of ``key``'s storage (a Param or Storage) in this recording, or None if it was not used."""
        if isinstance(key, Param):
            return self._group_of_storage.get(id(key.storage))
        if isinstance(key, Storage):
            return self._group_of_storage.get(id(key))
        return None

    def __getitem__(self, key: GradKey) -> Array:
        self._check_live()
        if isinstance(key, (Param, Storage)):
            g = self.group_of(key)
            val = None if g is None else self.group_gradient(g)
            if val is None and g is not None and g.id in self._consumed:
                raise ConsumedGradientError(g.parameter, "grads[param]")
            if val is None:
                raise KeyError(
                    f"{key!r} was not used as a trainable parameter in this recording, so it has no gradient; "
                    "grads.get(param) returns None instead of raising"
                )
            return val
        if isinstance(key, Tensor):
            if key.owner != self.owner or key.generation != self.generation:
                raise KeyError(f"{key!r} does not belong to the recording these gradients came from")
            key = key.id
        if isinstance(key, (int, np.integer)) and int(key) in self.by_leaf:
            return self.by_leaf[int(key)]
        raise KeyError(f"no gradient for {key!r}: it is not a leaf that requires grad and was reached from the loss")

    def __contains__(self, key: object) -> bool:
        try:
            self[cast(GradKey, key)]
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[int]:
        self._check_live()
        return iter(self.by_leaf)

    def __len__(self) -> int:
        self._check_live()
        return len(self.by_leaf)

    def params(self) -> list[tuple[ParameterRecord, Array]]:
        """``(parameter, gradient)`` for each group, in recording order."""
        self._check_whole("Grads.params()")
        out = []
        for g in self.groups:
            v = self.group_gradient(g)
            if v is not None:
                out.append((g.parameter, v))
        return out

    def stepped(self) -> None:
        """An optimizer stepped from these gradients (its session learns that its recording trained once)."""
        if self.on_step is not None:
            self.on_step()

    def consume(self, groups: Sequence[ParameterGroup]) -> None:
        """Let go of the buffers of ``groups`` (an optimizer has used them).

        Once every parameter group with a storage is consumed the whole object is
        released, so two optimizers over disjoint parameters can share one
        ``Grads`` (registrations without a storage are never an optimizer's to
        consume, so they do not keep it alive).
        """
        if self.released:
            return
        left = self._param_leaves
        if left is None:
            left = self._param_leaves = {i for g in self.groups if g.storage is not None for i in g.leaves}
        for g in groups:
            for i in g.leaves:
                self._by_leaf.pop(i, None)
            self._sums.pop(g.id, None)
            left.difference_update(g.leaves)
            self._consumed.add(g.id)
        if not left:
            self.release()

    def release(self) -> None:
        """Let go of every buffer these gradients hold (idempotent); arrays the user kept stay valid."""
        if self.released:
            return
        self.released = True
        self.pending = None
        self.check = None  # lets go of the tape it explains
        self._by_leaf = {}
        self._sums = {}

    # -- arithmetic (gradient accumulation) -------------------------------------
    @classmethod
    def of_storages(
        cls, entries: Sequence[tuple[ParameterRecord, Storage, Array]], state_logs: tuple[object, ...] = ()
    ) -> Grads:
        """A ``Grads`` of no recording: one group per ``(parameter, storage, gradient)`` entry."""
        groups = [ParameterGroup(i, prm, (i,), st) for i, (prm, st, _) in enumerate(entries)]
        out = cls({i: v for i, (_, _, v) in enumerate(entries)}, groups, owner=-1, generation=-1)
        out.state_logs = tuple({id(log): log for log in state_logs}.values())  # each recording's once, in order
        return out

    def _check_whole(self, what: str) -> None:
        """Raise :class:`ConsumedGradientError` if an optimizer step consumed any group: ``what`` would see only the rest."""
        self._check_live()
        if self._consumed:
            first = next(g for g in self.groups if g.id in self._consumed)
            raise ConsumedGradientError(first.parameter, what)

    def _entries(self, what: str) -> list[tuple[ParameterRecord, Storage, Array]]:
        self._check_whole(what)
        out = []
        for g in self.groups:
            if g.storage is not None:
                v = self.group_value(g)
                if v is not None:
                    out.append((g.parameter, g.storage, v))
        return out

    def __add__(self, other: object) -> Grads:
        if not isinstance(other, Grads):
            return NotImplemented
        merged: dict[int, tuple[ParameterRecord, Storage, Array]] = {}
        for prm, st, v in self._entries("Grads + Grads") + other._entries("Grads + Grads"):
            got = merged.get(id(st))
            if got is not None and (got[2].shape, got[2].dtype) != (v.shape, v.dtype):
                raise TapeError(
                    f"Grads + Grads: the gradients of {prm!r} have different shapes or dtypes "
                    f"({got[2].dtype}{list(got[2].shape)} and {v.dtype}{list(v.shape)}); add gradients of one model"
                )
            merged[id(st)] = (prm, st, v) if got is None else (got[0], st, sum_in_leaf_order([got[2], v]))
        return Grads.of_storages(list(merged.values()), self.state_logs + other.state_logs)

    def __radd__(self, other: object) -> Grads:
        if isinstance(other, (int, float)) and other == 0:  # sum([g1, g2, ...]) and total = 0 starts
            return Grads.of_storages(self._entries("sum(grads)"), self.state_logs)
        return NotImplemented

    def __mul__(self, c: object) -> Grads:
        if not _is_scalar(c):
            return NotImplemented
        scaled = [(p, st, v * jnp.asarray(c, v.dtype)) for p, st, v in self._entries("Grads * number")]
        return Grads.of_storages(scaled, self.state_logs)

    __rmul__ = __mul__

    def __truediv__(self, c: object) -> Grads:
        if not _is_scalar(c):
            return NotImplemented
        scaled = [(p, st, v / jnp.asarray(c, v.dtype)) for p, st, v in self._entries("Grads / number")]
        return Grads.of_storages(scaled, self.state_logs)

    def global_norm(self) -> Array:
        """The L2 norm of all gradients, each storage once (a tied weight's summed gradient counted once).

        As ``optax.global_norm`` of the optimizer's per-storage gradients and the
        value ``torch.nn.utils.clip_grad_norm_`` returns; computed in at least
        float32. A lazy session's gradients are computed here.
        """
        vals = [v for _, _, v in self._entries("Grads.global_norm()")]
        if not vals:
            return jnp.zeros((), jnp.float32)
        return global_norm_of(vals)

    def __enter__(self) -> Grads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = (
            "released"
            if self.released
            else f"{len(self._by_leaf) if self.pending is None else 'pending'} leaves, {len(self.groups)} parameter groups"
        )
        return f"Grads({state})"


class ConsumedGradientError(TapeError, KeyError):
    """A gradient an :meth:`Optimizer.step <tapeflow.Optimizer.step>` consumed (and freed) was read.

    Raised by ``grads[param]`` for that parameter, and by everything that reads
    every gradient (``global_norm``, ``clip_grad_norm``, ``grads * c``, ``grads + other``,
    ``params()``) once any was consumed: it would see only the rest. A
    ``TapeError`` and a ``KeyError``.

    >>> import jax.numpy as jnp, optax, tapeflow as tfl
    >>> w, v = tfl.Param(jnp.ones(2), name="w"), tfl.Param(jnp.ones(2), name="v")
    >>> with tfl.Session() as s:
    ...     g = s.backward((w * v).sum())
    ...     norm = g.global_norm()  # read everything before the first step
    ...     tfl.Optimizer(optax.sgd(0.1), [w]).step(g)
    ...     try:
    ...         g.global_norm()
    ...     except tfl.TapeError as e:
    ...         print(str(e).split(";")[0])
    Grads.global_norm() needs every gradient, but the gradient of Param 'w' was consumed (and freed) by an Optimizer.step
    """

    __str__ = BaseException.__str__  # the message as it is (KeyError's would quote it)

    def __init__(self, parameter: object, what: str) -> None:
        name = getattr(parameter, "name", None)
        shown = f"Param {name!r}" if name else repr(parameter)
        if what == "grads[param]":
            msg = (
                f"the gradient of {shown} was consumed (and freed) by an Optimizer.step; "
                "read grads[param] before the step if you need it"
            )
        else:
            msg = (
                f"{what} needs every gradient, but the gradient of {shown} was consumed (and freed) by an "
                f"Optimizer.step; compute {what} before the first optimizer steps from these gradients"
            )
        super().__init__(msg)


def _is_scalar(c: object) -> bool:
    return is_number(c) or (isinstance(c, (jax.Array, np.ndarray)) and np.ndim(c) == 0)


@jax.jit
def global_norm_of(values: list[Array]) -> Array:
    """The L2 norm over ``values`` (each squared and summed in at least float32), one compiled reduction."""

    def sq(v: Array) -> Array:
        v = v.astype(jnp.promote_types(v.dtype, jnp.float32))
        return jnp.sum(v * v)

    return jnp.sqrt(sum(sq(v) for v in values))


def clip_grad_norm(grads: Grads, max_norm: ArrayLike) -> tuple[Grads, Array]:
    """``(clipped, norm)``: ``grads`` scaled so their global norm is at most ``max_norm``, and the norm before.

    PyTorch's ``torch.nn.utils.clip_grad_norm_`` rule: every gradient is
    multiplied by ``min(1, max_norm / (norm + 1e-6))``, where ``norm`` is
    :meth:`Grads.global_norm` (a tied weight counted once). ``clipped`` is a
    new :class:`Grads` for ``opt.step``; ``grads`` is left as it was. (Inside an
    optax chain, ``optax.clip_by_global_norm`` clips the same gradients but its
    norm cannot be read.)

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> w = tfl.Param(jnp.array([3.0, 4.0]), name="w")
    >>> with tfl.Session() as s:
    ...     clipped, norm = tfl.clip_grad_norm(s.backward(tfl.sum(w * w) / 2), 1.0)
    >>> float(norm), [round(v, 4) for v in clipped[w].tolist()]
    (5.0, [0.6, 0.8])
    """
    if not isinstance(grads, Grads):
        raise TypeError(f"clip_grad_norm expects the tfl.Grads of a backward, got {type(grads).__name__}")
    if not _is_scalar(max_norm) or not float(max_norm) > 0:  # type: ignore[arg-type]
        raise ValueError(f"clip_grad_norm: max_norm must be a positive number, got {max_norm!r}")
    norm = grads.global_norm()
    coef = jnp.minimum(1.0, jnp.asarray(max_norm, norm.dtype) / (norm + 1e-6))
    return grads * coef, norm
