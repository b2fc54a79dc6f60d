"""The run directory of `infinity train`: bad data and failed starts leave nothing; one job at a time
(an OS lock, released by a crash); auto names that do not collide; a summary.json whenever a started run
stops early (a second Ctrl-C, a checkpoint that cannot be saved), naming what to do."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import infinity.job.train as train_mod
import infinity.state.checkpoint as ckpt_mod
import infinity.state.checkpoint_load as load_mod
from infinity.config.sections import ConfigError
from infinity.job.cli import EXIT_USAGE, main
from infinity.job.run_dir import LOCK, RunDir

TINY = ["--set", "model.n_layer=1", "--set", "model.d_model=16", "--set", "model.n_head=2", "--set",
        "model.seq_len=16", "--set", "run.batch_size=2", "--set", "run.eval_batches=1", "--set", "run.eval_every=0",
        "--set", "run.steps=4", "--set", "profile.enabled=false", "--quiet"]




def train(capsys, root: Path, name: str, *extra: str) -> tuple[int, str]:
    code = main(["train", *TINY, "--set", f"run.dir={root}", "--set", f"run.name={name}", *extra])
    return code, capsys.readouterr().err


def _data_file(tmp_path: Path, kind: str) -> Path:
    if kind == "empty":
        (tmp_path / "empty.txt").write_bytes(b"")
        return tmp_path / "empty.txt"
    if kind == "not-gzip":
        (tmp_path / "text.gz").write_text("plain text with a .gz name " * 100)
        return tmp_path / "text.gz"
    if kind == "empty-gzip":
        (tmp_path / "e.gz").write_bytes(gzip.compress(b""))
        return tmp_path / "e.gz"
    (tmp_path / "corpus").mkdir()
    return tmp_path / "corpus"


@pytest.mark.parametrize("kind,needle", [("empty", "is empty"), ("not-gzip", "not a valid gzip file"),
                                         ("empty-gzip", "is empty"), ("directory", "is a directory")])
def test_bad_data_exits_2_with_the_fix_and_leaves_nothing(kind, needle, tmp_path, capsys):
    data = _data_file(tmp_path, kind)
    code, err = train(capsys, tmp_path / "runs", "r", "--set", f"data.path={data}")
    assert code == EXIT_USAGE and needle in err and "Traceback" not in err, err
    assert "data.path" in err and ("point it at" in err or "compress it" in err)
    assert not (tmp_path / "runs" / "r").exists()


def test_a_failed_start_leaves_nothing_and_the_name_can_be_used_again(tmp_path, capsys):
    code, err = train(capsys, tmp_path, "r", "--set", "model.ffn_dim=100")  # fails building the model
    assert code == EXIT_USAGE and "model.ffn_dim" in err
    assert not (tmp_path / "r").exists(), "a failed start left the run directory behind"
    code, err = train(capsys, tmp_path, "r")
    assert code == 0, err
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["status"] == "completed"


def test_a_failed_start_in_an_existing_empty_directory_keeps_the_directory(tmp_path, capsys):
    (tmp_path / "r").mkdir()
    code, _ = train(capsys, tmp_path, "r", "--set", "model.ffn_dim=100")
    assert code == EXIT_USAGE and (tmp_path / "r").is_dir()  # the user's directory, not ours to remove


def test_auto_names_of_jobs_started_in_the_same_second_differ(tmp_path, monkeypatch):
    monkeypatch.setattr(train_mod.time, "strftime", lambda fmt: "20260101-000000")
    import infinity.job.run_dir as rd
    monkeypatch.setattr(rd.time, "strftime", lambda fmt: "20260101-000000")
    a, b = RunDir.new(str(tmp_path), "auto"), RunDir.new(str(tmp_path), "auto")
    assert a.path != b.path and {a.path.name, b.path.name} == {"20260101-000000", "20260101-000000-2"}
    a.release()
    b.release()


HOLD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from infinity.job.run_dir import RunDir
    run = RunDir.existing(Path(sys.argv[1]))
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
""")


