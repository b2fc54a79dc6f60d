"""The process group: the one home of creating it and of the object-level agreements between ranks.

Creating the default group (torchrun's environment: NCCL with a GPU, gloo without) and the host-side
agreements the job, the environment and checkpoints need (a barrier, rank 0's object on every rank, every
rank's object, every rank's flag) live here; the tensor collectives of a step are in collectives.py. Every
function takes the process group, None for a single process, where it costs nothing.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


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


def default_group():
    """The default group once created, else None (a single process)."""
    return dist.group.WORLD if dist.is_initialized() else None


def rank_and_world(group) -> tuple[int, int]:
    """This process's rank in `group` and the group's size ((0, 1) for None)."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def world_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def barrier(group) -> None:
    """Wait until every rank of `group` arrives (None: a single process, nothing to wait for)."""
    if group is not None:
        dist.barrier(group=group)


def broadcast_object(obj, group, src: int = 0):
    """Rank `src`'s picklable `obj` on every rank."""
    if group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def gather_object(obj, group) -> list:
    """Every rank's picklable `obj`, in rank order, on every rank."""
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj)
    return out


def any_rank(flag: bool, group, device: torch.device) -> bool:
    """Whether `flag` is true on any rank of `group` (a MAX all-reduce on `device`, the group's backend's)."""
    if group is None:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(int(t.cpu()))
