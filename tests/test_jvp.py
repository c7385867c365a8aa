"""Forward mode: ``tfl.jvp`` on the pure core and ``Session.jvp``.

Every tangent is checked against an independent oracle: ``jax.jvp`` of the
equivalent pure JAX function (and central finite differences once), never
against tapeflow's own reverse mode alone.
"""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import FOREIGN_MSG, STALE_MSG, _arr, _assert_unchanged, _state, close

import tapeflow as tfl
from tapeflow import TapeError
from tapeflow._core import _registry as R


def _leaves(*arrays):
    t = tfl.Tape.empty()
    ids = []
    for a in arrays:
        t, i = tfl.leaf(t, a)
        ids.append(i)
    return t, ids


def _rec(t, op, ins, **attrs):
    t, r = tfl.record(t, op, tuple(ins), **attrs)
    assert r.is_ok, r.error
    return t, r.value


# =========================================================================== pure core


def _chain(t, x):
    """tanh(exp(x) * sin(x)) + x / 3, recorded; returns (tape, root)."""
    t, e = _rec(t, "exp", [x])
    t, s = _rec(t, "sin", [x])
    t, m = _rec(t, "mul", [e, s])
    t, h = _rec(t, "tanh", [m])
    t, three = tfl.leaf(t, jnp.asarray(3.0, jnp.float64))
    t, d = _rec(t, "div", [x, three])
    return _rec(t, "add", [h, d])


def _chain_ref(x):
    return jnp.tanh(jnp.exp(x) * jnp.sin(x)) + x / 3.0


def test_elementwise_chain_matches_jax_jvp():
    xv, v = _arr((5,), 0), _arr((5,), 1)
    t, (x,) = _leaves(xv)
    t, root = _chain(t, x)
    close(tfl.jvp(t, root, {x: v}), jax.jvp(_chain_ref, (xv,), (v,))[1])


def test_matches_central_finite_differences():
    xv, v = _arr((6,), 2), _arr((6,), 3)
    t, (x,) = _leaves(xv)
    t, root = _chain(t, x)
    eps = 1e-6
    fd = (_chain_ref(xv + eps * v) - _chain_ref(xv - eps * v)) / (2 * eps)
    close(tfl.jvp(t, root, {x: v}), fd, rtol=1e-6, atol=1e-7)


def test_several_tangent_leaves_and_one_left_out():
    a, b, c = _arr((3,), 4), _arr((3,), 5), _arr((3,), 6)
    ta, tc = _arr((3,), 7), _arr((3,), 8)
    t, (ia, ib, ic) = _leaves(a, b, c)
    t, ab = _rec(t, "mul", [ia, ib])
    t, r = _rec(t, "mul", [ab, ic])
    t, root = _rec(t, "sin", [r])

    def f(a, c):
        return jnp.sin(a * b * c)

    want = jax.jvp(f, (a, c), (ta, tc))[1]
    close(tfl.jvp(t, root, {ia: ta, ic: tc}), want)
    close(tfl.jvp(t, tfl.Ok(root), {tfl.Ok(ia): ta, ic: tc}), want)  # Ok-wrapped ids too


def test_root_not_reached_by_any_tangent_is_zeros_of_its_shape():
    t, (x, y) = _leaves(_arr((2, 3), 0), _arr((4,), 1))
    t, r = _rec(t, "exp", [y])
    out = tfl.jvp(t, r, {x: jnp.ones((2, 3))})
    assert out.shape == (4,) and out.dtype == jnp.float64
    assert not np.any(np.asarray(out))
    assert tfl.jvp(t, r, {}).shape == (4,)


def test_tangent_of_the_root_itself_and_of_an_interior_node():
    xv = _arr((3,), 0)
    t, (x,) = _leaves(xv)
    t, e = _rec(t, "exp", [x])
    t, r = _rec(t, "sin", [e])
    v = _arr((3,), 1)
    close(tfl.jvp(t, x, {x: v}), v)
    # a tangent given for an interior node is that node's tangent (as if it were an input)
    close(tfl.jvp(t, r, {e: v}), jnp.cos(jnp.exp(xv)) * v)


