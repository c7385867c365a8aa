"""Core tape semantics: Ok/Err, persistence, failure atomicity, backward, jit.

Every gradient here is checked against ``jax.grad`` of the same computation
written as a plain JAX function (an oracle that shares no code with the tape).
"""

from __future__ import annotations

import gc
import threading

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapeflow as tfl
from tapeflow._core import _registry

# --------------------------------------------------------------------------- helpers


def ok(res):
    """Unpack ``(tape, Ok(id))`` and fail loudly on ``Err``."""
    t, r = res
    assert r.is_ok, r.error
    return t, r.value


def rec(t, op, inputs, **attrs):
    return ok(tfl.record(t, op, inputs, **attrs))


def vals(tape):
    return [np.asarray(nd.value) for nd in tape]


def rng(seed=0):
    return np.random.default_rng(seed)


# --------------------------------------------------------------------------- Ok / Err


def test_ok_fields_and_immutability():
    r = tfl.Ok(7)
    assert r.is_ok is True and r.value == 7 and r.error is None
    assert r.unwrap() == 7
    with pytest.raises(AttributeError):
        r.value = 8
    with pytest.raises(AttributeError):
        r.is_ok = False
    with pytest.raises(AttributeError):
        r.extra = 1
    assert r.value == 7 and r.is_ok is True
    assert not hasattr(r, "__dict__")
    assert r == tfl.Ok(7) and r != tfl.Ok(8) and r != tfl.Err("7")
    assert hash(r) == hash(tfl.Ok(7))


def test_err_fields_and_immutability():
    e = tfl.Err("mul: boom")
    assert e.is_ok is False and e.value is None and e.error == "mul: boom"
    with pytest.raises(AttributeError):
        e.error = "other"
    with pytest.raises(AttributeError):
        e.is_ok = True
    assert e.error == "mul: boom"
    with pytest.raises(tfl.TapeError, match="mul: boom"):
        e.unwrap()
    assert isinstance(tfl.TapeError("x"), ValueError)
    assert e == tfl.Err("mul: boom") and e != tfl.Err("other")
    assert hash(e) == hash(tfl.Err("mul: boom"))


def _describe(r):
    match r:
        case tfl.Ok(value=v):
            return ("ok", v)
        case tfl.Err(error=e):
            return ("err", e)
        case _:
            return ("neither", None)


def test_ok_err_structural_pattern_matching():
    assert _describe(tfl.Ok(3)) == ("ok", 3)
    assert _describe(tfl.Err("nope")) == ("err", "nope")
    assert _describe(3) == ("neither", None)
    # positional patterns use __match_args__
    match tfl.Ok(5):
        case tfl.Err(_):
            raise AssertionError("Ok matched Err")
        case tfl.Ok(v):
            assert v == 5


def test_record_results_pattern_match():
    t, x = tfl.leaf(tfl.Tape.empty(), jnp.ones(3))
    _, good = tfl.record(t, "exp", (x,))
    _, bad = tfl.record(t, "exp", (x, x))
    assert _describe(good) == ("ok", 1)
    kind, msg = _describe(bad)
    assert kind == "err" and "exp" in msg


# --------------------------------------------------------------------------- persistence and forks


def test_old_tape_unchanged_after_appends():
    t0 = tfl.Tape.empty()
    t1, x = tfl.leaf(t0, jnp.array([1.0, 2.0, 3.0]), requires_grad=True)
    t2, y = rec(t1, "mul", (x, x))
    snap1, snap2 = vals(t1), vals(t2)
    t = t2
    for _ in range(20):
        t, _ = rec(t, "add", (len(t) - 1, x))
    assert (len(t0), len(t1), len(t2), len(t)) == (0, 1, 2, 22)
    for a, b in zip(vals(t1), snap1):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(vals(t2), snap2):
        np.testing.assert_array_equal(a, b)
    assert list(t0) == []
    with pytest.raises(IndexError):
        t1[1]
    with pytest.raises(IndexError):
        t2[2]
    np.testing.assert_allclose(np.asarray(t[21].value), [21.0, 44.0, 69.0])


def test_node_view_shows_exactly_its_own_tapes_nodes():
    t1, x = tfl.leaf(tfl.Tape.empty(), jnp.array([1.0, 2.0]))
    t2, y = rec(t1, "exp", (x,))  # shares t1's buffer, one node longer
    t3, _ = rec(t1, "neg", (x,))  # a fork: its node #1 is not t2's
    v1, v2, v3 = t1.nodes, t2.nodes, t3.nodes
    assert (len(v1), len(v2), len(v3)) == (1, 2, 2)
    assert [nd.op for nd in v1] == [None] and [nd.op for nd in v2] == [None, "exp"] and v3[1].op == "neg"
    assert all(v2[i] is t2[i] for i in range(len(t2)))  # the nodes themselves, no copies
    assert v2[np.int64(1)] is t2[1] and v2[:] == list(t2) and v2[1:] == [t2[1]] and v2[::-1] == [t2[1], t2[0]]
    assert list(reversed(v2)) == [t2[1], t2[0]] and t2[1] in v2 and v2.index(t2[1]) == 1
    for bad in (1, -1, "0"):  # node #1 sits in t1's buffer, but it is not t1's
        with pytest.raises(IndexError, match="out of range for a tape of 1 node"):
            v1[bad]
    with pytest.raises(TypeError):
        v2[0] = t2[1]  # read-only
    assert not hasattr(v2, "append") and repr(v2) == "NodeView(len=2)"
    t4, _ = rec(t2, "neg", (y,))
    assert len(v2) == 2 and len(t4.nodes) == 3  # a view never grows with later tapes


