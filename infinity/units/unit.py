"""Unit: the parameters of one block, which move and communicate together, and their lifecycle (the analogue
of FSDP2's FSDPParamGroup): sharded, unsharding, gathering, unsharded, and back.

A unit's parameters are flattened into one buffer (trainable ones first), padded
to a multiple of the world size and cut into one partition per rank; what a rank
stores of each state kind is the unit's `layout` for the ZeRO stage (Note [stage
layouts] in memory/stages.py), on the tiers the plan chose. At stage 3, before the unit
runs (forward, and again in backward) its shard is fetched to the device and
all-gathered into the unsharded buffer, whose storage the parameters view;
afterwards that storage is resized to zero bytes. At stages 0-2 every rank
stores the whole unit: it is fetched whole, never gathered (on the device tier
the parameters view the stored tensor itself: `alias`), except once after each
update at stages 1-2 (Note [post-update gather]). Gradients are flattened in
fp32 and reduced as the stage says (gradients.py; when: grad_reduce.py); each parameter's Adam step count and
group are steps.py's; which modules form units, builder.py's.

Note [post-update gather]: at stages 1-2 a rank updates only its partition of
the whole parameters it holds; the other partitions arrive by one all-gather
per unit and update. It runs on the training thread, in the unit's first
unshard after its update (`updated` marks it; the forward waits for the update
first), so every rank issues these gathers in forward order among its other
collectives, as stage 3's gathers are (prefetch.py). A dedicated process group
on the optimizer worker would also keep the order, but the gathered bytes must
reach where the forward reads them (the device, or the host / NVMe copy the
next fetch reads) anyway, and the update's write of the same bytes would race
with it. After the gather, the other partitions are stored where the rank keeps
its whole parameters (host / NVMe: `TieredMemoryManager.store_gathered`; nothing
to store when aliased on the device), so the backward and later micro-batches
fetch them without gathering.
Stage 0 needs no gather: every rank steps the whole model on the same all-reduced
gradients, bit for bit alike.
"""

from __future__ import annotations

import enum

import torch
import torch.nn as nn

from infinity.device import collectives
from infinity.memory.manager import Pending, TieredMemoryManager
from infinity.memory.stages import UnitLayout, padded_numel
from infinity.memory.tier import Kind, Tier
from infinity.profile import Link
from infinity.units.context import UnitContext
from infinity.units.gradients import UnitGradients
from infinity.units.sharded_param import ParamSlot, install, point_at, point_away, release
from infinity.units.steps import UnitSteps


class UnitState(enum.Enum):
    """SHARDED -> UNSHARDING (fetch issued) -> GATHERING (all-gather issued, several ranks) -> UNSHARDED
    (gathered, views valid) -> SHARDED (reshard). `TRANSITIONS` lists every legal move."""

    SHARDED = "sharded"
    UNSHARDING = "unsharding"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


TRANSITIONS = frozenset({
    (UnitState.SHARDED, UnitState.UNSHARDING),  # unshard: the fetch of the stored parameters issued
    (UnitState.UNSHARDING, UnitState.UNSHARDED),  # the fetch landed and nothing is gathered
    (UnitState.UNSHARDING, UnitState.GATHERING),  # the fetch landed, the all-gather issued
    (UnitState.GATHERING, UnitState.UNSHARDED),  # the all-gather waited
    (UnitState.UNSHARDED, UnitState.SHARDED),  # reshard: the buffer's bytes freed
    (UnitState.UNSHARDING, UnitState.SHARDED),  # cancel_unshard: the fetch waited, its buffer freed
    (UnitState.GATHERING, UnitState.SHARDED),  # cancel_unshard: the gather waited, its buffer freed
})


class UnitStateError(RuntimeError):
    """A move the unit's lifecycle does not have (an ordering bug in the caller, never a wait)."""


