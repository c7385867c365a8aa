"""The file-system side of checkpoints: orbax access, staging siblings, recovery of a half swap.

A :func:`~tapeflow.save` stages the new checkpoint in a sibling directory
``<path>.tapeflow-tmp-<id>`` and, when replacing, moves the old one to
``<path>.tapeflow-old-<id>`` before renaming the new one into place;
:func:`recover` finishes a swap that was killed between the two renames.

>>> sibling("/ckpt/run1", "tmp", "0123456789ab")
'/ckpt/run1.tapeflow-tmp-0123456789ab'
>>> recover("/no/such/dir/run1")  # nothing staged beside it: nothing to finish
'/no/such/dir/run1'
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from types import ModuleType
from typing import Protocol

from .._core._typing import PyTree
from ._meta import CheckpointError

__all__: list[str] = []

PARAMS = "params"
OPT = "opt_state"
META = "meta"
ORBAX_MARKER = "_CHECKPOINT_METADATA"


def import_orbax() -> ModuleType:
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # pragma: no cover - dependency of the package
        raise CheckpointError(
            "tapeflow checkpoints need orbax-checkpoint; install it with `pip install orbax-checkpoint`"
        ) from e
    return ocp


def short(e: BaseException) -> str:
    """The gist of an orbax / TensorStore error (without the multi-kilobyte store spec)."""
    msg = str(e).split("\n", 1)[0]
    for cut in (" [tensorstore_spec", " See full TensorStore details", "tensorstore_spec"):
        k = msg.find(cut)
        if k > 0:
            msg = msg[:k]
    msg = msg.strip().rstrip(".:")
    return f"{type(e).__name__}: {msg[:300]}{'...' if len(msg) > 300 else ''}"


class Checkpointer(Protocol):
    """What tapeflow uses of orbax's ``Checkpointer`` (orbax ships no type information): a context manager
    that saves and restores a ``Composite`` of items in a checkpoint directory."""

    def __enter__(self) -> Checkpointer: ...
    def __exit__(self, *exc: object) -> None: ...
    def save(self, directory: str, *, args: object) -> None: ...
    def restore(self, directory: str, *, args: object) -> Mapping[str, PyTree]: ...


def checkpointer() -> Checkpointer:
    ocp = import_orbax()
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def sibling(path: str, kind: str, sid: str) -> str:
    """Where save ``sid`` stages the new checkpoint (``kind`` "tmp") or moves the one it replaces ("old")."""
    return f"{path}.tapeflow-{kind}-{sid}"


def siblings(path: str) -> list[tuple[str, str, str]]:
    """(path, kind, save id) of each staging sibling of ``path``; kind "orbax-tmp": a "tmp" orbax never finished."""
    parent, base = os.path.split(path)
    pattern = re.compile(re.escape(base) + r"\.tapeflow-(tmp|old)-([0-9a-f]{12})(\.orbax-checkpoint-tmp.*)?")
    found = [m for n in sorted(os.listdir(parent)) if (m := pattern.fullmatch(n))] if os.path.isdir(parent) else []
    return [(os.path.join(parent, m[0]), "orbax-tmp" if m[3] else m[1], m[2]) for m in found]


def recover(path: str) -> str:
    """Finish the swap of a :func:`save` killed between its two renames; returns the directory holding ``path``."""
    sibs = [] if os.path.lexists(path) else siblings(path)
    halfway = [t for t, kind, sid in sibs if kind == "tmp" and (sibling(path, "old", sid), "old", sid) in sibs]
    if halfway:
        try:
            os.rename(halfway[0], path)
        except OSError:  # e.g. a read-only directory: read the new checkpoint where it is
            return path if os.path.lexists(path) else halfway[0]
    return path
