"""Rematerialization: ``tfl.checkpoint(block)`` records one node per output and recomputes the block in backward.

Oracles: the same block recorded without checkpoint (gradients must agree to
float64 rounding), ``jax.grad`` of the equivalent pure JAX function, and
``jax.live_arrays()`` for the memory claim. The suite runs with x64 on, so
dtypes are explicit.
"""

from __future__ import annotations

import gc
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import PATHS, one_step

import tapeflow as tfl
from tapeflow import TapeError

F64 = np.float64
RTOL = 1e-12

# Every test ends with gc.collect() (below) and several collect inside: each walks only what this module made.
pytestmark = pytest.mark.usefixtures("small_gc_heap_for_module")


@pytest.fixture(autouse=True)
def _registry_left_as_found():
    """Every wrapper of a test is gone after it, and so is its op: the registry is left as it was."""
    before = set(tfl.REGISTRY)
    yield
    gc.collect()
    left = sorted(n for n in set(tfl.REGISTRY) - before if n.startswith("checkpoint:"))
    assert not left, f"checkpoint ops still registered after the test: {left}"


def close(a, b, rtol=RTOL, atol=1e-13):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def _arr(shape, seed, dtype=F64):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _ops(s: tfl.Session) -> list[str | None]:
    return [nd.op for nd in s.tape]


# --------------------------------------------------------------------------- a model with tied weights


class _Model:
    """Two residual tanh layers sharing ``emb``'s storage: inside the block (as ``w_in``) and outside it."""

    def __init__(self) -> None:
        self.emb = tfl.Param(_arr((4, 4), 1), name="emb")
        self.w_in = tfl.tie(self.emb, name="w_in")
        self.b = tfl.Param(_arr((4,), 2), name="b")
        self.v = tfl.Param(_arr((4, 3), 3), name="v")
        self.frozen = tfl.Param(_arr((4,), 4), name="frozen", trainable=False)

    def block(self, h):
        z = tfl.tanh(h @ self.w_in + self.b) * self.frozen
        return h + z @ self.emb.T  # the tied storage twice inside the block

    def params(self) -> dict[str, tfl.Param]:
        return {"emb": self.emb, "b": self.b, "v": self.v}

    def all_params(self) -> dict[str, tfl.Param]:
        return {**self.params(), "frozen": self.frozen}  # what a traced value_and_grad must be given

    def loss(self, block, x):
        h = x @ self.emb  # the tied storage outside the block too
        h = block(block(h))
        return tfl.sum(tfl.tanh(h @ self.v) ** 2.0)

    def pure(self, p, x, frozen):
        def blk(h):
            z = jnp.tanh(h @ p["emb"] + p["b"]) * frozen
            return h + z @ p["emb"].T

        h = blk(blk(x @ p["emb"]))
        return jnp.sum(jnp.tanh(h @ p["v"]) ** 2)


def test_gradients_equal_the_plain_recording_and_jax_grad():
    m = _Model()
    ck = tfl.checkpoint(m.block)
    x0 = _arr((5, 4), 5)
    results = {}
    for name, block in (("plain", m.block), ("checkpoint", ck)):
        with tfl.Session() as s:
            x = s.input(x0, requires_grad=True)
            loss = m.loss(block, x)
            g = s.backward(loss)
            results[name] = (float(loss), g[x], {k: g[p] for k, p in m.params().items()}, _ops(s))
            assert m.frozen not in g  # frozen inside the block: no gradient, as without checkpoint
    ref_loss = m.pure({k: p.value for k, p in m.params().items()}, x0, m.frozen.value)
    ref_g, ref_gx = jax.grad(m.pure, argnums=(0, 1))({k: p.value for k, p in m.params().items()}, x0, m.frozen.value)
    for loss, gx, gp, _ in results.values():
        close(loss, ref_loss)
        close(gx, ref_gx)
        for k in gp:
            close(gp[k], ref_g[k])
            close(gp[k], results["plain"][2][k])
    ops = results["checkpoint"][3]
    assert ops.count(ck.op_name) == 2 and "add" not in ops and ops.count("tanh") == 1  # one node per call
    assert ck.trace_count == 1


