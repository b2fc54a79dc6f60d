"""Kill test: SIGKILL at 20 random points of training and saving; every rerun resumes from a
complete checkpoint and ends with exactly the parameters of an uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import pytest
import torch

from ckpt_runs import states_equal

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kill_worker.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def run(root, *extra):
    return subprocess.run([sys.executable, WORKER, str(root), *extra], capture_output=True, text=True, env=ENV,
                          timeout=240)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    done = run(root)
    assert done.returncode == 0, done.stderr
    return torch.load(root / "final.pt")


def kill_points(n: int, seed: int = 1234) -> list[tuple[str, bool]]:
    """Random (seeded) kill sites: during forward/backward/update of any step, during the writes of a
    save, or right before a save's commit; some with background saving."""
    rng = random.Random(seed)
    points = []
    for _ in range(n):
        site = rng.choice(["forward", "backward", "step", "write", "write", "commit"])
        step = rng.choice([1, 3, 5]) if site in ("write", "commit") else rng.randrange(6)
        nth = rng.randint(1, 12) if site == "write" else 0  # a save of this model is 12 record writes
        points.append((f"{site}:{step}:{nth}", rng.random() < 0.3))
    return points


@pytest.mark.parametrize("kill_at,background", kill_points(20), ids=lambda v: str(v))
def test_killed_run_resumes_to_the_same_parameters(kill_at, background, reference, tmp_path):
    flags = ["--background"] if background else []
    killed = run(tmp_path, "--kill-at", kill_at, *flags)
    if killed.returncode == 0:
        pytest.fail(f"the kill point {kill_at} was never reached: {killed.stdout}")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    rerun = run(tmp_path, *flags)
    assert rerun.returncode == 0, rerun.stderr
    resumed = json.loads(rerun.stdout.strip().splitlines()[-1])
    if resumed["resumed_from"]:
        assert os.path.isfile(os.path.join(resumed["resumed_from"], "manifest.json"))
    assert states_equal(torch.load(tmp_path / "final.pt"), reference)
    ckpts = os.listdir(tmp_path / "ckpts")
    assert not [n for n in ckpts if ".tmp-" in n], f"partial saves were cleaned up: {ckpts}"
