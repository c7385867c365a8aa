"""Session overhead benchmarks: an eager MLP training step, per-op cost, storage canonicalization.

1. A 3-layer MLP (784-256-256-10, batch 64, relu, cross-entropy; mean squared
   error to one-hot targets if ``cross_entropy`` is not registered) run eagerly
   as forward + backward + reset on a :class:`tapeflow.Session`, against

   * PyTorch eager on the same model with ``torch.set_num_threads(1)``
     (skipped with a message when torch is not importable), target: tapeflow
     takes at most 2x PyTorch's time per step;
   * unjitted ``jax.value_and_grad`` of the equivalent pure function, target:
     tapeflow is at least 10x faster.

2. Per-op cost of an op on a ``Session`` (``tfl.add`` on (4,), ``tfl.matmul``
   (64, 256) @ (256, 256), ``tfl.relu`` on (64, 256): the cases of
   ``bench_core.py``'s per-op table), against the op's registered forward as a
   plain ``jax.jit`` call whose outputs are kept in a list. No target: the
   difference is the session's Python bookkeeping per recorded op (the pure
   core's ``record`` is in ``bench_core.py``).

3. :func:`tapeflow.canonical_indices` on 1,000,000 storages (half of them
   duplicates made with :func:`tapeflow.tie`) against a plain dict keyed by
   ``id()`` over the same list, target: at most 3x.

Timing is min-of-k: each of ``k`` repeats times a batch of steps, the best
repeat's mean is reported. Targets are printed, never asserted.

Usage::

    python benchmarks/bench_session.py           # full
    python benchmarks/bench_session.py --quick   # a few seconds
    python benchmarks/bench_session.py --json out/session.json   # also write the results as JSON
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any

# Compare single-threaded CPU kernels on both sides (PyTorch runs with one thread).
if "--multithread" not in sys.argv:
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")

import jax
import jax.numpy as jnp
import numpy as np
from _timing import Results, add_json_arg, fmt, interleaved, min_of_k, verdict

import tapeflow as tfl

SIZES = (784, 256, 256, 10)
BATCH = 64


# --------------------------------------------------------------------------- MLP


def make_data(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:]), start=1):
        out[f"w{i}"] = (rng.standard_normal((a, b)) * np.sqrt(2.0 / a)).astype(np.float32)
        out[f"b{i}"] = np.zeros(b, np.float32)
    out["x"] = rng.standard_normal((BATCH, SIZES[0])).astype(np.float32)
    out["labels"] = rng.integers(0, SIZES[-1], BATCH).astype(np.int32)
    out["onehot"] = np.eye(SIZES[-1], dtype=np.float32)[out["labels"]]
    return out


def use_cross_entropy() -> bool:
    return "cross_entropy" in tfl.REGISTRY


def tapeflow_step_fn(
    data: dict[str, np.ndarray],
) -> tuple[Callable[[], Any], Callable[[], float], Callable[[], int]]:
    params = {k: tfl.Param(jnp.asarray(v), name=k) for k, v in data.items() if k[0] in "wb"}
    x_dev = jax.device_put(data["x"])
    target = jax.device_put(data["labels"] if use_cross_entropy() else data["onehot"])
    s = tfl.Session(device="cpu", lazy=False)  # op by op: the per-op overhead this measures
    names = [k for k in params]
    last: list[float] = []

    def forward() -> Any:
        x = s.input(x_dev)
        t = s.input(target)
        h = tfl.relu(tfl.apply("linear", x, params["w1"], params["b1"]))
        h = tfl.relu(tfl.apply("linear", h, params["w2"], params["b2"]))
        logits = tfl.apply("linear", h, params["w3"], params["b3"])
        if use_cross_entropy():
            return tfl.cross_entropy(logits, t)
        d = logits - t
        return (d * d).mean()

    def step() -> None:
        loss = forward()
        with s.backward(loss) as g:
            jax.block_until_ready([g[params[k]] for k in names])
            last[:] = [float(loss)]
        s.reset()

    def loss_value() -> float:
        step()
        return last[0]

    def ops_per_step() -> int:
        """Op nodes (not leaves) one forward + backward records on the session's tape."""
        loss = forward()
        s.backward(loss)
        n = sum(1 for node in s.tape if node.op is not None)
        s.reset()
        return n

    return step, loss_value, ops_per_step


def jax_pure_loss(p: dict[str, Any], x: Any, target: Any) -> Any:
    h = jax.nn.relu(x @ p["w1"] + p["b1"])
    h = jax.nn.relu(h @ p["w2"] + p["b2"])
    logits = h @ p["w3"] + p["b3"]
    if use_cross_entropy():
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, target[:, None], axis=-1))
    return jnp.mean((logits - target) ** 2)


