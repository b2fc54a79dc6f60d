"""Engine: the training loop's surface (forward, backward, step) over sharded, tiered state.

`initialize` builds an Engine: it resolves the process group and device, splits the model into units, plans where every
state kind lives, checks the budgets, and materializes the model one unit at a time into its tiers. The engine then
drives the units through hooks (unshard before use, reshard after, reduce-scatter gradients as soon as they are final)
and hands each accumulation window's update to its update mode, one type per way of overlapping it (Note [overlap] in
update_modes.py): the engine never asks which one runs.
"""

from __future__ import annotations

import math
import os
import secrets
import sys
from typing import Callable

import psutil
import torch
import torch.nn as nn

from infinity.config.sections import Config
from infinity.device.collectives import all_reduce_sum
from infinity.device.dtypes import DTYPES, dtype_of
from infinity.device.process_group import broadcast_object
from infinity.device.streams import Streams, host_value, listen_host_syncs
from infinity.machine.environment import resolve
from infinity.machine.heap import heap_policy
from infinity.machine.link_rates import link_peaks
from infinity.memory.buffers import UnshardedMemory
from infinity.memory.fresh import fresh_budget
from infinity.memory.manager import TieredMemoryManager
from infinity.memory.stages import stage_for
from infinity.memory.traffic import bytes_per_step, plan_report
from infinity.optim.groups import resolve_groups
from infinity.profile import Link, NullProfiler, Profiler
from infinity.profile.clock import TrainingClock
from infinity.runtime.accumulation import AccumulationWindow
from infinity.runtime.activations import activations_for
from infinity.runtime.chunked_loss import kept_whole, loss_forward
from infinity.runtime.colocate import FORWARD, Colocation, mid_step, named_full_parameters
from infinity.runtime.grad_reduce import GradReducer
from infinity.runtime.hooks import GraphHooks, UnitCallbacks, install_unit_hooks, tensors_needing_grad, to_device
from infinity.runtime.inference import InferenceForwards, unclaimed
from infinity.runtime.loss_scale import LossScaler
from infinity.runtime.materialize import buffers_to, materialize_units
from infinity.runtime.optimizer_surface import EngineOptimizer, LearningRates
from infinity.runtime.planning import open_swap, plan_units
from infinity.runtime.prefetch import OrderTrace, Prefetcher
from infinity.runtime.recompute import Recomputation
from infinity.runtime.update_modes import NonFiniteGradError, build_update
from infinity.state.checkpoint import apply_retention, begin_save
from infinity.state.checkpoint_load import load as load_checkpoint
from infinity.state.references import PretrainedRefs
from infinity.state.state_dict import full_state_dict
from infinity.state.weights import plan_weights
from infinity.units.builder import build_units, split_regions, units_in
from infinity.units.context import UnitContext
from infinity.units.tiling import tile_layers
from infinity.units.unit import Unit

__all__ = ["Engine", "NonFiniteGradError", "initialize"]


