"""The functional bridge: ``value_and_grad``, ``train_step``, sharding, and the tape inside a user's jit.

Oracles: the eager training loop (``Session`` + ``Optimizer.step``) for the
compiled step, ``jax.grad`` of a plain JAX function for tied gradients, and a
Python loop for ``jax.vmap`` / ``jax.lax.scan``. Everything runs in float32
(the test session enables x64, so dtypes are explicit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tapeflow as tfl
from tapeflow import TapeError

F32 = np.float32
TOL = 1e-5  # the spec's bound for eager vs compiled float32 training


def _simulated_devices_env(n: int) -> dict[str, str]:
    """The environment of a subprocess that sees ``n`` simulated CPU devices."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _run_on_devices(script: str, n: int) -> dict:
    """Run ``script`` in a subprocess with ``n`` simulated devices; its last stdout line is JSON."""
    proc = subprocess.run(
        [sys.executable, "-c", script], env=_simulated_devices_env(n), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _np(shape, seed, scale=0.3):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(F32)


def max_abs_diff(a, b) -> float:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    return max(
        (float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))) if np.size(x) else 0.0)
        for x, y in zip(la, lb)
    )


def values_of(params) -> dict:
    return {k: np.asarray(p.value) for k, p in params.items()}


def bind(params, values):
    """A Params pytree of the same structure whose (bound) values are ``values``' leaves."""
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), jax.tree_util.tree_leaves(values))


# --------------------------------------------------------------------------- models


def make_mlp(seed=0, sizes=(12, 32, 32, 5)):
    """A tanh MLP with a softmax cross-entropy loss; returns (params by name, loss_fn, batch maker)."""
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"w{i}"] = tfl.Param(_np((a, b), seed + i, 1.0 / np.sqrt(a)), name=f"w{i}")
        params[f"b{i}"] = tfl.Param(_np((b,), seed + 100 + i, 0.1), name=f"b{i}")
    n = len(sizes) - 1

    def loss_fn(s, x, y):
        h = x
        for i in range(n):
            h = tfl.apply("linear", h, params[f"w{i}"], params[f"b{i}"])
            if i < n - 1:
                h = tfl.tanh(h)
        return tfl.cross_entropy(h, y)

    def batch(k, size=16):
        r = np.random.default_rng(1000 + k)
        return (
            jnp.asarray(r.standard_normal((size, sizes[0])), jnp.float32),
            jnp.asarray(r.integers(0, sizes[-1], size), jnp.int32),
        )

    return params, loss_fn, batch


def make_tied_autoencoder(seed=0, d=10, k=4):
    """Encoder ``x @ W``, decoder ``h @ W.T`` through a tied record of the same storage."""
    W = tfl.Param(_np((d, k), seed, 0.5), name="W")
    W_dec = tfl.tie(W, name="W_dec")
    b_enc = tfl.Param(np.zeros(k, F32), name="b_enc")
    b_dec = tfl.Param(_np((d,), seed + 1, 0.1), name="b_dec")
    registrations = {"W": W, "b_enc": b_enc, "W_dec": W_dec, "b_dec": b_dec}

    def loss_fn(s, x):
        h = tfl.tanh(tfl.apply("linear", x, W, b_enc))
        r = tfl.apply("linear", h, W_dec.T, b_dec)
        return tfl.mse(r, x)

    def batch(k_, size=16):
        r = np.random.default_rng(2000 + k_)
        return (jnp.asarray(r.standard_normal((size, d)), jnp.float32),)

    return registrations, loss_fn, batch


MODELS = {"mlp": make_mlp, "tied_autoencoder": make_tied_autoencoder}


def eager_train(params, loss_fn, tx, batches):
    opt = tfl.Optimizer(tx, params)
    losses = []
    for b in batches:
        with tfl.Session() as s:
            loss = loss_fn(s, *b)
            losses.append(float(loss))
            opt.step(s.backward(loss))
    return losses, opt


def compiled_train(params, loss_fn, tx, batches, **kw):
    opt = tfl.Optimizer(tx, params)
    step = tfl.train_step(loss_fn, opt, **kw)
    losses = [float(step(*b)) for b in batches]
    return losses, opt, step


# =========================================================================== train_step == eager


