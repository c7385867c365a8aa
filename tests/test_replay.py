"""Record once, replay after: a lazy session replays its last recording while the next one matches it.

The oracle for "replay changes nothing" is a normal lazy recording: a fresh
lazy session per step has no outline, so it records every op the normal way.
Over 20 steps a replaying session must equal it bit for bit. Every way a step
can differ from the last (another structure, a branch, a read, a hook, a Param
written between steps, dropout, a failure mid-step) must give the eager
session's result.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import optax
import pytest
from test_lazy import char_lm, mlp, programs, tied_autoencoder

import tapeflow as tfl
import tapeflow._core._registry
import tapeflow._shell._recorder
from tapeflow import nn
from tapeflow._core._tape import PENDING
from tapeflow._shell import _replay

F32 = np.float32


def replayed(s: tfl.Session) -> int:
    """How many nodes of the current recording matched the session's outline (0: nothing replayed).

    Reads the recording first: a lane (a replay that has built no nodes) builds them, and counts them then."""
    s.recording
    ol = s._outline
    return 0 if ol is None else ol.matched


def bn_cnn():
    k1, k2 = jax.random.split(jax.random.key(3))
    conv, bn, lin = nn.Conv2d(2, 4, 3, key=k1), nn.BatchNorm2d(4), nn.Linear(4 * 4 * 4, 3, key=k2)
    rng = np.random.default_rng(4)
    x = rng.normal(size=(5, 2, 6, 6)).astype(F32)
    y = rng.integers(0, 3, size=5).astype(np.int32)

    def loss_fn(s):
        h = tfl.relu(bn(conv(s.input(x))))
        return tfl.cross_entropy(lin(tfl.reshape(h, (5, -1))), s.input(y))

    params = {}
    for name, m in (("conv", conv), ("bn", bn), ("lin", lin)):
        params.update({f"{name}.{k}": p for k, p in m.parameter_records()})
    return {k: p for k, p in params.items() if p.trainable}, loss_fn


def _build(build):
    got = build()
    return got[0], got[1]


def _state(params):
    named = params.items() if isinstance(params, dict) else enumerate(params)
    return {k: np.asarray(p.value) for k, p in named}


def train(build, mode: str, steps: int = 20):
    """``mode``: "replay" (one lazy session), "fresh" (a new lazy session per step: never replays), "eager"."""
    params, loss_fn = _build(build)
    opt = tfl.Optimizer(optax.adam(1e-2), params)
    s = tfl.Session(lazy=mode != "eager")
    losses, matched = [], []
    for _ in range(steps):
        if mode == "fresh":
            s = tfl.Session(lazy=True)
        with s:
            loss = loss_fn(s)
            matched.append(replayed(s) == len(s.recording))
            opt.step(s.backward(loss))
            losses.append(float(loss))
    return losses, _state(params), matched


@pytest.mark.parametrize(
    "build", [mlp, tied_autoencoder, char_lm, bn_cnn], ids=["mlp", "tied_ae", "char_lm", "batchnorm_cnn"]
)
def test_replay_equals_normal_lazy_bit_for_bit_over_twenty_steps(build):
    r_losses, r_params, matched = train(build, "replay")
    f_losses, f_params, f_matched = train(build, "fresh")
    # a session notes its calls from its second recording on: every step after the second replays whole
    assert matched[:2] == [False, False] and all(matched[2:])
    assert not any(f_matched)
    assert r_losses == f_losses
    for k, v in f_params.items():
        np.testing.assert_array_equal(r_params[k], v, err_msg=str(k))


def _loop(body, lazy: bool, steps: int = 8, seed: int = 0, fresh: bool = False):
    """Run ``body(s, step, params) -> loss`` with Adam on the small MLP; (losses, params, replayed fractions).

    ``fresh``: a new session per step (it never replays), the RNG counter carried over."""
    rng = np.random.default_rng(0)
    params = [tfl.Param((rng.normal(size=(6, 5)) / 3).astype(F32), name="w"), tfl.Param(np.zeros(5, F32), name="b")]
    opt = tfl.Optimizer(optax.adam(1e-2), params)
    s = tfl.Session(lazy=lazy, seed=seed)
    losses, fractions = [], []
    for step in range(steps):
        if fresh:
            counter, s = s.rng_counter, tfl.Session(lazy=lazy, seed=seed)
            s.set_rng_state(counter=counter)
        try:
            with s:
                loss = body(s, step, params)
                fractions.append(replayed(s) / len(s.recording))
                opt.step(s.backward(loss))
                losses.append(float(loss))
        except tfl.TapeError as e:
            losses.append(str(e))
    return losses, [np.asarray(p.value) for p in params], fractions


def _assert_same(got, want) -> None:
    """Two :func:`_loop` results agree: the same errors at the same steps, losses and params to rounding."""
    (g_losses, g_params, _), (w_losses, w_params, _) = got, want
    assert [type(v) for v in g_losses] == [type(v) for v in w_losses]
    for a, b in zip(g_losses, w_losses):
        if isinstance(a, str):
            assert a == b  # the same error, at the same line
        else:
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(g_params, w_params):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


X = np.random.default_rng(1).normal(size=(4, 6)).astype(F32)


def _mlp(s, x, params, act=tfl.relu):
    w, b = params
    return tfl.mean(act(tfl.apply("linear", s.input(x), w, b)) ** 2)


def structure_change(s, step, params):
    return _mlp(s, X if step % 3 else X[:3], params)


def branch_on_alternate_steps(s, step, params):
    return _mlp(s, X, params, tfl.relu if step % 2 else tfl.tanh)


def value_read_mid_step(s, step, params):
    w, b = params
    h = tfl.apply("linear", s.input(X), w, b)
    scale = 2.0 if float(tfl.sum(h)) > 0 else 0.5  # a Python branch on a value read mid-step
    return tfl.mean(tfl.relu(h) * scale)


def hook_added(s, step, params):
    w, b = params
    h = tfl.apply("linear", s.input(X), w, b)
    if step >= 3:
        h.register_hook(lambda g: g * 3.0)
    return tfl.mean(tfl.relu(h) ** 2)


def param_written_between_steps(s, step, params):
    if step == 4:
        params[0].value = params[0].value * 0.5
    return _mlp(s, X, params)


def dropout(s, step, params):
    w, b = params
    h = tfl.dropout(tfl.apply("linear", s.input(X), w, b), 0.5, training=True)
    return tfl.mean(h**2)


def failure_mid_step(s, step, params):
    w, b = params
    h = tfl.apply("linear", s.input(X), w, b)
    if step == 3:
        tfl.apply("linear", h, w)  # (4, 5) @ (6, 5): a shape error raised at this line
    return tfl.mean(tfl.relu(h) ** 2)


def different_scalar(s, step, params):
    w, b = params
    return tfl.mean(tfl.relu(tfl.apply("linear", s.input(X), w, b)) * (1.0 if step % 2 else -0.0) + 0.0 * step)


FALLBACKS = [
    structure_change,
    branch_on_alternate_steps,
    value_read_mid_step,
    hook_added,
    param_written_between_steps,
    dropout,
    failure_mid_step,
    different_scalar,
]


@pytest.mark.parametrize("body", FALLBACKS, ids=[f.__name__ for f in FALLBACKS])
def test_every_fallback_gives_the_eager_result(body):
    lazy = _loop(body, lazy=True)
    _assert_same(lazy, _loop(body, lazy=False))
    assert max(lazy[2]) > 0  # the lazy loop did replay where the steps matched


def test_replay_skips_the_op_check_only_where_the_call_matches():
    w = tfl.Param(np.ones((3, 2), F32), name="w")
    s = tfl.Session(lazy=True)
    for x in (np.ones((4, 3), F32), np.ones((4, 3), F32), np.ones((4, 2), F32)):
        with s:
            try:
                y = s.input(x) @ w
            except tfl.TapeError as e:
                assert "matmul" in str(e) and len(s.recording) == 1  # the eager message; nothing recorded
                continue
            assert y.shape == (4, 2) and float(tfl.sum(y)) == 24.0


def test_a_redefined_op_is_not_replayed_with_its_old_definition():
    from tapeflow._core._registry import unregister

    s = tfl.Session(lazy=True)

    def run():
        with s:
            y = tfl.sum(tfl.apply("replay_scale", s.input(np.ones(2, F32))))
            return float(y), replayed(s) == len(s.recording)

    try:
        tfl.lift(lambda x: x * 2.0, name="replay_scale")
        assert run() == (4.0, False)
        assert run() == (4.0, False)  # the session notes its calls from its second recording on
        assert run() == (4.0, True)
        tfl.lift(lambda x: x * 3.0, name="replay_scale", replace=True)
        assert run() == (6.0, False)
        assert run() == (6.0, True)
    finally:
        unregister("replay_scale")


def test_grad_mode_and_trainable_flags_are_part_of_the_match():
    w = tfl.Param(np.ones(3, F32), name="w")
    s = tfl.Session(lazy=True)
    for k in range(3):  # armed: the third recording replays the second
        with s:
            assert s.backward(tfl.sum(s.input(np.ones(3, F32)) * w))[w].tolist() == [1.0, 1.0, 1.0]
            assert (replayed(s) == len(s.recording)) == (k == 2)
    with s:
        with s.no_grad():
            y = tfl.sum(s.input(np.ones(3, F32)) * w)
        assert not y.requires_grad
    w.trainable = False
    with s:
        y = tfl.sum(s.input(np.ones(3, F32)) * w)
        assert not y.requires_grad
    w.trainable = True
    for k in range(2):  # the first step after the change records anew, the next one replays it
        with s:
            y = tfl.sum(s.input(np.ones(3, F32)) * w)
            assert y.requires_grad and (replayed(s) == len(s.recording)) == bool(k)


def test_the_match_written_out_for_an_event_answers_as_the_generic_one():
    """An event that replayed once matches by code generated for it: every difference must still be one."""
    w, b, other = (tfl.Param(np.ones(s, F32), name=n) for n, s in (("w", (3, 2)), ("b", (2,)), ("o", (3, 2))))
    s = tfl.Session(lazy=True)

    def forward():
        h = tfl.apply("linear", s.input(np.ones((4, 3), F32)), w, b)
        return tfl.sum(h * 0.0)

    for _ in range(3):  # the third recording replays the second: each of its events has its code now
        with s:
            s.recording  # no lane: this test is about the node-by-node replay
            forward()
    events = s._outline.events
    lin, mul = (events[i] for i in sorted(events)[:2])
    assert lin._fast is not None and mul._fast is not None
    with s:
        x = s.input(np.ones((4, 3), F32))
        h = tfl.apply("linear", x, w, b)  # node 3, as recorded
        x2 = s.input(np.ones((4, 3), F32))  # another handle: node 4, where the event saw node 0
        dev = s.device
        calls = [
            (lin, ("linear", (x, w, b), {}, True, dev)),  # the recorded call
            (lin, ("linear", (x2, w, b), {}, True, dev)),
            (lin, ("linear", (x, other, b), {}, True, dev)),
            (lin, ("linear", (x, w, b, b), {}, True, dev)),
            (lin, ("linear", (x, w, 1.0), {}, True, dev)),
            (lin, ("matmul", (x, w, b), {}, True, dev)),
            (lin, ("linear", (x, w, b), {}, False, dev)),  # recorded with gradients, asked without
            (lin, ("linear", (x, w, b), {"axis": 1}, True, dev)),
            (mul, ("mul", (h, 0.0), {}, True, dev)),
            (mul, ("mul", (h, -0.0), {}, True, dev)),  # -0.0 == 0.0 but is another constant
            (mul, ("mul", (h, 0), {}, True, dev)),
            (mul, ("mul", (h, False), {}, True, dev)),
            (mul, ("mul", (x, 0.0), {}, True, dev)),
        ]
        matched = [_same_answer(ev, args) for ev, args in calls]
        assert matched == [True] + [False] * 7 + [True] + [False] * 4
        w.trainable = False  # the Param of the event, now frozen
        assert not _same_answer(lin, calls[0][1])
    w.trainable = True


def _same_answer(ev, args) -> bool:
    """Whether ``ev`` matches the call ``args`` (its attributes as given); its generic and generated matches must
    agree, nodes included. The generic match and the node-by-node replay take the attributes keyed, a lane's match
    takes them as the call gave them."""
    opname, operands, attrs, *rest = args
    keyed = (opname, operands, tapeflow._core._registry.attr_key(attrs.items()) if attrs else (), *rest)
    generic, written = ev.match(*keyed), ev._fast(*keyed)
    assert (generic is None) == (written is None), args[:2]
    vals: list = []
    assert ev.lane(*args, vals) == (generic is not None)  # a lane's match: the same answer
    if generic is None:
        return False
    assert len(vals) == sum(n.op is None for n in generic[0])  # and a value per leaf
    (gn, gp), (wn, wp) = generic, written
    assert gp == wp
    static = [(n.op, n.attrs, n.parents, n.requires_grad, n.spec, n.opdef) for n in gn]
    assert static == [(n.op, n.attrs, n.parents, n.requires_grad, n.spec, n.opdef) for n in wn]
    assert all(a.value is c.value for a, c in zip(gn, wn) if a.op is None)  # each use reads the storage
    return True


def test_each_param_use_reads_its_storage_when_replayed():
    w = tfl.Param(np.ones(2, F32), name="w")
    s = tfl.Session(lazy=True)
    for k in range(3):
        with s:
            a = tfl.sum(w * 1.0)
            w.value = np.full(2, 10.0, F32)  # written after its first use, before the second
            b = tfl.sum(w * 1.0)
            assert replayed(s) == (len(s.recording) if k >= 2 else 0)
            assert (float(a), float(b)) == (2.0, 20.0)
        w.value = np.ones(2, F32)


def test_stale_and_foreign_handles_are_refused_when_the_call_would_replay():
    s, other = tfl.Session(lazy=True), tfl.Session(lazy=True)
    with s:
        x = s.input(np.ones(2, F32))
        tfl.exp(x)
    with pytest.raises(tfl.TapeError, match="stale"):
        tfl.exp(x)  # the same node id as the recorded call, but from the last generation
    with s:
        s.input(np.ones(2, F32))
        with pytest.raises(tfl.TapeError):
            s.apply("exp", other.input(np.ones(2, F32)))


def test_a_hundred_replayed_steps_compile_one_program_and_live_arrays_stay_flat():
    params, loss_fn = mlp()
    opt = tfl.Optimizer(optax.adam(1e-3), params)
    s = tfl.Session(lazy=True)
    before = programs()
    for _ in range(100):
        with s:
            opt.step(s.backward(loss_fn(s)))
            assert replayed(s) in (0, len(s.recording))
    assert programs() - before == 1
    live0 = len(jax.live_arrays())
    for _ in range(1000):
        with s:
            opt.step(s.backward(loss_fn(s)))
    assert replayed(s) == 0 and len(jax.live_arrays()) <= live0 + 2


def test_an_inference_loop_replays_from_a_forward_only_recording():
    params, loss_fn = mlp()
    s = tfl.Session(lazy=True, grad_enabled=False)
    values = []
    for k in range(4):
        with s:
            loss = loss_fn(s)
            if k >= 2:
                assert replayed(s) == len(s.recording)
            values.append(float(loss))
    assert len(set(values)) == 1


# -- lanes: a replay that builds no nodes until something reads the recording ----------------------------------


def train_on_lanes(build, fresh: bool, read_loss: bool, steps: int = 20):
    """The plain loop, reading nothing mid-step (``read_loss``: the loss after each step); losses and params."""
    params, loss_fn = _build(build)
    opt = tfl.Optimizer(optax.adam(1e-2), params)
    s = tfl.Session(lazy=True)
    losses = []
    for _ in range(steps):
        if fresh:
            s = tfl.Session(lazy=True)
        with s:
            loss = loss_fn(s)
            opt.step(s.backward(loss))
            if read_loss:
                losses.append(float(loss))
    return losses, _state(params)


def char_lm_on_device():
    """The char LM of test_lazy with its ids given as ``jax.Array`` s to ``take`` (as arrays, not handles)."""
    from char_lm import CharLM

    model = CharLM(11, 8, 16, 2, 1, key=jax.random.key(0))
    rng = np.random.default_rng(2)
    ids = jax.numpy.asarray(rng.integers(0, 11, size=(4, 8)).astype(np.int32))
    targets = rng.integers(0, 11, size=(4, 8)).astype(np.int32)

    def loss_fn(s):
        return tfl.apply("cross_entropy", model(ids), s.input(targets))

    return dict(model.parameter_records()), loss_fn


@pytest.mark.parametrize(
    "build",
    [mlp, tied_autoencoder, char_lm, char_lm_on_device, bn_cnn],
    ids=["mlp", "tied_ae", "char_lm", "char_lm_device_ids", "batchnorm_cnn"],
)
@pytest.mark.parametrize("read_loss", [False, True], ids=["unread", "loss_read"])
def test_a_loop_on_lanes_equals_normal_lazy_bit_for_bit(build, read_loss, lane_counts):
    f_losses, f_params = train_on_lanes(build, fresh=True, read_loss=read_loss)
    assert lane_counts == {"backward": 0, "built": 0}  # a session used once never replays
    r_losses, r_params = train_on_lanes(build, fresh=False, read_loss=read_loss)
    assert r_losses == f_losses
    for k, v in f_params.items():
        np.testing.assert_array_equal(r_params[k], v, err_msg=str(k))
    if build is bn_cnn:  # BatchNorm writes its running statistics mid-forward: the lane builds its nodes there
        assert lane_counts["backward"] == 0 and lane_counts["built"] == 18
    else:
        # steps 3..20 replay on lanes; step 3's backward (the outline's first whole replay) builds the nodes and
        # plans, steps 4..20 run on values alone; the loss the step computed is read without building them
        assert lane_counts == {"backward": 17, "built": 1}


def test_the_loss_a_fused_step_computed_is_read_without_another_program(lane_counts):
    params, loss_fn = mlp()
    opt = tfl.Optimizer(optax.adam(1e-3), params)
    s = tfl.Session(lazy=True)
    for _ in range(4):  # from the fourth step on, the whole step runs on a lane
        with s:
            opt.step(s.backward(loss_fn(s)))
    with tfl.Session() as e:  # the eager value of the next step's loss
        expected = float(loss_fn(e))
    lane_counts.update(backward=0, built=0)
    before = programs()
    with s:
        loss = loss_fn(s)
        opt.step(s.backward(loss))
        value = float(loss)  # the step's root value, read from the lane
        assert lane_counts == {"backward": 1, "built": 0}
        assert s.recording[loss.id].value is not PENDING  # and kept for the node once built
        assert float(loss) == value and lane_counts["built"] == 1
    assert programs() == before  # no forward program: the value was kept
    assert value == pytest.approx(expected, rel=1e-6)


def test_gradients_of_a_lane_are_read_and_kept_past_the_reset(lane_counts):
    w = tfl.Param(np.arange(6, dtype=F32).reshape(3, 2) / 5, name="w")
    x = np.random.default_rng(2).normal(size=(4, 3)).astype(F32)

    def loss_fn(s):
        return tfl.sum(tfl.tanh(s.input(x) @ w) ** 2)

    oracle = jax.grad(lambda v: jax.numpy.sum(jax.numpy.tanh(x @ v) ** 2))(w.value)
    s = tfl.Session(lazy=True)
    for _ in range(3):  # the third backward plans the outline; the fourth runs on a lane
        with s:
            s.backward(loss_fn(s))
    with s:
        g = s.backward(loss_fn(s))
        np.testing.assert_allclose(g[w], oracle, rtol=1e-6)  # read in the step
    with s:
        kept = s.backward(loss_fn(s))
    np.testing.assert_allclose(kept[w], oracle, rtol=1e-6)  # read after the recording was reset
    assert lane_counts["backward"] == 2


def test_a_lane_refuses_stale_and_foreign_handles_and_names_the_last_recording_session():
    s, other = tfl.Session(lazy=True), tfl.Session(lazy=True)
    w = tfl.Param(np.ones(2, F32), name="w")
    for _ in range(3):
        with s:
            h = tfl.exp(s.input(np.ones(2, F32)) * w)
    with s:
        x = s.input(np.ones(2, F32))
        with pytest.raises(tfl.TapeError, match="stale"):
            tfl.exp(h * w)  # the handle of the last generation, where the outline has node 2
        other.input(np.ones(2, F32))
        assert tfl.last_recorded_session() is other
        y = tfl.exp(x * w)  # the outline's call again, on the lane
        assert tfl.last_recorded_session() is s
        assert float(tfl.sum(y)) == pytest.approx(2 * np.e)


@pytest.mark.parametrize("body", FALLBACKS, ids=[f.__name__ for f in FALLBACKS])
def test_every_fallback_from_a_lane_gives_the_eager_result(body):
    """As test_every_fallback_gives_the_eager_result, with nothing read mid-step (each step starts on a lane)."""

    def loop(lazy):
        rng = np.random.default_rng(0)
        params = [tfl.Param((rng.normal(size=(6, 5)) / 3).astype(F32), name="w"), tfl.Param(np.zeros(5, F32))]
        opt = tfl.Optimizer(optax.adam(1e-2), params)
        s = tfl.Session(lazy=lazy, seed=0)
        losses = []
        for step in range(8):
            try:
                with s:
                    loss = body(s, step, params)
                    opt.step(s.backward(loss))
                    losses.append(float(loss))
            except tfl.TapeError as e:
                losses.append(str(e))
        return losses, [np.asarray(p.value) for p in params]

    e_losses, e_params = loop(False)
    l_losses, l_params = loop(True)
    assert [type(v) for v in l_losses] == [type(v) for v in e_losses]
    for a, b in zip(l_losses, e_losses):
        if isinstance(a, str):
            assert a == b
        else:
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(l_params, e_params):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "node_by_node"])
def test_host_ids_of_a_replayed_call_are_checked_and_copied_as_recorded(lane):
    table = tfl.Param(np.arange(12, dtype=F32).reshape(6, 2), name="table")
    s = tfl.Session(lazy=True)
    ids = np.array([0, 5, 2], np.int32)
    for _ in range(3):
        with s:
            tfl.sum(tfl.numpy.take(table, ids, axis=0))
    with s:
        if not lane:
            s.recording  # builds the (empty) lane: the calls replay node by node
        bad = np.array([0, 6, 2], np.int32)
        with pytest.raises(tfl.TapeError) as got:
            tfl.numpy.take(table, bad, axis=0)
        assert len(s.recording) == 0  # nothing was recorded
    with tfl.Session(), pytest.raises(tfl.TapeError) as eager:
        tfl.numpy.take(table, bad, axis=0)
    assert str(got.value) == str(eager.value) and "holds 6, out of range" in str(got.value)
    with s:
        if not lane:
            s.recording
        mine = ids.copy()
        y = tfl.sum(tfl.numpy.take(table, mine, axis=0))
        mine[:] = 1  # the call copied the ids: a later edit changes nothing recorded
        assert float(y) == float(np.sum(np.arange(12).reshape(6, 2)[[0, 5, 2]]))


@pytest.mark.parametrize("mode", ["lane", "node_by_node", "eager"])
def test_a_replayed_host_operand_with_the_same_values_reuses_its_leaf_value(mode, monkeypatch):
    """Positions given as ``np.arange(n)`` every step are converted, checked and placed once; an edit in place,
    new values of the same shape (out of range included) and an array past the memo's size convert again."""
    table = tfl.Param(np.arange(12, dtype=F32).reshape(6, 2), name="table")
    s = tfl.Session(lazy=mode != "eager")
    expected = np.arange(12, dtype=F32).reshape(6, 2)

    def step(ids):
        with s:
            if mode == "node_by_node":
                s.recording  # builds the (empty) lane: the calls replay node by node
            y = tfl.numpy.take(table, ids, axis=0)
            total = float(tfl.sum(y))
            rec = s.recording
            return total, rec[rec[y.id].parents[1]].value  # the ids' leaf

    ids = np.array([0, 5, 2], np.int32)
    values = [step(np.array([0, 5, 2], np.int32)) for _ in range(4)]  # a new array of the same values each step
    assert all(t == float(expected[[0, 5, 2]].sum()) for t, _ in values)
    assert values[3][1] is values[2][1]  # replayed: the leaf value made by the last call
    total, v = step(ids)
    assert v is values[3][1]
    ids[1] = 4  # edited in place: converted again
    total, v = step(ids)
    assert total == float(expected[[0, 4, 2]].sum()) and v is not values[3][1]
    with pytest.raises(tfl.TapeError, match="holds 6, out of range"):
        step(np.array([0, 6, 2], np.int32))
    assert step(np.array([0, 4, 2], np.int32))[0] == float(expected[[0, 4, 2]].sum())
    _, v = step(np.array([0, 4, 2], np.int32))
    v.delete()  # a value someone deleted is never handed out again
    assert step(np.array([0, 4, 2], np.int32))[0] == float(expected[[0, 4, 2]].sum())
    monkeypatch.setattr(tapeflow._shell._recorder, "_HOST_MEMO_SIZE", 2)  # past the memo's size: never reused
    for _ in range(2):
        a = step(np.array([1, 1, 1], np.int32))
    b = step(np.array([1, 1, 1], np.int32))
    assert a[0] == b[0] == float(expected[[1, 1, 1]].sum()) and a[1] is not b[1]


