"""Lazy sessions (``tfl.Session(lazy=True)``): eager semantics, one compiled program per step.

The session, optimizer, nn and checkpoint test files also run every test with lazy
sessions (the ``lazy_mode`` fixture); this file checks what is particular to laziness:
values equal eager ones over many steps, what compiles and how often, memory, errors
at record time, reads in the middle of a step, and the fused optimizer step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tapeflow as tfl
from tapeflow._core._tape import PENDING
from tapeflow._shell import _lazy

F32 = np.float32
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def programs() -> int:
    """Compiled lazy programs so far (forward, gradient and step programs)."""
    return tfl.kernel_cache_info()["lazy"]


# --------------------------------------------------------------------------- models


def mlp():
    rng = np.random.default_rng(0)
    sizes = (12, 16, 16, 4)
    ps = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        ps += [tfl.Param((rng.normal(size=(a, b)) / np.sqrt(a)).astype(F32)), tfl.Param(np.zeros(b, F32))]
    x = rng.normal(size=(8, 12)).astype(F32)
    y = rng.integers(0, 4, size=8).astype(np.int32)

    def loss_fn(s):
        h = s.input(x)
        for i in range(0, len(ps), 2):
            h = tfl.apply("linear", h, ps[i], ps[i + 1])
            if i + 2 < len(ps):
                h = tfl.relu(h)
        return tfl.cross_entropy(h, s.input(y))

    return ps, loss_fn


def tied_autoencoder():
    rng = np.random.default_rng(1)
    W = tfl.Param((rng.normal(size=(10, 4)) / 3).astype(F32), name="W")
    b, c = tfl.Param(np.zeros(4, F32)), tfl.Param(np.zeros(10, F32))
    W_dec = tfl.tie(W, name="W_dec")
    x = rng.normal(size=(6, 10)).astype(F32)

    def loss_fn(s):
        xi = s.input(x)
        h = tfl.tanh(tfl.apply("linear", xi, W, b))
        return tfl.mse(h @ W_dec.T + c, xi)

    return [W, b, c, W_dec], loss_fn


def char_lm():
    from char_lm import CharLM

    model = CharLM(11, 8, 16, 2, 1, key=jax.random.key(0))
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 11, size=(4, 8)).astype(np.int32)
    targets = rng.integers(0, 11, size=(4, 8)).astype(np.int32)

    def loss_fn(s):
        return tfl.apply("cross_entropy", model(ids), s.input(targets))

    return dict(model.parameter_records()), loss_fn


def train(build, lazy: bool, steps: int = 20):
    params, loss_fn = build()
    opt = tfl.Optimizer(optax.adam(1e-2), params)
    losses = []
    s = tfl.Session(lazy=lazy)
    for _ in range(steps):
        with s:
            loss = loss_fn(s)
            opt.step(s.backward(loss))
            losses.append(float(loss))  # read after the step: the fused program computed it
    named = params.items() if isinstance(params, dict) else enumerate(params)
    return losses, {k: np.asarray(p.value) for k, p in named}


# The key projection's bias has an identically zero gradient (softmax ignores a shift shared by every key),
# so its computed gradient is rounding noise that Adam scales up to full-size steps: compared separately.
NOISE_ONLY = ("k_proj.bias",)


@pytest.mark.parametrize("build", [mlp, tied_autoencoder, char_lm], ids=["mlp", "tied_ae", "char_lm"])
def test_twenty_adam_steps_equal_eager(build):
    eager_losses, eager_params = train(build, lazy=False)
    lazy_losses, lazy_params = train(build, lazy=True)
    np.testing.assert_allclose(lazy_losses, eager_losses, rtol=1e-5, atol=1e-6)
    worst = max(
        float(np.max(np.abs(lazy_params[k] - v))) for k, v in eager_params.items() if not str(k).endswith(NOISE_ONLY)
    )
    assert worst <= 1e-6
    for k, v in eager_params.items():  # noise-driven steps: at most 20 steps of lr 1e-2 apart
        assert float(np.max(np.abs(lazy_params[k] - v))) <= 0.4
    assert eager_losses[-1] < eager_losses[0]


@pytest.mark.usefixtures("library_defaults")
class TestTheDefault:
    """A plain ``tfl.Session()`` records lazily; ``lazy=False`` or ``TAPEFLOW_LAZY=0`` runs op by op."""

    def test_a_plain_session_is_lazy_and_computes_nothing_until_read(self):
        s = tfl.Session()
        assert s.lazy and s.mode == "lazy"
        with s:
            y = tfl.tanh(s.input(jnp.ones(3)) * 2.0)
            assert s.recording[y.id].value is PENDING  # recorded, not computed
            np.testing.assert_allclose(np.asarray(y.value), np.tanh(2.0 * np.ones(3)), rtol=1e-6)

    @pytest.mark.parametrize(
        ("text", "lazy"), [("0", False), ("false", False), ("off", False), ("1", True), ("", True)]
    )
    def test_the_environment_chooses_when_the_call_does_not(self, monkeypatch, text, lazy):
        monkeypatch.setenv("TAPEFLOW_LAZY", text)
        assert tfl.Session().lazy is lazy
        assert tfl.Session(lazy=not lazy).lazy is (not lazy)  # an explicit argument wins

    def test_an_unreadable_switch_is_refused_with_the_values_it_takes(self, monkeypatch):
        monkeypatch.setenv("TAPEFLOW_LAZY", "sometimes")
        with pytest.raises(ValueError, match=r"TAPEFLOW_LAZY='sometimes'.*set it to 0"):
            tfl.Session()
        assert tfl.Session(lazy=False).mode == "eager"  # an explicit argument never reads it

    def test_op_by_op_runs_each_op_when_it_is_recorded(self, monkeypatch):
        monkeypatch.setenv("TAPEFLOW_LAZY", "0")
        with tfl.Session() as s:
            y = s.input(jnp.ones(3)) * 2.0
            assert s.recording[y.id].value is not PENDING


def test_a_lazy_step_runs_one_program_and_computes_nothing_while_recording():
    params, loss_fn = mlp()
    opt = tfl.Optimizer(optax.adam(1e-2), params)
    with tfl.Session(lazy=True) as s:
        loss = loss_fn(s)
        assert s.lazy and s._tape[loss.id].value is PENDING  # recorded, not computed
        assert loss.shape == () and loss.op == "cross_entropy" and loss.requires_grad  # metadata needs no value
        tfl.clear_kernel_caches()  # an earlier test's step of this structure would serve this one
        before = programs()
        opt.step(s.backward(loss))  # forward + backward + sums + Adam: one step program
        assert programs() == before + 1
        assert s._tape[loss.id].value is not PENDING and np.isfinite(float(loss))
        assert programs() == before + 1  # the loss came out of the step program


# --------------------------------------------------------------------------- compile counts


def _step_once(s, opt, params, x, branch=False):
    W, b = params
    with s:
        h = tfl.tanh(s.input(x) @ W + b)
        if branch:
            h = h * h
        opt.step(s.backward(tfl.mean(h)))


def test_compiles_once_per_structure():
    params = [tfl.Param(np.ones((5, 3), F32) / 5), tfl.Param(np.zeros(3, F32))]
    opt = tfl.Optimizer(optax.adam(1e-3), params)
    s = tfl.Session(lazy=True)
    x8, x4 = np.ones((8, 5), F32), np.ones((4, 5), F32)
    before = programs()
    for _ in range(100):
        _step_once(s, opt, params, x8)
    assert programs() == before + 1, "100 steps of one structure compile one program"
    for _ in range(3):
        _step_once(s, opt, params, x4)
    assert programs() == before + 2, "a new batch size compiles once more"
    for i in range(100):
        _step_once(s, opt, params, x8, branch=i % 2 == 1)
    assert programs() == before + 3, "a branch taken on alternate steps adds one program, not 50"


def test_values_are_arguments_never_constants():
    """The same program serves new data, new parameter values and new Python scalars of the same type."""
    W = tfl.Param(np.ones(3, F32))
    s = tfl.Session(lazy=True)
    outs = []
    for k in range(3):
        W.value = np.full(3, k, F32)
        with s:
            outs.append(float(tfl.sum(s.input(np.arange(3, dtype=F32)) * W)))
    assert outs == [0.0, 3.0, 6.0]


# --------------------------------------------------------------------------- memory


def test_live_arrays_flat_over_1000_lazy_steps():
    params = [tfl.Param(np.ones((5, 3), F32) / 5), tfl.Param(np.zeros(3, F32))]
    opt = tfl.Optimizer(optax.adam(1e-3), params)
    s = tfl.Session(lazy=True)
    x = np.ones((8, 5), F32)
    for _ in range(20):
        _step_once(s, opt, params, x)
    live0 = len(jax.live_arrays())
    for _ in range(1000):
        _step_once(s, opt, params, x)
    assert len(jax.live_arrays()) <= live0 + 2


def test_reset_drops_pending_values_and_programs_keep_no_step_arrays():
    s = tfl.Session(lazy=True)
    x = jnp.ones((64, 64), jnp.float32)
    with s:
        float(tfl.sum(s.input(x) * 2.0))
    live0 = len(jax.live_arrays())
    for _ in range(20):
        with s:
            y = tfl.sum(s.input(jnp.ones((64, 64), jnp.float32)) * 2.0)
            assert float(y) == 8192.0
    assert len(jax.live_arrays()) <= live0 + 1


# --------------------------------------------------------------------------- record-time errors


def test_errors_are_raised_at_record_time_with_the_eager_message_and_tape_unchanged():
    messages = []
    for lazy in (False, True):
        s = tfl.Session(lazy=lazy)
        a, b = s.input(np.ones((2, 3), F32)), s.input(np.ones((4, 5), F32))
        before = s._tape
        with pytest.raises(tfl.TapeError) as e:
            a @ b
        assert s._tape is before
        messages.append(str(e.value))
    assert messages[0] == messages[1] and "matmul" in messages[0]


# --------------------------------------------------------------------------- reads in the middle of a step


def test_data_dependent_control_flow():
    def run(lazy):
        W = tfl.Param(np.array([[1.0, -2.0], [0.5, 1.0]], F32))
        out = []
        for sign in (1.0, -1.0):
            with tfl.Session(lazy=lazy) as s:
                h = s.input(np.array([[sign, 1.0]], F32)) @ W
                if float(tfl.sum(h)) > 0:  # reads a value mid-recording; recording continues
                    loss = tfl.sum(tfl.relu(h) ** 2.0)
                else:
                    loss = tfl.sum(tfl.tanh(h))
                g = s.backward(loss)
                out.append((float(loss), np.asarray(g[W])))
        return out

    for (l1, g1), (l2, g2) in zip(run(True), run(False)):
        assert l1 == pytest.approx(l2, rel=1e-6)
        np.testing.assert_allclose(g1, g2, rtol=1e-6)


def test_reading_gradients_first_works_as_two_programs():
    """Clipping by hand: the gradients are computed (gradient program), then a normal step."""
    results = []
    for lazy in (False, True):
        W = tfl.Param(np.array([[3.0, -4.0]], F32))
        opt = tfl.Optimizer(optax.sgd(0.1), [W])
        with tfl.Session(lazy=lazy) as s:
            loss = tfl.sum((s.input(np.ones((2, 1), F32)) @ W) ** 2.0)
            before = programs()
            g = s.backward(loss)
            norm = float(jnp.linalg.norm(g[W]))  # reading them runs the gradient program
            opt.step({W: g[W] / max(norm, 1.0)})
            if lazy:
                assert programs() - before <= 1
            results.append((np.asarray(W.value), float(loss)))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-6)
    assert results[1][1] == pytest.approx(results[0][1])


def test_fill_pending_is_the_one_in_place_write_and_every_sharing_tape_sees_it():
    from tapeflow._core._tape import fill_pending

    s = tfl.Session(lazy=True)
    x = s.input(np.array([1.0, 2.0], F32))
    y = x * 2.0
    before = s._tape
    z = y + 1.0
    after = s._tape  # a longer tape value sharing y's node with ``before``
    with pytest.raises(tfl.TapeError, match=rf"fill_pending: node #{z.id} .* cannot hold a value of float32\[3\]"):
        fill_pending(after, [y.id, z.id], [jnp.full(2, 2.0, F32), jnp.ones(3, F32)])
    assert after[y.id].value is PENDING and after[z.id].value is PENDING  # checked first: nothing written
    fill_pending(after, [y.id], [jnp.array([2.0, 4.0], F32)])
    assert before[y.id].value.tolist() == [2.0, 4.0] and after[z.id].value is PENDING
    fill_pending(after, [y.id], [jnp.zeros(2, F32)])  # a computed value is kept
    assert before[y.id].value.tolist() == [2.0, 4.0]
    assert type(after[x.id].value) is np.ndarray  # a host input: read, it becomes a jax.Array in place
    assert z.value.tolist() == [3.0, 5.0] and x.value.tolist() == [1.0, 2.0]
    assert isinstance(before[x.id].value, jax.Array)


def test_every_way_of_reading_a_value():
    s = tfl.Session(lazy=True)
    x = s.input(np.array([1.5], F32))
    y = x * 2.0
    assert s._tape[y.id].value is PENDING
    assert float(y) == 3.0 and int(y) == 3 and bool(y) and y.item() == 3.0
    z = x + 1.0
    np.testing.assert_array_equal(z.numpy(), [2.5])
    w = x - 1.0
    np.testing.assert_array_equal(np.asarray(w), [0.5])
    v = x * x
    assert "Tensor(" in repr(v) and s._tape[v.id].value is PENDING  # the repr shows no value: nothing computed
    assert v.value.tolist() == [2.25]
    u = x * 3.0
    assert s.tape[u.id].value.tolist() == [4.5]  # Session.tape hands out a computed tape


def test_param_changed_after_its_use_contributes_the_value_seen_at_the_use():
    grads = []
    for lazy in (False, True):
        W = tfl.Param(np.array(2.0, F32))
        with tfl.Session(lazy=lazy) as s:
            y = W * W  # records W's value 2.0
            W.value = np.array(10.0, F32)
            loss = y * W  # records 10.0
            g = s.backward(loss)
            grads.append((float(g[W]), float(loss)))
    assert grads[0] == grads[1] == (2 * 2.0 * 10.0 + 4.0, 40.0)


def test_random_draws_advance_the_counter_at_record_time_and_equal_eager():
    vals = []
    for lazy in (False, True):
        s = tfl.Session(seed=3, lazy=lazy)
        a = s.normal((3,)) * 2.0
        assert s.rng_counter == 1
        b = tfl.dropout(s.input(np.ones(4, F32)), 0.5)
        vals.append((np.asarray(a.value), np.asarray(b.value), s.rng_counter))
    np.testing.assert_array_equal(vals[0][0], vals[1][0])
    np.testing.assert_array_equal(vals[0][1], vals[1][1])
    assert vals[0][2] == vals[1][2]


def test_stale_handles_and_gradients_after_reset():
    s = tfl.Session(lazy=True)
    x = s.input(np.ones(2, F32), requires_grad=True)
    y = tfl.sum(x * 3.0)
    g = s.backward(y)
    s.reset()
    with pytest.raises(tfl.TapeError, match="stale"):
        y.value
    np.testing.assert_array_equal(np.asarray(g[0]), [3.0, 3.0])  # taken before the reset: still computable


def test_inference_session_and_exact_rationals_and_create_graph():
    with tfl.Session(lazy=True, grad_enabled=False) as s:
        y = s.input(np.arange(3.0, dtype=F32)) * 2.0
        assert not y.requires_grad and y.value.tolist() == [0.0, 2.0, 4.0]
        with pytest.raises(tfl.TapeError, match="inference"):
            s.backward(tfl.sum(y))
    from fractions import Fraction

    with pytest.warns(tfl.RationalFallbackWarning), tfl.Session(lazy=True) as s:
        q = s.input(np.array([Fraction(1, 3)], dtype=object), requires_grad=True)
        r = q * q
        assert s._tape[r.id].value is not PENDING  # exact rationals are computed eagerly
        assert s.backward(tfl.sum(r))[q].tolist() == [Fraction(2, 3)]
    with tfl.Session(lazy=True) as s:
        x = s.input(np.array(3.0, F32), requires_grad=True)
        g = s.backward(x * x * x, create_graph=True)
        assert float(s.backward(g[x])[x]) == 18.0


def test_fused_step_refuses_a_non_finite_gradient_and_changes_nothing():
    for lazy in (False, True):
        W = tfl.Param(np.array([1.0, 0.0], F32))
        opt = tfl.Optimizer(optax.adam(0.1), [W], check_finite=True)
        state0 = opt.state
        with tfl.Session(lazy=lazy) as s:
            g = s.backward(tfl.sum(tfl.log(W)))  # d/dW log(0) = inf
            with pytest.raises(tfl.TapeError, match=r"non-finite gradient for .*; nothing was updated"):
                opt.step(g)
            assert np.isinf(np.asarray(g[W])[1])  # refused before the update: the gradients stay readable
        np.testing.assert_array_equal(np.asarray(W.value), [1.0, 0.0])
        assert opt.state is state0


def test_two_optimizers_share_one_lazy_backward():
    res = []
    for lazy in (False, True):
        a, b = tfl.Param(np.array(1.0, F32)), tfl.Param(np.array(2.0, F32))
        oa, ob = tfl.Optimizer(optax.sgd(0.5), [a]), tfl.Optimizer(optax.sgd(0.5), [b])
        with tfl.Session(lazy=lazy) as s:
            g = s.backward(a * b)
            oa.step(g)  # not all of g's groups are oa's: the gradients are computed once, then shared
            ob.step(g)
        res.append((float(a.value), float(b.value)))
    assert res[0] == res[1] == (0.0, 1.5)


def test_structure_key_is_interned_once_per_node():
    s = tfl.Session(lazy=True)
    x = s.input(np.ones(2, F32))
    y = tfl.exp(x)
    rec = s._lazy
    first = rec.structure(s._tape)
    assert len(rec.keys) == 2 and rec.structure(s._tape) == first  # (the table's epoch, then one id per node)
    z = y * 2.0
    assert len(rec.structure(s._tape)) == 1 + 4 and float(tfl.sum(z)) == pytest.approx(2 * 2 * np.e)
    assert isinstance(_lazy.LazyRecording(), _lazy.LazyRecording)


def test_a_redefined_user_op_is_not_served_by_an_old_program():
    from tapeflow._core._registry import unregister

    def run():
        with tfl.Session(lazy=True) as s:
            return float(tfl.apply("lazy_doc_scale", s.input(np.ones(2, F32))).sum())

    try:
        tfl.lift(lambda x: x * 2.0, name="lazy_doc_scale")
        assert run() == 4.0
        tfl.lift(lambda x: x * 3.0, name="lazy_doc_scale", replace=True)
        assert run() == 6.0
    finally:
        unregister("lazy_doc_scale")


def test_scalar_operands_are_arguments_and_scalar_attributes_are_keys():
    s = tfl.Session(lazy=True)
    x = np.array([0.1, 0.9], F32)

    def run(scale, lo):
        with s:
            return tfl.clamp(s.input(x) * scale, min=lo).value.tolist()

    run(2.0, 0.5)
    before = programs()
    assert run(3.0, 0.5) == pytest.approx([0.5, 2.7])  # a new operand scalar: the same program
    assert programs() == before
    assert run(3.0, 0.25) == pytest.approx([0.3, 2.7])  # a new attribute value: part of the key
    assert programs() == before + 1


def test_numpy_inputs_are_copied_kept_on_the_host_and_read_as_jax_arrays():
    """A lazy session hands a NumPy input to its programs as it is (faster than converting it when recorded)."""
    s = tfl.Session(lazy=True)
    x = np.arange(3, dtype=F32)
    h = s.input(x, requires_grad=True)
    y = tfl.sum(h * 2.0)
    x[:] = 100.0  # edits after the input was recorded do not count, as eagerly
    assert float(y) == 6.0
    assert isinstance(h.value, jax.Array) and h.value.tolist() == [0.0, 1.0, 2.0]
    assert s.backward(y)[h].tolist() == [2.0, 2.0, 2.0]
    with jax.enable_x64(False):
        s32 = tfl.Session(lazy=True)
        h64 = s32.input(np.arange(3.0))  # float64 data: JAX's dtype, as jnp.asarray gives
        assert h64.dtype == np.float32 and (h64 * 1.0).value.dtype == np.float32
        assert s32.tape[h64.id].value.dtype == np.float32 and isinstance(s32.tape[h64.id].value, jax.Array)
