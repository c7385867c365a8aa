"""PyTorch's type promotion on the surface's arithmetic (operators and ``tfl.<fn>``) against torch itself.

torch.result_type's rules: kinds bool < integer < floating; tensors with
dimensions decide, 0-d tensors and Python numbers (weak) count only where
their kind is higher. The suite runs with ``jax_enable_x64``, so torch's
int64 / float64 are JAX's dtypes of the same names here. The registry's ops
themselves keep refusing mixed dtypes (``tfl.apply``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import tapeflow as tfl
from tapeflow import TapeError

torch = pytest.importorskip("torch")

DATA: dict[str, tuple[Any, str]] = {  # name -> (values, dtype name)
    "i": ([1, 2, 3], "int64"),
    "i32": ([4, -5, 6], "int32"),
    "f": ([0.5, -1.25, 2.0], "float32"),
    "d": ([0.5, 1.5, -2.5], "float64"),
    "h": ([1.5, -0.5, 3.0], "float16"),
    "b": ([True, False, True], "bool"),
    "z": (2.5, "float32"),  # 0-d
    "zi": (3, "int64"),  # 0-d
}

OPERATORS: dict[str, Callable[[Any, Any], Any]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.truediv,
    "**": operator.pow,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}
FUNCTIONS = ("add", "sub", "mul", "div", "true_divide", "pow", "maximum", "minimum", "eq", "ne", "lt", "ge")

# (left, right): tensors by DATA name, or Python numbers
PAIRS = [
    ("i", "f"),  # int + float
    ("f", "i"),
    ("b", "i"),  # bool + int
    ("i", "b"),
    ("b", "f"),
    ("i", 1.5),  # int tensor * 1.5
    (1.5, "i"),
    ("b", 2),
    ("i", True),
    ("h", "f"),  # float16 + float32
    ("f", "h"),
    ("h", "z"),  # a 0-d float32 tensor does not widen float16
    ("i", "z"),  # ... but it does make an int tensor float
    ("z", "i32"),
    ("i32", "zi"),  # 0-d int64 vs an int32 tensor: int32
    ("h", 2.5),
    ("i32", 7),
    ("d", "f"),
    ("i32", "i"),
    ("f", "f"),
]


def _torch(v: Any) -> Any:
    if isinstance(v, str):
        data, dt = DATA[v]
        return torch.tensor(data, dtype=getattr(torch, dt))
    return v


def _ours(s: tfl.Session, v: Any) -> Any:
    if isinstance(v, str):
        data, dt = DATA[v]
        return s.input(jnp.asarray(data, dt), requires_grad=dt.startswith("float"))
    return v


def _same(got: Any, want: Any) -> None:
    assert str(got.dtype) == str(want.dtype).removeprefix("torch."), (got.dtype, want.dtype)
    w = want.numpy()
    np.testing.assert_allclose(np.asarray(got.value, w.dtype), w, rtol=1e-3 if w.dtype == np.float16 else 1e-6)


def _pair_id(p: tuple[Any, Any]) -> str:
    return f"{p[0]!r}-{p[1]!r}".replace("'", "")


def _raises_in_torch(fn: Callable[[Any, Any], Any], a: Any, b: Any) -> bool:
    try:
        fn(_torch(a), _torch(b))
    except (RuntimeError, TypeError):  # e.g. torch.maximum takes no number
        return True
    return False


@pytest.mark.parametrize("pair", PAIRS, ids=[_pair_id(p) for p in PAIRS])
@pytest.mark.parametrize("sym", list(OPERATORS))
def test_operators_promote_as_torch(sym: str, pair: tuple[Any, Any]) -> None:
    fn = OPERATORS[sym]
    a, b = pair
    if sym in ("-",) and "b" in pair:
        pytest.skip("torch refuses subtraction with a bool tensor")
    if _raises_in_torch(fn, a, b):
        pytest.skip("torch refuses this pair")
    want = fn(_torch(a), _torch(b))
    with tfl.Session() as s:
        _same(fn(_ours(s, a), _ours(s, b)), want)


@pytest.mark.parametrize("pair", PAIRS[:12], ids=[_pair_id(p) for p in PAIRS[:12]])
@pytest.mark.parametrize("name", FUNCTIONS)
def test_functions_and_methods_promote_as_torch(name: str, pair: tuple[Any, Any]) -> None:
    a, b = pair
    if not isinstance(a, str) or _raises_in_torch(getattr(torch, name), a, b):
        pytest.skip("torch refuses this pair (or takes no number first)")
    want = getattr(torch, name)(_torch(a), _torch(b))
    with tfl.Session() as s:
        x, y = _ours(s, a), _ours(s, b)
        _same(getattr(tfl, name)(x, y), want)
        _same(getattr(x, name)(y), want)  # the Tensor method is the same entry


@pytest.mark.parametrize(("a", "b"), [("f", "i"), ("i", "f"), ("h", "f"), ("f", 1.5), ("h", "z")])
def test_where_promotes_its_two_values(a: Any, b: Any) -> None:
    cond = [True, False, True]
    want = torch.where(torch.tensor(cond), _torch(a), _torch(b))
    with tfl.Session() as s:
        _same(tfl.where(s.input(jnp.asarray(cond)), _ours(s, a), _ours(s, b)), want)


def test_gradients_flow_through_the_casts() -> None:
    """A float16 operand promoted to float32 gets its gradient back as float16, equal to torch's."""
    h0, f0, i0 = np.array([1.5, -0.5, 3.0], np.float16), np.array([0.5, 2.0, -1.0], np.float32), np.array([1, 2, 3])
    th = torch.tensor(h0, requires_grad=True)
    tf = torch.tensor(f0, requires_grad=True)
    ((th * tf + torch.tensor(i0) / tf) ** 2 * 1.5).sum().backward()
    with tfl.Session() as s:
        h, f = s.input(jnp.asarray(h0), requires_grad=True), s.input(jnp.asarray(f0), requires_grad=True)
        y = (h * f + s.input(jnp.asarray(i0)) / f) ** 2 * 1.5
        g = s.backward(tfl.sum(y))
        assert y.dtype == np.float32 and g[h].dtype == np.float16 and g[f].dtype == np.float32
        np.testing.assert_allclose(np.asarray(g[h], np.float32), th.grad.numpy().astype(np.float32), rtol=1e-3)
        np.testing.assert_allclose(g[f], tf.grad.numpy(), rtol=1e-6)


def test_registry_ops_still_refuse_mixed_dtypes() -> None:
    with tfl.Session() as s:
        i, f = s.input(jnp.arange(3)), s.input(jnp.ones(3, jnp.float32))
        n = len(s.tape)
        with pytest.raises(TapeError, match=r"add: operand dtypes differ .* does not promote"):
            tfl.apply("add", i, f)
        assert len(s.tape) == n  # nothing recorded
        y = i + f
        assert y.op == "add" and [s.tape[p].op for p in y.node.parents] == ["astype", None]


def test_same_dtypes_record_no_cast() -> None:
    with tfl.Session() as s:
        x, y = s.input(jnp.ones(3, jnp.float32)), s.input(jnp.ones(3, jnp.float32))
        n = len(s.tape)
        for z in (x + y, x * 2.0, 2 * x, tfl.add(x, y), x < y, x / y, x**2, tfl.where(x > 0, x, 0.0)):
            assert "astype" not in {s.tape[p].op for p in z.node.parents}
        i = s.input(jnp.arange(3))
        assert (i + 1).dtype == i.dtype and (i * 2).node.parents[0] == i.id
        assert len(s.tape) > n
