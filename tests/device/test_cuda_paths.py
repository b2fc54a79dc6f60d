"""The CUDA path's logic, tested on the CPU through seams (issue 21): a compute device faked by `meta`
(arithmetic without bytes: a tensor left on the CPU fails the first op that meets a device tensor),
recording stand-ins for torch.cuda's streams, events and set_device, and a count of host syncs."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import infinity
import infinity.memory.manager as manager_module
import infinity.runtime.engine as engine_module
from dist_utils import run_distributed
from engine_runs import train_steps
from infinity.device.streams import Streams, count_host_syncs
from infinity.machine.environment import resolve
from infinity.memory.manager import TieredMemoryManager
from infinity.memory.tier import Kind, Tier
from infinity.models.gpt import GPT
from infinity.optim.offloaded import OffloadedOptimizer
from infinity.optim.worker import OptimizerWorker
from infinity.profile import Link
from infinity.profile.clock import TrainingClock
from infinity.runtime.hooks import to_device
from infinity.state.checkpoint import ShardWriter
from reference import TINY, Recipe, reference_run

META = torch.device("meta")


class WithBuffers(nn.Module):
    """Units with BatchNorm statistics; a persistent buffer and a non-persistent one (a mask) at the root;
    a forward that takes nested inputs."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)) for _ in range(3)])
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.register_buffer("mask", torch.ones(8), persistent=False)

    def forward(self, x, extra):
        h = self.embed(x) * self.scale * self.mask
        for block in self.blocks:
            h = block(h)
        return (h + extra["bias"][0]).square().mean()


@pytest.fixture
def meta_device(monkeypatch):
    """The engine's compute device is `meta`, as if it were a GPU: every tensor the forward meets must be there."""
    monkeypatch.setattr(engine_module, "resolve", lambda group=None: dataclasses.replace(resolve(group), device=META))


def test_inputs_and_buffers_on_the_engine_device(meta_device):
    engine = infinity.initialize(WithBuffers(), {"placement": {"params": "device", "grads": "device",
                                                               "optimizer": "device"},
                                                 "train": {"grad_accum_steps": 2}})  # (no step: no norm on meta)
    with engine:
        buffers = dict(engine.module.named_buffers())
        assert {"scale", "mask", "blocks.0.1.running_mean", "blocks.2.1.num_batches_tracked"} <= set(buffers)
        assert {name: b.device for name, b in buffers.items()} == {name: META for name in buffers}
        loss = engine(torch.randn(5, 4), extra={"bias": [torch.randn(8)]})  # CPU inputs, nested in a dict and list
        assert loss.device == META
        engine.backward(loss)


def test_to_device_moves_every_tensor_of_nested_inputs():
    tree = ([torch.ones(2), 3, "s"], {"a": (torch.zeros(1), None), "b": {"c": torch.arange(3)}})
    moved = to_device(tree, META)
    assert [moved[0][0].device, moved[1]["a"][0].device, moved[1]["b"]["c"].device] == [META] * 3
    assert moved[0][1:] == [3, "s"] and moved[1]["a"][1] is None


class CheckpointedGPT(GPT):
    """The GPT with every block under torch.utils.checkpoint: its forward runs again during backward."""

    use_reentrant = False

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.use_reentrant)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_activation_checkpointing_keeps_the_forward_order_and_prefetch(reentrant, tmp_path):
    """The recomputation in backward fires the blocks' forward pre-hooks again: they are not a new forward
    (the recorded order stays [1, 2, 3]) and prefetch keeps engaging in every later step."""
    recipe = Recipe(steps=3)

    def build():
        torch.manual_seed(recipe.seed)
        model = CheckpointedGPT(recipe.model)
        model.use_reentrant = reentrant
        return model

    ref_losses, _, ref_state = reference_run(recipe, model=build())
    config = recipe.config(params="nvme", grads="host", optimizer="host") | {"nvme": {"paths": [str(tmp_path)]}}
    engine = infinity.initialize(build(), config)  # (parameters on the CPU's own tier would alias: no fetch)
    losses, issued, fetches = [], [], []
    fetch = engine.manager.fetch

    def counting_fetch(unit, kind, *args, **kwargs):
        fetches.append((unit, kind))
        return fetch(unit, kind, *args, **kwargs)

    engine.manager.fetch = counting_fetch
    with engine:
        for step in range(recipe.steps):
            fetches.clear()
            losses += train_steps(engine, recipe, step, step + 1, rank=0, world=1)
            assert engine.prefetcher.trace.recorded == [1, 2, 3], engine.prefetcher.trace.recorded
            issued.append(engine.prefetcher.issued)
            # once for the forward, once for backward (the recomputation and the backward share it), per micro-batch
            per_unit = [fetches.count((i, Kind.PARAMS)) for i in (1, 2, 3)]
            assert per_unit == [2 * recipe.accum] * 3, per_unit
        state = engine.full_state_dict()
    assert all(b > a for a, b in zip(issued, issued[1:])), f"prefetches issued by the end of each step: {issued}"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key])


