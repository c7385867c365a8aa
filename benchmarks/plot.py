"""Charts and tables from the benchmark scripts' ``--json`` results.

Reads one or more results files (written by ``bench_*.py --json PATH``) and

* renders SVG charts into ``--out-dir`` (deterministic: the same JSON gives the
  same bytes), drawn for the docs' page column: 7 in wide, horizontal bars
  grouped under each model's or op's name, every text >= 10.5 pt (>= 14 px on
  the page; ``tests/test_figures.py`` checks it):

  - ``perf_train.svg``: time per training step of each model, one bar per
    variant found in the ``train`` section (``eager``, ``train_step``,
    ``pytorch``, ``jax_unjitted``, and any other, e.g. ``lazy``), each labelled
    with its ratio to PyTorch eager (or to ``eager`` when PyTorch is missing);
  - ``perf_per_op.svg``: time per recorded op (``per_op`` from bench_core.py,
    ``session_per_op`` from bench_session.py) against the same op as a plain
    ``jax.jit`` call, and the difference: the tape's Python overhead per op;

* with ``--markdown PAGE``, rewrites the part of PAGE between
  ``<!-- perf-table:start -->`` and ``<!-- perf-table:end -->`` with tables of
  the numbers and the machine, versions, dates and commands they come from;
* with ``--nan-guide PAGE``, the part between ``<!-- nan-cost:start -->`` and
  ``<!-- nan-cost:end -->`` with what ``debug_nans`` costs (bench_debug_nans).

Usage::

    python benchmarks/plot.py benchmarks/results/*.json --out-dir docs/images --markdown docs/performance.md \\
        --nan-guide docs/debugging-nans.md

Only matplotlib is needed (``pip install -e '.[demo]'``); JAX is not imported.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TIMES, MINUS = "\u00d7", "\u2212"  # the multiplication sign and minus sign of the labels

START = "<!-- perf-table:start -->"
END = "<!-- perf-table:end -->"
# the cost table of docs/debugging-nans.md, from bench_debug_nans's results (--nan-guide PAGE)
NAN_START = "<!-- nan-cost:start -->"
NAN_END = "<!-- nan-cost:end -->"

TRAIN_SECTION = "train"
PER_OP_SECTIONS = ("per_op", "session_per_op")
# bench_depth: time per step, and to the end of step 2 in a fresh process, of one model at several depths
DEPTH_SECTION = "depth"
DEPTH_FIRST_SECTION = "depth_first_step"
DEPTH_VARIANTS = ("pytorch", "default_loop", "default_loop_unrolled", "eager", "train_step", "hand_jit")
DEPTH_LABELS = {
    "pytorch": "PyTorch eager",
    "default_loop": "`Session()` loop",
    "default_loop_unrolled": "loop, block loops off",
    "eager": "`Session(lazy=False)`",
    "train_step": "`train_step`",
    "hand_jit": "hand-written `jax.jit`",
}
# issue 45's targets for the depth sweep (bench_depth.py prints the same verdicts)
DEPTH_TARGET_VS_TORCH = 0.8
DEPTH_TARGET_VS_TRAIN_STEP = 1.15
DEPTH_TARGET_FIRST_DEEP = 1.3  # the deepest model's time to the end of step 2 over the shallowest's
DEPTH_TARGET_FIRST_VS_JIT = 1.0

# Display names and colours of the variants the scripts write; any other variant is shown
# under its own name, in the next free colour, after these (in the order first seen).
VARIANT_ORDER = [
    "eager",
    "lazy",
    "train_step",
    "pytorch",
    "jax_unjitted",
    "jax_jit",
    "record",
    "session",
]
VARIANT_LABELS = {
    "eager": "tapeflow eager",
    "lazy": "tapeflow lazy",
    "train_step": "tfl.train_step",
    "pytorch": "PyTorch eager",
    "jax_unjitted": "JAX, not jitted",
    "jax_jit": "jax.jit call",
    "record": "tfl.record (pure core)",
    "session": "Session op",
    "hand_jit": "hand-written jax.jit",
    "nnx_jit": "nnx.jit",
    "opt_step": "opt.step",
    "lazy_record": "lazy: record one op",
    "lazy_record_replayed": "lazy: record one op (replayed step)",
    "lazy_record_fresh": "lazy: record one op (fresh recording)",
    "tape": "tape",
    "builtin": "built-in op",
    "lifted": "tfl.lift op",
    "dict_by_id": "dict keyed by id()",
    "canonical_indices": "tfl.canonical_indices",
    "eqx_jit": "eqx.filter_jit",
    "default_loop": "tfl.Session() loop",
    "default_loop_unrolled": "Session() loop, block loops off",
}
VARIANT_COLORS = {
    "eager": "#1f77b4",
    "lazy": "#9467bd",
    "train_step": "#2ca02c",
    "pytorch": "#ff7f0e",
    "jax_unjitted": "#7f7f7f",
    "jax_jit": "#7f7f7f",
    "record": "#1f77b4",
    "session": "#17becf",
}
SPARE_COLORS = ["#d62728", "#8c564b", "#e377c2", "#bcbd22", "#aec7e8", "#ffbb78", "#98df8a"]
VERSION_KEYS = ("python", "jax", "jaxlib", "optax", "numpy", "torch", "flax", "equinox", "tapeflow")


# --------------------------------------------------------------------------- loading


@dataclass(frozen=True, eq=False)
class Run:
    """One results file: its metadata and records."""

    path: Path
    benchmark: str
    machine: dict[str, Any]
    date: str
    command: list[str]
    quick: bool
    results: list[dict[str, Any]]


def load(paths: Iterable[str | Path]) -> list[Run]:
    runs = []
    for p in paths:
        path = Path(p)
        d = json.loads(path.read_text())
        for key in ("benchmark", "machine", "date", "command", "results"):
            if key not in d:
                raise SystemExit(f"{path}: not a benchmark results file (no {key!r}); write one with --json")
        runs.append(
            Run(path, d["benchmark"], d["machine"], d["date"], list(d["command"]), bool(d.get("quick")), d["results"])
        )
    return runs


@dataclass(frozen=True)
class Rec:
    run: Run
    row: dict[str, Any]

    @property
    def time_us(self) -> float | None:
        t = self.row.get("time_us")
        return None if t is None else float(t)


def collect(runs: Sequence[Run], sections: Sequence[str]) -> dict[tuple[str, str], Rec]:
    """``(model, variant) -> record`` over ``sections``, taken in that order.

    A timing found in several files (two scripts that both time ``eager``, say) is taken, per
    section and model, from the file with the most variants of that model (so that the bars of a
    model come from as few runs as possible), ties going to the file given first.
    """
    out: dict[tuple[str, str], Rec] = {}
    for section in sections:
        by_model: dict[str, list[list[Rec]]] = {}
        for run in runs:
            per_model: dict[str, list[Rec]] = {}
            for row in run.results:
                if row.get("section") == section and row.get("time_us") is not None:
                    per_model.setdefault(row["model"], []).append(Rec(run, row))
            for model, recs in per_model.items():
                by_model.setdefault(model, []).append(recs)
        for model, candidates in by_model.items():
            for recs in sorted(candidates, key=lambda rs: -len(rs)):  # stable: ties keep file order
                for rec in recs:
                    out.setdefault((model, rec.row["variant"]), rec)
    return out


def run_time(run: Run, section: str, model: str, variant: str | None) -> float | None:
    """The time of one record of one file, if it is there."""
    for row in run.results:
        if (row.get("section"), row.get("model"), row.get("variant")) == (section, model, variant):
            t = row.get("time_us")
            return None if t is None else float(t)
    return None


def baseline_time(rec: Rec) -> float | None:
    """The time of ``rec``'s baseline record, from the same file, section and model."""
    return run_time(rec.run, rec.row["section"], rec.row["model"], rec.row.get("baseline"))


