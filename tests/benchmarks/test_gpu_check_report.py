"""benchmarks/gpu_check_report.py: the GPU check's logs and case JSONs into one report, each bar measured / bar;
a part the check cut (no log line, no JSON) is not measured, never met."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_check_report  # noqa: E402


def test_pytest_counts_read_the_summary_line():
    assert gpu_check_report.pytest_counts("....\n41 passed, 1 skipped, 900 deselected in 24.1s\n") == {
        "passed": 41, "failed": 0, "skipped": 1}
    assert gpu_check_report.pytest_counts("FAILED x\n2 failed, 39 passed, 1 error in 3s") == {
        "passed": 39, "failed": 3, "skipped": 0}
    assert gpu_check_report.pytest_counts("Terminated\n") == {}


def test_the_report_measures_what_ran_and_marks_the_rest_unmeasured(tmp_path):
    (tmp_path / "env.log").write_text("device: NVIDIA H200\ntorch 2.11\n")
    (tmp_path / "gpu_tests.log").write_text("...\n52 passed, 950 deselected in 40.0s\n")
    (tmp_path / "sanitizer.log").write_text(f"{gpu_check_report.RACE} at ...\n1 failed, 51 passed in 90s\n")
    b = {"step_s": 0.5, "steady_s": 0.36, "floors": {"gpu_compute": 0.33}, "ratio": 0.36 / 0.33,
         "b_clip": {"steady_s": 0.40, "clip_over_no_clip": 0.40 / 0.36}}
    (tmp_path / "case_b.json").write_text(json.dumps({"b": b}))
    rep = gpu_check_report.report(str(tmp_path), elapsed_s=431.0)
    assert rep["device"] == "NVIDIA H200" and rep["sanitizer_races"] == 1
    assert rep["gpu_tests"] == {"passed": 52, "failed": 0, "skipped": 0}
    met = {b["what"]: b["met"] for b in rep["bars"]}
    assert met["offload floor: case b steady step / max(floors)"] is True  # 1.09 <= 1.2
    assert met["offload floor: case b with grad_clip 1.0 / without"] is False  # 1.11 > 1.1
    assert met["GPU truth: sanitizer races"] is False and met["GPU truth: gpu tests failed + skipped"] is True
    assert met["offload floor: Llama 1.12B bf16 offload shape, share of torch's speed"] is None  # case l was cut
    assert met["GPU truth: the check's seconds"] is True
    assert "not measured" in gpu_check_report.table(rep)


def test_the_memory_bound_cases_and_the_largest_model_have_their_bars(tmp_path):
    """m1 and m2 (bench_offload_bound.py), d2 against DeepSpeed's ZeRO-2, the largest model full and LoRA; the gpu
    tests' counts from the sanitizer's run when the tests did not run alone."""
    (tmp_path / "sanitizer.log").write_text("...\n60 passed in 200s\n")
    m1 = {"steady_s": 0.30, "ratio": 1.25, "speed": 0.6, "clip_over_no_clip": 1.05, "accum4_speed": 0.8,
          "accum4_lane_speed": 0.86}
    (tmp_path / "case_m1.json").write_text(json.dumps({"m1": m1}))
    (tmp_path / "case_m2.json").write_text(json.dumps({"m2": {"ratio": 1.1, "tflops": 300.0, "params": 12e9}}))
    (tmp_path / "case_d2.json").write_text(json.dumps({"d2": {"ratio": 0.4}}))
    (tmp_path / "largest.json").write_text(json.dumps({"params": 20e9, "step_s": 30.0, "lora_params": None,
                                                             "state_share": 0.7, "steps": 2, "lora_steps": None}))
    rep = gpu_check_report.report(str(tmp_path), elapsed_s=500.0)
    assert set(rep["cases"]) == {"m1", "m2", "d2"} and rep["sanitizer_races"] == 0
    met = {b["what"]: b["met"] for b in rep["bars"]}
    assert met["memory-bound: m1 (no tail units) steady step / max(floors)"] is False  # 1.25 > 1.2
    assert met["memory-bound: m1 share of torch's all-on-device speed"] is True
    assert met["memory-bound: m1 with grad_clip 1.0 / without"] is True
    assert met["memory-bound: m1 4 micro-batches accumulated, share of torch's speed"] is False  # 0.8 < 0.85
    assert met["memory-bound: m1 4 micro-batches accumulated, device lane on, share of torch's speed"] is True
    assert met["memory-bound: m2 (state over 1.2x the GPU) steady step / max(floors)"] is True
    assert met["memory-bound: m1 / DeepSpeed ZeRO-2 offload_optimizer cpu"] is True
    assert met["GPU truth: largest model trained (parameters)"] is True
    assert met["memory-bound: largest model trained with LoRA (parameters)"] is None  # (its run failed)
    assert met["GPU truth: largest model, full fine-tune steps trained in the part's time"] is False  # 2 < 3 steps
    assert met["memory-bound: largest model, LoRA steps trained in the part's time"] is None
    assert met["memory-bound: largest model trained, its state / (GPU + RAM + free disk)"] is False  # 0.7 < 0.8
    assert met["GPU truth: gpu tests failed + skipped"] is True  # 60 passed under the sanitizer
