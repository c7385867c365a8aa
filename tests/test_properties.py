"""Property test: ``tfl.backward`` on a random recorded program equals ``jax.grad``.

A program is a list of instructions over nodes: the input leaves, one constant
leaf (1.5, no gradient), then one node per instruction. The same instruction
list is run twice: recorded on a tape (``tfl.record``) and interpreted as a
plain JAX function built only from ``jax.numpy`` / ``jax.nn`` (the oracle).

Shapes: every operand shape is drawn from the *broadcast family* of one base
shape (dims right-aligned, each either the base dim or 1, leading dims possibly
dropped), so any two nodes broadcast together and every result, including
``keepdims`` reductions and ``axis=0`` reductions, stays in the family.

Domains are safe by construction: every node carries an upper bound on
``|value|``; ``log``/``sqrt`` only see ``softplus`` outputs, ``div`` divides by
``softplus(y) + 1.5``, ``pow`` raises ``sigmoid(x) + 1.5`` to ``tanh(y)``, and
an operand whose bound would make a result too large is first squashed by
``tanh`` (recorded as an op, on both sides).

The output is the sum of the last node plus the sums of every node no other
instruction uses, so no VJP is dead code; a quarter of the binary ops get the
same node twice (ties in ``maximum``/``minimum``, ``x * x``, ``x - x``).
"""

from __future__ import annotations

import math
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import tapeflow as tfl

LIMIT = 1e3
CONST = 1.5
LO, HI = -0.7317, 0.8123  # clamp bounds unlikely to be hit exactly

# --------------------------------------------------------------------------- the oracle (plain JAX)


def _clamp(x: Any, lo: float, hi: float) -> Any:
    # tapeflow's documented clamp gradient: passes where lo <= x <= hi (inclusive)
    inside = (x >= lo) & (x <= hi)
    return jnp.where(inside, x, jax.lax.stop_gradient(jnp.clip(x, lo, hi)))


PLAIN = {
    "exp": jnp.exp,
    "log": jnp.log,
    "sqrt": jnp.sqrt,
    "sin": jnp.sin,
    "cos": jnp.cos,
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
    "softplus": lambda x: jnp.logaddexp(x, 0.0),
    # tapeflow documents abs'(0) = 0 (jax.grad(jnp.abs)(0.) is 1): x * sign(x) has that gradient
    "abs": lambda x: x * jnp.sign(x),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "relu": jax.nn.relu,
    "neg": jnp.negative,
    "clamp": lambda x, lo, hi: _clamp(x, lo, hi),
    "stop_gradient": jax.lax.stop_gradient,
    "add": jnp.add,
    "sub": jnp.subtract,
    "mul": jnp.multiply,
    "div": jnp.divide,
    "pow": jnp.power,
    "maximum": jnp.maximum,
    "minimum": jnp.minimum,
    "gt": jnp.greater,
    "where": jnp.where,
    "sum": lambda x, axis, keepdims: jnp.sum(x, axis=axis, keepdims=keepdims),
    "mean": lambda x, axis, keepdims: jnp.mean(x, axis=axis, keepdims=keepdims),
    "max": lambda x, axis, keepdims: jnp.max(x, axis=axis, keepdims=keepdims),
    "softmax": lambda x, axis: jax.nn.softmax(x, axis=axis),
    "log_softmax": lambda x, axis: jax.nn.log_softmax(x, axis=axis),
    "logsumexp": lambda x, axis, keepdims: jax.scipy.special.logsumexp(x, axis=axis, keepdims=keepdims),
}

UNARY_BOUNDED = ["sin", "cos", "tanh", "sigmoid"]
UNARY_SAME = ["neg", "abs", "relu", "gelu", "stop_gradient"]
BINARY = ["add", "sub", "mul", "maximum", "minimum", "div", "pow", "where"]
SPECIAL_UNARY = ["exp", "log", "sqrt", "softplus", "clamp"]
REDUCTIONS = ["sum", "mean", "max"]
# shape-preserving ops of other modules, used only when they are registered
OPTIONAL = [name for name in ("softmax", "log_softmax", "logsumexp") if name in tfl.REGISTRY]
KINDS = UNARY_BOUNDED + UNARY_SAME + BINARY + SPECIAL_UNARY + REDUCTIONS + OPTIONAL


def _family(base: tuple[int, ...]) -> list[tuple[int, ...]]:
    out = set()
    for drop in range(len(base) + 1):
        tail = base[drop:]
        for mask in range(2 ** len(tail)):
            out.add(tuple(1 if mask >> k & 1 else d for k, d in enumerate(tail)))
    return sorted(out)


