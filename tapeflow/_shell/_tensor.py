"""Tensor handles, the operator set, and which session an op records on.

* :class:`TensorOps` is the operator set (``+ - * / @ **``, comparisons,
  indexing, ``.T``, ``.sum()`` ...). Every operator records a registry op via
  :func:`apply`. :class:`Tensor` and :class:`~tapeflow.Param` both inherit it,
  so ``w * x`` works on a parameter exactly as on a handle.
* :class:`Tensor` is a handle ``(session, owner, generation, node id)``; any use
  checks it against its session's *current* generation (:func:`check_handle`).
* Which session records an op: the session of the first Tensor operand; else
  the innermost ``with Session()`` block (:func:`current_session`); else the
  session that recorded last **in this thread or task**
  (:func:`last_recorded_session`). Both are :mod:`contextvars` variables:
  every new thread starts with neither, so one thread never records on another
  thread's session by accident (an asyncio task starts from a copy of the
  context that created it).

>>> import jax.numpy as jnp, tapeflow as tfl
>>> with tfl.Session() as s:
...     x = s.input(jnp.arange(3.0))
...     y = (x * 2 + 1).sum()
...     float(y), tfl.current_session() is s
(9.0, True)
"""

from __future__ import annotations

import contextvars
import math
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, TypeAlias

import jax
import numpy as np
from numpy.typing import ArrayLike

from .._core import _registry as R
from .._core._node import PENDING
from .._core._result import TapeError
from .._core._treescope import Rendering, SubtreeRenderer
from .._core._typing import Array, DTypeLike, NodeId, Shape
from . import _render

if TYPE_CHECKING:
    from .._core._backward import Hook
    from .._core._tape import Node
    from ._session import Session
    from ._surface_methods import SurfaceMethods  # the table's methods, generated for type checkers
else:
    SurfaceMethods = object  # bound at import from the table (tapeflow/_shell/_torch.py)

__all__ = [
    "RemovableHandle",
    "Tensor",
    "TensorOps",
    "apply",
    "check_handle",
    "current_session",
    "host_value",
    "last_recorded_session",
    "operand_shape",
    "promote",
    "promoted_div",
    "promoted_pow",
    "record_op",
    "session_of",
]

Operand: TypeAlias = "TensorOps | float | int | ArrayLike"
"""What an op accepts as an operand: a Tensor or a Param (the two kinds of :class:`TensorOps`), a number or an array
(nested lists too)."""


class RemovableHandle:
    """What ``register_hook`` returns: :meth:`remove` takes the hook off again (removing twice is a no-op).

    >>> hooks = []
    >>> h = RemovableHandle(hooks, print)
    >>> len(hooks), h.remove(), len(hooks)
    (1, None, 0)
    """

    __slots__ = ("_fn", "_hooks")

    def __init__(self, hooks: list[Hook], fn: Hook) -> None:
        hooks.append(fn)
        self._hooks: list[Hook] | None = hooks
        self._fn = fn

    def remove(self) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            for k, f in enumerate(hooks):
                if f is self._fn:
                    del hooks[k]
                    break


# --------------------------------------------------------------------------- which session records

_CURRENT: contextvars.ContextVar[Session | None] = contextvars.ContextVar("tapeflow_current_session", default=None)
_LAST_RECORDED: contextvars.ContextVar[weakref.ref[Session] | None] = contextvars.ContextVar(
    "tapeflow_last_recorded_session", default=None
)


def current_session() -> Session | None:
    """The session made current by the innermost ``with Session(...)`` block, or None.

    >>> import tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     tfl.current_session() is s
    True
    >>> tfl.current_session() is None
    True
    """
    return _CURRENT.get()


