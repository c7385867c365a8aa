"""Shared helpers of the Session, Tensor and Grads tests (``from _helpers import ...``).

``tests/conftest.py`` puts this folder on ``sys.path``, so the import works under
every ``--import-mode``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import tapeflow as tfl

RTOL = 1e-10
ATOL = 1e-12

STALE_MSG = (
    "stale tensor handle from generation 0; current generation is 1 "
    "(Session.reset() invalidates handles recorded before it)"
)
FOREIGN_MSG = "tensor handle belongs to a different session"


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _arr(shape, seed=0):
    return jnp.asarray(_rng(seed).standard_normal(shape))


def close(a, b, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def _state(s: tfl.Session):
    """Everything a rejected call must leave unchanged."""
    return (
        s.tape,
        len(s.tape),
        s.rng_counter,
        s.generation,
        dict(tfl.kernel_cache_info()),
        [(g.id, g.leaves, g.storage) for g in s.parameter_groups()],
        dict(s._params_by_leaf),
        list(s.selected_backends),
    )


def _assert_unchanged(s, before):
    after = _state(s)
    assert after[0] is before[0], "the tape object was replaced by a rejected call"
    assert after[1:] == before[1:]


class Switch:
    """A pure_callback target that raises while ``on``."""

    def __init__(self) -> None:
        self.on = False

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.on:
            raise RuntimeError("injected failure inside the update")
        return np.asarray(x)


PATHS = ["eager", "lazy", "train_step"]
"""The three ways to run a training step; a test parametrized over them checks one behaviour on every path."""


def one_step(path, loss_fn, opt, *, compute_dtype=None, steps=None):
    """One training step of ``loss_fn(session)`` on ``path``; returns the loss value.

    ``steps`` (a list) receives the ``TrainStep`` of the ``train_step`` path, to read its counters.
    """
    if path == "train_step":
        step = tfl.train_step(lambda s: loss_fn(s), opt, compute_dtype=compute_dtype)
        if steps is not None:
            steps.append(step)
        return step()
    with tfl.Session(lazy=path == "lazy", compute_dtype=compute_dtype) as s:
        loss = loss_fn(s)
        opt.step(s.backward(loss))
        return loss.value
