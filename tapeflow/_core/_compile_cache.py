"""JAX's persistent compilation cache, on by default: a program compiled once is loaded by the next process.

XLA compiles every new program (an eager op kernel, a lazy session's program, a
``train_step``, an optimizer update) and, left to itself, forgets it when the
process ends, so every run of a script waits for the same compiles again. JAX can
keep compiled programs on disk, but only once it is told where, and with its
default thresholds it skips the small programs (compiled in under a second) that
a training loop is made of. tapeflow turns it on when it is imported:

* ``TAPEFLOW_CACHE_DIR`` unset: a per-user folder (``platformdirs.user_cache_dir``,
  e.g. ``~/.cache/tapeflow`` on Linux), unless the program already set JAX's
  ``jax_compilation_cache_dir`` itself, which is then left as it is;
* ``TAPEFLOW_CACHE_DIR=/some/path``: that folder; ``TAPEFLOW_CACHE_DIR=""``: off. A path that cannot be
  a folder (it, or a folder above it, is a file) turns the cache off with one warning that says so.

:func:`set_cache_dir` changes it later (``None``: off). Programs go in a
subfolder named by the jax and jaxlib versions, so programs compiled by another
version are never read (JAX's own keys include them too). The folder is kept
under :data:`MAX_BYTES` by :func:`trim`, at most once a day, oldest programs
first (JAX's own size bound rescans the whole folder under a file lock at every
compile, which is why it is not used). Setting it up touches only JAX's
configuration and that folder: importing tapeflow starts no backend.

>>> import tapeflow as tfl
>>> folder = tfl.cache_dir()
>>> folder is None or folder.name.startswith("jax-")
True
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from pathlib import Path

import jax
import jaxlib

__all__ = ["MAX_BYTES", "TRIM_EVERY_S", "cache_dir", "set_cache_dir", "setup_from_environment", "trim", "versioned"]

MAX_BYTES = 2 * 1024**3
"""The most a cache folder may hold (2 GiB): :func:`trim` removes the oldest programs beyond it."""

TRIM_EVERY_S = 24 * 3600
"""How often a folder is looked over by :func:`trim` (once a day: the scan reads every file's size)."""

_MARK = ".tapeflow-trimmed"

ENV = "TAPEFLOW_CACHE_DIR"


def versioned(
    folder: str | os.PathLike[str], jax_version: str | None = None, jaxlib_version: str | None = None
) -> Path:
    """The subfolder of ``folder`` for programs of this jax and jaxlib (or of the versions given).

    >>> versioned("/tmp/c", "0.4.30", "0.4.31").as_posix()
    '/tmp/c/jax-0.4.30-jaxlib-0.4.31'
    """
    jv = jax.__version__ if jax_version is None else jax_version
    lv = jaxlib.__version__ if jaxlib_version is None else jaxlib_version
    return Path(folder) / f"jax-{jv}-jaxlib-{lv}"


def _default_folder() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("tapeflow", appauthor=False))


def trim(folder: str | os.PathLike[str], max_bytes: int = MAX_BYTES, *, force: bool = False) -> int:
    """Remove the oldest programs of ``folder`` until it holds at most ``max_bytes``; the number of bytes removed.

    Runs at most once per :data:`TRIM_EVERY_S` per folder (a marker file's time says when it last ran)
    unless ``force``. A program another process is loading as it goes is compiled again there.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> for k in range(3):
    ...     _ = (d / f"p{k}-cache").write_bytes(b"x" * 10)
    ...     os.utime(d / f"p{k}-cache", (k, k))   # p0 is the oldest
    >>> trim(d, 25), sorted(p.name for p in d.glob("*-cache"))
    (10, ['p1-cache', 'p2-cache'])
    """
    root = Path(folder)
    mark = root / _MARK
    now = time.time()
    with contextlib.suppress(OSError):
        if not force and now - mark.stat().st_mtime < TRIM_EVERY_S:
            return 0
    entries: list[tuple[float, int, Path]] = []
    with contextlib.suppress(OSError):
        for p in root.iterdir():
            if not p.name.startswith(".") and p.is_file():  # programs only: not the marker, nor a lock file
                st = p.stat()
                entries.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in entries)
    removed = 0
    for _, size, p in sorted(entries, key=lambda e: e[0]):
        if total - removed <= max_bytes:
            break
        with contextlib.suppress(OSError):  # gone already: another process trimmed it
            p.unlink()
            removed += size
    with contextlib.suppress(OSError):  # a read-only folder: JAX warns about it at its first write
        mark.touch()
    return removed