def last_recorded_session() -> Session | None:
    """The session that recorded the latest leaf or op in this thread (or asyncio task), if alive.

    An op whose operands are all Params (``w.T``) records there when no
    ``with Session()`` block is open, so notebook code outside a ``with`` block
    keeps working; mixing the result with another session's handles is then
    reported as a session mismatch. Each thread starts with no such session.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> s = tfl.Session()
    >>> _ = s.input(jnp.ones(2))
    >>> tfl.last_recorded_session() is s
    True
    """
    ref = _LAST_RECORDED.get()
    return None if ref is None else ref()


def note_recorded(ref: weakref.ref[Session]) -> None:
    """Remember ``ref``'s session as the last one that recorded in this context (cheap when unchanged)."""
    if _LAST_RECORDED.get() is not ref:
        _LAST_RECORDED.set(ref)


def push_current(s: Session) -> contextvars.Token[Session | None]:
    """Make ``s`` the current session; undo with :func:`pop_current`."""
    return _CURRENT.set(s)


def pop_current(token: contextvars.Token[Session | None]) -> None:
    _CURRENT.reset(token)


# --------------------------------------------------------------------------- PyTorch's type promotion

_BOOL_DT = np.dtype(bool)
_FLOAT_DT = np.dtype(np.float32)  # PyTorch's default float dtype, what a Python float promotes to
_KIND: dict[np.dtype, int] = {}  # dtype -> 0 bool, 1 integer, 2 floating, 3 complex, -1 neither (exact rationals)
_RESULT: dict[tuple[np.dtype | None, np.dtype | None, np.dtype | None], np.dtype | None] = {}


def _kind(dt: np.dtype) -> int:
    k = _KIND.get(dt)
    if k is None:
        if dt == _BOOL_DT:
            k = 0
        elif np.issubdtype(dt, np.integer):
            k = 1
        elif np.issubdtype(dt, np.complexfloating):
            k = 3
        elif jax.numpy.issubdtype(dt, jax.numpy.floating):  # bfloat16 and the float8 types too
            k = 2
        else:
            k = -1
        _KIND[dt] = k
    return k


def _join(a: np.dtype | None, b: np.dtype) -> np.dtype:
    return b if a is None or a == b else np.dtype(jax.numpy.promote_types(a, b))


def _combine(higher: np.dtype | None, lower: np.dtype | None) -> np.dtype | None:
    """PyTorch's rule for two priority classes: ``lower`` counts only where its kind is above ``higher``'s."""
    if higher is None or lower is None:
        return lower if higher is None else higher
    kh, kl = _kind(higher), _kind(lower)
    if kh == 3 or (kh == 2 and kl < 3):
        return higher
    if kl == 3:
        return np.dtype(jax.numpy.promote_types(higher, np.complex64)) if kh == 2 else lower
    if kh == 0 or kl == 2:
        return _join(higher, lower)
    return higher


def _result(dims: np.dtype | None, zeros: np.dtype | None, scalars: np.dtype | None) -> np.dtype | None:
    key = (dims, zeros, scalars)
    got = _RESULT.get(key, _RESULT)
    if got is _RESULT:
        r = _combine(dims, _combine(zeros, scalars))
        got = None if r is None else np.dtype(jax.dtypes.canonicalize_dtype(r))  # int64 -> int32 without x64
        _RESULT[key] = got
    return got  # type: ignore[return-value]


def _scalar_dtype(o: object) -> np.dtype:
    """The dtype PyTorch gives a Python number: bool, int64 (JAX's canonical int), the default float dtype."""
    if isinstance(o, (bool, np.bool_)):
        return _BOOL_DT
    if isinstance(o, (int, np.integer)):
        return np.dtype(jax.dtypes.canonicalize_dtype(np.int64))
    if isinstance(o, (float, np.floating)):
        return _FLOAT_DT
    return np.dtype(np.complex64)


_PY = {0: bool, 1: int, 2: float, 3: complex}


