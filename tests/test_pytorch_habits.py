"""A PyTorch user's habits (issue 25): what works, and what fails with an error that says what to write instead."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tapeflow as tfl

torch = pytest.importorskip("torch")
F32 = jnp.float32


def _mlp():
    return tfl.nn.MLP([3, 4, 2], key=jax.random.key(0))


# --------------------------------------------------------------------------- forgetting to reset


def test_a_second_training_step_without_reset_warns_once_with_the_fix():
    m = _mlp()
    opt = tfl.Optimizer(optax.sgd(0.1), m)
    s = tfl.Session()
    x = np.ones((2, 3), np.float32)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for _ in range(4):
            opt.step(s.backward(tfl.mean(m(s.input(x)) ** 2)))
    growth = [w for w in got if issubclass(w.category, tfl.TapeGrowthWarning)]
    assert len(growth) == 1, [str(w.message) for w in got]
    msg = str(growth[0].message)
    assert "nodes, growing with every step" in msg and "with s:" in msg and "s.reset()" in msg
    assert growth[0].filename == __file__  # the line of the user's backward


@pytest.mark.parametrize("lazy", [False, True])
def test_a_reset_per_step_never_warns(lazy):
    m = _mlp()
    opt = tfl.Optimizer(optax.sgd(0.1), m)
    s = tfl.Session(lazy=lazy)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for _ in range(3):
            with s:
                opt.step(s.backward(tfl.mean(m(s.input(np.ones((2, 3), np.float32))) ** 2)))
        with s:  # two backwards of one recording, no step in between: higher order or two losses, not a loop
            loss = tfl.mean(m(s.input(np.ones((2, 3), np.float32))) ** 2)
            s.backward(loss)
            opt.step(s.backward(loss))
    assert not [w for w in got if issubclass(w.category, tfl.TapeGrowthWarning)]


# --------------------------------------------------------------------------- tensors print like tensors


def test_repr_str_and_format_show_the_value():
    with tfl.Session(lazy=False) as s:  # an eager op has its value at once (lazy: the test below)
        x = s.input(jnp.arange(6.0, dtype=F32).reshape(2, 3), requires_grad=True)
        loss = tfl.mean(x * x)
        assert repr(loss) == "Tensor(9.1667, float32[], op=mean, id=2, gen=0, requires_grad)"
        assert str(loss) == "Tensor(9.1667, op=mean, requires_grad)"
        assert f"{loss:.2f}" == "9.17" and f"{loss}" == str(loss) and f"{loss:>8.3f}" == "   9.167"
        assert str(x) == "Tensor([[0., 1., 2.],\n        [3., 4., 5.]], op=leaf, requires_grad)"
        big = s.input(np.ones((40, 40), np.float32))
        assert repr(big) == "Tensor(float32[40,40], op=leaf, id=3, gen=0)"  # large: no values in repr
        assert "..." in str(big)  # summarized as NumPy (and PyTorch) print large arrays
        with pytest.raises(TypeError, match=r"format\(\) needs a tensor with one element, got shape \(2, 3\)"):
            f"{x:.2f}"


def test_repr_of_a_lazy_tensor_computes_nothing_and_str_computes_it():
    with tfl.Session(lazy=True) as s:
        y = tfl.sum(s.input(jnp.ones(3, F32)) * 2.0)
        assert repr(y) == "Tensor(float32[], op=sum, id=3, gen=0)"
        assert str(y) == "Tensor(6., op=sum)"
        assert repr(y) == "Tensor(6., float32[], op=sum, id=3, gen=0)"  # computed now


# --------------------------------------------------------------------------- inputs from anywhere


def test_pytorch_tensors_enter_sessions_params_ops_and_train_step():
    s = tfl.Session()
    x = s.input(torch.arange(6.0).reshape(2, 3))
    assert x.dtype == np.float32 and x.value.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    src = torch.ones(3, requires_grad=True)
    p = tfl.Param(src)  # detached and copied
    with torch.no_grad():
        src.add_(1.0)
    assert p.value.tolist() == [1.0, 1.0, 1.0]
    assert float(tfl.sum(x * torch.full((2, 3), 2.0))) == 30.0  # a tensor operand
    bf = s.input(torch.tensor([1.5, -2.0], dtype=torch.bfloat16))
    assert bf.dtype == jnp.bfloat16 and bf.value.astype(F32).tolist() == [1.5, -2.0]
    m = _mlp()
    step = tfl.train_step(lambda s, x, y: tfl.cross_entropy(m(x), y), tfl.Optimizer(optax.sgd(0.1), m))
    xb, yb = torch.ones(5, 3), torch.zeros(5, dtype=torch.long)
    got = float(step(xb, yb))
    m2 = _mlp()
    want = float(
        tfl.train_step(lambda s, x, y: tfl.cross_entropy(m2(x), y), tfl.Optimizer(optax.sgd(0.1), m2))(
            np.ones((5, 3), np.float32), np.zeros(5, np.int32)
        )
    )
    assert got == want


def test_arrays_of_other_libraries_and_tensors_off_the_cpu():
    class HasArray:
        def __array__(self, dtype=None, copy=None):
            return np.full(2, 3.0, np.float32)

    s = tfl.Session()
    assert s.input(HasArray()).value.tolist() == [3.0, 3.0]
    with pytest.raises(
        tfl.TapeError, match=r"Session.input: a PyTorch tensor on meta cannot be read here .* tensor.cpu\(\)"
    ):
        s.input(torch.ones(2, device="meta"))


# --------------------------------------------------------------------------- boolean masks


@pytest.mark.parametrize("lazy", [False, True])
def test_boolean_masks_select_as_numpy_does_with_gradients(lazy):
    data = np.array([[-1.0, 5.0, -2.0], [7.0, 0.5, -3.0]])
    with tfl.Session(lazy=lazy) as s:
        x = s.input(jnp.asarray(data), requires_grad=True)
        y = x[x > 0]
        np.testing.assert_array_equal(np.asarray(y.value), data[data > 0])
        g = s.backward(tfl.sum(y * y))[x]
    np.testing.assert_allclose(np.asarray(g), jax.grad(lambda v: jnp.sum(jnp.where(v > 0, v * v, 0.0)))(data))
    with tfl.Session(lazy=lazy) as s:
        x = s.input(jnp.asarray(data))
        np.testing.assert_array_equal(np.asarray(x[np.array([False, True])].value), data[np.array([False, True])])
        np.testing.assert_array_equal(np.asarray(x[[True, False]].value), data[[True, False]])


def test_a_mask_of_the_wrong_shape_and_a_mask_under_a_compiled_step_say_what_to_do():
    with tfl.Session() as s:
        x = s.input(jnp.ones((2, 3)))
        with pytest.raises(tfl.TapeError, match=r"a mask of shape \(3,\) does not fit a tensor of shape \(2, 3\)"):
            x[np.array([True, False, True])]
        with pytest.raises(tfl.TapeError, match=r"boolean mask, not integer positions.*tfl.where"):
            tfl.apply("take", x, np.array([True, False]), axis=0)  # never the old advice to cast it (rows 0 and 1)
    w = tfl.Param(jnp.ones(3))
    step = tfl.train_step(lambda s, x: tfl.sum((w * x)[x > 0]), tfl.Optimizer(optax.sgd(0.1), [w]))
    with pytest.raises(tfl.TapeError, match=r"compiled step .* tfl.where\(mask, x, 0\)"):
        step(jnp.ones(3))


# --------------------------------------------------------------------------- smaller traps


def test_a_deep_copy_shares_no_storage_and_says_so():
    import copy

    m = tfl.nn.Sequential(tfl.nn.Linear(2, 3, key=jax.random.key(0)), tfl.nn.Linear(3, 2, key=jax.random.key(1)))
    c = copy.deepcopy(m)
    ours = [p for _, p in m.named_parameters()]
    theirs = [p for _, p in c.named_parameters()]
    assert {id(p.storage) for p in ours}.isdisjoint(id(p.storage) for p in theirs)
    assert {p.storage.uid for p in ours}.isdisjoint(p.storage.uid for p in theirs)  # labels tell them apart
    assert all(f"storage=#{p.storage.uid}" in repr(p) for p in theirs)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value))
    theirs[0].value = jnp.zeros((3, 2), F32)  # Linear(2, 3).weight is (out, in)
    assert np.asarray(ours[0].value).any()  # writing the copy leaves the original


def test_reading_a_value_inside_a_compiled_step_names_the_fix():
    w = tfl.Param(jnp.ones(2))
    step = tfl.train_step(lambda s, x: float(tfl.sum(w * x)) * tfl.sum(w * x), tfl.Optimizer(optax.sgd(0.1), [w]))
    with pytest.raises(tfl.TapeError, match=r"float\(\) of Tensor.*inside a compiled step .*return it from loss_fn"):
        step(jnp.ones(2))


def test_a_layer_without_key_draws_the_seed_stream_and_a_second_optimizer_says_what_to_write():
    tfl.nn.init.manual_seed(3)
    a, b = tfl.nn.Linear(4, 4), tfl.nn.Linear(4, 4)  # PyTorch code constructs layers as written
    assert not np.array_equal(np.asarray(a.weight.value), np.asarray(b.weight.value))
    tfl.nn.init.manual_seed(3)
    np.testing.assert_array_equal(np.asarray(tfl.nn.Linear(4, 4).weight.value), np.asarray(a.weight.value))
    w = tfl.Param(jnp.ones(2, F32), name="w")
    first, second = tfl.Optimizer(optax.sgd(0.1), [w]), tfl.Optimizer(optax.sgd(0.1), [w])
    with tfl.Session() as s:
        g = s.backward(tfl.sum(w * w))
        first.step(g)
        with pytest.raises(
            tfl.TapeError, match=r"already released \(an optimizer step used them.*run backward again for it"
        ):
            second.step(g)
    assert second.describe() == f"slot 0: Param('w', float32[2], storage=#{w.storage.uid})"


# --------------------------------------------------------------------------- PyTorch's names


def test_pytorch_named_tensor_methods_match_torch_values_and_gradients():
    data = np.random.default_rng(0).normal(size=(2, 3, 4))
    t = torch.tensor(data, requires_grad=True)
    with tfl.Session() as s:
        x = s.input(jnp.asarray(data), requires_grad=True)
        pairs = [
            (x.view(6, 4), t.view(6, 4)),
            (x.flatten(), t.flatten()),
            (x.flatten(1), t.flatten(1)),
            (x.unsqueeze(1), t.unsqueeze(1)),
            (x.unsqueeze(0).squeeze(0), t.unsqueeze(0).squeeze(0)),
            (x.permute(2, 0, 1), t.permute(2, 0, 1)),
            (x.sum(dim=1, keepdim=True), t.sum(dim=1, keepdim=True)),
            (x.mean(dim=(0, 2)), t.mean(dim=(0, 2))),
            (x.max(dim=2).values, t.max(dim=2).values),
            (x.min(dim=0, keepdim=True).values, t.min(dim=0, keepdim=True).values),
            (x.var(dim=1, correction=1), t.var(dim=1, correction=1)),
            (x.std(dim=-1, keepdim=True, correction=0), t.std(dim=-1, keepdim=True, correction=0)),
            (x.std(), t.std()),  # PyTorch's default: unbiased
            (x.clamp(min=-0.5, max=0.5), t.clamp(min=-0.5, max=0.5)),
            (x.abs().sqrt().log().exp(), t.abs().sqrt().log().exp()),
            (x.tanh() + x.sigmoid() + x.relu(), t.tanh() + t.sigmoid() + t.relu()),
        ]
        total = None
        for ours, theirs in pairs:
            np.testing.assert_allclose(np.asarray(ours.value), theirs.detach().numpy(), rtol=1e-12, atol=1e-12)
            term = tfl.sum(ours * ours)
            total = term if total is None else total + term
        g = s.backward(total)[x]
        assert x.numel() == 24 and x.dim() == 3 and x.size() == (2, 3, 4) and x.size(1) == 3
        assert x.tolist() == data.tolist()
        with pytest.raises(TypeError, match="pass axis= or dim="):
            x.sum(axis=0, dim=0)
    torch_total = sum((theirs * theirs).sum() for _, theirs in pairs)
    torch_total.backward()
    np.testing.assert_allclose(np.asarray(g), t.grad.numpy(), rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------- index checks


@pytest.mark.parametrize("lazy", [False, True])
def test_out_of_range_host_indices_are_errors_with_nothing_recorded(lazy):
    emb = tfl.nn.Embedding(10, 4, key=jax.random.key(0))
    with tfl.Session(lazy=lazy) as s:
        assert emb(np.array([0, 9])).shape == (2, 4)
        n = len(s.tape)
        with pytest.raises(
            tfl.TapeError, match=r"gather: operand #1 \(indices\) holds 12, out of range \(valid: -10 to 9\)"
        ):
            emb(np.array([1, 12]))
        with pytest.raises(tfl.TapeError, match="Embedding: input holds -1; an index is a row number from 0 to 9"):
            emb(np.array([-1, 2]))
        with pytest.raises(
            tfl.TapeError, match=r"cross_entropy: operand #1 \(labels\) holds 3, out of range \(valid: 0 to 2\)"
        ):
            tfl.cross_entropy(s.input(jnp.ones((2, 3))), np.array([0, 3]))
        x = s.input(jnp.arange(5.0))
        with pytest.raises(tfl.TapeError, match="holds -6"):
            tfl.numpy.take(x, [-6], axis=0)
        assert float(tfl.numpy.take(x, [-1], axis=0)[0]) == 4.0  # NumPy's negative positions stay valid for take
        # the refused ops left nothing: two inputs, then the index leaf, take and the [0] the last line recorded
        assert len(s.tape) == n + 5


def test_layer_norm_without_bias_matches_torch():
    data = np.random.default_rng(2).normal(size=(3, 5))
    ln = tfl.nn.LayerNorm(5, bias=False, dtype=jnp.float64)
    assert ln.bias is None and [n for n, _ in ln.named_parameters()] == ["weight"]
    ref = torch.nn.LayerNorm(5, bias=False, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(torch.linspace(0.5, 1.5, 5, dtype=torch.float64))
    assert list(tfl.nn.state_dict(ln)) == list(ref.state_dict()) == ["weight"]
    tfl.nn.load_state_dict(ln, ref.state_dict())  # no bias key expected, none exported
    np.testing.assert_array_equal(np.asarray(ln.weight.value), np.linspace(0.5, 1.5, 5))
    t = torch.tensor(data, requires_grad=True)
    out_ref = ref(t)
    (out_ref * out_ref).sum().backward()
    with tfl.Session() as s:
        x = s.input(jnp.asarray(data), requires_grad=True)
        out = ln(x)
        g = s.backward(tfl.sum(out * out))
        np.testing.assert_allclose(np.asarray(out.value), out_ref.detach().numpy(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(np.asarray(g[x]), t.grad.numpy(), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(np.asarray(g[ln.weight]), ref.weight.grad.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_ignore_index_and_label_smoothing_match_torch(reduction, smoothing):
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(6, 5))
    labels = np.array([0, 4, -100, 2, -100, 1])
    t = torch.tensor(logits, requires_grad=True)
    ref = torch.nn.functional.cross_entropy(
        t, torch.tensor(labels), reduction=reduction, ignore_index=-100, label_smoothing=smoothing
    )
    cot = rng.normal(size=ref.shape)
    (ref * torch.tensor(cot)).sum().backward()
    with tfl.Session() as s:
        x = s.input(jnp.asarray(logits), requires_grad=True)
        loss = tfl.cross_entropy(x, labels, reduction=reduction, label_smoothing=smoothing)  # ignore_index=-100
        g = s.backward(tfl.sum(loss * jnp.asarray(cot)))[x]
        np.testing.assert_allclose(np.asarray(loss.value), ref.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(g), t.grad.numpy(), rtol=1e-10, atol=1e-12)
    with tfl.Session() as s:
        y = tfl.cross_entropy(s.input(jnp.asarray(logits)), np.array([0, 4, 7, 2, 1, 1]), ignore_index=7)
        assert np.isfinite(float(y))  # another ignore_index: its value passes the host index check
        with pytest.raises(ValueError, match=r"label_smoothing=1\.5 must be in \[0, 1\]"):
            tfl.cross_entropy(s.input(jnp.asarray(logits)), labels, label_smoothing=1.5)


def test_op_functions_take_dim_and_keepdim_as_well():
    data = np.arange(24.0).reshape(2, 3, 4)
    with tfl.Session() as s:
        x = s.input(jnp.asarray(data))
        np.testing.assert_array_equal(np.asarray(tfl.sum(x, dim=1, keepdim=True).value), data.sum(1, keepdims=True))
        np.testing.assert_array_equal(np.asarray(tfl.mean(x, dim=[0, 2]).value), data.mean((0, 2)))
        np.testing.assert_allclose(
            np.asarray(tfl.softmax(x, dim=0).value), torch.softmax(torch.tensor(data), dim=0).numpy(), rtol=1e-12
        )
        with pytest.raises(TypeError, match="sum: pass axis= or dim="):
            tfl.sum(x, axis=0, dim=1)
        # the methods are the same functions (one home: the surface table)
        with pytest.raises(TypeError, match="sum: pass keepdims= or keepdim="):
            x.sum(keepdims=True, keepdim=True)
        with pytest.raises(TypeError, match="std: pass axis= or dim="):
            x.std(axis=0, dim=0)
        assert x.sum(dim=1, keepdim=True).shape == tfl.sum(x, dim=1, keepdim=True).shape == (2, 1, 4)


def test_stack_split_chunk_and_constants_follow_pytorch():
    data = np.arange(14.0).reshape(7, 2)
    t = torch.tensor(data)
    with tfl.Session() as s:
        x = s.input(jnp.asarray(data), requires_grad=True)
        for ours, theirs in [
            (tfl.split(x, 3), torch.split(t, 3)),
            (tfl.split(x, [2, 5]), torch.split(t, [2, 5])),
            (tfl.chunk(x, 3), torch.chunk(t, 3)),
            (tfl.chunk(x, 2, dim=1), torch.chunk(t, 2, dim=1)),
        ]:
            assert [p.shape for p in ours] == [tuple(p.shape) for p in theirs]
            for a, b in zip(ours, theirs):
                np.testing.assert_array_equal(np.asarray(a.value), b.numpy())
        pieces = tfl.split(x, 3)
        st = tfl.stack([pieces[0], pieces[1]], dim=1)
        np.testing.assert_array_equal(np.asarray(st.value), torch.stack(torch.split(t, 3)[:2], dim=1).numpy())
        g = s.backward(tfl.sum(st) + tfl.sum(pieces[2]))[x]
        np.testing.assert_array_equal(np.asarray(g), np.ones((7, 2)))  # every row reached exactly once
        z = tfl.zeros(2, 3)
        assert isinstance(z, tfl.Tensor) and z.node.op is None and z.shape == (2, 3)  # a leaf of this session
        assert tfl.ones((2,)).tolist() == [1.0, 1.0] and tfl.full((2,), 7).tolist() == [7, 7]
        assert tfl.arange(5).tolist() == torch.arange(5).tolist()
        assert tfl.arange(0, 1, 0.25).tolist() == torch.arange(0, 1, 0.25).tolist()
        assert x.argmax(dim=1).tolist() == t.argmax(dim=1).tolist() and int(x.argmin()) == int(t.argmin())
        with pytest.raises(
            RuntimeError, match=r"sections \[2, 2\] must be non-negative and add up to dimension 0's size 7"
        ):
            tfl.split(x, [2, 2])
    assert isinstance(tfl.zeros(3), jax.Array)  # no session: a plain array


# --------------------------------------------------------------------------- gelu, attention dropout, Sequential names


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_forms_match_torch(approximate):
    data = np.random.default_rng(4).normal(size=(4, 6)) * 3
    t = torch.tensor(data, requires_grad=True)
    ref = torch.nn.functional.gelu(t, approximate=approximate)
    (ref * ref).sum().backward()
    with tfl.Session() as s:
        x = s.input(jnp.asarray(data), requires_grad=True)
        y = tfl.gelu(x, approximate=approximate)
        g = s.backward(tfl.sum(y * y))[x]
        np.testing.assert_allclose(np.asarray(y.value), ref.detach().numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(np.asarray(g), t.grad.numpy(), rtol=1e-10, atol=1e-12)
    # jax.nn.gelu (True = the tanh form) is a second oracle for the gradient
    oracle = jax.grad(lambda v: jnp.sum(jax.nn.gelu(v, approximate=approximate == "tanh") ** 2))(jnp.asarray(data))
    np.testing.assert_allclose(np.asarray(g), np.asarray(oracle), rtol=1e-10, atol=1e-12)
    # PyTorch takes a string only: jax.nn.gelu's bool and other strings are refused, naming the two forms
    for bad in ("erf", approximate == "tanh"):
        with tfl.Session() as s, pytest.raises(ValueError, match=rf'approximate={bad!r} must be "none" or "tanh"'):
            tfl.gelu(s.input(jnp.ones(2)), approximate=bad)


def _torch_dropped_attention(q, k, v, keep, p, causal):
    """PyTorch's scaled_dot_product_attention with a given dropout mask: softmax, drop and rescale, @ v."""
    scores = q @ k.transpose(-1, -2) / np.sqrt(q.shape[-1])
    if causal:
        lq, lk = scores.shape[-2:]
        scores = scores.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(), float("-inf"))
    w = torch.softmax(scores, dim=-1)
    return (w * torch.tensor(keep) / (1 - p)) @ v


