"""ZeRO-stage training runs, many inside one process group (one launch per world size:
tests/runtime/test_zero_stages.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import infinity
from engine_runs import train_steps
from reference import Recipe

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class Case:
    recipe: Recipe
    stage: int
    placement: dict
    overlap: bool
    save: str | None = None  # save a checkpoint here after `split` steps (and train on)
    load: str | None = None  # start from this checkpoint, saved after `split` steps
    split: int = 1


def record_flat_gradients(engine) -> list[set[int]]:
    """Per unit, the sizes of the flat gradients its backwards handed to the reduction (Note [trainable flat
    gradient]), filled in as the engine trains."""
    flats: list[set[int]] = [set() for _ in engine.units]
    for unit, seen in zip(engine.units, flats):
        def take(grads=unit.grads, take=unit.grads.take, seen=seen):
            flat = take()
            seen.add(flat.numel())
            return flat
        unit.grads.take = take
    return flats


def stage_run(case: Case, root: str, rank: int, world: int) -> dict:
    """One run: losses, grad norms, the state dict (rank 0), the update mode, each unit's (padded, flat, trainable)
    numel, the sizes of the flat gradients each unit's backwards filled,
    and per step the bytes on each collective link (Note [collective bytes])."""
    cfg = case.recipe.config(**case.placement)
    cfg["zero"] = {"stage": case.stage}
    cfg["overlap"] = cfg.get("overlap", {}) | {"optimizer_with_backward": case.overlap}
    cfg["profile"] = {"enabled": True, "trace_dir": os.path.join(root, "trace")}
    if "nvme" in case.placement.values():
        cfg["nvme"] = {"paths": [os.path.join(root, f"swap{rank}")]}
        os.makedirs(cfg["nvme"]["paths"][0], exist_ok=True)
    engine = infinity.initialize(case.recipe.build(), cfg)
    flats = record_flat_gradients(engine)
    losses, norms = [], []
    try:
        first = 0
        if case.load is not None:
            first = engine.load_checkpoint(case.load)["next_step"]
        for step in range(first, case.recipe.steps):
            losses += train_steps(engine, case.recipe, step, step + 1, rank, world)
            norms.append(engine.last_grad_norm)
            if case.save is not None and step + 1 == case.split:
                engine.save_checkpoint(case.save, {"next_step": step + 1})
        state = engine.full_state_dict()
        out = {"losses": losses, "norms": norms, "state": state, "mode": type(engine.updates).__name__,
               "units": [(u.padded_numel, u.flat_numel, u.stored_trainable) for u in engine.units],
               "itemsize": engine.compute_dtype.itemsize, "first": first,
               "aliased": [u.aliased for u in engine.units], "flats": flats}
        engine.clock.close()  # the last step ends here (as close() would end it)
        steps = engine.profiler.summary()["steps"]
        engine.profiler.clear()  # close() has no steps to write trace files of (the chart costs a second)
    finally:
        engine.close()
    out["collective_bytes"] = [{k: s["links"].get(k, {"bytes": 0})["bytes"] for k in COLLECTIVES} for s in steps]
    return out


def cases_on_rank(rank: int, world: int, cases: list[Case], root: str) -> list[dict]:
    """Every case in turn on this rank, each in its own directory."""
    return [stage_run(case, os.path.join(root, f"w{world}c{i}"), rank, world) for i, case in enumerate(cases)]
