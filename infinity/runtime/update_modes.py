"""Update modes: when an accumulation window's optimizer update runs, relative to the training thread.

Note [overlap]: with no global dependency (no clipping, no fp16 loss scaling, non-finite
gradients are errors) a unit's update needs only its own gradients, so it runs on the
worker as soon as they are final, during backward (`EagerUpdate`). With clipping, fp16 loss
scaling or skipped non-finite steps (and `overlap.speculation` "auto", the default, or 0) `step()`
computes the global norm first and hands the units to the worker in the order the next
forward uses them; that forward waits per unit (`DeferredUpdate`). With a size in
`overlap.speculation` (not with fp16) the update runs during backward anyway, as if the clip
will not fire, and is redone or put back from a journal once the norm says so
(`SpeculativeUpdate`, Note [speculative update] in optim/journal.py). Without
`[overlap] optimizer_with_backward` the update runs on the training thread inside
`step()` (`InlineUpdate`). All four are exactly the same update, bit for bit.

One type per mode (`MODE_TYPES`), chosen once by `update_mode(config)` (config/update_mode.py, the one
place the choice is made) and built by `build_update`; the engine calls the interface and never asks which
mode runs:

  ready(i)               may unit i's parameters be fetched now (not being updated)?
  before_forward(unit)   the forward is about to use `unit`: wait for its update
  before_grads(unit)     `unit`'s gradient shard is about to be written (GradReducer)
  grads_final(unit, s)   `unit`'s gradient for the window is complete, its squared norm `s`
  keep_grads(unit, g, c) that gradient as stored (chunk(s) `c`), to keep for the update if the mode wants it
  step(norm, index)      the window is complete (global `norm`): update, skip or raise
  settled()              a context inside which no update or state read is in flight
  resume()               a background save stopped reading the swap: read ahead again
  put_order() / forward_takes_in_order: the kept-copies prediction (`kept_params`)
  finish() / close()     the engine closes: wait for what is in flight, stop the worker

Each owns what its mode needs: the optimizer, the worker and the state read-ahead
(Note [state read-ahead]), the fresh-copies calls (Note [fresh parameters]) and the
policy for non-finite gradients.
"""

from __future__ import annotations

import abc
import contextlib
import math
from typing import Callable

import torch

from infinity.config.sections import Config
from infinity.config.update_mode import Mode, update_mode
from infinity.device.collectives import all_reduce_max
from infinity.device.streams import host_value, to_host, worker_cores, worker_threads
from infinity.memory.fresh import kept_chunks
from infinity.memory.manager import TieredMemoryManager
from infinity.memory.tier import Kind, Tier
from infinity.memory.traffic import speculated_units
from infinity.optim.cpu_adam import Hypers
from infinity.optim.journal import Journal, journal_for
from infinity.optim.offloaded import OffloadedOptimizer, Run
from infinity.optim.read_ahead import StateReadAhead
from infinity.optim.worker import OptimizerWorker
from infinity.profile import Link
from infinity.runtime.loss_scale import LossScaler
from infinity.runtime.prefetch import OrderTrace
from infinity.units.unit import Unit

NO_SPAN = contextlib.nullcontext()


class NonFiniteGradError(FloatingPointError):
    """Gradients were NaN or Inf and `[train] on_nonfinite = "error"`."""


