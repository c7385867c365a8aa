"""Recurrent layers equal to PyTorch's: GRUCell and LSTMCell (one step), GRU and LSTM (whole sequences).

The parameters keep PyTorch's names, gate order and layout, so a PyTorch
``state_dict`` maps onto them key for key: ``weight_ih`` is
``(G * hidden_size, input_size)``, ``weight_hh`` is ``(G * hidden_size, hidden_size)``,
``bias_ih`` and ``bias_hh`` are ``(G * hidden_size,)``, with G = 3 (r, z, n)
for the GRU and G = 4 (i, f, g, o) for the LSTM; the sequence layers name
them per layer and direction (``weight_ih_l0``, ``weight_hh_l1_reverse``).
A step records only existing ops (``linear``, ``index``, ``sigmoid``,
``tanh``, ``mul``, ``add``, ``sub``), so its gradients come from the tape;
:class:`GRU` / :class:`LSTM` unroll the sequence with a Python loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import numpy as np

from .._core._result import TapeError
from .._core._typing import DTypeLike, PRNGKey
from .._shell import _functions as R
from .._shell._params import Param
from .._shell._surface import torch_entry
from .._shell._tensor import Operand, Tensor, session_of
from . import _init as init
from . import functional as F
from ._module import Module, factory_dtype

__all__ = ["GRU", "LSTM", "GRUCell", "LSTMCell"]


def _spec(v: Operand) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of an operand without recording it."""
    if isinstance(v, (Tensor, Param)):
        return tuple(v.shape), np.dtype(v.dtype)
    a = v if hasattr(v, "shape") and hasattr(v, "dtype") else np.asarray(v)
    return tuple(int(d) for d in a.shape), np.dtype(a.dtype)


def _block(t: Tensor, i: int, h: int) -> Tensor:
    """Block ``i`` (in gate order) of a ``(..., G * h)`` pre-activation."""
    return t[..., i * h : (i + 1) * h]


def gru_step(gi: Tensor, gh: Tensor, h: Operand, hidden: int) -> Tensor:
    """One GRU update from the input and hidden pre-activations ``gi``, ``gh`` (``(..., 3 * hidden)``)."""
    r = R.sigmoid(_block(gi, 0, hidden) + _block(gh, 0, hidden))
    z = R.sigmoid(_block(gi, 1, hidden) + _block(gh, 1, hidden))
    n = R.tanh(_block(gi, 2, hidden) + r * _block(gh, 2, hidden))
    return (h - n) * z + n  # = (1 - z) * n + z * h, in PyTorch's order of operations


def lstm_step(gates: Tensor, c: Operand, hidden: int) -> tuple[Tensor, Tensor]:
    """One LSTM update ``(h', c')`` from the summed pre-activations ``gates`` (``(..., 4 * hidden)``)."""
    i = R.sigmoid(_block(gates, 0, hidden))
    f = R.sigmoid(_block(gates, 1, hidden))
    g = R.tanh(_block(gates, 2, hidden))
    o = R.sigmoid(_block(gates, 3, hidden))
    c_new = f * c + i * g
    return o * R.tanh(c_new), c_new