def test_the_block_node_keeps_only_inputs_params_and_output():
    m = _Model()
    ck = tfl.checkpoint(m.block)
    with tfl.Session() as s:
        h = s.input(_arr((5, 4), 6), requires_grad=True)
        y = ck(h)
        nd = y.node
        parents = [s.tape[i] for i in nd.parents]
        assert nd.op == ck.op_name and len(s.tape) == 1 + 4  # h, three storages (emb, b, frozen), y
        assert [p.op for p in parents] == [None] * 4
        groups = s.parameter_groups()
        assert [g.storage for g in groups] == [m.emb.storage, m.b.storage]  # frozen: not a trainable group
        assert parents[1].requires_grad and not parents[3].requires_grad


def test_stop_gradient_and_hand_written_vjps_inside_the_block_are_kept():
    """The recomputation is differentiated with tapeflow's VJPs, not jax.vjp of the forward kernels."""
    w = tfl.Param(jnp.asarray([0.0, 1.0, -2.0], F64), name="w")

    def block(h):
        return tfl.relu(h * w) + tfl.stop_gradient(h * w) * h  # relu at exactly 0; no gradient through stop

    grads = []
    for b in (block, tfl.checkpoint(block)):
        with tfl.Session() as s:
            x = s.input(jnp.asarray([1.0, 2.0, 3.0], F64), requires_grad=True)
            g = s.backward(tfl.sum(b(x)))
            grads.append((g[x], g[w]))
    close(grads[0][0], grads[1][0])
    close(grads[0][1], grads[1][1])
    close(grads[1][1], [0.0, 2.0, 0.0])  # only relu's VJP reaches w: x * (h*w > 0)


def test_several_outputs_record_one_node_each():
    w = tfl.Param(_arr((3, 3), 7), name="w")

    def block(h):
        a = tfl.tanh(h @ w)
        return a, tfl.sum(a * h, axis=1), h  # the last one is the input itself

    ck = tfl.checkpoint(block)
    x0 = _arr((2, 3), 8)

    def loss(b, x):
        a, r, h = b(x)
        return tfl.sum(a**2.0) + tfl.sum(r) * 3.0 + tfl.sum(h * h)

    out = {}
    for name, b in (("plain", block), ("checkpoint", ck)):
        with tfl.Session() as s:
            x = s.input(x0, requires_grad=True)
            res = b(x)
            assert isinstance(res, tuple) and len(res) == 3
            g = s.backward(loss(b, x))
            out[name] = (g[x], g[w])
            if name == "checkpoint":
                assert [r.op for r in res] == [ck.op_name] * 3
                close(res[2].value, x0)

    def pure(wv, x):
        a = jnp.tanh(x @ wv)
        return jnp.sum(a**2) + jnp.sum(jnp.sum(a * x, axis=1)) * 3.0 + jnp.sum(x * x)

    gw, gx = jax.grad(pure, argnums=(0, 1))(w.value, x0)
    for name in out:
        close(out[name][0], gx)
        close(out[name][1], gw)


def test_inside_value_and_grad_and_jit_equal_eager():
    m = _Model()
    ck = tfl.checkpoint(m.block)
    x0 = _arr((5, 4), 9)

    def loss_fn(block):
        return lambda s, x: m.loss(block, x)

    ref = tfl.value_and_grad(loss_fn(m.block))(m.all_params(), x0)
    for f in (tfl.value_and_grad(loss_fn(ck)), jax.jit(tfl.value_and_grad(loss_fn(ck)))):
        v, g = f(m.all_params(), x0)
        close(v, ref[0])
        for k in g:
            close(g[k], ref[1][k])
    assert ck.trace_count == 1  # the eager-shaped trace serves the compiled calls too


def test_train_step_equals_the_uncheckpointed_step():
    finals = []
    for use_ck in (False, True):
        m = _Model()
        block = tfl.checkpoint(m.block) if use_ck else m.block
        opt = tfl.Optimizer(optax.sgd(0.05), list(m.params().values()))
        step = tfl.train_step(lambda s, x: m.loss(block, x), opt)
        losses = [float(step(_arr((5, 4), 10 + i))) for i in range(3)]
        finals.append((losses, [p.value for p in m.params().values()]))
    close(finals[0][0], finals[1][0], rtol=1e-10)
    for a, b in zip(finals[0][1], finals[1][1]):
        close(a, b, rtol=1e-10)


# --------------------------------------------------------------------------- memory


def _live_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


