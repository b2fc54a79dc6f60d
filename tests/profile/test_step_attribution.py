"""Note [step attribution]: every instant of a step belongs to one named part, against hand-computed parts,
a wall clock around the steps, the host syncs a listener of its own hears, and the byte model."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

import pytest
import torch

import infinity
import infinity.runtime.engine as engine_module
from infinity.device.streams import listen_host_syncs
from infinity.machine.environment import resolve
from infinity.memory.tier import Kind
from infinity.memory.traffic import bytes_per_step
from infinity.profile import Link, Profiler, chart, format_summary
from infinity.profile.summary import attribute
from reference import Recipe


def test_each_instant_goes_to_the_first_part_that_covers_it():
    """Compute first, then the waits in Link order, then the host parts in HOST_PARTS order; gaps are shown."""
    prof = Profiler()
    prof.record_step(0, 0.0, 10.0)
    prof.record("forward", Link.COMPUTE, 0.0, 3.0)
    prof.record_wait(Link.NVME_READ, "fetch blocks.1", 2.0, 4.0)  # 1 s under compute: 1 s exposed
    prof.record_wait(Link.CPU_OPTIMIZER, "update blocks.1", 3.5, 5.0)  # 0.5 s under the read: 1 s exposed
    prof.record_host("hooks", 4.5, 5.5)  # 0.5 s under the wait
    prof.record_host("caller", 5.0, 8.0)  # 0.5 s under the hooks
    prof.record_host("data", 6.0, 7.0)  # inside the caller's time: named by the inner part
    prof.record("read", Link.NVME_READ, 0.0, 10.0, num_bytes=10)  # a link's work is no part of the thread's time
    step = prof.summary()["steps"][0]
    parts = step["parts"]
    assert parts["compute"] == pytest.approx(3.0)
    assert parts["exposed"] == {"nvme_read": pytest.approx(1.0), "cpu_optimizer": pytest.approx(1.0)}
    assert parts["host"]["hooks"] == pytest.approx(0.5)
    assert parts["host"]["data"] == pytest.approx(1.0)
    assert parts["host"]["caller"] == pytest.approx(2.5 - 1.0)
    assert parts["unattributed"] == pytest.approx(2.0)  # [8, 10]
    total = parts["compute"] + sum(parts["exposed"].values()) + sum(parts["host"].values()) + parts["unattributed"]
    assert total == pytest.approx(step["step_s"])
    assert step["overlap_efficiency"] == pytest.approx(3.0 / 10.0)
    assert step["attributed"] == pytest.approx(0.8)
    assert step["links"]["nvme_read"]["exposed_s"] == pytest.approx(1.0)
    text = format_summary(prof.summary())
    assert "unattributed 2000.00" in text and "hooks 500.00" in text


def test_the_median_is_the_median_step_whose_parts_add_up():
    prof = Profiler()
    for i, (length, compute) in enumerate([(1.0, 0.9), (3.0, 1.0), (2.0, 0.5), (4.0, 4.0)]):
        prof.record_step(i, 10.0 * i, 10.0 * i + length)
        prof.record("unit", Link.COMPUTE, 10.0 * i, 10.0 * i + compute)
    median = prof.summary()["median"]
    assert median["step"] == 2 and median["step_s"] == pytest.approx(2.0)  # the lower middle of 1, 2, 3, 4
    assert median["compute_s"] + median["unattributed_s"] == pytest.approx(median["step_s"])


def test_attribution_sweep_matches_a_point_sample():
    """The sweep against the definition itself: sample instants, give each to the first part covering it."""
    g = torch.Generator().manual_seed(0)
    prof = Profiler()
    kinds = [("compute", None), ("wait", Link.H2D), ("wait", Link.NVME_READ), ("host", "hooks"), ("host", "caller")]
    for _ in range(40):
        start, length = torch.rand(2, generator=g).tolist()
        kind, what = kinds[int(torch.randint(len(kinds), (1,), generator=g))]
        start, end = start * 10, start * 10 + length * 2
        if kind == "compute":
            prof.record("c", Link.COMPUTE, start, end)
        elif kind == "wait":
            prof.record_wait(what, "w", start, end)
        else:
            prof.record_host(what, start, end)
    spans = prof.spans()
    parts = attribute(spans, 0.0, 10.0)
    order = [("compute", Link.COMPUTE)] + [("wait", link) for link in Link] + [("host", "hooks"), ("host", "caller")]
    counts = collections.Counter()
    n = 20000
    for k in range(n):
        t = (k + 0.5) * 10.0 / n
        covering = {("compute", Link.COMPUTE) if s.kind.value == "work" else
                    ("wait", s.link) if s.kind.value == "wait" else ("host", s.name)
                    for s in spans if s.start <= t < s.end}
        counts[next((p for p in order if p in covering), None)] += 10.0 / n
    assert parts["compute"] == pytest.approx(counts[("compute", Link.COMPUTE)], abs=2e-3)
    for link in (Link.H2D, Link.NVME_READ):
        assert parts["exposed"].get(link.value, 0.0) == pytest.approx(counts[("wait", link)], abs=2e-3)
    for name in ("hooks", "caller"):
        assert parts["host"][name] == pytest.approx(counts[("host", name)], abs=2e-3)
    assert parts["unattributed"] == pytest.approx(counts[None], abs=2e-3)


PLACEMENTS = [("device", "device", "device"), ("nvme", "host", "nvme")]


@pytest.mark.parametrize("placement", PLACEMENTS, ids="-".join)
def test_a_training_step_is_attributed(placement, tmp_path, monkeypatch):
    """A user's loop (data, forward, loss, backward, step, a logged loss): at least 95% of the median step is
    named; each step's window lies within the wall clock read around it; the host syncs per step are those a
    listener of the test's own heard; h2d / d2h / NVMe bytes per step are the byte model's."""
    monkeypatch.setattr(chart, "draw_timeline", lambda *args: False)  # (the PNG at close: tested elsewhere)
    recipe = Recipe(steps=4, accum=1)
    cfg = recipe.config(params=placement[0], grads=placement[1], optimizer=placement[2])
    cfg |= {"nvme": {"paths": [str(tmp_path)]}, "profile": {"enabled": True, "trace_dir": str(tmp_path / "trace")},
            "overlap": {"optimizer_with_backward": False}}
    heard = []
    stop = listen_host_syncs(lambda thread, why: heard.append((time.perf_counter(), f"{why} ({thread})")))
    clock = []  # the test's wall clock, read before each step's first forward and after the last step
    try:
        with infinity.initialize(recipe.build(), cfg) as engine:
            for (x, y), in recipe.batches():
                clock.append(time.perf_counter())
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                loss.item()  # a user's log
            clock.append(time.perf_counter())
            engine.synchronize()
            predicted, first = (bytes_per_step(engine.plan, grad_accum_steps=1, first_step=first, cuda=False,
                                               kept=engine.kept_params) for first in (False, True))
    finally:
        stop()
    summary = engine.profiler.summary()
    thread = f"({threading.current_thread().name})"
    steps, median = summary["steps"], summary["median"]
    assert len(steps) == recipe.steps
    marks = engine.profiler.steps()
    for i, mark in enumerate(marks):
        assert clock[i] <= mark.begin and clock[i + 1] <= mark.end  # the step runs from one forward to the next
        assert i == 0 or mark.begin == marks[i - 1].end
        step = steps[i]
        parts = step["parts"]
        assert (parts["compute"] + sum(parts["exposed"].values()) + sum(parts["host"].values())
                + parts["unattributed"]) == pytest.approx(step["step_s"], rel=1e-9), step
        mine = collections.Counter(why for t, why in heard if mark.begin <= t < mark.end and why.endswith(thread))
        assert {why: n for why, n in step["host_syncs_by_reason"].items() if why.endswith(thread)} == mine
        assert step["host_syncs_training"] == sum(mine.values())  # (the training thread's, counted apart)
    # (another thread's sync may fall on either side of a boundary for the two clocks: the run's total)
    inside = [why for t, why in heard if marks[0].begin <= t < marks[-1].end]
    assert sum(s["host_syncs"] for s in steps) == len(inside) > 0
    assert median["attributed"] >= 0.95, format_summary(summary)
    assert median["compute_s"] > 0 and median["host_s"] > 0 and median["parts"]["host"]["hooks"] > 0
    assert median["host_syncs_by_reason"][f"grad norm {thread}"] == 1  # Note [host syncs]: one per step
    assert "(1 on the training thread)" in format_summary(summary).splitlines()[0]
    links = median["links"]
    assert {k: links[k]["bytes"] for k in ("h2d", "d2h")} == {"h2d": predicted["h2d"], "d2h": predicted["d2h"]}
    assert {k: links[k]["predicted_bytes"] for k in predicted if k in links} == {
        k: v for k, v in predicted.items() if k in links}
    if placement[0] == "nvme":  # a write submitted after its copy may start in the next step: the run's total
        for link in ("nvme_read", "nvme_write"):
            expected = first[link] + (recipe.steps - 1) * predicted[link]
            assert sum(s["links"][link]["bytes"] for s in steps) == expected > 0
        assert median["parts"]["exposed"].get("cpu_optimizer", 0.0) > 0  # the update on the training thread


def test_the_updates_copy_to_the_device_is_a_span_with_its_bytes(monkeypatch, tmp_path):
    """The parameters an update writes back to a device tier cross h2d (5.25 GB per step on the GPU run showed
    as 0 bytes): the copy is a span whose bytes are the ones the manager counts. The device is faked by `meta`,
    the streams by a CUDA-looking stand-in, so the manager takes its GPU path."""
    monkeypatch.setattr(engine_module, "resolve",
                        lambda group=None: dataclasses.replace(resolve(group), device=torch.device("meta")))
    recipe = Recipe()
    cfg = recipe.config(params="device", grads="host", optimizer="host")
    cfg["profile"] = {"enabled": True, "trace_dir": str(tmp_path)}
    with infinity.initialize(recipe.build(), cfg) as engine:
        manager = engine.manager
        manager.streams = _CudaLooking(manager.streams)
        unit = engine.units[1]
        resident = manager.resident(unit.index, Kind.PARAMS)
        assert manager.tier(unit.index, Kind.PARAMS).value == "device" and resident.device.type == "meta"
        before = manager.bytes_moved["h2d"]
        engine.profiler.clear()
        manager.store(unit.index, Kind.PARAMS, None, torch.zeros(resident.numel(), dtype=resident.dtype),
                      release=False)  # what an update on the host writes back (Note [traffic per step])
        spans = [s for s in engine.profiler.spans() if s.link is Link.H2D]
        assert sum(s.num_bytes for s in spans) == manager.bytes_moved["h2d"] - before == resident.nbytes > 0


class _CudaLooking:
    """The manager's streams as on a GPU (`is_cuda`), doing nothing."""

    is_cuda = True

    def __init__(self, streams):
        self._streams = streams

    def __getattr__(self, name):
        return getattr(self._streams, name)