def test_a_second_job_on_a_locked_run_directory_is_refused_naming_the_holder(tmp_path, capsys):
    code, err = train(capsys, tmp_path, "r", "--set", "run.steps=2")
    assert code == 0, err
    before = (tmp_path / "r" / "metrics.jsonl").read_text()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "r"), "60"], stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    try:
        assert holder.stdout.readline().strip() == "locked"
        code = main(["train", "--resume", str(tmp_path / "r"), "--set", "run.steps=4", "--quiet"])
        err = capsys.readouterr().err
        assert code == EXIT_USAGE and f"in use by another infinity train job (pid {holder.pid})" in err, err
        with pytest.raises(ConfigError, match=f"pid {holder.pid}"):
            RunDir.new(str(tmp_path), "r")  # a new run of the same name: refused for the lock too
        assert (tmp_path / "r" / "metrics.jsonl").read_text() == before, "the refused job wrote into the run"
    finally:
        holder.send_signal(signal.SIGKILL)  # a crash: the kernel drops the lock
        holder.wait()
    code = main(["train", "--resume", str(tmp_path / "r"), "--set", "run.steps=4", "--quiet"])
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "r" / LOCK).exists()


def test_a_second_ctrl_c_still_writes_a_summary(tmp_path, capsys, monkeypatch):
    real = train_mod._reduce_step

    def reduce(loss, stop, device, world):
        value = real(loss, stop, device, world)
        if reduce.calls == 2:  # Ctrl-C twice during step 3: StopFlag raises KeyboardInterrupt
            raise KeyboardInterrupt
        reduce.calls += 1
        return value
    reduce.calls = 0
    monkeypatch.setattr(train_mod, "_reduce_step", reduce)
    code, err = train(capsys, tmp_path, "r", "--set", "run.checkpoint_every=1")
    assert code == 130
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "aborted" and summary["steps"] == 2
    assert summary["checkpoint"].endswith("step-00000002") and "--resume" in summary["what_to_do"]


def _no_space_for(where: str, monkeypatch):
    real = ckpt_mod.shutil.disk_usage

    def disk_usage(path):
        usage = real(path)
        return usage._replace(free=0) if os.path.basename(os.fspath(path)) == where else usage
    monkeypatch.setattr(ckpt_mod.shutil, "disk_usage", disk_usage)


def test_a_final_save_without_space_keeps_the_last_checkpoint_and_says_what_to_do(tmp_path, capsys, monkeypatch):
    _no_space_for("r", monkeypatch)  # the final checkpoint goes to <run>/checkpoint; periodic ones elsewhere
    code, err = train(capsys, tmp_path, "r", "--set", "run.checkpoint_every=2")
    assert code == EXIT_USAGE and "not enough space" in err and "intact" not in err, err
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 4 and "not enough space" in summary["error"]
    assert summary["checkpoint"].endswith("step-00000002")
    assert "infinity train --resume" in summary["what_to_do"] and "lost" not in summary["what_to_do"]
    load_mod.read_manifest(summary["checkpoint"])  # the previous checkpoint is whole
    assert not [p for p in (tmp_path / "r").iterdir() if ".tmp-" in p.name]


def test_a_save_that_fails_with_no_earlier_checkpoint_says_the_training_is_lost(tmp_path, capsys, monkeypatch):
    _no_space_for("r", monkeypatch)
    code, err = train(capsys, tmp_path, "r")
    assert code == EXIT_USAGE and "intact" not in err
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["checkpoint"] is None
    assert "no complete checkpoint" in summary["what_to_do"] and "lost" in summary["what_to_do"]


def test_the_run_swap_folder_is_private(tmp_path, capsys, monkeypatch):
    seen = {}
    real = train_mod._loop

    def loop(job, config, engine, *a, **k):
        swap = Path(config.nvme.paths[0])
        seen["dir"] = swap.stat().st_mode & 0o777
        seen["files"] = {f.name: f.stat().st_mode & 0o777 for f in swap.iterdir()}
        return real(job, config, engine, *a, **k)
    monkeypatch.setattr(train_mod, "_loop", loop)
    code, err = train(capsys, tmp_path, "r", "--set", "run.steps=1")
    assert code == 0, err
    assert seen["dir"] == 0o700 and seen["files"] and all(m == 0o600 for m in seen["files"].values()), seen


