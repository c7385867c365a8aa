"""tfl.nn.load_state_dict / state_dict against PyTorch: an MLP, a CNN with BatchNorm and a tied-embedding LM.

Each PyTorch model is built with the names of the tapeflow model's paths (see
``tapeflow/nn/_interop.py``); loading its ``state_dict`` must give the same
outputs, gradients and parameters after an optimizer step on both sides, and the
export must load back into PyTorch. Errors (keys, shapes, dtypes, ties) must
leave the tapeflow model unchanged.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _interop_models import CNN, LM, D, H, L, V

import tapeflow as tfl
from tapeflow import nn

TOL = 1e-5


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    return torch


def _max_diff(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def _assert_close(tfl_dict, torch_dict, skip=None):
    """Every key in both agrees within TOL (except where ``skip[key]`` is True); returns the largest difference."""
    keys = [k for k in tfl_dict if k in torch_dict]
    assert keys
    worst = 0.0
    for k in keys:
        a, b = np.asarray(tfl_dict[k], np.float64), np.asarray(torch_dict[k], np.float64)
        assert a.shape == b.shape, (k, a.shape, b.shape)
        keep = ~skip[k] if skip is not None and k in skip else np.ones(a.shape, bool)
        d = float(np.max(np.abs(a - b)[keep], initial=0.0))
        assert d <= TOL, f"{k}: max difference {d}"
        worst = max(worst, d)
    return worst


def _values(model):
    """Every storage's value (a snapshot to compare after a rejected load)."""
    return [np.array(p.value) for p in model.parameters()]


def _unchanged(model, before):
    return all(np.array_equal(a, np.asarray(p.value)) for a, p in zip(before, model.parameters()))


def _torch_sd(torch, tmodel):
    return {k: v.detach().numpy().copy() for k, v in tmodel.state_dict().items()}


def _grads_as_torch(model, grads):
    """The tapeflow gradients in PyTorch's names and layouts (written into the model, exported, restored)."""
    saved = [(p, p.value) for p in model.parameters()]
    try:
        for p in model.parameters():
            if p.trainable:
                p.value = grads[p]
        return tfl.nn.state_dict(model)
    finally:
        for p, v in saved:
            p.value = v


def _torch_grads(tmodel):
    return {k: p.grad.numpy() for k, p in tmodel.named_parameters()}


# --------------------------------------------------------------------------- the three models


def _mlp_pair(torch):
    class TorchMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(5, 16), torch.nn.Linear(16, 8), torch.nn.Linear(8, 3)])

        def forward(self, x):
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i < len(self.layers) - 1:
                    x = torch.relu(x)
            return x

    torch.manual_seed(0)
    return (
        TorchMLP(),
        nn.MLP([5, 16, 8, 3], key=jax.random.key(1)),
        np.random.default_rng(0).standard_normal((6, 5)).astype(np.float32),
    )


def _cnn_pair(torch):
    tnn = torch.nn

    class TorchCNN(tnn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = tnn.Conv2d(3, 8, 3, padding=1, bias=False)
            self.bn = tnn.BatchNorm2d(8)
            self.conv2 = tnn.Conv2d(8, 16, 3)
            self.fc = tnn.Linear(16 * 2 * 2, 10)

        def forward(self, x):
            x = tnn.functional.max_pool2d(torch.relu(self.bn(self.conv1(x))), 2)
            x = tnn.functional.avg_pool2d(torch.relu(self.conv2(x)), 2)
            return self.fc(x.flatten(1))

    torch.manual_seed(0)
    tmodel = TorchCNN()
    rng = np.random.default_rng(1)
    with torch.no_grad():  # move the running statistics away from 0 and 1 first
        for _ in range(3):
            tmodel(torch.from_numpy(rng.standard_normal((4, 3, 12, 12)).astype(np.float32) * 2 + 1))
    return tmodel, CNN(jax.random.key(2)), rng.standard_normal((4, 3, 12, 12)).astype(np.float32)


def _lm_pair(torch):
    tnn = torch.nn

    class TorchLM(tnn.Module):
        def __init__(self):
            super().__init__()
            self.emb = tnn.Embedding(V, D)
            self.attn = tnn.MultiheadAttention(D, H, batch_first=True)
            self.ln = tnn.LayerNorm(D)
            self.head = tnn.Linear(D, V, bias=False)
            self.head.weight = self.emb.weight  # tied: one tensor under two names

        def forward(self, ids):
            h = self.emb(ids)
            causal = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), 1)
            a, _ = self.attn(h, h, h, attn_mask=causal, need_weights=False)
            return self.head(self.ln(h + a))

    torch.manual_seed(0)
    ids = np.random.default_rng(2).integers(0, V, (3, L))
    return TorchLM(), LM(jax.random.key(3)), ids