@pytest.mark.parametrize("causal", [False, True])
def test_attention_dropout_matches_torch_with_the_same_mask(causal):
    rng = np.random.default_rng(5)
    qd, kd, vd = (rng.normal(size=(2, 3, 5, 4)) for _ in range(3))
    cot = rng.normal(size=(2, 3, 5, 4))
    p = 0.4
    keep = np.asarray(tfl.Session(seed=11).bernoulli_mask((2, 3, 5, 5), 1 - p).value)  # the draw tfl.attention makes
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (qd, kd, vd))
    ref = _torch_dropped_attention(tq, tk, tv, keep, p, causal)
    (ref * torch.tensor(cot)).sum().backward()
    with tfl.Session(seed=11) as s:
        q, k, v = (s.input(jnp.asarray(a), requires_grad=True) for a in (qd, kd, vd))
        out = tfl.attention(q, k, v, causal=causal, dropout=p)
        assert s.rng_counter == 1
        g = s.backward(tfl.sum(out * jnp.asarray(cot)))
        np.testing.assert_allclose(np.asarray(out.value), ref.detach().numpy(), rtol=1e-11, atol=1e-12)
    for ours, theirs in ((q, tq), (k, tk), (v, tv)):
        np.testing.assert_allclose(np.asarray(g[ours]), theirs.grad.numpy(), rtol=1e-10, atol=1e-12)
    # dropout 0, an inference session and training=False are PyTorch's plain attention, with no draw
    plain = torch.nn.functional.scaled_dot_product_attention(*(torch.tensor(a) for a in (qd, kd, vd)), is_causal=causal)
    for grad_enabled, training in ((True, False), (False, None)):
        with tfl.Session(seed=11, grad_enabled=grad_enabled) as s:
            q, k, v = (s.input(jnp.asarray(a)) for a in (qd, kd, vd))
            out = tfl.attention(q, k, v, causal=causal, dropout=p, training=training)
            np.testing.assert_allclose(np.asarray(out.value), plain.numpy(), rtol=1e-11, atol=1e-12)
            assert s.rng_counter == 0


