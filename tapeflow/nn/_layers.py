"""Layers: Linear, Embedding (+ tied output), Dropout, Identity, Flatten, Unflatten, MultiHeadAttention and MLP.

Constructors take PyTorch's arguments; ``key=`` (a ``jax.random`` key) is an
optional keyword, and without it a layer draws the next key of the default seed
stream (:func:`tfl.nn.init.manual_seed <tapeflow.nn.init.manual_seed>`).
Forward code only records tapeflow ops on the current (or the operands') session.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import ArrayLike

from .._core._result import TapeError
from .._core._typing import DTypeLike, PRNGKey
from .._shell import _functions as R
from .._shell._params import Param, tie
from .._shell._surface import torch_entry
from .._shell._tensor import Operand, Tensor, operand_shape
from . import _init as init
from . import functional as F
from ._module import Module, factory_dtype

__all__ = [
    "MLP",
    "Dropout",
    "Embedding",
    "Flatten",
    "Identity",
    "Linear",
    "MultiHeadAttention",
    "TiedLinear",
    "Unflatten",
]


def uniform_param(key: PRNGKey, shape: tuple[int, ...], bound: float, dtype: DTypeLike, name: str) -> Param:
    """A Param uniform in ``±bound`` (PyTorch's default init of linear and convolution layers)."""
    return Param(init.uniform(key, shape, dtype, -bound, bound), name=name)


def fan_in_bound(fan_in: int) -> float:
    """``1 / sqrt(fan_in)``: PyTorch's ``kaiming_uniform_(a=sqrt(5))`` bound (and its bias bound); 0 when empty."""
    return 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0


@torch_entry(bind=("nn",), records="module", opinfo=())
class Linear(Module):
    """``y = x @ weight.T + bias`` with ``weight`` of shape ``(out_features, in_features)``, as ``torch.nn.Linear``.

    Initialized as PyTorch does: weight and bias uniform in ``±1/sqrt(in_features)``
    (values drawn from JAX's generator, so not PyTorch's numbers).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> lin = tfl.nn.Linear(3, 2)
    >>> lin.weight.shape, lin.bias.shape
    ((2, 3), (2,))
    >>> with tfl.Session() as s:
    ...     lin(s.input(jnp.ones((5, 3)))).shape
    (5, 2)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: object = None,
        dtype: DTypeLike | None = None,
        *,
        key: PRNGKey | None = None,
    ) -> None:
        dt = factory_dtype(device, dtype, "Linear")
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        if self.in_features < 0 or self.out_features < 0:
            raise ValueError(f"Linear: in_features={in_features} and out_features={out_features} must be >= 0")
        kw, kb = init.keys(init.require_key(key, "Linear"), 2)
        bound = fan_in_bound(self.in_features)
        self.weight = uniform_param(kw, (self.out_features, self.in_features), bound, dt, "weight")
        self.bias = uniform_param(kb, (self.out_features,), bound, dt, "bias") if bias else None

    def forward(self, input: Operand) -> Tensor:
        return F.linear(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class TiedLinear(Module):
    """Output projection ``h @ weight.T`` whose ``weight`` is a :func:`tfl.tie` d record.

    Made by :meth:`Embedding.tied_output`: the projection reuses the
    embedding's storage, so the gradient of the shared storage is the sum of
    both uses and an optimizer keeps one slot for it. Its weight is
    ``(out_features, in_features)`` as a :class:`Linear` without bias.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> emb = tfl.nn.Embedding(10, 4)
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
        return F.linear(h, self.weight)

    def extra_repr(self) -> str:
        n, d = self.weight.shape
        return f"in_features={d}, out_features={n}, tied"


@torch_entry(bind=("nn",), records="module", opinfo=())
class Embedding(Module):
    """Lookup table ``weight[input]`` with ``weight`` of shape ``(num_embeddings, embedding_dim)``, as ``torch.nn.Embedding``.

    ``input`` is an integer Tensor or array of any shape; the result has shape
    ``input.shape + (embedding_dim,)``. Initialized ``N(0, std**2)`` (``std=1``
    as PyTorch); with ``padding_idx`` that row starts at zero and gets no
    gradient. :meth:`attend` projects hidden states back onto the vocabulary
    with the same record; :meth:`tied_output` returns a :class:`TiedLinear`
    module holding a :func:`tfl.tie` d record of the weight.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> emb = tfl.nn.Embedding(10, 4, padding_idx=0)
    >>> emb.weight.value[0].tolist()
    [0.0, 0.0, 0.0, 0.0]
    >>> with tfl.Session() as s:
    ...     h = emb(jnp.array([[1, 2, 3]]))
    ...     h.shape, emb.attend(h).shape
    ((1, 3, 4), (1, 3, 10))
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: ArrayLike | None = None,
        _freeze: bool = False,
        device: object = None,
        dtype: DTypeLike | None = None,
        *,
        key: PRNGKey | None = None,
        std: float = 1.0,
    ) -> None:
        dt = factory_dtype(device, dtype, "Embedding")
        for flag, value, default in (
            ("max_norm", max_norm, None),
            ("scale_grad_by_freq", scale_grad_by_freq, False),
            ("sparse", sparse, False),
        ):
            if value != default:
                raise ValueError(f"Embedding: {flag}={value!r} is not supported; pass {flag}={default!r}")
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        if padding_idx is not None:
            padding_idx = int(padding_idx)
            if not -self.num_embeddings <= padding_idx < self.num_embeddings:
                raise ValueError(
                    f"Embedding: padding_idx={padding_idx} must be within num_embeddings={self.num_embeddings}"
                )
            padding_idx %= self.num_embeddings  # PyTorch keeps a negative index as its positive row
        self.padding_idx = padding_idx
        shape = (self.num_embeddings, self.embedding_dim)
        if _weight is not None:
            w = np.asarray(_weight, dt)
            if w.shape != shape:
                raise ValueError(f"Embedding: _weight has shape {w.shape}, expected {shape}")
        else:
            draw = init.normal(init.require_key(key, "Embedding"), shape, dt)
            w = np.array(draw, dtype=dt) * np.asarray(std, dt)  # scaled on the host: no compile per shape
            if padding_idx is not None:
                w[padding_idx] = 0
        self.weight = Param(jax.device_put(w), name="weight", trainable=not _freeze)

    @property
    def dim(self) -> int:
        """``embedding_dim`` (tapeflow's earlier name for it)."""
        return self.embedding_dim

    def forward(self, input: Operand) -> Tensor:
        if isinstance(input, (np.ndarray, list)) and np.size(input) and int(np.min(input)) < 0:  # host ids: no wait
            raise TapeError(
                f"Embedding: input holds {int(np.min(input))}; an index is a row number from 0 to "
                f"{self.num_embeddings - 1} (negative indices are errors, as in PyTorch); nothing was recorded"
            )
        return F.embedding(input, self.weight, self.padding_idx)

    def attend(self, h: Operand) -> Tensor:
        """``h @ weight.T``: logits over the table's rows."""
        return F.linear(h, self.weight)

    def tied_output(self, name: str | None = None) -> TiedLinear:
        """A :class:`TiedLinear` whose weight is ``tfl.tie(self.weight, name=name)``."""
        base = self.weight.name or "weight"
        return TiedLinear(tie(self.weight, name=name if name is not None else f"{base}.tied"))

    def extra_repr(self) -> str:
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}"


@torch_entry(bind=("nn",), records="module", opinfo=())
class Dropout(Module):
    """Inverted dropout with probability ``p`` (default 0.5), as ``torch.nn.Dropout``.

    Active in train mode (:meth:`Module.train`, the default) in a training
    session; the identity in eval mode (:meth:`Module.eval`), in an inference
    session (``grad_enabled=False``), or when called with ``training=False``
    (``training=True`` forces it on). The mask comes from the session's seeded RNG.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> drop = tfl.nn.Dropout()
    >>> drop.p
    0.5
    >>> with tfl.Session() as s:
    ...     drop.eval()(s.input(jnp.ones(4))).tolist()
    [1.0, 1.0, 1.0, 1.0]
    """

    def __init__(self, p: float = 0.5, inplace: bool = False) -> None:
        if not 0.0 <= float(p) <= 1.0:
            raise ValueError(f"Dropout: p must be in [0, 1], got {p}")
        self.p = float(p)
        self.inplace = bool(inplace)

    def forward(self, input: Tensor, training: bool | None = None) -> Tensor:
        if training is None and not self.training:
            training = False  # eval mode; in train mode (None) the session decides, as for tfl.dropout
        if self.p == 1.0 and training is not False:
            return input * 0.0  # PyTorch's p=1: every entry dropped
        return R.dropout(input, self.p, training=training)

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}"


