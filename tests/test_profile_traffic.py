"""The profile's per-link bytes are exactly what the plan predicts per step; a profiled run writes
a Chrome trace, a summary and a chart."""

from __future__ import annotations

import json

import pytest
import torch

import infinity
from infinity.memory.traffic import bytes_per_step
from infinity.profile import Link, SpanKind
from reference import Recipe

PLACEMENTS = [("nvme", "host", "nvme"), ("nvme", "nvme", "nvme"), ("device", "nvme", "host"), ("host", "device", "nvme")]


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
@pytest.mark.parametrize("placement", PLACEMENTS, ids="-".join)
def test_profiled_bytes_equal_the_plan(placement, overlap, tmp_path):
    recipe = Recipe(steps=3, accum=2)
    cfg = recipe.config(params=placement[0], grads=placement[1], optimizer=placement[2])
    cfg["nvme"] = {"paths": [str(tmp_path)]}
    cfg["profile"] = {"enabled": True, "trace_dir": str(tmp_path / "trace")}
    cfg["overlap"] = {"optimizer_with_backward": overlap}
    engine = infinity.initialize(recipe.build(), cfg)
    engine.profiler.clear()  # initialization's writes are not a step's
    for micro in recipe.batches():
        for x, y in micro:
            engine.backward(engine(x, y))
        engine.step()
    engine.close()
    recorded = {}
    for span in engine.profiler.spans():
        if span.kind is SpanKind.WORK and span.link in (Link.NVME_READ, Link.NVME_WRITE):
            recorded[span.link.value] = recorded.get(span.link.value, 0) + span.num_bytes
    predicted = {"nvme_read": 0, "nvme_write": 0}
    for step in range(recipe.steps):
        per = bytes_per_step(engine.plan, grad_accum_steps=recipe.accum, first_step=step == 0, cuda=False,
                             kept=engine.kept_params)
        for link in predicted:
            predicted[link] += per[link]
    # with overlap the worker reads the next update's state ahead (Note [state read-ahead]); after the
    # last step that read is never used, and is all the traffic beyond the plan's
    read_ahead = engine.optimizer.state_read_ahead
    assert (read_ahead is not None) == (overlap and placement[2] == "nvme")
    unused = read_ahead.unused_disk_bytes if read_ahead else 0
    assert read_ahead is None or read_ahead.stale == 0
    assert {k: recorded.get(k, 0) for k in predicted} == {**predicted, "nvme_read": predicted["nvme_read"] + unused}
    assert predicted["nvme_read"] > 0 and predicted["nvme_write"] > 0


@pytest.mark.parametrize("dtype,written_per_element", [("fp32", 12), ("bf16", 14)])
def test_fp32_parameters_on_nvme_are_the_masters_write(dtype, written_per_element, tmp_path):
    """Note [aliased parameters]: with parameters and optimizer on NVMe, an update writes the master and
    both moments (12 bytes per element); fp32 parameters are the master's bytes, bf16 ones are written too
    (2 more). The fp32 parameters take no swap space (that training is exact: test_engine_parity)."""
    recipe = Recipe(steps=2, accum=1)
    cfg = recipe.config(params="nvme", grads="host", optimizer="nvme")
    cfg["nvme"] = {"paths": [str(tmp_path)]}
    cfg["precision"] = {"compute_dtype": dtype}
    cfg["prefetch"] = {"keep_written": False}  # every parameter fetch reads the disk
    with infinity.initialize(recipe.build(), cfg) as engine:
        elements = sum(u.shard_numel for u in engine.units)
        state = engine.memory_report()["state"]["nvme"]
        assert state["params"] == (0 if dtype == "fp32" else elements * 2)
        for micro in recipe.batches():
            before = dict(engine.manager.bytes_moved)
            for x, y in micro:
                engine.backward(engine(x, y))
            engine.step()
            engine.synchronize()
            moved = {k: v - before[k] for k, v in engine.manager.bytes_moved.items()}
            assert moved["nvme_write"] == elements * written_per_element


def test_profile_outputs(tmp_path):
    recipe = Recipe(steps=3, accum=1)
    cfg = recipe.config(params="nvme", grads="host", optimizer="nvme")
    cfg["nvme"] = {"paths": [str(tmp_path)]}
    cfg["profile"] = {"enabled": True, "trace_dir": str(tmp_path / "trace")}
    engine = infinity.initialize(recipe.build(), cfg)
    for (x, y), in recipe.batches():
        engine.backward(engine(x, y))
        engine.step()
    engine.close()
    files = engine.profile_files
    trace = json.load(open(files["trace"]))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    lanes = {e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    assert {"compute", "nvme_read", "nvme_write", "cpu_optimizer"} <= lanes
    summary = json.load(open(files["summary"]))
    assert summary["num_steps"] == 3
    median = summary["median"]
    assert 0 < median["overlap_efficiency"] <= 1 and median["compute_s"] <= median["step_s"]
    assert median["links"]["nvme_read"]["bytes"] > 0
    if "timeline" in files:
        assert open(files["timeline"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_profile_peaks_are_the_measured_link_rates(tmp_path, monkeypatch):
    """With link rates measured for this machine and swap disk (`infinity bench-links`), the summary
    gives each link's peak and achieved / peak; with none measured, no peak is made up."""
    from infinity import link_rates
    from infinity.memory import cost_model
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path / "cache"))
    recipe = Recipe(steps=2, accum=1)
    cfg = recipe.config(params="nvme", grads="host", optimizer="nvme")
    cfg["nvme"] = {"paths": [str(tmp_path)]}
    cfg["profile"] = {"enabled": True, "trace_dir": str(tmp_path / "trace")}

    def median_links():
        engine = infinity.initialize(recipe.build(), cfg)
        for (x, y), in recipe.batches():
            engine.backward(engine(x, y))
            engine.step()
        engine.close()
        return json.load(open(engine.profile_files["summary"]))["median"]["links"]

    links = median_links()
    assert links["nvme_read"]["peak_GBps"] is None and links["nvme_read"]["fraction_of_peak"] is None

    rates = cost_model.LinkRates(nvme_read=2.5e9, nvme_write=3.25e9, cpu_adam=1.5e9, device_adam=1.5e9,
                                 matmul_flops=1e11, source="measured in this test")
    link_rates.store_rates(str(tmp_path), torch.device("cpu"), rates)
    links = median_links()
    expected = {"nvme_read": 2.5, "nvme_write": 3.25, "cpu_optimizer": 1.5 * 16}
    for name, peak in expected.items():
        assert links[name]["peak_GBps"] == pytest.approx(peak)
        assert links[name]["fraction_of_peak"] == pytest.approx(links[name]["GBps"] / peak)