def test_a_skipped_step_is_a_step_of_the_profile_numbered_as_the_callers(tmp_path):
    """The profile numbers steps as the caller counts them (metrics.jsonl: every window, its update applied or
    skipped), not by applied updates: a skipped non-finite step is its own profile step, and the steps after
    it keep their numbers, through a checkpoint's save and load too."""
    import math
    recipe = Recipe(steps=4, accum=1)
    config = recipe.config() | {"train": {"grad_accum_steps": 1, "on_nonfinite": "skip"},
                                "profile": {"enabled": True}}
    applied = []
    with infinity.initialize(recipe.build(), config) as engine:
        for i, ((x, y),) in enumerate(recipe.batches()[:3]):
            loss = engine(x, y)
            engine.backward(loss * math.nan if i == 1 else loss)
            applied.append(engine.step())
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        profiled = [mark.step for mark in engine.profiler.steps()]
    assert applied == [True, False, True] and profiled == [1, 2]  # (step 3 ends when the next begins)
    with infinity.initialize(recipe.build(), config) as engine:
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        for (x, y), in recipe.batches()[3:]:
            engine.backward(engine(x, y))
            engine.step()
        engine.clock.close()
        assert [mark.step for mark in engine.profiler.steps()] == [4] and engine.optimizer_steps == 3
