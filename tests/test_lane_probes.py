"""Adversarial probes of lanes: a lazy session must behave exactly as an eager one, step after step.

Each probe runs the same step body on a lazy and on an eager session (each over its own, identically
initialized model) for several steps and compares everything the body observed: values read mid-step,
gradients, parameters after every step, optimizer state, RNG counter, and errors (type and message).
Lanes start on the third recording of a structure, so every probe runs at least 6 steps and does
its "unusual" thing at a step >= 3.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _probes import F32, arr, compare, model

import tapeflow as tfl
from tapeflow import nn

RNG = np.random.default_rng(7)
X = RNG.normal(size=(8, 4)).astype(F32)
Y = RNG.integers(0, 3, size=8).astype(np.int32)
STEPS = 6


# ---------------------------------------------------------------------------------------------- harness


def forward(s, m, x=X):
    h = tfl.tanh(tfl.apply("linear", s.input(x), m.W1, m.b1))
    logits = h @ m.W2
    return h, logits, tfl.cross_entropy(logits, s.input(Y))


def run(body, lazy, steps=STEPS, build=model, catch=(Exception,)):
    m = build()
    s = tfl.Session(lazy=lazy, seed=0)
    m.s = s
    log = []
    for step in range(steps):
        try:
            with s:
                body(s, step, m, log)
        except catch as e:
            log.append(("error", step, *describe(e)))
        log.append(("params", step, [arr(p.value) for p in m.params]))
        log.append(("rng", step, s.rng_counter, s.generation))
        log.append(("opt", step, [arr(v) for v in jax.tree_util.tree_leaves(m.opt.state)]))
    return log


def describe(e):
    """An error as compared: its type and message (storage numbers differ between the two runs' models).

    A lazy session's check_finite refusal is a TapeError without the eager NonFiniteError's origin
    explanation (documented: a lazy session would have to recompute the forward to explain it), so a
    NonFiniteError is compared by its first line as a TapeError."""
    import re

    msg = re.sub(r"storage=#\d+", "storage=#N", str(e))
    if isinstance(e, tfl.NonFiniteError):
        return "TapeError", msg.split("\n")[0]
    return type(e).__name__, msg


@pytest.fixture
def lanes(lane_counts):
    """Counts of lane backwards taken and of lanes built into nodes (lazy session): conftest's counter."""
    return lane_counts


def same(body, lanes=None, **kw):
    """Eager and lazy logs of ``body`` are equal; returns the lazy log."""
    e = run(body, False, **kw)
    if lanes is not None:
        lanes.update(backward=0, built=0)
    z = run(body, True, **kw)
    compare(z, e)
    return z


def plain_step(s, step, m, log):
    _, _, loss = forward(s, m)
    m.opt.step(s.backward(loss))
    log.append(("loss", step, float(loss)))


# ---------------------------------------------------------------------------------------------- probes: reads


def test_plain_loop_runs_on_lanes(lanes):
    same(plain_step, lanes)
    assert lanes["backward"] >= 3


READS = {
    "float": lambda s, h: float(tfl.sum(h)),
    "value": lambda s, h: arr(h.value),
    "tolist": lambda s, h: h.tolist(),
    "asarray": lambda s, h: np.asarray(h),
    "repr": lambda s, h: (repr(h), str(h)),
    "s_value": lambda s, h: arr(s.value(h)),
    "s_node": lambda s, h: arr(s.node(h).value),
    "recording_len": lambda s, h: (len(s.recording), s.recording[h.id].op, s.recording[h.id].shape),
    "tape_value": lambda s, h: arr(s.tape[h.id].value),
    "param_leaf": lambda s, h: arr(s.recording.nodes[1].value),
    "handle_parents": lambda s, h: [s.handle(i).op for i in h.node.parents],
    "materialize": lambda s, h: (s.materialize(), arr(h.value))[1],
    "repr_session": lambda s, h: repr(s).split(",", 1)[1],
    "input_value_type": lambda s, h: (type(s.handle(0).value).__name__, arr(s.handle(0).value)),
    "parameter_groups": lambda s, h: [(list(g.leaves), g.parameter.name) for g in s.parameter_groups()],
    "leaf_names": lambda s, h: s.leaf_names(),
    "leaf_storages": lambda s, h: s.leaf_storages(),
    "to_dot": lambda s, h: __import__("re").sub(r"#\d+", "#N", s.to_dot()),
    "nonfinite_origin": lambda s, h: s.nonfinite_origin(tfl.sum(h)),
    "requires_grad_op": lambda s, h: (h.requires_grad, h.op, h.shape, str(h.dtype)),
}


# leaf_names / leaf_storages: {} on a lane at 4ccc3b5 (they read _params_by_leaf without building the nodes; fixed
# in e0a6c88)
@pytest.mark.parametrize("read", list(READS))
@pytest.mark.parametrize("where", ["mid", "after_backward", "after_step"])
def test_reads_at_one_step(read, where):
    fn = READS[read]

    def body(s, step, m, log):
        h, logits, loss = forward(s, m)
        if step == 4 and where == "mid":
            log.append(("read", fn(s, h)))
        g = s.backward(loss)
        if step == 4 and where == "after_backward":
            log.append(("read", fn(s, h)))
        m.opt.step(g)
        if step == 4 and where == "after_step":
            log.append(("read", fn(s, h)))
        log.append(("loss", step, float(loss)))

    same(body)


@pytest.mark.parametrize("read", ["float", "value", "s_value", "recording_len"])
def test_reads_every_step_of_the_loss_before_backward(read):
    fn = READS[read]

    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        log.append(("read", fn(s, loss) if read != "float" else float(loss)))
        m.opt.step(s.backward(loss))

    same(body)


def test_grads_read_before_and_after_step():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        g = s.backward(loss)
        if step >= 4:
            log.append(("g", [arr(g[p]) for p in m.params]))
        m.opt.step(g)
        if step == 5:
            try:
                log.append(("g_after", [arr(g[p]) for p in m.params]))
            except Exception as e:
                log.append(("g_after_err", type(e).__name__, str(e)))
        log.append(("loss", float(loss)))

    same(body)


def test_grads_kept_past_the_reset():
    def outer(s, step, m, log):
        _, _, loss = forward(s, m)
        g = s.backward(loss)
        if "g" in m.extra:
            log.append(("prev", [arr(m.extra["g"][p]) for p in m.params]))
        m.extra["g"] = g
        m.opt.step({p: jnp.ones_like(p.value) * 0.01 for p in m.params})

    same(outer)


def test_grads_params_iteration_and_manual_clip():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        g = s.backward(loss)
        norm = float(jnp.sqrt(sum(jnp.sum(v**2) for _, v in g.params())))
        log.append(("norm", norm))
        m.opt.step({p: v / max(norm, 1.0) for p, v in g.params()})
        log.append(("loss", float(loss)))

    same(body)


def test_clip_grad_norm_on_lane_grads():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        g = s.backward(loss)
        if step >= 3:
            log.append(("norm", arr(tfl.clip_grad_norm(g, 0.1))))
        m.opt.step(g)
        log.append(("loss", float(loss)))

    same(body)


# ---------------------------------------------------------------------------------------------- backward variants


def test_backward_twice_in_one_step():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        g1 = s.backward(loss)
        if step == 4:
            g2 = s.backward(loss)
            log.append(("g2", [arr(g2[p]) for p in m.params]))
        m.opt.step(g1)
        log.append(("loss", float(loss)))

    same(body)


def test_backward_twice_second_after_step():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        m.opt.step(s.backward(loss))
        if step == 4:
            import warnings

            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                g2 = s.backward(loss)
                log.append(("g2", [arr(g2[p]) for p in m.params], [type(x.message).__name__ for x in w]))
        log.append(("loss", float(loss)))

    same(body)


def test_opt_step_twice_same_grads():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        g = s.backward(loss)
        m.opt.step(g)
        if step == 4:
            m.opt.step(g)
        log.append(("loss", float(loss)))

    same(body)


def test_backward_with_seed_at_one_step():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        g = s.backward(loss, jnp.asarray(2.0, F32)) if step == 4 else s.backward(loss)
        m.opt.step(g)
        log.append(("loss", float(loss)))

    same(body)


def test_backward_of_non_scalar_raises_the_same():
    def body(s, step, m, log):
        h, _, loss = forward(s, m)
        if step == 4:
            s.backward(h)
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_backward_of_another_root():
    def body(s, step, m, log):
        h, logits, loss = forward(s, m)
        other = tfl.sum(logits * logits)
        root = other if step in (4, 5) else loss
        g = s.backward(root)
        log.append(("g", [arr(g[p]) for p in m.params] if step == 5 else None))
        m.opt.step(g)
        log.append(("loss", float(loss), float(other)))

    same(body)


def test_backward_wrt_interior_handle():
    def body(s, step, m, log):
        h, logits, loss = forward(s, m)
        if step >= 4:
            g = s.backward(loss, wrt=[logits])
            log.append(("g_logits", arr(g[logits])))
        else:
            g = s.backward(loss)
        m.opt.step(g)
        log.append(("loss", float(loss)))

    same(body)


def test_backward_wrt_non_grad_handle_raises_the_same():
    def body(s, step, m, log):
        xi = s.input(X)
        h = tfl.tanh(tfl.apply("linear", xi, m.W1, m.b1))
        loss = tfl.cross_entropy(h @ m.W2, s.input(Y))
        g = s.backward(loss, wrt=[xi]) if step == 4 else s.backward(loss)
        m.opt.step(g)
        log.append(("loss", float(loss)))

    same(body)


def test_tensor_ops_on_handles_after_backward():
    def body(s, step, m, log):
        h, logits, loss = forward(s, m)
        g = s.backward(loss)
        if step >= 3:
            more = tfl.sum(h * 2.0) + loss
            log.append(("more", float(more)))
        m.opt.step(g)
        log.append(("loss", float(loss)))

    same(body)


def test_create_graph_backward_at_one_step():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        if step == 4:
            g = s.backward(loss, create_graph=True)
            log.append(("g", [arr(g[p].value) for p in m.params]))
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_inference_session_no_backward_error():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        log.append(("loss", float(loss)))
        if step == 4:
            s.backward(loss)

    def build():
        return model()

    e_m, z_m = build(), build()
    for lazy, mm in ((False, e_m), (True, z_m)):
        s = tfl.Session(lazy=lazy, grad_enabled=False)
        mm.log = []
        for step in range(STEPS):
            try:
                with s:
                    body(s, step, mm, mm.log)
            except Exception as e:
                mm.log.append((type(e).__name__, str(e)))
    compare(z_m.log, e_m.log)


# ---------------------------------------------------------------------------------------------- params


def test_param_written_after_backward_before_step():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        g = s.backward(loss)
        if step == 4:
            m.W2.value = m.W2.value + 1.0
        m.opt.step(g)
        log.append(("loss", float(loss)))

    same(body)


def test_freeze_a_param_at_one_step():
    def body(s, step, m, log):
        m.W1.trainable = step != 4
        _, _, loss = forward(s, m)
        g = s.backward(loss)
        log.append(("g", arr(g[m.W2])))
        m.opt.step(g)
        log.append(("loss", float(loss)))

    same(body)


def test_freeze_after_use_before_backward():
    def body(s, step, m, log):
        m.W1.trainable = True
        _, _, loss = forward(s, m)
        if step == 4:
            m.W1.trainable = False
        g = s.backward(loss)
        m.opt.step(g)
        log.append(("loss", float(loss)))

    same(body)


def test_param_use_added_at_one_step():
    def body(s, step, m, log):
        _, logits, loss = forward(s, m)
        if step == 4:
            loss = loss + tfl.sum(m.W1 * m.W1) * 0.1
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_tie_at_one_step():
    def build():
        m = model()
        m.T = tfl.tie(m.W1, name="T")
        m.opt = tfl.Optimizer(optax.adam(1e-2), [*m.params, m.T])
        return m

    def body(s, step, m, log):
        h, logits, loss = forward(s, m)
        if step in (4, 5):
            loss = loss + tfl.mean(tfl.apply("linear", s.input(X), m.T, m.b1))
        g = s.backward(loss)
        log.append(("gW1", arr(g[m.W1]), arr(g[m.T])))
        m.opt.step(g)
        log.append(("loss", float(loss)))

    same(body, build=build)


def two_optimizers():
    """:func:`model` with two optimizers over disjoint Params: adam over W1 and b1, sgd over W2."""
    m = model()
    m.opt = tfl.Optimizer(optax.adam(1e-2), [m.W1, m.b1])
    m.opt2 = tfl.Optimizer(optax.sgd(0.1), [m.W2])
    return m


def test_two_optimizers_disjoint_params_same_step():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        g = s.backward(loss)
        m.opt.step(g)
        if step != 4:
            m.opt2.step(g)
        log.append(("loss", float(loss)))
        log.append(("opt2", [arr(v) for v in jax.tree_util.tree_leaves(m.opt2.state)]))

    same(body, build=two_optimizers)


def test_two_optimizers_reverse_order_at_one_step():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        g = s.backward(loss)
        if step == 4:
            m.opt2.step(g)
            m.opt.step(g)
        else:
            m.opt.step(g)
            m.opt2.step(g)
        log.append(("loss", float(loss)))

    same(body, build=two_optimizers)


def test_optimizer_over_subset_of_used_params():
    def build():
        m = model()
        m.opt = tfl.Optimizer(optax.adam(1e-2), [m.W1, m.b1])
        return m

    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body, build=build)