class TestTrainStepEqualsEager:
    @pytest.mark.parametrize("model", sorted(MODELS))
    @pytest.mark.parametrize("donate", [True, False])
    def test_twenty_adam_steps(self, model, donate):
        pe, fe, batch = MODELS[model]()
        pc, fc, _ = MODELS[model]()
        init = values_of(pc)
        batches = [batch(k) for k in range(20)]
        le, opt_e = eager_train(pe, fe, optax.adam(1e-2), batches)
        lc, opt_c, step = compiled_train(pc, fc, optax.adam(1e-2), batches, donate=donate)
        assert max_abs_diff(le, lc) <= TOL
        assert max_abs_diff(values_of(pe), values_of(pc)) <= TOL
        assert max_abs_diff(opt_e.state, opt_c.state) <= TOL
        assert step.trace_count == 1 and step.step_count == 20
        assert max_abs_diff(init, values_of(pc)) > 1e-2  # it trained
        assert values_of(pc)["W" if model == "tied_autoencoder" else "w0"].dtype == F32

    def test_tied_records_share_one_slot_and_one_update(self):
        params, loss_fn, batch = make_tied_autoencoder()
        opt = tfl.Optimizer(optax.adam(1e-2), params)
        assert len(opt.params) == 3
        step = tfl.train_step(loss_fn, opt)
        step(*batch(0))
        assert params["W"].storage is params["W_dec"].storage
        np.testing.assert_array_equal(np.asarray(params["W"].value), np.asarray(params["W_dec"].value))
        assert sorted(opt.state[0].mu) == ["W", "b_dec", "b_enc"]

    def test_user_optax_chain(self):
        tx = lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(3e-3, weight_decay=1e-2))  # noqa: E731
        pe, fe, batch = make_mlp(seed=3)
        pc, fc, _ = make_mlp(seed=3)
        batches = [batch(k) for k in range(20)]
        le, _ = eager_train(pe, fe, tx(), batches)
        lc, _, _ = compiled_train(pc, fc, tx(), batches)
        assert max_abs_diff(le, lc) <= TOL
        assert max_abs_diff(values_of(pe), values_of(pc)) <= TOL

    def test_unused_parameter_is_skipped_like_eager(self):
        def build():
            w = tfl.Param(_np((3,), 0), name="w")
            u = tfl.Param(_np((3,), 1), name="unused")
            return {"w": w, "unused": u}, (lambda s, x: tfl.sum(tfl.tanh(w * x)))

        pe, fe = build()
        pc, fc = build()
        u0 = np.asarray(pc["unused"].value).copy()
        batches = [(jnp.asarray(_np((3,), 10 + k, 1.0)),) for k in range(5)]
        le, opt_e = eager_train(pe, fe, optax.adam(0.1), batches)
        lc, opt_c, _ = compiled_train(pc, fc, optax.adam(0.1), batches)
        assert max_abs_diff(le, lc) <= TOL
        np.testing.assert_array_equal(np.asarray(pc["unused"].value), u0)
        assert max_abs_diff(values_of(pe), values_of(pc)) <= TOL
        assert max_abs_diff(opt_e.state, opt_c.state) <= TOL
        assert float(np.max(np.abs(np.asarray(opt_c.state[0].mu["unused"])))) == 0.0

    def test_writes_storages_and_optimizer_state(self):
        params, loss_fn, batch = make_mlp()
        opt = tfl.Optimizer(optax.sgd(0.1), params)
        before = values_of(params)
        step = tfl.train_step(loss_fn, opt)
        x, y = batch(0)
        # one step by hand: the compiled step's update is p - 0.1 * grad
        loss_ref, g = jax.jit(tfl.value_and_grad(loss_fn))(params, x, y)
        loss = step(x, y)
        assert abs(float(loss) - float(loss_ref)) <= TOL
        for k in params:
            np.testing.assert_allclose(
                np.asarray(params[k].value), before[k] - 0.1 * np.asarray(g[k]), rtol=1e-5, atol=1e-6
            )
        # eager code sees the new values
        with tfl.Session() as s:
            assert abs(float(loss_fn(s, x, y)) - float(step(x, y))) <= TOL


# =========================================================================== compile counts


class TestCompileCount:
    def test_one_program_per_shape(self):
        params, loss_fn, batch = make_mlp()
        opt = tfl.Optimizer(optax.adam(1e-3), params)
        step = tfl.train_step(loss_fn, opt)
        x, y = batch(0, size=16)
        for _ in range(50):
            step(x, y)
        assert step.trace_count == 1
        assert step.cache_size() == 1
        assert step.step_count == 50
        x2, y2 = batch(1, size=7)
        step(x2, y2)
        assert step.trace_count == 2
        assert step.cache_size() == 2
        for _ in range(5):  # both shapes are cached now
            step(x, y)
            step(x2, y2)
        assert step.trace_count == 2 and step.cache_size() == 2

    @pytest.mark.parametrize("built_from", ["module", "parameters()"])
    @pytest.mark.parametrize("layers", ["batchnorm", "dropout", "both"])
    def test_a_model_with_batchnorm_or_dropout_traces_once_per_shape(self, layers, built_from):
        """Running statistics (read and written, no optimizer slot) and train/eval modes are known on the first trace.

        PyTorch's ``Optimizer(tx, model.parameters())`` knows them as well as ``Optimizer(tx, model)``.
        """
        _, _, batch = make_mlp()

        def build():
            k1, k2 = jax.random.split(jax.random.key(0))
            mods = [tfl.nn.Linear(12, 16, key=k1)]
            mods += [tfl.nn.BatchNorm1d(16)] if layers != "dropout" else []
            mods += [tfl.nn.Dropout(0.25)] if layers != "batchnorm" else []
            return tfl.nn.Sequential(*mods, tfl.nn.Linear(16, 5, key=k2))

        model, traced = build(), []

        def loss_fn(s, x, y):
            traced.append(x.shape)  # Python runs here once per trace
            return tfl.cross_entropy(model(x), y)

        params = model if built_from == "module" else model.parameters()
        step = tfl.train_step(loss_fn, tfl.Optimizer(optax.sgd(0.1), params))
        batches = [batch(k) for k in range(3)]
        losses = [float(step(x, y)) for x, y in batches]
        assert step.trace_count == len(traced) == 1 and step.cache_size() == 1
        after = [(n, np.asarray(p.value)) for n, p in model.parameter_records()]
        step(*batch(3, size=8))  # a new shape: one more trace
        assert step.trace_count == len(traced) == 2
        model.eval()
        step(*batches[0])  # eval mode is its own program; back in train mode the first one serves again
        model.train()
        step(*batches[0])
        assert step.trace_count == len(traced) == 3 and step.cache_size() == 3
        if layers == "batchnorm":  # no random masks: the eager loop is the oracle, running statistics included
            # (sgd: the bias before BatchNorm has a gradient of rounding noise, which adam would scale up)
            ref = build()
            ref_losses, _ = eager_train(ref, lambda s, x, y: tfl.cross_entropy(ref(x), y), optax.sgd(0.1), batches)
            assert max_abs_diff(losses, ref_losses) <= TOL
            for (n, got), (_, p) in zip(after, ref.parameter_records(), strict=True):
                assert max_abs_diff(got, p.value) <= TOL, n

    def test_new_dtype_recompiles(self):
        params, loss_fn, batch = make_mlp()
        step = tfl.train_step(loss_fn, tfl.Optimizer(optax.sgd(1e-3), params))
        x, y = batch(0)
        step(x, y)
        step(x, y.astype(jnp.int64))
        assert step.trace_count == 2


