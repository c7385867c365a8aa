"""``tfl.save(..., overwrite=True)`` is atomic, cleans up after killed saves, and replaces only its own checkpoints.

The kill tests run a save in a subprocess that ends itself with ``os._exit(17)`` just before one named step of
the save, for every step it performs: each ``os.rename`` (orbax's own included), each ``shutil.rmtree`` and a point
partway through each rmtree (after its first file is unlinked). The library has no test hooks: the child wraps those
functions (see :func:`install_step_hooks`). After each kill the parent checks that ``restore`` gives exactly the old
or exactly the new checkpoint (which one, from where the kill fell), that the next ``save(overwrite=True)`` succeeds
and removes every leftover staging sibling and nothing else, and that the final restore gives the newest values.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import tapeflow as tfl
from tapeflow import CheckpointError

KILLED = 17
OLD, NEW, NEWEST, STALE = 0, 100, 200, 300  # value offsets (and session seeds) of the checkpoints involved
SAVE_ID = re.compile(r"[0-9a-f]{12}")
# Siblings that look alike but are not the staging directories of a save to <root>/ckpt: never touched.
UNRELATED = ["ckpt.backup", "other.tapeflow-tmp-x", "ckpt2.tapeflow-old-0123456789ab", "ckpt.tapeflow-tmp-x"]
# Leftovers of earlier killed saves to <root>/ckpt: a replaced checkpoint whose removal was cut short, and orbax's
# temporary of a staged checkpoint that was never finished.
LEFTOVERS = ["ckpt.tapeflow-old-0123456789ab", "ckpt.tapeflow-tmp-abcdef012345.orbax-checkpoint-tmp"]


def params(offset: int) -> list[tfl.Param]:
    return [
        tfl.Param(np.arange(4, dtype=np.float32) + offset, name="w"),
        tfl.Param(np.arange(3, dtype=np.int32) - offset, name="b"),
    ]


def save(path: Path | str, offset: int, **kw: bool) -> None:
    tfl.save(path, params(offset), session=tfl.Session(seed=offset), **kw)


def restored(path: Path) -> int:
    """The offset of the checkpoint at ``path``, checking that every value belongs to that one checkpoint."""
    ps, sess = params(-1), tfl.Session()
    tfl.restore(path, ps, session=sess)
    offset = sess.seed
    for got, want in zip(ps, params(offset)):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value))
    return offset


def install_step_hooks(on_step: Callable[[str], None]) -> Callable[[], None]:
    """Call ``on_step(name)`` before every rename and rmtree and partway through every rmtree; returns the undo."""
    rename, rmtree, unlink = os.rename, shutil.rmtree, os.unlink
    partway: list[str] = []

    def name(p: object) -> str:
        return SAVE_ID.sub("ID", os.path.basename(os.fspath(p)))

    def hooked_rename(src, dst, *a, **kw):
        on_step(f"rename {name(src)} -> {name(dst)}")
        return rename(src, dst, *a, **kw)

    def hooked_rmtree(p, *a, **kw):
        on_step(f"rmtree {name(p)}")
        partway[:] = [f"rmtree {name(p)} partway"]
        try:
            return rmtree(p, *a, **kw)
        finally:
            partway.clear()

    def hooked_unlink(p, *a, **kw):
        out = unlink(p, *a, **kw)
        if partway:
            on_step(partway.pop())
        return out

    os.rename, shutil.rmtree, os.unlink = hooked_rename, hooked_rmtree, hooked_unlink

    def undo() -> None:
        os.rename, shutil.rmtree, os.unlink = rename, rmtree, unlink

    return undo


def child_main(path: str, kill_at: int) -> None:
    """(In the subprocess.) Save NEW over ``path``, exiting with status 17 just before step ``kill_at``."""
    done: list[str] = []

    def on_step(step: str) -> None:
        if len(done) == kill_at:
            os._exit(KILLED)
        done.append(step)

    install_step_hooks(on_step)
    save(path, NEW, overwrite=True)


def run_killed(root: Path, kill_at: int) -> subprocess.CompletedProcess[str]:
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        f"import test_checkpoint_atomic as t; t.child_main({str(root / 'ckpt')!r}, {kill_at})"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def forking_main(jobs: str) -> None:
    """(In a fresh interpreter.) Import the library once, then run each ``root:kill_at`` of ``jobs`` in a fork.

    Each killed save still runs in a process of its own, as ``run_killed``'s do: the fork starts from an
    interpreter that has imported the library (and orbax) but started no JAX backend and saved nothing,
    and exits through ``child_main``. Its output goes to ``<root>.log``; this process prints one
    ``kill_at exit_status`` line per fork.
    """
    import orbax.checkpoint  # noqa: F401  (imported by the first save otherwise: once here, not in every fork)

    for job in jobs.split(";"):
        root, kill_at = job.rsplit(":", 1)
        with open(f"{root}.log", "w") as log:
            pid = os.fork()
            if pid == 0:  # the fork: its output to the log, its exit status to the waitpid below
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                status = 0
                try:
                    child_main(os.path.join(root, "ckpt"), int(kill_at))
                except BaseException:
                    import traceback

                    traceback.print_exc()
                    status = 1
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        _, status = os.waitpid(pid, 0)
        print(kill_at, os.waitstatus_to_exitcode(status), flush=True)


def run_all_killed(roots: dict[int, Path]) -> dict[int, tuple[int, str]]:
    """Each kill point's exit status and output: one killed save per process, as ``run_killed`` runs it.

    Where ``os.fork`` exists, one fresh interpreter imports the library once and forks one process per
    kill point from there (``forking_main``: about 0.3 s each, where a new interpreter spends 3 s importing
    the library); elsewhere every kill point gets an interpreter of its own (``run_killed``).
    """
    if not hasattr(os, "fork"):
        with ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
            procs = dict(zip(roots, pool.map(run_killed, roots.values(), roots)))
        return {k: (p.returncode, p.stderr) for k, p in procs.items()}
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            "import test_checkpoint_atomic as t; t.forking_main(sys.argv[1])",
            ";".join(f"{root}:{k}" for k, root in roots.items()),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got: dict[int, tuple[int, str]] = {}
    for line in proc.stdout.splitlines():
        k, status = (int(v) for v in line.split())
        got[k] = (status, Path(f"{roots[k]}.log").read_text())
    assert sorted(got) == sorted(roots), (sorted(got), proc.stdout, proc.stderr[-3000:])
    return got


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """<root>/ckpt holds OLD, beside leftovers of killed saves to it and unrelated look-alike siblings."""
    root = tmp_path_factory.mktemp("template")
    save(root / "ckpt", OLD)
    save(root / "stale", STALE)
    for name in LEFTOVERS:
        shutil.copytree(root / "stale", root / name)
    shutil.rmtree(root / "stale")
    for name in UNRELATED:
        (root / name).mkdir()
        (root / name / "keep.txt").write_text(name)
    return root


def steps_of_a_save(root: Path) -> list[str]:
    """The named steps of one ``save(NEW, overwrite=True)`` at ``root``, recorded in this process (on a copy)."""
    steps: list[str] = []
    copy = root.parent / f"{root.name}-record"
    shutil.copytree(root, copy)
    undo = install_step_hooks(steps.append)
    try:
        save(copy / "ckpt", NEW, overwrite=True)
    finally:
        undo()
    shutil.rmtree(copy)
    return steps


def check_after_kill(root: Path, expected: int | None, label: str) -> None:
    path = root / "ckpt"
    if expected is None:
        with pytest.raises(CheckpointError, match="does not exist"):
            restored(path)
    else:
        assert restored(path) == expected, label
    save(path, NEWEST, overwrite=True)
    assert sorted(os.listdir(root)) == sorted(["ckpt", *UNRELATED]), label
    for name in UNRELATED:
        assert (root / name / "keep.txt").read_text() == name
    assert restored(path) == NEWEST


@pytest.mark.parametrize("existing", [True, False], ids=["replace", "fresh"])
def test_kill_at_every_step_of_a_save(template: Path, tmp_path: Path, existing: bool) -> None:
    base = tmp_path / "base"
    shutil.copytree(template, base)
    if not existing:
        shutil.rmtree(base / "ckpt")
    steps = steps_of_a_save(base)
    cleanup = [f"rmtree {SAVE_ID.sub('ID', name)}{s}" for name in LEFTOVERS for s in ("", " partway")]
    swap = ["rename ckpt -> ckpt.tapeflow-old-ID"] if existing else []
    swap += ["rename ckpt.tapeflow-tmp-ID -> ckpt"]
    swap += ["rmtree ckpt.tapeflow-old-ID", "rmtree ckpt.tapeflow-old-ID partway"] if existing else []
    staged = "rename ckpt.tapeflow-tmp-ID.orbax-checkpoint-tmp -> ckpt.tapeflow-tmp-ID"
    assert steps[: len(cleanup)] == cleanup and steps[-len(swap) :] == swap, steps
    assert staged in steps[len(cleanup) : -len(swap)], steps  # orbax's own steps in between (per orbax version)
    # In the fresh case the cleanup steps are those of the replace case: kill from the first step of staging on.
    kill_points = range(len(steps)) if existing else range(len(cleanup), len(steps))
    first_new = steps.index(swap[0]) + 1  # from here on the new checkpoint is in place (or recovered into place)

    roots = {k: tmp_path / f"kill{k}" for k in kill_points}
    for root in roots.values():
        shutil.copytree(base, root)
    procs = run_all_killed(roots)
    for k, root in roots.items():
        label = f"killed before step {k}: {steps[k]}"
        assert procs[k][0] == KILLED, f"{label}\n{procs[k][1][-3000:]}"
        expected = NEW if k >= first_new else OLD if existing else None
        check_after_kill(root, expected, label)


def test_save_and_restore_finish_a_half_done_swap(tmp_path: Path) -> None:
    """A kill between the two renames: ``path`` missing, the replaced and the finished new checkpoint beside it."""
    path, sid = tmp_path / "ckpt", "0123456789ab"
    for first in ("restore", "save"):
        save(path, OLD, overwrite=True)
        save(f"{path}.tapeflow-tmp-{sid}", NEW)
        os.rename(path, f"{path}.tapeflow-old-{sid}")
        if first == "save":
            with pytest.raises(CheckpointError, match="already exists"):  # recovered first, so path exists
                save(path, NEWEST)
        assert restored(path) == NEW
        assert sorted(os.listdir(tmp_path)) == ["ckpt", f"ckpt.tapeflow-old-{sid}"]
        save(path, NEWEST, overwrite=True)
        assert os.listdir(tmp_path) == ["ckpt"] and restored(path) == NEWEST


def test_finished_staging_without_a_swap_is_not_promoted(tmp_path: Path) -> None:
    """A staged checkpoint whose save never moved the old one aside is a leftover, even when ``path`` is missing."""
    path = tmp_path / "ckpt"
    save(f"{path}.tapeflow-tmp-0123456789ab", NEW)
    with pytest.raises(CheckpointError, match="does not exist"):
        restored(path)
    save(path, NEWEST)
    assert os.listdir(tmp_path) == ["ckpt"] and restored(path) == NEWEST


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda d: (d.mkdir(), (d / "notes.txt").write_text("mine")),
            r"not a checkpoint written by tfl.save.*notes.txt",
        ),
        (
            lambda d: (save(d, OLD), (d / "notes.txt").write_text("mine")),
            r"tapeflow checkpoint but also holds notes.txt",
        ),
        (lambda d: (save(d, OLD), (d / "extra").mkdir()), r"tapeflow checkpoint but also holds extra"),
        (lambda d: d.write_text("a file"), r"it is a file, not a checkpoint directory"),
        (
            lambda d: (save(d, OLD), shutil.rmtree(d / "meta"), (d / "meta").mkdir()),
            r"not a checkpoint written by tfl.save",
        ),
        (
            lambda d: (save(d, OLD), os.remove(d / "_CHECKPOINT_METADATA")),
            r"not a checkpoint written by tfl.save",
        ),
    ],
    ids=["user-dir", "ckpt-plus-file", "ckpt-plus-dir", "file", "bad-meta", "no-orbax-marker"],
)
def test_overwrite_refuses_what_is_not_only_a_checkpoint(tmp_path: Path, make, match) -> None:
    path = tmp_path / "ckpt"
    make(path)
    before = _tree(tmp_path) if path.is_dir() else path.read_bytes()
    with pytest.raises(CheckpointError, match=match) as ei:
        save(path, NEW, overwrite=True)
    msg = str(ei.value)
    assert str(path) in msg and "remove it yourself, or choose another path" in msg
    assert (_tree(tmp_path) if path.is_dir() else path.read_bytes()) == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_overwrite_replaces_an_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    save(tmp_path / "ckpt", NEW, overwrite=True)
    assert os.listdir(tmp_path) == ["ckpt"] and restored(tmp_path / "ckpt") == NEW
