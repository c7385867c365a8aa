"""The examples run: the digits demo (+ checkpoint restore), the char-level LM, the scripts (nanoGPT from a
PyTorch state dict and the PyTorch port among them), WGAN-GP and MAML (against pure-JAX oracles), the notebook.

Every example states its run time in its docstring (the notebook: in its first cell), as a line
``Run time: about N s ...``; each run below fails when it takes more than twice that.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
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


RUN_TIME = re.compile(r"^Run time: about (\d+(?:\.\d+)?) (s|min)\b", re.M)
ALL_EXAMPLES = sorted(p.name for p in EXAMPLES.iterdir() if p.suffix in (".py", ".ipynb"))


def _intro(name: str) -> str:
    """An example's docstring; the notebook's first (markdown) cell."""
    path = EXAMPLES / name
    if path.suffix == ".ipynb":
        return "".join(json.loads(path.read_text(encoding="utf-8"))["cells"][0]["source"])
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""


def stated_seconds(name: str) -> float:
    """The run time ``examples/<name>`` states (``Run time: about 20 s`` or ``about 2 min``), in seconds."""
    m = RUN_TIME.search(_intro(name))
    assert m, f"examples/{name} states no run time: add a line 'Run time: about N s on one CPU core.'"
    return float(m.group(1)) * (60.0 if m.group(2) == "min" else 1.0)


@contextlib.contextmanager
def within_stated_time(name: str) -> Iterator[None]:
    """Fail when the block (a run of ``examples/<name>``) takes more than twice the example's stated run time.

    The scripts and the notebook run whole, as a user runs them; the demo and the char LM run their default
    training; WGAN-GP and MAML run shortened here, so for them the bound is loose (a slowdown of several
    times still shows: .ci/run times their whole runs, docs/_ext/gallery.py --check)."""
    limit = 2.0 * stated_seconds(name)
    t0 = time.perf_counter()
    yield
    took = time.perf_counter() - t0
    assert took <= limit, (
        f"examples/{name} took {took:.1f} s here, more than twice the {limit / 2:g} s its docstring states: "
        "make it faster or state an honest run time"
    )


@pytest.mark.parametrize("name", ALL_EXAMPLES)
def test_every_example_states_its_run_time_and_command(name: str) -> None:
    intro = _intro(name)
    assert 0 < stated_seconds(name) <= 120, "an example of the suite runs in at most two minutes"
    if name.endswith(".py"):
        assert f"python examples/{name}" in intro, f"examples/{name}: its docstring shows the command that runs it"


# --------------------------------------------------------------------------- demo


def test_demo_trains_saves_and_restores(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("sklearn")
    pytest.importorskip("tqdm")
    demo = _load("demo")
    ckpt = tmp_path / "ckpt"
    # Run the demo as a user would: JAX's default config (conftest turns x64 on for the suite).
    with jax.enable_x64(False):
        _demo_round_trip(demo, ckpt)
    _check_gallery_card("demo.py", capsys.readouterr().out)  # its data, its accuracy


def test_demo_trains_lazily_in_bfloat16_to_the_same_bar(tmp_path: Path) -> None:
    """Mixed precision (float32 master weights, bfloat16 compute) in a lazy session still reaches 0.95
    test accuracy; the demo times the eager loop, the lazy loop and train_step on the same model."""
    pytest.importorskip("sklearn")
    pytest.importorskip("tqdm")
    demo = _load("demo")
    with jax.enable_x64(False), within_stated_time("demo.py"):
        out = demo.main(["--quiet", "--lazy", "--compute-dtype", "bfloat16", "--checkpoint", str(tmp_path / "ckpt")])
    assert out["accuracy"] >= 0.95
    assert out["eager_step_s"] > 0 and out["lazy_step_s"] > 0 and out["train_step_s"] > 0


def _demo_round_trip(demo: ModuleType, ckpt: Path) -> None:
    curves = ckpt.parent / "curves.png"
    with within_stated_time("demo.py"):  # the demo's default run (quiet), and its plot
        out = demo.main(["--quiet", "--checkpoint", str(ckpt), "--plot", str(curves)])
    assert out["accuracy"] >= 0.95
    assert ckpt.is_dir()
    _assert_png(curves)

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


def _assert_png(path: Path) -> None:
    """``path`` is a PNG of a real picture: signature, a header chunk with sane dimensions, some bytes."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert 300 <= width <= 4000 and 200 <= height <= 4000, (width, height)
    assert len(data) > 10_000, f"{path} is suspiciously small ({len(data)} bytes)"
    assert data.rstrip(b"\x00")[-8:-4] == b"IEND"  # written to the end