PAIRS = {"mlp": _mlp_pair, "cnn": _cnn_pair, "lm": _lm_pair}


def _torch_input(torch, x):
    return torch.from_numpy(x) if x.dtype.kind == "f" else torch.from_numpy(x.astype(np.int64))


def _tfl_input(s, x):
    return s.input(x) if x.dtype.kind == "f" else jnp.asarray(x, jnp.int32)


def _loss_weights(shape):
    return np.random.default_rng(9).standard_normal(shape).astype(np.float32)


# --------------------------------------------------------------------------- outputs, gradients, one step


@pytest.mark.parametrize("kind", ["mlp", "cnn", "lm"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_loaded_model_matches_torch_forward_backward_and_step(torch, kind, optimizer):
    tmodel, model, x = PAIRS[kind](torch)
    result = tfl.nn.load_state_dict(model, tmodel.state_dict())
    assert result == ([], []) and result.missing_keys == [] and result.unexpected_keys == []

    tout = tmodel(_torch_input(torch, x))
    w = _loss_weights(tuple(tout.shape))
    (tout * torch.from_numpy(w)).sum().backward()
    topt = torch.optim.SGD(tmodel.parameters(), lr=0.1) if optimizer == "sgd" else torch.optim.Adam(tmodel.parameters())
    opt = tfl.Optimizer(optax.sgd(0.1) if optimizer == "sgd" else optax.adam(1e-3), model)

    with tfl.Session() as s:
        out = model(_tfl_input(s, x))
        g = s.backward(tfl.sum(out * w))
        out_diff = _max_diff(out.value, tout.detach().numpy())
        assert out_diff <= TOL
        grad_diff = _assert_close(_grads_as_torch(model, g), _torch_grads(tmodel))
        topt.step()
        opt.step(g)
    # Adam's first step is lr * g / (|g| + eps): where the gradient is zero in exact arithmetic (the key bias of
    # attention; float noise of ~1e-9 on both sides) it is lr times the sign of noise, so those entries are skipped
    tiny = {k: np.abs(v) < 1e-4 for k, v in _torch_grads(tmodel).items()} if optimizer == "adam" else None
    # running statistics (cnn) moved in the forward on both sides; parameters after one step
    step_diff = _assert_close(tfl.nn.state_dict(model), _torch_sd(torch, tmodel), skip=tiny)
    print(f"{kind}/{optimizer}: output {out_diff:.2e}, gradients {grad_diff:.2e}, after the step {step_diff:.2e}")


@pytest.mark.parametrize("kind", ["mlp", "cnn", "lm"])
def test_export_loads_into_torch_and_gives_the_same_outputs(torch, kind):
    tmodel, model, x = PAIRS[kind](torch)  # tmodel's own weights differ from the tapeflow model's
    sd = tfl.nn.state_dict(model)
    assert list(sd) == list(tmodel.state_dict())  # the same names, in PyTorch's order
    assert all(isinstance(v, np.ndarray) and v.flags.writeable for v in sd.values())
    tmodel.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})  # strict
    model.eval()
    tmodel.eval()
    with tfl.Session(grad_enabled=False) as s, torch.no_grad():
        d = _max_diff(model(_tfl_input(s, x)).value, tmodel(_torch_input(torch, x)).numpy())
    assert d <= TOL
    if kind == "lm":
        assert sd["emb.weight"] is sd["head.weight"]  # a tied storage: one array under both names
        assert tmodel.head.weight is tmodel.emb.weight  # still tied after loading
    if kind == "cnn":
        assert sd["bn.num_batches_tracked"].dtype == np.int64


