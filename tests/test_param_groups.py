"""Parameter groups for training recipes (issue 26): labels, the weight-decay mask, groups, hyperparameters.

The oracles are independent of tapeflow's optimizer code: hand-built label
dicts, ``jax.grad`` of an equivalent pure function with ``optax`` called
directly, ``torch.optim.AdamW`` with two parameter groups, and closed-form
SGD updates with hand-computed learning-rate schedules.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tapeflow as tfl

decay_mask, param_labels = tfl.nn.decay_mask, tfl.nn.param_labels

F64 = np.float64
V, T, D, B = 11, 4, 6, 3  # vocabulary, sequence length, width, batch

# --------------------------------------------------------------------------- a GPT-style model


class GPT(tfl.nn.Module):
    """nanoGPT in miniature: token and position tables, a tied head, LayerNorms, Linear layers with biases.

    ``extras``: a frozen Param and a BatchNorm1d (trainable scale and shift, running statistics as state
    cells), which the forward does not use (they only show up in the labels).
    """

    def __init__(self, key: jax.Array, *, extras: bool = False) -> None:
        k = jax.random.split(key, 4)
        self.wte = tfl.nn.Embedding(V, D, key=k[0], std=0.5, dtype=F64)
        self.wpe = tfl.nn.Embedding(T, D, key=k[1], std=0.5, dtype=F64)
        self.ln_1 = tfl.nn.LayerNorm(D, dtype=F64)
        self.fc = tfl.nn.Linear(D, 2 * D, key=k[2], dtype=F64)
        self.proj = tfl.nn.Linear(2 * D, D, key=k[3], dtype=F64)
        self.ln_f = tfl.nn.LayerNorm(D, dtype=F64)
        if extras:
            self.temperature = tfl.Param(np.ones((2, 2), F64), name="temperature", trainable=False)
            self.bn = tfl.nn.BatchNorm1d(D, dtype=F64)
        self.lm_head = self.wte.tied_output()

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(np.arange(T))
        x = x + self.proj(tfl.tanh(self.fc(self.ln_1(x))))
        return self.lm_head(self.ln_f(x))


def _gpt(extras: bool = False, seed: int = 0) -> GPT:
    model = GPT(jax.random.key(seed), extras=extras)
    # LayerNorms away from their ones/zeros init, so their gradients and decay are visible
    r = np.random.default_rng(seed + 100)
    for ln in (model.ln_1, model.ln_f):
        ln.weight.value = 1.0 + 0.1 * r.standard_normal(D)
        ln.bias.value = 0.1 * r.standard_normal(D)
    return model


def _batches(n: int, seed: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    r = np.random.default_rng(seed)
    return [(r.integers(0, V, (B, T)), r.integers(0, V, (B, T))) for _ in range(n)]


def _loss(model: GPT, ids, targets):
    return tfl.apply("cross_entropy", model(ids), targets)


def _layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + eps) * w + b


def _jax_loss(p: dict, ids, targets):
    """The GPT's loss as a pure function of a params dict keyed by the optimizer's slot keys (no tapeflow)."""
    x = p["wte.weight"][ids] + p["wpe.weight"][jnp.arange(T)]
    h = _layer_norm(x, p["ln_1.weight"], p["ln_1.bias"]) @ p["fc.weight"].T + p["fc.bias"]
    x = x + jnp.tanh(h) @ p["proj.weight"].T + p["proj.bias"]
    logits = _layer_norm(x, p["ln_f.weight"], p["ln_f.bias"]) @ p["wte.weight"].T
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))


def _values(model: GPT) -> dict[str, np.ndarray]:
    return {n: np.array(p.value, copy=True) for n, p in model.named_parameters() if p.trainable}


# the weight-decay split of GPT(extras=True), by hand: matrices decay, the tied wte / lm_head table too (it is
# the head's weight), the untied position table, biases, LayerNorm and BatchNorm Params do not; frozen Params
# and BatchNorm's running statistics have no slot at all
DECAY = {
    "wte.weight": True,
    "wpe.weight": False,
    "ln_1.weight": False,
    "ln_1.bias": False,
    "fc.weight": True,
    "fc.bias": False,
    "proj.weight": True,
    "proj.bias": False,
    "ln_f.weight": False,
    "ln_f.bias": False,
    "bn.weight": False,
    "bn.bias": False,
}
NANOGPT = {**DECAY, "wpe.weight": True}  # nanoGPT decays every parameter of 2 or more dimensions


# --------------------------------------------------------------------------- decay_mask and param_labels


def test_decay_mask_of_a_gpt_equals_the_hand_built_split_and_the_optimizer_keys():
    model = _gpt(extras=True)
    mask = decay_mask(model)
    assert mask == DECAY
    assert list(mask) == tfl.Optimizer(optax.adamw(1e-3), model).slot_keys
    assert decay_mask(model, embeddings=True) == NANOGPT
    assert all(type(v) is bool for v in mask.values())


def test_decay_mask_tie_rule_every_registration_must_be_no_decay():
    # a table tied only to other tables: every registration is an Embedding, so it does not decay
    e1 = tfl.nn.Embedding(V, D, key=jax.random.key(0))
    e2 = tfl.nn.Embedding(V, D, key=jax.random.key(1))
    e2.weight = tfl.tie(e1.weight, name="weight")
    tables = tfl.nn.Sequential(e1, e2)
    assert decay_mask(tables) == {"0.weight": False}
    assert decay_mask(tables, embeddings=True) == {"0.weight": True}
    # the head registered before the table: one key (the head's name), the same answer as the other way round
    head_first = tfl.nn.Sequential(e1.tied_output(), e1)
    assert decay_mask(head_first) == {"0.weight": True}


def test_decay_mask_include_and_exclude_patterns():
    model = _gpt(extras=True)
    # a pattern matching any name of a tied storage decides for the storage
    assert decay_mask(model, exclude="lm_head.weight") == {**DECAY, "wte.weight": False}
    assert decay_mask(model, exclude=["wte.*", "fc.weight"]) == {**DECAY, "wte.weight": False, "fc.weight": False}
    assert decay_mask(model, include="*.bias") == {
        **DECAY,
        **{k: True for k in DECAY if k.endswith(".bias")},
    }
    with pytest.raises(ValueError, match=r"'fc\.bias' .* include pattern '\*\.bias' and exclude pattern 'fc\.\*'"):
        decay_mask(model, include="*.bias", exclude="fc.*")
    with pytest.raises(ValueError, match=r"exclude pattern 'fc\.wieght' matches no parameter .* 'wte\.weight'"):
        decay_mask(model, exclude="fc.wieght")
    with pytest.raises(ValueError, match=r"include pattern 'temperature' matches no parameter .*frozen"):
        decay_mask(model, include="temperature")  # a frozen Param has no slot
    with pytest.raises(TypeError, match=r"exclude holds type .*parameter names or fnmatch patterns"):
        decay_mask(model, exclude=[tfl.nn.Embedding])


def test_param_labels_calls_rule_for_every_registration_of_each_slot():
    model = _gpt(extras=True)
    seen: list[str] = []

    def rule(name, p):
        seen.append(name)
        return "matrix" if p.ndim >= 2 else "vector"

    labels = param_labels(model, rule)
    assert labels == {
        k: "matrix" if k in ("wte.weight", "wpe.weight", "fc.weight", "proj.weight") else "vector" for k in DECAY
    }
    assert list(labels) == tfl.Optimizer(optax.sgd(0.1), model).slot_keys
    # every name of each trainable storage (the tied head's too), nothing of frozen Params or state cells
    assert sorted(seen) == sorted([*DECAY, "lm_head.weight"])


def test_param_labels_conflict_on_a_tied_weight_names_both_paths_and_labels():
    model = _gpt()
    with pytest.raises(ValueError) as e:
        param_labels(model, lambda name, p: name.split(".")[0])
    msg = str(e.value)
    assert "'wte.weight' and 'lm_head.weight' are one storage" in msg
    assert f"storage #{model.wte.weight.storage.uid}" in msg
    assert "labelled them 'wte' and 'lm_head'" in msg
    assert "the same label" in msg and "untie" in msg
    with pytest.raises(TypeError, match=r"expected a tfl\.nn\.Module, got dict"):
        param_labels({"w": model.fc.weight}, lambda n, p: 0)


@pytest.mark.usefixtures("lazy_mode")
def test_param_labels_drive_multi_transform_through_the_optimizer():
    model = _gpt()
    labels = param_labels(model, lambda name, p: "matrix" if p.ndim >= 2 else "vector")
    tx = optax.multi_transform({"matrix": optax.sgd(0.1), "vector": optax.set_to_zero()}, labels)
    opt = tfl.Optimizer(tx, model)
    before = _values(model)
    ids, targets = _batches(1)[0]
    grads = jax.grad(_jax_loss)({k: jnp.asarray(v) for k, v in before.items()}, ids, targets)
    with tfl.Session() as s:
        opt.step(s.backward(_loss(model, ids, targets)))
    after = _values(model)
    for k in before:
        want = before[k] - 0.1 * np.asarray(grads[k]) if labels[k] == "matrix" else before[k]
        np.testing.assert_allclose(after[k], want, rtol=1e-12, atol=1e-14, err_msg=k)


# --------------------------------------------------------------------------- adamw(mask=decay_mask) == optax


@pytest.mark.usefixtures("lazy_mode")
@pytest.mark.parametrize("path", ["eager", "train_step"])
def test_adamw_with_decay_mask_equals_plain_optax(path):
    model = _gpt()
    mask = decay_mask(model)
    opt = tfl.Optimizer(optax.adamw(3e-2, weight_decay=0.5, mask=mask), model)
    # the oracle: jax.grad of the pure function, optax called directly, the hand-built mask
    hand = {k: v for k, v in DECAY.items() if not k.startswith("bn.")}
    tx = optax.adamw(3e-2, weight_decay=0.5, mask=hand)
    params = {k: jnp.asarray(v) for k, v in _values(model).items()}
    state = tx.init(params)
    step = tfl.train_step(lambda s, ids, t: _loss(model, ids, t), opt) if path == "train_step" else None
    for ids, targets in _batches(4):
        if step is not None:
            step(ids, targets)
        else:
            with tfl.Session() as s:
                opt.step(s.backward(_loss(model, ids, targets)))
        g = jax.grad(_jax_loss)(params, ids, targets)
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
    got = _values(model)
    assert sorted(got) == sorted(params)
    for k, v in params.items():
        np.testing.assert_allclose(got[k], np.asarray(v), rtol=1e-10, atol=1e-12, err_msg=k)
    # the mask made a difference: an unmasked decay moves the LayerNorm scales elsewhere
    assert not np.allclose(np.asarray(params["ln_f.weight"]), _unmasked_ln_f(), atol=1e-6)


def _unmasked_ln_f() -> np.ndarray:
    params = {k: jnp.asarray(v) for k, v in _values(_gpt()).items()}
    tx = optax.adamw(3e-2, weight_decay=0.5)
    state = tx.init(params)
    for ids, targets in _batches(4):
        updates, state = tx.update(jax.grad(_jax_loss)(params, ids, targets), state, params)
        params = optax.apply_updates(params, updates)
    return np.asarray(params["ln_f.weight"])


# --------------------------------------------------------------------------- Optimizer.from_groups vs torch


def _torch_loss(torch, p: dict, ids, targets):
    import torch.nn.functional as F

    x = p["wte.weight"][ids] + p["wpe.weight"][torch.arange(T)]
    h = F.layer_norm(x, (D,), p["ln_1.weight"], p["ln_1.bias"], eps=1e-5) @ p["fc.weight"].T + p["fc.bias"]
    x = x + torch.tanh(h) @ p["proj.weight"].T + p["proj.bias"]
    logits = F.layer_norm(x, (D,), p["ln_f.weight"], p["ln_f.bias"], eps=1e-5) @ p["wte.weight"].T
    return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


@pytest.mark.usefixtures("lazy_mode")
def test_from_groups_matches_torch_adamw_with_two_param_groups():
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    model = _gpt()
    named = {n: p for n, p in model.named_parameters() if p.trainable}
    mask = decay_mask(model, embeddings=True)  # nanoGPT's configure_optimizers split
    decay = {n: p for n, p in named.items() if mask[n]}
    no_decay = [p for n, p in named.items() if not mask[n]]  # a list: keyed by Param.name, else group.position
    groups = [
        {"params": decay, "lr": 2e-2, "weight_decay": 0.3},
        {"params": no_decay, "lr": 5e-3, "weight_decay": 0.0},
    ]
    opt = tfl.Optimizer.from_groups(groups, betas=(0.9, 0.95), eps=1e-8)
    assert list(opt.state.inner_states) == [0, 1]
    assert opt.slot_keys[: len(decay)] == list(decay)
    assert len(opt.slot_keys) == len(named) and len(set(opt.slot_keys)) == len(named)

    init = _values(model)
    tp = {n: torch.tensor(np.asarray(p.value), dtype=torch.float64, requires_grad=True) for n, p in named.items()}
    topt = torch.optim.AdamW(
        [
            {"params": [tp[n] for n in decay], "lr": 2e-2, "weight_decay": 0.3},
            {"params": [tp[n] for n in named if not mask[n]], "lr": 5e-3, "weight_decay": 0.0},
        ],
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    for ids, targets in _batches(10):
        with tfl.Session() as s:
            opt.step(s.backward(_loss(model, ids, targets)))
        topt.zero_grad()
        _torch_loss(torch, tp, torch.as_tensor(ids), torch.as_tensor(targets)).backward()
        topt.step()
    moved = 0
    for n, p in named.items():
        want = tp[n].detach().numpy()
        np.testing.assert_allclose(np.asarray(p.value), want, rtol=1e-9, atol=1e-11, err_msg=n)
        moved += not np.allclose(want, init[n])
    assert moved == len(named)


def test_from_groups_keys_defaults_and_a_module_group():
    model = _gpt()
    extra = tfl.Param(np.zeros(3), name="fc.weight")  # its name is taken by the module's: it gets group.position
    opt = tfl.Optimizer.from_groups(
        [{"params": model}, {"params": [extra], "learning_rate": 0.5}], base=optax.sgd, learning_rate=0.25
    )
    assert opt.slot_keys == [*[k for k in DECAY if not k.startswith("bn.")], "1.0"]
    ids, targets = _batches(1)[0]
    before = _values(model)
    g = jax.grad(_jax_loss)({k: jnp.asarray(v) for k, v in before.items()}, ids, targets)
    with tfl.Session() as s:
        opt.step(s.backward(_loss(model, ids, targets) + tfl.sum(extra * np.array([1.0, 2.0, 3.0]))))
    for k, v in _values(model).items():  # group 0 takes the default learning rate
        np.testing.assert_allclose(v, before[k] - 0.25 * np.asarray(g[k]), rtol=1e-12, atol=1e-14, err_msg=k)
    np.testing.assert_allclose(np.asarray(extra.value), [-0.5, -1.0, -1.5], rtol=0, atol=1e-15)  # group 1's own


def test_from_groups_refuses_a_storage_in_two_groups_and_bad_groups():
    model = _gpt()
    with pytest.raises(ValueError) as e:  # tied: one storage under two names
        tfl.Optimizer.from_groups([{"params": [model.wte.weight]}, {"params": [model.lm_head.weight]}])
    msg = str(e.value)
    assert f"storage=#{model.wte.weight.storage.uid}" in msg
    assert "is in group 0 (as 'weight') and in group 1 (as 'weight.tied')" in msg
    assert "put it in one group only" in msg and "tfl.tie" in msg
    with pytest.raises(ValueError, match=r"in group 0 \(as 'a'\) and in group 1 \(as 'b'\)"):
        tfl.Optimizer.from_groups([{"params": {"a": model.fc.bias}}, {"params": {"b": model.fc.bias}}])
    with pytest.raises(TypeError, match=r"group 1 is dict without a params entry"):
        tfl.Optimizer.from_groups([{"params": model}, {"lr": 1e-3}])
    with pytest.raises(TypeError, match=r"groups must be a non-empty list of dicts"):
        tfl.Optimizer.from_groups({"params": model})
    with pytest.raises(ValueError, match=r"group 0 gives both lr and learning_rate"):
        tfl.Optimizer.from_groups([{"params": model, "lr": 1e-3, "learning_rate": 1e-3}])
    with pytest.raises(
        TypeError, match=r"group 0: adamw\(\*\*.*'momentum': 0\.9.*keyword arguments of base \(learning_rate, b1"
    ):
        tfl.Optimizer.from_groups([{"params": model, "momentum": 0.9}])
    with pytest.raises(TypeError, match=r"group 0: Optimizer: position 0 holds int, expected a tfl\.Param"):
        tfl.Optimizer.from_groups([{"params": [1]}])


# --------------------------------------------------------------------------- hyperparameters between steps


def _linear(dtype=F64):
    """w with loss sum(w * c): the gradient is c at every step, so SGD's values are closed-form."""
    w = tfl.Param(np.array([1.0, 2.0], dtype), name="w")
    c = np.array([1.0, 4.0], dtype)
    return w, c, lambda s: tfl.sum(w * c)


