"""Every compile, explained: what compiled, why, and how long it took; a warning when one keeps recompiling.

JAX reports each trace, lowering and XLA compile through :mod:`jax.monitoring`
(with the jitted function's name), and a hit of the persistent compilation
cache as an event. This module listens to those reports (installed at import;
they arrive only while something compiles, never on a cached call) and joins
them with what tapeflow knew when it traced the function: each function
tapeflow compiles calls :func:`traced` while it is traced (Python that runs
only at trace time, so a compiled call pays nothing), naming

* **what** compiled (``op kernel linear``, ``VJP kernel linear``, ``lazy step program``,
  ``train_step loss_fn``, ``optimizer update``),
* a **key**: which compiles count as the same function compiling again (a
  ``TrainStep``; a lazy recording's ops without their shapes; an optimizer's
  structure), and
* its **signature**: labelled shapes, dtypes and static values, compared with
  the last compile of the same key to say **why** it compiled again
  (``new shape of argument 1: (64, 784) -> (37, 784)``).

When the XLA compile of that function ends (or the cache served it), one
:class:`CompileRecord` is made. :func:`compile_log` prints them (or collects
them); ``TAPEFLOW_EXPLAIN_COMPILES=1`` prints them from import on. A key that
compiles for more distinct signatures than :func:`set_recompile_warning`'s
bound (default :data:`DEFAULT_WARN_AFTER`) in one process warns once with a
:class:`RecompileWarning` that names the changing argument and the fix. An op
kernel is keyed by its op, attributes and operand shapes, without the first
axis of operands with two or more (a model has a kernel per layer shape by design; one kernel compiled for
many batch sizes is the recompile to warn about), and all kernels share one
warning.

>>> import jax.numpy as jnp, tapeflow as tfl
>>> with tfl.compile_log(file=None) as log:
...     # a new op kernel, or one already compiled
...     _ = tfl.Session().input(jnp.ones(3)) * 7.5
>>> all(isinstance(r, tfl.CompileRecord) for r in log.records)
True
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import threading
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple, TextIO

import jax

__all__ = [
    "DEFAULT_WARN_AFTER",
    "STDERR",
    "CompileLog",
    "CompileRecord",
    "RecompileWarning",
    "SigEntry",
    "adopt_notes",
    "arrays",
    "compile_log",
    "install",
    "pending_notes",
    "set_recompile_warning",
    "traced",
    "tree_signature",
]

DEFAULT_WARN_AFTER = 8
"""A function compiled for more signatures than this in one process warns (:class:`RecompileWarning`)."""

_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILE = "/jax/core/compile/backend_compile_duration"
_HIT = "/jax/compilation_cache/cache_hits"
_MAX_KEYS = 4096  # keys remembered for "why"; beyond it the oldest are forgotten (their next compile says "first")

SigEntry = tuple[str, str, object]
"""One labelled part of a compile's signature: ``(label, kind, value)``, kind ``shape``, ``dtype``, ``static`` or ``structure``."""


class RecompileWarning(UserWarning):
    """One function compiled for more signatures than :func:`set_recompile_warning`'s bound (new shapes, most often)."""


class CompileRecord(NamedTuple):
    """One compile: ``what`` compiled, ``why``, ``seconds`` (trace, lowering and XLA compile or cache read),
    whether the persistent cache served it (``cached``), and ``times``: compiles of its key so far."""

    what: str
    why: str
    seconds: float
    cached: bool
    times: int

    def __str__(self) -> str:
        if not self.cached:
            return f"tapeflow: compiled {self.what} in {self.seconds:.3f} s: {self.why}"
        # ``why`` counts this process's compiles: a program an earlier process compiled is its first here
        why = "first time in this process" if self.why == "first time" else self.why
        return f"tapeflow: read {self.what} from the compilation cache in {self.seconds:.3f} s: {why}"


