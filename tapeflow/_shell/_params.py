"""Parameters and their storage identity.

A :class:`Param` is a small public record (name, trainable flag) pointing at a
:class:`Storage`: the mutable cells that hold the parameter's value. Two
records alias exactly when they point at the *same* storage object;
:func:`tie` is the only way to make that happen. Equal values or equal names
never make two parameters aliases.

>>> import jax.numpy as jnp, tapeflow as tfl
>>> w = tfl.Param(jnp.zeros((3, 2)), name="w")
>>> w_out = tfl.tie(w, name="w_out")
>>> other = tfl.Param(jnp.zeros((3, 2)), name="w")
>>> tfl.canonical_indices([w.storage, None, w_out.storage, other.storage])
[0, None, 0, 3]
"""

from __future__ import annotations

import copy
import itertools
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol, TypeAlias, cast

import jax
import numpy as np

from .._core import _registry as R
from .._core._device import device_of
from .._core._treescope import Rendering, SubtreeRenderer
from .._core._typing import Array, ArrayLike, DTypeLike
from . import _render
from ._commit import commit
from ._tensor import RemovableHandle, TensorOps
from ._values import check_value_kind, stored

__all__ = [
    "HasNamedParameters",
    "HasParameterRecords",
    "Param",
    "ParamTarget",
    "Storage",
    "canonical_indices",
    "registrations",
    "tie",
]

_storage_ids = itertools.count()
_storage_lock = threading.Lock()


def _check_trainable(trainable: object, where: str) -> bool:
    if not isinstance(trainable, (bool, np.bool_)):
        raise TypeError(f"{where}: trainable must be a bool, got {type(trainable).__name__} {trainable!r:.40}")
    return bool(trainable)


class _Several:
    """Where a storage's current value lives when it is not one device (several, a tracer, host data)."""


_SEVERAL = _Several()


