"""Draw the pictures of the docs: ``python docs/_ext/figures.py``.

Writes, under docs/images/:

* ``tape_fork.dot`` / ``.svg``: a pure tape in which one value feeds two ops
  (``Tape.to_dot`` as it is, but for the font: see ``_courier``);
* ``tied_param.dot`` / ``.svg``: a session tape in which one tied Param is used
  twice (``x @ W``, then ``h @ W_dec.T``), with the storage both leaves read
  from added to the DOT text here (``to_dot`` draws the tape, which holds
  leaves, not storages);
* ``timeline.svg``: a session's generations (matplotlib): recording, a reset
  that bumps the generation, an old handle rejected as stale, and a second
  session with an owner id of its own. The error texts are the real ones.

The DOT files and SVGs are committed; tests/test_docs.py checks that the DOT
text this script builds equals the committed files and that their SVGs are
its rendering. The SVGs come from ``graphviz-pure -Tsvg`` (a dev dependency)
and from matplotlib with a fixed hash salt and no date, so a rerun rewrites
identical files.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

import tapeflow as tfl

IMAGES = Path(__file__).resolve().parents[1] / "images"
F32 = jnp.float32


def _courier(dot: str) -> str:
    """graphviz-pure sizes boxes from font metrics it has for Courier but not for the generic "monospace"."""
    return dot.replace('fontname="monospace"', 'fontname="Courier"')


def fork_dot() -> str:
    """A tape where ``x`` is used by two ops, ``exp`` and ``sin``: backward sums both cotangents into ``x``."""
    t = tfl.Tape.empty()
    t, x = tfl.leaf(t, jnp.array([0.5, 1.0, 2.0], F32), requires_grad=True)
    t, a = tfl.record(t, "exp", (x,))
    t, b = tfl.record(t, "sin", (x,))
    t, m = tfl.record(t, "mul", (a.unwrap(), b.unwrap()))
    t, y = tfl.record(t, "sum", (m.unwrap(),))
    y.unwrap()
    return _courier(t.to_dot()) + "\n"


def tied_dot() -> str:
    """A tied autoencoder step (``x @ W``, then ``h @ W_dec.T`` with ``W_dec = tie(W)``) plus W's storage."""
    W = tfl.Param(jnp.full((4, 2), 0.1, F32), name="W")
    W_dec = tfl.tie(W, name="W_dec")
    with tfl.Session(seed=0) as s:
        x = s.input(np.ones((3, 4), np.float32))
        h = tfl.tanh(x @ W)
        tfl.mse(h @ W_dec.T, x)
        (group,) = s.parameter_groups()  # one storage, so one group: its leaves are the two uses
        dot = s.tape.to_dot()
    lines = _courier(dot).splitlines()
    for leaf_id, name in zip(group.leaves, ["W", "W_dec"]):
        lines = [
            ln.replace(f'n{leaf_id} [label="#{leaf_id} leaf', f'n{leaf_id} [label="#{leaf_id} leaf {name}')
            for ln in lines
        ]
    storage = [
        '  storage [label="W storage", shape=cylinder, style=filled, fillcolor="#fde7d9"];',
        *(
            f'  storage -> n{leaf_id} [dir=back, style=dashed, color="#c2410c", label="cotangents summed", fontname="Helvetica", fontsize=11];'
            for leaf_id in group.leaves
        ),
    ]
    assert lines[-1] == "}"
    return "\n".join(lines[:-1] + storage + ["}"]) + "\n"


