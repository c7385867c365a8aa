"""Shared timing helpers for the benchmark scripts (best-of-k, GC paused while timing)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import jax


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
