"""The pure core inside jax.jit: a tape recorded on tracers, differentiated, compiled.

No Session here: `leaf`, `record` and `backward` are pure functions of the tape
value, so the whole forward + backward is one compiled program. The result is
checked against `jax.grad` of the same model written in plain JAX.

    python examples/pure_core_jit.py

Run time: about 10 s on one CPU core (a first run: later ones reuse the compilation cache).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import tapeflow as tfl


def forward(t: tfl.Tape, x: jax.Array, w: jax.Array, b: jax.Array) -> tuple[tfl.Tape, int, int, int]:
    """Record a tiny model; `keep_tape_on_error` keeps the tape whole if a step fails."""
    t, ix = tfl.leaf(t, x)
    t, iw = tfl.leaf(t, w, requires_grad=True)
    t, ib = tfl.leaf(t, b, requires_grad=True)
    steps = [("linear", (ix, iw, ib), {}), ("tanh", None, {}), ("mul", None, {}), ("mean", None, {})]
    last = -1
    for op, ins, attrs in steps:
        if ins is None:
            ins = (last, last) if op == "mul" else (last,)
        t, r = tfl.keep_tape_on_error(t, tfl.record(t, op, ins, **attrs))
        if not r.is_ok:
            raise tfl.TapeError(r.error)
        last = r.value
    return t, last, iw, ib


@jax.jit
def loss_and_grads(x: jax.Array, w: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    t, root, iw, ib = forward(tfl.Tape.empty(), x, w, b)
    g = tfl.backward(t, root)
    return t[root].value, g[iw], g[ib]


def reference(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ w + b)
    return jnp.mean(h * h)


def main() -> None:
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (16, 8))
    w = jax.random.normal(kw, (8, 4)) * 0.3
    b = jnp.zeros(4)
    loss, gw, gb = loss_and_grads(x, w, b)
    ref_loss, (rw, rb) = jax.value_and_grad(reference, argnums=(1, 2))(x, w, b)
    print(f"loss {float(loss):.6f} (plain JAX {float(ref_loss):.6f})")
    print(f"max |dL/dw - jax.grad| = {float(jnp.max(jnp.abs(gw - rw))):.2e}")
    print(f"max |dL/db - jax.grad| = {float(jnp.max(jnp.abs(gb - rb))):.2e}")
    assert jnp.allclose(gw, rw, atol=1e-6) and jnp.allclose(gb, rb, atol=1e-6)

    # A tape is a pytree: it can also be a result of jax.jit.
    record_only = jax.jit(lambda x, w, b: forward(tfl.Tape.empty(), x, w, b)[0])
    t = record_only(x, w, b)
    print(f"tape returned from jit: {t}, node ops: {[n.op or 'leaf' for n in t]}")
    print(t.to_dot().splitlines()[0], "...")


if __name__ == "__main__":
    main()
