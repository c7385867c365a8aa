"""tfl.nn summary: counts by storage identity, output shapes per call, the pinned text table, HTML, no side effects."""

from __future__ import annotations

from html.parser import HTMLParser

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapeflow as tfl
from tapeflow import nn
from tapeflow._shell import _debug
from tapeflow.nn import _module
from tapeflow.nn._module import observe_calls
from tapeflow.nn._summary import Summary, SummaryRow, summary

F32 = jnp.float32  # the layers' default dtype (the suite runs with x64 on)


def keys(n: int, seed: int = 0):
    return list(jax.random.split(jax.random.key(seed), n))


def by_path(s: Summary) -> dict[str, SummaryRow]:
    return {r.path: r for r in s.rows}


def tied_lm():
    k1, k2 = keys(2)
    emb = nn.Embedding(16, 8, key=k1)
    return nn.Sequential(emb, nn.LayerNorm(8), nn.Linear(8, 8, key=k2), emb.tied_output())


class Pair(nn.Module):
    def forward(self, h):
        return h, {"sum": tfl.sum(h, axis=-1)}


class Twice(nn.Module):
    """Calls ``lin`` twice on one shape and ``proj`` on two shapes; ``unused`` is never called."""

    def __init__(self):
        k1, k2, k3 = keys(3, seed=1)
        self.lin = nn.Linear(4, 4, key=k1)
        self.proj = nn.Linear(4, 2, key=k2)
        self.unused = nn.Linear(4, 1, key=k3)
        self.pair = Pair()

    def forward(self, x):
        h = self.lin(self.lin(x))
        self.proj(h[None])
        out, _ = self.pair(self.proj(h))
        return out


class Mixed(nn.Module):
    """A Linear, a frozen Param, a BatchNorm (trainable weight/bias + three state cells), a frozen tie."""

    def __init__(self):
        self.lin = nn.Linear(3, 4, key=keys(1)[0])
        self.scale = tfl.Param(jnp.ones(5, F32), name="scale", trainable=False)
        self.bn = nn.BatchNorm1d(4)
        self.frozen_view = tfl.tie(self.lin.weight, trainable=False)

    def forward(self, x):
        return self.bn(self.lin(x))


# --------------------------------------------------------------------------- counts and ties


def test_tied_lm_counts_against_a_hand_count():
    lm = tied_lm()
    s = summary(lm, jnp.array([[1, 2, 3]]))
    rows = by_path(s)
    # hand count: embedding 16*8, layer norm 8+8, linear 8*8+8, tied head 0 (it shares the embedding's storage)
    assert [r.path for r in s.rows] == ["", "0", "1", "2", "3"] == [p for p, _ in lm.named_modules()]
    assert [r.params for r in s.rows] == [0, 128, 16, 72, 0]
    assert [r.bytes for r in s.rows] == [0, 512, 64, 288, 0]  # float32
    assert rows["3"].type == "TiedLinear" and rows["3"].tied_to == ("0.weight",)
    assert all(r.tied_to == () for r in s.rows if r.path != "3")
    assert s.total_params == 128 + 16 + 72 == lm.num_parameters() == sum(r.params for r in s.rows)
    assert s.total_bytes == 4 * s.total_params == sum(r.bytes for r in s.rows)
    assert (s.trainable_params, s.non_trainable_params, s.tied) == (216, 0, 1)
    assert "tied to 0.weight" in str(s).splitlines()[6]


def test_a_shared_module_is_one_module_with_a_row_at_its_later_path():
    k1, k2 = keys(2)
    lin, head = nn.Linear(3, 3, key=k1), nn.Linear(3, 2, key=k2)
    model = nn.Sequential(lin, tfl.relu, lin, head)
    s = summary(model, jnp.ones((2, 3), F32))
    rows = by_path(s)
    assert [r.path for r in s.rows] == ["", "0", "2", "3"]
    assert [p for p, _ in model.named_modules()] == ["", "0", "3"]
    assert rows["0"].output == "(2, 3) x2" and rows["0"].params == 12
    assert (rows["2"].params, rows["2"].tied_to, rows["2"].output, rows["2"].trainable) == (0, ("0",), "-", "-")
    assert s.total_params == 12 + 8 == model.num_parameters()
    assert s.tied == 2  # the second path's weight and bias


