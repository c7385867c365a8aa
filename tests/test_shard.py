"""tfl.shard: storages placed once on a mesh, every training path sharded, checkpoints that reshard.

The multi-device checks run in subprocesses (``--xla_force_host_platform_device_count`` only takes effect
before JAX starts), side by side: two processes of 4 devices each over ``jax.distributed``, writing a
checkpoint, and one process of 8 devices that runs every other scenario, then restores that checkpoint
once the two have written it. Each
scenario's numbers come back as JSON and each test below asserts one part of them against a
single-device run of the same model in the same subprocess (the oracle).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

import tapeflow as tfl

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RTOL = 1e-5  # the bound: a sharded run equals a single-device run
ATOL = 1e-6  # for entries near zero (Adam moves every weight by ~lr, so values stay O(0.01..1))

# --------------------------------------------------------------------------- the model every scenario trains

VOCAB, BLOCK, DIM, HEADS, LAYERS, BATCH = 64, 8, 32, 4, 1, 8  # one block: few ops to compile


class Block(tfl.nn.Module):
    def __init__(self, key: jax.Array) -> None:
        k1, k2, k3 = tfl.nn.init.keys(key, 3)
        self.ln_1 = tfl.nn.LayerNorm(DIM)
        self.attn = tfl.nn.MultiHeadAttention(DIM, HEADS, key=k1, causal=True)
        self.ln_2 = tfl.nn.LayerNorm(DIM)
        self.mlp = tfl.nn.Sequential(tfl.nn.Linear(DIM, 4 * DIM, key=k2), tfl.gelu, tfl.nn.Linear(4 * DIM, DIM, key=k3))

    def forward(self, x):  # type: ignore[no-untyped-def]
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(tfl.nn.Module):
    """A small GPT whose output head is tied to its token embedding (one storage, two names)."""

    def __init__(self, seed: int = 0) -> None:
        ke, kp, kb = tfl.nn.init.keys(jax.random.key(seed), 3)
        self.wte = tfl.nn.Embedding(VOCAB, DIM, key=ke, std=0.02)
        self.wpe = tfl.nn.Embedding(BLOCK, DIM, key=kp, std=0.02)
        self.h = [Block(k) for k in tfl.nn.init.keys(kb, LAYERS)]
        self.ln_f = tfl.nn.LayerNorm(DIM)
        self.lm_head = self.wte.tied_output()

    def forward(self, ids):  # type: ignore[no-untyped-def]
        x = self.wte(ids) + self.wpe(np.arange(ids.shape[-1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt_loss(model: GPT):  # type: ignore[no-untyped-def]
    def loss_fn(s, x, y):  # type: ignore[no-untyped-def]
        logits = model(s.input(x))
        return tfl.cross_entropy(logits.view(-1, VOCAB), s.input(y).view(-1))

    return loss_fn


def batches(n: int, seed: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    r = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        w = r.integers(0, VOCAB, (BATCH, BLOCK + 1)).astype(np.int32)
        out.append((w[:, :-1], w[:, 1:]))
    return out


# tensor parallelism over ("data", "model"): Linear weights are (out, in); q/k/v and the MLP's first layer are
# cut by output features (columns), the attention output and the MLP's second layer by input features (rows)
TP_RULES = [
    (r"h\.\d+\.attn\.(q|k|v)_proj\.weight", ("model", None)),
    (r"h\.\d+\.attn\.(q|k|v)_proj\.bias", ("model",)),
    (r"h\.\d+\.attn\.out_proj\.weight", (None, "model")),
    (r"h\.\d+\.mlp\.0\.weight", ("model", None)),
    (r"h\.\d+\.mlp\.0\.bias", ("model",)),
    (r"h\.\d+\.mlp\.2\.weight", (None, "model")),
    (r"wte\.weight|lm_head\.weight", (None, "model")),
]


# --------------------------------------------------------------------------- the subprocesses

_COMMON = textwrap.dedent(
    """
    import gc, json, os, sys
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    sys.path.insert(0, sys.argv[1])
    import tapeflow as tfl
    from test_shard import GPT, TP_RULES, batches, gpt_loss

    def tx():
        # eps well above rounding noise: a weight whose true gradient is 0 (a key bias: softmax ignores it)
        # gets a rounding-noise gradient, which Adam with a tiny eps would turn into a +-lr step of either
        # sign, on one device as on eight; the comparisons below would then measure that noise, not sharding
        return optax.adam(3e-3, eps=1e-4)

    def values(model):  # the whole value of each storage, gathered (on every process)
        from jax.experimental import multihost_utils
        out = {}
        for n, p in model.named_parameters():
            v = p.value
            if not v.is_fully_addressable:
                v = multihost_utils.process_allgather(v, tiled=True)
            out[n] = np.asarray(v).tolist()
        return out

    def spec(x):  # a Param's or an array's PartitionSpec, trailing Nones dropped (None: not on a mesh)
        sh = x.sharding
        if not isinstance(sh, NamedSharding):
            return None
        entries = [None if e is None else str(e) for e in sh.spec]
        while entries and entries[-1] is None:
            entries.pop()
        return entries
    """
)

_MULTIPROCESS = _COMMON + textwrap.dedent(
    """
    pid, port, ckpt = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    assert jax.process_count() == 2 and len(jax.devices()) == 8 and len(jax.local_devices()) == 4
    mesh = Mesh(np.array(jax.devices()), ("data",))
    model = GPT()
    tfl.shard(model, mesh)
    opt = tfl.Optimizer(tx(), model)
    step = tfl.train_step(gpt_loss(model), opt)
    rows = NamedSharding(mesh, P("data"))
    per = 8 // jax.process_count()
    losses = []
    for x, y in batches(3):
        lo = jax.process_index() * per
        gx = jax.make_array_from_process_local_data(rows, x[lo:lo + per])
        gy = jax.make_array_from_process_local_data(rows, y[lo:lo + per])
        losses.append(float(step(gx, gy)))
    tfl.save(ckpt, model, opt, step)  # each process writes its own shards
    result = {"losses": losses, "values": values(model), "spec": spec(model.wte.weight),
              "addressable": model.wte.weight.value.is_fully_addressable}
    with open(f"{ckpt}.{pid}.part", "w") as f:  # a file, not stdout: a full pipe would stall the shutdown barrier
        json.dump(result, f)
    os.replace(f"{ckpt}.{pid}.part", f"{ckpt}.{pid}.json")  # whole when it appears (the 8-device process waits for it)
    jax.distributed.shutdown()
    """
)

_EIGHT = _COMMON + textwrap.dedent(
    """
    ckpt_dir, two_proc_ckpt = sys.argv[2], sys.argv[3]
    assert len(jax.devices()) == 8
    out = {}
    devs = jax.devices()
    mesh8 = Mesh(np.array(devs), ("data",))
    rows8 = NamedSharding(mesh8, P("data"))
    data = batches(3)

    def diff(a, b):
        a, b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
        assert len(a) == len(b)
        return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))
                                / (1e-5 * np.abs(np.asarray(y, np.float64)) + 1e-6))) for x, y in zip(a, b))

    def device_bytes(arrays):
        per = {}
        for a in arrays:
            for s in a.addressable_shards:
                per[s.device] = per.get(s.device, 0) + s.data.nbytes
        return per

    def run(path, sharded, steps=3, **options):
        # `path` trains a fresh GPT for `steps` batches; returns losses, final values and the model
        model = GPT()
        if sharded is not None:
            tfl.shard(model, *sharded)
        opt = tfl.Optimizer(tx(), model)
        loss_fn = gpt_loss(model)
        put = (lambda a: jax.device_put(a, rows8)) if sharded is not None and sharded[0] is mesh8 else (lambda a: a)
        losses = []
        if path == "train_step":
            step = tfl.train_step(loss_fn, opt, **options)
            losses = [float(step(put(x), put(y))) for x, y in data[:steps]]
        else:
            for x, y in data[:steps]:
                with tfl.Session(lazy=path == "lazy") as s:
                    loss = loss_fn(s, put(x), put(y))
                    losses.append(float(loss))
                    opt.step(s.backward(loss))
        return losses, values(model), model, opt

    # 1. memory first (nothing else lives yet): fsdp train_step on 8 devices, then p.value and a save
    losses, vals, model, opt = run("train_step", (mesh8,))
    params = [p.value for _, p in model.named_parameters()]
    state = [a for a in jax.tree_util.tree_leaves(opt.state) if isinstance(a, jax.Array)]
    per = device_bytes(params + state)
    total = sum(a.nbytes for a in params + state)
    tfl.save(os.path.join(ckpt_dir, "mem"), model, opt)
    del vals
    gc.collect()
    live = {}  # every live buffer once (a sharded array and the arrays of its shards share their buffers)
    for a in jax.live_arrays():
        if not a.is_deleted():
            for s in a.addressable_shards:
                live[(s.device, s.data.unsafe_buffer_pointer())] = s.data.nbytes
    live = {d: sum(n for (e, _), n in live.items() if e == d) for d in devs}
    out["memory"] = {"ratio": max(per.values()) / total, "live_ratio": max(live.values()) / total,
                     "live_dev0": live[devs[0]], "live_dev1": live[devs[1]], "total": total,
                     "mirrors": sum(p.storage.mirror is not None for _, p in model.parameter_records())}
    del model, opt, params, state

    # train_step(mesh=..., param_specs=...) without tfl.shard: its sharded parameter too lives only as shards
    def live_bytes():
        gc.collect()
        seen = {}
        for a in jax.live_arrays():
            if not a.is_deleted():
                for s in a.addressable_shards:
                    seen[(s.device, s.data.unsafe_buffer_pointer())] = s.data.nbytes
        return {d: sum(n for (e, _), n in seen.items() if e == d) for d in devs}
    before = live_bytes()
    w = tfl.Param(np.full((64, 16), 0.1, np.float32), name="w")
    b = tfl.Param(np.zeros(16, np.float32), name="b")
    step_ps = tfl.train_step(lambda s, x: tfl.sum(tfl.tanh(s.input(x) @ w + b)),
                             tfl.Optimizer(optax.sgd(0.1), {"w": w, "b": b}), mesh=mesh8, param_specs={"w": P("data")})
    step_ps(np.ones((8, 64), np.float32))
    after = live_bytes()
    out["param_specs"] = {"spec": spec(w), "mirror": w.storage.mirror is not None, "whole": w.value.nbytes,
                          "dev0": after[devs[0]] - before[devs[0]], "dev1": after[devs[1]] - before[devs[1]]}
    del w, b, step_ps

    # 2. every path under fsdp equals the same path on one device; the shardings after the steps
    out["paths"] = {}
    for path in ("eager", "lazy", "train_step"):
        single = run(path, None)
        sharded = run(path, (mesh8,))
        m, o = sharded[2], sharded[3]
        pins = {n: spec(p) for n, p in m.named_parameters()}
        mu = o.state[0].mu
        out["paths"][path] = {
            "loss": diff(sharded[0], single[0]), "values": diff(sharded[1], single[1]),
            "kept": all(p.sharding == p.storage.pinned for _, p in m.parameter_records()),
            "mu_follows": all(mu[n].sharding == p.storage.pinned for n, p in m.named_parameters()),
            "tied_spec": [spec(m.wte.weight), spec(m.lm_head.weight)],
            "tied_one": m.wte.weight.storage is m.lm_head.weight.storage,
            "specs": pins, "falls": sharded[0][-1] < sharded[0][0],
        }
    # microbatches through train_step, against the whole-batch step on one device (the loop's last `single`)
    sharded = run("train_step", (mesh8,), microbatches=2)
    out["paths"]["microbatches"] = {"loss": diff(sharded[0], single[0]), "values": diff(sharded[1], single[1])}
    # mixed precision: bfloat16 rounds each device's partial sums, so eight devices differ from one by bf16's
    # rounding, not float32's; measured relative to each value's scale, with SGD (Adam would magnify the
    # rounding of near-zero gradients into whole steps)
    tx_adam = tx
    tx = lambda: optax.sgd(0.1, momentum=0.9)
    single = run("train_step", None, compute_dtype=jnp.bfloat16)
    sharded = run("train_step", (mesh8,), compute_dtype=jnp.bfloat16)
    tx = tx_adam
    out["paths"]["bf16"] = {
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(sharded[0], single[0])),
        # against the model's weight scale (LayerNorm weights ~1): a weight whose true gradient is 0 moves by
        # rounding alone, on one device as on eight
        "values_rel": max(float(np.max(np.abs(np.asarray(sharded[1][n]) - np.asarray(v)))) for n, v in single[1].items())
                      / max(float(np.max(np.abs(v))) for v in single[1].values()),
        "kept": all(p.sharding == p.storage.pinned for _, p in sharded[2].parameter_records()),
    }

    # 3. jax.jit(tfl.value_and_grad(...)) on the sharded storages
    def vg_of(sharded):
        model = GPT()
        if sharded:
            tfl.shard(model, mesh8)
        x, y = data[0]
        f = jax.jit(tfl.value_and_grad(gpt_loss(model)))
        params = {n: p for n, p in model.named_parameters()}
        loss, g = f(params, jax.device_put(x, rows8) if sharded else x, y)
        return float(loss), {n: np.asarray(v).tolist() for n, v in g.items()}, {n: g[n].sharding == params[n].sharding for n in g}
    l1, g1, _ = vg_of(False)
    l8, g8, same = vg_of(True)
    out["vg"] = {"loss": diff(l8, l1), "grads": diff(g8, g1), "sharding_kept": all(same.values())}

    # 4. BatchNorm and a tfl.checkpoint block, fsdp, train_step and eager
    def bn_run(sharded, path):
        r = np.random.default_rng(3)
        lin = tfl.nn.Linear(16, 32, key=jax.random.key(4))
        bn = tfl.nn.BatchNorm1d(32)
        head = tfl.nn.Linear(32, 8, key=jax.random.key(5))
        model = tfl.nn.Sequential(lin, bn, head)
        if sharded:
            tfl.shard(model, mesh8)
        block = tfl.checkpoint(lambda h: tfl.tanh(lin(h)))  # recomputed in backward (state is written outside)
        def loss_fn(s, x):
            return tfl.mean(head(bn(block(s.input(x)))) ** 2.0)
        opt = tfl.Optimizer(tx(), model)
        xs = [r.standard_normal((16, 16)).astype(np.float32) for _ in range(3)]
        put = (lambda a: jax.device_put(a, rows8)) if sharded else (lambda a: a)
        if path == "train_step":
            step = tfl.train_step(loss_fn, opt)
            losses = [float(step(put(x))) for x in xs]
        else:
            losses = []
            for x in xs:
                with tfl.Session() as s:
                    loss = loss_fn(s, put(x))
                    losses.append(float(loss))
                    opt.step(s.backward(loss))
        stats = [np.asarray(bn.running_mean.value).tolist(), np.asarray(bn.running_var.value).tolist()]
        return losses, values(model), stats, spec(bn.running_mean)
    out["bn"] = {}
    for path in ("train_step", "eager"):
        a, b = bn_run(False, path), bn_run(True, path)
        out["bn"][path] = {"loss": diff(b[0], a[0]), "values": diff(b[1], a[1]), "stats": diff(b[2], a[2]), "stat_spec": b[3]}

    # 5. a 2-D mesh ("data", "model") with column/row rules
    mesh2 = Mesh(np.array(devs).reshape(2, 4), ("data", "model"))
    rules = [(pattern, P(*entries)) for pattern, entries in TP_RULES]
    single = run("train_step", None)
    tp = run("train_step", (mesh2, rules))
    m = tp[2]
    out["tp"] = {"loss": diff(tp[0], single[0]), "values": diff(tp[1], single[1]),
                 "specs": {n: spec(p) for n, p in m.named_parameters()},
                 "mu": spec(tp[3].state[0].mu["h.0.mlp.2.weight"])}

    # 6. the conflict error: one storage, two names, two specs; nothing placed
    model = GPT()
    try:
        tfl.shard(model, mesh2, [(r"wte\\.weight", P("data", None)), (r"lm_head\\.weight", P(None, "model")),
                                 (r".*", P())])
        out["conflict"] = None
    except ValueError as e:
        out["conflict"] = {"message": str(e),
                           "placed": [n for n, p in model.parameter_records() if p.storage.pinned is not None]}

    # 7. checkpoints that reshard: 8 -> 4 -> 1 devices continues as an uninterrupted run
    mesh4 = Mesh(np.array(devs[:4]), ("data",))
    five = batches(5, seed=7)
    def fresh(mesh):
        model = GPT()
        if mesh is not None:
            tfl.shard(model, mesh)
        opt = tfl.Optimizer(tx(), model)
        return model, opt, tfl.train_step(gpt_loss(model), opt)
    def feed(mesh, step, batch):
        x, y = batch
        if mesh is not None:
            x, y = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
        return float(step(x, y))
    m_ref, _, s_ref = fresh(None)
    ref = [feed(None, s_ref, b) for b in five]
    m8, o8, s8 = fresh(mesh8)
    got = [feed(mesh8, s8, b) for b in five[:2]]
    tfl.save(os.path.join(ckpt_dir, "eight"), m8, o8, s8)
    m4, o4, s4 = fresh(mesh4)
    tfl.restore(os.path.join(ckpt_dir, "eight"), m4, o4, s4)
    resharded = {"m4": spec(m4.wte.weight), "m4_devices": len(m4.wte.weight.sharding.device_set),
                 "mu4_devices": len(o4.state[0].mu["wte.weight"].sharding.device_set)}
    got += [feed(mesh4, s4, b) for b in five[2:4]]
    tfl.save(os.path.join(ckpt_dir, "four"), m4, o4, s4)
    m1, o1, s1 = fresh(None)
    tfl.restore(os.path.join(ckpt_dir, "four"), m1, o1, s1)
    resharded["m1_devices"] = len(m1.wte.weight.sharding.device_set)
    got += [feed(None, s1, five[4])]
    # the same mesh again: a restore continues bit for bit
    ma, oa, sa = fresh(mesh8)
    straight = [feed(mesh8, sa, b) for b in five[:4]]
    mb, ob, sb = fresh(mesh8)
    tfl.restore(os.path.join(ckpt_dir, "eight"), mb, ob, sb)
    again = [feed(mesh8, sb, b) for b in five[2:4]]
    out["reshard"] = {"loss": diff(got, ref), "values": diff(values(m1), values(m_ref)), **resharded,
                      "same_mesh_exact": again == straight[2:] and values(mb) == values(ma)}

    # 8. a checkpoint written by two processes of 4 devices (running beside this one), restored by one of 8 and
    # by one device; each writes its JSON after its save returned, which is after the checkpoint was installed
    import time
    deadline = time.monotonic() + 600
    while not all(os.path.exists(f"{two_proc_ckpt}.{i}.json") for i in range(2)):
        assert time.monotonic() < deadline, "the two processes wrote no checkpoint"
        time.sleep(0.2)
    m8b, o8b, s8b = fresh(mesh8)
    mine = [feed(mesh8, s8b, b) for b in data]
    r8, ro8, rs8 = fresh(mesh8)
    tfl.restore(two_proc_ckpt, r8, ro8, rs8)
    r1, ro1, rs1 = fresh(None)
    tfl.restore(two_proc_ckpt, r1, ro1, rs1)
    nxt = batches(1, seed=9)[0]
    out["two_proc"] = {"losses": mine, "values": values(m8b), "restored8": values(r8), "restored1": values(r1),
                       "next8": feed(mesh8, rs8, nxt), "next1": feed(None, rs1, nxt), "next_mine": feed(mesh8, s8b, nxt)}

    # 9. the guide's picture: what the library draws for the guide's model now
    sys.path.insert(0, os.path.join(sys.argv[1], "..", "docs", "_ext"))
    import figures
    out["picture"] = figures.scaling_dot()
    print(json.dumps(out))
    """
)


def _env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    # LLVM without its optimization passes compiles these programs in about 60% of the time; every
    # comparison is between two runs of one process, compiled alike
    flags = " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}{flags}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_ENABLE_X64", None)
    return env


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two processes of 4 devices (jax.distributed on localhost) and, beside them, one process of 8 devices."""
    tmp = tmp_path_factory.mktemp("shard")
    ckpt = str(tmp / "two_proc")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    two = []
    with contextlib.ExitStack() as stack:
        # every process logs to a file: none can block on a full pipe (and stall the others at a barrier)
        logs = [stack.enter_context(open(tmp / f"process{i}.log", "w+")) for i in range(3)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _MULTIPROCESS, str(HERE), str(i), str(port), ckpt],
                env=_env(4),
                stdout=logs[i],
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i in range(2)
        ]
        eight_out = stack.enter_context(open(tmp / "eight.json", "w+"))
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _EIGHT, str(HERE), str(tmp), ckpt],
                env=_env(8),
                stdout=eight_out,
                stderr=logs[2],
                text=True,
            )
        )
        try:
            for i, p in enumerate(procs):
                p.wait(timeout=900)
                logs[i].seek(0)
                assert p.returncode == 0, logs[i].read()[-6000:]
                if i < 2:
                    two.append(json.loads(Path(f"{ckpt}.{i}.json").read_text()))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        eight_out.seek(0)
        return {"two": two, "eight": _last_json(eight_out.read())}