def promote(operands: tuple[Operand, ...]) -> tuple[Operand, ...]:
    """``operands`` cast to the dtype PyTorch's ``torch.result_type`` gives them (the PyTorch surface's arithmetic).

    PyTorch ranks the kinds bool < integer < floating < complex. Tensors with
    dimensions decide the dtype; 0-d tensors and then Python numbers (weak)
    count only when their kind is above every tensor's: ``int32 + float32`` is
    float32, ``float16 + 0-d float32`` float16, ``int32 * 1.5`` float32,
    ``bool + 1`` int. int64 / float64 become JAX's int32 / float32 without
    ``jax_enable_x64``. Tensors and Params are cast with the ``astype`` op (its
    gradient flows back), arrays cast directly, numbers become the result's
    Python type; operands already of the result's dtype are returned as they
    are. The registry's ops themselves never promote.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     i, f = s.input(jnp.arange(2)), s.input(jnp.ones(2, jnp.float16))
    ...     [o.dtype.name if hasattr(o, "dtype") else o for o in promote((i, f, 2))]
    ['float16', 'float16', 2.0]
    """
    if len(operands) == 2:  # the common cases first: two tensors of one dtype, a tensor and a number of its kind
        a, b = operands
        ta, tb = type(a), type(b)
        if ta is Tensor:
            if (tb is Tensor or isinstance(b, TensorOps)) and a.dtype is b.dtype:  # type: ignore[union-attr]
                return operands  # (a Param of the handle's dtype too)
            if tb is float or tb is int:
                k = _KIND.get(a.dtype)  # type: ignore[union-attr]
                if k == 2 or (k == 1 and tb is int):
                    return operands
        elif tb is Tensor and (ta is float or ta is int):
            k = _KIND.get(b.dtype)  # type: ignore[union-attr]
            if k == 2 or (k == 1 and ta is int):
                return operands
    dims = zeros = scalars = None
    handles = False
    for o in operands:
        t = type(o)
        if t is float or t is int or t is bool or isinstance(o, (int, float, complex, np.generic)):
            scalars = _join(scalars, _scalar_dtype(o))
            continue
        if isinstance(o, TensorOps):
            handles = True
            dt, shape = o.dtype, o.shape  # type: ignore[attr-defined]
        elif isinstance(o, (np.ndarray, jax.Array)):
            dt, shape = o.dtype, o.shape
        else:  # lists, another framework's arrays: their host value's dtype
            a = np.asarray(o)
            dt, shape = a.dtype, a.shape
        dt = np.dtype(dt)
        if _kind(dt) < 0:
            return operands  # exact rationals (object arrays): no promotion
        if shape:
            dims = _join(dims, dt)
        else:
            zeros = _join(zeros, dt)
    want = _result(dims, zeros, scalars)
    if want is None:
        return operands
    kind = _kind(want)
    out: list[Operand] = []
    for o in operands:
        if isinstance(o, TensorOps):
            out.append(o if o.dtype == want else apply("astype", o, dtype=want))  # type: ignore[attr-defined]
        elif isinstance(o, (int, float, complex, np.generic)):
            # a number takes the dtype of the handle operands it is recorded with; alone, it is an array
            out.append(_PY[kind](o) if handles else np.asarray(o, want))
        elif isinstance(o, jax.Array):
            out.append(o if o.dtype == want else o.astype(want))
        else:
            a = np.asarray(o)
            out.append(o if a.dtype == want else a.astype(want))
    return tuple(out)


def promoted_div(a: Operand, b: Operand) -> Tensor:
    """``a / b`` as PyTorch divides: operands promoted (:func:`promote`), integers and booleans divided as float32.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     promoted_div(s.input(jnp.array([1, 3])), 2).tolist()
    [0.5, 1.5]
    """
    a, b = promote((a, b))
    if _kind(_operand_dtype(a)) < 2 and _kind(_operand_dtype(b)) < 2:
        a, b = promote((a, b, 1.0))[:2]  # true division: the default float dtype
    return apply("div", a, b)


