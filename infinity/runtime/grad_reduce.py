"""Gradient reduction: sum each unit's gradients over the ranks, as its ZeRO stage says, into its gradient store.

Stages 2-3 reduce-scatter every micro-batch's gradients and accumulate the rank's
partition; stages 0-1 accumulate the micro-batches' gradients locally, whole, and
reduce once, at the accumulation window's last micro-batch (stage 0 all-reduces,
stage 1 reduce-scatters): DDP's no_sync. Which of the two is one type each
(`EveryMicroBatch`, `OncePerWindow`), chosen once per issue from the stage; the
collective itself is the unit's (`UnitGradients.reduce` (units/gradients.py)).

Reductions are issued from the backward hooks as soon as a unit's gradients
are complete and completed in order, with at most `max_in_flight` outstanding
(each holds a full fp32 flat gradient). On the last micro-batch of an
accumulation window the squared norm of each finished gradient is kept for
clipping, so the step never reads gradients twice: each rank counts only its
partition (`UnitGradients.norm_part`), so the all-reduced sum is the true norm at every
stage.

Note [gradient sums ahead]: after a window's first backward, each unit's gradient is added to the window's sum so
far, read from the gradient store. Fetched when the unit's gradient is done, that read is on the backward's critical
path whenever the store is not where the add runs: the compute stream waits for the sum's copy up before the next
unit's backward (gradients in host memory on a GPU: a unit's sum of the 1.12B Llama is ~195 MB, ~4 ms up at 50 GB/s,
about as long as its backward on an H200), and the training thread waits for the disk (gradients on NVMe: RESULTS
D30). So the engine's pre-backward hook issues the fetch (`fetch_ahead`) as the unit's backward starts, and the read
runs under its backward (not the root's: it has no such hook, and its gradient ends the backward; held through all
of it, an embedding's sum would cost its size). It holds one more sum at a time (the working term `grad_sum_ahead`,
memory/traffic.py); a sum fetched ahead and not added by the backward's end is released then.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from infinity.device import collectives
from infinity.memory.manager import TieredMemoryManager
from infinity.memory.tier import Kind
from infinity.profile import Link, NullProfiler
from infinity.units.gradients import Reduction
from infinity.units.unit import Unit


class GradReducer:
    """Issues reductions, averages, accumulates into the gradient tier, tracks norms."""

    def __init__(self, manager: TieredMemoryManager, world_size: int, max_in_flight: int = 1, profiler=None, *,
                 before_unit: Callable[[Unit], None] | None = None,
                 on_final: Callable[[Unit, torch.Tensor], None] | None = None,
                 keep_final: Callable[[Unit, torch.Tensor, object], None] | None = None):
        self.manager, self.world_size, self.max_in_flight = manager, world_size, max_in_flight
        self.profiler = profiler or NullProfiler()
        self._in_flight: deque = deque()
        self._sumsq: dict[int, torch.Tensor] = {}  # unit index -> squared norm of its final gradient partition
        self._writes: list = []
        self._ahead: dict[int, object] = {}  # unit index -> its gradient sum's fetch, issued ahead (Pending)
        self.before_unit = before_unit  # called with a unit before its gradient store is touched
        self.on_final = on_final  # called with a unit and its partition's squared norm once its gradient is final
        # called with a unit, its final gradient as stored and the store's chunk(s), which the callee may keep to read
        # (never write) until the update (Note [device lane] in memory/placement.py)
        self.keep_final = keep_final

    def issue(self, unit: Unit, final: bool) -> None:
        """Start reducing `unit`'s gradients (its `.grad`s are consumed and cleared)."""
        when = EVERY_MICRO_BATCH if unit.ctx.stage.reduce_every_micro_batch else ONCE_PER_WINDOW
        reduction = when.issue(self, unit, unit.grads.take(), final)
        if reduction is None:
            return  # accumulated locally: nothing in flight
        self._in_flight.append((unit, reduction, final, when))
        limit = 0 if reduction.work is collectives.DONE else self.max_in_flight  # one rank: nothing to overlap
        while len(self._in_flight) > limit:
            self._complete(*self._in_flight.popleft())

    def drain(self) -> None:
        """Complete every reduction issued so far."""
        while self._in_flight:
            self._complete(*self._in_flight.popleft())

    def _complete(self, unit: Unit, reduction: Reduction, final: bool, when: "_When") -> None:
        prof = self.profiler
        if reduction.work is not collectives.DONE:
            name = f"{reduction.link.value} {unit.name}"
            with prof.wait(reduction.link, name):
                reduction.work.wait()  # the sum must be complete before it is averaged and accumulated
            reduction.timed.done()  # its span (Profiler.collective: device time on a GPU)
        out = reduction.kept
        if self.world_size > 1:
            out.div_(self.world_size)
        self.before(unit)
        acc, chunk = when.accumulate(self, unit, out)
        if final:
            offset, numel = unit.grads.norm_part()
            # fp32 norm (a reduction, no temporary copy), squared in fp64 for the global sum.
            self._sumsq[unit.index] = torch.linalg.vector_norm(acc.narrow(0, offset, numel)).double().square()
        self.store(unit, chunk, acc, release=acc is not out)
        if final and self.keep_final is not None:
            self.keep_final(unit, acc, chunk)
        if final and self.on_final is not None:
            self.on_final(unit, self._sumsq[unit.index])

    def before(self, unit: Unit) -> None:
        if self.before_unit is not None:
            self.before_unit(unit)

    def fetch_ahead(self, unit: Unit, device: torch.device, window_open: bool) -> None:
        """Issue the fetch of `unit`'s gradient sum so far as its backward starts (Note [gradient sums ahead]);
        `window_open`: the window has taken a backward already (the store holds this window's sum)."""
        m = self.manager
        ahead = window_open and unit.index not in self._ahead and unit.trainable_numel > 0
        if not ahead or m.is_zero(unit.index, Kind.GRADS):
            return
        self.before(unit)  # (no update is left reading the store inside a window: this waits for nothing)
        self._ahead[unit.index] = m.fetch(unit.index, Kind.GRADS, None, device, urgent=True)

    def fetch(self, unit: Unit, device: torch.device) -> torch.Tensor:
        """The window's gradient so far (the whole store), to add to: fetched ahead, or now."""
        pending = self._ahead.pop(unit.index, None)
        if pending is None:
            pending = self.manager.fetch(unit.index, Kind.GRADS, None, device, urgent=True)  # backward waits for it
        with self.profiler.wait(Link.NVME_READ, f"accumulate grads {unit.name}"):
            return pending.wait()

    def backward_ended(self) -> None:
        """Autograd's backward has returned (or raised): release the sums fetched ahead that no gradient took.
        (What is left to add after it, reductions still in flight and the zeros of units without a gradient,
        fetches its own: in flight then is the last gradient done, the root's, never fetched ahead.)"""
        for pending in self._ahead.values():
            self.manager.release(pending.wait())
        self._ahead.clear()

    def store(self, unit: Unit, chunk, tensor: torch.Tensor, release: bool) -> None:
        while self._writes:
            with self.profiler.wait(Link.NVME_WRITE, f"grad write-behind {unit.name}"):
                self._writes.pop(0).wait()  # one gradient store in write-behind at a time bounds its memory
        self._writes.append(self.manager.store(unit.index, Kind.GRADS, chunk, tensor, release=release))

    def take_sumsq(self, device: torch.device) -> torch.Tensor:
        """This rank's squared gradient norm over the finished window (fp64 scalar); resets it."""
        total = torch.zeros((), dtype=torch.float64, device=device)
        for v in self._sumsq.values():
            total += v.to(device)
        self._sumsq.clear()
        return total

    def flush_writes(self) -> None:
        for w in self._writes:
            w.wait()  # the optimizer reads these gradients next
        self._writes.clear()


