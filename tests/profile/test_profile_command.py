"""The job prints the profiler's table at its end; `infinity profile RUN_DIR [--json]` prints it for a finished
run (Note [profile command]); a run without a profile is named with the fix."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from infinity.profile import format_summary

TINY = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "run.batch_size=4",
        "run.eval_every=0", "run.checkpoint=false", "data.val_fraction=0.1"]


def _cli(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infinity", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    sets = TINY + ["run.steps=14", f"run.dir={root}", "run.name=r", "profile.enabled=true"]
    out = _cli("train", *[a for s in sets for a in ("--set", s)])
    assert out.returncode == 0, out.stderr[-2000:]
    return root / "r", out.stdout


@pytest.mark.slow
def test_the_job_prints_the_profile_table_at_its_end(profiled_run):
    run_dir, stdout = profiled_run
    assert "profile rank 0: 14 step(s)" in stdout
    assert "per link, median over steps" in stdout and f"infinity profile {run_dir}" in stdout
    assert "(4 earlier step(s) not shown" in stdout  # the last 10 steps only


@pytest.mark.slow
def test_profile_command_prints_the_summary_and_json(profiled_run):
    run_dir, _ = profiled_run
    out = _cli("profile", str(run_dir), "--steps", "3")
    assert out.returncode == 0, out.stderr
    summary = json.loads((run_dir / "profile" / "rank0" / "summary.json").read_text())
    rows = [line.split() for line in out.stdout.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [s["step"] for s in summary["steps"][-3:]]
    # the profile numbers steps as metrics.jsonl does (from 1), and says which it covers
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in summary["steps"]] == [r["step"] for r in records] == list(range(1, 15))
    assert "14 step(s) (steps 1-14 of the run)" in out.stdout
    assert f"{summary['median']['step_s'] * 1e3:.2f}" in out.stdout
    median = summary["median"]  # Note [step attribution]: the printed split is the summary's, and it adds up
    assert f"median step ({median['step']}): step {median['step_s'] * 1e3:.2f} ms = compute " in out.stdout
    assert median["attributed"] >= 0.95 and median["host_syncs"] >= 1
    for link in ("h2d", "d2h"):  # no copy crosses a link on the CPU, as the byte model says
        assert median["links"][link]["bytes"] == median["links"][link]["predicted_bytes"] == 0
    as_json = json.loads(_cli("profile", str(run_dir), "--json").stdout)
    assert as_json == {"rank0": summary}
    assert _cli("profile", str(run_dir / "profile" / "rank0")).stdout == _cli("profile", str(run_dir)).stdout


def test_a_summary_without_the_split_still_prints():
    """A summary.json written before Note [step attribution] still prints (as `infinity profile` does), and says
    how to get the split."""
    step = {"step": 0, "step_s": 0.1, "compute_s": 0.05, "exposed_s": 0.01, "overlap_efficiency": 0.5,
            "on_demand_fetches": 0, "links": {}}
    text = format_summary({"rank": 0, "num_steps": 1, "steps": [step], "median": step})
    assert "median step 100.00 ms" in text and "profile the run again" in text


def _tiny_profile(root, count):
    """A run directory whose profile holds `count` steps numbered from 1, as the job writes them."""
    rank = root / "profile" / "rank0"
    rank.mkdir(parents=True)
    step = {"step_s": 0.1, "compute_s": 0.1, "exposed_s": 0.0, "host_s": 0.0, "unattributed_s": 0.0,
            "attributed": 1.0, "overlap_efficiency": 1.0, "on_demand_fetches": 0, "host_syncs": 0,
            "host_syncs_training": None, "host_syncs_by_reason": {}, "links": {},
            "parts": {"compute": 0.1, "exposed": {}, "host": {}, "unattributed": 0.0}}
    steps = [dict(step, step=i) for i in range(1, count + 1)]
    (rank / "summary.json").write_text(json.dumps({"rank": 0, "num_steps": count, "steps": steps,
                                                   "median": dict(steps[0], step=1)}))
    (root / "metrics.jsonl").write_text("")
    return root


def _step_rows(text: str) -> list[int]:
    return [int(line.split()[0]) for line in text.splitlines() if line.strip() and line.split()[0].isdigit()]


@pytest.mark.parametrize("count,shown", [(5, [3, 4, 5]), (3, [1, 2, 3])])
def test_steps_shows_the_last_n(tmp_path, capsys, count, shown):
    from infinity.job.cli import main
    assert main(["profile", str(_tiny_profile(tmp_path, count)), "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert _step_rows(out) == shown
    assert ("2 earlier step(s) not shown" in out) == (count == 5)


def test_steps_zero_shows_no_rows_and_a_negative_count_is_refused(tmp_path, capsys):
    from infinity.job.cli import main
    run = _tiny_profile(tmp_path, 5)
    assert main(["profile", str(run), "--steps", "0"]) == 0
    out = capsys.readouterr().out
    assert _step_rows(out) == [] and "5 earlier step(s) not shown" in out and "median step (1)" in out
    for bad in ("-1", "two"):
        with pytest.raises(SystemExit) as exit:
            main(["profile", str(run), "--steps", bad])
        err = capsys.readouterr().err
        assert exit.value.code == 2 and "give 0 or more" in err and "Traceback" not in err


def test_a_later_first_step_says_it_is_the_segment_since_a_resume():
    step = {"step": 31, "step_s": 0.1, "compute_s": 0.1, "exposed_s": 0.0, "host_s": 0.0, "unattributed_s": 0.0,
            "attributed": 1.0, "overlap_efficiency": 1.0, "on_demand_fetches": 0, "host_syncs": 0,
            "host_syncs_training": None, "host_syncs_by_reason": {}, "links": {},
            "parts": {"compute": 0.1, "exposed": {}, "host": {}, "unattributed": 0.0}}
    steps = [dict(step, step=i) for i in range(31, 41)]
    text = format_summary({"rank": 0, "num_steps": 10, "steps": steps, "median": steps[0]})
    assert "10 step(s) (steps 31-40 of the run: the segment since the resume at step 30)" in text


def test_a_file_given_for_the_run_directory_is_named(tmp_path):
    """`infinity profile RUN/metrics.jsonl`: exit 2 saying it wants a directory, naming the run's."""
    run = _tiny_profile(tmp_path / "r", 2)
    for path in (run / "metrics.jsonl", run / "profile" / "rank0" / "summary.json"):
        out = _cli("profile", str(path))
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert "a file; give a directory" in out.stderr and f"`infinity profile {run}`" in out.stderr


