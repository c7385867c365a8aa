"""Parameter groups, gradient summation per storage and `tfl.Optimizer` over optax.

The oracles here are independent of tapeflow's own summation/optimizer code:
hand-summed gradients on an untied copy of the model, plain ``jax.grad`` +
optax on a pure function of one weight, and closed-form SGD updates.
"""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tapeflow as tfl

pytestmark = pytest.mark.usefixtures("lazy_mode")  # every test runs with eager and with lazy sessions

F32 = np.float32
D, H, B = 6, 4, 5


# --------------------------------------------------------------------------- helpers


def _batches(n: int, dtype=F32, batch: int = B, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(batch, D)).astype(dtype) for _ in range(n)]


def _init_weights(dtype=F32, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (0.4 * rng.normal(size=(D, H))).astype(dtype), (0.1 * rng.normal(size=(H,))).astype(dtype)


def _tied_loss(s: tfl.Session, x: np.ndarray, enc, dec, c=None):
    """h = tanh(x @ enc [+ c]); y = h @ dec.T; mean squared reconstruction error."""
    xt = s.input(jnp.asarray(x))
    z = xt @ enc
    if c is not None:
        z = z + c
    h = tfl.tanh(z)
    y = h @ dec.T
    return tfl.mean((y - xt) ** 2)


def _jax_loss(p: dict, x) -> jax.Array:
    h = jnp.tanh(x @ p["W"] + p["c"])
    y = h @ p["W"].T
    return jnp.mean((y - x) ** 2)


def _snapshot(opt: tfl.Optimizer, params) -> tuple[list[np.ndarray], list[np.ndarray]]:
    vals = [np.array(p.value, copy=True) for p in params]
    state = [np.array(leaf, copy=True) for leaf in jax.tree_util.tree_leaves(opt.state)]
    return vals, state


def _assert_snapshot_equal(a, b) -> None:
    (va, sa), (vb, sb) = a, b
    assert len(va) == len(vb) and len(sa) == len(sb)
    for x, y in zip(va + sa, vb + sb):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert np.array_equal(x, y, equal_nan=True)


def _raising_tx() -> optax.GradientTransformation:
    def init(params):
        return optax.EmptyState()

    def update(updates, state, params=None):
        raise RuntimeError("update exploded")

    return optax.GradientTransformation(init, update)


def _mu(state):
    """The ScaleByAdamState inside a (possibly chained) optax state."""
    for node in jax.tree_util.tree_leaves(state, is_leaf=lambda n: isinstance(n, optax.ScaleByAdamState)):
        if isinstance(node, optax.ScaleByAdamState):
            return node
    raise AssertionError("no adam state")


# --------------------------------------------------------------------------- parameter groups


def test_parameter_groups_by_storage_identity_in_recording_order():
    W = tfl.Param(jnp.ones((3, 2), F32), name="W")
    W_tied = tfl.tie(W, name="W_tied")
    V = tfl.Param(jnp.ones((3, 2), F32), name="V")  # equal value, distinct storage
    frozen = tfl.Param(jnp.ones((3, 2), F32), name="frozen", trainable=False)
    W_frozen_use = tfl.tie(W, name="W_frozen", trainable=False)
    with tfl.Session() as s:
        a = s.use(W)
        f = s.use(frozen)
        b = s.use(V)
        c = s.use(W_tied)
        d = s.use(W_frozen_use)
        e = s.use(W)
        groups = s.parameter_groups()
    assert all(isinstance(g, tfl.ParameterGroup) for g in groups)
    assert [g.id for g in groups] == [a.id, b.id]
    gw, gv = groups
    assert gw.leaves == (a.id, c.id, e.id) and gw.parameter is W and gw.storage is W.storage and gw.shared
    assert gv.leaves == (b.id,) and gv.parameter is V and gv.storage is V.storage and not gv.shared
    assert f.id not in gw.leaves + gv.leaves and d.id not in gw.leaves + gv.leaves


def test_parameter_groups_do_not_read_tensor_data(monkeypatch):
    W = tfl.Param(jnp.ones((3, 2), F32), name="W")
    with tfl.Session() as s:
        s.use(W), s.use(tfl.tie(W)), s.use(W)

        def boom(*a, **k):
            raise AssertionError("grouping read parameter data")

        monkeypatch.setattr(tfl.Storage, "read_host", boom)
        monkeypatch.setattr(tfl.Storage, "read", boom)
        monkeypatch.setattr(tfl.Param, "__array__", boom)
        (g,) = s.parameter_groups()
        monkeypatch.undo()
    assert len(g.leaves) == 3


def test_registration_without_descriptor_is_its_own_group_and_bad_descriptor_rejected():
    W = tfl.Param(jnp.ones((3, 2), F32), name="W")
    with tfl.Session() as s:
        a = s.use(W)
        h = s.input(jnp.ones((3, 2), F32), requires_grad=True)
        s.register_parameter_leaf(h, W, storage=None)
        k = s.input(jnp.ones((3, 2), F32), requires_grad=True)
        s.register_parameter_leaf(k, "custom", storage=W.storage)
        before = s.parameter_groups()
        m = s.input(jnp.ones((3, 2), F32), requires_grad=True)
        with pytest.raises(tfl.TapeError, match="shape and dtype"):
            s.register_parameter_leaf(m, W, storage=tfl.Storage(jnp.ones((2, 3), F32)))
        with pytest.raises(tfl.TapeError):
            s.register_parameter_leaf(m, W, storage=tfl.Storage(jnp.ones((3, 2), np.float64)))
        after = s.parameter_groups()
    assert before == after
    assert [(g.leaves, g.storage) for g in after] == [((a.id, k.id), W.storage), ((h.id,), None)]


def test_singleton_group_gradient_is_handed_through_unchanged():
    W = tfl.Param(jnp.arange(6.0, dtype=F32).reshape(3, 2), name="W")
    with tfl.Session() as s:
        x = s.input(jnp.ones((4, 3), F32))
        w_leaf = s.use(W)
        g = s.backward(tfl.sum(tfl.tanh(x @ w_leaf)))
        assert g[W] is g.by_leaf[w_leaf.id]
        assert g.group_gradient(g.groups[0]) is g.by_leaf[w_leaf.id]


def test_shared_group_sums_cotangents_in_leaf_order():
    # float32 cotangents 1e8, -1e8, 1: ((1e8 + -1e8) + 1) == 1, while any other
    # association, e.g. (1 + -1e8) + 1e8 or 1e8 + (-1e8 + 1), rounds to 0.
    w = tfl.Param(jnp.array(1.0, F32), name="w")
    with tfl.Session() as s:
        loss = w * 1e8 + tfl.tie(w) * -1e8 + w * 1.0
        g = s.backward(loss)
        (grp,) = g.groups
        parts = [np.asarray(g.by_leaf[i]) for i in grp.leaves]
        assert [float(p) for p in parts] == [1e8, -1e8, 1.0]
        assert float(g[w]) == 1.0
        assert float((parts[2] + parts[1]) + parts[0]) == 0.0  # the oracle can tell orders apart
    opt = tfl.Optimizer(optax.sgd(1.0), [w])
    with tfl.Session() as s:
        opt.step(s.backward(w * 1e8 + tfl.tie(w) * -1e8 + w * 1.0))
    assert float(w.value) == 0.0


def test_sgd_two_uses_of_one_parameter():
    w = tfl.Param(jnp.array(1.0, F32), name="w")
    opt = tfl.Optimizer(optax.sgd(1.0), [w])
    with tfl.Session() as s:
        opt.step(s.backward(w * 1.0 + w * 0.25))
    assert float(w.value) == -0.25


# --------------------------------------------------------------------------- optimizer state layout


def test_state_has_one_slot_per_storage_in_first_registration_order():
    W0, c0 = _init_weights()
    W = tfl.Param(W0, name="W")
    c = tfl.Param(c0, name="c")
    Wt = tfl.tie(W, name="W_tied")
    V = tfl.Param(np.zeros((2,), F32), name="V")
    opt = tfl.Optimizer(optax.adam(1e-2), [W, c, Wt, V, c])
    assert opt.storages == [W.storage, c.storage, V.storage]
    assert [p is q for p, q in zip(opt.params, [W, c, V])] == [True] * 3
    assert opt.alias_layout == [0, 1, 0, 3, 1]
    mu = _mu(opt.state).mu
    assert isinstance(mu, list) and [m.shape for m in mu] == [(D, H), (H,), (2,)]

    opt_d = tfl.Optimizer(optax.adam(1e-2), {"W": W, "c": c, "W_tied": Wt})
    mu_d = _mu(opt_d.state).mu
    assert set(mu_d) == {"W", "c"}
    assert opt_d.storages == [W.storage, c.storage] and [p.name for p in opt_d.params] == ["W", "c"]
    assert isinstance(opt_d.param_tree(), dict) and set(opt_d.param_tree()) == {"W", "c"}


# --------------------------------------------------------------------------- tied == untied + hand-summed grads


def _tx(name: str) -> optax.GradientTransformation:
    return {
        "sgd": lambda: optax.sgd(0.05),
        "momentum": lambda: optax.sgd(0.05, momentum=0.9),
        "adam": lambda: optax.adam(1e-2),
        "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    }[name]()


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adamw"])
def test_tied_trajectory_bit_identical_to_untied_with_hand_summed_grads(name, lazy_mode):
    """Bit for bit op by op (an identity hook on the loss keeps an eager backward op by op); lazily the
    tied step is one fused XLA program (it may round the fused sum and update differently from the
    hand-summed path), so equal to float32 precision."""
    W0, _ = _init_weights()
    xs = _batches(20)

    W = tfl.Param(W0.copy(), name="W")
    W_tied = tfl.tie(W, name="W_tied")
    opt = tfl.Optimizer(_tx(name), [W, W_tied])

    a = tfl.Param(W0.copy(), name="a")
    b = tfl.Param(W0.copy(), name="b")
    opt2 = tfl.Optimizer(_tx(name), [a, b])

    for x in xs:
        with tfl.Session() as s:
            loss1 = _tied_loss(s, x, W, W_tied)
            if not lazy_mode:
                loss1.register_hook(lambda g: g)
            opt.step(s.backward(loss1))
        with tfl.Session() as s:
            loss2 = _tied_loss(s, x, a, b)
            if not lazy_mode:
                loss2.register_hook(lambda g: g)
            g = s.backward(loss2)
            opt2.step({a: g[a] + g[b]})
            g.release()
        b.value = jnp.array(a.value, copy=True)
        if lazy_mode:
            np.testing.assert_allclose(np.asarray(W.value), np.asarray(a.value), rtol=1e-6, atol=1e-7)
            a.value = b.value = jnp.array(W.value, copy=True)  # continue from the same point
        else:
            assert np.array_equal(np.asarray(W.value), np.asarray(a.value)), "trajectories diverged"
    assert not np.array_equal(np.asarray(W.value), W0)
    assert W.value.dtype == F32


# --------------------------------------------------------------------------- against plain JAX + optax


def _txs_for_jax() -> dict:
    return {
        "sgd": lambda: optax.sgd(0.05),
        "momentum": lambda: optax.sgd(0.05, momentum=0.9),
        "adam": lambda: optax.adam(1e-2),
        "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
        "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2, weight_decay=0.1)),
        "multi_transform": lambda: optax.multi_transform(
            {"fast": optax.adam(1e-2), "slow": optax.sgd(0.01, momentum=0.5)}, {"W": "fast", "c": "slow"}
        ),
        "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=3),
        "inject": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
    }


@pytest.mark.parametrize("name", list(_txs_for_jax()))
def test_tied_model_matches_plain_jax_and_optax(name):
    W0, c0 = _init_weights()
    xs = _batches(20, seed=3)

    W = tfl.Param(W0.copy(), name="W")
    c = tfl.Param(c0.copy(), name="c")
    W_tied = tfl.tie(W, name="W_tied")
    opt = tfl.Optimizer(_txs_for_jax()[name](), {"W": W, "c": c, "W_tied": W_tied})

    tx = _txs_for_jax()[name]()
    p = {"W": jnp.asarray(W0), "c": jnp.asarray(c0)}
    st = tx.init(p)
    grad = jax.grad(_jax_loss)
    update = jax.jit(tx.update)  # unjitted MultiSteps dispatches op by op: slow, same maths

    for x in xs:
        with tfl.Session() as s:
            opt.step(s.backward(_tied_loss(s, x, W, W_tied, c)))
        u, st = update(grad(p, jnp.asarray(x)), st, p)
        p = optax.apply_updates(p, u)
        np.testing.assert_allclose(np.asarray(W.value), np.asarray(p["W"]), rtol=0, atol=1e-6)
        np.testing.assert_allclose(np.asarray(c.value), np.asarray(p["c"]), rtol=0, atol=1e-6)
    assert not np.allclose(np.asarray(W.value), W0, atol=1e-3)
    assert W.value.dtype == F32 and c.value.dtype == F32
    # the optax state is a plain pytree with the same structure as optax's own
    assert jax.tree_util.tree_structure(opt.state) == jax.tree_util.tree_structure(st)
    for mine, ref in zip(jax.tree_util.tree_leaves(opt.state), jax.tree_util.tree_leaves(st)):
        np.testing.assert_allclose(np.asarray(mine), np.asarray(ref), rtol=1e-4, atol=1e-6)


def test_inject_hyperparams_learning_rate_changes_between_steps():
    w = tfl.Param(jnp.array([1.0, 2.0], F32), name="w")
    opt = tfl.Optimizer(optax.inject_hyperparams(optax.sgd)(learning_rate=0.5), [w])

    def step():
        with tfl.Session() as s:
            opt.step(s.backward(tfl.sum(w * jnp.array([1.0, 4.0], F32))))

    step()
    assert np.array_equal(np.asarray(w.value), np.array([0.5, 0.0], F32))
    opt.state.hyperparams["learning_rate"] = jnp.asarray(0.0, F32)
    step()
    assert np.array_equal(np.asarray(w.value), np.array([0.5, 0.0], F32))
    opt.state.hyperparams["learning_rate"] = jnp.asarray(0.25, F32)
    step()
    assert np.array_equal(np.asarray(w.value), np.array([0.25, -1.0], F32))


def test_multi_transform_labels_per_parameter():
    # 'frozen' label: set_to_zero; the 'c' parameter must never move, W must.
    W0, c0 = _init_weights()
    W = tfl.Param(W0.copy(), name="W")
    c = tfl.Param(c0.copy(), name="c")
    Wt = tfl.tie(W, name="W_tied")
    tx = optax.multi_transform(
        {"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, {"W": "train", "c": "frozen"}
    )
    opt = tfl.Optimizer(tx, {"W": W, "c": c, "W_tied": Wt})
    for x in _batches(3):
        with tfl.Session() as s:
            opt.step(s.backward(_tied_loss(s, x, W, Wt, c)))
    assert np.array_equal(np.asarray(c.value), c0)
    assert not np.array_equal(np.asarray(W.value), W0)


# --------------------------------------------------------------------------- MultiSteps == big batch


@pytest.mark.parametrize("inner", ["sgd_momentum", "adam"])
def test_multisteps_accumulation_with_tied_param_equals_big_batch(inner):
    make = {"sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9), "adam": lambda: optax.adam(1e-2)}[inner]
    W0, c0 = _init_weights(np.float64)
    micro = _batches(8, np.float64, batch=3, seed=7)

    W = tfl.Param(W0.copy(), name="W")
    c = tfl.Param(c0.copy(), name="c")
    Wt = tfl.tie(W, name="W_tied")
    opt = tfl.Optimizer(optax.MultiSteps(make(), every_k_schedule=4), [W, c, Wt])
    assert len(opt.state.acc_grads) == 2  # one accumulator per storage

    Wb = tfl.Param(W0.copy(), name="Wb")
    cb = tfl.Param(c0.copy(), name="cb")
    Wbt = tfl.tie(Wb)
    opt_big = tfl.Optimizer(make(), [Wb, cb, Wbt])

    for cycle in range(2):
        chunk = micro[4 * cycle : 4 * cycle + 4]
        start = np.asarray(W.value).copy()
        for i, x in enumerate(chunk):
            with tfl.Session() as s:
                opt.step(s.backward(_tied_loss(s, x, W, Wt, c)))
            if i < 3:
                assert np.array_equal(np.asarray(W.value), start), "MultiSteps must not move params mid-accumulation"
        with tfl.Session() as s:
            opt_big.step(s.backward(_tied_loss(s, np.concatenate(chunk), Wb, Wbt, cb)))
        assert not np.array_equal(np.asarray(W.value), start)
        # float64 throughout; optax's MultiSteps running mean itself carries a
        # float32-precision factor (~1e-8 relative), hence not a 1e-15 tolerance.
        np.testing.assert_allclose(np.asarray(W.value), np.asarray(Wb.value), rtol=0, atol=1e-7)
        np.testing.assert_allclose(np.asarray(c.value), np.asarray(cb.value), rtol=0, atol=1e-7)


# --------------------------------------------------------------------------- update from the current value


def test_update_starts_from_current_value_not_recorded_snapshot():
    w = tfl.Param(jnp.array([1.0, 2.0], F32), name="w")
    opt = tfl.Optimizer(optax.sgd(0.5), [w])
    with tfl.Session() as s:
        loss = tfl.sum(w * jnp.array([2.0, -4.0], F32))
        g = s.backward(loss)
        w.value = jnp.array([10.0, 20.0], F32)  # mutated after its use, before the step
        opt.step(g)
    # current - lr * grad; the snapshot would give [0, 4]
    assert np.array_equal(np.asarray(w.value), np.array([9.0, 22.0], F32))


def test_tied_storage_is_written_once_per_step():
    w = tfl.Param(jnp.array(3.0, F32), name="w")
    wt = tfl.tie(w)
    opt = tfl.Optimizer(optax.sgd(1.0), [w, wt])
    with tfl.Session() as s:
        opt.step(s.backward(w * 2.0 + wt * 5.0))
    assert float(w.value) == 3.0 - 7.0 and float(wt.value) == -4.0


# --------------------------------------------------------------------------- skipping unused parameters


def _three_params():
    W0, c0 = _init_weights()
    W = tfl.Param(W0.copy(), name="W")
    c = tfl.Param(c0.copy(), name="c")
    V = tfl.Param(np.linspace(-1, 1, 3).astype(F32), name="V")
    return W, c, V


@pytest.mark.parametrize(
    "make",
    [
        lambda: optax.adam(1e-2),
        lambda: optax.sgd(0.05, momentum=0.9),
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1)),
    ],
    ids=["adam", "momentum", "clip_adamw"],
)
def test_unused_trainable_param_value_and_slots_untouched(make):
    W, c, V = _three_params()
    opt = tfl.Optimizer(make(), [W, c, V])
    x = _batches(1)[0]
    with tfl.Session() as s:  # step 1 uses all three, so V's slots are non-zero
        opt.step(s.backward(_tied_loss(s, x, W, tfl.tie(W), c) + tfl.sum(V * V)))
    v_before = np.asarray(V.value).copy()
    slots_before = [np.asarray(leaf[2]).copy() for leaf in _slot_lists(opt.state)]
    assert slots_before and any(np.any(sl != 0) for sl in slots_before)
    W_before = np.asarray(W.value).copy()
    with tfl.Session() as s:  # step 2 does not use V
        opt.step(s.backward(_tied_loss(s, x, W, tfl.tie(W), c)))
    assert not np.array_equal(np.asarray(W.value), W_before)
    assert np.array_equal(np.asarray(V.value), v_before)
    for before, leaf in zip(slots_before, _slot_lists(opt.state)):
        assert np.array_equal(np.asarray(leaf[2]), before)


def _slot_lists(state):
    """Every per-parameter list (length 3) in an optax state built over a 3-param list."""
    found = []

    def visit(node):
        if isinstance(node, list) and len(node) == 3:
            found.append(node)
            return
        if isinstance(node, tuple):
            for child in node:
                visit(child)

    visit(state)
    return found


def test_unused_param_adam_count_still_advances():
    W, c, V = _three_params()
    opt = tfl.Optimizer(optax.adam(1e-2), [W, c, V])
    x = _batches(1)[0]
    with tfl.Session() as s:
        opt.step(s.backward(_tied_loss(s, x, W, W, c)))
    assert int(_mu(opt.state).count) == 1
    assert np.array_equal(np.asarray(_mu(opt.state).mu[2]), np.zeros(3, F32))


@pytest.mark.parametrize("kind", ["multi_transform", "inject_hyperparams"])
def test_unused_param_with_dict_params_and_dict_valued_state(kind):
    # State components that are dicts of the same size as the parameter dict
    # (multi_transform's per-label inner states, inject_hyperparams' hyperparams)
    # must not be mistaken for per-parameter slots.
    if kind == "multi_transform":
        a = tfl.Param(jnp.ones(2, F32), name="a")
        b = tfl.Param(jnp.ones(3, F32), name="b")
        params = {"a": a, "b": b}
        tx = optax.multi_transform({"x": optax.adam(0.1), "y": optax.sgd(0.1, momentum=0.9)}, {"a": "x", "b": "y"})
    else:
        names = ["a", "b", "p", "q", "r"]  # 5 params, adam has 5 hyperparams
        params = {n: tfl.Param(jnp.ones(2, F32), name=n) for n in names}
        a, b = params["a"], params["b"]
        tx = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    opt = tfl.Optimizer(tx, params)
    with tfl.Session() as s:
        opt.step(s.backward(sum((tfl.sum(p * p) for p in params.values()), start=tfl.sum(a * 0.0))))
    snap_b = np.asarray(b.value).copy()
    with tfl.Session() as s:
        opt.step(s.backward(tfl.sum(a * a)))
    assert np.array_equal(np.asarray(b.value), snap_b)
    assert not np.allclose(np.asarray(a.value), 1.0)


# --------------------------------------------------------------------------- validation: nothing changes


def _trained_opt():
    """Two storages (one tied) and adam state that is already non-trivial."""
    W, c, V = _three_params()
    opt = tfl.Optimizer(optax.adam(1e-2), [W, c, V])
    x = _batches(1)[0]
    for _ in range(2):
        with tfl.Session() as s:
            opt.step(s.backward(_tied_loss(s, x, W, tfl.tie(W), c) + tfl.sum(V * V)))
    return opt, [W, c, V], x


def test_wrong_shaped_gradient_rejected_nothing_changes():
    opt, (W, c, V), _ = _trained_opt()
    before = _snapshot(opt, [W, c, V])
    good = jnp.ones((D, H), F32)
    with pytest.raises(tfl.TapeError, match="nothing was updated"):
        opt.step({W: good, V: jnp.ones((4,), F32)})
    with pytest.raises(tfl.TapeError):
        opt.step({W: good, c: jnp.ones((H,), np.float64)})  # wrong dtype
    _assert_snapshot_equal(before, _snapshot(opt, [W, c, V]))
    opt.step({W: good})  # a valid gradient still works afterwards
    assert not np.array_equal(np.asarray(W.value), before[0][0])


def test_missing_gradient_rejected_nothing_changes():
    opt, (W, c, V), x = _trained_opt()
    before = _snapshot(opt, [W, c, V])
    with tfl.Session() as s:
        g = s.backward(_tied_loss(s, x, W, tfl.tie(W), c) + tfl.sum(V * V))
        gw = next(grp for grp in g.groups if grp.storage is W.storage)
        del g.by_leaf[gw.leaves[1]]
        with pytest.raises(tfl.TapeError, match="missing gradient"):
            opt.step(g)
    _assert_snapshot_equal(before, _snapshot(opt, [W, c, V]))


def test_non_finite_gradient_rejected_only_with_check_finite():
    opt, (W, c, V), x = _trained_opt()
    before = _snapshot(opt, [W, c, V])

    def record(s):
        return _tied_loss(s, x, W, tfl.tie(W), c) + tfl.sum(V * jnp.array([1.0, np.inf, 0.0], F32))

    with tfl.Session() as s:
        with pytest.raises(tfl.TapeError, match="non-finite"):
            opt.step(s.backward(record(s)), check_finite=True)
    _assert_snapshot_equal(before, _snapshot(opt, [W, c, V]))

    strict = tfl.Optimizer(optax.sgd(0.1), [W, c, V], check_finite=True)
    with tfl.Session() as s:
        with pytest.raises(tfl.TapeError, match="non-finite"):
            strict.step({W: jnp.ones((D, H), F32), c: jnp.full((H,), np.nan, F32)})
    _assert_snapshot_equal(before, _snapshot(opt, [W, c, V]))

    # default: no finiteness check, the update goes through
    with tfl.Session() as s:
        opt.step(s.backward(record(s)))
    assert not np.all(np.isfinite(np.asarray(V.value)))


def test_foreign_or_released_gradients_rejected():
    opt, (W, c, V), x = _trained_opt()
    other = tfl.Param(jnp.ones((D, H), F32))
    before = _snapshot(opt, [W, c, V])
    with pytest.raises(tfl.TapeError, match="not one of"):
        opt.step({other: jnp.ones((D, H), F32)})
    with tfl.Session() as s:
        g = s.backward(_tied_loss(s, x, W, tfl.tie(W), c))
        g.release()
        with pytest.raises(tfl.TapeError, match="released"):
            opt.step(g)
    _assert_snapshot_equal(before, _snapshot(opt, [W, c, V]))


# --------------------------------------------------------------------------- releasing gradient buffers


def test_grads_released_after_step():
    W0, c0 = _init_weights()
    W = tfl.Param(W0, name="W")
    c = tfl.Param(c0, name="c")
    opt = tfl.Optimizer(optax.adam(1e-2), [W, c])
    with tfl.Session() as s:
        g = s.backward(_tied_loss(s, _batches(1)[0], W, tfl.tie(W), c))
        refs = [weakref.ref(b) for b in g.by_leaf.values()]
        kept = g[c]  # a gradient the user took out stays valid after the step
        opt.step(g)
    assert g.released
    gc.collect()
    assert refs and all(r() is None for r in refs if r() is not kept)  # the rest is freed
    assert not kept.is_deleted() and np.isfinite(np.asarray(kept)).all()
    assert not W.value.is_deleted() and not c.value.is_deleted()
    with pytest.raises(tfl.TapeError):
        g[W]


def test_grads_released_when_update_raises_and_params_unchanged():
    W0, c0 = _init_weights()
    W = tfl.Param(W0, name="W")
    c = tfl.Param(c0, name="c")
    opt = tfl.Optimizer(_raising_tx(), [W, c])
    with tfl.Session() as s:
        g = s.backward(_tied_loss(s, _batches(1)[0], W, tfl.tie(W), c))
        refs = [weakref.ref(b) for b in g.by_leaf.values()]
        with pytest.raises(RuntimeError, match="update exploded"):
            opt.step(g)
    assert g.released
    gc.collect()
    assert refs and all(r() is None for r in refs)
    assert np.array_equal(np.asarray(W.value), W0) and np.array_equal(np.asarray(c.value), c0)
    assert isinstance(opt.state, optax.EmptyState)


# --------------------------------------------------------------------------- alias layout changes


def test_alias_layout_change_requires_reinit():
    p = tfl.Param(jnp.ones(3, F32), name="p")
    q = tfl.Param(jnp.full(3, 2.0, F32), name="q")
    opt = tfl.Optimizer(optax.adam(0.1), [p, q])
    with tfl.Session() as s:
        opt.step(s.backward(tfl.sum(p * q)))
    q.storage = p.storage  # tie two previously separate records
    before = _snapshot(opt, [p])
    with tfl.Session() as s:
        with pytest.raises(tfl.TapeError, match="reinit"):
            opt.step(s.backward(tfl.sum(p * q)))
    _assert_snapshot_equal(before, _snapshot(opt, [p]))
    opt.reinit()
    assert opt.storages == [p.storage] and opt.params[0] is p and len(_mu(opt.state).mu) == 1
    assert int(_mu(opt.state).count) == 0
    with tfl.Session() as s:
        opt.step(s.backward(tfl.sum(p * q)))
    assert not np.array_equal(np.asarray(p.value), before[0][0])


def test_untying_requires_reinit():
    p = tfl.Param(jnp.ones(3, F32), name="p")
    q = tfl.tie(p, name="q")
    opt = tfl.Optimizer(optax.sgd(0.1), [p, q])
    q.storage = tfl.Storage(jnp.ones(3, F32))
    with tfl.Session() as s:
        with pytest.raises(tfl.TapeError, match="reinit"):
            opt.step(s.backward(tfl.sum(p * q)))
    opt.reinit()
    assert len(opt.params) == 2


def test_replacing_a_storage_requires_reinit():
    # Same alias *pattern*, but q now points at a storage the optimizer has no slot for:
    # training it silently would be impossible (its gradient has no slot), so refuse.
    p = tfl.Param(jnp.ones(3, F32), name="p")
    q = tfl.Param(jnp.ones(3, F32), name="q")
    opt = tfl.Optimizer(optax.sgd(0.1), [p, q])
    q.storage = tfl.Storage(jnp.ones(3, F32))
    with tfl.Session() as s:
        with pytest.raises(tfl.TapeError, match="reinit"):
            opt.step(s.backward(tfl.sum(p * p) + tfl.sum(q * q)))
    assert np.array_equal(np.asarray(p.value), np.ones(3, F32))
    opt.reinit()
    with tfl.Session() as s:
        opt.step(s.backward(tfl.sum(p * p) + tfl.sum(q * q)))
    assert np.allclose(np.asarray(q.value), 0.8) and np.allclose(np.asarray(p.value), 0.8)


def test_optimizer_rejects_non_params_and_non_transformations():
    with pytest.raises(TypeError):
        tfl.Optimizer(optax.sgd(0.1), [jnp.ones(3)])
    with pytest.raises(TypeError):
        tfl.Optimizer(object(), [tfl.Param(jnp.ones(3))])


def test_two_optimizers_over_disjoint_params_share_one_grads() -> None:
    a = tfl.Param(jnp.array([1.0, 2.0]), name="a")
    b = tfl.Param(jnp.array([3.0]), name="b")
    o1 = tfl.Optimizer(optax.sgd(0.5), [a])
    o2 = tfl.Optimizer(optax.sgd(0.25), [b])
    with tfl.Session() as s:
        loss = tfl.sum(a * a) + tfl.sum(b * b * b)
        g = s.backward(loss)
        o1.step(g)
        assert not g.released  # b's gradient is still there for o2
        o2.step(g)
        assert g.released
    np.testing.assert_allclose(np.asarray(a.value), [1.0 - 0.5 * 2.0, 2.0 - 0.5 * 4.0])
    np.testing.assert_allclose(np.asarray(b.value), [3.0 - 0.25 * 27.0])


@pytest.mark.parametrize("order", ["used_first", "unused_first"])
def test_an_optimizer_none_of_whose_params_were_used_does_nothing_in_either_order(order) -> None:
    """The used optimizer's step releases the Grads; the other one's step then has nothing to do, not an error."""
    a = tfl.Param(jnp.array([1.0, 2.0]), name="a")
    b = tfl.Param(jnp.array([3.0]), name="b")
    o1 = tfl.Optimizer(optax.adam(0.5), [a])
    o2 = tfl.Optimizer(optax.adam(0.25), [b])
    b_state = [np.asarray(x).copy() for x in jax.tree_util.tree_leaves(o2.state)]
    with tfl.Session() as s:
        g = s.backward(tfl.sum(a * a))  # b is not used
        for o in (o1, o2) if order == "used_first" else (o2, o1):
            o.step(g)
        assert g.released
        with pytest.raises(tfl.TapeError, match="already released"):
            o1.step(g)  # a's gradient was consumed: a second step over it is still refused
    assert not np.array_equal(np.asarray(a.value), [1.0, 2.0])
    np.testing.assert_array_equal(np.asarray(b.value), [3.0])
    for x, y in zip(b_state, jax.tree_util.tree_leaves(o2.state)):
        np.testing.assert_array_equal(x, np.asarray(y))  # not even Adam's step count moved


# --------------------------------------------------------------------------- per-parameter state parts (tree_map_params)


def _adam_part(state, label=None):
    """The ScaleByAdamState inside ``state`` (inside multi_transform's ``label`` inner state if given)."""
    if label is not None:
        state = state.inner_states[label]
    return _mu(state)


def test_slot_indices_mark_per_parameter_parts_only():
    from optax.transforms import MaskedNode

    W, c, V = _three_params()
    params = {"W": W, "c": c, "V": V}
    cases = {
        "clip_adam": optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
        "adamw": optax.adamw(1e-2, weight_decay=0.1),
        "masked": optax.masked(optax.adam(1e-2), {"W": True, "c": False, "V": True}),
        "inject": optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
        "multi": optax.multi_transform(
            {"x": optax.adam(1e-2), "y": optax.sgd(0.1, momentum=0.9)}, {"W": "x", "c": "y", "V": "x"}
        ),
    }
    for name, tx in cases.items():
        opt = tfl.Optimizer(tx, params)
        idx = opt.slot_indices()
        # a prefix of the state: every state leaf pairs with one index
        pairs = []
        jax.tree_util.tree_map(lambda k, part: pairs.append((k, part)), idx, opt.state)
        slots = {k for k, _ in pairs if k >= 0}
        assert slots == {0, 1, 2}, name
        for k, part in pairs:
            if k >= 0 and not isinstance(part, MaskedNode):  # a parameter's own part has its shape
                assert part.shape == opt.storages[k].shape, (name, k)
        adam = _adam_part(idx, "x" if name == "multi" else None)
        assert adam.count == -1, name
        if name == "masked":
            assert adam.mu == {"W": 0, "c": 1, "V": 2}  # c's MaskedNode is c's part too
        elif name == "multi":
            assert adam.mu == {"W": 0, "c": 1, "V": 2} and idx.inner_states["y"].inner_state[0].trace == {
                "W": 0,
                "c": 1,
                "V": 2,
            }
        else:
            assert adam.mu == {"W": 0, "c": 1, "V": 2} and adam.nu == {"W": 0, "c": 1, "V": 2}
        if name == "inject":  # 5 hyperparameters in a dict: not per-parameter (whatever their count)
            assert set(idx.hyperparams.values()) == {-1}
    # a list of params: lists by position
    opt = tfl.Optimizer(optax.adam(1e-2), [W, c, V, tfl.tie(W)])
    assert _mu(opt.slot_indices()).mu == [0, 1, 2]


def test_tied_and_unused_param_adam_slots_untouched_count_advances():
    W, c, V = _three_params()
    Wt = tfl.tie(W, name="W_tied")
    opt = tfl.Optimizer(optax.adam(1e-2), [W, Wt, V, c])
    x = _batches(1)[0]
    with tfl.Session() as s:  # step 1 uses everything: V's moments become non-zero
        opt.step(s.backward(_tied_loss(s, x, W, Wt, c) + tfl.sum(V * V)))
    st = _mu(opt.state)
    v_mu, v_nu, w_mu = (np.asarray(a).copy() for a in (st.mu[1], st.nu[1], st.mu[0]))
    v_value = np.asarray(V.value).copy()
    assert np.any(v_mu != 0) and np.any(v_nu != 0) and int(st.count) == 1
    with tfl.Session() as s:  # step 2: W (through both records) and c, not V
        opt.step(s.backward(_tied_loss(s, x, W, Wt, c)))
    st = _mu(opt.state)
    assert int(st.count) == 2
    assert np.array_equal(np.asarray(st.mu[1]), v_mu) and np.array_equal(np.asarray(st.nu[1]), v_nu)
    assert np.array_equal(np.asarray(V.value), v_value)
    assert not np.array_equal(np.asarray(st.mu[0]), w_mu)


def test_multi_transform_per_label_dict_state_with_unused_param():
    a = tfl.Param(jnp.ones(2, F32), name="a")
    b = tfl.Param(jnp.full(3, 2.0, F32), name="b")
    c = tfl.Param(jnp.full(2, 3.0, F32), name="c")
    tx = optax.multi_transform(
        {"x": optax.adam(0.1), "y": optax.sgd(0.1, momentum=0.9)}, {"a": "x", "b": "x", "c": "y"}
    )
    opt = tfl.Optimizer(tx, {"a": a, "b": b, "c": c})
    assert set(opt.state.inner_states) == {"x", "y"}  # one inner state per label, not per parameter
    with tfl.Session() as s:
        opt.step(s.backward(tfl.sum(a * a) + tfl.sum(b * b) + tfl.sum(c * c)))
    adam, trace = _adam_part(opt.state, "x"), opt.state.inner_states["y"].inner_state[0].trace
    b_mu, b_nu, c_trace = (np.asarray(v).copy() for v in (adam.mu["b"], adam.nu["b"], trace["c"]))
    b_val, c_val = np.asarray(b.value).copy(), np.asarray(c.value).copy()
    with tfl.Session() as s:  # only a is used
        opt.step(s.backward(tfl.sum(a * a)))
    adam, trace = _adam_part(opt.state, "x"), opt.state.inner_states["y"].inner_state[0].trace
    assert int(adam.count) == 2
    assert np.array_equal(np.asarray(adam.mu["b"]), b_mu) and np.array_equal(np.asarray(adam.nu["b"]), b_nu)
    assert np.array_equal(np.asarray(trace["c"]), c_trace)
    assert np.array_equal(np.asarray(b.value), b_val) and np.array_equal(np.asarray(c.value), c_val)
    assert not np.allclose(np.asarray(a.value), 1.0)


def test_masked_and_inject_hyperparams_unused_param_slots_untouched():
    for tx in (
        optax.masked(optax.adam(0.1), {"a": True, "b": True, "c": False}),
        optax.inject_hyperparams(optax.adam)(learning_rate=0.1),
    ):
        a, b, c = (tfl.Param(jnp.full(2, float(i + 1), F32), name=n) for i, n in enumerate("abc"))
        opt = tfl.Optimizer(tx, {"a": a, "b": b, "c": c})
        with tfl.Session() as s:
            opt.step(s.backward(tfl.sum(a * a) + tfl.sum(b * b) + tfl.sum(c * c)))
        b_mu = np.asarray(_mu(opt.state).mu["b"]).copy()
        with tfl.Session() as s:
            opt.step(s.backward(tfl.sum(a * a) + tfl.sum(c * c)))
        assert int(_mu(opt.state).count) == 2
        assert np.array_equal(np.asarray(_mu(opt.state).mu["b"]), b_mu)


def test_state_tree_map_params_cannot_map_warns_and_still_trains():
    # multi_transform with a label function that looks at the params cannot be initialized on
    # optax's placeholder: nothing is then known to be per-parameter (the optimizer still works)
    a = tfl.Param(jnp.ones(2, F32), name="a")
    b = tfl.Param(jnp.ones(3, F32), name="b")
    tx = optax.multi_transform(
        {"x": optax.adam(0.1), "y": optax.sgd(0.1)}, lambda p: {k: ("x" if k == "a" else "y") for k in p}
    )
    opt = tfl.Optimizer(tx, {"a": a, "b": b})
    with pytest.warns(UserWarning, match="tree_map_params"):
        assert opt.slot_indices() == -1
    with tfl.Session() as s:
        opt.step(s.backward(tfl.sum(a * a)))
    assert np.array_equal(np.asarray(b.value), np.ones(3, F32)) and not np.allclose(np.asarray(a.value), 1.0)


# --------------------------------------------------------------------------- the tied sum comes from tapeflow._shell._grads


def test_step_takes_tied_sums_from_the_one_rule(monkeypatch):
    """Eagerly through Grads.group_gradient, lazily inside the fused step program: both sum with
    tapeflow._shell._grads.sum_in_leaf_order, never with a copy in the optimizer."""
    import tapeflow._shell._grads as grads_mod
    import tapeflow._train._optim as optim_mod

    calls = []
    orig = grads_mod.sum_in_leaf_order

    def spy(parts):
        calls.append(len(parts))
        return orig(parts)

    def no_sum(parts):
        raise AssertionError("Optimizer.step summed a Grads' cotangents itself")

    monkeypatch.setattr(grads_mod, "sum_in_leaf_order", spy)
    monkeypatch.setattr(optim_mod, "sum_in_leaf_order", no_sum)
    w = tfl.Param(jnp.array(1.0, F32), name="w")
    opt = tfl.Optimizer(optax.sgd(1.0), [w])
    jax.clear_caches()  # optimizers of one structure share step programs: trace this one's anew
    tfl.clear_kernel_caches()
    with tfl.Session() as s:
        opt.step(s.backward(w * 1e8 + tfl.tie(w) * -1e8 + w * 1.0))
    assert calls == [3]
    assert float(w.value) == 0.0  # ((1e8 + -1e8) + 1) in leaf order


def test_mapping_with_several_keys_of_one_storage_sums_in_key_order():
    w = tfl.Param(jnp.array(1.0, F32), name="w")
    w2, w3 = tfl.tie(w), tfl.tie(w)
    opt = tfl.Optimizer(optax.sgd(1.0), [w])
    opt.step({w: jnp.array(1e8, F32), w2: jnp.array(-1e8, F32), w3: jnp.array(1.0, F32)})
    assert float(w.value) == 0.0  # ((1e8 + -1e8) + 1); another association gives 1.0
    with pytest.raises(tfl.TapeError, match="nothing was updated"):
        opt.step({w: jnp.ones((), F32), w2: jnp.ones(2, F32)})  # each part is validated before summing
    assert float(w.value) == 0.0


# --------------------------------------------------------------------------- the public seams train_step uses


def test_update_is_pure_and_matches_step():
    W, c, V = _three_params()
    opt = tfl.Optimizer(optax.adam(1e-2), {"W": W, "c": c, "V": V})
    x = _batches(1)[0]
    state0 = opt.state
    values0 = [np.asarray(st.read_current()).copy() for st in opt.storages]
    with tfl.Session() as s:
        g = s.backward(_tied_loss(s, x, W, tfl.tie(W), c))
        grads = [np.asarray(v) if v is not None else None for v in g.storage_gradients(opt.storages)]
    upd = jax.jit(opt.update, static_argnums=(3,))
    vals, state = upd(
        [jnp.asarray(v) for v in values0],
        state0,
        [None if v is None else jnp.asarray(v) for v in grads],
        (True, True, False),
    )
    # nothing was read or written
    assert all(np.array_equal(np.asarray(st.read_current()), v) for st, v in zip(opt.storages, values0))
    assert opt.state is state0
    with tfl.Session() as s:
        opt.step(s.backward(_tied_loss(s, x, W, tfl.tie(W), c)))
    for mine, ref in zip(vals, [W, c, V]):
        np.testing.assert_allclose(np.asarray(mine), np.asarray(ref.value), rtol=0, atol=1e-7)
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(opt.state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-7)
    # used defaults to the gradients that are not None
    vals2, _ = opt.update(
        [jnp.asarray(v) for v in values0], state0, [None if v is None else jnp.asarray(v) for v in grads]
    )
    assert np.array_equal(np.asarray(vals2[2]), values0[2])
    with pytest.raises(ValueError, match="one per slot"):
        opt.update(values0[:2], state0, grads)


def test_public_views_of_the_slots():
    W, c, V = _three_params()
    Wt = tfl.tie(W, name="W_tied")
    opt = tfl.Optimizer(optax.sgd(0.1), {"W": W, "W_tied": Wt, "c": c, "V": V})
    assert opt.storages == [W.storage, c.storage, V.storage]
    assert [p is q for p, q in zip(opt.params, [W, c, V])] == [True] * 3 and len(opt.params) == 3
    assert opt.slot_keys == ["W", "c", "V"]
    assert opt.describe(0) == repr(W) and opt.describe(2) == repr(V)
    tree = opt.param_tree([1, 2, 3])
    assert tree == {"W": 1, "c": 2, "V": 3}
    with pytest.raises(ValueError):
        opt.param_tree([1, 2])
    first = opt.check_layout()
    assert first == tuple(opt.storages) and opt.check_layout() is first
    Wt.storage = tfl.Storage(jnp.zeros((D, H), F32))  # untie
    with pytest.raises(tfl.TapeError, match="reinit"):
        opt.check_layout()
    opt.reinit()
    assert len(opt.check_layout()) == 4 and opt.slot_keys == ["W", "W_tied", "c", "V"]


def test_optimizer_over_a_module_gives_slots_to_its_trainable_parameters_only():
    """BatchNorm's running statistics and frozen Params are state, not optimizer slots."""
    import jax

    frozen = tfl.Param(jnp.ones(3), trainable=False)
    model = tfl.nn.Sequential(tfl.nn.Linear(3, 4, key=jax.random.key(0)), tfl.nn.BatchNorm1d(4), lambda h: h * frozen)
    model.extra = frozen
    opt = tfl.Optimizer(optax.adam(1e-3), model)
    trainable = [p.storage for p in model.parameters() if p.trainable]
    assert list(opt.storages) == trainable and len(trainable) == 4  # Linear weight, bias; BatchNorm weight, bias
