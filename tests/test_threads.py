"""The threading model: a session belongs to its thread; optimizer steps are serialized.

* A Session (and each of its handles) may be used only from the thread that
  created it, as :mod:`sqlite3` connections: any other thread gets a clear
  ``TapeError`` and the session is left exactly as it was.
  ``Session(check_same_thread=False)`` lifts the check.
* ``Optimizer.step`` and ``TrainStep.__call__`` hold the optimizer's lock, so N
  threads x K steps give exactly the sequential result.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tapeflow as tfl

F32 = np.float32


def in_thread(fn):
    """Run ``fn`` in a new thread; return its result or re-raise its exception here."""
    box: dict = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as e:
            box["err"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert not t.is_alive()
    if "err" in box:
        raise box["err"]
    return box.get("out")


def state_of(s):
    return (s.tape, len(s.tape), s.generation, s.rng_counter)


class TestSessionBelongsToItsThread:
    def setup_method(self):
        self.W = tfl.Param(jnp.ones(3, F32), name="W")
        self.s = tfl.Session()
        self.x = self.s.input(jnp.arange(3.0, dtype=F32), requires_grad=True)
        self.y = self.x * self.s.use(self.W)

    @pytest.mark.parametrize(
        "call",
        [
            lambda t: t.s.input(jnp.ones(2)),
            lambda t: t.s.const(1.0),
            lambda t: t.s.use(t.W),
            lambda t: t.x * 2.0,
            lambda t: tfl.relu(t.y),
            lambda t: t.s.apply("add", t.x, t.x),
            lambda t: t.y.value,
            lambda t: float(t.y.sum()),
            lambda t: t.x.detach(),
            lambda t: t.s.backward(t.y.sum()),
            lambda t: t.s.normal((2,)),
            lambda t: t.s.random_key(),
            lambda t: t.s.set_rng_state(counter=5),
            lambda t: t.s.reset(),
            lambda t: t.s.parameter_groups(),
            lambda t: t.s.__enter__(),
        ],
        ids=lambda f: "",
    )
    def test_another_thread_is_refused_and_nothing_changes(self, call):
        before = state_of(self.s)
        with pytest.raises(tfl.TapeError, match=r"created in thread \d+ and cannot be used from thread"):
            in_thread(lambda: call(self))
        assert state_of(self.s) == before
        assert tfl.last_recorded_session() is self.s
        # the owning thread carries on
        assert np.asarray((self.y * 1.0).value).tolist() == [0.0, 1.0, 2.0]

    def test_repr_from_another_thread_does_not_raise(self):
        assert "Tensor(" in in_thread(lambda: repr(self.y))

    def test_check_same_thread_false_lets_another_thread_use_it(self):
        s = tfl.Session(check_same_thread=False)
        x = s.input(jnp.arange(3.0, dtype=F32), requires_grad=True)
        g = in_thread(lambda: s.backward(tfl.sum(x * x)))
        assert np.asarray(g[x]).tolist() == [0.0, 2.0, 4.0]

    def test_a_thread_uses_its_own_session(self):
        def work():
            with tfl.Session() as s:
                return float(tfl.sum(s.use(self.W) * 2.0))

        assert in_thread(work) == 6.0


def _run_threads(n, fn):
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def run():
        try:
            barrier.wait(30)
            fn()
        except BaseException as e:
            errors.append(e)

    ts = [threading.Thread(target=run) for _ in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    if errors:
        raise errors[0]


X = jnp.asarray(np.linspace(-1, 1, 8, dtype=F32).reshape(4, 2))


def _model():
    return tfl.Param(jnp.asarray([[0.5], [-0.3]], F32), name="W"), tfl.Param(jnp.zeros(1, F32), name="b")


def _loss(s, x, W, b):
    return tfl.mean(tfl.tanh(x @ W + b) ** 2.0)


def test_train_step_from_four_threads_equals_the_sequential_run():
    W, b = _model()
    opt = tfl.Optimizer(optax.adam(0.05), [W, b])
    step = tfl.train_step(lambda s, x: _loss(s, x, W, b), opt)
    step(X)  # compile once up front
    _run_threads(4, lambda: [step(X) for _ in range(100)])

    W2, b2 = _model()
    opt2 = tfl.Optimizer(optax.adam(0.05), [W2, b2])
    step2 = tfl.train_step(lambda s, x: _loss(s, x, W2, b2), opt2)
    for _ in range(401):
        step2(X)
    assert step.step_count == step2.step_count == 401
    np.testing.assert_array_equal(np.asarray(W.value), np.asarray(W2.value))
    np.testing.assert_array_equal(np.asarray(b.value), np.asarray(b2.value))
    for a, c in zip(jax.tree_util.tree_leaves(opt.state), jax.tree_util.tree_leaves(opt2.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_eager_steps_from_four_threads_lose_no_update():
    # a linear loss: every step's gradient is the same, so the sequential result is known
    # exactly whatever the order; a lost update (two steps reading the same old value) shows
    w = tfl.Param(jnp.zeros(3, F32), name="w")
    opt = tfl.Optimizer(optax.sgd(0.125), [w])
    c = jnp.asarray([1.0, 2.0, 4.0], F32)

    def work():
        for _ in range(100):
            with tfl.Session() as s:
                opt.step(s.backward(tfl.sum(w * c)))

    _run_threads(4, work)
    np.testing.assert_array_equal(np.asarray(w.value), -400 * 0.125 * np.asarray(c))


def test_eager_and_compiled_steps_share_the_lock():
    w = tfl.Param(jnp.zeros(2, F32), name="w")
    opt = tfl.Optimizer(optax.sgd(0.25), [w])
    c = jnp.asarray([1.0, -2.0], F32)
    step = tfl.train_step(lambda s: tfl.sum(w * c), opt)
    step()

    def eager():
        for _ in range(50):
            with tfl.Session() as s:
                opt.step(s.backward(tfl.sum(w * c)))

    def compiled():
        for _ in range(50):
            step()

    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def run(fn):
        try:
            barrier.wait(30)
            fn()
        except BaseException as e:
            errors.append(e)

    ts = [threading.Thread(target=run, args=(f,)) for f in (eager, compiled)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors
    np.testing.assert_array_equal(np.asarray(w.value), -101 * 0.25 * np.asarray(c))
