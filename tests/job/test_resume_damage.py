"""Note [damaged checkpoint]: `infinity train --resume RUN` never goes back in silence. Each kind of damage to
the newest checkpoint is named with what is wrong, the checkpoint is kept as `<name>.damaged` (an incomplete
save, which the next save removes, is named and left), the note says how many candidates were tried, and when
every one is damaged the error lists them all. The reference is the run's own intact periodic checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from infinity.config.sections import ConfigError
from infinity.job.resume import load_resume, set_aside
from infinity.job.spec import load_job
from infinity.job.train import train
from infinity.state.checkpoint import PARTIAL_MARKER

TINY = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "run.batch_size=4",
        "run.eval_batches=1", "run.eval_every=0", "run.steps=6", "run.checkpoint_every=2"]



@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    train(load_job(None, TINY + [f"run.dir={root}", "run.name=r"]), verbose=False)
    return root / "r"


def _truncate(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {  # kind -> (how, what the message must say)
    "truncated manifest": (lambda c: _truncate(c / "manifest.json", 0.5), "manifest.json is corrupted"),
    "unparsable manifest": (lambda c: (c / "manifest.json").write_text("{not json"), "manifest.json is corrupted"),
    "missing manifest": (lambda c: (c / "manifest.json").unlink(), "has no manifest.json"),
    "missing rank file": (lambda c: (c / "rank00000.bin").unlink(), "rank00000.bin is missing"),
    "wrong size": (lambda c: _truncate(c / "rank00000.bin", 0.9), "bytes, its records need"),
    "checksum mismatch": (lambda c: _flip(c / "rank00000.bin"), "does not match its checksum"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_each_kind_of_damage_is_named_and_kept(finished, tmp_path, kind):
    run = tmp_path / "r"
    shutil.copytree(finished, run)
    how, says = DAMAGE[kind]
    how(run / "checkpoint")
    _, resume = load_resume(run)
    assert resume.step == 4 and resume.checkpoint == run / "checkpoints" / "step-00000004"
    assert [p for p, _ in resume.damaged] == [run / "checkpoint"], resume.damaged
    assert says in resume.damaged[0][1], resume.damaged
    kept = set_aside(resume.damaged)
    assert kept == [run / "checkpoint.damaged"] and not (run / "checkpoint").exists()
    note = resume.damaged_note(kept)
    assert str(run / "checkpoint") in note and says in note and "the 2 tried" in note, note
    assert note.endswith(f"kept as {run / 'checkpoint.damaged'}"), note


def test_an_incomplete_save_is_named_and_left_for_the_next_save_to_remove(finished, tmp_path):
    run = tmp_path / "r"
    shutil.copytree(finished, run)
    partial = run / "checkpoints" / "step-00000006.tmp-1234"  # a save killed while writing
    shutil.copytree(run / "checkpoints" / "step-00000004", partial)
    (partial / "manifest.json").unlink()
    (partial / PARTIAL_MARKER).write_text("")
    _, resume = load_resume(run, None, ["run.steps=8"])
    assert resume.step == 6 and resume.checkpoint == run / "checkpoint"
    assert [p for p, _ in resume.damaged] == [partial]
    assert set_aside(resume.damaged) == [] and partial.exists()
    assert f"{partial} is an incomplete save" in resume.damaged_note([])


def test_every_damaged_candidate_is_listed_when_none_is_intact(finished, tmp_path):
    run = tmp_path / "r"
    shutil.copytree(finished, run)
    candidates = [run / "checkpoint", *sorted((run / "checkpoints").iterdir())]
    assert len(candidates) == 3
    DAMAGE["truncated manifest"][0](candidates[0])
    for c in candidates[1:]:
        _flip(c / "rank00000.bin")
    with pytest.raises(ConfigError) as e:
        load_resume(run)
    assert "3 tried" in str(e.value) and all(str(c) in str(e.value) for c in candidates), str(e.value)


def test_the_resumed_run_reports_the_damage_before_the_dropped_metrics(finished, tmp_path, capsys):
    """The command's lines in causal order: the damage, then the metrics records it made the run drop."""
    from infinity.job.cli import main
    run = tmp_path / "r"
    shutil.copytree(finished, run)
    DAMAGE["truncated manifest"][0](run / "checkpoint")
    assert main(["train", "--resume", str(run)]) == 0
    err = capsys.readouterr()
    lines = (err.out + err.err).splitlines()
    damage = next(i for i, line in enumerate(lines) if "is damaged" in line)
    dropped = next(i for i, line in enumerate(lines) if "dropped 2 metrics record(s)" in line)
    assert damage < dropped, lines
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # steps 5 and 6 trained again, each recorded once
    assert (run / "checkpoint.damaged").is_dir() and (run / "checkpoint" / "manifest.json").is_file()
