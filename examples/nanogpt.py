"""A nanoGPT-style model whose weights come from a PyTorch ``state_dict``.

A small GPT, as in Karpathy's nanoGPT: token embeddings tied with the output
head (``tfl.nn.Embedding`` and ``emb.tied_output()``), learned positions,
pre-norm blocks of ``LayerNorm``, causal ``tfl.nn.MultiHeadAttention`` and an
MLP with GPT-2's tanh GELU, then a final ``LayerNorm``. The same model is
written in ``torch.nn`` in this file (``nn.MultiheadAttention``, an
``nn.Sequential`` MLP, ``lm_head.weight = wte.weight``); its ``state_dict()``
goes into the tapeflow model with one ``tfl.nn.load_state_dict`` call (the tied
pair arrives as one tensor under two names and lands in one storage), and the
logits of both models are compared.

Then a few training steps with nanoGPT's optimizer: AdamW with betas (0.9,
0.95), weight decay 0.1 on the 2-D weights only (``tfl.nn.decay_mask``), the
global gradient norm clipped to 1.0, warmup then cosine decay, one compiled
``tfl.train_step`` per step that also returns the gradient norm. The text is
the char LM's snapshot of the docs (``examples/data/docs_corpus.txt.gz``).

PyTorch is needed only for the reference model (it is a test dependency of
tapeflow, not a dependency): without it the example says so and exits.

    python examples/nanogpt.py

Run time: about 15 s on one CPU core (a first run: later ones reuse the compilation cache).
"""

from __future__ import annotations

import argparse
import gzip
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

import tapeflow as tfl

ROOT = Path(__file__).resolve().parents[1]
NO_TORCH = (
    "nanogpt.py needs PyTorch for its reference model; install its CPU build (the default wheel is a CUDA "
    "build of several GB): pip install torch --index-url https://download.pytorch.org/whl/cpu, "
    "or pip install -e '.[dev]' in a checkout"
)


def gelu_tanh(x: Any) -> tfl.Tensor:
    return tfl.gelu(x, approximate="tanh")  # GPT-2's GELU


