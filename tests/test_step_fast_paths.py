"""The short cuts of a replayed lazy training step give what the full path gives: values, errors, compiles.

* ``LazyGrads.step`` finds the step program of the last step again by the identity of its parts (structure,
  pending ids, the optimizer's slot leaves and step, every slot passed as its first leaf) instead of keying it;
* an ``Optimizer`` makes its fused step's static argument (``StepCall``) once per rule and finite check;
* ``Session.input`` of a ``jax.Array`` on a lane tests the outline's leaf in one call (``Recorder.lane_input``).

Each probe runs one step body on an eager and a lazy session (each over its own, identically initialized
model: ``_probes.model``) and compares everything the body observed, as ``test_lane_probes.py`` does; the lazy
run also counts how often the remembered step program was taken, so a probe whose short cut never ran fails.
"""

from __future__ import annotations

import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _probes import F32, arr, compare, model

import tapeflow as tfl
from tapeflow._shell import _lazy

RNG = np.random.default_rng(11)
X = RNG.normal(size=(8, 4)).astype(F32)
Y = RNG.integers(0, 3, size=8).astype(np.int32)
STEPS = 11  # lanes from the fourth recording here; the first lane step keys its program


@pytest.fixture
def remembered(monkeypatch):
    """How many steps ran the remembered program (``_lazy._cached_program`` found it), and how many missed."""
    counts = {"hit": 0, "miss": 0}
    cached = _lazy._cached_program

    def counted(key):
        got = cached(key)
        counts["hit" if got is not None else "miss"] += 1
        return got

    monkeypatch.setattr(_lazy, "_cached_program", counted)
    monkeypatch.setattr(_lazy, "_last_step", None)
    return counts


def forward(s, m, x=X, y=Y):
    h = tfl.tanh(tfl.apply("linear", s.input(jnp.asarray(x)), m.W1, m.b1))
    return tfl.cross_entropy(h @ m.W2, s.input(jnp.asarray(y)))


def run(body, lazy, steps=STEPS, build=model):
    m = build()
    s = tfl.Session(lazy=lazy, seed=0)
    log = []
    for step in range(steps):
        try:
            with s:
                body(s, step, m, log)
        except Exception as e:  # compared by type and text
            log.append(("error", step, *describe(e)))
        log.append(("params", step, [arr(p.value) for p in m.params]))
        log.append(("opt", step, [arr(v) for v in jax.tree_util.tree_leaves(m.opt.state)]))
    return log


def describe(e):
    """An error as compared: a lazy session's finite-check refusal is a TapeError without the eager
    NonFiniteError's origin search (documented), so that one is compared by its first line."""
    msg = re.sub(r"storage=#\d+", "storage=#N", str(e))  # the two runs' models have their own storages
    if isinstance(e, tfl.NonFiniteError):
        return "TapeError", msg.split("\n")[0]
    return type(e).__name__, msg


def same(body, **kw):
    """The eager and the lazy log of ``body`` are equal; returns the lazy one."""
    e = run(body, False, **kw)
    z = run(body, True, **kw)
    compare(z, e)
    return z


def plain(s, step, m, log):
    loss = forward(s, m)
    m.opt.step(s.backward(loss))
    log.append(("loss", step, float(loss)))


def test_plain_loop_takes_the_remembered_step(remembered):
    same(plain)
    assert remembered["hit"] >= STEPS - 5