class Storage:
    """The mutable cells of one parameter: host value, device mirror, host-current flag.

    Identity is the storage object itself; nothing here reads or compares
    tensor elements. ``shape`` and ``dtype`` are fixed at creation.

    * ``value`` (host cell): the value as last written on the host.
    * ``mirror`` (device cell): the same value on a session's device, reused by
      every later use on that device instead of uploading again.
    * ``host_current``: False when an update wrote the mirror and the host cell
      is stale; reading :attr:`Param.value` synchronizes it first.

    :meth:`read` / :meth:`write` place and check values; :meth:`read_current` /
    :meth:`write_current` (and their one-call forms for many storages, which a
    compiled training step uses) are the unchecked fast path they are built on.
    """

    # _current is the value of the current cell (_host when _host_current, else _mirror);
    # write_current_many, the one cell update, and read_host's sync keep it so
    __slots__ = (
        "__weakref__",
        "_current",
        "_host",
        "_host_current",
        "_mirror",
        "_on",
        "_pinned",
        "dtype",
        "hooks",
        "shape",
        "uid",
    )

    pin_epoch: int = 0
    """Changes whenever any storage is pinned: an optimizer or a step that placed its state by the pins compares it."""

    def __init__(self, value: ArrayLike) -> None:
        v = stored(value)
        check_value_kind(v, "Param")
        self.shape: tuple[int, ...] = tuple(v.shape)
        self.dtype: np.dtype = np.dtype(v.dtype)
        self._host: Array = v
        self._mirror: Array | None = None
        self._host_current = True
        self._current: Array = v
        self._on: jax.Device | _Several | None = None  # the one device _current lives on (None: not found yet)
        self._pinned: jax.sharding.Sharding | None = None  # where tfl.shard placed it: every write lands there
        self.hooks: list[Callable[[Array], Array | None]] = []  # Param.register_hook: once per backward, summed
        with _storage_lock:
            self.uid = next(_storage_ids)

    def __deepcopy__(self, memo: dict[int, object]) -> Storage:
        """A new storage with this one's current value and hooks, and its own ``uid``.

        A deep copy of a model shares nothing with it: its storages are new
        objects, and they are labelled as such (``storage=#7``, not the
        original's ``#0``), since in tapeflow a shared label means a tie.
        """
        new = Storage(self._current)
        new._pinned = self._pinned
        memo[id(self)] = new
        new.hooks = copy.deepcopy(self.hooks, memo)
        return new

    def __copy__(self) -> Storage:
        """A new storage holding the same value (a storage is a cell: a copy is another cell, with its own ``uid``)."""
        new = Storage(self._current)
        new._pinned = self._pinned
        new.hooks = list(self.hooks)
        return new

    # -- cells -----------------------------------------------------------------
    @property
    def host_current(self) -> bool:
        return self._host_current

    @property
    def mirror(self) -> Array | None:
        """The device mirror (a ``jax.Array``) or None when no device copy is cached."""
        return self._mirror

    @property
    def pinned(self) -> jax.sharding.Sharding | None:
        """The sharding :func:`tfl.shard <tapeflow.shard>` placed this storage with (None: not placed).

        Every later write of a pinned storage lands on this sharding
        (:func:`~tapeflow._shell._commit.commit` puts a value computed elsewhere there).
        """
        return self._pinned

    def pin(self, sharding: jax.sharding.Sharding | None, value: Array) -> None:
        """Make ``value`` (already placed with ``sharding``) the current value, and keep ``sharding`` for every write.

        Unchecked: ``value`` has the storage's shape and dtype and lives on
        ``sharding`` (:func:`tfl.shard <tapeflow.shard>` checks and places it
        first, and calls this from :func:`~tapeflow._shell._commit.commit`'s
        ``then``). The value becomes the host cell, so the storage lives only as
        its shards. ``sharding=None`` unpins.

        >>> import jax, jax.numpy as jnp, tapeflow as tfl
        >>> st = tfl.Storage(jnp.zeros(2))
        >>> one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        >>> st.pin(one, jax.device_put(jnp.ones(2), one))
        >>> st.pinned == one, st.read_current().tolist(), tfl.Storage.pin_epoch > 0
        (True, [1.0, 1.0], True)
        """
        self._pinned = sharding
        self._host = value
        self._mirror = None
        self._host_current = True
        self._current = value
        self._on = None
        Storage.pin_epoch += 1

    @staticmethod
    def read_current_many(storages: Iterable[Storage]) -> list[Array]:
        """The current value of each storage, wherever it lives: no placement, no host sync.

        The current cell is the device mirror when an update wrote it (the host
        cell is then stale), else the host cell; every cell change records its
        value, so this is one attribute read per storage (what
        :meth:`read_current` and ``read(None)`` return), and a compiled step reads
        all its storages with one call.

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> a, b = tfl.Storage(jnp.zeros(2)), tfl.Storage(jnp.ones(1))
        >>> [v.tolist() for v in tfl.Storage.read_current_many([a, b])]
        [[0.0, 0.0], [1.0]]
        """
        return [s._current for s in storages]

    @staticmethod
    def all_on(storages: Sequence[Storage], device: jax.Device) -> bool:
        """Whether the current value of every storage lives on ``device`` alone (one call for many storages).

        >>> import jax, jax.numpy as jnp, tapeflow as tfl
        >>> tfl.Storage.all_on([tfl.Storage(jnp.zeros(2))], jax.devices()[0])
        True
        """
        for s in storages:  # the cached placement read inline: a write-back makes no Python call per storage
            on = s._on
            if on is None:  # once per cell change
                on = s._where()
            if on is not device:
                return False
        return True

    def _where(self) -> jax.Device | _Several:
        """The one device the current value lives on (found once per cell change), or ``_SEVERAL`` (pinned too)."""
        on = self._on
        if on is None:
            # a pinned storage counts as several devices even on a 1-device mesh: its writes go through the
            # checks that keep its sharding
            on = self._on = (device_of(self._current) if self._pinned is None else None) or _SEVERAL
        return on

    @staticmethod
    def write_current_many(
        storages: Iterable[Storage], values: Iterable[Array], device: jax.Device | None = None
    ) -> None:
        """Replace the current cell of each storage with its new value (the fast write of a compiled step).

        Each new value replaces the cell the current value lives in (the host
        cell, dropping a cached mirror; or the mirror, leaving the stale host
        cell stale), exactly as ``write(value, on_device=True)`` does for a value
        on the current cell's device. **Nothing is checked**: each value must have
        its storage's shape and dtype and live where :meth:`read_current_many`
        found the old one (as the outputs of a single-device program computed
        from those reads do); use :meth:`write` for anything else. ``device``:
        the one device every value lives on, when the caller knows it. This is the
        one home of the cell update: :meth:`write` and :meth:`write_current` use it.

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> st = tfl.Storage(jnp.zeros(2))
        >>> tfl.Storage.write_current_many([st], [jnp.ones(2)])
        >>> st.read_current().tolist(), st.host_current
        ([1.0, 1.0], True)
        """
        for s, v in zip(storages, values):
            if s._host_current:
                s._host = v
                s._mirror = None
            else:
                s._mirror = v
            s._current = v
            s._on = device  # where v lives when the caller knows it (None: found on the next read)

    def read_current(self) -> Array:
        """The current value wherever it lives (no placement, no host sync); see :meth:`read_current_many`."""
        return self._current

    def write_current(self, value: Array) -> None:
        """Unchecked fast write into the current cell; see :meth:`write_current_many` for the contract."""
        Storage.write_current_many((self,), (value,))

    def read_host(self) -> Array:
        """The current value on the host, synchronizing a newer device mirror first."""
        if not self._host_current:
            host_dev = device_of(self._host)
            m = self._mirror
            # a mirror over several devices becomes the host cell as it is: a sharded value is never gathered
            self._host = m if host_dev is None or device_of(m) is None else jax.device_put(m, host_dev)
            self._host_current = True
            self._current = self._host
            self._on = None
        return self._host

    def read(self, device: jax.Device | None) -> Array:
        """The current value placed on ``device`` (None: :meth:`read_current`, wherever it lives).

        The mirror is reused when it is on ``device``; otherwise the current value
        is uploaded once and cached as the new mirror.
        """
        if device is None:
            return self._current  # read_current()
        on = self._on  # cached inline: every Param use of a replayed step reads here
        if on is None:
            on = self._where()
        if on is device:
            return self._current  # the common case: the current value lives on the device asked for
        if on is _SEVERAL:
            # sharded over several devices (or a tracer, or rationals on the host): used as it is, never
            # gathered onto one device
            return self._current
        m = self._mirror
        if m is not None and device_of(m) == device:
            return m
        m = jax.device_put(self.read_host(), device)
        self._mirror = m
        return m

    def write(self, value: ArrayLike, *, on_device: bool = False) -> None:
        """Replace the value, checking its shape and dtype.

        ``on_device=True`` keeps a value that lives on another device than the
        host cell as the mirror and marks the host stale; otherwise the value
        becomes the host cell. The cell update itself is :meth:`write_current_many`.
        """
        v = stored(value)
        if tuple(v.shape) != self.shape or np.dtype(v.dtype) != self.dtype:
            raise ValueError(
                f"cannot write a {R.fmt_spec((tuple(v.shape), np.dtype(v.dtype)))} value into a parameter "
                f"storage of {R.fmt_spec((self.shape, self.dtype))}; a parameter keeps its shape and dtype "
                "(create a new Param to change them)"
            )
        # choose the cell, then replace it; a value over several devices is the host cell (it lives only as its shards)
        on = device_of(v)
        several = on is None and isinstance(v, jax.Array) and not isinstance(v, jax.core.Tracer)
        self._host_current = several or not (on_device and on != device_of(self._host))
        self.write_current(v)

    def __repr__(self) -> str:
        return f"<Storage #{self.uid} {R.fmt_spec((self.shape, self.dtype))}>"

    def __treescope_repr__(self, path: str | None, subtree_renderer: SubtreeRenderer) -> Rendering:
        return _render.render_storage(self, path, subtree_renderer)  # treescope picture (tapeflow[viz])


