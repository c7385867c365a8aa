import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)


def _share_compiled_programs() -> None:
    """One compilation cache for this run of the suite, shared by its processes, removed at the end.

    tapeflow keeps compiled programs in JAX's persistent cache (``TAPEFLOW_CACHE_DIR``). The suite
    points it at a fresh folder per run, never at the user's own: the process that starts the run
    makes the folder, and the xdist workers and the scripts the tests start inherit its name, so
    each distinct program is compiled once per run (many tests build the same small programs in new
    jitted functions, which JAX's in-memory caches compile again). Only compilation is shared:
    tracing, and every count of traces and programs the tests assert, is unchanged.
    """
    if os.environ.get("TAPEFLOW_TEST_XLA_CACHE") is None:
        folder = tempfile.mkdtemp(prefix="tapeflow-tests-xla-")
        os.environ["TAPEFLOW_TEST_XLA_CACHE"] = os.environ["TAPEFLOW_CACHE_DIR"] = folder
        atexit.register(shutil.rmtree, folder, ignore_errors=True)


_share_compiled_programs()


def _share_run_folder() -> None:
    """A folder of this run of the suite, shared by its processes (``TAPEFLOW_TEST_RUN_DIR``), removed at the end.

    Made by the process that starts the run, as the compilation cache is: what one xdist worker
    makes there once (the docs site, see ``docs_site_build``) the other worker reads.
    """
    if os.environ.get("TAPEFLOW_TEST_RUN_DIR") is None:
        folder = tempfile.mkdtemp(prefix="tapeflow-tests-run-")
        os.environ["TAPEFLOW_TEST_RUN_DIR"] = folder
        atexit.register(shutil.rmtree, folder, ignore_errors=True)


_share_run_folder()

# Test modules share helpers with `from _helpers import ...`; make this folder importable
# under every --import-mode (the default "prepend" mode already does it, "importlib" does not).
_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


def _register_hypothesis_profiles() -> None:
    """Named profiles only (the default profile stays as it is).

    ``--hypothesis-profile=long`` runs the stateful fuzzer of ``test_fuzz_session.py`` for about ten
    minutes (locally; without it that test uses its own CI-sized settings).
    """
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "long",
        max_examples=220,
        stateful_step_count=50,
        deadline=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
            HealthCheck.large_base_example,
        ],
    )


_register_hypothesis_profiles()


import pytest  # noqa: E402


@pytest.fixture(params=[False, True], ids=["eager", "lazy"])
def lazy_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Run a test twice: with eager sessions, then with every ``tfl.Session()`` lazy (``Session(lazy=True)``).

    Test modules opt in with ``pytestmark = pytest.mark.usefixtures("lazy_mode")``; a session
    created with an explicit ``lazy=`` keeps it. The switch is the default of ``Session``'s
    keyword-only ``lazy`` parameter, so the library holds no test-only setting.
    """
    import tapeflow

    monkeypatch.setitem(tapeflow.Session.__init__.__kwdefaults__, "lazy", request.param)
    return bool(request.param)


@pytest.fixture
def library_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``tfl.Session()`` gets the library's own default (lazy), also when the suite runs under ``TAPEFLOW_LAZY=0``.

    ``TAPEFLOW_LAZY=0 python -m pytest`` runs every default session of the suite op by op. The text
    that shows what a user's default session does (the docstring examples: ``tfl.Session().lazy`` is
    ``True`` there; the doc pages that show what their code printed) runs with the library's default.
    """
    import tapeflow

    monkeypatch.delenv("TAPEFLOW_LAZY", raising=False)
    monkeypatch.setitem(tapeflow.Session.__init__.__kwdefaults__, "lazy", None)


@pytest.fixture
def small_gc_heap():
    """Hide the objects earlier tests left (compiled programs, caches) from the cyclic garbage collector.

    Late in the suite the heap holds millions of long-lived objects; a test that allocates a
    lot (the stateful fuzzer, the property tests) then spends most of its time in full
    collections that walk them all (3.5x slower than the same test run alone). Frozen objects
    are skipped by the collector until the test ends.
    """
    yield from _frozen_heap()


@pytest.fixture(scope="module")
def small_gc_heap_for_module():
    """``small_gc_heap`` for a whole module: what earlier modules left is frozen from its first test to its last.

    For a module whose tests call ``gc.collect()`` often (to check that a wrapper, an array or a
    recording was freed): each such collection then walks only what the module made, not the
    whole heap (late in the suite about a second per call). What the module makes is collected
    as before, so every check that something was freed still runs on the same objects. Modules
    opt in with ``pytestmark = pytest.mark.usefixtures("small_gc_heap_for_module")``; a test of
    such a module must not use ``small_gc_heap`` (its ``gc.unfreeze()`` ends the module's freeze).
    """
    yield from _frozen_heap()