def test_record_without_a_stream_records_on_the_engine_device(monkeypatch):
    """Streams of cuda:1 (stand-ins): an event recorded 'on the current stream' is on cuda:1's current
    stream, not on whatever torch.cuda.Event.record picks for the calling thread's device (cuda:0)."""
    recorded = []

    class Event:
        def record(self, stream=None):
            recorded.append(stream)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"current stream of {device}")
    streams = Streams(device=torch.device("cuda", 1), compute="compute", h2d="h2d", d2h="d2h", comm="comm")
    streams.record()
    streams.record(streams.comm)
    assert recorded == ["current stream of cuda:1", "comm"]


def test_threads_select_the_engine_device(monkeypatch, tmp_path):
    """The optimizer worker and the background checkpoint writer select the engine's GPU when they start
    (torch.cuda.set_device, recorded here with the thread that called it)."""
    selected = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda device: selected.append((threading.current_thread().name, torch.device(device))))
    cuda1 = torch.device("cuda", 1)
    OptimizerWorker(SimpleNamespace(compute_device=cuda1), num_units=1).close()
    assert selected == [("infinity-optimizer", cuda1)]

    selected.clear()
    engine = infinity.initialize(Recipe().build(), Recipe().config())
    with engine:
        engine.env = dataclasses.replace(engine.env, device=cuda1)  # (only the writer thread reads it after this)
        writer = ShardWriter(engine, str(tmp_path))
        writer._write = lambda: None
        writer.start(background=True)
        writer.join()
        engine.env = dataclasses.replace(engine.env, device=torch.device("cpu"))
    assert selected == [("infinity-checkpoint", cuda1)]


def _gather_order_on_rank(rank, world, recipe):
    """Train `recipe` at world size `world`, recording each all-gather's issue and wait (the collectives
    seam), the start of each block's forward compute (a forward pre-hook registered after the engine's) and
    the end of its backward (its gradients' reduction)."""
    import infinity.device.collectives as collectives
    from infinity.units.gradients import UnitGradients
    events = []
    config = recipe.config(params="host", grads="host", optimizer="host")
    config["overlap"] = {"optimizer_with_backward": False}  # (else a unit still updating is fetched late)
    engine = infinity.initialize(recipe.build(), config)

    def unit_of(out):
        return next(u.index for u in engine.units if u.flat_numel and u._storage.data_ptr() == out.data_ptr())

    issue = collectives.all_gather_into

    class Work:
        def __init__(self, work, index):
            self.work, self.index = work, index

        def wait(self):
            events.append(("wait", self.index))
            return self.work.wait()

    def recording_gather(out, shard, group, async_op=True):
        index = unit_of(out)
        events.append(("issue", index))
        return Work(issue(out, shard, group, async_op), index)

    collectives.all_gather_into = recording_gather
    reduce_grads = UnitGradients.reduce

    def recording_reduce(grads, *args):
        index = next(u.index for u in engine.units if u.grads is grads)
        events.append(("reduce", index))  # the unit's backward is done: its gradients are reduced
        return reduce_grads(grads, *args)

    UnitGradients.reduce = recording_reduce
    for i, block in enumerate(engine.module.blocks, start=1):
        block.register_forward_pre_hook(lambda _m, _a, i=i: events.append(("compute", i)) if torch.is_grad_enabled()
                                        and not engine._in_backward else None)
    per_step, losses = [], []
    with engine:
        for step in range(recipe.steps):
            events.clear()
            losses += train_steps(engine, recipe, step, step + 1, rank, world)
            per_step.append(list(events))
        collectives.all_gather_into = issue
        state = engine.full_state_dict()
    return losses, per_step, state


def test_all_gather_of_the_next_unit_is_issued_while_one_computes(tmp_path):
    """World size 2 (gloo): from the second step on, the all-gather of block i+1 is issued before block i
    computes and waited after it, and in backward that of block i-1 before block i's backward ends; the
    training matches torch."""
    recipe = Recipe(steps=3, accum=1)
    ref_losses, _, ref_state = reference_run(recipe)
    results = run_distributed(_gather_order_on_rank, 2, recipe)
    for losses, per_step, _ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        for events in per_step[1:]:
            forward = events[:events.index(("compute", 3)) + 1]
            for i in (1, 2):
                assert forward.index(("issue", i + 1)) < forward.index(("compute", i)) < \
                    forward.index(("wait", i + 1)), forward
            backward = events[len(forward):]
            for i in (3, 2):
                assert backward.index(("issue", i - 1)) < backward.index(("reduce", i)) < \
                    backward.index(("wait", i - 1)), backward
    state = results[0][2]
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key])


