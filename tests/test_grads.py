"""Grads: lookup by Param / Storage / Tensor / node id, parameter groups, tied sums in leaf
order, release / consume and the context manager.

Split from ``test_session.py`` along ``tapeflow/_grads.py``. Gradients are checked
against ``jax.grad`` of an equivalent pure function.
"""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import _arr, close

import tapeflow as tfl
from tapeflow import TapeError
from tapeflow._shell._grads import sum_in_leaf_order

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
            refs = [weakref.ref(a) for a in g.by_leaf.values()]
            assert not gx.is_deleted() and not gw.is_deleted()
        assert g.released
        # released: arrays the user kept stay valid, the rest is freed
        assert not gx.is_deleted() and not gw.is_deleted()
        del gx, gw
        gc.collect()
        assert refs and all(r() is None for r in refs)
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
                gw = weakref.ref(grads[w])
                raise RuntimeError("boom")
        assert grads is not None and grads.released
        gc.collect()
        assert gw() is None

    def test_shared_sum_released_too(self):
        w = tfl.Param(_arr((3,), 94))
        s = tfl.Session()
        loss = (s.use(w) * w).sum() + (s.use(w) * 2.0).sum()
        with s.backward(loss) as g:
            total = g[w]
            parts = [g[i] for i in g.groups[0].leaves]
            assert len(parts) == 3
            close(total, parts[0] + parts[1] + parts[2])
            refs = [weakref.ref(a) for a in [total, *parts]]
            del total, parts
        gc.collect()
        assert all(r() is None for r in refs)  # the cached sum is released with the parts

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


# =========================================================================== parameter gradients


class TestParams:
    """Gradients of Params: snapshots summed per storage, tied weights, groups (leaves: test_session.py)."""

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


# =========================================================================== lookup, tied sums, consume


class TestGradsLookup:
    def test_lookup_by_param_storage_tensor_and_id(self):
        w_np, x_np = _arr((3,), 95), _arr((3,), 96)
        w, unused = tfl.Param(w_np, name="w"), tfl.Param(_arr((3,), 97), name="unused")
        s = tfl.Session()
        x = s.input(x_np, requires_grad=True)
        leaf = s.use(w)
        g = s.backward((leaf * x).sum())
        assert g[w] is g[w.storage] is g[tfl.tie(w)] is g[leaf] is g[leaf.id] is g[np.int64(leaf.id)]
        close(g[w], x_np)
        close(g[x], w_np)
        assert g.group_of(w) is g.group_of(w.storage) is g.groups[0]
        assert g.group_of(unused) is None and g.group_of(unused.storage) is None
        assert g.storage_gradients([unused.storage, w.storage]) == [None, g[w]]
        ((param, grad),) = g.params()
        assert param is w and grad is g[w]
        for missing in (unused, unused.storage, "w", 10**6, x.id + 1000):
            assert missing not in g and g.get(missing) is None
            with pytest.raises(KeyError):
                g[missing]
        other = tfl.Session().input(x_np, requires_grad=True)  # same id, different session
        assert other.id == x.id
        with pytest.raises(KeyError, match="does not belong"):
            g[other]

    def test_tied_sum_is_in_leaf_order_and_shared_by_every_lookup(self):
        w = tfl.Param(_arr((4,), 98))
        t = tfl.tie(w, name="t")
        s = tfl.Session()
        x = s.input(_arr((4,), 99))
        loss = (s.use(w) * x).sum() + (tfl.tanh(t) * x).sum() + (w * w).sum()
        g = s.backward(loss)
        (grp,) = g.groups
        assert grp.shared and grp.leaves == tuple(sorted(grp.leaves)) and len(grp.leaves) == 4
        parts = [g[i] for i in grp.leaves]
        total = g[w]
        expected = parts[0]
        for p in parts[1:]:
            expected = expected + p  # left to right, in recording order
        assert np.array_equal(np.asarray(total), np.asarray(expected))
        assert np.array_equal(np.asarray(total), np.asarray(sum_in_leaf_order(parts)))
        # one cached sum: the Param, its tie, its storage, the optimizer's path and storage_gradients agree exactly
        assert g[t] is total and g[w.storage] is total and g.group_gradient(grp) is total
        assert g.storage_gradients([w.storage])[0] is total
        assert sum_in_leaf_order(parts[:1]) is parts[0]  # a singleton is handed through, not copied

    def test_consume_frees_groups_then_releases(self):
        p, q = tfl.Param(_arr((3,), 100)), tfl.Param(_arr((3,), 101))
        s = tfl.Session()
        x = s.input(_arr((3,), 102), requires_grad=True)
        loss = (p * x).sum() + (tfl.tie(q) * q * x).sum()
        g = s.backward(loss)
        gp = weakref.ref(g[p])
        gq, gx = weakref.ref(g[q]), weakref.ref(g[x])
        q_parts = [weakref.ref(g[i]) for i in g.group_of(q).leaves]
        kept = g[q]  # a gradient the user holds outlives consume and release
        g.consume([g.group_of(p)])  # one optimizer used p's gradient
        gc.collect()
        assert not g.released and gp() is None
        assert p not in g and g.get(p) is None
        assert gx() is not None and q in g
        g.consume([g.group_of(q)])  # every parameter group consumed: the whole object is released
        gc.collect()
        assert g.released
        assert all(r() is None for r in q_parts) and gx() is None
        assert gq() is kept and not kept.is_deleted()
        g.consume([g.groups[0]])  # consuming after release is a no-op
        g.release()
        assert not p.value.is_deleted() and not q.value.is_deleted() and not x.value.is_deleted()


