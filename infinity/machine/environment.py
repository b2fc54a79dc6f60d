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

from infinity.config.options import headroom_bytes
from infinity.config.sections import ConfigError
from infinity.device.process_group import join_process_group
from infinity.memory.plan import Budgets
from io_engine import format_size


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


def resolve_budgets(memory_cfg, device: torch.device, local_world_size: int, nvme_free: int, *,
                    check_machine: bool = True) -> Budgets:
    """Byte budgets per tier; "auto" means this rank's share of the free memory detected now (the RAM less
    `memory.headroom`: Note [headroom]; the nvme budget is `nvme_free`, the caller's, already less it).

    Note [budget check]: a budget set to more than this machine has (`memory.device_budget` over the GPU's
    memory, or the RAM without a GPU; `memory.host_budget` over the RAM) is refused at once with a
    ConfigError naming what the machine has, in `initialize`, the job and `infinity estimate` on this
    machine; `check_machine=False` for the what-if estimates of other machines (--world, --hardware)."""
    vm = psutil.virtual_memory()
    margin = headroom_bytes(memory_cfg.headroom, vm.total)  # Note [headroom]
    available = max(0, vm.available - margin) // max(1, local_world_size)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        device_auto, shared, device_name = free, False, f"GPU {device} has {format_size(total, exact=False)}"
    else:
        device_auto, shared, total = available, True, vm.total
        device_name = f"no GPU: the device tier is the RAM, {format_size(total, exact=False)}"
    device_budget = device_auto if memory_cfg.device_budget == "auto" else int(memory_cfg.device_budget)
    host_budget = available if memory_cfg.host_budget == "auto" else int(memory_cfg.host_budget)
    if check_machine:
        ram = f"{format_size(vm.total, exact=False)} of RAM ({format_size(vm.available, exact=False)} free now)"
        if memory_cfg.device_budget != "auto" and device_budget > total:
            raise ConfigError(f"memory.device_budget = {format_size(device_budget, exact=False)} is more than this "
                              f"machine has ({device_name}, {format_size(device_auto, exact=False)} free now): "
                              f'set it to at most that, or "auto"')
        if memory_cfg.host_budget != "auto" and host_budget > vm.total:
            raise ConfigError(f"memory.host_budget = {format_size(host_budget, exact=False)} is more than this "
                              f'machine has ({ram}): set it to at most that, or "auto"')
    return Budgets(device=device_budget, host=host_budget, nvme=nvme_free // max(1, local_world_size),
                   shared_ram=shared, ram=available if shared else None, activations=memory_cfg.reserved_activations)
