"""Write docs/ops.md and docs/api/functions.md from the op registry: ``python docs/_ext/gen_ops.py``.

The test suite checks that the committed pages equal this output. Run in a
process that registered ops with ``tfl.lift`` / ``tfl.defop`` (import this
module and call :func:`render`), the ops page also lists those, in a section of
their own; the committed page has none (not even the lifted functions that
tapeflow's PyTorch surface registers at import: the surface table lists them).

docs/ops.md is a compact table (one row per op: its name, linking to the op's
section, and its one-line summary) followed by one section per op with the
details: the function that records it, operands, attributes with their
defaults, gradient, dtype rule and the op's notes.
"""

from __future__ import annotations

from pathlib import Path

import tapeflow as tfl
from tapeflow._core import _registry as R
from tapeflow._shell import _functions as F
from tapeflow._shell import _surface

HEADER = """# Ops

Every op of the registry, generated from its definition (`python docs/_ext/gen_ops.py`).
Record one on a tape with `tfl.record(tape, "name", inputs, **attributes)`; on a
session, call the function of the same name (`tfl.relu(h)`, `tfl.sum(h, 0)`) or
an operator, or `tfl.apply("name", *operands, **attributes)`. Where PyTorch has
the name, the function is PyTorch's (its arguments: the surface table's entry);
otherwise its parameters are the operands then the attributes.
An optional operand (`b=None`) is left out of the record when None; the
operands of a variadic op (`*xs`) are passed to its function as one sequence
(`tfl.concat([a, b], axis=1)`). Each op's section below lists its operands,
attributes, gradient and dtype rule.

| op | summary |
| --- | --- |
"""

DETAILS_HEADER = """
## Op details

*Gradient*: a hand-written VJP, or `jax.vjp` of the forward; the comparisons
have none (their output never carries a gradient). Operands listed under *no
gradient* (labels, indices, conditions, masks) never receive one. *Dtype*: under
a mixed-precision policy an op computes in the policy's compute dtype, in
float32 (losses, reductions, normalizations) or in its operands' own dtype (ops
that move or select elements, or cast on purpose). *Exact* ops also run on exact
rationals (NumPy object arrays of `fractions.Fraction`) on the CPU.
"""

BOOLEAN_OUTPUT = {"lt", "le", "gt", "ge", "eq", "ne"}

PRECISION = {
    "compute": "the policy's compute dtype",
    "float32": "float32",
    "layout": "its operands' own dtype",
}


def _fmt_default(v: object) -> str:
    return "required" if v is R.REQUIRED else repr(v)


def _operands(d: R.OpDef) -> str:
    if d.variadic:
        *required, seq = d.operands
        return ", ".join(f"`{n}`" for n in required + [f"*{seq}"])
    optional = d.optional_operands
    return ", ".join(f"`{n}=None`" if n in optional else f"`{n}`" for n in d.operands)


def _attributes(d: R.OpDef) -> str:
    return ", ".join(f"`{k}={_fmt_default(v)}`" for k, v in d.defaults.items())


def _gradient(name: str, d: R.OpDef) -> str:
    return "none" if name in BOOLEAN_OUTPUT else ("hand" if d.vjp is not None else "jax.vjp")


def _nondiff(d: R.OpDef) -> str:
    return ", ".join(f"`{d.operands[i]}`" for i in sorted(d.nondiff) if i < len(d.operands))


def _builtin() -> list[str]:
    return [name for name in tfl.ops() if not R.REGISTRY[name].user]


def _user() -> list[str]:
    return [name for name in tfl.ops() if R.REGISTRY[name].user]


def _anchor(name: str) -> str:
    return f"op-{name.replace('_', '-')}"


def _summary_row(name: str) -> str:
    doc = R.REGISTRY[name].doc.replace("|", "\\|")
    return f"| [`{name}`](#{_anchor(name)}) | {doc} |"


def _torch_entry(name: str) -> _surface.Entry | None:
    """The surface table's ``tfl.<name>`` (PyTorch's function of that name, which replaces the op's), if any."""
    e = _surface.SURFACE.get(name)
    return e if e is not None and "tfl" in e.bind else None


def _records_op(e: _surface.Entry, op: str) -> bool:
    kind, _, ops = e.records.partition(":")
    return kind in ("op", "ops") and op in ops.split(",")


def _plain_aliases(d: R.OpDef) -> list[str]:
    """The op's other function names that still name its function (not replaced by PyTorch's function)."""
    return [a for a in d.aliases if _torch_entry(a) is None]


def _section(name: str) -> str:
    d = R.REGISTRY[name]
    e = _torch_entry(name) if d.public else None
    if e is not None and not _records_op(e, name):
        function = (
            f'`tfl.apply("{name}", ...)`: [`tfl.{name}`][tapeflow.{name}] is PyTorch\'s `torch.{name}` and records '
            f"`{e.records}`"
        )
    elif d.public:
        function = f"[`tfl.{name}`][tapeflow.{name}]"
        if e is not None:
            function += " (PyTorch's signature: the surface table's entry)"
        function += "".join(f", also `tfl.{alias}`" for alias in _plain_aliases(d))
    else:
        function = f'none: a Tensor operator records it, or `tfl.apply("{name}", ...)`'
    grad = {
        "hand": "hand-written VJP",
        "jax.vjp": "`jax.vjp` of the forward",
        "none": "none (boolean output)",
    }[_gradient(name, d)]
    items = [
        f"* Function: {function}",
        f"* Operands: {_operands(d)}",
        f"* Attributes: {_attributes(d) or 'none'}",
        f"* Gradient: {grad}",
    ]
    if _nondiff(d):
        items.append(f"* No gradient: {_nondiff(d)}")
    items.append(f"* Dtype: computes in {PRECISION[d.precision]}")
    if d.exact:
        items.append("* Exact: also runs on exact rationals")
    notes = f"\n\n{d.notes.strip()}" if d.notes.strip() else ""
    return f"\n### `{name}` {{ #{_anchor(name)} }}\n\n{d.doc}\n\n" + "\n".join(items) + notes + "\n"


