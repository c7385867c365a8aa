"""Fill in what a page's code prints: the ```text block right under each ```python block.

A page opts in with the marker ``<!-- outputs: NAME.py -->``: its python blocks run
in order, in one namespace, as the one script named ``NAME.py`` that they make
together (so an error's ``file:line`` names that script and a line of it, counted
over the blocks in order), with what users get by default (x64 off). The ```text block that directly follows a python
block (only blank lines between them) becomes what that block printed; a python
block not followed by one must print nothing. A printed line longer than ``WIDTH``
(what a code block shows at the theme's default width) is wrapped at spaces, its
continuation lines indented two spaces more than it, so nothing scrolls out of view.
``tests/test_docs.py`` checks that every such page is up to date.

Usage::

    python docs/_ext/outputs.py docs/debugging-nans.md      # rewrite the page's outputs
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import textwrap
from pathlib import Path

MARKER = re.compile(r"<!-- outputs: ([\w.-]+\.py) -->")
BLOCK = re.compile(r"```python\n(.*?)```(\n\s*\n```text\n(.*?)```)?", re.S)
WIDTH = 88  # characters of a code block line the text column shows (tests/test_docs_layout.py)


def wrap(printed: str, width: int = WIDTH) -> str:
    """``printed`` with each line longer than ``width`` broken at spaces, continuations indented 2 more.

    A word longer than a line is left whole (never split mid-word).
    """
    lines = []
    for line in printed.split("\n"):
        if len(line) <= width:
            lines.append(line)
            continue
        indent = line[: len(line) - len(line.lstrip())]
        lines += textwrap.wrap(
            line.lstrip(),
            width,
            initial_indent=indent,
            subsequent_indent=indent + "  ",
            break_long_words=False,
            break_on_hyphens=False,
        )
    return "\n".join(lines)


def script_name(text: str) -> str | None:
    """The script name a page's marker gives its code, or None when the page has no marker."""
    m = MARKER.search(text)
    return None if m is None else m.group(1)


def render(path: Path) -> str:
    """``path``'s text with every output block replaced by what its python block printed now."""
    import jax

    text = path.read_text()
    name = script_name(text)
    if name is None:
        raise ValueError(f"{path}: no '<!-- outputs: NAME.py -->' marker")
    ns: dict[str, object] = {"__name__": "__main__"}
    pieces: list[str] = []
    last = 0
    offset = 0  # lines of the blocks before this one: the script is the blocks one after another
    with jax.enable_x64(False):
        for m in BLOCK.finditer(text):
            code = m.group(1)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile("\n" * offset + code, name, "exec"), ns)
            offset += code.count("\n")
            printed = out.getvalue()
            if m.group(2) is None:
                if printed:
                    raise AssertionError(f"{path}: a block printed {printed!r} but has no ```text block under it")
                continue
            start = m.start(3)
            pieces.append(text[last:start])
            pieces.append(wrap(printed))
            last = m.end(3)
    pieces.append(text[last:])
    return "".join(pieces)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        page = Path(arg)
        page.write_text(render(page))
        print(f"wrote {page}")
