"""Mixed precision: Session(compute_dtype=...) against pure-JAX references with the same casts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import PATHS, one_step

import tapeflow as tfl
from tapeflow import TapeError
from tapeflow._core import _registry as R
from tapeflow._core._precision import Precision

BF16 = np.dtype(jnp.bfloat16)
F32 = np.dtype(np.float32)
RNG = np.random.default_rng(0)


def _model():
    w = tfl.Param(jnp.asarray(RNG.normal(size=(6, 5)).astype(F32) * 0.5))
    b = tfl.Param(jnp.asarray(RNG.normal(size=(5,)).astype(F32) * 0.1))
    x = jnp.asarray(RNG.normal(size=(8, 6)).astype(F32))
    y = jnp.asarray(RNG.integers(0, 5, 8).astype(np.int32))
    return w, b, x, y


def _pure(w, b, x, y, dt):
    """The policy written out by hand: operands cast to dt, the loss computed in float32."""
    h = jnp.tanh(x.astype(dt) @ w.astype(dt) + b.astype(dt))
    logits = (h * 2).astype(jnp.float32)
    return jnp.mean(-jax.nn.log_softmax(logits)[jnp.arange(8), y])


@pytest.mark.parametrize("dt", [BF16, np.dtype(np.float16)], ids=["bfloat16", "float16"])
def test_policy_casts_operands_and_gradients_come_back_in_the_parameters_dtype(dt):
    w, b, x, y = _model()
    with tfl.Session(compute_dtype=dt) as s:
        h = tfl.tanh(s.input(x) @ w + b)
        logits = h * 2.0
        loss = tfl.cross_entropy(logits, s.input(y))
        assert (h.dtype, logits.dtype, loss.dtype) == (dt, dt, F32)
        g = s.backward(loss)
        gw, gb, value = np.asarray(g[w]), np.asarray(g[b]), float(loss)
    assert gw.dtype == gb.dtype == F32
    ref_loss, (rw, rb) = jax.value_and_grad(_pure, argnums=(0, 1))(w.value, b.value, x, y, dt)
    # op-by-op VJPs round in the compute dtype where XLA's fused reference may not: a few ulps of dt
    tol = 4 * float(jnp.finfo(dt).eps)
    np.testing.assert_allclose(value, float(ref_loss), rtol=tol)
    np.testing.assert_allclose(gw, rw, rtol=tol, atol=tol * float(np.max(np.abs(rw))))
    np.testing.assert_allclose(gb, rb, rtol=tol, atol=tol * float(np.max(np.abs(rb))))
    # and close to the float32 gradient, within the compute dtype's precision
    full = jax.grad(_pure, argnums=0)(w.value, b.value, x, y, jnp.float32)
    np.testing.assert_allclose(gw, full, atol=5e-2 if dt == BF16 else 5e-3)


def test_mixing_float32_and_the_compute_dtype_follows_the_policy_instead_of_failing():
    a = jnp.ones((2, 3), jnp.float32)
    c = jnp.ones((3,), jnp.bfloat16)
    with tfl.Session() as s:
        with pytest.raises(TapeError):
            tfl.apply("add", s.input(a), s.input(c))  # the registry's op does not promote
        assert (s.input(a) + s.input(c)).dtype == F32  # the operator promotes as PyTorch does
    with tfl.Session(compute_dtype=jnp.bfloat16) as s:
        out = s.input(a) + s.input(c)
        assert out.dtype == BF16
        total = tfl.sum(out)  # a reduction: float32
        assert total.dtype == F32 and float(total) == 12.0
        assert s.input(a).reshape((3, 2)).dtype == F32  # layout ops keep their dtype
        assert s.input(c).astype("float32").dtype == F32  # astype does what it is asked


def test_policy_with_an_optimizer_keeps_float32_master_weights():
    w, b, x, y = _model()
    opt = tfl.Optimizer(optax.sgd(0.1), [w, b])
    ref_w, ref_b = w.value, b.value
    for _ in range(3):
        with tfl.Session(compute_dtype=jnp.bfloat16) as s:
            loss = tfl.cross_entropy(tfl.tanh(s.input(x) @ w + b) * 2.0, s.input(y))
            opt.step(s.backward(loss))
        gw, gb = jax.grad(_pure, argnums=(0, 1))(ref_w, ref_b, x, y, BF16)
        ref_w, ref_b = ref_w - 0.1 * gw, ref_b - 0.1 * gb
    assert w.value.dtype == F32
    tol = 4 * float(jnp.finfo(jnp.bfloat16).eps) * 0.1 * 3  # three steps of lr 0.1, a few bf16 ulps each
    np.testing.assert_allclose(w.value, ref_w, atol=tol)
    np.testing.assert_allclose(b.value, ref_b, atol=tol)


def test_casts_inside_no_grad_are_untracked_and_bad_policies_are_refused():
    w = tfl.Param(jnp.ones(2))
    with tfl.Session(compute_dtype="bfloat16") as s:
        with s.no_grad():
            y = w * 2.0
        assert not y.requires_grad and y.dtype == BF16
        assert all(not nd.requires_grad for nd in s.tape)
    for bad in ("int32", "nonsense", bool):
        with pytest.raises(TapeError, match="compute_dtype"):
            tfl.Session(compute_dtype=bad)


def test_float16_with_a_loss_scale_and_optax_apply_if_finite_skips_overflowing_steps():
    """float16's range is small: scale the loss, unscale in the optax chain, skip non-finite steps (optax)."""
    scale = 2.0**10
    w = tfl.Param(jnp.asarray(np.linspace(-1, 1, 6, dtype=F32).reshape(3, 2)))
    tx = optax.apply_if_finite(optax.chain(optax.scale(1.0 / scale), optax.sgd(0.1)), max_consecutive_errors=5)
    opt = tfl.Optimizer(tx, [w])

    def step(x):
        with tfl.Session(compute_dtype=jnp.float16) as s:
            loss = tfl.mean((s.input(x) @ w) ** 2.0)
            opt.step(s.backward(loss * scale))

    x = np.ones((4, 3), F32)
    before = np.asarray(w.value)
    step(x)
    after = np.asarray(w.value)
    g = jax.grad(lambda v: jnp.mean((x @ v) ** 2))(before)
    np.testing.assert_allclose(after, before - 0.1 * g, atol=2e-3)  # unscaled, float16 precision
    step(x * 1e4)  # (x w)^2 * scale overflows float16: the gradient is inf, the step is skipped
    np.testing.assert_array_equal(np.asarray(w.value), after)
    assert int(opt.state.notfinite_count) == 1  # optax counted the skipped step


