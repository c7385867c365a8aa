"""Write docs/ops.md from the op registry: ``python docs/_ext/gen_ops.py``.

The test suite checks that the committed page equals this output.
"""

from __future__ import annotations

from pathlib import Path

import tapeflow as tfl
from tapeflow import _registry as R

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


def _footer() -> str:
    lines = []
    for name in tfl.ops():
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


def render() -> str:
    rows = []
    for name in tfl.ops():
        d = R.REGISTRY[name]
        attrs = ", ".join(f"`{k}={_fmt_default(v)}`" for k, v in d.defaults.items()) or "-"
        grad = "none" if name in BOOLEAN_OUTPUT else ("hand" if d.vjp is not None else "jax.vjp")
        nondiff = ", ".join(f"`{d.operands[i]}`" for i in sorted(d.nondiff)) or "-"
        doc = d.doc.replace("|", "\\|")
        exact = "yes" if d.exact else "-"
        rows.append(f"| `{name}` | {_operands(d)} | {attrs} | {grad} | {nondiff} | {exact} | {doc} |")
    return HEADER + "\n".join(rows) + "\n" + _footer()


def main() -> None:
    out = Path(__file__).resolve().parents[1] / "ops.md"
    out.write_text(render())
    print(f"wrote {out} ({len(tfl.ops())} ops)")


if __name__ == "__main__":
    main()
