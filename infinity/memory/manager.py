"""TieredMemoryManager: where every shard's bytes are, and moving them on request.

The manager owns the storage of every (unit, kind) shard on the tier the plan
gave it: a device tensor, a host tensor, or NVMe extents (one per optimizer
sub-group, "chunk"). A shard is what the rank stores of that kind, by the unit's
layout (Note [stage layouts] in stages.py): its numel and chunks differ by kind
(frozen weights have parameters only; at stages 0-2 the parameters are the whole
unit). Chunk numbers are the kind's own; the optimizer's chunk c is chunk
`optimizer_chunk(unit, kind, c)` of the parameters and gradients. Callers move
data with issue/wait pairs:

    pending = manager.fetch(unit, Kind.MASTER, chunk, device)   # issue
    master = pending.wait()                                    # a tensor on `device`
    ... update master in place ...
    manager.store(unit, Kind.MASTER, chunk, master)            # write back (async on NVMe)

For resident tiers a fetch on the same device returns a view of the stored
tensor (no copy) and storing that view back is free. Staging buffers handed out
by fetch go back to the pool when stored or released. New master weights are
stored with `store_master`, which also stores the parameters that hold the same
elements (their cast): one write when the parameters alias the master on NVMe
(Note [aliased parameters]).
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from infinity.device.streams import Streams, bind_thread, host_wait
from infinity.memory.buffers import HostArena, StagingBuffers, arena_bytes
from infinity.memory.fresh import FreshCopies
from infinity.memory.parked import park_bytes
from infinity.memory.pending import Chained, Pending, WritesAfterCopy  # noqa: F401 - Pending: the handles' home for callers
from infinity.memory.plan import Plan
from infinity.memory.shards import Chunk, Shard, crossing
from infinity.memory.tier import Kind, Residency, Tier, check_transition, uploads_master
from infinity.profile import Link, NullProfiler
from io_engine import SwapSpace


class TieredMemoryManager:
    """Residency table and byte counters of every shard on this rank."""

    def __init__(self, plan: Plan, device: torch.device, streams: Streams, swap: SwapSpace | None,
                 pin_host: bool, profiler=None, fresh_budget: int = 0):
        self.plan, self.device, self.streams, self.swap = plan, device, streams, swap
        self.profiler = profiler or NullProfiler()
        self.pin_host = pin_host
        self.staging = StagingBuffers(device, pin=pin_host)
        self.fresh = FreshCopies(fresh_budget, self.staging.release)  # Note [fresh parameters]
        self._shards: dict[tuple[int, Kind], Shard] = {}
        host = [(u.numel(k), plan.dtype(k)) for i, u in enumerate(plan.units) for k in Kind
                if plan.tier(i, k) is Tier.HOST]
        self.host_arena = HostArena(arena_bytes(host), pin=pin_host) if pin_host else None  # Note [pinned arena]
        self.bytes_moved: dict[str, int] = {"nvme_read": 0, "nvme_write": 0, "h2d": 0, "d2h": 0}
        # stores from the device to NVMe: submitted once their d2h copy is done (Note [stores after their copy])
        self._copy_waiter = ThreadPoolExecutor(1, thread_name_prefix="infinity-d2h-wait")

    # ----------------------------------------------------------------- allocation
    def allocate(self, unit: int, kind: Kind) -> None:
        """Create the storage of one shard on its planned tier, as the unit's layout of `kind` says; its contents
        start as ZERO."""
        layout = self.plan.units[unit].layout.of(kind)
        tier = self.plan.tier(unit, kind)
        dtype = self.plan.dtype(kind)
        shard = Shard(unit=unit, kind=kind, tier=tier, dtype=dtype, numel=layout.numel)
        start = 0
        for n in layout.chunks:
            shard.chunks.append(Chunk(start=start, numel=n))
            start += n
        assert start == layout.numel, (start, layout.numel)
        if tier is Tier.DEVICE:
            shard.resident = torch.empty(shard.numel, dtype=dtype, device=self.device)
        elif tier is Tier.HOST and self.host_arena is not None:
            shard.resident = self.host_arena.take(shard.numel, dtype)  # pinned at its exact size
        elif tier is Tier.HOST:
            shard.resident = torch.empty(shard.numel, dtype=dtype)
        elif not self._aliased(shard):  # aliased parameters take the master's extents (_link_alias)
            assert self.swap is not None, "NVMe placement without a swap space"
            for c in shard.chunks:
                c.extent = self.swap.allocate(c.numel * dtype.itemsize)
        self._shards[(unit, kind)] = shard
        self._link_alias(unit)

    def _link_alias(self, unit: int) -> None:
        """Aliased parameters read and track the master's extents, whichever was allocated first."""
        params, master = self._shards.get((unit, Kind.PARAMS)), self._shards.get((unit, Kind.MASTER))
        if params is not None and master is not None and self.plan.aliases_master(unit):
            for p, m in zip(params.chunks, master.chunks, strict=True):
                p.extent = m.extent

    def _aliased(self, shard: Shard) -> bool:
        """`shard` is parameters stored as the master (Note [aliased parameters])."""
        return shard.kind is Kind.PARAMS and self.plan.aliases_master(shard.unit)

    def tier(self, unit: int, kind: Kind) -> Tier:
        return self._shards[(unit, kind)].tier

    def num_chunks(self, unit: int, kind: Kind = Kind.MASTER) -> int:
        """Chunks of the rank's shard of `kind` (default: the optimizer's, its update range)."""
        return len(self.plan.units[unit].chunks(kind))

    def chunk_span(self, unit: int, chunk: int | None, kind: Kind = Kind.MASTER) -> tuple[int, int]:
        """(start, numel) of a chunk of `kind` within what the rank stores of it."""
        return self._shards[(unit, kind)].span(chunk)

    def optimizer_chunk(self, unit: int, kind: Kind, chunk: int | None) -> "int | range":
        """The chunk(s) of `kind` holding the same elements as the optimizer's chunk `chunk` (None: its
        whole update range, a run of chunks of `kind`)."""
        layout = self.plan.units[unit].layout
        if chunk is None:
            first = layout.of(kind).first_chunk
            return range(first, first + layout.update.update_chunks)
        return layout.optimizer_chunk(kind, chunk)

    def params_not_updated(self, unit: int) -> list[int]:
        """The parameter chunks outside the rank's update range: frozen weights, and at stages 0-2 the other
        ranks' partitions (an update never writes them here; their values are stored with `store`)."""
        updated = self.optimizer_chunk(unit, Kind.PARAMS, None)
        return [c for c in range(self.num_chunks(unit, Kind.PARAMS)) if c not in updated]

    def store_gathered(self, unit: int, params: torch.Tensor, trainable: int) -> None:
        """Issue: store the parameter chunks no update writes here (other ranks' partitions, just all-gathered at
        stages 1-2: Note [post-update gather] in units/unit.py) from `params`, the rank's stored parameters in full;
        frozen weights (from element `trainable` on) never change. A later fetch waits for the writes."""
        for chunk in self.params_not_updated(unit):
            start, numel = self.chunk_span(unit, chunk, Kind.PARAMS)
            if start >= trainable:
                continue
            target = self.target(unit, Kind.PARAMS, chunk, params.device)
            target.copy_(params.narrow(0, start, numel))  # (the unsharded buffer is freed soon)
            self.store(unit, Kind.PARAMS, chunk, target)

    # ----------------------------------------------------------------- state
    def _set(self, shard: Shard, c: Chunk, new: Residency) -> None:
        check_transition(c.state, new, f"unit {shard.unit} {shard.kind.value} chunk@{c.start}")
        c.state = new

    def is_zero(self, unit: int, kind: Kind, chunk: int | None = None) -> bool:
        shard = self._shards[(unit, kind)]
        return all(shard.chunks[i].state is Residency.ZERO for i in shard.chunk_ids(chunk))

    def mark_zero(self, unit: int, kind: Kind) -> None:
        """Declare a shard's contents zero (no I/O): the next fetch yields zeros."""
        shard = self._shards[(unit, kind)]
        for i, c in enumerate(shard.chunks):
            if kind is Kind.PARAMS:
                self.fresh.discard(unit, i)
            self._wait_write(c)
            self._set(shard, c, Residency.ZERO)
            c.version += 1

    def versions(self, unit: int, kind: Kind, chunk: int | None = None) -> tuple[int, ...]:
        """The content version of each chunk (Note [state read-ahead] in optim/read_ahead.py)."""
        shard = self._shards[(unit, kind)]
        return tuple(shard.chunks[i].version for i in shard.chunk_ids(chunk))

    def _wait_write(self, c: Chunk) -> None:
        if c.write is not None:
            c.write.wait()  # read-after-write: the previous write-back must land before the bytes are reused

    # ----------------------------------------------------------------- fetch
    def fetch(self, unit: int, kind: Kind, chunk: int | None = None, device: torch.device | None = None,
              into: torch.Tensor | None = None, *, urgent: bool = False) -> Pending:
        """Issue: bring a shard (or one chunk) to `device` (default: the compute device).

        With `into`, the bytes land there (e.g. straight in a unit's unsharded buffer,
        with no staging copy); otherwise in a resident view or a pooled staging buffer.
        `urgent`: compute will wait for it (parameters, accumulated gradients): NVMe reads
        go ahead of queued write-behind and read-ahead (Note [urgent lane] in io_engine).
        """
        device = into.device if into is not None else (device or self.device)
        shard = self._shards[(unit, kind)]
        start, numel = shard.span(chunk)
        assert into is None or (into.numel() == numel and into.dtype == shard.dtype), (
            f"fetch into {into.numel()} {into.dtype} of {numel} {shard.dtype}")
        if shard.tier is Tier.NVME:
            return self._fetch_nvme(shard, chunk, start, numel, device, into, urgent)
        view = shard.resident.narrow(0, start, numel)
        for i in shard.chunk_ids(chunk):
            c = shard.chunks[i]
            if c.state is Residency.ZERO:
                self._settle(shard, range(i, i + 1))
                view.narrow(0, c.start - start, c.numel).zero_()
            self._set(shard, c, Residency.RESIDENT)
        ids = shard.chunk_ids(chunk)
        if into is None and view.device == device:
            if view.device.type == "cpu":
                return Pending(view, after=lambda: self._settle(shard, ids))  # the CPU reads or rewrites them
            return Pending(view)
        if view.device.type == "cpu":
            self._order_device(shard, ids, self.streams.h2d)  # a copy from the device may still be landing
        pending, done = self._copy_across(view, device, into)
        if view.device.type == "cpu" and device.type != "cpu":
            for i in ids:
                shard.chunks[i].device_use = done  # the host bytes may not change before this copy has read them
        return pending

    def _device_span(self, key: str | None, src: torch.Tensor):
        """A profile span of a copy across, in device time (CUDA events on the stream now current)."""
        if key is None or not self.streams.is_cuda or not self.profiler.enabled:
            return contextlib.nullcontext()
        nbytes = src.numel() * src.element_size()
        return self.profiler.device_span(f"{key} {nbytes} B", Link.H2D if key == "h2d" else Link.D2H,
                                         num_bytes=nbytes)

    def _settle(self, shard: Shard, ids) -> None:
        """Before the CPU reads or rewrites host bytes of `shard`: the copies to or from the device using them
        must be done (on the thread that touches them: the optimizer worker, a checkpoint writer)."""
        for i in ids:
            c = shard.chunks[i]
            if c.device_use is not None:
                host_wait(c.device_use, "host bytes in a device copy")  # (issued long ago: normally done)
                c.device_use = None

    def _order_device(self, shard: Shard, ids, stream) -> None:
        """Before a copy on `stream` reads or writes host bytes of `shard`: it waits, on the device, for the
        copies using them before."""
        for i in ids:
            if shard.chunks[i].device_use is not None:
                self.streams.wait_event(shard.chunks[i].device_use, stream)

    def after_copies(self, unit: int, kind: Kind, chunk) -> None:
        """This thread's current stream waits, on the device, for the copies that use these host chunks of
        `kind`: a device tensor one of them reads is about to be rewritten (Note [device lane]: a kept gradient
        the update unscales in place, after its copy to the host)."""
        shard = self._shards[(unit, kind)]
        self._order_device(shard, shard.chunk_ids(chunk), self.streams.current())

    def _copy_across(self, src: torch.Tensor, device: torch.device, dst: torch.Tensor | None = None,
                     dst_ready=None):
        """Issue a copy of `src` to `device` (into `dst`); returns (its Pending, the copy's done event).
        `dst_ready`: for a device `dst` the caller allocated, an event of its stream recorded after it
        (default: now, on this thread's stream; Note [stream-ordered memory]).

        Waiting for a copy to the device makes the waiting thread's current stream wait for it on the
        device (no host sync: Note [host syncs]); for a copy to the host, the host waits (it reads next)."""
        given = dst is not None
        if device.type == "cpu":
            dst = self.staging.host_buffer(src.numel(), src.dtype) if dst is None else dst
            stream, key = self.streams.d2h, "d2h"
        else:
            stream, key = self.streams.h2d, "h2d"
            if dst is None:
                with self.streams.use(stream):  # Note [stream-ordered memory]: allocated for the stream writing it
                    dst = self.staging.device_buffer(src.numel(), src.dtype)
        if src.device == dst.device:
            stream, key = None, None
        if src.device.type != "cpu" or (given and dst.device.type != "cpu"):
            # the copy must see compute's last writes to src, and may write device memory the calling thread's
            # stream allocated or used last only after that stream is done with it (Note [stream-ordered memory])
            self.streams.wait_event(dst_ready if dst_ready is not None else self.streams.record(), stream)
        with self.streams.use(stream), self._device_span(key, src):
            dst.copy_(src, non_blocking=stream is not None)
            done = self.streams.record(stream)
        if key is None:
            return Pending(dst), done
        self.bytes_moved[key] += src.numel() * src.element_size()
        if device.type == "cpu":
            return Pending(dst, after=lambda: host_wait(done, "d2h fetch")), done  # the CPU reads dst next
        return Pending(dst, after=lambda: self._arrived(dst, done)), done

    def _arrived(self, dst: torch.Tensor, done) -> None:
        """A copy to the device waited on the waiter's stream, which holds dst (Note [stream-ordered memory])."""
        self.streams.wait_event(done)
        self.streams.hold(dst, self.streams.current())

    def _fetch_nvme(self, shard: Shard, chunk, start: int, numel: int, device: torch.device,
                    into: torch.Tensor | None, urgent: bool) -> Pending:
        direct = into is not None and into.device.type == "cpu"
        host = into if direct else self.staging.host_buffer(numel, shard.dtype)
        futures = []
        for i in shard.chunk_ids(chunk):
            c = shard.chunks[i]
            dst = host.narrow(0, c.start - start, c.numel)
            kept = self.fresh.take(shard.unit, i, c.version) if shard.kind is Kind.PARAMS else None
            if kept is not None:  # Note [fresh parameters]: the bytes just written are still in memory
                dst.copy_(kept[0])
                self.fresh.done_with(*kept)
                continue
            self._wait_write(c)
            if c.state is Residency.ZERO:
                dst.zero_()  # nothing on disk yet: zeros need no read
                continue
            self._set(shard, c, Residency.READING)
            futures.append(self._timed(self.swap.read(c.extent, dst, urgent=urgent), Link.NVME_READ, shard, c))
            self.bytes_moved["nvme_read"] += c.numel * shard.dtype.itemsize

        def landed():
            for i in shard.chunk_ids(chunk):
                c = shard.chunks[i]
                if c.state is Residency.READING:
                    self._set(shard, c, Residency.RESIDENT)  # the disk copy stays valid until a store
        pend = Pending(host, futures, after=landed)
        if device.type == "cpu":
            return pend
        return self._to_device_when_read(pend, futures, host, device, into)

    def _to_device_when_read(self, read: Pending, futures: list, host: torch.Tensor, device: torch.device,
                             into: torch.Tensor | None) -> Pending:
        """The copy of an NVMe read to the device is issued as soon as the last block lands (on the thread
        that completes it), so it runs behind compute instead of starting at `wait()`; `wait()` then makes
        the waiting stream wait for the copy on the device. The host staging buffer goes back to the pool
        once the copy has read it."""
        lock, left, copy = threading.Lock(), [len(futures)], []
        # the caller's buffer is ordered for the copy on the caller's stream, now (Note [stream-ordered memory])
        ready = self.streams.record() if into is not None and into.device.type != "cpu" else None

        def issue(_future=None, landed: bool = False) -> None:
            with lock:
                left[0] -= _future is not None
                if copy or (left[0] > 0 and not landed):  # (landed: wait() saw every read done)
                    return
                bind_thread(device)  # (an I/O thread: its current device would be cuda:0, Note in streams.py)
                pending, done = self._copy_across(host, device, into, ready)
                self.staging.release_after(host, done)
                copy.append(pending)

        for future in futures:
            future.add_done_callback(issue)
        return Chained(read, lambda _host: (issue(landed=True), copy[0].wait())[1])

    def resident(self, unit: int, kind: Kind) -> torch.Tensor | None:
        """The whole stored shard of a DEVICE / HOST shard (None on NVMe), for aliasing."""
        return self._shards[(unit, kind)].resident

    def target(self, unit: int, kind: Kind, chunk: int | None, device: torch.device) -> torch.Tensor:
        """A tensor on `device` to fill with new contents for `store`, without reading the old ones:
        the resident view itself when the shard lives on `device`, else a staging buffer."""
        shard = self._shards[(unit, kind)]
        start, numel = shard.span(chunk)
        if shard.resident is not None and shard.resident.device == device:
            if device.type == "cpu":
                self._settle(shard, shard.chunk_ids(chunk))  # the caller rewrites these bytes
            return shard.resident.narrow(0, start, numel)
        if device.type == "cpu":
            return self.staging.host_buffer(numel, shard.dtype)
        return self.staging.device_buffer(numel, shard.dtype)

    # ----------------------------------------------------------------- store
    def store_master(self, unit: int, chunk: int | None, master: torch.Tensor, *, release: bool = True,
                     keep_params: bool = False) -> list[Pending]:
        """Issue: new master weights of an optimizer chunk (None: the whole update range), and the
        parameters holding the same elements (`optimizer_chunk`), their cast. `master` is in the master's
        dtype, or fp32 when `release` is False (the caller's own values: cast to a bf16 master here, rounded
        to nearest; Note [16-bit optimizer state] in optim/state_update.py).

        Parameters that alias the master (Note [aliased parameters]) take the master's
        write. Others are cast into a staging buffer (a temporary when `release` is False:
        `master` is the caller's own tensor) and stored first: the next forward reads them
        soonest. `keep_params`: offer the buffer the parameters were written from to the
        fresh copies (Note [fresh parameters]).

        Note [async upload]: updated parameters go to the GPU without the updating thread waiting: the
        copy is queued on its stream from pinned host bytes, and those bytes are held until the copy has
        read them (a staging buffer returns to the pool after the copy's event; a host-tier master, copied
        from directly, gets the event as its chunks' `device_use`, which the next update's fetch waits for).
        (On the H200 the worker once waited for each unit's upload before stepping the next.) A host-tier
        master of another dtype than the parameters (fp32, bf16 compute) goes up as it is and is cast on the
        device (`tier.uploads_master`): the CPU's cast was ~1.3 ms of each 8.4M-element chunk's ~3.7 ms on the
        worker (the H200's case l, 2026-11-27), the update's critical path once the state does not fit the GPU;
        the copy up is 2 more bytes an element on a link the update leaves mostly idle.
        """
        dtype = self.plan.dtype(Kind.MASTER)
        if master.dtype != dtype:
            assert not release, f"store_master of a {master.dtype} staging buffer into a {dtype} master"
            master = master.to(dtype)  # a temporary: the caller keeps its own tensor
        if self.plan.aliases_master(unit):
            return [self.store(unit, Kind.MASTER, chunk, master, release=release, keep=keep_params)]
        if master.numel() == 0:
            return []  # nothing trainable here (frozen weights)
        into = self.optimizer_chunk(unit, Kind.PARAMS, chunk)
        direct = (release and master.device.type == "cpu"  # (not the device lane's copy: Note [device lane])
                  and uploads_master(self._shards[(unit, Kind.PARAMS)].tier,  # (the host tier's own bytes, not
                                     self._shards[(unit, Kind.MASTER)].tier, self.streams.is_cuda))  # staging)
        if direct and master.dtype == self.plan.compute_dtype:  # Note [async upload]: no copy on the CPU
            params = master
        elif direct:  # up in the master's dtype, into a device buffer that `store` casts from on the device
            device = self._shards[(unit, Kind.PARAMS)].resident.device  # (on its stream: freed after the cast)
            params = torch.empty(master.numel(), dtype=master.dtype, device=device)
            with self._device_span("h2d", master):
                params.copy_(master, non_blocking=True)
            self.bytes_moved["h2d"] += master.numel() * master.element_size()  # (Note [traffic per step])
        elif release:
            params = self.target(unit, Kind.PARAMS, into, master.device)
            params.copy_(master)
        else:
            params = master.to(self.plan.compute_dtype)
        writes = [self.store(unit, Kind.PARAMS, into, params, release=release, keep=keep_params)]
        if direct:  # the CPU may not rewrite the master before the copy has read it
            shard, done = self._shards[(unit, Kind.MASTER)], self.streams.record()
            for i in shard.chunk_ids(chunk):
                shard.chunks[i].device_use = done
        return writes + [self.store(unit, Kind.MASTER, chunk, master, release=release)]

    def store(self, unit: int, kind: Kind, chunk: int | None, tensor: torch.Tensor, release: bool = True,
              keep: bool = False) -> Pending:
        """Issue: write `tensor` as the new contents of the shard / chunk.

        A view of the resident storage is already in place (free). Staging buffers
        from `fetch` go back to the pool once written (`release`). `keep` (parameters of
        one chunk on NVMe, from a staging buffer): offer the buffer to the fresh copies,
        so the next fetch may read memory instead of the disk (Note [fresh parameters]).
        Parameters that alias the master are stored through `store_master`.

        Note [copies hold their source]: a device `tensor` stored to the host or NVMe tier is read by a d2h copy
        that runs after this returns. The copy holds the tensor's device memory (`Streams.hold`: the caching
        allocator does not reuse it before the copy is done), and nothing waits for it on the caller's stream:
        a caller that keeps the tensor (release=False) drops it after the store, never writes into it again (a
        unit's flat gradient is allocated afresh by each backward, units/gradients.py). On the H100 the backward
        used to wait on the device for each unit's gradient copy before computing the next unit (3.7 ms per
        unit of case b, 52 ms a step: benchmarks/RESULTS.md); tests/device/test_cuda_paths.py holds it.
        """
        shard = self._shards[(unit, kind)]
        start, numel = shard.span(chunk)
        cast_here = shard.tier is Tier.DEVICE and tensor.device == shard.resident.device  # (Note [async upload])
        assert tensor.numel() == numel and (tensor.dtype == shard.dtype or cast_here), (
            f"store of {tensor.numel()} {tensor.dtype} into {numel} {shard.dtype} ({shard.kind.value}, unit {unit})")
        assert not self._aliased(shard), f"unit {unit}'s parameters alias its master: store them with store_master"
        if shard.tier is not Tier.NVME:
            view = shard.resident.narrow(0, start, numel)
            ids = shard.chunk_ids(chunk)
            if tensor.data_ptr() != view.data_ptr():
                if view.device.type == "cpu" and tensor.device.type != "cpu":
                    self._order_device(shard, ids, self.streams.d2h)
                    done = self._to_host(view, tensor, wait=False)  # whoever reads these bytes next waits for it
                    self.streams.hold(tensor, self.streams.d2h)  # Note [copies hold their source]
                    for i in ids:
                        shard.chunks[i].device_use = done
                else:
                    if view.device.type == "cpu":
                        self._settle(shard, ids)  # these bytes are rewritten now
                    upload = release and tensor.device.type == "cpu" and view.device.type != "cpu"
                    with self._device_span(crossing(tensor.device, view.device), tensor):  # (the update's h2d)
                        view.copy_(tensor, non_blocking=upload)  # (on the producer's stream: in order after it)
                    if upload and self.staging.owns(tensor):  # Note [async upload]: the buffer goes back once the
                        self.staging.release_after(tensor, self.streams.record())  # copy has read it (a tier's own
                        release = False  # bytes: store_master holds them)
                if (link := crossing(tensor.device, view.device)) is not None:  # every byte moved is counted
                    self.bytes_moved[link] += numel * shard.dtype.itemsize  # (Note [traffic per step])
            for i in shard.chunk_ids(chunk):
                self._set(shard, shard.chunks[i], Residency.RESIDENT)
                shard.chunks[i].version += 1
            if release:
                self.staging.release(tensor)
            return Pending(None)
        host, copied = tensor, None
        if tensor.device.type != "cpu":
            host = self.staging.host_buffer(numel, shard.dtype)
            copied = self._to_host(host, tensor, wait=False)  # the disk write waits for it, not this thread
            self.streams.hold(tensor, self.streams.d2h)  # Note [copies hold their source]
            self.bytes_moved["d2h"] += numel * shard.dtype.itemsize
            if release:
                self.staging.release(tensor)
            release = True
        ids = shard.chunk_ids(chunk)
        # a master that the parameters alias is written for both: they follow its state
        aliased = kind is Kind.MASTER and self.plan.aliases_master(unit)
        follower = self._shards[(unit, Kind.PARAMS)] if aliased else None
        params = shard if kind is Kind.PARAMS else follower  # whose fresh copy this buffer may become
        keep = keep and params is not None and len(ids) == 1 and release and self.staging.owns(host)
        if params is not None:
            for i in ids:
                self.fresh.discard(unit, i)
        chunks = [shard.chunks[i] for i in ids]
        written_chunks = [(shard, c) for c in chunks]
        for c in (follower.chunks[i] for i in ids) if follower is not None else ():
            self._wait_write(c)
            self._set(follower, c, Residency.WRITING)  # before any write: a read of them in flight is a bug
            c.version += 1
            written_chunks.append((follower, c))
        for c in chunks:
            self._wait_write(c)
            self._set(shard, c, Residency.WRITING)
            c.version += 1
            self.bytes_moved["nvme_write"] += c.numel * shard.dtype.itemsize

        def submit():
            return [self._timed(self.swap.write(c.extent, host.narrow(0, c.start - start, c.numel)),
                                Link.NVME_WRITE, shard, c) for c in chunks]
        if copied is None:
            futures = submit()
        else:  # Note [stores after their copy] (pending.py)
            futures = [WritesAfterCopy(self._copy_waiter, copied, submit)]

        release_when_written = release and not keep  # a kept buffer is released by the fresh copies

        def written():
            for owner, c in written_chunks:
                if c.state is Residency.WRITING:
                    self._set(owner, c, Residency.RESIDENT)
                    c.write = None
            if release_when_written:
                self.staging.release(host)
        pending = Pending(None, futures, after=written)
        for _, c in written_chunks:
            c.write = pending  # whoever waits first (caller, a later fetch, drain) completes it once
        if keep and not self.fresh.put(unit, ids[0], host, params.chunks[ids[0]].version, pending):
            self.fresh.done_with(host, pending)  # not kept: back to the pool once written
        return pending

    def _to_host(self, dst: torch.Tensor, src: torch.Tensor, wait: bool = True):
        """Copy device `src` into host `dst` on the d2h stream, after the work that produced `src` (queued on
        this thread's current stream: the reduce-scatter's accumulation, the optimizer's cast), and wait
        (else return the copy's event: a host-tier store, which whoever touches the bytes next waits for)."""
        streams = self.streams
        streams.wait_event(streams.record(), streams.d2h)  # the copy must see the producer's last writes to src
        with streams.use(streams.d2h), self._device_span("d2h", src):
            dst.copy_(src, non_blocking=True)
            done = streams.record(streams.d2h)
        if not wait:
            return done
        host_wait(done, "d2h store")  # the caller reuses src, and the disk write reads dst, next
        return done

    def _timed(self, fut, link: Link, shard: Shard, c: Chunk):
        """Record the transfer as a span when it completes (on the io thread)."""
        if self.profiler.enabled:
            start, name = time.perf_counter(), f"{link.value} {shard.kind.value} u{shard.unit} @{c.start}"
            nbytes = c.numel * shard.dtype.itemsize
            fut.add_done_callback(lambda _f: self.profiler.record(name, link, start, time.perf_counter(),
                                                                  num_bytes=nbytes))
        return fut

    def release(self, tensor: torch.Tensor) -> None:
        """Return a fetched staging buffer without writing it (clean)."""
        self.staging.release(tensor)

    # ----------------------------------------------------------------- offloaded states
    def park(self, unit: int, kind: Kind, tier: Tier, *, non_blocking: bool = False) -> int:
        """Move a DEVICE shard's bytes to `tier` (host or NVMe), free its device storage (views see zero bytes until
        `unpark`); the bytes moved (all-zero: none). Others are left as they are (Note [offloaded states])."""
        shard = self._shards[(unit, kind)]
        if shard.tier is not Tier.DEVICE or shard.parked is not None:
            return 0
        assert all(c.state in (Residency.ZERO, Residency.RESIDENT) for c in shard.chunks), (
            f"unit {unit} {kind.value}: parked with {[c.state.name for c in shard.chunks]}")
        live = any(c.state is Residency.RESIDENT for c in shard.chunks)
        shard.parked = park_bytes(shard.resident if live else None, tier, self.streams, self.swap, self.pin_host,
                                  non_blocking=non_blocking)
        self.bytes_moved["d2h"] += shard.parked.nbytes
        self.streams.hold(shard.resident, self.streams.d2h)  # (its device memory is not reused before the copy)
        shard.resident.untyped_storage().resize_(0)
        return shard.parked.nbytes

    def unpark(self, unit: int, kind: Kind) -> list:
        """Give a parked shard its device storage back and issue the copy of its bytes into it; returns the
        copies' events (the caller waits for them before the host copies go)."""
        shard = self._shards[(unit, kind)]
        parked, shard.parked = shard.parked, None
        if parked is None:
            return []
        shard.resident.untyped_storage().resize_(shard.numel * shard.dtype.itemsize)
        self.bytes_moved["h2d"] += parked.nbytes
        return parked.restore(shard.resident, self.streams, self.swap)

    def stores(self, unit: int, kind: Kind) -> bool:  # a shard of `kind` was allocated for `unit`
        return (unit, kind) in self._shards

    def is_parked(self, unit: int, kind: Kind) -> bool:
        return self._shards[(unit, kind)].parked is not None

    # ----------------------------------------------------------------- accounting
    def memory_report(self) -> dict:
        """Exact bytes of state per tier and kind, plus staging and swap reservation."""
        state = {t.value: {k.value: 0 for k in Kind} for t in Tier}
        for shard in self._shards.values():
            if shard.parked is not None:  # offloaded: its bytes are where they were parked (none when all zero)
                state[shard.parked.tier.value][shard.kind.value] += shard.parked.nbytes
            elif not self._aliased(shard):  # aliased parameters take no storage of their own
                state[shard.tier.value][shard.kind.value] += shard.numel * shard.dtype.itemsize
        return {
            "state": state,
            "tier_totals": {t: sum(v.values()) for t, v in state.items()},
            "staging_host_bytes": self.staging.host_bytes_allocated,
            "pinned_host_tier_bytes": self.host_arena.nbytes if self.host_arena is not None else 0,
            "staging_peak_bytes_out": self.staging.peak_bytes_out,
            "nvme_reserved_bytes": self.swap.bytes_reserved if self.swap is not None else 0,
            "bytes_moved": dict(self.bytes_moved),
        }

    def drain(self) -> None:
        """Wait for every write-back in flight."""
        for shard in self._shards.values():
            for c in shard.chunks:
                self._wait_write(c)
        self.fresh.drain()

    def close(self) -> None:
        self.drain()
        self._copy_waiter.shutdown()
        self.fresh.close()
        self.staging.close()
        if self.host_arena is not None:
            self.host_arena.close()