def test_reading_a_consumed_gradient_says_it_was_consumed():
    import optax

    w = tfl.Param(jnp.ones(2))
    v = tfl.Param(jnp.ones(2))
    opt = tfl.Optimizer(optax.sgd(0.1), [w])
    with tfl.Session() as s:
        g = s.backward((w * v).sum())
        opt.step(g)  # consumes w's group only; v's gradient stays readable
        with pytest.raises(KeyError, match="consumed"):
            g[w]
        assert g[v].shape == (2,)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_whole_grads_reads_after_a_shared_step_say_a_gradient_was_consumed(lazy):
    """A Grads shared by two optimizers: after the first step nothing that reads every gradient is silently partial."""
    import optax

    from tapeflow._shell._grads import ConsumedGradientError

    w = tfl.Param(jnp.array([1.0, 2.0]), name="w")
    v = tfl.Param(jnp.array([3.0, 4.0, 5.0]), name="v")
    opt_w, opt_v = tfl.Optimizer(optax.sgd(0.1), [w]), tfl.Optimizer(optax.sgd(0.1), [v])
    with tfl.Session(lazy=lazy) as s:
        g = s.backward((w * w).sum() + (v * v).sum())
        full = float(g.global_norm())
        assert full == pytest.approx(float(np.linalg.norm([2.0, 4.0, 6.0, 8.0, 10.0])))
        opt_w.step(g)
        reads = {
            "Grads.global_norm()": g.global_norm,
            "Grads * number": lambda: g * 0.5,
            "Grads * number ": lambda: 0.5 * g,
            "Grads / number": lambda: g / 2,
            "Grads + Grads": lambda: g + g,
            "sum(grads)": lambda: sum([g]),
            "Grads.params()": g.params,
            "clip_grad_norm": lambda: tfl.clip_grad_norm(g, 1.0),
        }
        for what, read in reads.items():
            with pytest.raises(ConsumedGradientError, match="Param 'w' was consumed") as e:
                read()
            assert isinstance(e.value, TapeError) and isinstance(e.value, KeyError), what
            assert "before the first optimizer steps" in str(e.value), what
        with pytest.raises(KeyError, match="consumed"):
            g[w]
        want = np.asarray(v.value) - 0.1 * 2 * np.asarray(v.value)
        opt_v.step(g)  # the other optimizer still steps from its own entries
        np.testing.assert_allclose(np.asarray(v.value), want)


def test_step_and_release_never_delete_an_array_the_user_kept():
    """Issue 10, item 6: opt.step releases only what it consumed; release drops, never deletes, kept arrays."""
    import optax

    w = tfl.Param(jnp.array([1.0, 2.0]))
    opt = tfl.Optimizer(optax.sgd(0.5), [w])
    with tfl.Session() as s:
        x = s.input(jnp.array([3.0, 4.0]), requires_grad=True)
        g = s.backward((w * x).sum())
        gx = g[x]  # a gradient for an input, taken out before the step
        opt.step(g)
    assert not gx.is_deleted() and np.asarray(gx).tolist() == [1.0, 2.0]

    p = tfl.Param(jnp.zeros(2))
    with tfl.Session() as s:
        g = s.backward((p * 3.0).sum())
        p.value = g[p]  # the gradient becomes a parameter value
        g.release()
    assert not p.value.is_deleted() and np.asarray(p.value).tolist() == [3.0, 3.0]
