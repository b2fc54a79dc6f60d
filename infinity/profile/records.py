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
    HOST = "host"  # the training thread ran host code, neither compute nor a wait: its name is a HOST_PARTS key
    SYNC = "sync"  # an instant: a thread blocked until the device reached a point (Note [host syncs])


# Note [step attribution]: the host parts of a step, in their order of precedence (summary.attribute). A HOST
# span is named by one of these keys, and `unit` may say which unit a hook served. The engine records the first
# three; the job names the caller's time it knows (eval, checkpoint, loss, data, log: a part nested in another is
# named by the inner one, first in this order); `caller` is the rest of the
# time the training thread spent outside the engine's calls, measured from one call's return to the next call.
HOST_PARTS = {
    "hooks": "the engine's unit hooks outside their waits: issuing fetches and prefetches, resharding, "
             "issuing gradient reductions and updates",
    "heap": "returning the step's freed memory to the OS (malloc_trim: [memory] release_heap)",
    "engine": "the engine's own bookkeeping: moving the inputs, ending a forward, the end of backward "
              "(gradients of unused parameters, drain), the step (gradient norm, update issue)",
    "eval": "the caller's validation",
    "checkpoint": "the caller's checkpoint save",
    "loss": "the caller's loss function outside the engine's forward: building the model's inputs (masks, "
            "positions); the loss computed on the forward's output counts as compute",
    "data": "the caller's next batch (read, collated, moved to the device)",
    "log": "the caller's loss read, metrics and progress",
    "caller": "the rest of the caller's code between engine calls (outside engine(...), backward, step)",
}


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

__all__ = ["HOST_PARTS", "Link", "ON_DEMAND", "Span", "SpanKind", "StepMark"]
