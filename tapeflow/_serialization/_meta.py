"""Checkpoint metadata as one typed structure, validated in one place.

:class:`CheckpointMeta` and its entries are frozen dataclasses whose field
names are the JSON keys of a checkpoint's ``meta`` item and whose field types
are the schema: :meth:`CheckpointMeta.from_json` checks a raw JSON value
against them and raises :class:`CheckpointError` naming the checkpoint and the
bad field, never a raw ``KeyError`` or ``ValueError``.

>>> import numpy as np
>>> m = CheckpointMeta((ParamEntry("w", (2,), np.dtype("float32")),), (0,), False,
...                    (StorageEntry("s0", 0, "ab"),), None, SessionEntry(0, 3), "0")
>>> CheckpointMeta.from_json("ckpt", m.to_json()) == m
True
>>> CheckpointMeta.from_json("ckpt", {**m.to_json(), "alias_layout": [1]})
Traceback (most recent call last):
...
tapeflow.CheckpointError: checkpoint at ckpt is corrupted or incomplete: ...
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields, is_dataclass
from types import UnionType
from typing import NoReturn, TypeAlias, cast, get_args, get_origin, get_type_hints

import numpy as np

from .._core._checks import is_int
from .._shell._random import RNG_COUNTER_RANGE, RNG_SEED_RANGE

__all__ = [
    "FORMAT",
    "VERSION",
    "CheckpointError",
    "CheckpointMeta",
    "LeafEntry",
    "OptimizerEntry",
    "ParamEntry",
    "SessionEntry",
    "StorageEntry",
    "bad_meta",
]

FORMAT = "tapeflow.checkpoint"
VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint could not be saved or restored; nothing was installed."""


CheckpointError.__module__ = "tapeflow"  # its public home: tfl.CheckpointError


# --------------------------------------------------------------------------- metadata

Json: TypeAlias = "bool | int | float | str | list[Json] | dict[str, Json] | None"
# metadata ints lie in [0, 2**63) (the session's RNG counter range); a seed in the session's seed range
# [-2**63, 2**63): JAX's int64 seed range, which holds uint32's
_I64 = RNG_COUNTER_RANGE[1]
assert RNG_COUNTER_RANGE == (0, _I64) and RNG_SEED_RANGE[1] == _I64


@dataclass(frozen=True)
class ParamEntry:
    """One parameter registration: its name (None when unnamed), shape and dtype."""

    name: str | None
    shape: tuple[int, ...]
    dtype: np.dtype[np.generic]


@dataclass(frozen=True)
class StorageEntry:
    """One stored parameter array: its orbax key, the first registration of its storage, its SHA-256 digest."""

    key: str
    registration: int
    digest: str


@dataclass(frozen=True)
class LeafEntry:
    """One optax state leaf: its orbax key, key path in the state tree, shape, dtype and SHA-256 digest."""

    key: str
    path: str
    shape: tuple[int, ...]
    dtype: np.dtype[np.generic]
    digest: str


@dataclass(frozen=True)
class OptimizerEntry:
    """The optimizer: its state treedef (as text) and leaves, its alias layout, each slot's first registration."""

    treedef: str
    leaves: tuple[LeafEntry, ...]
    alias_layout: tuple[int, ...]
    slot_registrations: tuple[int, ...]


@dataclass(frozen=True)
class SessionEntry:
    """The session's RNG state: its ``seed`` (negative ones too) and ``rng_counter`` (the number of keys drawn)."""

    seed: int = field(metadata={"lo": RNG_SEED_RANGE[0]})
    rng_counter: int


