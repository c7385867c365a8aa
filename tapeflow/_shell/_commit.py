"""The one way user-visible state changes: check everything, then write everything, or write nothing.

Every change a user can observe between two calls (Param storages, an
optimizer's state, state cells such as BatchNorm's running statistics, a
session's RNG counter, a compiled step's counters, a restored checkpoint, a
loaded state dict) goes through :func:`commit`:

1. every new storage value is checked first: no JAX tracer (a value being
   traced inside ``jax.jit``/``grad``/``vmap`` would outlive its trace and
   destroy the model), the storage's shape and dtype (weak types are made
   definite); the first problem raises :class:`StateWriteError` and nothing
   has been written;
2. then, with Ctrl-C held off (:class:`~tapeflow._core._interrupts.deferred_interrupts`),
   every storage is written and every ``then`` setter runs, so an interrupt
   lands before or after the whole change, never inside it.

Setters passed as ``then`` must not fail (plain attribute assignments);
anything that can fail belongs in the check phase of the caller.

>>> import jax.numpy as jnp, tapeflow as tfl
>>> st = tfl.Storage(jnp.zeros(2))
>>> commit([(st, jnp.ones(2))], where="example")
>>> st.read_current().tolist()
[1.0, 1.0]
>>> try:
...     commit([(st, jnp.ones(3))], where="example")
... except StateWriteError as e:
...     print(str(e).split(";")[0])
example: cannot write a float32[3] value into <Storage #... float32[2]>
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, cast

import jax
import jax.numpy as jnp
import numpy as np

from .._core import _registry as R
from .._core._device import concrete_array_type, device_of
from .._core._interrupts import deferred_interrupts
from .._core._result import TapeError
from .._core._typing import Array, ArrayLike

if TYPE_CHECKING:
    from ._params import Storage  # commit sits below _params: Param.value writes through it

__all__ = ["StateWriteError", "check_write", "commit", "traced_write"]


class StateWriteError(TapeError):
    """A state write was refused before anything changed (a tracer, or a value of the wrong shape or dtype).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> w = tfl.Param(jnp.zeros(2), name="w")
    >>> try:
    ...     w.value = jnp.zeros(3)
    ... except tfl.StateWriteError as e:
    ...     print(type(e).__mro__[1].__name__, w.value.shape)
    TapeError (2,)
    """


def traced_write(where: str, what: str) -> StateWriteError:
    """The refusal of a write whose value (``what``) is being traced by JAX: a storage never holds a tracer.

    >>> message = traced_write("train_step", "the batch").args[0]
    >>> print(message.split(";")[0])  # doctest: +NORMALIZE_WHITESPACE
    train_step: the batch is being traced by JAX (inside jax.jit, jax.grad, jax.vmap,
      ...), so it cannot be stored: train_step writes parameters and state, and a
      storage never holds a tracer
    """
    return StateWriteError(
        f"{where}: {what} is being traced by JAX (inside jax.jit, jax.grad, jax.vmap, ...), "
        f"so it cannot be stored: {where} writes parameters and state, and a storage never holds a tracer; "
        f"nothing was written. Run {where} outside the transformation, or use tfl.value_and_grad for a pure "
        "function that returns the new values instead of writing them"
    )


def check_write(st: Storage, value: ArrayLike, where: str, label: str | None = None) -> Array | np.ndarray:
    """``value`` as it will be stored in ``st`` (a definite-typed array), or :class:`StateWriteError`.

    ``label`` names the parameter in the message (default: the storage's repr).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> check_write(tfl.Storage(jnp.zeros(())), 1.0, "example").dtype
    dtype('float32')
    """
    what = repr(st) if label is None else label
    if isinstance(value, jax.core.Tracer):
        raise traced_write(where, f"the new value of {what}")
    v: Array | np.ndarray
    if isinstance(value, jax.Array):
        v = value
    elif st.dtype == R.OBJECT:  # exact rationals stay NumPy object arrays
        v = np.asarray(value, dtype=object)
    else:
        v = jnp.asarray(value, st.dtype if isinstance(value, (int, float, bool)) else None)
    shape, dtype = tuple(v.shape), np.dtype(v.dtype)
    if shape != st.shape or dtype != st.dtype:
        raise StateWriteError(
            f"{where}: cannot write a {R.fmt_spec((shape, dtype))} value into {what}; a parameter keeps its "
            f"shape and dtype {R.fmt_spec((st.shape, st.dtype))} (create a new Param to change them); "
            "nothing was written"
        )
    if isinstance(v, jax.Array) and v.weak_type:
        v = jnp.asarray(v, st.dtype)
    return v


def _plain(v: Array, st: Storage) -> bool:
    """``v`` (a concrete array) has the storage's shape and dtype and is not weakly typed."""
    return not v.weak_type and v.shape == st.shape and v.dtype == st.dtype


def commit(
    writes: Iterable[tuple[Storage, ArrayLike]] = (),
    *,
    where: str,
    label: Callable[[int], str] | None = None,
    then: Iterable[Callable[[], None]] = (),
    replacing: Sequence[Array] | None = None,
    traced: bool = False,
) -> None:
    """Check every ``(storage, value)`` of ``writes``, then write them all and run ``then``, as one unit.

    ``where`` names the caller in error messages (``"Optimizer.step"``,
    ``"restore"``); ``label(k)`` names the parameter of write ``k`` (called
    only for a message). ``replacing`` (the fast path of a single-device
    program) holds the current values the first ``len(replacing)`` writes
    replace, as :meth:`Storage.read_current_many` returned them and the
    program read them: a new value that lives on the device of the value it
    replaces goes into that cell without placement. Every other value on
    another device than its host cell (a program over several devices hands
    back values placed by XLA) becomes the device mirror
    (:meth:`Storage.write` with ``on_device=True``). A storage placed by
    :func:`tfl.shard <tapeflow.shard>` (:attr:`Storage.pinned`) gets each new
    value on its sharding, wherever the value was computed.

    ``traced=True``: the values of ``replacing`` are outputs of one compiled
    program whose trace checked each against its storage (shape, dtype, never
    weakly typed: :func:`tapeflow._train._step.step`), so a concrete output of
    that program has them; commit then checks that they are concrete arrays
    (no tracer), that the first lives on one device and that every old cell
    lives there (one program's outputs share its one device), and writes them
    all in place with no call per value; otherwise it checks each as usual.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> a, b = tfl.Storage(jnp.zeros(1)), tfl.Storage(jnp.zeros(1))
    >>> log = []
    >>> writes = [(a, jnp.ones(1)), (b, jnp.full(1, 2.0))]
    >>> commit(writes, where="example", then=[lambda: log.append("done")])
    >>> a.read_current().tolist(), b.read_current().tolist(), log
    ([1.0], [2.0], ['done'])
    """
    pairs = list(writes)
    olds = () if replacing is None else replacing
    n_old = len(olds)
    concrete = concrete_array_type()
    fast_cells: list[Storage] = []  # the writes that replace their current cell in place
    fast_values: list[Array] = []
    placed: list[tuple[Storage, Array | np.ndarray]] = []
    start, on = 0, None
    if traced and 0 < n_old <= len(pairs):
        # one single-device program's outputs live on its one device: if the first is a concrete array there
        # and every old cell lives there too, every write is in place (no per-value call)
        news = [v for _, v in pairs[:n_old]]
        if operator.countOf(map(type, news), concrete) == n_old:
            on = device_of(news[0])
            cells = [st for st, _ in pairs[:n_old]]
            if on is not None and type(cells[0]).all_on(cells, on):
                fast_cells, fast_values, start = cells, news, n_old
    for k in range(start, len(pairs)):
        st, v = pairs[k]
        got: Array | np.ndarray
        if type(v) is concrete and _plain(cast(Array, v), st):
            got = cast(Array, v)  # the common case: a concrete array of the storage's spec
        else:
            got = check_write(st, v, where, None if label is None else label(k))  # raises, or the checked value
        pin = st.pinned
        if pin is not None and isinstance(got, jax.Array) and got.sharding != pin:
            got = jax.device_put(got, pin)  # a placed storage keeps its placement, whatever computed the value
        if k < n_old and device_of(got) == device_of(olds[k]):
            fast_cells.append(st)
            fast_values.append(cast(Array, got))
        else:
            placed.append((st, got))
    setters = list(then)
    with deferred_interrupts():
        if fast_cells:
            type(fast_cells[0]).write_current_many(fast_cells, fast_values, on if start else None)
        for st, v in placed:
            st.write(v, on_device=True)
        for f in setters:
            f()