def test_append_node_appends_a_checked_node_as_it_is():
    from tapeflow._core._tape import Node, append_node

    v = jnp.ones(2)
    nd = Node(None, (), (), v, True, (2,), np.dtype("float32"))
    t, i = append_node(tfl.Tape.empty(), nd)
    assert (i, len(t)) == (0, 1) and t[0] is nd
    t2, j = append_node(t, Node(None, (), (), v, False, (2,), np.dtype("float32")))
    t3, k = append_node(t, Node(None, (), (), v, False, (2,), np.dtype("float32")))  # a fork
    assert j == k == 1 and t2[1] is not t3[1] and len(t) == 1
    with pytest.raises(TypeError, match="append_node: expected a Node, got ndarray"):
        append_node(t, np.ones(2))
    with pytest.raises(tfl.TapeError, match=r"has parents \(0, 3\) but the tape has 1 node"):
        append_node(t, Node("add", (), (0, 3), v, False, (2,), np.dtype("float32")))
    assert len(t) == 1


def test_forks_are_independent():
    base, x = tfl.leaf(tfl.Tape.empty(), jnp.array([1.0, 2.0]), requires_grad=True)
    base, y = rec(base, "mul", (x, x))  # [1, 4]
    a, ra = rec(base, "add", (x, y))  # [2, 6]
    b, rb = rec(base, "sub", (x, y))  # [0, -2]   (fork: base already continued by a)
    a, ra2 = rec(a, "exp", (ra,))
    b, rb2 = rec(b, "neg", (rb,))
    b, rb3 = rec(b, "neg", (rb2,))
    assert (len(base), len(a), len(b)) == (2, 4, 5)
    assert ra == rb == 2
    assert a[2].op == "add" and b[2].op == "sub"
    np.testing.assert_allclose(a.value(2), [2.0, 6.0])
    np.testing.assert_allclose(a.value(3), np.exp([2.0, 6.0]))
    np.testing.assert_allclose(b.value(2), [0.0, -2.0])
    np.testing.assert_allclose(b.value(4), [0.0, -2.0])
    # continuing the original after both forks is a third independent branch
    c, rc = rec(base, "div", (y, x))
    assert rc == 2 and len(c) == 3 and c[2].op == "div"
    np.testing.assert_allclose(c.value(2), [1.0, 2.0])
    # nothing leaked between branches
    assert a[2].op == "add" and b[2].op == "sub" and len(a) == 4 and len(b) == 5
    # gradients on each branch are those of that branch
    ga = tfl.backward(a, ra2, seed=jnp.ones(2))[x]
    gb = tfl.backward(b, rb3, seed=jnp.ones(2))[x]
    xv = jnp.array([1.0, 2.0])
    chex.assert_trees_all_close(ga, jax.grad(lambda v: jnp.sum(jnp.exp(v + v * v)))(xv), rtol=1e-6, strict=True)
    chex.assert_trees_all_close(gb, jax.grad(lambda v: jnp.sum(v - v * v))(xv), rtol=1e-6, strict=True)


def test_fork_of_a_fork_and_leaf_forks():
    t0, x = tfl.leaf(tfl.Tape.empty(), jnp.array(2.0))
    t1, _ = tfl.leaf(t0, jnp.array(3.0))
    t2, _ = tfl.leaf(t0, jnp.array(4.0))  # fork by a leaf
    t3, _ = tfl.leaf(t2, jnp.array(5.0))
    t4, _ = tfl.leaf(t2, jnp.array(6.0))  # fork of the fork
    assert [float(v) for v in vals(t1)] == [2.0, 3.0]
    assert [float(v) for v in vals(t3)] == [2.0, 4.0, 5.0]
    assert [float(v) for v in vals(t4)] == [2.0, 4.0, 6.0]
    assert [float(v) for v in vals(t2)] == [2.0, 4.0]


def test_concurrent_forks_from_threads():
    base, x = tfl.leaf(tfl.Tape.empty(), jnp.arange(4.0))
    out: dict[int, tfl.Tape] = {}

    def work(k):
        t = base
        for _ in range(k + 1):
            t, _ = tfl.leaf(t, jnp.full(4, float(k)))
        out[k] = t

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(base) == 1
    for k, t in out.items():
        assert len(t) == k + 2
        np.testing.assert_array_equal(t.value(0), np.arange(4.0))
        for i in range(1, k + 2):
            np.testing.assert_array_equal(t.value(i), np.full(4, float(k)))


# --------------------------------------------------------------------------- pytree / jit


def _small_tape():
    t, x = tfl.leaf(tfl.Tape.empty(), jnp.array([1.0, -2.0, 3.0]), requires_grad=True)
    t, w = tfl.leaf(t, jnp.array(0.5))
    t, y = rec(t, "mul", (x, w))
    t, z = rec(t, "sum", (y,))
    return t, x, w, y, z


