"""A WGAN-GP on 2-D data: a gradient penalty computed with ``backward(create_graph=True)``.

The real data is a mixture of 8 Gaussians on a circle. A generator MLP maps
2-D noise to points; a critic MLP scores points. The critic is trained to
maximize ``E[D(real)] - E[D(fake)]`` (an estimate of the Wasserstein distance)
while the gradient penalty of Gulrajani et al. (2017),

    lambda * E[(||d D(x_hat) / d x_hat|| - 1) ** 2],  x_hat = eps * real + (1 - eps) * fake,

keeps it close to 1-Lipschitz. The gradient ``d D / d x_hat`` comes from
``s.backward(..., create_graph=True)``: it is a Tensor recorded on the same
tape, so the penalty built from it is differentiated again, with respect to
the critic's weights, by the ordinary ``s.backward(loss)`` that follows.

Two ``tfl.Optimizer`` s, one per network; ``--n-critic`` critic steps per
generator step. The critic's step draws the fake batch under ``s.no_grad()``
(no generator gradients are needed there); the generator's step differentiates
through the critic and only the generator's optimizer uses the result.

Watch the printed columns: ``|grad D|`` (the mean gradient norm of the critic at
the interpolates) moves toward 1, the Wasserstein estimate ``W`` shrinks as the
generator catches up, and ``dist`` (the mean distance from a generated point to
its nearest mode) falls.

    python examples/gradient_penalty.py              # CPU
    python examples/gradient_penalty.py --steps 2000 # train longer

Run time: about 40 s on one CPU core (a first run: later ones reuse the compilation cache).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import jax
import numpy as np
import optax

import tapeflow as tfl

MODES = 8
RADIUS = 2.0


def modes() -> np.ndarray:
    """The 8 centres on the circle of radius ``RADIUS``, shape (8, 2)."""
    a = 2 * np.pi * np.arange(MODES) / MODES
    return RADIUS * np.stack([np.cos(a), np.sin(a)], axis=1).astype(np.float32)


def sample_real(rng: np.random.Generator, n: int, std: float = 0.05) -> np.ndarray:
    """``n`` points of the mixture of 8 Gaussians (float32, shape (n, 2))."""
    centres = modes()[rng.integers(0, MODES, size=n)]
    return (centres + std * rng.normal(size=(n, 2))).astype(np.float32)


def make(
    seed: int, hidden: int = 128, lr_gen: float = 3e-4, lr_critic: float = 1e-3, dtype: Any = np.float32
) -> dict[str, Any]:
    """Generator and critic MLPs (ReLU) and an Adam optimizer for each (Adam's betas as in the WGAN-GP paper)."""
    kg, kd = jax.random.split(jax.random.key(seed))
    gen = tfl.nn.MLP([2, hidden, hidden, 2], key=kg, activation=tfl.relu, dtype=dtype)
    critic = tfl.nn.MLP([2, hidden, hidden, 1], key=kd, activation=tfl.relu, dtype=dtype)
    return {
        "gen": gen,
        "critic": critic,
        "opt_gen": tfl.Optimizer(optax.adam(lr_gen, b1=0.5, b2=0.9), gen),
        "opt_critic": tfl.Optimizer(optax.adam(lr_critic, b1=0.5, b2=0.9), critic),
    }


def critic_loss(
    s: tfl.Session, critic: Any, real: Any, fake: Any, eps: Any, gp_weight: float = 10.0
) -> tuple[tfl.Tensor, tfl.Tensor, tfl.Tensor]:
    """The WGAN-GP critic loss on one batch, recorded on ``s``: ``(loss, wasserstein, grad_norms)``.

    ``real`` and ``fake`` are arrays of shape (n, 2), ``eps`` of shape (n, 1)
    (the interpolation weights). ``loss = -(mean D(real) - mean D(fake)) +
    gp_weight * mean((||dD/dx_hat|| - 1)^2)``; ``s.backward(loss)`` then gives
    its gradient for the critic's parameters, through the penalty's gradient.
    """
    x_hat = s.input(eps * real + (1.0 - eps) * fake, requires_grad=True)
    d_hat = critic(x_hat)
    # d D(x_hat) / d x_hat, row by row (each row of D depends only on its own x_hat row),
    # recorded on the tape so that it can be differentiated again
    gx = s.backward(tfl.sum(d_hat), create_graph=True)[x_hat]
    norms = tfl.sqrt(tfl.sum(gx * gx, axis=1) + 1e-12)
    penalty = tfl.mean((norms - 1.0) ** 2.0)
    wasserstein = tfl.mean(critic(real)) - tfl.mean(critic(fake))
    return -wasserstein + gp_weight * penalty, wasserstein, norms


def generator_loss(s: tfl.Session, gen: Any, critic: Any, z: Any) -> tfl.Tensor:
    """``-mean D(G(z))``: the generator moves its samples to where the critic scores high."""
    return -tfl.mean(critic(gen(z)))


def mode_distance(points: np.ndarray) -> float:
    """Mean distance from each point to its nearest mode (0 for a perfect generator with std -> 0)."""
    d = np.linalg.norm(points[:, None, :] - modes()[None, :, :], axis=-1)
    return float(d.min(axis=1).mean())


def modes_covered(points: np.ndarray, within: float = 0.25) -> int:
    """How many of the 8 modes have at least 1% of the points within ``within`` of their centre."""
    d = np.linalg.norm(points[:, None, :] - modes()[None, :, :], axis=-1)
    near = d.min(axis=1) < within
    hits = np.bincount(d.argmin(axis=1)[near], minlength=MODES)
    return int((hits >= 0.01 * len(points)).sum())


def generate(gen: Any, z: np.ndarray) -> np.ndarray:
    with tfl.Session(grad_enabled=False) as s:  # inference: no VJPs
        return np.asarray(gen(s.input(z)).value)


def train(
    steps: int = 300,
    n_critic: int = 5,
    batch: int = 256,
    gp_weight: float = 10.0,
    lr_gen: float = 3e-4,
    lr_critic: float = 1e-3,
    hidden: int = 128,
    seed: int = 0,
    log_every: int = 50,
    quiet: bool = False,
) -> dict[str, Any]:
    """Train for ``steps`` generator steps (``n_critic`` critic steps each); returns the logged history."""
    rng = np.random.default_rng(seed)
    m = make(seed, hidden, lr_gen, lr_critic)
    gen, critic, opt_gen, opt_critic = m["gen"], m["critic"], m["opt_gen"], m["opt_critic"]
    z_eval = rng.normal(size=(1000, 2)).astype(np.float32)
    history: list[dict[str, float]] = []
    session = tfl.Session(seed=seed)

    def log(step: int, w: float, norm: float, gp: float) -> None:
        pts = generate(gen, z_eval)
        row = {"step": step, "wasserstein": w, "grad_norm": norm, "penalty": gp, "dist": mode_distance(pts)}
        row["modes"] = modes_covered(pts)
        history.append(row)
        if not quiet:
            print(
                f"step {step:4d}  W {w:7.4f}  |grad D| {norm:6.3f}  GP {gp:7.4f}  "
                f"dist {row['dist']:6.3f}  modes {row['modes']}/{MODES}"
            )

    stats: list[tuple[float, float, float]] = []  # (W, mean |grad D|, penalty) of each critic step since the last log
    for step in range(steps + 1):
        for _ in range(n_critic):
            with session as s:  # the block resets the session on exit
                with s.no_grad():  # the critic's step needs no generator gradients
                    fake = gen(s.input(rng.normal(size=(batch, 2)).astype(np.float32))).value
                real = sample_real(rng, batch)
                eps = rng.uniform(size=(batch, 1)).astype(np.float32)
                loss, w, norms = critic_loss(s, critic, real, fake, eps, gp_weight)
                nv = np.asarray(norms.value)
                stats.append((float(w), float(nv.mean()), float(((nv - 1.0) ** 2).mean())))
                opt_critic.step(s.backward(loss))
        if step % log_every == 0 or step == steps:
            log(step, *np.mean(stats, axis=0).tolist())
            stats.clear()
        if step == steps:
            break
        with session as s:
            z = s.input(rng.normal(size=(batch, 2)).astype(np.float32))
            opt_gen.step(s.backward(generator_loss(s, gen, critic, z)))  # the critic's gradients go unused
    return {"history": history, "gen": gen, "critic": critic}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="generator steps")
    ap.add_argument("--n-critic", type=int, default=5, help="critic steps per generator step")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--gp-weight", type=float, default=10.0, help="lambda, the gradient penalty's weight")
    ap.add_argument("--lr-gen", type=float, default=3e-4)
    ap.add_argument("--lr-critic", type=float, default=1e-3)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    out = train(
        steps=args.steps,
        n_critic=args.n_critic,
        batch=args.batch,
        gp_weight=args.gp_weight,
        lr_gen=args.lr_gen,
        lr_critic=args.lr_critic,
        hidden=args.hidden,
        seed=args.seed,
        log_every=args.log_every,
        quiet=args.quiet,
    )
    first, last = out["history"][0], out["history"][-1]
    print(
        f"|grad D| at interpolates {first['grad_norm']:.3f} -> {last['grad_norm']:.3f} (target 1); "
        f"distance to nearest mode {first['dist']:.3f} -> {last['dist']:.3f}; "
        f"{time.perf_counter() - t0:.1f} s"
    )
    return out


if __name__ == "__main__":
    main()
