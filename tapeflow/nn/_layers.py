"""Layers: Linear, Embedding (+ tied output), LayerNorm, Dropout, Conv2d,
MultiHeadAttention, Sequential and MLP.

Every initializer takes an explicit ``key`` (a ``jax.random`` key), so
construction is reproducible; ``dtype`` defaults to float32. Forward code
only records tapeflow ops on the current (or the operands') session.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import ArrayLike

from .._core._checks import int_pair, is_int
from .._core._registry import Padding, Pair
from .._core._result import TapeError
from .._core._typing import Array, DTypeLike, PRNGKey
from .._shell import _functions as F
from .._shell._params import Param, tie
from .._shell._tensor import Operand, Tensor
from . import _init as init
from ._module import Module, members

__all__ = [
    "MLP",
    "Conv2d",
    "Dropout",
    "Embedding",
    "LayerNorm",
    "Linear",
    "MultiHeadAttention",
    "Sequential",
    "TiedLinear",
]


def _uniform(key: PRNGKey, shape: tuple[int, ...], bound: float, dtype: DTypeLike) -> Array:
    return init.uniform(key, shape, dtype, -bound, bound)


class Linear(Module):
    """``y = x @ weight + bias`` with ``weight`` of shape ``(in_features, out_features)``.

    Initialized as PyTorch does: weight and bias uniform in ``±1/sqrt(in_features)``.

    >>> import jax, jax.numpy as jnp, tapeflow as tfl
    >>> lin = tfl.nn.Linear(3, 2, key=jax.random.key(0))
    >>> lin.weight.shape, lin.bias.shape
    ((3, 2), (2,))
    >>> with tfl.Session() as s:
    ...     lin(s.input(jnp.ones((5, 3)))).shape
    (5, 2)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        key: PRNGKey | None = None,
        bias: bool = True,
        dtype: DTypeLike = jnp.float32,
    ) -> None:
        key = init.require_key(key, "Linear")
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        kw, kb = init.keys(key, 2)
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
        self.weight = Param(_uniform(kw, (self.in_features, self.out_features), bound, dtype), name="weight")
        self.bias = Param(_uniform(kb, (self.out_features,), bound, dtype), name="bias") if bias else None

    def forward(self, x: Operand) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class TiedLinear(Module):
    """Output projection ``h @ weight.T`` whose ``weight`` is a :func:`tfl.tie` d record.

    Made by :meth:`Embedding.tied_output`: the projection reuses the
    embedding's storage, so the gradient of the shared storage is the sum of
    both uses and an optimizer keeps one slot for it.

    >>> import jax, jax.numpy as jnp, tapeflow as tfl
    >>> emb = tfl.nn.Embedding(10, 4, key=jax.random.key(0))
    >>> out = emb.tied_output()
    >>> out.weight.storage is emb.weight.storage
    True
    >>> with tfl.Session() as s:
    ...     out(emb(jnp.array([1, 2]))).shape
    (2, 10)
    """

    def __init__(self, weight: Param) -> None:
        if not isinstance(weight, Param):
            raise TypeError(f"TiedLinear expects a Param, got {type(weight).__name__}")
        self.weight = weight

    def forward(self, h: Operand) -> Tensor:
        return F.matmul(h, F.transpose(self.weight))

    def extra_repr(self) -> str:
        n, d = self.weight.shape
        return f"in_features={d}, out_features={n}, tied"


