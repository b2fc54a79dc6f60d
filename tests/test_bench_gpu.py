"""benchmarks/bench_gpu.py runs end to end (tiny model, on the CPU here): its cases and their keys."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


def test_bench_gpu_tiny_runs_and_reports_each_case(tmp_path):
    import bench_gpu
    out = bench_gpu.main(["--tiny", "--device", "cpu", "--json", str(tmp_path / "gpu.json")])
    assert (tmp_path / "gpu.json").exists()
    for case in ("a", "b"):
        assert out[case]["step_s"] > 0 and out[case]["tflops"] > 0
        assert out[case]["ratio"] == out[case]["step_s"] / max(out[case]["floors"].values())
    assert set(out["b"]["floors"]) == {"gpu_compute", "cpu_adam", "pcie"}
