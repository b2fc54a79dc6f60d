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
"""

from __future__ import annotations

import enum

from .memory.manager import TieredMemoryManager
from .unit import Unit, UnitState


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

    def invalidate(self) -> None:
        self.recorded, self.current, self.state = [], [], TraceState.RECORDING


class Prefetcher:
    """Issues unshards ahead of use within the window; releases what was not used."""

    def __init__(self, units: list[Unit], manager: TieredMemoryManager, units_ahead: int, max_bytes_in_flight: int,
                 ready=None, trace: OrderTrace | None = None):
        self.units, self.manager = units, manager
        self.ready = ready or (lambda index: True)  # False while a unit's parameters are being updated
        self.units_ahead, self.max_bytes = units_ahead, max_bytes_in_flight
        self.trace = trace or OrderTrace()  # (shared with the update mode, which updates in forward order)
        self._backward_order: list[int] = []
        self._next: int | None = None  # the unit predicted to run after the one starting now
        self.issued = 0  # prefetches issued (for tests and the profile)
        self.wasted = 0  # prefetches released unused

    def _in_flight_bytes(self) -> int:
        return sum(u.shard_bytes for u in self.units if u.state in (UnitState.UNSHARDING, UnitState.GATHERING))

    def _issue(self, indices: list[int]) -> None:
        for i in indices:
            unit = self.units[i]
            if unit.state is not UnitState.SHARDED or unit.flat_numel == 0 or not self.ready(i):
                continue
            if self._in_flight_bytes() + unit.shard_bytes > self.max_bytes:
                break
            unit.unshard(self.manager)
            self.issued += 1

    def before_forward(self, unit: Unit) -> None:
        predicted = self.trace.on_forward(unit.index, self.units_ahead)
        self._issue(predicted)
        self._next = predicted[0] if predicted else None

    def end_forward(self) -> None:
        order = self.trace.end_forward()
        backward, seen = [], set()
        for i in reversed(order):  # a unit that ran twice is needed first by its last call's backward
            if i not in seen:
                seen.add(i)
                backward.append(i)
        self._backward_order = backward

    def before_backward(self, unit: Unit) -> None:
        order = self._backward_order
        if self.units_ahead and unit.index in order:
            pos = order.index(unit.index)
            predicted = order[pos + 1: pos + 1 + self.units_ahead]
            self._issue(predicted)
            self._next = predicted[0] if predicted else None

    def gather_ahead(self) -> None:
        """The unit starting now has its parameters: issue the all-gather of the one predicted next (its
        fetch issued earlier) so that it runs while this one computes. One rank gathers nothing, nor do whole
        parameters (stages 0-2) but once after an update: their fetch is not waited for here."""
        index, self._next = self._next, None
        if index is not None and self.units[index].gathers() and self.units[index].state is UnitState.UNSHARDING:
            self.units[index].issue_gather(self.manager)

    def release_unused(self) -> None:
        """Drop prefetched units that were not used (order changed, or no backward came)."""
        self._next = None
        for unit in self.units:
            if unit.state in (UnitState.UNSHARDING, UnitState.GATHERING):
                unit.cancel_unshard(self.manager)
                self.wasted += 1