class _Cell(Module):
    """Shared construction, shape checks and projections of the recurrent cells."""

    _gates = 0  # G: how many hidden-size blocks the weights stack

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        bias: bool = True,
        device: object = None,
        dtype: DTypeLike | None = None,
        *,
        key: PRNGKey | None = None,
    ) -> None:
        name = type(self).__name__
        dtype = factory_dtype(device, dtype, name)
        key = init.require_key(key, name)
        self.input_size = int(input_size)
        self.hidden_size = int(hidden_size)
        if self.input_size < 0 or self.hidden_size < 1:
            raise ValueError(f"{name}: input_size={input_size} must be >= 0 and hidden_size={hidden_size} must be >= 1")
        g = self._gates * self.hidden_size
        bound = 1.0 / math.sqrt(self.hidden_size)
        k1, k2, k3, k4 = init.keys(key, 4)

        def param(k: PRNGKey, shape: tuple[int, ...], pname: str) -> Param:
            return Param(init.uniform(k, shape, dtype, -bound, bound), name=pname)

        self.weight_ih = param(k1, (g, self.input_size), "weight_ih")
        self.weight_hh = param(k2, (g, self.hidden_size), "weight_hh")
        self.bias_ih: Param | None = param(k3, (g,), "bias_ih") if bias else None
        self.bias_hh: Param | None = param(k4, (g,), "bias_hh") if bias else None

    def _check_input(self, x: Operand) -> tuple[tuple[int, ...], np.dtype]:
        shape, dtype = _spec(x)
        if len(shape) not in (1, 2) or shape[-1] != self.input_size:
            raise TapeError(
                f"{type(self).__name__}: input has shape {shape}; expected ({self.input_size},) (unbatched) "
                f"or (N, {self.input_size}) (batched, input_size={self.input_size})"
            )
        return shape, dtype

    def _state(self, what: str, v: Operand | None, x_shape: tuple[int, ...], dtype: np.dtype) -> Operand:
        """``v`` after checking its shape against ``x``'s; zeros of that shape when ``v`` is None."""
        want = x_shape[:-1] + (self.hidden_size,)
        if v is None:
            return np.zeros(want, dtype)
        shape, _ = _spec(v)
        if shape != want:
            raise TapeError(
                f"{type(self).__name__}: {what} has shape {shape}; expected {want} for input of shape {x_shape} "
                f"(hidden_size={self.hidden_size})"
            )
        return v

    def _zeros_dtype(self, x_dtype: np.dtype) -> np.dtype:
        """dtype of a default zero state: the input's when it is floating, else the weights'."""
        return x_dtype if np.issubdtype(x_dtype, np.floating) else np.dtype(self.weight_ih.dtype)

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}, bias={self.bias_ih is not None}"


@torch_entry(bind=("nn",), records="module", opinfo=())
class GRUCell(_Cell):
    """Gated recurrent unit, one step: ``h' = GRUCell(x, h)``, equal to ``torch.nn.GRUCell``.

    With ``gi = x @ weight_ih.T + bias_ih`` and ``gh = h @ weight_hh.T + bias_hh``
    split into blocks (r, z, n) of ``hidden_size`` each::

        r = sigmoid(gi_r + gh_r)
        z = sigmoid(gi_z + gh_z)
        n = tanh(gi_n + r * gh_n)
        h' = (1 - z) * n + z * h

    Parameters, in PyTorch's layout:
    ``weight_ih`` ``(3 * hidden_size, input_size)``, ``weight_hh``
    ``(3 * hidden_size, hidden_size)``, ``bias_ih`` and ``bias_hh``
    ``(3 * hidden_size,)`` (None with ``bias=False``), all initialized
    uniform in ``±1/sqrt(hidden_size)`` as PyTorch does.

    ``forward(x, state=None)``: ``x`` is ``(N, input_size)`` or unbatched
    ``(input_size,)``; ``state`` is ``h`` of shape ``(N, hidden_size)`` or
    ``(hidden_size,)`` (zeros when None). Returns ``h'`` of ``state``'s shape.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> cell = tfl.nn.GRUCell(3, 4)
    >>> for n, p in cell.named_parameters():
    ...     print(n, p.shape)
    weight_ih (12, 3)
    weight_hh (12, 4)
    bias_ih (12,)
    bias_hh (12,)
    >>> with tfl.Session() as s:
    ...     h = None
    ...     for x in s.input(jnp.ones((5, 2, 3))):  # 5 steps of a batch of 2
    ...         h = cell(x, h)
    ...     g = s.backward(tfl.sum(h))
    ...     h.shape, g[cell.weight_hh].shape
    ((2, 4), (12, 4))
    """

    _gates = 3

    def forward(self, x: Operand, state: Operand | None = None) -> Tensor:
        x_shape, dtype = self._check_input(x)
        h = self._state("state", state, x_shape, self._zeros_dtype(dtype))
        with session_of((x, h), "GRUCell").as_current():
            gi = F.linear(x, self.weight_ih, self.bias_ih)
            gh = F.linear(h, self.weight_hh, self.bias_hh)
            return gru_step(gi, gh, h, self.hidden_size)


