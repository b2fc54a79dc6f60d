"""The journal of speculated updates: what a unit's update overwrote, to put it back or do it again.

Note [speculative update]: with clipping (or `train.on_nonfinite = "skip"`) a unit's update depends on the
global gradient norm, known only when backward ends; waiting for it leaves the CPU idle during backward and
the next forward waiting for the whole update (the deferred schedule). Instead each unit is updated as soon
as its gradients are final, as if the clip will not fire (coefficient 1, exactly the unclipped update), and
before a sub-group is stepped its master, moments (as stored) and fp32 gradient are copied into the journal.
`step()` validates once the norm is known:

- the clip does not fire and the norm is finite: nothing more to do (the common case of a pretraining run);
- the clip fires: each speculated unit is put back from the journal and stepped again with the clipped
  gradient, in the next forward's order (that forward waits per unit): exactly the deferred update;
- the norm is not finite: each speculated unit is put back and not stepped; its Adam step counts too.

Bit for bit what the deferred update computes, in every case. A fired clip costs the journal's copies and the
speculated update, both during backward, and then the deferred schedule's update.

The journal is one host arena of `plan.speculation` bytes (a working term of the byte model, fitted to the
host budget after the read-ahead); units are admitted in the order backward finalizes them while their copies
fit, the rest wait for the norm as deferred updates do. Units whose optimizer runs on a GPU are never
speculated (their update is fast; the copies would cross PCIe), nor those with parameters or optimizer state on
NVMe (a fired clip would write them twice over the slowest link; their reads are ahead of the update already:
Note [state read-ahead]).

The default, "auto", does not speculate: Note [speculation default] in config/update_mode.py.

The worker applies the journal through `OffloadedOptimizer.step(journal=...)`, one type per use:
`Recording` (copy in, then step), `Replaying` (copy back with the gradient, then step) and `Restoring`
(copy back master and moments, no step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from infinity.memory.tier import OPTIMIZER_KINDS, Kind, StateDtype
from infinity.memory.traffic import JOURNAL_KINDS, journal_kind_bytes


@dataclass
class Entry:
    """One speculated unit: its copies (per kind, over its whole update range), the runs its update stepped
    (set on the worker; None until then or when it was not stepped) and its Adam step counts before it."""
    copies: dict[Kind, torch.Tensor]
    counts: dict[str, int]
    runs: dict | None = None
    hyper: tuple = field(default=())


class Journal:
    """A host arena of `capacity` bytes; `numels[u]`: the update range of each unit that may be speculated."""

    def __init__(self, capacity: int, numels: dict[int, int], compute_dtype: torch.dtype, state_dtype: StateDtype):
        self.numels, self.state_dtype = numels, state_dtype
        self.dtypes = {k: k.dtype(compute_dtype, state_dtype) for k in JOURNAL_KINDS}
        self.arena = torch.empty(capacity, dtype=torch.uint8)  # pages are touched when first used
        self.entries: dict[int, Entry] = {}
        self._used = 0
        self.recording, self.replaying, self.restoring = Recording(self), Replaying(self), Restoring(self)

    @property
    def capacity(self) -> int:
        return self.arena.numel()

    def reserve(self, unit: int, counts: dict[str, int]) -> Entry | None:
        """Room for `unit`'s copies in this window (training thread); None when it is not speculated."""
        numel = self.numels.get(unit, 0)
        sizes = [journal_kind_bytes(numel, k, self.state_dtype) for k in JOURNAL_KINDS]
        if not numel or self._used + sum(sizes) > self.capacity:
            return None
        copies = {}
        for kind, size in zip(JOURNAL_KINDS, sizes):
            copies[kind] = self.arena[self._used: self._used + size].view(self.dtypes[kind])[:numel]
            self._used += size
        self.entries[unit] = entry = Entry(copies, dict(counts))
        return entry

    def clear(self) -> None:
        """A new window: every region is free (the caller has waited for the updates that used them)."""
        self.entries, self._used = {}, 0


class _Use:
    """How one update uses the journal: `before_step(unit, at, runs, bufs)` runs on the worker once a sub-group's
    state is in memory (`at`: the sub-group's start in the unit's update range; `runs`: its (start, length, step,
    group) runs); True when the sub-group is then stepped."""

    label = "adam"

    def __init__(self, journal: Journal):
        self.journal = journal

    def _pairs(self, unit: int, at: int, runs, bufs: dict, kinds):
        copies = self.journal.entries[unit].copies
        for a, n, _step, _group in runs:
            for kind in kinds:
                yield copies[kind].narrow(0, at + a, n), bufs[kind].narrow(0, a, n)


class Recording(_Use):
    def before_step(self, unit: int, at: int, runs, bufs: dict) -> bool:
        for kept, live in self._pairs(unit, at, runs, bufs, JOURNAL_KINDS):
            kept.copy_(live)
        return True


class Replaying(_Use):
    label = "adam again"

    def before_step(self, unit: int, at: int, runs, bufs: dict) -> bool:
        for kept, live in self._pairs(unit, at, runs, bufs, JOURNAL_KINDS):
            live.copy_(kept)  # the gradient too: the speculated update declared it spent
        return True


class Restoring(_Use):
    label = "put back"

    def before_step(self, unit: int, at: int, runs, bufs: dict) -> bool:
        for kept, live in self._pairs(unit, at, runs, bufs, OPTIMIZER_KINDS):
            live.copy_(kept)
        return False


def journal_for(plan, capacity: int, units_speculated: list[int]) -> Journal:
    """The journal of `plan` (`plan.speculation` bytes) over the units it may speculate."""
    return Journal(capacity, {u: plan.units[u].numel(Kind.MASTER) for u in units_speculated}, plan.compute_dtype,
                   plan.state_dtype)