def test_trainable_frozen_and_state_cells_in_the_totals():
    m = Mixed()
    s = summary(m, jnp.ones((2, 3), F32))
    rows = by_path(s)
    assert rows[""].params == 5 and rows[""].trainable == "none"  # scale (frozen) + the frozen tie
    assert rows[""].tied_to == ("lin.weight",)
    assert (rows["lin"].params, rows["lin"].trainable) == (16, "all")
    assert (rows["bn"].params, rows["bn"].trainable) == (4 + 4 + 4 + 4 + 1, "partial")
    assert rows["bn"].bytes == 16 * 4 + 4  # float32 statistics, int32 counter
    # trainable: what an Optimizer gives a slot (the tie's first record, lin.weight, is trainable)
    trainable = sum(int(np.prod(p.shape)) for _, p in m.named_parameters() if p.trainable)
    assert s.trainable_params == 16 + 8 == trainable
    assert s.non_trainable_params == 5 + 4 + 4 + 1
    buffers = sum(int(np.prod(b.shape)) for b in m.buffers())  # running statistics: buffers, not parameters
    assert s.total_params == s.trainable_params + s.non_trainable_params == m.num_parameters() + buffers
    assert s.tied == 1
    assert "Non-trainable params: 14" in str(s)


def test_a_frozen_model_has_no_trainable_params():
    m = nn.Linear(3, 2, key=keys(1)[0])
    m.weight.trainable = m.bias.trainable = False
    s = summary(m, jnp.ones((1, 3), F32))
    assert (s.trainable_params, s.non_trainable_params, s.rows[0].trainable) == (0, 8, "none")


# --------------------------------------------------------------------------- output shapes


def test_output_shapes_per_module_and_call():
    m = Twice()
    s = summary(m, jnp.ones((2, 4), F32))
    rows = by_path(s)
    assert rows["lin"].output_shapes == ("(2, 4)", "(2, 4)") and rows["lin"].output == "(2, 4) x2"
    assert rows["proj"].output_shapes == ("(1, 2, 2)", "(2, 2)") and rows["proj"].output == "(1, 2, 2); (2, 2)"
    assert rows["unused"].output_shapes == () and rows["unused"].output == "-"
    assert rows["pair"].output == "[(2, 2), {'sum': (2,)}]"  # a tuple and a dict of Tensors: each shape
    assert rows[""].output == "(2, 2)"
    assert rows["unused"].params == 5  # counted though never called


# --------------------------------------------------------------------------- the text and the HTML


MLP_TABLE = """\
Module    Type    Output shape  Params  Bytes  Trainable  Tied
--------------------------------------------------------------
<root>    MLP     (5, 2)             0      0  -
layers.0  Linear  (5, 4)            16     64  all
layers.1  Linear  (5, 2)            10     40  all
--------------------------------------------------------------
Total params: 26
Trainable params: 26
Non-trainable params: 0
Total bytes: 104 (104 B)
Tied registrations: 0"""


def test_the_text_table_of_a_tiny_mlp():
    s = summary(nn.MLP([3, 4, 2], key=keys(1)[0]), jnp.ones((5, 3), F32))
    assert str(s) == MLP_TABLE
    assert repr(s) == MLP_TABLE


class _Cells(HTMLParser):
    def __init__(self):
        super().__init__()
        self.sections: dict[str, list[list[str]]] = {}
        self.where = ""
        self.cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag in ("thead", "tbody", "tfoot"):
            self.where = tag
        elif tag == "tr":
            self.sections.setdefault(self.where, []).append([])
        elif tag in ("td", "th"):
            self.cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self.cell is not None:
            self.sections[self.where][-1].append("".join(self.cell))
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell.append(data)


def test_html_has_a_table_with_the_same_rows():
    s = summary(tied_lm(), jnp.array([[1, 2]]))
    page = s._repr_html_()
    assert page.startswith("<table>") and page.endswith("</table>")
    cells = _Cells()
    cells.feed(page)
    assert cells.sections["thead"] == [["Module", "Type", "Output shape", "Params", "Bytes", "Trainable", "Tied"]]
    assert cells.sections["tbody"] == [list(r.cells()) for r in s.rows]
    assert cells.sections["tbody"][-1][-1] == "tied to 0.weight"
    assert [row[0] for row in cells.sections["tfoot"]] == s.totals()