def promoted_pow(a: Operand, b: Operand) -> Tensor:
    """``a ** b`` as PyTorch raises: operands promoted (:func:`promote`); integers stay integers (no gradient).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     i = s.input(jnp.array([2, 3]))
    ...     promoted_pow(i, 2).tolist(), promoted_pow(i, 0.5).dtype.name
    ([4, 9], 'float32')
    """
    a, b = promote((a, b))
    if _kind(_operand_dtype(a)) < 2:  # the pow op takes floats: integer powers are jax.numpy's
        from ._numpy import record

        if not any(isinstance(o, TensorOps) for o in (a, b)):
            a = np.asarray(a)
        return record("power", a, b)
    return apply("pow", a, b)


def _operand_dtype(o: Operand) -> np.dtype:
    """The dtype of an operand after :func:`promote` (a Python number: the dtype it promotes as)."""
    dt = getattr(o, "dtype", None)
    return _scalar_dtype(o) if dt is None else np.dtype(dt)


# --------------------------------------------------------------------------- the operator set


def torch_alias(opname: str, value: object, default: object, alias: object, names: tuple[str, str]) -> object:
    """``value`` (NumPy's ``axis=`` / ``keepdims=``), or ``alias`` (PyTorch's ``dim=`` / ``keepdim=``) when given.

    Giving both (``value`` not at its ``default``) is an error: the one rule of
    op functions and Tensor methods alike.

    >>> torch_alias("sum", None, None, [0, 1], ("axis", "dim"))
    (0, 1)
    """
    if alias is None:
        return value
    if value is not default and value != default:
        raise TypeError(f"{opname}: pass {names[0]}= or {names[1]}= (the same thing), not both")
    return tuple(alias) if isinstance(alias, list) else alias


