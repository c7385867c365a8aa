"""The PyTorch surface, assembled: every entry module imported, then the Tensor methods bound from the table.

``tapeflow/__init__.py`` and ``tapeflow/nn/functional.py`` import their
PyTorch-named functions from here; :data:`~._surface.SURFACE` lists them all.
"""

from __future__ import annotations

from . import _torch_functional, _torch_tensor
from ._surface import SURFACE, bind_methods
from ._tensor import TensorOps

__all__ = ["SURFACE", "functional", "tensor"]

tensor = _torch_tensor
functional = _torch_functional

bind_methods(TensorOps)
