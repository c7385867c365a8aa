"""One training step, defined once: what every path runs between "here are the gradients" and "state changed".

An eager :meth:`Optimizer.step <tapeflow.Optimizer.step>`, a lazy session's
fused step and :func:`~tapeflow.train_step` differ only in where the
gradients come from (arrays of an eager backward, the reverse sweep inside a
lazy program, the sweep inside ``train_step``'s trace) and whether this code
runs traced. Everything else is here:

1. :func:`check_parts` (Python, before anything runs): each cotangent a slot
   receives has the slot's shape and dtype and is not a released buffer.
2. :func:`step` (pure, jit-traceable): which slots the recording used (a slot
   with no cotangents is unused), the per-storage sums
   (:func:`~tapeflow._shell._grads.sum_in_leaf_order`, the one tied-weight rule),
   the finite check on those sums (what the optimizer actually sees, after
   Param hooks), zeros for unused slots, the optax update, the unused slots'
   values and per-parameter state kept as they were, and the post-update check
   (shape and dtype kept, never weakly typed). With the finite check on, a
   refused step returns the old values and state, so even a program whose
   inputs were donated can put them back.
3. :func:`finish` (Python): refuse a non-finite step with nothing written, or
   write the new slot values, the optimizer state, state cells and the
   caller's counters through :func:`~tapeflow._shell._commit.commit`.

>>> import jax.numpy as jnp, optax, tapeflow as tfl
>>> w = tfl.Param(jnp.array([1.0, 2.0]), name="w")
>>> opt = tfl.Optimizer(optax.sgd(1.0), [w])
>>> parts = [(jnp.array([0.5, 0.5]), jnp.array([0.25, 0.25]))]
>>> out = step(opt.rule, parts, [w.value], opt.state, True)
>>> out.values[0].tolist(), out.finite.tolist()     # 1 - (0.5 + 0.25), 2 - 0.75
([0.25, 1.25], [True])
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence
from functools import partial
from typing import NamedTuple, Protocol, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._core import _compile_log
from .._core import _registry as R
from .._core._fnkey import structural_key
from .._core._result import TapeError
from .._core._typing import Array, OptState, PyTree
from .._shell import _grads
from .._shell._commit import commit, traced_write
from .._shell._params import Storage

__all__ = [
    "STEP",
    "HasState",
    "SlotOwner",
    "SlotParts",
    "SlotRule",
    "StepCall",
    "StepOutcome",
    "check_parts",
    "finish",
    "step",
]

SlotParts: TypeAlias = "Sequence[tuple[Array, ...] | None]"
"""For each optimizer slot, the cotangents of its storage's leaves in recording order (None: unused)."""


class SlotOwner(Protocol):
    """What a :class:`SlotRule` asks its optimizer (an :class:`~tapeflow.Optimizer`), through a weak reference."""

    def slot_indices(self, state: OptState | None = None) -> PyTree: ...
    def describe(self, k: int) -> str: ...


