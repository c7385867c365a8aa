"""Neural-network ops of the registry: softmax family, normalization, losses,
convolution, pooling and attention.

Each op is one block: the forward (decorated with :func:`~tapeflow._core._registry.op`),
its VJP (``@<op>.defvjp``) and its check (``check=`` argument). ``max_pool2d``
and ``avg_pool2d`` have no hand-written VJP: the registry derives theirs from
``jax.vjp`` of the forward.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .._core._checks import (
    as_int,
    axes_error,
    bool_error,
    broadcasts_to,
    checked_pair,
    float_check,
    int_pair,
    is_finite_number,
    is_int_dtype,
    is_number,
    norm_axes,
)
from .._core._registry import REQUIRED, Axes, Padding, Pair, Reduction, Spec, broadcast_shapes, op, unbroadcast
from .._core._typing import Array

# --------------------------------------------------------------------------- shared helpers


def _axis_check(specs: tuple[Spec, ...], axis: object = -1, **_: object) -> str | None:
    return float_check(specs) or axes_error(axis, len(specs[0][0]), none_ok=True)


def _reduction_error(reduction: object) -> str | None:
    if reduction not in ("mean", "sum", "none"):
        return f'attribute reduction={reduction!r} must be "mean", "sum" or "none"'
    return None


def _reduce(loss: Array, reduction: str) -> Array:
    if reduction == "mean":
        return jnp.mean(loss)
    if reduction == "sum":
        return jnp.sum(loss)
    return loss


def _unreduce(g: Array, shape: tuple[int, ...], reduction: str) -> Array:
    """The per-element cotangent of a loss reduced with ``reduction`` to ``g``."""
    if reduction == "none":
        return g
    g = jnp.broadcast_to(g, shape)
    if reduction == "mean":
        g = g / max(math.prod(shape), 1)
    return g


def _stable_max(x: Array, axes: tuple[int, ...]) -> Array:
    """``max`` over ``axes`` (keepdims), replaced by 0 where it is not finite (all -inf rows)."""
    m = jnp.max(x, axis=axes, keepdims=True)
    return jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, jnp.zeros((), x.dtype)))


# --------------------------------------------------------------------------- softmax family


@op("softmax", arity=1, attrs={"axis": -1}, check=_axis_check, precision="float32")
def softmax(x: Array, axis: Axes) -> Array:
    """``exp(x) / sum(exp(x))`` over ``axis`` (int or tuple), computed as ``exp(x - max)`` for stability."""
    axes = norm_axes(axis, x.ndim)
    e = jnp.exp(x - _stable_max(x, axes))
    return e / jnp.sum(e, axis=axes, keepdims=True)


@softmax.defvjp
def _softmax_vjp(g: Array, out: Array, x: Array, axis: Axes) -> tuple[Array]:
    axes = norm_axes(axis, x.ndim)
    return (out * (g - jnp.sum(g * out, axis=axes, keepdims=True)),)


@op("log_softmax", arity=1, attrs={"axis": -1}, check=_axis_check, precision="float32")
def log_softmax(x: Array, axis: Axes) -> Array:
    """``x - logsumexp(x)`` over ``axis`` (int or tuple), shifted by the max for stability."""
    axes = norm_axes(axis, x.ndim)
    s = x - _stable_max(x, axes)
    return s - jnp.log(jnp.sum(jnp.exp(s), axis=axes, keepdims=True))


@log_softmax.defvjp
def _log_softmax_vjp(g: Array, out: Array, x: Array, axis: Axes) -> tuple[Array]:
    axes = norm_axes(axis, x.ndim)
    return (g - jnp.exp(out) * jnp.sum(g, axis=axes, keepdims=True),)


def _logsumexp_check(specs: tuple[Spec, ...], axis: object, keepdims: object) -> str | None:
    if err := float_check(specs):
        return err
    if err := bool_error("keepdims", keepdims):
        return err
    return axes_error(axis, len(specs[0][0]), none_ok=True)


@op("logsumexp", arity=1, attrs={"axis": -1, "keepdims": False}, check=_logsumexp_check, precision="float32")
def logsumexp(x: Array, axis: Axes | None, keepdims: bool) -> Array:
    """``log(sum(exp(x)))`` over ``axis`` (int, tuple or None for all), shifted by the max for stability."""
    axes = norm_axes(axis, x.ndim)
    m = _stable_max(x, axes)
    out = m + jnp.log(jnp.sum(jnp.exp(x - m), axis=axes, keepdims=True))
    return out if keepdims else jnp.squeeze(out, axis=axes)


@logsumexp.defvjp
def _logsumexp_vjp(g: Array, out: Array, x: Array, axis: Axes | None, keepdims: bool) -> tuple[Array]:
    axes = norm_axes(axis, x.ndim)
    if not keepdims:
        g = jnp.expand_dims(g, axes)
        out = jnp.expand_dims(out, axes)
    return (g * jnp.exp(x - out),)


# --------------------------------------------------------------------------- layer_norm


def _layer_norm_check(specs: tuple[Spec, ...], axis: object, eps: object) -> str | None:
    if err := float_check(specs):
        return err
    shape = specs[0][0]
    if err := axes_error(axis, len(shape), none_ok=True):
        return err
    r = norm_axes(axis, len(shape))
    if not r or r != tuple(range(len(shape) - len(r), len(shape))):
        return (
            f"axis={axis!r} must name trailing axes of the rank-{len(shape)} input "
            f"(e.g. -1, or (-2, -1)); got normalized axes {r}"
        )
    if not is_finite_number(eps) or eps < 0:
        return f"attribute eps={eps!r} must be a finite non-negative number"
    norm = shape[len(shape) - len(r) :]
    for i, name in ((1, "weight"), (2, "bias")):
        if len(specs) > i and specs[i][0] != norm:
            return (
                f"{name} (operand #{i}) has shape {specs[i][0]} but must have the normalized "
                f"shape {norm} (x.shape over axis={axis!r})"
            )
    return None


def _layer_norm_stats(x: Array, axes: tuple[int, ...], eps: float | jax.Array) -> tuple[Array, Array]:
    mu = jnp.mean(x, axis=axes, keepdims=True)
    xc = x - mu
    rstd = jax.lax.rsqrt(jnp.mean(xc * xc, axis=axes, keepdims=True) + jnp.asarray(eps, x.dtype))
    return xc * rstd, rstd


@op(
    "layer_norm",
    arity=(1, 3),
    attrs={"axis": -1, "eps": 1e-5},
    check=_layer_norm_check,
    runtime=("eps",),
    precision="float32",
)
def layer_norm(x: Array, weight: Array = None, bias: Array = None, *, axis: Axes, eps: float) -> Array:
    """Layer normalization ``(x - mean) / sqrt(var + eps) * weight + bias`` over the trailing ``axis`` (int or tuple).

    ``var`` is the biased variance; ``weight`` and ``bias`` are optional (give
    ``weight`` alone, or both) and have the normalized trailing shape.
    """
    xhat, _ = _layer_norm_stats(x, norm_axes(axis, x.ndim), eps)
    y = xhat if weight is None else xhat * weight
    return y if bias is None else y + bias


@layer_norm.defvjp
def _layer_norm_vjp(
    g: Array, out: Array, x: Array, weight: Array = None, bias: Array = None, *, axis: Axes, eps: float | jax.Array
) -> tuple[Array, ...]:
    axes = norm_axes(axis, x.ndim)
    xhat, rstd = _layer_norm_stats(x, axes, eps)
    gx_hat = g if weight is None else g * weight
    gx = rstd * (
        gx_hat - jnp.mean(gx_hat, axis=axes, keepdims=True) - xhat * jnp.mean(gx_hat * xhat, axis=axes, keepdims=True)
    )
    lead = tuple(range(x.ndim - len(axes)))
    cts: list[Array] = [gx]
    if weight is not None:
        cts.append(jnp.sum(g * xhat, axis=lead))
    if bias is not None:
        cts.append(jnp.sum(g, axis=lead))
    return tuple(cts)


# --------------------------------------------------------------------------- losses


def _cross_entropy_check(
    specs: tuple[Spec, ...], reduction: object, ignore_index: object = -100, label_smoothing: object = 0.0
) -> str | None:
    if err := float_check(specs, (0,)):
        return err
    (ls, _), (ys, ydt) = specs
    if len(ls) == 0 or ls[-1] == 0:
        return f"logits must have shape (..., C) with C >= 1 classes, got {ls}"
    if not is_int_dtype(ydt):
        return (
            f"labels (operand #1) must be integer class indices, got dtype {ydt}; "
            "for one-hot or soft targets use log_softmax, mul and sum"
        )
    if ys != ls[:-1]:
        return f"labels have shape {ys} but must have shape logits.shape[:-1] = {ls[:-1]} (one class index per row)"
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        return f"attribute ignore_index={ignore_index!r} must be an int (a label value whose rows count for nothing)"
    if (
        isinstance(label_smoothing, bool)
        or not isinstance(label_smoothing, (int, float))
        or not 0 <= label_smoothing <= 1
    ):
        return f"attribute label_smoothing={label_smoothing!r} must be a number in [0, 1]"
    return _reduction_error(reduction)


def _ce_parts(logits: Array, labels: Array, ignore_index: int, smoothing: float) -> tuple[Array, Array, Array, Array]:
    """Log-softmax, the target distribution, rows that count (label not ``ignore_index``), rows with a valid label."""
    c = logits.shape[-1]
    logp = logits - logsumexp.fwd(logits, axis=-1, keepdims=True)
    onehot = (labels[..., None] == jnp.arange(c)).astype(logits.dtype)
    target = onehot if smoothing == 0 else (1 - smoothing) * onehot + smoothing / c  # PyTorch's label smoothing
    keep = labels != ignore_index
    valid = ((labels >= 0) & (labels < c)) | ~keep
    return logp, target, keep, valid


def _ce_count(keep: Array, dtype: np.dtype) -> Array:
    """What a "mean" divides by: the rows that count (PyTorch's mean over the rows not ignored)."""
    return jnp.sum(keep).astype(dtype)


@op(
    "cross_entropy",
    arity=2,
    attrs={"reduction": "mean", "ignore_index": -100, "label_smoothing": 0.0},
    nondiff=(1,),
    check=_cross_entropy_check,
    precision="float32",
    index_bounds=lambda specs, ignore_index=-100, **_: [(1, 0, specs[0][0][-1], ignore_index)] if specs[0][0] else [],
    index_clamps=False,  # a label out of range gives a NaN loss, which debug_nans explains
)
def cross_entropy(
    logits: Array, labels: Array, reduction: Reduction, ignore_index: int = -100, label_smoothing: float = 0.0
) -> Array:
    """Softmax cross-entropy of ``logits`` (..., C) against integer ``labels`` (...), as PyTorch's.

    Per row ``-sum(q * log_softmax(logits))`` with ``q`` the one-hot label
    (with ``label_smoothing`` e: ``(1 - e) * one_hot + e / C``), reduced by
    ``reduction`` ("mean" over the rows that count, "sum", or "none" for shape
    ``labels.shape``). Rows whose label is ``ignore_index`` (default -100)
    count for nothing: loss and gradient 0, left out of the mean. A label
    outside ``[0, C)`` that is not ``ignore_index`` gives a NaN loss (and NaN
    gradient) for its row, so bad labels never pass silently. ``labels`` get
    no gradient.
    """
    logp, target, keep, valid = _ce_parts(logits, labels, ignore_index, float(label_smoothing))
    loss = jnp.where(keep, -jnp.sum(logp * target, axis=-1), jnp.zeros((), logits.dtype))
    loss = jnp.where(valid, loss, jnp.asarray(jnp.nan, logits.dtype))
    if reduction == "mean":
        return jnp.sum(loss) / _ce_count(keep, loss.dtype)
    return _reduce(loss, reduction)


@cross_entropy.defvjp
def _cross_entropy_vjp(
    g: Array,
    out: Array,
    logits: Array,
    labels: Array,
    reduction: str,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
) -> tuple[Array, None]:
    logp, target, keep, valid = _ce_parts(logits, labels, ignore_index, float(label_smoothing))
    gl = g if reduction == "none" else jnp.broadcast_to(g, labels.shape)
    if reduction == "mean":
        gl = gl / _ce_count(keep, logits.dtype)
    gl = jnp.where(keep, gl, jnp.zeros((), logits.dtype))
    gl = jnp.where(valid, gl, jnp.asarray(jnp.nan, logits.dtype))
    return gl[..., None] * (jnp.exp(logp) - target), None


def _mse_check(specs: tuple[Spec, ...], reduction: object) -> str | None:
    if err := float_check(specs):
        return err
    if specs[0][0] != specs[1][0]:
        return (
            f"pred has shape {specs[0][0]} but target has shape {specs[1][0]}; they must match exactly "
            "(mse does not broadcast: broadcast_to or reshape one of them first)"
        )
    return _reduction_error(reduction)


@op("mse", arity=2, attrs={"reduction": "mean"}, check=_mse_check, precision="float32")
def mse(pred: Array, target: Array, reduction: Reduction) -> Array:
    """Squared error ``(pred - target) ** 2`` (same shapes), reduced by "mean", "sum" or "none"."""
    d = pred - target
    return _reduce(d * d, reduction)


@mse.defvjp
def _mse_vjp(g: Array, out: Array, pred: Array, target: Array, reduction: str) -> tuple[Array, Array]:
    gd = 2 * (pred - target) * _unreduce(g, pred.shape, reduction)
    return gd, -gd


# --------------------------------------------------------------------------- linear_t


def _linear_t_check(specs: tuple[Spec, ...]) -> str | None:
    if err := float_check(specs):
        return err
    x, w = specs[0][0], specs[1][0]
    if len(x) < 1 or len(w) != 2:
        return f"expects input of rank >= 1 and weight of shape (out_features, in_features); got input{x}, weight{w}"
    if x[-1] != w[1]:
        return f"input has {x[-1]} features but weight expects {w[1]} (weight shape (out, in) = {w})"
    if len(specs) == 3 and specs[2][0] not in ((w[0],), ()):
        return f"bias must have shape ({w[0]},) (one value per output feature), got {specs[2][0]}"
    return None


@op("linear_t", arity=(2, 3), check=_linear_t_check, public=False)
def linear_t(x: Array, w: Array, b: Array = None) -> Array:
    """``x @ w.T + b`` with ``w`` of shape ``(out, in)`` (PyTorch's layout) and an optional bias ``b`` of shape ``(out,)``."""
    y = jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))
    return y if b is None else y + b


