"""Train/eval modes and BatchNorm with running statistics (issue 12, items 1 and 2).

* ``tfl.nn.BatchNorm1d`` / ``BatchNorm2d`` equal ``torch.nn.BatchNorm1d`` / ``BatchNorm2d``
  (outputs, gradients of input, weight and bias, running statistics) over five
  training steps and one eval step, eagerly and compiled with ``train_step``,
  whose running statistics equal the eager run's;
* the running statistics are state cells: saved and restored by ``tfl.save`` /
  ``tfl.restore``, and unchanged by a step that fails, on the eager and the
  compiled path alike;
* ``Module.train()`` / ``eval()`` are recursive; dropout and batch norm follow
  the module's mode in a training session, and an inference session (or eval
  mode) gives deterministic outputs.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import Switch

import tapeflow as tfl
from tapeflow import nn

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

F32 = np.float32
TOL = 1e-5  # on |a - b| / max(1, |b|): absolute for values up to 1, relative (a few float32 ulps) above
LR = 0.05
C = 3
CASES = {
    "1d": (nn.BatchNorm1d, "BatchNorm1d", (8, C)),
    "1d_seq": (nn.BatchNorm1d, "BatchNorm1d", (6, C, 5)),
    "2d": (nn.BatchNorm2d, "BatchNorm2d", (4, C, 5, 6)),
}
# measured max (|a - b|, |a - b| / max(1, |b|)) per quantity, printed by test_report_max_differences
MEASURED: dict[str, tuple[float, float]] = {}


def _close(key: str, a, b, tol: float = TOL) -> None:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    diff = np.abs(a - b)
    d, scaled = float(diff.max()), float((diff / np.maximum(1.0, np.abs(b))).max())
    old = MEASURED.get(key, (0.0, 0.0))
    MEASURED[key] = (max(old[0], d), max(old[1], scaled))
    assert scaled <= tol, f"{key}: max difference {d:.3g} (scaled by max(1, |b|): {scaled:.3g}) > {tol}"


def _data(shape, seed=0):
    """Five training batches and one eval batch (offset and scaled so the running statistics move), with cotangents."""
    rng = np.random.default_rng(seed)
    scale = np.array([0.5, 2.0, 3.0], F32).reshape((1, C) + (1,) * (len(shape) - 2))
    shift = np.array([1.0, -2.0, 0.5], F32).reshape(scale.shape)
    xs = [(rng.standard_normal(shape).astype(F32) * scale + shift) for _ in range(6)]
    rs = [rng.standard_normal(shape).astype(F32) for _ in range(6)]
    w0 = rng.uniform(0.5, 1.5, C).astype(F32)
    b0 = rng.standard_normal(C).astype(F32)
    return xs, rs, w0, b0


def recording_sgd(lr: float) -> optax.GradientTransformation:
    """SGD whose state keeps the last gradients it was given, so a compiled step's gradients can be read back."""

    def init(params):
        return {"grads": jax.tree_util.tree_map(jnp.zeros_like, params)}

    def update(grads, state, params=None):
        return jax.tree_util.tree_map(lambda g: -lr * g, grads), {"grads": grads}

    return optax.GradientTransformation(init, update)


def torch_reference(kind):
    """Per step: output, gradients (x, weight, bias), running statistics and weights after the SGD update."""
    _, tname, shape = CASES[kind]
    xs, rs, w0, b0 = _data(shape)
    bn = getattr(torch.nn, tname)(C)
    with torch.no_grad():
        bn.weight.copy_(torch.from_numpy(w0))
        bn.bias.copy_(torch.from_numpy(b0))
    opt = torch.optim.SGD(bn.parameters(), lr=LR)
    out = []
    for k in range(6):
        if k == 5:
            bn.eval()
        x = torch.from_numpy(xs[k]).requires_grad_(True)
        y = bn(x)
        (y * torch.from_numpy(rs[k])).sum().backward()
        rec = {
            "y": y.detach().numpy().copy(),
            "gx": x.grad.numpy().copy(),
            "gw": bn.weight.grad.numpy().copy(),
            "gb": bn.bias.grad.numpy().copy(),
            "running_mean": bn.running_mean.numpy().copy(),
            "running_var": bn.running_var.numpy().copy(),
            "num_batches_tracked": int(bn.num_batches_tracked),
        }
        opt.step()
        opt.zero_grad()
        rec["w"] = bn.weight.detach().numpy().copy()
        rec["b"] = bn.bias.detach().numpy().copy()
        out.append(rec)
    return out


