"""State cells written by a recording: BatchNorm's running statistics and the like.

A *state cell* is a non-trainable :class:`~tapeflow.Param` that a forward pass
updates (a running mean, a batch counter). Layers write it with
:meth:`Session.assign_state <tapeflow.Session.assign_state>`; what happens depends
on the session:

* an **eager** session writes the storage at once, as PyTorch updates a
  buffer during the forward, and remembers the value it replaced. When an
  :meth:`Optimizer.step <tapeflow.Optimizer.step>` over the gradients of that
  recording fails (a non-finite gradient with ``check_finite``, an exception
  in the update), the replaced values are put back, so a failed step leaves the
  state cells unchanged exactly like the parameters; once a step over them
  succeeded, the writes are final.
* a **traced** session (the one :func:`~tapeflow.value_and_grad` and
  :func:`~tapeflow.train_step` trace) writes nothing: it records the new value
  (later reads in the same recording see it) and lists it in
  ``session.state_writes``. ``train_step`` returns those values from its
  compiled program and installs them with the optimizer's write-back;
  ``value_and_grad(has_state=True)`` returns them.

>>> import jax.numpy as jnp, tapeflow as tfl
>>> count = tfl.Param(jnp.zeros(()), name="count", trainable=False)
>>> with tfl.Session() as s:
...     s.assign_state(count, s.use(count) + 1.0)
...     float(count.value), [st is count.storage for st in s.state_writes]
(1.0, [True])
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from .._core import _registry as R
from .._core._result import TapeError
from .._core._typing import Array, ArrayLike
from ._commit import commit
from ._grads import Grads
from ._params import Param, Storage

if TYPE_CHECKING:
    from ._values import ParamSource

__all__ = [
    "ModeOwner",
    "StateLog",
    "check_state_cell",
    "mode_reads",
    "note_mode_read",
    "state_log_of",
    "state_writes_refused",
]


class ModeOwner(Protocol):
    """What has a train/eval mode (an ``nn.Module``): a compiled program is keyed by it."""

    @property
    def training(self) -> bool: ...


_MODE_READS: contextvars.ContextVar[dict[int, ModeOwner] | None] = contextvars.ContextVar(
    "tapeflow_mode_reads", default=None
)


def note_mode_read(owner: ModeOwner) -> None:
    """Note that ``owner``'s train/eval mode was read (``Module.training`` calls this) while :func:`mode_reads` collects."""
    reads = _MODE_READS.get()
    if reads is not None:
        reads.setdefault(id(owner), owner)


@contextlib.contextmanager
def mode_reads() -> Iterator[dict[int, ModeOwner]]:
    """Collect the objects whose mode is read inside the block (``id -> object``), e.g. while a step is traced.

    A compiled program bakes in the modes its trace read; :class:`~tapeflow.TrainStep`
    keys its programs by them, so switching a module between train and eval mode
    selects (or compiles) the matching program instead of reusing a stale one.

    >>> import tapeflow as tfl
    >>> drop = tfl.nn.Dropout(0.5)
    >>> with mode_reads() as reads:
    ...     drop.training
    True
    >>> list(reads.values()) == [drop]
    True
    """
    reads: dict[int, ModeOwner] = {}
    token = _MODE_READS.set(reads)
    try:
        yield reads
    finally:
        _MODE_READS.reset(token)


_REFUSED: contextvars.ContextVar[str | None] = contextvars.ContextVar("tapeflow_state_writes_refused", default=None)


@contextlib.contextmanager
def state_writes_refused(where: str) -> Iterator[None]:
    """Refuse every state write inside the block, before anything is written; ``where`` names the block.

    A checkpointed block runs again in its backward, so a write inside it would
    happen twice (and, compiled, with values JAX traces); refusing the first
    write keeps a refused call free of side effects.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> n = tfl.Param(jnp.zeros(()), trainable=False)
    >>> with tfl.Session() as s, state_writes_refused("checkpoint(f)"):
    ...     s.assign_state(n, 1.0)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    tapeflow._core._result.TapeError: assign_state: the state cell Param(...) is written
      inside checkpoint(f), ...
    >>> float(n.value)
    0.0
    """
    token = _REFUSED.set(where)
    try:
        yield
    finally:
        _REFUSED.reset(token)


