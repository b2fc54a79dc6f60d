"""Prefetch: predict which units run next and issue their unshard early.

The forward order of the units is recorded on the first step and replayed on
the next ones; while unit i computes, the fetches of the next `units_ahead`
units are in flight (NVMe reads, host-to-device copies), within
`max_bytes_in_flight`. Backward runs in the reverse of the forward order this
step actually took, so it is always predicted exactly. When the forward order
changes (a branch, a skipped or repeated unit, eval), the mismatch stops the
replay for the rest of the step: what was not predicted is fetched on demand,
what was predicted but not used is released, and the new order is recorded.

With several ranks the all-gather of the unit predicted next is issued as soon
as the unit before it has its parameters (`gather_ahead`), so it runs on the
comm stream while that unit computes. Collectives must be issued in the same
order on every rank, and they are, though whether a unit is prefetched may differ
between ranks (its update may still run on one rank's worker): in forward only
all-gathers are issued, each after the previous unit's and before the next one's,
early or not; in backward every unit still to come is ready (the forward waited
for its update), so the decisions depend only on the recorded order and the
shard sizes, which all ranks share.

Note [backward prefetch]: the backward's first units are issued when the forward
ends (the last unit of the forward was resharded after it; without this its
backward, and its recomputation with activation checkpointing, would fetch it on
demand every step), and each unit's pre-backward issues the next ones. The same
calls issue the copy back of offloaded checkpoint inputs (`fetch_inputs`, Note
[activation offload]) one unit ahead. A recomputed forward never reaches
`before_forward` (Note [unit checkpoints], Note [recomputed forward]), so the
recorded order stays the forward's. `wait_for` counts each unshard it waits for as
a hit (issued ahead), after its update (predicted, but skipped by the prefetch
because the overlapped optimizer was still updating it: with clipping the update
runs in the next forward, Note [overlap]; the fetch waits for the update by design)
or on demand (nothing predicted it, or the window was full), per unit but the root
(fetched at each forward's start by design); the profile marks the on-demand ones
(`ON_DEMAND`). The forward's first units are issued when the root starts it.
"""

from __future__ import annotations

import enum
import time

from infinity.memory.manager import TieredMemoryManager
from infinity.profile.records import ON_DEMAND, Link
from infinity.units.unit import Unit, UnitState


class TraceState(enum.Enum):
    RECORDING = "recording"  # no valid order yet: fetch on demand, record
    REPLAYING = "replaying"  # the recorded order held so far this step
    DIVERGED = "diverged"  # this step left the recorded order: on demand until the step ends


class OrderTrace:
    """The forward order of unit indices: record, replay, invalidate."""

    def __init__(self):
        self.recorded: list[int] = []
        self.current: list[int] = []
        self.state = TraceState.RECORDING

    def on_forward(self, index: int, ahead: int) -> list[int]:
        """Note that `index` runs now; returns the units predicted to run next."""
        pos = len(self.current)
        self.current.append(index)
        if self.state is TraceState.REPLAYING:
            if pos < len(self.recorded) and self.recorded[pos] == index:
                return self.recorded[pos + 1: pos + 1 + ahead]
            self.state = TraceState.DIVERGED
        return []

    def end_forward(self) -> list[int]:
        """Close this step's forward; returns its order (the backward runs it in reverse)."""
        order, self.current = self.current, []
        if order:
            if order != self.recorded:
                self.recorded = order  # re-record: the next step replays what this one did
            self.state = TraceState.REPLAYING
        return order

    def abandon_forward(self) -> None:
        """This forward raised partway (Note [failed forward]): forget its order; the next one replays as before."""
        self.current = []
        self.state = TraceState.REPLAYING if self.recorded else TraceState.RECORDING

    def invalidate(self) -> None:
        self.recorded, self.current, self.state = [], [], TraceState.RECORDING