def test_profile_command_names_a_missing_profile(tmp_path):
    out = _cli("profile", str(tmp_path))
    assert out.returncode == 2 and "profile.enabled=true" in out.stderr
    out = _cli("profile", str(tmp_path / "nope"))
    assert out.returncode == 2 and "no such directory" in out.stderr


def _big_profile(root, count=4000):
    """A profile summary of `count` steps (4000: its JSON is more than a pipe holds)."""
    rank = root / "profile" / "rank0"
    rank.mkdir(parents=True)
    steps = [{"step": i, "step_s": 0.1, "links": {"compute": {"busy_s": 0.05}}} for i in range(count)]
    (rank / "summary.json").write_text(json.dumps({"rank": 0, "num_steps": count, "steps": steps,
                                                   "median": {"step_s": 0.1}}))
    return root


@pytest.mark.parametrize("count", [4000, 2], ids=["larger-than-the-pipe", "small"])
def test_a_closed_stdout_ends_the_command_quietly(tmp_path, count, capsys, monkeypatch):
    """Note [closed stdout]: stdout a pipe whose reader is gone (`| head` exited): 141, nothing on stderr, and
    stdout pointed at /dev/null (the interpreter's own flush at exit cannot fail); a large write fails in print,
    a small one in main's flush."""
    import os

    from infinity.job.cli import main
    read, write = os.pipe()
    os.close(read)
    stdout = open(write, "w")
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(["profile", str(_big_profile(tmp_path, count)), "--json"]) == 141
    assert os.path.samestat(os.fstat(write), os.stat(os.devnull))
    monkeypatch.undo()
    stdout.close()
    assert capsys.readouterr().err == ""


@pytest.mark.slow  # (a process start: ~2 s)
def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path):
    """`infinity profile RUN --json | head -1` as the shell runs it: exit 141, nothing on stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "infinity", "profile", str(_big_profile(tmp_path)), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"{"
    proc.stdout.close()  # (head -1 exits)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and err == ""
