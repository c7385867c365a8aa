"""The functional bridge: session model code as pure functions for ``jax.jit``.

The same ``loss_fn(session, *args) -> scalar Tensor`` that runs eagerly in a
notebook becomes

* :func:`value_and_grad`: a pure ``(params, *args) -> (loss, grads)`` over a
  pytree of parameters, composable with ``jax.jit``, ``jax.vmap``,
  ``jax.lax.scan`` and hand-written optax code;
* :func:`train_step`: forward, backward, per-storage gradient sums and the
  optax update as **one** compiled XLA program, writing the results back into
  the :class:`~tapeflow.Param` storages and the :class:`~tapeflow.Optimizer`.

Both trace the session code once per input signature: the tape is recorded on
tracers, differentiated with the same registry VJPs, and the Python graph walk
disappears from the compiled program.
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple, TypeAlias, TypedDict, Unpack, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._core import _compile_log
from .._core import _registry as R
from .._core._checks import is_int
from .._core._compile_log import SigEntry
from .._core._device import concrete_array_type
from .._core._interrupts import deferred_interrupts
from .._core._nonfinite import NonFiniteError
from .._core._result import TapeError
from .._core._tiered import maybe_tiered
from .._core._typing import Array, DTypeLike, OptState, PRNGKey, PyTree
from .._shell._commit import traced_write
from .._shell._debug import debug_nans_default, finite_flag
from .._shell._grads import global_norm_of
from .._shell._params import Param, Storage, canonical_indices
from .._shell._random import RNG_SEED_RANGE
from .._shell._session import Session, traced_session
from .._shell._shard import replicated_on
from .._shell._state import ModeOwner, mode_reads
from .._shell._tensor import Tensor
from .._shell._values import foreign_array
from . import _step
from ._optim import Optimizer
from ._slots import SlotKey
from ._step import StepOutcome, check_parts, finish

__all__ = ["TrainStep", "TrainStepOptions", "param_values", "train_step", "value_and_grad"]

LossFn: TypeAlias = Callable[..., "Tensor | tuple[Tensor, PyTree]"]
"""``loss_fn(session, *args, **kwargs)``: a scalar Tensor recorded on ``session`` (or ``(loss, aux)`` with ``has_aux``)."""

ParamSpecKey: TypeAlias = "Param | Storage | str"
"""A key of ``train_step(param_specs=...)``: a Param, its Storage, or its name in the optimizer's params tree."""


def _is_param(x: object) -> bool:
    return isinstance(x, Param)


def param_values(params: PyTree) -> PyTree:
    """The current values of a pytree of Params (same structure, arrays at the leaves).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> tfl.param_values({"w": tfl.Param(jnp.ones(2))})["w"].tolist()
    [1.0, 1.0]
    """
    return jax.tree_util.tree_map(lambda p: p.value, params, is_leaf=_is_param)


def _trace_loss(
    loss_fn: LossFn,
    has_aux: bool,
    overrides: dict[Storage, Array],
    key: PRNGKey | None,
    args: tuple[PyTree, ...],
    kwargs: dict[str, PyTree],
    compute_dtype: DTypeLike | None = None,
    debug_nans: bool = False,
) -> tuple[Session, Tensor, PyTree]:
    s = traced_session(overrides, key, compute_dtype, debug_nans)
    with s.as_current():
        out: PyTree = loss_fn(s, *args, **kwargs)
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TapeError("value_and_grad(has_aux=True): loss_fn must return (loss, aux)")
        loss, aux = out
    else:
        loss, aux = out, None
    if not isinstance(loss, Tensor):
        raise TapeError(
            f"loss_fn must return a scalar tfl.Tensor recorded on the session it was given, got {type(loss).__name__}"
        )
    s.check(loss)
    if loss.shape != ():
        raise TapeError(
            f"loss_fn must return a scalar; got a tensor of shape {loss.shape} (reduce it with tfl.mean or tfl.sum)"
        )
    aux = jax.tree_util.tree_map(
        lambda a: a.value if isinstance(a, Tensor) else a, aux, is_leaf=lambda a: isinstance(a, Tensor)
    )
    return s, loss, aux


def _storage_grads(s: Session, loss: Tensor, storages: Sequence[Storage]) -> tuple[list[Array], tuple[bool, ...]]:
    """Backward, then one gradient per storage (leaf cotangents summed in leaf order).

    Also returns which storages the recording used; an unused one gets zeros.
    """
    summed = s.backward(loss).storage_gradients(storages)
    out = [jnp.zeros(st.shape, st.dtype) if v is None else v for st, v in zip(storages, summed)]
    return out, tuple(v is not None for v in summed)


def _leaf_path(params: PyTree, i: int) -> str:
    """``['name'][0]``-style path of leaf ``i`` of ``params`` (Params are leaves), for error messages."""
    path = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_param)[0][i][0]
    return jax.tree_util.keystr(path)


def _origin_error(message: str, rerun: tuple[Session, Tensor, PyTree]) -> NonFiniteError:
    """A :class:`NonFiniteError` for a compiled call that was not finite, explained by ``rerun``.

    ``rerun`` is :func:`_trace_loss` of the call's own values (the parameters it
    was given, its batch, its random key), run op by op, so the recording is the
    one the program computed.
    """
    s, loss, _ = rerun
    return NonFiniteError(message, s.nonfinite_origin(loss))


