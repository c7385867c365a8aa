"""``debug_nans``: what it costs when nothing is wrong, and how long it takes to name the origin when something is.

Two models of ``bench_lazy.py`` are trained with the same loop body as there (Adam, lr 1e-3,
float32): the MLP 784-256-256-10 (batch 64) and the char-level LM of ``examples/char_lm.py``
(tied embedding, 2 blocks of 64, context 48, batch 32). Each is timed with ``debug_nans`` off
and on, in an eager session, a lazy session and ``tfl.train_step``, the two settings
interleaved repeat by repeat so machine noise hits them alike. For comparison, in the same run:

* ``jax_debug_nans``: JAX's own NaN checker (``jax.config.update("jax_debug_nans", True)``)
  on the ``train_step`` program and on the eager session, against the same step with it off;
* ``torch.autograd.set_detect_anomaly(True)`` on the PyTorch twin of each model
  (``torch.set_num_threads(1)``), against the same step without it.

Targets (issue 23), no NaN occurring: ``debug_nans=True`` at most 1.05x ``debug_nans=False``
in eager sessions and at most 1.03x in lazy sessions and ``train_step``.

A third row per path, ``+wait``, is the plain step waiting for its results every step (as a
loop that logs its loss each step does): a ``debug_nans`` step reads its one flag before it
writes anything, so it waits every step too, which a loop that never reads a result does not.

Then one label of the char LM's batch is put out of range (``cross_entropy`` makes a NaN) and
the time of the failing step (the flag fails, the origin is searched for and located, the
error is built, nothing is written) is reported next to a normal step, on every path.

Timing is min-of-k (best of ``k`` repeats, each the mean over ``n`` steps); times are printed,
never asserted. XLA runs single-threaded like PyTorch, and the process is pinned to one core.

Usage::

    python benchmarks/bench_debug_nans.py              # full (a few minutes)
    python benchmarks/bench_debug_nans.py --quick      # about a minute, mostly compilation
    python benchmarks/bench_debug_nans.py --json out/debug_nans.json
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _timing import TRAIN_MLP, Results, add_json_arg, fmt, take_turns, verdict
from bench_lazy import LM, LR, MLP, LMModel, Model, torch

import tapeflow as tfl

SECTION = "debug_nans"
LOCATE = "debug_nans_locate"
TARGET_EAGER = 1.05
TARGET_COMPILED = 1.03  # lazy sessions and train_step
PATHS = ("eager", "lazy", "train_step")


def models() -> list[Model]:
    return [MLP((784, 256, 256, 10), 64, TRAIN_MLP, False), LMModel()]


def tapeflow_step(m: Model, path: str, debug: bool, y: Any = None) -> Callable[[], Any]:
    """A fresh copy of ``m``'s parameters trained on ``path`` with ``debug_nans=debug`` (labels ``y``, or the model's)."""
    ps = m.params()  # type: ignore[attr-defined]
    opt = tfl.Optimizer(optax.adam(LR), ps)
    loss_fn = m.make_loss(ps)  # type: ignore[attr-defined]
    x, y = jnp.asarray(m.x), jnp.asarray(m.y if y is None else y)  # type: ignore[attr-defined]
    if path == "train_step":
        compiled = tfl.train_step(loss_fn, opt, debug_nans=debug)
        return lambda: compiled(x, y)
    s = tfl.Session(lazy=path == "lazy", debug_nans=debug)
    storages = opt.storages

    def step() -> Any:
        with s:
            opt.step(s.backward(loss_fn(s, x, y)))
        return [st.read(None) for st in storages]

    return step


def _waiting(step: Callable[[], Any]) -> Callable[[], Any]:
    """``step`` that waits for its results every step, as a loop that reads its loss each step does.

    ``debug_nans`` reads one flag per step, so it waits too; this row shows how much of its cost is that wait.
    """

    def run() -> Any:
        return jax.block_until_ready(step())

    return run


def _with_jax_debug_nans(step: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        jax.config.update("jax_debug_nans", True)
        try:
            return jax.block_until_ready(step())
        finally:
            jax.config.update("jax_debug_nans", False)

    return run


def _with_detect_anomaly(step: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        assert torch is not None
        torch.autograd.set_detect_anomaly(True)
        try:
            return step()
        finally:
            torch.autograd.set_detect_anomaly(False)

    return run


def time_to_locate(m: LMModel, path: str, k: int) -> tuple[float, tfl.NonFiniteError]:
    """Best over ``k`` of one failing step (an out-of-range label) with ``debug_nans=True``: seconds and the error."""
    y = np.array(m.y)
    y[3, 17] = LM["vocab"]  # one label past the last class
    step = tapeflow_step(m, path, True, y)

    def fail() -> tuple[float, tfl.NonFiniteError]:
        t0 = time.perf_counter()
        try:
            step()
        except tfl.NonFiniteError as e:
            return time.perf_counter() - t0, e
        raise AssertionError(f"{path}: the out-of-range label was not reported")

    fail()  # the first failure compiles the failing path's programs: not counted
    best, err = min((fail() for _ in range(k)), key=lambda r: r[0])
    return best, err


def main(argv: list[str] | None = None) -> Results:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few repeats (numbers are rough)")
    add_json_arg(ap)
    args = ap.parse_args(argv)
    n, k = (5, 2) if args.quick else (20, 7)
    res = Results("bench_debug_nans", quick=args.quick)
    print(f"tapeflow {tfl.__version__}, jax {jax.__version__}, torch {None if torch is None else torch.__version__}")
    print("Step time with no NaN, debug on vs off (interleaved):")
    for m in models():
        steps: dict[str, Callable[[], Any]] = {}
        for path in PATHS:
            steps[path] = tapeflow_step(m, path, False)
            steps[f"{path}+debug_nans"] = tapeflow_step(m, path, True)
            steps[f"{path}+wait"] = _waiting(tapeflow_step(m, path, False))
        for path in ("eager", "train_step"):
            steps[f"{path}+jax_debug_nans"] = _with_jax_debug_nans(tapeflow_step(m, path, False))
        tstep = m.torch_step()
        if tstep is not None:
            steps["pytorch"] = tstep
            steps["pytorch+detect_anomaly"] = _with_detect_anomaly(m.torch_step())  # type: ignore[arg-type]
        times = take_turns(steps, n, k)
        print(f"  {m.name}")
        for variant, t in times.items():
            base = variant.split("+")[0] if "+" in variant else None
            target = None
            if variant.endswith("+debug_nans"):
                target = TARGET_EAGER if base == "eager" else TARGET_COMPILED
            extra = {} if target is None else {"target": f"<= {target}x {base}"}
            res.add(SECTION, m.name, variant, t, baseline=base, **extra)
            if base is None:
                print(f"    {variant:26s} {fmt(t)}")
                continue
            ratio = t / times[base]
            tail = "" if target is None else f"  target <= {target}x: {verdict(ratio <= target)}"
            print(f"    {variant:26s} {fmt(t)}  {ratio:5.3f}x {base}{tail}")
    print()
    print("Time to locate: one char-LM step with an out-of-range label, debug_nans=True, vs a normal step:")
    lm = LMModel()
    normal = take_turns({p: tapeflow_step(lm, p, True) for p in PATHS}, n, max(2, k // 2))
    for path in PATHS:
        t, err = time_to_locate(lm, path, max(2, k // 2))
        res.add(LOCATE, lm.name, f"{path}_normal", normal[path])
        res.add(LOCATE, lm.name, f"{path}_failing", t, baseline=f"{path}_normal", op=err.op, where=str(err.where))
        print(
            f"  {path:10s} failing step {fmt(t)} (normal {fmt(normal[path])}, {t / normal[path]:6.1f}x): "
            f"{err.phase} {err.op} at {err.where}"
        )
    res.write(args.json)
    return res


if __name__ == "__main__":
    main()
