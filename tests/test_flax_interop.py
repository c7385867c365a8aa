"""tfl.nn.load_nnx_state / nnx_state against Flax NNX: an MLP, a CNN with BatchNorm, a tied-embedding LM.

Flax NNX is channels-last (NHWC, HWIO kernels); the tapeflow models are NCHW /
OIHW, so the inputs and outputs are transposed and the import maps the kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _interop_models import CNN, LM, D, H, L, V

import tapeflow as tfl
from tapeflow import nn

nnx = pytest.importorskip("flax.nnx")

TOL = 1e-5


def _max_diff(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b)))


def _values(model):
    return [np.array(p.value) for p in model.parameters()]


def _unchanged(model, before):
    return all(np.array_equal(a, np.asarray(p.value)) for a, p in zip(before, model.parameters()))


# --------------------------------------------------------------------------- models


class FlaxMLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List(
            [nnx.Linear(5, 16, rngs=rngs), nnx.Linear(16, 8, rngs=rngs), nnx.Linear(8, 3, rngs=rngs)]
        )

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = nnx.relu(x)
        return x


class FlaxCNN(nnx.Module):
    def __init__(self, rngs):
        self.conv1 = nnx.Conv(3, 8, (3, 3), padding=1, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(8, epsilon=1e-5, use_running_average=True, rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, (3, 3), padding="VALID", rngs=rngs)
        self.fc = nnx.Linear(16 * 2 * 2, 10, rngs=rngs)

    def __call__(self, x):  # x: NHWC
        x = nnx.max_pool(nnx.relu(self.bn(self.conv1(x))), (2, 2), (2, 2))
        x = nnx.avg_pool(nnx.relu(self.conv2(x)), (2, 2), (2, 2))
        return self.fc(x.transpose(0, 3, 1, 2).reshape(x.shape[0], -1))  # flatten as NCHW, as tapeflow does


class FlaxLM(nnx.Module):
    def __init__(self, rngs):
        self.emb = nnx.Embed(V, D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=H, in_features=D, decode=False, rngs=rngs)
        self.ln = nnx.LayerNorm(D, epsilon=1e-5, rngs=rngs)

    def __call__(self, ids):
        h = self.emb(ids)
        h = self.ln(h + self.attn(h, mask=nnx.make_causal_mask(ids)))
        return self.emb.attend(h)  # tied output projection


def _randomize(fmodel, seed=5):
    """Move every Flax variable (biases, scales, BatchNorm statistics included) off its initial value."""
    rng = np.random.default_rng(seed)
    for path, v in nnx.to_flat_state(nnx.state(fmodel, (nnx.Param, nnx.BatchStat))):
        new = rng.standard_normal(v[...].shape).astype(v[...].dtype) * 0.5
        v[...] = jnp.asarray(np.abs(new) + 0.5 if path[-1] == "var" else new)  # a variance stays positive
    return fmodel


def _mlp():
    x = np.random.default_rng(0).standard_normal((6, 5)).astype(np.float32)
    return _randomize(FlaxMLP(nnx.Rngs(0))), nn.MLP([5, 16, 8, 3], key=jax.random.key(1)), x, x


def _cnn():
    x = np.random.default_rng(1).standard_normal((4, 3, 12, 12)).astype(np.float32)
    return _randomize(FlaxCNN(nnx.Rngs(0))), CNN(jax.random.key(2)), x, x.transpose(0, 2, 3, 1)


def _lm():
    ids = np.random.default_rng(2).integers(0, V, (3, L)).astype(np.int32)
    return _randomize(FlaxLM(nnx.Rngs(0))), LM(jax.random.key(3)), ids, ids


MODELS = {"mlp": _mlp, "cnn": _cnn, "lm": _lm}


def _tfl_out(model, x):
    model.eval()
    with tfl.Session(grad_enabled=False) as s:
        return model(s.input(x) if x.dtype.kind == "f" else jnp.asarray(x)).value


# --------------------------------------------------------------------------- import, export


@pytest.mark.parametrize("kind", ["mlp", "cnn", "lm"])
def test_import_gives_the_same_outputs(kind):
    fmodel, model, x, fx = MODELS[kind]()
    assert tfl.nn.load_nnx_state(model, nnx.state(fmodel)) == ([], [])  # head.weight: filled through its tie
    d = _max_diff(_tfl_out(model, x), fmodel(jnp.asarray(fx)))
    print(f"flax {kind}: import, max output difference {d:.2e}")
    assert d <= TOL


@pytest.mark.parametrize("kind", ["mlp", "cnn", "lm"])
def test_export_update_gives_the_same_outputs(kind):
    fmodel, model, x, fx = MODELS[kind]()
    st = tfl.nn.nnx_state(model)
    assert isinstance(st, nnx.State)
    flat_mine = {k for k, _ in nnx.to_flat_state(st)}
    flat_theirs = {k for k, _ in nnx.to_flat_state(nnx.state(fmodel, (nnx.Param, nnx.BatchStat)))}
    assert flat_mine == flat_theirs  # the same paths (a tied storage once, as nnx.state lists it)
    nnx.update(fmodel, st)
    d = _max_diff(_tfl_out(model, x), fmodel(jnp.asarray(fx)))
    print(f"flax {kind}: export -> nnx.update, max output difference {d:.2e}")
    assert d <= TOL


def test_plain_sequential_keeps_flax_layers_path():
    k1, k2 = jax.random.split(jax.random.key(0))
    seq = nn.Sequential(nn.Linear(4, 6, key=k1), tfl.relu, nn.Linear(6, 2, key=k2))
    fseq = _randomize(nnx.Sequential(nnx.Linear(4, 6, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(6, 2, rngs=nnx.Rngs(1))))
    tfl.nn.load_nnx_state(seq, nnx.state(fseq))
    x = np.ones((3, 4), np.float32)
    assert _max_diff(_tfl_out(seq, x), fseq(jnp.asarray(x))) <= TOL
    assert list(tfl.nn.state_dict(seq, layout="flax")) == [
        "layers.0.kernel",
        "layers.0.bias",
        "layers.2.kernel",
        "layers.2.bias",
    ]


def test_batchnorm_counter_is_left_alone_and_dropout_rng_state_skipped():
    class WithDropout(nnx.Module):
        def __init__(self, rngs):
            self.bn = nnx.BatchNorm(3, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

    class Mine(nn.Module):
        def __init__(self):
            self.bn = nn.BatchNorm1d(3)
            self.drop = nn.Dropout(0.1)

    f, m = _randomize(WithDropout(nnx.Rngs(0))), Mine()
    m.bn.num_batches_tracked.value = jnp.asarray(4, jnp.int32)
    assert tfl.nn.load_nnx_state(m, nnx.state(f)) == ([], [])  # RngState skipped, no counter expected
    assert int(m.bn.num_batches_tracked.value) == 4
    assert np.array_equal(m.bn.running_mean.value, f.bn.mean[...])
    assert "num_batches_tracked" not in tfl.nn.state_dict(m, layout="flax")


# --------------------------------------------------------------------------- checks


def test_missing_unexpected_shape_errors_change_nothing():
    fmodel, model, *_ = _mlp()
    state = nnx.to_pure_dict(nnx.state(fmodel))
    before = _values(model)
    del state["layers"][2]["bias"]
    with pytest.raises(ValueError, match=r"missing keys: 'layers.2.bias'"):
        tfl.nn.load_nnx_state(model, state)
    assert _unchanged(model, before)
    res = tfl.nn.load_nnx_state(model, state, strict=False)
    assert res.missing_keys == ["layers.2.bias"] and res.unexpected_keys == []

    model2 = nn.MLP([5, 16, 8, 3], key=jax.random.key(9))
    state["layers"][1]["kernel"] = state["layers"][1]["kernel"].T
    before = _values(model2)
    with pytest.raises(ValueError, match=r"'layers.1.kernel': got float32\[8,16\], expected float32\[16,8\]"):
        tfl.nn.load_nnx_state(model2, state, strict=False)
    assert _unchanged(model2, before)


def test_shared_variable_needs_a_tied_destination():
    class Shared(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(3, 3, rngs=rngs)
            self.b = self.a  # one module, two paths: nnx.state lists it once

    class Untied(nn.Module):
        def __init__(self):
            self.a = nn.Linear(3, 3, key=jax.random.key(0))
            self.b = nn.Linear(3, 3, key=jax.random.key(1))

    st = nnx.state(Shared(nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"missing keys: 'b.kernel', 'b.bias'"):
        tfl.nn.load_nnx_state(Untied(), st)
    flat = {"a": dict(st["a"]), "b": dict(st["a"])}  # the same Variables under both paths
    with pytest.raises(ValueError, match=r"'a.kernel', 'b.kernel' are one tensor"):
        tfl.nn.load_nnx_state(Untied(), flat)


def test_recurrent_cells_have_no_flax_counterpart():
    cell = nn.GRUCell(3, 4, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"GRUCell at '<root>' has no Flax NNX counterpart"):
        tfl.nn.nnx_state(cell)
    with pytest.raises(ValueError, match="no Flax NNX counterpart"):
        tfl.nn.load_nnx_state(nn.Sequential(cell), {})
