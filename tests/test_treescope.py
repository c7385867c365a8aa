"""Treescope pictures (``__treescope_repr__``): what each one shows, and tapeflow without treescope."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import tapeflow as tfl
from tapeflow._core import _treescope
from tapeflow._shell import _render

treescope = pytest.importorskip("treescope")

ROOT = Path(__file__).resolve().parents[1]
F32 = jnp.float32


def _text(obj: object) -> str:
    return treescope.render_to_text(obj)


class _TiedAE(tfl.nn.Module):
    def __init__(self) -> None:
        self.enc = tfl.nn.Linear(4, 2, key=jax.random.key(0))
        self.dec = tfl.tie(self.enc.weight, name="dec")
        self.scale = tfl.Param(jnp.ones((), F32), name="scale", trainable=False)


def test_tape_shows_each_node_op_parents_shape_dtype_and_requires_grad() -> None:
    t, x = tfl.leaf(tfl.Tape.empty(), jnp.ones((2, 3), F32), requires_grad=True)
    t, c = tfl.leaf(t, jnp.arange(3, dtype=jnp.int32))
    t, y = tfl.record(t, "mul", (x, x))
    text = _text(t)
    assert text.startswith("Tape(\n  len=3,")
    assert "#0 leaf float32[2,3] requires_grad" in text
    assert re.search(r"#1 leaf int32\[3\]\n", text), "an integer leaf does not require grad"
    assert "#2 mul(0, 0) float32[2,3] requires_grad" in text


def test_long_tape_shows_first_and_last_nodes_like_its_html_table() -> None:
    t, x = tfl.leaf(tfl.Tape.empty(), jnp.ones(2, F32), requires_grad=True)
    last = x
    for _ in range(60):
        t, r = tfl.record(t, "exp", (last,))
        last = r.value
    text = _text(t)
    assert "len=61" in text and "... 21 more nodes ..." in text
    assert "#19 exp(18)" in text and "#41 exp(40)" in text and "#60 exp(59)" in text
    assert "#20 exp" not in text and "#40 exp" not in text
    lines = [ln for ln in text.splitlines() if re.match(r"\s+#\d+ ", ln)]
    assert len(lines) == 2 * _treescope.TAPE_LIMIT
    assert "Tape(len=0)" in _text(tfl.Tape.empty())


def test_param_and_storage_show_shape_dtype_and_storage_uid() -> None:
    w = tfl.Param(jnp.ones((4, 2), F32), name="w")
    text = _text(w)
    for fact in ("name='w'", "shape=(4, 2)", "dtype=float32", "trainable=True", f"storage=#{w.storage.uid}"):
        assert fact in text, fact
    st = _text(w.storage)
    assert f"uid={w.storage.uid}" in st and "shape=(4, 2)" in st and "host_current=True" in st


def test_tied_params_share_their_storage_uid_and_color() -> None:
    w = tfl.Param(jnp.ones((4, 2), F32), name="w")
    w2 = tfl.tie(w, name="w_dec")
    other = tfl.Param(jnp.ones((4, 2), F32), name="w")  # equal value and name: still another storage
    text = _text([w, w2, other])
    assert text.count(f"storage=#{w.storage.uid}") == 2 and f"storage=#{other.storage.uid}" in text
    html = treescope.render_to_html([w, w2, other], compressed=False)
    mine, theirs = (_render.storage_color(treescope, p.storage.uid) for p in (w, other))
    assert mine != theirs and html.count(mine) >= 2 and theirs in html


def test_module_lists_its_attributes_and_which_registrations_are_tied() -> None:
    m = _TiedAE()
    text = _text(m)
    assert text.startswith("_TiedAE(")
    assert "in_features=4" in text and "shape=(2, 4)" in text and "dtype=float32" in text
    uid = m.enc.weight.storage.uid
    assert f"# tied: storage #{uid} <- enc.weight, dec" in text
    assert "# 11 parameters in 3 storages, 4 registrations" in text
    assert "trainable=False" in text
    assert _render.module_ties(m) == [(uid, ["enc.weight", "dec"])]


def test_shared_submodule_counts_as_a_tie() -> None:
    lin = tfl.nn.Linear(2, 2, key=jax.random.key(1))
    seq = tfl.nn.Sequential(lin, lin)
    assert [paths for _, paths in _render.module_ties(seq)] == [
        ["0.weight", "1.weight"],
        ["0.bias", "1.bias"],
    ]
    assert "# tied: storage #" in _text(seq)


def test_session_shows_owner_generation_nodes_rng_counter_and_tied_leaves() -> None:
    m = _TiedAE()
    s = tfl.Session(seed=7)
    x = s.input(jnp.ones((3, 4), F32))
    s.normal((2,), F32)
    tfl.mse(tfl.tanh(x @ m.enc.weight.T) @ m.dec, x)
    text = _text(s)
    n = len(s.tape)
    for fact in (f"owner={s.owner}", "generation=0", f"nodes={n}", "rng_counter=1", "seed=7", "grad_enabled=True"):
        assert fact in text, fact
    leaves = [g.leaves for g in s.parameter_groups() if g.shared]
    assert len(leaves) == 1
    ids = ", ".join(f"#{i}" for i in leaves[0])
    assert f"# storage #{m.enc.weight.storage.uid} (weight): tied leaves {ids}, one summed gradient" in text
    assert f"len={n}" in text and f"#{n - 1} mse(" in text
    # the session names its Param leaves and the storage they read, and marks the tied uses
    a, b = leaves[0]
    assert f"#{a} leaf weight float32[2,4] requires_grad <- weight storage (tied)" in text
    assert f"#{b} leaf dec float32[2,4] requires_grad <- weight storage (tied)" in text
    assert "Rich HTML" not in text  # the nested tape is drawn directly, without treescope's box for its HTML
    s.reset()
    text = _text(s)
    assert "generation=1" in text and "nodes=0" in text and "rng_counter=1" in text


def test_tensor_handle_shows_its_node_and_is_marked_stale_after_reset() -> None:
    s = tfl.Session()
    x = s.input(jnp.ones((2, 3), F32), requires_grad=True)
    y = (x * 2.0).sum(axis=1)
    text = _text(y)
    for fact in ("shape=(2,)", "dtype=float32", f"id={y.id}", f"owner={s.owner}", "generation=0", "op=sum"):
        assert fact in text, fact
    assert "requires_grad=True" in text and "value=" in text and "stale" not in text
    s.reset()
    text = _text(y)
    assert "stale=True" in text and "the session is at generation 1" in text
    assert "op=" not in text and "value=" not in text  # nothing of the dropped recording is read


def test_pictures_render_to_html() -> None:
    s = tfl.Session()
    s.input(jnp.ones(2, F32))
    html = treescope.render_to_html(s, compressed=False)
    assert "generation" in html and "rng_counter" in html


def test_without_treescope_the_protocol_returns_not_implemented(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _TiedAE()
    s = tfl.Session()
    x = s.input(jnp.ones(2, F32))
    objs = [s.tape, s, x, m.enc.weight, m.enc.weight.storage, m]
    monkeypatch.setitem(sys.modules, "treescope", None)  # `import treescope` now raises ImportError

    def renderer(*args: object, **kwargs: object) -> object:
        raise AssertionError("nothing is rendered without treescope")

    for obj in objs:
        assert obj.__treescope_repr__("", renderer) is NotImplemented
        assert repr(obj)
    assert "<table>" in s.tape._repr_html_()


def test_tapeflow_imports_and_works_when_treescope_is_not_installed() -> None:
    code = textwrap.dedent(
        """
        import sys
        import tapeflow as tfl
        print("imported treescope:", "treescope" in sys.modules)  # only a picture imports it
        sys.modules["treescope"] = None  # as if not installed
        import jax.numpy as jnp
        w = tfl.Param(jnp.ones((2, 2)), name="w")
        with tfl.Session() as s:
            g = s.backward((s.input(jnp.ones((1, 2))) @ w).sum())
            print(repr(s), repr(s.tape), g[w].shape, s.tape.__treescope_repr__("", None) is NotImplemented)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "imported treescope: False" in proc.stdout
    assert "Session(owner=" in proc.stdout and "(2, 2) True" in proc.stdout
