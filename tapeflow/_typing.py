"""Named type aliases used across tapeflow's annotations.

These say what a value *is* in the library's vocabulary (a node id, a shape,
an optax state) where the runtime type alone would be a bare ``Any``.

>>> from tapeflow._typing import Shape, NodeId
>>> s: Shape = (2, 3); i: NodeId = 0
>>> s, i
((2, 3), 0)
"""

from __future__ import annotations

from typing import Any, TypeAlias

import jax

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
"""A ``jax.Array`` (or a tracer of one), or a NumPy object array of exact rationals."""

ArrayLike: TypeAlias = Any
"""Anything that converts to an array: ``jax.Array``, ``np.ndarray``, a number, nested lists."""

DTypeLike: TypeAlias = Any
"""A dtype or something ``np.dtype`` accepts (``jnp.float32``, ``"float32"``)."""

DeviceLike: TypeAlias = str | jax.Device | None
"""``"cpu"``, ``"gpu"``/``"cuda"``, ``"gpu:N"``, a ``jax.Device``, or None for JAX's default."""

Shape: TypeAlias = tuple[int, ...]
"""A concrete array shape."""

NodeId: TypeAlias = int
"""The index of a node on a :class:`~tapeflow.Tape`."""

AttrValue: TypeAlias = Any
"""A hashable op attribute: a number, a string, None, a dtype, or a tuple of those."""

Attrs: TypeAlias = tuple[tuple[str, AttrValue], ...]
"""Op attributes normalized into a sorted, hashable tuple of ``(name, value)``."""

PyTree: TypeAlias = Any
"""A JAX pytree (nested lists, tuples, dicts and registered nodes)."""

OptState: TypeAlias = Any
"""An optax optimizer state pytree."""

PRNGKey: TypeAlias = Any
"""A ``jax.random`` key array."""
