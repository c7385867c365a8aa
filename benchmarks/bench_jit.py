"""Compiled training step: ``tfl.train_step`` against a hand-written ``jax.jit`` + optax step.

Both sides train the same model with the same ``optax.adam`` chain and are
timed in the same run, like for like: ``train_step`` with its default (no
donation, so a failed or interrupted step loses nothing) against a hand-written
step that does not donate either, then ``train_step(donate=True)`` against a
hand-written step that donates its parameter and optimizer-state buffers. The
ratio of the two hand-written steps is the price of the safe default:

1. a 3-layer MLP 784-256-256-10, batch 64, relu, softmax cross-entropy
   (``tfl.cross_entropy`` when the op is registered, else mean squared error
   to one-hot targets), where the XLA program dominates;
2. a 32-layer 16-wide MLP (batch 16), where the per-call overhead dominates:
   what Python does around the compiled program (reading the Param storages,
   the step's RNG key, writing the new values back);
3. ``nnx.jit`` on the 784-256-256-10 MLP when flax is importable (skipped with
   a message otherwise).

Target: ``train_step`` takes at most 1.05x the hand-written step's time per
call on both models. The per-call overhead must be flat: no per-call Python
walk over the recorded graph (the session code runs only when tracing). Shown
four ways over a depth sweep (2..32 layers of width 16):

* time per call against the hand-written step, and the difference;
* Python function calls made by one warm call (deterministic: the same number
  for every depth means no per-parameter or per-op Python work);
* the Python wrapper alone, with the XLA call stubbed out by its saved outputs;
* time per call over successive windows of one long run (no growth with steps).

Timing is min-of-k: each of ``k`` repeats times ``n`` calls and then waits for
the last result; the best repeat's mean per call is reported. Times are printed,
never asserted.

Usage::

    python benchmarks/bench_jit.py           # full
    python benchmarks/bench_jit.py --quick   # a few seconds
    python benchmarks/bench_jit.py --json out/jit.json   # also write the results as JSON
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _timing import Results, add_json_arg, min_of_k

import tapeflow as tfl

TARGET = 1.05


def init_mlp(sizes: tuple[int, ...], seed: int = 0) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        out[f"w{i}"] = (r.standard_normal((a, b)) * np.sqrt(2.0 / a)).astype(np.float32)
        out[f"b{i}"] = np.zeros(b, np.float32)
    return out


HAS_CE = "cross_entropy" in tfl.REGISTRY


def tfl_model(init: dict[str, np.ndarray], n_layers: int) -> tuple[dict[str, tfl.Param], Callable[..., Any]]:
    params = {k: tfl.Param(v, name=k) for k, v in init.items()}
    ws = [params[f"w{i}"] for i in range(n_layers)]
    bs = [params[f"b{i}"] for i in range(n_layers)]

    def loss_fn(s: tfl.Session, x: Any, y: Any) -> tfl.Tensor:
        h = x
        for i in range(n_layers):
            h = tfl.apply("linear", h, ws[i], bs[i])
            if i < n_layers - 1:
                h = tfl.relu(h)
        if HAS_CE:
            return tfl.cross_entropy(h, y)
        return tfl.mse(h, jax.nn.one_hot(y, h.shape[-1], dtype=h.dtype))

    return params, loss_fn


def jax_loss(n_layers: int) -> Callable[..., Any]:
    def loss(p: dict[str, Any], x: Any, y: Any) -> Any:
        h = x
        for i in range(n_layers):
            h = h @ p[f"w{i}"] + p[f"b{i}"]
            if i < n_layers - 1:
                h = jax.nn.relu(h)
        if HAS_CE:
            return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()
        return jnp.mean((h - jax.nn.one_hot(y, h.shape[-1], dtype=h.dtype)) ** 2)

    return loss


class HandWritten:
    """The baseline: params and optax state as plain pytrees, one ``jax.jit`` with donation."""

    def __init__(self, init: dict[str, np.ndarray], n_layers: int, tx: Any, donate: bool = True) -> None:
        self.params = {k: jnp.asarray(v) for k, v in init.items()}
        self.state = tx.init(self.params)
        loss = jax_loss(n_layers)

        def step(params: Any, state: Any, x: Any, y: Any) -> Any:
            l, g = jax.value_and_grad(loss)(params, x, y)
            updates, state = tx.update(g, state, params)
            return optax.apply_updates(params, updates), state, l

        self._step = jax.jit(step, donate_argnums=(0, 1) if donate else ())

    def __call__(self, x: Any, y: Any) -> Any:
        self.params, self.state, l = self._step(self.params, self.state, x, y)
        return l


def batch(sizes: tuple[int, ...], n: int, seed: int = 0) -> tuple[Any, Any]:
    r = np.random.default_rng(seed)
    return jnp.asarray(r.standard_normal((n, sizes[0])), jnp.float32), jnp.asarray(
        r.integers(0, sizes[-1], n), jnp.int32
    )


def compare(
    label: str,
    sizes: tuple[int, ...],
    bsz: int,
    n: int,
    k: int,
    warmup: int,
    donate: bool = False,
    *,
    res: Results,
    section: str,
    model: str,
) -> tuple[float, float]:
    """``train_step(donate=donate)`` against the hand-written step with the same donation."""
    n_layers = len(sizes) - 1
    init = init_mlp(sizes)
    x, y = batch(sizes, bsz)
    params, loss_fn = tfl_model(init, n_layers)
    step = tfl.train_step(loss_fn, tfl.Optimizer(optax.adam(1e-3), params), donate=donate)
    hand = HandWritten(init, n_layers, optax.adam(1e-3), donate=donate)
    # same model, same chain: the two agree after a few steps
    for _ in range(3):
        a, b = step(x, y), hand(x, y)
    diff = max(float(jnp.max(jnp.abs(params[key].value - hand.params[key]))) for key in params)
    # interleave the two sides so that machine noise hits both alike
    t_tfl = t_hand = float("inf")
    for _ in range(k):
        t_tfl = min(t_tfl, min_of_k(lambda: step(x, y), n, 1, warmup))
        t_hand = min(t_hand, min_of_k(lambda: hand(x, y), n, 1, warmup))
    ratio = t_tfl / t_hand
    ok = "ok" if ratio <= TARGET else "OVER TARGET"
    print(
        f"{label:<34} train_step {t_tfl * 1e6:9.1f} us/call   hand jit {t_hand * 1e6:9.1f} us/call   "
        f"ratio {ratio:5.3f} (target <= {TARGET}) {ok}   [|loss diff| {abs(float(a) - float(b)):.1e}, max |param diff| {diff:.1e}; "
        f"traces {step.trace_count}]"
    )
    res.add(section, model, "hand_jit", t_hand, per="call")
    res.add(section, model, "train_step", t_tfl, per="call", baseline="hand_jit", target=f"<= {TARGET}x hand_jit")
    return t_tfl, t_hand


def depth_sweep(depths: tuple[int, ...], width: int, bsz: int, n: int, k: int, warmup: int, res: Results) -> None:
    print(f"\nper-call overhead of train_step over the hand-written step, {width}-wide MLPs, batch {bsz}:")
    for depth in depths:
        sizes = (width,) * (depth + 1)
        t_tfl, t_hand = compare(
            f"  {depth:>2} layers ({2 * depth:>2} params)",
            sizes,
            bsz,
            n,
            k,
            warmup,
            res=res,
            section="jit_depth",
            model=f"{depth} x {width}-wide, batch {bsz}",
        )
        print(
            f"  {'':<32} overhead {(t_tfl - t_hand) * 1e6:+8.1f} us/call ({(t_tfl - t_hand) / (2 * depth) * 1e9:+8.1f} ns per param)"
        )


def python_calls_per_step(depths: tuple[int, ...], width: int, bsz: int, res: Results) -> None:
    """Python-level function calls made by one warm step (deterministic, unlike times)."""
    import sys

    print(f"\nPython function calls per warm step ({width}-wide MLPs; the session code runs only when tracing):")
    for depth in depths:
        sizes = (width,) * (depth + 1)
        init = init_mlp(sizes)
        x, y = batch(sizes, bsz)
        params, loss_fn = tfl_model(init, depth)
        step = tfl.train_step(loss_fn, tfl.Optimizer(optax.adam(1e-3), params))
        hand = HandWritten(init, depth, optax.adam(1e-3))
        counts = []
        for call in (lambda: step(x, y), lambda: hand(x, y)):
            jax.block_until_ready(call())
            n = [0]

            def prof(frame: Any, event: str, arg: Any) -> None:
                if event == "call":
                    n[0] += 1

            sys.setprofile(prof)
            try:
                call()
            finally:
                sys.setprofile(None)
            counts.append(n[0])
        print(
            f"  {depth:>2} layers ({2 * depth:>2} params): train_step {counts[0]:3d}   hand-written jit {counts[1]:3d}"
        )
        model = f"{depth} x {width}-wide, batch {bsz}"
        res.add("jit_python_calls", model, "hand_jit", None, per="call", python_calls=counts[1])
        res.add("jit_python_calls", model, "train_step", None, per="call", python_calls=counts[0])


def wrapper_cost(depths: tuple[int, ...], width: int, bsz: int, res: Results) -> None:
    """The Python around the XLA call alone: the compiled program is replaced by its saved outputs."""
    import timeit

    print(f"\nPython wrapper of train_step alone (XLA call stubbed out), {width}-wide MLPs:")
    for depth in depths:
        sizes = (width,) * (depth + 1)
        x, y = batch(sizes, bsz)
        params, loss_fn = tfl_model(init_mlp(sizes), depth)
        step = tfl.train_step(loss_fn, tfl.Optimizer(optax.adam(1e-3), params), donate=False)
        jax.block_until_ready(step(x, y))
        compiled = step._compiled
        saved: list[Any] = []

        def record(*a: Any, **k: Any) -> Any:
            out = compiled(*a, **k)
            saved.append(out)
            return out

        step._compiled = record
        step(x, y)
        step._compiled = lambda *a, **k: saved[0]
        t = min(timeit.repeat(lambda: step(x, y), number=2000, repeat=5)) / 2000
        print(f"  {depth:>2} layers ({2 * depth:>2} params): {t * 1e6:6.1f} us/call")
        res.add("jit_wrapper", f"{depth} x {width}-wide, batch {bsz}", "train_step_wrapper", t, per="call")


def drift(width: int, depth: int, bsz: int, windows: int, n: int, res: Results) -> None:
    sizes = (width,) * (depth + 1)
    init = init_mlp(sizes)
    x, y = batch(sizes, bsz)
    params, loss_fn = tfl_model(init, depth)
    step = tfl.train_step(loss_fn, tfl.Optimizer(optax.adam(1e-3), params))
    jax.block_until_ready(step(x, y))
    times = []
    for _ in range(windows):
        times.append(min_of_k(lambda: step(x, y), n, 1, 0))
    row = "  ".join(f"{t * 1e6:6.1f}" for t in times)
    print(f"\n{depth}-layer train_step, us/call over successive windows of {n} steps: {row}")
    print(
        f"  last/first window: {times[-1] / times[0]:.3f} (flat: ~1.0; total steps {step.step_count}, traces {step.trace_count})"
    )
    for i, t in enumerate(times):
        baseline = None if i == 0 else "window 1"
        res.add(
            "jit_drift", f"{depth} x {width}-wide, batch {bsz}", f"window {i + 1}", t, per="call", baseline=baseline
        )


def bench_nnx(n: int, k: int, warmup: int, t_tfl: float, res: Results, label: str) -> None:
    try:
        from flax import nnx
    except Exception:
        print("\nnnx.jit: skipped (flax is not importable)")
        return
    sizes = (784, 256, 256, 10)

    class MLP(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            layers = [nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])]
            # flax >= 0.12 wants a list of modules marked as data (nnx.List); older flax takes a list
            self.layers = nnx.List(layers) if hasattr(nnx, "List") else layers

        def __call__(self, x: Any) -> Any:
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i < len(self.layers) - 1:
                    x = jax.nn.relu(x)
            return x

    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    @nnx.jit
    def train(model: Any, optimizer: Any, x: Any, y: Any) -> Any:
        def loss_fn(model: Any) -> Any:
            return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    x, y = batch(sizes, 64)
    t = min_of_k(lambda: train(model, optimizer, x, y), n, k, warmup)
    print(f"\nnnx.jit 784-256-256-10 batch 64: {t * 1e6:9.1f} us/call; train_step / nnx.jit = {t_tfl / t:5.3f}")
    res.add("jit", label, "nnx_jit", t, per="call", baseline="hand_jit")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a few seconds)")
    add_json_arg(ap)
    args = ap.parse_args()
    res = Results("bench_jit", quick=args.quick)
    big, small = "MLP 784-256-256-10, batch 64", "MLP 32 x 16-wide, batch 16"
    if args.quick:
        n_big, n_small, k, warmup, depths, windows = 20, 200, 3, 5, (2, 8, 32), 3
    else:
        n_big, n_small, k, warmup, depths, windows = 100, 1000, 7, 20, (2, 4, 8, 16, 32), 6
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; loss: {'cross_entropy' if HAS_CE else 'mse (cross_entropy not registered)'}"
    )
    print("train_step (default: no donation) vs a hand-written jax.jit + optax.adam step without donation:\n")
    kw: dict[str, Any] = {"res": res, "section": "jit"}
    t_big, hand_big = compare(big, (784, 256, 256, 10), 64, n_big, k, warmup, model=big, **kw)
    _, hand_small = compare(small, (16,) * 33, 16, n_small, k, warmup, model=small, **kw)
    print("\ntrain_step(donate=True) vs the hand-written step donating its parameter and state buffers:\n")
    kw["section"] = "jit_donate"
    _, hand_big_d = compare(big, (784, 256, 256, 10), 64, n_big, k, warmup, True, model=big, **kw)
    _, hand_small_d = compare(small, (16,) * 33, 16, n_small, k, warmup, True, model=small, **kw)
    print(
        "\ncost of not donating (the default keeps the old buffers until the write-back), hand-written steps: "
        f"784-256-256-10 {hand_big / hand_big_d:.3f}x, 32 x 16-wide {hand_small / hand_small_d:.3f}x"
    )
    depth_sweep(depths, 16, 16, n_small, k, warmup, res)
    python_calls_per_step(depths, 16, 16, res)
    wrapper_cost(depths, 16, 16, res)
    drift(16, 32, 16, windows, n_small, res)
    bench_nnx(n_big, k, warmup, t_big, res, big)
    res.write(args.json)


if __name__ == "__main__":
    main()