def test_tapeflow_round_trip_keeps_ties_and_values():
    a, b = LM(jax.random.key(0)), LM(jax.random.key(1))
    assert tfl.nn.load_state_dict(b, tfl.nn.state_dict(a)) == ([], [])
    assert all(np.array_equal(x, y) for x, y in zip(_values(a), _values(b)))
    assert b.head.weight.storage is b.emb.weight.storage


def test_plain_sequential_names_match_torch_sequential(torch):
    torch.manual_seed(0)
    tseq = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    k1, k2 = jax.random.split(jax.random.key(0))
    seq = nn.Sequential(nn.Linear(4, 6, key=k1), tfl.relu, nn.Linear(6, 2, key=k2))
    assert list(tfl.nn.state_dict(seq)) == list(tseq.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    tfl.nn.load_state_dict(seq, tseq.state_dict())
    x = np.ones((3, 4), np.float32)
    with tfl.Session() as s, torch.no_grad():
        assert _max_diff(seq(s.input(x)).value, tseq(torch.from_numpy(x)).numpy()) <= TOL


def test_sources_numpy_and_jax_arrays_and_torch_bfloat16(torch):
    tmodel, model, x = _mlp_pair(torch)
    sd = tmodel.state_dict()
    for conv in (lambda t: t.detach().numpy(), lambda t: jnp.asarray(t.detach().numpy())):
        fresh = nn.MLP([5, 16, 8, 3], key=jax.random.key(7))
        tfl.nn.load_state_dict(fresh, {k: conv(v) for k, v in sd.items()})
        assert np.array_equal(fresh.layers[0].weight.value, sd["layers.0.weight"].numpy())
    lin = nn.Linear(3, 2, key=jax.random.key(0), dtype=jnp.bfloat16)
    tlin = torch.nn.Linear(3, 2, dtype=torch.bfloat16)
    tfl.nn.load_state_dict(lin, tlin.state_dict())
    assert np.array_equal(np.asarray(lin.weight.value, np.float32), tlin.weight.detach().float().numpy())


def test_loaded_values_do_not_alias_the_source(torch):
    tlin = torch.nn.Linear(3, 2)
    lin = nn.Linear(3, 2, key=jax.random.key(0))
    tfl.nn.load_state_dict(lin, tlin.state_dict())
    before = np.array(lin.bias.value)
    with torch.no_grad():
        tlin.bias.add_(1.0)
    assert np.array_equal(before, np.asarray(lin.bias.value))


# --------------------------------------------------------------------------- keys, shapes, dtypes


def test_missing_and_unexpected_keys(torch):
    tmodel, model, _ = _mlp_pair(torch)
    sd = dict(tmodel.state_dict())
    del sd["layers.2.bias"]
    sd["layers.3.weight"] = torch.zeros(2, 2)
    before = _values(model)
    with pytest.raises(ValueError, match=r"missing keys: 'layers.2.bias'") as e:
        tfl.nn.load_state_dict(model, sd)
    assert "unexpected keys: 'layers.3.weight'" in str(e.value) and "nothing was changed" in str(e.value)
    assert _unchanged(model, before)

    res = tfl.nn.load_state_dict(model, sd, strict=False)
    assert res == (["layers.2.bias"], ["layers.3.weight"])
    assert res.missing_keys == ["layers.2.bias"] and res.unexpected_keys == ["layers.3.weight"]
    assert np.array_equal(model.layers[2].bias.value, before[5])  # the missing one kept its value
    assert np.array_equal(model.layers[0].weight.value, sd["layers.0.weight"].numpy())


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda sd: sd.update({"layers.2.weight": sd["layers.2.weight"].T}), r"'layers.2.weight': got float32\[8,3\]"),
        (lambda sd: sd.update({"layers.1.bias": sd["layers.1.bias"].double()}), r"got float64\[8\], expected float32"),
        (lambda sd: sd.update({"layers.1.bias": "nope"}), r"expected an array"),
    ],
    ids=["shape", "dtype", "not-an-array"],
)
def test_shape_and_dtype_errors_change_nothing(torch, bad, message):
    tmodel, model, _ = _mlp_pair(torch)
    sd = dict(tmodel.state_dict())
    bad(sd)
    before = _values(model)
    with pytest.raises(ValueError, match=message):
        tfl.nn.load_state_dict(model, sd, strict=False)
    assert _unchanged(model, before)  # layers.0 was fine, and still nothing was installed


