"""How a session's backward runs: op by op, as one compiled program, or on a lane; what it reuses and checks.

A :class:`BackwardPlanner` is the part of a :class:`~tapeflow.Session` that
checks a ``backward`` call (:meth:`BackwardPlanner.check`: live handles,
gradients on, a real seed, ``wrt`` handles that require grad) and turns it into
:class:`~tapeflow.Grads`, as one pipeline (:meth:`BackwardPlanner.backward`):

1. the growth warning: a second training step on one recording
   (:class:`TapeGrowthWarning`);
2. the hooks, as the sweep calls them;
3. how it runs: a lazy session's gradient program, an eager session's one
   compiled program (:meth:`BackwardPlanner.compiles`: decided by the recording
   alone), the recorded sweep (``create_graph``), or the sweep op by op;
4. what it reuses: the last backward's :class:`~tapeflow._shell._lazy.BackwardPlan`
   (requested ids, parameter groups, checks) while the recording has the same
   structure and Params;
5. the sweep, the non-finite check (``debug_nans``) and the Grads, with the
   storages' hooks run; anything that fails puts the old tape back.

A lazy session that replayed its whole outline on a lane takes
:meth:`BackwardPlanner.lane_backward` first: the plan its outline's last
backward used, values only, no node built.

>>> import jax.numpy as jnp, tapeflow as tfl
>>> w = tfl.Param(jnp.ones(2), name="w")
>>> s = tfl.Session(lazy=True)
>>> for step in range(2):
...     with s:
...         print(s.backward(tfl.sum(s.input(jnp.arange(2.0)) * w))[w].tolist())
[0.0, 1.0]
[0.0, 1.0]
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeAlias, cast

import jax.numpy as jnp

from .._core._backward import GraphHook, Hook, backward_graph, root_and_seed, run_hooks
from .._core._backward import backward as tape_backward
from .._core._nonfinite import Origin
from .._core._result import TapeError
from .._core._tape import Tape
from .._core._typing import Array, NodeId
from ._debug import NonFiniteCheck
from ._gradctl import GradControls
from ._grads import Grads
from ._lazy import BackwardPlan, LazyGrads, ParameterGroups, Structure, traced_gradients
from ._recorder import Recorder
from ._state import StateLog
from ._tensor import Tensor, check_handle
from ._values import COMPLEX_HINT

if TYPE_CHECKING:
    from ._session import Session

__all__ = ["BackwardPlanner", "TapeGrowthWarning"]

ArrayHooks: TypeAlias = dict[NodeId, list[Hook[Array]]]
"""A backward's tensor hooks as the array sweep calls them: cotangent in, checked replacement out."""

GraphHooks: TypeAlias = dict[NodeId, list[GraphHook]]
"""A recorded backward's tensor hooks: ``(tape, cotangent id)`` in and out."""


class TapeGrowthWarning(UserWarning):
    """A session recorded another training step without a reset (its tape keeps growing).

    >>> import warnings, jax.numpy as jnp, tapeflow as tfl
    >>> issubclass(tfl.TapeGrowthWarning, UserWarning)
    True
    """


def _note_step(ref: weakref.ref[BackwardPlanner], generation: int) -> None:
    """An optimizer stepped from the gradients of recording ``generation`` of ``ref``'s session."""
    planner = ref()
    if planner is not None:
        planner.stepped = max(planner.stepped, generation)


