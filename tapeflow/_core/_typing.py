"""Named type aliases used across tapeflow's annotations.

These say what a value *is* in the library's vocabulary (a node id, a shape,
an optax state). ``PyTree`` is ``Any`` because any object can be a leaf;
``Array``, ``ArrayLike`` and ``DTypeLike`` are ``Any`` to the type checker,
and their docstrings say which type each stands for and why.

>>> from tapeflow._core._typing import Shape, NodeId
>>> s: Shape = (2, 3); i: NodeId = 0
>>> s, i
((2, 3), 0)
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, TypeAlias

import jax
import optax

__all__ = [
    "Array",
    "ArrayLike",
    "AttrValue",
    "Attrs",
    "DTypeLike",
    "DeviceLike",
    "NodeId",
    "OptState",
    "PRNGKey",
    "PyTree",
    "Shape",
]

Array: TypeAlias = Any
"""A ``jax.Array`` (or a tracer of one), or a NumPy object array of exact rationals.

Stands for ``jax.Array | np.ndarray``; the checker sees ``Any`` because op
kernels also pass shapes, paddings and None through ``Array`` parameters.
"""

ArrayLike: TypeAlias = Any
"""Anything that converts to an array: ``jax.Array``, ``np.ndarray``, a number, nested lists.

Stands for ``numpy.typing.ArrayLike`` (``jax.typing.ArrayLike`` leaves out
nested lists); code that reads ``.dtype`` after a ``getattr`` test relies on the checker seeing ``Any``.
"""

DTypeLike: TypeAlias = Any
"""A dtype or something ``np.dtype`` accepts (``jnp.float32``, ``"float32"``).

Stands for ``jax.typing.DTypeLike``; ``__array__(self, dtype: DTypeLike = None)``
overrides take None too, so the checker sees ``Any`` until they say ``DTypeLike | None``.
"""

DeviceLike: TypeAlias = str | jax.Device | None
"""``"cpu"``, ``"gpu"``/``"cuda"``, ``"gpu:N"``, a ``jax.Device``, or None for JAX's default."""

Shape: TypeAlias = tuple[int, ...]
"""A concrete array shape."""

NodeId: TypeAlias = int
"""The index of a node on a :class:`~tapeflow.Tape`."""

AttrValue: TypeAlias = Hashable
"""A hashable op attribute: a number, a string, None, a dtype, or a tuple of those."""

Attrs: TypeAlias = tuple[tuple[str, AttrValue], ...]
"""Op attributes normalized into a sorted, hashable tuple of ``(name, value)``."""

PyTree: TypeAlias = Any
"""A JAX pytree (nested lists, tuples, dicts and registered nodes) with leaves of any type.

``Any`` is the type: JAX takes every object that is not a container as a leaf,
and tapeflow's trees hold Params, Tensors, arrays or ints depending on the
call (``chex.ArrayTree`` covers only the trees of arrays).
"""

OptState: TypeAlias = optax.OptState
"""An optax optimizer state: a pytree of arrays (``optax.OptState``, itself ``chex.ArrayTree``)."""

PRNGKey: TypeAlias = jax.Array
"""A ``jax.random`` key array (``jax.random.key(0)``, or a legacy ``uint32[2]`` key)."""
