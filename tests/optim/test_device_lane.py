"""Note [device lane] (memory/placement.py): when the update waits for the global norm, a second worker steps on the
GPU the host-state units the next forward uses last while the CPU's worker steps its first, the two meeting in the
middle. Here: the split (each unit once, from either end), the lane's pace, its errors, the plan's units, staging
and reasons, and training with it bit for bit as without it (on the CPU, where the lane is forced: its "device" is
the CPU). Its schedule in a GPU's proportions: tests/device/test_simulated_schedule.py."""

from __future__ import annotations

import dataclasses
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import infinity
import infinity.memory.placement as placement_module
from engine_runs import engine_run
from infinity.config.sections import Config, SettingWarning
from infinity.memory.device_lane import LANE_UNITS_IN_FLIGHT, lane_staging_bytes
from infinity.memory.manager import TieredMemoryManager
from infinity.memory.pending import Pending
from infinity.memory.placement import plan_for_config, plan_placement
from infinity.memory.plan import Budgets, PlacementError, UnitSizes
from infinity.memory.tier import Tier
from infinity.optim.offloaded import OffloadedOptimizer
from infinity.optim.worker import OptimizerWorker
from reference import Recipe, reference_run


class Stepping:
    """An optimizer that records which thread stepped which unit, taking `seconds` per unit."""

    compute_device = torch.device("cpu")

    def __init__(self, log: list, seconds: float, fail_on: int | None = None, started: threading.Event | None = None,
                 after: tuple[threading.Event, int] | None = None):
        self.log, self.seconds, self.fail_on = log, seconds, fail_on
        self.started = started  # set once it steps (the lane's)
        self.after = after  # (event, k): units from k on wait for it (the CPU's: the lane runs first, however loaded)

    def step(self, *, units, on_unit_done, **_):
        for unit in units:
            if self.started is not None:
                self.started.set()
            if self.after is not None and unit.index >= self.after[1]:
                assert self.after[0].wait(10), "the lane never ran"
            if unit.index == self.fail_on:
                raise RuntimeError(f"lane failed on u{unit.index}")
            time.sleep(self.seconds)
            self.log.append((threading.current_thread().name, unit.index))
            on_unit_done(unit)


def _workers(log: list, seconds: float, lane_from: int, **lane) -> tuple[Stepping, Stepping]:
    """The CPU's and the lane's: the CPU steps no lane unit before the lane has begun (a loaded machine may
    schedule the lane late; on a GPU its units' state is still on the way up then)."""
    started = threading.Event()
    return (Stepping(log, seconds, after=(started, lane_from)), Stepping(log, seconds, started=started, **lane))


def _submit_all(worker: OptimizerWorker, n: int, lane_from: int, done: dict) -> None:
    with worker.offering():  # as DeferredUpdate offers: all of a step's units at once
        for k in range(n):  # the next forward's order, as DeferredUpdate submits
            _submit(worker, k, lane_from, done)


def _submit(worker: OptimizerWorker, k: int, lane_from: int, done: dict) -> None:
    worker.submit([SimpleNamespace(index=k, name=f"u{k}")], hyper=(), grad_scale=None, active={k: []},
                  after_unit=lambda u: done.__setitem__(u.index, time.perf_counter()), position=k,
                  lane=k >= lane_from)


def test_the_cpu_takes_the_forwards_first_units_and_the_lane_its_last_each_once():
    log, done, n = [], {}, 12
    cpu, lane = _workers(log, 0.004, lane_from=2)
    worker = OptimizerWorker(cpu, n, lane=lane)
    try:
        _submit_all(worker, n, lane_from=2, done=done)  # (units 0-1: not the lane's, the tail units' place)
        worker.wait_all()
    finally:
        worker.close()
    cpu = [u for name, u in log if name == "infinity-optimizer"]
    lane = [u for name, u in log if name == "infinity-lane"]
    assert sorted(cpu + lane) == list(range(n))  # each unit stepped once
    assert cpu == list(range(len(cpu))) and lane == list(range(n - 1, n - 1 - len(lane), -1)), (cpu, lane)
    assert len(cpu) >= 2 and lane  # (both worked: the lane takes the last one as soon as it is offered)
    assert set(done) == set(range(n))


