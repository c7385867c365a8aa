"""The gradient controls of a :class:`~tapeflow.Session`: its tensor hooks and its ``no_grad`` depth.

A :class:`GradControls` is one part a session holds, one layer below the
session module (``docs/architecture.md``): :meth:`GradControls.register`
stores the hooks that :meth:`Session.backward <tapeflow.Session.backward>` runs
through :func:`tapeflow._core._backward.run_hooks` (the session puts its old
tape back when one raises, so a hook never leaves a half-recorded tape);
:meth:`GradControls.paused` turns tracking off for a block
(:meth:`Session.no_grad <tapeflow.Session.no_grad>`).

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
from collections.abc import Iterator

from .._core._backward import Hook
from .._core._typing import NodeId
from ._tensor import RemovableHandle

__all__ = ["GradControls"]


class GradControls:
    """A recording's tensor hooks (``node id -> hooks``) and how many ``no_grad`` blocks are open.

    >>> ctl = GradControls()
    >>> handle = ctl.register(3, lambda g: g * 2)
    >>> with ctl.paused():
    ...     ctl.depth, len(ctl.hooks[3])
    (1, 1)
    >>> handle.remove(); ctl.depth, ctl.hooks
    (0, {3: []})
    """

    __slots__ = ("depth", "hooks")

    def __init__(self) -> None:
        self.hooks: dict[NodeId, list[Hook]] = {}
        self.depth = 0  # open no_grad blocks: tracking is on only at 0

    def register(self, node_id: NodeId, fn: Hook) -> RemovableHandle:
        """Run ``fn(cotangent)`` when a backward reaches node ``node_id``; the handle removes it."""
        if not callable(fn):
            raise TypeError(f"register_hook expects a function of the cotangent, got {type(fn).__name__}")
        return RemovableHandle(self.hooks.setdefault(node_id, []), fn)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Record without gradient tracking inside the block."""
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def clear(self) -> None:
        """Drop every hook (a reset's new recording has no nodes to hook)."""
        self.hooks = {}
