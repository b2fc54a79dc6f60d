"""Gathering the fp32 master weights into one state dict on rank 0, unit by unit."""

from __future__ import annotations

import torch
import torch.nn as nn

from . import collectives
from .memory.manager import TieredMemoryManager
from .memory.tier import Kind
from .unit import Unit


def gather_unit_master(unit: Unit, manager: TieredMemoryManager) -> torch.Tensor | None:
    """The unit's full fp32 master flat on rank 0 (None elsewhere)."""
    comm = unit.comm
    shard = manager.fetch(unit.index, Kind.MASTER, None, torch.device("cpu")).wait()
    if comm.group is None:
        full = shard.clone()
    else:
        on = comm.device  # NCCL gathers device tensors; gloo CPU ones
        full = torch.empty(unit.padded_numel, dtype=torch.float32, device=on)
        collectives.all_gather_into(full, shard.to(on), comm.group).wait()  # rank 0 reads the gathered bytes next
        full = full.cpu() if comm.rank == 0 else None
    manager.release(shard)
    return full


def full_state_dict(model: nn.Module, units: list[Unit], manager: TieredMemoryManager, rank: int) -> dict:
    """Keys and order as `model.state_dict()`; parameters from the fp32 masters; rank 0 only."""
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
    return out