def ratio_to(rec: Rec, ref: str, recs: dict[tuple[str, str], Rec]) -> float | None:
    """``rec``'s time over the reference variant's, from the same run when that run has it."""
    model = rec.row["model"]
    base = run_time(rec.run, rec.row["section"], model, ref)
    if base is None and (model, ref) in recs:
        base = recs[(model, ref)].time_us
    return None if not base or rec.time_us is None else rec.time_us / base


def ordered(names: Iterable[str]) -> list[str]:
    seen: list[str] = []
    for n in names:
        if n not in seen:
            seen.append(n)
    known = [v for v in VARIANT_ORDER if v in seen]
    return known + [v for v in seen if v not in VARIANT_ORDER]


def label(variant: str) -> str:
    return VARIANT_LABELS.get(variant, variant)


def colors(variants: Sequence[str]) -> dict[str, str]:
    out, spare = {}, iter(SPARE_COLORS * 4)
    used = set()
    for v in variants:
        c = VARIANT_COLORS.get(v)
        if c is None or c in used:
            c = next(spare)
        used.add(c)
        out[v] = c
    return out


# --------------------------------------------------------------------------- formatting


def fmt_us(t: float) -> str:
    """A time given in microseconds, as µs, ms or s with three significant digits (``1.90 ms``)."""
    a = abs(t)
    scale, unit = (1e6, "s") if a >= 1e6 else (1e3, "ms") if a >= 1e3 else (1.0, "µs")
    v = t / scale
    digits = 0 if abs(v) >= 100 else 1 if abs(v) >= 10 else 2
    return f"{v:.{digits}f} {unit}"


def fmt_date(iso: str) -> str:
    """``2025-01-02T03:04:05+00:00`` as ``2025-01-02 03:04 UTC``."""
    day, _, rest = iso.partition("T")
    return f"{day} {rest[:5]} UTC" if rest else day


def machine_line(m: dict[str, Any]) -> str:
    cpu = m.get("processor") or m.get("machine") or "unknown CPU"
    return f"{cpu}, {m.get('cpu_count', '?')} CPUs, {m.get('platform', '?')}"


def versions_line(m: dict[str, Any]) -> str:
    return ", ".join(f"{k} {m[k]}" for k in VERSION_KEYS if m.get(k))


def command_line(run: Run) -> str:
    return shlex.join(["python", *run.command])


CODE_WIDTH = 77  # characters a docs code block shows clear of its copy button (docs/ruff.toml)


def shell_lines(cmd: str, width: int = CODE_WIDTH) -> str:
    """``cmd`` continued onto new lines (``\\``) where it would pass ``width``, an option with its value."""
    groups: list[str] = []
    for word in shlex.split(cmd):
        if word.startswith("-") or not groups:
            groups.append(shlex.quote(word))
        else:
            groups[-1] += " " + shlex.quote(word)
    lines = [groups[0]]
    for g in groups[1:]:
        if len(lines[-1]) + 1 + len(g) + 2 > width:
            lines[-1] += " \\"
            lines.append("    " + g)
        else:
            lines[-1] += " " + g
    return "\n".join(lines)


