"""PyTorch's Tensor methods and torch.<fn> names against torch itself: values, dtypes, shapes, structures, gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapeflow as tfl
from tapeflow._shell._surface import SURFACE, entries

torch = pytest.importorskip("torch")


def _jax_dtype(t):
    """torch's dtype as JAX holds it (64-bit types only under jax_enable_x64, which the suite turns on)."""
    return np.dtype(jax.dtypes.canonicalize_dtype(np.dtype(str(t).removeprefix("torch."))))


def _check(ours, theirs):
    """Values, shape and dtype (int64 -> int32, float64 -> float32: JAX without x64) of one result or a tuple."""
    if isinstance(theirs, (tuple, list)):
        assert type(ours).__name__ in ("ValuesIndices", "tuple"), type(ours)
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            _check(a, b)
        return
    want = theirs.detach().numpy()
    got = np.asarray(ours)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == _jax_dtype(theirs.dtype), (got.dtype, theirs.dtype)
    np.testing.assert_allclose(got, want.astype(got.dtype), rtol=1e-5, atol=1e-6)


def _grad_case(data, ours_fn, torch_fn):
    """The result and the gradient of sum(result * weights) through ``ours_fn`` vs through ``torch_fn``."""
    t = torch.tensor(data, dtype=torch.float32, requires_grad=True)
    want = torch_fn(t)
    with tfl.Session() as s:
        x = s.input(jnp.asarray(data, jnp.float32), requires_grad=True)
        got = ours_fn(x)
        first_ours = got[0] if isinstance(got, tuple) else got
        first_theirs = want[0] if isinstance(want, tuple) else want
        _check(got, want)
        if not first_theirs.dtype.is_floating_point:
            return
        w = np.arange(1.0, first_theirs.numel() + 1).reshape(first_theirs.shape).astype(np.float32)
        g = s.backward(tfl.sum(first_ours * w.astype(first_ours.dtype)))[x]
    (first_theirs * torch.tensor(w)).sum().backward()
    np.testing.assert_allclose(np.asarray(g), t.grad.numpy(), rtol=1e-5, atol=1e-6)


X = np.array([[1.0, 5.0, 5.0], [4.0, -2.0, 3.0]], np.float32)  # a tie in row 0 (max and amax differ there)
SQUARE = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
CUBE = np.arange(24.0, dtype=np.float32).reshape(2, 3, 4)


# --------------------------------------------------------------------------- the three silent idioms


def test_transpose_swaps_two_dims_on_a_square_matrix_and_on_a_batch():
    _grad_case(SQUARE, lambda x: x.transpose(0, 1), lambda t: t.transpose(0, 1))
    _grad_case(CUBE, lambda k: k.transpose(-2, -1), lambda k: k.transpose(-2, -1))
    _grad_case(SQUARE, lambda x: tfl.transpose(x, 0, 1), lambda t: torch.transpose(t, 0, 1))


def test_max_with_a_dim_is_a_values_indices_pair_whose_gradient_goes_to_the_index():
    _grad_case(X, lambda x: x.max(1), lambda t: t.max(1))
    _grad_case(X, lambda x: x.min(0, keepdim=True), lambda t: t.min(0, keepdim=True))
    with tfl.Session() as s:
        out = s.input(jnp.asarray(X))
        _, pred = out.max(1)
        assert pred.tolist() == torch.tensor(X).max(1)[1].tolist() == out.max(1)[1].tolist() == [1, 0]
        assert pred.dtype == _jax_dtype(torch.int64) and out.max(1).indices.tolist() == [1, 0]


def test_var_and_std_are_unbiased_by_default():
    _grad_case(X, lambda x: x.var(), lambda t: t.var())
    _grad_case(X, lambda x: x.std(1), lambda t: t.std(1))


