"""Three whole PyTorch models ported to tapeflow's PyTorch names, checked against PyTorch itself.

The models (``_torch_port_models.py``) are a MobileNet-style CNN, a ``TransformerEncoder``
classifier with a padding mask and a two-layer LSTM language model with a tied embedding;
each tapeflow model is the PyTorch source with ``torch`` replaced by ``tfl``. Each port
loads the PyTorch model's ``state_dict``, then trains three AdamW steps on three batches
in an eager session, a lazy session and a compiled ``tfl.train_step``; every step's
logits, loss and gradient of every parameter (by PyTorch's names), and every parameter
and buffer after the steps, must equal PyTorch's to float32 rounding.

PyTorch's run is made once per model (module-scoped fixture) and shared by the three paths.
"""

from __future__ import annotations

import copy
import inspect
import re
import textwrap
from dataclasses import dataclass, field

import _torch_port_models as ports
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tapeflow as tfl

torch = pytest.importorskip("torch")

STEPS = 3
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.999), 1e-8, 1e-2  # torch.optim.AdamW's defaults, but lr
PATHS = ("eager", "lazy", "train_step")

# (rtol, atol) per quantity. Measured largest differences (float32 rounding through these depths):
# logits and losses 4e-7, gradients 5e-7, values after the three AdamW steps 8e-6 (lr 1e-2 moves
# them by up to 3e-2: Adam's normalized step turns a gradient's relative rounding into lr times it)
TOL = {"logits": (1e-5, 2e-6), "loss": (1e-5, 2e-6), "grad": (1e-5, 2e-6), "after": (1e-5, 2e-5)}


# --------------------------------------------------------------------------- data


