"""tapeflow demo: a tied-weight autoencoder with a classifier head on handwritten digits.

The encoder weight ``W`` is used twice: once to encode (``x @ W``) and once,
through ``tfl.tie``, to decode (``code @ W_dec.T``). tapeflow records one leaf
per use, sums both cotangents per storage, and hands the sum to an optax chain
that updates ``W`` once per step.

Runs offline on scikit-learn's bundled digits (1,797 8x8 images):

    python examples/demo.py                       # CPU
    python examples/demo.py --device gpu          # on a GPU, when JAX has one
    python examples/demo.py --plot curves.png     # also plot the loss and accuracy curves (matplotlib)
    python examples/demo.py --eager               # the same loop op by op (tfl.Session(lazy=False))

At the end it times one training step three ways on the same model: the loop
in a session (lazy, the default), the same loop op by op, and one compiled ``tfl.train_step`` call
(the median of 100 steps each, after a few untimed ones).

Run time: about 20 s on one CPU core (a first run: later ones reuse the compilation cache).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import tapeflow as tfl


def load_data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return x_tr, x_te, y_tr, y_te


class TiedAutoencoderClassifier:
    """encoder x @ W, decoder code @ tie(W).T, classifier head on the code."""

    def __init__(self, n_in: int, n_code: int, n_classes: int, key: Any) -> None:
        k1, k2 = jax.random.split(key)
        f32 = jnp.float32
        self.W = tfl.Param(jax.random.normal(k1, (n_in, n_code), f32) * (1.0 / n_in) ** 0.5, name="W")
        self.W_dec = tfl.tie(self.W, name="W_dec")  # same storage, second use
        self.b_enc = tfl.Param(jnp.zeros(n_code, f32), name="b_enc")
        self.b_dec = tfl.Param(jnp.zeros(n_in, f32), name="b_dec")
        self.head = tfl.Param(jax.random.normal(k2, (n_code, n_classes), f32) * (1.0 / n_code) ** 0.5, name="head")
        self.b_head = tfl.Param(jnp.zeros(n_classes, f32), name="b_head")

    def records(self) -> list[tfl.Param]:
        return [self.W, self.W_dec, self.b_enc, self.b_dec, self.head, self.b_head]

    def __call__(self, s: tfl.Session, x: Any) -> tuple[tfl.Tensor, tfl.Tensor, tfl.Tensor]:
        x = s.input(x)
        code = tfl.tanh(x @ self.W + self.b_enc)
        recon = code @ self.W_dec.T + self.b_dec
        logits = code @ self.head + self.b_head
        return x, recon, logits

    def loss(self, s: tfl.Session, x: Any, y: Any) -> tfl.Tensor:
        xin, recon, logits = self(s, x)
        return tfl.cross_entropy(logits, s.input(y)) + 0.5 * tfl.mse(recon, xin)


def make(seed: int, lr: float) -> tuple[TiedAutoencoderClassifier, tfl.Optimizer]:
    model = TiedAutoencoderClassifier(64, 48, 10, jax.random.PRNGKey(seed))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, weight_decay=1e-4))
    return model, tfl.Optimizer(tx, model.records())


def batches(n: int, batch: int, rng: np.random.Generator) -> list[np.ndarray]:
    order = rng.permutation(n)
    return [order[i : i + batch] for i in range(0, n - batch + 1, batch)]


def accuracy(
    model: TiedAutoencoderClassifier, x: np.ndarray, y: np.ndarray, device: Any, compute_dtype: Any = None
) -> float:
    with tfl.Session(device=device, grad_enabled=False, compute_dtype=compute_dtype) as s:  # inference: no VJPs
        _, _, logits = model(s, x)
        pred = np.asarray(logits.value).argmax(axis=1)
    return float((pred == y).mean())


@contextlib.contextmanager
def compiles_shown_on(bar: Any, desc: str) -> Iterator[None]:
    """While XLA compiles (the first steps), ``bar`` says so, and the compile time stays out of its rate
    (so out of its ETA): ``unpause()`` restarts the bar's clock once the compile is done."""

    def compiling(what: str) -> None:
        # an op kernel or a program; the library names a step program after the lazy machinery that
        # builds it, which an eager session's backward also runs: the bar names it for either mode
        named = "" if what.startswith("jax function") else f" {what.split(' (')[0].removeprefix('lazy ')}"
        bar.set_description_str(f"compiling{named}", refresh=True)

    def compiled(record: tfl.CompileRecord) -> None:
        bar.set_description_str(desc, refresh=False)
        bar.unpause()

    with tfl.compile_log(file=None, on_start=compiling, on_end=compiled):
        yield