def test_optax_exception_mid_chain_changes_nothing():
    class Boom(Exception):
        pass

    def build():
        calls = {"n": 0}

        def update(updates, state, params=None):
            calls["n"] += 1
            return updates, state

        def boom_update(updates, state, params=None):
            if calls.get("boom"):
                raise Boom("boom")
            return updates, state

        tx = optax.chain(optax.adam(1e-2), optax.GradientTransformation(lambda p: optax.EmptyState(), boom_update))
        m = model(tx)
        m.calls = calls
        return m

    def body(s, step, m, log):
        m.calls["boom"] = step == 4
        _, _, loss = forward(s, m)
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body, build=build)


def test_set_hyperparams_between_lane_steps():
    def build():
        return model(optax.inject_hyperparams(optax.adam)(learning_rate=1e-2))

    def body(s, step, m, log):
        if step == 4:
            m.opt.set_hyperparams(learning_rate=0.5)
        _, _, loss = forward(s, m)
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body, build=build)


# ---------------------------------------------------------------------------------------------- inputs and modes


def test_no_grad_block_at_one_step():
    def body(s, step, m, log):
        h, logits, loss = forward(s, m)
        if step == 4:
            with s.no_grad():
                probe = tfl.sum(logits)
            log.append(("probe", float(probe), probe.requires_grad))
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_forward_under_no_grad_at_one_step():
    def body(s, step, m, log):
        if step == 4:
            with s.no_grad():
                _, _, loss = forward(s, m)
        else:
            _, _, loss = forward(s, m)
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_input_requires_grad_at_one_step():
    def body(s, step, m, log):
        xi = s.input(X, requires_grad=step == 4)
        loss = tfl.cross_entropy(tfl.tanh(tfl.apply("linear", xi, m.W1, m.b1)) @ m.W2, s.input(Y))
        g = s.backward(loss)
        if step == 4:
            log.append(("gx", arr(g[xi])))
        m.opt.step(g)
        log.append(("loss", float(loss)))

    same(body)


