"""Collectives as pure functions over flat tensors: all-gather, reduce-scatter, all-reduce (the process group
and the host-side agreements between ranks: process_group.py).

Every function takes the process group (None = single process) and returns a
handle with `wait()`, so a caller can issue a collective early and wait for it
later. With no group (world size 1) they are local copies.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from infinity.device.process_group import world_size


class _Done:
    """Handle of a collective that already completed (world size 1)."""

    def wait(self) -> bool:
        return True


DONE = _Done()


def all_gather_into(out: torch.Tensor, shard: torch.Tensor, group, async_op: bool = True):
    """Gather every rank's `shard` into `out` (concatenated in rank order)."""
    assert out.numel() == shard.numel() * world_size(group), (out.numel(), shard.numel(), world_size(group))
    if group is None:
        out.copy_(shard)
        return _Done()
    return _all_gather_fn()(out, shard, group=group, async_op=async_op) or _Done()


def _all_gather_fn():
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single and deprecated the old name.
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_fn():
    # torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single and deprecated the old name.
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_scatter_sum(out: torch.Tensor, full: torch.Tensor, group, async_op: bool = True):
    """Sum `full` over ranks and leave this rank's slice in `out`.

    Averaging is the caller's division: gloo has no AVG reduction.
    """
    assert full.numel() == out.numel() * world_size(group), (full.numel(), out.numel(), world_size(group))
    if group is None:
        out.copy_(full)
        return _Done()
    return _reduce_scatter_fn()(out, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op) or _Done()


def all_reduce_sum(tensor: torch.Tensor, group, async_op: bool = False):
    """Sum `tensor` in place over ranks (e.g. the squared gradient norm)."""
    if group is None:
        return _Done()
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op) or _Done()


def all_reduce_max(tensor: torch.Tensor, group, async_op: bool = False):
    if group is None:
        return _Done()
    return dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=async_op) or _Done()
