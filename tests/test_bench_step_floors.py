"""benchmarks/bench_step.py's floors and disk counters, checked against their formulas.

No timing is asserted: the inputs are made-up samples and counter snapshots, and the
outputs are compared with the arithmetic the docstrings state.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_step  # noqa: E402
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
    assert d["write_GB"] >= 0.004 and d["busy_fraction"] >= 0 and d["device"]  # io_ticks may round a short write to 0 ms


def results_with(step_s: float, compute_s: float, samples: list[dict]) -> dict:
    moved = {"nvme_read": 4_000_000_000, "nvme_write": 5_000_000_000}
    return {"io": bench_step._io_median(samples),
            "infinity:device/device/device": {"step_s": compute_s},
            "infinity:nvme/host/nvme": {"step_s": step_s, "bytes_moved_per_step": moved,
                                        "disk": {"busy_fraction": 0.97}}}


def test_floors_use_the_burst_median_and_report_the_sustained_floor_beside_it():
    samples = [{"read_GBps": 2.0, "write_GBps": 2.5, "sustained_read_GBps": 1.6, "sustained_write_GBps": 2.0},
               {"read_GBps": 4.0, "write_GBps": 5.0, "sustained_read_GBps": 2.0, "sustained_write_GBps": 2.5},
               {"read_GBps": 1.0, "write_GBps": 1.25, "sustained_read_GBps": 1.0, "sustained_write_GBps": 1.25}]
    floors = bench_step._floors(results_with(step_s=5.5, compute_s=2.0, samples=samples))["infinity:nvme/host/nvme"]
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
    floors = bench_step._floors(results_with(step_s=3.0, compute_s=2.5, samples=samples))["infinity:nvme/host/nvme"]
    assert floors["io_floor_s"] == pytest.approx(0.2, abs=1e-3)
    assert floors["step_over_floor"] == pytest.approx(3.0 / 2.5, abs=1e-3)
    assert "io_floor_sustained_s" not in floors


def test_io_sample_measures_burst_and_sustained_rates(tmp_path):
    args = bench_step.parser().parse_args(["--dir", str(tmp_path), "--io-bytes", str(1 << 20),
                                           "--io-sustained-bytes", str(3 << 20)])
    out = bench_step.run_io_floor(args)
    assert set(out) == {"read_GBps", "write_GBps", "sustained_read_GBps", "sustained_write_GBps"}
    assert all(v > 0 for v in out.values())
    assert not [f for f in os.listdir(tmp_path) if f.startswith("bench-io-")]  # the sample's file is removed
