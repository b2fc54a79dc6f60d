"""Staging buffers: host buffers (page-aligned, pinned with CUDA, reused) and device buffers.

Buffers are allocated once per size class and reused; the pool knows which
tensors it handed out (by data pointer: no state is attached to the tensors).
"""

from __future__ import annotations

import threading

import torch

from io_engine import AlignedBufferPool


class StagingBuffers:
    """Host staging for NVMe and cross-device copies, plus device staging on a GPU."""

    def __init__(self, device: torch.device, pin: bool):
        self.device = device
        self.host = AlignedBufferPool(alignment=4096, pin=pin, lock=True)
        self._out: dict[int, tuple[str, torch.Tensor]] = {}  # data_ptr -> (where, the pooled tensor)
        self._lock = threading.Lock()  # a background checkpoint writer shares the pool with training
        self.peak_bytes_out = 0
        self._bytes_out = 0

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
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

    @property
    def host_bytes_allocated(self) -> int:
        return self.host.bytes_allocated

    def close(self) -> None:
        self._out.clear()
        self.host.close()
