"""Preallocated per-rank swap files, an aligned extent allocator, striping, checksums.

SwapSpace owns one file per directory for this rank (``{name}.rank{rank}.{pid}.swp``),
created on first need and removed by close() (and nothing else in those directories).
An Extent is a byte range of tensor data: one part in one file, or, when large enough,
split into one aligned part per file so a single read/write uses every disk at once
(Note [striping]). Extents are carved from per-file free lists (first fit, coalescing on
free); when reserve() was too small the files grow (or fail with a clear disk-full error).

Note [checksum]: with checksum "full" or "sampled" each write records one checksum per
engine block in memory (swap is per-run scratch: no on-disk metadata) and each read
verifies them in the worker threads before wait() returns; a flipped byte ("full"; with
"sampled" one inside the sample, Note [sampled checksum] in engine.py) raises
ChecksumError, a truncated file IOEngineError (short read), both naming the file and offset.

An extent may be read by several readers at once (e.g. a parameter fetch and the
optimizer's read-ahead of the same bytes); a write excludes every other operation on
it, and starting one that conflicts raises (the caller's ordering bug, never a wait).
"""

from __future__ import annotations

import bisect
import itertools
import mmap
import os
import threading
from dataclasses import dataclass

import torch

from .engine import IOEngine, IOFuture, checksum_mode
from .errors import IOEngineError, describe_failure

_DIRECT_ALIGNMENT = 4096  # largest O_DIRECT alignment a filesystem may ask for
_PAGE = mmap.PAGESIZE  # direct I/O granularity of ThreadBackend (Note [direct I/O])


