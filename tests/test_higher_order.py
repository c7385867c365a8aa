"""Higher-order and intermediate gradients, hooks and no_grad, against jax.grad / jax.hessian / jax.jvp."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tapeflow as tfl
from tapeflow import TapeError

F32 = np.float32
RNG = np.random.default_rng(0)


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


# --------------------------------------------------------------------------- create_graph


@pytest.mark.parametrize(
    "name, tf_fn, jax_fn",
    [
        ("cube", lambda x: x * x * x, lambda x: x**3),
        ("tanh_sq", lambda x: tfl.tanh(x) ** 2.0, lambda x: jnp.tanh(x) ** 2),
        ("exp_sin", lambda x: tfl.exp(tfl.sin(x)), lambda x: jnp.exp(jnp.sin(x))),
        ("log1p_sq", lambda x: tfl.log(1.0 + x * x), lambda x: jnp.log(1.0 + x * x)),
        ("sigmoid", lambda x: tfl.sigmoid(x * 2.0), lambda x: jax.nn.sigmoid(x * 2.0)),
    ],
)
def test_second_derivative_of_scalar_functions_equals_jax(name, tf_fn, jax_fn):
    for x0 in (F32(0.3), F32(-1.2), F32(2.0)):
        with tfl.Session() as s:
            x = s.input(jnp.asarray(x0), requires_grad=True)
            g = s.backward(tf_fn(x), create_graph=True)[x]
            assert isinstance(g, tfl.Tensor) and g.requires_grad
            close(g.value, jax.grad(jax_fn)(x0))
            close(s.backward(g)[x], jax.grad(jax.grad(jax_fn))(x0), 1e-4)


def _mlp_pure(params, x):
    w1, b1, w2 = params
    return jnp.sum(jnp.tanh(x @ w1 + b1) @ w2) ** 2 / x.shape[0]


def _mlp_params():
    return [
        RNG.normal(size=(3, 4)).astype(F32) * 0.5,
        RNG.normal(size=(4,)).astype(F32) * 0.1,
        RNG.normal(size=(4, 2)).astype(F32) * 0.5,
    ]


@pytest.mark.parametrize("mode", ["reverse-over-reverse", "forward-over-reverse"])
def test_mlp_hessian_vector_products_equal_jax(mode):
    """create_graph records the gradient; a second backward of <g, v>, or s.jvp of g along v, gives H v."""
    vals = _mlp_params()
    x0 = RNG.normal(size=(5, 3)).astype(F32)
    vs = [RNG.normal(size=v.shape).astype(F32) for v in vals]
    params = [tfl.Param(jnp.asarray(v)) for v in vals]
    with tfl.Session() as s:
        x = s.input(jnp.asarray(x0))
        w1, b1, w2 = params
        loss = tfl.sum(tfl.tanh(x @ w1 + b1) @ w2) ** 2.0 / 5.0
        g = s.backward(loss, create_graph=True)
        if mode == "forward-over-reverse":
            got = [s.jvp(g[p], dict(zip(params, vs))) for p in params]
        else:
            hv = s.backward(sum(tfl.sum(g[p] * v) for p, v in zip(params, vs)))
            got = [hv[p] for p in params]
    want = jax.jvp(lambda ps: jax.grad(_mlp_pure)(ps, x0), ([jnp.asarray(v) for v in vals],), (vs,))[1]
    for a, b in zip(got, want):
        close(a, b, 1e-4)


def test_mlp_hessian_block_equals_jax_hessian():
    vals = _mlp_params()
    x0 = RNG.normal(size=(5, 3)).astype(F32)
    params = [tfl.Param(jnp.asarray(v)) for v in vals]
    # the full Hessian block of w2, one row per seed of the recorded gradient
    with tfl.Session() as s:
        x = s.input(jnp.asarray(x0))
        w2 = s.input(jnp.asarray(vals[2]), requires_grad=True)
        loss = tfl.sum(tfl.tanh(x @ params[0] + params[1]) @ w2) ** 2.0 / 5.0
        gw = s.backward(loss, create_graph=True)[w2]
        rows = [s.backward(gw, seed=jnp.eye(8, dtype=F32)[k].reshape(4, 2))[w2] for k in range(8)]
    hess = jax.hessian(lambda w: _mlp_pure([jnp.asarray(vals[0]), jnp.asarray(vals[1]), w], x0))(jnp.asarray(vals[2]))
    close(np.stack([np.asarray(r).reshape(-1) for r in rows]), np.asarray(hess).reshape(8, 8), 1e-4)


def test_create_graph_tied_param_gives_one_summed_second_order_result():
    w = tfl.Param(jnp.array(1.5, F32))
    w_out = tfl.tie(w)
    with tfl.Session() as s:
        g = s.backward(tfl.sin(w) * w_out * w_out, create_graph=True)  # f(w) = sin(w) w^2
        gw = g[w]
        assert isinstance(gw, tfl.Tensor) and len(g.groups) == 1 and len(g.groups[0].leaves) == 3
        first = gw.value
        second = s.backward(gw)[w]

    def f(v):
        return jnp.sin(v) * v * v

    close(first, jax.grad(f)(1.5))
    close(second, jax.grad(jax.grad(f))(1.5), 1e-4)


def test_create_graph_is_failure_atomic_and_grads_work_with_an_optimizer():
    w = tfl.Param(jnp.array(2.0, F32))
    opt = tfl.Optimizer(optax.sgd(0.1), [w])
    with tfl.Session() as s:
        loss = w * w
        before = s.tape
        with pytest.raises(TapeError, match="seed has shape"):
            s.backward(loss, seed=jnp.ones(3), create_graph=True)
        assert s.tape is before
        g = s.backward(loss, create_graph=True)
        opt.step(g)  # the optimizer reads the recorded gradients' values
    close(w.value, 2.0 - 0.1 * 4.0)


def test_gradient_penalty_training_equals_pure_jax():
    """A WGAN-GP style critic: ((||d D(x)/dx|| - 1)^2) trained for 5 steps, eager vs a pure-JAX reference."""
    vals = [RNG.normal(size=(2, 8)).astype(F32) * 0.5, np.zeros(8, F32), RNG.normal(size=(8, 1)).astype(F32) * 0.5]
    xs = [RNG.normal(size=(6, 2)).astype(F32) for _ in range(5)]

    def critic(ps, x):
        return jnp.tanh(x @ ps[0] + ps[1]) @ ps[2]

    def pure_loss(ps, x):
        gx = jax.grad(lambda xx: jnp.sum(critic(ps, xx)))(x)
        norm = jnp.sqrt(jnp.sum(gx * gx, axis=1) + 1e-12)
        return jnp.mean(critic(ps, x)) + 10.0 * jnp.mean((norm - 1.0) ** 2)

    ref = [jnp.asarray(v) for v in vals]
    tx = optax.adam(1e-2)
    st = tx.init(ref)
    for x in xs:
        g = jax.grad(pure_loss)(ref, x)
        upd, st = tx.update(g, st, ref)
        ref = optax.apply_updates(ref, upd)

    params = [tfl.Param(jnp.asarray(v)) for v in vals]
    opt = tfl.Optimizer(optax.adam(1e-2), params)
    for x in xs:
        with tfl.Session() as s:
            xin = s.input(jnp.asarray(x), requires_grad=True)
            out = tfl.tanh(xin @ params[0] + params[1]) @ params[2]
            gx = s.backward(tfl.sum(out), create_graph=True)[xin]
            norm = tfl.sqrt(tfl.sum(gx * gx, axis=1) + 1e-12)
            loss = tfl.mean(out) + 10.0 * tfl.mean((norm - 1.0) ** 2.0)
            opt.step(s.backward(loss))
    for p, r in zip(params, ref):
        close(p.value, r, 1e-4)


# --------------------------------------------------------------------------- wrt


def test_wrt_returns_gradients_of_interior_nodes():
    x0 = RNG.normal(size=(4,)).astype(F32)
    with tfl.Session() as s:
        x = s.input(jnp.asarray(x0), requires_grad=True)
        h1 = tfl.tanh(x * 2.0)
        h2 = h1 * h1
        unused = x * 5.0
        g = s.backward(tfl.sum(tfl.exp(h2)), wrt=[h1, h2, unused])
        # independent oracle: the loss as a function of each intermediate
        t1 = np.tanh(x0 * 2)
        close(g[h2], jax.grad(lambda h: jnp.sum(jnp.exp(h)))(t1 * t1))
        close(g[h1], jax.grad(lambda h: jnp.sum(jnp.exp(h * h)))(t1))
        close(g[unused], np.zeros(4))
        close(g[x], jax.grad(lambda v: jnp.sum(jnp.exp(jnp.tanh(2 * v) ** 2)))(x0))


def test_wrt_refuses_stale_foreign_and_non_tensor_handles():
    other = tfl.Session()
    foreign = other.input(jnp.ones(()), requires_grad=True)
    with tfl.Session() as s:
        x = s.input(jnp.ones(()), requires_grad=True)
        loss = x * 2.0
        with pytest.raises(TypeError, match="wrt takes Tensor handles"):
            s.backward(loss, wrt=[np.ones(())])
        with pytest.raises(TapeError):
            s.backward(loss, wrt=[foreign])
        old = x
        s.reset()
        y = s.input(jnp.ones(()), requires_grad=True)
        with pytest.raises(TapeError, match="stale"):
            s.backward(y * 2.0, wrt=[old])


# --------------------------------------------------------------------------- hooks


def test_tensor_hook_sees_the_complete_cotangent_and_may_replace_it():
    x0 = np.array([1.0, -2.0, 3.0], F32)
    seen = []
    with tfl.Session() as s:
        x = s.input(jnp.asarray(x0), requires_grad=True)
        h = x * 3.0
        h.register_hook(lambda g: seen.append(np.asarray(g)))
        handle = h.register_hook(lambda g: g * 0.5)
        loss = tfl.sum(h * h) + tfl.sum(h)  # h has two consumers: the hook sees their sum once
        g = s.backward(loss)
        assert len(seen) == 1
        close(seen[0], 2 * (3 * x0) + 1)
        close(g[x], 0.5 * (2 * (3 * x0) + 1) * 3)
        handle.remove()
        handle.remove()  # twice is a no-op
        close(s.backward(loss)[x], (2 * (3 * x0) + 1) * 3)
        assert len(seen) == 2


def test_param_hook_on_a_tied_param_fires_once_with_the_sum_and_replaces_it_for_the_optimizer():
    w = tfl.Param(jnp.array([1.0, 2.0], F32))
    tied = tfl.tie(w)
    seen = []
    hook = tied.register_hook(lambda g: seen.append(np.asarray(g)) or g * 0.0 + 1.0)  # the storage's hook
    opt = tfl.Optimizer(optax.sgd(1.0), [w, tied])
    with tfl.Session() as s:
        g = s.backward(tfl.sum(w * 3.0) + tfl.sum(tied * tied))
        assert len(seen) == 1
        close(seen[0], 3.0 + 2 * np.array([1.0, 2.0]))
        close(g[w], np.ones(2))
        opt.step(g)
    close(w.value, np.array([0.0, 1.0]))
    hook.remove()
    with tfl.Session() as s:
        s.backward(tfl.sum(w * 3.0))
    assert len(seen) == 1


def test_hooks_under_create_graph_get_tensors():
    with tfl.Session() as s:
        x = s.input(jnp.array(2.0, F32), requires_grad=True)
        h = x * x
        hook = h.register_hook(lambda g: g * h)  # a recorded replacement that depends on h
        g = s.backward(h * 1.0, create_graph=True)[x]  # d/dx of x^2 with cotangent h: h * 2x
        close(g.value, 4.0 * 4.0)
        hook.remove()  # it returns Tensors: a first-order backward would refuse it
        close(s.backward(g)[x], jax.grad(lambda v: v * v * 2 * v)(2.0))


def test_raising_hook_changes_nothing():
    w = tfl.Param(jnp.array(1.0, F32))
    opt = tfl.Optimizer(optax.sgd(1.0), [w])

    def boom(g):
        raise RuntimeError("hook failed")

    for create_graph in (False, True):
        with tfl.Session() as s:
            x = s.input(jnp.array(2.0, F32), requires_grad=True)
            h = x * w
            loss = h * h
            handle = h.register_hook(boom)
            before = s.tape
            with pytest.raises(RuntimeError, match="hook failed"):
                s.backward(loss, create_graph=create_graph)
            assert s.tape is before
            handle.remove()
            hw = w.register_hook(lambda g: g * 2.0 if create_graph else boom(g))
            if not create_graph:
                with pytest.raises(RuntimeError):
                    s.backward(loss)
                assert s.tape is before
            hw.remove()
            opt.step(s.backward(loss))
    close(w.value, 1.0 - 8.0 - (1.0 - 8.0) * 8.0)


def test_hook_returning_a_wrong_shape_is_refused():
    with tfl.Session() as s:
        x = s.input(jnp.ones(3), requires_grad=True)
        h = x * 2.0
        h.register_hook(lambda g: jnp.ones(2))
        with pytest.raises(TapeError, match=r"hook .* returned shape \(2,\)"):
            s.backward(tfl.sum(h))


def test_hooks_end_with_the_recording():
    with tfl.Session() as s:
        x = s.input(jnp.ones(()), requires_grad=True)
        (x * 2.0).register_hook(lambda g: g * 100.0)
        s.reset()
        y = s.input(jnp.ones(()), requires_grad=True)
        assert float(s.backward(y * 2.0)[y]) == 2.0


# --------------------------------------------------------------------------- no_grad


def test_no_grad_records_untracked_ops_and_leaves():
    w = tfl.Param(jnp.array([1.0, 2.0], F32))
    with tfl.Session() as s:
        x = s.input(jnp.array([3.0, 4.0], F32), requires_grad=True)
        with s.no_grad():
            target = tfl.tanh(x * w)  # e.g. a target network's output
            y = s.input(jnp.ones(2), requires_grad=True)
            assert not (target.requires_grad or y.requires_grad)
        loss = tfl.sum((x * w - target) ** 2.0)
        g = s.backward(loss)
        t = np.tanh(np.array([3.0, 8.0]))
        close(g[x], 2 * (np.array([3.0, 8.0]) - t) * np.array([1.0, 2.0]))
        close(g[w], 2 * (np.array([3.0, 8.0]) - t) * np.array([3.0, 4.0]))
        assert len(g.groups) == 1  # the use inside no_grad is not a trainable leaf


# --------------------------------------------------------------------------- compiled paths


@pytest.mark.parametrize("path", ["eager", "train_step", "value_and_grad"])
def test_gradient_penalty_and_param_hook_behave_the_same_compiled(path):
    """create_graph inside the loss and a Param hook: eager, train_step and value_and_grad agree."""
    vals = [
        np.linspace(-1, 1, 16, dtype=F32).reshape(2, 8),
        np.zeros(8, F32),
        np.linspace(1, -1, 8, dtype=F32)[:, None],
    ]
    x0 = jnp.asarray(np.linspace(-2, 2, 12, dtype=F32).reshape(6, 2))

    def loss_fn(s, ps, x):
        xin = s.input(x, requires_grad=True)
        out = tfl.tanh(xin @ ps[0] + ps[1]) @ ps[2]
        gx = s.backward(tfl.sum(out), create_graph=True)[xin]
        norm = tfl.sqrt(tfl.sum(gx * gx, axis=1) + 1e-12)
        return tfl.mean(out) + 10.0 * tfl.mean((norm - 1.0) ** 2.0)

    def run(path):
        ps = [tfl.Param(jnp.asarray(v)) for v in vals]
        hook = ps[0].register_hook(lambda g: g * 0.5)
        opt = tfl.Optimizer(optax.adam(1e-2), ps)
        if path == "train_step":
            step = tfl.train_step(lambda s, x: loss_fn(s, ps, x), opt)
            for _ in range(3):
                step(x0)
        elif path == "value_and_grad":
            vg = jax.jit(tfl.value_and_grad(lambda s, x: loss_fn(s, ps, x)))
            for _ in range(3):
                _, g = vg(ps, x0)
                opt.step(dict(zip(ps, g)))
        else:
            for _ in range(3):
                with tfl.Session() as s:
                    opt.step(s.backward(loss_fn(s, ps, x0)))
        hook.remove()
        return [np.asarray(p.value) for p in ps]

    for a, b in zip(run(path), run("eager")):
        close(a, b)