def _file_in_the_way(path: Path) -> Path | None:
    """The file at ``path`` or above it that keeps ``path`` from being a folder (None: it can be one)."""
    for p in (path, *path.parents):
        if p.exists():
            return None if p.is_dir() else p
    return None


def _not_a_folder(path: Path, blocker: Path, source: str) -> str:
    where = "is a file" if blocker == path else f"is below {blocker}, which is a file"
    said = f"{source}: {path} {where}, so it cannot hold compiled programs"
    if source == "set_cache_dir":
        return f"{said}; the cache is left as it was. Pass a folder (or None to turn the cache off)"
    return (
        f"{said}; the persistent compilation cache is off in this process (tfl.cache_dir() is None). Point "
        f"{ENV} at a folder, or set it to '' to turn the cache off without this warning"
    )


def set_cache_dir(folder: str | os.PathLike[str] | None) -> Path | None:
    """Keep compiled programs in ``folder`` (in its subfolder for this jax version); ``None`` turns the cache off.

    Takes effect for the next compile, also after programs were already compiled
    in this process. Returns the subfolder in use (None: off). A folder that
    already is such a subfolder is used as it is, so ``set_cache_dir(cache_dir())``
    changes nothing and puts back a cache that was changed.

    >>> import tempfile, tapeflow as tfl
    >>> before = tfl.cache_dir()
    >>> used = tfl.set_cache_dir(tempfile.mkdtemp())
    >>> used.name.startswith("jax-"), tfl.cache_dir() == used
    (True, True)
    >>> tfl.set_cache_dir(None) is None, tfl.cache_dir()
    (True, None)
    >>> tfl.set_cache_dir(before) == before
    True

    A path that cannot be a folder (it, or a folder above it, is a file) raises
    :class:`NotADirectoryError` and leaves the cache as it was.
    """
    if folder is not None and not isinstance(folder, (str, os.PathLike)):
        raise TypeError(
            f"set_cache_dir: the folder must be a path (str or os.PathLike), got {type(folder).__name__} "
            f"{folder!r}; pass None to turn the persistent compilation cache off"
        )
    if folder is not None:
        blocker = _file_in_the_way(Path(folder))
        if blocker is not None:
            raise NotADirectoryError(_not_a_folder(Path(folder), blocker, "set_cache_dir"))
    from jax.experimental.compilation_cache import compilation_cache as cc

    cc.reset_cache()  # JAX reads its settings once, at its first compile: read them again at the next one
    if folder is None:
        jax.config.update("jax_compilation_cache_dir", None)
        return None
    path = Path(folder)
    if path.name != versioned(path).name:
        path = versioned(path)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # a training loop's programs are small
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", -1)  # bounded by trim: no rescan at every compile
    trim(path)
    return path


def _jax_folder() -> str | None:
    """JAX's ``jax_compilation_cache_dir`` setting now."""
    folder = jax.config.values["jax_compilation_cache_dir"]
    return None if folder is None else str(folder)


def cache_dir() -> Path | None:
    """The folder compiled programs are kept in now (None: the persistent cache is off)."""
    folder = _jax_folder()
    return None if not folder else Path(folder)


def setup_from_environment() -> Path | None:
    """At import: the cache ``TAPEFLOW_CACHE_DIR`` asks for (see the module's docstring); the folder or None."""
    asked = os.environ.get(ENV)
    if asked is None and _jax_folder():  # the program set JAX's cache up itself: its choice stands
        return cache_dir()
    if asked == "":
        return set_cache_dir(None)
    path = _default_folder() if asked is None else Path(asked)
    blocker = _file_in_the_way(path)
    if blocker is not None:  # said once, here: with the cache off, JAX has nothing to warn about at each compile
        warnings.warn(_not_a_folder(path, blocker, ENV if asked else "the default cache folder"), stacklevel=2)
        return set_cache_dir(None)
    return set_cache_dir(path)