def _frozen_heap():
    """Collect, then freeze every object alive now until the caller's fixture ends (see small_gc_heap)."""
    import gc

    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _file_cost(scope: str) -> float:
    """A file's rough seconds in a full run (``tests/_file_costs.py``); a file not listed there counts as the longest."""
    from _file_costs import COSTS

    return COSTS.get(Path(scope).name, float("inf"))


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist loadfile`` that hands out the longest file left first (the times of ``tests/_file_costs.py``).

    xdist hands out the files with the most tests first, so long files of few tests (the fuzzer's
    one test, the multi-device subprocesses of test_shard.py) could start last: one worker ran them
    while the other had nothing left to do. Longest first, the files that start last are the
    shortest, and both workers finish at about the same time. A file the table does not list yet
    goes first: it cannot then be a long file that starts last. Other ``--dist`` modes, and an xdist
    whose scheduler has no work queue to reorder, keep xdist's own scheduling.
    """
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    if not hasattr(LoadFileScheduling, "_assign_work_unit"):
        return None

    class LongestFirst(LoadFileScheduling):
        def _assign_work_unit(self, node: object) -> None:
            queue = getattr(self, "workqueue", None)
            if queue and hasattr(queue, "move_to_end"):
                queue.move_to_end(max(queue, key=_file_cost), last=False)
            super()._assign_work_unit(node)

    return LongestFirst(config, log)


@pytest.fixture
def lane_counts(monkeypatch):
    """Counts of lane backwards taken (the whole outline, values only) and of lanes turned into nodes."""
    from tapeflow._shell import _planner, _replay

    counts = {"backward": 0, "built": 0}
    lane_backward, build = _planner.BackwardPlanner.lane_backward, _replay.Lane.tape

    def counted_backward(self, root, state_log):
        got = lane_backward(self, root, state_log)
        counts["backward"] += got is not None
        return got

    def counted_build(self):
        counts["built"] += self.built is None
        return build(self)

    monkeypatch.setattr(_planner.BackwardPlanner, "lane_backward", counted_backward)
    monkeypatch.setattr(_replay.Lane, "tape", counted_build)
    return counts


@dataclass(frozen=True)
class SiteBuild:
    """One ``mkdocs build --strict`` of the docs: its exit status, its log and the site folder it wrote."""

    returncode: int
    log: str
    site: Path


@pytest.fixture(scope="session")
def docs_site_build() -> SiteBuild:
    """One strict build of the site per run of the suite, shared by every process of the run.

    tests/test_docs.py checks the build (its warnings, its links) and tests/test_docs_layout.py
    loads its pages in a browser; under xdist they run on different workers. The first process
    to ask builds into the run's folder (``TAPEFLOW_TEST_RUN_DIR``) while holding a file lock;
    the other waits for the lock and reads the same build. The sources do not change during a
    run, so both see the site a build of their own would make. ``--strict`` stops mkdocs only
    after it wrote every page (its warnings count at the end), so a strict build that failed on
    warnings still wrote the whole site.
    """
    import json

    folder = Path(os.environ["TAPEFLOW_TEST_RUN_DIR"]) / "docs-site"
    folder.mkdir(exist_ok=True)
    result = folder / "result.json"
    with open(folder / "lock", "w") as lock:
        try:
            import fcntl
        except ImportError:  # no POSIX locks (Windows): each module's process builds its own
            folder = Path(tempfile.mkdtemp(dir=folder))
            result = folder / "result.json"
        else:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not result.is_file():
            exe = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or shutil.which("mkdocs")
            assert exe, "mkdocs is a dev dependency (pip install -e '.[dev]')"
            proc = subprocess.run(
                [exe, "build", "--strict", "--site-dir", str(folder / "site")],
                cwd=Path(__file__).resolve().parents[1],
                capture_output=True,
                text=True,
                timeout=300,
                env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # mkdocs-material's banner about MkDocs 2.0
            )
            result.write_text(json.dumps({"returncode": proc.returncode, "log": proc.stdout + proc.stderr}))
        got = json.loads(result.read_text())
    return SiteBuild(got["returncode"], got["log"], folder / "site")
