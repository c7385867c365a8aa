"""train_step honours Optimizer(check_finite=True) exactly as Optimizer.step does (issue 10, item 4)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tapeflow as tfl


def _setup():
    w = tfl.Param(jnp.array([1.0, 2.0]), name="w")
    v = tfl.Param(jnp.array([3.0]), name="v")
    opt = tfl.Optimizer(optax.adam(0.1), [w, v], check_finite=True)
    return w, v, opt


def _loss(w, v):
    def loss_fn(s, x):
        # log(x) is -inf / nan for x <= 0: a non-finite gradient for w only
        return tfl.sum(tfl.log(w * x)) + tfl.sum(v * v)

    return loss_fn


def _eager_step(w, v, opt, x, lazy=False):
    with tfl.Session(lazy=lazy) as s:
        loss = _loss(w, v)(s, s.input(x))
        opt.step(s.backward(loss))


def _compiled_step(w, v, opt, x, step=None):
    step = step or tfl.train_step(_loss(w, v), opt)
    step(x)
    return step


@pytest.mark.parametrize("path", ["eager", "lazy", "train_step"])
def test_non_finite_gradient_updates_nothing_and_names_the_parameter(path):
    w, v, opt = _setup()
    run = {
        "eager": _eager_step,
        "lazy": lambda w, v, opt, x: _eager_step(w, v, opt, x, lazy=True),
        "train_step": _compiled_step,
    }[path]
    run(w, v, opt, jnp.array([1.0, 1.0]))  # a good step first
    before = (
        np.asarray(w.value),
        np.asarray(v.value),
        [np.asarray(x) for x in jax.tree_util.tree_leaves(opt.state)],
    )
    with pytest.raises(tfl.TapeError, match=r"non-finite gradient for Param\('w'.*nothing was updated"):
        run(w, v, opt, jnp.array([0.0, 1.0]))
    np.testing.assert_array_equal(np.asarray(w.value), before[0])
    np.testing.assert_array_equal(np.asarray(v.value), before[1])
    after_state = [np.asarray(x) for x in jax.tree_util.tree_leaves(opt.state)]
    assert all(np.array_equal(a, b) for a, b in zip(before[2], after_state))


def test_train_step_is_usable_after_a_rejected_step_and_matches_eager():
    w1, v1, opt1 = _setup()
    w2, v2, opt2 = _setup()
    step = tfl.train_step(_loss(w2, v2), opt2)
    xs = [jnp.array([1.0, 2.0]), jnp.array([0.0, 1.0]), jnp.array([2.0, 1.0])]
    for x in xs:
        errs = []
        for run in (lambda: _eager_step(w1, v1, opt1, x), lambda: step(x)):
            try:
                run()
                errs.append(None)
            except tfl.TapeError as e:
                errs.append(re.sub(r"#\d+", "#", str(e).split(":", 1)[1]))  # storage ids differ
        assert errs[0] == errs[1]
        rejected = errs[0] is not None
        assert rejected == bool(x[0] == 0.0)
    assert step.step_count == 2  # the rejected call did not count
    np.testing.assert_allclose(np.asarray(w1.value), np.asarray(w2.value), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(v1.value), np.asarray(v2.value), rtol=1e-6)
