"""The rank's six CUDA streams, with a CPU no-op fallback: compute (the training thread's forward and
backward), h2d (host-to-device copies), d2h (device-to-host copies), comm (collectives), update (the optimizer
worker's device-tier Adam) and lane (the device lane's Adam: Note [device lane]); docs/architecture.md §2,
"Streams and events", maps who queues what on each and who waits for it.

On a GPU, copies, collectives and updates run on their own streams so they overlap
compute; ordering between streams is expressed with events (`record` on the
producer, `wait` on the consumer), never with a host synchronization. On the
CPU every stream is the same synchronous executor, and events are no-ops.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch


class _NoEvent:
    """CPU stand-in for torch.cuda.Event: the work it marks is already complete."""

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


# Note [stream-ordered memory]: CUDA's caching allocator hands a freed block to the next allocation on the
# stream it was allocated on, in that stream's order, without asking other streams. So device memory written
# or read on another stream than the one it was allocated on must be ordered for it: either allocated on the
# stream that writes it (a device staging buffer a copy fills is allocated under `use(h2d)`; a reduce-scatter's
# output under `use(comm)`; an activation's copy back under `use(h2d)`), or the writing stream first waits for
# an event of the allocating stream recorded after the allocation (a copy into the unsharded buffer, grown on
# the training thread's stream, waits for that stream). A reader on a third stream waits for the writer's
# event and `hold`s the tensor (record_stream), so the block is not handed out again before the reader is done.
# tests/device/test_cuda_paths.py checks every copy of the manager against these rules on simulated streams.

# Note [host syncs]: the places where a thread blocks until the device has finished work go through
# `host_wait` (an event), `host_value` (a scalar) and `to_host` (a small tensor the CPU reads), so they can
# be counted (`count_host_syncs`). On the training thread a steady step has a constant number of them
# (the global gradient norm; with a global dependency, the flags of which parameters got gradients), never
# one per unit: per-unit waits for the device happen on the optimizer worker, which needs the bytes anyway,
# and compute waits for copies and collectives on the device (events), not on the host. The count is of
# the places, on every device: on the CPU they return at once. Every listener (`listen_host_syncs`: the
# profiler's per-step count, `count_host_syncs` in tests) hears each one, with the thread's name.
_sync_listeners: list = []


def _note_sync(why: str) -> None:
    thread = threading.current_thread().name
    for listener in list(_sync_listeners):
        listener(thread, why)


def listen_host_syncs(listener: Callable[[str, str], None]) -> Callable[[], None]:
    """Call `listener(thread name, why)` at every host sync from now on; returns the function that stops it."""
    _sync_listeners.append(listener)
    return lambda: _sync_listeners.remove(listener) if listener in _sync_listeners else None


def host_wait(event, why: str) -> None:
    """Block this thread until the work `event` marks is done (Note [host syncs])."""
    _note_sync(why)
    event.synchronize()


def host_poll(event, why: str, interval_s: float = 2e-4) -> None:
    """As `host_wait`, but looking every `interval_s` and sleeping between looks: a CUDA event's synchronize
    spins a core while it waits, and the device lane's paced waits (Note [device lane]) would take one from the
    CPU's Adam for the whole update."""
    _note_sync(why)
    while not event.query():
        time.sleep(interval_s)


def host_value(tensor: torch.Tensor, why: str) -> float:
    """A device scalar read by the CPU (Note [host syncs])."""
    _note_sync(why)
    return float(tensor)


def to_host(tensor: torch.Tensor, why: str) -> torch.Tensor:
    """A small device tensor read by the CPU (Note [host syncs])."""
    _note_sync(why)
    return tensor.cpu()


@contextlib.contextmanager
def count_host_syncs():
    """Inside: a list of (thread name, why) of every host sync, in order (for tests and the profile)."""
    record: list[tuple[str, str]] = []
    stop = listen_host_syncs(lambda thread, why: record.append((thread, why)))
    try:
        yield record
    finally:
        stop()