class Param(TensorOps):
    """A trainable (or frozen) parameter: a named record pointing at a :class:`Storage`.

    Every use of a ``Param`` in a session op records a new leaf holding the value
    observed at that moment; assigning ``p.value`` later never changes what
    was recorded.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> w = tfl.Param(jnp.ones((2, 2)), name="w")
    >>> w.shape, w.name, w.trainable
    ((2, 2), 'w', True)
    """

    __slots__ = ("__weakref__", "_bound", "name", "storage", "trainable")

    def __init__(self, value: ArrayLike, name: str | None = None, trainable: bool = True) -> None:
        trainable = _check_trainable(trainable, "Param")
        self.storage = Storage(value)
        self.name = name
        self.trainable = trainable
        self._bound: Array | None = None

    @classmethod
    def _from_storage(cls, storage: Storage, name: str | None, trainable: bool, bound: Array | None = None) -> Param:
        p = object.__new__(cls)
        p.storage = storage
        p.name = name
        p.trainable = trainable
        p._bound = bound
        return p

    def register_hook(self, fn: Callable[[Array], Array | None]) -> RemovableHandle:
        """Call ``fn(gradient)`` once per backward with this storage's summed gradient.

        Every tied registration shares the hook (it belongs to the storage), and
        it sees the sum over all uses, as PyTorch calls a tensor hook once with
        the accumulated gradient. A returned array of the same shape and dtype
        replaces the gradient for ``grads[p]`` and every optimizer; None keeps it.

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> w = tfl.Param(jnp.array(2.0))
        >>> hook = w.register_hook(lambda g: g * 10.0)
        >>> with tfl.Session() as s:
        ...     float(s.backward(w * 3.0 + tfl.tie(w) * 4.0)[w])
        70.0
        >>> hook.remove()
        """
        if not callable(fn):
            raise TypeError(f"register_hook expects a function of the gradient, got {type(fn).__name__}")
        return RemovableHandle(self.storage.hooks, fn)

    @property
    def bound(self) -> bool:
        """True for a read-only view made by JAX's pytree machinery (see :meth:`value`)."""
        return self._bound is not None

    @property
    def value(self) -> Array:
        """The current value (a ``jax.Array``), synchronized from a newer device mirror.

        ``Param`` is a JAX pytree whose one leaf is this value and whose static
        part is the storage identity; a ``Param`` rebuilt by JAX (for example the
        argument seen inside ``jax.jit``) is a read-only view bound to the leaf it
        was rebuilt with, and ``value`` returns that leaf.
        """
        if self._bound is not None:
            return self._bound
        return self.storage.read_host()

    @value.setter
    def value(self, new: ArrayLike) -> None:
        if self._bound is not None:
            raise TypeError(
                f"{self!r} is a read-only view rebuilt by a JAX transformation; assign to the original Param "
                "(or let tfl.train_step / Optimizer.step write the storage)"
            )
        commit([(self.storage, new)], where="Param.value", label=lambda _: repr(self))

    @property
    def sharding(self) -> jax.sharding.Sharding | None:
        """The ``jax.sharding.Sharding`` of the storage's current value (None for a tracer or exact rationals).

        :func:`tfl.shard <tapeflow.shard>` sets it; every training path keeps it.

        >>> import jax, jax.numpy as jnp, tapeflow as tfl
        >>> w = tfl.Param(jnp.ones((4, 2)), name="w")
        >>> w.sharding.device_set == {jax.devices()[0]}
        True
        """
        v = self._bound if self._bound is not None else self.storage.read_current()
        if isinstance(v, jax.Array) and not isinstance(v, jax.core.Tracer):
            return v.sharding
        return None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.storage.shape

    @property
    def dtype(self) -> np.dtype:
        return self.storage.dtype

    def __array__(self, dtype: DTypeLike = None, copy: bool | None = None) -> np.ndarray:
        return np.asarray(self.value, dtype=dtype)

    def __repr__(self) -> str:
        frozen = "" if self.trainable else ", frozen"
        return f"Param({self.name!r}, {R.fmt_spec((self.shape, self.dtype))}, storage=#{self.storage.uid}{frozen})"

    def __treescope_repr__(self, path: str | None, subtree_renderer: SubtreeRenderer) -> Rendering:
        return _render.render_param(self, path, subtree_renderer)  # treescope picture (tapeflow[viz])