def tapeflow_run(kind, path):
    """The same six steps in tapeflow: the input is a Param so both paths give its gradient."""
    cls, _, shape = CASES[kind]
    xs, rs, w0, b0 = _data(shape)
    bn = cls(C)
    bn.weight.value = jnp.asarray(w0)
    bn.bias.value = jnp.asarray(b0)
    xp = tfl.Param(jnp.zeros(shape, F32), name="x")
    opt = tfl.Optimizer(recording_sgd(LR), [xp, bn.weight, bn.bias])

    def loss_fn(s, r):
        y = bn(xp)
        return tfl.sum(y * r), y

    step = tfl.train_step(loss_fn, opt, has_aux=True) if path == "train_step" else None
    out = []
    for k in range(6):
        if k == 5:
            assert bn.eval() is bn
        xp.value = jnp.asarray(xs[k])
        if step is None:
            with tfl.Session(lazy=path == "lazy") as s:
                loss, y = loss_fn(s, jnp.asarray(rs[k]))
                y = np.asarray(y.value)
                g = s.backward(loss)
                direct = [np.asarray(g[p]).copy() for p in (xp, bn.weight, bn.bias)]
                opt.step(g)
        else:
            _, y = step(jnp.asarray(rs[k]))
            y = np.asarray(y)
        gx, gw, gb = (np.asarray(a) for a in opt.state["grads"])  # what the update was given
        if step is None:
            for a, b in zip(direct, (gx, gw, gb)):
                np.testing.assert_array_equal(a, b)
        out.append(
            {
                "y": y,
                "gx": gx,
                "gw": gw,
                "gb": gb,
                "running_mean": np.asarray(bn.running_mean.value).copy(),
                "running_var": np.asarray(bn.running_var.value).copy(),
                "num_batches_tracked": int(bn.num_batches_tracked.value),
                "w": np.asarray(bn.weight.value).copy(),
                "b": np.asarray(bn.bias.value).copy(),
            }
        )
    return out, step, bn


@pytest.fixture(scope="module")
def runs():
    cache: dict[tuple[str, str], list[dict]] = {}

    def get(kind, path):
        if (kind, path) not in cache:
            cache[kind, path] = torch_reference(kind) if path == "torch" else tapeflow_run(kind, path)[0]
        return cache[kind, path]

    return get


@pytest.mark.parametrize("path", ["eager", "lazy", "train_step"])
@pytest.mark.parametrize("kind", sorted(CASES))
def test_outputs_gradients_and_running_stats_equal_torch(runs, kind, path):
    ref, got = runs(kind, "torch"), runs(kind, path)
    for k, (r, g) in enumerate(zip(ref, got, strict=True)):
        for q in ("y", "gx", "gw", "gb", "running_mean", "running_var", "w", "b"):
            _close(f"{path} {q}", g[q], r[q])
        assert g["num_batches_tracked"] == r["num_batches_tracked"] == min(k + 1, 5)
    # eval step: the running statistics normalize and stay as they were
    for q in ("running_mean", "running_var"):
        np.testing.assert_array_equal(got[5][q], got[4][q])


@pytest.mark.parametrize("kind", sorted(CASES))
def test_compiled_running_stats_equal_the_eager_run(runs, kind):
    for e, c in zip(runs(kind, "eager"), runs(kind, "train_step"), strict=True):
        for q in ("running_mean", "running_var"):
            _close(f"train_step vs eager {q}", c[q], e[q], tol=1e-6)
        assert c["num_batches_tracked"] == e["num_batches_tracked"]


def test_train_step_keys_its_programs_by_the_modes_it_read():
    _, step, bn = tapeflow_run("1d", "train_step")  # five steps in train mode, the sixth in eval mode
    assert step.cache_size() == 2
    bn.train()
    step(jnp.ones(CASES["1d"][2], F32))  # back to the train-mode program: nothing new compiled
    assert step.cache_size() == 2
    assert int(bn.num_batches_tracked.value) == 6