@dataclasses.dataclass(frozen=True)
class SlotRule:
    """What the step needs to know of an optimizer's slots; a jit static argument, compared by structure.

    ``keys`` are the dict keys of the optax params pytree (None: the pytree
    is a list); ``slot_indices(state)`` maps each part of an optax state to its
    slot (see :func:`~tapeflow._train._slots.slot_index_tree`); ``describe(k)`` names
    slot ``k`` in error messages.

    Two rules are equal when their transformations have the same
    :func:`~tapeflow._core._fnkey.structural_key` and their slots the same specs
    and keys: they trace to the same update, so every optimizer of one structure
    (a new ``Optimizer`` over a restored model, a re-run notebook cell) shares the
    compiled step programs of the first. ``slot_indices`` and ``describe`` run
    only while a step is traced, with the rule of the call being traced.

    A rule holds no optimizer, parameter or value: compiled step programs keep
    their rule (a lazy session caches them by structure), and a finished
    optimizer must be freed with everything it holds. :meth:`of` builds the rule
    of an optimizer, reaching it through a weak reference.
    """

    tx: optax.GradientTransformation = dataclasses.field(compare=False)
    specs: tuple[R.Spec, ...]
    keys: tuple[str | int, ...] | None
    slot_indices: Callable[[OptState], PyTree] = dataclasses.field(compare=False)
    describe: Callable[[int], str] = dataclasses.field(compare=False)
    tx_key: Hashable = dataclasses.field(default=None)
    _hash: int = dataclasses.field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        # a rule is hashed by every program call it keys (a lazy step's cache, jit's static argument): once here
        object.__setattr__(self, "_hash", hash(self._compared()))

    def _compared(self) -> tuple[Hashable, ...]:
        """What two rules must share to be equal (the fields that take part in comparisons)."""
        return (self.specs, self.keys, self.tx_key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not SlotRule or self._hash != other._hash:
            return False
        return self._compared() == other._compared()

    @classmethod
    def of(
        cls,
        owner: SlotOwner,
        tx: optax.GradientTransformation,
        specs: tuple[R.Spec, ...],
        keys: tuple[str | int, ...] | None,
    ) -> SlotRule:
        """The rule of optimizer ``owner``, whose ``slot_indices`` and ``describe`` it calls while ``owner`` lives."""
        ref = weakref.ref(owner)

        def slot_indices(state: OptState) -> PyTree:
            opt = ref()
            if opt is None:  # only the owner's steps run its rule, so a traced step always has it
                raise TapeError("a training step ran for an optimizer that was deleted; step a live Optimizer")
            return opt.slot_indices(state)

        def describe(k: int) -> str:
            opt = ref()
            return f"slot {k}" if opt is None else opt.describe(k)

        return cls(tx, specs, keys, slot_indices, describe, structural_key(tx))

    def tree(self, values: Sequence[object]) -> PyTree:
        """``values`` (one per slot) as the optax params pytree."""
        return list(values) if self.keys is None else dict(zip(self.keys, values))

    def leaves(self, tree: PyTree) -> list[Array]:
        """The per-slot values of an optax params pytree, in slot order."""
        return list(tree) if self.keys is None else [tree[k] for k in self.keys]


@dataclasses.dataclass(frozen=True)
class StepCall:
    """:func:`step` for one rule and finite-check flag, as ``fn(parts, values, state, loss=None)``.

    Equal for equal rules, so a lazy session's step programs (keyed by it) serve
    every optimizer of one structure.
    """

    rule: SlotRule
    check_finite: bool

    def __hash__(self) -> int:
        return hash(self.rule) ^ self.check_finite  # the rule's hash is computed once

    def __eq__(self, other: object) -> bool:
        return self is other or (
            type(other) is StepCall and self.check_finite is other.check_finite and self.rule == other.rule
        )

    def __call__(
        self, parts: SlotParts, values: Sequence[Array], state: OptState, loss: Array | None = None
    ) -> StepOutcome:
        return step(self.rule, parts, values, state, self.check_finite, loss)


class HasState(Protocol):
    """What :func:`finish` writes the new optax state into (an :class:`~tapeflow.Optimizer`)."""

    state: OptState


class StepOutcome(NamedTuple):
    """What :func:`step` returns: new slot values, new optax state, per-slot finite flags (None: unchecked)."""

    values: list[Array]
    state: OptState
    finite: Array | None


def check_parts(rule: SlotRule, parts: SlotParts, where: str) -> None:
    """Raise :class:`TapeError` unless every cotangent has its slot's shape and dtype and is still alive.

    ``parts`` may hold arrays, or anything with ``shape`` and ``dtype`` (a lazy
    session checks its recorded nodes before computing them).
    """
    for k, ps in enumerate(parts):
        if ps is None:
            continue
        spec = rule.specs[k]
        for g in ps:
            if not hasattr(g, "dtype"):
                g = np.asarray(g)
            got = (tuple(g.shape), np.dtype(g.dtype))
            if got != spec:
                raise TapeError(
                    f"{where}: gradient for {rule.describe(k)} is {R.fmt_spec(got)} but the parameter is "
                    f"{R.fmt_spec(spec)}; nothing was updated"
                )
            if isinstance(g, jax.Array) and not isinstance(g, jax.core.Tracer) and g.is_deleted():
                raise TapeError(f"{where}: gradient for {rule.describe(k)} was already released")


def step(
    rule: SlotRule,
    parts: SlotParts,
    values: Sequence[Array],
    state: OptState,
    check_finite: bool,
    loss: Array | None = None,
    keep_on_refusal: bool = False,
) -> StepOutcome:
    """One optax update of the slot ``values`` from the per-leaf cotangents ``parts``: pure, traceable.

    With ``check_finite``, ``finite`` has one flag per slot's summed gradient,
    and one more for ``loss`` when it is given (``debug_nans``: a non-finite
    loss refuses the step too). A refused step is not written (:func:`finish`),
    so its new values need not be undone here; ``keep_on_refusal`` (a program
    whose inputs are donated, which are gone once it ran) makes the outcome
    hold the old values and state when a flag fails, at the cost of a select
    over every value.

    An unused slot (``parts[k] is None``) keeps its value and its per-parameter
    state; when no slot is used nothing changes, not even shared state such as
    Adam's step count. Raises :class:`TapeError` (at trace time) if the update
    would change a parameter's shape or dtype.
    """
    n = len(rule.specs)
    used = [p is not None for p in parts]
    summed = [None if p is None else p[0] if len(p) == 1 else _grads.sum_in_leaf_order(list(p)) for p in parts]
    finite = None
    if check_finite:
        flags = [jnp.array(True) if g is None else jnp.all(jnp.isfinite(g)) for g in summed]
        finite = jnp.stack(flags if loss is None else [*flags, jnp.all(jnp.isfinite(loss))])
    if not any(used):
        return StepOutcome(list(values), state, finite)
    grads = [jnp.zeros_like(values[k]) if g is None else g for k, g in enumerate(summed)]
    params = rule.tree(values)
    updates, new_state = rule.tx.update(rule.tree(grads), state, params)
    new_vals = rule.leaves(optax.apply_updates(params, updates))
    if not all(used):
        new_vals = [nv if used[k] else values[k] for k, nv in enumerate(new_vals)]

        def keep_unused(k: int, new: PyTree, old: PyTree) -> PyTree:
            return old if k >= 0 and not used[k] else new

        new_state = jax.tree_util.tree_map(keep_unused, rule.slot_indices(state), new_state, state)
    for k in range(n):
        got = (tuple(jnp.shape(new_vals[k])), np.dtype(jnp.result_type(new_vals[k])))
        if got != rule.specs[k]:
            raise TapeError(
                f"the optimizer's update turns {rule.describe(k)} into {R.fmt_spec(got)}; a parameter keeps its "
                f"shape and dtype {R.fmt_spec(rule.specs[k])}; nothing was updated"
            )
    new_vals = [jnp.asarray(v, rule.specs[k][1]) for k, v in enumerate(new_vals)]  # never weakly typed
    if finite is not None and keep_on_refusal:
        ok = jnp.all(finite)
        new_vals = [jnp.where(ok, nv, v) for nv, v in zip(new_vals, values)]
        new_state = jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), new_state, state)
    return StepOutcome(new_vals, new_state, finite)


