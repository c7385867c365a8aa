"""Loss modules with ``torch.nn``'s arguments: CrossEntropyLoss, NLLLoss, MSELoss, L1Loss, SmoothL1Loss,
HuberLoss, BCELoss, BCEWithLogitsLoss and KLDivLoss.

Each calls the function of the same name in :mod:`tapeflow.nn.functional`
with the arguments it was built with. Class weights (``weight``,
``pos_weight``) are buffers, as in PyTorch (state-dict entries, not parameters).
"""

from __future__ import annotations

from numpy.typing import ArrayLike

from .._shell._params import Param
from .._shell._surface import torch_entry
from .._shell._tensor import Operand, Tensor
from . import functional as F
from ._module import Module

__all__ = [
    "BCELoss",
    "BCEWithLogitsLoss",
    "CrossEntropyLoss",
    "HuberLoss",
    "KLDivLoss",
    "L1Loss",
    "MSELoss",
    "NLLLoss",
    "SmoothL1Loss",
]

_REDUCTIONS = ("none", "mean", "sum")


class _Loss(Module):
    weight: Param | None
    pos_weight: Param | None

    def __init__(self, size_average: bool | None = None, reduce: bool | None = None, reduction: str = "mean") -> None:
        name = type(self).__name__
        if size_average is not None or reduce is not None:
            raise ValueError(
                f"{name}: size_average and reduce are deprecated in PyTorch and not supported; "
                "pass reduction='mean', 'sum' or 'none'"
            )
        if reduction not in _REDUCTIONS:
            raise ValueError(f"{name}: reduction={reduction!r}; expected one of {_REDUCTIONS}")
        self.reduction = reduction

    def _weight(self, name: str, value: ArrayLike | Param | Tensor | None) -> None:
        self.register_buffer(name, value)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}"