# =========================================================================== value_and_grad


class TestValueAndGrad:
    def test_tied_params_equal_hand_summed_pure_jax_gradient(self):
        W = tfl.Param(_np((6, 3), 0, 0.5), name="W")
        W_out = tfl.tie(W, name="W_out")
        x = jnp.asarray(_np((5, 6), 1, 1.0))

        def loss_fn(s, x):
            h = tfl.tanh(x @ W)
            r = h @ W_out.T
            return tfl.sum((r - x) ** 2.0) + tfl.sum(W * W_out)

        def plain(w, x):  # one weight, three uses: jax.grad sums them
            h = jnp.tanh(x @ w)
            return jnp.sum((h @ w.T - x) ** 2) + jnp.sum(w * w)

        ref_loss, ref_g = jax.value_and_grad(plain)(jnp.asarray(W.value), x)
        vg = tfl.value_and_grad(loss_fn)
        for key, rec in (("W", W), ("W_out", W_out)):  # either record stands for the storage
            for f in (vg, jax.jit(vg)):
                loss, g = f({key: rec}, x)
                assert list(g) == [key]
                np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
                np.testing.assert_allclose(np.asarray(g[key]), np.asarray(ref_g), rtol=1e-5, atol=1e-6)

    def test_tied_sum_is_bit_identical_to_eager(self):
        W = tfl.Param(_np((4, 4), 2, 0.5), name="W")
        W2 = tfl.tie(W)
        x = jnp.asarray(_np((3, 4), 3, 1.0))

        def loss_fn(s, x):
            return tfl.sum(tfl.tanh(x @ W) @ W2) + tfl.sum(W2 * 0.5)

        with tfl.Session() as s:
            g_eager = np.asarray(s.backward(loss_fn(s, x))[W])
        _, g = tfl.value_and_grad(loss_fn)({"W": W}, x)
        np.testing.assert_array_equal(np.asarray(g["W"]), g_eager)

    def test_params_pytree_structure_is_kept(self):
        params, loss_fn, batch = make_mlp()
        tree = {
            "layers": [(params["w0"], params["b0"]), (params["w1"], params["b1"])],
            "head": {"w": params["w2"], "b": params["b2"]},
        }
        loss, g = jax.jit(tfl.value_and_grad(loss_fn))(tree, *batch(0))
        assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(tfl.param_values(tree))
        loss2, g2 = jax.jit(tfl.value_and_grad(loss_fn))(params, *batch(0))
        assert float(loss) == float(loss2)
        np.testing.assert_array_equal(np.asarray(g["head"]["w"]), np.asarray(g2["w2"]))

    def test_values_come_from_params_not_storages(self):
        w = tfl.Param(np.array([1.0, 2.0], F32), name="w")
        vg = jax.jit(tfl.value_and_grad(lambda s, x: tfl.sum(w * x * w)))
        x = jnp.asarray([3.0, 1.0], jnp.float32)
        new = bind({"w": w}, {"w": jnp.asarray([2.0, 0.0], jnp.float32)})
        loss, g = vg(new, x)
        assert float(loss) == 12.0 and g["w"].tolist() == [12.0, 0.0]
        assert w.value.tolist() == [1.0, 2.0]  # the storage is untouched

    def test_unused_param_gets_zero_gradient(self):
        w = tfl.Param(np.ones(2, F32), name="w")
        u = tfl.Param(np.ones((2, 3), F32), name="u")
        loss, g = jax.jit(tfl.value_and_grad(lambda s: tfl.sum(w * w)))({"w": w, "u": u})
        assert g["u"].shape == (2, 3) and g["u"].dtype == F32
        assert float(jnp.max(jnp.abs(g["u"]))) == 0.0

    def test_vmap_per_example_equals_python_loop(self):
        params, loss_fn, batch = make_mlp()
        x, y = batch(0, size=6)
        vg = tfl.value_and_grad(loss_fn)
        losses, grads = jax.jit(jax.vmap(vg, in_axes=(None, 0, 0)))(params, x, y)
        assert losses.shape == (6,)
        assert grads["w0"].shape == (6,) + params["w0"].shape
        vg1 = jax.jit(vg)  # one example at a time
        for i in range(6):
            li, gi = vg1(params, x[i], y[i])
            np.testing.assert_allclose(float(losses[i]), float(li), rtol=1e-6, atol=1e-6)
            for k in params:
                np.testing.assert_allclose(np.asarray(grads[k][i]), np.asarray(gi[k]), rtol=1e-5, atol=1e-6)
        # the mean of per-example gradients is the batch gradient
        _, gb = vg(params, x, y)
        np.testing.assert_allclose(np.asarray(grads["w1"].mean(0)), np.asarray(gb["w1"]), rtol=1e-5, atol=1e-6)

    def test_scan_with_handwritten_optax_update_equals_python_loop(self):
        params, loss_fn, batch = make_mlp(seed=5)
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
        vg = tfl.value_and_grad(loss_fn)
        bs = [batch(k) for k in range(8)]
        xs, ys = jnp.stack([b[0] for b in bs]), jnp.stack([b[1] for b in bs])

        def update(p, state, x, y):
            loss, g = vg(p, x, y)
            vals = tfl.param_values(p)
            updates, state = tx.update(g, state, vals)
            return bind(p, optax.apply_updates(vals, updates)), state, loss

        def body(carry, b):
            p, state = carry
            p, state, loss = update(p, state, *b)
            return (p, state), loss

        state0 = tx.init(tfl.param_values(params))
        (p_scan, s_scan), l_scan = jax.jit(lambda p, s: jax.lax.scan(body, (p, s), (xs, ys)))(params, state0)
        assert all(isinstance(p, tfl.Param) and p.bound for p in p_scan.values())

        p, state, l_loop = params, state0, []
        step = jax.jit(update)
        for b in bs:
            p, state, loss = step(p, state, *b)
            l_loop.append(float(loss))
        assert max_abs_diff(list(l_scan), l_loop) <= TOL
        assert max_abs_diff(tfl.param_values(p_scan), tfl.param_values(p)) <= TOL
        assert max_abs_diff(s_scan, state) <= TOL
        # and it matches tfl.train_step with the same chain
        pc, fc, _ = make_mlp(seed=5)
        lc, _, _ = compiled_train(pc, fc, optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), bs)
        assert max_abs_diff(lc, l_loop) <= TOL
        assert max_abs_diff(values_of(pc), tfl.param_values(p)) <= TOL

    def test_rng_keyword_seeds_random_tensors(self):
        w = tfl.Param(np.ones(64, F32), name="w")

        def loss_fn(s, x):
            return tfl.sum(tfl.dropout(w * x, 0.5))

        vg = jax.jit(tfl.value_and_grad(loss_fn))
        x = jnp.ones(64, jnp.float32)
        k1, k2 = jax.random.PRNGKey(1), jax.random.PRNGKey(2)
        a, b, c = vg({"w": w}, x, rng=k1), vg({"w": w}, x, rng=k1), vg({"w": w}, x, rng=k2)
        np.testing.assert_array_equal(np.asarray(a[1]["w"]), np.asarray(b[1]["w"]))
        assert not np.array_equal(np.asarray(a[1]["w"]), np.asarray(c[1]["w"]))


