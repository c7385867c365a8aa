"""Fill in the gallery's outputs and run times by running the examples.

Each card of docs/gallery.md that shows an example's output starts that part with a marker,
``<!-- example: NAME fingerprint: HEX -->``, followed by a ```text block (the lines of the
example's output the card shows: ``SHOW[NAME]`` picks them) and a line ``Run time: ...``
(the notebook's card has no text block, only the run time). This script runs each example as
a user does, ``python examples/NAME`` in a fresh interpreter with an empty compilation cache
(a first run, the slowest), twice: the two runs must print the same lines, and the faster one's
time is shown (on a machine shared with other work one run can be slowed several times). It
writes what the run printed, how long it took, and the fingerprint of what the run read: the
example's file and its data (``INPUTS``).

Keeping the cards true is split by cost (running every example takes minutes, more than the test
suite can spend):

- ``tests/test_gallery.py`` (every suite run, no example run): the fingerprints match the examples
  and their data now, so a changed example or corpus fails until the cards are regenerated;
- ``tests/test_examples.py`` runs the demo, the char LM, nanoGPT, the PyTorch port, the core-only
  script and the training loop as a user does (the notebook too, which shows no output), and
  compares what each printed with its card's lines (times in a line aside), within twice the run
  time its docstring states: a change in tapeflow or a dependency that changes what they print
  fails the suite;
- ``python docs/_ext/gallery.py --check gradient_penalty.py maml.py`` (a step of ``.ci/run``):
  the two examples the suite runs only shortened, whole, in the same way. Without names,
  ``--check`` reruns every example.

Usage::

    python docs/_ext/gallery.py                  # run every example, rewrite the cards
    python docs/_ext/gallery.py --check          # run every example, write nothing, fail on a stale card
    python docs/_ext/gallery.py --check maml.py  # only the named examples' cards
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
PAGE = ROOT / "docs" / "gallery.md"
# characters a code block in a gallery card shows left of its copy button at 1280 px (a card is
# narrower than the text column; tests/test_docs_layout.py checks that nothing is cut)
WIDTH = 73

# the lines of each example's output its card shows (regular expressions, matched at a line's start);
# None: the card shows no output (the notebook: its picture)
SHOW: dict[str, list[str] | None] = {
    "demo.py": [r"tapeflow \S+ on ", r"test accuracy: "],
    "char_lm.py": [r"tapeflow \S+ on ", r"step +(1|200|400) ", r"loss \S+ -> "],
    "nanogpt.py": [r"loaded ", r"logits ", r"step +(0|10|29) ", r"loss \S+ -> "],
    "port_pytorch.py": [r"tapeflow \S+: ", r"max \|logit", r"step \d "],
    "gradient_penalty.py": [r"step +(0|150|300) "],
    "maml.py": [r"meta-step +(50|150|300) ", r"meta-loss \S+ -> "],
    "pure_core_jit.py": [r"loss ", r"max \|"],
    "train_loop.py": [r"Optimizer\(", r"step +(0|200) ", r"W and W_dec "],
    "quickstart.ipynb": None,
}
# what each run reads besides the example's own file
INPUTS: dict[str, list[str]] = {
    "char_lm.py": ["examples/data/docs_corpus.txt.gz"],
    "nanogpt.py": ["examples/data/docs_corpus.txt.gz"],
}
MARKER = re.compile(r"^( *)<!-- example: (\S+) fingerprint: ([0-9a-f]+) -->$")
RUN_TIME = re.compile(r"^Run time: about (\d+(?:\.\d+)?) (s|min)\b", re.M)
# a time inside an output line ("(3.4 s)", "in 4.4 s"): it differs from run to run
TIMING = re.compile(r"\d+(?:\.\d+)? ?(?:s|ms|µs)\b")


def fingerprint(name: str) -> str:
    """sha256 (first 16 hex digits) of the example's file and the data it reads, by path and bytes."""
    h = hashlib.sha256()
    for rel in [f"examples/{name}", *INPUTS.get(name, [])]:
        h.update(rel.encode() + b"\0" + (ROOT / rel).read_bytes() + b"\0")
    return h.hexdigest()[:16]


def stated_seconds(name: str) -> float:
    """The run time ``examples/NAME`` states in its docstring (the notebook: its first cell)."""
    path = EXAMPLES / name
    if path.suffix == ".ipynb":
        intro = "".join(json.loads(path.read_text(encoding="utf-8"))["cells"][0]["source"])
    else:
        intro = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    m = RUN_TIME.search(intro)
    if m is None:
        raise SystemExit(f"examples/{name} states no run time ('Run time: about N s ...')")
    return float(m.group(1)) * (60.0 if m.group(2) == "min" else 1.0)


def shown_lines(name: str, printed: str) -> list[str]:
    """The lines of ``printed`` the card of ``name`` shows, in order."""
    patterns = [re.compile(p) for p in SHOW[name] or []]
    return [line for line in printed.splitlines() if any(p.match(line) for p in patterns)]


def without_times(line: str) -> str:
    return TIMING.sub("<time>", line)


class Run(NamedTuple):
    name: str
    printed: str
    seconds: float


def run_example(name: str) -> Run:
    """``examples/NAME`` as a user runs it, in a fresh interpreter, with an empty compilation cache."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "TAPEFLOW_CACHE_DIR": str(Path(tmp) / "cache")}
        path = EXAMPLES / name
        if path.suffix == ".ipynb":
            cmd = [sys.executable, __file__, "--run-notebook", str(path)]
        else:
            cmd = [sys.executable, str(path)]
        t0 = time.perf_counter()
        # the current folder is a scratch one: the demo saves its checkpoint under it
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
        seconds = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"examples/{name} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return Run(name, proc.stdout, seconds)


def _run_notebook(path: Path) -> None:
    """Execute the notebook as the test suite does (nbclient, a python3 kernel), every cell."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()