@pytest.mark.parametrize("path", ["train_step", "value_and_grad"])
def test_compiled_paths_follow_the_same_policy_as_the_eager_session(path):
    def loss_fn(s, w, b, x, y):
        h = tfl.tanh(s.input(x) @ w + b)
        return tfl.cross_entropy(h * 2.0, s.input(y)), h

    results = []
    for mode in ("eager", path):
        w, b, x, y = (tfl.Param(jnp.asarray(v)) if i < 2 else v for i, v in enumerate(_fixed()))
        opt = tfl.Optimizer(optax.sgd(0.1), [w, b])
        step = tfl.train_step(lambda s, x, y: loss_fn(s, w, b, x, y), opt, compute_dtype="bfloat16", has_aux=True)
        f = jax.jit(tfl.value_and_grad(lambda s, x, y: loss_fn(s, w, b, x, y), has_aux=True, compute_dtype="bfloat16"))
        for _ in range(2):
            if mode == "eager":
                with tfl.Session(compute_dtype=jnp.bfloat16) as s:
                    loss, h = loss_fn(s, w, b, x, y)
                    h = h.value
                    opt.step(s.backward(loss))
            elif mode == "train_step":
                loss, h = step(x, y)
            else:
                (loss, h), g = f([w, b], x, y)
                opt.step(dict(zip([w, b], g)))
            assert h.dtype == BF16 and loss.dtype == F32  # the policy holds inside the compiled program too
        results.append([np.asarray(w.value), np.asarray(b.value)])
    # XLA fuses the compiled program's bfloat16 ops (keeping some intermediates wider): the two runs
    # stay within about one bfloat16 ulp of each update
    for a, c in zip(*results):
        assert c.dtype == F32
        np.testing.assert_allclose(c, a, atol=5e-4)


def _fixed():
    r = np.random.default_rng(7)
    return (
        r.normal(size=(6, 5)).astype(F32) * 0.5,
        r.normal(size=(5,)).astype(F32) * 0.1,
        jnp.asarray(r.normal(size=(8, 6)).astype(F32)),
        jnp.asarray(r.integers(0, 5, 8).astype(np.int32)),
    )


def test_dynamic_loss_scale_skips_overflow_shrinks_and_grows_the_scale():
    w = tfl.Param(jnp.asarray(np.linspace(-1, 1, 6, dtype=F32).reshape(3, 2)))
    opt = tfl.Optimizer(tfl.dynamic_loss_scale(optax.sgd(0.1), initial_scale=2.0**10, period=2), [w])
    ref_w = np.asarray(w.value)

    def step(x):
        with tfl.Session(compute_dtype=jnp.float16) as s:
            loss = tfl.mean((s.input(x) @ w) ** 2.0)
            opt.step(s.backward(loss * opt.state.scale))

    x = np.ones((4, 3), F32)
    scales = []
    for big in (False, True, False, False, False):
        step(x * 1e4 if big else x)
        scales.append(float(opt.state.scale))
        if not big:  # a finite step: the unscaled sgd update (float16 forward)
            ref_w = ref_w - 0.1 * np.asarray(jax.grad(lambda v: jnp.mean((x @ v) ** 2))(ref_w))
        np.testing.assert_allclose(np.asarray(w.value), ref_w, atol=5e-3)
    # 1 finite step; overflow: skipped, scale halved; then 2 finite steps in a row double it; and 1 more
    assert scales == [2.0**10, 2.0**9, 2.0**9, 2.0**10, 2.0**10]
    assert int(opt.state.skipped) == 1