def test_meta_and_sparse_tensors_are_refused_by_key_with_nothing_loaded(torch):
    """Neither holds dense data to copy: one ValueError names every such key, not torch's own error."""
    tmodel, model, _ = _mlp_pair(torch)
    sd = dict(tmodel.state_dict())
    sd["layers.0.weight"] = torch.empty(sd["layers.0.weight"].shape, device="meta")
    sd["layers.1.bias"] = sd["layers.1.bias"].to_sparse()
    sd["layers.2.weight"] = sd["layers.2.weight"].to_sparse_csr()
    before = _values(model)
    with pytest.raises(ValueError) as e:
        tfl.nn.load_state_dict(model, sd)
    msg = str(e.value)
    assert "nothing was changed" in msg
    assert re.search(r"'layers.0.weight': .*meta device", msg)
    assert re.search(r"'layers.1.bias': .*sparse_coo.*to_dense\(\)", msg)
    assert re.search(r"'layers.2.weight': .*sparse_csr.*to_dense\(\)", msg)
    assert _unchanged(model, before)


def test_mha_packed_in_proj_shape_is_checked(torch):
    tmodel, model, _ = _lm_pair(torch)
    sd = dict(tmodel.state_dict())
    sd["attn.in_proj_weight"] = sd["attn.in_proj_weight"][: 2 * D]
    before = _values(model)
    with pytest.raises(ValueError, match=r"'attn.in_proj_weight': got float32\[16,8\], expected float32\[24,8\]"):
        tfl.nn.load_state_dict(model, sd)
    assert _unchanged(model, before)


def test_error_names_the_layer_and_the_layout(torch):
    lin = nn.Linear(3, 2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"Linear at '<root>' holds float32\[2,3\]; PyTorch layout: as stored"):
        tfl.nn.load_state_dict(lin, {"weight": np.zeros((3, 2), np.float32), "bias": np.zeros(2, np.float32)})


# --------------------------------------------------------------------------- ties


def test_tied_source_into_untied_destination_is_an_error(torch):
    tmodel, _, _ = _lm_pair(torch)
    untied = LM(jax.random.key(3), tied=False)  # head is its own Linear(D, V): shapes fit, storages differ
    before = _values(untied)
    with pytest.raises(ValueError, match=r"'emb.weight', 'head.weight' are one tensor .* separate storages here"):
        tfl.nn.load_state_dict(untied, tmodel.state_dict())
    assert _unchanged(untied, before)


def test_tied_destination_needs_one_tensor(torch):
    tmodel, model, _ = _lm_pair(torch)
    sd = dict(tmodel.state_dict())
    before = _values(model)
    for other in (sd["emb.weight"].clone(), torch.zeros_like(sd["emb.weight"])):  # equal values, different ones
        with pytest.raises(ValueError, match=r"'emb.weight' and 'head.weight' are one storage here"):
            tfl.nn.load_state_dict(model, {**sd, "head.weight": other})
        assert _unchanged(model, before)