def test_two_sessions_on_lanes_interleaved_op_by_op_equal_each_alone(lane_counts):
    def model(seed):
        rng = np.random.default_rng(seed)
        w = tfl.Param((rng.normal(size=(6, 5)) / 3).astype(F32), name="w")
        return w, tfl.Optimizer(optax.adam(1e-2), [w])

    def steps(interleaved):
        (wa, oa), (wb, ob) = model(0), model(1)
        a, b = tfl.Session(lazy=True), tfl.Session(lazy=True)
        for _ in range(6):
            with a, b:
                if interleaved:  # each op of one session between two of the other
                    ha, hb = s_in(a), s_in(b)
                    ha, hb = tfl.tanh(ha @ wa), tfl.tanh(hb @ wb)
                    la, lb = tfl.sum(ha * ha), tfl.sum(hb * hb)
                else:
                    ha = tfl.tanh(s_in(a) @ wa)
                    la = tfl.sum(ha * ha)
                    hb = tfl.tanh(s_in(b) @ wb)
                    lb = tfl.sum(hb * hb)
                with a.no_grad():  # a no-grad block on a lane: part of the match, its op records no gradient
                    probe = tfl.sum(s_in(a) @ wa)
                assert not probe.requires_grad
                oa.step(a.backward(la))
                ob.step(b.backward(lb))
        return np.asarray(wa.value), np.asarray(wb.value)

    def s_in(s):
        return s.input(X)

    alone, mixed = steps(False), steps(True)
    for x, y in zip(alone, mixed):
        np.testing.assert_array_equal(x, y)
    assert lane_counts["backward"] > 0  # the steps after the first three ran on lanes


