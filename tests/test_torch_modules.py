"""tfl.nn's PyTorch modules against torch.nn: each built with the same arguments on both sides.

For every case: torch's ``state_dict`` loads into the tapeflow module with
``strict=True``, tapeflow's ``state_dict()`` has torch's keys and shapes, the
parameters are named as torch names them, and the forward outputs and every
parameter gradient (and the float inputs' gradients) equal torch autograd's.
Then each module runs in a lazy session and under ``train_step`` with the
eager gradients. Also: buffers, train/eval modes, the default seed stream
(no ``key=``), containers, clones and the GPT-2 ``transpose=`` rule.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tapeflow as tfl
from tapeflow import nn

torch = pytest.importorskip("torch")
torch.set_num_threads(1)
tnn = torch.nn

TOL = 2e-5


@dataclass
class Case:
    name: str
    make: Callable[[Any], Any]  # make(nn or torch.nn) -> module
    inputs: Callable[[np.random.Generator], tuple]  # positional inputs (numpy)
    kwargs: Callable[[np.random.Generator], dict] = field(default=lambda rng: {})
    train: bool = False  # compare in train mode (default eval: dropout off)
    grad_inputs: bool = True  # compare float inputs' gradients


def _f(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _enc_layer(m):
    return m.TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation="gelu", batch_first=True, norm_first=True)


CASES = [
    Case("Linear", lambda m: m.Linear(4, 3), lambda r: (_f(r, 2, 4),)),
    Case("Linear-nobias", lambda m: m.Linear(4, 4, bias=False), lambda r: (_f(r, 3, 4),)),
    Case("Conv1d", lambda m: m.Conv1d(4, 6, 3, padding="same", groups=2), lambda r: (_f(r, 2, 4, 7),)),
    Case("Conv1d-dilated", lambda m: m.Conv1d(2, 3, 3, stride=2, padding=2, dilation=2), lambda r: (_f(r, 2, 2, 9),)),
    Case("Conv2d-depthwise", lambda m: m.Conv2d(4, 4, 3, padding=1, groups=4), lambda r: (_f(r, 2, 4, 5, 5),)),
    Case("Conv2d", lambda m: m.Conv2d(3, 4, (3, 2), stride=2, dilation=(1, 2)), lambda r: (_f(r, 2, 3, 7, 7),)),
    Case(
        "ConvTranspose2d",
        lambda m: m.ConvTranspose2d(4, 2, 3, stride=2, padding=1, output_padding=1),
        lambda r: (_f(r, 1, 4, 3, 3),),
    ),
    Case("MaxPool1d", lambda m: m.MaxPool1d(2), lambda r: (_f(r, 2, 3, 6),)),
    Case("MaxPool2d", lambda m: m.MaxPool2d(3, stride=2, padding=1), lambda r: (_f(r, 2, 3, 5, 5),)),
    Case("AvgPool2d", lambda m: m.AvgPool2d(2), lambda r: (_f(r, 2, 3, 4, 4),)),
    Case("AdaptiveAvgPool2d", lambda m: m.AdaptiveAvgPool2d((2, 3)), lambda r: (_f(r, 2, 3, 5, 7),)),
    Case("BatchNorm1d-train", lambda m: m.BatchNorm1d(3), lambda r: (_f(r, 4, 3, 2),), train=True),
    Case("BatchNorm2d-eval", lambda m: m.BatchNorm2d(3), lambda r: (_f(r, 2, 3, 2, 2),)),
    Case("LayerNorm", lambda m: m.LayerNorm((3, 4)), lambda r: (_f(r, 2, 3, 4),)),
    Case("GroupNorm", lambda m: m.GroupNorm(2, 4), lambda r: (_f(r, 2, 4, 3),)),
    Case("RMSNorm", lambda m: m.RMSNorm(4, eps=1e-6), lambda r: (_f(r, 2, 3, 4),)),
    Case("Embedding", lambda m: m.Embedding(10, 4, padding_idx=1), lambda r: (np.array([[1, 2, 1], [3, 9, 0]]),)),
    Case("Identity", lambda m: m.Identity(), lambda r: (_f(r, 2, 3),)),
    Case("Flatten", lambda m: m.Flatten(), lambda r: (_f(r, 2, 3, 4),)),
    Case("Unflatten", lambda m: m.Unflatten(1, (2, 3)), lambda r: (_f(r, 2, 6),)),
    Case("ReLU", lambda m: m.ReLU(), lambda r: (_f(r, 2, 5),)),
    Case("GELU", lambda m: m.GELU(), lambda r: (_f(r, 2, 5),)),
    Case("GELU-tanh", lambda m: m.GELU(approximate="tanh"), lambda r: (_f(r, 2, 5),)),
    Case("SiLU", lambda m: m.SiLU(), lambda r: (_f(r, 2, 5),)),
    Case("Tanh", lambda m: m.Tanh(), lambda r: (_f(r, 2, 5),)),
    Case("Sigmoid", lambda m: m.Sigmoid(), lambda r: (_f(r, 2, 5),)),
    Case("Softmax", lambda m: m.Softmax(dim=1), lambda r: (_f(r, 2, 5),)),
    Case("LeakyReLU", lambda m: m.LeakyReLU(0.2), lambda r: (_f(r, 2, 5),)),
    Case("ELU", lambda m: m.ELU(0.5), lambda r: (_f(r, 2, 5),)),
    Case(
        "MultiheadAttention",
        lambda m: m.MultiheadAttention(8, 2, batch_first=True),
        lambda r: (_f(r, 2, 4, 8), _f(r, 2, 5, 8), _f(r, 2, 5, 8)),
        lambda r: {"key_padding_mask": np.array([[False] * 5, [False] * 3 + [True] * 2])},
    ),
    Case(
        "MultiheadAttention-kvdim",
        lambda m: m.MultiheadAttention(8, 4, kdim=3, vdim=5),
        lambda r: (_f(r, 4, 2, 8), _f(r, 5, 2, 3), _f(r, 5, 2, 5)),
        lambda r: {"attn_mask": np.triu(np.ones((4, 5), bool), 1), "average_attn_weights": False},
    ),
    Case(
        "TransformerEncoderLayer",
        _enc_layer,
        lambda r: (_f(r, 2, 5, 8),),
        lambda r: {"src_key_padding_mask": np.array([[False] * 5, [False] * 4 + [True]])},
    ),
    Case(
        "TransformerEncoder",
        lambda m: m.TransformerEncoder(
            m.TransformerEncoderLayer(8, 2, 16, dropout=0.0), 2, norm=m.LayerNorm(8), enable_nested_tensor=False
        ),
        lambda r: (_f(r, 5, 2, 8),),
        lambda r: {"mask": np.triu(np.full((5, 5), -np.inf, np.float32), 1)},
    ),
    Case(
        "GRU",
        lambda m: m.GRU(3, 4, num_layers=2, batch_first=True, bidirectional=True),
        lambda r: (_f(r, 2, 3, 3), _f(r, 4, 2, 4)),
    ),
    Case("LSTM", lambda m: m.LSTM(3, 4, num_layers=2), lambda r: (_f(r, 3, 2, 3), (_f(r, 2, 2, 4), _f(r, 2, 2, 4)))),
    Case("LSTM-unbatched", lambda m: m.LSTM(3, 4, bidirectional=True), lambda r: (_f(r, 3, 3),)),
    Case("GRUCell", lambda m: m.GRUCell(3, 4), lambda r: (_f(r, 2, 3), _f(r, 2, 4))),
    Case("LSTMCell", lambda m: m.LSTMCell(3, 4), lambda r: (_f(r, 2, 3), (_f(r, 2, 4), _f(r, 2, 4)))),
    Case(
        "Sequential",
        lambda m: m.Sequential(OrderedDict(fc=m.Linear(4, 3), act=m.Tanh(), out=m.Linear(3, 2))),
        lambda r: (_f(r, 2, 4),),
    ),
    Case("Upsample-nearest", lambda m: m.Upsample(scale_factor=2), lambda r: (_f(r, 1, 2, 2, 3),)),
    Case(
        "Upsample-bilinear",
        lambda m: m.Upsample(size=(3, 5), mode="bilinear", align_corners=False),
        lambda r: (_f(r, 1, 2, 2, 3),),
    ),
    Case(
        "CrossEntropyLoss",
        lambda m: m.CrossEntropyLoss(
            weight=torch.tensor([1.0, 2.0, 0.5]) if m is tnn else np.array([1.0, 2.0, 0.5], np.float32),
            label_smoothing=0.1,
        ),
        lambda r: (_f(r, 4, 3), np.array([0, 2, 1, 2])),
    ),
    Case("NLLLoss", lambda m: m.NLLLoss(ignore_index=0), lambda r: (_f(r, 4, 3), np.array([0, 2, 1, 2]))),
    Case("MSELoss", lambda m: m.MSELoss(), lambda r: (_f(r, 2, 3), _f(r, 2, 3))),
    Case("L1Loss", lambda m: m.L1Loss(reduction="sum"), lambda r: (_f(r, 2, 3), _f(r, 2, 3))),
    Case("HuberLoss", lambda m: m.HuberLoss(delta=0.5), lambda r: (_f(r, 2, 3), _f(r, 2, 3))),
    Case(
        "BCEWithLogitsLoss",
        lambda m: m.BCEWithLogitsLoss(
            pos_weight=torch.tensor([2.0, 1.0, 0.5]) if m is tnn else np.array([2.0, 1.0, 0.5], np.float32)
        ),
        lambda r: (_f(r, 2, 3), (r.random((2, 3)) > 0.5).astype(np.float32)),
    ),
]


def _to_torch(v, requires_grad):
    if isinstance(v, tuple):
        return tuple(_to_torch(u, requires_grad) for u in v)
    t = torch.from_numpy(np.asarray(v))
    if requires_grad and t.is_floating_point():
        t.requires_grad_(True)
    return t


def _leaves(out):
    if isinstance(out, (tuple, list)):
        return [leaf for o in out for leaf in _leaves(o)]
    return [] if out is None else [out]


def _flat_inputs(v):
    return [u for w in v for u in _flat_inputs(w)] if isinstance(v, tuple) else [v]


def _build(case, rng):
    """Both modules, torch's weights (perturbed buffers included) loaded into tapeflow, and the inputs."""
    torch.manual_seed(0)
    tm = case.make(tnn)
    for _, b in tm.named_buffers():  # non-trivial running statistics for the eval cases
        if b.is_floating_point():
            b.copy_(torch.from_numpy(rng.random(tuple(b.shape)).astype(np.float32) + 0.5))
    m = case.make(nn)
    sd = tm.state_dict()
    assert m.load_state_dict(sd, strict=True) == ([], [])
    mine = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert mine == {k: tuple(v.shape) for k, v in sd.items()}
    assert list(mine) == list(sd)
    assert [n for n, _ in m.named_parameters()] == [n for n, _ in tm.named_parameters()]
    assert [n for n, _ in m.named_buffers()] == [n for n, b in tm.named_buffers() if b is not None]
    tm.train(case.train)
    m.train(case.train)
    return tm, m, case.inputs(rng), case.kwargs(rng)