class TensorOps(SurfaceMethods):
    """The operators shared by :class:`Tensor` handles and :class:`~tapeflow.Param` s.

    Each one records a registry op with :func:`apply`; a Param operand records a
    fresh leaf holding its current value.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> w = tfl.Param(jnp.ones((2, 2)))
    >>> with tfl.Session() as s:
    ...     (w.T @ w).sum().value.item()
    8.0
    """

    __slots__ = ()
    __array_priority__ = 1000

    def __add__(self, o: Operand) -> Tensor:
        if type(o) is Tensor and o.dtype is self.dtype:  # type: ignore[attr-defined]
            return apply("add", self, o)
        return apply("add", *promote((self, o)))

    def __radd__(self, o: Operand) -> Tensor:
        if type(o) is Tensor and o.dtype is self.dtype:  # type: ignore[attr-defined]
            return apply("add", o, self)
        return apply("add", *promote((o, self)))

    def __sub__(self, o: Operand) -> Tensor:
        if type(o) is Tensor and o.dtype is self.dtype:  # type: ignore[attr-defined]
            return apply("sub", self, o)
        return apply("sub", *promote((self, o)))

    def __rsub__(self, o: Operand) -> Tensor:
        if type(o) is Tensor and o.dtype is self.dtype:  # type: ignore[attr-defined]
            return apply("sub", o, self)
        return apply("sub", *promote((o, self)))

    def __mul__(self, o: Operand) -> Tensor:
        if type(o) is Tensor and o.dtype is self.dtype:  # type: ignore[attr-defined]
            return apply("mul", self, o)
        return apply("mul", *promote((self, o)))

    def __rmul__(self, o: Operand) -> Tensor:
        if type(o) is Tensor and o.dtype is self.dtype:  # type: ignore[attr-defined]
            return apply("mul", o, self)
        return apply("mul", *promote((o, self)))

    def __truediv__(self, o: Operand) -> Tensor:
        if type(o) is Tensor and o.dtype is self.dtype and _kind(o.dtype) == 2:  # type: ignore[attr-defined]
            return apply("div", self, o)
        return promoted_div(self, o)

    def __rtruediv__(self, o: Operand) -> Tensor:
        if type(o) is Tensor and o.dtype is self.dtype and _kind(o.dtype) == 2:  # type: ignore[attr-defined]
            return apply("div", o, self)
        return promoted_div(o, self)

    def __matmul__(self, o: Operand) -> Tensor:
        return apply("matmul", self, o)

    def __rmatmul__(self, o: Operand) -> Tensor:
        return apply("matmul", o, self)

    def __pow__(self, o: Operand) -> Tensor:
        if type(o) is Tensor and o.dtype is self.dtype and _kind(o.dtype) == 2:  # type: ignore[attr-defined]
            return apply("pow", self, o)
        return promoted_pow(self, o)

    def __rpow__(self, o: Operand) -> Tensor:
        if type(o) is Tensor and o.dtype is self.dtype and _kind(o.dtype) == 2:  # type: ignore[attr-defined]
            return apply("pow", o, self)
        return promoted_pow(o, self)

    def __neg__(self) -> Tensor:
        return apply("neg", self)

    def __abs__(self) -> Tensor:
        return apply("abs", self)

    def __lt__(self, o: Operand) -> Tensor:
        if type(o) is Tensor and o.dtype is self.dtype:  # type: ignore[attr-defined]
            return apply("lt", self, o)
        return apply("lt", *promote((self, o)))

    def __le__(self, o: Operand) -> Tensor:
        if type(o) is Tensor and o.dtype is self.dtype:  # type: ignore[attr-defined]
            return apply("le", self, o)
        return apply("le", *promote((self, o)))

    def __gt__(self, o: Operand) -> Tensor:
        if type(o) is Tensor and o.dtype is self.dtype:  # type: ignore[attr-defined]
            return apply("gt", self, o)
        return apply("gt", *promote((self, o)))

    def __ge__(self, o: Operand) -> Tensor:
        if type(o) is Tensor and o.dtype is self.dtype:  # type: ignore[attr-defined]
            return apply("ge", self, o)
        return apply("ge", *promote((self, o)))

    def __getitem__(self, idx: object) -> Tensor:
        """Basic indexing records ``index``; an integer array or Tensor index records ``take`` along axis 0.

        A boolean mask (of the leading axes' shape) selects as NumPy does, ``x[x > 0]``: its value is read (a
        lazy session computes it) and the positions it picks are taken; under a compiled step, where shapes
        must not depend on values, it is refused with the shape-keeping alternative, ``tfl.where``.
        """
        if isinstance(idx, (Tensor, np.ndarray, jax.Array, list)):
            positions = _mask_positions(getattr(self, "shape"), idx)  # noqa: B009  (Tensor and Param define it)
            if positions is not None:
                lead, rest, picked = positions
                flat = self if len(lead) == 1 else apply("reshape", self, shape=(math.prod(lead), *rest))
                return apply("take", flat, picked.astype(np.int32), axis=0)
            return apply("take", self, idx, axis=0)
        from .._ops._shape import normalize_index

        return apply("index", self, index=normalize_index(idx))

    def __iter__(self) -> Iterator[Tensor]:
        """Iterate over the first axis: ``x[0], x[1], ...``, each recorded as it is reached."""
        shape: Shape = getattr(self, "shape")  # noqa: B009  (Tensor and Param both define it)
        if not shape:
            raise TypeError("iteration over a 0-d tensor")
        return (self[i] for i in range(shape[0]))

    def astype(self, dtype: DTypeLike) -> Tensor:
        """The value cast to ``dtype`` (NumPy's name; ``x.to(dtype)`` is PyTorch's), recorded as ``astype``."""
        return apply("astype", self, dtype=np.dtype(dtype))


# --------------------------------------------------------------------------- handles


