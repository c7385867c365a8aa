"""Compile once per structure, per process, and every compile explained (tfl.compile_log).

Counts come from :func:`tfl.compile_log`, which listens to JAX's own compile
reports: a record per XLA compile (or persistent-cache read), of any function.
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tapeflow as tfl
from tapeflow._core._fnkey import structural_key

F32 = jnp.float32
X = jnp.asarray(np.random.default_rng(0).normal(size=(6, 5)), F32)
Y = jnp.array([0, 1, 2, 0, 1, 2])


def model(seed: int = 0) -> tfl.nn.MLP:
    return tfl.nn.MLP([5, 7, 3], key=jax.random.key(seed))


def loss_of(m):
    return lambda s, x, y: tfl.cross_entropy(m(x), y)


def eager_step(m, opt, x=X, y=Y, lazy=False):
    with tfl.Session(lazy=lazy) as s:
        loss = tfl.cross_entropy(m(s.input(x)), y)
        opt.step(s.backward(loss))
        return float(loss)


def values(m):
    return [np.asarray(p.value) for _, p in m.named_parameters()]


# --------------------------------------------------------------------------- the structural key of a transformation


def test_structural_key_of_equal_transformations_is_equal():
    assert structural_key(optax.adam(1e-3)) == structural_key(optax.adam(1e-3))
    assert hash(structural_key(optax.adam(1e-3))) == hash(structural_key(optax.adam(1e-3)))
    chain = lambda lr: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, weight_decay=0.1))  # noqa: E731
    assert structural_key(chain(1e-3)) == structural_key(chain(1e-3))
    sched = lambda: optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100)  # noqa: E731
    assert structural_key(optax.adam(sched())) == structural_key(optax.adam(sched()))


@pytest.mark.parametrize(
    "a, b",
    [
        (lambda: optax.adam(1e-3), lambda: optax.adam(2e-3)),  # a hyperparameter
        (lambda: optax.adam(1e-3), lambda: optax.sgd(1e-3)),  # another transformation
        (lambda: optax.adam(1e-3), lambda: optax.adam(1e-3, b1=0.8)),
        (
            lambda: optax.adamw(1e-3, mask={"w": True, "b": False}),
            lambda: optax.adamw(1e-3, mask={"w": False, "b": True}),
        ),
        (
            lambda: optax.adam(optax.linear_schedule(1.0, 0.0, 10)),
            lambda: optax.adam(optax.linear_schedule(1.0, 0.0, 20)),
        ),
        (lambda: optax.adam(1e-3), lambda: optax.adam(jnp.float32(1e-3) * 2)),
    ],
)
def test_structural_key_tells_different_transformations_apart(a, b):
    assert structural_key(a()) != structural_key(b())


def test_structural_key_compares_unknown_objects_by_identity_and_keeps_them():
    class Rate:
        def __call__(self, count):
            return 1e-3

    r = Rate()
    assert structural_key(optax.adam(r)) == structural_key(optax.adam(r))
    assert structural_key(optax.adam(Rate())) != structural_key(optax.adam(Rate()))
    big = np.ones(10_000, np.float32)  # past MAX_ARRAY_SIZE: by identity
    assert structural_key(optax.scale(big)) == structural_key(optax.scale(big))
    assert structural_key(optax.scale(big)) != structural_key(optax.scale(big.copy()))


def test_structural_key_of_a_recursive_closure_terminates():
    def make():
        def f(n):
            return 0 if n == 0 else f(n - 1)

        return optax.GradientTransformation(
            lambda p: (), lambda u, s, p=None: (jax.tree.map(lambda g: g * (1 + f(2)), u), s)
        )

    assert structural_key(make()) == structural_key(make())


RATE = 0.1  # read by rate_from_global: a module global a schedule reads


class RateConfig:
    rate = 0.1  # read by rate_from_class: a class attribute a schedule reads


def rate_from_global(count):
    return RATE


def rate_from_class(count):
    return RateConfig.rate


def _step_with(sched, path):
    """One SGD step of sum(w) from w = 1 through ``path`` with a new Param and a new Optimizer: w's new value."""
    w = tfl.Param(jnp.ones(3, F32))
    opt = tfl.Optimizer(optax.sgd(sched), [w])
    if path == "train_step":
        tfl.train_step(lambda s: tfl.sum(w * 1.0), opt)()
    else:
        with tfl.Session(lazy=path == "lazy") as s:
            opt.step(s.backward(tfl.sum(w * 1.0)))
    return float(w.value[0])


