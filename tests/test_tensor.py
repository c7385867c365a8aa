"""Tensor handles and the operator set: operators on Tensors and Params, indexing, repr,
stale / foreign / ownerless handle errors, and which session an op records on (the
current session, else the session that recorded last in this thread).

Split from ``test_session.py`` along ``tapeflow/_tensor.py``. Operator gradients are
checked against ``jax.grad`` of an equivalent pure function.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import FOREIGN_MSG, STALE_MSG, _assert_unchanged, _rng, _state, close

import tapeflow as tfl
import tapeflow._shell._tensor
from tapeflow import TapeError
from tapeflow._shell._tensor import TensorOps

# =========================================================================== current session


class TestContextManager:
    def test_current_and_reset_on_exit(self):
        assert tfl.current_session() is None
        with tfl.Session() as s:
            assert tfl.current_session() is s
            x = s.input(jnp.ones(2))
            assert len(s.tape) == 1
        assert tfl.current_session() is None
        assert s.generation == 1 and len(s.tape) == 0
        with pytest.raises(TapeError, match="stale tensor handle"):
            _ = x + 1.0

    def test_nested_restores_outer(self):
        with tfl.Session() as a:
            with tfl.Session() as b:
                assert tfl.current_session() is b
            assert tfl.current_session() is a
            assert b.generation == 1 and a.generation == 0
        assert tfl.current_session() is None

    def test_reset_and_restore_on_exception(self):
        with pytest.raises(RuntimeError):
            with tfl.Session() as s:
                s.input(jnp.ones(2))
                raise RuntimeError("boom")
        assert tfl.current_session() is None
        assert s.generation == 1 and len(s.tape) == 0

    def test_as_current_nests_keeps_the_recording_and_restores_on_exception(self):
        a, b = tfl.Session(), tfl.Session()
        with a.as_current() as got:
            assert got is a and tfl.current_session() is a
            x = tfl.relu(tfl.Param(jnp.ones(2)))
            with pytest.raises(RuntimeError, match="boom"), b.as_current():
                assert tfl.current_session() is b
                raise RuntimeError("boom")
            assert tfl.current_session() is a
        assert tfl.current_session() is None
        assert a.generation == 0 and x.value.tolist() == [1.0, 1.0]  # no reset: the handle is live
        block = a.as_current()
        with block:
            assert tfl.current_session() is a
        assert tfl.current_session() is None

    def test_ops_without_tensor_operands_use_current_session(self):
        p = tfl.Param(jnp.arange(3.0))
        with tfl.Session() as s:
            y = tfl.relu(p)
            assert y.owner == s.owner
            assert y.value.tolist() == [0.0, 1.0, 2.0]
            z = p + 1.0
            assert z.owner == s.owner and z.value.tolist() == [1.0, 2.0, 3.0]

    def test_no_current_session_is_a_clear_error(self):
        p = tfl.Param(jnp.arange(3.0))
        assert tfl.current_session() is None
        with pytest.raises(TapeError, match="no session"):
            tfl.relu(p)


# =========================================================================== handles


class TestHandles:
    def test_identity_fields(self):
        s = tfl.Session()
        x = s.input(jnp.ones((2, 3), jnp.float32))
        y = x * 2.0
        assert (x.owner, x.generation, x.id) == (s.owner, 0, 0)
        assert (y.owner, y.generation, y.id) == (s.owner, 0, len(s.tape) - 1)  # the 2.0 is a constant leaf
        assert x.shape == (2, 3) and y.shape == (2, 3)
        assert x.dtype == np.dtype("float32") and y.dtype == np.dtype("float32")
        assert x.ndim == 2 and x.numel() == 6 and x.size() == (2, 3) and len(x) == 2
        s.reset()
        z = s.input(jnp.ones(4))
        assert (z.generation, z.id) == (1, 0)

    def test_operators_match_numpy(self):
        a_np = _rng(1).standard_normal((3, 4))
        b_np = _rng(2).standard_normal((3, 4)) + 3.0
        m_np = _rng(3).standard_normal((4, 2))
        s = tfl.Session()
        a, b, m = s.input(a_np), s.input(b_np), s.input(m_np)
        close((a + b).value, a_np + b_np)
        close((a - b).value, a_np - b_np)
        close((a * b).value, a_np * b_np)
        close((a / b).value, a_np / b_np)
        close((a @ m).value, a_np @ m_np)
        close((b**2.0).value, b_np**2.0)
        close((b**a).value, b_np**a_np)
        close((-a).value, -a_np)
        close(abs(a).value, np.abs(a_np))
        close((2.0 + a).value, 2.0 + a_np)
        close((2.0 - a).value, 2.0 - a_np)
        close((2.0 * a).value, 2.0 * a_np)
        close((2.0 / b).value, 2.0 / b_np)
        close((a_np @ m).value, a_np @ m_np)  # __rmatmul__ via __array_priority__
        close((+a).value, a_np)

    def test_comparisons_are_boolean_without_grad(self):
        a_np = np.array([1.0, 2.0, 3.0])
        b_np = np.array([3.0, 2.0, 1.0])
        s = tfl.Session()
        a = s.input(a_np, requires_grad=True)
        b = s.input(b_np, requires_grad=True)
        for h, ref in [
            (a < b, a_np < b_np),
            (a <= b, a_np <= b_np),
            (a > b, a_np > b_np),
            (a >= b, a_np >= b_np),
            (a == b, a_np == b_np),
            (a != b, a_np != b_np),
            (a > 1.5, a_np > 1.5),
        ]:
            assert h.dtype == np.dtype(bool)
            assert h.requires_grad is False
            assert np.asarray(h).tolist() == ref.tolist()

    def test_shape_methods_and_indexing(self):
        x_np = np.arange(24.0).reshape(2, 3, 4)
        s = tfl.Session()
        x = s.input(x_np)
        m = s.input(x_np[0])
        assert np.array_equal(m.T.value, x_np[0].T)
        assert np.array_equal(tfl.numpy.transpose(x).value, x_np.transpose())
        assert np.array_equal(x.transpose(1, 0).value, x_np.transpose(1, 0, 2))
        assert np.array_equal(x.permute(2, 0, 1).value, x_np.transpose(2, 0, 1))
        assert np.array_equal(x[1].value, x_np[1])
        assert np.array_equal(x[:, 1:, ::2].value, x_np[:, 1:, ::2])
        assert np.array_equal(x[..., -1].value, x_np[..., -1])
        assert np.array_equal(x[0, None, 2].value, x_np[0, None, 2])
        assert np.array_equal(x.reshape(6, 4).value, x_np.reshape(6, 4))
        assert np.array_equal(x.reshape((4, -1)).value, x_np.reshape(4, -1))
        close(x.sum().value, x_np.sum())
        close(x.sum(axis=1).value, x_np.sum(axis=1))
        close(x.sum(axis=[0, 2]).value, x_np.sum(axis=(0, 2)))
        close(x.mean(axis=-1, keepdims=True).value, x_np.mean(axis=-1, keepdims=True))
        close(x.max().value, x_np.max())
        close(x.max(axis=0).values.value, x_np.max(axis=0))
        close(x.amax(axis=0).value, x_np.max(axis=0))

    def test_integer_index_tensor_takes_rows(self):
        x_np = np.arange(12.0).reshape(4, 3)
        s = tfl.Session()
        x = s.input(x_np)
        idx = s.input(np.array([3, 0, 3]))
        y = x[idx]
        assert np.array_equal(y.value, x_np[[3, 0, 3]])
        assert s.tape[y.id].op == "take"

    def test_value_conversions_and_repr(self):
        s = tfl.Session()
        x = s.input(jnp.array([1.5, -2.0]), requires_grad=True)
        y = x.sum()
        assert isinstance(x.value, jax.Array)
        assert np.asarray(x).tolist() == [1.5, -2.0]
        assert float(y) == -0.5
        assert y.item() == -0.5
        with pytest.raises(TypeError):
            float(x)
        r = repr(x)
        assert "leaf" in r and "requires_grad" in r and "[2]" in r
        assert "sum" in repr(y)
        s.reset()
        assert "stale" in repr(x)  # repr never raises, it says what is wrong
        ownerless = tfl.Tensor(None, 0, 0, 0, (), np.dtype("float32"))
        assert "no session" in repr(ownerless)

    def test_operator_gradients_match_jax_grad(self):
        a_np = _rng(4).standard_normal((3, 4))
        b_np = _rng(5).standard_normal((3, 4)) + 3.0
        m_np = _rng(6).standard_normal((4, 2))

        def f(a, b, m):
            y = (a + b) * (a - b) / b
            y = y @ m
            y = -abs(y) + (b**2.0).sum(axis=0)[:2]
            y = y.T[1:, :]
            return y.sum() + y.mean() + y.max() + y.reshape(-1)[1]

        s = tfl.Session()
        a = s.input(a_np, requires_grad=True)
        b = s.input(b_np, requires_grad=True)
        m = s.input(m_np, requires_grad=True)
        loss = f(a, b, m)
        ref_val, ref = jax.value_and_grad(f, argnums=(0, 1, 2))(jnp.asarray(a_np), jnp.asarray(b_np), jnp.asarray(m_np))
        close(loss.value, ref_val)
        g = s.backward(loss)
        close(g[a], ref[0])
        close(g[b], ref[1])
        close(g[m], ref[2])


# =========================================================================== handle checks


class TestHandleChecks:
    def test_stale_message_exact(self):
        s = tfl.Session()
        x = s.input(jnp.ones(3))
        s.reset()
        with pytest.raises(TapeError) as ei:
            _ = x + 1.0
        assert STALE_MSG in str(ei.value)

    def test_foreign_message(self):
        a, b = tfl.Session(), tfl.Session()
        x = a.input(jnp.ones(3))
        y = b.input(jnp.ones(3))
        with pytest.raises(TapeError) as ei:
            _ = y + x
        assert FOREIGN_MSG in str(ei.value)

    def test_mismatch_reported_before_stale(self):
        a, b = tfl.Session(), tfl.Session()
        x = a.input(jnp.ones(3))
        a.reset()  # x is now both foreign to b and stale in a
        b.reset()  # and its generation differs from b's too
        y = b.input(jnp.ones(3))
        with pytest.raises(TapeError) as ei:
            _ = y * x
        assert FOREIGN_MSG in str(ei.value)
        assert "stale" not in str(ei.value)
        with pytest.raises(TapeError, match=FOREIGN_MSG):
            b.detach(x)
        with pytest.raises(TapeError, match=FOREIGN_MSG):
            b.backward(x)

    def test_operands_checked_left_to_right(self):
        a, b = tfl.Session(), tfl.Session()
        stale = a.input(jnp.ones(3))
        a.reset()
        live = a.input(jnp.ones(3))
        mask = a.input(np.array([True, False, True]))
        foreign = b.input(jnp.ones(3))
        with pytest.raises(TapeError, match=FOREIGN_MSG):
            tfl.where(mask, foreign, stale)
        with pytest.raises(TapeError, match="stale tensor handle"):
            tfl.where(mask, stale, foreign)
        with pytest.raises(TapeError, match="stale tensor handle"):
            tfl.concat([live, stale, foreign])
        with pytest.raises(TapeError, match=FOREIGN_MSG):
            tfl.concat([live, foreign, stale])
        # the first tensor operand picks the session: a stale first handle is stale in its own session
        with pytest.raises(TapeError, match="stale tensor handle"):
            tfl.add(stale, live)

    def test_ownerless_handle_rejected(self):
        s = tfl.Session()
        x = s.input(jnp.ones(()))
        bad = tfl.Tensor(None, 0, 0, 0, (), np.dtype("float32"))
        before = _state(s)
        with pytest.raises(TapeError):
            _ = x + bad
        with pytest.raises(TapeError):
            _ = bad + x
        with pytest.raises(TapeError):
            tfl.relu(bad)
        with pytest.raises(TapeError):
            s.detach(bad)
        with pytest.raises(TapeError):
            s.backward(bad)
        with pytest.raises(TapeError):
            s.input(bad)
        with pytest.raises(TapeError):
            bad.value
        with pytest.raises(TapeError):
            np.asarray(bad)
        _assert_unchanged(s, before)

    def test_stale_reads_raise(self):
        s = tfl.Session()
        x = s.input(jnp.ones((2, 2)))
        s.reset()
        for f in (
            lambda: x.value,
            lambda: np.asarray(x),
            lambda: float(x.sum()),
            lambda: x.T,
            lambda: x[0],
            lambda: x.sum(),
            lambda: x.requires_grad,
            lambda: s.detach(x),
            lambda: s.input(x),
            lambda: s.backward(x),
        ):
            with pytest.raises(TapeError, match="stale tensor handle"):
                f()


# =========================================================================== last-recorded session


def test_param_only_op_records_on_the_session_that_recorded_last() -> None:
    w = tfl.Param(jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3), name="w")
    s = tfl.Session()  # no `with` block: not current
    x = s.input(jnp.ones((4, 3), jnp.float32))
    y = x @ w.T  # w.T has no Tensor operand: it records on s, the session x came from
    assert y.shape == (4, 2) and len(s.tape) == 4
    np.testing.assert_allclose(np.asarray(y.value), np.ones((4, 3)) @ np.asarray(w.value).T)
    other = tfl.Session()
    z = other.input(jnp.ones((4, 3), jnp.float32))  # `other` recorded last now
    with pytest.raises(tfl.TapeError, match="tensor handle belongs to a different session"):
        _ = x @ w.T  # w.T lands on `other`; mixing it with s's handle is reported
    assert len(s.tape) == 4  # nothing recorded on s by the rejected call
    del z


# =========================================================================== dispatch across threads


def _run_threads(*targets):
    """Run each target in its own thread; re-raise the first exception one of them raised."""
    errors: list[BaseException] = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as e:
                errors.append(e)

        return run

    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a worker thread did not finish"
    if errors:
        raise errors[0]


class TestDispatchAcrossThreads:
    def test_param_only_ops_in_another_thread_see_no_session(self):
        w = tfl.Param(jnp.arange(3.0), name="w")
        main = tfl.Session()
        _ = main.input(jnp.ones(3))  # `main` recorded last in this thread
        assert tfl.last_recorded_session() is main
        a_recorded, b_done = threading.Event(), threading.Event()
        box: dict = {}

        def thread_a():
            try:
                box["a_saw"] = (tfl.current_session(), tfl.last_recorded_session())
                with tfl.Session() as a:  # current and last-recorded in thread A while B runs
                    box["a"] = a
                    x = a.input(jnp.ones(3))
                    _ = x * w
                    _ = w * 2.0  # a Param-only op in thread A records on A's session
                    box["a_views"] = (tfl.current_session() is a, tfl.last_recorded_session() is a)
                    box["a_len"] = len(a.tape)
                    a_recorded.set()
                    assert b_done.wait(60), "thread B did not finish"
                    box["a_len_after_b"] = len(a.tape)
            finally:
                a_recorded.set()

        def thread_b():
            try:
                assert a_recorded.wait(60), "thread A did not record"
                box["b_saw"] = (tfl.current_session(), tfl.last_recorded_session())
                outcomes = []
                for op in (
                    lambda: w * 2.0,
                    lambda: 2.0 * w,
                    lambda: w.T,
                    lambda: w[0],
                    lambda: w.sum(),
                    lambda: tfl.relu(w),
                    lambda: tfl.apply("add", w, 1.0),
                ):
                    try:
                        got = op()
                    except TapeError as e:
                        outcomes.append(str(e))
                    else:
                        outcomes.append(f"recorded on owner {got.owner}")
                box["b_outcomes"] = outcomes
            finally:
                b_done.set()

        _run_threads(thread_a, thread_b)
        assert box["a_saw"] == (None, None)  # a new thread starts with no session of this one
        assert box["a_views"] == (True, True)
        assert box["b_saw"] == (None, None)  # nor of thread A's, current or last-recorded
        assert len(box["b_outcomes"]) == 7
        for outcome in box["b_outcomes"]:
            assert "no session to record on" in outcome
        assert box["a_len_after_b"] == box["a_len"]  # nothing landed on A's tape
        assert len(main.tape) == 1  # nor on this thread's
        assert tfl.last_recorded_session() is main  # thread A's recording did not move it here
        y = w * 2.0  # here the same op still records on `main`
        assert y.owner == main.owner and len(main.tape) == 4  # the constant 2.0, the leaf of w, the mul
        assert np.asarray(y).tolist() == [0.0, 2.0, 4.0]


# =========================================================================== Param operators


class TestParamOperators:
    def test_param_inherits_the_operator_set(self):
        ops_cls = tfl.Tensor.__mro__[1]
        assert ops_cls is TensorOps
        assert issubclass(tfl.Param, ops_cls) and tfl.Param.__mro__[1] is ops_cls
        assert not issubclass(tfl.Param, tfl.Tensor)
        assert "__mul__" not in vars(tfl.Param)
        assert tfl.Param.__mul__ is tapeflow._shell._tensor.TensorOps.__mul__
        assert tfl.Tensor.__mul__ is tapeflow._shell._tensor.TensorOps.__mul__
        skip = {"__module__", "__qualname__", "__doc__", "__slots__", "__firstlineno__", "__static_attributes__"}
        operators = sorted(set(vars(TensorOps)) - skip)
        expected = {"__add__", "__rmul__", "__matmul__", "__pow__", "__neg__", "__lt__", "__getitem__", "T", "sum"}
        assert expected <= set(operators)
        for name in operators:
            # no operator is set on Param (by setattr or by a definition): every one is TensorOps' own
            assert name not in vars(tfl.Param), f"Param defines {name} itself"
            assert getattr(tfl.Param, name) is getattr(TensorOps, name), name

    def test_param_operators_record_on_the_current_session(self):
        w_np = np.arange(6.0).reshape(2, 3)
        x_np = np.full((2, 3), 2.0)
        w = tfl.Param(jnp.asarray(w_np), name="w")
        with tfl.Session() as s:
            x = s.input(x_np)
            cases = [
                (lambda: w * x, "mul", w_np * x_np),
                (lambda: 2.0 * w, "mul", 2.0 * w_np),
                (lambda: w.T, "transpose", w_np.T),
                (lambda: w[0], "index", w_np[0]),
                (lambda: w.sum(), "sum", w_np.sum()),
                (lambda: w @ x_np.T, "matmul", w_np @ x_np.T),
                (lambda: -w, "neg", -w_np),
            ]
            outs = []
            for make, op, ref in cases:
                n = len(s.tape)
                y = make()
                assert isinstance(y, tfl.Tensor) and y.session is s and y.owner == s.owner, op
                nd = s.tape[y.id]
                assert nd.op == op and y.id == len(s.tape) - 1
                close(y.value, ref)
                # the Param operand is a fresh leaf of this op, holding w's value and registered for w
                (w_leaf,) = [i for i in nd.parents if i >= n and i in s._params_by_leaf]
                assert s._params_by_leaf[w_leaf] is w
                assert s.tape[w_leaf].op is None and s.tape[w_leaf].requires_grad
                close(s.tape[w_leaf].value, w_np)
                outs.append(y)
            (grp,) = s.parameter_groups()
            assert len(grp.leaves) == len(cases) and grp.storage is w.storage
            loss = outs[0].sum()
            for y in outs[1:]:
                loss = loss + y.sum()

            def f(W):
                y = (W * x_np).sum() + (2.0 * W).sum() + W.T.sum() + W[0].sum() + W.sum()
                return y + (W @ x_np.T).sum() - W.sum()

            close(loss.value, f(w_np))
            g = s.backward(loss)
            close(g[w], jax.grad(f)(jnp.asarray(w_np)))


class TestIteration:
    def test_iterating_a_tensor_yields_rows_and_records_only_them(self):
        with tfl.Session() as s:
            x = s.input(jnp.arange(6.0).reshape(3, 2))
            n0 = len(s.tape)
            rows = list(x)
            assert [r.shape for r in rows] == [(2,)] * 3
            assert [r.value.tolist() for r in rows] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
            assert len(s.tape) == n0 + 3  # one index op per row, nothing past the end

    def test_iterating_a_param_differentiates_each_row(self):
        w = tfl.Param(jnp.arange(4.0).reshape(2, 2))
        with tfl.Session() as s:
            a, b = w
            g = s.backward((a * 2.0).sum() + (b * 3.0).sum())
            np.testing.assert_allclose(np.asarray(g[w]), [[2.0, 2.0], [3.0, 3.0]])

    def test_iterating_a_scalar_is_a_type_error(self):
        with tfl.Session() as s:
            with pytest.raises(TypeError, match="0-d"):
                iter(s.input(jnp.array(1.0)))


def test_int_of_a_tensor_is_exact_for_64_bit_integers():
    """int(t) reads the integer itself: 2**53 + 1 does not round through a float (issue 21, low)."""
    with jax.enable_x64(True):
        s = tfl.Session()
        big = 2**53 + 1
        assert int(s.input(np.array(big, np.int64))) == big
        assert int(s.input(np.array(-7.9, np.float64))) == -7  # floats still truncate toward zero, as int() does
