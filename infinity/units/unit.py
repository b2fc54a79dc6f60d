"""Unit: the parameters of one block, which move and communicate together.

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
fp32 and reduced as the stage says (`reduce_grads`; grad_reduce.py).

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
its whole parameters (host / NVMe; nothing to store when aliased on the
device), so the backward and later micro-batches fetch them without gathering.
Stage 0 needs no gather: every rank steps the whole model on the same all-reduced
gradients, bit for bit alike.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from infinity.device import collectives
from infinity.device.streams import Streams
from infinity.memory.buffers import UnshardedMemory
from infinity.memory.manager import Pending, TieredMemoryManager
from infinity.memory.placement import UnitSizes
from infinity.memory.stages import Stage, UnitLayout, padded_numel, stage_for
from infinity.memory.tier import Kind, Tier
from infinity.profile import Link
from infinity.units.sharded_param import ParamSlot, collect_slots, install, layout
from infinity.units.tiling import TILED, contains_tiles


class UnitState(enum.Enum):
    """SHARDED -> UNSHARDING (fetch issued) -> GATHERING (all-gather issued, several ranks) -> UNSHARDED
    (gathered, views valid) -> SHARDED (reshard)."""

    SHARDED = "sharded"
    UNSHARDING = "unsharding"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


@dataclass(frozen=True)
class Comm:
    """What a unit needs to know about the process group and the device."""

    group: object  # None for a single process
    rank: int
    world_size: int
    device: torch.device
    compute_dtype: torch.dtype
    streams: Streams
    profiler: object = None  # infinity.profile.Profiler or NullProfiler
    unsharded: UnshardedMemory = UnshardedMemory()  # the bytes of unsharded buffers (Note [unsharded memory])
    stage: Stage = stage_for(3)  # what each rank stores of each kind, and the collectives (memory/stages.py)
    sub_group_size: int = 8_388_608  # [optimizer] sub_group_size: the chunks of every stored kind


@dataclass(frozen=True)
class Reduction:
    """An issued sum of a unit's gradient over the ranks: what this rank keeps of it, and the collective."""

    kept: torch.Tensor
    work: object  # the handle (collectives.DONE with one rank)
    link: Link | None = None
    num_bytes: int = 0  # Note [collective bytes] (profile/records.py)
    issued: float = 0.0


