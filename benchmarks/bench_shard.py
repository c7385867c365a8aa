"""Sharded training: memory per device under ``tfl.shard(model, mesh, "fsdp")`` and the step's time.

A GPT (token embedding tied with the output head, learned positions, pre-norm
blocks of causal attention and a GELU MLP) trained with AdamW on 8 simulated
CPU devices (``--xla_force_host_platform_device_count=8``, set here before JAX
starts), the whole process pinned to one core as every benchmark here is:

1. memory: the bytes of parameters plus optimizer state each device holds
   under ``"fsdp"``, against one copy of them all (target: at most 1.25/8;
   1/8 is an even split);
2. time: ``tfl.train_step`` of the sharded model against the same model
   written by hand in ``jax.numpy`` (same initial values, same ``optax.adamw``,
   the same shardings for parameters, state and batch), compiled with
   ``jax.jit`` (neither donates its buffers). Target: at most 1.1x.

Times are min-of-k with the two steps taking turns; printed, never asserted.

Usage::

    python benchmarks/bench_shard.py           # full
    python benchmarks/bench_shard.py --quick   # a few seconds once compiled
    python benchmarks/bench_shard.py --json out/shard.json
"""

from __future__ import annotations

import os

DEVICES = 8
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402  (the device count is set before JAX starts)
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _timing import Results, add_json_arg, take_turns  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import tapeflow as tfl  # noqa: E402

MEMORY_TARGET = 1.25 / DEVICES
TIME_TARGET = 1.1
VOCAB, BLOCK, DIM, HEADS, LAYERS, BATCH = 256, 32, 128, 4, 4, 16