KINDS = {
    "numpy": lambda: X,
    "jax": lambda: jnp.asarray(X),
    "list": lambda: X.tolist(),
    "f64": lambda: X.astype(np.float64),
    "jax_f64": lambda: jnp.asarray(X.astype(np.float64)),
    "tensor": None,
}


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "tensor"])
def test_input_kind_changes_at_one_step(kind):
    def body(s, step, m, log):
        x = KINDS[kind]() if step == 4 else X
        try:
            _, _, loss = forward(s, m, x)
            m.opt.step(s.backward(loss))
            log.append(("loss", float(loss), str(loss.dtype)))
        except Exception as e:
            log.append(("err", type(e).__name__, str(e)))

    same(body)


@pytest.mark.parametrize("kind", ["numpy", "jax", "list"])
def test_input_kind_every_step(kind):
    def body(s, step, m, log):
        _, _, loss = forward(s, m, KINDS[kind]())
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_python_float_scalar_input():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        scale = s.input(0.5 if step != 4 else 2.0)
        loss = loss * scale
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss), str(scale.dtype)))

    same(body)


def test_python_int_scalar_input_with_float_dtype_change():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        scale = s.input(2 if step == 4 else 2.0)
        try:
            loss = loss * scale
            log.append(("dtype", str(loss.dtype)))
        except Exception as e:
            log.append(("err", type(e).__name__, str(e)))
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_input_values_change_same_structure():
    def body(s, step, m, log):
        x = X * (step + 1)
        _, _, loss = forward(s, m, x)
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_numpy_input_mutated_after_record():
    def body(s, step, m, log):
        x = X.copy()
        _, _, loss = forward(s, m, x)
        x[:] = 100.0  # the input was copied when recorded
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_batch_shape_changes_then_back():
    def body(s, step, m, log):
        n = 5 if step == 4 else 8
        xi = s.input(X[:n])
        loss = tfl.cross_entropy(tfl.tanh(tfl.apply("linear", xi, m.W1, m.b1)) @ m.W2, s.input(Y[:n]))
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_scalar_operand_int_vs_float_vs_bool():
    def body(s, step, m, log):
        _, logits, loss = forward(s, m)
        k = {4: 1, 5: True}.get(step, 1.0)
        loss = loss * k
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss), str(loss.dtype)))

    same(body)


def test_jax_array_operand_to_op():
    def body(s, step, m, log):
        _, logits, loss = forward(s, m)
        c = jnp.full((3,), 0.5 + 0.1 * step, F32)
        loss = loss + tfl.sum(logits * c)
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_numpy_array_operand_to_op():
    def body(s, step, m, log):
        _, logits, loss = forward(s, m)
        c = np.full((3,), 0.5 + 0.1 * step, F32)
        loss = loss + tfl.sum(logits * c)
        c[:] = 99.0
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_numpy_float64_operand_to_op():
    def body(s, step, m, log):
        _, logits, loss = forward(s, m)
        c = np.full((3,), 0.5, np.float64 if step == 4 else F32)
        try:
            loss = loss + tfl.sum(logits * c)
            log.append(("dtype", str(loss.dtype)))
        except Exception as e:
            log.append(("err", type(e).__name__, str(e)))
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_shape_error_at_one_step_then_continue():
    def body(s, step, m, log):
        h, logits, loss = forward(s, m)
        if step == 4:
            try:
                tfl.apply("linear", h, m.W1)
            except tfl.TapeError as e:
                log.append(("err", str(e), len(s.recording)))
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_shape_error_at_first_op_on_lane():
    def body(s, step, m, log):
        xi = s.input(X)
        if step == 4:
            try:
                tfl.apply("linear", xi, m.W2, m.b1)
            except tfl.TapeError as e:
                log.append(("err", str(e), len(s.recording)))
        loss = tfl.cross_entropy(tfl.tanh(tfl.apply("linear", xi, m.W1, m.b1)) @ m.W2, s.input(Y))
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_exception_propagating_out_of_step():
    def body(s, step, m, log):
        h, logits, loss = forward(s, m)
        if step == 4:
            raise RuntimeError("user error mid-step")
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_exception_after_backward_before_step():
    def body(s, step, m, log):
        h, logits, loss = forward(s, m)
        g = s.backward(loss)
        if step == 4:
            raise RuntimeError("after backward")
        m.opt.step(g)
        log.append(("loss", float(loss)))

    same(body)


