"""What the profiler records: links, spans and step marks (the writers read only these)."""

from __future__ import annotations

import dataclasses
import enum


class Link(enum.Enum):
    """A resource that carries work; one lane per link in the trace and chart.

    The values are the display names and the keys of `summary()["links"]`.
    """

    COMPUTE = "compute"  # the training thread's work on the device (or CPU)
    NVME_READ = "nvme_read"  # swap file -> pinned host staging
    NVME_WRITE = "nvme_write"  # pinned host staging -> swap file
    H2D = "h2d"  # host -> device copies
    D2H = "d2h"  # device -> host copies
    ALL_GATHER = "all_gather"  # unshard parameters
    REDUCE_SCATTER = "reduce_scatter"  # shard gradients
    CPU_OPTIMIZER = "cpu_optimizer"  # optimizer sub-steps on the CPU


class SpanKind(enum.Enum):
    """What a span's interval means for its link."""

    WORK = "work"  # the link was busy (counts in busy time, bytes)
    WAIT = "wait"  # compute was blocked on the link (counts in exposed time)


@dataclasses.dataclass(frozen=True, slots=True)
class Span:
    """One recorded interval; `start`/`end` in `time.perf_counter()` seconds."""

    name: str
    link: Link
    start: float
    end: float
    num_bytes: int = 0
    unit: str | None = None  # the unit's qualified name, when the span serves one
    kind: SpanKind = SpanKind.WORK


@dataclasses.dataclass(frozen=True, slots=True)
class StepMark:
    """The host-clock boundaries of one training step."""

    step: int
    begin: float
    end: float


ON_DEMAND = "on-demand fetch"  # name prefix of the mark of an unshard nothing prefetched (prefetch.py)

__all__ = ["Link", "ON_DEMAND", "Span", "SpanKind", "StepMark"]
