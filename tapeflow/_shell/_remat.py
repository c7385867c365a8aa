"""Rematerialization: :func:`checkpoint` records a block of session code as one node per output.

``tfl.checkpoint(block)`` wraps a function of Tensors (a transformer block, an
MLP layer, any session code that closes over :mod:`tapeflow.nn` modules and
:class:`~tapeflow.Param` s). Called on session Tensors it records **one node
per output** instead of the block's internal ops, so the tape keeps only the
block's inputs, the Params it reads and its outputs alive; the backward of
that node runs the block again (the intermediates exist only while that node's
VJP runs) and differentiates the recomputation with tapeflow's own backward.

How it works:

* On the first call with a new signature (operand shapes and dtypes, the
  static arguments, whether the session tracks gradients, its mixed-precision
  policy) the block is run
  once on a private inner :class:`~tapeflow.Session`, which finds the Params it
  reads (every one, frozen and tied records included) and whether it draws
  random numbers. That is the block's *trace*. Under ``compute_dtype`` the
  inner session has the calling session's policy, so the block records the
  same casts as without checkpoint, in its forward and in its recomputation;
  the op itself casts no operand (``precision="layout"``).
* Each wrapped block is one op of the registry (``checkpoint:<qualname>:<n>``,
  not public) whose operands are the Tensor (and array) arguments, one leaf per Param
  storage the block reads (recorded with the calling session's ``use``, so
  tied weights, :class:`~tapeflow.Grads`, :class:`~tapeflow.Optimizer`,
  :func:`~tapeflow.value_and_grad` and :func:`~tapeflow.train_step` treat them as
  ordinary parameter uses) and, for a block that draws random numbers, a key.
  Its forward is the block run as a pure function of those operands on an inner
  session; forward and VJP kernels are compiled and cached per shapes like a
  built-in op's.
* The VJP is the block's recomputation on an inner session (inputs behind an
  ``optimization_barrier``, so XLA neither hoists nor merges it with the
  forward) followed by :func:`tapeflow.backward` of that inner recording. It is
  written here rather than left to ``jax.vjp`` of the forward kernels because
  the block's ops keep their own VJPs that way (``stop_gradient``, hand-written
  rules), so gradients equal those of the un-checkpointed recording. Forward
  mode (``Session.jvp``) uses ``jax.jvp`` of the forward kernel, as for a lifted op.
* The op lives as long as its :class:`Checkpointed` wrapper, or a recording in
  progress that used it: when both are gone it is unregistered and its kernels
  are dropped. The op and its kernels refer to the block only weakly.

>>> import jax, jax.numpy as jnp, tapeflow as tfl
>>> layer = tfl.nn.Linear(3, 3, key=jax.random.key(0))
>>> block = tfl.checkpoint(lambda h: tfl.tanh(layer(h)) + h)
>>> with tfl.Session() as s:
...     x = s.input(jnp.ones((2, 3)), requires_grad=True)
...     y = block(x)
...     ops = [nd.op or "leaf" for nd in s.tape]
...     ops[-1].startswith("checkpoint:"), len(s.tape)  # x, weight, bias, y
...     g = s.backward(tfl.sum(y))
...     g[layer.weight].shape
(True, 4)
(3, 3)
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import TypeAlias

import jax
import jax.numpy as jnp
import numpy as np

from .._core import _registry as R
from .._core._backward import backward as _tape_backward
from .._core._kernels import drop_kernels_of
from .._core._precision import Precision, dtypes_kept, keep_dtypes
from .._core._result import TapeError
from .._core._tape import check_op
from .._core._typing import Array, PRNGKey, PyTree
from ._grads import sum_in_leaf_order
from ._params import Param, Storage
from ._session import Session, block_session
from ._state import state_writes_refused
from ._tensor import Operand, Tensor, session_of
from ._values import ParamSource, host_operand

__all__ = ["Checkpointed", "checkpoint"]

Block: TypeAlias = Callable[..., PyTree]
"""A function of Tensors (and static Python values) that records session ops and returns Tensor(s)."""


def _is_handle(x: object) -> bool:
    return isinstance(x, (Tensor, Param))


class _BlockReads(ParamSource):
    """Where a block's Param uses read, noting the Param records the block reads.

    ``given`` maps storages to the values to record for them (the op's operands);
    a read of a storage it does not list is noted in ``unlisted``. Without
    ``given`` (the first run of a signature) every read records the current value.
    A block's operand is its value even for a view rebuilt by a JAX transformation.
    """

    __slots__ = ("records",)

    def __init__(self, given: dict[Storage, Array] | None) -> None:
        super().__init__(given)
        self.records: dict[Storage, Param] = {}  # per storage: its first trainable record read, else its first

    def read(self, p: Param) -> Array | None:
        st = p.storage
        first = self.records.get(st)
        if first is None or (p.trainable and not first.trainable):
            self.records[st] = p
        return self.lookup(st)


@dataclasses.dataclass(frozen=True, eq=False)
class _Args:
    """How to call the block: the structure of ``(args, kwargs)`` and its static leaves."""

    args: jax.tree_util.PyTreeDef  # structure of (args, kwargs), Tensors and Params as leaves
    statics: tuple[Hashable, ...]  # the leaves, with None where a Tensor goes
    slots: tuple[int, ...]  # positions of the Tensor leaves


@dataclasses.dataclass(frozen=True, eq=False)
class _Trace(_Args):
    """What the first run of one signature found; the op's attribute ``trace`` indexes these."""

    index: int
    grad_enabled: bool
    precision: Precision | None  # the calling session's policy: the block records and recomputes under it
    records: tuple[Param, ...]  # one Param record per storage the block reads, in first-read order
    has_key: bool  # the block draws random numbers: the op takes a key as its last operand
    outputs: jax.tree_util.PyTreeDef  # structure of the block's result, Tensors as leaves
    specs: tuple[R.Spec, ...]  # (shape, dtype) of every operand but the key

    @property
    def storages(self) -> tuple[Storage, ...]:
        return tuple(p.storage for p in self.records)

    @property
    def n_outputs(self) -> int:
        return self.outputs.num_leaves


_names = itertools.count(1)
_lock = threading.RLock()
# Wrappers used in each session's current recording: a node keeps its op registered (see _release).
_in_use: weakref.WeakKeyDictionary[Session, tuple[int, list[Checkpointed]]] = weakref.WeakKeyDictionary()
_memo: weakref.WeakValueDictionary[Hashable, Checkpointed] = weakref.WeakValueDictionary()
_dead: list[str] = []  # ops of collected wrappers whose compiled kernels are not yet dropped


def _release(opname: str) -> None:
    """Unregister the op of a collected wrapper; its kernels are dropped at the next safe point (:func:`_purge`)."""
    with contextlib.suppress(KeyError):  # already unregistered by hand
        R.unregister(opname, keep_kernels=True)
    _dead.append(opname)


def _purge() -> None:
    """Drop the cached kernels of unregistered checkpoint ops (not from a finalizer: it may run inside a cache)."""
    if not _dead:
        return
    with _lock:
        names = set(_dead)
        try:
            drop_kernels_of(names)
        except RuntimeError:  # another thread changed a cache meanwhile: try again at the next call
            return
        _dead[:] = [n for n in _dead if n not in names]


def _qualname(block: Block) -> str:
    name = getattr(block, "__qualname__", None) or type(block).__qualname__
    return str(name)


def _key_data(key: PRNGKey) -> Array:
    """A raw ``uint32`` key array: what a tape leaf can hold (typed keys have no NumPy dtype)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return key


class _Core:
    """A wrapped block's traces, its forward and its VJP: what the registered op refers to.

    It never refers to the :class:`Checkpointed` wrapper, so the wrapper can be
    collected (and the op unregistered) while kernels still hold the core.
    """

    def __init__(self, block: Block, opname: str, label: str) -> None:
        self.block = block
        self.opname = opname
        self.label = label
        self.traces: list[_Trace] = []
        self.by_key: dict[Hashable, int] = {}
        self.lock = threading.RLock()  # re-entrant: a block may call another checkpointed block, or itself

    # -- running the block ----------------------------------------------------------------------
    def _call_block(self, t: _Args, inner: Session, handles: Sequence[Tensor], when: str) -> PyTree:
        leaves = list(t.statics)
        for pos, h in zip(t.slots, handles):
            leaves[pos] = h
        args, kwargs = jax.tree_util.tree_unflatten(t.args, leaves)
        try:
            # the inner session's policy alone decides the block's casts, wherever its kernels are traced;
            # a state write would happen again in the recomputation
            with inner.as_current(), keep_dtypes(False), state_writes_refused(self.label):
                return self.block(*args, **kwargs)
        except Exception as e:
            msg = str(e) if isinstance(e, TapeError) else f"{type(e).__name__}: {e}"
            raise TapeError(f"{self.label}: the block failed {when}: {msg}") from e

    def _outputs(self, out: PyTree, inner: Session, when: str) -> tuple[list[Tensor], jax.tree_util.PyTreeDef]:
        leaves, treedef = jax.tree_util.tree_flatten(out, is_leaf=_is_handle)
        if not leaves:
            raise TapeError(
                f"{self.label}: the block returned no Tensor ({when}); it must return a Tensor or a tuple of them"
            )
        for i, h in enumerate(leaves):
            if not isinstance(h, Tensor) or h.session is not inner or h.generation != inner.generation:
                what = type(h).__name__ if not isinstance(h, Tensor) else "a Tensor the block did not compute"
                raise TapeError(
                    f"{self.label}: output {i} of the block is {what} ({when}); a checkpointed block returns "
                    "Tensors it computed from its arguments (pass every Tensor it uses as an argument)"
                )
        return leaves, treedef

    def run(self, t: _Trace, xs: Sequence[Array], *, recompute: bool) -> tuple[Session, list[Tensor], list[Tensor]]:
        """Run the block of trace ``t`` on the operand values ``xs``: (inner session, input handles, outputs)."""
        n_in, n_p = len(t.slots), len(t.records)
        given = dict(zip(t.storages, xs[n_in : n_in + n_p]))
        key = xs[n_in + n_p] if t.has_key else None
        reads = _BlockReads(given)
        inner = block_session(None, reads, key, True if recompute else t.grad_enabled, _dtype(t.precision))
        when = "while recomputed for backward" if recompute else "while its forward was compiled"
        handles = [inner.input(x, requires_grad=recompute and R.is_float(np.dtype(x.dtype))) for x in xs[:n_in]]
        out = self._call_block(t, inner, handles, when)
        outs, treedef = self._outputs(out, inner, when)
        if reads.unlisted or treedef != t.outputs or (inner.rng_counter > 0 and not t.has_key):
            raise TapeError(
                f"{self.label}: {when}, the block read other Params, returned another structure or drew "
                f"random numbers where its first call with these operands ({R.describe(t.specs)}) did not "
                f"({len(reads.unlisted)} unlisted Param storage(s)). A checkpointed block must do the same on every "
                "call with the same operand shapes and static arguments: pass changing choices as static "
                "(non-Tensor) arguments, or wrap the changed block with tfl.checkpoint again"
            )
        return inner, handles, outs

    # -- the registered op ----------------------------------------------------------------------
    def check(self, specs: tuple[R.Spec, ...], trace: object, output: object) -> str | None:
        if type(trace) is not int or not 0 <= trace < len(self.traces):
            return f"trace={trace!r} is not a trace of this checkpointed block; call the wrapped block instead"
        t = self.traces[trace]
        if type(output) is not int or not 0 <= output < t.n_outputs:
            return f"output={output!r} must index one of the block's {t.n_outputs} output(s)"
        n = len(t.specs)
        key_ok = len(specs) == n + 1 and np.issubdtype(specs[-1][1], np.unsignedinteger)
        if tuple(specs[:n]) != t.specs or not (key_ok if t.has_key else len(specs) == n):
            want = R.describe(t.specs) + (" and a random key" if t.has_key else "")
            return f"the block was traced for operands {want}; call the wrapped block instead"
        return None

    def forward(self, *xs: Array, trace: int, output: int) -> Array:
        """A block recorded by ``tfl.checkpoint``: its forward runs the block, its backward runs it again.

        Operands: the block's Tensor arguments, one value per Param storage it
        reads, and a random key for a block that draws random numbers.
        """
        inner, _, outs = self.run(self.traces[trace], xs, recompute=False)
        return inner.node(outs[output]).value

    def vjp(self, g: Array, out: Array, *xs: Array, trace: int, output: int) -> tuple[Array | None, ...]:
        t = self.traces[trace]
        # the recomputation starts only when the cotangent exists and is never merged with the forward
        g, xs = jax.lax.optimization_barrier((g, tuple(xs)))
        inner, handles, outs = self.run(t, xs, recompute=True)
        groups = {grp.storage: grp for grp in inner.parameter_groups()}
        wrt = [h.id for h in handles if h.requires_grad] + [i for grp in groups.values() for i in grp.leaves]
        by_leaf = _tape_backward(inner.tape, outs[output].id, seed=g, wrt=wrt)
        cts: list[Array | None] = [by_leaf[h.id] if h.requires_grad else None for h in handles]
        for st in t.storages:
            grp = groups.get(st)
            if grp is None:  # read only through frozen records: no gradient reaches the storage
                cts.append(jnp.zeros(st.shape, st.dtype) if R.is_float(st.dtype) else None)
            else:
                cts.append(sum_in_leaf_order([by_leaf[i] for i in grp.leaves]))
        if t.has_key:
            cts.append(None)
        return tuple(cts)

    # -- the first call of a signature ----------------------------------------------------------
    def trace_for(
        self, key: Hashable, s: Session, values: Sequence[Array], in_specs: tuple[R.Spec, ...], call: _Args
    ) -> _Trace:
        """The trace of signature ``key``; a new one runs the block once on the operand ``values``."""
        with self.lock:
            i = self.by_key.get(key)
            if i is not None:
                return self.traces[i]
            reads = _BlockReads(None)
            policy = _policy(s)
            inner = block_session(s.device, reads, None, s.grad_enabled, _dtype(policy))
            t0 = s.tape
            try:
                ins = [inner.input(v) for v in values]
                out = self._call_block(call, inner, ins, f"on operands {R.describe(in_specs)}")
                outs, treedef = self._outputs(out, inner, "on its first call")
            finally:
                if s.tape is not t0:
                    raise TapeError(
                        f"{self.label}: the block recorded on the session it was called from (it used a Tensor it "
                        "closes over, or that session itself; what it recorded there stays on that tape); pass every "
                        "Tensor the block uses as an argument"
                    )
            records = tuple(reads.records.values())
            if bad := [p for p in records if p.dtype == R.OBJECT]:
                raise TapeError(f"{self.label}: exact rational Params ({bad[0]!r}) are not supported by checkpoint")
            if bad_out := [h for h in outs if h.dtype == R.OBJECT]:
                raise TapeError(
                    f"{self.label}: the block returns exact rational values ({bad_out[0]!r}), "
                    "which checkpoint does not support"
                )
            specs = in_specs + tuple((p.shape, p.dtype) for p in records)
            t = _Trace(call.args, call.statics, call.slots, len(self.traces), s.grad_enabled, policy, records,
                       inner.rng_counter > 0, treedef, specs)  # fmt: skip
            self.traces.append(t)
            self.by_key[key] = t.index
            return t


def _policy(s: Session) -> Precision | None:
    """The policy ops recorded on ``s`` now follow (None inside :func:`keep_dtypes`): the one a trace runs under."""
    return None if dtypes_kept() else s.precision


def _dtype(policy: Precision | None) -> np.dtype | None:
    return None if policy is None else policy.compute_dtype


def _register(core: _Core) -> None:
    """Register ``core``'s op. The op (and the kernels cached for it) refers to the core weakly, so
    nothing but the wrapper keeps the block, and what it closes over, alive."""
    ref, core_label = weakref.ref(core), core.label

    def live() -> _Core:
        c = ref()
        if c is None:  # unreachable through the registry: the op is unregistered with its wrapper
            raise TapeError(f"{core_label}: the wrapped block was garbage collected")
        return c

    def check(specs: tuple[R.Spec, ...], trace: object, output: object) -> str | None:
        return live().check(specs, trace, output)

    def forward(*xs: Array, trace: int, output: int) -> Array:
        return live().forward(*xs, trace=trace, output=output)

    def vjp(g: Array, out: Array, *xs: Array, trace: int, output: int) -> tuple[Array | None, ...]:
        return live().vjp(g, out, *xs, trace=trace, output=output)

    forward.__doc__ = _Core.forward.__doc__
    # "layout": the outer policy casts no operand; the block records its own casts under its trace's policy
    d = R.op(
        core.opname,
        attrs={"trace": R.REQUIRED, "output": 0},
        check=check,
        public=False,
        user=live,  # a user op whose source holds the core weakly: cached kernels keep their OpDef, never the block
        precision="layout",
    )(forward)
    d.defvjp(vjp)


class Checkpointed:
    """A block wrapped by :func:`checkpoint`; call it like the block.

    ``op_name`` is its registry op; ``trace_count`` counts the signatures traced
    so far (one per new combination of operand shapes and dtypes, static
    arguments and gradient mode). The op is unregistered when the wrapper is
    garbage collected and no recording in progress uses it.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> double = tfl.checkpoint(lambda h: h * 2.0)
    >>> with tfl.Session() as s:
    ...     double(s.input(jnp.ones(2))).value.tolist(), double.trace_count
    ([2.0, 2.0], 1)
    """

    def __init__(self, block: Block, name: str | None = None) -> None:
        if not callable(block):
            raise TypeError(f"checkpoint expects a function of Tensors, got {type(block).__name__}")
        label = name or _qualname(block)
        opname = f"checkpoint:{label}:{next(_names)}"
        self.__wrapped__ = block
        self.__name__ = getattr(block, "__name__", label)
        self.__qualname__ = label
        self.__doc__ = getattr(block, "__doc__", None) or type(self).__doc__
        self._core = core = _Core(block, opname, f"checkpoint({label})")
        _register(core)
        fin = weakref.finalize(self, _release, opname)
        fin.atexit = False

    @property
    def op_name(self) -> str:
        """The name of this block's registry op (``checkpoint:<qualname>:<n>``)."""
        return self._core.opname

    @property
    def trace_count(self) -> int:
        """How many signatures of the block have been traced (each compiles its own kernels)."""
        return len(self._core.traces)

    def __repr__(self) -> str:
        return f"<checkpoint {self._core.label} op={self.op_name!r} traces={self.trace_count}>"

    def __call__(self, *args: PyTree, **kwargs: PyTree) -> PyTree:
        _purge()
        core = self._core
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_is_handle)
        slots = tuple(i for i, x in enumerate(leaves) if isinstance(x, (Tensor, np.ndarray, jax.Array)))
        inputs: list[Tensor | np.ndarray | jax.Array] = [leaves[i] for i in slots]
        operand_at = set(slots)
        statics = tuple(None if i in operand_at else x for i, x in enumerate(leaves))
        for i, x in enumerate(statics):
            try:
                hash(x)
            except TypeError:
                raise TapeError(
                    f"{core.label}: argument leaf {i} ({type(x).__name__}) is neither a Tensor, an array nor "
                    "hashable; Tensors and arrays are operands, other arguments are static Python values "
                    "(numbers, strings, flags) and each new value traces the block again"
                ) from None
        values: list[Array] = []
        try:
            s = session_of(inputs, core.label)
            for i, x in enumerate(inputs):
                if isinstance(x, Tensor):
                    values.append(s.node(x).value)  # checks the handle
                else:  # an array operand: a constant leaf, converted as the session converts constants
                    if not isinstance(x, jax.Array) and np.dtype(x.dtype) == R.OBJECT:
                        raise TapeError("exact rational operands are not supported by checkpoint")
                    x = host_operand(x, core.label)
                    inputs[i] = x
                    values.append(x)
        except TapeError as e:
            raise TapeError(f"{core.label}: {e}") from None
        in_specs = tuple((tuple(v.shape), np.dtype(v.dtype)) for v in values)
        if any(spec[1] == R.OBJECT for spec in in_specs):
            raise TapeError(f"{core.label}: exact rational operands are not supported ({R.describe(in_specs)})")
        key = (treedef, tuple((type(x), x) for x in statics), in_specs, s.grad_enabled, _policy(s))
        t = core.trace_for(key, s, values, in_specs, _Args(treedef, statics, slots))
        operands: list[Operand] = [*inputs, *t.records]
        specs = list(t.specs)
        counter = s.rng_counter
        try:
            if t.has_key:  # one draw per call: the forward and the recomputation use this key
                kd = _key_data(s.random_key())
                operands.append(kd)
                specs.append((tuple(kd.shape), np.dtype(kd.dtype)))
            for k in range(t.n_outputs):  # every output checked before anything is recorded
                entry = check_op(core.opname, {"trace": t.index, "output": k}, tuple(specs))
                if isinstance(entry, str):
                    raise TapeError(f"{core.label}: {entry}")
            outs = [s.apply(core.opname, *operands, trace=t.index, output=k) for k in range(t.n_outputs)]
        except BaseException:
            if s.rng_counter != counter:
                s.set_rng_state(counter=counter)
            raise
        _keep(s, self)
        return jax.tree_util.tree_unflatten(t.outputs, outs)


