"""Optimizer state read ahead of the update that needs it, within a byte budget.

Note [state read-ahead]: with clipping the update of step N can only start once
backward N has produced the global norm, and the next forward waits for it unit by
unit; with the state on NVMe the disk then idles through backward and is the
bottleneck of the forward. But the state an update reads (fp32 master, both moments)
does not depend on the gradients: it is final as soon as the previous update wrote it.
So once a step's updates are issued, the worker reads the next step's state, in the
order the next update will want it, into staging buffers while forward and backward
run, up to `[overlap] optimizer_read_ahead` bytes, READS_IN_FLIGHT chunks at a time (a
deeper queue would make the update's write-behind and the parameter fetches wait behind
reads needed only later). The update then finds its reads done. Without clipping
(updates during backward) the same read-ahead runs during the forward.

Note [reads before writes]: when the backward is shorter than the reads it has to hold
(parameters plus the read-ahead), the read-ahead has not finished when the update starts,
and the update would read the rest itself, each task's reads between the previous tasks'
writes. So before an update steps its first unit the worker issues every chunk left in
the read-ahead's order at once (`issue_rest`, within the budget): they queue ahead of the
update's writes, the disk reads them, then writes. Its premise, a penalty for mixing reads
and writes, did not hold on the development disk later (benchmarks/history/from-notes.md).
What this costs when the read-ahead is behind: the root unit's writes queue behind the
rest and the next forward waits on that update, harmless while the disk is the bottleneck.

Exactness: an entry remembers the manager's version of every chunk it read; an
entry whose chunk was stored since (a checkpoint load, say) is discarded and read
again (`take`). Chunk residency stays legal: `land()` waits every read in flight
before anyone else may store to those chunks (the update mode's `settled()` calls it,
through the worker's `quiesce`).

Thread model: `set_order` and `land` come from the training thread, `issue_next` and
`take` from the optimizer worker; one lock guards the bookkeeping (never held across
a wait for I/O); a second one spans the issue of one chunk, so `land` sees it.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from infinity.memory.manager import Pending, TieredMemoryManager
from infinity.memory.tier import OPTIMIZER_KINDS, Kind, Tier

_CPU = torch.device("cpu")


# Chunks being read ahead at a time. Enough to keep the disk busy (two sub-groups of three
# kinds queue ~100 ms of reads), few enough that the update's write-behind and the next
# parameter fetches never queue behind seconds of reads that are needed only later.
READS_IN_FLIGHT = 2


class Issue(enum.Enum):
    """What `StateReadAhead.issue_next` did."""
    ISSUED = "issued"  # one more chunk is being read
    BUSY = "busy"  # READS_IN_FLIGHT chunks are being read: try again when one lands
    IDLE = "idle"  # nothing to read now (no order, budget full, paused)


@dataclass
class _Entry:
    fetches: dict[Kind, Pending]
    versions: dict[Kind, tuple[int, ...]]
    num_bytes: int  # budget it holds
    disk_bytes: int  # what it read from disk (chunks still all-zero need no read)


def state_read_ahead_kinds(manager: TieredMemoryManager, unit: int) -> tuple[Kind, ...]:
    """The optimizer kinds of `unit` worth reading ahead: those on NVMe (resident ones are used in place)."""
    return tuple(k for k in OPTIMIZER_KINDS if manager.tier(unit, k) is Tier.NVME)


class StateReadAhead:
    """Read-ahead cache of (unit, chunk) optimizer state, bounded by `budget` bytes."""

    def __init__(self, manager: TieredMemoryManager, budget: int):
        self.manager, self.budget = manager, budget
        self._lock = threading.Lock()
        self._issuing = threading.Lock()  # held by the worker while it issues one chunk's reads
        self._todo: OrderedDict[tuple[int, int], None] = OrderedDict()  # chunks to read, next first
        self._held: dict[tuple[int, int], _Entry] = {}
        self.held_bytes = 0
        self._paused = False
        self.hits = self.misses = self.stale = 0
        self.unused_disk_bytes = 0  # read but never used: stale entries, and those dropped at close

    def reserve_buffers(self) -> int:
        """Allocate up front the staging buffers a full read-ahead holds (every NVMe optimizer chunk in
        unit order, up to the budget) and leave them free in the pool; returns their bytes. Without
        this the pool grew over the first steps as the read-ahead got further each step (2.3, 3.4,
        3.8 GB after steps 1-3 of the 311M-parameter bench model) and those steps ran 1.4-1.9x slower
        than the steady ones, the issue of each new buffer pacing the reads behind it."""
        buffers, total = [], 0
        chunks = ((u, c) for u in range(len(self.manager.plan.units)) for c in range(self.manager.num_chunks(u)))
        for unit, chunk in chunks:
            num_bytes = self.chunk_bytes(unit, chunk)
            if total + num_bytes > self.budget:
                break
            total += num_bytes
            numel = self.manager.chunk_span(unit, chunk)[1]
            buffers += [(numel, self.manager.plan.dtype(k)) for k in state_read_ahead_kinds(self.manager, unit)]
        self.manager.staging.reserve_host(buffers)
        return total

    def chunk_bytes(self, unit: int, chunk: int) -> int:
        _, numel = self.manager.chunk_span(unit, chunk)
        return numel * sum(self.manager.plan.dtype(k).itemsize for k in state_read_ahead_kinds(self.manager, unit))

    # ------------------------------------------------------------ training thread
    def set_order(self, chunks: list[tuple[int, int]]) -> None:
        """The (unit, chunk) tasks of the next update, in its order; chunks already held stay held."""
        if self.budget <= 0:
            return
        with self._lock:
            self._todo = OrderedDict((c, None) for c in chunks
                                     if c not in self._held and state_read_ahead_kinds(self.manager, c[0]))

    def land(self) -> None:
        """Pause reading ahead (until `resume`) and wait for the reads in flight: their chunks are then
        RESIDENT again, so anyone may store to them (a stored chunk's entry goes stale)."""
        with self._lock:
            self._paused = True
        with self._issuing, self._lock:  # a chunk being issued now is registered before we look
            entries = list(self._held.values())
        for entry in entries:
            for pending in entry.fetches.values():
                pending.wait()  # the bytes stay held; a later store makes the entry stale (version)

    def resume(self) -> None:
        with self._lock:
            self._paused = False

    def drop(self) -> None:
        """Release every held buffer (at close); a read that failed is raised after all are released."""
        with self._lock:
            self._paused = True
        with self._issuing, self._lock:
            entries, self._held, self.held_bytes = list(self._held.values()), {}, 0
        error = None
        for entry in entries:
            self.unused_disk_bytes += entry.disk_bytes
            for pending in entry.fetches.values():
                try:
                    self.manager.release(pending.wait())
                except Exception as e:  # noqa: BLE001 - raised below, once every buffer is back
                    error = error or e
        if error is not None:
            raise error

    # ------------------------------------------------------------ optimizer worker
    def issue_next(self) -> Issue:
        """Issue the reads of the next chunk in order if the budget has room and fewer than
        `READS_IN_FLIGHT` chunks are still being read: ISSUED, BUSY (try again once a read lands)
        or IDLE (nothing more to do until the order, the budget or the pause changes)."""
        with self._issuing:
            return self._issue_next(READS_IN_FLIGHT)

    def issue_rest(self) -> int:
        """Issue the reads of every chunk left in order, within the budget, now: the update is about
        to start and would otherwise read them itself between its writes (Note [reads before writes]).
        Returns the chunks issued."""
        issued = 0
        with self._issuing:
            while self._issue_next(None) is Issue.ISSUED:
                issued += 1
        return issued

    def _issue_next(self, max_reading: int | None) -> Issue:
        with self._lock:
            if self._paused or not self._todo:
                return Issue.IDLE
            if max_reading is not None and sum(
                    1 for e in self._held.values() if not all(p.done() for p in e.fetches.values())) >= max_reading:
                return Issue.BUSY
            key = next(iter(self._todo))
            num_bytes = self.chunk_bytes(*key)
            if self.held_bytes + num_bytes > self.budget:
                return Issue.IDLE  # the update frees budget as it takes entries
            del self._todo[key]
            self.held_bytes += num_bytes
        unit, chunk = key
        kinds = state_read_ahead_kinds(self.manager, unit)
        versions = {k: self.manager.versions(unit, k, chunk) for k in kinds}
        disk = sum(
            self.manager.chunk_span(unit, chunk)[1] * self.manager.plan.dtype(k).itemsize for k in kinds
            if not self.manager.is_zero(unit, k, chunk)
        )
        fetches = {k: self.manager.fetch(unit, k, chunk, _CPU) for k in kinds}
        with self._lock:
            self._held[key] = _Entry(fetches, versions, num_bytes, disk)
        return Issue.ISSUED

    def take(self, unit: int, chunk: int) -> dict[Kind, Pending]:
        """The held reads of this chunk (empty when none, or stale: then they are released).
        The chunk is no longer read ahead for this round either way."""
        key = (unit, chunk)
        with self._lock:
            self._todo.pop(key, None)
            entry = self._held.pop(key, None)
            if entry is not None:
                self.held_bytes -= entry.num_bytes
        if entry is None:
            self.misses += 1
            return {}
        if any(self.manager.versions(unit, k, chunk) != v for k, v in entry.versions.items()):
            self.stale += 1
            self.unused_disk_bytes += entry.disk_bytes
            for pending in entry.fetches.values():
                self.manager.release(pending.wait())  # stored since it was read: those bytes are old
            return {}
        self.hits += 1
        return entry.fetches


def resolve_read_ahead(cfg, plan, budgets) -> int:
    """The read-ahead budget of a run of `cfg` with `plan` under `budgets` (0: none). The planner resolved
    it into the plan (`traffic.resolve_read_ahead`, fitted to the host budget with everything else), so
    this is `plan.read_ahead`; the arguments say which run it is."""
    return plan.read_ahead
