"""Runtime attributes and the bounded kernel caches.

Float attributes declared ``runtime`` (clamp's bounds, layer_norm's eps,
attention's scale, the rates of random draws) reach one compiled kernel as
traced scalars, so varying them per call compiles nothing new; values and
gradients stay bit-identical to kernels with the value compiled in. Every
kernel cache is an LRU bounded by ``tfl.set_kernel_cache_size``.
"""

from __future__ import annotations

import functools
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import _assert_unchanged, _state

import tapeflow as tfl
from tapeflow._core import _kernels
from tapeflow._core import _registry as R
from tapeflow._shell import _random


@pytest.fixture(autouse=True)
def default_cache_size():
    tfl.set_kernel_cache_size(_kernels.DEFAULT_KERNEL_CACHE_SIZE)
    yield
    tfl.set_kernel_cache_size(_kernels.DEFAULT_KERNEL_CACHE_SIZE)


def _compiled(info: dict[str, int]) -> dict[str, int]:
    return {k: info[k] for k in ("fwd", "vjp", "fwd_jit", "random")}


def _grown(before: dict[str, int]) -> dict[str, int]:
    after = _compiled(tfl.kernel_cache_info())
    return {k: after[k] - before[k] for k in after}


def _tape(*arrays, requires_grad=True):
    t = tfl.Tape.empty()
    ids = []
    for a in arrays:
        t, i = tfl.leaf(t, a, requires_grad=requires_grad)
        ids.append(i)
    return t, tuple(ids)


# --------------------------------------------------------------------------- no kernel per value


def test_200_dropout_rates_add_a_constant_number_of_kernels():
    s = tfl.Session(seed=0)
    x = s.input(jnp.ones((16, 8), jnp.float32))
    tfl.dropout(x, 0.5, training=True)  # warm: bernoulli draw, mul, where
    before = _compiled(tfl.kernel_cache_info())
    evictions = tfl.kernel_cache_info()["evictions"]  # the suite may have filled the caches before
    n_random = len(_random._KERNELS)
    kept = []
    for i in range(200):
        rate = 0.001 + i * 0.004
        y = tfl.dropout(x, rate, training=True)
        v = np.asarray(y.value)
        assert set(np.unique(v)) <= {0.0, np.float32(1 / (1 - rate))}
        kept.append((v != 0).mean())
    assert _grown(before) == {"fwd": 0, "vjp": 0, "fwd_jit": 0, "random": 0}
    assert len(_random._KERNELS) == n_random
    assert kept[0] > 0.9 and kept[-1] < 0.4  # the rate really is a runtime value
    assert tfl.kernel_cache_info()["evictions"] == evictions


def test_200_clamp_bounds_add_a_constant_number_of_kernels():
    xv = jnp.linspace(-2.0, 2.0, 24, dtype=jnp.float32).reshape(4, 6)
    t, (x,) = _tape(xv)
    t1, r = tfl.record(t, "clamp", (x,), lo=-0.5, hi=0.5)
    t1, z = tfl.record(t1, "sum", (r.value,))
    tfl.backward(t1, z.value)
    before = _compiled(tfl.kernel_cache_info())
    for i in range(200):
        lo, hi = -1.0 + i * 0.003, 0.25 + i * 0.002
        t1, r = tfl.record(t, "clamp", (x,), lo=lo, hi=hi)
        assert r.is_ok, r.error
        np.testing.assert_array_equal(t1.value(r.value), np.clip(np.asarray(xv), np.float32(lo), np.float32(hi)))
        t1, z = tfl.record(t1, "sum", (r.value,))
        g = tfl.backward(t1, z.value)[x]
        np.testing.assert_array_equal(g, ((xv >= lo) & (xv <= hi)).astype(np.float32))
    assert _grown(before) == {"fwd": 0, "vjp": 0, "fwd_jit": 0, "random": 0}