# --------------------------------------------------------------------------- no side effects


@pytest.mark.usefixtures("lazy_mode")
def test_a_user_session_records_nothing_and_keeps_its_state():
    lm = tied_lm()
    with tfl.Session() as s:
        ids = s.input(jnp.array([[1, 2, 3]]))
        h = s.input(jnp.ones((2, 8), F32), requires_grad=True)
        before = (len(s.tape), s.generation, s.grad_enabled)
        out = summary(lm, ids)
        assert by_path(out)[""].output == "(1, 3, 16)"
        assert (len(s.tape), s.generation, s.grad_enabled) == before
        assert tfl.current_session() is s and tfl.last_recorded_session() is s
        g = s.backward(tfl.sum(h * h))  # grad recording still works as before
        assert np.allclose(g[h], 2.0)


def test_the_session_that_recorded_last_stays_so():
    s = tfl.Session()
    s.input(jnp.ones(2))
    summary(nn.MLP([3, 2], key=keys(1)[0]), jnp.ones((1, 3), F32))
    assert tfl.current_session() is None and tfl.last_recorded_session() is s


def test_modes_and_state_cells_are_left_alone():
    m = Mixed()
    old = [np.asarray(p.value) for p in (m.bn.running_mean, m.bn.running_var, m.bn.num_batches_tracked)]
    summary(m, jnp.arange(6.0, dtype=F32).reshape(2, 3))
    s = summary(m.bn, jnp.arange(8.0, dtype=F32).reshape(2, 4), training=True)  # forced: writes the cells
    assert s.rows[0].output == "(2, 4)"
    new = [np.asarray(p.value) for p in (m.bn.running_mean, m.bn.running_var, m.bn.num_batches_tracked)]
    assert all(np.array_equal(a, b) for a, b in zip(old, new))
    assert all(mod.training for mod in m.modules())
    m.eval()
    summary(m, jnp.ones((2, 3), F32))
    assert not any(mod.training for mod in m.modules())


# --------------------------------------------------------------------------- errors and the observer hook


def test_not_a_module():
    with pytest.raises(TypeError, match=r"summary expects a tfl\.nn\.Module, got function"):
        summary(tfl.relu, jnp.ones(2))


def test_a_model_error_propagates_with_a_note_and_the_hook_is_off():
    lm = tied_lm()
    with pytest.raises((tfl.TapeError, TypeError)) as info:
        summary(lm, jnp.ones((2, 3), F32))  # float ids: the embedding refuses them
    assert any("tfl.nn.summary" in n for n in getattr(info.value, "__notes__", []))
    assert _module.observing == 0
    assert tfl.current_session() is None


def test_the_hook_is_off_after_summary_and_costs_nothing_when_off(monkeypatch: pytest.MonkeyPatch):
    lin = nn.Linear(3, 2, key=keys(1)[0])
    summary(lin, jnp.ones((1, 3), F32))
    assert _module.observing == 0

    class Untouchable:
        def get(self):
            raise AssertionError("the fast path read the observers")

    # closed: Module.__call__ reads one flag (and debug_nans' own) and goes straight to forward
    monkeypatch.setattr(_debug, "tracking", False)
    monkeypatch.setattr(_module, "_OBSERVERS", Untouchable())
    with tfl.Session() as s:
        assert lin(s.input(jnp.ones((1, 3), F32))).shape == (1, 2)
    monkeypatch.undo()

    with observe_calls() as calls, tfl.Session() as s:  # an observer of our own sees only its own calls
        assert _module.observing == 1
        lin(s.input(jnp.ones((4, 3), F32)))
    assert [(m, o.shape) for m, o in calls] == [(lin, (4, 2))]
    assert _module.observing == 0


def test_debug_nans_module_stack_and_an_observer_together(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(_debug, "tracking", True)  # as once a debug_nans session exists
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(list(_debug.module_stack()))
            if x < 0:
                raise ValueError("negative")
            return x

    probe = Probe()
    outer = nn.Sequential(probe)
    with observe_calls() as calls:
        assert outer(1) == 1
        with pytest.raises(ValueError):
            outer(-1)
    assert seen == [[outer, probe], [outer, probe]] and _debug.module_stack() == []
    assert calls == [(probe, 1), (outer, 1)]  # inner call first; a call that raised is not noted
