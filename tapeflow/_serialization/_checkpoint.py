"""Checkpoints: parameters, alias layout, optimizer state and session RNG, via orbax.

:func:`save` writes one directory of orbax items, staged in full beside the
path and then renamed into place (a killed save never leaves a half checkpoint):

* ``params``: the parameter values, one array per *storage* (tied
  registrations are stored once);
* ``opt_state``: the leaves of the optax state (when an optimizer is given);
* ``meta``: a JSON description: format version, every registration's name,
  shape and dtype, the alias layout, the optimizer's state structure (treedef
  string, leaf shapes and dtypes), its alias layout, the session's seed and RNG
  counter, and a SHA-256 digest of every array.

:func:`restore` validates the whole checkpoint against the destination before
it installs anything: layout slot by slot, shapes, dtypes, optimizer structure,
and that every array reads back with the digest it was saved with. On any
difference it raises :class:`CheckpointError` and leaves parameters, optimizer
state and RNG counter untouched.

>>> import tempfile, os, jax.numpy as jnp, tapeflow as tfl
>>> w = tfl.Param(jnp.arange(3.0), name="w")
>>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
>>> tfl.save(d, [w, tfl.tie(w, name="w_out")])
>>> v = tfl.Param(jnp.zeros(3), name="w")
>>> tfl.restore(d, [v, tfl.tie(v, name="w_out")])
>>> v.value.tolist()
[0.0, 1.0, 2.0]
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import (
    TYPE_CHECKING,
    NamedTuple,
    TypeAlias,
    cast,
)

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from .._core import _registry as R
from .._core._device import default_device, device_of
from .._core._typing import Array, ArrayLike, DTypeLike
from .._shell._commit import commit
from .._shell._params import Param, ParamTarget, canonical_indices, registrations
from .._shell._session import Session
from .._train._functional import TrainStep
from ._io import (
    META,
    OPT,
    ORBAX_MARKER,
    PARAMS,
    checkpointer,
    import_orbax,
    recover,
    short,
    sibling,
    siblings,
)
from ._meta import (
    CheckpointError,
    CheckpointMeta,
    LeafEntry,
    OptimizerEntry,
    ParamEntry,
    SessionEntry,
    StorageEntry,
    bad_meta,
)

if TYPE_CHECKING:
    from .._train._optim import Optimizer

__all__ = ["CheckpointError", "restore", "save"]

# --------------------------------------------------------------------------- collecting


ParamSource: TypeAlias = ParamTarget
StrPath: TypeAlias = "str | os.PathLike[str]"


def _registrations(params_or_module: ParamSource) -> tuple[list[str | None], list[Param], bool]:
    """(names, registrations, keyed): keyed when names come from a mapping or a module."""
    pairs, keyed = registrations(params_or_module)
    return [n for n, _ in pairs], [p for _, p in pairs], keyed


def _spec_str(shape: Iterable[int], dtype: DTypeLike) -> str:
    return R.fmt_spec((tuple(shape), np.dtype(dtype)))


def _layout(regs: list[Param]) -> tuple[int, ...]:
    """The alias layout of parameter registrations (never None: every Param has a storage)."""
    return tuple(cast("list[int]", canonical_indices([p.storage for p in regs])))


_SUM = "sum32:"  # the digest of an array over several devices: a checksum computed where its shards live


def _words(x: Array) -> Array:
    """The bits of ``x`` as uint32 words (one per element; two per element of an 8-byte dtype, on a new last axis)."""
    size = np.dtype(x.dtype).itemsize
    if x.dtype == np.bool_:
        return x.astype(jnp.uint32)
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    as_uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
    return jax.lax.bitcast_convert_type(x, as_uint).astype(jnp.uint32)


def _checksum(x: Array) -> Array:
    """Two position-weighted sums of ``x``'s bits, modulo 2**32 (integer sums: the same on any sharding)."""
    w = _words(x)
    index = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(w.ndim)):  # each element's flat position, without reshaping the shards
        index = index + jax.lax.broadcasted_iota(jnp.uint32, w.shape, d) * jnp.uint32(stride % 2**32)
        stride *= w.shape[d]
    odd = index * jnp.uint32(2) + jnp.uint32(1)
    mixed = (w ^ (w >> jnp.uint32(15))) * jnp.uint32(2654435761)
    return jnp.stack([jnp.sum(w * odd, dtype=jnp.uint32), jnp.sum(mixed + index, dtype=jnp.uint32)])


