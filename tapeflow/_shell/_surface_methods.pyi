"""The PyTorch surface's Tensor methods and properties, for type checkers (``TensorOps`` inherits them).

Generated from the surface table by ``python docs/_ext/gen_method_stub.py``; do not edit.
"""

import builtins
import numpy as np

from ._torch_functional import Tensor
from ._torch_tensor import DTypeLike, Dims, Operand, Sequence, TensorOps, ValuesIndices


class SurfaceMethods:
    def relu(self, inplace: builtins.bool = False) -> Tensor:
        """``max(input, 0)`` elementwise (``inplace`` is accepted and ignored: tensors are values)."""
        ...

    def view(self, *shape: builtins.int | Sequence[builtins.int]) -> Tensor:
        """``input`` with a new shape (``-1`` inferred); a tensor has no storage to alias, so this records a reshape."""
        ...

    def reshape(self, *shape: builtins.int | Sequence[builtins.int]) -> Tensor:
        """``input`` with a new shape (``-1`` inferred): ``x.reshape(2, 3)`` or ``tfl.reshape(x, (2, 3))``."""
        ...

    def flatten(self, start_dim: builtins.int = 0, end_dim: builtins.int = -1) -> Tensor:
        """Dimensions ``start_dim`` to ``end_dim`` (inclusive) merged into one; a 0-d tensor becomes shape ``(1,)``."""
        ...

    def unflatten(self, dim: builtins.int, sizes: Sequence[builtins.int]) -> Tensor:
        """Dimension ``dim`` split into ``sizes`` (one of them may be -1)."""
        ...

    def squeeze(self, dim: Dims | None = None, *, axis: Dims | None = None) -> Tensor:
        """``input`` without its size-1 dimensions (those of ``dim`` only; a named dimension of another size stays)."""
        ...

    def unsqueeze(self, dim: builtins.int) -> Tensor:
        """``input`` with a size-1 dimension inserted at ``dim`` (``-1``: last)."""
        ...

    def permute(self, *dims: builtins.int | Sequence[builtins.int]) -> Tensor:
        """The dimensions reordered: result dimension ``i`` is input dimension ``dims[i]``."""
        ...

    def transpose(self, dim0: builtins.int, dim1: builtins.int) -> Tensor:
        """``input`` with dimensions ``dim0`` and ``dim1`` swapped (``tfl.numpy.transpose`` is NumPy's axes permutation)."""
        ...

    def t(self) -> Tensor:
        """A 2-D tensor transposed; a 0-d or 1-d tensor as it is."""
        ...

    @property
    def mT(self) -> Tensor:
        """The last two dimensions swapped (a batch of matrices, each transposed)."""
        ...

    @property
    def T(self) -> Tensor:
        """The dimensions reversed (a matrix transposed)."""
        ...

    def expand(self, *sizes: builtins.int | Sequence[builtins.int]) -> Tensor:
        """``input`` broadcast to ``sizes`` (``-1`` keeps a dimension; new dimensions go in front)."""
        ...

    def expand_as(self, other: Operand) -> Tensor:
        """``input`` broadcast to ``other``'s shape."""
        ...

    def broadcast_to(self, size: Sequence[builtins.int]) -> Tensor:
        """``input`` broadcast to ``size`` (NumPy's rules; ``-1`` keeps a dimension)."""
        ...

    def repeat(self, *sizes: builtins.int | Sequence[builtins.int]) -> Tensor:
        """``input`` tiled ``sizes[i]`` times along dimension ``i`` (extra sizes add leading dimensions), as ``np.tile``."""
        ...

    def repeat_interleave(
        self,
        repeats: builtins.int | Operand,
        dim: builtins.int | None = None,
        *,
        output_size: builtins.int | None = None,
    ) -> Tensor:
        """Each element repeated ``repeats`` times (a number, or one count per element) along ``dim`` (None: flattened)."""
        ...

    def flip(self, dims: Dims) -> Tensor:
        """``input`` reversed along each of ``dims``."""
        ...

    def roll(
        self,
        shifts: builtins.int | Sequence[builtins.int],
        dims: Dims | None = None,
    ) -> Tensor:
        """``input`` shifted cyclically by ``shifts`` along ``dims`` (no dims: the flattened tensor, shape kept)."""
        ...

    def narrow(self, dim: builtins.int, start: builtins.int, length: builtins.int) -> Tensor:
        """``length`` elements of dimension ``dim`` from ``start`` on (a negative start counts from the end)."""
        ...

    def split(
        self,
        split_size_or_sections: builtins.int | Sequence[builtins.int],
        dim: builtins.int = 0,
    ) -> tuple[Tensor, ...]:
        """Pieces of ``split_size_or_sections`` elements along ``dim`` (the last one smaller), or of the listed sizes."""
        ...

    def chunk(self, chunks: builtins.int, dim: builtins.int = 0) -> tuple[Tensor, ...]:
        """At most ``chunks`` pieces of ``ceil(n / chunks)`` elements along ``dim`` (the last one smaller)."""
        ...

    def unbind(self, dim: builtins.int = 0) -> tuple[Tensor, ...]:
        """The slices along ``dim``, each without that dimension."""
        ...

    def gather(
        self,
        dim: builtins.int,
        index: Operand,
        *,
        sparse_grad: builtins.bool = False,
    ) -> Tensor:
        """``out[i][j] = input[index[i][j]][j]`` for ``dim=0`` (and so on): values picked along ``dim`` at ``index``."""
        ...

    def scatter_add(self, dim: builtins.int, index: Operand, src: Operand) -> Tensor:
        """``input`` with ``src[i][j]`` added at ``[index[i][j]][j]`` for ``dim=0`` (and so on); repeats accumulate."""
        ...

    def index_select(self, dim: builtins.int, index: Operand) -> Tensor:
        """The entries at the positions ``index`` (a 1-d integer tensor) along ``dim``."""
        ...

    def masked_fill(self, mask: Operand, value: builtins.float | Operand) -> Tensor:
        """``input`` with ``value`` where the boolean ``mask`` (broadcast to its shape) is True."""
        ...

    def tril(self, diagonal: builtins.int = 0) -> Tensor:
        """The lower triangle of each matrix (the last two dimensions), from ``diagonal`` down; zeros above."""
        ...

    def triu(self, diagonal: builtins.int = 0) -> Tensor:
        """The upper triangle of each matrix (the last two dimensions), from ``diagonal`` up; zeros below."""
        ...

    def diagonal(
        self,
        offset: builtins.int = 0,
        dim1: builtins.int = 0,
        dim2: builtins.int = 1,
    ) -> Tensor:
        """The diagonal of the matrices in dimensions ``dim1`` and ``dim2``, as the last dimension."""
        ...

    def movedim(self, source: Dims, destination: Dims) -> Tensor:
        """Dimensions ``source`` moved to positions ``destination``; the others keep their order."""
        ...

    def contiguous(self, memory_format: object = None) -> TensorOps:
        """``input`` itself: a tensor here is a value with no memory layout to change."""
        ...

    def clone(self, *, memory_format: object = None) -> Tensor:
        """A new tensor with ``input``'s value; gradients flow back to ``input``."""
        ...

    def add(self, other: Operand, *, alpha: builtins.float = 1) -> Tensor:
        """``input + alpha * other``."""
        ...

    def sub(self, other: Operand, *, alpha: builtins.float = 1) -> Tensor:
        """``input - alpha * other``."""
        ...

    def mul(self, other: Operand) -> Tensor:
        """``input * other``, broadcast."""
        ...

    def div(self, other: Operand, *, rounding_mode: str | None = None) -> Tensor:
        """``input / other``: true division (integers give floats), or rounded by ``rounding_mode`` "trunc" / "floor"."""
        ...

    def true_divide(self, other: Operand) -> Tensor:
        """``input / other``, integers divided as floats."""
        ...

    def floor_divide(self, other: Operand) -> Tensor:
        """``input / other`` rounded down (``div(..., rounding_mode="floor")``); no gradient."""
        ...

    def remainder(self, other: Operand) -> Tensor:
        """``input - floor(input / other) * other``: the remainder with the sign of ``other`` (Python's ``%``)."""
        ...

    def pow(self, exponent: Operand) -> Tensor:
        """``input ** exponent`` elementwise."""
        ...

    def neg(self) -> Tensor:
        """``-input``."""
        ...

    def abs(self) -> Tensor:
        """``|input|`` elementwise (gradient ``sign(input)``, 0 at 0)."""
        ...

    def exp(self) -> Tensor:
        """``e ** input`` elementwise."""
        ...

    def log(self) -> Tensor:
        """The natural logarithm elementwise."""
        ...

    def sqrt(self) -> Tensor:
        """The square root elementwise."""
        ...

    def sin(self) -> Tensor:
        """The sine elementwise."""
        ...

    def cos(self) -> Tensor:
        """The cosine elementwise."""
        ...

    def tanh(self) -> Tensor:
        """The hyperbolic tangent elementwise."""
        ...

    def sigmoid(self) -> Tensor:
        """The logistic sigmoid ``1 / (1 + exp(-input))`` elementwise."""
        ...

    def log1p(self) -> Tensor:
        """``log(1 + input)``, accurate near 0."""
        ...

    def expm1(self) -> Tensor:
        """``exp(input) - 1``, accurate near 0."""
        ...

    def rsqrt(self) -> Tensor:
        """``1 / sqrt(input)`` elementwise."""
        ...

    def reciprocal(self) -> Tensor:
        """``1 / input`` elementwise (integers give floats)."""
        ...

    def square(self) -> Tensor:
        """``input * input`` elementwise."""
        ...

    def sign(self) -> Tensor:
        """-1, 0 or 1 by the sign of each element (zero gradient)."""
        ...

    def lerp(self, end: Operand, weight: builtins.float | Operand) -> Tensor:
        """``input + weight * (end - input)``."""
        ...

    def maximum(self, other: Operand) -> Tensor:
        """The larger of ``input`` and ``other`` elementwise (ties share the gradient)."""
        ...

    def minimum(self, other: Operand) -> Tensor:
        """The smaller of ``input`` and ``other`` elementwise (ties share the gradient)."""
        ...

    def eq(self, other: Operand) -> Tensor:
        """``input == other`` elementwise: a boolean tensor (no gradient)."""
        ...

    def ne(self, other: Operand) -> Tensor:
        """``input != other`` elementwise: a boolean tensor (no gradient)."""
        ...

    def lt(self, other: Operand) -> Tensor:
        """``input < other`` elementwise: a boolean tensor (no gradient)."""
        ...

    def le(self, other: Operand) -> Tensor:
        """``input <= other`` elementwise: a boolean tensor (no gradient)."""
        ...

    def gt(self, other: Operand) -> Tensor:
        """``input > other`` elementwise: a boolean tensor (no gradient)."""
        ...

    def ge(self, other: Operand) -> Tensor:
        """``input >= other`` elementwise: a boolean tensor (no gradient)."""
        ...

    def softmax(
        self,
        dim: builtins.int | None = None,
        _stacklevel: builtins.int = 3,
        dtype: DTypeLike | None = None,
        *,
        axis: builtins.int | None = None,
    ) -> Tensor:
        """``exp(input) / sum(exp(input))`` along ``dim`` (computed in ``dtype`` when given)."""
        ...

    def log_softmax(
        self,
        dim: builtins.int | None = None,
        _stacklevel: builtins.int = 3,
        dtype: DTypeLike | None = None,
        *,
        axis: builtins.int | None = None,
    ) -> Tensor:
        """``input - logsumexp(input)`` along ``dim`` (computed in ``dtype`` when given)."""
        ...

    def clamp(
        self,
        min: builtins.float | Operand | None = None,
        max: builtins.float | Operand | None = None,
    ) -> Tensor:
        """``input`` limited to ``[min, max]`` (numbers or tensors; the gradient passes where the bound does not bite)."""
        ...

    def clip(
        self,
        min: builtins.float | Operand | None = None,
        max: builtins.float | Operand | None = None,
    ) -> Tensor:
        """``input`` limited to ``[min, max]`` (numbers or tensors; the gradient passes where the bound does not bite)."""
        ...

    def matmul(self, other: Operand) -> Tensor:
        """The matrix product, batched and broadcast over leading dimensions (1-d operands as vectors)."""
        ...

    def mm(self, mat2: Operand) -> Tensor:
        """The product of two matrices (2-d only; ``matmul`` batches)."""
        ...

    def bmm(self, mat2: Operand) -> Tensor:
        """The products of two batches of matrices (3-d only, equal batch sizes)."""
        ...

    def outer(self, vec2: Operand) -> Tensor:
        """The outer product of two vectors."""
        ...

    def sum(
        self,
        dim: Dims | None = None,
        keepdim: builtins.bool = False,
        *,
        dtype: DTypeLike | None = None,
        axis: Dims | None = None,
        keepdims: builtins.bool | None = None,
    ) -> Tensor:
        """The sum over ``dim`` (all dimensions when None), keeping reduced dimensions with ``keepdim``."""
        ...

    def mean(
        self,
        dim: Dims | None = None,
        keepdim: builtins.bool = False,
        *,
        dtype: DTypeLike | None = None,
        axis: Dims | None = None,
        keepdims: builtins.bool | None = None,
    ) -> Tensor:
        """The mean over ``dim`` (all dimensions when None); integer tensors need a float ``dtype``, as in PyTorch."""
        ...

    def prod(
        self,
        dim: builtins.int | None = None,
        keepdim: builtins.bool = False,
        *,
        dtype: DTypeLike | None = None,
        axis: builtins.int | None = None,
        keepdims: builtins.bool | None = None,
    ) -> Tensor:
        """The product over ``dim`` (all elements when None)."""
        ...

    def max(
        self,
        dim: builtins.int | Operand | None = None,
        keepdim: builtins.bool = False,
        *,
        axis: builtins.int | None = None,
        keepdims: builtins.bool | None = None,
    ) -> Tensor | ValuesIndices:
        """The largest value; with ``dim``, the ``(values, indices)`` pair along it; with a tensor, the elementwise maximum."""
        ...

    def min(
        self,
        dim: builtins.int | Operand | None = None,
        keepdim: builtins.bool = False,
        *,
        axis: builtins.int | None = None,
        keepdims: builtins.bool | None = None,
    ) -> Tensor | ValuesIndices:
        """The smallest value; with ``dim``, the ``(values, indices)`` pair along it; with a tensor, the elementwise minimum."""
        ...

    def amax(
        self,
        dim: Dims = ...,
        keepdim: builtins.bool = False,
        *,
        axis: Dims | None = None,
        keepdims: builtins.bool | None = None,
    ) -> Tensor:
        """The maximum over ``dim`` (``()``: all dimensions); ties share the gradient evenly."""
        ...

    def amin(
        self,
        dim: Dims = ...,
        keepdim: builtins.bool = False,
        *,
        axis: Dims | None = None,
        keepdims: builtins.bool | None = None,
    ) -> Tensor:
        """The minimum over ``dim`` (``()``: all dimensions); ties share the gradient evenly."""
        ...

    def argmax(
        self,
        dim: builtins.int | None = None,
        keepdim: builtins.bool = False,
        *,
        axis: builtins.int | None = None,
        keepdims: builtins.bool | None = None,
    ) -> Tensor:
        """The position of the largest value along ``dim`` (None: in the flattened tensor); the first one of ties."""
        ...

    def argmin(
        self,
        dim: builtins.int | None = None,
        keepdim: builtins.bool = False,
        *,
        axis: builtins.int | None = None,
        keepdims: builtins.bool | None = None,
    ) -> Tensor:
        """The position of the smallest value along ``dim`` (None: in the flattened tensor); the first one of ties."""
        ...

    def var(
        self,
        dim: Dims | None = None,
        unbiased: builtins.bool | None = None,
        keepdim: builtins.bool = False,
        *,
        correction: builtins.float | None = None,
        axis: Dims | None = None,
        keepdims: builtins.bool | None = None,
    ) -> Tensor:
        """The variance over ``dim``, divided by ``N - correction`` (PyTorch's default ``correction=1``, unbiased)."""
        ...

    def std(
        self,
        dim: Dims | None = None,
        unbiased: builtins.bool | None = None,
        keepdim: builtins.bool = False,
        *,
        correction: builtins.float | None = None,
        axis: Dims | None = None,
        keepdims: builtins.bool | None = None,
    ) -> Tensor:
        """The standard deviation: the square root of :func:`var` (unbiased by default, as PyTorch)."""
        ...

    def logsumexp(
        self,
        dim: Dims | None = None,
        keepdim: builtins.bool = False,
        *,
        axis: Dims | None = None,
        keepdims: builtins.bool | None = None,
    ) -> Tensor:
        """``log(sum(exp(input)))`` over ``dim``, computed stably."""
        ...

    def cumsum(
        self,
        dim: builtins.int,
        *,
        dtype: DTypeLike | None = None,
        axis: builtins.int | None = None,
    ) -> Tensor:
        """The running sum along ``dim``."""
        ...

    def norm(
        self,
        p: builtins.float | str | None = "fro",
        dim: Dims | None = None,
        keepdim: builtins.bool = False,
        dtype: DTypeLike | None = None,
    ) -> Tensor:
        """The vector ``p``-norm over ``dim`` (all elements when None); ``"fro"`` is the 2-norm, ``"nuc"`` the nuclear."""
        ...

    def all(self, dim: Dims | None = None, keepdim: builtins.bool = False) -> Tensor:
        """Whether every element (along ``dim``) is nonzero: a boolean tensor."""
        ...

    def any(self, dim: Dims | None = None, keepdim: builtins.bool = False) -> Tensor:
        """Whether some element (along ``dim``) is nonzero: a boolean tensor."""
        ...

    def sort(
        self,
        dim: builtins.int = -1,
        descending: builtins.bool = False,
        *,
        stable: builtins.bool = False,
    ) -> ValuesIndices:
        """``(values, indices)``: the elements along ``dim`` in order (ties keep their order); gradients follow them."""
        ...

    def topk(
        self,
        k: builtins.int,
        dim: builtins.int = -1,
        largest: builtins.bool = True,
        sorted: builtins.bool = True,
    ) -> ValuesIndices:
        """``(values, indices)`` of the ``k`` largest (or smallest) elements along ``dim``, in order."""
        ...

    def float(self, memory_format: object = None) -> Operand:
        """``input`` as float32 (the tensor itself when it has that dtype already)."""
        ...

    def double(self, memory_format: object = None) -> Operand:
        """``input`` as float32 (PyTorch: float64, the tensor itself when it has that dtype already)."""
        ...

    def half(self, memory_format: object = None) -> Operand:
        """``input`` as float16 (the tensor itself when it has that dtype already)."""
        ...

    def bfloat16(self, memory_format: object = None) -> Operand:
        """``input`` as bfloat16 (the tensor itself when it has that dtype already)."""
        ...

    def long(self, memory_format: object = None) -> Operand:
        """``input`` as int32 (PyTorch: int64, the tensor itself when it has that dtype already)."""
        ...

    def int(self, memory_format: object = None) -> Operand:
        """``input`` as int32 (the tensor itself when it has that dtype already)."""
        ...

    def bool(self, memory_format: object = None) -> Operand:
        """``input`` as bool (the tensor itself when it has that dtype already)."""
        ...

    def to(self, *args: object, **kwargs: object) -> Operand:
        """``to(dtype)``, ``to(other)`` (its dtype), ``to(device)`` or ``to(device, dtype)``: a cast; devices must be the session's."""
        ...

    def type_as(self, other: TensorOps) -> Operand:
        """``input`` cast to ``other``'s dtype."""
        ...

    def cpu(self, memory_format: object = None) -> TensorOps:
        """``input`` itself: a session holds its values on its device, and ``numpy()`` / ``item()`` read them to the host."""
        ...

    def detach(self) -> Tensor:
        """A new leaf holding this value, cut off from the recording's gradients."""
        ...

    def item(self) -> builtins.int | builtins.float | builtins.bool:
        """The value of a one-element tensor as a Python number (read: a lazy session computes it)."""
        ...

    def tolist(self) -> object:
        """The value as nested Python lists (a number for a 0-d tensor)."""
        ...

    def numpy(self, *, force: builtins.bool = False) -> np.ndarray:
        """The value as a NumPy array on the host."""
        ...

    def size(self, dim: builtins.int | None = None) -> tuple[builtins.int, ...] | builtins.int:
        """The shape (a tuple), or the size of dimension ``dim``."""
        ...

    def dim(self) -> builtins.int:
        """The number of dimensions."""
        ...

    def numel(self) -> builtins.int:
        """The number of elements."""
        ...

    @property
    def ndim(self) -> builtins.int:
        """The number of dimensions."""
        ...

    def take(self, index: Operand) -> Tensor:
        """The elements of the flattened ``input`` at ``index`` (the result has ``index``'s shape)."""
        ...
