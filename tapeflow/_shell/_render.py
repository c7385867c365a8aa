"""The pictures of a session and what it records: leaf names, storage labels, DOT and treescope.

What :meth:`Session.leaf_names <tapeflow.Session.leaf_names>`,
:meth:`~tapeflow.Session.leaf_storages` and :meth:`~tapeflow.Session.to_dot`
return, and the treescope pictures (``tapeflow[viz]``) of sessions, handles,
storages, Params and modules: each class's ``__treescope_repr__`` is one line
that calls a ``render_*`` function here. They read their objects through
public members only; a module is read through :class:`ParameterHolder`, so
this layer never imports ``nn``. A tape's own picture and the parts every
picture is built from are the core's (``tapeflow/_core/_treescope.py``).

>>> import jax.numpy as jnp, tapeflow as tfl
>>> W = tfl.Param(jnp.ones((3, 2)), name="W")
>>> leaf_names({1: W, 4: tfl.tie(W, name="W_dec"), 6: object()})
{1: 'W', 4: 'W_dec', 6: 'param'}
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

import jax

from .._core._result import TapeError
from .._core._treescope import (
    Drawn,
    Note,
    Rendering,
    SubtreeRenderer,
    constructor,
    render_tape,
    treescope_module,
)
from .._core._typing import NodeId

if TYPE_CHECKING:
    from ._grads import ParameterGroup, ParameterRecord
    from ._params import Param, Storage
    from ._session import Session
    from ._tensor import Tensor

__all__ = [
    "ParameterHolder",
    "leaf_names",
    "module_ties",
    "placement_dot",
    "render_module",
    "render_param",
    "render_session",
    "render_storage",
    "render_tensor",
    "session_dot",
    "spec_text",
    "storage_color",
    "storage_labels",
]


class ParameterHolder(Protocol):
    """What a module's picture reads: ``tfl.nn.Module``'s registrations, storages and size."""

    def parameter_records(self) -> list[tuple[str, Param]]: ...

    def parameters(self) -> list[Param]: ...

    def num_parameters(self) -> int: ...


def leaf_names(params_by_leaf: Mapping[NodeId, ParameterRecord]) -> dict[NodeId, str]:
    """``leaf id -> name`` of the Param each leaf is a use of, by node id; ``param`` for a Param without a name.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> leaf_names({3: tfl.Param(jnp.ones(2)), 1: tfl.Param(jnp.ones(2), name="b")})
    {1: 'b', 3: 'param'}
    """
    return {i: str(getattr(p, "name", None) or "param") for i, p in sorted(params_by_leaf.items())}


def storage_labels(names: Mapping[NodeId, str], groups: Iterable[ParameterGroup]) -> dict[NodeId, str]:
    """``leaf id -> "<name> storage"``: every leaf of a group gets the label of its first leaf's name.

    Two storages whose first uses share a name are told apart by a number
    (``"w storage (2)"``), so a label read by two leaves marks a tied use.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> from tapeflow._shell._grads import group_parameter_leaves
    >>> w, v = tfl.Param(jnp.ones(2), name="w"), tfl.Param(jnp.ones(2), name="w")
    >>> pbl = {1: w, 2: v, 5: tfl.tie(w, name="w_out")}
    >>> groups = group_parameter_leaves(pbl, {i: p.storage for i, p in pbl.items()})
    >>> storage_labels(leaf_names(pbl), groups)
    {1: 'w storage', 2: 'w storage (2)', 5: 'w storage'}
    """
    out: dict[NodeId, str] = {}
    taken: set[str] = set()
    for g in groups:
        base = f"{names[g.id]} storage"
        label, k = base, 1
        while label in taken:
            k += 1
            label = f"{base} ({k})"
        taken.add(label)
        out.update((i, label) for i in g.leaves)
    return dict(sorted(out.items()))


def session_dot(s: Session) -> str:
    """Graphviz DOT text of a session's recording (uncomputed), with its leaf names and storage labels.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> s = tfl.Session()
    >>> y = s.input(jnp.ones((1, 3))) @ tfl.Param(jnp.ones((3, 2)), name="W")
    >>> 'label="W storage"' in session_dot(s)
    True
    """
    return s.recording.to_dot(labels=s.leaf_names(), storages=s.leaf_storages())


def module_ties(module: ParameterHolder) -> list[tuple[int, list[str]]]:
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


_PLACEMENT_COLORS = ("#dbe4ff", "#d3f9d8", "#fff3bf", "#ffe3e3", "#e5dbff", "#c5f6fa", "#ffe8cc", "#f3d9fa")


def _bytes_text(n: int) -> str:
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def placement_dot(records: Iterable[tuple[str, Param]]) -> str:
    """Graphviz DOT text: a table of where each storage of ``records`` lives, one column per device.

    ``records`` are ``(name, Param)`` pairs; tied names share a row (named
    ``a = b``). In a storage's row, the cell under a device is the number of
    the slice that device holds (slices numbered along the cut dimensions, in
    order); a storage kept whole spans its devices with one cell. The last
    columns are the shape of one slice and its bytes, the last row the most
    bytes one device holds against one copy of everything. Read through public
    members only (``p.storage``, ``p.sharding``).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> w = tfl.Param(jnp.ones((4, 2)), name="w")
    >>> "w = w_out" in placement_dot([("w", w), ("w_out", tfl.tie(w))])
    True
    """
    import html

    import numpy as np

    rows: dict[int, tuple[list[str], Param]] = {}
    for name, p in records:
        rows.setdefault(id(p.storage), ([], p))[0].append(name)
    devices: list[jax.Device] = []
    table = []
    for names, p in rows.values():
        sh = p.sharding
        shape = tuple(p.shape)
        cells: dict[jax.Device, tuple[tuple[int, ...], ...]] = {}
        if sh is not None:
            mesh = getattr(sh, "mesh", None)
            order = list(mesh.devices.flat) if mesh is not None else [d for d in jax.devices() if d in sh.device_set]
            devices += [d for d in order if d not in devices]
            for d, index in sh.devices_indices_map(shape).items():
                cells[d] = tuple(tuple(sl.indices(n)[:2]) for sl, n in zip(index, shape))
        spec = getattr(sh, "spec", None)
        table.append((" = ".join(names), shape, "one device" if spec is None else spec_text(spec), cells, p.dtype))
    per_device = dict.fromkeys(devices, 0)
    lines = [
        "digraph placement {",
        '  node [shape=plaintext, fontname="monospace", fontsize=14];',
        '  placement [label=<<table border="0" cellborder="1" cellspacing="0" cellpadding="3">',
    ]
    every = jax.devices()
    head = ["storage", "shape", "spec", *(str(every.index(d)) for d in devices), "slice", "bytes"]  # device ids
    lines.append("    <tr>" + "".join(f"<td><b>{html.escape(h)}</b></td>" for h in head) + "</tr>")
    total = 0
    for k, (name, shape, spec_txt, cells, dtype) in enumerate(table):
        itemsize = np.dtype(dtype).itemsize
        total += int(np.prod(shape, dtype=np.int64)) * itemsize
        slices = sorted(set(cells.values()))
        number = {sl: i for i, sl in enumerate(slices)}
        one = slices[0] if slices else tuple((0, n) for n in shape)
        piece = tuple(b - a for a, b in one)
        nbytes = int(np.prod(piece, dtype=np.int64)) * itemsize
        row = [f'<td align="left">{html.escape(t, quote=False)}</td>' for t in (name, str(shape), spec_txt)]
        if len(slices) == 1 and len(cells) == len(devices):
            row.append(f'<td bgcolor="#f1f3f5" colspan="{len(devices)}">whole on every device</td>')
        else:
            color = _PLACEMENT_COLORS[k % len(_PLACEMENT_COLORS)]
            for d in devices:
                sl = cells.get(d)
                row.append("<td></td>" if sl is None else f'<td bgcolor="{color}">{number[sl]}</td>')
        for d in cells:
            per_device[d] += nbytes
        row += [f'<td align="left">{piece}</td>', f'<td align="right">{_bytes_text(nbytes)}</td>']
        lines.append("    <tr>" + "".join(row) + "</tr>")
    most = max(per_device.values(), default=0)
    share = f" ({most / total:.3f} of it)" if total else ""
    lines.append(
        f'    <tr><td align="left" colspan="{len(head)}">most on one device: {_bytes_text(most)}; '
        f"one copy of everything: {_bytes_text(total)}{share}</td></tr>"
    )
    lines += ["  </table>>];", "}"]
    return "\n".join(lines)


def spec_text(spec: Iterable[object]) -> str:
    """A ``PartitionSpec`` without trailing Nones, as written in code: ``P('data')``, ``P(None, 'model')``, ``P()``.

    >>> from jax.sharding import PartitionSpec
    >>> spec_text(PartitionSpec("data", None)), spec_text(PartitionSpec())
    ("P('data')", 'P()')
    """
    parts = list(spec)
    while parts and parts[-1] is None:
        parts.pop()
    return f"P({', '.join(repr(p) for p in parts)})"


def storage_color(ts: ModuleType, uid: int) -> str:
    """The background color of a storage's records: one per storage uid, the same in every picture.

    >>> import treescope
    >>> storage_color(treescope, 7) == storage_color(treescope, 7) != storage_color(treescope, 8)
    True
    """
    return str(ts.formatting_util.color_from_string(f"tapeflow-storage-{uid}"))


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
    ts = treescope_module()
    if ts is None:
        return NotImplemented
    fields: list[tuple[str, object]] = [
        ("owner", s.owner),
        ("generation", s.generation),
        ("nodes", Note(str(len(s.tape)))),
        ("rng_counter", s.rng_counter),
        ("seed", s.seed),
        ("device", Note(str(s.device))),
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
            fields.append(("", Note(f"# storage #{uid} ({name}): tied leaves {leaves}, one summed gradient")))
    tape_path = None if path is None else f"{path}.tape"
    fields.append(("tape", Drawn(render_tape(s.tape, tape_path, subtree_renderer, labels=labels, storages=storages))))
    return constructor(ts, s, fields, path, subtree_renderer)


def render_tensor(h: Tensor, path: str | None, subtree_renderer: SubtreeRenderer) -> Rendering:
    """Picture of a handle: shape, dtype, node id, owner and generation; op and value while it is current.

    >>> import jax.numpy as jnp, tapeflow as tfl, treescope
    >>> s = tfl.Session()
    >>> x = s.input(jnp.ones(2))
    >>> s.reset()
    >>> "stale=True" in treescope.render_to_text(x)
    True
    """
    ts = treescope_module()
    if ts is None:
        return NotImplemented
    fields: list[tuple[str, object]] = [
        ("shape", h.shape),
        ("dtype", Note(str(h.dtype))),
        ("id", h.id),
        ("owner", h.owner),
        ("generation", h.generation),
    ]
    s = h.session
    if s is None or s.owner != h.owner:
        fields.append(("", Note("# no session" if s is None else "# from a different session")))
    elif s.generation != h.generation:
        fields.append(("stale", Note("True")))
        fields.append(("", Note(f"# the session is at generation {s.generation}: reset() made this handle stale")))
    else:
        nd = s.tape[h.id]
        fields += [("op", Note("leaf" if nd.op is None else nd.op)), ("requires_grad", nd.requires_grad)]
        try:
            s.check_thread()
            fields.append(("value", nd.value))
        except TapeError:
            pass
    return constructor(ts, h, fields, path, subtree_renderer)


def render_storage(st: Storage, path: str | None, subtree_renderer: SubtreeRenderer) -> Rendering:
    """Picture of a storage: uid, shape, dtype and which cell is current, in the storage's color."""
    ts = treescope_module()
    if ts is None:
        return NotImplemented
    fields = [
        ("uid", st.uid),
        ("shape", st.shape),
        ("dtype", Note(str(st.dtype))),
        ("host_current", st.host_current),
    ]
    return constructor(ts, st, fields, path, subtree_renderer, color=storage_color(ts, st.uid))