@pytest.mark.usefixtures("lazy_mode")
def test_set_hyperparams_eagerly_changes_the_next_step_and_compiles_nothing():
    w, c, loss_fn = _linear(np.float32)  # float32 parameters under x64: the hyperparameter is float32 too
    opt = tfl.Optimizer(optax.inject_hyperparams(optax.sgd)(learning_rate=0.5), [w])

    def step():
        with tfl.Session() as s:
            opt.step(s.backward(loss_fn(s)))

    step()
    step()  # everything compiled
    np.testing.assert_array_equal(np.asarray(w.value), np.array([1.0, 2.0], np.float32) - 2 * 0.5 * c)
    kept = opt.state
    with tfl.compile_log(file=None) as log:
        opt.set_hyperparams(learning_rate=0.125)
        step()
    assert log.tapeflow_records() == []
    lr = opt.state.hyperparams["learning_rate"]
    assert lr.dtype == np.float32 and float(lr) == 0.125
    assert float(kept.hyperparams["learning_rate"]) == 0.5  # the old state was not written in place
    np.testing.assert_array_equal(np.asarray(w.value), np.array([1.0, 2.0], np.float32) - (1.0 + 0.125) * c)
    # the log does see a recompile: a Python float written by hand changes the update's signature
    with tfl.compile_log(file=None) as log:
        opt.state.hyperparams["learning_rate"] = 0.125
        step()
    assert log.tapeflow_records() != []


