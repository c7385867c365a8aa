"""Adversarial probes of eager replay: one eager session reused step after step must behave as a fresh one per step.

An eager session replays its last recording from the third recording of a structure on (each matching op call
skips the op check and runs its cached kernel). A fresh eager session per step never replays (it has no
outline); the RNG counter is carried over. Each probe runs the same step body both ways, over its own
identically initialized model, and compares everything the body observed: values read mid-step, gradients,
parameters after every step, optimizer state, RNG counter, and errors (type and message). Every probe runs
at least 6 steps and does its "unusual" thing at a step >= 3.
"""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _probes import F32, arr, compare, model

import tapeflow as tfl
from tapeflow import nn

RNG = np.random.default_rng(11)
X = RNG.normal(size=(8, 4)).astype(F32)
Y = RNG.integers(0, 3, size=8).astype(np.int32)
STEPS = 6


# ---------------------------------------------------------------------------------------------- harness


def forward(s, m, x=X, act=tfl.tanh):
    h = act(tfl.apply("linear", s.input(x), m.W1, m.b1))
    logits = h @ m.W2
    return h, logits, tfl.cross_entropy(logits, s.input(Y))


def run(body, reuse, steps=STEPS, build=model, make=None):
    """``body(s, step, m, log)`` on one session reused (``reuse``) or on a fresh one per step."""
    make = make or (lambda: tfl.Session(lazy=False, seed=0))
    m = build()
    s = make()
    log = []
    for step in range(steps):
        if not reuse and step:
            counter = s.rng_counter
            s = make()
            s.set_rng_state(counter=counter)
        m.s = s
        try:
            with s:
                body(s, step, m, log)
        except Exception as e:
            log.append(("error", step, *describe(e)))
        log.append(("params", step, [arr(p.value) for p in m.params]))
        log.append(("rng", step, s.rng_counter))
        log.append(("opt", step, [arr(v) for v in jax.tree_util.tree_leaves(m.opt.state)]))
    return log


def describe(e):
    msg = re.sub(r"storage=#\d+", "storage=#N", str(e))
    # a stale handle names generations, which count the session's recordings (a fresh session's start at 0)
    return type(e).__name__, re.sub(r"generation (is )?\d+", r"generation \1N", msg)


def same(body, tol=(1e-6, 1e-7), **kw):
    """The reused session's log equals the fresh sessions' log; returns the reused one."""
    fresh = run(body, False, **kw)
    reused = run(body, True, **kw)
    compare(reused, fresh, "log", *tol)
    return reused


def plain_step(s, step, m, log, **kw):
    _, _, loss = forward(s, m, **kw)
    g = s.backward(loss)
    log.append(("loss", step, float(loss)))
    log.append(("grads", step, [arr(g[p]) for p in m.params]))
    m.opt.step(g)


def replayed(s):
    s.recording
    ol = s._outline
    return 0 if ol is None else ol.matched


# ---------------------------------------------------------------------------------------------- probes


def test_plain_loop_replays_and_matches():
    seen = []

    def body(s, step, m, log):
        plain_step(s, step, m, log)
        seen.append(replayed(s))

    same(body)
    assert seen[-1] > 0  # the reused session did replay (the probe exercises the fast path)


def test_shape_error_at_one_step_then_continue():
    def body(s, step, m, log):
        x = X[:, :3] if step == 3 else X
        plain_step(s, step, m, log, x=x)

    log = same(body)
    assert any(e[0] == "error" and e[1] == 3 for e in log)


def test_shape_error_mid_step_after_replayed_ops():
    def body(s, step, m, log):
        h, logits, loss = forward(s, m)
        log.append(("h", step, arr(h.value)))
        if step == 3:
            h @ m.W1  # (8, 5) @ (4, 5): an error after replayed ops
        m.opt.step(s.backward(loss))

    log = same(body, steps=7)
    assert any(e[0] == "error" and e[1] == 3 for e in log)