class StateLog:
    """The state writes of one recording: new values in write order, and (eagerly) the values they replaced.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> st = tfl.Storage(jnp.zeros(2))
    >>> log = StateLog()
    >>> log.write(st, jnp.ones(2), eager=True)
    >>> st.read_current().tolist(), len(log.new)
    ([1.0, 1.0], 1)
    >>> log.undo()
    >>> st.read_current().tolist(), len(log.new)
    ([0.0, 0.0], 0)
    """

    __slots__ = ("new", "old", "parts")

    def __init__(self) -> None:
        self.new: dict[Storage, Array] = {}
        self.old: dict[Storage, Array] = {}  # eager writes only: the value before the recording's first write
        self.parts: tuple[StateLog, ...] = ()  # a merged log: the recordings' logs it stands for

    @classmethod
    def merged(cls, logs: list[StateLog]) -> StateLog:
        """One log for several recordings in order (accumulated gradients): undo puts back the oldest values.

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> st = tfl.Storage(jnp.zeros(()))
        >>> a, b = StateLog(), StateLog()
        >>> a.write(st, jnp.ones(()), eager=True); b.write(st, jnp.full((), 2.0), eager=True)
        >>> StateLog.merged([a, b]).undo()
        >>> float(st.read_current()), a.old, b.old
        (0.0, {}, {})
        """
        out = cls()
        out.parts = tuple(logs)
        for log in logs:
            for st, v in log.old.items():
                out.old.setdefault(st, v)
            out.new.update(log.new)
        return out

    def write(self, st: Storage, v: Array, *, eager: bool) -> None:
        """Note ``v`` as the new value of ``st``; ``eager`` also writes the storage, remembering the old value."""
        if eager:
            old = st.read_current()
            commit([(st, v)], where="assign_state")
            self.old.setdefault(st, old)
        self.new[st] = v

    def undo(self) -> None:
        """Put back the values the eager writes replaced (one unit, Ctrl-C held off), and forget the writes."""
        forget = [x.clear for log in (self, *self.parts) for x in (log.old, log.new)]
        commit(self.old.items(), where="StateLog.undo", then=forget)

    def commit(self) -> None:
        """Make the writes final: a later failure no longer undoes them."""
        self.old.clear()
        for log in self.parts:
            log.old.clear()

    def assign(self, param: Param, value: ArrayLike, *, eager: bool) -> Array:
        """Check ``value`` as the new value of the state cell ``param`` (see :func:`check_state_cell`), cast it, note it.

        The value must have the cell's shape and is cast to its dtype; ``eager``
        writes the storage now (a traced value cannot be written). Returns the
        value as noted.

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> cell = tfl.Param(jnp.zeros(2, jnp.int32), trainable=False)
        >>> StateLog().assign(cell, [1.5, 2.5], eager=False).tolist()
        [1, 2]
        """
        st = param.storage
        where = _REFUSED.get()
        if where is not None:
            raise TapeError(
                f"assign_state: the state cell {param!r} is written inside {where}, which recomputes its block in "
                "backward and so cannot update state; nothing was written. Call the layer that updates state (a "
                "BatchNorm in train mode) outside the checkpointed block, or put it in eval mode inside it"
            )
        if tuple(np.shape(value)) != st.shape:
            raise TapeError(
                f"assign_state: {param!r} holds {R.fmt_spec((st.shape, st.dtype))}; the new value has shape "
                f"{tuple(np.shape(value))}. A state cell keeps its shape"
            )
        v = jnp.asarray(value, st.dtype)
        if eager and isinstance(v, jax.core.Tracer):
            raise TapeError(
                f"assign_state: the new value of {param!r} is being traced by JAX (a jax transformation of eager "
                "session code), so it cannot be written into the storage. Update state outside the transformation, "
                "or use tfl.train_step / tfl.value_and_grad(has_state=True)"
            )
        self.write(st, v, eager=eager)
        return v

    def assign_cell(self, param: object, value: ArrayLike, source: ParamSource | None) -> None:
        """:meth:`Session.assign_state <tapeflow.Session.assign_state>` on this log: ``param`` checked as a state
        cell (:func:`check_state_cell`), ``value`` checked and noted. Written into the storage now, or, given a
        traced recording's ``source``, only recorded there (its later uses in the recording read it).

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> cell = tfl.Param(jnp.zeros(()), trainable=False)
        >>> StateLog().assign_cell(cell, 3.0, None); float(cell.value)
        3.0
        """
        cell = check_state_cell(param)
        new = self.assign(cell, value, eager=source is None)
        if source is not None:
            source.write(cell.storage, new)

    def attach(self, grads: Grads) -> None:
        """Let ``grads`` carry this log (when it holds eager writes), so a failed optimizer step can undo them."""
        if self.old:
            grads.state_logs = (self,)


def check_state_cell(param: object) -> Param:
    """``param`` if it may be written as a state cell (a non-trainable Param, not a view), else the error.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> cell = tfl.Param(jnp.zeros(()), name="w")
    >>> check_state_cell(cell)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    tapeflow._core._result.TapeError: assign_state: Param('w', float32[], storage=#...)
      is trainable; ...
    """
    if not isinstance(param, Param):
        raise TypeError(f"assign_state expects a non-trainable tfl.Param, got {type(param).__name__}")
    if param.bound:
        raise TypeError(f"assign_state: {param!r} is a read-only view made by a JAX transformation")
    if param.trainable:
        raise TapeError(
            f"assign_state: {param!r} is trainable; its value belongs to the optimizer. State cells "
            "(running statistics, counters) are Params created with trainable=False"
        )
    return param


def state_log_of(grads: object) -> StateLog | None:
    """The state log of the recording(s) ``grads`` came from (None: a mapping, or recordings that wrote no state).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     loss = tfl.sum(s.input(jnp.ones(2), requires_grad=True))
    ...     state_log_of(s.backward(loss)) is None
    True
    """
    if not isinstance(grads, Grads):
        return None
    logs = [log for log in grads.state_logs if isinstance(log, StateLog) and log.old]
    if len(logs) < 2:
        return logs[0] if logs else None
    return StateLog.merged(logs)  # accumulated gradients: a failed step puts back what every recording wrote
