"""The built site as a reader sees it, in a real browser: nothing cut off, nothing under the copy button.

Every page of the built site is served on 127.0.0.1 and loaded in headless Chromium (Debian's
``chromium`` and ``chromium-driver``, driven by selenium) at two widths:

- 1280 px (a laptop; mkdocs-material shows both sidebars, so the text column is at its narrowest
  for a desktop window): no code block or table needs horizontal scrolling, the copy button of a
  code block covers no text, and no inline code name is broken inside a word (``err.operand`` /
  ``s``);
- 390 px (a phone): no page is wider than the screen.

A screenshot of every page at 1280 px is written for review, to ``$TAPEFLOW_DOCS_SCREENSHOTS`` when
set, else to ``build/docs-screenshots`` in the checkout (git ignores it); the test prints the folder.

Requests that leave the machine (Google's web fonts) are blocked, so a run does not depend on
the network: code then shows in the system's monospace font (DejaVu Sans Mono on Debian, 0.602 em
a character), a little wider than the theme's Roboto Mono (0.600 em), so what fits here fits
for a reader too.

Without Chromium the browser tests skip, except under ``CI=true`` or ``TAPEFLOW_REQUIRE_BROWSER=1``
(``.ci/run`` sets it and installs the browser), where they fail and name the command that
installs it.
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from conftest import SiteBuild

ROOT = Path(__file__).resolve().parents[1]
INSTALL = "apt-get install -y chromium chromium-driver"
DESKTOP, PHONE = 1280, 390


@pytest.fixture(scope="module")
def site(docs_site_build: SiteBuild, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site of the run's one strict build (conftest's ``docs_site_build``, shared with tests/test_docs.py).

    The build's warnings are test_mkdocs_build_strict's to report; this module looks only at
    the pages. When the strict build failed, this module builds the site again, not strict
    (about 30 s).
    """
    if docs_site_build.returncode == 0:
        return docs_site_build.site
    exe = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or shutil.which("mkdocs")
    assert exe, "mkdocs is a dev dependency (pip install -e '.[dev]')"
    out = tmp_path_factory.mktemp("layout") / "site"
    t0 = time.perf_counter()
    proc = subprocess.run(
        [exe, "build", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # mkdocs-material's banner about MkDocs 2.0
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(f"mkdocs build: {time.perf_counter() - t0:.0f} s")
    return out


def _missing_browser(reason: str) -> None:
    """Fail in CI (the browser is part of its setup), skip elsewhere; either way say how to install it."""
    msg = f"{reason}: install Debian's browser and its driver with `{INSTALL}` (as root), and selenium with pip install -e '.[dev]'"
    if os.environ.get("CI", "").lower() == "true" or os.environ.get("TAPEFLOW_REQUIRE_BROWSER") == "1":
        pytest.fail(msg)
    pytest.skip(msg)


def _find(*names: str) -> str | None:
    return next((p for p in map(shutil.which, names) if p), None)


def start_browser(chrome: str, driver_exe: str) -> Any:
    """Headless Chromium, driven through selenium, that loads nothing from outside 127.0.0.1."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chrome
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(options=opts, service=Service(driver_exe))
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(30)
    driver.execute_cdp_cmd("Network.enable", {})
    # the web fonts (see the module docstring), and the search index, which the search worker
    # parses on every page load and which changes no layout
    blocked = ["https://*", "*://fonts.googleapis.com/*", "*://fonts.gstatic.com/*", "*search_index.json"]
    driver.execute_cdp_cmd("Network.setBlockedURLs", {"urls": blocked})
    return driver


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if importlib.util.find_spec("selenium") is None:
        _missing_browser("selenium is not installed")
    chrome = _find("chromium", "chromium-browser")
    driver_exe = _find("chromedriver")
    if chrome is None or driver_exe is None:
        _missing_browser(f"no {'chromium' if chrome is None else 'chromedriver'} on PATH")
    assert chrome and driver_exe
    driver = start_browser(chrome, driver_exe)
    try:
        yield driver
    finally:
        driver.quit()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    """The built site served over HTTP on 127.0.0.1, on a free port: its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


# Runs in the page once it has loaded, its fonts are ready and the theme's script has added the copy
# buttons; calls back with what it measured (see _Page). Collapsed admonitions are opened first, so
# the code inside them is measured too.
MEASURE = r"""
const phone = arguments[0];  // at the phone width only the page's width and what sticks out
const done = arguments[arguments.length - 1];
const content = () => document.querySelector(".md-content") || document.body;
const longest = (el) => (el.innerText || el.textContent || "").split("\n")
  .reduce((a, b) => (b.length > a.length ? b : a), "").slice(0, 140);
const kind = (el) => el.matches("pre > code") ? "code block"
  : el.querySelector("table") ? "table" : el.tagName.toLowerCase();
function textRects(root, skip) {
  // one rect per line box of each text node's visible characters (leading/trailing spaces dropped)
  const out = [];
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    if (skip && skip.contains(n)) continue;
    const s = n.data, first = s.search(/\S/);
    if (first < 0) continue;
    const r = document.createRange();
    r.setStart(n, first);
    r.setEnd(n, s.trimEnd().length);
    for (const q of r.getClientRects()) if (q.width > 0) out.push([q, s.trim()]);
  }
  return out;
}
function brokenInsideWord(code) {
  // the characters either side of each line break of an inline code span, when both are word characters
  const n = code.firstChild;
  if (!n || n.nodeType !== Node.TEXT_NODE || code.childNodes.length !== 1) return null;
  const r = document.createRange();
  let top = null;
  for (let i = 0; i < n.data.length; i++) {
    r.setStart(n, i); r.setEnd(n, i + 1);
    const rects = r.getClientRects();
    if (!rects.length) continue;
    const t = Math.round(rects[rects.length - 1].top);
    if (top !== null && t > top + 2 && /\w/.test(n.data[i - 1]) && /\w/.test(n.data[i]))
      return n.data.slice(0, i) + " / " + n.data.slice(i);
    top = t;
  }
  return null;
}
function measurePhone() {
  // the innermost elements that reach past the screen's right edge
  const out = {pageWidth: document.documentElement.scrollWidth, scrolls: [], covered: [], broken: [],
               sticksOut: [], column: null};
  const past = (el) => { const r = el.getBoundingClientRect(); return r.width > 0 && r.right > PHONE_PX + 1; };
  for (const el of document.body.querySelectorAll("*")) {
    if (out.sticksOut.length < 5 && past(el) && !Array.from(el.children).some(past))
      out.sticksOut.push([el.tagName.toLowerCase(), Math.round(el.getBoundingClientRect().right),
                          longest(el.closest("pre, table, p, li") || el).slice(0, 80)]);
  }
  done(out);
}
function measure() {
  for (const d of document.querySelectorAll("details")) d.open = true;
  const root = content();
  const out = {pageWidth: document.documentElement.scrollWidth, scrolls: [], covered: [], broken: [],
               sticksOut: [], column: null};
  for (const el of root.querySelectorAll("*")) {
    const cs = getComputedStyle(el);
    if ((cs.overflowX === "auto" || cs.overflowX === "scroll") && el.scrollWidth > el.clientWidth + 1)
      out.scrolls.push([kind(el), el.scrollWidth - el.clientWidth, longest(el)]);
  }
  for (const nav of root.querySelectorAll(".md-code__nav")) {
    const pre = nav.closest("pre");
    const b = nav.getBoundingClientRect();
    if (!pre || b.width === 0) continue;
    const hit = textRects(pre, nav).find(([q]) =>
      q.right > b.left && q.left < b.right && q.bottom > b.top && q.top < b.bottom);
    if (hit) out.covered.push([hit[1].slice(0, 60), longest(pre)]);
  }
  for (const code of root.querySelectorAll("code")) {
    if (code.closest("pre") || /\s/.test(code.textContent)) continue;
    if (code.getClientRects().length < 2) continue;
    const where = brokenInsideWord(code);
    if (where) out.broken.push(where);
  }
  // how many monospace characters the page's widest code block shows, and how many fit left of
  // its copy button (a block in a list, an admonition or a card shows fewer)
  for (const code of root.querySelectorAll("pre > code")) {
    const nav = code.parentElement.querySelector(".md-code__nav");
    if (!nav || code.clientWidth === 0) continue;
    const cs = getComputedStyle(code);
    const ctx = document.createElement("canvas").getContext("2d");
    ctx.font = cs.fontSize + " " + cs.fontFamily;
    const ch = ctx.measureText("0".repeat(100)).width / 100;
    const left = code.getBoundingClientRect().left + parseFloat(cs.paddingLeft);
    const shown = Math.floor((code.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight)) / ch);
    if (!out.column || shown > out.column[0])
      out.column = [shown, Math.floor((nav.getBoundingClientRect().left - left) / ch)];
  }
  done(out);
}
function whenSettled() {
  // the theme adds the copy buttons from its script: wait until their count holds for 100 ms
  let last = -1;
  const poll = () => {
    const n = document.querySelectorAll(".md-code__nav").length;
    if (n === last) measure(); else { last = n; setTimeout(poll, 100); }
  };
  document.fonts.ready.then(() => setTimeout(poll, 50));
}
// the phone width lays out the page the desktop width measured (loaded and settled) again
if (phone) measurePhone();
else if (document.readyState === "complete") whenSettled(); else addEventListener("load", whenSettled);
""".replace("PHONE_PX", str(PHONE))


@dataclass
class _Page:
    """What the browser measured on one page at one width."""

    page_width: int
    scrolls: list[tuple[str, int, str]] = field(default_factory=list)  # (kind, px hidden, its longest line)
    covered: list[tuple[str, str]] = field(default_factory=list)  # (text under the copy button, the block's line)
    broken: list[str] = field(default_factory=list)  # inline code broken inside a word, "err.operand / s"
    sticks_out: list[tuple[str, int, str]] = field(
        default_factory=list
    )  # at the phone width: (element, right edge, text)
    column: tuple[int, int] | None = None  # characters a code line shows, and those left of the copy button


def _pages(site: Path) -> list[str]:
    return sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html"))


def _viewport(driver: Any, width: int, height: int = 900) -> None:
    # the phone is emulated as one (its viewport meta tag honoured), the laptop as a window
    metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": width == PHONE}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)


def _measure(driver: Any, phone: bool = False) -> _Page:
    got = driver.execute_async_script(MEASURE, phone)
    return _Page(
        page_width=got["pageWidth"],
        scrolls=[tuple(s) for s in got["scrolls"]],
        covered=[tuple(c) for c in got["covered"]],
        broken=got["broken"],
        sticks_out=[tuple(s) for s in got["sticksOut"]],
        column=tuple(got["column"]) if got["column"] else None,
    )


def visit(driver: Any, url: str, shot: Path | None = None) -> tuple[_Page, _Page]:
    """One page measured at 1280 px (and photographed, whole, into ``shot``), then at 390 px.

    The page is loaded once: the phone width is the same document laid out again, as a
    browser window made narrower lays it out.
    """
    _viewport(driver, DESKTOP)
    driver.get(url)
    desktop = _measure(driver)
    if shot is not None:
        # the viewport made as tall as the page, then one picture of it: much faster than
        # Chromium's capture beyond the viewport, and JPEG than PNG (long pages are 40,000 px)
        _viewport(driver, DESKTOP, driver.execute_script("return document.documentElement.scrollHeight"))
        picture = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "jpeg", "quality": 80})
        shot.write_bytes(base64.b64decode(picture["data"]))
    _viewport(driver, PHONE)
    return desktop, _measure(driver, phone=True)