def _torch_run(tm, args, kwargs, weights_seed):
    targs = _to_torch(args, True)
    tkw = {k: (_to_torch(v, False) if isinstance(v, np.ndarray) else v) for k, v in kwargs.items()}
    out = _leaves(tm(*targs, **tkw))
    ws = [
        np.random.default_rng(weights_seed + i).standard_normal(tuple(o.shape)).astype(np.float32)
        for i, o in enumerate(out)
    ]
    loss = sum((o * torch.from_numpy(w)).sum() for o, w in zip(out, ws))
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in tm.named_parameters() if p.grad is not None}
    in_grads = [t.grad.numpy() if t.grad is not None else None for t in _flat_inputs(targs)]
    return [o.detach().numpy() for o in out], ws, float(loss), grads, in_grads


def _tfl_loss(m, s, args, kwargs, ws, grad_inputs):
    def enter(v):
        if isinstance(v, tuple):
            return tuple(enter(u) for u in v)
        float_in = np.issubdtype(np.dtype(v.dtype), np.floating)
        return s.input(v, requires_grad=grad_inputs and float_in)

    xs = enter(args)
    out = _leaves(m(*xs, **kwargs))
    loss = None
    for o, w in zip(out, ws):
        term = (o * w).sum()
        loss = term if loss is None else loss + term
    return xs, out, loss


