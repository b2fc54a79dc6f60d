"""Many ZeRO-stage training runs inside one process group (one launch per world size, tests/test_zero_stages.py)."""

from __future__ import annotations

import os

import infinity
from engine_runs import train_steps
from reference import Recipe

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


def stage_run(recipe: Recipe, stage: int, placement: dict, overlap: bool, root: str, rank: int, world: int) -> dict:
    """One run: losses, grad norms, the state dict (rank 0), the update mode, each unit's (padded, flat) numel,
    and per step the bytes on each collective link (Note [collective bytes])."""
    cfg = recipe.config(**placement)
    cfg["zero"] = {"stage": stage}
    cfg["overlap"] = {"optimizer_with_backward": overlap}
    cfg["profile"] = {"enabled": True, "trace_dir": os.path.join(root, "trace")}
    if "nvme" in placement.values():
        cfg["nvme"] = {"paths": [os.path.join(root, f"swap{rank}")]}
        os.makedirs(cfg["nvme"]["paths"][0], exist_ok=True)
    engine = infinity.initialize(recipe.build(), cfg)
    losses, norms = [], []
    try:
        for step in range(recipe.steps):
            losses += train_steps(engine, recipe, step, step + 1, rank, world)
            norms.append(engine.last_grad_norm)
        state = engine.full_state_dict()
        out = {"losses": losses, "norms": norms, "state": state, "mode": type(engine.updates).__name__,
               "units": [(u.padded_numel, u.flat_numel) for u in engine.units],
               "itemsize": engine.compute_dtype.itemsize}
    finally:
        engine.close()
    steps = engine.profiler.summary()["steps"]
    out["collective_bytes"] = [{k: s["links"].get(k, {"bytes": 0})["bytes"] for k in COLLECTIVES} for s in steps]
    return out


def cases_on_rank(rank: int, world: int, cases: list[tuple], root: str) -> list[dict]:
    """Every (recipe, stage, placement, overlap) case in turn on this rank, each in its own directory."""
    return [stage_run(recipe, stage, placement, overlap, os.path.join(root, f"c{i}"), rank, world)
            for i, (recipe, stage, placement, overlap) in enumerate(cases)]
