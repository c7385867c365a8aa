"""NaN provenance: ``debug_nans`` finds the first op (forward) or VJP (backward) that made a non-finite value.

Each source of a NaN or an infinity below is one loss function; a line marked
``# origin: NAME`` is where the origin op is recorded, so every check can say
exactly which line the error must name. Every source is checked in eager and
lazy sessions (phase, op, node, line, module, and that nothing was updated);
four of them also through ``train_step`` and ``value_and_grad``.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tapeflow as tfl
from tapeflow import nn
from tapeflow._core import _registry as R

HERE = os.path.relpath(__file__)
_LINES = {}
with open(__file__) as fh:
    for _n, _text in enumerate(fh, 1):
        if "# origin: " in _text:
            _LINES[_text.split("# origin: ")[1].strip()] = f"{HERE}:{_n}"


def line(name: str) -> str:
    return _LINES[name]


W = tfl.Param(jnp.array([0.5, 1.0, 2.0]), name="w")


def _nan_vjp_forward(x):
    return x * 2.0


def _nan_vjp(g, out, x):
    return (g * jnp.log(x - x),)  # log(0) = -inf: the backward of a finite forward is not finite


@pytest.fixture(autouse=True, scope="module")
def user_ops():
    """A lifted op whose forward makes a NaN inside, and a defop'd op whose VJP does."""
    tfl.lift(lambda x: jnp.sqrt(x - 10.0), name="dbg_nanop")
    tfl.defop("dbg_badvjp", _nan_vjp_forward, _nan_vjp)
    yield
    R.unregister("dbg_nanop")
    R.unregister("dbg_badvjp")


def sqrt_negative(s, x):
    y = W * x - 1.0
    return tfl.sum(tfl.sqrt(y))  # origin: sqrt_negative


def log_zero(s, x):
    y = W * x - W * x
    return tfl.mean(tfl.log(y))  # origin: log_zero


def exp_overflow(s, x):
    y = W * x * 1000.0
    return tfl.sum(tfl.exp(y))  # origin: exp_overflow


def zero_by_zero(s, x):
    y = W * x - W * x
    return tfl.sum(y / y)  # origin: zero_by_zero


def masked_branch(s, x):
    y = W * x - 0.5
    safe = y > 0.0
    picked = tfl.where(safe, tfl.log(y), 0.0)  # origin: masked_branch
    return tfl.sum(picked)


def label_out_of_range(s, x):
    logits = tfl.reshape(W * x, (1, 3))
    return tfl.cross_entropy(logits, jnp.array([7]))  # origin: label_out_of_range


def lifted_op(s, x):
    y = W * x
    return tfl.sum(tfl.apply("dbg_nanop", y))  # origin: lifted_op


def backward_only(s, x):
    y = W * x - W * x
    return tfl.sum(tfl.sqrt(y) + W)  # origin: backward_only


def defop_vjp(s, x):
    return tfl.sum(tfl.apply("dbg_badvjp", W * x))  # origin: defop_vjp


def nonfinite_input(s, x):
    bad = s.input(x.at[1].set(jnp.inf))  # origin: nonfinite_input
    return tfl.sum(W * bad)


class Attn(nn.Module):
    def __init__(self):
        self.scale = tfl.Param(jnp.array(1.0), name="scale")

    def forward(self, x):
        return tfl.log(x * self.scale - 1.0)  # origin: deep_module


class Block(nn.Module):
    def __init__(self):
        self.attn = Attn()

    def forward(self, x):
        return self.attn(x)


class Net(nn.Module):
    def __init__(self):
        self.blocks = [Block(), Block()]

    def forward(self, x):
        return self.blocks[1](self.blocks[0](x) + 1.0)


NET = Net()


def deep_module(s, x):
    return tfl.sum(NET(W * x))


BAD = tfl.Param(jnp.array([1.0, jnp.nan, 1.0]), name="bad")


def nonfinite_param(s, x):
    return tfl.sum(BAD * x + W)  # origin: nonfinite_param


X = jnp.array([1.0, 1.0, 1.0])

# name -> (loss_fn, phase, op, module)
CASES = {
    "sqrt_negative": (sqrt_negative, "forward", "sqrt", None),
    "log_zero": (log_zero, "forward", "log", None),
    "exp_overflow": (exp_overflow, "forward", "exp", None),
    "zero_by_zero": (zero_by_zero, "forward", "div", None),
    "masked_branch": (masked_branch, "backward", "log", None),
    "label_out_of_range": (label_out_of_range, "forward", "cross_entropy", None),
    "lifted_op": (lifted_op, "forward", "dbg_nanop", None),
    "backward_only": (backward_only, "backward", "sqrt", None),
    "defop_vjp": (defop_vjp, "backward", "dbg_badvjp", None),
    "nonfinite_input": (nonfinite_input, "forward", "input", None),
    "deep_module": (deep_module, "forward", "log", "blocks.0.attn"),
    "nonfinite_param": (nonfinite_param, "forward", "param", None),
}