def jax_unjitted_step_fn(data: dict[str, np.ndarray]) -> tuple[Callable[[], Any], Callable[[], float]]:
    p = {k: jnp.asarray(v) for k, v in data.items() if k[0] in "wb"}
    x = jnp.asarray(data["x"])
    target = jnp.asarray(data["labels"] if use_cross_entropy() else data["onehot"])
    vg = jax.value_and_grad(jax_pure_loss)  # deliberately not jax.jit-ed

    def step() -> Any:
        return jax.block_until_ready(vg(p, x, target))

    return step, lambda: float(step()[0])


def torch_step_fn(data: dict[str, np.ndarray]) -> tuple[Callable[[], Any], Callable[[], float]] | str:
    try:
        import torch
    except Exception as e:  # pragma: no cover - depends on the environment
        return f"PyTorch is not importable ({type(e).__name__}: {e}); skipping the PyTorch comparison"
    torch.set_num_threads(1)
    p = {k: torch.from_numpy(v.copy()).requires_grad_(True) for k, v in data.items() if k[0] in "wb"}
    ws = [p[f"w{i}"] for i in (1, 2, 3)]
    bs = [p[f"b{i}"] for i in (1, 2, 3)]
    x = torch.from_numpy(data["x"])
    labels = torch.from_numpy(data["labels"].astype(np.int64))
    onehot = torch.from_numpy(data["onehot"])
    F = torch.nn.functional
    ce = use_cross_entropy()

    def step() -> Any:
        for t in ws + bs:
            t.grad = None
        h = torch.relu(torch.addmm(bs[0], x, ws[0]))
        h = torch.relu(torch.addmm(bs[1], h, ws[1]))
        logits = torch.addmm(bs[2], h, ws[2])
        loss = F.cross_entropy(logits, labels) if ce else ((logits - onehot) ** 2).mean()
        loss.backward()
        return loss

    return step, lambda: float(step().detach())


def bench_mlp(quick: bool, res: Results) -> None:
    n, k, warm = (20, 3, 5) if quick else (100, 7, 20)
    n_slow, k_slow = (3, 2) if quick else (10, 5)
    data = make_data()
    loss_kind = "cross-entropy" if use_cross_entropy() else "mean squared error to one-hot targets"
    print(f"MLP {'-'.join(map(str, SIZES))}, batch {BATCH}, relu, {loss_kind}; forward + backward (+ reset)")
    print(f"  jax {jax.__version__} on {jax.devices()[0]}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")

    tf_step, tf_loss, tf_ops = tapeflow_step_fn(data)
    jx_step, jx_loss = jax_unjitted_step_fn(data)
    l_tf, l_jx = tf_loss(), jx_loss()
    if not np.isclose(l_tf, l_jx, rtol=1e-4, atol=1e-5):
        print(f"  WARNING: losses differ: tapeflow {l_tf:.6f} vs jax {l_jx:.6f}")

    t_tf = min_of_k(tf_step, n, k, warm)
    print(f"  tapeflow Session (eager)            {fmt(t_tf)} / step")
    t_jx = min_of_k(jx_step, n_slow, k_slow, 1)
    print(f"  jax.value_and_grad (not jitted)     {fmt(t_jx)} / step")
    torch_fns = torch_step_fn(data)
    t_pt = None
    if isinstance(torch_fns, str):
        print(f"  {torch_fns}")
    else:
        pt_step, pt_loss = torch_fns
        l_pt = pt_loss()
        if not np.isclose(l_tf, l_pt, rtol=1e-4, atol=1e-5):
            print(f"  WARNING: losses differ: tapeflow {l_tf:.6f} vs torch {l_pt:.6f}")
        t_pt = min_of_k(pt_step, n, k, warm)
        print(f"  PyTorch eager (1 thread)            {fmt(t_pt)} / step")
    print()
    model = f"MLP {'-'.join(map(str, SIZES))}, batch {BATCH}"
    n_ops = tf_ops()
    base = "pytorch" if t_pt is not None else None
    res.add("session_mlp", model, "eager", t_tf, baseline=base, target="<= 2x pytorch", ops_per_step=n_ops)
    res.add("session_mlp", model, "jax_unjitted", t_jx, baseline="eager", target=">= 10x eager")
    if t_pt is not None:
        res.add("session_mlp", model, "pytorch", t_pt)
    if t_pt is not None:
        r = t_tf / t_pt
        print(f"  tapeflow / PyTorch eager            {r:8.2f}x   (target <= 2x: {verdict(r <= 2.0)})")
    r = t_jx / t_tf
    print(f"  unjitted value_and_grad / tapeflow  {r:8.2f}x   (target >= 10x faster: {verdict(r >= 10.0)})")