def caption(runs: Iterable[Run]) -> str:
    """One line per results file: benchmark, date, (quick), CPU, versions."""
    lines = []
    for run in sorted(set(runs), key=lambda r: (r.benchmark, str(r.path))):
        quick = " --quick" if run.quick else ""
        m = run.machine
        cpu = m.get("processor") or m.get("machine") or "unknown CPU"
        lines.append(
            f"{run.benchmark}{quick}, {fmt_date(run.date)}: {cpu}, {m.get('cpu_count', '?')} CPUs; {versions_line(m)}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- charts


# Charts are drawn for the docs' page column: 7 in wide at 72 pt per inch is 504 pt, shown at its
# natural 672 CSS px (<= the ~690 px column, so never shrunk), and every text is >= 10.5 pt, seen
# at >= 14 px (tests/test_figures.py checks >= 12 px for every picture of the docs).
FIG_W = 7.0  # inches
FONT = 11.0  # pt: ticks, labels, titles
SMALL = 10.5  # pt: bar notes, legend, caption
ROW_IN = 0.3  # inches per bar
LEFT_IN = 2.3  # room for the variant names
RIGHT_IN = 0.2
LABEL_CHARS = 24  # a variant name longer than this takes two lines


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:  # pragma: no cover - depends on the environment
        raise SystemExit("plot.py needs matplotlib: pip install -e '.[demo]'") from None
    matplotlib.use("Agg")
    matplotlib.rcParams.update(
        {
            "svg.hashsalt": "tapeflow-benchmarks",  # fixed ids: the same input gives the same SVG
            "svg.fonttype": "none",  # text stays text: small files, searchable labels
            "font.family": "DejaVu Sans",
            "font.size": FONT,
        }
    )
    import matplotlib.pyplot as plt

    return plt


@dataclass
class Panel:
    """One axes of a chart: a header row per group, then one horizontal bar per variant the group has."""

    title: str
    groups: Sequence[str]
    variants: Sequence[str]
    value: Callable[[str, str], float | None]
    text: Callable[[str, str], str | None]
    xlabel: str
    log: bool
    marker: Callable[[str, str], float | None] | None = None
    marker_label: str = ""

    def row_in(self) -> float:
        """Inches per row: taller where a variant's name takes two lines."""
        two = any("\n" in wrap(label(v), LABEL_CHARS) for _, v in self.rows() if v is not None)
        return ROW_IN * (1.45 if two else 1.0)

    def rows(self) -> list[tuple[str, str | None]]:
        """``(group, variant)`` from top to bottom; ``variant`` None is the group's header row."""
        out: list[tuple[str, str | None]] = []
        for g in self.groups:
            present = [v for v in self.variants if self.value(g, v) is not None]
            if present:
                out += [(g, None), *((g, v) for v in present)]
        return out


def _ticker() -> Any:
    import matplotlib.ticker

    return matplotlib.ticker


def hbars(ax: Any, panel: Panel, palette: dict[str, str]) -> bool:
    """Draw ``panel`` on ``ax``: bold group names, a bar per variant with its note at the bar's end.

    ``panel.marker`` (optional) draws a black tick across a bar at another value (its baseline).
    Returns whether a marker was drawn.
    """
    rows = panel.rows()
    ys = list(range(len(rows)))[::-1]
    marked = False
    values = [val for g, var in rows if var is not None and (val := panel.value(g, var)) is not None]
    for y, (g, v) in zip(ys, rows):
        if v is None:
            continue
        x = panel.value(g, v)
        assert x is not None
        ax.barh([y], [x], 0.72, color=palette[v], left=None)
        note = panel.text(g, v)
        if note:
            ax.annotate(
                note,
                (max(x, 0.0), y),
                xytext=(4, 0),
                textcoords="offset points",
                ha="left",
                va="center",
                fontsize=SMALL,
            )
        m = None if panel.marker is None else panel.marker(g, v)
        if m is not None:
            ax.plot([m, m], [y - 0.42, y + 0.42], color="black", lw=1.8, label=None if marked else panel.marker_label)
            marked = True
    bar_rows = [(y, v) for y, (_, v) in zip(ys, rows) if v is not None]
    ax.set_yticks([y for y, _ in bar_rows], [wrap(label(v), LABEL_CHARS) for _, v in bar_rows])
    x0 = -(LEFT_IN - 0.1) / (FIG_W - LEFT_IN - RIGHT_IN)  # the figure's left edge, in axes coordinates
    for y, (g, v) in zip(ys, rows):
        if v is None:  # the group's name, left-aligned above its bars
            ax.text(
                x0,
                y,
                wrap(g, 48),
                transform=ax.get_yaxis_transform(),
                ha="left",
                va="center",
                fontweight="bold",
                fontsize=FONT,
            )
    ax.tick_params(axis="y", length=0)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    if panel.log:
        ax.set_xscale("log")
        lo, hi = min(v for v in values if v > 0), max(values)
        ax.set_xlim(lo / 2, hi * 12)  # room for the notes right of the longest bar
        # plain numbers (0.1, 1, 10), not mathtext powers, whose small exponents would be hard to read
        ax.xaxis.set_major_formatter(_ticker().FuncFormatter(lambda x, _pos: f"{x:g}"))
        ax.xaxis.set_minor_formatter(_ticker().NullFormatter())
    else:
        lo, hi = min([0.0, *values]), max([0.0, *values])
        ax.set_xlim(lo - 0.05 * (hi - lo), hi + 0.45 * (hi - lo or 1.0))
        ax.axvline(0, color="black", lw=0.6)
    ax.grid(axis="x", alpha=0.3, which="both")
    ax.set_axisbelow(True)
    ax.set_xlabel(panel.xlabel, fontsize=FONT)
    ax.set_title(panel.title, fontsize=FONT, loc="left", fontweight="bold")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return marked


def draw_panels(
    plt: Any, panels: Sequence[Panel], palette: dict[str, str], heading: str, runs: Iterable[Run], path: Path
) -> Path:
    """Stack ``panels`` in one chart ``FIG_W`` inches wide, each as tall as its rows; heading and caption around."""
    cap = caption_lines(runs)
    head_in = 0.3 + 0.22 * heading.count("\n")
    # the ticks' legend goes under the heading, above the bars it explains (at the foot of a tall
    # chart nobody connects it with them)
    legend_in = 0.3 if any(p.marker for p in panels) else 0.0
    cap_in = 0.12 + 0.19 * len(cap)
    pane_in = [p.row_in() * len(p.rows()) for p in panels]
    gap_in = 0.95  # x label, ticks and the next title
    fig_h = head_in + legend_in + sum(pane_in) + gap_in * len(panels) + cap_in
    fig = plt.figure(figsize=(FIG_W, fig_h))
    fig.text(0.5 / FIG_W, 1 - 0.12 / fig_h, heading, fontsize=FONT, va="top", ha="left")
    top = fig_h - head_in - legend_in - 0.3
    marked_any = None
    for p, h in zip(panels, pane_in):
        ax = fig.add_axes((LEFT_IN / FIG_W, (top - h) / fig_h, 1 - (LEFT_IN + RIGHT_IN) / FIG_W, h / fig_h))
        if hbars(ax, p, palette):
            marked_any = ax
        top -= h + gap_in
    if marked_any is not None:
        handles, labels = marked_any.get_legend_handles_labels()
        fig.legend(
            handles,
            labels,
            fontsize=SMALL,
            loc="upper left",
            frameon=False,
            bbox_to_anchor=(0.4 / FIG_W, 1 - (head_in - 0.02) / fig_h),
        )
    for k, line in enumerate(cap):
        fig.text(
            0.1 / FIG_W,
            (0.08 + 0.19 * (len(cap) - 1 - k)) / fig_h,
            line,
            fontsize=SMALL,
            color="#555555",
            va="bottom",
            ha="left",
        )
    return _save(plt, fig, path)


def wrap(text: str, width: int) -> str:
    """Break ``text`` at spaces into lines of about ``width`` characters (tick labels)."""
    lines: list[str] = []
    for word in text.split(" "):
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return "\n".join(lines)


def caption_lines(runs: Iterable[Run], width: int = 82) -> list[str]:
    """:func:`caption` broken into lines that fit the chart's width (at ``"; "`` and ``", "``)."""
    out: list[str] = []
    for line in caption(runs).splitlines():
        head, _, versions = line.partition("; ")
        out.append(head)
        cur = ""
        for part in versions.split(", "):
            if cur and len(cur) + 2 + len(part) > width - 2:
                out.append("  " + cur + ",")
                cur = part
            else:
                cur = part if not cur else f"{cur}, {part}"
        if cur:
            out.append("  " + cur)
    return out


def _span(values: Iterable[float]) -> float:
    vs = [v for v in values if v > 0]
    return max(vs) / min(vs) if vs else 1.0


FORMAT = "svg"


def _save(plt: Any, fig: Any, path: Path) -> Path:
    path = path.with_suffix("." + FORMAT)
    path.parent.mkdir(parents=True, exist_ok=True)
    if FORMAT == "svg":
        fig.savefig(path, format="svg", metadata={"Date": None})
    else:
        fig.savefig(path, format=FORMAT, dpi=150)
    plt.close(fig)
    return path


def reference_of(recs: dict[tuple[str, str], Rec], model: str) -> str | None:
    for ref in ("pytorch", "eager"):
        if (model, ref) in recs:
            return ref
    return None


def plot_train(runs: Sequence[Run], out_dir: Path) -> Path | None:
    """Time per training step per model, one bar per variant, labelled with the ratio to the reference."""
    recs = collect(runs, [TRAIN_SECTION])
    if not recs:
        return None
    plt = _pyplot()
    models = list(dict.fromkeys(m for m, _ in recs))
    variants = ordered(v for _, v in recs)
    refs = {m: reference_of(recs, m) for m in models}

    def value(m: str, v: str) -> float | None:
        r = recs.get((m, v))
        return None if r is None else (r.time_us or 0.0) / 1e3

    def text(m: str, v: str) -> str | None:
        r, ref = recs.get((m, v)), refs[m]
        if r is None or r.time_us is None:
            return None
        t = fmt_us(r.time_us)
        if ref is None or v == ref:
            return t
        ratio = ratio_to(r, ref, recs)
        return t if ratio is None else f"{t} ({ratio:.2f}{TIMES})"

    log = _span(r.time_us or 0 for r in recs.values()) > 8
    ref_names = sorted({label(r) for r in refs.values() if r})
    panel = Panel(
        "",
        models,
        variants,
        value,
        text,
        "ms per training step" + (" (log scale)" if log else ""),
        log,
    )
    heading = (
        "Training step: forward, backward, Adam update\n"
        "(float32; batch 64 unless the model says otherwise)\n"
        f"in brackets: time / {' or '.join(ref_names) or 'reference'}; lower is better"
    )
    return draw_panels(
        plt, [panel], colors(variants), heading, {r.run for r in recs.values()}, out_dir / "perf_train.svg"
    )


def plot_per_op(runs: Sequence[Run], out_dir: Path) -> Path | None:
    """Time per recorded op against a plain jax.jit call, and the difference (the per-op overhead)."""
    recs = collect(runs, PER_OP_SECTIONS)
    if not recs:
        return None
    plt = _pyplot()
    ops = list(dict.fromkeys(m for m, _ in recs))
    variants = ordered(v for _, v in recs)
    palette = colors(variants)
    base = {k: b for k, r in recs.items() if (b := baseline_time(r)) is not None}
    over = {k: (recs[k].time_us or 0.0) - b for k, b in base.items()}
    over_variants = [v for v in variants if any(k[1] == v for k in over)]
    baselines = {r.row.get("baseline") for r in recs.values()}
    # the baselines (the jax.jit calls) are drawn as a line across each bar, from the bar's own run
    shown = [v for v in variants if v not in baselines]
    base_name = " or ".join(sorted(label(b) for b in baselines if b)) or "baseline"
    over_ops = [m for m in ops if any(k[0] == m for k in over)]

    def value(m: str, v: str) -> float | None:
        r = recs.get((m, v))
        return None if r is None else r.time_us

    def text(m: str, v: str) -> str | None:
        r = recs.get((m, v))
        if r is None or r.time_us is None:
            return None
        b = base.get((m, v))
        return fmt_us(r.time_us) + ("" if b is None else f" (tick: {fmt_us(b)})")

    def ovalue(m: str, v: str) -> float | None:
        return over.get((m, v))

    def otext(m: str, v: str) -> str | None:
        o = over.get((m, v))
        return None if o is None else f"{o:+.1f} µs"

    log = _span(r.time_us or 0 for r in recs.values()) > 8
    panels = [
        Panel(
            "time per op",
            ops,
            shown,
            value,
            text,
            "µs per op" + (" (log scale)" if log else ""),
            log,
            lambda m, v: base.get((m, v)),
            f"black tick: the same op as a {base_name}, in the same run (its time in brackets)",
        )
    ]
    if over_ops:
        panels.append(
            Panel(
                f"overhead per recorded op (time {MINUS} {base_name})",
                over_ops,
                over_variants,
                ovalue,
                otext,
                f"µs per op over the {base_name}",
                False,
            )
        )
    heading = f"Per-op cost: recording an op vs the same kernel\nas a {base_name}"
    return draw_panels(plt, panels, palette, heading, {r.run for r in recs.values()}, out_dir / "perf_per_op.svg")


# --------------------------------------------------------------------------- markdown


def _cell(s: Any) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: Sequence[str] | None = None) -> str:
    align = align or ["l"] * len(header)
    lines = [
        "| " + " | ".join(_cell(h) for h in header) + " |",
        "| " + " | ".join("---:" if a == "r" else "---" for a in align) + " |",
    ]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def train_table(runs: Sequence[Run]) -> str | None:
    recs = collect(runs, [TRAIN_SECTION])
    if not recs:
        return None
    models = list(dict.fromkeys(m for m, _ in recs))
    # plain JAX op by op is in bench_train's own table below: a seventh column is wider than the page
    variants = ordered(v for _, v in recs if v != "jax_unjitted")
    rows = []
    for m in models:
        ref = reference_of(recs, m)
        row = [m]
        for v in variants:
            r = recs.get((m, v))
            if r is None or r.time_us is None:
                row.append("")
            elif ref is None or v == ref:
                row.append(fmt_us(r.time_us))
            else:
                ratio = ratio_to(r, ref, recs)
                row.append(fmt_us(r.time_us) + ("" if ratio is None else f" ({ratio:.2f}{TIMES})"))
        rows.append(row)
    refs = sorted({label(x) for m in models if (x := reference_of(recs, m))})
    return (
        table(["model", *(label(v) for v in variants)], rows, ["l"] + ["r"] * len(variants))
        + f"\n\nTime per training step; in brackets, the ratio to {' or '.join(refs) or 'the reference'} (lower is better)."
    )


