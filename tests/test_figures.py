"""Every picture the docs show is readable at page width, and the tape pictures are the library's own.

Readability rule (``MIN_TEXT_PX``): mkdocs-material's content column is about
``COLUMN_PX`` = 690 CSS px wide, and an image wider than that is shrunk to it.
An SVG of width ``W`` (its ``width`` attribute in CSS px: ``pt`` times 4/3) and
viewBox width ``V`` is drawn ``min(COLUMN_PX, W)`` px wide, so a text of font
size ``f`` user units is seen at ``f * min(COLUMN_PX, W) / V`` px (times any
``scale(...)`` of the ``transform``s above it). Every text of every SVG that a
page of docs/ references must be seen at >= 12 px: the body text is 16 px
(0.8rem at mkdocs-material's 20px root) and 12 px is the smallest caption size
that is still comfortably read; the charts and tape figures aim at >= 14 px.

Font sizes are read as matplotlib and graphviz write them: a ``font-size``
attribute, a ``style="font-size: 9px"`` or ``style="font: 9px 'DejaVu Sans'"``,
on the ``<text>`` itself or inherited from an enclosing ``<g>`` (SVG's
default is 16).
"""

from __future__ import annotations

import math
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
COLUMN_PX = 690.0
MIN_TEXT_PX = 12.0
SVG_DEFAULT_FONT = 16.0
_UNIT_PX = {"": 1.0, "px": 1.0, "pt": 4 / 3, "in": 96.0, "cm": 96 / 2.54, "mm": 9.6 / 2.54}
_LENGTH = re.compile(r"^\s*([0-9.]+)\s*([a-z]*)\s*$")
_IMG = re.compile(r"\]\((images/[^)\s]+\.svg)\)|src=\"(images/[^\"]+\.svg)\"")


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _length_px(text: str) -> float:
    m = _LENGTH.match(text)
    if m is None or m.group(2) not in _UNIT_PX:
        raise ValueError(f"cannot read the SVG length {text!r}")
    return float(m.group(1)) * _UNIT_PX[m.group(2)]


def _font_size(el: ET.Element) -> float | None:
    """The font size ``el`` sets itself (attribute or style), in user units; None when it sets none."""
    style = el.get("style", "")
    m = re.search(r"font-size\s*:\s*([0-9.]+)\s*(px|pt)?", style)
    if m is None:
        m = re.search(r"(?:^|;)\s*font\s*:[^;]*?([0-9.]+)\s*(px|pt)", style)
    if m is not None:
        return float(m.group(1)) * (4 / 3 if m.group(2) == "pt" else 1.0)
    attr = el.get("font-size")
    return None if attr is None else _length_px(attr)


def _scale(el: ET.Element) -> float:
    """The linear scale of ``el``'s ``transform`` (scale() and matrix(); translations and rotations keep size)."""
    s = 1.0
    for kind, args in re.findall(r"(scale|matrix)\(([^)]*)\)", el.get("transform", "")):
        v = [float(a) for a in re.split(r"[\s,]+", args.strip()) if a]
        if kind == "scale":
            s *= math.sqrt(abs(v[0] * (v[1] if len(v) > 1 else v[0])))
        else:
            s *= math.sqrt(abs(v[0] * v[3] - v[1] * v[2]))
    return s


def text_sizes(svg_text: str, column_px: float = COLUMN_PX) -> list[tuple[float, str]]:
    """``(rendered px, text)`` of every text of an SVG shown in a ``column_px`` wide column."""
    root = ET.fromstring(svg_text)
    vb = root.get("viewBox")
    width_px = _length_px(root.get("width", "") or (vb.split()[2] if vb else "0"))
    vb_width = float(re.split(r"[\s,]+", vb.strip())[2]) if vb else width_px
    page = min(column_px, width_px) / vb_width
    out: list[tuple[float, str]] = []

    def walk(el: ET.Element, font: float, scale: float) -> None:
        font = _font_size(el) or font
        scale *= _scale(el)
        if _local(el.tag) == "text":
            spans = [c for c in el if _local(c.tag) == "tspan"]
            if spans:  # matplotlib's mathtext: each character a tspan with its own size
                for c in spans:
                    words = "".join(c.itertext()).strip()
                    if words:
                        out.append(((_font_size(c) or font) * scale * page, words))
                return
            words = "".join(el.itertext()).strip()
            if words:
                out.append((font * scale * page, words))
            return
        for child in el:
            walk(child, font, scale)

    walk(root, SVG_DEFAULT_FONT, 1.0)
    return out


