"""benchmarks/bench_largest.py within a time budget: the training process is stopped when the budget is spent or
when the script itself is (a `timeout` around it, as gpu_check.sh runs it), and the steps done are reported.

The estimate it reads is written here by hand for a tiny Llama (the real `infinity estimate --largest` answers a
model this machine takes minutes to train)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_largest  # noqa: E402

from infinity.plan.largest import MODES, Rung  # noqa: E402

TINY = Rung(name="tiny", d_model=32, n_layer=2, n_head=2, n_kv_head=1, ffn_dim=64, vocab_size=256)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_command_past_its_limit_is_stopped_with_its_whole_process_group(tmp_path):
    """SIGTERM at the limit, SIGKILL after the grace for one that ignores it; the command's own children go too
    (planted: a plain Popen().communicate(timeout) that kills only the child; the grandchild stays; this fails)."""
    pid_file = tmp_path / "grandchild"
    ignores_term = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                    f"p = subprocess.Popen(['sleep', '60']); open({str(pid_file)!r}, 'w').write(str(p.pid)); "
                    "time.sleep(60)")
    start = time.monotonic()
    code, err = bench_largest.run_bounded([sys.executable, "-c", ignores_term], limit_s=1, grace_s=0.5)
    assert time.monotonic() - start < 20
    assert code == -signal.SIGKILL and "past the 1 s limit" in err
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:  # (reaped by init once its parent is gone)
        time.sleep(0.1)
    assert not _alive(grandchild)
    code, err = bench_largest.run_bounded([sys.executable, "-c", "import sys; sys.exit(3)"], limit_s=30)
    assert code == 3  # (one within its limit: its own code)


def _estimate(tmp_path: Path) -> Path:
    largest = {"shape": {"name": TINY.name, "d_model": TINY.d_model, "n_layer": TINY.n_layer, "n_head": TINY.n_head,
                         "n_kv_head": TINY.n_kv_head, "ffn_dim": TINY.ffn_dim, "vocab_size": TINY.vocab_size},
               "num_params": TINY.num_params, "set": [], "step_s": 0.01, "state_bytes": 1, "free_bytes": 2}
    path = tmp_path / "estimate.json"
    path.write_text(json.dumps([{"mode": mode, "largest": largest} for mode in MODES]))
    return path


@pytest.fixture
def leftover_training(tmp_path):
    """After the test, whatever it left running: an `infinity train` of its run directory (a failing test, or a
    planted bug, must not leave one training on the machine) is stopped, and the test fails if there was one."""
    pattern = f"run.dir={tmp_path / 'run'}"
    yield pattern
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    subprocess.run(["pkill", "-KILL", "-f", pattern], capture_output=True)
    assert not found, f"an `infinity train` was left running: {found}"


def _bench(tmp_path: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_largest.py"), "--estimate", str(_estimate(tmp_path)),
           "--seq-len", "16", "--set", "run.batch_size=2", "--run-dir", str(tmp_path / "run"),
           "--json", str(tmp_path / "out.json"), *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow  # (~20 s: `infinity train` until its time limit)
def test_the_full_fine_tune_stops_at_its_time_limit_and_reports_its_steps(tmp_path, leftover_training):
    """run.time_limit from --time-limit: far fewer steps than asked, a clean end, the steps' times reported
    (planted: --time-limit not passed on as run.time_limit; the run is killed at the limit, no summary; fails)."""
    bench = _bench(tmp_path, "--modes", "full", "--steps", "1000000", "--time-limit", "22")
    output, _ = bench.communicate(timeout=120)
    assert bench.returncode == 0, output[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    full = out["full"]
    assert out["steps"] == full["steps_done"]  # (the GPU check's bar reads it: 3 steps in the part's time)
    assert full["returncode"] == 130 and "run.time_limit" in full["stopped_by"], full  # (docs/job.md: 130)
    assert 1 <= full["steps_done"] < 1_000_000 and len(full["step_times_s"]) == full["steps_done"]
    assert full["trained_params"] == TINY.num_params and full["step_s"] > 0 and full["wall_s"] > full["step_s"]


@pytest.mark.slow  # (~20 s: a tiny LoRA run stopped from outside)
def test_a_stopped_script_stops_its_training_and_still_writes_what_it_did(tmp_path, leftover_training):
    """SIGTERM to the script (gpu_check.sh's `timeout`) while the full fine-tune trains: the training process
    ends, the JSON holds the steps done, LoRA does not start (planted: no SIGTERM handler; no JSON, and the
    training left running; fails)."""
    bench = _bench(tmp_path, "--modes", "full,lora", "--steps", "1000000")
    metrics = tmp_path / "run"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not any(
            p.stat().st_size > 0 for p in metrics.glob("*/metrics.jsonl")):
        time.sleep(0.2)
    time.sleep(1.0)  # (a few more steps)
    bench.send_signal(signal.SIGTERM)
    output, _ = bench.communicate(timeout=60)
    out = json.loads((tmp_path / "out.json").read_text())
    assert "lora" not in out, output[-3000:]
    full = out["full"]
    assert full["steps_done"] >= 1 and full["stopped_by"] == f"signal {int(signal.SIGTERM)}", full
    # (and the fixture: the `infinity train` of that run is gone)
