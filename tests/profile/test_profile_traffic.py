"""The profile's per-link bytes are exactly what the plan predicts per step; a profiled run writes
a Chrome trace, a summary and a chart."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

import infinity
from infinity.memory.traffic import bytes_per_step, plan_traffic
from infinity.profile import Link, SpanKind
from reference import Recipe

PLACEMENTS = [
    ("nvme", "host", "nvme"),
    ("nvme", "nvme", "nvme"),
    ("device", "nvme", "host"),
    ("host", "device", "nvme"),
]


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
@pytest.mark.parametrize("placement", PLACEMENTS, ids="-".join)
def test_profiled_bytes_equal_the_plan(placement, overlap, tmp_path):
    _check_profiled_bytes(placement, overlap, tmp_path)


def test_profiled_bytes_equal_the_plan_with_bf16_state(tmp_path):
    """The read-ahead's unused bytes count each kind at its stored width (2 bytes for bf16 moments)."""
    _check_profiled_bytes(("nvme", "host", "nvme"), True, tmp_path, state_dtype="bf16")


def _check_profiled_bytes(placement, overlap, tmp_path, state_dtype="fp32"):
    recipe = Recipe(steps=3, accum=2)
    cfg = recipe.config(params=placement[0], grads=placement[1], optimizer=placement[2])
    cfg.setdefault("optimizer", {})["state_dtype"] = state_dtype
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
    read_ahead = engine.updates.optimizer.state_read_ahead
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


def test_a_long_run_profiles_its_latest_steps_and_writes_them_again(tmp_path):
    """[profile] keep_steps = 2: each write holds the latest two steps, and a write after more steps rewrites
    it though the profiler still holds two (Note [profile window]; planted: write_profile comparing
    len(steps()) with the steps written; the second write is skipped; fails)."""
    recipe = Recipe(steps=7, accum=1)
    cfg = recipe.config(params="host", grads="host", optimizer="host")
    cfg["profile"] = {"enabled": True, "trace_dir": str(tmp_path / "trace"), "keep_steps": 2}
    engine = infinity.initialize(recipe.build(), cfg)
    written = []
    for i, ((x, y),) in enumerate(recipe.batches()):
        engine.backward(engine(x, y))
        engine.step()
        if i in (2, 6):
            engine.write_profile()
            written.append([s["step"] for s in json.load(open(engine.profile_files["summary"]))["steps"]])
    engine.close()
    assert engine.profiler.completed_steps == 7
    assert written[0] == [2, 3] and written[1] == [6, 7], written


def test_profile_peaks_are_the_measured_link_rates(tmp_path, monkeypatch):
    """With link rates measured for this machine and swap disk (`infinity bench-links`), the summary
    gives each link's peak and achieved / peak; with none measured, no peak is made up."""
    from infinity.machine import link_rates
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


# ---------------------------------------------------------------- the CUDA-shaped case, devices faked

GPU, CPU = torch.device("cuda", 0), torch.device("cpu")  # only compared, never allocated on


def _events(tiers: dict[str, str], *, accum: int, is_root: bool) -> list[tuple[str, str, torch.device, torch.device]]:
    """Every transfer one optimizer step makes, as the engine issues them: (kind, what, from, to). A shard
    on NVMe is staged through host memory; the optimizer runs on the GPU when its state is on the device."""
    where = {"device": GPU, "host": CPU, "nvme": CPU}
    opt_at = GPU if tiers["optimizer"] == "device" else CPU
    out = []
    for micro in range(accum):
        for _ in range(1 if is_root else 2):  # forward, and again before backward
            out.append(("params", "read" if tiers["params"] == "nvme" else "", where[tiers["params"]], GPU))
        if micro > 0:  # the sum so far, to add this micro-batch's gradient to
            out.append(("grads", "read" if tiers["grads"] == "nvme" else "", where[tiers["grads"]], GPU))
        out.append(("grads", "write" if tiers["grads"] == "nvme" else "", GPU, where[tiers["grads"]]))
    for kind in ("master", "exp_avg", "exp_avg_sq"):  # steady state: all three read and written back
        out.append((kind, "read" if tiers["optimizer"] == "nvme" else "", where[tiers["optimizer"]], opt_at))
    out.append(("grads", "read" if tiers["grads"] == "nvme" else "", where[tiers["grads"]], opt_at))
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        out.append((kind, "write" if tiers["optimizer"] == "nvme" else "", opt_at, where[tiers["optimizer"]]))
    # a host master goes up to device parameters as it is (fp32), cast there (Note [async upload])
    new_params = "master" if (tiers["params"], tiers["optimizer"]) == ("device", "host") else "params"
    out.append((new_params, "write" if tiers["params"] == "nvme" else "", opt_at, where[tiers["params"]]))
    return out