def train(
    model: TiedAutoencoderClassifier,
    opt: tfl.Optimizer,
    session: tfl.Session,
    x: np.ndarray,
    y: np.ndarray,
    *,
    epochs: int,
    batch: int,
    rng: np.random.Generator,
    eval_data: tuple[np.ndarray, np.ndarray] | None = None,
    quiet: bool = False,
    device: Any = None,
    compute_dtype: Any = None,
) -> dict[str, list[float]]:
    """The eager training loop. Returns the history: the loss of every step, and per epoch
    the mean loss and (with ``eval_data``) the test accuracy."""
    from tqdm import tqdm  # plain: tqdm.auto wants ipywidgets in a notebook (TqdmWarning: IProgress not found)

    history: dict[str, list[float]] = {"step_loss": [], "epoch_loss": [], "epoch_accuracy": []}
    per_epoch = len(x) // batch
    desc = f"training ({'lazy' if session.lazy else 'eager'})"
    bar = tqdm(total=epochs * per_epoch, disable=quiet, desc=desc, unit="step")

    with compiles_shown_on(bar, desc):
        for _ in range(epochs):
            for b in batches(len(x), batch, rng):
                with session as s:  # the block resets the session on exit
                    loss = model.loss(s, x[b], y[b])
                    opt.step(s.backward(loss))  # tied W: both uses summed, one update
                    history["step_loss"].append(float(loss))
                    bar.set_postfix(loss=f"{history['step_loss'][-1]:.4f}", refresh=False)
                bar.update()
            history["epoch_loss"].append(float(np.mean(history["step_loss"][-per_epoch:])))
            if eval_data is not None:
                history["epoch_accuracy"].append(accuracy(model, *eval_data, device, compute_dtype))

    bar.close()
    return history


PLOT_HELP = "--plot needs matplotlib: pip install -e '.[demo]'"


def _figure_api() -> tuple[Any, Any]:
    """matplotlib's ``Figure`` and Agg canvas (imported only when a plot is asked for)."""
    try:
        import matplotlib  # noqa: F401  (a missing matplotlib fails here, with the message below)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise SystemExit(f"{PLOT_HELP} ({e})") from None
    return Figure, FigureCanvasAgg