@torch_entry(bind=("nn",), records="module", opinfo=())
class LSTMCell(_Cell):
    """Long short-term memory, one step: ``(h', c') = LSTMCell(x, (h, c))``, equal to ``torch.nn.LSTMCell``.

    With ``gates = x @ weight_ih.T + bias_ih + h @ weight_hh.T + bias_hh``
    split into blocks (i, f, g, o) of ``hidden_size`` each::

        c' = sigmoid(f) * c + sigmoid(i) * tanh(g)
        h' = sigmoid(o) * tanh(c')

    Parameters, in PyTorch's layout:
    ``weight_ih`` ``(4 * hidden_size, input_size)``, ``weight_hh``
    ``(4 * hidden_size, hidden_size)``, ``bias_ih`` and ``bias_hh``
    ``(4 * hidden_size,)`` (None with ``bias=False``), all initialized
    uniform in ``±1/sqrt(hidden_size)`` as PyTorch does.

    ``forward(x, state=None)``: ``x`` is ``(N, input_size)`` or unbatched
    ``(input_size,)``; ``state`` is a pair ``(h, c)``, each ``(N, hidden_size)``
    or ``(hidden_size,)`` (both zeros when None). Returns the pair ``(h', c')``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> cell = tfl.nn.LSTMCell(3, 4)
    >>> cell.weight_ih.shape, cell.bias_hh.shape
    ((16, 3), (16,))
    >>> with tfl.Session() as s:
    ...     state = None
    ...     for x in s.input(jnp.ones((5, 3))):  # 5 unbatched steps
    ...         state = cell(x, state)
    ...     h, c = state
    ...     g = s.backward(tfl.sum(h))
    ...     h.shape, c.shape, g[cell.weight_ih].shape
    ((4,), (4,), (16, 3))
    """

    _gates = 4

    def forward(self, x: Operand, state: tuple[Operand, Operand] | None = None) -> tuple[Tensor, Tensor]:
        x_shape, dtype = self._check_input(x)
        zdt = self._zeros_dtype(dtype)
        if state is None:
            h, c = self._state("h", None, x_shape, zdt), self._state("c", None, x_shape, zdt)
        elif isinstance(state, (tuple, list)) and len(state) == 2:
            h, c = self._state("h", state[0], x_shape, zdt), self._state("c", state[1], x_shape, zdt)
        else:
            raise TypeError(f"LSTMCell: state must be None or a pair (h, c), got {type(state).__name__}")
        with session_of((x, h, c), "LSTMCell").as_current():
            gates = F.linear(x, self.weight_ih, self.bias_ih) + F.linear(h, self.weight_hh, self.bias_hh)
            return lstm_step(gates, c, self.hidden_size)


def _stack(ts: Sequence[Tensor]) -> Tensor:
    """The ``(N, H)`` tensors ``ts`` stacked along a new axis 0."""
    return R.concat([R.expand_dims(t, 0) for t in ts], axis=0)