# --------------------------------------------------------------------------- eager sessions replay too
#
# An eager session matches each call against its last recording as a lazy one does, and on a match runs the op's
# kernel at once, at its line: every value is there as in the normal path, and its compiled backward reuses the
# outline's structure. The oracle is a fresh eager session per step, which never replays.


@pytest.mark.parametrize("build", [mlp, tied_autoencoder, char_lm], ids=["mlp", "tied_ae", "char_lm"])
def test_an_eager_replay_computes_every_value_at_its_line_bit_for_bit(build):
    _, loss_fn = _build(build)
    s = tfl.Session(lazy=False)
    for step in range(5):
        with s:
            loss = loss_fn(s)
            assert float(loss) == float(loss)  # the value is there at its line
            got = [np.asarray(nd.value) for nd in s.recording.nodes]
            assert (replayed(s) == len(s.recording)) == (step >= 2)
        with tfl.Session(lazy=False) as f:
            loss_fn(f)
            want = [np.asarray(nd.value) for nd in f.recording.nodes]
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(got, want)):
            np.testing.assert_array_equal(a, b, err_msg=f"step {step}, node {i}")


@pytest.mark.parametrize("body", FALLBACKS, ids=[f.__name__ for f in FALLBACKS])
def test_every_fallback_of_an_eager_replay_gives_the_normal_eager_result(body):
    eager = _loop(body, lazy=False)
    fresh = _loop(body, lazy=False, fresh=True)
    _assert_same(eager, fresh)
    assert max(eager[2]) > 0 and max(fresh[2]) == 0  # the eager loop did replay where the steps matched