class BackwardPlanner:
    """A session's backward: the pipeline (see the module docstring) and what it remembers between backwards.

    ``stepped`` is the generation an optimizer last stepped from (a backward of
    it again is the growth the warning names); ``unfit`` a structure whose
    backward failed to trace as one program (it runs op by op from then on).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> s = tfl.Session()
    >>> x = s.input(jnp.ones(2), requires_grad=True)
    >>> s.backward(tfl.sum(x * x))[x].tolist()
    [2.0, 2.0]
    """

    __slots__ = ("__weakref__", "grad", "rec", "ref", "stepped", "unfit", "warned")

    def __init__(self, rec: Recorder, grad: GradControls) -> None:
        self.rec = rec  # the recording it differentiates
        self.grad = grad  # the session's tensor hooks
        self.ref = weakref.ref(self)  # what an optimizer's step notes its generation through
        self.stepped = -1
        self.unfit: Structure | None = None
        self.warned = False

    def backward(
        self,
        s: Session,
        root: NodeId,
        seed: Array | None,
        wrt: tuple[NodeId, ...],
        create_graph: bool,
        state_log: StateLog,
    ) -> Grads:
        """Gradients of node ``root`` of ``s``'s recording (:meth:`check` passed): the pipeline, or a lane's."""
        rec = self.rec
        if rec.lane is not None and seed is None and not wrt and not create_graph:
            laned = self.lane_backward(root, state_log)
            if laned is not None:
                return laned
        if self.stepped == rec.generation and not self.warned:
            self.warn_growth()
        old = rec.tape
        array_hooks, graph_hooks = self.hooks(s, old, create_graph)
        hooked = bool(array_hooks or graph_hooks)
        # how it runs: a lazy session's program (unless it records, is hooked or holds exact rationals), an eager
        # one's compiled program when its structure allows (fused with the optimizer step that consumes it)
        mode, lz = rec.mode, rec.lazy
        lazy = mode == "lazy" and not (create_graph or hooked or lz.exact)
        ol = rec.outline
        if ol is not None and len(lz.keys) < len(old) and (lazy or mode == "eager"):
            hint = ol.structure_hint(len(old), lz.epoch)
            if hint is not None:
                lz.keys = hint  # a replayed recording's structure is the outline's
        compiled = mode == "eager" and not (create_graph or hooked) and self.compiles(old)
        program = lazy or compiled
        # what it reuses: the same structure, Params and request as the last backward
        struct: Structure = ()
        plan: BackwardPlan | None = None
        if program:
            struct = lz.structure(old)
            plan = rec.lazy.plan
            if plan is None or not plan.matches(struct, root, seed, wrt, rec.params_by_leaf, rec.storage_by_leaf):
                plan = None
        kept = None if plan is None else plan.groups()
        if plan is not None and kept is not None:
            ids, groups = plan.ids, kept
        else:
            plan = None
            ids, groups = self.requested(s, old, root, wrt), ParameterGroups(s.parameter_groups())
        traced = mode == "traced" and not (create_graph or hooked or lz.exact)  # a sweep of its own, below
        if not (lazy or traced):
            s.materialize()  # the sweep below reads every value
        by_leaf: dict[NodeId, Array] | dict[NodeId, Tensor] | LazyGrads
        try:
            if program and plan is None:
                checked = root_and_seed(old, root, seed)[1]  # root and seed checked now, as eagerly
                pending = LazyGrads(struct, old, root, None if seed is None else checked, ids)
                try:
                    pending.check()
                except Exception:
                    if not compiled:
                        raise
                    program = False  # what fails to trace as one program runs op by op (a failing VJP raises there)
                    self.unfit = struct
                if program and seed is None:
                    rec.lazy.plan = BackwardPlan.of(
                        struct, root, wrt, rec.params_by_leaf, rec.storage_by_leaf, ids, groups
                    )
            if program:  # computed on first read, or fused into the optimizer step that consumes them
                by_leaf = pending if plan is None else LazyGrads(struct, old, root, None, ids)  # plan: checked
            elif create_graph:
                with rec.eagerly():  # the sweep and the hooks read values
                    t, by_id = backward_graph(old, root, seed, ids, graph_hooks)
                s.check_thread()
                rec.install(t)
                by_leaf = {i: s.handle(j) for i, j in by_id.items()}
            elif traced:  # on tracers, into the caller's program; a repeated block traced once
                by_leaf = traced_gradients(old, root, seed, ids)
            else:
                by_leaf = tape_backward(old, root, seed=seed, wrt=ids, hooks=array_hooks)
            check = self.nonfinite_check(old, root, seed)
            if check is not None and check.debug and compiled and program:
                # an eager session's backward raises at its line under debug_nans, compiled or not: the
                # gradients are computed now (not fused into the optimizer step) and checked below
                by_leaf = cast(LazyGrads, by_leaf).resolve()
                program = False
            if check is not None and check.debug and not program:
                if create_graph:
                    check.verify([s.node(h).value for h in cast(dict[NodeId, Tensor], by_leaf).values()], "backward")
                else:
                    check.verify(list(cast(dict[NodeId, Array], by_leaf).values()), "backward")
            # a recorded backward's gradients are handles: Grads holds them as they are
            grads = self.grads(cast("dict[NodeId, Array] | LazyGrads", by_leaf), groups, state_log)
            grads.check = check
            for group in grads.groups:
                if group.storage is not None and group.storage.hooks:
                    g = grads.group_gradient(group)
                    grads.set_group_gradient(group, run_hooks(group.storage.hooks, g, repr(group.parameter)))
        except BaseException:
            s.check_thread()
            rec.install(old)  # hooks may have recorded on the tape: none of it happened
            raise
        ol = rec.outline
        if lazy and seed is None and not wrt and ol is not None and ol.tape is old and ol.matched == len(ol.keys):
            # a whole replay of the outline: the next one, on a lane, may reuse this backward's plan as it is
            ol.plan, ol.struct = rec.lazy.plan, struct
        return grads

    def check(self, s: Session, loss: Tensor, seed: Array | None, wrt: Sequence[Tensor]) -> None:
        """Raise unless ``s.backward(loss, seed, wrt=wrt)`` may run: live handles, gradients on, a real seed, and
        ``wrt`` handles that require grad.

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> s = tfl.Session()
        >>> x = s.input(jnp.ones(2))
        >>> s.backward(tfl.sum(x), wrt=[x])
        Traceback (most recent call last):
        tapeflow._core._result.TapeError: backward: wrt[0] ... was recorded without requires_grad, ...
        """
        if not isinstance(loss, Tensor):
            raise TypeError(f"Session.backward expects a Tensor handle, got {type(loss).__name__}")
        check_handle(loss, s)
        if not self.rec.grad_enabled:
            raise TapeError(
                "backward: this is an inference session (grad_enabled=False); it records no gradients. "
                "Open a Session(grad_enabled=True) to train"
            )
        if seed is not None and jnp.iscomplexobj(seed):
            raise TapeError(f"backward: {COMPLEX_HINT}")
        for k, h in enumerate(wrt):
            if not isinstance(h, Tensor):
                raise TypeError(f"backward: wrt takes Tensor handles of this session, got {type(h).__name__}")
            check_handle(h, s)
            # the sweep stops at nodes that need no gradient: their cotangent would read as zeros
            nd = self.rec.tape.nodes[h.id]
            if not nd.requires_grad and nd.op is None:
                raise TapeError(
                    f"backward: wrt[{k}] {h!r} was recorded without requires_grad, so the loss has no gradient "
                    "wrt it (it would read as zeros); record it with s.input(..., requires_grad=True)"
                )
            if not nd.requires_grad:
                raise TapeError(
                    f"backward: wrt[{k}] {h!r} depends on no leaf that requires grad, so the loss has no gradient "
                    "wrt it (it would read as zeros); record the inputs it is computed from with "
                    "s.input(..., requires_grad=True)"
                )

    def lane_backward(self, root: NodeId, state_log: StateLog) -> Grads | None:
        """The backward of a lane that replayed the whole outline, by the plan its last backward used (the same
        Grads, groups and lazy gradients); None: the pipeline of :meth:`backward` (which builds the nodes)."""
        rec = self.rec
        lane = rec.lane
        if lane is None:
            return None
        ol = lane.outline
        plan = ol.plan
        groups = None if plan is None else plan.groups()
        if (
            plan is None
            or groups is None
            or plan is not rec.lazy.plan
            or plan.root != root
            or plan.wrt
            or not lane.whole
            or not rec.grad_enabled
            or rec.debug_nans
            or self.stepped == rec.generation
            or any(self.grad.hooks.values())
        ):
            return None
        for group in groups:
            if group.storage is not None and group.storage.hooks:
                return None
        return self.grads(LazyGrads(cast(Structure, ol.struct), lane, root, None, plan.ids), groups, state_log)

    def grads(self, by_leaf: dict[NodeId, Array] | LazyGrads, groups: ParameterGroups, state_log: StateLog) -> Grads:
        """The Grads of this recording: an optimizer step from them notes its generation; its state writes ride
        along, so a failed step undoes them."""
        rec = self.rec
        grads = Grads(by_leaf, groups, rec.owner, rec.generation)
        grads.on_step = functools.partial(_note_step, self.ref, rec.generation)
        state_log.attach(grads)
        return grads

    def hooks(self, s: Session, tape: Tape, graph: bool) -> tuple[ArrayHooks, GraphHooks]:
        """The tensor hooks as the sweep calls them: arrays in, checked arrays out; or, recording (``graph``),
        ``(tape, id)`` in and out (one of the two is empty)."""
        found = {i: fns for i, fns in self.grad.hooks.items() if fns}
        if not graph:
            return {i: [self.array_hook(tape, i, fn) for fn in fns] for i, fns in found.items()}, {}
        return {}, {i: [self.graph_hook(s, tape, i, fn) for fn in fns] for i, fns in found.items()}

    @staticmethod
    def array_hook(tape: Tape, i: NodeId, fn: Hook[Array]) -> Hook[Array]:
        """``fn`` as the array sweep calls it for node ``i``."""
        nd = tape[i]
        return lambda g: run_hooks([fn], g, f"node #{i} ({nd.op or 'leaf'})")

    def graph_hook(self, s: Session, tape: Tape, i: NodeId, fn: Hook[Tensor]) -> GraphHook:
        """``fn`` as the recorded sweep calls it for node ``i``: it may record on the tape built so far."""
        nd, rec = tape[i], self.rec

        def call(t: Tape, gid: NodeId) -> tuple[Tape, NodeId]:
            s.check_thread()
            rec.install(t)  # the hook records on the tape the sweep has built so far
            r = run_hooks([fn], s.handle(gid), f"node #{i} ({nd.op or 'leaf'})")
            if isinstance(r, Tensor):
                check_handle(r, s)
                return rec.tape, r.id
            return rec.tape, gid

        return call

    def requested(self, s: Session, tape: Tape, root: NodeId, wrt: Sequence[NodeId]) -> list[NodeId]:
        """Every trainable leaf up to ``root`` and every Param leaf after it (zeros when the loss does not reach
        it), then the ``wrt`` ids."""
        nodes = tape.nodes
        params = self.rec.params_by_leaf
        ids = [i for i, nd in enumerate(nodes[: root + 1]) if nd.op is None and nd.requires_grad]
        ids += [i for i in params if i > root and nodes[i].requires_grad]
        ids += wrt
        return ids

    def warn_growth(self) -> None:
        """A second training step on one recording: the tape (and the memory it holds) grows with every step."""
        self.warned = True
        warnings.warn(
            f"Session: backward of another training step on the same recording ({len(self.rec.tape)} nodes, growing "
            "with every step): an optimizer already stepped from this recording's gradients. A session keeps "
            "every op until it is reset (PyTorch frees its graph after backward), so each step gets slower and "
            "holds more memory. Reset once per step: wrap the step in `with s:` (it resets on exit), or call "
            "s.reset() after opt.step(...)",
            TapeGrowthWarning,
            stacklevel=4,  # the line of the user's backward (this, the pipeline, Session.backward, the caller)
        )

    def nonfinite_check(self, tape: Tape, root: NodeId, seed: Array | None) -> NonFiniteCheck | None:
        """How this backward's non-finite gradients are checked (debug_nans) and explained (also for check_finite).

        An eager session's tape holds every forward value, so an optimizer's
        ``check_finite`` refusal can name the origin at no cost; a lazy session's
        would have to recompute it, which only ``debug_nans`` asks for.
        """
        rec = self.rec
        if rec.mode == "traced" or (not rec.debug_nans and rec.mode != "eager"):
            return None  # a traced session's caller (train_step, value_and_grad) checks its program's outputs
        return NonFiniteCheck(rec.debug_nans, tape, root, seed, rec.sites, rec.params_by_leaf)

    def origin(self, root: NodeId, seed: Array | None) -> Origin | None:
        """Where the first non-finite value reaching node ``root`` or its gradients was made (None: all finite),
        searched on the recording's computed values (see :meth:`Session.nonfinite_origin
        <tapeflow.Session.nonfinite_origin>`)."""
        rec = self.rec
        return NonFiniteCheck(rec.debug_nans, rec.tape, root, seed, rec.sites, rec.params_by_leaf).explain()

    def compiles(self, tape: Tape) -> bool:
        """Whether this eager backward of ``tape`` runs as one compiled program.

        Decided by the recording alone, never by what the session ran before: a
        run restored from a checkpoint into a new session then takes the same
        path at every step as the uninterrupted run, so it continues bit for bit
        (the op-by-op sweep and the program round differently). Op by op: a
        recording :meth:`LazyRecording.compiled_structure` refuses, a block's
        session, and a structure whose backward failed to trace (it fails again).
        """
        rec = self.rec
        struct = rec.lazy.compiled_structure(tape)
        return struct is not None and rec.source is None and struct != self.unfit