class Tensor(TensorOps):
    """A handle to one node of a session's current recording.

    It carries (owner, generation, node id) plus the node's shape and dtype. Any
    use checks that the handle belongs to its session's *current* generation.
    Operators build new recorded ops (see :class:`TensorOps`); comparisons give
    boolean tensors without gradient.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> s = tfl.Session()
    >>> x = s.input(jnp.arange(6.0).reshape(2, 3))
    >>> y = (x * 2).sum(axis=1)
    >>> y.shape, float(y[0])
    ((2,), 6.0)
    """

    __slots__ = ("__weakref__", "_generation", "_owner", "_session", "dtype", "id", "shape")
    __hash__ = object.__hash__

    def __init__(
        self, session: Session | None, owner: int, generation: int, id: NodeId, shape: Shape, dtype: np.dtype
    ) -> None:
        self._session = session
        self._owner = owner
        self._generation = generation
        self.id = id
        self.shape = shape
        self.dtype = dtype

    # -- identity --------------------------------------------------------------
    @property
    def owner(self) -> int:
        """Owner id of the session that recorded this handle."""
        return self._owner

    @property
    def generation(self) -> int:
        """The session generation this handle was recorded in."""
        return self._generation

    @property
    def session(self) -> Session | None:
        """The session that recorded this handle."""
        return self._session

    @property
    def node(self) -> Node:
        """The recorded :class:`~tapeflow.Node` this handle points at (a lazy session computes its value first)."""
        return check_handle(self, self._session).node(self)

    @property
    def value(self) -> Array:
        """The forward value (a ``jax.Array``; a NumPy object array for exact rationals)."""
        return check_handle(self, self._session).value(self)

    def register_hook(self, fn: Hook) -> RemovableHandle:
        """Call ``fn(cotangent)`` when a backward of this recording reaches this node.

        ``fn`` sees the node's complete cotangent (every use summed) before it
        flows to the node's inputs, and may return a replacement of the same
        shape and dtype (None keeps it). Under ``create_graph=True`` it gets and
        returns Tensors. Hooks end with the recording (``reset``).

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> with tfl.Session() as s:
        ...     x = s.input(jnp.ones(2), requires_grad=True)
        ...     h = x * 3.0
        ...     hook = h.register_hook(lambda g: g * 0.5)
        ...     s.backward(tfl.sum(h))[x].tolist()
        [1.5, 1.5]
        """
        return check_handle(self, self._session).register_hook(self, fn)

    @property
    def op(self) -> str | None:
        """The name of the op that made this value (None for a leaf: an input or a Param's value)."""
        return check_handle(self, self._session).recording[self.id].op  # no value needed: a lazy node stays pending

    @property
    def requires_grad(self) -> bool:
        """Whether a backward of this recording gives this value a gradient (it depends on a Param or tracked input)."""
        return bool(check_handle(self, self._session).recording[self.id].requires_grad)

    def __array__(self, dtype: DTypeLike | None = None, copy: bool | None = None) -> np.ndarray:
        v = host_value(self, "np.asarray()")
        return v if dtype is None else v.astype(dtype)

    def _scalar(self, what: str) -> np.ndarray:
        if self.shape not in ((), (1,)):
            if what == "bool":
                raise TypeError(
                    f"the truth value of a tensor of shape {self.shape} is ambiguous; use .value.any() or .value.all()"
                )
            raise TypeError(f"{what}() needs a tensor with one element, got shape {self.shape}")
        return host_value(self, f"{what}()").reshape(())

    def __float__(self) -> float:
        return float(self._scalar("float"))

    def __int__(self) -> int:
        return int(self._scalar("int"))  # exact for integers (no detour through a float's 53 bits)

    def __bool__(self) -> bool:
        return bool(self._scalar("bool"))

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __repr__(self) -> str:
        spec = R.fmt_spec((self.shape, self.dtype))
        s = self._session
        if s is None or s.owner != self._owner:
            state = "no session" if s is None else "foreign"
            return f"Tensor({spec}, id={self.id}, gen={self._generation}, {state})"
        if s.generation != self._generation:
            return f"Tensor({spec}, id={self.id}, gen={self._generation}, stale)"
        nd = s.recording[self.id]
        op = "leaf" if nd.op is None else nd.op
        grad = ", requires_grad" if nd.requires_grad else ""
        # the value of a small tensor that has one (a lazy node stays pending: repr never computes)
        v = nd.value
        if v is not PENDING and v is not None and np.size(v) <= _REPR_SIZE and not isinstance(v, jax.core.Tracer):
            return f"Tensor({_values_text(v)}, {spec}, op={op}, id={self.id}, gen={self._generation}{grad})"
        return f"Tensor({spec}, op={op}, id={self.id}, gen={self._generation}{grad})"

    def __str__(self) -> str:
        """The value (read: a lazy session computes it), summarized as NumPy does past 1000 elements, and the op."""
        s = self._session
        if s is None or s.owner != self._owner or s.generation != self._generation:
            return repr(self)
        v = self.value
        if isinstance(v, jax.core.Tracer):
            return repr(self)
        nd = s.recording[self.id]
        op = "leaf" if nd.op is None else nd.op
        grad = ", requires_grad" if nd.requires_grad else ""
        return f"Tensor({_values_text(v)}, op={op}{grad})"

    def __format__(self, spec: str) -> str:
        """``f"{loss:.4f}"``: a one-element tensor formats its value as a Python number; ``f"{t}"`` is ``str``."""
        if not spec:
            return str(self)
        x = self._scalar("format")
        return format(x.item(), spec)

    def __treescope_repr__(self, path: str | None, subtree_renderer: SubtreeRenderer) -> Rendering:
        return _render.render_tensor(self, path, subtree_renderer)  # treescope picture (tapeflow[viz])

    # -- operators only handles have --------------------------------------------
    def __pos__(self) -> Tensor:
        return self

    def __eq__(self, o: Operand) -> Tensor:  # type: ignore[override]
        return apply("eq", self, o)

    def __ne__(self, o: Operand) -> Tensor:  # type: ignore[override]
        return apply("ne", self, o)


