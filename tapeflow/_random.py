"""Compiled random draws for session random tensors, cached per (kind, shape, dtype).

>>> import jax, numpy as np
>>> draw(("normal",), (2,), np.dtype("float32"), jax.random.PRNGKey(0)).shape
(2,)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from ._result import TapeError
from ._typing import Array, PRNGKey, Shape

__all__ = ["RNG_COUNTER_RANGE", "RNG_SEED_RANGE", "draw", "rng_int"]

RandomKind = tuple[str] | tuple[str, float] | tuple[str, float, float]
"""``("normal",)``, ``("bernoulli", p)`` or ``("uniform", low, high)``."""

_KERNELS: dict[tuple[RandomKind, Shape, np.dtype | None], Callable[[PRNGKey], Array]] = {}


def _kernel(kind: RandomKind, shape: Shape, dtype: np.dtype | None) -> Callable[[PRNGKey], Array]:
    key = (kind, shape, dtype)
    fn = _KERNELS.get(key)
    if fn is None:
        name = kind[0]
        if name == "uniform":
            lo, hi = kind[1], kind[2]  # type: ignore[misc]

            def f(k: PRNGKey) -> Array:
                return jax.random.uniform(k, shape, dtype, lo, hi)
        elif name == "normal":

            def f(k: PRNGKey) -> Array:
                return jax.random.normal(k, shape, dtype)
        else:
            p = kind[1]  # type: ignore[misc]

            def f(k: PRNGKey) -> Array:
                return jax.random.bernoulli(k, p, shape)

        fn = _KERNELS[key] = jax.jit(f)
    return fn


def draw(kind: RandomKind, shape: Shape, dtype: np.dtype | None, key: PRNGKey) -> Array:
    """One draw of ``kind`` with ``shape`` and ``dtype`` from ``key``."""
    return _kernel(kind, shape, dtype)(key)


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