@pytest.mark.parametrize("path", ["eager", "lazy", "train_step"])
def test_a_new_optimizer_reads_the_current_value_of_a_global_its_schedule_reads(path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "RATE", 0.1)
    monkeypatch.setattr(RateConfig, "rate", 0.1)
    for sched, change in [
        (rate_from_global, lambda v: monkeypatch.setattr(sys.modules[__name__], "RATE", v)),
        (rate_from_class, lambda v: monkeypatch.setattr(RateConfig, "rate", v)),
    ]:
        assert _step_with(sched, path) == pytest.approx(0.9)
        change(0.5)
        assert _step_with(sched, path) == pytest.approx(0.5)  # a compiled update made with 0.1 is not reused
        change(0.1)
        assert _step_with(sched, path) == pytest.approx(0.9)


def test_structural_key_reads_globals_class_attributes_and_nested_functions(monkeypatch):
    key = lambda: structural_key(optax.sgd(rate_from_global))  # noqa: E731
    first = key()
    assert key() == first
    monkeypatch.setattr(sys.modules[__name__], "RATE", 0.25)
    assert key() != first

    def nested(count):
        return rate_from_class(count) * 2  # a global function it calls reads a class attribute

    first = structural_key(optax.sgd(nested))
    monkeypatch.setattr(RateConfig, "rate", 0.3)
    assert structural_key(optax.sgd(nested)) != first


def test_a_lifted_function_that_reads_a_changed_global_is_a_different_function():
    from tapeflow._core._fnkey import same_function

    def scaled(x):
        return x * RATE

    ns = {"RATE": 2.0}
    again = type(scaled)(scaled.__code__, ns, "scaled")  # the same cell, run again in its module
    assert same_function(scaled, scaled)
    assert same_function(type(scaled)(scaled.__code__, dict(ns), "scaled"), again)
    other = dict(ns, RATE=3.0)
    assert not same_function(type(scaled)(scaled.__code__, other, "scaled"), again)
    from tapeflow._core import _registry as R

    tfl.lift(again, name="test_compile_counts_global")
    try:
        tfl.lift(again, name="test_compile_counts_global")  # the very same function: registered again
        with pytest.raises(tfl.TapeError, match="different function"):
            tfl.lift(type(scaled)(scaled.__code__, other, "scaled"), name="test_compile_counts_global")
    finally:
        R.unregister("test_compile_counts_global")


# --------------------------------------------------------------------------- compile once per structure


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_a_new_optimizer_over_a_restored_model_compiles_nothing(lazy):
    a = model()
    opt_a = tfl.Optimizer(optax.adam(1e-2), a)
    for _ in range(2):
        eager_step(a, opt_a, lazy=lazy)
    b = model(seed=1)
    tfl.nn.load_state_dict(b, tfl.nn.state_dict(a))  # a fresh model with a's weights, as after a restore
    with tfl.compile_log(file=None) as log:
        opt_b = tfl.Optimizer(optax.adam(1e-2), b)  # a fresh transformation too: same structure
        fresh = jax.tree_util.tree_leaves(opt_b.state)
        opt_b.state = opt_a.state
        la, lb = eager_step(a, opt_a, lazy=lazy), eager_step(b, opt_b, lazy=lazy)
    assert log.records == [], [str(r) for r in log.records]
    assert la == lb
    assert all(not np.asarray(x).any() for x in fresh)  # the compiled init: Adam's zeros and count
    for va, vb in zip(values(a), values(b)):
        np.testing.assert_array_equal(va, vb)  # the shared program computes b's step from b's values