def per_op_table(runs: Sequence[Run]) -> str | None:
    """One table per set of variants the ops were timed with: a table of every variant of every op is
    wider than the page, and most of its cells are empty (an op timed against ``jax.jit`` is not timed
    in a lazy step, a lazy model not against ``jax.jit``)."""
    recs = collect(runs, PER_OP_SECTIONS)
    if not recs:
        return None
    ops = list(dict.fromkeys(m for m, _ in recs))
    variants = ordered(v for _, v in recs)
    by_set: dict[tuple[str, ...], list[str]] = {}
    for m in ops:
        by_set.setdefault(tuple(v for v in variants if (m, v) in recs), []).append(m)
    tables = []
    for shown, set_ops in by_set.items():
        over_variants = [v for v in shown if any(baseline_time(recs[(m, v)]) is not None for m in set_ops)]
        header = ["op", *(label(v) for v in shown), *(f"{label(v)} {MINUS} jax.jit" for v in over_variants)]
        rows = []
        for m in set_ops:
            row = [m]
            for v in shown:
                r = recs[(m, v)]
                row.append("" if r.time_us is None else fmt_us(r.time_us))
            for v in over_variants:
                r = recs[(m, v)]
                b = baseline_time(r)
                row.append("" if b is None else f"{(r.time_us or 0.0) - b:+.1f} µs")
            rows.append(row)
        tables.append(table(header, rows, ["l"] + ["r"] * (len(header) - 1)))
    return (
        "\n\n".join(tables)
        + "\n\nTime per op, and the difference to the same kernel called through `jax.jit` in the same run "
        "(the Python bookkeeping of recording the op; for the larger ops it is within the noise)."
    )


