"""Time to the first training step, in fresh processes: tapeflow (eager, lazy, ``train_step``) against a
hand-written ``jax.jit`` + optax step and PyTorch eager, every system in the same run.

A training script pays for its first step before it pays for any other: the model is built, the
optimizer created, and every program of the step traced and compiled. Each measurement here runs in
a new Python process (a child of this script, ``--child``), so nothing compiled by an earlier
measurement is in memory. The children run one after another, each pinned to the same one CPU
(``_timing.pin_to_one_core``) with XLA single-threaded and PyTorch at one thread. Systems (variants):

* ``jax_jit`` (the baseline of every ratio): params as a pytree, ``jax.value_and_grad``, optax.adam,
  ``optax.apply_updates``, one ``jax.jit``. tapeflow is not imported and ``TAPEFLOW_CACHE_DIR=""``,
  so JAX's persistent compilation cache is off: what a plain JAX user gets;
* ``pytorch``: PyTorch eager + ``torch.optim.Adam`` (skipped when torch is not importable);
* ``eager``: ``with s: loss = loss_fn(s, x, y); opt.step(s.backward(loss)); float(loss)`` on a
  ``tfl.Session()``;
* ``lazy``: the same loop on a ``tfl.Session(lazy=True)``;
* ``train_step``: ``step = tfl.train_step(loss_fn, opt); float(step(x, y))``;
* ``lazy+tiered``, ``train_step+tiered``: the same with tiered compilation on (``TAPEFLOW_TIERED=1``:
  each new program runs an XLA level-0 build first while the optimized one compiles on a thread).

tapeflow variants use tapeflow's default persistent compilation cache, pointed by
``TAPEFLOW_CACHE_DIR`` at a folder this script controls. Models (Adam, lr 1e-3, float32, random
data and labels):

1. MLP 784-256-256-10, batch 64, cross-entropy (``tfl.nn.MLP`` / ``nn.Sequential`` / by hand);
2. a tiny GPT: the char LM of ``examples/char_lm.py`` (tied embedding, 2 pre-norm blocks of width
   64, 4 heads, context 48, vocabulary 80, batch 32), imported from that file; ``jax_jit`` is a
   hand-written twin with the same initialization (its first loss equals tapeflow's). No PyTorch.

Measurements per (model, variant); times start just after the imports (jax, optax, tapeflow / torch)
and JAX's backend start (``jax.devices()``, reported apart), and end once the loss is on the host:

* ``first_step_cold``: model build + optimizer creation + the first step, in a fresh process; for
  tapeflow variants the cache folder is new and empty;
* ``second_process``: the same, in a second fresh process with the same cache folder (tapeflow's
  persistent cache is warm; for ``jax_jit`` and ``pytorch`` it is just another fresh process);
* ``new_shape``: in the cold process, after the first step and one more, the first step on a batch
  of 37 rows (the recompile for a new batch shape).

Each cold / second-process pair runs ``--repeats`` times (the variants interleaved, each pair in new
processes with a new cache folder); the minimum is kept.

Targets: first step cold ``train_step`` and ``lazy`` <= 0.7x ``jax_jit``, ``eager`` <= 1.0x; second
process <= 0.2x the variant's own cold first step (eager, lazy, train_step); new shape <= 0.7x
``jax_jit``'s recompile. Times are printed, never asserted.

Usage::

    python benchmarks/bench_first_step.py                 # full (3 repeats; several minutes)
    python benchmarks/bench_first_step.py --quick         # 1 repeat
    python benchmarks/bench_first_step.py --only mlp --json out/first_step.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
if hasattr(os, "sched_setaffinity"):  # one core before jax (imported by _timing) starts its threads
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

from _timing import Results, add_json_arg, fmt, load_example, pin_to_one_core, verdict

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
LR = 1e-3
NEW_BATCH = 37
MLP_SIZES = (784, 256, 256, 10)
LM = {"vocab": 80, "context": 48, "dim": 64, "heads": 4, "layers": 2, "batch": 32}
MODELS = {
    "mlp": ("MLP 784-256-256-10", 64),
    "gpt": ("tiny GPT (char LM 2x64, context 48, batch 32)", LM["batch"]),
}
VARIANTS = ("jax_jit", "pytorch", "eager", "lazy", "train_step", "lazy+tiered", "train_step+tiered")
TAPEFLOW = ("eager", "lazy", "train_step", "lazy+tiered", "train_step+tiered")
TIERED = "+tiered"  # the variant with tiered compilation on (TAPEFLOW_TIERED=1 in its processes)
BASELINE = "jax_jit"
TARGET_COLD = {"train_step": 0.7, "lazy": 0.7, "eager": 1.0, "lazy+tiered": 0.7, "train_step+tiered": 0.7}
TARGET_SECOND_VS_COLD = 0.2
TARGET_NEW_SHAPE = 0.7
SECTIONS = ("first_step_cold", "second_process", "new_shape")
COMPILE_EVENTS = {  # jax.monitoring duration events -> what CompileStats sums
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",  # persistent-cache reads included
}


# --------------------------------------------------------------------------- child: one measurement


class CompileStats:
    """JAX's compile events (``jax.monitoring``) since :meth:`reset`: traces, lowerings, backend compiles, cache hits."""

    def __init__(self) -> None:
        import jax.monitoring

        self.reset()
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)

    def reset(self) -> None:
        self.s = dict.fromkeys(COMPILE_EVENTS.values(), 0.0)
        self.n = dict.fromkeys(COMPILE_EVENTS.values(), 0)
        self.cache_hits = 0

    def _duration(self, event: str, secs: float, **_: Any) -> None:
        kind = COMPILE_EVENTS.get(event)
        if kind is not None:
            self.s[kind] += secs
            self.n[kind] += 1

    def _event(self, event: str, **_: Any) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.cache_hits += 1

    def snapshot(self) -> dict[str, Any]:
        return {
            "programs": self.n["compile"],
            "cache_hits": self.cache_hits,
            "trace_s": self.s["trace"],
            "lower_s": self.s["lower"],
            "compile_s": self.s["compile"],
        }


