"""tapeflow demo: a tied-weight autoencoder with a classifier head on handwritten digits.

The encoder weight ``W`` is used twice: once to encode (``x @ W``) and once,
through ``tfl.tie``, to decode (``code @ W_dec.T``). tapeflow records one leaf
per use, sums both cotangents per storage, and hands the sum to an optax chain
that updates ``W`` once per step.

Runs offline on scikit-learn's bundled digits (1,797 8x8 images):

    python examples/demo.py               # CPU
    python examples/demo.py --device gpu  # on a GPU, when JAX has one
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import tapeflow as tfl


def load_data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return x_tr, x_te, y_tr, y_te


class TiedAutoencoderClassifier:
    """encoder x @ W, decoder code @ tie(W).T, classifier head on the code."""

    def __init__(self, n_in: int, n_code: int, n_classes: int, key: Any) -> None:
        k1, k2 = jax.random.split(key)
        f32 = jnp.float32
        self.W = tfl.Param(jax.random.normal(k1, (n_in, n_code), f32) * (1.0 / n_in) ** 0.5, name="W")
        self.W_dec = tfl.tie(self.W, name="W_dec")  # same storage, second use
        self.b_enc = tfl.Param(jnp.zeros(n_code, f32), name="b_enc")
        self.b_dec = tfl.Param(jnp.zeros(n_in, f32), name="b_dec")
        self.head = tfl.Param(jax.random.normal(k2, (n_code, n_classes), f32) * (1.0 / n_code) ** 0.5, name="head")
        self.b_head = tfl.Param(jnp.zeros(n_classes, f32), name="b_head")

    def records(self) -> list[tfl.Param]:
        return [self.W, self.W_dec, self.b_enc, self.b_dec, self.head, self.b_head]

    def __call__(self, s: tfl.Session, x: Any) -> tuple[tfl.Tensor, tfl.Tensor, tfl.Tensor]:
        x = s.input(x)
        code = tfl.tanh(x @ self.W + self.b_enc)
        recon = code @ self.W_dec.T + self.b_dec
        logits = code @ self.head + self.b_head
        return x, recon, logits

    def loss(self, s: tfl.Session, x: Any, y: Any) -> tfl.Tensor:
        xin, recon, logits = self(s, x)
        return tfl.cross_entropy(logits, s.input(y)) + 0.5 * tfl.mse(recon, xin)


def make(seed: int, lr: float) -> tuple[TiedAutoencoderClassifier, tfl.Optimizer]:
    model = TiedAutoencoderClassifier(64, 48, 10, jax.random.PRNGKey(seed))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, weight_decay=1e-4))
    return model, tfl.Optimizer(tx, model.records())


def batches(n: int, batch: int, rng: np.random.Generator) -> list[np.ndarray]:
    order = rng.permutation(n)
    return [order[i : i + batch] for i in range(0, n - batch + 1, batch)]


def accuracy(
    model: TiedAutoencoderClassifier, x: np.ndarray, y: np.ndarray, device: Any, compute_dtype: Any = None
) -> float:
    with tfl.Session(device=device, grad_enabled=False, compute_dtype=compute_dtype) as s:  # inference: no VJPs
        _, _, logits = model(s, x)
        pred = np.asarray(logits.value).argmax(axis=1)
    return float((pred == y).mean())


def time_steps(step: Any, x: np.ndarray, y: np.ndarray, idx: list[np.ndarray], n: int) -> float:
    step(x[idx[0]], y[idx[0]])  # warm-up (compiles kernels)
    t0 = time.perf_counter()
    for i in range(n):
        b = idx[i % len(idx)]
        out = step(x[b], y[b])
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="cpu, gpu, ... (default: JAX's default device)")
    ap.add_argument("--checkpoint", default="checkpoints/demo", help="where to save the trained model")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument(
        "--compute-dtype",
        default=None,
        help="mixed precision, e.g. bfloat16: float32 parameters, ops computed in this dtype (default: float32)",
    )
    args = ap.parse_args(argv)

    from tqdm.auto import tqdm

    x_tr, x_te, y_tr, y_te = load_data(args.seed)
    model, opt = make(args.seed, args.lr)
    rng = np.random.default_rng(args.seed)
    session = tfl.Session(device=args.device, seed=args.seed, compute_dtype=args.compute_dtype)
    print(f"tapeflow {tfl.__version__} on {session.device}: {len(x_tr)} train / {len(x_te)} test digits")

    steps = args.epochs * (len(x_tr) // args.batch)
    bar = tqdm(total=steps, disable=args.quiet, desc="training (eager)", unit="step")
    for _ in range(args.epochs):
        for b in batches(len(x_tr), args.batch, rng):
            with session as s:  # the block resets the session on exit
                loss = model.loss(s, x_tr[b], y_tr[b])
                opt.step(s.backward(loss))  # tied W: both uses summed, one update
                bar.set_postfix(loss=f"{float(loss):.4f}", refresh=False)
            bar.update()
    bar.close()

    acc = accuracy(model, x_te, y_te, args.device, args.compute_dtype)
    print(f"test accuracy: {acc:.4f}")

    # Same model code, eager step vs one compiled train_step (fresh copies, same data).
    idx = batches(len(x_tr), args.batch, np.random.default_rng(1))
    m_e, opt_e = make(args.seed + 1, args.lr)
    sess = tfl.Session(device=args.device)

    def eager_step(xb: np.ndarray, yb: np.ndarray) -> Any:
        with sess as s:
            loss = m_e.loss(s, xb, yb)
            opt_e.step(s.backward(loss))
            return float(loss)

    m_c, opt_c = make(args.seed + 1, args.lr)
    compiled = tfl.train_step(m_c.loss, opt_c)
    t_eager = time_steps(eager_step, x_tr, y_tr, idx, 100)
    t_jit = time_steps(compiled, x_tr, y_tr, idx, 300)
    print(
        f"time per step: eager {t_eager * 1e3:.2f} ms, train_step {t_jit * 1e3:.3f} ms ({t_eager / t_jit:.1f}x faster)"
    )

    path = Path(args.checkpoint).resolve()
    tfl.save(path, model.records(), optimizer=opt, session=session, overwrite=True)
    print(f"checkpoint saved to {path}")
    return {"accuracy": acc, "eager_step_s": t_eager, "train_step_s": t_jit}


if __name__ == "__main__":
    main()