def test_different_op_at_one_step():
    def body(s, step, m, log):
        plain_step(s, step, m, log, act=tfl.relu if step == 3 else tfl.tanh)

    same(body)


def test_different_attribute_at_one_step():
    def body(s, step, m, log):
        _, logits, _ = forward(s, m)
        loss = tfl.cross_entropy(logits, s.input(Y), label_smoothing=0.1 if step in (3, 5) else 0.0)
        log.append(("loss", step, float(loss)))
        m.opt.step(s.backward(loss))

    same(body, steps=7)


def test_negative_zero_scalar_operand():
    def body(s, step, m, log):
        h, _, loss = forward(s, m)
        z = 1.0 / (tfl.sum(h) * (-0.0 if step == 3 else 0.0))
        log.append(("z", step, arr(z.value)))
        m.opt.step(s.backward(loss))

    log = same(body)
    zs = [e[2] for e in log if e[0] == "z"]
    assert np.isneginf(zs[3]) != np.isneginf(zs[2])


def test_negative_zero_attribute_of_a_user_op():
    name = "eager_replay_probe_div"
    tfl.defop(name, lambda x, *, c: x / c, None, replace=True)
    try:

        def body(s, step, m, log):
            h, _, loss = forward(s, m)
            z = tfl.apply(name, tfl.sum(h), c=-0.0 if step == 3 else 0.0)
            log.append(("z", step, arr(z.value)))
            m.opt.step(s.backward(loss))

        log = same(body)
        zs = [e[2] for e in log if e[0] == "z"]
        assert np.signbit(zs[3]) != np.signbit(zs[2])
    finally:
        from tapeflow._core._registry import unregister

        unregister(name)


def test_int_vs_float_operand():
    def body(s, step, m, log):
        h, _, loss = forward(s, m)
        k = s.input(np.arange(5, dtype=np.int32))
        c = 2.0 if step == 3 else 2
        y = k * c
        log.append(("y", step, arr(y.value), str(y.dtype)))
        z = h * c
        log.append(("z", step, arr(z.value)))
        m.opt.step(s.backward(loss + tfl.mean(z)))

    log = same(body)
    ys = [e[2] for e in log if e[0] == "y"]
    np.testing.assert_array_equal(ys[3], ys[2])


def test_true_vs_one_operand():
    def body(s, step, m, log):
        h, _, loss = forward(s, m)
        k = s.input(np.arange(5, dtype=np.int32))
        y = k + (True if step == 3 else 1)
        log.append(("y", step, arr(y.value), str(y.dtype)))
        m.opt.step(s.backward(loss))

    same(body)


def test_numpy_vs_jax_inputs():
    def body(s, step, m, log):
        x = jnp.asarray(X) if step in (3, 5) else X
        xi = s.input(x)
        h = tfl.tanh(tfl.apply("linear", xi, m.W1, m.b1))
        h2 = h * (jnp.ones(5, F32) * 2 if step == 4 else np.full(5, 2, F32))  # a raw array operand
        loss = tfl.cross_entropy(h2 @ m.W2, s.input(Y))
        log.append(("loss", step, float(loss)))
        m.opt.step(s.backward(loss))

    same(body, steps=7)


def test_raw_host_array_operand_values_change():
    def body(s, step, m, log):
        h, _, loss = forward(s, m)
        w = np.full(5, float(step), F32)  # same shape and dtype, new values each step
        z = tfl.sum(h * w)
        log.append(("z", step, float(z)))
        m.opt.step(s.backward(loss + z * 1e-3))

    same(body, steps=7)


def test_raw_device_array_operand_values_change():
    def body(s, step, m, log):
        h, _, loss = forward(s, m)
        w = jnp.full(5, float(step), F32)
        z = tfl.sum(h * w)
        log.append(("z", step, float(z)))
        m.opt.step(s.backward(loss + z * 1e-3))

    same(body, steps=7)


