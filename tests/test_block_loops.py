"""Repeated blocks compiled once (tapeflow._core._blocks): found in a recording, run as one function per block.

A lazy session's program calls one traced function per block of a run (forward and reverse sweep) instead of
tracing every block's ops again. What it computes must be what the unrolled program computes, bit for bit
(XLA inlines the calls), and what an op-by-op session computes within float32 rounding.
"""

from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tapeflow as tfl
from tapeflow._core import _blocks
from tapeflow._core._tape import PENDING

DIM, HEADS, CTX, BATCH = 16, 2, 6, 2


class Block(tfl.nn.Module):
    """A pre-norm transformer block: more than MIN_BLOCK_OPS ops, wired to the block before by its input."""

    def __init__(self, key: jax.Array) -> None:
        k1, k2 = tfl.nn.init.keys(key, 2)
        self.ln1 = tfl.nn.LayerNorm(DIM)
        self.attn = tfl.nn.MultiHeadAttention(DIM, HEADS, key=k1, causal=True)
        self.ln2 = tfl.nn.LayerNorm(DIM)
        self.mlp = tfl.nn.MLP([DIM, 2 * DIM, DIM], key=k2, activation=tfl.gelu)

    def forward(self, x: tfl.Tensor) -> tfl.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Stack(tfl.nn.Module):
    def __init__(self, layers: int, key: jax.Array) -> None:
        ki, kb = tfl.nn.init.keys(key, 2)
        self.proj = tfl.nn.Linear(3, DIM, key=ki)
        self.blocks = [Block(k) for k in tfl.nn.init.keys(kb, layers)]
        self.head = tfl.nn.Linear(DIM, 1, key=ki)

    def hidden(self, x: tfl.Tensor) -> list[tfl.Tensor]:
        out = [self.proj(x)]
        for b in self.blocks:
            out.append(b(out[-1]))
        return out

    def forward(self, x: tfl.Tensor) -> tfl.Tensor:
        return self.head(self.hidden(x)[-1])


@pytest.fixture
def loops():
    """Block loops on for the test (the library's default), as they were after it."""
    before = tfl.set_block_loops(True)
    yield
    tfl.set_block_loops(before)


def _batch(seed: int) -> tuple[np.ndarray, np.ndarray]:
    r = np.random.default_rng(seed)
    return r.normal(size=(BATCH, CTX, 3)).astype(np.float32), r.normal(size=(BATCH, CTX, 1)).astype(np.float32)


def _train(
    loop: bool, lazy: bool, tx: optax.GradientTransformation, layers: int = 2, steps: int = 2
) -> tuple[list[float], list[np.ndarray]]:
    before = tfl.set_block_loops(loop)
    try:
        model = Stack(layers, jax.random.key(1))
        opt = tfl.Optimizer(tx, model)
        s = tfl.Session(lazy=lazy)
        losses = []
        for step in range(steps):
            x, y = _batch(step)
            with s:
                loss = tfl.mean((model(s.input(x)) - s.input(y)) ** 2)
                opt.step(s.backward(loss))
                losses.append(float(loss))
        return losses, [np.asarray(p.value) for p in model.parameters()]
    finally:
        tfl.set_block_loops(before)


def _recording(layers: int) -> list:
    model = Stack(layers, jax.random.key(0))
    s = tfl.Session(lazy=True)
    x, y = _batch(0)
    with s:
        tfl.mean((model(s.input(x)) - s.input(y)) ** 2)
        return list(s.recording.nodes)


def _pending(nodes: list) -> set[int]:
    return {i for i, nd in enumerate(nodes) if nd.value is PENDING}


class TestFinding:
    def test_a_stack_of_blocks_is_one_run_of_every_block(self):
        for layers in (2, 5):
            nodes = _recording(layers)
            (run,) = _blocks.find_runs(nodes, _pending(nodes))
            assert run.blocks == layers
            # every block's first node is a LayerNorm leaf right after the input projection's output (the carry)
            assert run.init == (run.start - 1,) and nodes[run.start - 1].op == "linear_t"
            assert run.stop <= len(nodes) and nodes[run.stop].op is None  # the head's weight leaf

    def test_small_layers_and_single_blocks_are_left_unrolled(self):
        model = tfl.nn.MLP([4] * 9, key=jax.random.key(0))  # 8 layers of 2 ops: fewer than MIN_BLOCK_OPS
        s = tfl.Session(lazy=True)
        with s:
            tfl.sum(model(s.input(np.ones((2, 4), np.float32))))
            nodes = list(s.recording.nodes)
        assert _blocks.find_runs(nodes, _pending(nodes)) == ()
        one = _recording(1)
        assert _blocks.find_runs(one, _pending(one)) == ()

    def test_a_block_that_reads_two_blocks_back_ends_the_run(self):
        t = tfl.Tape.empty()
        t, x = tfl.leaf(t, jnp.ones(3), requires_grad=True)
        ids = [x]
        pending = set()
        for k in range(4):
            h = ids[-1] if k != 3 else ids[-2]  # the last block reads the output two blocks back
            for _ in range(8):
                t, r = tfl.record(t, "tanh", (h,))
                h = r.value
                pending.add(h)
            ids.append(h)
        runs = _blocks.find_runs(list(t.nodes), pending)
        assert [(r.start, r.length, r.blocks) for r in runs] == [(1, 8, 3)]


