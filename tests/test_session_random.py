"""Session randomness: the seeded RNG counter, distributions, dropout, rejected draws.

Split from ``test_session.py``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import _arr, close

import tapeflow as tfl
from tapeflow import TapeError

pytestmark = pytest.mark.usefixtures("lazy_mode")  # every test runs with eager and with lazy sessions

# =========================================================================== randomness


class TestRandomness:
    def test_counter_advances_once_per_call(self):
        s = tfl.Session(seed=1)
        x = s.input(jnp.ones((4, 4)))
        assert s.rng_counter == 0
        s.rand_uniform((3,))
        assert s.rng_counter == 1
        s.normal((2, 2))
        assert s.rng_counter == 2
        s.bernoulli_mask((5,), 0.5)
        assert s.rng_counter == 3
        tfl.dropout(x, 0.25)
        assert s.rng_counter == 4
        tfl.dropout(x, 0.0)  # identity: no draw
        assert s.rng_counter == 4

    def test_counter_survives_reset_and_sessions_agree(self):
        a = tfl.Session(seed=5)
        b = tfl.Session(seed=5)
        ua = [np.asarray(a.rand_uniform((4,)))]
        a.reset()
        assert a.rng_counter == 1
        ua.append(np.asarray(a.normal((4,))))
        a.reset()
        ua.append(np.asarray(a.bernoulli_mask((64,), 0.3)))
        ub = [np.asarray(b.rand_uniform((4,))), np.asarray(b.normal((4,))), np.asarray(b.bernoulli_mask((64,), 0.3))]
        for x, y in zip(ua, ub):
            assert np.array_equal(x, y)
        assert a.rng_counter == b.rng_counter == 3
        # a reset does not rewind: the next draw differs from the first
        assert not np.array_equal(np.asarray(a.rand_uniform((4,))), ua[0])

    def test_seed_matters_and_draws_differ(self):
        a = tfl.Session(seed=0)
        b = tfl.Session(seed=1)
        x0, x1 = np.asarray(a.rand_uniform((16,))), np.asarray(a.rand_uniform((16,)))
        y0 = np.asarray(b.rand_uniform((16,)))
        assert not np.array_equal(x0, x1)
        assert not np.array_equal(x0, y0)

    def test_distributions(self):
        s = tfl.Session(seed=2)
        u = s.rand_uniform((20000,), low=-2.0, high=3.0)
        arr = np.asarray(u)
        assert arr.min() >= -2.0 and arr.max() < 3.0
        assert abs(arr.mean() - 0.5) < 0.05
        n = np.asarray(s.normal((20000,)))
        assert abs(n.mean()) < 0.05 and abs(n.std() - 1.0) < 0.05
        m = s.bernoulli_mask((20000,), 0.3)
        assert m.dtype == np.dtype(bool)
        assert abs(np.asarray(m).mean() - 0.3) < 0.02
        for h in (u, m):
            assert not h.requires_grad and s.tape[h.id].op is None
        assert s.rand_uniform(5).shape == (5,)
        assert s.normal((2, 3), dtype=jnp.float32).dtype == np.dtype("float32")

    @pytest.mark.parametrize(
        "call",
        [
            lambda s: s.rand_uniform((2, -1)),
            lambda s: s.normal((2.5,)),
            lambda s: s.bernoulli_mask((3,), 1.5),
            lambda s: s.bernoulli_mask((-3,), 0.5),
            lambda s: tfl.dropout(s.input(jnp.ones(3)), 1.5),
            lambda s: tfl.dropout(s.input(jnp.ones(3)), -0.1),
            lambda s: tfl.dropout(s.input(np.arange(3)), 0.5),  # integer operand: rejected before drawing
            lambda s: tfl.dropout(s.input(np.array([True, False])), 0.5),
        ],
    )
    def test_rejected_draw_does_not_advance(self, call):
        s = tfl.Session(seed=3)
        s.rand_uniform((2,))
        n = len(s.tape)
        with pytest.raises((TapeError, ValueError, TypeError)):
            call(s)
        assert s.rng_counter == 1
        assert len(s.tape) <= n + 1  # at most the dropout operand's input leaf, no mask leaf
        ref = tfl.Session(seed=3)
        ref.rand_uniform((2,))
        assert np.array_equal(np.asarray(s.rand_uniform((3,))), np.asarray(ref.rand_uniform((3,))))

    def test_dropout_uses_the_session_mask_and_its_gradient(self):
        x_np = _arr((8, 8), 70) + 5.0
        a = tfl.Session(seed=9)
        b = tfl.Session(seed=9)
        a.rand_uniform((1,))
        b.rand_uniform((1,))
        x = a.input(x_np, requires_grad=True)
        y = tfl.dropout(x, 0.25)
        mask = np.asarray(b.bernoulli_mask((8, 8), 0.75))
        expect = np.where(mask, x_np / 0.75, 0.0)
        close(y.value, expect)
        assert 0 < mask.sum() < 64
        g = a.backward(y.sum())
        close(g[x], mask / 0.75)

    def test_dropout_inference_is_identity(self):
        s = tfl.Session(grad_enabled=False)
        x = s.input(jnp.ones(4))
        assert tfl.dropout(x, 0.5, training=s.grad_enabled) is x  # PyTorch's training=True default drops
        s2 = tfl.Session()
        x2 = s2.input(jnp.ones(4))
        assert tfl.dropout(x2, 0.5, training=False) is x2
        assert s2.rng_counter == 0


@pytest.mark.parametrize(
    "draw",
    [
        lambda s, x: s.normal((2,)),
        lambda s, x: s.rand_uniform((2,)),
        lambda s, x: s.bernoulli_mask((2,), 0.5),
        lambda s, x: s.random_key(),
        lambda s, x: tfl.dropout(x, 0.5, True),
    ],
    ids=["normal", "rand_uniform", "bernoulli_mask", "random_key", "dropout"],
)
def test_draw_at_the_last_counter_value_is_refused_and_the_state_stays_savable(draw, tmp_path):
    s = tfl.Session(seed=3)
    s.set_rng_state(counter=2**63 - 2)
    x = s.input(jnp.ones(2))
    draw(s, x)  # the last draw that keeps the counter in [0, 2**63)
    assert s.rng_counter == 2**63 - 1
    n = len(s.tape)
    with pytest.raises(TapeError, match=r"RNG counter is at its last value.*nothing was drawn.*set_rng_state"):
        draw(s, x)
    assert (s.rng_counter, len(s.tape)) == (2**63 - 1, n)
    p = tfl.Param(jnp.ones(2))
    tfl.save(tmp_path / "ck", [p], session=s)
    s2 = tfl.Session()
    tfl.restore(tmp_path / "ck", [p], session=s2)
    assert (s2.seed, s2.rng_counter) == (3, 2**63 - 1)
    s.set_rng_state(seed=4, counter=0)
    draw(s, x)
    assert s.rng_counter == 1


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 1.5, True, "0"])
def test_session_seed_out_of_range_or_not_an_int_is_refused(seed):
    with pytest.raises(TapeError, match=r"Session: seed must be an int in \[-2\*\*63, 2\*\*63\)"):
        tfl.Session(seed=seed)


def test_session_seed_accepts_the_ends_of_its_range():
    for seed in (-(2**63), 2**63 - 1, np.int64(5)):
        assert tfl.Session(seed=seed).seed == int(seed)
