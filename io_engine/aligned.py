"""Page-aligned, page-locked CPU buffers (pinned with CUDA where CUDA is present).

Note [why lock]: direct I/O pins the user pages of every request; on the VM this was
measured on, reads and writes from mlock'ed memory ran close to 2x faster than from
ordinary (even pre-faulted) memory. So every buffer the engine or its users transfer
through should come from here.

Without CUDA a buffer is an anonymous mmap (page aligned by construction) wrapped by
``torch.frombuffer``; the tensor holds a reference to the mmap, so the memory is
unmapped (and unlocked) when the last view of the tensor dies. With CUDA and
``pin`` not False it is torch pinned memory (cudaHostAlloc: page-locked already).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
import warnings
import weakref

import torch

_PAGE = mmap.PAGESIZE
_HUGE = 2 << 20
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mlock.restype = ctypes.c_int
_lock_warned = False
_lock_warn_guard = threading.Lock()


def _check_alignment(alignment: int) -> None:
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a positive power of two, got {alignment!r}")


def mlock(address: int, num_bytes: int) -> bool:
    """Lock [address, address + num_bytes) in RAM (rounded out to pages). Warn once on failure."""
    global _lock_warned
    start = address - address % _PAGE
    length = address + num_bytes - start
    if _libc.mlock(ctypes.c_void_p(start), ctypes.c_size_t(length)) == 0:
        return True
    err = ctypes.get_errno()
    with _lock_warn_guard:
        if not _lock_warned:
            _lock_warned = True
            import resource
            soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            warnings.warn(
                f"io_engine: mlock of {num_bytes} bytes failed ({os.strerror(err)}; "
                f"RLIMIT_MEMLOCK={soft}): I/O buffers are not page-locked and direct I/O may run "
                f"up to ~2x slower. Raise `ulimit -l` (e.g. `ulimit -l unlimited`) or grant "
                f"CAP_IPC_LOCK, or pass lock=False to silence this.",
                RuntimeWarning, stacklevel=3)
    return False


def cuda_host_register(tensor: torch.Tensor) -> None:
    """Page-lock `tensor`'s bytes for DMA at their exact size (cudaHostRegister through torch.cuda.cudart)."""
    nbytes = tensor.numel() * tensor.element_size()
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
    assert int(err) == 0, f"cudaHostRegister of {nbytes} bytes failed: {err}"


