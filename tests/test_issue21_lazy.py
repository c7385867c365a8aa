"""Nodes keep their op definitions, lazy keys stay unambiguous, programs hold no optimizers, sharded lazy steps,
and the dtype of a user VJP's cotangents (issue 21, findings 3, 4, 7, 8 and 12)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tapeflow as tfl
from tapeflow._core import _registry as R
from tapeflow._shell import _lazy

OP = "test_issue21_scaled"


@pytest.fixture(autouse=True)
def _clean_registry():
    yield
    for name in [n for n in R.REGISTRY if n.startswith("test_issue21")]:
        R.unregister(name)


def _scaled(k: float) -> R.OpDef:
    """``OP`` as ``k * x`` with the VJP ``k * g``: a redefinition changes both."""
    return tfl.defop(OP, lambda x: k * x, lambda g, out, x: (k * g,), replace=True)


# --------------------------------------------------------------------------- finding 3: a node keeps its definition


def test_eager_backward_uses_the_definition_a_node_was_recorded_with() -> None:
    _scaled(2.0)
    with tfl.Session() as s:
        x = s.input(jnp.ones(3), requires_grad=True)
        y = tfl.sum(tfl.apply(OP, x))
        _scaled(3.0)
        np.testing.assert_allclose(np.asarray(s.backward(y)[x]), 2.0)
    with tfl.Session() as s:  # a new recording gets the new definition
        x = s.input(jnp.ones(3), requires_grad=True)
        np.testing.assert_allclose(np.asarray(s.backward(tfl.sum(tfl.apply(OP, x)))[x]), 3.0)


def test_pending_lazy_nodes_compute_with_their_recorded_definition() -> None:
    _scaled(2.0)
    x0 = jnp.arange(3.0)
    with tfl.Session(lazy=True) as s:
        x = s.input(x0, requires_grad=True)
        y = tfl.apply(OP, x)
        _scaled(3.0)
        np.testing.assert_allclose(np.asarray(y.value), 2.0 * x0)
    _scaled(2.0)
    with tfl.Session(lazy=True) as s:  # recorded under 2 x, redefined before the gradient program runs
        x = s.input(x0, requires_grad=True)
        y = tfl.sum(tfl.apply(OP, x))
        _scaled(3.0)
        np.testing.assert_allclose(np.asarray(s.backward(y)[x]), 2.0)


def test_lazy_structure_keys_tell_two_definitions_of_one_name_apart() -> None:
    x0 = jnp.arange(3.0)
    got = []
    for k in (2.0, 3.0):
        _scaled(k)
        with tfl.Session(lazy=True) as s:
            x = s.input(x0)
            got.append(np.asarray(tfl.apply(OP, x).value))
    np.testing.assert_allclose(got, [2.0 * x0, 3.0 * x0])


def test_jvp_and_recorded_backward_use_the_recorded_definition() -> None:
    _scaled(2.0)
    t, x = tfl.leaf(tfl.Tape.empty(), jnp.ones(2), requires_grad=True)
    t, y = tfl.record(t, OP, (x,))
    _scaled(3.0)
    np.testing.assert_allclose(np.asarray(tfl.jvp(t, y.value, {x: jnp.ones(2)})), 2.0)
    t2, g = tfl.backward_graph(t, y.value, seed=jnp.ones(2), wrt=[x])
    np.testing.assert_allclose(np.asarray(t2[g[x]].value), 2.0)
    np.testing.assert_allclose(np.asarray(tfl.backward(t, y.value, seed=jnp.ones(2))[x]), 2.0)


def test_jit_of_a_tape_function_retraces_for_a_new_definition() -> None:
    """A tape's pytree structure holds each node's definition, so ``jax.jit`` never reuses a trace of the old one."""
    f = jax.jit(lambda t, root: tfl.backward(t, root, seed=jnp.ones(2))[0], static_argnums=1)
    outs = []
    for k in (2.0, 3.0):
        _scaled(k)
        t, x = tfl.leaf(tfl.Tape.empty(), jnp.ones(2), requires_grad=True)
        t, y = tfl.record(t, OP, (x,))
        outs.append(np.asarray(f(t, y.value)))
    np.testing.assert_allclose(outs, [np.full(2, 2.0), np.full(2, 3.0)])


# --------------------------------------------------------------------------- finding 4: keys across a table reset


def test_structure_keys_stay_unambiguous_across_an_intern_table_reset(monkeypatch) -> None:
    monkeypatch.setattr(_lazy, "_META_IDS", {})
    monkeypatch.setattr(_lazy, "_META_LIMIT", 3)
    x0 = jnp.arange(3.0) / 4
    with tfl.Session(lazy=True) as a:  # keys its 3 nodes (the table is then full); its gradients are read last
        xa = a.input(x0, requires_grad=True)
        ga = a.backward(tfl.sum(tfl.exp(xa)))
    with tfl.Session(lazy=True) as b:  # a new table: the same 3 small ints, another structure
        xb = b.input(jnp.arange(4.0), requires_grad=True)
        gb = b.backward(tfl.sum(tfl.tanh(xb)))
        np.testing.assert_allclose(np.asarray(gb[xb]), 1 - np.tanh(np.arange(4.0)) ** 2, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(ga[xa]), np.exp(x0), rtol=1e-6)


def test_a_recording_whose_keys_span_a_reset_rekeys_itself(monkeypatch) -> None:
    """After a reset a recording's key is what a fresh recording of the same tape gets, never old ids and new ones."""
    monkeypatch.setattr(_lazy, "_META_IDS", {})
    monkeypatch.setattr(_lazy, "_META_LIMIT", 4)
    with tfl.Session(lazy=True) as s:
        x = s.input(jnp.arange(3.0))
        y = tfl.exp(x)
        rec = _lazy.LazyRecording()
        rec.structure(s.tape)  # 2 nodes keyed
        with tfl.Session(lazy=True) as b:  # 3 more metas: the table fills and starts over
            tfl.tanh(tfl.sin(b.input(jnp.arange(5.0)))).value
        tfl.cos(y)
        assert rec.structure(s.tape) == _lazy.LazyRecording().structure(s.tape)
        np.testing.assert_allclose(np.asarray(tfl.cos(y).value), np.cos(np.exp(np.arange(3.0))), rtol=1e-6)


