"""Treescope pictures of tapes, and the parts every picture is built from.

`treescope <https://treescope.readthedocs.io>`_ is an optional extra
(``pip install "tapeflow[viz]"``). A class's ``__treescope_repr__`` is one line
that calls a ``render_*`` function; treescope is imported inside those
functions only (:func:`treescope_module`), so tapeflow imports and works
without it (a call then returns ``NotImplemented``, which tells a renderer to
fall back to ``repr``).

This module draws the core's own object, the :class:`~tapeflow.Tape` (its
length, device and nodes, the first and last :data:`TAPE_LIMIT` of a long tape
as its HTML table does), and knows nothing of the layers above it: the
pictures of sessions, handles, parameters and modules are in
``tapeflow/_shell/_render.py``, built from :func:`constructor`, :class:`Note`
and :class:`Drawn`.

The facts come from plain functions that need no treescope:

>>> import jax.numpy as jnp, tapeflow as tfl
>>> t, x = tfl.leaf(tfl.Tape.empty(), jnp.ones((2, 3)), requires_grad=True)
>>> t, y = tfl.record(t, "exp", (x,))
>>> node_lines(t)
['#0 leaf float32[2,3] requires_grad', '#1 exp(0) float32[2,3] requires_grad']

With treescope installed, ``treescope.render_to_text(obj)`` (or
``treescope.display(obj)`` in a notebook) draws the picture:

>>> import treescope
>>> print(treescope.render_to_text(t))  # a tape also appends its HTML table (a box in text)
Tape(
  len=2,
  #0 leaf float32[2,3] requires_grad
  #1 exp(0) float32[2,3] requires_grad
)
...
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, TypeAlias

from ._registry import fmt_spec

if TYPE_CHECKING:
    from ._tape import Tape

__all__ = [
    "TAPE_LIMIT",
    "Drawn",
    "Note",
    "Rendering",
    "SubtreeRenderer",
    "constructor",
    "node_lines",
    "render_tape",
    "storage_readers",
    "treescope_module",
]

TAPE_LIMIT = 20
"""A tape longer than ``2 * TAPE_LIMIT`` nodes shows its first and last ``TAPE_LIMIT``."""


Rendering: TypeAlias = object
"""A treescope rendering (a ``RenderableAndLineAnnotations``); treescope is optional, so it is not imported for types."""

SubtreeRenderer: TypeAlias = Callable[..., object]
"""treescope's ``subtree_renderer(value, path=...)`` handed to every ``__treescope_repr__``."""


class Note(str):
    """A child shown as plain (comment-colored) text instead of a rendered value."""


class Drawn:
    """A child already drawn (a nested tape: drawn directly, without treescope's box for its HTML table)."""

    def __init__(self, rendering: Rendering) -> None:
        self.rendering = rendering


def treescope_module() -> ModuleType | None:
    """The treescope module, imported on first use; None when it is not installed."""
    try:
        return importlib.import_module("treescope")
    except ImportError:
        return None


def storage_readers(storages: Mapping[int, str]) -> dict[str, list[int]]:
    """``storage label -> [leaf id, ...]`` in first-read order: the leaves that read each storage.

    >>> storage_readers({1: "W storage", 3: "b storage", 6: "W storage"})
    {'W storage': [1, 6], 'b storage': [3]}
    """
    out: dict[str, list[int]] = {}
    for i in sorted(storages):
        out.setdefault(storages[i], []).append(i)
    return out


def node_lines(
    tape: Tape,
    limit: int = TAPE_LIMIT,
    labels: Mapping[int, str] | None = None,
    storages: Mapping[int, str] | None = None,
) -> list[str]:
    """One line per node (id, op and parents, shape/dtype, requires_grad); the middle of a long tape elided.

    ``labels`` and ``storages`` are :meth:`Tape.to_dot <tapeflow.Tape.to_dot>`'s: a
    named leaf shows its name and ``<- storage`` (``tied`` when two leaves read it).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> t, w = tfl.leaf(tfl.Tape.empty(), jnp.ones(2, "float32"), requires_grad=True)
    >>> t, w2 = tfl.leaf(t, jnp.ones(2, "float32"), requires_grad=True)
    >>> node_lines(t, labels={0: "W", 1: "W_dec"}, storages={0: "W storage", 1: "W storage"})
    ['#0 leaf W float32[2] requires_grad <- W storage (tied)', '#1 leaf W_dec float32[2] requires_grad <- W storage (tied)']

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> t, x = tfl.leaf(tfl.Tape.empty(), jnp.ones(2))
    >>> for _ in range(5):
    ...     t, r = tfl.record(t, "exp", (len(t) - 1,))
    >>> node_lines(t, limit=2)
    ['#0 leaf float32[2]', '#1 exp(0) float32[2]', '... 2 more nodes ...', '#4 exp(3) float32[2]', '#5 exp(4) float32[2]']
    """
    labels = labels or {}
    storages = storages or {}
    readers = storage_readers(storages)
    n = len(tape)
    ids: Iterable[int] = range(n) if n <= 2 * limit else [*range(limit), -1, *range(n - limit, n)]
    out = []
    for i in ids:
        if i < 0:
            out.append(f"... {n - 2 * limit} more nodes ...")
            continue
        nd = tape[i]
        what = "leaf" if nd.op is None else f"{nd.op}({', '.join(map(str, nd.parents))})"
        if i in labels:
            what += f" {labels[i]}"
        grad = " requires_grad" if nd.requires_grad else ""
        st = storages.get(i)
        reads = "" if st is None else f" <- {st}" + (" (tied)" if len(readers[st]) > 1 else "")
        out.append(f"#{i} {what} {fmt_spec(nd.spec)}{grad}{reads}")
    return out