def _round_up(x: int, a: int) -> int:
    return -(-x // a) * a


@dataclass(frozen=True)
class ExtentPart:
    """``num_bytes`` of an extent's data at ``offset`` of ``path`` (offset is aligned; the
    part owns ``capacity`` bytes there: num_bytes rounded up to the alignment)."""

    path: str
    offset: int
    num_bytes: int
    capacity: int


@dataclass(frozen=True)
class Extent:
    """A tensor-sized range of swap space: its parts, in data order, and total size."""

    id: int
    num_bytes: int
    parts: tuple[ExtentPart, ...]

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(p.path for p in self.parts)

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(p.offset for p in self.parts)

    @property
    def path(self) -> str | None:
        """The first part's file (None for a 0-byte extent)."""
        return self.parts[0].path if self.parts else None

    @property
    def offset(self) -> int | None:
        return self.parts[0].offset if self.parts else None


class _FileSpace:
    """Free list of one swap file: sorted, non-adjacent (offset, size) holes below capacity."""

    def __init__(self, path: str):
        self.path = path
        self.capacity = 0
        self.created = False
        self.free: list[tuple[int, int]] = []

    def take(self, size: int) -> int | None:
        for i, (off, hole) in enumerate(self.free):  # first fit keeps low offsets busy
            if hole >= size:
                if hole == size:
                    del self.free[i]
                else:
                    self.free[i] = (off + size, hole - size)
                return off
        return None

    def give(self, off: int, size: int) -> None:
        i = bisect.bisect_left(self.free, (off, 0))
        assert i == len(self.free) or off + size <= self.free[i][0], (
            f"{self.path}: freeing [{off}, {off + size}) overlaps hole {self.free[i]}")
        assert i == 0 or self.free[i - 1][0] + self.free[i - 1][1] <= off, (
            f"{self.path}: freeing [{off}, {off + size}) overlaps hole {self.free[i - 1]}")
        if i < len(self.free) and off + size == self.free[i][0]:
            size += self.free.pop(i)[1]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == off:
            off, size = self.free[i - 1][0], self.free[i - 1][1] + size
            i -= 1
            del self.free[i]
        self.free.insert(i, (off, size))

    def trailing_free(self) -> int:
        if self.free and sum(self.free[-1]) == self.capacity:
            return self.free[-1][1]
        return 0

    def extend(self, new_capacity: int) -> None:
        assert new_capacity >= self.capacity, f"{self.path}: shrink {self.capacity}->{new_capacity}"
        if new_capacity > self.capacity:
            self.give(self.capacity, new_capacity - self.capacity)
            self.capacity = new_capacity


class _Record:
    """What SwapSpace knows about a live extent: checksums per part and block (None =
    never successfully written) and the reads / write in flight."""

    __slots__ = ("checksums", "written", "readers", "writing", "futures")

    def __init__(self) -> None:
        self.checksums: list[list[int]] | None = None
        self.written = False
        self.readers = 0
        self.writing = False
        self.futures: list[IOFuture] = []  # of operations started (done ones pruned as new ones start)

    @property
    def busy(self) -> str | None:
        return "written" if self.writing else "read" if self.readers else None


class SwapSpace:
    """Swap files for one rank across ``dirs`` (several = striping), driven through ``io``.

    alignment: extent offsets and capacities (a multiple of 4096; rounded up to the page
    size where pages are larger). checksum: "full" | "sampled" | "off" (True / False:
    "full" / "off"); None follows ``io.config.checksum``. stripe_min_bytes: extents at
    least this large are split across all dirs (default: one engine block per dir).
    """

    def __init__(self, dirs: list[str] | str, io: IOEngine, rank: int = 0, name: str = "swap",
                 alignment: int = 4096, checksum: bool | str | None = None,
                 stripe_min_bytes: int | None = None):
        dirs = [dirs] if isinstance(dirs, (str, os.PathLike)) else list(dirs)
        if not dirs:
            raise ValueError("SwapSpace needs at least one directory: set [nvme] paths")
        if alignment <= 0 or alignment % _DIRECT_ALIGNMENT:
            raise ValueError(f"SwapSpace alignment must be a positive multiple of 4096 (direct "
                             f"I/O), got {alignment}")
        self.io = io
        self.rank = rank
        self.name = name
        self.alignment = _round_up(alignment, _PAGE)  # padded tails are whole pages
        self.checksum = io.config.checksum if checksum is None else checksum_mode(checksum)
        self.stripe_min_bytes = (io.config.block_size * len(dirs) if stripe_min_bytes is None
                                 else stripe_min_bytes)
        self._backend = io.backend
        self._lock = threading.Lock()  # guards the free lists and records
        self._spaces: list[_FileSpace] = []
        for d in dirs:
            d = os.fspath(d)
            if not self._backend.is_dir(d):
                raise IOEngineError(f"swap directory {d} does not exist: create it or point the "
                                    f"[nvme] paths at a mounted NVMe directory",
                                    path=d)
            self._spaces.append(_FileSpace(self._file_name(d)))
        self._records: dict[int, _Record] = {}
        self._ids = itertools.count()
        self._next_space = 0
        self._bytes_in_use = 0
        self._closed = False

    def _file_name(self, d: str) -> str:
        base = os.path.join(d, f"{self.name}.rank{self.rank}.{os.getpid()}")
        path, n = base + ".swp", 1
        while os.path.exists(path):  # a stale file from another run: never reuse it
            path, n = f"{base}.{n}.swp", n + 1
        return path

    # -- space ----------------------------------------------------------------------
    @property
    def files(self) -> list[str]:
        """Paths of the swap files created so far."""
        return [s.path for s in self._spaces if s.created]

    @property
    def bytes_reserved(self) -> int:
        """Bytes preallocated in all swap files."""
        return sum(s.capacity for s in self._spaces)

    @property
    def bytes_in_use(self) -> int:
        """Bytes held by live extents (aligned capacities)."""
        return self._bytes_in_use

    def reserve(self, total_bytes: int) -> None:
        """Preallocate at least total_bytes across the files (split evenly)."""
        share = _round_up(-(-total_bytes // len(self._spaces)), self.alignment)
        with self._lock:
            for space in self._spaces:
                if share > space.capacity:
                    self._grow(space, share)

    def _grow(self, space: _FileSpace, new_capacity: int) -> None:
        """posix_fallocate the file to new_capacity (lock held); disk full -> clear error."""
        need = new_capacity - space.capacity
        directory = os.path.dirname(space.path)
        free = self._backend.free_bytes(directory)
        hint = ("free space there, point the [nvme] paths at a larger disk (or add one), or "
                "reduce what is placed on NVMe")
        if free is not None and free < need:
            raise IOEngineError(
                f"not enough disk space for swap file {space.path}: needs {need} more bytes, "
                f"{free} free, {need - free} bytes missing: {hint}",
                errno=28, path=space.path, offset=space.capacity, num_bytes=need,
                direction="write")
        try:
            self._backend.preallocate(space.path, new_capacity, create=not space.created)
        except OSError as e:
            if e.errno == 28:
                free = self._backend.free_bytes(directory) or 0
                raise IOEngineError(
                    f"disk full while preallocating swap file {space.path} to {new_capacity} "
                    f"bytes ({need} more, {free} free, about {max(need - free, 0)} bytes "
                    f"missing): {hint}", errno=28, path=space.path, offset=space.capacity,
                    num_bytes=need, direction="write") from e
            raise describe_failure(e, direction="write", path=space.path,
                                   offset=space.capacity, num_bytes=need) from e
        space.created = True
        space.extend(new_capacity)

    def allocate(self, num_bytes: int) -> Extent:
        """An extent of num_bytes (striped across the dirs when >= stripe_min_bytes)."""
        if not isinstance(num_bytes, int) or num_bytes < 0:
            raise ValueError(f"num_bytes must be a non-negative int, got {num_bytes!r}")
        with self._lock:
            if self._closed:
                raise RuntimeError("SwapSpace.allocate() after close()")
            n = len(self._spaces)
            if num_bytes >= self.stripe_min_bytes and n > 1:
                size = _round_up(-(-num_bytes // n), self.alignment)
                sizes = [min(size, num_bytes - i * size) for i in range(n)]
                targets = [(s, b) for s, b in zip(self._spaces, sizes) if b > 0]
            elif num_bytes:
                targets = [(self._spaces[self._next_space], num_bytes)]
                self._next_space = (self._next_space + 1) % n  # Note [striping]: round-robin
            else:
                targets = []
            parts = []
            try:
                for space, size in targets:
                    cap = _round_up(size, self.alignment)
                    parts.append(ExtentPart(space.path, self._take(space, cap), size, cap))
            except BaseException:
                for part in parts:  # all or nothing
                    self._space(part.path).give(part.offset, part.capacity)
                raise
            ext = Extent(next(self._ids), num_bytes, tuple(parts))
            self._records[ext.id] = _Record()
            self._bytes_in_use += sum(p.capacity for p in parts)
            return ext

    def _take(self, space: _FileSpace, cap: int) -> int:
        off = space.take(cap)
        if off is None:  # reserve() was too small: grow the file by what is missing
            self._grow(space, space.capacity + cap - space.trailing_free())
            off = space.take(cap)
        assert off is not None and off % self.alignment == 0, (
            f"{space.path}: allocator returned offset {off} for {cap} bytes")
        return off

    def _space(self, path: str) -> _FileSpace:
        return next(s for s in self._spaces if s.path == path)

    def free(self, ext: Extent) -> None:
        """Return an extent's space for reuse; its data is gone."""
        with self._lock:
            rec = self._live(ext)
            if rec.busy:
                raise RuntimeError(f"extent {ext.id} is being {rec.busy}: wait() for it before "
                                   f"free()")
            del self._records[ext.id]
            for part in ext.parts:
                self._space(part.path).give(part.offset, part.capacity)
            self._bytes_in_use -= sum(p.capacity for p in ext.parts)

    def _live(self, ext: Extent) -> _Record:
        rec = self._records.get(ext.id)
        if rec is None:
            raise ValueError(f"extent {ext.id} ({ext.num_bytes} bytes) is not allocated in this "
                             f"SwapSpace (freed already, or from another one)")
        return rec

    # -- data -----------------------------------------------------------------------
    def _byte_views(self, ext: Extent, tensor: torch.Tensor, what: str) -> list[torch.Tensor]:
        num_bytes = tensor.numel() * tensor.element_size()
        if num_bytes != ext.num_bytes:
            raise ValueError(f"{what} has {tensor.numel()} x {tensor.element_size()} = "
                             f"{num_bytes} bytes but extent {ext.id} holds {ext.num_bytes}")
        if not tensor.is_contiguous():
            raise ValueError(f"{what} must be contiguous (pass t.contiguous())")
        flat = tensor.reshape(-1).view(torch.uint8) if num_bytes else tensor
        views, pos = [], 0
        for part in ext.parts:
            views.append(flat[pos:pos + part.num_bytes])
            pos += part.num_bytes
        return views

    def _start(self, ext: Extent, kind: str) -> _Record:
        with self._lock:
            rec = self._live(ext)
            if rec.writing or (kind == "write" and rec.readers):  # reads may share an extent
                raise RuntimeError(f"extent {ext.id} is already being {rec.busy}: wait() for it "
                                   f"before starting a {kind}")
            if kind == "read" and not rec.written:
                raise IOEngineError(f"extent {ext.id} ({ext.num_bytes} bytes in {ext.paths}) "
                                    f"holds no data: it was never written, or its last write "
                                    f"failed", path=ext.path, offset=ext.offset,
                                    num_bytes=ext.num_bytes, direction="read")
            if kind == "read":
                rec.readers += 1
            else:
                rec.writing = True
            rec.futures = [f for f in rec.futures if not f.done()]
            return rec

    def _started(self, rec: _Record, future: IOFuture) -> IOFuture:
        with self._lock:
            rec.futures.append(future)  # close() waits for it
        return self.io.adopt(future)

    def write(self, ext: Extent, tensor: torch.Tensor) -> IOFuture:
        """Write tensor's bytes into the extent; checksums recorded before wait() returns."""
        views = self._byte_views(ext, tensor, "tensor to write")
        rec = self._start(ext, "write")
        rec.written = False
        rec.checksums = None
        futs = [self.io.submit("write", v, p.path, p.offset, create=False, pad_tail=True,
                               checksum=self.checksum, report=False)
                for v, p in zip(views, ext.parts)]

        def on_done(error):
            with self._lock:
                rec.writing = False
                if error is None:
                    rec.written = True
                    rec.checksums = [f.checksums for f in futs] if self.checksum != "off" else None
            return error

        return self._started(rec, IOFuture.gather(futs, f"swap write of extent {ext.id}", on_done))

    def read(self, ext: Extent, out: torch.Tensor, *, urgent: bool = False) -> IOFuture:
        """Read the extent into out; with checksum on, verified before wait() returns.
        urgent: ahead of queued non-urgent I/O (Note [urgent lane] in engine.py)."""
        views = self._byte_views(ext, out, "read buffer `out`")
        rec = self._start(ext, "read")
        futs = [self.io.submit("read", v, p.path, p.offset, pad_tail=True,
                               checksum=self.checksum if rec.checksums is not None else "off",
                               expected=rec.checksums[i] if rec.checksums is not None else None,
                               report=False, urgent=urgent)
                for i, (v, p) in enumerate(zip(views, ext.parts))]

        def on_done(error):
            with self._lock:
                rec.readers -= 1
            return error

        return self._started(rec, IOFuture.gather(futs, f"swap read of extent {ext.id}", on_done))

    def close(self) -> None:
        """Wait for this swap's I/O in flight, then remove the swap files it created (only
        those; never other files, never the directories). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            in_flight = [f for r in self._records.values() for f in r.futures if not f.done()]
        for fut in in_flight:
            fut.exception()  # why: a file must not vanish under its I/O; errors went to wait()
        for space in self._spaces:
            if space.created:
                self._backend.remove(space.path)
                space.created = False
        self._records.clear()

    def __enter__(self) -> SwapSpace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Extent", "ExtentPart", "SwapSpace"]
