import sys
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

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