# --------------------------------------------------------------------------- the other silent differences


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (lambda x: x.var(correction=0.5), lambda t: t.var(correction=0.5)),
        (lambda x: x.var(1, unbiased=False), lambda t: t.var(1, unbiased=False)),
        (lambda x: x.std(unbiased=True, keepdim=True, dim=0), lambda t: t.std(unbiased=True, keepdim=True, dim=0)),
        (lambda x: tfl.take(x, [0, 4]), lambda t: torch.take(t, torch.tensor([0, 4]))),
        (lambda x: x.unsqueeze(0).squeeze(1), lambda t: t.unsqueeze(0).squeeze(1)),  # size 2: a no-op
        (lambda x: x.squeeze((0, 1)), lambda t: t.squeeze((0, 1))),
        (lambda x: x.add(x * 2, alpha=3), lambda t: t.add(t * 2, alpha=3)),
        (lambda x: tfl.sub(x, 1.0, alpha=2), lambda t: torch.sub(t, 1.0, alpha=2)),
        (lambda x: x.div(2.0, rounding_mode="floor"), lambda t: t.div(2.0, rounding_mode="floor")),
        (lambda x: x.div(-2.0, rounding_mode="trunc"), lambda t: t.div(-2.0, rounding_mode="trunc")),
        (lambda x: x.softmax(1, dtype=jnp.float64), lambda t: t.softmax(1, dtype=torch.float64)),
        (lambda x: x.log_softmax(0), lambda t: t.log_softmax(0)),
        (lambda x: x.clamp(min=x * 0.5, max=x * 0 + 3.0), lambda t: t.clamp(min=t * 0.5, max=t * 0 + 3.0)),
        (lambda x: x.max(x.flip([1])), lambda t: t.max(t.flip([1]))),
        (
            lambda x: tfl.gather(x, 1, jnp.array([[2, 0], [1, 1]])),
            lambda t: torch.gather(t, 1, torch.tensor([[2, 0], [1, 1]])),
        ),
        (lambda x: x.amax(1), lambda t: t.amax(1)),  # the tie shares the gradient
        (lambda x: x.amin(), lambda t: t.amin()),
        (lambda x: x.sort(1, descending=True), lambda t: t.sort(stable=True, dim=1, descending=True)),
        (lambda x: x.topk(2, dim=1), lambda t: t.topk(2, dim=1)),
        (lambda x: x.norm(), lambda t: t.norm()),
        (lambda x: x.norm(1, dim=1), lambda t: t.norm(1, dim=1)),
        (lambda x: x.cumsum(1), lambda t: t.cumsum(1)),
        (lambda x: x.logsumexp(1, keepdim=True), lambda t: t.logsumexp(1, keepdim=True)),
        (lambda x: x.repeat(2, 1), lambda t: t.repeat(2, 1)),
        (lambda x: x.repeat_interleave(2, dim=1), lambda t: t.repeat_interleave(2, dim=1)),
        (lambda x: x.expand(3, -1, -1), lambda t: t.expand(3, -1, -1)),
        (lambda x: x.narrow(1, 1, 2), lambda t: t.narrow(1, 1, 2)),
        (lambda x: x.unbind(1), lambda t: t.unbind(1)),
        (lambda x: tfl.split(x, [1, 2], 1), lambda t: torch.split(t, [1, 2], 1)),
        (lambda x: x.chunk(2, 1), lambda t: t.chunk(2, 1)),
        (lambda x: x.roll(1, 1), lambda t: t.roll(1, 1)),
        (lambda x: x.movedim(0, 1), lambda t: t.movedim(0, 1)),
        (lambda x: x.unflatten(1, (3, 1)), lambda t: t.unflatten(1, (3, 1))),
        (lambda x: x.lerp(x * 3, 0.25), lambda t: t.lerp(t * 3, 0.25)),
        (
            lambda x: x.scatter_add(1, jnp.array([[0, 0, 1], [2, 2, 2]]), x),
            lambda t: t.scatter_add(1, torch.tensor([[0, 0, 1], [2, 2, 2]]), t),
        ),
        (lambda x: x.index_select(1, jnp.array([2, 0])), lambda t: t.index_select(1, torch.tensor([2, 0]))),
        (lambda x: x.masked_fill(x > 3, -1.0), lambda t: t.masked_fill(t > 3, -1.0)),
        (lambda x: x.mT @ x, lambda t: t.mT @ t),
        (lambda x: x.prod(1), lambda t: t.prod(1)),
        (lambda x: x.remainder(3.0), lambda t: t.remainder(3.0)),
        (lambda x: x.rsqrt().square().reciprocal(), lambda t: t.rsqrt().square().reciprocal()),
        (lambda x: tfl.stack([x, x], 1), lambda t: torch.stack([t, t], 1)),
        (lambda x: tfl.cat([x, x], dim=-1), lambda t: torch.cat([t, t], dim=-1)),
        (lambda x: tfl.where(x > 2, x, 0.0), lambda t: torch.where(t > 2, t, 0.0)),
        (lambda x: tfl.einsum("ij,kj->ik", x, x), lambda t: torch.einsum("ij,kj->ik", t, t)),
        (lambda x: x[None].squeeze(()), lambda t: t[None].squeeze(())),  # an empty dim list squeezes nothing
        (lambda x: tfl.cat([jnp.zeros(0, jnp.float32), x], dim=1), lambda t: torch.cat([torch.zeros(0), t], dim=1)),
        (  # an integer bound promotes with the float input
            lambda x: x.clamp(jnp.array([1, 2, 1], jnp.int32), jnp.array([2, 2, 3], jnp.int32)),
            lambda t: t.clamp(torch.tensor([1, 2, 1], dtype=torch.int32), torch.tensor([2, 2, 3], dtype=torch.int32)),
        ),
        (lambda x: x[:, :0].log_softmax(1), lambda t: t[:, :0].log_softmax(1)),
    ],
)
def test_silent_differences_match_torch(ours, theirs):
    _grad_case(np.abs(X) + 0.5, ours, theirs)  # positive (rsqrt), with the tie of row 0 kept