def test_type_error_operand_on_lane():
    def body(s, step, m, log):
        h, logits, loss = forward(s, m)
        if step == 4:
            try:
                tfl.mul(logits, "x")
            except Exception as e:
                log.append(("err", type(e).__name__, str(e), len(s.recording)))
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


# ---------------------------------------------------------------------------------------------- hooks


def test_tensor_hook_at_one_step():
    def body(s, step, m, log):
        h, logits, loss = forward(s, m)
        if step == 4:
            h.register_hook(lambda g: g * 3.0)
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_tensor_hook_removed_before_backward():
    def body(s, step, m, log):
        h, logits, loss = forward(s, m)
        if step == 4:
            r = h.register_hook(lambda g: g * 3.0)
            r.remove()
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_param_hook_at_one_step():
    def body(s, step, m, log):
        r = m.W2.register_hook(lambda g: g * 0.0) if step == 4 else None
        try:
            _, _, loss = forward(s, m)
            g = s.backward(loss)
            log.append(("g", arr(g[m.W2])))
            m.opt.step(g)
            log.append(("loss", float(loss)))
        finally:
            if r is not None:
                r.remove()

    same(body)


def test_param_hook_registered_after_backward():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        g = s.backward(loss)
        r = m.W2.register_hook(lambda g: g * 0.0) if step == 4 else None
        m.opt.step(g)
        if r is not None:
            r.remove()
        log.append(("loss", float(loss)))

    same(body)


def test_param_hook_registered_mid_forward():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        r = m.W2.register_hook(lambda g: g * 0.0) if step == 4 else None
        try:
            m.opt.step(s.backward(loss))
        finally:
            if r is not None:
                r.remove()
        log.append(("loss", float(loss)))

    same(body)


def test_hook_raising_keyboard_interrupt():
    def body(s, step, m, log):
        h, logits, loss = forward(s, m)
        if step == 4:

            def hook(g):
                raise KeyboardInterrupt("stop")

            h.register_hook(hook)
        try:
            g = s.backward(loss)
        except KeyboardInterrupt as e:
            log.append(("kbi", str(e), len(s.recording)))
            g = None
        if g is not None:
            m.opt.step(g)
        log.append(("loss", float(loss)))

    same(body)


def test_param_hook_raising_keyboard_interrupt():
    def body(s, step, m, log):
        def hook(g):
            raise KeyboardInterrupt("param stop")

        r = m.W1.register_hook(hook) if step == 4 else None
        try:
            _, _, loss = forward(s, m)
            try:
                g = s.backward(loss)
                m.opt.step(g)
            except KeyboardInterrupt as e:
                log.append(("kbi", str(e)))
            log.append(("loss", float(loss)))
        finally:
            if r is not None:
                r.remove()

    same(body)


# ---------------------------------------------------------------------------------------------- reset, handles


def test_reset_mid_lane_then_old_handle():
    def body(s, step, m, log):
        h, logits, loss = forward(s, m)
        if step == 4:
            s.reset()
            for fn in (lambda: float(loss), lambda: tfl.exp(h), lambda: s.backward(loss), lambda: s.value(h)):
                try:
                    fn()
                    log.append("no error")
                except Exception as e:
                    log.append(("err", type(e).__name__, str(e)))
            _, _, loss = forward(s, m)
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_stale_handle_from_last_step_on_lane():
    def body(s, step, m, log):
        h, logits, loss = forward(s, m)
        if step == 4:
            old = m.extra["h"]
            for fn in (lambda: tfl.sum(old), lambda: float(old), lambda: old.value, lambda: s.backward(old)):
                try:
                    fn()
                    log.append("no error")
                except Exception as e:
                    log.append(("err", type(e).__name__, str(e)))
        m.extra["h"] = h
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_stale_grads_and_values_after_reset():
    def body(s, step, m, log):
        h, logits, loss = forward(s, m)
        g = s.backward(loss)
        if step == 4:
            s.reset()
            try:
                log.append(("g", [arr(g[p]) for p in m.params]))
            except Exception as e:
                log.append(("err", type(e).__name__, str(e)))
            try:
                m.opt.step(g)
                log.append("stepped")
            except Exception as e:
                log.append(("err", type(e).__name__, str(e)))
        else:
            m.opt.step(g)

    same(body)


def test_reset_after_step_then_read_loss():
    def body(s, step, m, log):
        h, logits, loss = forward(s, m)
        m.opt.step(s.backward(loss))
        if step == 4:
            s.reset()
            try:
                log.append(("loss", float(loss)))
            except Exception as e:
                log.append(("err", type(e).__name__, str(e)))
        else:
            log.append(("loss", float(loss)))

    same(body)


def test_foreign_handle_into_lane():
    def body(s, step, m, log):
        other = m.extra.setdefault("other", tfl.Session(lazy=s.lazy))
        with other:
            foreign = other.input(X)
            xi = s.input(X)
            try:
                if step == 4:
                    tfl.apply("linear", foreign, m.W1, m.b1)
            except Exception as e:
                log.append(("err", type(e).__name__, str(e).replace(f"owner {other.owner}", "OTHER")))
        h = tfl.tanh(tfl.apply("linear", xi, m.W1, m.b1))
        loss = tfl.cross_entropy(h @ m.W2, s.input(Y))
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    def norm(log):
        # owner ids differ between the two runs: compare the messages without them
        import re

        return [
            (x[0], x[1], re.sub(r"owner \d+|session \d+|#\d+", "N", x[2]))
            if isinstance(x, tuple) and x[0] == "err"
            else x
            for x in log
        ]

    e = run(body, False)
    z = run(body, True)
    compare(norm(z), norm(e))


def test_foreign_backward_on_lane_session():
    def body(s, step, m, log):
        other = m.extra.setdefault("other", tfl.Session(lazy=s.lazy))
        h, logits, loss = forward(s, m)
        if step == 4:
            try:
                other.backward(loss)
            except Exception as e:
                log.append(("err", type(e).__name__))
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_handle_of_last_step_reused_as_input():
    def body(s, step, m, log):
        _, logits, loss = forward(s, m)
        prev = m.extra.get("loss_value")
        m.opt.step(s.backward(loss))
        m.extra["loss_value"] = float(loss)
        log.append(("loss", float(loss), prev))

    same(body)