def test_each_op_declares_the_dtype_it_computes_in():
    """The policy reads ``OpDef.precision``; these are the ops that do not follow the compute dtype."""
    builtin = [n for n in tfl.ops() if not tfl.REGISTRY[n].user]  # user ops other tests left for the collector
    by = {p: {n for n in builtin if tfl.REGISTRY[n].precision == p} for p in ("float32", "layout")}
    losses = {"sum", "mean", "softmax", "log_softmax", "logsumexp", "cross_entropy", "mse", "layer_norm"}
    assert by["float32"] == losses | {"exp", "log", "pow", "softplus"}  # torch.autocast's float32 list has these
    layout = {"astype", "reshape", "transpose", "permute", "squeeze", "expand_dims", "broadcast_to", "index"}
    assert by["layout"] == layout | {"take", "gather", "stop_gradient", "vjp"}
    p = Precision(jnp.bfloat16)
    assert [p.target(n) for n in ("mse", "take", "matmul", "no_such_op")] == [F32, None, BF16, None]
    with pytest.raises(ValueError, match="precision='f32' must be one of"):
        R.op("test_precision_bad", precision="f32")  # type: ignore[arg-type]
    assert "test_precision_bad" not in tfl.REGISTRY


@pytest.mark.parametrize("path", PATHS)
def test_scalar_arithmetic_computes_in_float32_so_a_float16_loss_scale_of_2_16_stays_finite(path):
    """``loss * 2.0**16`` is inf in float16; all-scalar operands compute in float32 on every path."""
    scale = 2.0**16
    w = tfl.Param(jnp.asarray(np.linspace(-1, 1, 6, dtype=F32).reshape(3, 2)))
    tx = optax.apply_if_finite(optax.chain(optax.scale(1.0 / scale), optax.sgd(0.1)), max_consecutive_errors=5)
    opt = tfl.Optimizer(tx, [w])
    x = np.full((4, 3), 0.1, F32)
    before = np.asarray(w.value)
    scaled = one_step(
        path, lambda s: tfl.mean(s.input(x) @ w) * jnp.asarray(scale, jnp.float32), opt, compute_dtype=jnp.float16
    )
    assert scaled.dtype == F32 and np.isfinite(float(scaled))
    assert int(opt.state.notfinite_count) == 0  # the finite step was taken
    g = jax.grad(lambda v: jnp.mean(x @ v))(before)
    np.testing.assert_allclose(np.asarray(w.value), before - 0.1 * g, atol=1e-3)
    p = Precision(jnp.float16)
    f16 = np.dtype(np.float16)
    assert p.targets("mul", [((), F32), ((), f16)]) == [None, F32]
    assert p.targets("mul", [((), np.dtype(np.float64)), ((), F32)]) == [None, np.dtype(np.float64)]  # widest
    assert p.targets("mul", [((3,), F32), ((), F32)]) == [f16, f16]  # not all scalars: the compute dtype


@pytest.mark.parametrize("path", ["eager", "lazy"])
def test_dynamic_loss_scale_grows_past_2_15_under_float16_and_skips_no_finite_step(path):
    """The documented ``loss * opt.state.scale``: the scale doubles every finite step (period 1) past 2**15."""
    w = tfl.Param(jnp.asarray(np.linspace(-1, 1, 6, dtype=F32).reshape(3, 2)))
    opt = tfl.Optimizer(tfl.dynamic_loss_scale(optax.sgd(0.1), initial_scale=2.0**15, period=1), [w])
    x = np.full((4, 3), 0.1, F32)
    ref_w = np.asarray(w.value)
    for _ in range(3):
        one_step(path, lambda s: tfl.mean((s.input(x) @ w) ** 2.0) * opt.state.scale, opt, compute_dtype=jnp.float16)
        ref_w = ref_w - 0.1 * np.asarray(jax.grad(lambda v: jnp.mean((x @ v) ** 2))(ref_w))
        np.testing.assert_allclose(np.asarray(w.value), ref_w, atol=1e-3)
    assert float(opt.state.scale) == 2.0**18 and int(opt.state.skipped) == 0
