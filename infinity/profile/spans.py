"""Recording spans: the `Profiler` and its do-nothing twin `NullProfiler`.

A span is one interval of work on one link (a unit's forward on COMPUTE, an
NVMe read of a unit's parameters on NVME_READ), or one interval in which
compute waited on a link (kind WAIT: that link's exposed time). Times are
`time.perf_counter()` seconds (CLOCK_MONOTONIC on Linux, so the ranks of one
host share a clock).

Thread safety: spans are appended under one lock, so I/O worker threads may
`record` completions while the training thread opens spans. Each `span`/`wait`
context manager belongs to the thread that entered it.

Note [profile window]: a run profiled from start to end (`infinity train` profiles by default) kept every
span of every step: memory that grew with the run (~70 spans a step for a 3-unit model, thousands for a big
one) and an end-of-run report whose time grew with it (a tiny model stopped at step 263 spent 6 s on it). The
profiler keeps the latest `keep_steps` steps (`[profile] keep_steps`, 100 by default) and the spans that end
after the first of them began: past twice that many it forgets the older ones at once (amortized: one pass
per `keep_steps` steps). `steps()`, the summary, the trace and the chart hold those steps;
`completed_steps` counts every step.

Cost: with `NullProfiler`, `span`/`wait` return one shared null context
manager (no allocation); hot paths that build names with f-strings can check
`prof.enabled` first. With `Profiler`, a span costs one small object, two
clock reads and a locked append; its `torch.profiler.record_function` range is
opened only while a torch profiler is active.
"""

from __future__ import annotations

import threading
import time

import torch

from infinity.profile import device as device_timing
from infinity.profile.records import Link, Span, SpanKind, StepMark


class _SpanTimer:
    """Context manager of one live span: times its body, records on exit.

    `num_bytes` may be set inside the body when the size is known only then.
    """

    __slots__ = ("_profiler", "_name", "_link", "_unit", "_kind", "_start", "_torch_range", "num_bytes")

    def __init__(self, profiler: Profiler, name: str, link: Link, num_bytes: int, unit: str | None, kind: SpanKind):
        self._profiler = profiler
        self._name = name
        self._link = link
        self._unit = unit
        self._kind = kind
        self._torch_range = None
        self.num_bytes = num_bytes

    def __enter__(self) -> _SpanTimer:
        if torch.autograd._profiler_enabled():  # a torch profiler is recording: show the span there too
            self._torch_range = torch.profiler.record_function(self._name)
            self._torch_range.__enter__()
        self._start = time.perf_counter()
        return self

    def end(self, name: str) -> None:
        """Close the span under `name` (known only at its end)."""
        self._name = name
        self.__exit__(None, None, None)

    def __exit__(self, *exc) -> bool:
        end = time.perf_counter()
        if self._torch_range is not None:
            self._torch_range.__exit__(*exc)
        self._profiler._append(Span(self._name, self._link, self._start, end, self.num_bytes, self._unit, self._kind))
        return False


class _IssuedOnHost:
    """A collective's span on the CPU (`Profiler.collective`): from its issue (the end of the body) to `done()`,
    when the wait found it complete; without a device, that host time is its time."""

    __slots__ = ("_profiler", "_name", "_link", "_unit", "_issued", "num_bytes")

    def __init__(self, profiler: Profiler, name: str, link: Link, num_bytes: int, unit: str | None):
        self._profiler, self._name, self._link, self._unit, self.num_bytes = profiler, name, link, unit, num_bytes
        self._issued = None

    def __enter__(self) -> _IssuedOnHost:
        return self

    def __exit__(self, *exc) -> bool:
        self._issued = time.perf_counter()
        return False

    def done(self) -> None:
        self._profiler.record(self._name, self._link, self._issued, time.perf_counter(), num_bytes=self.num_bytes,
                              unit=self._unit)


class _NullSpan:
    """The shared do-nothing context manager of `NullProfiler`."""

    __slots__ = ("num_bytes",)

    def __init__(self):
        self.num_bytes = 0

    def __enter__(self) -> _NullSpan:
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def done(self) -> None:
        pass


