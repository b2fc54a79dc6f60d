"""benchmarks/gpu_check.sh's flow, dry-run on the CPU (tiny cases, no largest model): every part logs, the report
lists every bar and writes its JSON. Slow (about a minute): the check is for a GPU lease, run by hand there."""

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
    for part in ("gpu tests rc=", "sanitizer rc=", "case a rc=0", "case b rc=0", "case l rc=0", "done"):
        assert part in log, part
    (report,) = tmp_path.glob("gpu_*.json")
    payload = json.loads(report.read_text())
    assert {"device", "gpu_tests", "sanitizer_races", "cases", "bars", "elapsed_s"} <= set(payload)
    assert set(payload["cases"]) == {"a", "b", "l"} and len(payload["bars"]) == 11
    assert len(list(tmp_path.iterdir())) <= 8  # what the device tool brings back