class Engine:
    """One rank's view of a sharded model. Create with `infinity.initialize`."""

    def __init__(self, model: nn.Module, config: Config, *, init_fn: Callable[[nn.Module], None] | None = None,
                 lr_schedule: Callable[[int], float] | None = None, group=None, weights=None, strict: bool = True,
                 param_groups: list[dict] | None = None):
        self.module, self.config, self.groups = model, config, resolve_groups(model, config.optimizer, param_groups)
        self.env = resolve(group)
        self.compute_dtype = DTYPES[config.precision.compute_dtype]
        self.streams = Streams.for_device(self.env.device)
        self.profiler = (Profiler(self.env.rank, link_peaks(config, self.env.device), config.profile.keep_steps)
                         if config.profile.enabled else NullProfiler(rank=self.env.rank))
        self._stop_sync_count = listen_host_syncs(self.profiler.heard_sync)  # Note [host syncs]: counted per step
        self.unsharded = UnshardedMemory.for_device(self.env.device)  # Note [unsharded memory]
        self.heap = heap_policy(config.memory.release_heap)  # Note [heap release]
        ctx = UnitContext(group=self.env.group, rank=self.env.rank, world_size=self.env.world_size,
                         device=self.env.device, compute_dtype=self.compute_dtype, streams=self.streams,
                         profiler=self.profiler, unsharded=self.unsharded, stage=stage_for(config.zero.stage),
                         sub_group_size=config.optimizer.sub_group_size)
        self.forward_fn = loss_forward(config.activation, model)  # the model, or its chunked loss (checked first)
        # Note [tiles are units] (units/tiling.py): after the groups, which name the untiled parameters
        self.tiling = tile_layers(model, config.units.tile_bytes, self.compute_dtype.itemsize,
                                  keep=kept_whole(self.forward_fn))
        self.units = build_units(model, list(config.units.classes), ctx)
        self.regions = split_regions(model, list(config.units.classes), self.units)  # checkpointed whole
        group_of = self.tiling.by_tile(self.groups.group_of)
        for unit in self.units:
            unit.steps.set_groups(group_of)  # Note [groups ride on ranges] (optim/groups.py)
        self.lrs = LearningRates(self.groups, config.optimizer, lr_schedule)  # Note [who sets the lr]
        loaded = (plan_weights(weights, model, self.units, strict, self.tiling) if weights is not None
                  else None)  # checked first
        self.plan, self.read_ahead_bytes = plan_units(self.units, self.regions, config, self.env, loaded)
        self.io, self.swap = open_swap(self.plan, config, self.env.rank, len(self.units))
        self.manager = TieredMemoryManager(self.plan, self.env.device, self.streams, self.swap,
                                           pin_host=self.env.device.type == "cuda", profiler=self.profiler,
                                           fresh_budget=fresh_budget(self.plan, config.prefetch))
        materialize_units(self.units, self.manager, config.train.seed, init_fn, loaded)
        self.pretrained = PretrainedRefs.of_weights(loaded)  # frozen ranges a checkpoint may refer to, not copy
        buffers_to(model, self.env.device)  # the forward reads them there (they are not sharded)
        self.scaler = LossScaler.for_config(config.precision)
        self._pending_checkpoint = None  # a background save, committed at the next step() / wait_for_checkpoint()
        trace = OrderTrace()  # the forward order: the prefetcher replays it, the update mode updates in it
        self.updates = build_update(config, units=self.units, manager=self.manager, device=self.env.device,
                                    group=self.env.group, scaler=self.scaler, trace=trace,
                                    hyper=lambda: self.lrs.for_update(self.optimizer_steps),
                                    read_ahead_bytes=self.read_ahead_bytes, profiler=self.profiler,
                                    reading_swap=lambda: self._pending_checkpoint is not None)
        self.optimizer = EngineOptimizer(self.groups, config.optimizer, self.step)  # for a user's LR scheduler
        self.reducer = GradReducer(self.manager, self.env.world_size, profiler=self.profiler,
                                   before_unit=self.updates.before_grads, on_final=self.updates.grads_final,
                                   keep_final=self.updates.keep_grads)
        self.activations = activations_for(config, self.units, self.streams, self.env.device, self.regions)
        self.prefetcher = Prefetcher(self.units, self.manager, config.prefetch.units_ahead,
                                     config.prefetch.max_bytes_in_flight, ready=self.updates.ready, trace=trace,
                                     fetch_inputs=self.activations.fetch)
        self.clock = TrainingClock(self.profiler, device_time=self.env.device.type == "cuda")  # its compute spans
        self.window = AccumulationWindow(config.train.grad_accum_steps)  # Note [accumulation windows]
        self._handles, self._counters, self.graph_hooks = [], [], GraphHooks()  # (Note [graph hooks])
        self.recompute = Recomputation(units_in(self.regions), self._pre_backward, self.prefetcher, self.clock)
        callbacks = UnitCallbacks(pre_forward=self._pre_forward, post_forward=self._post_forward,
                                  pre_backward=self._pre_backward, grads_ready=self._grads_ready,
                                  in_backward=lambda: self._in_backward, backward_done=self._backward_done,
                                  pre_recompute=self.recompute.pre, post_recompute=self.recompute.post,
                                  keep_hook=self.graph_hooks.keep)
        installed = [install_unit_hooks(u, callbacks, with_module_hooks=u.index != 0) for u in self.units]
        self._handles += [h for handles, _ in installed for h in handles]
        self._counters += [counter for _, counter in installed]
        self._handles += self.activations.install() + [self.graph_hooks]  # (after unit hooks: Note [unit checkpoints])
        self.inference = InferenceForwards(model, self.units[0], self._pre_forward, self.prefetcher, self.env.device,
                                           backward_pending=lambda: self._backward_pending)
        self._handles += self.inference.handles
        self.colocation = Colocation(model=model, units=self.units, manager=self.manager, device=self.env.device,
                                     unsharded=self.unsharded, profiler=self.profiler, settled=self.updates.settled,
                                     mid_step=lambda: mid_step(self.window, self._backward_pending))
        self.micro_step = self.optimizer_steps = 0  # backward passes since initialize; updates applied (not skipped)
        self._profiled_steps = 0  # the profiled steps write_profile has written
        self.last_grad_norm: float | None = None
        self._backward_pending = self._in_backward = self._closed = False  # in backward, forward hooks recompute
        self.run_id = broadcast_object(secrets.token_hex(8), self.env.group)  # names the checkpoints this run writes
        self._saved_checkpoints: list[str] = []
        # Note [switch interval]: I/O completions, the prefetcher and the optimizer worker run Python and need the GIL,
        # which the training thread holds between torch ops. At the default 5 ms a waiting thread can wait 5 ms per 1
        # MiB block the disk moves in 0.3 ms (0.5 ms: the disk at half speed); at 0.1 ms the out-of-core step went from
        # 5.0-8.4 s to 4.5-4.7 s (0.05, 0.02 ms: no better; benchmarks/history/from-notes.md). `[io] switch_interval_us`
        # sets it while the engine is open (last in __init__: a failed initialize leaves it).
        self._saved_switch_interval = sys.getswitchinterval()
        if config.io.switch_interval_us > 0:
            sys.setswitchinterval(config.io.switch_interval_us * 1e-6)

    # ----------------------------------------------------------------- hooks
    def _pre_forward(self, unit: Unit) -> None:  # (Note [step attribution]: host code, its waits named inside)
        with self.clock.host("hooks", unit.name, during="forward", then="compute"):
            self.updates.before_forward(unit)  # its parameters may still be updating (and a failed update raises)
            self.prefetcher.before_forward(unit)  # (the root's: the first units of the recorded order)
            self.prefetcher.wait_for(unit)
            self.prefetcher.gather_ahead()  # the next unit's all-gather runs while this one computes

    def _pre_backward(self, unit: Unit) -> None:
        with self.clock.host("hooks", unit.name, during="backward", then="compute"):
            self.prefetcher.before_backward(unit)
            self.prefetcher.wait_for(unit)
            self.prefetcher.gather_ahead()  # the next unit's all-gather runs while this one computes
            self.reducer.fetch_ahead(unit, self.env.device, window_open=self.window.taken_in_window > 0)

    def _post_forward(self, unit: Unit) -> None:
        with self.clock.host("hooks", unit.name, during="forward"):
            unit.reshard()

    def _grads_ready(self, unit: Unit) -> None:
        with self.clock.host("hooks", unit.name, during="backward"):
            self.reducer.issue(unit, final=self.window.ends_now())
            if unit.index != 0 and unit.trainable_numel == unit.flat_numel:
                unit.reshard()  # every parameter has its gradient, so no backward op needs them any more

    def _backward_done(self, unit: Unit) -> None:
        if unit.index != 0:
            with self.clock.host("hooks", unit.name, during="backward"):
                unit.reshard()  # its inputs' gradients are computed: no backward op reads its parameters now

    # ----------------------------------------------------------------- training surface
    def __call__(self, *args, **kwargs):
        """Forward on the engine's device (tensor arguments are moved there): returns what the model returns."""
        self._check_open("engine(...)", FORWARD)
        self.clock.forward_begins()
        with self.clock.host("engine", start=self.clock.call_begins()):
            args, kwargs = to_device((args, kwargs), self.env.device, self.compute_dtype)  # Note [input dtype]
        root = self.units[0]
        self.graph_hooks.forward_begins(backward_pending=self._backward_pending)
        self._pre_forward(root)  # (waits for the root's update first, with overlap)
        try:
            with self.activations.forward(), self.inference.engine_call():  # (Note [activation bytes])
                output = self.forward_fn(*args, **kwargs)
        except BaseException:
            self._forward_failed(root)
            raise
        needs_grad = bool(tensors_needing_grad(output))  # (then: the caller's loss, as compute, until backward)
        with self.clock.host("engine", during="forward", then="compute" if needs_grad else "caller"):
            self.prefetcher.end_forward(backward_follows=needs_grad)
            if needs_grad:
                self._backward_pending = True  # the root stays unsharded until backward has used it
            else:
                self.prefetcher.release_unused()
                root.reshard()
        return output

    def _forward_failed(self, root: Unit) -> None:
        """Note [failed forward]: a forward that raises (a bad batch; a user's bug caught in a notebook) leaves
        the engine as before the call: its order is not recorded, its prefetches and every unit it fetched are
        released (the root too, unless an earlier forward's backward still needs it), and its graph dies with
        the exception, so training goes on as if the call had not happened."""
        self.clock.compute_end("forward")
        self.prefetcher.abandon_forward()
        for unit in self.units:
            if unit is not root or not self._backward_pending:
                unit.reshard()

    def generate(self, *args, **kwargs):
        """A Hugging Face model's own `generate`, at every placement (Note [inference forwards])."""
        self._check_open("engine.generate", FORWARD)
        return self.inference.generate(*args, **kwargs)

    def backward(self, loss: torch.Tensor, end_window: bool = False, num_items_in_batch=None) -> None:
        """Backward of `loss` (scaled by 1/grad_accum_steps and the fp16 loss scale); `end_window=True` ends the
        window here (Note [accumulation windows]). `num_items_in_batch`: `loss` is this micro-batch's summed loss
        over the window's items on all ranks, as transformers returns it (Note [token-weighted windows])."""
        self._check_open("engine.backward")
        if not self._backward_pending:
            raise RuntimeError("engine.backward(loss) needs a forward with gradients first: call engine(batch) "
                               "outside torch.no_grad() (and with the model's parameters trainable)")
        self.window.begin(end_window, weighted=num_items_in_batch is not None)
        if self.updates.updates_during_backward and self.window.ends_now():
            self.wait_for_checkpoint()  # updates start during this backward (Note [overlap])
        scale = self.scaler.scale * self.window.share(self.world_size)
        self.clock.compute_begin(at=self.clock.compute_end("forward: the caller's loss"))
        self._in_backward = True
        try:
            (loss * scale).backward()
        finally:
            self._in_backward = False
            self.graph_hooks.remove()
            self.reducer.backward_ended()  # (Note [gradient sums ahead]: those not taken go back)
        with self.clock.host("engine", during="backward", then="caller"):
            final = self.window.ends_now()
            for unit, counter in zip(self.units, self._counters):
                if not counter.fired and unit.trainable_numel > 0:
                    self.reducer.issue(unit, final=final)  # parameters that got no gradient contribute zeros
                counter.reset()
            self.reducer.drain()
            self.prefetcher.release_unused()
            for unit in self.units:
                unit.reshard()
            self.recompute.backward_ended()
            self._backward_pending = False
            self.micro_step += 1
            self.window.taken()

    def step(self) -> bool:
        """Apply the optimizer at an accumulation boundary; returns whether parameters changed.

        With `[overlap] optimizer_with_backward` the update runs on a worker thread (Note
        [overlap]) and this returns once it is issued; the next forward waits per unit.
        """
        self._check_open("engine.step")
        with self.clock.host("engine", start=self.clock.call_begins(), then="caller"):
            return self._step()

    def _step(self) -> bool:
        if not self.window.closed:
            return False
        self.wait_for_checkpoint()  # (before the next line: after a failed save, step() again applies the update)
        self.window.stepped()
        with self.profiler.host("heap"):
            self.heap.release()  # the step's activations are freed; the update is not issued yet
        self.reducer.flush_writes()
        sumsq = self.reducer.take_sumsq(self.env.device)
        all_reduce_sum(sumsq, self.env.group)
        norm = math.sqrt(host_value(sumsq, "grad norm")) / self.scaler.scale  # clipping and skipping need it
        self.last_grad_norm = norm
        applied = self.updates.step(norm, self.optimizer_steps)
        if applied:
            self.optimizer_steps += 1
            self.optimizer.stepped()  # (a torch LR scheduler on it checks this)
        self.clock.stepped(self.window.steps)  # from 1, skipped steps too, as metrics.jsonl and the progress line
        return applied

    @property
    def lr(self) -> list[float]:
        """The learning rate of each parameter group for the next update (Note [who sets the lr])."""
        return self.lrs.current(self.optimizer_steps)

    def set_lr(self, value: float | list[float]) -> None:
        """Set the learning rate of every group (a number) or of each (a list); from then on the built-in
        schedule stops and the rates change only when set again (Note [who sets the lr])."""
        self.lrs.set(value)

    @property
    def param_groups(self) -> list[dict]:
        """The parameter groups: `params` (names) and `lr`, `weight_decay`, `betas`, `eps` (live dicts)."""
        return self.groups.groups

    @property
    def kept_params(self) -> frozenset[tuple[int, int]]:
        """The (unit, chunk)s whose first fetch after an update reads the update's copy (Note [fresh parameters])."""
        return self.updates.kept_params()

    def write_profile(self) -> None:
        """The profile so far to `[profile] trace_dir`/rank<N> (close() too, when steps were taken since)."""
        self.clock.close()
        steps = self.profiler.completed_steps  # (not len(steps()): a window of the latest, Note [profile window])
        if steps > self._profiled_steps:
            self._profiled_steps = steps
            self.profiler.predicted_bytes = bytes_per_step(  # the byte model's steady step, beside the bytes
                self.plan, grad_accum_steps=self.window.length, first_step=False, cuda=self.streams.is_cuda,
                kept=self.kept_params)
            self.profile_files = self.profiler.write(os.path.join(self.config.profile.trace_dir, f"rank{self.rank}"),
                                                     print_table=False)  # the caller prints format_summary if it wants

    def synchronize(self) -> None:
        """Wait for all work in flight (optimizer updates, a background checkpoint); raise its errors."""
        self._check_open()
        with self.profiler.wait(Link.CPU_OPTIMIZER, "synchronize: the update in flight"), self.updates.settled():
            self.wait_for_checkpoint()

    # ----------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str, user_state: dict | None = None) -> None:
        """Save every rank's shards to the directory `path` (all ranks call it, right after a step).

        `user_state` (JSON-serializable, e.g. the data position) comes back from
        `load_checkpoint`. With `[checkpoint] background = true` the files are written
        while training goes on and the checkpoint appears at the next `step()` / `close()`.
        """
        self._check_open("engine.save_checkpoint")
        with self.updates.settled():
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
            self.updates.resume()  # the save no longer reads the swap (settled())
        if self.rank == 0:
            self._saved_checkpoints.append(path)
            self._saved_checkpoints = apply_retention(self._saved_checkpoints, self.config.checkpoint.keep_last,
                                                      self.run_id)
        return path

    def load_checkpoint(self, path: str) -> dict:
        """Restore the state saved at `path` (at this or another world size); returns its user state."""
        self._check_open("engine.load_checkpoint")
        with self.updates.settled():
            self.wait_for_checkpoint()
            self.manager.drain()
            return load_checkpoint(self, path)

    def export_state_dict(self, path: str, dtype: torch.dtype | str | None = "auto", max_shard_size: int | str = "5GB",
                          merge_lora: bool = False) -> str:
        """Write the consolidated state dict, streaming: one file for `.safetensors` (torch.save for another
        suffix), a Hugging Face directory for a path with no suffix (sharded at `max_shard_size`, config.json
        from the model's own config; a PEFT model's adapters alone, or merged with `merge_lora`). `dtype`:
        "auto" the model config's dtype (else fp32), "fp32" / "bf16" / "fp16" or a torch dtype (Note
        [stand-alone export]). All ranks call this; a temporary checkpoint beside `path` is removed after."""
        self._check_open("engine.export_state_dict")
        from infinity.state.export import export_engine
        return export_engine(self, path, dtype=dtype, max_shard_size=max_shard_size, merge_lora=merge_lora)

    # ----------------------------------------------------------------- beside an inference engine
    def offload_states(self, kinds=None, tier: str = "host", non_blocking: bool = False) -> int:
        """Move every byte this engine holds on the device to `tier` ("host", or "nvme" with a swap space) between
        steps, for an inference engine sharing the device; returns the bytes moved. `kinds`: a subset of
        "params", "grads", "optimizer" (or "master", "exp_avg", "exp_avg_sq"), "buffers" (the model's buffers,
        the pools); None: all. Idempotent; refused in the middle of a step. `non_blocking`: return once the
        copies to the host are issued (Note [offloaded states] in runtime/colocate.py and memory/parked.py)."""
        self._check_open()
        self.wait_for_checkpoint()  # a background save reads the state
        return self.colocation.offload(kinds, tier, non_blocking)

    def reload_states(self) -> int:
        """Bring back everything `offload_states` moved (bit for bit); returns the bytes moved. Idempotent."""
        self._check_open()
        return self.colocation.reload()

    def named_full_parameters(self, dtype: torch.dtype | str | None = None, merge_lora: bool = False):
        """Iterate (name, full tensor on the CPU) over the model's parameters, unit by unit, in the model's own
        names (`merge_lora`: a PEFT model's base weights merged, under the base model's names); `dtype`: the
        compute dtype by default ("fp32" / "bf16" / "fp16" or a torch dtype). All ranks iterate it together
        (each unit is gathered). At most one unit's full values exist at a time beside the engine's own."""
        self._check_open("engine.named_full_parameters", ("params", "optimizer"))
        self.wait_for_checkpoint()  # a background save may be reading the same master extents
        dtype = dtype_of(dtype) if isinstance(dtype, str) else (dtype or self.compute_dtype)
        return named_full_parameters(self.module, self.units, self.manager, self.tiling, dtype, merge_lora,
                                     settled=self.updates.settled)

    # ----------------------------------------------------------------- reporting and state
    def memory_report(self) -> dict:
        """Bytes per tier and per state kind on this rank, and the buffers and peaks around them."""
        report = self.manager.memory_report()
        report.update(plan_report(self.plan, self.colocation.offloaded))  # the byte model's, as offloaded now
        report.update(self.colocation.report())
        report["unsharded_peak_bytes"] = max((u.peak_unsharded for u in self.units), default=0)
        report["unsharded_pool_bytes"] = self.unsharded.pooled_bytes
        report.update(self.activations.report())  # the last forward's (Note [activation bytes])
        report["process_rss_bytes"] = psutil.Process(os.getpid()).memory_info().rss
        if self.env.device.type == "cuda":
            report["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(self.env.device)
        return report

    def full_state_dict(self) -> dict:
        """fp32 master weights gathered on rank 0 (empty dict elsewhere), keys as model.state_dict()."""
        self._check_open("engine.full_state_dict")
        with self.updates.settled():
            self.wait_for_checkpoint()  # a background save may be reading the same master extents
            return full_state_dict(self.module, self.units, self.manager, self.env.rank, self.tiling)

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

    def _check_open(self, what: str | None = None, needs=("params", "grads", "optimizer", "buffers")) -> None:
        if self._closed:
            raise RuntimeError("this Engine is closed; create a new one with infinity.initialize")
        if what is not None:
            self.colocation.require(what, needs)  # Note [offloaded states] (runtime/colocate.py)

    def close(self) -> None:
        """Finish a pending checkpoint, wait for in-flight I/O, remove hooks and this run's swap files."""
        if self._closed:
            return
        try:
            self.updates.finish()  # an update error nobody has seen yet is raised here
            self.wait_for_checkpoint()
            self.write_profile()
        finally:
            self._closed = True
            try:
                self.updates.close()  # (a read-ahead error nobody consumed is raised here)
            finally:
                self._stop_sync_count()
                for h in self._handles:
                    h.remove()
                self.manager.close()
                for opened in (self.swap, self.io):  # (the swap files first: their I/O engine after them)
                    if opened is not None:
                        opened.close()
                sys.setswitchinterval(self._saved_switch_interval)
                if self.env.owns_group:
                    torch.distributed.destroy_process_group()  # (imported by collectives.py)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def initialize(model: nn.Module, config: Config | dict | str | None = None, *,
               init_fn: Callable[[nn.Module], None] | None = None,
               lr_schedule: Callable[[int], float | list[float]] | None = None, group=None, weights=None,
               strict: bool = True, param_groups: list[dict] | None = None) -> Engine:
    """Shard `model`, plan its state over the tiers, and materialize it unit by unit (docs/loop.md: a loop).

    `config` is a Config, a dict, a path to a TOML file, or None for defaults. `weights`: a
    `.safetensors` file, an HF directory or a torch state dict to load, unit by unit (weights.py;
    `strict=False` warns about keys that do not fit instead of raising). `param_groups`: as torch.optim
    takes them, dicts of `params` (the model's parameters or their names) and any of `lr`, `weight_decay`,
    `betas`, `eps` (the rest from `[optimizer]`); every trainable parameter in exactly one group; replaces
    `[optimizer] no_decay`. `lr_schedule(step)`: the learning rate of optimizer step `step` (0-based) for a
    group at `optimizer.lr` (others scaled by their lr), or a list per group, instead of `[optimizer]
    schedule`, until `engine.set_lr` or a torch scheduler on `engine.optimizer` takes over (Note [who sets
    the lr] in optimizer_surface.py).
    """
    return Engine(unclaimed(model), Config.of(config), init_fn=init_fn, lr_schedule=lr_schedule, group=group,
                  weights=weights, strict=strict, param_groups=param_groups)