def test_every_path_under_fsdp_equals_one_device(runs: dict) -> None:
    paths = runs["eight"]["paths"]
    for path in ("eager", "lazy", "train_step"):
        got = paths[path]
        assert got["loss"] <= 1.0 and got["values"] <= 1.0, (path, got)  # |a - b| <= rtol |b| + atol
        assert got["kept"] and got["mu_follows"], (path, got)
        assert got["falls"], (path, got)
        assert got["tied_one"] and got["tied_spec"] == [["data"], ["data"]], (path, got)
        specs = got["specs"]
        # the largest dimension the 8 devices divide: wte (64, 32) by rows, wpe (8, 32) by columns
        assert specs["wpe.weight"] == [None, "data"] and specs["h.0.mlp.0.weight"] == ["data"], specs
        assert specs["h.0.mlp.2.weight"] == [None, "data"] and specs["ln_f.weight"] == ["data"], specs
    assert paths["microbatches"]["loss"] <= 1.0 and paths["microbatches"]["values"] <= 1.0, paths["microbatches"]
    # bfloat16 compute: equal to bfloat16's resolution (2**-8), not to float32's 1e-5 (see the script)
    bf16 = paths["bf16"]
    assert bf16["loss_rel"] <= 2**-8 and bf16["values_rel"] <= 2**-8 and bf16["kept"], bf16


