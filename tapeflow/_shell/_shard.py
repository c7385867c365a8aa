"""Where parameter storages live on a device mesh: :func:`shard` and its rules.

:func:`shard` places each parameter *storage* once (tied registrations are
one storage) on a ``jax.sharding.Mesh``, by a rule: ``"fsdp"`` cuts each
storage along one dimension over the data axis, ``"replicate"`` copies it to
every device, and a list of ``(regex, PartitionSpec)`` pairs names the
placement of each parameter by its name (tensor parallelism). The placement is
JAX's own: each value becomes a ``jax.Array`` with a ``NamedSharding``, and
the storage is pinned to it (:attr:`Storage.pinned`), so every later write
(an eager or lazy step, ``train_step``, a restore, ``p.value = ...``) lands on
the same sharding. :func:`placement_dot` draws where each storage lives.

>>> import jax, numpy as np, tapeflow as tfl
>>> from jax.sharding import Mesh
>>> mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
>>> fsdp_spec((1024, 64), 1), fsdp_spec((3,), 2), fsdp_spec((), 8)
(P('data', None), P(), P())
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from functools import partial
from typing import TypeAlias

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._core import _registry as R
from .._core._typing import Array
from . import _render
from ._commit import commit
from ._params import Param, ParamTarget, Storage, registrations
from ._render import spec_text

__all__ = [
    "Rules",
    "ShardTarget",
    "fsdp_spec",
    "named_records",
    "place",
    "placement_dot",
    "replicated_on",
    "shard",
]


ShardTarget: TypeAlias = ParamTarget
"""What :func:`shard` places: a module, a Param, a list of Params or a dict ``name -> Param``."""

Rules: TypeAlias = "str | Sequence[tuple[str, PartitionSpec]]"
"""``"fsdp"``, ``"replicate"``, or ``(regex, PartitionSpec)`` pairs matched on parameter names."""


def named_records(target: ShardTarget, where: str = "shard") -> list[tuple[str, Param]]:
    """Every registration of ``target`` with the name rules match: ``(name, Param)``, tied ones included.

    A module's names are its paths (``named_parameters`` / ``parameter_records``,
    buffers included); a dict's its keys; a list's each ``Param.name`` (its
    position when it has none); a lone Param's its name (``""`` without one).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> w = tfl.Param(jnp.ones(2), name="w")
    >>> [n for n, _ in named_records([w, tfl.tie(w, name="w_out"), tfl.Param(jnp.ones(1))])]
    ['w', 'w_out', '2']
    """
    pairs, _ = registrations(target, where)
    if isinstance(target, Param):
        return [(pairs[0][0] or "", target)]
    return [(str(i) if n is None else n, p) for i, (n, p) in enumerate(pairs)]


def fsdp_spec(shape: Sequence[int], size: int, axis: str = "data") -> PartitionSpec:
    """The ``"fsdp"`` placement of a storage of ``shape`` over a mesh axis of ``size`` devices.

    Its largest dimension that ``size`` divides (the lower one on a tie) is cut
    over ``axis``; a storage with no such dimension is replicated.

    >>> fsdp_spec((512, 512), 8), fsdp_spec((6, 16), 4, "d"), fsdp_spec((7,), 2)
    (P('data', None), P(None, 'd'), P())
    """
    best = None
    for d, n in enumerate(shape):
        if n > 0 and n % size == 0 and (best is None or n > shape[best]):
            best = d
    if best is None:
        return PartitionSpec()
    return PartitionSpec(*[axis if d == best else None for d in range(len(shape))])


def _normal(spec: PartitionSpec) -> tuple[object, ...]:
    parts = [tuple(p) if isinstance(p, list) else p for p in spec]
    while parts and parts[-1] is None:
        parts.pop()
    return tuple(parts)


def replicated_on(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """A sharding that holds a whole copy on every device of ``sharding`` (for step counters and scalars).

    >>> import jax, numpy as np
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    >>> replicated_on(NamedSharding(mesh, PartitionSpec("data"))).spec
    P()
    """
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    devices = [d for d in jax.devices() if d in sharding.device_set]
    if len(devices) == 1:
        return jax.sharding.SingleDeviceSharding(devices[0])
    return NamedSharding(Mesh(np.array(devices), ("_all",)), PartitionSpec())


def place(value: Array, sharding: jax.sharding.Sharding) -> Array:
    """``value`` as a ``jax.Array`` on ``sharding``; with several processes, each makes only its own shards.

    >>> import jax, jax.numpy as jnp
    >>> one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    >>> place(jnp.ones(2), one).sharding == one
    True
    """
    if sharding.is_fully_addressable or not getattr(value, "is_fully_addressable", True):
        return jax.device_put(value, sharding)
    host = np.asarray(value)  # the same value on every process (each built the model alike)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _rule_specs(rules: Rules, mesh: Mesh, data_axis: str) -> Callable[[str, Param], tuple[PartitionSpec, str]]:
    """The rule as ``(name, param) -> (spec, why)``; ``why`` names the rule in a conflict message."""
    if isinstance(rules, str):
        if rules == "replicate":
            return lambda name, p: (PartitionSpec(), '"replicate"')
        if rules == "fsdp":
            if data_axis not in mesh.shape:
                raise ValueError(
                    f'shard(rules="fsdp"): the mesh has no axis {data_axis!r} (its axes: {dict(mesh.shape)}); '
                    "pass data_axis= naming the axis to shard parameters over"
                )
            size = mesh.shape[data_axis]
            return lambda name, p: (fsdp_spec(p.shape, size, data_axis), '"fsdp"')
        raise ValueError(
            f'shard: unknown rules {rules!r}; use "fsdp", "replicate" or a list of (regex, PartitionSpec) pairs'
        )
    table: list[tuple[re.Pattern[str], PartitionSpec, str]] = []
    for i, rule in enumerate(rules):
        try:
            pattern, spec = rule
        except (TypeError, ValueError):
            raise TypeError(f"shard: rule {i} is {rule!r}; each rule is a pair (regex, PartitionSpec)") from None
        if not isinstance(pattern, str):
            raise TypeError(f"shard: rule {i} has the pattern {pattern!r}; a pattern is a regex string")
        if not isinstance(spec, PartitionSpec):
            raise TypeError(
                f"shard: rule {i} ({pattern!r}) gives {type(spec).__name__} {spec!r}; give a "
                "jax.sharding.PartitionSpec, e.g. PartitionSpec(None, 'model')"
            )
        try:
            compiled = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"shard: rule {i} has the pattern {pattern!r}, which is not a regex ({e})") from None
        table.append((compiled, spec, f"rule {i} ({pattern!r})"))

    def by_name(name: str, p: Param) -> tuple[PartitionSpec, str]:
        for compiled, spec, why in table:
            if compiled.fullmatch(name):
                return spec, why
        return PartitionSpec(), "no rule (replicated)"

    return by_name


def _check_spec(name: str, p: Param, spec: PartitionSpec, mesh: Mesh, why: str) -> None:
    """Raise ``ValueError`` unless ``spec`` places ``p`` on ``mesh``: known axes, rank, divisible dimensions."""
    if len(spec) > len(p.shape):
        raise ValueError(
            f"shard: {why} gives {name!r} {R.fmt_spec((p.shape, p.dtype))} the spec {spec_text(spec)}, which has "
            f"{len(spec)} entries for {len(p.shape)} dimensions; nothing was placed"
        )
    for d, entry in enumerate(spec):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        size = 1
        for a in axes:
            if a not in mesh.shape:
                raise ValueError(
                    f"shard: {why} places {name!r} over the mesh axis {a!r}, which the mesh does not have (its "
                    f"axes: {dict(mesh.shape)}); nothing was placed"
                )
            size *= mesh.shape[a]
        if p.shape[d] % size:
            raise ValueError(
                f"shard: {why} cuts dimension {d} of {name!r} {R.fmt_spec((p.shape, p.dtype))} into {size} "
                f"parts over {axes}, which do not divide {p.shape[d]}; change the rule for {name!r} (or the "
                "mesh); nothing was placed"
            )


def shard(target: ShardTarget, mesh: Mesh, rules: Rules = "fsdp", *, data_axis: str = "data") -> None:
    """Place every parameter storage of ``target`` on ``mesh``, once per storage, by ``rules``.

    ``target`` is a ``tfl.nn.Module`` (its parameters and buffers), a
    :class:`~tapeflow.Param`, a list of Params or a dict ``name -> Param``.
    ``rules``:

    * ``"fsdp"`` (fully sharded data parallelism): each storage is cut along its
      largest dimension that the size of the mesh axis ``data_axis`` divides (the
      lower dimension on a tie); a storage with no such dimension is replicated;
    * ``"replicate"``: a whole copy on every device;
    * a sequence of ``(regex, PartitionSpec)`` pairs: each parameter's name (a
      module's paths as ``named_parameters()`` gives them, a dict's keys, a
      list's ``Param.name``) is matched with ``re.fullmatch``; the first match
      gives its spec, and a parameter no rule matches is replicated. Over a mesh
      such as ``("data", "model")`` this is tensor parallelism.

    Tied registrations are one storage, placed once; when two names of one
    storage get different specs, ``ValueError`` names both and nothing is
    placed (as for any other refused rule). After ``shard`` the storage lives
    only as its shards (``p.sharding``), every path computes on them (eager and
    lazy sessions, :func:`~tapeflow.train_step` without ``mesh=``,
    ``jax.jit(tfl.value_and_grad(...))``), every write keeps the placement, and
    an :class:`~tapeflow.Optimizer`'s per-parameter state takes its storage's
    sharding. ``p.value`` is the sharded ``jax.Array``: nothing is gathered
    until you ask (``np.asarray(p.value)``). Call ``shard`` again to move the
    storages to another mesh or rule.

    Inputs are not moved: shard a batch over the data axis yourself, e.g.
    ``jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))`` (or
    ``jax.make_array_from_process_local_data`` with several processes).

    >>> import jax, numpy as np, tapeflow as tfl
    >>> from jax.sharding import Mesh
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    >>> model = tfl.nn.Linear(4, 8)
    >>> tfl.shard(model, mesh)                      # fsdp over the "data" axis
    >>> model.weight.sharding.spec, model.bias.sharding.spec
    (P('data',), P('data',))
    >>> rules = [(r"weight", jax.sharding.PartitionSpec(None, "data"))]
    >>> tfl.shard(model, mesh, rules)
    >>> model.weight.sharding.spec, model.bias.sharding.spec
    (P(None, 'data'), P())
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"shard: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    records = named_records(target)
    spec_of = _rule_specs(rules, mesh, data_axis)
    chosen: dict[int, tuple[Storage, str, PartitionSpec, str]] = {}  # id(storage) -> its first name's choice
    for name, p in records:
        spec, why = spec_of(name, p)
        st = p.storage
        first = chosen.get(id(st))
        if first is None:
            if st.dtype == R.OBJECT:
                raise TypeError(
                    f"shard: {name!r} holds exact rationals (NumPy object values), which live on the host and "
                    "cannot be sharded; convert them to a float dtype first; nothing was placed"
                )
            if isinstance(st.read_current(), jax.core.Tracer):
                raise TypeError(f"shard: {name!r} holds a value being traced by JAX; call shard outside jax.jit")
            _check_spec(name, p, spec, mesh, why)
            chosen[id(st)] = (st, name, spec, why)
        elif _normal(first[2]) != _normal(spec):
            raise ValueError(
                f"shard: {first[1]!r} and {name!r} are one storage (tied), but {first[3]} gives {first[1]!r} "
                f"{spec_text(first[2])} and {why} gives {name!r} {spec_text(spec)}; a storage is placed once: "
                "make the rules agree for every name of a tied parameter; nothing was placed"
            )
    placed = []
    for st, _, spec, _ in chosen.values():  # every value placed before any storage changes
        # written as XLA writes the shardings of its results (no trailing None), so results compare equal
        sharding = NamedSharding(mesh, PartitionSpec(*_normal(spec)))
        placed.append((st, sharding, place(st.read_current(), sharding)))
    commit(where="shard", then=[partial(st.pin, sharding, v) for st, sharding, v in placed])


def placement_dot(target: ShardTarget) -> str:
    """Graphviz DOT text of where each parameter storage of ``target`` lives: one row per storage, one column per device.

    Under each device, the number of the slice of the storage it holds (a
    storage kept whole spans every device with one cell); then the shape and
    bytes of one slice, and a last row with the most bytes one device holds
    against one copy of everything. Tied names share a row. Render it with
    Graphviz (``dot -Tsvg``), as docs/_ext/figures.py does for the Scaling out guide.

    >>> import jax, numpy as np, tapeflow as tfl
    >>> from jax.sharding import Mesh
    >>> model = tfl.nn.Linear(4, 8)
    >>> tfl.shard(model, Mesh(np.array(jax.devices()[:1]), ("data",)))
    >>> print(tfl.placement_dot(model).splitlines()[0])
    digraph placement {
    """
    return _render.placement_dot(named_records(target, "placement_dot"))