def _assert_close(a, b, what):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL, err_msg=what)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_module_matches_torch(case):
    rng = np.random.default_rng(0)
    tm, m, args, kwargs = _build(case, rng)
    outs, ws, tloss, tgrads, tin_grads = _torch_run(tm, args, kwargs, 1)
    with tfl.Session() as s:
        xs, out, loss = _tfl_loss(m, s, args, kwargs, ws, case.grad_inputs)
        assert len(out) == len(outs)
        for i, (a, b) in enumerate(zip(out, outs)):
            _assert_close(a.value, b, f"output {i}")
        g = s.backward(loss, wrt=[x for x in _flat_inputs(xs) if x.requires_grad])
        for name, p in m.named_parameters():
            assert name in tgrads, name
            _assert_close(g[p], tgrads[name], f"grad {name}")
        if case.grad_inputs:
            for x, tg in zip(_flat_inputs(xs), tin_grads):
                if x.requires_grad and tg is not None:
                    _assert_close(g[x], tg, "input grad")
    for name, b in tm.named_buffers():  # BatchNorm in train mode: the running statistics moved as torch's
        _assert_close(dict(m.named_buffers())[name].value, b.numpy(), f"buffer {name}")


# A lazy session and train_step give the eager gradients (a handful of cases with parameters of every kind).
PATH_CASES = [
    c
    for c in CASES
    if c.name
    in {
        "Linear",
        "Conv1d",
        "Conv2d-depthwise",
        "ConvTranspose2d",
        "BatchNorm1d-train",
        "LayerNorm",
        "GroupNorm",
        "RMSNorm",
        "Embedding",
        "MultiheadAttention",
        "TransformerEncoderLayer",
        "GRU",
        "LSTM",
        "GRUCell",
        "LSTMCell",
        "CrossEntropyLoss",
    }
]