def test_a_0d_tensor_takes_dim_0_and_minus_1():
    for ours, theirs in [
        (lambda x: x.sum(0), lambda t: t.sum(0)),
        (lambda x: x.max(-1), lambda t: t.max(-1)),
        (lambda x: x.softmax(0), lambda t: t.softmax(0)),
        (lambda x: x.cumsum(0), lambda t: t.cumsum(0)),
        (lambda x: x.argmax(0), lambda t: t.argmax(0)),
    ]:
        _grad_case(np.float32(3.0), ours, theirs)


def test_dtypes_and_constants_map_to_32_bits():
    with tfl.Session() as s:
        assert tfl.full((3,), True).dtype == np.bool_ and tfl.full((3,), True).tolist() == [True] * 3
        assert tfl.full((2,), 7).dtype == _jax_dtype(torch.int64) and tfl.full((2,), 0.5).dtype == np.float32
        x = s.input(jnp.asarray(X))
        assert (
            x.long().dtype == _jax_dtype(torch.int64)
            and x.double().dtype == _jax_dtype(torch.float64)
            and x.bool().dtype == np.bool_
        )
        assert x.to(torch.float64).dtype == _jax_dtype(torch.float64) and x.float() is x and x.to("cpu") is x
        assert x.sum().item() == pytest.approx(float(torch.tensor(X).sum()))
        assert x.size() == (2, 3) and x.size(-1) == 3 and x.dim() == 2 and x.numel() == 6
        assert x.argmax().tolist() == int(torch.tensor(X).argmax())
        b = s.input(jnp.array([True, False]))
        assert b.sum().dtype == _jax_dtype(torch.int64) and b.sum().item() == 1
        with pytest.raises(RuntimeError, match=r"mean: a int.. tensor has no floating mean dtype"):
            s.input(jnp.array([1, 2])).mean()


def test_refusals_name_what_to_use():
    with tfl.Session() as s:
        x = s.input(jnp.asarray(X))
        with pytest.raises(RuntimeError, match=r"where\(condition\) is nonzero"):
            tfl.where(x > 0)
        with pytest.raises(RuntimeError, match="t: expects a tensor with <= 2 dimensions"):
            s.input(jnp.asarray(CUBE)).t()
        with pytest.raises(IndexError, match=r"transpose: dim=2 is out of range for a tensor with 2 dimensions"):
            x.transpose(0, 2)
        with pytest.raises(TypeError, match="sum: pass axis= or dim="):
            x.sum(0, axis=1)


# --------------------------------------------------------------------------- the table and tfl's names


# tfl names that are also torch names but mean something of tapeflow's own, with the reason
INTENTIONALLY_DIFFERENT = {
    "Tensor": "tapeflow's tensor handle class (torch.Tensor is a storage-backed tensor)",
    "Node": "a recorded tape node (torch.Node is an autograd graph node)",
    "Storage": "a Param's storage cells (torch.Storage is raw memory)",
    "ops": "tapeflow's op registry view (torch.ops is the operator namespace)",
    "save": "a checkpoint of model, optimizer and step (torch.save pickles any object)",
}


def test_tfl_exports_every_tfl_entry_and_torch_names_come_from_the_table():
    for name, e in entries("tfl").items():
        assert name in tfl.__all__, name
        assert getattr(tfl, name) is e.fn, name
    shared = [n for n in tfl.__all__ if hasattr(torch, n)]
    for n in shared:
        if n in INTENTIONALLY_DIFFERENT:
            assert n not in SURFACE or "tfl" not in SURFACE[n].bind, n
            continue
        assert n in SURFACE and "tfl" in SURFACE[n].bind, f"tfl.{n} is torch.{n}'s name but not a table entry"
    for n, e in SURFACE.items():
        if "method" in e.bind:
            assert getattr(tfl.Tensor, n) is e.fn and getattr(tfl.Param, n) is e.fn, n