def test_non_float_nodes_carry_no_tangent():
    xv, v = _arr((6,), 0), _arr((6,), 1)
    idx = jnp.asarray([5, 0, 2], jnp.int32)
    t, (x, i) = _leaves(xv, idx)
    t, zero = tfl.leaf(t, jnp.asarray(0.0, jnp.float64))
    t, pos = _rec(t, "gt", [x, zero])  # bool
    t, nx = _rec(t, "neg", [x])
    t, w = _rec(t, "where", [pos, x, nx])  # |x|
    t, xi = _rec(t, "astype", [x], dtype="int32")  # int: no tangent
    t, xf = _rec(t, "astype", [xi], dtype="float64")
    t, s = _rec(t, "mul", [w, xf])
    t, root = _rec(t, "take", [s, i])

    def f(x):
        w = jnp.where(x > 0, x, -x)
        return jnp.take(w * x.astype(jnp.int32).astype(jnp.float64), idx)

    close(tfl.jvp(t, root, {x: v}), jax.jvp(f, (xv,), (v,))[1])
    # an integer root reached by a tangent: zeros of its shape and dtype
    out = tfl.jvp(t, xi, {x: v})
    assert out.dtype == jnp.int32 and out.shape == (6,) and not np.any(np.asarray(out))


def test_stop_gradient_carries_no_tangent():
    xv, v = _arr((4,), 0), _arr((4,), 1)
    t, (x,) = _leaves(xv)
    t, sg = _rec(t, "stop_gradient", [x])
    t, root = _rec(t, "mul", [sg, x])
    close(tfl.jvp(t, root, {x: v}), jax.jvp(lambda x: jax.lax.stop_gradient(x) * x, (xv,), (v,))[1])
    assert [n for n in tfl.ops() if not tfl.REGISTRY[n].tangent] == ["stop_gradient"]


def test_an_op_declared_without_tangent_carries_none():
    """``jvp`` reads ``OpDef.tangent``: an op whose forward would pass a tangent gets none when it says so."""
    d = R.op("test_jvp_no_tangent", tangent=False, user=jnp.negative)(lambda x: -x)
    try:
        xv, v = _arr((3,), 0), _arr((3,), 1)
        t, (x,) = _leaves(xv)
        t, y = _rec(t, "test_jvp_no_tangent", [x])
        t, root = _rec(t, "add", [y, x])
        close(tfl.jvp(t, root, {x: v}), v)  # only the direct path
        close(tfl.jvp(t, y, {x: v}), np.zeros(3))
    finally:
        R.unregister(d.name)


def test_runtime_attributes_are_traced_and_compile_nothing_new():
    xv, v = _arr((8,), 0), _arr((8,), 1)
    t, (x,) = _leaves(xv)
    t, r = _rec(t, "clamp", [x], lo=-0.5, hi=0.5)
    close(tfl.jvp(t, r, {x: v}), jax.jvp(lambda x: jnp.clip(x, -0.5, 0.5), (xv,), (v,))[1])
    before = tfl.kernel_cache_info()["jvp"]
    for lo, hi in [(-0.1, 0.2), (-1.5, 0.0), (0.3, 2.0)]:
        t2, r2 = _rec(t, "clamp", [x], lo=lo, hi=hi)
        want = jax.jvp(lambda x, lo=lo, hi=hi: jnp.clip(x, lo, hi), (xv,), (v,))[1]
        close(tfl.jvp(t2, r2, {x: v}), want)
    assert tfl.kernel_cache_info()["jvp"] == before


def test_inside_jit_on_a_tape_of_tracers():
    xv, v = _arr((5,), 0), _arr((5,), 1)
    t, (x,) = _leaves(xv)
    t, root = _chain(t, x)
    want = jax.jvp(_chain_ref, (xv,), (v,))[1]
    close(jax.jit(lambda tape, v: tfl.jvp(tape, root, {x: v}))(t, v), want)

    @jax.jit
    def built_inside(xv, v):
        t, (x,) = _leaves(xv)
        t, root = _chain(t, x)
        return tfl.jvp(t, root, {x: v})

    close(built_inside(xv, v), want)


def test_jvp_against_backward_gives_the_same_directional_derivative():
    xv, v = _arr((5,), 0), _arr((5,), 1)
    t = tfl.Tape.empty()
    t, x = tfl.leaf(t, xv, requires_grad=True)
    t, root = _chain(t, x)
    t, loss = _rec(t, "sum", [root])
    close(tfl.jvp(t, loss, {x: v}), jnp.vdot(tfl.backward(t, loss)[x], v))