def _data(model: str, rows: int, seed: int) -> tuple[Any, Any]:
    import numpy as np

    r = np.random.default_rng(seed)
    if model == "mlp":
        x = r.standard_normal((rows, MLP_SIZES[0])).astype(np.float32)
        return x, r.integers(0, MLP_SIZES[-1], rows).astype(np.int32)
    shape = (rows, LM["context"])
    return r.integers(0, LM["vocab"], shape).astype(np.int32), r.integers(0, LM["vocab"], shape).astype(np.int32)


def _tapeflow_builder(variant: str, model: str) -> Callable[[], Callable[[Any, Any], float]]:
    """Imports tapeflow (and char_lm); returns the timed part: build the model, the optimizer and the step."""
    import jax
    import optax

    import tapeflow as tfl

    char_lm = load_example("char_lm") if model == "gpt" else None

    def build() -> Callable[[Any, Any], float]:
        if model == "mlp":
            mlp = tfl.nn.MLP(list(MLP_SIZES), key=jax.random.key(0))
            params: Any = mlp.parameters()

            def loss_fn(s: tfl.Session, x: Any, y: Any) -> tfl.Tensor:
                return tfl.cross_entropy(mlp(s.input(x)), s.input(y))

        else:
            lm = char_lm.CharLM(  # type: ignore[union-attr]
                LM["vocab"], LM["context"], LM["dim"], LM["heads"], LM["layers"], key=jax.random.key(0)
            )
            params = dict(lm.parameter_records())  # the tied output included: one slot for the shared storage

            def loss_fn(s: tfl.Session, x: Any, y: Any) -> tfl.Tensor:
                # the registry op takes the classes last: (batch, context, vocab) logits, as measured before
                return tfl.apply("cross_entropy", lm(x), s.input(y))

        opt = tfl.Optimizer(optax.adam(LR), params)
        if variant == "train_step":
            compiled = tfl.train_step(loss_fn, opt)
            return lambda x, y: float(compiled(x, y))
        session = tfl.Session(lazy=variant == "lazy")

        def step(x: Any, y: Any) -> float:
            with session as s:
                loss = loss_fn(s, x, y)
                opt.step(s.backward(loss))
                return float(loss)  # read inside the block: the handle goes stale at its end

        return step

    return build