def test_momentum_none_no_tracking_and_no_affine_match_torch():
    shape = (8, C, 4)
    xs, _, _, _ = _data(shape, seed=1)
    configs = [
        dict(momentum=None),
        dict(track_running_stats=False),
        dict(affine=False, momentum=0.3, eps=1e-3),
    ]
    for cfg in configs:
        bn, tbn = nn.BatchNorm1d(C, **cfg), torch.nn.BatchNorm1d(C, **cfg)
        for k in range(4):
            if k == 3:
                bn.eval(), tbn.eval()
            with tfl.Session() as s:
                y = bn(s.input(xs[k]))
                _close("options y", y.value, tbn(torch.from_numpy(xs[k])).detach().numpy())
            if cfg.get("track_running_stats", True):
                _close("options running_mean", bn.running_mean.value, tbn.running_mean.numpy())
                _close("options running_var", bn.running_var.value, tbn.running_var.numpy())
                assert int(bn.num_batches_tracked.value) == int(tbn.num_batches_tracked)
            else:
                assert bn.running_mean is None and tbn.running_mean is None
        assert (bn.weight is None) == (not cfg.get("affine", True))


def test_parameters_and_state_cells_are_listed_in_pytorch_order():
    bn = nn.BatchNorm2d(4)
    tbn = torch.nn.BatchNorm2d(4)
    assert [n for n, _ in bn.named_parameters()] == [n for n, _ in tbn.named_parameters()] == ["weight", "bias"]
    assert [n for n, _ in bn.named_buffers()] == [n for n, _ in tbn.named_buffers()]
    assert list(bn.state_dict()) == list(tbn.state_dict())
    assert [p.trainable for _, p in bn.parameter_records()] == [True, True, False, False, False]
    assert bn.num_batches_tracked.dtype == np.int32 and bn.running_var.shape == (4,)


def test_save_and_restore_round_trip_the_running_statistics(tmp_path):
    model = nn.Sequential(nn.Linear(3, 4, key=jax.random.key(0)), nn.BatchNorm1d(4))
    xs, _, _, _ = _data((8, C), seed=2)
    for x in xs[:3]:
        with tfl.Session() as s:
            model(s.input(x))
    saved = {n: np.asarray(p.value).copy() for n, p in model.named_parameters()}
    path = os.path.join(tmp_path, "ckpt")
    tfl.save(path, model)
    fresh = nn.Sequential(nn.Linear(3, 4, key=jax.random.key(1)), nn.BatchNorm1d(4))
    tfl.restore(path, fresh)
    for n, p in fresh.named_parameters():
        np.testing.assert_array_equal(np.asarray(p.value), saved[n])
        assert np.asarray(p.value).dtype == saved[n].dtype
    assert int(fresh.layers[1].num_batches_tracked.value) == 3
    model.eval(), fresh.eval()
    with tfl.Session(grad_enabled=False) as s:
        np.testing.assert_array_equal(np.asarray(model(s.input(xs[4])).value), np.asarray(fresh(s.input(xs[4])).value))


# --------------------------------------------------------------------------- failed steps


def failing_sgd(switch: Switch) -> optax.GradientTransformation:
    sgd = optax.sgd(0.1, momentum=0.9)

    def update(updates, state, params=None):
        updates = jax.tree_util.tree_map(
            lambda u: jax.pure_callback(switch, jax.ShapeDtypeStruct(u.shape, u.dtype), u), updates
        )
        return sgd.update(updates, state, params)

    return optax.GradientTransformation(sgd.init, update)


class Net(nn.Module):
    def __init__(self):
        self.lin = nn.Linear(3, 4, key=jax.random.key(0))
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.lin(x))


def net_loss(net):
    def loss_fn(s, x):
        return tfl.mean(tfl.tanh(net(s.input(x))) ** 2.0)

    return loss_fn


class Eager:
    def __init__(self, loss_fn, opt, lazy=False):
        self.loss_fn, self.opt, self.lazy = loss_fn, opt, lazy

    def __call__(self, x):
        with tfl.Session(lazy=self.lazy) as s:
            loss = self.loss_fn(s, x)
            self.opt.step(s.backward(loss))


