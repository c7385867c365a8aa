"""A character-level language model with tied input/output embeddings.

A small causal transformer (learned positions, pre-norm attention and MLP
blocks with residuals) reads characters through ``tfl.nn.Embedding`` and
projects back onto the vocabulary through ``Embedding.tied_output()``: the
output layer is a ``tfl.tie`` d record of the embedding table, so both uses
share one storage, their gradients are summed, and the optimizer keeps one
AdamW slot for it.

The training text is the project's own documentation (``README.md`` and
``docs/*.md``), as a snapshot kept with the example
(``examples/data/docs_corpus.txt.gz``), so the run prints the same numbers
while the docs change; ``--text`` trains on any other text file. Training runs
as one compiled ``tfl.train_step`` per step; sampling then runs eagerly in an
inference session (``grad_enabled=False``).

    python examples/char_lm.py                    # CPU
    python examples/char_lm.py --steps 2000       # longer, better samples
    python examples/char_lm.py --device gpu       # on a GPU, when JAX has one
    python examples/char_lm.py --text notes.txt   # on your own text

Run time: about 30 s on one CPU core (a first run: later ones reuse the compilation cache).
"""

from __future__ import annotations

import argparse
import gzip
import math
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

import tapeflow as tfl

# README.md followed by docs/*.md (sorted), as one string, from a commit of the repository
CORPUS = Path(__file__).resolve().parent / "data" / "docs_corpus.txt.gz"


def load_text(path: Path = CORPUS) -> str:
    """The text of ``path`` (UTF-8; gzip-compressed when its name ends in ``.gz``)."""
    data = path.read_bytes()
    return (gzip.decompress(data) if path.suffix == ".gz" else data).decode("utf-8")


class Block(tfl.nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int, *, key: Any) -> None:
        k1, k2 = tfl.nn.init.keys(key, 2)  # jax.random.split's keys, nothing compiled
        self.ln1 = tfl.nn.LayerNorm(dim)
        self.attn = tfl.nn.MultiHeadAttention(dim, heads, key=k1, causal=True)
        self.ln2 = tfl.nn.LayerNorm(dim)
        self.mlp = tfl.nn.MLP([dim, 4 * dim, dim], key=k2, activation=tfl.gelu)

    def forward(self, x: Any) -> tfl.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharLM(tfl.nn.Module):
    """Tied embedding -> learned positions -> blocks -> LayerNorm -> tied output projection."""

    def __init__(self, vocab: int, context: int, dim: int, heads: int, layers: int, *, key: Any) -> None:
        ke, kp, kb = tfl.nn.init.keys(key, 3)
        self.context = context
        self.embed = tfl.nn.Embedding(vocab, dim, key=ke, std=0.1)
        # jax.random.normal's values, from the one compiled initializer kernel, scaled on the host
        self.pos = tfl.Param(np.float32(0.02) * np.asarray(tfl.nn.init.normal(kp, (context, dim))), name="pos")
        self.blocks = [Block(dim, heads, key=k) for k in tfl.nn.init.keys(kb, layers)]
        self.ln_f = tfl.nn.LayerNorm(dim)
        self.head = self.embed.tied_output()  # same storage as embed.weight

    def forward(self, ids: Any) -> tfl.Tensor:
        n = ids.shape[-1]
        x = self.embed(ids) + self.pos[:n]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (..., n, vocab)