def test_input_dtype_change():
    def body(s, step, m, log):
        x = X.astype(np.float64) if step == 3 else X
        xi = s.input(x)
        log.append(("xi", step, str(xi.dtype)))
        h = tfl.tanh(xi * 2.0)
        log.append(("h", step, arr(h.value), str(h.dtype)))
        plain_step(s, step, m, log)

    same(body)


def test_batch_size_change_and_back():
    def body(s, step, m, log):
        x = X[:4] if step == 3 else X
        y = Y[:4] if step == 3 else Y
        h = tfl.tanh(tfl.apply("linear", s.input(x), m.W1, m.b1))
        loss = tfl.cross_entropy(h @ m.W2, s.input(y))
        g = s.backward(loss)
        log.append(("loss", step, float(loss), [arr(g[p]) for p in m.params]))
        m.opt.step(g)

    same(body, steps=7)


def test_param_written_between_steps():
    def body(s, step, m, log):
        if step == 3:
            m.W1.value = jnp.full((4, 5), 0.1, F32)
        if step == 4:
            m.b1.value = np.ones(5, F32)
        plain_step(s, step, m, log)

    same(body, steps=7)


def test_param_written_mid_step():
    def body(s, step, m, log):
        h, _, _ = forward(s, m)
        if step == 3:
            m.W1.value = m.W1.value * 0.5
        h2, _, loss = forward(s, m)
        log.append(("h", step, arr(h.value), arr(h2.value)))
        m.opt.step(s.backward(loss + tfl.mean(h)))

    same(body)


def test_trainable_toggled():
    def body(s, step, m, log):
        m.W1.trainable = step != 3
        _, _, loss = forward(s, m)
        g = s.backward(loss)
        log.append(("has", step, m.W1 in g))
        log.append(("grads", step, [arr(g[p]) for p in m.params if p in g]))
        m.opt.step(g)
        m.W1.trainable = True

    same(body)


def test_tie_at_one_step():
    def body(s, step, m, log):
        W = tfl.tie(m.W1, name="W1t") if step == 3 else m.W1
        h = tfl.tanh(tfl.apply("linear", s.input(X), W, m.b1))
        loss = tfl.cross_entropy(h @ m.W2, s.input(Y))
        g = s.backward(loss)
        log.append(("grads", step, [arr(g[p]) for p in m.params]))
        m.opt.step(g)

    same(body)


def test_no_grad_block_at_one_step():
    def body(s, step, m, log):
        if step == 3:
            with s.no_grad():
                _, _, loss = forward(s, m)
            log.append(("rg", step, loss.requires_grad, float(loss)))
            return
        plain_step(s, step, m, log)

    same(body, steps=7)


def test_no_grad_partial_block():
    def body(s, step, m, log):
        xi = s.input(X)
        if step in (3, 4):
            with s.no_grad():
                h = tfl.tanh(tfl.apply("linear", xi, m.W1, m.b1))
        else:
            h = tfl.tanh(tfl.apply("linear", xi, m.W1, m.b1))
        loss = tfl.cross_entropy(h @ m.W2, s.input(Y))
        g = s.backward(loss)
        log.append(("grads", step, [arr(g[p]) for p in m.params if p in g], [p.name for p in m.params if p in g]))
        m.opt.step(g)

    same(body, steps=7)


def test_tensor_hook_at_one_step():
    def body(s, step, m, log):
        h, logits, _ = forward(s, m)
        if step == 3:
            h.register_hook(lambda g: g * 3.0)
        loss = tfl.cross_entropy(logits, s.input(Y))
        g = s.backward(loss)
        log.append(("grads", step, [arr(g[p]) for p in m.params]))
        m.opt.step(g)

    same(body)


def test_param_hook_at_one_step():
    def body(s, step, m, log):
        hd = m.W2.register_hook(lambda g: g * 0.0) if step == 3 else None
        try:
            plain_step(s, step, m, log)
        finally:
            if hd is not None:
                hd.remove()

    same(body)


