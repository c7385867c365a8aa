"""The built site as a reader sees it: every code and output block fits the text column."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# mkdocs-material's text column at its default width shows about 88 characters of code
# before a block scrolls sideways, and what scrolls off is often exactly an error's hint
MAX_PRE_LINE = 88


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One build of the site for the module (about 30 s), run as tests/test_docs.py runs it.

    Not ``--strict``: the build's warnings are test_mkdocs_build_strict's to report; this
    module looks only at the pages it made.
    """
    exe = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or shutil.which("mkdocs")
    assert exe, "mkdocs is a dev dependency (pip install -e '.[dev]')"
    out = tmp_path_factory.mktemp("layout") / "site"
    proc = subprocess.run(
        [exe, "build", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # mkdocs-material's banner about MkDocs 2.0
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


class _PreText(HTMLParser):
    """The text content of every ``<pre>`` of a page, tags (highlighting ``<span>``s) dropped.

    This includes the API pages' signatures: mkdocstrings renders each as a ``<pre>`` in a
    ``<div class="doc-signature">``, the same element as a code block, so they are measured
    too (the handler's ``line_length`` option in mkdocs.yml wraps them).
    """

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[str] = []
        self._depth = 0
        self._parts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "pre":
            self._depth += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "pre" and self._depth:
            self._depth -= 1
            if not self._depth:
                self.blocks.append("".join(self._parts))
                self._parts = []

    def handle_data(self, data: str) -> None:
        if self._depth:
            self._parts.append(data)


def pre_lines(html: str) -> list[str]:
    """Every line of every ``<pre>`` block in ``html``, as a reader sees it."""
    parser = _PreText()
    parser.feed(html)
    parser.close()
    return [line for block in parser.blocks for line in block.split("\n")]


def long_pre_lines(site: Path, limit: int = MAX_PRE_LINE) -> list[str]:
    """``page: [len] line`` for each ``<pre>`` line of the built site longer than ``limit``."""
    found = []
    for page in sorted(site.rglob("*.html")):
        rel = page.relative_to(site)
        for line in pre_lines(page.read_text()):
            if len(line) > limit:
                found.append(f"{rel}: [{len(line)}] {line}")
    return found


def test_pre_lines_take_the_text_of_highlighted_code() -> None:
    """What a reader sees of a block: its text, entities decoded; prose outside ``<pre>`` is not a line."""
    html = (
        "<p>" + "prose " * 40 + '</p><div class="highlight"><pre><span></span><code>'
        '<a id="__codelineno-0-1" href="#__codelineno-0-1"></a><span class="n">x</span>'
        '<span class="o">=</span><span class="mi">1</span>\n&lt;b&gt; ok\n</code></pre></div>'
    )
    assert pre_lines(html) == ["x=1", "<b> ok", ""]


def test_long_pre_lines_name_the_page_the_length_and_the_line(tmp_path: Path) -> None:
    (tmp_path / "guide").mkdir()
    long_line = "y = " + "1 + " * 30 + "1"
    (tmp_path / "guide" / "index.html").write_text(f"<pre><code>ok\n{long_line}</code></pre>")
    assert long_pre_lines(tmp_path) == [f"guide/index.html: [{len(long_line)}] {long_line}"]


def test_every_code_line_fits_the_column(site: Path) -> None:
    assert list(site.rglob("*.html")), "the build made pages"
    found = long_pre_lines(site)
    assert not found, (
        f"{len(found)} code/output line(s) longer than {MAX_PRE_LINE} characters "
        "(they scroll out of the text column):\n" + "\n".join(found)
    )


def test_generated_outputs_wrap_long_printed_lines() -> None:
    """docs/_ext/outputs.py wraps what a page's code prints at spaces, continuations indented 2 more."""
    spec = importlib.util.spec_from_file_location("docs_ext_outputs", ROOT / "docs" / "_ext" / "outputs.py")
    assert spec and spec.loader
    outputs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(outputs)
    assert outputs.WIDTH == MAX_PRE_LINE
    words = " ".join(f"word{i}" for i in range(30))
    printed = f"short\n  {words}\n{'x' * 100}\n"
    lines = outputs.wrap(printed).split("\n")
    assert lines[0] == "short" and lines[-2:] == ["x" * 100, ""]  # a word is never split
    body = lines[1:-2]
    assert len(body) > 1 and all(len(line) <= MAX_PRE_LINE for line in body)
    assert body[0].startswith("  word0") and all(line.startswith("    word") for line in body[1:])
    assert " ".join(line.strip() for line in body) == words