@pytest.mark.parametrize("overlap, clip", [(False, 0.5), (True, 0.0), (True, 0.5)],
                         ids=["inline", "eager", "deferred"])
def test_host_syncs_per_step_do_not_grow_with_the_units(overlap, clip):
    """The training thread's host syncs (Note [host syncs], counted at the seam) per steady step are the
    same with 2 blocks as with 5, in every update mode; the optimizer worker may wait per unit."""
    per_model = {}
    for n_layer in (2, 5):
        recipe = Recipe(model=dataclasses.replace(TINY, n_layer=n_layer), steps=3, grad_clip=clip,
                        extra={"overlap": {"optimizer_with_backward": overlap}})
        engine = infinity.initialize(recipe.build(), recipe.config(params="host", grads="host", optimizer="host"))
        with engine:
            train_steps(engine, recipe, 0, 1, rank=0, world=1)
            with count_host_syncs() as syncs:
                train_steps(engine, recipe, 1, 3, rank=0, world=1)
                engine.synchronize()
        per_model[n_layer] = [why for thread, why in syncs if thread == threading.current_thread().name]
    assert per_model[2] == per_model[5] == ["grad norm"] * 2, per_model


class RecordingStreams(Streams):
    """Streams of a pretend GPU: every record / wait / use / host sync is logged, in order."""

    def __init__(self):
        super().__init__(device=torch.device("cuda", 0), compute="compute", h2d="h2d", d2h="d2h", comm="comm")
        self.log, self.held = [], []
        self.complete = True

    def record(self, stream=None):
        log, on = self.log, stream or "current"
        log.append(("record", on))

        streams = self

        class Event:
            def synchronize(self):
                log.append(("host waits", on))

            def query(self):
                return streams.complete  # (the test says when the device has finished)
        return Event()

    def wait_event(self, event, stream=None) -> None:
        self.log.append(("wait", stream or "current"))

    def hold(self, tensor, stream) -> None:
        self.held.append(stream)  # (apart from the log: which streams the allocator was told use a tensor)

    def current(self):
        return "current"

    @contextlib.contextmanager
    def use(self, stream):
        self.log.append(("use", stream))
        yield
        self.log.append(("end", stream))


@contextlib.contextmanager
def recorded_manager(tmp_path, optimizer: str):
    """An engine with params on NVMe and grads on the host; its manager's streams record every call."""
    recipe = Recipe()
    config = recipe.config(params="nvme", grads="host", optimizer=optimizer) | {"nvme": {"paths": [str(tmp_path)]}}
    with infinity.initialize(recipe.build(), config) as engine:
        engine.manager.streams = RecordingStreams()
        yield engine.manager, engine.manager.streams


def test_device_to_host_store_waits_for_the_producing_stream(tmp_path, monkeypatch):
    """Defect 1: a store of a device tensor to the host or NVMe tier copies on the d2h stream only after
    that stream waits for the stream that produced the tensor; and both tiers' stores take that path."""
    with recorded_manager(tmp_path, "nvme") as (manager, streams):
        manager._to_host(torch.empty(4), torch.ones(4))
        assert streams.log == [("record", "current"), ("wait", "d2h"), ("use", "d2h"), ("record", "d2h"),
                               ("end", "d2h"), ("host waits", "d2h")]
        copies = []

        def to_host(dst, src, wait=True):
            copies.append((dst.device.type, src.device.type, wait))
            return streams.record("d2h")

        monkeypatch.setattr(manager, "_to_host", to_host)
        streams.log.clear()
        start, numel = manager.chunk_span(1, 0)
        with count_host_syncs() as syncs:
            manager.store(1, Kind.GRADS, 0, torch.empty(numel, device=META)).wait()  # host tier
            # defect 8: the host-tier store does not wait; the thread that reads those host bytes next does
            assert ("host waits", "d2h") not in streams.log and syncs == []
            manager.store(1, Kind.EXP_AVG, 0, torch.empty(numel, device=META)).wait()  # NVMe tier
        # Note [stores after their copy]: the NVMe store does not wait for its copy on the storing thread either;
        # its disk write, which reads the host buffer, waits for it on the manager's copy-waiter thread
        assert copies == [("cpu", "meta", False), ("cpu", "meta", False)]
        assert [(thread.startswith("infinity-d2h-wait"), why) for thread, why in syncs] == [
            (True, "d2h copy before its disk write")], syncs
        stored = torch.empty(numel, device=META)
        # Note [copies hold their source]: a source the caller keeps (release=False: a unit's flat gradient) is
        # held for the copy that reads it, and the caller's stream does not wait for that copy, in both tiers (on
        # the H100 backward waited for each unit's gradient copy before computing the next unit)
        for kind in (Kind.GRADS, Kind.EXP_AVG):
            streams.log.clear(), streams.held.clear()
            manager.store(1, kind, 0, stored, release=False).wait()
            log = streams.log
            assert streams.held == ["d2h"] and ("wait", "current") not in log, (kind, streams.held, log)
        manager.mark_zero(1, Kind.EXP_AVG)
        streams.log.clear()
        with count_host_syncs() as syncs:
            manager.fetch(1, Kind.GRADS, 0, torch.device("cpu")).wait()
        assert streams.log == [("host waits", "d2h")] and len(syncs) == 1


