"""Gradient reduction: reduce-scatter each unit's gradients and accumulate them into its shard.

Reductions are issued from the backward hooks as soon as a unit's gradients
are complete and completed in order, with at most `max_in_flight` outstanding
(each holds a full fp32 flat gradient). On the last micro-batch of an
accumulation window the squared norm of each finished gradient shard is kept
for clipping, so the step never reads gradients twice.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import torch

from . import collectives
from .memory.manager import TieredMemoryManager
from .memory.tier import Kind
from .profile import Link, NullProfiler
from .unit import Unit


class GradReducer:
    """Issues reduce-scatters, averages, accumulates into the gradient tier, tracks norms."""

    def __init__(self, manager: TieredMemoryManager, world_size: int, max_in_flight: int = 1, profiler=None, *,
                 before_unit: Callable[[Unit], None] | None = None,
                 on_final: Callable[[Unit, torch.Tensor], None] | None = None):
        self.manager, self.world_size, self.max_in_flight = manager, world_size, max_in_flight
        self.profiler = profiler or NullProfiler()
        self._in_flight: deque = deque()
        self._sumsq: dict[int, torch.Tensor] = {}  # unit index -> squared norm of its final gradient shard
        self._writes: list = []
        self.before_unit = before_unit  # called with a unit before its gradient shard is touched
        self.on_final = on_final  # called with a unit and its shard's squared norm once its window's gradient is final

    def issue(self, unit: Unit, final: bool) -> None:
        """Start reducing `unit`'s gradients (its `.grad`s are consumed and cleared)."""
        out, work = unit.reduce_grads()
        self._in_flight.append((unit, out, work, final))
        limit = 0 if work is collectives.DONE else self.max_in_flight  # one rank: nothing to overlap
        while len(self._in_flight) > limit:
            self._complete(*self._in_flight.popleft())

    def drain(self) -> None:
        """Complete every reduction issued so far."""
        while self._in_flight:
            self._complete(*self._in_flight.popleft())

    def _complete(self, unit: Unit, out: torch.Tensor, work, final: bool) -> None:
        prof = self.profiler
        if work is not collectives.DONE:
            with prof.wait(Link.REDUCE_SCATTER, f"reduce-scatter {unit.name}"):
                work.wait()  # the summed shard must be complete before it is averaged and accumulated
            prof.record(f"reduce-scatter {unit.name}", Link.REDUCE_SCATTER, unit.reduce_issued, time.perf_counter(),
                        num_bytes=unit.padded_numel * 4, unit=unit.name)
        if self.world_size > 1:
            out.div_(self.world_size)
        m = self.manager
        if self.before_unit is not None:
            self.before_unit(unit)
        if m.is_zero(unit.index, Kind.GRADS):
            acc = out  # first micro-batch of the window: the reduced shard is the gradient
        else:
            pending = m.fetch(unit.index, Kind.GRADS, None, out.device, urgent=True)  # backward waits for it
            with prof.wait(Link.NVME_READ, f"accumulate grads {unit.name}"):
                acc = pending.wait()  # the window's earlier gradient is added to
            acc.add_(out)
        if final:
            grads, update = unit.layout.grads, unit.layout.update
            own = acc.narrow(0, update.start - grads.start, update.numel)  # the gradients this rank updates
            # fp32 norm (a reduction, no temporary copy of the shard), squared in fp64 for the global sum.
            self._sumsq[unit.index] = torch.linalg.vector_norm(own).double().square()
        while self._writes:
            with prof.wait(Link.NVME_WRITE, f"grad write-behind {unit.name}"):
                self._writes.pop(0).wait()  # one gradient shard in write-behind at a time bounds its memory
        self._writes.append(m.store(unit.index, Kind.GRADS, None, acc, release=acc is not out))
        if final and self.on_final is not None:
            self.on_final(unit, self._sumsq[unit.index])

    def take_sumsq(self, device: torch.device) -> torch.Tensor:
        """This rank's squared gradient norm over the finished window (fp64 scalar); resets it."""
        total = torch.zeros((), dtype=torch.float64, device=device)
        for v in self._sumsq.values():
            total += v.to(device)
        self._sumsq.clear()
        return total

    def flush_writes(self) -> None:
        for w in self._writes:
            w.wait()  # the optimizer reads these gradient shards next
        self._writes.clear()
