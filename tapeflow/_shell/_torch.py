"""The PyTorch surface, assembled: every entry module imported, then the Tensor methods bound from the table.

``tapeflow/__init__.py`` and ``tapeflow/nn/functional.py`` import their
PyTorch-named functions from the entry modules; :data:`~._surface.SURFACE` lists them all.

>>> import tapeflow as tfl
>>> from tapeflow._shell._torch import SURFACE
>>> tfl.Tensor.transpose is SURFACE["transpose"].fn is tfl.transpose  # a method is the function itself
True
"""

from __future__ import annotations

from . import _torch_functional, _torch_tensor
from ._surface import SURFACE, bind_methods
from ._tensor import TensorOps

__all__ = ["SURFACE", "functional", "tensor"]

tensor = _torch_tensor
functional = _torch_functional

bind_methods(TensorOps)
