"""Attention on XLA:CPU against PyTorch: the ``attention`` op alone and the char LM's training step.

Two sections, every variant of a section interleaved repeat by repeat, min-of-k:

* ``attention``: scaled dot-product attention at the char LM's shapes (batch 32, 4 heads, 48
  positions, head width 16, causal), the forward alone and the forward with its backward as one
  program, for
  - ``tapeflow``: the registry op's forward and hand-written VJP under one ``jax.jit`` (what a
    compiled step traces: ``train_step``, a lazy session), layout ``(B, H, T, D)``;
  - ``jax_nn``: ``jax.nn.dot_product_attention(implementation="xla")`` and ``jax.vjp`` of it, in its
    own layout ``(B, T, H, D)`` (no transposes added);
  - ``pytorch`` (the baseline): ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``,
    under ``torch.no_grad`` for the forward, ``.backward(g)`` for both.
* ``char_lm``: one training step (forward, backward, Adam) of the char LM of ``examples/char_lm.py``
  (vocabulary 80, context 48, width 64, 4 heads, 2 blocks, batch 32), with ``bench_lazy.py``'s model
  and PyTorch twin: ``train_step`` (``tfl.train_step``), ``default_loop`` (``with s:
  opt.step(s.backward(loss_fn(s, x, y)))`` on a lazy ``tfl.Session``, the session a user gets) and
  ``pytorch`` (the baseline).

Target (issue 45, item 2; printed, never asserted): ``train_step`` and the default loop at most 0.8x
PyTorch eager on the char LM.

``--profile`` also prints where the char LM's compiled step spends its time: the HLO's thunks
(fusions, library calls, copies) grouped by the tapeflow op whose lowering produced them, each thunk
at its fastest over the traced steps (``jax.profiler``'s trace of XLA:CPU's thunk executor), and how
many of them are layout copies (transposes).

JAX runs with its default (asynchronous) CPU dispatch, as a user runs it and as issue 45's targets are
stated; ``TAPEFLOW_BENCH_DISPATCH=sync`` gives synchronous dispatch instead. XLA is single-threaded,
PyTorch at one thread, the process pinned to one core.

Usage::

    python benchmarks/bench_attention.py                 # full (about two minutes)
    python benchmarks/bench_attention.py --quick         # rough numbers, about a minute
    python benchmarks/bench_attention.py --profile       # and the compiled step's time by op
    python benchmarks/bench_attention.py --clock cpu     # CPU time, on a machine shared with busy neighbours
    python benchmarks/bench_attention.py --json benchmarks/results/attention.json
"""

from __future__ import annotations

import argparse
import collections
import gc
import gzip
import json
import os
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
os.environ.setdefault("TAPEFLOW_BENCH_DISPATCH", "async")  # JAX's default, as issue 45's targets are stated
os.environ.pop("TAPEFLOW_LAZY", None)  # the default loop is the default session

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _timing import Results, add_json_arg, fmt, take_turns, verdict
from bench_lazy import LM, LMModel, tapeflow_step

import tapeflow as tfl

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover - torch is a dev dependency
    torch = None

