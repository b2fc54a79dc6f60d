"""IOEngine: submit_read / submit_write -> IOFuture; drain; close.

A request (one tensor <-> one file range) is split by the backend into blocks of at most
``block_size`` bytes; at most ``queue_depth`` blocks are handed to the backend at a time
(the rest wait in the engine's FIFO), and a request completes when its last block does.
Issue and wait are separate calls: ``submit_*`` returns at once, ``IOFuture.wait()``
blocks, so a prefetch is just an early submit.

Request lifecycle (RequestState): QUEUED -> ISSUED -> DONE | FAILED. A block error fails
its request (the remaining blocks of that request are skipped, other requests carry on).

Note [urgent lane]: a training step mixes I/O somebody waits for now (the parameters
the next layer computes with) with I/O that only has to finish eventually (optimizer
state written behind, read ahead). With one FIFO a parameter read queues behind
gigabytes of write-behind and compute stalls although the disk is busy. Requests
submitted with ``urgent=True`` go to a second FIFO that ``_take_ready`` drains first;
blocks already handed to the backend (at most queue_depth) are not pre-empted, so an
urgent block waits for at most queue_depth blocks. Within each lane order is FIFO.

Checksums of blocks (full or sampled): io_engine/checksums.py.
"""

from __future__ import annotations

import asyncio
import enum
import errno
import itertools
import logging
import os
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from .aligned import address_memoryview
from .backends import Backend, BlockOp, Direction, ThreadBackend, kernel_aio
from .checksums import (
    CHECKSUM_ALGORITHM,
    CHECKSUM_MODES,
    SAMPLE_BYTES,
    SAMPLE_PIECES,
    checksum,
    checksum_mode,
    sampled_checksum,
)
from .errors import ChecksumError, IOEngineError, describe_failure
from .io_config import IOConfig
from .stats import IOStats, StatsRecorder

log = logging.getLogger(__name__)


def backend_name(cfg: IOConfig) -> str:
    """"aio" or "threads": what ``cfg.backend`` runs as on this machine ("auto": aio if the
    kernel offers it)."""
    if cfg.backend == "auto":
        return "aio" if kernel_aio.available() else "threads"
    return cfg.backend


def file_backend(cfg: IOConfig) -> Backend:
    """The backend for real files that ``cfg.backend`` names."""
    if backend_name(cfg) == "aio":
        try:
            return kernel_aio.AioBackend(queue_depth=cfg.queue_depth, threads=cfg.threads,
                                         direct=cfg.direct, bounce_bytes=cfg.block_size)
        except OSError as e:
            if cfg.backend == "aio":
                raise IOEngineError(f"IOConfig.backend = 'aio' but kernel AIO is unavailable "
                                    f"here ({e}): use backend='threads' (or 'auto', which falls "
                                    f"back to it)") from None
            warnings.warn(f"io_engine: no kernel AIO context for this engine ({e}); its blocks "
                          f"go through {cfg.threads} threads instead (slower beside compute). "
                          f"Close engines you no longer use, or set backend='threads' to "
                          f"silence this.", RuntimeWarning, stacklevel=3)
    return ThreadBackend(threads=cfg.threads, direct=cfg.direct, bounce_bytes=cfg.block_size)