def _param_flatten(p: Param) -> tuple[tuple[Array], tuple[Storage, str | None, bool]]:
    value = p._bound if p._bound is not None else p.storage.read_current()  # no host sync
    return (value,), (p.storage, p.name, p.trainable)


def _param_unflatten(aux: tuple[Storage, str | None, bool], children: tuple[Array, ...]) -> Param:
    storage, name, trainable = aux
    return Param._from_storage(storage, name, trainable, bound=children[0])


jax.tree_util.register_pytree_node(Param, _param_flatten, _param_unflatten)


def tie(p: Param, name: str | None = None, trainable: bool | None = None) -> Param:
    """A new parameter record that shares ``p``'s storage (weight tying).

    >>> import jax.numpy as jnp
    >>> w = Param(jnp.ones(3), name="emb")
    >>> tie(w, name="out").storage is w.storage
    True
    """
    if not isinstance(p, Param):
        raise TypeError(f"tie expects a Param, got {type(p).__name__}")
    return Param._from_storage(
        p.storage,
        p.name if name is None else name,
        p.trainable if trainable is None else _check_trainable(trainable, "tie"),
    )


def canonical_indices(storages: Sequence[Storage | Param | None]) -> list[int | None]:
    """For each slot, the index of the first slot holding the same storage (None stays None).

    Identity decides: two slots agree only when they hold the very same
    :class:`Storage` object (a :class:`Param` stands for its storage). Runs in
    expected O(n) time through a hash table keyed by object identity; the list
    keeps every storage alive during the call, so identities cannot be reused,
    and nothing is cached between calls.

    >>> import jax.numpy as jnp
    >>> p, q = Param(jnp.ones(2)), Param(jnp.ones(2))
    >>> canonical_indices([p, q, p, None])
    [0, 1, 0, None]
    """
    first: dict[int, int] = {}
    out: list[int | None] = []
    setdefault = first.setdefault
    append = out.append
    for i, s in enumerate(storages):
        if s is None:
            append(None)
            continue
        if type(s) is not Storage:
            if isinstance(s, Param):
                s = s.storage
            elif not isinstance(s, Storage):
                raise TypeError(
                    f"canonical_indices: slot {i} holds {type(s).__name__}, expected a Storage, Param or None"
                )
        append(setdefault(id(s), i))
    return out


