"""``tfl.nn.summary``: a model's modules, output shapes and parameter counts as one table.

:func:`summary` runs the model once on example inputs in a fresh inference
session of its own and returns a :class:`Summary`: one :class:`SummaryRow` per
module (its path, type, the output shape of each of its calls, the size of
its own direct Params, whether they are trainable, and what they are tied to)
and the totals. Storage identity decides ties, as everywhere in tapeflow: a
storage (a parameter or a buffer) is counted once, at its first path in :meth:`Module.param_dict
<tapeflow.nn.Module.param_dict>`, so the Params column sums to the total.
``print(summary(model, x))`` shows the text table, a notebook shows the HTML one.
"""

from __future__ import annotations

import contextvars
import html
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import jax

from .._core._typing import PyTree
from .._shell._commit import commit
from .._shell._params import Param, Storage
from .._shell._session import Session
from .._shell._tensor import Tensor
from ._module import Module, observe_calls

__all__ = ["Summary", "SummaryRow", "summary"]

Trainable = Literal["all", "none", "partial", "-"]
HEADER = ("Module", "Type", "Output shape", "Params", "Bytes", "Trainable", "Tied")
NUMERIC = (3, 4)  # right-aligned columns


@dataclass(frozen=True)
class SummaryRow:
    """One module of a :class:`Summary` (a module reached again at a later path: one row tied to its first)."""

    path: str  # "" for the root (shown as <root>), else its path in named_modules()
    type: str
    output_shapes: tuple[str, ...]  # one per call, in call order; () when never called
    params: int  # scalars of its own direct Params whose storage is first counted here
    bytes: int
    trainable: Trainable  # of its own direct Params ("-": it has none)
    tied_to: tuple[str, ...]  # the first paths of its Params counted elsewhere (or of the module itself)

    @property
    def output(self) -> str:
        """The table's cell: ``"-"`` when never called, ``"(2, 8) x3"`` for equal calls, else each call's."""
        shapes = self.output_shapes
        if not shapes:
            return "-"
        if len(set(shapes)) == 1:
            return shapes[0] if len(shapes) == 1 else f"{shapes[0]} x{len(shapes)}"
        return "; ".join(shapes)

    def cells(self) -> tuple[str, ...]:
        """The row's text cells, in :data:`HEADER` order."""
        tied = f"tied to {', '.join(self.tied_to)}" if self.tied_to else ""
        return (
            self.path or "<root>",
            self.type,
            self.output,
            f"{self.params:,}",
            f"{self.bytes:,}",
            self.trainable,
            tied,
        )


@dataclass(frozen=True, repr=False)
class Summary:
    """What :func:`summary` returns: the rows and the totals; ``str`` / ``repr`` is the text table."""

    rows: tuple[SummaryRow, ...]
    total_params: int  # scalars over the distinct storages
    trainable_params: int  # of the storages an Optimizer gives a slot (first record trainable)
    non_trainable_params: int  # frozen Params and state cells (BatchNorm's running statistics)
    total_bytes: int
    tied: int  # registrations of a storage after its first (tied Params, a shared module's second path)

    def totals(self) -> list[str]:
        """The lines under the table."""
        return [
            f"Total params: {self.total_params:,}",
            f"Trainable params: {self.trainable_params:,}",
            f"Non-trainable params: {self.non_trainable_params:,}",
            f"Total bytes: {self.total_bytes:,} ({_human(self.total_bytes)})",
            f"Tied registrations: {self.tied:,}",
        ]

    def __str__(self) -> str:
        table = [HEADER, *(r.cells() for r in self.rows)]
        widths = [max(len(row[c]) for row in table) for c in range(len(HEADER))]

        def line(row: tuple[str, ...]) -> str:
            cols = (v.rjust(w) if c in NUMERIC else v.ljust(w) for c, (v, w) in enumerate(zip(row, widths)))
            return "  ".join(cols).rstrip()

        rule = "-" * (sum(widths) + 2 * (len(widths) - 1))
        return "\n".join([line(HEADER), rule, *map(line, table[1:]), rule, *self.totals()])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        def tr(cells: tuple[str, ...], tag: str) -> str:
            right = ' style="text-align:right"'
            tds = (f"<{tag}{right if c in NUMERIC else ''}>{html.escape(v)}</{tag}>" for c, v in enumerate(cells))
            return f"<tr>{''.join(tds)}</tr>"

        foot = "".join(f'<tr><td colspan="{len(HEADER)}">{html.escape(t)}</td></tr>' for t in self.totals())
        body = "".join(tr(r.cells(), "td") for r in self.rows)
        return f"<table><thead>{tr(HEADER, 'th')}</thead><tbody>{body}</tbody><tfoot>{foot}</tfoot></table>"


