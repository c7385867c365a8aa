"""The documentation runs: README and docs code blocks, docstring examples, mkdocs build."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import inspect
import pkgutil
import re
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

import jax
import pytest

import tapeflow as tfl

if TYPE_CHECKING:
    from conftest import SiteBuild

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
    # (what a user's default session prints, also under TAPEFLOW_LAZY=0)
    request.getfixturevalue("library_defaults")
    t0 = time.perf_counter()
    rendered = outputs.render(path)
    took = time.perf_counter() - t0
    assert rendered == path.read_text(), (
        f"docs/{page} shows outputs its code no longer prints: run python docs/_ext/outputs.py docs/{page}"
    )
    if page == "getting-started.md":
        # the page says how long its code takes in a fresh process, a first run the longest; the rule of
        # the examples' stated run times (tests/test_examples.py): a run within twice that
        m = re.search(r"code ran in \d+ to (\d+) s the first time", " ".join(path.read_text().split()))
        assert m, "getting-started.md states how long its code takes the first time"
        assert took <= 2 * int(m[1]), (
            f"getting-started.md's code took {took:.0f} s in a fresh process, more than twice the {m[1]} s "
            "the page states for a first run: make it faster or state an honest time"
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


def test_surface_method_stub_is_up_to_date() -> None:
    """tapeflow/_shell/_surface_methods.pyi (the table's Tensor methods, for type checkers) matches the table.

    Checked in a fresh interpreter, as a user imports tapeflow (without the suite's x64), by the generator itself.
    """
    gen = ROOT / "docs" / "_ext" / "gen_method_stub.py"
    proc = subprocess.run([sys.executable, str(gen), "--check"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stub = ROOT / "tapeflow" / "_shell" / "_surface_methods.pyi"
    compile(stub.read_text(), str(stub), "exec")
    from tapeflow._shell._surface import SURFACE

    declared = set(re.findall(r"^    def (\w+)\(", stub.read_text(), re.M))
    bound = {n for n, e in SURFACE.items() if e.bind & {"method", "property"} and e.records != "stored"}
    assert declared == bound, "every bound Tensor method and property has a stub entry"


@pytest.fixture(scope="module")
def site(docs_site_build: SiteBuild) -> Path:
    """The built site, once the strict build succeeded."""
    assert docs_site_build.returncode == 0, docs_site_build.log
    return docs_site_build.site


def test_mkdocs_build_strict(docs_site_build: SiteBuild) -> None:
    """One strict build of the site, then its HTML: no reST role left, every cross-reference and internal link resolved."""
    log = docs_site_build.log
    assert docs_site_build.returncode == 0, log
    warnings = [ln for ln in log.splitlines() if re.match(r"\s*(WARNING|ERROR)\b", ln) or "Could not find" in ln]
    assert not warnings, "the docs build warned:\n" + "\n".join(warnings)
    problems = site_problems(docs_site_build.site)
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
        # code may index [a][b]: blocks are dropped, and an inline code span counts as one word
        prose = re.sub(r"<pre\b.*?</pre>", "", html, flags=re.S)
        prose = re.sub(r"<[^>]+>", "", re.sub(r"<code\b[^>]*>.*?</code>", "code", prose, flags=re.S))
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
        "<pre><code>a[i][j]</code></pre><p>inline <code>out[i][j] = x[index[i][j]][j]</code></p>"
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
        "```pycon\n>>> :func:`leaf`\n```\n"
        "wrapped: :func:`the tie\n    <tapeflow.tie>`."
    )
    assert xrefs.convert_roles(text, ids.get) == (
        "[`leaf`][tapeflow.leaf], [`Tape.empty`][tapeflow.Tape.empty], [`tie`][tapeflow.tie], "
        "[`tfl.tie`][tapeflow.tie], `jax.jit`\n```pycon\n>>> :func:`leaf`\n```\n"
        "wrapped: [`the tie`][tapeflow.tie]."
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


# --------------------------------------------------------------------------- the API reference: signatures, Tensor


class _ClassSignatures(HTMLParser):
    """Each class heading of an API page (mkdocstrings' ``doc-class`` blocks) and the signature shown under it.

    ``found`` holds ``(heading id, signature text)``, the text None when the class's contents start with no
    ``doc-signature`` block between its heading and them.
    """

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.found: list[tuple[str, str | None]] = []
        self._class_open = False  # inside a doc-class block, before its heading
        self._heading: str | None = None  # a class heading waiting for its signature
        self._depth = 0  # div depth inside the signature block
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        classes = set((a.get("class") or "").split())
        if self._depth:
            self._depth += tag == "div"
        elif tag == "div" and {"doc-object", "doc-class"} <= classes:
            self._class_open = True
        elif self._class_open and re.fullmatch(r"h[1-6]", tag) and "doc-heading" in classes:
            self._class_open, self._heading = False, a.get("id") or ""
        elif self._heading is not None and tag == "div" and "doc-signature" in classes:
            self._depth = 1
        elif self._heading is not None and tag == "div" and "doc-contents" in classes:
            self.found.append((self._heading, None))
            self._heading = None

    def handle_endtag(self, tag: str) -> None:
        if self._depth and tag == "div":
            self._depth -= 1
            if not self._depth:
                self.found.append((self._heading or "", "".join(self._text).strip()))
                self._heading, self._text = None, []

    def handle_data(self, data: str) -> None:
        if self._depth:
            self._text.append(data)


def class_signatures(html: str) -> list[tuple[str, str | None]]:
    """``(heading id, signature or None)`` for every class documented on an API page."""
    parser = _ClassSignatures()
    parser.feed(html)
    parser.close()
    return parser.found


def _runtime(path: str) -> object:
    return _ext("signatures").runtime(path)


def test_class_signatures_reads_a_page() -> None:
    """The parser pairs each class heading with the signature under it, and notices a class with none."""
    html = (
        '<div class="doc doc-object doc-class"><h3 id="tapeflow.nn.Linear" class="doc doc-heading">Linear</h3>'
        '<div class="language-python doc-signature highlight"><pre><code><span class="nf">Linear</span>'
        "(\n    in_features, <span>out_features</span>\n)</code></pre></div>"
        '<div class="doc doc-contents"><div class="doc doc-object doc-function"><h4 id="tapeflow.nn.Linear.forward"'
        ' class="doc doc-heading">forward</h4><div class="doc-signature"><pre>forward(x)</pre></div></div></div></div>'
        '<div class="doc doc-object doc-class"><h3 id="tapeflow.Bare" class="doc doc-heading">Bare</h3>'
        '<div class="doc doc-contents"><p>No signature.</p></div></div>'
    )
    assert class_signatures(html) == [
        ("tapeflow.nn.Linear", "Linear(\n    in_features, out_features\n)"),
        ("tapeflow.Bare", None),
    ]


def test_every_api_class_shows_its_constructor_signature(site: Path) -> None:
    """Every class on the API pages shows ``Name(parameters)`` under its heading (``merge_init_into_class``).

    Exception and warning classes are exempt: tapeflow raises them, and Python reports no signature for
    BaseException's constructor (docs/_ext/signatures.py gives every other class the one Python reports).
    """
    pages = sorted((site / "api").rglob("*.html"))
    assert pages
    found, missing = 0, []
    for page in pages:
        for hid, sig in class_signatures(page.read_text()):
            obj = _runtime(hid)
            assert obj is not None, f"{page.relative_to(site)}: class heading {hid!r} names no importable object"
            if inspect.isclass(obj) and issubclass(obj, BaseException):
                continue
            name = hid.rsplit(".", 1)[-1]
            found += 1
            if sig is None or not re.match(rf"{re.escape(name)}\(", sig):
                missing.append(f"{page.relative_to(site)}: {hid} shows {sig!r}")
    assert found >= 20, f"only {found} classes found on the API pages: has the HTML changed?"
    assert not missing, "classes without their constructor signature:\n" + "\n".join(missing)


def test_linear_shows_pytorchs_constructor(site: Path) -> None:
    sigs = dict(class_signatures((site / "api" / "nn" / "index.html").read_text()))
    text = re.sub(r"\s+", " ", sigs["tapeflow.nn.Linear"] or "")
    assert re.match(r"Linear\( ?in_features: int, out_features: int, .*bias: bool = True", text), text


def test_every_public_tensor_member_is_documented(site: Path) -> None:
    """Each public name of ``dir(tfl.Tensor)`` has its heading on the Tensor page, with its signature and text."""
    page = (site / "api" / "tensor" / "index.html").read_text()
    parser = _Anchors()
    parser.feed(page)
    public = [n for n in dir(tfl.Tensor) if not n.startswith("_")]
    assert len(public) > 40
    absent = [n for n in public if f"tapeflow.Tensor.{n}" not in parser.ids]
    assert not absent, f"public Tensor members missing from docs/api/tensor.md: {absent}"
    gen = _ext("gen_surface")
    undescribed = [n for n in public if not gen._description(gen._doc(n, tfl.Tensor))[0]]
    assert not undescribed, f"public Tensor members with no description (give them a docstring): {undescribed}"


def test_surface_pages_are_up_to_date() -> None:
    """docs/api/tensor.md and the PyTorch-name tables of docs/from-pytorch.md are what the code generates.

    Checked in a fresh interpreter, as a user imports tapeflow (without the suite's x64), by the generator itself.
    """
    gen = ROOT / "docs" / "_ext" / "gen_surface.py"
    proc = subprocess.run([sys.executable, str(gen), "--check"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_from_pytorch_lists_every_surface_entry_and_layer() -> None:
    """Each surface entry appears in its binding's table, each tfl.nn layer class in the layers table."""
    from tapeflow._shell import _surface

    text = (ROOT / "docs" / "from-pytorch.md").read_text()
    generated = text.split(_ext("gen_surface").BEGIN, 1)[1]
    prefix = {"method": "x.", "property": "x.", "tfl": "tfl.", "F": "F.", "nn": "nn."}
    absent = [
        f"{prefix[b]}{n}" for n, e in _surface.SURFACE.items() for b in e.bind if f"`{prefix[b]}{n}`" not in generated
    ]
    assert not absent, f"surface entries missing from docs/from-pytorch.md: {absent}"
    layers = [n for n in tfl.nn.__all__ if inspect.isclass(c := getattr(tfl.nn, n)) and issubclass(c, tfl.nn.Module)]
    assert "Linear" in layers
    assert not [n for n in layers if f"`nn.{n}`" not in generated]


def test_gen_surface_writes_calls_a_reader_can_read() -> None:
    """Signatures: no annotations, defaults by name (never an address), long ones one parameter per line."""
    gen = _ext("gen_surface")

    def f(input, dim=None, *, dtype=jax.numpy.float32, act=tfl.relu):
        return input

    text = gen.call("x.f", gen.plain(inspect.signature(f), drop_first=True))
    assert text == "x.f(dim=None, *, dtype=float32, act=relu)"

    def g(input: object, a_long_parameter_name: int = 1, /, another_long_one: str = "x", *, k: int = 3) -> None:
        return None

    text = gen.call("x.a_method_with_a_long_name", gen.plain(inspect.signature(g)))
    assert text.split("\n") == [
        "x.a_method_with_a_long_name(",
        "    input,",
        "    a_long_parameter_name=1,",
        "    /,",
        '    another_long_one="x",',
        "    *,",
        "    k=3,",
        ")",
    ]


def test_porting_guide_ports_the_class_unchanged() -> None:
    """docs/porting.md: the tapeflow model is the PyTorch class's text, only the imports changed."""
    blocks = _blocks(ROOT / "docs" / "porting.md")
    nets = [b for b in blocks if "class Net(nn.Module):" in b]
    assert len(nets) == 2, "the guide shows the class twice: PyTorch's, then tapeflow's"
    (torch_imports, torch_rest), (tfl_imports, tfl_rest) = (b.split("class Net(nn.Module):", 1) for b in nets)

    def body(rest: str) -> str:  # the class: its lines up to the first one back at column 0
        return re.split(r"\n(?=\S)", rest, maxsplit=1)[0].rstrip()

    assert body(torch_rest) == body(tfl_rest) and "def forward(self, x):" in body(tfl_rest)
    assert "import torch.nn as nn" in torch_imports and "import torch.nn.functional as F" in torch_imports
    assert "import tapeflow.nn as nn" in tfl_imports and "import tapeflow.nn.functional as F" in tfl_imports
