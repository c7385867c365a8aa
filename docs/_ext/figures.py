"""Draw the pictures of the docs: ``python docs/_ext/figures.py``.

Writes, under docs/images/:

* ``tape_fork.dot`` / ``.svg``: a pure tape in which one value feeds two ops
  (``Tape.to_dot`` as it is);
* ``tied_param.dot`` / ``.svg``: a session tape in which one tied Param is used
  twice (``x @ W``, then ``h @ W_dec.T``): ``Session.to_dot``, which names the
  Param leaves and draws the storage both read;
* ``getting_started_tape.dot`` / ``.svg``: the tape of the eager step of
  docs/getting-started.md, recorded by running that page's own code blocks
  (``Session.to_dot`` of the very session the page's ``loss_fn`` records on);
* ``scaling_fsdp.dot`` / ``.svg``: where each storage of docs/scaling.md's model
  lives under ``"fsdp"`` on eight simulated devices (``tfl.placement_dot``, in a
  subprocess with eight CPU devices);
* ``timeline.svg``: a session's generations (matplotlib): recording, a reset
  that bumps the generation, an old handle rejected as stale, and a second
  session with an owner id of its own. The error texts are the real ones.

Every tape picture is the library's DOT text with one house style
(``_style``): the Courier font graphviz-pure has metrics for, top-to-bottom
ranks so that a tape fits the page column, and the library's 14 pt font, so
all three share one scale (tests/test_figures.py checks every text is seen
at >= 12 px at page width). The timeline is drawn 6.9 in wide (the page
column) with 11 pt text.

The DOT files and SVGs are committed; tests/test_docs.py and
tests/test_figures.py check that the DOT text this script builds equals the
committed files and that their SVGs are its rendering. The SVGs come from
``graphviz-pure -Tsvg`` (a dev dependency) and from matplotlib with a fixed
hash salt and no date, so a rerun rewrites identical files.
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import tapeflow as tfl

DOCS = Path(__file__).resolve().parents[1]
IMAGES = DOCS / "images"
F32 = jnp.float32


def _style(dot: str) -> str:
    """The house style of the docs' tape pictures, on the library's DOT text.

    graphviz-pure sizes boxes from font metrics it has for Courier but not for
    the generic "monospace"; ranks run top to bottom so a tape fits the page.
    """
    return dot.replace('fontname="monospace"', 'fontname="Courier"').replace("rankdir=LR;", "rankdir=TB;") + "\n"


def fork_dot() -> str:
    """A tape where ``x`` is used by two ops, ``exp`` and ``sin``: backward sums both cotangents into ``x``."""
    t = tfl.Tape.empty()
    t, x = tfl.leaf(t, jnp.array([0.5, 1.0, 2.0], F32), requires_grad=True)
    t, a = tfl.record(t, "exp", (x,))
    t, b = tfl.record(t, "sin", (x,))
    t, m = tfl.record(t, "mul", (a.unwrap(), b.unwrap()))
    t, y = tfl.record(t, "sum", (m.unwrap(),))
    y.unwrap()
    return _style(t.to_dot())


def tied_dot() -> str:
    """A tied autoencoder step (``x @ W``, then ``h @ W_dec.T`` with ``W_dec = tie(W)``), as ``Session.to_dot`` draws it."""
    W = tfl.Param(jnp.full((4, 2), 0.1, F32), name="W")
    W_dec = tfl.tie(W, name="W_dec")
    with tfl.Session(seed=0) as s:
        x = s.input(np.ones((3, 4), np.float32))
        h = tfl.tanh(x @ W)
        tfl.mse(h @ W_dec.T, x)
        dot = s.to_dot()
    return _style(dot)


def page_code(page: Path, blocks: int) -> str:
    """The first ``blocks`` ```` ```python ```` blocks of a docs page, joined."""
    found = re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)
    if len(found) < blocks:
        raise SystemExit(f"{page}: expected at least {blocks} python blocks, found {len(found)}")
    return "\n".join(found[:blocks])


def getting_started_dot() -> str:
    """The tape of docs/getting-started.md's eager step, recorded by the page's own code.

    The page's first three blocks (the data, the Params, ``loss_fn``) run as
    written; then the step's recording, ``loss_fn(s, x_all[:32])`` in a
    ``tfl.Session(seed=0)`` as the page's fourth block opens it, is drawn.
    """
    ns: dict[str, Any] = {}
    # the page runs as a user runs it: JAX's default float32 (the test suite turns x64 on)
    with jax.enable_x64(False), contextlib.redirect_stdout(io.StringIO()):
        exec(compile(page_code(DOCS / "getting-started.md", 3), "getting-started.md", "exec"), ns)
        with tfl.Session(seed=0) as s:
            ns["loss_fn"](s, ns["x_all"][:32])
            dot = s.to_dot()
    return _style(dot)


SCALING_DEVICES = 8  # the devices docs/scaling.md's picture shows (simulated CPU devices)


def scaling_dot() -> str:
    """Where each storage of docs/scaling.md's model lives under ``"fsdp"``: ``tfl.placement_dot``, as the page places it.

    Runs the page's first code block (which builds ``model``) and the one that
    calls ``tfl.shard(model, mesh)`` (the blocks between them train, which the
    placement does not depend on), in a process with ``SCALING_DEVICES``
    devices (:func:`scaling_dot_in_subprocess` starts one;
    ``tests/test_shard.py`` calls this in its own 8-device process).
    """
    if len(jax.devices()) != SCALING_DEVICES:
        raise SystemExit(f"scaling_dot needs {SCALING_DEVICES} devices, this process has {len(jax.devices())}")
    page = DOCS / "scaling.md"
    blocks = re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)
    upto = next(i for i, b in enumerate(blocks) if "tfl.shard(model, mesh)" in b)
    ns: dict[str, Any] = {}
    with jax.enable_x64(False), contextlib.redirect_stdout(io.StringIO()):
        exec(compile(blocks[0] + "\n" + blocks[upto], "scaling.md", "exec"), ns)
    return _style(tfl.placement_dot(ns["model"]))


def scaling_dot_in_subprocess() -> str:
    """:func:`scaling_dot`, run in a fresh process that simulates ``SCALING_DEVICES`` CPU devices."""
    env = {
        **__import__("os").environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={SCALING_DEVICES}",
        "JAX_PLATFORMS": "cpu",
    }
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import figures; print(figures.scaling_dot(), end='')"
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=600
    ).stdout


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
    plt.rcParams.update({"svg.hashsalt": "tapeflow-timeline", "svg.fonttype": "none", "font.size": 11})
    fig, ax = plt.subplots(figsize=(6.9, 4.6))
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
        ax.annotate(text, (t, lane), (t, lane + dy), ha="center", va="center", color=color, fontsize=10.5)

    stale = ev["stale"].replace("; ", ";\n")
    foreign = textwrap.fill(ev["foreign"], 26)
    event(0.0, A, "a = tfl.Session()", blue, 0.42)
    event(1.2, A, f"x = a.input(...)\nhandle: owner {own_a},\ngeneration {g0}", blue, -0.52)
    event(4.0, A, "a.reset()\ngeneration + 1", blue, 0.45, marker="D")
    event(7.2, A, f"tfl.relu(x) raises TapeError:\n{stale}", red, -0.52, marker="X")
    event(5.0, B, f"b = tfl.Session()\nits own owner id: {own_b}", teal, -0.45)
    event(9.3, B, f"tfl.add(y, handle of a)\nraises TapeError:\n{foreign}", red, -0.62, marker="X")
    ax.set_yticks([A, B], [f"session a\nowner {own_a}", f"session b\nowner {own_b}"])
    ax.tick_params(left=False)
    ax.set_xticks([])
    ax.set_xlim(-1.2, 12.2)
    ax.set_ylim(-1.05, 1.75)
    ax.set_xlabel("time")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)


def main() -> None:
    IMAGES.mkdir(exist_ok=True)
    written = []
    for name, text in [
        ("tape_fork", fork_dot()),
        ("tied_param", tied_dot()),
        ("getting_started_tape", getting_started_dot()),
        ("scaling_fsdp", scaling_dot_in_subprocess()),
    ]:
        (IMAGES / f"{name}.dot").write_text(text)
        (IMAGES / f"{name}.svg").write_text(render_svg(text))
        written += [f"{name}.dot", f"{name}.svg"]
    timeline_svg(IMAGES / "timeline.svg")
    print(f"wrote {', '.join([*written, 'timeline.svg'])} in {IMAGES}")


if __name__ == "__main__":
    main()
