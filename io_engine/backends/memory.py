"""Files in RAM, with injectable latency, completion reordering and failures.

For testing code above the disk: behind ``IOEngine(cfg, backend=MemoryBackend(...))``
everything (SwapSpace included) runs as on real files, but deterministic faults can be
injected: fail the Nth write with ENOSPC, fail every read of a path, run out of capacity,
complete blocks late and out of order.

One scheduler thread completes blocks at their due time (submit time + latency_s +
uniform(0, jitter_s)); data is copied at completion, like a device would DMA it.
"""

from __future__ import annotations

import errno as _errno
import fnmatch
import heapq
import itertools
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Union

from ..errors import ShortRead
from .base import Backend, BlockOp, Complete, Direction, split_blocks


@dataclass(frozen=True)
class OpInfo:
    """What a ``fail`` callable sees for each block: its request's direction ("read" /
    "write"), path, the block's file offset and size, the request's 1-based index among
    requests of that direction, and the block's index within its request."""

    direction: str
    path: str
    offset: int
    num_bytes: int
    index: int
    block: int


@dataclass(frozen=True)
class FailRule:
    """Fail requests matching ``direction`` ("read" / "write" / None = both) and ``path``
    (fnmatch pattern, None = any) with OSError(``errno``): only the ``nth`` matching one
    (1-based) or, with nth=None, every one."""

    direction: str | None = None
    path: str | None = None
    nth: int | None = None
    errno: int = _errno.EIO

    def matches(self, direction: str, path: str) -> bool:
        return ((self.direction is None or self.direction == direction)
                and (self.path is None or fnmatch.fnmatch(path, self.path)))


FailSpec = Union[None, FailRule, Iterable[FailRule], Callable[[OpInfo], Any]]


class _MemHandle:
    """One request's view of a file: the file's bytearray (kept even if the file is removed
    meanwhile, like an open inode) and the failure decided for the request, if any."""

    def __init__(self, path: str, data: bytearray, index: int, fail_errno: int | None):
        self.path = path
        self.data = data
        self.index = index
        self.fail_errno = fail_errno


