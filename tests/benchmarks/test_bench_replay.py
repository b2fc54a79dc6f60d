"""benchmarks/bench_replay.py: the recorded requests are replayed where and as they were issued.

No timing is asserted: the replay's bytes are checked against the buffer it wrote, and a
tiny end-to-end run against its own recording.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_replay  # noqa: E402

from io_engine import IOConfig, IOEngine, aligned_empty  # noqa: E402


def test_replay_writes_each_request_at_its_offset_in_the_scratch_copy(tmp_path):
    buf = aligned_empty(3 * 4096 + 8192, torch.uint8)
    buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    data = buf.numpy().tobytes()
    files = {"/swap/a": str(tmp_path / "a"), "/swap/b": str(tmp_path / "b")}
    with IOEngine(IOConfig(block_size=4096, queue_depth=4, threads=2)) as io:
        io.submit("write", aligned_empty(4 * 4096, torch.uint8).zero_(), files["/swap/a"], 0).wait()
        # b holds the buffer's own bytes: the read into the shared buffer, racing the writes, changes nothing
        io.submit("write", buf[:4 * 4096], files["/swap/b"], 0).wait()
        requests = [
            {
                "direction": "write",
                "path": "/swap/a",
                "offset": 4096,
                "num_bytes": 8192,
                "urgent": False,
                "pad_tail": False,
            },
            {"direction": "read", "path": "/swap/b", "offset": 0, "num_bytes": 4096, "urgent": True, "pad_tail": False},
            {
                "direction": "write",
                "path": "/swap/b",
                "offset": 3 * 4096,
                "num_bytes": 4096,
                "urgent": False,
                "pad_tail": False,
            },
        ]
        assert bench_replay.replay(io, requests, files, buf, checksum=True) > 0
    a, b = (open(files[p], "rb").read() for p in ("/swap/a", "/swap/b"))
    assert a == bytes(4096) + data[:8192] + bytes(4096)
    assert b == data[:3 * 4096] + data[:4096]


def test_records_a_steady_step_and_replays_it_in_both_arms(tmp_path, monkeypatch):
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path / "cache"))
    disk = tmp_path / "disk"
    disk.mkdir()
    out = bench_replay.main(["--dir", str(disk), "--warmup", "1", "--reps", "1", "--layers", "2", "--d-model", "64",
                             "--heads", "2", "--vocab", "256", "--seq", "32", "--json", str(tmp_path / "r.json")])
    assert out["requests"] > 0 and out["read_bytes"] > 0 and out["write_bytes"] > 0
    # every optimizer-state byte is rewritten once per step: the writes recorded are at least those the
    # plan predicts for the step's own update less its tail, and no more than two updates' worth
    assert 0 < out["write_bytes"] <= 2 * out["planned_bytes_per_step"]["nvme_write"]
    assert [len(out["replay_s"][arm]) for arm in ("alone", "hog")] == [1, 1]
    assert out["hog_over_alone"] == pytest.approx(out["replay_s"]["hog"][0] / out["replay_s"]["alone"][0], rel=1e-2)
    assert os.listdir(disk) == []  # swap files and their copies are removed
    assert os.path.exists(tmp_path / "r.json")


def test_options_that_mean_nothing_here_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="does not use --systems"):
        bench_replay.main(["--dir", str(tmp_path), "--systems", "torch"])
    with pytest.raises(SystemExit, match="puts nothing on NVMe"):
        bench_replay.main(["--dir", str(tmp_path), "--placement", "host/host/host"])