def test_tree_leaves_are_node_values():
    t, *_ = _small_tape()
    leaves = jax.tree_util.tree_leaves(t)
    assert len(leaves) == len(t) == 4
    for a, nd in zip(leaves, t):
        assert a is nd.value
    assert jax.tree_util.tree_leaves(tfl.Tape.empty()) == []


def test_tree_map_over_tape():
    t, x, w, y, z = _small_tape()
    t2 = jax.tree_util.tree_map(lambda v: v * 2, t)
    assert isinstance(t2, tfl.Tape) and len(t2) == len(t)
    for a, b in zip(t, t2):
        assert (a.op, a.parents, a.attrs, a.requires_grad, a.shape, a.dtype) == (
            b.op,
            b.parents,
            b.attrs,
            b.requires_grad,
            b.shape,
            b.dtype,
        )
        np.testing.assert_allclose(b.value, 2 * np.asarray(a.value))
    # the original is untouched and the mapped tape is a working tape
    np.testing.assert_allclose(t.value(2), [0.5, -1.0, 1.5])
    t3, r = rec(t2, "add", (y, x))
    np.testing.assert_allclose(t3.value(r), [3.0, -6.0, 9.0])
    assert len(t2) == 4
    # same structure both ways
    assert jax.tree_util.tree_structure(t) == jax.tree_util.tree_structure(t2)


def test_tape_through_jit_argument_and_result():
    t, x, w, y, z = _small_tape()

    @jax.jit
    def grow(tape):
        tape, a = rec(tape, "exp", (2,))
        tape, b = rec(tape, "mul", (a, 0))
        return tape

    t2 = grow(t)
    assert isinstance(t2, tfl.Tape) and len(t2) == 6 and len(t) == 4
    assert [nd.op for nd in t2] == [None, None, "mul", "sum", "exp", "mul"]
    xv = np.array([1.0, -2.0, 3.0])
    np.testing.assert_allclose(t2.value(4), np.exp(xv * 0.5), rtol=1e-6)
    np.testing.assert_allclose(t2.value(5), np.exp(xv * 0.5) * xv, rtol=1e-6)
    assert t2[5].requires_grad and not t2[1].requires_grad
    # the returned tape keeps working eagerly
    t3, r = rec(t2, "sum", (5,))
    g = tfl.backward(t3, r)
    want = jax.grad(lambda v: jnp.sum(jnp.exp(v * 0.5) * v))(jnp.asarray(xv))
    chex.assert_trees_all_close(g[0], want, rtol=1e-6, strict=True)

    # and backward itself can run on a tape passed into jit
    gj = jax.jit(lambda tape: tfl.backward(tape, 3))(t)
    assert set(gj) == {0}
    np.testing.assert_allclose(gj[0], np.full(3, 0.5))


def test_jit_retrace_keyed_on_tape_structure():
    calls = []

    @jax.jit
    def f(tape):
        calls.append(1)
        return jnp.sum(tape.value(len(tape) - 1))

    t1, _ = tfl.leaf(tfl.Tape.empty(), jnp.ones(3))
    t2, _ = tfl.leaf(tfl.Tape.empty(), 2 * jnp.ones(3))
    assert float(f(t1)) == 3.0 and float(f(t2)) == 6.0
    assert len(calls) == 1  # same structure, different values: one trace
    t3, _ = rec(t1, "exp", (0,))
    np.testing.assert_allclose(f(t3), 3 * np.e, rtol=1e-6)
    assert len(calls) == 2


# --------------------------------------------------------------------------- failure atomicity


def _failure_tape():
    t = tfl.Tape.empty()
    t, a = tfl.leaf(t, jnp.ones((2, 3), jnp.float32), requires_grad=True)
    t, b = tfl.leaf(t, jnp.ones((2, 3), jnp.float64), requires_grad=True)
    t, c = tfl.leaf(t, jnp.ones((4,), jnp.float32), requires_grad=True)
    return t


# (id, op, inputs, attrs, substrings that the message must contain)
FAILURES = [
    ("unknown-op", "frobnicate", (0,), {}, ["frobnicate", "float32[2,3]"]),
    ("arity-low", "add", (0,), {}, ["add", "float32[2,3]"]),
    ("arity-high", "exp", (0, 0), {}, ["exp", "float32[2,3]"]),
    ("shape", "add", (0, 2), {}, ["add", "float32[2,3]", "float32[4]"]),
    ("dtype", "add", (0, 1), {}, ["add", "float32[2,3]", "float64[2,3]"]),
    ("matmul-shape", "matmul", (0, 0), {}, ["matmul", "float32[2,3]"]),
    ("unknown-attr", "sum", (0,), {"bogus": 1}, ["sum", "bogus", "float32[2,3]"]),
    ("bad-attr-value", "sum", (0,), {"axis": 5}, ["sum", "axis", "float32[2,3]"]),
    ("missing-attr", "astype", (0,), {}, ["astype", "dtype", "float32[2,3]"]),
    ("out-of-range", "add", (0, 3), {}, ["add", "3"]),
    ("far-out-of-range", "exp", (10**9,), {}, ["exp", str(10**9)]),
    ("negative", "add", (0, -1), {}, ["add", "-1"]),
    ("float-id", "add", (0, 1.0), {}, ["add", "1.0"]),
    ("str-id", "exp", ("0",), {}, ["exp", "'0'"]),
    ("bool-id", "exp", (True,), {}, ["exp", "True"]),
    ("none-id", "exp", (None,), {}, ["exp", "None"]),
    ("inputs-not-sequence", "exp", 0, {}, ["exp"]),
    ("unhashable-attr-set", "sum", (0,), {"axis": {0, 1}}, ["sum", "hashable", "float32[2,3]"]),
    ("unhashable-attr-array", "sum", (0,), {"axis": jnp.array(0)}, ["sum", "hashable", "float32[2,3]"]),
    ("non-float-unary", "exp", (3,), {}, ["exp", "int32[3]"]),
]


