"""`run.report_to`: the run's metrics go to the trackers it names beside metrics.jsonl; TensorBoard's own reader
reads the event files back with the run's loss values (the reference: metrics.jsonl of the same run)."""

from __future__ import annotations

import json

import pytest

from infinity.config.sections import ConfigError
from infinity.job.spec import load_job
from infinity.job.train import train

TINY = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.seq_len=16", "run.batch_size=2",
        "run.eval_batches=1", "run.eval_every=3", "run.steps=6", "profile.enabled=false"]

pytestmark = pytest.mark.usefixtures("module_cache")


def test_tensorboard_events_hold_the_runs_losses(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    train(load_job(None, TINY + [f"run.dir={tmp_path}", "run.name=r", 'run.report_to=["tensorboard"]']),
          verbose=False)
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(tmp_path / "r" / "tensorboard"))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert losses == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in records]
    assert [e.step for e in events.Scalars("train/val_loss")] == [3, 6]
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s", "train/step_time_s"} <= set(events.Tags()["scalars"])
    assert "config" in " ".join(events.Tags()["tensors"])  # the run's config.toml as text


def test_a_tracker_infinity_does_not_write_to_is_refused():
    with pytest.raises(ConfigError, match=r'"wandb" is not a tracker infinity train writes to \(not yet.*'
                                          r'use "tensorboard", or \[\]'):
        load_job(None, ['run.report_to=["wandb"]'])


def test_a_missing_tracker_package_stops_before_any_work(tmp_path, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match="needs the tensorboard package: pip install tensorboard"):
        train(load_job(None, TINY + [f"run.dir={tmp_path}", "run.name=r", 'run.report_to=["tensorboard"]']),
              verbose=False)
    assert not (tmp_path / "r").exists()