def _params():
    return [W, NET.blocks[0].attn.scale, NET.blocks[1].attn.scale]


def _snapshot(opt):
    return [np.asarray(p.value).copy() for p in _params()], jax.tree_util.tree_map(np.asarray, opt.state)


def _unchanged(opt, before):
    vals, state = _snapshot(opt)
    for a, b in zip(vals, before[0]):
        np.testing.assert_array_equal(a, b)
    jax.tree_util.tree_map(np.testing.assert_array_equal, state, before[1])


@pytest.fixture
def opt():
    """An optimizer over the Params above, which start every test at their first values."""
    start = [np.asarray(p.value).copy() for p in _params()]
    yield tfl.Optimizer(optax.adam(1e-2), _params())
    for p, v in zip(_params(), start):
        p.value = jnp.asarray(v)


def _session_step(lazy, loss_fn, opt):
    s = tfl.Session(lazy=lazy, debug_nans=True)
    with s:
        loss = loss_fn(s, X)
        opt.step(s.backward(loss))
    return s


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_each_source_is_found_at_its_op_phase_line_and_module(name, lazy, opt):
    loss_fn, phase, op, module = CASES[name]
    before = _snapshot(opt)
    s = tfl.Session(lazy=lazy, debug_nans=True)
    tapes = []
    with pytest.raises(tfl.NonFiniteError) as info:
        with s:
            loss = loss_fn(s, X)
            tapes.append(s.tape)
            opt.step(s.backward(loss))
    err = info.value
    assert (err.phase, err.op, err.where, err.module) == (phase, op, line(name), module), str(err)
    nd = tapes[0].nodes[err.node]
    assert nd.op == (None if op in ("input", "param") else op)
    assert isinstance(err, tfl.TapeError)
    _unchanged(opt, before)
    text = str(err)
    assert line(name) in text
    assert repr(op) in text or op in ("input", "param")
    if phase == "forward" and op not in ("input", "param"):  # finite operands, a non-finite output
        *ins, out = err.operands
        assert all(o.finite for o in ins) and not out.finite and out.role == "output"
        assert tuple(out.shape) == nd.shape


def test_the_error_describes_operands_and_the_masked_branch_fix(opt):
    with pytest.raises(tfl.NonFiniteError) as info:
        _session_step(False, masked_branch, opt)
    err = info.value
    assert err.origin.masked_by is not None
    assert err.origin.masked_where == line("masked_branch")
    assert "untaken branch of where" in str(err) and "tfl.where(m, x, 1.0)" in str(err)
    cot = next(o for o in err.operands if o.role == "incoming cotangent")
    assert cot.finite and cot.min == 0.0
    out = next(o for o in err.operands if o.role == "cotangent of operand 0")
    assert not out.finite and out.nan >= 1


def test_a_named_param_and_an_out_of_range_label_are_explained(opt):
    with pytest.raises(tfl.NonFiniteError) as info:
        _session_step(False, nonfinite_param, opt)
    assert info.value.origin.name == "bad"
    with pytest.raises(tfl.NonFiniteError) as info:
        _session_step(True, label_out_of_range, opt)
    assert "out of range" in info.value.origin.hint and "3 classes" in info.value.origin.hint


COMPILED = ["sqrt_negative", "masked_branch", "label_out_of_range", "backward_only", "deep_module"]


@pytest.mark.parametrize("name", COMPILED)
def test_train_step_finds_the_same_origin_and_updates_nothing(name, opt):
    loss_fn, phase, op, module = CASES[name]
    step = tfl.train_step(loss_fn, opt, debug_nans=True)
    before = _snapshot(opt)
    with pytest.raises(tfl.NonFiniteError) as info:
        step(X)
    err = info.value
    assert (err.phase, err.op, err.where, err.module) == (phase, op, line(name), module), str(err)
    assert step.step_count == 0
    _unchanged(opt, before)


@pytest.mark.parametrize("name", COMPILED)
def test_value_and_grad_finds_the_same_origin(name):
    loss_fn, phase, op, module = CASES[name]
    f = tfl.value_and_grad(loss_fn, debug_nans=True)
    params = {f"p{k}": p for k, p in enumerate(_params())}
    with pytest.raises(tfl.NonFiniteError) as info:
        f(params, X)
    err = info.value
    assert (err.phase, err.op, err.where, err.module) == (phase, op, line(name), module), str(err)
    # under jax.jit the check runs in the program and JAX carries the error's text
    with pytest.raises(Exception, match=f"op '{op}'") as jinfo:
        jax.block_until_ready(jax.jit(f)(params, X))
    assert line(name) in str(jinfo.value)