def summary(model: Module, *example_inputs: PyTree, **example_kwargs: PyTree) -> Summary:
    """Run ``model(*example_inputs, **example_kwargs)`` once and tabulate its modules and parameters.

    The call runs in a fresh inference session of summary's own
    (``Session(grad_enabled=False, lazy=True)``: nothing requires grad, and
    nothing is computed unless the model reads a value), inside a copy of the
    caller's context, and the session is dropped afterwards: a session the
    caller holds (current, or the one that recorded last) records nothing and
    keeps its state. Tensors among the example inputs are entered again as
    inputs of that session (their values are read); everything else is passed
    as given. Each module keeps its train/eval mode; a state cell of the
    model written anyway (``bn(x, training=True)``) gets its old value back.

    Rows: the root (``<root>``), then each sub-module once, at its first path
    in :meth:`Module.named_modules <tapeflow.nn.Module.named_modules>`; a module
    reached again at a later path gets one more row there, tied to its first
    path, with nothing counted. ``Output shape`` shows each call's output (a
    Tensor's shape; a tuple, list or dict of them as ``[...]`` / ``{...}``),
    one value with ``xN`` when N calls gave the same, ``-`` when the module was
    not called. ``Params`` / ``Bytes`` count the module's own direct Params
    whose storage is first met there (the column sums to the total); a Param
    whose storage has an earlier path counts 0 and is shown ``tied to <first
    path>``. ``Trainable`` reads the direct Params' own flags. The trainable
    total counts what an :class:`~tapeflow.Optimizer` would update (a storage
    whose first record is trainable); frozen Params and state cells are
    non-trainable.

    Raises ``TypeError`` when ``model`` is not a Module. An error the model
    raises on the example inputs propagates unchanged, with a note that it was
    raised inside ``summary``.

    >>> import jax, jax.numpy as jnp, tapeflow as tfl
    >>> emb = tfl.nn.Embedding(16, 8, key=jax.random.key(0))
    >>> lm = tfl.nn.Sequential(emb, tfl.nn.LayerNorm(8), emb.tied_output())
    >>> print(tfl.nn.summary(lm, jnp.array([[1, 2, 3]])))
    Module  Type        Output shape  Params  Bytes  Trainable  Tied
    ----------------------------------------------------------------------------
    <root>  Sequential  (1, 3, 16)         0      0  -
    0       Embedding   (1, 3, 8)        128    512  all
    1       LayerNorm   (1, 3, 8)         16     64  all
    2       TiedLinear  (1, 3, 16)         0      0  all        tied to 0.weight
    ----------------------------------------------------------------------------
    Total params: 144
    Trainable params: 144
    Non-trainable params: 0
    Total bytes: 576 (576 B)
    Tied registrations: 1
    """
    if not isinstance(model, Module):
        raise TypeError(f"summary expects a tfl.nn.Module, got {type(model).__name__}")
    calls = contextvars.copy_context().run(_run, model, example_inputs, example_kwargs)
    outputs: dict[int, list[str]] = {}
    for m, out in calls:
        outputs.setdefault(id(m), []).append(_shape_text(out))

    named = list(model.param_dict().items())  # parameters and buffers, each storage once at its first path
    first = {id(p.storage): path for path, p in named}
    rows = [_row(path, m, outputs, first, again) for path, m, again in _walk(model)]
    sizes = [(_size(p.storage), p) for _, p in named]
    return Summary(
        rows=tuple(rows),
        total_params=sum(n for (n, _), _ in sizes),
        trainable_params=sum(n for (n, _), p in sizes if p.trainable),
        non_trainable_params=sum(n for (n, _), p in sizes if not p.trainable),
        total_bytes=sum(b for (_, b), _ in sizes),
        tied=len(model.parameter_records()) - len(named),
    )


