"""The job's batches built ahead of the step on a background thread.

Note [batches ahead]: the batches of optimizer step s are a function of (data.seed, s) alone (Note [same batches
at every world size]), so they can be built before step s starts: a worker thread builds the windows of the next
`depth` steps (the sampler, the memory-mapped reads, the collation of samples and, on a CPU device, their
attention masks and position ids) and, when the device is a GPU, copies them into pinned host memory, so the
training thread only takes them from a queue and starts their copies without blocking (`to_device`), as
`DataLoader(num_workers=..., pin_memory=True)` does. On a GPU the attention masks are built on the device from the
segment ids (a [B, T, T] mask copied from the host would cost more than building it there). The steps come out
in order, each exactly the window `batches.window` gives (a resumed run starts the thread at its step), and an
error on the thread is raised on the training thread at the step that needed it.
"""

from __future__ import annotations

import queue
import threading

import torch

DEPTH = 2  # steps built ahead


def to_device(x, device: torch.device):
    """A batch's inputs (a tensor, or a dict of tensors built ahead) on `device`, copied without blocking."""
    if isinstance(x, dict):
        return {k: v.to(device, non_blocking=True) for k, v in x.items()}
    return x.to(device, non_blocking=True)


def _pinned(x):
    if isinstance(x, dict):
        return {k: v.pin_memory() for k, v in x.items()}
    return x.pin_memory()


class BatchesAhead:
    """The windows of steps `first` .. `last` - 1 (0-based, as `batches.window` counts them), built ahead on a
    thread (Note [batches ahead]); `window(step)` takes them in order. `close()` stops the thread."""

    def __init__(self, batches, first: int, last: int, accum: int, device: torch.device, depth: int = DEPTH):
        self.batches, self.accum, self.next = batches, accum, first
        self.pin = device.type == "cuda" and torch.cuda.is_available()
        self.prepare = getattr(batches, "inputs_ahead", None) if device.type == "cpu" else None
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, args=(first, last), daemon=True,
                                        name="infinity-batches-ahead")
        self._thread.start()

    def _build(self, step: int):
        rows, items = self.batches.window(step, self.accum)
        out = []
        for x, y in rows:
            if self.prepare is not None:
                x = self.prepare(x)
            if self.pin:
                x, y = _pinned(x), y.pin_memory()
            out.append((x, y))
        return out, items

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _work(self, first: int, last: int) -> None:
        for step in range(first, last):
            try:
                item = (step, self._build(step), None)
            except BaseException as e:  # noqa: BLE001 - raised on the training thread (window)
                self._put((step, None, e))
                return
            if not self._put(item):
                return

    def window(self, step: int):
        """(rows, items) of step `step`, as `batches.window(step, accum)` gives them (the inputs built ahead)."""
        assert step == self.next, f"batches ahead: step {step} asked for, {self.next} is next"
        got, rows, error = self._queue.get()
        assert got == step
        if error is not None:
            raise error
        self.next += 1
        return rows

    def close(self) -> None:
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=10)
