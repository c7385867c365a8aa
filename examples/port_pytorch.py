"""Port a PyTorch model to tapeflow: the same class, PyTorch's weights, the same logits and losses.

A small MobileNet-style CNN (a depthwise-separable block with BatchNorm,
global average pooling, a linear head) is written once, in a function that
takes the ``nn`` and ``F`` modules: called with ``torch.nn`` and
``torch.nn.functional`` it builds the PyTorch model, called with
``tapeflow.nn`` and ``tapeflow.nn.functional`` the tapeflow one. The PyTorch
model's ``state_dict()`` loads into the tapeflow model with
``model.load_state_dict``; the eval-mode logits are compared, then both train
for a few AdamW steps (``torch.optim.AdamW`` and
``tfl.Optimizer(optax.adamw(...))`` in one compiled ``tfl.train_step``) and
their losses are printed side by side. The guide ``docs/porting.md`` walks
through the same port.

PyTorch is needed for the reference model (it is a test dependency of
tapeflow, not a dependency): without it the example says so and exits.

    python examples/port_pytorch.py

Run time: about 25 s on one CPU core (a first run: later ones reuse the compilation cache).
"""

from __future__ import annotations

import argparse
import time
from types import ModuleType
from typing import Any

import numpy as np
import optax

import tapeflow as tfl

NO_TORCH = "port_pytorch.py needs PyTorch for its reference model: pip install torch (or pip install -e '.[dev]')"


def make_net(nn: ModuleType, F: ModuleType) -> Any:
    """The model class, written once against PyTorch's API: ``nn`` and ``F`` pick the framework."""

    class Net(nn.Module):  # type: ignore[name-defined]
        def __init__(self, classes: int = 10) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
            self.block = nn.Sequential(
                nn.Conv2d(16, 16, 3, padding=1, groups=16),  # depthwise
                nn.BatchNorm2d(16),
                nn.ReLU(),
                nn.Conv2d(16, 32, 1),  # pointwise
                nn.BatchNorm2d(32),
                nn.ReLU(),
            )
            self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
            self.head = nn.Linear(32, classes)

        def forward(self, x: Any) -> Any:
            x = F.max_pool2d(self.stem(x), 2)
            return self.head(self.pool(self.block(x)))

    return Net


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps in each framework")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print(NO_TORCH)
        return {"torch": False}
    import tapeflow.nn.functional as tfl_F

    t0 = time.perf_counter()
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    images = rng.normal(size=(64, 1, 16, 16)).astype(np.float32)
    labels = rng.integers(0, 10, size=64)

    # PyTorch: the reference logits (eval mode), the initial weights, then AdamW in train mode
    torch_model = make_net(torch.nn, torch.nn.functional)()
    torch_model.eval()
    with torch.no_grad():
        torch_logits = torch_model(torch.from_numpy(images)).numpy()
    sd = {k: v.clone() for k, v in torch_model.state_dict().items()}
    torch_model.train()
    optim = torch.optim.AdamW(torch_model.parameters(), lr=1e-2, weight_decay=0.01)
    x, y = torch.from_numpy(images), torch.from_numpy(labels)
    torch_losses = []
    for _ in range(args.steps):
        optim.zero_grad()
        loss = torch.nn.functional.cross_entropy(torch_model(x), y)
        loss.backward()
        optim.step()
        torch_losses.append(loss.item())

    # tapeflow: the same class, PyTorch's state dict, the same logits, then the same AdamW steps
    model = make_net(tfl.nn, tfl_F)()
    model.load_state_dict(sd)
    model.eval()
    with tfl.Session(grad_enabled=False) as s:
        logits = np.asarray(model(s.input(images)).value)
    diff = float(np.abs(logits - torch_logits).max())
    print(f"tapeflow {tfl.__version__}: {len(sd)} state-dict entries loaded from the PyTorch model")
    print(f"max |logit difference| = {diff:.2e}")

    opt = tfl.Optimizer(optax.adamw(1e-2, weight_decay=0.01), model)
    step = tfl.train_step(lambda s, x, y: tfl_F.cross_entropy(model(s.input(x)), s.input(y)), opt)
    model.train()
    losses = [float(step(images, labels)) for _ in range(args.steps)]
    for i, (a, b) in enumerate(zip(losses, torch_losses)):
        print(f"step {i + 1}  loss tapeflow {a:.5f}  PyTorch {b:.5f}")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return {"torch": True, "max_logit_diff": diff, "losses": losses, "torch_losses": torch_losses}


if __name__ == "__main__":
    main()