def render_param(p: Param, path: str | None, subtree_renderer: SubtreeRenderer) -> Rendering:
    """Picture of a Param: name, shape, dtype, trainable, its storage uid and value, in the storage's color.

    Every record of one storage (``tfl.tie``) gets the same color.

    >>> import jax.numpy as jnp, tapeflow as tfl, treescope
    >>> w = tfl.Param(jnp.ones((2, 3)), name="w")
    >>> text = treescope.render_to_text(w)
    >>> f"storage=#{w.storage.uid}" in text and "shape=(2, 3)" in text
    True
    """
    ts = treescope_module()
    if ts is None:
        return NotImplemented
    fields: list[tuple[str, object]] = [
        ("name", p.name),
        ("shape", p.shape),
        ("dtype", Note(str(p.dtype))),
        ("trainable", p.trainable),
        ("storage", Note(f"#{p.storage.uid}")),
        ("value", p.value),
    ]
    return constructor(ts, p, fields, path, subtree_renderer, color=storage_color(ts, p.storage.uid))


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


def render_module(m: ParameterHolder, path: str | None, subtree_renderer: SubtreeRenderer) -> Rendering:
    """Picture of a module: its attributes (Params, sub-modules, settings), then its parameter count and ties.

    >>> import jax, jax.numpy as jnp, tapeflow as tfl, treescope
    >>> emb = tfl.nn.Embedding(10, 4, key=jax.random.key(0))
    >>> lm = tfl.nn.Sequential(emb, emb.tied_output())
    >>> "# tied: storage #" in treescope.render_to_text(lm)
    True
    """
    ts = treescope_module()
    if ts is None:
        return NotImplemented
    fields: list[tuple[str, object]] = [
        (k, v) for k, v in vars(m).items() if not k.startswith("_") or _holds_parameters(v)
    ]
    params = m.parameters()
    records = m.parameter_records()
    if records:
        counts = f"{_count(len(params), 'storage')}, {_count(len(records), 'registration')}"
        fields.append(("", Note(f"# {_count(m.num_parameters(), 'parameter')} in {counts}")))
    for uid, paths in module_ties(m):
        fields.append(("", Note(f"# tied: storage #{uid} <- {', '.join(paths)}")))
    return constructor(ts, m, fields, path, subtree_renderer)
