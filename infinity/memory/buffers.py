"""Staging buffers: host buffers (page-aligned, pinned with CUDA, reused) and device buffers;
the memory behind units' unsharded buffers.

Buffers are allocated once per size class and reused; the pool knows which
tensors it handed out (by data pointer: no state is attached to the tensors).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

import torch

from infinity.device.streams import host_wait
from io_engine import AlignedBufferPool, aligned_empty, cuda_host_register, cuda_host_unregister


class StagingBuffers:
    """Host staging for NVMe and cross-device copies, plus device staging on a GPU."""

    def __init__(self, device: torch.device, pin: bool):
        self.device = device
        self.host = AlignedBufferPool(alignment=4096, pin=pin, lock=True)
        self._out: dict[int, tuple[str, torch.Tensor]] = {}  # data_ptr -> (where, the pooled tensor)
        self._lock = threading.Lock()  # a background checkpoint writer shares the pool with training
        self._after: list[tuple[torch.Tensor, object]] = []  # (buffer, event): back to the pool once it is done
        self.peak_bytes_out = 0
        self._bytes_out = 0

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self._after:
            self._sweep()  # buffers whose copies to the device have finished go back first
        t = self.host.get(numel, dtype)
        self._track(t, "host")
        return t

    def device_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "cpu":
            return self.host_buffer(numel, dtype)
        t = torch.empty(numel, dtype=dtype, device=self.device)
        self._track(t, "device")
        return t

    def _track(self, t: torch.Tensor, where: str) -> None:
        if t.numel() == 0:
            return
        with self._lock:
            self._out[t.data_ptr()] = (where, t)
            self._bytes_out += t.numel() * t.element_size()
            self.peak_bytes_out = max(self.peak_bytes_out, self._bytes_out)

    def release_after(self, t: torch.Tensor, event) -> None:
        """Give a buffer back once the device work `event` marks (a copy reading it) is done; checked when
        a host buffer is next asked for, and at close."""
        with self._lock:
            self._after.append((t, event))
        self._sweep()

    def _sweep(self, wait: bool = False) -> None:
        with self._lock:
            ready = [item for item in self._after if wait or item[1].query()]
            self._after = [item for item in self._after if not any(item is r for r in ready)]
        for t, ev in ready:
            if wait:
                host_wait(ev, "staging buffer reuse")  # closing: its copy must have read it
            self.release(t)

    def owns(self, t: torch.Tensor) -> bool:
        return t.numel() > 0 and t.data_ptr() in self._out

    def release(self, t: torch.Tensor) -> None:
        """Give a buffer back; tensors the pool did not hand out are ignored (resident views)."""
        with self._lock:
            if not self.owns(t):
                return
            where, pooled = self._out.pop(t.data_ptr())
            self._bytes_out -= pooled.numel() * pooled.element_size()
        if where == "host":
            self.host.put(pooled)

    def reserve_host(self, buffers: list[tuple[int, torch.dtype]]) -> None:
        """Allocate host buffers of these (numel, dtype) now and keep them free in the pool, so the
        steps that first need them find them there. A buffer allocated mid-step costs a fresh mapping
        and mlock on the way: page faults, zeroing and huge-page compaction while I/O waits for it."""
        taken = [self.host.get(numel, dtype) for numel, dtype in buffers]
        for t in taken:
            self.host.put(t)

    @property
    def host_bytes_allocated(self) -> int:
        return self.host.bytes_allocated

    def close(self) -> None:
        self._sweep(wait=True)
        self._out.clear()
        self.host.close()


class UnshardedMemory:
    """Gives a unit's unsharded storage its bytes (`grow`) and takes them back (`shrink`).

    This one uses the storage's own allocator (`resize_`): the CUDA caching allocator on a
    GPU. `for_device` picks `PooledUnshardedMemory` for a CPU compute device.
    """

    def grow(self, key: Hashable, storage: torch.UntypedStorage, nbytes: int) -> None:
        storage.resize_(nbytes)

    def shrink(self, key: Hashable, storage: torch.UntypedStorage) -> None:
        storage.resize_(0)

    @property
    def pooled_bytes(self) -> int:
        """Bytes this object holds itself (free and lent out); the allocator's are not counted."""
        return 0

    def release_free(self) -> None:
        """Give the free bytes back (offloaded states: Note [offloaded states] in parked.py); the allocator's
        cache is the caller's to empty."""

    @staticmethod
    def for_device(device: torch.device) -> "UnshardedMemory":
        if device.type == "cpu" and hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
            return PooledUnshardedMemory()
        return UnshardedMemory()


