"""The trackers `run.report_to` names: sinks of the run's metrics (job/metrics.py) beside metrics.jsonl.

"tensorboard": event files in <run>/tensorboard, one scalar per numeric field of each record (loss, lr,
grad_norm, step_time_s, tokens_per_s, overlap_efficiency, val_loss...) at its step, and the run's config.toml as
text; TensorBoard's own reader reads them back. Each tracker is an optional package: a run that names one that is
not installed stops before its first step with the pip line.
"""

from __future__ import annotations

from pathlib import Path

from infinity.config.options import ConfigError


def check_installed(names: tuple[str, ...]) -> None:
    """Refuse, before any work, a tracker whose package is missing."""
    from importlib.util import find_spec
    for name in names:
        if name == "tensorboard" and find_spec("tensorboard") is None:
            raise ConfigError('run.report_to = ["tensorboard"] needs the tensorboard package: pip install '
                              'tensorboard (or pip install -e ".[trackers]"), or remove it from run.report_to')


class TensorBoard:
    """Event files of the run in <run>/tensorboard (torch's SummaryWriter)."""

    def __init__(self, run_dir: Path, config_text: str):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
        self.writer.add_text("config", "```\n" + config_text + "\n```")

    def write(self, record: dict) -> None:
        step = int(record["step"])
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"train/{key}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def trackers(names: tuple[str, ...], run_dir: Path, config_text: str) -> tuple:
    """The sinks `run.report_to` names, for rank 0."""
    return tuple(TensorBoard(run_dir, config_text) for name in names if name == "tensorboard")
