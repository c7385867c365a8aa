"""The documentation runs: README and docs code blocks, docstring examples, mkdocs build."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import inspect
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import tapeflow as tfl

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"```python\n(.*?)```", re.S)


def _blocks(path: Path) -> list[str]:
    return FENCE.findall(path.read_text())


def _run_blocks(path: Path) -> None:
    ns: dict[str, object] = {"__name__": f"doc_{path.stem}"}
    with jax.enable_x64(False):  # what a user gets by default (the suite's conftest turns x64 on)
        _exec_blocks(path, ns)


def _exec_blocks(path: Path, ns: dict[str, object]) -> None:
    for i, code in enumerate(_blocks(path)):
        try:
            exec(compile(code, f"{path.name}[block {i}]", "exec"), ns)
        except Exception as e:  # pragma: no cover - the message is the point
            raise AssertionError(f"{path.name} code block {i} failed: {type(e).__name__}: {e}\n{code}") from e


def test_readme_code_blocks_run() -> None:
    assert _blocks(ROOT / "README.md"), "README has python examples"
    _run_blocks(ROOT / "README.md")


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md") if _blocks(p)))
def test_docs_code_blocks_run(page: str) -> None:
    _run_blocks(ROOT / "docs" / page)


def test_readme_quickstart_has_exactly_two_commands_and_ci_runs_the_test_one() -> None:
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    cmds = re.findall(r"```bash\n(.*?)```", quick, re.S)
    assert len(cmds) == 2 and all(c.strip().count("\n") == 0 for c in cmds)
    assert "examples/demo.py" in cmds[0] and "pytest" in cmds[1]
    assert cmds[1].strip() in (ROOT / ".ci" / "run").read_text()


def _modules() -> list[str]:
    names = ["tapeflow"]
    for m in pkgutil.walk_packages(tfl.__path__, "tapeflow."):
        names.append(m.name)
    return sorted(names)


# Modules allowed to have no docstring examples, each with the reason. Every other
# module (new ones included) must run at least one example, so a module whose
# examples silently stop being collected fails here instead of passing with none.
NO_EXAMPLES = {
    "tapeflow._checks": "private operand-check predicates for the op modules; no public API",
    "tapeflow._ops_math": "op definitions: their docstrings live on OpDef objects, which doctest does not "
    "collect; the ops are documented in docs/ops.md and tested in tests/test_ops.py",
    "tapeflow._ops_nn": "op definitions (as tapeflow._ops_math)",
}


def test_no_examples_exemptions_name_existing_modules() -> None:
    stale = sorted(set(NO_EXAMPLES) - set(_modules()))
    assert not stale, f"NO_EXAMPLES names modules that no longer exist: {stale}"


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name: str) -> None:
    mod = importlib.import_module(name)
    with jax.enable_x64(False):  # docstring examples assume JAX's default float32
        res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert res.failed == 0, f"{res.failed} docstring example(s) failed in {name}"
    if name not in NO_EXAMPLES:
        assert res.attempted > 0, (
            f"no docstring examples ran in {name}: add a >>> example to its public API, or exempt it in "
            "NO_EXAMPLES with the reason"
        )


def test_public_names_have_docstrings_with_examples() -> None:
    missing = []
    for name in tfl.__all__:
        obj = getattr(tfl, name)
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and not (obj.__doc__ or "").strip():
            missing.append(name)
    assert not missing, f"public names without a docstring: {missing}"
    for name in (
        "Tape",
        "leaf",
        "record",
        "backward",
        "Session",
        "Param",
        "tie",
        "canonical_indices",
        "Optimizer",
        "value_and_grad",
        "train_step",
    ):
        assert ">>>" in (getattr(tfl, name).__doc__ or ""), f"{name} has no runnable example"


def test_every_registered_op_is_documented() -> None:
    text = (ROOT / "docs" / "ops.md").read_text()
    # ops registered at run time (tfl.lift, tfl.defop, tfl.checkpoint: by other tests, doc examples) are not on the page
    undocumented = [op for op in tfl.ops() if not tfl.REGISTRY[op].user and f"`{op}`" not in text]
    assert not undocumented, f"ops missing from docs/ops.md: {undocumented}"
    spec = importlib.util.spec_from_file_location("gen_ops", ROOT / "docs" / "_ext" / "gen_ops.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert text == gen.render(include_user=False), "docs/ops.md is out of date: run python docs/_ext/gen_ops.py"


def test_functions_stub_is_up_to_date() -> None:
    """tapeflow/_functions.pyi (the op functions' typed signatures, for IDEs) matches the registry."""
    spec = importlib.util.spec_from_file_location("gen_stubs", ROOT / "docs" / "_ext" / "gen_stubs.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    stub = ROOT / "tapeflow" / "_functions.pyi"
    assert stub.read_text() == gen.render(), "tapeflow/_functions.pyi is out of date: run python docs/_ext/gen_stubs.py"
    compile(stub.read_text(), str(stub), "exec")  # valid Python syntax
    from tapeflow import _functions

    defined = set(re.findall(r"^(?:def (\w+)\(|(\w+) = )", stub.read_text(), re.M))
    names = {a or b for a, b in defined}
    assert set(_functions.__all__) <= names, "every op function has a stub entry"


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    exe = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or shutil.which("mkdocs")
    assert exe, "mkdocs is a dev dependency (pip install -e '.[dev]')"
    proc = subprocess.run(
        [exe, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
