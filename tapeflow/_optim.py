"""`Optimizer`: any optax ``GradientTransformation`` over parameter storages.

The optimizer state has **one slot per storage**: parameters tied with
:func:`~tapeflow.tie` share a slot, so they never get two moment histories.
:meth:`Optimizer.step` takes the :class:`~tapeflow.Grads` of a recording,
sums the cotangents of every leaf of a storage, validates everything, and then
applies one compiled optax update per step that writes each storage once,
starting from its *current* value.

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

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import _registry as R
from ._params import Param, Storage, _device_of, canonical_indices
from ._result import TapeError
from ._grads import Grads, release_arrays, sum_in_leaf_order

__all__ = ["Optimizer"]


def _records_of(params: Any) -> tuple[list[Param], list[str] | None]:
    """Flatten the user's parameter collection into registrations (+ names for a mapping)."""
    if hasattr(params, "named_parameters") and callable(params.named_parameters):
        named = list(params.named_parameters())
        return [p for _, p in named], [n for n, _ in named]
    if isinstance(params, Param):
        return [params], None
    if isinstance(params, Mapping):
        names = [str(k) for k in params]
        recs = list(params.values())
    else:
        recs = list(params)
        names = None
    for i, p in enumerate(recs):
        if not isinstance(p, Param):
            where = names[i] if names else f"position {i}"
            raise TypeError(f"Optimizer: {where} holds {type(p).__name__}, expected a tfl.Param")
    return recs, names


def _is_slot_tree(x: Any, n: int, container: type, keys: frozenset[Any] | None = None) -> bool:
    """A per-parameter subtree of an optax state: same container and size as the params tree
    (and, for a dict, the same keys, so e.g. multi_transform's per-label dict is not one)."""
    return type(x) is container and len(x) == n and (keys is None or set(x) == keys)


