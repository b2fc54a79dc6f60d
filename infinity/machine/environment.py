"""Where a run executes: process group, compute device, memory budgets.

Everything here runs once at `initialize`, before any state is built (the checks
that the machine can run the plan are infinity/machine/preflight.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist

from infinity.memory.placement import Budgets


def init_process_group(backend: str | None = None) -> None:
    """Create the default process group: the one place the project does (NCCL with a GPU, after making
    LOCAL_RANK's GPU current; gloo without), unless `backend` is given."""
    if backend is None and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"))


def join_process_group() -> bool:
    """Under torchrun (WORLD_SIZE > 1) with no default group yet, create it; returns whether this call did."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    init_process_group()
    return True


@dataclass(frozen=True)
class ProcessEnv:
    """This process's place in the run: its process group, rank and device."""

    group: object  # process group, None for one process
    rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    owns_group: bool  # initialize created the default group (close destroys it)


def resolve(group=None) -> ProcessEnv:
    """The process group (given, existing default, or created from torchrun's environment) and device."""
    owns = join_process_group() if group is None else False
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", str(rank % max(1, torch.cuda.device_count()))))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world == 1:
        group = None  # a single process needs no collectives
    return ProcessEnv(group=group, rank=rank, world_size=world, local_world_size=local_world, device=device,
                      owns_group=owns)


def resolve_budgets(memory_cfg, device: torch.device, local_world_size: int, nvme_free: int) -> Budgets:
    """Byte budgets per tier; "auto" means this rank's share of the free memory detected now."""
    available = psutil.virtual_memory().available // max(1, local_world_size)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        device_auto, shared = free, False
    else:
        device_auto, shared = available, True
    device_budget = device_auto if memory_cfg.device_budget == "auto" else int(memory_cfg.device_budget)
    host_budget = available if memory_cfg.host_budget == "auto" else int(memory_cfg.host_budget)
    return Budgets(device=device_budget, host=host_budget, nvme=nvme_free // max(1, local_world_size),
                   shared_ram=shared, ram=available if shared else None)