def test_a_shared_step_program_matches_plain_optax():
    first = model()
    opt_first = tfl.Optimizer(optax.adam(1e-2), first)
    eager_step(first, opt_first)  # compiles the update this structure shares
    m = model()
    opt = tfl.Optimizer(optax.adam(1e-2), m)
    params = {n: p.value for n, p in m.named_parameters()}
    tx = optax.adam(1e-2)
    state = tx.init(params)

    def pure_loss(params):
        h = jnp.maximum(X @ params["layers.0.weight"].T + params["layers.0.bias"], 0.0)  # (out, in) weights
        logits = h @ params["layers.1.weight"].T + params["layers.1.bias"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), Y[:, None], axis=1))

    names = [n for n, _ in m.named_parameters()]
    assert names == ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"]
    for _ in range(3):
        eager_step(m, opt)
        g = jax.grad(pure_loss)(params)
        upd, state = tx.update(g, state, params)
        params = optax.apply_updates(params, upd)
    for n, v in zip(names, values(m)):
        np.testing.assert_allclose(v, np.asarray(params[n]), rtol=2e-5, atol=1e-6)


def test_a_retrace_after_the_first_optimizer_died_uses_the_live_one():
    w1, v1 = tfl.Param(jnp.ones(3, F32), name="w"), tfl.Param(jnp.ones(2, F32), name="v")
    opt1 = tfl.Optimizer(optax.sgd(0.5), {"w": w1, "v": v1})
    with tfl.Session() as s:
        opt1.step(s.backward(tfl.sum(w1 * w1) + tfl.sum(v1)))  # both slots used
    del opt1
    gc.collect()
    w2, v2 = tfl.Param(jnp.ones(3, F32), name="w"), tfl.Param(jnp.ones(2, F32), name="v")
    opt2 = tfl.Optimizer(optax.sgd(0.5), {"w": w2, "v": v2})
    with tfl.Session() as s:
        opt2.step(s.backward(tfl.sum(w2 * w2)))  # only w: a new parts structure, traced with opt2's rule
    np.testing.assert_allclose(np.asarray(w2.value), [0.0, 0.0, 0.0])
    np.testing.assert_allclose(np.asarray(v2.value), [1.0, 1.0])


def test_a_different_hyperparameter_compiles_its_own_update():
    m = model()
    eager_step(m, tfl.Optimizer(optax.adam(1e-2), m))
    before = values(m)
    with tfl.compile_log(file=None) as log:
        eager_step(m, tfl.Optimizer(optax.adam(0.25), m))
    what = [r.what for r in log.tapeflow_records()]
    assert len(what) == 2 and what[0] == "optimizer state init (4 slots)", what
    assert what[1].startswith("lazy step program"), what  # the eager backward fused with the new update
    # another optimizer's step program is a first compile of its own (nothing was dropped)
    assert [r.why for r in log.tapeflow_records()] == ["first time", "first time"]
    moved = [np.abs(a - b).max() for a, b in zip(values(m), before)]
    assert max(moved) > 0.2  # Adam's first step moves each weight by about the learning rate: 0.25, not 0.01


@pytest.mark.skipif(not tfl.cache_dir(), reason="needs the persistent compilation cache (TAPEFLOW_CACHE_DIR)")
def test_a_second_train_step_of_one_structure_reads_its_program_from_the_cache():
    a = model()
    opt_a = tfl.Optimizer(optax.adam(1e-2), a)
    tfl.train_step(loss_of(a), opt_a)(X, Y)
    b = model(seed=1)
    tfl.nn.load_state_dict(b, tfl.nn.state_dict(a))
    with tfl.compile_log(file=None) as log:
        tfl.train_step(loss_of(b), tfl.Optimizer(optax.adam(1e-2), b))(X, Y)
    recs = log.tapeflow_records()
    assert [r.what.split()[0] for r in recs] == ["train_step"]
    assert recs[0].cached, str(recs[0])  # traced again (a new loss function), but no XLA compile
    # this process's first compile of it, read from the cache: the line does not say "first time" alone
    assert str(recs[0]).startswith("tapeflow: read train_step ") and " from the compilation cache in " in str(recs[0])
    assert str(recs[0]).endswith(": first time in this process"), str(recs[0])


def test_a_record_read_from_the_cache_is_not_called_compiled_for_the_first_time():
    rec = tfl.CompileRecord("train_step f", "first time", 0.25, True, 1)
    assert str(rec) == "tapeflow: read train_step f from the compilation cache in 0.250 s: first time in this process"
    assert str(rec._replace(cached=False)) == "tapeflow: compiled train_step f in 0.250 s: first time"


# --------------------------------------------------------------------------- every compile explained