def test_repeated_calls_with_the_same_shapes_compile_nothing_new():
    t, (x,) = _leaves(_arr((3, 4), 0))
    t, root = _chain(t, x)
    tfl.jvp(t, root, {x: _arr((3, 4), 1)})
    before = dict(tfl.kernel_cache_info())
    assert before["jvp"] >= 5
    for seed in range(3):
        t2, (y,) = _leaves(_arr((3, 4), 10 + seed))
        t2, root2 = _chain(t2, y)
        tfl.jvp(t2, root2, {y: _arr((3, 4), 20 + seed)})
    assert tfl.kernel_cache_info()["jvp"] == before["jvp"]


# --------------------------------------------------------------------------- pure-core errors


def test_bad_tangents_and_ids_raise_naming_the_node():
    t, (x, i) = _leaves(jnp.ones((2, 3), jnp.float32), jnp.arange(3))
    t, r = _rec(t, "exp", [x])
    with pytest.raises(TapeError, match=r"node #0 is float32\[3,2\] but float32\[2,3\] was expected"):
        tfl.jvp(t, r, {x: jnp.ones((3, 2), jnp.float32)})
    with pytest.raises(TapeError, match=r"node #0 is float64\[2,3\] but float32\[2,3\] was expected.*jnp.asarray"):
        tfl.jvp(t, r, {x: np.ones((2, 3))})
    with pytest.raises(TapeError, match=r"node #1 is int.*only float values carry tangents"):
        tfl.jvp(t, r, {i: jnp.ones(3)})
    with pytest.raises(TapeError, match="a tangent key 7 is out of range for a tape of 3 node"):
        tfl.jvp(t, r, {7: 1.0})
    with pytest.raises(TapeError, match="a tangent key must be a node id"):
        tfl.jvp(t, r, {"x": 1.0})
    with pytest.raises(TapeError, match="root 3 is out of range"):
        tfl.jvp(t, 3, {x: jnp.ones((2, 3), jnp.float32)})
    with pytest.raises(TapeError, match="not an array of numbers"):
        tfl.jvp(t, r, {x: [["a"]]})


def test_python_numbers_and_lists_take_the_node_dtype():
    t, (x,) = _leaves(jnp.asarray([1.0, 2.0], jnp.float32))
    t, r = _rec(t, "mul", [x, x])
    out = tfl.jvp(t, r, {x: [1.0, 0.5]})
    assert out.dtype == jnp.float32
    close(out, [2.0, 2.0])


def test_exact_rationals_are_refused_clearly():
    q = np.array([Fraction(1, 2), Fraction(3)], dtype=object)
    t, (x,) = _leaves(q)
    t, r = _rec(t, "mul", [x, x])
    with pytest.raises(TapeError, match=r"exact rationals.*not supported"):
        tfl.jvp(t, r, {x: q})
    with pytest.raises(TapeError, match=r"exact rationals.*not supported"):
        tfl.jvp(t, r, {})


# =========================================================================== session


def _mlp_ref(x, w1, b1, w2):
    return jnp.tanh(x @ w1 + b1) @ w2


def test_session_mlp_with_tangents_on_inputs_and_params():
    xv, w1v, b1v, w2v = _arr((4, 3), 0), _arr((3, 5), 1), _arr((5,), 2), _arr((5, 2), 3)
    tx, tw1, tb1 = _arr((4, 3), 4), _arr((3, 5), 5), _arr((5,), 6)
    w1, b1, w2 = tfl.Param(w1v, name="w1"), tfl.Param(b1v, name="b1"), tfl.Param(w2v, name="w2")
    s = tfl.Session()
    x = s.input(xv)
    out = tfl.tanh(x @ w1 + b1) @ w2
    got = s.jvp(out, {x: tx, w1: tw1, b1: tb1})
    want = jax.jvp(_mlp_ref, (xv, w1v, b1v, w2v), (tx, tw1, tb1, jnp.zeros_like(w2v)))[1]
    close(got, want)
    loss = tfl.mean(out**2)
    want_loss = jax.jvp(lambda x, w: jnp.mean(_mlp_ref(x, w, b1v, w2v) ** 2), (xv, w1v), (tx, tw1))[1]
    close(s.jvp(loss, {x: tx, w1: tw1}), want_loss)


