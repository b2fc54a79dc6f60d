"""`infinity train --resume`: a stopped run continues exactly as if it had not stopped, or says why it cannot."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from infinity.config.sections import ConfigError
from infinity.job.cli import EXIT_USAGE, main
from infinity.job.resume import load_resume
from infinity.job.spec import load_job
from infinity.job.train import train
from infinity.state.checkpoint import PARTIAL_MARKER
from infinity.state.export import export_checkpoint

# a fixed LR schedule (total_steps, warmup), so a run of N steps and one stopped at N/2 follow the same one
TINY = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "run.batch_size=4",
        "run.eval_batches=1", "run.eval_every=0", "optimizer.total_steps=6", "optimizer.warmup_steps=2"]
N = 6




def run_job(root: Path, name: str, *overrides: str):
    return train(load_job(None, TINY + [f"run.dir={root}", f"run.name={name}", *overrides]), verbose=False)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def final_state(checkpoint: Path, tmp_path: Path) -> dict:
    out = tmp_path / f"{checkpoint.parent.name}-{checkpoint.name}.pt"
    export_checkpoint(str(checkpoint), str(out))
    return torch.load(out)


def assert_same_training(a: Path, b: Path, tmp_path: Path, from_step: int) -> None:
    """Steps from_step.. of runs a and b have the same losses, LR and gradient norms, and both end in the same
    parameters and Adam moments (the checkpoints' rank files are byte-identical)."""
    ma, mb = metrics(a), metrics(b)
    assert [r["step"] for r in ma] == [r["step"] for r in mb] == list(range(1, len(ma) + 1))
    for key in ("loss", "lr", "grad_norm", "tokens"):
        assert [r[key] for r in ma][from_step:] == [r[key] for r in mb][from_step:], key
    for records in (ma, mb):  # a running total of the trained tokens, carried across a resume
        assert [r["tokens"] for r in records] == list(itertools.accumulate(r["tokens_per_step"] for r in records))
    sa, sb = final_state(a / "checkpoint", tmp_path), final_state(b / "checkpoint", tmp_path)
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert (a / "checkpoint" / "rank00000.bin").read_bytes() == (b / "checkpoint" / "rank00000.bin").read_bytes()


def test_stopped_run_resumed_matches_the_uninterrupted_run_exactly(tmp_path, capsys):
    run_job(tmp_path, "whole", f"run.steps={N}")
    run_job(tmp_path, "stopped", f"run.steps={N // 2}")  # stops at N/2 with its final checkpoint
    stopped = tmp_path / "stopped"
    assert json.loads((stopped / "summary.json").read_text())["steps"] == N // 2
    code = main(["train", "--resume", str(stopped), "--set", f"run.steps={N}", "--quiet"])
    assert code == 0, capsys.readouterr().err
    assert_same_training(tmp_path / "whole", stopped, tmp_path, from_step=0)
    summary = json.loads((stopped / "summary.json").read_text())
    assert summary["steps"] == N and summary["status"] == "completed"
    assert summary["resumed"] == {"from": str(stopped / "checkpoint"), "at_step": N // 2}
    assert summary["first_loss"] == metrics(stopped)[0]["loss"] and summary["last_loss"] == metrics(stopped)[-1]["loss"]
    assert summary["tokens_per_s"] == pytest.approx(metrics(stopped)[-1]["tokens"] / summary["seconds"])
    assert load_job(stopped / "config.toml").run.steps == N  # a later --resume continues from this config
    assert not [p for p in stopped.iterdir() if p.name.startswith("checkpoint.")], "no replaced checkpoint is left"
    assert not (stopped / "swap").exists()


def test_crashed_run_resumes_from_its_latest_periodic_checkpoint(tmp_path):
    run_job(tmp_path, "r", f"run.steps={N}", "run.checkpoint_every=2")
    run = tmp_path / "r"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    shutil.copytree(run, tmp_path / "whole")
    # a crash during step 6: the metrics of step 5 and half a line of step 6 are there, the final checkpoint is not
    shutil.rmtree(run / "checkpoint")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[:5]) + "\n" + lines[5][:20])
    job, resume = load_resume(run)
    assert resume.checkpoint == run / "checkpoints" / "step-00000004" and resume.step == 4
    train(job, verbose=False, resume=resume)
    assert_same_training(tmp_path / "whole", run, tmp_path, from_step=0)  # steps 5 and 6 trained again, once each