def plot_history(history: dict[str, list[float]], path: str | Path) -> Path:
    """Save the loss curve (per step, and its per-epoch mean) and the test-accuracy curve as a PNG.

    ``path`` may be a directory: the file is then ``training_curves.png`` in it. Uses the Agg
    canvas directly, so it changes no pyplot backend (in a notebook either).
    """
    Figure, FigureCanvasAgg = _figure_api()
    from matplotlib.ticker import MaxNLocator

    out = Path(path)
    if out.is_dir():
        out = out / "training_curves.png"
    fig = Figure(figsize=(9, 3.4), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_acc = fig.subplots(1, 2)
    steps = np.arange(1, len(history["step_loss"]) + 1)
    ax_loss.plot(steps, history["step_loss"], lw=0.7, alpha=0.5, label="per step")
    epochs = len(history["epoch_loss"])
    if epochs:
        per_epoch = len(steps) // epochs
        ends = per_epoch * np.arange(1, epochs + 1)
        ax_loss.plot(ends, history["epoch_loss"], "o-", ms=3, label="epoch mean")
    ax_loss.set(xlabel="step", ylabel="training loss", title="loss (cross-entropy + 0.5 mse)")
    ax_loss.legend()
    acc = history.get("epoch_accuracy", [])
    ax_acc.plot(np.arange(1, len(acc) + 1), acc, "o-", ms=3, color="C2")
    ax_acc.set(xlabel="epoch", ylabel="test accuracy", title="test accuracy", ylim=(0, 1.02))
    ax_acc.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs 1, 2, 3: no 1.5
    if acc:
        ax_acc.annotate(f"{acc[-1]:.3f}", (len(acc), acc[-1]), xytext=(-4, -12), textcoords="offset points", ha="right")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out


WARMUP_STEPS = 5  # compiles, then a lazy session's replay (values only from its fourth recording on)


def time_steps(step: Any, x: np.ndarray, y: np.ndarray, idx: list[np.ndarray], n: int) -> float:
    """The median time of one step over ``n`` steps, each waited for, after ``WARMUP_STEPS`` untimed ones.

    A median, not a mean: on a shared machine a few steps are slowed by other work, and a mean of them
    moved by several times from one run to the next.
    """
    for i in range(WARMUP_STEPS):
        b = idx[i % len(idx)]
        jax.block_until_ready(step(x[b], y[b]))
    times = []
    for i in range(n):
        b = idx[i % len(idx)]
        t0 = time.perf_counter()
        jax.block_until_ready(step(x[b], y[b]))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


DEMO_EXTRA = (
    "demo.py needs scikit-learn (the digits data) and tqdm (the progress bar), which the demo extra installs: "
    "pip install -e '.[demo]' in a checkout, or pip install 'tapeflow[demo]'"
)


def require_demo_extra() -> None:
    """Exit with what to install when the ``[demo]`` extra is missing (a raw ModuleNotFoundError says less)."""
    try:
        import sklearn  # noqa: F401
        import tqdm  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"{DEMO_EXTRA} (missing: {e.name})") from None


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="cpu, gpu, ... (default: JAX's default device)")
    ap.add_argument("--checkpoint", default="checkpoints/demo", help="where to save the trained model")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument(
        "--plot",
        metavar="PATH",
        default=None,
        help="save the loss and test-accuracy curves as a PNG at PATH (a directory: PATH/training_curves.png); "
        "needs matplotlib (pip install -e '.[demo]')",
    )
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument(
        "--lazy",
        action="store_true",
        help="train in a lazy session, the default of tfl.Session(): the same loop, one compiled program per step",
    )
    mode.add_argument(
        "--eager",
        action="store_true",
        help="train op by op (tfl.Session(lazy=False)): every op runs as it is recorded, for debugging",
    )
    ap.add_argument(
        "--compute-dtype",
        default=None,
        help="mixed precision, e.g. bfloat16: float32 parameters, ops computed in this dtype (default: float32)",
    )
    args = ap.parse_args(argv)
    require_demo_extra()
    if args.plot is not None:
        _figure_api()  # fail now, not after training, when matplotlib is missing

    x_tr, x_te, y_tr, y_te = load_data(args.seed)
    model, opt = make(args.seed, args.lr)
    rng = np.random.default_rng(args.seed)
    session = tfl.Session(device=args.device, seed=args.seed, compute_dtype=args.compute_dtype, lazy=not args.eager)
    print(f"tapeflow {tfl.__version__} on {session.device}: {len(x_tr)} train / {len(x_te)} test digits")

    history = train(
        model,
        opt,
        session,
        x_tr,
        y_tr,
        epochs=args.epochs,
        batch=args.batch,
        rng=rng,
        eval_data=(x_te, y_te) if args.plot is not None else None,
        quiet=args.quiet,
        device=args.device,
        compute_dtype=args.compute_dtype,
    )

    acc = accuracy(model, x_te, y_te, args.device, args.compute_dtype)
    print(f"test accuracy: {acc:.4f}")
    if args.plot is not None:
        print(f"training curves saved to {plot_history(history, args.plot).resolve()}")

    # Same model code three ways (fresh copies, same data): the eager loop, the same loop in a
    # lazy session (one compiled program per step), and one compiled tfl.train_step call.
    idx = batches(len(x_tr), args.batch, np.random.default_rng(1))

    def loop_step(lazy: bool) -> Any:
        model, opt = make(args.seed + 1, args.lr)
        sess = tfl.Session(device=args.device, lazy=lazy)

        def step(xb: np.ndarray, yb: np.ndarray) -> Any:
            with sess as s:
                loss = model.loss(s, xb, yb)
                opt.step(s.backward(loss))
                return float(loss)

        return step

    m_c, opt_c = make(args.seed + 1, args.lr)
    compiled = tfl.train_step(m_c.loss, opt_c)
    n = 100
    t_eager = time_steps(loop_step(False), x_tr, y_tr, idx, n)
    t_lazy = time_steps(loop_step(True), x_tr, y_tr, idx, n)
    t_jit = time_steps(compiled, x_tr, y_tr, idx, n)
    print(f"time per step, the median of {n} steps of each:")
    for name, t in (("eager loop", t_eager), ("lazy loop", t_lazy), ("train_step", t_jit)):
        print(f"  {name:<11} {t * 1e3:6.3f} ms" + ("" if t is t_eager else f"  ({t / t_eager:.2f} of eager's)"))

    path = Path(args.checkpoint).resolve()
    tfl.save(path, model.records(), optimizer=opt, session=session, overwrite=True)
    print(f"checkpoint saved to {path}")
    return {"accuracy": acc, "eager_step_s": t_eager, "lazy_step_s": t_lazy, "train_step_s": t_jit}


if __name__ == "__main__":
    main()