@jax.jit
def _checksums(xs: list[Array]) -> list[Array]:
    """:func:`_checksum` of every sharded array of a checkpoint, as one program."""
    return [_checksum(x) for x in xs]


def _digests(arrays: list[ArrayLike], like: list[str] | None = None) -> list[str]:
    """The digest saved with each array: SHA-256 of its bytes, or for an array over several devices a checksum
    computed where its shards live (nothing is gathered). ``like``: the saved digests, whose kinds are computed."""
    summed = [
        k
        for k, a in enumerate(arrays)
        if (like[k].startswith(_SUM) if like is not None else isinstance(a, jax.Array) and device_of(a) is None)
    ]
    out = [""] * len(arrays)
    if summed:
        for k, pair in zip(summed, jax.device_get(_checksums([arrays[k] for k in summed]))):
            out[k] = f"{_SUM}{int(pair[0]):08x}{int(pair[1]):08x}"
    for k, a in enumerate(arrays):
        if out[k]:
            continue
        if isinstance(a, jax.Array) and not a.is_fully_addressable:  # a SHA-256 digest restored over processes
            a = multihost_utils.process_allgather(a, tiled=True)
        out[k] = hashlib.sha256(np.ascontiguousarray(np.asarray(a)).tobytes()).hexdigest()
    return out


def _digest(a: ArrayLike) -> str:
    """The SHA-256 digest of one array, wherever it lives (see :func:`_digests`)."""
    return _digests([a], like=[""])[0]


def _reg_label(i: int, names: list[str | None]) -> str:
    n = names[i] if i < len(names) else None
    return f"registration {i}" + (f" ({n!r})" if n is not None else "")


def _check_not_rational(dtype: DTypeLike, what: str) -> None:
    if np.dtype(dtype) == R.OBJECT:
        raise CheckpointError(
            f"{what} holds exact rationals (object dtype); checkpoints of exact rational parameters are not supported. Convert the values to a float dtype first (or pickle them yourself)"
        )


def _opt_slot_registrations(optimizer: Optimizer, regs: list[Param], names: list[str | None], verb: str) -> list[int]:
    """For each optimizer slot, the first registration (in ``regs``) of its storage."""
    first: dict[int, int] = {}
    for i, p in enumerate(regs):
        first.setdefault(id(p.storage), i)
    out = []
    for k, st in enumerate(optimizer.storages):
        j = first.get(id(st))
        if j is None:
            rec = next((p for p in optimizer.records if p.storage is st), st)
            raise CheckpointError(
                f"the optimizer's slot {k} updates {rec!r}, which is not among the parameters being {verb}; pass every parameter the optimizer updates (e.g. the same list / module the optimizer was built from)"
            )
        out.append(j)
    return out


def _check_opt_current(optimizer: Optimizer) -> None:
    now = canonical_indices([p.storage for p in optimizer.records])
    if now != optimizer.alias_layout:
        raise CheckpointError(
            "the optimizer's alias layout changed since it was built (its parameters were re-tied); call optimizer.reinit() before saving or restoring"
        )