def cuda_host_unregister(tensor: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


def _cuda_pinned(nbytes: int, alignment: int) -> torch.Tensor:
    """Pinned uint8 tensor of exactly nbytes (page-rounded) at an aligned address: a fresh mapping registered
    with CUDA, unregistered when its last view dies. Not `torch.empty(pin_memory=True)`: PyTorch's caching host
    allocator rounds every pinned block up to a power of two and keeps it (a 5 MiB size class would pin 8 MiB;
    Note [pinned arena] in infinity/memory/buffers.py)."""
    raw, mapping = _mapping(nbytes, alignment)
    cuda_host_register(raw)
    ptr = raw.data_ptr()
    weakref.finalize(mapping, lambda: torch.cuda.cudart().cudaHostUnregister(ptr))  # before the unmap
    return raw


def _mapping(nbytes: int, alignment: int) -> tuple[torch.Tensor, mmap.mmap]:
    """uint8 tensor of nbytes in a fresh anonymous mapping, aligned; and the mapping (freed with the tensor)."""
    extra = alignment - _PAGE if alignment > _PAGE else 0
    length = -(-(nbytes + extra) // _PAGE) * _PAGE
    m = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if length >= _HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)  # fewer pages for the kernel to pin per request
    base = torch.frombuffer(m, dtype=torch.uint8)  # holds a reference to m: freed with the tensor
    shift = (-base.data_ptr()) % alignment
    return base[shift:shift + nbytes], m


def _mapped(nbytes: int, alignment: int, lock: bool) -> torch.Tensor:
    """uint8 tensor of nbytes in a fresh anonymous mapping, aligned, optionally mlock'ed."""
    raw, _ = _mapping(nbytes, alignment)
    if lock:
        mlock(raw.data_ptr(), nbytes)
    return raw


def aligned_empty(numel: int, dtype: torch.dtype = torch.float32, alignment: int = 4096,
                  pin: bool | None = None, lock: bool = True) -> torch.Tensor:
    """Uninitialized 1-D CPU tensor of ``numel`` elements whose data starts at a multiple of
    ``alignment`` bytes.

    pin:  None = pinned (CUDA page-locked) when CUDA is available; True = same (without
          CUDA there is nothing to pin, the buffer is mlock'ed instead); False = never.
    lock: mlock the pages of a non-CUDA buffer (root or a large RLIMIT_MEMLOCK; warns once
          when the OS refuses). The memory is released when the tensor and its views die.
    """
    _check_alignment(alignment)
    if not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    nbytes = numel * dtype.itemsize
    use_cuda = pin is not False and torch.cuda.is_available()
    raw = _cuda_pinned(nbytes, alignment) if use_cuda else _mapped(nbytes, alignment, lock)
    assert raw.data_ptr() % alignment == 0, (
        f"buffer at {raw.data_ptr():#x} is not aligned to {alignment}")
    return raw.view(dtype)


def size_class(nbytes: int, alignment: int) -> int:
    """Smallest class >= nbytes: powers of two split in quarter steps (<= 25% waste)."""
    n = max(nbytes, alignment)
    top = 1 << (n - 1).bit_length()
    if top <= 4 * alignment:
        return top
    step = top // 8  # classes between top/2 and top: top/2 + k * top/8
    return -(-n // step) * step


class AlignedBufferPool:
    """Reusable aligned (pinned / mlock'ed) buffers, grouped by byte size class.

    ``get`` hands out a tensor of exactly ``numel`` elements backed by a buffer of the
    size class (allocated on first need, then reused); ``put`` returns it. Thread-safe.
    """

    def __init__(self, alignment: int = 4096, pin: bool | None = None, lock: bool = True):
        _check_alignment(alignment)
        self.alignment = alignment
        self.pin = pin
        self.lock = lock
        self._guard = threading.Lock()
        self._free: dict[int, list[torch.Tensor]] = {}
        self._in_use: dict[int, tuple[int, torch.Tensor]] = {}  # data_ptr -> (class, buffer)
        self._bytes_allocated = 0
        self._closed = False

    @property
    def bytes_allocated(self) -> int:
        """Bytes of all buffers this pool allocated and still holds (free + in use)."""
        return self._bytes_allocated

    @property
    def bytes_in_use(self) -> int:
        """Bytes of the size classes currently handed out."""
        with self._guard:
            return sum(c for c, _ in self._in_use.values())

    def get(self, numel: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """An aligned tensor of ``numel`` elements of ``dtype`` (contents undefined)."""
        if self._closed:
            raise RuntimeError("AlignedBufferPool.get() after close(): create a new pool")
        nbytes = numel * dtype.itemsize
        cls = size_class(nbytes, self.alignment)
        with self._guard:
            free = self._free.get(cls)
            buf = free.pop() if free else None
        if buf is None:
            buf = aligned_empty(cls, torch.uint8, self.alignment, self.pin, self.lock)
            with self._guard:
                self._bytes_allocated += cls
        with self._guard:
            self._in_use[buf.data_ptr()] = (cls, buf)
        return buf[:nbytes].view(dtype)

    def put(self, tensor: torch.Tensor) -> None:
        """Return a tensor obtained from ``get``; it must not be used afterwards."""
        with self._guard:
            entry = self._in_use.pop(tensor.data_ptr(), None)
            if entry is None:
                raise ValueError(
                    f"tensor at {tensor.data_ptr():#x} was not handed out by this pool (or was "
                    f"already put back): put() only what get() returned, once")
            size_class, buf = entry
            if not self._closed:
                self._free.setdefault(size_class, []).append(buf)
            else:
                self._bytes_allocated -= size_class

    def close(self) -> None:
        """Drop the free buffers; buffers still in use are freed when their tensors die."""
        with self._guard:
            self._closed = True
            for size_class, bufs in self._free.items():
                self._bytes_allocated -= size_class * len(bufs)
            self._free.clear()


_PyMemoryView_FromMemory = ctypes.pythonapi.PyMemoryView_FromMemory
_PyMemoryView_FromMemory.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PyMemoryView_FromMemory.restype = ctypes.py_object
_PyBUF_WRITE = 0x200


def address_memoryview(address: int, num_bytes: int) -> memoryview:
    """A writable byte memoryview of [address, address + num_bytes). The caller keeps the
    owner of that memory alive for as long as the view is used. (Not a ctypes array: those
    create and cache one type per distinct length.)"""
    return _PyMemoryView_FromMemory(address, num_bytes, _PyBUF_WRITE)


def tensor_memoryview(tensor: torch.Tensor) -> memoryview:
    """Byte memoryview of a contiguous CPU tensor's data (any dtype); see address_memoryview."""
    return address_memoryview(tensor.data_ptr(), tensor.numel() * tensor.element_size())
