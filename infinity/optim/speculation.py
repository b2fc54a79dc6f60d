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
speculated update, both during backward, and then the deferred schedule's update; with a GPU these run on
host cores that backward leaves idle, so every window speculates. Without a GPU they take the cores from
compute: on the 2-core development machine (docs/tiers.md) a speculated step was 1.33-1.56x the deferred one
when the clip never fired and 1.33-1.65x when it always did, while the deferred update was as fast as the eager
one or faster; so "auto" speculates with a GPU only, and a size turns it on anywhere.

The journal is one host arena of `plan.speculation` bytes (a working term of the byte model, fitted to the
host budget after the read-ahead); units are admitted in the order backward finalizes them while their copies
fit, the rest wait for the norm as deferred updates do. Units whose optimizer runs on a GPU are never
speculated (their update is fast; the copies would cross PCIe), nor those with parameters or optimizer state on
NVMe (a fired clip would write them twice over the slowest link; their reads are ahead of the update already:
Note [state read-ahead]).

Note [speculation forecast]: a fired clip costs the journal's copies and the speculated update on top of the
deferred update: on an H100 (1.12B Llama in bf16, the ZeRO-Offload shape, the clip firing in every window) the
speculated step was 2.76x the unclipped one. So "auto" forecasts: a window speculates only when the clip fired in
none of the last `QUIET_WINDOWS` windows (nor was a norm non-finite); otherwise its units wait for the norm, as
deferred updates do. Every window's outcome is known at `step()`, speculated or not, so the forecast follows the
run: where the clip keeps firing (a fine-tune's first steps at max_grad_norm 1.0) the windows defer, where it
rarely fires (pretraining: 0.12% of BLOOM-176B's steps in SuperOffload's report) nearly every window speculates.
A size in `overlap.speculation` speculates every window (`Always`).

The worker applies the journal through `OffloadedOptimizer.step(journal=...)`, one type per use:
`Recording` (copy in, then step), `Replaying` (copy back with the gradient, then step) and `Restoring`
(copy back master and moments, no step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from infinity.memory.tier import OPTIMIZER_KINDS, Kind, StateDtype
from infinity.memory.traffic import JOURNAL_KINDS as KEPT
from infinity.memory.traffic import journal_kind_bytes


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
        self.dtypes = {k: k.dtype(compute_dtype, state_dtype) for k in KEPT}
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
        sizes = [journal_kind_bytes(numel, k, self.state_dtype) for k in KEPT]
        if not numel or self._used + sum(sizes) > self.capacity:
            return None
        copies = {}
        for kind, size in zip(KEPT, sizes):
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
        for kept, live in self._pairs(unit, at, runs, bufs, KEPT):
            kept.copy_(live)
        return True


class Replaying(_Use):
    label = "adam again"

    def before_step(self, unit: int, at: int, runs, bufs: dict) -> bool:
        for kept, live in self._pairs(unit, at, runs, bufs, KEPT):
            live.copy_(kept)  # the gradient too: the speculated update declared it spent
        return True


class Restoring(_Use):
    label = "put back"

    def before_step(self, unit: int, at: int, runs, bufs: dict) -> bool:
        for kept, live in self._pairs(unit, at, runs, bufs, OPTIMIZER_KINDS):
            live.copy_(kept)
        return False


class Forecast:
    """Whether the next window speculates (Note [speculation forecast]); told each window's outcome."""

    def speculate(self) -> bool:
        raise NotImplementedError

    def record(self, fired: bool) -> None:
        """The window just validated: its clip fired or its norm was not finite (`fired`), or neither."""


class Always(Forecast):
    """An explicit `overlap.speculation` size: every window speculates."""

    def speculate(self) -> bool:
        return True


QUIET_WINDOWS = 4


class AfterQuietWindows(Forecast):
    """"auto": speculate when none of the last `quiet` windows fired."""

    def __init__(self, quiet: int = QUIET_WINDOWS):
        self.quiet = quiet
        self.since_fired = quiet  # windows since the clip last fired (the run's first window speculates)

    def speculate(self) -> bool:
        return self.since_fired >= self.quiet

    def record(self, fired: bool) -> None:
        self.since_fired = 0 if fired else self.since_fired + 1


def forecast_for(speculation: int | str) -> Forecast:
    """The forecast for `overlap.speculation` ("auto" or a size)."""
    return AfterQuietWindows() if speculation == "auto" else Always()


def journal_for(plan, capacity: int, units_speculated: list[int]) -> Journal:
    """The journal of `plan` (`plan.speculation` bytes) over the units it may speculate."""
    return Journal(capacity, {u: plan.units[u].numel(Kind.MASTER) for u in units_speculated}, plan.compute_dtype,
                   plan.state_dtype)