def test_value_and_grad_under_jit_on_sharded_storages(runs: dict) -> None:
    vg = runs["eight"]["vg"]
    assert vg["loss"] <= 1.0 and vg["grads"] <= 1.0 and vg["sharding_kept"], vg


def test_batchnorm_and_checkpointed_block_sharded(runs: dict) -> None:
    for path, got in runs["eight"]["bn"].items():
        assert got["loss"] <= 1.0 and got["values"] <= 1.0 and got["stats"] <= 1.0, (path, got)
        assert got["stat_spec"] == ["data"], (path, got)  # running statistics are placed like parameters


def test_fsdp_memory_per_device(runs: dict) -> None:
    mem = runs["eight"]["memory"]
    assert mem["ratio"] <= 1.25 / 8, mem
    # nothing else holds a whole copy: every live array on device 0 (params, optimizer state, what the
    # step and the save left) is no more than on device 1, and within the same bound
    assert mem["live_ratio"] <= 1.25 / 8 and mem["live_dev0"] == mem["live_dev1"], mem
    assert mem["mirrors"] == 0, mem


def test_param_specs_path_keeps_no_whole_copy_on_device_0(runs: dict) -> None:
    got = runs["eight"]["param_specs"]
    assert got["spec"] == ["data"] and not got["mirror"], got
    # device 0 gained what device 1 did (w's shard, b, the batch's rows, counters), not a copy of w
    assert got["dev0"] == got["dev1"] < got["whole"], got


