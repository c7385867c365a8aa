"""A failed or interrupted step loses nothing, on the eager and the compiled path alike.

* an exception inside the update (a ``jax.pure_callback`` in the user's optax
  transform that raises) leaves every Param and the optimizer state exactly as
  they were, and the step is usable again;
* Ctrl-C (a real SIGINT) landing while a step writes its results is held until
  the write-back is complete: the parameters and the state always belong to one
  step, never to a mix of two;
* an update never invalidates a value another session recorded (``s.use(W)``);
* a registration without a storage descriptor is refused by the optimizer that
  owns its Param, and never keeps a ``Grads`` alive.
"""

from __future__ import annotations

import contextlib
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import Switch

import tapeflow as tfl

F32 = np.float32


def failing_transform(switch: Switch) -> optax.GradientTransformation:
    """Adam whose update passes the gradients through a host callback that can raise."""
    adam = optax.adam(0.1)

    def update(updates, state, params=None):
        updates = jax.tree_util.tree_map(
            lambda u: jax.pure_callback(switch, jax.ShapeDtypeStruct(u.shape, u.dtype), u), updates
        )
        return adam.update(updates, state, params)

    return optax.GradientTransformation(adam.init, update)


def model():
    W = tfl.Param(jnp.asarray(np.linspace(-1, 1, 6, dtype=F32).reshape(3, 2)), name="W")
    b = tfl.Param(jnp.zeros(2, F32), name="b")
    return W, b


def loss_fn(s, x, W, b):
    return tfl.mean(tfl.tanh(x @ W + b) ** 2.0)


X = jnp.asarray(np.arange(12, dtype=F32).reshape(4, 3) / 10)


class Eager:
    """``opt.step(s.backward(loss))`` in a fresh session per call (``lazy``: a lazy one, the loss read after
    the step, so forward, backward and update run as one fused program)."""

    def __init__(self, opt, W, b, lazy=False):
        self.opt, self.W, self.b, self.lazy = opt, W, b, lazy

    def __call__(self, x):
        with tfl.Session(lazy=self.lazy) as s:
            loss = loss_fn(s, x, self.W, self.b)
            value = None if self.lazy else loss.value
            self.opt.step(s.backward(loss))
            return loss.value if self.lazy else value


def compiled(opt, W, b):
    return tfl.train_step(lambda s, x: loss_fn(s, x, W, b), opt)


@pytest.fixture(params=["eager", "lazy", "train_step"])
def make_step(request):
    """Builds the same training step on the eager path, in a lazy session, or compiled with ``train_step``."""

    def build(opt, W, b):
        if request.param == "train_step":
            return compiled(opt, W, b)
        return Eager(opt, W, b, lazy=request.param == "lazy")

    return build


def snapshot(opt, *params):
    return [np.asarray(p.value).copy() for p in params], [
        np.asarray(x).copy() for x in jax.tree_util.tree_leaves(opt.state)
    ]


def assert_same(a, b):
    for x, y in zip(a[0] + a[1], b[0] + b[1], strict=True):
        np.testing.assert_array_equal(x, y)


def reference_after(n_steps):
    """Params and state after ``n_steps`` uninterrupted eager steps with the same transform."""
    W, b = model()
    opt = tfl.Optimizer(failing_transform(Switch()), [W, b])
    step = Eager(opt, W, b)
    for _ in range(n_steps):
        step(X)
    return snapshot(opt, W, b)


def test_exception_inside_the_update_changes_nothing_and_the_step_recovers(make_step):
    W, b = model()
    switch = Switch()
    opt = tfl.Optimizer(failing_transform(switch), [W, b])
    step = make_step(opt, W, b)
    step(X)
    before = snapshot(opt, W, b)
    count = getattr(step, "step_count", None)
    switch.on = True
    with pytest.raises(Exception, match=r"injected failure|pure_callback"):
        step(X)
    for p in (W, b):
        assert not p.value.is_deleted()
    assert_same(snapshot(opt, W, b), before)
    assert getattr(step, "step_count", None) == count
    switch.on = False
    step(X)
    assert_same(snapshot(opt, W, b), reference_after(2))


def test_donating_step_that_fails_says_what_was_lost():
    W, b = model()
    switch = Switch()
    opt = tfl.Optimizer(failing_transform(switch), [W, b])
    step = tfl.train_step(lambda s, x: loss_fn(s, x, W, b), opt, donate=True)
    step(X)
    switch.on = True
    with pytest.raises(tfl.TapeError, match=r"donate=True.*deleted.*donate=False"):
        step(X)


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("flag", ["check_finite", "debug_nans"])
def test_a_refused_non_finite_train_step_keeps_every_value_donated_or_not(donate, flag):
    # a refused step is simply not written; with donate=True its inputs are gone, so the program itself
    # hands back the old values (the only case that pays for a select over every value)
    W, b = model()
    opt = tfl.Optimizer(failing_transform(Switch()), [W, b], check_finite=flag == "check_finite")
    step = tfl.train_step(lambda s, x: loss_fn(s, x, W, b), opt, donate=donate, debug_nans=flag == "debug_nans")
    step(X)
    before = snapshot(opt, W, b)
    bad = X.at[1, 2].set(jnp.inf)
    with pytest.raises(tfl.TapeError, match="nothing was updated"):
        step(bad)
    for p in (W, b):
        assert not p.value.is_deleted()
    assert_same(snapshot(opt, W, b), before)
    assert step.step_count == 1
    step(X)
    assert_same(snapshot(opt, W, b), reference_after(2))


