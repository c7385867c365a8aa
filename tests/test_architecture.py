"""The shape of the codebase: each layer is a subpackage, imports point one way, modules meet at public seams.

``docs/architecture.md`` describes the layers checked here; a change that
needs an import against the arrow belongs in a lower layer.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "tapeflow"

# The layers, lowest first: a module imports (at run time) only from its own layer and the ones before it.
LAYERS: list[str] = ["_core", "_ops", "_shell", "_train", "_serialization", "nn"]
RANK = {layer: i for i, layer in enumerate(LAYERS)}

SOURCES = sorted(p for p in PKG.rglob("*.py"))


def _layer(path: Path) -> str:
    """The layer a source file belongs to (``__init__`` for the package's own ``__init__.py``)."""
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_layers(path: Path, root: Path = ROOT) -> dict[str, tuple[int, bool]]:
    """The layers ``path`` imports from, with a line each and whether every such import is type-only.

    Type-only imports (inside ``if TYPE_CHECKING:``) are imports too: a lower layer that names a higher
    layer's class, even for a checker, describes what it reads with a Protocol of its own instead.
    """
    tree = ast.parse(path.read_text())
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(n) for n in ast.walk(node))
    package = list(path.relative_to(root).with_suffix("").parts)
    package = package[:-1]  # the package a relative import starts from (also right for __init__.py)
    out: dict[str, tuple[int, bool]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name.split(".") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (node.module or "").split(".") if node.module else []
            if node.level:
                base = package[: len(package) - (node.level - 1)] + base
            targets = [base + [a.name] for a in node.names] if not node.module else [base]
        else:
            continue
        for t in targets:
            if len(t) >= 2 and t[0] == "tapeflow" and t[1] in RANK:
                line, only_types = out.get(t[1], (node.lineno, True))
                out[t[1]] = (min(line, node.lineno), only_types and id(node) in type_only)
    return out


def test_the_package_is_its_layers() -> None:
    """``ls tapeflow`` shows the layers: every module lives in one (the package's ``__init__.py`` aside)."""
    stray = [p.name for p in PKG.glob("*.py") if p.name != "__init__.py"]
    assert not stray, f"modules outside the layer subpackages: {stray}; move each into the layer it belongs to"
    found = sorted(p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert found == sorted(LAYERS), f"subpackages {found}, layers {LAYERS}: keep this list and the page in step"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PKG)))
def test_imports_point_one_way(path: Path) -> None:
    me = _layer(path)
    if me == "__init__":
        return  # the public surface re-exports from every layer
    for dep, (line, only_types) in sorted(_imported_layers(path).items()):
        kind = " (type-only, under `if TYPE_CHECKING:`, which counts too)" if only_types else ""
        assert RANK[dep] <= RANK[me], (
            f"tapeflow/{path.relative_to(PKG)}:{line} ({me}) imports from {dep}, a higher layer{kind}; "
            f"imports point to the layers before it: {' < '.join(LAYERS)}; name what a higher layer's object "
            "offers with a Protocol in the lower layer (see docs/architecture.md)"
        )


def test_the_layer_check_sees_type_only_imports(tmp_path: Path) -> None:
    """An upward import under ``if TYPE_CHECKING:`` is found, and reported as type-only."""
    code = (
        "from typing import TYPE_CHECKING\n"
        "from . import _typing\n"
        "if TYPE_CHECKING:\n"
        "    from .._shell._session import Session\n"
        "    from ..nn import Module\n"
    )
    fake = tmp_path / "tapeflow" / "_core" / "_probe.py"
    fake.parent.mkdir(parents=True)
    fake.write_text(code)
    found = _imported_layers(fake, tmp_path)
    assert found == {"_core": (2, False), "_shell": (4, True), "nn": (5, True)}


def test_every_module_is_in_the_architecture_page() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`([\w]+)(?:\.py|/)`", page))
    modules = {p.stem for p in SOURCES if p.name != "__init__.py"} | set(LAYERS)
    missing = sorted(modules - named)
    assert not missing, f"docs/architecture.md does not describe: {missing}"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_private_names(tree: ast.Module) -> set[str]:
    """The private names a module defines itself: its functions, classes and methods, names it assigns
    (module-level ``_x``, class attributes), ``self._x``/``cls._x`` it assigns, and its ``__slots__`` entries."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            own.add(node.attr)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            own.update(
                c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)
            )
    return {n for n in own if _is_private(n)}


def _module_aliases(tree: ast.Module) -> set[str]:
    """Names bound to modules: ``import x [as y]`` and ``from . import x [as y]``."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.asname or a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is None:
            out.update(a.asname or a.name for a in node.names)
    return out


MODULES = {p.stem for p in SOURCES} | {p.name for p in PKG.iterdir() if p.is_dir()}


