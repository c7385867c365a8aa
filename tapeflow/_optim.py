"""`Optimizer`: any optax ``GradientTransformation`` over parameter storages.

The optimizer state has **one slot per storage**: parameters tied with
:func:`~tapeflow.tie` share a slot, so they never get two moment histories.
:meth:`Optimizer.step` takes the :class:`~tapeflow.Grads` of a recording,
takes the per-storage gradient sums from it (:meth:`Grads.group_gradient`, the
one home of the tied-weight sum), validates everything, and then applies one
compiled optax update per step that writes each storage once, starting from its
*current* value. :meth:`Optimizer.update` is that update as a pure function,
which :func:`~tapeflow.train_step` traces into its program.

>>> import jax.numpy as jnp, optax, tapeflow as tfl
>>> w = tfl.Param(jnp.array(1.0), name="w")
>>> opt = tfl.Optimizer(optax.sgd(1.0), [w])
>>> with tfl.Session() as s:
...     loss = w * 1.0 + w * 0.25          # two uses of one storage
...     opt.step(s.backward(loss))
>>> float(w.value)                         # 1.0 - (1.0 + 0.25)
-0.25
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeAlias, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import _registry as R
from ._device import device_of
from ._grads import Grads, ParameterGroup, sum_in_leaf_order
from ._interrupts import deferred_interrupts
from ._lazy import LazyGrads
from ._params import Param, Storage, canonical_indices
from ._result import TapeError
from ._slots import ParamCollection, SlotKey, records_of, slot_index_tree
from ._state import StateLog, state_log_of
from ._typing import Array, ArrayLike, OptState, PyTree

__all__ = ["Optimizer", "ParamCollection", "SlotKey", "slot_index_tree"]

GradsLike: TypeAlias = "Grads | Mapping[Param | Storage | SlotKey, ArrayLike | None]"
"""What :meth:`Optimizer.step` accepts: a :class:`Grads`, or a mapping from a Param, a Storage or a slot key to a gradient."""

UpdateFn: TypeAlias = Callable[[list[Array | None], OptState, list[Array]], tuple[list[Array], OptState]]
"""The jitted ``(slot_grads, state, values) -> (new_values, new_state)`` of one used-pattern."""


class Optimizer:
    """Optax transformation ``tx`` over the storages of ``params``.

    ``params`` is a sequence of :class:`Param` s, a mapping ``name -> Param`` (the
    optax params pytree is then a dict keyed by the first name of each storage,
    which ``optax.multi_transform`` labels can use), or a module with
    ``named_parameters()`` (its trainable ones: state cells such as BatchNorm's
    running statistics and frozen Params get no optimizer slot).

    * ``opt.storages`` (alias ``opt.params``): the canonical storages, in
      first-registration order (one per slot); ``opt.slot_keys`` their keys in
      the optax params pytree.
    * ``opt.state``: the plain optax state pytree.
    * ``opt.step(grads, check_finite=False)``: one update per used storage.
    * ``opt.update(values, state, grads, used)``: the same update as a pure,
      jit-compatible function of the slot values (what ``train_step`` compiles).
    * ``opt.lock``: steps (eager or compiled) over this optimizer from several
      threads are serialized on it, and each step's write-back is one unit.

    A trainable parameter that the recording did not use is skipped, as PyTorch
    skips a parameter whose ``.grad`` is None: its value and its per-parameter
    optimizer slots stay exactly as they were (global counters such as Adam's step
    count advance with every step). The per-parameter slots are located with
    :func:`optax.tree_utils.tree_map_params` (see :func:`slot_index_tree`).

    >>> import jax.numpy as jnp, optax, tapeflow as tfl
    >>> emb = tfl.Param(jnp.ones((4, 2)), name="emb")
    >>> out = tfl.tie(emb, name="out")               # tied: same storage
    >>> opt = tfl.Optimizer(optax.adam(1e-3), {"emb": emb, "out": out})
    >>> len(opt.storages), opt.slot_keys, list(opt.state[0].mu)   # one slot, keyed by the first name
    (1, ['emb'], ['emb'])
    """

    def __init__(
        self, tx: optax.GradientTransformation, params: ParamCollection, *, check_finite: bool = False
    ) -> None:
        if not (hasattr(tx, "init") and hasattr(tx, "update")):
            raise TypeError(f"Optimizer expects an optax GradientTransformation, got {type(tx).__name__}")
        self.tx = tx
        self.check_finite = check_finite
        self.lock = threading.RLock()  # steps from several threads run one after the other
        self._records, names = records_of(params)
        self._names = names
        self._update_fns: dict[tuple[bool, ...], UpdateFn] = {}
        self._init_slots()

    # -- layout ----------------------------------------------------------------
    def _init_slots(self) -> None:
        storages = [p.storage for p in self._records]
        self._layout = canonical_indices(storages)
        firsts = [i for i, c in enumerate(self._layout) if c == i]
        self._slot_storages: tuple[Storage, ...] = tuple(storages[i] for i in firsts)
        self._slot_of_storage = {id(s): k for k, s in enumerate(self._slot_storages)}
        self._slot_specs = [(st.shape, st.dtype) for st in self._slot_storages]  # what each slot's gradient must be
        self._slot_keys: list[SlotKey] = (
            [self._names[i] for i in firsts] if self._names is not None else list(range(len(firsts)))
        )
        # the registrations' storages when the layout was last found valid (check_layout's fast path)
        self._checked_storages: list[Storage] = storages
        # state structure -> slot_index_tree of it (None: tree_map_params could not map it)
        self._slot_indices: dict[jax.tree_util.PyTreeDef, PyTree] = {}
        self._warned_no_slots = False
        self.state: OptState = self.tx.init(self.param_tree())

    def _tree(self, values: Sequence[object]) -> PyTree:
        if self._names is not None:
            return dict(zip(self._slot_keys, values))
        return list(values)

    def _leaves(self, tree: PyTree) -> list[Array]:
        if self._names is not None:
            return [tree[k] for k in self._slot_keys]
        return list(tree)

    @property
    def storages(self) -> list[Storage]:
        """The canonical storages, one per optimizer slot, in first-registration order."""
        return list(self._slot_storages)

    @property
    def params(self) -> list[Storage]:
        """Alias of :attr:`storages`."""
        return list(self._slot_storages)

    @property
    def slot_keys(self) -> list[SlotKey]:
        """The key of each slot in the optax params pytree: the first name of its storage, or its position."""
        return list(self._slot_keys)

    @property
    def records(self) -> list[Param]:
        """Every registration given to the optimizer (tied records included)."""
        return list(self._records)

    @property
    def alias_layout(self) -> list[int | None]:
        """For each registration, the index of the first registration of its storage."""
        return list(self._layout)

    def param_tree(self, values: Sequence[Array] | None = None) -> PyTree:
        """``values`` (one per slot; default: the current values) as the optax params pytree.

        A list, or for a mapping of parameters a dict keyed by :attr:`slot_keys`.
        """
        if values is None:
            values = [s.read_host() for s in self._slot_storages]
        elif len(values) != len(self._slot_storages):
            raise ValueError(
                f"Optimizer.param_tree: expected {len(self._slot_storages)} values (one per slot), got {len(values)}"
            )
        return self._tree(values)

    def describe(self, k: int) -> str:
        """Slot ``k`` for error messages: the repr of the first registration of its storage."""
        st = self._slot_storages[k]
        return repr(next(p for p in self._records if p.storage is st))

    def reinit(self) -> None:
        """Re-read the alias layout of the registrations and start from fresh optimizer state."""
        self._init_slots()
        self._update_fns.clear()

    def check_layout(self) -> tuple[Storage, ...]:
        """Raise :class:`TapeError` if the registrations no longer fit the state; return the slot storages.

        The state has one slot per storage given at init: a registration re-pointed
        at a storage with no slot, or a changed alias pattern (tying or untying
        records), needs :meth:`reinit`. Costs one identity comparison per
        registration when nothing changed since the last check; the returned tuple
        is the same object until :meth:`reinit`.
        """
        now_storages = [p.storage for p in self._records]
        if now_storages == self._checked_storages:  # element identity (Storage has no __eq__)
            return self._slot_storages
        now = canonical_indices(now_storages)
        if now != self._layout:
            first = next(i for i, (a, b) in enumerate(zip(now, self._layout)) if a != b)
            raise TapeError(
                f"Optimizer: the alias layout of its parameters changed since init (registration {first} "
                f"{self._records[first]!r} now shares storage with registration {now[first]}, was {self._layout[first]}); "
                "existing optimizer state cannot be mapped onto the new storages. Call opt.reinit() to start "
                "from fresh optimizer state"
            )
        stale = next((i for i, st in enumerate(now_storages) if id(st) not in self._slot_of_storage), None)
        if stale is not None:
            raise TapeError(
                f"Optimizer: registration {stale} {self._records[stale]!r} now points at a storage that was not "
                "given to the optimizer at init; existing optimizer state has no slot for it. Call opt.reinit() "
                "to start from fresh optimizer state"
            )
        self._checked_storages = now_storages
        return self._slot_storages

    def slot_indices(self, state: OptState | None = None) -> PyTree:
        """:func:`slot_index_tree` of ``state`` (default :attr:`state`) for this optimizer's params tree.

        Cached per state structure, so it is free after the first call (also inside
        ``jax.jit``: it looks at the structure only). When ``tree_map_params``
        cannot map the state (see :func:`slot_index_tree`) it warns once and returns
        ``-1`` for the whole state: nothing is then known to be per-parameter, so a
        parameter a step does not use has its slots updated with a zero gradient,
        and ``train_step(mesh=...)`` replicates every slot.

        >>> import jax.numpy as jnp, optax, tapeflow as tfl
        >>> opt = tfl.Optimizer(optax.sgd(0.1, momentum=0.9), [tfl.Param(jnp.ones(2)), tfl.Param(jnp.ones(3))])
        >>> opt.slot_indices()
        (TraceState(trace=[0, 1]), EmptyState())
        """
        if state is None:
            state = self.state
        treedef = jax.tree_util.tree_structure(state)
        got = self._slot_indices.get(treedef)
        if got is None:
            try:
                got = slot_index_tree(self.tx, state, self._tree(range(len(self._slot_storages))))
            except Exception as e:
                got = -1
                if not self._warned_no_slots:
                    self._warned_no_slots = True
                    warnings.warn(
                        f"Optimizer: optax.tree_utils.tree_map_params cannot locate the per-parameter parts of this "
                        f"optax state ({type(e).__name__}: {e}); the slots of a parameter a step does not use are "
                        "updated with a zero gradient, and train_step(mesh=...) replicates every slot",
                        stacklevel=2,
                    )
            self._slot_indices[treedef] = got
        return got

    # -- gradients -------------------------------------------------------------
    def _collect(self, grads: GradsLike) -> tuple[list[tuple[Array, ...] | None], list[ParameterGroup | None]]:
        """For each slot, the cotangents to validate (None: slot unused this step), and its group for a Grads."""
        n = len(self._slot_storages)
        per_slot: list[tuple[Array, ...] | None] = [None] * n
        if isinstance(grads, Grads):
            groups = self._slot_groups(grads)
            for slot, g in enumerate(groups):
                if g is None:
                    continue
                missing = [i for i in g.leaves if i not in grads.by_leaf]
                if missing:
                    raise TapeError(
                        f"Optimizer.step: missing gradient for leaf #{missing[0]} of {g.parameter!r} "
                        f"(storage used at leaves {list(g.leaves)}); nothing was updated"
                    )
                per_slot[slot] = grads.leaf_values(g)
            return per_slot, groups
        groups = [None] * n  # a mapping has no parameter groups
        if not isinstance(grads, Mapping):
            raise TypeError(
                f"Optimizer.step expects tfl.Grads or a mapping Param -> gradient, got {type(grads).__name__}"
            )
        for key, v in grads.items():
            if isinstance(key, Param):
                st: Storage | None = key.storage
            elif isinstance(key, Storage):
                st = key
            elif self._names is not None and key in self._slot_keys:
                st = self._slot_storages[self._slot_keys.index(cast(str, key))]
            else:
                raise TapeError(f"Optimizer.step: gradient key {key!r} is not one of this optimizer's parameters")
            k = self._slot_of_storage.get(id(st))
            if k is None:
                raise TapeError(f"Optimizer.step: {key!r} is not one of this optimizer's parameters")
            if v is None:
                continue
            per_slot[k] = (per_slot[k] or ()) + (v,)
        return per_slot, groups

    def _slot_groups(self, grads: Grads) -> list[ParameterGroup | None]:
        """The parameter group of ``grads`` that updates each slot (None: the recording did not use it)."""
        if grads.released:
            raise TapeError("Optimizer.step: these gradients were already released; run backward again")
        groups: list[ParameterGroup | None] = [None] * len(self._slot_storages)
        for g in grads.groups:
            if g.storage is None:
                self._refuse_storageless(g)
            elif (k := self._slot_of_storage.get(id(g.storage))) is not None:
                groups[k] = g
        return groups

    def _refuse_storageless(self, g: ParameterGroup) -> None:
        """Raise if ``g`` registers one of this optimizer's Params without a storage (nothing to update)."""
        p = g.parameter
        st = p.storage if isinstance(p, Param) else None
        if st is not None and id(st) in self._slot_of_storage:
            raise TapeError(
                f"Optimizer.step: leaf #{g.leaves[0]} registers {p!r}, one of this optimizer's parameters, without "
                "a storage descriptor, so the optimizer cannot tell which storage its gradient updates; nothing "
                "was updated. Register it with session.register_parameter_leaf(h, p, storage=p.storage), or "
                "record it with session.use(p)"
            )

    def _validate(self, per_slot: list[tuple[Array, ...] | None], check_finite: bool) -> None:
        for k, parts in enumerate(per_slot):
            if parts is None:
                continue
            st = self._slot_storages[k]
            for g in parts:
                if not hasattr(g, "dtype"):
                    g = np.asarray(g)
                shape, dtype = tuple(g.shape), np.dtype(g.dtype)
                if shape != st.shape or dtype != st.dtype:
                    raise TapeError(
                        f"Optimizer.step: gradient for {self.describe(k)} is {R.fmt_spec((shape, dtype))} but the "
                        f"parameter is {R.fmt_spec((st.shape, st.dtype))}; nothing was updated"
                    )
                if isinstance(g, jax.Array) and g.is_deleted():
                    raise TapeError(f"Optimizer.step: gradient for {self.describe(k)} was already released")
        if check_finite:
            flags = [jnp.all(jnp.isfinite(g)) for parts in per_slot if parts for g in parts]
            if flags and not bool(jnp.all(jnp.stack(flags))):
                bad = next(
                    self.describe(k)
                    for k, parts in enumerate(per_slot)
                    if parts and not all(bool(jnp.all(jnp.isfinite(g))) for g in parts)
                )
                raise TapeError(f"Optimizer.step: non-finite gradient for {bad}; nothing was updated")

    # -- update ----------------------------------------------------------------
    def _update_fn(self, used: tuple[bool, ...]) -> UpdateFn:
        fn = self._update_fns.get(used)
        if fn is not None:
            return fn
        tx = self.tx
        n = len(self._slot_storages)
        tree = self._tree
        leaves_of = self._leaves
        slot_indices = self.slot_indices

        def keep_unused(k: int, new: PyTree, old: PyTree) -> PyTree:
            return old if k >= 0 and not used[k] else new

        def update(
            slot_grads: list[Array | None], state: OptState, values: list[Array]
        ) -> tuple[list[Array], OptState]:
            if not any(used):
                return list(values), state  # a recording that used none of the slots changes nothing at all
            grads = [slot_grads[k] if used[k] else jnp.zeros_like(values[k]) for k in range(n)]
            params = tree(values)
            updates, new_state = tx.update(tree(grads), state, params)
            new_vals = leaves_of(optax.apply_updates(params, updates))
            if all(used):
                return new_vals, new_state
            new_vals = [nv if used[k] else values[k] for k, nv in enumerate(new_vals)]
            # an unused parameter's own parts of the state stay as they were
            new_state = jax.tree_util.tree_map(keep_unused, slot_indices(state), new_state, state)
            return new_vals, new_state

        fn = self._update_fns[used] = jax.jit(update)
        return fn

    def update(
        self,
        values: Sequence[Array],
        state: OptState,
        grads: Sequence[Array | None],
        used: Sequence[bool] | None = None,
    ) -> tuple[list[Array], OptState]:
        """One optax update of the slot values, as a pure function: ``(new_values, new_state)``.

        ``values`` and ``grads`` hold one array per slot (in :attr:`storages`
        order; ``grads`` already summed per storage); ``used`` marks the slots the
        recording used (default: those whose gradient is not None). An unused
        slot's value and per-parameter state are returned unchanged; when no slot
        is used, nothing changes, not even shared state such as Adam's step
        count (as in :meth:`step`). Nothing is
        read or written: this is what :meth:`step` applies and what
        :func:`~tapeflow.train_step` traces into its program. It is compiled once
        per ``used`` pattern and can be called inside ``jax.jit``.

        >>> import jax.numpy as jnp, optax, tapeflow as tfl
        >>> opt = tfl.Optimizer(optax.sgd(0.5), [tfl.Param(jnp.ones(2)), tfl.Param(jnp.ones(1))])
        >>> vals, state = opt.update([jnp.ones(2), jnp.ones(1)], opt.state, [jnp.ones(2), None])
        >>> [v.tolist() for v in vals]
        [[0.5, 0.5], [1.0]]
        """
        n = len(self._slot_storages)
        if len(values) != n or len(grads) != n:
            raise ValueError(
                f"Optimizer.update: expected {n} values and gradients (one per slot), got {len(values)} and {len(grads)}"
            )
        mask = tuple(g is not None for g in grads) if used is None else tuple(bool(u) for u in used)
        return self._update_fn(mask)(list(grads), state, list(values))

    def step(self, grads: GradsLike, *, check_finite: bool | None = None) -> None:
        """Apply one update per storage used in the recording, then free the gradients it used.

        Every gradient is validated (present, shape and dtype; finiteness when
        ``check_finite``) before any parameter changes. The gradient buffers this
        step consumed are released after the update, also when it raises; once
        every parameter group of ``grads`` is consumed the whole ``Grads`` is
        released (so two optimizers over disjoint parameters can share one).
        Steps from several threads are serialized on :attr:`lock`.

        State cells the recording assigned eagerly (``Session.assign_state``:
        BatchNorm's running statistics) were written during the forward; when
        this step fails (an invalid or non-finite gradient, an exception in the
        update, Ctrl-C) their old values are put back, so a failed step changes
        neither the parameters nor the state, as in :func:`~tapeflow.train_step`.
        Once a step over the recording's gradients succeeded, its writes are final.
        """
        with self.lock:
            log = state_log_of(grads)
            try:
                self._step(grads, check_finite, log)
            except BaseException:
                if log is not None:
                    log.undo()  # nothing once committed: the step's write-back had completed
                raise

    def _step(self, grads: GradsLike, check_finite: bool | None, log: StateLog | None) -> None:
        storages = self.check_layout()
        check = self.check_finite if check_finite is None else check_finite
        if isinstance(grads, Grads) and isinstance(grads.pending, LazyGrads) and self._fused(grads, check, log):
            return
        per_slot, groups = self._collect(grads)
        self._validate(per_slot, check)
        used = tuple(p is not None for p in per_slot)
        mine = [g for g in groups if g is not None]
        if not any(used):
            if isinstance(grads, Grads):
                grads.consume(mine)
            if log is not None:
                log.commit()
            return
        try:
            device = next(device_of(p[0]) for p in per_slot if p is not None)
            values = [s.read(device) for s in storages]
            if isinstance(grads, Grads):
                # the per-storage sums of the recording (held by grads until consume() lets go of them)
                slot_grads = [None if g is None else grads.group_value(g) for g in groups]
            else:
                slot_grads = [None if p is None else sum_in_leaf_order(p) for p in per_slot]
            new_vals, new_state = self.update(values, self.state, slot_grads, used)
        finally:
            if isinstance(grads, Grads):
                grads.consume(mine)  # lets go of what this step used; of everything once every group is used
        with deferred_interrupts():  # a Ctrl-C held during the write-back lands after the commit, undoing nothing
            self.install(new_vals, new_state, used)
            if log is not None:
                log.commit()

    def _fused(self, grads: Grads, check_finite: bool, log: StateLog | None) -> bool:
        """A lazy session's unread gradients and this update as one program (as ``train_step``); False: not fusable.

        It fuses when this optimizer consumes every parameter group of ``grads``
        (else they are computed once and shared, as eagerly); checks, failures
        and the write-back are :meth:`step`'s.
        """
        lazy = cast(LazyGrads, grads.pending)
        groups = self._slot_groups(grads)
        mine = [g for g in groups if g is not None]
        if not mine or len(mine) != sum(g.storage is not None for g in grads.groups):
            return False
        nodes = lazy.tape._buf.nodes
        leaves = [None if g is None else g.leaves for g in groups]
        specs = self._slot_specs
        if any(ls is not None and any(nodes[i].spec != specs[k] for i in ls) for k, ls in enumerate(leaves)):
            self._validate([None if ls is None else tuple(nodes[i] for i in ls) for ls in leaves], False)  # raises
        used = tuple(ls is not None for ls in leaves)
        grads.pending = None  # consumed by this step, read or not
        try:
            storages = self._slot_storages
            device = device_of(nodes[mine[0].leaves[0]].value)  # where the recording's leaves live
            values = [st.read(device) for st in storages]
            exact = all(v is st.read_current() for v, st in zip(values, storages))  # single-device cells
            new_vals, new_state, flags = lazy.step(leaves, self._update_fn(used), values, self.state, check_finite)
        except BaseException:
            grads.consume(mine)  # as step: a failed update still lets go of the gradients it used
            raise
        if flags is not None and not bool(jnp.all(flags)):
            grads.pending = lazy  # as step's validation: refused before the update, the gradients stay readable
            bad = self.describe(int(np.argmin(np.asarray(flags))))
            raise TapeError(f"Optimizer.step: non-finite gradient for {bad}; nothing was updated")
        grads.release()  # every storage group was this step's (consume(mine) would end in the same release)
        with deferred_interrupts():
            self.install(new_vals, new_state, used, exact=exact)  # the program cast them to the slots' dtypes
            if log is not None:
                log.commit()
        return True

    def install(
        self,
        values: Sequence[Array],
        state: OptState,
        used: Sequence[bool] | None = None,
        *,
        exact: bool = False,
        state_writes: Iterable[tuple[Storage, Array]] = (),
    ) -> None:
        """Write new slot values (those marked ``used``; default all) and the new state, as one unit.

        The writes run with Ctrl-C held off (:func:`~tapeflow._interrupts.deferred_interrupts`):
        an interrupt lands before or after them, never between two, so the
        parameters and the state always belong to the same step. ``exact=True``
        skips the per-value placement and dtype handling of :meth:`Storage.write`
        (for values a compiled step already produced in the cells' shapes, dtypes
        and devices). ``state_writes`` are ``(storage, value)`` pairs of state cells
        (running statistics a compiled step computed) written after the slots, in
        the same unit; a storage listed there ends with that value.
        """
        storages = self._slot_storages
        if used is None:
            used = [True] * len(storages)
        with deferred_interrupts():
            if exact and all(used):
                Storage.write_current_many(storages, values)
            else:
                for st, v, u in zip(storages, values, used):
                    if u:
                        st.write(v, on_device=True)
            for st, v in state_writes:
                st.write(v, on_device=True)
            self.state = state

    def __repr__(self) -> str:
        return f"Optimizer({len(self._slot_storages)} slots for {len(self._records)} registrations)"