class _Note(NamedTuple):
    what: str
    why: str
    times: int
    shapes: int  # distinct signatures of its key so far (what the warning counts)
    group: Hashable  # warned about once per group (None: never)


class _Counts:
    """Per key: how many compiles, the last signature and the distinct ones (bounded, oldest forgotten first);
    the groups that warned."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: dict[Hashable, tuple[int, tuple[SigEntry, ...], frozenset[int]]] = {}
        self.warned: set[Hashable] = set()


_counts = _Counts()
_local = threading.local()
_warn_after: int | None = DEFAULT_WARN_AFTER
_sinks: list[CompileLog] = []  # active logs, innermost last
_installed = False


def _thread() -> threading.local:
    t = _local
    if not hasattr(t, "notes"):
        t.notes = {}  # jax function name -> the note of its last trace
        t.seconds = {}  # jax function name -> trace + lowering seconds so far
        t.hit = False
    return t


def arrays(named: Sequence[tuple[str, object]]) -> list[SigEntry]:
    """Signature entries of labelled values: shape and dtype of each array (or ShapeDtypeStruct), else its value."""
    out: list[SigEntry] = []
    for label, x in named:
        shape = getattr(x, "shape", None)
        if shape is not None and hasattr(x, "dtype"):
            out.append((label, "shape", tuple(shape)))
            out.append((label, "dtype", str(x.dtype)))
        else:
            out.append((label, "static value", x))
    return out


def tree_signature(tree: object, label: str) -> list[SigEntry]:
    """Signature entries of a pytree's leaves (``"<label> <i>"``): shape, dtype and weak type of each.

    >>> import jax.numpy as jnp
    >>> [kind for _, kind, _ in tree_signature({"mu": jnp.zeros(2)}, "optimizer state leaf")]
    ['shape', 'dtype', 'weak type']
    """
    out: list[SigEntry] = []
    for i, x in enumerate(jax.tree_util.tree_leaves(tree)):
        name = f"{label} {i}"
        out += arrays([(name, x)])
        out.append((name, "weak type", bool(getattr(getattr(x, "aval", x), "weak_type", False))))
    return out


def _why(old: tuple[SigEntry, ...] | None, new: tuple[SigEntry, ...]) -> str:
    if old is None:
        return "first time"
    before = {(label, kind): v for label, kind, v in old}
    changes: list[str] = []
    for label, kind, v in new:
        if (label, kind) not in before:
            changes.append(f"new {label}")
            continue
        was = before.pop((label, kind))
        if was != v:
            changes.append(f"new structure: {v}" if kind == "structure" else f"new {kind} of {label}: {was} -> {v}")
    changes += sorted({f"no {label} any more" for label, _ in before})
    if not changes:
        return "the same signature again (its compiled program was dropped: an evicted cache entry or jax.clear_caches)"
    more = f" (and {len(changes) - 2} more)" if len(changes) > 2 else ""
    return "; ".join(changes[:2]) + more


def traced(
    name: str,
    what: str,
    key: Hashable,
    signature: Sequence[SigEntry] | Callable[[], Sequence[SigEntry]],
    *,
    group: Hashable = "key",
) -> None:
    """Call while tracing jax function ``name``: its compile is ``what``, counted under ``key``, with ``signature``.

    ``signature`` may be a function (called here, at trace time only). A key
    that compiles for more signatures than the bound warns once per ``group`` (default: the
    key itself; None: never), so kernels of many ops can share one warning.
    """
    sig = tuple(signature() if callable(signature) else signature)
    h = hash(repr(sig))  # a compile of a signature seen before (a dropped program) is no new shape
    with _counts.lock:
        got = _counts.seen.pop(key, None)
        count, old, distinct = (0, None, frozenset()) if got is None else got
        why = _why(old, sig)
        if h not in distinct and len(distinct) <= 64:  # past the bound, only "more than it" matters
            distinct = distinct | {h}
        _counts.seen[key] = (count + 1, sig, distinct)
        while len(_counts.seen) > _MAX_KEYS:
            del _counts.seen[next(iter(_counts.seen))]
    _thread().notes[name] = _Note(what, why, count + 1, len(distinct), key if group == "key" else group)


def pending_notes() -> dict[str, object]:
    """This thread's notes of traced functions not compiled yet (to hand to a thread that compiles them)."""
    return dict(_thread().notes)


