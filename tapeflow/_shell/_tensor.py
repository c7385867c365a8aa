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
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeAlias

import jax
import numpy as np
from numpy.typing import ArrayLike

from .._core import _registry as R
from .._core._node import PENDING
from .._core._result import TapeError
from .._core._typing import Array, DTypeLike, NodeId, Shape
from . import _render

if TYPE_CHECKING:
    from .._core._backward import Hook
    from .._core._tape import Node
    from ._session import Session

__all__ = [
    "RemovableHandle",
    "Tensor",
    "TensorOps",
    "apply",
    "check_handle",
    "current_session",
    "host_value",
    "last_recorded_session",
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


class TensorOps:
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
        return apply("add", self, o)

    def __radd__(self, o: Operand) -> Tensor:
        return apply("add", o, self)

    def __sub__(self, o: Operand) -> Tensor:
        return apply("sub", self, o)

    def __rsub__(self, o: Operand) -> Tensor:
        return apply("sub", o, self)

    def __mul__(self, o: Operand) -> Tensor:
        return apply("mul", self, o)

    def __rmul__(self, o: Operand) -> Tensor:
        return apply("mul", o, self)

    def __truediv__(self, o: Operand) -> Tensor:
        return apply("div", self, o)

    def __rtruediv__(self, o: Operand) -> Tensor:
        return apply("div", o, self)

    def __matmul__(self, o: Operand) -> Tensor:
        return apply("matmul", self, o)

    def __rmatmul__(self, o: Operand) -> Tensor:
        return apply("matmul", o, self)

    def __pow__(self, o: Operand) -> Tensor:
        return apply("pow", self, o)

    def __rpow__(self, o: Operand) -> Tensor:
        return apply("pow", o, self)

    def __neg__(self) -> Tensor:
        return apply("neg", self)

    def __abs__(self) -> Tensor:
        return apply("abs", self)

    def __lt__(self, o: Operand) -> Tensor:
        return apply("lt", self, o)

    def __le__(self, o: Operand) -> Tensor:
        return apply("le", self, o)

    def __gt__(self, o: Operand) -> Tensor:
        return apply("gt", self, o)

    def __ge__(self, o: Operand) -> Tensor:
        return apply("ge", self, o)

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

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
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
            f"({s._stale_reason(h._generation)})"
        )
    return s


# --------------------------------------------------------------------------- dispatch


def session_of(operands: tuple[Operand, ...] | list[Operand], opname: str) -> Session:
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