def test_tensor_parallel_rules_on_a_2d_mesh(runs: dict) -> None:
    tp = runs["eight"]["tp"]
    assert tp["loss"] <= 1.0 and tp["values"] <= 1.0, tp
    specs = tp["specs"]
    # spec() drops trailing Nones, as shard writes them: P("model", None) reads back as ["model"]
    assert specs["h.0.attn.q_proj.weight"] == ["model"] and specs["h.0.attn.out_proj.weight"] == [None, "model"]
    assert specs["h.0.mlp.0.bias"] == ["model"] and specs["wte.weight"] == [None, "model"]
    assert specs["ln_f.weight"] == [] and specs["h.0.attn.out_proj.bias"] == []  # unmatched: replicated
    assert tp["mu"] == [None, "model"], tp


def test_two_names_of_one_storage_with_different_specs_is_an_error(runs: dict) -> None:
    got = runs["eight"]["conflict"]
    assert got is not None, "no error"
    assert "'wte.weight'" in got["message"] and "'lm_head.weight'" in got["message"], got
    assert "P('data')" in got["message"] and "P(None, 'model')" in got["message"], got
    assert got["placed"] == [], got


def test_restores_reshard_8_to_4_to_1_devices(runs: dict) -> None:
    got = runs["eight"]["reshard"]
    assert got["loss"] <= 1.0 and got["values"] <= 1.0, got
    assert got["m4"] == ["data"] and got["m4_devices"] == 4 and got["mu4_devices"] == 4, got
    assert got["m1_devices"] == 1, got
    assert got["same_mesh_exact"], got