def adopt_notes(notes: dict[str, object], suffix: str) -> None:
    """Make ``notes`` (from :func:`pending_notes`) this thread's, each ``what`` followed by ``suffix``."""
    t = _thread()
    for name, note in notes.items():
        if isinstance(note, _Note):
            t.notes[name] = _Note(f"{note.what} {suffix}", note.why, note.times, note.shapes, None)


def _on_duration(event: str, duration_secs: float, **kwargs: str | int) -> None:
    if event not in (_TRACE, _LOWER, _COMPILE):
        return
    name = str(kwargs.get("fun_name", ""))
    if name.startswith("jit(") and name.endswith(")"):
        name = name[4:-1]
    t = _thread()
    if event != _COMPILE:
        t.seconds[name] = t.seconds.get(name, 0.0) + duration_secs
        return
    total = t.seconds.pop(name, 0.0) + duration_secs
    hit, t.hit = t.hit, False
    note = t.notes.pop(name, None)
    if note is None:
        rec = CompileRecord(f"jax function {name}", "compiled outside tapeflow's kernels", total, hit, 1)
    else:
        rec = CompileRecord(note.what, note.why, total, hit, note.times)
        _maybe_warn(note)
    for sink in list(_sinks):
        sink.add(rec)


def _on_scalar(event: str, value: float | int, **kwargs: str | int) -> None:
    """The start of a trace, lowering or compile (JAX reports the start time as a scalar)."""
    if event != _COMPILE or not _sinks:
        return
    name = str(kwargs.get("fun_name", ""))
    if name.startswith("jit(") and name.endswith(")"):
        name = name[4:-1]
    note = _thread().notes.get(name)
    what = f"jax function {name}" if note is None else note.what
    for sink in list(_sinks):
        sink.start(what)


def _on_event(event: str, **kwargs: str | int) -> None:
    if event == _HIT:
        _thread().hit = True


def _outside_frames() -> int:
    """The ``stacklevel`` of the first caller outside tapeflow and JAX (the user's line that compiled)."""
    skip = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(jax.__file__))
    here = inspect.currentframe()
    f = here.f_back if here is not None else None  # the caller: what stacklevel=1 names
    level = 1
    while f is not None and f.f_code.co_filename.startswith(skip) and f.f_back is not None:
        f, level = f.f_back, level + 1
    return level


def _maybe_warn(note: _Note) -> None:
    bound = _warn_after
    if bound is None or note.group is None or note.shapes <= bound:
        return
    with _counts.lock:
        if note.group in _counts.warned:
            return
        _counts.warned.add(note.group)
    warnings.warn(
        f"tapeflow: {note.what} compiled for {note.shapes} different signatures in this process, this time "
        f"because {note.why}. "
        "Each new shape compiles a new program: give every step the same shapes (pad the last batch to the batch "
        "size with a mask, or drop it: drop_last=True; bucket sequence lengths to a few sizes). "
        "tfl.compile_log() lists every compile; tfl.set_recompile_warning(None) silences this",
        RecompileWarning,
        stacklevel=_outside_frames(),
    )


def install() -> None:
    """Listen to JAX's compile reports (once per process; starts no backend). Called at import."""
    global _installed
    if _installed:
        return
    _installed = True
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)
    jax.monitoring.register_scalar_listener(_on_scalar)
    if os.environ.get("TAPEFLOW_EXPLAIN_COMPILES", "").strip() not in ("", "0"):
        _sinks.append(CompileLog(sys.stderr))


