"""Write docs/ops.md from the op registry: ``python docs/_ext/gen_ops.py``.

The test suite checks that the committed page equals this output. Run in a
process that registered ops with ``tfl.lift`` / ``tfl.defop`` (import this
module and call :func:`render`), the page also lists those, in a section of
their own; the committed page, generated in a fresh process, has none.
"""

from __future__ import annotations

from pathlib import Path

import tapeflow as tfl
from tapeflow._core import _registry as R

HEADER = """# Ops

Every op of the registry, generated from its definition (`python docs/_ext/gen_ops.py`).
Record one on a tape with `tfl.record(tape, "name", inputs, **attributes)`; on a
session, call the function of the same name, whose parameters are the operands
then the attributes (`tfl.relu(h)`, `tfl.sum(h, axis=0)`), or an operator.
An optional operand (`b=None`) is left out of the record when None; the
operands of a variadic op (`*xs`) are passed to its function as one sequence
(`tfl.concat([a, b], axis=1)`).

*Gradient*: `hand` means a hand-written VJP, `jax.vjp` that the VJP is
`jax.vjp` of the forward, `none` that the output never carries a gradient
(comparisons). Inputs listed under *no grad* (labels, indices, conditions,
masks) never receive one. *Exact* ops also run on exact rationals (NumPy object
arrays of `fractions.Fraction`) on the CPU.

| op | operands | attributes | gradient | no grad | exact | description |
| --- | --- | --- | --- | --- | --- | --- |
"""

BOOLEAN_OUTPUT = {"lt", "le", "gt", "ge", "eq", "ne"}


def _fmt_default(v: object) -> str:
    return "required" if v is R.REQUIRED else repr(v)


def _operands(d: R.OpDef) -> str:
    if d.variadic:
        *required, seq = d.operands
        return ", ".join(f"`{n}`" for n in required + [f"*{seq}"])
    optional = d.optional_operands
    return ", ".join(f"`{n}=None`" if n in optional else f"`{n}`" for n in d.operands)


def _builtin() -> list[str]:
    return [name for name in tfl.ops() if not R.REGISTRY[name].user]


def _user() -> list[str]:
    return [name for name in tfl.ops() if R.REGISTRY[name].user]


def _footer() -> str:
    lines = []
    for name in _builtin():
        d = R.REGISTRY[name]
        if not d.public:
            lines.append(
                f"* `{name}` has no `tfl.{name}` function: a Tensor operator records it, "
                f'or call `tfl.apply("{name}", ...)` or `tfl.record`.'
            )
        for alias in d.aliases:
            lines.append(f"* `tfl.{alias}` is another name for `tfl.{name}`.")
    lines.append("* `tfl.dropout(x, rate, training=None)` is a composite of `where` and `mul`, not a registry op.")
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
    attrs = ", ".join(f"`{k}={_fmt_default(v)}`" for k, v in d.defaults.items()) or "-"
    grad = "none" if name in BOOLEAN_OUTPUT else ("hand" if d.vjp is not None else "jax.vjp")
    nondiff = ", ".join(f"`{d.operands[i]}`" for i in sorted(d.nondiff) if i < len(d.operands)) or "-"
    doc = d.doc.replace("|", "\\|")
    return f"| `{name}` | {_operands(d)} | {attrs} | {grad} | {nondiff} | {last} | {doc} |"


def _function_name(d: R.OpDef) -> str:
    f = d.source
    qual = getattr(f, "__qualname__", None) or getattr(f, "__name__", None) or type(f).__name__
    module = getattr(f, "__module__", None)
    return f"`{module}.{qual}`".replace("|", "\\|") if isinstance(module, str) else f"`{qual}`"


def render(include_user: bool = True) -> str:
    """The ops page; ``include_user=False`` leaves out ops registered at run time (the committed page has none)."""
    rows = [_row(name, "yes" if R.REGISTRY[name].exact else "-") for name in _builtin()]
    user = [_row(name, _function_name(R.REGISTRY[name])) for name in _user()] if include_user else []
    section = USER_HEADER + "\n".join(user) + "\n" if user else ""
    return HEADER + "\n".join(rows) + "\n" + section + _footer()


def main() -> None:
    out = Path(__file__).resolve().parents[1] / "ops.md"
    out.write_text(render())
    print(f"wrote {out} ({len(_builtin())} ops, {len(_user())} user-registered)")


if __name__ == "__main__":
    main()