@pytest.mark.parametrize("case", FAILURES, ids=[c[0] for c in FAILURES])
def test_failed_record_is_atomic(case):
    _, op, inputs, attrs, needles = case
    t = _failure_tape()
    if case[0] == "non-float-unary":
        t, _ = tfl.leaf(t, jnp.arange(3, dtype=jnp.int32))
    n = len(t)
    before_vals = vals(t)
    before_cache = tfl.kernel_cache_info()
    t2, r = tfl.record(t, op, inputs, **attrs)
    assert t2 is t
    assert len(t) == n
    assert isinstance(r, tfl.Err) and not r.is_ok and r.value is None
    for s in needles:
        assert s in r.error, (s, r.error)
    assert tfl.kernel_cache_info() == before_cache
    for a, b in zip(vals(t), before_vals):
        np.testing.assert_array_equal(a, b)
    # the same tape still records valid ops with the right ids and values
    t3, r3 = tfl.record(t, "mul", (0, 0))
    assert r3.is_ok and r3.value == n and len(t3) == n + 1
    np.testing.assert_array_equal(t3.value(n), np.ones((2, 3), np.float32))
    # and a failed record did not silently extend the shared buffer
    t4, r4 = tfl.record(t, "add", (0, 0))
    assert r4.value == n and t4.value(n).dtype == jnp.float32
    np.testing.assert_array_equal(t4.value(n), 2 * np.ones((2, 3), np.float32))
    assert len(t3) == n + 1 and t3[n].op == "mul"


def test_failed_record_does_not_touch_kernel_caches_fresh_shapes():
    # shapes never used anywhere else, so any cache insert would be visible
    t = tfl.Tape.empty()
    t, a = tfl.leaf(t, jnp.ones((7, 13), jnp.float32))
    t, b = tfl.leaf(t, jnp.ones((7, 13), jnp.float64))
    t, c = tfl.leaf(t, jnp.ones((11,), jnp.float32))
    before = tfl.kernel_cache_info()
    for op, ins, kw in [
        ("add", (a, b), {}),
        ("add", (a, c), {}),
        ("matmul", (a, c), {}),
        ("sum", (a,), {"axis": 2}),
        ("sum", (a,), {"nope": 0}),
        ("astype", (a,), {}),
        ("exp", (a, a), {}),
        ("where", (a, a, a), {}),
    ]:
        t2, r = tfl.record(t, op, ins, **kw)
        assert t2 is t and not r.is_ok
    assert tfl.kernel_cache_info() == before
    # a successful record with a fresh key does add one forward kernel (the counter is live)
    t2, r = tfl.record(t, "mul", (a, a))
    assert r.is_ok
    assert tfl.kernel_cache_info()["fwd"] == before["fwd"] + 1


def test_keep_tape_on_error():
    t0, x = tfl.leaf(tfl.Tape.empty(), jnp.ones(2))
    t, r = tfl.keep_tape_on_error(t0, tfl.record(t0, "exp", (x,)))
    assert r.is_ok and len(t) == 2
    t, r = tfl.keep_tape_on_error(t0, tfl.record(t0, "exp", (x, x)))
    assert t is t0 and not r.is_ok
    t, r = tfl.keep_tape_on_error(t0, KeyError("k"))
    assert t is t0 and r.error.startswith("KeyError")
    t, r = tfl.keep_tape_on_error(t0, tfl.Ok(1))
    assert t is t0 and r == tfl.Ok(1)


# --------------------------------------------------------------------------- backward
# The pure-core backward tests run as chex variants: once eagerly and once with the
# whole program (recording and backward) under jax.jit, where every kernel inlines
# into one trace. Node ids are Python ints fixed by the recording order, so they are
# read from an eager recording; under jit the gradient dict keeps them as its keys.


def _three_leaf_values():
    rs = rng(1)
    return tuple(jnp.asarray(rs.normal(size=s)) for s in [(3,), (3,), (2, 3)])


def _three_leaf_build(av, bv, cv):
    t = tfl.Tape.empty()
    t, a = tfl.leaf(t, av, requires_grad=True)
    t, b = tfl.leaf(t, bv, requires_grad=True)
    t, c = tfl.leaf(t, cv, requires_grad=False)
    t, ab = rec(t, "mul", (a, b))
    t, abc = rec(t, "add", (c, ab))  # broadcast (2,3) + (3,)
    t, e = rec(t, "exp", (abc,))
    t, z = rec(t, "sum", (e,))
    return t, z, (a, b, c, ab, abc, e, z)


