"""Eager sessions compile their backward: every backward whose recording allows it runs as one program.

The forward stays op by op (every value is there at its line). The gradients of a
compiled backward come from the same program a lazy session builds (and an
optimizer step over them fuses with it), so they equal the op-by-op sweep to
float32 rounding; ``create_graph`` and hooks run op by op. Which path a backward
takes depends on its recording only, never on what the session ran before (a
restored run continues bit for bit: ``test_resume.py``).
"""

from __future__ import annotations

import numpy as np
import optax
import pytest
from test_lazy import char_lm, mlp, tied_autoencoder

import tapeflow as tfl

F32 = np.float32


def _train(build, op_by_op: bool, steps: int = 12):
    params, loss_fn = build()
    opt = tfl.Optimizer(optax.adam(1e-2), params)
    losses, compiled = [], []
    for _ in range(steps):
        s = tfl.Session(lazy=False)  # a fresh session each step: the path never depends on what ran before
        with s:
            loss = loss_fn(s)
            losses.append(float(loss))  # an eager value, there before the backward
            if op_by_op:
                loss.register_hook(lambda g: g)  # a hook keeps the backward op by op
            g = s.backward(loss)
            compiled.append(g.pending is not None)
            opt.step(g)
    named = params.items() if isinstance(params, dict) else enumerate(params)
    return losses, {k: np.asarray(p.value) for k, p in named}, compiled


@pytest.mark.parametrize("build", [mlp, tied_autoencoder, char_lm], ids=["mlp", "tied_ae", "char_lm"])
def test_a_compiled_backward_equals_the_op_by_op_one(build):
    c_losses, c_params, compiled = _train(build, op_by_op=False)
    o_losses, o_params, o_compiled = _train(build, op_by_op=True)
    assert all(compiled) and not any(o_compiled)
    np.testing.assert_allclose(c_losses, o_losses, rtol=1e-5, atol=1e-6)
    for k, v in o_params.items():
        if str(k).endswith("k_proj.bias"):  # a gradient of pure rounding noise (see test_lazy.NOISE_ONLY)
            continue
        np.testing.assert_allclose(c_params[k], v, rtol=1e-4, atol=1e-5, err_msg=str(k))


def test_read_gradients_of_a_compiled_backward_equal_op_by_op_ones():
    w = tfl.Param(np.linspace(-1, 1, 6, dtype=F32).reshape(2, 3), name="w")
    s = tfl.Session(lazy=False)
    got = []
    for k in range(2):
        with s:
            loss = tfl.sum(tfl.tanh(s.input(np.ones((4, 2), F32)) @ w) ** 2)
            if k == 0:
                loss.register_hook(lambda g: g)  # op by op
            g = s.backward(loss)
            got.append((g.pending is not None, np.asarray(g[w])))
    assert [c for c, _ in got] == [False, True]
    np.testing.assert_allclose(got[1][1], got[0][1], rtol=1e-6)


def test_hooks_and_create_graph_stay_op_by_op():
    w = tfl.Param(np.ones(3, F32), name="w")
    s = tfl.Session(lazy=False)
    for k in range(3):
        with s:
            h = s.input(np.ones(3, F32)) * w
            if k == 2:
                h.register_hook(lambda g: g * 2.0)
            g = s.backward(tfl.sum(h * h))
            assert (g.pending is not None) == (k != 2)
            assert g[w].tolist() == ([4.0] * 3 if k == 2 else [2.0] * 3)
    with s:
        x = s.input(np.array(3.0, F32), requires_grad=True)
        g = s.backward(x * x * x, create_graph=True)
        assert g.pending is None and float(s.backward(g[x])[x]) == 18.0


def test_a_failing_vjp_raises_at_backward_with_the_tape_unchanged():
    def fwd(x):
        return x * 2.0

    def vjp(g, out, x):
        raise ValueError("this vjp always fails")

    tfl.defop("failing_vjp", fwd, vjp, replace=True)
    try:
        s = tfl.Session(lazy=False)
        for _ in range(3):
            with s:
                x = s.input(np.ones(2, F32), requires_grad=True)
                y = tfl.sum(tfl.apply("failing_vjp", x))
                before = s.recording
                with pytest.raises(ValueError, match="always fails"):
                    s.backward(y)
                assert s.recording is before
    finally:
        from tapeflow._core._registry import unregister

        unregister("failing_vjp")


def test_recordings_that_cannot_be_one_program_stay_op_by_op_and_keep_no_block_alive():
    import gc
    from fractions import Fraction

    w = tfl.Param(np.array([1.0, 2.0], F32), name="w")

    def block(h):
        return tfl.sin(h * w)

    s = tfl.Session(lazy=False)
    ck = tfl.checkpoint(block)
    for _ in range(3):  # a checkpointed block: its op must go with its wrapper, so no program (or key) holds it
        with s:
            g = s.backward(tfl.sum(ck(s.input(np.ones(2, F32)))))
            assert g.pending is None
            np.testing.assert_allclose(g[w], np.cos(np.array([1.0, 2.0], F32)), rtol=1e-6)
            name = ck(s.input(np.ones(2, F32))).op
    del ck, g, s
    gc.collect()
    assert name not in tfl.REGISTRY
    q = tfl.Param(np.array([Fraction(1, 3), Fraction(2, 5)], dtype=object), name="q")
    s = tfl.Session(lazy=False)
    with pytest.warns(tfl.RationalFallbackWarning):  # said once, by the first op on them
        s.input(q.value)
    s.reset()
    for _ in range(3):  # exact rationals are computed by NumPy, never compiled
        with s:
            g = s.backward(tfl.sum(q * q))
            assert g.pending is None and list(g[q]) == [Fraction(2, 3), Fraction(4, 5)]