class Embedding(Module):
    """Lookup table ``weight[ids]`` with ``weight`` of shape ``(num_embeddings, dim)``.

    ``ids`` is an integer Tensor or array of any shape; the result has shape
    ``ids.shape + (dim,)``. Initialized ``N(0, std**2)`` (``std=1`` as PyTorch).
    :meth:`attend` projects hidden states back onto the vocabulary with the
    same record; :meth:`tied_output` returns a :class:`TiedLinear` module
    holding a :func:`tfl.tie` d record of the weight.

    >>> import jax, jax.numpy as jnp, tapeflow as tfl
    >>> emb = tfl.nn.Embedding(10, 4, key=jax.random.key(0))
    >>> with tfl.Session() as s:
    ...     h = emb(jnp.array([[1, 2, 3]]))
    ...     h.shape, emb.attend(h).shape
    ((1, 3, 4), (1, 3, 10))
    """

    def __init__(
        self,
        num_embeddings: int,
        dim: int,
        *,
        key: PRNGKey | None = None,
        std: float = 1.0,
        dtype: DTypeLike = jnp.float32,
    ) -> None:
        key = init.require_key(key, "Embedding")
        self.num_embeddings = int(num_embeddings)
        self.dim = int(dim)
        w = init.normal(key, (self.num_embeddings, self.dim), dtype)
        if np.dtype(dtype) == np.float32:  # scaled on the host: one float32 rounding, as on a device, no compile
            w = jax.device_put(np.asarray(w) * np.float32(std))
        else:
            w = w * jnp.asarray(std, dtype)
        self.weight = Param(w, name="weight")

    def forward(self, ids: Operand) -> Tensor:
        if isinstance(ids, (np.ndarray, list)) and np.size(ids) and int(np.min(ids)) < 0:  # host ids: no device wait
            raise TapeError(
                f"Embedding: ids hold {int(np.min(ids))}; an id is a row number from 0 to {self.num_embeddings - 1} "
                "(negative ids are errors, as in PyTorch); nothing was recorded"
            )
        return F.take(self.weight, ids, axis=0)

    def attend(self, h: Operand) -> Tensor:
        """``h @ weight.T``: logits over the table's rows."""
        return F.matmul(h, F.transpose(self.weight))

    def tied_output(self, name: str | None = None) -> TiedLinear:
        """A :class:`TiedLinear` whose weight is ``tfl.tie(self.weight, name=name)``."""
        base = self.weight.name or "weight"
        return TiedLinear(tie(self.weight, name=name if name is not None else f"{base}.tied"))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.dim}"


class LayerNorm(Module):
    """Layer normalization over the trailing ``shape`` with affine ``weight`` (ones) and ``bias`` (zeros).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> ln = tfl.nn.LayerNorm(4)
    >>> with tfl.Session() as s:
    ...     y = ln(s.input(jnp.arange(8.0).reshape(2, 4)))
    ...     [round(v, 3) for v in y.value[0].tolist()]
    [-1.342, -0.447, 0.447, 1.342]
    """

    def __init__(
        self,
        shape: int | Sequence[int],
        eps: float = 1e-5,
        *,
        elementwise_affine: bool = True,
        bias: bool = True,
        dtype: DTypeLike = jnp.float32,
    ) -> None:
        self.shape = (int(cast(int, shape)),) if is_int(shape) else tuple(int(d) for d in cast(Sequence[int], shape))
        self.eps = float(eps)
        # host ones and zeros: jnp.ones would compile a program per shape
        self.weight: Param | None = Param(np.ones(self.shape, dtype), name="weight") if elementwise_affine else None
        has_bias = elementwise_affine and bias  # bias=False: PyTorch's LayerNorm(..., bias=False), a weight only
        self.bias: Param | None = Param(np.zeros(self.shape, dtype), name="bias") if has_bias else None

    def forward(self, x: Operand) -> Tensor:
        axis = tuple(range(-len(self.shape), 0))
        return F.layer_norm(x, self.weight, self.bias, axis=axis if len(axis) > 1 else -1, eps=self.eps)

    def extra_repr(self) -> str:
        return f"{self.shape}, eps={self.eps}"


class Dropout(Module):
    """Inverted dropout with probability ``rate`` (see :func:`tfl.dropout`).

    Active in train mode (:meth:`Module.train`, the default) in a training
    session; the identity in eval mode (:meth:`Module.eval`), in an inference
    session (``grad_enabled=False``), or when called with ``training=False``
    (``training=True`` forces it on). The mask comes from the session's seeded RNG.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> drop = tfl.nn.Dropout(0.5)
    >>> with tfl.Session(grad_enabled=False) as s:
    ...     drop(s.input(jnp.ones(4))).value.tolist()
    [1.0, 1.0, 1.0, 1.0]
    >>> with tfl.Session() as s:
    ...     drop.eval()(s.input(jnp.ones(4))).value.tolist()
    [1.0, 1.0, 1.0, 1.0]
    """

    def __init__(self, rate: float) -> None:
        if not 0.0 <= float(rate) < 1.0:
            raise ValueError(f"Dropout: rate must be in [0, 1), got {rate}")
        self.rate = float(rate)

    def forward(self, x: Tensor, training: bool | None = None) -> Tensor:
        if training is None and not self.training:
            training = False  # eval mode; in train mode (None) the session decides, as for tfl.dropout
        return F.dropout(x, self.rate, training=training)

    def extra_repr(self) -> str:
        return f"rate={self.rate}"


