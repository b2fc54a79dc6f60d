"""Training runs that save and resume, shared by the checkpoint and kill tests."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import infinity
from reference import Recipe

NVME = {"params": "nvme", "grads": "nvme", "optimizer": "nvme"}


def make_engine(recipe: Recipe, placement: dict, swap_dir: str, extra: dict | None = None, rank: int = 0):
    cfg = recipe.config(**placement)
    swap = os.path.join(swap_dir, f"swap{rank}")
    os.makedirs(swap, exist_ok=True)
    cfg["nvme"] = {"paths": [swap]}
    for section, values in (extra or {}).items():
        cfg.setdefault(section, {}).update(values)
    return infinity.initialize(recipe.build(), cfg)


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


def run_then_save(rank, world, recipe, placement, root, ckpt, steps, extra=None):
    engine = make_engine(recipe, placement, root, extra, rank)
    with engine:
        losses = train_steps(engine, recipe, 0, steps, rank, world)
        engine.save_checkpoint(ckpt, user_state={"next_step": steps})
        if engine.config.checkpoint.background:  # keep training while the save finishes
            losses += train_steps(engine, recipe, steps, steps + 1, rank, world)
    return losses


def load_then_run(rank, world, recipe, placement, root, ckpt, extra=None):
    engine = make_engine(recipe, placement, root, extra, rank)
    with engine:
        user = engine.load_checkpoint(ckpt)
        losses = train_steps(engine, recipe, user["next_step"], recipe.steps, rank, world)
        return losses, engine.full_state_dict()


def uninterrupted(rank, world, recipe, placement, root, extra=None):
    engine = make_engine(recipe, placement, root, extra, rank)
    with engine:
        losses = train_steps(engine, recipe, 0, recipe.steps, rank, world)
        return losses, engine.full_state_dict()


def states_equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
