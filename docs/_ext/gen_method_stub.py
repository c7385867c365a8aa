"""Write tapeflow/_shell/_surface_methods.pyi from the surface table: ``python docs/_ext/gen_method_stub.py``.

The Tensor methods and properties of the PyTorch surface are bound from the
table at import time (:func:`tapeflow._shell._surface.bind_methods`), so type
checkers and IDEs cannot see them on ``TensorOps``. The stub declares them on
``SurfaceMethods``, the base ``TensorOps`` inherits from for type checkers only,
with each entry's own signature (the tensor parameter becomes ``self``) and
summary. The test suite checks that the committed stub equals this output.
"""

from __future__ import annotations

import builtins
import inspect
import re
import sys
from pathlib import Path

from tapeflow._shell import _torch  # noqa: F401  (imports every entry module)
from tapeflow._shell._surface import SURFACE, Entry

STUB = Path(__file__).resolve().parents[2] / "tapeflow" / "_shell" / "_surface_methods.pyi"
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
WIDTH = 100
SHADOWED = {n for n, e in SURFACE.items() if e.bind & {"method", "property"} and hasattr(builtins, n)}

HEADER = '''"""The PyTorch surface's Tensor methods and properties, for type checkers (``TensorOps`` inherits them).

Generated from the surface table by ``python docs/_ext/gen_method_stub.py``; do not edit.
"""

'''


def _source(entry: Entry, text: str, imports: dict[str, set[str]]) -> str:
    """``text`` with each name it uses noted in ``imports`` under the module that binds it for ``entry.fn``."""
    g = entry.fn.__globals__
    # a builtin type that is also a method name (int, float, bool) would mean the method inside the class
    text = NAME.sub(lambda m: f"builtins.{m[0]}" if m[0] in SHADOWED else m[0], text)
    text = text.replace("builtins.builtins.", "builtins.")
    for name in NAME.findall(text):
        if name in g and not hasattr(builtins, name):
            value = g[name]
            if inspect.ismodule(value):
                imports.setdefault("", set()).add(f"import {value.__name__} as {name}")
            elif not any(name in names for names in imports.values()):
                imports.setdefault(entry.fn.__module__, set()).add(name)
    return text


def _default(v: object) -> str:
    if isinstance(v, str) and v.isprintable() and '"' not in v and "\\" not in v:
        return f'"{v}"'
    return repr(v) if v is None or type(v) in (bool, int, float, str) else "..."


def _method(entry: Entry, imports: dict[str, set[str]]) -> str:
    sig = entry.signature
    P = inspect.Parameter
    params = list(sig.parameters.values())[1:]
    parts = ["self"]
    star = False
    for p in params:
        if p.kind is P.KEYWORD_ONLY and not star:
            parts.append("*")
        star = star or p.kind in (P.KEYWORD_ONLY, P.VAR_POSITIONAL)
        text = ("*" if p.kind is P.VAR_POSITIONAL else "**" if p.kind is P.VAR_KEYWORD else "") + p.name
        if p.annotation is not P.empty:
            text += f": {_source(entry, str(p.annotation), imports)}"
        if p.default is not P.empty:
            text += f" = {_default(p.default)}"
        parts.append(text)
    ret = "" if sig.return_annotation is P.empty else f" -> {_source(entry, str(sig.return_annotation), imports)}"
    head = "    @property\n" if "property" in entry.bind else ""
    line = f"    def {entry.name}({', '.join(parts)}){ret}:"
    if len(line) > WIDTH:
        line = f"    def {entry.name}(\n" + "".join(f"        {p},\n" for p in parts) + f"    ){ret}:"
    summary = entry.summary.replace("\\", "\\\\").replace('"""', "'''")
    return f'{head}{line}\n        """{summary}"""\n        ...'


def render() -> str:
    imports: dict[str, set[str]] = {}
    # "stored" entries (shape, dtype) are attributes Tensor and Param define themselves
    body = [_method(e, imports) for e in SURFACE.values() if e.bind & {"method", "property"} and e.records != "stored"]
    plain = sorted({"import builtins", *imports.pop("", set())} - {"import builtins as builtins"})
    lines = [*plain, ""]
    for module in sorted(imports):
        rel = "." + module.rpartition(".")[2]
        lines.append(f"from {rel} import {', '.join(sorted(imports[module]))}")
    return HEADER + "\n".join(lines) + "\n\n\nclass SurfaceMethods:\n" + "\n\n".join(body) + "\n"


def main() -> None:
    """Write the stub, or with ``--check`` exit 1 when the committed one differs (run as a user imports tapeflow)."""
    text = render()
    if "--check" in sys.argv[1:]:
        if STUB.read_text() != text:
            sys.exit(f"{STUB} is out of date: run python docs/_ext/gen_method_stub.py")
        return
    STUB.write_text(text)
    print(f"wrote {STUB}")


if __name__ == "__main__":
    main()
