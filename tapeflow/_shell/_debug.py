"""NaN provenance in the shell: where each op was recorded, and how a non-finite step is explained.

``Session(debug_nans=True)`` (or ``TAPEFLOW_DEBUG_NANS=1``) notes, for every
node it records, the user's line (the first frame outside tapeflow) and the
``tfl.nn.Module`` calls it was recorded in (:class:`Sites`). A step whose loss
or gradients are not finite is then explained by :class:`NonFiniteCheck`: the
pure search :func:`tapeflow._core._nonfinite.nonfinite_origin` finds the
origin, and :func:`locate` adds the line, the module path and the Param's name.
Nothing here runs for a step that is finite.

>>> import jax.numpy as jnp, tapeflow as tfl
>>> s = tfl.Session(debug_nans=True)
>>> x = s.input(jnp.array([-1.0, 4.0]), requires_grad=True)
>>> try:
...     s.backward(tfl.sum(tfl.sqrt(x)))[x]  # a lazy session checks when it computes
... except tfl.NonFiniteError as e:
...     print(e.phase, e.op, e.node, e.where.split(":")[0])
forward sqrt 1 <doctest tapeflow._shell._debug[3]>
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import threading
from collections.abc import Mapping, Sequence
from types import CodeType, FrameType

import jax
import jax.numpy as jnp
import numpy as np

from .._core import _registry as R
from .._core._nonfinite import NonFiniteError, Origin, nonfinite_origin
from .._core._tape import Tape
from .._core._typing import Array, NodeId

__all__ = [
    "NonFiniteCheck",
    "Sites",
    "debug_nans_default",
    "finite_flag",
    "locate",
    "module_stack",
    "track_modules",
    "tracking",
]

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # .../tapeflow/
_INSIDE: dict[CodeType, bool] = {}  # code object -> whether it is tapeflow's own

tracking = False
"""Whether ``tfl.nn.Module`` calls are noted (set once a debugging session or step exists; read per call)."""

_local = threading.local()


def debug_nans_default(flag: bool | None) -> bool:
    """``flag``, or (None) whether the environment variable ``TAPEFLOW_DEBUG_NANS`` is set to a true value.

    >>> debug_nans_default(True), debug_nans_default(False)
    (True, False)
    """
    if flag is None:
        flag = os.environ.get("TAPEFLOW_DEBUG_NANS", "").strip().lower() not in ("", "0", "false", "no", "off")
    if flag:
        track_modules()
    return bool(flag)


def track_modules() -> None:
    """From now on, note which ``tfl.nn.Module`` calls are open while an op records (for ``err.module``)."""
    global tracking
    tracking = True


def module_stack() -> list[object]:
    """This thread's open ``tfl.nn.Module`` calls, outermost first (the list ``Module.__call__`` pushes on)."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _caller() -> tuple[str, int] | None:
    """``(file, line)`` of the first frame outside tapeflow: the user's code that recorded an op."""
    f: FrameType | None = inspect.currentframe()  # tapeflow's own frames are skipped below
    inside = _INSIDE
    while f is not None:
        code = f.f_code
        own = inside.get(code)
        if own is None:
            name = code.co_filename
            own = inside[code] = name.startswith(_PKG) or name.startswith("<tapeflow generated")
        if not own:
            return code.co_filename, f.f_lineno
        f = f.f_back
    return None


class Sites:
    """Where each node of one recording was made: ``(file, line)`` and the open module calls, by node id."""

    __slots__ = ("by_node",)

    def __init__(self) -> None:
        self.by_node: dict[NodeId, tuple[tuple[str, int] | None, tuple[object, ...]]] = {}

    def note(self, start: NodeId, end: NodeId) -> None:
        """Note the caller of nodes ``start..end-1`` (just recorded)."""
        if end <= start:
            return
        stack = getattr(_local, "stack", None)
        site = (_caller(), tuple(stack) if stack else ())
        d = self.by_node
        for i in range(start, end):
            d[i] = site

    def where(self, i: NodeId) -> str | None:
        """``"file.py:LINE"`` of node ``i`` (relative to the working directory when under it), or None."""
        site = self.by_node.get(i)
        if site is None or site[0] is None:
            return None
        path, line = site[0]
        try:
            rel = os.path.relpath(path)
            path = path if rel.startswith("..") else rel
        except ValueError:  # another drive (Windows)
            pass
        return f"{path}:{line}"

    def module(self, i: NodeId) -> str | None:
        """The attribute path of the innermost module call that recorded node ``i`` (its class name at the root)."""
        site = self.by_node.get(i)
        if site is None or not site[1]:
            return None
        root, inner = site[1][0], site[1][-1]
        if inner is root:
            return type(root).__name__
        for name, m in root.named_modules():  # type: ignore[attr-defined]
            if m is inner and name:
                return str(name)
        return type(inner).__name__


def locate(origin: Origin, sites: Sites | None, params: Mapping[NodeId, object]) -> Origin:
    """``origin`` with its line, module path and Param name filled in from a session's records.

    ``params`` maps the leaves that are Param uses to their Param (anything with a ``name``).
    """
    changes: dict[str, object] = {}
    if origin.op == "input" and origin.node in params:
        changes["op"] = "param"
        changes["name"] = getattr(params[origin.node], "name", None)
    if sites is not None:
        changes["where"] = sites.where(origin.node)
        changes["module"] = sites.module(origin.node)
        if origin.masked_by is not None:
            changes["masked_where"] = sites.where(origin.masked_by)
    return dataclasses.replace(origin, **changes) if changes else origin  # type: ignore[arg-type]


@jax.jit
def _all_finite(values: list[Array]) -> Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(v)) for v in values]))


def finite_flag(values: Sequence[Array]) -> bool:
    """Whether every floating array in ``values`` is finite: one compiled reduction, one host read.

    >>> finite_flag([jnp.ones(2), jnp.arange(3)]), finite_flag([jnp.array(jnp.nan)])
    (True, False)
    """
    checked = [v for v in values if R.is_float(np.dtype(v.dtype)) and v.size]
    if not checked:
        return True
    return bool(_all_finite(checked))


class NonFiniteCheck:
    """How one backward's non-finite gradients are checked and explained.

    ``debug``: the session asked for ``debug_nans`` (every step is checked; the
    origin gets its line); else only a refusal by ``check_finite`` asks for the
    origin. ``explain()`` runs the search on the tape the backward was taken of.
    """

    __slots__ = ("debug", "params", "root", "seed", "sites", "tape")

    def __init__(
        self,
        debug: bool,
        tape: Tape,
        root: NodeId,
        seed: Array | None,
        sites: Sites | None,
        params: Mapping[NodeId, object],
    ) -> None:
        self.debug, self.tape, self.root, self.seed, self.sites, self.params = debug, tape, root, seed, sites, params

    def explain(self) -> Origin | None:
        """The origin of the non-finite values of this backward (None: everything reaching the loss is finite)."""
        origin = nonfinite_origin(self.tape, self.root, self.seed)
        return None if origin is None else locate(origin, self.sites, self.params)

    def error(self, message: str) -> NonFiniteError:
        """A :class:`~tapeflow.NonFiniteError` with ``message`` and the origin (None when the search finds none)."""
        return NonFiniteError(message, self.explain())

    def verify(self, grads: Sequence[Array], where: str) -> None:
        """Raise :meth:`error` unless the root's value and every array in ``grads`` are finite (one fused check)."""
        root = self.tape[self.root].value
        if not finite_flag([root, *grads]):
            raise self.error(f"{where}: the loss or a gradient is not finite (debug_nans); nothing was updated")