@dataclass(frozen=True)
class CheckpointMeta:
    """The ``meta`` item of a checkpoint, typed: everything :func:`save` records besides the arrays.

    ``alias_layout[i]`` is the first registration sharing registration ``i``'s storage, ``storages`` holds one
    array per storage in layout order. The JSON keys are the field names (plus ``format`` and ``version``); the
    field types are the schema :meth:`from_json` checks.
    """

    registrations: tuple[ParamEntry, ...]
    alias_layout: tuple[int, ...]
    keyed: bool
    storages: tuple[StorageEntry, ...]
    optimizer: OptimizerEntry | None
    session: SessionEntry | None
    jax_version: str

    def to_json(self) -> dict[str, Json]:
        """The JSON object :func:`save` writes; :meth:`from_json` reads it back to an equal value."""
        return {"format": FORMAT, "version": VERSION, **cast("dict[str, Json]", _json(self))}

    @classmethod
    def from_json(cls, path: str, raw: Json) -> CheckpointMeta:
        """Validate the metadata ``raw`` of the checkpoint at ``path``; a CheckpointError names both and the bad field."""
        if not isinstance(raw, dict):
            raise bad_meta(path, f"is a {type(raw).__name__}, not an object")
        if raw.get("format") != FORMAT:
            raise bad_meta(path, f"has format {raw.get('format')!r}, expected {FORMAT!r}")
        if not _in(raw.get("version"), VERSION, VERSION + 1):
            raise CheckpointError(
                f"checkpoint at {path} has format version {raw.get('version')!r}; this tapeflow reads version {VERSION}. "
                "Use the tapeflow version that wrote it"
            )
        meta = cast(CheckpointMeta, _parse(path, "", cls, raw))
        n, om = len(meta.registrations), meta.optimizer
        _check_layout(path, "alias_layout", meta.alias_layout, n)
        firsts, stored = [i for i, c in enumerate(meta.alias_layout) if c == i], [s.registration for s in meta.storages]
        if stored != firsts:
            raise bad_meta(
                path,
                f"field 'storages' does not match its alias layout: it stores registrations {stored!s:.80}, "
                f"the layout's storages start at {firsts!s:.80}",
            )
        if om is not None:
            _check_layout(path, "optimizer.alias_layout", om.alias_layout, len(om.alias_layout))
            slots = sum(c == i for i, c in enumerate(om.alias_layout))
            if len(om.slot_registrations) != slots or not all(r < n for r in om.slot_registrations):
                raise bad_meta(
                    path,
                    f"field 'optimizer.slot_registrations' is {list(om.slot_registrations)!s:.80}, "
                    f"expected {slots} registrations below {n} (one per storage of the optimizer's alias layout)",
                )
        return meta


def _json(x: object) -> Json:
    """A metadata value as JSON: entries become objects keyed by field name, tuples lists, dtypes their names."""
    if isinstance(x, tuple):
        return [_json(v) for v in x]
    if isinstance(x, np.dtype):
        return x.name
    if is_dataclass(x) and not isinstance(x, type):
        return {f.name: _json(getattr(x, f.name)) for f in fields(x)}
    return cast(Json, x)


def bad_meta(path: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint at {path} is corrupted or incomplete: its metadata {what}; re-save it, or restore from an intact copy"
    )


def _fail(path: str, where: str, v: Json, expected: str) -> NoReturn:
    raise bad_meta(path, f"field '{where}' is {v!r:.60} ({type(v).__name__}), expected {expected}")


def _in(v: Json, lo: int, hi: int) -> bool:
    return is_int(v) and lo <= cast(int, v) < hi


def _is_dtype(v: Json) -> bool:
    try:
        return isinstance(v, str) and np.dtype(v).kind not in "OUS"  # object and string arrays are never saved
    except (TypeError, ValueError, SyntaxError):
        return False


_KINDS: dict[object, str] = {str: "string", bool: "flag", int: "integer", tuple: "list", np.dtype: "dtype name"}


@functools.cache
def _schema(cls: type) -> list[tuple[str, object, int]]:
    """(name, type, lowest int allowed) of each field of a metadata dataclass."""
    hints = get_type_hints(cls)
    return [(f.name, hints[f.name], f.metadata.get("lo", 0)) for f in fields(cls)]


def _parse(path: str, where: str, tp: object, v: Json, lo: int = 0) -> object:
    """The JSON ``v`` at field ``where`` checked against, and built as, the metadata type ``tp`` (ints: >= ``lo``)."""
    origin, args = get_origin(tp) or tp, get_args(tp)
    if origin is UnionType:  # an entry or null
        return None if v is None else _parse(path, where, args[0], v, lo)
    if origin is tuple:
        items = v if isinstance(v, list) else _fail(path, where, v, "a list")
        return tuple(_parse(path, f"{where}[{i}]", args[0], x, lo) for i, x in enumerate(items))
    if isinstance(origin, type) and is_dataclass(origin):
        obj = v if isinstance(v, dict) else _fail(path, where, v, "an object")
        for name, t, _ in _schema(origin):
            if name not in obj:
                sub = f"{where}.{name}" if where else name
                raise bad_meta(path, f"has no '{sub}' {_KINDS.get(get_origin(t) or t, 'entry')}")
        return origin(
            **{n: _parse(path, f"{where}.{n}" if where else n, t, obj[n], low) for n, t, low in _schema(origin)}
        )
    if origin is np.dtype:
        return np.dtype(cast(str, v)) if _is_dtype(v) else _fail(path, where, v, "the name of a numeric NumPy dtype")
    if origin is int:
        return (
            int(cast(int, v))
            if _in(v, lo, _I64)
            else _fail(path, where, v, f"an int in [{'-2**63' if lo else 0}, 2**63)")
        )
    return v if isinstance(v, cast(type, origin)) else _fail(path, where, v, f"a {_KINDS[origin]}")


def _check_layout(path: str, where: str, lay: tuple[int, ...], n: int) -> None:
    if len(lay) != n or not all(c <= i and lay[c] == c for i, c in enumerate(lay)):
        raise bad_meta(
            path,
            f"field '{where}' is {list(lay)!s:.80}, not an alias layout of {n} registrations "
            "(entry i: the first registration of i's storage)",
        )