def test_session_ops_with_varying_floats_compile_once():
    s = tfl.Session()
    x = s.input(jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4) / 7, requires_grad=True)
    q = s.input(jnp.ones((2, 3, 4), jnp.float32))

    def step(i):
        s.backward(tfl.layer_norm(x, (4,), eps=1e-5 * (i + 1)).sum())
        tfl.attention(q, q, q, scale=0.1 * (i + 1))
        s.backward(tfl.clamp(x, min=-0.01 * i, max=1.0 + i).sum())

    step(0)
    before = _compiled(tfl.kernel_cache_info())
    for i in range(1, 50):
        step(i)
    assert _grown(before) == {"fwd": 0, "vjp": 0, "fwd_jit": 0, "random": 0}


def test_the_key_keeps_none_and_the_value_type():
    d = R.REGISTRY["clamp"]
    k_float, rt = R.kernel_key(d, (("hi", None), ("lo", 0.5)))
    assert rt == {"lo": 0.5}
    assert R.kernel_key(d, (("hi", None), ("lo", 0.75)))[0] == k_float  # the value is not in the key
    assert R.kernel_key(d, (("hi", None), ("lo", 1)))[0] != k_float  # its type is
    assert R.kernel_key(d, (("hi", 2.0), ("lo", 0.5)))[0] != k_float  # None vs a number
    assert R.kernel_key(d, (("lo", None),)) == (R.attr_key((("lo", None),)), {})
    big = R.kernel_key(d, (("lo", -(2**40)),))  # beyond int32: compiled in, works with x64 off too
    assert big == (R.attr_key((("lo", -(2**40)),)), {})
    t, (x,) = _tape(jnp.asarray([-3.0, 0.0, 3.0]))
    for lo, hi in [(1, 2), (1.0, 2.0), (-(2**40), 2**40), (None, 0.5), (np.float32(0.5), None)]:
        t2, r = tfl.record(t, "clamp", (x,), lo=lo, hi=hi)
        assert r.is_ok, r.error
        np.testing.assert_array_equal(t2.value(r.value), np.clip([-3.0, 0.0, 3.0], lo, hi))
        assert t2[r.value].attrs == R.normalize_attrs({"lo": lo, "hi": hi})
        assert type(dict(t2[r.value].attrs)["lo"]) is (float if isinstance(lo, np.floating) else type(lo))


# --------------------------------------------------------------------------- values and gradients


RT_CASES = [
    ("clamp", [(5, 7)], {"lo": -0.7, "hi": 0.3}),
    ("clamp", [(5, 7)], {"lo": None, "hi": 0.123456789}),
    ("clamp", [(5, 7)], {"lo": -1, "hi": 2}),
    ("layer_norm", [(5, 7), (7,), (7,)], {"eps": 0.37}),
    ("layer_norm", [(5, 7)], {"eps": 1e-12}),
    ("attention", [(2, 3, 4), (2, 5, 4), (2, 5, 6)], {"scale": 0.3333333, "causal": True}),
    ("attention", [(2, 3, 4), (2, 5, 4), (2, 5, 6)], {"scale": -1.7, "causal": False}),
]