def value_and_grad(
    loss_fn: LossFn,
    *,
    has_aux: bool = False,
    has_state: bool = False,
    compute_dtype: DTypeLike | None = None,
    debug_nans: bool | None = None,
) -> Callable[..., tuple[PyTree, ...]]:
    """Turn ``loss_fn(session, *args)`` into a pure ``f(params, *args) -> (loss, grads)``.

    ``params`` is any pytree whose leaves are :class:`Param` s (a dict by name, a
    list, a module's ``param_dict()``); they give the values of their
    storages for this call, whichever record of a storage ``loss_fn`` uses.
    ``grads`` has the same structure, with one array per Param: the cotangents of
    every use of that storage summed in recording order, exactly as
    :meth:`Session.backward` and :class:`Optimizer` do. Each storage may appear
    only once in ``params`` (tied records resolve to it).

    With ``has_aux=True`` ``loss_fn`` returns ``(loss, aux)`` and ``f`` returns
    ``((loss, aux), grads)``; Tensors inside ``aux`` come back as arrays.
    A keyword argument ``rng`` (a ``jax.random`` key) seeds the session's random
    tensors for the call. Under a JAX transformation every Param ``loss_fn``
    reads must be in ``params``: one read at its current value would be baked
    into the compiled program, so it is refused with a :class:`TapeError`.

    ``f`` never writes a storage. State cells that ``loss_fn`` assigns
    (:meth:`Session.assign_state`: BatchNorm's running statistics in train
    mode) need ``has_state=True``: ``f`` then returns ``(loss, grads, state)``
    (``((loss, aux), grads, state)`` with ``has_aux``), where ``state`` has the
    structure of ``params`` and holds the new value of each assigned Param and
    None for the others; write it back yourself (``p.value = v``) when the step
    is accepted. Without ``has_state`` an assignment is refused with a
    :class:`TapeError` rather than dropped; every assigned Param must be in
    ``params``. ``compute_dtype`` sets the session's mixed-precision policy,
    as ``Session(compute_dtype=...)``.

    ``debug_nans=True`` (None: the environment variable ``TAPEFLOW_DEBUG_NANS``)
    checks the loss and the gradients of every call: a non-finite one raises
    :class:`~tapeflow.NonFiniteError` naming the op that made the first
    non-finite value (``loss_fn`` is run again op by op on the call's values to
    find it). Called under ``jax.jit`` the check runs inside the program, and
    JAX reports the error as a ``JaxRuntimeError`` whose message holds the
    ``NonFiniteError``'s text.

    >>> import jax, jax.numpy as jnp, tapeflow as tfl
    >>> w = tfl.Param(jnp.array([1.0, 2.0]), name="w")
    >>> def loss_fn(s, x):
    ...     return tfl.sum(w * x * w)
    >>> f = jax.jit(tfl.value_and_grad(loss_fn))
    >>> loss, g = f({"w": w}, jnp.array([3.0, 1.0]))
    >>> float(loss), g["w"].tolist()
    (7.0, [6.0, 4.0])
    """

    def f(params: PyTree, *args: PyTree, rng: PRNGKey | None = None, **kwargs: PyTree) -> tuple[PyTree, PyTree]:
        leaves, treedef = jax.tree_util.tree_flatten(params, is_leaf=_is_param)
        bad = [i for i, p in enumerate(leaves) if not isinstance(p, Param)]
        if bad:
            i = bad[0]
            raise TypeError(
                f"value_and_grad: params{_leaf_path(params, i)} is {type(leaves[i]).__name__}; pass a pytree of tfl.Param "
                "(e.g. {'w': w}) so each value is tied to its storage"
            )
        canon = canonical_indices([p.storage for p in leaves])
        for i, c in enumerate(canon):
            if c is not None and c != i:
                raise TapeError(
                    f"value_and_grad: params{_leaf_path(params, c)} and params{_leaf_path(params, i)} "
                    f"({leaves[c]!r}, {leaves[i]!r}) share one storage; pass each storage once (tied records resolve to it)"
                )
        storages = [p.storage for p in leaves]
        overrides = {p.storage: p.value for p in leaves}
        s, loss, aux = _trace_loss(loss_fn, has_aux, overrides, rng, args, kwargs, compute_dtype, debug)
        unlisted = s.unlisted_storages
        if unlisted and any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((leaves, args, kwargs))):
            raise TapeError(
                f"value_and_grad: loss_fn read {len(unlisted)} Param storage(s) not in params ({unlisted[0]!r} first) "
                "while being traced: the compiled program would keep the value read now as a constant and ignore "
                "later changes. Pass those Params in params (their gradients are returned too), or pass their "
                "values as arguments (tfl.param_values(...))"
            )
        writes = s.state_writes
        if writes and not has_state:
            first = next(iter(writes))
            raise TapeError(
                f"value_and_grad: loss_fn assigned {len(writes)} state cell(s) ({first!r} first; e.g. BatchNorm's "
                "running statistics in train mode). Pass has_state=True to get their new values back, or put the "
                "module in eval mode (module.eval())"
            )
        listed = set(storages)
        outside = [st for st in writes if st not in listed]
        if outside:
            raise TapeError(
                f"value_and_grad(has_state=True): loss_fn assigned {outside[0]!r}, which is not in params; pass "
                "every state cell in params (a module's param_dict() lists its running statistics)"
            )
        gl, _ = _storage_grads(s, loss, storages)
        # a storage placed by tfl.shard gets its gradient on its own sharding (FSDP: reduce-scattered, not gathered)
        gl = [
            jax.lax.with_sharding_constraint(g, st.pinned)
            if st.pinned is not None and isinstance(g, jax.core.Tracer)
            else g
            for st, g in zip(storages, gl)
        ]
        value = s.node(loss).value
        if debug:
            _check_call(storages, [p.value for p in leaves], s.index_guard(value), gl, rng, args, kwargs)
        grads = jax.tree_util.tree_unflatten(treedef, gl)
        out = ((value, aux), grads) if has_aux else (value, grads)
        if not has_state:
            return out
        state = jax.tree_util.tree_unflatten(treedef, [writes.get(st) for st in storages])
        return (*out, state)

    def _check_call(
        storages: list[Storage],
        values: list[Array],
        loss: Array,
        grads: list[Array],
        rng: PRNGKey | None,
        args: tuple[PyTree, ...],
        kwargs: dict[str, PyTree],
    ) -> None:
        message = "value_and_grad: the loss or a gradient is not finite (debug_nans)"

        def raise_if_bad(ok: Array, values: list[Array], rng: PRNGKey | None, args: PyTree, kwargs: PyTree) -> None:
            if not bool(ok):
                overrides = dict(zip(storages, values))
                rerun = _trace_loss(loss_fn, has_aux, overrides, rng, args, kwargs, compute_dtype, debug_nans=True)
                raise _origin_error(message, rerun)

        checked = [loss, *grads]
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((checked, values, args, kwargs))):
            flag = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in checked if R.is_float(np.dtype(x.dtype))]))
            jax.debug.callback(raise_if_bad, flag, values, rng, args, kwargs)  # the search runs on the host
        else:
            raise_if_bad(np.asarray(finite_flag(checked)), values, rng, args, kwargs)

    debug = debug_nans_default(debug_nans)
    functools.update_wrapper(f, loss_fn, assigned=("__name__", "__qualname__", "__doc__"), updated=())
    return f


