"""A unit's gradients: the fp32 flat gradient its backward fills parameter by parameter, which parameters got
one in the accumulation window, and its sum over the ranks as the ZeRO stage says (reduce-scatter into the
rank's partition, or stage 0's all-reduce), with the part of it this rank counts in the global norm. When and
where a reduction runs is grad_reduce.py's (runtime/).

Note [trainable flat gradient]: a unit's trainable elements lead its flat buffer ([0, T): Note [stage layouts]), so
its backward fills only those. The flat gradient is that prefix wherever the reduction reads nothing else: one
rank (the update range is a view of it) and stage 0 (the all-reduce of the trainable part); where a reduce-scatter
partitions it over several ranks (stages 1-3) it is the whole padded unit, each rank's partition at its place
(`UnitLayout.flat_grad_numel`, stages.py). Until 2026-11-29 it was always the whole unit: a LoRA unit of a
pretrained 2048-wide Llama (84M elements, ~66K of them trainable) zero-filled 338 MB a backward, and on the
what-if H200 (benchmarks/largest_whatif.py) the byte model reserved 24 GiB of GPU memory for a 405B-wide LoRA
unit's flat gradient and its shard."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infinity.device import collectives
from infinity.memory.stages import UnitLayout
from infinity.profile import Link
from infinity.units.context import UnitContext
from infinity.units.sharded_param import ParamSlot


@dataclass(frozen=True)
class Reduction:
    """An issued sum of a unit's gradient over the ranks: what this rank keeps of it, and the collective."""

    kept: torch.Tensor
    work: object  # the handle (collectives.DONE with one rank)
    link: Link | None = None
    num_bytes: int = 0  # Note [collective bytes] (profile/records.py)
    timed: object = None  # its profile span (Profiler.collective): `done()` once waited for


class UnitGradients:
    """One unit's gradient on this rank: filled by its backward, handed over, reduced."""

    def __init__(self, ctx: UnitContext, slots: list[ParamSlot], layout: UnitLayout,
                 shard_start: int, shard_numel: int, stored_trainable: int, unit_name: str = ""):
        self.ctx, self.slots, self.layout = ctx, slots, layout  # (the flat size: Note [trainable flat gradient])
        self.unit_name = unit_name  # (its reductions' profile spans name it)
        self.shard_start, self.shard_numel, self.stored_trainable = shard_start, shard_numel, stored_trainable
        self.flat: torch.Tensor | None = None  # this backward's gradients, filled parameter by parameter
        self.slots_with_grad: set[int] = set()  # ids of slots that got a gradient in this accumulation window

    def absorb(self, slot: ParamSlot) -> None:
        """Move one parameter's fresh `.grad` into the unit's fp32 flat gradient (and free it), so at
        most one parameter's gradient exists beside the flat buffer."""
        if self.flat is None:
            self.flat = torch.zeros(self.layout.flat_grad_numel, dtype=torch.float32, device=self.ctx.device)
        self.flat.narrow(0, slot.offset, slot.numel).copy_(slot.param.grad.reshape(-1))
        slot.param.grad = None
        self.slots_with_grad.add(id(slot))

    def flags(self) -> list[bool]:
        """Per trainable slot (flat order): did it get a gradient in this accumulation window?"""
        return [id(s) in self.slots_with_grad for s in self.slots if s.requires_grad]

    def take(self) -> torch.Tensor:
        """This backward's flat fp32 gradient, handed over (zeros where parameters got no gradient)."""
        flat, self.flat = self.flat, None
        if flat is None:
            flat = torch.zeros(self.layout.flat_grad_numel, dtype=torch.float32, device=self.ctx.device)
        return flat

    def reduce(self, flat: torch.Tensor) -> Reduction:
        """Issue: sum a flat fp32 gradient over the ranks as the stage says: reduce-scatter into this rank's
        partition (stages 1-3), or all-reduce the whole trainable part (stage 0). The result's `kept` is
        the sum over this rank's update range (`layout.update`), where the optimizer reads it. Parameters
        without a gradient contribute zeros."""
        ctx, update = self.ctx, self.layout.update
        if ctx.group is None:
            return Reduction(flat.narrow(0, update.start, update.numel), collectives.DONE)  # one rank: no copy
        ctx.streams.wait_event(ctx.streams.record(), ctx.streams.comm)  # the flat gradient is written on compute
        scatter = ctx.stage.optimizer_partitioned
        link = Link.REDUCE_SCATTER if scatter else Link.ALL_REDUCE  # Note [collective bytes]: the volume
        volume = flat.numel() if scatter else 2 * update.numel
        timed = ctx.profiler.collective(f"{link.value} {self.unit_name}", link, stream=ctx.streams.comm,
                                        num_bytes=volume * 4, unit=self.unit_name)
        with ctx.streams.use(ctx.streams.comm), timed:
            if scatter:
                out = torch.empty(self.shard_numel, dtype=torch.float32, device=ctx.device)
                work = collectives.reduce_scatter_sum(out, flat, ctx.group)
                kept = out.narrow(0, update.start - self.shard_start, update.numel)
            else:
                kept = flat.narrow(0, update.start, update.numel)
                work = collectives.all_reduce_sum(kept, ctx.group, async_op=True)
            if ctx.streams.is_cuda:
                work.wait()  # (NCCL: the comm stream waits for it, not the host) its device span ends when it does
        ctx.streams.hold(flat, ctx.streams.comm)
        return Reduction(kept, work, link, volume * 4, timed)

    def norm_part(self) -> tuple[int, int]:
        """(offset, numel) within a reduction's `kept` of the gradient this rank counts in the global norm:
        its partition's trainable elements (stage 0 keeps them all, and each rank counts its partition)."""
        start = self.shard_start
        numel = max(0, min(self.shard_numel, self.stored_trainable - start))
        return (start - self.layout.update.start, numel) if numel else (0, 0)  # (a frozen partition: nothing)