def _blocks(model: str) -> int | None:
    """The block count in a depth-sweep model's name (``GPT-like, 16 blocks``)."""
    m = re.search(r"(\d+) blocks", model)
    return None if m is None else int(m.group(1))


def _verdict(ok: list[tuple[str, bool]]) -> str:
    """``met`` / ``missed at ...`` / ``met at ..., missed at ...`` over labelled checks."""
    missed = [name for name, good in ok if not good]
    if not missed:
        return "met"
    met = [name for name, good in ok if good]
    return ("met at " + ", ".join(met) + "; " if met else "") + "missed at " + ", ".join(missed)


def depth_table(runs: Sequence[Run]) -> str | None:
    """bench_depth's two tables: time per step per depth, and time to the end of step 2 in a fresh process.

    One column per depth and one row per variant: a column per variant is wider than the page.
    """
    parts = []
    recs = collect(runs, [DEPTH_SECTION])
    names = {b: m for m, _ in recs if (b := _blocks(m)) is not None}
    depths = sorted(names)
    if depths:
        variants = [v for v in DEPTH_VARIANTS if any((names[b], v) in recs for b in depths)]
        rows = []
        for v in variants:
            row = [DEPTH_LABELS.get(v, label(v))]
            for b in depths:
                r = recs.get((names[b], v))
                ratio = None if r is None or v == "pytorch" else ratio_to(r, "pytorch", recs)
                t = "" if r is None or r.time_us is None else fmt_us(r.time_us)
                row.append(t + ("" if ratio is None else f" ({ratio:.2f}{TIMES})"))
            rows.append(row)
        vs_torch, vs_ts, ts_row = [], [], ["loop / `train_step`"]
        for b in depths:
            loop = recs.get((names[b], "default_loop"))
            r_torch = None if loop is None else ratio_to(loop, "pytorch", recs)
            r_ts = None if loop is None or (names[b], "train_step") not in recs else ratio_to(loop, "train_step", recs)
            ts_row.append("" if r_ts is None else f"{r_ts:.2f}{TIMES}")
            if r_torch is not None:
                vs_torch.append((f"{b} blocks ({r_torch:.2f}{TIMES})", r_torch <= DEPTH_TARGET_VS_TORCH))
            if r_ts is not None:
                vs_ts.append((f"{b} blocks ({r_ts:.2f}{TIMES})", r_ts <= DEPTH_TARGET_VS_TRAIN_STEP))
        rows.append(ts_row)
        header = ["per step", *(f"{b} blocks" for b in depths)]
        parts.append(
            table(header, rows, ["l"] + ["r"] * len(depths))
            + "\n\nTime per training step; in brackets, the ratio to PyTorch eager (lower is better). Targets:"
            f" the `Session()` loop at most {DEPTH_TARGET_VS_TORCH}{TIMES} PyTorch eager at every depth"
            f" ({_verdict(vs_torch)}), at most {DEPTH_TARGET_VS_TRAIN_STEP}{TIMES} `train_step` ({_verdict(vs_ts)})."
        )
    first = collect(runs, [DEPTH_FIRST_SECTION])
    f_names = {b: m for m, _ in first if (b := _blocks(m)) is not None}
    f_depths = sorted(f_names)
    if f_depths:
        low, high = f_depths[0], f_depths[-1]
        variants = [v for v in DEPTH_VARIANTS if any((f_names[b], v) in first for b in f_depths)]
        rows = []
        for v in variants:
            row = [DEPTH_LABELS.get(v, label(v))]
            r0 = first.get((f_names[low], v))
            for b in f_depths:
                r = first.get((f_names[b], v))
                if r is None or r.time_us is None:
                    row.append("")
                    continue
                grow = None if b == low or r0 is None or not r0.time_us else r.time_us / r0.time_us
                row.append(fmt_us(r.time_us) + ("" if grow is None else f" ({grow:.2f}{TIMES})"))
            rows.append(row)
        vs_jit, jit_row = [], ["loop / `jax.jit`"]
        for b in f_depths:
            loop = first.get((f_names[b], "default_loop"))
            r_jit = None if loop is None or (f_names[b], "hand_jit") not in first else ratio_to(loop, "hand_jit", first)
            jit_row.append("" if r_jit is None else f"{r_jit:.2f}{TIMES}")
            if r_jit is not None:
                vs_jit.append((f"{b} blocks ({r_jit:.2f}{TIMES})", r_jit <= DEPTH_TARGET_FIRST_VS_JIT))
        rows.append(jit_row)
        deep, shallow = first.get((f_names[high], "default_loop")), first.get((f_names[low], "default_loop"))
        grow_note = ""
        if high != low and deep is not None and shallow is not None and deep.time_us and shallow.time_us:
            g = deep.time_us / shallow.time_us
            grow_note = (
                f" at {high} blocks at most {DEPTH_TARGET_FIRST_DEEP}{TIMES} its time at {low} blocks"
                f" ({'met' if g <= DEPTH_TARGET_FIRST_DEEP else 'missed'}: {g:.2f}{TIMES}), and"
            )
        parts.append(
            table(["to the end of step 2", *(f"{b} blocks" for b in f_depths)], rows, ["l"] + ["r"] * len(f_depths))
            + "\n\nTime from a fresh process's first line of model code to the end of step 2 (imports and JAX's"
            " backend start not counted), with an empty compilation cache; in brackets, the time over the same"
            f" variant's at {low} blocks. Target: the `Session()` loop{grow_note} never more than the"
            f" hand-written `jax.jit` step ({_verdict(vs_jit)})."
        )
    return "\n\n".join(parts) or None


