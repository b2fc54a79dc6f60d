"""Training through the engine with a Recipe, on one rank of a (possibly single-process) group."""

from __future__ import annotations

import os

import torch.distributed as dist

import infinity
from reference import Recipe


def engine_run(recipe: Recipe, placement: dict, swap_dir: str | None = None, extra: dict | None = None,
               rank: int = 0, world: int = 1):
    """Losses (mean over ranks) per micro-batch, the engine's grad norms, the state dict (rank 0), and the
    memory report with the name of the update mode that ran (`update_mode`)."""
    cfg = recipe.config(**placement)
    if swap_dir is not None:
        os.makedirs(swap_dir, exist_ok=True)
        cfg["nvme"] = {"paths": [swap_dir]}
    for section, values in (extra or {}).items():
        cfg.setdefault(section, {}).update(values)
    engine = infinity.initialize(recipe.build(), cfg)
    losses, norms = [], []
    try:
        for step in range(recipe.steps):
            losses += train_steps(engine, recipe, step, step + 1, rank, world)
            norms.append(engine.last_grad_norm)
        state = engine.full_state_dict()
        report = engine.memory_report() | {"update_mode": type(engine.updates).__name__}  # Note [overlap]
    finally:
        engine.close()
    return losses, norms, state, report


def train_steps(engine, recipe: Recipe, first: int, last: int, rank: int, world: int) -> list[float]:
    """Steps [first, last) of the recipe's data; returns the rank-mean loss of each micro-batch."""
    losses = []
    per_rank = recipe.micro_batch // world
    for micro_batches in recipe.batches()[first:last]:
        for x, y in micro_batches:
            sl = slice(rank * per_rank, (rank + 1) * per_rank)
            loss = engine(x[sl], y[sl])
            engine.backward(loss)
            value = loss.detach().clone()
            if world > 1:
                dist.all_reduce(value)
                value /= world
            losses.append(value.item())
            engine.step()
    return losses


ALL_PLACEMENTS = [{"params": p, "grads": g, "optimizer": o}
                  for p in ("device", "host", "nvme") for g in ("device", "host", "nvme")
                  for o in ("device", "host", "nvme")]


_TIERS = ("device", "host", "nvme")
LATIN_PLACEMENTS = [{"params": p, "grads": g, "optimizer": _TIERS[(i + j) % 3]}
                    for i, p in enumerate(_TIERS) for j, g in enumerate(_TIERS)]
"""9 of the 27: every (params, grads) pair once, every tier three times for each kind (a Latin square)."""


def all_placements_on_rank(rank: int, world: int, recipe: Recipe, swap_root: str, overlap: bool = False,
                           placements: list[dict] | None = None):
    """Every placement (or `placements`) in turn on this rank; returns [(placement, losses, norms, state)] (state
    on rank 0)."""
    out = []
    for i, placement in enumerate(ALL_PLACEMENTS if placements is None else placements):
        swap = os.path.join(swap_root, f"p{i}") if "nvme" in placement.values() else None
        extra = {"overlap": {"optimizer_with_backward": overlap}}
        losses, norms, state, _ = engine_run(recipe, placement, swap, extra, rank=rank, world=world)
        out.append((placement, losses, norms, state))
    return out
