"""Note [time limit]: `run.time_limit` stops a run in time for its final checkpoint, SIGUSR1 (Slurm's warning
signal) stops it as Ctrl-C does, the summary says why, and `--resume` continues bit for bit (the reference: the
same steps trained without a stop)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infinity.config.sections import ConfigError
from infinity.job.cli import EXIT_INTERRUPTED, main
from infinity.job.spec import load_job
from infinity.job.train import train

# a fixed LR schedule, so a run stopped at step S and resumed follows the uninterrupted run's
TINY = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "run.batch_size=4",
        "run.eval_batches=1", "run.eval_every=0", "optimizer.total_steps=6", "optimizer.warmup_steps=2",
        "profile.enabled=false"]



def _sets(root: Path, name: str, *more: str) -> list[str]:
    return [a for s in TINY + [f"run.dir={root}", f"run.name={name}", *more] for a in ("--set", s)]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("value", ["3 hours", "-5m", "h"])
def test_a_time_limit_that_is_not_a_duration_is_refused(value):
    with pytest.raises(ConfigError, match=r'run.time_limit = .*not a duration; write it as "3h50m"'):
        load_job(None, [f"run.time_limit={json.dumps(value)}"])


def test_the_time_limit_stops_with_a_checkpoint_and_the_resume_is_bitwise(tmp_path):
    limit = 3
    assert main(["train", "--quiet", *_sets(tmp_path, "limited", "run.steps=1000000",
                                           f'run.time_limit="{limit}s"')]) == EXIT_INTERRUPTED
    run = tmp_path / "limited"
    summary = json.loads((run / "summary.json").read_text())
    steps = summary["steps"]
    assert summary["status"] == "interrupted" and summary["stopped_by"] == f"run.time_limit = {limit}s"
    assert 1 <= steps < 1000000 and summary["seconds"] < limit  # stopped in time: the loop's own clock
    assert (run / "checkpoint" / "manifest.json").is_file() and len(_metrics(run)) == steps
    assert main(["train", "--quiet", "--resume", str(run), "--set", f"run.steps={steps + 2}",
                 "--set", 'run.time_limit="none"']) == 0
    train(load_job(None, TINY + [f"run.dir={tmp_path}", "run.name=whole", f"run.steps={steps + 2}"]), verbose=False)
    whole = tmp_path / "whole"
    for key in ("loss", "lr", "grad_norm"):
        assert [r[key] for r in _metrics(run)] == [r[key] for r in _metrics(whole)], key
    assert (run / "checkpoint" / "rank00000.bin").read_bytes() == (whole / "checkpoint" / "rank00000.bin").read_bytes()


def test_sigusr1_stops_the_run_as_ctrl_c_does_and_the_summary_names_it(tmp_path):
    cmd = [sys.executable, "-m", "infinity", "train", "--quiet", *_sets(tmp_path, "r", "run.steps=1000000")]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    metrics = tmp_path / "r" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INTERRUPTED, err
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["stopped_by"] == "SIGUSR1"
    assert (tmp_path / "r" / "checkpoint" / "manifest.json").is_file()
    assert out.strip().startswith("interrupted (SIGUSR1) after"), out