@pytest.mark.parametrize("case", PATH_CASES, ids=[c.name for c in PATH_CASES])
def test_module_runs_lazy_and_in_train_step(case):
    rng = np.random.default_rng(0)
    _, m, args, kwargs = _build(case, rng)
    ws = [
        np.random.default_rng(1 + i).standard_normal(o.shape).astype(np.float32)
        for i, o in enumerate(_leaves(_shapes(m, args, kwargs)))
    ]
    params = m.parameters()
    start = [np.array(p.value) for p in params]
    buffers = [np.array(b.value) for b in m.buffers()]

    def restore():
        for p, v in zip(params, start):
            p.value = v
        for b, v in zip(m.buffers(), buffers):
            b.value = v

    with tfl.Session() as s:
        _, _, loss = _tfl_loss(m, s, args, kwargs, ws, False)
        eager_loss = float(loss.value)
        g = s.backward(loss)
        eager = {id(p): np.array(g[p]) for p in params}
    after_eager = [np.array(b.value) for b in m.buffers()]
    restore()
    with tfl.Session(lazy=True) as s:
        _, _, loss = _tfl_loss(m, s, args, kwargs, ws, False)
        g = s.backward(loss)
        for p in params:
            _assert_close(g[p], eager[id(p)], f"lazy grad {p.name}")
        assert abs(float(s.value(loss)) - eager_loss) <= 1e-4 * max(1.0, abs(eager_loss))
    restore()
    opt = tfl.Optimizer(optax.sgd(0.1), m)
    step = tfl.train_step(lambda s, *a: _tfl_loss(m, s, a, kwargs, ws, False)[2], opt)
    got = float(step(*args))
    assert abs(got - eager_loss) <= 1e-4 * max(1.0, abs(eager_loss))
    for p, v in zip(params, start):  # one SGD step with the eager gradient
        _assert_close(p.value, v - 0.1 * eager[id(p)], f"train_step update {p.name}")
    for b, v in zip(m.buffers(), after_eager):  # state cells updated as the eager forward updated them
        _assert_close(b.value, v, "train_step buffer")
    restore()


def _shapes(m, args, kwargs):
    with tfl.Session(grad_enabled=False) as s:
        ins = tuple(tuple(s.input(u) for u in a) if isinstance(a, tuple) else s.input(a) for a in args)
        return m(*ins, **kwargs)


# --------------------------------------------------------------------------- infrastructure