class Block(tfl.nn.Module):
    """x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, dim: int, heads: int, *, key: Any) -> None:
        k1, k2, k3 = tfl.nn.init.keys(key, 3)
        self.ln_1 = tfl.nn.LayerNorm(dim)
        self.attn = tfl.nn.MultiHeadAttention(dim, heads, key=k1, causal=True)
        self.ln_2 = tfl.nn.LayerNorm(dim)
        self.mlp = tfl.nn.Sequential(
            tfl.nn.Linear(dim, 4 * dim, key=k2), gelu_tanh, tfl.nn.Linear(4 * dim, dim, key=k3)
        )

    def forward(self, x: Any) -> tfl.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(tfl.nn.Module):
    """wte + wpe -> blocks -> ln_f -> lm_head (tied with wte)."""

    def __init__(self, vocab: int, block_size: int, dim: int, heads: int, layers: int, *, key: Any) -> None:
        ke, kp, kb = tfl.nn.init.keys(key, 3)
        self.wte = tfl.nn.Embedding(vocab, dim, key=ke, std=0.02)
        self.wpe = tfl.nn.Embedding(block_size, dim, key=kp, std=0.02)
        self.h = [Block(dim, heads, key=k) for k in tfl.nn.init.keys(kb, layers)]
        self.ln_f = tfl.nn.LayerNorm(dim)
        self.lm_head = self.wte.tied_output()  # one storage with wte.weight

    def forward(self, ids: Any) -> tfl.Tensor:
        x = self.wte(ids) + self.wpe(np.arange(ids.shape[-1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def torch_gpt(vocab: int, block_size: int, dim: int, heads: int, layers: int, seed: int) -> Any:
    """The same GPT in torch.nn, initialized as nanoGPT does (N(0, 0.02), zero biases)."""
    import torch
    from torch import nn

    class TorchBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1 = nn.LayerNorm(dim)
            self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
            self.ln_2 = nn.LayerNorm(dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

        def forward(self, x: Any) -> Any:
            n = x.shape[1]
            mask = torch.ones(n, n, dtype=torch.bool).triu(1)  # True: may not attend
            h = self.ln_1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln_2(x))

    class TorchGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(vocab, dim)
            self.wpe = nn.Embedding(block_size, dim)
            self.h = nn.ModuleList([TorchBlock() for _ in range(layers)])
            self.ln_f = nn.LayerNorm(dim)
            self.lm_head = nn.Linear(dim, vocab, bias=False)
            self.lm_head.weight = self.wte.weight  # weight tying, as nanoGPT
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                elif p.ndim == 2 and "ln" not in name:
                    nn.init.normal_(p, 0.0, 0.02)

        def forward(self, ids: Any) -> Any:
            pos = torch.arange(ids.shape[1])
            x = self.wte(ids) + self.wpe(pos)
            for block in self.h:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    torch.manual_seed(seed)
    return TorchGPT().eval()


CORPUS = ROOT / "examples" / "data" / "docs_corpus.txt.gz"


def load_text(path: Path = CORPUS) -> str:
    """The text it trains on: the char LM's snapshot of the docs, so a run prints the same numbers while they change."""
    return gzip.decompress(path.read_bytes()).decode("utf-8")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    try:
        import torch
    except ImportError:
        print(NO_TORCH)
        return {"torch": False}
    torch.set_num_threads(1)

    text = load_text()
    itos = sorted(set(text))
    stoi = {c: i for i, c in enumerate(itos)}
    data = np.asarray([stoi[c] for c in text], np.int32)
    shape = (len(itos), args.block_size, args.dim, args.heads, args.layers)

    reference = torch_gpt(*shape, seed=args.seed)
    model = GPT(*shape, key=jax.random.key(args.seed))
    tfl.nn.load_state_dict(model, reference.state_dict())  # wte.weight and lm_head.weight: one tensor
    tied = model.lm_head.weight.storage is model.wte.weight.storage
    print(
        f"loaded {len(reference.state_dict())} torch tensors; "
        f"lm_head shares wte's storage: {tied}; {model.num_parameters():,} weights"
    )

    rng = np.random.default_rng(args.seed)

    def batch() -> tuple[np.ndarray, np.ndarray]:
        starts = rng.integers(0, len(data) - args.block_size - 1, size=args.batch)
        w = data[starts[:, None] + np.arange(args.block_size + 1)[None, :]]
        return w[:, :-1], w[:, 1:]

    ids, _ = batch()
    with torch.no_grad():
        want = reference(torch.from_numpy(ids.astype(np.int64))).numpy()
    with tfl.Session(grad_enabled=False) as s:
        got = np.asarray(model(s.input(ids)).value)
    diff = float(np.max(np.abs(got - want)))
    print(f"logits {got.shape}: max |tapeflow - torch| = {diff:.2e}")

    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=args.lr, warmup_steps=5, decay_steps=args.steps, end_value=args.lr / 10
    )
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=tfl.nn.decay_mask(model)),
    )
    opt = tfl.Optimizer(tx, model)

    def loss_fn(s: tfl.Session, x: Any, y: Any) -> tfl.Tensor:
        logits = model(x)  # (batch, block, vocab): as nanoGPT, the classes go on dim 1 of a 2-D view
        return tfl.cross_entropy(logits.view(-1, logits.shape[-1]), s.input(y).view(-1))

    step = tfl.train_step(loss_fn, opt, return_stats=True)
    losses, norms = [], []
    t0 = time.perf_counter()
    for i in range(args.steps):
        loss, stats = step(*batch())
        losses.append(float(loss))
        norms.append(float(stats.grad_norm))
        if i % 5 == 0 or i + 1 == args.steps:
            lr = float(schedule(i))
            print(f"step {i:3d}  lr {lr:.1e}  loss {losses[-1]:.4f}  grad norm {norms[-1]:.3f}")
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {time.perf_counter() - t0:.1f} s")
    return {"torch": True, "max_diff": diff, "tied": tied, "losses": losses, "grad_norms": norms}


if __name__ == "__main__":
    main()
