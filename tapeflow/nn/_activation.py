"""Activation modules: ``torch.nn``'s ReLU, GELU, SiLU, Tanh, Sigmoid, Softmax, LogSoftmax, LeakyReLU, ELU, Softplus.

Each holds PyTorch's constructor arguments as attributes and calls the
function of the same name in :mod:`tapeflow.nn.functional`; none has parameters.
"""

from __future__ import annotations

from .._shell._surface import torch_entry
from .._shell._tensor import Operand, Tensor
from . import functional as F
from ._module import Module

__all__ = ["ELU", "GELU", "LeakyReLU", "LogSoftmax", "ReLU", "SiLU", "Sigmoid", "Softmax", "Softplus", "Tanh"]


@torch_entry(bind=("nn",), records="module", opinfo=())
class ReLU(Module):
    """``max(input, 0)``, as ``torch.nn.ReLU`` (``inplace`` is accepted: tensors are values).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.nn.ReLU()(s.input(jnp.array([-1.0, 2.0]))).tolist()
    [0.0, 2.0]
    """

    def __init__(self, inplace: bool = False) -> None:
        self.inplace = bool(inplace)

    def forward(self, input: Operand) -> Tensor:
        return F.relu(input)


@torch_entry(bind=("nn",), records="module", opinfo=())
class GELU(Module):
    """Gaussian error linear unit, exact (``approximate='none'``) or ``'tanh'``, as ``torch.nn.GELU``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     round(tfl.nn.GELU()(s.input(jnp.array([1.0]))).item(), 4)
    0.8413
    """

    def __init__(self, approximate: str = "none") -> None:
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, input: Operand) -> Tensor:
        return F.gelu(input, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


@torch_entry(bind=("nn",), records="module", opinfo=())
class SiLU(Module):
    """``input * sigmoid(input)``, as ``torch.nn.SiLU``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.nn.SiLU()(s.input(jnp.array([0.0]))).tolist()
    [0.0]
    """

    def __init__(self, inplace: bool = False) -> None:
        self.inplace = bool(inplace)

    def forward(self, input: Operand) -> Tensor:
        return F.silu(input)


@torch_entry(bind=("nn",), records="module", opinfo=())
class Tanh(Module):
    """``tanh(input)``, as ``torch.nn.Tanh``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.nn.Tanh()(s.input(jnp.array([0.0]))).tolist()
    [0.0]
    """

    def forward(self, input: Operand) -> Tensor:
        return F.tanh(input)


@torch_entry(bind=("nn",), records="module", opinfo=())
class Sigmoid(Module):
    """``1 / (1 + exp(-input))``, as ``torch.nn.Sigmoid``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.nn.Sigmoid()(s.input(jnp.array([0.0]))).tolist()
    [0.5]
    """

    def forward(self, input: Operand) -> Tensor:
        return F.sigmoid(input)


@torch_entry(bind=("nn",), records="module", opinfo=())
class Softmax(Module):
    """Softmax over ``dim``, as ``torch.nn.Softmax`` (``dim=None``: PyTorch's legacy choice, 0 for 0-/1-/3-D input, else 1).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.nn.Softmax(dim=1)(s.input(jnp.zeros((1, 2)))).tolist()
    [[0.5, 0.5]]
    """

    def __init__(self, dim: int | None = None) -> None:
        self.dim = dim

    def forward(self, input: Operand) -> Tensor:
        return F.softmax(input, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


@torch_entry(bind=("nn",), records="module", opinfo=())
class LogSoftmax(Module):
    """Log-softmax over ``dim``, as ``torch.nn.LogSoftmax``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.zeros(2))
    ...     [round(v, 4) for v in tfl.nn.LogSoftmax(dim=-1)(x).tolist()]
    [-0.6931, -0.6931]
    """

    def __init__(self, dim: int | None = None) -> None:
        self.dim = dim

    def forward(self, input: Operand) -> Tensor:
        return F.log_softmax(input, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


@torch_entry(bind=("nn",), records="module", opinfo=())
class LeakyReLU(Module):
    """``input`` where positive, else ``negative_slope * input`` (default 0.01), as ``torch.nn.LeakyReLU``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.nn.LeakyReLU(0.5)(s.input(jnp.array([-2.0, 2.0]))).tolist()
    [-1.0, 2.0]
    """

    def __init__(self, negative_slope: float = 0.01, inplace: bool = False) -> None:
        self.negative_slope = float(negative_slope)
        self.inplace = bool(inplace)

    def forward(self, input: Operand) -> Tensor:
        return F.leaky_relu(input, self.negative_slope)

    def extra_repr(self) -> str:
        return f"negative_slope={self.negative_slope}"


@torch_entry(bind=("nn",), records="module", opinfo=())
class ELU(Module):
    """``input`` where positive, else ``alpha * (exp(input) - 1)``, as ``torch.nn.ELU``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.nn.ELU()(s.input(jnp.array([0.0, 2.0]))).tolist()
    [0.0, 2.0]
    """

    def __init__(self, alpha: float = 1.0, inplace: bool = False) -> None:
        self.alpha = float(alpha)
        self.inplace = bool(inplace)

    def forward(self, input: Operand) -> Tensor:
        return F.elu(input, self.alpha)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}"


@torch_entry(bind=("nn",), records="module", opinfo=())
class Softplus(Module):
    """``log(1 + exp(beta * input)) / beta``, linear above ``threshold``, as ``torch.nn.Softplus``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     round(tfl.nn.Softplus()(s.input(jnp.array([0.0]))).item(), 4)
    0.6931
    """

    def __init__(self, beta: float = 1.0, threshold: float = 20.0) -> None:
        self.beta = float(beta)
        self.threshold = float(threshold)

    def forward(self, input: Operand) -> Tensor:
        return F.softplus(input, self.beta, self.threshold)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, threshold={self.threshold}"
