"""Conformance of tapeflow's PyTorch surface against PyTorch's OpInfo and ModuleInfo databases, as a report.

Runs what ``tests/test_torch_conformance.py`` runs (the harness is ``tests/_torch_oracle.py``) and
prints, per table entry and per module, how many samples pass, are refused with a clear error
(unsupported), differ silently, raise an unclear error, or are skipped, with the seconds each
took. ``--json PATH`` writes the counts (and every problem line) for the docs;
``--failures PATH`` writes the problems as a Markdown list.

    python benchmarks/conformance_report.py --json docs/conformance.json
    python benchmarks/conformance_report.py relu var --modules Linear   # a few only
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("pass", "unsupported", "silent", "error", "skipped")
SHOWN = 4  # problem lines per entry in the Markdown list
GUIDE = [
    "Each line reads `kind: binding on sample: detail`; the sample text is what a `gaps` key matches (a substring).",
    "- `silent`: a different value, shape, dtype, structure or gradient: fix it.",
    "- `error`: raised, but not clearly (not a TapeError/TypeError/ValueError/IndexError/NotImplementedError, or the"
    " message does not name the entry): raise a clear error, or support the call.",
    "- `unsupported ... (no gap lists it)`: a clear refusal: support it, or add `gaps={'<part of the sample>': 'why'}`"
    " to the entry (`'int64['`: integer inputs, `'return_indices=True'`: a keyword, `'max.binary('`: a whole row).",
    "- `stale gap`: no refused sample matches the key any more: remove it.",
    "- `opinfo row ... is not in PyTorch's op_db`: fix `opinfo=` (`()` where PyTorch has no row; a variant is"
    " `name.variant`).",
    "- Modules: a module's gaps are those of a table entry with `records='module'` named like the class.",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("entries", nargs="*", help="table entries to run (default: every entry with OpInfo rows)")
    ap.add_argument(
        "--modules", nargs="*", default=None, help="modules to run (default: all, or none when entries are named)"
    )
    ap.add_argument("--json", type=Path, help="write the counts and problems here")
    ap.add_argument("--failures", type=Path, help="write the problems here as Markdown")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(ROOT / "tests"))
    if "TAPEFLOW_CACHE_DIR" not in os.environ:  # compile cold, as the test suite does (a fresh folder per run)
        folder = tempfile.mkdtemp(prefix="tapeflow-conformance-xla-")
        os.environ["TAPEFLOW_CACHE_DIR"] = folder
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    import jax

    jax.config.update("jax_enable_x64", True)  # as the test suite runs (the tapeflow side turns it off)
    import _torch_oracle as O

    if args.entries or args.modules is not None:
        names, modules = args.entries, args.modules or []
    else:
        names, modules = O.opinfo_entries(), O.module_names()
    reports = []
    for n in names:
        reports.append(("entry", O.check_entry(n)))
        _print(*reports[-1])
    import tapeflow as tfl

    for n in modules:
        if not hasattr(tfl.nn, n):
            print(f"module {n:28s} tfl.nn has no {n}")
            continue
        reports.append(("module", O.check_module(n)))
        _print(*reports[-1])
    totals = {
        kind: {k: sum(r.count(k) for w, r in reports if w == kind) for k in KINDS} for kind in ("entry", "module")
    }
    for kind, t in totals.items():
        n = sum(w == kind for w, _ in reports)
        clean = sum(w == kind and not r.problems for w, r in reports)
        print(f"{kind} total: {n} ({clean} without problems), samples {t}")
    if args.json:
        data = {
            "schema": 1,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "limits": {
                "max_samples": O.MAX_SAMPLES,
                "max_grad_samples": O.MAX_GRAD_SAMPLES,
                "max_int_samples": O.MAX_INT_SAMPLES,
                "max_elements": O.MAX_ELEMENTS,
                "max_module_inputs": O.MAX_MODULE_INPUTS,
                "max_eval_inputs": O.MAX_EVAL_INPUTS,
            },
            "totals": totals,
            "entries": [
                {"kind": w, "name": r.name, **r.counts(), "seconds": round(r.seconds, 2), "problems": r.problems}
                for w, r in reports
            ],
        }
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    if args.failures:
        args.failures.write_text(_markdown(reports, totals))
    return 0


def _print(kind: str, r: object) -> None:
    c = r.counts()  # type: ignore[attr-defined]
    cells = " ".join(f"{k} {c[k]:3d}" for k in KINDS)
    flag = "" if not r.problems else f"  <- {len(r.problems)} problems"  # type: ignore[attr-defined]
    print(f"{kind} {r.name:28s} {cells}  {r.seconds:6.2f} s{flag}", flush=True)  # type: ignore[attr-defined]


def _markdown(reports: list[tuple[str, object]], totals: dict[str, dict[str, int]]) -> str:
    lines = ["# Conformance failures (generated by benchmarks/conformance_report.py)", "", *GUIDE, ""]
    for kind, t in totals.items():
        lines.append(f"- {kind} samples: " + ", ".join(f"{k} {v}" for k, v in t.items()))
    lines.append("")
    for kind, r in reports:
        problems = r.problems  # type: ignore[attr-defined]
        if not problems:
            continue
        lines.append(f"## {kind} `{r.name}` ({r.counts()})")  # type: ignore[attr-defined]
        lines.append("")
        lines += [f"- {p}" for p in problems[:SHOWN]]
        if len(problems) > SHOWN:
            lines.append(
                f"- ... and {len(problems) - SHOWN} more (run `python benchmarks/conformance_report.py {r.name}`)"
            )  # type: ignore[attr-defined]
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