class Unit:
    """One unit's parameters, their unsharded buffer, and its state."""

    def __init__(self, index: int, name: str, modules: list[nn.Module], slots: list[ParamSlot],
                 trainable_numel: int, comm: Comm):
        self.index, self.name, self.modules, self.slots, self.comm = index, name, modules, slots, comm
        self.flat_numel = sum(s.numel for s in slots)
        self.trainable_numel = trainable_numel
        self.padded_numel = padded_numel(self.flat_numel, comm.world_size)
        self.shard_numel = self.padded_numel // comm.world_size
        # What this rank stores of each kind (Note [stage layouts]). Note [padding rides with the trainable]:
        # a unit without frozen weights counts its padding as trainable, so at stage 3 every kind stores the
        # same whole partition (one layout: its parameters may alias the master) as before stages existed.
        trainable = self.padded_numel if trainable_numel == self.flat_numel else trainable_numel
        self.layout: UnitLayout = comm.stage.layout(self.flat_numel, trainable, comm.world_size, comm.rank,
                                                    comm.sub_group_size)
        self.stored_trainable = trainable  # the T of the layouts: gradients and optimizer state cover [0, T)
        self.state = UnitState.SHARDED
        itemsize = comm.compute_dtype.itemsize
        self._nbytes = self.padded_numel * itemsize
        self._storage = torch.empty(0, dtype=comm.compute_dtype, device=comm.device).untyped_storage()
        self._pending: Pending | None = None  # the fetch of this rank's shard (UNSHARDING)
        self._gather: tuple[object, float] | None = None  # the all-gather's handle and issue time (GATHERING)
        self.aliased = False  # parameters view the stored shard (see alias)
        self._stored: torch.Tensor | None = None  # the stored whole parameters the views alias
        self.stale = False  # Note [post-update gather]: the other ranks' updated partitions are still to come
        self._grad_flat: torch.Tensor | None = None  # this backward's gradients, filled parameter by parameter
        self.slots_with_grad: set[int] = set()  # ids of slots that got a gradient in this accumulation window
        self.param_steps: dict[str, int] = {}  # optimizer steps each parameter has taken (Adam bias correction)
        self.slot_groups: tuple[int, ...] = ()  # per trainable slot: its parameter group (empty: all group 0)
        self.peak_unsharded = 0

    def can_alias(self, stored: torch.Tensor | None) -> bool:
        """The stored parameters are the whole unit on the compute device (one rank, or stages 0-2)."""
        return stored is not None and stored.device == self.comm.device and stored.numel() == self.padded_numel

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
        if self.comm.stage.gathers_after_update and self.comm.group is not None:
            self.stale = True

    def install_views(self) -> None:
        """Make every owner module hold parameters that view the unsharded buffer (once, after
        the unit's values have been stored in its shards)."""
        install(self.slots, self._flat())
        self._storage.resize_(0)  # set_ grew the storage to the view's size; sharded means zero bytes

    # ----------------------------------------------------------------- views
    def _flat(self) -> torch.Tensor:
        """A fresh tensor over the unsharded storage (its own version counter, so filling it
        does not trip autograd's checks on the parameter views saved for backward)."""
        t = torch.empty(0, dtype=self.comm.compute_dtype, device=self.comm.device)
        return t.set_(self._storage, 0, (self.padded_numel,), (1,))

    @property
    def shard_bytes(self) -> int:
        """Bytes an unshard fetches: the parameters this rank stores (stage 3: its shard; else the whole unit)."""
        return self.layout.params.numel * self.comm.compute_dtype.itemsize

    def shard_range(self) -> tuple[int, int]:
        """[start, end) of this rank's partition in the unit's flat buffer (stage 3: the parameters it stores)."""
        start = self.comm.rank * self.shard_numel
        return start, start + self.shard_numel

    # ----------------------------------------------------------------- unshard / reshard
    def gathers(self) -> bool:
        """The next unshard all-gathers: always at stage 3 (several ranks), once after an update at stages 1-2."""
        return self.comm.group is not None and (self.comm.stage.gathers_params or self.stale)

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
            self.comm.unsharded.grow(self.index, self._storage, self._nbytes)
            self.peak_unsharded = max(self.peak_unsharded, self._nbytes)
        # The shard lands in its own slot of the unsharded buffer; the all-gather fills the rest in place.
        into = self._own_slot() if self.comm.stage.gathers_params else self._flat()
        self._pending = manager.fetch(self.index, Kind.PARAMS, None, into=into, urgent=True)
        self.state = UnitState.UNSHARDING

    def issue_gather(self, manager: TieredMemoryManager) -> None:
        """Issue: once this rank's shard has landed, all-gather it into the unsharded buffer on the comm
        stream, asynchronously (a prefetch issues it while the previous unit computes, as FSDP2 does).
        With one rank the fetch fills the whole buffer: the unit is unsharded once it lands."""
        if self.state is UnitState.SHARDED:
            self.unshard(manager)
        if self.state is not UnitState.UNSHARDING:
            return
        prof = self.comm.profiler
        link = Link.NVME_READ if manager.tier(self.index, Kind.PARAMS) is Tier.NVME else Link.H2D  # the plan's
        with prof.wait(link, f"fetch {self.name}"):
            shard = self._pending.wait()  # the gather (or, with one rank, compute) reads this unit's bytes
        self._pending = None
        if not self.gathers():
            self.state = UnitState.UNSHARDED  # one rank, or whole parameters that are current
            return
        own = shard if self.comm.stage.gathers_params else self._own_slot()
        self._gather = self._issue_all_gather(self._flat(), own)
        self.state = UnitState.GATHERING

    def _issue_all_gather(self, whole: torch.Tensor, own: torch.Tensor) -> tuple[object, float]:
        streams = self.comm.streams
        streams.wait_event(streams.record(), streams.comm)  # the comm stream must see the fetched shard
        with streams.use(streams.comm):
            return collectives.all_gather_into(whole, own, self.comm.group), time.perf_counter()

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
            self.state = UnitState.UNSHARDED

    def _gathered(self, manager: TieredMemoryManager) -> None:
        """Wait for the all-gather in flight; after a post-update gather, keep the other partitions where the
        next fetch reads them (Note [post-update gather])."""
        self._wait_gather()
        streams = self.comm.streams
        streams.wait_event(streams.record(streams.comm))  # compute waits for the gathered bytes, on the device
        if not self.stale:
            return
        self.stale = False
        if self.aliased:
            return  # the gather wrote the stored parameters themselves
        flat = self._flat()
        for chunk in manager.params_not_updated(self.index):
            start, numel = manager.chunk_span(self.index, chunk, Kind.PARAMS)
            if start >= self.stored_trainable:
                continue  # frozen weights never change
            target = manager.target(self.index, Kind.PARAMS, chunk, flat.device)
            target.copy_(flat.narrow(0, self.layout.params.start + start, numel))  # (the buffer is freed soon)
            manager.store(self.index, Kind.PARAMS, chunk, target)  # a later fetch waits for the write

    def _wait_gather(self) -> None:
        (work, issued), self._gather = self._gather, None
        prof, streams = self.comm.profiler, self.comm.streams
        with streams.use(streams.comm), prof.wait(Link.ALL_GATHER, f"all-gather {self.name}"):
            work.wait()  # NCCL: the comm stream waits for the collective; gloo: the host waits for the bytes
        prof.record(f"all-gather {self.name}", Link.ALL_GATHER, issued, time.perf_counter(), num_bytes=self._nbytes,
                    unit=self.name)

    def cancel_unshard(self, manager: TieredMemoryManager) -> None:
        """Abandon an issued unshard that will not be used (a prefetch the order did not need)."""
        if self.state is UnitState.UNSHARDING:
            self._pending.wait()  # the read must finish before its buffer is freed
            self._pending = None
        elif self.state is UnitState.GATHERING:
            self._gathered(manager)  # the collective writes the buffer until it completes (and was issued once)
        else:
            return
        self.comm.unsharded.shrink(self.index, self._storage)
        self.state = UnitState.SHARDED

    def reshard(self) -> None:
        """Free the unsharded buffer (its bytes go back: the storage holds zero bytes)."""
        if self.state is UnitState.UNSHARDED:
            self.comm.unsharded.shrink(self.index, self._storage)
            self.state = UnitState.SHARDED

    # ----------------------------------------------------------------- gradients
    def absorb_grad(self, slot: ParamSlot) -> None:
        """Move one parameter's fresh `.grad` into the unit's fp32 flat gradient (and free it), so at
        most one parameter's gradient exists beside the flat buffer."""
        if self._grad_flat is None:
            self._grad_flat = torch.zeros(self.padded_numel, dtype=torch.float32, device=self.comm.device)
        self._grad_flat.narrow(0, slot.offset, slot.numel).copy_(slot.param.grad.reshape(-1))
        slot.param.grad = None
        self.slots_with_grad.add(id(slot))

    def grad_flags(self) -> list[bool]:
        """Per trainable slot (flat order): did it get a gradient in this accumulation window?"""
        return [id(s) in self.slots_with_grad for s in self.slots if s.requires_grad]

    def set_groups(self, group_of: dict[str, int]) -> None:
        """Each trainable parameter's group, by canonical name (Note [groups ride on ranges] in optim/groups.py)."""
        self.slot_groups = tuple(group_of[s.name] for s in self.slots if s.requires_grad)

    def active_ranges(self, flags: list[bool]) -> list[tuple[int, int, int, int]]:
        """(start, length, adam_step, group) runs of this rank's update range (`layout.update`) to step this step.

        `flags` (from `grad_flags`, reduced over ranks) says which trainable parameters
        got a gradient on some rank. Like torch.optim, a parameter whose gradient is
        None is not stepped (no decay, no moment update) and its own step count, used
        for bias correction, does not advance. Runs merge neighbours of equal step count
        and parameter group (Note [groups ride on ranges] in optim/groups.py).
        """
        update = self.layout.update  # ranges are relative to its start (stages 1-3: rank * s; stage 0: 0)
        shard_start, shard_end = update.start, update.start + update.numel
        trainable = [s for s in self.slots if s.requires_grad]
        groups = self.slot_groups or (0,) * len(trainable)
        runs: list[tuple[int, int, int, int]] = []
        for slot, flag, group in zip(trainable, flags, groups):
            lo, hi = max(slot.offset, shard_start), min(slot.offset + slot.numel, shard_end)
            if not flag or lo >= hi:
                continue
            step = self.param_steps.get(slot.name, 0) + 1
            if runs and runs[-1][0] + runs[-1][1] == lo - shard_start and runs[-1][2:] == (step, group):
                runs[-1] = (runs[-1][0], runs[-1][1] + hi - lo, step, group)
            else:
                runs.append((lo - shard_start, hi - lo, step, group))
        return runs

    def commit_steps(self, flags: list[bool]) -> None:
        """Advance the step count of the parameters that were updated (every rank, shard or not)."""
        for slot, flag in zip((s for s in self.slots if s.requires_grad), flags):
            if flag:
                self.param_steps[slot.name] = self.param_steps.get(slot.name, 0) + 1

    def take_grads(self) -> torch.Tensor:
        """This backward's flat fp32 gradient, handed over (zeros where parameters got no gradient)."""
        flat, self._grad_flat = self._grad_flat, None
        if flat is None:
            flat = torch.zeros(self.padded_numel, dtype=torch.float32, device=self.comm.device)
        return flat

    def reduce_grads(self, flat: torch.Tensor) -> Reduction:
        """Issue: sum a flat fp32 gradient over the ranks as the stage says: reduce-scatter into this rank's
        partition (stages 1-3), or all-reduce the whole trainable part (stage 0). The result's `kept` is
        the sum over this rank's update range (`layout.update`), where the optimizer reads it. Parameters
        without a gradient contribute zeros."""
        comm, update = self.comm, self.layout.update
        if comm.group is None:
            return Reduction(flat.narrow(0, update.start, update.numel), collectives.DONE)  # one rank: no copy
        comm.streams.wait_event(comm.streams.record(), comm.streams.comm)  # the flat gradient is written on compute
        with comm.streams.use(comm.streams.comm):
            issued = time.perf_counter()
            if comm.stage.optimizer_partitioned:
                out = torch.empty(self.shard_numel, dtype=torch.float32, device=comm.device)
                work = collectives.reduce_scatter_sum(out, flat, comm.group)
                kept = out.narrow(0, update.start - self.shard_range()[0], update.numel)
                link, volume = Link.REDUCE_SCATTER, flat.numel()  # Note [collective bytes]
            else:
                kept = flat.narrow(0, update.start, update.numel)
                work = collectives.all_reduce_sum(kept, comm.group, async_op=True)
                link, volume = Link.ALL_REDUCE, 2 * kept.numel()
        comm.streams.hold(flat, comm.streams.comm)
        return Reduction(kept, work, link, volume * 4, issued)

    def norm_part(self) -> tuple[int, int]:
        """(offset, numel) within a reduction's `kept` of the gradient this rank counts in the global norm:
        its partition's trainable elements (stage 0 keeps them all, and each rank counts its partition)."""
        start, _ = self.shard_range()
        numel = max(0, min(self.shard_numel, self.stored_trainable - start))
        return (start - self.layout.update.start, numel) if numel else (0, 0)  # (a frozen partition: nothing)

    def trainable_params(self) -> list[nn.Parameter]:
        return [s.param for s in self.slots if s.requires_grad]


