"""A readable eager training loop: a small tied autoencoder trained with optax.adamw.

The decoder reuses the encoder weight through ``tfl.tie``: both uses share one
storage, so the optimizer keeps one Adam slot for it and sums the two
gradient contributions before the update.

Run with ``python examples/train_loop.py``.

Run time: about 10 s on one CPU core (a first run: later ones reuse the compilation cache).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax

import tapeflow as tfl

D, H, BATCH, STEPS = 32, 8, 64, 200


def main() -> None:
    rng = np.random.default_rng(0)
    # data on an 8-dimensional subspace, so an 8-unit bottleneck can reconstruct it
    basis = 0.5 * rng.normal(size=(H, D)).astype(np.float32) / np.sqrt(H)

    W = tfl.Param(0.1 * rng.normal(size=(D, H)).astype(np.float32), name="W")
    b = tfl.Param(np.zeros(H, np.float32), name="b")
    W_dec = tfl.tie(W, name="W_dec")  # weight tying: same storage as W

    opt = tfl.Optimizer(optax.adamw(3e-2, weight_decay=1e-4), [W, b, W_dec])
    print(opt)  # 2 slots for 3 registrations

    with tfl.Session(seed=0) as s:
        for step in range(STEPS + 1):
            z = s.normal((BATCH, H))
            x = z @ basis  # a constant in the recording (no gradient)
            h = tfl.tanh(x @ W + b)
            x_hat = h @ W_dec.T
            loss = tfl.mean((x_hat - x) ** 2)
            if step % 25 == 0:
                print(f"step {step:4d}  loss {float(loss):.5f}")
            opt.step(s.backward(loss))
            s.reset()

    print("W and W_dec share storage:", W.storage is W_dec.storage)
    print("final |W|:", float(jnp.linalg.norm(W.value)))


if __name__ == "__main__":
    main()