def test_compile_log_says_what_compiled_and_which_argument_changed():
    m = model()
    step = tfl.train_step(loss_of(m), tfl.Optimizer(optax.sgd(0.1), m))
    with tfl.compile_log(file=None) as log:
        step(X, Y)
        step(X, Y)  # cached: no record
        step(X[:4], Y[:4])
    recs = log.tapeflow_records()
    assert [r.what for r in recs] == ["train_step loss_of.<locals>.<lambda>"] * 2
    assert recs[0].why == "first time" and recs[0].times == 1
    assert recs[1].why == "new shape of argument 0: (6, 5) -> (4, 5); new shape of argument 1: (6,) -> (4,)"
    assert recs[1].times == 2 and recs[1].seconds > 0
    assert "train_step loss_of.<locals>.<lambda> in " in str(recs[1]) and "(6, 5) -> (4, 5)" in str(recs[1])


def test_compile_log_explains_lazy_programs_and_op_kernels():
    m = model()
    opt = tfl.Optimizer(optax.sgd(0.1), m)
    x = jnp.ones((11, 5), F32)  # a batch size no other test uses
    with tfl.compile_log(file=None) as log:
        eager_step(m, opt, x, jnp.zeros(11, jnp.int32), lazy=True)
        eager_step(m, opt, x[:9], jnp.zeros(9, jnp.int32), lazy=True)
    lazy = [r for r in log.tapeflow_records() if r.what.startswith("lazy step program")]
    assert len(lazy) == 2
    assert lazy[1].why.startswith("new shape of input node 0: (11, 5) -> (9, 5)")
    tfl.clear_kernel_caches()
    with tfl.compile_log(file=None) as log:
        tfl.Session(lazy=False).input(jnp.ones((13, 3), F32)) * 2.0  # an eager op compiles its kernel
    ops = [r for r in log.tapeflow_records() if r.what == "op kernel mul"]
    assert len(ops) == 1, [str(r) for r in log.records]
    assert ops[0].why == "first time" or "-> (13, 3)" in ops[0].why, ops[0].why  # vs an earlier mul of (k, 3)


def test_a_dropped_program_compiling_again_says_so():
    m = model()
    step = tfl.train_step(loss_of(m), tfl.Optimizer(optax.sgd(0.1), m))
    step(X, Y)
    jax.clear_caches()
    with tfl.compile_log(file=None) as log:
        step(X, Y)
    (rec,) = [r for r in log.tapeflow_records() if r.what.startswith("train_step")]
    assert rec.why.startswith("the same signature again")


@contextlib.contextmanager
def recompile_warnings(bound):
    """The RecompileWarnings of the block (a list, filled when it ends), with the warning bound set to ``bound``."""
    old = tfl.set_recompile_warning(bound)
    found = []
    try:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            yield found
        found += [w for w in got if issubclass(w.category, tfl.RecompileWarning)]
    finally:
        tfl.set_recompile_warning(old)


def test_recompiling_past_the_bound_warns_once_naming_the_argument_and_the_fix():
    m = model()
    step = tfl.train_step(loss_of(m), tfl.Optimizer(optax.sgd(0.1), m))
    with recompile_warnings(2) as rec:
        for n in (6, 5, 4, 3, 2):
            step(X[:n], Y[:n])
    assert len(rec) == 1, [str(w.message) for w in rec]
    msg = str(rec[0].message)
    assert "compiled for 3 different signatures" in msg and "argument 0: (5, 5) -> (4, 5)" in msg
    assert "pad the last batch" in msg and "drop_last" in msg
    assert rec[0].filename == __file__  # points at the line that compiled
    step2 = tfl.train_step(loss_of(m), tfl.Optimizer(optax.sgd(0.1), m))
    with recompile_warnings(None) as rec:
        for n in (6, 5, 4, 3, 2):
            step2(X[:n], Y[:n])
    assert rec == []


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_set_recompile_warning_rejects_bad_bounds(bad):
    with pytest.raises(ValueError, match="set_recompile_warning: expected a positive int or None"):
        tfl.set_recompile_warning(bad)


