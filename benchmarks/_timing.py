"""Shared helpers for the benchmark scripts: best-of-k timing (GC paused), formatting, ``--json`` results."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import numpy as np

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as the module ``name``, loaded once per process (the examples folder is not a package)."""
    got = sys.modules.get(name)
    if got is not None:
        return got
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def pin_to_one_core() -> int | None:
    """Run this process (and the threads XLA starts) on one CPU, so every system timed shares one core.

    XLA on CPU uses a second core even when told to run single-threaded; PyTorch is set to one thread.
    Every thread that already exists is pinned too (``import jax`` starts one, and programs dispatched
    asynchronously can run on it: left unpinned, a loop that never waits would have its Python overlap
    with its programs on a second core, which a loop that reads a result every step cannot).
    Returns the core, or None where the platform cannot pin.
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    tasks = Path(f"/proc/{os.getpid()}/task")
    for tid in os.listdir(tasks) if tasks.is_dir() else ():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), {core})
    return core


DISPATCH_ENV = "TAPEFLOW_BENCH_DISPATCH"


def cpu_dispatch() -> str:
    """How JAX dispatches programs on the CPU in this run: ``"sync"`` (the scripts' setting) or ``"async"``.

    On one pinned core JAX's default, asynchronous dispatch, runs every program
    on a second thread of that same core: each op pays a hand-off between two
    threads and nothing overlaps, while PyTorch runs its ops on the calling
    thread. The scripts therefore turn it off (``jax_cpu_enable_async_dispatch``),
    the setting a JAX user picks on one core, for every JAX system they time
    alike; ``TAPEFLOW_BENCH_DISPATCH=async`` keeps JAX's default (child processes
    inherit the choice through the environment).
    """
    return "async" if os.environ.get(DISPATCH_ENV, "sync").strip().lower() == "async" else "sync"


def set_cpu_dispatch() -> str:
    """Apply :func:`cpu_dispatch` to this process (before JAX starts its CPU client) and to its children."""
    mode = cpu_dispatch()
    os.environ[DISPATCH_ENV] = mode
    os.environ["JAX_CPU_ENABLE_ASYNC_DISPATCH"] = "true" if mode == "async" else "false"
    jax.config.update("jax_cpu_enable_async_dispatch", mode == "async")
    return mode


if sys.argv and Path(sys.argv[0]).resolve().parent == Path(__file__).resolve().parent:
    # a benchmark script imports this before it times anything (a test importing it is neither pinned nor set)
    pin_to_one_core()
    set_cpu_dispatch()


def min_of_k(call: Callable[[], Any], n: int, k: int, warmup: int = 1, *, pause_gc: bool = True) -> float:
    """Best over ``k`` repeats of the mean time of ``n`` calls of ``call``, in seconds per call.

    Results are waited for (``jax.block_until_ready``) after the warm-up and after
    each repeat, so asynchronous dispatch is inside the timing.
    """
    out = None
    for _ in range(warmup):
        out = call()
    jax.block_until_ready(out)
    best = float("inf")
    for _ in range(k):
        if pause_gc:
            gc.collect()
            gc.disable()
        try:
            t0 = time.perf_counter()
            for _ in range(n):
                out = call()
            jax.block_until_ready(out)
            best = min(best, (time.perf_counter() - t0) / n)
        finally:
            if pause_gc:
                gc.enable()
    return best


def interleaved(calls: list[Callable[[], Any]], k: int, n: int) -> list[float]:
    """Best time per inner iteration of each of ``calls`` (each runs ``n`` iterations per call).

    Every call is made once first (compilation), then the ``k`` repeats are
    interleaved (call 1, call 2, ..., call 1, ...) so all of them share the
    machine's noise; returns the best repeat of each, divided by ``n``.
    """
    for call in calls:
        call()
    best = [float("inf")] * len(calls)
    for _ in range(k):
        for i, call in enumerate(calls):
            best[i] = min(best[i], min_of_k(call, 1, 1, warmup=0) / n)
    return best


def take_turns(steps: dict[str, Callable[[], Any]], n: int, k: int) -> dict[str, float]:
    """:func:`interleaved` over named steps: the best mean time of ``n`` calls of each, over ``k`` rounds.

    Each step is called once more first, so it has compiled and warmed its caches before its first round.
    """
    for step in steps.values():
        jax.block_until_ready(step())

    def n_calls(step: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            out = None
            for _ in range(n):
                out = step()
            return out  # min_of_k waits for it: every call of the round is inside the timing

        return run

    return dict(zip(steps, interleaved([n_calls(s) for s in steps.values()], k, n)))


def fmt(t: float) -> str:
    """A duration in seconds, as ``s``, ``ms`` or ``us`` in a fixed-width field."""
    if t >= 1.0:
        return f"{t:8.3f} s "
    if t >= 1e-3:
        return f"{t * 1e3:8.3f} ms"
    return f"{t * 1e6:8.2f} us"


def verdict(ok: bool) -> str:
    """``ok`` or ``MISSES TARGET``."""
    return "ok" if ok else "MISSES TARGET"


# --------------------------------------------------------------------------- JSON results
#
# Every script takes ``--json PATH`` and writes one object there (see benchmarks/README.md):
#
#   {"schema": 1, "benchmark": "bench_train", "machine": {...}, "date": "2025-01-01T00:00:00+00:00",
#    "command": ["benchmarks/bench_train.py", "--quick", "--json", "out/train.json"], "quick": true,
#    "results": [{"section": "train", "model": "MLP 784-256-256-10", "variant": "eager",
#                 "time_us": 1234.5, "per": "step", "baseline": "pytorch", "ratio": 1.2}, ...]}
#
# ``ratio`` is always this record's time over the time of the record named by ``baseline``
# (same section and model), filled in when the file is written.

SCHEMA = 1

# The training-step comparison (bench_train.py; variants "eager", "train_step", "pytorch",
# "jax_unjitted"). Another script that times a training step of the same models (a "lazy"
# variant, say) uses these section and model names, and benchmarks/plot.py draws its bars
# next to the others.
TRAIN_SECTION = "train"
TRAIN_MLP = "MLP 784-256-256-10"
TRAIN_AE = "tied autoencoder 784-128"

_REPO = Path(__file__).resolve().parents[1]


def add_json_arg(ap: argparse.ArgumentParser) -> None:
    """The ``--json PATH`` option every benchmark script takes."""
    ap.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="also write the results to PATH as JSON (machine, versions, date, command, one record per timing)",
    )


def _cpu_model() -> str:
    """The CPU's name (``platform.processor()`` is empty on Linux: read /proc/cpuinfo there)."""
    name = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return name


