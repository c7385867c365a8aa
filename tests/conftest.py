import sys
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

# Test modules share helpers with `from _helpers import ...`; make this folder importable
# under every --import-mode (the default "prepend" mode already does it, "importlib" does not).
_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
