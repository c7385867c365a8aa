"""Normalization layers: :class:`BatchNorm1d` / :class:`BatchNorm2d` (running statistics), :class:`LayerNorm`,
:class:`GroupNorm` and :class:`RMSNorm`, with ``torch.nn``'s arguments and state-dict keys.

PyTorch's semantics: in training behaviour a batch is normalized with its own
mean and biased variance over every axis but the channel axis (axis 1), and
the running statistics move towards the batch's mean and *unbiased* variance
with ``momentum``; in eval behaviour the running statistics normalize.

``weight`` and ``bias`` are trainable Params; ``running_mean``, ``running_var``
and ``num_batches_tracked`` are buffers (:meth:`Module.register_buffer`:
non-trainable Params used as state cells): ``named_buffers()`` lists them and
``parameters()`` does not, as in PyTorch; they are state-dict entries, saved
and restored by :func:`tfl.save` / :func:`tfl.restore`, and written with
:meth:`Session.assign_state`, so an eager forward updates them at once and
:func:`tfl.train_step` updates them inside its compiled program (see
``docs/concepts.md``, "Modes and state").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import jax
import numpy as np

from .._core._precision import keep_dtypes
from .._core._registry import is_float
from .._core._result import TapeError
from .._core._typing import DTypeLike
from .._shell import _functions as R
from .._shell._params import Param
from .._shell._surface import torch_entry
from .._shell._tensor import Operand, Tensor, session_of
from . import functional as F
from ._module import Module, factory_dtype

if TYPE_CHECKING:
    from .._shell._session import Session

__all__ = ["BatchNorm1d", "BatchNorm2d", "GroupNorm", "LayerNorm", "RMSNorm"]


class _BatchNorm(Module):
    """Shared implementation; subclasses set the accepted input ranks."""

    _ranks: tuple[int, ...] = ()
    _layout = ""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: object = None,
        dtype: DTypeLike | None = None,
    ) -> None:
        name = type(self).__name__
        dtype = factory_dtype(device, dtype, name)
        if int(num_features) < 1:
            raise ValueError(f"{name}: num_features must be >= 1, got {num_features}")
        if not (math.isfinite(float(eps)) and float(eps) >= 0.0):
            raise ValueError(f"{name}: eps must be a finite number >= 0, got {eps}")
        if momentum is not None and not 0.0 <= float(momentum) <= 1.0:
            raise ValueError(f"{name}: momentum must be in [0, 1] or None (cumulative average), got {momentum}")
        self.num_features = int(num_features)
        self.eps = float(eps)
        self.momentum = None if momentum is None else float(momentum)
        self.affine = bool(affine)
        self.track_running_stats = bool(track_running_stats)
        c = (self.num_features,)
        # host ones and zeros: jnp.ones would compile a program per shape
        self.weight: Param | None = Param(np.ones(c, dtype), name="weight") if self.affine else None
        self.bias: Param | None = Param(np.zeros(c, dtype), name="bias") if self.affine else None
        self.running_mean: Param | None
        self.running_var: Param | None
        self.num_batches_tracked: Param | None
        track = self.track_running_stats
        self.register_buffer("running_mean", np.zeros(c, dtype) if track else None)
        self.register_buffer("running_var", np.ones(c, dtype) if track else None)
        self.register_buffer("num_batches_tracked", np.zeros((), np.int32) if track else None)

    def _check(self, x: Tensor | jax.Array) -> tuple[int, ...]:
        shape = tuple(np.shape(x))
        name = type(self).__name__
        if len(shape) not in self._ranks:
            raise TapeError(f"{name}: expected input of shape {self._layout}, got shape {shape}")
        if shape[1] != self.num_features:
            raise TapeError(
                f"{name}: input has {shape[1]} channels (axis 1 of shape {shape}) but num_features={self.num_features}"
            )
        if not is_float(np.dtype(x.dtype)):
            raise TapeError(f"{name}: input has dtype {x.dtype}, expected a floating dtype; cast it with tfl.astype")
        return shape

    def forward(self, x: Tensor | jax.Array, training: bool | None = None) -> Tensor:
        """Normalize ``x``; ``training`` (default: the module's mode and the session's ``grad_enabled``) forces a behaviour."""
        shape = self._check(x)
        s = session_of((x,), type(self).__name__)
        if training is None:
            training = self.training and s.grad_enabled
        axes = (0, *range(2, len(shape)))
        bshape = (1, self.num_features) + (1,) * (len(shape) - 2)
        dtype = np.dtype(x.dtype)
        with s.as_current():  # Params alone (weight.reshape) record on x's session
            if training or self.running_mean is None or self.running_var is None:
                n = math.prod(shape[a] for a in axes)
                if training and n <= 1:
                    raise TapeError(
                        f"{type(self).__name__}: expected more than 1 value per channel when training, got input "
                        f"shape {shape}"
                    )
                mean = R.mean(x, axis=axes, keepdims=True)
                xc = x - mean
                var = R.mean(xc * xc, axis=axes, keepdims=True)  # biased: what normalizes
                if training and self.running_mean is not None:
                    self._update_running_stats(s, mean, var, n)
            else:
                mean, var = (
                    self._running(self.running_mean, bshape, dtype),
                    self._running(self.running_var, bshape, dtype),
                )
                xc = x - mean
            y = xc * (1.0 / R.sqrt(var + self.eps))
            if self.weight is not None and self.bias is not None:
                y = y * R.reshape(self.weight, bshape) + R.reshape(self.bias, bshape)
        return y

    @staticmethod
    def _running(p: Param, bshape: tuple[int, ...], dtype: np.dtype) -> Tensor:
        t = R.reshape(p, bshape)
        return t if p.dtype == dtype else R.astype(t, dtype)

    def _update_running_stats(self, s: Session, mean: Tensor, var: Tensor, n: int) -> None:
        """PyTorch's update: ``r <- (1 - f) r + f * batch``, unbiased batch variance, ``f`` = momentum or 1/count.

        Computed in the statistics' own dtype whatever the session's compute dtype (as PyTorch's
        autocast updates float32 buffers in float32): a bfloat16 update of a small momentum rounds away.
        """
        rm, rv, count = self.running_mean, self.running_var, self.num_batches_tracked
        assert rm is not None and rv is not None and count is not None
        # no_grad: the statistics are not part of any gradient; keep_dtypes: no cast to the compute dtype
        with s.no_grad(), keep_dtypes():
            new_count = s.use(count) + 1
            f: Tensor | float = self.momentum if self.momentum is not None else 1.0 / R.astype(new_count, rm.dtype)
            m = R.reshape(mean, (self.num_features,))
            v = R.reshape(var, (self.num_features,)) * (n / (n - 1))
            if m.dtype != rm.dtype:
                m, v = R.astype(m, rm.dtype), R.astype(v, rm.dtype)
            new_mean = s.use(rm) * (1.0 - f) + m * f
            new_var = s.use(rv) * (1.0 - f) + v * f
            s.assign_state(rm, new_mean)
            s.assign_state(rv, new_var)
            s.assign_state(count, new_count)

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
            f"track_running_stats={self.track_running_stats}"
        )


@torch_entry(bind=("nn",), records="module", opinfo=())
class BatchNorm1d(_BatchNorm):
    """Batch normalization over ``(N, C)`` or ``(N, C, L)`` input, as ``torch.nn.BatchNorm1d``.

    Train mode in a training session normalizes with the batch statistics and
    updates ``running_mean`` / ``running_var`` (momentum, unbiased variance) and
    ``num_batches_tracked``; eval mode (:meth:`Module.eval`) or an inference
    session normalizes with the running statistics. ``momentum=None`` is a
    cumulative average; ``track_running_stats=False`` always uses batch statistics.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> bn = tfl.nn.BatchNorm1d(2)
    >>> with tfl.Session() as s:
    ...     y = bn(s.input(jnp.array([[1.0, 10.0], [3.0, 30.0]])))
    ...     [round(v, 3) for v in y.value[:, 0].tolist()]
    [-1.0, 1.0]
    >>> stats = (bn.running_mean, bn.running_var)
    >>> [[round(v, 4) for v in p.value.tolist()] for p in stats]
    [[0.2, 2.0], [1.1, 20.9]]
    >>> int(bn.num_batches_tracked.value)
    1
    """

    _ranks = (2, 3)
    _layout = "(N, C) or (N, C, L)"


@torch_entry(bind=("nn",), records="module", opinfo=())
class BatchNorm2d(_BatchNorm):
    """Batch normalization over ``(N, C, H, W)`` input, as ``torch.nn.BatchNorm2d`` (see :class:`BatchNorm1d`).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> bn = tfl.nn.BatchNorm2d(3).eval()  # eval: the running statistics (0, 1)
    >>> with tfl.Session(grad_enabled=False) as s:
    ...     y = bn(s.input(jnp.full((2, 3, 4, 4), 2.0)))
    ...     y.shape, round(float(y.value.max()), 4)
    ((2, 3, 4, 4), 2.0)
    """

    _ranks = (4,)
    _layout = "(N, C, H, W)"


def _normalized(name: str, shape: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        return (int(shape),)
    out = tuple(int(d) for d in cast(Sequence[int], shape))
    if not out:
        raise ValueError(f"{name}: normalized_shape must name at least one dimension, got {shape!r}")
    return out


@torch_entry(bind=("nn",), records="module", opinfo=())
class LayerNorm(Module):
    """Layer normalization over the trailing ``normalized_shape``, as ``torch.nn.LayerNorm``.

    ``weight`` (ones) and ``bias`` (zeros) have ``normalized_shape``;
    ``elementwise_affine=False`` has neither, ``bias=False`` no bias.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> ln = tfl.nn.LayerNorm(4)
    >>> with tfl.Session() as s:
    ...     y = ln(s.input(jnp.arange(8.0).reshape(2, 4)))
    ...     [round(v, 3) for v in y.value[0].tolist()]
    [-1.342, -0.447, 0.447, 1.342]
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: object = None,
        dtype: DTypeLike | None = None,
    ) -> None:
        dt = factory_dtype(device, dtype, "LayerNorm")
        self.normalized_shape = _normalized("LayerNorm", normalized_shape)
        self.eps = float(eps)
        self.elementwise_affine = bool(elementwise_affine)
        shape = self.normalized_shape
        self.weight: Param | None = Param(np.ones(shape, dt), name="weight") if elementwise_affine else None
        has_bias = elementwise_affine and bias
        self.bias: Param | None = Param(np.zeros(shape, dt), name="bias") if has_bias else None

    def forward(self, input: Operand) -> Tensor:
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