def _jax_mlp_init(key: Any) -> Any:
    """``tfl.nn.MLP``'s initialization (the same keys and bounds), as a pytree."""
    import jax

    out = []
    for a, b, k in zip(MLP_SIZES[:-1], MLP_SIZES[1:], jax.random.split(key, len(MLP_SIZES) - 1)):
        out.append(_jax_linear(k, a, b))
    return out


def _jax_linear(key: Any, a: int, b: int) -> dict[str, Any]:
    """``tfl.nn.Linear``'s initialization: weight (a, b) and bias uniform in +-1/sqrt(a)."""
    import jax
    import jax.numpy as jnp

    kw, kb = jax.random.split(key)
    bound = 1.0 / math.sqrt(a)
    return {
        "w": jax.random.uniform(kw, (a, b), jnp.float32, -bound, bound),
        "b": jax.random.uniform(kb, (b,), jnp.float32, -bound, bound),
    }


def _jax_lm_init(key: Any) -> dict[str, Any]:
    """``char_lm.CharLM``'s initialization (the same keys, shapes and scales), as a pytree."""
    import jax
    import jax.numpy as jnp

    v, n, d = LM["vocab"], LM["context"], LM["dim"]
    ke, kp, kb = jax.random.split(key, 3)
    blocks = []
    for k in jax.random.split(kb, LM["layers"]):
        k1, k2 = jax.random.split(k)
        kq, kk, kv, ko = jax.random.split(k1, 4)
        km1, km2 = jax.random.split(k2, 2)
        blocks.append(
            {
                "ln1": {"w": jnp.ones(d), "b": jnp.zeros(d)},
                "q": _jax_linear(kq, d, d),
                "k": _jax_linear(kk, d, d),
                "v": _jax_linear(kv, d, d),
                "o": _jax_linear(ko, d, d),
                "ln2": {"w": jnp.ones(d), "b": jnp.zeros(d)},
                "fc1": _jax_linear(km1, d, 4 * d),
                "fc2": _jax_linear(km2, 4 * d, d),
            }
        )
    return {
        "embed": jax.random.normal(ke, (v, d), jnp.float32) * jnp.asarray(0.1, jnp.float32),
        "pos": 0.02 * jax.random.normal(kp, (n, d), jnp.float32),
        "blocks": blocks,
        "ln_f": {"w": jnp.ones(d), "b": jnp.zeros(d)},
    }


