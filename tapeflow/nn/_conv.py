"""Convolutions, pools and resampling: Conv1d, Conv2d, ConvTranspose2d, MaxPool1d/2d, AvgPool1d/2d,
AdaptiveAvgPool1d/2d and Upsample, with ``torch.nn``'s constructor arguments and parameter layouts.

Weights are ``(out_channels, in_channels / groups, *kernel_size)``
(``ConvTranspose2d``: ``(in_channels, out_channels / groups, kh, kw)``), as
PyTorch stores them, so a state dict loads without a transform. Each forward
is one call of the function of the same name in :mod:`tapeflow.nn.functional`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

from .._core._typing import DTypeLike, PRNGKey
from .._shell._surface import torch_entry
from .._shell._tensor import Operand, Tensor
from . import _init as init
from . import functional as F
from ._layers import fan_in_bound, uniform_param
from ._module import Module, factory_dtype

__all__ = [
    "AdaptiveAvgPool1d",
    "AdaptiveAvgPool2d",
    "AvgPool1d",
    "AvgPool2d",
    "Conv1d",
    "Conv2d",
    "ConvTranspose2d",
    "MaxPool1d",
    "MaxPool2d",
    "Upsample",
]

IntOrTuple = int | Sequence[int]
_PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


def _tuple(name: str, layer: str, v: IntOrTuple, n: int) -> tuple[int, ...]:
    if isinstance(v, int) and not isinstance(v, bool):
        return (v,) * n
    out = tuple(cast(Sequence[int], v))
    if len(out) != n or not all(isinstance(d, int) and not isinstance(d, bool) for d in out):
        raise ValueError(f"{layer}: {name}={v!r} must be an int or a tuple of {n} ints")
    return out


class _ConvNd(Module):
    """Shared construction of the convolutions (PyTorch's ``_ConvNd``)."""

    _n = 2
    _transposed = False

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: IntOrTuple,
        stride: IntOrTuple = 1,
        padding: str | IntOrTuple = 0,
        dilation: IntOrTuple = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device: object = None,
        dtype: DTypeLike | None = None,
        *,
        key: PRNGKey | None = None,
        output_padding: IntOrTuple = 0,
    ) -> None:
        layer = type(self).__name__
        dt = factory_dtype(device, dtype, layer)
        n = self._n
        self.in_channels, self.out_channels, self.groups = int(in_channels), int(out_channels), int(groups)
        if self.groups < 1 or self.in_channels % self.groups or self.out_channels % self.groups:
            raise ValueError(
                f"{layer}: in_channels={in_channels} and out_channels={out_channels} must both be divisible by "
                f"groups={groups} (>= 1)"
            )
        self.kernel_size = _tuple("kernel_size", layer, kernel_size, n)
        self.stride = _tuple("stride", layer, stride, n)
        self.dilation = _tuple("dilation", layer, dilation, n)
        self.output_padding = _tuple("output_padding", layer, output_padding, n)
        if min(self.kernel_size) < 1 or min(self.stride) < 1 or min(self.dilation) < 1:
            raise ValueError(f"{layer}: kernel_size, stride and dilation must be positive")
        if isinstance(padding, str):
            if padding not in ("same", "valid") or self._transposed:
                raise ValueError(f"{layer}: padding={padding!r}; expected 'same', 'valid' or ints")
            if padding == "same" and any(s != 1 for s in self.stride):
                raise ValueError(f"{layer}: padding='same' is not supported for strided convolutions")
            self.padding: str | tuple[int, ...] = padding
        else:
            self.padding = _tuple("padding", layer, padding, n)
        if padding_mode not in _PADDING_MODES or (self._transposed and padding_mode != "zeros"):
            allowed = ("zeros",) if self._transposed else _PADDING_MODES
            raise ValueError(f"{layer}: padding_mode={padding_mode!r}; expected one of {allowed}")
        self.padding_mode = padding_mode
        if self._transposed:
            shape = (self.in_channels, self.out_channels // self.groups, *self.kernel_size)
        else:
            shape = (self.out_channels, self.in_channels // self.groups, *self.kernel_size)
        fan_in = shape[1] * math.prod(self.kernel_size)  # PyTorch's fan-in of the weight: dim 1 x receptive field
        bound = fan_in_bound(fan_in)
        kw, kb = init.keys(init.require_key(key, layer), 2)
        self.weight = uniform_param(kw, shape, bound, dt, "weight")
        self.bias = uniform_param(kb, (self.out_channels,), bound, dt, "bias") if bias else None

    def _padded(self, input: Operand) -> tuple[Operand, str | tuple[int, ...]]:
        """``input`` padded by ``padding_mode`` (non-zero modes pad first, then convolve unpadded)."""
        if self.padding_mode == "zeros":
            return input, self.padding
        if isinstance(self.padding, str):
            total = [d * (k - 1) for d, k in zip(self.dilation, self.kernel_size)]
            if self.padding == "valid":
                total = [0] * self._n
            pads = [p for t in reversed(total) for p in (t // 2, t - t // 2)]
        else:
            pads = [p for p in reversed(self.padding) for _ in range(2)]
        return F.pad(input, pads, mode=self.padding_mode), (0,) * self._n

    def extra_repr(self) -> str:
        s = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"
        if self.padding != (0,) * self._n:
            s += f", padding={self.padding}"
        if self.dilation != (1,) * self._n:
            s += f", dilation={self.dilation}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        if self.padding_mode != "zeros":
            s += f", padding_mode={self.padding_mode!r}"
        return s


@torch_entry(bind=("nn",), records="module", opinfo=())
class Conv1d(_ConvNd):
    """1-D convolution over ``(N, C, L)`` (or unbatched ``(C, L)``) input, as ``torch.nn.Conv1d``.

    ``weight`` is ``(out_channels, in_channels / groups, kernel_size)``; padding
    is an int, ``'same'`` or ``'valid'``; ``padding_mode`` is ``'zeros'``,
    ``'reflect'``, ``'replicate'`` or ``'circular'``. Initialized as PyTorch
    does: uniform in ``±1/sqrt(fan_in)``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> conv = tfl.nn.Conv1d(4, 6, 3, padding="same", groups=2)
    >>> conv.weight.shape
    (6, 2, 3)
    >>> with tfl.Session() as s:
    ...     conv(s.input(jnp.ones((2, 4, 7)))).shape
    (2, 6, 7)
    """

    _n = 1

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: IntOrTuple,
        stride: IntOrTuple = 1,
        padding: str | IntOrTuple = 0,
        dilation: IntOrTuple = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device: object = None,
        dtype: DTypeLike | None = None,
        *,
        key: PRNGKey | None = None,
    ) -> None:
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode,
            device, dtype, key=key,
        )  # fmt: skip

    def forward(self, input: Operand) -> Tensor:
        x, padding = self._padded(input)
        return F.conv1d(x, self.weight, self.bias, self.stride, padding, self.dilation, self.groups)


@torch_entry(bind=("nn",), records="module", opinfo=())
class Conv2d(_ConvNd):
    """2-D convolution over ``(N, C, H, W)`` (or unbatched ``(C, H, W)``) input, as ``torch.nn.Conv2d``.

    ``weight`` is OIHW: ``(out_channels, in_channels / groups, kh, kw)``;
    ``groups=in_channels`` is a depthwise convolution; padding is an int, a
    pair, ``'same'`` or ``'valid'``; ``padding_mode`` is ``'zeros'``,
    ``'reflect'``, ``'replicate'`` or ``'circular'``. Initialized as PyTorch
    does: uniform in ``±1/sqrt(fan_in)``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> conv = tfl.nn.Conv2d(3, 8, 3, padding=1)
    >>> conv.weight.shape
    (8, 3, 3, 3)
    >>> with tfl.Session() as s:
    ...     conv(s.input(jnp.ones((2, 3, 5, 5)))).shape
    (2, 8, 5, 5)
    """

    _n = 2

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: IntOrTuple,
        stride: IntOrTuple = 1,
        padding: str | IntOrTuple = 0,
        dilation: IntOrTuple = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device: object = None,
        dtype: DTypeLike | None = None,
        *,
        key: PRNGKey | None = None,
    ) -> None:
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode,
            device, dtype, key=key,
        )  # fmt: skip

    def forward(self, input: Operand) -> Tensor:
        x, padding = self._padded(input)
        return F.conv2d(x, self.weight, self.bias, self.stride, padding, self.dilation, self.groups)