# --------------------------------------------------------------------------- per-op cost on a Session


PER_OP_CASES: list[tuple[str, str, list[tuple[int, ...]]]] = [
    ("add (4,)", "add", [(4,), (4,)]),
    ("matmul 64x256 @ 256x256", "matmul", [(64, 256), (256, 256)]),
    ("relu (64, 256)", "relu", [(64, 256)]),
]


def bench_per_op(quick: bool, res: Results) -> None:
    n, k = (300, 3) if quick else (3000, 5)
    rs = np.random.default_rng(0)
    print(f"per-op cost of an op on a Session vs a plain jax.jit call ({n} calls/repeat, best of {k})")
    print(f"  {'op':<26}{'jax.jit':>12}{'Session':>12}{'ratio':>9}{'overhead':>12}")
    for label, op, shapes in PER_OP_CASES:
        vals = [jnp.asarray(rs.standard_normal(sh), jnp.float32) for sh in shapes]
        fn = jax.jit(tfl.REGISTRY[op].fwd)  # the same XLA kernel as the session's
        f = getattr(tfl, op)

        def run_jit() -> None:
            out = []
            for _ in range(n):
                out.append(fn(*vals))
            out[-1].block_until_ready()

        def run_session() -> None:
            with tfl.Session(lazy=False) as s:
                xs = [s.input(v, requires_grad=True) for v in vals]
                for _ in range(n):
                    y = f(*xs)
                y.value.block_until_ready()

        tj, ts = interleaved([run_jit, run_session], k, n)
        print(f"  {label:<26}{fmt(tj):>12}{fmt(ts):>12}{ts / tj:>8.2f}x{fmt(ts - tj):>12}")
        res.add("session_per_op", label, "jax_jit", tj, per="op")
        res.add("session_per_op", label, "session", ts, per="op", baseline="jax_jit")


# --------------------------------------------------------------------------- canonical_indices


def dict_by_id(storages: list[Any]) -> list[int]:
    """The baseline: first index of each object, by a plain dict keyed by ``id()``."""
    first: dict[int, int] = {}
    return [first.setdefault(id(s), i) for i, s in enumerate(storages)]


def bench_canonical(quick: bool, res: Results) -> None:
    n = 1_000_000
    k = 3 if quick else 7
    shared = jnp.zeros((), jnp.float32)  # one small array: creating the storages stays cheap
    t0 = time.perf_counter()
    base = [tfl.Param(shared) for _ in range(n // 2)]
    slots = [p.storage for p in base] + [tfl.tie(p).storage for p in base]  # every storage twice
    random.Random(0).shuffle(slots)
    t_make = time.perf_counter() - t0
    ref = dict_by_id(slots)
    got = tfl.canonical_indices(slots)
    if got != ref:
        print("  WARNING: canonical_indices disagrees with the id() dict")
    assert len(set(got)) == n // 2
    t_ci = min_of_k(lambda: tfl.canonical_indices(slots), 1, k, 1)
    t_d = min_of_k(lambda: dict_by_id(slots), 1, k, 1)
    r = t_ci / t_d
    print(f"canonical_indices over {n:,} storages ({n // 2:,} distinct, duplicates via tie; built in {t_make:.1f} s)")
    print(f"  tfl.canonical_indices               {fmt(t_ci)}")
    print(f"  dict keyed by id()                  {fmt(t_d)}")
    print(f"  ratio                               {r:8.2f}x   (target <= 3x: {verdict(r <= 3.0)})")
    model = f"{n:,} storages, {n // 2:,} distinct"
    res.add("canonical", model, "dict_by_id", t_d, per="call")
    res.add("canonical", model, "canonical_indices", t_ci, per="call", baseline="dict_by_id", target="<= 3x dict_by_id")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and repeats (a few seconds)")
    ap.add_argument("--multithread", action="store_true", help="leave XLA's CPU thread pool at its default")
    ap.add_argument("--only", choices=("mlp", "per_op", "canonical"), help="run one of the three benchmarks")
    add_json_arg(ap)
    args = ap.parse_args(argv)
    res = Results("bench_session", quick=args.quick, argv=None if argv is None else [sys.argv[0], *argv])
    if args.only in (None, "mlp"):
        bench_mlp(args.quick, res)
    if args.only is None:
        print()
    if args.only in (None, "per_op"):
        bench_per_op(args.quick, res)
    if args.only is None:
        print()
    if args.only in (None, "canonical"):
        bench_canonical(args.quick, res)
    res.write(args.json)


if __name__ == "__main__":
    main()