class HasParameterRecords(Protocol):
    """A module: every registration of its parameters and buffers by path, tied ones included."""

    def parameter_records(self) -> Iterable[tuple[str, Param]]: ...


class HasNamedParameters(Protocol):
    """A collection that names its parameters, as a module does."""

    def named_parameters(self) -> Iterable[tuple[str, Param]]: ...


ParamTarget: TypeAlias = "Param | Mapping[str, Param] | Iterable[Param] | HasParameterRecords | HasNamedParameters"
"""A parameter collection a user hands over: a module, a Param, Params, or a mapping ``name -> Param``."""


def registrations(target: ParamTarget, where: str = "") -> tuple[list[tuple[str | None, Param]], bool]:
    """Each registration of ``target`` with its name, and whether the names are keys (a module's or a mapping's).

    A module gives its paths (``parameter_records``, else ``named_parameters``),
    a mapping its keys; a lone Param, or an iterable of them, gives each Param's
    own name (None without one). Every entry must be an original Param (not a
    read-only view a JAX transformation made); ``where`` (the caller's name)
    starts each error message.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> w = tfl.Param(jnp.ones(2), name="w")
    >>> pairs, keyed = registrations([w, tfl.tie(w, name="w_out"), tfl.Param(jnp.ones(1))])
    >>> [n for n, _ in pairs], pairs[1][1].storage is w.storage, keyed
    (['w', 'w_out', None], True, False)
    >>> [n for n, _ in registrations({"a": w})[0]], registrations({"a": w})[1]
    (['a'], True)
    """
    pre = f"{where}: " if where else ""
    pairs: list[tuple[str | None, object]]
    if isinstance(target, Param):
        pairs, keyed = [(target.name, target)], False
    elif hasattr(target, "parameter_records") and callable(target.parameter_records):
        pairs, keyed = list(target.parameter_records()), True
    elif hasattr(target, "named_parameters") and callable(target.named_parameters):
        pairs, keyed = list(target.named_parameters()), True
    elif isinstance(target, Mapping):
        pairs, keyed = [(str(k), v) for k, v in target.items()], True
    else:
        try:
            recs = list(cast("Iterable[Param]", target))  # anything else a user passes fails here, at run time
        except TypeError:
            raise TypeError(
                f"{pre}expected a sequence of tfl.Param, a mapping name -> Param, or a module with "
                f"parameter_records(); got {type(target).__name__}"
            ) from None
        pairs, keyed = [(getattr(p, "name", None), p) for p in recs], False
    out: list[tuple[str | None, Param]] = []
    for i, pair in enumerate(pairs):
        try:
            name, p = pair
        except (TypeError, ValueError):
            raise TypeError(f"{pre}parameter_records() entry {i} is not a (name, Param) pair: {pair!r}") from None
        if not isinstance(p, Param):
            at = f"{name!r}" if keyed else f"position {i}"
            raise TypeError(f"{pre}{at} holds {type(p).__name__}, expected a tfl.Param")
        if p.bound:
            raise TypeError(f"{pre}{p!r} is a read-only view made by a JAX transformation; pass the original Param")
        out.append((None if name is None else str(name), p))
    return out, keyed