def host_value(x: TensorOps | ArrayLike, what: str) -> np.ndarray:
    """``x``'s value on the host; inside a compiled step (a traced value) an error that says where to read it.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     host_value(s.input(jnp.ones(2)), "numpy()").tolist()
    [1.0, 1.0]
    """
    v = x.value if isinstance(x, TensorOps) else x  # type: ignore[attr-defined]
    if isinstance(v, jax.core.Tracer):
        raise TapeError(
            f"{what} of {x!r}: inside a compiled step (train_step, value_and_grad under jax.jit) a value "
            "exists only when the program runs; return it from loss_fn (train_step returns the loss, and "
            "auxiliary values with has_aux=True) and read it after the step, or print it with jax.debug.print"
        )
    return np.asarray(v)


def _mask_positions(shape: Shape, idx: object) -> tuple[tuple[int, ...], tuple[int, ...], np.ndarray] | None:
    """For a boolean mask ``idx`` of a tensor of ``shape``: ``(mask shape, the other axes, flat positions)``; else None."""
    dt = getattr(idx, "dtype", None)
    if dt is None:  # a list
        dt = np.asarray(idx).dtype
    if np.dtype(dt) != np.dtype(bool):
        return None
    mask = idx.value if isinstance(idx, Tensor) else idx
    if isinstance(mask, jax.core.Tracer):
        raise TapeError(
            "x[mask]: a boolean mask selects a number of elements that depends on its values, which a compiled "
            "step (train_step, value_and_grad under jax.jit) cannot record; keep the shape with "
            "tfl.where(mask, x, 0) and, for a mean over the selected elements, divide by tfl.sum(mask)"
        )
    m = np.asarray(mask)
    shape = tuple(shape)
    if m.ndim == 0 or m.shape != shape[: m.ndim]:
        raise TapeError(
            f"x[mask]: a mask of shape {m.shape} does not fit a tensor of shape {shape}: it must have the shape of "
            f"the tensor's leading axes (e.g. {shape} or {shape[:1]})"
        )
    return m.shape, shape[m.ndim :], np.flatnonzero(m)