def _bshape(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(np.broadcast_shapes(*shapes))


def _reduced(shape: tuple[int, ...], axis: Any, keepdims: bool) -> tuple[int, ...]:
    if axis is None:
        return tuple(1 for _ in shape) if keepdims else ()
    if keepdims:
        return tuple(1 if i == axis % len(shape) else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i != axis % len(shape))


# --------------------------------------------------------------------------- program generation


class _Builder:
    """Emits instructions while tracking each node's shape and |value| bound."""

    def __init__(self, shapes: list[tuple[int, ...]], bound: float) -> None:
        self.shape = list(shapes) + [()]
        self.bound: list[float | None] = [bound] * len(shapes) + [CONST]
        self.const = len(shapes)
        self.instrs: list[tuple[str, tuple[int, ...], dict[str, Any]]] = []

    def emit(self, name: str, args: tuple[int, ...], bound: float | None, shape: tuple[int, ...], **attrs: Any) -> int:
        self.instrs.append((name, args, attrs))
        self.shape.append(shape)
        self.bound.append(None if bound is None else float(bound))
        return len(self.shape) - 1

    def finish(self) -> None:
        """Make every node count: add ``sum(node)`` of each unused float node into the output.

        Without this, most random nodes would be dead code and their VJPs never checked.
        """
        first = self.const + 1
        if len(self.shape) == first:
            return
        used = {i for _, args, _ in self.instrs for i in args}
        last = len(self.shape) - 1
        acc = self.emit("sum", (last,), 0.0, (), axis=None, keepdims=False)
        for i in range(first, last):
            if i not in used and self.bound[i] is not None:
                s = self.emit("sum", (i,), 0.0, (), axis=None, keepdims=False)
                acc = self.emit("add", (acc, s), 0.0, ())

    def squash(self, i: int, limit: float) -> int:
        """``tanh(node)`` if the node's bound exceeds ``limit``, else the node itself."""
        if self.bound[i] <= limit:
            return i
        return self.emit("tanh", (i,), 1.0, self.shape[i])

    def unary(self, name: str, i: int) -> int:
        return self.emit(name, (i,), _UNARY_BOUND[name](self.bound[i]), self.shape[i])

    def step(self, kind: str, a: int, b: int, c: int, d: int, axis_choice: int, keep: bool) -> None:
        sh = self.shape
        if kind in UNARY_BOUNDED or kind in UNARY_SAME:
            self.unary(kind, a)
        elif kind == "exp":
            self.unary("exp", self.squash(a, 3.0))
        elif kind == "softplus":
            self.unary("softplus", self.squash(a, LIMIT / 2))
        elif kind in ("log", "sqrt"):
            sp = self.unary("softplus", self.squash(a, 30.0))
            bound = 31.0 if kind == "log" else math.sqrt(32.0)
            self.emit(kind, (sp,), bound, sh[sp])
        elif kind == "clamp":
            self.emit("clamp", (a,), max(-LO, HI), sh[a], lo=LO, hi=HI)
        elif kind in ("add", "sub", "maximum", "minimum"):
            a, b = self.squash(a, LIMIT / 2), self.squash(b, LIMIT / 2)
            bound = self.bound[a] + self.bound[b] if kind in ("add", "sub") else max(self.bound[a], self.bound[b])
            self.emit(kind, (a, b), bound, _bshape(sh[a], sh[b]))
        elif kind == "mul":
            if self.bound[a] * self.bound[b] > LIMIT:
                a = self.squash(a, 1.0)
            if self.bound[a] * self.bound[b] > LIMIT:
                b = self.squash(b, 1.0)
            self.emit("mul", (a, b), self.bound[a] * self.bound[b], _bshape(sh[a], sh[b]))
        elif kind == "div":
            sp = self.unary("softplus", self.squash(b, LIMIT / 2))
            den = self.emit("add", (sp, self.const), self.bound[sp] + CONST, sh[sp])
            self.emit("div", (a, den), self.bound[a] / CONST, _bshape(sh[a], sh[den]))
        elif kind == "pow":
            s = self.unary("sigmoid", a)
            base = self.emit("add", (s, self.const), 1 + CONST, sh[s])
            ex = self.unary("tanh", b)
            self.emit("pow", (base, ex), 1 + CONST, _bshape(sh[base], sh[ex]))
        elif kind == "where":
            cond = self.emit("gt", (c, d), None, _bshape(sh[c], sh[d]))  # bound None: boolean
            self.emit(
                "where",
                (cond, a, b),
                max(self.bound[a], self.bound[b]),
                _bshape(sh[cond], sh[a], sh[b]),
            )
        elif kind in REDUCTIONS:
            shape = sh[a]
            # axis=None (any keepdims), a kept axis, or axis 0 dropped: all stay in the family
            if axis_choice == 0 or not shape:
                axis, keepdims = None, keep
            elif keep:
                axis, keepdims = axis_choice % len(shape), True
            else:
                axis, keepdims = 0, False
            out = _reduced(shape, axis, keepdims)
            n_red = math.prod(shape) // max(math.prod(out), 1)
            if kind == "sum" and self.bound[a] * n_red > LIMIT:
                a = self.squash(a, 1.0)
            bound = self.bound[a] * (n_red if kind == "sum" else 1)
            self.emit(kind, (a,), bound, out, axis=axis, keepdims=keepdims)
        elif kind in ("softmax", "log_softmax"):
            if not sh[a]:
                self.unary("sin", a)
                return
            a = self.squash(a, LIMIT / 4)
            n = sh[a][-1]
            bound = 1.0 if kind == "softmax" else 2 * self.bound[a] + math.log(n) + 1
            self.emit(kind, (a,), bound, sh[a], axis=-1)
        elif kind == "logsumexp":
            if not sh[a]:
                self.unary("cos", a)
                return
            a = self.squash(a, LIMIT / 4)
            out = sh[a][:-1] + (1,)
            self.emit("logsumexp", (a,), self.bound[a] + math.log(sh[a][-1]) + 1, out, axis=-1, keepdims=True)
        else:  # pragma: no cover
            raise AssertionError(kind)


_UNARY_BOUND = {
    "sin": lambda b: 1.0,
    "cos": lambda b: 1.0,
    "tanh": lambda b: 1.0,
    "sigmoid": lambda b: 1.0,
    "neg": lambda b: b,
    "abs": lambda b: b,
    "relu": lambda b: b,
    "gelu": lambda b: b,
    "stop_gradient": lambda b: b,
    "exp": lambda b: math.exp(b),
    "softplus": lambda b: b + 1.0,
}


@st.composite
def programs(draw: Any) -> tuple[list[np.ndarray], list[tuple[str, tuple[int, ...], dict[str, Any]]]]:
    # hypothesis leans to the first choices: put the richest shapes first
    base = draw(st.sampled_from([(2, 3), (2, 1, 3), (3,)]))
    fam = sorted(_family(base), key=lambda s: (-math.prod(s), -len(s)))
    n_in = draw(st.integers(1, 3))
    shapes = [draw(st.sampled_from(fam)) for _ in range(n_in)]
    # a few repeated round values make ties (maximum, max, where, relu at 0) common across leaves
    elems = st.one_of(
        st.sampled_from([0.0, 1.0, -1.0]),
        st.floats(-2.0, 2.0, allow_nan=False, allow_infinity=False, width=64),
    )
    inputs = [draw(hnp.arrays(np.float64, s, elements=elems)) for s in shapes]
    b = _Builder(shapes, 2.0)
    n_ops = draw(st.integers(1, 30))

    def pick() -> int:
        # any float node (the boolean conditions of `where` are not operands)
        ok = [i for i, bnd in enumerate(b.bound) if bnd is not None]
        n = len(ok)
        recent = st.integers(0, min(3, n - 1)).map(lambda k: n - 1 - k)
        return ok[draw(st.one_of(recent, st.integers(0, n - 1)))]

    for _ in range(n_ops):
        kind = draw(st.sampled_from(KINDS))
        a, bb, c, d = pick(), pick(), pick(), pick()
        if draw(st.integers(0, 3)) == 0:  # same operand twice: ties in maximum/minimum/where, x*x, x-x
            bb = a
        b.step(kind, a, bb, c, d, draw(st.integers(0, 3)), draw(st.booleans()))
    b.finish()
    return inputs, b.instrs


# --------------------------------------------------------------------------- the two interpreters


def run_tape(inputs: list[np.ndarray], instrs: list[Any]) -> tuple[tfl.Tape, int, list[int]]:
    t = tfl.Tape.empty()
    ids = []
    for v in inputs:
        t, i = tfl.leaf(t, jnp.asarray(v), requires_grad=True)
        ids.append(i)
    t, _ = tfl.leaf(t, jnp.asarray(CONST, jnp.float64))
    for name, args, attrs in instrs:
        t, r = tfl.record(t, name, args, **attrs)
        assert r.is_ok, (name, args, attrs, r.error)
    t, r = tfl.record(t, "sum", (len(t) - 1,))
    assert r.is_ok, r.error
    return t, r.value, ids


def run_plain(instrs: list[Any], *xs: Any) -> Any:
    env = list(xs) + [jnp.asarray(CONST, jnp.float64)]
    for name, args, attrs in instrs:
        env.append(PLAIN[name](*(env[i] for i in args), **attrs))
    return jnp.sum(env[-1])


@pytest.mark.usefixtures("small_gc_heap")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(programs())
def test_backward_equals_jax_grad(prog: Any) -> None:
    inputs, instrs = prog
    t, root, ids = run_tape(inputs, instrs)
    xs = [jnp.asarray(v) for v in inputs]
    # the oracle jitted: one program per example, where op by op jax compiles each primitive and its transpose
    want_val, want = jax.jit(jax.value_and_grad(lambda *v: run_plain(instrs, *v), argnums=tuple(range(len(xs)))))(*xs)
    np.testing.assert_allclose(t.value(root), want_val, rtol=1e-9, atol=1e-9)
    got = tfl.backward(t, root, wrt=ids)
    assert set(got) == set(ids)
    for i, w in zip(ids, want):
        g = np.asarray(got[i])
        assert g.shape == w.shape and g.dtype == np.float64
        scale = 1.0 + float(np.max(np.abs(w), initial=0.0))
        chex.assert_trees_all_close(
            g, w, rtol=1e-7, atol=1e-9 * scale, strict=True, custom_message=f"leaf {i}: {instrs}"
        )
    # without wrt: exactly the reached leaves, same values
    plain = tfl.backward(t, root)
    assert set(plain) <= set(ids)
    for i in plain:
        np.testing.assert_array_equal(np.asarray(plain[i]), np.asarray(got[i]))


def _check(inputs: list[np.ndarray], instrs: list[Any], variant: Any) -> None:
    """``tfl.backward`` of the recorded program equals ``jax.grad`` of the plain one.

    ``variant`` (a chex variant: with or without ``jax.jit``) wraps the recording
    and the backward pass together; node ids are fixed by the program, so they
    come from an eager recording.
    """
    _, root, ids = run_tape(inputs, instrs)
    xs = [jnp.asarray(v) for v in inputs]
    want = jax.jit(jax.grad(lambda *v: run_plain(instrs, *v), argnums=tuple(range(len(xs)))))(*xs)
    got = variant(lambda *v: tfl.backward(run_tape(list(v), instrs)[0], root, wrt=ids))(*xs)
    assert set(got) == set(ids)
    chex.assert_trees_all_close(
        tuple(got[i] for i in ids), want, rtol=1e-9, atol=1e-12, strict=True, custom_message=f"leaves {ids}: {instrs}"
    )


_AXES = [(0, False), (0, True), (1, True), (2, True), (1, False)]  # (axis_choice, keep) of _Builder.step
_CONFIGS = [(k, ax, keep) for k in KINDS for ax, keep in (_AXES if k in REDUCTIONS else [(0, False)])]


class TestEveryKind(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*((f"{k}_{a}_{int(kp)}", k, a, kp) for k, a, kp in _CONFIGS))
    def test_every_kind_on_full_shapes(self, kind: str, axis_choice: int, keep: bool) -> None:
        # deterministic companion of the property: every instruction kind runs once on
        # rank-2 / rank-3 operands, with exact ties between the two leaves (row 0 of x0 equals x1),
        # eagerly and under jax.jit
        for base in [(2, 3), (2, 2, 3)]:
            rs = np.random.default_rng(len(base))
            x0 = rs.uniform(-2, 2, size=base)
            x1 = x0[:1].copy()
            b = _Builder([x0.shape, x1.shape], 2.0)
            b.step(kind, 0, 1, 0, 1, axis_choice, keep)
            b.step(kind, len(b.shape) - 1, 0, 1, 0, axis_choice, keep)
            b.finish()
            _check([x0, x1], b.instrs, self.variant)


def test_family_helper() -> None:
    # the generator's shape bookkeeping must agree with what the tape records
    fam = _family((2, 3))
    assert set(fam) == {(), (1,), (3,), (1, 1), (1, 3), (2, 1), (2, 3)}
    for s1 in fam:
        for s2 in fam:
            assert _bshape(s1, s2) in fam
    assert _reduced((2, 3), 0, False) == (3,)
    assert _reduced((2, 3), 1, True) == (2, 1)
    assert _reduced((2, 3), None, False) == ()