class PooledUnshardedMemory(UnshardedMemory):
    """Note [unsharded memory]: on a CPU compute device a unit's parameters are read from NVMe
    straight into its unsharded buffer (no staging copy), and copied there from kept fresh
    parameters. torch's CPU allocator gives a buffer of this size a fresh mapping on every
    `resize_`, with the data 64 bytes past a page boundary: O_DIRECT cannot target it, so
    io_engine moved every byte through a worker's bounce buffer (one more memcpy), and each
    first touch of a fresh page faulted and zeroed it. On the 2-core development VM that CPU
    work slowed the backward itself: 2.4-2.6 s of backward compute per nvme/host/nvme step
    against 1.7-1.85 s with this pool (the compute floor's is 1.4-1.5; benchmarks/RESULTS.md).
    So the bytes come from page-aligned, huge-page-advised mappings that are kept and reused,
    one free list per exact size (units of a model have few sizes). `grow` swaps a pooled
    buffer's data pointer into the unit's storage (`UntypedStorage._swap_data_ptr_`, as FSDP
    and CUDA graph trees do), so the parameters keep viewing the same storage and no autograd
    version counter moves; `shrink` swaps it back out. A storage holding pooled bytes is
    never resized (its allocator did not make them): `grow` asserts it starts empty.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lent: dict[Hashable, torch.Tensor] = {}  # key -> the pooled buffer whose bytes it holds
        self._bytes = 0
        self._lock = threading.Lock()

    def grow(self, key: Hashable, storage: torch.UntypedStorage, nbytes: int) -> None:
        assert storage.nbytes() == 0, f"unsharded storage of {key!r} grown twice ({storage.nbytes()} bytes)"
        with self._lock:
            assert key not in self._lent, f"unsharded storage of {key!r} already holds pooled bytes"
            free = self._free.get(nbytes)
            buf = free.pop() if free else None
        if buf is None:
            buf = aligned_empty(nbytes, torch.uint8, pin=False, lock=False)
            assert buf.storage_offset() == 0, "a page-aligned mapping starts its storage"
            with self._lock:
                self._bytes += buf.untyped_storage().nbytes()
        storage._swap_data_ptr_(buf.untyped_storage())
        with self._lock:
            self._lent[key] = buf

    def shrink(self, key: Hashable, storage: torch.UntypedStorage) -> None:
        with self._lock:
            buf = self._lent.pop(key, None)
        assert buf is not None, f"shrink of {key!r}, whose storage holds no pooled bytes"
        storage._swap_data_ptr_(buf.untyped_storage())  # the storage gets its empty pointer back
        with self._lock:
            self._free.setdefault(buf.numel(), []).append(buf)

    @property
    def pooled_bytes(self) -> int:
        return self._bytes

    def release_free(self) -> None:
        with self._lock:
            free, self._free = self._free, {}
            self._bytes -= sum(b.untyped_storage().nbytes() for bufs in free.values() for b in bufs)


# Note [pinned arena]: every host-tier shard comes from one allocation, sub-allocated at page boundaries
# and, with CUDA, page-locked once at its exact size (cudaHostRegister). A `torch.empty(pin_memory=True)` per
# shard goes through PyTorch's caching host allocator, which rounds each block up to a power of two and
# keeps it: up to twice the planned pinned bytes, so a host tier sized to the RAM that is free would fail
# or be OOM-killed. The arena's bytes are the plan's host state bytes plus at most one page per shard.
ARENA_ALIGN = 4096


def arena_bytes(numels_and_dtypes) -> int:
    """The arena bytes of shards of (numel, dtype): each rounded up to a page."""
    return sum(-(-n * dtype.itemsize // ARENA_ALIGN) * ARENA_ALIGN for n, dtype in numels_and_dtypes)


class HostArena:
    """The host tier's shards, sub-allocated from one allocation of `nbytes` (Note [pinned arena])."""

    def __init__(self, nbytes: int, pin: bool):
        self.nbytes, self.pinned = nbytes, pin and nbytes > 0
        self._raw = aligned_empty(nbytes, torch.uint8, pin=False, lock=False) if nbytes else None
        if self.pinned:
            cuda_host_register(self._raw)
        self._used = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `numel` elements at the next page boundary of the arena."""
        nbytes = numel * dtype.itemsize
        start, self._used = self._used, self._used + arena_bytes([(numel, dtype)])
        assert self._used <= self.nbytes, f"host arena of {self.nbytes} bytes overrun: {self._used} taken"
        return self._raw[start:start + nbytes].view(dtype)

    def close(self) -> None:
        if self.pinned:
            self.pinned = False
            cuda_host_unregister(self._raw)  # (the bytes go when the last shard view dies)