def _arrays(shapes, dtype, seed=0):
    rs = np.random.default_rng(seed)
    # avoid exact ties with clamp bounds: jax.grad and the hand VJP differ only there
    return [jnp.asarray(rs.standard_normal(s) * 1.3 + 0.01, dtype) for s in shapes]


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("op,shapes,attrs", RT_CASES, ids=[f"{c[0]}-{c[2]}" for c in RT_CASES])
def test_runtime_values_and_gradients_are_bit_identical_to_compiled_in_values(op, shapes, attrs, dtype):
    xs = _arrays(shapes, jnp.dtype(dtype))
    t, ids = _tape(*xs)
    t, r = tfl.record(t, op, ids, **attrs)
    assert r.is_ok, r.error
    node = t[r.value]
    assert R.kernel_key(R.REGISTRY[op], node.attrs)[1], "the case passes a value at run time"
    seed = jnp.asarray(np.random.default_rng(1).standard_normal(node.shape), node.dtype)
    grads = tfl.backward(t, r.value, seed=seed)

    d = R.REGISTRY[op]
    full = dict(node.attrs)
    want = jax.jit(functools.partial(d.fwd, **full))(*xs)  # the value compiled in: the kernel before runtime attrs
    np.testing.assert_array_equal(np.asarray(t.value(r.value)), np.asarray(want))
    want_cts = jax.jit(lambda g, o, *a: d.vjp(g, o, *a, **full))(seed, want, *xs)
    for i, ct in zip(ids, want_cts):
        assert grads[i].dtype == ct.dtype
        np.testing.assert_array_equal(np.asarray(grads[i]), np.asarray(ct))

    # and against jax.grad of the same pure function
    if dtype != "bfloat16":
        ref = jax.grad(lambda *a: jnp.sum(d.fwd(*a, **full) * seed), argnums=tuple(range(len(xs))))(*xs)
        tol = 1e-5 if dtype == "float32" else 1e-12
        for i, gr in zip(ids, ref):
            np.testing.assert_allclose(np.asarray(grads[i]), np.asarray(gr), rtol=tol, atol=tol)


def test_runtime_attributes_inside_an_outer_jit():
    xv = jnp.linspace(-2.0, 2.0, 9) + 0.01  # no ties with the bounds

    def f(x, lo, hi):
        t, (i,) = _tape(x)
        t, r = tfl.record(t, "clamp", (i,), lo=lo, hi=hi)
        t, r = tfl.record(t, "mul", (r.value, r.value))
        t, z = tfl.record(t, "sum", (r.value,))
        return t.value(z.value), tfl.backward(t, z.value)[i]

    for lo, hi in [(-1.0, 1.5), (-0.25, 0.5)]:
        val, g = jax.jit(functools.partial(f, lo=lo, hi=hi))(xv)
        ref_val, ref_g = jax.value_and_grad(lambda x: jnp.sum(jnp.clip(x, lo, hi) ** 2))(xv)
        np.testing.assert_allclose(val, ref_val, rtol=1e-12)
        np.testing.assert_allclose(g, ref_g, rtol=1e-12)


@pytest.fixture
def scale_op():
    """A throwaway exact op with a runtime attribute (removed again afterwards)."""

    def check(specs, factor):
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor != factor:
            return f"attribute factor={factor!r} must be a number"
        return None

    @R.op("_test_scale", attrs={"factor": 1}, exact=True, check=check, runtime=("factor",), public=False)
    def scale(x, factor):
        """``x * factor``."""
        return x * factor

    @scale.defvjp
    def _(g, out, x, factor):
        return (g * factor,)

    yield "_test_scale"
    del R.REGISTRY["_test_scale"]
    tfl.clear_kernel_caches()


def test_runtime_attributes_on_the_exact_rational_path(scale_op):
    xv = np.array([Fraction(1, 3), Fraction(-2, 7)], dtype=object)
    t, (x,) = _tape(xv)
    before = _compiled(tfl.kernel_cache_info())
    for factor in (3, 5, -2):
        t2, r = tfl.record(t, scale_op, (x,), factor=factor)
        assert r.is_ok, r.error
        assert list(t2.value(r.value)) == [v * factor for v in xv]
        t2, z = tfl.record(t2, "sum", (r.value,))
        assert list(tfl.backward(t2, z.value)[x]) == [Fraction(factor)] * 2
    assert _grown(before) == {"fwd": 2, "vjp": 2, "fwd_jit": 0, "random": 0}  # scale and sum, once each
    _, r = tfl.record(t, scale_op, (x,), factor=float("nan"))
    assert r.error.startswith(f"{scale_op}: attribute factor=nan must be a number")
    # the same op on floats: one compiled kernel for every factor
    t, (y,) = _tape(jnp.arange(3.0))
    jits = tfl.kernel_cache_info()["fwd_jit"]
    for factor in (0.5, 1.5, 2.5):
        t2, r = tfl.record(t, scale_op, (y,), factor=factor)
        np.testing.assert_array_equal(t2.value(r.value), np.arange(3.0) * factor)
    assert tfl.kernel_cache_info()["fwd_jit"] == jits + 1