# ---------------------------------------------------------------------------------------------- sessions


def test_two_lazy_sessions_same_params_interleaved_one_step():
    def both(lazy):
        m = model()
        a, b = tfl.Session(lazy=lazy), tfl.Session(lazy=lazy)
        log = []
        for step in range(STEPS):
            with a:
                _, _, la = forward(a, m)
                if step == 4:
                    with b:
                        _, _, lb = forward(b, m)
                        m.opt.step(b.backward(lb))
                        log.append(("lb", float(lb)))
                m.opt.step(a.backward(la))
                log.append(("la", float(la)))
            log.append([arr(p.value) for p in m.params])
        return log

    compare(both(True), both(False))


def test_same_params_two_sessions_alternate_steps():
    def both(lazy):
        m = model()
        a, b = tfl.Session(lazy=lazy), tfl.Session(lazy=lazy)
        log = []
        for step in range(STEPS * 2):
            s = a if step % 3 else b
            with s:
                _, _, loss = forward(s, m)
                m.opt.step(s.backward(loss))
                log.append(float(loss))
        log.append([arr(p.value) for p in m.params])
        return log

    compare(both(True), both(False))


def test_debug_nans_toggled_at_one_step():
    def body(s, step, m, log):
        s.debug_nans = step == 4
        _, _, loss = forward(s, m)
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_debug_nans_toggled_mid_step():
    def body(s, step, m, log):
        s.debug_nans = False
        h, _, loss = forward(s, m)
        if step == 4:
            s.debug_nans = True
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_grad_enabled_toggled_at_one_step():
    def body(s, step, m, log):
        s.grad_enabled = step != 4
        _, _, loss = forward(s, m)
        try:
            m.opt.step(s.backward(loss))
        except Exception as e:
            log.append(("err", type(e).__name__, str(e)))
        log.append(("loss", float(loss)))

    same(body)


def test_grad_enabled_toggled_mid_step():
    def body(s, step, m, log):
        s.grad_enabled = True
        _, _, loss = forward(s, m)
        if step == 4:
            s.grad_enabled = False
        try:
            m.opt.step(s.backward(loss))
        except Exception as e:
            log.append(("err", type(e).__name__, str(e)))
        log.append(("loss", float(loss)))
        s.grad_enabled = True

    same(body)


def test_dropout_at_some_steps():
    def body(s, step, m, log):
        xi = s.input(X)
        h = tfl.tanh(tfl.apply("linear", xi, m.W1, m.b1))
        h = tfl.dropout(h, 0.5, training=step in (4, 5))
        loss = tfl.cross_entropy(h @ m.W2, s.input(Y))
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss), s.rng_counter))

    same(body)


def test_dropout_every_step():
    def body(s, step, m, log):
        xi = s.input(X)
        h = tfl.dropout(tfl.tanh(tfl.apply("linear", xi, m.W1, m.b1)), 0.3, training=True)
        loss = tfl.cross_entropy(h @ m.W2, s.input(Y))
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss), s.rng_counter))

    same(body)


def test_set_rng_state_between_steps():
    def body(s, step, m, log):
        if step == 4:
            s.set_rng_state(counter=0)
        xi = s.input(X)
        h = tfl.dropout(tfl.tanh(tfl.apply("linear", xi, m.W1, m.b1)), 0.3, training=True)
        loss = tfl.cross_entropy(h @ m.W2, s.input(Y))
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss), s.rng_counter))

    same(body)


def test_checkpoint_block_at_some_steps():
    def body(s, step, m, log):
        xi = s.input(X)

        def block(x):
            return tfl.tanh(tfl.apply("linear", x, m.W1, m.b1))

        ck = m.extra.setdefault("ck", tfl.checkpoint(block))  # one wrapper: the same op every step
        h = ck(xi) if step >= 3 else block(xi)
        loss = tfl.cross_entropy(h @ m.W2, s.input(Y))
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_jvp_mid_step():
    def body(s, step, m, log):
        xi = s.input(X, requires_grad=True)
        h = tfl.tanh(tfl.apply("linear", xi, m.W1, m.b1))
        loss = tfl.cross_entropy(h @ m.W2, s.input(Y))
        if step == 4:
            log.append(("jvp", arr(s.jvp(loss, {xi: np.ones_like(X)}))))
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_state_write_at_one_step():
    def build():
        m = model()
        m.cell = tfl.Param(np.zeros(3, F32), name="cell", trainable=False)
        m.params.append(m.cell)
        return m

    def body(s, step, m, log):
        h, logits, loss = forward(s, m)
        if step == 4:
            s.assign_state(m.cell, tfl.mean(logits, axis=0))
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body, build=build)


def test_state_write_then_failed_step_is_undone():
    def build():
        m = model()
        m.opt = tfl.Optimizer(optax.adam(1e-2), m.params, check_finite=True)
        m.cell = tfl.Param(np.zeros(3, F32), name="cell", trainable=False)
        m.params.append(m.cell)
        return m

    def body(s, step, m, log):
        x = X.copy()
        if step == 5:
            x[0, 0] = np.inf
        h, logits, loss = forward(s, m, x)
        s.assign_state(m.cell, tfl.mean(logits * 0.0, axis=0) + float(step))
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body, build=build)


# ---------------------------------------------------------------------------------------------- nn modules


def nn_model(kind):
    def build():
        k1, k2 = jax.random.split(jax.random.key(0))
        lin1, lin2 = nn.Linear(4, 6, key=k1), nn.Linear(6, 3, key=k2)
        norm = {"ln": nn.LayerNorm(6), "bn": nn.BatchNorm1d(6)}[kind]
        mods = [lin1, norm, lin2]
        params = []
        for mod in mods:
            params += [p for _, p in mod.parameter_records()]
        # sgd: Adam would amplify the rounding noise of the (nearly zero) bias gradients before a BatchNorm
        opt = tfl.Optimizer(optax.sgd(0.1), [p for p in params if p.trainable])
        return types.SimpleNamespace(lin1=lin1, norm=norm, lin2=lin2, params=params, opt=opt, extra={})

    return build


def nn_forward(s, m):
    h = tfl.relu(m.norm(m.lin1(s.input(X))))
    return tfl.cross_entropy(m.lin2(h), s.input(Y))