def test_demo_plot_history_writes_a_png(tmp_path: Path) -> None:
    """The demo's plotting path on a short synthetic history (fast; the full run is in the round trip)."""
    pytest.importorskip("matplotlib")
    demo = _load("demo")
    rs = np.random.default_rng(0)
    history = {
        "step_loss": list(2.5 * np.exp(-np.linspace(0, 3, 60)) + 0.05 * rs.random(60)),
        "epoch_loss": [2.0, 1.2, 0.8],
        "epoch_accuracy": [0.7, 0.85, 0.9],
    }
    path = demo.plot_history(history, tmp_path)  # a directory: the default file name in it
    assert path == tmp_path / "training_curves.png"
    _assert_png(path)
    _assert_png(demo.plot_history(history, tmp_path / "sub" / "curves.png"))


def test_demo_plot_without_matplotlib_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    demo = _load("demo")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit, match=r"pip install -e '\.\[demo\]'"):
        demo.main(["--quiet", "--plot", "never-written.png"])  # before any training
    assert not Path("never-written.png").exists()


# --------------------------------------------------------------------------- char LM


def test_char_lm_loss_decreases_and_output_is_tied(capsys: pytest.CaptureFixture[str]) -> None:
    char_lm = _load("char_lm")
    # its default run, as a user runs it (JAX's default config): the gallery shows what it prints
    with jax.enable_x64(False), within_stated_time("char_lm.py"):
        out = char_lm.main([])
    _check_gallery_card("char_lm.py", capsys.readouterr().out)  # its corpus, its losses
    assert np.isfinite(out["initial_loss"]) and np.isfinite(out["final_loss"])
    # from ~ln(vocab) to clearly below the unigram entropy of the text
    assert out["initial_loss"] > 4.0
    assert out["final_loss"] < out["initial_loss"] - 1.5, (out["initial_loss"], out["final_loss"])
    # the tied output projection is one extra record but no extra optimizer slot
    assert out["tied"] and out["records"] == out["slots"] + 1
    assert isinstance(out["sample"], str) and len(out["sample"]) >= 40


# --------------------------------------------------------------------------- scripts


