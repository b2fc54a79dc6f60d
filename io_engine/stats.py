"""Per-direction I/O statistics: bytes, requests, blocks, latency percentiles, busy time."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

DIRECTIONS = ("read", "write")
_MAX_SAMPLES = 1 << 16  # latency samples kept per direction (a ring: the most recent ones)


@dataclass(frozen=True)
class DirectionStats:
    """Totals for one direction since the engine started.

    ``ops`` counts requests (one submit_read / submit_write), ``blocks`` the block-sized
    pieces they were split into. Latencies are per request, submit to completion, in
    seconds, over the most recent 65,536 requests (``latency_max_s`` over all of them).
    ``busy_s`` is the wall time during which at least one request was in flight.
    """

    bytes: int = 0
    ops: int = 0
    blocks: int = 0
    errors: int = 0
    latency_p50_s: float = 0.0
    latency_p90_s: float = 0.0
    latency_p99_s: float = 0.0
    latency_max_s: float = 0.0
    busy_s: float = 0.0

    @property
    def throughput_GBps(self) -> float:
        """Decimal GB per busy second (0 when nothing ran)."""
        return self.bytes / self.busy_s / 1e9 if self.busy_s > 0 else 0.0


@dataclass(frozen=True)
class IOStats:
    """Snapshot of an engine's statistics, one DirectionStats per direction."""

    read: DirectionStats = field(default_factory=DirectionStats)
    write: DirectionStats = field(default_factory=DirectionStats)

    def __getitem__(self, direction: str) -> DirectionStats:
        if direction not in DIRECTIONS:
            raise KeyError(f"direction must be 'read' or 'write', got {direction!r}")
        return getattr(self, direction)

    def summary(self) -> str:
        """One line per direction, human readable."""
        lines = []
        for d in DIRECTIONS:
            s = self[d]
            lines.append(f"{d:5s} {s.bytes / 1e9:8.3f} GB in {s.ops} ops ({s.blocks} blocks, "
                         f"{s.errors} errors), {s.throughput_GBps:.2f} GB/s busy, latency p50 "
                         f"{s.latency_p50_s * 1e3:.2f} ms p99 {s.latency_p99_s * 1e3:.2f} ms "
                         f"max {s.latency_max_s * 1e3:.2f} ms")
        return "\n".join(lines)


class _Direction:
    """Mutable counters of one direction; guarded by StatsRecorder's lock."""

    def __init__(self) -> None:
        self.bytes = 0
        self.ops = 0
        self.blocks = 0
        self.errors = 0
        self.samples = np.zeros(_MAX_SAMPLES, dtype=np.float64)
        self.num_samples = 0
        self.latency_max = 0.0
        self.in_flight = 0
        self.busy = 0.0
        self.busy_since = 0.0

    def snapshot(self, now: float) -> DirectionStats:
        n = min(self.num_samples, _MAX_SAMPLES)
        if n:
            p50, p90, p99 = np.percentile(self.samples[:n], [50, 90, 99])
        else:
            p50 = p90 = p99 = 0.0
        busy = self.busy + (now - self.busy_since if self.in_flight else 0.0)
        return DirectionStats(self.bytes, self.ops, self.blocks, self.errors, float(p50),
                              float(p90), float(p99), self.latency_max, busy)


class StatsRecorder:
    """Thread-safe accumulator the engine feeds; ``snapshot()`` gives an IOStats."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dirs = {d: _Direction() for d in DIRECTIONS}

    def started(self, direction: str, now: float) -> None:
        """A request entered flight (busy time starts when the first one does)."""
        with self._lock:
            d = self._dirs[direction]
            if d.in_flight == 0:
                d.busy_since = now
            d.in_flight += 1

    def finished(self, direction: str, num_bytes: int, blocks: int, latency_s: float,
                 failed: bool, now: float) -> None:
        """A request completed (successfully or not)."""
        with self._lock:
            d = self._dirs[direction]
            assert d.in_flight > 0, f"finished() without started(): in_flight={d.in_flight}"
            d.in_flight -= 1
            if d.in_flight == 0:
                d.busy += now - d.busy_since
            d.ops += 1
            d.blocks += blocks
            if failed:
                d.errors += 1
            else:
                d.bytes += num_bytes
            d.samples[d.num_samples % _MAX_SAMPLES] = latency_s
            d.num_samples += 1
            d.latency_max = max(d.latency_max, latency_s)

    def snapshot(self) -> IOStats:
        now = time.perf_counter()
        with self._lock:
            return IOStats(read=self._dirs["read"].snapshot(now),
                           write=self._dirs["write"].snapshot(now))