def test_backward_twice():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        g = s.backward(loss)
        if step == 3:
            g2 = s.backward(loss * 2.0)
            log.append(("g2", step, [arr(g2[p]) for p in m.params]))
        log.append(("grads", step, [arr(g[p]) for p in m.params]))
        m.opt.step(g)

    same(body)


def test_create_graph_at_one_step():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        if step == 3:
            g = s.backward(loss, create_graph=True)
            gn = tfl.sum(g.tensor(m.W1) * g.tensor(m.W1)) if hasattr(g, "tensor") else None
            if gn is not None:
                log.append(("gn", step, float(gn)))
        else:
            g = s.backward(loss)
        log.append(("grads", step, [arr(g[p]) for p in m.params]))
        m.opt.step(g)

    same(body)


def test_wrt_interior_at_one_step():
    def body(s, step, m, log):
        h, _, loss = forward(s, m)
        g = s.backward(loss, wrt=[h] if step == 3 else [])
        if step == 3:
            log.append(("gh", step, arr(g[h])))
        log.append(("grads", step, [arr(g[p]) for p in m.params]))
        m.opt.step(g)

    same(body)


def debug_nans_body(nan_steps):
    def body(s, step, m, log):
        s.debug_nans = True
        x = X.copy()
        if step in nan_steps:
            x[0, 0] = np.nan
        _, _, loss = forward(s, m, x=x)
        g = s.backward(loss)
        log.append(("grads", step, [arr(g[p]) for p in m.params]))
        m.opt.step(g)

    return body


def test_debug_nans_nan_at_a_replayed_step():
    same(debug_nans_body((3,)))


def test_debug_nans_nan_at_second_step_before_replay():
    same(debug_nans_body((1,)))


def test_debug_nans_toggled_with_nan_input():
    def body(s, step, m, log):
        s.debug_nans = step in (3, 4)
        x = X.copy()
        if step in (3, 5):
            x[0, 0] = np.nan
        _, _, loss = forward(s, m, x=x)
        log.append(("loss", step, float(loss)))
        g = s.backward(loss)
        log.append(("grads", step, [arr(g[p]) for p in m.params]))
        if step not in (3, 5):
            m.opt.step(g)

    same(body, steps=7)


def test_debug_nans_with_out_of_range_device_ids():
    def build():
        m = model()
        m.emb = nn.Embedding(6, 4, key=jax.random.key(1))
        m.params = m.params + [p for _, p in m.emb.parameter_records()]
        m.opt = tfl.Optimizer(optax.adam(1e-2), m.params)
        return m

    def body(s, step, m, log):
        s.debug_nans = step >= 3
        ids = jnp.asarray([0, 1, 2, 3, 4, 5, 1, 2] if step != 4 else [0, 1, 2, 9, 4, 5, 1, 2], jnp.int32)
        e = m.emb(s.input(ids))
        h = tfl.tanh(tfl.apply("linear", e, m.W1, m.b1))
        loss = tfl.cross_entropy(h @ m.W2, s.input(Y))
        log.append(("loss", step, float(loss)))
        m.opt.step(s.backward(loss))

    log = same(body, build=build, steps=7)
    assert any(e[0] == "error" and e[1] == 4 for e in log)


def test_precision_policy_toggled():
    from tapeflow._core._precision import Precision

    def body(s, step, m, log):
        s.precision = Precision(jnp.bfloat16) if step == 3 else None
        h, _, loss = forward(s, m)
        log.append(("h", step, str(h.dtype), arr(h.value).astype(F32)))
        g = s.backward(loss)
        log.append(("grads", step, [arr(g[p]) for p in m.params]))
        m.opt.step(g)

    same(body)


def test_compute_dtype_session():
    def body(s, step, m, log):
        h, _, loss = forward(s, m)
        log.append(("h", step, str(h.dtype), arr(h.value).astype(F32)))
        g = s.backward(loss)
        log.append(("grads", step, [arr(g[p]) for p in m.params]))
        m.opt.step(g)

    # bfloat16: a compiled backward and an op-by-op one round differently (one bfloat16 ulp)
    same(body, tol=(2e-2, 1e-3), make=lambda: tfl.Session(lazy=False, seed=0, compute_dtype=jnp.bfloat16))


