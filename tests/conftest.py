import atexit
import os
import shutil
import sys
import tempfile
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


def _lazy_everywhere() -> None:
    """``TAPEFLOW_TEST_LAZY=1 python -m pytest`` makes lazy the default of every session in the suite."""
    import os

    if os.environ.get("TAPEFLOW_TEST_LAZY") == "1":
        import tapeflow

        tapeflow.Session.__init__.__kwdefaults__["lazy"] = True


_lazy_everywhere()


@pytest.fixture
def small_gc_heap():
    """Hide the objects earlier tests left (compiled programs, caches) from the cyclic garbage collector.

    Late in the suite the heap holds millions of long-lived objects; a test that allocates a
    lot (the stateful fuzzer, the property tests) then spends most of its time in full
    collections that walk them all (3.5x slower than the same test run alone). Frozen objects
    are skipped by the collector until the test ends.
    """
    import gc

    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
