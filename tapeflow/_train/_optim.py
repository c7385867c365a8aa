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

import inspect
import threading
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple, TypeAlias, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._core import _compile_log
from .._core._device import device_of
from .._core._kernels import KernelCache
from .._core._result import TapeError
from .._core._typing import Array, ArrayLike, NodeId, OptState, PyTree
from .._shell._commit import commit, traced_write
from .._shell._grads import Grads, ParameterGroup, sum_in_leaf_order
from .._shell._lazy import LazyGrads
from .._shell._params import Param, Storage, canonical_indices
from .._shell._shard import replicated_on
from .._shell._state import StateLog, state_log_of
from . import _step
from ._slots import ParamCollection, SlotKey, non_trainable_of, records_of, slot_index_tree
from ._step import SlotRule, StepCall, check_parts, finish

__all__ = ["Optimizer", "ParamCollection", "SlotKey", "slot_index_tree"]

GradsLike: TypeAlias = "Grads | Mapping[Param | Storage | SlotKey, ArrayLike | None]"
"""What :meth:`Optimizer.step` accepts: a :class:`Grads`, or a mapping from a Param, a Storage or a slot key to a gradient."""


class _FusedPlan(NamedTuple):
    """An optimizer's slot mapping of one recording's parameter groups (checked against its slots once)."""

    groups: list[ParameterGroup]  # the Grads' groups it was made for (identity)
    mine: list[ParameterGroup]  # the groups that update one of this optimizer's slots
    leaves: list[tuple[NodeId, ...] | None]  # per slot, the leaves whose cotangents update it (None: unused)
    used: list[bool]


_INITS = KernelCache("optimizer_init", opaque=True)  # rule -> its transformation's init, compiled


def _init_state(rule: SlotRule, params: PyTree) -> OptState:
    """``rule.tx.init(params)`` as one compiled program per optimizer structure (shared by equal rules).

    Run eagerly, an init costs one small compile per parameter shape (each
    ``zeros_like``); compiled, it is one program, and a new optimizer of a
    structure seen before compiles nothing. An init that needs concrete values
    (Python control flow on them) runs eagerly.
    """
    fn = _INITS.hit(rule)
    if fn is None:
        init = rule.tx.init

        def optimizer_init(params: PyTree) -> OptState:
            _compile_log.traced("optimizer_init", f"optimizer state init ({len(rule.specs)} slots)", ("init", rule), ())
            return init(params)

        _INITS.put(rule, fn := jax.jit(optimizer_init))
    try:
        return fn(params)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError):
        return rule.tx.init(params)


def _free_key(key: str, taken: Mapping[str, object]) -> str:
    """``key``, or ``key`` with a suffix, that ``taken`` does not hold."""
    out, n = key, 1
    while out in taken:
        out, n = f"{key}.{n}", n + 1
    return out


def _torch_names(group: Mapping[str, Any], where: str, what: str) -> dict[str, Any]:
    """A group's hyperparameters with PyTorch's names made optax's: ``lr`` -> ``learning_rate``, ``betas`` -> ``b1``, ``b2``."""
    out: dict[str, Any] = {}
    for k, v in group.items():
        if not isinstance(k, str):
            raise TypeError(f"{where}: {what} has the key {k!r}; hyperparameters are named by strings")
        out[k] = v
    if "lr" in out:
        if "learning_rate" in out:
            raise ValueError(f"{where}: {what} gives both lr and learning_rate (the same hyperparameter); keep one")
        out["learning_rate"] = out.pop("lr")
    if "betas" in out:
        betas = out.pop("betas")
        if "b1" in out or "b2" in out:
            raise ValueError(f"{where}: {what} gives both betas and b1/b2 (the same hyperparameters); keep one")
        try:
            out["b1"], out["b2"] = betas
        except (TypeError, ValueError):
            raise ValueError(f"{where}: {what} has betas={betas!r}; PyTorch's betas is a pair (b1, b2)") from None
    return out


def _parameters_of(fn: Callable[..., object]) -> str:
    """`` (name, name, ...)`` of ``fn``'s parameters for a message, or nothing when they cannot be read."""
    try:
        return f" ({', '.join(inspect.signature(fn).parameters)})"
    except (TypeError, ValueError):
        return ""