def masked_attention(s, x):
    scores = tfl.reshape(W * x, (1, 3))
    mask = jnp.array([[0.0, -jnp.inf, 0.0]])
    p = tfl.softmax(scores + mask, axis=-1)  # the -inf is intended: softmax turns it into 0
    return tfl.sum(tfl.log(p - 0.5))  # origin: masked_attention


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_an_intended_minus_inf_mask_is_never_blamed(lazy, opt):
    with pytest.raises(tfl.NonFiniteError) as info:
        _session_step(lazy, masked_attention, opt)
    assert (info.value.op, info.value.where) == ("log", line("masked_attention"))

    # and with nothing else wrong, the mask alone raises nothing
    def fine(s, x):
        scores = tfl.reshape(W * x, (1, 3))
        return tfl.sum(tfl.softmax(scores + jnp.array([[0.0, -jnp.inf, 0.0]]), axis=-1) * 2.0)

    _session_step(lazy, fine, opt)


def two_origins(s, x):
    a = tfl.sqrt(W * x - 1.0)  # origin: two_origins
    b = tfl.log(W * x - W * x)
    return tfl.sum(a) + tfl.sum(b)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_the_first_origin_wins(lazy, opt):
    with pytest.raises(tfl.NonFiniteError) as info:
        _session_step(lazy, two_origins, opt)
    assert (info.value.op, info.value.where) == ("sqrt", line("two_origins"))


def test_nonfinite_origin_on_the_pure_core():
    t, x = tfl.leaf(tfl.Tape.empty(), jnp.array([1.0, 0.0]), requires_grad=True)
    t, y = tfl.record(t, "log", (x,))
    t, z = tfl.record(t, "sum", (y.value,))
    o = tfl.nonfinite_origin(t, z.value)
    assert (o.phase, o.op, o.node, o.where) == ("forward", "log", 1, None)
    t2, x2 = tfl.leaf(tfl.Tape.empty(), jnp.array([1.0, 2.0]), requires_grad=True)
    t2, y2 = tfl.record(t2, "sum", (x2,))
    assert tfl.nonfinite_origin(t2, y2.value) is None


def test_check_finite_names_the_origin_in_an_eager_session(opt):
    opt.check_finite = True
    before = _snapshot(opt)
    tapes = []
    with pytest.raises(tfl.NonFiniteError, match="non-finite gradient for") as info:
        with tfl.Session(lazy=False) as s:  # no debug_nans: the origin without its line
            loss = backward_only(s, X)
            tapes.append(s.tape)
            opt.step(s.backward(loss))
    assert (info.value.phase, info.value.op, info.value.where) == ("backward", "sqrt", None)
    assert tapes[0].nodes[info.value.node].op == "sqrt"
    _unchanged(opt, before)


def test_the_environment_variable_turns_it_on(monkeypatch, opt):
    monkeypatch.setenv("TAPEFLOW_DEBUG_NANS", "1")
    assert tfl.Session().debug_nans and tfl.train_step(sqrt_negative, opt).debug_nans
    monkeypatch.setenv("TAPEFLOW_DEBUG_NANS", "0")
    assert not tfl.Session().debug_nans


def _mlp(seed):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return nn.Linear(4, 8, key=k1), nn.Linear(8, 2, key=k2)


@pytest.mark.parametrize("path", ["eager", "lazy", "train_step"])
def test_with_no_nan_debug_nans_is_bit_identical(path):
    xs = jax.random.normal(jax.random.PRNGKey(1), (20, 6, 4), jnp.float32)
    results = []
    for debug in (False, True):
        l1, l2 = _mlp(0)
        params = [*l1.parameters(), *l2.parameters()]
        opt = tfl.Optimizer(optax.adam(1e-2), params)

        def loss_fn(s, x):
            return tfl.mean((l2(tfl.relu(l1(x))) - 1.0) ** 2.0)

        losses = []
        if path == "train_step":
            step = tfl.train_step(loss_fn, opt, debug_nans=debug)
            losses = [np.asarray(step(x)) for x in xs]
        else:
            for x in xs:
                with tfl.Session(lazy=path == "lazy", debug_nans=debug) as s:
                    loss = loss_fn(s, x)
                    opt.step(s.backward(loss))
                    losses.append(np.asarray(loss.value))
        results.append((losses, [np.asarray(p.value) for p in params]))
    (l0, p0), (l1_, p1) = results
    for a, b in zip(l0 + p0, l1_ + p1):
        np.testing.assert_array_equal(a, b)