def test_a_kernel_failing_on_an_eager_replay_raises_as_the_normal_path_and_records_nothing(monkeypatch):
    from tapeflow._core._tape import kernel_failed

    w = tfl.Param(np.ones((3, 2), F32), name="w")
    x = np.ones((4, 3), F32)
    s = tfl.Session(lazy=False)
    for _ in range(2):
        with s:
            tfl.relu(s.input(x) @ w)
    ev = next(e for e in s._outline.events.values() if e.opname == "relu")

    def boom(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(ev, "kernel", boom)
    with s:
        h = s.input(x) @ w
        before = s.recording
        with pytest.raises(tfl.TapeError) as err:
            tfl.relu(h)
        assert str(err.value) == kernel_failed("relu", [before[h.id]], RuntimeError("boom"))
        assert s.recording is before  # nothing was recorded
        np.testing.assert_allclose(tfl.tanh(h).value, np.tanh(x @ np.ones((3, 2), F32)), rtol=1e-6)


_NAN = float("nan")  # one NaN object: a key holding it equals itself (a tuple compares identity first)
_ATTRS = [
    {}, {"a": 1}, {"a": True}, {"a": 1.0}, {"a": np.int64(1)}, {"a": 0.0}, {"a": -0.0}, {"a": np.float64(0.0)},
    {"a": None}, {"b": None}, {"a": 1.5, "b": "mean"}, {"b": "mean", "a": 1.5}, {"a": 1.5, "b": "sum"},
    {"a": 1, "b": 2}, {"a": (1, 2)}, {"a": (True, 2)}, {"a": (1.0, 2)}, {"a": (1, 2.0)}, {"a": ()}, {"a": ((1,), 2)},
    {"a": ((1.0,), 2)}, {"a": (0.0, 2.0)}, {"a": (-0.0, 2.0)}, {"a": ("x", None)}, {"a": [1, 2]}, {"a": _NAN},
    {"a": float("nan")},
]  # fmt: skip


@pytest.mark.parametrize("recorded", [a for a in _ATTRS if not any(type(v) is list for v in a.values())], ids=repr)
def test_a_lanes_written_out_attribute_test_answers_as_the_attribute_key(recorded):
    """A lane compares a call's attributes as given with the event's key by code written for that key: it must
    answer as comparing the keys does (typed: 1, 1.0, True and np.int64(1) differ; -0.0 is not 0.0, in a tuple
    too; a NaN equals only itself, as a key's tuple compares it)."""
    key = tapeflow._core._registry.attr_key(recorded.items())
    ns = {"ATTRS": key, "MISSING": object(), "copysign": math.copysign, "other_attrs": _replay._other_attrs}
    differs = eval(f"lambda attrs: bool({_replay._attr_tests(key, ns)})", ns)
    for call in _ATTRS:
        assert differs(call) == (tapeflow._core._registry.attr_key(call.items()) != key), call


def test_a_replayed_call_with_equal_attributes_of_another_type_records_them_as_given():
    """clamp(lo=-0.0) after steps of clamp(lo=0.0): equal attributes, but another key, so the lane does not match
    and the op records -0.0 (whose sign the result shows), as a session that never saw lo=0.0 does."""
    s = tfl.Session(lazy=True)
    x = np.array([-1.0, 2.0], F32)
    for lo in (0.0, 0.0, 0.0, -0.0, 0, 0.0):
        with s:
            y = tfl.apply("clamp", s.input(x), lo=lo)
            got = np.asarray(y.value)
            with tfl.Session(lazy=True) as fresh:
                want = np.asarray(tfl.apply("clamp", fresh.input(x), lo=lo).value)
            np.testing.assert_array_equal(got, want)
            assert np.signbit(got[0]) == np.signbit(want[0]) == (type(lo) is float and math.copysign(1.0, lo) < 0)
