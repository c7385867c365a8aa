"""PyTorch's Tensor methods and ``torch.<fn>`` functions, declared in the surface table (:mod:`._surface`).

Each function here is both ``tfl.<name>`` and the Tensor method of the same
name (where the entry binds both): its first parameter is the tensor, its
signature and defaults are PyTorch's, and it records built-in ops (or a lifted
JAX function) on the operand's session. ``tfl.numpy`` keeps NumPy's meanings
(``tfl.numpy.transpose(x)`` reverses the axes, ``tfl.numpy.var`` divides by n).

>>> import jax.numpy as jnp, tapeflow as tfl
>>> with tfl.Session() as s:
...     x = s.input(jnp.array([[1.0, 5.0], [4.0, 2.0]]))
...     v, i = x.max(1)
...     x.transpose(0, 1).tolist(), v.tolist(), i.tolist(), float(x.var())
([[1.0, 4.0], [5.0, 2.0]], [5.0, 4.0], [1, 0], 3.3333332538604736)
"""

from __future__ import annotations

import builtins
import math
from typing import NamedTuple

import numpy as np

from .._core._typing import DTypeLike, Shape
from ._surface import torch_entry
from ._tensor import Operand, Tensor, apply

__all__ = ["ValuesIndices", "max", "sum", "transpose", "var"]


class ValuesIndices(NamedTuple):
    """PyTorch's ``(values, indices)`` pair (``torch.return_types.max`` and friends): unpacks and indexes as a tuple."""

    values: Tensor
    indices: Tensor


def _shape(x: Operand) -> Shape:
    got = getattr(x, "shape", None)
    return tuple(np.shape(np.asarray(x)) if got is None else got)


def _dim(op: str, dim: int, ndim: int) -> int:
    """``dim`` as a non-negative axis of a tensor with ``ndim`` axes (a 0-d tensor takes 0 and -1, as PyTorch)."""
    n = builtins.max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(
            f"{op}: dim={dim} is out of range for a tensor with {ndim} dimensions (expected [{-n}, {n - 1}])"
        )
    return dim % n


def _dims(op: str, dim: int | tuple[int, ...] | list[int] | None, ndim: int) -> tuple[int, ...] | None:
    if dim is None:
        return None
    if isinstance(dim, (tuple, list)):
        return tuple(_dim(op, int(d), ndim) for d in dim) if ndim else None
    return (_dim(op, int(dim), ndim),) if ndim else None


@torch_entry(records="op:permute", opinfo=("transpose",))
def transpose(input: Operand, dim0: int, dim1: int) -> Tensor:
    """``input`` with dimensions ``dim0`` and ``dim1`` swapped (``tfl.numpy.transpose`` is NumPy's axes permutation)."""
    n = len(_shape(input))
    a, b = _dim("transpose", dim0, n), _dim("transpose", dim1, n)
    perm = list(range(n))
    perm[a], perm[b] = perm[b], perm[a]
    return apply("permute", input, axes=tuple(perm))


@torch_entry(records="op:sum", opinfo=("sum",))
def sum(
    input: Operand, dim: int | tuple[int, ...] | None = None, keepdim: bool = False, *, dtype: DTypeLike | None = None
) -> Tensor:
    """The sum over ``dim`` (all dimensions when None), keeping reduced dimensions with ``keepdim``."""
    x = input if dtype is None else apply("astype", input, dtype=np.dtype(dtype))
    return apply("sum", x, axis=_dims("sum", dim, len(_shape(input))), keepdims=bool(keepdim))


@torch_entry(
    records="ops:max,argmax,take_along_axis", opinfo=("max.reduction_no_dim", "max.reduction_with_dim", "max.binary")
)
def max(input: Operand, dim: int | Operand | None = None, keepdim: bool = False) -> Tensor | ValuesIndices:
    """The largest value; with ``dim``, the ``(values, indices)`` pair along it; with a tensor, the elementwise maximum."""
    if dim is None:
        return apply("max", input)
    if not isinstance(dim, (int, np.integer)):
        return apply("maximum", input, dim)
    ...
    raise NotImplementedError


@torch_entry(records="ops:mean,sub,mul,sum,div", opinfo=("var", "var_unbiased"))
def var(
    input: Operand,
    dim: int | tuple[int, ...] | None = None,
    unbiased: bool | None = None,
    keepdim: bool = False,
    *,
    correction: float | None = None,
) -> Tensor:
    """The variance over ``dim``, divided by ``N - correction`` (PyTorch's default ``correction=1``, unbiased)."""
    shape = _shape(input)
    axes = _dims("var", dim, len(shape))
    if unbiased is not None and correction is not None:
        raise TypeError("var: pass unbiased= or correction= (correction=1 is unbiased=True), not both")
    c = float(correction if correction is not None else (1.0 if unbiased is None or unbiased else 0.0))
    n = math.prod(shape) if axes is None else math.prod(shape[a] for a in axes)
    centered = apply("sub", input, apply("mean", input, axis=axes, keepdims=True))
    total = apply("sum", apply("mul", centered, centered), axis=axes, keepdims=bool(keepdim))
    return apply("div", total, float(n - c) if n - c > 0 else 0.0)
