"""``tapeflow.nn.functional`` against ``torch.nn.functional``: values, shapes, dtypes and gradients.

Each case runs one call through PyTorch (float32, autograd) and through
tapeflow (``s.backward`` of the output contracted with a fixed random
cotangent), and compares the outputs and the gradient of every float input.
Inputs named in ``constants`` (loss weights, which PyTorch refuses to
differentiate) get no gradient on either side. Shapes are small so the file
compiles few kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapeflow as tfl
import tapeflow.nn.functional as F
from tapeflow._shell._surface import SURFACE

torch = pytest.importorskip("torch")
TF = torch.nn.functional

_RNG = np.random.default_rng(0)


def rand(*shape: int) -> np.ndarray:
    return _RNG.standard_normal(shape).astype(np.float32)


def unit(*shape: int) -> np.ndarray:
    return _RNG.uniform(0.05, 0.95, shape).astype(np.float32)


def ints(*values: object) -> np.ndarray:
    return np.asarray(values, np.int32)


def compare(
    name: str,
    args: tuple[object, ...],
    kwargs: dict[str, object] | None = None,
    *,
    constants: tuple[str, ...] = ("weight", "pos_weight"),
    torch_fn: Callable[..., object] | None = None,
    tol: float = 1e-5,
) -> None:
    """``F.<name>(*args, **kwargs)`` equals ``torch.nn.functional.<name>``: value, shape, dtype, gradients."""
    kwargs = kwargs or {}
    tfn = torch_fn or getattr(TF, name)
    diff = {i: a.dtype.kind == "f" for i, a in enumerate(args) if isinstance(a, np.ndarray)}
    diff.update({k: a.dtype.kind == "f" and k not in constants for k, a in kwargs.items() if isinstance(a, np.ndarray)})

    def to_torch(key: int | str, a: object) -> object:
        if not isinstance(a, np.ndarray):
            return a
        t = torch.from_numpy(a.copy())
        return t.long() if a.dtype == np.int32 else t.requires_grad_(diff[key])

    targs = [to_torch(i, a) for i, a in enumerate(args)]
    tkw = {k: to_torch(k, a) for k, a in kwargs.items()}
    want = tfn(*targs, **tkw)
    w = want.detach().numpy()
    with tfl.Session() as s:

        def to_tfl(key: int | str, a: object) -> object:
            return s.input(a, requires_grad=diff[key]) if isinstance(a, np.ndarray) else a

        sargs = [to_tfl(i, a) for i, a in enumerate(args)]
        skw = {k: to_tfl(k, a) for k, a in kwargs.items()}
        got = getattr(F, name)(*sargs, **skw)
        assert isinstance(got, tfl.Tensor)
        assert tuple(got.shape) == w.shape
        mapped = {np.dtype(np.int64): np.dtype(np.int32), np.dtype(np.float64): np.dtype(np.float32)}
        assert np.dtype(got.dtype) == mapped.get(w.dtype, w.dtype)
        np.testing.assert_allclose(np.asarray(got.value), w, rtol=tol, atol=tol)
        if not want.requires_grad:
            return
        cot = _RNG.standard_normal(w.shape).astype(np.float32)
        want.backward(torch.from_numpy(cot))
        g = s.backward(tfl.sum(got * cot))
        pairs = [(sargs[i], targs[i]) for i in diff if isinstance(i, int) and diff[i]]
        pairs += [(skw[k], tkw[k]) for k in diff if isinstance(k, str) and diff[k]]
        for mine, theirs in pairs:
            expected = np.zeros(theirs.shape, np.float32) if theirs.grad is None else theirs.grad.numpy()
            np.testing.assert_allclose(np.asarray(g[mine]), expected, rtol=10 * tol, atol=10 * tol)


CASES: list[tuple[str, tuple[object, ...], dict[str, object]]] = [
    # (a) layers
    ("linear", (rand(2, 3), rand(4, 3), rand(4)), {}),
    ("linear", (rand(3), rand(4, 3)), {}),
    ("conv1d", (rand(2, 4, 7), rand(6, 2, 3), rand(6)), dict(stride=2, padding=1, groups=2)),
    ("conv1d", (rand(4, 7), rand(6, 4, 2)), dict(padding="same", dilation=2)),
    (
        "conv2d",
        (rand(2, 4, 6, 5), rand(6, 2, 3, 2), rand(6)),
        dict(stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2),
    ),
    ("conv2d", (rand(1, 3, 5, 5), rand(2, 3, 4, 4)), dict(padding="same")),
    ("conv2d", (rand(3, 5, 5), rand(2, 3, 3, 3)), dict(padding="valid")),
    (
        "conv_transpose2d",
        (rand(2, 4, 3, 4), rand(4, 3, 3, 2), rand(6)),
        dict(stride=2, padding=1, output_padding=1, groups=2),
    ),
    ("conv_transpose2d", (rand(1, 2, 3, 3), rand(2, 3, 2, 3)), dict(stride=(1, 2), padding=(0, 2), dilation=2)),
    ("max_pool1d", (rand(2, 3, 7), 3), dict(stride=2, padding=1, ceil_mode=True)),
    ("max_pool1d", (rand(1, 2, 9), 3), dict(stride=2, dilation=3)),
    ("max_pool2d", (rand(2, 3, 5, 6), 2), {}),
    ("max_pool2d", (rand(1, 2, 7, 6), (3, 2)), dict(stride=(2, 1), padding=1, dilation=(1, 2), ceil_mode=True)),
    ("avg_pool1d", (rand(2, 3, 7), 3), dict(stride=2, padding=1, ceil_mode=True, count_include_pad=False)),
    ("avg_pool2d", (rand(2, 3, 5, 6), 2), dict(padding=1)),
    ("avg_pool2d", (rand(1, 2, 7, 6), 3), dict(stride=2, padding=1, ceil_mode=True)),
    ("avg_pool2d", (rand(2, 7, 6), 3), dict(stride=2, padding=1, ceil_mode=True, count_include_pad=False)),
    ("avg_pool2d", (rand(1, 2, 7, 6), 3), dict(divisor_override=5)),
    ("adaptive_avg_pool1d", (rand(2, 3, 7), 3), {}),
    ("adaptive_avg_pool2d", (rand(2, 3, 7, 5), (3, None)), {}),
    ("adaptive_avg_pool2d", (rand(3, 7, 5), 1), {}),
    ("adaptive_avg_pool2d", (rand(3, 7, 5), (4, 2)), {}),
    ("embedding", (ints([0, 2, 1], [2, 2, 0]), rand(4, 3)), dict(padding_idx=2)),
    ("embedding", (ints(3, 0), rand(4, 3)), dict(padding_idx=-1)),
    ("layer_norm", (rand(2, 3, 4), (3, 4), rand(3, 4), rand(3, 4)), {}),
    ("layer_norm", (rand(2, 3, 4), [4]), dict(bias=rand(4))),
    ("group_norm", (rand(2, 6, 3), 3, rand(6), rand(6)), {}),
    ("rms_norm", (rand(2, 3, 4), (4,), rand(4)), {}),
    ("rms_norm", (rand(2, 3, 4), (3, 4)), dict(eps=1e-3)),
    ("scaled_dot_product_attention", (rand(2, 2, 3, 4), rand(2, 2, 5, 4), rand(2, 2, 5, 3)), {}),
    ("scaled_dot_product_attention", (rand(2, 3, 4), rand(2, 5, 4), rand(2, 5, 3)), dict(is_causal=True, scale=0.3)),
    (
        "scaled_dot_product_attention",
        (rand(2, 3, 4), rand(2, 5, 4), rand(2, 5, 3)),
        dict(attn_mask=np.array([[1, 0, 1, 1, 0], [0] * 5, [1] * 5], bool)),
    ),
    (
        "scaled_dot_product_attention",
        (rand(2, 3, 4), rand(2, 5, 4), rand(2, 5, 3)),
        dict(attn_mask=np.where(_RNG.random((3, 5)) > 0.3, rand(3, 5), -np.inf).astype(np.float32)),
    ),
    ("scaled_dot_product_attention", (rand(1, 4, 3, 4), rand(1, 2, 5, 4), rand(1, 2, 5, 4)), dict(enable_gqa=True)),
    # (b) activations and friends
    ("gelu", (rand(3, 4),), {}),
    ("gelu", (rand(3, 4),), dict(approximate="tanh")),
    ("silu", (rand(3, 4),), {}),
    ("elu", (np.array([-100.0, -1.0, 0.0, 2.0, 100.0], np.float32),), dict(alpha=0.7)),
    ("leaky_relu", (np.array([-1.0, 0.0, 2.0], np.float32),), dict(negative_slope=0.2)),
    ("softplus", (rand(3, 4) * 10,), {}),
    ("softplus", (rand(3, 4) * 10,), dict(beta=2.0, threshold=5.0)),
    ("one_hot", (ints([0, 3], [1, 2]),), {}),
    ("one_hot", (ints(0, 2), 5), {}),
    ("normalize", (rand(3, 4),), {}),
    ("normalize", (rand(3, 4),), dict(p=1.0, dim=0)),
    ("normalize", (np.array([[0.0, 0.0], [1.0, 2.0]], np.float32),), {}),
    ("normalize", (rand(3, 4),), dict(p=float("inf"), dim=-1)),
    ("cosine_similarity", (rand(3, 4), rand(1, 4)), {}),
    ("cosine_similarity", (rand(2, 3), rand(2, 3)), dict(dim=0)),
    ("cosine_similarity", (np.zeros((2, 3), np.float32), rand(2, 3)), {}),
    ("pad", (rand(2, 3, 4), (1, 2)), {}),
    ("pad", (rand(2, 3, 4), (1, -1, 2, 0)), dict(value=1.5)),
    ("pad", (rand(1, 2, 3, 4), (1, 2, 2, 1)), dict(mode="reflect")),
    ("pad", (rand(2, 3, 4), (2, 3)), dict(mode="replicate")),
    ("pad", (rand(1, 2, 3, 4), (1, 2, 3, 1)), dict(mode="circular")),
    ("interpolate", (rand(1, 2, 3, 4),), dict(size=(5, 7))),
    ("interpolate", (rand(1, 2, 3, 4),), dict(scale_factor=2)),
    ("interpolate", (rand(1, 2, 5, 4),), dict(scale_factor=0.6)),
    ("interpolate", (rand(1, 2, 3, 4),), dict(size=(5, 7), mode="bilinear", align_corners=False)),
    ("interpolate", (rand(1, 2, 3, 4),), dict(size=(5, 2), mode="bilinear", align_corners=True)),
    ("interpolate", (rand(1, 2, 3, 4),), dict(scale_factor=(1.5, 2.5), mode="bilinear")),
    ("interpolate", (rand(2, 3, 5),), dict(size=7, mode="linear")),
    ("interpolate", (rand(2, 3, 5),), dict(size=7, mode="nearest-exact")),
    ("interpolate", (rand(1, 2, 6, 4),), dict(size=(3, 2), mode="area")),
    # (c) losses
    ("cross_entropy", (rand(4, 5), ints(0, 4, 2, 1)), {}),
    ("cross_entropy", (rand(2, 5, 3), ints([0, 4, 2], [1, 1, -100])), dict(label_smoothing=0.1)),
    ("cross_entropy", (rand(4, 5), ints(0, 4, 2, 1)), dict(weight=unit(5), ignore_index=2, label_smoothing=0.2)),
    ("cross_entropy", (rand(4, 5), ints(0, 4, 2, 1)), dict(weight=unit(5), reduction="none")),
    (
        "cross_entropy",
        (rand(2, 5, 3), ints([0, 4, 2], [1, 1, 3])),
        dict(weight=unit(5), reduction="sum", label_smoothing=0.3),
    ),
    ("cross_entropy", (rand(5), np.array(3, np.int32)), {}),
    ("cross_entropy", (rand(4, 5), _RNG.dirichlet(np.ones(5), 4).astype(np.float32)), dict(label_smoothing=0.1)),
    ("cross_entropy", (rand(2, 5, 3), unit(2, 5, 3)), dict(weight=unit(5))),
    ("nll_loss", (rand(4, 5), ints(0, 4, 2, 1)), dict(weight=unit(5), ignore_index=4)),
    ("nll_loss", (rand(2, 5, 3), ints([0, 4, 2], [1, 1, 3])), dict(reduction="none")),
    ("mse_loss", (rand(3, 4), rand(3, 4)), {}),
    ("mse_loss", (rand(3, 4), rand(3, 4)), dict(weight=unit(3, 4))),
    ("l1_loss", (rand(3, 4), rand(3, 4)), dict(reduction="sum")),
    ("l1_loss", (rand(3, 4), rand(3, 4)), dict(weight=unit(3, 4))),
    ("smooth_l1_loss", (rand(3, 4), rand(3, 4)), dict(beta=0.5)),
    ("smooth_l1_loss", (rand(3, 4), rand(3, 4)), dict(beta=0.0, reduction="none")),
    ("huber_loss", (rand(3, 4), rand(3, 4)), dict(delta=0.7)),
    ("huber_loss", (rand(3, 4), rand(3, 4)), dict(weight=unit(3, 4))),
    ("binary_cross_entropy", (unit(3, 4), unit(3, 4)), {}),
    ("binary_cross_entropy", (unit(3, 4), unit(3, 4)), dict(weight=unit(4), reduction="sum")),
    ("binary_cross_entropy_with_logits", (rand(3, 4), unit(3, 4)), {}),
    ("binary_cross_entropy_with_logits", (rand(3, 4), unit(3, 4)), dict(weight=unit(4), pos_weight=3 * unit(4))),
    ("binary_cross_entropy_with_logits", (rand(3, 4), unit(3, 4)), dict(pos_weight=3 * unit(4), reduction="none")),
    ("kl_div", (rand(3, 4), unit(3, 4)), {}),
    ("kl_div", (rand(3, 4), unit(3, 4)), dict(reduction="batchmean")),
    ("kl_div", (rand(3, 4), rand(3, 4)), dict(reduction="sum", log_target=True)),
]


@pytest.mark.parametrize(("name", "args", "kwargs"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_against_torch(name: str, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    compare(name, args, kwargs)


def test_every_F_entry_is_exported_and_has_a_case() -> None:
    names = {n for n, e in SURFACE.items() if "F" in e.bind}
    assert names <= set(F.__all__)
    assert all(getattr(F, n) is SURFACE[n].fn for n in names)
    covered = {c[0] for c in CASES} | {"relu", "dropout", "sigmoid", "tanh", "softmax", "log_softmax"}
    assert names <= covered, sorted(names - covered)


def test_tfl_names_mean_torch_functional() -> None:
    # names bound "tfl" are torch.<name>, which for these is torch.nn.functional.<name>'s meaning
    for n in (
        "linear",
        "conv2d",
        "max_pool2d",
        "avg_pool2d",
        "layer_norm",
        "dropout",
        "gelu",
        "softplus",
        "cross_entropy",
        "scaled_dot_product_attention",
    ):
        assert getattr(tfl, n) is getattr(F, n), n
    with tfl.Session() as s:
        x, w = rand(2, 3), rand(3, 3)
        np.testing.assert_allclose(np.asarray(tfl.linear(s.input(x), w).value), x @ w.T, rtol=1e-6)
        logits, ids = rand(2, 4, 3), ints([0, 1, 2, 3], [3, 2, 1, 0])  # classes on dim 1 (4 of them)
        want = TF.cross_entropy(torch.from_numpy(logits), torch.from_numpy(ids).long()[:, :3])
        got = tfl.cross_entropy(s.input(logits), ids[:, :3])
        np.testing.assert_allclose(float(got), float(want), rtol=1e-6)


def test_dropout_draws_from_the_session_rng() -> None:
    with tfl.Session(seed=0) as s:
        x = s.input(np.ones(4000, np.float32), requires_grad=True)
        before = s.rng_counter
        y = F.dropout(x, 0.25)  # PyTorch's default: training=True, also in an inference-free session
        assert s.rng_counter == before + 1
        v = np.asarray(y.value)
        assert set(np.unique(v).tolist()) <= {0.0, np.float32(1 / 0.75)}
        assert 0.2 < float(np.mean(v == 0)) < 0.3
        g = np.asarray(s.backward(tfl.sum(y))[x])
        np.testing.assert_array_equal(g, v)  # the gradient is the mask, scaled
        assert F.dropout(x, 0.25, training=False) is x and s.rng_counter == before + 1
        assert float(tfl.sum(F.dropout(x, 1.0))) == 0.0
        with pytest.raises(ValueError, match="between 0 and 1"):
            F.dropout(x, 1.5)
        assert s.rng_counter == before + 1  # p=1 and a refused p draw nothing
    with tfl.Session(seed=0, grad_enabled=False) as s:  # an inference session still drops when asked to
        assert float(np.mean(np.asarray(F.dropout(s.input(np.ones(1000, np.float32)), 0.5).value) == 0)) > 0.3


def test_sdpa_dropout_draws_once_and_keeps_rows() -> None:
    q = rand(1, 4, 3)
    with tfl.Session(seed=1) as s:
        before = s.rng_counter
        out = F.scaled_dot_product_attention(s.input(q), s.input(q), s.input(q), attn_mask=rand(4, 4), dropout_p=0.5)
        assert out.shape == (1, 4, 3) and s.rng_counter == before + 1
        plain = F.scaled_dot_product_attention(s.input(q), s.input(q), s.input(q), dropout_p=0.0)
        assert s.rng_counter == before + 1 and plain.shape == (1, 4, 3)


def test_max_pool_return_indices_match_torch() -> None:
    x = rand(2, 3, 5, 6)
    want_v, want_i = torch.nn.functional.max_pool2d(torch.from_numpy(x), 3, 2, padding=1, return_indices=True)
    with tfl.Session() as s:
        v, i = F.max_pool2d(s.input(x), 3, 2, padding=1, return_indices=True)
        np.testing.assert_array_equal(np.asarray(v), want_v.numpy())
        np.testing.assert_array_equal(np.asarray(i), want_i.numpy())


ERRORS: list[tuple[Callable[[tfl.Session], object], type[Exception], str]] = [
    (lambda s: F.conv2d(s.input(rand(1, 3, 5, 5)), rand(2, 2, 3, 3)), ValueError, "expects 2"),
    (lambda s: F.conv2d(s.input(rand(1, 3, 5, 5)), rand(2, 3, 3, 3), stride=2, padding="same"), ValueError, "strided"),
    (lambda s: F.conv1d(s.input(rand(5)), rand(2, 1, 3)), ValueError, r"\(N, C, L\)"),
    (lambda s: F.max_pool2d(s.input(rand(1, 1, 4, 4)), 2, padding=2), ValueError, "half of the kernel"),
    (lambda s: F.embedding(s.input(ints(0)), rand(3, 2), max_norm=1.0), NotImplementedError, "max_norm"),
    (lambda s: F.embedding(s.input(rand(2)), rand(3, 2)), TypeError, "integer indices"),
    (lambda s: F.layer_norm(s.input(rand(2, 3)), (2,)), ValueError, "trailing dimensions"),
    (lambda s: F.group_norm(s.input(rand(2, 3, 4)), 2), ValueError, "divisible"),
    (lambda s: F.gelu(s.input(rand(2)), approximate="fast"), ValueError, "approximate"),
    (lambda s: F.one_hot(s.input(ints(0, 3)), 3), ValueError, r"\[0, num_classes=3\)"),
    (lambda s: F.pad(s.input(rand(2, 3)), (3, 0), mode="reflect"), ValueError, "at most 2"),
    (lambda s: F.pad(s.input(rand(2, 3)), (1, 0, 1)), ValueError, "even number"),
    (lambda s: F.interpolate(s.input(rand(1, 1, 4)), size=3, scale_factor=2.0), ValueError, "exactly one"),
    (lambda s: F.interpolate(s.input(rand(1, 1, 4)), size=3, mode="bicubic"), NotImplementedError, "bicubic"),
    (lambda s: F.cross_entropy(s.input(rand(4, 5)), ints(0, 1, 2)), ValueError, "does not match"),
    (lambda s: F.cross_entropy(s.input(rand(4, 5)), ints(0, 1, 2, 3), reduction="avg"), ValueError, "reduction"),
    (lambda s: F.binary_cross_entropy(s.input(unit(4)), unit(2, 4)), ValueError, "input's shape"),
    (
        lambda s: F.scaled_dot_product_attention(
            *(s.input(rand(2, 3)),) * 3, attn_mask=np.ones((2, 2), bool), is_causal=True
        ),
        ValueError,
        "not both",
    ),
]


@pytest.mark.parametrize(("call", "exc", "match"), ERRORS, ids=[e[2] for e in ERRORS])
def test_refusals_say_why(call: Callable[[tfl.Session], object], exc: type[Exception], match: str) -> None:
    with tfl.Session() as s:
        n = len(s.tape)
        with pytest.raises(exc, match=match):
            call(s)
        assert len(s.tape) - n <= 1  # at most the operand's input leaf: no op was recorded


def test_one_hot_in_a_compiled_step_needs_num_classes() -> None:
    def loss(x: jax.Array) -> jax.Array:
        with tfl.Session() as s:
            with pytest.raises(tfl.TapeError, match="pass num_classes"):
                F.one_hot(s.input(x))
            return F.one_hot(s.input(x), 4).value.sum()

    assert int(jax.jit(loss)(jnp.array([1, 2]))) == 2