class Unit:
    """One unit's parameters, their unsharded buffer, and its state."""

    def __init__(self, index: int, name: str, modules: list[nn.Module], slots: list[ParamSlot],
                 trainable_numel: int, ctx: UnitContext):
        self.index, self.name, self.modules, self.slots, self.ctx = index, name, modules, slots, ctx
        self.flat_numel = sum(s.numel for s in slots)
        self.trainable_numel = trainable_numel
        self.padded_numel = padded_numel(self.flat_numel, ctx.world_size)
        self.shard_numel = self.padded_numel // ctx.world_size
        # What this rank stores of each kind (Note [stage layouts]). Note [padding rides with the trainable]:
        # a unit without frozen weights counts its padding as trainable, so at stage 3 every kind stores the
        # same whole partition (one layout: its parameters may alias the master) as before stages existed.
        trainable = self.padded_numel if trainable_numel == self.flat_numel else trainable_numel
        self.layout: UnitLayout = ctx.stage.layout(self.flat_numel, trainable, ctx.world_size, ctx.rank,
                                                    ctx.sub_group_size)
        self.stored_trainable = trainable  # the T of the layouts: gradients and optimizer state cover [0, T)
        self.state = UnitState.SHARDED
        itemsize = ctx.compute_dtype.itemsize
        self._nbytes = self.padded_numel * itemsize
        self._storage = torch.empty(0, dtype=ctx.compute_dtype, device=ctx.device).untyped_storage()
        self._pending: Pending | None = None  # the fetch of this rank's shard (UNSHARDING)
        self._gather: tuple[object, object] | None = None  # the all-gather's handle and profile span (GATHERING)
        self.aliased = False  # parameters view the stored shard (see alias)
        self._stored: torch.Tensor | None = None  # the stored whole parameters the views alias
        self.stale = False  # Note [post-update gather]: the other ranks' updated partitions are still to come
        self.grads = UnitGradients(ctx, slots, self.layout, ctx.rank * self.shard_numel,
                                   self.shard_numel, trainable, self.name)  # its flat gradient, reduction
        self.steps = UnitSteps(slots, self.layout)  # its parameters' Adam step counts and groups (steps.py)
        self.peak_unsharded = 0

    def _move(self, new: UnitState) -> None:
        """Change the lifecycle state; a move TRANSITIONS lacks is refused (UnitStateError)."""
        if (self.state, new) not in TRANSITIONS:
            raise UnitStateError(f"unit {self.name}: {self.state.value} -> {new.value} is not a move of its lifecycle")
        self.state = new

    def can_alias(self, stored: torch.Tensor | None) -> bool:
        """The stored parameters are the whole unit on the compute device (one rank, or stages 0-2)."""
        return stored is not None and stored.device == self.ctx.device and stored.numel() == self.padded_numel

    def alias(self, resident: torch.Tensor) -> None:
        """Parameters stored whole on the compute device: the module's parameters view the stored
        tensor itself, so unshard and reshard cost nothing (no copy, no second buffer). The optimizer
        writes the new values there, after the unit's backward is done with them."""
        assert self.can_alias(resident), (resident.numel(), resident.device, self.padded_numel)
        install(self.slots, resident)
        self.aliased, self._stored = True, resident

    def updated(self) -> None:
        """This rank's update of the unit is done (after its last chunk): at stages 1-2 the other ranks'
        partitions are gathered at the next unshard (Note [post-update gather])."""
        if self.ctx.stage.gathers_after_update and self.ctx.group is not None:
            self.stale = True

    def install_views(self) -> None:
        """Make every owner module hold parameters that view the unsharded buffer (once, after
        the unit's values have been stored in its shards)."""
        install(self.slots, self._flat())
        self._storage.resize_(0)  # set_ grew the storage to the view's size; sharded means zero bytes
        point_away(self.slots)  # Note [parameters between steps]

    # ----------------------------------------------------------------- views
    def _flat(self) -> torch.Tensor:
        """A fresh tensor over the unsharded storage (its own version counter, so filling it
        does not trip autograd's checks on the parameter views saved for backward)."""
        t = torch.empty(0, dtype=self.ctx.compute_dtype, device=self.ctx.device)
        return t.set_(self._storage, 0, (self.padded_numel,), (1,))

    @property
    def shard_bytes(self) -> int:
        """Bytes an unshard fetches: the parameters this rank stores (stage 3: its shard; else the whole unit)."""
        return self.layout.params.numel * self.ctx.compute_dtype.itemsize

    def shard_range(self) -> tuple[int, int]:
        """[start, end) of this rank's partition in the unit's flat buffer (stage 3: the parameters it stores)."""
        start = self.ctx.rank * self.shard_numel
        return start, start + self.shard_numel

    # ----------------------------------------------------------------- unshard / reshard
    def gathers(self) -> bool:
        """The next unshard all-gathers: always at stage 3 (several ranks), once after an update at stages 1-2."""
        return self.ctx.group is not None and (self.ctx.stage.gathers_params or self.stale)

    def _own_slot(self) -> torch.Tensor:
        """This rank's partition of the unsharded buffer: an all-gather's input, in place."""
        start, _ = self.shard_range()
        return self._flat().narrow(0, start, self.shard_numel)

    def unshard(self, manager: TieredMemoryManager) -> None:
        """Issue: start bringing this rank's stored parameters (stage 3: its shard; else the whole unit) to
        the device."""
        if self.state is not UnitState.SHARDED or self.flat_numel == 0 or self.aliased:
            return
        if self._storage.nbytes() == 0:
            self.ctx.unsharded.grow(self.index, self._storage, self._nbytes)
            self.peak_unsharded = max(self.peak_unsharded, self._nbytes)
            point_at(self.slots, self._flat())  # (after grow: a view made over zero bytes would grow the storage)
        # The shard lands in its own slot of the unsharded buffer; the all-gather fills the rest in place.
        into = self._own_slot() if self.ctx.stage.gathers_params else self._flat()
        self._pending = manager.fetch(self.index, Kind.PARAMS, None, into=into, urgent=True)
        self._move(UnitState.UNSHARDING)

    def issue_gather(self, manager: TieredMemoryManager) -> None:
        """Issue: once this rank's shard has landed, all-gather it into the unsharded buffer on the comm
        stream, asynchronously (a prefetch issues it while the previous unit computes, as FSDP2 does).
        With one rank the fetch fills the whole buffer: the unit is unsharded once it lands."""
        if self.state is UnitState.SHARDED:
            self.unshard(manager)
        if self.state is not UnitState.UNSHARDING:
            return
        prof = self.ctx.profiler
        link = Link.NVME_READ if manager.tier(self.index, Kind.PARAMS) is Tier.NVME else Link.H2D  # the plan's
        with prof.wait(link, f"fetch {self.name}"):
            shard = self._pending.wait()  # the gather (or, with one rank, compute) reads this unit's bytes
        self._pending = None
        if not self.gathers():
            self._move(UnitState.UNSHARDED)  # one rank, or whole parameters that are current
            return
        own = shard if self.ctx.stage.gathers_params else self._own_slot()
        self._gather = self._issue_all_gather(self._flat(), own)
        self._move(UnitState.GATHERING)

    def _issue_all_gather(self, whole: torch.Tensor, own: torch.Tensor) -> tuple[object, object]:
        streams = self.ctx.streams
        streams.wait_event(streams.record(), streams.comm)  # the comm stream must see the fetched shard
        timed = self.ctx.profiler.collective(f"all-gather {self.name}", Link.ALL_GATHER, stream=streams.comm,
                                             num_bytes=self._nbytes, unit=self.name)
        with streams.use(streams.comm), timed:
            work = collectives.all_gather_into(whole, own, self.ctx.group)
            if streams.is_cuda:
                work.wait()  # (NCCL: the comm stream waits for it, not the host) its device span ends when it does
        return work, timed

    def wait_for_unshard(self, manager: TieredMemoryManager) -> None:
        """Wait: the views are valid after this (compute waits for the gather on the device, not the host)."""
        if self.flat_numel == 0:
            return
        if self.aliased:
            if self.stale:  # Note [post-update gather]: in place in the stored parameters the views alias
                start, _ = self.shard_range()
                self._gather = self._issue_all_gather(self._stored, self._stored.narrow(0, start, self.shard_numel))
                self._gathered(manager)
            return
        self.issue_gather(manager)
        if self.state is UnitState.GATHERING:
            self._gathered(manager)
            self._move(UnitState.UNSHARDED)

    def _gathered(self, manager: TieredMemoryManager) -> None:
        """Wait for the all-gather in flight; after a post-update gather, keep the other partitions where the
        next fetch reads them (Note [post-update gather])."""
        self._wait_gather()
        streams = self.ctx.streams
        streams.wait_event(streams.record(streams.comm))  # compute waits for the gathered bytes, on the device
        if not self.stale:
            return
        self.stale = False
        if self.aliased:
            return  # the gather wrote the stored parameters themselves
        manager.store_gathered(self.index, self._flat().narrow(0, self.layout.params.start, self.layout.params.numel),
                               self.stored_trainable)

    def _wait_gather(self) -> None:
        (work, timed), self._gather = self._gather, None
        prof, streams = self.ctx.profiler, self.ctx.streams
        with streams.use(streams.comm), prof.wait(Link.ALL_GATHER, f"all-gather {self.name}"):
            work.wait()  # NCCL: the comm stream waits for the collective; gloo: the host waits for the bytes
        timed.done()  # (on the CPU its span runs from the issue to here)

    def cancel_unshard(self, manager: TieredMemoryManager) -> None:
        """Abandon an issued unshard that will not be used (a prefetch the order did not need)."""
        if self.state is UnitState.UNSHARDING:
            self._pending.wait()  # the read must finish before its buffer is freed
            self._pending = None
        elif self.state is UnitState.GATHERING:
            self._gathered(manager)  # the collective writes the buffer until it completes (and was issued once)
        else:
            return
        self._free()

    def reshard(self) -> None:
        """Free the unsharded buffer (its bytes go back: the storage holds zero bytes)."""
        if self.state is UnitState.UNSHARDED:
            self._free()

    def _free(self) -> None:
        self.ctx.unsharded.shrink(self.index, self._storage)
        point_away(self.slots)  # Note [parameters between steps]
        self._move(UnitState.SHARDED)

    def values_readable(self) -> bool:
        """Whether its parameters' views hold values now: aliased to the stored tensor, or unsharded."""
        return self.aliased or self.flat_numel == 0 or self.state is UnitState.UNSHARDED

    def release_views(self) -> None:
        """At the engine's close: parameters viewing the unsharded buffer become empty (Note [released
        parameters] in sharded_param.py); aliased ones keep their values."""
        if not self.aliased:
            release(self.slots)

    def trainable_params(self) -> list[nn.Parameter]:
        return [s.param for s in self.slots if s.requires_grad]
