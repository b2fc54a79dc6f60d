"""Engine: the training loop's surface (forward, backward, step) over sharded, tiered state.

`initialize` builds an Engine: it resolves the process group and device,
splits the model into units, plans where every state kind lives, checks the
budgets, and materializes the model one unit at a time into its tiers. The
engine then drives the units through hooks (unshard before use, reshard after,
reduce-scatter gradients as soon as they are final) and runs the optimizer over
the shards at each accumulation boundary.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import sys
import time
from typing import Callable

import psutil
import torch
import torch.nn as nn

from io_engine import IOEngine, SwapSpace

from .checkpoint import apply_retention, begin_save
from .checkpoint import load as load_checkpoint
from .collectives import all_reduce_max, all_reduce_sum, broadcast_object
from .config import Config
from .dtypes import DTYPES
from .environment import resolve, resolve_budgets
from .grad_reduce import GradReducer
from .hooks import UnitCallbacks, install_unit_hooks, tensors_needing_grad
from .loss_scale import LossScaler
from .materialize import materialize_flat, unit_seed
from .memory.buffers import UnshardedMemory
from .memory.manager import TieredMemoryManager
from .memory.fresh import fresh_budget, kept_chunks
from .memory.placement import plan_for_config
from .memory.tier import Kind, Tier
from .optim.cpu_adam import AdamHyper
from .optim.offloaded import OffloadedOptimizer
from .optim.read_ahead import StateReadAhead, resolve_read_ahead
from .optim.worker import OptimizerWorker
from .optim.schedule import lr_at
from .prefetch import Prefetcher
from .profile import Link, NullProfiler, Profiler
from .state_dict import full_state_dict
from .streams import Streams
from .unit import Comm, Unit, build_units, unit_sizes

NO_SPAN = contextlib.nullcontext()


class NonFiniteGradError(FloatingPointError):
    """Gradients were NaN or Inf and `[train] on_nonfinite = "error"`."""


class Engine:
    """One rank's view of a sharded model. Create with `infinity.initialize`."""

    def __init__(self, model: nn.Module, config: Config, *, init_fn: Callable[[nn.Module], None] | None = None,
                 lr_schedule: Callable[[int], float] | None = None, group=None):
        self.module, self.config = model, config
        self.lr_schedule = lr_schedule
        self.env = resolve(group)
        self.compute_dtype = DTYPES[config.precision.compute_dtype]
        self.streams = Streams.for_device(self.env.device)
        self.profiler = (Profiler(rank=self.env.rank, peaks_GBps=self._link_peaks()) if config.profile.enabled
                         else NullProfiler(rank=self.env.rank))
        self.unsharded = UnshardedMemory.for_device(self.env.device)  # Note [unsharded memory]
        comm = Comm(group=self.env.group, rank=self.env.rank, world_size=self.env.world_size,
                    device=self.env.device, compute_dtype=self.compute_dtype, streams=self.streams,
                    profiler=self.profiler, unsharded=self.unsharded)
        self.units = build_units(model, list(config.units.classes), comm)
        self.plan = self._plan()
        self.io, self.swap = self._open_swap()
        self.manager = TieredMemoryManager(self.plan, self.env.device, self.streams, self.swap,
                                           pin_host=self.env.device.type == "cuda", profiler=self.profiler,
                                           fresh_budget=fresh_budget(self.plan, config.prefetch))
        for unit in self.units:
            unit.fetch_link = Link.NVME_READ if self.plan.tier(unit.index, Kind.PARAMS) is Tier.NVME else Link.H2D
        self._materialize(init_fn)
        self.reducer = GradReducer(self.manager, self.env.world_size, profiler=self.profiler)
        self.optimizer = OffloadedOptimizer(self.units, self.manager, self.env.device, profiler=self.profiler)
        # Note [overlap]: with no global dependency (no clipping, no fp16 scaling, non-finite gradients
        # are errors) a unit's update needs only its own gradients, so it runs on the worker as soon as
        # they are final, during backward ("eager"). Otherwise step() computes the global norm first and
        # hands the units to the worker in forward order; the next forward waits per unit ("deferred").
        # Both are exactly the non-overlapped update.
        # Note [state read-ahead] (optim/read_ahead.py): the worker reads the next update's NVMe state meanwhile.
        read_ahead = StateReadAhead(self.manager, self.read_ahead_bytes) if self.read_ahead_bytes > 0 else None
        if read_ahead is not None:
            read_ahead.reserve_buffers()  # its staging, allocated now rather than during the first steps
        self.optimizer.state_read_ahead = read_ahead
        self.worker = (OptimizerWorker(self.optimizer, len(self.units), read_ahead)
                       if config.overlap.optimizer_with_backward else None)
        self._eager = (self.worker is not None and config.optimizer.grad_clip == 0 and self.compute_dtype != torch.float16
                       and config.train.on_nonfinite == "error")
        self._eager_nonfinite: tuple[str, float] | None = None
        self._eager_active: dict[int, list[tuple[int, int, int]]] = {}  # this step's eager updates (read-ahead)
        self.optimizer.blocks_compute = self.worker is None
        self._compute_since: float | None = None  # the training thread computes since then (profiling)
        self._step_started: float | None = None
        self._pending_step_mark: tuple | None = None  # (step, start) of the step whose end is the next one's start
        self._stepped_at = 0  # micro_step of the last step() that ran, so a second call is a no-op
        if self._eager:
            self.reducer.on_final = self._unit_grads_final
        if self.worker is not None:
            self.reducer.before_unit = self._before_grads
        self.prefetcher = Prefetcher(self.units, self.manager, config.prefetch.units_ahead,
                                     config.prefetch.max_bytes_in_flight,
                                     ready=(lambda i: not self.worker.pending(i)) if self.worker else None)
        self.scaler = LossScaler.for_config(config.precision)
        self._handles, self._counters = [], []
        callbacks = UnitCallbacks(pre_forward=self._pre_forward, post_forward=self._post_forward,
                                  pre_backward=self._pre_backward, grads_ready=self._grads_ready)
        for unit in self.units:
            handles, counter = install_unit_hooks(unit, callbacks, with_module_hooks=unit.index != 0)
            self._handles += handles
            self._counters.append(counter)
        self.micro_step = 0  # backward passes since initialize
        self.optimizer_steps = 0  # updates applied (skipped steps not counted)
        self.last_grad_norm: float | None = None
        self._backward_pending = False
        self._closed = False
        self.run_id = broadcast_object(secrets.token_hex(8), self.env.group)  # names the checkpoints this run writes
        self._pending_checkpoint = None
        self._settled = 0  # depth of _updates_settled: the read-ahead stays paused inside
        self._saved_checkpoints: list[str] = []
        # Note [switch interval]: every I/O block completion, the prefetcher and the optimizer worker run
        # Python, so they need the GIL, and the training thread holds it between torch ops. At Python's
        # default switch interval (5 ms) a waiting thread can wait 5 ms per 1 MiB block that the disk
        # moves in 0.3 ms: writes under a Python-heavy forward measured 0.5 GB/s, 1.9 GB/s at 0.5 ms
        # (benchmarks/RESULTS.md). Inside a real step 0.5 ms was still too long: the queue stayed full
        # (16 blocks "in flight") while the disk ran at half speed, the blocks' threads waiting for the
        # GIL to finish and resubmit; at 0.1 ms the out-of-core step went from 5.0-8.4 s to 4.5-4.7 s
        # (0.05 and 0.02 ms: no better). `[io] switch_interval_us` sets it while the engine is open
        # (last in __init__, so a failed initialize leaves it alone).
        self._saved_switch_interval = sys.getswitchinterval()
        if config.io.switch_interval_us > 0:
            sys.setswitchinterval(config.io.switch_interval_us * 1e-6)

    # ----------------------------------------------------------------- construction
    def _link_peaks(self) -> dict[str, float]:
        """The profile's per-link peaks: the link rates measured on this machine and swap disk (cached by
        `infinity bench-links --dir DIR` or the auto policy); none measured = no achieved-vs-peak."""
        from .link_rates import cached_rates_for
        from .memory import cost_model
        paths = self.config.nvme.paths
        if paths and not os.path.isdir(paths[0]):
            return {}  # the plan's preflight names the missing directory
        return cost_model.profile_peaks(cached_rates_for(paths[0] if paths else None, self.env.device))

    def _plan(self):
        """The placement, planned exactly as `infinity estimate` plans it, then the same preflight checks."""
        from .link_rates import rates_for_plan
        from .preflight import check_nvme_paths, preflight, require
        cfg = self.config
        sizes = unit_sizes(self.units, cfg.optimizer.sub_group_size)
        nvme_free = check_nvme_paths(list(cfg.nvme.paths)) if cfg.nvme.paths else 0
        budgets = resolve_budgets(cfg.memory, self.env.device, self.env.local_world_size, nvme_free)
        auto = cfg.placement.policy == "auto"  # the swap disk's rates measured once per machine, then cached
        rates = rates_for_plan(cfg, self.env.device, measure=True) if auto else None
        plan = plan_for_config(sizes, cfg, budgets, rates=rates)
        self.read_ahead_bytes = resolve_read_ahead(cfg, plan, budgets)
        require(preflight(plan, None, cfg, local_world_size=self.env.local_world_size,
                          cuda=self.env.device.type == "cuda", read_ahead=self.read_ahead_bytes))
        return plan

    def _open_swap(self):
        if not self.plan.uses(Tier.NVME):
            return None, None
        io_cfg = self.config.io
        io = IOEngine(io_cfg.engine_config())
        swap = SwapSpace(dirs=list(self.config.nvme.paths), io=io, rank=self.env.rank, name="infinity",
                         checksum=io_cfg.checksum)
        nvme_bytes = sum(self.plan.state_bytes()[Tier.NVME].values())
        swap.reserve(nvme_bytes + len(self.units) * 5 * 4096 * 2)  # plus each extent's alignment
        return io, swap

    def _materialize(self, init_fn) -> None:
        """Unit by unit: full fp32 values -> this rank's shard -> tiers; the full copy is dropped."""
        seed = self.config.train.seed
        for unit in self.units:
            for kind in Kind:
                self.manager.allocate(unit.index, kind)
            flat = materialize_flat(unit.name, unit.slots, unit.padded_numel, unit_seed(seed, unit.index), init_fn)
            start, end = unit.shard_range()
            master = flat[start:end].clone()
            del flat
            pending = self.manager.store_master(unit.index, None, master, release=False)
            for p in pending:
                p.wait()  # the shard's values must be stored before its full copy goes away
            stored = self.manager.resident(unit.index, Kind.PARAMS)
            if self.env.world_size == 1 and stored is not None and stored.device == self.env.device:
                unit.alias(stored)
            else:
                unit.install_views()
        self.manager.drain()

    # ----------------------------------------------------------------- hooks
    def _pre_forward(self, unit: Unit) -> None:
        self._compute_end(f"forward before {unit.name}")
        if self.worker is not None:
            pending = self.worker.pending(unit.index)
            with self.profiler.wait(Link.CPU_OPTIMIZER, f"update {unit.name}") if pending else NO_SPAN:
                self._wait_update(unit)  # its parameters may still be updating (and a failed update raises)
        if unit.index != 0:
            self.prefetcher.before_forward(unit)
        unit.unshard(self.manager)
        unit.wait_for_unshard(self.manager)
        self._compute_begin()

    def _pre_backward(self, unit: Unit) -> None:
        self._compute_end(f"backward before {unit.name}")
        self.prefetcher.before_backward(unit)
        unit.unshard(self.manager)
        unit.wait_for_unshard(self.manager)
        self._compute_begin()

    def _compute_begin(self) -> None:
        if self.profiler.enabled:
            self._compute_since = time.perf_counter()

    def _compute_end(self, name: str) -> None:
        """Close the training thread's current compute span (it is about to wait, or is done)."""
        if self._compute_since is not None:
            self.profiler.record(name, Link.COMPUTE, self._compute_since, time.perf_counter())
            self._compute_since = None

    def _before_grads(self, unit: Unit) -> None:
        """A unit's gradient shard is about to be written: its previous update must have finished
        (units the forward used were waited for there; this catches the ones it skipped)."""
        if self.worker.pending(unit.index):
            with self.profiler.wait(Link.CPU_OPTIMIZER, f"update {unit.name}"):
                self._wait_update(unit)

    def _wait_update(self, unit: Unit) -> None:
        if self.worker.pending(unit.index):
            self.manager.fresh.relieve(unit.index)  # Note [fresh parameters]: the worker must not wait for us
        self.worker.wait_unit(unit.index)

    def _wait_all_updates(self) -> None:
        self.manager.fresh.unblock()  # Note [fresh parameters]: the worker must not wait for a forward
        self.worker.wait_all()

    def _unit_grads_final(self, unit: Unit) -> None:
        """Eager overlap: this unit's gradient for the window is complete; update it now."""
        flags = self._reduce_flags([unit.grad_flags()])[0]
        sumsq = float(self.reducer.unit_sumsq(unit.index))  # host sync: a non-finite unit must not be stepped
        if not math.isfinite(sumsq):
            self._eager_nonfinite = self._eager_nonfinite or (unit.name, sumsq)
            return
        active = {unit.index: unit.active_ranges(flags)}
        self._eager_active.update(active)
        self.worker.submit([unit], hyper=self._hyper(), grad_scale=None, active=active,
                           after_unit=self._after_update(flags, unit))

    def _after_update(self, flags: list[bool], unit: Unit):
        def after(u: Unit) -> None:
            u.commit_steps(flags)
            u.slots_with_grad.clear()
        return after

    def _hyper(self) -> AdamHyper:
        o = self.config.optimizer
        lr = self.lr_schedule(self.optimizer_steps) if self.lr_schedule else lr_at(self.optimizer_steps, o)
        return AdamHyper(lr=lr, beta1=o.betas[0], beta2=o.betas[1], eps=o.eps, weight_decay=o.weight_decay,
                         decoupled=o.name == "adamw")

    def _post_forward(self, unit: Unit) -> None:
        unit.reshard()

    def _grads_ready(self, unit: Unit) -> None:
        self.reducer.issue(unit, final=self._final_micro_batch())
        if unit.index != 0 and unit.trainable_numel == unit.flat_numel:
            unit.reshard()  # every parameter has its gradient, so no backward op needs them any more

    def _final_micro_batch(self) -> bool:
        return (self.micro_step + 1) % self.config.train.grad_accum_steps == 0

    # ----------------------------------------------------------------- training surface
    def __call__(self, *args, **kwargs):
        """Forward: returns what the model returns."""
        self._check_open()
        if self._step_started is None and self.profiler.enabled:
            self._step_started = time.perf_counter()  # a profiled step runs from its first forward to the next one's
            if self._pending_step_mark is not None:
                self.profiler.record_step(*self._pending_step_mark, self._step_started)  # the previous one ends here
                self._pending_step_mark = None
        root = self.units[0]
        self._pre_forward(root)  # (waits for the root's update first, with overlap)
        output = self.module(*args, **kwargs)
        self._compute_end("forward")
        self.prefetcher.end_forward()
        if tensors_needing_grad(output):
            self._backward_pending = True  # the root stays unsharded until backward has used it
        else:
            self.prefetcher.release_unused()
            root.reshard()
        return output

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` (scaled by 1/grad_accum_steps, and the fp16 loss scale)."""
        self._check_open()
        if not self._backward_pending:
            raise RuntimeError("engine.backward(loss) needs a forward with gradients first: call engine(batch) "
                               "outside torch.no_grad() (and with the model's parameters trainable)")
        if self._eager and self._final_micro_batch():
            self.wait_for_checkpoint()  # eager updates start during this backward
        scale = self.scaler.scale / self.config.train.grad_accum_steps
        self._compute_begin()
        (loss * scale).backward()
        self._compute_end("backward")
        final = self._final_micro_batch()
        for unit, counter in zip(self.units, self._counters):
            if not counter.fired and unit.trainable_numel > 0:
                self.reducer.issue(unit, final=final)  # parameters that got no gradient contribute zeros
            counter.reset()
        self.reducer.drain()
        self.prefetcher.release_unused()
        for unit in self.units:
            unit.reshard()
        self._backward_pending = False
        self.micro_step += 1

    def step(self) -> bool:
        """Apply the optimizer at an accumulation boundary; returns whether parameters changed.

        With `[overlap] optimizer_with_backward` the update runs on a worker thread (Note
        [overlap]) and this returns once it is issued; the next forward waits per unit.
        """
        self._check_open()
        cfg = self.config
        if self.micro_step == 0 or self.micro_step % cfg.train.grad_accum_steps != 0 or self._stepped_at == self.micro_step:
            return False
        self._stepped_at = self.micro_step
        self.wait_for_checkpoint()  # the optimizer must not change state a background save is still writing
        self.reducer.flush_writes()
        sumsq = self.reducer.take_sumsq(self.env.device)
        all_reduce_sum(sumsq, self.env.group)
        norm = math.sqrt(float(sumsq)) / self.scaler.scale  # one host sync per step: clipping and skipping need it
        self.last_grad_norm = norm
        if self._eager:
            return self._finish_eager_step(norm)
        if not math.isfinite(norm):
            self._nonfinite(norm)
            return False
        self.scaler.update(found_inf=False)
        clip_coef = 1.0
        if cfg.optimizer.grad_clip > 0:
            clip_coef = min(1.0, cfg.optimizer.grad_clip / (norm + 1e-6))
        grad_scale = self.scaler.scale / clip_coef
        grad_scale = None if grad_scale == 1.0 else grad_scale
        flags = self._reduce_flags([u.grad_flags() for u in self.units])
        active = {u.index: u.active_ranges(f) for u, f in zip(self.units, flags)}
        hyper = self._hyper()
        if self.worker is not None:
            order = self._update_order()
            self.manager.fresh.begin_update([u.index for u in order], blocking=True)  # the forward takes in order
            for unit in order:
                self.worker.submit([unit], hyper=hyper, grad_scale=grad_scale, active={unit.index: active[unit.index]},
                                   after_unit=self._after_update(flags[unit.index], unit))
            self.worker.read_ahead_next(self.optimizer.task_chunks(active, order))  # the next update's, same order
        else:
            self.optimizer.step(hyper=hyper, grad_scale=grad_scale, active=active,
                                on_unit_done=lambda u: self._after_update(flags[u.index], u)(u))
        self.optimizer_steps += 1
        self._mark_step()
        return True

    def _mark_step(self) -> None:
        """Profiling: the step just issued ends when the next one starts (its update overlaps that forward)."""
        if self.profiler.enabled and self._pending_step_mark is not None:  # a step with no forward after it
            self.profiler.record_step(*self._pending_step_mark, time.perf_counter())
        if self.profiler.enabled:
            self._pending_step_mark = (self.optimizer_steps - 1, self._step_started)
            self._step_started = None

    def _finish_eager_step(self, norm: float) -> bool:
        bad, self._eager_nonfinite = self._eager_nonfinite, None
        if bad is not None or not math.isfinite(norm):
            self._wait_all_updates()
            unit = bad[0] if bad else "?"
            raise NonFiniteGradError(
                f"gradient norm is {norm} at optimizer step {self.optimizer_steps} (unit {unit}): the loss or a gradient "
                f"overflowed. With overlap.optimizer_with_backward and no clipping, units whose gradients were finite "
                f"were already updated: resume from the last checkpoint. Lower optimizer.lr or check the data")
        self.optimizer_steps += 1
        self._mark_step()
        # the next step's updates come as backward finalizes units: about the reverse of the forward order
        active, self._eager_active = self._eager_active, {}
        self.worker.read_ahead_next(self.optimizer.task_chunks(active, self._update_order()[::-1]))
        return True

    @property
    def kept_params(self) -> frozenset[tuple[int, int]]:
        """The (unit, chunk)s of parameters whose first fetch after an update reads the copy the update kept
        in memory (Note [fresh parameters]): for `traffic.bytes_per_step`. Deferred updates keep every chunk
        that fits; a synchronous or eager update, those left after its puts in its order."""
        fresh = self.manager.fresh
        nvme = [u for u in self.units if self.plan.tier(u.index, Kind.PARAMS) is Tier.NVME]
        if self.worker is None:
            order = nvme  # optimizer.step, in unit order
        elif self._eager:
            order = [u for u in self._update_order()[::-1] if u in nvme]  # as backward finalizes them
        else:
            order = [u for u in self._update_order() if u in nvme]
        size = self.compute_dtype.itemsize
        chunks = [(u.index, c) for u in order for c in range(self.manager.num_chunks(u.index))]
        nbytes = {(u, c): self.manager.chunk_span(u, c)[1] * size for u, c in chunks}
        return kept_chunks(nbytes, chunks, fresh.budget, blocking=self.worker is not None and not self._eager)

    def _update_order(self) -> list[Unit]:
        """Deferred overlap: update the units in the order the next forward will use them."""
        order = [0] + [i for i in self.prefetcher.trace.recorded if i != 0]
        seen = set(order)
        return [self.units[i] for i in order + [u.index for u in self.units if u.index not in seen]]

    def _reduce_flags(self, per_unit: list[list[bool]]) -> list[list[bool]]:
        """Per unit and trainable parameter: did it get a gradient on any rank this window?"""
        flags = torch.tensor([f for unit_flags in per_unit for f in unit_flags], dtype=torch.int32)
        if self.env.group is not None and flags.numel():
            reduced = flags.to(self.env.device)  # NCCL reduces device tensors; gloo CPU ones
            all_reduce_max(reduced, self.env.group)
            flags = reduced.cpu()
        out, pos = [], 0
        for unit_flags in per_unit:
            out.append([bool(f) for f in flags[pos: pos + len(unit_flags)].tolist()])
            pos += len(unit_flags)
        return out

    def _close_profile(self) -> None:
        if not self.profiler.enabled:
            return
        if self._pending_step_mark is not None and self._pending_step_mark[1] is not None:
            self.profiler.record_step(*self._pending_step_mark, time.perf_counter())
            self._pending_step_mark = None
        if self.profiler.steps():
            self.profile_files = self.profiler.write(os.path.join(self.config.profile.trace_dir, f"rank{self.rank}"),
                                                     print_table=False)  # the caller prints format_summary if it wants

    def synchronize(self) -> None:
        """Wait for all work in flight (optimizer updates, a background checkpoint); raise its errors."""
        self._check_open()
        with self._updates_settled():
            self.wait_for_checkpoint()

    @contextlib.contextmanager
    def _updates_settled(self):
        """Inside: every submitted update is done and no optimizer state read is in flight (Note [state
        read-ahead]), so the state may be read or replaced; the read-ahead resumes on exit, unless a
        background save is still reading the swap (two reads of one extent may not overlap): then it
        resumes when the save is committed."""
        if self.worker is None:
            yield
            return
        self._wait_all_updates()  # the state must be the stepped one before it is read or replaced
        self.worker.quiesce()
        self._settled += 1
        try:
            yield
        finally:
            self._settled -= 1
            self._resume_read_ahead()

    def _resume_read_ahead(self) -> None:
        if self.worker is not None and self._settled == 0 and self._pending_checkpoint is None:
            self.worker.resume()

    def _end_window(self) -> None:
        for unit in self.units:
            unit.slots_with_grad.clear()

    def _nonfinite(self, norm: float) -> None:
        for unit in self.units:
            self.manager.mark_zero(unit.index, Kind.GRADS)  # the window's gradients are discarded
        self._end_window()
        if self.scaler.dynamic:
            self.scaler.update(found_inf=True)
            return
        if self.config.train.on_nonfinite == "error":
            raise NonFiniteGradError(
                f"gradient norm is {norm} at optimizer step {self.optimizer_steps}: the loss or a gradient overflowed. "
                f"Lower optimizer.lr, check the data, or set train.on_nonfinite = \"skip\" to skip such steps")

    # ----------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str, user_state: dict | None = None) -> None:
        """Save every rank's shards to the directory `path` (all ranks call it, right after a step).

        `user_state` (JSON-serializable, e.g. the data position) comes back from
        `load_checkpoint`. With `[checkpoint] background = true` the files are written
        while training goes on and the checkpoint appears at the next `step()` / `close()`.
        """
        self._check_open()
        with self._updates_settled():
            self.wait_for_checkpoint()
            self.reducer.flush_writes()
            self.manager.drain()  # the optimizer's write-behind must land before the state is copied
            self._pending_checkpoint = begin_save(self, path, user_state, self.config.checkpoint.background)
        if not self.config.checkpoint.background:
            self.wait_for_checkpoint()

    def wait_for_checkpoint(self) -> str | None:
        """Finish a save in progress and make it visible; returns its path (None if none was pending)."""
        pending, self._pending_checkpoint = self._pending_checkpoint, None
        if pending is None:
            return None
        try:
            path = pending.commit()
        finally:
            self._resume_read_ahead()  # the save no longer reads the swap (_updates_settled)
        if self.rank == 0:
            self._saved_checkpoints.append(path)
            self._saved_checkpoints = apply_retention(self._saved_checkpoints, self.config.checkpoint.keep_last,
                                                      self.run_id)
        return path

    def load_checkpoint(self, path: str) -> dict:
        """Restore the state saved at `path` (at this or another world size); returns its user state."""
        self._check_open()
        with self._updates_settled():
            self.wait_for_checkpoint()
            self.manager.drain()
            return load_checkpoint(self, path)

    def export_state_dict(self, path: str, dtype: torch.dtype | None = None) -> str:
        """Write the consolidated state dict (safetensors for `.safetensors`, else torch.save), streaming.

        Saves a checkpoint next to `path` first (all ranks call this), then rank 0 assembles
        the tensors one by one from it; the checkpoint stays, for resuming.
        """
        from .export import export_checkpoint
        ckpt = f"{os.fspath(path)}.checkpoint"
        self.save_checkpoint(ckpt)
        self.wait_for_checkpoint()
        if self.rank == 0:
            export_checkpoint(ckpt, path, dtype=dtype)
        if self.env.group is not None:
            import torch.distributed as dist
            dist.barrier(group=self.env.group)  # the file is complete when every rank returns
        return os.fspath(path)

    # ----------------------------------------------------------------- reporting and state
    def memory_report(self) -> dict:
        """Bytes per tier and per state kind on this rank, and the buffers and peaks around them."""
        report = self.manager.memory_report()
        report["plan"] = {t.value: {k.value: v for k, v in kinds.items()} for t, kinds in self.plan.state_bytes().items()}
        report["working_planned"] = {t.value: v for t, v in self.plan.working.items()}
        report["unsharded_peak_bytes"] = max((u.peak_unsharded for u in self.units), default=0)
        report["unsharded_pool_bytes"] = self.unsharded.pooled_bytes
        report["process_rss_bytes"] = psutil.Process(os.getpid()).memory_info().rss
        if self.env.device.type == "cuda":
            report["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(self.env.device)
        return report

    def full_state_dict(self) -> dict:
        """fp32 master weights gathered on rank 0 (empty dict elsewhere), keys as model.state_dict()."""
        self._check_open()
        with self._updates_settled():
            self.wait_for_checkpoint()  # a background save may be reading the same master extents
            return full_state_dict(self.module, self.units, self.manager, self.env.rank)

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def device(self) -> torch.device:
        return self.env.device

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Engine is closed; create a new one with infinity.initialize")

    def close(self) -> None:
        """Finish a pending checkpoint, wait for in-flight I/O, remove hooks and this run's swap files."""
        if self._closed:
            return
        try:
            if self.worker is not None and not (self.worker.failed and self.worker.error_reported):
                self._wait_all_updates()  # an update error nobody has seen yet is raised here
            self.wait_for_checkpoint()
            self._close_profile()
        finally:
            self._closed = True
            try:
                if self.worker is not None:
                    self.manager.fresh.unblock()  # a worker left after a failed update must not wait for a forward
                    self.worker.close()  # (a read-ahead error nobody consumed is raised here)
            finally:
                for h in self._handles:
                    h.remove()
                self.manager.close()
                if self.swap is not None:
                    self.swap.close()
                if self.io is not None:
                    self.io.close()
                sys.setswitchinterval(self._saved_switch_interval)
                if self.env.owns_group:
                    import torch.distributed as dist
                    dist.destroy_process_group()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def initialize(model: nn.Module, config: Config | dict | str | None = None, *,
               init_fn: Callable[[nn.Module], None] | None = None,
               lr_schedule: Callable[[int], float] | None = None, group=None) -> Engine:
    """Shard `model`, plan its state over the tiers, and materialize it unit by unit.

    `config` is a Config, a dict, a path to a TOML file, or None for defaults.
    """
    if config is None:
        config = Config()
    elif isinstance(config, dict):
        config = Config.from_dict(config)
    elif isinstance(config, (str, os.PathLike)):
        config = Config.from_file(config)
    return Engine(model, config, init_fn=init_fn, lr_schedule=lr_schedule, group=group)