class UpdateMode(abc.ABC):
    """How one accumulation window's update runs (module docstring: the interface)."""

    forward_takes_in_order = False  # the next forward takes the kept copies as the update puts them
    updates_during_backward = False  # the final backward starts updates: a background save must be committed first

    def __init__(self, *, units: list[Unit], manager: TieredMemoryManager, optimizer: OffloadedOptimizer,
                 scaler: LossScaler, hyper: Callable[[], Hypers], trace: OrderTrace, group, device: torch.device,
                 grad_clip: float, on_nonfinite: str, profiler):
        self.units, self.manager, self.optimizer, self.scaler = units, manager, optimizer, scaler
        self.hyper = hyper  # per parameter group, the hyperparameters of the update issued now (its lr)
        self.trace, self.group, self.device, self.profiler = trace, group, device, profiler
        self.grad_clip, self.on_nonfinite = grad_clip, on_nonfinite
        self._positions: tuple[list[int] | None, dict[int, int]] = (None, {})  # (the trace's order, unit -> place)

    # ----------------------------------------------------------------- the interface (no-ops here)
    def ready(self, index: int) -> bool:
        return True

    def before_forward(self, unit: Unit) -> None:
        pass

    def before_grads(self, unit: Unit) -> None:
        pass

    def grads_final(self, unit: Unit, sumsq: torch.Tensor) -> None:
        pass

    def keep_grads(self, unit: Unit, grads: torch.Tensor, chunk) -> None:
        pass

    @abc.abstractmethod
    def step(self, norm: float, index: int) -> bool:
        """The window's update (optimizer step `index`, global gradient norm `norm`): True if it was
        applied or issued, False if skipped; raises NonFiniteGradError when the policy says so."""

    @contextlib.contextmanager
    def settled(self):
        yield

    def resume(self) -> None:
        pass

    @abc.abstractmethod
    def put_order(self) -> list[Unit]:
        """The order in which the update puts the units' new parameters (Note [fresh parameters])."""

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass

    # ----------------------------------------------------------------- shared by the modes
    def kept_params(self) -> frozenset[tuple[int, int]]:
        """The (unit, chunk)s whose first parameter fetch after an update reads the copy the update kept
        (Note [fresh parameters]): every chunk that fits when the forward takes in the update's order,
        else those left after the puts in `put_order`."""
        m = self.manager
        order = [u for u in self.put_order() if m.tier(u.index, Kind.PARAMS) is Tier.NVME]
        chunks = [(u.index, m.optimizer_chunk(u.index, Kind.PARAMS, c)) for u in order  # the chunks it writes
                  for c in range(m.num_chunks(u.index))]
        nbytes = {(u, c): m.chunk_span(u, c, Kind.PARAMS)[1] * m.plan.compute_dtype.itemsize for u, c in chunks}
        return kept_chunks(nbytes, chunks, m.fresh.budget, blocking=self.forward_takes_in_order)

    def _begin_puts(self) -> None:
        """An update starts: the fresh copies keep what `kept_params` predicts (Note [fresh parameters])."""
        self.manager.fresh.begin_update([u.index for u in self.put_order()], blocking=self.forward_takes_in_order,
                                        keep=self.kept_params())

    def position(self, unit: Unit) -> int:
        """Where the next forward uses `unit` (Note [forward first] in optim/worker.py)."""
        if self._positions[0] is not self.trace.recorded:  # (the trace records a new list when the order changes)
            self._positions = (self.trace.recorded, {u.index: k for k, u in enumerate(self.forward_order())})
        return self._positions[1][unit.index]

    def forward_order(self) -> list[Unit]:
        """The units in the order the next forward uses them (the recorded one; the root first)."""
        order = [0] + [i for i in self.trace.recorded if i != 0]
        seen = set(order)
        return [self.units[i] for i in order + [u.index for u in self.units if u.index not in seen]]

    def reduce_flags(self, per_unit: list[list[bool]]) -> list[list[bool]]:
        """Per unit and trainable parameter: did it get a gradient on any rank this window?"""
        return self.issue_flags(per_unit).wait()

    def issue_flags(self, per_unit: list[list[bool]]) -> "_Flags":
        """Issue `reduce_flags` (the collective starts now, on this thread: every rank issues it in the
        same place); its `wait()` may run on another thread."""
        return _Flags(per_unit, self.group, self.device)

    def _global_update(self, norm: float, index: int):
        """A window whose update depends on the global norm: (hyper, grad_scale, flags, active), or None
        when it is skipped (non-finite gradients: discarded, then the loss scale backs off or it raises)."""
        if not math.isfinite(norm):
            for unit in self.units:
                self.manager.mark_zero(unit.index, Kind.GRADS)  # the window's gradients are discarded
                unit.grads.slots_with_grad.clear()
            if self.scaler.dynamic:
                self.scaler.update(found_inf=True)
                return None
            if self.on_nonfinite == "error":
                raise NonFiniteGradError(
                    f"gradient norm is {norm} at optimizer step {index}: the loss or a gradient overflowed. "
                    f"Lower optimizer.lr, check the data, or set train.on_nonfinite = \"skip\" to skip such steps")
            return None
        self.scaler.update(found_inf=False)
        flags = self.reduce_flags([u.grads.flags() for u in self.units])
        active = {u.index: u.steps.active_ranges(f) for u, f in zip(self.units, flags)}
        return self.hyper(), self.grad_scale(norm), flags, active

    def grad_scale(self, norm: float) -> float | None:
        """What a finite window's update divides its gradients by (global norm `norm`): the loss scale over the clip
        coefficient; None when that is 1."""
        clip_coef = min(1.0, self.grad_clip / (norm + 1e-6)) if self.grad_clip > 0 else 1.0
        grad_scale = self.scaler.scale / clip_coef
        return None if grad_scale == 1.0 else grad_scale