def _run(model: Module, args: tuple[PyTree, ...], kwargs: dict[str, PyTree]) -> list[tuple[Module, PyTree]]:
    """The model's calls on summary's own session (run in a copy of the caller's context)."""
    cells = {id(p.storage): p.storage for _, p in model.parameter_records() if not p.trainable}
    before = {k: st.read_current() for k, st in cells.items()}
    s = Session(grad_enabled=False, lazy=True)

    def enter(x: object) -> object:
        return s.input(x.value) if isinstance(x, Tensor) else x

    is_leaf = lambda x: isinstance(x, (Tensor, Param))  # noqa: E731  (a Param stays itself, not its value)
    try:
        args, kwargs = jax.tree_util.tree_map(enter, (args, kwargs), is_leaf=is_leaf)
        with observe_calls() as calls, s.as_current():
            model(*args, **kwargs)
    except Exception as e:
        e.add_note(f"(raised while tfl.nn.summary ran {type(model).__name__} on the example inputs)")
        raise
    finally:
        undo = [(st, before[id(st)]) for st in s.state_writes if id(st) in before]
        if undo:
            commit(undo, where="summary")
    return calls


def _walk(model: Module) -> Iterator[tuple[str, Module, str | None]]:
    """``(path, module, first path or None)``: named_modules' order, plus each later path of a shared module."""
    seen: dict[int, str] = {}

    def visit(m: Module, path: str) -> Iterator[tuple[str, Module, str | None]]:
        if id(m) in seen:
            yield path, m, seen[id(m)] or "<root>"
            return
        seen[id(m)] = path
        yield path, m, None
        for name, obj in m.named_members():
            if isinstance(obj, Module):
                yield from visit(obj, f"{path}.{name}" if path else name)

    return visit(model, "")


def _row(path: str, m: Module, outputs: dict[int, list[str]], first: dict[int, str], again: str | None) -> SummaryRow:
    kind = type(m).__name__
    if again is not None:
        return SummaryRow(path, kind, (), 0, 0, "-", (again,))
    params = nbytes = 0
    tied: list[str] = []
    flags: set[bool] = set()
    for name, p in m.named_members():
        if not isinstance(p, Param):
            continue
        flags.add(p.trainable)
        here = f"{path}.{name}" if path else name
        if first.get(id(p.storage), here) != here:
            tied.append(first[id(p.storage)])
            continue
        n, b = _size(p.storage)
        params, nbytes = params + n, nbytes + b
    trainable: Trainable = "-" if not flags else "partial" if len(flags) == 2 else "all" if True in flags else "none"
    return SummaryRow(path, kind, tuple(outputs.get(id(m), ())), params, nbytes, trainable, tuple(tied))


def _size(st: Storage) -> tuple[int, int]:
    n = math.prod(st.shape)
    return n, n * st.dtype.itemsize


def _shape_text(out: object) -> str:
    """A call's output as shapes: ``(2, 8)``, ``[(2, 8), (2,)]``, ``{'h': (2, 8)}``; anything else by type."""
    if isinstance(out, (tuple, list)):
        return "[" + ", ".join(map(_shape_text, out)) + "]"
    if isinstance(out, Mapping):
        return "{" + ", ".join(f"{k!r}: {_shape_text(v)}" for k, v in out.items()) + "}"
    if out is None:
        return "None"
    shape = getattr(out, "shape", None)
    return str(tuple(shape)) if shape is not None else type(out).__name__


def _human(n: int) -> str:
    size, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
