"""Treescope pictures of tapes, sessions, handles, parameters and modules.

`treescope <https://treescope.readthedocs.io>`_ is an optional extra
(``pip install "tapeflow[viz]"``). Each class's ``__treescope_repr__`` is one
line that calls a ``render_*`` function here; treescope is imported inside
those functions only, so tapeflow imports and works without it (a call then
returns ``NotImplemented``, which tells a renderer to fall back to ``repr``).

The pictures show what the text reprs show and what they cannot fold away:
shapes and dtypes, storage identity (a Param's storage uid, the color it
shares with every record of the same storage, and a module's list of tied
registrations), generations (a session's owner, generation, node count and RNG
counter; a stale handle is marked) and a tape's nodes, the first and last
:data:`TAPE_LIMIT` of a long tape as its HTML table does.

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
from ._result import TapeError

if TYPE_CHECKING:
    from .._shell._params import Param, Storage
    from .._shell._session import Session
    from .._shell._tensor import Tensor
    from ..nn import Module
    from ._tape import Tape

__all__ = [
    "TAPE_LIMIT",
    "module_ties",
    "node_lines",
    "render_module",
    "render_param",
    "render_session",
    "render_storage",
    "render_tape",
    "render_tensor",
    "storage_readers",
]

TAPE_LIMIT = 20
"""A tape longer than ``2 * TAPE_LIMIT`` nodes shows its first and last ``TAPE_LIMIT``."""


Rendering: TypeAlias = object
"""A treescope rendering (a ``RenderableAndLineAnnotations``); treescope is optional, so it is not imported for types."""

SubtreeRenderer: TypeAlias = Callable[..., object]
"""treescope's ``subtree_renderer(value, path=...)`` handed to every ``__treescope_repr__``."""


class _Note(str):
    """A child shown as plain (comment-colored) text instead of a rendered value."""


class _Drawn:
    """A child already drawn (a nested tape: drawn directly, without treescope's box for its HTML table)."""

    def __init__(self, rendering: Rendering) -> None:
        self.rendering = rendering


def _treescope() -> ModuleType | None:
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


def module_ties(module: Module) -> list[tuple[int, list[str]]]:
    """``(storage uid, [path, ...])`` for each storage registered under more than one path, in definition order.

    Tied records (:func:`tfl.tie <tapeflow.tie>`) and a Param or sub-module
    stored in two places both share a storage; identity decides, never names.

    >>> import jax, jax.numpy as jnp, tapeflow as tfl
    >>> class AE(tfl.nn.Module):
    ...     def __init__(self):
    ...         self.enc = tfl.Param(jnp.ones((4, 2)), name="enc")
    ...         self.dec = tfl.tie(self.enc, name="dec")
    ...         self.b = tfl.Param(jnp.zeros(2))
    >>> m = AE()
    >>> [paths for uid, paths in module_ties(m)], module_ties(m)[0][0] == m.enc.storage.uid
    ([['enc', 'dec']], True)
    """
    groups: dict[int, tuple[int, list[str]]] = {}
    for name, p in module.parameter_records():
        groups.setdefault(id(p.storage), (p.storage.uid, []))[1].append(name)
    return [g for g in groups.values() if len(g[1]) > 1]


def _build(
    ts: ModuleType,
    obj: object,
    fields: Iterable[tuple[str, object]],
    path: str | None,
    subtree_renderer: SubtreeRenderer,
    color: str | None = None,
    expanded: bool = False,
) -> Rendering:
    """Constructor form ``Type(name=value, ...)`` as ``repr_lib.render_object_constructor`` draws it.

    A field whose value is a :class:`_Note` is drawn as its text (a fact that is
    not an attribute, so it gets no copy-path button); a field named ``""`` is a
    bare line; one that starts with ``"# "`` is a comment, shown only while the
    node is open. ``expanded`` opens the node whatever treescope's layout would
    choose.
    """
    rp = ts.rendering_parts
    items = list(fields)
    is_comment = [isinstance(v, _Note) and not n and v.startswith("# ") for n, v in items]
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
        if isinstance(value, _Note):
            shown = rp.text(value)
        elif isinstance(value, _Drawn):
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


def _storage_color(ts: ModuleType, uid: int) -> str:
    return str(ts.formatting_util.color_from_string(f"tapeflow-storage-{uid}"))


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
    ts = _treescope()
    if ts is None:
        return NotImplemented
    fields: list[tuple[str, object]] = [("len", len(tape))]
    if tape.device is not None:
        fields.append(("device", _Note(str(tape.device))))
    fields += [("", _Note(line)) for line in node_lines(tape, limit, labels, storages)]
    # drawn as the root (path ""), a tape opens even when its lines exceed treescope's height budget
    return _build(ts, tape, fields, path, subtree_renderer, expanded=path == "" and len(tape) > 0)