def find_unit_modules(model: nn.Module, classes: list[str]) -> list[tuple[str, nn.Module]]:
    """The modules that form units, in module order.

    With `classes` (from `[units] classes`): every module whose class name is listed
    (not descending into one once found). Otherwise: the children of each
    `nn.ModuleList` that hold parameters (the repeated blocks). Every tile of a TiledLinear or TiledEmbedding
    is a unit, and a block holding one is split into its children that hold parameters, recursively, so that
    units do not nest (Note [tiles are units] in tiling.py).
    """
    return _walk(model, classes)[0]


def split_blocks(model: nn.Module, classes: list[str]) -> list[tuple[str, nn.Module]]:
    """The blocks that would be units but hold a tiled layer, so their children are (outermost only)."""
    return _walk(model, classes)[1]


def activation_modules(model: nn.Module, classes: list[str]) -> list[tuple[str, nn.Module]]:
    """What `[activation] checkpoint = "units"` checkpoints, in module order: each split block whole, and every
    unit outside one (Note [tiles are units] in tiling.py)."""
    units, split = _walk(model, classes)
    inside = {id(m) for _, block in split for m in block.modules()}
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(split + [(n, m) for n, m in units if id(m) not in inside], key=lambda nm: order[id(nm[1])])


def split_regions(model: nn.Module, classes: list[str], units: list[Unit]) -> list[tuple[nn.Module, list[Unit]]]:
    """Each split block with the units inside it, in forward (module) order."""
    regions = []
    for _, block in split_blocks(model, classes):
        inside = {id(m) for m in block.modules()}
        regions.append((block, [u for u in units[1:] if id(u.modules[0]) in inside]))
    return regions


