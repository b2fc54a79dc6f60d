"""Device spans: time work enqueued on a CUDA stream, on the host clock.

A host-clock span around an asynchronous copy or collective measures only the
launch. A device span records a CUDA event before and after the work instead;
once the end event has completed, both are placed on the `time.perf_counter()`
axis through one reference event per device, recorded right after a device
synchronize at a known host time (the first device span on that device):

    host_time(event) = reference_host_time + reference.elapsed_time(event) / 1e3

Note (clock calibration): the reference is taken once, so the one
synchronize happens at the first device span, not on every step; the error is
the launch latency of the reference event (microseconds) plus the drift
between the GPU and host clocks over the run (parts per million).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from infinity.profile.records import Span, SpanKind


class DeviceSpans:
    """Pending device spans of one profiler, resolved into host-clock spans."""

    def __init__(self, append: Callable):
        self.available = torch.cuda.is_available()
        self._append = append  # Profiler._append: adds a resolved Span
        self._lock = threading.Lock()
        self._pending: list[_DeviceSpanTimer] = []
        self._references: dict[int, tuple[torch.cuda.Event, float]] = {}

    def timer(self, name, link, stream, num_bytes, unit) -> _DeviceSpanTimer:
        stream = stream if stream is not None else torch.cuda.current_stream()
        return _DeviceSpanTimer(self, name, link, stream, num_bytes, unit)

    def reference(self, device_index: int) -> tuple[torch.cuda.Event, float]:
        """The (event, host time) pair that anchors this device's event clock."""
        with self._lock:
            if device_index not in self._references:
                # Waits for all queued work so the reference event runs as soon as it is recorded.
                torch.cuda.synchronize(device_index)
                event = torch.cuda.Event(enable_timing=True)
                host_time = time.perf_counter()
                event.record(torch.cuda.current_stream(device_index))
                self._references[device_index] = (event, host_time)
            return self._references[device_index]

    def add_pending(self, timer: _DeviceSpanTimer) -> None:
        with self._lock:
            self._pending.append(timer)

    def collect(self, block: bool) -> None:
        """Resolve the completed device spans (all of them when `block`)."""
        if not self.available:
            return
        with self._lock:
            pending, self._pending = self._pending, []
        still_pending = []
        for timer in pending:
            if block:
                timer.end_event.synchronize()  # summary/trace need its time: wait for the work to finish
            elif not timer.end_event.query():
                still_pending.append(timer)
                continue
            self._append(timer.resolve())
        if still_pending:
            with self._lock:
                self._pending[:0] = still_pending


class _DeviceSpanTimer:
    """Context manager of one device span: events around the enqueued work."""

    __slots__ = ("_owner", "_name", "_link", "_stream", "_unit", "_torch_range", "_reference", "start_event",
                 "end_event", "num_bytes")

    def __init__(self, owner: DeviceSpans, name, link, stream, num_bytes, unit):
        self._owner = owner
        self._name = name
        self._link = link
        self._stream = stream
        self._unit = unit
        self._torch_range = None
        self.num_bytes = num_bytes

    def __enter__(self) -> _DeviceSpanTimer:
        if torch.autograd._profiler_enabled():
            self._torch_range = torch.profiler.record_function(self._name)
            self._torch_range.__enter__()
        self._reference = self._owner.reference(self._stream.device.index)
        self.start_event = torch.cuda.Event(enable_timing=True)
        self.start_event.record(self._stream)
        return self

    def end(self, name: str) -> None:
        """Close the span under `name` (known only at its end, e.g. what compute waits for next)."""
        self._name = name
        self.__exit__(None, None, None)

    def __exit__(self, *exc) -> bool:
        self.end_event = torch.cuda.Event(enable_timing=True)
        self.end_event.record(self._stream)
        if self._torch_range is not None:
            self._torch_range.__exit__(*exc)
        self._owner.add_pending(self)
        return False

    def done(self) -> None:
        """(As a collective's span: closed at its issue, its end event is its completion on the stream.)"""

    def resolve(self):
        """The host-clock Span; call once `end_event` has completed."""
        reference_event, reference_time = self._reference
        reference_event.synchronize()  # elapsed_time needs both events complete; this one is long done
        start = reference_time + reference_event.elapsed_time(self.start_event) / 1e3
        end = reference_time + reference_event.elapsed_time(self.end_event) / 1e3
        return Span(self._name, self._link, start, max(start, end), self.num_bytes, self._unit, SpanKind.WORK)