def _batches(kind: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Three (input, target) batches per model; ids and labels are int32 here (JAX's default) and int64 for PyTorch."""
    rng = np.random.default_rng({"mobilenet": 0, "transformer": 1, "lstm": 2}[kind])
    out = []
    for _ in range(STEPS):
        if kind == "mobilenet":
            x = rng.standard_normal(ports.IMAGE).astype(np.float32)
            y = rng.integers(0, ports.CLASSES, ports.IMAGE[0]).astype(np.int32)
        elif kind == "transformer":
            lengths = [ports.SEQ, 5, 2, 6]  # padding at the end of three of the four rows
            x = rng.integers(1, ports.VOCAB, (len(lengths), ports.SEQ)).astype(np.int32)
            for row, n in enumerate(lengths):
                x[row, n:] = ports.PAD
            y = rng.integers(0, ports.LABELS, len(lengths)).astype(np.int32)
        else:
            x = rng.integers(0, ports.LM_VOCAB, (3, ports.LM_SEQ)).astype(np.int32)
            y = rng.integers(0, ports.LM_VOCAB, (3, ports.LM_SEQ)).astype(np.int32)
        out.append((x, y))
    return out


CLASS_OF = {"mobilenet": "MobileNet", "transformer": "TransformerClassifier", "lstm": "LSTMLanguageModel"}


# --------------------------------------------------------------------------- the PyTorch run


@dataclass
class Run:
    """What one training run saw: per step the logits, the loss and every gradient by name; the state after."""

    logits: list[np.ndarray] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    grads: list[dict[str, np.ndarray]] = field(default_factory=list)
    after: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class Reference:
    kind: str
    untrained: object  # the PyTorch model before training (its state_dict is what the ports load)
    names: list[tuple[str, tuple[int, ...]]]  # named_parameters(): names and shapes, in PyTorch's order
    run: Run


def _torch_tensor(a: np.ndarray):
    return torch.from_numpy(a.astype(np.int64) if a.dtype.kind == "i" else a)


def _numpy(t) -> np.ndarray:
    return t.detach().numpy().copy()


def _torch_run(tmodel, kind: str) -> Run:
    """Three AdamW steps of the PyTorch model in train mode, one batch each."""
    tmodel.train()
    opt = torch.optim.AdamW(tmodel.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    run = Run()
    for x, y in _batches(kind):
        opt.zero_grad()
        logits = tmodel(_torch_tensor(x))
        loss = tmodel.loss(logits, _torch_tensor(y))
        loss.backward()
        run.logits.append(_numpy(logits))
        run.loss.append(loss.item())
        run.grads.append({n: _numpy(p.grad) for n, p in tmodel.named_parameters()})
        opt.step()
    run.after = {k: _numpy(v) for k, v in tmodel.state_dict().items()}
    return run


@pytest.fixture(scope="module", params=list(CLASS_OF))
def reference(request: pytest.FixtureRequest) -> Reference:
    kind = request.param
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tmodel = getattr(ports.torch_models(), CLASS_OF[kind])()
    untrained = copy.deepcopy(tmodel)  # deepcopy keeps the LSTM model's tie
    names = [(n, tuple(p.shape)) for n, p in tmodel.named_parameters()]
    return Reference(kind, untrained, names, _torch_run(tmodel, kind))


# --------------------------------------------------------------------------- the tapeflow runs


def _keep_gradients() -> optax.GradientTransformation:
    """Passes the gradients on unchanged and keeps them as its state (how a compiled step's gradients are read)."""

    def init(params):
        return jax.tree.map(jnp.zeros_like, params)

    def update(updates, state, params=None):
        return updates, updates

    return optax.GradientTransformation(init, update)


def _port(ref: Reference):
    model = getattr(ports, CLASS_OF[ref.kind])()
    loaded = model.load_state_dict(ref.untrained.state_dict())  # strict, as PyTorch's default
    assert loaded.missing_keys == [] and loaded.unexpected_keys == []
    return model.train()


def _tapeflow_run(model, kind: str, path: str) -> Run:
    tx = optax.chain(_keep_gradients(), optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY))
    opt = tfl.Optimizer(tx, model)
    named = model.named_parameters()
    run = Run()

    if path == "train_step":

        def loss_fn(s, x, y):
            logits = model(s.input(x))
            return model.loss(logits, s.input(y)), logits

        step = tfl.train_step(loss_fn, opt, has_aux=True)
        for x, y in _batches(kind):
            loss, logits = step(x, y)
            kept = opt.state[0]
            run.logits.append(np.asarray(logits))
            run.loss.append(float(loss))
            run.grads.append({n: np.asarray(kept[n]) for n, _ in named})
    else:
        s = tfl.Session(lazy=path == "lazy")
        for x, y in _batches(kind):
            with s:
                logits = model(s.input(x))
                loss = model.loss(logits, s.input(y))
                g = s.backward(loss)
                run.logits.append(np.asarray(logits.value))
                run.loss.append(float(loss))
                run.grads.append({n: np.asarray(g[p]) for n, p in named})
                opt.step(g)
    run.after = {k: np.asarray(v) for k, v in model.state_dict().items()}
    return run


# --------------------------------------------------------------------------- comparison


class Mismatches:
    """Every comparison of a run, the failing ones collected (one test reports all of them at once)."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.worst: dict[str, float] = {}
        self.skipped = self.entries = 0

    def check(self, what: str, kind: str, got: object, want: object, skip: np.ndarray | None = None) -> None:
        got, want = np.asarray(got), np.asarray(want)
        if got.shape != want.shape:
            self.failures.append(f"{what}: shape {got.shape}, PyTorch {want.shape}")
            return
        g, w = got.astype(np.float64), want.astype(np.float64)
        if skip is not None:
            g, w = g[~skip], w[~skip]
        rtol, atol = TOL[kind]
        err = np.abs(g - w)
        self.worst[kind] = max(self.worst.get(kind, 0.0), float(err.max(initial=0.0)))
        bad = err > atol + rtol * np.abs(w)
        if not np.all(np.isfinite(g)) or bad.any():
            self.failures.append(
                f"{what}: {int(bad.sum())} of {w.size} entries differ, max |difference| {float(err.max()):.3g} "
                f"(rtol {rtol}, atol {atol})"
            )


ADAM_FLOOR = 1e-6
"""Below this gradient magnitude AdamW's step depends on the gradient's float32 rounding (see _rounding_sensitive)."""


def _rounding_sensitive(name: str, ref: Run, run: Run) -> np.ndarray:
    """Entries whose gradient, at some step, is nonzero but below ``ADAM_FLOOR`` on either side.

    Adam's step is ``m / (sqrt(v) + eps)``: for a gradient of a few ``eps`` (1e-8) it is a
    steep function of the gradient, so a float32 rounding difference of 1e-9 (which two
    correct implementations differ by) moves it by a visible fraction of ``lr``. Such
    gradients are float noise around an exact zero (the key third of an attention
    ``in_proj_bias``: adding a constant to every key shifts a query's scores by one constant,
    which the softmax removes) or nearly so (a batch-norm scale whose channel barely reaches
    the loss). Their gradients are still compared at every step; only their values after
    the steps are not. A gradient that is exactly zero on both sides gives exactly no step
    and stays compared.
    """
    mask = np.zeros(ref.after[name].shape, bool)
    for want, got in zip(ref.grads, run.grads):
        if name in want and name in got and np.shape(got[name]) == mask.shape:
            size = np.maximum(np.abs(want[name]), np.abs(got[name]))
            mask |= (size > 0) & (size < ADAM_FLOOR)
    return mask


def _compare(ref: Reference, run: Run) -> Mismatches:
    m = Mismatches()
    for k in range(STEPS):
        m.check(f"step {k + 1} logits", "logits", run.logits[k], ref.run.logits[k])
        m.check(f"step {k + 1} loss", "loss", run.loss[k], ref.run.loss[k])
        missing = set(ref.run.grads[k]) ^ set(run.grads[k])
        if missing:
            m.failures.append(f"step {k + 1} gradients: names differ: {sorted(missing)}")
        for name, want in ref.run.grads[k].items():
            if name in run.grads[k]:
                m.check(f"step {k + 1} grad {name}", "grad", run.grads[k][name], want)
    if list(run.after) != list(ref.run.after):
        m.failures.append(f"state_dict keys: {list(run.after)}, PyTorch {list(ref.run.after)}")
    for name, want in ref.run.after.items():
        if name in run.after:
            skip = _rounding_sensitive(name, ref.run, run)
            m.skipped += int(skip.sum())
            m.check(f"after {STEPS} steps {name}", "after", run.after[name], want, skip=skip)
    m.entries = sum(np.size(v) for v in ref.run.after.values())
    # a handful of near-zero gradients per model, not a large part of it
    if m.skipped > 0.01 * m.entries:
        m.failures.append(f"{m.skipped} of {m.entries} entries have gradients below {ADAM_FLOOR}: too many to skip")
    return m


# --------------------------------------------------------------------------- tests


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest) -> str:
    """The three ways to run a training step: an eager session, a lazy session, a compiled ``tfl.train_step``."""
    return str(request.param)


def test_port_matches_pytorch(reference: Reference, path: str) -> None:
    model = _port(reference)
    m = _compare(reference, _tapeflow_run(model, reference.kind, path))
    worst = ", ".join(f"{k} {v:.2e}" for k, v in m.worst.items())
    print(f"{reference.kind}/{path}: largest differences {worst}; {m.skipped} of {m.entries} not compared after")
    assert not m.failures, f"{reference.kind} on {path}:\n" + "\n".join(m.failures)


def test_named_parameters_and_state_dict_keys_match_pytorch(reference: Reference) -> None:
    model = _port(reference)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == reference.names
    assert list(model.state_dict()) == list(reference.untrained.state_dict())
    assert len(model.parameters()) == len(list(reference.untrained.parameters()))


def test_loaded_port_keeps_the_tie() -> None:
    """PyTorch's idiom ``decoder.weight = encoder.weight`` ties one storage; loading and training keep it."""
    torch.manual_seed(0)
    tmodel = ports.torch_models().LSTMLanguageModel()
    model = ports.LSTMLanguageModel()
    assert model.decoder.weight is model.encoder.weight
    model.load_state_dict(tmodel.state_dict())
    assert model.decoder.weight.storage is model.encoder.weight.storage
    sd = model.state_dict()
    np.testing.assert_array_equal(np.asarray(sd["decoder.weight"]), _numpy(tmodel.encoder.weight))
    np.testing.assert_array_equal(np.asarray(sd["encoder.weight"]), np.asarray(sd["decoder.weight"]))


def test_ports_are_the_pytorch_source_with_tapeflow_names() -> None:
    """Each port's class body is PyTorch's with ``torch.`` replaced by ``tfl.``: nothing tapeflow-specific in it."""
    originals = ports.torch_models()
    for name in ports.MODEL_NAMES:
        theirs = textwrap.dedent(inspect.getsource(getattr(originals, name)))
        ours = inspect.getsource(getattr(ports, name))
        assert re.sub(r"\btorch\.", "tfl.", theirs) == ours, name