class _Flags:
    """An issued max-reduction of per-parameter gradient flags over the ranks."""

    def __init__(self, per_unit: list[list[bool]], group, device: torch.device):
        self.lengths = [len(f) for f in per_unit]
        self.flags = torch.tensor([f for unit_flags in per_unit for f in unit_flags], dtype=torch.int32)
        self.work = None
        if group is not None and self.flags.numel():
            self.flags = self.flags.to(device)  # NCCL reduces device tensors; gloo CPU ones
            self.work = all_reduce_max(self.flags, group, async_op=True)

    def wait(self) -> list[list[bool]]:
        flags = self.flags
        if self.work is not None:
            self.work.wait()  # (NCCL: this thread's stream waits for it; gloo: the host does)
            flags = to_host(flags, "gradient flags")
        out, pos = [], 0
        for n in self.lengths:
            out.append([bool(f) for f in flags[pos: pos + n].tolist()])
            pos += n
        return out


def after_update(flags: list[bool], unit: Unit) -> Callable[[Unit], None]:
    """What follows a unit's update: its parameters' Adam steps advance, its window's gradients are spent, and
    at stages 1-2 the other partitions are due (Note [post-update gather] in unit.py)."""
    def after(u: Unit) -> None:
        u.steps.commit(flags)
        u.grads.slots_with_grad.clear()
        u.updated()
    return after


class InlineUpdate(UpdateMode):
    """The update runs on the training thread inside `step()`, unit by unit in unit order."""

    def step(self, norm: float, index: int) -> bool:
        update = self._global_update(norm, index)
        if update is None:
            return False
        hyper, grad_scale, flags, active = update
        self._begin_puts()
        with self.profiler.wait(Link.CPU_OPTIMIZER, "update on the training thread"):  # (Note [step attribution])
            self.optimizer.step(hyper=hyper, grad_scale=grad_scale, active=active,
                                on_unit_done=lambda u: after_update(flags[u.index], u)(u))
        return True

    def put_order(self) -> list[Unit]:
        return self.units


class _OnWorker(UpdateMode):
    """An update run by the optimizer worker while the training thread computes."""

    def __init__(self, *, worker: OptimizerWorker, reading_swap: Callable[[], bool], **shared):
        super().__init__(**shared)
        self.worker = worker
        self.reading_swap = reading_swap  # a background save still reads the swap: the read-ahead stays paused
        self._settled = 0  # depth of settled(): the read-ahead stays paused inside
        plan = self.manager.plan  # Note [device lane]: the units it may step (none where it speculates), and those
        # whose final gradient the device keeps for it (only where the update waits for the norm: the plan's)
        self._lane = frozenset(plan.device_lane) if self.worker.lane is not None else frozenset()
        self._keeps = frozenset(plan.lane_grads) & self._lane
        self._kept: dict[int, tuple[torch.Tensor, object]] = {}  # unit -> (final gradient on the device, its chunk)

    def keep_grads(self, unit: Unit, grads: torch.Tensor, chunk) -> None:
        """Note [device lane]: the final gradient of a unit the lane will likely take stays on the device for it."""
        if unit.index in self._keeps:
            self._kept[unit.index] = (grads, chunk)

    def ready(self, index: int) -> bool:
        if self.worker.pending(index):
            return False
        self.worker.wait_unit(index)  # (done: this only makes the fetch follow the update on the device)
        return True

    def before_forward(self, unit: Unit) -> None:
        pending = self.worker.pending(unit.index)
        with self.profiler.wait(Link.CPU_OPTIMIZER, f"update {unit.name}") if pending else NO_SPAN:
            self._wait_unit(unit)  # its parameters may still be updating (and a failed update raises)

    def before_grads(self, unit: Unit) -> None:
        """Its previous update must have finished (units the forward used were waited for there; this
        catches the ones it skipped)."""
        if self.worker.pending(unit.index):
            with self.profiler.wait(Link.CPU_OPTIMIZER, f"update {unit.name}"):
                self._wait_unit(unit)

    def _wait_unit(self, unit: Unit) -> None:
        if self.worker.pending(unit.index):
            self.manager.fresh.relieve(unit.index)  # Note [fresh parameters]: the worker must not wait for us
        self.worker.wait_unit(unit.index)

    def wait_all(self) -> None:
        self.manager.fresh.unblock()  # Note [fresh parameters]: the worker must not wait for a forward
        self.worker.wait_all()

    @contextlib.contextmanager
    def settled(self):
        """Inside: every submitted update is done and no optimizer state read is in flight (Note [state
        read-ahead]), so the state may be read or replaced; the read-ahead resumes on exit, unless a
        background save is still reading the swap (two reads of one extent may not overlap): then it
        resumes when the save is committed (`resume`)."""
        self.wait_all()  # the state must be the stepped one before it is read or replaced
        self.worker.quiesce()
        self._settled += 1
        try:
            yield
        finally:
            self._settled -= 1
            self.resume()

    def resume(self) -> None:
        if self._settled == 0 and not self.reading_swap():
            self.worker.resume()

    def finish(self) -> None:
        if not (self.worker.failed and self.worker.error_reported):
            self.wait_all()  # an update error nobody has seen yet is raised here

    def close(self) -> None:
        self.manager.fresh.unblock()  # a worker left after a failed update must not wait for a forward
        self.worker.close()  # (a read-ahead error nobody consumed is raised here)