@torch_entry(bind=("nn",), records="module", opinfo=())
class ConvTranspose2d(_ConvNd):
    """Transposed 2-D convolution (the gradient of :class:`Conv2d` with respect to its input), as ``torch.nn.ConvTranspose2d``.

    ``weight`` is ``(in_channels, out_channels / groups, kh, kw)``.
    ``forward(input, output_size=None)``: ``output_size`` (the last two, or all,
    dimensions) picks the ``output_padding`` that gives that size, as PyTorch does.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> up = tfl.nn.ConvTranspose2d(
    ...     4, 2, 3, stride=2, padding=1, output_padding=1
    ... )
    >>> up.weight.shape
    (4, 2, 3, 3)
    >>> with tfl.Session() as s:
    ...     up(s.input(jnp.ones((1, 4, 5, 5)))).shape
    (1, 2, 10, 10)
    """

    _n = 2
    _transposed = True

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: IntOrTuple,
        stride: IntOrTuple = 1,
        padding: IntOrTuple = 0,
        output_padding: IntOrTuple = 0,
        groups: int = 1,
        bias: bool = True,
        dilation: IntOrTuple = 1,
        padding_mode: str = "zeros",
        device: object = None,
        dtype: DTypeLike | None = None,
        *,
        key: PRNGKey | None = None,
    ) -> None:
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode,
            device, dtype, key=key, output_padding=output_padding,
        )  # fmt: skip

    def _output_padding(self, input: Operand, output_size: Sequence[int] | None) -> tuple[int, ...]:
        if output_size is None:
            return self.output_padding
        size = tuple(int(d) for d in output_size)[-2:]
        spatial = tuple(getattr(input, "shape", ()))[-2:]
        pads: list[int] = []
        for d in range(2):
            assert isinstance(self.padding, tuple)
            least = (
                (spatial[d] - 1) * self.stride[d]
                - 2 * self.padding[d]
                + self.dilation[d] * (self.kernel_size[d] - 1)
                + 1
            )
            extra = size[d] - least
            if not 0 <= extra < max(self.stride[d], self.dilation[d]):
                raise ValueError(
                    f"ConvTranspose2d: output_size={tuple(output_size)} is not reachable from input of spatial shape "
                    f"{spatial}: dimension {d} must be in [{least}, {least + max(self.stride[d], self.dilation[d]) - 1}]"
                )
            pads.append(extra)
        return tuple(pads)

    def forward(self, input: Operand, output_size: Sequence[int] | None = None) -> Tensor:
        op = self._output_padding(input, output_size)
        assert isinstance(self.padding, tuple)  # a transposed convolution refuses string padding
        return F.conv_transpose2d(
            input, self.weight, self.bias, self.stride, self.padding, op, self.groups, self.dilation
        )