def render_session(s: Session, path: str | None, subtree_renderer: SubtreeRenderer) -> Rendering:
    """Picture of a session: owner, generation, node count, RNG state, device and its tape.

    Parameter storages used more than once in the current recording are listed
    with their leaf ids (the leaves whose cotangents are summed).

    >>> import jax.numpy as jnp, tapeflow as tfl, treescope
    >>> s = tfl.Session(seed=3)
    >>> s.reset()
    >>> print(treescope.render_to_text(s))  # doctest: +ELLIPSIS
    Session(
      owner=...,
      generation=1,
      nodes=0,
      rng_counter=0,
      seed=3,
      device=...,
      grad_enabled=True,
      tape=Tape(len=0, device=...),
    )
    """
    ts = _treescope()
    if ts is None:
        return NotImplemented
    fields: list[tuple[str, object]] = [
        ("owner", s.owner),
        ("generation", s.generation),
        ("nodes", _Note(str(len(s.tape)))),
        ("rng_counter", s.rng_counter),
        ("seed", s.seed),
        ("device", _Note(str(s.device))),
        ("grad_enabled", s.grad_enabled),
    ]
    try:
        groups = s.parameter_groups()
        labels, storages = s.leaf_names(), s.leaf_storages()
    except TapeError:  # drawn from another thread: the parameter leaves are the owner thread's business
        groups, labels, storages = [], {}, {}
    for g in groups:
        if g.shared:
            uid = "?" if g.storage is None else g.storage.uid
            name = getattr(g.parameter, "name", None)
            leaves = ", ".join(f"#{i}" for i in g.leaves)
            fields.append(("", _Note(f"# storage #{uid} ({name}): tied leaves {leaves}, one summed gradient")))
    tape_path = None if path is None else f"{path}.tape"
    fields.append(("tape", _Drawn(render_tape(s.tape, tape_path, subtree_renderer, labels=labels, storages=storages))))
    return _build(ts, s, fields, path, subtree_renderer)


def render_tensor(h: Tensor, path: str | None, subtree_renderer: SubtreeRenderer) -> Rendering:
    """Picture of a handle: shape, dtype, node id, owner and generation; op and value while it is current.

    >>> import jax.numpy as jnp, tapeflow as tfl, treescope
    >>> s = tfl.Session()
    >>> x = s.input(jnp.ones(2))
    >>> s.reset()
    >>> "stale=True" in treescope.render_to_text(x)
    True
    """
    ts = _treescope()
    if ts is None:
        return NotImplemented
    fields: list[tuple[str, object]] = [
        ("shape", h.shape),
        ("dtype", _Note(str(h.dtype))),
        ("id", h.id),
        ("owner", h.owner),
        ("generation", h.generation),
    ]
    s = h.session
    if s is None or s.owner != h.owner:
        fields.append(("", _Note("# no session" if s is None else "# from a different session")))
    elif s.generation != h.generation:
        fields.append(("stale", _Note("True")))
        fields.append(("", _Note(f"# the session is at generation {s.generation}: reset() made this handle stale")))
    else:
        nd = s.tape[h.id]
        fields += [("op", _Note("leaf" if nd.op is None else nd.op)), ("requires_grad", nd.requires_grad)]
        try:
            s.check_thread()
            fields.append(("value", nd.value))
        except TapeError:
            pass
    return _build(ts, h, fields, path, subtree_renderer)


def render_storage(st: Storage, path: str | None, subtree_renderer: SubtreeRenderer) -> Rendering:
    """Picture of a storage: uid, shape, dtype and which cell is current, in the storage's color."""
    ts = _treescope()
    if ts is None:
        return NotImplemented
    fields = [
        ("uid", st.uid),
        ("shape", st.shape),
        ("dtype", _Note(str(st.dtype))),
        ("host_current", st.host_current),
    ]
    return _build(ts, st, fields, path, subtree_renderer, color=_storage_color(ts, st.uid))


def render_param(p: Param, path: str | None, subtree_renderer: SubtreeRenderer) -> Rendering:
    """Picture of a Param: name, shape, dtype, trainable, its storage uid and value, in the storage's color.

    Every record of one storage (``tfl.tie``) gets the same color.

    >>> import jax.numpy as jnp, tapeflow as tfl, treescope
    >>> w = tfl.Param(jnp.ones((2, 3)), name="w")
    >>> text = treescope.render_to_text(w)
    >>> f"storage=#{w.storage.uid}" in text and "shape=(2, 3)" in text
    True
    """
    ts = _treescope()
    if ts is None:
        return NotImplemented
    fields: list[tuple[str, object]] = [
        ("name", p.name),
        ("shape", p.shape),
        ("dtype", _Note(str(p.dtype))),
        ("trainable", p.trainable),
        ("storage", _Note(f"#{p.storage.uid}")),
        ("value", p.value),
    ]
    return _build(ts, p, fields, path, subtree_renderer, color=_storage_color(ts, p.storage.uid))


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _holds_parameters(v: object, depth: int = 0) -> bool:
    if hasattr(v, "parameter_records") or hasattr(v, "storage"):
        return True
    if depth < 8 and isinstance(v, dict):
        return any(_holds_parameters(x, depth + 1) for x in v.values())
    if depth < 8 and isinstance(v, (list, tuple)):
        return any(_holds_parameters(x, depth + 1) for x in v)
    return False


def render_module(m: Module, path: str | None, subtree_renderer: SubtreeRenderer) -> Rendering:
    """Picture of a module: its attributes (Params, sub-modules, settings), then its parameter count and ties.

    >>> import jax, jax.numpy as jnp, tapeflow as tfl, treescope
    >>> emb = tfl.nn.Embedding(10, 4, key=jax.random.key(0))
    >>> lm = tfl.nn.Sequential(emb, emb.tied_output())
    >>> "# tied: storage #" in treescope.render_to_text(lm)
    True
    """
    ts = _treescope()
    if ts is None:
        return NotImplemented
    fields: list[tuple[str, object]] = [
        (k, v) for k, v in vars(m).items() if not k.startswith("_") or _holds_parameters(v)
    ]
    params = m.parameters()
    records = m.parameter_records()
    if records:
        counts = f"{_count(len(params), 'storage')}, {_count(len(records), 'registration')}"
        fields.append(("", _Note(f"# {_count(m.num_parameters(), 'parameter')} in {counts}")))
    for uid, paths in module_ties(m):
        fields.append(("", _Note(f"# tied: storage #{uid} <- {', '.join(paths)}")))
    return _build(ts, m, fields, path, subtree_renderer)
