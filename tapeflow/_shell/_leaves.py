"""How a value becomes a leaf of a session's recording: inputs, constants, detached values, Param uses, draws.

A :class:`Leaves` is the part of a :class:`~tapeflow.Session` that places a
value and appends it as a leaf node: a ``jax.Array`` as it is (on a lane, only
its value is kept while the outline has an input leaf there), host data
through the session's :class:`~tapeflow._shell._values.ValuePolicy` (a lazy
session keeps a NumPy input on the host until a program reads it), a Param
use with the value the recorder reads for it, registered as that Param's leaf.
Every leaf is installed through the recorder after the thread check, so a
rejected value records nothing.

>>> import jax.numpy as jnp, numpy as np, tapeflow as tfl
>>> s = tfl.Session(lazy=True)
>>> x = s.input(np.ones(2, np.float32), requires_grad=True)
>>> type(s.recording[x.id].value).__name__, x.requires_grad
('ndarray', True)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np

from .._core import _registry as R
from .._core._device import concrete_array_type
from .._core._result import TapeError
from .._core._tape import Node, append_node, leaf
from .._core._typing import Array, ArrayLike, NodeId
from ._grads import ParameterRecord
from ._params import Param, Storage
from ._recorder import Recorder
from ._tensor import Tensor
from ._values import ValuePolicy

if TYPE_CHECKING:
    from ._session import Session

__all__ = ["Leaves"]


class Leaves:
    """A session's leaves: how each kind of value is placed and appended (see the module docstring).

    ``host`` (a lazy session): host data stays a NumPy array in the node until a
    program reads it.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> s = tfl.Session()
    >>> w = tfl.Param(jnp.ones(2), name="w")
    >>> u = s.use(w)
    >>> u.requires_grad, s.leaf_names()
    (True, {0: 'w'})
    """

    __slots__ = ("host", "rec", "values")

    def __init__(self, rec: Recorder, values: ValuePolicy, host: bool) -> None:
        self.rec = rec  # the recording the leaves are appended to
        self.values = values  # how host data enters the session
        self.host = host

    def handle(self, s: Session, i: NodeId) -> Tensor:
        """A handle of node ``i`` of ``s``'s current recording."""
        rec = self.rec
        nd = rec.tape[i]
        return Tensor(s, rec.owner, rec.generation, i, nd.shape, nd.dtype)

    def value(self, s: Session, v: Array, requires_grad: bool) -> Tensor:
        """A leaf holding ``v`` (already checked); a gradient only if asked and gradients are on here."""
        rec = self.rec
        t, i = leaf(rec.tape, v, requires_grad=requires_grad and rec.conditions.tracked)
        s.check_thread()
        rec.install(t)
        return self.handle(s, i)

    def input(self, s: Session, x: ArrayLike | Tensor, requires_grad: bool) -> Tensor:
        """:meth:`Session.input <tapeflow.Session.input>`: ``x`` as a leaf (a handle's value is copied in)."""
        rec = self.rec
        if type(x) is concrete_array_type():  # a jax.Array: leaf() places it
            if rec.lane is not None:  # a replayed step: the outline's input leaf here, placed already
                got = rec.lane_input(s, cast(Array, x), requires_grad)
                if got is not None:
                    return got
            if cast(Array, x).dtype.kind != "c":
                return self.value(s, cast(Array, x), requires_grad)
        if isinstance(x, Tensor):
            x = s.node(x).value
        v = self.values.prepare(x, host=self.host)
        if type(v) is np.ndarray and v.dtype != R.OBJECT:  # a lazy session's host input (read as a jax.Array)
            dt = np.dtype(v.dtype)
            if rec.lane is not None:
                got = rec.lane_leaf(s, v, dt, requires_grad)
                if got is not None:
                    return got
            t, i = append_node(rec.tape, Node(None, (), (), v, rec.leaf_grad(requires_grad, dt), v.shape, dt))
            s.check_thread()
            rec.install(t)
            return self.handle(s, i)
        return self.value(s, v, requires_grad)

    def use(self, s: Session, p: Param) -> Tensor:
        """:meth:`Session.use <tapeflow.Session.use>`: a leaf holding the value a use of ``p`` records."""
        if not isinstance(p, Param):
            raise TypeError(f"Session.use expects a Param, got {type(p).__name__}")
        h = self.value(s, self.rec.param_value(p), p.trainable)
        self.rec.register(h.id, p, p.storage)
        return h

    def mark(self, s: Session, h: Tensor, parameter: ParameterRecord, storage: Storage | None) -> None:
        """:meth:`Session.register_parameter_leaf <tapeflow.Session.register_parameter_leaf>`: the checks, then
        the registration; a rejected one changes nothing."""
        nd = s.node(h)
        if nd.op is not None:
            raise TapeError(
                f"node #{h.id} is the output of {nd.op!r}, not a leaf; only leaves can be parameter registrations"
            )
        if storage is not None and (storage.shape != nd.shape or storage.dtype != nd.dtype):
            raise TapeError(
                f"storage {storage!r} does not match leaf #{h.id} of {R.fmt_spec(nd.spec)}; "
                "a parameter registration's storage must have the leaf's shape and dtype"
            )
        self.rec.register(h.id, parameter, storage)
