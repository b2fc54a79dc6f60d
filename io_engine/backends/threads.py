"""Real files: os.preadv / os.pwritev straight into tensor memory from a pool of threads.

Each block is one (or a few) positional syscalls on a memoryview of the tensor's bytes;
the GIL is released inside the syscall, so ``threads`` blocks are on the device at once.

Note [direct I/O]: files are opened with O_DIRECT where the filesystem allows it (probed
once per filesystem, with the memory alignment it needs, 512 or 4096; if none, buffered
I/O with one warning). A block's page-aligned body goes straight between the tensor and
the disk. The exceptions, all at most one page long except the second:
  - head / tail bytes of a file range that does not start / end on a page boundary go
    through a second, buffered descriptor of the same file (exact bytes: no
    read-modify-write of a neighbour's bytes, no file grown past the data's end). The
    granularity is the page, not the device's 512-byte sector, so that a page of the file
    is either wholly inside one request's direct body or touched only by buffered I/O:
    the kernel keeps the page cache coherent with direct I/O on the same file, but not
    when both write the same page at the same time;
  - a body whose memory address is not aligned as direct I/O needs (a tensor view with
    an odd storage_offset) is copied through this thread's aligned, locked bounce buffer;
  - a tail whose padding up to the next boundary belongs to the same owner (a swap
    extent: ``op.pad_tail``) is written zero-padded / read whole through the bounce
    buffer, so swap traffic never touches the page cache.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import queue
import threading
import warnings

import torch

from ..aligned import address_memoryview, aligned_empty
from ..errors import ShortRead
from .base import Backend, BlockOp, Complete, Direction, split_blocks

log = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE
_FALLBACK_ALIGNMENT = 4096  # memory alignment when the probe cannot run (read-only directory)


def _round_up(x: int, a: int) -> int:
    return -(-x // a) * a


def _round_down(x: int, a: int) -> int:
    return x - x % a


class FileHandle:
    """One request's open file: the direct descriptor (or buffered, if no O_DIRECT), the
    file granularity of direct I/O (the page size; 0 = buffered only), the memory
    alignment direct I/O needs, and a lazily opened buffered twin."""

    def __init__(self, path: str, fd: int, mem_align: int, flags: int):
        self.path = path
        self.fd = fd
        self.align = _PAGE if mem_align else 0
        self.mem_align = mem_align
        self._flags = flags  # flags without O_DIRECT / O_CREAT, for the buffered twin
        self._buffered_fd = fd if mem_align == 0 else -1
        self._lock = threading.Lock()

    def buffered_fd(self) -> int:
        with self._lock:  # two workers may need the twin at once; open it once
            if self._buffered_fd < 0:
                self._buffered_fd = os.open(self.path, self._flags)
            return self._buffered_fd

    def close(self) -> None:
        if self._buffered_fd >= 0 and self._buffered_fd != self.fd:
            os.close(self._buffered_fd)
        os.close(self.fd)
        self.fd = self._buffered_fd = -1


class ThreadBackend(Backend):
    """Executes blocks on real files with ``threads`` worker threads.

    direct: use O_DIRECT where the filesystem allows (see Note [direct I/O]).
    bounce_bytes: size of each worker's aligned bounce buffer (the engine's block size).
    """

    def __init__(self, threads: int = 8, direct: bool = True, bounce_bytes: int = 1 << 20):
        assert threads >= 1, f"threads must be >= 1, got {threads}"
        self.threads = threads
        self.direct = direct
        self.bounce_bytes = _round_up(bounce_bytes, _PAGE)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._complete: Complete | None = None
        self._alignment_by_dev: dict[int, int] = {}  # st_dev -> memory alignment, 0 = no O_DIRECT
        self._warned_devs: set[int] = set()  # filesystems already warned about (no O_DIRECT)
        self._probe_lock = threading.Lock()
        self._local = threading.local()

    # -- lifecycle ------------------------------------------------------------------
    def start(self, complete: Complete) -> None:
        assert not self._workers, "ThreadBackend.start() called twice"
        self._complete = complete
        for i in range(self.threads):
            t = threading.Thread(target=self._worker, name=f"io_engine-{i}", daemon=True)
            t.start()
            self._workers.append(t)

    def shutdown(self) -> None:
        for _ in self._workers:
            self._queue.put(None)
        for t in self._workers:
            t.join()  # why: a worker may still be inside a syscall on a tensor's memory
        self._workers.clear()

    # -- files ----------------------------------------------------------------------
    def open(self, path: str, direction: Direction, create: bool) -> FileHandle:
        base = os.O_CLOEXEC | (os.O_RDONLY if direction is Direction.READ else os.O_WRONLY)
        flags = base | (os.O_CREAT if create and direction is Direction.WRITE else 0)
        if self.direct:
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                fd = -1  # this filesystem refuses O_DIRECT at open
            try:
                align = self._direct_alignment(fd, path) if fd >= 0 else 0
            except BaseException:
                os.close(fd)
                raise
            if align:
                return FileHandle(path, fd, align, base)
            if fd >= 0:
                os.close(fd)
            self._warn_buffered(path)
        return FileHandle(path, os.open(path, flags, 0o644), 0, base)

    def close_handle(self, handle: FileHandle) -> None:
        handle.close()

    def preallocate(self, path: str, num_bytes: int, create: bool) -> None:
        flags = os.O_WRONLY | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if num_bytes > 0:
                os.posix_fallocate(fd, 0, num_bytes)
        finally:
            os.close(fd)

    def remove(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def free_bytes(self, directory: str) -> int | None:
        st = os.statvfs(directory)
        return st.f_bavail * st.f_frsize

    def is_dir(self, directory: str) -> bool:
        return os.path.isdir(directory)

    def _direct_alignment(self, fd: int, path: str) -> int:
        dev = os.fstat(fd).st_dev
        with self._probe_lock:  # probe each filesystem once, even if many requests race here
            if dev not in self._alignment_by_dev:
                align = _probe_direct_alignment(os.path.dirname(os.path.abspath(path)))
                # could not probe (read-only, full): the conservative alignment is safe
                self._alignment_by_dev[dev] = _FALLBACK_ALIGNMENT if align is None else align
            return self._alignment_by_dev[dev]

    def _warn_buffered(self, path: str) -> None:
        dev = os.stat(os.path.dirname(os.path.abspath(path))).st_dev
        with self._probe_lock:
            if dev in self._warned_devs:
                return
            self._warned_devs.add(dev)
        warnings.warn(f"io_engine: the filesystem of {path} does not support O_DIRECT; using "
                      f"buffered I/O there (page cache in the way: slower, uses RAM). Point the "
                      f"[nvme] paths at an ext4/xfs NVMe mount, or set [io] direct = false to "
                      f"silence this.", RuntimeWarning, stacklevel=2)

    # -- blocks ---------------------------------------------------------------------
    def split(self, handle: FileHandle, offset: int, num_bytes: int, block_size: int,
              pad_tail: bool) -> list[tuple[int, int]]:
        first = _round_up(offset, handle.align) if handle.align else None
        return split_blocks(offset, num_bytes, block_size, first)

    def submit(self, op: BlockOp) -> None:
        self._queue.put(op)

    def _worker(self) -> None:
        while True:
            op = self._queue.get()  # why: idle until the engine hands over a block
            if op is None:
                return
            try:
                self._execute(op)
                error = None
            except BaseException as e:  # reported to the request, never lost
                error = e
            try:
                self._complete(op, error)
            except BaseException:  # a bug in the engine's callback: keep the worker alive
                log.exception("io_engine completion callback failed")

    def _execute(self, op: BlockOp) -> None:
        h: FileHandle = op.handle
        mv, off, a = op.mem, op.file_offset, h.align
        end = off + len(mv)
        if a == 0:
            self._loop(h, op.direction, mv, off, direct=False)
            return
        head_end = min(_round_up(off, a), end)
        if head_end > off:
            self._loop(h, op.direction, mv[:head_end - off], off, direct=False)
        body_end = max(_round_down(end, a), head_end)
        if body_end > head_end:
            addr = op.addr + head_end - off
            body = mv[head_end - off:body_end - off]
            if addr % h.mem_align == 0:
                self._loop(h, op.direction, body, head_end, direct=True)
            else:
                self._bounce(h, op.direction, addr, len(body), head_end, padded=len(body))
        if end > body_end:
            tail = mv[body_end - off:]
            if op.pad_tail:
                self._bounce(h, op.direction, op.addr + body_end - off, len(tail), body_end,
                             padded=_round_up(len(tail), a))
            else:
                self._loop(h, op.direction, tail, body_end, direct=False)

    def _loop(self, h: FileHandle, direction: Direction, mv: memoryview, off: int,
              direct: bool) -> None:
        """Transfer all of mv at file offset off, retrying short transfers."""
        fd = h.fd if direct else h.buffered_fd()
        done, n = 0, len(mv)
        while done < n:
            if direction is Direction.READ:
                k = os.preadv(fd, [mv[done:]], off + done)
                if k == 0:
                    raise ShortRead(os.fstat(fd).st_size, off + n)
            else:
                k = os.pwritev(fd, [mv[done:]], off + done)
                if k == 0:
                    raise OSError(errno.EIO, "write transferred 0 bytes")
            done += k
            if direct and done < n and k % h.align:
                fd, direct = h.buffered_fd(), False  # remainder is unaligned: finish buffered

    def _bounce(self, h: FileHandle, direction: Direction, addr: int, length: int, off: int,
                padded: int) -> None:
        """Move [addr, addr+length) <-> file [off, off+padded) through the bounce buffer;
        bytes past length are zeros on write and ignored on read (off is aligned)."""
        bounce_addr, bounce_size = self._bounce_buffer()
        pos = 0
        while pos < padded:
            chunk = min(bounce_size, padded - pos)
            data = max(0, min(chunk, length - pos))
            mv = address_memoryview(bounce_addr, chunk)
            if direction is Direction.WRITE:
                ctypes.memmove(bounce_addr, addr + pos, data)
                if chunk > data:
                    ctypes.memset(bounce_addr + data, 0, chunk - data)
                self._loop(h, direction, mv, off + pos, direct=True)
            else:
                got = 0
                while got < data:
                    k = os.preadv(h.fd, [mv[got:]], off + pos + got)
                    if k == 0:
                        raise ShortRead(os.fstat(h.fd).st_size, off + pos + data)
                    got += k
                    if got < data and got % h.align:
                        self._loop(h, direction, mv[got:data], off + pos + got, direct=False)
                        got = data
                ctypes.memmove(addr + pos, bounce_addr, data)
            pos += chunk

    def _bounce_buffer(self) -> tuple[int, int]:
        buf = getattr(self._local, "bounce", None)
        if buf is None:  # one per worker thread, allocated once, locked
            buf = aligned_empty(self.bounce_bytes, torch.uint8, _PAGE, pin=False, lock=True)
            self._local.bounce = buf
        return buf.data_ptr(), buf.numel()


def _probe_direct_alignment(directory: str) -> int | None:
    """The memory alignment O_DIRECT writes of whole pages need in ``directory``'s
    filesystem (512 or 4096); 0 if O_DIRECT is refused; None if the probe could not run
    (directory not writable or missing, disk full)."""
    name = os.path.join(directory, f".io_engine_probe.{os.getpid()}.{threading.get_ident()}")
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        return 0 if e.errno == errno.EINVAL else None
    try:
        buf = aligned_empty(2 * _PAGE, torch.uint8, _PAGE, pin=False, lock=False)
        for mem_align in (512, _PAGE):  # one page at a page-aligned offset, from memory
            mv = address_memoryview(buf.data_ptr() + mem_align % _PAGE, _PAGE)  # at +512, +0
            try:
                os.pwrite(fd, mv, _PAGE)
                return mem_align
            except OSError as e:
                if e.errno != errno.EINVAL:
                    return None
        return 0
    finally:
        os.close(fd)
        os.unlink(name)


__all__ = ["FileHandle", "ThreadBackend"]
