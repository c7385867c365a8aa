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
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from .._core._checks import as_dtype, is_floating_dtype
from .._core._kernels import KernelCache
from .._core._result import TapeError
from .._core._typing import Array, DTypeLike, PRNGKey, Shape

if TYPE_CHECKING:
    from ._tensor import Tensor

__all__ = ["RNG_COUNTER_RANGE", "RNG_SEED_RANGE", "RandomDraws", "draw", "rng_int"]

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
            fn = jax.jit(lambda k, lo, hi: jax.random.uniform(k, shape, dtype, lo, hi))
        elif name == "normal":
            fn = jax.jit(lambda k: jax.random.normal(k, shape, dtype))
        else:
            fn = jax.jit(lambda k, p: jax.random.bernoulli(k, p, shape))
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
    >>> rng_int("seed", 2**63, RNG_SEED_RANGE, "Session")
    Traceback (most recent call last):
    tapeflow._core._result.TapeError: Session: seed must be an int in [-2**63, 2**63), got 9223372036854775808
    """
    lo, hi = bounds
    rng = f"[{'-2**63' if lo else 0}, 2**63)"
    if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_)):
        raise TapeError(f"{where}: {name} must be an int in {rng}, got {type(v).__name__} {v!r}")
    if not lo <= int(v) < hi:
        raise TapeError(f"{where}: {name} must be an int in {rng}, got {v}")
    return int(v)


class RandomDraws:
    """The random side of a :class:`~tapeflow.Session`: seed, counter, keys and random leaves.

    Draw ``k`` of a session uses ``fold_in(PRNGKey(seed), k)`` and advances the
    counter once; a refused draw (bad shape or dtype, counter at its last value)
    advances nothing and records nothing. Mixed into ``Session``, which provides
    ``check_thread``, ``_commit_leaf`` and ``_prepare_value``.
    """

    _seed: int
    _rng_counter: int
    _base_key: PRNGKey | None

    def check_thread(self) -> None:  # pragma: no cover - provided by Session
        raise NotImplementedError

    def _commit_leaf(self, value: Array, requires_grad: bool) -> Tensor:  # pragma: no cover - provided by Session
        raise NotImplementedError

    _prepare_value: Callable[..., Array]  # ValuePolicy's, also mixed into Session

    @property
    def rng_counter(self) -> int:
        """Number of random tensors drawn so far (kept across resets)."""
        return self._rng_counter

    @property
    def seed(self) -> int:
        """Seed of the session's random tensors (see :meth:`set_rng_state`)."""
        return self._seed

    def set_rng_state(self, seed: int | None = None, counter: int | None = None) -> None:
        """Set the RNG seed and/or counter, e.g. to continue a restored run.

        >>> import tapeflow as tfl
        >>> s = tfl.Session(seed=1)
        >>> a = s.normal((2,)).value
        >>> s.set_rng_state(seed=1, counter=0)
        >>> bool((s.normal((2,)).value == a).all())
        True
        """
        self.check_thread()
        new_seed = None if seed is None else rng_int("seed", seed, RNG_SEED_RANGE)
        new_counter = None if counter is None else rng_int("counter", counter, RNG_COUNTER_RANGE)
        if new_seed is not None:
            self._seed = new_seed
            self._base_key = None
        if new_counter is not None:
            self._rng_counter = new_counter

    def _key(self, method: str) -> PRNGKey:
        """The key of the next draw, ``fold_in(key(seed), counter)``; does not advance the counter.

        Refuses the draw that would move the counter out of its range (and so
        make the session's RNG state unsavable).
        """
        if self._rng_counter + 1 >= RNG_COUNTER_RANGE[1]:
            raise TapeError(
                f"{method}: the RNG counter is at its last value ({self._rng_counter}); nothing was drawn. "
                "Start a new stream with s.set_rng_state(seed=..., counter=0)"
            )
        if self._base_key is None:
            self._base_key = jax.random.PRNGKey(self._seed)
        c = self._rng_counter
        if c < 2**32:
            return jax.random.fold_in(self._base_key, c)
        return jax.random.fold_in(jax.random.fold_in(self._base_key, c >> 32), c & 0xFFFFFFFF)  # fold_in takes uint32

    def _next_key(self, method: str) -> PRNGKey:
        k = self._key(method)
        self._rng_counter += 1
        return k

    def _random(self, method: str, kind: RandomKind, shape: int | tuple[int, ...], dtype: DTypeLike | None) -> Tensor:
        # every check before the draw: a rejected call advances no counter and records nothing
        self.check_thread()
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
        v = draw(kind, tuple(int(d) for d in shape), dt, self._key(method))
        self._rng_counter += 1
        return self._commit_leaf(self._prepare_value(v), False)

    def rand_uniform(
        self, shape: int | tuple[int, ...], dtype: DTypeLike = jnp.float32, low: float = 0.0, high: float = 1.0
    ) -> Tensor:
        """Uniform ``[low, high)`` samples (a constant leaf); advances the RNG counter once."""
        return self._random("rand_uniform", ("uniform", float(low), float(high)), shape, dtype)

    def normal(self, shape: int | tuple[int, ...], dtype: DTypeLike = jnp.float32) -> Tensor:
        """Standard normal samples (a constant leaf); advances the RNG counter once."""
        return self._random("normal", ("normal",), shape, dtype)

    def bernoulli_mask(self, shape: int | tuple[int, ...], keep_prob: float) -> Tensor:
        """Boolean mask, True with probability ``keep_prob``; advances the RNG counter once."""
        if not 0.0 <= float(keep_prob) <= 1.0:
            raise TapeError(f"bernoulli_mask: keep_prob must be in [0, 1], got {keep_prob}")
        return self._random("bernoulli_mask", ("bernoulli", float(keep_prob)), shape, None)

    def random_key(self) -> PRNGKey:
        """A fresh ``jax.random`` key derived from (seed, counter); advances the counter once."""
        self.check_thread()
        return self._next_key("random_key")