def test_a_resume_removes_the_swap_files_a_killed_job_left(tmp_path):
    swap = tmp_path / "r" / "swap"
    swap.mkdir(parents=True)
    (swap / "infinity.rank0.12345.swp").write_bytes(b"x" * 4096)
    (swap / "keep.txt").write_text("not a swap file")
    run = RunDir.existing(tmp_path / "r")
    try:
        assert sorted(p.name for p in swap.iterdir()) == ["keep.txt"]
    finally:
        run.release()


def test_resumes_keep_checkpoint_keep_last_in_bounds(tmp_path, capsys):
    """Each resume continues the run's keep_last count (it does not start its own), and the final checkpoint
    is still replaced when keep_last already removed the old one."""
    keep = ["--set", "run.checkpoint_every=1", "--set", "checkpoint.keep_last=2"]
    code, err = train(capsys, tmp_path, "r", *keep)
    assert code == 0, err
    for steps in (6, 8):
        code = main(["train", "--resume", str(tmp_path / "r"), "--set", f"run.steps={steps}", "--quiet"])
        assert code == 0, capsys.readouterr().err
    saved = sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir())
    assert len(saved) <= 2, saved
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["steps"] == 8
    load_mod.read_manifest(str(tmp_path / "r" / "checkpoint"))


