"""benchmarks/gpu_check.sh's flow, dry-run on the CPU (tiny cases, no largest model): every part logs, the report
lists every bar and writes its JSON, the parts in the default order (what has not been measured first). Slow
(about two minutes): the check is for a GPU machine, run by hand there."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gpu_check_runs_every_part_and_reports_every_bar(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "BENCH_ARGS": "--tiny --device cpu", "LARGEST": "0"}
    subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=env, check=True, timeout=600)
    log = (tmp_path / "check.log").read_text()
    parts = ("sanitizer rc=", "case m1 rc=0", "case m2 rc=0", "case d2", "largest model skipped", "gpu tests rc=",
             "case b rc=0", "case l rc=0", "case a rc=0", "done")
    at = [log.find(part) for part in parts]
    assert -1 not in at and at == sorted(at), dict(zip(parts, at))
    (report,) = tmp_path.glob("gpu_*.json")
    payload = json.loads(report.read_text())
    assert {"device", "gpu_tests", "sanitizer_races", "cases", "bars", "elapsed_s"} <= set(payload)
    assert {"a", "b", "l", "m1", "m2"} <= set(payload["cases"]) and len(payload["bars"]) == 20
    assert {"ratio", "speed", "clip_over_no_clip", "accum4_speed"} <= set(payload["cases"]["m1"])
    assert {"ratio", "tflops", "params"} <= set(payload["cases"]["m2"])
    assert len(list(tmp_path.iterdir())) <= 8  # what the device tool brings back