def wrap(lines: list[str]) -> str:
    """The lines as a card shows them: long ones wrapped as docs/_ext/outputs.py wraps a page's outputs."""
    spec = importlib.util.spec_from_file_location("docs_ext_outputs", Path(__file__).with_name("outputs.py"))
    assert spec is not None and spec.loader is not None
    outputs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(outputs)
    return outputs.wrap("\n".join(lines), WIDTH)


class Card(NamedTuple):
    """One marker of the page and what follows it: the text block's lines and the run-time line."""

    name: str
    fingerprint: str
    indent: str
    start: int  # line index of the marker
    end: int  # line index after the run-time line
    lines: list[str]  # the text block's lines, dedented
    run_time: str


def cards(text: str) -> list[Card]:
    lines = text.split("\n")
    out = []
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        if m is None:
            continue
        ind, name, fp = m.groups()
        j = i + 1
        shown: list[str] = []
        if lines[j] == f"{ind}```text":
            k = lines.index(f"{ind}```", j + 1)
            shown = [ln[len(ind) :] for ln in lines[j + 1 : k]]
            j = k + 1
            while lines[j] == "":
                j += 1
        if not lines[j].startswith(f"{ind}Run time: "):
            raise SystemExit(f"docs/gallery.md: the card of {name} has no 'Run time:' line after its output")
        out.append(Card(name, fp, ind, i, j + 1, shown, lines[j][len(ind) :]))
    return out


def run_time_line(name: str, seconds: float) -> str:
    what = "every cell and the kernel's start; its first cell says" if name.endswith(".ipynb") else "the docstring says"
    return f"Run time: {round(seconds)} s measured ({what} about {stated_seconds(name):g} s)."


def render(text: str, runs: dict[str, Run]) -> str:
    """``text`` (docs/gallery.md) with each card's output, run time and fingerprint from ``runs``."""
    lines = text.split("\n")
    for card in reversed(cards(text)):
        run = runs[card.name]
        ind = card.indent
        block = [f"{ind}<!-- example: {card.name} fingerprint: {fingerprint(card.name)} -->"]
        if SHOW[card.name] is not None:
            shown = wrap(shown_lines(card.name, run.printed)).split("\n")
            block += [f"{ind}```text", *(f"{ind}{ln}" if ln else "" for ln in shown), f"{ind}```", ""]
        block.append(ind + run_time_line(card.name, run.seconds))
        lines[card.start : card.end] = block
    return "\n".join(lines)


def card_differs(text: str, name: str, printed: str) -> str | None:
    """How the card of ``name`` in ``text`` differs from the lines ``printed`` gives it (times aside), or None."""
    card = next(c for c in cards(text) if c.name == name)
    want = [without_times(ln) for ln in wrap(shown_lines(name, printed)).split("\n")]
    got = [without_times(ln) for ln in card.lines]
    if got == want:
        return None
    return f"{name}: the card shows\n  " + "\n  ".join(got) + "\na run prints\n  " + "\n  ".join(want)


def stale(text: str, runs: dict[str, Run], names: list[str] | None = None) -> list[str]:
    """What the page shows that the runs no longer print, and runs slower than twice the stated time.

    ``names``: only those examples' cards (default: every card).
    """
    problems = []
    for card in cards(text):
        if names is not None and card.name not in names:
            continue
        run = runs[card.name]
        if SHOW[card.name] is not None and (differs := card_differs(text, card.name, run.printed)):
            problems.append(differs)
        limit = 2 * stated_seconds(card.name)
        if run.seconds > limit:
            problems.append(
                f"{card.name}: a run took {run.seconds:.0f} s, more than twice the {limit / 2:g} s it states"
            )
    return problems


def main(argv: list[str]) -> int:
    if argv[:1] == ["--run-notebook"]:
        _run_notebook(Path(argv[1]))
        return 0
    text = PAGE.read_text()
    names = [c.name for c in cards(text)]
    check = "--check" in argv
    chosen = [a for a in argv if not a.startswith("--")]
    if chosen:
        if not check:
            raise SystemExit("naming examples is for --check: rewriting the page runs every example")
        if unknown := sorted(set(chosen) - set(names)):
            raise SystemExit(f"no card for {unknown} in docs/gallery.md (cards: {names})")
        names = [n for n in names if n in chosen]
    runs = {}
    for name in names:
        runs[name] = run_example(name)
        if not check:  # a second run: the same lines, and the faster time
            again = run_example(name)
            first = [without_times(ln) for ln in shown_lines(name, runs[name].printed)]
            if first != [without_times(ln) for ln in shown_lines(name, again.printed)]:
                raise SystemExit(f"examples/{name} printed other lines in a second run: its card cannot show one")
            runs[name] = min(runs[name], again, key=lambda r: r.seconds)
        print(f"{name}: {runs[name].seconds:.1f} s (states about {stated_seconds(name):g} s)", flush=True)
    if check:
        problems = stale(text, runs, names)
        for p in problems:
            print(p)
        return 1 if problems else 0
    slow = [n for n, r in runs.items() if r.seconds > 2 * stated_seconds(n)]
    if slow:
        print(f"slower than twice their stated run time: {slow}; state an honest time in their docstrings")
        return 1
    PAGE.write_text(render(text, runs))
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