def test_explain_compiles_environment_variable_prints_each_compile():
    code = (
        "import jax.numpy as jnp, optax, tapeflow as tfl\n"
        "w = tfl.Param(jnp.ones(3))\n"
        "step = tfl.train_step(lambda s, x: tfl.sum(w * x), tfl.Optimizer(optax.sgd(0.1), [w]))\n"
        "step(jnp.ones(3)); step(jnp.ones(3))\n"
    )
    env = {**os.environ, "TAPEFLOW_EXPLAIN_COMPILES": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if "train_step <lambda>" in ln]
    assert len(lines) == 1 and lines[0].startswith("tapeflow: ") and lines[0].endswith(": first time"), out.stderr


def test_on_start_and_on_end_bracket_each_compile():
    events = []
    m = model()
    step = tfl.train_step(loss_of(m), tfl.Optimizer(optax.sgd(0.1), m))
    with tfl.compile_log(
        file=None, on_start=lambda what: events.append(("start", what)), on_end=lambda r: events.append(("end", r.what))
    ):
        step(X[:5], Y[:5])
    mine = [e for e in events if e[1].startswith("train_step")]
    assert mine == [("start", "train_step loss_of.<locals>.<lambda>"), ("end", "train_step loss_of.<locals>.<lambda>")]
    assert events.index(mine[0]) < events.index(mine[1])


def test_numpy_inputs_of_new_shapes_compile_nothing_to_enter_a_session():
    s = tfl.Session()
    s.input(np.ones((2, 3), np.float32))
    with tfl.compile_log(file=None) as log:
        xs = [s.input(np.full((n, 3), float(n))) for n in (3, 4, 5)]  # float64 NumPy data: JAX's dtype, copied
        p = tfl.Param(np.zeros((7, 2), np.float32))
    assert log.records == [], [str(r) for r in log.records]
    for n, x in zip((3, 4, 5), xs):
        assert x.value.dtype == jnp.result_type(np.float64) and np.asarray(x.value).tolist() == [[n] * 3] * n
    for n in (500, 1000, 5000, 20000):  # device_put reads its source after it returns: sizes that raced
        held = []
        for _ in range(20):
            host = np.ones(n, np.float32)
            held.append(s.input(host))
            host[:] = 5.0  # the buffer reused at once, as a data loader does: the session holds a copy
        assert all(float(x.value[-1]) == 1.0 for x in held)
    assert p.value.shape == (7, 2)


def test_compiling_one_signature_again_and_again_does_not_warn():
    m = model()
    step = tfl.train_step(loss_of(m), tfl.Optimizer(optax.sgd(0.1), m))
    with recompile_warnings(2) as rec:
        for _ in range(4):
            jax.clear_caches()  # the program is dropped: the next call compiles the same signature again
            step(X, Y)
    assert rec == []


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_an_optimizer_update_recompiled_for_a_new_state_type_says_which_leaf(lazy):
    w = tfl.Param(jnp.ones(3), name="w")
    opt = tfl.Optimizer(optax.inject_hyperparams(optax.sgd)(learning_rate=0.5), [w])
    with tfl.compile_log(file=None) as log:
        for lr in (None, 0.25):
            if lr is not None:
                opt.state.hyperparams["learning_rate"] = lr  # by hand, a Python float: a weakly typed leaf
            # eager and lazy: the update is part of the step program the backward fuses with
            with tfl.Session(lazy=lazy) as s:
                opt.step(s.backward(tfl.sum(w * w)))
    program = "lazy step program"
    whys = [r.why for r in log.records if r.what.startswith(program)]
    assert whys[-1] == "new weak type of optimizer state leaf 1: False -> True", whys


@pytest.mark.parametrize("lazy", [False, True])
def test_other_optimizers_on_one_structure_are_no_recompile_for_new_shapes(lazy):
    """Each optimizer's step program is its own (counted per update rule): three optimizers stepping one model's
    recording are three first compiles, not one program recompiled for three signatures."""
    # in a fresh process: the warning counts signatures per process, and other tests compile these kernels too
    code = (
        "import sys, optax; sys.path.insert(0, 'tests'); import tapeflow as tfl; import test_compile_counts as t\n"
        "m = t.model()\n"
        "with t.recompile_warnings(1) as found:\n"
        "    for tx in (optax.sgd(0.1), optax.adam(1e-3), optax.sgd(0.1, momentum=0.9)):\n"
        f"        t.eager_step(m, tfl.Optimizer(tx, m), lazy={lazy})\n"
        "print([str(w.message) for w in found])\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout
