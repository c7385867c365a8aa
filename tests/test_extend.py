"""The public op extension API: ``tfl.lift`` (any JAX function as an op) and ``tfl.defop`` (a hand-written VJP).

Oracles: the lifted function itself for forward values, ``jax.grad`` of the same
pure function for gradients (so a ``jax.custom_vjp`` rule is the oracle's rule
too), central finite differences for hand-written VJPs. Every op a test
registers is named ``test_extend_*`` and removed again after the test, so other
test files see only the built-in ops.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jax.scipy.special as jsp
import numpy as np
import optax
import pytest

import tapeflow as tfl
from tapeflow import TapeError
from tapeflow._core import _kernels
from tapeflow._core import _registry as R

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-9  # float64 (the suite's conftest enables x64)


@pytest.fixture(autouse=True)
def _clean_registry():
    """Remove the ops a test registered (and their kernels), whatever happened in it."""
    before = set(R.REGISTRY)
    yield
    for name in sorted(set(R.REGISTRY) - before):
        if R.REGISTRY[name].user:
            R.unregister(name)
    assert set(R.REGISTRY) == before


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _close(a: Any, b: Any, tol: float = TOL) -> None:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=tol, atol=tol)


# --------------------------------------------------------------------------- lifted jax functions vs jax.grad


@dataclass
class Case:
    fn: Callable[..., Any]
    inputs: Callable[[np.random.Generator], list[np.ndarray]]
    static: dict[str, Any] = field(default_factory=dict)
    diff: tuple[int, ...] | None = None  # inputs to differentiate (default: every float one)
    ref: Callable[..., Any] | None = None  # the oracle, called like the lifted function (default: fn)


def _normal(*shape: int) -> Callable[[np.random.Generator], np.ndarray]:
    return lambda r: r.standard_normal(shape)


def _inputs(*makers: Callable[[np.random.Generator], Any]) -> Callable[[np.random.Generator], list[Any]]:
    return lambda r: [m(r) for m in makers]


def _spd(r: np.random.Generator) -> np.ndarray:
    a = r.standard_normal((3, 3))
    return a @ a.T + 3 * np.eye(3)


@jax.custom_jvp
def _soft_clip(x):
    return jnp.tanh(x)


_soft_clip.defjvp(lambda primals, tangents: (jnp.tanh(primals[0]), 0.5 * tangents[0]))  # deliberately not tanh'


def _einsum(subscripts, a, b):  # the static argument comes first: lift passes it positionally
    return jnp.einsum(subscripts, a, b)


CASES: dict[str, Case] = {
    "norm": Case(jnp.linalg.norm, _inputs(_normal(3, 4))),
    "norm_axis": Case(jnp.linalg.norm, _inputs(_normal(3, 4)), {"axis": 1}),
    "softplus": Case(jax.nn.softplus, _inputs(_normal(5))),
    "logsumexp": Case(jsp.logsumexp, _inputs(_normal(3, 4)), {"axis": 1}),
    "cumsum": Case(jnp.cumsum, _inputs(_normal(3, 4)), {"axis": 0}),
    "sort": Case(jnp.sort, _inputs(_normal(6))),
    "tanh": Case(jnp.tanh, _inputs(_normal(2, 3))),
    "gelu": Case(jax.nn.gelu, _inputs(_normal(7))),
    "gelu_exact": Case(jax.nn.gelu, _inputs(_normal(7)), {"approximate": False}),
    "det": Case(jnp.linalg.det, _inputs(_spd)),
    "inv": Case(jnp.linalg.inv, _inputs(_spd)),
    "cholesky": Case(jnp.linalg.cholesky, _inputs(_spd)),
    "einsum": Case(
        _einsum,
        _inputs(_normal(2, 3), _normal(3, 4)),
        {"subscripts": "ij,jk->ik"},
        ref=lambda a, b, subscripts: jnp.einsum(subscripts, a, b),
    ),
    "softmax": Case(jax.nn.softmax, _inputs(_normal(3, 5))),
    "log_sigmoid": Case(jax.nn.log_sigmoid, _inputs(_normal(4))),
    "silu": Case(jax.nn.silu, _inputs(_normal(4))),
    "erf": Case(jsp.erf, _inputs(_normal(4))),
    "gammaln": Case(jsp.gammaln, _inputs(lambda r: np.abs(r.standard_normal(4)) + 0.5)),
    "arctan2": Case(jnp.arctan2, _inputs(_normal(4), _normal(4))),  # a jnp ufunc: operands are *args
    "outer": Case(jnp.outer, _inputs(_normal(3), _normal(2))),
    "prod": Case(jnp.prod, _inputs(_normal(2, 3)), {"axis": 1}),
    "max": Case(jnp.max, _inputs(_normal(2, 5)), {"axis": 0}),
    "where": Case(jnp.where, _inputs(lambda r: r.standard_normal(5) > 0, _normal(5), _normal(5)), diff=(1, 2)),
    "clip": Case(lambda x, lo, hi: jnp.clip(x, lo, hi), _inputs(_normal(6), lambda r: -0.3, lambda r: 0.4), diff=(0,)),
    "slogdet": Case(jnp.linalg.slogdet, _inputs(_spd)),  # a namedtuple (sign, logabsdet)
    "custom_jvp": Case(_soft_clip, _inputs(_normal(5))),
    "tuple_out": Case(lambda x: (jnp.sin(x), 2 * jnp.cos(x)), _inputs(_normal(3))),
    "dict_out": Case(lambda x, y: {"s": x + y, "p": (x * y, jnp.exp(x))}, _inputs(_normal(3), _normal(3))),
}


def _weights(out: Any, seed: int) -> list[np.ndarray]:
    r = _rng(seed)
    return [r.standard_normal(np.shape(leaf)) for leaf in jax.tree_util.tree_leaves(out)]


def _weighted_sum(leaves: list[Any], ws: list[np.ndarray]) -> Any:
    total = None
    for leaf, w in zip(leaves, ws):
        term = (leaf * w).sum()
        total = term if total is None else total + term
    return total


@pytest.mark.parametrize("label", sorted(CASES))
def test_lifted_function_matches_jax(label: str) -> None:
    case = CASES[label]
    xs = case.inputs(_rng(zlib.crc32(label.encode())))
    ref = case.ref or case.fn
    lifted = tfl.lift(case.fn, name=f"test_extend_{label}", static_argnames=tuple(case.static))
    diff = case.diff if case.diff is not None else tuple(i for i, x in enumerate(xs) if np.asarray(x).dtype.kind == "f")
    expected = ref(*xs, **case.static)
    ws = _weights(expected, 1)

    def pure(*dx):
        full = list(xs)
        for i, v in zip(diff, dx):
            full[i] = v
        return _weighted_sum(jax.tree_util.tree_leaves(ref(*full, **case.static)), ws)

    want = jax.grad(pure, argnums=tuple(range(len(diff))))(*(xs[i] for i in diff))

    with tfl.Session() as s:
        hs = [s.input(np.asarray(x), requires_grad=i in diff) if np.ndim(x) else x for i, x in enumerate(xs)]
        n0 = len(s.tape)
        out = lifted(*hs, **case.static)
        leaves = jax.tree_util.tree_leaves(out)
        assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(expected)
        assert len(s.tape) - n0 == len(leaves) + sum(np.ndim(x) == 0 for x in xs)  # one node per leaf (+ constants)
        assert all(isinstance(h, tfl.Tensor) and h.op == f"test_extend_{label}" for h in leaves)
        _close([h.value for h in leaves], jax.tree_util.tree_leaves(expected))
        g = s.backward(_weighted_sum(leaves, ws))
        _close([g[hs[i]] for i in diff], list(want), tol=1e-7)


def test_a_custom_vjp_function_keeps_its_own_rule() -> None:
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    f.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (42.0 * g * x,))  # deliberately not cos(x)
    lifted = tfl.lift(f, name="test_extend_custom_vjp")
    x0 = _rng(0).standard_normal(4)
    with tfl.Session() as s:
        x = s.input(x0, requires_grad=True)
        y = lifted(x)
        _close(y.value, np.sin(x0))
        got = s.backward(tfl.sum(y))[x]
    _close(got, jax.grad(lambda v: jnp.sum(f(v)))(x0))
    _close(got, 42.0 * x0)
    assert not np.allclose(got, np.cos(x0))


def test_lifted_function_on_plain_arrays_just_runs_it() -> None:
    calls = []

    def f(x):
        calls.append(type(x))
        return x * 2

    lifted = tfl.lift(f, name="test_extend_plain")
    with tfl.Session() as s:
        out = lifted(jnp.arange(3.0))
        assert isinstance(out, jax.Array) and len(s.tape) == 0
    _close(jax.jit(lifted)(jnp.arange(3.0)), np.array([0.0, 2.0, 4.0]))  # a tracer: just the function
    assert calls[0] is not tfl.Tensor


def test_lift_as_a_decorator_and_default_name() -> None:
    @tfl.lift
    def test_extend_bare(x):
        return x + 1

    @tfl.lift()
    def test_extend_empty_call(x):
        return x + 2

    @tfl.lift(name="test_extend_named")
    def g(x):
        return x + 3

    assert test_extend_bare.op.name == f"{__name__}.test_lift_as_a_decorator_and_default_name.<locals>.test_extend_bare"
    assert test_extend_bare.__name__ == "test_extend_bare" and g.op.name == "test_extend_named"
    tanh = tfl.lift(jnp.tanh)
    assert tanh.op.name == "jax.numpy.tanh" and tfl.REGISTRY["tanh"].user is False
    with tfl.Session() as s:
        x = s.input(jnp.zeros(2))
        assert [float(f(x)[0]) for f in (test_extend_bare, test_extend_empty_call, g)] == [1.0, 2.0, 3.0]
        assert tanh(x).op == "jax.numpy.tanh"


def test_param_operand_of_a_multi_output_function_is_one_leaf() -> None:
    w0 = _rng(3).standard_normal((3,))
    w = tfl.Param(w0, name="w")
    lifted = tfl.lift(lambda v: (jnp.sin(v), v**2), name="test_extend_param_multi")
    with tfl.Session() as s:
        a, b = lifted(w)
        assert a.node.parents == b.node.parents and len(s.tape) == 3
        got = s.backward(tfl.sum(a) + tfl.sum(b))[w]
    _close(got, jax.grad(lambda v: jnp.sum(jnp.sin(v)) + jnp.sum(v**2))(w0))


# --------------------------------------------------------------------------- compiled: value_and_grad, train_step


def _model() -> tuple[dict[str, tfl.Param], Callable[..., Any], Callable[..., Any], np.ndarray]:
    r = _rng(7)
    w0, b0 = r.standard_normal((4, 3)) * 0.5, r.standard_normal(3) * 0.1
    x = r.standard_normal((5, 4))
    params = {"w": tfl.Param(w0, name="w"), "b": tfl.Param(b0, name="b")}
    softplus = tfl.lift(jax.nn.softplus, name="test_extend_vg_softplus")
    lse = tfl.lift(jsp.logsumexp, name="test_extend_vg_lse", static_argnames="axis")
    split = tfl.lift(lambda h: (jnp.sort(h, axis=1), jnp.linalg.norm(h)), name="test_extend_vg_split")

    def loss_fn(s, xv):
        h = softplus(tfl.apply("linear", xv, params["w"], params["b"]))
        srt, nrm = split(h)
        return tfl.mean(lse(srt * 2.0, axis=1)) + 0.1 * nrm

    def pure(p, xv):
        h = jax.nn.softplus(xv @ p["w"] + p["b"])
        return jnp.mean(jsp.logsumexp(jnp.sort(h, axis=1) * 2.0, axis=1)) + 0.1 * jnp.linalg.norm(h)

    return params, loss_fn, pure, x


@pytest.mark.parametrize("jit", [False, True])
def test_lifted_ops_inside_value_and_grad(jit: bool) -> None:
    params, loss_fn, pure, x = _model()
    f = tfl.value_and_grad(loss_fn)
    loss, grads = (jax.jit(f) if jit else f)(params, x)
    values = {k: p.value for k, p in params.items()}
    want_loss, want = jax.value_and_grad(pure)(values, x)
    _close(loss, want_loss)
    _close(grads, want, tol=1e-7)


def test_lifted_ops_inside_train_step() -> None:
    params, loss_fn, pure, x = _model()
    values = {k: np.asarray(p.value) for k, p in params.items()}
    opt = tfl.Optimizer(optax.sgd(0.1), params)
    step = tfl.train_step(loss_fn, opt)
    for _ in range(3):
        loss = step(x)
        want_loss, g = jax.value_and_grad(pure)(values, x)
        _close(loss, want_loss, tol=1e-7)
        values = jax.tree_util.tree_map(lambda v, d: v - 0.1 * d, values, g)
        _close({k: p.value for k, p in params.items()}, values, tol=1e-7)
    assert step.trace_count == 1


# --------------------------------------------------------------------------- pure core


def test_pure_core_records_a_lifted_op_by_name() -> None:
    tfl.lift(lambda a, b: (a @ b, jnp.tanh(a)), name="test_extend_core")
    a0, b0 = _rng(1).standard_normal((2, 3)), _rng(2).standard_normal((3, 2))
    t, a = tfl.leaf(tfl.Tape.empty(), a0, requires_grad=True)
    t, b = tfl.leaf(t, b0, requires_grad=True)
    t, r0 = tfl.record(t, "test_extend_core", (a, b))
    t, r1 = tfl.record(t, "test_extend_core", (a, b), output=1)
    assert r0.is_ok and r1.is_ok
    _close([t.value(r0.value), t.value(r1.value)], [a0 @ b0, np.tanh(a0)])
    t, s0 = tfl.record(t, "sum", (r0.value,))
    t, s1 = tfl.record(t, "sum", (r1.value,))
    t, total = tfl.record(t, "add", (s0.value, s1.value))
    g = tfl.backward(t, total.value)
    want = jax.grad(lambda p, q: jnp.sum(p @ q) + jnp.sum(jnp.tanh(p)), argnums=(0, 1))(a0, b0)
    _close([g[a], g[b]], list(want))
    # failures: Err naming the op and operand shapes, and the very same tape
    t2, bad = tfl.record(t, "test_extend_core", (a, a))
    assert t2 is t and not bad.is_ok
    assert "test_extend_core" in bad.error and "[2,3]" in bad.error
    for attrs, words in (({"output": 2}, "output=2"), ({"output": -1}, "non-negative"), ({"foo": 1}, "unknown")):
        t2, bad = tfl.record(t, "test_extend_core", (a, b), **attrs)
        assert t2 is t and words in bad.error, bad.error


# --------------------------------------------------------------------------- errors


def test_shape_error_names_op_and_shapes_and_leaves_tape_unchanged() -> None:
    matmul = tfl.lift(lambda a, b: a @ b, name="test_extend_mm")
    w = tfl.Param(np.ones((4, 2)), name="w")
    with tfl.Session() as s:
        a = s.input(np.ones((2, 3)), requires_grad=True)
        n = len(s.tape)
        with pytest.raises(TapeError) as e:
            matmul(a, w)  # the Param is not recorded either
        assert len(s.tape) == n
        msg = str(e.value)
        assert "test_extend_mm" in msg and "float64[2,3]" in msg and "float64[4,2]" in msg
        with pytest.raises(TapeError, match="test_extend_mm"):
            matmul(a, np.ones(5))  # an array constant is not recorded either
        assert len(s.tape) == n
        assert matmul(a, np.ones((3, 2))).shape == (2, 2)


def test_function_raising_at_trace_time_leaves_tape_unchanged() -> None:
    def picky(x):
        if x.shape[0] > 2:
            raise RuntimeError("too long for picky")
        return x * 2

    lifted = tfl.lift(picky, name="test_extend_picky")
    with tfl.Session() as s:
        x = s.input(np.ones(3), requires_grad=True)
        n = len(s.tape)
        with pytest.raises(TapeError, match="too long for picky") as e:
            lifted(x)
        assert "test_extend_picky" in str(e.value) and "float64[3]" in str(e.value)
        assert len(s.tape) == n
        assert lifted(s.input(np.ones(2))).shape == (2,)


def test_name_clash_replace_and_rerun() -> None:
    first = tfl.lift(lambda x: x + 1, name="test_extend_clash")
    with pytest.raises(TapeError, match="already registered with a different function"):
        tfl.lift(jnp.sin, name="test_extend_clash")
    assert tfl.REGISTRY["test_extend_clash"].source is not jnp.sin
    # registering the very same function again is fine
    tfl.lift(first.op.source, name="test_extend_clash")
    # replace=True redefines it; the earlier lifted function now records the new one too
    second = tfl.lift(jnp.sin, name="test_extend_clash", replace=True)
    with tfl.Session() as s:
        x = s.input(np.array([0.5]))
        _close([second(x).value, first(x).value], [np.sin([0.5]), np.sin([0.5])])


def test_rerunning_a_cell_registers_again_without_replace() -> None:
    cell = (
        "import jax.numpy as jnp, tapeflow as tfl\n@tfl.lift(name='test_extend_cell')\ndef f(x):\n    return x * {k}\n"
    )
    ns: dict[str, Any] = {}
    exec(compile(cell.format(k=2), "<cell 1>", "exec"), ns)
    exec(compile(cell.format(k=2), "<cell 2>", "exec"), ns)  # the same cell again
    with pytest.raises(TapeError, match="different function"):
        exec(compile(cell.format(k=3), "<cell 3>", "exec"), ns)  # an edited cell

    # closures over different values are different functions
    def scale(k):
        return lambda x: x * k

    tfl.lift(scale(2.0), name="test_extend_closure")
    tfl.lift(scale(2.0), name="test_extend_closure")
    with pytest.raises(TapeError, match="different function"):
        tfl.lift(scale(3.0), name="test_extend_closure")


def test_built_in_names_cannot_be_taken() -> None:
    before = tfl.REGISTRY["tanh"]
    with pytest.raises(TapeError, match="built-in"):
        tfl.lift(jnp.tanh, name="tanh")
    with pytest.raises(TapeError, match="built-in"):
        tfl.lift(jnp.tanh, name="tanh", replace=True)
    with pytest.raises(TapeError, match="built-in"):
        tfl.defop("add", lambda x, y: x + y, None)
    with pytest.raises(ValueError, match="built-in"):
        R.unregister("add")
    assert tfl.REGISTRY["tanh"] is before and not before.user
    with pytest.raises(TypeError, match="non-empty string"):
        tfl.defop("", lambda x: x, None)


def test_static_argument_errors() -> None:
    ein = tfl.lift(_einsum, name="test_extend_ein", static_argnames=("subscripts",))
    with tfl.Session() as s:
        a = s.input(np.ones((2, 3)))
        n = len(s.tape)
        with pytest.raises(TypeError, match="not static arguments"):
            ein(a, a.T, subscripts="ij,jk->ik", bogus=1)
        with pytest.raises(TypeError, match="not static arguments"):
            ein(np.ones((2, 3)), np.ones((3, 2)), bogus=1)
        with pytest.raises(TapeError, match="missing required attribute"):
            ein(a, a)
        with pytest.raises(TapeError, match="test_extend_ein"):
            ein(a, a, subscripts=["not", "hashable", {}])
        assert len(s.tape) == n + 1  # only a.T
        _close(ein(a, a.T, subscripts=["ij,jk->ik"][0]).value, np.full((2, 2), 3.0))
    with pytest.raises(TypeError, match="not parameters"):
        tfl.lift(jnp.tanh, name="test_extend_nope", static_argnames="axis")
    with pytest.raises(TypeError, match="reserved"):
        tfl.lift(lambda x, output: x, name="test_extend_reserved", static_argnames="output")

    def kwonly(x, *, mode):
        return x

    with pytest.raises(TypeError, match="static_argnames"):
        tfl.lift(kwonly, name="test_extend_kwonly")
    assert not any(n.startswith("test_extend_") for n in tfl.REGISTRY if n != "test_extend_ein")


# --------------------------------------------------------------------------- defop


def _smooth_abs(x, *, eps=1e-2):
    """``sqrt(x**2 + eps)``, a smooth absolute value."""
    return jnp.sqrt(x * x + eps)


def _smooth_abs_vjp(g, out, x, *, eps=1e-2):
    return (g * x / out,)


def _finite_difference(f: Callable[[np.ndarray], float], x: np.ndarray, h: float = 1e-6) -> np.ndarray:
    out = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i] = h
        out[i] = (f(x + e) - f(x - e)) / (2 * h)
    return out


def test_defop_with_hand_written_vjp_matches_finite_differences_and_jax() -> None:
    d = tfl.defop("test_extend_sabs", _smooth_abs, _smooth_abs_vjp)
    assert isinstance(d, tfl.OpDef) and d.user and d.defaults == {"eps": 1e-2}
    assert d.doc == "``sqrt(x**2 + eps)``, a smooth absolute value."
    x0 = _rng(4).standard_normal((3, 2))
    ws = _rng(5).standard_normal((3, 2))
    for eps in (1e-2, 0.5):
        with tfl.Session() as s:
            x = s.input(x0, requires_grad=True)
            y = tfl.apply("test_extend_sabs", x, eps=eps)
            _close(y.value, np.sqrt(x0**2 + eps))
            got = s.backward(tfl.sum(y * ws))[x]
        fd = _finite_difference(lambda v: float(np.sum(np.sqrt(v**2 + eps) * ws)), x0)
        np.testing.assert_allclose(got, fd, rtol=1e-6, atol=1e-7)
        _close(got, jax.grad(lambda v: jnp.sum(_smooth_abs(v, eps=eps) * ws))(x0))


def test_defop_check_doc_and_derived_vjp() -> None:
    def check(specs, *, eps=1e-2):
        ((shape, dtype),) = specs
        return None if len(shape) == 2 else f"expects a matrix, got rank {len(shape)}"

    tfl.defop("test_extend_checked", _smooth_abs, None, check=check, doc="Smooth |x| of a matrix.")
    assert tfl.REGISTRY["test_extend_checked"].doc == "Smooth |x| of a matrix."
    with tfl.Session() as s:
        v = s.input(np.ones(3), requires_grad=True)
        n = len(s.tape)
        with pytest.raises(TapeError, match="expects a matrix, got rank 1") as e:
            tfl.apply("test_extend_checked", v)
        assert "test_extend_checked" in str(e.value) and "float64[3]" in str(e.value) and len(s.tape) == n
        x0 = _rng(6).standard_normal((2, 2))
        x = s.input(x0, requires_grad=True)
        got = s.backward(tfl.sum(tfl.apply("test_extend_checked", x)))[x]  # vjp=None: jax.vjp of forward
    _close(got, jax.grad(lambda t: jnp.sum(_smooth_abs(t)))(x0))
    t, x = tfl.leaf(tfl.Tape.empty(), np.ones(3))
    t2, r = tfl.record(t, "test_extend_checked", (x,))
    assert t2 is t and "expects a matrix" in r.error


def test_defop_nondiff_argnums() -> None:
    def mix(x, w):
        return x * w

    def mix_vjp(g, out, x, w):
        return g * w, None

    tfl.defop("test_extend_mix", mix, mix_vjp, nondiff_argnums=(1,))
    x0, w0 = _rng(8).standard_normal(4), _rng(9).standard_normal(4)
    with tfl.Session() as s:
        x, w = s.input(x0, requires_grad=True), s.input(w0, requires_grad=True)
        y = tfl.apply("test_extend_mix", x, w)
        g = s.backward(tfl.sum(y))
        _close(g[x], w0)
        _close(g[w], np.zeros(4))  # no gradient flows to a nondiff operand
    with pytest.raises(ValueError, match="out of range"):
        tfl.defop("test_extend_mix_bad", mix, mix_vjp, nondiff_argnums=(2,))
    assert "test_extend_mix_bad" not in tfl.REGISTRY
    with pytest.raises(TypeError, match="nondiff_argnums"):
        tfl.defop("test_extend_mix_bad", mix, mix_vjp, nondiff_argnums=(-1,))


def test_defop_variadic_and_vjp_shape_errors() -> None:
    def total(*xs):
        return sum(xs)

    tfl.defop("test_extend_total", total, lambda g, out, *xs: tuple(g for _ in xs))
    with tfl.Session() as s:
        hs = [s.input(np.full(2, float(i)), requires_grad=True) for i in range(3)]
        y = tfl.apply("test_extend_total", *hs)
        _close(y.value, np.array([3.0, 3.0]))
        g = s.backward(tfl.sum(y * 2.0))
        _close([g[h] for h in hs], [np.full(2, 2.0)] * 3)
    tfl.defop("test_extend_wrong_count", lambda x, y: x * y, lambda g, out, x, y: (g * y,))
    tfl.defop("test_extend_wrong_shape", lambda x: x * 2, lambda g, out, x: (jnp.sum(g),))
    for name, words in (("test_extend_wrong_count", "1 cotangent"), ("test_extend_wrong_shape", "has shape")):
        with tfl.Session() as s:
            x = s.input(np.ones(3), requires_grad=True)
            y = tfl.apply(name, x, x) if "count" in name else tfl.apply(name, x)
            with pytest.raises((TypeError, ValueError), match=words):
                s.backward(tfl.sum(y))


def test_user_vjps_are_differentiable_again() -> None:
    """``jax.vjp`` of a user op's VJP kernel (what a recorded backward differentiates) gives the second derivative."""
    tfl.defop("test_extend_cube", lambda x: x**3, lambda g, out, x: (3.0 * g * x**2,))
    tfl.lift(lambda x: x**3, name="test_extend_cube_lifted")
    x0 = np.array([0.5, -1.5, 2.0])
    spec = ((3,), np.dtype(np.float64))
    for name in ("test_extend_cube", "test_extend_cube_lifted"):
        attrs = (("output", 0),) if "lifted" in name else ()
        vjp = R.get_vjp(name, attrs, (spec,), (True,))
        second = jax.grad(lambda v, vjp=vjp: jnp.sum(vjp(jnp.ones(3), v**3, v)[0]))(x0)
        _close(second, 6.0 * x0)


# --------------------------------------------------------------------------- kernels and re-registration


def _mentioning(name: str) -> int:
    return sum(1 for c in _kernels._CACHES.values() for k in list(c) if _kernels._mentions(k, {name}))


def test_second_call_with_same_shapes_compiles_nothing() -> None:
    traces = []

    def f(x, y):
        traces.append(x.shape)
        return jnp.tanh(x) * y

    lifted = tfl.lift(f, name="test_extend_cached")

    def run(shape):
        with tfl.Session() as s:
            x, y = s.input(np.ones(shape), requires_grad=True), s.input(np.ones(shape), requires_grad=True)
            s.backward(tfl.sum(lifted(x, y)))

    run((3,))
    info, n_traces = tfl.kernel_cache_info(), len(traces)
    assert _mentioning("test_extend_cached") >= 3
    run((3,))
    assert tfl.kernel_cache_info() == info and len(traces) == n_traces
    run((4,))  # a new shape compiles its own kernels
    assert len(traces) > n_traces and tfl.kernel_cache_info()["fwd"] > info["fwd"]


def test_replace_purges_the_old_kernels() -> None:
    tfl.lift(lambda x: x * 2, name="test_extend_purge")
    with tfl.Session() as s:
        x = s.input(np.ones(2), requires_grad=True)
        s.backward(tfl.sum(tfl.apply("test_extend_purge", x)))
    assert _mentioning("test_extend_purge") >= 3
    other = tfl.lift(lambda x: x * 5, name="test_extend_purge", replace=True)
    assert _mentioning("test_extend_purge") == 0
    with tfl.Session() as s:
        x = s.input(np.ones(2), requires_grad=True)
        y = other(x)
        _close([y.value, s.backward(tfl.sum(y))[x]], [np.full(2, 5.0), np.full(2, 5.0)])
    if hasattr(tfl, "jvp"):  # forward mode caches its kernels by op name too
        for k in (2.0, 7.0):
            f = tfl.lift(lambda x, k=k: x * k, name="test_extend_purge", replace=True)
            t, x = tfl.leaf(tfl.Tape.empty(), np.ones(2), requires_grad=True)
            t, y = tfl.record(t, "test_extend_purge", (x,))
            _close(tfl.jvp(t, y.value, {x: np.ones(2)}), np.full(2, k))
            assert f.op is tfl.REGISTRY["test_extend_purge"]
    R.unregister("test_extend_purge")
    assert "test_extend_purge" not in tfl.REGISTRY and _mentioning("test_extend_purge") == 0
    with pytest.raises(KeyError):
        R.unregister("test_extend_purge")