_NULL_SPAN = _NullSpan()


def _normalize_peaks(peaks_GBps) -> dict[Link, float]:
    """Accept `{Link.NVME_READ: 6.5}` or `{"nvme_read": 6.5}`."""
    peaks = {}
    for key, value in (peaks_GBps or {}).items():
        link = key if isinstance(key, Link) else Link(key)
        if not value > 0:
            raise ValueError(f"peaks_GBps[{link.value!r}] = {value!r}: give a positive measured bandwidth or "
                             f"leave it out")
        peaks[link] = float(value)
    return peaks


class Profiler:
    """Records spans and step boundaries; turns them into trace, summary, chart.

    Args:
        rank: this process's rank: the trace's pid and the chart's title.
        peaks_GBps: measured peak bandwidth per link, in decimal GB/s (for
            achieved-vs-peak in the summary); links left out get no fraction.
    """

    enabled = True
    completed_steps = 0  # every step marked, the forgotten ones too (set per instance)

    def __init__(self, rank: int = 0, peaks_GBps: dict | None = None, keep_steps: int = 0):
        """`keep_steps`: the latest steps whose spans are kept (0: every step; `[profile] keep_steps`)."""
        self.rank = rank
        self.peaks_GBps = _normalize_peaks(peaks_GBps)
        if keep_steps < 0:
            raise ValueError(f"keep_steps must be >= 0, got {keep_steps}")
        self.keep_steps = keep_steps
        self.completed_steps = 0
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self._steps: list[StepMark] = []
        self._open_steps: dict[int, float] = {}
        self._device = device_timing.DeviceSpans(self._append)
        self.predicted_bytes: dict[str, int] | None = None  # the byte model's per steady step, set by the engine
        self.training_thread = threading.current_thread().name  # the engine's: its host syncs are counted apart

    # ---- recording ----------------------------------------------------

    def span(self, name: str, link: Link, *, num_bytes: int = 0, unit: str | None = None) -> _SpanTimer:
        """Time the body on the host clock as work on `link`."""
        return _SpanTimer(self, name, link, num_bytes, unit, SpanKind.WORK)

    def wait(self, link: Link, name: str) -> _SpanTimer:
        """Time the body as compute blocked on `link` (its exposed time)."""
        return _SpanTimer(self, name, link, 0, None, SpanKind.WAIT)

    def host(self, part: str, *, unit: str | None = None) -> _SpanTimer:
        """Time the body as the training thread's host code of `part` (a `HOST_PARTS` key: Note [step
        attribution])."""
        return _SpanTimer(self, part, Link.COMPUTE, 0, unit, SpanKind.HOST)

    def record_host(self, part: str, start: float, end: float, *, unit: str | None = None) -> None:
        """Add an already-timed stretch of host code of `part`."""
        if end < start:
            raise ValueError(f"host span {part!r} ends before it starts (start={start}, end={end})")
        self._append(Span(part, Link.COMPUTE, start, end, 0, unit, SpanKind.HOST))

    def heard_sync(self, thread: str, why: str) -> None:
        """A listener of the host syncs (`streams.listen_host_syncs`): each is recorded with its thread."""
        self.record_sync(f"{why} ({thread})")

    def record_sync(self, why: str) -> None:
        """A host synchronization now (Note [host syncs]): counted per step."""
        now = time.perf_counter()
        self._append(Span(why, Link.COMPUTE, now, now, 0, None, SpanKind.SYNC))

    def device_span(self, name: str, link: Link, *, stream=None, num_bytes: int = 0, unit: str | None = None):
        """Time the work the body enqueues on a CUDA `stream` (default: current).

        Asynchronous copies and collectives take ~no host time; this records
        CUDA events around them and maps their times onto the host clock when
        they complete. Without CUDA it is `span`.
        """
        if not self._device.available:
            return self.span(name, link, num_bytes=num_bytes, unit=unit)
        return self._device.timer(name, link, stream, num_bytes, unit)

    def collective(self, name: str, link: Link, *, stream=None, num_bytes: int = 0, unit: str | None = None):
        """The span of a collective issued in the body; call its `done()` once it was waited for. On a GPU
        (a CUDA `stream`) it is device time: events on `stream` around the body, where the caller makes `stream`
        wait for the collective (so the end event is its completion) and `done()` does nothing. On the CPU it
        runs on the host from the issue to `done()` (the host span is the device time)."""
        if not self._device.available or stream is None:
            return _IssuedOnHost(self, name, link, num_bytes, unit)
        return self._device.timer(name, link, stream, num_bytes, unit)

    def record(self, name: str, link: Link, start: float, end: float, *, num_bytes: int = 0,
               unit: str | None = None) -> None:
        """Add an already-timed span (e.g. an I/O completion on a worker thread)."""
        if end < start:
            raise ValueError(f"span {name!r} ends before it starts (start={start}, end={end}): pass "
                             f"time.perf_counter() values")
        self._append(Span(name, link, start, end, num_bytes, unit, SpanKind.WORK))

    def record_wait(self, link: Link, name: str, start: float, end: float) -> None:
        """Add an already-timed wait of compute on `link`."""
        if end < start:
            raise ValueError(f"wait {name!r} ends before it starts (start={start}, end={end}): pass "
                             f"time.perf_counter() values")
        self._append(Span(name, link, start, end, 0, None, SpanKind.WAIT))

    def step_begin(self, step: int) -> None:
        """Mark the start of training step `step` (now)."""
        now = time.perf_counter()
        with self._lock:
            if step in self._open_steps:
                raise ValueError(f"step_begin({step}) twice without step_end({step})")
            self._open_steps[step] = now

    def step_end(self, step: int) -> None:
        """Mark the end of training step `step` (now)."""
        now = time.perf_counter()
        with self._lock:
            if step not in self._open_steps:
                raise ValueError(f"step_end({step}) without step_begin({step}); open steps: {sorted(self._open_steps)}")
            self._step_done(StepMark(step, self._open_steps.pop(step), now))
        self._device.collect(block=False)  # resolve device spans that already completed

    def record_step(self, step: int, begin: float, end: float) -> None:
        """Add an already-timed step (`time.perf_counter()` seconds)."""
        if end < begin:
            raise ValueError(f"step {step} ends before it begins (begin={begin}, end={end})")
        with self._lock:
            self._step_done(StepMark(step, begin, end))

    def _step_done(self, mark: StepMark) -> None:
        """Note [profile window]: past 2 x keep_steps steps, forget all but the latest keep_steps and the spans
        that end before the first of them (under the lock)."""
        self._steps.append(mark)
        self.completed_steps += 1
        if self.keep_steps and len(self._steps) >= 2 * self.keep_steps:
            self._steps = self._steps[-self.keep_steps:]
            cutoff = min(m.begin for m in self._steps)
            self._spans = [s for s in self._spans if s.end >= cutoff]

    def _append(self, span: Span) -> None:
        with self._lock:
            self._spans.append(span)

    def clear(self) -> None:
        """Forget every span and step (e.g. after warm-up steps)."""
        self._device.collect(block=True)
        with self._lock:
            self._spans.clear()
            self._steps.clear()
            self._open_steps.clear()

    # ---- reading ------------------------------------------------------

    def spans(self) -> list[Span]:
        """A snapshot of the recorded spans (pending device spans resolved)."""
        self._device.collect(block=True)
        with self._lock:
            return list(self._spans)

    def steps(self) -> list[StepMark]:
        """A snapshot of the completed steps, in order of completion (the latest `keep_steps` when set)."""
        with self._lock:
            return list(self._steps[-self.keep_steps:] if self.keep_steps else self._steps)

    def summary(self) -> dict:
        """Per-step and median overlap summary; see `summary.summarize`."""
        from infinity.profile.summary import summarize

        steps = self.steps()
        return summarize(self.spans(), steps, self.peaks_GBps, rank=self.rank, predicted_bytes=self.predicted_bytes,
                         training_thread=self.training_thread, forgotten_steps=self.completed_steps - len(steps))

    def write(self, out_dir: str, *, print_table: bool = True) -> dict[str, str]:
        """Write trace.json, summary.json and timeline.png under `out_dir`.

        Use one directory per rank (e.g. f"profile/rank{rank}"). Returns
        {"trace": path, "summary": path, "timeline": path}; "timeline" is
        missing when matplotlib is not installed. Prints the summary table
        unless `print_table` is False.
        """
        import json
        import os

        from infinity.profile import chart, chrome
        from infinity.profile.summary import format_summary, summarize
        from io_engine import atomic_write

        spans, steps = self.spans(), self.steps()
        if steps and self.completed_steps > len(steps):  # (the trace and chart: the kept steps' spans alone)
            first = min(m.begin for m in steps)
            spans = [s for s in spans if s.end >= first]
        summary = summarize(spans, steps, self.peaks_GBps, rank=self.rank, predicted_bytes=self.predicted_bytes,
                            training_thread=self.training_thread, forgotten_steps=self.completed_steps - len(steps))
        os.makedirs(out_dir, exist_ok=True)
        paths = {"trace": os.path.join(out_dir, "trace.json"), "summary": os.path.join(out_dir, "summary.json")}
        atomic_write(paths["trace"], json.dumps(chrome.chrome_trace(spans, steps, rank=self.rank)))
        atomic_write(paths["summary"], json.dumps(summary, indent=2))
        timeline = os.path.join(out_dir, "timeline.png")
        if chart.draw_timeline(spans, steps, summary, timeline):
            paths["timeline"] = timeline
        if print_table:
            print(format_summary(summary))
        return paths