@torch_entry(bind=("nn",), records="module", opinfo=())
class Identity(Module):
    """Returns its input unchanged (constructor arguments are accepted and ignored), as ``torch.nn.Identity``.

    >>> import tapeflow as tfl
    >>> tfl.nn.Identity(54, unused="x")(3)
    3
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def forward(self, input: Operand) -> Operand:
        return input


@torch_entry(bind=("nn",), records="module", opinfo=())
class Flatten(Module):
    """``input.flatten(start_dim, end_dim)`` (defaults ``1`` and ``-1``: keep the batch dimension), as ``torch.nn.Flatten``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.nn.Flatten()(s.input(jnp.ones((2, 3, 4, 5)))).shape
    (2, 60)
    """

    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        self.start_dim = int(start_dim)
        self.end_dim = int(end_dim)

    def forward(self, input: Operand) -> Tensor:
        shape = operand_shape(input)
        n = max(len(shape), 1)
        lo, hi = self.start_dim % n, self.end_dim % n
        if not (-n <= self.start_dim < n and -n <= self.end_dim < n) or lo > hi:
            raise TapeError(
                f"Flatten: start_dim={self.start_dim}, end_dim={self.end_dim} do not fit an input of shape {shape}"
            )
        if not shape:
            return R.reshape(input, (1,))
        return R.reshape(input, shape[:lo] + (math.prod(shape[lo : hi + 1]),) + shape[hi + 1 :])

    def extra_repr(self) -> str:
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"


@torch_entry(bind=("nn",), records="module", opinfo=())
class Unflatten(Module):
    """Split dimension ``dim`` into ``unflattened_size``, as ``torch.nn.Unflatten``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.nn.Unflatten(1, (2, 5))(s.input(jnp.ones((3, 10)))).shape
    (3, 2, 5)
    """

    def __init__(self, dim: int, unflattened_size: Sequence[int]) -> None:
        self.dim = int(dim)
        self.unflattened_size = tuple(int(d) for d in unflattened_size)

    def forward(self, input: Operand) -> Tensor:
        shape = operand_shape(input)
        if not -len(shape) <= self.dim < len(shape):
            raise TapeError(f"Unflatten: dim={self.dim} is out of range for an input of shape {shape}")
        d = self.dim % len(shape)
        sizes = list(self.unflattened_size)
        if sizes.count(-1) == 1:
            known = math.prod(v for v in sizes if v != -1)
            sizes[sizes.index(-1)] = shape[d] // known if known else 0
        if math.prod(sizes) != shape[d]:
            raise TapeError(
                f"Unflatten: unflattened_size={self.unflattened_size} does not multiply to {shape[d]}, "
                f"dimension {self.dim} of the input of shape {shape}"
            )
        return R.reshape(input, shape[:d] + tuple(sizes) + shape[d + 1 :])

    def extra_repr(self) -> str:
        return f"dim={self.dim}, unflattened_size={self.unflattened_size}"


class MultiHeadAttention(Module):
    """tapeflow's self/cross attention block: separate q/k/v/out :class:`Linear` projections, ``forward(x, context, mask)``.

    For PyTorch's signature, state-dict keys and ``(output, weights)`` return,
    use :class:`~tapeflow.nn.MultiheadAttention`. This block keeps tapeflow's
    call: ``forward(x, context=None, mask=None)`` with ``x`` of shape
    ``(..., Lq, dim)``; keys and values come from ``context`` (``(..., Lk, dim)``,
    default ``x``). ``mask`` is boolean (True = attend) and broadcastable to
    ``(..., num_heads, Lq, Lk)``; a mask with as many dimensions as ``x``
    (``(..., Lq, Lk)``) is applied to every head. ``causal=True`` adds the
    top-left aligned causal mask. ``dropout=p`` drops attention weights with
    probability ``p`` in train mode (see :func:`tfl.attention`). Its PyTorch
    state dict is ``torch.nn.MultiheadAttention``'s (q, k, v weights stacked into
    ``in_proj_weight``).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> mha = tfl.nn.MultiHeadAttention(8, 2, causal=True, dropout=0.1)
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
        dtype: DTypeLike | None = None,
    ) -> None:
        if dim % num_heads:
            raise ValueError(f"MultiHeadAttention: dim={dim} is not divisible by num_heads={num_heads}")
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"MultiHeadAttention: dropout must be in [0, 1), got {dropout}")
        self.dropout = float(dropout)
        self.dim = int(dim)
        self.num_heads = int(num_heads)
        self.head_dim = self.dim // self.num_heads
        self.causal = bool(causal)
        kq, kk, kv, ko = init.keys(init.require_key(key, "MultiHeadAttention"), 4)
        self.q_proj = Linear(dim, dim, bias, dtype=dtype, key=kq)
        self.k_proj = Linear(dim, dim, bias, dtype=dtype, key=kk)
        self.v_proj = Linear(dim, dim, bias, dtype=dtype, key=kv)
        self.out_proj = Linear(dim, dim, bias, dtype=dtype, key=ko)

    def _heads(self, t: Tensor) -> Tensor:
        lead, n = t.shape[:-2], t.shape[-2]
        t = R.reshape(t, lead + (n, self.num_heads, self.head_dim))
        b = len(lead)
        return R.permute(t, tuple(range(b)) + (b + 1, b, b + 2))

    def forward(self, x: Operand, context: Operand | None = None, mask: Tensor | ArrayLike | None = None) -> Tensor:
        kv_in = x if context is None else context
        xq = self.q_proj(x)  # the rank of x
        q = self._heads(xq)
        k = self._heads(self.k_proj(kv_in))
        v = self._heads(self.v_proj(kv_in))
        if mask is not None and len(operand_shape(mask)) == len(xq.shape) >= 3:
            mask = R.expand_dims(mask, -3) if isinstance(mask, Tensor) else jnp.expand_dims(jnp.asarray(mask), -3)
        if self.dropout:  # the train/eval mode is read (and keys compiled programs) only when it matters
            o = R.attention(
                q, k, v, mask, causal=self.causal, dropout=self.dropout, training=None if self.training else False
            )
        else:
            o = R.attention(q, k, v, mask, causal=self.causal)  # (..., H, Lq, Dh)
        b = len(o.shape) - 3
        o = R.permute(o, tuple(range(b)) + (b + 1, b, b + 2))
        o = R.reshape(o, o.shape[:-2] + (self.dim,))
        return self.out_proj(o)

    def extra_repr(self) -> str:
        drop = f", dropout={self.dropout}" if self.dropout else ""
        return f"dim={self.dim}, num_heads={self.num_heads}, causal={self.causal}{drop}"