_REPR_SIZE = 16  # repr shows the values of tensors this small (str shows every tensor's)


def _values_text(v: object) -> str:
    """A value as NumPy prints it on one line per row, summarized past 1000 elements, as PyTorch prints tensors."""
    a = np.asarray(v)
    if a.ndim == 0:
        return np.array2string(a, precision=4, floatmode="maxprec")
    return np.array2string(
        a, precision=4, separator=", ", threshold=1000, edgeitems=3, floatmode="maxprec", prefix="Tensor("
    )


def check_handle(h: Tensor, s: Session | None) -> Session:
    """Raise :class:`TapeError` unless ``h`` belongs to ``s`` (default: its own session) and its current generation.

    A session mismatch is reported before a use from a thread that may not use
    the session (:meth:`Session.check_thread`), and that before a stale generation.
    """
    hs = h._session
    if hs is None:
        raise TapeError(
            "tensor handle has no owning session (it was not produced by a Session op); "
            "create tensors with session.input(...) or session ops"
        )
    if s is None:
        s = hs
    if h._owner != s.owner:
        raise TapeError(
            f"tensor handle belongs to a different session (owner {h._owner}, this session is owner {s.owner}); "
            "handles cannot be mixed across sessions: pass the value with session.input(handle.value)"
        )
    s.check_thread()
    if h._generation != s.generation:
        raise TapeError(
            f"stale tensor handle from generation {h._generation}; current generation is {s.generation} "
            f"({s.stale_reason(h._generation)})"
        )
    return s


# --------------------------------------------------------------------------- dispatch


def operand_shape(x: Operand) -> Shape:
    """The shape of an operand (Tensor, Param, array, number or nested list), read without recording anything.

    >>> operand_shape([[1, 2, 3]]), operand_shape(2.0)
    ((1, 3), ())
    """
    got = getattr(x, "shape", None)
    return tuple(int(d) for d in (np.shape(np.asarray(x)) if got is None else got))


def session_of(operands: Sequence[Operand], opname: str) -> Session:
    """The session an op on ``operands`` records on (see the module docstring for the order)."""
    for o in operands:
        if isinstance(o, Tensor):
            s = o._session
            if s is None:
                check_handle(o, None)  # raises the ownerless-handle error
            assert s is not None
            return s
    s = _CURRENT.get() or last_recorded_session()
    if s is None:
        raise TapeError(
            f"{opname}: no session to record on: none of the operands is a Tensor, no session is current, "
            "and no session has recorded anything yet in this thread. Use `with tfl.Session() as s:` or pass "
            "a tensor from s.input(...)"
        )
    return s


def apply(opname: str, *operands: Operand, **attrs: object) -> Tensor:
    """Record registered op ``opname`` on the operands' session and return the new handle.

    Operands may be :class:`Tensor` handles, :class:`~tapeflow.Param` s (each
    recorded as a fresh leaf), numbers or arrays (constant leaves). The session
    is that of the first Tensor operand, else the current session.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     y = tfl.apply("add", s.input(jnp.ones(2)), 1.0)
    ...     y.value.tolist()
    [2.0, 2.0]
    """
    return record_op(opname, operands, attrs)


def record_op(opname: str, operands: tuple[Operand, ...], attrs: dict[str, object]) -> Tensor:
    """:func:`apply` with the operands as a tuple and the attributes as a dict (what each ``tfl.<op>`` calls).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> with tfl.Session() as s:
    ...     record_op("add", (s.input(jnp.ones(2)), 1.0), {}).value.tolist()
    [2.0, 2.0]
    """
    for o in operands:  # session_of, inlined: this is every op function's first step
        if isinstance(o, Tensor):
            s = o._session
            if s is not None:
                return s.record_op(opname, operands, attrs)
            break
    return session_of(operands, opname).record_op(opname, operands, attrs)