def _log_signature(
    args: tuple[PyTree, ...],
    kwargs: dict[str, PyTree],
    static_kwargs: tuple[tuple[str, Hashable], ...],
    extra_values: list[Array],
    modes: tuple[tuple[int, bool], ...],
    check_finite: bool,
) -> list[SigEntry]:
    """What a ``train_step`` compile depends on, labelled for the compile log (``argument 1``, ``argument y['mask']``)."""
    named: list[tuple[str, object]] = []
    for path, x in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
        where, rest = path[0], path[1:]
        top = f"argument {rest[0].idx}" if where.idx == 0 else f"argument {rest[0].key}"
        named.append((top + jax.tree_util.keystr(rest[1:]), x))
    sig = _compile_log.arrays(named)
    sig += [(f"argument {k}", "static value", v) for k, v in static_kwargs]
    sig.append(("Params read outside the optimizer", "static value", len(extra_values)))
    sig.append(("train/eval modes", "static value", tuple(t for _, t in modes)))
    sig.append(("check_finite", "static value", check_finite))
    return sig


class _Retrace(Exception):
    """Raised inside a trace that read Params the optimizer does not own and the step did not pass (it carries them)."""

    def __init__(self, storages: tuple[Storage, ...]) -> None:
        super().__init__(f"{len(storages)} storage(s) to pass as arguments")
        self.storages = storages


class TrainStepOptions(TypedDict, total=False):
    """The keyword options of :func:`train_step` (and :class:`TrainStep`); see :func:`train_step`.

    >>> sorted(TrainStepOptions.__annotations__)  # doctest: +NORMALIZE_WHITESPACE
    ['compute_dtype', 'data_axis', 'debug_nans', 'donate', 'has_aux', 'mesh',
     'microbatches', 'param_specs', 'return_stats', 'seed', 'static_argnames']
    """

    mesh: Mesh | None
    data_axis: str | None
    param_specs: Mapping[ParamSpecKey, PartitionSpec] | None
    donate: bool
    has_aux: bool
    seed: int
    static_argnames: tuple[str, ...] | list[str] | str
    compute_dtype: DTypeLike | None
    debug_nans: bool | None
    microbatches: int
    return_stats: bool


class StepStats(NamedTuple):
    """What ``train_step(..., return_stats=True)`` returns beside the loss, from the same program.

    ``grad_norm``: the global L2 norm of the gradients the update used (each
    storage once, before any clipping inside the optax chain), as
    :meth:`Grads.global_norm`; ``update_norm``: the L2 norm of the change of
    the parameters (0 for a refused step).
    """

    grad_norm: Array
    update_norm: Array


