"""benchmarks/bench_step.py's floors and disk counters, checked against their formulas.

No timing is asserted: the inputs are made-up samples and counter snapshots, and the
outputs are compared with the arithmetic the docstrings state.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_step  # noqa: E402
import step_floors  # noqa: E402
from common import DiskCounters  # noqa: E402


def counters_for(tmp_path) -> DiskCounters:
    disk = DiskCounters(str(tmp_path))
    if disk.stat_file is None:
        disk.device = "fake"  # between() needs only the two snapshots
    return disk


def test_disk_counters_between_follows_the_kernel_stat_fields(tmp_path):
    disk = counters_for(tmp_path)
    # fields: reads, merges, sectors read, ms reading, writes, merges, sectors written, ms writing,
    # in flight, io_ticks (ms busy), time_in_queue (ms x requests)
    a = (10.0, [100, 0, 1_000, 5, 200, 0, 2_000, 7, 0, 1_000, 4_000])
    b = (12.0, [900, 0, 1_000 + 4_000_000, 9, 700, 0, 2_000 + 6_000_000, 9, 3, 2_800, 4_000 + 24_000])
    d = disk.between(a, b)
    assert d["wall_s"] == 2.0
    assert d["busy_fraction"] == pytest.approx(1.8 / 2.0)
    assert d["read_GB"] == pytest.approx(4_000_000 * 512 / 1e9, abs=1e-3)
    assert d["write_GB"] == pytest.approx(6_000_000 * 512 / 1e9, abs=1e-3)
    assert d["read_GBps"] == pytest.approx(4_000_000 * 512 / 1e9 / 2, abs=1e-3)
    assert d["write_GBps"] == pytest.approx(6_000_000 * 512 / 1e9 / 2, abs=1e-3)
    assert d["mean_in_flight"] == pytest.approx(12.0)


def test_disk_counters_say_why_there_are_none(tmp_path):
    disk = counters_for(tmp_path)
    disk.stat_file, disk.reason = None, "no block device counters for X"
    assert disk.snapshot() is None
    assert disk.between(None, None) == {"error": "no block device counters for X"}


def test_disk_counters_read_this_machines_device_when_it_has_one(tmp_path):
    disk = DiskCounters(str(tmp_path))
    if disk.stat_file is None:
        assert "does not exist" in disk.reason
        return
    a = disk.snapshot()
    with open(tmp_path / "f.bin", "wb") as f:
        f.write(os.urandom(4 << 20))
        os.fsync(f.fileno())  # the 4 MiB reach the device, whatever else it did meanwhile
    d = disk.between(a, disk.snapshot())
    assert (
        d["write_GB"] >= 0.004 and d["busy_fraction"] >= 0 and d["device"]
    )  # io_ticks may round a short write to 0 ms


def results_with(step_s: float, compute_s: float, samples: list[dict]) -> dict:
    moved = {"nvme_read": 4_000_000_000, "nvme_write": 5_000_000_000}
    return {"io": step_floors.io_median(samples),
            "infinity:device/device/device": {"step_s": compute_s},
            "infinity:nvme/host/nvme": {"step_s": step_s, "bytes_moved_per_step": moved,
                                        "disk": {"busy_fraction": 0.97}}}


def test_floors_use_the_burst_median_and_report_the_sustained_floor_beside_it():
    samples = [{"read_GBps": 2.0, "write_GBps": 2.5, "sustained_read_GBps": 1.6, "sustained_write_GBps": 2.0},
               {"read_GBps": 4.0, "write_GBps": 5.0, "sustained_read_GBps": 2.0, "sustained_write_GBps": 2.5},
               {"read_GBps": 1.0, "write_GBps": 1.25, "sustained_read_GBps": 1.0, "sustained_write_GBps": 1.25}]
    floors = step_floors.floors_of(results_with(step_s=5.5, compute_s=2.0, samples=samples))["infinity:nvme/host/nvme"]
    burst = 4.0 / 2.0 + 5.0 / 2.5  # the medians: 2.0 and 2.5 GB/s
    assert floors["io_floor_s"] == pytest.approx(burst, abs=1e-3)
    assert floors["step_over_floor"] == pytest.approx(5.5 / burst, abs=1e-3)
    assert floors["io_floor_first_sample_s"] == pytest.approx(burst, abs=1e-3)
    sustained = 4.0 / 1.6 + 5.0 / 2.0
    assert floors["io_floor_sustained_s"] == pytest.approx(sustained, abs=1e-3)
    assert floors["step_over_sustained_floor"] == pytest.approx(5.5 / sustained, abs=1e-3)
    assert floors["disk_busy_fraction"] == 0.97


def test_floors_take_the_compute_floor_when_it_is_the_larger():
    samples = [{"read_GBps": 40.0, "write_GBps": 50.0}]  # no sustained sample (--io-sustained-bytes 0)
    floors = step_floors.floors_of(results_with(step_s=3.0, compute_s=2.5, samples=samples))["infinity:nvme/host/nvme"]
    assert floors["io_floor_s"] == pytest.approx(0.2, abs=1e-3)
    assert floors["step_over_floor"] == pytest.approx(3.0 / 2.5, abs=1e-3)
    assert "io_floor_sustained_s" not in floors


def test_io_sample_measures_burst_and_sustained_rates(tmp_path):
    args = bench_step.parser().parse_args(["--dir", str(tmp_path), "--io-bytes", str(1 << 20),
                                           "--io-sustained-bytes", str(3 << 20)])
    out = step_floors.run_io_floor(args)
    assert set(out) == {"read_GBps", "write_GBps", "sustained_read_GBps", "sustained_write_GBps"}
    assert all(v > 0 for v in out.values())
    assert not [f for f in os.listdir(tmp_path) if f.startswith("bench-io-")]  # the sample's file is removed


def test_paired_floor_puts_each_step_over_the_mean_floor_of_the_samples_around_it():
    samples = [{"read_GBps": 2.0, "write_GBps": 2.5}, {"read_GBps": 1.0, "write_GBps": 1.25},
               {"read_GBps": 4.0, "write_GBps": 5.0}, {"read_GBps": 2.0, "write_GBps": 2.5}]
    steps = [{"step_s": 4.5}, {"step_s": 9.0}, {"step_s": 2.2}]
    results = results_with(step_s=5.5, compute_s=2.0, samples=[samples[0]])
    results["paired:nvme/host/nvme"] = {"samples": samples, "steps": steps}
    paired = step_floors.floors_of(results)["infinity:nvme/host/nvme"]["paired"]
    floor = [4.0 / r["read_GBps"] + 5.0 / r["write_GBps"] for r in samples]  # 4, 8, 2, 4 s
    io_floors = [(floor[i] + floor[i + 1]) / 2 for i in range(3)]  # 6, 5, 3 s
    ratios = [s["step_s"] / max(2.0, f) for s, f in zip(steps, io_floors)]  # 0.75, 1.8, 0.733
    assert paired["io_floors_s"] == pytest.approx(io_floors, abs=1e-3)
    assert paired["ratios"] == pytest.approx(ratios, abs=1e-3)
    assert paired["step_over_floor"] == pytest.approx(sorted(ratios)[1], abs=1e-3)
    assert paired["step_s"] == 4.5 and paired["io_floor_s"] == pytest.approx(5.0, abs=1e-3)
    # with a compute floor above every I/O floor, the compute floor is the yardstick
    results["infinity:device/device/device"]["step_s"] = 10.0
    paired = step_floors.floors_of(results)["infinity:nvme/host/nvme"]["paired"]
    assert paired["ratios"] == pytest.approx([0.45, 0.9, 0.22], abs=1e-3)


def test_paired_floor_is_absent_without_the_run_and_says_why_it_failed():
    results = results_with(step_s=5.5, compute_s=2.0, samples=[{"read_GBps": 2.0, "write_GBps": 2.5}])
    assert "paired" not in step_floors.floors_of(results)["infinity:nvme/host/nvme"]
    results["paired:nvme/host/nvme"] = {"error": "exit 1: boom"}
    assert step_floors.floors_of(results)["infinity:nvme/host/nvme"]["paired"] == {"error": "exit 1: boom"}


@pytest.mark.slow  # ~20 s: a benchmark run
def test_driver_brackets_each_paired_step_with_samples(tmp_path, monkeypatch):
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path / "cache"))  # the workers inherit it
    argv = ["--dir", str(tmp_path / "disk"), "--steps", "1", "--warmup", "1", "--io-bytes", str(1 << 20),
            "--io-sustained-bytes", "0", "--paired-blocks", "2", "--layers", "2", "--d-model", "64",
            "--heads", "2", "--vocab", "256", "--seq", "32", "--timeout", "300",
            "--systems", "infinity:device/device/device,infinity:nvme/host/nvme"]
    payload = bench_step.main(argv)
    run = payload["results"]["paired:nvme/host/nvme"]
    assert len(run["samples"]) == 3 and len(run["steps"]) == 2, run
    assert all(s["read_GBps"] > 0 and s["write_GBps"] > 0 for s in run["samples"])
    assert run["bytes_moved_per_step"] == payload["results"]["infinity:nvme/host/nvme"]["bytes_moved_per_step"]
    moved, compute = run["bytes_moved_per_step"], payload["results"]["infinity:device/device/device"]["step_s"]
    floor = [moved["nvme_read"] / 1e9 / s["read_GBps"] + moved["nvme_write"] / 1e9 / s["write_GBps"]
             for s in run["samples"]]
    expected = [st["step_s"] / max(compute, (floor[i] + floor[i + 1]) / 2) for i, st in enumerate(run["steps"])]
    assert payload["floors"]["infinity:nvme/host/nvme"]["paired"]["ratios"] == pytest.approx(expected, rel=1e-2)
    prefixes = ("bench-io-", "bench-paired-", "bench-step-")
    leftovers = [f for f in os.listdir(tmp_path / "disk") if f.startswith(prefixes)]
    assert not leftovers  # swap directories and sample files are removed
