"""Whether an attribute is accepted never depends on which kernels are cached.

Python hashes ``True``, ``1``, ``1.0`` and ``np.int64(1)`` alike, so a cache
keyed by plain values would let ``sum(axis=True)`` find the entry that
``sum(axis=1)`` left behind. The kernel caches are keyed by
:func:`tapeflow._core._registry.attr_key` (value and type); NumPy scalars are
normalized to the equal Python scalar first. These tests compare each rejection
in a fresh cache with the same rejection after the accepted look-alike was
cached, on the pure core (``tfl.record``) and through a ``Session``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import _assert_unchanged, _state

import tapeflow as tfl
from tapeflow._core import _registry as R
from tapeflow._shell import _functions as op_functions  # the registry's functions (tfl.<name> may be PyTorch's)

# (op, operand shapes, accepted attrs, rejected look-alike attrs, text in the error)
LOOKALIKES = [
    ("sum", [(3, 4)], {"axis": 1}, {"axis": True}, "axis=True"),
    ("sum", [(3, 4)], {"axis": 1}, {"axis": 1.0}, "axis=1.0"),
    ("sum", [(3, 4)], {"axis": 0}, {"axis": False}, "axis=False"),
    ("sum", [(3, 4)], {"axis": (1, 0)}, {"axis": (True, 0)}, "axis=(True, 0)"),
    ("sum", [(3, 4)], {"keepdims": True}, {"keepdims": 1}, "keepdims=1"),
    ("sum", [(3, 4)], {"keepdims": False}, {"keepdims": 0}, "keepdims=0"),
    ("sum", [(3, 4)], {"keepdims": True}, {"keepdims": 1.0}, "keepdims=1.0"),
    ("mean", [(3, 4)], {"axis": 1, "keepdims": True}, {"axis": 1, "keepdims": 1}, "keepdims=1"),
    ("max", [(3, 4)], {"axis": -1, "keepdims": False}, {"axis": -1, "keepdims": 0}, "keepdims=0"),
    ("logsumexp", [(3, 4)], {"keepdims": True}, {"keepdims": 1}, "keepdims=1"),
    ("softmax", [(3, 4)], {"axis": 1}, {"axis": True}, "axis=True"),
    ("attention", [(2, 4), (3, 4), (3, 5)], {"causal": True}, {"causal": 1}, "causal=1"),
]
IDS = [f"{c[0]}-{c[3]}" for c in LOOKALIKES]


def _tape(shapes):
    t = tfl.Tape.empty()
    ids = []
    for k, shape in enumerate(shapes):
        t, i = tfl.leaf(t, jnp.arange(float(np.prod(shape)), dtype=jnp.float32).reshape(shape) + k)
        ids.append(i)
    return t, tuple(ids)


def _rejected(t, op, ids, attrs):
    """Record a call that must fail; check it left the tape and the kernel caches alone."""
    before = tfl.kernel_cache_info()
    n = len(t)
    t2, r = tfl.record(t, op, ids, **attrs)
    assert t2 is t and len(t) == n
    assert isinstance(r, tfl.Err), f"{op}{attrs} was accepted"
    assert tfl.kernel_cache_info() == before
    return r.error


@pytest.mark.parametrize("op,shapes,good,bad,needle", LOOKALIKES, ids=IDS)
def test_lookalike_rejected_the_same_before_and_after_the_accepted_value_is_cached(op, shapes, good, bad, needle):
    tfl.clear_kernel_caches()
    t, ids = _tape(shapes)
    first = _rejected(t, op, ids, bad)
    assert first.startswith(f"{op}: ") and needle in first

    tfl.clear_kernel_caches()
    t, ids = _tape(shapes)
    t_ok, r = tfl.record(t, op, ids, **good)
    assert r.is_ok, r.error
    assert tfl.kernel_cache_info()["fwd"] == 1
    assert _rejected(t, op, ids, bad) == first
    assert _rejected(t_ok, op, ids, bad) == first  # the tape holding the cached op's node, too
    # and the accepted value still hits its entry
    _, r = tfl.record(t, op, ids, **good)
    assert r.is_ok and tfl.kernel_cache_info()["fwd"] == 1


@pytest.mark.parametrize("op,shapes,good,bad,needle", LOOKALIKES, ids=IDS)
def test_lookalike_through_a_session(op, shapes, good, bad, needle):
    tfl.clear_kernel_caches()
    t, ids = _tape(shapes)
    core_msg = _rejected(t, op, ids, bad)

    s = tfl.Session()
    xs = [s.input(t.value(i)) for i in ids]
    fn = getattr(op_functions, op)
    fn(*xs, **good)  # caches the accepted look-alike
    before = _state(s)
    with pytest.raises(tfl.TapeError) as e:
        fn(*xs, **bad)
    assert str(e.value) == core_msg
    _assert_unchanged(s, before)
    with pytest.raises(tfl.TapeError) as e:
        s.apply(op, *xs, **bad)
    assert str(e.value) == core_msg
    _assert_unchanged(s, before)


def test_sum_axis_true_via_the_op_function_and_tfl_sum():
    s = tfl.Session()
    x = s.input(jnp.ones((3, 4), jnp.float32))
    assert op_functions.sum(x, axis=1).shape == (3,)
    with pytest.raises(tfl.TapeError, match=r"sum: attribute axis=True must be an int"):
        op_functions.sum(x, axis=True)
    with pytest.raises(tfl.TapeError, match=r"sum: attribute keepdims=1 must be True or False"):
        op_functions.sum(x, axis=1, keepdims=1)
    # PyTorch's tfl.sum refuses the same look-alikes, as torch.sum does
    assert tfl.sum(x, 1).shape == (3,)
    with pytest.raises(TypeError, match=r"sum: dim must be an int, got True"):
        tfl.sum(x, True)
    with pytest.raises(TypeError, match=r"sum: keepdim must be a bool, got 1"):
        tfl.sum(x, 1, keepdim=1)


# --------------------------------------------------------------------------- NumPy scalars are normalized


@pytest.mark.parametrize(
    "op,good,numpy_attrs",
    [
        ("sum", {"axis": 1}, {"axis": np.int64(1)}),
        ("sum", {"axis": (0, 1)}, {"axis": (np.int32(0), np.int64(1))}),
        ("sum", {"axis": 1, "keepdims": True}, {"axis": np.int8(1), "keepdims": np.bool_(True)}),
        ("logsumexp", {"keepdims": False}, {"keepdims": np.bool_(False)}),
        ("clamp", {"lo": 0.5}, {"lo": np.float64(0.5)}),
    ],
)
def test_numpy_scalars_share_the_python_scalars_kernel(op, good, numpy_attrs):
    tfl.clear_kernel_caches()
    t, (a,) = _tape([(3, 4)])
    t1, r1 = tfl.record(t, op, (a,), **good)
    assert r1.is_ok, r1.error
    t2, r2 = tfl.record(t, op, (a,), **numpy_attrs)
    assert r2.is_ok, r2.error
    assert tfl.kernel_cache_info()["fwd"] == 1
    assert t2[r2.value].attrs == t1[r1.value].attrs
    for (_, v1), (_, v2) in zip(t1[r1.value].attrs, t2[r2.value].attrs):
        assert type(v1) is type(v2)
    np.testing.assert_array_equal(t2.value(r2.value), t1.value(r1.value))


def test_numpy_scalar_lookalike_of_a_bool_is_still_rejected():
    tfl.clear_kernel_caches()
    t, (a,) = _tape([(3, 4)])
    assert tfl.record(t, "sum", (a,), keepdims=True)[1].is_ok
    assert "keepdims=1" in _rejected(t, "sum", (a,), {"keepdims": np.int64(1)})
    assert tfl.record(t, "sum", (a,), axis=1)[1].is_ok
    assert "axis=True" in _rejected(t, "sum", (a,), {"axis": np.bool_(True)})


def test_attr_key_is_typed():
    keys = [R.attr_key({"a": v}.items()) for v in (True, 1, 1.0, np.int64(1), np.float64(1.0))]
    assert len(set(keys)) == len(keys)
    nested = [R.attr_key({"a": v}.items()) for v in ((1, 2), (True, 2), ((1, 2),), ((1.0, 2),), ((1,), 2), (1, (2,)))]
    assert len(set(nested)) == len(nested)
    assert R.attr_key({"b": 1, "a": (0,)}.items()) == R.attr_key(R.normalize_attrs({"a": [0], "b": np.int64(1)}))
    assert R.normalize_attrs({"k": np.bool_(True), "x": (np.float32(0.5), [np.int16(2)])}) == (
        ("k", True),
        ("x", (0.5, (2,))),
    )


# --------------------------------------------------------------------------- non-finite attributes


BAD_FLOATS = [
    ("clamp", [(3, 4)], {"lo": float("nan")}, "lo"),
    ("clamp", [(3, 4)], {"hi": float("nan")}, "hi"),
    ("clamp", [(3, 4)], {"lo": np.float32("nan"), "hi": 1.0}, "lo"),
    ("layer_norm", [(3, 4)], {"eps": float("nan")}, "eps"),
    ("layer_norm", [(3, 4)], {"eps": float("inf")}, "eps"),
    ("layer_norm", [(3, 4)], {"eps": -1e-5}, "eps"),
    ("layer_norm", [(3, 4)], {"eps": np.float64("nan")}, "eps"),
    ("layer_norm", [(3, 4)], {"eps": True}, "eps"),
    ("attention", [(2, 4), (3, 4), (3, 5)], {"scale": float("nan")}, "scale"),
    ("attention", [(2, 4), (3, 4), (3, 5)], {"scale": float("inf")}, "scale"),
    ("attention", [(2, 4), (3, 4), (3, 5)], {"scale": -float("inf")}, "scale"),
]


@pytest.mark.parametrize("op,shapes,attrs,name", BAD_FLOATS, ids=[f"{c[0]}-{c[2]}" for c in BAD_FLOATS])
def test_meaningless_float_attributes_are_rejected(op, shapes, attrs, name):
    tfl.clear_kernel_caches()
    t, ids = _tape(shapes)
    msg = _rejected(t, op, ids, attrs)
    assert msg.startswith(f"{op}: attribute {name}")
    s = tfl.Session()
    xs = [s.input(t.value(i)) for i in ids]
    before = _state(s)
    with pytest.raises(tfl.TapeError) as e:
        getattr(op_functions, op)(*xs, **attrs)
    assert str(e.value) == msg
    _assert_unchanged(s, before)


def test_clamp_allows_infinite_bounds():
    t, (a,) = _tape([(3, 4)])
    x = np.asarray(t.value(a))
    for lo, hi in [(-float("inf"), 5.0), (2.0, float("inf")), (-float("inf"), float("inf"))]:
        t2, r = tfl.record(t, "clamp", (a,), lo=lo, hi=hi)
        assert r.is_ok, r.error
        np.testing.assert_array_equal(t2.value(r.value), np.clip(x, lo, hi))


def test_layer_norm_zero_eps_and_finite_scale_are_accepted():
    t, ids = _tape([(3, 4)])
    assert tfl.record(t, "layer_norm", ids, eps=0.0)[1].is_ok
    assert tfl.record(t, "layer_norm", ids, eps=0)[1].is_ok
    t, ids = _tape([(2, 4), (3, 4), (3, 5)])
    assert tfl.record(t, "attention", ids, scale=0.5)[1].is_ok
    assert tfl.record(t, "attention", ids, scale=np.float32(0.5))[1].is_ok
