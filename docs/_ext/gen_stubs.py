"""Write tapeflow/_shell/_functions.pyi from the op registry: ``python docs/_ext/gen_stubs.py``.

The op functions (``tfl.relu``, ``tfl.sum``, ...) are generated at import time,
so IDEs and type checkers cannot see them in ``_functions.py``; the stub gives
each one its typed signature and docstring. The test suite checks that the
committed stub equals this output.
"""

from __future__ import annotations

import builtins
import inspect
import re
from collections.abc import Callable
from pathlib import Path

from tapeflow._core import _registry as R
from tapeflow._shell import _functions as F
from tapeflow._shell._params import Param
from tapeflow._shell._tensor import Tensor

STUB = Path(__file__).resolve().parents[2] / "tapeflow" / "_shell" / "_functions.pyi"

# where each name an annotation may use comes from (builtins need no import)
SOURCES: dict[str, str] = {
    "Sequence": "collections.abc",
    "ArrayLike": "numpy.typing",
    "DTypeLike": "numpy.typing",
    "AttrValue": ".._core._typing",
    "Operand": "._tensor",
    "Tensor": "." + Tensor.__module__.rpartition(".")[2],
    "Param": "." + Param.__module__.rpartition(".")[2],
    **{name: ".._core._registry" for name in R.ATTR_TYPES},
}
ALWAYS = {"Operand", "Tensor"}  # every op function takes an Operand and returns a Tensor
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
WIDTH = 100

HEADER = '''"""Typed signatures of the op functions ``tfl.relu``, ``tfl.sum``, ...

Generated from the op registry by ``python docs/_ext/gen_stubs.py``; do not edit.
"""

'''


def _annotation(fn: Callable[..., object], ann: object, used: set[str]) -> str:
    text = ann if isinstance(ann, str) else inspect.formatannotation(ann)
    for name in NAME.findall(text):
        if name in SOURCES:
            used.add(name)
        elif not hasattr(builtins, name):
            raise ValueError(
                f"{fn.__name__}: annotation {text!r} uses {name!r}, which the stub cannot import; "
                f"annotate op attributes with builtins or {sorted(SOURCES)}"
            )
    return text


def _default(v: object) -> str:
    if isinstance(v, str) and v.isprintable() and '"' not in v and "\\" not in v:
        return f'"{v}"'
    return repr(v) if v is None or type(v) in (bool, int, float) else "..."


def _signature(name: str, fn: Callable[..., object], used: set[str]) -> str:
    sig = inspect.signature(fn)
    P = inspect.Parameter
    params = list(sig.parameters.values())
    parts: list[str] = []
    star = False
    for i, p in enumerate(params):
        if p.kind is P.KEYWORD_ONLY and not star:
            parts.append("*")
        star = star or p.kind in (P.KEYWORD_ONLY, P.VAR_POSITIONAL)
        text = ("*" if p.kind is P.VAR_POSITIONAL else "**" if p.kind is P.VAR_KEYWORD else "") + p.name
        if p.annotation is not P.empty:
            text += f": {_annotation(fn, p.annotation, used)}"
        if p.default is not P.empty:
            text += f" = {_default(p.default)}" if p.annotation is not P.empty else f"={_default(p.default)}"
        parts.append(text)
        if p.kind is P.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not P.POSITIONAL_ONLY):
            parts.append("/")
    ret = "" if sig.return_annotation is P.empty else f" -> {_annotation(fn, sig.return_annotation, used)}"
    line = f"def {name}({', '.join(parts)}){ret}:"
    if len(line) <= WIDTH:
        return line
    return f"def {name}(\n" + "".join(f"    {p},\n" for p in parts) + f"){ret}:"


def _docstring(doc: str) -> str:
    body = inspect.cleandoc(doc).replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    lines = body.splitlines()
    if len(lines) == 1:
        return f'    """{body}"""'
    inner = "\n".join(f"    {line}" if line else "" for line in lines)
    return f'    """{inner.lstrip()}\n    """'


def render() -> str:
    used = set(ALWAYS)
    defs = []
    for name in F.__all__:
        fn = getattr(F, name)
        if fn.__name__ != name:  # an alias: the same function under a second name
            defs.append(f"{name} = {fn.__name__}\n")
        else:
            defs.append(f"{_signature(name, fn, used)}\n{_docstring(fn.__doc__ or '')}\n")
    by_module: dict[str, list[str]] = {}
    for name in sorted(used):
        by_module.setdefault(SOURCES[name], []).append(name)
    std = [m for m in by_module if not m.startswith(".") and m.split(".")[0] in ("collections", "typing")]
    third = [m for m in by_module if not m.startswith(".") and m not in std]
    local = [m for m in by_module if m.startswith(".")]
    blocks = [
        [f"from {m} import {', '.join(by_module[m])}" for m in sorted(std)],
        [f"from {m} import {', '.join(by_module[m])}" for m in sorted(third)],
        [f"from {m} import {', '.join(by_module[m])}" for m in sorted(local)],
    ]
    imports = "\n\n".join("\n".join(sorted(b)) for b in blocks if b)
    all_ = "__all__ = [\n" + "".join(f'    "{n}",\n' for n in F.__all__) + "]\n"
    return HEADER + imports + "\n\n" + all_ + "\n\n" + "\n\n".join(defs)


def main() -> None:
    STUB.write_text(render())
    print(f"wrote {STUB} ({len(F.__all__)} functions)")


if __name__ == "__main__":
    main()