def optimizer_update(rule: SlotRule, parts: SlotParts, *args: object, **kwargs: object) -> StepOutcome:
    """:func:`step` as the eager path compiles it (``step`` is looked up when traced), telling the compile log."""
    _compile_log.traced(
        "optimizer_update",
        f"optimizer update ({len(rule.specs)} slots)",
        ("optimizer update", rule),
        lambda: [
            ("the slots used", "structure", tuple(0 if p is None else len(p) for p in parts)),
            ("check_finite", "static value", kwargs.get("check_finite")),
            *_compile_log.tree_signature(args[1] if len(args) > 1 else kwargs.get("state"), "optimizer state leaf"),
        ],
    )
    return step(rule, parts, *args, **kwargs)  # type: ignore[arg-type]


STEP = jax.jit(optimizer_update, static_argnums=0, static_argnames=("check_finite", "keep_on_refusal"))
""":func:`step` compiled, for an eager step: one program per rule structure and parts (shared by equal rules)."""


def refused(finite: Array | None) -> int | None:
    """The first slot whose summed gradient was not finite, or the number of slots for the loss (None: accepted)."""
    if finite is None:
        return None
    flags = np.asarray(finite)
    return None if flags.all() else int(np.argmin(flags))


def finish(
    rule: SlotRule,
    storages: Sequence[Storage],
    out: StepOutcome,
    used: Sequence[bool],
    where: str,
    owner: HasState,
    *,
    replacing: Sequence[Array] | None = None,
    state_writes: Sequence[tuple[Storage, Array]] = (),
    then: Iterable[Callable[[], None]] = (),
    restore_on_refusal: bool = False,
    traced: bool = False,
    explain: Callable[[str], TapeError] | None = None,
) -> None:
    """Write the outcome of :func:`step`, or refuse a non-finite one with nothing changed.

    The used slots' values, the optax state (``owner.state``), ``state_writes``
    (state cells a compiled step computed) and the caller's ``then`` setters
    (counters, a state log's commit) change together through
    :func:`~tapeflow._shell._commit.commit`. A refused step raises :class:`TapeError`;
    ``restore_on_refusal`` (a program whose inputs were donated) first puts the
    old values the program handed back into the storages, so they stay readable.
    ``traced=True``: ``out`` is a compiled program's, traced through :func:`step`
    (which checked every new value's shape and dtype): see
    :func:`~tapeflow._shell._commit.commit`. ``explain(message)`` makes the
    error of a refused step (a :class:`~tapeflow.NonFiniteError` naming where the
    non-finite values came from); it runs only after the refusal is decided.
    """
    if isinstance(out.finite, jax.core.Tracer):  # the step ran inside a jax transformation: nothing to write
        raise traced_write(where, "the step's result")
    bad = refused(out.finite)
    if bad is not None:
        if restore_on_refusal:
            commit(
                zip(storages, out.values),
                where=where,
                replacing=replacing,
                then=[partial(setattr, owner, "state", out.state)],
            )
        what = "the loss is not finite" if bad >= len(rule.specs) else f"non-finite gradient for {rule.describe(bad)}"
        message = f"{where}: {what}; nothing was updated"
        raise TapeError(message) if explain is None else explain(message)
    if all(used):  # the usual step: every slot
        slots: Sequence[int] = range(len(used))
        writes = list(zip(storages, out.values))
    else:
        slots = [k for k, u in enumerate(used) if u]
        writes = [(storages[k], out.values[k]) for k in slots]
        if replacing is not None:
            replacing = [replacing[k] for k in slots]
    if state_writes:
        writes += state_writes
    commit(
        writes,
        where=where,
        label=lambda i: rule.describe(slots[i]) if i < len(slots) else repr(writes[i][0]),
        replacing=replacing,
        then=[partial(setattr, owner, "state", out.state), *then],
        traced=traced,
    )
