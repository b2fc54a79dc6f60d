"""A unit's Adam step counts and the runs of its update range that step: each trainable parameter's own
count (bias correction; a parameter without a gradient is not stepped, as in torch.optim) and parameter group
(Note [groups ride on ranges] in optim/groups.py)."""

from __future__ import annotations

from infinity.memory.stages import UnitLayout
from infinity.units.sharded_param import ParamSlot


class UnitSteps:
    """Per trainable parameter of one unit: its optimizer step count and its parameter group."""

    def __init__(self, slots: list[ParamSlot], layout: UnitLayout):
        self.trainable = [s for s in slots if s.requires_grad]
        self.layout = layout
        self.counts: dict[str, int] = {}  # optimizer steps each parameter has taken (Adam bias correction)
        self.groups: tuple[int, ...] = ()  # per trainable slot: its parameter group (empty: all group 0)

    def set_groups(self, group_of: dict[str, int]) -> None:
        """Each trainable parameter's group, by canonical name (Note [groups ride on ranges] in optim/groups.py)."""
        self.groups = tuple(group_of[s.name] for s in self.trainable)

    def active_ranges(self, flags: list[bool]) -> list[tuple[int, int, int, int]]:
        """(start, length, adam_step, group) runs of this rank's update range (`layout.update`) to step this step.

        `flags` (from `UnitGradients.flags`, reduced over ranks) says which trainable parameters
        got a gradient on some rank. Like torch.optim, a parameter whose gradient is
        None is not stepped (no decay, no moment update) and its own step count, used
        for bias correction, does not advance. Runs merge neighbours of equal step count
        and parameter group (Note [groups ride on ranges] in optim/groups.py).
        """
        update = self.layout.update  # ranges are relative to its start (stages 1-3: rank * s; stage 0: 0)
        shard_start, shard_end = update.start, update.start + update.numel
        groups = self.groups or (0,) * len(self.trainable)
        runs: list[tuple[int, int, int, int]] = []
        for slot, flag, group in zip(self.trainable, flags, groups):
            lo, hi = max(slot.offset, shard_start), min(slot.offset + slot.numel, shard_end)
            if not flag or lo >= hi:
                continue
            step = self.counts.get(slot.name, 0) + 1
            if runs and runs[-1][0] + runs[-1][1] == lo - shard_start and runs[-1][2:] == (step, group):
                runs[-1] = (runs[-1][0], runs[-1][1] + hi - lo, step, group)
            else:
                runs.append((lo - shard_start, hi - lo, step, group))
        return runs

    def commit(self, flags: list[bool]) -> None:
        """Advance the step count of the parameters that were updated (every rank, shard or not)."""
        for slot, flag in zip(self.trainable, flags):
            if flag:
                self.counts[slot.name] = self.counts.get(slot.name, 0) + 1