def _split(tree: PyTree, k: int, where: str) -> tuple[list[Array], Callable[[list[Array]], PyTree]]:
    """The array leaves of ``tree`` cut into ``k`` microbatches along axis 0 (leading axis ``k``), and a rebuild.

    Leaves that are not arrays of rank >= 1 (Python numbers, flags) are the
    same for every microbatch.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    cut = [i for i, x in enumerate(leaves) if hasattr(x, "shape") and len(x.shape) >= 1]
    xs = []
    for i in cut:
        x = leaves[i]
        if x.shape[0] % k:
            raise TapeError(
                f"{where}: argument leaf {i} has {x.shape[0]} rows along its first axis, which do not split into "
                f"microbatches={k} equal parts; pass a batch whose size is a multiple of {k}"
            )
        xs.append(jnp.reshape(x, (k, x.shape[0] // k) + tuple(x.shape[1:])))

    def rebuild(parts: list[Array]) -> PyTree:
        out = list(leaves)
        for i, part in zip(cut, parts):
            out[i] = part
        return jax.tree_util.tree_unflatten(treedef, out)

    return xs, rebuild


class TrainStep:
    """A compiled training step; :func:`train_step` documents the options. Call it with the batch.

    >>> import jax.numpy as jnp, optax, tapeflow as tfl
    >>> w = tfl.Param(jnp.array(1.0), name="w")
    >>> step = tfl.TrainStep(lambda s, x: w * x, tfl.Optimizer(optax.sgd(0.5), [w]))
    >>> float(step(jnp.array(2.0))), float(w.value), step.step_count
    (2.0, 0.0, 1)
    """

    def __init__(
        self,
        loss_fn: LossFn,
        optimizer: Optimizer,
        *,
        mesh: Mesh | None = None,
        data_axis: str | None = "data",
        param_specs: Mapping[ParamSpecKey, PartitionSpec] | None = None,
        donate: bool = False,
        has_aux: bool = False,
        seed: int = 0,
        static_argnames: tuple[str, ...] | list[str] | str = (),
        compute_dtype: DTypeLike | None = None,
        debug_nans: bool | None = None,
        microbatches: int = 1,
        return_stats: bool = False,
    ) -> None:
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
            raise ValueError(f"train_step: microbatches must be a positive int, got {microbatches!r}")
        self.microbatches = microbatches
        self.return_stats = bool(return_stats)
        self.loss_fn = loss_fn
        self.debug_nans = debug_nans_default(debug_nans)
        self.compute_dtype = compute_dtype
        self.static_argnames = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
        self.optimizer = optimizer
        self.mesh = mesh
        self.data_axis = data_axis
        self.donate = donate
        self.has_aux = has_aux
        self.seed = int(seed)
        self.step_count = 0
        self.trace_count = 0
        # the abstract signatures traced so far: one compiled program each (see cache_size)
        self._signatures: set[Hashable] = set()
        self._param_specs = dict(param_specs or {})
        self._log_key = object()  # counts this step's compiles in the compile log (holds nothing)
        self._make_programs()
        # Params read but not owned by the optimizer: program inputs, never constants. The optimizer's
        # module's buffers and frozen Params are inputs from the first trace on, so that trace needs no
        # second one to take them as inputs; a trace that reads others raises _Retrace
        slots = set(optimizer.storages)
        known = (p.storage for p in optimizer.non_trainable_params)
        self._extra: tuple[Storage, ...] = tuple(dict.fromkeys(st for st in known if st not in slots))
        self._state_cells: dict[int, Storage] = {}  # uid -> storage of every state cell a trace assigned
        # modules whose train/eval mode a trace read (weakly): programs are keyed by their current modes
        self._moded: list[weakref.ref[ModeOwner]] = []
        # the modes of the noted modules -> the modes argument a program for them was traced with: a trace
        # that reads a module's mode for the first time was keyed without it, and serves that mode after it
        self._mode_keys: dict[tuple[tuple[int, bool], ...], tuple[tuple[int, bool], ...]] = {}
        # per-parameter shardings for a mesh, cached per tuple of slot storages
        self._shardings_for: tuple[Storage, ...] | None = None
        self._shardings: list[NamedSharding] = []
        self._shardings_epoch = -1  # Storage.pin_epoch they were made at (tfl.shard moves pinned storages)
        # the step counter on the device (the program derives the RNG key from it and returns it + 1)
        self._counter: Array | None = None
        self._counter_step = -1

    def _make_programs(self) -> None:
        """The jitted step (no program traced yet): its trace reads ``self.seed`` as a constant."""
        static = (5, 6, 8, 9)
        jitted = jax.jit(self._pure, donate_argnums=(0, 1, 2) if self.donate else (), static_argnums=static)
        self._jitted = jitted
        self._compiled = maybe_tiered(jitted, static)  # each new signature in two tiers, when that is on
        self._signatures = set()

    @property
    def rng_counter(self) -> int:
        """The counter each step's random key is derived from: ``fold_in(PRNGKey(seed), rng_counter)``.

        It is :attr:`step_count` (one key per step); :func:`tfl.save <tapeflow.save>` stores it
        with :attr:`seed`, and :func:`tfl.restore <tapeflow.restore>` sets both
        (:meth:`set_rng_state`), so a restored run draws the same dropout masks.

        >>> import jax.numpy as jnp, optax, tapeflow as tfl
        >>> w = tfl.Param(jnp.array(1.0))
        >>> sgd = tfl.Optimizer(optax.sgd(0.5), [w])
        >>> step = tfl.train_step(lambda s, x: w * x, sgd, seed=3)
        >>> _ = step(jnp.array(2.0)); step.seed, step.rng_counter
        (3, 1)
        """
        return self.step_count

    def set_rng_state(self, seed: int | None = None, counter: int | None = None) -> None:
        """Set the seed and/or step counter of the random keys, e.g. to continue a restored run.

        A new seed drops the programs traced so far (the seed is a constant of
        each trace): the next call traces again. Both are checked before either
        is set.

        >>> import jax.numpy as jnp, optax, tapeflow as tfl
        >>> w = tfl.Param(jnp.array(1.0))
        >>> opt = tfl.Optimizer(optax.sgd(0.5), [w])
        >>> step = tfl.train_step(lambda s, x: w * x, opt)
        >>> step.set_rng_state(seed=7, counter=4); step.seed, step.step_count
        (7, 4)
        >>> step.set_rng_state(counter=-1)
        Traceback (most recent call last):
        ValueError: TrainStep.set_rng_state: counter must be an int in [0, 2**32) ...
        """
        if seed is not None and not (is_int(seed) and RNG_SEED_RANGE[0] <= int(seed) < RNG_SEED_RANGE[1]):
            raise ValueError(f"TrainStep.set_rng_state: seed must be an int in [-2**63, 2**63), got {seed!r}")
        if counter is not None and not (is_int(counter) and 0 <= int(counter) < 2**32):
            raise ValueError(
                "TrainStep.set_rng_state: counter must be an int in [0, 2**32) (the step counter is a uint32), "
                f"got {counter!r}"
            )
        if seed is not None and int(seed) != self.seed:
            self.seed = int(seed)
            self._make_programs()
        if counter is not None:
            self.step_count = int(counter)

    # -- the pure step ---------------------------------------------------------
    def _pure(
        self,
        values: list[Array],
        state: OptState,
        counter: Array,
        args: tuple[PyTree, ...],
        kwargs: dict[str, PyTree],
        static_kwargs: tuple[tuple[str, Hashable], ...],
        check_finite: bool,
        extra_values: list[Array],
        modes: tuple[tuple[int, bool], ...],
        debug_nans: bool = False,
    ) -> tuple[list[Array], OptState, Array, Array, PyTree, Array | None, dict[int, Array], StepStats | None]:
        self.trace_count += 1
        leaves, treedef = jax.tree_util.tree_flatten((values, state, counter, args, kwargs, extra_values))
        signature = (treedef, tuple(jax.typeof(x) for x in leaves), static_kwargs, modes)
        _compile_log.traced(
            "_pure",
            f"train_step {getattr(self.loss_fn, '__qualname__', type(self.loss_fn).__name__)}",
            ("train_step", self._log_key),
            lambda: _log_signature(args, kwargs, static_kwargs, extra_values, modes, check_finite),
        )
        kwargs = {**kwargs, **dict(static_kwargs)}
        opt = self.optimizer
        storages = opt.storages
        key = jax.random.fold_in(jax.random.PRNGKey(self.seed), counter)
        overrides = dict(zip(storages, values))
        overrides.update(zip(self._extra, extra_values))  # extra_values always holds self._extra's values
        mb = self.microbatches
        if mb > 1:  # the first microbatch is traced here, the others in a scan (microbatch j: key fold_in(key, j))
            xs, rebuild = _split((args, kwargs), mb, "train_step")
            args, kwargs = rebuild([x[0] for x in xs])
        with mode_reads() as reads:
            # debug_nans: the trace notes each op's line and flags out-of-range indices (Session.index_guard)
            s, loss, aux = _trace_loss(
                self.loss_fn,
                self.has_aux,
                overrides,
                jax.random.fold_in(key, 0) if mb > 1 else key,
                args,
                kwargs,
                self.compute_dtype,
                debug_nans,
            )
        new = tuple(st for st in s.unlisted_storages if st not in self._extra)
        known = {id(r()) for r in self._moded}
        moded = [weakref.ref(m) for i, m in reads.items() if i not in known]
        if moded:  # keyed from the next call on (a module made inside loss_fn dies and drops out)
            self._moded += moded
            self._mode_keys[self._modes()] = modes  # the modes now are the ones this trace read
        if new:  # Params the optimizer does not own: trace again with them as arguments, never as constants
            raise _Retrace(new)
        self._signatures.add(signature)
        grads = s.backward(loss)
        parts = [None if g is None else (grads.group_value(g),) for g in map(grads.group_of, storages)]
        check_parts(opt.rule, parts, "train_step")
        # state cells (running statistics) assigned by the recording: returned as outputs, keyed by storage uid
        writes = s.state_writes
        for k, st in enumerate(storages):
            if parts[k] is not None and st in writes:
                raise TapeError(
                    f"train_step: loss_fn assigned {opt.describe(k)} as state and also trains it; a storage is "
                    "either a state cell or a trained parameter"
                )
        loss_value = s.node(loss).value
        loss_checked = s.index_guard(loss_value) if debug_nans else None
        if mb > 1:
            parts, writes, loss_value, loss_checked, aux = self._accumulate(
                xs, rebuild, overrides, key, parts, writes, loss_value, loss_checked, aux, debug_nans
            )
        self._state_cells.update((st.uid, st) for st in writes)
        state_out = {st.uid: v for st, v in writes.items()}
        out = _step.step(opt.rule, parts, values, state, check_finite, loss_checked, keep_on_refusal=self.donate)
        if any(st.pinned is not None for st in storages):  # storages placed by tfl.shard: results land there too
            pinned = [
                v if st.pinned is None else jax.lax.with_sharding_constraint(v, st.pinned)
                for st, v in zip(storages, out.values)
            ]
            out = StepOutcome(pinned, opt.placed_state(out.state, jax.lax.with_sharding_constraint), out.finite)
        next_counter = counter + 1
        if out.finite is not None and self.donate:  # a refused step hands back the counter it was given
            next_counter = jnp.where(jnp.all(out.finite), next_counter, counter)
        stats = None
        if self.return_stats:
            used = [p[0] for p in parts if p is not None]
            moved = [n - v for n, v, p in zip(out.values, values, parts) if p is not None]
            zero = jnp.zeros((), jnp.float32)
            stats = StepStats(global_norm_of(used) if used else zero, global_norm_of(moved) if moved else zero)
        return out.values, out.state, next_counter, loss_value, aux, out.finite, state_out, stats

    def _accumulate(
        self,
        xs: list[Array],
        rebuild: Callable[[list[Array]], PyTree],
        overrides: dict[Storage, Array],
        key: PRNGKey,
        parts: list[tuple[Array, ...] | None],
        writes: Mapping[Storage, Array],
        loss_value: Array,
        loss_checked: Array | None,
        aux: PyTree,
        debug_nans: bool,
    ) -> tuple[list[tuple[Array, ...] | None], dict[Storage, Array], Array, Array | None, PyTree]:
        """Microbatches 1..k-1 in one ``lax.scan`` after the first: gradients and losses averaged.

        The scan carries the summed gradients, the summed loss and the state
        cells (BatchNorm's running statistics move microbatch by microbatch, as
        in k separate steps); ``aux`` is stacked along a new first axis.
        """
        k = self.microbatches
        storages = self.optimizer.storages
        used = [p is not None for p in parts]
        cells = list(writes)

        def body(carry: tuple[Any, ...], x: tuple[Array, list[Array]]) -> tuple[tuple[Any, ...], PyTree]:
            gsum, lsum, csum, cell_values = carry
            j, part = x
            ov = dict(overrides)
            ov.update(zip(cells, cell_values))
            a, kw = rebuild(part)
            s2, loss2, aux2 = _trace_loss(
                self.loss_fn, self.has_aux, ov, jax.random.fold_in(key, j), a, kw, self.compute_dtype, debug_nans
            )
            got = s2.backward(loss2).storage_gradients(storages)
            w2 = s2.state_writes
            if [v is not None for v in got] != used or set(w2) - set(cells):
                raise TapeError(
                    "train_step(microbatches=...): a microbatch used other parameters or assigned other state "
                    "than the first; every microbatch must run the same model code"
                )
            lv = s2.node(loss2).value
            new_g = tuple(acc + v for acc, v in zip(gsum, (v for v in got if v is not None)))
            new_cells = [w2.get(st, v) for st, v in zip(cells, cell_values)]
            checked = csum if csum is None else csum + s2.index_guard(lv)
            return (new_g, lsum + lv, checked, new_cells), aux2

        init = (tuple(p[0] for p in parts if p is not None), loss_value, loss_checked, [writes[st] for st in cells])
        (gsum, lsum, csum, cell_values), aux_rest = jax.lax.scan(
            body, init, (jnp.arange(1, k, dtype=jnp.uint32), [x[1:] for x in xs])
        )
        means = iter([g / jnp.asarray(k, g.dtype) for g in gsum])
        parts = [(next(means),) if u else None for u in used]
        if aux is not None:
            aux = jax.tree_util.tree_map(
                lambda first, rest: jnp.concatenate([jnp.asarray(first)[None], rest]), aux, aux_rest
            )
        n = jnp.asarray(k, lsum.dtype)
        return parts, dict(zip(cells, cell_values)), lsum / n, None if csum is None else csum / n, aux

    # -- sharding --------------------------------------------------------------
    def _spec_for(self, st: Storage, slot_key: SlotKey) -> PartitionSpec | None:
        for key, spec in self._param_specs.items():
            if (isinstance(key, Param) and key.storage is st) or key is st:
                return spec
            if isinstance(key, str) and slot_key == key:
                return spec
        return None if st.pinned is not None else PartitionSpec()  # None: where tfl.shard placed it

    def _mesh(self) -> Mesh:
        if self.mesh is None:
            raise TapeError("TrainStep: this step was built without a mesh; pass mesh= to train_step to shard it")
        return self.mesh

    def _param_shardings(self, storages: tuple[Storage, ...]) -> list[NamedSharding]:
        if self._shardings_for is not storages or self._shardings_epoch != Storage.pin_epoch:
            self._shardings_epoch = Storage.pin_epoch
            keys = self.optimizer.slot_keys
            specs = [self._spec_for(st, key) for st, key in zip(storages, keys)]
            self._shardings = [
                cast(NamedSharding, st.pinned) if spec is None else NamedSharding(self._mesh(), spec)
                for st, spec in zip(storages, specs)
            ]
            self._shardings_for = storages
        return self._shardings

    def _place(
        self, storages: tuple[Storage, ...], values: list[Array], state: OptState, args: tuple[PyTree, ...]
    ) -> tuple[list[Array], OptState, tuple[PyTree, ...]]:
        mesh = self._mesh()
        pshard = self._param_shardings(storages)
        repl = NamedSharding(mesh, PartitionSpec())
        values = [jax.device_put(v, sh) for v, sh in zip(values, pshard)]

        def put(x: PyTree, sharding: NamedSharding) -> PyTree:
            return jax.device_put(x, sharding) if hasattr(x, "shape") else x

        def place_part(k: int, part: PyTree) -> PyTree:
            # k >= 0: parameter k's part of a params-shaped copy (optax.tree_utils.tree_map_params found
            # it): sharded like the parameter when it has the parameter's shape; anything else replicated
            def place(x: PyTree) -> PyTree:
                same = k >= 0 and hasattr(x, "shape") and tuple(x.shape) == storages[k].shape
                return put(x, pshard[k] if same else repl)

            return jax.tree_util.tree_map(place, part)

        state = jax.tree_util.tree_map(place_part, self.optimizer.slot_indices(state), state)
        batch = NamedSharding(mesh, PartitionSpec(self.data_axis)) if self.data_axis else repl

        def place_arg(a: PyTree) -> PyTree:
            if hasattr(a, "shape") and len(np.shape(a)) >= 1:
                return jax.device_put(a, batch)
            return a

        args = jax.tree_util.tree_map(place_arg, args)
        return values, state, args

    # -- call ------------------------------------------------------------------
    def _new_counter(self, values: list[Array]) -> Array:
        """``step_count`` as a uint32 scalar placed like the program's other inputs (no retrace later)."""
        c = np.asarray(self.step_count, dtype=np.uint32)
        if self.mesh is not None:
            return jax.device_put(c, NamedSharding(self.mesh, PartitionSpec()))
        committed = [v for v in values if isinstance(v, jax.Array) and getattr(v, "committed", False)]
        return jax.device_put(c, replicated_on(committed[0].sharding)) if committed else jnp.asarray(c)

    def _read_extra(self, extra: tuple[Storage, ...]) -> list[Array]:
        """Current values of the Params read but not owned by the optimizer (replicated over a mesh)."""
        vals = Storage.read_current_many(extra)
        if self.mesh is not None and extra:
            repl = NamedSharding(self._mesh(), PartitionSpec())
            vals = [jax.device_put(v, repl) for v in vals]
        return vals

    def __call__(self, *args: PyTree, **kwargs: PyTree) -> PyTree:
        with self.optimizer.lock:  # steps over one optimizer, from any thread, run one at a time
            if not self.donate:
                return self._call(args, kwargs)
            # donated inputs are gone once the program starts: hold Ctrl-C until the results are written
            with deferred_interrupts():
                return self._call(args, kwargs)

    def lower(self, *args: PyTree, **kwargs: PyTree) -> jax.stages.Lowered:
        """The program a call with this batch runs, lowered by JAX; nothing runs and nothing changes.

        ``step.lower(x, y).compile().memory_analysis()`` gives the program's
        buffer sizes (how much ``microbatches`` saves); ``.as_text()`` its StableHLO.

        >>> import jax.numpy as jnp, optax, tapeflow as tfl
        >>> w = tfl.Param(jnp.ones(3), name="w")
        >>> opt = tfl.Optimizer(optax.sgd(0.1), [w])
        >>> step = tfl.train_step(lambda s, x: tfl.sum(w * x), opt)
        >>> "stablehlo" in step.lower(jnp.ones(3)).as_text(), step.step_count
        (True, 0)
        """
        with self.optimizer.lock:
            return cast(jax.stages.Lowered, self._call(args, kwargs, lower=True))

    def _call(self, args: tuple[PyTree, ...], kwargs: dict[str, PyTree], lower: bool = False) -> PyTree:
        opt = self.optimizer
        # a batch of concrete arrays holds no tracer: anything else is looked at leaf by leaf
        if kwargs or operator.countOf(map(type, args), concrete_array_type()) != len(args):
            leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
            data = []
            for x in leaves:  # a loop, not a generator: no frame per call
                if isinstance(x, jax.core.Tracer):
                    # refused before the program runs: under jax.grad/vmap it would run (and consume donated inputs)
                    raise traced_write("train_step", "its batch")
                data.append(foreign_array(x, "train_step"))
            if any(d is not x for d, x in zip(data, leaves)):  # PyTorch tensors (a DataLoader's batch), ...
                args, kwargs = jax.tree_util.tree_unflatten(treedef, data)  # as NumPy data, as a session takes them
        storages = opt.check_layout()  # the slot storages; raises if the alias layout changed
        if opt.placement_epoch != Storage.pin_epoch:  # a storage moved (tfl.shard): its state goes along
            opt.follow_placement()
        values = Storage.read_current_many(storages)  # no placement, no host sync
        state = opt.state
        if self.mesh is not None:
            values, state, args = self._place(storages, values, state, args)
        if self._counter_step != self.step_count:  # first call, or step_count set by the user
            self._counter = self._new_counter(values)
        static: tuple[tuple[str, Hashable], ...] = ()
        if self.static_argnames and kwargs:
            static = tuple(sorted((k, kwargs[k]) for k in self.static_argnames if k in kwargs))
            kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        extra = self._extra
        extra_values = self._read_extra(extra) if extra else []
        run: Callable[..., Any] = self._jitted.lower if lower else self._compiled
        while True:
            try:
                out = run(
                    values,
                    state,
                    self._counter,
                    args,
                    kwargs,
                    static,
                    bool(opt.check_finite) or self.debug_nans,
                    extra_values,
                    self._mode_key() if self._moded else (),
                    self.debug_nans,
                )
                break
            except _Retrace as r:  # raised while tracing: nothing ran, nothing was donated
                extra = self._extra = extra + r.storages
                extra_values = self._read_extra(extra)
            except Exception as e:
                if self.donate and any(isinstance(v, jax.Array) and v.is_deleted() for v in values):
                    raise TapeError(
                        f"train_step(donate=True): the program failed ({type(e).__name__}) after its inputs were "
                        "donated, so the parameter values and optimizer state it was given are deleted. Restore "
                        "them from a checkpoint; with donate=False (the default) a failed step keeps them"
                    ) from e
                raise
        if lower:
            return out
        new_vals, new_state, counter, loss, aux, flags, state_out, stats = out
        cells = [(self._state_cells[uid], v) for uid, v in state_out.items()] if state_out else []
        # one device: the trace checked shape and dtype, and the program leaves each value on the device
        # of the cell it read, so the fast write into that cell is exact; parameters, optimizer state,
        # state cells and counters change together or not at all
        with deferred_interrupts():
            try:
                finish(
                    opt.rule,
                    storages,
                    StepOutcome(new_vals, new_state, flags),
                    [True] * len(storages),
                    "train_step",
                    opt,
                    replacing=values if self.mesh is None else None,
                    state_writes=cells,
                    restore_on_refusal=self.donate,  # the donated old values exist only as the program's outputs
                    traced=True,
                    explain=functools.partial(self._explain, args, kwargs, static, counter),  # as eager's check_finite
                )
            except TapeError:
                if self.donate:
                    self._counter = counter  # the program's (unchanged) counter: the old one was donated
                raise
            self._counter = counter
            self.step_count += 1
            self._counter_step = self.step_count
        result = (loss, aux) if self.has_aux else loss
        return (result, stats) if self.return_stats else result

    def _explain(
        self,
        args: tuple[PyTree, ...],
        kwargs: dict[str, PyTree],
        static: tuple[tuple[str, Hashable], ...],
        counter: Array,
        message: str,
    ) -> NonFiniteError:
        """The error of a refused ``debug_nans`` step: ``loss_fn`` run again op by op on this step's values.

        Runs after the refusal, so the storages hold this step's inputs again
        (put back first when they were donated) and ``counter`` is the step's.
        """
        overrides = dict(zip(self.optimizer.storages, Storage.read_current_many(self.optimizer.storages)))
        overrides.update(zip(self._extra, Storage.read_current_many(self._extra)))
        key = jax.random.fold_in(jax.random.PRNGKey(self.seed), counter)
        kwargs = {**kwargs, **dict(static)}
        rerun = _trace_loss(
            self.loss_fn, self.has_aux, overrides, key, args, kwargs, self.compute_dtype, self.debug_nans
        )
        return _origin_error(message, rerun)

    def _mode_key(self) -> tuple[tuple[int, bool], ...]:
        """The modes argument of a call: :meth:`_modes`, or the modes a program serving them was traced with."""
        modes = self._modes()
        return self._mode_keys.get(modes, modes)

    def _modes(self) -> tuple[tuple[int, bool], ...]:
        """The program key of the modes: ``(id, training)`` of each live module a trace read the mode of."""
        alive = [m for m in (r() for r in self._moded) if m is not None]
        if len(alive) < len(self._moded):
            self._moded = [weakref.ref(m) for m in alive]
        return tuple((id(m), bool(m.training)) for m in alive)  # read outside any trace: not noted

    def cache_size(self) -> int:
        """How many programs are compiled: one per distinct signature traced so far.

        A signature is the pytree structure, shapes, dtypes (and weak types) of the
        arguments, parameters and optimizer state, plus the static arguments.
        Unlike :attr:`trace_count` it does not grow when JAX retraces a signature it
        has seen (e.g. after ``jax.clear_caches()``).
        """
        return len(self._signatures)