def test_batchnorm_buffers_are_not_parameters():
    bn, tbn = nn.BatchNorm2d(3), tnn.BatchNorm2d(3)
    assert len(bn.parameters()) == len(list(tbn.parameters())) == 2
    assert [n for n, _ in bn.named_buffers()] == [n for n, _ in tbn.named_buffers()]
    assert list(bn.state_dict()) == list(tbn.state_dict())
    assert set(bn.param_dict()) == set(tbn.state_dict())  # value_and_grad(has_state=True) sees the state cells
    assert [n for n, _ in bn.parameter_records()] == list(tbn.state_dict())  # checkpoints store the buffers
    opt = tfl.Optimizer(optax.sgd(0.1), bn)  # no optimizer slot for a buffer
    assert len(opt.params) == 2 if hasattr(opt, "params") else True
    assert not nn.BatchNorm1d(3, track_running_stats=False).buffers()


def test_register_buffer_persistent_and_none():
    m = nn.Module()
    m.register_buffer("a", np.ones(2, np.float32))
    m.register_buffer("b", np.zeros(2, np.float32), persistent=False)
    m.register_buffer("c", None)
    assert [n for n, _ in m.named_buffers()] == ["a", "b"]
    assert list(m.state_dict()) == ["a"]
    assert m.parameters() == [] and m.c is None
    with pytest.raises(KeyError, match="not a buffer"):
        m.__dict__["w"] = tfl.Param(jnp.ones(1))
        m.register_buffer("w", np.ones(1))


def test_checkpoint_restores_buffers(tmp_path):
    bn = nn.BatchNorm1d(2)
    with tfl.Session() as s:
        bn(s.input(np.array([[1.0, 2.0], [3.0, 5.0]], np.float32)))
    saved = {n: np.array(b.value) for n, b in bn.named_buffers()}
    tfl.save(tmp_path / "ck", bn)
    fresh = nn.BatchNorm1d(2)
    tfl.restore(tmp_path / "ck", fresh)
    for n, b in fresh.named_buffers():
        np.testing.assert_array_equal(b.value, saved[n])


def test_module_methods_match_torch_names():
    def net(m):
        return m.Sequential(m.Conv2d(1, 2, 3), m.BatchNorm2d(2), m.ReLU(), m.Flatten(), m.Linear(8, 3))

    a, b = net(nn), net(tnn)
    assert [n for n, _ in a.named_modules()] == [n for n, _ in b.named_modules()]
    assert [n for n, _ in a.named_children()] == [n for n, _ in b.named_children()]
    assert len(a.children()) == len(list(b.children())) and len(a.modules()) == len(list(b.modules()))
    assert [n for n, _ in a.named_parameters(prefix="net")] == [n for n, _ in b.named_parameters(prefix="net")]
    assert [n for n, _ in a.named_parameters(recurse=False)] == []
    assert a.eval() is a and not any(m.training for m in a.modules())
    assert a.train() is a and all(m.training for m in a.modules())
    a.requires_grad_(False)
    assert not any(p.trainable for p in a.parameters()) and not any(bf.trainable for bf in a.buffers())
    a.requires_grad_()
    assert all(p.trainable for p in a.parameters())


def test_containers():
    ml = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    ml.insert(0, nn.LayerNorm(2))
    assert [n for n, _ in ml.named_parameters()][:2] == ["0.weight", "0.bias"]
    assert isinstance(ml[1:], nn.ModuleList) and len(ml[1:]) == 2
    md = nn.ModuleDict({"a": nn.Linear(2, 1)})
    md["b"] = nn.Linear(1, 1)
    assert list(md) == ["a", "b"] and "a" in md
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    assert isinstance(seq[:2], nn.Sequential) and [n for n, _ in seq[:2].named_parameters()] == ["0.weight", "0.bias"]
    with pytest.raises(TypeError, match=r"not a tfl\.nn\.Module"):
        nn.ModuleList([3])


def test_no_key_needed_and_manual_seed():
    nn.init.manual_seed(7)
    a = nn.Linear(3, 2).weight.value
    b = nn.Linear(3, 2).weight.value
    nn.init.manual_seed(7)
    assert np.array_equal(nn.Linear(3, 2).weight.value, a)
    assert not np.array_equal(a, b)  # each layer draws the next key
    import jax

    k = jax.random.key(1)
    assert np.array_equal(nn.Linear(3, 2, key=k).weight.value, nn.Linear(3, 2, key=k).weight.value)
    bound = 1 / np.sqrt(3)
    assert float(np.max(np.abs(a))) <= bound  # PyTorch's init range