# the libraries a script compares with, listed only where it imported them: one column of the machine table
# (a column each is wider than the page once a few runs differ)
PEERS = ("torch", "flax", "equinox")
PEER_KEY = "peer libraries"
MACHINE_KEYS = [
    "processor",
    "cpu_count",
    "machine",
    "platform",
    "device",
    "xla_flags",
    "cpu_dispatch",
    *(k for k in VERSION_KEYS if k not in PEERS),
    PEER_KEY,
]
LONG_CELL = 24  # characters: a longer value that differs between runs is a numbered note under the table
SHORT_HEADER = {"quick run": "quick", "cpu_dispatch": "dispatch", PEER_KEY: "peers"}  # the table fits the page


def _machine_value(run: Run, key: str) -> str:
    if key == "date":
        return fmt_date(run.date)
    if key == "quick run":
        return "yes" if run.quick else "no"
    if key == PEER_KEY:
        return ", ".join(f"{k} {run.machine[k]}" for k in PEERS if run.machine.get(k))
    v = run.machine.get(key)
    if key == "xla_flags":
        return f"`{v}`" if v else "(none)"
    return "" if v is None else str(v)


def machine_table(runs: Sequence[Run]) -> str:
    """Where each run was measured: what all runs share in one line, then one row per run with the rest.

    One column per run would be as wide as the runs are many; values longer than ``LONG_CELL`` (XLA
    flags) are numbered notes under the table, so no cell is wider than the page.
    """
    runs = sorted(runs, key=lambda r: (r.benchmark, str(r.path)))
    keys = ["date", "quick run", *(k for k in MACHINE_KEYS if any(_machine_value(r, k) for r in runs))]
    values = {k: [_machine_value(r, k) for r in runs] for k in keys}
    same = [k for k in keys if len(set(values[k])) == 1]
    differ = [k for k in keys if k not in same]
    notes: list[str] = []

    def cell(v: str) -> str:
        if len(v) <= LONG_CELL:
            return v
        if v not in notes:
            notes.append(v)
        return f"({notes.index(v) + 1})"

    parts = []
    if same:
        parts.append("All runs: " + "; ".join(f"{k} {values[k][0] or '(none)'}" for k in same) + ".")
    if differ:
        rows = [[r.benchmark, *(cell(values[k][i]) for k in differ)] for i, r in enumerate(runs)]
        parts.append(table(["run", *(SHORT_HEADER.get(k, k) for k in differ)], rows))
    if notes:
        parts.append("\n".join(f"- ({i + 1}) {v}" for i, v in enumerate(notes)))
    return "\n\n".join(parts)


