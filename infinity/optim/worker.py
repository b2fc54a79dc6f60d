"""The optimizer on a background thread: units are submitted as their update becomes possible,
and callers wait for exactly the units they are about to use.

Submission and waiting are the issue/wait pair of the optimizer: `submit(units, ...)`
returns at once; `wait_unit(i)` blocks until unit i's update is stepped and its
write-backs issued; `wait_all()` until everything submitted is. Batches queued while
the thread is busy are merged, so the read-ahead pipeline runs across units. An error
on the worker is raised by every later wait, on the training thread (the state is no
longer the one the step meant, so nothing may continue on it).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Callable

from ..unit import Unit
from .cpu_adam import AdamHyper
from .offloaded import OffloadedOptimizer


@dataclass
class _Batch:
    units: list[Unit]
    hyper: AdamHyper
    grad_scale: float | None
    active: dict[int, list[tuple[int, int, int]]]
    after_unit: Callable[[Unit], None]


class OptimizerWorker:
    """One background thread stepping submitted units in submission order."""

    def __init__(self, optimizer: OffloadedOptimizer, num_units: int):
        self.optimizer = optimizer
        self._queue: queue.Queue = queue.Queue()
        self._done = [threading.Event() for _ in range(num_units)]
        for ev in self._done:
            ev.set()
        self._error: BaseException | None = None
        self.error_reported = False
        self._thread = threading.Thread(target=self._run, name="infinity-optimizer", daemon=True)
        self._thread.start()

    def submit(self, units: list[Unit], *, hyper: AdamHyper, grad_scale: float | None,
               active: dict[int, list[tuple[int, int, int]]], after_unit: Callable[[Unit], None]) -> None:
        """Issue the update of `units` (all submitted batches must share hyper and grad_scale)."""
        for unit in units:
            self._done[unit.index].clear()
        self._queue.put(_Batch(list(units), hyper, grad_scale, active, after_unit))

    def pending(self, index: int) -> bool:
        return not self._done[index].is_set()

    def wait_unit(self, index: int) -> None:
        self._done[index].wait()  # this unit's parameters and optimizer state are being rewritten
        self._raise()

    def wait_all(self) -> None:
        for ev in self._done:
            ev.wait()  # every submitted update must be finished
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            self.error_reported = True
            raise self._error  # sticky: the state is not what the step meant; nothing may continue on it

    def _run(self) -> None:
        while True:
            batch = self._queue.get()  # idle until a unit's update is submitted
            if batch is None:
                return
            batches = [batch]
            while True:  # merge what queued up meanwhile: one pipeline across those units
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                batches.append(more)
            units = [u for b in batches for u in b.units]
            active = {k: v for b in batches for k, v in b.active.items()}
            after = {u.index: b.after_unit for b in batches for u in b.units}

            def done(unit: Unit) -> None:
                after[unit.index](unit)
                self._done[unit.index].set()

            try:
                self.optimizer.step(hyper=batch.hyper, grad_scale=batch.grad_scale, active=active, units=units,
                                    on_unit_done=done)
            except BaseException as e:  # noqa: BLE001 - re-raised on the training thread
                self._error = e
                for unit in units:
                    self._done[unit.index].set()

    @property
    def failed(self) -> bool:
        return self._error is not None

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()  # no update may run after the engine releases its state
