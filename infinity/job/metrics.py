"""The run's metrics: one JSON record per optimizer step (with the validation loss on the steps that measure
it) in `<run>/metrics.jsonl`, written by rank 0, and what a resume reads back from it.

Every record passes through `Metrics.record`, which hands it to each sink: the JSONL file is the one every
run has; a tracker (TensorBoard, Weights & Biases, MLflow, trackio: job/trackers.py) is another sink with the same
`write` and `close`. A record holds the step's loss, lr, grad norm, time, tokens, overlap and the state bytes per
tier (`memory_fields`: the engine's memory report).
Ranks other than 0 record nothing (`Metrics(None)`).

Note [metrics on resume]: a checkpoint is older than the run's last records (the steps after it are trained
again), so a resume first keeps only the records of steps up to the checkpoint's (`Metrics.resumed`), then
appends: the file holds each step once, in order, and the earlier losses and trained tokens come from it. A line
a killed run left half-written is dropped with the records after the checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from io_engine import atomic_write

FILE = "metrics.jsonl"


class Sink(Protocol):
    def write(self, record: dict) -> None: ...

    def close(self, ok: bool = True) -> None: ...  # ok: the run ended without an error (a tracker marks it)


class JsonLines:
    """The run's own sink: metrics.jsonl, one line a record, flushed at each (a killed run keeps its steps)."""

    def __init__(self, path: Path):
        self.file = path.open("a")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self, ok: bool = True) -> None:
        self.file.close()


@dataclass
class Earlier:
    """What the kept records say of the steps before a resume (Note [metrics on resume])."""

    dropped: int = 0  # records of steps after the checkpoint (and half-written lines), removed
    losses: list[float] = field(default_factory=list)
    tokens: int = 0  # trained tokens up to the checkpoint (the last kept record's running total)


class Metrics:
    """The per-step record of a run (rank 0: `run_dir`'s metrics.jsonl; other ranks: `run_dir` None)."""

    def __init__(self, run_dir: Path | None, sinks: tuple[Sink, ...] = ()):
        self.path = None if run_dir is None else Path(run_dir) / FILE
        self.sinks: list[Sink] = list(sinks)

    def resumed(self, last_step: int) -> Earlier:
        """Keep the records of steps <= `last_step` (the checkpoint's) and read what they say."""
        if self.path is None:
            return Earlier()
        lines = _records(self.path)
        kept = [(line, record) for line, record in lines
                if record is not None and record.get("step", 0) <= last_step]
        if len(kept) != len(lines):
            atomic_write(self.path, "".join(line + "\n" for line, _ in kept))
        records = [record for _, record in kept]
        return Earlier(dropped=len(lines) - len(kept), losses=[r["loss"] for r in records],
                       tokens=int(records[-1].get("tokens", 0)) if records else 0)

    def step_seconds(self) -> dict[int, float]:
        """step -> its seconds ("step_time_s") of the records kept (the whole run's, across resumes)."""
        records = [r for _, r in _records(self.path)] if self.path is not None else []
        return {int(r["step"]): float(r["step_time_s"]) for r in records if r is not None and "step_time_s" in r}

    def __enter__(self) -> Metrics:
        if self.path is not None:
            self.sinks.insert(0, JsonLines(self.path))
        return self

    def record(self, record: dict) -> None:
        for sink in self.sinks:
            sink.write(record)

    def __exit__(self, kind, *exc) -> None:
        for sink in self.sinks:
            sink.close(ok=kind is None)
        self.sinks.clear()


def memory_fields(report: dict) -> dict:
    """The engine's memory report (`engine.memory_report()`) as a record's fields: state bytes per tier (params,
    grads and optimizer state on device, host, nvme) and the process's resident memory."""
    fields = {f"memory_{tier}_bytes": int(total) for tier, total in report["tier_totals"].items()}
    fields["process_rss_bytes"] = int(report["process_rss_bytes"])
    if "cuda_peak_bytes" in report:
        fields["cuda_peak_bytes"] = int(report["cuda_peak_bytes"])
    return fields


def _records(path: Path) -> list[tuple[str, dict | None]]:
    """(line, record) of metrics.jsonl; record None for a line a killed run left half-written."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append((line, json.loads(line)))
        except ValueError:
            out.append((line, None))
    return out
