"""Each test file's rough time in seconds in a full run of the suite (two workers), for the order of ``--dist loadfile``.

``tests/conftest.py`` hands the files out longest first, so the last files to start are the shortest
and both workers finish at about the same time. Only the order depends on these numbers, never what
runs; a file missing here (a new one) is handed out before all of them, so that a long new file cannot
be the one that starts last. Refresh from the junit XML of a full run (setup, call and teardown of
every test, summed per file):

    python -m pytest -q -n 2 --dist loadfile --junitxml=run.xml
    python tests/_file_costs.py run.xml
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

COSTS = {
    "test_torch_conformance.py": 397,
    "test_properties.py": 275,
    "test_docs.py": 257,
    "test_examples.py": 220,
    "test_torch_modules.py": 194,
    "test_fuzz_session.py": 178,
    "test_numpy_namespace.py": 173,
    "test_optim.py": 164,
    "test_torch_functional.py": 127,
    "test_ops.py": 127,
    "test_functional.py": 127,
    "test_nn.py": 100,
    "test_docs_layout.py": 100,
    "test_shard.py": 98,
    "test_lane_probes.py": 94,
    "test_kernel_cache.py": 79,
    "test_recurrent.py": 71,
    "test_remat.py": 69,
    "test_replay.py": 67,
    "test_checkpoint.py": 59,
    "test_torch_ports.py": 56,
    "test_checkpoint_atomic.py": 54,
    "test_block_loops.py": 50,
    "test_session.py": 48,
    "test_pytorch_habits.py": 46,
    "test_extend.py": 45,
    "test_compile_cache.py": 44,
    "test_higher_order.py": 44,
    "test_resume.py": 43,
    "test_compile_counts.py": 43,
    "test_batchnorm.py": 41,
    "test_torch_promotion.py": 40,
    "test_recipes.py": 37,
    "test_flax_interop.py": 35,
    "test_debug_nans.py": 33,
    "test_tape.py": 32,
    "test_param_groups.py": 32,
    "test_architecture.py": 32,
    "test_nn_init.py": 28,
    "test_tiered.py": 26,
    "test_devices.py": 25,
    "test_eager_replay_probes.py": 24,
    "test_dropped_model.py": 20,
    "test_torch_tensor.py": 20,
    "test_lazy.py": 17,
    "test_step_failures.py": 16,
    "test_torch_interop.py": 16,
    "test_precision.py": 16,
    "test_jvp.py": 15,
    "test_issue21_lazy.py": 15,
    "test_grads.py": 14,
    "test_compiled_backward.py": 14,
    "test_one_step.py": 14,
    "test_attr_cache.py": 12,
    "test_lint.py": 10,
    "test_benchmarks.py": 10,
    "test_tensor.py": 9,
    "test_session_random.py": 9,
    "test_surface_fast_paths.py": 7,
    "test_treescope.py": 6,
    "test_train_step_params.py": 3,
    "test_threads.py": 2,
    "test_summary.py": 2,
    "test_train_step_finite.py": 1,
    "test_validation.py": 1,
    "test_figures.py": 1,
    "test_session_parts.py": 1,
    "test_new_user_paths.py": 1,
    "test_session_rationals.py": 1,
    "test_gallery.py": 1,
}


def from_junit(xml_path: str) -> dict[str, int]:
    """Seconds per test file (``test_x.py``) summed over the test cases of a junit XML report."""
    import xml.etree.ElementTree as ET

    totals: dict[str, float] = defaultdict(float)
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        module = (case.get("classname") or "").split(".")
        if len(module) > 1 and module[0] == "tests":
            totals[f"{module[1]}.py"] += float(case.get("time") or 0.0)
    return {name: max(1, round(s)) for name, s in sorted(totals.items(), key=lambda kv: -kv[1])}


if __name__ == "__main__":
    costs = from_junit(sys.argv[1])
    path = Path(__file__)
    text = path.read_text()
    head, rest = text.split("COSTS = {\n", 1)
    table = "".join(f'    "{name}": {s},\n' for name, s in costs.items())
    path.write_text(head + "COSTS = {\n" + table + "}\n" + rest.split("\n}\n", 1)[1])
    print(f"{path}: {len(costs)} files, {sum(costs.values())} s in all")
