"""The PyTorch surface's short cuts for the common call give what the full checks give: values and errors.

``cross_entropy`` remembers the operand specs whose class-index checks passed and records the op at once for a
later call with those specs and plain arguments; ``relu`` of a floating Tensor records the op without the integer
rule. Every test compares a call made with the short cut primed against the same call with nothing remembered
(the full checks), and values against PyTorch.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import tapeflow as tfl
from tapeflow._shell import _torch_functional

torch = pytest.importorskip("torch")

F32 = np.float32
X = np.array([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0], [2.0, 2.0, 2.0], [-1.0, 0.0, 1.0]], F32)
Y = np.array([0, 1, 2, 1], np.int32)


def _outcome(fn):
    """What ``fn()`` gives: its value as a NumPy array, or the type and text of what it raised."""
    try:
        return np.asarray(fn().value)
    except Exception as e:  # compared by type and text
        return type(e), str(e)


def _same(a, b) -> None:
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype
    else:
        assert a == b


def _primed_and_full(make):
    """``make(s, x, y)`` once after a plain cross_entropy of X, Y primed the short cut, once with nothing remembered."""
    out = []
    for primed in (True, False):
        _torch_functional._PLAIN_CLASS_TARGETS.clear()
        with tfl.Session(lazy=True) as s:
            x, y = s.input(X), s.input(Y)
            if primed:
                tfl.cross_entropy(x, y)
                assert _torch_functional._PLAIN_CLASS_TARGETS  # the short cut is primed for these specs
            out.append(_outcome(lambda: make(s, x, y)))
    _same(*out)
    return out[0]


def _torch_ce(x, y, **kw):
    return torch.nn.functional.cross_entropy(torch.tensor(x), torch.tensor(y, dtype=torch.long), **kw).numpy()


@pytest.mark.parametrize(
    "kw",
    [{}, {"reduction": "sum"}, {"reduction": "none"}, {"label_smoothing": 0.25}, {"ignore_index": 1}],
    ids=repr,
)
def test_cross_entropy_short_cut_gives_the_full_paths_value(kw):
    got = _primed_and_full(lambda s, x, y: tfl.cross_entropy(x, y, **kw))
    np.testing.assert_allclose(got, _torch_ce(X, Y, **kw), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "kw",
    [
        {"reduction": "avg"},
        {"reduction": None},
        {"label_smoothing": 1.5},
        {"label_smoothing": math.nan},
        {"label_smoothing": -0.0},
        {"label_smoothing": 0},
        {"ignore_index": True},
        {"ignore_index": np.int64(2)},
        {"reduce": False},
        {"size_average": False},
    ],
    ids=repr,
)
def test_cross_entropy_arguments_off_the_short_cut_give_the_full_paths_outcome(kw):
    _primed_and_full(lambda s, x, y: tfl.cross_entropy(x, y, **kw))


@pytest.mark.parametrize(
    "other",
    [
        np.array([0, 1, 2], np.int32),  # the wrong batch
        np.array([[0], [1], [2], [1]], np.int32),  # the wrong rank
        np.array([0.0, 1.0, 2.0, 1.0], F32),  # floats of the index shape: not probabilities of the input's shape
        np.array([True, False, True, False]),  # booleans are not class indices
        np.full((4, 3), 1.0 / 3.0, F32),  # probabilities: another path
    ],
    ids=lambda a: f"{a.dtype}{list(a.shape)}",
)
def test_a_new_target_spec_after_a_remembered_one_takes_the_full_checks(other):
    _primed_and_full(lambda s, x, y: tfl.cross_entropy(x, s.input(other)))


def test_a_new_input_spec_after_a_remembered_one_takes_the_full_checks():
    _primed_and_full(lambda s, x, y: tfl.cross_entropy(s.input(X[:, :2]), y))  # still valid: 2 classes
    _primed_and_full(lambda s, x, y: tfl.cross_entropy(s.input(X.astype(np.int32)), y))  # integer scores
    _primed_and_full(lambda s, x, y: tfl.cross_entropy(s.input(X[None]), y))  # (1, 4, 3) against (4,)
    x3 = np.stack([X, -X], axis=2)  # (N, C, d): classes on dim 1, recorded through a permute
    y3 = np.stack([Y, Y[::-1]], axis=1)
    got = _primed_and_full(lambda s, x, y: tfl.cross_entropy(s.input(x3), s.input(y3)))
    np.testing.assert_allclose(got, _torch_ce(x3, y3), rtol=1e-6)


def test_stale_and_foreign_handles_are_refused_as_by_the_full_checks():
    other = tfl.Session(lazy=True)
    foreign = other.input(X)
    for make_old in (True, False):
        out = []
        for primed in (True, False):
            _torch_functional._PLAIN_CLASS_TARGETS.clear()
            s = tfl.Session(lazy=True)
            with s:
                x, y = s.input(X), s.input(Y)
                if primed:
                    tfl.cross_entropy(x, y)
            with s:
                y2 = s.input(Y)
                kind, text = _outcome(lambda: tfl.cross_entropy(x if make_old else foreign, y2))
                assert len(s.recording) == 1  # nothing recorded by the refused call
            out.append((kind, re.sub(r"\d+", "#", text)))  # the sessions' owner numbers differ
        _same(*out)
        assert out[0][0] is tfl.TapeError


def test_cross_entropy_replayed_step_by_step_matches_pytorch():
    """The short cut inside a training loop: each step's loss and gradient as PyTorch computes them."""
    _torch_functional._PLAIN_CLASS_TARGETS.clear()
    w = tfl.Param(np.eye(3, dtype=F32), name="w")
    tw = torch.eye(3, requires_grad=True)
    s = tfl.Session(lazy=True)
    for step in range(4):
        scale = F32(1.0 + step)
        with s:
            loss = tfl.cross_entropy(tfl.relu(s.input(X * scale) @ w), s.input(Y), label_smoothing=0.1)
            g = s.backward(loss)[w]
            got = (float(loss), np.asarray(g))
        tw.grad = None
        tl = torch.nn.functional.cross_entropy(
            torch.relu(torch.tensor(X * scale) @ tw), torch.tensor(Y, dtype=torch.long), label_smoothing=0.1
        )
        tl.backward()
        np.testing.assert_allclose(got[0], tl.item(), rtol=1e-6)
        np.testing.assert_allclose(got[1], tw.grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int32"])
def test_relu_gives_pytorchs_value_for_each_dtype(dtype):
    x = np.array([[-1.5, 0.0, 2.0], [3.0, -0.0, -4.0]], F32)
    want = torch.relu(torch.tensor(x).to(getattr(torch, dtype))).to(torch.float32).numpy()
    s = tfl.Session(lazy=True)
    for _ in range(3):  # recorded, then replayed
        with s:
            h = s.input(x).to(dtype)
            got = tfl.relu(h)
            assert got.dtype == h.dtype
            np.testing.assert_array_equal(np.asarray(got.astype("float32").value), want)


def test_relu_of_a_stale_handle_is_refused_as_the_op_itself_refuses_it():
    s = tfl.Session(lazy=True)
    with s:
        old = s.input(X)
    with s:
        errors = [_outcome(lambda: tfl.relu(old)), _outcome(lambda: tfl.apply("relu", old))]
    assert errors[0] == errors[1] and errors[0][0] is tfl.TapeError


@pytest.mark.parametrize(
    ("x_dtype", "p_dtype"),
    [("float32", "float32"), ("float16", "float32"), ("float32", "float16"), ("int32", "float32"), ("int32", "int32")],
)
def test_a_handle_and_a_param_promote_as_pytorch(x_dtype, p_dtype):
    """``handle + param`` and ``handle * param``: PyTorch's result dtype and values, recorded and replayed."""
    x = np.array([[1.0, -2.0], [3.0, 4.0]])
    p = np.array([0.5, 2.0]) if p_dtype.startswith("float") else np.array([1, 2])
    w = tfl.Param(p.astype(p_dtype))
    tx, tp = torch.tensor(x.astype(x_dtype)), torch.tensor(p.astype(p_dtype))
    s = tfl.Session(lazy=True)
    for _ in range(3):
        with s:
            h = s.input(x.astype(x_dtype))
            for got, want in ((h + w, tx + tp), (h * w, tx * tp)):
                assert str(got.dtype) == str(want.dtype).removeprefix("torch.")
                np.testing.assert_array_equal(np.asarray(got.value), want.numpy())


def test_cross_entropy_remembers_a_bounded_number_of_specs(monkeypatch):
    """A loop over ever new batch sizes does not grow the remembered specs without bound; each call still gives
    PyTorch's loss."""
    monkeypatch.setattr(_torch_functional, "_REMEMBERED", 2)
    _torch_functional._PLAIN_CLASS_TARGETS.clear()
    with tfl.Session(lazy=True) as s:
        for n in (1, 2, 3, 4, 2):
            got = float(tfl.cross_entropy(s.input(X[:n]), s.input(Y[:n])))
            assert len(_torch_functional._PLAIN_CLASS_TARGETS) <= 2
            np.testing.assert_allclose(got, _torch_ce(X[:n], Y[:n]), rtol=1e-6)