def test_the_lane_starts_from_the_forwards_last_unit_though_the_submitter_gives_up_the_gil():
    """The lane wakes at the first offer; a step's offers are taken only once all are made (`offering`), so its
    first unit is the forward's last, not whichever was offered when the submitting thread (which releases the
    GIL: a CUDA event record, the engine's 100 us switch interval) let it run."""
    from infinity.device.streams import Streams

    class SlowRecord(Streams):
        def record(self, stream=None):
            time.sleep(0.0005)  # (the GIL is released here)
            return super().record(stream)

    for _ in range(3):
        log, done, n = [], {}, 24
        cpu, lane = _workers(log, 0.002, lane_from=6)
        worker = OptimizerWorker(cpu, n, streams=SlowRecord(torch.device("cpu")), lane=lane)
        try:
            _submit_all(worker, n, lane_from=6, done=done)
            worker.wait_all()
        finally:
            worker.close()
        lane = [u for name, u in log if name == "infinity-lane"]
        assert lane and lane[0] == n - 1 and lane == sorted(lane, reverse=True), log


def test_a_unit_the_lane_steps_is_waited_for_like_any_other():
    log, done, n = [], {}, 4
    cpu, lane = _workers(log, 0.05, lane_from=0)
    worker = OptimizerWorker(cpu, n, lane=lane)
    try:
        _submit_all(worker, n, lane_from=0, done=done)
        worker.wait_unit(n - 1)  # the lane's first
        assert n - 1 in done and ("infinity-lane", n - 1) in log
        worker.wait_all()
    finally:
        worker.close()
    assert set(done) == set(range(n))


def test_an_error_on_the_lane_is_raised_by_the_next_wait_and_nothing_runs_after_it():
    log, done, n = [], {}, 6
    cpu, lane = _workers(log, 0.01, lane_from=0, fail_on=n - 1)
    worker = OptimizerWorker(cpu, n, lane=lane)
    try:
        _submit_all(worker, n, lane_from=0, done=done)
        with pytest.raises(RuntimeError, match="lane failed on u5"):
            worker.wait_all()
    finally:
        worker.close()
    assert n - 1 not in done


def test_without_a_lane_the_lane_flag_changes_nothing():
    log, done, n = [], {}, 5
    worker = OptimizerWorker(Stepping(log, 0.0), n)
    try:
        _submit_all(worker, n, lane_from=0, done=done)
        worker.wait_all()
    finally:
        worker.close()
    assert log == [("infinity-optimizer", u) for u in range(n)]


class Events:
    """Streams whose events say when they were recorded and whose host waits are logged."""

    def __init__(self):
        self.recorded, self.waited = 0, []
        self.h2d = "h2d"

    def record(self, stream=None):
        self.recorded += 1
        return SimpleNamespace(n=self.recorded, stream=stream)


def test_the_lane_paces_its_copies_up_two_tasks_at_a_time(monkeypatch):
    """Note [device lane]: an upload of the CPU's waits behind at most LANE_CHUNKS_IN_FLIGHT of the lane's tasks."""
    import infinity.optim.offloaded as offloaded
    streams, waited = Events(), []
    monkeypatch.setattr(offloaded, "host_poll", lambda event, why: waited.append((event.n, why)))
    manager = SimpleNamespace(streams=streams, fetch=lambda *a: None, optimizer_chunk=lambda u, k, c: c,
                              tier=lambda u, k: Tier.HOST, plan=SimpleNamespace(
                                  state_dtype=placement_module.StateDtype.FP32, dtype=lambda k: torch.float32,
                                  compute_dtype=torch.bfloat16))
    lane = OffloadedOptimizer([], manager, torch.device("cpu"), on_device=True)
    unit = SimpleNamespace(index=0)
    for chunk in range(4):
        lane._issue(offloaded._Task(unit, chunk, ()))
    assert [n for n, _ in waited] == [1, 2] and {why for _, why in waited} == {"device lane pace"}
    assert all(e.stream == "h2d" for e in lane._copies_up)


# ------------------------------------------------------------------------------------------------ the plan
OFFLOAD = {"params": "device", "grads": "host", "optimizer": "host"}
GPU = Budgets(device=40 << 30, host=100 << 30, nvme=0, shared_ram=False, ram=125 << 30)


def _plan(budgets=GPU, static=OFFLOAD, defers=True, tail=0, units=6, numel=1000, eager=False):
    sizes = tuple(UnitSizes.uniform(f"u{u}", numel * (1 + u % 2)) for u in range(units))
    return plan_placement(sizes, torch.float32, policy="static", budgets=budgets, units_ahead=2, static=static,
                          tail_units=tail, device_lane="on", defers_update=defers, eager_update=eager)