def test_declaring_an_unknown_runtime_attribute_is_an_error():
    with pytest.raises(ValueError, match=r"op '_test_bad': runtime=\['nope'\] names no attribute"):

        @R.op("_test_bad", attrs={"a": 1.0}, runtime=("nope",))
        def bad(x, a):
            return x * a

    assert "_test_bad" not in R.REGISTRY


# --------------------------------------------------------------------------- rejected values


def test_a_rejected_runtime_value_leaves_the_caches_and_their_order_alone():
    t, (x, y) = _tape(jnp.ones((3, 4)), jnp.ones((2,)))
    assert tfl.record(t, "clamp", (x,), lo=0.5)[1].is_ok
    assert tfl.record(t, "exp", (y,))[1].is_ok  # the clamp kernel is now least recently used
    before, order = tfl.kernel_cache_info(), [list(c) for c in _kernels._CACHES.values()]
    for attrs, needle in [
        ({"lo": float("nan")}, "attribute lo=nan is NaN"),
        ({"lo": 2.0, "hi": 1.0}, "lo=2.0 is greater than hi=1.0"),
        ({"lo": True}, "attribute lo must be a number or None, got True"),
    ]:
        t2, r = tfl.record(t, "clamp", (x,), **attrs)
        assert t2 is t and not r.is_ok and needle in r.error, r.error
        assert tfl.kernel_cache_info() == before
        assert [list(c) for c in _kernels._CACHES.values()] == order
    s = tfl.Session()
    h = s.input(jnp.ones((3, 4)))
    state = _state(s)
    with pytest.raises(tfl.TapeError, match="is NaN"):
        tfl.clamp(h, min=float("nan"))
    _assert_unchanged(s, state)
    with pytest.raises(tfl.TapeError, match="eps"):
        tfl.layer_norm(h, (4,), eps=float("inf"))
    _assert_unchanged(s, state)


# --------------------------------------------------------------------------- the LRU bound


def _exp_of(n: int):
    t, (x,) = _tape(jnp.arange(float(n)))
    return tfl.record(t, "exp", (x,))


def _fwd_shapes() -> list[tuple[int, ...]]:
    return [key[2][0][0] for key in R._FWD_CACHE]


@pytest.mark.parametrize("path", ["record", "session"])
def test_hits_mark_recency_only_once_the_cache_is_crowded(path):
    """A cache at most half full evicts nothing, so a hit leaves the order alone; past half, hits mark
    exact recency, and eviction takes the entries unused since then first (KernelCache's rule, on both
    the pure ``record`` path and the session's ``check_op`` fast path)."""

    def exp_of(n: int) -> None:
        if path == "record":
            assert _exp_of(n)[1].is_ok
        else:
            s = tfl.Session(lazy=False)
            tfl.exp(s.input(jnp.arange(float(n))))

    tfl.clear_kernel_caches()
    old = tfl.set_kernel_cache_size(6)
    try:
        for n in (1, 2, 3):
            exp_of(n)
        exp_of(1)  # a hit at 3 of 6: not crowded, nothing moves
        assert _fwd_shapes() == [(1,), (2,), (3,)] and not R._FWD_CACHE.crowded
        exp_of(4)  # 4 of 6: crowded from now on
        assert R._FWD_CACHE.crowded
        exp_of(2)  # a hit that marks
        assert _fwd_shapes() == [(1,), (3,), (4,), (2,)]
        for n in (5, 6, 7, 8):
            exp_of(n)
        assert _fwd_shapes() == [(4,), (2,), (5,), (6,), (7,), (8,)]  # (1,) and (3,) went first
        assert tfl.kernel_cache_info()["evictions"] >= 2
        tfl.clear_kernel_caches()
        assert not R._FWD_CACHE.crowded
    finally:
        tfl.set_kernel_cache_size(old)
        tfl.clear_kernel_caches()


