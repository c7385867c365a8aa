"""The PyTorch surface against PyTorch's own test databases (OpInfo ``op_db``, ModuleInfo ``module_db``).

Every table entry with OpInfo rows and every module of the issue's list with a ModuleInfo row
runs its samples through tapeflow (``tests/_torch_oracle.py`` says how samples are converted,
compared and classified). A test per entry names the entry: it fails on a silent difference, on
an unclear error, on a refusal no gap of the entry lists, and on a gap that no refusal matches
any more. The last test adds everything up: no silent difference anywhere.
The harness's own tests come first: deliberately wrong implementations are caught.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("expecttest")  # PyTorch's test databases import it

import _torch_oracle as O

import tapeflow as tfl
from tapeflow._shell._surface import SURFACE, Entry
from tapeflow._shell._tensor import apply

ENTRIES = O.opinfo_entries()
_REPORTS: dict[str, O.Report] = {}
_MODULE_REPORTS: dict[str, O.Report] = {}


def _report(name: str) -> O.Report:
    if name not in _REPORTS:
        _REPORTS[name] = O.check_entry(name)
    return _REPORTS[name]


def _module_report(name: str) -> O.Report:
    if name not in _MODULE_REPORTS:
        _MODULE_REPORTS[name] = O.check_module(name)
    return _MODULE_REPORTS[name]


def _fake(fn, row: str, binding=("tfl",), gaps=None) -> Entry:
    """An entry that is not in the table: the harness's own tests run it against a real row."""
    return Entry("fake", fn, frozenset(binding), "ops:x", (row,), dict(gaps or {}))


def _kinds(report: O.Report) -> set[str]:
    return {o.kind for o in report.outcomes}


# --------------------------------------------------------------------------- the harness catches differences


def test_describe_names_a_sample_as_gaps_match_it():
    torch = pytest.importorskip("torch")
    text = O.describe("var", (torch.ones(5, 5, dtype=torch.float32), [torch.ones(2, dtype=torch.int64)]), {"dim": 1})
    assert text == "var(float32[5, 5], [int64[2]], dim=1)"
    assert O.describe("max.binary", (torch.ones(()), 2.5), {"dtype": torch.float64}) == (
        "max.binary(float32[], 2.5, dtype=torch.float64)"
    )


def test_numpy_transpose_is_a_silent_difference():
    def transpose(input, dim0, dim1):  # NumPy's reading of transpose(x, 0, 1): the identity permutation
        n = input.ndim
        return apply("permute", input, axes=tuple(range(n)))

    report = O.check_entry(_fake(transpose, "transpose"))
    silent = [o for o in report.outcomes if o.kind == "silent"]
    assert silent and any("values differ" in o.detail or "shape" in o.detail for o in silent)
    assert any(o.kind == "silent" for o in report.outcomes if "transpose(float32[10, 10], 0, 1)" in o.sample)


def test_a_biased_variance_and_a_missing_pair_are_silent():
    def var(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
        axes = None if dim is None else ((dim,) if isinstance(dim, int) else tuple(dim))
        return tfl.numpy.var(input, axis=axes, keepdims=keepdim)  # NumPy's ddof=0

    report = O.check_entry(_fake(var, "var"))
    assert any(o.kind == "silent" and "values differ" in o.detail for o in report.outcomes)

    def max_(input, dim=None, keepdim=False):
        if dim is None:
            return tfl.numpy.max(input)
        return (tfl.numpy.max(input, axis=dim, keepdims=keepdim), tfl.numpy.argmax(input, axis=dim, keepdims=keepdim))

    report = O.check_entry(_fake(max_, "max.reduction_with_dim"))
    assert any(o.kind == "silent" and "named tuple" in o.detail for o in report.outcomes), report.problems


def test_a_wrong_gradient_and_a_wrong_dtype_are_silent():
    straight_through = tfl.lift(
        lambda x: x + jax.lax.stop_gradient(jnp.maximum(x, 0) - x), name="tests.conformance.straight_relu"
    )

    def relu(input, inplace=False):  # relu's value, identity's gradient
        return straight_through(input)

    report = O.check_entry(_fake(relu, "nn.functional.relu"))
    assert any(o.kind == "silent" and "gradient of input 0" in o.detail for o in report.outcomes), report.problems

    def sum_(input, dim=None, keepdim=False, *, dtype=None):  # always float32
        return apply("sum", apply("astype", input, dtype=np.dtype(np.float32)), axis=dim, keepdims=keepdim)

    report = O.check_entry(_fake(sum_, "sum"))
    assert any(o.kind == "silent" and "dtype float32 != int32" in o.detail for o in report.outcomes)


def test_refusals_need_a_clear_message_and_a_gap_and_gaps_go_stale():
    def relu(input, inplace=False):
        if input.ndim == 0:
            raise ValueError("fake: a 0-d input is refused here; reshape it to (1,) first")
        return apply("relu", input)

    report = O.check_entry(_fake(relu, "nn.functional.relu"))
    refused = [o for o in report.outcomes if o.kind == "unsupported"]
    assert refused and all("[]" in o.sample for o in refused)
    assert any("no gap lists it" in p for p in report.problems)

    gaps = {"float32[])": "0-d inputs", "int64[": "integers", "never(": "matches nothing"}
    report = O.check_entry(_fake(relu, "nn.functional.relu", gaps=gaps))
    assert not [p for p in report.problems if "no gap lists it" in p]
    assert [p for p in report.problems if p.startswith("stale gap")] == [
        "stale gap 'never(': no refused sample matches it (reason: matches nothing)"
    ]

    def unclear(input, inplace=False):
        raise RuntimeError("something went wrong")

    report = O.check_entry(_fake(unclear, "nn.functional.relu", gaps={"(": "everything"}))
    assert _kinds(report) == {"error"} and report.problems


def test_an_unknown_row_is_reported():
    entry = dataclasses.replace(_fake(lambda input: input, "transpose"), opinfo=("no_such_row",))
    report = O.check_entry(entry)
    assert report.problems == ["opinfo row 'no_such_row' is not in PyTorch's op_db (rows near it: [])"]


# --------------------------------------------------------------------------- the table's entries


@pytest.mark.parametrize("name", ENTRIES)
def test_entry_matches_pytorch_opinfo(name: str) -> None:
    report = _report(name)
    assert not report.problems, f"{name}: {report.counts()}\n" + "\n".join(report.problems)


@pytest.mark.parametrize("name", O.MODULES)
def test_module_matches_pytorch_moduleinfo(name: str) -> None:
    if name not in O.module_rows():
        pytest.skip(f"torch.nn.{name} has no ModuleInfo row (hand-written cases test it)")
    assert hasattr(tfl.nn, name), f"tfl.nn has no {name}"
    report = _module_report(name)
    assert not report.problems, f"{name}: {report.counts()}\n" + "\n".join(report.problems)


def test_no_silent_difference_anywhere() -> None:
    """Every entry and module together: silent must be 0 (the counts are printed with -s)."""
    reports = [_report(n) for n in ENTRIES]
    reports += [_module_report(n) for n in O.MODULES if n in O.module_rows() and hasattr(tfl.nn, n)]
    total = {k: sum(r.count(k) for r in reports) for k in ("pass", "unsupported", "silent", "error", "skipped")}
    print(f"conformance: {len(reports)} entries and modules, {total}")
    silent = [o.line() for r in reports for o in r.outcomes if o.kind == "silent"]
    assert not silent, f"{len(silent)} silent differences:\n" + "\n".join(silent)
    assert SURFACE  # the table is declared