def test_tied_param_gets_the_tangent_at_every_use():
    xv, wv, tw = _arr((2, 3), 0), _arr((3, 3), 1), _arr((3, 3), 2)
    w = tfl.Param(wv, name="w")
    w_out = tfl.tie(w, name="w_out")
    s = tfl.Session()
    x = s.input(xv)
    h = tfl.tanh(x @ w)
    out = tfl.sum(h @ w_out.T + h @ w)  # three uses of one storage

    def f(w):
        h = jnp.tanh(xv @ w)
        return jnp.sum(h @ w.T + h @ w)

    want = jax.jvp(f, (wv,), (tw,))[1]
    close(s.jvp(out, {w: tw}), want)
    close(s.jvp(out, {w_out: tw}), want)  # either record of the storage means all of its uses
    with pytest.raises(TapeError, match="given a tangent by both Param 'w' and Param 'w_out'"):
        s.jvp(out, {w: tw, w_out: tw})


def test_frozen_params_and_inference_sessions_take_tangents_too():
    xv, wv, tw = _arr((3,), 0), _arr((3,), 1), _arr((3,), 2)
    w = tfl.Param(wv, trainable=False)
    for s in (tfl.Session(), tfl.Session(grad_enabled=False)):
        out = tfl.sum(tfl.sin(s.input(xv) * w))
        close(s.jvp(out, {w: tw}), jax.jvp(lambda w: jnp.sum(jnp.sin(xv * w)), (wv,), (tw,))[1])


def test_unused_param_contributes_nothing_but_is_still_checked():
    xv, v = _arr((3,), 0), _arr((3,), 1)
    unused = tfl.Param(jnp.ones((2,), jnp.float64), name="unused")
    s = tfl.Session()
    x = s.input(xv)
    y = tfl.exp(x)
    close(s.jvp(y, {x: v, unused: jnp.ones(2)}), jnp.exp(xv) * v)
    close(s.jvp(y, {unused: jnp.ones(2)}), jnp.zeros(3))
    with pytest.raises(TapeError, match=r"Param 'unused' is float64\[5\] but float64\[2\] was expected"):
        s.jvp(y, {unused: jnp.ones(5)})


def test_session_jvp_changes_nothing_and_compiles_nothing_on_repeat():
    xv, v = _arr((4, 3), 0), _arr((4, 3), 1)
    w = tfl.Param(_arr((3, 2), 2))
    s = tfl.Session()
    x = s.input(xv)
    out = tfl.relu(x @ w)
    tangents = {x: v, w: jnp.zeros((3, 2))}
    first = s.jvp(out, tangents)
    before = _state(s)  # the kernel caches included
    again = s.jvp(out, tangents)
    _assert_unchanged(s, before)
    close(first, again)
    close(first, jax.jvp(lambda x: jax.nn.relu(x @ w.value), (xv,), (v,))[1])


def test_session_error_cases():
    s = tfl.Session()
    x = s.input(jnp.ones(3))
    y = tfl.exp(x)
    with pytest.raises(TapeError, match=r"tensor #0 is float64\[4\] but float64\[3\] was expected"):
        s.jvp(y, {x: jnp.ones(4)})
    with pytest.raises(TapeError, match=r"float32\[3\] but float64\[3\]"):
        s.jvp(y, {x: jnp.ones(3, jnp.float32)})
    with pytest.raises(TypeError, match="Tensor or Param keys, got str"):
        s.jvp(y, {"x": jnp.ones(3)})
    with pytest.raises(TypeError, match="got int"):  # node ids are for the pure core's tfl.jvp
        s.jvp(y, {x.id: jnp.ones(3)})
    with pytest.raises(TypeError, match="Tensor output"):
        s.jvp(y.value, {x: jnp.ones(3)})
    other = tfl.Session()
    z = other.input(jnp.ones(3))
    with pytest.raises(TapeError, match=FOREIGN_MSG):
        s.jvp(y, {z: jnp.ones(3)})
    with pytest.raises(TapeError, match=FOREIGN_MSG):
        other.jvp(y, {z: jnp.ones(3)})
    s.reset()
    x2 = s.input(jnp.ones(3))
    with pytest.raises(TapeError, match=STALE_MSG.split(";")[0]):
        s.jvp(tfl.exp(x2), {x: jnp.ones(3)})
    with pytest.raises(TapeError, match=STALE_MSG.split(";")[0]):
        s.jvp(y, {x2: jnp.ones(3)})
