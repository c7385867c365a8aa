"""The gradient controls of a :class:`~tapeflow.Session`: its tensor hooks, its ``no_grad`` blocks, ``jvp``.

A :class:`GradControls` is one part a session holds, one layer below the
session module (``docs/architecture.md``): :meth:`GradControls.register`
stores the hooks that :meth:`Session.backward <tapeflow.Session.backward>` runs
through :func:`tapeflow._core._backward.run_hooks` (the session puts its old
tape back when one raises, so a hook never leaves a half-recorded tape);
:meth:`GradControls.paused` turns tracking off for a block, and
:class:`NoGrad` is that block as :meth:`Session.no_grad <tapeflow.Session.no_grad>`
opens it (the recorder describes its conditions again on the way in and out);
:func:`tangent` is :meth:`Session.jvp <tapeflow.Session.jvp>`'s forward-mode sweep
with its keys checked.

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
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Generic, TypeVar

from .._core._backward import Hook
from .._core._jvp import jvp_keys
from .._core._typing import Array, ArrayLike, NodeId
from ._params import Param, Storage
from ._tensor import RemovableHandle, Tensor, check_handle

if TYPE_CHECKING:
    from ._session import Session

__all__ = ["GradControls", "NoGrad", "tangent"]

S = TypeVar("S")


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


class NoGrad(contextlib.ContextDecorator, Generic[S]):
    """A ``no_grad`` block of ``owner`` (what ``with`` gives back): ``enter`` checks the caller first, and
    ``retune`` describes the recording's conditions again once the depth changed, on the way in and out.
    Also a decorator: the function runs inside the block at every call (as ``@torch.no_grad()``).

    >>> ctl, seen = GradControls(), []
    >>> with NoGrad("session", ctl, lambda: None, lambda: seen.append(ctl.depth)) as got:
    ...     got, ctl.depth
    ('session', 1)
    >>> seen, ctl.depth
    ([1, 0], 0)
    """

    __slots__ = ("ctl", "enter", "owner", "retune")

    def __init__(self, owner: S, ctl: GradControls, enter: Callable[[], None], retune: Callable[[], None]) -> None:
        self.owner, self.ctl, self.enter, self.retune = owner, ctl, enter, retune

    def __enter__(self) -> S:
        self.enter()
        self.ctl.depth += 1
        try:
            self.retune()  # the grad depth is one of the recorder's conditions
        except BaseException:
            self.__exit__()
            raise
        return self.owner

    def __exit__(self, *exc: object) -> None:
        self.ctl.depth -= 1
        self.retune()


def tangent(
    s: Session, output: Tensor, tangents: Mapping[Tensor | Param, ArrayLike], storage_by_leaf: Mapping[NodeId, Storage]
) -> Array:
    """:meth:`Session.jvp <tapeflow.Session.jvp>` on ``s``'s recording: the keys checked (live handles of ``s``,
    or Params, whose tangent reaches every leaf in ``storage_by_leaf`` that reads their storage), the values
    computed, then the tangent sweep.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> s = tfl.Session()
    >>> x = s.input(jnp.arange(3.0))
    >>> float(tangent(s, tfl.sum(x * x), {x: jnp.ones(3)}, {}))
    6.0
    """
    for k in (output, *tangents):
        if isinstance(k, Tensor):
            check_handle(k, s)
        elif not (isinstance(k, Param) and isinstance(output, Tensor)):  # output: a Tensor, keys: also Params
            raise TypeError(f"Session.jvp takes a Tensor output and Tensor or Param keys, got {type(k).__name__}")
    s.materialize()  # the tangent sweep reads the forward values
    return jvp_keys(s.recording, output.id, tangents, storage_by_leaf)
