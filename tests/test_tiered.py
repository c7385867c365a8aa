"""Tiered compilation (tfl.set_tiered_compilation): a level-0 build at once, the optimized one from a thread."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tapeflow as tfl
from tapeflow._core._tiered import Tiered

F32 = jnp.float32


@pytest.fixture
def tiered():
    before = tfl.set_tiered_compilation(True)
    yield
    tfl.set_tiered_compilation(before)


def _f(x, w, scale):
    return jnp.tanh(x @ w) * scale + jnp.sum(x * x, axis=1, keepdims=True)


def test_each_signature_runs_level_0_then_the_optimized_build():
    jitted = jax.jit(_f, static_argnums=2)
    t = Tiered(jitted, (2,))
    rng = np.random.default_rng(0)
    x, w = jnp.asarray(rng.normal(size=(8, 5)), F32), jnp.asarray(rng.normal(size=(5, 3)), F32)
    first = t(x, w, 2.0)
    np.testing.assert_allclose(first, jitted(x, w, 2.0), rtol=1e-5, atol=1e-6)  # level 0: float32 rounding
    t.wait()
    assert t.optimized()
    np.testing.assert_array_equal(t(x, w, 2.0), jitted(x, w, 2.0))  # the optimized build: the jitted bits
    x2 = x[:3]
    np.testing.assert_allclose(t(x2, w, 2.0), jitted(x2, w, 2.0), rtol=1e-5, atol=1e-6)  # a new shape: tiered
    np.testing.assert_allclose(t(x, w, 3.0), jitted(x, w, 3.0), rtol=1e-5, atol=1e-6)  # a new static value
    t.wait()
    for args in [(x, w, 2.0), (x2, w, 2.0), (x, w, 3.0)]:
        np.testing.assert_array_equal(t(*args), jitted(*args))


def _mlp():
    return tfl.nn.MLP([5, 8, 3], key=jax.random.key(0))


X = jnp.asarray(np.random.default_rng(1).normal(size=(6, 5)), F32)
Y = jnp.array([0, 1, 2, 0, 1, 2])


def _lazy_losses(n):
    m = _mlp()
    opt = tfl.Optimizer(optax.adam(1e-2), m)
    out = []
    for _ in range(n):
        with tfl.Session(lazy=True) as s:
            loss = tfl.cross_entropy(m(s.input(X)), Y)
            opt.step(s.backward(loss))
            out.append(float(loss))
    return out, [np.asarray(p.value) for _, p in m.named_parameters()]


def _train_step_losses(n, **options):
    m = _mlp()
    step = tfl.train_step(lambda s, x, y: tfl.cross_entropy(m(x), y), tfl.Optimizer(optax.adam(1e-2), m), **options)
    out = [float(step(X, Y)) for _ in range(n)]
    return out, [np.asarray(p.value) for _, p in m.named_parameters()], step


def test_lazy_steps_match_untiered_within_float32_rounding(tiered):
    tfl.clear_kernel_caches()  # new programs: tiered ones
    got, got_params = _lazy_losses(6)
    tfl.set_tiered_compilation(False)
    tfl.clear_kernel_caches()
    want, want_params = _lazy_losses(6)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(got_params, want_params):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("donate", [False, True])
def test_train_step_matches_untiered_and_traces_once(tiered, donate):
    got, got_params, step = _train_step_losses(5, donate=donate)
    assert step.trace_count == 1  # traced and lowered once; both builds compile that lowering
    step._compiled.wait()
    assert step._compiled.optimized()
    tfl.set_tiered_compilation(False)
    want, want_params, _ = _train_step_losses(5, donate=donate)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(got_params, want_params):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_train_step_that_reads_outside_params_retraces_under_tiering(tiered):
    m = _mlp()
    scale = tfl.Param(jnp.asarray(2.0, F32), name="scale", trainable=False)
    step = tfl.train_step(lambda s, x, y: tfl.cross_entropy(m(x) * scale, y), tfl.Optimizer(optax.sgd(0.1), m))
    a = float(step(X, Y))
    tfl.set_tiered_compilation(False)
    m2 = _mlp()
    step2 = tfl.train_step(lambda s, x, y: tfl.cross_entropy(m2(x) * scale, y), tfl.Optimizer(optax.sgd(0.1), m2))
    np.testing.assert_allclose(a, float(step2(X, Y)), rtol=1e-5)


def test_the_compile_log_names_both_builds(tiered):
    m = _mlp()
    step = tfl.train_step(lambda s, x, y: tfl.cross_entropy(m(x), y), tfl.Optimizer(optax.sgd(0.1), m))
    with tfl.compile_log(file=None) as log:
        step(X[:4], Y[:4])
        step._compiled.wait()
    whats = [r.what for r in log.tapeflow_records()]
    assert any(w.startswith("train_step") and w.endswith("(level-0 build)") for w in whats), whats
    assert any(w.startswith("train_step") and w.endswith("(optimized build, in the background)") for w in whats), whats


def test_set_tiered_compilation_takes_a_bool_and_the_environment_turns_it_on():
    with pytest.raises(TypeError, match="set_tiered_compilation: expected True or False"):
        tfl.set_tiered_compilation(1)
    code = "import tapeflow._core._tiered as t; print(t.tiered_enabled())"
    for value, want in [("1", "True"), ("", "False"), ("0", "False")]:
        env = {**os.environ, "TAPEFLOW_TIERED": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == want, out.stderr