@pytest.fixture
def cudart_calls(monkeypatch) -> list:
    """CUDA's runtime faked: the cudaHostRegister / cudaHostUnregister calls made, in order."""
    calls = []

    class CudaRuntime:
        def cudaHostRegister(self, ptr, nbytes, flags):
            calls.append(("register", ptr, nbytes))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", CudaRuntime)
    return calls


def test_host_tier_is_one_arena_pinned_at_its_exact_size(cudart_calls):
    """Defect 5 (Note [pinned arena]): with pinning, the host tier is one allocation registered once with
    CUDA at the plan's bytes (each shard rounded up to a page), every shard inside it; nothing goes
    through the caching host allocator, which rounds pinned blocks up to powers of two."""
    calls = cudart_calls
    recipe = Recipe()
    engine = infinity.initialize(recipe.build(), recipe.config(params="host", grads="host", optimizer="host"))
    with engine:
        plan = engine.plan
        manager = TieredMemoryManager(plan, torch.device("cpu"), Streams(torch.device("cpu")), None, pin_host=True)
        for unit in range(len(plan.units)):
            for kind in Kind:
                manager.allocate(unit, kind)
        shards = [manager.resident(u, k) for u in range(len(plan.units)) for k in Kind]
        page = 4096
        expected = sum(-(-s.numel() * s.element_size() // page) * page for s in shards)
        host_state = sum(plan.state_bytes()[Tier.HOST].values())
        assert host_state <= expected <= host_state + page * len(shards)
        assert calls == [("register", calls[0][1], expected)]
        base = calls[0][1]
        for s in shards:
            assert base <= s.data_ptr() and s.data_ptr() + s.numel() * s.element_size() <= base + expected
        assert manager.memory_report()["pinned_host_tier_bytes"] == expected
        manager.close()
        assert calls[1:] == [("unregister", base)]


def test_copies_to_the_device_are_waited_for_on_the_device(tmp_path, monkeypatch):
    """Defects 6 and 8: a fetch to the device (faked by meta) from the host tier, or from NVMe, is waited
    for by the consumer's stream (no host sync); the NVMe read's copy is issued as soon as the read lands,
    before wait(); its staging buffer goes back only once the copy is done; host bytes a copy may still
    read are waited for before they are rewritten."""
    with recorded_manager(tmp_path, "host") as (manager, streams):
        numel = manager.chunk_span(1, None)[1]
        with count_host_syncs() as syncs:
            pending = manager.fetch(1, Kind.GRADS, None, into=torch.empty(numel, device=META))  # host tier
            # the copy into the caller's buffer waits for the caller's stream (Note [stream-ordered memory])
            assert streams.log == [("record", "current"), ("wait", "h2d"), ("use", "h2d"), ("record", "h2d"),
                                   ("end", "h2d")]
            pending.wait()
            assert streams.log[5:] == [("wait", "current")]
        assert syncs == []
        streams.log.clear()
        spans, profiler = [], manager.profiler
        manager.profiler = SimpleNamespace(enabled=True, device_span=lambda name, link, num_bytes: (
            spans.append((link, num_bytes)) or contextlib.nullcontext()))
        manager.fetch(1, Kind.GRADS, None, into=torch.empty(numel, device=META)).wait()
        assert spans == [(Link.H2D, numel * 4)]  # (defect 11: the copy's profile span is device time)
        manager.profiler = profiler
        streams.log.clear()
        manager.store(1, Kind.GRADS, None, torch.zeros(numel))  # rewrites the bytes the copy reads
        assert streams.log == [("host waits", "h2d")]

        streams.log.clear()
        streams.complete = False  # the copies below have not finished on the device
        bound = []  # (defect 4: the I/O thread that issues the copy selects the engine's device first)
        monkeypatch.setattr(manager_module, "bind_thread", lambda device: bound.append(
            (threading.current_thread() is threading.main_thread(), device)))
        with count_host_syncs() as syncs:
            pending = manager.fetch(1, Kind.PARAMS, None, into=torch.empty(numel, dtype=torch.float32, device=META),
                                    urgent=True)
            deadline = time.monotonic() + 30
            while ("end", "h2d") not in streams.log and time.monotonic() < deadline:
                time.sleep(0.01)  # the read lands on the I/O thread, which issues the copy
            # the caller's stream is recorded at issue, and the copy the I/O thread issues waits for it
            assert streams.log == [("record", "current"), ("wait", "h2d"), ("use", "h2d"), ("record", "h2d"),
                                   ("end", "h2d")], streams.log
            pending.wait()
            assert streams.log[5:] == [("wait", "current")]
        assert syncs == []
        assert bound == [(False, META)]
        assert len(manager.staging._after) == 1  # the staging buffer waits for its copy
        streams.complete = True
        manager.staging.host_buffer(16, torch.float32)
        assert manager.staging._after == []


def test_worker_updates_on_its_own_stream_ordered_by_events():
    """Defect 9 (Note [update stream]): the optimizer worker queues its device work on the update stream,
    waits on the device for the gradients the training thread queued before submitting, and a user of
    the unit waits on the device for the event recorded after its update (stand-in streams, by thread)."""
    log = []

    class ThreadStreams(RecordingStreams):
        def __init__(self):
            super().__init__()
            self.update = "update"
            self.log = _ByThread(log)

    class _Optimizer:
        compute_device = torch.device("cpu")

        def step(self, *, hyper, grad_scale, active, units, on_unit_done, journal=None):
            log.append((threading.current_thread().name, "step"))
            for unit in units:
                on_unit_done(unit)

    worker = OptimizerWorker(_Optimizer(), num_units=1, streams=ThreadStreams())
    try:
        unit = SimpleNamespace(index=0)
        worker.submit([unit], hyper=None, grad_scale=None, active={0: [(0, 1, 1, 0)]}, after_unit=lambda u: None)
        worker.wait_unit(0)
    finally:
        worker.close()
    main, work = threading.current_thread().name, "infinity-optimizer"
    assert [e for e in log if e[0] == work][:4] == [(work, "use", "update"), (work, "wait", "current"), (work, "step"),
                                                    (work, "record", "current")], log
    # the initial 'updated' event, the event at submit, then the wait for the unit's update event
    assert [e for e in log if e[0] == main] == [(main, "record", "current")] * 2 + [(main, "wait", "current")], log


def test_the_device_lane_queues_its_work_on_its_own_stream():
    """Note [device lane]: the lane thread's device work goes on the lane stream (not update, where the CPU
    worker's parameter uploads would queue behind the lane's waits for its copies up), after waiting on the device
    for the gradients; its copies back are paced by events on d2h; a unit it stepped is waited for on the device."""
    log, lane_stepped = [], threading.Event()

    class ThreadStreams(RecordingStreams):
        def __init__(self):
            super().__init__()
            self.update, self.lane = "update", "lane"
            self.log = _ByThread(log)

    class _Optimizer:
        compute_device = torch.device("cpu")

        def __init__(self, on_lane: bool):
            self.on_lane = on_lane

        def step(self, *, units, on_unit_done, **_):
            if not self.on_lane:
                assert lane_stepped.wait(10)  # (the CPU's unit 0 until the lane has taken unit 1)
            log.append((threading.current_thread().name, "step", units[0].index))
            for unit in units:
                on_unit_done(unit)
            lane_stepped.set()

    worker = OptimizerWorker(_Optimizer(False), num_units=2, streams=ThreadStreams(), lane=_Optimizer(True))
    try:
        with worker.offering():
            for k in range(2):
                worker.submit([SimpleNamespace(index=k)], hyper=None, grad_scale=None, active={k: [(0, 1, 1, 0)]},
                              after_unit=lambda u: None, position=k, lane=k == 1)
        worker.wait_unit(1)
        worker.wait_unit(0)
    finally:
        worker.close()
    lane, work, main = "infinity-lane", "infinity-optimizer", threading.current_thread().name
    assert [e for e in log if e[0] == lane] == [(lane, "use", "lane"), (lane, "wait", "current"), (lane, "step", 1),
                                               (lane, "record", "current"), (lane, "record", "d2h"),
                                               (lane, "end", "lane")], log
    assert [e for e in log if e[0] == work] == [(work, "use", "update"), (work, "wait", "current"), (work, "step", 0),
                                               (work, "record", "current"), (work, "end", "update")], log
    assert [e for e in log if e[0] == main][-2:] == [(main, "wait", "current")] * 2, log  # each unit's update event


class _ByThread(list):
    """A log whose entries carry the name of the thread that appended them."""

    def __init__(self, sink: list):
        super().__init__()
        self.sink = sink

    def append(self, entry) -> None:
        self.sink.append((threading.current_thread().name, *entry))


def test_compute_spans_on_a_gpu_are_device_time():
    """Defect 11: on a GPU the training thread's compute spans are device spans (CUDA events on the compute
    stream, named when they end), not host-clock spans around kernel launches."""
    calls = []

    class DeviceSpan:
        def __enter__(self):
            calls.append("device span begins")
            return self

        def end(self, name):
            calls.append(("device span ends", name))

    class Profiler:
        enabled = True

        def device_span(self, name, link, **kwargs):
            assert link is Link.COMPUTE
            return DeviceSpan()

        def record(self, name, link, start, end, **kwargs):
            calls.append(("host span", name))

    clock = TrainingClock(Profiler(), device_time=True)
    clock.compute_begin()
    clock.compute_end("forward before blocks.1")
    assert calls == ["device span begins", ("device span ends", "forward before blocks.1")]
    calls.clear()
    cpu = TrainingClock(Profiler())
    cpu.compute_begin()
    cpu.compute_end("backward")
    assert calls == [("host span", "backward")]


def test_a_prefetch_after_an_update_follows_it_on_the_device():
    """Note [update stream]: a unit whose update is done may be prefetched (ready), and the stream that
    fetches it then waits for the update's event, so the fetch or gather reads the new parameters."""
    recipe = Recipe(extra={"overlap": {"optimizer_with_backward": True}})
    engine = infinity.initialize(recipe.build(), recipe.config())
    with engine:
        streams = engine.updates.worker.streams = RecordingStreams()
        assert engine.updates.ready(1)
        assert streams.log == [("wait", "current")]


def test_staging_buffers_are_pinned_at_their_size_class_not_a_power_of_two(cudart_calls, monkeypatch):
    """Defect 5 for io_engine's staging pool: a pinned buffer is a fresh mapping registered with CUDA at its
    exact bytes (a 5 MiB size class pins 5 MiB, where the caching host allocator would pin 8 MiB) and
    unregistered when its last view dies, before the mapping goes."""
    import gc

    from io_engine import AlignedBufferPool, size_class
    calls = cudart_calls
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda *a, **k: pytest.fail("caching host allocator used"))
    pool = AlignedBufferPool(alignment=4096, pin=None)
    nbytes = 4 * 2**20 + 12345  # its class: 5 MiB
    buf = pool.get(nbytes // 4, torch.float32)
    assert size_class(nbytes, 4096) == 5 * 2**20
    assert calls == [("register", calls[0][1], 5 * 2**20)]
    assert calls[0][1] <= buf.data_ptr() < calls[0][1] + 5 * 2**20 and buf.data_ptr() % 4096 == 0
    buf.fill_(1.0)  # the bytes are real memory
    pool.put(buf)
    del buf
    pool.close()
    gc.collect()
    assert calls[1:] == [("unregister", calls[0][1])]


class OrderedStreams(Streams):
    """Streams of a pretend GPU that check Note [stream-ordered memory]: each device buffer remembers the stream
    it was allocated on (and when); a copy that writes it on another stream must come after that stream waited
    for an event of the allocating stream recorded at or after the allocation. `violations` lists the others."""

    def __init__(self):
        super().__init__(device=torch.device("cuda", 0), compute="compute", h2d="h2d", d2h="d2h", comm="comm")
        self.stack, self.seq = ["compute"], 0
        self.edges: list[tuple[str, int, str]] = []  # (waited stream, its position, waiting stream)
        self.allocated: dict[int, tuple[str, int]] = {}  # id(buffer) -> (stream, position)
        self.held: list[tuple[int, str]] = []
        self.violations: list[str] = []
        self.buffers = []  # (kept alive: ids stay unique)

    def tick(self) -> int:
        self.seq += 1
        return self.seq

    def current(self):
        return self.stack[-1]

    def record(self, stream=None):
        return SimpleNamespace(stream=stream or self.current(), seq=self.tick(), query=lambda: True,
                               synchronize=lambda: None)

    def wait_event(self, event, stream=None) -> None:
        self.edges.append((event.stream, event.seq, stream or self.current()))

    @contextlib.contextmanager
    def use(self, stream):
        self.stack.append(stream or self.current())
        yield
        self.stack.pop()

    def hold(self, tensor, stream) -> None:
        self.held.append((id(tensor), stream))

    def allocate(self, t: torch.Tensor) -> torch.Tensor:
        self.allocated[id(t)] = (self.current(), self.tick())
        self.buffers.append(t)
        return t

    def written(self, t: torch.Tensor) -> None:
        if id(t) not in self.allocated:
            return
        home, at = self.allocated[id(t)]
        on = self.current()
        if on != home and not any(a == home and s >= at and b == on for a, s, b in self.edges):
            self.violations.append(f"allocated on {home}, written on {on} with no ordering edge")


class WatchWrites(torch.overrides.TorchFunctionMode):
    def __init__(self, streams: OrderedStreams):
        super().__init__()
        self.streams = streams

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            self.streams.written(args[0])
        return func(*args, **(kwargs or {}))


def test_device_buffers_are_allocated_or_ordered_for_the_stream_that_writes_them(tmp_path, monkeypatch):
    """Note [stream-ordered memory], the race CSAN reported on the H200: a fetch to the device fills a staging
    buffer on the h2d stream; it must be allocated on that stream (or the copy ordered after the allocating
    stream), and a buffer the caller allocated on its own stream (the unsharded buffer) must be written only
    after the h2d stream waited for it. The waiter holds the buffer for its own stream."""
    recipe = Recipe()
    config = recipe.config(params="host", grads="host", optimizer="host")
    with infinity.initialize(recipe.build(), config) as engine:
        manager = engine.manager
        streams = manager.streams = OrderedStreams()

        monkeypatch.setattr(manager.staging, "device_buffer", lambda numel, dtype: streams.allocate(
            torch.empty(numel, dtype=dtype, device=META)))
        with WatchWrites(streams):
            fetched = manager.fetch(1, Kind.GRADS, 0, META).wait()  # into a staging buffer
            into = streams.allocate(torch.empty(manager.chunk_span(1, 0, Kind.PARAMS)[1], device=META))
            manager.fetch(1, Kind.PARAMS, 0, META, into=into).wait()  # into the caller's buffer
        assert fetched.device == META and id(fetched) in streams.allocated
        assert streams.violations == [], streams.violations
        assert (id(fetched), "compute") in streams.held  # the waiter's stream keeps the block from early reuse


def test_worker_steps_each_unit_once_the_device_has_its_gradients():
    """Note [merge only what the device has reached], the schedule behind the H200's ZeRO-Offload profile, on a
    simulated device: the training thread submits every unit's update long before the device has computed those
    gradients (it runs ahead); the device then produces them one by one. Each unit must be stepped once its own
    gradients exist, not after the last unit's: the worker never waits on the stream for an event the device
    has not reached when an earlier unit could step."""
    device_at = [0]  # how many units' gradients the simulated device has produced
    log = []

    class Event:
        def __init__(self, unit):
            self.unit = unit

        def query(self):
            return self.unit is None or self.unit < device_at[0]

        def synchronize(self):
            pass

    class SimulatedStreams(Streams):
        def __init__(self):
            super().__init__(device=torch.device("cuda", 0), compute="compute", update="update")
            self.submitting = None

        def record(self, stream=None):
            return Event(self.submitting)

        def wait_event(self, event, stream=None):
            # the worker's stream waits for the gradients' event, and the host reads what follows on it (the
            # unit's norm, the gradient copied to the host) only once the device got there: modelled as a wait
            if threading.current_thread().name == "infinity-optimizer" and event.unit is not None:
                deadline = time.monotonic() + 3
                while not event.query() and time.monotonic() < deadline:
                    time.sleep(0.002)
                log.append(("stream waits for", event.unit, device_at[0]))

        @contextlib.contextmanager
        def use(self, stream):
            yield

    class _Optimizer:
        compute_device = torch.device("cpu")

        def step(self, *, hyper, grad_scale, active, units, on_unit_done, journal=None):
            for unit in units:
                log.append(("step", unit.index, device_at[0]))
                on_unit_done(unit)

    n = 5
    streams = SimulatedStreams()
    worker = OptimizerWorker(_Optimizer(), num_units=n, streams=streams)
    try:
        first = threading.Event()
        for i in range(n):  # backward's hooks, far ahead of the device
            streams.submitting = i
            active = (lambda: first.wait(10) and {0: []}) if i == 0 else {i: []}
            worker.submit([SimpleNamespace(index=i)], hyper=None, grad_scale=None, active=active,
                          after_unit=lambda u: None)
        streams.submitting = None
        first.set()
        for i in range(n):  # the device produces each unit's gradients in turn
            device_at[0] = i + 1
            deadline = time.monotonic() + 10
            while worker.pending(i) and time.monotonic() < deadline:
                time.sleep(0.002)
            assert not worker.pending(i), f"unit {i} not stepped once the device produced its gradients: {log}"
    finally:
        worker.close()
    # every wait and step happened when the device had reached that unit, never while it stood before it
    assert all(reached > unit for _, unit, reached in log), log


@pytest.mark.parametrize("compute,optimizer", [("fp32", "host"), ("bf16", "host"), ("fp32", "nvme")])
def test_updated_parameters_go_up_without_the_updating_thread_waiting(compute, optimizer, tmp_path, monkeypatch):
    """Note [async upload]: a master's update is copied to the device parameters (faked by meta) with no host sync
    on the updating thread. A host-tier fp32 master is the copy's source itself (no staging buffer), under bf16
    compute too (its 4 bytes an element go up and are cast on the device: no cast on the CPU), and the next
    fetch that lets the CPU rewrite it waits for the copy; a master read from NVMe (whose staging buffer its own
    disk write releases) is cast into a staging buffer of its own that returns to the pool only once the copy's
    event has completed: no buffer is handed back twice."""
    recipe = Recipe()
    config = recipe.config(params="device", grads="host", optimizer=optimizer) | {
        "precision": {"compute_dtype": compute}, "nvme": {"paths": [str(tmp_path)]}}
    config["placement"]["tail_units"] = 0
    with infinity.initialize(recipe.build(), config) as engine:
        manager, unit = engine.manager, 1
        assert manager._shards[(unit, Kind.MASTER)].tier is Tier(optimizer)
        manager.streams = streams = RecordingStreams()
        shard = manager._shards[(unit, Kind.PARAMS)]
        shard.resident = torch.empty_like(shard.resident, device=META)  # the parameters on the "GPU"
        staged, released = [], []
        host_buffer, release = manager.staging.host_buffer, manager.staging.release
        monkeypatch.setattr(manager.staging, "host_buffer", lambda n, dtype: staged.append(dtype) or host_buffer(
            n, dtype))
        monkeypatch.setattr(manager.staging, "release", lambda t: (
            released.append(t.data_ptr()) if manager.staging.owns(t) else None, release(t))[1])
        master = manager.fetch(unit, Kind.MASTER, None, torch.device("cpu")).wait()  # the tier's bytes, or staging
        staged.clear()
        streams.complete = False  # the copy has not finished on the device
        up = manager.bytes_moved["h2d"]
        with count_host_syncs() as syncs:
            writes = manager.store_master(unit, None, master)
        assert syncs == [] and all(e[0] != "host waits" for e in streams.log), streams.log
        assert manager.bytes_moved["h2d"] - up == master.numel() * (4 if optimizer == "host" else shard.dtype.itemsize)
        if optimizer == "host":
            assert staged == [] and shard.resident.dtype == getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[
                compute])
            streams.log.clear()
            manager.fetch(unit, Kind.MASTER, None, torch.device("cpu")).wait()  # the next update rewrites it
            assert streams.log == [("host waits", "current")]
            return
        assert staged == [shard.dtype] and len(manager.staging._after) == 1
        manager.staging.host_buffer(16, torch.float32)
        assert len(manager.staging._after) == 1  # (its copy has not read it yet)
        streams.complete = True
        for write in writes:
            write.wait()  # (the master's disk write, which releases its staging buffer)
        manager.staging.host_buffer(16, torch.float32)
        assert manager.staging._after == [] and len(released) == len(set(released)) == 1 + (optimizer == "nvme")


def test_a_kept_gradient_is_rewritten_only_after_its_copy_to_the_host_has_read_it(tmp_path, monkeypatch):
    """Note [device lane]: the lane's fused Adam unscales a gradient the device kept in place, and that gradient's
    copy to the host (on the d2h stream) reads the same device bytes: the lane's stream waits, on the device, for
    that copy first, and holds the gradient until it has read it. No host sync."""
    import infinity.optim.offloaded as offloaded
    with recorded_manager(tmp_path, "host") as (manager, streams):
        copies = []

        def to_host(dst, src, wait=True):
            copies.append(streams.record("d2h"))
            return copies[-1]
        monkeypatch.setattr(manager, "_to_host", to_host)
        _, total = manager.chunk_span(1, None, Kind.GRADS)
        grads = torch.empty(total, device=META)  # the unit's final gradient, stored to the host and kept
        manager.store(1, Kind.GRADS, None, grads, release=False)
        assert copies, "the gradient's copy to the host"
        waited = []
        monkeypatch.setattr(streams, "wait_event", lambda event, stream=None: waited.append((event, stream)))
        lane = OffloadedOptimizer([], manager, META, on_device=True)
        with count_host_syncs() as syncs:
            chunk = lane._kept_chunk(offloaded._Task(SimpleNamespace(index=1), 0, ()), grads, None)
        assert waited and {stream for _, stream in waited} == {"current"}, waited
        assert {id(event) for event, _ in waited} <= {id(event) for event in copies}
        assert streams.held[-1] == "current" and syncs == []
        assert chunk.wait().numel() == manager.chunk_span(1, manager.optimizer_chunk(1, Kind.GRADS, 0), Kind.GRADS)[1]
