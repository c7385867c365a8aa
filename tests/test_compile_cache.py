"""The persistent compilation cache: on at import in a per-user, per-version folder; a second process loads
what the first compiled; ``TAPEFLOW_CACHE_DIR`` and :func:`tfl.set_cache_dir` choose or turn it off.

Each import-time case runs in a fresh process (the suite's own processes have imported tapeflow already),
with ``XDG_CACHE_HOME`` pointing into a temporary folder so no test writes to the user's cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import optax
import pytest

import tapeflow as tfl
from tapeflow._core import _compile_cache as C

VERSIONED = f"jax-{jax.__version__}-jaxlib-{jaxlib.__version__}"

PROBE = r"""
import json, sys
import jax
if sys.argv[1] == "user-set":
    jax.config.update("jax_compilation_cache_dir", sys.argv[2])
import tapeflow as tfl
from jax._src import xla_bridge
report = {
    "backend_started": bool(xla_bridge._backends),
    "cache_dir": None if tfl.cache_dir() is None else str(tfl.cache_dir()),
    "min_compile_secs": jax.config.jax_persistent_cache_min_compile_time_secs,
    "min_entry_bytes": jax.config.jax_persistent_cache_min_entry_size_bytes,
    "max_size": jax.config.jax_compilation_cache_max_size,
}
if sys.argv[1] == "train":
    events = []
    jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
    import jax.numpy as jnp, optax
    w = tfl.Param(jnp.ones((4, 3)), name="w")
    step = tfl.train_step(lambda s, x: tfl.sum(tfl.tanh(x @ w)), tfl.Optimizer(optax.adam(0.1), [w]))
    report["loss"] = float(step(jnp.ones((2, 4))))
    report["hits"] = sum(e == "/jax/compilation_cache/cache_hits" for e in events)
    report["misses"] = sum(e == "/jax/compilation_cache/cache_misses" for e in events)
