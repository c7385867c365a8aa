"""Recurrent cells: GRUCell and LSTMCell, one time step each, equal to PyTorch's.

The parameters keep PyTorch's names, gate order and layout, so a PyTorch
``state_dict`` maps onto them key for key and without a transpose:
``weight_ih`` is ``(G * hidden_size, input_size)``, ``weight_hh`` is
``(G * hidden_size, hidden_size)``, ``bias_ih`` and ``bias_hh`` are
``(G * hidden_size,)``, with G = 3 (r, z, n) for the GRU and G = 4
(i, f, g, o) for the LSTM. (:class:`~tapeflow.nn.Linear` stores its weight
transposed, as ``(in, out)``; the cells do not.) A step records only
existing ops (``transpose``, ``linear``, ``index``, ``sigmoid``, ``tanh``,
``mul``, ``add``, ``sub``), so its gradients come from the tape; unroll a
sequence with a Python loop.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from .._core._result import TapeError
from .._core._typing import DTypeLike, PRNGKey
from .._shell import _functions as F
from .._shell._params import Param
from .._shell._tensor import Operand, Tensor, session_of
from . import _init as init
from ._module import Module

__all__ = ["GRUCell", "LSTMCell"]


def _spec(v: Operand) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of an operand without recording it."""
    if isinstance(v, (Tensor, Param)):
        return tuple(v.shape), np.dtype(v.dtype)
    a = v if hasattr(v, "shape") and hasattr(v, "dtype") else np.asarray(v)
    return tuple(int(d) for d in a.shape), np.dtype(a.dtype)


class _Cell(Module):
    """Shared construction, shape checks and projections of the recurrent cells."""

    _gates = 0  # G: how many hidden-size blocks the weights stack

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        *,
        key: PRNGKey | None = None,
        bias: bool = True,
        dtype: DTypeLike = jnp.float32,
    ) -> None:
        name = type(self).__name__
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
            return jnp.zeros(want, dtype)
        shape, _ = _spec(v)
        if shape != want:
            raise TapeError(
                f"{type(self).__name__}: {what} has shape {shape}; expected {want} for input of shape {x_shape} "
                f"(hidden_size={self.hidden_size})"
            )
        return v

    def _zeros_dtype(self, x_dtype: np.dtype) -> np.dtype:
        """dtype of a default zero state: the input's when it is floating, else the weights'."""
        return x_dtype if jnp.issubdtype(x_dtype, jnp.floating) else np.dtype(self.weight_ih.dtype)

    def _project(self, v: Operand, w: Param, b: Param | None) -> Tensor:
        """``v @ w.T + b``: one gate pre-activation block of shape ``(..., G * hidden_size)``."""
        return F.linear(v, F.transpose(w), b)

    def _gate(self, t: Tensor, i: int) -> Tensor:
        """Block ``i`` (in gate order) of a ``(..., G * hidden_size)`` pre-activation."""
        h = self.hidden_size
        return t[..., i * h : (i + 1) * h]

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}, bias={self.bias_ih is not None}"


class GRUCell(_Cell):
    """Gated recurrent unit, one step: ``h' = GRUCell(x, h)``, equal to ``torch.nn.GRUCell``.

    With ``gi = x @ weight_ih.T + bias_ih`` and ``gh = h @ weight_hh.T + bias_hh``
    split into blocks (r, z, n) of ``hidden_size`` each::

        r = sigmoid(gi_r + gh_r)
        z = sigmoid(gi_z + gh_z)
        n = tanh(gi_n + r * gh_n)
        h' = (1 - z) * n + z * h

    Parameters, in PyTorch's layout (not :class:`Linear`'s transposed one):
    ``weight_ih`` ``(3 * hidden_size, input_size)``, ``weight_hh``
    ``(3 * hidden_size, hidden_size)``, ``bias_ih`` and ``bias_hh``
    ``(3 * hidden_size,)`` (None with ``bias=False``), all initialized
    uniform in ``±1/sqrt(hidden_size)`` as PyTorch does.

    ``forward(x, state=None)``: ``x`` is ``(N, input_size)`` or unbatched
    ``(input_size,)``; ``state`` is ``h`` of shape ``(N, hidden_size)`` or
    ``(hidden_size,)`` (zeros when None). Returns ``h'`` of ``state``'s shape.

    >>> import jax, jax.numpy as jnp, tapeflow as tfl
    >>> cell = tfl.nn.GRUCell(3, 4, key=jax.random.key(0))
    >>> [(n, p.shape) for n, p in cell.named_parameters()]
    [('weight_ih', (12, 3)), ('weight_hh', (12, 4)), ('bias_ih', (12,)), ('bias_hh', (12,))]
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
            gi = self._project(x, self.weight_ih, self.bias_ih)
            gh = self._project(h, self.weight_hh, self.bias_hh)
            r = F.sigmoid(self._gate(gi, 0) + self._gate(gh, 0))
            z = F.sigmoid(self._gate(gi, 1) + self._gate(gh, 1))
            n = F.tanh(self._gate(gi, 2) + r * self._gate(gh, 2))
            return (h - n) * z + n  # = (1 - z) * n + z * h, in PyTorch's order of operations


class LSTMCell(_Cell):
    """Long short-term memory, one step: ``(h', c') = LSTMCell(x, (h, c))``, equal to ``torch.nn.LSTMCell``.

    With ``gates = x @ weight_ih.T + bias_ih + h @ weight_hh.T + bias_hh``
    split into blocks (i, f, g, o) of ``hidden_size`` each::

        c' = sigmoid(f) * c + sigmoid(i) * tanh(g)
        h' = sigmoid(o) * tanh(c')

    Parameters, in PyTorch's layout (not :class:`Linear`'s transposed one):
    ``weight_ih`` ``(4 * hidden_size, input_size)``, ``weight_hh``
    ``(4 * hidden_size, hidden_size)``, ``bias_ih`` and ``bias_hh``
    ``(4 * hidden_size,)`` (None with ``bias=False``), all initialized
    uniform in ``±1/sqrt(hidden_size)`` as PyTorch does.

    ``forward(x, state=None)``: ``x`` is ``(N, input_size)`` or unbatched
    ``(input_size,)``; ``state`` is a pair ``(h, c)``, each ``(N, hidden_size)``
    or ``(hidden_size,)`` (both zeros when None). Returns the pair ``(h', c')``.

    >>> import jax, jax.numpy as jnp, tapeflow as tfl
    >>> cell = tfl.nn.LSTMCell(3, 4, key=jax.random.key(0))
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
            gates = self._project(x, self.weight_ih, self.bias_ih) + self._project(h, self.weight_hh, self.bias_hh)
            i = F.sigmoid(self._gate(gates, 0))
            f = F.sigmoid(self._gate(gates, 1))
            g = F.tanh(self._gate(gates, 2))
            o = F.sigmoid(self._gate(gates, 3))
            c_new = f * c + i * g
            return o * F.tanh(c_new), c_new
