"""The optimizer step over every unit's shards, streamed through bounded buffers.

Work is a list of (unit, chunk) tasks, a chunk being one optimizer sub-group of
the rank's update range of a unit (trainable elements only: Note [stage layouts]).
For each task the master, both Adam moments and the gradient are fetched
to where the optimizer runs (the device when the optimizer state lives there,
else the CPU), updated in place (in fp32; a 16-bit state is upcast and rounded
back by its `StateUpdate`, Note [16-bit optimizer state]), written back, and the new master weights
are cast to the compute dtype and stored to the parameters' tier (or are the parameters: Note [aliased parameters] in
memory/tier.py). With state on NVMe this is a pipeline: the reads of task j+1
are issued before task j is stepped, and the writes of task j drain while later
tasks run (read ahead, step, write behind). Resident tiers are updated
in place with no copies. With a `StateReadAhead` (run by the optimizer worker,
Note [state read-ahead]) a task's state may already have been read during the
forward / backward before the update: its fetches are taken from there.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass

import torch

from infinity.device.streams import host_poll
from infinity.memory.device_lane import LANE_CHUNKS_IN_FLIGHT
from infinity.memory.manager import TieredMemoryManager
from infinity.memory.pending import Pending
from infinity.memory.tier import Kind, Tier
from infinity.memory.traffic import UPDATE_READS_AHEAD, UPDATE_WRITES_IN_FLIGHT  # the byte model stages these
from infinity.optim.cpu_adam import Hypers
from infinity.optim.read_ahead import StateReadAhead
from infinity.optim.state_update import state_update_for
from infinity.profile import Link, NullProfiler
from infinity.units.unit import Unit

_NOTHING = contextlib.nullcontext()
FETCHED = (Kind.MASTER, Kind.EXP_AVG, Kind.EXP_AVG_SQ, Kind.GRADS)
Run = tuple[int, int, int, int]  # (start, length, adam step, parameter group) of a unit's update range


@dataclass(frozen=True)
class _Task:
    unit: Unit
    chunk: int | None  # None: the unit's whole update range at once (Note [whole-unit updates])
    ranges: tuple[Run, ...]  # (start, length, adam step, group) within the chunk; the rest is left as is


class OffloadedOptimizer:
    """Adam / AdamW over all units' flat shards, wherever they live, in the plan's state dtype. `seed`: the seed
    of a bf16 master's stochastic rounding (`train.seed`; Note [16-bit optimizer state])."""

    def __init__(self, units: list[Unit], manager: TieredMemoryManager, compute_device: torch.device,
                 read_ahead: int = UPDATE_READS_AHEAD, max_writes_in_flight: int = UPDATE_WRITES_IN_FLIGHT,
                 profiler=None, blocks_compute: bool = True, state_read_ahead: StateReadAhead | None = None,
                 seed: int = 0, on_device: bool = False):
        self.units, self.manager, self.compute_device = units, manager, compute_device
        self.on_device = on_device  # the device lane's (Note [device lane]): every update on the compute device
        self.label = "lane adam" if on_device else "adam"  # its spans (on the device lane: the launches)
        self._copies_up: deque = deque()  # the device lane's: an event after each task's copies up
        self.update = state_update_for(manager.plan.state_dtype, seed)
        self.profiler = profiler or NullProfiler()
        self.blocks_compute = blocks_compute  # on the training thread: its read waits are exposed time
        self.read_ahead, self.max_writes_in_flight = read_ahead, max_writes_in_flight
        self.state_read_ahead = state_read_ahead  # the worker's (Note [state read-ahead]): reads taken from it

    def plan_tasks(self, active: dict[int, list[Run]], units: list[Unit]) -> list[_Task]:
        """Chunks that hold elements to step, given each unit's active (start, length, step, group) shard ranges.

        Note [whole-unit updates]: a unit whose state and gradients all live on the device tier is one task over
        its whole update range: its chunks (optimizer sub-groups) exist to pipeline copies and disk reads, which it
        has none of, and each costs the worker its bookkeeping and kernel launches again. On the H100 the worker
        spent ~1.6 ms launching each tail unit's update chunk by chunk, 20 ms of a deferred step's critical path
        before its first CPU update (case b, 12 tail units). Elementwise, the same result bit for bit."""
        tasks = []
        for unit in units:
            runs = active.get(unit.index, [])
            for chunk in ((None,) if self._whole(unit) else range(self.manager.num_chunks(unit.index))):
                start, numel = self.manager.chunk_span(unit.index, chunk)
                inside = tuple((max(a, start) - start, min(a + n, start + numel) - max(a, start), step, group)
                               for a, n, step, group in runs if a < start + numel and a + n > start)
                if inside:
                    tasks.append(_Task(unit, chunk, inside))
        return tasks

    @property
    def reads_disk(self) -> bool:
        """Does an update read state from NVMe (its sub-groups then pipeline their reads across units)?"""
        return any(self.manager.tier(u.index, k) is Tier.NVME for u in self.units for k in FETCHED)

    def _whole(self, unit: Unit) -> bool:
        """Note [whole-unit updates]: is the unit's state (and gradient) all on the device tier?"""
        return all(self.manager.tier(unit.index, k) is Tier.DEVICE for k in FETCHED)

    def device_of(self, unit: Unit) -> torch.device:
        """The optimizer runs where its state lives: the device tier's device, else the CPU; the device lane's on
        the device, its state copied there and back (Note [device lane] in memory/placement.py)."""
        on_device = self.on_device or self.manager.tier(unit.index, Kind.MASTER) is Tier.DEVICE
        return self.compute_device if on_device else torch.device("cpu")

    def _issue(self, task: _Task, kept_grads: dict | None = None) -> dict:
        device = self.device_of(task.unit)
        held = (self.state_read_ahead.take(task.unit.index, task.chunk)
                if self.state_read_ahead and task.chunk is not None else {})  # (a whole unit is never on NVMe)
        m, u = self.manager, task.unit.index
        if kept_grads and u in kept_grads:
            held = held | {Kind.GRADS: self._kept_chunk(task, *kept_grads[u])}
        if self.on_device:
            self._pace()
        # the gradients' chunk holding the same elements as the optimizer's (Note [stage layouts])
        fetched = {k: held[k] if k in held else m.fetch(u, s, m.optimizer_chunk(u, s, task.chunk), device)
                   for k, s in self._sources(u).items()}
        if self.on_device:
            self._copies_up.append(m.streams.record(m.streams.h2d))
        return fetched

    def _kept_chunk(self, task: _Task, grads: torch.Tensor, chunk) -> Pending:
        """The task's gradient chunk read from the unit's final gradient `grads` (the store's chunk(s) `chunk`), kept
        on the device: the update's stream holds it until it has read it (Note [device lane])."""
        m, u = self.manager, task.unit.index
        start, numel = m.chunk_span(u, m.optimizer_chunk(u, Kind.GRADS, task.chunk), Kind.GRADS)
        first, total = m.chunk_span(u, chunk, Kind.GRADS)
        assert first <= start and start + numel <= first + total, (u, task.chunk, chunk)
        view = grads.narrow(0, start - first, numel)
        m.streams.hold(view, m.streams.current())
        m.after_copies(u, Kind.GRADS, chunk)  # (the update unscales it in place: after its copy to the host read it)
        return Pending(view)

    def _sources(self, u: int) -> dict[Kind, Kind]:
        """The kind each fetched kind is read from: itself, except on the device lane for a master of the compute
        dtype beside parameters on the device, which hold the same values (the master's last store wrote them):
        the lane updates the parameters in place and copies up a quarter less (Note [device lane])."""
        m = self.manager
        in_params = (self.on_device and m.plan.dtype(Kind.MASTER) == m.plan.compute_dtype
                     and m.tier(u, Kind.PARAMS) is Tier.DEVICE and not m.plan.aliases_master(u))
        return {k: Kind.PARAMS if in_params and k is Kind.MASTER else k for k in FETCHED}

    def _pace(self) -> None:
        """Note [device lane]: at most LANE_CHUNKS_IN_FLIGHT tasks' copies up queued on the h2d stream, so the
        parameters the CPU's worker uploads for the next forward wait behind no more than that."""
        while len(self._copies_up) >= LANE_CHUNKS_IN_FLIGHT:
            host_poll(self._copies_up.popleft(), "device lane pace")

    def task_chunks(self, active: dict[int, list[Run]], units: list[Unit]) -> list[tuple[int, int]]:
        """(unit, chunk) of every task `step` would run, in its order (what to read ahead)."""
        return [(t.unit.index, t.chunk) for t in self.plan_tasks(active, units) if t.chunk is not None]

    def step(self, *, hyper: Hypers, grad_scale: float | None, active: dict[int, list[Run]],
             units: list[Unit] | None = None, on_unit_done=None, journal=None, kept_grads: dict | None = None) -> None:
        """One update of the active elements of `units` (default: all), in that order.

        Each run carries its 1-based Adam step and its parameter group, whose hyper-parameters are
        `hyper[group]` (Note [groups ride on ranges] in groups.py: one kernel call per run).
        `on_unit_done(unit)` is called once a unit's last sub-group has been stepped and its write-backs
        issued (later reads of its shards wait for those writes); its gradients are then declared zero.
        `journal`: a use of the speculation's journal (Note [speculative update] in journal.py) that sees
        each sub-group's state before it is stepped: it copies it in, or back (and may say not to step).
        `kept_grads`: per unit, its final gradient kept on the device and that gradient's chunk(s) of the store,
        read instead of fetching it (the device lane's: Note [device lane] in memory/placement.py).
        """
        m = self.manager
        units = self.units if units is None else units
        tasks = self.plan_tasks(active, units)
        last_task = {}
        for i, task in enumerate(tasks):
            last_task[task.unit.index] = i
        ahead: deque = deque()
        writes: deque = deque()
        next_task = 0
        finished = set()

        def finish(unit: Unit) -> None:
            m.mark_zero(unit.index, Kind.GRADS)
            finished.add(unit.index)
            if on_unit_done is not None:
                on_unit_done(unit)

        for unit in units:
            if unit.index not in last_task:
                finish(unit)  # nothing to step (no gradient anywhere): done at once
        for i, task in enumerate(tasks):
            while next_task < len(tasks) and len(ahead) <= self.read_ahead:
                ahead.append(self._issue(tasks[next_task], kept_grads))  # read ahead while earlier tasks compute
                next_task += 1
            pending = ahead.popleft()
            prof = self.profiler
            what = f"u{task.unit.index}" if task.chunk is None else f"u{task.unit.index} c{task.chunk}"
            with prof.wait(Link.NVME_READ, f"optimizer state {what}") if self.blocks_compute else _NOTHING:
                bufs = {k: p.wait() for k, p in pending.items()}  # this sub-group's state must be in memory to step it
            u, c = task.unit.index, task.chunk
            at = m.chunk_span(u, c)[0]  # the chunk's start in the unit's update range
            first = task.unit.layout.update.start + at  # the chunk's index in the flat buffer
            with prof.span(f"{journal.label if journal else self.label} {what}", Link.CPU_OPTIMIZER,
                           num_bytes=sum(r[1] for r in task.ranges) * self.update.bytes_per_element,
                           unit=task.unit.name):
                stepped = journal.before_step(u, at, task.ranges, bufs) if journal is not None else True
                for a, n, step, group in task.ranges if stepped else ():
                    master, exp_avg, exp_avg_sq, grad = (bufs[k].narrow(0, a, n) for k in FETCHED)
                    self.update.step(master, grad, exp_avg, exp_avg_sq, step=step, hyper=hyper[group],
                                     grad_scale=grad_scale, unit=u, first=first + a)
            # the parameters first: the next forward reads them soonest (from memory when kept:
            # Note [fresh parameters]); aliased to the master, they are its write (Note [aliased parameters])
            writes.extend(m.store_master(u, c, bufs[Kind.MASTER], keep_params=True))
            for kind in (Kind.EXP_AVG, Kind.EXP_AVG_SQ):
                writes.append(m.store(u, kind, c, bufs[kind]))
            m.release(bufs[Kind.GRADS])
            while len(writes) > self.max_writes_in_flight:
                writes.popleft().wait()  # bound the staging buffers held by write-behind
            if last_task[u] == i:
                finish(task.unit)
