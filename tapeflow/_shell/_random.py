"""Compiled random draws for session random tensors, one kernel per (kind name, shape, dtype).

The floats of a kind (``p``, ``low``, ``high``) are traced arguments of that
kernel, keyed by their types only, so drawing with a new rate compiles nothing.
The kernels live in the bounded LRU ``_KERNELS`` (``"random"`` in
:func:`~tapeflow.kernel_cache_info`).

>>> import jax, numpy as np
>>> draw(("normal",), (2,), np.dtype("float32"), jax.random.PRNGKey(0)).shape
(2,)
>>> a = draw(("bernoulli", 0.25), (3,), None, jax.random.PRNGKey(0))
>>> b = draw(("bernoulli", 0.75), (3,), None, jax.random.PRNGKey(0))
>>> len([k for k in _KERNELS if k[0] == "bernoulli" and k[2] == (3,)])
1
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from .._core import _registry as R
from .._core._checks import as_dtype, is_floating_dtype
from .._core._kernels import KernelCache
from .._core._result import TapeError
from .._core._typing import Array, DTypeLike, PRNGKey, Shape

__all__ = ["RNG_COUNTER_RANGE", "RNG_SEED_RANGE", "RandomKind", "RandomStream", "draw", "rng_int"]

RandomKind = tuple[str] | tuple[str, float] | tuple[str, float, float]
"""``("normal",)``, ``("bernoulli", p)`` or ``("uniform", low, high)``."""

DrawKey = tuple[str, tuple[type, ...], Shape, "np.dtype | None"]
"""``(kind name, types of the kind's floats, shape, dtype)``: one compiled draw."""

_KERNELS = KernelCache("random")


def _kernel(name: str, types: tuple[type, ...], shape: Shape, dtype: np.dtype | None) -> Callable[..., Array]:
    key: DrawKey = (name, types, shape, dtype)
    fn: Callable[..., Array] | None = _KERNELS.hit(key)
    if fn is None:
        if name == "uniform":
            body: Callable[..., Array] = lambda k, lo, hi: jax.random.uniform(k, shape, dtype, lo, hi)  # noqa: E731
        elif name == "normal":
            body = lambda k: jax.random.normal(k, shape, dtype)  # noqa: E731
        else:
            body = lambda k, p: jax.random.bernoulli(k, p, shape)  # noqa: E731
        fn = jax.jit(R.logged_kernel(body, name, "random draw", {"shape": shape, "dtype": str(dtype)}))
        _KERNELS.put(key, fn)
    return fn


def draw(kind: RandomKind, shape: Shape, dtype: np.dtype | None, key: PRNGKey) -> Array:
    """One draw of ``kind`` with ``shape`` and ``dtype`` from ``key``."""
    params = kind[1:]
    return _kernel(kind[0], tuple(map(type, params)), shape, dtype)(key, *params)


RNG_SEED_RANGE = (-(2**63), 2**63)
"""``[lo, hi)`` of a session seed (JAX's int64 seed range); checkpoints check restored seeds against it."""
RNG_COUNTER_RANGE = (0, 2**63)
"""``[lo, hi)`` of a session's RNG counter; checkpoints check restored counters against it."""


def rng_int(name: str, v: object, bounds: tuple[int, int], where: str = "set_rng_state") -> int:
    """``v`` as an RNG seed or counter in ``[lo, hi)``, else a TapeError naming ``where``, ``name`` and the range.

    >>> rng_int("seed", 7, RNG_SEED_RANGE)
    7
    >>> rng_int("seed", 2**63, RNG_SEED_RANGE, "Session")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    tapeflow._core._result.TapeError: Session: seed must be an int in [-2**63, 2**63),
      got 9223372036854775808
    """
    lo, hi = bounds
    rng = f"[{'-2**63' if lo else 0}, 2**63)"
    if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_)):
        raise TapeError(f"{where}: {name} must be an int in {rng}, got {type(v).__name__} {v!r}")
    if not lo <= int(v) < hi:
        raise TapeError(f"{where}: {name} must be an int in {rng}, got {v}")
    return int(v)


class RandomStream:
    """A session's random stream: its seed, its counter and the key of each draw.

    Draw ``k`` uses ``fold_in(PRNGKey(seed), k)`` (or ``fold_in(key, k)`` of the
    ``key`` given instead of a seed) and advances the counter once; a refused
    draw (bad shape or dtype, counter at its last value) advances nothing.

    >>> rs = RandomStream(seed=0)
    >>> a = rs.draw("normal", ("normal",), 2, np.float32)
    >>> counter, reset = rs.counter, rs.set_state(counter=0)
    >>> counter, reset, bool((rs.draw("normal", ("normal",), 2, np.float32) == a).all())
    (1, None, True)
    """

    __slots__ = ("base_key", "counter", "seed")

    def __init__(self, seed: int, key: PRNGKey | None = None) -> None:
        self.seed = seed
        self.counter = 0
        self.base_key = key

    def set_state(self, seed: int | None = None, counter: int | None = None) -> None:
        """Set the seed and/or counter (each checked against its range first; a refused call changes nothing)."""
        new_seed = None if seed is None else rng_int("seed", seed, RNG_SEED_RANGE)
        new_counter = None if counter is None else rng_int("counter", counter, RNG_COUNTER_RANGE)
        if new_seed is not None:
            self.seed = new_seed
            self.base_key = None
        if new_counter is not None:
            self.counter = new_counter

    def key(self, method: str) -> PRNGKey:
        """The key of the next draw, ``fold_in(key(seed), counter)``; does not advance the counter.

        Refuses the draw that would move the counter out of its range (and so
        make the session's RNG state unsavable).
        """
        if self.counter + 1 >= RNG_COUNTER_RANGE[1]:
            raise TapeError(
                f"{method}: the RNG counter is at its last value ({self.counter}); nothing was drawn. "
                "Start a new stream with s.set_rng_state(seed=..., counter=0)"
            )
        if self.base_key is None:
            self.base_key = jax.random.PRNGKey(self.seed)
        c = self.counter
        if c < 2**32:
            return jax.random.fold_in(self.base_key, c)
        return jax.random.fold_in(jax.random.fold_in(self.base_key, c >> 32), c & 0xFFFFFFFF)  # fold_in takes uint32

    def next_key(self, method: str) -> PRNGKey:
        """The key of the next draw; advances the counter once."""
        k = self.key(method)
        self.counter += 1
        return k

    def draw(self, method: str, kind: RandomKind, shape: int | tuple[int, ...], dtype: DTypeLike | None) -> Array:
        """One draw of ``kind``: ``shape`` and ``dtype`` checked first, so a refused call advances nothing."""
        if isinstance(shape, (int, np.integer)) and not isinstance(shape, (bool, np.bool_)):
            shape = (shape,)
        if not isinstance(shape, (tuple, list)) or any(
            not isinstance(d, (int, np.integer)) or isinstance(d, (bool, np.bool_)) or d < 0 for d in shape
        ):
            raise TapeError(f"{method}: random tensor shape must be non-negative integers, got {shape!r}")
        dt = None
        if dtype is not None:
            dt = as_dtype(dtype)
            if dt is None:
                raise TapeError(f"{method}: {dtype!r} is not a dtype; use a floating dtype such as float32")
            if not is_floating_dtype(dt):
                raise TapeError(f"{method}: dtype {dt} is not supported; use a floating dtype such as float32")
        v = draw(kind, tuple(int(d) for d in shape), dt, self.key(method))
        self.counter += 1
        return v
