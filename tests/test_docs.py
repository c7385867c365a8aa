"""The documentation runs: README and docs code blocks, docstring examples, mkdocs build."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import inspect
import os
import pkgutil
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from types import ModuleType
from urllib.parse import unquote, urlsplit

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


def _ext(name: str) -> ModuleType:
    """Import ``docs/_ext/<name>.py`` from its path."""
    spec = importlib.util.spec_from_file_location(f"docs_ext_{name}", ROOT / "docs" / "_ext" / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md") if _blocks(p)))
def test_docs_code_blocks_run(page: str, request: pytest.FixtureRequest) -> None:
    path = ROOT / "docs" / page
    outputs = _ext("outputs")
    if outputs.script_name(path.read_text()) is None:
        _run_blocks(path)
        return
    # a page that shows what its code prints: the blocks run as its script, and the text shown is what they print
    # (what a user's default session prints, also under TAPEFLOW_TEST_LAZY=1)
    request.getfixturevalue("library_defaults")
    assert outputs.render(path) == path.read_text(), (
        f"docs/{page} shows outputs its code no longer prints: run python docs/_ext/outputs.py docs/{page}"
    )


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
    **{
        f"tapeflow.{layer}": "a layer's package: its docstring names the layer; the examples live in its modules"
        for layer in ("_core", "_ops", "_shell", "_train", "_serialization")
    },
    "tapeflow._core._checks": "private operand-check predicates for the op modules; no public API",
    "tapeflow._ops._math": "op definitions: their docstrings live on OpDef objects, which doctest does not "
    "collect; the ops are documented in docs/ops.md and tested in tests/test_ops.py",
    "tapeflow._ops._nn": "op definitions (as tapeflow._ops._math)",
}


def test_no_examples_exemptions_name_existing_modules() -> None:
    stale = sorted(set(NO_EXAMPLES) - set(_modules()))
    assert not stale, f"NO_EXAMPLES names modules that no longer exist: {stale}"


@pytest.mark.parametrize("name", _modules())
@pytest.mark.usefixtures("library_defaults")  # the examples show a user's default session
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
    gen = _ext("gen_ops")
    assert text == gen.render(include_user=False), "docs/ops.md is out of date: run python docs/_ext/gen_ops.py"
    assert (ROOT / "docs" / "api" / "functions.md").read_text() == gen.render_functions(), (
        "docs/api/functions.md is out of date: run python docs/_ext/gen_ops.py"
    )


def test_functions_stub_is_up_to_date() -> None:
    """tapeflow/_shell/_functions.pyi (the op functions' typed signatures, for IDEs) matches the registry."""
    gen = _ext("gen_stubs")
    stub = ROOT / "tapeflow" / "_shell" / "_functions.pyi"
    assert stub.read_text() == gen.render(), (
        "tapeflow/_shell/_functions.pyi is out of date: run python docs/_ext/gen_stubs.py"
    )
    compile(stub.read_text(), str(stub), "exec")  # valid Python syntax
    from tapeflow._shell import _functions

    defined = set(re.findall(r"^(?:def (\w+)\(|(\w+) = )", stub.read_text(), re.M))
    names = {a or b for a, b in defined}
    assert set(_functions.__all__) <= names, "every op function has a stub entry"


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    """One strict build of the site, then its HTML: no reST role left, every cross-reference and internal link resolved."""
    exe = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or shutil.which("mkdocs")
    assert exe, "mkdocs is a dev dependency (pip install -e '.[dev]')"
    site = tmp_path / "site"
    proc = subprocess.run(
        [exe, "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # mkdocs-material's banner about MkDocs 2.0
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    warnings = [ln for ln in log.splitlines() if re.match(r"\s*(WARNING|ERROR)\b", ln) or "Could not find" in ln]
    assert not warnings, "the docs build warned:\n" + "\n".join(warnings)
    problems = site_problems(site)
    assert not problems, f"{len(problems)} problem(s) in the built site:\n" + "\n".join(problems[:50])


# reST roles that reached the HTML unconverted: `:func:` then a backtick, or the <code> Markdown made of it
ROLE_TEXT = re.compile(r":(?:func|meth|class|attr|data|mod|exc|obj):(?:`|<code)")
# an autorefs reference left as text, [title][identifier]: autorefs leaves those it cannot resolve
UNRESOLVED_REF = re.compile(r"\[[^\[\]\n]+\]\[[A-Za-z_][\w.]*\]")


class _Anchors(HTMLParser):
    """The ids of a page and the links (href, src) it makes."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"] or "")
        if tag == "a" and a.get("name"):
            self.ids.add(a["name"] or "")
        self.links += [v for k, v in attrs if k in ("href", "src") and v]


def site_problems(site: Path) -> list[str]:
    """Raw role text, unresolved cross-references and broken internal links in a built site."""
    root = site.resolve()
    problems: list[str] = []
    pages: dict[Path, _Anchors] = {}
    for page in sorted(root.rglob("*.html")):
        html = page.read_text()
        rel = page.relative_to(root)
        problems += [f"{rel}: raw reST role {html[m.start() : m.start() + 40]!r}" for m in ROLE_TEXT.finditer(html)]
        prose = re.sub(r"<[^>]+>", "", re.sub(r"<pre\b.*?</pre>", "", html, flags=re.S))  # code blocks may index [a][b]
        problems += [f"{rel}: unresolved cross-reference {m.group(0)!r}" for m in UNRESOLVED_REF.finditer(prose)]
        if "<autoref" in html:
            problems.append(f"{rel}: an <autoref> element was left unresolved")
        pages[page] = parser = _Anchors()
        parser.feed(html)
    for page, parser in pages.items():
        for link in parser.links:
            url = urlsplit(link)
            if url.scheme or url.netloc:
                continue  # external: not checked (the build runs offline)
            where = f"{page.relative_to(root)}: link {link!r}"
            if url.path:
                base = root if url.path.startswith("/") else page.parent
                target = (base / unquote(url.path).lstrip("/")).resolve()
            else:
                target = page
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                problems.append(f"{where}: no file {target}")
            elif url.fragment and target.suffix == ".html" and unquote(url.fragment) not in pages[target].ids:
                problems.append(f"{where}: {target.relative_to(root)} has no id {url.fragment!r}")
    return problems


def test_site_problems_finds_each_kind(tmp_path: Path) -> None:
    """The checker of the built site reports what it is meant to catch (a site with one of each)."""
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "index.html").write_text('<h3 id="tapeflow.leaf">leaf</h3><img src="../img.svg">')
    (tmp_path / "img.svg").write_text("<svg/>")
    (tmp_path / "index.html").write_text(
        '<a href="api/#tapeflow.leaf">ok</a> <a href="https://example.org/x">external</a> <a href="#top" id="top">top</a>'
        "<pre><code>a[i][j]</code></pre>"
        "<p>See :func:<code>leaf</code>, [<code>nope</code>][tapeflow.nope], <autoref identifier=x>.</p>"
        '<a href="api/#tapeflow.gone">anchor</a> <a href="missing/">page</a> <img src="/img.svg">'
    )
    found = site_problems(tmp_path)
    assert len(found) == 5, found
    for what in ("raw reST role", "unresolved cross-reference", "<autoref>", "no id 'tapeflow.gone'", "no file"):
        assert any(what in p for p in found), (what, found)


def test_xrefs_convert_roles() -> None:
    """reST roles become autorefs links when the site documents the name, plain code otherwise."""
    xrefs = _ext("xrefs")
    ids = {"leaf": "tapeflow.leaf", "Tape.empty": "tapeflow.Tape.empty", "tapeflow.tie": "tapeflow.tie"}
    text = (
        ":func:`leaf`, :meth:`Tape.empty`, :func:`~tapeflow.tie`, :func:`tfl.tie <tapeflow.tie>`, :func:`jax.jit`\n"
        "```pycon\n>>> :func:`leaf`\n```"
    )
    assert xrefs.convert_roles(text, ids.get) == (
        "[`leaf`][tapeflow.leaf], [`Tape.empty`][tapeflow.Tape.empty], [`tie`][tapeflow.tie], "
        "[`tfl.tie`][tapeflow.tie], `jax.jit`\n```pycon\n>>> :func:`leaf`\n```"
    )


def test_figures_match_their_script() -> None:
    """docs/images: the committed DOT files are what docs/_ext/figures.py builds, and the SVGs their rendering."""
    figures = _ext("figures")
    images = ROOT / "docs" / "images"
    with jax.enable_x64(False):  # the pictures show float32, JAX's default
        dots = {"tape_fork": figures.fork_dot(), "tied_param": figures.tied_dot()}
    for name, text in dots.items():
        assert (images / f"{name}.dot").read_text() == text, (
            f"docs/images/{name}.dot is stale: run python docs/_ext/figures.py"
        )
        assert (images / f"{name}.svg").read_text() == figures.render_svg(text), f"docs/images/{name}.svg is stale"
    assert "W storage" in dots["tied_param"] and dots["tied_param"].count("cotangents summed") == 2
    assert (images / "timeline.svg").is_file()


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_the_documented_training_loop_draws_a_new_dropout_mask_every_step(page: str, monkeypatch) -> None:
    """The page's eager loop, with a dropout after each ``tfl.tanh``: a session made once keeps its RNG counter.

    A ``tfl.Session(seed=0)`` opened anew each step would restart the counter and draw the same mask every step.
    """
    blocks = _blocks(ROOT / page)
    loop = next(i for i, b in enumerate(blocks) if "for step in range" in b and "opt.step(s.backward" in b)
    masks: list[object] = []
    drop, tanh = tfl.nn.Dropout(0.5), tfl.tanh

    def tanh_then_dropout(x: tfl.Tensor) -> tfl.Tensor:
        out = drop(tanh(x))
        masks.append(jax.numpy.asarray(out.value) != 0)
        return out

    ns: dict[str, object] = {"__name__": "doc_loop"}
    with jax.enable_x64(False):
        for i, code in enumerate(blocks[: loop + 1]):
            if i == loop:
                monkeypatch.setattr(tfl, "tanh", tanh_then_dropout)
            exec(compile(code, f"{page}[block {i}]", "exec"), ns)
    assert len(masks) >= 2
    assert not any(bool((a == b).all()) for a, b in zip(masks, masks[1:])), f"{page}: a step repeated its mask"