def _version(module: str) -> str | None:
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        mod = sys.modules.get(module)
        return getattr(mod, "__version__", None)


def machine_info() -> dict[str, Any]:
    """Where and with what the benchmark ran: CPU, OS, Python and library versions, XLA settings.

    ``torch``, ``flax`` and ``equinox`` are listed only when the script imported them.
    """
    info: dict[str, Any] = {
        "processor": _cpu_model(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "optax": _version("optax"),
        "numpy": _version("numpy"),
        "tapeflow": _version("tapeflow"),
    }
    for optional in ("torch", "flax", "equinox"):
        if optional in sys.modules:
            info[optional] = getattr(sys.modules[optional], "__version__", None) or _version(optional)
    info["device"] = str(jax.devices()[0])
    info["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    info["cpu_dispatch"] = cpu_dispatch()
    return info


def _command(argv: list[str]) -> list[str]:
    """``argv`` with the script path made relative to the repository when it lies inside it."""
    if not argv:
        return []
    script = Path(argv[0])
    if not script.is_file():
        return list(argv)
    try:
        first = script.resolve().relative_to(_REPO).as_posix()
    except ValueError:
        first = argv[0]
    return [first, *argv[1:]]


class Results:
    """The records of one benchmark run, written as JSON by :meth:`write`.

    >>> r = Results("bench_x")
    >>> r.add("per_op", "add (4,)", "jax_jit", 2e-6, per="op")
    >>> r.add("per_op", "add (4,)", "record", 3e-6, per="op", baseline="jax_jit")
    >>> round(r.records()[1]["ratio"], 3)
    1.5
    """

    def __init__(self, benchmark: str, *, quick: bool = False, argv: list[str] | None = None) -> None:
        self.benchmark = benchmark
        self.quick = quick
        self.argv = list(sys.argv if argv is None else argv)
        self._rows: list[dict[str, Any]] = []

    def add(
        self,
        section: str,
        model: str,
        variant: str,
        seconds: float | None,
        *,
        per: str = "step",
        baseline: str | None = None,
        **extra: Any,
    ) -> None:
        """One timing: ``seconds`` per ``per`` (stored as ``time_us``), or ``None`` for a count-only record."""
        row: dict[str, Any] = {
            "section": section,
            "model": model,
            "variant": variant,
            "time_us": None if seconds is None else round(float(seconds) * 1e6, 4),
            "per": per,
            "baseline": baseline,
            "ratio": None,
        }
        for key, value in extra.items():
            row[key] = float(value) if isinstance(value, np.floating) else value
        self._rows.append(row)

    def records(self) -> list[dict[str, Any]]:
        """The records with ``ratio`` = time / the baseline record's time (same section and model)."""
        times = {(r["section"], r["model"], r["variant"]): r["time_us"] for r in self._rows}
        out = []
        for r in self._rows:
            r = dict(r)
            base = times.get((r["section"], r["model"], r["baseline"]))
            if r["baseline"] is not None and base and r["time_us"] is not None:
                r["ratio"] = round(r["time_us"] / base, 4)
            out.append(r)
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "benchmark": self.benchmark,
            "machine": machine_info(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": _command(self.argv),
            "quick": self.quick,
            "results": self.records(),
        }

    def write(self, path: str | os.PathLike[str] | None) -> None:
        """Write the JSON object to ``path`` (its folder is created); nothing when ``path`` is None."""
        if path is None:
            return
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.as_dict(), indent=2) + "\n")
        print(f"\nresults written to {p}")
