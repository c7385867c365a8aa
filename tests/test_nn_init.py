"""tfl.nn.init: jax.random's values, bit for bit, without a compiled program per shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapeflow as tfl
from tapeflow.nn import init

SHAPES = [(), (0,), (1,), (7,), (3, 5), (init.CHUNK,), (init.CHUNK + 1,), (300, 700), (2, 3, 4, 5)]


def same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_uniform_and_normal_equal_jax_random(shape, make_key):
    key = make_key(11)
    f32 = jnp.float32  # the suite runs with jax_enable_x64: jax.random's default dtype is float64 there
    assert same(init.uniform(key, shape), jax.random.uniform(key, shape, f32))
    assert same(init.uniform(key, shape, f32, -0.25, 0.5), jax.random.uniform(key, shape, f32, -0.25, 0.5))
    assert same(init.normal(key, shape), jax.random.normal(key, shape, f32))
    assert same(init.uniform(key, shape, jnp.float64), jax.random.uniform(key, shape, jnp.float64))  # handed over


@pytest.mark.parametrize("num", [0, 1, 2, 5, 1000])
@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_split_and_keys_equal_jax_random(num, make_key):
    key = make_key(5)
    want = jax.random.split(key, num)
    got = init.split(key, num)
    data = jax.random.key_data if make_key is jax.random.key else np.asarray
    assert same(data(got), data(want))
    assert got.dtype == want.dtype
    one_by_one = init.keys(key, num)
    assert len(one_by_one) == num
    for k, w in zip(one_by_one, want):
        assert same(data(k), data(w))


def test_other_dtypes_and_implementations_are_handed_to_jax_random():
    key = jax.random.key(3)
    assert same(init.uniform(key, (4,), jnp.bfloat16), jax.random.uniform(key, (4,), jnp.bfloat16))
    rbg = jax.random.key(3, impl="rbg")
    assert same(init.normal(rbg, (6,)), jax.random.normal(rbg, (6,), jnp.float32))
    assert same(jax.random.key_data(init.split(rbg, 3)), jax.random.key_data(jax.random.split(rbg, 3)))
    with jax.threefry_partitionable(False):
        assert same(init.uniform(key, (5, 3)), jax.random.uniform(key, (5, 3), jnp.float32))
        assert same(jax.random.key_data(init.split(key, 4)), jax.random.key_data(jax.random.split(key, 4)))
    with pytest.raises(ValueError, match="must be a float dtype"):
        init.uniform(key, (3,), jnp.int32)  # what jax.random says about an integer dtype


def test_a_model_of_new_shapes_compiles_no_initializer():
    tfl.nn.MLP([5, 9, 4], key=jax.random.key(0))  # the initializer kernel exists now
    with tfl.compile_log(file=None) as log:
        m = tfl.nn.MLP([6, 17, 23, 3], key=jax.random.key(1))  # shapes never drawn before
        tfl.nn.Embedding(19, 7, key=jax.random.key(2), std=0.02)
        tfl.nn.GRUCell(3, 5, key=jax.random.key(3))
    assert log.records == [], [str(r) for r in log.records]
    k = init.keys(jax.random.key(1), 3)
    kw, kb = init.keys(k[1], 2)
    np.testing.assert_array_equal(
        np.asarray(m.layers[1].weight.value), jax.random.uniform(kw, (23, 17), jnp.float32, -(17**-0.5), 17**-0.5)
    )


def test_layer_initial_values_are_the_jax_random_ones():
    """The initial values are those jax.random.split and jax.random.uniform / normal give (unchanged by this path)."""
    key = jax.random.key(4)
    lin = tfl.nn.Linear(6, 3, key=key)
    kw, kb = jax.random.split(key)
    b = 1 / np.sqrt(6)
    assert same(lin.weight.value, jax.random.uniform(kw, (3, 6), jnp.float32, -b, b))
    assert same(lin.bias.value, jax.random.uniform(kb, (3,), jnp.float32, -b, b))
    emb = tfl.nn.Embedding(10, 4, key=key, std=0.02)
    assert same(emb.weight.value, jax.random.normal(key, (10, 4), jnp.float32) * jnp.float32(0.02))