class _MaxPoolNd(Module):
    _n = 2

    def __init__(
        self,
        kernel_size: IntOrTuple,
        stride: IntOrTuple | None = None,
        padding: IntOrTuple = 0,
        dilation: IntOrTuple = 1,
        return_indices: bool = False,
        ceil_mode: bool = False,
    ) -> None:
        self.kernel_size = kernel_size
        self.stride = stride if stride is not None else kernel_size
        self.padding = padding
        self.dilation = dilation
        self.return_indices = bool(return_indices)
        self.ceil_mode = bool(ceil_mode)

    def forward(self, input: Operand) -> Tensor | tuple[Tensor, Tensor]:
        fn = F.max_pool1d if self._n == 1 else F.max_pool2d
        return fn(
            input, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode, self.return_indices
        )

    def extra_repr(self) -> str:
        return (
            f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
            f"dilation={self.dilation}, ceil_mode={self.ceil_mode}"
        )


@torch_entry(bind=("nn",), records="module", opinfo=())
class MaxPool1d(_MaxPoolNd):
    """Max over sliding windows of ``(N, C, L)`` input, as ``torch.nn.MaxPool1d`` (``stride`` defaults to ``kernel_size``).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.arange(6.0).reshape(1, 1, 6))
    ...     tfl.nn.MaxPool1d(2)(x).tolist()
    [[[1.0, 3.0, 5.0]]]
    """

    _n = 1


@torch_entry(bind=("nn",), records="module", opinfo=())
class MaxPool2d(_MaxPoolNd):
    """Max over sliding windows of ``(N, C, H, W)`` input, as ``torch.nn.MaxPool2d`` (``stride`` defaults to ``kernel_size``).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.nn.MaxPool2d(2)(s.input(jnp.ones((1, 3, 4, 4)))).shape
    (1, 3, 2, 2)
    """

    _n = 2