def make_batch(data: np.ndarray, batch: int, context: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``batch`` random windows of ``context`` characters and the next character at each position."""
    starts = rng.integers(0, len(data) - context - 1, size=batch)
    idx = starts[:, None] + np.arange(context + 1)[None, :]
    w = data[idx]
    return w[:, :-1], w[:, 1:]


def sample(
    model: CharLM,
    prompt: str,
    n: int,
    stoi: dict[str, int],
    itos: list[str],
    *,
    temperature: float,
    seed: int,
    device: Any,
) -> str:
    """Generate ``n`` characters after ``prompt``, one forward pass per character, in an inference session.

    The window is always ``model.context`` characters (the prompt is left-padded
    with spaces), so every step reuses the same compiled kernels.
    """
    pad = stoi.get(" ", 0)
    window = [pad] * model.context + [stoi[c] for c in prompt if c in stoi]
    rng = np.random.default_rng(seed)
    out = []
    with tfl.Session(device=device, grad_enabled=False) as s:
        for _ in range(n):
            ids = np.asarray(window[-model.context :], np.int32)[None, :]
            logits = np.asarray(model(s.input(ids)).value[0, -1], np.float64)
            s.reset()  # drop the recording: nothing requires grad, nothing is kept
            if temperature <= 0:
                nxt = int(logits.argmax())
            else:
                p = np.exp((logits - logits.max()) / temperature)
                nxt = int(rng.choice(len(p), p=p / p.sum()))
            window.append(nxt)
            out.append(itos[nxt])
    return prompt + "".join(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400, help="training steps (default: 400)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=48)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--temperature", type=float, default=0.7, help="0 samples greedily")
    ap.add_argument("--chars", type=int, default=200, help="characters to sample after training")
    ap.add_argument("--prompt", default="The tape ")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="cpu, gpu, ... (default: JAX's default device)")
    ap.add_argument("--text", type=Path, default=CORPUS, help="the text to train on (default: the docs' snapshot)")
    args = ap.parse_args(argv)

    device = tfl.Session(device=args.device).device  # resolves the name; an absent device is an error
    text = load_text(args.text)
    itos = sorted(set(text))
    stoi = {c: i for i, c in enumerate(itos)}
    data = np.asarray([stoi[c] for c in text], np.int32)
    what = "docs" if args.text == CORPUS else args.text.name
    print(f"tapeflow {tfl.__version__} on {device}: {len(text):,} characters of {what}, vocabulary of {len(itos)}")

    with jax.default_device(device):  # parameters and optimizer state live on the chosen device
        model = CharLM(len(itos), args.context, args.dim, args.heads, args.layers, key=jax.random.key(args.seed))
        records = dict(model.parameter_records())  # every registration, the tied output included
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr, weight_decay=0.01))
        opt = tfl.Optimizer(tx, records)
    tied = model.head.weight.storage is model.embed.weight.storage
    print(
        f"{len(opt.records)} parameter records, {len(opt.params)} optimizer slots "
        f"(head.weight shares embed.weight's storage: {tied}); {model.num_parameters():,} weights"
    )

    def loss_fn(s: tfl.Session, ids: Any, targets: Any) -> tfl.Tensor:
        logits = model(ids)  # (batch, context, vocab): PyTorch's cross_entropy wants the classes on dim 1
        return tfl.cross_entropy(logits.view(-1, logits.shape[-1]), s.input(targets).view(-1))

    step = tfl.train_step(loss_fn, opt, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    losses: list[Any] = []
    every = max(1, args.steps // 10)
    t0 = time.perf_counter()
    for i in range(args.steps):
        xb, yb = make_batch(data, args.batch, args.context, rng)
        loss = step(xb, yb)  # forward, backward, tied-gradient sum and AdamW in one program
        losses.append(loss)
        if i == 0 or (i + 1) % every == 0 or i + 1 == args.steps:
            print(f"step {i + 1:5d}  loss {float(loss):.4f}  ({time.perf_counter() - t0:.1f} s)")
    losses_f = [float(v) for v in losses]
    train_s = time.perf_counter() - t0
    initial = losses_f[0]
    final = float(np.mean(losses_f[-10:]))
    print(
        f"loss {initial:.3f} -> {final:.3f} (uniform over the vocabulary: {math.log(len(itos)):.3f}) in {train_s:.1f} s"
    )

    text_out = sample(
        model, args.prompt, args.chars, stoi, itos, temperature=args.temperature, seed=args.seed, device=device
    )
    print(f"--- sample (temperature {args.temperature}) ---")
    print(text_out)
    print("---")
    return {
        "initial_loss": initial,
        "final_loss": final,
        "losses": losses_f,
        "sample": text_out,
        "records": len(opt.records),
        "slots": len(opt.params),
        "tied": tied,
        "train_seconds": train_s,
    }


if __name__ == "__main__":
    main()