class MemoryBackend(Backend):
    """In-memory files. latency_s / jitter_s: per-block completion delay (seconds);
    reorder: let blocks complete in any order (otherwise strictly in submission order);
    fail: a FailRule, a list of them, or ``callable(OpInfo) -> errno | OSError | None``;
    capacity_bytes: total bytes all files may hold (beyond: ENOSPC); seed: for jitter."""

    def __init__(self, latency_s: float = 0.0, jitter_s: float = 0.0, reorder: bool = True,
                 fail: FailSpec = None, capacity_bytes: int | None = None, seed: int = 0):
        if latency_s < 0 or jitter_s < 0:
            raise ValueError(f"latency_s and jitter_s must be >= 0, got {latency_s}, {jitter_s}")
        self.latency_s = latency_s
        self.jitter_s = jitter_s
        self.reorder = reorder
        self.capacity_bytes = capacity_bytes
        if fail is None or callable(fail):
            self._rules: list[FailRule] = []
            self._fail_fn = fail
        else:
            self._rules = [fail] if isinstance(fail, FailRule) else list(fail)
            self._fail_fn = None
        self._rule_hits = [0] * len(self._rules)
        self._request_count = {d: 0 for d in Direction}
        self._files: dict[str, bytearray] = {}
        self._lock = threading.Lock()  # guards files, counters
        self._cond = threading.Condition(threading.Lock())  # guards the heap
        self._heap: list[tuple[float, int, BlockOp]] = []
        self._seq = itertools.count()
        self._last_due = 0.0
        self._rng = random.Random(seed)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._complete: Complete | None = None

    # -- lifecycle ------------------------------------------------------------------
    def start(self, complete: Complete) -> None:
        assert self._thread is None, "MemoryBackend.start() called twice"
        self._complete = complete
        self._thread = threading.Thread(target=self._run, name="io_engine-memory", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()  # why: blocks still due must complete before the engine closes
            self._thread = None

    # -- files ----------------------------------------------------------------------
    def open(self, path: str, direction: Direction, create: bool) -> _MemHandle:
        path = os.path.normpath(os.fspath(path))
        with self._lock:
            self._request_count[direction] += 1
            index = self._request_count[direction]
            fail_errno = None
            for i, rule in enumerate(self._rules):
                if rule.matches(direction.value, path):
                    self._rule_hits[i] += 1
                    if rule.nth is None or rule.nth == self._rule_hits[i]:
                        fail_errno = fail_errno or rule.errno
            data = self._files.get(path)
            if data is None:
                if direction is Direction.READ or not create:
                    raise FileNotFoundError(_errno.ENOENT, os.strerror(_errno.ENOENT), path)
                data = self._files[path] = bytearray()
        return _MemHandle(path, data, index, fail_errno)

    def close_handle(self, handle: _MemHandle) -> None:
        handle.data = bytearray()

    def preallocate(self, path: str, num_bytes: int, create: bool) -> None:
        path = os.path.normpath(os.fspath(path))
        with self._lock:
            data = self._files.get(path)
            if create and data is not None:
                raise FileExistsError(_errno.EEXIST, os.strerror(_errno.EEXIST), path)
            if not create and data is None:
                raise FileNotFoundError(_errno.ENOENT, os.strerror(_errno.ENOENT), path)
            if data is None:
                data = self._files[path] = bytearray()
            self._grow(path, data, num_bytes)

    def remove(self, path: str) -> None:
        with self._lock:
            self._files.pop(os.path.normpath(os.fspath(path)), None)

    def free_bytes(self, directory: str) -> int | None:
        if self.capacity_bytes is None:
            return None
        with self._lock:
            return self.capacity_bytes - self._used()

    def is_dir(self, directory: str) -> bool:
        return True

    # -- test helpers ---------------------------------------------------------------
    @property
    def files(self) -> list[str]:
        """Paths of the files that exist."""
        with self._lock:
            return sorted(self._files)

    def read_file(self, path: str) -> bytes:
        """A copy of a file's bytes."""
        with self._lock:
            return bytes(self._files[os.path.normpath(path)])

    def flip_byte(self, path: str, offset: int) -> None:
        """Corrupt one byte (bitwise not), as a bad disk or a stray writer would."""
        with self._lock:
            data = self._files[os.path.normpath(path)]
            data[offset] ^= 0xFF

    def truncate(self, path: str, num_bytes: int) -> None:
        """Cut a file down to num_bytes."""
        with self._lock:
            del self._files[os.path.normpath(path)][num_bytes:]

    # -- blocks ---------------------------------------------------------------------
    def split(self, handle: Any, offset: int, num_bytes: int, block_size: int,
              pad_tail: bool) -> list[tuple[int, int]]:
        return split_blocks(offset, num_bytes, block_size)

    def submit(self, op: BlockOp) -> None:
        delay = self.latency_s + (self._rng.uniform(0.0, self.jitter_s) if self.jitter_s else 0.0)
        with self._cond:
            due = time.monotonic() + delay
            if not self.reorder:
                due = max(due, self._last_due)  # FIFO: never complete before an earlier block
                self._last_due = due
            heapq.heappush(self._heap, (due, next(self._seq), op))
            self._cond.notify()

    def _next_due(self) -> BlockOp | None:
        with self._cond:
            while True:
                if self._heap:
                    now = time.monotonic()
                    wait_s = self._heap[0][0] - now
                    if wait_s <= 0:
                        break
                elif self._stopping:
                    return None
                else:
                    wait_s = None
                self._cond.wait(wait_s)  # why: nothing due yet; submit() or time wakes us
            if not self.reorder:
                return heapq.heappop(self._heap)[2]
            ready = []
            while self._heap and self._heap[0][0] <= now:
                ready.append(heapq.heappop(self._heap))
            pick = ready.pop(self._rng.randrange(len(ready)))
            for entry in ready:
                heapq.heappush(self._heap, entry)
            return pick[2]

    def _run(self) -> None:
        while (op := self._next_due()) is not None:
            try:
                self._execute(op)
                error = None
            except BaseException as e:
                error = e
            self._complete(op, error)

    def _execute(self, op: BlockOp) -> None:
        h: _MemHandle = op.handle
        n, off = len(op.mem), op.file_offset
        code = h.fail_errno
        if code is None and self._fail_fn is not None:
            code = self._fail_fn(OpInfo(op.direction.value, h.path, off, n, h.index, op.index))
        if isinstance(code, BaseException):
            raise code
        if code:
            raise OSError(code, os.strerror(code), h.path)
        with self._lock:
            if op.direction is Direction.WRITE:
                self._grow(h.path, h.data, off + n)
                h.data[off:off + n] = op.mem
            else:
                if off + n > len(h.data):
                    raise ShortRead(len(h.data), off + n)
                op.mem[:] = h.data[off:off + n]

    def _used(self) -> int:
        return sum(len(d) for d in self._files.values())

    def _grow(self, path: str, data: bytearray, size: int) -> None:
        """Extend data to size bytes (zeros); ENOSPC past capacity_bytes. Lock held."""
        growth = size - len(data)
        if growth <= 0:
            return
        if self.capacity_bytes is not None and self._used() + growth > self.capacity_bytes:
            raise OSError(_errno.ENOSPC, os.strerror(_errno.ENOSPC), path)
        data.extend(bytes(growth))


__all__ = ["FailRule", "MemoryBackend", "OpInfo"]