def test_batchnorm_train_eval_switching():
    def body(s, step, m, log):
        if step in (3, 5):
            m.norm.eval()
        else:
            m.norm.train()
        loss = nn_forward(s, m)
        if step in (3, 5):
            log.append(("eval_loss", float(loss)))
        else:
            m.opt.step(s.backward(loss))
            log.append(("loss", float(loss)))

    same(body, build=nn_model("bn"), steps=9)


def test_batchnorm_eval_loop_then_train():
    def body(s, step, m, log):
        if step < 5:
            m.norm.eval()
        else:
            m.norm.train()
        loss = nn_forward(s, m)
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body, build=nn_model("bn"), steps=8)


# ---------------------------------------------------------------------------------------------- functional interop


def test_value_and_grad_between_lazy_steps():
    def body(s, step, m, log):
        if step == 4:

            def loss_fn(ss):
                return forward(ss, m)[2]

            v, g = tfl.value_and_grad(loss_fn)({})
            log.append(("vg", float(v)))
        _, _, loss = forward(s, m)
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_value_and_grad_inside_a_lazy_step():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        if step == 4:
            v, g = tfl.value_and_grad(lambda ss: forward(ss, m)[2])({})
            log.append(("vg", float(v)))
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_train_step_between_lazy_steps():
    def body(s, step, m, log):
        if step in (4, 5):
            ts = m.extra.setdefault("ts", tfl.train_step(lambda ss: forward(ss, m)[2], m.opt))
            log.append(("ts", float(ts())))
        _, _, loss = forward(s, m)
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_checkpoint_save_restore_between_steps(tmp_path):
    def body(s, step, m, log):
        path = tmp_path / f"ck_{s.lazy}"
        if step == 3:
            tfl.save(path, m.params, m.opt, s)
        if step == 5:
            tfl.restore(path, m.params, m.opt, s)
        _, _, loss = forward(s, m)
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


# ---------------------------------------------------------------------------------------------- leaves outside apply


def test_input_leaf_where_the_outline_used_a_param(lanes):
    """Failed at 4ccc3b5 (fixed in e0a6c88): the lane backward took the outline's parameter groups, so W1 (not
    used at step 5) was updated with the input's gradient."""

    def body(s, step, m, log):
        if step == 5:  # an input of W1's shape, dtype and requires_grad, where the outline has s.use(W1)
            w = s.input(np.ones((4, 5), F32), requires_grad=True)
        else:
            w = s.use(m.W1)
        loss = tfl.cross_entropy(tfl.tanh(s.input(X) @ w) @ m.W2, s.input(Y))
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body, lanes)


def test_unregistered_leaf_where_the_outline_registered_one():
    """Failed at 4ccc3b5, fixed in e0a6c88 (``W1 in g`` was True on the lane at step 5)."""

    def body(s, step, m, log):
        w = s.input(np.asarray(m.W1.value), requires_grad=True)
        if step != 5:
            s.register_parameter_leaf(w, m.W1, m.W1.storage)
        loss = tfl.cross_entropy(tfl.tanh(s.input(X) @ w) @ m.W2, s.input(Y))
        g = s.backward(loss)
        log.append(("has_W1", m.W1 in g))
        m.opt.step(g)
        log.append(("loss", float(loss)))

    same(body)


def test_input_leaf_after_an_eval_step_where_the_plan_used_a_param():
    def body(s, step, m, log):
        w = s.use(m.W1) if step < 4 else s.input(np.ones((4, 5), F32), requires_grad=True)
        loss = tfl.cross_entropy(tfl.tanh(s.input(X) @ w) @ m.W2, s.input(Y))
        if step == 4:  # forward only: no backward re-plans the outline
            log.append(("eval", float(loss)))
            return
        g = s.backward(loss)
        log.append(("has_W1", m.W1 in g))
        m.opt.step(g)
        log.append(("loss", float(loss)))

    same(body)


def test_param_storage_repointed_at_an_eval_step():
    def body(s, step, m, log):
        if step == 4:  # W1 re-pointed at a new storage of its shape and dtype, the optimizer started afresh
            m.W1.storage = tfl.Param(np.asarray(m.W1.value) * 0.5).storage
            m.opt.reinit()
        _, _, loss = forward(s, m)
        if step == 4:  # forward only: no backward re-plans the outline
            log.append(("eval", float(loss)))
            return
        g = s.backward(loss)
        try:
            log.append(("gW1", arr(g[m.W1])))
        except Exception as e:
            log.append(("err", describe(e)))
        m.opt.step(g)
        log.append(("loss", float(loss)))

    same(body)


def test_s_use_every_step(lanes):
    def body(s, step, m, log):
        w = s.use(m.W1)
        loss = tfl.cross_entropy(tfl.tanh(s.input(X) @ w) @ m.W2, s.input(Y))
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body, lanes)


def test_grads_api_on_lane_grads():
    def body(s, step, m, log):
        xi = s.input(X)
        _, logits, loss = forward(s, m)
        g = s.backward(loss)
        if step >= 4:
            log.append(("len", len(g), m.W1 in g, xi in g, logits in g, sorted(iter(g))))
            log.append(("norm", arr(g.global_norm())))
            log.append(("scaled", arr((g * 2.0)[m.W2]), arr((g / 2.0)[m.b1]), arr((g + g)[m.W1])))
            for key in (xi, logits, loss):
                try:
                    log.append(arr(g[key]))
                except Exception as e:
                    log.append(("err", type(e).__name__, str(e)))
            log.append(repr(g).replace(str(s.owner), "O"))
        m.opt.step(g)
        log.append(("loss", float(loss)))

    same(body)


def test_grads_release_then_step():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        g = s.backward(loss)
        if step == 4:
            g.release()
        m.opt.step(g)
        log.append(("loss", float(loss)))

    same(body)


def test_grads_context_manager_on_lane():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        with s.backward(loss) as g:
            m.opt.step(g)
        log.append(("loss", float(loss)))

    same(body)


def test_use_from_another_thread_on_lane():
    import threading

    def body(s, step, m, log):
        h, _, loss = forward(s, m)
        g = s.backward(loss)
        if step == 4:
            got = []

            def other():
                for fn in (lambda: float(loss), lambda: s.value(loss), lambda: s.backward(loss), lambda: tfl.exp(h)):
                    try:
                        fn()
                        got.append("no error")
                    except Exception as e:
                        got.append(type(e).__name__)

            t = threading.Thread(target=other)
            t.start()
            t.join()
            log.append(("thread", got))
        m.opt.step(g)
        log.append(("loss", float(loss)))
        if step == 5:
            got = []
            t = threading.Thread(target=lambda: got.append(_try(lambda: float(loss))))
            t.start()
            t.join()
            log.append(("thread_after_step", got))

    same(body)


