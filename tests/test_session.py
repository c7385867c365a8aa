"""The Session shell: fields, parameter leaves, inputs, inference, Session.apply failure
atomicity, reset and buffer release, devices.

Randomness is in ``test_session_random.py``, exact rationals in
``test_session_rationals.py``, handles and operators in ``test_tensor.py``, gradients
in ``test_grads.py``. Gradients are checked against ``jax.grad`` of an equivalent pure
function (an oracle that never touches tapeflow).
"""

from __future__ import annotations

import gc
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import _arr, _assert_unchanged, _state, close

import tapeflow as tfl
from tapeflow import TapeError

pytestmark = pytest.mark.usefixtures("lazy_mode")  # every test runs with eager and with lazy sessions

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


# =========================================================================== Session.apply failure atomicity


class TestHandleChecks:
    """A call rejected by Session.apply changes nothing (the handle error messages are in test_tensor.py)."""

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
        rows = tfl.numpy.take(table, labels, axis=0)
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


class TestMode:
    def test_each_session_states_its_mode(self):
        modes = []

        def loss(s):
            modes.append(s.mode)
            return tfl.sum(s.input(jnp.ones(2)))

        tfl.value_and_grad(loss)({})
        assert (tfl.Session(lazy=False).mode, tfl.Session(lazy=True).mode, modes) == ("eager", "lazy", ["traced"])

    @pytest.mark.parametrize("kw", [{"param_values": {}}, {"rng_key": jax.random.PRNGKey(0)}])
    def test_the_traced_sessions_internals_are_not_constructor_arguments(self, kw):
        with pytest.raises(TypeError, match="unexpected keyword"):
            tfl.Session(**kw)

    def test_a_recorded_backward_of_a_lazy_session_runs_its_hooks_ops_at_once_and_stays_lazy(self):
        from tapeflow._core._tape import PENDING

        s = tfl.Session(lazy=True)
        x = s.input(jnp.array(3.0), requires_grad=True)
        y = x * x
        seen = []
        s.register_hook(y, lambda g: seen.append(g * 2.0) or seen[-1])
        g = s.backward(y, create_graph=True)
        assert s.recording[seen[0].id].value is not PENDING  # recorded eagerly: the sweep read it
        assert float(g[x]) == 12.0
        z = x * 2.0  # after the backward, the session records lazily again
        assert s.mode == "lazy" and s.recording[z.id].value is PENDING


class TestBackwardWrt:
    def test_an_input_recorded_without_requires_grad_is_refused_not_zeros(self):
        """The sweep stops at nodes that need no gradient: ``wrt=[x]`` would read zeros though the loss uses x."""
        with tfl.Session() as s:
            x = s.input(jnp.array(3.0))
            y = x * 2.0  # interior, but computed from no leaf that requires grad
            z = s.input(jnp.array(2.0), requires_grad=True)
            h = z * 3.0
            loss = y * y + h * x
            n = len(s.tape)
            with pytest.raises(TapeError, match=r"wrt\[0\].*recorded without requires_grad.*requires_grad=True"):
                s.backward(loss, wrt=[x])
            with pytest.raises(TapeError, match=r"wrt\[1\].*depends on no leaf that requires grad"):
                s.backward(loss, wrt=[h, y])
            assert len(s.tape) == n
            # a requires-grad leaf and an interior node computed from one still work
            g = s.backward(loss, wrt=[z, h])
            assert (float(g[z]), float(g[h])) == (9.0, 3.0)