# =========================================================================== has_aux


class TestHasAux:
    def _model(self):
        params, loss_fn, batch = make_mlp()

        def loss_aux(s, x, y):
            h = tfl.tanh(tfl.apply("linear", x, params["w0"], params["b0"]))
            h = tfl.tanh(tfl.apply("linear", h, params["w1"], params["b1"]))
            logits = tfl.apply("linear", h, params["w2"], params["b2"])
            return tfl.cross_entropy(logits, y), {"logits": logits, "norm": tfl.sum(h * h), "tag": jnp.asarray(7)}

        return params, loss_fn, loss_aux, batch

    def test_value_and_grad_has_aux(self):
        params, loss_fn, loss_aux, batch = self._model()
        x, y = batch(0)
        (loss, aux), g = jax.jit(tfl.value_and_grad(loss_aux, has_aux=True))(params, x, y)
        loss_ref, g_ref = jax.jit(tfl.value_and_grad(loss_fn))(params, x, y)
        assert float(loss) == float(loss_ref)
        assert max_abs_diff(g, g_ref) == 0.0
        assert isinstance(aux["logits"], jax.Array) and aux["logits"].shape == (16, 5)
        assert aux["norm"].shape == () and int(aux["tag"]) == 7

    def test_train_step_has_aux(self):
        params, _, loss_aux, batch = self._model()
        step = tfl.train_step(loss_aux, tfl.Optimizer(optax.adam(1e-2), params), has_aux=True)
        x, y = batch(0)
        loss, aux = step(x, y)
        assert loss.shape == () and aux["logits"].shape == (16, 5)
        loss2, _ = step(x, y)
        assert float(loss2) < float(loss)

    def test_has_aux_needs_a_pair(self):
        params, loss_fn, _, batch = self._model()
        with pytest.raises(TapeError, match=r"has_aux=True.*must return \(loss, aux\)"):
            tfl.value_and_grad(loss_fn, has_aux=True)(params, *batch(0))


# =========================================================================== errors


class TestErrors:
    def test_non_scalar_loss(self):
        w = tfl.Param(np.ones(3, F32), name="w")
        f = tfl.value_and_grad(lambda s, x: w * x)
        with pytest.raises(TapeError, match=r"must return a scalar; got a tensor of shape \(3,\).*tfl.mean or tfl.sum"):
            f({"w": w}, jnp.ones(3, jnp.float32))
        with pytest.raises(TapeError, match=r"must return a scalar"):
            jax.jit(f)({"w": w}, jnp.ones(3, jnp.float32))
        step = tfl.train_step(lambda s, x: w * x, tfl.Optimizer(optax.sgd(0.1), [w]))
        with pytest.raises(TapeError, match=r"must return a scalar"):
            step(jnp.ones(3, jnp.float32))
        assert w.value.tolist() == [1.0, 1.0, 1.0]

    def test_loss_not_a_tensor(self):
        w = tfl.Param(np.ones(3, F32), name="w")
        with pytest.raises(TapeError, match=r"must return a scalar tfl.Tensor.*got ArrayImpl"):
            tfl.value_and_grad(lambda s: jnp.sum(w.value))({"w": w})

    def test_same_storage_twice(self):
        w = tfl.Param(np.ones(3, F32), name="w")
        f = tfl.value_and_grad(lambda s: tfl.sum(w * w))
        with pytest.raises(TapeError, match=r"share one storage; pass each storage once"):
            f({"a": w, "b": tfl.tie(w, name="w2")})
        with pytest.raises(TapeError, match=r"share one storage"):
            f([w, w])
        with pytest.raises(TapeError, match=r"share one storage"):
            jax.jit(f)({"a": w, "b": w})

    def test_non_param_leaves(self):
        w = tfl.Param(np.ones(3, F32), name="w")
        f = tfl.value_and_grad(lambda s: tfl.sum(w * w))
        with pytest.raises(TypeError, match=r"\['v'\] is ArrayImpl; pass a pytree of tfl.Param"):
            f({"w": w, "v": jnp.ones(3)})
        with pytest.raises(TypeError, match=r"pass a pytree of tfl.Param"):
            f({"w": 1.0})
        with pytest.raises(TypeError, match=r"pass a pytree of tfl.Param"):
            jax.jit(f)(tfl.param_values({"w": w}))