@torch_entry(bind=("nn",), records="module", opinfo=())
class AvgPool1d(Module):
    """Mean over sliding windows of ``(N, C, L)`` input, as ``torch.nn.AvgPool1d``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.arange(4.0).reshape(1, 1, 4))
    ...     tfl.nn.AvgPool1d(2)(x).tolist()
    [[[0.5, 2.5]]]
    """

    def __init__(
        self,
        kernel_size: IntOrTuple,
        stride: IntOrTuple | None = None,
        padding: IntOrTuple = 0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
    ) -> None:
        self.kernel_size = kernel_size
        self.stride = stride if stride is not None else kernel_size
        self.padding = padding
        self.ceil_mode = bool(ceil_mode)
        self.count_include_pad = bool(count_include_pad)

    def forward(self, input: Operand) -> Tensor:
        return F.avg_pool1d(input, self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


@torch_entry(bind=("nn",), records="module", opinfo=())
class AvgPool2d(Module):
    """Mean over sliding windows of ``(N, C, H, W)`` input, as ``torch.nn.AvgPool2d``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.nn.AvgPool2d(2)(s.input(jnp.ones((1, 3, 4, 4)))).shape
    (1, 3, 2, 2)
    """

    def __init__(
        self,
        kernel_size: IntOrTuple,
        stride: IntOrTuple | None = None,
        padding: IntOrTuple = 0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
        divisor_override: int | None = None,
    ) -> None:
        self.kernel_size = kernel_size
        self.stride = stride if stride is not None else kernel_size
        self.padding = padding
        self.ceil_mode = bool(ceil_mode)
        self.count_include_pad = bool(count_include_pad)
        self.divisor_override = divisor_override

    def forward(self, input: Operand) -> Tensor:
        return F.avg_pool2d(
            input,
            self.kernel_size,
            self.stride,
            self.padding,
            self.ceil_mode,
            self.count_include_pad,
            self.divisor_override,
        )

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


@torch_entry(bind=("nn",), records="module", opinfo=())
class AdaptiveAvgPool1d(Module):
    """Mean pooling of ``(N, C, L)`` input to ``output_size`` positions, as ``torch.nn.AdaptiveAvgPool1d``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.arange(4.0).reshape(1, 1, 4))
    ...     tfl.nn.AdaptiveAvgPool1d(1)(x).tolist()
    [[[1.5]]]
    """

    def __init__(self, output_size: int) -> None:
        self.output_size = output_size

    def forward(self, input: Operand) -> Tensor:
        return F.adaptive_avg_pool1d(input, self.output_size)

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}"


@torch_entry(bind=("nn",), records="module", opinfo=())
class AdaptiveAvgPool2d(Module):
    """Mean pooling of ``(N, C, H, W)`` input to ``output_size`` (an int, a pair, None keeps a size), as ``torch.nn.AdaptiveAvgPool2d``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.ones((2, 3, 5, 5)))
    ...     tfl.nn.AdaptiveAvgPool2d((1, 1))(x).shape
    (2, 3, 1, 1)
    """

    def __init__(self, output_size: int | Sequence[int | None] | None) -> None:
        self.output_size = output_size

    def forward(self, input: Operand) -> Tensor:
        return F.adaptive_avg_pool2d(input, self.output_size)

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}"


@torch_entry(bind=("nn",), records="module", opinfo=())
class Upsample(Module):
    """Resize spatial dimensions by ``size`` or ``scale_factor`` (``'nearest'`` or ``'bilinear'``), as ``torch.nn.Upsample``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.ones((1, 1, 2, 2)))
    ...     tfl.nn.Upsample(scale_factor=2)(x).shape
    (1, 1, 4, 4)
    """

    def __init__(
        self,
        size: int | Sequence[int] | None = None,
        scale_factor: float | Sequence[float] | None = None,
        mode: str = "nearest",
        align_corners: bool | None = None,
        recompute_scale_factor: bool | None = None,
    ) -> None:
        if (size is None) == (scale_factor is None):
            raise ValueError("Upsample: pass exactly one of size and scale_factor")
        self.size = size
        self.scale_factor = scale_factor
        self.mode = mode
        self.align_corners = align_corners
        self.recompute_scale_factor = recompute_scale_factor

    def forward(self, input: Operand) -> Tensor:
        return F.interpolate(
            input, self.size, self.scale_factor, self.mode, self.align_corners, self.recompute_scale_factor
        )

    def extra_repr(self) -> str:
        what = f"size={self.size}" if self.size is not None else f"scale_factor={self.scale_factor}"
        return f"{what}, mode={self.mode!r}"