def test_a_checkpointed_32_layer_mlp_keeps_fewer_live_bytes_with_equal_gradients():
    width, batch, depth = 256, 256, 32
    keys = jax.random.split(jax.random.key(0), depth)
    layers = [tfl.nn.Linear(width, width, key=k, dtype=np.float32) for k in keys]
    x0 = jax.random.normal(jax.random.key(1), (batch, width), np.float32)
    plain = lambda h, layer: tfl.tanh(layer(h))  # noqa: E731
    ck = tfl.checkpoint(plain)

    def forward(block):
        h = s.input(x0)
        for layer in layers:
            h = block(h, layer)
        return tfl.mean(h * h)

    measured, grads = {}, {}
    for name, block in (("plain", plain), ("checkpoint", ck)):
        with tfl.Session(lazy=False) as s:  # eager: the forward's values exist once it is recorded
            s.backward(forward(block)).release()  # warm-up: kernels compiled, caches filled
            s.reset()
            before = _live_bytes()
            loss = forward(block)
            measured[name] = _live_bytes() - before  # after the forward is recorded, before backward
            g = s.backward(loss)
            grads[name] = [np.asarray(g[p]) for layer in layers for p in (layer.weight, layer.bias)]
    act = batch * width * 4  # bytes of one activation
    print(f"live bytes after the forward: plain {measured['plain']}, checkpointed {measured['checkpoint']}")
    assert measured["plain"] >= 2 * depth * act  # linear and tanh per layer
    assert measured["checkpoint"] <= depth * act + 4 * act  # the block outputs (and the loss)
    assert measured["checkpoint"] < 0.6 * measured["plain"]
    for a, b in zip(grads["plain"], grads["checkpoint"]):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)
    assert ck.trace_count == depth  # each layer is a static argument: one trace (and kernel) per layer


# --------------------------------------------------------------------------- randomness


def test_random_draws_inside_a_block_are_the_same_in_forward_and_recomputation():
    w = tfl.Param(jnp.arange(1.0, 7.0, dtype=F64).reshape(2, 3), name="w")
    ck = tfl.checkpoint(lambda h: tfl.dropout(h * w, 0.5))
    x0 = jnp.asarray(np.linspace(0.5, 1.5, 6).reshape(2, 3), F64)
    with tfl.Session(seed=3) as s:
        x = s.input(x0, requires_grad=True)
        y1 = ck(x)
        assert s.rng_counter == 1  # one key per call
        y2 = ck(x)
        g = s.backward(tfl.sum(y1))
        y1v = np.asarray(y1.value)
        kept = y1v != 0
        assert 0 < kept.sum() < kept.size and not np.array_equal(kept, np.asarray(y2.value) != 0)
        close(y1.value, np.where(kept, x0 * w.value * 2.0, 0.0))
        close(g[w], np.where(kept, x0 * 2.0, 0.0))  # the recomputation drew the forward's mask
        close(g[x], np.where(kept, w.value * 2.0, 0.0))
    with tfl.Session(seed=3) as s:  # the same seed reproduces the draws
        close(ck(s.input(x0)).value, y1v)
    with tfl.Session(seed=3, grad_enabled=False) as s:  # PyTorch's F.dropout drops in inference too: the same draw
        y = ck(s.input(x0))
        close(y.value, y1v)
        assert s.rng_counter == 1 and not y.requires_grad
    assert ck.trace_count == 2


def test_random_draws_inside_train_step_follow_the_step_key():
    w = tfl.Param(jnp.ones((4,), F64), name="w")
    ck = tfl.checkpoint(lambda h: tfl.dropout(h * w, 0.5))
    opt = tfl.Optimizer(optax.sgd(0.1), [w])
    step = tfl.train_step(lambda s, x: tfl.sum(ck(x)), opt, seed=5)
    x = jnp.arange(1.0, 5.0, dtype=F64)
    loss = float(step(x))
    # gradient of sum(where(mask, x * w * 2, 0)) wrt w is where(mask, 2x, 0): w moved exactly where it was kept
    moved = np.asarray(w.value) != 1.0
    close(loss, float(np.sum(np.where(moved, np.asarray(x) * 2.0, 0.0))))
    close(w.value, np.where(moved, 1.0 - 0.1 * 2.0 * np.asarray(x), 1.0))


# --------------------------------------------------------------------------- Params read later, not baked in


