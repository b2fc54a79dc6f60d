"""benchmarks/bench_step.py's `--world N` (torchrun workers) and ZeRO stages (`@S`, `--zero-stage`).

No timing is asserted: the flags reach the engine config, a world-2 run reports every rank, and the
stage comparison is the ratio of the steps it reports.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import infinity

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_step  # noqa: E402
import step_floors  # noqa: E402
import step_systems  # noqa: E402

TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--vocab", "256", "--seq", "16", "--batch", "1"]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path / "cache"))  # the workers inherit it


def test_stage_reaches_the_engine_config(tmp_path):
    args = bench_step.parser().parse_args(["--dir", str(tmp_path), "--zero-stage", "1"])
    stage = lambda placement: infinity.Config.from_dict(  # noqa: E731
        step_systems.infinity_config(args, placement, str(tmp_path))).zero.stage
    assert stage("host/host/host") == 1  # --zero-stage
    assert stage("host/host/host@2") == 2  # the system's own suffix wins
    assert stage("auto@0") == 0
    args = bench_step.parser().parse_args(["--dir", str(tmp_path)])
    assert stage("device/host/host") == infinity.Config().zero.stage  # neither: the engine's default


def test_stage_ratios():
    results = {"infinity:a@2": {"step_s": 1.0}, "infinity:a@3": {"step_s": 2.0}, "deepspeed:cpu_opt@2": {"step_s": 1.2},
               "fsdp2:cpu_both": {"step_s": 4.0}, "infinity:b@2": {"error": "x"}}
    r = step_floors.stage_ratios(results)
    assert r["infinity:a@2 / infinity:a@3"] == {"step_ratio": 0.5, "bar": "< 1.0", "met": True}
    assert r["infinity:a@2 / deepspeed:cpu_opt@2"] == {"step_ratio": 0.833, "bar": "<= 0.8", "met": False}
    assert r["infinity:a@2 / fsdp2:cpu_both"] == {"step_ratio": 0.25}
    assert len(r) == 3


@pytest.mark.slow  # ~20 s: a torchrun benchmark run
def test_world_two_runs_every_rank(tmp_path):
    argv = ["--dir", str(tmp_path / "disk"), "--world", "2", "--steps", "2", "--warmup", "1",
            "--io-bytes", str(1 << 20), "--io-sustained-bytes", "0", "--paired-blocks", "2",
            "--systems", "infinity:nvme/host/nvme@2,fsdp2:cpu_opt", "--timeout", "300"] + TINY
    payload = bench_step.main(argv)
    assert payload["world"] == 2 and payload["threads"] == 1
    for name in ("infinity:nvme/host/nvme@2",):
        r = payload["results"][name]
        assert "error" not in r, (name, r)
        assert len(r["step_times"]) == 2 and len(r["peak_rss_GiB_per_rank"]) == 2, r
        assert all(s > 0 for s in r["step_s_per_rank"])
    error = payload["results"]["fsdp2:cpu_opt"]["error"]  # the worker's own exception, not torchrun's summary
    assert "ValueError: FSDP2 shards everything" in error, error
    assert "paired:nvme/host/nvme@2" not in payload["results"]  # the paired floor runs one process only
    assert payload["stage_ratios"] == {}  # nothing to compare the @2 system with (no @3 twin, DeepSpeed or FSDP2)