def _walk(model: nn.Module, classes: list[str]) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    found: list[tuple[str, nn.Module]] = []
    split_found: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, module: nn.Module, split: bool = False) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, TILED):
                found.extend((f"{path}.tiles.{i}", tile) for i, tile in enumerate(child.tiles))
                continue
            holds = any(True for _ in child.parameters())
            if classes:
                block = type(child).__name__ in classes
            else:
                block = isinstance(module, nn.ModuleList) and holds
            if (block or (split and holds)) and not contains_tiles(child):
                found.append((path, child))
                continue
            if block and not split:
                split_found.append((path, child))
            walk(path, child, split or block)

    walk("", model)
    if classes and not found:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(f"units.classes = {classes} matches no module of the model; its module classes are "
                         f"{present}: list the class of the repeated block (e.g. the transformer layer)")
    return found, split_found


def assign_parameters(model: nn.Module, unit_modules: list[nn.Module]) -> list[list[tuple]]:
    """(fqn, module, attr, param) entries per unit; index 0 is the root unit.

    A parameter used by several units (a tied embedding and output head) goes to
    the root unit, which stays unsharded for the whole forward and backward.
    """
    unit_of_module: dict[int, int] = {}
    for i, um in enumerate(unit_modules, start=1):
        for sub in um.modules():
            unit_of_module.setdefault(id(sub), i)
    entries: dict[int, list] = {}
    units_of_param: dict[int, set] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is None:
                continue
            fqn = f"{mname}.{attr}" if mname else attr
            entries.setdefault(id(param), []).append((fqn, module, attr, param))
            units_of_param.setdefault(id(param), set()).add(unit_of_module.get(id(module), 0))
    per_unit: list[list[tuple]] = [[] for _ in range(len(unit_modules) + 1)]
    for pid, items in entries.items():
        owners = units_of_param[pid]
        per_unit[next(iter(owners)) if len(owners) == 1 else 0].extend(items)
    return per_unit


