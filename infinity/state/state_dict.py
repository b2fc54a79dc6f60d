"""Gathering the fp32 master weights into one state dict on rank 0, unit by unit."""

from __future__ import annotations

import torch
import torch.nn as nn

from infinity.device import collectives
from infinity.memory.manager import TieredMemoryManager
from infinity.memory.tier import Kind
from infinity.units.tiling import Tiling
from infinity.units.unit import Unit


def own_partition_fp32(unit: Unit, manager: TieredMemoryManager) -> torch.Tensor:
    """This rank's partition [r*s, (r+1)*s) of the unit's values in fp32: its trainable elements from the master
    (every stage's update range holds them), the rest (frozen weights, padding) from the parameters, cast
    (they have no master: Note [stage layouts]). Every rank stores its own partition at every stage."""
    lay, cpu = unit.layout, torch.device("cpu")
    start = unit.ctx.rank * unit.shard_numel
    own = max(0, min(unit.shard_numel, unit.stored_trainable - start))
    out = torch.empty(unit.shard_numel, dtype=torch.float32)
    if own:
        master = manager.fetch(unit.index, Kind.MASTER, None, cpu).wait()
        out[:own].copy_(master.narrow(0, start - lay.update.start, own))
        manager.release(master)
    if own < unit.shard_numel:
        params = manager.fetch(unit.index, Kind.PARAMS, None, cpu).wait()
        out[own:].copy_(params.narrow(0, start + own - lay.params.start, unit.shard_numel - own))
        manager.release(params)
    return out


def gather_unit_master(unit: Unit, manager: TieredMemoryManager, every_rank: bool = False) -> torch.Tensor | None:
    """The unit's full fp32 values (the masters; frozen weights from their parameters) on rank 0 (None
    elsewhere; on every rank with `every_rank`)."""
    ctx = unit.ctx
    shard = own_partition_fp32(unit, manager)
    if ctx.group is None:
        return shard
    on = ctx.device  # NCCL gathers device tensors; gloo CPU ones
    full = torch.empty(unit.padded_numel, dtype=torch.float32, device=on)
    collectives.all_gather_into(full, shard.to(on), ctx.group).wait()  # rank 0 reads the gathered bytes next
    return full.cpu() if ctx.rank == 0 or every_rank else None


def full_state_dict(model: nn.Module, units: list[Unit], manager: TieredMemoryManager, rank: int,
                    tiling: Tiling | None = None) -> dict:
    """Keys and order as `model.state_dict()` before tiling (a tiled parameter is its tiles concatenated: Note
    [tiles are units] in units/tiling.py); parameters from the fp32 masters (frozen ones from their
    parameters); rank 0 only."""
    values: dict[str, torch.Tensor] = {}
    for unit in units:
        if unit.flat_numel == 0:
            continue
        full = gather_unit_master(unit, manager)
        if full is None:
            continue
        for slot in unit.slots:
            value = full.narrow(0, slot.offset, slot.numel).view(slot.shape).clone()
            for name in slot.names:
                values[name] = value
    if rank != 0:
        return {}
    out = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        out[key] = values[key] if key in values else tensor.detach().cpu().clone()
    return tiling.untile(out) if tiling is not None else out
