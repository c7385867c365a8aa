"""Bounded LRU caches of compiled kernels, and the public knobs over all of them.

Every cache of compiled functions in tapeflow (op forwards, VJPs, random
draws) is a :class:`KernelCache` registered here under a name, so
:func:`kernel_cache_info`, :func:`set_kernel_cache_size` and
:func:`clear_kernel_caches` see all of them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable
from typing import Any

import numpy as np

from ._result import TapeError

__all__ = ["KernelCache", "clear_kernel_caches", "drop_kernels_of", "kernel_cache_info", "set_kernel_cache_size"]

_max_size = DEFAULT_KERNEL_CACHE_SIZE = 4096
_CACHES: dict[str, KernelCache] = {}


class KernelCache(OrderedDict[Hashable, Any]):
    """An LRU cache of kernels, counted as ``name`` by :func:`kernel_cache_info`; ``hit`` is a ``get``
    that marks the entry most recently used, ``put`` evicts beyond :func:`set_kernel_cache_size`.

    Marking costs an ``OrderedDict`` move on every hit, and a cache far from its bound can evict
    nothing, so ``hit`` marks only while the cache is ``crowded`` (more than half its bound full). The
    order is exact LRU among the entries used since the cache became crowded; entries unused since then
    are older than all of those and keep their insertion order, so they go first. A caller's own fast
    path may ``get`` and call ``hit`` only when ``crowded`` (``check_op`` does).

    >>> c = KernelCache("doctest")
    >>> c.put("a", 1); c.hit("a"), c.crowded
    (1, False)
    >>> _ = _CACHES.pop("doctest")
    """

    __slots__ = ("crowded", "evictions", "opaque")

    def __init__(self, name: str, *, opaque: bool = False) -> None:
        super().__init__()
        self.evictions = 0
        self.crowded = False  # more than half of the bound full: hits mark recency (see the class doc)
        self.opaque = opaque  # keys do not name their ops (interned structures): dropped whole by drop_kernels_of
        _CACHES[name] = self

    def hit(self, key: Hashable) -> Any:
        v = self.get(key)
        if v is not None and self.crowded:
            try:  # noqa: SIM105 (contextlib.suppress would cost a context manager per hit)
                self.move_to_end(key)
            except KeyError:  # evicted by another thread meanwhile: still a valid kernel
                pass
        return v

    def put(self, key: Hashable, value: Any) -> None:
        self[key] = value
        self.trim()

    def trim(self) -> None:
        """Evict the least recently used entries beyond the bound, and note whether the cache is crowded."""
        while len(self) > _max_size and self.popitem(last=False):
            self.evictions += 1
        self.crowded = len(self) > _max_size >> 1


def kernel_cache_info() -> dict[str, int]:
    """Entries per kernel cache (``"fwd"``, ``"vjp"``, ``"jvp"``, ``"fwd_jit"``: per op and attrs, ``"random"``: draws,
    ``"lazy"``: programs of lazy sessions, ``"lazy_checked"``: structures whose backward a lazy session traced,
    ``"optimizer_init"``: optimizers' compiled state inits, one per structure),
    their bound (``"max_size"``) and the ``"evictions"`` since the last :func:`clear_kernel_caches`.

    >>> import tapeflow as tfl
    >>> sorted(tfl.kernel_cache_info())  # doctest: +NORMALIZE_WHITESPACE
    ['evictions', 'fwd', 'fwd_jit', 'jvp', 'lazy', 'lazy_checked', 'max_size',
     'optimizer_init', 'random', 'vjp']
    """
    info = {name: len(c) for name, c in _CACHES.items()}
    return {**info, "max_size": _max_size, "evictions": sum(c.evictions for c in _CACHES.values())}


def set_kernel_cache_size(max_size: int) -> int:
    """Keep at most ``max_size`` entries (default 4096) in each kernel cache; returns the previous bound.

    Beyond it, the least recently used kernels are dropped (at once when
    shrinking) and compiled again on their next use.

    >>> import tapeflow as tfl
    >>> old = tfl.set_kernel_cache_size(256)
    >>> tfl.kernel_cache_info()["max_size"], tfl.set_kernel_cache_size(old)
    (256, 256)
    """
    global _max_size
    if not isinstance(max_size, (int, np.integer)) or isinstance(max_size, (bool, np.bool_)) or max_size < 1:
        raise TapeError(
            f"set_kernel_cache_size: max_size must be a positive int (kernels kept per cache), got {max_size!r}; "
            f"e.g. tfl.set_kernel_cache_size({DEFAULT_KERNEL_CACHE_SIZE})"
        )
    old, _max_size = _max_size, int(max_size)
    for c in _CACHES.values():
        c.trim()
    return old


def clear_kernel_caches() -> None:
    """Drop every cached kernel (they are rebuilt on next use) and zero the eviction count."""
    for c in _CACHES.values():
        c.clear()
        c.evictions = 0
        c.crowded = False


def drop_kernels_of(names: Collection[str]) -> None:
    """Drop every cached kernel whose key mentions one of the op ``names`` (as its op, or inside an attribute:
    a recorded VJP keys by the op it differentiates). The one rule for forgetting an op's kernels.

    >>> drop_kernels_of({"no_such_op"})
    """
    for cache in list(_CACHES.values()):
        if cache.opaque:
            cache.clear()
            continue
        for key in [k for k in list(cache) if _mentions(k, names)]:
            cache.pop(key, None)


def _mentions(key: object, names: Collection[str]) -> bool:
    if type(key) is str:
        return key in names
    return type(key) is tuple and any(_mentions(k, names) for k in key)