class Conv2d(Module):
    """2-D convolution over NCHW input with an OIHW ``weight`` and optional ``bias`` (out_ch,).

    Initialized as PyTorch does: uniform in ``±1/sqrt(in_ch * kh * kw)``.
    ``padding`` is an int, a pair, or a string accepted by :func:`tfl.conv2d`.

    >>> import jax, jax.numpy as jnp, tapeflow as tfl
    >>> conv = tfl.nn.Conv2d(3, 8, 3, key=jax.random.key(0), padding=1)
    >>> conv.weight.shape
    (8, 3, 3, 3)
    >>> with tfl.Session() as s:
    ...     conv(s.input(jnp.ones((2, 3, 5, 5)))).shape
    (2, 8, 5, 5)
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        *,
        key: PRNGKey | None = None,
        stride: Pair = 1,
        padding: Padding = 0,
        dilation: Pair = 1,
        bias: bool = True,
        dtype: DTypeLike = jnp.float32,
    ) -> None:
        key = init.require_key(key, "Conv2d")
        self.in_channels = int(in_channels)
        self.out_channels = int(out_channels)
        k = int_pair(kernel_size)
        if k is None or min(k) < 1:
            raise ValueError(f"Conv2d: kernel_size={kernel_size!r} must be a positive int or a pair of them")
        self.kernel_size = k
        self.stride = stride
        self.padding = padding
        self.dilation = dilation
        kh, kw = self.kernel_size
        fan_in = self.in_channels * kh * kw
        bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        k1, k2 = init.keys(key, 2)
        self.weight = Param(_uniform(k1, (self.out_channels, self.in_channels, kh, kw), bound, dtype), name="weight")
        self.bias = Param(_uniform(k2, (self.out_channels,), bound, dtype), name="bias") if bias else None

    def forward(self, x: Operand) -> Tensor:
        return F.conv2d(x, self.weight, self.bias, stride=self.stride, padding=self.padding, dilation=self.dilation)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, bias={self.bias is not None}"
        )


class MultiHeadAttention(Module):
    """Multi-head scaled dot-product attention with q/k/v/out :class:`Linear` projections.

    ``forward(x, context=None, mask=None)``: ``x`` is ``(..., Lq, dim)``;
    keys and values come from ``context`` (``(..., Lk, dim)``, default ``x``).
    ``mask`` is boolean (True = attend) and broadcastable to
    ``(..., num_heads, Lq, Lk)``; a mask with as many dimensions as ``x``
    (``(..., Lq, Lk)``) is applied to every head. ``causal=True`` adds the
    top-left aligned causal mask. ``dropout=p`` drops attention weights with
    probability ``p`` in train mode (see :func:`tfl.attention`), as
    ``torch.nn.MultiheadAttention(dropout=p)``; eval mode turns it off.

    >>> import jax, jax.numpy as jnp, tapeflow as tfl
    >>> key = jax.random.key(0)
    >>> mha = tfl.nn.MultiHeadAttention(8, 2, key=key, causal=True, dropout=0.1)
    >>> with tfl.Session() as s:
    ...     mha(s.input(jnp.ones((3, 5, 8)))).shape
    (3, 5, 8)
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        key: PRNGKey | None = None,
        causal: bool = False,
        bias: bool = True,
        dropout: float = 0.0,
        dtype: DTypeLike = jnp.float32,
    ) -> None:
        key = init.require_key(key, "MultiHeadAttention")
        if dim % num_heads:
            raise ValueError(f"MultiHeadAttention: dim={dim} is not divisible by num_heads={num_heads}")
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"MultiHeadAttention: dropout must be in [0, 1), got {dropout}")
        self.dropout = float(dropout)
        self.dim = int(dim)
        self.num_heads = int(num_heads)
        self.head_dim = self.dim // self.num_heads
        self.causal = bool(causal)
        kq, kk, kv, ko = init.keys(key, 4)
        self.q_proj = Linear(dim, dim, key=kq, bias=bias, dtype=dtype)
        self.k_proj = Linear(dim, dim, key=kk, bias=bias, dtype=dtype)
        self.v_proj = Linear(dim, dim, key=kv, bias=bias, dtype=dtype)
        self.out_proj = Linear(dim, dim, key=ko, bias=bias, dtype=dtype)

    def _heads(self, t: Tensor) -> Tensor:
        lead, n = t.shape[:-2], t.shape[-2]
        t = F.reshape(t, lead + (n, self.num_heads, self.head_dim))
        b = len(lead)
        return F.permute(t, tuple(range(b)) + (b + 1, b, b + 2))

    def forward(self, x: Operand, context: Operand | None = None, mask: Tensor | ArrayLike | None = None) -> Tensor:
        kv_in = x if context is None else context
        xq = self.q_proj(x)  # the rank of x
        q = self._heads(xq)
        k = self._heads(self.k_proj(kv_in))
        v = self._heads(self.v_proj(kv_in))
        if mask is not None and len(np.shape(mask)) == xq.ndim and xq.ndim >= 3:
            mask = F.expand_dims(mask, -3) if isinstance(mask, Tensor) else jnp.expand_dims(jnp.asarray(mask), -3)
        if self.dropout:  # the train/eval mode is read (and keys compiled programs) only when it matters
            o = F.attention(
                q, k, v, mask, causal=self.causal, dropout=self.dropout, training=None if self.training else False
            )
        else:
            o = F.attention(q, k, v, mask, causal=self.causal)  # (..., H, Lq, Dh)
        b = o.ndim - 3
        o = F.permute(o, tuple(range(b)) + (b + 1, b, b + 2))
        o = F.reshape(o, o.shape[:-2] + (self.dim,))
        return self.out_proj(o)

    def extra_repr(self) -> str:
        drop = f", dropout={self.dropout}" if self.dropout else ""
        return f"dim={self.dim}, num_heads={self.num_heads}, causal={self.causal}{drop}"


