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

from ._registry import KernelCache
from ._result import TapeError
from ._typing import Array, PRNGKey, Shape

__all__ = ["RNG_COUNTER_RANGE", "RNG_SEED_RANGE", "draw", "rng_int"]

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


def rng_int(name: str, v: object, bounds: tuple[int, int]) -> int:
    """``v`` as an RNG seed or counter in ``[lo, hi)``, else a TapeError naming ``name`` and the range."""
    lo, hi = bounds
    rng = f"[{'-2**63' if lo else 0}, 2**63)"
    if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_)):
        raise TapeError(f"set_rng_state: {name} must be an int in {rng}, got {type(v).__name__} {v!r}")
    if not lo <= int(v) < hi:
        raise TapeError(f"set_rng_state: {name} must be an int in {rng}, got {v}")
    return int(v)