def test_attention_dropout_rate_and_refusals():
    with tfl.Session(seed=0) as s:
        q = s.input(jnp.ones((64, 32, 8)))
        w_out = tfl.attention(q, q, q, dropout=0.25)  # uniform weights 1/32: each output is (kept share) / 0.75
        kept = np.asarray(w_out.value)[..., 0] * 0.75
        assert abs(kept.mean() - 0.75) < 0.01
        with pytest.raises(tfl.TapeError, match=r"attention: dropout must be a number in \[0, 1\), got 1\.0"):
            tfl.attention(q, q, q, dropout=1.0)
        with pytest.raises(tfl.TapeError, match=r"mask \(operand #3\) must be boolean"):
            tfl.attention(q, q, q, jnp.ones((32, 32)), dropout=0.5)
        with pytest.raises(tfl.TapeError, match=r"needs the keep mask"):
            tfl.apply("attention", q, q, q, dropout=0.5)  # the bare op: the mask must be given
        assert s.rng_counter == 1  # refused calls drew nothing


def test_multi_head_attention_dropout_is_on_in_train_mode_only():
    mha = tfl.nn.MultiHeadAttention(8, 2, key=jax.random.key(0), dropout=0.5)
    plain = tfl.nn.MultiHeadAttention(8, 2, key=jax.random.key(0))
    x0 = jax.random.normal(jax.random.key(1), (3, 5, 8), F32)
    assert "dropout=0.5" in repr(mha)
    with tfl.Session(seed=0) as s:
        x = s.input(x0)
        ref = np.asarray(plain(x).value)
        assert not np.allclose(np.asarray(mha(x).value), ref) and s.rng_counter == 1
        np.testing.assert_allclose(np.asarray(mha.eval()(x).value), ref, rtol=1e-6)
        assert s.rng_counter == 1
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        tfl.nn.MultiHeadAttention(8, 2, key=jax.random.key(0), dropout=1.5)


