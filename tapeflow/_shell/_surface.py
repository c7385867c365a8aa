"""The PyTorch surface: one table of every name tapeflow shares with PyTorch, and how each records.

Each entry is declared once, by decorating its implementation with
:func:`torch_entry`. The implementation's Python signature **is** the PyTorch
signature (positional dims, ``dim=``, ``keepdim=``, PyTorch's defaults), and the
entry says where the name is bound and how a call records:

* ``bind``: ``"method"`` (a :class:`~tapeflow.Tensor` / :class:`~tapeflow.Param`
  method, the same function object, so a method costs what the function costs),
  ``"property"`` (a Tensor property), ``"tfl"`` (``tfl.<name>``, ``torch.<name>``'s
  meaning) and ``"F"`` (``tfl.nn.functional.<name>``, ``torch.nn.functional``'s);
* ``records``: ``"op:<name>"`` for one built-in registry op, ``"ops:<a>,<b>"`` for
  a composition of built-in ops, ``"lifted"`` for a JAX function made an op with
  :func:`~tapeflow.lift`, ``"host"`` for a read of the value (``item``,
  ``tolist``), ``"constant"`` for a new leaf (``zeros``, ``arange``), ``"stored"`` for
  a property each kind of tensor keeps itself (``shape``, ``dtype``: declared here, never bound);
* ``opinfo``: the names of the entry's rows in PyTorch's OpInfo database
  (``torch.testing._internal.common_methods_invocations.op_db``; a
  ``"name.variant"`` picks a variant), which the conformance tests run through
  tapeflow; empty when PyTorch has no row, and the entry has hand-written cases;
* ``gaps``: the samples of those rows tapeflow refuses on purpose, each with the
  reason (``{"what": "why"}``): the one place a difference from PyTorch is listed.
  A key matches every sample whose description contains it; a sample is described
  as its row, then the call with each tensor as its dtype and shape:
  ``var(float32[5, 5], dim=1, unbiased=True)``, ``max.binary(int64[5], int64[5])``.
  So ``"rounding_mode="`` lists every sample passing that keyword, ``"int64["`` the
  integer samples, ``"float32[])"`` a 0-d input, ``"max.binary("`` a whole row.
  Only refusals are excused (an error naming the entry, of type ``TapeError``,
  ``TypeError``, ``ValueError``, ``IndexError`` or ``NotImplementedError``), never a
  different result; a key that matches no refused sample fails the tests (stale).

Nothing else declares the surface: :func:`bind_methods` sets the Tensor methods,
``tapeflow/__init__.py`` and ``tapeflow/nn/functional.py`` import the
functions, the docs' "PyTorch habits" table is :func:`markdown_table`, and the
conformance tests iterate :data:`SURFACE` (a test checks that every ``"tfl"`` and
``"F"`` entry is exported).

>>> from tapeflow._shell._surface import SURFACE
>>> e = SURFACE["transpose"]
>>> sorted(e.bind), e.records, e.torch
(['method', 'tfl'], 'op:permute', 'torch.transpose')
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, ParamSpec, TypeVar

__all__ = ["SURFACE", "Binding", "Entry", "bind_methods", "entries", "markdown_table", "torch_entry"]

Binding = Literal["method", "property", "tfl", "F", "nn"]
"""Where an entry's name is bound: a Tensor method or property, ``tfl.<name>``, ``tfl.nn.functional.<name>``, or
``tfl.nn.<name>`` (a module class, declared by decorating the class: ``records="module"``)."""

_BINDINGS: frozenset[str] = frozenset(("method", "property", "tfl", "F", "nn"))

_P = ParamSpec("_P")
_R = TypeVar("_R")


@dataclass(frozen=True)
class Entry:
    """One PyTorch name: its implementation (whose signature is PyTorch's), bindings, recording and oracle rows.

    ``gaps`` keys match the refused samples whose description contains them (the module
    docstring shows the description); ``tests/_torch_oracle.py`` writes it.
    """

    name: str
    fn: Callable[..., object]
    bind: frozenset[str]
    records: str
    opinfo: tuple[str, ...] = ()
    gaps: Mapping[str, str] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()
    note: str = ""

    @property
    def torch(self) -> str:
        """The PyTorch name this entry means: ``torch.<name>``, ``torch.Tensor.<name>`` or ``torch.nn.functional.<name>``."""
        if "nn" in self.bind:
            return f"torch.nn.{self.name}"
        if "tfl" in self.bind:
            return f"torch.{self.name}"
        if "F" in self.bind:
            return f"torch.nn.functional.{self.name}"
        return f"torch.Tensor.{self.name}"

    @property
    def signature(self) -> inspect.Signature:
        return inspect.signature(self.fn)

    @property
    def summary(self) -> str:
        """The first line of the implementation's docstring."""
        return (inspect.getdoc(self.fn) or "").split("\n", 1)[0]


SURFACE: dict[str, Entry] = {}
"""Every PyTorch-named entry by name, in declaration order (several entries may share a function)."""


def torch_entry(
    name: str | None = None,
    *,
    bind: Iterable[Binding] = ("method", "tfl"),
    records: str,
    opinfo: Iterable[str] | None = None,
    gaps: Mapping[str, str] | None = None,
    aliases: Iterable[str] = (),
    note: str = "",
) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Declare the decorated function as PyTorch's ``name`` (default: its own name), bound where ``bind`` says.

    ``opinfo`` defaults to ``(name,)``: the OpInfo row of the same name; pass
    ``()`` for a name PyTorch's database has no row for. ``aliases`` are further
    names bound the same way (``clip`` for ``clamp``), each an entry of its own.

    >>> @torch_entry("doc_twice", bind=("tfl",), records="ops:mul", opinfo=())
    ... def twice(input):
    ...     '''Twice the input.'''
    ...     return input * 2
    >>> SURFACE["doc_twice"].summary, SURFACE.pop("doc_twice").records
    ('Twice the input.', 'ops:mul')
    """
    where = frozenset(bind)
    if not where or not where <= _BINDINGS:
        raise ValueError(f"torch_entry: bind={sorted(where)} must be a non-empty subset of {sorted(_BINDINGS)}")
    kind = records.split(":", 1)[0]
    if kind not in ("op", "ops", "lifted", "host", "constant", "module", "stored"):
        raise ValueError(
            f"torch_entry: records={records!r} must start with op:, ops:, lifted, host, constant or stored"
        )

    def deco(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        main = name or fn.__name__
        rows = (main,) if opinfo is None else tuple(opinfo)
        for n in (main, *aliases):
            if n in SURFACE:
                raise ValueError(f"torch_entry: {n!r} is declared twice (first by {SURFACE[n].fn.__qualname__})")
            SURFACE[n] = Entry(n, fn, where, records, rows if n == main else (), dict(gaps or {}), (), note)
        return fn

    return deco


def entries(binding: Binding) -> dict[str, Entry]:
    """The entries bound as ``binding``, by name."""
    return {n: e for n, e in SURFACE.items() if binding in e.bind}


def bind_methods(cls: type) -> None:
    """Set every ``"method"`` entry as a method of ``cls`` and every ``"property"`` entry as a property.

    The method is the implementation itself (its first parameter is the tensor),
    so ``x.sum(1)`` and ``tfl.sum(x, 1)`` run the same code.
    """
    for n, e in SURFACE.items():
        if "method" in e.bind:
            setattr(cls, n, e.fn)
        elif "property" in e.bind and e.records != "stored":
            setattr(cls, n, property(e.fn, doc=inspect.getdoc(e.fn)))


def markdown_table(binding: Binding) -> str:
    """The docs' table of the entries bound as ``binding``: name, PyTorch signature, how it records, notes."""
    prefix = {"method": "x.", "property": "x.", "tfl": "tfl.", "F": "F.", "nn": "nn."}[binding]
    rows = ["| name | signature | records | notes |", "|---|---|---|---|"]
    for n, e in entries(binding).items():
        params = list(e.signature.parameters.values())[1 if binding in ("method", "property") else 0 :]
        # the call as PyTorch's docs write it: names and defaults, no annotations
        plain = [p.replace(annotation=inspect.Parameter.empty) for p in params]
        text = str(inspect.Signature(plain)).replace("|", "\\|")
        notes = (e.note or e.summary).replace("|", "\\|")
        rows.append(f"| `{prefix}{n}` | `{text}` | {e.records} | {notes} |")
    return "\n".join(rows)