def test_the_plan_names_the_host_state_units_and_fits_two_of_them_on_the_device():
    plan = _plan(tail=2)  # units of 1000, 2000, 1000, ... elements
    assert plan.device_lane == (2, 3, 4, 5)  # (0-1: tail units, updated on the device already)
    per_element = 4 * 4  # fp32 master, exp_avg, exp_avg_sq and gradient
    assert plan.working_terms[Tier.DEVICE]["device_lane"] == 2 * 2000 * per_element == lane_staging_bytes(
        plan, [2, 3, 4, 5])  # the two largest units
    assert LANE_UNITS_IN_FLIGHT == 2
    assert any(r.startswith("device lane: after the global norm, units 2-5 (6,000 trainable") for r in plan.reasons)
    # the forward's last units' gradients, up to half of the lane's (6,000 elements: 3,000 of them, 4 bytes each)
    assert plan.lane_grads == (4, 5) and plan.working_terms[Tier.DEVICE]["device_lane_grads"] == 3000 * 4
    off = plan_placement(plan.units, torch.float32, policy="static", budgets=GPU, units_ahead=2, static=OFFLOAD,
                         tail_units=2)
    assert off.device_lane == off.lane_grads == () and "device_lane" not in off.working_terms.get(Tier.DEVICE, {})
    assert plan.tier_totals()[Tier.DEVICE] == off.tier_totals()[Tier.DEVICE] + 2 * 2000 * per_element + 3000 * 4


def test_the_kept_gradients_take_at_most_a_quarter_of_the_device_memory_left():
    loose = _plan()
    staged = loose.tier_totals()[Tier.DEVICE] - loose.working_terms[Tier.DEVICE]["device_lane_grads"]
    tight = _plan(budgets=dataclasses.replace(GPU, device=staged + 4 * 8000 + 3))  # room for 8,000 bytes: u5's
    assert loose.lane_grads == (4, 5) and tight.lane_grads == (5,), (loose.lane_grads, tight.lane_grads)  # (half)
    none = _plan(budgets=dataclasses.replace(GPU, device=staged + 4 * 8000 - 4))
    assert none.lane_grads == () and "device_lane_grads" not in none.working_terms[Tier.DEVICE]


def test_an_eager_update_has_the_lane_without_kept_gradients():
    """Note [device lane]: the eager update (no clipping) offers the lane its units as backward finalizes them; no
    gradient is kept on the device for it (the lane copies the final one up)."""
    plan = _plan(defers=False, eager=True, tail=2)
    assert plan.device_lane == (2, 3, 4, 5) and plan.lane_grads == ()
    assert "device_lane_grads" not in plan.working_terms[Tier.DEVICE]
    assert any(r.startswith("device lane: as backward finalizes them, units 2-5") for r in plan.reasons), plan.reasons


@pytest.mark.parametrize("case", ["no GPU", "not on the worker", "state on the device", "parameters on NVMe"])
def test_a_lane_that_cannot_act_is_said(case):
    kwargs = {"no GPU": {"budgets": dataclasses.replace(GPU, shared_ram=True)},
              "not on the worker": {"defers": False},  # (the update on the training thread, or speculated)
              "state on the device": {"static": {"params": "device", "grads": "device", "optimizer": "device"}},
              "parameters on NVMe": {"static": {"params": "nvme", "grads": "host", "optimizer": "host"},
                                     "budgets": dataclasses.replace(GPU, nvme=1 << 30)}}[case]
    plan = _plan(**kwargs)
    assert plan.device_lane == ()
    said = [r for r in plan.reasons if r.startswith('overlap.device_lane = "on": nothing is updated on the GPU')]
    assert len(said) == 1 and plan.inert == tuple(said), plan.reasons  # Note [inert setting]


@pytest.mark.parametrize("lane", ["on", "off"])
def test_initialize_warns_of_a_setting_that_does_nothing(lane, recwarn):
    """Note [inert setting]: on this CPU the lane cannot act; the engine says so when it starts (the job prints
    the warning as one line: tests/job/test_cli.py), and says nothing when the lane is off."""
    recipe = Recipe(steps=1)  # (grad_clip 0.5: the update waits for the norm)
    config = recipe.config(params="host", grads="host", optimizer="host") | {"overlap": {"device_lane": lane}}
    infinity.initialize(recipe.build(), config).close()
    said = [str(w.message) for w in recwarn if issubclass(w.category, SettingWarning)]
    assert said == ([] if lane == "off" else [
        'overlap.device_lane = "on": nothing is updated on the GPU: no GPU (the CPU would run both); the setting '
        'does nothing in this run'])


