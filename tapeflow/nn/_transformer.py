"""Attention and transformer layers with ``torch.nn``'s signatures: :class:`MultiheadAttention`,
:class:`TransformerEncoderLayer` and :class:`TransformerEncoder`.

Parameters, names and layouts are PyTorch's (``in_proj_weight`` ``(3E, E)``,
``out_proj.weight``, ``linear1``, ``norm1``, ``layers.0...``), so a PyTorch
state dict loads key for key; the attention follows
``torch.nn.functional.multi_head_attention_forward`` op for op (masks as
additive float masks, ``True`` in a boolean mask meaning *not* allowed).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from .._core._result import TapeError
from .._core._typing import DTypeLike, PRNGKey
from .._shell import _functions as R
from .._shell._params import Param, tie
from .._shell._surface import torch_entry
from .._shell._tensor import Operand, Tensor, operand_shape, session_of
from . import _init as init
from . import functional as F
from ._container import ModuleList
from ._layers import Dropout, Linear
from ._module import Module, factory_dtype
from ._norm import LayerNorm

__all__ = ["MultiheadAttention", "TransformerEncoder", "TransformerEncoderLayer", "clone_module"]


def clone_module(module: Module) -> Module:
    """A deep copy of ``module`` whose Params are new storages holding the same values (ties kept within the copy).

    >>> import tapeflow as tfl
    >>> a = tfl.nn.Linear(2, 2)
    >>> b = clone_module(a)
    >>> same_values = bool((b.weight.value == a.weight.value).all())
    >>> b.weight.storage is a.weight.storage, same_values
    (False, True)
    """
    memo: dict[int, object] = {}
    fresh: dict[int, Param] = {}
    for _, p in module.parameter_records():
        if id(p) in memo:
            continue
        first = fresh.get(id(p.storage))
        if first is None:
            first = fresh[id(p.storage)] = Param(np.array(p.value), name=p.name, trainable=p.trainable)
            memo[id(p)] = first
        else:
            memo[id(p)] = tie(first, name=p.name, trainable=p.trainable)
    return copy.deepcopy(module, memo)


def _float_mask(mask: Operand | None, what: str, dtype: np.dtype) -> Operand | None:
    """PyTorch's ``_canonical_mask``: a boolean mask (True = masked out) as an additive float mask."""
    if mask is None:
        return None
    mdt = np.dtype(mask.dtype) if hasattr(mask, "dtype") else np.asarray(mask).dtype
    if mdt == np.bool_:
        if isinstance(mask, Tensor):
            return R.where(mask, -math.inf, 0.0)
        return jnp.where(jnp.asarray(mask), jnp.asarray(-jnp.inf, dtype), jnp.asarray(0.0, dtype))
    if not np.issubdtype(mdt, np.floating):
        raise TapeError(f"MultiheadAttention: {what} has dtype {mdt}; expected bool or a floating dtype")
    return mask


