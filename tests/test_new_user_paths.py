"""What a new user meets first: the errors and messages of the first hour say what happened and what to do."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import tapeflow as tfl
from tapeflow import TapeError

STALE = r"stale tensor handle from generation {}; current generation is {} \({}"


def test_a_handle_read_after_its_with_block_says_the_block_exit_reset_the_session():
    s = tfl.Session()
    with s:
        loss = tfl.sum(s.input(jnp.arange(3.0)))
    with pytest.raises(TapeError, match=STALE.format(0, 1, r"the `with s:` block it was recorded in has ended")):
        float(loss)
    with pytest.raises(TapeError) as err:
        loss.value
    assert "Session.reset()" not in str(err.value) and "float(loss)" in str(err.value)


def test_a_handle_read_after_reset_names_the_reset():
    s = tfl.Session()
    with s:
        kept = tfl.sum(s.input(jnp.arange(3.0)))
        s.reset()  # inside the block: the user's own reset invalidated it
        with pytest.raises(TapeError, match=STALE.format(0, 1, r"Session\.reset\(\) invalidates handles")):
            float(kept)
    with pytest.raises(TapeError, match=STALE.format(0, 2, r"Session\.reset\(\) invalidates handles")):
        float(kept)