def test_two_processes_equal_one_process_and_their_checkpoint_restores(runs: dict) -> None:
    two, eight = runs["two"], runs["eight"]["two_proc"]
    assert two[0]["losses"] == two[1]["losses"] and two[0]["values"] == two[1]["values"]
    assert two[0]["spec"] == ["data"] and not two[0]["addressable"]  # shards across both processes
    np.testing.assert_allclose(two[0]["losses"], eight["losses"], rtol=RTOL, atol=ATOL)
    for name, v in eight["values"].items():
        np.testing.assert_allclose(two[0]["values"][name], v, rtol=RTOL, atol=ATOL, err_msg=name)
        # the checkpoint the two processes wrote holds exactly what they trained
        assert eight["restored8"][name] == two[0]["values"][name] == eight["restored1"][name], name
    np.testing.assert_allclose([eight["next8"], eight["next1"]], eight["next_mine"], rtol=RTOL, atol=ATOL)


def test_the_guides_picture_is_what_the_library_draws(runs: dict) -> None:
    committed = (ROOT / "docs" / "images" / "scaling_fsdp.dot").read_text()
    assert runs["eight"]["picture"] == committed, (
        "docs/images/scaling_fsdp.dot is stale: run python docs/_ext/figures.py"
    )


# --------------------------------------------------------------------------- one device, in this process