class Optimizer:
    """Optax transformation ``tx`` over the storages of ``params``.

    ``params`` is a sequence of :class:`Param` s, a mapping ``name -> Param`` (the
    optax params pytree is then a dict keyed by the first name of each storage,
    which ``optax.multi_transform`` labels can use), or a module with
    ``named_parameters()``.

    * ``opt.params``: the canonical storages, in first-registration order (one per slot).
    * ``opt.state``: the plain optax state pytree.
    * ``opt.step(grads, check_finite=False)``: one update per used storage.

    A trainable parameter that the recording did not use is skipped, as PyTorch
    skips a parameter whose ``.grad`` is None: its value and its per-parameter
    optimizer slots stay exactly as they were (global counters such as Adam's step
    count advance with every step).

    >>> import jax.numpy as jnp, optax, tapeflow as tfl
    >>> emb = tfl.Param(jnp.ones((4, 2)), name="emb")
    >>> out = tfl.tie(emb, name="out")               # tied: same storage
    >>> opt = tfl.Optimizer(optax.adam(1e-3), {"emb": emb, "out": out})
    >>> len(opt.params), list(opt.state[0].mu)       # one slot, keyed by the first name
    (1, ['emb'])
    """

    def __init__(self, tx: optax.GradientTransformation, params: Any, *, check_finite: bool = False) -> None:
        if not (hasattr(tx, "init") and hasattr(tx, "update")):
            raise TypeError(f"Optimizer expects an optax GradientTransformation, got {type(tx).__name__}")
        self.tx = tx
        self.check_finite = check_finite
        self._records, names = _records_of(params)
        self._names = names
        self._update_fns: dict[Any, Any] = {}
        self._init_slots()

    # -- layout ----------------------------------------------------------------
    def _init_slots(self) -> None:
        storages = [p.storage for p in self._records]
        self._layout = canonical_indices(storages)
        firsts = [i for i, c in enumerate(self._layout) if c == i]
        self._slot_storages: list[Storage] = [storages[i] for i in firsts]
        self._slot_of_storage = {id(s): k for k, s in enumerate(self._slot_storages)}
        if self._names is not None:
            self._slot_keys: list[Any] = [self._names[i] for i in firsts]
        else:
            self._slot_keys = list(range(len(firsts)))
        self.state = self.tx.init(self._tree([s.read_host() for s in self._slot_storages]))

    def _tree(self, values: Sequence[Any]) -> Any:
        if self._names is not None:
            return dict(zip(self._slot_keys, values))
        return list(values)

    def _leaves(self, tree: Any) -> list[Any]:
        if self._names is not None:
            return [tree[k] for k in self._slot_keys]
        return list(tree)

    @property
    def params(self) -> list[Storage]:
        """The canonical storages, one per optimizer slot, in first-registration order."""
        return list(self._slot_storages)

    @property
    def records(self) -> list[Param]:
        """Every registration given to the optimizer (tied records included)."""
        return list(self._records)

    @property
    def alias_layout(self) -> list[int | None]:
        """For each registration, the index of the first registration of its storage."""
        return list(self._layout)

    def param_tree(self) -> Any:
        """Current values as the optax params pytree (a list, or a dict by first name)."""
        return self._tree([s.read_host() for s in self._slot_storages])

    def reinit(self) -> None:
        """Re-read the alias layout of the registrations and start from fresh optimizer state."""
        self._init_slots()
        self._update_fns.clear()

    def _check_layout(self) -> None:
        now = canonical_indices([p.storage for p in self._records])
        if now == self._layout:
            stale = next((i for i, p in enumerate(self._records) if id(p.storage) not in self._slot_of_storage), None)
            if stale is not None:
                raise TapeError(
                    f"Optimizer: registration {stale} {self._records[stale]!r} now points at a storage that was not "
                    "given to the optimizer at init; existing optimizer state has no slot for it. Call opt.reinit() "
                    "to start from fresh optimizer state"
                )
            return
        first = next(i for i, (a, b) in enumerate(zip(now, self._layout)) if a != b)
        raise TapeError(
            f"Optimizer: the alias layout of its parameters changed since init (registration {first} "
            f"{self._records[first]!r} now shares storage with registration {now[first]}, was {self._layout[first]}); "
            "existing optimizer state cannot be mapped onto the new storages. Call opt.reinit() to start "
            "from fresh optimizer state"
        )

    # -- gradients -------------------------------------------------------------
    def _collect(self, grads: Any) -> list[tuple[Any, ...] | None]:
        """For each slot, the tuple of cotangents to sum (None: slot unused this step)."""
        per_slot: list[tuple[Any, ...] | None] = [None] * len(self._slot_storages)
        if isinstance(grads, Grads):
            if grads.released:
                raise TapeError("Optimizer.step: these gradients were already released; run backward again")
            for g in grads.groups:
                if g.storage is None:
                    continue
                k = self._slot_of_storage.get(id(g.storage))
                if k is None:
                    continue
                missing = [i for i in g.leaves if i not in grads.by_leaf]
                if missing:
                    raise TapeError(
                        f"Optimizer.step: missing gradient for leaf #{missing[0]} of {g.parameter!r} "
                        f"(storage used at leaves {list(g.leaves)}); nothing was updated"
                    )
                per_slot[k] = tuple(grads.by_leaf[i] for i in g.leaves)
            return per_slot
        if not isinstance(grads, Mapping):
            raise TypeError(f"Optimizer.step expects tfl.Grads or a mapping Param -> gradient, got {type(grads).__name__}")
        for key, v in grads.items():
            if isinstance(key, Param):
                st: Storage | None = key.storage
            elif isinstance(key, Storage):
                st = key
            elif self._names is not None and key in self._slot_keys:
                st = self._slot_storages[self._slot_keys.index(key)]
            else:
                raise TapeError(f"Optimizer.step: gradient key {key!r} is not one of this optimizer's parameters")
            k = self._slot_of_storage.get(id(st))
            if k is None:
                raise TapeError(f"Optimizer.step: {key!r} is not one of this optimizer's parameters")
            if v is None:
                continue
            per_slot[k] = (per_slot[k] or ()) + (v,)
        return per_slot

    def _validate(self, per_slot: list[tuple[Any, ...] | None], check_finite: bool) -> None:
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
                        f"Optimizer.step: gradient for {self._describe_slot(k)} is {R.fmt_spec((shape, dtype))} but the "
                        f"parameter is {R.fmt_spec((st.shape, st.dtype))}; nothing was updated"
                    )
                if isinstance(g, jax.Array) and g.is_deleted():
                    raise TapeError(f"Optimizer.step: gradient for {self._describe_slot(k)} was already released")
        if check_finite:
            flags = [jnp.all(jnp.isfinite(g)) for parts in per_slot if parts for g in parts]
            if flags and not bool(jnp.all(jnp.stack(flags))):
                bad = next(
                    self._describe_slot(k)
                    for k, parts in enumerate(per_slot)
                    if parts and not all(bool(jnp.all(jnp.isfinite(g))) for g in parts)
                )
                raise TapeError(f"Optimizer.step: non-finite gradient for {bad}; nothing was updated")

    def _describe_slot(self, k: int) -> str:
        return repr(self._records[self._first_record(k)])

    def _first_record(self, k: int) -> int:
        st = self._slot_storages[k]
        return next(i for i, p in enumerate(self._records) if p.storage is st)

    # -- update ----------------------------------------------------------------
    def _update_fn(self, used: tuple[bool, ...]) -> Any:
        key = used
        fn = self._update_fns.get(key)
        if fn is not None:
            return fn
        tx = self.tx
        n = len(self._slot_storages)
        container = dict if self._names is not None else list
        keys = frozenset(self._slot_keys) if self._names is not None else None
        tree = self._tree
        leaves_of = self._leaves

        def update(slot_grads: list[Any], state: Any, values: list[Any]) -> tuple[list[Any], Any]:
            grads = [slot_grads[k] if used[k] else jnp.zeros_like(values[k]) for k in range(n)]
            params = tree(values)
            updates, new_state = tx.update(tree(grads), state, params)
            new_params = optax.apply_updates(params, updates)
            new_vals = leaves_of(new_params)
            if all(used):
                return new_vals, new_state
            new_vals = [nv if used[k] else values[k] for k, nv in enumerate(new_vals)]

            def keep_unused(new: Any, old: Any) -> Any:
                if _is_slot_tree(new, n, container, keys):
                    nl, ol = leaves_of(new), leaves_of(old)
                    return tree([nl[k] if used[k] else ol[k] for k in range(n)])
                return new

            def is_slot(x: Any) -> bool:
                return _is_slot_tree(x, n, container, keys)

            new_state = jax.tree_util.tree_map(keep_unused, new_state, state, is_leaf=is_slot)
            return new_vals, new_state

        fn = self._update_fns[key] = jax.jit(update)
        return fn

    def step(self, grads: Any, *, check_finite: bool | None = None) -> None:
        """Apply one update per storage used in the recording, then free the gradients it used.

        Every gradient is validated (present, shape and dtype; finiteness when
        ``check_finite``) before any parameter changes. The gradient buffers this
        step consumed are released after the update, also when it raises; once
        every parameter group of ``grads`` is consumed the whole ``Grads`` is
        released (so two optimizers over disjoint parameters can share one).
        """
        self._check_layout()
        per_slot = self._collect(grads)
        self._validate(per_slot, self.check_finite if check_finite is None else check_finite)
        used = tuple(p is not None for p in per_slot)
        mine = (
            [g for g in grads.groups if g.storage is not None and id(g.storage) in self._slot_of_storage]
            if isinstance(grads, Grads)
            else []
        )
        if not any(used):
            if isinstance(grads, Grads):
                grads.consume(mine)
            return
        temps: list[Any] = []
        try:
            device = next(_device_of(p[0]) for p in per_slot if p is not None)
            values = [s.read(device) for s in self._slot_storages]
            slot_grads = [None if p is None else sum_in_leaf_order(p) for p in per_slot]
            temps = [g for g, p in zip(slot_grads, per_slot) if p is not None and len(p) > 1]
            fn = self._update_fn(used)
            new_vals, new_state = fn(slot_grads, self.state, values)
        finally:
            release_arrays(temps)
            if isinstance(grads, Grads):
                grads.consume(mine)  # frees what this step used; all of it once every group is used
        for k, st in enumerate(self._slot_storages):
            if used[k]:
                st.write(new_vals[k], on_device=True)
        self.state = new_state

    def __repr__(self) -> str:
        return f"Optimizer({len(self._slot_storages)} slots for {len(self._records)} registrations)"