def test_dropout_at_some_steps():
    def body(s, step, m, log):
        h = tfl.tanh(tfl.apply("linear", s.input(X), m.W1, m.b1))
        if step in (3, 4):
            h = tfl.dropout(h, 0.5, training=True)
            log.append(("h", step, arr(h.value)))
        loss = tfl.cross_entropy(h @ m.W2, s.input(Y))
        g = s.backward(loss)
        log.append(("grads", step, [arr(g[p]) for p in m.params]))
        m.opt.step(g)

    same(body, steps=7)


def test_dropout_every_step():
    def body(s, step, m, log):
        h = tfl.dropout(tfl.tanh(tfl.apply("linear", s.input(X), m.W1, m.b1)), 0.5, training=True)
        log.append(("h", step, arr(h.value)))
        loss = tfl.cross_entropy(h @ m.W2, s.input(Y))
        m.opt.step(s.backward(loss))

    log = same(body)
    hs = [e[2] for e in log if e[0] == "h"]
    assert not np.array_equal(hs[3] == 0, hs[4] == 0)  # a new mask each step


def test_checkpoint_block_at_some_steps():
    def block(x, W, b):
        return tfl.tanh(tfl.apply("linear", x, W, b))

    ck = tfl.checkpoint(block)

    def body(s, step, m, log):
        xi = s.input(X)
        h = ck(xi, m.W1, m.b1) if step in (3, 5) else block(xi, m.W1, m.b1)
        loss = tfl.cross_entropy(h @ m.W2, s.input(Y))
        g = s.backward(loss)
        log.append(("grads", step, float(loss), [arr(g[p]) for p in m.params]))
        m.opt.step(g)

    same(body, steps=7)


def nn_model(kind):
    def build():
        k1, k2 = jax.random.split(jax.random.key(0))
        lin1, lin2 = nn.Linear(4, 6, key=k1), nn.Linear(6, 3, key=k2)
        norm = {"ln": nn.LayerNorm(6), "bn": nn.BatchNorm1d(6)}[kind]
        params = []
        for mod in (lin1, norm, lin2):
            params += [p for _, p in mod.parameter_records()]
        opt = tfl.Optimizer(optax.sgd(0.1), [p for p in params if p.trainable])
        return types.SimpleNamespace(lin1=lin1, norm=norm, lin2=lin2, params=params, opt=opt, extra={})

    return build


def nn_forward(s, m, x=X):
    h = tfl.relu(m.norm(m.lin1(s.input(x))))
    return tfl.cross_entropy(m.lin2(h), s.input(Y[: len(x)]))


def test_layernorm_model():
    def body(s, step, m, log):
        loss = nn_forward(s, m, x=X[:4] if step == 3 else X)
        log.append(("loss", step, float(loss)))
        m.opt.step(s.backward(loss))

    same(body, build=nn_model("ln"))


def test_batchnorm_train_eval_toggles():
    def body(s, step, m, log):
        if step in (3, 5):
            m.norm.eval()
        else:
            m.norm.train()
        loss = nn_forward(s, m)
        log.append(("loss", step, float(loss)))
        if step not in (3, 5):
            m.opt.step(s.backward(loss))

    same(body, build=nn_model("bn"), steps=8)


def test_embedding_out_of_range_host_ids():
    def build():
        m = model()
        m.emb = nn.Embedding(6, 4, key=jax.random.key(1))
        m.params = m.params + [p for _, p in m.emb.parameter_records()]
        m.opt = tfl.Optimizer(optax.adam(1e-2), m.params)
        return m

    def body(s, step, m, log):
        ids = np.array([0, 1, 2, 3, 4, 5, 1, 2] if step != 3 else [0, 1, 2, 6, 4, 5, 1, 2], np.int32)
        e = tfl.numpy.take(m.emb.weight, ids, axis=0)  # host ids: checked against their range as recorded
        h = tfl.tanh(tfl.apply("linear", e, m.W1, m.b1))
        loss = tfl.cross_entropy(h @ m.W2, s.input(Y))
        log.append(("loss", step, float(loss)))
        m.opt.step(s.backward(loss))

    log = same(body, build=build)
    assert any(e[0] == "error" and e[1] == 3 for e in log)