class _RNNBase(Module):
    """Multi-layer, optionally bidirectional recurrences over whole sequences (PyTorch's ``RNNBase``)."""

    _gates = 0

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        device: object = None,
        dtype: DTypeLike | None = None,
        *,
        key: PRNGKey | None = None,
    ) -> None:
        name = type(self).__name__
        dt = factory_dtype(device, dtype, name)
        self.input_size, self.hidden_size, self.num_layers = int(input_size), int(hidden_size), int(num_layers)
        if self.input_size < 0 or self.hidden_size < 1 or self.num_layers < 1:
            raise ValueError(
                f"{name}: input_size={input_size} must be >= 0, hidden_size={hidden_size} and "
                f"num_layers={num_layers} >= 1"
            )
        if isinstance(dropout, bool) or not 0.0 <= float(dropout) <= 1.0:
            raise ValueError(f"{name}: dropout must be a number in [0, 1], got {dropout!r}")
        self.bias = bool(bias)
        self.batch_first = bool(batch_first)
        self.dropout = float(dropout)
        self.bidirectional = bool(bidirectional)
        self.num_directions = 2 if self.bidirectional else 1
        g = self._gates * self.hidden_size
        bound = 1.0 / math.sqrt(self.hidden_size)
        names: list[tuple[str, tuple[int, ...]]] = []
        for layer in range(self.num_layers):
            in_size = self.input_size if layer == 0 else self.hidden_size * self.num_directions
            for d in range(self.num_directions):
                sfx = f"_l{layer}" + ("_reverse" if d else "")
                names += [(f"weight_ih{sfx}", (g, in_size)), (f"weight_hh{sfx}", (g, self.hidden_size))]
                if self.bias:
                    names += [(f"bias_ih{sfx}", (g,)), (f"bias_hh{sfx}", (g,))]
        keys = init.keys(init.require_key(key, name), len(names))
        for (pname, shape), k in zip(names, keys):
            setattr(self, pname, Param(init.uniform(k, shape, dt, -bound, bound), name=pname))

    def _weights(self, layer: int, d: int) -> tuple[Param, Param, Param | None, Param | None]:
        sfx = f"_l{layer}" + ("_reverse" if d else "")
        get = self.__dict__.get
        w_ih, w_hh = cast(Param, get(f"weight_ih{sfx}")), cast(Param, get(f"weight_hh{sfx}"))
        return w_ih, w_hh, get(f"bias_ih{sfx}"), get(f"bias_hh{sfx}")

    def _input(self, input: Operand) -> tuple[Operand, bool]:
        """``input`` as ``(L, N, input_size)`` and whether it was unbatched."""
        shape, dtype = _spec(input)
        name = type(self).__name__
        if len(shape) not in (2, 3) or shape[-1] != self.input_size:
            layout = "(N, L, H_in)" if self.batch_first else "(L, N, H_in)"
            raise TapeError(
                f"{name}: input has shape {shape}; expected {layout} or unbatched (L, H_in) "
                f"with H_in = input_size = {self.input_size}"
            )
        if not np.issubdtype(dtype, np.floating):
            raise TapeError(f"{name}: input has dtype {dtype}, expected a floating dtype")
        if len(shape) == 2:
            return R.expand_dims(input, 1), True
        return (R.permute(input, (1, 0, 2)) if self.batch_first else input), False

    def _state(self, what: str, v: Operand | None, n: int, unbatched: bool, dtype: np.dtype) -> list[Operand]:
        """The initial state ``v`` as one ``(N, H)`` operand per layer and direction (zeros when None)."""
        k = self.num_layers * self.num_directions
        if v is None:
            zero = np.zeros((n, self.hidden_size), dtype)
            return [zero] * k
        want = (k, self.hidden_size) if unbatched else (k, n, self.hidden_size)
        shape, _ = _spec(v)
        if shape != want:
            raise TapeError(
                f"{type(self).__name__}: {what} has shape {shape}; expected {want} "
                "(num_layers * num_directions, [batch,] hidden_size)"
            )
        if unbatched:
            v = R.expand_dims(v, 1)
        return [v[i] for i in range(k)]  # type: ignore[index]

    def _step(self, gi: Tensor, state: tuple[Operand, ...], w_hh: Param, b_hh: Param | None) -> tuple[Tensor, ...]:
        raise NotImplementedError

    def _run(self, input: Operand, states: tuple[Operand | None, ...]) -> tuple[Tensor, list[tuple[Tensor, ...]], bool]:
        x, unbatched = self._input(input)
        shape, dtype = _spec(x)
        seq_len, n = shape[:2]
        init_states = [self._state(w, v, n, unbatched, dtype) for w, v in zip(("hx", "cx"), states)]
        finals: list[tuple[Tensor, ...]] = []
        with session_of((x,), type(self).__name__).as_current():
            layer_in: Operand = x
            for layer in range(self.num_layers):
                outs = []
                for d in range(self.num_directions):
                    w_ih, w_hh, b_ih, b_hh = self._weights(layer, d)
                    gi_all = F.linear(layer_in, w_ih, b_ih)  # every step's input projection in one op
                    k = layer * self.num_directions + d
                    state = tuple(s[k] for s in init_states)
                    ys: list[Tensor] = [None] * seq_len  # type: ignore[list-item]
                    for t in reversed(range(seq_len)) if d else range(seq_len):
                        state = self._step(gi_all[t], state, w_hh, b_hh)
                        ys[t] = state[0]
                    finals.append(state)  # type: ignore[arg-type]
                    outs.append(_stack(ys))
                layer_in = outs[0] if len(outs) == 1 else R.concat(outs, axis=-1)
                if self.dropout and layer < self.num_layers - 1:
                    layer_in = R.dropout(layer_in, self.dropout, training=None if self.training else False)
            out = cast(Tensor, layer_in)
            if unbatched:
                out = out[:, 0]
            elif self.batch_first:
                out = R.permute(out, (1, 0, 2))
        return out, finals, unbatched

    @staticmethod
    def _final(parts: list[Tensor], unbatched: bool) -> Tensor:
        h = _stack(parts)
        return h[:, 0] if unbatched else h

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        if not self.bias:
            s += ", bias=False"
        if self.batch_first:
            s += ", batch_first=True"
        if self.dropout:
            s += f", dropout={self.dropout}"
        if self.bidirectional:
            s += ", bidirectional=True"
        return s