def test_set_hyperparams_under_train_step_does_not_retrace():
    w, c, loss_fn = _linear()
    opt = tfl.Optimizer(optax.inject_hyperparams(optax.sgd)(learning_rate=0.5), [w])
    step = tfl.train_step(loss_fn, opt)
    lrs = [0.5, 0.25, 0.0, 1.0, 0.125]
    for k, lr in enumerate(lrs):
        if k:
            opt.set_hyperparams(learning_rate=lr)
        step()
    assert step.trace_count == 1
    np.testing.assert_allclose(np.asarray(w.value), np.array([1.0, 2.0]) - sum(lrs) * c, rtol=1e-15)


def test_set_hyperparams_per_group_of_from_groups():
    a = tfl.Param(np.array([1.0, 1.0]), name="a")
    b = tfl.Param(np.array([2.0]), name="b")
    opt = tfl.Optimizer.from_groups(
        [{"params": [a], "lr": 0.5}, {"params": [b], "lr": 0.25}], base=optax.inject_hyperparams(optax.sgd)
    )
    step = tfl.train_step(lambda s: tfl.sum(a) + 2.0 * tfl.sum(b), opt)
    step()  # a -= 0.5, b -= 0.25 * 2
    opt.set_hyperparams(group=1, learning_rate=0.0)  # freeze group 1 only
    step()  # a -= 0.5
    opt.set_hyperparams(learning_rate=0.125)  # every group, as `for g in param_groups: g["lr"] = lr`
    step()  # a -= 0.125, b -= 0.125 * 2
    assert step.trace_count == 1
    np.testing.assert_allclose(np.asarray(a.value), [1.0 - 1.125] * 2, rtol=1e-15)
    np.testing.assert_allclose(np.asarray(b.value), [2.0 - 0.5 - 0.25], rtol=1e-15)
    hyper = {g: float(opt.state.inner_states[g].inner_state.hyperparams["learning_rate"]) for g in (0, 1)}
    assert hyper == {0: 0.125, 1: 0.125}
    with pytest.raises(
        ValueError, match=r"no group 2 with an inject_hyperparams state; this optimizer's groups are \[0, 1\]"
    ):
        opt.set_hyperparams(group=2, learning_rate=0.1)


