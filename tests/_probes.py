"""The shared harness of the probe files (``test_lane_probes.py``, ``test_eager_replay_probes.py``): a small
model and the comparison of two runs' logs (``from _probes import ...``; conftest puts this folder on the path)."""

from __future__ import annotations

import types

import jax
import numpy as np
import optax

import tapeflow as tfl

F32 = np.float32


def model(tx=None):
    """A 4-5-3 MLP (W1, b1, W2) and an Optimizer over it (adam 1e-2 unless ``tx``); the same values every call."""
    rng = np.random.default_rng(0)
    W1 = tfl.Param((rng.normal(size=(4, 5)) / 2).astype(F32), name="W1")
    b1 = tfl.Param(np.zeros(5, F32), name="b1")
    W2 = tfl.Param((rng.normal(size=(5, 3)) / 2).astype(F32), name="W2")
    params = [W1, b1, W2]
    opt = tfl.Optimizer(tx or optax.adam(1e-2), params)
    return types.SimpleNamespace(W1=W1, b1=b1, W2=W2, params=params, opt=opt, extra={})


def arr(v):
    return np.asarray(v)


def compare(a, b, path="log", rtol=1e-6, atol=1e-7):
    """Two logs are equal: the same structure and plain values, arrays of one shape and dtype (and sign of
    zero) equal to ``rtol``/``atol``."""
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: {a!r} vs {b!r}"
        for k, (x, y) in enumerate(zip(a, b)):
            compare(x, y, f"{path}[{k}]", rtol, atol)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            compare(a[k], b[k], f"{path}[{k!r}]", rtol, atol)
    elif isinstance(a, (np.ndarray, jax.Array, np.generic, float)) and not isinstance(a, bool):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, f"{path}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
        if a.dtype.kind in "fc":
            assert (np.signbit(a) == np.signbit(b)).all() or not (a == 0).any(), f"{path}: sign of zero"
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=path)
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