def set_recompile_warning(after: int | None) -> int | None:
    """Warn when one function compiled for more than ``after`` signatures (None: never); returns the previous bound.

    A signature counts once: compiling one again after its program was dropped
    (``jax.clear_caches``, an evicted kernel) is not what the warning is about.

    >>> import tapeflow as tfl
    >>> old = tfl.set_recompile_warning(2)
    >>> tfl.set_recompile_warning(old)
    2
    """
    global _warn_after
    if after is not None and (isinstance(after, bool) or not isinstance(after, int) or after < 1):
        raise ValueError(f"set_recompile_warning: expected a positive int or None, got {after!r}")
    old, _warn_after = _warn_after, after
    return old


class CompileLog:
    """The compiles seen while this log is active: :attr:`records`, each also printed to ``file`` (None: not printed).

    ``on_start(what)`` is called when an XLA compile begins (in the thread that
    compiles, before it blocks), ``on_end(record)`` when it ended: a progress
    bar can say "compiling" meanwhile, and leave the compile out of its rate.
    """

    def __init__(
        self,
        file: TextIO | None,
        on_start: Callable[[str], None] | None = None,
        on_end: Callable[[CompileRecord], None] | None = None,
    ) -> None:
        self.file = file
        self.on_start = on_start
        self.on_end = on_end
        self.records: list[CompileRecord] = []
        self._lock = threading.Lock()

    def add(self, rec: CompileRecord) -> None:
        with self._lock:
            self.records.append(rec)
        if self.file is not None:
            print(rec, file=self.file, flush=True)
        if self.on_end is not None:
            self.on_end(rec)

    def start(self, what: str) -> None:
        """An XLA compile of ``what`` begins (see ``on_start``)."""
        if self.on_start is not None:
            self.on_start(what)

    def tapeflow_records(self) -> list[CompileRecord]:
        """The records of functions tapeflow compiled (not the user's own ``jax.jit`` s or JAX internals)."""
        return [r for r in self.records if not r.what.startswith("jax function ")]

    def stop(self) -> None:
        """Stop collecting (and printing)."""
        with contextlib.suppress(ValueError):
            _sinks.remove(self)

    def __enter__(self) -> CompileLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"CompileLog({len(self.records)} compiles)"


class _Stderr:
    """The default ``file`` of :func:`compile_log`: whatever ``sys.stderr`` is when the log starts."""

    def __repr__(self) -> str:
        return "sys.stderr"


STDERR = _Stderr()


def compile_log(
    file: TextIO | _Stderr | None = STDERR,
    *,
    on_start: Callable[[str], None] | None = None,
    on_end: Callable[[CompileRecord], None] | None = None,
) -> CompileLog:
    """Print one line per compile from now on (to ``file``, default stderr; None: collect only); returns the log.

    Each line says what compiled (an op kernel, a lazy program, a ``train_step``,
    an optimizer update, or a JAX function tapeflow did not make), why (first
    time; a new shape, dtype or static value of which argument; a new structure),
    how long it took, and whether the persistent compilation cache served it.
    Use it as a context manager to log a block, or call :meth:`CompileLog.stop`.
    ``on_start(what)`` and ``on_end(record)`` are called as each compile begins
    and ends (``examples/demo.py``'s progress bar says "compiling" with them).
    ``TAPEFLOW_EXPLAIN_COMPILES=1`` logs every compile to stderr from import on.

    >>> import jax, jax.numpy as jnp, tapeflow as tfl
    >>> f = jax.jit(lambda x: x * 2)
    >>> x3, x4 = jnp.ones(3), jnp.ones(4)
    >>> # a function tapeflow did not make: what, not why
    >>> with tfl.compile_log(file=None) as log:
    ...     _ = f(x3), f(x4), f(x3)
    >>> [r.what for r in log.records]
    ['jax function <lambda>', 'jax function <lambda>']
    """
    log = CompileLog(sys.stderr if isinstance(file, _Stderr) else file, on_start, on_end)
    _sinks.append(log)
    return log
