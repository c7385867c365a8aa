"""train_step reads every Param's current value on every call (issue 10, item 1).

A Param reachable from ``loss_fn`` but not owned by the optimizer (a frozen
table, a target network, a Param another optimizer owns) is a runtime argument
of the compiled program, never a constant baked in at trace time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tapeflow as tfl


def test_a_frozen_param_changed_between_calls_is_read_each_call():
    w = tfl.Param(jnp.array(1.0))
    u = tfl.Param(jnp.array(0.0), trainable=False)
    step = tfl.train_step(lambda s: (w - u) ** 2.0, tfl.Optimizer(optax.sgd(0.0), [w]))
    got = []
    for k in range(4):
        u.value = jnp.array(float(k))
        got.append(float(step()))
    assert got == [1.0, 0.0, 1.0, 4.0]
    assert step.cache_size() == 1  # discovered while tracing, compiled once


def test_identical_inputs_compile_once_even_from_a_weakly_typed_param():
    w = tfl.Param(jnp.array(1.0))  # jnp.array(1.0) is weakly typed
    step = tfl.train_step(lambda s: (w - 1.0) ** 2.0, tfl.Optimizer(optax.sgd(0.1), [w]))
    for _ in range(3):
        step()
    assert step.cache_size() == 1 and step.trace_count == 1


@pytest.mark.parametrize("donate", [True, False])
def test_two_optimizers_over_one_loss_equal_the_eager_alternation(donate):
    def make():
        a = tfl.Param(jnp.array([1.0, -2.0]), name="a")
        b = tfl.Param(jnp.array([0.5, 3.0]), name="b")
        return a, b, tfl.Optimizer(optax.adam(0.1), [a]), tfl.Optimizer(optax.sgd(0.05), [b])

    def loss_of(a, b):
        return lambda s: tfl.sum((a * b - 1.0) ** 2.0)

    a1, b1, oa1, ob1 = make()
    for _ in range(5):
        for opt in (oa1, ob1):
            with tfl.Session() as s:
                opt.step(s.backward(loss_of(a1, b1)(s)))
    a2, b2, oa2, ob2 = make()
    step_a = tfl.train_step(loss_of(a2, b2), oa2, donate=donate)
    step_b = tfl.train_step(loss_of(a2, b2), ob2, donate=donate)
    for _ in range(5):
        step_a()
        step_b()
    np.testing.assert_allclose(np.asarray(a2.value), np.asarray(a1.value), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(b2.value), np.asarray(b1.value), rtol=1e-6, atol=1e-6)
    assert step_a.cache_size() == 1 and step_b.cache_size() == 1


def test_a_param_first_used_on_a_later_call_is_an_argument_too():
    w = tfl.Param(jnp.array(2.0))
    late = tfl.Param(jnp.array(10.0), trainable=False)
    step = tfl.train_step(
        lambda s, use_late: (w - late) ** 2.0 if use_late else w**2.0,
        tfl.Optimizer(optax.sgd(0.0), [w]),
        static_argnames="use_late",
    )
    assert float(step(use_late=False)) == 4.0
    assert float(step(use_late=True)) == 64.0
    late.value = jnp.array(3.0)
    assert float(step(use_late=True)) == 1.0


class TestValueAndGradReadsNoHiddenParam:
    """value_and_grad is a pure function of ``params``: under jax.jit a Param it was not given is refused."""

    def test_an_unlisted_param_under_jit_is_refused_not_baked(self):
        w = tfl.Param(jnp.array(1.0))
        u = tfl.Param(jnp.array(0.0), trainable=False)
        f = jax.jit(tfl.value_and_grad(lambda s: (w - u) ** 2.0))
        with pytest.raises(tfl.TapeError, match=r"not in params.*constant.*Pass those Params in params"):
            f({"w": w})

    def test_listing_it_reads_it_every_call(self):
        w = tfl.Param(jnp.array(1.0))
        u = tfl.Param(jnp.array(0.0), trainable=False)
        f = jax.jit(tfl.value_and_grad(lambda s: (w - u) ** 2.0))
        got = []
        for k in range(4):
            u.value = jnp.array(float(k))
            loss, g = f({"w": w, "u": u})
            got.append((float(loss), float(g["w"])))
        assert got == [(1.0, 2.0), (0.0, 0.0), (1.0, -2.0), (4.0, -4.0)]

    def test_outside_a_transformation_the_current_value_is_read(self):
        w = tfl.Param(jnp.array(1.0))
        u = tfl.Param(jnp.array(3.0), trainable=False)
        loss, g = tfl.value_and_grad(lambda s: (w - u) ** 2.0)({"w": w})
        assert (float(loss), float(g["w"])) == (4.0, -4.0)