def all_results(run: Run) -> str:
    """A run's every result, one table per section (named in a line above it).

    One table of every row, with a section column beside the model, variant, time, ratio and
    target, is wider than the page; within a section a column with one value in every row is a
    line above the table instead.
    """
    groups: dict[str, list[list[str]]] = {}
    for row in run.results:
        if row.get("time_us") is not None:
            t = f"{fmt_us(float(row['time_us']))} / {row.get('per', '')}"
        elif "python_calls" in row:
            t = f"{row['python_calls']} Python calls / {row.get('per', '')}"
        else:
            t = ""
        ratio = row.get("ratio")
        cells = [
            str(row.get("section", "")),
            str(row.get("model", "")),
            # "train_step+jax_debug_nans" is one word a column cannot wrap; "train_step + ..." wraps
            str(row.get("variant", "")).replace("+", " + "),
            t,
            "" if ratio is None else f"{ratio:.2f}{TIMES} {row.get('baseline')}",
            str(row.get("target", "")),
        ]
        groups.setdefault(cells[0], []).append(cells)
    return "\n\n".join(_results_table(rows) for rows in groups.values())


def _results_table(rows: list[list[str]]) -> str:
    header = ["section", "model", "variant", "time", "ratio", "target"]
    # one unit for every time ("1.51 ms / step"): said once in the header, so a cell does not wrap
    units = {r[3].rpartition(" / ")[2] for r in rows if " / " in r[3]}
    if len(units) == 1 and all(" / " in r[3] or not r[3] for r in rows):
        (unit,) = units
        header[3] = f"time / {unit}"
        rows = [[*r[:3], r[3].rpartition(" / ")[0], *r[4:]] for r in rows]
    align = ["l", "l", "l", "r", "r", "l"]
    keep = [c for c in range(len(header)) if len(rows) < 2 or len({r[c] for r in rows}) > 1 or c == 3]
    fixed = [f"{header[c]}: {rows[0][c]}" for c in range(len(header)) if c not in keep and rows and rows[0][c] != ""]
    body = table([header[c] for c in keep], [[r[c] for c in keep] for r in rows], [align[c] for c in keep])
    return ("; ".join(fixed) + " (every row).\n\n" if fixed else "") + body