def test_a_param_read_only_under_a_new_static_argument_becomes_an_operand():
    w = tfl.Param(jnp.asarray([1.0, 2.0], F64), name="w")
    b = tfl.Param(jnp.asarray([0.5, -0.5], F64), name="b")
    ck = tfl.checkpoint(lambda h, use_b: h * w + b if use_b else h * w)
    with tfl.Session() as s:
        x = s.input(jnp.ones(2, F64))
        ck(x, False)
        y = ck(x, True)
        assert ck.trace_count == 2 and len(y.node.parents) == 3
        close(s.backward(tfl.sum(y))[b], [1.0, 1.0])
    b.value = jnp.asarray([10.0, 20.0], F64)  # a new value is read, never a constant of the kernel
    with tfl.Session() as s:
        close(ck(s.input(jnp.ones(2, F64)), True).value, [11.0, 22.0])


def test_a_param_not_in_params_is_refused_by_value_and_grad_and_passed_by_train_step():
    w = tfl.Param(jnp.asarray([1.0, 2.0], F64), name="w")
    scale = tfl.Param(jnp.asarray(3.0, F64), name="scale", trainable=False)
    ck = tfl.checkpoint(lambda h: h * w * scale)
    with pytest.raises(TapeError, match="not in params"):
        jax.jit(tfl.value_and_grad(lambda s, x: tfl.sum(ck(x))))({"w": w}, jnp.ones(2, F64))
    opt = tfl.Optimizer(optax.sgd(0.0), [w])
    step = tfl.train_step(lambda s, x: tfl.sum(ck(x)), opt)
    close(step(jnp.ones(2, F64)), 9.0)
    scale.value = jnp.asarray(5.0, F64)
    close(step(jnp.ones(2, F64)), 15.0)  # the new value is a runtime argument of the program


def test_a_block_that_reads_other_params_when_recomputed_is_refused():
    w = tfl.Param(jnp.asarray([1.0, 2.0], F64), name="w")
    extra = tfl.Param(jnp.asarray([3.0, 4.0], F64), name="extra")
    state = {"use_extra": False}
    ck = tfl.checkpoint(lambda h: h * w * extra if state["use_extra"] else h * w)
    with tfl.Session(lazy=False) as s:  # eager: the forward ran before the change, the recomputation sees it
        y = ck(s.input(jnp.ones(2, F64), requires_grad=True))
        state["use_extra"] = True  # Python state the first trace fixed
        tfl.clear_kernel_caches()  # so that backward traces the block again
        with pytest.raises(
            TapeError, match=r"checkpoint\(.*<lambda>\): while recomputed for backward, the block read other"
        ):
            s.backward(tfl.sum(y))


def test_a_lazy_block_that_reads_other_params_before_its_forward_is_computed_is_refused():
    w = tfl.Param(jnp.asarray([1.0, 2.0], F64), name="w")
    extra = tfl.Param(jnp.asarray([3.0, 4.0], F64), name="extra")
    state = {"use_extra": False}
    ck = tfl.checkpoint(lambda h: h * w * extra if state["use_extra"] else h * w)
    with tfl.Session(lazy=True) as s:  # lazy: the forward is compiled only after the change, and sees it
        y = ck(s.input(jnp.ones(2, F64), requires_grad=True))
        state["use_extra"] = True  # Python state the first trace fixed
        tfl.clear_kernel_caches()  # so that the lazy program traces the block again
        with pytest.raises(
            TapeError, match=r"checkpoint\(.*<lambda>\): while its forward was compiled, the block read other"
        ):
            s.backward(tfl.sum(y))


# --------------------------------------------------------------------------- errors


def _snapshot(s: tfl.Session):
    return s.tape, len(s.tape), s.rng_counter, [(g.id, g.leaves) for g in s.parameter_groups()]


def _unchanged(s, before):
    after = _snapshot(s)
    assert after[0] is before[0] and after[1:] == before[1:]


def test_a_failing_block_raises_a_tape_error_naming_it_and_records_nothing():
    w = tfl.Param(jnp.ones((3, 2), F64), name="w")

    def my_block(h):
        z = tfl.tanh(h @ w)
        return z @ w  # (n, 2) @ (3, 2): a shape error inside

    ck = tfl.checkpoint(my_block)
    with tfl.Session() as s:
        x = s.input(jnp.ones((4, 3), F64), requires_grad=True)
        _ = s.normal((2,))
        before = _snapshot(s)
        with pytest.raises(
            TapeError, match=r"checkpoint\(.*my_block\): the block failed on operands #0 float64\[4,3\].*matmul"
        ):
            ck(x)
        _unchanged(s, before)
        with pytest.raises(TapeError, match=r"checkpoint\(.*my_block\).*(stale|different session)"):
            ck(_stale_handle())
        _unchanged(s, before)
        drawing = tfl.checkpoint(lambda h: tfl.dropout(h, 0.5) @ w @ w, name="drawing")
        with pytest.raises(TapeError, match=r"checkpoint\(drawing\): the block failed"):
            drawing(x)
        _unchanged(s, before)  # the RNG counter included
    assert ck.trace_count == 0


