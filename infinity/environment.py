"""Where a run executes: process group, compute device, memory budgets, preflight checks.

Everything here runs once at `initialize`, before any state is built, so that a
run that cannot fit or cannot write its swap files fails in seconds with a
message that says what to change.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist

from .memory.placement import Budgets


class PreflightError(RuntimeError):
    """The machine cannot run this configuration; the message names the fix."""


@dataclass(frozen=True)
class Placement:
    group: object  # process group, None for one process
    rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    owns_group: bool  # initialize created the default group (close destroys it)


def resolve(group=None) -> Placement:
    """The process group (given, existing default, or created from torchrun's environment) and device."""
    owns = False
    if group is None and not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        owns = True
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
    return Placement(group=group, rank=rank, world_size=world, local_world_size=local_world, device=device,
                     owns_group=owns)


def check_nvme_paths(paths: list[str]) -> int:
    """Each swap directory exists and is writable; returns the free bytes over distinct filesystems."""
    free, seen_devices = 0, set()
    for path in paths:
        if not os.path.isdir(path):
            raise PreflightError(f"nvme.paths entry {path!r} does not exist or is not a directory: create it "
                                 f"(mkdir -p {path}) or point nvme.paths at a directory on a fast local disk")
        try:
            with tempfile.NamedTemporaryFile(dir=path, prefix=".infinity-probe-"):
                pass
        except OSError as e:
            raise PreflightError(f"nvme.paths entry {path!r} is not writable ({e.strerror}): swap files cannot be "
                                 f"created there; choose a writable directory on a local disk") from e
        st = os.stat(path)
        if st.st_dev not in seen_devices:
            seen_devices.add(st.st_dev)
            free += shutil.disk_usage(path).free
    return free


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