def test_rules_on_one_device() -> None:
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    w = tfl.Param(jnp.ones((4, 6), jnp.float32), name="w")
    b = tfl.Param(jnp.zeros(3, jnp.float32), name="b")
    tfl.shard([w, tfl.tie(w, name="w_out"), b], mesh)
    assert w.sharding.spec == PartitionSpec(None, "data") and b.sharding.spec == PartitionSpec("data")
    assert w.storage.pinned == w.sharding
    tfl.shard({"w": w, "b": b}, mesh, "replicate")
    assert w.sharding.spec == PartitionSpec() and b.sharding.spec == PartitionSpec()
    tfl.shard({"w": w, "b": b}, mesh, [(r"b", PartitionSpec("data")), (r".*", PartitionSpec("data", None))])
    # written without trailing Nones, as XLA writes its results' specs (PartitionSpec compares entry by entry)
    assert w.sharding.spec == PartitionSpec("data") and b.sharding.spec == PartitionSpec("data")
    # a write lands on the storage's sharding, whatever computed it
    w.value = jnp.full((4, 6), 2.0, jnp.float32)
    assert w.sharding == w.storage.pinned and float(w.value[0, 0]) == 2.0


@pytest.mark.parametrize(
    ("rules", "kw", "error", "match"),
    [
        ("zero", {}, ValueError, r'unknown rules .zero.; use "fsdp"'),
        ("fsdp", {"data_axis": "batch"}, ValueError, r"mesh has no axis 'batch'"),
        ([("(", PartitionSpec())], {}, ValueError, r"rule 0 has the pattern '\(', which is not a regex"),
        ([("w", ("data",))], {}, TypeError, r"give a jax.sharding.PartitionSpec"),
        ([("w", PartitionSpec("model"))], {}, ValueError, r"mesh axis 'model', which the mesh does not have"),
        ([("w", PartitionSpec(None, None, "data"))], {}, ValueError, r"3 entries for 2 dimensions"),
    ],
)
def test_refused_rules_place_nothing(rules: object, kw: dict, error: type, match: str) -> None:
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    w = tfl.Param(jnp.ones((4, 6), jnp.float32), name="w")
    before = w.sharding
    with pytest.raises(error, match=match):
        tfl.shard([w], mesh, rules, **kw)  # type: ignore[arg-type]
    assert w.storage.pinned is None and w.sharding == before


