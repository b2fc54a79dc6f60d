"""A plain PyTorch model (no transformer, no special base class) trained through infinity.

    python examples/plain_pytorch.py                 # state on NVMe in a temporary directory
    python examples/plain_pytorch.py --placement host

The model is a residual MLP: an input layer, a stack of blocks in an nn.ModuleList
(each block becomes one infinity unit, fetched and freed as it runs) and an output
layer (the root unit). It learns a fixed random teacher network, so the loss has a
known floor of zero. Nothing in the model knows about infinity.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

import infinity


class ResidualMLP(nn.Module):
    def __init__(self, d_in: int = 64, width: int = 512, depth: int = 8, d_out: int = 16):
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            for _ in range(depth))
        self.out = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--placement", choices=("device", "host", "nvme"), default="nvme",
                    help="tier of parameters, gradients and optimizer state")
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    if args.steps < 1:
        ap.error(f"--steps {args.steps}: give 1 or more")

    swap = tempfile.mkdtemp(prefix="infinity-swap-")
    config = infinity.Config.from_dict({
        "optimizer": {"lr": 1e-3, "schedule": "cosine", "warmup_steps": min(10, args.steps // 10),
                      "total_steps": args.steps},
        "placement": {"params": args.placement, "grads": args.placement, "optimizer": args.placement},
        "nvme": {"paths": [swap]},
    })
    with infinity.meta_init():  # no parameter memory yet: each unit is created and initialized in turn
        model = ResidualMLP()
    engine = infinity.initialize(model, config)  # nn.Linear / nn.LayerNorm initialize themselves (reset_parameters)

    torch.manual_seed(0)
    teacher = ResidualMLP(depth=2).eval()
    try:
        for step in range(args.steps):
            x = torch.randn(64, 64)
            with torch.no_grad():
                target = teacher(x)
            loss = F.mse_loss(engine(x), target)
            engine.backward(loss)
            engine.step()
            if step % 20 == 0 or step == args.steps - 1:
                print(f"step {step:4d}  loss {loss.item():.5f}")
        state = engine.memory_report()["state"]
        print("bytes per tier:", {tier: sum(kinds.values()) for tier, kinds in state.items()})
    finally:
        engine.close()
        shutil.rmtree(swap, ignore_errors=True)


if __name__ == "__main__":
    main()
