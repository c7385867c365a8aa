"""The gradient controls of a :class:`~tapeflow.Session`: hooks, ``no_grad`` and forward-mode ``jvp``.

A mixin of :class:`~tapeflow.Session`, one layer below the session module
(``docs/architecture.md``): :meth:`GradControls.register_hook` stores hooks that
:meth:`Session.backward <tapeflow.Session.backward>` runs through
:func:`tapeflow._core._backward.run_hooks`; :meth:`GradControls.no_grad` turns
tracking off for a block; :meth:`GradControls.jvp` pushes tangents forward
through the recording (:mod:`tapeflow._core._jvp`).

>>> import jax.numpy as jnp, tapeflow as tfl
>>> with tfl.Session() as s:
...     x = s.input(jnp.ones(2), requires_grad=True)
...     with s.no_grad():
...         y = x * 2.0
...     y.requires_grad, float(s.jvp(tfl.sum(x * 3.0), {x: jnp.ones(2)}))
(False, 6.0)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Self, cast

from .._core._backward import GraphHook, Hook, run_hooks
from .._core._jvp import jvp_keys
from .._core._tape import Tape
from .._core._typing import Array, ArrayLike, NodeId
from ._params import Param, Storage
from ._tensor import RemovableHandle, Tensor, check_handle

if TYPE_CHECKING:
    from ._session import Session

__all__ = ["GradControls"]


class GradControls:
    """Hooks, ``no_grad`` and ``jvp``, mixed into :class:`~tapeflow.Session`."""

    _hooks: dict[NodeId, list[Hook]]
    _tape: Tape
    _no_grad: int
    _storage_by_leaf: dict[NodeId, Storage]

    def check_thread(self) -> None:  # pragma: no cover - provided by Session
        raise NotImplementedError

    def materialize(self) -> None:  # pragma: no cover - provided by Session
        raise NotImplementedError

    def _commit(self, t: Tape) -> None:  # pragma: no cover - provided by Session
        raise NotImplementedError

    def _handle(self, node_id: NodeId) -> Tensor:  # pragma: no cover - provided by Session
        raise NotImplementedError

    def _session(self) -> Session:
        return cast("Session", self)  # the mixin is only ever a Session

    def register_hook(self, h: Tensor, fn: Hook) -> RemovableHandle:
        """Call ``fn(cotangent)`` when a backward reaches ``h``; see :meth:`Tensor.register_hook`."""
        check_handle(h, self._session())
        if not callable(fn):
            raise TypeError(f"register_hook expects a function of the cotangent, got {type(fn).__name__}")
        return RemovableHandle(self._hooks.setdefault(h.id, []), fn)

    def _hook_call(self, i: NodeId, fn: Hook, graph: bool) -> Hook | GraphHook:
        """``fn`` as the sweep calls it: arrays in, checked arrays out; or, recording, ``(tape, id)`` in and out."""
        nd = self._tape[i]
        if not graph:
            return lambda g: run_hooks([fn], g, f"node #{i} ({nd.op or 'leaf'})")

        def call(t: Tape, gid: NodeId) -> tuple[Tape, NodeId]:
            self._commit(t)  # the hook records on the tape the sweep has built so far
            r = run_hooks([fn], self._handle(gid), f"node #{i} ({nd.op or 'leaf'})")
            if isinstance(r, Tensor):
                check_handle(r, self._session())
                return self._tape, r.id
            return self._tape, gid

        return call

    @contextlib.contextmanager
    def no_grad(self) -> Iterator[Self]:
        """Record without gradient tracking inside the block (ops and leaves get ``requires_grad=False``).

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> with tfl.Session() as s:
        ...     w = s.input(jnp.ones(2), requires_grad=True)
        ...     with s.no_grad():
        ...         frozen = w * 2.0
        ...     frozen.requires_grad, (w * 2.0).requires_grad
        (False, True)
        """
        self.check_thread()
        self._no_grad += 1
        try:
            yield self
        finally:
            self._no_grad -= 1

    def jvp(self, output: Tensor, tangents: Mapping[Tensor | Param, ArrayLike]) -> Array:
        """The tangent of ``output`` given tangents of live handles and of Params (a Param's reaches all its uses).

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> s, w = tfl.Session(), tfl.Param(jnp.array([1.0, 2.0]))
        >>> x = s.input(jnp.array([3.0, 4.0]))
        >>> float(s.jvp(tfl.sum(x * w), {x: jnp.ones(2), w: jnp.array([1.0, 0.0])}))
        6.0
        """
        for k in (output, *tangents):
            if isinstance(k, Tensor):
                check_handle(k, self._session())
            elif not (isinstance(k, Param) and isinstance(output, Tensor)):  # output: a Tensor, keys: also Params
                raise TypeError(f"Session.jvp takes a Tensor output and Tensor or Param keys, got {type(k).__name__}")
        self.materialize()  # the tangent sweep reads the forward values
        return jvp_keys(self._tape, output.id, tangents, self._storage_by_leaf)
