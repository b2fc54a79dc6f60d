"""Kill test: SIGKILL at 20 distinct seeded points of training and saving, 13 of them after a committed
checkpoint (the rerun must resume from it); every rerun resumes from a
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

WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers", "kill_worker.py")
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


STEPS, SAVE_EVERY, RECORD_WRITES = 6, 2, 12  # kill_worker.py: 6 steps, a save every 2, 12 record writes a save


def after_a_commit(site: str, step: int, background: bool) -> bool:
    """Whether a complete checkpoint exists when the kill lands. The first save (after step index 1)
    commits at its end, or with background saving in the update of step index 2."""
    if site in ("write", "commit"):
        return step >= 2 * SAVE_EVERY - 1  # a later save: the first one committed before it began
    return step >= SAVE_EVERY + (1 if background else 0)


def kill_points(n: int = 20, after: int = 13, seed: int = 1234) -> list[tuple[str, bool]]:
    """`n` distinct seeded kill sites, `after` of them when a committed checkpoint exists (so the rerun really
    resumes): during forward / backward / update of any step, during the record writes of a save, or right
    before a save's commit; with and without background saving."""
    saves = range(SAVE_EVERY - 1, STEPS, SAVE_EVERY)
    candidates = [(f"{site}:{s}:0", bg) for site in ("forward", "backward", "step") for s in range(STEPS)
                  for bg in (False, True)]
    candidates += [(f"write:{s}:{k}", bg) for s in saves for k in range(1, RECORD_WRITES + 1) for bg in (False, True)]
    candidates += [(f"commit:{s}:0", bg) for s in saves for bg in (False, True)]

    def is_after(point):
        site, step, _ = point[0].split(":")
        return after_a_commit(site, int(step), point[1])
    rng = random.Random(seed)
    rng.shuffle(candidates)
    chosen: dict[str, bool] = {}  # site -> background: every site once
    for want_after, count in ((True, after), (False, n - after)):
        for point in [c for c in candidates if is_after(c) == want_after and c[0] not in chosen][:count]:
            chosen[point[0]] = point[1]
    return sorted(chosen.items())


POINTS = kill_points()
# CI runs the first point of the write site (a kill during a checkpoint's writes; the suite's 8 minutes);
# `-m slow` runs all 20, every site kind
_FIRST_OF_SITE = {site: point for point in reversed(POINTS) for site in [point[0].split(":")[0]]}
_IN_CI = {point for site, point in _FIRST_OF_SITE.items() if site == "write"}
CASES = [pytest.param(*point, marks=() if point in _IN_CI else pytest.mark.slow) for point in POINTS]


def test_the_kill_points_are_distinct_and_mostly_after_a_commit():
    assert len({site for site, _ in POINTS}) == len(POINTS) == 20
    assert sum(after_a_commit(p.split(":")[0], int(p.split(":")[1]), bg) for p, bg in POINTS) >= 12


@pytest.mark.parametrize("kill_at,background", CASES, ids=lambda v: str(v))
def test_killed_run_resumes_to_the_same_parameters(kill_at, background, reference, tmp_path):
    flags = ["--background"] if background else []
    killed = run(tmp_path, "--kill-at", kill_at, *flags)
    if killed.returncode == 0:
        pytest.fail(f"the kill point {kill_at} was never reached: {killed.stdout}")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    rerun = run(tmp_path, *flags)
    assert rerun.returncode == 0, rerun.stderr
    resumed = json.loads(rerun.stdout.strip().splitlines()[-1])
    site, step, _ = kill_at.split(":")
    if after_a_commit(site, int(step), background):
        assert resumed["resumed_from"], f"a checkpoint was committed before {kill_at}: the rerun must resume"
    if resumed["resumed_from"]:
        assert resumed["resumed_complete"], "the rerun loaded an incomplete checkpoint"
    assert states_equal(torch.load(tmp_path / "final.pt"), reference)
    ckpts = os.listdir(tmp_path / "ckpts")
    assert not [n for n in ckpts if ".tmp-" in n], f"partial saves were cleaned up: {ckpts}"
    assert sorted(ckpts) == ["step-4", "step-6"], f"keep_last = 2 holds across the restart: {ckpts}"
