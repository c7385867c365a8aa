"""How a value enters a session: kind checks, host conversion, placement, constants and Param values.

One rule for every way in (an input, a Param's value, a Python-number or
array operand, a random draw, a checkpointed block's array operand, a
storage's value, a lazy session's host input read later):

* no complex values; exact rationals are NumPy object arrays of Fractions,
  computed on the CPU with one :class:`RationalFallbackWarning` per session;
* host data is converted with JAX's dtypes (64-bit integers that would wrap
  are an error while ``jax_enable_x64`` is off) and placed by
  :func:`tapeflow._core._tape.place`: uncommitted on JAX's default device, so
  kernels see one placement for every operand and compile once, committed
  to any other device;
* a lazy session on the default device keeps a NumPy input on the host (its
  programs take it as an argument, which moves it faster);
* a Python number is given the dtype of the op's other operands and cached.

>>> import jax.numpy as jnp, numpy as np, tapeflow as tfl
>>> s = tfl.Session()
>>> (s.input(jnp.ones(2, jnp.bfloat16)) * 2).dtype
dtype(bfloat16)
>>> lz = tfl.Session(lazy=True)
>>> x = lz.input(np.ones(2))
>>> type(lz.recording[x.id].value).__name__  # kept on the host until read
'ndarray'
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, Protocol, cast

import jax
import numpy as np

from .._core import _registry as R
from .._core._device import default_device
from .._core._result import TapeError
from .._core._tape import Tape, fill_pending, place
from .._core._typing import Array, ArrayLike, NodeId

if TYPE_CHECKING:
    from ._params import Param, Storage

__all__ = [
    "COMPLEX_HINT",
    "ParamSource",
    "RationalFallbackWarning",
    "ValuePolicy",
    "check_fits_without_x64",
    "check_value_kind",
    "foreign_array",
    "host_operand",
    "read_host_inputs",
    "stored",
]

COMPLEX_HINT = (
    "complex values are not supported yet: gradients of complex inputs would be wrong; "
    "use real and imaginary parts as two real tensors"
)

ConstantKey = tuple[type, bool | int | float, float, np.dtype]
"""``(type, number, sign, dtype)``: one cached constant operand (the sign tells ``0.0`` from ``-0.0``)."""

_CONSTANT_CACHE_SIZE = 1024


class RationalFallbackWarning(UserWarning):
    """Values without a native JAX dtype (exact rationals) are computed on the CPU with NumPy."""


_NATIVE = (np.ndarray, np.generic, jax.Array, bool, int, float, complex, list, tuple, Fraction)


class _TorchTensor(Protocol):
    """What :func:`foreign_array` reads of a ``torch.Tensor`` (torch is optional: not imported for types)."""

    requires_grad: bool

    def detach(self) -> _TorchTensor: ...
    def view(self, dtype: object) -> _TorchTensor: ...
    def numpy(self) -> np.ndarray: ...


def foreign_array(x: object, where: str) -> object:
    """``x`` itself, or another framework's array as NumPy data: the one rule for values from outside JAX.

    A CPU PyTorch tensor becomes a NumPy view of its memory (detached; bfloat16
    kept through its bits), and the session copies it as it copies any NumPy
    data; anything else with ``__array__`` or ``__dlpack__`` (CuPy, TensorFlow,
    Arrow, ...) goes through NumPy the same way. A PyTorch tensor on a GPU is an
    error that says to move it: its memory is not where JAX's CPU arrays live.

    >>> import torch
    >>> foreign_array(torch.arange(3.0), "input").tolist()
    [0.0, 1.0, 2.0]
    """
    if x is None or isinstance(x, _NATIVE):
        return x
    if type(x).__module__.split(".")[0] == "torch":
        t = cast("_TorchTensor", x)  # torch is optional: not imported to check
        device = getattr(t, "device", None)
        if device is not None and getattr(device, "type", "cpu") != "cpu":
            raise TapeError(
                f"{where}: a PyTorch tensor on {device} cannot be read here (JAX's arrays are on "
                f"{jax.devices()[0].platform}); pass tensor.cpu(), or keep the data loader on the CPU"
            )
        t = t.detach() if getattr(t, "requires_grad", False) else t
        if str(getattr(t, "dtype", "")) == "torch.bfloat16":  # NumPy has no bfloat16: its bits, viewed as JAX's
            import torch

            return t.view(torch.int16).numpy().view(jax.numpy.bfloat16)
        return t.numpy()
    if hasattr(x, "__array__"):
        return np.asarray(x)
    if hasattr(x, "__dlpack__"):
        return np.from_dlpack(x)
    return x


def check_value_kind(x: object, where: str) -> None:
    """Refuse values tapeflow cannot differentiate: complex ones, and object arrays not of exact rationals.

    An object array is the exact-rational carrier: each element must be a
    ``fractions.Fraction`` or an int (not a bool).

    >>> import numpy as np
    >>> check_value_kind(np.array([Fraction(1, 2), 3], dtype=object), "input")
    >>> try:
    ...     check_value_kind(np.array(["a"], dtype=object), "input")
    ... except TapeError as e:
    ...     print(str(e).split(";")[0])
    input: an exact-rational (object) array holds a str element ('a')
    """
    dt = getattr(x, "dtype", None)
    if dt is None and isinstance(x, (complex, list, tuple)):
        try:
            dt = np.asarray(x).dtype
        except (TypeError, ValueError):
            return  # not an array; whoever converts it reports that
    if dt is None:
        return
    if np.dtype(dt).kind == "c":
        raise TapeError(f"{where}: {COMPLEX_HINT}")
    if np.dtype(dt) == R.OBJECT and isinstance(x, np.ndarray):
        for e in x.flat:
            if isinstance(e, (bool, np.bool_)) or not isinstance(e, (Fraction, int, np.integer)):
                raise TapeError(
                    f"{where}: an exact-rational (object) array holds a {type(e).__name__} element ({e!r:.40}); "
                    "use fractions.Fraction or int elements"
                )


def check_fits_without_x64(x: object, where: str) -> None:
    """Host integers that JAX would silently wrap to 32 bits when ``jax_enable_x64`` is off are an error.

    >>> check_fits_without_x64(np.array([2**40]), "input")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    tapeflow._core._result.TapeError: input: int64 values in [1099511627776, ...
    """
    if jax.dtypes.canonicalize_dtype(np.int64) == np.int64:  # jax_enable_x64 is on
        return
    a = x if isinstance(x, (np.ndarray, np.generic)) else None
    if a is None or a.dtype.kind not in "iu" or a.dtype.itemsize <= 4 or a.size == 0:
        return
    info = np.iinfo(np.int32 if a.dtype.kind == "i" else np.uint32)
    if a.min() < info.min or a.max() > info.max:
        raise TapeError(
            f"{where}: {a.dtype} values in [{a.min()}, {a.max()}] do not fit {info.dtype} "
            f"([{info.min}, {info.max}]), which JAX uses while 64-bit values are off; "
            'turn them on with jax.config.update("jax_enable_x64", True)'
        )


def stored(value: ArrayLike) -> Array:
    """``value`` as a :class:`~tapeflow.Storage` holds it: a ``jax.Array`` of a definite dtype (or a tracer, or rationals).

    A weakly typed value (``jnp.array(1.0)``) gets its dtype made definite, so a
    compiled step sees one signature before and after its first update; host
    data lands uncommitted on the default device; rationals are copied.

    >>> import jax.numpy as jnp
    >>> stored(jnp.array(1.0)).weak_type, stored([1, 2]).dtype
    (False, dtype('int32'))
    """
    value = foreign_array(value, "Param")
    if isinstance(value, np.ndarray) and value.dtype == R.OBJECT:
        return value.copy()
    if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer) and value.weak_type:
        return jax.numpy.asarray(value, value.dtype)
    return place(value, None)


def host_operand(x: ArrayLike, where: str) -> Array:
    """A host array operand (not rationals) checked and converted as a session converts one, on the default device.

    >>> host_operand(np.ones(2), "op").dtype
    dtype('float32')
    """
    if isinstance(x, jax.Array):
        return x
    check_value_kind(x, where)
    check_fits_without_x64(x, where)
    return place(x, None)


def read_host_inputs(tape: Tape, ids: Sequence[NodeId]) -> None:
    """A lazy session keeps NumPy inputs on the host for its programs; read, each becomes a jax.Array like every value.

    ``ids`` are nodes holding NumPy arrays; exact rationals (object arrays) stay as they are.

    >>> from tapeflow._core._tape import Node, append_node
    >>> node = Node(None, (), (), np.ones(2, np.float32), False, (2,), np.dtype("float32"))
    >>> t, i = append_node(Tape.empty(), node)
    >>> read_host_inputs(t, [i]); type(t[i].value).__name__
    'ArrayImpl'
    """
    nodes = tape.nodes
    ids = [i for i in ids if nodes[i].dtype != R.OBJECT]
    fill_pending(tape, ids, [place(nodes[i].value, None) for i in ids])


class ParamSource:
    """Values a session records for Param uses instead of the storages' current values.

    ``given`` maps storages to those values (the parameter tracers of a traced
    step, a checkpointed block's operands); a use of a storage it does not list
    reads the storage and is noted in ``unlisted``. Without ``given`` every use
    reads the storage. A view rebuilt by a JAX transformation keeps its own
    value. A subclass may note more in :meth:`read` (``tfl.checkpoint`` notes
    the records a block reads).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> w, b = tfl.Param(jnp.ones(2)), tfl.Param(jnp.zeros(2))
    >>> src = ParamSource({w.storage: jnp.full(2, 5.0)})
    >>> src.read(w).tolist(), src.read(b), src.unlisted == [b.storage]
    ([5.0, 5.0], None, True)
    """

    __slots__ = ("given", "unlisted")

    def __init__(self, given: dict[Storage, Array] | None) -> None:
        self.given = given
        self.unlisted: list[Storage] = []

    def read(self, p: Param) -> Array | None:
        """The value to record for a use of ``p``; None: the session reads it (the storage, or a view's own value)."""
        if p.bound:
            return None
        return self.lookup(p.storage)

    def lookup(self, st: Storage) -> Array | None:
        """The given value of ``st``; None (noting ``st`` as unlisted when values are given) without one."""
        given = self.given
        if given is None:
            return None
        v = given.get(st)
        if v is None and st not in self.unlisted:
            self.unlisted.append(st)
        return v

    def write(self, st: Storage, v: Array) -> None:
        """Give ``st`` the value ``v`` from now on (a traced recording's state write: later uses read it)."""
        if self.given is None:
            self.given = {}
        self.given[st] = v


class ValuePolicy:
    """One session's side of the rule: its device, its rational warning and its cached constant operands.

    ``device`` is the session's device; values meant for JAX's default device
    are left uncommitted there (see the module docstring). ``owner`` names the
    session in the rational warning.

    >>> import jax, jax.numpy as jnp
    >>> pol = ValuePolicy(jax.devices()[0], owner=1)
    >>> pol.constant(2, np.dtype("float32"), "mul").dtype, pol.prepare([1.0, 2.0]).dtype
    (dtype('float32'), dtype('float32'))
    """

    __slots__ = ("constants", "device", "on_default_device", "owner", "rational_warned")

    def __init__(self, device: jax.Device, owner: int) -> None:
        self.device = device
        self.owner = owner
        self.on_default_device = device == default_device()
        self.rational_warned = False
        self.constants: dict[ConstantKey, Array] = {}

    def _placement(self) -> jax.Device | None:
        return None if self.on_default_device else self.device

    def prepare(self, x: ArrayLike, where: str = "Session.input", host: bool = False) -> Array:
        """``x`` checked and converted to enter the tape; a ``jax.Array`` is placed by ``leaf`` itself.

        ``host=True`` (a lazy session's input) keeps a NumPy array on the host on
        the default device, as a copy in JAX's dtype (later edits of ``x`` do not count).
        """
        x = foreign_array(x, where)
        check_value_kind(x, where)
        if isinstance(x, np.ndarray) and x.dtype == R.OBJECT:
            self.warn_rational()
            return x
        if isinstance(x, jax.Array):  # (or a tracer) leaf() moves it if needed, keeping sharded arrays as they are
            return x
        check_fits_without_x64(x, where)
        if host and self.on_default_device and type(x) is np.ndarray:
            return np.array(x, dtype=jax.dtypes.canonicalize_dtype(x.dtype))
        return place(x, self._placement())

    def warn_rational(self) -> None:
        """Warn once per session that exact rationals run on the CPU with NumPy."""
        if not self.rational_warned:
            self.rational_warned = True
            warnings.warn(
                f"exact rational values have no native JAX dtype; session {self.owner} computes them on the CPU "
                f"with NumPy (requested device: {self.device})",
                RationalFallbackWarning,
                stacklevel=4,
            )

    def constant(self, o: object, ref_dtype: np.dtype | None, opname: str) -> Array:
        """A non-handle operand of ``opname`` as a value: a number in ``ref_dtype`` (the other operands'), or an array."""
        if isinstance(o, complex):
            raise TapeError(f"{opname}: {COMPLEX_HINT}")
        if isinstance(o, (bool, int, float)):
            if ref_dtype is not None and ref_dtype == R.OBJECT:
                return np.asarray(Fraction(o), dtype=object)
            dt: np.dtype
            if isinstance(o, bool):
                dt = np.dtype(bool)
            elif ref_dtype is not None and (isinstance(o, int) or R.is_float(ref_dtype)):
                dt = ref_dtype
            else:
                dt = np.dtype(np.float32) if isinstance(o, float) else np.dtype(np.int32)
            key: ConstantKey = (type(o), o, math.copysign(1.0, o), dt)
            c = self.constants.get(key)
            if c is None:
                try:
                    host = np.asarray(o, dtype=dt)
                except OverflowError:
                    raise TapeError(
                        f"{opname}: the constant {o} does not fit the operand dtype {dt}; cast explicitly "
                        '(e.g. x.astype("int64")) or turn on 64-bit values: jax.config.update("jax_enable_x64", True)'
                    ) from None
                c = place(host, self._placement())  # uncommitted, it also mixes with sharded tracers under jit
                if len(self.constants) < _CONSTANT_CACHE_SIZE:
                    self.constants[key] = c
            return c
        if isinstance(o, (np.ndarray, jax.Array, list, tuple, np.generic)):
            return self.prepare(np.asarray(o) if isinstance(o, (list, tuple)) else o, opname)
        if (data := foreign_array(o, opname)) is not o:  # another framework's array (a PyTorch tensor, ...)
            return self.prepare(data, opname)
        raise TapeError(
            f"{opname}: operand of type {type(o).__name__} is not supported; "
            "use a Tensor, a Param, a number or an array"
        )
