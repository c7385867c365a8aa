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
session, call the function of the same name (`tfl.relu(h)`) or an operator.

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


def render() -> str:
    rows = []
    for name in tfl.ops():
        d = R.REGISTRY[name]
        lo, hi = d.arity
        arity = str(lo) if lo == hi else f"{lo}..{'n' if hi is None else hi}"
        attrs = ", ".join(f"`{k}={_fmt_default(v)}`" for k, v in d.defaults.items()) or "-"
        grad = "none" if name in BOOLEAN_OUTPUT else ("hand" if d.vjp is not None else "jax.vjp")
        nondiff = ", ".join(f"#{i}" for i in sorted(d.nondiff)) or "-"
        doc = (d.doc.splitlines()[0] if d.doc else "").replace("|", "\\|")
        rows.append(f"| `{name}` | {arity} | {attrs} | {grad} | {nondiff} | {'yes' if d.exact else '-'} | {doc} |")
    return HEADER + "\n".join(rows) + "\n"


def main() -> None:
    out = Path(__file__).resolve().parents[1] / "ops.md"
    out.write_text(render())
    print(f"wrote {out} ({len(tfl.ops())} ops)")


if __name__ == "__main__":
    main()