def _warmup_cosine(t: int, peak: float, end: float, warmup: int, total: int) -> float:
    """nanoGPT's shape: linear warmup from 0 to ``peak``, then half a cosine down to ``end`` at ``total``."""
    if t < warmup:
        return peak * t / warmup
    if t >= total:
        return end
    return end + (peak - end) * 0.5 * (1.0 + math.cos(math.pi * (t - warmup) / (total - warmup)))


@pytest.mark.parametrize("path", ["eager", "train_step"])
def test_warmup_cosine_schedule_matches_the_hand_computed_learning_rates(path):
    w, c, loss_fn = _linear()
    peak, end, warmup, total, steps = 0.1, 0.01, 3, 8, 10
    sched = optax.warmup_cosine_decay_schedule(0.0, peak, warmup, total, end)
    opt = tfl.Optimizer(optax.inject_hyperparams(optax.sgd)(learning_rate=sched), [w])
    step = tfl.train_step(loss_fn, opt) if path == "train_step" else None
    want = np.array([1.0, 2.0])
    for t in range(steps):
        if step is not None:
            step()
        else:
            with tfl.Session() as s:
                opt.step(s.backward(loss_fn(s)))
        lr = _warmup_cosine(t, peak, end, warmup, total)
        want = want - lr * c
        # optax evaluates a schedule in float32, whatever the parameters' dtype
        assert float(opt.state.hyperparams["learning_rate"]) == pytest.approx(lr, rel=1e-6, abs=1e-12), t
        np.testing.assert_allclose(np.asarray(w.value), want, rtol=1e-6)
    assert step is None or step.trace_count == 1
    with pytest.raises(ValueError, match=r"'learning_rate' of opt\.state follows a schedule"):
        opt.set_hyperparams(learning_rate=0.5)