def test_a_lane_without_room_on_the_device_is_refused_with_the_fix():
    plan = _plan(budgets=GPU)
    staged = plan.tier_totals()[Tier.DEVICE] - plan.working_terms[Tier.DEVICE]["device_lane_grads"]
    tight = dataclasses.replace(GPU, device=staged - 1)
    with pytest.raises(PlacementError, match=r'device_lane = "on" needs .* set it to "off", or raise '
                                             r"memory.device_budget"):
        _plan(budgets=tight)


def test_plan_for_config_asks_the_lane_of_the_worker_updates_without_a_journal():
    sizes = tuple(UnitSizes.uniform(f"u{u}", 1000) for u in range(3))
    base = {"placement": OFFLOAD | {"tail_units": 0}, "overlap": {"device_lane": "on"}}
    clipped = plan_for_config(sizes, Config.from_dict(base | {"optimizer": {"grad_clip": 1.0}}), GPU)
    assert clipped.device_lane == (0, 1, 2) and clipped.lane_grads
    eager = plan_for_config(sizes, Config.from_dict(base | {"optimizer": {"grad_clip": 0.0}}), GPU)
    assert eager.device_lane == (0, 1, 2) and eager.lane_grads == ()  # (its gradients are final when offered)
    lane = {"device_lane": "on"}
    for other in ({"optimizer": {"grad_clip": 1.0}, "overlap": lane | {"speculation": "1GiB"}},
                  {"optimizer": {"grad_clip": 0.0}, "overlap": lane | {"optimizer_with_backward": False}}):
        assert plan_for_config(sizes, Config.from_dict(base | other), GPU).device_lane == ()


# ------------------------------------------------------------------------------------------------ training
BASE = Recipe(steps=4, accum=2)


