"""A run restored from a checkpoint continues bit for bit as the uninterrupted run, on every path.

Each test trains a model with Dropout and BatchNorm for ``N`` steps without a break, then trains a
fresh copy ``K`` steps, saves, restores into a freshly built model, optimizer and session (or
TrainStep) and trains the remaining ``N - K``: the losses of every step and the final parameters
must be equal with ``==`` (not close).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tapeflow as tfl

pytestmark = pytest.mark.filterwarnings(
    "ignore:(?s)Exception ignored.*Event loop is closed:pytest.PytestUnraisableExceptionWarning"
)

N, K = 8, 4
X = jnp.asarray(np.random.default_rng(0).standard_normal((16, 6)), jnp.float32)
Y = jnp.arange(16) % 3


def build(seed: int = 0):
    """A fresh model (Linear, BatchNorm, ReLU, Dropout, Linear), its AdamW optimizer, initial values from ``seed``."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    m = tfl.nn.Sequential(
        tfl.nn.Linear(6, 16, key=k1),
        tfl.nn.BatchNorm1d(16),
        tfl.relu,
        tfl.nn.Dropout(0.3),
        tfl.nn.Linear(16, 3, key=k2),
    )
    return m, tfl.Optimizer(optax.adamw(1e-2), m)


def loss_of(m, x, y):
    return tfl.cross_entropy(m(x), y)


def session_steps(m, opt, s, n):
    losses = []
    for _ in range(n):
        with s:
            loss = loss_of(m, s.input(X), Y)
            opt.step(s.backward(loss))
            losses.append(np.asarray(loss.value))
    return losses


def params(m):
    return [np.asarray(p.value) for _, p in m.parameter_records()]


def run(path: str, tmp_path, resume_at: int | None):
    """The losses and final parameter values of N steps on ``path``; with ``resume_at``: saved, restored there."""
    m, opt = build(0)
    lazy = path == "lazy"
    if path == "train_step":
        rng = tfl.train_step(lambda s, x, y: loss_of(m, x, y), opt, seed=11)
        steps = lambda n: [np.asarray(rng(X, Y)) for _ in range(n)]  # noqa: E731
    else:
        rng = tfl.Session(seed=11, lazy=lazy)
        steps = lambda n: session_steps(m, opt, rng, n)  # noqa: E731
    if resume_at is None:
        return steps(N), params(m)
    losses = steps(resume_at)
    ckpt = tmp_path / f"ckpt-{path}-{resume_at}"
    tfl.save(ckpt, m, opt, rng)
    del m, opt, rng, steps
    m, opt = build(1)  # other initial values, and another seed below: the checkpoint must set them all
    if path == "train_step":
        rng = tfl.train_step(lambda s, x, y: loss_of(m, x, y), opt, seed=99)
        tfl.restore(ckpt, m, opt, rng)
        losses += [np.asarray(rng(X, Y)) for _ in range(N - resume_at)]
    else:
        rng = tfl.Session(seed=99, lazy=lazy)
        tfl.restore(ckpt, m, opt, rng)
        losses += session_steps(m, opt, rng, N - resume_at)
    return losses, params(m)


def assert_bitwise(a, b):
    (la, pa), (lb, pb) = a, b
    assert [x.tobytes() for x in la] == [x.tobytes() for x in lb], (
        [float(x) for x in la],
        [float(x) for x in lb],
    )
    for x, y in zip(pa, pb):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()


@pytest.mark.parametrize("path", ["eager", "lazy", "train_step"])
def test_a_restored_run_continues_bit_for_bit(path, tmp_path):
    whole = run(path, tmp_path, None)
    assert_bitwise(run(path, tmp_path, K), whole)


@pytest.mark.parametrize("path", ["eager", "lazy", "train_step"])
@pytest.mark.parametrize("at", [1, 2, 7])
def test_a_restore_at_any_step_continues_bit_for_bit(path, at, tmp_path):
    assert_bitwise(run(path, tmp_path, at), run(path, tmp_path, None))


def test_a_train_step_checkpoint_holds_its_seed_and_step_counter(tmp_path):
    m, opt = build(0)
    step = tfl.train_step(lambda s, x, y: loss_of(m, x, y), opt, seed=5)
    for _ in range(3):
        step(X, Y)
    tfl.save(tmp_path / "c", m, opt, step)
    m2, opt2 = build(1)
    step2 = tfl.train_step(lambda s, x, y: loss_of(m2, x, y), opt2, seed=0)
    step2(X, Y)  # traced with seed 0: the restored seed must not reuse that program
    tfl.restore(tmp_path / "c", m2, opt2, step2)
    assert (step2.seed, step2.step_count, step2.rng_counter) == (5, 3, 3)
    assert np.asarray(step(X, Y)).tobytes() == np.asarray(step2(X, Y)).tobytes()


def test_save_and_restore_name_what_they_take_for_the_rng_state(tmp_path):
    m, opt = build(0)
    with pytest.raises(TypeError, match=r"must be a tfl\.Session or a tfl\.TrainStep.*got int"):
        tfl.save(tmp_path / "c", m, opt, 3)
    assert not (tmp_path / "c").exists()
    tfl.save(tmp_path / "c", m, opt, tfl.Session(seed=1))
    before = params(m)
    with pytest.raises(TypeError, match=r"must be a tfl\.Session or a tfl\.TrainStep"):
        tfl.restore(tmp_path / "c", m, opt, object())
    assert all(a.tobytes() == b.tobytes() for a, b in zip(params(m), before))
    step = tfl.train_step(lambda s, x, y: loss_of(m, x, y), opt)
    with pytest.raises(ValueError, match=r"counter must be an int in \[0, 2\*\*32\)"):
        step.set_rng_state(counter=2**32)
    with pytest.raises(ValueError, match="seed must be an int"):
        step.set_rng_state(seed=1.5, counter=2)
    assert (step.seed, step.step_count) == (0, 0)  # nothing half set