@linear_t.defvjp
def _linear_t_vjp(g: Array, out: Array, x: Array, w: Array, b: Array = None) -> tuple[Array, ...]:
    gx = jax.lax.dot_general(g, w, (((g.ndim - 1,), (0,)), ((), ())))  # g @ w
    lead = tuple(range(x.ndim - 1))
    gw = jax.lax.dot_general(g, x, ((lead, lead), ((), ())))  # g.T @ x over every leading axis: (out, in)
    if b is None:
        return gx, gw
    return gx, gw, unbroadcast(g, b.shape)


# --------------------------------------------------------------------------- conv2d


def _padding(padding: object) -> str | tuple[tuple[int, int], tuple[int, int]] | None:
    """``"SAME"``/``"VALID"``, or ``((top, bottom), (left, right))``; None if malformed."""
    if isinstance(padding, str):
        p = padding.upper()
        return p if p in ("SAME", "VALID") else None
    pr = int_pair(padding)
    if pr is not None:
        return ((pr[0], pr[0]), (pr[1], pr[1]))
    if (
        isinstance(padding, tuple)
        and len(padding) == 2
        and all(isinstance(p, tuple) and int_pair(p) is not None for p in padding)
    ):
        (a, b), (c, d) = padding
        return ((int(a), int(b)), (int(c), int(d)))
    return None