def test_interrupt_during_the_write_back_lands_after_it(make_step, monkeypatch):
    W, b = model()
    opt = tfl.Optimizer(failing_transform(Switch()), [W, b])
    step = make_step(opt, W, b)
    step(X)
    fired = []
    real_write = tfl.Storage.write_current_many
    real_single = tfl.Storage.write

    def interrupt_once():
        if not fired:
            fired.append(True)
            signal.raise_signal(signal.SIGINT)  # a real Ctrl-C, in the middle of the write-back

    def write_many(storages, values, device=None):
        storages, values = list(storages), list(values)
        real_write(storages[:1], values[:1], device)
        interrupt_once()
        real_write(storages[1:], values[1:], device)

    def write(self, value, *, on_device=False):
        real_single(self, value, on_device=on_device)
        interrupt_once()

    monkeypatch.setattr(tfl.Storage, "write_current_many", staticmethod(write_many))
    monkeypatch.setattr(tfl.Storage, "write", write)
    with pytest.raises(KeyboardInterrupt):
        step(X)
    monkeypatch.undo()
    assert fired
    # the interrupt waited for the whole write-back: parameters and state are exactly step 2's
    assert_same(snapshot(opt, W, b), reference_after(2))
    if hasattr(step, "step_count"):
        assert step.step_count == 2
    step(X)  # and the step is usable again
    assert_same(snapshot(opt, W, b), reference_after(3))


def test_interrupt_while_the_program_runs_leaves_one_whole_step():
    W, b = model()
    adam = optax.adam(0.1)
    armed = [False]

    def fire():
        if armed[0]:
            armed[0] = False
            signal.raise_signal(signal.SIGINT)

    def update(updates, state, params=None):
        jax.debug.callback(fire)
        return adam.update(updates, state, params)

    opt = tfl.Optimizer(optax.GradientTransformation(adam.init, update), [W, b])
    step = compiled(opt, W, b)
    step(X)
    old = snapshot(opt, W, b)
    armed[0] = True
    with contextlib.suppress(KeyboardInterrupt, jax.errors.JaxRuntimeError):  # JAX may report it as a failure
        step(X)
    now = snapshot(opt, W, b)
    new = reference_after(2)
    # either the step did not happen at all or it happened completely
    assert step.step_count in (1, 2)
    assert_same(now, old if step.step_count == 1 else new)
    step(X)
    assert step.step_count in (2, 3)


def test_update_never_invalidates_another_sessions_snapshot(make_step):
    W, b = model()
    opt = tfl.Optimizer(optax.sgd(0.1), [W, b])
    step = make_step(opt, W, b)
    s = tfl.Session()
    w_leaf = s.use(W)
    kept = W.value
    old = np.asarray(kept).copy()
    for _ in range(3):
        step(X)
    assert not kept.is_deleted()
    np.testing.assert_array_equal(np.asarray(w_leaf.value), old)  # the value seen at the use
    g = s.backward(tfl.sum(w_leaf * w_leaf))
    np.testing.assert_array_equal(np.asarray(g[W]), 2 * old)
    assert not np.array_equal(np.asarray(W.value), old)


class TestStoragelessRegistrations:
    def _recording(self, W, V):
        s = tfl.Session()
        h = s.input(jnp.ones((3, 2), F32), requires_grad=True)
        s.register_parameter_leaf(h, W)  # W's registration, but no storage descriptor
        v = s.use(V)
        return s, s.backward(tfl.sum(h * 2.0) + tfl.sum(v * 3.0))

    def test_optimizer_owning_the_param_refuses_and_changes_nothing(self):
        W, V = tfl.Param(jnp.ones((3, 2), F32), name="W"), tfl.Param(jnp.ones(2, F32), name="V")
        opt = tfl.Optimizer(optax.sgd(0.5), [W, V])
        _, g = self._recording(W, V)
        with pytest.raises(tfl.TapeError, match=r"without a storage descriptor.*storage=p.storage"):
            opt.step(g)
        np.testing.assert_array_equal(np.asarray(W.value), np.ones((3, 2), F32))
        np.testing.assert_array_equal(np.asarray(V.value), np.ones(2, F32))

    def test_it_does_not_keep_the_gradients_alive(self):
        W, V = tfl.Param(jnp.ones((3, 2), F32), name="W"), tfl.Param(jnp.ones(2, F32), name="V")
        opt = tfl.Optimizer(optax.sgd(0.5), [V])  # owns V only: the storage-less registration is not its
        _, g = self._recording(W, V)
        opt.step(g)
        np.testing.assert_allclose(np.asarray(V.value), np.full(2, -0.5, F32))
        assert g.released  # every group with a storage was consumed: nothing is held any more


def test_deferred_interrupts_nest_and_deliver_after_the_outer_block():
    from tapeflow._core._interrupts import deferred_interrupts

    reached = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupts():
            with deferred_interrupts():
                signal.raise_signal(signal.SIGINT)
                reached.append("inner")
            reached.append("outer")
        reached.append("after")  # never: the held Ctrl-C is delivered as the outer block ends
    assert reached == ["inner", "outer"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_step_whose_loss_uses_none_of_the_optimizers_storages_changes_nothing(make_step):
    """Not even shared optax state (Adam's count): both paths treat "no storage used" the same way."""
    W, b = model()
    other = tfl.Param(jnp.ones(2, F32), name="other")
    opt = tfl.Optimizer(optax.adam(0.1), [other])
    step = make_step(opt, W, b)  # the loss reads W and b only
    before = snapshot(opt, other)
    for _ in range(3):
        step(X)
    assert_same(snapshot(opt, other), before)
    assert int(opt.state[0].count) == 0