class _DuringBackward(_OnWorker):
    """Units submitted to the worker as backward finalizes them; the worker reads each one's norm and flags (Note
    [host syncs]): the training thread does not wait for the device here, once per unit."""

    updates_during_backward = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._nonfinite: tuple[str, float] | None = None  # the first unit whose gradient was not finite
        self._predicted: dict[int, list[Run]] = {}  # this window's ranges by local flags (read-ahead)
        self._open = False  # a window's first unit has been finalized (step() closes it)

    def _opens_window(self) -> bool:
        """Is this grads_final the window's first (its update starts during this backward)?"""
        opens, self._open = not self._open, True
        return opens

    def _issue_flags(self, unit: Unit) -> "_Flags":
        """The reduction of `unit`'s gradient flags (every rank, every unit, in the same place)."""
        local = unit.grads.flags()
        self._predicted[unit.index] = unit.steps.active_ranges(local)  # (the state read-ahead's guess: local flags)
        return self.issue_flags([local])

    def _submit(self, unit: Unit, sumsq: torch.Tensor, reduced: "_Flags", hyper: Hypers, journal=None,
                keep: Callable[[dict], None] = lambda runs: None) -> None:
        """`unit`'s update with the gradient scale 1, stepped unless its gradient is not finite; `keep(runs)`: the
        runs it steps, once known (on the worker)."""
        flags: list[bool] = []

        def active() -> dict[int, list[Run]] | None:  # on the worker
            value = host_value(sumsq, "unit grad norm")  # a non-finite unit must not be stepped
            if not math.isfinite(value):
                self._nonfinite = self._nonfinite or (unit.name, value)
                return None  # (the window raises, or is skipped)
            flags.extend(reduced.wait()[0])
            runs = {unit.index: unit.steps.active_ranges(flags)}
            keep(runs)
            return runs

        self.worker.submit([unit], hyper=hyper, grad_scale=None, active=active, journal=journal,
                           after_unit=lambda u: after_update(flags, u)(u), position=self.position(unit),
                           lane=journal is None and unit.index in self._lane)

    def _read_ahead_next(self) -> None:
        """The next window's state read ahead, in the order of this one's ranges (the next update's)."""
        predicted, self._predicted = self._predicted, {}
        self.worker.read_ahead_next(self.optimizer.task_chunks(predicted, self.put_order()))


class EagerUpdate(_DuringBackward):
    """Each unit is submitted to the worker as soon as its gradient is final, during the last backward."""

    def grads_final(self, unit: Unit, sumsq: torch.Tensor) -> None:
        if self._opens_window():
            self._begin_puts()  # (its puts, during backward)
        self._submit(unit, sumsq, self._issue_flags(unit), self.hyper())

    def step(self, norm: float, index: int) -> bool:
        self._open = False
        if self._nonfinite is not None or not math.isfinite(norm):
            self.wait_all()  # (the worker finds which unit was not finite)
            bad, self._nonfinite = self._nonfinite, None
            raise NonFiniteGradError(
                f"gradient norm is {norm} at optimizer step {index} (unit {bad[0] if bad else '?'}): the loss or a "
                f"gradient overflowed. With overlap.optimizer_with_backward and no clipping, units whose gradients "
                f"were finite were already updated: resume from the last checkpoint. Lower optimizer.lr or check "
                f"the data")
        self._read_ahead_next()  # (as backward finalizes units: about the reverse of the forward order)
        return True

    def put_order(self) -> list[Unit]:
        return self.forward_order()[::-1]  # as backward finalizes them


