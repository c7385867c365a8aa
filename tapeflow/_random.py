"""Compiled random draws for session random tensors, cached per (kind, shape, dtype).

>>> import jax, numpy as np
>>> draw(("normal",), (2,), np.dtype("float32"), jax.random.PRNGKey(0)).shape
(2,)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from ._typing import Array, PRNGKey, Shape

__all__ = ["draw"]

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
