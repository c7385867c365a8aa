"""PyTorch's Tensor methods and ``torch.<fn>`` functions, declared in the surface table (:mod:`._surface`).

Each function here is both ``tfl.<name>`` and the Tensor method of the same
name (where the entry binds both): its first parameter is the tensor, its
signature and defaults are PyTorch's, and it records built-in ops (or a lifted
JAX function) on the operand's session. ``tfl.numpy`` keeps NumPy's meanings
(``tfl.numpy.transpose(x)`` reverses the axes, ``tfl.numpy.var`` divides by n).

PyTorch also takes NumPy's ``axis=`` / ``keepdims=`` for ``dim=`` / ``keepdim=``
(``torch.sum(x, axis=0)``), and so do the reductions here. JAX runs without
64-bit types, so where PyTorch gives int64 or float64 these give int32 or
float32.

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
import warnings
from collections.abc import Callable, Sequence
from typing import NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from .._core import _registry as R
from .._core._result import TapeError
from .._core._typing import Array, DTypeLike, PyTree, Shape
from .._ops._shape import normalize_index
from . import _numpy
from ._extend import lift
from ._surface import torch_entry
from ._tensor import (
    Operand,
    Tensor,
    TensorOps,
    apply,
    current_session,
    host_value,
    operand_shape,
    promote,
    promoted_div,
    promoted_pow,
    session_of,
)

__all__ = [
    "ValuesIndices",
    "abs",
    "add",
    "all",
    "amax",
    "amin",
    "any",
    "arange",
    "argmax",
    "argmin",
    "bmm",
    "broadcast_to",
    "cat",
    "chunk",
    "clamp",
    "clip",
    "concat",
    "cos",
    "cumsum",
    "diagonal",
    "div",
    "einsum",
    "eq",
    "exp",
    "expm1",
    "flatten",
    "flip",
    "floor_divide",
    "full",
    "gather",
    "ge",
    "gt",
    "index_select",
    "le",
    "lerp",
    "log",
    "log1p",
    "log_softmax",
    "logsumexp",
    "lt",
    "masked_fill",
    "matmul",
    "max",
    "maximum",
    "mean",
    "min",
    "minimum",
    "mm",
    "movedim",
    "mul",
    "narrow",
    "ne",
    "neg",
    "norm",
    "ones",
    "ones_like",
    "outer",
    "permute",
    "pow",
    "prod",
    "reciprocal",
    "remainder",
    "repeat_interleave",
    "reshape",
    "roll",
    "rsqrt",
    "scatter_add",
    "sigmoid",
    "sign",
    "sin",
    "softmax",
    "sort",
    "split",
    "sqrt",
    "square",
    "squeeze",
    "stack",
    "std",
    "sub",
    "sum",
    "t",
    "take",
    "tanh",
    "topk",
    "transpose",
    "tril",
    "triu",
    "true_divide",
    "unbind",
    "unflatten",
    "unsqueeze",
    "var",
    "where",
    "zeros",
    "zeros_like",
]

Dims = int | tuple[int, ...] | list[int]
"""PyTorch's ``dim`` argument of a reduction: one dimension or several."""


class ValuesIndices(NamedTuple):
    """PyTorch's ``(values, indices)`` pair (``torch.return_types.max`` and friends): unpacks and indexes as a tuple.

    >>> ValuesIndices(1.0, 0).indices
    0
    """

    values: Tensor
    indices: Tensor


# --------------------------------------------------------------------------- argument helpers


def _dtype_of(x: Operand) -> np.dtype:
    if type(x) is Tensor:  # the common operand: its dtype is a NumPy dtype already
        return x.dtype
    got = getattr(x, "dtype", None)
    if got is None:
        return np.dtype(np.float32) if isinstance(x, builtins.float) else np.asarray(x).dtype
    if type(got).__module__ == "torch":  # a CPU torch tensor: its dtype is torch's own type
        return np.asarray(x).dtype
    return np.dtype(got)


def _shape(x: Operand) -> Shape:
    """:func:`operand_shape`, read straight off a Tensor (whose shape is a tuple of ints already)."""
    return x.shape if type(x) is Tensor else operand_shape(x)


def _dim(op: str, dim: int, ndim: int) -> int:
    """``dim`` as a non-negative axis of a tensor with ``ndim`` axes (a 0-d tensor takes 0 and -1, as PyTorch)."""
    n = builtins.max(ndim, 1)
    if isinstance(dim, builtins.bool) or not isinstance(dim, (builtins.int, np.integer)):
        raise TypeError(f"{op}: dim must be an int, got {dim!r}")
    if not -n <= dim < n:
        raise IndexError(
            f"{op}: dim={dim} is out of range for a tensor with {ndim} dimensions (expected [{-n}, {n - 1}])"
        )
    return builtins.int(dim) % n


def _dims(op: str, dim: Dims | None, ndim: int) -> tuple[int, ...] | None:
    """The reduced axes (None: all of them; a 0-d tensor reduces over nothing, whatever ``dim`` says)."""
    if dim is None:
        return None
    if isinstance(dim, (tuple, list)):
        axes = tuple(_dim(op, d, ndim) for d in dim)
        if len(set(axes)) != len(axes):
            raise RuntimeError(f"{op}: dim {tuple(dim)} names a dimension twice")
        return (axes or None) if ndim else None
    return (_dim(op, dim, ndim),) if ndim else None


def _alias(op: str, value: object, default: object, numpy: object, names: tuple[str, str]) -> object:
    """PyTorch's argument, or NumPy's spelling of it (``axis=`` for ``dim=``), which PyTorch takes too."""
    if numpy is None:
        return value
    if value is not default:
        raise TypeError(f"{op}: pass {names[1]}= or {names[0]}= (the same thing), not both")
    return numpy


def _red(
    op: str, dim: Dims | None, axis: Dims | None, keepdim: bool, keepdims: bool | None, no_dim: object = None
) -> tuple[Dims | None, bool]:
    d = _alias(op, dim, no_dim, axis, ("dim", "axis"))
    k = _alias(op, keepdim, False, keepdims, ("keepdim", "keepdims"))
    if not isinstance(k, (builtins.bool, np.bool_)):
        raise TypeError(f"{op}: keepdim must be a bool, got {k!r} (PyTorch refuses it too: pass True or False)")
    return d, builtins.bool(k)  # type: ignore[return-value]


def _sizes(op: str, size: tuple[int | Sequence[int], ...]) -> tuple[int, ...]:
    """``f(2, 3)``, ``f((2, 3))`` and ``f([2, 3])`` all mean ``(2, 3)``."""
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = tuple(size[0])
    try:
        return tuple(builtins.int(s) for s in size)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{op}: sizes must be ints, got {size!r}") from None


_TORCH_DTYPES = {"long": "int64", "int": "int32", "short": "int16", "float": "float32", "double": "float64"}
_TORCH_DTYPES |= {"half": "float16", "bool": "bool", "cfloat": "complex64"}


def _as_dtype(dtype: DTypeLike) -> np.dtype:
    """A dtype (NumPy's, JAX's, a name, or a ``torch.dtype``) as JAX holds it: 64-bit types become 32-bit ones."""
    if type(dtype).__module__ == "torch":  # torch.float64 -> "float64", without importing torch
        name = str(dtype).removeprefix("torch.")
        dtype = _TORCH_DTYPES.get(name, name)
    return np.dtype(jax.dtypes.canonicalize_dtype(jnp.dtype(dtype)))


def _cast(x: Operand, dtype: DTypeLike | None) -> Operand:
    if dtype is None:
        return x
    dt = _as_dtype(dtype)
    return x if _dtype_of(x) == dt else apply("astype", x, dtype=dt)


def _is_float(x: Operand) -> builtins.bool:
    return R.is_float(_dtype_of(x))  # floating, complex, or exact rationals (object arrays)


def _floating(x: Operand) -> Operand:
    """``x``, integer or boolean ones as float32: PyTorch's math functions promote them to the default float type."""
    return x if _is_float(x) else apply("astype", x, dtype=np.dtype(np.float32))


def _long() -> np.dtype:
    """PyTorch's int64 as JAX holds it: int64 with ``jax_enable_x64``, else int32."""
    return np.dtype(jax.dtypes.canonicalize_dtype(np.int64))


def _leaf(like: Operand, value: np.ndarray, requires_grad: builtins.bool = False) -> Tensor:
    """A constant leaf on the session an op on ``like`` records on."""
    return session_of((like,), "constant").input(value, requires_grad=requires_grad)


class _Lifted:
    """A module-level JAX function recorded as op ``name`` (made an op with :func:`~tapeflow.lift` on first use)."""

    def __init__(self, name: str, fn: Callable[..., PyTree], statics: tuple[str, ...]) -> None:
        self.name, self.fn, self.statics = name, fn, statics
        self.op: R.OpDef | None = None

    def __call__(self, *operands: Operand, **statics: object) -> Tensor:
        if self.op is None or R.REGISTRY.get(self.name) is not self.op:
            self.op = lift(self.fn, name=self.name, static_argnames=self.statics).op  # type: ignore[attr-defined]
        return apply(self.name, *operands, **statics)


# --------------------------------------------------------------------------- shapes and views


@torch_entry(bind=("method",), records="op:reshape")
def view(input: Operand, *shape: int | Sequence[int]) -> Tensor:
    """``input`` with a new shape (``-1`` inferred); a tensor has no storage to alias, so this records a reshape.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.arange(6.0)).view(2, -1).shape
    (2, 3)
    """
    if len(shape) == 1 and not isinstance(shape[0], (builtins.int, np.integer, tuple, list)):
        raise TypeError(f"view: view(dtype) reinterprets memory, which tapeflow has not; use .to({shape[0]!r})")
    return apply("reshape", input, shape=_sizes("view", shape))


@torch_entry(records="op:reshape")
def reshape(input: Operand, *shape: int | Sequence[int]) -> Tensor:
    """``input`` with a new shape (``-1`` inferred): ``x.reshape(2, 3)`` or ``tfl.reshape(x, (2, 3))``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.reshape(s.input(jnp.arange(6.0)), (3, 2)).shape
    (3, 2)
    """
    if not shape:
        raise TypeError("reshape: give the new shape, e.g. reshape(x, (2, -1)) (() for a 0-d tensor)")
    return apply("reshape", input, shape=_sizes("reshape", shape))