print(json.dumps(report))
"""


def probe(tmp_path: Path, mode: str, *args: str, cache: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TAPEFLOW_CACHE_DIR", "TAPEFLOW_TEST_XLA_CACHE")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    if cache is not None:
        env["TAPEFLOW_CACHE_DIR"] = cache
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, mode, *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_turns_it_on_in_a_per_user_per_version_folder_and_starts_no_backend(tmp_path: Path) -> None:
    got = probe(tmp_path, "plain")
    assert got["backend_started"] is False
    assert got["cache_dir"] == str(tmp_path / "xdg" / "tapeflow" / VERSIONED)
    # small programs count: a training loop's programs compile in well under JAX's default second
    assert (got["min_compile_secs"], got["min_entry_bytes"]) == (0.0, 0)
    assert got["max_size"] == -1  # bounded by trim, not by a rescan of the folder at every compile


def test_the_environment_variable_chooses_the_folder_or_turns_it_off(tmp_path: Path) -> None:
    chosen = probe(tmp_path, "plain", cache=str(tmp_path / "mine"))
    assert chosen["cache_dir"] == str(tmp_path / "mine" / VERSIONED)
    off = probe(tmp_path, "plain", cache="")
    assert off["cache_dir"] is None


def test_a_cache_the_program_set_up_itself_is_left_as_it_is(tmp_path: Path) -> None:
    got = probe(tmp_path, "user-set", str(tmp_path / "own"))
    assert got["cache_dir"] == str(tmp_path / "own")


def test_a_second_process_loads_the_programs_the_first_compiled(tmp_path: Path) -> None:
    folder = str(tmp_path / "shared")
    first = probe(tmp_path, "train", cache=folder)
    stored = list((tmp_path / "shared" / VERSIONED).iterdir())
    assert stored, "the first process stored its compiled programs"
    second = probe(tmp_path, "train", cache=folder)
    assert first["misses"] > 0 and second["misses"] == 0  # every program of the step: loaded, none compiled
    assert second["hits"] == first["hits"] + first["misses"]
    assert second["loss"] == first["loss"]


def test_programs_of_another_jax_version_are_never_read() -> None:
    here = C.versioned("/c")
    assert here.name == VERSIONED
    assert C.versioned("/c", "0.4.35", jaxlib.__version__) != here
    assert C.versioned("/c", jax.__version__, "0.4.35") != here


def test_set_cache_dir_takes_effect_after_programs_were_compiled(tmp_path: Path) -> None:
    before = tfl.cache_dir()
    try:
        used = tfl.set_cache_dir(tmp_path / "later")
        assert used == tfl.cache_dir() == tmp_path / "later" / VERSIONED
        w = tfl.Param(jnp.full((5, 2), 0.5), name="w")
        step = tfl.train_step(lambda s, x: tfl.sum(x @ w), tfl.Optimizer(optax.sgd(0.1), [w]))
        step(jnp.ones((3, 5)))
        assert any(used.iterdir()), "programs compiled after set_cache_dir are stored in the new folder"
        assert tfl.set_cache_dir(None) is None and tfl.cache_dir() is None
        assert jax.config.jax_compilation_cache_dir is None
    finally:
        tfl.set_cache_dir(before)
    assert tfl.cache_dir() == before


def test_trim_removes_the_oldest_programs_beyond_the_bound_at_most_once_a_day(tmp_path: Path) -> None:
    for k in range(5):
        f = tmp_path / f"prog{k}-cache"
        f.write_bytes(b"x" * 100)
        os.utime(f, (1000 + k, 1000 + k))
    assert C.trim(tmp_path, 250) == 300
    assert sorted(p.name for p in tmp_path.glob("*-cache")) == ["prog3-cache", "prog4-cache"]
    (tmp_path / "prog5-cache").write_bytes(b"x" * 100)
    assert C.trim(tmp_path, 50) == 0, "looked over less than a day ago: not scanned again"
    assert C.trim(tmp_path, 50, force=True) == 300
    assert sorted(p.name for p in tmp_path.glob("*-cache")) == []
    assert (tmp_path / ".tapeflow-trimmed").exists()


@pytest.mark.parametrize("bad", [123, 1.5])
def test_a_folder_that_is_not_a_path_is_refused_with_the_fix(bad: object) -> None:
    with pytest.raises(TypeError, match=r"set_cache_dir: .*folder.*None"):
        tfl.set_cache_dir(bad)  # type: ignore[arg-type]


def test_a_cache_path_that_is_a_file_is_said_once_and_turns_the_cache_off(tmp_path: Path) -> None:
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file, not a folder")
    env = {k: v for k, v in os.environ.items() if k not in ("TAPEFLOW_CACHE_DIR", "TAPEFLOW_TEST_XLA_CACHE")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    for asked, where in ((blocker, "is a file"), (blocker / "sub", f"is below {blocker}, which is a file")):
        env["TAPEFLOW_CACHE_DIR"] = str(asked)
        proc = subprocess.run(
            [sys.executable, "-c", PROBE, "train"], env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        assert got["cache_dir"] is None and got["hits"] == got["misses"] == 0  # off: nothing read nor written
        said = [line for line in proc.stderr.splitlines() if "Warning" in line or "warn" in line.lower()]
        assert len(said) == 1, proc.stderr  # one warning, tapeflow's (JAX has nothing to warn about)
        assert f"TAPEFLOW_CACHE_DIR: {asked} {where}" in said[0] and "tfl.cache_dir() is None" in said[0]
    assert blocker.read_text() == "a file, not a folder"


def test_set_cache_dir_refuses_a_file_and_keeps_the_cache_as_it_was(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    before = tfl.cache_dir()
    with pytest.raises(NotADirectoryError, match=r"set_cache_dir: .*f is a file.*left as it was"):
        tfl.set_cache_dir(tmp_path / "f")
    assert tfl.cache_dir() == before