@torch_entry(
    bind=("nn",),
    records="module",
    opinfo=(),
    gaps={
        "add_bias_kv=True": "the learned bias row and the zero row appended to the keys and values (add_bias_kv, add_zero_attn) are not implemented; pass False for both and append them to key and value yourself"
    },
)
class MultiheadAttention(Module):
    """Multi-head attention as ``torch.nn.MultiheadAttention``: PyTorch's arguments, parameters and ``(output, weights)``.

    ``forward(query, key, value, key_padding_mask=None, need_weights=True,
    attn_mask=None, average_attn_weights=True, is_causal=False)``: inputs are
    ``(L, N, E)`` (``(N, L, E)`` with ``batch_first=True``; unbatched ``(L, E)``);
    ``key_padding_mask`` ``(N, S)`` and ``attn_mask`` ``(L, S)`` or
    ``(N * num_heads, L, S)`` are boolean (True = not attended) or float
    (added to the scores). ``is_causal`` is a hint that ``attn_mask`` is the
    causal mask (as in PyTorch, it needs ``attn_mask``). Returns the output and
    the attention weights ``(N, L, S)`` averaged over heads (per head
    ``(N, num_heads, L, S)`` with ``average_attn_weights=False``; None with
    ``need_weights=False``). ``dropout`` drops attention weights in train mode.
    ``add_bias_kv`` and ``add_zero_attn`` are not supported.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> mha = tfl.nn.MultiheadAttention(8, 2, batch_first=True)
    >>> [(n, p.shape) for n, p in mha.named_parameters()][:2]
    [('in_proj_weight', (24, 8)), ('in_proj_bias', (24,))]
    >>> with tfl.Session() as s:
    ...     x = s.input(jnp.ones((3, 5, 8)))
    ...     out, w = mha(x, x, x)
    ...     out.shape, w.shape
    ((3, 5, 8), (3, 5, 5))
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: object = None,
        dtype: DTypeLike | None = None,
        *,
        key: PRNGKey | None = None,
    ) -> None:
        dt = factory_dtype(device, dtype, "MultiheadAttention")
        if add_bias_kv or add_zero_attn:
            raise ValueError("MultiheadAttention: add_bias_kv and add_zero_attn are not supported; pass False for both")
        self.embed_dim = int(embed_dim)
        self.num_heads = int(num_heads)
        if self.num_heads < 1 or self.embed_dim % self.num_heads:
            raise ValueError(f"MultiheadAttention: embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        if isinstance(dropout, bool) or not 0.0 <= float(dropout) <= 1.0:
            raise ValueError(f"MultiheadAttention: dropout must be in [0, 1], got {dropout!r}")
        self.kdim = self.embed_dim if kdim is None else int(kdim)
        self.vdim = self.embed_dim if vdim is None else int(vdim)
        self._qkv_same_embed_dim = self.kdim == self.embed_dim and self.vdim == self.embed_dim
        self.dropout = float(dropout)
        self.batch_first = bool(batch_first)
        self.head_dim = self.embed_dim // self.num_heads
        e = self.embed_dim
        k_in, k_q, k_k, k_v, k_out = init.keys(init.require_key(key, "MultiheadAttention"), 5)

        def xavier(k: PRNGKey, shape: tuple[int, int], name: str) -> Param:
            bound = math.sqrt(6.0 / (shape[0] + shape[1]))
            return Param(init.uniform(k, shape, dt, -bound, bound), name=name)

        self.in_proj_weight: Param | None = None
        self.q_proj_weight: Param | None = None
        self.k_proj_weight: Param | None = None
        self.v_proj_weight: Param | None = None
        if self._qkv_same_embed_dim:
            self.in_proj_weight = xavier(k_in, (3 * e, e), "in_proj_weight")
        else:
            self.q_proj_weight = xavier(k_q, (e, e), "q_proj_weight")
            self.k_proj_weight = xavier(k_k, (e, self.kdim), "k_proj_weight")
            self.v_proj_weight = xavier(k_v, (e, self.vdim), "v_proj_weight")
        self.in_proj_bias: Param | None = Param(np.zeros(3 * e, dt), name="in_proj_bias") if bias else None
        self.out_proj = Linear(e, e, bias, dtype=dt, key=k_out)
        if self.out_proj.bias is not None:
            self.out_proj.bias = Param(np.zeros(e, dt), name="bias")

    def _project(self, x: Operand, i: int) -> Tensor:
        e = self.embed_dim
        if self.in_proj_weight is not None:
            w: Operand = self.in_proj_weight[i * e : (i + 1) * e]
        else:
            w = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)[i]  # type: ignore[assignment]
        b = None if self.in_proj_bias is None else self.in_proj_bias[i * e : (i + 1) * e]
        return F.linear(x, w, b)

    def forward(
        self,
        query: Operand,
        key: Operand,
        value: Operand,
        key_padding_mask: Operand | None = None,
        need_weights: bool = True,
        attn_mask: Operand | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        shape = operand_shape(query)
        if len(shape) not in (2, 3) or shape[-1] != self.embed_dim:
            raise TapeError(
                f"MultiheadAttention: query has shape {shape}; expected (L, N, E), (N, L, E) with batch_first, "
                f"or unbatched (L, E), with E = embed_dim = {self.embed_dim}"
            )
        if is_causal and attn_mask is None:
            raise TapeError(
                "MultiheadAttention: is_causal=True is a hint that attn_mask is the causal mask and needs attn_mask "
                "(as in PyTorch); pass attn_mask (e.g. torch.nn.Transformer.generate_square_subsequent_mask(L))"
            )
        batched = len(shape) == 3
        with session_of((query, key, value), "MultiheadAttention").as_current():
            if not batched:
                query, key, value = (R.expand_dims(t, 1) for t in (query, key, value))
                if key_padding_mask is not None:
                    key_padding_mask = R.expand_dims(key_padding_mask, 0)
            elif self.batch_first:
                query, key, value = (R.permute(t, (1, 0, 2)) for t in (query, key, value))
            tgt_len, n = tuple(query.shape)[:2]  # type: ignore[union-attr]
            src_len = int(key.shape[0])  # type: ignore[union-attr]
            h, dh = self.num_heads, self.head_dim

            def heads(t: Tensor, length: int) -> Tensor:  # (L, N, E) -> (N, H, L, Dh)
                return R.permute(R.reshape(t, (length, n, h, dh)), (1, 2, 0, 3))

            q = heads(self._project(query, 0), tgt_len)
            k = heads(self._project(key, 1), src_len)
            v = heads(self._project(value, 2), src_len)
            dtype = np.dtype(q.dtype)
            mask = _float_mask(attn_mask, "attn_mask", dtype)
            if mask is not None and len(operand_shape(mask)) == 3:
                mask = R.reshape(mask, (n, h, tgt_len, src_len))
            kpm = _float_mask(key_padding_mask, "key_padding_mask", dtype)
            if kpm is not None:
                kpm = R.reshape(kpm, (n, 1, 1, src_len))
                mask = kpm if mask is None else mask + kpm
            scores = R.matmul(q * math.sqrt(1.0 / dh), R.permute(k, (0, 1, 3, 2)))
            if mask is not None:
                scores = scores + mask
            weights = R.softmax(scores, axis=-1)
            if self.dropout:
                weights = R.dropout(weights, self.dropout, training=None if self.training else False)
            o = R.matmul(weights, v)  # (N, H, L, Dh)
            o = R.reshape(R.permute(o, (2, 0, 1, 3)), (tgt_len, n, self.embed_dim))
            out = self.out_proj(o)
            if not batched:
                out = out[:, 0]
            elif self.batch_first:
                out = R.permute(out, (1, 0, 2))
            if not need_weights:
                return out, None
            w = R.mean(weights, axis=1) if average_attn_weights else weights
            if not batched:
                w = w[0]
            return out, w

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}"


def _activation(activation: str | Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    if activation == "relu":
        return F.relu
    if activation == "gelu":
        return F.gelu
    if isinstance(activation, str) or not callable(activation):
        raise ValueError(f"activation should be relu/gelu, not {activation!r}")
    return activation


@torch_entry(bind=("nn",), records="module", opinfo=())
class TransformerEncoderLayer(Module):
    """Self-attention and feed-forward block as ``torch.nn.TransformerEncoderLayer`` (post-norm, or ``norm_first``).

    Sub-modules, in PyTorch's names: ``self_attn`` (:class:`MultiheadAttention`),
    ``linear1``, ``dropout``, ``linear2``, ``norm1``, ``norm2``, ``dropout1``,
    ``dropout2``. ``activation`` is ``"relu"``, ``"gelu"`` or a callable.
    ``forward(src, src_mask=None, src_key_padding_mask=None, is_causal=False)``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> layer = tfl.nn.TransformerEncoderLayer(
    ...     8, 2, dim_feedforward=16, batch_first=True
    ... )
    >>> with tfl.Session() as s:
    ...     layer(s.input(jnp.ones((2, 5, 8)))).shape
    (2, 5, 8)
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Tensor], Tensor] = "relu",
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device: object = None,
        dtype: DTypeLike | None = None,
        *,
        key: PRNGKey | None = None,
    ) -> None:
        k_attn, k1, k2 = init.keys(init.require_key(key, "TransformerEncoderLayer"), 3)
        self.self_attn = MultiheadAttention(
            d_model, nhead, dropout=dropout, bias=bias, batch_first=batch_first, device=device, dtype=dtype, key=k_attn
        )
        self.linear1 = Linear(d_model, dim_feedforward, bias, device, dtype, key=k1)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias, device, dtype, key=k2)
        self.norm_first = bool(norm_first)
        self.norm1 = LayerNorm(d_model, layer_norm_eps, True, bias, device, dtype)
        self.norm2 = LayerNorm(d_model, layer_norm_eps, True, bias, device, dtype)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.activation = _activation(activation)
        self.batch_first = bool(batch_first)

    def _sa_block(self, x: Operand, attn_mask: Operand | None, kpm: Operand | None, is_causal: bool) -> Tensor:
        out, _ = self.self_attn(
            x, x, x, attn_mask=attn_mask, key_padding_mask=kpm, need_weights=False, is_causal=is_causal
        )
        return self.dropout1(out)

    def _ff_block(self, x: Tensor) -> Tensor:
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def forward(
        self,
        src: Operand,
        src_mask: Operand | None = None,
        src_key_padding_mask: Operand | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            return x + self._ff_block(self.norm2(x))
        x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal))
        return self.norm2(x + self._ff_block(x))


