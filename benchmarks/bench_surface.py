"""PyTorch surface benchmark: a Tensor method against the ``tfl.<fn>`` function it is bound from.

The surface table (``tapeflow/_shell/_surface.py``) binds each PyTorch-named
Tensor method as the very function ``tfl.<name>`` is, so ``x.sum(1)`` should
cost what ``tfl.sum(x, 1)`` costs: per call, on an eager session, each case
records the same op(s) both ways. Cases: ``sum(1)``, ``transpose(0, 1)``,
``max(1)`` (the ``(values, indices)`` pair), ``softmax(1)`` and ``var()`` on a
(32, 64) float32 tensor. Target: a method costs at most 1.05x the function.

Both variants of a case take turns (best of ``k`` rounds of ``n`` calls each)
on one pinned core with synchronous CPU dispatch (see ``_timing.py``); the
session is reset between cases. Ratios and targets are printed, never asserted.

Usage::

    python benchmarks/bench_surface.py            # full run
    python benchmarks/bench_surface.py --quick    # a few seconds
    python benchmarks/bench_surface.py --json benchmarks/results/surface.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from _timing import Results, add_json_arg, fmt, take_turns, verdict

import tapeflow as tfl

TARGET = 1.05
SHAPE = (32, 64)


def cases() -> list[tuple[str, Callable[[Any], Any], Callable[[Any], Any]]]:
    """(label, method call, function call) per case."""
    return [
        ("sum(1)", lambda x: x.sum(1), lambda x: tfl.sum(x, 1)),
        ("transpose(0, 1)", lambda x: x.transpose(0, 1), lambda x: tfl.transpose(x, 0, 1)),
        ("max(1)", lambda x: x.max(1), lambda x: tfl.max(x, 1)),
        ("softmax(1)", lambda x: x.softmax(1), lambda x: tfl.softmax(x, 1)),
        ("var()", lambda x: x.var(), lambda x: tfl.var(x)),
    ]


def bench(n: int, k: int) -> list[tuple[str, float, float]]:
    data = np.random.default_rng(0).normal(size=SHAPE).astype(np.float32)
    s = tfl.Session(lazy=False)  # each call runs its op: the binding's cost shows
    out = []
    for label, method, function in cases():
        s.reset()
        x = s.input(jnp.asarray(data), requires_grad=True)
        got = take_turns({"function": lambda: function(x), "method": lambda: method(x)}, n, k)
        out.append((label, got["function"], got["method"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short run (a few seconds)")
    add_json_arg(ap)
    args = ap.parse_args()
    res = Results("bench_surface", quick=args.quick)
    n, k = (200, 3) if args.quick else (500, 15)
    print(f"Tensor method vs the tfl function it binds, eager, {SHAPE} float32 ({n} calls/round, best of {k})")
    print(f"   {'case':<18}{'tfl.<fn>(x)':>14}{'x.<fn>()':>12}{'ratio':>9}   target <= {TARGET}x")
    for label, tf, tm in bench(n, k):
        ratio = tm / tf
        print(f"   {label:<18}{fmt(tf):>14}{fmt(tm):>12}{ratio:>8.3f}x   {verdict(ratio <= TARGET)}")
        res.add("method_vs_function", label, "function", tf, per="call")
        res.add(
            "method_vs_function", label, "method", tm, per="call", baseline="function", target=f"<= {TARGET}x function"
        )
    res.write(args.json)


if __name__ == "__main__":
    main()
