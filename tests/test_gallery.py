"""The gallery shows what the examples print now: docs/_ext/gallery.py's cards against the examples.

Each card's fingerprint is that of its example and the data it reads now (a changed example or
corpus makes its card stale until ``python docs/_ext/gallery.py`` runs it again).
``tests/test_examples.py`` compares the cards of the examples it runs whole with what they printed
there, and ``.ci/run`` runs the others whole (``python docs/_ext/gallery.py --check NAME ...``):
every card with output is compared with a fresh run of its example, which this module checks.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def gallery() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_ext_gallery", ROOT / "docs" / "_ext" / "gallery.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_example_has_a_card_with_its_current_fingerprint() -> None:
    g = gallery()
    cards = g.cards(g.PAGE.read_text())
    examples = sorted(p.name for p in (ROOT / "examples").iterdir() if p.suffix in (".py", ".ipynb"))
    assert sorted(c.name for c in cards) == examples, "one card per example in docs/gallery.md"
    assert set(g.SHOW) == set(examples), "docs/_ext/gallery.py says which lines each example's card shows"
    stale = [c.name for c in cards if c.fingerprint != g.fingerprint(c.name)]
    assert not stale, (
        f"examples changed since docs/gallery.md showed their output: {stale}; "
        "run python docs/_ext/gallery.py (it runs every example, a few minutes)"
    )
    for c in cards:
        assert (g.SHOW[c.name] is None) == (not c.lines), f"{c.name}: a card shows output exactly when SHOW picks lines"
        assert all(len(line) <= g.WIDTH for line in c.lines), f"{c.name}: a line wider than a card shows"


def test_every_card_with_output_is_compared_with_a_fresh_run() -> None:
    """Each card that shows output is checked by tests/test_examples.py's runs or by .ci/run's step."""
    g = gallery()
    shown = {c.name for c in g.cards(g.PAGE.read_text()) if g.SHOW[c.name] is not None}
    source = (ROOT / "tests" / "test_examples.py").read_text()
    in_suite = set(re.findall(r'_check_gallery_card\("([^"]+)"', source))
    scripts = re.search(r'parametrize\("script", \[([^]]*)\]\)\ndef test_script_runs', source)
    assert scripts and "_check_gallery_card(script, " in source, "test_script_runs checks the cards of its scripts"
    in_suite |= set(re.findall(r'"([^"]+)"', scripts[1]))
    steps = [
        shlex.split(line)
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.startswith("python docs/_ext/gallery.py --check")
    ]
    assert len(steps) == 1, ".ci/run runs docs/_ext/gallery.py --check once"
    in_ci = set(steps[0][3:])
    assert in_ci, ".ci/run names the examples it checks (the suite runs the others)"
    assert shown <= in_suite | in_ci, f"cards no run compares: {sorted(shown - in_suite - in_ci)}"
    assert not in_suite & in_ci, f"run twice: {sorted(in_suite & in_ci)}"


def test_a_changed_input_changes_the_fingerprint(tmp_path: Path, monkeypatch) -> None:
    g = gallery()
    (tmp_path / "examples" / "data").mkdir(parents=True)
    (tmp_path / "examples" / "char_lm.py").write_text("print(1)\n")
    (tmp_path / "examples" / "data" / "docs_corpus.txt.gz").write_bytes(b"a")
    monkeypatch.setattr(g, "ROOT", tmp_path)
    before = g.fingerprint("char_lm.py")
    (tmp_path / "examples" / "data" / "docs_corpus.txt.gz").write_bytes(b"b")  # the data it reads
    after_data = g.fingerprint("char_lm.py")
    (tmp_path / "examples" / "char_lm.py").write_text("print(2)\n")  # the example itself
    assert len({before, after_data, g.fingerprint("char_lm.py")}) == 3


PAGE = """intro

-   **An example**

    <!-- example: maml.py fingerprint: 00 -->
    ```text
    meta-step   50  meta-loss 3.5704
    meta-loss 3.5704 -> 1.7840; 20.4 s
    ```

    Run time: 24 s measured (the docstring says about 25 s).

-   **The notebook**

    <!-- example: quickstart.ipynb fingerprint: 00 -->
    Run time: 30 s measured (every cell and the kernel's start; its first cell says about 30 s).
"""


def test_cards_are_rewritten_from_a_run_and_compared_without_times() -> None:
    g = gallery()
    printed = "meta-step   50  meta-loss 3.5704\nmeta-step  100  meta-loss 2.9\nmeta-loss 3.5704 -> 1.7840; 18.9 s\n"
    runs = {"maml.py": g.Run("maml.py", printed, 21.4), "quickstart.ipynb": g.Run("quickstart.ipynb", "", 31.6)}
    # the page's lines, with another time in the last one: not stale
    assert g.card_differs(PAGE, "maml.py", printed) is None
    assert g.stale(PAGE, runs) == []
    # another loss is
    differs = g.card_differs(PAGE, "maml.py", printed.replace("1.7840", "1.7841"))
    assert differs and "meta-loss 3.5704 -> 1.7841" in differs
    # slower than twice the stated 25 s is
    slow = {**runs, "maml.py": g.Run("maml.py", printed, 51.0)}
    assert any("more than twice the 25 s" in p for p in g.stale(PAGE, slow))
    # --check NAME compares only that card: the notebook, not run, is not looked up
    assert g.stale(PAGE, {"maml.py": slow["maml.py"]}, ["maml.py"]) == g.stale(PAGE, slow)
    out = g.render(PAGE, runs)
    assert f"<!-- example: maml.py fingerprint: {g.fingerprint('maml.py')} -->" in out
    assert "    meta-step   50  meta-loss 3.5704\n    meta-loss 3.5704 -> 1.7840; 18.9 s\n    ```" in out
    assert "meta-step  100" not in out  # not a line the card shows
    assert "    Run time: 21 s measured (the docstring says about 25 s)." in out
    assert "    Run time: 32 s measured (every cell and the kernel's start; its first cell says about 30 s)." in out
    assert g.render(out, runs) == out and out.startswith("intro\n")