def referenced_svgs() -> list[Path]:
    found = set()
    for page in DOCS.glob("*.md"):
        for a, b in _IMG.findall(page.read_text()):
            found.add(DOCS / (a or b))
    return sorted(found)


def test_the_docs_reference_every_picture() -> None:
    svgs = referenced_svgs()
    names = {p.name for p in svgs}
    assert {"perf_train.svg", "perf_per_op.svg", "tape_fork.svg", "tied_param.svg", "timeline.svg"} <= names
    for p in svgs:
        assert p.is_file(), f"{p.relative_to(ROOT)} is referenced but missing"


@pytest.mark.parametrize("svg", referenced_svgs(), ids=lambda p: p.name)
def test_every_text_is_readable_at_page_width(svg: Path) -> None:
    sizes = text_sizes(svg.read_text())
    assert sizes, f"{svg.name}: no text found"
    small = sorted({(round(px, 1), t[:40]) for px, t in sizes if px < MIN_TEXT_PX})
    assert not small, f"{svg.name}: texts seen below {MIN_TEXT_PX} px at page width: {small[:8]}"


def test_text_sizes_reads_matplotlib_and_graphviz_fonts() -> None:
    mpl = (
        '<svg width="504pt" height="100pt" viewBox="0 0 504 100" xmlns="http://www.w3.org/2000/svg">'
        '<g style="font-size: 9px"><text>a</text></g>'
        "<text style=\"font: 12px 'DejaVu Sans'\">b</text>"
        '<text><tspan style="font-size: 11px">1</tspan><tspan style="font-size: 7.7px">2</tspan></text></svg>'
    )
    got = [(round(px, 2), t) for px, t in text_sizes(mpl)]
    assert got == [(12.0, "a"), (16.0, "b"), (14.67, "1"), (10.27, "2")]
    wide = (
        '<svg width="1035pt" height="10pt" viewBox="0.00 0.00 1035.00 10.00" xmlns="http://www.w3.org/2000/svg">'
        '<g transform="scale(1 1) rotate(0) translate(4 5)"><text font-size="14.00">c</text></g></svg>'
    )
    ((px, _),) = text_sizes(wide)
    assert px == pytest.approx(14 * 690 / 1035)


def _figures():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import figures
    finally:
        sys.path.pop(0)
    return figures


def test_the_tape_figures_are_the_librarys_own_pictures() -> None:
    """figures.py draws Session.to_dot(): names, the storage and its tied leaves come from the library."""
    figures = _figures()
    dot = figures.tied_dot()
    assert "leaf W (tied)" in dot and "leaf W_dec (tied)" in dot
    assert '[label="W storage", shape=cylinder' in dot and dot.count('label="cotangents summed"') == 2


def test_the_getting_started_figure_is_the_tape_its_code_records() -> None:
    figures = _figures()
    images = DOCS / "images"
    dot = figures.getting_started_dot()
    assert (images / "getting_started_tape.dot").read_text() == dot, "stale: run python docs/_ext/figures.py"
    assert (images / "getting_started_tape.svg").read_text() == figures.render_svg(dot)
    page = (DOCS / "getting-started.md").read_text()
    assert "images/getting_started_tape.svg" in page
    for what in ("leaf W (tied)", "leaf W_dec (tied)", "leaf b_enc", "leaf b_dec", "sigmoid", "float32[64,16]"):
        assert what in dot, what
