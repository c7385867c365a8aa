"""Device placement on a non-default device, in a fresh interpreter with four host (CPU) devices.

``--xla_force_host_platform_device_count`` only takes effect if it is set before
JAX initializes, so the checks run in a subprocess whose environment has it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    r"""
    import jax, jax.numpy as jnp, numpy as np
    import tapeflow as tfl

    cpus = jax.devices("cpu")
    assert len(cpus) == 4, cpus
    dev = cpus[2]
    on = lambda a: a.devices() == {dev}

    w_np = np.arange(12.0, dtype=np.float32).reshape(3, 4) / 10
    w = tfl.Param(jnp.asarray(w_np), name="w")
    b = tfl.Param(jnp.zeros(4, jnp.float32), name="b")
    host_before = w.value
    assert not on(host_before)  # the parameter lives on the default device before any use

    s = tfl.Session(device=dev)
    assert s.device == dev
    x = s.input(np.ones((2, 3), np.float32), requires_grad=True)
    u1 = s.use(w)
    u2 = s.use(w)
    # the device mirror is uploaded once and reused by later uses
    assert u1.value is u2.value, "second use uploaded the parameter again"
    assert w.storage.mirror is u1.value
    h = tfl.relu(x @ w + b)          # a Param operand inside an op: the same mirror again
    w_leaf = s.tape[s.tape[h.id].parents[0]].parents[0]
    w_leaf = s.tape[w_leaf].parents[1]
    assert s.tape[w_leaf].value is u1.value
    y = (h * 2.0 - 1.0).sum()
    r = s.rand_uniform((3,))
    n = s.normal((2, 2))
    m = s.bernoulli_mask((5,), 0.5)
    c = s.const(np.ones(2, np.float32))
    d = s.detach(h)
    for node in s.tape:
        assert on(node.value), (node, node.value.devices())
    for t in (x, u1, h, y, r, n, m, c, d):
        assert on(t.value), t
    g = s.backward(y)
    assert on(g[x]) and on(g[w]) and on(g[b])
    # Param.value reads back correctly (and is not moved)
    np.testing.assert_array_equal(np.asarray(w.value), w_np)
    assert w.value is host_before
    # a write replaces the host value and drops the mirror; the next use uploads once more
    w.value = jnp.asarray(w_np * 2)
    s.reset()
    v1 = s.use(w)
    v2 = s.use(w)
    assert on(v1.value) and v1.value is v2.value
    np.testing.assert_array_equal(np.asarray(v1.value), w_np * 2)
    np.testing.assert_array_equal(np.asarray(w.value), w_np * 2)
    # a session on another device gets its own mirror; the first one is untouched
    s0 = tfl.Session(device=cpus[1])
    z = s0.use(w)
    assert z.value.devices() == {cpus[1]}
    assert on(v1.value)
    # by index and by string
    assert tfl.Session(device="cpu:3").device == cpus[3]
    assert tfl.Session(device="cpu").device == cpus[0]
    for bad in ("cpu:4", "cpu:-1", "gpu", "cuda", "gpu:1", "nonsense", "cpu:two"):
        try:
            tfl.Session(device=bad)
        except ValueError as e:
            assert str(e), bad
        else:
            raise AssertionError(f"Session(device={bad!r}) did not raise")
    # default_device() follows JAX's default-device setting (a device or a platform name)
    from tapeflow._core._device import default_device
    assert default_device() == cpus[0]
    with jax.default_device(cpus[2]):
        assert default_device() == cpus[2]
    with jax.default_device("cpu"):
        assert default_device() == cpus[0]
    assert default_device() == cpus[0]
    print("DEVICES-OK")
    """
)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_non_default_cpu_device_in_subprocess(lazy):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_ENABLE_X64", None)
    proc = subprocess.run(
        [sys.executable, "-c", _lazy_default(lazy) + SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "DEVICES-OK" in proc.stdout


def _lazy_default(lazy: bool) -> str:
    """A preamble that makes every ``tfl.Session()`` of the script lazy (or leaves them eager)."""
    return f"import tapeflow\ntapeflow.Session.__init__.__kwdefaults__['lazy'] = {lazy}\n"


SHARDED_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, tapeflow as tfl
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    x = jax.device_put(jnp.arange(8.0).reshape(4, 2), sharding)
    s = tfl.Session()
    h = s.input(x, requires_grad=True)
    assert h.value.sharding == sharding, h.value.sharding   # kept, not gathered onto one device
    g = s.backward(tfl.sum(h * h))
    np.testing.assert_allclose(np.asarray(g[h]), 2 * np.arange(8.0).reshape(4, 2))
    print("SHARDED-OK")
    """
)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_sharded_input_keeps_its_sharding_in_a_session(lazy):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    env["JAX_PLATFORMS"] = "cpu"
    script = _lazy_default(lazy) + SHARDED_SCRIPT
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "SHARDED-OK" in proc.stdout


TRACED_COMMIT_SCRIPT = textwrap.dedent(
    r"""
    import jax, jax.numpy as jnp
    import tapeflow as tfl
    from tapeflow._shell._commit import commit

    c0, c1 = jax.devices("cpu")[:2]
    a = tfl.Storage(jax.device_put(jnp.zeros(2), c0))
    b = tfl.Storage(jax.device_put(jnp.zeros(2), c1))
    olds = tfl.Storage.read_current_many([a, b])
    new = [jax.device_put(jnp.ones(2), c0), jax.device_put(jnp.full(2, 2.0), c0)]
    # the old cells live on two devices: not one program's in-place write; each value is checked and placed
    commit(zip([a, b], new), where="t", replacing=olds, traced=True)
    assert a.read_current() is new[0] and a.host_current
    assert b.read(c0).tolist() == [2.0, 2.0] and b.read_host().devices() == {c1}
    # every old cell on one device with the new values: all in place, and reads on that device are the values
    olds = tfl.Storage.read_current_many([a])
    commit(zip([a], [jnp.full(2, 3.0, device=c0)]), where="t", replacing=olds, traced=True)
    assert a.read(c0).tolist() == [3.0, 3.0] and tfl.Storage.all_on([a], c0) and not tfl.Storage.all_on([a], c1)
    print("TRACED-COMMIT-OK")
    """
)


def test_a_traced_commit_writes_in_place_only_when_every_cell_is_on_the_programs_device():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", TRACED_COMMIT_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "TRACED-COMMIT-OK" in proc.stdout


def test_a_traced_commit_still_refuses_a_tracer():
    import jax
    import jax.numpy as jnp

    import tapeflow as tfl
    from tapeflow._shell._commit import StateWriteError, commit

    st = tfl.Storage(jnp.zeros(2))
    olds = tfl.Storage.read_current_many([st])

    def write(v):
        commit([(st, v)], where="t", replacing=olds, traced=True)
        return v

    with pytest.raises(StateWriteError):
        jax.jit(write)(jnp.ones(2))
    assert st.read_current() is olds[0]
