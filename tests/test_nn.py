"""tapeflow.nn: parameter discovery/dedup, layers against plain-JAX references, tied LM training."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tapeflow as tfl
from tapeflow import nn

pytestmark = pytest.mark.usefixtures("lazy_mode")  # every test runs with eager and with lazy sessions

F64 = jnp.float64


def keys(n: int, seed: int = 0):
    return list(jax.random.split(jax.random.key(seed), n))


# --------------------------------------------------------------------------- discovery and dedup


def test_shared_linear_in_sequential_listed_once():
    k1, k2 = keys(2)
    lin = nn.Linear(3, 3, key=k1)
    head = nn.Linear(3, 2, key=k2)
    model = nn.Sequential(lin, tfl.relu, lin, head)

    assert [id(p) for p in model.parameters()] == [id(lin.weight), id(lin.bias), id(head.weight), id(head.bias)]
    assert [n for n, _ in model.named_parameters()] == [
        "0.weight",
        "0.bias",
        "3.weight",
        "3.bias",
    ]
    recs = model.parameter_records()
    assert [n for n, _ in recs] == [
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
        "3.weight",
        "3.bias",
    ]
    assert recs[2][1] is lin.weight and recs[3][1] is lin.bias
    assert list(model.param_dict()) == [n for n, _ in model.named_parameters()]

    opt = tfl.Optimizer(optax.adam(1e-3), model)
    assert len(opt.params) == 4
    assert [q is p for q, p in zip(opt.params, model.parameters())] == [True] * 4
    mu = opt.state[0].mu
    assert sorted(mu) == sorted(n for n, _ in model.named_parameters())


class _TiedBlock(nn.Module):
    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.embed = nn.Embedding(7, 4, key=k1)
        self.norm = nn.LayerNorm(4)
        self.proj = nn.Linear(4, 4, key=k2)
        self.head = self.embed.tied_output(name="head")

    def forward(self, ids):
        return self.head(self.proj(self.norm(self.embed(ids))))


def test_embedding_with_tied_output_dedup():
    m = _TiedBlock(jax.random.key(1))
    names = ["embed.weight", "norm.weight", "norm.bias", "proj.weight", "proj.bias"]
    assert [n for n, _ in m.named_parameters()] == names
    assert m.parameters()[0] is m.embed.weight
    recs = m.parameter_records()
    assert [n for n, _ in recs] == names + ["head.weight"]
    tied = recs[-1][1]
    assert tied is m.head.weight and tied is not m.embed.weight
    assert tied.storage is m.embed.weight.storage and tied.name == "head"
    assert tfl.canonical_indices([p.storage for _, p in recs]) == [0, 1, 2, 3, 4, 0]
    assert m.num_parameters() == 7 * 4 + 4 + 4 + 16 + 4

    opt = tfl.Optimizer(optax.adam(1e-3), m)
    assert len(opt.params) == 5
    assert opt.params[0] is m.embed.weight and opt.storages[0] is m.embed.weight.storage
    # a pytree of Params with each storage once is accepted by value_and_grad
    loss, g = tfl.value_and_grad(lambda s, ids: tfl.sum(m(ids)))(m.param_dict(), jnp.array([1, 2]))
    assert sorted(g) == sorted(names)  # a dict pytree comes back with sorted keys (JAX convention)


class _Containers(nn.Module):
    def __init__(self, key):
        k = keys(4, 3)
        self.first = tfl.Param(jnp.zeros(2), name="first")
        self.blocks = {"a": nn.Linear(2, 2, key=k[0]), "b": [nn.Linear(2, 1, key=k[1], bias=False)]}
        self.pair = (nn.LayerNorm(2), tfl.Param(jnp.ones(3)))
        self.note = "not a parameter"
        self.fn = tfl.relu
        self.alias = self.first  # the same record again


def test_containers_definition_order_and_repr():
    m = _Containers(None)
    assert [n for n, _ in m.named_parameters()] == [
        "first",
        "blocks.a.weight",
        "blocks.a.bias",
        "blocks.b.0.weight",
        "pair.0.weight",
        "pair.0.bias",
        "pair.1",
    ]
    assert [n for n, _ in m.parameter_records()][-1] == "alias"
    assert [n for n, _ in m.named_modules()] == ["", "blocks.a", "blocks.b.0", "pair.0"]
    text = repr(m)
    assert text.splitlines()[0] == "_Containers()"
    assert "(blocks.a): Linear(in_features=2, out_features=2, bias=True)" in text
    assert "float32[2,2]" in text  # shapes and dtypes read as everywhere else (registry fmt_spec)

    lin = nn.Linear(2, 2, key=jax.random.key(0))
    r = repr(nn.Sequential(lin, tfl.relu, lin))
    assert "(1): relu" in r and "same module as 0" in r


def test_module_contains_itself_does_not_recurse_forever():
    seq = nn.Sequential(nn.Linear(2, 2, key=jax.random.key(0)))
    seq.append(seq)
    assert len(seq.parameters()) == 2
    assert "same module as <root>" in repr(seq)


# --------------------------------------------------------------------------- layers vs plain JAX


def _check_layer(module, ref, *inputs, rtol=1e-10, atol=1e-10, jit=False):
    """Forward and parameter gradients of sum(module(x) * c) eagerly and via value_and_grad vs jax.grad(ref)."""
    pd = module.param_dict()
    vals = {k: jnp.asarray(p.value) for k, p in pd.items()}
    y_ref = jax.jit(ref)(vals, *inputs)
    c = jax.random.normal(jax.random.key(42), y_ref.shape, y_ref.dtype)
    g_ref = jax.jit(jax.grad(lambda v, c, *xs: jnp.sum(ref(v, *xs) * c)))(vals, c, *inputs)

    with tfl.Session() as s:
        y = module(*[s.input(x) for x in inputs])
        np.testing.assert_allclose(np.asarray(y.value), np.asarray(y_ref), rtol=rtol, atol=atol)
        grads = s.backward(tfl.sum(y * c))
        for name, p in pd.items():
            np.testing.assert_allclose(
                np.asarray(grads[p]), np.asarray(g_ref[name]), rtol=rtol, atol=atol, err_msg=name
            )

    f = tfl.value_and_grad(lambda s, *xs: tfl.sum(module(*xs) * c))
    if jit:
        f = jax.jit(f)
    loss, g = f(pd, *inputs)
    np.testing.assert_allclose(float(loss), float(jnp.sum(y_ref * c)), rtol=max(rtol, 1e-12), atol=atol)
    assert set(g) == set(g_ref)
    for name in g_ref:
        np.testing.assert_allclose(np.asarray(g[name]), np.asarray(g_ref[name]), rtol=rtol, atol=atol, err_msg=name)


def test_linear_matches_jax():
    lin = nn.Linear(5, 3, key=jax.random.key(0), dtype=F64)
    x = jax.random.normal(jax.random.key(1), (2, 4, 5), F64)
    _check_layer(lin, lambda v, x: x @ v["weight"].T + v["bias"], x)
    nob = nn.Linear(5, 3, key=jax.random.key(0), bias=False, dtype=F64)
    assert nob.bias is None and len(nob.parameters()) == 1
    _check_layer(nob, lambda v, x: x @ v["weight"].T, x)


def test_embedding_matches_jax_with_repeated_ids():
    emb = nn.Embedding(6, 3, key=jax.random.key(0), dtype=F64)
    ids = jnp.array([[0, 2, 2], [5, 2, 0]])
    _check_layer(emb, lambda v, i: v["weight"][i], ids)
    # the repeated id accumulates: row 2 is used three times
    with tfl.Session() as s:
        g = s.backward(tfl.sum(emb(s.input(ids))))
        np.testing.assert_allclose(np.asarray(g[emb.weight])[:, 0], [2, 0, 3, 0, 0, 1])


def test_embedding_attend_and_tied_output():
    emb = nn.Embedding(6, 3, key=jax.random.key(0), dtype=F64)
    h = jax.random.normal(jax.random.key(1), (2, 3), F64)
    out = emb.tied_output()
    assert out.weight.storage is emb.weight.storage and out.weight is not emb.weight
    _check_layer(out, lambda v, h: h @ v["weight"].T, h)

    class Attend(nn.Module):
        def __init__(self, e):
            self.e = e

        def forward(self, h):
            return self.e.attend(h)

    _check_layer(Attend(emb), lambda v, h: h @ v["e.weight"].T, h)


def test_layer_norm_matches_jax():
    ln = nn.LayerNorm(4, eps=1e-3, dtype=F64)
    ln.weight.value = jax.random.normal(jax.random.key(5), (4,), F64)
    ln.bias.value = jax.random.normal(jax.random.key(6), (4,), F64)
    x = jax.random.normal(jax.random.key(7), (3, 2, 4), F64)

    def ref(v, x):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / jnp.sqrt(var + 1e-3) * v["weight"] + v["bias"]

    _check_layer(ln, ref, x)

    ln2 = nn.LayerNorm((2, 4), dtype=F64)
    assert ln2.weight.shape == (2, 4)

    def ref2(v, x):
        mu = x.mean((-2, -1), keepdims=True)
        var = ((x - mu) ** 2).mean((-2, -1), keepdims=True)
        return (x - mu) / jnp.sqrt(var + 1e-5) * v["weight"] + v["bias"]

    _check_layer(ln2, ref2, x, rtol=1e-9, atol=1e-9)


def test_conv2d_matches_lax():
    stride, padding = 2, 1
    conv = nn.Conv2d(3, 4, (3, 2), key=jax.random.key(0), stride=stride, padding=padding, dtype=F64)
    assert conv.weight.shape == (4, 3, 3, 2) and conv.bias.shape == (4,)
    x = jax.random.normal(jax.random.key(1), (2, 3, 7, 6), F64)

    def ref(v, x):
        y = jax.lax.conv_general_dilated(
            x, v["weight"], (stride, stride), [(padding, padding)] * 2, dimension_numbers=("NCHW", "OIHW", "NCHW")
        )
        return y + v["bias"][None, :, None, None]

    _check_layer(conv, ref, x)


def _mha_ref(v, x, ctx=None, mask=None, *, heads, causal=False):
    ctx = x if ctx is None else ctx
    q = x @ v["q_proj.weight"].T + v["q_proj.bias"]
    k = ctx @ v["k_proj.weight"].T + v["k_proj.bias"]
    val = ctx @ v["v_proj.weight"].T + v["v_proj.bias"]
    b, lq, d = q.shape
    lk = k.shape[1]
    dh = d // heads

    def split(t, n):
        return t.reshape(b, n, heads, dh).transpose(0, 2, 1, 3)

    q, k, val = split(q, lq), split(k, lk), split(val, lk)
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(dh)
    keep = jnp.ones((b, 1, lq, lk), bool)
    if mask is not None:
        keep = keep & mask[:, None]
    if causal:
        keep = keep & jnp.tril(jnp.ones((lq, lk), bool))
    scores = jnp.where(keep, scores, -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1)
    o = (p @ val).transpose(0, 2, 1, 3).reshape(b, lq, d)
    return o @ v["out_proj.weight"].T + v["out_proj.bias"]


@pytest.mark.parametrize("causal", [False, True])
def test_multi_head_attention_matches_manual(causal):
    mha = nn.MultiHeadAttention(8, 2, key=jax.random.key(0), causal=causal, dtype=F64)
    assert [n for n, _ in mha.named_parameters()][:2] == ["q_proj.weight", "q_proj.bias"]
    x = jax.random.normal(jax.random.key(1), (2, 5, 8), F64)
    _check_layer(mha, lambda v, x: _mha_ref(v, x, heads=2, causal=causal), x, jit=causal)


def test_multi_head_attention_mask_and_context():
    mha = nn.MultiHeadAttention(8, 2, key=jax.random.key(2), dtype=F64)
    x = jax.random.normal(jax.random.key(3), (2, 5, 8), F64)
    ctx = jax.random.normal(jax.random.key(4), (2, 3, 8), F64)
    mask = jax.random.bernoulli(jax.random.key(5), 0.6, (2, 5, 3)).at[:, :, 0].set(True)

    pd = mha.param_dict()
    vals = {k: p.value for k, p in pd.items()}
    ref_fn = jax.jit(lambda v, m: _mha_ref(v, x, ctx, m, heads=2))
    ref = ref_fn(vals, mask)
    with tfl.Session() as s:
        y_arr = mha(s.input(x), s.input(ctx), mask)  # mask as an array
        y_t = mha(s.input(x), s.input(ctx), s.input(mask))  # mask as a Tensor
        np.testing.assert_allclose(np.asarray(y_arr.value), np.asarray(ref), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(np.asarray(y_t.value), np.asarray(ref), rtol=1e-10, atol=1e-12)
        # the mask matters
        assert not np.allclose(np.asarray(ref), np.asarray(ref_fn(vals, jnp.ones_like(mask))))

    c = jax.random.normal(jax.random.key(6), ref.shape, F64)
    g_ref = jax.jit(jax.grad(lambda v: jnp.sum(_mha_ref(v, x, ctx, mask, heads=2) * c)))(vals)
    _, g = jax.jit(tfl.value_and_grad(lambda s, x, ctx, m: tfl.sum(mha(x, ctx, m) * c)))(pd, x, ctx, mask)
    for name in g_ref:
        np.testing.assert_allclose(np.asarray(g[name]), np.asarray(g_ref[name]), rtol=1e-9, atol=1e-12, err_msg=name)


def test_mlp_and_sequential_match_jax():
    mlp = nn.MLP([4, 4, 4, 1], key=jax.random.key(0), activation=tfl.tanh, dtype=F64)
    assert [p.shape for p in mlp.parameters()] == [(4, 4), (4,), (4, 4), (4,), (1, 4), (1,)]
    x = jax.random.normal(jax.random.key(1), (5, 4), F64)

    def ref(v, x):
        h = jnp.tanh(x @ v["layers.0.weight"].T + v["layers.0.bias"])
        h = jnp.tanh(h @ v["layers.1.weight"].T + v["layers.1.bias"])
        return h @ v["layers.2.weight"].T + v["layers.2.bias"]

    _check_layer(mlp, ref, x)

    # a shared Linear used twice: its gradient is the sum over both uses
    k1, k2 = keys(2, 7)
    lin = nn.Linear(4, 4, key=k1, dtype=F64)
    seq = nn.Sequential(lin, tfl.relu, lin, nn.Linear(4, 1, key=k2, dtype=F64))

    def ref_seq(v, x):
        h = jax.nn.relu(x @ v["0.weight"].T + v["0.bias"])
        h = h @ v["0.weight"].T + v["0.bias"]
        return h @ v["3.weight"].T + v["3.bias"]

    _check_layer(seq, ref_seq, x)


# --------------------------------------------------------------------------- init and dropout


@pytest.mark.parametrize(
    "make",
    [
        lambda k: nn.Linear(4, 3, key=k),
        lambda k: nn.Embedding(5, 3, key=k),
        lambda k: nn.Conv2d(2, 3, 3, key=k),
        lambda k: nn.MultiHeadAttention(4, 2, key=k),
        lambda k: nn.MLP([3, 4, 2], key=k),
    ],
)
def test_seeded_init_reproducible(make):
    a, b, c = make(jax.random.key(0)), make(jax.random.key(0)), make(jax.random.key(1))
    va = [np.asarray(p.value) for p in a.parameters()]
    vb = [np.asarray(p.value) for p in b.parameters()]
    vc = [np.asarray(p.value) for p in c.parameters()]
    assert all(np.array_equal(x, y) for x, y in zip(va, vb))
    assert all(not np.array_equal(x, y) for x, y in zip(va, vc))
    assert all(x.dtype == np.float32 for x in va)
    # distinct Params get distinct storages (no accidental aliasing)
    assert len({id(p.storage) for p in a.parameters()}) == len(va)


def test_linear_init_bounds():
    lin = nn.Linear(16, 32, key=jax.random.key(0))
    w = np.asarray(lin.weight.value)
    assert np.abs(w).max() <= 0.25 and w.std() > 0.1


def test_dropout_inference_identity_and_training_rate():
    x = jnp.ones((100, 100), jnp.float32)
    drop = nn.Dropout(0.3)
    with tfl.Session(grad_enabled=False) as s:
        np.testing.assert_array_equal(np.asarray(drop(s.input(x)).value), np.asarray(x))
    with tfl.Session(seed=0) as s:
        np.testing.assert_array_equal(np.asarray(drop(s.input(x), training=False).value), np.asarray(x))

    def sample(seed):
        with tfl.Session(seed=seed) as s:
            return np.asarray(drop(s.input(x)).value)

    y = sample(3)
    zero = y == 0
    assert abs(zero.mean() - 0.3) < 0.03
    np.testing.assert_allclose(y[~zero], 1 / 0.7, rtol=1e-6)
    np.testing.assert_array_equal(sample(3), y)
    assert not np.array_equal(sample(4), y)


def test_dropout_gradient_uses_same_mask():
    x = jnp.arange(1.0, 41.0).reshape(4, 10)
    with tfl.Session(seed=1) as s:
        xi = s.input(x, requires_grad=True)
        y = nn.Dropout(0.5)(xi)
        g = np.asarray(s.backward(tfl.sum(y))[xi])
        yv = np.asarray(y.value)
    np.testing.assert_allclose(g, np.where(yv != 0, 2.0, 0.0))


# --------------------------------------------------------------------------- tied LM block

V, D, H, L, B = 11, 8, 2, 5, 2  # D, H, L, B as in the attention tests (shared kernels)


class _TinyLM(nn.Module):
    def __init__(self, key, dtype=jnp.float32):
        k1, k2 = jax.random.split(key)
        self.embed = nn.Embedding(V, D, key=k1, std=0.5, dtype=dtype)
        self.attn = nn.MultiHeadAttention(D, H, key=k2, causal=True, dtype=dtype)
        self.norm = nn.LayerNorm(D, dtype=dtype)
        self.head = self.embed.tied_output()

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.attn(h)
        return self.head(self.norm(h))


def _lm_ref(v, w_out, ids, targets):
    """The same model as a pure function, with the output weight as a separate argument."""
    h = v["embed.weight"][ids]
    attn_v = {k[len("attn.") :]: a for k, a in v.items() if k.startswith("attn.")}
    h = h + _mha_ref(attn_v, h, heads=H, causal=True)
    mu = h.mean(-1, keepdims=True)
    var = ((h - mu) ** 2).mean(-1, keepdims=True)
    h = (h - mu) / jnp.sqrt(var + 1e-5) * v["norm.weight"] + v["norm.bias"]
    logits = h @ w_out.T
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))


def _lm_batch():
    ids = jax.random.randint(jax.random.key(9), (B, L + 1), 0, V)
    return ids[:, :-1], ids[:, 1:]


def _lm_loss(model):
    return lambda s, ids, targets: tfl.apply("cross_entropy", model(ids), targets)


def test_tied_lm_gradient_is_sum_of_both_uses():
    model = _TinyLM(jax.random.key(0), dtype=F64)
    ids, targets = _lm_batch()
    pd = model.param_dict()
    assert "head.weight" not in pd and "head.weight" in dict(model.parameter_records())
    vals = {k: p.value for k, p in pd.items()}
    w = vals["embed.weight"]

    ref_loss, (g_ref, g_out) = jax.jit(jax.value_and_grad(_lm_ref, argnums=(0, 1)))(vals, w, ids, targets)
    g_in = g_ref["embed.weight"]
    assert float(jnp.abs(g_in).sum()) > 1e-3 and float(jnp.abs(g_out).sum()) > 1e-3

    loss, g = jax.jit(tfl.value_and_grad(_lm_loss(model)))(pd, ids, targets)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-10)
    np.testing.assert_allclose(np.asarray(g["embed.weight"]), np.asarray(g_in + g_out), rtol=1e-8, atol=1e-10)
    assert not np.allclose(np.asarray(g["embed.weight"]), np.asarray(g_in))
    for name in g_ref:
        if name != "embed.weight":
            np.testing.assert_allclose(
                np.asarray(g[name]), np.asarray(g_ref[name]), rtol=1e-8, atol=1e-10, err_msg=name
            )

    # eager: the tied record and the embedding record form one parameter group
    with tfl.Session() as s:
        grads = s.backward(_lm_loss(model)(s, s.input(ids), s.input(targets)))
        np.testing.assert_allclose(
            np.asarray(grads[model.head.weight]), np.asarray(g_in + g_out), rtol=1e-8, atol=1e-10
        )
        np.testing.assert_allclose(
            np.asarray(grads[model.embed.weight]), np.asarray(g_in + g_out), rtol=1e-8, atol=1e-10
        )


def test_tied_lm_trains_with_train_step():
    model = _TinyLM(jax.random.key(0))
    ids, targets = _lm_batch()
    opt = tfl.Optimizer(optax.adam(3e-2), model)
    assert len(opt.params) == len(model.parameters()) == len(model.parameter_records()) - 1
    step = tfl.train_step(_lm_loss(model), opt)
    losses = [float(step(ids, targets)) for _ in range(40)]
    assert step.trace_count == 1
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0]
    # the tied output reads the trained storage
    assert np.array_equal(np.asarray(model.head.weight.value), np.asarray(model.embed.weight.value))
    with tfl.Session(grad_enabled=False) as s:
        eager = float(_lm_loss(model)(s, ids, targets))
    assert eager < losses[0]