# =========================================================================== RNG of train_step


def test_train_step_rng_follows_seed_and_step():
    w = tfl.Param(np.ones(64, F32), name="w")

    def loss_fn(s, x):
        return tfl.sum(tfl.dropout(w * x, 0.5))

    x = jnp.ones(64, jnp.float32)
    step = tfl.train_step(loss_fn, tfl.Optimizer(optax.sgd(0.0), [w]), seed=3)
    vg = jax.jit(tfl.value_and_grad(loss_fn))
    for k in range(3):
        ref, _ = vg({"w": w}, x, rng=jax.random.fold_in(jax.random.PRNGKey(3), k))
        assert float(step(x)) == float(ref)


def test_train_step_step_count_can_be_set_to_resume_the_rng_stream():
    w = tfl.Param(np.ones(64, F32), name="w")

    def loss_fn(s, x):
        return tfl.sum(tfl.dropout(w * x, 0.5))

    x = jnp.ones(64, jnp.float32)
    step = tfl.train_step(loss_fn, tfl.Optimizer(optax.sgd(0.0), [w]), seed=0)
    first = [float(step(x)) for _ in range(4)]
    step.step_count = 2  # e.g. resuming from a checkpoint taken after two steps
    assert [float(step(x)) for _ in range(2)] == first[2:]
    assert step.step_count == 4 and step.trace_count == 1


class TestTrainStepGuards:
    def test_update_that_changes_a_parameter_shape_is_rejected(self):
        w = tfl.Param(np.ones(3, F32), name="w")

        def update(updates, state, params=None):  # a broken transformation: adds an axis
            return jax.tree_util.tree_map(lambda g: -0.1 * g[None], updates), state

        tx = optax.GradientTransformation(lambda p: optax.EmptyState(), update)
        step = tfl.train_step(lambda s: tfl.sum(w * w), tfl.Optimizer(tx, {"w": w}))
        with pytest.raises(
            TapeError, match=r"turns Param\('w', float32\[3\].*into float32\[1,3\]; a parameter keeps its shape"
        ):
            step()
        assert w.value.tolist() == [1.0, 1.0, 1.0]

    def test_changed_alias_layout_is_rejected_like_optimizer_step(self):
        a = tfl.Param(np.ones(3, F32), name="a")
        b = tfl.Param(np.ones(3, F32), name="b")
        opt = tfl.Optimizer(optax.sgd(0.1), [a, b])
        step = tfl.train_step(lambda s: tfl.sum(a * b), opt)
        step()
        b.storage = a.storage  # tie after the optimizer was built
        with pytest.raises(TapeError, match=r"alias layout of its parameters changed since init"):
            step()

    def test_reinit_between_steps(self):
        params, loss_fn, batch = make_mlp()
        opt = tfl.Optimizer(optax.adam(1e-2), params)
        step = tfl.train_step(loss_fn, opt)
        for _ in range(3):
            step(*batch(0))
        assert int(opt.state[0].count) == 3
        opt.reinit()
        step(*batch(0))
        assert int(opt.state[0].count) == 1 and step.trace_count == 1

    def test_eager_steps_between_compiled_steps(self):
        pe, fe, batch = make_mlp(seed=7)
        pc, fc, _ = make_mlp(seed=7)
        batches = [batch(k) for k in range(6)]
        le, _ = eager_train(pe, fe, optax.adam(1e-2), batches)
        opt = tfl.Optimizer(optax.adam(1e-2), pc)
        step = tfl.train_step(fc, opt, donate=False)
        lc = []
        for k, b in enumerate(batches):
            if k % 2:
                lc.append(float(step(*b)))
            else:
                with tfl.Session() as s:
                    loss = fc(s, *b)
                    lc.append(float(loss))
                    opt.step(s.backward(loss))
        assert max_abs_diff(le, lc) <= TOL
        assert max_abs_diff(values_of(pe), values_of(pc)) <= TOL


# =========================================================================== tape inside the user's jit


class TestSessionInsideUserJit:
    def test_inputs_on_tracers_equal_eager(self):
        def grads_of(xv, wv, bv):
            with tfl.Session() as s:
                x = s.input(xv, requires_grad=True)
                w = s.input(wv, requires_grad=True)
                b = s.input(bv, requires_grad=True)
                h = tfl.tanh(x @ w + b)
                loss = tfl.sum(h * h) + tfl.mean(w * w)
                g = s.backward(loss)
                return loss.value, g[x], g[w], g[b]

        args = (jnp.asarray(_np((4, 5), 0, 1.0)), jnp.asarray(_np((5, 3), 1)), jnp.asarray(_np((3,), 2)))
        eager = grads_of(*args)
        jitted = jax.jit(grads_of)(*args)
        for e, j in zip(eager, jitted):
            assert not isinstance(j, jax.core.Tracer)
            np.testing.assert_allclose(np.asarray(j), np.asarray(e), rtol=1e-5, atol=1e-6)

    def test_tied_params_passed_through_user_jit_equal_eager(self):
        params, loss_fn, batch = make_tied_autoencoder()
        W = params["W"]
        x = batch(0)[0]

        def grad_W(p, x):  # p: the Params pytree, rebuilt by jit as bound views on tracers
            with tfl.Session() as s:
                loss = tfl.mse(
                    tfl.apply("linear", tfl.tanh(tfl.apply("linear", x, p["W"], p["b_enc"])), p["W_dec"].T, p["b_dec"]),
                    x,
                )
                g = s.backward(loss)
                return loss.value, g[p["W"]]

        with tfl.Session() as s:
            loss = loss_fn(s, x)
            g = s.backward(loss)
            eager = (loss.value, g[W])
        jitted = jax.jit(grad_W)(params, x)
        np.testing.assert_allclose(float(jitted[0]), float(eager[0]), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(jitted[1]), np.asarray(eager[1]), rtol=1e-5, atol=1e-6)

    def test_jax_grad_of_session_function(self):
        def f(xv):
            with tfl.Session() as s:
                return tfl.sum(tfl.sin(s.input(xv)) * 2.0).value

        x = jnp.asarray(_np((5,), 4, 1.0))
        np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(f))(x)), 2 * np.cos(np.asarray(x)), rtol=1e-5)