def bind_thread(device: torch.device) -> None:
    """Every thread that queues CUDA work starts here (the optimizer worker, the background checkpoint
    writer): the current device is per thread and starts as cuda:0, so without this such a thread would
    create a context on GPU 0 and order its work against GPU 0's streams, not its rank's GPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def worker_threads(setting: int | str, cuda: bool, cores: frozenset[int] | None = None) -> int | None:
    """The optimizer worker's intra-op threads for `overlap.optimizer_threads` (Note [thread budget]): a count as
    set; "auto" without a GPU, torch's count (None: the worker keeps it), since the training thread computes on
    the same cores and one worker thread measured 1.21-1.89x slower there; with a GPU, one fewer than torch's
    count: the training thread mostly launches kernels, and a worker on every core would make it wait for a core
    while the GPU runs dry. Bound to `cores` (Note [core binding]), "auto" is one thread per bound core."""
    if setting != "auto":
        return int(setting)
    if cores:
        return len(cores)
    return max(1, torch.get_num_threads() - 1) if cuda else None


def worker_cores(setting: str, allowed: Iterable[int] | None = None,
                 local_rank: int | None = None, local_world: int | None = None) -> frozenset[int] | None:
    """Note [core binding]: the cores `overlap.optimizer_cores` binds the optimizer worker to, or None.

    "bind": this rank's share of the process's allowed cores (`allowed`: os.sched_getaffinity; the ranks on this
    machine, LOCAL_RANK of LOCAL_WORLD_SIZE as torchrun sets them, take equal consecutive shares), less its first
    core, left to the training thread. The training thread itself is not bound: the processes it starts (a
    DataLoader's workers) would inherit its one core. "auto" binds nowhere, as measured:
    - on the H100 (bench_gpu, 16 cores, the worker on 15 of them), bound made the 1.12B Llama's offload step
      slower in both calls that measured it (unbound 0.82x and 0.79x the bound step) and case b's no faster
      (0.997x, once backward stopped waiting for the gradient copies; 1.09x slower unbound before);
    - on the 2-core development machine "bind" (one worker thread on core 1) was 1.02-1.27x faster in 5 of 5 runs,
      but that slower worker's updates run on into the next forward, whose fetches then find more fresh
      parameter copies than the byte model's simulation keeps (Note [fresh parameters] assumes no take during the
      puts): one tiled unit's read fewer than predicted in tests/units/test_tiling.py.
    Ranks started without LOCAL_WORLD_SIZE (their share unknown) are not bound."""
    if setting != "bind" or not hasattr(os, "sched_getaffinity"):
        return None
    if local_world is None and "LOCAL_WORLD_SIZE" not in os.environ and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        return None  # ranks launched without torchrun's LOCAL_* variables: this rank's share is unknown
    cores = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    rank = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if local_world is None else local_world
    share = len(cores) // max(1, ranks)
    mine = cores[rank * share:(rank + 1) * share] if share else []
    if len(mine) < 2:
        return None  # no core for the worker beside the training thread's
    return frozenset(mine[1:])


def bind_cores(cores: frozenset[int]) -> None:
    """Note [core binding]: the calling thread runs on `cores` only, and so do the threads it starts from now on
    (its intra-op threads included: Linux threads inherit their creator's binding)."""
    os.sched_setaffinity(0, cores)  # (0: the calling thread, on Linux)


def budget_threads(count: int) -> None:
    """Note [thread budget]: the calling thread's intra-op threads (torch's fused kernels, copies) become `count`.
    torch keeps that count per thread once set, but set_num_threads also changes the default a thread starts
    with; it is set back from a short thread of its own, so the budget stays this thread's alone."""
    default = torch.get_num_threads()
    torch.set_num_threads(count)
    restore = threading.Thread(target=torch.set_num_threads, args=(default,), name="infinity-threads")
    restore.start()
    restore.join()


@dataclass
class Streams:
    """The streams of one rank. On CPU all are None and `use` does nothing.

    The stream map (docs/architecture.md §2, "Streams and events", keeps the same table): who queues work on
    each stream, the events it records, who waits on them, and what it overlaps. Every cross-stream edge is an
    event recorded on the producer and waited on the consumer's stream, on the device; the host waits only at
    the places Note [host syncs] counts.
    """

    device: torch.device
    # compute: the training thread's current stream (torch's default stream at construction). Queued by the
    #   training thread: forward and backward kernels, the flat gradient filled parameter by parameter
    #   (units/gradients.py), the gradient's average and accumulation (runtime/grad_reduce.py). Records: the
    #   event a copy or collective waits for before reading what compute wrote (`record()` just before it is
    #   issued: manager copies to the host, the all-gather's input, the gradient reduction, an activation's
    #   offload), and each worker submission's `submitted` event (optim/worker.py). Waits on: h2d copies it
    #   reads (a fetch's Pending, an activation's copy back), comm's gathers (units/unit.py), the update
    #   stream's per-unit `updated` events before a unit's next forward (Note [update stream]).
    compute: object = None
    # h2d: host-to-device copies. Queued by whichever thread fetches to the device (manager fetches: the
    #   training thread's unshards and gradient accumulation, the optimizer worker's state and gradients for a
    #   device-tier update) and by the activations' copy back (runtime/activations.py). Records: each copy's
    #   `done` event (waited by the fetch's waiter on its own stream, and kept on the host chunks it read as
    #   `device_use`, so the CPU does not rewrite them before the copy read them: manager `_settle`), an
    #   activation's `arrived`. Waits on: earlier copies of the same host bytes (`device_use`), an activation's
    #   d2h `copied`. Overlaps: forward and backward compute (prefetch: Note [backward prefetch]).
    h2d: object = None
    # d2h: device-to-host copies. Queued by the training thread (gradient stores to a host or NVMe tier,
    #   activation offload) and the optimizer worker (device-tier results written below). Records: each
    #   copy's `done`, waited on the host by the CPU reader ("d2h fetch" / "d2h store") or by the copy-waiter
    #   thread before the NVMe write of those bytes (Note [stores after their copy]). Waits on: compute's event
    #   recorded at issue (the copy reads the producer's last writes). Overlaps: backward compute.
    d2h: object = None
    # comm: collectives. Queued by the training thread: all-gathers of parameters (units/unit.py, issued a
    #   unit ahead by the prefetcher) and gradient reductions (units/gradients.py). Records: the event compute
    #   waits for before reading a gathered buffer. Waits on: compute's event recorded at issue (the fetched
    #   shard, the flat gradient). The allocator is told the reduced gradient is in use there (`hold`).
    #   Overlaps: the previous unit's compute (forward) and the next unit's backward.
    comm: object = None
    # update: the optimizer worker's current stream (Note [update stream] in optim/worker.py). Queued by the
    #   worker: a device-tier Adam step, the parameters' cast, copies it issues. Waits on: each batch's
    #   `submitted` event (the gradients compute produced). Records: per unit an `updated` event, waited by
    #   compute before that unit's next use (`wait_unit`, `wait_all`). Overlaps: backward (eager mode) or the
    #   next forward (deferred mode).
    update: object = None
    # lane: the device lane's current stream (Note [device lane] in memory/placement.py): its Adam over state it
    #   copied up, the parameters it writes. Its own, so the worker's parameter uploads (queued on update) never
    #   wait behind the lane's waits for its copies up. Waits on: each batch's `submitted`, its copies up (h2d
    #   `done`), the copies to the host of a kept gradient before unscaling it. Records: per unit an `updated`
    #   event, as update does. Overlaps: the next forward (deferred mode).
    lane: object = None

    @classmethod
    def for_device(cls, device: torch.device) -> "Streams":
        if device.type != "cuda":
            return cls(device=device)
        return cls(device=device, compute=torch.cuda.current_stream(device), h2d=torch.cuda.Stream(device),
                   d2h=torch.cuda.Stream(device), comm=torch.cuda.Stream(device), update=torch.cuda.Stream(device),
                   lane=torch.cuda.Stream(device))

    @property
    def is_cuda(self) -> bool:
        return self.compute is not None

    def use(self, stream):
        """Context manager: run the enclosed ops on `stream` (no-op on CPU)."""
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def event(self):
        return torch.cuda.Event() if self.is_cuda else _NoEvent()

    def record(self, stream=None):
        """An event marking the work queued so far on `stream` (by default this thread's current stream of
        the engine's device: never another GPU's, whatever device the calling thread has selected)."""
        ev = self.event()
        if self.is_cuda:
            ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return ev

    def wait_event(self, event, stream=None) -> None:
        """Make `stream` (default: current) wait for `event` on the device, not the host."""
        if self.is_cuda:
            (stream or torch.cuda.current_stream(self.device)).wait_event(event)

    def current(self):
        """This thread's current stream of the engine's device (None on the CPU)."""
        return torch.cuda.current_stream(self.device) if self.is_cuda else None

    def hold(self, tensor: torch.Tensor, stream) -> None:
        """Tell the caching allocator that `tensor` is used on `stream` (so it is not reused early)."""
        if self.is_cuda and stream is not None and tensor.is_cuda:
            tensor.record_stream(stream)