@torch_entry(bind=("nn",), records="module", opinfo=())
class TransformerEncoder(Module):
    """A stack of ``num_layers`` copies of ``encoder_layer`` (and an optional final ``norm``), as ``torch.nn.TransformerEncoder``.

    As PyTorch, the copies start with the same weights (the layer's, copied
    into new storages), and the stack is ``layers.0``, ``layers.1``, ...
    ``forward(src, mask=None, src_key_padding_mask=None, is_causal=None)``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> layer = tfl.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16)
    >>> enc = tfl.nn.TransformerEncoder(layer, num_layers=2)
    >>> [n for n, _ in enc.named_parameters()][0]
    'layers.0.self_attn.in_proj_weight'
    >>> with tfl.Session() as s:
    ...     enc(s.input(jnp.ones((5, 2, 8)))).shape
    (5, 2, 8)
    """

    def __init__(
        self,
        encoder_layer: TransformerEncoderLayer,
        num_layers: int,
        norm: Module | None = None,
        enable_nested_tensor: bool = True,
        mask_check: bool = True,
    ) -> None:
        if not isinstance(encoder_layer, Module):
            raise TypeError(
                f"TransformerEncoder: encoder_layer must be a tfl.nn.Module, got {type(encoder_layer).__name__}"
            )
        self.layers = ModuleList([clone_module(encoder_layer) for _ in range(int(num_layers))])
        self.num_layers = int(num_layers)
        self.norm = norm

    def forward(
        self,
        src: Operand,
        mask: Operand | None = None,
        src_key_padding_mask: Operand | None = None,
        is_causal: bool | None = None,
    ) -> Operand:
        out = src
        for layer in self.layers:
            out = layer(out, src_mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=bool(is_causal))
        if self.norm is not None:
            out = self.norm(out)
        return out