def _nchw_error(shape: tuple[int, ...]) -> str | None:
    """Message if an image operand of ``shape`` is not rank 4 (N, C, H, W)."""
    if len(shape) != 4:
        return f"input must be NCHW (rank 4), got shape {shape}; add a batch axis with expand_dims(axis=0)"
    return None


def _out_size(n: int, k: int, s: int, d: int, pad: tuple[int, int]) -> int:
    return (n + pad[0] + pad[1] - d * (k - 1) - 1) // s + 1


def _conv2d_check(
    specs: tuple[Spec, ...], stride: object, padding: object, dilation: object, groups: object
) -> str | None:
    if err := float_check(specs):
        return err
    xs, ws = specs[0][0], specs[1][0]
    if err := _nchw_error(xs):
        return err
    if len(ws) != 4:
        return f"weight must be OIHW (rank 4: out_channels, in_channels/groups, kH, kW), got shape {ws}"
    st, dl = checked_pair(stride), checked_pair(dilation)
    if st is None or min(st) < 1:
        return f"attribute stride={stride!r} must be a positive int or a pair of them"
    if dl is None or min(dl) < 1:
        return f"attribute dilation={dilation!r} must be a positive int or a pair of them"
    pad = _padding(padding)
    if pad is None or (not isinstance(pad, str) and min(min(p) for p in pad) < 0):
        return f'attribute padding={padding!r} must be a non-negative int, a pair of them, "SAME" or "VALID"'
    ng = as_int(groups)
    if ng is None or ng < 1:
        return f"attribute groups={groups!r} must be a positive int"
    n, c, h, w = xs
    o, ci, kh, kw = ws
    if c % ng or o % ng:
        return f"groups={groups} must divide both the input channels ({c}) and the output channels ({o})"
    if ci * ng != c:
        return (
            f"input has {c} channels but weight expects {ci * ng} (groups={groups}); "
            "weight shape is (O, C/groups, kH, kW)"
        )
    if len(specs) == 3 and specs[2][0] != (o,):
        return f"bias must have shape ({o},) (one value per output channel), got {specs[2][0]}"
    if not isinstance(pad, str):
        oh = _out_size(h, kh, st[0], dl[0], pad[0])
        ow = _out_size(w, kw, st[1], dl[1], pad[1])
        if oh < 1 or ow < 1:
            return (
                f"the {kh}x{kw} kernel (dilation {dl}) does not fit the {h}x{w} input with padding {pad}: "
                "pad the input or use a smaller kernel"
            )
    elif pad == "VALID" and (dl[0] * (kh - 1) >= h or dl[1] * (kw - 1) >= w):
        return f'the {kh}x{kw} kernel (dilation {dl}) does not fit the {h}x{w} input with padding="VALID"'
    return None