def _opt_leaves(optimizer: Optimizer) -> tuple[jax.tree_util.PyTreeDef, list[Array], list[str]]:
    """(treedef, leaves, key path of each leaf) of the optax state."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(optimizer.state)
    return treedef, [x for _, x in with_paths], [jax.tree_util.keystr(kp) for kp, _ in with_paths]


# --------------------------------------------------------------------------- save

_OWN_ENTRIES = frozenset({META, PARAMS, OPT, ORBAX_MARKER, "commit_success.txt"})


def _check_replaceable(path: str) -> None:
    """Refuse ``overwrite=True`` unless ``path`` is an empty directory or a tapeflow checkpoint and nothing else."""
    if os.path.islink(path) or not os.path.isdir(path):
        found = f"it is a {'symbolic link' if os.path.islink(path) else 'file'}, not a checkpoint directory"
    elif entries := sorted(os.listdir(path)):
        try:
            ours = os.path.isfile(os.path.join(path, ORBAX_MARKER)) and _load_meta(path) is not None
        except CheckpointError:
            ours = False
        if not (extra := [e for e in entries if e not in _OWN_ENTRIES]) and ours:
            return
        found = f"it is a tapeflow checkpoint but also holds {', '.join(extra[:5])}, which overwriting would delete"
        found = found if ours else f"it is not a checkpoint written by tfl.save (it holds {', '.join(entries[:5])})"
    else:
        return
    raise CheckpointError(
        f"refusing to overwrite {path}: {found}; overwrite=True replaces only a tapeflow checkpoint that holds nothing else (or an empty directory). Move your files out of it, remove it yourself, or choose another path"
    )


def save(
    path: StrPath,
    params_or_module: ParamSource,
    optimizer: Optimizer | None = None,
    session: Session | TrainStep | None = None,
    *,
    overwrite: bool = False,
) -> None:
    """Write a checkpoint directory at ``path`` (atomically).

    ``params_or_module``: a sequence of :class:`~tapeflow.Param` registrations
    (tied records included), a mapping ``name -> Param``, or a module with
    ``parameter_records()``. ``optimizer``: a :class:`~tapeflow.Optimizer` whose
    parameters are among them. ``session``: a :class:`~tapeflow.Session` whose
    seed and RNG counter are saved, or a :class:`~tapeflow.TrainStep` whose seed
    and step counter are (:attr:`TrainStep.rng_counter <tapeflow.TrainStep.rng_counter>`:
    what its dropout masks are drawn from), so a restored run continues bit for bit. ``overwrite=False`` refuses an existing path;
    ``overwrite=True`` replaces only a tapeflow checkpoint that holds nothing
    else (or an empty directory), atomically: the new checkpoint is written in
    full to ``path.tapeflow-tmp-ID``, then ``path`` is renamed to
    ``path.tapeflow-old-ID`` and the new one to ``path``. Both ``save`` and
    :func:`restore` first finish a swap killed between those renames (the new
    checkpoint is complete, so it moves into place): a kill at any instant leaves
    ``path`` restorable as exactly the old or the new checkpoint. ``save`` then
    removes the staging directories that killed saves to ``path`` left behind.

    >>> import tempfile, os, jax.numpy as jnp, optax, tapeflow as tfl
    >>> w = tfl.Param(jnp.ones(2), name="w")
    >>> opt, s = tfl.Optimizer(optax.adam(0.1), [w]), tfl.Session(seed=1)
    >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> tfl.save(d, [w], opt, s)
    >>> w2 = tfl.Param(jnp.zeros(2), name="w")
    >>> opt2, s2 = tfl.Optimizer(optax.adam(0.1), [w2]), tfl.Session()
    >>> tfl.restore(d, [w2], opt2, s2)
    >>> w2.value.tolist(), s2.seed
    ([1.0, 1.0], 1)
    >>> extra = tfl.Param(jnp.zeros(2))
    >>> tfl.restore(d, [w2, extra])  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    tapeflow.CheckpointError: checkpoint at ... has 1 parameter registrations,
      the destination has 2; ...
    """
    path = os.path.abspath(os.fspath(path))
    names, regs, keyed = _registrations(params_or_module)
    many, lead = jax.process_count() > 1, jax.process_index() == 0
    if lead:  # with several processes, one of them moves directories; the others wait for it
        recover(path)
    _sync(many, "tapeflow.save.recovered")
    if os.path.lexists(path):
        if not overwrite:
            raise CheckpointError(f"checkpoint path {path} already exists; pass overwrite=True to replace it")
        _check_replaceable(path)

    layout = _layout(regs)
    arrays: dict[str, dict[str, jax.Array | np.ndarray]] = {PARAMS: {}, OPT: {}}
    registrations = []
    for i, (n, p) in enumerate(zip(names, regs)):
        _check_not_rational(p.dtype, _reg_label(i, names))
        registrations.append(ParamEntry(n, tuple(p.shape), np.dtype(p.dtype)))
    storages: list[StorageEntry] = []
    for i, p in enumerate(regs):
        if layout[i] != i:
            continue
        key = f"param_{len(storages)}"
        v = p.storage.read_host()  # a sharded value as it is: each process writes the shards it holds
        arrays[PARAMS][key] = v
        storages.append(StorageEntry(key, i, ""))

    opt_meta = None
    if optimizer is not None:
        _check_opt_current(optimizer)
        slot_regs = _opt_slot_registrations(optimizer, regs, names, "saved")
        treedef, leaves, paths = _opt_leaves(optimizer)
        leaf_meta = []
        for j, (leaf, kp) in enumerate(zip(leaves, paths)):
            a = leaf if isinstance(leaf, (jax.Array, np.ndarray)) else np.asarray(leaf)
            _check_not_rational(a.dtype, f"optimizer state leaf {j}")
            key = f"opt_{j}"
            arrays[OPT][key] = a
            leaf_meta.append(LeafEntry(key, kp, tuple(np.shape(a)), np.dtype(a.dtype), ""))
        opt_layout = tuple(cast("list[int]", optimizer.alias_layout))
        opt_meta = OptimizerEntry(str(treedef), tuple(leaf_meta), opt_layout, tuple(slot_regs))
    # every digest at once (the arrays over several devices are checked where they live, in one program)
    digests = iter(_digests([*arrays[PARAMS].values(), *arrays[OPT].values()]))
    storages = [dataclasses.replace(e, digest=next(digests)) for e in storages]
    if opt_meta is not None:
        leaves_meta = tuple(dataclasses.replace(e, digest=next(digests)) for e in opt_meta.leaves)
        opt_meta = dataclasses.replace(opt_meta, leaves=leaves_meta)
    _check_rng_owner(session, "save")
    sess_meta = None if session is None else SessionEntry(int(session.seed), int(session.rng_counter))
    meta = CheckpointMeta(
        registrations=tuple(registrations),
        alias_layout=layout,
        keyed=keyed,
        storages=tuple(storages),
        optimizer=opt_meta,
        session=sess_meta,
        jax_version=jax.__version__,
    )

    ocp = import_orbax()
    items: dict[str, object] = {META: ocp.args.JsonSave(meta.to_json())}
    for item, tree in arrays.items():
        if tree:
            items[item] = ocp.args.StandardSave(tree)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if lead:
        for leftover, *_ in siblings(path):  # staging directories of killed saves
            shutil.rmtree(leftover, ignore_errors=True)
    sid = _shared_id(many)
    tmp, old = sibling(path, "tmp", sid), sibling(path, "old", sid)
    _sync(many, "tapeflow.save.staging")
    try:
        with checkpointer() as ck:  # with several processes, each writes the shards it holds
            ck.save(tmp, args=ocp.args.Composite(**items))
    except Exception as e:
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"saving the checkpoint to {path} failed ({short(e)}); no checkpoint was written (an existing one is left as it was)"
        ) from e
    _sync(many, "tapeflow.save.written")
    failed = _swap(tmp, path, old) if lead else None
    _sync(many, "tapeflow.save.installed")
    if failed is not None:
        raise failed


def _swap(tmp: str, path: str, old: str) -> CheckpointError | None:
    """Move the complete checkpoint ``tmp`` to ``path`` (the one there, if any, by way of ``old``); the error, if any."""
    try:
        if not os.path.lexists(path):
            os.rename(tmp, path)
            return None
        os.rename(path, old)  # a kill from here until recover's rename leaves the half-done swap recover finishes
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        return CheckpointError(
            f"saving the checkpoint to {path} failed ({short(e)}); no checkpoint was written (an existing one is left as it was)"
        )
    if recover(path) != path:
        os.rename(old, path)
        shutil.rmtree(tmp, ignore_errors=True)
        return CheckpointError(f"could not move the new checkpoint into {path}; the existing one is left as it was")
    shutil.rmtree(old, ignore_errors=True)
    return None


def _sync(many: bool, name: str) -> None:
    """With several processes (``jax.distributed``), wait until every one of them got here."""
    if many:
        multihost_utils.sync_global_devices(name)


def _shared_id(many: bool) -> str:
    """A new save's id (12 hex digits), the same on every process (process 0's)."""
    words = np.frombuffer(uuid.uuid4().bytes[:8], dtype=np.uint32) >> np.uint32(8)  # two 24-bit halves
    if many:
        words = np.asarray(multihost_utils.broadcast_one_to_all(words))
    return "".join(f"{int(w):06x}" for w in words)


# --------------------------------------------------------------------------- restore


def _load_meta(path: str) -> CheckpointMeta:
    """Read the ``meta`` item of the checkpoint directory at ``path`` (validated by ``from_json``)."""
    if not os.path.exists(path):
        raise CheckpointError(
            f"no checkpoint at {path}: the path does not exist; check the path (save writes a directory)"
        )
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path}: it is not a directory; tfl.save writes a checkpoint directory")
    if not os.path.isdir(os.path.join(path, META)):
        raise CheckpointError(
            f"checkpoint at {path} is corrupted or incomplete: the '{META}' item is missing (not a tapeflow checkpoint, or an interrupted copy); re-save it or restore from an intact copy"
        )
    ocp = import_orbax()
    try:
        with checkpointer() as ck:
            raw = ck.restore(path, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
    except Exception as e:
        raise bad_meta(path, f"could not be read ({short(e)})") from e
    return CheckpointMeta.from_json(path, raw)


def _layout_desc(c: int | None, i: int, names: list[str | None]) -> str:
    if c is None or c == i:
        return "its own storage"
    return f"tied to {_reg_label(c, names)}"


def _check_params(path: str, meta: CheckpointMeta, names: list[str | None], regs: list[Param], keyed: bool) -> None:
    saved = meta.registrations
    saved_names = [r.name for r in saved]
    if len(saved) != len(regs):
        raise CheckpointError(
            f"checkpoint at {path} has {len(saved)} parameter registrations, the destination has {len(regs)}; construct the destination exactly as the saved model (same parameters, ties and order)"
        )
    layout, saved_layout = list(_layout(regs)), list(meta.alias_layout)
    for i, (r, p) in enumerate(zip(saved, regs)):
        label = _reg_label(i, names)
        _check_not_rational(p.dtype, f"destination {label}")
        if keyed and meta.keyed and r.name != names[i]:
            raise CheckpointError(
                f"{label} is named {names[i]!r} in the destination but {r.name!r} in the checkpoint at {path}; construct the destination with the same parameter names and order as the saved model"
            )
        if layout[i] != saved_layout[i]:
            raise CheckpointError(
                f"alias layout differs at {label}: in the checkpoint at {path} it is {_layout_desc(saved_layout[i], i, saved_names)}, in the destination it is {_layout_desc(layout[i], i, names)} (checkpoint layout {saved_layout}, destination {layout}); tie the destination's parameters (tfl.tie) exactly as in the saved model"
            )
        if r.shape != tuple(p.shape):
            raise CheckpointError(
                f"shape differs at {label}: checkpoint {r.shape}, destination {p.shape}; construct the destination with the saved model's shapes"
            )
        if r.dtype != p.dtype:
            raise CheckpointError(
                f"dtype differs at {label}: checkpoint {r.dtype.name}, destination {p.dtype.name}; construct the destination with the saved dtypes (restore never casts)"
            )


def _check_optimizer(
    path: str, meta: CheckpointMeta, optimizer: Optimizer, regs: list[Param], names: list[str | None]
) -> tuple[OptimizerEntry, jax.tree_util.PyTreeDef, list[object]]:
    """The saved optimizer entry, and the destination's state treedef and leaves, once they agree."""
    om = meta.optimizer
    if om is None:
        raise CheckpointError(
            f"checkpoint at {path} holds no optimizer state, but an optimizer was given; pass optimizer=None (and start it fresh), or restore a checkpoint saved with its optimizer"
        )
    _check_opt_current(optimizer)
    ol, sl = list(om.alias_layout), optimizer.alias_layout
    if ol != sl:
        if len(ol) != len(sl):
            raise CheckpointError(
                f"the optimizer covers {len(sl)} registrations, the one in the checkpoint at {path} covered {len(ol)}; build the optimizer over the same parameters as the saved one"
            )
        k = next(i for i, (a, b) in enumerate(zip(ol, sl)) if a != b)
        raise CheckpointError(
            f"the optimizer's alias layout differs at its registration {k}: checkpoint {ol}, destination {sl}; build the optimizer over parameters tied exactly as in the saved model"
        )
    slot_regs, saved_slots = _opt_slot_registrations(optimizer, regs, names, "restored"), list(om.slot_registrations)
    if slot_regs != saved_slots:
        k = next(
            (i for i, (a, b) in enumerate(zip(slot_regs, saved_slots)) if a != b), min(len(slot_regs), len(saved_slots))
        )
        raise CheckpointError(
            f"the optimizer's slot {k} maps to a different parameter: checkpoint slots update registrations {saved_slots}, destination slots update {slot_regs}; build the optimizer over the parameters in the same order as the saved one"
        )
    treedef, leaves, paths = _opt_leaves(optimizer)
    saved_leaves = om.leaves
    fix = "build the optimizer with the same optax transformation (and parameter container) as the saved one"
    for j, (lm, leaf, kp) in enumerate(zip(saved_leaves, leaves, paths)):
        shape = tuple(np.shape(leaf))
        dtype = np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
        if lm.path != kp or lm.shape != shape or lm.dtype != dtype:
            raise CheckpointError(
                f"optimizer state structure differs from the checkpoint at {path} at state leaf {j}: checkpoint has {lm.path or '<root>'} {_spec_str(lm.shape, lm.dtype)}, destination has {kp or '<root>'} {_spec_str(shape, dtype)}; {fix}"
            )
    if len(saved_leaves) != len(leaves):
        j = min(len(saved_leaves), len(leaves))
        extra = f"checkpoint leaf {saved_leaves[j].path}" if j < len(saved_leaves) else f"destination leaf {paths[j]}"
        raise CheckpointError(
            f"optimizer state structure differs from the checkpoint at {path}: it has {len(saved_leaves)} state leaves, the destination has {len(leaves)} (first unmatched: {extra}); {fix}"
        )
    # The treedef string also tells apart containers and state classes with equal leaf paths
    # (e.g. adam vs. adamw); its text is only comparable within one jax version.
    a, b = om.treedef, str(treedef)
    if a != b and meta.jax_version == jax.__version__:
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        lo, hi = max(0, at - 40), at + 60
        pre = "..." if lo else ""
        raise CheckpointError(
            f"optimizer state structure differs from the checkpoint at {path} (state treedef, first difference at character {at}: checkpoint {pre}{a[lo:hi]}{'...' if hi < len(a) else ''}, destination {pre}{b[lo:hi]}{'...' if hi < len(b) else ''}); {fix}"
        )
    return om, treedef, leaves


