"""PyTorch's tensor-building and tensor-splitting functions under their PyTorch names and semantics.

``tfl.stack``, ``tfl.split``, ``tfl.chunk`` record ops on their operands'
session (``stack`` through ``tfl.numpy.stack``; the pieces of ``split`` and
``chunk`` as ``take`` of their positions, so each piece has its gradient);
``tfl.zeros``, ``tfl.ones``, ``tfl.full`` and ``tfl.arange`` make constants,
recorded as leaves of the current session (the innermost ``with Session()``)
when there is one, else plain arrays. Where NumPy and PyTorch disagree the
PyTorch meaning holds here, and ``tfl.numpy`` keeps NumPy's:
``tfl.split(x, 2)`` cuts pieces of **size** 2 (``torch.split``), while
``tfl.numpy.split(x, 2)`` cuts 2 pieces (``np.split``).

>>> import jax.numpy as jnp, tapeflow as tfl
>>> with tfl.Session() as s:
...     x = s.input(jnp.arange(5.0), requires_grad=True)
...     split, chunk = tfl.split(x, 2), tfl.chunk(x, 2)
...     [p.shape for p in split], [p.shape for p in chunk], tfl.stack([x, x]).shape
([(2,), (2,), (1,)], [(3,), (2,)], (2, 5))
>>> with tfl.Session() as s:
...     tfl.zeros((2, 3)).node.op is None, tfl.arange(4).tolist()  # a session's leaf
(True, [0, 1, 2, 3])
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np

from .._core._typing import Array, DTypeLike
from . import _numpy
from ._tensor import Operand, Tensor, apply, current_session

__all__ = ["arange", "chunk", "full", "ones", "split", "stack", "zeros"]


def _dim(axis: int, dim: int | None) -> int:
    return axis if dim is None else dim


def stack(tensors: Sequence[Operand], axis: int = 0, *, dim: int | None = None) -> Tensor | Array:
    """``torch.stack`` / ``jnp.stack``: the operands along a new axis ``axis`` (or ``dim``)."""
    out: Tensor | Array = _numpy.FUNCTIONS["stack"](list(tensors), axis=_dim(axis, dim))
    return out


def _pieces(x: Operand, sizes: Sequence[int], axis: int) -> list[Tensor]:
    out, start = [], 0
    for n in sizes:
        out.append(apply("take", x, np.arange(start, start + n, dtype=np.int32), axis=axis))
        start += n
    return out


def _length(x: Operand, axis: int) -> int:
    got = getattr(x, "shape", None)
    shape = tuple(np.shape(np.asarray(x)) if got is None else got)
    if not shape:
        raise TypeError("split/chunk of a 0-d tensor: it has no axis to cut")
    return shape[axis % len(shape)]


def split(x: Operand, split_size_or_sections: int | Sequence[int], dim: int = 0) -> list[Tensor]:
    """``torch.split``: pieces of ``split_size_or_sections`` elements along ``dim`` (the last one smaller), or of
    the listed sizes. (``tfl.numpy.split(x, n)`` is NumPy's: ``n`` equal pieces.)"""
    n = _length(x, dim)
    if isinstance(split_size_or_sections, (int, np.integer)):
        size = int(split_size_or_sections)
        if size < 1:
            raise ValueError(f"split: split_size={size} must be at least 1")
        sizes = [min(size, n - start) for start in range(0, n, size)]
    else:
        sizes = [int(s) for s in split_size_or_sections]
        if sum(sizes) != n or min(sizes, default=0) < 0:
            raise ValueError(f"split: sections {sizes} must be non-negative and add up to the axis length {n}")
    return _pieces(x, sizes, dim)


def chunk(x: Operand, chunks: int, dim: int = 0) -> list[Tensor]:
    """``torch.chunk``: at most ``chunks`` pieces of ``ceil(n / chunks)`` elements along ``dim`` (the last smaller)."""
    if chunks < 1:
        raise ValueError(f"chunk: chunks={chunks} must be at least 1")
    n = _length(x, dim)
    return split(x, max(math.ceil(n / chunks), 1), dim)


def _constant(value: np.ndarray) -> Tensor | Array:
    s = current_session()
    return s.input(value) if s is not None else jax.device_put(value)


def _shape(size: tuple[int | Sequence[int], ...]) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        return tuple(int(d) for d in size[0])
    return tuple(int(d) for d in size)  # type: ignore[arg-type]


def zeros(*size: int | Sequence[int], dtype: DTypeLike = np.float32) -> Tensor | Array:
    """``torch.zeros(2, 3)`` or ``zeros((2, 3))``: a constant (a leaf of the current session, if any)."""
    return _constant(np.zeros(_shape(size), dtype))


def ones(*size: int | Sequence[int], dtype: DTypeLike = np.float32) -> Tensor | Array:
    """``torch.ones(2, 3)`` or ``ones((2, 3))``: a constant (a leaf of the current session, if any)."""
    return _constant(np.ones(_shape(size), dtype))


def full(size: Sequence[int], fill_value: float, dtype: DTypeLike | None = None) -> Tensor | Array:
    """``torch.full(size, fill_value)``: a constant (float32 for a float value, int32 for an int, as PyTorch picks)."""
    dt = dtype if dtype is not None else (np.int32 if isinstance(fill_value, int) else np.float32)
    return _constant(np.full(tuple(size), fill_value, dt))


def arange(start: float, end: float | None = None, step: float = 1, dtype: DTypeLike | None = None) -> Tensor | Array:
    """``torch.arange``: ``start`` to ``end`` (exclusive) by ``step``, integers unless a bound or step is a float."""
    lo, hi = (0, start) if end is None else (start, end)
    floats = any(isinstance(v, float) for v in (lo, hi, step))
    dt = dtype if dtype is not None else (np.float32 if floats else np.int32)
    return _constant(np.arange(lo, hi, step, dtype=dt))