def _conv2d_pads(
    hw: tuple[int, int], khw: tuple[int, int], st: tuple[int, int], dl: tuple[int, int], padding: Padding
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Explicit ``((top, bottom), (left, right))`` padding (``"SAME"``/``"VALID"`` resolved)."""
    pad = _padding(padding)
    if pad == "VALID":
        return ((0, 0), (0, 0))
    if pad == "SAME":
        eff = tuple(d * (k - 1) + 1 for d, k in zip(dl, khw))
        (a, b), (c, d) = jax.lax.padtype_to_pads(hw, eff, st, "SAME")
        return ((int(a), int(b)), (int(c), int(d)))
    assert isinstance(pad, tuple)
    return pad


@op(
    "conv2d",
    arity=(2, 3),
    attrs={"stride": 1, "padding": 0, "dilation": 1, "groups": 1},
    check=_conv2d_check,
)
def conv2d(
    x: Array, w: Array, b: Array = None, *, stride: Pair, padding: Padding, dilation: Pair, groups: int
) -> Array:
    """2-D convolution (cross-correlation) of ``x`` (N, C, H, W) with ``w`` (O, C/groups, kH, kW), plus an optional bias ``b`` (O,).

    ``stride`` and ``dilation`` are an int or a pair; ``padding`` is an int, a
    pair, ``((top, bottom), (left, right))``, ``"SAME"`` or ``"VALID"``. The
    forward is ``jax.lax.conv_general_dilated``. The VJP is hand-written from
    strided slices, einsums and pads, not derived: XLA's CPU compiler aborts
    the process on the transposed convolution that ``jax.vjp`` emits for some
    strided shapes (e.g. x (1, 1, 6, 5), w (1, 1, 2, 3), stride 2, padding (1, 0)).
    """
    st, dl = checked_pair(stride), checked_pair(dilation)
    y = jax.lax.conv_general_dilated(
        x,
        w,
        window_strides=st,
        padding=_conv2d_pads(x.shape[2:], w.shape[2:], st, dl, padding),
        rhs_dilation=dl,
        dimension_numbers=("NCHW", "OIHW", "NCHW"),
        feature_group_count=groups,
    )
    return y if b is None else y + b[None, :, None, None]


@conv2d.defvjp
def _conv2d_vjp(
    g: Array,
    out: Array,
    x: Array,
    w: Array,
    b: Array = None,
    *,
    stride: Pair,
    padding: Padding,
    dilation: Pair,
    groups: int,
) -> tuple[Array, ...]:
    (sh, sw), (dh, dw) = checked_pair(stride), checked_pair(dilation)
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    (p0, p1), (q0, q1) = _conv2d_pads((h, wd), (kh, kw), (sh, sw), (dh, dw), padding)
    oh, ow = g.shape[2:]
    xp = jnp.pad(x, ((0, 0), (0, 0), (p0, p1), (q0, q1))).reshape(n, groups, cg, h + p0 + p1, wd + q0 + q1)
    hp, wp = xp.shape[3:]
    gg = g.reshape(n, groups, o // groups, oh, ow)
    wg = w.reshape(groups, o // groups, cg, kh, kw)
    zero = jnp.zeros((), x.dtype)
    gxp = jnp.zeros(xp.shape, x.dtype)
    gw = []
    # y[n, o, i, j] = sum over (a, b) of x_pad[n, c, i*sh + a*dh, j*sw + b*dw] * w[o, c, a, b]
    for a in range(kh):
        for bb in range(kw):
            hs = slice(a * dh, a * dh + (oh - 1) * sh + 1, sh)
            ws = slice(bb * dw, bb * dw + (ow - 1) * sw + 1, sw)
            gw.append(jnp.einsum("ngchw,ngohw->goc", xp[:, :, :, hs, ws], gg))
            t = jnp.einsum("ngohw,goc->ngchw", gg, wg[:, :, :, a, bb])
            cfg = [(0, 0, 0)] * 3 + [
                (a * dh, hp - a * dh - (oh - 1) * sh - 1, sh - 1),
                (bb * dw, wp - bb * dw - (ow - 1) * sw - 1, sw - 1),
            ]
            gxp = gxp + jax.lax.pad(t, zero, cfg)
    gx = gxp.reshape(n, c, hp, wp)[:, :, p0 : p0 + h, q0 : q0 + wd]
    gw_full = jnp.stack(gw, axis=-1).reshape(o, cg, kh, kw)
    if b is None:
        return gx, gw_full
    return gx, gw_full, jnp.sum(g, axis=(0, 2, 3))


# --------------------------------------------------------------------------- pooling


def _pool_pairs(
    kernel_size: object, stride: object, padding: object
) -> tuple[tuple[int, int] | None, tuple[int, int] | None, tuple[int, int] | None]:
    """Kernel size, stride (None = the kernel size) and padding as ``(h, w)`` int pairs; None where malformed."""
    k = int_pair(kernel_size)
    return k, k if stride is None else int_pair(stride), int_pair(padding)


def _pool_check(specs: tuple[Spec, ...], kernel_size: object, stride: object, padding: object) -> str | None:
    if err := float_check(specs):
        return err
    xs = specs[0][0]
    if err := _nchw_error(xs):
        return err
    k, s, p = _pool_pairs(kernel_size, stride, padding)
    if k is None or min(k) < 1:
        return f"attribute kernel_size={kernel_size!r} must be a positive int or a pair of them"
    if s is None or min(s) < 1:
        return f"attribute stride={stride!r} must be None (= kernel_size), a positive int or a pair of them"
    if p is None or min(p) < 0:
        return f"attribute padding={padding!r} must be a non-negative int or a pair of them"
    if p[0] * 2 > k[0] or p[1] * 2 > k[1]:
        return f"padding {p} must be at most half the kernel size {k}, so no window lies entirely in padding"
    for n, kk, pp in zip(xs[2:], k, p):
        if n + 2 * pp < kk:
            return f"the {k[0]}x{k[1]} window does not fit the {xs[2]}x{xs[3]} input with padding {p}"
    return None


def _window(
    kernel_size: Pair, stride: Pair | None, padding: Pair
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, int], ...]]:
    """Window dimensions, strides and paddings of ``reduce_window`` over NCHW, from attributes the check accepted."""
    k, p = checked_pair(kernel_size), checked_pair(padding)
    s = k if stride is None else checked_pair(stride)
    return (1, 1) + k, (1, 1) + s, ((0, 0), (0, 0), (p[0], p[0]), (p[1], p[1]))


_POOL_ATTRS = {"kernel_size": REQUIRED, "stride": None, "padding": 0}


@op("max_pool2d", arity=1, attrs=_POOL_ATTRS, check=_pool_check)
def max_pool2d(x: Array, kernel_size: Pair, stride: Pair | None, padding: Pair) -> Array:
    """Max over ``kernel_size`` windows of ``x`` (N, C, H, W); ``stride`` defaults to ``kernel_size``.

    Padding is implicit ``-inf``. Via ``jax.lax.reduce_window``; the VJP is
    derived from ``jax.vjp`` of this forward (on ties the gradient goes to one
    of the maximal elements).
    """
    dims, strides, pads = _window(kernel_size, stride, padding)
    init = np.array(-np.inf, x.dtype)  # a concrete init value lets JAX differentiate the max window
    return jax.lax.reduce_window(x, init, jax.lax.max, dims, strides, pads)


@op("avg_pool2d", arity=1, attrs=_POOL_ATTRS, check=_pool_check)
def avg_pool2d(x: Array, kernel_size: Pair, stride: Pair | None, padding: Pair) -> Array:
    """Mean over ``kernel_size`` windows of ``x`` (N, C, H, W); ``stride`` defaults to ``kernel_size``.

    Zero padding counts in the mean (the divisor is always kH * kW). Via
    ``jax.lax.reduce_window``; the VJP is derived from ``jax.vjp`` of this forward.
    """
    dims, strides, pads = _window(kernel_size, stride, padding)
    s = jax.lax.reduce_window(x, np.zeros((), x.dtype), jax.lax.add, dims, strides, pads)
    return s / (dims[2] * dims[3])


# --------------------------------------------------------------------------- attention


def _attention_check(specs: tuple[Spec, ...], scale: object, causal: object, dropout: object = 0.0) -> str | None:
    if err := float_check(specs, (0, 1, 2)):
        return err
    q, k, v = (s for s, _ in specs[:3])
    for name, s in (("q", q), ("k", k), ("v", v)):
        if len(s) < 2:
            return f"{name} must have shape (..., L, D) (rank >= 2), got {s}"
    if q[-1] != k[-1]:
        return f"q has feature size {q[-1]} but k has {k[-1]}; q is (..., Lq, D) and k is (..., Lk, D)"
    if k[-2] != v[-2]:
        return f"k has {k[-2]} keys but v has {v[-2]} values; k is (..., Lk, D) and v is (..., Lk, Dv)"
    batch = broadcast_shapes(q[:-2], k[:-2], v[:-2])
    if batch is None:
        return f"batch dimensions {q[:-2]}, {k[:-2]} and {v[:-2]} of q, k and v do not broadcast together"
    target = batch + (q[-2], k[-2])
    for i, what in ((3, "mask (operand #3) must be boolean (True = attend)"), (4, "keep (operand #4) must be boolean")):
        if len(specs) > i:
            ms, mdt = specs[i]
            if mdt != np.dtype(bool):
                return f"{what}, got {mdt}; build it with a comparison"
            if not broadcasts_to(ms, target):
                return f"{('mask', 'keep')[i - 3]} has shape {ms} but must broadcast to (..., Lq, Lk) = {target}"
    if scale is not None and not is_finite_number(scale):
        return f"attribute scale={scale!r} must be a finite number or None (= 1/sqrt(D))"
    if not is_number(dropout) or not 0.0 <= float(dropout) < 1.0:
        return f"attribute dropout={dropout!r} must be a number in [0, 1)"
    if dropout and len(specs) < 5:
        return (
            f"attribute dropout={dropout} needs the keep mask (operand #4) drawn from the session's RNG; "
            "call tfl.attention(q, k, v, mask, dropout=p), which draws it"
        )
    return bool_error("causal", causal)


def _attention_probs(
    q: Array, k: Array, mask: Array, scale: float | jax.Array | None, causal: bool
) -> tuple[Array, Array]:
    """Attention weights ``p`` (..., Lq, Lk) and the scale used; fully masked rows get ``p = 0``."""
    sc = jnp.asarray(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale, q.dtype)
    s = (q @ jnp.swapaxes(k, -1, -2)) * sc
    keep = None if mask is None else mask
    if causal:
        lq, lk = q.shape[-2], k.shape[-2]
        tri = jnp.arange(lk)[None, :] <= jnp.arange(lq)[:, None]
        if keep is None and lk > 0:
            # every query keeps key 0, so no row is empty: the max is finite and the sum positive, and the
            # guards of the masked form below (two selects and a where over (..., Lq, Lk)) change nothing
            s = jnp.where(tri, s, jnp.asarray(-jnp.inf, s.dtype))
            m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
            e = jnp.exp(s - m)
            return e / jnp.sum(e, axis=-1, keepdims=True), sc
        keep = tri if keep is None else keep & tri
    if keep is None:
        m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
        e = jnp.exp(s - m)
        return e / jnp.sum(e, axis=-1, keepdims=True), sc
    neg = jnp.asarray(-jnp.inf, s.dtype)
    sm = jnp.where(keep, s, neg)
    m = _stable_max(sm, (sm.ndim - 1,))
    e = jnp.where(keep, jnp.exp(sm - m), jnp.zeros((), s.dtype))
    den = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(den > 0, den, jnp.ones((), s.dtype)), sc


def _dropped(p: Array, keep: Array, dropout: float) -> Array:
    """Inverted dropout of the attention weights: kept entries scaled by ``1 / (1 - dropout)``."""
    return jnp.where(keep, p * jnp.asarray(1.0 / (1.0 - dropout), p.dtype), jnp.zeros((), p.dtype))


@op(
    "attention",
    arity=(3, 5),
    attrs={"scale": None, "causal": False, "dropout": 0.0},
    nondiff=(3, 4),
    check=_attention_check,
    aliases=("scaled_dot_product_attention",),
    runtime=("scale",),
)
def attention(
    q: Array,
    k: Array,
    v: Array,
    mask: Array = None,
    keep: Array = None,
    *,
    scale: float | None,
    causal: bool,
    dropout: float,
) -> Array:
    """Scaled dot-product attention ``softmax(q @ k^T * scale) @ v``.

    ``q`` (..., Lq, D), ``k`` (..., Lk, D), ``v`` (..., Lk, Dv); batch dims
    broadcast. ``scale`` defaults to ``1/sqrt(D)``. ``mask`` is boolean,
    broadcastable to (..., Lq, Lk), True = attend; it gets no gradient.
    ``causal=True`` additionally keeps key ``j`` for query ``i`` only when
    ``j <= i`` (top-left aligned, as ``jax.nn.dot_product_attention``). A query
    row with every key masked attends to nothing: its output is 0 and it
    passes zero gradient (never NaN). ``dropout=p`` drops attention weights
    after the softmax with probability ``p`` and scales the rest by
    ``1 / (1 - p)``, as ``torch.nn.functional.scaled_dot_product_attention``'s
    ``dropout_p``; the boolean ``keep`` operand (True = kept) is drawn from the
    session's RNG by ``tfl.attention``. The VJP recomputes the softmax.
    """
    p, _ = _attention_probs(q, k, mask, scale, causal)
    if keep is not None:
        p = _dropped(p, keep, dropout)
    return p @ v


@attention.defvjp
def _attention_vjp(
    g: Array,
    out: Array,
    q: Array,
    k: Array,
    v: Array,
    mask: Array = None,
    keep: Array = None,
    *,
    scale: float | jax.Array | None,
    causal: bool,
    dropout: float,
) -> tuple[Array, ...]:
    p, sc = _attention_probs(q, k, mask, scale, causal)
    pd = p if keep is None else _dropped(p, keep, dropout)
    gv = jnp.swapaxes(pd, -1, -2) @ g
    gp = g @ jnp.swapaxes(v, -1, -2)
    if keep is not None:
        gp = _dropped(gp, keep, dropout)
    # the softmax VJP's row sums sum(p * gp) over the Lk keys equal sum(g * out) over the Dv features
    # (out = pd @ v, with or without dropout): one reduction over Dv, not a product and a reduction over
    # (..., Lq, Lk); the scale multiplies the (..., L, D) products, not the (..., Lq, Lk) cotangent (XLA:CPU
    # materializes a broadcast scalar as an operand of the fused matmul)
    gs = p * (gp - jnp.sum(g * out, axis=-1, keepdims=True))
    gq = (gs @ k) * sc
    gk = (jnp.swapaxes(gs, -1, -2) @ q) * sc
    cts = (unbroadcast(gq, q.shape), unbroadcast(gk, k.shape), unbroadcast(gv, v.shape))
    return cts + (None,) * (0 if mask is None else 1 if keep is None else 2)