def test_replace_purges_kernels_of_ops_that_name_it() -> None:
    """A kernel keyed by another op whose attribute names the replaced op (a recorded VJP step) goes too."""
    key = ("vjp", (("node_op", str, "test_extend_named_in_attr"), ("k", int, 0)), ((), np.dtype("float32")))
    assert _kernels._mentions(key, {"test_extend_named_in_attr"}) and not _kernels._mentions(key, {"test_extend_other"})
    if "create_graph" not in inspect.signature(tfl.Session.backward).parameters:
        pytest.skip("Session.backward(create_graph=True) is not available")

    def second_derivative(f):
        with tfl.Session() as s:
            x = s.input(np.array([0.5, 2.0]), requires_grad=True)
            gx = s.backward(tfl.sum(f(x)), create_graph=True)[x]
            return s.backward(tfl.sum(gx))[x]

    cube = tfl.lift(lambda x: x**3, name="test_extend_named_in_attr")
    _close(second_derivative(cube), 6.0 * np.array([0.5, 2.0]))
    quartic = tfl.lift(lambda x: x**4, name="test_extend_named_in_attr", replace=True)
    _close(second_derivative(quartic), 12.0 * np.array([0.5, 2.0]) ** 2)


# --------------------------------------------------------------------------- docs/ops.md