def test_eviction_is_least_recently_used_counted_and_recompiles_correctly():
    tfl.clear_kernel_caches()
    assert tfl.set_kernel_cache_size(3) == _kernels.DEFAULT_KERNEL_CACHE_SIZE
    for n in (1, 2, 3):
        assert _exp_of(n)[1].is_ok
    assert tfl.kernel_cache_info()["fwd"] == 3 and tfl.kernel_cache_info()["evictions"] == 0
    _exp_of(1)  # a hit: shape (1,) becomes the most recently used
    _exp_of(4)  # evicts (2,), the least recently used
    shapes = [key[2][0][0] for key in R._FWD_CACHE]
    assert shapes == [(3,), (1,), (4,)]
    info = tfl.kernel_cache_info()
    assert info["fwd"] == 3 and info["max_size"] == 3 and info["evictions"] == 1
    assert info["fwd_jit"] == 1  # one jitted forward for exp, shared by the shapes
    t, r = _exp_of(2)  # compiled again, and right
    np.testing.assert_allclose(t.value(r.value), np.exp(np.arange(2.0)), rtol=1e-12)
    assert tfl.kernel_cache_info()["evictions"] == 2
    # distinct attributes evict jitted forwards too
    t, (x,) = _tape(jnp.arange(6.0).reshape(2, 3))
    for axis in (0, 1, -1, None, (0, 1)):
        t2, r = tfl.record(t, "sum", (x,), axis=axis)
        np.testing.assert_allclose(t2.value(r.value), np.sum(np.arange(6.0).reshape(2, 3), axis=axis))
    info = tfl.kernel_cache_info()
    assert info["fwd"] == info["fwd_jit"] == 3
    assert info["evictions"] >= 2 + 2 + 4
    tfl.clear_kernel_caches()
    assert tfl.kernel_cache_info() == {
        "fwd": 0,
        "vjp": 0,
        "jvp": 0,
        "fwd_jit": 0,
        "random": 0,
        "lazy": 0,
        "lazy_checked": 0,
        "optimizer_init": 0,
        "max_size": 3,
        "evictions": 0,
    }


def test_vjp_and_random_caches_are_bounded_too():
    tfl.clear_kernel_caches()
    tfl.set_kernel_cache_size(2)
    for n in (1, 2, 3, 4):
        t, r = _exp_of(n)
        t, z = tfl.record(t, "sum", (r.value,))
        g = tfl.backward(t, z.value)[0]
        np.testing.assert_allclose(g, np.exp(np.arange(float(n))), rtol=1e-12)
    s = tfl.Session(seed=1)
    for n in (1, 2, 3):
        assert s.rand_uniform((n,), low=0.25, high=0.5).shape == (n,)
    info = tfl.kernel_cache_info()
    assert info["vjp"] == info["random"] == info["fwd"] == 2
    assert len(_random._KERNELS) == 2


def test_shrinking_evicts_at_once():
    tfl.clear_kernel_caches()
    for n in (1, 2, 3, 4, 5):
        _exp_of(n)
    assert tfl.set_kernel_cache_size(2) == _kernels.DEFAULT_KERNEL_CACHE_SIZE
    info = tfl.kernel_cache_info()
    assert info["fwd"] == 2 and info["evictions"] == 3
    assert [key[2][0][0] for key in R._FWD_CACHE] == [(4,), (5,)]
    assert tfl.set_kernel_cache_size(np.int64(8)) == 2
    assert tfl.kernel_cache_info()["max_size"] == 8


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "10", None, np.float64(3.0)])
def test_set_kernel_cache_size_validates_its_argument(bad):
    before = tfl.kernel_cache_info()
    with pytest.raises(tfl.TapeError) as e:
        tfl.set_kernel_cache_size(bad)
    msg = str(e.value)
    assert msg.startswith("set_kernel_cache_size: max_size must be a positive int")
    assert f"got {bad!r}" in msg and "tfl.set_kernel_cache_size(4096)" in msg
    assert tfl.kernel_cache_info() == before