class DeferredUpdate(_OnWorker):
    """`step()` computes the global norm, then submits every unit in the next forward's order; that forward
    waits per unit."""

    forward_takes_in_order = True

    def step(self, norm: float, index: int) -> bool:
        kept, self._kept = self._kept, {}  # (dropped if the window is skipped)
        update = self._global_update(norm, index)
        if update is None:
            return False
        hyper, grad_scale, flags, active = update
        order = self.put_order()
        self._begin_puts()  # (blocking: the forward takes in this order)
        with self.worker.offering():  # Note [device lane]: the lane's units the GPU may step instead, all offered
            for k, unit in enumerate(order):
                self.worker.submit([unit], hyper=hyper, grad_scale=grad_scale,
                                   active={unit.index: active[unit.index]},
                                   after_unit=after_update(flags[unit.index], unit), position=k,
                                   lane=unit.index in self._lane, grads=kept.pop(unit.index, None))
        self.worker.read_ahead_next(self.optimizer.task_chunks(active, order))  # the next update's, same order
        return True

    def put_order(self) -> list[Unit]:
        return self.forward_order()


class SpeculativeUpdate(_DuringBackward):
    """Each unit is updated as soon as its gradient is final, as if the clip will not fire, its pre-update state in
    the journal; `step()` validates with the global norm and redoes or puts back what must change (Note
    [speculative update] in optim/journal.py). Units the journal has no room for wait for the norm."""

    forward_takes_in_order = True  # (the units it updates from step(): those with parameters on NVMe among them)

    def __init__(self, *, journal: Journal, **kwargs):
        super().__init__(**kwargs)
        self.journal = journal
        self._after_norm: list[tuple[Unit, _Flags]] = []  # units left for step(), their flags' reduction issued
        self.fired = 0  # windows whose clip fired after speculating (redone)

    def grads_final(self, unit: Unit, sumsq: torch.Tensor) -> None:
        """Submit `unit`'s speculated update now (its norm and flags read on the worker: Note [host syncs]), or
        keep it for step() when the journal has no room for it."""
        if self._opens_window():  # the journal's last users (the previous window's updates) are done
            for index in self.journal.entries:
                self.worker.wait_unit(index)
            self.journal.clear()
        reduced = self._issue_flags(unit)
        entry = self.journal.reserve(unit.index, unit.steps.counts)
        if entry is None:
            self._after_norm.append((unit, reduced))
            return
        entry.hyper = self.hyper()
        self._submit(unit, sumsq, reduced, entry.hyper, self.journal.recording,
                     keep=lambda runs: setattr(entry, "runs", runs))

    def step(self, norm: float, index: int) -> bool:
        self._open = False
        deferred, self._after_norm = self._after_norm, []
        speculated = self.journal.entries  # (their runs are set on the worker, before a later batch resolves)
        if self._nonfinite is not None or not math.isfinite(norm):
            self._predicted = {}
            return self._put_back(speculated, deferred, norm, index)
        grad_scale = self.grad_scale(norm)  # (as _global_update's: the same update, bit for bit)
        waiting = {u.index: reduced for u, reduced in deferred}
        hyper = self.hyper()
        order = self.forward_order()
        self._begin_puts()  # (blocking: the forward takes in this order)
        for unit in order:  # the next forward waits per unit
            if unit.index in waiting:
                flags = waiting[unit.index].wait()[0]
                self.worker.submit([unit], hyper=hyper, grad_scale=grad_scale,
                                   active={unit.index: unit.steps.active_ranges(flags)},
                                   after_unit=after_update(flags, unit))
            elif unit.index in speculated and grad_scale is not None:  # the clip fired: again, from its copy
                entry = speculated[unit.index]
                self.worker.submit([unit], hyper=entry.hyper, grad_scale=grad_scale,
                                   active=lambda e=entry: e.runs, after_unit=Unit.updated,
                                   journal=self.journal.replaying)
        self.fired += bool(speculated) and grad_scale is not None
        self._read_ahead_next()
        return True

    def _put_back(self, speculated: dict, deferred: list, norm: float, index: int) -> bool:
        """A non-finite window: every speculated unit put back (state and step counts; a unit that was not
        stepped has no runs and nothing to put back), every gradient discarded; then skipped, or
        NonFiniteGradError."""
        for i, entry in speculated.items():
            def restore(u: Unit, counts=entry.counts) -> None:
                u.steps.counts = dict(counts)
                u.updated()
            self.worker.submit([self.units[i]], hyper=entry.hyper, grad_scale=None, active=lambda e=entry: e.runs,
                               after_unit=restore, journal=self.journal.restoring)
        for _unit, reduced in deferred:
            reduced.wait()  # (issued on every rank: completed on every rank)
        self.wait_all()
        bad, self._nonfinite = self._nonfinite, None
        for unit in self.units:
            self.manager.mark_zero(unit.index, Kind.GRADS)  # the window's gradients are discarded
            unit.grads.slots_with_grad.clear()
        if self.on_nonfinite == "error":
            raise NonFiniteGradError(
                f"gradient norm is {norm} at optimizer step {index} (unit {bad[0] if bad else '?'}): the loss or a "
                f"gradient overflowed; the step was not applied (the units updated during backward were put back). "
                f"Lower optimizer.lr, check the data, or set train.on_nonfinite = \"skip\" to skip such steps")
        return False

    def put_order(self) -> list[Unit]:
        """The forward's order: the units that put parameters to NVMe (Note [fresh parameters]) are never speculated
        (their writes would be repeated); they are updated from step() in this order, the forward taking them in
        it (blocking puts, as the deferred update)."""
        return self.forward_order()


