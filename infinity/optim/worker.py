"""The optimizer on a background thread: units are submitted as their update becomes possible,
and callers wait for exactly the units they are about to use.

Submission and waiting are the issue/wait pair of the optimizer: `submit(units, ...)`
returns at once; `wait_unit(i)` blocks until unit i's update is stepped and its
write-backs issued; `wait_all()` until everything submitted is. Batches queued while
the thread is busy are merged and stepped in the next forward's order: all at once when
the update reads state from NVMe (the read pipeline runs across units), else one at a
time, merging again after each (Note [forward first, again]). An error
on the worker is raised by every later wait, on the training thread (the state is no
longer the one the step meant, so nothing may continue on it).

With a device lane (Note [device lane] in memory/placement.py) a second thread steps on the GPU the batches
submitted `lane=True`, taking the one the next forward uses last while the first thread takes the one it uses
first, until they meet (`_LaneShare`); each batch is stepped by exactly one of them, and the waits are the same.

When its queue is empty the thread reads the next update's optimizer state ahead
(Note [state read-ahead]), one chunk at a time so that a new submission is never kept
waiting for more than one chunk's issue, with at most READS_IN_FLIGHT chunks being read;
`read_ahead_next(chunks)` queues the order of the next update behind the batches already
submitted.
"""

from __future__ import annotations

import bisect
import contextlib
import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from infinity.device.streams import Streams, bind_cores, bind_thread, budget_threads, host_poll
from infinity.memory.device_lane import LANE_UNITS_IN_FLIGHT
from infinity.optim.cpu_adam import Hypers
from infinity.optim.offloaded import OffloadedOptimizer, Run
from infinity.optim.read_ahead import Issue, StateReadAhead
from infinity.units.unit import Unit

_POLL_S = 0.002  # while the read-ahead waits for a chunk to land: 2 ms of latency on ~50 ms reads


Active = dict[int, list[Run]]  # per unit: the (start, length, adam step, group) runs to step


@dataclass
class _Batch:
    units: list[Unit]
    hyper: Hypers  # per parameter group
    grad_scale: float | None
    active: Active | Callable[[], Active | None]  # or resolved on the worker (it may wait for the device there)
    after_unit: Callable[[Unit], None]
    submitted: object = None  # an event after the work the submitting thread queued (the gradients)
    journal: object = None  # how the update uses the speculation's journal (Note [speculative update])
    position: int = 0  # where the next forward uses the units (Note [forward first])
    lane: bool = False  # the device lane may step it instead (Note [device lane])
    grads: tuple | None = None  # its unit's final gradient kept on the device, and that gradient's chunk, for the lane

    def joins(self, other: "_Batch") -> bool:
        """May `other` run in one pipeline with this batch: the same update, and its gradients on the device
        (Note [merge only what the device has reached])."""
        return (other.journal is self.journal and other.grad_scale == self.grad_scale and other.hyper == self.hyper
                and other.submitted.query())


_NOTHING = object()


@dataclass
class _Order:
    """The (unit, chunk) order of the next update, to read its state ahead."""
    chunks: list[tuple[int, int]]


@dataclass
class _Mark:
    """Set `event` once every item queued before it has been handled."""
    event: threading.Event


