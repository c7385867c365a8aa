"""The Session shell: handles, parameters, randomness, inference, gradients, reset, devices, rationals.

Gradients are checked against ``jax.grad`` of an equivalent pure function (an
oracle that never touches tapeflow) or, for exact rationals, against a backward
pass written out by hand with NumPy object arrays of ``Fraction``.
"""

from __future__ import annotations

import gc
import weakref
import threading
import warnings
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapeflow as tfl
from tapeflow import TapeError

RTOL = 1e-10
ATOL = 1e-12

STALE_MSG = (
    "stale tensor handle from generation 0; current generation is 1 "
    "(Session.reset() invalidates handles recorded before it)"
)
FOREIGN_MSG = "tensor handle belongs to a different session"


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _arr(shape, seed=0):
    return jnp.asarray(_rng(seed).standard_normal(shape))


def close(a, b, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def _state(s: tfl.Session):
    """Everything a rejected call must leave unchanged."""
    return (
        s.tape,
        len(s.tape),
        s.rng_counter,
        s.generation,
        dict(tfl.kernel_cache_info()),
        [(g.id, g.leaves, g.storage) for g in s.parameter_groups()],
        dict(s._params_by_leaf),
        list(s.selected_backends),
    )


def _assert_unchanged(s, before):
    after = _state(s)
    assert after[0] is before[0], "the tape object was replaced by a rejected call"
    assert after[1:] == before[1:]


# =========================================================================== session fields


class TestSessionFields:
    def test_defaults(self):
        s = tfl.Session()
        assert s.generation == 0
        assert s.rng_counter == 0
        assert s.grad_enabled is True
        assert isinstance(s.device, jax.Device)
        assert s.device == jax.devices()[0]
        assert isinstance(s.tape, tfl.Tape) and len(s.tape) == 0
        assert s.selected_backends == []
        assert isinstance(s.owner, int)

    def test_owner_is_unique_and_kept_across_reset(self):
        a, b = tfl.Session(), tfl.Session()
        assert a.owner != b.owner
        o = a.owner
        a.reset()
        a.reset()
        assert a.owner == o and a.generation == 2

    def test_owner_counter_thread_safe(self):
        owners: list[int] = []
        lock = threading.Lock()
        barrier = threading.Barrier(8)

        def work():
            barrier.wait()
            got = [tfl.Session().owner for _ in range(100)]
            with lock:
                owners.extend(got)

        ts = [threading.Thread(target=work) for _ in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert len(owners) == 800
        assert len(set(owners)) == 800

    def test_grad_enabled_and_device_fields(self):
        s = tfl.Session(device="cpu", seed=7, grad_enabled=False)
        assert s.grad_enabled is False
        assert s.device.platform == "cpu"
        assert s.seed == 7

    def test_tape_is_replaced_per_op(self):
        s = tfl.Session()
        t0 = s.tape
        x = s.input(jnp.ones(3))
        t1 = s.tape
        assert t1 is not t0 and len(t0) == 0 and len(t1) == 1
        y = x + x
        assert len(s.tape) == 2 and s.tape[y.id].op == "add"

    def test_selected_backends_first_use_order(self):
        s = tfl.Session()
        x = s.input(_arr((2, 3)))
        w = s.input(_arr((3, 4), 1))
        h = tfl.relu(x @ w)
        h = tfl.relu(h @ s.input(_arr((4, 4), 2)))  # repeats: no new entries
        _ = (h * h).sum()
        names = [n for n, _ in s.selected_backends]
        assert names == ["matmul", "relu", "mul", "sum"]
        assert all(k == f"xla:{s.device.platform}" for _, k in s.selected_backends)
        s.reset()
        assert [n for n, _ in s.selected_backends] == names  # the audit survives reset
        y = s.input(jnp.ones(2))
        _ = tfl.exp(y) + y
        assert [n for n, _ in s.selected_backends] == names + ["exp", "add"]

    def test_show_backend_prints_once_per_op(self, capsys):
        s = tfl.Session(show_backend=True)
        x = s.input(jnp.ones((2, 2)))
        for _ in range(3):
            _ = tfl.relu(x @ x)
        s.reset()
        x = s.input(jnp.ones((2, 2)))
        _ = tfl.relu(x @ x)
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert sum("matmul" in ln for ln in lines) == 1
        assert sum("relu" in ln for ln in lines) == 1
        assert len(lines) == 2
        assert lines[0].index("matmul") >= 0 and "cpu" in lines[0]

    def test_show_backend_off_prints_nothing(self, capsys):
        s = tfl.Session()
        x = s.input(jnp.ones((2, 2)))
        _ = tfl.relu(x @ x)
        captured = capsys.readouterr()
        assert captured.err == "" and captured.out == ""


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
        assert x.ndim == 2 and x.size == 6 and len(x) == 2
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
        close((b ** 2.0).value, b_np**2.0)
        close((b ** a).value, b_np**a_np)
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
        assert np.array_equal(x.transpose().value, x_np.transpose())
        assert np.array_equal(x.transpose(1, 0, 2).value, x_np.transpose(1, 0, 2))
        assert np.array_equal(x.transpose((2, 0, 1)).value, x_np.transpose(2, 0, 1))
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
        close(x.max(axis=0).value, x_np.max(axis=0))

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
        for f in (lambda: x.value, lambda: np.asarray(x), lambda: float(x.sum()), lambda: x.T, lambda: x[0],
                  lambda: x.sum(), lambda: x.requires_grad, lambda: s.detach(x), lambda: s.input(x),
                  lambda: s.backward(x)):
            with pytest.raises(TapeError, match="stale tensor handle"):
                f()

    @pytest.mark.parametrize("kind", ["stale", "foreign", "ownerless"])
    def test_rejected_call_changes_nothing(self, kind):
        s = tfl.Session(seed=3)
        if kind == "stale":
            bad = s.input(_arr((7, 11)))
            s.reset()
        elif kind == "foreign":
            bad = tfl.Session().input(_arr((7, 11)))
        else:
            bad = tfl.Tensor(None, 0, 0, 0, (7, 11), np.dtype("float64"))
        w = tfl.Param(_arr((7, 11), 9), name="w")
        good = s.input(_arr((7, 11), 10))
        _ = s.rand_uniform((2,))
        _ = s.use(w)
        tfl.clear_kernel_caches()
        before = _state(s)
        mask = good > 0.0
        before = _state(s)
        calls = [
            lambda: good + bad,
            lambda: good - bad,
            lambda: tfl.matmul(good, bad),
            lambda: tfl.where(mask, w, bad),  # a Param operand must not be recorded nor registered
            lambda: tfl.where(mask, bad, w),
            lambda: tfl.concat([good, w, bad], axis=1),
            lambda: tfl.apply("sub", good, w, bad),
            lambda: s.detach(bad),
            lambda: s.input(bad),
            lambda: s.backward(bad),
        ]
        if kind != "foreign":
            # a foreign handle in first position simply records on its own session
            calls += [
                lambda: w * bad,
                lambda: tfl.matmul(w, bad),
                lambda: tfl.dropout(bad, 0.5),
                lambda: bad.sum(),
                lambda: bad[0],
            ]
        for c in calls:
            with pytest.raises(TapeError):
                c()
            _assert_unchanged(s, before)

    def test_dropout_on_stale_handle_does_not_advance_rng(self):
        s = tfl.Session()
        x = s.input(jnp.ones(4))
        s.reset()
        with pytest.raises(TapeError, match="stale"):
            tfl.dropout(x, 0.5)
        assert s.rng_counter == 0

    def test_shape_check_failure_keeps_the_very_same_tape(self):
        s = tfl.Session()
        a = s.input(jnp.ones((2, 3)))
        b = s.input(jnp.ones((4, 5)))
        w = tfl.Param(jnp.ones((4, 4)))
        expected = tfl.record(s.tape, "matmul", (a.id, b.id))[1].error
        before = _state(s)
        with pytest.raises(TapeError) as ei:
            _ = a @ b
        assert str(ei.value) == expected
        _assert_unchanged(s, before)
        expected = tfl.record(s.tape, "add", (a.id, b.id))[1].error
        with pytest.raises(TapeError) as ei:
            _ = a + b
        assert str(ei.value) == expected
        _assert_unchanged(s, before)
        # a Param operand of a rejected op is not recorded nor registered
        with pytest.raises(TapeError, match="matmul"):
            _ = a @ w
        _assert_unchanged(s, before)
        with pytest.raises(TapeError):
            _ = a.reshape(7)
        _assert_unchanged(s, before)
        with pytest.raises(TapeError):
            _ = a[5]
        _assert_unchanged(s, before)


# =========================================================================== parameters


class TestParams:
    def test_storage_identity_and_tie(self):
        w = tfl.Param(jnp.ones((2, 2)), name="w")
        t = tfl.tie(w, name="t")
        v = tfl.Param(jnp.ones((2, 2)), name="w")
        assert t.storage is w.storage
        assert v.storage is not w.storage
        assert t.name == "t" and w.name == "w"
        w.value = jnp.full((2, 2), 5.0)
        assert np.array_equal(t.value, np.full((2, 2), 5.0))  # shared cells
        assert np.array_equal(v.value, np.ones((2, 2)))
        frozen = tfl.tie(w, trainable=False)
        assert frozen.storage is w.storage and not frozen.trainable and w.trainable

    def test_canonical_indices(self):
        p = tfl.Param(jnp.ones(2), name="p")
        q = tfl.Param(jnp.ones(2), name="p")  # equal value and name: still distinct
        assert tfl.canonical_indices([p, q, p]) == [0, 1, 0]
        assert tfl.canonical_indices([p, None, tfl.tie(p)]) == [0, None, 0]
        assert tfl.canonical_indices([p.storage, q.storage, tfl.tie(q).storage, p]) == [0, 1, 1, 0]
        assert tfl.canonical_indices([]) == []
        with pytest.raises(TypeError):
            tfl.canonical_indices([p, "p"])

    def test_write_keeps_shape_and_dtype(self):
        p = tfl.Param(jnp.ones((2, 2)))
        with pytest.raises(ValueError):
            p.value = jnp.ones((3,))
        with pytest.raises(ValueError):
            p.value = jnp.ones((2, 2), jnp.int32)

    def test_every_use_records_a_new_leaf_with_the_observed_value(self):
        p = tfl.Param(jnp.array([1.0, 2.0]), name="p")
        s = tfl.Session()
        a = s.use(p)
        b = s.input(jnp.ones(2)) * p  # a use through an operator records a leaf too
        b_leaf = s.tape[b.id].parents[1]
        assert s.tape[b_leaf].op is None and b_leaf not in (a.id,)
        p.value = jnp.array([10.0, 20.0])
        c = s.use(p)
        assert len({a.id, b_leaf, c.id}) == 3
        assert s.parameter_groups()[0].leaves == (a.id, b_leaf, c.id)
        assert np.asarray(a).tolist() == [1.0, 2.0]
        assert np.asarray(c).tolist() == [10.0, 20.0]
        p.value = jnp.array([-1.0, -1.0])
        assert np.asarray(a).tolist() == [1.0, 2.0]  # recorded leaves never change
        assert np.asarray(s.tape[b_leaf].value).tolist() == [1.0, 2.0]
        assert np.asarray(c).tolist() == [10.0, 20.0]
        assert s.tape[a.id].requires_grad and s.tape[c.id].requires_grad

    def test_snapshot_gradients_use_recorded_values(self):
        v1 = _arr((3,), 11)
        v2 = _arr((3,), 12)
        x_np = _arr((3,), 13)
        p = tfl.Param(v1, name="p")
        s = tfl.Session()
        x = s.input(x_np)
        first = s.use(p)
        y1 = (first * first * x).sum()
        p.value = v2
        second = s.use(p)
        y2 = (tfl.tanh(second) * first).sum()
        loss = y1 + y2
        assert not np.array_equal(np.asarray(first), np.asarray(second))

        def f(w1, w2):
            return (w1 * w1 * x_np).sum() + (jnp.tanh(w2) * w1).sum()

        ref_val = f(v1, v2)
        g1, g2 = jax.grad(f, argnums=(0, 1))(v1, v2)
        close(loss.value, ref_val)
        g = s.backward(loss)
        close(g[first], g1)
        close(g[second], g2)
        close(g[p], g1 + g2)  # summed over the leaves of the storage
        (grp,) = g.groups
        assert grp.leaves == (first.id, second.id) and grp.shared and grp.storage is p.storage

    def test_tied_parameter_model_matches_single_weight_oracle(self):
        x_np = _arr((4, 3), 20)
        w_np = _arr((3, 5), 21)
        w = tfl.Param(w_np, name="w")
        w2 = tfl.tie(w, name="w_out")

        def f(W):
            return jnp.mean((jax.nn.relu(x_np @ W) @ W.T) ** 2)

        def f2(W1, W2):
            return jnp.mean((jax.nn.relu(x_np @ W1) @ W2.T) ** 2)

        with tfl.Session() as s:
            x = s.input(x_np)
            h = tfl.relu(x @ w)
            y = h @ w2.T
            loss = (y * y).mean()
            close(loss.value, f(w_np))
            grads = s.backward(loss)
            close(grads[w], jax.grad(f)(w_np))
            assert grads[w2] is grads[w]
            (grp,) = grads.groups
            assert grp.shared and len(grp.leaves) == 2 and grp.storage is w.storage
            g1, g2 = jax.grad(f2, argnums=(0, 1))(w_np, w_np)
            close(grads[grp.leaves[0]], g1)
            close(grads[grp.leaves[1]], g2)
            # grads[w] is the sum over both uses, not just one of them
            assert not np.allclose(np.asarray(grads[w]), np.asarray(g1))
            assert not np.allclose(np.asarray(grads[w]), np.asarray(g2))

    def test_separate_equal_params_never_alias(self):
        v = _arr((3,), 30)
        p = tfl.Param(v, name="same")
        q = tfl.Param(v, name="same")
        s = tfl.Session()
        with s:
            loss = (p * p).sum() + (q * 3.0).sum()
            g = s.backward(loss)
        close(g[p], 2 * v)
        close(g[q], 3.0 * jnp.ones(3))
        assert len(g.groups) == 2

    def test_singleton_group_is_the_leaf_array(self):
        p = tfl.Param(_arr((3,), 31))
        s = tfl.Session()
        leaf = s.use(p)
        g = s.backward((leaf * leaf).sum())
        assert g[p] is g[leaf.id]
        assert g[p] is g[leaf]
        assert g.params()[0][0] is p and g.params()[0][1] is g[p]

    def test_frozen_param_has_no_gradient(self):
        p = tfl.Param(_arr((3,), 32), trainable=False)
        q = tfl.Param(_arr((3,), 33))
        s = tfl.Session()
        a = s.use(p)
        assert a.requires_grad is False
        g = s.backward((a * q).sum())
        assert q in g and p not in g
        assert g.get(p) is None
        with pytest.raises(KeyError):
            g[p]

    def test_reset_in_one_session_keeps_the_other_sessions_snapshot(self):
        v = _arr((2, 3), 40)
        p = tfl.Param(v, name="shared")
        s1, s2 = tfl.Session(), tfl.Session()
        x1 = s1.input(_arr((4, 2), 41))
        x2 = s2.input(_arr((4, 2), 42))
        y1 = tfl.relu(x1 @ p)
        y2 = tfl.relu(x2 @ p)
        loss2 = (y2 * y2).sum()
        _ = s1.backward((y1 * y1).sum())
        s1.reset()
        # s2's snapshot of p, its intermediates and its gradients are unaffected
        p_leaf = s2.tape[y2.id].parents[0]
        p_leaf = s2.tape[p_leaf].parents[1]
        close(s2.tape[p_leaf].value, v)
        close(y2.value, jax.nn.relu(x2.value @ v))
        g = s2.backward(loss2)
        close(g[p], jax.grad(lambda W: jnp.sum(jax.nn.relu(x2.value @ W) ** 2))(v))
        close(p.value, v)
        # and the other way around
        s2.reset()
        x1 = s1.input(_arr((4, 2), 41))
        close((x1 @ p).value, x1.value @ v)

    def test_param_set_from_op_output_survives_reset(self):
        p = tfl.Param(_arr((3,), 50))
        s = tfl.Session()
        y = s.use(p) * 2.0
        g = s.backward(y.sum())
        new = y.value - 0.1 * g[p]
        expected = np.asarray(new)
        p.value = y.value  # the storage now references an op output
        s.reset()
        close(p.value, np.asarray(expected + 0.1 * 2.0))
        q = tfl.Param(_arr((3,), 51))
        y = s.use(q) * 2.0
        q.value = y.value
        s.reset()
        assert not q.value.is_deleted()
        close(q.value, 2.0 * _arr((3,), 51))


# =========================================================================== inputs


class TestInputs:
    def test_input_const_detach(self):
        x_np = _arr((3,), 60)
        s = tfl.Session()
        x = s.input(x_np, requires_grad=True)
        c = s.const(x_np)
        d = s.detach(x * 2.0)
        assert x.requires_grad and not c.requires_grad and not d.requires_grad
        assert s.tape[d.id].op is None
        close(d.value, 2 * x_np)
        loss = (x * c).sum() + (x * d).sum()
        g = s.backward(loss)
        # d is cut off: its dependence on x contributes nothing
        close(g[x], x_np + 2 * x_np)
        assert c.id not in g and d.id not in g
        y = s.input(x_np)
        assert not y.requires_grad

    def test_integer_and_boolean_inputs(self):
        table_np = _arr((5, 3), 61)
        labels_np = np.array([4, 0, 4, 2])
        mask_np = np.array([True, False, True])
        s = tfl.Session()
        table = s.input(table_np, requires_grad=True)
        labels = s.input(labels_np, requires_grad=True)  # integers never require grad
        mask = s.input(mask_np)
        assert np.issubdtype(labels.dtype, np.integer) and not labels.requires_grad
        assert mask.dtype == np.dtype(bool) and not mask.requires_grad
        rows = tfl.take(table, labels)
        picked = tfl.where(mask, rows, 0.0)
        loss = (picked * picked).sum() + table[labels].sum()

        def f(t):
            r = t[labels_np]
            return jnp.sum(jnp.where(mask_np, r, 0.0) ** 2) + r.sum()

        close(loss.value, f(table_np))
        g = s.backward(loss)
        close(g[table], jax.grad(f)(table_np))
        assert labels.id not in g and mask.id not in g

    def test_input_of_a_tensor_copies_its_value_as_a_leaf(self):
        s = tfl.Session()
        x = s.input(jnp.arange(3.0))
        y = s.input(x * 2.0)
        assert s.tape[y.id].op is None
        assert np.asarray(y).tolist() == [0.0, 2.0, 4.0]


# =========================================================================== randomness


class TestRandomness:
    def test_counter_advances_once_per_call(self):
        s = tfl.Session(seed=1)
        x = s.input(jnp.ones((4, 4)))
        assert s.rng_counter == 0
        s.rand_uniform((3,))
        assert s.rng_counter == 1
        s.normal((2, 2))
        assert s.rng_counter == 2
        s.bernoulli_mask((5,), 0.5)
        assert s.rng_counter == 3
        tfl.dropout(x, 0.25)
        assert s.rng_counter == 4
        tfl.dropout(x, 0.0)  # identity: no draw
        assert s.rng_counter == 4

    def test_counter_survives_reset_and_sessions_agree(self):
        a = tfl.Session(seed=5)
        b = tfl.Session(seed=5)
        ua = [np.asarray(a.rand_uniform((4,)))]
        a.reset()
        assert a.rng_counter == 1
        ua.append(np.asarray(a.normal((4,))))
        a.reset()
        ua.append(np.asarray(a.bernoulli_mask((64,), 0.3)))
        ub = [np.asarray(b.rand_uniform((4,))), np.asarray(b.normal((4,))), np.asarray(b.bernoulli_mask((64,), 0.3))]
        for x, y in zip(ua, ub):
            assert np.array_equal(x, y)
        assert a.rng_counter == b.rng_counter == 3
        # a reset does not rewind: the next draw differs from the first
        assert not np.array_equal(np.asarray(a.rand_uniform((4,))), ua[0])

    def test_seed_matters_and_draws_differ(self):
        a = tfl.Session(seed=0)
        b = tfl.Session(seed=1)
        x0, x1 = np.asarray(a.rand_uniform((16,))), np.asarray(a.rand_uniform((16,)))
        y0 = np.asarray(b.rand_uniform((16,)))
        assert not np.array_equal(x0, x1)
        assert not np.array_equal(x0, y0)

    def test_distributions(self):
        s = tfl.Session(seed=2)
        u = s.rand_uniform((20000,), low=-2.0, high=3.0)
        arr = np.asarray(u)
        assert arr.min() >= -2.0 and arr.max() < 3.0
        assert abs(arr.mean() - 0.5) < 0.05
        n = np.asarray(s.normal((20000,)))
        assert abs(n.mean()) < 0.05 and abs(n.std() - 1.0) < 0.05
        m = s.bernoulli_mask((20000,), 0.3)
        assert m.dtype == np.dtype(bool)
        assert abs(np.asarray(m).mean() - 0.3) < 0.02
        for h in (u, m):
            assert not h.requires_grad and s.tape[h.id].op is None
        assert s.rand_uniform(5).shape == (5,)
        assert s.normal((2, 3), dtype=jnp.float32).dtype == np.dtype("float32")

    @pytest.mark.parametrize(
        "call",
        [
            lambda s: s.rand_uniform((2, -1)),
            lambda s: s.normal((2.5,)),
            lambda s: s.bernoulli_mask((3,), 1.5),
            lambda s: s.bernoulli_mask((-3,), 0.5),
            lambda s: tfl.dropout(s.input(jnp.ones(3)), 1.0),
            lambda s: tfl.dropout(s.input(jnp.ones(3)), -0.1),
            lambda s: tfl.dropout(s.input(np.arange(3)), 0.5),  # integer operand: rejected before drawing
            lambda s: tfl.dropout(s.input(np.array([True, False])), 0.5),
        ],
    )
    def test_rejected_draw_does_not_advance(self, call):
        s = tfl.Session(seed=3)
        s.rand_uniform((2,))
        n = len(s.tape)
        with pytest.raises((TapeError, ValueError, TypeError)):
            call(s)
        assert s.rng_counter == 1
        assert len(s.tape) <= n + 1  # at most the dropout operand's input leaf, no mask leaf
        ref = tfl.Session(seed=3)
        ref.rand_uniform((2,))
        assert np.array_equal(np.asarray(s.rand_uniform((3,))), np.asarray(ref.rand_uniform((3,))))

    def test_dropout_uses_the_session_mask_and_its_gradient(self):
        x_np = _arr((8, 8), 70) + 5.0
        a = tfl.Session(seed=9)
        b = tfl.Session(seed=9)
        a.rand_uniform((1,))
        b.rand_uniform((1,))
        x = a.input(x_np, requires_grad=True)
        y = tfl.dropout(x, 0.25)
        mask = np.asarray(b.bernoulli_mask((8, 8), 0.75))
        expect = np.where(mask, x_np / 0.75, 0.0)
        close(y.value, expect)
        assert 0 < mask.sum() < 64
        g = a.backward(y.sum())
        close(g[x], mask / 0.75)

    def test_dropout_inference_is_identity(self):
        s = tfl.Session(grad_enabled=False)
        x = s.input(jnp.ones(4))
        assert tfl.dropout(x, 0.5) is x
        s2 = tfl.Session()
        x2 = s2.input(jnp.ones(4))
        assert tfl.dropout(x2, 0.5, training=False) is x2
        assert s2.rng_counter == 0


# =========================================================================== inference


class TestInference:
    def test_values_readable_and_nothing_requires_grad(self):
        w_np = _arr((3, 2), 80)
        w = tfl.Param(w_np)
        s = tfl.Session(grad_enabled=False)
        x = s.input(_arr((4, 3), 81), requires_grad=True)
        leaf = s.use(w)
        y = tfl.relu(x @ w)
        assert not x.requires_grad and not leaf.requires_grad and not y.requires_grad
        close(y.value, jax.nn.relu(x.value @ w_np))
        assert all(not nd.requires_grad for nd in s.tape)
        assert s.parameter_groups() == []

    def test_vjp_cache_does_not_grow(self):
        tfl.clear_kernel_caches()
        s = tfl.Session(grad_enabled=False)
        w = tfl.Param(_arr((13, 7), 82))
        x = s.input(_arr((5, 13), 83), requires_grad=True)
        before = tfl.kernel_cache_info()["vjp"]
        y = tfl.tanh(x @ w) * 3.0
        z = (y - y.mean()).sum()
        assert float(z) == pytest.approx(float(np.asarray(y).sum() - np.asarray(y).mean() * 35))
        assert tfl.kernel_cache_info()["vjp"] == before
        assert tfl.kernel_cache_info()["fwd"] > 0

    def test_backward_raises_mentioning_inference(self):
        s = tfl.Session(grad_enabled=False)
        x = s.input(jnp.ones(3), requires_grad=True)
        loss = (x * x).sum()
        before = _state(s)
        with pytest.raises(TapeError, match="inference"):
            s.backward(loss)
        _assert_unchanged(s, before)


# =========================================================================== gradients


class TestGrads:
    def _model(self):
        x_np = _arr((4, 3), 90)
        w_np = _arr((3, 2), 91)
        w = tfl.Param(w_np)
        s = tfl.Session()
        x = s.input(x_np, requires_grad=True)
        loss = (tfl.tanh(x @ w) ** 2.0).sum()
        return s, x, w, loss, x_np, w_np

    def test_raw_cotangents_and_param_grads(self):
        s, x, w, loss, x_np, w_np = self._model()

        def f(x_, w_):
            return jnp.sum(jnp.tanh(x_ @ w_) ** 2)

        gx, gw = jax.grad(f, argnums=(0, 1))(x_np, w_np)
        g = s.backward(loss)
        assert isinstance(g, tfl.Grads)
        assert set(g) == {x.id, g.groups[0].id}
        close(g[x], gx)
        close(g[x.id], gx)
        close(g[w], gw)
        assert len(g) == 2

    def test_explicit_seed(self):
        s = tfl.Session()
        x_np = _arr((3,), 92)
        x = s.input(x_np, requires_grad=True)
        y = tfl.tanh(x)
        seed = jnp.asarray(_arr((3,), 93))
        g = s.backward(y, seed=seed)
        _, pull = jax.vjp(jnp.tanh, x_np)
        close(g[x], pull(seed)[0])
        with pytest.raises(TapeError):
            s.backward(y)  # non-scalar root without a seed
        with pytest.raises(TapeError):
            s.backward(y, seed=jnp.ones(4))
        g.release()
        assert not seed.is_deleted()  # a user-passed seed is never freed

    def test_context_manager_releases(self):
        s, x, w, loss, *_ = self._model()
        with s.backward(loss) as g:
            gx, gw = g[x], g[w]
            assert not gx.is_deleted() and not gw.is_deleted()
        assert g.released
        assert gx.is_deleted() and gw.is_deleted()
        with pytest.raises(TapeError, match="released"):
            g[x]
        with pytest.raises(TapeError, match="released"):
            g[w]
        with pytest.raises(TapeError, match="released"):
            g.params()
        with pytest.raises(TapeError, match="released"):
            list(g)  # iterating must not silently yield nothing
        with pytest.raises(TapeError, match="released"):
            dict(g.items())
        with pytest.raises(TapeError, match="released"):
            len(g)
        with pytest.raises(TapeError, match="released"):
            w in g
        g.release()  # twice is safe
        g.release()
        # parameters and leaves are untouched
        assert not w.value.is_deleted()
        assert not x.value.is_deleted()

    def test_context_manager_releases_on_exception(self):
        s, x, w, loss, *_ = self._model()
        grads = None
        with pytest.raises(RuntimeError):
            with s.backward(loss) as grads:
                gw = grads[w]
                raise RuntimeError("boom")
        assert grads is not None and grads.released
        assert gw.is_deleted()

    def test_shared_sum_released_too(self):
        w = tfl.Param(_arr((3,), 94))
        s = tfl.Session()
        loss = (s.use(w) * w).sum() + (s.use(w) * 2.0).sum()
        with s.backward(loss) as g:
            total = g[w]
            parts = [g[i] for i in g.groups[0].leaves]
            assert len(parts) == 3
            close(total, parts[0] + parts[1] + parts[2])
        assert total.is_deleted() and all(p.is_deleted() for p in parts)

    def test_backward_twice_same_result(self):
        s, x, w, loss, *_ = self._model()
        g1 = s.backward(loss)
        a = np.asarray(g1[w])
        g1.release()
        g2 = s.backward(loss)
        close(g2[w], a)

    def test_grads_key_from_other_generation(self):
        s, x, w, loss, *_ = self._model()
        g = s.backward(loss)
        s.reset()
        y = s.input(jnp.ones(3))
        with pytest.raises(KeyError):
            g[y]


# =========================================================================== reset


class TestReset:
    def test_reset_fields(self):
        s = tfl.Session(seed=4)
        owner = s.owner
        x = s.input(jnp.ones(3))
        _ = tfl.exp(x)
        s.rand_uniform((2,))
        audit = list(s.selected_backends)
        s.reset()
        assert len(s.tape) == 0
        assert s.generation == 1
        assert s.owner == owner
        assert s.rng_counter == 1
        assert s.selected_backends == audit
        assert s.parameter_groups() == []

    def test_reset_frees_only_what_the_tape_owns(self):
        user = jax.device_put(_arr((3, 3), 100), jax.devices()[0])
        user_np = np.asarray(user)
        const_arr = jax.device_put(_arr((3, 3), 101), jax.devices()[0])
        p = tfl.Param(_arr((3, 3), 102))
        p_val = p.value
        s = tfl.Session()
        x = s.input(user, requires_grad=True)
        y = tfl.relu(x @ p) * const_arr
        z = tfl.stop_gradient(y)
        r = z.reshape(9).reshape(3, 3)
        kept_value = r.value  # still referenced by the user: must survive
        loss = (y * y).sum()
        with s.backward(loss) as g:
            gp = np.asarray(g[p])
        # weak references only: the session owns what it recorded, the test keeps nothing alive
        op_refs = [weakref.ref(nd.value) for nd in s.tape if nd.op is not None]
        leaf_values = [nd.value for nd in s.tape if nd.op is None]
        s.reset()
        assert not user.is_deleted() and np.array_equal(np.asarray(user), user_np)
        assert not const_arr.is_deleted()
        assert not p.value.is_deleted() and p.value is p_val
        if p.storage.mirror is not None:
            assert not p.storage.mirror.is_deleted()
        assert all(not v.is_deleted() for v in leaf_values)
        assert not kept_value.is_deleted()
        alive = [ref() for ref in op_refs if ref() is not None]
        assert len(op_refs) == 8 and alive == [kept_value]  # every intermediate freed except the one kept
        # the params still work in a new recording
        x = s.input(user, requires_grad=True)
        loss = (tfl.relu(x @ p) * const_arr) ** 2.0
        with s.backward(loss.sum()) as g:
            close(g[p], gp)

    def test_reset_with_a_forked_tape_kept_frees_nothing(self):
        s = tfl.Session()
        x = s.input(jnp.ones(3))
        y = x * 2.0
        t_old = s.tape
        z = y + 1.0
        nodes = list(s.tape)
        del z
        s.reset()
        assert all(not nd.value.is_deleted() for nd in nodes)  # t_old still reads them
        assert np.asarray(t_old[y.id].value).tolist() == [2.0, 2.0, 2.0]

    def test_reset_keeps_a_tape_value_the_user_holds(self):
        s = tfl.Session()
        x = s.input(jnp.ones(3))
        y = tfl.exp(x) * 2.0
        kept = s.tape  # the current Tape value itself
        s.reset()
        assert not kept[y.id].value.is_deleted()
        close(kept[y.id].value, 2 * np.e * np.ones(3))
        assert all(not leaf_value.is_deleted() for leaf_value in jax.tree_util.tree_leaves(kept))

    def test_reset_keeps_values_another_session_recorded(self):
        a, b = tfl.Session(), tfl.Session()
        y = tfl.exp(a.input(jnp.ones(3)))
        z = b.input(y.value)  # b records a's intermediate as its own leaf
        del y
        a.reset()
        close(z.value, np.e * np.ones(3))
        close(tfl.log(z).value, np.ones(3))

    def test_live_arrays_stable_over_1000_cycles(self):
        w1 = tfl.Param(_arr((3, 4), 110) * 0.1)
        w2 = tfl.Param(_arr((4, 2), 111) * 0.1)
        x_np = np.asarray(_arr((5, 3), 112))
        s = tfl.Session()

        def cycle():
            x = s.input(x_np)
            h = tfl.relu(x @ w1)
            y = h @ w2
            loss = (y * y).mean()
            with s.backward(loss) as g:
                _ = g[w1], g[w2]
            s.reset()

        cycle()
        gc.collect()
        n1 = len(jax.live_arrays())
        for _ in range(999):
            cycle()
        gc.collect()
        assert len(jax.live_arrays()) == n1
        assert s.generation == 1000


# =========================================================================== devices


class TestDevices:
    def test_cpu_and_jax_device(self):
        dev = jax.devices("cpu")[0]
        for spec in ("cpu", "CPU", "cpu:0", dev):
            s = tfl.Session(device=spec)
            assert s.device == dev
            x = s.input(np.ones(3))
            y = x * 2.0
            assert x.value.devices() == {dev} and y.value.devices() == {dev}

    @pytest.mark.skipif(any(d.platform == "gpu" for d in jax.devices()), reason="a GPU is present")
    @pytest.mark.parametrize("spec", ["gpu", "cuda", "gpu:0"])
    def test_absent_gpu_raises_at_construction(self, spec):
        with pytest.raises(ValueError, match="gpu"):
            tfl.Session(device=spec)

    @pytest.mark.parametrize("spec", ["tpu0", "metal", "", "cpu:x", f"cpu:{len(jax.devices('cpu'))}"])
    def test_unknown_device_raises(self, spec):
        with pytest.raises(ValueError):
            tfl.Session(device=spec)

    def test_wrong_type_raises(self):
        with pytest.raises(TypeError):
            tfl.Session(device=0)


# =========================================================================== exact rationals


def _frac(a):
    out = np.empty(np.shape(a), dtype=object)
    for i, v in np.ndenumerate(np.asarray(a, dtype=object)):
        out[i] = Fraction(v)
    return out


def _is_fractions(a):
    return isinstance(a, np.ndarray) and a.dtype == object and all(isinstance(v, Fraction) for v in a.flat)


def _exact_equal(a, b):
    a, b = np.asarray(a, dtype=object), np.asarray(b, dtype=object)
    return a.shape == b.shape and all(u == v and type(u) is Fraction for u, v in zip(a.flat, b.flat))


class TestRationals:
    def test_fallback_warning_and_cpu_numpy(self):
        s = tfl.Session()
        with pytest.warns(tfl.RationalFallbackWarning):
            x = s.input(_frac([[Fraction(1, 3), Fraction(-2, 7)]]))
        assert x.dtype == np.dtype(object)
        y = x * x
        assert _is_fractions(y.value)
        assert ("mul", "numpy-exact (cpu)") in s.selected_backends

    def test_exact_forward_ops(self):
        a_v = _frac([[Fraction(1, 3), Fraction(-2, 7)], [Fraction(5, 2), Fraction(0)]])
        b_v = _frac([[Fraction(3, 4), Fraction(1, 9)], [Fraction(-1, 5), Fraction(7, 3)]])
        s = tfl.Session()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tfl.RationalFallbackWarning)
            a, b = s.input(a_v), s.input(b_v)
            cases = {
                "add": (a + b, a_v + b_v),
                "sub": (a - b, a_v - b_v),
                "mul": (a * b, a_v * b_v),
                "div": (a / b, a_v / b_v),
                "neg": (-a, -a_v),
                "matmul": (a @ b, a_v @ b_v),
                "sum": (a.sum(axis=0), a_v.sum(axis=0)),
                "mean": (a.mean(), a_v.sum() / 4),
                "relu": (tfl.relu(a), np.where(a_v > 0, a_v, Fraction(0))),
                "maximum": (tfl.maximum(a, b), np.where(a_v >= b_v, a_v, b_v)),
                "minimum": (tfl.minimum(a, b), np.where(a_v <= b_v, a_v, b_v)),
                "scalar": (a * 3 + 1, a_v * 3 + 1),
            }
        for name, (h, ref) in cases.items():
            assert _exact_equal(h.value, ref), name

    @pytest.mark.parametrize("fn", [tfl.exp, tfl.tanh, tfl.sqrt, tfl.sigmoid, lambda h: h.max(), lambda h: tfl.softmax(h)])
    def test_inexact_ops_give_a_clear_error(self, fn):
        s = tfl.Session()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tfl.RationalFallbackWarning)
            x = s.input(_frac([Fraction(1, 2), Fraction(3, 2)]))
        before = _state(s)
        with pytest.raises(TapeError, match="exact rational|object|rational"):
            fn(x)
        _assert_unchanged(s, before)

    def test_two_layer_mlp_gradients_are_exact(self):
        F = Fraction
        x_v = _frac([[F(1, 2), F(-1, 3), F(2)], [F(-3, 4), F(5, 6), F(1, 7)]])  # (2, 3)
        w1_v = _frac([[F(1, 5), F(-2, 3), F(3, 4), F(1)],
                      [F(-1, 2), F(1, 3), F(2, 7), F(-5, 4)],
                      [F(2, 9), F(1, 6), F(-1, 8), F(3, 5)]])  # (3, 4)
        b1_v = _frac([F(1, 10), F(-1, 20), F(1, 3), F(-2, 5)])  # (4,)
        w2_v = _frac([[F(1, 3), F(-1, 2)], [F(2, 5), F(1, 4)], [F(-3, 7), F(2, 3)], [F(1, 6), F(-1, 9)]])  # (4, 2)
        t_v = _frac([[F(1), F(0)], [F(0), F(1)]])  # (2, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tfl.RationalFallbackWarning)
            w1, b1, w2 = tfl.Param(w1_v, name="w1"), tfl.Param(b1_v, name="b1"), tfl.Param(w2_v, name="w2")
            s = tfl.Session()
            x = s.input(x_v)
            t = s.const(t_v)
            h = tfl.relu(x @ w1 + b1)
            out = h @ w2
            d = out - t
            loss = (d * d).mean()
            grads = s.backward(loss)

        # hand-written forward and backward, exact
        z1 = x_v @ w1_v + b1_v
        assert all(v != 0 for v in z1.flat)  # no kinks at relu's corner
        assert any(v < 0 for v in z1.flat) and any(v > 0 for v in z1.flat)
        h_v = np.where(z1 > 0, z1, F(0))
        out_v = h_v @ w2_v
        d_v = out_v - t_v
        n = d_v.size
        loss_v = (d_v * d_v).sum() / n
        g_d = 2 * d_v / n
        g_w2 = h_v.T @ g_d
        g_h = g_d @ w2_v.T
        g_z1 = np.where(z1 > 0, g_h, F(0))
        g_b1 = g_z1.sum(axis=0)
        g_w1 = x_v.T @ g_z1

        assert _is_fractions(loss.value) and loss.value.item() == loss_v
        assert isinstance(loss_v, Fraction)
        for p, ref in ((w1, g_w1), (b1, g_b1), (w2, g_w2)):
            got = grads[p]
            assert _is_fractions(got)
            assert _exact_equal(got, _frac(ref)), p.name
        assert x.id not in grads and t.id not in grads

    def test_rational_tied_weights_exact(self):
        F = Fraction
        w_v = _frac([[F(1, 2), F(-1, 3)], [F(2, 5), F(3, 4)]])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tfl.RationalFallbackWarning)
            w = tfl.Param(w_v)
            wt = tfl.tie(w)
            s = tfl.Session()
            y = (s.use(w) @ wt).sum()  # sum(W @ W)
            g = s.backward(y)
        ones = _frac(np.ones((2, 2), dtype=int))
        # d/dW sum(W1 @ W2) = ones @ W2.T + W1.T @ ones at W1 = W2 = W
        ref = ones @ w_v.T + w_v.T @ ones
        assert _exact_equal(g[w], ref)


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