@torch_entry(records="op:reshape")
def flatten(input: Operand, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    """Dimensions ``start_dim`` to ``end_dim`` (inclusive) merged into one; a 0-d tensor becomes shape ``(1,)``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.ones((2, 3, 4))).flatten(1).shape
    (2, 12)
    """
    shape = _shape(input)
    if not shape:
        return apply("reshape", input, shape=(1,))
    lo, hi = _dim("flatten", start_dim, len(shape)), _dim("flatten", end_dim, len(shape))
    if lo > hi:
        raise RuntimeError(f"flatten: start_dim={start_dim} comes after end_dim={end_dim} (shape {shape})")
    return apply("reshape", input, shape=(*shape[:lo], math.prod(shape[lo : hi + 1]), *shape[hi + 1 :]))


@torch_entry(records="op:reshape")
def unflatten(input: Operand, dim: int, sizes: Sequence[int]) -> Tensor:
    """Dimension ``dim`` split into ``sizes`` (one of them may be -1).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.ones((2, 12))).unflatten(1, (3, -1)).shape
    (2, 3, 4)
    """
    shape = _shape(input)
    d = _dim("unflatten", dim, len(shape))
    sizes = _sizes("unflatten", tuple(sizes))
    known = math.prod(s for s in sizes if s != -1)
    if sizes.count(-1) > 1 or (-1 not in sizes and known != shape[d]) or (known and shape[d] % known):
        raise RuntimeError(f"unflatten: sizes {sizes} do not multiply to dimension {dim} of size {shape[d]}")
    full = tuple(shape[d] // known if s == -1 else s for s in sizes) if known else sizes
    return apply("reshape", input, shape=(*shape[:d], *full, *shape[d + 1 :]))


@torch_entry(records="op:squeeze", opinfo=("squeeze", "squeeze.multiple"))
def squeeze(input: Operand, dim: Dims | None = None, *, axis: Dims | None = None) -> Tensor:
    """``input`` without its size-1 dimensions (those of ``dim`` only; a named dimension of another size stays).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.ones((1, 3)))
    ...     x.squeeze().shape, x.squeeze(1).shape
    ((3,), (1, 3))
    """
    shape = _shape(input)
    named = _alias("squeeze", dim, None, axis, ("dim", "axis"))
    if isinstance(named, (tuple, list)) and not named:  # PyTorch: an empty dim list names no dimension to squeeze
        return apply("reshape", input, shape=shape)
    dims = _dims("squeeze", named, len(shape))  # type: ignore[arg-type]
    dims = tuple(range(len(shape))) if dims is None else dims
    ones = tuple(d for d in dims if shape[d] == 1)
    if not ones:
        return apply("reshape", input, shape=shape)  # PyTorch returns a view of the same shape
    return apply("squeeze", input, axis=ones)


@torch_entry(records="op:expand_dims")
def unsqueeze(input: Operand, dim: int) -> Tensor:
    """``input`` with a size-1 dimension inserted at ``dim`` (``-1``: last).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.ones(3)).unsqueeze(-1).shape
    (3, 1)
    """
    n = len(_shape(input))
    if not -n - 1 <= dim <= n:
        raise IndexError(
            f"unsqueeze: dim={dim} is out of range for a tensor with {n} dimensions (expected [{-n - 1}, {n}])"
        )
    return apply("expand_dims", input, axis=builtins.int(dim) % (n + 1))


@torch_entry(records="op:permute")
def permute(input: Operand, *dims: int | Sequence[int]) -> Tensor:
    """The dimensions reordered: result dimension ``i`` is input dimension ``dims[i]``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.ones((2, 3, 4))).permute(2, 0, 1).shape
    (4, 2, 3)
    """
    n = len(_shape(input))
    perm = tuple(_dim("permute", d, n) for d in _sizes("permute", dims))
    if sorted(perm) != list(range(n)):
        raise RuntimeError(f"permute: dims {dims} are not a permutation of the {n} dimensions")
    return apply("permute", input, axes=perm)


@torch_entry(records="op:permute", opinfo=("transpose",))
def transpose(input: Operand, dim0: int, dim1: int) -> Tensor:
    """``input`` with dimensions ``dim0`` and ``dim1`` swapped (``tfl.numpy.transpose`` is NumPy's axes permutation).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.ones((2, 3, 4))).transpose(-2, -1).shape
    (2, 4, 3)
    """
    n = len(_shape(input))
    a, b = _dim("transpose", dim0, n), _dim("transpose", dim1, n)
    perm = list(range(n))
    if n:
        perm[a], perm[b] = perm[b], perm[a]
    return apply("permute", input, axes=tuple(perm))


@torch_entry(records="op:permute")
def t(input: Operand) -> Tensor:
    """A 2-D tensor transposed; a 0-d or 1-d tensor as it is.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.ones((2, 3))).t().shape
    (3, 2)
    """
    n = len(_shape(input))
    if n > 2:
        raise RuntimeError(f"t: expects a tensor with <= 2 dimensions, got {n}; use transpose(dim0, dim1) or mT")
    return apply("permute", input, axes=(1, 0) if n == 2 else tuple(range(n)))


@torch_entry(bind=("property",), records="op:permute")
def mT(input: Operand) -> Tensor:
    """The last two dimensions swapped (a batch of matrices, each transposed).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.ones((5, 2, 3))).mT.shape
    (5, 3, 2)
    """
    if len(_shape(input)) < 2:
        raise RuntimeError(f"mT: needs a tensor of at least 2 dimensions, got shape {_shape(input)}")
    return transpose(input, -2, -1)


@torch_entry(bind=("property",), records="op:transpose")
def T(input: Operand) -> Tensor:
    """The dimensions reversed (a matrix transposed).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.ones((2, 3))).T.shape
    (3, 2)
    """
    return apply("transpose", input)


@torch_entry(bind=("method",), records="op:broadcast_to")
def expand(input: Operand, *sizes: int | Sequence[int]) -> Tensor:
    """``input`` broadcast to ``sizes`` (``-1`` keeps a dimension; new dimensions go in front).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.ones((3, 1))).expand(2, -1, 4).shape
    (2, 3, 4)
    """
    shape, want = _shape(input), _sizes("expand", sizes)
    lead = len(want) - len(shape)
    if lead < 0:
        raise RuntimeError(f"expand: sizes {want} have fewer dimensions than the tensor's shape {shape}")
    if builtins.any(s == -1 for s in want[:lead]):
        raise RuntimeError(f"expand: -1 is not allowed for the new leading dimensions in sizes {want}")
    out = tuple(shape[i - lead] if s == -1 else s for i, s in enumerate(want))
    return apply("broadcast_to", input, shape=out)


@torch_entry(bind=("method",), records="op:broadcast_to")
def expand_as(input: Operand, other: Operand) -> Tensor:
    """``input`` broadcast to ``other``'s shape.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.ones(3)).expand_as(s.input(jnp.ones((2, 3)))).shape
    (2, 3)
    """
    return apply("broadcast_to", input, shape=_shape(other))


@torch_entry(records="op:broadcast_to")
def broadcast_to(input: Operand, size: Sequence[int]) -> Tensor:
    """``input`` broadcast to ``size`` (NumPy's rules; ``-1`` keeps a dimension).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.broadcast_to(s.input(jnp.ones(3)), (2, 3)).shape
    (2, 3)
    """
    return expand(input, tuple(size))


@torch_entry(bind=("method",), records="ops:reshape,broadcast_to")
def repeat(input: Operand, *sizes: int | Sequence[int]) -> Tensor:
    """``input`` tiled ``sizes[i]`` times along dimension ``i`` (extra sizes add leading dimensions), as ``np.tile``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([1.0, 2.0])).repeat(2, 2).tolist()
    [[1.0, 2.0, 1.0, 2.0], [1.0, 2.0, 1.0, 2.0]]
    """
    shape, reps = _shape(input), _sizes("repeat", sizes)
    if len(reps) < len(shape):
        raise RuntimeError(f"repeat: {len(reps)} repeat sizes for a tensor of {len(shape)} dimensions: give one each")
    full = (1,) * (len(reps) - len(shape)) + tuple(shape)
    spread = tuple(v for n in full for v in (1, n))
    tiled = tuple(v for r, n in zip(reps, full) for v in (r, n))
    x = apply("reshape", input, shape=spread)
    x = apply("broadcast_to", x, shape=tiled)
    return apply("reshape", x, shape=tuple(r * n for r, n in zip(reps, full)))


@torch_entry(records="ops:take")
def repeat_interleave(
    input: Operand, repeats: int | Operand, dim: int | None = None, *, output_size: int | None = None
) -> Tensor:
    """Each element repeated ``repeats`` times (a number, or one count per element) along ``dim`` (None: flattened).

    The counts are read on the host: a count tensor cannot be computed inside a compiled step.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([1.0, 2.0])).repeat_interleave(2).tolist()
    [1.0, 1.0, 2.0, 2.0]
    """
    x = input
    if dim is None:
        x, d = apply("reshape", input, shape=(-1,)), 0
    else:
        d = _dim("repeat_interleave", dim, len(_shape(input)))
    shape = _shape(x)
    if not shape:
        x, shape = apply("reshape", x, shape=(1,)), (1,)
    n = shape[d]
    reps = np.asarray(host_value(repeats, "repeat_interleave(repeats)") if isinstance(repeats, TensorOps) else repeats)
    if reps.ndim == 0:
        reps = np.full(n, builtins.int(reps))
    if reps.shape != (n,) or (reps.size and reps.min() < 0):
        raise RuntimeError(f"repeat_interleave: repeats {reps.tolist()} must be {n} non-negative counts (or one)")
    if output_size is not None and builtins.int(reps.sum()) != output_size:
        raise RuntimeError(f"repeat_interleave: output_size={output_size} but the repeats add up to {reps.sum()}")
    return apply("take", x, np.repeat(np.arange(n, dtype=np.int32), reps), axis=d)


def _slices(ndim: int, pick: dict[int, object]) -> tuple[object, ...]:
    return normalize_index(tuple(pick.get(i, slice(None)) for i in range(ndim)))


@torch_entry(records="op:index")
def flip(input: Operand, dims: Dims) -> Tensor:
    """``input`` reversed along each of ``dims``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.flip(s.input(jnp.array([1.0, 2.0, 3.0])), [0]).tolist()
    [3.0, 2.0, 1.0]
    """
    n = len(_shape(input))
    axes = _dims("flip", dims, n) or ()
    return apply("index", input, index=_slices(n, {a: slice(None, None, -1) for a in axes}))


@torch_entry(records="lifted")
def roll(input: Operand, shifts: int | Sequence[int], dims: Dims | None = None) -> Tensor:
    """``input`` shifted cyclically by ``shifts`` along ``dims`` (no dims: the flattened tensor, shape kept).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.roll(s.input(jnp.array([1.0, 2.0, 3.0])), 1).tolist()
    [3.0, 1.0, 2.0]
    """
    n = len(_shape(input))
    axes = None if dims is None else (_dims("roll", dims, n) or ())
    shift: int | tuple[int, ...] = (
        tuple(shifts) if isinstance(shifts, (tuple, list)) else builtins.int(cast(int, shifts))
    )
    if axes is not None and isinstance(shift, tuple) and len(shift) != len(axes):
        raise RuntimeError(f"roll: {len(shift)} shifts for {len(axes)} dims: give one shift per dim")
    if axes is not None and not isinstance(shift, tuple):
        shift = (shift,) * len(axes)
    return _numpy.record("roll", input, shift, axis=axes)


@torch_entry(records="op:index")
def narrow(input: Operand, dim: int, start: int, length: int) -> Tensor:
    """``length`` elements of dimension ``dim`` from ``start`` on (a negative start counts from the end).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.arange(5.0)).narrow(0, 1, 3).tolist()
    [1.0, 2.0, 3.0]
    """
    shape = _shape(input)
    d = _dim("narrow", dim, len(shape))
    size = shape[d]
    lo = builtins.int(start) + size if start < 0 else builtins.int(start)
    if not (0 <= lo <= size and length >= 0 and lo + length <= size):
        raise IndexError(f"narrow: start={start}, length={length} do not fit dimension {dim} of size {size}")
    return apply("index", input, index=_slices(len(shape), {d: slice(lo, lo + builtins.int(length))}))


def _pieces(op: str, x: Operand, sizes: Sequence[int], dim: int) -> tuple[Tensor, ...]:
    n = len(_shape(x))
    out, start = [], 0
    for k in sizes:
        out.append(apply("index", x, index=_slices(n, {dim: slice(start, start + k)})))
        start += k
    return tuple(out)


@torch_entry(records="op:index", opinfo=("split", "split.list_args"))
def split(tensor: Operand, split_size_or_sections: int | Sequence[int], dim: int = 0) -> tuple[Tensor, ...]:
    """Pieces of ``split_size_or_sections`` elements along ``dim`` (the last one smaller), or of the listed sizes.

    ``tfl.numpy.split(x, n)`` is NumPy's: ``n`` equal pieces.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     [p.shape for p in tfl.split(s.input(jnp.arange(5.0)), 2)]
    [(2,), (2,), (1,)]
    """
    shape = _shape(tensor)
    if not shape:
        raise RuntimeError("split: a 0-d tensor has no dimension to split")
    d = _dim("split", dim, len(shape))
    n = shape[d]
    if isinstance(split_size_or_sections, (builtins.int, np.integer)):
        size = builtins.int(split_size_or_sections)
        if size < 0 or (size == 0 and n):
            raise RuntimeError(f"split: split_size={size} must be positive")
        sizes = [builtins.min(size, n - start) for start in range(0, n, size)] if size else [0]
    else:
        sizes = [builtins.int(s) for s in split_size_or_sections]
        if builtins.sum(sizes) != n or builtins.min(sizes, default=0) < 0:
            raise RuntimeError(f"split: sections {sizes} must be non-negative and add up to dimension {dim}'s size {n}")
    return _pieces("split", tensor, sizes, d)


@torch_entry(records="op:index")
def chunk(input: Operand, chunks: int, dim: int = 0) -> tuple[Tensor, ...]:
    """At most ``chunks`` pieces of ``ceil(n / chunks)`` elements along ``dim`` (the last one smaller).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     [p.shape for p in s.input(jnp.arange(5.0)).chunk(2)]
    [(3,), (2,)]
    """
    if chunks < 1:
        raise RuntimeError(f"chunk: chunks={chunks} must be at least 1")
    shape = _shape(input)
    if not shape:
        raise RuntimeError("chunk: a 0-d tensor has no dimension to cut")
    n = shape[_dim("chunk", dim, len(shape))]
    return split(input, builtins.max(math.ceil(n / chunks), 1), dim)


@torch_entry(records="op:index")
def unbind(input: Operand, dim: int = 0) -> tuple[Tensor, ...]:
    """The slices along ``dim``, each without that dimension.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([[1.0, 2.0], [3.0, 4.0]]))
    ...     [p.tolist() for p in x.unbind(1)]
    [[1.0, 3.0], [2.0, 4.0]]
    """
    shape = _shape(input)
    if not shape:
        raise RuntimeError("unbind: a 0-d tensor has no dimension to unbind")
    d = _dim("unbind", dim, len(shape))
    return tuple(apply("index", input, index=_slices(len(shape), {d: i})) for i in range(shape[d]))


@torch_entry(records="ops:index,tfl.numpy.take_along_axis")
def gather(input: Operand, dim: int, index: Operand, *, sparse_grad: builtins.bool = False) -> Tensor:
    """``out[i][j] = input[index[i][j]][j]`` for ``dim=0`` (and so on): values picked along ``dim`` at ``index``.

    ``index`` has ``input``'s number of dimensions and is no larger in the others.
    (``x[idx]`` or ``tfl.numpy.take(x, idx, axis=0)`` selects whole rows.)

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([[1.0, 2.0], [3.0, 4.0]]))
    ...     tfl.gather(x, 1, jnp.array([[1], [0]])).tolist()
    [[2.0], [3.0]]
    """
    shape, ishape = _shape(input), _shape(index)
    if not np.issubdtype(_dtype_of(index), np.integer):
        raise RuntimeError(f"gather: index must be an integer tensor, got {_dtype_of(index)}")
    if not math.prod(ishape):  # PyTorch checks no shapes for an empty index: the result is empty, shaped as it
        flat = apply("reshape", input, shape=(-1,))
        return apply("reshape", apply("index", flat, index=(slice(0, 0),)), shape=ishape)
    if len(ishape) != len(shape) and not (len(shape) <= 1 and len(ishape) <= 1):
        raise RuntimeError(f"gather: index of shape {ishape} must have the input's {len(shape)} dimensions ({shape})")
    if not shape:  # a 0-d input: every index is 0, and picks the one value
        return apply("broadcast_to", apply("reshape", input, shape=()), shape=ishape)
    d = _dim("gather", dim, len(shape))
    if builtins.any(i > s for k, (i, s) in enumerate(zip(ishape, shape)) if k != d):
        raise RuntimeError(f"gather: index of shape {ishape} is larger than the input {shape} outside dim {dim}")
    x = input
    if builtins.any(i != s for k, (i, s) in enumerate(zip(ishape, shape)) if k != d):
        x = apply("index", x, index=_slices(len(shape), {k: slice(0, i) for k, i in enumerate(ishape) if k != d}))
    return _numpy.record("take_along_axis", x, index, axis=d)


def _scatter_add_jax(x: Array, index: Array, src: Array, *, dim: int) -> Array:
    grid = list(jnp.indices(index.shape, sparse=True))
    grid[dim] = index
    part = src[tuple(slice(0, n) for n in index.shape)]
    return x.at[tuple(grid)].add(part.astype(x.dtype))


_scatter_add = _Lifted("torch.scatter_add", _scatter_add_jax, ("dim",))


@torch_entry(records="lifted")
def scatter_add(input: Operand, dim: int, index: Operand, src: Operand) -> Tensor:
    """``input`` with ``src[i][j]`` added at ``[index[i][j]][j]`` for ``dim=0`` (and so on); repeats accumulate.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.zeros(3))
    ...     src = jnp.array([1.0, 2.0, 3.0])
    ...     x.scatter_add(0, jnp.array([0, 2, 0]), src).tolist()
    [4.0, 0.0, 2.0]
    """
    shape, ishape, sshape = _shape(input), _shape(index), _shape(src)
    if len(ishape) != len(shape) or len(sshape) != len(shape):
        raise RuntimeError(f"scatter_add: input {shape}, index {ishape} and src {sshape} need as many dimensions")
    if not shape:  # 0-d operands: the one index names the one position; scatter as 1-d, then drop the dimension
        _dim("scatter_add", dim, 1)
        one = [
            apply("reshape", v, shape=(1,)) if isinstance(v, TensorOps) else jnp.asarray(v).reshape(1)
            for v in (input, index, src)
        ]
        return apply("reshape", _scatter_add(*one, dim=0), shape=())
    d = _dim("scatter_add", dim, len(shape))
    if builtins.any(i > s for i, s in zip(ishape, sshape)) or builtins.any(
        i > s for k, (i, s) in enumerate(zip(ishape, shape)) if k != d
    ):
        raise RuntimeError(f"scatter_add: index {ishape} is larger than src {sshape} or than input {shape} outside dim")
    return _scatter_add(input, index, src, dim=d)


@torch_entry(records="op:take")
def index_select(input: Operand, dim: int, index: Operand) -> Tensor:
    """The entries at the positions ``index`` (a 1-d integer tensor) along ``dim``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([[1.0, 2.0], [3.0, 4.0]]))
    ...     x.index_select(0, jnp.array([1])).tolist()
    [[3.0, 4.0]]
    """
    shape, ishape = _shape(input), _shape(index)
    if len(ishape) > 1:
        raise RuntimeError(f"index_select: index must be 1-d (or 0-d), got shape {ishape}")
    idx = apply("reshape", index, shape=(-1,)) if isinstance(index, TensorOps) and not ishape else index
    if not isinstance(index, TensorOps) and not ishape:
        idx = np.reshape(np.asarray(index), (1,))
    if not shape:
        return apply("reshape", input, shape=())
    return apply("take", input, idx, axis=_dim("index_select", dim, len(shape)))


@torch_entry(records="op:where")
def masked_fill(input: Operand, mask: Operand, value: float | Operand) -> Tensor:
    """``input`` with ``value`` where the boolean ``mask`` (broadcast to its shape) is True.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([1.0, 2.0]))
    ...     x.masked_fill(x > 1.5, -1.0).tolist()
    [1.0, -1.0]
    """
    if _dtype_of(mask) != np.dtype(bool):
        raise RuntimeError(f"masked_fill: mask must be a boolean tensor, got {_dtype_of(mask)}")
    dt = _dtype_of(input)
    if isinstance(value, TensorOps):
        if _shape(value):
            raise RuntimeError(f"masked_fill: value must be a number or a 0-d tensor, got shape {_shape(value)}")
        v: Operand = _cast(value, dt)
    else:
        v = np.asarray(value, dt)
    return apply("where", mask, v, input)


@torch_entry(records="lifted")
def tril(input: Operand, diagonal: int = 0) -> Tensor:
    """The lower triangle of each matrix (the last two dimensions), from ``diagonal`` down; zeros above.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.tril(s.input(jnp.ones((2, 2)))).tolist()
    [[1.0, 0.0], [1.0, 1.0]]
    """
    return _numpy.record("tril", input, k=builtins.int(diagonal))


@torch_entry(records="lifted")
def triu(input: Operand, diagonal: int = 0) -> Tensor:
    """The upper triangle of each matrix (the last two dimensions), from ``diagonal`` up; zeros below.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.triu(s.input(jnp.ones((2, 2)))).tolist()
    [[1.0, 1.0], [0.0, 1.0]]
    """
    return _numpy.record("triu", input, k=builtins.int(diagonal))


@torch_entry(records="lifted")
def diagonal(input: Operand, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Tensor:
    """The diagonal of the matrices in dimensions ``dim1`` and ``dim2``, as the last dimension.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([[1.0, 2.0], [3.0, 4.0]])).diagonal().tolist()
    [1.0, 4.0]
    """
    n = len(_shape(input))
    a, b = _dim("diagonal", dim1, n), _dim("diagonal", dim2, n)
    if a == b:
        raise RuntimeError(f"diagonal: dim1 and dim2 name the same dimension ({dim1}, {dim2})")
    return _numpy.record("diagonal", input, offset=builtins.int(offset), axis1=a, axis2=b)


@torch_entry(records="op:permute")
def movedim(input: Operand, source: Dims, destination: Dims) -> Tensor:
    """Dimensions ``source`` moved to positions ``destination``; the others keep their order.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.movedim(s.input(jnp.ones((2, 3, 4))), 0, -1).shape
    (3, 4, 2)
    """
    n = len(_shape(input))
    src = _dims("movedim", source, n) or ()
    dst = _dims("movedim", destination, n) or ()
    if len(src) != len(dst):
        raise RuntimeError(f"movedim: source {source} and destination {destination} differ in length")
    rest = iter(d for d in range(n) if d not in src)
    where = dict(zip(dst, src))
    return apply("permute", input, axes=tuple(where[i] if i in where else next(rest) for i in range(n)))


@torch_entry(bind=("method",), records="ops:", opinfo=("contiguous",))
def contiguous(input: TensorOps, memory_format: object = None) -> TensorOps:
    """``input`` itself: a tensor here is a value with no memory layout to change.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.ones(2))
    ...     x.contiguous() is x
    True
    """
    return input


@torch_entry(bind=("method",), records="op:reshape")
def clone(input: Operand, *, memory_format: object = None) -> Tensor:
    """A new tensor with ``input``'s value; gradients flow back to ``input``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.ones(2)).clone().tolist()
    [1.0, 1.0]
    """
    return apply("reshape", input, shape=_shape(input))


# --------------------------------------------------------------------------- arithmetic


def _scale(x: Operand, alpha: float) -> float:
    """``alpha`` as a number of ``x``'s kind (a float for a float tensor: the ops do not promote)."""
    return builtins.float(alpha) if _is_float(x) else alpha


@torch_entry(records="ops:add,mul")
def add(input: Operand, other: Operand, *, alpha: float = 1) -> Tensor:
    """``input + alpha * other``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.ones(2)).add(jnp.ones(2), alpha=3).tolist()
    [4.0, 4.0]
    """
    input, other = promote((input, other))
    return apply("add", input, other if alpha == 1 else apply("mul", other, _scale(other, alpha)))


@torch_entry(records="ops:sub,mul")
def sub(input: Operand, other: Operand, *, alpha: float = 1) -> Tensor:
    """``input - alpha * other``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.ones(2)).sub(jnp.ones(2), alpha=3).tolist()
    [-2.0, -2.0]
    """
    input, other = promote((input, other))
    return apply("sub", input, other if alpha == 1 else apply("mul", other, _scale(other, alpha)))


@torch_entry(records="op:mul")
def mul(input: Operand, other: Operand) -> Tensor:
    """``input * other``, broadcast.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.ones(2)).mul(3.0).tolist()
    [3.0, 3.0]
    """
    return apply("mul", *promote((input, other)))


def _div_rounded_jax(x: Array, y: Array, *, mode: str) -> Array:
    dt = jnp.result_type(x, y)
    x, y = x.astype(dt), y.astype(dt)
    if jnp.issubdtype(dt, jnp.integer):
        if mode == "floor":
            return jnp.floor_divide(x, y)
        return jax.lax.div(*jnp.broadcast_arrays(x, y))  # lax.div truncates integers, and broadcasts nothing
    return jnp.floor(x / y) if mode == "floor" else jnp.trunc(x / y)


_div_rounded = _Lifted("torch.div.rounded", _div_rounded_jax, ("mode",))


@torch_entry(records="ops:div,astype", opinfo=("div.no_rounding_mode", "div.trunc_rounding", "div.floor_rounding"))
def div(input: Operand, other: Operand, *, rounding_mode: str | None = None) -> Tensor:
    """``input / other``: true division (integers give floats), or rounded by ``rounding_mode`` "trunc" / "floor".

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([-7.0, 7.0]))
    ...     x.div(2).tolist(), x.div(2, rounding_mode="floor").tolist()
    ([-3.5, 3.5], [-4.0, 3.0])
    """
    if rounding_mode is None:
        return promoted_div(input, other)
    if rounding_mode not in ("trunc", "floor"):
        raise ValueError(f"div: rounding_mode={rounding_mode!r} must be None, 'trunc' or 'floor'")
    if not isinstance(input, TensorOps) and not isinstance(other, TensorOps):
        input = _leaf(input, np.asarray(input))
    return _div_rounded(input, other, mode=rounding_mode)


@torch_entry(records="op:div")
def true_divide(input: Operand, other: Operand) -> Tensor:
    """``input / other``, integers divided as floats.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([3, 4])).true_divide(2).tolist()
    [1.5, 2.0]
    """
    return div(input, other)


@torch_entry(records="lifted")
def floor_divide(input: Operand, other: Operand) -> Tensor:
    """``input / other`` rounded down (``div(..., rounding_mode="floor")``); no gradient.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([-7, 7])).floor_divide(2).tolist()
    [-4, 3]
    """
    return div(input, other, rounding_mode="floor")


@torch_entry(records="lifted")
def remainder(input: Operand, other: Operand) -> Tensor:
    """``input - floor(input / other) * other``: the remainder with the sign of ``other`` (Python's ``%``).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([-3.0, 3.0])).remainder(2).tolist()
    [1.0, 1.0]
    """
    return _numpy.record("remainder", input, other)


@torch_entry(records="op:pow")
def pow(input: Operand, exponent: Operand) -> Tensor:
    """``input ** exponent`` elementwise.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([2.0, 3.0])).pow(2).tolist()
    [4.0, 9.0]
    """
    return promoted_pow(input, exponent)


@torch_entry(records="op:neg")
def neg(input: Operand) -> Tensor:
    """``-input``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([2.0])).neg().tolist()
    [-2.0]
    """
    return apply("neg", input)


@torch_entry(records="op:abs")
def abs(input: Operand) -> Tensor:
    """``|input|`` elementwise (gradient ``sign(input)``, 0 at 0).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([-2.0])).abs().tolist()
    [2.0]
    """
    return apply("abs", input) if _is_float(input) else _numpy.record("abs", input)


def _unary(name: str, op: str, summary: str, example: str, result: str) -> Callable[[Operand], Tensor]:
    """A float function of one tensor recording built-in op ``op`` (integer tensors promoted to float32)."""

    def fn(input: Operand) -> Tensor:
        return apply(op, _floating(input))

    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = __name__
    fn.__doc__ = (
        f"{summary}\n\n    >>> import jax.numpy as jnp, tapeflow as tfl\n    >>> with tfl.Session() as s:\n"
        f"    ...     x = s.input(jnp.array({example}))\n"
        f"    ...     [round(v, 4) for v in x.{name}().tolist()]\n    {result}\n"
    )
    return fn


exp = torch_entry("exp", records="op:exp")(
    _unary("exp", "exp", "``e ** input`` elementwise.", "[0.0, 1.0]", "[1.0, 2.7183]")
)
log = torch_entry("log", records="op:log")(
    _unary("log", "log", "The natural logarithm elementwise.", "[1.0, 2.0]", "[0.0, 0.6931]")
)
sqrt = torch_entry("sqrt", records="op:sqrt")(
    _unary("sqrt", "sqrt", "The square root elementwise.", "[4.0, 2.0]", "[2.0, 1.4142]")
)
sin = torch_entry("sin", records="op:sin")(_unary("sin", "sin", "The sine elementwise.", "[0.0, 1.0]", "[0.0, 0.8415]"))
cos = torch_entry("cos", records="op:cos")(
    _unary("cos", "cos", "The cosine elementwise.", "[0.0, 1.0]", "[1.0, 0.5403]")
)
tanh = torch_entry("tanh", bind=("method", "tfl", "F"), records="op:tanh", opinfo=("tanh",))(
    _unary("tanh", "tanh", "The hyperbolic tangent elementwise.", "[0.0, 1.0]", "[0.0, 0.7616]")
)
sigmoid = torch_entry("sigmoid", bind=("method", "tfl", "F"), records="op:sigmoid", opinfo=("sigmoid",))(
    _unary(
        "sigmoid",
        "sigmoid",
        "The logistic sigmoid ``1 / (1 + exp(-input))`` elementwise.",
        "[0.0, 2.0]",
        "[0.5, 0.8808]",
    )
)


@torch_entry(records="lifted")
def log1p(input: Operand) -> Tensor:
    """``log(1 + input)``, accurate near 0.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([0.0])).log1p().tolist()
    [0.0]
    """
    return _numpy.record("log1p", _floating(input))


@torch_entry(records="lifted")
def expm1(input: Operand) -> Tensor:
    """``exp(input) - 1``, accurate near 0.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([0.0])).expm1().tolist()
    [0.0]
    """
    return _numpy.record("expm1", _floating(input))


@torch_entry(records="ops:sqrt,div")
def rsqrt(input: Operand) -> Tensor:
    """``1 / sqrt(input)`` elementwise.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([4.0])).rsqrt().tolist()
    [0.5]
    """
    return apply("div", 1.0, apply("sqrt", _floating(input)))


@torch_entry(records="op:div")
def reciprocal(input: Operand) -> Tensor:
    """``1 / input`` elementwise (integers give floats).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([4.0])).reciprocal().tolist()
    [0.25]
    """
    return apply("div", 1.0, _floating(input))


@torch_entry(records="op:mul")
def square(input: Operand) -> Tensor:
    """``input * input`` elementwise.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([3.0])).square().tolist()
    [9.0]
    """
    return apply("mul", input, input)


@torch_entry(records="lifted")
def sign(input: Operand) -> Tensor:
    """-1, 0 or 1 by the sign of each element (zero gradient).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([-3.0, 0.0, 2.0])).sign().tolist()
    [-1.0, 0.0, 1.0]
    """
    return _numpy.record("sign", input)


@torch_entry(records="ops:sub,mul,add")
def lerp(input: Operand, end: Operand, weight: float | Operand) -> Tensor:
    """``input + weight * (end - input)``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([0.0])).lerp(jnp.array([10.0]), 0.25).tolist()
    [2.5]
    """
    return apply("add", input, apply("mul", weight, apply("sub", end, input)))


@torch_entry(records="op:maximum")
def maximum(input: Operand, other: Operand) -> Tensor:
    """The larger of ``input`` and ``other`` elementwise (ties share the gradient).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([1.0, 5.0]))
    ...     x.maximum(jnp.array([3.0, 3.0])).tolist()
    [3.0, 5.0]
    """
    return apply("maximum", *promote((input, other)))


@torch_entry(records="op:minimum")
def minimum(input: Operand, other: Operand) -> Tensor:
    """The smaller of ``input`` and ``other`` elementwise (ties share the gradient).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([1.0, 5.0]))
    ...     x.minimum(jnp.array([3.0, 3.0])).tolist()
    [1.0, 3.0]
    """
    return apply("minimum", *promote((input, other)))


def _compare(name: str, symbol: str) -> Callable[[Operand, Operand], Tensor]:
    def fn(input: Operand, other: Operand) -> Tensor:
        return apply(name, *promote((input, other)))

    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = __name__
    fn.__doc__ = (
        f"``input {symbol} other`` elementwise: a boolean tensor (no gradient).\n\n"
        "    >>> import jax.numpy as jnp, tapeflow as tfl\n    >>> with tfl.Session() as s:\n"
        f"    ...     s.input(jnp.array([1.0, 2.0])).{name}(2.0).tolist()\n"
        f"    {[bool(eval(f'{v} {symbol} 2.0')) for v in (1.0, 2.0)]}\n"
    )
    return torch_entry(name, records=f"op:{name}")(fn)


eq = _compare("eq", "==")
ne = _compare("ne", "!=")
lt = _compare("lt", "<")
le = _compare("le", "<=")
gt = _compare("gt", ">")
ge = _compare("ge", ">=")


def _softmax_dim(op: str, dim: int | None, axis: int | None, ndim: int) -> int | None:
    d = _alias(op, dim, None, axis, ("dim", "axis"))
    if d is None:  # PyTorch's implicit choice, with PyTorch's warning
        warnings.warn(
            f"Implicit dimension choice for {op} has been deprecated. Change the call to include dim=X as an argument.",
            UserWarning,
            stacklevel=3,
        )
        d = 0 if ndim in (0, 1, 3) else 1
    return None if ndim == 0 else _dim(op, d, ndim)  # type: ignore[arg-type]


@torch_entry(bind=("method", "tfl", "F"), records="op:softmax", opinfo=("softmax", "softmax.with_dtype"))
def softmax(
    input: Operand,
    dim: int | None = None,
    _stacklevel: int = 3,
    dtype: DTypeLike | None = None,
    *,
    axis: int | None = None,
) -> Tensor:
    """``exp(input) / sum(exp(input))`` along ``dim`` (computed in ``dtype`` when given).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.zeros((1, 2))).softmax(1).tolist()
    [[0.5, 0.5]]
    """
    x = _floating(_cast(input, dtype))
    d = _softmax_dim("softmax", dim, axis, len(_shape(input)))
    if d is None:
        return apply("div", apply("exp", apply("sub", x, x)), 1.0)  # 0-d: exp(0) = 1, with a gradient path
    if not math.prod(_shape(input)):  # nothing to normalize; the op's max has no identity on an empty axis
        return apply("reshape", x, shape=_shape(input))
    return apply("softmax", x, axis=d)


@torch_entry(
    bind=("method", "tfl", "F"),
    records="op:log_softmax",
    opinfo=("log_softmax", "log_softmax.with_dtype"),
)
def log_softmax(
    input: Operand,
    dim: int | None = None,
    _stacklevel: int = 3,
    dtype: DTypeLike | None = None,
    *,
    axis: int | None = None,
) -> Tensor:
    """``input - logsumexp(input)`` along ``dim`` (computed in ``dtype`` when given).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     [round(v, 4) for v in s.input(jnp.zeros(2)).log_softmax(0).tolist()]
    [-0.6931, -0.6931]
    """
    x = _floating(_cast(input, dtype))
    d = _softmax_dim("log_softmax", dim, axis, len(_shape(input)))
    if d is None:
        return apply("sub", x, x)
    if not math.prod(_shape(input)):  # nothing to normalize; the op's max has no identity on an empty axis
        return apply("reshape", x, shape=_shape(input))
    return apply("log_softmax", x, axis=d)


@torch_entry(records="ops:clamp,where", aliases=("clip",))
def clamp(input: Operand, min: float | Operand | None = None, max: float | Operand | None = None) -> Tensor:
    """``input`` limited to ``[min, max]`` (numbers or tensors; the gradient passes where the bound does not bite).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([-2.0, 0.5, 3.0])).clamp(-1, 1).tolist()
    [-1.0, 0.5, 1.0]
    """
    lo, hi = min, max
    if lo is None and hi is None:
        raise RuntimeError("clamp: at least one of min and max must be given")
    numbers = builtins.all(v is None or type(v) in (builtins.int, builtins.float) for v in (lo, hi))
    if numbers and _is_float(input):
        if lo is not None and hi is not None and cast(float, lo) > cast(float, hi):  # PyTorch: all become max
            return apply("add", apply("mul", input, 0.0), cast(float, hi))
        return apply("clamp", input, lo=lo, hi=hi)
    # PyTorch's result dtype is that of input and the bounds together (an int32 bound on a float32 input: float32)
    bounds = tuple(v for v in (lo, hi) if v is not None)
    out, *given = promote((input, *bounds))
    lo = given.pop(0) if lo is not None else None
    hi = given.pop(0) if hi is not None else None
    if lo is not None:
        out = apply("where", apply("lt", out, lo), lo, out)
    if hi is not None:
        out = apply("where", apply("gt", out, hi), hi, out)
    return out if isinstance(out, Tensor) else apply("reshape", out, shape=_shape(out))


clip = clamp


@torch_entry(records="op:matmul")
def matmul(input: Operand, other: Operand) -> Tensor:
    """The matrix product, batched and broadcast over leading dimensions (1-d operands as vectors).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.ones((2, 3))).matmul(jnp.ones((3, 4))).shape
    (2, 4)
    """
    return apply("matmul", input, other)


@torch_entry(records="op:matmul")
def mm(input: Operand, mat2: Operand) -> Tensor:
    """The product of two matrices (2-d only; ``matmul`` batches).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.ones((2, 3))).mm(jnp.ones((3, 4))).shape
    (2, 4)
    """
    if len(_shape(input)) != 2 or len(_shape(mat2)) != 2:
        raise RuntimeError(f"mm: needs two matrices, got shapes {_shape(input)} and {_shape(mat2)}; use matmul")
    return apply("matmul", input, mat2)


@torch_entry(records="op:matmul")
def bmm(input: Operand, mat2: Operand) -> Tensor:
    """The products of two batches of matrices (3-d only, equal batch sizes).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.ones((5, 2, 3))).bmm(jnp.ones((5, 3, 4))).shape
    (5, 2, 4)
    """
    a, b = _shape(input), _shape(mat2)
    if len(a) != 3 or len(b) != 3 or a[0] != b[0]:
        raise RuntimeError(f"bmm: needs two 3-d batches of equal size, got shapes {a} and {b}; use matmul")
    return apply("matmul", input, mat2)


@torch_entry(records="ops:reshape,mul")
def outer(input: Operand, vec2: Operand) -> Tensor:
    """The outer product of two vectors.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([1.0, 2.0]))
    ...     tfl.outer(x, jnp.array([1.0, 3.0])).tolist()
    [[1.0, 3.0], [2.0, 6.0]]
    """
    if len(_shape(input)) != 1 or len(_shape(vec2)) != 1:
        raise RuntimeError(f"outer: needs two vectors, got shapes {_shape(input)} and {_shape(vec2)}")
    return apply("mul", apply("reshape", input, shape=(-1, 1)), vec2)


@torch_entry(bind=("tfl",), records="lifted")
def einsum(equation: str, *operands: Operand | Sequence[Operand]) -> Tensor:
    """The Einstein summation ``equation`` over the operands (given one by one or as one list).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.ones((2, 3)))
    ...     tfl.einsum("ij,j->i", x, jnp.ones(3)).tolist()
    [3.0, 3.0]
    """
    ops = operands[0] if len(operands) == 1 and isinstance(operands[0], (list, tuple)) else operands
    return _numpy.record("einsum", equation, *ops)


# --------------------------------------------------------------------------- reductions


def _sum_dtype(x: Operand, dtype: DTypeLike | None) -> Operand:
    if dtype is not None:
        return _cast(x, dtype)
    return apply("astype", x, dtype=_long()) if not _is_float(x) and _dtype_of(x) != _long() else x


@torch_entry(records="op:sum", opinfo=("sum",))
def sum(
    input: Operand,
    dim: Dims | None = None,
    keepdim: builtins.bool = False,
    *,
    dtype: DTypeLike | None = None,
    axis: Dims | None = None,
    keepdims: builtins.bool | None = None,
) -> Tensor:
    """The sum over ``dim`` (all dimensions when None), keeping reduced dimensions with ``keepdim``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.ones((2, 3))).sum(1).tolist()
    [3.0, 3.0]
    """
    d, k = _red("sum", dim, axis, keepdim, keepdims)
    return apply("sum", _sum_dtype(input, dtype), axis=_dims("sum", d, len(_shape(input))), keepdims=k)


@torch_entry(records="op:mean")
def mean(
    input: Operand,
    dim: Dims | None = None,
    keepdim: builtins.bool = False,
    *,
    dtype: DTypeLike | None = None,
    axis: Dims | None = None,
    keepdims: builtins.bool | None = None,
) -> Tensor:
    """The mean over ``dim`` (all dimensions when None); integer tensors need a float ``dtype``, as in PyTorch.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([[1.0, 3.0]])).mean(dim=1).tolist()
    [2.0]
    """
    d, k = _red("mean", dim, axis, keepdim, keepdims)
    x = _cast(input, dtype)
    if not _is_float(x):
        raise RuntimeError(
            f"mean: a {_dtype_of(x)} tensor has no floating mean dtype; pass dtype=jnp.float32 or call .float() first"
        )
    return apply("mean", x, axis=_dims("mean", d, len(_shape(input))), keepdims=k)


@torch_entry(records="lifted")
def prod(
    input: Operand,
    dim: int | None = None,
    keepdim: builtins.bool = False,
    *,
    dtype: DTypeLike | None = None,
    axis: int | None = None,
    keepdims: builtins.bool | None = None,
) -> Tensor:
    """The product over ``dim`` (all elements when None).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([2.0, 3.0])).prod().tolist()
    6.0
    """
    d, k = _red("prod", dim, axis, keepdim, keepdims)
    axes = _dims("prod", d, len(_shape(input)))
    return _numpy.record("prod", _sum_dtype(input, dtype), axis=axes, keepdims=k)


def _picked(op: str, input: Operand, dim: int, keepdim: builtins.bool, largest: builtins.bool) -> ValuesIndices:
    """``(values, indices)`` of the max (``largest``) or min along ``dim``: the gradient reaches the picked element."""
    n = len(_shape(input))
    d = _dim(op, dim, n)
    if n == 0:
        return ValuesIndices(apply("reshape", input, shape=()), _leaf(input, np.zeros((), _long())))
    idx = _numpy.record("argmax" if largest else "argmin", input, axis=d, keepdims=True)
    values = _numpy.record("take_along_axis", input, idx, axis=d)
    if not keepdim:
        values, idx = apply("squeeze", values, axis=(d,)), apply("squeeze", idx, axis=(d,))
    return ValuesIndices(values, idx)


def _extreme(input: Operand, axes: tuple[int, ...] | None, keepdim: builtins.bool, largest: builtins.bool) -> Tensor:
    """amax / amin over ``axes``: ties share the gradient evenly."""
    if largest:
        return apply("max", input, axis=axes, keepdims=keepdim)
    if _is_float(input):
        return apply("neg", apply("max", apply("neg", input), axis=axes, keepdims=keepdim))
    return _numpy.record("amin", input, axis=axes, keepdims=keepdim)


@torch_entry(
    records="ops:max,argmax,take_along_axis", opinfo=("max.reduction_no_dim", "max.reduction_with_dim", "max.binary")
)
def max(
    input: Operand,
    dim: int | Operand | None = None,
    keepdim: builtins.bool = False,
    *,
    axis: int | None = None,
    keepdims: builtins.bool | None = None,
) -> Tensor | ValuesIndices:
    """The largest value; with ``dim``, the ``(values, indices)`` pair along it; with a tensor, the elementwise maximum.

    With ``dim`` the gradient goes to the element picked; without, ties share it evenly (PyTorch's rules).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([[1.0, 5.0], [4.0, 2.0]]))
    ...     other = jnp.full((2, 2), 3.0)
    ...     float(x.max()), x.max(1).indices.tolist(), x.max(other).tolist()
    (5.0, [1, 0], [[3.0, 5.0], [4.0, 3.0]])
    """
    d, k = _red("max", dim, axis, keepdim, keepdims)  # type: ignore[arg-type]
    if d is None:
        return _extreme(input, None, False, True)
    if not isinstance(d, (builtins.int, np.integer)):
        return apply("maximum", input, d)
    return _picked("max", input, d, k, True)


@torch_entry(
    records="ops:neg,max,argmin,take_along_axis",
    opinfo=("min.reduction_no_dim", "min.reduction_with_dim", "min.binary"),
)
def min(
    input: Operand,
    dim: int | Operand | None = None,
    keepdim: builtins.bool = False,
    *,
    axis: int | None = None,
    keepdims: builtins.bool | None = None,
) -> Tensor | ValuesIndices:
    """The smallest value; with ``dim``, the ``(values, indices)`` pair along it; with a tensor, the elementwise minimum.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([[1.0, 5.0], [4.0, 2.0]]))
    ...     float(x.min()), x.min(1).values.tolist()
    (1.0, [1.0, 2.0])
    """
    d, k = _red("min", dim, axis, keepdim, keepdims)  # type: ignore[arg-type]
    if d is None:
        return _extreme(input, None, False, False)
    if not isinstance(d, (builtins.int, np.integer)):
        return apply("minimum", input, d)
    return _picked("min", input, d, k, False)


@torch_entry(records="op:max")
def amax(
    input: Operand,
    dim: Dims = (),
    keepdim: builtins.bool = False,
    *,
    axis: Dims | None = None,
    keepdims: builtins.bool | None = None,
) -> Tensor:
    """The maximum over ``dim`` (``()``: all dimensions); ties share the gradient evenly.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([[1.0, 5.0], [4.0, 2.0]])).amax(0).tolist()
    [4.0, 5.0]
    """
    d, k = _red("amax", dim, axis, keepdim, keepdims, no_dim=dim if dim == () else None)
    return _extreme(input, _dims("amax", d, len(_shape(input))), k, True)


@torch_entry(records="ops:neg,max")
def amin(
    input: Operand,
    dim: Dims = (),
    keepdim: builtins.bool = False,
    *,
    axis: Dims | None = None,
    keepdims: builtins.bool | None = None,
) -> Tensor:
    """The minimum over ``dim`` (``()``: all dimensions); ties share the gradient evenly.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([[1.0, 5.0], [4.0, 2.0]])).amin(0).tolist()
    [1.0, 2.0]
    """
    d, k = _red("amin", dim, axis, keepdim, keepdims, no_dim=dim if dim == () else None)
    return _extreme(input, _dims("amin", d, len(_shape(input))), k, False)


def _position(op: str, input: Operand, dim: int | None, keepdim: builtins.bool) -> Tensor:
    n = len(_shape(input))
    if dim is None:
        out = _numpy.record(op, apply("reshape", input, shape=(-1,)), axis=0)
        return apply("reshape", out, shape=(1,) * n) if keepdim else out
    d = _dim(op, dim, n)
    if n == 0:
        return _leaf(input, np.zeros((), _long()))
    return _numpy.record(op, input, axis=d, keepdims=keepdim)


@torch_entry(records="lifted")
def argmax(
    input: Operand,
    dim: int | None = None,
    keepdim: builtins.bool = False,
    *,
    axis: int | None = None,
    keepdims: builtins.bool | None = None,
) -> Tensor:
    """The position of the largest value along ``dim`` (None: in the flattened tensor); the first one of ties.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([[1.0, 5.0], [4.0, 2.0]])).argmax(1).tolist()
    [1, 0]
    """
    d, k = _red("argmax", dim, axis, keepdim, keepdims)
    return _position("argmax", input, d, k)  # type: ignore[arg-type]


@torch_entry(records="lifted")
def argmin(
    input: Operand,
    dim: int | None = None,
    keepdim: builtins.bool = False,
    *,
    axis: int | None = None,
    keepdims: builtins.bool | None = None,
) -> Tensor:
    """The position of the smallest value along ``dim`` (None: in the flattened tensor); the first one of ties.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([[1.0, 5.0], [4.0, 2.0]])).argmin().tolist()
    0
    """
    d, k = _red("argmin", dim, axis, keepdim, keepdims)
    return _position("argmin", input, d, k)  # type: ignore[arg-type]


def _spread(
    op: str,
    input: Operand,
    dim: Dims | builtins.bool | None,
    unbiased: builtins.bool | None,
    keepdim: builtins.bool,
    correction: float | None,
    axis: Dims | None,
    keepdims: builtins.bool | None,
) -> Tensor:
    if isinstance(dim, builtins.bool):  # var(input, unbiased): PyTorch's second overload
        if unbiased is not None:
            raise TypeError(f"{op}: unbiased given twice ({dim!r} positionally and unbiased={unbiased!r})")
        dim, unbiased = None, dim
    d, k = _red(op, dim, axis, keepdim, keepdims)
    if unbiased is not None and correction is not None:
        raise TypeError(f"{op}: pass unbiased= or correction= (correction=1 is unbiased=True), not both")
    if not _is_float(input):
        raise RuntimeError(f"{op}: needs a floating tensor, got {_dtype_of(input)}; call .float() first")
    shape = _shape(input)
    axes = _dims(op, d, len(shape))
    c = builtins.float(correction if correction is not None else (1.0 if unbiased is None or unbiased else 0.0))
    n = math.prod(shape) if axes is None else math.prod(shape[a] for a in axes)
    centered = apply("sub", input, apply("mean", input, axis=axes, keepdims=True))
    total = apply("sum", apply("mul", centered, centered), axis=axes, keepdims=k)
    return apply("div", total, builtins.max(n - c, 0.0))


@torch_entry(records="ops:mean,sub,mul,sum,div", opinfo=("var", "var.unbiased"))
def var(
    input: Operand,
    dim: Dims | None = None,
    unbiased: builtins.bool | None = None,
    keepdim: builtins.bool = False,
    *,
    correction: float | None = None,
    axis: Dims | None = None,
    keepdims: builtins.bool | None = None,
) -> Tensor:
    """The variance over ``dim``, divided by ``N - correction`` (PyTorch's default ``correction=1``, unbiased).

    ``tfl.numpy.var`` is NumPy's (``ddof=0``).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([1.0, 2.0, 3.0, 4.0]))
    ...     round(float(x.var()), 4), float(x.var(unbiased=False))
    (1.6667, 1.25)
    """
    return _spread("var", input, dim, unbiased, keepdim, correction, axis, keepdims)


@torch_entry(records="ops:mean,sub,mul,sum,div,sqrt", opinfo=("std", "std.unbiased"))
def std(
    input: Operand,
    dim: Dims | None = None,
    unbiased: builtins.bool | None = None,
    keepdim: builtins.bool = False,
    *,
    correction: float | None = None,
    axis: Dims | None = None,
    keepdims: builtins.bool | None = None,
) -> Tensor:
    """The standard deviation: the square root of :func:`var` (unbiased by default, as PyTorch).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     float(s.input(jnp.array([1.0, 3.0])).std())
    1.4142135381698608
    """
    return apply("sqrt", _spread("std", input, dim, unbiased, keepdim, correction, axis, keepdims))


@torch_entry(records="op:logsumexp")
def logsumexp(
    input: Operand,
    dim: Dims | None = None,
    keepdim: builtins.bool = False,
    *,
    axis: Dims | None = None,
    keepdims: builtins.bool | None = None,
) -> Tensor:
    """``log(sum(exp(input)))`` over ``dim``, computed stably.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     round(float(s.input(jnp.zeros(2)).logsumexp(0)), 4)
    0.6931
    """
    d, k = _red("logsumexp", dim, axis, keepdim, keepdims)
    x = _floating(input)
    axes = _dims("logsumexp", d, len(_shape(input)))
    if not _shape(input):
        return apply("reshape", x, shape=())
    return apply("logsumexp", x, axis=axes, keepdims=k)


@torch_entry(records="lifted")
def cumsum(input: Operand, dim: int, *, dtype: DTypeLike | None = None, axis: int | None = None) -> Tensor:
    """The running sum along ``dim``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([1.0, 2.0, 3.0])).cumsum(0).tolist()
    [1.0, 3.0, 6.0]
    """
    d = _alias("cumsum", dim, None, axis, ("dim", "axis"))
    shape = _shape(input)
    x = _sum_dtype(input, dtype)
    if not shape:
        _dim("cumsum", d, 0)  # type: ignore[arg-type]
        return apply("reshape", x, shape=())
    return _numpy.record("cumsum", x, axis=_dim("cumsum", d, len(shape)))  # type: ignore[arg-type]


def _norm_jax(x: Array, *, p: float, axis: tuple[int, ...] | None, keepdims: builtins.bool) -> Array:
    """The vector p-norm over ``axis`` with PyTorch's gradient at a zero norm (zero, where a plain root gives NaN)."""
    a = jnp.abs(x)
    if p == math.inf:
        return jnp.max(a, axis=axis, keepdims=keepdims)
    if p == -math.inf:
        return jnp.min(a, axis=axis, keepdims=keepdims)
    if p == 0:
        return jnp.sum((a != 0).astype(x.dtype), axis=axis, keepdims=keepdims)
    if p == 1:
        return jnp.sum(a, axis=axis, keepdims=keepdims)
    s = jnp.sum(x * x if p == 2 else a**p, axis=axis, keepdims=keepdims)
    zero = s == 0
    safe = jnp.where(zero, 1.0, s)
    return jnp.where(zero, 0.0, jnp.sqrt(safe) if p == 2 else safe ** (1.0 / p))


_norm = _Lifted("torch.norm", _norm_jax, ("p", "axis", "keepdims"))


def _nuclear_jax(x: Array, *, axis: tuple[int, int], keepdims: builtins.bool) -> Array:
    return jnp.linalg.norm(x, ord="nuc", axis=axis, keepdims=keepdims)


_nuclear = _Lifted("torch.norm.nuc", _nuclear_jax, ("axis", "keepdims"))


@torch_entry(records="lifted", opinfo=("norm", "norm.fro", "norm.inf"))
def norm(
    input: Operand,
    p: float | str | None = "fro",
    dim: Dims | None = None,
    keepdim: builtins.bool = False,
    dtype: DTypeLike | None = None,
) -> Tensor:
    """The vector ``p``-norm over ``dim`` (all elements when None); ``"fro"`` is the 2-norm, ``"nuc"`` the nuclear.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([3.0, -4.0]))
    ...     float(x.norm()), float(x.norm(1)), float(x.norm(float("inf")))
    (5.0, 7.0, 4.0)
    """
    x = _floating(_cast(input, dtype))
    n = len(_shape(input))
    axes = _dims("norm", dim, n)
    if p == "nuc":
        if axes is None or len(axes) != 2:
            if axes is None and n == 2:
                axes = (0, 1)
            else:
                raise RuntimeError(
                    f"norm: p='nuc' is a matrix norm: give two dims (got dim={dim}, shape {_shape(input)})"
                )
        return _nuclear(x, axis=axes, keepdims=builtins.bool(keepdim))
    if p == "fro" or p is None:
        pv = 2.0
    elif isinstance(p, str):
        raise RuntimeError(f"norm: p={p!r} is not a norm; give a number, 'fro' or 'nuc'")
    else:
        pv = builtins.float(p)
    return _norm(x, p=pv, axis=axes, keepdims=builtins.bool(keepdim))


@torch_entry(records="lifted")
def all(input: Operand, dim: Dims | None = None, keepdim: builtins.bool = False) -> Tensor:
    """Whether every element (along ``dim``) is nonzero: a boolean tensor.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([[True, False], [True, True]])).all(1).tolist()
    [False, True]
    """
    return _numpy.record("all", input, axis=_dims("all", dim, len(_shape(input))), keepdims=builtins.bool(keepdim))


@torch_entry(records="lifted")
def any(input: Operand, dim: Dims | None = None, keepdim: builtins.bool = False) -> Tensor:
    """Whether some element (along ``dim``) is nonzero: a boolean tensor.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([[True, False], [False, False]])).any(1).tolist()
    [True, False]
    """
    return _numpy.record("any", input, axis=_dims("any", dim, len(_shape(input))), keepdims=builtins.bool(keepdim))


@torch_entry(records="lifted")
def sort(
    input: Operand, dim: int = -1, descending: builtins.bool = False, *, stable: builtins.bool = False
) -> ValuesIndices:
    """``(values, indices)``: the elements along ``dim`` in order (ties keep their order); gradients follow them.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     v, i = s.input(jnp.array([3.0, 1.0, 2.0])).sort(descending=True)
    ...     v.tolist(), i.tolist()
    ([3.0, 2.0, 1.0], [0, 2, 1])
    """
    n = len(_shape(input))
    d = _dim("sort", dim, n)
    if n == 0:
        return ValuesIndices(apply("reshape", input, shape=()), _leaf(input, np.zeros((), _long())))
    idx = _numpy.record("argsort", input, axis=d, stable=True, descending=builtins.bool(descending))
    return ValuesIndices(_numpy.record("take_along_axis", input, idx, axis=d), idx)


@torch_entry(records="lifted")
def topk(
    input: Operand, k: int, dim: int = -1, largest: builtins.bool = True, sorted: builtins.bool = True
) -> ValuesIndices:
    """``(values, indices)`` of the ``k`` largest (or smallest) elements along ``dim``, in order.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     v, i = tfl.topk(s.input(jnp.array([3.0, 1.0, 2.0])), 2)
    ...     v.tolist(), i.tolist()
    ([3.0, 2.0], [0, 2])
    """
    shape = _shape(input)
    d = _dim("topk", dim, len(shape))
    size = shape[d] if shape else 1
    if not 0 <= k <= size:
        raise RuntimeError(f"topk: k={k} is out of range for dimension {dim} of size {size}")
    if not shape:
        return sort(input)
    order = _numpy.record("argsort", input, axis=d, stable=True, descending=builtins.bool(largest))
    idx = apply("index", order, index=_slices(len(shape), {d: slice(0, builtins.int(k))}))
    return ValuesIndices(_numpy.record("take_along_axis", input, idx, axis=d), idx)


# --------------------------------------------------------------------------- dtypes, devices and host reads


def _caster(name: str, dtype: DTypeLike, result: str) -> Callable[..., Operand]:
    def fn(input: TensorOps, memory_format: object = None) -> Operand:
        return _cast(input, dtype)

    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = __name__
    target = np.dtype(jax.dtypes.canonicalize_dtype(jnp.dtype(dtype)))
    fn.__doc__ = (
        f"``input`` as {target} ({'PyTorch: ' + str(np.dtype(dtype)) + ', ' if target != np.dtype(dtype) else ''}"
        "the tensor itself when it has that dtype already).\n\n"
        "    >>> import jax.numpy as jnp, tapeflow as tfl\n    >>> with tfl.Session() as s:\n"
        f"    ...     s.input(jnp.array([1.5, 0.0])).{name}().tolist()\n    {result}\n"
    )
    return torch_entry(name, bind=("method",), records="op:astype")(fn)


_to_float = _caster("float", np.float32, "[1.5, 0.0]")
_to_double = _caster("double", np.float64, "[1.5, 0.0]")
_to_half = _caster("half", np.float16, "[1.5, 0.0]")
_to_bfloat16 = _caster("bfloat16", jnp.bfloat16, "[1.5, 0.0]")
_to_long = _caster("long", np.int64, "[1, 0]")
_to_int = _caster("int", np.int32, "[1, 0]")
_to_bool = _caster("bool", np.bool_, "[True, False]")


def _platform(device: object) -> str:
    kind = getattr(device, "type", None) or getattr(device, "platform", None) or str(device).split(":")[0]
    return {"cuda": "gpu"}.get(str(kind), str(kind))


def _check_device(op: str, input: Operand, device: object) -> None:
    """A device request: the session's own platform is fine; another one is an error naming ``Session(device=)``."""
    if device is None:
        return
    s = input.session if isinstance(input, Tensor) else current_session()
    if s is None:
        return
    have = s.device.platform
    if _platform(device) != have:
        raise RuntimeError(
            f"{op}: device {device!r}, but this tensor's session runs on {s.device}; a session holds its tensors on "
            f"one device: make the session with tfl.Session(device=...) instead"
        )


@torch_entry(bind=("method",), records="op:astype")
def to(input: TensorOps, *args: object, **kwargs: object) -> Operand:
    """``to(dtype)``, ``to(other)`` (its dtype), ``to(device)`` or ``to(device, dtype)``: a cast; devices must be the session's.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([1.5]))
    ...     x.to(jnp.int32).tolist(), x.to("cpu") is x
    ([1], True)
    """
    dtype = kwargs.pop("dtype", None)
    device = kwargs.pop("device", None)
    for k in ("non_blocking", "copy", "memory_format"):
        kwargs.pop(k, None)
    if kwargs:
        raise TypeError(f"to: unexpected keyword argument(s) {sorted(kwargs)}")
    for a in args:
        if isinstance(a, TensorOps):
            dtype = a.dtype  # type: ignore[attr-defined]
        elif isinstance(a, builtins.bool):
            continue  # non_blocking / copy positionally
        elif (
            (isinstance(a, str) and a.split(":")[0] in ("cpu", "cuda", "gpu", "tpu", "mps", "meta"))
            or type(a).__name__ in ("device", "Device", "CpuDevice", "GpuDevice")
            or hasattr(a, "platform")
        ):
            device = a
        else:
            dtype = a
    _check_device("to", input, device)
    return input if dtype is None else _cast(input, dtype)


@torch_entry(bind=("method",), records="op:astype", opinfo=())
def type_as(input: TensorOps, other: TensorOps) -> Operand:
    """``input`` cast to ``other``'s dtype.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([1.5])).type_as(s.input(jnp.array([1]))).tolist()
    [1]
    """
    return _cast(input, other.dtype)  # type: ignore[attr-defined]


@torch_entry(bind=("method",), records="ops:", opinfo=())
def cpu(input: TensorOps, memory_format: object = None) -> TensorOps:
    """``input`` itself: a session holds its values on its device, and ``numpy()`` / ``item()`` read them to the host.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.ones(2)).cpu().numpy().tolist()
    [1.0, 1.0]
    """
    return input


@torch_entry(bind=("method",), records="host", opinfo=())
def detach(input: TensorOps) -> Tensor:
    """A new leaf holding this value, cut off from the recording's gradients.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.ones(2), requires_grad=True)
    ...     (x * 2).detach().requires_grad
    False
    """
    if isinstance(input, Tensor):
        s = input.session
        if s is None:
            raise TapeError("detach: the tensor handle has no owning session")
        return s.detach(input)
    return session_of((input,), "detach").input(input.value)  # type: ignore[attr-defined]


@torch_entry(bind=("method",), records="host", opinfo=("item",))
def item(input: TensorOps) -> builtins.int | builtins.float | builtins.bool:
    """The value of a one-element tensor as a Python number (read: a lazy session computes it).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([2.5])).item()
    2.5
    """
    v = host_value(input, "item()")
    if v.size != 1:
        raise RuntimeError(f"item: a tensor with {v.size} elements cannot be converted to a Python number")
    out: builtins.int | builtins.float | builtins.bool = v.reshape(()).item()
    return out


@torch_entry(bind=("method",), records="host", opinfo=())
def tolist(input: TensorOps) -> object:
    """The value as nested Python lists (a number for a 0-d tensor).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([[1, 2]])).tolist()
    [[1, 2]]
    """
    return host_value(input, "tolist()").tolist()


@torch_entry(bind=("method",), records="host", opinfo=())
def numpy(input: TensorOps, *, force: builtins.bool = False) -> np.ndarray:
    """The value as a NumPy array on the host.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.array([1.0])).numpy()
    array([1.], dtype=float32)
    """
    return host_value(input, "numpy()")


@torch_entry("size", bind=("method",), records="host", opinfo=())
def _size(input: TensorOps, dim: int | None = None) -> tuple[int, ...] | int:
    """The shape (a tuple), or the size of dimension ``dim``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.ones((2, 3)))
    ...     x.size(), x.size(-1)
    ((2, 3), 3)
    """
    shape: Shape = tuple(input.shape)  # type: ignore[attr-defined]
    return shape if dim is None else shape[_dim("size", dim, len(shape))]


@torch_entry("dim", bind=("method",), records="host", opinfo=())
def _ndims(input: TensorOps) -> int:
    """The number of dimensions.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.ones((2, 3))).dim()
    2
    """
    return len(input.shape)  # type: ignore[attr-defined]


@torch_entry(bind=("method",), records="host", opinfo=())
def numel(input: TensorOps) -> int:
    """The number of elements.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.ones((2, 3))).numel()
    6
    """
    return math.prod(input.shape)  # type: ignore[attr-defined]


@torch_entry("ndim", bind=("property",), records="host", opinfo=())
def _ndim(input: TensorOps) -> int:
    """The number of dimensions.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.ones((2, 3))).ndim
    2
    """
    return len(input.shape)  # type: ignore[attr-defined]


# ``shape`` and ``dtype`` are kept by each kind of tensor (a Tensor's slots, a Param's storage): their entries
# declare them (records="stored": bind_methods leaves them to the classes)


@torch_entry("shape", bind=("property",), records="stored", opinfo=())
def _shape_entry(input: TensorOps) -> tuple[int, ...]:
    """The shape, a tuple of ints (PyTorch's ``torch.Size``).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.ones((2, 3))).shape
    (2, 3)
    """
    return tuple(input.shape)  # type: ignore[attr-defined]


@torch_entry("dtype", bind=("property",), records="stored", opinfo=())
def _dtype_entry(input: TensorOps) -> np.dtype:
    """The element type (a NumPy dtype: ``float32`` where PyTorch says ``torch.float32``).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     s.input(jnp.ones(2)).dtype
    dtype('float32')
    """
    return np.dtype(input.dtype)  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- building and joining tensors


def _promote(tensors: Sequence[Operand]) -> list[Operand]:
    dt = np.dtype(jnp.result_type(*(_dtype_of(t) for t in tensors))) if tensors else None
    return [_cast(t, dt) if _dtype_of(t) != dt else t for t in tensors]


@torch_entry(bind=("tfl",), records="op:concat", aliases=("concat",))
def cat(tensors: Sequence[Operand], dim: int = 0, *, axis: int | None = None) -> Tensor:
    """The tensors joined along ``dim`` (dtypes promoted, as PyTorch).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.cat([s.input(jnp.ones((1, 2))), jnp.zeros((1, 2))], dim=0).shape
    (2, 2)
    """
    d = _alias("cat", dim, 0, axis, ("dim", "axis"))
    if isinstance(tensors, TensorOps) or hasattr(tensors, "shape"):
        raise TypeError("cat: tensors must be a sequence of tensors (a list or tuple), got one tensor")
    ts = list(tensors)
    if not ts:
        raise RuntimeError("cat: expects a non-empty list of tensors")
    n = builtins.max(len(_shape(t)) for t in ts)
    ts = _promote(ts)
    if n > 1:  # PyTorch's legacy rule: an empty 1-d tensor joins tensors of any rank by being skipped
        ts = [t for t in ts if _shape(t) != (0,)]
    return apply("concat", *ts, axis=_dim("cat", d, n))  # type: ignore[arg-type]


concat = cat


@torch_entry(bind=("tfl",), records="ops:expand_dims,concat")
def stack(tensors: Sequence[Operand], dim: int = 0, *, axis: int | None = None) -> Tensor:
    """The tensors (of one shape) joined along a new dimension ``dim``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.stack([s.input(jnp.ones(2)), jnp.zeros(2)], dim=1).shape
    (2, 2)
    """
    d = _alias("stack", dim, 0, axis, ("dim", "axis"))
    if isinstance(tensors, TensorOps) or hasattr(tensors, "shape"):
        raise TypeError("stack: tensors must be a sequence of tensors (a list or tuple), got one tensor")
    ts = list(tensors)
    if not ts:
        raise RuntimeError("stack: expects a non-empty list of tensors")
    shapes = {_shape(t) for t in ts}
    if len(shapes) != 1:
        raise RuntimeError(f"stack: expects tensors of one shape, got {sorted(shapes)}")
    n = len(next(iter(shapes)))
    if not -n - 1 <= d <= n:  # type: ignore[operator]
        raise IndexError(f"stack: dim={d} is out of range for {n + 1} result dimensions")
    a = builtins.int(d) % (n + 1)  # type: ignore[call-overload]
    return apply("concat", *(apply("expand_dims", t, axis=a) for t in _promote(ts)), axis=a)


@torch_entry(bind=("tfl",), records="op:where")
def where(condition: Operand, input: Operand | None = None, other: Operand | None = None) -> Tensor:
    """``input`` where ``condition`` is True, else ``other`` (broadcast; no gradient to ``condition``).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([-1.0, 2.0]))
    ...     tfl.where(x > 0, x, 0.0).tolist()
    [0.0, 2.0]
    """
    if input is None or other is None:
        raise RuntimeError(
            "where(condition) is nonzero(condition): its shape depends on the values, which a tape cannot record; "
            "use tfl.where(condition, input, other), or read the positions with np.nonzero(condition.numpy())"
        )
    return apply("where", condition, *promote((input, other)))


@torch_entry(records="ops:reshape,take")
def take(input: Operand, index: Operand) -> Tensor:
    """The elements of the flattened ``input`` at ``index`` (the result has ``index``'s shape).

    ``tfl.numpy.take(x, idx, axis=0)`` takes along an axis.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.array([[1.0, 2.0], [3.0, 4.0]]))
    ...     tfl.take(x, jnp.array([0, 3])).tolist()
    [1.0, 4.0]
    """
    return apply("take", apply("reshape", input, shape=(-1,)), index, axis=0)


def _new(
    op: str, value: np.ndarray, like: Operand | None, device: object, requires_grad: builtins.bool
) -> Tensor | Array:
    """A new constant: a leaf of ``like``'s session (else the current one), or a plain array with no session."""
    _check_device(op, like, device)  # type: ignore[arg-type]
    s = like.session if isinstance(like, Tensor) else current_session()
    if s is None:
        if requires_grad:
            raise RuntimeError(f"{op}: requires_grad=True needs a session (`with tfl.Session() as s:`)")
        return jax.device_put(value)
    return s.input(value, requires_grad=requires_grad)


def _float_dtype(dtype: DTypeLike | None) -> np.dtype:
    return np.dtype(np.float32) if dtype is None else _as_dtype(dtype)


@torch_entry(bind=("tfl",), records="constant")
def zeros(
    *size: int | Sequence[int],
    dtype: DTypeLike | None = None,
    device: object = None,
    requires_grad: builtins.bool = False,
) -> Tensor | Array:
    """A tensor of zeros, ``zeros(2, 3)`` or ``zeros((2, 3))`` (float32; a leaf of the current session, if any).

    >>> import tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.zeros(2, 3).shape
    (2, 3)
    """
    return _new("zeros", np.zeros(_sizes("zeros", size), _float_dtype(dtype)), None, device, requires_grad)


@torch_entry(bind=("tfl",), records="constant")
def ones(
    *size: int | Sequence[int],
    dtype: DTypeLike | None = None,
    device: object = None,
    requires_grad: builtins.bool = False,
) -> Tensor | Array:
    """A tensor of ones, ``ones(2, 3)`` or ``ones((2, 3))`` (float32; a leaf of the current session, if any).

    >>> import tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.ones(2).tolist()
    [1.0, 1.0]
    """
    return _new("ones", np.ones(_sizes("ones", size), _float_dtype(dtype)), None, device, requires_grad)


def _fill_dtype(fill_value: object) -> np.dtype:
    if isinstance(fill_value, (builtins.bool, np.bool_)):
        return np.dtype(bool)
    if isinstance(fill_value, (builtins.int, np.integer)):
        return _long()
    return np.dtype(np.float32)


@torch_entry(bind=("tfl",), records="constant")
def full(
    size: Sequence[int],
    fill_value: float | builtins.bool,
    *,
    dtype: DTypeLike | None = None,
    device: object = None,
    requires_grad: builtins.bool = False,
) -> Tensor | Array:
    """A tensor of ``fill_value``: bool for a bool, int64 for an int (int32 without x64), else float32.

    >>> import tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.full((2,), True).tolist(), tfl.full((2,), 7).tolist()
    ([True, True], [7, 7])
    """
    dt = _fill_dtype(fill_value) if dtype is None else _as_dtype(dtype)
    return _new("full", np.full(_sizes("full", (size,)), fill_value, dt), None, device, requires_grad)


@torch_entry(bind=("tfl",), records="constant")
def arange(
    start: float,
    end: float | None = None,
    step: float = 1,
    *,
    dtype: DTypeLike | None = None,
    device: object = None,
    requires_grad: builtins.bool = False,
) -> Tensor | Array:
    """``start`` to ``end`` (exclusive) by ``step``: int64 (int32 without x64) unless a bound or step is a float.

    >>> import tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.arange(4).tolist(), tfl.arange(0, 1, 0.5).tolist()
    ([0, 1, 2, 3], [0.0, 0.5])
    """
    lo, hi = (0, start) if end is None else (start, end)
    floats = builtins.any(isinstance(v, builtins.float) for v in (lo, hi, step))
    dt = _as_dtype(dtype) if dtype is not None else (np.dtype(np.float32) if floats else _long())
    return _new("arange", np.arange(lo, hi, step, dtype=dt), None, device, requires_grad)


@torch_entry(bind=("tfl",), records="constant")
def zeros_like(
    input: Operand,
    *,
    dtype: DTypeLike | None = None,
    device: object = None,
    requires_grad: builtins.bool = False,
    memory_format: object = None,
) -> Tensor | Array:
    """Zeros of ``input``'s shape and dtype (a new leaf, no gradient link to ``input``).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.zeros_like(s.input(jnp.ones(2, jnp.int32))).tolist()
    [0, 0]
    """
    dt = _dtype_of(input) if dtype is None else _as_dtype(dtype)
    return _new("zeros_like", np.zeros(_shape(input), dt), input, device, requires_grad)


@torch_entry(bind=("tfl",), records="constant")
def ones_like(
    input: Operand,
    *,
    dtype: DTypeLike | None = None,
    device: object = None,
    requires_grad: builtins.bool = False,
    memory_format: object = None,
) -> Tensor | Array:
    """Ones of ``input``'s shape and dtype (a new leaf, no gradient link to ``input``).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.ones_like(s.input(jnp.zeros(2))).tolist()
    [1.0, 1.0]
    """
    dt = _dtype_of(input) if dtype is None else _as_dtype(dtype)
    return _new("ones_like", np.ones(_shape(input), dt), input, device, requires_grad)