@torch_entry(bind=("nn",), records="module", opinfo=())
class CrossEntropyLoss(_Loss):
    """Cross entropy of logits ``(N, C, ...)`` against class indices or probabilities, as ``torch.nn.CrossEntropyLoss``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> loss = tfl.nn.CrossEntropyLoss(label_smoothing=0.1)
    >>> with tfl.Session() as s:
    ...     round(loss(s.input(jnp.zeros((2, 4))), jnp.array([1, 3])).item(), 4)
    1.3863
    """

    def __init__(
        self,
        weight: ArrayLike | None = None,
        size_average: bool | None = None,
        ignore_index: int = -100,
        reduce: bool | None = None,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__(size_average, reduce, reduction)
        self._weight("weight", weight)
        self.ignore_index = int(ignore_index)
        self.label_smoothing = float(label_smoothing)

    def forward(self, input: Operand, target: Operand) -> Tensor:
        return F.cross_entropy(
            input,
            target,
            self.weight,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
        )


@torch_entry(bind=("nn",), records="module", opinfo=())
class NLLLoss(_Loss):
    """Negative log likelihood of log-probabilities ``(N, C, ...)`` at class indices, as ``torch.nn.NLLLoss``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([[-1.0, -2.0]]))
    ...     tfl.nn.NLLLoss()(x, jnp.array([1])).item()
    2.0
    """

    def __init__(
        self,
        weight: ArrayLike | None = None,
        size_average: bool | None = None,
        ignore_index: int = -100,
        reduce: bool | None = None,
        reduction: str = "mean",
    ) -> None:
        super().__init__(size_average, reduce, reduction)
        self._weight("weight", weight)
        self.ignore_index = int(ignore_index)

    def forward(self, input: Operand, target: Operand) -> Tensor:
        return F.nll_loss(input, target, self.weight, ignore_index=self.ignore_index, reduction=self.reduction)


@torch_entry(bind=("nn",), records="module", opinfo=())
class MSELoss(_Loss):
    """Mean (or summed) squared error, as ``torch.nn.MSELoss``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([1.0, 3.0]))
    ...     tfl.nn.MSELoss()(x, jnp.array([0.0, 0.0])).item()
    5.0
    """

    def forward(self, input: Operand, target: Operand) -> Tensor:
        return F.mse_loss(input, target, reduction=self.reduction)


@torch_entry(bind=("nn",), records="module", opinfo=())
class L1Loss(_Loss):
    """Mean (or summed) absolute error, as ``torch.nn.L1Loss``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([1.0, -3.0]))
    ...     tfl.nn.L1Loss()(x, jnp.array([0.0, 0.0])).item()
    2.0
    """

    def forward(self, input: Operand, target: Operand) -> Tensor:
        return F.l1_loss(input, target, reduction=self.reduction)


@torch_entry(bind=("nn",), records="module", opinfo=())
class SmoothL1Loss(_Loss):
    """Squared error below ``beta``, absolute error above it, as ``torch.nn.SmoothL1Loss``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([0.5, 3.0]))
    ...     tfl.nn.SmoothL1Loss()(x, jnp.array([0.0, 0.0])).item()
    1.3125
    """

    def __init__(
        self, size_average: bool | None = None, reduce: bool | None = None, reduction: str = "mean", beta: float = 1.0
    ) -> None:
        super().__init__(size_average, reduce, reduction)
        self.beta = float(beta)

    def forward(self, input: Operand, target: Operand) -> Tensor:
        return F.smooth_l1_loss(input, target, reduction=self.reduction, beta=self.beta)


@torch_entry(bind=("nn",), records="module", opinfo=())
class HuberLoss(_Loss):
    """Huber loss with threshold ``delta``, as ``torch.nn.HuberLoss``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([1.0, 4.0]))
    ...     tfl.nn.HuberLoss(delta=2.0)(x, jnp.array([0.0, 0.0])).item()
    3.25
    """

    def __init__(self, reduction: str = "mean", delta: float = 1.0) -> None:
        super().__init__(None, None, reduction)
        self.delta = float(delta)

    def forward(self, input: Operand, target: Operand) -> Tensor:
        return F.huber_loss(input, target, reduction=self.reduction, delta=self.delta)


@torch_entry(bind=("nn",), records="module", opinfo=())
class BCELoss(_Loss):
    """Binary cross entropy of probabilities, as ``torch.nn.BCELoss``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([0.5]))
    ...     round(tfl.nn.BCELoss()(x, jnp.array([1.0])).item(), 4)
    0.6931
    """

    def __init__(
        self,
        weight: ArrayLike | None = None,
        size_average: bool | None = None,
        reduce: bool | None = None,
        reduction: str = "mean",
    ) -> None:
        super().__init__(size_average, reduce, reduction)
        self._weight("weight", weight)

    def forward(self, input: Operand, target: Operand) -> Tensor:
        return F.binary_cross_entropy(input, target, self.weight, reduction=self.reduction)


@torch_entry(bind=("nn",), records="module", opinfo=())
class BCEWithLogitsLoss(_Loss):
    """Binary cross entropy of logits (sigmoid inside, stably), with ``pos_weight``, as ``torch.nn.BCEWithLogitsLoss``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([0.0]))
    ...     round(tfl.nn.BCEWithLogitsLoss()(x, jnp.array([1.0])).item(), 4)
    0.6931
    """

    def __init__(
        self,
        weight: ArrayLike | None = None,
        size_average: bool | None = None,
        reduce: bool | None = None,
        reduction: str = "mean",
        pos_weight: ArrayLike | None = None,
    ) -> None:
        super().__init__(size_average, reduce, reduction)
        self._weight("weight", weight)
        self._weight("pos_weight", pos_weight)

    def forward(self, input: Operand, target: Operand) -> Tensor:
        return F.binary_cross_entropy_with_logits(
            input, target, self.weight, reduction=self.reduction, pos_weight=self.pos_weight
        )


@torch_entry(bind=("nn",), records="module", opinfo=())
class KLDivLoss(_Loss):
    """Kullback-Leibler divergence of log-probabilities ``input`` from ``target``, as ``torch.nn.KLDivLoss``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.log(jnp.array([0.5, 0.5])))
    ...     tfl.nn.KLDivLoss(reduction="sum")(x, jnp.array([0.5, 0.5])).item()
    0.0
    """

    def __init__(
        self,
        size_average: bool | None = None,
        reduce: bool | None = None,
        reduction: str = "mean",
        log_target: bool = False,
    ) -> None:
        super().__init__(size_average, reduce, reduction)
        self.log_target = bool(log_target)

    def forward(self, input: Operand, target: Operand) -> Tensor:
        return F.kl_div(input, target, reduction=self.reduction, log_target=self.log_target)