def test_sequential_has_one_naming_scheme_as_in_torch():
    k1, k2 = jax.random.split(jax.random.key(0))
    net = tfl.nn.Sequential(tfl.nn.Linear(3, 4, key=k1), tfl.relu, tfl.nn.Linear(4, 2, key=k2))
    ref = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    names = [n for n, _ in net.named_parameters()]
    assert names == [n for n, _ in ref.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert list(tfl.nn.state_dict(net)) == list(ref.state_dict()) == names
    text = repr(net)
    assert "(0): Linear(" in text and "(1): relu" in text and "(2): Linear(" in text and "layers" not in text
    tfl.nn.load_state_dict(net, ref.state_dict())  # PyTorch's keys load as they are
    np.testing.assert_array_equal(np.asarray(net[2].bias.value), ref[2].bias.detach().numpy())
    assert list(tfl.nn.state_dict(net, layout="flax")) == [
        "layers.0.kernel",
        "layers.0.bias",
        "layers.2.kernel",
        "layers.2.bias",
    ]


def test_attention_dropout_steps_alike_on_every_path():
    """Lazy equals eager (one seeded stream); train_step equals value_and_grad under its documented key."""
    from _helpers import one_step

    x0 = jax.random.normal(jax.random.key(1), (3, 5, 8), F32)

    def model():
        return tfl.nn.MultiHeadAttention(8, 2, key=jax.random.key(0), causal=True, dropout=0.3)

    def run(path):
        mha = model()
        loss = one_step(path, lambda s: tfl.sum(mha(s.input(x0)) ** 2), tfl.Optimizer(optax.sgd(0.1), mha))
        return float(loss), [np.asarray(q.value) for q in mha.parameters()]

    (ref_loss, ref), (loss, params) = run("eager"), run("lazy")
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for a, b in zip(params, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with tfl.Session() as s:  # the dropout was drawn: the loss is not the plain one's
        plain = tfl.nn.MultiHeadAttention(8, 2, key=jax.random.key(0), causal=True)
        assert abs(float(tfl.sum(plain(s.input(x0)) ** 2)) - ref_loss) > 1e-3

    mha = model()
    vg = tfl.value_and_grad(lambda s, x: tfl.sum(mha(x) ** 2))
    oracle, grads = vg(mha.param_dict(), x0, rng=jax.random.fold_in(jax.random.PRNGKey(0), 0))
    before = {n: np.asarray(p.value) for n, p in mha.named_parameters()}
    loss = one_step("train_step", lambda s: tfl.sum(mha(s.input(x0)) ** 2), tfl.Optimizer(optax.sgd(0.1), mha))
    np.testing.assert_allclose(float(loss), float(oracle), rtol=1e-6)
    for n, p in mha.named_parameters():
        np.testing.assert_allclose(np.asarray(p.value), before[n] - 0.1 * np.asarray(grads[n]), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- device indices under debug_nans


@pytest.mark.parametrize("lazy", [False, True])
def test_out_of_range_device_indices_are_errors_under_debug_nans(lazy):
    emb = tfl.nn.Embedding(10, 4, key=jax.random.key(0))
    ids = jnp.array([1, 12])  # on the device: reading it would wait, so only debug_nans looks
    with tfl.Session(lazy=lazy) as s:
        assert emb(ids).shape == (2, 4)  # JAX's semantics: the position is clamped
    with tfl.Session(lazy=lazy, debug_nans=True) as s:
        n = len(s.tape)
        with pytest.raises(tfl.TapeError, match=r"gather: operand #1 \(indices\) holds 12, out of range"):
            emb(ids)
        computed = s.input(jnp.array([0, 2])) * 3  # an index computed on the tape (lazy: not yet computed)
        with pytest.raises(tfl.TapeError, match=r"take: operand #1 \(indices\) holds 6, out of range"):
            tfl.numpy.take(s.input(jnp.ones((5, 3))), computed, axis=0)
        assert len(s.tape) == n + 4  # two inputs, the constant 3 and the mul: the refused ops recorded nothing
        # a label out of range makes a NaN loss instead, which the debug_nans search explains (its own test)
        assert emb(jnp.array([0, 9])).shape == (2, 4)


def test_out_of_range_device_indices_refuse_a_debug_nans_step_with_nothing_updated():
    emb = tfl.nn.Embedding(10, 4, key=jax.random.key(0))
    opt = tfl.Optimizer(optax.sgd(0.1), emb)
    before = np.asarray(emb.weight.value)
    step = tfl.train_step(lambda s, ids: tfl.sum(emb(ids) ** 2), opt, debug_nans=True)
    step(jnp.array([1, 2]))  # in range: a normal step
    after_good = np.asarray(emb.weight.value)
    assert not np.array_equal(after_good, before)
    with pytest.raises(tfl.TapeError, match=r"gather: operand #1 \(indices\) holds 12, out of range"):
        step(jnp.array([1, 12]))
    np.testing.assert_array_equal(np.asarray(emb.weight.value), after_good)
    assert step.step_count == 1
    # without debug_nans the step runs with JAX's clamped position (no device wait is added)
    tfl.train_step(lambda s, ids: tfl.sum(emb(ids) ** 2), opt)(jnp.array([1, 12]))

    vg = jax.jit(tfl.value_and_grad(lambda s, ids: tfl.sum(emb(ids) ** 2), debug_nans=True))
    vg(emb.param_dict(), jnp.array([3]))
    with pytest.raises(Exception, match=r"holds 12, out of range"):  # under jax.jit JAX carries the text
        jax.block_until_ready(vg(emb.param_dict(), jnp.array([12])))