def snapshot(net, opt):
    return [np.asarray(p.value).copy() for p in net.parameters()] + [
        np.asarray(a).copy() for a in jax.tree_util.tree_leaves(opt.state)
    ]


def same(a, b):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


X_GOOD = np.linspace(-2.0, 3.0, 24, dtype=F32).reshape(8, 3)


def make_step(path, net, opt):
    return tfl.train_step(net_loss(net), opt) if path == "train_step" else Eager(net_loss(net), opt, path == "lazy")


def good_run(path, n_steps):
    """Parameters, optimizer state and state cells after ``n_steps`` uninterrupted steps on ``path``."""
    net = Net()
    opt = tfl.Optimizer(failing_sgd(Switch()), net, check_finite=True)
    step = make_step(path, net, opt)
    for _ in range(n_steps):
        step(X_GOOD)
    return snapshot(net, opt)


@pytest.mark.parametrize("failure", ["non-finite", "exception"])
@pytest.mark.parametrize("path", ["eager", "lazy", "train_step"])
def test_a_failed_step_leaves_parameters_and_running_stats_unchanged(path, failure):
    net = Net()
    switch = Switch()
    opt = tfl.Optimizer(failing_sgd(switch), net, check_finite=True)  # the module: its state cells are slots too
    step = make_step(path, net, opt)
    step(X_GOOD)
    before = snapshot(net, opt)
    assert int(net.bn.num_batches_tracked.value) == 1
    if failure == "non-finite":
        bad, match = X_GOOD.copy(), "non-finite"
        bad[0, 0] = np.nan
    else:
        bad, match = X_GOOD * 2.0, "injected failure|pure_callback"
        switch.on = True
    with pytest.raises(Exception, match=match):
        step(bad)
    same(snapshot(net, opt), before)  # parameters, optimizer state, running statistics and counter
    switch.on = False
    step(X_GOOD)
    after = snapshot(net, opt)
    same(after, good_run(path, 2))  # as if the failed step never happened
    for a, b in zip(after, good_run("eager" if path == "train_step" else "train_step", 2), strict=True):
        _close("failure test: eager vs train_step", a, b, tol=1e-6)  # and the two paths agree
    assert int(net.bn.num_batches_tracked.value) == 2


def test_eager_writes_happen_at_the_forward_and_survive_without_a_step():
    bn = nn.BatchNorm1d(C)
    with tfl.Session() as s:
        bn(s.input(X_GOOD))
        assert int(bn.num_batches_tracked.value) == 1  # at the forward, as in PyTorch
        bn(s.input(X_GOOD))
        assert int(bn.num_batches_tracked.value) == 2  # the second use sees the first update
        assert [st for st in s.state_writes] == [
            bn.running_mean.storage,
            bn.running_var.storage,
            bn.num_batches_tracked.storage,
        ]
    assert int(bn.num_batches_tracked.value) == 2


# --------------------------------------------------------------------------- value_and_grad


def test_value_and_grad_returns_the_new_state_and_writes_nothing():
    bn = nn.BatchNorm1d(C)
    params = bn.param_dict()

    def loss_fn(s, x):
        return tfl.sum(bn(s.input(x)) ** 2.0)

    with pytest.raises(tfl.TapeError, match="has_state=True"):
        tfl.value_and_grad(loss_fn)(params, X_GOOD)
    f = jax.jit(tfl.value_and_grad(loss_fn, has_state=True))
    loss, grads, state = f(params, X_GOOD)
    assert int(bn.num_batches_tracked.value) == 0  # nothing written
    assert state["weight"] is None and state["bias"] is None
    assert set(grads) == set(params)
    eager = nn.BatchNorm1d(C)
    with tfl.Session() as s:
        y = eager(s.input(X_GOOD))
        g = s.backward(tfl.sum(y**2.0))
        _close("value_and_grad loss", loss, tfl.sum(y**2.0).value)
        _close("value_and_grad weight grad", grads["weight"], g[eager.weight])
    for n in ("running_mean", "running_var", "num_batches_tracked"):
        _close(f"value_and_grad {n}", state[n], getattr(eager, n).value, tol=1e-6)
    for name, v in state.items():  # the caller writes the state back
        if v is not None:
            params[name].value = v
    assert int(bn.num_batches_tracked.value) == 1
    # a state cell not in params cannot be returned in params' structure
    with pytest.raises(tfl.TapeError, match="not in params"):
        tfl.value_and_grad(loss_fn, has_state=True)({"weight": bn.weight, "bias": bn.bias}, X_GOOD)
    bn.eval()  # eval mode assigns nothing: has_state is not needed
    loss_eval, _ = tfl.value_and_grad(loss_fn)(params, X_GOOD)
    assert np.isfinite(float(loss_eval))