@pytest.fixture(scope="module")
def screenshots() -> Path:
    """The folder of this run's screenshots, emptied first (a page that is gone leaves no picture behind)."""
    folder = Path(os.environ.get("TAPEFLOW_DOCS_SCREENSHOTS") or ROOT / "build" / "docs-screenshots")
    if folder.is_dir():
        for old in folder.glob("*.jpg"):
            old.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def measured(browser: Any, served: str, site: Path, screenshots: Path) -> dict[str, tuple[_Page, _Page]]:
    """Every page of the site: what it shows at 1280 px and at 390 px."""
    pages = _pages(site)
    assert len(pages) > 20, "the build made the pages"
    got = {}
    t0 = time.perf_counter()
    for page in pages:
        shot = screenshots / (page.removesuffix(".html").replace("/", "_") + ".jpg")
        got[page] = visit(browser, f"{served}/{page}", shot)
    print(
        f"{len(pages)} pages at {DESKTOP} and {PHONE} px: {time.perf_counter() - t0:.0f} s; screenshots: {screenshots}"
    )
    return got


def test_at_1280_px_no_code_or_table_is_cut(measured: dict[str, tuple[_Page, _Page]], screenshots: Path) -> None:
    """Every page at 1280 px: nothing scrolls sideways, nothing under a copy button, no name broken mid-word."""
    problems: list[str] = []
    for page, (got, _) in measured.items():
        problems += [f"{page}: {k} scrolls {px} px: {line!r}" for k, px, line in got.scrolls]
        problems += [f"{page}: the copy button covers {text!r} in {line!r}" for text, line in got.covered]
        problems += [f"{page}: inline code broken inside a word: {where!r}" for where in got.broken]
    assert not problems, (
        f"{len(problems)} thing(s) a reader sees cut at {DESKTOP} px (screenshots: {screenshots}):\n"
        + "\n".join(problems)
    )