def damage(checkpoint: Path) -> bytes:
    """Overwrite bytes in the middle of the checkpoint's rank file (its manifest still reads); the file's bytes."""
    data = bytearray((checkpoint / "rank00000.bin").read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = bytes(64)
    (checkpoint / "rank00000.bin").write_bytes(bytes(data))
    return bytes(data)


def test_a_damaged_latest_checkpoint_resumes_from_the_newest_intact_one(tmp_path, capsys):
    """Note [damaged checkpoint]: `--resume RUN` passes over a damaged final checkpoint to the newest intact one,
    says so, keeps the damaged one, and trains as the uninterrupted run; `--resume RUN/checkpoints/step-N` is not
    refused for newer damaged checkpoints."""
    run_job(tmp_path, "r", f"run.steps={N}", "run.checkpoint_every=2")
    run = tmp_path / "r"
    shutil.copytree(run, tmp_path / "whole")
    shutil.copytree(run, tmp_path / "explicit")
    damaged = damage(run / "checkpoint")
    code = main(["train", "--resume", str(run)])
    out = capsys.readouterr()
    assert code == 0, out.err
    said = [line for line in (out.out + out.err).splitlines() if "is damaged" in line]
    assert len(said) == 1 and str(run / "checkpoint") in said[0] and "step-00000004 (step 4)" in said[0], said
    assert (run / "checkpoint.damaged" / "rank00000.bin").read_bytes() == damaged  # kept as it was
    assert said[0].endswith(f"kept as {run / 'checkpoint.damaged'}"), said  # its real name
    assert_same_training(tmp_path / "whole", run, tmp_path, from_step=0)  # steps 5 and 6 trained again

    explicit = tmp_path / "explicit"
    damage(explicit / "checkpoint")
    damage(explicit / "checkpoints" / "step-00000004")
    job, resume = load_resume(explicit / "checkpoints" / "step-00000002", None, [f"run.steps={N}"])
    assert resume.step == 2 and {p.name for p, _ in resume.damaged} == {"checkpoint", "step-00000004"}
    with pytest.raises(ConfigError, match=f"the checkpoint is damaged .*infinity train --resume {explicit}$"):
        load_resume(explicit / "checkpoints" / "step-00000004", None, [f"run.steps={N}"])


def test_a_resumed_run_keeps_the_earlier_segments_profile(tmp_path, capsys):
    """Note [profile segments]: the profile of the steps before a resume moves to profile/segment-<first step>;
    the new profile holds the steps since, numbered as metrics.jsonl, and `infinity profile` says so."""
    run_job(tmp_path, "r", f"run.steps={N // 2}", "profile.enabled=true")
    run = tmp_path / "r"
    code = main(["train", "--resume", str(run), "--set", f"run.steps={N}", "--quiet"])
    assert code == 0, capsys.readouterr().err
    def steps(profile: Path) -> list[int]:
        return [s["step"] for s in json.loads((profile / "rank0" / "summary.json").read_text())["steps"]]
    assert steps(run / "profile" / "segment-1") == list(range(1, N // 2 + 1))
    assert steps(run / "profile") == list(range(N // 2 + 1, N + 1)) == [r["step"] for r in metrics(run)][N // 2:]
    capsys.readouterr()
    assert main(["profile", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"(steps {N // 2 + 1}-{N} of the run: the segment since the resume at step {N // 2})" in out
    assert f"infinity profile {run / 'profile' / 'segment-1'}" in out
    assert main(["profile", str(run / "profile" / "segment-1")]) == 0
    assert f"(steps 1-{N // 2} of the run)" in capsys.readouterr().out


@pytest.mark.parametrize("disks", ["one per node", "shared"])
def test_every_node_keeps_its_earlier_profile_segment(tmp_path, disks):
    """Note [profile segments] on two nodes of two ranks each (threads for ranks, a barrier for the collective):
    where each node has its own run directory, the second node's profile moves too (rank 0 sees only its own
    node's); where the directory is shared, rank 0 moves all four and the other node finds nothing to move."""
    import threading

    from infinity.job.resume import keep_profile_segments
    nodes = [tmp_path / "node0", tmp_path / "node1"] if disks == "one per node" else [tmp_path / "shared"] * 2
    for rank in range(4):
        own = nodes[rank // 2] / "profile" / f"rank{rank}"
        own.mkdir(parents=True)
        (own / "summary.json").write_text(json.dumps({"steps": [{"step": 1}, {"step": 2}]}))
    gate, errors = threading.Barrier(4), []

    def rank_of(rank: int) -> None:
        try:
            keep_profile_segments(str(nodes[rank // 2] / "profile"), rank, rank % 2, gate.wait)
        except BaseException as e:  # (reported below)
            errors.append(e)
    threads = [threading.Thread(target=rank_of, args=(r,)) for r in range(4)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    assert not errors
    for node in set(nodes):
        held = sorted(p.relative_to(node / "profile").as_posix() for p in (node / "profile").rglob("rank*"))
        ranks = range(4) if disks == "shared" else range(2 * nodes.index(node), 2 * nodes.index(node) + 2)
        assert held == [f"segment-1/rank{r}" for r in ranks]


@pytest.mark.slow  # (CI: the Ctrl-C stop in test_train_job, the resumed run's exactness above)
def test_ctrl_c_then_resume_matches_the_uninterrupted_run(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same kernels in every process, so the same sums

    def cli(*args: str, name: str) -> subprocess.Popen:
        sets = TINY + [f"run.dir={tmp_path}", "optimizer.total_steps=400"] + ([f"run.name={name}"] if name else [])
        return subprocess.Popen([sys.executable, "-m", "infinity", "train", "--quiet", *args]
                                + [a for s in sets for a in ("--set", s)], env=env, stderr=subprocess.PIPE, text=True)
    proc = cli("--set", "run.steps=400", name="stopped")
    log = tmp_path / "stopped" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 3):
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130, proc.stderr.read()
    k = json.loads((tmp_path / "stopped" / "summary.json").read_text())["steps"]
    assert 3 <= k < 400
    resumed = subprocess.Popen([sys.executable, "-m", "infinity", "train", "--quiet", "--resume",
                                str(tmp_path / "stopped"), "--set", f"run.steps={k + 2}"], env=env,
                               stderr=subprocess.PIPE, text=True)
    whole = cli("--set", f"run.steps={k + 2}", name="whole")
    for p in (resumed, whole):
        assert p.wait(timeout=180) == 0, p.stderr.read()
    assert_same_training(tmp_path / "whole", tmp_path / "stopped", tmp_path, from_step=0)


# ---------------------------------------------------------------- errors that name the problem and the fix


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A 4-step run with checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("finished")
    run_job(root, "r", "run.steps=4", "run.checkpoint_every=2")
    return root / "r"


@pytest.mark.parametrize("overrides,needle", [
    (["run.steps=4"], "nothing to train; --set run.steps=N with N > 4"),
    (["run.steps=8", "model.n_layer=3"], "model.n_layer = 3, but the checkpoint was trained with model.n_layer = 2"),
    (["run.steps=8", "run.batch_size=8"], "run.batch_size = 8, but the run trained with run.batch_size = 4"),
    (["run.steps=8", "data.seed=7"], "data.seed = 7, but the run trained with data.seed = 1234"),
    (["run.steps=8", "run.name=other"], "continues in its own directory"),
])
def test_changes_that_would_break_the_continuation_are_refused(finished, overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_resume(finished, None, overrides)
    assert needle in str(e.value)


def test_what_a_resume_may_change(finished):
    job, resume = load_resume(finished, None, ["run.steps=8", "placement.optimizer=host", "run.eval_every=2"])
    config = job.engine_config(str(finished))
    assert job.run.steps == 8 and config.placement.optimizer == "host" and resume.step == 4
    assert resume.checkpoint == finished / "checkpoint"
    assert config.nvme.paths == (str(finished / "swap"),)


def test_a_resume_that_cannot_start_leaves_the_run_as_it_was(finished, tmp_path, capsys):
    run = tmp_path / "copy"
    shutil.copytree(finished, run)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    code = main(["train", "--resume", str(run), "--set", "run.steps=8", "--set", "memory.host_budget=4096", "--quiet"])
    assert code == EXIT_USAGE and "memory.host_budget" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_an_older_checkpoint_is_refused_while_a_newer_one_exists(finished):
    with pytest.raises(ConfigError, match="newer than .*step-00000002.*Resume from the latest"):
        load_resume(finished / "checkpoints" / "step-00000002", None, ["run.steps=8"])


def test_resume_names_what_is_missing(tmp_path, finished, capsys):
    with pytest.raises(ConfigError, match="no such directory"):
        load_resume(tmp_path / "nothing")
    run_job(tmp_path, "nockpt", "run.steps=2", "run.checkpoint=false")
    with pytest.raises(ConfigError, match="no checkpoint found in .*nockpt: the run saved none"):
        load_resume(tmp_path / "nockpt")
    # only a save that never completed (killed while saving)
    shutil.copytree(finished, tmp_path / "killed", ignore=shutil.ignore_patterns("checkpoints"))
    os.rename(tmp_path / "killed" / "checkpoint", tmp_path / "killed" / "checkpoint.tmp-dead")
    (tmp_path / "killed" / "checkpoint.tmp-dead" / PARTIAL_MARKER).touch()
    with pytest.raises(ConfigError, match=r"only checkpoint.tmp-dead, which is incomplete"):
        load_resume(tmp_path / "killed")
    code = main(["train", "--resume", str(tmp_path / "killed"), "--quiet"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "no checkpoint found in" in err and "Traceback" not in err


def test_a_data_file_whose_bytes_changed_since_the_checkpoint_is_refused(tmp_path):
    """Note [changed data file]: the same data.path with other bytes would give other batches after the
    checkpoint, silently; the same bytes (touched, or copied back) resume."""
    data = tmp_path / "notes.txt"
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(400))
    data.write_text(text)
    run_job(tmp_path, "d", "run.steps=2", f"data.path={data}")
    data.write_text(text.replace("fox", "cat"))
    with pytest.raises(ConfigError, match=r'data.path = .*notes.txt" has changed since the checkpoint'):
        load_resume(tmp_path / "d", None, ["run.steps=4"])
    data.write_text(text)  # the run's bytes again (a new mtime)
    job, resume = load_resume(tmp_path / "d", None, ["run.steps=4"])
    assert resume.step == 2


def test_a_resume_names_every_engine_key_it_changes(finished):
    """Placement, the optimizer's settings and the like may change on resume, but not silently: each key that
    differs from the run's config.toml is listed (the progress prints them)."""
    config_toml = (finished / "config.toml").read_text()
    lr = next(line.split(" = ")[1] for line in config_toml.splitlines() if line.startswith("lr = "))
    _, same = load_resume(finished, None, ["run.steps=8", "run.eval_every=2"])
    assert same.changes == ()
    _, resume = load_resume(finished, None, ["run.steps=8", "optimizer.lr=0.01", "placement.optimizer=host"])
    assert set(resume.changes) == {f"optimizer.lr: {lr} -> 0.01", 'placement.optimizer: "nvme" -> "host"'}
