"""Core tape benchmarks: per-op record cost, MLP forward+backward, append scaling.

1. Per-op cost of ``tfl.record`` on a growing tape, divided by the cost of the
   same op (the op's registered forward) as a plain ``jax.jit`` call whose
   outputs are kept in a list (the tape keeps every output too, so both sides
   hold the same buffers alive).
   Ops: ``add`` on (4,), ``matmul`` (64, 256) @ (256, 256), ``relu`` on (64, 256).
   Target: at most 1.3x the jitted call.
2. Forward + backward of a 3-layer MLP (784-256-256-10, batch 64, relu,
   softmax cross-entropy, or mean squared error to one-hot targets when
   ``cross_entropy`` is not registered) recorded on a fresh tape each step, against
   *unjitted* ``jax.value_and_grad`` of the same model. Target: the tape is at
   least 10x faster.
3. 100k appends (alternating ``leaf`` and ``record``) on one tape, timed at 25k,
   50k and 100k appends: the time per append should stay flat (linear growth).
   The garbage collector stays on here, as in real use; its full collections
   over the growing heap make the per-append time creep up before levelling off.
4. A lifted op vs the built-in: ``tfl.lift(jnp.tanh)`` recorded on a session
   against ``tfl.tanh`` on (64, 256), per call (and the same two through the pure
   core's ``tfl.record``). Target: the lifted op costs at most 1.1x the built-in.
5. A Hessian-vector product of the MLP of 2 (tanh instead of relu, so the
   curvature is not piecewise zero) with ``create_graph=True``: forward,
   recorded backward, then forward-over-reverse (``s.jvp`` of the recorded
   gradient) and reverse-over-reverse (a second ``backward`` of
   ``sum(grad * v)``), against ``jax.jvp(jax.grad(f))`` unjitted and jitted.
   The ratios are printed (no target: a reference point for the recorded backward).

Timing is best-of-k: each of ``k`` repeats times ``n`` calls and the fastest
repeat's mean per call is reported. Ratios and targets are printed, never asserted.

Usage::

    python benchmarks/bench_core.py            # full run
    python benchmarks/bench_core.py --quick    # a few seconds
    python benchmarks/bench_core.py --profile  # also cProfile `record` on add (4,)
    python benchmarks/bench_core.py --single-thread  # one XLA CPU thread on both sides
    python benchmarks/bench_core.py --json out/core.json  # also write the results as JSON
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import sys
import time
from typing import Any

# --single-thread: one XLA CPU thread on both sides (steadier numbers on a busy machine).
if "--single-thread" in sys.argv:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    ).strip()

import jax
import jax.numpy as jnp
import numpy as np
from _timing import Results, add_json_arg, fmt, interleaved, min_of_k, verdict

import tapeflow as tfl

PER_OP_TARGET = 1.3
MLP_TARGET = 10.0
LIFT_TARGET = 1.1


# --------------------------------------------------------------------------- timing


# --------------------------------------------------------------------------- 1. per-op overhead


def per_op_cases() -> list[tuple[str, str, list[tuple[int, ...]]]]:
    return [
        ("add (4,)", "add", [(4,), (4,)]),
        ("matmul 64x256 @ 256x256", "matmul", [(64, 256), (256, 256)]),
        ("relu (64, 256)", "relu", [(64, 256)]),
    ]


def bench_per_op(n: int, k: int) -> list[tuple[str, float, float]]:
    rs = np.random.default_rng(0)
    rows = []
    for label, op, shapes in per_op_cases():
        vals = [jnp.asarray(rs.standard_normal(s), jnp.float32) for s in shapes]
        # the op's own forward under a plain jax.jit: the same XLA kernel as the tape's,
        # so the ratio measures the tape's bookkeeping (jax.nn.relu, say, lowers differently)
        fn = jax.jit(tfl.REGISTRY[op].fwd)

        def run_jit() -> None:
            out = []
            for _ in range(n):
                out.append(fn(*vals))
            out[-1].block_until_ready()

        t0 = tfl.Tape.empty()
        ids = []
        for v in vals:
            t0, i = tfl.leaf(t0, v, requires_grad=True)
            ids.append(i)
        ins = tuple(ids)

        def run_tape() -> None:
            t = t0
            for _ in range(n):
                t, r = tfl.record(t, op, ins)
            t.value(r.value).block_until_ready()

        tj, tt = interleaved([run_jit, run_tape], k, n)  # compiled first, repeats interleaved
        rows.append((label, tj, tt))
    return rows


def profile_record(n: int) -> str:
    t, x = tfl.leaf(tfl.Tape.empty(), jnp.ones(4, jnp.float32), requires_grad=True)
    t, r = tfl.record(t, "add", (x, x))  # compile outside the profile
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        t, r = tfl.record(t, "add", (x, x))
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
    return s.getvalue()


# --------------------------------------------------------------------------- 2. MLP forward + backward


SIZES = (784, 256, 256, 10)
BATCH = 64


def mlp_params(rs: np.random.Generator) -> list[jax.Array]:
    ps = []
    for a, b in zip(SIZES[:-1], SIZES[1:]):
        ps.append(jnp.asarray(rs.standard_normal((a, b)) / np.sqrt(a), jnp.float32))
        ps.append(jnp.zeros((b,), jnp.float32))
    return ps


def bench_mlp(n: int, k: int) -> tuple[float, float, float, float, str]:
    rs = np.random.default_rng(1)
    params = mlp_params(rs)
    x = jnp.asarray(rs.standard_normal((BATCH, SIZES[0])), jnp.float32)
    labels = jnp.asarray(rs.integers(0, SIZES[-1], BATCH), jnp.int32)
    use_ce = "cross_entropy" in tfl.REGISTRY
    onehot = jax.nn.one_hot(labels, SIZES[-1], dtype=jnp.float32)
    use_mse = "mse" in tfl.REGISTRY
    loss_name = "softmax cross-entropy" if use_ce else "mean squared error"

    def plain_loss(ps: list[jax.Array], xv: jax.Array) -> jax.Array:
        h = xv
        for j in range(0, len(ps), 2):
            h = h @ ps[j] + ps[j + 1]
            if j + 2 < len(ps):
                h = jax.nn.relu(h)
        if use_ce:
            logp = jax.nn.log_softmax(h, axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))
        return jnp.mean((h - onehot) ** 2)

    def tape_step() -> tuple[Any, dict[int, Any], list[int]]:
        t = tfl.Tape.empty()
        pid = []
        for p in params:
            t, i = tfl.leaf(t, p, requires_grad=True)
            pid.append(i)
        t, h = tfl.leaf(t, x)
        for j in range(0, len(pid), 2):
            t, r = tfl.record(t, "matmul", (h, pid[j]))
            t, r = tfl.record(t, "add", (r.value, pid[j + 1]))
            h = r.value
            if j + 2 < len(pid):
                t, r = tfl.record(t, "relu", (h,))
                h = r.value
        if use_ce:
            t, y = tfl.leaf(t, labels)
            t, r = tfl.record(t, "cross_entropy", (h, y))
        else:
            t, y = tfl.leaf(t, onehot)
            if use_mse:
                t, r = tfl.record(t, "mse", (h, y))
            else:
                t, r = tfl.record(t, "sub", (h, y))
                t, r = tfl.record(t, "mul", (r.value, r.value))
                t, r = tfl.record(t, "mean", (r.value,))
        assert r.is_ok, r.error
        g = tfl.backward(t, r.value)
        return t.value(r.value), g, pid

    vg = jax.value_and_grad(plain_loss)

    # correctness first: both sides compute the same loss and gradients
    loss_t, g_t, pid = tape_step()
    loss_p, g_p = vg(params, x)
    err = max(float(jnp.max(jnp.abs(g_t[i] - gp))) for i, gp in zip(pid, g_p))
    err = max(err, abs(float(loss_t) - float(loss_p)))
    assert err < 1e-3, f"tape and jax.value_and_grad disagree (max abs diff {err})"

    def run_tape() -> None:
        for _ in range(n):
            loss, g, _ = tape_step()
        jax.block_until_ready((loss, g))

    def run_plain() -> None:
        for _ in range(n):
            out = vg(params, x)
        jax.block_until_ready(out)

    vgj = jax.jit(vg)

    def run_jitted() -> None:
        for _ in range(n):
            out = vgj(params, x)
        jax.block_until_ready(out)

    tt, tp, tj = interleaved([run_tape, run_plain, run_jitted], k, n)
    return tt, tp, tj, err, loss_name


# --------------------------------------------------------------------------- 3. append scaling


def bench_appends(total: int) -> list[tuple[int, float, float]]:
    marks = sorted({total // 4, total // 2, total})
    c = jnp.ones(4, jnp.float32)
    t, h = tfl.leaf(tfl.Tape.empty(), c, requires_grad=True)
    t, r = tfl.record(t, "add", (h, h))  # compile
    t, h = tfl.leaf(tfl.Tape.empty(), c, requires_grad=True)
    rows = []
    done = 1
    gc.collect()
    start = last = time.perf_counter()
    last_done = done
    for m in marks:
        while done < m:
            t, leaf_id = tfl.leaf(t, c)
            t, r = tfl.record(t, "add", (h, leaf_id))
            h = r.value
            done += 2
        t.value(h).block_until_ready()
        now = time.perf_counter()
        rows.append((done, (now - start) / done, (now - last) / (done - last_done)))
        last, last_done = now, done
    assert len(t) == done
    return rows


# --------------------------------------------------------------------------- 4. lifted op vs built-in


def bench_lift(n: int, k: int) -> list[tuple[str, float, float]]:
    """Per-call cost of a lifted ``jnp.tanh`` and of the built-in ``tanh``: on a session, on the pure core."""
    lifted = tfl.lift(jnp.tanh, name="bench_lifted_tanh", replace=True)
    v = jnp.asarray(np.random.default_rng(2).standard_normal((64, 256)), jnp.float32)
    with tfl.Session() as s:  # the two ops agree before anything is timed
        x = s.input(v, requires_grad=True)
        a, b = lifted(x), tfl.tanh(x)
        err = float(jnp.max(jnp.abs(s.backward(tfl.sum(a))[x] - s.backward(tfl.sum(b))[x])))
        assert err < 1e-6 and bool(jnp.all(a.value == b.value)), err

    def on_session(f: Any) -> Any:
        def run() -> None:
            with tfl.Session(lazy=False) as s:  # the per-call cost of an op run at once
                x = s.input(v, requires_grad=True)
                for _ in range(n):
                    y = f(x)
                y.value.block_until_ready()

        return run

    t0, i = tfl.leaf(tfl.Tape.empty(), v, requires_grad=True)

    def on_tape(op: str) -> Any:
        def run() -> None:
            t = t0
            for _ in range(n):
                t, r = tfl.record(t, op, (i,))
            t.value(r.value).block_until_ready()

        return run

    rows = []
    for label, builtin, lift_run in (
        ("session: f(x)", on_session(tfl.tanh), on_session(lifted)),
        ("pure core: record", on_tape("tanh"), on_tape("bench_lifted_tanh")),
    ):
        tb, tl = interleaved([builtin, lift_run], k, n)
        rows.append((label, tb, tl))
    return rows


# --------------------------------------------------------------------------- 5. Hessian-vector product


def bench_hvp(n: int, k: int) -> tuple[float, float, float, float, float]:
    """Per-HVP time: tape forward-over-reverse, tape reverse-over-reverse, jax unjitted, jax jitted; max error."""
    rs = np.random.default_rng(3)
    vals = mlp_params(rs)
    x = jnp.asarray(rs.standard_normal((BATCH, SIZES[0])), jnp.float32)
    vs = [jnp.asarray(rs.standard_normal(p.shape) * 0.1, jnp.float32) for p in vals]
    params = [tfl.Param(p) for p in vals]

    def plain(ps: list[jax.Array]) -> jax.Array:
        h = x
        for j in range(0, len(ps), 2):
            h = h @ ps[j] + ps[j + 1]
            if j + 2 < len(ps):
                h = jnp.tanh(h)
        return jnp.mean(h * h)

    def tape_loss(s: tfl.Session) -> tfl.Tensor:
        h: Any = s.input(x)
        for j in range(0, len(params), 2):
            h = h @ params[j] + params[j + 1]
            if j + 2 < len(params):
                h = tfl.tanh(h)
        return tfl.mean(h * h)

    def fwd_over_rev() -> list[jax.Array]:
        with tfl.Session() as s:
            g = s.backward(tape_loss(s), create_graph=True)
            tangents = dict(zip(params, vs))
            return [s.jvp(g[p], tangents) for p in params]

    def rev_over_rev() -> list[jax.Array]:
        with tfl.Session() as s:
            g = s.backward(tape_loss(s), create_graph=True)
            dot = tfl.sum(g[params[0]] * vs[0])
            for p, v in zip(params[1:], vs[1:]):
                dot = dot + tfl.sum(g[p] * v)
            hv = s.backward(dot)
            return [hv[p] for p in params]

    def jax_hvp(ps: list[jax.Array], tv: list[jax.Array]) -> list[jax.Array]:
        return jax.jvp(jax.grad(plain), (ps,), (tv,))[1]  # type: ignore[no-any-return]

    jitted = jax.jit(jax_hvp)
    want = jitted(vals, vs)
    err = max(float(jnp.max(jnp.abs(a - b))) for got in (fwd_over_rev(), rev_over_rev()) for a, b in zip(got, want))

    times = [
        min_of_k(f, n, k) for f in (fwd_over_rev, rev_over_rev, lambda: jax_hvp(vals, vs), lambda: jitted(vals, vs))
    ]
    return times[0], times[1], times[2], times[3], err


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short run (a few seconds)")
    ap.add_argument("--profile", action="store_true", help="cProfile record() on add (4,)")
    ap.add_argument("--single-thread", action="store_true", help="one XLA CPU thread (set before jax loads)")
    add_json_arg(ap)
    args = ap.parse_args()
    res = Results("bench_core", quick=args.quick)
    n_op, k, n_mlp, n_app = (300, 3, 5, 20_000) if args.quick else (3000, 5, 30, 100_000)

    print(f"tapeflow core benchmark  (jax {jax.__version__}, device {jax.devices()[0]}, best of {k})")
    print()
    print(f"1. per-op record cost on a growing tape vs a plain jax.jit call ({n_op} calls/repeat)")
    print(f"   {'op':<26}{'jax.jit':>12}{'record':>12}{'ratio':>9}   target <= {PER_OP_TARGET}x")
    worst = 0.0
    for label, tj, tt in bench_per_op(n_op, k):
        ratio = tt / tj
        worst = max(worst, ratio)
        print(f"   {label:<26}{fmt(tj):>12}{fmt(tt):>12}{ratio:>8.2f}x   {verdict(ratio <= PER_OP_TARGET)}")
        res.add("per_op", label, "jax_jit", tj, per="op")
        res.add("per_op", label, "record", tt, per="op", baseline="jax_jit", target=f"<= {PER_OP_TARGET}x jax_jit")
    print()

    tt, tp, tj, err, loss_name = bench_mlp(n_mlp, k)
    mlp = f"MLP {'-'.join(map(str, SIZES))}, batch {BATCH}"
    res.add("mlp_fwd_bwd", mlp, "jax_unjitted", tp)
    res.add("mlp_fwd_bwd", mlp, "jax_jit", tj, baseline="jax_unjitted")
    res.add("mlp_fwd_bwd", mlp, "tape", tt, baseline="jax_unjitted", target=f"<= {1 / MLP_TARGET:g}x jax_unjitted")
    print(f"2. MLP 784-256-256-10, batch {BATCH}, relu, {loss_name}: forward + backward ({n_mlp} steps/repeat)")
    print(f"   tape (record + backward)           {fmt(tt)} / step")
    print(f"   jax.value_and_grad (unjitted)      {fmt(tp)} / step")
    print(f"   jax.jit(value_and_grad) (reference){fmt(tj)} / step   (tape / jit: {tt / tj:.2f}x)")
    speedup = tp / tt
    print(f"   max |difference| tape vs jax       {err:.2e}")
    print(
        f"   tape speedup vs unjitted value_and_grad: {speedup:.1f}x   "
        f"target >= {MLP_TARGET:.0f}x   {verdict(speedup >= MLP_TARGET)}"
    )
    print()

    print(f"3. appends (leaf + record add (4,) pairs) on one tape, up to {n_app}")
    print(f"   {'appends':>9}{'cumulative/append':>20}{'this window/append':>21}")
    rows = bench_appends(n_app)
    for done, cum, win in rows:
        print(f"   {done:>9}{fmt(cum):>20}{fmt(win):>21}")
        res.add("appends", f"{done} appends", "cumulative", cum, per="append")
        res.add("appends", f"{done} appends", "window", win, per="append")
    growth = rows[-1][2] / rows[0][2]
    print(f"   last window / first window per-append time: {growth:.2f}x   (linear growth: about 1x)")

    print()

    print(f"4. lifted jnp.tanh (tfl.lift) vs built-in tanh on (64, 256), per call ({n_op} calls/repeat)")
    print(f"   {'path':<26}{'built-in':>12}{'lifted':>12}{'ratio':>9}   target <= {LIFT_TARGET}x")
    for label, tb, tl in bench_lift(n_op, k):
        ratio = tl / tb
        print(f"   {label:<26}{fmt(tb):>12}{fmt(tl):>12}{ratio:>8.2f}x   {verdict(ratio <= LIFT_TARGET)}")
        res.add("lift", label, "builtin", tb, per="call")
        res.add("lift", label, "lifted", tl, per="call", baseline="builtin", target=f"<= {LIFT_TARGET}x builtin")

    print()
    n_hvp = 3 if args.quick else 10
    t_fr, t_rr, t_jax, t_jit, err = bench_hvp(n_hvp, k)
    print(f"5. Hessian-vector product, MLP 784-256-256-10 (tanh), batch {BATCH} ({n_hvp} HVPs/repeat)")
    print(f"   tape: create_graph + s.jvp (forward-over-reverse)   {fmt(t_fr)} / HVP")
    print(f"   tape: create_graph + backward (reverse-over-reverse){fmt(t_rr)} / HVP")
    print(f"   jax.jvp(jax.grad(f)) unjitted                       {fmt(t_jax)} / HVP")
    print(f"   jax.jit(jax.jvp(jax.grad(f)))                       {fmt(t_jit)} / HVP")
    print(f"   max |difference| tape vs jax                        {err:.2e}")
    print(
        f"   forward-over-reverse vs unjitted: {t_fr / t_jax:.2f}x, vs jitted: {t_fr / t_jit:.2f}x;  "
        f"reverse-over-reverse vs unjitted: {t_rr / t_jax:.2f}x, vs jitted: {t_rr / t_jit:.2f}x"
    )
    hvp = f"MLP {'-'.join(map(str, SIZES))} (tanh), batch {BATCH}"
    res.add("hvp", hvp, "jax_unjitted", t_jax, per="hvp")
    res.add("hvp", hvp, "jax_jit", t_jit, per="hvp", baseline="jax_unjitted")
    res.add("hvp", hvp, "tape_fwd_over_rev", t_fr, per="hvp", baseline="jax_unjitted")
    res.add("hvp", hvp, "tape_rev_over_rev", t_rr, per="hvp", baseline="jax_unjitted")

    if args.profile or worst > PER_OP_TARGET:
        print()
        print("cProfile of record(t, 'add', (x, x)) on (4,), sorted by own time:")
        print(profile_record(n_op * 5))
    res.write(args.json)


if __name__ == "__main__":
    main()