def _three_leaf_tape():
    vs = _three_leaf_values()
    t, _, ids = _three_leaf_build(*vs)
    return t, ids, vs


class TestBackward(chex.TestCase):
    def backward(self, build, *values, seed=None, wrt=None):
        """``tfl.backward(tape, root, seed=seed, wrt=wrt)`` for ``(tape, root, ...) = build(*values)``, run
        through ``self.variant`` (the values and the seed are traced under jit; ``wrt`` ids stay static)."""
        root = build(*values)[1]
        return self.variant(lambda vs, s: tfl.backward(build(*vs)[0], root, seed=s, wrt=wrt))(values, seed)

    @chex.variants(with_jit=True, without_jit=True)
    def test_backward_scalar_default_seed(self):
        xv = jnp.array([0.3, -1.2, 2.0])

        def build(v):
            t, x = tfl.leaf(tfl.Tape.empty(), v, requires_grad=True)
            t, s = rec(t, "sin", (x,))
            t, y = rec(t, "mul", (s, x))
            t, z = rec(t, "sum", (y,))
            return t, z, x, y

        _, _, x, _ = build(xv)
        g = self.backward(build, xv)
        assert set(g) == {x}
        chex.assert_trees_all_close(g[x], jax.grad(lambda v: jnp.sum(jnp.sin(v) * v))(xv), rtol=1e-12, strict=True)

        # an Ok is accepted as the root too, with the same gradient
        def by_ok(v):
            t, _, _, y = build(v)
            t, zr = tfl.record(t, "sum", (y,))
            assert zr.is_ok
            return tfl.backward(t, zr)

        chex.assert_trees_all_close(self.variant(by_ok)(xv), g, rtol=1e-12, strict=True)

    @chex.variants(with_jit=True, without_jit=True)
    def test_backward_nonscalar_root_needs_seed(self):
        def build(v):
            t, x = tfl.leaf(tfl.Tape.empty(), v, requires_grad=True)
            t, y = rec(t, "exp", (x,))
            return t, y

        with pytest.raises(tfl.TapeError, match="seed"):
            self.backward(build, jnp.ones((2, 2)))
        with pytest.raises(tfl.TapeError, match="seed"):
            self.backward(build, jnp.ones((2, 2)), seed=jnp.ones(3))

    @chex.variants(with_jit=True, without_jit=True)
    def test_backward_explicit_seed(self):
        xv = jnp.array([[0.5, -1.0], [2.0, 0.1]])
        sv = jnp.array([[1.0, 2.0], [-3.0, 0.25]])

        def build(v):
            t, x = tfl.leaf(tfl.Tape.empty(), v, requires_grad=True)
            t, y = rec(t, "tanh", (x,))
            return t, y, x

        x = build(xv)[2]
        g = self.backward(build, xv, seed=sv)
        _, pull = jax.vjp(jnp.tanh, xv)
        chex.assert_trees_all_close(g[x], pull(sv)[0], rtol=1e-12, strict=True)

        # a scalar root with an explicit seed scales the gradient
        def build_sum(v):
            t, y, _ = build(v)
            t, z = rec(t, "sum", (y,))
            return t, z

        g3 = self.backward(build_sum, xv, seed=jnp.array(3.0))
        chex.assert_trees_all_close(g3[x], 3 * (1 - jnp.tanh(xv) ** 2), rtol=1e-12, strict=True)

    @chex.variants(with_jit=True, without_jit=True)
    def test_backward_bad_root_and_wrt(self):
        def backward(root, **kw):
            def f(v):
                t, _ = tfl.leaf(tfl.Tape.empty(), v, requires_grad=True)
                return tfl.backward(t, root, **kw)

            return self.variant(f)(jnp.array(1.0))

        for root in (1, -1, "0", True):
            with pytest.raises(tfl.TapeError):
                backward(root)
        for wrt in ([5], ["0"]):
            with pytest.raises(tfl.TapeError):
                backward(0, wrt=wrt)

    @chex.variants(with_jit=True, without_jit=True)
    def test_backward_wrt_restricts_and_requires_grad_false_is_absent(self):
        vs = _three_leaf_values()
        _, _, (a, b, *_) = _three_leaf_build(*vs)
        plain = lambda a_, b_, c_: jnp.sum(jnp.exp(c_ + a_ * b_))  # noqa: E731
        ga, gb, gc = jax.grad(plain, argnums=(0, 1, 2))(*vs)
        g = self.backward(_three_leaf_build, *vs)
        assert set(g) == {a, b}  # c does not require grad
        chex.assert_trees_all_close((g[a], g[b]), (ga, gb), rtol=1e-12, strict=True)
        g = self.backward(_three_leaf_build, *vs, wrt=[b])
        assert set(g) == {b}
        chex.assert_trees_all_close(g[b], gb, rtol=1e-12, strict=True)

    @chex.variants(with_jit=True, without_jit=True)
    def test_backward_interior_nodes_in_wrt(self):
        vs = av, bv, cv = _three_leaf_values()
        _, _, (a, b, c, ab, abc, e, z) = _three_leaf_build(*vs)
        g = self.backward(_three_leaf_build, *vs, wrt=[ab, e, a, z])
        assert set(g) == {ab, e, a, z}
        pre = cv + av * bv
        chex.assert_trees_all_close(g[e], np.ones((2, 3)), strict=True)
        chex.assert_trees_all_close(g[z], np.float64(1.0), strict=True)
        want_ab = jax.grad(lambda h: jnp.sum(jnp.exp(cv + h)))(av * bv)
        chex.assert_trees_all_close(g[ab], want_ab, rtol=1e-12, strict=True)
        chex.assert_trees_all_close(g[a], np.sum(np.exp(pre), axis=0) * bv, rtol=1e-12, strict=True)

    @chex.variants(with_jit=True, without_jit=True)
    def test_backward_unreached_requested_leaf_gets_zeros(self):
        def build(xv, uv):
            t, x = tfl.leaf(tfl.Tape.empty(), xv, requires_grad=True)
            t, u = tfl.leaf(t, uv, requires_grad=True)  # never used
            t, y = rec(t, "sum", (x,))
            return t, y, x, u

        vs = (jnp.ones(3), jnp.ones((2, 5), jnp.float32))
        _, _, x, u = build(*vs)
        g = self.backward(build, *vs, wrt=[x, u])
        assert set(g) == {x, u}
        assert g[u].shape == (2, 5) and g[u].dtype == jnp.float32
        np.testing.assert_array_equal(g[u], np.zeros((2, 5)))
        np.testing.assert_array_equal(g[x], np.ones(3))
        # without wrt the unreached leaf is simply absent
        assert set(self.backward(build, *vs)) == {x}

    @chex.variants(with_jit=True, without_jit=True)
    def test_backward_sums_cotangents_of_shared_leaf(self):
        xv = jnp.array([0.7, -0.4, 1.9])

        def build(v):
            t, x = tfl.leaf(tfl.Tape.empty(), v, requires_grad=True)
            t, a = rec(t, "mul", (x, x))
            t, b = rec(t, "sin", (x,))
            t, c = rec(t, "add", (a, b))
            t, d = rec(t, "mul", (c, x))
            t, e = rec(t, "add", (d, x))
            t, z = rec(t, "sum", (e,))
            return t, z, x

        x = build(xv)[2]
        g = self.backward(build, xv)
        want = jax.grad(lambda v: jnp.sum((v * v + jnp.sin(v)) * v + v))(xv)
        chex.assert_trees_all_close(g, {x: want}, rtol=1e-12, strict=True)

    @chex.variants(with_jit=True, without_jit=True)
    def test_backward_integer_leaves_never_require_grad(self):
        def build(iv, mv, xv):
            t, i = tfl.leaf(tfl.Tape.empty(), iv, requires_grad=True)
            t, bmask = tfl.leaf(t, mv, requires_grad=True)
            t, x = tfl.leaf(t, xv, requires_grad=True)
            t, fi = rec(t, "astype", (i,), dtype=jnp.float64)
            t, y = rec(t, "mul", (fi, x))
            t, y2 = rec(t, "where", (bmask, y, x))
            t, z = rec(t, "sum", (y2,))
            return t, z, (i, bmask, x, fi)

        vs = (jnp.arange(3), jnp.array([True, False, True]), jnp.array([1.0, 2.0, 3.0]))
        t, _, (i, bmask, x, fi) = build(*vs)
        assert not t[i].requires_grad and not t[bmask].requires_grad and t[x].requires_grad
        assert not t[fi].requires_grad
        g = self.backward(build, *vs)
        assert set(g) == {x}
        chex.assert_trees_all_close(g[x], np.array([0.0, 1.0, 2.0]), strict=True)

    @chex.variants(with_jit=True, without_jit=True)
    def test_backward_matches_jax_grad_mlp(self):
        rs = rng(2)
        xv = jnp.asarray(rs.normal(size=(5, 4)))
        w1v = jnp.asarray(rs.normal(size=(4, 6)))
        b1v = jnp.asarray(rs.normal(size=(6,)))
        w2v = jnp.asarray(rs.normal(size=(6, 3)))

        def build(xv, w1v, b1v, w2v):
            t = tfl.Tape.empty()
            t, x = tfl.leaf(t, xv)
            t, w1 = tfl.leaf(t, w1v, requires_grad=True)
            t, b1 = tfl.leaf(t, b1v, requires_grad=True)
            t, w2 = tfl.leaf(t, w2v, requires_grad=True)
            t, h = rec(t, "matmul", (x, w1))
            t, h = rec(t, "add", (h, b1))
            t, h = rec(t, "tanh", (h,))
            t, o = rec(t, "matmul", (h, w2))
            t, o2 = rec(t, "mul", (o, o))
            t, m = rec(t, "max", (o2,), axis=1)
            t, l = rec(t, "mean", (m,))
            return t, l, (w1, b1, w2)

        def plain(w1_, b1_, w2_):
            o_ = jnp.tanh(xv @ w1_ + b1_) @ w2_
            return jnp.mean(jnp.max(o_ * o_, axis=1))

        want = jax.grad(plain, argnums=(0, 1, 2))(w1v, b1v, w2v)
        ids = build(xv, w1v, b1v, w2v)[2]
        g = self.backward(build, xv, w1v, b1v, w2v)
        assert set(g) == set(ids)
        chex.assert_trees_all_close(tuple(g[k] for k in ids), want, rtol=1e-10, atol=1e-12, strict=True)

    @chex.variants(with_jit=True, without_jit=True)
    def test_backward_float32_dtypes_preserved(self):
        def build(v):
            t, x = tfl.leaf(tfl.Tape.empty(), v, requires_grad=True)
            t, y = rec(t, "exp", (x,))
            t, z = rec(t, "sum", (y,))
            return t, z, x

        xv = jnp.array([1.0, 2.0], jnp.float32)
        x = build(xv)[2]
        g = self.backward(build, xv)
        assert g[x].dtype == jnp.float32
        np.testing.assert_allclose(g[x], np.exp([1.0, 2.0]), rtol=1e-6)


