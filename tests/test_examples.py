"""The examples run: the digits demo (+ checkpoint restore), the char-level LM, the scripts, the notebook."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapeflow as tfl

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _load(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` from its path (examples is not a package)."""
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"tapeflow_example_{name}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses / pickling look modules up by name
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------- demo


def test_demo_trains_saves_and_restores(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    pytest.importorskip("tqdm")
    demo = _load("demo")
    ckpt = tmp_path / "ckpt"
    # Run the demo as a user would: JAX's default config (conftest turns x64 on for the suite).
    with jax.enable_x64(False):
        _demo_round_trip(demo, ckpt)


def _demo_round_trip(demo: ModuleType, ckpt: Path) -> None:
    out = demo.main(["--quiet", "--checkpoint", str(ckpt)])
    assert out["accuracy"] >= 0.95
    assert ckpt.is_dir()

    model, _ = demo.make(0, 3e-3)  # the defaults of demo.main: seed 0, lr 3e-3
    init = [np.asarray(p.value) for p in model.records()]
    tfl.restore(ckpt, model.records())
    restored = [np.asarray(p.value) for p in model.records()]
    # the trained values came back: not the fresh initialization, and the tie is kept
    assert any(not np.array_equal(a, b) for a, b in zip(init, restored))
    assert model.W_dec.storage is model.W.storage
    np.testing.assert_array_equal(np.asarray(model.W_dec.value), np.asarray(model.W.value))
    # ... and they are the values the demo evaluated: the same test accuracy
    x_tr, x_te, y_tr, y_te = demo.load_data(0)
    assert demo.accuracy(model, x_te, y_te, None) == out["accuracy"]

    # a second fresh model (with its optimizer, and a session) restores to exactly the same arrays
    model2, opt2 = demo.make(0, 3e-3)
    session = tfl.Session(seed=123)
    tfl.restore(ckpt, model2.records(), optimizer=opt2, session=session)
    for a, p in zip(restored, model2.records()):
        np.testing.assert_array_equal(a, np.asarray(p.value))
    assert session.seed == 0  # the demo's session seed


# --------------------------------------------------------------------------- char LM


def test_char_lm_loss_decreases_and_output_is_tied() -> None:
    char_lm = _load("char_lm")
    out = char_lm.main(["--steps", "150", "--chars", "40", "--seed", "0"])
    assert np.isfinite(out["initial_loss"]) and np.isfinite(out["final_loss"])
    # from ~ln(vocab) to clearly below the unigram entropy of the text
    assert out["initial_loss"] > 4.0
    assert out["final_loss"] < out["initial_loss"] - 1.5, (out["initial_loss"], out["final_loss"])
    # the tied output projection is one extra record but no extra optimizer slot
    assert out["tied"] and out["records"] == out["slots"] + 1
    assert isinstance(out["sample"], str) and len(out["sample"]) >= 40


# --------------------------------------------------------------------------- scripts


@pytest.mark.parametrize("script", ["train_loop.py", "pure_core_jit.py"])
def test_script_runs(script: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{script} exited with {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


# --------------------------------------------------------------------------- rich display


def test_tape_repr_html_lists_nodes_and_truncates() -> None:
    t, x = tfl.leaf(tfl.Tape.empty(), jnp.ones(2, jnp.float32), requires_grad=True)
    t, y = tfl.record(t, "mul", (x, x))
    html = t._repr_html_()
    assert html.startswith("<table>") and html.rstrip().endswith("</table>")
    assert "<td>mul</td><td>0, 0</td>" in html and "float32[2]" in html
    assert html.count("<tr>") == 1 + 2  # header + two nodes

    last = y.value
    for _ in range(60):
        t, r = tfl.record(t, "exp", (last,))
        last = r.value
    html = t._repr_html_()
    assert html.count("<tr>") == 1 + 20 + 1 + 20  # header, first 20, "... 22 more ...", last 20
    assert "22 more" in html and f"<td>{len(t) - 1}</td>" in html and "<td>25</td>" not in html
    assert "Tape: 0 nodes" in tfl.Tape.empty()._repr_html_()


# --------------------------------------------------------------------------- notebook


def _python3_kernel(tmp_dir: Path) -> tuple[str, dict[str, str]]:
    """The kernel name to run with, and environment changes that make it findable.

    Uses the ``python3`` kernel spec when it runs this interpreter (ipykernel's
    own spec says plain ``python``, which jupyter_client maps to
    ``sys.executable``); otherwise installs one for this interpreter in a
    temporary prefix and points ``JUPYTER_PATH`` at it.
    """
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        argv0 = KernelSpecManager().get_kernel_spec("python3").argv[0]
        ours = argv0 in {"python", f"python{sys.version_info[0]}", "python{}.{}".format(*sys.version_info[:2])} or (
            os.path.exists(argv0) and os.path.samefile(argv0, sys.executable)
        )
    except NoSuchKernel:
        ours = False
    if ours:
        return "python3", {}
    prefix = tmp_dir / "jupyter"
    subprocess.run(
        [sys.executable, "-m", "ipykernel", "install", "--prefix", str(prefix), "--name", "python3"],
        check=True,
        capture_output=True,
    )
    old = os.environ.get("JUPYTER_PATH")
    path = str(prefix / "share" / "jupyter") + (os.pathsep + old if old else "")
    return "python3", {"JUPYTER_PATH": path}


def _outputs(nb: Any) -> tuple[str, list[str], list[str]]:
    text, html, errors = [], [], []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for o in cell.get("outputs", []):
            if o.output_type == "stream":
                text.append(o.text)
            elif o.output_type in ("execute_result", "display_data"):
                text.append(o.data.get("text/plain", ""))
                if "text/html" in o.data:
                    html.append(o.data["text/html"])
            elif o.output_type == "error":
                errors.append(f"{o.ename}: {o.evalue}")
    return "".join(text), html, errors


def test_quickstart_notebook_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    path = EXAMPLES / "quickstart.ipynb"
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    stored = [c for c in nb.cells if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count"))]
    assert not stored, "the notebook is stored without outputs"

    kernel, env = _python3_kernel(tmp_path)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    client = nbclient.NotebookClient(
        nb, timeout=180, kernel_name=kernel, allow_errors=True, resources={"metadata": {"path": str(EXAMPLES)}}
    )
    client.execute()
    text, html, errors = _outputs(nb)
    assert not errors, errors
    assert "stale tensor handle from generation 0; current generation is 1" in text
    assert "quickstart finished" in text and "digraph tape {" in text
    assert any(h.startswith("<table>") and "<td>mse</td>" in h for h in html), "the tape's rich display"
