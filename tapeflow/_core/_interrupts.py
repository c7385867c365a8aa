"""Blocks that Ctrl-C cannot cut in half.

A training step writes new parameter values, the optimizer state and its own
counters one after another. A ``KeyboardInterrupt`` landing between two of those
writes would leave a mix of old and new state. :class:`deferred_interrupts`
holds SIGINT for the duration of such a block and delivers it right after, so
the interrupted program sees either everything written or nothing.
"""

from __future__ import annotations

import importlib
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import TypeAlias

__all__ = ["deferred_interrupts"]

Handler: TypeAlias = "Callable[[int, FrameType | None], object] | int | None"
"""A SIGINT disposition: a Python handler, ``SIG_DFL``/``SIG_IGN``, or None (not set from Python)."""

# The C functions behind `signal.signal` / `signal.raise_signal`, without their enum round trips
# (those cost ~10 us per block; these two calls cost well under one).
_c_signal = importlib.import_module("_signal")
_set_handler: Callable[[int, Handler], Handler] = _c_signal.signal
_raise_signal: Callable[[int], None] = _c_signal.raise_signal
_SIGINT = int(signal.SIGINT)
_MAIN = threading.main_thread().ident


class deferred_interrupts:
    """Hold off SIGINT (Ctrl-C) until the block ends, then deliver it.

    Python runs signal handlers in the main thread only, so in any other thread
    the block runs unchanged (no ``KeyboardInterrupt`` can land there). Blocks
    nest: an inner block leaves the signal to the outer one, which delivers it
    as it ends. The outermost block costs two C-level ``signal`` calls, an inner
    one none, so a compiled step can afford them on every call.

    >>> with deferred_interrupts():
    ...     x = 1 + 1
    >>> x
    2
    """

    __slots__ = ("_active", "_held", "_previous")
    _previous: Handler
    _open = 0  # blocks open in the main thread: an inner one leaves the outer one's handler holding the signal

    def __enter__(self) -> None:
        self._active = self._held = False
        if threading.get_ident() != _MAIN:
            return
        if deferred_interrupts._open:  # nested: the outer block holds a Ctrl-C and delivers it as it ends
            deferred_interrupts._open += 1
            return
        try:
            self._previous = _set_handler(_SIGINT, self._hold)
        except ValueError:  # not the main interpreter: signals cannot be handled here
            return
        self._active = True
        deferred_interrupts._open = 1

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        self._held = True

    def __exit__(self, *exc: object) -> None:
        if not self._active:
            if deferred_interrupts._open > 1:  # an inner block of the main thread
                deferred_interrupts._open -= 1
            return
        deferred_interrupts._open = 0
        previous = self._previous
        _set_handler(_SIGINT, signal.SIG_DFL if previous is None else previous)
        if self._held:
            _raise_signal(_SIGINT)  # the previous handler runs now (KeyboardInterrupt by default)