def render_svg(dot_text: str) -> str:
    """SVG text from ``graphviz-pure -Tsvg`` (the dev dependency's ``dot``)."""
    exe = Path(sys.executable).parent / "graphviz-pure"
    proc = subprocess.run(
        [str(exe) if exe.exists() else "graphviz-pure", "-Tsvg"],
        input=dot_text,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return proc.stdout


def timeline_events() -> dict[str, Any]:
    """Run the story of the timeline and keep what it shows: generations, owner ids, error texts."""
    a = tfl.Session()
    x = a.input(np.ones(3, np.float32))
    tfl.relu(x)
    gen_before = a.generation
    a.reset()
    try:
        tfl.relu(x)
        raise AssertionError("a stale handle was accepted")
    except tfl.TapeError as e:
        stale = str(e).split(" (", 1)[0]
    b = tfl.Session()
    y = b.input(np.ones(3, np.float32))
    try:
        tfl.add(y, a.input(np.ones(3, np.float32)))
        raise AssertionError("handles of two sessions were mixed")
    except tfl.TapeError as e:
        foreign = str(e).split(" (", 1)[0]
    # owner ids are process-wide counters: show them as numbered in a fresh process (1 and 2)
    return {
        "owners": (1, 1 + b.owner - a.owner),
        "generations": (gen_before, a.generation, b.generation),
        "stale": stale,
        "foreign": foreign,
    }


def timeline_svg(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev = timeline_events()
    (own_a, own_b), (g0, g1, gb) = ev["owners"], ev["generations"]
    plt.rcParams.update({"svg.hashsalt": "tapeflow-timeline", "svg.fonttype": "none", "font.size": 9})
    fig, ax = plt.subplots(figsize=(9.0, 3.4))
    A, B, h = 1.0, 0.0, 0.3  # lane heights, bar thickness
    blue, teal, red = "#3b5bdb", "#0c8599", "#c92a2a"
    ax.broken_barh([(0.0, 4.0)], (A - h / 2, h), facecolors="#dbe4ff", edgecolors=blue)
    ax.broken_barh([(4.0, 7.0)], (A - h / 2, h), facecolors="#edf2ff", edgecolors=blue)
    ax.broken_barh([(5.0, 6.0)], (B - h / 2, h), facecolors="#e3fafc", edgecolors=teal)
    ax.text(2.6, A, f"generation {g0}", ha="center", va="center", color=blue)
    ax.text(9.6, A, f"generation {g1}", ha="center", va="center", color=blue)
    ax.text(7.2, B, f"generation {gb}", ha="center", va="center", color=teal)

    def event(t: float, lane: float, text: str, color: str, dy: float, marker: str = "o") -> None:
        ax.plot([t], [lane], marker=marker, color=color, markersize=7, zorder=3)
        ax.annotate(text, (t, lane), (t, lane + dy), ha="center", va="center", color=color, fontsize=8)

    stale = ev["stale"].replace("; ", ";\n")
    event(0.0, A, "a = tfl.Session()", blue, 0.38)
    event(1.2, A, f"x = a.input(...)\nhandle: owner {own_a}, generation {g0}", blue, -0.4)
    event(4.0, A, "a.reset()\ngeneration + 1", blue, 0.42, marker="D")
    event(7.2, A, f"tfl.relu(x) raises TapeError:\n{stale}", red, 0.5, marker="X")
    event(5.0, B, f"b = tfl.Session()\nits own owner id: {own_b}", teal, -0.4)
    event(9.3, B, f"tfl.add(y, handle of a) raises TapeError:\n{ev['foreign']}", red, -0.4, marker="X")
    ax.set_yticks([A, B], [f"session a\nowner {own_a}", f"session b\nowner {own_b}"])
    ax.tick_params(left=False)
    ax.set_xticks([])
    ax.set_xlim(-1.2, 12.0)
    ax.set_ylim(-0.75, 1.85)
    ax.set_xlabel("time")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)


def main() -> None:
    IMAGES.mkdir(exist_ok=True)
    written = []
    for name, text in [("tape_fork", fork_dot()), ("tied_param", tied_dot())]:
        (IMAGES / f"{name}.dot").write_text(text)
        (IMAGES / f"{name}.svg").write_text(render_svg(text))
        written += [f"{name}.dot", f"{name}.svg"]
    timeline_svg(IMAGES / "timeline.svg")
    print(f"wrote {', '.join([*written, 'timeline.svg'])} in {IMAGES}")


if __name__ == "__main__":
    main()