def render_markdown(runs: Sequence[Run], sources: Sequence[str]) -> str:
    """The generated part of the performance page (between the markers, exclusive)."""
    parts = [
        "<!-- generated by benchmarks/plot.py from "
        + ", ".join(sources)
        + "; edit the script or rerun it, not this block -->",
    ]
    quick = sorted(r.benchmark for r in runs if r.quick)
    if quick:
        parts.append(
            f"**These numbers come from `--quick` runs** ({', '.join(quick)}): few repeats, "
            "noisy. Rerun the commands below without `--quick` on a quiet machine for numbers to quote."
        )
    for title, body in (
        ("Training step", train_table(runs)),
        ("Depth sweep", depth_table(runs)),
        ("Per-op overhead", per_op_table(runs)),
    ):
        if body:
            parts.append(f"### {title}\n\n{body}")
    parts.append("### Measured on\n\n" + machine_table(runs))
    cmds = "\n".join(shell_lines(command_line(r)) for r in sorted(runs, key=lambda r: (r.benchmark, str(r.path))))
    parts.append("The commands that produced these results:\n\n```bash\n" + cmds + "\n```")
    parts.append("### All results")
    for run in sorted(runs, key=lambda r: (r.benchmark, str(r.path))):
        parts.append(f"#### {run.benchmark}\n\n{all_results(run)}")
    return "\n\n".join(parts)


def source_names(runs: Sequence[Run], base: Path) -> list[str]:
    """The results files' paths relative to ``base`` (the repository root), else their names."""
    names = []
    for r in runs:
        try:
            names.append(r.path.resolve().relative_to(base.resolve()).as_posix())
        except ValueError:
            names.append(r.path.name)
    return names


def fill_markdown(page: Path, body: str, start: str = START, end: str = END) -> None:
    """Replace the text between the markers in ``page`` with ``body``."""
    text = page.read_text()
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise SystemExit(f"{page}: needs one {start} line followed by one {end} line")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    page.write_text(f"{head}{start}\n{body}\n{end}{tail}")


def short_model(model: str) -> str:
    """A model's name without its sizes: ``MLP 784-256-256-10`` is ``MLP``, ``char LM (2x64, ...)`` ``char LM``."""
    return re.split(r"\s+[\d(]", model, maxsplit=1)[0]


NAN_PATHS = ("eager", "lazy", "train_step")


def nan_cost(runs: Sequence[Run]) -> str:
    """The debugging guide's table of what ``debug_nans`` costs, and its failing step's time, from bench_debug_nans.

    One row per model and path: each checker's step time as a ratio to the same path's step with it
    off (PyTorch's ``detect_anomaly``: to PyTorch's own step), then the time of a step that fails and
    locates the origin.
    """
    got = [r for r in runs if r.benchmark == "bench_debug_nans"]
    if len(got) != 1:
        raise SystemExit(f"--nan-guide needs one bench_debug_nans results file, got {len(got)}")
    rows = got[0].results

    def ratio(section: str, model: str, variant: str) -> str:
        r = next(
            (r for r in rows if (r.get("section"), r.get("model"), r.get("variant")) == (section, model, variant)), None
        )
        return "" if r is None or r.get("ratio") is None else f"{r['ratio']:.2f}x"

    models = list(dict.fromkeys(str(r["model"]) for r in rows if r.get("section") == "debug_nans"))
    header = [
        "model, path",
        "`debug_nans=True`",
        "waiting every step",
        "`jax_debug_nans`",
        "PyTorch `detect_anomaly`",
    ]
    body = []
    for m in models:
        for path in NAN_PATHS:
            anomaly = ratio("debug_nans", m, "pytorch+detect_anomaly") if path == "eager" else ""
            cells = [ratio("debug_nans", m, f"{path}+{c}") for c in ("debug_nans", "wait", "jax_debug_nans")]
            # model and path share a cell: every column is at least the theme's 5rem wide, and six
            # of them with their padding are wider than the text column
            body.append([f"{short_model(m)}, {path}", *cells, anomaly])
    parts = [f"The models: {' and '.join(models)}.", table(header, body, ["l", "r", "r", "r", "r"])]
    failing = []
    for r in rows:
        v = str(r.get("variant", ""))
        if r.get("section") == "debug_nans_locate" and v.endswith("_failing") and r.get("time_us") is not None:
            failing.append((short_model(str(r["model"])), v.removesuffix("_failing"), r))
    if failing:
        said = ", ".join(
            f"{path} {fmt_us(float(r['time_us']))} ({r['ratio']:.2f}x a normal step)" for _, path, r in failing
        )
        parts.append(
            f"After a failure, the {failing[0][0]}'s failing step, which finds and locates the origin, takes {said}."
        )
    return "\n\n".join(parts)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="results files written by bench_*.py --json")
    ap.add_argument("--out-dir", default="docs/images", help="where the SVG charts go (default: docs/images)")
    ap.add_argument("--markdown", metavar="PAGE", help="fill PAGE's perf-table block with tables of the numbers")
    ap.add_argument("--nan-guide", metavar="PAGE", help="fill PAGE's nan-cost block with bench_debug_nans's costs")
    ap.add_argument("--no-charts", action="store_true", help="only the --markdown tables")
    ap.add_argument("--format", choices=("svg", "png"), default="svg", help="chart format (default: svg)")
    args = ap.parse_args(argv)
    global FORMAT
    FORMAT = args.format
    runs = load(args.results)
    written: list[Path] = []
    if not args.no_charts:
        out = Path(args.out_dir)
        for fn in (plot_train, plot_per_op):
            p = fn(runs, out)
            if p is not None:
                written.append(p)
                print(f"wrote {p}")
    if args.markdown:
        page = Path(args.markdown)
        fill_markdown(page, render_markdown(runs, source_names(runs, Path.cwd())))
        written.append(page)
        print(f"wrote {page} (between {START} and {END})")
    if args.nan_guide:
        page = Path(args.nan_guide)
        fill_markdown(page, nan_cost(runs), NAN_START, NAN_END)
        written.append(page)
        print(f"wrote {page} (between {NAN_START} and {NAN_END})")
    return written


if __name__ == "__main__":
    main()
