"""The benchmark scripts' ``--json`` results, the charts and tables of benchmarks/plot.py, and
the performance page generated from the committed results."""

from __future__ import annotations

import datetime
import doctest
import importlib.util
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results"
PAGE = ROOT / "docs" / "performance.md"

RECORD_KEYS = {"section", "model", "variant", "time_us", "per", "baseline", "ratio"}
X = "\u00d7"  # the multiplication sign of the ratio labels
MACHINE_KEYS = {"processor", "machine", "cpu_count", "platform", "python", "jax", "jaxlib", "optax", "tapeflow"}


def _load(name: str) -> ModuleType:
    """Import ``benchmarks/<name>.py`` (the folder is not a package; its scripts import ``_timing``)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"tapeflow_bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def _check_results_file(d: dict[str, Any], benchmark: str) -> None:
    assert d["schema"] == 1
    assert d["benchmark"] == benchmark
    assert set(d["machine"]) >= MACHINE_KEYS, set(d["machine"])
    assert isinstance(d["machine"]["cpu_count"], int)
    date = datetime.datetime.fromisoformat(d["date"])
    assert date.utcoffset() == datetime.timedelta(0), "dates are UTC"
    assert d["command"][0] == f"benchmarks/{benchmark}.py" and "--json" in d["command"]
    assert isinstance(d["quick"], bool)
    assert d["results"], "no records"
    times = {}
    for r in d["results"]:
        assert set(r) >= RECORD_KEYS, r
        assert all(isinstance(r[k], str) for k in ("section", "model", "variant", "per")), r
        assert r["time_us"] is None or (isinstance(r["time_us"], float) and r["time_us"] > 0), r
        times[(r["section"], r["model"], r["variant"])] = r["time_us"]
        for v in r.values():  # flat records
            assert v is None or isinstance(v, str | int | float), r
    for r in d["results"]:  # ratio = time / the baseline record's time (same section and model)
        if r["ratio"] is not None:
            base = times[(r["section"], r["model"], r["baseline"])]
            assert r["ratio"] == pytest.approx(r["time_us"] / base, rel=1e-3), r


# --------------------------------------------------------------------------- --json


def test_bench_session_writes_json(tmp_path: Path) -> None:
    """One script end to end (its quick per-op part: a few seconds); the others share the writer."""
    out = tmp_path / "sub" / "session.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_session.py", "--quick", "--only", "per_op", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "per-op cost of an op on a Session" in proc.stdout  # the printed report is still there
    d = json.loads(out.read_text())
    _check_results_file(d, "bench_session")
    assert d["quick"] is True and d["command"][-2:] == ["--json", str(out)]
    got = {(r["section"], r["model"], r["variant"]) for r in d["results"]}
    for op in ("add (4,)", "matmul 64x256 @ 256x256", "relu (64, 256)"):
        assert {("session_per_op", op, "jax_jit"), ("session_per_op", op, "session")} <= got
    assert all(r["per"] == "op" for r in d["results"])


def test_results_writer_doctest() -> None:
    timing = _load("_timing")
    res = doctest.testmod(timing, verbose=False)
    assert res.failed == 0 and res.attempted > 0


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_committed_results_follow_the_schema(path: Path) -> None:
    d = json.loads(path.read_text())
    _check_results_file(d, d["benchmark"])


# --------------------------------------------------------------------------- plot.py


def _synthetic(tmp_path: Path) -> list[Path]:
    machine = {
        "processor": "Test CPU 9000",
        "machine": "x86_64",
        "cpu_count": 8,
        "platform": "Linux-test",
        "python": "3.11.0",
        "jax": "0.0.1",
        "jaxlib": "0.0.1",
        "optax": "0.0.2",
        "tapeflow": "0.1.0",
        "torch": "2.0.0",
        "device": "cpu:0",
        "xla_flags": "",
    }

    def rec(section: str, model: str, variant: str, t: float | None, baseline: str | None = None, **kw: Any) -> Any:
        return {"section": section, "model": model, "variant": variant, "time_us": t, "per": "step"} | {
            "baseline": baseline,
            "ratio": None,
            **kw,
        }

    train = {
        "schema": 1,
        "benchmark": "bench_train",
        "machine": machine,
        "date": "2025-03-04T05:06:07+00:00",
        "command": ["benchmarks/bench_train.py", "--json", "out/train.json"],
        "quick": False,
        "results": [
            rec("train", "MLP 784-256-256-10", "eager", 1500.0, "pytorch"),
            rec("train", "MLP 784-256-256-10", "pytorch", 1250.0),
            rec("train", "MLP 784-256-256-10", "train_step", 400.0, "pytorch"),
            rec("train", "MLP 784-256-256-10", "jax_unjitted", 9000.0, "pytorch"),
            rec("train", "tied autoencoder 784-128", "eager", 900.0, "pytorch"),
            rec("train", "tied autoencoder 784-128", "pytorch", 1000.0),
            rec("train", "tied autoencoder 784-128", "train_step", 300.0, "pytorch"),
            rec("train_opt_step", "MLP 784-256-256-10", "opt_step", 300.0),
        ],
    }
    # a variant the plot does not know by name, from another script: drawn next to the others. Its
    # eager and pytorch timings repeat bench_train's: the file with more variants of a model wins,
    # and the lazy bar's ratio is to the pytorch time of its own run
    lazy = train | {
        "benchmark": "bench_lazy",
        "date": "2025-03-05T00:00:00+00:00",
        "command": ["benchmarks/bench_lazy.py", "--json", "out/lazy.json"],
        "results": [
            rec("train", "MLP 784-256-256-10", "lazy", 700.0),
            rec("train", "MLP 784-256-256-10", "eager", 1600.0),
            rec("train", "MLP 784-256-256-10", "pytorch", 1300.0),
            rec("train", "tied autoencoder 784-128", "lazy", 500.0),
        ],
    }
    core = train | {
        "benchmark": "bench_core",
        "command": ["benchmarks/bench_core.py", "--quick", "--json", "out/core.json"],
        "quick": True,
        "results": [
            rec("per_op", "add (4,)", "jax_jit", 6.0, per="op"),
            rec("per_op", "add (4,)", "record", 9.0, "jax_jit", per="op", ratio=1.5),
            rec("per_op", "relu (64, 256)", "jax_jit", 40.0, per="op"),
            rec("per_op", "relu (64, 256)", "record", 41.0, "jax_jit", per="op"),
            rec("jit_python_calls", "2 x 16-wide", "train_step", None, python_calls=15),
        ],
    }
    session = train | {
        "benchmark": "bench_session",
        "command": ["benchmarks/bench_session.py", "--json", "out/session.json"],
        "results": [
            rec("session_per_op", "add (4,)", "jax_jit", 6.5, per="op"),
            rec("session_per_op", "add (4,)", "session", 13.0, "jax_jit", per="op"),
        ],
    }
    paths = []
    for name, d in (("core", core), ("lazy", lazy), ("session", session), ("train", train)):
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(d))
        paths.append(p)
    return paths


def test_plot_renders_deterministic_svgs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plot = _load("plot")
    files = [str(p) for p in _synthetic(tmp_path)]
    written = plot.main([*files, "--out-dir", str(tmp_path / "a")])
    assert sorted(p.name for p in written) == ["perf_per_op.svg", "perf_train.svg"]
    train = (tmp_path / "a" / "perf_train.svg").read_text()
    per_op = (tmp_path / "a" / "perf_per_op.svg").read_text()
    for svg in (train, per_op):
        ET.fromstring(svg)  # well-formed
        assert "Test CPU 9000" in svg and "2025-03-04 05:06 UTC" in svg  # machine and date in the caption
    # every variant of the train section, the unknown "lazy" included, with its ratio to PyTorch
    for text in ("tapeflow eager", "tfl.train_step", "PyTorch eager", "JAX, not jitted", "tapeflow lazy"):
        assert text in train, text
    # eager 1500/1250 (bench_train's); lazy 700/1300 (its own run's PyTorch), 500/1000 (bench_train's)
    assert f"1.20{X}" in train and f"0.54{X}" in train and f"0.50{X}" in train
    assert "1.60 ms" not in train
    assert "opt.step" not in train  # another section
    assert "Session op" in per_op and "+6.5 µs" in per_op and "+3.0 µs" in per_op
    # the same input gives the same bytes
    plot.main([*files, "--out-dir", str(tmp_path / "b")])
    for name in ("perf_train.svg", "perf_per_op.svg"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_plot_fills_the_markdown_block(tmp_path: Path) -> None:
    plot = _load("plot")
    files = [str(p) for p in _synthetic(tmp_path)]
    page = tmp_path / "page.md"
    page.write_text(f"# Perf\n\nintro\n\n{plot.START}\nstale\n{plot.END}\n\noutro\n")
    plot.main([*files, "--no-charts", "--markdown", str(page)])
    text = page.read_text()
    assert text.startswith("# Perf\n\nintro\n\n") and text.endswith("\n\noutro\n") and "stale" not in text
    body = text.split(plot.START)[1].split(plot.END)[0]
    assert f"| MLP 784-256-256-10 | 1.50 ms (1.20{X}) |" in body
    assert "tapeflow lazy" in body and f"700 µs (0.54{X})" in body
    assert "| add (4,) | 6.00 µs | 9.00 µs | 13.0 µs | +3.0 µs | +6.5 µs |" in body
    assert "Test CPU 9000" in body and "2025-03-04 05:06 UTC" in body
    assert "python benchmarks/bench_train.py --json out/train.json" in body
    assert "--quick" in body and "bench_core" in body.split("come from `--quick` runs")[1].split("\n")[0]
    assert "15 Python calls" in body
    assert "```python" not in body  # the docs test would run it
    plot.main([*files, "--no-charts", "--markdown", str(page)])
    assert page.read_text() == text  # idempotent

    page.write_text("# no markers\n")
    with pytest.raises(SystemExit, match="perf-table"):
        plot.main([*files, "--no-charts", "--markdown", str(page)])


def test_nan_guide_costs_are_generated_from_the_committed_results() -> None:
    """docs/debugging-nans.md's cost table and failing-step times are what plot.py makes of debug_nans.json.

    After a new run: python benchmarks/plot.py benchmarks/results/*.json --no-charts
    --markdown docs/performance.md --nan-guide docs/debugging-nans.md
    """
    plot = _load("plot")
    runs = plot.load(sorted(RESULTS.glob("*.json")))
    want = plot.nan_cost(runs)
    text = (ROOT / "docs" / "debugging-nans.md").read_text()
    assert text.count(plot.NAN_START) == 1 and text.count(plot.NAN_END) == 1
    got = text.split(plot.NAN_START, 1)[1].split(plot.NAN_END, 1)[0].strip("\n")
    assert got == want, "docs/debugging-nans.md's costs are out of date with benchmarks/results/debug_nans.json"
    # every path of both models has its checker's ratio, and the failing step's time is said
    rows = [line for line in want.splitlines() if line.startswith(("| MLP, ", "| char LM, "))]
    assert len(rows) == 6 and all(line.split(" | ")[1].endswith("x") for line in rows)
    assert "failing step" in want and "a normal step" in want


def test_performance_page_is_generated_from_the_committed_results() -> None:
    """docs/performance.md's numbers are exactly what plot.py makes of benchmarks/results/*.json.

    After a new run: python benchmarks/plot.py benchmarks/results/*.json --out-dir docs/images
    --markdown docs/performance.md
    """
    plot = _load("plot")
    files = sorted(RESULTS.glob("*.json"))
    assert files, "benchmarks/results/*.json are committed"
    runs = plot.load(files)
    want = plot.render_markdown(runs, plot.source_names(runs, ROOT))
    text = PAGE.read_text()
    assert text.count(plot.START) == 1 and text.count(plot.END) == 1
    got = text.split(plot.START, 1)[1].split(plot.END, 1)[0].strip("\n")
    assert got == want, (
        "docs/performance.md is out of date with benchmarks/results/*.json: rerun "
        "python benchmarks/plot.py benchmarks/results/*.json --out-dir docs/images --markdown docs/performance.md"
    )
    for name in ("perf_train.svg", "perf_per_op.svg"):
        assert f"images/{name}" in text
        svg = (ROOT / "docs" / "images" / name).read_text()
        dates = {plot.fmt_date(r.date) for r in runs if r.benchmark in ("bench_train", "bench_core")}
        assert any(d in svg for d in dates), f"docs/images/{name} was not rendered from these results"


def test_plot_depth_tables(tmp_path: Path) -> None:
    """bench_depth's records as two tables, one column per depth, with the ratios and issue 45's verdicts."""
    plot = _load("plot")

    def rec(section: str, blocks: int, variant: str, us: float, baseline: str | None) -> dict[str, Any]:
        model = f"GPT-like, {blocks} blocks"
        return {"section": section, "model": model, "variant": variant, "time_us": us, "per": "step"} | {
            "baseline": baseline,
            "ratio": None,
        }

    steady = {"pytorch": (7000.0, 56000.0), "default_loop": (5000.0, 50400.0), "train_step": (4000.0, 40000.0)}
    first = {"default_loop": (4e6, 6e6), "hand_jit": (5e6, 5.5e6)}
    results = [
        rec("depth", b, v, ts[i], None if v == "pytorch" else "pytorch")
        for i, b in enumerate((2, 16))
        for v, ts in steady.items()
    ] + [
        rec("depth_first_step", b, v, ts[i], None if v == "hand_jit" else "hand_jit")
        for i, b in enumerate((2, 16))
        for v, ts in first.items()
    ]
    path = tmp_path / "depth.json"
    path.write_text(
        json.dumps(
            {
                "schema": 1,
                "benchmark": "bench_depth",
                "machine": {"processor": "Test CPU", "cpu_count": 2},
                "date": "2025-03-04T05:06:07+00:00",
                "command": ["benchmarks/bench_depth.py", "--json", "depth.json"],
                "quick": False,
                "results": results,
            }
        )
    )
    runs = plot.load([path])
    text = plot.depth_table(runs)
    assert text is not None
    lines = text.splitlines()
    assert "| per step | 2 blocks | 16 blocks |" in lines
    assert "| PyTorch eager | 7.00 ms | 56.0 ms |" in lines
    assert f"| `Session()` loop | 5.00 ms (0.71{X}) | 50.4 ms (0.90{X}) |" in lines
    assert f"| loop / `train_step` | 1.25{X} | 1.26{X} |" in lines
    assert f"at every depth (met at 2 blocks (0.71{X}); missed at 16 blocks (0.90{X}))" in text
    # time to the end of step 2: the growth over 2 blocks in brackets, the loop over the hand-written step
    assert "| to the end of step 2 | 2 blocks | 16 blocks |" in lines
    assert f"| `Session()` loop | 4.00 s | 6.00 s (1.50{X}) |" in lines
    assert f"| loop / `jax.jit` | 0.80{X} | 1.09{X} |" in lines
    assert f"(missed: 1.50{X})" in text and f"missed at 16 blocks (1.09{X})" in text
    assert "### Depth sweep" in plot.render_markdown(runs, ["depth.json"])
    assert plot.depth_table(plot.load(_synthetic(tmp_path))) is None  # no depth records, no tables