def test_tied_destination_accepts_shared_memory_and_one_of_the_names(torch):
    tmodel, model, _ = _lm_pair(torch)
    sd = tmodel.state_dict()
    as_numpy = {k: v.detach().numpy() for k, v in sd.items()}  # distinct ndarrays viewing one memory
    assert as_numpy["emb.weight"] is not as_numpy["head.weight"]
    assert tfl.nn.load_state_dict(model, as_numpy) == ([], [])
    deduplicated = {k: v for k, v in sd.items() if k != "head.weight"}  # a checkpoint that kept one name
    assert tfl.nn.load_state_dict(model, deduplicated) == ([], [])
    without_both = {k: v for k, v in sd.items() if k not in ("head.weight", "emb.weight")}
    assert tfl.nn.load_state_dict(model, without_both, strict=False).missing_keys == ["emb.weight", "head.weight"]


# --------------------------------------------------------------------------- BatchNorm buffers, recurrent cells


@pytest.mark.parametrize("dims", [1, 2])
def test_batchnorm_buffers_load_and_eval_matches(torch, dims):
    torch.manual_seed(0)
    tbn = (torch.nn.BatchNorm1d if dims == 1 else torch.nn.BatchNorm2d)(4)
    shape = (5, 4, 3) if dims == 1 else (5, 4, 3, 3)
    rng = np.random.default_rng(0)
    for _ in range(3):
        tbn(torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * 3 + 2))
    with torch.no_grad():
        tbn.weight.mul_(1.5)
        tbn.bias.add_(0.25)
    bn = (nn.BatchNorm1d if dims == 1 else nn.BatchNorm2d)(4)
    tfl.nn.load_state_dict(bn, tbn.state_dict())
    assert int(bn.num_batches_tracked.value) == 3 and bn.num_batches_tracked.dtype == np.int32
    assert _max_diff(bn.running_var.value, tbn.running_var.numpy()) == 0.0
    x = rng.standard_normal(shape).astype(np.float32)
    bn.eval()
    tbn.eval()
    with tfl.Session(grad_enabled=False) as s, torch.no_grad():
        assert _max_diff(bn(s.input(x)).value, tbn(torch.from_numpy(x)).numpy()) <= TOL


def test_integer_counter_must_fit(torch):
    bn = nn.BatchNorm1d(2)
    sd = tfl.nn.state_dict(bn)
    sd["num_batches_tracked"] = np.array(2**40, np.int64)
    with pytest.raises(ValueError, match="do not fit int32"):
        tfl.nn.load_state_dict(bn, sd)
    sd["num_batches_tracked"] = np.array(7, np.int16)  # any integer dtype that fits
    tfl.nn.load_state_dict(bn, sd)
    assert int(bn.num_batches_tracked.value) == 7


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_recurrent_cells_load_as_stored(torch, kind):
    torch.manual_seed(0)
    tcell = (torch.nn.GRUCell if kind == "gru" else torch.nn.LSTMCell)(3, 5)
    cell = (nn.GRUCell if kind == "gru" else nn.LSTMCell)(3, 5, key=jax.random.key(0))
    tfl.nn.load_state_dict(cell, tcell.state_dict())
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    with tfl.Session() as s, torch.no_grad():
        out, tout = cell(s.input(x)), tcell(torch.from_numpy(x))
        out, tout = (out[0], tout[0]) if kind == "lstm" else (out, tout)
        assert _max_diff(out.value, tout.numpy()) <= TOL
    assert list(tfl.nn.state_dict(cell)) == list(tcell.state_dict())


def test_layout_argument_is_checked():
    with pytest.raises(ValueError, match="layout must be 'torch' or 'flax'"):
        tfl.nn.state_dict(nn.LayerNorm(2), layout="jax")
    with pytest.raises(TypeError, match=r"expected a tfl\.nn\.Module"):
        tfl.nn.state_dict(object())