def _stale_handle() -> tfl.Tensor:
    s = tfl.Session()
    h = s.input(jnp.ones((4, 3), F64))
    s.reset()
    return h


@pytest.mark.parametrize(
    ("block", "match"),
    [
        (lambda h: h.value, r"output 0 of the block is ArrayImpl"),
        (lambda h: (), r"returned no Tensor"),
        (lambda h: (h * 2.0, 3.0), r"output 1 of the block is float"),
        (lambda h: h.shape, r"output 0 of the block is int"),
    ],
    ids=["array", "empty", "number", "shape"],
)
def test_a_block_must_return_tensors_it_computed(block, match):
    ck = tfl.checkpoint(block)
    with tfl.Session() as s:
        x = s.input(jnp.ones(2, F64))
        before = _snapshot(s)
        with pytest.raises(TapeError, match=match):
            ck(x)
        _unchanged(s, before)


def test_a_block_closing_over_an_outer_tensor_is_refused():
    with tfl.Session() as s:
        mask = s.input(jnp.asarray([1.0, 0.0], F64))
        x = s.input(jnp.ones(2, F64))
        before = _snapshot(s)
        with pytest.raises(TapeError, match="different session"):  # mixed with the block's own Tensor
            tfl.checkpoint(lambda h: h * mask)(x)
        _unchanged(s, before)
        with pytest.raises(TapeError, match="pass every Tensor the block uses as an argument"):
            tfl.checkpoint(lambda h: mask * 2.0)(x)  # recorded on the outer session: refused, never used


def test_unhashable_static_arguments_are_refused():
    ck = tfl.checkpoint(lambda h, cfg: h * cfg["k"])
    with tfl.Session() as s:
        x = s.input(jnp.ones(2, F64))
        before = _snapshot(s)
        with pytest.raises(TapeError, match=r"argument leaf 1 \(set\) is neither a Tensor, an array nor hashable"):
            ck(x, {1.0})
        _unchanged(s, before)
        close(ck(x, {"k": 2.0}).value, [2.0, 2.0])  # a dict of hashable leaves is fine (static)


def test_the_op_is_checked_like_any_other():
    ck = tfl.checkpoint(lambda h: h * 2.0)
    with tfl.Session() as s:
        x = s.input(jnp.ones(2, F64))
        ck(x)
        with pytest.raises(TapeError, match="trace=5 is not a trace"):
            s.apply(ck.op_name, x, trace=5)
        with pytest.raises(TapeError, match="traced for operands #0 float64\\[2\\]"):
            s.apply(ck.op_name, s.input(jnp.ones(3, F64)), trace=0)


# --------------------------------------------------------------------------- caching and lifetime


def test_second_call_reuses_the_compiled_kernels():
    m = _Model()
    ck = tfl.checkpoint(m.block)
    x0 = _arr((5, 4), 11)
    with tfl.Session() as s:
        s.backward(m.loss(ck, s.input(x0, requires_grad=True))).release()
    before = tfl.kernel_cache_info()
    with tfl.Session() as s:
        s.backward(m.loss(ck, s.input(x0 + 1.0, requires_grad=True))).release()
    assert tfl.kernel_cache_info() == before
    assert ck.trace_count == 1


def test_inline_wrappers_stay_registered_while_their_recording_lives():
    w = tfl.Param(jnp.asarray([1.0, 2.0], F64), name="w")

    def block(h):
        return tfl.sin(h * w)

    with tfl.Session() as s:
        x = s.input(jnp.ones(2, F64), requires_grad=True)
        y = tfl.checkpoint(block)(x)  # the wrapper is not kept by the caller
        assert tfl.checkpoint(block) is tfl.checkpoint(block)  # one wrapper per live block
        name = y.op
        gc.collect()
        assert name in tfl.REGISTRY
        close(s.backward(tfl.sum(y))[w], np.cos(np.asarray(w.value)))
    del x, y, s
    gc.collect()
    assert name not in tfl.REGISTRY  # the wrapper and its recording are gone: so is the op