def test_plain_loop_against_optax_and_jax_grad(remembered):
    """An independent oracle: the same MLP trained by plain optax on ``jax.grad`` of a jax function."""
    m = model()
    s = tfl.Session(lazy=True)
    for _ in range(STEPS):
        with s:
            m.opt.step(s.backward(forward(s, m)))
    assert remembered["hit"] >= STEPS - 5

    ref = model()
    ws = [jnp.asarray(p.value) for p in ref.params]
    tx = optax.adam(1e-2)
    state = tx.init(ws)

    def loss_fn(ws):
        W1, b1, W2 = ws
        logits = jnp.tanh(X @ W1 + b1) @ W2
        return optax.softmax_cross_entropy_with_integer_labels(logits, Y).mean()

    for _ in range(STEPS):
        updates, state = tx.update(jax.grad(loss_fn)(ws), state, ws)
        ws = optax.apply_updates(ws, updates)
    for p, w in zip(m.params, ws):
        np.testing.assert_allclose(np.asarray(p.value), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_batch_shape_changes_then_back(remembered):
    def body(s, step, m, log):
        n = 5 if step in (5, 6) else 8
        loss = forward(s, m, X[:n], Y[:n])
        m.opt.step(s.backward(loss))
        log.append(("loss", step, float(loss)))

    same(body, steps=STEPS + 1)
    assert remembered["hit"] >= 2


def test_other_op_mid_step(remembered):
    def body(s, step, m, log):
        h = tfl.apply("linear", s.input(jnp.asarray(X)), m.W1, m.b1)
        h = tfl.relu(h) if step == 5 else tfl.tanh(h)
        loss = tfl.cross_entropy(h @ m.W2, s.input(jnp.asarray(Y)))
        m.opt.step(s.backward(loss))
        log.append(("loss", step, float(loss)))

    same(body)
    assert remembered["hit"] >= 1


def test_shape_error_mid_step_then_the_plain_step(remembered):
    """A replayed step that fails at a line raises there with the full path's message; the next steps train."""

    def body(s, step, m, log):
        h = tfl.tanh(tfl.apply("linear", s.input(jnp.asarray(X)), m.W1, m.b1))
        if step == 5:
            h = h @ m.W1  # (8, 5) @ (4, 5): the error at this line, nothing stepped
        loss = tfl.cross_entropy(h @ m.W2, s.input(jnp.asarray(Y)))
        m.opt.step(s.backward(loss))
        log.append(("loss", step, float(loss)))

    log = same(body)
    assert [e[1] for e in log if e[0] == "error"] == [5]
    assert remembered["hit"] >= 2


def test_param_written_between_backward_and_step(remembered):
    """A slot whose current value is no longer its leaf's snapshot is passed apart: the full path, the same values."""

    def body(s, step, m, log):
        g = s.backward(forward(s, m))
        if step == 5:
            m.W2.value = m.W2.value * 0.5
        m.opt.step(g)

    same(body)
    assert remembered["hit"] >= 2


def test_program_evicted_between_steps(remembered):
    """The remembered key's program is gone (caches cleared): the full path builds it again, same values."""

    def body(s, step, m, log):
        if step == 5:
            tfl.clear_kernel_caches()
        plain(s, step, m, log)

    same(body)
    assert remembered["miss"] >= 1 and remembered["hit"] >= 2


def test_block_loops_switched_between_steps(remembered):
    def body(s, step, m, log):
        tfl.set_block_loops(step != 5)
        plain(s, step, m, log)

    try:
        same(body)
    finally:
        tfl.set_block_loops(True)
    assert remembered["miss"] >= 1


def test_two_optimizers_of_one_structure_alternate(remembered):
    """Two models of the same structure, stepped in turn by their own optimizers: each its own values."""
    a, b = model(), model(optax.adam(3e-2))
    s = tfl.Session(lazy=True)
    ea, eb = model(), model(optax.adam(3e-2))
    e = tfl.Session(lazy=False)
    for _ in range(STEPS):
        for m, sess in ((a, s), (b, s), (ea, e), (eb, e)):
            with sess:
                m.opt.step(sess.backward(forward(sess, m)))
    for lazy_m, eager_m in ((a, ea), (b, eb)):
        compare([arr(p.value) for p in lazy_m.params], [arr(p.value) for p in eager_m.params])
    assert not np.allclose(np.asarray(a.W1.value), np.asarray(b.W1.value))


def test_check_finite_switched_between_steps(remembered):
    """The optimizer's finite check changes its step (another static argument): never the remembered one."""

    def body(s, step, m, log):
        m.opt.check_finite = step % 2 == 1
        loss = forward(s, m, X * (np.inf if step == 6 else 1.0))
        m.opt.step(s.backward(loss))
        log.append(("loss", step, float(loss)))

    log = same(body)
    errors = [e[1] for e in log if e[0] == "error"]
    assert errors and all(k > 6 and k % 2 == 1 for k in errors)  # step 6 unchecked: NaNs written, refused later
    assert any(np.isnan(v).any() for e in log if e[0] == "params" and e[1] == 6 for v in e[2])


def test_refused_step_on_the_remembered_path(remembered):
    """A non-finite step refused by the finite check on the remembered program: the same error, nothing written."""

    def body(s, step, m, log):
        m.opt.check_finite = True
        loss = forward(s, m, X * (np.inf if step == 6 else 1.0))
        m.opt.step(s.backward(loss))
        log.append(("loss", step, float(loss)))

    log = same(body)
    assert [e[1] for e in log if e[0] == "error"] == [6]
    assert remembered["hit"] >= 3


def test_input_fast_path_same_leaves_and_errors():
    """``s.input`` on a lane: another dtype, shape, ``requires_grad``, a complex array or a NumPy array in the
    outline's place records what a session without a lane records (node specs, values and errors)."""
    variants = [
        jnp.asarray(X),
        jnp.asarray(X, jnp.float16),
        jnp.asarray(X[:5]),
        jnp.asarray(X) + 0j,
        X,
        jnp.asarray(X),
    ]

    def record(s, x, rg):
        try:
            h = s.input(x, requires_grad=rg)
        except Exception as e:  # compared by type and text
            return type(e).__name__, str(e)
        nd = s.recording[h.id]
        return h.id, nd.op, nd.spec, nd.requires_grad, np.asarray(h.value).tolist(), h.shape, str(h.dtype)

    for rg in (False, True):
        for x in variants:
            got = []
            for lane in (True, False):
                s = tfl.Session(lazy=True)
                for _ in range(3 if lane else 0):  # the third recording replays on a lane
                    with s:
                        s.input(jnp.asarray(X))
                with s:
                    got.append(record(s, x, rg))
            assert got[0] == got[1], (x.dtype, x.shape, rg)


def test_input_from_another_thread_on_a_lane():
    s = tfl.Session(lazy=True)
    for _ in range(3):
        with s:
            s.input(jnp.asarray(X))
    errors = []
    with s:
        t = threading.Thread(target=lambda: errors.append(_raises(lambda: s.input(jnp.asarray(X)))))
        t.start()
        t.join()
        assert errors and "cannot be used from thread" in errors[0]
        assert len(s.recording) == 0  # nothing recorded
        h = s.input(jnp.asarray(X))  # the lane goes on in the owner's thread
        assert h.id == 0


def _raises(fn):
    try:
        fn()
    except tfl.TapeError as e:
        return str(e)
    return None