@torch_entry(bind=("nn",), records="module", opinfo=())
class GroupNorm(Module):
    """Group normalization of ``(N, C, *)`` input over ``num_groups`` channel groups, as ``torch.nn.GroupNorm``.

    ``weight`` (ones) and ``bias`` (zeros) are per channel, ``(num_channels,)``;
    ``bias=False`` keeps the weight and drops the bias (both need ``affine``).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> gn = tfl.nn.GroupNorm(2, 4)
    >>> with tfl.Session() as s:
    ...     gn(s.input(jnp.arange(16.0).reshape(2, 4, 2))).shape
    (2, 4, 2)
    """

    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        device: object = None,
        dtype: DTypeLike | None = None,
        *,
        bias: bool = True,
    ) -> None:
        dt = factory_dtype(device, dtype, "GroupNorm")
        self.num_groups, self.num_channels = int(num_groups), int(num_channels)
        if self.num_groups < 1 or self.num_channels % self.num_groups:
            raise ValueError(
                f"GroupNorm: num_channels={num_channels} must be divisible by num_groups={num_groups} (>= 1)"
            )
        self.eps = float(eps)
        self.affine = bool(affine)
        c = (self.num_channels,)
        self.weight: Param | None = Param(np.ones(c, dt), name="weight") if self.affine else None
        self.bias: Param | None = Param(np.zeros(c, dt), name="bias") if self.affine and bias else None

    def forward(self, input: Operand) -> Tensor:
        return F.group_norm(input, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"


@torch_entry(bind=("nn",), records="module", opinfo=())
class RMSNorm(Module):
    """Root-mean-square normalization over the trailing ``normalized_shape``, as ``torch.nn.RMSNorm``.

    ``eps=None`` is the input dtype's machine epsilon, as PyTorch; ``weight``
    (ones, ``normalized_shape``) unless ``elementwise_affine=False``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([3.0, 4.0]))
    ...     [round(v, 4) for v in tfl.nn.RMSNorm(2)(x).tolist()]
    [0.8485, 1.1314]
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float | None = None,
        elementwise_affine: bool = True,
        device: object = None,
        dtype: DTypeLike | None = None,
    ) -> None:
        dt = factory_dtype(device, dtype, "RMSNorm")
        self.normalized_shape = _normalized("RMSNorm", normalized_shape)
        self.eps = None if eps is None else float(eps)
        self.elementwise_affine = bool(elementwise_affine)
        self.weight: Param | None = (
            Param(np.ones(self.normalized_shape, dt), name="weight") if elementwise_affine else None
        )

    def forward(self, input: Operand) -> Tensor:
        return F.rms_norm(input, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
