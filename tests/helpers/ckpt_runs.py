"""Training runs that save and resume, shared by the checkpoint and kill tests."""

from __future__ import annotations

import os

import torch

import infinity
from engine_runs import train_steps  # noqa: F401 - the shared loop, re-exported for the tests
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
