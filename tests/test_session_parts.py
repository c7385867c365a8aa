"""The Session's parts on their own: its leaves (``_shell/_leaves.py``), the backward call's checks
(``BackwardPlanner.check``), the ``no_grad`` block and ``jvp`` (``_shell/_gradctl.py``), state writes
(``StateLog.assign_cell``).

Oracles: ``jax.jvp`` for tangents, the tape's length and the storages' values before a refused call (a refusal
changes nothing), the node values the leaves were given.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapeflow as tfl
from tapeflow._core._result import TapeError
from tapeflow._core._tape import PENDING
from tapeflow._shell._gradctl import GradControls, NoGrad, tangent
from tapeflow._shell._session import traced_session
from tapeflow._shell._state import StateLog
from tapeflow._shell._values import ParamSource

# -- leaves ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lazy", [False, True])
def test_leaves_hold_the_values_they_were_given(lazy):
    s = tfl.Session(lazy=lazy)
    w = tfl.Param(jnp.array([1.0, 2.0]), name="w")
    host = np.array([3.0, 4.0], np.float32)
    x, c, u = s.input(host, requires_grad=True), s.const(jnp.arange(2.0)), s.use(w)
    d = s.detach(x * 2.0)
    nodes = s.recording.nodes
    assert [nodes[h.id].op for h in (x, c, u, d)] == [None] * 4
    # a lazy session keeps host data on the host until something reads it
    assert type(nodes[x.id].value) is (np.ndarray if lazy else type(jnp.zeros(1)))
    np.testing.assert_array_equal(x.value, host)
    np.testing.assert_array_equal(c.value, [0.0, 1.0])
    np.testing.assert_array_equal(u.value, [1.0, 2.0])
    np.testing.assert_array_equal(d.value, [6.0, 8.0])
    assert (x.requires_grad, c.requires_grad, u.requires_grad, d.requires_grad) == (True, False, True, False)
    assert s.leaf_names() == {u.id: "w"}


def test_leaves_record_no_gradient_where_gradients_are_off():
    s = tfl.Session()
    with s.no_grad():
        x = s.input(jnp.ones(2), requires_grad=True)
        u = s.use(tfl.Param(jnp.ones(2)))
    assert not x.requires_grad and not u.requires_grad
    assert not tfl.Session(grad_enabled=False).input(jnp.ones(2), requires_grad=True).requires_grad


def test_a_refused_leaf_records_nothing():
    s = tfl.Session()
    x = s.input(jnp.ones(2))
    y = x * 2.0
    n = len(s.recording)
    with pytest.raises(TypeError, match=r"Session\.use expects a Param"):
        s.use(jnp.ones(2))
    with pytest.raises(TapeError, match="not a leaf"):
        s.register_parameter_leaf(y, tfl.Param(jnp.ones(2)))
    with pytest.raises(TapeError, match="a parameter registration"):
        s.register_parameter_leaf(x, tfl.Param(jnp.ones(3)), tfl.Storage(jnp.ones(3)))
    errors = []
    worker = threading.Thread(target=lambda: _catch(errors, lambda: s.input(jnp.ones(2))))
    worker.start()
    worker.join()
    assert len(errors) == 1 and "cannot be used from thread" in str(errors[0])
    assert len(s.recording) == n and s.leaf_names() == {}


def _catch(errors, fn):
    try:
        fn()
    except TapeError as e:
        errors.append(e)


# -- the backward call's checks -------------------------------------------------------------------------------


@pytest.mark.parametrize("lazy", [False, True])
def test_a_refused_backward_leaves_the_recording_as_it_was(lazy):
    s = tfl.Session(lazy=lazy)
    x = s.input(jnp.array([1.0, 2.0]), requires_grad=True)
    c = s.input(jnp.ones(2))
    loss, c2 = tfl.sum(x * c), c * 2.0
    n = len(s.recording)
    with pytest.raises(TypeError, match="expects a Tensor handle"):
        s.backward(jnp.ones(()))
    with pytest.raises(TapeError, match="recorded without requires_grad"):
        s.backward(loss, wrt=[c])
    with pytest.raises(TapeError, match="depends on no leaf that requires grad"):
        s.backward(loss, wrt=[c2])
    with pytest.raises(TypeError, match="wrt takes Tensor handles"):
        s.backward(loss, wrt=[jnp.ones(2)])
    with pytest.raises(TapeError, match="complex"):
        s.backward(loss, seed=jnp.ones((), jnp.complex64))
    assert len(s.recording) == n  # nothing recorded by the refused backwards
    np.testing.assert_allclose(s.backward(loss)[x], jax.grad(lambda v: jnp.sum(v * jnp.ones(2)))(x.value))


def test_an_inference_session_refuses_backward():
    s = tfl.Session(grad_enabled=False)
    loss = tfl.sum(s.input(jnp.ones(2), requires_grad=True))
    with pytest.raises(TapeError, match="inference session"):
        s.backward(loss)


# -- gradient controls: the no_grad block and jvp --------------------------------------------------------------


def test_the_no_grad_block_counts_its_depth_and_describes_the_recording_again_in_and_out():
    ctl, seen, entered = GradControls(), [], []
    outer = NoGrad("s", ctl, lambda: entered.append(1), lambda: seen.append(ctl.depth))
    with outer as got:
        with NoGrad("s", ctl, lambda: None, lambda: seen.append(ctl.depth)):
            assert ctl.depth == 2
        assert got == "s" and ctl.depth == 1
    assert seen == [1, 2, 1, 0] and entered == [1] and ctl.depth == 0
    with pytest.raises(ValueError), NoGrad("s", ctl, lambda: None, lambda: None):
        raise ValueError
    assert ctl.depth == 0  # an exception in the block closes it too


def test_no_grad_is_checked_on_entry_and_then_restores_tracking():
    s = tfl.Session()
    block = s.no_grad()  # made here, entered in another thread: refused there, with nothing changed
    errors = []
    worker = threading.Thread(target=lambda: _catch(errors, block.__enter__))
    worker.start()
    worker.join()
    assert len(errors) == 1
    x = s.input(jnp.ones(2), requires_grad=True)
    with s.no_grad() as same:
        assert same is s and not (x * 2.0).requires_grad
    assert (x * 2.0).requires_grad


def test_no_grad_also_decorates_a_function():
    s = tfl.Session()
    x = s.input(jnp.ones(2), requires_grad=True)

    @s.no_grad()
    def frozen(h):
        return h * 2.0

    assert not frozen(x).requires_grad and not frozen(x).requires_grad  # every call runs in the block
    assert (x * 2.0).requires_grad
    np.testing.assert_array_equal(frozen(x).value, [2.0, 2.0])


def test_tangent_matches_jax_jvp_for_handles_and_params():
    w = tfl.Param(jnp.array([0.5, -1.0, 2.0]), name="w")
    xv, tx, tw = jnp.array([1.0, 2.0, 3.0]), jnp.array([0.1, 0.2, 0.3]), jnp.array([1.0, 0.0, -1.0])
    s = tfl.Session()
    x = s.input(xv)
    out = tfl.sum(tfl.tanh(x * w) * w)  # w used twice: its tangent reaches both uses
    _, expected = jax.jvp(lambda a, b: jnp.sum(jnp.tanh(a * b) * b), (xv, w.value), (tx, tw))
    np.testing.assert_allclose(s.jvp(out, {x: tx, w: tw}), expected, rtol=1e-6)
    np.testing.assert_allclose(tangent(s, out, {x: tx, w: tw}, s._recorder.storage_by_leaf), expected, rtol=1e-6)
    with pytest.raises(TypeError, match="Tensor or Param keys"):
        s.jvp(out, {"x": tx})


# -- state writes -----------------------------------------------------------------------------------------------


def test_assign_cell_writes_eagerly_and_only_records_in_a_traced_recording():
    cell = tfl.Param(jnp.zeros(2), name="count", trainable=False)
    log = StateLog()
    log.assign_cell(cell, jnp.array([1.0, 2.0]), None)
    np.testing.assert_array_equal(cell.value, [1.0, 2.0])
    log.undo()
    np.testing.assert_array_equal(cell.value, [0.0, 0.0])

    source = ParamSource({})
    traced = StateLog()
    traced.assign_cell(cell, jnp.array([5.0, 6.0]), source)
    np.testing.assert_array_equal(cell.value, [0.0, 0.0])  # nothing written
    np.testing.assert_array_equal(source.read(cell), [5.0, 6.0])  # later uses read the new value
    np.testing.assert_array_equal(traced.new[cell.storage], [5.0, 6.0])
    with pytest.raises(TapeError, match="is trainable"):
        traced.assign_cell(tfl.Param(jnp.zeros(2)), jnp.ones(2), source)


def test_a_refused_state_write_computes_nothing_in_a_lazy_session():
    s = tfl.Session(lazy=True)
    v = s.input(jnp.ones(2)) * 2.0
    with pytest.raises(TapeError, match="is trainable"):
        s.assign_state(tfl.Param(jnp.zeros(2)), v)
    assert s.recording[v.id].value is PENDING and s.state_writes == {}


def test_a_traced_session_records_its_state_writes_for_later_uses():
    cell = tfl.Param(jnp.zeros(()), trainable=False)
    s = traced_session({}, None)
    s.assign_state(cell, s.use(cell) + 3.0)
    assert float(s.use(cell).value) == 3.0 and float(cell.value) == 0.0
    assert [float(v) for v in s.state_writes.values()] == [3.0]