# --------------------------------------------------------------------------- finding 7: programs hold no optimizers


def test_lazy_step_programs_keep_no_optimizer_or_params_alive() -> None:
    refs = []
    for trial in range(4):
        w = tfl.Param(jnp.full((64, 64), 0.01 * (trial + 1)), name="w")
        opt = tfl.Optimizer(optax.adam(1e-3), [w])
        for _ in range(2):
            with tfl.Session(lazy=True) as s:
                x = s.input(jnp.ones((2, 64)))
                opt.step(s.backward(tfl.sum((x @ w) ** 2)))
        refs.append((weakref.ref(opt), weakref.ref(w), weakref.ref(w.storage)))
        del w, opt, s, x
    gc.collect()
    alive = [k for k, rs in enumerate(refs) if any(r() is not None for r in rs)]
    assert not alive, f"trials {alive} still hold their optimizer or parameters after they ended"


# --------------------------------------------------------------------------- finding 12: a user VJP's dtypes


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int32])
def test_defop_vjp_cotangent_dtype_is_checked(dtype) -> None:
    tfl.defop("test_issue21_castvjp", lambda x: x * x, lambda g, out, x: ((2 * g * x).astype(dtype),))
    w = tfl.Param(jnp.array([1.81, 7.93, 0.74], jnp.float32), name="w")
    with tfl.Session() as s, pytest.raises(TypeError, match=r"test_issue21_castvjp.*cotangent #0.*float32"):
        s.backward(tfl.sum(tfl.apply("test_issue21_castvjp", w)))


def test_defop_vjp_python_number_cotangent_takes_the_operand_dtype() -> None:
    tfl.defop("test_issue21_number", lambda x: 3.0 * x, lambda g, out, x: (3.0,))
    with tfl.Session() as s:
        x = s.input(np.float32(2.0), requires_grad=True)
        g = s.backward(tfl.apply("test_issue21_number", x))[x]
        assert g.dtype == np.float32 and float(g) == 3.0


# --------------------------------------------------------------------------- finding 8: sharded inputs, lazy steps

SHARDED_STEPS = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, optax, tapeflow as tfl
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()), ("d",))
    xv = jax.device_put(jnp.arange(16.0).reshape(8, 2) / 10, NamedSharding(mesh, P("d")))

    def train(lazy):
        w = tfl.Param(jnp.array([[0.5], [-0.25]]), name="w")
        opt = tfl.Optimizer(optax.adam(0.1), [w])
        for _ in range(4):
            with tfl.Session(lazy=lazy) as s:
                x = s.input(xv)
                opt.step(s.backward(tfl.sum((x @ w) ** 2)))
        return np.asarray(w.storage.read_current())

    np.testing.assert_allclose(train(True), train(False), rtol=1e-6)
    print("SHARDED-STEPS-OK")
    """
)


def test_lazy_steps_over_a_sharded_input_equal_eager_ones() -> None:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-c", SHARDED_STEPS], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "SHARDED-STEPS-OK" in proc.stdout