def _private_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    own, modules = _own_private_names(tree), _module_aliases(tree)
    where = f"tapeflow/{path.relative_to(PKG)}"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            out += [
                f"{where}:{node.lineno}: imports {a.name} from {node.module}"
                for a in node.names
                if _is_private(a.name) and a.name not in MODULES  # private modules are the package's own
            ]
        if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if isinstance(owner, ast.Name) and owner.id in modules:
            out.append(f"{where}:{node.lineno}: {owner.id}.{node.attr} (a private name of another module)")
        elif node.attr not in own:
            out.append(f"{where}:{node.lineno}: {ast.unparse(owner)}.{node.attr}")
    return out


def test_modules_use_only_public_members_of_other_modules() -> None:
    """Every module reaches other modules' objects (tapes, sessions, optimizers, storages) through public seams.

    A private attribute ``obj._x`` of something other than ``self``/``cls`` is allowed only when the module
    defines ``_x`` itself (its own classes' internals); a private name of another module (``R._x``, or
    ``from .m import _x``) never is.
    """
    offenders = [line for path in SOURCES for line in _private_uses(path)]
    assert not offenders, (
        "private members of other modules used (make the member public, or add a public function for it):\n"
        + "\n".join(offenders)
    )


# Bare ``Any`` tokens in the package's code (docstrings and comments excluded). Lower it as types get real;
# the goal is under 100: what remains is mostly tfl.numpy's generic wrappers (_shell/_numpy.py) and nn/.
ANY_BOUND = 35


def _any_tokens(path: Path) -> int:
    toks = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return sum(1 for t in toks if t.type == tokenize.NAME and t.string == "Any")


def test_bare_any_stays_under_its_bound() -> None:
    """Annotations name what a value is (``jax.Array``, ``ArrayLike``, the aliases in ``_core/_typing.py``,
    a Protocol, a TypeVar); ``Any`` does not grow back."""
    counts = {f"tapeflow/{p.relative_to(PKG)}": n for p in SOURCES if (n := _any_tokens(p))}
    total = sum(counts.values())
    worst = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:5])
    assert total <= ANY_BOUND, (
        f"{total} bare Any tokens in tapeflow/, the bound is {ANY_BOUND} (most in {worst}); "
        "use jax.Array, ArrayLike, the aliases in tapeflow/_core/_typing.py, a Protocol or a TypeVar instead"
    )


def test_no_star_imports_in_the_package() -> None:
    for path in SOURCES:
        assert "import *" not in path.read_text(), f"tapeflow/{path.relative_to(PKG)} uses import *"


def test_importing_tapeflow_starts_no_jax_backend() -> None:
    """Import stays cheap and leaves JAX configurable (jax.distributed.initialize, jax_platforms) afterwards."""
    code = (
        "import tapeflow\nfrom jax._src import xla_bridge\nassert not xla_bridge._backends, 'import started a backend'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


_REGISTRY_TABLE = "REGISTRY"
_MUTATORS = frozenset({"pop", "popitem", "update", "setdefault", "clear", "__setitem__", "__delitem__"})


def _is_registry_table(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == _REGISTRY_TABLE) or (
        isinstance(node, ast.Attribute) and node.attr == _REGISTRY_TABLE
    )


def test_only_the_registry_module_changes_the_op_table() -> None:
    """Ops enter and leave through ``_registry.register`` / ``unregister`` / ``restore``, so the
    name rules and the kernel drops that go with them are never skipped."""
    registry = ast.parse((PKG / "_core" / "_registry.py").read_text())
    tables = {ast.unparse(n.target) for n in registry.body if isinstance(n, ast.AnnAssign)}
    assert _REGISTRY_TABLE in tables, f"_registry.py no longer defines {_REGISTRY_TABLE}: update this test"
    offenders = []
    for path in SOURCES:
        if path == PKG / "_core" / "_registry.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"tapeflow/{path.relative_to(PKG)}:{getattr(node, 'lineno', '?')}"
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
                if _is_registry_table(node.value):
                    offenders.append(f"{where}: binds {_REGISTRY_TABLE} to another name")
            elif isinstance(node, ast.AugAssign | ast.AnnAssign | ast.Delete):
                targets = node.targets if isinstance(node, ast.Delete) else [node.target]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in _MUTATORS
                and _is_registry_table(node.func.value)
            ):
                offenders.append(f"{where}: calls {_REGISTRY_TABLE}.{node.func.attr}(...)")
            for t in targets:
                if _is_registry_table(t) or (isinstance(t, ast.Subscript) and _is_registry_table(t.value)):
                    offenders.append(f"{where}: {type(node).__name__.lower()} {ast.unparse(t)}")
    assert not offenders, (
        f"only tapeflow/_core/_registry.py may change {_REGISTRY_TABLE}; call _registry.register, unregister or "
        "restore instead:\n" + "\n".join(offenders)
    )
