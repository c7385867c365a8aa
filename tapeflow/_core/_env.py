"""On/off switches read from the environment (``TAPEFLOW_LAZY``, ``TAPEFLOW_BLOCK_LOOPS``): one reading of their values.

>>> import os
>>> os.environ["TAPEFLOW_DOC_SWITCH"] = "off"
>>> switch("TAPEFLOW_DOC_SWITCH", True), switch("TAPEFLOW_UNSET_SWITCH", True)
(False, True)
"""

from __future__ import annotations

import os

__all__ = ["switch"]

_FALSE, _TRUE = ("0", "false", "no", "off"), ("1", "true", "yes", "on")


def switch(name: str, default: bool) -> bool:
    """The environment variable ``name`` as on or off; ``default`` when it is unset or empty.

    ``0`` / ``false`` / ``no`` / ``off`` mean off and ``1`` / ``true`` / ``yes`` / ``on`` on (any case);
    another value is refused with a :class:`ValueError` naming the values it takes.
    """
    text = os.environ.get(name, "").strip().lower()
    if text in _FALSE:
        return False
    if text in _TRUE:
        return True
    if text == "":
        return default
    raise ValueError(
        f"{name}={os.environ[name]!r} is not a switch: set it to {' / '.join(_FALSE)} (off) or "
        f"{' / '.join(_TRUE)} (on), or leave it unset ({'on' if default else 'off'})"
    )