def test_checkpoint_refuses_what_is_not_callable():
    with pytest.raises(TypeError, match="checkpoint expects a function"):
        tfl.checkpoint(3)


# --------------------------------------------------------------------------- inputs that are arrays


def test_array_arguments_are_constant_operands():
    w = tfl.Param(jnp.asarray([1.0, 2.0], F64), name="w")
    ck = tfl.checkpoint(lambda h, m: h * w * m)
    with tfl.Session() as s:
        x = s.input(jnp.ones(2, F64), requires_grad=True)
        y = ck(x, np.asarray([3.0, 4.0]))
        y2 = ck(x, jnp.asarray([5.0, 6.0], F64))  # a new value of an array is not a new trace
        g = s.backward(tfl.sum(y) + tfl.sum(y2))
        close(g[w], [8.0, 10.0])
        close(g[x], [8.0, 20.0])
    assert ck.trace_count == 1


# --------------------------------------------------------------------------- higher order and forward mode


def test_second_order_and_forward_mode_through_a_checkpointed_block():
    w = tfl.Param(jnp.asarray([0.3, -0.7], F64), name="w")
    ck = tfl.checkpoint(lambda h: tfl.sin(h * w) * h)
    x0 = jnp.asarray([1.0, 2.0], F64)

    def f(wv, x):
        return jnp.sum(jnp.sin(x * wv) * x)

    with tfl.Session() as s:
        x = s.input(x0, requires_grad=True)
        y = tfl.sum(ck(x))
        gx = s.backward(y, create_graph=True)[x]
        close(gx.value, jax.grad(f, argnums=1)(w.value, x0))
        h = s.backward(tfl.sum(gx * gx))
        penalty = lambda wv, x: jnp.sum(jax.grad(f, argnums=1)(wv, x) ** 2)  # noqa: E731
        close(h[x], jax.grad(penalty, argnums=1)(w.value, x0))
        close(h[w], jax.grad(penalty, argnums=0)(w.value, x0))
        tw = jnp.asarray([1.0, 0.0], F64)
        close(s.jvp(y, {x: jnp.ones(2, F64), w: tw}), jax.jvp(f, (w.value, x0), (tw, jnp.ones(2, F64)))[1])


def test_a_wrapper_made_inside_a_traced_loss_fn_works():
    w = tfl.Param(jnp.asarray([1.0, 2.0], F64), name="w")

    def block(h):
        return tfl.tanh(h * w)

    f = jax.jit(tfl.value_and_grad(lambda s, x: tfl.sum(tfl.checkpoint(block)(x))))
    x0 = jnp.asarray([0.5, -0.5], F64)
    for _ in range(2):
        v, g = f({"w": w}, x0)
        gc.collect()
        close(v, jnp.sum(jnp.tanh(x0 * w.value)))
        close(g["w"], jax.grad(lambda wv: jnp.sum(jnp.tanh(x0 * wv)))(w.value))


def test_checkpointed_blocks_nest():
    w = tfl.Param(jnp.asarray([0.3, -0.7], F64), name="w")
    inner = tfl.checkpoint(lambda h: tfl.sin(h * w))
    outer_block = lambda h: inner(h) * h + inner(h * 2.0)  # noqa: E731
    outer = tfl.checkpoint(outer_block)
    x0 = jnp.asarray([1.0, 2.0], F64)
    grads = []
    for b in (outer_block, outer):
        with tfl.Session() as s:
            x = s.input(x0, requires_grad=True)
            g = s.backward(tfl.sum(b(x)))
            grads.append((g[x], g[w]))
        if b is outer:
            assert len(s.tape) == 0  # (reset on exit) the outer recording held x, w and one node

    def f(wv, x):
        return jnp.sum(jnp.sin(x * wv) * x + jnp.sin(2.0 * x * wv))

    for gx, gw in grads:
        close(gx, jax.grad(f, argnums=1)(w.value, x0))
        close(gw, jax.grad(f, argnums=0)(w.value, x0))


def test_rational_operands_are_refused():
    from fractions import Fraction

    ck = tfl.checkpoint(lambda h: h * 2)
    with tfl.Session() as s:
        x = s.input(jnp.ones(2, F64))
        with pytest.raises(TapeError, match="exact rational operands are not supported"):
            ck(x, np.array([Fraction(1, 3)], dtype=object))