class NullProfiler:
    """`Profiler`'s interface, doing nothing: the default when profiling is off.

    `span`, `wait` and `device_span` return one shared null context manager.
    """

    enabled = False
    completed_steps = 0

    def __init__(self, rank: int = 0, peaks_GBps: dict | None = None, keep_steps: int = 0):
        self.rank = rank
        self.peaks_GBps = {}
        self.predicted_bytes = None

    def span(self, name: str, link: Link, *, num_bytes: int = 0, unit: str | None = None) -> _NullSpan:
        return _NULL_SPAN

    def wait(self, link: Link, name: str) -> _NullSpan:
        return _NULL_SPAN

    def host(self, part: str, *, unit: str | None = None) -> _NullSpan:
        return _NULL_SPAN

    def record_host(self, part: str, start: float, end: float, *, unit: str | None = None) -> None:
        pass

    def heard_sync(self, thread: str, why: str) -> None:
        pass

    def record_sync(self, why: str) -> None:
        pass

    def device_span(self, name: str, link: Link, *, stream=None, num_bytes: int = 0,
                    unit: str | None = None) -> _NullSpan:
        return _NULL_SPAN

    def collective(self, name: str, link: Link, *, stream=None, num_bytes: int = 0,
                   unit: str | None = None) -> _NullSpan:
        return _NULL_SPAN

    def record(self, name: str, link: Link, start: float, end: float, *, num_bytes: int = 0,
               unit: str | None = None) -> None:
        pass

    def record_wait(self, link: Link, name: str, start: float, end: float) -> None:
        pass

    def step_begin(self, step: int) -> None:
        pass

    def step_end(self, step: int) -> None:
        pass

    def record_step(self, step: int, begin: float, end: float) -> None:
        pass

    def clear(self) -> None:
        pass

    def spans(self) -> list[Span]:
        return []

    def steps(self) -> list[StepMark]:
        return []

    def summary(self) -> dict:
        return {"rank": self.rank, "num_steps": 0, "steps": [], "median": None}

    def write(self, out_dir: str, *, print_table: bool = True) -> dict[str, str]:
        return {}