@pytest.mark.parametrize("script", ["train_loop.py", "pure_core_jit.py", "nanogpt.py", "port_pytorch.py"])
def test_script_runs(script: str) -> None:
    """Each script whole, in a fresh interpreter, as ``python examples/<script>`` (its stated time included)."""
    with within_stated_time(script):
        proc = subprocess.run(
            [sys.executable, str(EXAMPLES / script)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert proc.returncode == 0, f"{script} exited with {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    _check_gallery_card(script, proc.stdout)
    if script == "nanogpt.py":
        _check_nanogpt_output(proc.stdout)
    if script == "port_pytorch.py":
        _check_port_output(proc.stdout)


def _check_gallery_card(name: str, printed: str) -> None:
    """docs/gallery.md's card of ``examples/<name>`` shows lines this run printed (times in them aside).

    These examples run whole here, as a user runs them, so their cards are checked on every suite run;
    ``.ci/run`` checks the others (``docs/_ext/gallery.py --check``; tests/test_gallery.py sees that
    every card is one or the other's).
    """
    from test_gallery import gallery

    g = gallery()
    differs = g.card_differs(g.PAGE.read_text(), name, printed)
    assert differs is None, f"{differs}\nrun python docs/_ext/gallery.py to show what the examples print now"


def _check_port_output(out: str) -> None:
    """The PyTorch model's state dict loaded, the logits agree, and each training loss equals PyTorch's."""
    if importlib.util.find_spec("torch") is None:
        assert "needs PyTorch" in out and "pip install torch" in out, out
        return
    diff = re.search(r"max \|logit difference\| = (\S+)", out)
    assert diff and float(diff.group(1)) < 1e-4, out
    steps = re.findall(r"^step \d+  loss tapeflow (\S+)  PyTorch (\S+)$", out, re.M)
    assert len(steps) == 3, out
    ours, theirs = (np.array([float(s[i]) for s in steps]) for i in (0, 1))
    np.testing.assert_allclose(ours, theirs, rtol=1e-4)
    assert ours[-1] < ours[0], out


def test_port_pytorch_without_torch_says_so_and_returns(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    port = _load("port_pytorch")
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    assert port.main([]) == {"torch": False}
    assert "pip install torch" in capsys.readouterr().out


def _check_nanogpt_output(out: str) -> None:
    """The torch state dict loaded (the tie kept), the logits agree with torch's, the loss went down."""
    if importlib.util.find_spec("torch") is None:
        assert "needs PyTorch" in out and "pip install torch" in out, out
        return
    assert "lm_head shares wte's storage: True" in out, out
    diff = re.search(r"max \|tapeflow - torch\| = (\S+)", out)
    assert diff and float(diff.group(1)) < 1e-4, out
    losses = re.search(r"^loss (\S+) -> (\S+) in", out, re.M)
    assert losses and float(losses.group(2)) < float(losses.group(1)) - 0.5, out
    norms = [float(v) for v in re.findall(r"grad norm (\S+)", out)]
    assert len(norms) >= 3 and all(np.isfinite(norms)) and all(v > 0 for v in norms), out


def test_nanogpt_without_torch_says_so_and_returns(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    nanogpt = _load("nanogpt")
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    assert nanogpt.main([]) == {"torch": False}
    assert "pip install torch" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["gradient_penalty", "maml"])
def test_script_command_line_runs(name: str) -> None:
    """The command line of the two higher-order examples, short, in this process (their kernels are shared
    with the tests below; a fresh interpreter per script costs seconds of start-up and compilation)."""
    with within_stated_time(f"{name}.py"):
        out = _load(name).main(["--steps", "2", "--log-every", "1"])
    logged = np.asarray(jax.tree_util.tree_leaves(out["history"]), dtype=float)  # steps and losses, as logged
    assert logged.size and np.isfinite(logged).all()


# --------------------------------------------------------------------------- higher order: WGAN-GP and MAML


def test_gradient_penalty_trains_the_critic_toward_unit_gradient_norm() -> None:
    gp = _load("gradient_penalty")
    hist = gp.train(steps=12, log_every=6, quiet=True)["history"]
    assert [h["step"] for h in hist] == [0, 6, 12]
    assert all(np.isfinite([h["wasserstein"], h["grad_norm"], h["penalty"], h["dist"]]).all() for h in hist)
    first, last = hist[0], hist[-1]
    assert first["grad_norm"] < 0.5 and abs(last["grad_norm"] - 1.0) < 0.2, (first, last)
    assert last["penalty"] < first["penalty"] / 4
    assert last["dist"] < first["dist"]  # the generator's samples moved toward the modes


def _mlp_pure(ws: list[Any], x: Any) -> Any:
    """tfl.nn.MLP with ReLU, as a pure function of [W1, b1, W2, b2, ...] (PyTorch's (out, in) weights)."""
    n = len(ws) // 2
    for i in range(n):
        x = x @ ws[2 * i].T + ws[2 * i + 1]
        if i < n - 1:
            x = jax.nn.relu(x)
    return x


@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-9), (np.float32, 1e-5)])
def test_gradient_penalty_critic_gradient_equals_pure_jax(dtype: Any, tol: float) -> None:
    """The example's critic loss (penalty via create_graph=True) vs jax.grad of a loss that calls jax.grad."""
    gp = _load("gradient_penalty")
    rng = np.random.default_rng(3)
    m = gp.make(1, dtype=dtype)  # the example's shapes (its kernels are compiled once per test session)
    critic, gen = m["critic"], m["gen"]
    n = 256
    real = gp.sample_real(rng, n).astype(dtype)
    fake = (0.5 * rng.normal(size=(n, 2))).astype(dtype)
    eps = rng.uniform(size=(n, 1)).astype(dtype)
    z = rng.normal(size=(n, 2)).astype(dtype)

    def pure_critic_loss(ws: list[Any]) -> Any:
        x_hat = eps * real + (1 - eps) * fake
        gx = jax.grad(lambda x: jnp.sum(_mlp_pure(ws, x)))(x_hat)
        norms = jnp.sqrt(jnp.sum(gx * gx, axis=1) + 1e-12)
        w = jnp.mean(_mlp_pure(ws, real)) - jnp.mean(_mlp_pure(ws, fake))
        return -w + 10.0 * jnp.mean((norms - 1.0) ** 2)

    def first_order_loss(ws: list[Any]) -> Any:  # the penalty's gradient treated as a constant
        x_hat = eps * real + (1 - eps) * fake
        gx = jax.lax.stop_gradient(jax.grad(lambda x: jnp.sum(_mlp_pure(ws, x)))(x_hat))
        norms = jnp.sqrt(jnp.sum(gx * gx, axis=1) + 1e-12)
        w = jnp.mean(_mlp_pure(ws, real)) - jnp.mean(_mlp_pure(ws, fake))
        return -w + 10.0 * jnp.mean((norms - 1.0) ** 2)

    ps = critic.parameters()
    vals = [jnp.asarray(p.value) for p in ps]
    with tfl.Session() as s:
        loss, _, _ = gp.critic_loss(s, critic, real, fake, eps, 10.0)
        g = s.backward(loss)
        got = [np.asarray(g[p]) for p in ps]
        got_loss = float(loss)
    want_loss, want = jax.value_and_grad(pure_critic_loss)(vals)
    np.testing.assert_allclose(got_loss, float(want_loss), rtol=tol, atol=tol)
    scale = max(float(jnp.max(jnp.abs(w))) for w in want)
    for a, b in zip(got, want):
        assert a.dtype == dtype
        np.testing.assert_allclose(a, np.asarray(b), rtol=tol, atol=tol * scale)
    # the second-order term matters: without it the gradient is clearly different
    fo = jax.grad(first_order_loss)(vals)
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(fo, want)) > 1e-2 * scale

    # and the generator's gradient through the critic
    gvals = [jnp.asarray(p.value) for p in gen.parameters()]
    with tfl.Session() as s:
        gg = s.backward(gp.generator_loss(s, gen, critic, z))
        got_g = [np.asarray(gg[p]) for p in gen.parameters()]
    want_g = jax.grad(lambda ws: -jnp.mean(_mlp_pure(vals, _mlp_pure(ws, z))))(gvals)
    for a, b in zip(got_g, want_g):
        np.testing.assert_allclose(a, np.asarray(b), rtol=tol, atol=tol * max(1.0, float(jnp.max(jnp.abs(b)))))