def _try(fn):
    try:
        fn()
        return "no error"
    except Exception as e:
        return type(e).__name__


# ---------------------------------------------------------------------------------------------- more ops on lanes


def test_multi_operand_and_multi_output_ops_on_lanes(lanes):
    def body(s, step, m, log):
        h, logits, loss = forward(s, m)
        a, b = tfl.chunk(h, 2, dim=0) if hasattr(tfl, "chunk") else (h[:4], h[4:])
        parts = tfl.split(logits, [1, 2], dim=1)
        cat = tfl.concat([a, b, h], axis=0)
        st = tfl.stack([logits, logits * 2.0], dim=0)
        w = tfl.where(logits > 0.0, logits, logits * 0.1)
        loss = loss + tfl.mean(cat) + tfl.mean(st) + tfl.sum(parts[1]) * 0.1 + tfl.mean(w)
        g = s.backward(loss)
        if step == 5:
            log.append(("g", [arr(g[p]) for p in m.params]))
        m.opt.step(g)
        log.append(("loss", float(loss)))

    same(body, lanes)
    assert lanes["backward"] >= 2


def test_param_updated_by_another_optimizer_between_two_uses():
    def build():
        m = model()
        m.opt = tfl.Optimizer(optax.adam(1e-2), [m.W1, m.b1, m.W2])
        m.other = tfl.Optimizer(optax.sgd(0.5), [m.W1])
        return m

    def body(s, step, m, log):
        xi = s.input(X)
        a = tfl.tanh(tfl.apply("linear", xi, m.W1, m.b1))
        if step == 4:
            m.other.step({m.W1: jnp.ones((4, 5), F32)})
        b = tfl.tanh(tfl.apply("linear", xi, m.W1, m.b1))
        loss = tfl.cross_entropy((a + b) @ m.W2, s.input(Y))
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body, build=build)


def test_grads_of_a_lane_read_two_steps_later():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        g = s.backward(loss)
        m.extra.setdefault("kept", {})[step] = (g, loss)
        if step >= 5:
            old, old_loss = m.extra["kept"][step - 2]
            log.append(("old", [arr(old[p]) for p in m.params]))
            try:
                log.append(("old_loss", float(old_loss)))
            except Exception as e:
                log.append(("err", type(e).__name__, str(e)))
        m.opt.step({p: jnp.full(p.shape, 0.01, F32) for p in m.params})

    same(body)


def test_trainable_toggled_between_backward_and_step():
    def body(s, step, m, log):
        m.W2.trainable = True
        _, _, loss = forward(s, m)
        g = s.backward(loss)
        if step == 4:
            m.W2.trainable = False
        m.opt.step(g)
        log.append(("loss", float(loss)))
        m.W2.trainable = True

    same(body)


def test_clear_kernel_caches_between_lane_steps():
    def body(s, step, m, log):
        if step == 4:
            tfl.clear_kernel_caches()
        plain_step(s, step, m, log)

    same(body)


def test_opt_reinit_between_lane_steps():
    def body(s, step, m, log):
        if step == 4:
            m.opt.reinit()
        _, _, loss = forward(s, m)
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_new_optimizer_object_at_one_step():
    def body(s, step, m, log):
        if step == 4:
            m.opt = tfl.Optimizer(optax.sgd(0.1), m.params)
        _, _, loss = forward(s, m)
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body)


def test_precision_set_after_forward_before_backward():
    from tapeflow._core._precision import Precision

    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        if step == 4:
            s.precision = Precision(jnp.float64)
        try:
            m.opt.step(s.backward(loss))
        finally:
            s.precision = None
        log.append(("loss", float(loss)))

    same(body)


def test_prefix_only_step_then_full_steps():
    def body(s, step, m, log):
        h, logits, loss = forward(s, m)
        if step == 4:
            log.append(("eval", float(loss)))
            return
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body, steps=8)


def test_empty_step_between_lane_steps():
    def body(s, step, m, log):
        if step == 4:
            return
        plain_step(s, step, m, log)

    same(body)


def test_with_block_nested_same_session_on_lane():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))
        if step == 4:
            with s:  # a nested with: resets on exit
                pass
            try:
                log.append(float(loss))
            except Exception as e:
                log.append(("err", type(e).__name__, str(e)))

    same(body)


def test_negative_zero_attribute_after_positive_zero():
    """Not lane-specific; failed at 4ccc3b5 in eager and lazy alike (attr_key keyed -0.0 as 0.0), fixed in e0a6c88."""
    xs = np.array([-1.0, 2.0], F32)
    for lazy in (False, True):
        s = tfl.Session(lazy=lazy)
        for step in range(5):
            with s:
                lo = -0.0 if step == 4 else 0.0
                with np.errstate(divide="ignore"):
                    got = np.asarray(1.0 / tfl.clamp(s.input(xs), min=lo))
                    np.testing.assert_array_equal(got, 1.0 / np.clip(xs, lo, None))


def test_check_finite_kwarg_at_one_step_refuses_then_grads_readable():
    def body(s, step, m, log):
        x = X.copy()
        if step in (4, 5):
            x[1, 1] = np.inf
        _, _, loss = forward(s, m, x)
        g = s.backward(loss)
        try:
            m.opt.step(g, check_finite=step == 4)
            log.append("stepped")
        except Exception as e:
            log.append(("refused", describe(e)))
            log.append(("readable", [bool(np.isfinite(arr(g[p])).all()) for p in m.params]))
            m.opt.step(g)  # the same gradients, unchecked
        log.append(("loss", bool(np.isfinite(float(loss)))))

    same(body)


def test_base_exception_inside_the_fused_update():
    class Stop(BaseException):
        pass

    def build():
        flag = {"on": False}

        def boom_update(updates, state, params=None):
            if flag["on"]:
                raise Stop("stop")
            return updates, state

        tx = optax.chain(optax.adam(1e-2), optax.GradientTransformation(lambda p: optax.EmptyState(), boom_update))
        m = model(tx)
        m.flag = flag
        return m

    def body(s, step, m, log):
        m.flag["on"] = step == 4
        _, _, loss = forward(s, m)
        g = s.backward(loss)
        try:
            m.opt.step(g)
        except Stop as e:
            log.append(("stop", str(e)))
            m.flag["on"] = False
            try:
                log.append(("g", [arr(g[p]) for p in m.params]))
            except Exception as e2:
                log.append(("err", describe(e2)))
        log.append(("loss", float(loss)))

    same(body, build=build)