def test_indivisible_spec_names_the_parameter() -> None:
    devs = jax.devices()
    if len(devs) < 2:
        mesh = Mesh(np.array(devs * 1).reshape(1, 1), ("data", "model"))
        w = tfl.Param(jnp.ones((3, 5), jnp.float32), name="w")
        tfl.shard([w], mesh, [(r"w", PartitionSpec("data", "model"))])  # size 1 divides everything
        assert w.sharding.spec == PartitionSpec("data", "model")
        return
    mesh = Mesh(np.array(devs[:2]), ("data",))
    w = tfl.Param(jnp.ones((3, 5), jnp.float32), name="w")
    with pytest.raises(ValueError, match=re.escape("cuts dimension 0 of 'w' float32[3, 5] into 2 parts")):
        tfl.shard([w], mesh, [(r"w", PartitionSpec("data"))])


def test_placement_picture_names_tied_storages_once() -> None:
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    emb = tfl.nn.Embedding(8, 4, key=jax.random.key(0))
    out = emb.tied_output()
    tfl.shard({"emb": emb.weight, "out": out.weight}, mesh)
    dot = tfl.placement_dot({"emb": emb.weight, "out": out.weight})
    assert dot.count("emb = out") == 1 and "P('data')" in dot and "128 B" in dot