def test_ops_page_lists_user_ops_only_when_registered() -> None:
    spec = importlib.util.spec_from_file_location("gen_ops", ROOT / "docs" / "_ext" / "gen_ops.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    committed = (ROOT / "docs" / "ops.md").read_text()
    assert "User-registered ops" not in gen.render(include_user=False)
    assert gen.render(include_user=False) == committed
    tfl.lift(jax.nn.softplus, name="test_extend_listed")
    tfl.defop("test_extend_listed_hand", _smooth_abs, _smooth_abs_vjp, nondiff_argnums=())
    page = gen.render()
    assert "## User-registered ops" in page
    assert "| `test_extend_listed` | `x` | `output=0` | jax.vjp | - | `jax.nn.softplus` |" in page.replace(
        "jax._src.nn.functions", "jax.nn"
    )
    assert "| `test_extend_listed_hand` | `x` | `eps=0.01` | hand |" in page
    assert page.startswith(committed.split("\n## Functions")[0])  # the built-in table is unchanged


def test_a_refused_replacement_puts_the_old_op_back() -> None:
    def double(x):
        return 2 * x

    old = tfl.defop("test_extend_restored", double, None)
    with tfl.Session() as s:  # compiles kernels for the old op
        tfl.apply("test_extend_restored", s.input(jnp.ones(2)))
    with pytest.raises(ValueError, match="out of range"):
        tfl.defop("test_extend_restored", lambda x, w: x * w, None, nondiff_argnums=(2,), replace=True)
    assert tfl.REGISTRY["test_extend_restored"] is old
    with tfl.Session() as s:
        assert tfl.apply("test_extend_restored", s.input(jnp.ones(2))).value.tolist() == [2.0, 2.0]
    # user ops compute in the policy's dtype and carry tangents, like most built-ins
    assert (old.precision, old.tangent) == ("compute", True)
    assert tfl.lift(jnp.sin, name="test_extend_defaults").op.precision == "compute"


def test_register_unregister_and_restore_are_the_only_doors() -> None:
    d = R.unregister(tfl.defop("test_extend_doors", lambda x: x + 1, None).name)
    with pytest.raises(KeyError, match="no op 'test_extend_doors'"):
        R.unregister("test_extend_doors")
    new = tfl.defop("test_extend_doors", lambda x: x - 1, None)
    with tfl.Session() as s:
        tfl.apply("test_extend_doors", s.input(jnp.ones(2)))
    assert R.restore(d) is tfl.REGISTRY["test_extend_doors"] is not new
    with tfl.Session() as s:  # the replaced op's kernels went with it
        assert tfl.apply("test_extend_doors", s.input(jnp.ones(2))).value.tolist() == [2.0, 2.0]
    assert R.restore(d) is d  # already there: nothing changes
    with pytest.raises(ValueError, match="already registered"):
        R.register(d)
    with pytest.raises(ValueError, match="'add' is a built-in op"):
        R.restore(dataclasses.replace(d, name="add"))  # never in place of a built-in
    with pytest.raises(ValueError, match="'tanh' is a built-in op"):
        R.restore(tfl.REGISTRY["tanh"])
    assert not tfl.REGISTRY["add"].user