class IOFuture:
    """Completion of one I/O request (or of a group of them).

    ``wait()`` blocks until done and raises the request's IOEngineError, if any; ``done()``
    polls; ``await fut`` works inside asyncio (no thread per call). ``checksums`` holds the
    per-block checksums of a checksummed request once done.
    """

    def __init__(self, description: str = ""):
        self.description = description
        self.checksums: list[int] | None = None
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[IOFuture], None]] = []
        self._observed = False

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "done")
        return f"<IOFuture {state}: {self.description}>"

    def done(self) -> bool:
        """True once the request completed (successfully or not)."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until complete; raise its error (IOEngineError) if it failed."""
        if not self._event.wait(timeout):  # why: the bytes are not in place / reusable before
            raise TimeoutError(f"{self.description}: still in flight after {timeout} s")
        self._observed = True
        if self._error is not None:
            raise self._error

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Block until complete; return its error (None on success) without raising."""
        if not self._event.wait(timeout):  # why: the outcome is not known before
            raise TimeoutError(f"{self.description}: still in flight after {timeout} s")
        self._observed = True
        return self._error

    def add_done_callback(self, fn: Callable[[IOFuture], None]) -> None:
        """Call fn(self) on completion (on the completing thread; now if already done)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def __await__(self):
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()

        def transfer(_: IOFuture) -> None:
            if not waiter.cancelled():
                if self._error is not None:
                    waiter.set_exception(self._error)
                else:
                    waiter.set_result(None)

        self.add_done_callback(lambda f: loop.call_soon_threadsafe(transfer, f))
        self._observed = True
        return waiter.__await__()

    def _set(self, error: BaseException | None) -> None:
        with self._lock:
            assert not self._event.is_set(), f"{self.description}: completed twice"
            self._error = error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except BaseException:  # one bad callback must not starve the others
                log.exception("io_engine: IOFuture done-callback failed (%s)", self.description)

    @classmethod
    def completed(cls, error: BaseException | None = None, description: str = "") -> IOFuture:
        """An already finished future."""
        fut = cls(description)
        fut._set(error)
        return fut

    @classmethod
    def gather(cls, futures: Iterable[IOFuture], description: str = "",
               on_done: Callable[[BaseException | None], BaseException | None] | None = None
               ) -> IOFuture:
        """A future that completes when all ``futures`` have, with the first error (in the
        given order). ``on_done(error)`` runs before completion and returns the final error."""
        futures = list(futures)
        out = cls(description)
        remaining = [len(futures)]
        guard = threading.Lock()

        def finish() -> None:
            error = next((f._error for f in futures if f._error is not None), None)
            for f in futures:
                f._observed = True  # reported through `out` from now on
            if on_done is not None:
                try:
                    error = on_done(error)
                except BaseException as e:
                    error = e
            out._set(error)

        def child_done(_: IOFuture) -> None:
            with guard:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                finish()

        if not futures:
            finish()
        for f in futures:
            f.add_done_callback(child_done)
        return out


class RequestState(enum.Enum):
    """Lifecycle of a request."""

    QUEUED = "queued"    # accepted; some blocks wait in the engine FIFO for a queue slot
    ISSUED = "issued"    # every block handed to the backend; waiting for completions
    DONE = "done"        # all blocks transferred (and checksums verified)
    FAILED = "failed"    # a block failed; error recorded, remaining blocks skipped


@dataclass(eq=False, slots=True)
class _Request:
    """Engine-side record of one request (the backend only sees its blocks)."""

    id: int
    direction: Direction
    path: str
    offset: int
    num_bytes: int
    tensor: torch.Tensor | None  # keeps the memory alive until completion
    future: IOFuture
    report: bool  # failures count as unobserved for drain() unless a group owns them
    handle: object = None
    state: RequestState = RequestState.QUEUED
    error: BaseException | None = None
    remaining: int = 0  # blocks not completed (or skipped) yet
    unissued: int = 0  # blocks still in the engine FIFO
    blocks: int = 0
    t_submit: float = field(default_factory=time.perf_counter)
    checksums: list[int] | None = None
    expected: list[int] | None = None
    checksum_mode: str = "off"  # CHECKSUM_MODES; checksums / expected are used unless "off"


def _check_tensor(t: torch.Tensor, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{what} is on {t.device}: io_engine moves bytes between files and CPU "
                         f"memory; copy through a pinned CPU buffer (io_engine.aligned_empty)")
    if t.layout != torch.strided or not t.is_contiguous():
        raise ValueError(f"{what} is not a contiguous strided tensor (shape {tuple(t.shape)}, "
                         f"stride {t.stride()}): pass t.contiguous(), or read into a contiguous "
                         f"buffer and copy_ into the view")
    if t.is_conj() or t.is_neg():
        raise ValueError(f"{what} has a lazy conj/neg bit: pass t.resolve_conj().resolve_neg()")