# =========================================================================== sharding (8 simulated CPU devices)

# shared by the subprocess scripts below: a sharding's spec without trailing Nones
_SPEC_OF = textwrap.dedent(
    """
    def spec_of(a):
        from jax.sharding import NamedSharding
        if not isinstance(a.sharding, NamedSharding):
            return "single-device" if len(a.devices()) == 1 else type(a.sharding).__name__
        spec = list(a.sharding.spec)
        while spec and spec[-1] is None:
            spec.pop()
        return str(tuple(spec))
    """
)

_SHARDED_SCRIPT = _SPEC_OF + textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import tapeflow as tfl

    assert len(jax.devices()) == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("data",))

    def build():
        r = np.random.default_rng(0)
        params = {
            "w0": tfl.Param((r.standard_normal((8, 16)) * 0.3).astype(np.float32), name="w0"),
            "b0": tfl.Param(np.zeros(16, np.float32), name="b0"),
            "w1": tfl.Param((r.standard_normal((16, 4)) * 0.3).astype(np.float32), name="w1"),
        }
        params["w1_tied"] = tfl.tie(params["w0"], name="w1_tied")

        def loss_fn(s, x, y):
            h = tfl.tanh(tfl.apply("linear", x, params["w0"], params["b0"]))
            h = h + tfl.tanh(h @ params["w1_tied"].T) @ params["w0"]
            return tfl.cross_entropy(h @ params["w1"], y)

        return params, loss_fn

    def batches():
        r = np.random.default_rng(1)
        return [(jnp.asarray(r.standard_normal((32, 8)), jnp.float32), jnp.asarray(r.integers(0, 4, 32), jnp.int32)) for _ in range(10)]

    def run(specs=None, **kw):
        params, loss_fn = build()
        if specs is not None:
            kw["param_specs"] = specs(params)
        opt = tfl.Optimizer(optax.adam(1e-2), params)
        step = tfl.train_step(loss_fn, opt, **kw)
        losses = [float(step(*b)) for b in batches()]
        # the raw storage cell before Param.value syncs it back to the host device
        spec = spec_of(params["w0"].storage.read(None))
        mu_spec = spec_of(opt.state[0].mu["w0"])
        vals = {k: np.asarray(p.value) for k, p in params.items()}
        return losses, vals, spec, mu_spec, step.trace_count

    def diff(a, b):
        return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))

    single = run()
    dp = run(mesh=mesh)
    by_name = run(mesh=mesh, specs=lambda p: {"w0": P("data", None)})
    by_param = run(mesh=mesh, specs=lambda p: {p["w1_tied"]: P("data", None)})  # any record of the storage
    # value_and_grad under the user's jit with a batch sharded over the mesh
    params, loss_fn = build()
    params = {k: p for k, p in params.items() if k != "w1_tied"}  # each storage once
    vg = jax.jit(tfl.value_and_grad(loss_fn))
    x, y = batches()[0]
    ref = vg(params, x, y)
    shard = NamedSharding(mesh, P("data"))
    got = vg(params, jax.device_put(x, shard), jax.device_put(y, shard))
    vg_diff = diff(ref, got)

    print(json.dumps({
        "vg_diff": vg_diff,
        "dp_loss": diff(single[0], dp[0]), "dp_vals": diff(single[1], dp[1]),
        "sh_loss": diff(single[0], by_name[0]), "sh_vals": diff(single[1], by_name[1]),
        "pr_loss": diff(single[0], by_param[0]), "pr_vals": diff(single[1], by_param[1]),
        "dp_spec": dp[2], "sh_spec": by_name[2], "sh_mu_spec": by_name[3], "pr_spec": by_param[2],
        "traces": [single[4], dp[4], by_name[4], by_param[4]],
        "first_loss": single[0][0], "last_loss": single[0][-1],
    }))
    """
)


def test_data_parallel_and_sharded_params_on_8_simulated_devices():
    out = _run_on_devices(_SHARDED_SCRIPT, 8)
    assert out["vg_diff"] <= TOL, out
    assert out["dp_loss"] <= TOL and out["dp_vals"] <= TOL, out
    assert out["sh_loss"] <= TOL and out["sh_vals"] <= TOL, out
    assert out["pr_loss"] <= TOL and out["pr_vals"] <= TOL, out
    assert out["pr_spec"] == "('data',)", out
    assert out["dp_spec"] == "()", out  # replicated over the mesh
    assert out["sh_spec"] == "('data',)", out  # (8, 16) weight sharded on dim 0
    assert out["sh_mu_spec"] == "('data',)", out  # its Adam slot follows it
    assert out["traces"] == [1, 1, 1, 1], out
    assert out["last_loss"] < out["first_loss"], out


# =========================================================================== multi-process (2 CPU processes x 4 devices)

_MULTIPROCESS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    pid, port = int(sys.argv[1]), int(sys.argv[2])
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    import numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jax.experimental import multihost_utils
    import tapeflow as tfl

    sys.path.insert(0, sys.argv[3])
    from test_functional import make_mlp, mp_batches

    params, loss_fn, _ = make_mlp(seed=11)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    step = tfl.train_step(loss_fn, tfl.Optimizer(optax.adam(1e-2), params), mesh=mesh,
                          param_specs={"w1": P(None, "data")})
    batch = NamedSharding(mesh, P("data"))
    losses = []
    for xs, ys in mp_batches():
        per = xs.shape[0] // jax.process_count()
        lo = jax.process_index() * per
        x = jax.make_array_from_process_local_data(batch, xs[lo:lo + per])
        y = jax.make_array_from_process_local_data(batch, ys[lo:lo + per])
        losses.append(float(step(x, y)))
    vals = {k: multihost_utils.process_allgather(p.storage.read(None), tiled=True).tolist() for k, p in params.items()}
    print(json.dumps({"n_proc": jax.process_count(), "n_dev": len(jax.devices()), "losses": losses, "values": vals,
                      "traces": step.trace_count}))
    jax.distributed.shutdown()
    """
)


