"""Sessions over exact rationals: NumPy object arrays of ``Fraction`` computed on the CPU.

Gradients are checked against a backward pass written out by hand with ``Fraction``.
Split from ``test_session.py``.
"""

from __future__ import annotations

import warnings
from fractions import Fraction

import numpy as np
import pytest
from _helpers import _assert_unchanged, _state

import tapeflow as tfl
from tapeflow import TapeError

pytestmark = pytest.mark.usefixtures("lazy_mode")  # every test runs with eager and with lazy sessions

# =========================================================================== exact rationals


def _frac(a):
    out = np.empty(np.shape(a), dtype=object)
    for i, v in np.ndenumerate(np.asarray(a, dtype=object)):
        out[i] = Fraction(v)
    return out


def _is_fractions(a):
    return isinstance(a, np.ndarray) and a.dtype == object and all(isinstance(v, Fraction) for v in a.flat)


def _exact_equal(a, b):
    a, b = np.asarray(a, dtype=object), np.asarray(b, dtype=object)
    return a.shape == b.shape and all(u == v and type(u) is Fraction for u, v in zip(a.flat, b.flat))


class TestRationals:
    def test_fallback_warning_and_cpu_numpy(self):
        s = tfl.Session()
        with pytest.warns(tfl.RationalFallbackWarning):
            x = s.input(_frac([[Fraction(1, 3), Fraction(-2, 7)]]))
        assert x.dtype == np.dtype(object)
        y = x * x
        assert _is_fractions(y.value)
        assert ("mul", "numpy-exact (cpu)") in s.selected_backends

    def test_exact_forward_ops(self):
        a_v = _frac([[Fraction(1, 3), Fraction(-2, 7)], [Fraction(5, 2), Fraction(0)]])
        b_v = _frac([[Fraction(3, 4), Fraction(1, 9)], [Fraction(-1, 5), Fraction(7, 3)]])
        s = tfl.Session()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tfl.RationalFallbackWarning)
            a, b = s.input(a_v), s.input(b_v)
            cases = {
                "add": (a + b, a_v + b_v),
                "sub": (a - b, a_v - b_v),
                "mul": (a * b, a_v * b_v),
                "div": (a / b, a_v / b_v),
                "neg": (-a, -a_v),
                "matmul": (a @ b, a_v @ b_v),
                "sum": (a.sum(axis=0), a_v.sum(axis=0)),
                "mean": (a.mean(), a_v.sum() / 4),
                "relu": (tfl.relu(a), np.where(a_v > 0, a_v, Fraction(0))),
                "maximum": (tfl.maximum(a, b), np.where(a_v >= b_v, a_v, b_v)),
                "minimum": (tfl.minimum(a, b), np.where(a_v <= b_v, a_v, b_v)),
                "scalar": (a * 3 + 1, a_v * 3 + 1),
            }
        for name, (h, ref) in cases.items():
            assert _exact_equal(h.value, ref), name

    @pytest.mark.parametrize(
        "fn", [tfl.exp, tfl.tanh, tfl.sqrt, tfl.sigmoid, lambda h: h.max(), lambda h: tfl.softmax(h, dim=-1)]
    )
    def test_inexact_ops_give_a_clear_error(self, fn):
        s = tfl.Session()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tfl.RationalFallbackWarning)
            x = s.input(_frac([Fraction(1, 2), Fraction(3, 2)]))
        before = _state(s)
        with pytest.raises(TapeError, match=r"exact rational|object|rational"):
            fn(x)
        _assert_unchanged(s, before)

    def test_two_layer_mlp_gradients_are_exact(self):
        F = Fraction
        x_v = _frac([[F(1, 2), F(-1, 3), F(2)], [F(-3, 4), F(5, 6), F(1, 7)]])  # (2, 3)
        w1_v = _frac(
            [
                [F(1, 5), F(-2, 3), F(3, 4), F(1)],
                [F(-1, 2), F(1, 3), F(2, 7), F(-5, 4)],
                [F(2, 9), F(1, 6), F(-1, 8), F(3, 5)],
            ]
        )  # (3, 4)
        b1_v = _frac([F(1, 10), F(-1, 20), F(1, 3), F(-2, 5)])  # (4,)
        w2_v = _frac([[F(1, 3), F(-1, 2)], [F(2, 5), F(1, 4)], [F(-3, 7), F(2, 3)], [F(1, 6), F(-1, 9)]])  # (4, 2)
        t_v = _frac([[F(1), F(0)], [F(0), F(1)]])  # (2, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tfl.RationalFallbackWarning)
            w1, b1, w2 = tfl.Param(w1_v, name="w1"), tfl.Param(b1_v, name="b1"), tfl.Param(w2_v, name="w2")
            s = tfl.Session()
            x = s.input(x_v)
            t = s.const(t_v)
            h = tfl.relu(x @ w1 + b1)
            out = h @ w2
            d = out - t
            loss = (d * d).mean()
            grads = s.backward(loss)

        # hand-written forward and backward, exact
        z1 = x_v @ w1_v + b1_v
        assert all(v != 0 for v in z1.flat)  # no kinks at relu's corner
        assert any(v < 0 for v in z1.flat) and any(v > 0 for v in z1.flat)
        h_v = np.where(z1 > 0, z1, F(0))
        out_v = h_v @ w2_v
        d_v = out_v - t_v
        n = d_v.size
        loss_v = (d_v * d_v).sum() / n
        g_d = 2 * d_v / n
        g_w2 = h_v.T @ g_d
        g_h = g_d @ w2_v.T
        g_z1 = np.where(z1 > 0, g_h, F(0))
        g_b1 = g_z1.sum(axis=0)
        g_w1 = x_v.T @ g_z1

        assert _is_fractions(loss.value) and loss.value.item() == loss_v
        assert isinstance(loss_v, Fraction)
        for p, ref in ((w1, g_w1), (b1, g_b1), (w2, g_w2)):
            got = grads[p]
            assert _is_fractions(got)
            assert _exact_equal(got, _frac(ref)), p.name
        assert x.id not in grads and t.id not in grads

    def test_rational_tied_weights_exact(self):
        F = Fraction
        w_v = _frac([[F(1, 2), F(-1, 3)], [F(2, 5), F(3, 4)]])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tfl.RationalFallbackWarning)
            w = tfl.Param(w_v)
            wt = tfl.tie(w)
            s = tfl.Session()
            y = (s.use(w) @ wt).sum()  # sum(W @ W)
            g = s.backward(y)
        ones = _frac(np.ones((2, 2), dtype=int))
        # d/dW sum(W1 @ W2) = ones @ W2.T + W1.T @ ones at W1 = W2 = W
        ref = ones @ w_v.T + w_v.T @ ones
        assert _exact_equal(g[w], ref)