MODE_TYPES: dict[Mode, type[UpdateMode]] = {Mode.INLINE: InlineUpdate, Mode.EAGER: EagerUpdate,
                                             Mode.SPECULATIVE: SpeculativeUpdate, Mode.DEFERRED: DeferredUpdate}


def build_update(config: Config, *, units: list[Unit], manager: TieredMemoryManager, device: torch.device, group,
                scaler: LossScaler, hyper: Callable[[], Hypers], trace: OrderTrace, read_ahead_bytes: int,
                reading_swap: Callable[[], bool], profiler) -> UpdateMode:
    """Build the configured mode with its optimizer (and, on the worker, its worker and state read-ahead)."""
    cls = MODE_TYPES[update_mode(config)]  # the choice: config/update_mode.py
    shared = {"units": units, "manager": manager, "scaler": scaler, "hyper": hyper, "trace": trace, "group": group,
              "device": device, "grad_clip": config.optimizer.grad_clip, "on_nonfinite": config.train.on_nonfinite,
              "profiler": profiler}
    if cls is InlineUpdate:
        assert read_ahead_bytes == 0, f"a state read-ahead of {read_ahead_bytes} bytes needs the worker"
        optimizer = OffloadedOptimizer(units, manager, device, profiler=profiler, blocks_compute=True,
                                       seed=config.train.seed)
        return InlineUpdate(optimizer=optimizer, **shared)
    # Note [state read-ahead] (optim/read_ahead.py): the worker reads the next update's NVMe state meanwhile
    read_ahead = StateReadAhead(manager, read_ahead_bytes) if read_ahead_bytes > 0 else None
    if read_ahead is not None:
        read_ahead.reserve_buffers()  # its staging, allocated now rather than during the first steps
    optimizer = OffloadedOptimizer(units, manager, device, profiler=profiler, blocks_compute=False,
                                   state_read_ahead=read_ahead, seed=config.train.seed)
    cuda = device.type == "cuda"
    cores = worker_cores(config.overlap.optimizer_cores)  # Note [core binding]
    lane = (OffloadedOptimizer(units, manager, device, read_ahead=1, profiler=profiler, blocks_compute=False,
                               seed=config.train.seed, on_device=True)
            if cls in (DeferredUpdate, EagerUpdate) and manager.plan.device_lane else None)  # Note [device lane]
    worker = OptimizerWorker(optimizer, len(units), read_ahead, streams=manager.streams,
                             threads=worker_threads(config.overlap.optimizer_threads, cuda, cores), cores=cores,
                             pipeline_batches=optimizer.reads_disk, lane=lane)  # Note [forward first, again]
    if cls is SpeculativeUpdate:
        shared["journal"] = journal_for(manager.plan, manager.plan.speculation,
                                        speculated_units(manager.plan, cuda))
    return cls(optimizer=optimizer, worker=worker, reading_swap=reading_swap, **shared)