def test_generated_outputs_fit_under_the_copy_button(measured: dict[str, tuple[_Page, _Page]]) -> None:
    """The widths printed lines are wrapped to are what a code block shows left of its copy button.

    docs/_ext/outputs.py wraps a page's outputs to its text column; docs/_ext/gallery.py wraps the
    gallery's to a card, narrower than the column (a card is the gallery's widest code block).
    """
    columns = {page: got.column for page, (got, _) in measured.items() if got.column}
    assert columns, "no code block with a copy button was measured"
    assert GALLERY in columns, "the gallery's cards show code blocks"
    widths = {GALLERY: _ext("gallery").WIDTH}
    for page, (shown, before_button) in columns.items():
        width = widths.get(page, _ext("outputs").WIDTH)
        assert width <= before_button <= shown, (page, width, before_button, shown)


def test_at_390_px_no_page_is_wider_than_the_phone(measured: dict[str, tuple[_Page, _Page]]) -> None:
    """Every page on a phone: the page itself never scrolls sideways (a code block or a table may)."""
    problems = []
    for page, (_, got) in measured.items():
        if got.page_width > PHONE:
            what = "; ".join(f"{el} to {right} px {text!r}" for el, right, text in got.sticks_out[:3])
            problems.append(f"{page}: {got.page_width} px wide ({what})")
    assert not problems, f"{len(problems)} page(s) wider than a {PHONE} px phone:\n" + "\n".join(problems)


GALLERY = "gallery/index.html"


@functools.cache
def _ext(name: str) -> Any:
    """``docs/_ext/<name>.py``, imported from its path (docs/_ext is not a package)."""
    spec = importlib.util.spec_from_file_location(f"docs_ext_{name}", ROOT / "docs" / "_ext" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_outputs_wrap_long_printed_lines() -> None:
    """docs/_ext/outputs.py wraps what a page's code prints at spaces, continuations indented 2 more."""
    outputs = _ext("outputs")
    width = outputs.WIDTH
    words = " ".join(f"word{i}" for i in range(30))
    printed = f"short\n  {words}\n{'x' * 100}\n"
    lines = outputs.wrap(printed).split("\n")
    assert lines[0] == "short" and lines[-2:] == ["x" * 100, ""]  # a word is never split
    body = lines[1:-2]
    assert len(body) > 1 and all(len(line) <= width for line in body)
    assert body[0].startswith("  word0") and all(line.startswith("    word") for line in body[1:])
    assert " ".join(line.strip() for line in body) == words
