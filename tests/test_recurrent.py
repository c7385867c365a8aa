"""tfl.nn.GRUCell and LSTMCell against torch.nn.GRUCell / LSTMCell: outputs and gradients over unrolled steps."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tapeflow as tfl
from tapeflow import nn

T, N, IN, HID = 5, 3, 4, 6
TOL = {"float32": 1e-5, "float64": 1e-10}
NAMES = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    return torch


def _pair(torch, kind: str, dtype: str, bias: bool = True):
    """A torch cell and a tapeflow cell holding the same weights (copied from torch)."""
    torch.manual_seed(0)
    tcls = torch.nn.GRUCell if kind == "gru" else torch.nn.LSTMCell
    tcell = tcls(IN, HID, bias=bias, dtype=getattr(torch, dtype))
    cls = nn.GRUCell if kind == "gru" else nn.LSTMCell
    cell = cls(IN, HID, key=jax.random.key(1), bias=bias, dtype=jnp.dtype(dtype))
    for name in NAMES if bias else NAMES[:2]:
        p = getattr(cell, name)
        w = getattr(tcell, name).detach().numpy()
        assert p.shape == w.shape and p.dtype == w.dtype, name  # PyTorch's layout: no transpose
        p.value = jnp.asarray(w)
    return tcell, cell


def _data(dtype: str, batched: bool = True):
    rng = np.random.default_rng(0)
    lead = (N,) if batched else ()
    xs = rng.standard_normal((T, *lead, IN)).astype(dtype)
    h0 = rng.standard_normal((*lead, HID)).astype(dtype)
    c0 = rng.standard_normal((*lead, HID)).astype(dtype)
    wh = rng.standard_normal((T, *lead, HID)).astype(dtype)  # loss weights per step (every output counts)
    wc = rng.standard_normal((*lead, HID)).astype(dtype)
    return xs, h0, c0, wh, wc


def _torch_run(torch, tcell, kind, xs, h0, c0, wh, wc, with_state=True):
    x = torch.tensor(xs, requires_grad=True)
    h = torch.tensor(h0, requires_grad=True)
    c = torch.tensor(c0, requires_grad=True)
    state = None
    if with_state:
        state = h if kind == "gru" else (h, c)
    outs, loss = [], 0.0
    for t in range(T):
        state = tcell(x[t]) if state is None else tcell(x[t], state)
        ht = state if kind == "gru" else state[0]
        outs.append(ht.detach().numpy())
        loss = loss + (ht * torch.tensor(wh[t])).sum()
    if kind == "lstm":
        outs.append(state[1].detach().numpy())
        loss = loss + (state[1] * torch.tensor(wc)).sum()
    loss.backward()
    grads = {"x": x.grad.numpy()}
    if with_state:
        grads["h0"] = h.grad.numpy()
        if kind == "lstm":
            grads["c0"] = c.grad.numpy()
    for name, p in tcell.named_parameters():
        grads[name] = p.grad.numpy()
    return np.stack(outs), float(loss.detach()), grads


def _tfl_run(cell, kind, xs, h0, c0, wh, wc, with_state=True):
    with tfl.Session() as s:
        x = s.input(jnp.asarray(xs), requires_grad=True)
        h = s.input(jnp.asarray(h0), requires_grad=True)
        c = s.input(jnp.asarray(c0), requires_grad=True)
        state = None
        if with_state:
            state = h if kind == "gru" else (h, c)
        outs, loss = [], None
        for t in range(T):
            state = cell(x[t], state)
            ht = state if kind == "gru" else state[0]
            outs.append(np.asarray(ht.value))
            term = tfl.sum(ht * jnp.asarray(wh[t]))
            loss = term if loss is None else loss + term
        if kind == "lstm":
            outs.append(np.asarray(state[1].value))
            loss = loss + tfl.sum(state[1] * jnp.asarray(wc))
        g = s.backward(loss)
        grads = {"x": np.asarray(g[x])}
        if with_state:
            grads["h0"] = np.asarray(g[h])
            if kind == "lstm":
                grads["c0"] = np.asarray(g[c])
        for name, p in cell.named_parameters():
            grads[name] = np.asarray(g[p])
        return np.stack(outs), float(loss.value), grads


def _max_diffs(torch, kind, dtype, batched=True, with_state=True, bias=True):
    tcell, cell = _pair(torch, kind, dtype, bias=bias)
    data = _data(dtype, batched)
    t_out, t_loss, t_g = _torch_run(torch, tcell, kind, *data, with_state=with_state)
    out, loss, g = _tfl_run(cell, kind, *data, with_state=with_state)
    assert out.dtype == np.dtype(dtype) and out.shape == t_out.shape
    assert sorted(g) == sorted(t_g)
    diffs = {"out": float(np.max(np.abs(out - t_out))), "loss": abs(loss - t_loss) / max(1.0, abs(t_loss))}
    for k in t_g:
        assert g[k].shape == t_g[k].shape and g[k].dtype == np.dtype(dtype), k
        assert np.any(t_g[k] != 0), k  # every gradient is exercised
        diffs[k] = float(np.max(np.abs(g[k] - t_g[k])))
    return diffs


def assert_within(diffs: dict[str, float], tol: float, what: str) -> None:
    """Every max |tapeflow - torch| in ``diffs`` is at most ``tol`` (NaN fails too)."""
    bad = {k: v for k, v in diffs.items() if not v <= tol}
    assert not bad, f"{what}: max |tapeflow - torch| over tolerance {tol}: {bad}"


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_unrolled_cell_equals_torch_forward_and_backward(torch, kind, dtype):
    diffs = _max_diffs(torch, kind, dtype)
    assert set(diffs) >= {"out", "x", "h0", *NAMES}
    assert_within(diffs, TOL[dtype], f"{kind} {dtype}")


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_unbatched_input_equals_torch(torch, kind):
    diffs = _max_diffs(torch, kind, "float64", batched=False)
    assert_within(diffs, 1e-10, kind)


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_default_state_is_zeros_as_in_torch(torch, kind):
    diffs = _max_diffs(torch, kind, "float64", with_state=False)
    assert_within(diffs, 1e-10, kind)
    # and the same as passing zeros explicitly
    _, cell = _pair(torch, kind, "float64")
    x = jnp.asarray(_data("float64")[0][0])
    zeros = jnp.zeros((N, HID), jnp.float64)
    with tfl.Session() as s:
        xi = s.input(x)
        a = cell(xi)
        b = cell(xi, zeros if kind == "gru" else (zeros, zeros))
        for u, v in zip(a if kind == "lstm" else [a], b if kind == "lstm" else [b]):
            assert u.shape == (N, HID)
            np.testing.assert_array_equal(np.asarray(u.value), np.asarray(v.value))


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_no_bias_equals_torch(torch, kind):
    diffs = _max_diffs(torch, kind, "float64", bias=False)
    assert_within(diffs, 1e-10, kind)


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_parameters_layout_and_init(kind):
    g = 3 if kind == "gru" else 4
    cls = nn.GRUCell if kind == "gru" else nn.LSTMCell
    cell = cls(IN, HID, key=jax.random.key(0))
    assert [(n, p.shape, p.dtype) for n, p in cell.named_parameters()] == [
        ("weight_ih", (g * HID, IN), np.dtype("float32")),
        ("weight_hh", (g * HID, HID), np.dtype("float32")),
        ("bias_ih", (g * HID,), np.dtype("float32")),
        ("bias_hh", (g * HID,), np.dtype("float32")),
    ]
    assert [p.name for p in cell.parameters()] == list(NAMES)
    bound = 1 / np.sqrt(HID)
    vals = np.concatenate([np.ravel(p.value) for p in cell.parameters()])
    assert np.all(np.abs(vals) <= bound) and np.max(np.abs(vals)) > 0.8 * bound
    again = cls(IN, HID, key=jax.random.key(0))
    for p, q in zip(cell.parameters(), again.parameters()):
        np.testing.assert_array_equal(np.asarray(p.value), np.asarray(q.value))
    no_bias = cls(IN, HID, key=jax.random.key(0), bias=False, dtype=jnp.float64)
    assert [n for n, _ in no_bias.named_parameters()] == ["weight_ih", "weight_hh"]
    assert no_bias.bias_ih is None and no_bias.bias_hh is None
    assert no_bias.weight_ih.dtype == np.dtype("float64")
    assert repr(cell).startswith(f"{cls.__name__}({IN}, {HID}, bias=True)")
    tfl.nn.init.manual_seed(3)  # without key=: the default seed stream, as PyTorch code builds a cell
    a = cls(IN, HID)
    tfl.nn.init.manual_seed(3)
    assert np.array_equal(np.asarray(cls(IN, HID).weight_hh.value), np.asarray(a.weight_hh.value))


# --------------------------------------------------------------------------- errors


def test_gru_wrong_input_shape_names_layer_and_shapes():
    cell = nn.GRUCell(IN, HID, key=jax.random.key(0))
    with tfl.Session() as s:
        for shape in [(N, IN + 1), (IN + 1,), (2, N, IN), ()]:
            x = s.input(jnp.ones(shape))
            n = len(s.tape)
            with pytest.raises(
                tfl.TapeError,
                match=re.escape(f"GRUCell: input has shape {shape}; expected ({IN},) (unbatched) or (N, {IN})"),
            ):
                cell(x)
            assert len(s.tape) == n  # nothing recorded


def test_gru_wrong_state_shape_names_layer_and_shapes():
    cell = nn.GRUCell(IN, HID, key=jax.random.key(0))
    with tfl.Session() as s:
        x = s.input(jnp.ones((N, IN)))
        for bad in [(N + 1, HID), (N, HID + 1), (HID,)]:
            msg = f"GRUCell: state has shape {bad}; expected {(N, HID)} for input of shape {(N, IN)}"
            with pytest.raises(tfl.TapeError, match=re.escape(msg)):
                cell(x, s.input(jnp.ones(bad)))
        with pytest.raises(tfl.TapeError, match=rf"GRUCell: state has shape \(1, {HID}\); expected \({HID},\)"):
            cell(s.input(jnp.ones(IN)), jnp.ones((1, HID)))


def test_lstm_wrong_state_names_layer_and_shapes():
    cell = nn.LSTMCell(IN, HID, key=jax.random.key(0))
    with tfl.Session() as s:
        x = s.input(jnp.ones((N, IN)))
        good = s.input(jnp.ones((N, HID)))
        bad = s.input(jnp.ones((N, HID + 1)))
        with pytest.raises(tfl.TapeError, match=rf"LSTMCell: h has shape \({N}, {HID + 1}\); expected \({N}, {HID}\)"):
            cell(x, (bad, good))
        with pytest.raises(tfl.TapeError, match=rf"LSTMCell: c has shape \({N}, {HID + 1}\); expected \({N}, {HID}\)"):
            cell(x, (good, bad))
        with pytest.raises(tfl.TapeError, match=rf"LSTMCell: input has shape \({N}, {IN + 2}\)"):
            cell(s.input(jnp.ones((N, IN + 2))), (good, good))
        with pytest.raises(TypeError, match=r"LSTMCell: state must be None or a pair \(h, c\), got Tensor"):
            cell(x, good)


# --------------------------------------------------------------------------- compiled


def _gru_loss(cell, head):
    def loss_fn(s, xs, target):
        x = s.input(xs)
        h = None
        for t in range(xs.shape[0]):
            h = cell(x[t], h)
        return tfl.mse(head(h), target)

    return loss_fn


def test_train_step_over_unrolled_gru_equals_eager_step():
    rng = np.random.default_rng(1)
    xs = jnp.asarray(rng.standard_normal((T, N, IN)), jnp.float32)
    target = jnp.asarray(rng.standard_normal((N, 2)), jnp.float32)

    def model():
        k1, k2 = jax.random.split(jax.random.key(3))
        return nn.GRUCell(IN, HID, key=k1), nn.Linear(HID, 2, key=k2)

    (ce, he), (cc, hc) = model(), model()
    opt_e = tfl.Optimizer(optax.adam(1e-2), [*ce.parameters(), *he.parameters()])
    opt_c = tfl.Optimizer(optax.adam(1e-2), [*cc.parameters(), *hc.parameters()])
    step = tfl.train_step(_gru_loss(cc, hc), opt_c)
    eager_fn = _gru_loss(ce, he)
    init = [np.asarray(p.value) for p in [*ce.parameters(), *he.parameters()]]
    for _ in range(3):
        with tfl.Session() as s:
            loss_e = eager_fn(s, xs, target)
            le = float(loss_e.value)
            opt_e.step(s.backward(loss_e))
        lc = float(step(xs, target))
        np.testing.assert_allclose(lc, le, rtol=1e-5, atol=1e-6)
    assert step.trace_count == 1
    for p, q, v0 in zip([*ce.parameters(), *he.parameters()], [*cc.parameters(), *hc.parameters()], init):
        assert not np.array_equal(np.asarray(p.value), v0), p.name  # every parameter was trained
        np.testing.assert_allclose(np.asarray(q.value), np.asarray(p.value), rtol=1e-5, atol=1e-6, err_msg=p.name)


def test_cell_records_on_its_inputs_session_not_the_current_one():
    cell = nn.LSTMCell(IN, HID, key=jax.random.key(0))
    s1 = tfl.Session()
    x = s1.input(jnp.ones((N, IN), jnp.float32))
    with tfl.Session() as s2:
        h, c = cell(x)  # the weights' transposes record on x's session too
        assert h.session is s1 and c.session is s1 and len(s2.tape) == 0
        assert tfl.current_session() is s2
        g = s1.backward(tfl.sum(h))
        assert g[cell.weight_hh].shape == (4 * HID, HID)
