"""The trackers `run.report_to` names: sinks of the run's metrics (job/metrics.py) beside metrics.jsonl.

One type per tracker, one interface (`metrics.Sink`: `write(record)`, `close(ok)`), made on rank 0 when the run
starts. Each gets the run's config (its config.toml) as hyper-parameters and, at each record's step, one scalar per
numeric field under "train/": loss, lr, grad_norm, step_time_s, tokens_per_s, overlap_efficiency, the state bytes
per tier (memory_device_bytes, memory_host_bytes, memory_nvme_bytes), process_rss_bytes, and val_loss on the steps
that measure it. The names are the ones transformers' `report_to` uses.

    "tensorboard"  event files in <run>/tensorboard (torch's SummaryWriter); the config as text
    "wandb"        a run in <run>/wandb; WANDB_MODE (online / offline) and WANDB_PROJECT as wandb reads them
    "mlflow"       MLFLOW_TRACKING_URI (a server) if set, else a sqlite store <run>/mlflow.db; experiment
                   MLFLOW_EXPERIMENT_NAME or "infinity"
    "trackio"      trackio's local store (TRACKIO_DIR, else its default), project TRACKIO_PROJECT or "infinity"

The tracker's run is named after the run directory. Each tracker is an optional package (the `trackers` extra): a
run that names one that is not installed stops before any work with the pip line, and a tracker that cannot start
(wandb online without a login, an unreachable mlflow server) stops the run before its first step, with its own
message and what to change. A resumed run is a new run of the tracker, from the checkpoint's step on.
"""

from __future__ import annotations

import contextlib
import io
import os
import time
import tomllib
from pathlib import Path

from infinity.config.options import ConfigError

PREFIX = "train/"
PACKAGES = {  # name in run.report_to -> (module to import, what to pip install)
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "trackio": ("trackio", "trackio"),
}


def check_installed(names: tuple[str, ...]) -> None:
    """Refuse, before any work, a tracker whose package is missing."""
    from importlib.util import find_spec
    for name in names:
        module, pip = PACKAGES[name]
        if find_spec(module) is None:
            raise ConfigError(f'run.report_to = ["{name}"] needs the {pip} package: pip install {pip} (or pip install '
                              f'-e ".[trackers]"), or remove it from run.report_to')


def scalars(record: dict) -> dict[str, float]:
    """The record's numeric fields, named as every tracker gets them ("train/loss", ...); not the step itself,
    nor flags (skipped) or fields a step leaves empty (overlap_efficiency between its measurements)."""
    return {PREFIX + key: float(value) for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


def hyperparameters(config_text: str) -> dict[str, object]:
    """The run's config.toml as flat "section.key" -> value (lists as they are)."""
    flat: dict[str, object] = {}

    def walk(prefix: str, table: dict) -> None:
        for key, value in table.items():
            if isinstance(value, dict):
                walk(f"{prefix}{key}.", value)
            else:
                flat[prefix + key] = value
    walk("", tomllib.loads(config_text))
    return flat


class TensorBoard:
    """Event files of the run in <run>/tensorboard (torch's SummaryWriter)."""

    def __init__(self, run_dir: Path, config_text: str):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
        self.writer.add_text("config", "```\n" + config_text + "\n```")

    def write(self, record: dict) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, int(record["step"]))
        self.writer.flush()

    def close(self, ok: bool = True) -> None:
        self.writer.close()


class WandB:
    """A Weights & Biases run in <run>/wandb: synced as it goes online, kept for `wandb sync` offline
    (WANDB_MODE=offline: no network, no login)."""

    def __init__(self, run_dir: Path, config_text: str):
        import wandb
        run_dir = Path(run_dir)
        try:
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "infinity", name=run_dir.name,
                                  dir=str(run_dir), config=tomllib.loads(config_text),
                                  settings=wandb.Settings(console="off", silent=True))
        except wandb.errors.Error as e:
            raise ConfigError(f'run.report_to = ["wandb"]: wandb could not start its run ({e}); run `wandb login`, '
                              f'or set WANDB_MODE=offline (the run is kept in {run_dir}/wandb for `wandb sync`), or '
                              f'remove "wandb" from run.report_to') from e

    def write(self, record: dict) -> None:
        self.run.log(scalars(record), step=int(record["step"]))

    def close(self, ok: bool = True) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class MLflow:
    """An MLflow run: to MLFLOW_TRACKING_URI when set (a tracking server), else to a sqlite store in the run
    directory (`mlflow ui --backend-store-uri sqlite:///<run>/mlflow.db`)."""

    def __init__(self, run_dir: Path, config_text: str):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        run_dir = Path(run_dir)
        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
        try:
            self.client = MlflowClient(tracking_uri=self.uri)
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "infinity"
            found = self.client.get_experiment_by_name(name)
            experiment = found.experiment_id if found is not None else self.client.create_experiment(name)
            self.run_id = self.client.create_run(experiment, run_name=run_dir.name,
                                                 tags={"infinity.run_dir": str(run_dir)}).info.run_id
        except ImportError as e:  # mlflow-skinny: no sqlalchemy for the sqlite store
            raise ConfigError(f'run.report_to = ["mlflow"]: the store {self.uri} needs {e.name} (mlflow-skinny has no '
                              f'sqlite store): pip install mlflow, or set MLFLOW_TRACKING_URI to a tracking '
                              f'server') from e
        except Exception as e:  # noqa: BLE001 - mlflow's errors (MlflowException, connection errors): said, raised
            raise ConfigError(f'run.report_to = ["mlflow"]: mlflow could not start a run at {self.uri} '
                              f'({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}); set '
                              f'MLFLOW_TRACKING_URI to a reachable store, or remove "mlflow" from run.report_to') from e
        params = [Param(key, str(value)) for key, value in hyperparameters(config_text).items()]
        for i in range(0, len(params), 100):  # (mlflow takes at most 100 params per batch)
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def write(self, record: dict) -> None:
        from mlflow.entities import Metric
        now, step = int(time.time() * 1000), int(record["step"])
        self.client.log_batch(self.run_id, metrics=[Metric(key, value, now, step)
                                                    for key, value in scalars(record).items()])

    def close(self, ok: bool = True) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


class Trackio:
    """A trackio run in its local store (TRACKIO_DIR, else trackio's default; `trackio show` opens it): no
    network unless a Space is configured through trackio's own settings."""

    def __init__(self, run_dir: Path, config_text: str):
        with contextlib.redirect_stdout(io.StringIO()):  # its banner: the run's output stays the run's own
            import trackio
            self.trackio = trackio
            self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT") or "infinity", name=Path(run_dir).name,
                                    config=hyperparameters(config_text), auto_log_cpu=False, auto_log_gpu=False)

    def write(self, record: dict) -> None:
        self.run.log(scalars(record), step=int(record["step"]))

    def close(self, ok: bool = True) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            self.trackio.finish()  # (the module's: it also forgets the run, which its exit hook would finish again)


SINKS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow, "trackio": Trackio}


def trackers(names: tuple[str, ...], run_dir: Path, config_text: str) -> tuple:
    """The sinks `run.report_to` names, for rank 0 (those made already are closed if a later one cannot start)."""
    made = []
    try:
        for name in names:
            made.append(SINKS[name](run_dir, config_text))
    except BaseException:
        for sink in made:
            sink.close(ok=False)
        raise
    return tuple(made)