def mp_batches():
    r = np.random.default_rng(12)
    return [(r.standard_normal((16, 12)).astype(F32), r.integers(0, 5, 16).astype(np.int32)) for _ in range(8)]


def test_multi_process_cluster_equals_single_device():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = _simulated_devices_env(4)
    here = os.path.dirname(os.path.abspath(__file__))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _MULTIPROCESS_SCRIPT, str(i), str(port), here],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-4000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    params, loss_fn, _ = make_mlp(seed=11)
    ref_losses, _, _ = compiled_train(
        params, loss_fn, optax.adam(1e-2), [tuple(map(jnp.asarray, b)) for b in mp_batches()]
    )
    for out in outs:
        assert out["n_proc"] == 2 and out["n_dev"] == 8 and out["traces"] == 1
        assert max_abs_diff(out["losses"], ref_losses) <= TOL
        assert max_abs_diff({k: np.asarray(v, F32) for k, v in out["values"].items()}, values_of(params)) <= TOL


def test_train_step_static_keyword_arguments_compile_per_value() -> None:
    w = tfl.Param(jnp.array(2.0, jnp.float32), name="w")
    opt = tfl.Optimizer(optax.sgd(0.1), [w])

    def loss_fn(s, x, *, square):
        y = w * x
        return y * y if square else y  # a Python branch: needs a static argument

    step = tfl.train_step(loss_fn, opt, static_argnames=("square",))
    assert float(step(jnp.array(1.0, jnp.float32), square=True)) == 4.0
    assert abs(float(w.value) - (2.0 - 0.1 * 4.0)) < 1e-6
    step(jnp.array(1.0, jnp.float32), square=True)
    assert step.trace_count == 1
    before = float(w.value)
    step(jnp.array(1.0, jnp.float32), square=False)  # d(w*x)/dw = 1
    assert step.trace_count == 2
    assert abs(float(w.value) - (before - 0.1)) < 1e-6


# =========================================================================== the public seams TrainStep uses