def constructor(
    ts: ModuleType,
    obj: object,
    fields: Iterable[tuple[str, object]],
    path: str | None,
    subtree_renderer: SubtreeRenderer,
    color: str | None = None,
    expanded: bool = False,
) -> Rendering:
    """Constructor form ``Type(name=value, ...)`` as ``repr_lib.render_object_constructor`` draws it.

    A field whose value is a :class:`Note` is drawn as its text (a fact that is
    not an attribute, so it gets no copy-path button); a field named ``""`` is a
    bare line; one that starts with ``"# "`` is a comment, shown only while the
    node is open. ``expanded`` opens the node whatever treescope's layout would
    choose.
    """
    rp = ts.rendering_parts
    items = list(fields)
    is_comment = [isinstance(v, Note) and not n and v.startswith("# ") for n, v in items]
    last = max((k for k, c in enumerate(is_comment) if not c), default=-1)
    children = []
    for k, (name, value) in enumerate(items):
        if is_comment[k]:  # shown only when the node is open: a folded line stays `Type(a=1, b=2)`
            children.append(rp.fold_condition(expanded=rp.comment_color(rp.text(value))))
            continue
        if k == last:
            comma = rp.fold_condition(expanded=rp.text(",")) if name else rp.empty_part()
        elif name:
            comma = rp.siblings(",", rp.fold_condition(collapsed=rp.text(" ")))
        else:  # a bare line is not an argument: nothing after it when open, "; " when folded
            comma = rp.fold_condition(collapsed=rp.text("; "))
        if isinstance(value, Note):
            shown = rp.text(value)
        elif isinstance(value, Drawn):
            shown = value.rendering
        else:
            child_path = None if path is None or not name.isidentifier() else f"{path}.{name}"
            shown = subtree_renderer(value, path=child_path)
        prefix = f"{name}=" if name else ""
        children.append(rp.build_full_line_with_annotations(rp.siblings_with_annotations(prefix, shown), comma))
    open_ = rp.siblings(
        rp.roundtrip_condition(roundtrip=rp.text("<")),
        rp.maybe_qualified_type_name(type(obj)),
        "(",
    )
    close = rp.siblings(")", rp.roundtrip_condition(roundtrip=rp.text(">")))
    state = rp.ExpandState.EXPANDED if expanded else rp.ExpandState.WEAKLY_COLLAPSED
    return rp.build_foldable_tree_node_from_children(
        prefix=open_, children=children, suffix=close, path=path, background_color=color, expand_state=state
    )


def render_tape(
    tape: Tape,
    path: str | None,
    subtree_renderer: SubtreeRenderer,
    limit: int = TAPE_LIMIT,
    labels: Mapping[int, str] | None = None,
    storages: Mapping[int, str] | None = None,
) -> Rendering:
    """Picture of a tape: its length, device and :func:`node_lines` (see the module example).

    ``labels`` and ``storages`` name Param leaves and the storages they read (a session passes its own).
    """
    ts = treescope_module()
    if ts is None:
        return NotImplemented
    fields: list[tuple[str, object]] = [("len", len(tape))]
    if tape.device is not None:
        fields.append(("device", Note(str(tape.device))))
    fields += [("", Note(line)) for line in node_lines(tape, limit, labels, storages)]
    # drawn as the root (path ""), a tape opens even when its lines exceed treescope's height budget
    return constructor(ts, tape, fields, path, subtree_renderer, expanded=path == "" and len(tape) > 0)
