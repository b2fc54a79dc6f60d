"""The issue/wait handles of the tiered memory manager: what `fetch` and `store` return.

A handle is issued at once and completed by whoever waits for it first (the caller, a later fetch of the same
bytes, a drain); `wait()` then runs its `after` step once (release a staging buffer, mark chunks resident).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from infinity.device.streams import host_wait


class Pending:
    """An issued fetch or store. `wait()` returns the tensor (fetch) or None (store)."""

    def __init__(self, result=None, futures=(), after=None):
        self._result, self._futures, self._after = result, list(futures), after
        self._done = False
        self._lock = threading.Lock()  # the training thread and the optimizer worker may wait on the same write

    def done(self) -> bool:
        return self._done or all(f.done() for f in self._futures)

    def wait(self):
        if self._done:
            return self._result
        with self._lock:
            if not self._done:
                for fut in self._futures:
                    fut.wait()  # the bytes must be on disk / in the buffer before the caller touches them
                if self._after is not None:
                    self._after()
                self._done = True
        return self._result


class Chained(Pending):
    """A fetch followed by a step that runs at wait() time (e.g. NVMe read, then host-to-device)."""

    def __init__(self, first: Pending, then):
        super().__init__()
        self._first, self._then = first, then

    def done(self) -> bool:
        return self._first.done()

    def wait(self):
        with self._lock:
            if not self._done:
                self._result = self._then(self._first.wait())
                self._done = True
        return self._result


class WritesAfterCopy:
    """Disk writes of host bytes that a device-to-host copy is still filling (Note [stores after their copy]).

    Note [stores after their copy]: a store of a device tensor to the NVMe tier copies it into a host staging
    buffer on the d2h stream, and the disk write must read that buffer only once the copy is done. The storing
    thread (the training thread for gradients, the optimizer worker for moments) does not wait for the copy:
    it hands the copy's event and the write submission to one copy-waiter thread per manager, which blocks on
    the event and then submits the writes, in the order stores were issued. So a steady step's host syncs on
    the training thread do not grow with the units (Note [host syncs]). The handle looks like one I/O future
    to `Pending`: `done()` and `wait()` over the writes once they are submitted; an error submitting them (a
    full disk) is raised by `wait()`.
    """

    def __init__(self, waiter: ThreadPoolExecutor, copied, submit):
        self._submitted = waiter.submit(self._run, copied, submit)

    @staticmethod
    def _run(copied, submit):
        host_wait(copied, "d2h copy before its disk write")  # (on the copy-waiter thread: the write reads it)
        return submit()

    def done(self) -> bool:
        return self._submitted.done() and all(f.done() for f in self._submitted.result())

    def wait(self) -> None:
        for fut in self._submitted.result():
            fut.wait()