@torch_entry(bind=("nn",), records="module", opinfo=())
class GRU(_RNNBase):
    """Multi-layer gated recurrent unit over a whole sequence, equal to ``torch.nn.GRU``.

    ``forward(input, hx=None)`` with ``input`` of shape ``(L, N, input_size)``
    (``(N, L, input_size)`` with ``batch_first=True``, or unbatched
    ``(L, input_size)``) and ``hx`` of shape ``(D * num_layers, N, hidden_size)``
    (zeros when None; D = 2 when ``bidirectional``) returns ``(output, h_n)``:
    ``output`` holds the last layer's hidden state at every step
    ``(L, N, D * hidden_size)``, ``h_n`` the final state of every layer and
    direction. ``dropout`` applies between layers in train mode. Parameters
    are named and laid out as PyTorch's (``weight_ih_l0``, ``bias_hh_l0_reverse``, ...),
    each initialized uniform in ``±1/sqrt(hidden_size)``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> gru = tfl.nn.GRU(3, 4, num_layers=2, batch_first=True)
    >>> [n for n, _ in gru.named_parameters()][:4]
    ['weight_ih_l0', 'weight_hh_l0', 'bias_ih_l0', 'bias_hh_l0']
    >>> with tfl.Session() as s:
    ...     out, h_n = gru(s.input(jnp.ones((2, 5, 3))))
    ...     out.shape, h_n.shape
    ((2, 5, 4), (2, 2, 4))
    """

    _gates = 3

    def _step(self, gi: Tensor, state: tuple[Operand, ...], w_hh: Param, b_hh: Param | None) -> tuple[Tensor, ...]:
        (h,) = state
        return (gru_step(gi, F.linear(h, w_hh, b_hh), h, self.hidden_size),)

    def forward(self, input: Operand, hx: Operand | None = None) -> tuple[Tensor, Tensor]:
        out, finals, unbatched = self._run(input, (hx,))
        return out, self._final([f[0] for f in finals], unbatched)


@torch_entry(
    bind=("nn",),
    records="module",
    opinfo=(),
    gaps={
        "proj_size=": "LSTM with projections (proj_size > 0) is not implemented; project the outputs with a Linear layer"
    },
)
class LSTM(_RNNBase):
    """Multi-layer long short-term memory over a whole sequence, equal to ``torch.nn.LSTM``.

    ``forward(input, hx=None)`` with ``input`` as for :class:`GRU` and ``hx`` a
    pair ``(h_0, c_0)`` (each ``(D * num_layers, N, hidden_size)``; zeros when
    None) returns ``(output, (h_n, c_n))``. Parameters are named and laid out
    as PyTorch's (gate order i, f, g, o). ``proj_size`` is not supported.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> lstm = tfl.nn.LSTM(3, 4, bidirectional=True)
    >>> lstm.weight_hh_l0_reverse.shape
    (16, 4)
    >>> with tfl.Session() as s:
    ...     out, (h_n, c_n) = lstm(s.input(jnp.ones((5, 2, 3))))
    ...     out.shape, h_n.shape, c_n.shape
    ((5, 2, 8), (2, 2, 4), (2, 2, 4))
    """

    _gates = 4

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
        device: object = None,
        dtype: DTypeLike | None = None,
        *,
        key: PRNGKey | None = None,
    ) -> None:
        if proj_size:
            raise ValueError(f"LSTM: proj_size={proj_size} is not supported; pass proj_size=0")
        self.proj_size = 0
        super().__init__(
            input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional, device, dtype, key=key
        )

    def _step(self, gi: Tensor, state: tuple[Operand, ...], w_hh: Param, b_hh: Param | None) -> tuple[Tensor, ...]:
        h, c = state
        return lstm_step(gi + F.linear(h, w_hh, b_hh), c, self.hidden_size)

    def forward(
        self, input: Operand, hx: tuple[Operand, Operand] | None = None
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        if hx is not None and not (isinstance(hx, (tuple, list)) and len(hx) == 2):
            raise TypeError(f"LSTM: hx must be None or a pair (h_0, c_0), got {type(hx).__name__}")
        out, finals, unbatched = self._run(input, (None, None) if hx is None else tuple(hx))
        return out, (self._final([f[0] for f in finals], unbatched), self._final([f[1] for f in finals], unbatched))
