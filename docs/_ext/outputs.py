"""Fill in what a page's code prints: the ```text block right under each ```python block.

A page opts in with the marker ``<!-- outputs: NAME.py -->``: its python blocks run
in order, in one namespace, as the one script named ``NAME.py`` that they make
together (so an error's ``file:line`` names that script and a line of it, counted
over the blocks in order), with what users get by default (x64 off). The ```text block that directly follows a python
block (only blank lines between them) becomes what that block printed; a python
block not followed by one must print nothing. A printed line longer than ``WIDTH``
(what a code block shows, clear of its copy button, at 1280 px) is wrapped at spaces, its
continuation lines indented two spaces more than it, so nothing scrolls out of view.
``tests/test_docs.py`` checks that every such page is up to date.

A page whose output depends on what ran before in the process (the owner ids of
sessions, counted per process) says so in its marker,
``<!-- outputs: NAME.py in a fresh process -->``: its script then runs in a new
interpreter, as a user runs it, also when the test suite checks the page.

Usage::

    python docs/_ext/outputs.py docs/debugging-nans.md      # rewrite the page's outputs
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
import textwrap
from pathlib import Path

MARKER = re.compile(r"<!-- outputs: ([\w.-]+\.py)( in a fresh process)? -->")
BLOCK = re.compile(r"```python\n(.*?)```(\n\s*\n```text\n(.*?)```)?", re.S)
WIDTH = 77  # characters a code block shows left of its copy button at 1280 px (tests/test_docs_layout.py)


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


def fresh_process(text: str) -> bool:
    """Whether a page's marker asks for its script to run in a new interpreter."""
    m = MARKER.search(text)
    return m is not None and m.group(2) is not None


def render(path: Path) -> str:
    """``path``'s text with every output block replaced by what its python block printed now."""
    text = path.read_text()
    name = script_name(text)
    if name is None:
        raise ValueError(f"{path}: no '<!-- outputs: NAME.py -->' marker")
    if fresh_process(text):
        proc = subprocess.run(
            [sys.executable, __file__, "--print", str(path)], capture_output=True, text=True, timeout=600
        )
        if proc.returncode:
            raise AssertionError(f"{path}: its script failed in a fresh process:\n{proc.stderr}")
        return proc.stdout
    return _render_here(path, text, name)


def _render_here(path: Path, text: str, name: str) -> str:
    import jax

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
    if sys.argv[1:2] == ["--print"]:  # render's fresh process: the page's text, written to nothing
        page = Path(sys.argv[2])
        text = page.read_text()
        sys.stdout.write(_render_here(page, text, script_name(text) or ""))
        sys.exit(0)
    for arg in sys.argv[1:]:
        page = Path(arg)
        page.write_text(render(page))
        print(f"wrote {page}")