def test_an_nvme_path_that_is_a_file_exits_2_and_leaves_nothing(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    code, err = train(capsys, tmp_path / "runs", "r", "--set", f'nvme.paths=["{tmp_path / "afile"}"]')
    assert code == EXIT_USAGE and "afile" in err and "Traceback" not in err, err
    assert not (tmp_path / "runs" / "r").exists()


def test_a_run_trained_again_from_its_config_toml_leaves_the_old_run_as_it_was(tmp_path, capsys):
    """Note [run paths]: config.toml names the swap, profile and checkpoint paths only in comments, so the new run
    derives its own (they pointed into the old run, whose profile the new one overwrote)."""
    root = tmp_path / "runs"
    code, err = train(capsys, root, "a", "--set", "profile.enabled=true", "--set", "run.checkpoint_every=2")
    assert code == 0, err
    before = {p: p.read_bytes() for p in (root / "a").rglob("*") if p.is_file() and p.name != LOCK}
    assert any(p.parent.name == "rank0" and p.name == "summary.json" for p in before)
    code = main(["train", "--config", str(root / "a" / "config.toml"), "--set", "run.name=b", "--quiet"])
    assert code == 0, capsys.readouterr().err
    after = {p: p.read_bytes() for p in (root / "a").rglob("*") if p.is_file() and p.name != LOCK}
    assert after == before and not (root / "a" / "swap").exists()
    assert (root / "b" / "profile" / "rank0" / "summary.json").is_file()
    assert (root / "b" / "checkpoints" / "step-00000002").is_dir()


def test_a_swap_path_the_user_names_must_exist_the_job_creates_only_its_own(tmp_path, capsys):
    """A typo or an unmounted NVMe must not put the swap files on whatever disk holds the path's parent."""
    missing = tmp_path / "not-mounted" / "nvme0"
    for command in ("train", "estimate"):
        code, err = train(capsys, tmp_path / "runs", "r", "--set", f'nvme.paths=["{missing}"]') if command == "train" \
            else (main(["estimate", *TINY[:-1], "--set", f'nvme.paths=["{missing}"]']), capsys.readouterr().err)
        assert code == EXIT_USAGE and "does not exist" in err and f"mkdir -p {missing}" in err, (command, err)
        assert "Traceback" not in err and not missing.parent.exists() and not (tmp_path / "runs" / "r").exists()
    missing.mkdir(parents=True)
    code, err = train(capsys, tmp_path / "runs", "r", "--set", f'nvme.paths=["{missing}"]')
    assert code == 0, err


@pytest.fixture
def read_only(tmp_path):
    """Makes a directory unwritable even for root (chattr +i; chmod for other users); undone after the test."""
    made = []

    def make(path: Path) -> None:
        if os.geteuid() != 0:
            path.chmod(0o555)
        elif subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
            pytest.skip("needs chattr +i (root on a filesystem with immutable inodes)")
        made.append(path)

    yield make
    for path in made:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        path.chmod(0o755)


def test_resuming_a_run_whose_directory_is_read_only_exits_2_naming_it(tmp_path, capsys, read_only):
    """Even with the swap elsewhere (what the swap check's message suggests), a resume writes into the run."""
    root = tmp_path / "runs"
    code, err = train(capsys, root, "ro", "--set", "run.checkpoint_every=2")
    assert code == 0, err
    (tmp_path / "swap").mkdir()
    read_only(root / "ro")
    code = main(["train", "--resume", str(root / "ro"), "--set", "run.steps=6", "--quiet", "--set",
                 f'nvme.paths=["{tmp_path / "swap"}"]'])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and f"run directory {root / 'ro'} is not writable" in err and "Traceback" not in err, err
    assert "--set run.name=<new name>" in err


def test_resuming_a_live_run_that_has_no_checkpoint_yet_names_the_job_using_it(tmp_path, capsys):
    """The lock is asked first: 'no checkpoint found' (and its advice to start again) was wrong for a run that
    another job is still training (checkpoint_every = 0 saves only at the end)."""
    root = tmp_path / "runs"
    code, err = train(capsys, root, "live", "--set", "run.checkpoint=false")
    assert code == 0, err
    held = RunDir.existing(root / "live")  # as the live job holds it
    try:
        code = main(["train", "--resume", str(root / "live"), "--quiet"])
        err = capsys.readouterr().err
        assert code == EXIT_USAGE and f"pid {os.getpid()}" in err and "in use by another" in err, err
    finally:
        held.release()
    code = main(["train", "--resume", str(root / "live"), "--quiet"])
    assert code == EXIT_USAGE and "no checkpoint found" in capsys.readouterr().err


def test_a_sigterm_after_a_failure_still_writes_the_summary(tmp_path, capsys, monkeypatch):
    # Note [clean stop]: one rank of a torchrun job died; the others left the loop with its error, and torchrun's
    # SIGTERM, sent at once, killed them before summary.json was written and the swap files removed
    def reduce(loss, stop, device, world):
        raise RuntimeError("Connection closed by peer")  # what gloo says when another rank is gone
    monkeypatch.setattr(train_mod, "_reduce_step", reduce)
    real_summary = train_mod.stopped_summary

    def summary_after_sigterm(*args):
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun's, during the cleanup
        return real_summary(*args)
    monkeypatch.setattr(train_mod, "stopped_summary", summary_after_sigterm)

    def killed(signum, frame):  # stands in for the default action (death), so that a regression fails the test
        raise SystemExit(128 + signum)
    previous = signal.signal(signal.SIGTERM, killed)
    try:
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            train(capsys, tmp_path, "r")
    finally:
        signal.signal(signal.SIGTERM, previous)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "failed" and "Connection closed by peer" in summary["error"]
    assert not (tmp_path / "r" / "swap").exists(), "the swap files are removed"
    err = capsys.readouterr().err  # (the loop had ended: no "stopping after this step")
    assert "SIGTERM: finishing the report, checkpoint and cleanup (again to stop now)" in err, err


def test_quiet_prints_the_final_line_and_nothing_else(tmp_path, capsys):
    """`--quiet` drops the progress and the notes, not the run's result: one line, with the run directory."""
    code = main(["train", *TINY, "--set", f"run.dir={tmp_path}", "--set", "run.name=q"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and len(out) == 1, out
    assert out[0].startswith("completed after 4 steps") and str(tmp_path / "q") in out[0], out
