"""State cells written by a recording: BatchNorm's running statistics and the like.

A *state cell* is a non-trainable :class:`~tapeflow.Param` that a forward pass
updates (a running mean, a batch counter). Layers write it with
:meth:`Session.assign_state <StateWrites.assign_state>`; what happens depends
on the session:

* an **eager** session writes the storage at once, as PyTorch updates a
  buffer during the forward, and remembers the value it replaced. When an
  :meth:`Optimizer.step <tapeflow.Optimizer.step>` over the gradients of that
  recording fails (a non-finite gradient with ``check_finite``, an exception
  in the update), the replaced values are put back, so a failed step leaves the
  state cells unchanged exactly like the parameters; once a step over them
  succeeded, the writes are final.
* a **functional** session (the one :func:`~tapeflow.value_and_grad` and
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
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core import _registry as R
from .._core._result import TapeError
from .._core._typing import Array, ArrayLike
from ._commit import commit
from ._grads import Grads
from ._params import Param, Storage
from ._tensor import Tensor

if TYPE_CHECKING:
    from .._core._tape import Node

__all__ = ["StateLog", "StateWrites", "mode_reads", "note_mode_read", "state_log_of"]

_LOG_ATTR = "_tapeflow_state_log"
"""The attribute under which a :class:`~tapeflow.Grads` carries the state log of its recording."""


_MODE_READS: contextvars.ContextVar[dict[int, Any] | None] = contextvars.ContextVar("tapeflow_mode_reads", default=None)


def note_mode_read(owner: object) -> None:
    """Note that ``owner``'s train/eval mode was read (``Module.training`` calls this) while :func:`mode_reads` collects."""
    reads = _MODE_READS.get()
    if reads is not None:
        reads.setdefault(id(owner), owner)


@contextlib.contextmanager
def mode_reads() -> Iterator[dict[int, Any]]:
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
    reads: dict[int, Any] = {}
    token = _MODE_READS.set(reads)
    try:
        yield reads
    finally:
        _MODE_READS.reset(token)


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

    __slots__ = ("new", "old")

    def __init__(self) -> None:
        self.new: dict[Storage, Array] = {}
        self.old: dict[Storage, Array] = {}  # eager writes only: the value before the recording's first write

    def write(self, st: Storage, v: Array, *, eager: bool) -> None:
        """Note ``v`` as the new value of ``st``; ``eager`` also writes the storage, remembering the old value."""
        if eager:
            old = st.read_current()
            commit([(st, v)], where="assign_state")
            self.old.setdefault(st, old)
        self.new[st] = v

    def undo(self) -> None:
        """Put back the values the eager writes replaced (one unit, Ctrl-C held off), and forget the writes."""
        commit(self.old.items(), where="StateLog.undo", then=[self.old.clear, self.new.clear])

    def commit(self) -> None:
        """Make the writes final: a later failure no longer undoes them."""
        self.old.clear()


def state_log_of(grads: object) -> StateLog | None:
    """The state log of the recording ``grads`` came from (None: a mapping, or a recording that wrote no state).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     state_log_of(s.backward(tfl.sum(s.input(jnp.ones(2), requires_grad=True)))) is None
    True
    """
    log = getattr(grads, _LOG_ATTR, None) if isinstance(grads, Grads) else None
    return log if isinstance(log, StateLog) and log.old else None


class StateWrites:
    """The state side of a :class:`~tapeflow.Session`: :meth:`assign_state` and :attr:`state_writes`.

    Mixed into ``Session``, which provides ``check_thread``, ``node`` and the
    ``param_values`` overrides (set for the functional sessions of
    ``value_and_grad`` / ``train_step``; None for an eager session).
    """

    _param_values: dict[Storage, Array] | None
    _state_log: StateLog

    def check_thread(self) -> None:  # pragma: no cover - provided by Session
        raise NotImplementedError

    def node(self, h: Tensor) -> Node:  # pragma: no cover - provided by Session
        raise NotImplementedError

    @property
    def state_writes(self) -> Mapping[Storage, Array]:
        """The state cells this recording assigned, ``storage -> new value``, in first-write order (a copy)."""
        return dict(self._state_log.new)

    def assign_state(self, param: Param, value: Tensor | ArrayLike) -> None:
        """Set the state cell ``param`` (a non-trainable Param, e.g. a running mean) to ``value``.

        ``value`` (a Tensor of this session, or an array) must have the cell's
        shape; it is cast to the cell's dtype and is not part of any gradient.
        An eager session writes the storage now (later uses see the new value);
        if an :meth:`Optimizer.step <tapeflow.Optimizer.step>` over this
        recording's gradients fails, the old value is put back. A functional
        session (inside :func:`~tapeflow.value_and_grad` / :func:`~tapeflow.train_step`)
        only records it: later uses in the same recording see it, and
        ``train_step`` installs it with the parameters when the step succeeds.

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> mean = tfl.Param(jnp.zeros(2), name="running_mean", trainable=False)
        >>> with tfl.Session() as s:
        ...     s.assign_state(mean, s.use(mean) * 0.9 + jnp.array([1.0, 2.0]) * 0.1)
        >>> [round(v, 2) for v in mean.value.tolist()]
        [0.1, 0.2]
        """
        self.check_thread()
        if not isinstance(param, Param):
            raise TypeError(f"assign_state expects a non-trainable tfl.Param, got {type(param).__name__}")
        if param.bound:
            raise TypeError(f"assign_state: {param!r} is a read-only view made by a JAX transformation")
        if param.trainable:
            raise TapeError(
                f"assign_state: {param!r} is trainable; its value belongs to the optimizer. State cells "
                "(running statistics, counters) are Params created with trainable=False"
            )
        v = self.node(value).value if isinstance(value, Tensor) else value
        st = param.storage
        if tuple(np.shape(v)) != st.shape:
            raise TapeError(
                f"assign_state: {param!r} holds {R.fmt_spec((st.shape, st.dtype))}; the new value has shape "
                f"{tuple(np.shape(v))}. A state cell keeps its shape"
            )
        v = jnp.asarray(v, st.dtype)
        eager = self._param_values is None
        if eager and isinstance(v, jax.core.Tracer):
            raise TapeError(
                f"assign_state: the new value of {param!r} is being traced by JAX (inside tfl.checkpoint or a "
                "jax transformation of eager session code), so it cannot be written into the storage. Update "
                "state outside the checkpointed block, or use tfl.train_step / tfl.value_and_grad(has_state=True)"
            )
        if not eager:
            assert self._param_values is not None
            self._param_values[st] = v  # later uses in this recording read the new value
        self._state_log.write(st, v, eager=eager)

    def _attach_state_log(self, grads: Grads) -> None:
        """Let ``grads`` carry this recording's state log, so a failed optimizer step can undo its writes."""
        if self._state_log.old:
            setattr(grads, _LOG_ATTR, self._state_log)