def _target_sharding(current: object) -> jax.sharding.Sharding:
    """Where a restored array goes: where the value it replaces lives (its shards, for one over several devices)."""
    if isinstance(current, jax.ShapeDtypeStruct) and current.sharding is not None:
        return cast(jax.sharding.Sharding, current.sharding)  # a storage placed by tfl.shard
    dev = device_of(current)
    if dev is None and isinstance(current, jax.Array) and not isinstance(current, jax.core.Tracer):
        return current.sharding  # placed by tfl.shard (or a sharded step): restored shard by shard, on this mesh
    return jax.sharding.SingleDeviceSharding(dev if dev is not None else default_device())


class _Want(NamedTuple):
    """One array to read back: its expected spec and digest, the value it replaces (for placement), a label."""

    shape: tuple[int, ...]
    dtype: np.dtype[np.generic]
    digest: str
    current: object
    what: str


def _read_arrays(path: str, wanted: dict[str, dict[str, _Want]]) -> dict[str, jax.Array]:
    """Restore the named arrays of each item (``wanted[item][key]``) and verify shape, dtype and digest of each."""
    wanted = {item: w for item, w in wanted.items() if w}
    if not wanted:
        return {}
    for item in wanted:
        if not os.path.isdir(os.path.join(path, item)):
            raise CheckpointError(
                f"checkpoint at {path} is corrupted or incomplete: its '{item}' item is missing; re-save it or restore from an intact copy"
            )
    ocp = import_orbax()
    args = {
        item: ocp.args.StandardRestore(
            {
                k: jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=_target_sharding(spec.current))
                for k, spec in w.items()
            }
        )
        for item, w in wanted.items()
    }
    try:
        with checkpointer() as ck:
            restored = ck.restore(path, args=ocp.args.Composite(**args))
            got_items = {item: restored[item] for item in wanted}
    except Exception as e:
        msg = short(e)
        raise CheckpointError(
            f"checkpoint at {path} is corrupted or incomplete: its array data could not be read ({msg}); re-save it or restore from an intact copy"
        ) from e
    out: dict[str, jax.Array] = {}
    summed = [  # the checksums of arrays saved from several devices, computed where they were restored, at once
        (got_items[item].get(k), spec.digest)
        for item, w in wanted.items()
        for k, spec in w.items()
        if spec.digest.startswith(_SUM) and isinstance(got_items[item], Mapping) and got_items[item].get(k) is not None
    ]
    sums = dict(zip((id(v) for v, _ in summed), _digests([v for v, _ in summed], [d for _, d in summed])))
    for item, w in wanted.items():
        got = got_items[item]
        for k, (shape, dtype, digest, _, what) in w.items():
            v = got.get(k) if isinstance(got, Mapping) else None
            if v is None:
                raise CheckpointError(
                    f"checkpoint at {path} is corrupted or incomplete: the array for {what} is missing; re-save it or restore from an intact copy"
                )
            if tuple(np.shape(v)) != tuple(shape) or np.dtype(v.dtype) != dtype:
                raise CheckpointError(
                    f"checkpoint at {path} is corrupted: the array for {what} reads back as {_spec_str(np.shape(v), v.dtype)}, its metadata says {_spec_str(shape, dtype)}; re-save it or restore from an intact copy"
                )
            if (sums.get(id(v)) if digest.startswith(_SUM) else _digest(v)) != digest:
                raise CheckpointError(
                    f"checkpoint at {path} is corrupted: the data of {what} does not match the digest recorded at save time; re-save it or restore from an intact copy"
                )
            out[k] = v
    return out


