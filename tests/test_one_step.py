"""One step semantics on every path: eager ``Optimizer.step``, a lazy session's fused step, ``train_step``.

Each test runs the same scenario on the three paths through one parametrized
fixture; the spy test checks that every path runs ``tapeflow._train._step.step``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import PATHS, one_step

import tapeflow as tfl
from tapeflow._train import _step


def _snapshot(params, opt):
    return [np.asarray(p.value).copy() for p in params], [
        np.asarray(x).copy() for x in jax.tree_util.tree_leaves(opt.state)
    ]


def _same(a, b) -> None:
    for x, y in zip(a[0] + a[1], b[0] + b[1]):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


def _reshaping_tx() -> optax.GradientTransformation:
    """An update that turns each (3,) parameter into (2, 3) (apply_updates broadcasts it)."""

    def init(params):
        return optax.EmptyState()

    def update(updates, state, params=None):
        return jax.tree_util.tree_map(lambda u: jnp.broadcast_to(u, (2, *u.shape)), updates), state

    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("path", PATHS)
def test_an_update_that_changes_a_parameters_shape_is_refused_with_nothing_changed(path):
    w = tfl.Param(jnp.arange(3.0, dtype=jnp.float32), name="w")
    opt = tfl.Optimizer(optax.chain(optax.scale_by_adam(), _reshaping_tx()), [w])
    before = _snapshot([w], opt)
    steps: list = []
    with pytest.raises(tfl.TapeError, match=r"turns Param\('w'.*float32\[2,3\].*keeps its shape and dtype"):
        one_step(path, lambda s: tfl.sum(w * w), opt, steps=steps)
    assert w.shape == (3,) and w.value.shape == (3,)
    _same(before, _snapshot([w], opt))
    if steps:
        assert steps[0].step_count == 0


@pytest.mark.parametrize("path", PATHS)
def test_check_finite_refuses_a_tied_sum_that_overflows_with_nothing_changed(path):
    """Each use's cotangent (60000) is finite in float16; their per-storage sum (120000) is not."""
    w = tfl.Param(jnp.ones(2, jnp.float16), name="w")
    w_out = tfl.tie(w, name="w_out")
    opt = tfl.Optimizer(optax.adam(1e-3), [w, w_out], check_finite=True)
    before = _snapshot([w], opt)
    c = np.full(2, 60000.0, np.float16)
    steps: list = []
    with pytest.raises(tfl.TapeError, match=r"non-finite gradient for Param\('w'.*nothing was updated"):
        one_step(path, lambda s: tfl.sum(w * s.input(c)) + tfl.sum(w_out * s.input(c)), opt, steps=steps)
    _same(before, _snapshot([w], opt))
    assert np.isfinite(np.asarray(w.value, np.float32)).all()
    if steps:
        assert steps[0].step_count == 0
    # the same optimizer still steps once the gradient is finite
    one_step(path, lambda s: tfl.sum(w * s.input(np.ones(2, np.float16))), opt)
    assert not np.array_equal(np.asarray(w.value), before[0][0])


@pytest.mark.parametrize("path", PATHS)
def test_every_path_runs_the_one_step(path, monkeypatch):
    calls = []
    orig = _step.step

    def spy(*args, **kwargs):
        calls.append(path)
        return orig(*args, **kwargs)

    monkeypatch.setattr(_step, "step", spy)
    w = tfl.Param(jnp.array([1.0, 2.0], jnp.float32), name="w")
    opt = tfl.Optimizer(optax.sgd(0.5), [w, tfl.tie(w)])
    # optimizers of one structure share their compiled steps: drop them so every path traces its step anew
    jax.clear_caches()
    tfl.clear_kernel_caches()
    one_step(path, lambda s: tfl.sum(w * w), opt)
    assert calls, f"the {path} path did not run tapeflow._train._step.step"
    np.testing.assert_allclose(np.asarray(w.value), [0.0, 0.0])  # w - 0.5 * 2w


@pytest.mark.parametrize("path", PATHS)
def test_a_step_run_under_a_jax_transformation_writes_no_tracer(path):
    """A step writes state: under jax.jit it refuses instead of storing tracers in the Params."""
    w = tfl.Param(jnp.array([1.0, 2.0], jnp.float32), name="w")
    opt = tfl.Optimizer(optax.sgd(0.5), [w])
    before = _snapshot([w], opt)

    def traced(x):
        one_step(path, lambda s: tfl.sum(w * x), opt)
        return x

    with pytest.raises(tfl.TapeError, match="traced by JAX"):
        jax.jit(traced)(jnp.ones(2, jnp.float32))
    assert not isinstance(w.storage.read_current(), jax.core.Tracer)
    _same(before, _snapshot([w], opt))