def build_units(model: nn.Module, classes: list[str], comm: Comm) -> list[Unit]:
    """Split `model` into units (root first). Nothing is allocated: parameters may be on meta."""
    found = find_unit_modules(model, classes)
    per_unit = assign_parameters(model, [m for _, m in found])
    names = ["<root>"] + [n for n, _ in found]
    modules = [[model]] + [[m] for _, m in found]
    units = []
    for i, entries in enumerate(per_unit):
        slots = collect_slots(entries)
        trainable = layout(slots)
        units.append(Unit(i, names[i], modules[i], slots, trainable, comm))
    return units


def unit_sizes(units: list[Unit], sub_group_size: int | None = None,
               recomputed: frozenset[int] = frozenset()) -> tuple[UnitSizes, ...]:
    """What placement needs to know of each unit on this rank: its layout (chunked by `Comm.sub_group_size`,
    which `sub_group_size`, when given, must equal), and its fetches per micro-batch (`recomputed`: the units of
    the blocks checkpointed whole, `recomputed_units`)."""
    assert all(sub_group_size in (None, u.comm.sub_group_size) for u in units), (
        sub_group_size, {u.comm.sub_group_size for u in units})
    return tuple(UnitSizes(name=u.name, layout=u.layout, trainable_numel=u.stored_trainable,
                           fetches=3 if u.index in recomputed else 2) for u in units)


def units_in(regions: list[tuple[nn.Module, list[Unit]]]) -> frozenset[int]:
    """The indices of the units inside the split blocks."""
    return frozenset(u.index for _, units in regions for u in units)


def recomputed_units(regions: list[tuple[nn.Module, list[Unit]]], checkpoint: str,
                     units_ahead: int) -> frozenset[int]:
    """The units a whole-block recomputation fetches once more per micro-batch (Note [tiles are units]): all
    of a split block's but its last `units_ahead + 1`, which its backward fetched (and prefetched) before the
    recomputation starts."""
    if checkpoint != "units":
        return frozenset()
    return frozenset(u.index for _, units in regions for u in units[:max(0, len(units) - units_ahead - 1)])