_STORAGE_FAST_PATH_SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np, optax
    import tapeflow as tfl

    d0, d1 = jax.devices()[:2]
    out = {}

    def states():
        host = tfl.Storage(jnp.arange(3.0, dtype=jnp.float32))        # host cell only
        cached = tfl.Storage(jnp.arange(3.0, dtype=jnp.float32))
        cached.read(d1)                                                # host current, mirror cached on d1
        mirror = tfl.Storage(jnp.arange(3.0, dtype=jnp.float32))
        mirror.write(jax.device_put(jnp.ones(3, jnp.float32), d1), on_device=True)   # mirror current
        return [host, cached, mirror]

    sts = states()
    flags = [st.host_current for st in sts]
    got = tfl.Storage.read_current_many(sts)
    out["flags"] = flags
    out["read_is_read_none"] = [g is st.read(None) and g is st.read_current() for g, st in zip(got, sts)]
    out["no_sync"] = [st.host_current for st in sts] == flags
    out["current_cell"] = [g is (st.mirror if not f else st.read_host()) for g, st, f in zip(got, sts, flags)]

    a, b = states(), states()
    new = [jax.device_put(jnp.full(3, 7.0, jnp.float32), list(st.read_current().devices())[0]) for st in a]
    tfl.Storage.write_current_many(a, new)
    for st, v in zip(b, new):
        st.write(v, on_device=True)
    out["write_equals_checked_write"] = [
        x.host_current == y.host_current and x.read_current() is y.read_current() and (x.mirror is None) == (y.mirror is None)
        and x.read_current() is (x.mirror if not x.host_current else x.read_host())
        for x, y in zip(a, b)
    ]

    # eager steps on d1 leave the storages' mirrors current; train_step then writes those mirrors
    def build():
        w = tfl.Param(np.linspace(-1, 1, 6).astype(np.float32).reshape(2, 3), name="w")
        c = tfl.Param(np.zeros(3, np.float32), name="c")
        return [w, c], (lambda s, x: tfl.sum(tfl.tanh(x @ w + c) ** 2.0))

    xs = [jax.device_put(jnp.asarray(np.random.default_rng(k).standard_normal((4, 2)), jnp.float32), d1) for k in range(4)]
    pe, fe = build()
    ope = tfl.Optimizer(optax.adam(0.1), pe)
    for x in xs:
        with tfl.Session(device=d1) as s:
            ope.step(s.backward(fe(s, x)))
    pc, fc = build()
    opc = tfl.Optimizer(optax.adam(0.1), pc)
    for x in xs[:2]:
        with tfl.Session(device=d1) as s:
            opc.step(s.backward(fc(s, x)))
    out["mirror_current_before"] = [not p.storage.host_current for p in pc]
    step = tfl.train_step(fc, opc, donate=False)
    for x in xs[2:]:
        step(x)
    out["mirror_on_d1_after"] = [not p.storage.host_current and p.storage.read_current().devices() == {d1} for p in pc]
    out["diff"] = max(float(np.max(np.abs(np.asarray(a.value) - np.asarray(b.value)))) for a, b in zip(pe, pc))
    print(json.dumps(out))
    """
)


def test_storage_fast_path_in_every_cell_state_on_two_devices():
    out = _run_on_devices(_STORAGE_FAST_PATH_SCRIPT, 2)
    assert out["flags"] == [True, True, False], out
    assert out["read_is_read_none"] == out["current_cell"] == out["write_equals_checked_write"] == [True] * 3, out
    assert out["no_sync"], out
    assert out["mirror_current_before"] == out["mirror_on_d1_after"] == [True, True], out
    assert out["diff"] <= TOL, out


class TestTrainStepSeams:
    def test_train_step_is_train_step_class_with_the_same_options(self):
        import inspect

        from tapeflow._train._functional import TrainStepOptions

        kw_only = [n for n, p in inspect.signature(tfl.TrainStep).parameters.items() if p.kind is p.KEYWORD_ONLY]
        assert sorted(kw_only) == sorted(TrainStepOptions.__annotations__)
        w = tfl.Param(jnp.array(1.0, jnp.float32), name="w")
        opt = tfl.Optimizer(optax.sgd(0.1), [w])
        step = tfl.train_step(lambda s, x: w * x, opt, donate=False, seed=3, has_aux=False, static_argnames="mode")
        assert isinstance(step, tfl.TrainStep)
        assert (step.donate, step.seed, step.static_argnames, step.mesh, step.data_axis) == (
            False,
            3,
            ("mode",),
            None,
            "data",
        )
        with pytest.raises(TypeError):
            tfl.train_step(lambda s, x: w * x, opt, donat=False)
        assert ">>>" in tfl.train_step.__doc__

    def test_per_call_python_work_is_flat_in_the_number_of_parameters(self):
        import sys

        def calls_per_step(n):
            ws = [tfl.Param(np.full(2, 0.5, F32), name=f"w{i}") for i in range(n)]
            step = tfl.train_step(
                lambda s, x: sum((tfl.sum(w * x) for w in ws[1:]), start=tfl.sum(ws[0] * x)),
                tfl.Optimizer(optax.adam(1e-3), ws),
            )
            x = jnp.ones(2, jnp.float32)
            jax.block_until_ready(step(x))
            count = [0]

            def prof(frame, event, arg):
                if event == "call" and frame.f_code.co_filename.endswith(("_functional.py", "_optim.py", "_params.py")):
                    count[0] += 1

            sys.setprofile(prof)
            try:
                step(x)
            finally:
                sys.setprofile(None)
            return count[0]

        # __call__, _call, check_layout, read_current_many, Optimizer.install, write_current_many
        # (+ two list comprehensions): none per parameter
        assert calls_per_step(2) == calls_per_step(24) <= 8


_SLOT_PLACEMENT_SCRIPT = _SPEC_OF + textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import tapeflow as tfl

    mesh = Mesh(np.array(jax.devices()), ("data",))

    def adam_of(state):
        return next(n for n in jax.tree_util.tree_leaves(state, is_leaf=lambda n: isinstance(n, optax.ScaleByAdamState))
                    if isinstance(n, optax.ScaleByAdamState))

    txs = {
        "multi": lambda: optax.multi_transform({"x": optax.adam(1e-2), "y": optax.sgd(0.1, momentum=0.9)},
                                               {"w0": "x", "b0": "y", "w1": "x"}),
        "masked": lambda: optax.masked(optax.adam(1e-2), {"w0": True, "b0": False, "w1": True}),
        "inject": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
        "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
    }

    def run(name, **kw):
        r = np.random.default_rng(0)
        params = {"w0": tfl.Param((r.standard_normal((8, 16)) * 0.3).astype(np.float32), name="w0"),
                  "b0": tfl.Param(np.zeros(16, np.float32), name="b0"),
                  "w1": tfl.Param((r.standard_normal((16, 4)) * 0.3).astype(np.float32), name="w1")}
        loss_fn = lambda s, x, y: tfl.cross_entropy(tfl.tanh(tfl.apply("linear", x, params["w0"], params["b0"])) @ params["w1"], y)
        opt = tfl.Optimizer(txs[name](), params)
        step = tfl.train_step(loss_fn, opt, **kw)
        r = np.random.default_rng(1)
        losses = [float(step(jnp.asarray(r.standard_normal((32, 8)), jnp.float32), jnp.asarray(r.integers(0, 4, 32), jnp.int32)))
                  for _ in range(3)]
        adam = adam_of(opt.state)
        specs = {"mu_w0": spec_of(adam.mu["w0"]), "nu_w0": spec_of(adam.nu["w0"]), "mu_w1": spec_of(adam.mu["w1"]),
                 "count": spec_of(adam.count)}
        if name == "inject":
            specs["lr"] = spec_of(opt.state.hyperparams["learning_rate"])
        if name == "multi":
            specs["trace_b0"] = spec_of(opt.state.inner_states["y"].inner_state[0].trace["b0"])
        return losses, specs, step.trace_count

    out = {}
    for name in txs:
        single, _, _ = run(name)
        sharded, specs, traces = run(name, mesh=mesh, param_specs={"w0": P("data", None)})
        out[name] = {"diff": max(abs(a - b) for a, b in zip(single, sharded)), "specs": specs, "traces": traces}
    print(json.dumps(out))
    """
)


def test_optimizer_slots_follow_their_parameter_sharding_for_composite_optax_states():
    out = _run_on_devices(_SLOT_PLACEMENT_SCRIPT, 8)
    for name, got in out.items():
        assert got["diff"] <= TOL and got["traces"] == 1, (name, got)
        specs = got["specs"]
        # w0 is sharded on dim 0: its Adam moments follow it; w1's and the step count are replicated
        assert specs["mu_w0"] == specs["nu_w0"] == "('data',)", (name, specs)
        assert specs["mu_w1"] == specs["count"] == "()", (name, specs)
        assert specs.get("lr", "()") == "()" and specs.get("trace_b0", "()") == "()", (name, specs)
