"""``torch.nn.functional``'s functions, declared in the surface table (:mod:`._surface`), bound as ``tfl.nn.functional``.

Each function takes PyTorch's arguments (layouts too: ``conv2d`` weights are
``(out, in / groups, kh, kw)``, ``linear`` weights ``(out, in)``, class
scores on dimension 1 for ``cross_entropy``) and records built-in ops, or a
lifted JAX function, on its operands' session.
"""

from __future__ import annotations

from ._surface import torch_entry
from ._tensor import Operand, Tensor, apply

__all__ = ["relu"]


@torch_entry(bind=("method", "tfl", "F"), records="op:relu", opinfo=("nn.functional.relu",))
def relu(input: Operand, inplace: bool = False) -> Tensor:
    """``max(input, 0)`` elementwise (``inplace`` is accepted and ignored: tensors are values)."""
    return apply("relu", input)