# --------------------------------------------------------------------------- modes


class Inner(nn.Module):
    def __init__(self):
        self.drop = nn.Dropout(0.5)
        self.norms = {"a": nn.BatchNorm1d(2), "b": [nn.BatchNorm2d(2)]}


class Outer(nn.Module):
    def __init__(self):
        self.inner = Inner()
        self.seq = nn.Sequential(nn.Linear(2, 2, key=jax.random.key(0)), self.inner)  # shared sub-module


def test_modes_are_recursive_and_return_the_module():
    m = Outer()
    mods = m.modules()
    assert len(mods) == 7 and all(x.training for x in mods)
    assert m.eval() is m and not any(x.training for x in mods)
    assert m.inner.train() is m.inner  # a sub-tree only
    assert [x.training for x in mods] == [False, True, True, True, True, False, False]
    assert m.train(True) is m and all(x.training for x in mods)
    m.train(False)
    assert not m.inner.norms["b"][0].training


def test_dropout_follows_the_module_mode():
    x = jnp.ones((50, 40), F32)
    drop = nn.Dropout(0.5)
    with tfl.Session(seed=0) as s:
        assert (np.asarray(drop(s.input(x)).value) == 0).any()  # train mode, training session: active
        counter = s.rng_counter
        drop.eval()
        np.testing.assert_array_equal(np.asarray(drop(s.input(x)).value), np.asarray(x))  # eval: identity
        assert s.rng_counter == counter  # no mask drawn
        assert (np.asarray(drop(s.input(x), training=True).value) == 0).any()  # the call overrides the mode
    drop.train()
    with tfl.Session(grad_enabled=False) as s:  # an inference session turns it off in train mode too
        np.testing.assert_array_equal(np.asarray(drop(s.input(x)).value), np.asarray(x))
    with tfl.Session(grad_enabled=False, seed=0) as s:  # the functional tfl.dropout is PyTorch's: training=True
        assert (np.asarray(tfl.dropout(s.input(x), 0.5).value) == 0).any()  # unless told, whatever the session
        np.testing.assert_array_equal(np.asarray(tfl.dropout(s.input(x), 0.5, training=False).value), np.asarray(x))


def test_eval_and_inference_session_give_deterministic_outputs():
    model = nn.Sequential(nn.Linear(3, 4, key=jax.random.key(0)), nn.Dropout(0.5), nn.BatchNorm1d(4))
    with tfl.Session(seed=0) as s:
        model(s.input(X_GOOD))  # one training forward moves the running statistics
    stats = [np.asarray(p.value).copy() for p in model.parameters()]
    model.eval()
    outs = []
    for seed in (0, 1):
        with tfl.Session(seed=seed, grad_enabled=False) as s:
            outs.append(np.asarray(model(s.input(X_GOOD)).value))
            assert s.rng_counter == 0
    np.testing.assert_array_equal(outs[0], outs[1])
    same([np.asarray(p.value) for p in model.parameters()], stats)  # eval: nothing updated


