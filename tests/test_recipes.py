"""Training recipes (issue 26): gradient accumulation, readable gradient norms, microbatched train_step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tapeflow as tfl

F64 = jnp.float64


def _tied_ae(key=0):
    """A tied autoencoder: W used twice (encoder and, transposed, decoder)."""
    w = tfl.Param(jax.random.normal(jax.random.key(key), (6, 3), F64) * 0.5, name="W")
    b = tfl.Param(jnp.zeros(3, F64), name="b")
    wt = tfl.tie(w, name="W.dec")

    def loss(s, x):
        h = tfl.tanh(tfl.matmul(x, w) + b)
        return tfl.mean((tfl.matmul(h, wt.T) - x) ** 2)

    return [w, b, wt], loss


def _pure_ae(p, x):
    h = jnp.tanh(x @ p["W"] + p["b"])
    return jnp.mean((h @ p["W"].T - x) ** 2)


X = jax.random.normal(jax.random.key(5), (16, 6), F64)


@pytest.mark.parametrize("lazy", [False, True])
def test_k_backward_calls_summed_equal_one_backward_of_the_whole_batch(lazy):
    params, loss = _tied_ae()
    w, b, _ = params
    s = tfl.Session(lazy=lazy)
    total = 0
    for part in jnp.split(X, 4):
        with s:
            total = total + s.backward(loss(s, part))
    mean = total / 4
    oracle = jax.grad(_pure_ae)({"W": w.value, "b": b.value}, X)  # a mean loss: the mean of 4 equal parts
    np.testing.assert_allclose(np.asarray(mean[w]), np.asarray(oracle["W"]), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(np.asarray(mean[b]), np.asarray(oracle["b"]), rtol=1e-12, atol=1e-14)
    assert len(mean.groups) == 2  # the tie is one entry: its two uses were summed before the addition
    # scalar forms and sum()
    np.testing.assert_allclose(np.asarray((0.25 * total)[w]), np.asarray(mean[w]), rtol=1e-15)
    np.testing.assert_allclose(np.asarray(sum([total, total])[b]), 2 * np.asarray(total[b]), rtol=1e-15)
    # one optimizer step over the accumulated gradients equals optax on the oracle
    opt = tfl.Optimizer(optax.adam(1e-2), [w, b])
    tx = optax.adam(1e-2)
    ref = {"W": w.value, "b": b.value}
    upd, _ = tx.update(oracle, tx.init(ref), ref)
    ref = optax.apply_updates(ref, upd)
    opt.step(mean)
    np.testing.assert_allclose(np.asarray(w.value), np.asarray(ref["W"]), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(b.value), np.asarray(ref["b"]), rtol=1e-12)


def test_grads_arithmetic_refuses_what_it_cannot_mean():
    params, loss = _tied_ae()
    with tfl.Session() as s:
        g = s.backward(loss(s, X))
        with pytest.raises(TypeError):
            g + 1.0
        with pytest.raises(TypeError):
            g * jnp.ones(3)
        other = tfl.Param(jnp.ones((2, 2), F64), name="o")
        h = g + s.backward(tfl.sum(other * other))  # disjoint parameters: both kept
        assert len(h.groups) == 3
        with pytest.raises(KeyError, match="does not belong"):
            h[s.input(jnp.ones(2))]  # a sum has no leaves of any recording


def test_global_norm_and_clip_grad_norm_match_torch_on_a_tied_model():
    torch = pytest.importorskip("torch")
    params, loss = _tied_ae()
    w, b, _ = params
    tw = torch.tensor(np.asarray(w.value), requires_grad=True)
    tb = torch.tensor(np.asarray(b.value), requires_grad=True)
    tx = torch.tensor(np.asarray(X))
    h = torch.tanh(tx @ tw + tb)
    (((h @ tw.T) - tx) ** 2).mean().backward()
    with tfl.Session() as s:
        g = s.backward(loss(s, X))
        norm = g.global_norm()
        clipped, before = tfl.clip_grad_norm(g, 0.05)
        kept, _ = tfl.clip_grad_norm(g, 1e3)  # a large bound leaves the gradients (almost exactly) as they were
    ref_norm = torch.nn.utils.clip_grad_norm_([tw, tb], 0.05)
    np.testing.assert_allclose(float(norm), float(ref_norm), rtol=1e-12)
    np.testing.assert_allclose(float(before), float(ref_norm), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(clipped[w]), tw.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(clipped[b]), tb.grad.numpy(), rtol=1e-12)
    assert float(clipped.global_norm()) == pytest.approx(0.05, rel=1e-4)
    np.testing.assert_array_equal(np.asarray(kept[w]), np.asarray(g[w]))
    with pytest.raises(ValueError, match="max_norm must be a positive number"):
        tfl.clip_grad_norm(g, -1.0)


def test_clip_grad_norm_in_a_lazy_session_equals_eager():
    params, loss = _tied_ae()
    w = params[0]
    out = []
    for lazy in (False, True):
        with tfl.Session(lazy=lazy) as s:
            clipped, norm = tfl.clip_grad_norm(s.backward(loss(s, X)), 0.01)
            out.append((float(norm), np.asarray(clipped[w])))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-12)
    np.testing.assert_allclose(out[0][1], out[1][1], rtol=1e-12)


def _mlp_step(k, **opts):
    m = tfl.nn.MLP([6, 16, 3], key=jax.random.key(0), dtype=F64)
    opt = tfl.Optimizer(optax.adam(1e-2), m)
    step = tfl.train_step(lambda s, x, y: tfl.cross_entropy(m(x), y), opt, microbatches=k, **opts)
    return m, step


def test_microbatches_equal_the_full_batch_step():
    y = jnp.arange(16) % 3
    m1, full = _mlp_step(1)
    m8, micro = _mlp_step(8)
    for _ in range(3):
        np.testing.assert_allclose(float(micro(X, y)), float(full(X, y)), rtol=1e-12)
    for a, b in zip(m1.parameters(), m8.parameters()):
        np.testing.assert_allclose(np.asarray(a.value), np.asarray(b.value), rtol=1e-10, atol=1e-13)
    assert micro.trace_count == 1 and micro.step_count == 3
    with pytest.raises(tfl.TapeError, match="16 rows along its first axis, which do not split into microbatches=5"):
        _mlp_step(5)[1](X, y)
    with pytest.raises(ValueError, match="microbatches must be a positive int"):
        _mlp_step(0)


def test_microbatches_stack_python_numbers_in_aux_like_every_leaf():
    y = jnp.arange(16) % 3
    for k in (1, 2, 4):
        m = tfl.nn.MLP([6, 16, 3], key=jax.random.key(0), dtype=F64)
        opt = tfl.Optimizer(optax.adam(1e-2), m)

        def loss_fn(s, x, y):
            loss = tfl.cross_entropy(m(x), y)
            return loss, {"loss": loss, "scale": 0.5, "count": 3, "none": None}

        step = tfl.train_step(loss_fn, opt, microbatches=k, has_aux=True)
        _, aux = step(X, y)
        want = () if k == 1 else (k,)
        assert np.shape(aux["loss"]) == want and np.shape(aux["scale"]) == want and np.shape(aux["count"]) == want
        np.testing.assert_array_equal(np.asarray(aux["scale"]), np.full(want, 0.5))
        np.testing.assert_array_equal(np.asarray(aux["count"]), np.full(want, 3))
        assert aux["none"] is None


def test_microbatches_hold_one_part_of_the_activations():
    """Peak live bytes of the program (XLA's temporaries), k=1 vs k=8, same total batch, measured here."""
    wide = tfl.nn.MLP([64, 256, 256, 10], key=jax.random.key(0))  # activations (8192 rows) outweigh the weights
    x = jnp.ones((8192, 64), jnp.float32)
    y = jnp.zeros(8192, jnp.int32)
    sizes = {}
    for k in (1, 8):
        opt = tfl.Optimizer(optax.sgd(0.1), wide)
        step = tfl.train_step(lambda s, x, y: tfl.cross_entropy(wide(x), y), opt, microbatches=k)
        sizes[k] = step.lower(x, y).compile().memory_analysis().temp_size_in_bytes
        assert step.step_count == 0  # lowering ran nothing
    assert sizes[8] < 0.5 * sizes[1], sizes


def test_microbatches_move_batchnorm_statistics_as_separate_steps_and_stack_aux():
    bn = tfl.nn.BatchNorm1d(6, dtype=F64)
    lin = tfl.nn.Linear(6, 1, key=jax.random.key(1), dtype=F64)

    def loss_fn(s, x):
        out = lin(bn(x))
        return tfl.mean(out * out), tfl.sum(out)

    expected_mean = np.asarray(bn.running_mean.value)
    for part in np.split(np.asarray(X), 2):  # two separate forwards in train mode, by the running-mean formula
        expected_mean = 0.9 * expected_mean + 0.1 * part.mean(0)
    step = tfl.train_step(loss_fn, tfl.Optimizer(optax.sgd(0.0), [lin.weight, lin.bias]), microbatches=2, has_aux=True)
    loss, aux = step(X)
    np.testing.assert_allclose(np.asarray(bn.running_mean.value), expected_mean, rtol=1e-12)
    assert aux.shape == (2,)


def test_return_stats_give_the_gradient_and_update_norms_of_the_same_step():
    y = jnp.arange(16) % 3
    m, step = _mlp_step(1, return_stats=True)
    before = [np.asarray(p.value) for p in m.parameters()]
    with tfl.Session() as s:  # the eager gradients of the same state, for the oracle
        g = s.backward(tfl.cross_entropy(m(s.input(X)), y))
        eager_norm = float(g.global_norm())
    loss, stats = step(X, y)
    assert isinstance(stats, tfl.StepStats)
    np.testing.assert_allclose(float(stats.grad_norm), eager_norm, rtol=1e-10)
    moved = np.sqrt(sum(((np.asarray(p.value) - b) ** 2).sum() for p, b in zip(m.parameters(), before)))
    np.testing.assert_allclose(float(stats.update_norm), moved, rtol=1e-10)
    assert step.trace_count == 1
    _, stats8 = _mlp_step(4, return_stats=True)[1](X, y)
    np.testing.assert_allclose(float(stats8.grad_norm), eager_norm, rtol=1e-10)


@pytest.mark.parametrize("lazy", [False, True])
def test_a_refused_step_over_accumulated_grads_puts_back_every_microbatch_state(lazy):
    bn = tfl.nn.BatchNorm1d(6, dtype=F64)
    lin = tfl.nn.Linear(6, 1, key=jax.random.key(1), dtype=F64)
    opt = tfl.Optimizer(optax.sgd(0.1), [lin.weight, lin.bias], check_finite=True)
    start = np.asarray(bn.running_mean.value)
    w0 = np.asarray(lin.weight.value)
    s = tfl.Session(lazy=lazy)

    def accumulate():
        total = 0
        for part in jnp.split(X, 2):
            with s:
                total = total + s.backward(tfl.mean(lin(bn(s.input(part))) ** 2))
        return total

    total = accumulate()
    assert not np.array_equal(np.asarray(bn.running_mean.value), start)  # two forwards wrote the statistics
    with pytest.raises(tfl.TapeError, match="non-finite"):
        opt.step(total * float("inf"))
    np.testing.assert_array_equal(np.asarray(bn.running_mean.value), start)  # both writes taken back
    np.testing.assert_array_equal(np.asarray(lin.weight.value), w0)
    opt.step(accumulate() / 2)  # a step that succeeds makes the writes final
    moved = np.asarray(bn.running_mean.value)
    assert not np.array_equal(moved, start) and not np.array_equal(np.asarray(lin.weight.value), w0)