def _jax_lm_loss(p: dict[str, Any], ids: Any, targets: Any) -> Any:
    """The char LM's forward (pre-norm causal blocks, exact GELU, tied output) and mean cross-entropy."""
    import jax
    import jax.numpy as jnp
    import optax

    d, heads = LM["dim"], LM["heads"]
    hd = d // heads

    def ln(x: Any, q: dict[str, Any]) -> Any:
        # JAX's own standardization, as bench_depth's twin: written out as mean, then the mean square of
        # x - mean, XLA:CPU compiles the gradient far slower and runs it 2-4x slower (see bench_depth.jax_loss)
        return jax.nn.standardize(x, axis=-1, epsilon=1e-5) * q["w"] + q["b"]

    def lin(x: Any, q: dict[str, Any]) -> Any:
        return x @ q["w"] + q["b"]

    b, n = ids.shape
    x = p["embed"][ids] + p["pos"][:n]
    causal = jnp.arange(n)[None, :] <= jnp.arange(n)[:, None]
    for blk in p["blocks"]:
        h = ln(x, blk["ln1"])
        q, k, v = (lin(h, blk[name]).reshape(b, n, heads, hd).transpose(0, 2, 1, 3) for name in ("q", "k", "v"))
        att = jnp.where(causal, (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(hd), -jnp.inf)
        o = (jax.nn.softmax(att, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(b, n, d)
        x = x + lin(o, blk["o"])
        x = x + lin(jax.nn.gelu(lin(ln(x, blk["ln2"]), blk["fc1"]), approximate=False), blk["fc2"])
    logits = ln(x, p["ln_f"]) @ p["embed"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _jax_builder(model: str) -> Callable[[], Callable[[Any, Any], float]]:
    import jax
    import optax

    def mlp_loss(p: Any, x: Any, y: Any) -> Any:
        h = x
        for i, layer in enumerate(p):
            h = h @ layer["w"] + layer["b"]
            if i < len(p) - 1:
                h = jax.nn.relu(h)
        return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()

    def build() -> Callable[[Any, Any], float]:
        init, loss = (_jax_mlp_init, mlp_loss) if model == "mlp" else (_jax_lm_init, _jax_lm_loss)
        tx = optax.adam(LR)
        box = [init(jax.random.key(0))]
        box.append(tx.init(box[0]))

        @jax.jit
        def train(params: Any, state: Any, x: Any, y: Any) -> Any:
            l, g = jax.value_and_grad(loss)(params, x, y)
            updates, state = tx.update(g, state, params)
            return optax.apply_updates(params, updates), state, l

        def step(x: Any, y: Any) -> float:
            box[0], box[1], l = train(box[0], box[1], x, y)
            return float(l)

        return step

    return build


def _torch_builder(model: str) -> Callable[[], Callable[[Any, Any], float]]:
    import torch

    torch.set_num_threads(1)
    if model != "mlp":
        raise SystemExit("pytorch: only the MLP has a PyTorch twin here")

    def build() -> Callable[[Any, Any], float]:
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for i, (a, b) in enumerate(zip(MLP_SIZES[:-1], MLP_SIZES[1:])):
            layers += [torch.nn.Linear(a, b)] + ([torch.nn.ReLU()] if i < len(MLP_SIZES) - 2 else [])
        net = torch.nn.Sequential(*layers)
        opt = torch.optim.Adam(net.parameters(), lr=LR)

        def step(x: Any, y: Any) -> float:
            loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y).long())
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.item()

        return step

    return build


def child(variant: str, model: str) -> dict[str, Any]:
    """One fresh-process measurement; the caller prints it as one JSON line."""
    pin_to_one_core()
    t = time.perf_counter()
    import jax

    if variant == "jax_jit":
        build = _jax_builder(model)
    elif variant == "pytorch":
        build = _torch_builder(model)
    else:
        build = _tapeflow_builder(variant.removesuffix(TIERED), model)
    imports_s = time.perf_counter() - t
    t = time.perf_counter()
    jax.devices()  # JAX's backend starts (every JAX variant pays it once, before any program)
    backend_s = time.perf_counter() - t
    batch = MODELS[model][1]
    x, y = _data(model, batch, 0)
    x2, y2 = _data(model, batch, 1)
    x3, y3 = _data(model, NEW_BATCH, 2)
    stats = CompileStats()

    t0 = time.perf_counter()
    step = build()
    build_s = time.perf_counter() - t0
    build_stats = stats.snapshot()
    loss = step(x, y)
    first_s = time.perf_counter() - t0
    first_stats = stats.snapshot()

    stats.reset()
    t = time.perf_counter()
    step(x2, y2)
    second_step_s = time.perf_counter() - t
    second_stats = stats.snapshot()
    stats.reset()
    t = time.perf_counter()
    step(x3, y3)
    new_shape_s = time.perf_counter() - t
    new_stats = stats.snapshot()

    out: dict[str, Any] = {
        "variant": variant,
        "model": model,
        "first_s": first_s,
        "build_s": build_s,
        "second_step_s": second_step_s,
        "new_shape_s": new_shape_s,
        "imports_s": imports_s,
        "backend_s": backend_s,
        "loss": loss,
        "build_stats": build_stats,
        "first_stats": first_stats,
        "second_step_stats": second_stats,
        "new_shape_stats": new_stats,
        "jax_cache_dir": jax.config.values["jax_compilation_cache_dir"],
        "tapeflow_imported": "tapeflow" in sys.modules,
    }
    return out


# --------------------------------------------------------------------------- parent: spawn, collect, report


def run_child(variant: str, model: str, cache: str | None, timeout: float) -> dict[str, Any] | None:
    """One fresh process; its JSON line, or None (its stderr printed) when it failed."""
    env = dict(os.environ)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["TAPEFLOW_CACHE_DIR"] = cache if cache is not None else ""  # "": off (tapeflow is not even imported)
    env["TAPEFLOW_TIERED"] = "1" if variant.endswith(TIERED) else ""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", variant, "--model", model]
    try:
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        print(f"  ! {variant} / {model}: no result after {timeout:.0f} s", file=sys.stderr)
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        print(_tail(err), file=sys.stderr)
        return None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(f"  ! {variant} / {model}: the child failed (exit {proc.returncode}); its stderr:", file=sys.stderr)
        print(_tail(proc.stderr or proc.stdout), file=sys.stderr)
        return None
    got: dict[str, Any] = json.loads(lines[-1])
    if cache is None and (got["jax_cache_dir"] or got["tapeflow_imported"]):
        print(f"  ! {variant} / {model}: a persistent cache was on in the baseline process: {got}", file=sys.stderr)
        return None
    return got


def _tail(text: str, n: int = 40) -> str:
    lines = text.rstrip().splitlines()
    return "\n".join(("    " + line) for line in lines[-n:]) or "    (nothing)"


def _ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b else float("nan")


def _check(r: float, target: float) -> str:
    """The verdict of ratio ``r`` against ``target`` (``n/a`` when a time it needs is missing)."""
    return verdict(r <= target) if r == r else "n/a (a time is missing)"


def _x(r: float) -> str:
    return f"{r:6.2f}x" if r == r else f"{'-':>7s}"


def _t(t: float | None) -> str:
    return fmt(t) if t is not None else f"{'-':>11s}"


def measure(
    models: list[str], variants: list[str], repeats: int, cache_root: Path, timeout: float
) -> dict[tuple[str, str], dict[str, Any]]:
    """Best (minimum) over ``repeats`` of each cell; the children of one repeat interleave the variants."""
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for rep in range(repeats):
        for model in models:
            for variant in variants:
                cache = None
                if variant in TAPEFLOW:
                    cache = tempfile.mkdtemp(prefix=f"{model}-{variant}-{rep}-", dir=cache_root)
                t = time.perf_counter()
                cold = run_child(variant, model, cache, timeout)
                second = run_child(variant, model, cache, timeout) if cold is not None else None
                cell = best.setdefault((model, variant), {})
                if cold is not None:
                    if "cold" not in cell or cold["first_s"] < cell["cold"]["first_s"]:
                        cell["cold"] = cold
                    if "new" not in cell or cold["new_shape_s"] < cell["new"]["new_shape_s"]:
                        cell["new"] = cold
                if second is not None and ("second" not in cell or second["first_s"] < cell["second"]["first_s"]):
                    cell["second"] = second
                files = sum(1 for p in Path(cache).rglob("*") if p.is_file()) if cache else 0
                print(
                    f"  repeat {rep + 1}/{repeats}  {model:3s} {variant:17s}  cold {_t(cold and cold['first_s'])}"
                    f"  second {_t(second and second['first_s'])}"
                    + (f"  ({files} files in the cache)" if cache else "")
                    + f"  [{time.perf_counter() - t:.1f} s]",
                    flush=True,
                )
    return best


def report(best: dict[tuple[str, str], dict[str, Any]], models: list[str], variants: list[str], res: Results) -> None:
    for model in models:
        name, batch = MODELS[model]
        cells = {v: best.get((model, v), {}) for v in variants}
        cold = {v: c["cold"]["first_s"] for v, c in cells.items() if "cold" in c}
        second = {v: c["second"]["first_s"] for v, c in cells.items() if "second" in c}
        new = {v: c["new"]["new_shape_s"] for v, c in cells.items() if "new" in c}
        steady = {v: c["cold"]["second_step_s"] for v, c in cells.items() if "cold" in c}
        loss = {v: c["cold"]["loss"] for v, c in cells.items() if "cold" in c}
        base_cold, base_second, base_new = cold.get(BASELINE), second.get(BASELINE), new.get(BASELINE)
        print(f"\n{name}: batch {batch}, new shape batch {NEW_BATCH}; ratios to {BASELINE} of the same column")
        print(
            f"  {'variant':17s} {'cold 1st step':>13s} {'/jit':>7s} {'2nd process':>12s} {'/jit':>7s} {'/cold':>7s}"
            f" {'new shape':>12s} {'/jit':>7s} {'next step':>12s}  first loss"
        )
        for v in variants:
            if not cells[v]:
                print(f"  {v:17s} {'(no result)':>13s}")
                continue
            print(
                f"  {v:17s}  {_t(cold.get(v))} {_x(_ratio(cold.get(v), base_cold))}  {_t(second.get(v))}"
                f" {_x(_ratio(second.get(v), base_second))} {_x(_ratio(second.get(v), cold.get(v)))}"
                f"  {_t(new.get(v))} {_x(_ratio(new.get(v), base_new))}  {_t(steady.get(v))}"
                f"  {loss.get(v, float('nan')):.5f}"
            )
        for section, times in zip(SECTIONS, (cold, second, new)):
            for v, t in times.items():
                extra: dict[str, Any] = {}
                if v != BASELINE and v in TAPEFLOW:
                    if section == "first_step_cold":
                        extra["target"] = f"<= {TARGET_COLD[v]}x {BASELINE}"
                    elif section == "second_process":
                        extra["target"] = f"<= {TARGET_SECOND_VS_COLD}x own first_step_cold"
                    else:
                        extra["target"] = f"<= {TARGET_NEW_SHAPE}x {BASELINE}"
                if section == "second_process" and v in cold:
                    extra["ratio_to_cold"] = round(t / cold[v], 4)
                baseline = None if v == BASELINE else BASELINE
                base = times.get(BASELINE)
                if baseline is not None and base and t / base < 0.05:
                    # Results rounds a ratio to 4 decimals: below 0.05 that is off by more than the 0.1 % the
                    # schema check allows (PyTorch's new shape compiles nothing); keep the ratio in its own key
                    baseline, extra[f"ratio_to_{BASELINE}"] = None, float(f"{t / base:.4g}")
                res.add(section, name, v, t, baseline=baseline, **extra)

        print("  targets:")
        for v in TAPEFLOW:
            if v not in cells or not cells[v]:
                continue
            r_cold, r_sec, r_new = (
                _ratio(cold.get(v), base_cold),
                _ratio(second.get(v), cold.get(v)),
                _ratio(new.get(v), base_new),
            )
            print(
                f"    {v:17s} cold {r_cold:5.2f}x jit (<= {TARGET_COLD[v]}x): {_check(r_cold, TARGET_COLD[v])};"
                f"  second process {r_sec:5.2f}x own cold (<= {TARGET_SECOND_VS_COLD}x):"
                f" {_check(r_sec, TARGET_SECOND_VS_COLD)};"
                f"  new shape {r_new:5.2f}x jit (<= {TARGET_NEW_SHAPE}x): {_check(r_new, TARGET_NEW_SHAPE)}"
            )
        print(
            "  where the time goes: rows cold / second (process) / next (the cold process's second step, same"
            " shapes) / new (its batch-37 step);\n  build = model + optimizer, then the step; progs = XLA compiles"
            " (persistent-cache reads included), hits = read from the cache;\n  trace, lower, compile and rest"
            " (Python, running) cover build + step together (JAX times its events by the wall clock)"
        )
        print(
            f"  {'variant':17s} {'run':6s} {'build':>11s} {'progs':>5s} {'step':>11s} {'progs':>5s} {'hits':>5s}"
            f" {'trace':>11s} {'lower':>11s} {'compile':>11s} {'rest':>11s}   imports, backend start (not timed)"
        )
        for v in variants:
            for run in ("cold", "second", "next", "new"):
                c = cells[v].get("cold" if run == "next" else run)
                if c is None:
                    continue
                if run == "next":  # the cold process's second step (same shapes)
                    st, total, build, n_build = c["second_step_stats"], c["second_step_s"], None, 0
                elif run == "new":
                    st, total, build, n_build = c["new_shape_stats"], c["new_shape_s"], None, 0
                else:
                    st, total, build = c["first_stats"], c["first_s"], c["build_s"]
                    n_build = c["build_stats"]["programs"]
                rest = total - st["trace_s"] - st["lower_s"] - st["compile_s"]
                print(
                    f"  {v:17s} {run:6s} {_t(build)} {n_build if build is not None else '':>5} {_t(total - (build or 0))}"
                    f" {st['programs'] - n_build:5d} {st['cache_hits']:5d} {_t(st['trace_s'])} {_t(st['lower_s'])}"
                    f" {_t(st['compile_s'])} {_t(rest) if rest >= 0 else '   (clock?)'}"
                    + (f"   {c['imports_s']:.2f} s, {c['backend_s']:.2f} s" if build is not None else "")
                )


def main(argv: list[str] | None = None) -> Results | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one repeat")
    ap.add_argument("--repeats", type=int, default=None, help="fresh-process pairs per cell (default 3, --quick 1)")
    ap.add_argument("--only", choices=sorted(MODELS), default=None, help="one model")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a child may run (default 600)")
    ap.add_argument("--child", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", choices=sorted(MODELS), default="mlp", help=argparse.SUPPRESS)
    add_json_arg(ap)
    args = ap.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args.model)), flush=True)
        return None

    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # progress and the children's stderr interleave
    repeats = args.repeats or (1 if args.quick else 3)
    models = [args.only] if args.only else list(MODELS)
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; choose from {','.join(VARIANTS)}")
    if "pytorch" in variants and importlib.util.find_spec("torch") is None:
        print("pytorch: skipped (torch is not importable)")
        variants.remove("pytorch")
    res = Results("bench_first_step", quick=args.quick)
    import jax

    print(
        f"jax {jax.__version__}; fresh processes pinned to one core, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; "
        f"{repeats} repeat(s), minimum kept"
    )
    cache_root = Path(tempfile.mkdtemp(prefix="tapeflow-first-step-"))
    try:
        best: dict[tuple[str, str], dict[str, Any]] = {}
        for model in models:  # PyTorch has no tiny GPT twin here
            vs = [v for v in variants if model == "mlp" or v != "pytorch"]
            best.update(measure([model], vs, repeats, cache_root, args.timeout))
        for model in models:
            report(best, [model], [v for v in variants if model == "mlp" or v != "pytorch"], res)
    finally:
        shutil.rmtree(cache_root, ignore_errors=True)
    if res.records():
        res.write(args.json)
    elif args.json:
        print("no results: nothing written", file=sys.stderr)
    return res


if __name__ == "__main__":
    main()
