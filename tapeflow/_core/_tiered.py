"""Tiered compilation (opt in): a new program first runs quickly compiled, the optimized build takes over when ready.

XLA's optimization passes are most of a program's compile time: at
``xla_backend_optimization_level=0`` a training step compiles in about 60% of
the time and runs about 3x slower (measured on the MLP 784-256-256-10 step,
CPU). With tiering on (:func:`set_tiered_compilation`, or
``TAPEFLOW_TIERED=1``), the first call of a new program (a lazy session's
program for a new structure or batch shape, a ``train_step`` signature) is
traced and lowered once, compiled at level 0 and run at once, while the fully
optimized build compiles on a background thread (XLA releases the GIL) and
serves every call from the one after it is ready.

Results differ within float32 rounding: the level-0 build does not contract
``a * b + c`` into fused multiply-adds nor fuse reductions the way the
optimized one does, so the steps that run before the switch can differ from
an untiered run in the last bits, and *which* steps those are depends on how
fast the background compile finishes. That is why it is off by default: with
it off, every run of a script computes the same bits.

>>> import tapeflow as tfl
>>> before = tfl.set_tiered_compilation(True)
>>> tfl.set_tiered_compilation(before)
True
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Hashable, Sequence

import jax

from . import _compile_log
from ._typing import PyTree

__all__ = ["FAST_OPTIONS", "Tiered", "maybe_tiered", "set_tiered_compilation", "tiered_enabled"]

FAST_OPTIONS = {"xla_backend_optimization_level": 0}
"""The XLA options of the first, quickly compiled build."""

_enabled = os.environ.get("TAPEFLOW_TIERED", "").strip() not in ("", "0")


def set_tiered_compilation(enabled: bool) -> bool:
    """Turn tiered compilation on or off for programs compiled from now on; returns the previous setting."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"set_tiered_compilation: expected True or False, got {enabled!r}")
    old, _enabled = _enabled, enabled
    return old


def tiered_enabled() -> bool:
    """Whether programs compiled now are tiered (:func:`set_tiered_compilation`)."""
    return _enabled


class _Build:
    """One signature's two builds: level 0 at once, the optimized one from a background thread when ready."""

    __slots__ = ("fast", "full", "thread")

    def __init__(self) -> None:
        self.fast: Callable[..., PyTree] | None = None
        self.full: Callable[..., PyTree] | None = None
        self.thread: threading.Thread | None = None

    def __call__(self, *dynamic: PyTree) -> PyTree:
        return (self.full or self.fast)(*dynamic)  # type: ignore[misc]


class Tiered:
    """A jitted function whose every new signature is compiled in two tiers (see the module docstring).

    ``static_argnums`` are the jitted function's static positions (part of a
    signature, dropped when calling a compiled build). The last signature
    called is tried first; a call that does not fit it (another shape) costs
    one signature lookup.
    """

    __slots__ = ("_builds", "_current", "_jitted", "_lock", "_static")

    def __init__(self, jitted: Callable[..., PyTree], static_argnums: Sequence[int] = ()) -> None:
        self._jitted = jitted
        self._static = frozenset(static_argnums)
        self._builds: dict[Hashable, _Build] = {}
        self._current: tuple[tuple[PyTree, ...], _Build] | None = None  # the last call's static values, build
        self._lock = threading.Lock()

    def _dynamic(self, args: tuple[PyTree, ...]) -> tuple[PyTree, ...]:
        return tuple(a for i, a in enumerate(args) if i not in self._static) if self._static else args

    def _signature(self, args: tuple[PyTree, ...]) -> Hashable:
        leaves, treedef = jax.tree_util.tree_flatten(self._dynamic(args))
        return treedef, tuple(jax.typeof(x) for x in leaves), self._statics(args)

    def _statics(self, args: tuple[PyTree, ...]) -> tuple[PyTree, ...]:
        return tuple(a for i, a in enumerate(args) if i in self._static) if self._static else ()

    def __call__(self, *args: PyTree) -> PyTree:
        cur = self._current
        # a compiled build checks the dynamic arguments' structure, shapes and dtypes itself; static ones here
        if cur is not None and cur[0] == self._statics(args):
            try:
                return cur[1](*self._dynamic(args))
            except (TypeError, ValueError):  # another signature (or placement) than the last one: look it up
                pass
        key = self._signature(args)
        with self._lock:
            b = self._builds.get(key)
            if b is None or b.fast is None:
                b = self._builds[key] = _Build()
                out = self._first(b, args)
                self._current = (self._statics(args), b)
                return out
        self._current = (self._statics(args), b)
        return b(*self._dynamic(args))

    def _first(self, b: _Build, args: tuple[PyTree, ...]) -> PyTree:
        lowered = self._jitted.lower(*args)  # type: ignore[attr-defined]
        notes = _compile_log.pending_notes()  # what was traced, for the background compile's log line too
        _compile_log.adopt_notes(notes, "(level-0 build)")
        b.fast = lowered.compile(compiler_options=FAST_OPTIONS)
        out = b.fast(*self._dynamic(args))

        def optimize() -> None:
            _compile_log.adopt_notes(notes, "(optimized build, in the background)")
            # on failure the level-0 build, which compiled the same program, keeps serving
            with contextlib.suppress(Exception):
                b.full = lowered.compile()

        # not a daemon: the interpreter waits for a compile in flight instead of tearing XLA down under it
        b.thread = threading.Thread(target=optimize, name="tapeflow-compile")
        b.thread.start()
        return out

    def wait(self) -> None:
        """Block until every optimized build started so far is ready (or failed)."""
        for b in list(self._builds.values()):
            if b.thread is not None:
                b.thread.join()

    def optimized(self) -> bool:
        """Whether the last signature called runs its optimized build."""
        return self._current is not None and self._current[1].full is not None


def maybe_tiered(jitted: Callable[..., PyTree], static_argnums: Sequence[int] = ()) -> Callable[..., PyTree]:
    """``jitted`` itself, or a :class:`Tiered` wrapper of it while tiered compilation is on."""
    return Tiered(jitted, static_argnums) if _enabled else jitted