TARGET_VS_TORCH = 0.8
REPEATS = 15  # k of min-of-k, as bench_lazy.py
SHAPE = (LM["batch"], LM["heads"], LM["context"], LM["dim"] // LM["heads"])  # (B, H, T, D)
ATTENTION = "causal attention (B 32, H 4, T 48, D 16)"
CHAR_LM = "char LM (2x64, context 48, batch 32)"


def attention_steps() -> dict[str, dict[str, Callable[[], Any]]]:
    """``{"fwd" | "fwd+bwd": {variant: call}}`` on the same random q, k, v and output cotangent."""
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.normal(size=SHAPE).astype(np.float32) for _ in range(4))
    op = tfl.REGISTRY["attention"]
    attrs = {"scale": None, "causal": True, "dropout": 0.0}

    def tf_fwd(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return op.fwd(q, k, v, **attrs)

    def tf_both(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array) -> Any:
        out = op.fwd(q, k, v, **attrs)
        assert op.vjp is not None
        return out, op.vjp(g, out, q, k, v, **attrs)

    def nn_fwd(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    def nn_both(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array) -> Any:
        out, pull = jax.vjp(nn_fwd, q, k, v)
        return out, pull(g)

    jq, jk, jv, jg = map(jnp.asarray, (q, k, v, g))
    tq, tk, tv, tg = (jnp.swapaxes(a, 1, 2) for a in (jq, jk, jv, jg))  # jax.nn's (B, T, H, D), made once
    f1, f2, n1, n2 = jax.jit(tf_fwd), jax.jit(tf_both), jax.jit(nn_fwd), jax.jit(nn_both)
    fwd: dict[str, Callable[[], Any]] = {"tapeflow": lambda: f1(jq, jk, jv), "jax_nn": lambda: n1(tq, tk, tv)}
    both: dict[str, Callable[[], Any]] = {"tapeflow": lambda: f2(jq, jk, jv, jg), "jax_nn": lambda: n2(tq, tk, tv, tg)}
    if torch is not None:
        sdpa = torch.nn.functional.scaled_dot_product_attention
        tq_, tk_, tv_, tg_ = map(torch.tensor, (q, k, v, g))
        lq, lk, lv = leaves = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]

        def torch_fwd() -> Any:
            with torch.no_grad():
                return sdpa(tq_, tk_, tv_, is_causal=True)

        def torch_both() -> Any:
            for t in leaves:
                t.grad = None
            sdpa(lq, lk, lv, is_causal=True).backward(tg_)

        fwd["pytorch"], both["pytorch"] = torch_fwd, torch_both
    return {"fwd": fwd, "fwd+bwd": both}


def check_attention() -> float:
    """Largest difference of the op's output and gradients from ``jax.nn``'s, relative to their size."""
    rng = np.random.default_rng(1)
    q, k, v, g = (jnp.asarray(rng.normal(size=SHAPE).astype(np.float32)) for _ in range(4))
    op = tfl.REGISTRY["attention"]
    attrs = {"scale": None, "causal": True, "dropout": 0.0}
    out = op.fwd(q, k, v, **attrs)
    assert op.vjp is not None
    got = [out, *op.vjp(g, out, q, k, v, **attrs)]

    def t(a: jax.Array) -> jax.Array:  # (B, H, T, D) <-> jax.nn's (B, T, H, D)
        return jnp.swapaxes(a, 1, 2)

    def ref(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return t(jax.nn.dot_product_attention(t(q), t(k), t(v), is_causal=True, implementation="xla"))

    r_out, pull = jax.vjp(ref, q, k, v)
    want = [r_out, *pull(g)]
    return max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(got, want))


def char_lm_steps() -> dict[str, Callable[[], Any]]:
    m = LMModel()
    steps = {"train_step": tapeflow_step(m, "train_step")[0], "default_loop": tapeflow_step(m, "lazy")[0]}
    tstep = m.torch_step()
    if tstep is not None:
        steps["pytorch"] = tstep
    return steps


def cpu_turns(steps: dict[str, Callable[[], Any]], n: int, k: int) -> dict[str, float]:
    """:func:`_timing.take_turns` on the process's CPU time instead of the wall clock.

    Every thread of the process counts (JAX's dispatch thread too) and time spent waiting for the
    core while another process runs does not: on a machine shared with busy neighbours the wall
    clock's best repeat is often still hit by them, while the CPU time is not.
    """
    for step in steps.values():
        jax.block_until_ready(step())
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(k):
        for name, step in steps.items():
            gc.collect()
            gc.disable()
            try:
                t0 = time.process_time()
                out = None
                for _ in range(n):
                    out = step()
                jax.block_until_ready(out)
                best[name] = min(best[name], (time.process_time() - t0) / n)
            finally:
                gc.enable()
    return best


# --------------------------------------------------------------------------- --profile


def _thunk_ops(hlo: str) -> dict[str, str]:
    """Each instruction of the compiled HLO's entry computation -> the tapeflow op (``jit(<op>_op)`` or
    ``jit(<op>_vjp)``) named in its metadata, else its own op name."""
    if "\nENTRY " not in hlo:
        return {}
    entry = hlo[hlo.index("\nENTRY ") :]
    out = {}
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*%?(\S+) = \S+ [a-z-]+\(", line)
        if m:
            name = re.search(r'op_name="([^"]*)"', line)
            where = re.findall(r"jit\((\w+?)_(op|vjp)\)", name.group(1)) if name else []
            out[m.group(1)] = f"{where[0][0]} ({'forward' if where[0][1] == 'op' else 'VJP'})" if where else "other"
    return out


def profile_step(steps: int = 20) -> None:
    """Print the char LM's compiled training step, by tapeflow op: each thunk's fastest time over ``steps``."""
    m = LMModel()
    ps = m.params()
    opt = tfl.Optimizer(optax.adam(1e-3), ps)
    step = tfl.train_step(m.make_loss(ps), opt)
    x, y = jnp.asarray(m.x), jnp.asarray(m.y)
    owner = _thunk_ops(step.lower(x, y).compile().as_text() or "")
    copies = [n for n in owner if re.match(r"(transpose|copy)", n)]
    for _ in range(3):
        jax.block_until_ready(step(x, y))
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True)
        for _ in range(steps):
            jax.block_until_ready(step(x, y))
        jax.profiler.stop_trace()
        traces = sorted(Path(tmp).rglob("perfetto_trace.json.gz"))
        if not traces:
            print("no perfetto trace was written: this jax cannot profile here")
            return
        data = json.loads(gzip.decompress(traces[-1].read_bytes()))
    events = data["traceEvents"] if isinstance(data, dict) else data
    runs: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("name") in owner:
            runs[e["name"]].append(float(e.get("dur", 0.0)))
    best = {n: min(ts) for n, ts in runs.items()}
    by_op: dict[str, float] = collections.defaultdict(float)
    for n, t in best.items():
        by_op[owner[n]] += t
    total = sum(best.values())
    print(
        f"\nchar LM train_step, compiled: {len(best)} thunks, {total / 1e3:.2f} ms of thunk time (each at its "
        f"fastest of {steps} steps); {len(copies)} layout copies, {sum(best.get(n, 0) for n in copies) / 1e3:.2f} ms"
    )
    for name, t in sorted(by_op.items(), key=lambda kv: -kv[1])[:16]:
        print(f"  {name:28s} {t / 1e3:7.2f} ms  {t / total:6.1%}")


def main(argv: list[str] | None = None) -> Results:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few repeats (numbers are rough)")
    ap.add_argument("--profile", action="store_true", help="also print the compiled step's time by op")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="time by the wall clock (default) or by the process's CPU time (a machine shared with busy neighbours)",
    )
    add_json_arg(ap)
    args = ap.parse_args(argv)
    k = 3 if args.quick else REPEATS
    turns = cpu_turns if args.clock == "cpu" else take_turns
    res = Results("bench_attention", quick=args.quick)
    print(
        f"tapeflow {tfl.__version__}, jax {jax.__version__}, torch {None if torch is None else torch.__version__}; "
        f"JAX dispatch {os.environ['TAPEFLOW_BENCH_DISPATCH']}, {args.clock} clock"
    )
    print(f"attention op vs jax.nn (output and gradients): {check_attention():.1e} of their size")
    print(f"\n{ATTENTION}")
    for part, steps in attention_steps().items():
        times = turns(steps, 5 if args.quick else 20, k)
        for variant, t in times.items():
            res.add("attention", f"{ATTENTION} {part}", variant, t, per="call", baseline="pytorch", clock=args.clock)
        ratios = "  ".join(f"{v} {times[v] / times['pytorch']:.2f}x" for v in times if "pytorch" in times)
        print(f"  {part:8s} " + " ".join(f"{v} {fmt(t)}" for v, t in times.items()) + f"   vs pytorch: {ratios}")
    print(f"\n{CHAR_LM}")
    times = turns(char_lm_steps(), 3 if args.quick else 10, k)
    for variant, t in times.items():
        res.add("char_lm", CHAR_LM, variant, t, baseline="pytorch", clock=args.clock)
    print("  " + " ".join(f"{v} {fmt(t)}" for v, t in times.items()))
    if "pytorch" in times:
        for variant in ("train_step", "default_loop"):
            r = times[variant] / times["pytorch"]
            print(f"  {variant:12s} {r:.2f}x pytorch  target <= {TARGET_VS_TORCH}x: {verdict(r <= TARGET_VS_TORCH)}")
    if args.profile:
        profile_step()
    res.write(args.json)
    return res


if __name__ == "__main__":
    main()