def test_set_hyperparams_errors_and_writes_nothing_on_a_refusal():
    w, _, _ = _linear()
    with pytest.raises(
        TypeError, match=r"holds no optax\.inject_hyperparams state.*optax\.inject_hyperparams\(optax\.adamw\)"
    ):
        tfl.Optimizer(optax.adam(1e-3), [w]).set_hyperparams(learning_rate=0.1)
    opt = tfl.Optimizer(optax.inject_hyperparams(optax.adamw)(learning_rate=0.5), [w])
    before = opt.state
    with pytest.raises(
        TypeError,
        match=r"'lr' is not a hyperparameter of opt\.state; its hyperparameters are \['b1', 'b2', 'eps', 'eps_root', 'learning_rate', 'weight_decay'\]",
    ):
        opt.set_hyperparams(learning_rate=0.1, lr=0.1)  # learning_rate checked fine, then lr refused
    assert opt.state is before and float(opt.state.hyperparams["learning_rate"]) == 0.5
    with pytest.raises(
        ValueError, match=r"'learning_rate' of opt\.state holds a value of shape \(\), got one of shape \(2,\)"
    ):
        opt.set_hyperparams(learning_rate=[0.1, 0.2])
    with pytest.raises(TypeError, match=r"must be a number, got function.*pass it to inject_hyperparams"):
        opt.set_hyperparams(learning_rate=optax.constant_schedule(0.1))
    with pytest.raises(ValueError, match=r"this optimizer's state has no groups"):
        opt.set_hyperparams(group=0, learning_rate=0.1)
    with pytest.raises(TypeError, match=r"no values given"):
        opt.set_hyperparams()
    with pytest.raises(tfl.StateWriteError, match=r"is being traced by JAX"):
        jax.jit(lambda lr: opt.set_hyperparams(learning_rate=lr))(0.1)
    assert opt.state is before
    opt.set_hyperparams(learning_rate=0.1, weight_decay=0.0)
    assert float(opt.state.hyperparams["learning_rate"]) == 0.1 and float(opt.state.hyperparams["weight_decay"]) == 0.0
