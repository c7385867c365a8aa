"""Install tapeflow's declared dependency floors in a fresh venv and run the core test files there.

Every ``>=`` bound of ``[project] dependencies`` in pyproject.toml must be a version the
suite has passed on. This script reads those bounds, builds a virtual environment
with each runtime dependency pinned to its floor (``jax==0.7.0``, ``numpy==2.0.0``, ...),
installs tapeflow itself without dependencies, adds the test tools (pytest, pytest-xdist,
hypothesis: their newest releases, since they are not tapeflow's dependencies), and runs
:data:`CORE` (the files that need neither torch, flax nor the demo extra) on two workers.

    python tools/check_floors.py                    # venv in /tmp/tapeflow-floors
    python tools/check_floors.py --venv DIR --keep  # reuse DIR if it already holds the floors

It needs the network (PyPI) for the install (one to three minutes); the tests took five and
a half minutes on two busy cores (606 tests, two workers). That fits the CI budget of 90
minutes beside the suite, so .ci/run runs it after the suite. When it fails, raise the floor in
pyproject.toml (or stop the tests from using the newer feature); never lower a floor without
a passing run.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CORE = [
    "tests/test_tape.py",
    "tests/test_properties.py",
    "tests/test_session.py",
    "tests/test_lazy.py",
    "tests/test_grads.py",
    "tests/test_optim.py",
    "tests/test_checkpoint.py",
    "tests/test_functional.py",
    "tests/test_resume.py",
    "tests/test_batchnorm.py",
]
"""The core test files: the tape, sessions (eager and lazy), gradients, optimizers, checkpoints, train_step."""

WORKERS = ["-n", "2", "--dist", "loadfile"]
"""Two workers, one file each at a time (as the suite runs): CI has two cores."""

TEST_TOOLS = ["pytest>=8", "pytest-xdist>=3", "hypothesis>=6.100"]


def floors(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """``name==floor`` for each runtime dependency of ``pyproject`` (every one must state a ``>=`` floor).

    >>> all("==" in f for f in floors())
    True
    """
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    out = []
    for d in deps:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-\[\]]+)\s*>=\s*([0-9][^,;\s]*)\s*", d)
        if m is None:
            raise SystemExit(f"check_floors: dependency {d!r} states no plain '>=' floor; give it one")
        out.append(f"{m.group(1)}=={m.group(2)}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", default="/tmp/tapeflow-floors", help="where to build the virtual environment")
    ap.add_argument("--keep", action="store_true", help="reuse the venv if it exists (skip the install)")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (e.g. -x, -k name)")
    args = ap.parse_args(argv)
    env_dir = Path(args.venv)
    py = env_dir / "bin" / "python"
    pins = floors()
    if not (args.keep and py.exists()):
        venv.create(env_dir, with_pip=True, clear=True)
        subprocess.run([py, "-m", "pip", "install", "-q", *pins, *TEST_TOOLS], check=True)
        subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)], check=True)
    got = subprocess.run([py, "-m", "pip", "freeze"], check=True, capture_output=True, text=True).stdout.lower()
    wrong = [p for p in pins if p.lower().replace("_", "-") not in got.replace("_", "-")]
    if wrong:
        raise SystemExit(f"check_floors: the venv does not hold these floors: {wrong} (installed: {got})")
    print("floors:", " ".join(pins), flush=True)
    cmd = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *WORKERS, *CORE, *args.pytest_args]
    return subprocess.run(cmd, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
