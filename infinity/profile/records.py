"""What the profiler records: links, spans and step marks (the writers read only these)."""

from __future__ import annotations

import dataclasses
import enum


class Link(enum.Enum):
    """A resource that carries work; one lane per link in the trace and chart.

    The values are the display names and the keys of `summary()["links"]`.

    Note [collective bytes]: a collective's span carries its communication volume in the ZeRO
    papers' convention, per element of the whole buffer: 1 for an all-gather (its output) and a
    reduce-scatter (its input), 2 for an all-reduce (a reduce-scatter then an all-gather), times
    the element size; padding to the world size included (it is sent). So a step's bytes on the
    three collective links, over the element sizes, are `Stage.comm_elements` of the padded units.
    The scalar all-reductions (the gradient norm, the per-parameter gradient flags) are not counted.
    """

    COMPUTE = "compute"  # the training thread's work on the device (or CPU)
    NVME_READ = "nvme_read"  # swap file -> pinned host staging
    NVME_WRITE = "nvme_write"  # pinned host staging -> swap file
    H2D = "h2d"  # host -> device copies
    D2H = "d2h"  # device -> host copies
    ALL_GATHER = "all_gather"  # unshard parameters (stage 3), or gather the updated partitions (stages 1-2)
    REDUCE_SCATTER = "reduce_scatter"  # shard gradients (stages 1-3)
    ALL_REDUCE = "all_reduce"  # sum whole gradients (stage 0)
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