@pytest.mark.parametrize("accum", [1, 3])
def test_cuda_traffic_is_every_crossing_the_manager_counts(accum):
    """With a GPU (faked: only the arithmetic), the byte model's h2d / d2h / NVMe bytes per step are the
    sum over every transfer the engine makes, each counted the way the manager counts it (`shards.crossing`:
    a copy between host memory and the GPU, whichever tier asked for it), for all 27 placements, root and
    not. Nothing is kept (no fresh copies) and parameters are bf16, so none alias the master."""
    from infinity.memory.plan import Plan, UnitSizes
    from infinity.memory.shards import crossing
    from infinity.memory.tier import Kind, Tier
    n, csize = 1000, 2
    nbytes = {"params": n * csize, "grads": n * 4, "master": n * 4, "exp_avg": n * 4, "exp_avg_sq": n * 4}
    for combo in itertools.product(("device", "host", "nvme"), repeat=3):
        tiers = dict(zip(("params", "grads", "optimizer"), combo))
        unit_tiers = {k: Tier(tiers[k.group]) for k in Kind}
        units = tuple(UnitSizes.uniform(f"u{i}", n, n, chunk_numels=(n,)) for i in range(2))
        plan = Plan(tiers=(unit_tiers, unit_tiers), units=units, compute_dtype=torch.bfloat16)
        expected = {"nvme_read": 0, "nvme_write": 0, "h2d": 0, "d2h": 0}
        for is_root in (True, False):
            for kind, disk, src, dst in _events(tiers, accum=accum, is_root=is_root):
                link = crossing(src, dst)
                if link is not None:
                    expected[link] += nbytes[kind]
                if disk:
                    expected[f"nvme_{disk}"] += nbytes[kind]
        got = bytes_per_step(plan, grad_accum_steps=accum, first_step=False, cuda=True)
        assert got == expected, f"placement {combo}"
        assert got == plan_traffic(plan, cuda=True, accum=accum, kept=frozenset()).total(), f"placement {combo}"


def test_the_manager_counts_copies_into_resident_tiers():
    """A store of a host tensor into a device-resident shard (new parameters from a CPU optimizer) is an
    h2d, a GPU tensor into a host-resident shard a d2h; copies within one memory cross no link. The
    device is faked by the meta device (copies into it move no data; the counting is what is checked).
    Before the manager counted them, the h2d here stayed 0."""
    from infinity.device.streams import Streams
    from infinity.memory.manager import TieredMemoryManager
    from infinity.memory.plan import Plan, UnitSizes
    from infinity.memory.shards import crossing
    from infinity.memory.tier import Kind, Tier
    assert crossing(GPU, CPU) == "d2h" and crossing(CPU, GPU) == "h2d"
    assert crossing(CPU, CPU) is None and crossing(GPU, torch.device("cuda", 0)) is None
    units = (UnitSizes.uniform("u0", 8, 8, chunk_numels=(8,)),)
    tiers = {k: Tier.HOST for k in Kind} | {Kind.PARAMS: Tier.DEVICE}
    plan = Plan(tiers=(tiers,), units=units, compute_dtype=torch.bfloat16)
    manager = TieredMemoryManager(plan, torch.device("meta"), Streams.for_device(CPU), None, pin_host=False)
    for kind in Kind:
        manager.allocate(0, kind)
    manager.store_master(0, None, torch.ones(8))  # the CPU optimizer's new master, and parameters to the device
    assert manager.bytes_moved == {"nvme_read": 0, "nvme_write": 0, "h2d": 8 * 2, "d2h": 0}
