"""What a new user meets first: the errors and messages of the first hour say what happened and what to do."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import jax.numpy as jnp
import pytest

import tapeflow as tfl
from tapeflow import TapeError

STALE = r"stale tensor handle from generation {}; current generation is {} \({}"


def test_a_handle_read_after_its_with_block_says_the_block_exit_reset_the_session():
    s = tfl.Session()
    with s:
        loss = tfl.sum(s.input(jnp.arange(3.0)))
    with pytest.raises(TapeError, match=STALE.format(0, 1, r"the `with s:` block it was recorded in has ended")):
        float(loss)
    with pytest.raises(TapeError) as err:
        loss.value
    assert "Session.reset()" not in str(err.value) and "float(loss)" in str(err.value)


def test_a_handle_read_after_reset_names_the_reset():
    s = tfl.Session()
    with s:
        kept = tfl.sum(s.input(jnp.arange(3.0)))
        s.reset()  # inside the block: the user's own reset invalidated it
        with pytest.raises(TapeError, match=STALE.format(0, 1, r"Session\.reset\(\) invalidates handles")):
            float(kept)
    with pytest.raises(TapeError, match=STALE.format(0, 2, r"Session\.reset\(\) invalidates handles")):
        float(kept)


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"tapeflow_example_{name}_new_user", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("missing", ["sklearn", "tqdm"])
def test_the_demo_without_its_extra_says_which_extra_to_install(missing, monkeypatch):
    demo = _example("demo")
    monkeypatch.setitem(sys.modules, missing, None)  # an import of it raises ImportError, as when not installed
    with pytest.raises(SystemExit) as exit_:
        demo.main(["--quiet"])
    said = str(exit_.value)
    assert "pip install -e '.[demo]'" in said and "tapeflow[demo]" in said and f"missing: {missing}" in said


def test_nanogpt_suggests_the_cpu_build_of_torch_not_a_plain_pip_install():
    said = _example("nanogpt").NO_TORCH
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in said and "'.[dev]'" in said
    assert not re.search(r"pip install torch(?! --index-url https://download\.pytorch\.org/whl/cpu)", said), said
