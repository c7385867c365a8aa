"""A session outlives the models it trained: a dropped model's Params and arrays are freed, on every path.

A notebook rebuilds its model in the same session. What the session keeps from its last recording to
replay the next one (the outline, the backward plan) and the optimizer's fused step plan must not keep
an old model alive: after ``del model, opt`` and a collection, weak references to its Params and to
their arrays are dead while the session is still alive. A recording that is still open holds its
Params as an eager recording does.
"""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tapeflow as tfl

X = jnp.asarray(np.random.default_rng(0).standard_normal((8, 6)), jnp.float32)
Y = jnp.arange(8) % 3


def build(seed: int = 0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    m = tfl.nn.Sequential(
        tfl.nn.Linear(6, 16, key=k1),
        tfl.nn.BatchNorm1d(16),
        tfl.relu,
        tfl.nn.Dropout(0.3),
        tfl.nn.Linear(16, 3, key=k2),
    )
    return m, tfl.Optimizer(optax.adamw(1e-2), m)


def loss_of(m, x):
    return tfl.cross_entropy(m(x), Y)


def weak_refs(m):
    """Weak references to every Param of ``m``, its storage and the storage's current array."""
    ps = [p for _, p in m.parameter_records()]
    return [weakref.ref(o) for p in ps for o in (p, p.storage, p.storage.read_current())]


def alive(refs):
    gc.collect()
    return sum(r() is not None for r in refs)


def train(path, m, opt, s, steps=4):
    if path == "train_step":
        step = tfl.train_step(lambda s, x: loss_of(m, x), opt, seed=3)
        for _ in range(steps):
            step(X)
        return step
    for _ in range(steps):  # enough steps for the replay, the backward plan, the lane and the fused step
        with s:
            loss = loss_of(m, s.input(X))
            opt.step(s.backward(loss))
    with s:  # an evaluation step (no backward) is an outline too
        with s.no_grad():
            float(loss_of(m, s.input(X)))
    return None


@pytest.mark.parametrize("path", ["eager", "lazy", "train_step"])
def test_a_dropped_model_is_freed_while_its_session_lives(path):
    s = tfl.Session(seed=1, lazy=path == "lazy")
    m, opt = build()
    step = train(path, m, opt, s)
    refs = weak_refs(m)
    assert alive(refs) == len(refs)
    del m, opt, step
    assert alive(refs) == 0
    # the session goes on with a new model, and its outline and plan are worked out again for it
    m2, opt2 = build(1)
    train(path, m2, opt2, s, steps=2)
    assert s.rng_counter > 0 or path == "train_step"


@pytest.mark.parametrize("lazy", [False, True])
def test_a_dropped_model_is_freed_after_backward_without_an_optimizer(lazy):
    s = tfl.Session(seed=1, lazy=lazy)
    m, _ = build()
    for _ in range(4):
        with s:
            g = s.backward(loss_of(m, s.input(X)))
            g.global_norm()
    refs = weak_refs(m)
    del m, g
    assert alive(refs) == 0


def test_an_open_recording_holds_its_params_until_it_is_reset():
    """On a lane (a lazy recording replaying the outline with no nodes built) the recording holds the Params it
    used: a model dropped in mid-step still gives its gradients, and is freed with the recording."""
    s = tfl.Session(seed=1, lazy=True)
    m, opt = build()
    train("lazy", m, opt, s)
    trainable = sum(p.trainable for _, p in m.parameter_records())
    s.__enter__()
    try:
        loss = loss_of(m, s.input(X))
        refs = weak_refs(m)
        del m, opt
        assert alive(refs) == len(refs)  # the open recording holds them
        g = s.backward(loss)
        got = g.params()
        assert len(got) == trainable and all(np.isfinite(np.asarray(v)).all() for _, v in got)
        del g, got
    finally:
        s.__exit__(None, None, None)
    assert alive(refs) == 0