@pytest.fixture(scope="module")
def recipe():
    """A clip between the run's norms: it fires in some windows and not in others."""
    _, norms, _ = reference_run(dataclasses.replace(BASE, grad_clip=1e9))
    clip = sorted(norms)[len(norms) // 2]
    assert any(n > clip for n in norms) and not all(n > clip for n in norms), norms
    return dataclasses.replace(BASE, grad_clip=clip)


@pytest.fixture
def forced_lane(monkeypatch):
    """The lane planned as on a GPU (its "device" is then the CPU); what it fetches from the host tier is a copy, as
    on a GPU (so its stores must write everything back); counts the units each worker stepped."""
    real = placement_module.with_device_lane
    monkeypatch.setattr(placement_module, "with_device_lane", lambda plan, setting, budgets, **modes: real(
        plan, setting, dataclasses.replace(budgets, shared_ram=False), **modes))
    fetch = TieredMemoryManager.fetch

    def copying(self, unit, kind, *args, **kwargs):
        pending = fetch(self, unit, kind, *args, **kwargs)
        if threading.current_thread().name == "infinity-lane" and self.tier(unit, kind) is Tier.HOST:
            return Pending(pending.wait().clone())
        return pending
    monkeypatch.setattr(TieredMemoryManager, "fetch", copying)
    stepped = {"lane": 0, "cpu": 0, "kept gradient chunks": 0}
    step, kept_chunk = OffloadedOptimizer.step, OffloadedOptimizer._kept_chunk

    def counting(self, **kwargs):
        stepped["lane" if self.on_device else "cpu"] += len(kwargs.get("units") or [])
        if not self.on_device:
            time.sleep(0.002)  # (a tiny model's CPU Adam could claim every unit before the lane runs once)
        return step(self, **kwargs)

    def counting_kept(self, *args):
        stepped["kept gradient chunks"] += 1
        return kept_chunk(self, *args)
    monkeypatch.setattr(OffloadedOptimizer, "step", counting)
    monkeypatch.setattr(OffloadedOptimizer, "_kept_chunk", counting_kept)
    return stepped


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_training_with_the_lane_is_bitwise_training_without_it(recipe, forced_lane, dtype):
    """With the clip firing in some windows: the same losses, norms and weights, bit for bit, as the deferred
    update without the lane, which itself follows torch AdamW after clip_grad_norm_. fp32: the lane takes the
    master from the parameters (Note [device lane]); bf16: from the host. The forward's last units' gradients
    are read from what backward kept (two micro-batches a window: the sum, not the last one's)."""
    extra = {"overlap": {"optimizer_with_backward": True, "device_lane": "on"},
             "placement": {"tail_units": 0}, "precision": {"compute_dtype": dtype},
             "optimizer": {"sub_group_size": 1024}}  # (several tasks a unit: paced copies, kept gradient views)
    with_lane = engine_run(recipe, OFFLOAD, None, extra)
    assert with_lane[3]["update_mode"] == "DeferredUpdate"
    assert forced_lane["lane"] > 0 and forced_lane["cpu"] > 0 and forced_lane["kept gradient chunks"] > 0, forced_lane
    assert with_lane[3]["working_planned_terms"]["device"]["device_lane"] > 0
    without = engine_run(recipe, OFFLOAD, None, extra | {"overlap": {"optimizer_with_backward": True}})
    assert with_lane[0] == without[0] and with_lane[1] == without[1]
    for name, tensor in without[2].items():
        assert torch.equal(with_lane[2][name], tensor), name
    if dtype == "fp32":
        ref_losses, _, ref_state = reference_run(recipe)
        assert with_lane[0] == pytest.approx(ref_losses, rel=1e-4)
        for name, tensor in ref_state.items():
            torch.testing.assert_close(with_lane[2][name], tensor, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_training_with_the_lane_and_no_clipping_is_bitwise_training_without_it(forced_lane, dtype):
    """The eager update (no clipping: each unit submitted as backward finalizes it) with the lane: the same losses
    and weights, bit for bit, as without it; the lane and the CPU each stepped units, and no gradient was kept for
    the lane (the eager update keeps none)."""
    recipe = dataclasses.replace(BASE, grad_clip=0.0)
    extra = {"overlap": {"optimizer_with_backward": True, "device_lane": "on"},
             "placement": {"tail_units": 0}, "precision": {"compute_dtype": dtype},
             "optimizer": {"sub_group_size": 1024}}
    with_lane = engine_run(recipe, OFFLOAD, None, extra)
    assert with_lane[3]["update_mode"] == "EagerUpdate"
    assert forced_lane["lane"] > 0 and forced_lane["cpu"] > 0, forced_lane
    assert forced_lane["kept gradient chunks"] == 0
    without = engine_run(recipe, OFFLOAD, None, extra | {"overlap": {"optimizer_with_backward": True}})
    assert with_lane[0] == without[0]
    for name, tensor in without[2].items():
        assert torch.equal(with_lane[2][name], tensor), name


def test_the_lane_takes_its_next_unit_once_all_but_one_of_its_copies_back_are_done():
    """Note [device lane]: LANE_UNITS_IN_FLIGHT units' copies back at most; the waits are the lane thread's."""
    from infinity.device.streams import Streams

    log = []

    class Recording(Streams):
        def __init__(self):
            super().__init__(device=torch.device("cpu"), d2h="d2h")

        def record(self, stream=None):
            on = stream or "current"  # (who polls it, logged when it does)
            return SimpleNamespace(
                query=lambda: log.append((threading.current_thread().name, "host waits", on)) or True)

    steps, done, n = [], {}, 4
    worker = OptimizerWorker(Stepping(steps, 0.0), n, streams=Recording(), lane=Stepping(steps, 0.0))
    try:
        _submit_all(worker, n, lane_from=0, done=done)
        worker.wait_all()
    finally:
        worker.close()
    lane = sum(name == "infinity-lane" for name, _ in steps)
    paced = [entry for entry in log if entry[2] == "d2h"]
    assert paced == [("infinity-lane", "host waits", "d2h")] * (lane - LANE_UNITS_IN_FLIGHT + 1), (log, steps)


def test_a_checkpoint_taken_with_the_lane_resumes_bitwise(recipe, forced_lane, tmp_path):
    """The lane's units are settled like the CPU's before a save (their state copied back), and a run resumed
    from the checkpoint continues bit for bit."""
    import infinity
    from engine_runs import train_steps

    config = recipe.config(**OFFLOAD) | {"overlap": {"optimizer_with_backward": True, "device_lane": "on"}}
    config["placement"]["tail_units"] = 0
    path = str(tmp_path / "ckpt")
    with infinity.initialize(recipe.build(), config) as engine:
        train_steps(engine, recipe, 0, 2, rank=0, world=1)
        engine.save_checkpoint(path)
        after = train_steps(engine, recipe, 2, recipe.steps, rank=0, world=1)
        state = engine.full_state_dict()
    assert forced_lane["lane"] > 0
    with infinity.initialize(recipe.build(), config) as engine:
        engine.load_checkpoint(path)
        assert train_steps(engine, recipe, 2, recipe.steps, rank=0, world=1) == after
        resumed = engine.full_state_dict()
    for name, tensor in state.items():
        assert torch.equal(resumed[name], tensor), name