def _check_rng_owner(session: object, where: str) -> None:
    if session is not None and not isinstance(session, (Session, TrainStep)):
        raise TypeError(
            f"tfl.{where}: session must be a tfl.Session or a tfl.TrainStep (whose RNG seed and counter a checkpoint "
            f"holds), got {type(session).__name__}; pass the session or train_step that draws the run's random masks"
        )


def restore(
    path: StrPath,
    params_or_module: ParamSource,
    optimizer: Optimizer | None = None,
    session: Session | TrainStep | None = None,
) -> None:
    """Load a checkpoint written by :func:`save` into existing parameters (and optimizer, session).

    The destination must be built like the saved model: same registrations in
    the same order, the same ties (alias layout, compared slot by slot), shapes
    and dtypes; an optimizer must have the same optax state structure and alias
    layout. Everything, including every array's integrity, is checked before
    anything is written; on any difference :class:`CheckpointError` names the
    first one and nothing changes. Then each parameter storage is written once,
    ``optimizer.state`` is replaced and the session's seed and RNG counter are set
    (a :class:`~tapeflow.TrainStep`'s seed and step counter: :meth:`TrainStep.set_rng_state
    <tapeflow.TrainStep.set_rng_state>`).

    >>> import tempfile, os, jax.numpy as jnp, optax, tapeflow as tfl
    >>> w = tfl.Param(jnp.ones(2), name="w")
    >>> opt = tfl.Optimizer(optax.sgd(0.1), [w])
    >>> def loss_fn(s, x):
    ...     return tfl.sum(tfl.dropout(w * x, 0.5))
    >>> step = tfl.train_step(loss_fn, opt, seed=5)
    >>> _ = step(jnp.ones(2)); _ = step(jnp.ones(2))
    >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> tfl.save(d, [w], opt, step)
    >>> w2 = tfl.Param(jnp.zeros(2), name="w")
    >>> opt2 = tfl.Optimizer(optax.sgd(0.1), [w2])
    >>> def loss_fn2(s, x):
    ...     return tfl.sum(tfl.dropout(w2 * x, 0.5))
    >>> step2 = tfl.train_step(loss_fn2, opt2)
    >>> tfl.restore(d, [w2], opt2, step2)
    >>> step2.seed, step2.step_count
    (5, 2)
    >>> bool(step(jnp.ones(2)) == step2(jnp.ones(2)))
    True
    """
    _check_rng_owner(session, "restore")
    check_thread = getattr(session, "check_thread", None)
    if check_thread is not None:
        check_thread()  # first: the RNG state is set together with the parameters
    path = os.path.abspath(os.fspath(path))
    many = jax.process_count() > 1
    if not many:
        path = recover(path)
    else:  # one process finishes a half swap; the others read what it left at path
        if jax.process_index() == 0:
            recover(path)
        _sync(many, "tapeflow.restore.recovered")
    names, regs, keyed = _registrations(params_or_module)
    meta = _load_meta(path)
    _check_params(path, meta, names, regs, keyed)
    wanted: dict[str, dict[str, _Want]] = {PARAMS: {}, OPT: {}}
    for s in meta.storages:
        p = regs[s.registration]
        what = f"parameter {_reg_label(s.registration, names)}"
        st = p.storage
        where = st.read(None) if st.pinned is None else jax.ShapeDtypeStruct(st.shape, st.dtype, sharding=st.pinned)
        wanted[PARAMS][s.key] = _Want(tuple(p.shape), p.dtype, s.digest, where, what)
    opt_plan: tuple[OptimizerEntry, jax.tree_util.PyTreeDef] | None = None
    if optimizer is not None:
        om, opt_treedef, leaves = _check_optimizer(path, meta, optimizer, regs, names)
        opt_plan = (om, opt_treedef)
        for j, (lm, leaf) in enumerate(zip(om.leaves, leaves)):
            wanted[OPT][lm.key] = _Want(lm.shape, lm.dtype, lm.digest, leaf, f"optimizer state leaf {j}")
    rng = meta.session
    if session is not None and rng is None:
        raise CheckpointError(
            f"checkpoint at {path} holds no session state, but a session was given; pass session=None"
        )
    if rng is not None and isinstance(session, TrainStep) and rng.rng_counter >= 2**32:
        raise CheckpointError(
            f"checkpoint at {path} holds RNG counter {rng.rng_counter}, past a TrainStep's uint32 step counter; "
            "restore it into a tfl.Session, or pass session=None"
        )
    got = _read_arrays(path, wanted)

    # -- everything checked: install, as one unit (nothing is written if any write is refused) -----------
    then: list[Callable[[], None]] = []
    if optimizer is not None and opt_plan is not None:
        om, opt_treedef = opt_plan
        new_state = jax.tree_util.tree_unflatten(opt_treedef, [got[lm.key] for lm in om.leaves])
        then.append(partial(setattr, optimizer, "state", new_state))
    if session is not None and rng is not None:
        then.append(partial(session.set_rng_state, seed=rng.seed, counter=rng.rng_counter))
    commit(
        [(regs[s.registration].storage, got[s.key]) for s in meta.storages],
        where="restore",
        label=lambda k: f"parameter {_reg_label(meta.storages[k].registration, names)}",
        then=then,
    )
