"""The training thread's own spans: its compute between waits, and where each step begins and ends.

On a GPU a compute span is device time: CUDA events on the compute stream around the kernels the
thread queued between two waits (`Profiler.device_span`), not the host time it took to launch them.

A profiled step runs from its first forward to the next step's first forward: with overlap its
update runs during that next forward, so it ends there (or at `close` for the last one).

The rest of the thread's time is named too (Note [step attribution] in records.py): `host(part)` spans the
engine's own host code (pausing an open compute span, so the two never overlap on the CPU), and the time
between the return of one engine call and the start of the next is the caller's (`call_begins`/`call_ends`).
"""

from __future__ import annotations

import contextlib
import time

from infinity.profile.spans import Link


class TrainingClock:
    """Compute spans and step marks of the training thread, recorded into `profiler` when it is enabled."""

    def __init__(self, profiler, device_time: bool = False):
        self.profiler = profiler
        self.device_time = device_time  # compute spans are CUDA events on the compute stream
        self._compute_since: float | None = None  # the training thread computes since then
        self._device_span = None  # the open device span of the compute in progress (device_time)
        self._step_started: float | None = None  # the first forward of the step in progress
        self._pending: tuple[int, float | None] | None = None  # (step, start) of the step the next one ends
        self._outside_since: float | None = None  # an engine call returned then: the caller runs since
        self._computing = False  # a compute span is open

    def call_begins(self) -> float:
        """An engine call starts (now, returned): the caller's time since the last one returned ends."""
        now = time.perf_counter()
        if self._outside_since is not None:
            self.profiler.record_host("caller", self._outside_since, now)
            self._outside_since = None
        return now

    def call_ends(self, at: float | None = None) -> None:
        """An engine call returns to the caller (who runs from `at`, default now, until the next call)."""
        if self.profiler.enabled:
            self._outside_since = at if at is not None else time.perf_counter()

    @contextlib.contextmanager
    def host(self, part: str, unit: str | None = None, during: str = "compute", start: float | None = None,
             then: str | None = None):
        """The body is host code of `part` (a HOST_PARTS key), from `start` (default now). An open compute span
        (of phase `during`) is closed where the body starts. After it, from the instant it ends: `then` =
        "compute" begins a compute span (as does a paused one), "caller" hands the thread to the caller.
        Consecutive parts share their boundary instant, so no time falls between them."""
        if not self.profiler.enabled:
            yield
            return
        paused = self._computing
        if paused:
            start = self.compute_end(f"{during} before {unit}" if unit else f"{during} until {part}")
        start = start if start is not None else time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self.profiler.record_host(part, start, end, unit=unit)
            if then == "caller":
                self.call_ends(at=end)
            elif paused or then == "compute":
                self.compute_begin(at=end)

    def compute_begin(self, at: float | None = None) -> None:
        """A compute span begins (at `at`, default now; on a GPU, at the compute stream's current point)."""
        self._computing = self.profiler.enabled
        if self.profiler.enabled and self.device_time:
            self._device_span = self.profiler.device_span("compute", Link.COMPUTE)
            self._device_span.__enter__()
        elif self.profiler.enabled:
            self._compute_since = at if at is not None else time.perf_counter()

    def compute_end(self, name: str) -> float:
        """Close the current compute span (the thread is about to wait, or is done); returns the instant."""
        self._computing = False
        now = time.perf_counter()
        if self._device_span is not None:
            span, self._device_span = self._device_span, None
            span.end(name)
        if self._compute_since is not None:
            self.profiler.record(name, Link.COMPUTE, self._compute_since, now)
            self._compute_since = None
        return now

    def forward_begins(self) -> None:
        """A forward starts: the first of a step starts it and ends the previous step."""
        if self._step_started is None and self.profiler.enabled:
            self._step_started = time.perf_counter()
            if self._pending is not None:
                self.profiler.record_step(*self._pending, self._step_started)  # the previous one ends here
                self._pending = None

    def stepped(self, step: int) -> None:
        """Optimizer step `step` was issued: it ends when the next one starts (its update overlaps that forward)."""
        if not self.profiler.enabled:
            return
        if self._pending is not None:  # a step with no forward after it
            self.profiler.record_step(*self._pending, time.perf_counter())
        self._pending = (step, self._step_started)
        self._step_started = None

    def close(self) -> None:
        """The last step ends now."""
        self.call_begins()  # (the caller's time since the last call)
        if self._pending is not None and self._pending[1] is not None:
            self.profiler.record_step(*self._pending, time.perf_counter())
            self._pending = None