def test_batchnorm_mode_and_session_combine():
    bn = nn.BatchNorm1d(C)
    with tfl.Session(grad_enabled=False) as s:  # train mode, inference session: running statistics, no update
        y = bn(s.input(X_GOOD))
        np.testing.assert_allclose(np.asarray(y.value), X_GOOD / np.sqrt(1.0 + 1e-5), rtol=1e-6)
        assert int(bn.num_batches_tracked.value) == 0
        bn(s.input(X_GOOD), training=True)  # forced: batch statistics and an update, without gradients
        assert int(bn.num_batches_tracked.value) == 1
    bn.eval()
    with tfl.Session() as s:  # eval mode in a training session: running statistics, gradients flow
        x = s.input(X_GOOD, requires_grad=True)
        g = s.backward(tfl.sum(bn(x)))
        rv = np.asarray(bn.running_var.value)
        np.testing.assert_allclose(np.asarray(g[x]), np.broadcast_to(1.0 / np.sqrt(rv + 1e-5), X_GOOD.shape), rtol=1e-6)
        assert int(bn.num_batches_tracked.value) == 1


# --------------------------------------------------------------------------- errors


def test_bad_inputs_and_assignments_are_refused():
    bn1, bn2 = nn.BatchNorm1d(C), nn.BatchNorm2d(C)
    with tfl.Session() as s:
        for layer, x, match in [
            (bn1, np.ones((4, C, 2, 2), F32), r"\(N, C\) or \(N, C, L\)"),
            (bn2, np.ones((4, C), F32), r"\(N, C, H, W\)"),
            (bn1, np.ones((4, C + 1), F32), "num_features=3"),
            (bn1, np.ones((4, C), np.int32), "floating dtype"),
            (bn1, np.ones((1, C), F32), "more than 1 value per channel"),
        ]:
            n = len(s.tape)
            with pytest.raises(tfl.TapeError, match=match):
                layer(s.input(x))
            assert len(s.tape) == n + 1  # only the input leaf
        assert int(bn1.num_batches_tracked.value) == 0
        bn1.eval()
        assert bn1(s.input(np.ones((1, C), F32))).shape == (1, C)  # eval: one sample is fine
        with pytest.raises(tfl.TapeError, match="trainable"):
            s.assign_state(bn1.weight, jnp.zeros(C, F32))
        with pytest.raises(tfl.TapeError, match="keeps its shape"):
            s.assign_state(bn1.running_mean, jnp.zeros(C + 1, F32))
        with pytest.raises(TypeError):
            s.assign_state(jnp.zeros(C), jnp.zeros(C))
    with pytest.raises(ValueError, match="momentum"):
        nn.BatchNorm1d(C, momentum=1.5)


def test_report_max_differences():
    """Not a check: prints the largest differences measured by the tests above (run with -s)."""
    for k in sorted(MEASURED):
        print(f"{k:40s} abs {MEASURED[k][0]:.3g}  scaled {MEASURED[k][1]:.3g}")


# --------------------------------------------------------------------------- mixed precision


@pytest.mark.parametrize("momentum", [0.01, 0.1])
@pytest.mark.parametrize("path", ["eager", "lazy", "train_step"])
def test_running_stats_under_a_bfloat16_policy_move_in_float32_on_every_path(path, momentum):
    """State updates compute in the state cell's dtype: in bfloat16, 1.0 + 0.01 * 0.05 rounds back to 1.0."""
    x = jnp.asarray(1.05 + 0.1 * np.random.default_rng(3).standard_normal((16, C)), jnp.float32)
    bn = nn.BatchNorm1d(C, momentum=momentum)
    bn.running_mean.value = jnp.ones(C, jnp.float32)
    opt = tfl.Optimizer(optax.sgd(0.0), [bn.weight, bn.bias])
    ref = np.ones(C, F32)
    batch = np.asarray(x).mean(axis=0, dtype=F32)  # mean is computed in float32 under the policy
    f = F32(momentum)

    def loss_fn(s):
        return tfl.sum(bn(s.input(x)))

    step = tfl.train_step(loss_fn, opt, compute_dtype=jnp.bfloat16) if path == "train_step" else None
    for _ in range(10):
        if step is not None:
            step()
        else:
            with tfl.Session(lazy=path == "lazy", compute_dtype=jnp.bfloat16) as s:
                opt.step(s.backward(loss_fn(s)))
        ref = ref * (F32(1) - f) + batch * f
    for cell in (bn.running_mean, bn.running_var):
        assert cell.value.dtype == F32
    np.testing.assert_allclose(np.asarray(bn.running_mean.value), ref, rtol=0, atol=1e-6)
    assert int(bn.num_batches_tracked.value) == 10
