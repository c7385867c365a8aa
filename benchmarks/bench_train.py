"""Eager training-step benchmark: forward, backward, grouping, optax Adam step, reset.

Models (float32, batch 64):

(a) MLP 784-256-256-10, relu, cross-entropy (``tfl.cross_entropy`` when the op is
    registered, else mean squared error to one-hot targets);
(b) tied autoencoder 784-128: ``h = tanh(x @ W + b)``, ``x_hat = h @ tie(W).T + c``,
    mean squared reconstruction error. ``W`` gets one Adam slot for its two uses.

Each tapeflow step is the readable loop body::

    loss = model(s.input(x)); opt.step(s.backward(loss)); s.reset()

compared with

* PyTorch eager + ``torch.optim.Adam`` (``torch.set_num_threads(1)``; skipped
  with a message when torch is not importable). Target: tapeflow <= 1.5x per step.
* unjitted ``jax.value_and_grad`` + unjitted ``optax`` update (op-by-op JAX);
* the same loss code compiled by ``tfl.train_step`` (forward, backward and the
  optax update as one XLA program): what the eager step costs over the compiled one.

It also times ``opt.step`` alone against the whole step: the optax update is
one compiled call per step and should be a small part of it.

Timing is min-of-k (the best of ``k`` repeats, each the mean over ``n`` steps).
Times are printed, never asserted. XLA runs single-threaded like PyTorch unless
``--multithread`` is given.

Usage::

    python benchmarks/bench_train.py           # full
    python benchmarks/bench_train.py --quick   # well under a minute, mostly compilation
    python benchmarks/bench_train.py --json out/train.json   # also write the results as JSON
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

if "--multithread" not in sys.argv:
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _timing import TRAIN_AE, TRAIN_MLP, TRAIN_SECTION, Results, add_json_arg, min_of_k

import tapeflow as tfl

BATCH = 64
MLP = (784, 256, 256, 10)
AE = (784, 128)
LR = 1e-3
TARGET_VS_TORCH = 1.5
HAS_CE = "cross_entropy" in tfl.REGISTRY


# --------------------------------------------------------------------------- timing


def _sync(xs: Any) -> None:
    jax.block_until_ready(xs)


# --------------------------------------------------------------------------- data and weights


def make_data(rng: np.random.Generator, d_in: int, n_cls: int) -> tuple[np.ndarray, np.ndarray]:
    x = rng.normal(size=(BATCH, d_in)).astype(np.float32)
    y = rng.integers(0, n_cls, size=(BATCH,)).astype(np.int32)
    return x, y


def mlp_weights(rng: np.random.Generator) -> list[np.ndarray]:
    ws = []
    for a, b in zip(MLP[:-1], MLP[1:]):
        ws.append((rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32))
        ws.append(np.zeros(b, np.float32))
    return ws


def ae_weights(rng: np.random.Generator) -> list[np.ndarray]:
    d, h = AE
    return [
        (rng.normal(size=(d, h)) / np.sqrt(d)).astype(np.float32),
        np.zeros(h, np.float32),
        np.zeros(d, np.float32),
    ]


# --------------------------------------------------------------------------- tapeflow


class TflMLP:
    def __init__(self, ws: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> None:
        self.params = [tfl.Param(w, name=f"p{i}") for i, w in enumerate(ws)]
        self.opt = tfl.Optimizer(optax.adam(LR), self.params)
        self.s = tfl.Session(seed=0, lazy=False)  # the eager step this benchmark names
        self.x = jnp.asarray(x)
        self.y = jnp.asarray(y)
        self.onehot = jax.nn.one_hot(self.y, MLP[-1], dtype=jnp.float32)
        self.t_opt = 0.0

    def target(self) -> Any:
        """What the loss compares against: the labels (cross-entropy) or one-hot rows (mse)."""
        return self.y if HAS_CE else self.onehot

    def loss(self) -> Any:
        return self.loss_fn(self.s, self.x, self.target())

    def loss_fn(self, s: tfl.Session, x: Any, target: Any) -> Any:
        W1, b1, W2, b2, W3, b3 = self.params
        h = tfl.relu(tfl.apply("linear", s.input(x), W1, b1))
        h = tfl.relu(tfl.apply("linear", h, W2, b2))
        logits = tfl.apply("linear", h, W3, b3)
        if HAS_CE:
            return tfl.cross_entropy(logits, s.input(target))
        return tfl.mse(logits, s.input(target))

    def step(self) -> None:
        with self.s:
            grads = self.s.backward(self.loss())
            _sync(list(grads.by_leaf.values()))  # forward/backward done: time opt.step's own work
            t0 = time.perf_counter()
            self.opt.step(grads)
            _sync([p.storage.read(None) for p in self.params])
            self.t_opt += time.perf_counter() - t0
        # leaving the with block resets the session (drops the recording)


class TflAE(TflMLP):
    def __init__(self, ws: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> None:
        W = tfl.Param(ws[0], name="W")
        self.W_dec = tfl.tie(W, name="W_dec")
        self.params = [W, tfl.Param(ws[1], name="b"), tfl.Param(ws[2], name="c")]
        self.opt = tfl.Optimizer(optax.adam(LR), self.params + [self.W_dec])
        self.s = tfl.Session(seed=0, lazy=False)  # the eager step this benchmark names
        self.x = jnp.asarray(x)
        self.t_opt = 0.0

    def target(self) -> Any:
        return self.x

    def loss_fn(self, s: tfl.Session, x: Any, target: Any) -> Any:
        W, b, c = self.params
        x = s.input(x)
        h = tfl.tanh(tfl.apply("linear", x, W, b))
        x_hat = h @ self.W_dec.T + c
        return tfl.mse(x_hat, x)


# --------------------------------------------------------------------------- tapeflow, compiled


def compiled_step(cls: type[TflMLP], ws: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> Callable[[], Any]:
    """The model's loss code (fresh parameters) compiled by ``tfl.train_step``: one call per step."""
    model = cls(ws, x, y)
    step = tfl.train_step(model.loss_fn, model.opt)
    xb, target = model.x, model.target()
    return lambda: step(xb, target)


