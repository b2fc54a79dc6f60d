"""Parameters just written to NVMe, kept in host memory until the next fetch of them.

Note [fresh parameters]: the update writes every unit's new compute-dtype parameters
to NVMe, and the next forward reads them straight back (with clipping, a few
milliseconds later: it waits for that unit's update, then for the write to land,
then for the read). `FreshCopies` keeps the host buffer a parameter chunk was
written from, with the chunk's version, and the fetch copies from it: no disk read
and no wait for the write. The copies take at most `budget` bytes:

- `put` (the optimizer, once the write is issued): kept when it fits. When it does
  not, in blocking mode (the deferred update: the forward takes chunks in the order
  the worker puts them) the worker waits for room; otherwise kept copies farther in
  forward order (unit index) than the new one are evicted while that makes room,
  and the new one is kept if it then fits.
- `take` (a fetch): the buffer, when its version is current; the entry leaves.
- An entry that leaves unused (stale, evicted, relieved, closed) is retired: its
  buffer returns to the pool once its write has landed (`reap`).

Which chunks are kept is predicted, so the bytes a step moves are the byte model's
(`kept_chunks`, used by `traffic.bytes_per_step`): deferred (blocking): every chunk
that fits the budget at all; otherwise a simulation of the puts of one update in its
order with no take in between. Each update says the prediction at its start
(`begin_update`) and only those chunks are kept: an eager update's last puts meet
the next forward's first takes, and a backlog is stepped in forward order, so what
the budget admits at each put depends on timing (a loaded machine kept one chunk
more, a disk read less than the model said).

No deadlock: the worker waits in `put` only in blocking mode, and the training
thread, before it waits for the worker, relieves it: `relieve(unit)` (it is about
to wait for that unit's update: every entry put before that unit is a unit the
forward skipped, and is dropped) or `unblock()` (it waits for everything).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from infinity.memory.tier import Kind, Tier
from infinity.memory.traffic import fresh_bytes


@dataclass
class _Entry:
    tensor: torch.Tensor  # the host staging buffer the chunk was written from (owned here)
    version: int
    write: object  # the manager's Pending of that write (the buffer may not be reused before it lands)
    position: int  # order of the put within this update (for relieve)


class FreshCopies:
    """(unit, chunk) -> host copy of its newest parameters, within `budget` bytes."""

    def __init__(self, budget: int, release):
        self.budget = budget
        self._release = release  # gives a buffer back to the staging pool
        self._cond = threading.Condition()
        self._kept: dict[tuple[int, int], _Entry] = {}
        self._retired: list[_Entry] = []
        self.kept_bytes = 0
        self._blocking = False
        self._order: dict[int, int] = {}  # unit -> position in the current update's order
        self._keep: frozenset[tuple[int, int]] | None = None  # what the current update keeps (None: what fits)
        self.hits = self.puts = self.refused = 0

    # ------------------------------------------------------------ modes (training thread)
    def begin_update(self, units: list[int], *, blocking: bool, keep: frozenset[tuple[int, int]] | None) -> None:
        """An update of `units` (in this order) starts; `blocking`: the forward will take in that order; `keep`: the
        (unit, chunk)s it keeps, the prediction (`kept_chunks`; None: whatever the budget admits). Only those are
        kept, whatever the order of the puts (the worker steps a backlog in forward order) and whatever the forward
        takes meanwhile (an eager update's last units are put while the next forward takes the first): the bytes a
        step reads are the byte model's. A copy of an earlier update's that nobody took and this one does not keep
        leaves: its forward has run."""
        with self._cond:
            self._order = {u: i for i, u in enumerate(units)} if blocking else {}  # (relieve: a blocking update's)
            self._blocking, self._keep = blocking, keep
            for key in [k for k in self._kept if keep is not None and k not in keep]:
                self._retire(key)
            self._cond.notify_all()

    def relieve(self, unit: int) -> None:
        """The training thread is about to wait for `unit`'s update: drop entries put before it."""
        with self._cond:
            mine = self._order.get(unit)
            if mine is None:
                return
            for key in [k for k, e in self._kept.items() if e.position < mine]:
                self._retire(key)
            self._cond.notify_all()

    def unblock(self) -> None:
        """The training thread waits for the whole update: puts stop waiting for room."""
        with self._cond:
            self._blocking = False
            self._cond.notify_all()

    # ------------------------------------------------------------ put / take
    def put(self, unit: int, chunk: int, tensor: torch.Tensor, version: int, write) -> bool:
        """Keep `tensor` (just written as version `version` of the chunk, by `write`); False: not kept,
        the caller keeps ownership of the buffer."""
        nbytes = tensor.numel() * tensor.element_size()
        with self._cond:
            self.puts += 1
            self._reap()
            key = (unit, chunk)
            if nbytes > self.budget or (self._keep is not None and key not in self._keep):
                self.refused += 1
                return False
            if key in self._kept:
                self._retire(key)  # an older version nobody took
            while self._blocking and self.kept_bytes + nbytes > self.budget:
                self._cond.wait()  # why: the forward frees room as it takes chunks (or relieves us)
            sizes = {k: e.tensor.numel() * e.tensor.element_size() for k, e in self._kept.items()}
            evict = _evictions(sizes, key, nbytes, self.budget)
            if evict is None:
                self.refused += 1
                return False
            for k in evict:
                self._retire(k)
            self._kept[key] = _Entry(tensor, version, write, self._order.get(unit, -1))
            self.kept_bytes += nbytes
            return True

    def take(self, unit: int, chunk: int, version: int) -> tuple[torch.Tensor, object] | None:
        """(buffer, write) of the chunk when its kept copy is `version`; the caller copies from it and
        then calls `done_with`. None when there is none (a stale one is retired)."""
        with self._cond:
            entry = self._kept.get((unit, chunk))
            if entry is None:
                return None
            if entry.version != version:
                self._retire((unit, chunk))
                return None
            del self._kept[(unit, chunk)]
            self.kept_bytes -= entry.tensor.numel() * entry.tensor.element_size()
            self.hits += 1
            self._cond.notify_all()
            return entry.tensor, entry.write

    def done_with(self, tensor: torch.Tensor, write) -> None:
        """A taken buffer was copied from: back to the pool once its write has landed."""
        with self._cond:
            self._retired.append(_Entry(tensor, -1, write, -1))
            self._reap()

    def discard(self, unit: int, chunk: int) -> None:
        """The chunk is being stored again (or zeroed): its kept copy is old."""
        with self._cond:
            if (unit, chunk) in self._kept:
                self._retire((unit, chunk))
                self._cond.notify_all()

    # ------------------------------------------------------------ cleanup
    def _retire(self, key) -> None:
        entry = self._kept.pop(key)
        self.kept_bytes -= entry.tensor.numel() * entry.tensor.element_size()
        self._retired.append(entry)
        self._reap()

    def _reap(self) -> None:
        """Release retired buffers whose writes have landed (lock held)."""
        still = []
        for entry in self._retired:
            if entry.write.done():
                entry.write.wait()  # completes the write's bookkeeping (residency), raises its error
                self._release(entry.tensor)
            else:
                still.append(entry)
        self._retired = still

    def drain(self) -> None:
        """Wait for the writes of retired buffers and release them (kept copies stay)."""
        with self._cond:
            retired, self._retired = self._retired, []
        for entry in retired:
            entry.write.wait()  # why: a buffer goes back to the pool only once the disk has its bytes
            self._release(entry.tensor)

    def close(self) -> None:
        """Retire everything and release it (waits for the writes)."""
        with self._cond:
            self._blocking = False
            for key in list(self._kept):
                self._retire(key)
            self._cond.notify_all()
        self.drain()


def fresh_budget(plan, prefetch) -> int:
    """Bytes the fresh copies may hold: the plan's `fresh_params` term (Note [working memory], traffic.py):
    `units_ahead + 1` of the largest parameter shards on NVMe (0 with `[prefetch] keep_written = false`,
    or no parameters on NVMe)."""
    return fresh_bytes(plan.units, plan.compute_dtype.itemsize, prefetch.units_ahead, prefetch.keep_written,
                       lambda u: plan.tier(u, Kind.PARAMS) is Tier.NVME)


def kept_chunks(chunk_bytes: dict[tuple[int, int], int], order: list[tuple[int, int]], budget: int, *,
                blocking: bool) -> frozenset[tuple[int, int]]:
    """The (unit, chunk)s whose next fetch is served from a kept copy, for an update that puts
    `order` (chunks with params on NVMe, sizes `chunk_bytes`) before the next forward takes them
    (Note [fresh parameters]). `blocking`: the deferred update, where every chunk that fits is kept."""
    fits = [key for key in order if chunk_bytes[key] <= budget]
    if blocking:
        return frozenset(fits)
    kept: dict[tuple[int, int], int] = {}
    for key in fits:
        kept.pop(key, None)
        evict = _evictions(kept, key, chunk_bytes[key], budget)
        if evict is not None:
            for k in evict:
                del kept[k]
            kept[key] = chunk_bytes[key]
    return frozenset(kept)


def _evictions(kept: dict[tuple[int, int], int], key: tuple[int, int], nbytes: int, budget: int):
    """The kept (unit, chunk)s to evict so that `key` (`nbytes`) fits, farthest in forward order first, none
    nearer than `key`'s unit; None when it cannot fit that way (the one eviction policy of `put` and
    `kept_chunks`)."""
    used, out = sum(kept.values()), []
    for k in sorted(kept, key=lambda k: k[0], reverse=True):
        if used + nbytes <= budget or k[0] <= key[0]:
            break
        used -= kept[k]
        out.append(k)
    return out if used + nbytes <= budget else None