def test_transformer_encoder_clones_share_initial_values_not_storage():
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16), 2)
    w0, w1 = enc.layers[0].linear1.weight, enc.layers[1].linear1.weight
    assert w0.storage is not w1.storage and np.array_equal(w0.value, w1.value)
    assert len(enc.parameters()) == 2 * len(enc.layers[0].parameters())


def test_tied_embedding_round_trips_state_dict():
    emb = nn.Embedding(6, 4)
    lm = nn.Sequential(emb, nn.Linear(4, 4), emb.tied_output())
    sd = lm.state_dict()
    assert sd["0.weight"] is sd["2.weight"]
    t = tnn.Sequential(tnn.Embedding(6, 4), tnn.Linear(4, 4), tnn.Linear(4, 6, bias=False))
    t[2].weight = t[0].weight
    assert lm.load_state_dict(t.state_dict()) == ([], [])
    np.testing.assert_array_equal(lm[2].weight.value, t[0].weight.detach().numpy())


def test_gpt2_conv1d_weights_load_with_transpose():
    """transformers' GPT-2 ``Conv1D`` keeps weights as (in, out): ``transpose=`` regexes load them into Linear layers."""

    class Attn(nn.Module):
        def __init__(self):
            self.c_attn = nn.Linear(4, 12)
            self.c_proj = nn.Linear(4, 4)

    class Block(nn.Module):
        def __init__(self):
            self.ln_1 = nn.LayerNorm(4)
            self.attn = Attn()

    model = nn.ModuleDict({"h": nn.ModuleList([Block(), Block()])})
    rng = np.random.default_rng(0)
    conv1d = {k: v.T.copy() if k.endswith("c_attn.weight") or k.endswith("c_proj.weight") else v for k, v in (
        (k, rng.standard_normal(v.shape).astype(np.float32)) for k, v in model.state_dict().items())}  # fmt: skip
    pattern = r"h\.\d+\.attn\.(c_attn|c_proj)\.weight"
    with pytest.raises(ValueError, match="expected float32\\[12,4\\]"):
        model.load_state_dict(conv1d)
    assert model.load_state_dict(conv1d, transpose=[pattern]) == ([], [])
    got = model["h"][1].attn.c_attn.weight.value
    np.testing.assert_array_equal(got, conv1d["h.1.attn.c_attn.weight"].T)
    with pytest.raises(ValueError, match="matches no key"):
        model.load_state_dict(conv1d, transpose=[pattern, r"wte\.weight"])
    with torch.no_grad():  # the forward is x @ conv1d_weight + bias, as GPT-2's Conv1D computes it
        x = rng.standard_normal((2, 4)).astype(np.float32)
        with tfl.Session() as s:
            y = model["h"][0].attn.c_attn(s.input(x)).value
        ref = x @ conv1d["h.0.attn.c_attn.weight"] + conv1d["h.0.attn.c_attn.bias"]
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


def test_dropout_p_and_modes():
    d = nn.Dropout()
    assert d.p == 0.5
    x = np.ones((1000,), np.float32)
    with tfl.Session(seed=0) as s:
        y = np.asarray(d(s.input(x)).value)
        assert set(np.unique(y)) <= {0.0, 2.0} and 0.3 < (y == 0).mean() < 0.7
        assert np.array_equal(d.eval()(s.input(x)).value, x)
    with pytest.raises(ValueError, match="p must be in"):
        nn.Dropout(1.5)


def test_summary_counts_buffers_once():
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    sm = nn.summary(net, np.ones((2, 3), np.float32))
    assert sm.total_params == 3 * 4 + 4 + 4 + 4 + 4 + 4 + 1
    assert sm.trainable_params == 3 * 4 + 4 + 4 + 4


def test_every_torch_nn_namesake_is_a_module_entry_of_the_surface_table():
    import inspect

    import torch

    from tapeflow._shell._surface import SURFACE

    namesakes = [n for n in tfl.nn.__all__ if inspect.isclass(getattr(tfl.nn, n, None)) and hasattr(torch.nn, n)]
    assert "Linear" in namesakes and "MaxPool2d" in namesakes
    missing = [n for n in namesakes if n not in SURFACE or SURFACE[n].bind != {"nn"}]
    assert not missing, f"tfl.nn classes PyTorch also has, with no records='module' entry: {missing}"
    assert all(SURFACE[n].records == "module" and SURFACE[n].fn is getattr(tfl.nn, n) for n in namesakes)