def _footer() -> str:
    lines = []
    for name in _builtin():
        d = R.REGISTRY[name]
        if not d.public:
            lines.append(
                f"* `{name}` has no `tfl.{name}` function: a Tensor operator records it, "
                f'or call `tfl.apply("{name}", ...)` or `tfl.record`.'
            )
        for alias in _plain_aliases(d):
            lines.append(f"* `tfl.{alias}` is another name for `tfl.{name}`.")
    torch_only = [n for n in _surface.entries("tfl") if n not in R.REGISTRY]
    lines.append(
        f"* {len(torch_only)} more `tfl.*` functions have PyTorch's names and record built-in ops or lifted JAX "
        "functions without an op of their own: see [Coming from PyTorch](from-pytorch.md#pytorch-names)."
    )
    return "\n## Functions\n\n" + "\n".join(lines) + "\n"


USER_HEADER = """
## User-registered ops

Registered in this process with `tfl.lift` (gradient `jax.vjp` of the function) or
`tfl.defop` (gradient `hand` when given a VJP). They have no `tfl.<name>` function:
call the lifted function, `tfl.apply("name", ...)` or `tfl.record`.

| op | operands | attributes | gradient | no grad | function | description |
| --- | --- | --- | --- | --- | --- | --- |
"""


def _row(name: str, last: str) -> str:
    d = R.REGISTRY[name]
    attrs = _attributes(d) or "-"
    nondiff = _nondiff(d) or "-"
    doc = d.doc.replace("|", "\\|")
    return f"| `{name}` | {_operands(d)} | {attrs} | {_gradient(name, d)} | {nondiff} | {last} | {doc} |"


def _function_name(d: R.OpDef) -> str:
    f = d.source
    qual = getattr(f, "__qualname__", None) or getattr(f, "__name__", None) or type(f).__name__
    module = getattr(f, "__module__", None)
    return f"`{module}.{qual}`".replace("|", "\\|") if isinstance(module, str) else f"`{qual}`"


def render(include_user: bool = True) -> str:
    """The ops page; ``include_user=False`` leaves out ops registered at run time (the committed page has none)."""
    rows = [_summary_row(name) for name in _builtin()]
    sections = [_section(name) for name in _builtin()]
    user = [_row(name, _function_name(R.REGISTRY[name])) for name in _user()] if include_user else []
    user_section = USER_HEADER + "\n".join(user) + "\n" if user else ""
    return HEADER + "\n".join(rows) + "\n" + DETAILS_HEADER + "".join(sections) + user_section + _footer()


FUNCTIONS_HEADER = """# Op functions

Every public op of the registry is a function of the same name: `tfl.relu(h)`,
`tfl.matmul(a, b)`, `tfl.where(c, a, b)`. Where PyTorch has the name, the
function is PyTorch's (`tfl.sum(h, 0)`, `tfl.transpose(h, 0, 1)`: its arguments,
defaults and results; the surface table declares it). Otherwise its parameters
are the op's operands, then its attributes in declaration order with their
defaults (a required attribute has none). A trailing optional
operand defaults to None and is left out of the record when None; a variadic op,
such as `concat`, takes one sequence. Operands may be
[`Tensor`][tapeflow.Tensor] handles, [`Param`][tapeflow.Param]s, numbers or
arrays; the function records the op on the operands' session.

[`tfl.attention`][tapeflow.attention] draws the dropout mask of the `attention`
op from the session's RNG. The operands, attributes, gradient
and dtype rule of each op are listed in [Ops](../ops.md).
{aliases}"""


TORCH_FUNCTIONS_HEADER = """
## PyTorch's functions

These `tfl.*` functions have PyTorch's names and meanings (`torch.<name>`) and
no op of their own in the registry: each records built-in ops or a lifted JAX
function (the surface table, `tapeflow/_shell/_surface.py`, says which; see
[Coming from PyTorch](../from-pytorch.md#pytorch-names)). The op functions above
with a PyTorch name (`tfl.sum`, `tfl.transpose`, ...) take PyTorch's arguments too.
"""


def render_functions() -> str:
    """docs/api/functions.md: one reference entry per op function, under its public name ``tapeflow.NAME``."""
    aliases = {alias: name for name in _builtin() for alias in _plain_aliases(R.REGISTRY[name])}
    said = "".join(f"\n`tfl.{a}` is another name for [`tfl.{n}`][tapeflow.{n}].\n" for a, n in aliases.items())
    entries = [f"::: tapeflow.{name}\n" for name in F.__all__ if name not in aliases]
    torch_only = [n for n in _surface.entries("tfl") if n not in F.__all__ and n not in aliases]
    more = [f"::: tapeflow.{name}\n" for name in torch_only]
    return (
        FUNCTIONS_HEADER.replace("{aliases}", said)
        + "\n"
        + "\n".join(entries)
        + (TORCH_FUNCTIONS_HEADER + "\n" + "\n".join(more) if more else "")
    )


def main() -> None:
    docs = Path(__file__).resolve().parents[1]
    # the page lists the built-in ops: tapeflow's own lifted functions (the PyTorch surface's) are user-registered
    (docs / "ops.md").write_text(render(include_user=False))
    (docs / "api" / "functions.md").write_text(render_functions())
    print(f"wrote {docs / 'ops.md'} ({len(_builtin())} ops, {len(_user())} user-registered)")
    print(f"wrote {docs / 'api' / 'functions.md'}")


if __name__ == "__main__":
    main()