# --------------------------------------------------------------------------- plain JAX (unjitted)


def jax_mlp_loss(p: list[Any], x: Any, y: Any) -> Any:
    h = jax.nn.relu(x @ p[0] + p[1])
    h = jax.nn.relu(h @ p[2] + p[3])
    logits = h @ p[4] + p[5]
    if HAS_CE:
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return jnp.mean((logits - jax.nn.one_hot(y, MLP[-1], dtype=logits.dtype)) ** 2)


def jax_ae_loss(p: list[Any], x: Any, y: Any) -> Any:
    W, b, c = p
    h = jnp.tanh(x @ W + b)
    return jnp.mean((h @ W.T + c - x) ** 2)


class JaxEager:
    def __init__(self, loss: Callable[..., Any], ws: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> None:
        self.vg = jax.value_and_grad(loss)
        self.tx = optax.adam(LR)
        self.p = [jnp.asarray(w) for w in ws]
        self.state = self.tx.init(self.p)
        self.x, self.y = jnp.asarray(x), jnp.asarray(y)

    def step(self) -> None:
        _, g = self.vg(self.p, self.x, self.y)
        u, self.state = self.tx.update(g, self.state, self.p)
        self.p = optax.apply_updates(self.p, u)
        _sync(self.p)


# --------------------------------------------------------------------------- PyTorch


def torch_steps(
    ws: list[np.ndarray], x: np.ndarray, y: np.ndarray
) -> tuple[Callable[[], None], Callable[[], None]] | None:
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    torch.set_num_threads(1)
    tx, ty = torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))

    mp = [torch.nn.Parameter(torch.from_numpy(w.copy())) for w in ws]
    mopt = torch.optim.Adam(mp, lr=LR)
    onehot = F.one_hot(ty, MLP[-1]).float()

    def mlp_step() -> None:
        h = F.relu(torch.addmm(mp[1], tx, mp[0]))
        h = F.relu(torch.addmm(mp[3], h, mp[2]))
        logits = torch.addmm(mp[5], h, mp[4])
        loss = F.cross_entropy(logits, ty) if HAS_CE else F.mse_loss(logits, onehot)
        mopt.zero_grad(set_to_none=True)
        loss.backward()
        mopt.step()

    aw = ae_weights(np.random.default_rng(1))
    ap = [torch.nn.Parameter(torch.from_numpy(w.copy())) for w in aw]
    aopt = torch.optim.Adam(ap, lr=LR)

    def ae_step() -> None:
        W, b, c = ap
        h = torch.tanh(torch.addmm(b, tx, W))
        x_hat = torch.addmm(c, h, W.t())
        loss = F.mse_loss(x_hat, tx)
        aopt.zero_grad(set_to_none=True)
        loss.backward()
        aopt.step()

    return mlp_step, ae_step


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    ap.add_argument("--multithread", action="store_true", help="let XLA use its multi-threaded CPU kernels")
    add_json_arg(ap)
    args = ap.parse_args()
    res = Results("bench_train", quick=args.quick)
    n, k, warm = (10, 3, 3) if args.quick else (50, 5, 10)
    n_jax = max(2, n // 5)

    rng = np.random.default_rng(0)
    x, y = make_data(rng, MLP[0], MLP[-1])
    mw = mlp_weights(np.random.default_rng(1))
    aw = ae_weights(np.random.default_rng(1))
    torch = torch_steps(mw, x, y)

    print(
        f"jax {jax.__version__} on {jax.devices()[0]}, optax {optax.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
    )
    print(
        f"batch {BATCH}, Adam lr {LR}, min of {k} repeats x {n} steps"
        f"{'' if HAS_CE else ' (no cross_entropy op: mse to one-hot)'}"
    )
    if torch is None:
        print("torch not importable: PyTorch comparison skipped")

    cases = [
        (
            "(a) MLP 784-256-256-10, cross-entropy" if HAS_CE else "(a) MLP 784-256-256-10, mse",
            TflMLP,
            mw,
            jax_mlp_loss,
            0,
            TRAIN_MLP,
        ),
        ("(b) tied autoencoder 784-128, W_dec = tie(W)", TflAE, aw, jax_ae_loss, 1, TRAIN_AE),
    ]
    baseline = "pytorch" if torch is not None else None
    for title, cls, ws, jloss, ti, name in cases:
        print(f"\n{title}")
        model = cls(ws, x, y)
        t_tfl = min_of_k(model.step, n, k, warm)
        # opt.step alone, measured inside the same steps (min-of-k on both)
        best_opt, best_all = float("inf"), float("inf")
        for _ in range(k):
            model.t_opt = 0.0
            t0 = time.perf_counter()
            for _ in range(n):
                model.step()
            best_all = min(best_all, (time.perf_counter() - t0) / n)
            best_opt = min(best_opt, model.t_opt / n)
        print(f"  tapeflow eager step          {t_tfl * 1e3:8.3f} ms")
        print(
            f"    of which opt.step          {best_opt * 1e3:8.3f} ms  ({best_opt / best_all:.0%} of {best_all * 1e3:.3f} ms)"
        )
        res.add(TRAIN_SECTION, name, "eager", t_tfl, baseline=baseline, target=f"<= {TARGET_VS_TORCH}x pytorch")
        res.add("train_opt_step", name, "eager", best_all)
        res.add("train_opt_step", name, "opt_step", best_opt, baseline="eager")
        if torch is not None:
            t_torch = min_of_k(torch[ti], n, k, warm)
            r = t_tfl / t_torch
            verdict = "meets" if r <= TARGET_VS_TORCH else "MISSES"
            print(
                f"  PyTorch eager + Adam         {t_torch * 1e3:8.3f} ms   tapeflow/torch = {r:5.2f}x "
                f"(target <= {TARGET_VS_TORCH}x: {verdict})"
            )
            res.add(TRAIN_SECTION, name, "pytorch", t_torch)
        je = JaxEager(jloss, ws, x, y)
        t_jax = min_of_k(je.step, n_jax, k, 2)
        print(f"  jax.value_and_grad + optax   {t_jax * 1e3:8.3f} ms   unjitted-jax/tapeflow = {t_jax / t_tfl:5.1f}x")
        res.add(TRAIN_SECTION, name, "jax_unjitted", t_jax, baseline=baseline)
        t_jit = min_of_k(compiled_step(cls, ws, x, y), n, k, warm)
        print(f"  tfl.train_step (compiled)    {t_jit * 1e3:8.3f} ms   eager/train_step = {t_tfl / t_jit:5.1f}x")
        res.add(TRAIN_SECTION, name, "train_step", t_jit, baseline=baseline)
    res.write(args.json)


if __name__ == "__main__":
    main()