def test_second_backward_used_first_dropped():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        g1 = s.backward(loss)
        g2 = s.backward(loss) if step == 4 else g1
        m.opt.step(g2)
        if step == 4:
            try:
                log.append(("g1", [arr(g1[p]) for p in m.params]))
            except Exception as e:
                log.append(("err", describe(e)))
        log.append(("loss", float(loss)))

    same(body)


def test_frozen_param_every_step_and_its_grads_error():
    def body(s, step, m, log):
        m.W1.trainable = False
        _, _, loss = forward(s, m)
        g = s.backward(loss)
        log.append(("in", m.W1 in g, m.W2 in g))
        if step >= 3:
            try:
                log.append(arr(g[m.W1]))
            except Exception as e:
                log.append(("err", describe(e)))
        m.opt.step(g)
        log.append(("loss", float(loss)))

    same(body)


def test_tensor_hook_registered_after_backward():
    def body(s, step, m, log):
        h, _, loss = forward(s, m)
        g = s.backward(loss)
        if step == 4:
            h.register_hook(lambda c: c * 100.0)
        m.opt.step(g)
        log.append(("loss", float(loss)))

    same(body)


def test_backward_inside_no_grad_block():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        if step == 4:
            with s.no_grad():
                g = s.backward(loss)
        else:
            g = s.backward(loss)
        m.opt.step(g)
        log.append(("loss", float(loss)))

    same(body)


@pytest.mark.parametrize("scalar", ["np32", "np64_at_4", "jnp32"])
def test_numpy_scalar_inputs(scalar):
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        v = {"np32": np.float32(0.5), "jnp32": jnp.float32(0.5)}.get(scalar, np.float32(0.5))
        if scalar == "np64_at_4" and step == 4:
            v = np.float64(0.5)
        try:
            loss = loss * s.input(v)
        except Exception as e:
            log.append(("err", describe(e)))
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss), str(loss.dtype)))

    same(body)


def test_state_write_of_an_array_on_a_lane_then_failed_step():
    def build():
        m = model()
        m.opt = tfl.Optimizer(optax.adam(1e-2), m.params, check_finite=True)
        m.cell = tfl.Param(np.zeros(3, F32), name="cell", trainable=False)
        m.params.append(m.cell)
        return m

    def body(s, step, m, log):
        x = X.copy()
        if step == 4:
            x[0, 0] = np.inf
        h, logits, loss = forward(s, m, x)
        s.assign_state(m.cell, np.full(3, float(step), F32))  # an array: nothing recorded
        loss = loss + tfl.sum(m.cell) * 0.0  # a use after the write reads the new value
        log.append(("writes", [arr(v) for v in s.state_writes.values()]))
        m.opt.step(s.backward(loss))
        log.append(("loss", float(loss)))

    same(body, build=build)


# ---------------------------------------------------------------------------------------------- a small random driver


ACTIONS_PRE = ["none", "none", "none", "write_b1", "freeze_W2", "hook_W1"]
ACTIONS_MID = ["none", "none", "none", "read_h", "recording", "tensor_hook", "s_value", "extra_op", "no_grad_probe"]
ACTIONS_BWD = ["none", "none", "read_g", "second_backward", "write_W2", "reset", "wrt_logits"]
ACTIONS_STEP = ["step", "step", "step", "skip", "twice", "mapping"]
ACTIONS_POST = ["none", "read_loss", "read_h", "new_op"]


def random_scenario(seed, steps=8):
    r = np.random.default_rng(seed)
    plan = []
    for step in range(steps):
        quiet = step < 3 or r.random() < 0.4  # some steps plain: lanes form again

        def pick(xs, quiet=quiet):
            return xs[0] if quiet else xs[r.integers(len(xs))]

        plan.append(
            (
                pick(ACTIONS_PRE),
                pick(ACTIONS_MID),
                pick(ACTIONS_BWD),
                "step" if quiet else ACTIONS_STEP[r.integers(len(ACTIONS_STEP))],
                pick(ACTIONS_POST) if not quiet else "read_loss",
            )
        )
    return plan


def scenario_body(plan):
    def body(s, step, m, log):
        pre, mid, bwd, st, post = plan[step]
        m.W2.trainable = pre != "freeze_W2"
        handle = m.W1.register_hook(lambda c: c * 0.5) if pre == "hook_W1" else None
        try:
            if pre == "write_b1":
                m.b1.value = m.b1.value + 0.05
            h, logits, loss = forward(s, m)
            if mid == "read_h":
                log.append(("h", arr(h.value)))
            elif mid == "recording":
                log.append(("rec", len(s.recording)))
            elif mid == "tensor_hook":
                h.register_hook(lambda c: c * 2.0)
            elif mid == "s_value":
                log.append(("sv", arr(s.value(logits))))
            elif mid == "extra_op":
                loss = loss + tfl.mean(h) * 0.1
            elif mid == "no_grad_probe":
                with s.no_grad():
                    log.append(("probe", float(tfl.sum(logits))))
            g = s.backward(loss, wrt=[logits]) if bwd == "wrt_logits" else s.backward(loss)
            if bwd == "read_g":
                log.append(("g", [arr(g[p]) for p in (m.W1, m.b1)]))
            elif bwd == "second_backward":
                g = s.backward(loss)
            elif bwd == "write_W2":
                m.W2.value = m.W2.value * 0.9
            elif bwd == "reset":
                s.reset()
            elif bwd == "wrt_logits":
                log.append(("gl", arr(g[logits])))
            if st == "step":
                m.opt.step(g)
            elif st == "twice":
                m.opt.step(g)
                m.opt.step(g)
            elif st == "mapping":
                m.opt.step({p: v for p, v in g.params()})
            if post == "read_loss":
                log.append(("loss", float(loss)))
            elif post == "read_h":
                log.append(("h", arr(h.value)))
            elif post == "new_op":
                log.append(("new", float(tfl.sum(h @ m.W2))))
        finally:
            if handle is not None:
                handle.remove()
            m.W2.trainable = True

    return body


@pytest.mark.parametrize("seed", range(4))
def test_random_scenarios(seed):
    same(scenario_body(random_scenario(seed)), steps=8)


def test_grads_of_the_last_step_stepped_one_step_late():
    def body(s, step, m, log):
        _, _, loss = forward(s, m)
        g = s.backward(loss)
        prev = m.extra.get("prev")
        if prev is not None:
            m.opt.step(prev)  # the last recording's gradients, after its reset and this step's forward
        m.extra["prev"] = g
        log.append(("loss", float(loss)))

    same(body)