def _is_injected(x: object) -> bool:
    """An ``optax.inject_hyperparams`` state (it holds the ``hyperparams`` dict)."""
    return isinstance(x, (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState))


def _groups_on(path: tuple[Any, ...]) -> list[Hashable]:
    """The ``optax.multi_transform`` labels along a key path (``.inner_states[label]``)."""
    return [
        key.key
        for prev, key in zip(path, path[1:])
        if isinstance(prev, jax.tree_util.GetAttrKey)
        and prev.name == "inner_states"
        and isinstance(key, jax.tree_util.DictKey)
    ]


def _hyperparam_value(old: object, value: object, what: str, where: str) -> object:
    """``value`` as ``old`` is held (dtype, shape, placement), so a compiled update takes it unchanged."""
    if isinstance(value, jax.core.Tracer):
        raise traced_write(where, f"the new value of {what}")
    try:
        arr = np.asarray(value)
    except Exception as e:
        raise TypeError(f"{where}: {what} must be a number, got {type(value).__name__}: {e}") from None
    if arr.dtype.kind not in "biuf":
        raise TypeError(
            f"{where}: {what} must be a number, got {type(value).__name__} {value!r:.60}; to follow a schedule, pass "
            "it to inject_hyperparams instead (optax.inject_hyperparams(optax.adamw)(learning_rate=schedule))"
        )
    dtype, shape = np.dtype(getattr(old, "dtype", arr.dtype)), tuple(np.shape(cast(Any, old)))
    if arr.shape != shape:
        raise ValueError(f"{where}: {what} holds a value of shape {shape}, got one of shape {arr.shape}")
    cast_ = arr.astype(dtype)
    if dtype.kind in "biu" and not np.array_equal(cast_, arr):
        raise ValueError(f"{where}: {what} is a {dtype} hyperparameter; {value!r} is not one")
    if isinstance(old, jax.Array):
        return jax.device_put(cast_, old.sharding) if old.committed else jax.device_put(cast_)
    return cast_