def test_a_collected_wrapper_unregisters_its_op_and_tolerates_one_removed_by_hand(monkeypatch):
    from tapeflow._core import _registry as R

    kept, gone = tfl.checkpoint(lambda h: h * 2.0), tfl.checkpoint(lambda h: h * 3.0)
    names = kept.op_name, gone.op_name
    assert all(tfl.REGISTRY[n].user for n in names)
    R.unregister(gone.op_name)
    raised = []
    monkeypatch.setattr(sys, "unraisablehook", raised.append)  # what a failing finalizer would report
    del kept, gone
    gc.collect()
    assert not set(names) & set(tfl.REGISTRY) and not raised


# --------------------------------------------------------------------------- mixed precision and state

F32 = np.float32
BF16 = np.dtype(jnp.bfloat16)


def _f32(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * 0.5, F32)


@pytest.mark.parametrize("path", PATHS)
def test_a_block_under_a_compute_dtype_records_and_recomputes_under_the_same_policy(path):
    results = {}
    for name in ("plain", "checkpoint"):
        w, b, v = tfl.Param(_f32((4, 4), 1)), tfl.Param(_f32((4,), 2)), tfl.Param(_f32((4, 3), 3))

        def block(h, w=w, b=b):
            return h + tfl.tanh(h @ w + b)

        blk = tfl.checkpoint(block) if name == "checkpoint" else block
        seen = []

        def loss_fn(s, blk=blk, v=v, seen=seen):
            h = blk(blk(s.input(_f32((5, 4), 4))))
            seen.append(h.dtype)
            return tfl.mean(tfl.tanh(h @ v) ** 2.0)

        opt = tfl.Optimizer(optax.sgd(0.5), [w, b, v])
        loss = one_step(path, loss_fn, opt, compute_dtype=jnp.bfloat16)
        assert seen == [BF16] and loss.dtype == F32
        if name == "checkpoint":
            assert blk.trace_count == 2  # a float32 input, then the first block's bfloat16 output
        results[name] = [float(loss)] + [np.asarray(p.value) for p in (w, b, v)]
        assert all(r.dtype == F32 for r in results[name][1:])  # float32 master weights
    # the same casts; a compiled block may keep bfloat16 intermediates wider: about one bfloat16 ulp per update
    np.testing.assert_allclose(results["checkpoint"][0], results["plain"][0], rtol=2e-2)
    for a, c in zip(results["checkpoint"][1:], results["plain"][1:]):
        np.testing.assert_allclose(a, c, atol=0.5 * 2e-2)


def test_a_block_traces_once_per_policy():
    w = tfl.Param(_f32((3, 3), 5))
    ck = tfl.checkpoint(lambda h: tfl.tanh(h @ w))
    x = _f32((2, 3), 6)
    dtypes = []
    for dt in (None, jnp.bfloat16, None, jnp.float16):
        with tfl.Session(compute_dtype=dt) as s:
            dtypes.append(ck(s.input(x)).dtype)
    assert dtypes == [np.dtype(F32), BF16, np.dtype(F32), np.dtype(np.float16)]
    assert ck.trace_count == 3


@pytest.mark.parametrize("path", PATHS)
def test_a_checkpointed_train_mode_batchnorm_is_refused_with_nothing_written(path):
    bn = tfl.nn.BatchNorm1d(3)
    ck = tfl.checkpoint(lambda h: bn(h))
    opt = tfl.Optimizer(optax.sgd(0.1), [bn.weight, bn.bias])
    cells = (bn.running_mean, bn.running_var, bn.num_batches_tracked, bn.weight, bn.bias)
    before = [np.asarray(p.value).copy() for p in cells]
    x = _f32((4, 3), 7)
    with pytest.raises(TapeError, match=r"running_mean.*written inside checkpoint\(.*<lambda>\).*cannot update state"):
        one_step(path, lambda s: tfl.sum(ck(s.input(x))), opt)
    for p, old in zip(cells, before):
        np.testing.assert_array_equal(np.asarray(p.value), old)
    bn.eval()  # what the message offers: in eval mode the block writes no state and is accepted
    one_step(path, lambda s: tfl.sum(ck(s.input(x))), opt)
    assert int(bn.num_batches_tracked.value) == 0