class _LaneShare:
    """The batches both threads may step (Note [device lane]), in the next forward's order: the CPU's thread claims
    each as it reaches it in its queue, the lane takes the last one left; whoever comes second leaves it."""

    def __init__(self):
        self._cond = threading.Condition()
        self._batches: list[_Batch] = []  # sorted by position
        self._closed = False
        self._filling = False  # a step is offering its batches: the last one is not known yet

    @contextlib.contextmanager
    def filling(self):
        """Offers made inside are taken only once all are made: the lane's first is then the forward's last unit,
        not whichever was offered last when it woke (the submitting thread gives up the GIL between offers)."""
        with self._cond:
            self._filling = True
        try:
            yield
        finally:
            with self._cond:
                self._filling = False
                self._cond.notify_all()

    def offer(self, batch: _Batch) -> None:
        with self._cond:
            self._batches.insert(bisect.bisect([b.position for b in self._batches], batch.position), batch)
            self._cond.notify_all()

    def claim(self, batch: _Batch) -> bool:
        """The CPU's thread is about to step `batch`: True unless the lane took it."""
        with self._cond:
            for i, b in enumerate(self._batches):
                if b is batch:
                    del self._batches[i]
                    return True
            return False

    def take_last(self) -> _Batch | None:
        """The lane's next batch (the forward's last one left); None once closed."""
        with self._cond:
            self._cond.wait_for(lambda: (self._batches and not self._filling) or self._closed)
            return self._batches.pop() if self._batches else None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class OptimizerWorker:
    """One background thread stepping submitted units, those the next forward needs first first."""

    def __init__(self, optimizer: OffloadedOptimizer, num_units: int, read_ahead: StateReadAhead | None = None,
                 streams: Streams | None = None, threads: int | None = None, cores: frozenset[int] | None = None,
                 pipeline_batches: bool = False, lane: OffloadedOptimizer | None = None):
        self.optimizer = optimizer
        self.lane = lane  # the device lane's optimizer (Note [device lane]): it steps on the GPU
        self._share = _LaneShare() if lane is not None else None
        # every ready batch in one pipeline (state read from NVMe: the reads run on across units), or one batch at a
        # time (Note [forward first, again])
        self.pipeline_batches = pipeline_batches  # (a state read-ahead exists only for state on NVMe)
        self.threads = threads  # its intra-op threads (Note [thread budget]); None: torch's count
        self.cores = cores  # the cores it and its intra-op threads run on (Note [core binding]); None: unbound
        self.read_ahead = read_ahead
        # Note [merge only what the device has reached]:
        # batches queued while the worker was busy are merged into one pipeline, but only those whose
        # `submitted` event the device has passed. The training thread runs ahead of the GPU: during backward it
        # queues every unit's submission long before the GPU computes those gradients, so a merge of everything
        # queued would wait on the stream (and for each unit's norm, on the host) for the last unit's event, the
        # end of backward, before stepping the first: the H200's ZeRO-Offload profile (a burst of updates early
        # in backward, then none until it ends). Merging only what is ready keeps each update behind its own
        # unit's gradient, during backward. On the CPU every event is complete: everything queued is merged.
        # Note [forward first]: of the batches merged into one pipeline, the units the next forward uses first
        # are stepped first. During backward the CPU update may fall behind the device (case b on the H200: 292 ms
        # of Adam for 220 ms of backward); at backward's end the units still queued are the forward's first ones,
        # which arrived last. Stepped in arrival order, the forward's first unit would wait for all of them; in
        # forward order it waits for one, and each later one is paced by the update, not by the whole backlog.
        # Note [update stream]: on a GPU the worker queues its device work (a device-tier Adam step, the
        # parameters' cast and copies) on its own stream, never the compute stream it would serialize with:
        # it waits on the device for the gradients the training thread produced (an event recorded at
        # submit), and whoever uses a unit after its update waits on the device for an event recorded
        # when the update was issued (wait_unit).
        self.streams = streams or Streams(torch.device("cpu"))
        self._updated = [self.streams.record() for _ in range(num_units)]  # per unit: after its last update
        self._queue: queue.Queue = queue.Queue()
        self._done = [threading.Event() for _ in range(num_units)]  # set: no update of the unit is queued or running
        for ev in self._done:
            ev.set()
        self._queued = [0] * num_units  # per unit: submitted batches not finished (a unit may have two: a
        self._count = threading.Lock()  # speculated update and its redo, Note [speculative update])
        self._error: BaseException | None = None
        self.error_reported = False
        self._thread = threading.Thread(target=self._run, name="infinity-optimizer", daemon=True)
        self._thread.start()
        self._lane_thread = None
        if lane is not None:
            self._lane_thread = threading.Thread(target=self._run_lane, name="infinity-lane", daemon=True)
            self._lane_thread.start()

    def submit(self, units: list[Unit], *, hyper: Hypers, grad_scale: float | None,
               active: Active | Callable[[], Active | None], after_unit: Callable[[Unit], None],
               journal=None, position: int = 0, lane: bool = False, grads: tuple | None = None) -> None:
        """Issue the update of `units`. `active` may be a function the worker calls first (Note [host syncs] in
        streams.py); if it returns None the batch's units are not stepped (their waits return; `after_unit` is
        not called). `journal`: how the update uses the speculation's journal (Note [speculative update]).
        `position`: where the next forward uses these units (Note [forward first]). `lane`: the device lane, if
        there is one, may step them instead (Note [device lane]; never a journal's update), reading the one unit's
        final gradient from `grads` (the tensor kept on the device, its chunk of the gradient store) if given."""
        assert not (lane and journal is not None), "a speculated update is the CPU's (its journal)"
        with self._count:
            for unit in units:
                self._queued[unit.index] += 1
                self._done[unit.index].clear()
        shared = lane and self._share is not None
        batch = _Batch(list(units), hyper, grad_scale, active, after_unit, self.streams.record(), journal, position,
                       lane=shared, grads=grads if shared else None)
        if batch.lane:
            self._share.offer(batch)  # (before the queue: the lane may take it at once)
        self._queue.put(batch)

    def offering(self):
        """Context manager: the batches submitted inside for the lane are offered to it together (Note [device
        lane]); without a lane, nothing."""
        return self._share.filling() if self._share is not None else contextlib.nullcontext()

    def read_ahead_next(self, chunks: list[tuple[int, int]]) -> None:
        """After the batches submitted so far: read ahead the state of `chunks` (the next update's order)."""
        if self.read_ahead is not None:
            self._queue.put(_Order(chunks))

    def quiesce(self) -> None:
        """Wait until the thread has handled everything queued, then pause the read-ahead and land its
        reads in flight (the state may then be stored by others); `resume()` undoes the pause."""
        if self.read_ahead is None:
            return
        mark = _Mark(threading.Event())
        self._queue.put(mark)
        mark.event.wait()  # the queue may still hold an order that would restart reading ahead
        self.read_ahead.land()

    def resume(self) -> None:
        if self.read_ahead is not None:
            self.read_ahead.resume()
            self._queue.put(_Mark(threading.Event()))  # wake the thread to continue reading ahead

    def pending(self, index: int) -> bool:
        return not self._done[index].is_set()

    def wait_unit(self, index: int) -> None:
        self._done[index].wait()  # this unit's parameters and optimizer state are being rewritten
        self.streams.wait_event(self._updated[index])  # (and its device work, on the device: Note [update stream])
        self._raise()

    def wait_all(self) -> None:
        for ev in self._done:
            ev.wait()  # every submitted update must be finished
        for event in self._updated:
            self.streams.wait_event(event)
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            self.error_reported = True
            raise self._error  # sticky: the state is not what the step meant; nothing may continue on it

    def _next_item(self):
        """The next queued item; while there is none, read ahead (one chunk per look at the queue)."""
        while True:
            try:
                return self._queue.get_nowait()
            except queue.Empty:
                pass
            issued = Issue.IDLE if self.read_ahead is None or self._error is not None else self._read_one()
            if issued is Issue.IDLE:
                return self._queue.get()  # idle until a unit's update is submitted
            if issued is Issue.BUSY:
                try:
                    return self._queue.get(timeout=_POLL_S)  # a submission, or look again when a read may have landed
                except queue.Empty:
                    pass

    def _read_one(self) -> Issue:
        try:
            return self.read_ahead.issue_next()
        except BaseException as e:  # noqa: BLE001 - re-raised on the training thread
            self._error = e
            return Issue.IDLE

    def _run(self) -> None:
        bind_thread(self.optimizer.compute_device)  # its copies and kernels go to this rank's GPU
        if self.cores:
            bind_cores(self.cores)  # before its intra-op threads start: they inherit it
        if self.threads is not None:
            budget_threads(self.threads)
        with self.streams.use(self.streams.update):  # Note [update stream]
            self._loop()

    def _loop(self) -> None:
        held = _NOTHING  # an item taken from the queue while merging batches, handled once the backlog is done
        backlog: list[_Batch] = []  # merged batches not stepped yet (Note [forward first, again])
        while True:
            if not backlog:
                item, held = (held, _NOTHING) if held is not _NOTHING else (self._next_item(), _NOTHING)
                if item is None:
                    return
                if isinstance(item, _Order):
                    self.read_ahead.set_order(item.chunks)
                    continue
                if isinstance(item, _Mark):
                    item.event.set()
                    continue
                backlog = [item]
            while True:  # merge the batches queued up meanwhile (and the one held, if ready now): one pipeline
                if held is not _NOTHING:
                    more, held = held, _NOTHING
                else:
                    try:
                        more = self._queue.get_nowait()
                    except queue.Empty:
                        break
                if not isinstance(more, _Batch) or not backlog[0].joins(more):
                    # an order, a mark or the end: after these batches; so is another kind of update, or a batch
                    # whose gradients the device has not produced yet (Note [merge only what the device has reached])
                    held = more
                    break
                backlog.append(more)
            backlog.sort(key=lambda b: b.position)  # Note [forward first]
            # Note [forward first, again]: without state on NVMe (no pipeline of disk reads across units to keep
            # going) one batch is stepped at a time, and the merge is done again after each, the batch held
            # back as not yet reached included: a batch the device reaches meanwhile goes before the backlog's
            # later ones when the next forward needs it sooner. On the H100 (case l) the worker had merged the
            # thirteen units ready near backward's end (five of them CPU updates), the forward's first units
            # arrived a moment later behind them, and the forward waited 123 ms for the whole backlog.
            split = len(backlog) if self.pipeline_batches else 1
            batches, backlog = backlog[:split], backlog[split:]
            batches = [b for b in batches if not b.lane or self._share.claim(b)]  # (else the lane has stepped it)
            for b in batches:
                b.grads = None  # a gradient kept for the lane: not the CPU's to read (its device memory goes now)
            if not batches:
                continue
            self._step(self.optimizer, batches, before=self.read_ahead.issue_rest if self.read_ahead else None)

    def _step(self, optimizer: OffloadedOptimizer, batches: list[_Batch], before=None, after=None,
              **kwargs) -> None:
        """Step `batches` with `optimizer`, one pipeline: their gradients waited for on this thread's stream,
        their active ranges resolved; `before()` and `after()` run beside the step (their errors are its
        errors); `kwargs` go to the step. Units not stepped (resolved to None, or after an error: sticky, no
        update runs on the state a failed one left) finish unstepped, their waits raising the error."""
        journal = batches[0].journal  # (merged batches are one update: Note [merge only what the device has reached])
        for b in batches:
            self.streams.wait_event(b.submitted)  # the gradients were produced on the training thread's stream
        if self._error is None:
            batches = self._resolve(batches)
        units = [u for b in batches for u in b.units]
        if self._error is not None or not batches:
            for unit in units:
                self._finished(unit)  # (their waits raise the error)
            return
        active = {k: v for b in batches for k, v in b.active.items()}
        after_unit = {u.index: b.after_unit for b in batches for u in b.units}
        finished: set[int] = set()

        def done(unit: Unit) -> None:
            after_unit[unit.index](unit)
            self._updated[unit.index] = self.streams.record()  # users of the unit wait for this on the device
            finished.add(unit.index)
            self._finished(unit)

        try:
            if before is not None:
                before()  # Note [reads before writes]
            optimizer.step(hyper=batches[0].hyper, grad_scale=batches[0].grad_scale, active=active, units=units,
                           on_unit_done=done, journal=journal, **kwargs)
            if after is not None:
                after()
        except BaseException as e:  # noqa: BLE001 - re-raised on the training thread
            self._error = e
            for unit in units:
                if unit.index not in finished:
                    self._finished(unit)

    def _run_lane(self) -> None:
        bind_thread(self.lane.compute_device)
        with self.streams.use(self.streams.lane):  # (its own: Streams.lane) the units' users wait for its events
            self._lane_loop()

    def _lane_loop(self) -> None:
        """Note [device lane]: take the forward's last batch left, step it on the device (copies and kernels queued,
        nothing waited for on this thread), and take the next once at most LANE_UNITS_IN_FLIGHT - 1 of its
        earlier batches' copies back are still running: the lane goes at PCIe's pace and holds that much staging."""
        in_flight: deque = deque()  # per batch stepped: an event after its copies back

        def pace() -> None:
            in_flight.append(self.streams.record(self.streams.d2h))  # (the copies back wait for the update)
            while len(in_flight) >= LANE_UNITS_IN_FLIGHT:
                host_poll(in_flight.popleft(), "device lane pace")

        while (batch := self._share.take_last()) is not None:
            assert batch.grads is None or len(batch.units) == 1, "a kept gradient is one unit's"
            kept = {batch.units[0].index: batch.grads} if batch.grads is not None else None
            self._step(self.lane, [batch], after=pace, kept_grads=kept)
            batch.grads = kept = None  # (its device memory goes once its uses are done; the CPU's queue still holds
            # this batch until it reaches it)

    def _resolve(self, batches: list[_Batch]) -> list[_Batch]:
        """The batches with their active ranges resolved; those that resolve to None are done, unstepped."""
        out = []
        for b in batches:
            try:
                active = b.active() if callable(b.active) else b.active
            except BaseException as e:  # noqa: BLE001 - re-raised on the training thread
                self._error = e
                active = {}
            if active is None:
                for unit in b.units:
                    self._finished(unit)  # not stepped (the mode knows why)
                continue
            b.active = active
            out.append(b)
        return out

    def _finished(self, unit: Unit) -> None:
        """One of the unit's batches is done; its waits return once none is left."""
        with self._count:
            self._queued[unit.index] -= 1
            if self._queued[unit.index] == 0:
                self._done[unit.index].set()

    @property
    def failed(self) -> bool:
        return self._error is not None

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()  # no update may run after the engine releases its state
        if self._lane_thread is not None:
            self._share.close()
            self._lane_thread.join()
        if self.read_ahead is not None:
            try:
                self.read_ahead.drop()
            except Exception:
                if not self.error_reported:
                    raise  # a read-ahead that failed and that no update consumed
                # else: more reads that failed with the error already raised to the caller