def test_maml_meta_loss_decreases_and_adaptation_helps() -> None:
    maml = _load("maml")
    out = maml.train(steps=40, log_every=20, eval_tasks=5, quiet=True)
    (s1, l1), (s2, l2) = out["history"]
    assert (s1, s2) == (20, 40) and np.isfinite([l1, l2]).all()
    assert l2 < l1, out["history"]
    ev = out["eval"]
    assert ev[1] < ev[0], ev  # one inner step on 10 support points lowers the query loss


def _maml_pure(ws: list[Any], tasks: list[Any], alpha: float, steps: int, first_order: bool = False) -> Any:
    def mse(w: list[Any], x: Any, y: Any) -> Any:
        return jnp.mean((_mlp_pure(w, x) - y) ** 2)

    total = 0.0
    for t in tasks:
        fast = list(ws)
        for _ in range(steps):
            g = jax.grad(mse)(fast, t.xs, t.ys)
            if first_order:
                g = jax.lax.stop_gradient(g)
            fast = [w - alpha * gw for w, gw in zip(fast, g)]
        total = total + mse(fast, t.xq, t.yq)
    return total / len(tasks)


@pytest.mark.parametrize(
    "dtype, inner_steps, tol", [(np.float64, 1, 1e-9), (np.float64, 2, 1e-9), (np.float32, 1, 1e-5)]
)
def test_maml_meta_gradient_equals_pure_jax(dtype: Any, inner_steps: int, tol: float) -> None:
    """The example's second-order meta-gradient vs jax.grad of the same MAML objective (same weights and tasks)."""
    maml = _load("maml")
    model = maml.make(2, dtype=dtype)  # the example's shapes (its kernels are compiled once per test session)
    tasks = maml.sample_tasks(np.random.default_rng(4), 3, dtype=dtype)
    ps = model.parameters()
    vals = [jnp.asarray(p.value) for p in ps]
    alpha = 0.05
    with tfl.Session() as s:
        loss = maml.meta_loss(s, ps, tasks, alpha, inner_steps)
        g = s.backward(loss)
        got = [np.asarray(g[p]) for p in ps]
        got_loss = float(loss)
    want_loss, want = jax.value_and_grad(_maml_pure)(vals, tasks, alpha, inner_steps)
    np.testing.assert_allclose(got_loss, float(want_loss), rtol=tol, atol=tol)
    scale = max(float(jnp.max(jnp.abs(w))) for w in want)
    for a, b in zip(got, want):
        assert a.dtype == dtype
        np.testing.assert_allclose(a, np.asarray(b), rtol=tol, atol=tol * scale)
    # the oracle can tell second from first order: first-order MAML gives a clearly different gradient
    fo = jax.grad(_maml_pure)(vals, tasks, alpha, inner_steps, True)
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(fo, want)) > 1e-3 * scale


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
    with within_stated_time("quickstart.ipynb"):  # the kernel's start included
        client.execute()
    text, html, errors = _outputs(nb)
    assert not errors, errors
    assert "stale tensor handle from generation 0; current generation is 1" in text
    assert "quickstart finished" in text and "digraph tape {" in text
    assert any(h.startswith("<table>") and "<td>mse</td>" in h for h in html), "the tape's rich display"
    if importlib.util.find_spec("matplotlib") and importlib.util.find_spec("sklearn"):
        # the demo's training curves, shown inline as a PNG
        pngs = [
            o.data["image/png"]
            for c in nb.cells
            if c.cell_type == "code"
            for o in c.get("outputs", [])
            if o.output_type == "display_data" and "image/png" in o.data
        ]
        assert pngs, "the demo's training curves are displayed"
        assert "test accuracy" in text