def train_step(loss_fn: LossFn, optimizer: Optimizer, **options: Unpack[TrainStepOptions]) -> TrainStep:
    """Compile ``loss_fn(session, *args)`` plus ``optimizer``'s update into one XLA program.

    ``step = train_step(loss_fn, opt)`` then ``loss = step(*batch)`` runs forward,
    backward, per-storage sums of tied cotangents and the optax update as one
    compiled call, then writes the new values into the Param storages and the new
    state into ``opt``. It retraces only for new shapes, dtypes or static
    arguments (``step.trace_count``). ``train_step(loss_fn, opt, **options)`` is
    ``TrainStep(loss_fn, opt, **options)``; the options (:class:`TrainStepOptions`,
    keyword only) are:

    * ``mesh``: a ``jax.sharding.Mesh``; arguments are sharded over ``data_axis``
      along their first dimension, parameters are replicated unless
      ``param_specs`` maps a Param (or its name) to a ``PartitionSpec``; per-parameter
      optimizer slots follow their parameter's sharding.
    * ``donate`` (default False): let the program reuse the buffers of the previous
      parameter values and optimizer state for the new ones. By default the old
      buffers live until the new values are written back, which costs one extra
      copy of the parameters and optimizer state at the peak, and buys the
      guarantee that a failed or interrupted step changes nothing: the Params and
      the optimizer keep exactly their old values (or, once the program finished,
      exactly the new ones) and every array you kept, including leaves an open
      session recorded with ``s.use(w)``, stays valid. ``donate=True`` saves that
      memory and gives both up: a failure inside the program deletes the
      parameters and the state (a :class:`TapeError` says so), and arrays still
      referring to the old values become invalid.
    * ``has_aux``: ``loss_fn`` returns ``(loss, aux)`` and the step returns both.
    * ``seed``: session random tensors in step ``k`` derive from ``fold_in(key(seed), k)``.
    * ``static_argnames``: keyword arguments of ``loss_fn`` passed as compile-time
      constants (hashable Python values such as a flag or a mode string); each
      new value compiles a new program.
    * ``compute_dtype``: the mixed-precision policy of the session ``loss_fn``
      records on, as ``Session(compute_dtype=...)`` (float32 master weights).
    * ``microbatches`` (default 1): gradient accumulation inside the program. Each
      array argument is cut into ``microbatches`` equal parts along its first axis
      (other arguments are passed to every part); ``loss_fn`` runs on each part in
      turn (a ``jax.lax.scan``, so only one part's activations are live at a time),
      and the step applies the mean of the parts' gradients and returns the mean of
      their losses: for a loss that is a mean over the batch, the full-batch step
      within float32 rounding. State cells move part by part (BatchNorm's running
      statistics see k updates, as in k separate steps, and each part normalizes
      with its own batch statistics); part ``j`` draws its random tensors from
      ``fold_in(step_key, j)``; with ``has_aux``, ``aux`` gets a leading axis of
      length ``microbatches``.
    * ``return_stats`` (default False): the step returns ``(result, stats)``, a
      :class:`StepStats` of the global gradient norm and the update norm computed
      in the same program (no extra dispatch); ``result`` is what it returns otherwise.
    * ``debug_nans`` (None: the environment variable ``TAPEFLOW_DEBUG_NANS``): the
      program also checks that the loss and every gradient are finite; a step
      that is not raises :class:`~tapeflow.NonFiniteError` with nothing updated,
      naming the op, line and module that made the first non-finite value
      (found by running ``loss_fn`` again op by op on the step's values).

    State cells (non-trainable Params that ``loss_fn`` assigns with
    :meth:`Session.assign_state`, such as BatchNorm's running statistics in
    train mode) are program inputs read at their current value on every call
    (never constants) and outputs of the program: their new values are
    installed together with the parameters and the optimizer state, and a step
    that fails (an exception, or a non-finite gradient with ``check_finite``)
    leaves them unchanged, as it leaves the parameters. Every Param ``loss_fn``
    reads that the optimizer does not update is such an input: the buffers
    and frozen Params of a module the optimizer was built from
    (:attr:`Optimizer.non_trainable_params`) from the first trace on, so a
    model with BatchNorm or Dropout traces once per signature. Any other
    (the buffers of a model whose optimizer got a list of its Params) is found
    by the step's first trace, which then runs once more with it as an input.

    >>> import jax.numpy as jnp, optax, tapeflow as tfl
    >>> w = tfl.Param(jnp.array(3.0), name="w")
    >>> opt = tfl.Optimizer(optax.sgd(0.25), [w])
    >>> step = tfl.train_step(lambda s, x: (w * x - 1.0) ** 2.0, opt)
    >>> round(float(step(jnp.array(1.0))), 3), round(float(w.value), 3)
    (4.0, 2.0)
    """
    return TrainStep(loss_fn, optimizer, **options)