class Sequential(Module):
    """Apply modules (or plain callables such as ``tfl.relu``) in order.

    Its entries are named ``0``, ``1``, ... everywhere, as in
    ``torch.nn.Sequential``: in the repr, in :meth:`named_parameters`
    (``0.weight``) and in PyTorch state dicts (Flax's layout adds ``layers.``,
    as ``nnx.Sequential`` does). The entries are stored in ``layers``; a module
    passed twice is one set of parameters.

    >>> import jax, jax.numpy as jnp, tapeflow as tfl
    >>> k1, k2 = jax.random.split(jax.random.key(0))
    >>> net = tfl.nn.Sequential(
    ...     tfl.nn.Linear(3, 4, key=k1), tfl.relu, tfl.nn.Linear(4, 1, key=k2)
    ... )
    >>> [n for n, _ in net.named_parameters()]
    ['0.weight', '0.bias', '2.weight', '2.bias']
    >>> with tfl.Session() as s:
    ...     net(s.input(jnp.ones((2, 3)))).shape
    (2, 1)
    """

    def __init__(self, *modules: Callable[..., Operand]) -> None:
        for i, m in enumerate(modules):
            if not callable(m):
                raise TypeError(f"Sequential: entry {i} ({type(m).__name__}) is not callable")
        self.layers = list(modules)

    def forward(self, x: Operand) -> Operand:
        for m in self.layers:
            x = m(x)
        return x

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[Callable[..., Operand]]:
        return iter(self.layers)

    def __getitem__(self, i: int) -> Callable[..., Operand]:
        return self.layers[i]

    def named_members(self) -> Iterator[tuple[str, Param | Module]]:
        for i, m in enumerate(self.layers):
            yield from members(m, str(i))

    def _repr_children(self) -> list[tuple[str, object]]:
        return [(str(i), m) for i, m in enumerate(self.layers)]


class MLP(Module):
    """Stack of :class:`Linear` layers of widths ``sizes`` with ``activation`` between them (not after the last).

    >>> import jax, jax.numpy as jnp, tapeflow as tfl
    >>> mlp = tfl.nn.MLP([3, 16, 2], key=jax.random.key(0))
    >>> [tuple(p.shape) for p in mlp.parameters()]
    [(3, 16), (16,), (16, 2), (2,)]
    >>> with tfl.Session() as s:
    ...     mlp(s.input(jnp.ones((4, 3)))).shape
    (4, 2)
    """

    def __init__(
        self,
        sizes: Sequence[int],
        *,
        key: PRNGKey | None = None,
        activation: Callable[[Tensor], Tensor] = F.relu,
        bias: bool = True,
        dtype: DTypeLike = jnp.float32,
    ) -> None:
        key = init.require_key(key, "MLP")
        sizes = [int(s) for s in sizes]
        if len(sizes) < 2:
            raise ValueError(f"MLP: sizes needs at least an input and an output width, got {sizes}")
        keys = init.keys(key, len(sizes) - 1)
        self.activation = activation
        self.layers = [Linear(a, b, key=k, bias=bias, dtype=dtype) for a, b, k in zip(sizes[:-1], sizes[1:], keys)]

    def forward(self, x: Operand) -> Tensor:
        h: Tensor = self.layers[0](x)
        for layer in self.layers[1:]:
            h = layer(self.activation(h))
        return h

    def extra_repr(self) -> str:
        act = getattr(self.activation, "__name__", repr(self.activation))
        sizes = [self.layers[0].in_features] + [lyr.out_features for lyr in self.layers]
        return f"sizes={sizes}, activation={act}"