# --------------------------------------------------------------------------- backward peak memory


def _long_chain(n):
    xv = jnp.linspace(-1.0, 1.0, 16)
    t, x = tfl.leaf(tfl.Tape.empty(), xv, requires_grad=True)
    h = x
    for k in range(n):
        if k % 2:
            t, h = rec(t, "sin", (h,))
        else:
            t, h = rec(t, "add", (h, x))  # x gets a cotangent on every other step
    t, z = rec(t, "sum", (h,))
    return t, x, z, xv


def test_backward_drops_interior_cotangents(monkeypatch):
    n = 2000
    t, x, z, xv = _long_chain(n)
    gc.collect()
    samples: list[int] = []
    calls = [0]
    real_get_vjp = _registry.get_vjp

    def spy_get_vjp(*a, **k):
        fn = real_get_vjp(*a, **k)

        def wrapped(*args):
            calls[0] += 1
            if calls[0] % 50 == 1:
                samples.append(len(jax.live_arrays()))
            return fn(*args)

        return wrapped

    monkeypatch.setattr(_registry, "get_vjp", spy_get_vjp)
    g = tfl.backward(t, z)
    monkeypatch.undo()
    assert calls[0] == n + 1
    assert len(samples) >= 30
    # the tape holds n + 2 values; retained cotangents would add ~1 array per node swept
    growth = max(samples) - samples[0]
    assert growth < 40, f"live arrays grew by {growth} over a {n}-op sweep: cotangents are kept"

    def plain(v):
        h, _ = jax.lax.scan(lambda h, _: (jnp.sin(h + v), None), v, None, length=n // 2)
        return jnp.sum(h)

    chex.assert_trees_all_close(g[x], jax.grad(plain)(xv), rtol=1e-9, atol=1e-12, strict=True)


# --------------------------------------------------------------------------- inside jax.jit


def _tape_loss_grads(xv, w1v, w2v):
    t = tfl.Tape.empty()
    t, x = tfl.leaf(t, xv)
    t, w1 = tfl.leaf(t, w1v, requires_grad=True)
    t, w2 = tfl.leaf(t, w2v, requires_grad=True)
    t, h = rec(t, "matmul", (x, w1))
    t, h = rec(t, "sigmoid", (h,))
    t, h2 = rec(t, "mul", (h, h))
    t, o = rec(t, "matmul", (h2, w2))
    t, l = rec(t, "sum", (o,))
    t, l = rec(t, "log", (l,))
    g = tfl.backward(t, l)
    return t.value(l), g[w1], g[w2]


def _plain_loss(w1v, w2v, xv):
    h = jax.nn.sigmoid(xv @ w1v)
    return jnp.log(jnp.sum((h * h) @ w2v))


def test_backward_inside_jit_matches_eager_and_jax_grad():
    rs = rng(3)
    xv = jnp.asarray(rs.normal(size=(4, 3)))
    w1v = jnp.asarray(rs.normal(size=(3, 5)))
    w2v = jnp.asarray(np.abs(rs.normal(size=(5, 2))) + 0.1)
    eager = _tape_loss_grads(xv, w1v, w2v)
    traces = []

    def counted(*a):
        traces.append(1)
        return _tape_loss_grads(*a)

    # the whole tape program compiles once: chex fails a second trace of the same shapes
    jitted = jax.jit(chex.assert_max_traces(counted, n=1))
    inside = jitted(xv, w1v, w2v)
    inside2 = jitted(xv * 0.5, w1v, w2v)
    assert len(traces) == 1
    loss, (g1, g2) = jax.value_and_grad(_plain_loss, argnums=(0, 1))(w1v, w2v, xv)
    chex.assert_trees_all_close(inside, eager, rtol=1e-12, strict=True)
    chex.assert_trees_all_close(inside[0], loss, rtol=1e-12, strict=True)
    chex.assert_trees_all_close(inside[1:], (g1, g2), rtol=1e-10, strict=True)
    # no retrace for new values, and the new values are the ones used
    want2 = jax.grad(_plain_loss, argnums=0)(w1v, w2v, xv * 0.5)
    chex.assert_trees_all_close(inside2[1], want2, rtol=1e-10, strict=True)
    # the trace counter is live: new shapes are a second trace, which it rejects
    with pytest.raises(AssertionError, match="traced > 1 times"):
        jitted(xv[:2], w1v, w2v)


def test_failed_record_inside_jit_is_atomic():
    @jax.jit
    def f(v):
        t, x = tfl.leaf(tfl.Tape.empty(), v, requires_grad=True)
        t2, r = tfl.record(t, "matmul", (x, x, x))
        assert t2 is t and not r.is_ok and "matmul" in r.error
        t, y = rec(t, "mul", (x, x))
        t, z = rec(t, "sum", (y,))
        return tfl.backward(t, z)[x]

    np.testing.assert_allclose(f(jnp.array([1.0, 3.0])), [2.0, 6.0])


def test_grad_of_function_using_tape():
    # jax.grad can differentiate *through* a function that records on a tape
    def f(v):
        t, x = tfl.leaf(tfl.Tape.empty(), v)
        t, y = rec(t, "sin", (x,))
        t, z = rec(t, "sum", (y,))
        return t.value(z)

    xv = jnp.array([0.1, 0.2])
    np.testing.assert_allclose(jax.grad(f)(xv), np.cos(xv), rtol=1e-12)


# --------------------------------------------------------------------------- to_dot


def test_to_dot_contains_every_node_and_edge():
    t, (a, b, c, ab, abc, e, z), _ = _three_leaf_tape()
    t, sq = rec(t, "mul", (e, e))
    dot = t.to_dot()
    lines = [ln.strip() for ln in dot.splitlines()]
    assert lines[0].startswith("digraph") and lines[-1] == "}"
    for i, nd in enumerate(t):
        node_lines = [ln for ln in lines if ln.startswith(f"n{i} [")]
        assert len(node_lines) == 1, i
        assert f"#{i}" in node_lines[0]
        assert (nd.op or "leaf") in node_lines[0]
        assert f"[{','.join(map(str, nd.shape))}]" in node_lines[0]
    edges = sorted(tuple(int(p[1:]) for p in ln.rstrip(";").split(" -> ")) for ln in lines if "->" in ln)
    want = sorted((p, i) for i, nd in enumerate(t) for p in nd.parents)
    assert edges == want
    assert (e, sq) in edges and edges.count((e, sq)) == 2
    assert tfl.Tape.empty().to_dot().count("->") == 0


def test_to_dot_names_leaves_and_draws_the_storages_they_read():
    t, (a, b, c, ab, abc, e, z), _ = _three_leaf_tape()
    dot = t.to_dot(labels={a: "W", b: "W_dec", c: "b"}, storages={a: "W storage", b: "W storage", c: "b storage"})
    lines = [ln.strip() for ln in dot.splitlines()]
    assert any(ln.startswith(f'n{a} [label="#{a} leaf W (tied)') for ln in lines)
    assert any(ln.startswith(f'n{b} [label="#{b} leaf W_dec (tied)') for ln in lines)
    assert any(ln.startswith(f'n{c} [label="#{c} leaf b\\n') for ln in lines)
    assert lines.count('s0 [label="W storage", shape=cylinder, style=filled, fillcolor="#fde7d9"];') == 1
    # the gradient edges point the way their label says: from each leaf's cotangent into the storage
    # (dir=back draws the arrowhead at the storage, which stays ranked above the leaves)
    assert f's0 -> n{a} [dir=back, style=dashed, color="#c2410c", label="cotangents summed"];' in lines
    assert f's0 -> n{b} [dir=back, style=dashed, color="#c2410c", label="cotangents summed"];' in lines
    assert f's1 -> n{c} [dir=back, style=dashed, color="#c2410c"];' in lines  # one reader: not tied
    legend = [ln for ln in lines if ln.startswith("legend [")]
    assert len(legend) == 1 and "solid arrows: values, forward" in legend[0]
    assert "dashed arrows: cotangents, backward" in legend[0]
    assert "legend" not in t.to_dot()  # no storage drawn: no dashed arrow to explain
    html = t._repr_html_(labels={a: "W"}, storages={a: "W storage", b: "W storage"})
    assert "<th>name</th><th>storage</th>" in html and "<td>W</td><td>W storage (tied)</td>" in html
    assert "<th>name</th>" not in t._repr_html_()  # without labels: the table as before


def test_session_to_dot_names_param_leaves():
    W = tfl.Param(jnp.ones((3, 2), jnp.float32), name="W")
    with tfl.Session() as s:
        h = s.input(jnp.ones((1, 3), jnp.float32)) @ W
        tfl.sum(h @ tfl.tie(W, name="W_dec").T)
        names, storages = s.leaf_names(), s.leaf_storages()
        dot = s.to_dot()
        assert dot == s.tape.to_dot(labels=names, storages=storages)
    assert list(names.values()) == ["W", "W_dec"] and set(storages.values()) == {"W storage"}
    assert "leaf W (tied)" in dot and "leaf W_dec (tied)" in dot and dot.count("cotangents summed") == 2


def test_node_fields():
    t, x = tfl.leaf(tfl.Tape.empty(), jnp.ones((2, 3)), requires_grad=True)
    t, s = rec(t, "sum", (x,), axis=1, keepdims=True)
    nd = t[s]
    assert nd.op == "sum" and nd.parents == (x,) and nd.shape == (2, 1)
    assert dict(nd.attrs) == {"axis": 1, "keepdims": True}
    assert nd.requires_grad and nd.dtype == np.float64
    assert t[np.int64(1)] is nd
    with pytest.raises(IndexError):
        t[True]  # a bool is not a node id