class _When:
    """When a stage reduces gradients (the module docstring)."""

    def issue(self, reducer: GradReducer, unit: Unit, flat: torch.Tensor, final: bool) -> Reduction | None:
        """Issue the micro-batch's reduction, or accumulate it locally (None)."""
        raise NotImplementedError

    def accumulate(self, reducer: GradReducer, unit: Unit, out: torch.Tensor):
        """(the window's gradient with the reduced `out` in it, the chunk(s) of the gradient store it goes to)."""
        raise NotImplementedError


class EveryMicroBatch(_When):
    """Stages 2-3: reduce-scatter each micro-batch; the rank's partition of the sum is accumulated."""

    def issue(self, reducer, unit, flat, final):
        return unit.grads.reduce(flat)

    def accumulate(self, reducer, unit, out):
        if reducer.manager.is_zero(unit.index, Kind.GRADS):
            return out, None  # first micro-batch of the window: the reduced partition is the gradient
        acc = reducer.fetch(unit, out.device)
        return acc.add_(out), None


class OncePerWindow(_When):
    """Stages 0-1: each micro-batch's whole gradient is added to the local store (no communication); the last
    one adds the window's sum so far to its own and reduces that, once (stage 1: a reduce-scatter, the rank
    keeps its update range, stored in its chunks of the whole store; stage 0: an all-reduce of it all)."""

    def issue(self, reducer, unit, flat, final):
        m, grads = reducer.manager, unit.layout.grads
        local = flat.narrow(0, grads.start, grads.numel)  # the trainable elements (the rest of flat is zeros)
        reducer.before(unit)  # (its previous update is done with the store)
        if m.is_zero(unit.index, Kind.GRADS):
            if final:
                return unit.grads.reduce(flat)  # one micro-batch in this window
            reducer.store(unit, None, local, release=False)  # the window's first micro-batch
            return None
        earlier = reducer.fetch(unit, flat.device)
        if not final:
            reducer.store(unit, None, earlier.add_(local), release=True)
            return None
        local.add_(earlier)  # the window's sum on this rank
        m.release(earlier)
        return unit.grads.reduce(flat)

    def accumulate(self, reducer, unit, out):
        return out, reducer.manager.optimizer_chunk(unit.index, Kind.GRADS, None)


EVERY_MICRO_BATCH, ONCE_PER_WINDOW = EveryMicroBatch(), OncePerWindow()