class IOEngine:
    """Asynchronous tensor file I/O. ``IOEngine(config, backend=None)``: the default backend
    is ThreadBackend (real files); tests pass MemoryBackend(...). Use as a context manager
    or call close()."""

    def __init__(self, config: IOConfig | None = None, backend: Backend | None = None):
        self.config = config if config is not None else IOConfig()
        cfg = self.config
        self.backend = backend if backend is not None else file_backend(cfg)
        self._lock = threading.Lock()  # guards the FIFOs, counters and the tables below
        self._pending: deque[BlockOp] = deque()
        self._urgent: deque[BlockOp] = deque()  # issued before anything in _pending
        self._blocks_in_flight = 0
        self._outstanding: dict[int, IOFuture] = {}
        self._unobserved: list[IOFuture] = []
        self._ids = itertools.count()
        self._stats = StatsRecorder()
        self._closed = False
        self.backend.start(self._on_block_done)

    # -- public ---------------------------------------------------------------------
    def submit_write(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0, *,
                     create: bool = True) -> IOFuture:
        """Write the bytes of contiguous CPU ``tensor`` to ``path`` at byte ``offset``.
        The tensor must not be modified until the future completes. ``create``: create the
        file if missing (otherwise a missing file is an error)."""
        return self.submit(Direction.WRITE, tensor, path, offset, create=create)

    def submit_read(self, out: torch.Tensor, path: str | os.PathLike, offset: int = 0, *,
                    urgent: bool = False) -> IOFuture:
        """Fill contiguous CPU ``out`` in place with bytes of ``path`` from byte ``offset``.
        ``urgent``: someone is waiting for it now; its blocks go ahead of every queued
        non-urgent block (blocks already handed to the backend finish first)."""
        return self.submit(Direction.READ, out, path, offset, urgent=urgent)

    async def read(self, out: torch.Tensor, path: str | os.PathLike, offset: int = 0) -> None:
        """asyncio face of submit_read."""
        await self.submit_read(out, path, offset)

    async def write(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0) -> None:
        """asyncio face of submit_write."""
        await self.submit_write(tensor, path, offset)

    @property
    def stats(self) -> IOStats:
        """Snapshot of bytes, ops and latency percentiles per direction."""
        return self._stats.snapshot()

    def drain(self) -> None:
        """Wait for every request in flight; raise the first failure nobody has seen yet
        (through wait()/exception()/await) among all requests so far."""
        with self._lock:
            futures = list(self._outstanding.values())
        for fut in futures:
            fut._event.wait()  # why: drain promises that nothing is in flight when it returns
        with self._lock:
            failed = [f for f in self._unobserved if not f._observed]
            self._unobserved.clear()
        for f in failed:
            f._observed = True
        if failed:
            raise failed[0]._error

    def close(self) -> None:
        """Wait for everything in flight, then stop the workers. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            futures = list(self._outstanding.values())
        for fut in futures:
            fut._event.wait()  # why: workers must not touch tensors after close returns
        self.backend.shutdown()
        unseen = [f for f in self._unobserved if not f._observed]
        if unseen:
            warnings.warn(f"IOEngine closed with {len(unseen)} failed request(s) nobody waited "
                          f"on; first: {unseen[0]._error}", RuntimeWarning, stacklevel=2)

    def __enter__(self) -> IOEngine:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.drain()
        finally:
            self.close()

    # -- for SwapSpace ----------------------------------------------------------------
    def adopt(self, future: IOFuture) -> IOFuture:
        """Track a group future (IOFuture.gather of untracked requests) so drain()/close()
        wait for it and report its failure if nobody waits on it."""
        fid = -1 - next(self._ids)
        with self._lock:
            self._outstanding[fid] = future

        def forget(f: IOFuture) -> None:
            with self._lock:
                self._outstanding.pop(fid, None)
                if f._error is not None:
                    self._unobserved.append(f)

        future.add_done_callback(forget)
        return future

    def submit(self, direction: Direction | str, tensor: torch.Tensor, path: str | os.PathLike,
               offset: int, *, create: bool = True, pad_tail: bool = False,
               checksum: bool | str = False, expected: list[int] | None = None,
               report: bool = True, urgent: bool = False) -> IOFuture:
        """The general form of submit_read/submit_write. pad_tail: bytes up to the next
        direct-I/O alignment after the range belong to the caller (see ThreadBackend).
        checksum: record per-block checksums in ``future.checksums`` ("full" or True,
        "sampled": Note [sampled checksum]; "off" or False: none); expected: verify a read
        against checksums recorded in the same mode (ChecksumError on mismatch).
        report=False: a group future owns failures (see adopt). urgent: queue ahead of
        non-urgent blocks (Note [urgent lane])."""
        direction = Direction(direction)
        what = "tensor to write" if direction is Direction.WRITE else "read buffer `out`"
        _check_tensor(tensor, what)
        path = os.fspath(path)
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset must be a non-negative int, got {offset!r} (file {path})")
        num_bytes = tensor.numel() * tensor.element_size()
        fut = IOFuture(f"{direction.value} of {num_bytes} bytes at offset {offset} of {path}")
        req = _Request(next(self._ids), direction, path, offset, num_bytes, tensor, fut, report)
        mode = checksum_mode(checksum)
        if mode != "off":
            req.checksums, req.expected, req.checksum_mode = [], expected, mode
        with self._lock:
            if self._closed:
                raise RuntimeError(f"IOEngine is closed: cannot {direction.value} {path}; "
                                   f"submit before close() or create a new engine")
            self._outstanding[req.id] = fut
        self._stats.started(direction.value, req.t_submit)
        try:  # opened even for 0 bytes: a 0-byte write creates the file, errors are the same
            req.handle = self.backend.open(path, direction, create)
        except BaseException as e:
            req.error = describe_failure(e, direction=direction.value, path=path, offset=offset,
                                         num_bytes=num_bytes)
            self._finish(req)
            return fut
        if num_bytes == 0:
            self._finish(req)
            return fut
        ops = self._blocks(req, pad_tail)
        with self._lock:
            (self._urgent if urgent else self._pending).extend(ops)
            ready, finished = self._take_ready()
        for op in ready:
            self.backend.submit(op)
        for r in finished:
            self._finish(r)
        return fut

    # -- internals --------------------------------------------------------------------
    def _blocks(self, req: _Request, pad_tail: bool) -> list[BlockOp]:
        pieces = self.backend.split(req.handle, req.offset, req.num_bytes,
                                    self.config.block_size, pad_tail)
        assert sum(n for _, n in pieces) == req.num_bytes and pieces[0][0] == req.offset, (
            f"split of {req.num_bytes} bytes at {req.offset} gave {pieces[:4]}...")
        if req.expected is not None:
            assert len(req.expected) == len(pieces), (
                f"{req.path}: {len(req.expected)} recorded checksums for {len(pieces)} blocks")
        if req.checksums is not None:
            req.checksums = [0] * len(pieces)
        addr = req.tensor.data_ptr()
        mem = address_memoryview(addr, req.num_bytes)
        last = len(pieces) - 1
        ops = []
        for i, (file_offset, length) in enumerate(pieces):
            start = file_offset - req.offset
            ops.append(BlockOp(req.direction, req.handle, file_offset, mem[start:start + length],
                               addr + start, pad_tail and i == last, req, i))
        req.remaining = req.unissued = req.blocks = len(ops)
        return ops

    def _take_ready(self) -> tuple[list[BlockOp], list[_Request]]:
        """Pop blocks that fit in the queue (lock held). Blocks of failed requests are
        skipped; returns (blocks to submit, requests that just finished)."""
        ready, finished = [], []
        qd = self.config.queue_depth
        while (self._urgent or self._pending) and self._blocks_in_flight < qd:
            op = (self._urgent or self._pending).popleft()
            req = op.request
            req.unissued -= 1
            if req.unissued == 0 and req.state is RequestState.QUEUED:
                req.state = RequestState.ISSUED
            if req.error is not None:
                req.remaining -= 1
                if req.remaining == 0:
                    finished.append(req)
                continue
            self._blocks_in_flight += 1
            ready.append(op)
        return ready, finished

    def _on_block_done(self, op: BlockOp, error: BaseException | None) -> None:
        """Backend callback, on a backend thread: account the block, refill the queue, then
        checksum it. Note [checksum off the queue]: the block's queue slot is the disk's, so
        it is refilled before the checksum; computed first, a CRC (and the wait for a CPU to
        run it on while compute holds both cores) left the disk one request short meanwhile."""
        req: _Request = op.request
        with self._lock:
            self._blocks_in_flight -= 1
            assert self._blocks_in_flight >= 0, f"blocks in flight: {self._blocks_in_flight}"
            self._record_error(req, op, error)  # before the refill: a failed request's blocks are skipped
            ready, more = self._take_ready()
        for o in ready:
            self.backend.submit(o)
        try:
            mismatch = self._checksum_block(req, op) if error is None and req.checksums is not None else None
        except BaseException as e:  # a failing checksum fails its request, never leaves it waiting
            mismatch = e
        with self._lock:
            self._record_error(req, op, mismatch)
            req.remaining -= 1
            finished = [req] if req.remaining == 0 else []
        for r in finished + more:
            self._finish(r)

    @staticmethod
    def _record_error(req: _Request, op: BlockOp, error: BaseException | None) -> None:
        """The request's first error, described with the block's place in it (lock held)."""
        if error is not None and req.error is None:
            context = (f" (block {op.index + 1} of {req.blocks} of a {req.num_bytes}-byte "
                       f"{req.direction.value} at offset {req.offset})" if req.blocks > 1 else "")
            req.error = describe_failure(error, direction=req.direction.value, path=req.path,
                                         offset=op.file_offset, num_bytes=len(op.mem), context=context)

    def _checksum_block(self, req: _Request, op: BlockOp) -> BaseException | None:
        crc = (checksum if req.checksum_mode == "full" else sampled_checksum)(op.mem)
        req.checksums[op.index] = crc
        if req.expected is None or req.expected[op.index] == crc:
            return None
        return ChecksumError(
            f"checksum mismatch in {req.path} at offset {op.file_offset} ({len(op.mem)} bytes): "
            f"{CHECKSUM_ALGORITHM}{' (sampled)' if req.checksum_mode == 'sampled' else ''} was "
            f"{req.expected[op.index]:#010x} when written, "
            f"{crc:#010x} now. The file was modified underneath or the disk corrupted it; this "
            f"data is lost: restart from the last checkpoint and check the disk (dmesg, smartctl).",
            errno=errno.EIO, path=req.path, offset=op.file_offset, num_bytes=len(op.mem),
            direction=req.direction.value)

    def _finish(self, req: _Request) -> None:
        """Complete a request: close its file, record stats, resolve the future."""
        if req.handle is not None:
            try:
                self.backend.close_handle(req.handle)
            except OSError as e:
                if req.error is None:
                    req.error = describe_failure(e, direction=req.direction.value, path=req.path,
                                                 offset=req.offset, num_bytes=req.num_bytes)
            req.handle = None
        req.state = RequestState.FAILED if req.error is not None else RequestState.DONE
        now = time.perf_counter()
        self._stats.finished(req.direction.value, req.num_bytes, req.blocks, now - req.t_submit,
                             req.error is not None, now)
        with self._lock:
            self._outstanding.pop(req.id, None)
            if req.error is not None and req.report:
                self._unobserved.append(req.future)
        req.future.checksums = req.checksums
        req.tensor = None
        req.future._set(req.error)


__all__ = ["CHECKSUM_ALGORITHM", "CHECKSUM_MODES", "IOConfig", "IOEngine", "IOFuture", "RequestState",
           "SAMPLE_BYTES", "SAMPLE_PIECES", "checksum", "checksum_mode", "sampled_checksum"]
