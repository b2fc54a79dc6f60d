"""`run.report_to`: the run's metrics go to the trackers it names beside metrics.jsonl. Each tracker's own files are
read back with its own reader (TensorBoard's EventAccumulator, wandb's protobuf records of its offline `.wandb`
file, MLflow's client, trackio's storage) and compared with metrics.jsonl of the same run, the reference.

One run writes to every tracker installed here (offline: no network, no login); the test of a tracker whose package
is not installed is skipped with the reason (CI installs tensorboard, wandb and trackio: the `test` extra).
"""

from __future__ import annotations

import json
import struct
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

from infinity.config.sections import ConfigError
from infinity.job.spec import load_job
from infinity.job.train import train

TINY = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.seq_len=16", "run.batch_size=2",
        "run.eval_batches=1", "run.eval_every=3", "run.steps=6", "profile.enabled=false", "optimizer.lr=1e-3"]
ALL = ("tensorboard", "wandb", "mlflow", "trackio")
RECORDED = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "memory_device_bytes", "process_rss_bytes",
            "memory_host_bytes", "memory_nvme_bytes", "val_loss")



@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run of the tiny job reporting to every tracker installed here; its directory and its records."""
    root = tmp_path_factory.mktemp("trackers")
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")  # no network, no login: the run stays in <run>/wandb
    mp.setenv("WANDB_DIR", str(root / "wandb-home"))  # (wandb's own settings and caches: not the user's)
    mp.setenv("WANDB_CONFIG_DIR", str(root / "wandb-home"))
    mp.setenv("WANDB_CACHE_DIR", str(root / "wandb-home"))
    mp.setenv("TRACKIO_DIR", str(root / "trackio"))  # its store, read when trackio is imported; and if another
    for name, module in list(sys.modules.items()):  # test imported it already, where its modules keep the path
        if name.split(".")[0] == "trackio" and isinstance(getattr(module, "TRACKIO_DIR", None), Path):
            mp.setattr(module, "TRACKIO_DIR", root / "trackio")
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)  # the sqlite store in the run directory
    names = [n for n in ALL if find_spec(n) is not None]
    try:
        train(load_job(None, TINY + [f"run.dir={root}", "run.name=r", f"run.report_to={json.dumps(names)}"]),
              verbose=False)
        records = [json.loads(line) for line in (root / "r" / "metrics.jsonl").read_text().splitlines()]
        yield root / "r", records, root
    finally:
        mp.undo()


def losses_of(records: list[dict], key: str = "loss") -> list[tuple[int, float]]:
    return [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in records if key in r]


def test_every_record_holds_the_memory_per_tier(run):
    """The state bytes per tier in each record are the engine's memory report at the end (a fixed placement)."""
    run_dir, records, _ = run
    report = json.loads((run_dir / "memory_report.json").read_text())
    for r in records:
        assert {f"memory_{t}_bytes": r[f"memory_{t}_bytes"] for t in ("device", "host", "nvme")} == {
            f"memory_{t}_bytes": report["tier_totals"][t] for t in ("device", "host", "nvme")}
    assert sum(report["tier_totals"].values()) > 0


def test_tensorboard_events_hold_the_runs_losses(run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run_dir, records, _ = run
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == losses_of(records)
    assert [(e.step, e.value) for e in events.Scalars("train/val_loss")] == losses_of(records, "val_loss")
    assert [e.step for e in events.Scalars("train/val_loss")] == [3, 6]
    assert {f"train/{k}" for k in RECORDED} <= set(events.Tags()["scalars"])
    assert "config" in " ".join(events.Tags()["tensors"])  # the run's config.toml as text


def wandb_records(path: Path):
    """The records of a `.wandb` file, each parsed by wandb's own protobuf message (wandb_internal_pb2.Record).
    The file is a LevelDB log, as wandb writes it: a 7-byte header (":W&B", 0xBEE1, version), then 32 KiB blocks
    of chunks, each a 7-byte header (checksum, length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes."""
    from wandb.proto.wandb_internal_pb2 import Record
    data, block = path.read_bytes(), 32768
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path} is not a wandb transaction log: {data[:7]!r}"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length, kind) == (0, 0):  # a block's zero-filled tail
            pos += left
            continue
        parts, pos = parts + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(parts)
            yield record
            parts = b""


