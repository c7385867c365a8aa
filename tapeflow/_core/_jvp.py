"""Forward mode over a :class:`~tapeflow.Tape`: pure, and jit-compatible.

:func:`jvp` pushes tangents of some nodes forward, node by node, to a root:
each op's tangent is ``jax.jvp`` of its forward kernel, compiled with
``jax.jit`` and cached (the ``"jvp"`` entry of ``tfl.kernel_cache_info()``)
per (op, attributes, operand shapes and dtypes, which operands carry a
tangent). Nodes that depend on no tangent carry none (a symbolic zero).

>>> import jax.numpy as jnp
>>> from tapeflow import Tape, leaf, record
>>> t, x = leaf(Tape.empty(), jnp.array(3.0))
>>> t, y = record(t, "mul", (x, x))
>>> float(jvp(t, y.value, {x: 1.0}))        # d(x * x)/dx at 3
6.0
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np

from . import _registry as R
from ._backward import zeros_like_spec
from ._kernels import KernelCache
from ._result import TapeError
from ._tape import Node, Tape, node_id
from ._typing import Array, ArrayLike, Attrs, NodeId

__all__ = ["TangentGroup", "get_jvp", "jvp", "jvp_groups", "jvp_keys"]

_JVP_CACHE = KernelCache("jvp")

TangentGroup: TypeAlias = tuple[Sequence[NodeId], ArrayLike, str, R.Spec | None]
"""``(node ids, tangent, what the key is, its (shape, dtype) or None)``: one tangent given to several nodes."""


def get_jvp(op: str | R.OpDef, attrs: Attrs, specs: tuple[R.Spec, ...], mask: tuple[bool, ...]) -> Callable[..., Array]:
    """Compiled ``(*inputs, *tangents of the masked inputs) -> tangent of the output``, bound to runtime values in ``attrs``.

    ``op`` is a registered name or a definition (a node's: see :func:`~tapeflow._core._registry.kernel_cache_key`).

    >>> import numpy as np
    >>> f32 = np.dtype("float32")
    >>> f = get_jvp("mul", (), (((), f32), ((), f32)), (True, False))
    >>> float(f(np.float32(2.0), np.float32(5.0), np.float32(1.0)))   # d(x * y)/dx . 1 = y
    5.0
    """
    d = R.definition(op)
    akey, rt = R.kernel_key(d, attrs) if attrs else ((), {})
    key = R.kernel_cache_key(d, akey, specs, mask)
    fn = _JVP_CACHE.hit(key)
    if fn is None:
        static = {k: v for k, v in attrs if k not in rt}
        fwd, n = d.fwd, len(specs)
        pos = tuple(i for i, m in enumerate(mask) if m)

        def body(*args: Array, **rt: int | float | jax.Array) -> Array:
            xs, ts = args[:n], args[n:]

            def f(*dx: Array) -> Array:
                full = list(xs)
                for i, v in zip(pos, dx):
                    full[i] = v
                return fwd(*full, **static, **rt)

            return jax.jvp(f, tuple(xs[i] for i in pos), tuple(ts))[1]

        fn = jax.jit(R.logged_kernel(body, d.name, "tangent kernel", static))
        _JVP_CACHE.put(key, fn)
    return functools.partial(fn, **rt) if rt else fn


def _tangent(t: ArrayLike, spec: R.Spec, what: str) -> Array:
    """Check that tangent ``t`` fits a value of ``spec`` (a float node's); returns it as an array."""
    shape, dtype = spec
    if dtype == R.OBJECT:
        raise TapeError(
            f"jvp: {what} holds exact rationals (object dtype); forward mode is not supported on them. "
            "Record float values, or use backward"
        )
    if not R.is_float(dtype):
        raise TapeError(
            f"jvp: {what} is {R.fmt_spec(spec)}; only float values carry tangents. Leave it out of the tangents"
        )
    if getattr(t, "dtype", None) is None:  # a Python number or nested lists: take the node's dtype
        try:
            t = jnp.asarray(t, dtype)
        except (TypeError, ValueError) as e:
            raise TapeError(f"jvp: the tangent for {what} is not an array of numbers ({e})") from None
    got = (tuple(np.shape(t)), np.dtype(t.dtype))
    if got != (shape, dtype):
        raise TapeError(
            f"jvp: the tangent for {what} is {R.fmt_spec(got)} but {R.fmt_spec(spec)} was expected; "
            f'pass an array of the same shape and dtype, e.g. jnp.asarray(tangent, "{dtype}")'
        )
    return t


def jvp(tape: Tape, root: NodeId, tangents: Mapping[NodeId, ArrayLike]) -> Array:
    """The tangent of node ``root`` given ``tangents`` ``{node_id: tangent}`` (a Jacobian-vector product).

    * Tangents are normally given for leaves; one given for an interior node is
      used as that node's tangent, whatever its parents carry.
    * Each tangent must have its node's shape and dtype, and only float nodes
      carry them (integer and boolean nodes, and ops such as comparisons,
      carry none; so does the output of ``stop_gradient``).
    * A root reached by no tangent gets zeros of its shape and dtype.
    * Exact-rational (object) nodes are not supported in forward mode.
    * Pure: works on a tape whose values are tracers inside ``jax.jit``.

    >>> import jax.numpy as jnp
    >>> from tapeflow import Tape, leaf, record
    >>> t, x = leaf(Tape.empty(), jnp.array([1.0, 2.0]))
    >>> t, y = leaf(t, jnp.array([3.0, 4.0]))
    >>> t, z = record(t, "mul", (x, y))
    >>> jvp(t, z.value, {x: jnp.ones(2), y: jnp.zeros(2)}).tolist()   # y * dx
    [3.0, 4.0]
    """
    root = node_id(tape, root, "jvp", "root")
    nodes = list(tape.nodes)  # a list: _push reads each node several times
    seeds: dict[int, Array] = {}
    for k, v in tangents.items():
        i = node_id(tape, k, "jvp", "a tangent key")
        seeds[i] = _tangent(v, nodes[i].spec, f"node #{i}")
    return _push(nodes, root, seeds)


def jvp_groups(tape: Tape, root: NodeId, groups: Iterable[TangentGroup]) -> Array:
    """:func:`jvp` with each tangent given to every node of its group (e.g. every use of one parameter).

    Each group is ``(node_ids, tangent, what, spec)``: ``what`` names the key
    in error messages, ``spec`` (its shape and dtype, or None) validates a
    tangent whose group has no node. A node given two tangents is an error.

    >>> import jax.numpy as jnp
    >>> from tapeflow import Tape, leaf, record
    >>> t, w1 = leaf(Tape.empty(), jnp.array(2.0))
    >>> t, w2 = leaf(t, jnp.array(2.0))          # two uses of one weight
    >>> t, y = record(t, "mul", (w1, w2))
    >>> float(jvp_groups(t, y.value, [((w1, w2), 1.0, "w", None)]))
    4.0
    """
    root = node_id(tape, root, "jvp", "root")
    nodes = list(tape.nodes)  # a list: _push reads each node several times
    seeds: dict[int, Array] = {}
    given: dict[int, str] = {}
    for group, v, what, spec in groups:
        ids = [node_id(tape, i, "jvp", f"a node of {what}") for i in group]
        for i in ids:
            if i in given:
                raise TapeError(
                    f"jvp: node #{i} is given a tangent by both {given[i]} and {what}; give each value one tangent"
                )
            given[i] = what
        if spec is None and ids:
            spec = nodes[ids[0]].spec
        if spec is not None:
            v = _tangent(v, spec, what)
        for i in ids:  # every node of a group normally has the group's spec
            seeds[i] = v if nodes[i].spec == spec else _tangent(v, nodes[i].spec, f"{what} (node #{i})")
    return _push(nodes, root, seeds)


def jvp_keys(
    tape: Tape, root: NodeId, tangents: Mapping[Any, ArrayLike], storage_by_leaf: Mapping[NodeId, object]
) -> Array:
    """:func:`jvp_groups` for :meth:`Session.jvp <tapeflow.Session.jvp>`, whose keys it has already checked.

    A key with a ``storage`` (a ``Param``) gives its tangent to every leaf of
    that storage in ``storage_by_leaf`` (none: it contributes nothing); any
    other key is a live handle and gives it to its node ``key.id``.

    >>> import jax.numpy as jnp
    >>> from tapeflow import Param, Tape, leaf, record
    >>> w = Param(jnp.array(2.0), name="w")
    >>> t, w1 = leaf(Tape.empty(), w.value)
    >>> t, w2 = leaf(t, w.value)                 # two uses of w
    >>> t, y = record(t, "mul", (w1, w2))
    >>> float(jvp_keys(t, y.value, {w: 1.0}, {w1: w.storage, w2: w.storage}))
    4.0
    """
    groups: list[TangentGroup] = []
    for k, v in tangents.items():
        st = getattr(k, "storage", None)
        if st is None:
            groups.append(([k.id], v, f"tensor #{k.id}", None))
            continue
        ids = [i for i, s in storage_by_leaf.items() if s is st]
        what = f"Param {k.name!r}" if k.name else "an unnamed Param"
        groups.append((ids, v, what, (tuple(k.shape), np.dtype(k.dtype))))
    return jvp_groups(tape, root, groups)


def _push(nodes: Sequence[Node], root: int, seeds: dict[int, Array]) -> Array:
    """Push the validated ``seeds`` forward to ``root``, visiting only nodes on a path to it."""
    rnode = nodes[root]
    if rnode.dtype == R.OBJECT:
        raise TapeError(
            f"jvp: root #{root} holds exact rationals (object dtype); forward mode is not supported on them"
        )
    if root in seeds:
        return seeds[root]
    seeds = {i: v for i, v in seeds.items() if i < root}
    if not seeds or not R.is_float(rnode.dtype):
        return zeros_like_spec(rnode.spec)
    start = min(seeds)
    # nodes start..root that root depends on, and the last of them to read each node
    needed = [False] * (root - start + 1)
    needed[-1] = True
    last: dict[int, int] = {}
    for i in range(root, start - 1, -1):
        if not needed[i - start] or i in seeds:
            continue
        for p in nodes[i].parents:
            if p >= start:
                needed[p - start] = True
                last.setdefault(p, i)
    tan = {i: v for i, v in seeds.items() if needed[i - start]}
    for i in range(start, root + 1):
        if not needed[i - start] or i in seeds:
            continue
        nd = nodes[i]
        if nd.op is None:
            continue
        parents = nd.parents
        mask = tuple(p in tan for p in parents)
        d = nd.opdef  # the definition the node was recorded with
        if d is None:
            raise TapeError(
                f"jvp: node #{i} records op {nd.op!r}, which is not registered; record it with a registered op"
            )
        if any(mask) and R.is_float(nd.dtype) and d.tangent:
            if d.nondiff:
                mask = tuple(m and j not in d.nondiff for j, m in enumerate(mask))
            if any(mask):
                if nd.dtype == R.OBJECT:
                    raise TapeError(
                        f"jvp: node #{i} ({nd.op}) holds exact rationals (object dtype); "
                        "forward mode is not supported on them"
                    )
                fn = get_jvp(d, nd.attrs, tuple([nodes[p].spec for p in parents]), mask)
                tan[i] = fn(*[nodes[p].value for p in parents], *[tan[p] for p, m in zip(parents, mask) if m])
        for p in parents:
            if last.get(p) == i:
                tan.pop(p, None)
    out = tan.get(root)
    return zeros_like_spec(rnode.spec) if out is None else out
