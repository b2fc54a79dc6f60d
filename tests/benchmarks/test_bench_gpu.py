"""benchmarks/bench_gpu.py runs end to end (tiny model, on the CPU here): its cases and their keys."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_bench_gpu_tiny_runs_and_reports_each_case(tmp_path):
    import bench_gpu
    out = bench_gpu.main(["--tiny", "--device", "cpu", "--cases", "a,b,l", "--json", str(tmp_path / "gpu.json")])
    assert (tmp_path / "gpu.json").exists()
    for case in ("a", "b", "l"):
        assert out[case]["step_s"] > 0
    assert out["a"]["ratio"] == out["a"]["step_s"] / max(out["a"]["floors"].values())
    # case b: the ratio is the back-to-back step's (what a loop sees), beside the synchronized one
    assert out["b"]["ratio"] == out["b"]["steady_s"] / max(out["b"]["floors"].values())
    assert out["b"]["ratio_synchronized"] == out["b"]["step_s"] / max(out["b"]["floors"].values())
    assert set(out["b"]["floors"]) == {"gpu_compute", "cpu_adam", "pcie"}
    assert out["b"]["b_clip"]["clip_over_no_clip"] == out["b"]["b_clip"]["steady_s"] / out["b"]["steady_s"]
    llama = out["l"]  # the Llama case: torch all on the device vs the offload shape, without and with clipping
    assert llama["speed"] == llama["torch_steady_s"] / llama["no_clip"]["steady_s"]
    assert llama["clip_over_no_clip"] == llama["clip"]["steady_s"] / llama["no_clip"]["steady_s"]
    # what the planner kept on the device, per run (no GPU here: no tail units, no lane)
    assert {k: llama["clip_lane"][k] for k in ("tail_units", "lane_units", "lane_grads")} == dict.fromkeys(
        ("tail_units", "lane_units", "lane_grads"), 0)


def test_a_failing_diagnostic_run_is_recorded_and_the_case_goes_on(capsys):
    import bench_gpu

    def failing():
        raise RuntimeError("the lane broke")
    assert bench_gpu.diagnostic("b", "clip_lane", failing) == {"error": "RuntimeError('the lane broke')"}
    assert "the lane broke" in capsys.readouterr().err  # (its traceback, in the bench log)
    with pytest.raises(RuntimeError):
        bench_gpu.diagnostic("b", "clip", failing)  # the bars' own runs are not diagnostics
    assert bench_gpu.ratios({"clip_lane": {"error": "x"}, "bound": {"steady_s": 2.0}}, 1.0) == {"bound_over_auto": 2.0}


def test_bench_gpu_tiny_case_c_counts_the_disk(tmp_path):
    """Case c runs both shapes with the disk among the floors, its bytes from the byte model (nonzero: the
    optimizer state, and in c2 the parameters, live on the disk)."""
    import bench_gpu
    out = bench_gpu.main(["--tiny", "--device", "cpu", "--cases", "c", "--dir", str(tmp_path),
                          "--profile", str(tmp_path / "e")])
    for name in ("c1", "c2"):  # case e: each profiled run leaves its trace, summary and timeline
        files = set(os.listdir(tmp_path / "e" / f"case_{name}" / "rank0"))
        assert {"trace.json", "summary.json", "timeline.png"} <= files
    for name in ("c1", "c2"):
        case = out["c"][name]
        assert set(case["floors"]) == {"gpu_compute", "cpu_adam", "pcie", "disk"}
        assert case["floors"]["disk"] > 0 and case["nvme_bytes"]["nvme_write"] > 0
        assert case["ratio"] == case["step_s"] / max(case["floors"].values())
    assert out["c"]["c2"]["nvme_bytes"]["nvme_read"] > out["c"]["c1"]["nvme_bytes"]["nvme_read"]  # parameters too


@pytest.mark.slow
def test_bench_gpu_tiny_case_d_runs_deepspeed(tmp_path):
    """Case d: DeepSpeed ZeRO-3 with the optimizer on the CPU in a child process (a benchmark extra: skipped
    where deepspeed is not installed; slow, its cpu_adam op compiles on first use)."""
    pytest.importorskip("deepspeed")
    import bench_gpu
    out = bench_gpu.main(["--tiny", "--device", "cpu", "--cases", "d"])
    d = out["d"]
    assert d["deepspeed_step_s"] > 0 and d["ratio"] == d["step_s"] / d["deepspeed_step_s"]


def test_a_count_of_tail_units_reaches_cases_b_and_l():
    """--tail-units stands for a device that holds no more than that count (the memory-bound tail a lease
    measures: docs/benchmarks.md); a count is taken without a GPU too (Note [tail units])."""
    import bench_gpu
    out = bench_gpu.main(["--tiny", "--device", "cpu", "--cases", "b,l", "--runs", "no_clip,clip",
                          "--tail-units", "1"])
    assert out["b"]["runs"]["no_clip"]["tail_units"] == out["l"]["no_clip"]["tail_units"] == 1
    assert out["b"]["b_clip"]["tail_units"] == out["l"]["clip"]["tail_units"] == 1