class Optimizer:
    """Optax transformation ``tx`` over the storages of ``params``.

    ``params`` is a sequence of :class:`Param` s, a mapping ``name -> Param`` (the
    optax params pytree is then a dict keyed by the first name of each storage,
    which ``optax.multi_transform`` labels can use), or a module with
    ``named_parameters()`` (its trainable ones: state cells such as BatchNorm's
    running statistics and frozen Params get no optimizer slot).

    * ``opt.storages``: the canonical storages, in first-registration order
      (one per slot); ``opt.params`` the first Param registered for each;
      ``opt.slot_keys`` their keys in the optax params pytree.
    * ``opt.state``: the plain optax state pytree.
    * ``opt.step(grads, check_finite=False)``: one update per used storage.
    * ``opt.update(values, state, grads, used)``: the same update as a pure,
      jit-compatible function of the slot values (what ``train_step`` compiles).
    * ``opt.lock``: steps (eager or compiled) over this optimizer from several
      threads are serialized on it, and each step's write-back is one unit.
    * ``Optimizer.from_groups(groups, base)``: PyTorch's ``param_groups``, one
      ``optax.multi_transform`` label per group.
    * ``opt.set_hyperparams(learning_rate=...)``: change a hyperparameter of an
      ``optax.inject_hyperparams`` transformation between steps, with no recompile.

    A trainable parameter that the recording did not use is skipped, as PyTorch
    skips a parameter whose ``.grad`` is None: its value and its per-parameter
    optimizer slots stay exactly as they were (global counters such as Adam's step
    count advance with every step). The per-parameter slots are located with
    :func:`optax.tree_utils.tree_map_params` (see :func:`slot_index_tree`).

    >>> import jax.numpy as jnp, optax, tapeflow as tfl
    >>> emb = tfl.Param(jnp.ones((4, 2)), name="emb")
    >>> out = tfl.tie(emb, name="out")               # tied: same storage
    >>> opt = tfl.Optimizer(optax.adam(1e-3), {"emb": emb, "out": out})
    >>> # one slot, keyed by the first name
    >>> len(opt.storages), opt.slot_keys, list(opt.state[0].mu)
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
        self._non_trainable = non_trainable_of(params)
        self._init_slots()

    @classmethod
    def from_groups(
        cls,
        groups: Sequence[Mapping[str, Any]],
        base: Callable[..., optax.GradientTransformation] = optax.adamw,
        *,
        check_finite: bool = False,
        **defaults: Any,
    ) -> Optimizer:
        """An optimizer over parameter groups with their own hyperparameters, as PyTorch's ``param_groups``.

        Each group is a dict ``{"params": ..., **hyperparameters}``: ``params`` a
        module (its trainable Params), a list of Params or a dict ``name -> Param``;
        the other keys are keyword arguments of ``base`` (an optax optimizer
        factory such as ``optax.adamw``), with PyTorch's ``lr`` meaning
        ``learning_rate`` and ``betas=(b1, b2)`` meaning ``b1=``, ``b2=``.
        ``defaults`` fill the keys a group leaves out, as in PyTorch. The result
        is a plain :class:`Optimizer` over ``optax.multi_transform({0: base(**group0),
        1: base(**group1), ...}, labels)``: its optax params pytree is a dict
        keyed by each storage's name (its path in a module, its key in a dict,
        its ``Param.name`` in a list; ``"<group>.<position>"`` where that name is
        missing or already taken), and ``opt.state.inner_states[k]`` is group
        ``k``'s optax state.

        A storage belongs to one group: the same Param (or two Params tied with
        :func:`~tapeflow.tie`, which share ``p.storage``) in two groups is a
        ``ValueError`` that names it. To change a group's learning rate between
        steps, wrap the factory: ``base=optax.inject_hyperparams(optax.adamw)``,
        then :meth:`set_hyperparams`.

        >>> import jax.numpy as jnp, optax, tapeflow as tfl
        >>> w = tfl.Param(jnp.ones((2, 2)), name="w")
        >>> b = tfl.Param(jnp.ones(2), name="b")
        >>> opt = tfl.Optimizer.from_groups(
        ...     [
        ...         {"params": [w], "weight_decay": 0.1},
        ...         {"params": [b], "lr": 1e-2, "weight_decay": 0.0},
        ...     ],
        ...     lr=1e-3,
        ... )
        >>> opt.slot_keys, list(opt.state.inner_states)
        (['w', 'b'], [0, 1])
        """
        where = "Optimizer.from_groups"
        if isinstance(groups, (Mapping, str)) or not isinstance(groups, Sequence) or not groups:
            raise TypeError(
                f"{where}: groups must be a non-empty list of dicts such as {{'params': model_or_params, 'lr': 1e-3}}, "
                f"got {type(groups).__name__}"
            )
        base_name = getattr(base, "__qualname__", None) or repr(base)
        named: dict[str, Param] = {}  # every registration, under a distinct key (the Optimizer's params)
        non_trainable: list[Param] = []  # the groups' modules' buffers and frozen Params
        owner: dict[int, tuple[int, str, Param]] = {}  # storage -> (its group, its key, its first Param)
        labels: dict[str, int] = {}  # slot key -> group
        transforms: dict[int, optax.GradientTransformation] = {}
        for g, group in enumerate(groups):
            if not isinstance(group, Mapping) or "params" not in group:
                raise TypeError(
                    f"{where}: group {g} is {type(group).__name__}"
                    f"{'' if not isinstance(group, Mapping) else ' without a params entry'}; each group is a dict "
                    "with 'params' (a module, a list of Params or a dict name -> Param) and its hyperparameters, "
                    "e.g. {'params': no_decay, 'weight_decay': 0.0}"
                )
            try:
                recs, names = records_of(group["params"])
            except TypeError as e:
                raise TypeError(f"{where}: group {g}: {e}") from e
            non_trainable += non_trainable_of(group["params"])
            for j, p in enumerate(recs):
                name = names[j] if names is not None else p.name
                key = name if name and name not in named else _free_key(f"{g}.{j}", named)
                first = owner.get(id(p.storage))
                if first is not None and first[0] != g:
                    raise ValueError(
                        f"{where}: {first[2]!r} is in group {first[0]} (as {first[1]!r}) and in group {g} (as "
                        f"{key!r}); an optimizer updates a storage once, with one group's hyperparameters (Params "
                        "tied with tfl.tie share one storage, p.storage): put it in one group only"
                    )
                named[key] = p
                if first is None:
                    owner[id(p.storage)] = (g, key, p)
                    labels[key] = g
        for g, group in enumerate(groups):  # every group's parameters are checked before any transformation is built
            kwargs = {**_torch_names(defaults, where, "defaults"), **_torch_names(group, where, f"group {g}")}
            kwargs.pop("params", None)
            try:
                transforms[g] = base(**kwargs)
            except TypeError as e:
                raise TypeError(
                    f"{where}: group {g}: {base_name}(**{kwargs}) failed ({e}); a group's keys other than 'params' "
                    f"are keyword arguments of base{_parameters_of(base)}, and values every group shares can "
                    "be given once: Optimizer.from_groups(groups, lr=1e-3)"
                ) from e
        opt = cls(optax.multi_transform(transforms, labels), named, check_finite=check_finite)
        opt._non_trainable = non_trainable
        return opt

    def set_hyperparams(self, *, group: Hashable | None = None, **values: ArrayLike) -> None:
        """Change hyperparameters of an ``optax.inject_hyperparams`` transformation between steps.

        ``opt.set_hyperparams(learning_rate=3e-4)`` writes the value into the
        ``hyperparams`` of the optimizer state's ``inject_hyperparams`` part
        (``opt.state.hyperparams["learning_rate"]`` for
        ``tx = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3)``),
        converted to the dtype, shape and placement of the value it replaces, so
        the next eager step and the next :func:`~tapeflow.train_step` call use it
        without compiling again (a plain Python float written into the dict by
        hand would change the program's signature and compile it again). For an
        optimizer over several groups (:meth:`from_groups` with
        ``base=optax.inject_hyperparams(optax.adamw)``, or any
        ``optax.multi_transform`` of them) it sets every group, as PyTorch's
        ``for g in opt.param_groups: g["lr"] = lr``; ``group=k`` sets only group
        ``k``.

        Everything is checked first (each name is a hyperparameter of every part
        it sets and not one a schedule recomputes each step; each value is a
        number that fits), then the new state is written through the one commit:
        all of it, or nothing. A scheduled hyperparameter (passed to
        ``inject_hyperparams`` as a function of the step count) follows its
        schedule; ``opt.state.hyperparams`` shows its current value.

        >>> import jax.numpy as jnp, optax, tapeflow as tfl
        >>> w = tfl.Param(jnp.array(1.0), name="w")
        >>> sgd = optax.inject_hyperparams(optax.sgd)
        >>> opt = tfl.Optimizer(sgd(learning_rate=0.5), [w])
        >>> opt.set_hyperparams(learning_rate=0.25)
        >>> with tfl.Session() as s:
        ...     opt.step(s.backward(w * 2.0))
        >>> lr = opt.state.hyperparams["learning_rate"]
        >>> float(w.value), float(lr)  # 1.0 - 0.25 * 2.0
        (0.5, 0.25)
        """
        where = "Optimizer.set_hyperparams"
        if not values:
            raise TypeError(f"{where}: no values given; name them, e.g. opt.set_hyperparams(learning_rate=3e-4)")
        with self.lock:
            state = self.state
            leaves, treedef = jax.tree_util.tree_flatten(state, is_leaf=_is_injected)
            paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_injected)[0]]
            found = [i for i, leaf in enumerate(leaves) if _is_injected(leaf)]
            if not found:
                raise TypeError(
                    f"{where}: this optimizer's state ({type(state).__name__}) holds no optax.inject_hyperparams "
                    "state, so its hyperparameters are constants of the update; build the transformation with "
                    "optax.inject_hyperparams, e.g. tfl.Optimizer(optax.inject_hyperparams(optax.adamw)"
                    "(learning_rate=1e-3), model), or Optimizer.from_groups(groups, "
                    "base=optax.inject_hyperparams(optax.adamw))"
                )
            if group is not None:
                known = list(dict.fromkeys(g for i in found for g in _groups_on(paths[i])))
                found = [i for i in found if group in _groups_on(paths[i])]
                if not found:
                    raise ValueError(
                        f"{where}: no group {group!r} with an inject_hyperparams state; "
                        + (
                            f"this optimizer's groups are {known}"
                            if known
                            else "this optimizer's state has no groups (optax.multi_transform): call without group="
                        )
                    )
            new = list(leaves)
            for i in found:
                node = leaves[i]
                at = f"opt.state{jax.tree_util.keystr(paths[i])}"
                hyper = dict(node.hyperparams)
                scheduled = getattr(node, "hyperparams_states", None) or {}
                for name, value in values.items():
                    if name not in hyper:
                        raise TypeError(
                            f"{where}: {name!r} is not a hyperparameter of {at}; its hyperparameters are "
                            f"{sorted(hyper)} (only numeric arguments of the inject_hyperparams factory are)"
                        )
                    if name in scheduled:
                        raise ValueError(
                            f"{where}: {name!r} of {at} follows a schedule, which sets it again from the step "
                            "count at every step; pass a number for it to inject_hyperparams to set it by hand, "
                            "or give the schedule the values you want"
                        )
                    hyper[name] = _hyperparam_value(hyper[name], value, f"{name!r} of {at}", where)
                new[i] = type(node)(*[hyper if field is node.hyperparams else field for field in node])
            commit(where=where, then=[partial(setattr, self, "state", jax.tree_util.tree_unflatten(treedef, new))])

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
        self.rule = SlotRule.of(
            self, self.tx, tuple(self._slot_specs), None if self._names is None else tuple(self._slot_keys)
        )
        self._fused_plan: _FusedPlan | None = None  # the last fused step's slot mapping (valid for its groups)
        # the fused step's static argument, made once per rule and finite check (a lazy program's key and jit's
        # static argument then match it by identity)
        self._step_call: StepCall | None = None
        params = self.param_tree()
        if any(st.pinned is not None for st in self._slot_storages):
            # born where its storages live: a state that does not fit one device is never whole on one
            shardings = self.placed_state(jax.eval_shape(self.tx.init, params), put=lambda _, sharding: sharding)
            self.state: OptState = jax.jit(self.tx.init, out_shardings=shardings)(params)
        else:
            self.state = _init_state(self.rule, params)
        # the pins the state follows: a step whose Storage.pin_epoch differs calls follow_placement first
        self.placement_epoch = Storage.pin_epoch

    def placed_state(
        self,
        state: OptState | None = None,
        put: Callable[[Array, jax.sharding.Sharding], Array] = jax.device_put,
    ) -> OptState:
        """``state`` (default :attr:`state`) with each part put where its storage lives: ``put(part, sharding)``.

        Only when some storage was placed by :func:`tfl.shard <tapeflow.shard>`
        (:attr:`Storage.pinned`): a per-parameter part of a pinned storage's
        shape (Adam's moments, a momentum trace) takes that storage's sharding;
        every other part (step counts, hyperparameters, parts of storages that
        were not placed) is replicated over the same devices. Without pinned
        storages ``state`` is returned as it is. ``put`` is ``jax.device_put``
        outside a program, ``jax.lax.with_sharding_constraint`` inside one.

        >>> import jax, jax.numpy as jnp, numpy as np, optax, tapeflow as tfl
        >>> w = tfl.Param(jnp.ones((4, 2)), name="w")
        >>> tfl.shard([w], jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)))
        >>> opt = tfl.Optimizer(optax.adam(0.1), [w])
        >>> opt.placed_state()[0].mu[0].sharding == w.sharding   # its storage's
        True
        """
        if state is None:
            state = self.state
        storages = self._slot_storages
        pins = [st.pinned for st in storages]
        first = next((p for p in pins if p is not None), None)
        if first is None:
            return state
        whole = replicated_on(first)

        def place_part(k: int, part: PyTree) -> PyTree:
            def one(x: PyTree) -> PyTree:
                if not hasattr(x, "shape"):
                    return x
                pin = pins[k] if k >= 0 and tuple(x.shape) == storages[k].shape else None
                target = whole if pin is None else pin
                if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.sharding == target:
                    return x
                return put(x, target)

            return jax.tree_util.tree_map(one, part)

        return jax.tree_util.tree_map(place_part, self.slot_indices(state), state)

    def follow_placement(self) -> None:
        """Put the state where its storages live (:meth:`placed_state`) if a storage was placed since it last did.

        Every step calls it first when :attr:`Storage.pin_epoch` is not
        :attr:`placement_epoch` (the pins the state was placed by), so an
        optimizer built before :func:`tfl.shard <tapeflow.shard>` follows the placement.

        >>> import jax.numpy as jnp, optax, tapeflow as tfl
        >>> opt = tfl.Optimizer(optax.adam(0.1), [tfl.Param(jnp.ones(2))])
        >>> opt.follow_placement()  # nothing was placed: nothing to do
        """
        epoch = Storage.pin_epoch
        if self.placement_epoch == epoch:
            return
        new = self.placed_state()
        if new is not self.state:
            commit(where="Optimizer.follow_placement", then=[partial(setattr, self, "state", new)])
        self.placement_epoch = epoch

    def _tree(self, values: Sequence[object]) -> PyTree:
        if self._names is not None:
            return dict(zip(self._slot_keys, values))
        return list(values)

    @property
    def storages(self) -> list[Storage]:
        """The canonical storages, one per optimizer slot, in first-registration order."""
        return list(self._slot_storages)

    @property
    def params(self) -> list[Param]:
        """The Params the optimizer updates, one per slot: the first registration of each storage, in slot order.

        >>> import jax.numpy as jnp, optax, tapeflow as tfl
        >>> emb = tfl.Param(jnp.ones(2), name="emb")
        >>> opt = tfl.Optimizer(optax.sgd(0.1), [emb, tfl.tie(emb, name="out")])
        >>> [p.name for p in opt.params], opt.params[0].storage is opt.storages[0]
        (['emb'], True)
        """
        first = {id(st): k for k, st in enumerate(self._slot_storages)}
        out: list[Param | None] = [None] * len(self._slot_storages)
        for p in self._records:
            k = first.get(id(p.storage))
            if k is not None and out[k] is None:
                out[k] = p
        return [p for p in out if p is not None]

    @property
    def slot_keys(self) -> list[SlotKey]:
        """The key of each slot in the optax params pytree: the first name of its storage, or its position."""
        return list(self._slot_keys)

    @property
    def records(self) -> list[Param]:
        """Every registration given to the optimizer (tied records included)."""
        return list(self._records)

    @property
    def non_trainable_params(self) -> list[Param]:
        """The Params of the module(s) it was built from that it does not update: frozen Params, then buffers.

        The forward reads them, and writes buffers such as BatchNorm's running
        statistics, without a slot; :func:`~tapeflow.train_step` passes them to its
        program as inputs from the first trace on. Empty for an optimizer built
        from Params (a list or a dict), which names only what it trains.

        >>> import optax, tapeflow as tfl
        >>> opt = tfl.Optimizer(optax.sgd(0.1), tfl.nn.BatchNorm1d(2))
        >>> [p.name for p in opt.params], [p.name for p in opt.non_trainable_params]
        (['weight', 'bias'], ['running_mean', 'running_var', 'num_batches_tracked'])
        """
        return list(self._non_trainable)

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

    def describe(self, k: int | None = None) -> str:
        """Slot ``k`` as error messages name it (the repr of its storage's first registration); every slot without ``k``.

        >>> import jax.numpy as jnp, optax, tapeflow as tfl
        >>> w = tfl.Param(jnp.ones(2), name="w")
        >>> opt = tfl.Optimizer(optax.sgd(0.1), {"w": w})
        >>> print(opt.describe())
        slot 0 ('w'): Param('w', float32[2], storage=#...)
        """
        if k is None:
            named = [f" ({key!r})" if isinstance(key, str) else "" for key in self._slot_keys]
            return "\n".join(f"slot {i}{name}: {self.describe(i)}" for i, name in enumerate(named))
        st = self._slot_storages[k]
        return repr(next(p for p in self._records if p.storage is st))

    def reinit(self) -> None:
        """Re-read the alias layout of the registrations and start from fresh optimizer state."""
        self._init_slots()

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
        >>> params = [tfl.Param(jnp.ones(2)), tfl.Param(jnp.ones(3))]
        >>> opt = tfl.Optimizer(optax.sgd(0.1, momentum=0.9), params)
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
        """For each slot, the cotangents that update it (None: slot unused this step), and its group for a Grads."""
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
        """The parameter group of ``grads`` that updates each slot (None: the recording did not use it).

        The groups outlive a release, so an optimizer none of whose Params the
        recording used finds nothing to do whether it steps before or after the
        step that released ``grads``.
        """
        groups: list[ParameterGroup | None] = [None] * len(self._slot_storages)
        for g in grads.groups:
            if g.storage is None:
                self._refuse_storageless(g)
            elif (k := self._slot_of_storage.get(id(g.storage))) is not None:
                groups[k] = g
        if grads.released and any(g is not None for g in groups):
            raise TapeError(
                "Optimizer.step: these gradients were already released (an optimizer step used them, or "
                "release() was called); a Grads updates each storage once: to update the same Params with a "
                "second optimizer, run backward again for it, or give each optimizer its own Params"
            )
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

    # -- update ----------------------------------------------------------------
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
        count (as in :meth:`step`). Nothing is read or written: this is
        :func:`tapeflow._train._step.step`, the update every training path runs, compiled
        once per ``used`` pattern; it can be called inside ``jax.jit``.

        >>> import jax.numpy as jnp, optax, tapeflow as tfl
        >>> params = [tfl.Param(jnp.ones(2)), tfl.Param(jnp.ones(1))]
        >>> opt = tfl.Optimizer(optax.sgd(0.5), params)
        >>> grads = [jnp.ones(2), None]
        >>> vals, state = opt.update([jnp.ones(2), jnp.ones(1)], opt.state, grads)
        >>> [v.tolist() for v in vals]
        [[0.5, 0.5], [1.0]]
        """
        n = len(self._slot_storages)
        if len(values) != n or len(grads) != n:
            raise ValueError(
                f"Optimizer.update: expected {n} values and gradients (one per slot), got {len(values)} and {len(grads)}"
            )
        mask = [g is not None for g in grads] if used is None else [bool(u) for u in used]
        parts = [
            None if not m else ((jnp.zeros(self.rule.specs[k][0], self.rule.specs[k][1]) if g is None else g),)
            for k, (g, m) in enumerate(zip(grads, mask))
        ]
        out = _step.STEP(self.rule, parts, list(values), state, check_finite=False)
        return out.values, out.state

    def step(self, grads: GradsLike, *, check_finite: bool | None = None) -> None:
        """Apply one update per storage used in the recording, then free the gradients it used.

        Every gradient is validated (present, shape and dtype; with
        ``check_finite``, that each storage's summed gradient is finite) before
        any parameter changes; a refused step leaves the gradients readable. The
        gradient buffers this step consumed are released after the update, also
        when the update raises; once every parameter group of ``grads`` is
        consumed the whole ``Grads`` is released (so two optimizers over disjoint
        parameters can share one). Steps from several threads are serialized on
        :attr:`lock`. What the step computes and writes is :mod:`tapeflow._train._step`,
        shared with a lazy session's fused step and :func:`~tapeflow.train_step`.

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
                self._run(grads, check_finite, log)
            except BaseException:
                if log is not None:
                    log.undo()  # nothing once committed: the step's write-back had completed
                raise
        if isinstance(grads, Grads):
            grads.stepped()

    def _run(self, grads: GradsLike, check_finite: bool | None, log: StateLog | None) -> None:
        storages = self.check_layout()
        if self.placement_epoch != Storage.pin_epoch:
            self.follow_placement()
        check = self.check_finite if check_finite is None else check_finite
        then = () if log is None else (log.commit,)
        nf = grads.check if isinstance(grads, Grads) else None
        debug = nf is not None and nf.debug  # debug_nans: every step is checked, the loss too
        explain = None if nf is None else nf.error
        fusable = isinstance(grads, Grads) and isinstance(grads.pending, LazyGrads)
        if fusable and self._fused(cast(Grads, grads), check or debug, then, debug, explain):
            return
        parts, groups = self._collect(grads)
        check_parts(self.rule, parts, "Optimizer.step")
        used = [p is not None for p in parts]
        mine = [g for g in groups if g is not None]
        if not any(used):
            if isinstance(grads, Grads):
                grads.consume(mine)
            commit(where="Optimizer.step", then=then)
            return
        try:
            device = next(device_of(p[0]) for p in parts if p is not None)
            values = [s.read(device) for s in storages]
            # summed here, as grads[param] sums them (bit-identical to it), then handed to the step as one part
            if isinstance(grads, Grads):
                parts = [None if g is None else (grads.group_value(g),) for g in groups]
            else:
                parts = [None if p is None else (sum_in_leaf_order(p),) for p in parts]
            out = _step.STEP(self.rule, parts, values, self.state, check_finite=check)
        except BaseException:
            if isinstance(grads, Grads):
                grads.consume(mine)  # a failed update still lets go of the gradients it used
            raise
        finish(self.rule, storages, out, used, "Optimizer.step", self, then=then, explain=explain)
        if isinstance(grads, Grads):
            grads.consume(mine)  # lets go of what this step used; of everything once every group is used

    def _fused(
        self,
        grads: Grads,
        check_finite: bool,
        then: Sequence[Callable[[], None]],
        debug: bool = False,
        explain: Callable[[str], TapeError] | None = None,
    ) -> bool:
        """A lazy session's unread gradients and the step as one program (as ``train_step``); False: not fusable.

        It fuses when this optimizer consumes every parameter group of ``grads``
        (else they are computed once and shared, as eagerly); the checks and the
        write-back are :mod:`tapeflow._train._step`'s, as in :meth:`step`.
        """
        lazy = cast(LazyGrads, grads.pending)
        plan = self._fused_plan
        if plan is None or plan.groups is not grads.groups or grads.released:
            # the slot mapping and its checks: worked out once per recording structure (a session's
            # BackwardPlan hands every step of one structure the same groups)
            groups = self._slot_groups(grads)
            mine = [g for g in groups if g is not None]
            if not mine or len(mine) != sum(g.storage is not None for g in grads.groups):
                return False
            leaves = [None if g is None else g.leaves for g in groups]
            nodes = lazy.tape.nodes
            parts = [None if ls is None else tuple(nodes[i] for i in ls) for ls in leaves]
            check_parts(self.rule, parts, "Optimizer.step")
            plan = self._fused_plan = _FusedPlan(grads.groups, mine, leaves, [ls is not None for ls in leaves])
        mine, leaves, used = plan.mine, plan.leaves, plan.used
        grads.pending = None  # consumed by this step, read or not
        try:
            storages = self._slot_storages
            device = device_of(lazy.leaf_value(mine[0].leaves[0]))  # where the recording's leaves live
            current = device is not None and Storage.all_on(storages, device)
            # every current value on the leaves' device (the usual step): read as they are, in one call
            values = Storage.read_current_many(storages) if current else [st.read(device) for st in storages]
            if not current:
                current = all(v is st.read_current() for v, st in zip(values, storages))
            call = self._step_call
            if call is None or call.rule is not self.rule or call.check_finite is not check_finite:
                call = self._step_call = StepCall(self.rule, check_finite)
            out = lazy.step(leaves, call, values, self.state, with_loss=debug)
        except BaseException:
            grads.consume(mine)  # as step: a failed update still lets go of the gradients it used
            raise
        # the fast write replaces each current cell in place where the program's result lives on that cell's
        # device (commit checks each); a recording over several devices (a mesh-sharded input) hands back
        # values placed by XLA, which commit installs as it does an eager step's
        try:
            finish(
                self.rule,
                storages,
                out,
                used,
                "Optimizer.step",
                self,
                replacing=values if current else None,
                then=then,
                traced=True,
                explain=explain,
            )
        except BaseException:
            grads.pending = lazy  # as step: a refused step leaves the gradients readable
            raise
        grads.release()  # every storage group was this step's (consume(mine) would end in the same release)
        return True

    def __repr__(self) -> str:
        return f"Optimizer({len(self._slot_storages)} slots for {len(self._records)} registrations)"