def test_take_with_raw_out_of_range_host_ids():
    def body(s, step, m, log):
        h, _, loss = forward(s, m)
        ids = np.array([0, 1, 2] if step != 3 else [0, 9, 2], np.int32)
        z = tfl.numpy.take(h, ids, axis=1) if hasattr(tfl, "take") else h
        log.append(("z", step, arr(z.value)))
        m.opt.step(s.backward(loss))

    log = same(body)
    assert any(e[0] == "error" and e[1] == 3 for e in log)


def test_op_redefined_between_steps():
    name = "eager_replay_probe_scale"
    from tapeflow._core._registry import unregister

    try:
        tfl.defop(name, lambda x: x * 2.0, lambda g, out, x: (g * 2.0,), replace=True)

        def body(s, step, m, log):
            if step == 3:
                tfl.defop(name, lambda x: x * 3.0, lambda g, out, x: (g * 3.0,), replace=True)
            h, _, loss = forward(s, m)
            z = tfl.apply(name, h)
            log.append(("z", step, arr(z.value)))
            g = s.backward(loss + tfl.mean(z))
            log.append(("grads", step, [arr(g[p]) for p in m.params]))
            m.opt.step(g)

        def runner(reuse):
            tfl.defop(name, lambda x: x * 2.0, lambda g, out, x: (g * 2.0,), replace=True)
            return run(body, reuse)

        compare(runner(True), runner(False))
    finally:
        unregister(name)


def test_two_sessions_sharing_params_interleaved():
    def body(s, step, m, log):
        if "s2" not in m.extra or m.extra.get("fresh"):
            m.extra["s2"] = tfl.Session(lazy=False, seed=1)
        s2 = m.extra["s2"]
        h, _, loss = forward(s, m)
        with s2:
            _, _, loss2 = forward(s2, m, x=X[::-1].copy() if step == 3 else X)
            g2 = s2.backward(loss2)
            log.append(("l2", step, float(loss2), [arr(g2[p]) for p in m.params]))
        if step == 4:
            m.W2.value = m.W2.value + 0.01
        g = s.backward(loss)
        log.append(("grads", step, float(loss), [arr(g[p]) for p in m.params]))
        m.opt.step(g)

    def build_fresh():
        m = model()
        m.extra["fresh"] = True
        return m

    fresh = run(body, False, build=build_fresh)
    reused = run(body, True)
    compare(reused, fresh)


def test_reading_recording_mid_step():
    def body(s, step, m, log):
        h, logits, loss = forward(s, m)
        if step >= 3:
            log.append(("len", step, len(s.recording)))
        log.append(("v", step, arr(logits.value)))
        m.opt.step(s.backward(loss))

    same(body)


def test_reset_mid_step_and_stale_handles():
    def body(s, step, m, log):
        h, _, loss = forward(s, m)
        if step == 3:
            s.reset()
            try:
                float(h)
            except Exception as e:
                log.append(("stale", step, *describe(e)))
            _, _, loss = forward(s, m)
        g = s.backward(loss)
        log.append(("grads", step, [arr(g[p]) for p in m.params]))
        m.opt.step(g)

    log = same(body, steps=7)
    assert any(e[0] == "stale" for e in log)


def test_error_then_same_structure_replays_correct_values():
    def body(s, step, m, log):
        xi = s.input(X)
        a = tfl.tanh(tfl.apply("linear", xi, m.W1, m.b1))
        if step == 3:
            tfl.apply("linear", xi, m.W2, m.b1)  # (8, 4) @ (5, 3): shape error mid-step
        loss = tfl.cross_entropy(a @ m.W2, s.input(Y))
        log.append(("loss", step, float(loss)))
        m.opt.step(s.backward(loss))

    same(body, steps=8)