def test_wandb_offline_run_holds_the_runs_losses(run):
    pytest.importorskip("wandb", reason="wandb not installed (pip install wandb, or the trackers extra)")
    run_dir, records, _ = run
    [path] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")  # in the run directory, offline
    rows, config = [], {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows.append(row | {"_step": record.history.step.num})
        elif record.WhichOneof("record_type") == "run":
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
    assert [(row["_step"], row["train/loss"]) for row in rows] == losses_of(records)
    assert [(row["_step"], row["train/val_loss"]) for row in rows if "train/val_loss" in row] == \
        losses_of(records, "val_loss")
    assert {f"train/{k}" for k in RECORDED} <= set().union(*rows)
    assert config["optimizer"]["lr"] == 1e-3 and config["run"]["steps"] == 6  # the hyper-parameters


@pytest.mark.slow  # mlflow's sqlite store creates its tables first: ~9 s on a 2-core machine
def test_mlflow_run_holds_the_runs_losses(run):
    pytest.importorskip("mlflow", reason="mlflow not installed (pip install mlflow, or the trackers extra)")
    from mlflow.tracking import MlflowClient
    run_dir, records, _ = run
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    [found] = client.search_runs([client.get_experiment_by_name("infinity").experiment_id])
    assert found.info.run_name == "r" and found.info.status == "FINISHED"
    history = client.get_metric_history(found.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == losses_of(records)
    val = client.get_metric_history(found.info.run_id, "train/val_loss")
    assert sorted((m.step, m.value) for m in val) == losses_of(records, "val_loss")
    assert {f"train/{k}" for k in RECORDED} <= set(found.data.metrics)
    assert found.data.params["optimizer.lr"] == "0.001" and found.data.params["run.steps"] == "6"


def test_trackio_run_holds_the_runs_losses(run):
    pytest.importorskip("trackio", reason="trackio not installed (pip install trackio, or the trackers extra)")
    from trackio.sqlite_storage import SQLiteStorage
    run_dir, records, root = run
    assert (root / "trackio").is_dir()  # TRACKIO_DIR: its local store, no network
    logs = SQLiteStorage.get_logs("infinity", "r")
    assert [(row["step"], row["train/loss"]) for row in logs] == losses_of(records)
    assert [(row["step"], row["train/val_loss"]) for row in logs if row.get("train/val_loss") is not None] == \
        losses_of(records, "val_loss")
    assert {f"train/{k}" for k in RECORDED} <= set().union(*logs)
    config = SQLiteStorage.get_run_config("infinity", "r")
    assert config["optimizer.lr"] == 1e-3 and config["run.steps"] == 6


def test_a_tracker_infinity_does_not_write_to_is_refused():
    with pytest.raises(ConfigError, match=r'"comet_ml" is not a tracker infinity train writes to \(not yet.*'
                                          r'use "tensorboard", "wandb", "mlflow", "trackio", or \[\]'):
        load_job(None, ['run.report_to=["comet_ml"]'])


@pytest.mark.parametrize("name", ALL)
def test_a_missing_tracker_package_stops_before_any_work(tmp_path, monkeypatch, name):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == name else real(n, *a))
    with pytest.raises(ConfigError, match=rf'^run.report_to = \["{name}"\] needs the {name} package: pip install '
                                          rf'{name} \(or pip install -e "\.\[trackers\]"\), or remove it'):
        train(load_job(None, TINY + [f"run.dir={tmp_path}", "run.name=r", f'run.report_to=["{name}"]']),
              verbose=False)
    assert not (tmp_path / "r").exists()


def test_wandb_online_without_a_login_stops_before_the_model_with_the_fix(tmp_path, monkeypatch):
    """Online (WANDB_MODE unset) with no API key, wandb cannot start its run: one line naming `wandb login` and
    WANDB_MODE=offline, before the model is built (nothing trained, the run directory removed)."""
    wandb = pytest.importorskip("wandb", reason="wandb not installed (pip install wandb, or the trackers extra)")
    import infinity.job.train as job_train
    wandb.teardown()  # wandb reads its environment once a process: forget the offline mode of the run above
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-home"))  # no settings, no key
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # (nor the user's ~/.netrc)
    built = []
    monkeypatch.setattr(job_train, "build_model", lambda *a: built.append(a))
    with pytest.raises(ConfigError, match=r'^run.report_to = \["wandb"\]: wandb could not start its run \(.*API '
                                          r'key.*\); run `wandb login`, or set WANDB_MODE=offline') as error:
        train(load_job(None, TINY + [f"run.dir={tmp_path}", "run.name=r", 'run.report_to=["wandb"]']),
              verbose=False)
    assert "\n" not in str(error.value) and built == [] and not (tmp_path / "r").exists()