class TestSameResults:
    def test_training_equals_the_unrolled_program_bit_for_bit(self):
        loop_losses, loop_params = _train(loop=True, lazy=True, tx=optax.adam(1e-2))
        flat_losses, flat_params = _train(loop=False, lazy=True, tx=optax.adam(1e-2))
        assert loop_losses == flat_losses
        for a, b in zip(loop_params, flat_params):
            np.testing.assert_array_equal(a, b)

    def test_training_equals_an_op_by_op_session(self):
        # SGD: Adam divides by the root of tiny second moments, which turns rounding into visible differences
        loop_losses, loop_params = _train(loop=True, lazy=True, tx=optax.sgd(0.1))
        eager_losses, eager_params = _train(loop=True, lazy=False, tx=optax.sgd(0.1))
        np.testing.assert_allclose(loop_losses, eager_losses, rtol=1e-5)
        for a, b in zip(loop_params, eager_params):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    @pytest.mark.usefixtures("loops")
    def test_every_block_output_read_after_the_run_and_an_input_every_block_reads(self):
        """Cotangents that reach interior blocks from after the run, and a shared node that requires grad."""
        model = Stack(2, jax.random.key(2))
        x, _ = _batch(3)
        memory = tfl.Param(jnp.linspace(-1.0, 1.0, DIM, dtype=jnp.float32), name="memory")

        def loss_fn(s: tfl.Session) -> tfl.Tensor:
            m = s.use(memory)
            h = [model.proj(s.input(x))]
            for b in model.blocks:
                h.append(b(h[-1] * m))  # every block reads the same leaf `m`
            return sum((tfl.mean(t * t) for t in h[1:]), start=tfl.mean(h[0]))

        grads = {}
        for mode, lazy in (("lazy", True), ("eager", False)):
            s = tfl.Session(lazy=lazy)
            with s:
                loss = loss_fn(s)
                if lazy:
                    nodes = list(s.recording.nodes)
                    runs = _blocks.find_runs(nodes, _pending(nodes))
                    assert runs and runs[0].blocks == 2  # the case under test is a loop
                g = s.backward(loss)
                used = [memory, model.proj.weight, model.proj.bias, *(p for b in model.blocks for p in b.parameters())]
                grads[mode] = [np.asarray(g[p]) for p in used]
        for a, b in zip(grads["lazy"], grads["eager"]):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)

    @pytest.mark.usefixtures("loops")
    def test_a_block_params_gradient_matches_finite_differences(self):
        model = Stack(2, jax.random.key(4))
        x, y = _batch(5)
        params = list(model.parameters())
        s = tfl.Session(lazy=True)
        with s:
            loss = tfl.mean((model(s.input(x)) - s.input(y)) ** 2)
            g = s.backward(loss)
            got = [np.asarray(g[p]) for p in params]
        eps = 1e-3
        w = params[3]  # a block Param: its finite difference along a random direction
        d = np.random.default_rng(0).normal(size=w.shape).astype(np.float32)
        base = w.value
        vals = []
        for sign in (1, -1):
            w.value = base + sign * eps * d
            with tfl.Session(lazy=False) as t:
                vals.append(float(tfl.mean((model(t.input(x)) - t.input(y)) ** 2)))
        w.value = base
        fd = (vals[0] - vals[1]) / (2 * eps)
        np.testing.assert_allclose(np.sum(got[3] * d), fd, rtol=2e-2, atol=1e-5)

    @pytest.mark.usefixtures("loops")
    def test_reading_an_intermediate_value_computes_it_in_the_loop(self):
        model = Stack(2, jax.random.key(5))
        x, _ = _batch(6)
        with tfl.Session(lazy=True) as s:
            hs = model.hidden(s.input(x))
            got = [np.asarray(h.value) for h in hs]
        with tfl.Session(lazy=False) as s:
            want = [np.asarray(h.value) for h in model.hidden(s.input(x))]
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    @pytest.mark.usefixtures("loops")
    def test_gradients_of_an_interior_node_are_swept_node_by_node(self):
        model = Stack(2, jax.random.key(6))
        x, _ = _batch(7)
        out = {}
        for lazy in (True, False):
            with tfl.Session(lazy=lazy) as s:
                hs = model.hidden(s.input(x))
                loss = tfl.sum(hs[-1] * hs[-1])
                g = s.backward(loss, wrt=[hs[1], hs[2]])
                out[lazy] = [np.asarray(g[hs[1]]), np.asarray(g[hs[2]])]
        for a, b in zip(out[True], out[False]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    @pytest.mark.usefixtures("loops")
    def test_dropout_in_every_block_draws_as_the_unrolled_program(self):
        def run(loop: bool) -> list[np.ndarray]:
            tfl.set_block_loops(loop)
            model = Stack(2, jax.random.key(7))
            s = tfl.Session(lazy=True, seed=3)
            x, _ = _batch(8)
            with s:
                h = model.proj(s.input(x))
                for b in model.blocks:
                    h = tfl.dropout(b(h), 0.25)
                g = s.backward(tfl.sum(h))
                return [np.asarray(g[p]) for b in model.blocks for p in b.parameters()]

        for a, b in zip(run(True), run(False)):
            np.testing.assert_array_equal(a, b)


class TestOneFunctionPerBlock:
    def test_the_program_traces_each_block_once(self):
        """The outer program holds one call per block, whatever the block's size: its length grows by a few
        equations per block, not by the block's ops."""

        def outer_eqns(layers: int, loop: bool) -> int:
            nodes = _recording(layers)
            pending = frozenset(_pending(nodes))
            given = [nd.value for i, nd in enumerate(nodes) if i not in pending]
            runs = _blocks.find_runs(nodes, pending) if loop else ()
            jaxpr = jax.make_jaxpr(lambda g: _blocks.Forward(nodes, pending, g, runs, "test").values[-1])(given)
            return len(jaxpr.jaxpr.eqns)

        loop2, loop6 = outer_eqns(2, True), outer_eqns(6, True)
        flat2, flat6 = outer_eqns(2, False), outer_eqns(6, False)
        assert loop6 - loop2 == 4  # one call per block
        assert flat6 - flat2 > 4 * 15  # every op of every block


class TestSwitch:
    def test_set_block_loops_returns_the_previous_setting_and_checks_its_argument(self):
        before = tfl.set_block_loops(False)
        try:
            assert _blocks.block_loops_enabled() is False
            assert tfl.set_block_loops(True) is False
            with pytest.raises(TypeError, match="set_block_loops: expected True or False, got 1"):
                tfl.set_block_loops(1)  # type: ignore[arg-type]
            assert _blocks.block_loops_enabled() is True
        finally:
            tfl.set_block_loops(before)

    def test_the_environment_turns_it_off_in_a_new_process(self):
        import os
        import subprocess
        import sys

        code = "import tapeflow as tfl; print(tfl.set_block_loops(True))"
        env = {**os.environ, "TAPEFLOW_BLOCK_LOOPS": "0"}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "False", out.stderr

    @pytest.mark.parametrize("text, want", [("off", False), ("No", False), ("", True), ("1", True), ("on", True)])
    def test_the_switchs_values(self, monkeypatch: pytest.MonkeyPatch, text: str, want: bool):
        from tapeflow._core._env import switch

        monkeypatch.setenv("TAPEFLOW_BLOCK_LOOPS", text)
        assert switch("TAPEFLOW_BLOCK_LOOPS", True) is want

    def test_another_value_is_refused_naming_the_values_it_takes(self, monkeypatch: pytest.MonkeyPatch):
        from tapeflow._core._env import switch

        monkeypatch.setenv("TAPEFLOW_BLOCK_LOOPS", "sometimes")
        with pytest.raises(ValueError, match=r"TAPEFLOW_BLOCK_LOOPS='sometimes' is not a switch: set it to 0 / false"):
            switch("TAPEFLOW_BLOCK_LOOPS", True)


def _loss_fn(model: Stack):
    def loss_fn(s: tfl.Session, x: np.ndarray, y: np.ndarray) -> tfl.Tensor:
        return tfl.mean((model(s.input(x)) - s.input(y)) ** 2)

    return loss_fn


def _calls(jaxpr: jax.extend.core.Jaxpr) -> dict[str, int]:
    """How many calls of a block's forward (``block``) and reverse sweep (``step``) ``jaxpr`` makes, nested
    programs included."""
    found: dict[str, int] = {}
    for e in jaxpr.eqns:
        if e.primitive.name in ("pjit", "jit"):
            name = e.params["name"]
            if name in ("block", "step"):
                found[name] = found.get(name, 0) + 1
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            for k, v in _calls(sub).items():
                found[k] = found.get(k, 0) + v
    return found


def _train_step(loop: bool, tx: optax.GradientTransformation, steps: int = 2) -> tuple[list[float], list[np.ndarray]]:
    """``train_step``'s training with block loops on or off when it is traced."""
    before = tfl.set_block_loops(loop)
    try:
        model = Stack(2, jax.random.key(1))
        step = tfl.train_step(_loss_fn(model), tfl.Optimizer(tx, model))
        losses = [float(step(*_batch(k))) for k in range(steps)]
        return losses, [np.asarray(p.value) for p in model.parameters()]
    finally:
        tfl.set_block_loops(before)


class TestTracedSessions:
    """``train_step`` and ``value_and_grad`` compute each op as they record it (on tracers); their reverse
    sweep of a repeated block is traced once."""

    def test_train_step_equals_its_unrolled_program_bit_for_bit_and_the_lazy_loop(self):
        loop_losses, loop_params = _train_step(True, optax.adam(1e-2))
        flat_losses, flat_params = _train_step(False, optax.adam(1e-2))
        assert loop_losses == flat_losses
        for a, b in zip(loop_params, flat_params):
            np.testing.assert_array_equal(a, b)
        sgd_losses, sgd_params = _train_step(True, optax.sgd(0.1))
        lazy_losses, lazy_params = _train(loop=True, lazy=True, tx=optax.sgd(0.1))
        np.testing.assert_allclose(sgd_losses, lazy_losses, rtol=1e-5)
        for a, b in zip(sgd_params, lazy_params):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    def test_value_and_grads_reverse_sweep_calls_one_function_per_block(self):
        def block_calls(layers: int, loop: bool) -> tuple[int, list[np.ndarray]]:
            model = Stack(layers, jax.random.key(3))
            params = model.param_dict()
            f = tfl.value_and_grad(_loss_fn(model))
            x, y = _batch(4)
            before = tfl.set_block_loops(loop)
            try:
                traced = jax.jit(f).trace(params, x, y)
            finally:
                tfl.set_block_loops(before)
            _, grads = traced.lower().compile()(params, x, y)
            return _calls(traced.jaxpr.jaxpr), [np.asarray(g) for g in jax.tree_util.tree_leaves(grads)]

        for layers in (2, 3):
            n_loop, g_loop = block_calls(layers, True)
            n_flat, g_flat = block_calls(layers, False)
            assert (n_loop, n_flat) == ({"block": layers, "step": layers}, {})
            for a, b in zip(g_loop, g_flat):
                np.testing.assert_array_equal(a, b)

    @pytest.mark.usefixtures("loops")
    def test_value_and_grad_with_an_input_every_block_reads_equals_an_op_by_op_session(self):
        """Cotangents of a shared Param that every block reads are summed over the blocks, as unrolled."""
        model = Stack(3, jax.random.key(8))
        memory = tfl.Param(jnp.linspace(-1.0, 1.0, DIM, dtype=jnp.float32), name="memory")
        x, y = _batch(9)

        def loss_fn(s: tfl.Session, x: np.ndarray, y: np.ndarray) -> tfl.Tensor:
            m = s.use(memory)
            h = model.proj(s.input(x))
            for b in model.blocks:
                h = b(h * m)
            return tfl.mean((model.head(h) - s.input(y)) ** 2)

        params = {"memory": memory, **model.param_dict()}
        traced = jax.jit(tfl.value_and_grad(loss_fn)).trace(params, x, y)
        assert _calls(traced.jaxpr.jaxpr) == {"block": 3, "step": 3}  # the case under test is a loop
        loss, grads = traced.lower().compile()(params, x, y)
        with tfl.Session(lazy=False) as s:
            want_loss = loss_fn(s, x, y)
            want = s.backward(want_loss)
            np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
            for k, p in params.items():
                np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(want[p]), rtol=2e-5, atol=1e-6, err_msg=k)