class MLP(Module):
    """Stack of :class:`Linear` layers of widths ``sizes`` with ``activation`` between them (not after the last).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> mlp = tfl.nn.MLP([3, 16, 2])
    >>> [tuple(p.shape) for p in mlp.parameters()]
    [(16, 3), (16,), (2, 16), (2,)]
    >>> with tfl.Session() as s:
    ...     mlp(s.input(jnp.ones((4, 3)))).shape
    (4, 2)
    """

    def __init__(
        self,
        sizes: Sequence[int],
        *,
        key: PRNGKey | None = None,
        activation: Callable[[Tensor], Tensor] = R.relu,
        bias: bool = True,
        dtype: DTypeLike | None = None,
    ) -> None:
        sizes = [int(s) for s in sizes]
        if len(sizes) < 2:
            raise ValueError(f"MLP: sizes needs at least an input and an output width, got {sizes}")
        keys = init.keys(init.require_key(key, "MLP"), len(sizes) - 1)
        self.activation = activation
        self.layers = [Linear(a, b, bias, dtype=dtype, key=k) for a, b, k in zip(sizes[:-1], sizes[1:], keys)]

    def forward(self, x: Operand) -> Tensor:
        h: Tensor = self.layers[0](x)
        for layer in self.layers[1:]:
            h = layer(self.activation(h))
        return h

    def extra_repr(self) -> str:
        act = getattr(self.activation, "__name__", repr(self.activation))
        sizes = [self.layers[0].in_features] + [lyr.out_features for lyr in self.layers]
        return f"sizes={sizes}, activation={act}"