def test_handle_from_previous_step_as_operand():
    def body(s, step, m, log):
        h, _, loss = forward(s, m)
        if step == 3 and "old" in m.extra:
            try:
                tfl.sum(m.extra["old"] * 2.0)
            except Exception as e:
                log.append(("stale", step, *describe(e)))
        m.extra["old"] = h
        m.opt.step(s.backward(loss))

    log = same(body)
    assert any(e[0] == "stale" for e in log)


def test_value_read_mid_step_changes_with_params():
    def body(s, step, m, log):
        h, logits, loss = forward(s, m)
        log.append(("h", step, arr(h.value), float(tfl.sum(logits))))
        g = s.backward(loss)
        m.opt.step(g)
        h2, _, _ = forward(s, m)  # second forward after the update: the same structure repeated in one step
        log.append(("h2", step, arr(h2.value)))

    same(body)


def test_grad_enabled_toggled():
    def body(s, step, m, log):
        s.grad_enabled = step != 3
        try:
            h, _, loss = forward(s, m)
            log.append(("rg", step, loss.requires_grad, float(loss)))
            if step != 3:
                m.opt.step(s.backward(loss))
        finally:
            s.grad_enabled = True

    same(body)


def test_param_value_dtype_changed_between_steps():
    def body(s, step, m, log):
        if step == 3:
            m.b1.value = np.zeros(5, np.float64)
        if step == 4:
            m.b1.value = np.zeros(5, F32)
        h, _, loss = forward(s, m)
        log.append(("h", step, str(h.dtype), str(m.b1.dtype), arr(h.value)))
        m.opt.step(s.backward(loss))

    same(body, steps=7)


def test_param_value_shape_changed_between_steps():
    def body(s, step, m, log):
        if step == 3:
            m.b1.value = np.zeros((1, 5), F32)
        if step == 4:
            m.b1.value = np.zeros(5, F32)
        h, _, loss = forward(s, m)
        log.append(("h", step, h.shape, m.b1.shape, arr(h.value)))
        m.opt.step(s.backward(loss))

    same(body, steps=7)


def test_scalar_operand_dtype_follows_float64_input():
    def body(s, step, m, log):
        x = s.input(X.astype(np.float64) if step in (3, 4) else X)
        y = x * 3
        z = 0.5 + x
        log.append(("y", step, str(y.dtype), arr(y.value), str(z.dtype), arr(z.value)))
        plain_step(s, step, m, log)

    same(body, steps=7)


def test_grads_read_after_the_step_and_two_steps_later():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        g = s.backward(loss)
        m.extra.setdefault("kept", {})[step] = g
        m.opt.step(g)
        log.append(("after", step, [arr(g[p]) for p in m.params]))
        if step >= 3:
            log.append(("old", step, [arr(m.extra["kept"][step - 2][p]) for p in m.params]))

    same(body)


def test_nan_and_overflowing_scalar_operands():
    def body(s, step, m, log):
        h, _, loss = forward(s, m)
        z = h + (float("nan") if step == 3 else 0.0)
        log.append(("z", step, arr(z.value)))
        k = s.input(np.arange(5, dtype=np.int32))
        w = k * (2**40 if step == 4 else 2)
        log.append(("w", step, arr(w.value)))
        m.opt.step(s.backward(loss))

    log = same(body, steps=7)
    assert any(e[0] == "error" and e[1] == 4 for e in log)


def test_detach_at_one_step():
    def body(s, step, m, log):
        xi = s.input(X)
        h = tfl.tanh(tfl.apply("linear", xi, m.W1, m.b1))
        if step == 3:
            h = s.detach(h)
        loss = tfl.cross_entropy(h @ m.W2, s.input(Y))
        g = s.backward(loss)
        log.append(("grads", step, [arr(g[p]) for p in m.params]))
        m.opt.step(g)

    same(body)