class Block(tfl.nn.Module):
    def __init__(self, key: Any) -> None:
        k1, k2, k3 = tfl.nn.init.keys(key, 3)
        self.ln_1 = tfl.nn.LayerNorm(DIM)
        self.attn = tfl.nn.MultiHeadAttention(DIM, HEADS, key=k1, causal=True)
        self.ln_2 = tfl.nn.LayerNorm(DIM)
        self.mlp = tfl.nn.Sequential(tfl.nn.Linear(DIM, 4 * DIM, key=k2), tfl.gelu, tfl.nn.Linear(4 * DIM, DIM, key=k3))

    def forward(self, x: Any) -> tfl.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(tfl.nn.Module):
    def __init__(self, key: Any) -> None:
        ke, kp, kb = tfl.nn.init.keys(key, 3)
        self.wte = tfl.nn.Embedding(VOCAB, DIM, key=ke, std=0.02)
        self.wpe = tfl.nn.Embedding(BLOCK, DIM, key=kp, std=0.02)
        self.h = [Block(k) for k in tfl.nn.init.keys(kb, LAYERS)]
        self.ln_f = tfl.nn.LayerNorm(DIM)
        self.lm_head = self.wte.tied_output()

    def forward(self, ids: Any) -> tfl.Tensor:
        x = self.wte(ids) + self.wpe(np.arange(ids.shape[-1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# --------------------------------------------------------------------------- the same model, by hand


def layer_norm(p: dict[str, jax.Array], pre: str, x: jax.Array) -> jax.Array:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + 1e-5) * p[pre + ".weight"] + p[pre + ".bias"]


def linear(p: dict[str, jax.Array], pre: str, x: jax.Array) -> jax.Array:
    return x @ p[pre + ".weight"].T + p[pre + ".bias"]  # PyTorch's (out, in) weights


def attention(p: dict[str, jax.Array], pre: str, x: jax.Array) -> jax.Array:
    b, n, _ = x.shape
    hd = DIM // HEADS

    def heads(t: jax.Array) -> jax.Array:
        return t.reshape(b, n, HEADS, hd).transpose(0, 2, 1, 3)

    q, k, v = (heads(linear(p, f"{pre}.{name}_proj", x)) for name in "qkv")
    scores = q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(jnp.float32(hd))
    scores = jnp.where(jnp.tril(jnp.ones((n, n), bool)), scores, -jnp.inf)
    o = jax.nn.softmax(scores, axis=-1) @ v
    return linear(p, f"{pre}.out_proj", o.transpose(0, 2, 1, 3).reshape(b, n, DIM))


def hand_loss(p: dict[str, jax.Array], ids: jax.Array, targets: jax.Array) -> jax.Array:
    x = p["wte.weight"][ids] + p["wpe.weight"][jnp.arange(ids.shape[-1])]
    for i in range(LAYERS):
        x = x + attention(p, f"h.{i}.attn", layer_norm(p, f"h.{i}.ln_1", x))
        h = jax.nn.gelu(linear(p, f"h.{i}.mlp.0", layer_norm(p, f"h.{i}.ln_2", x)), approximate=False)
        x = x + linear(p, f"h.{i}.mlp.2", h)
    logits = layer_norm(p, "ln_f", x) @ p["wte.weight"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits.reshape(-1, VOCAB), targets.reshape(-1)).mean()


# --------------------------------------------------------------------------- measurements


def device_bytes(arrays: list[jax.Array]) -> dict[jax.Device, int]:
    per: dict[jax.Device, int] = {}
    for a in arrays:
        for s in a.addressable_shards:
            per[s.device] = per.get(s.device, 0) + s.data.nbytes
    return per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    add_json_arg(ap)
    args = ap.parse_args()
    res = Results("bench_shard", quick=args.quick)
    n, k = (5, 3) if args.quick else (20, 7)
    devices = jax.devices()
    assert len(devices) == DEVICES, devices
    mesh = Mesh(np.array(devices), ("data",))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    label = f"GPT {LAYERS} layers, width {DIM}, vocab {VOCAB}, batch {BATCH}x{BLOCK}"
    tx = optax.adamw(1e-3)

    model = GPT(jax.random.key(0))
    tfl.shard(model, mesh)
    opt = tfl.Optimizer(tx, model)
    n_weights = sum(int(np.prod(p.shape)) for _, p in model.named_parameters())
    print(f"jax {jax.__version__}, {len(devices)} simulated CPU devices on one core; {label}, {n_weights:,} weights")

    params = [p.value for _, p in model.named_parameters()]
    state = [a for a in jax.tree_util.tree_leaves(opt.state) if isinstance(a, jax.Array)]
    per = device_bytes(params + state)
    total = sum(a.nbytes for a in params + state)
    ratio = max(per.values()) / total
    print(
        f"\nmemory (parameters + AdamW state): {total / 2**20:.2f} MiB in all; per device "
        f"{min(per.values()) / 2**20:.3f}..{max(per.values()) / 2**20:.3f} MiB; most on one device / total = "
        f"{ratio:.4f} (target <= {MEMORY_TARGET:.4f}: {'ok' if ratio <= MEMORY_TARGET else 'MISSES TARGET'})"
    )
    res.add("memory", label, "fsdp", None, per="device", ratio_of_total=ratio, total_bytes=total)

    def loss_fn(s: tfl.Session, x: Any, y: Any) -> tfl.Tensor:
        logits = model(s.input(x))
        return tfl.cross_entropy(logits.view(-1, VOCAB), s.input(y).view(-1))

    step = tfl.train_step(loss_fn, opt)

    # the hand-written step: the same values and shardings, its own copy of the parameters and state
    hp = {name: p.value for name, p in model.named_parameters()}
    hstate = jax.tree_util.tree_map(lambda a: a, opt.state)
    p_sh = jax.tree_util.tree_map(lambda a: a.sharding, hp)
    s_sh = jax.tree_util.tree_map(lambda a: a.sharding, hstate)

    def hand_step(p: Any, st: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, g = jax.value_and_grad(hand_loss)(p, x, y)
        updates, st = tx.update(g, st, p)
        return optax.apply_updates(p, updates), st, loss

    hand = jax.jit(hand_step, out_shardings=(p_sh, s_sh, NamedSharding(mesh, PartitionSpec())))
    r = np.random.default_rng(0)
    w = r.integers(0, VOCAB, (BATCH, BLOCK + 1)).astype(np.int32)
    x, y = jax.device_put(w[:, :-1], rows), jax.device_put(w[:, 1:], rows)
    box = {"p": hp, "s": hstate}
    first_tfl = float(step(x, y))
    first_hand = float(hand(box["p"], box["s"], x, y)[2])
    print(
        f"first losses: train_step {first_tfl:.6f}, by hand {first_hand:.6f} (|diff| {abs(first_tfl - first_hand):.1e})"
    )

    def hand_call() -> jax.Array:
        box["p"], box["s"], loss = hand(box["p"], box["s"], x, y)
        return loss

    times = take_turns({"train_step": lambda: step(x, y), "hand_jit": hand_call}, n, k)
    t_ratio = times["train_step"] / times["hand_jit"]
    print(
        f"\nstep time: train_step {times['train_step'] * 1e3:.2f} ms, by hand with jax.jit {times['hand_jit'] * 1e3:.2f} ms; "
        f"ratio {t_ratio:.3f} (target <= {TIME_TARGET}: {'ok' if t_ratio <= TIME_TARGET else 'MISSES TARGET'})"
    )
    kept = all(p.sharding == p.storage.pinned for _, p in model.parameter_records())
    print(f"every storage still on its fsdp sharding after {step.step_count} steps: {kept}")
    res.add("step", label, "hand_jit", times["hand_jit"])
    res.add("step", label, "train_step", times["train_step"], baseline="hand_jit")
    res.write(args.json)


if __name__ == "__main__":
    main()