_REFUSED_UNDER_TRACE = (
    r"traced by JAX.*{where} writes parameters.*nothing was written.*outside the transformation.*value_and_grad"
)


def _steps_eagerly_afterwards(w: tfl.Param, opt: tfl.Optimizer, before) -> None:
    """A refused traced step left no tracer behind: the next eager step reads and writes real arrays."""
    _same(before, _snapshot([w], opt))
    assert not isinstance(w.storage.read_current(), jax.core.Tracer)
    with tfl.Session() as s:
        opt.step(s.backward(tfl.sum(w * w)))
    assert not np.array_equal(np.asarray(w.value), before[0][0])


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_a_train_step_called_under_grad_or_vmap_is_refused_with_nothing_changed(transform):
    w = tfl.Param(jnp.array([1.0, 2.0], jnp.float32), name="w")
    opt = tfl.Optimizer(optax.adam(0.5), [w])
    step = tfl.train_step(lambda s, x: tfl.sum(w * s.input(x)), opt)
    before = _snapshot([w], opt)
    with pytest.raises(tfl.StateWriteError, match=_REFUSED_UNDER_TRACE.format(where="train_step")):
        if transform == "grad":
            jax.grad(step)(jnp.ones(2, jnp.float32))
        else:
            jax.vmap(step)(jnp.ones((3, 2), jnp.float32))
    assert step.step_count == 0
    _steps_eagerly_afterwards(w, opt, before)
    step(jnp.ones(2, jnp.float32))  # the same TrainStep, called outside the transformation
    assert step.step_count == 1


def test_a_lazy_sessions_step_under_jit_is_refused_with_nothing_changed():
    w = tfl.Param(jnp.array([1.0, 2.0], jnp.float32), name="w")
    opt = tfl.Optimizer(optax.adam(0.5), [w])
    before = _snapshot([w], opt)

    def traced(x):
        with tfl.Session(lazy=True) as s:
            opt.step(s.backward(tfl.sum(w * s.input(x))))
        return x

    with pytest.raises(tfl.StateWriteError, match=_REFUSED_UNDER_TRACE.format(where="Optimizer.step")):
        jax.jit(traced)(jnp.ones(2, jnp.float32))
    _steps_eagerly_afterwards(w, opt, before)


def test_setting_a_params_value_to_a_tracer_is_refused_with_nothing_changed():
    w = tfl.Param(jnp.array([1.0, 2.0], jnp.float32), name="w")
    opt = tfl.Optimizer(optax.adam(0.5), [w])
    before = _snapshot([w], opt)

    def traced(x):
        w.value = x
        return x

    with pytest.raises(tfl.StateWriteError, match=_REFUSED_UNDER_TRACE.format(where="Param.value")):
        jax.jit(traced)(jnp.ones(2, jnp.float32))
    _steps_eagerly_afterwards(w, opt, before)


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_a_donating_train_step_called_under_grad_or_vmap_keeps_the_params(transform):
    w = tfl.Param(jnp.array([1.0, 2.0], jnp.float32), name="w")
    opt = tfl.Optimizer(optax.adam(0.5), [w])
    step = tfl.train_step(lambda s, x: tfl.sum(w * s.input(x)), opt, donate=True)
    before = _snapshot([w], opt)
    with pytest.raises(tfl.StateWriteError, match=_REFUSED_UNDER_TRACE.format(where="train_step")):
        if transform == "grad":
            jax.grad(step)(jnp.ones(2, jnp.float32))
        else:
            jax.vmap(step)(jnp.ones((3, 2), jnp.float32))
    _steps_eagerly_afterwards(w, opt, before)


@pytest.mark.parametrize("path", PATHS)
def test_a_finite_checked_step_under_jit_is_refused_with_a_tape_error(path):
    w = tfl.Param(jnp.array([1.0, 2.0], jnp.float32), name="w")
    opt = tfl.Optimizer(optax.adam(0.5), [w], check_finite=True)
    before = _snapshot([w], opt)

    def traced(x):
        one_step(path, lambda s: tfl.sum(w * s.input(x)), opt)
        return x

    with pytest.raises(tfl.StateWriteError, match="traced by JAX"):
        jax.jit(traced)(jnp.ones(2, jnp.float32))
    _steps_eagerly_afterwards(w, opt, before)