def _keep(s: Session, w: Checkpointed) -> None:
    """Keep ``w`` (so its op stays registered) while ``s``'s current recording may differentiate through it."""
    with _lock:
        gen, ws = _in_use.get(s, (None, []))
        if gen != s.generation:
            _in_use[s] = (s.generation, [w])
        elif not any(x is w for x in ws):
            ws.append(w)


def checkpoint(block: Block, *, name: str | None = None) -> Checkpointed:
    """Rematerialize ``block``: record it as one node per output, recompute it in backward.

    ``block`` is session code: a function of Tensors that records tapeflow ops
    (through :mod:`tapeflow.nn` modules, ``tfl.*`` functions, Params it closes
    over) and returns a Tensor or a tuple (or list) of Tensors. Calling the
    result on session Tensors records one node per output whose operands are the
    Tensor (and array) arguments and one leaf per Param storage the block reads (recorded as
    ordinary parameter uses: tied weights sum, ``grads[p]``, optimizers,
    :func:`value_and_grad` and :func:`train_step` work as without checkpoint).
    Only those are kept on the tape; the backward of the node runs the block
    again and differentiates it, so the block's intermediates exist only during
    that node's VJP. Gradients equal those of the un-checkpointed block.

    * Arguments may be pytrees. Leaves that are Tensors or arrays are operands;
      the others (numbers, flags, strings, Params, modules) are static and must
      be hashable: each new value traces the block again. The block is traced once
      per signature, as ``jax.jit`` traces a function: Python state it reads
      (which Params, which branch) is fixed then; a later run that reads other
      Params is refused with a :class:`TapeError`, never baked in.
    * Random draws inside the block (``tfl.dropout``, ``s.normal`` on the
      current session) are supported: each call draws one key from the calling
      session (one RNG counter step) and passes it as an operand, so the forward
      and the recomputation see the same random values. They differ from the
      values the un-checkpointed block would draw.
    * Several outputs record one node each; in eager mode each node's kernel runs
      the block (under ``jax.jit`` XLA merges them), and each output's backward
      recomputes it. Prefer single-output blocks where that matters.
    * Under a mixed-precision policy (``Session(compute_dtype=...)``,
      ``train_step(compute_dtype=...)``) the block records and recomputes under
      the same policy: its gradients equal the un-checkpointed block's under it.
    * A block cannot update state: :meth:`Session.assign_state` inside it (a
      BatchNorm in train mode) is refused at its first write, so the refused
      call changes nothing. Call such a layer outside the block, or in eval mode.
    * A block that fails (a shape error inside) raises a :class:`TapeError`
      naming the block; the calling session's tape is unchanged.
    * Wrap a block once and reuse the wrapper: each wrapper is its own registry
      op with its own compiled kernels. Calling ``checkpoint`` again on the same
      block while its wrapper is alive returns that wrapper.

    >>> import jax, jax.numpy as jnp, tapeflow as tfl
    >>> w = tfl.Param(jnp.array([[1.0, 2.0], [3.0, 4.0]]), name="w")
    >>> layer = tfl.checkpoint(lambda h: tfl.tanh(h @ w))
    >>> def loss(s, x):
    ...     return tfl.sum(layer(layer(x)))
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([[0.1, -0.2]]))
    ...     g = s.backward(loss(s, x))[w]
    >>> _, g2 = tfl.value_and_grad(loss)({"w": w}, jnp.array([[0.1, -0.2]]))
    >>> bool(jnp.allclose(g, g2["w"]))
    True
    """
    _purge()
    try:
        memo_key: Hashable | None = (block, name)
        hash(memo_key)
    except TypeError:
        memo_key = None
    with _lock:
        if memo_key is not None:
            w = _memo.get(memo_key)
            if w is not None:
                return w
        w = Checkpointed(block, name)
        if memo_key is not None:
            _memo[memo_key] = w
        return w