class Prefetcher:
    """Issues unshards ahead of use within the window; releases what was not used."""

    def __init__(self, units: list[Unit], manager: TieredMemoryManager, units_ahead: int, max_bytes_in_flight: int,
                 ready=None, trace: OrderTrace | None = None, fetch_inputs=None):
        self.units, self.manager = units, manager
        self.ready = ready or (lambda index: True)  # False while a unit's parameters are being updated
        self.units_ahead, self.max_bytes = units_ahead, max_bytes_in_flight
        self.trace = trace or OrderTrace()  # (shared with the update mode, which updates in forward order)
        self._backward_order: list[int] = []
        self._next: int | None = None  # the unit predicted to run after the one starting now
        self.fetch_inputs = fetch_inputs or (lambda indices: None)  # offloaded activations (Note [backward prefetch])
        self.issued = 0  # prefetches issued (for tests and the profile)
        self.wasted = 0  # prefetches released unused
        self.hits = 0  # unshards waited for that a prefetch had issued
        self.on_demand = 0  # unshards the wait itself had to issue (Note [backward prefetch])
        self.after_update = 0  # unshards issued by the wait because the unit's update ran at prefetch time
        self._updating: set[int] = set()  # units skipped by a prefetch while their update ran

    def _in_flight_bytes(self) -> int:
        return sum(u.shard_bytes for u in self.units if u.state in (UnitState.UNSHARDING, UnitState.GATHERING))

    def _issue(self, indices: list[int]) -> None:
        for i in indices:
            unit = self.units[i]
            if unit.state is not UnitState.SHARDED or unit.flat_numel == 0:
                continue
            if not self.ready(i):
                self._updating.add(i)  # predicted, but its update runs: fetched once it is done
                continue
            if self._in_flight_bytes() + unit.shard_bytes > self.max_bytes:
                break
            unit.unshard(self.manager)
            self.issued += 1

    def before_forward(self, unit: Unit) -> None:
        if unit.index == 0:  # the root starts the forward: the recorded order's first units come next
            replaying = self.trace.state is TraceState.REPLAYING
            self._issue(self.trace.recorded[:self.units_ahead] if replaying else [])
            self._next = self.trace.recorded[0] if replaying and self.trace.recorded else None
            return
        predicted = self.trace.on_forward(unit.index, self.units_ahead)
        self._issue(predicted)
        self._next = predicted[0] if predicted else None

    def end_forward(self, backward_follows: bool = True) -> None:
        order = self.trace.end_forward()
        backward, seen = [], set()
        for i in reversed(order):  # a unit that ran twice is needed first by its last call's backward
            if i not in seen:
                seen.add(i)
                backward.append(i)
        self._backward_order = backward
        if backward_follows:
            self.fetch_inputs(backward[:1])  # (Note [backward prefetch])
            self._issue(backward[:self.units_ahead])

    def before_backward(self, unit: Unit) -> None:
        order = self._backward_order
        if unit.index in order:
            pos = order.index(unit.index)
            self.fetch_inputs(order[pos: pos + 2])  # its own, if not yet, and the next unit's
            if self.units_ahead:
                predicted = order[pos + 1: pos + 1 + self.units_ahead]
                self._issue(predicted)
                self._next = predicted[0] if predicted else None

    def wait_for(self, unit: Unit) -> None:
        """Wait for `unit`'s parameters, counting whether a prefetch had issued them (Note [backward prefetch])."""
        if unit.index != 0 and unit.flat_numel and not unit.aliased:
            if unit.state is not UnitState.SHARDED:
                self.hits += 1
            elif unit.index in self._updating:
                self.after_update += 1
            else:
                self.on_demand += 1
                now = time.perf_counter()
                unit.ctx.profiler.record(f"{ON_DEMAND} {unit.name}", Link.COMPUTE, now, now, unit=unit.name)
            self._updating.discard(unit.index)
        unit.wait_for_unshard(self.manager)

    def gather_ahead(self) -> None:
        """The unit starting now has its parameters: issue the all-gather of the one predicted next (its
        fetch issued earlier) so that it runs while this one computes. One rank gathers nothing, nor do whole
        parameters (stages 0-2) but once after an update: their fetch is not waited for here."""
        index, self._next = self._next, None
        if index is not None and self.units[index].gathers() and self.units[index].state is UnitState.UNSHARDING:
            self.units[index].issue_gather(self.manager)

    def abandon_forward(self) -> None:
        """The forward raised partway (Note [failed forward]): its order is forgotten and what it prefetched
        is released; no backward follows it."""
        self.trace.abandon_forward()
        self._updating.clear()
        self.release_unused()

    def release_unused(self) -> None:
        """Drop prefetched units that were not used (order changed, or no backward came)."""
        self._next = None
        for unit in self.units:
            if unit.state in (UnitState.UNSHARDING, UnitState.GATHERING):
                unit.cancel_unshard(self.manager)
                self.wasted += 1
