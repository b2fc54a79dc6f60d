"""MemoryBackend: the disk stand-in for code above it. Latency, reordering, failures,
capacity; and the engine's queue-depth bound, checked against it."""

import errno
import threading
import time

import numpy as np
import pytest
import torch

from io_engine import FailRule, IOConfig, IOEngine, IOEngineError, MemoryBackend

CFG = IOConfig(block_size=64 << 10, queue_depth=8, threads=4)


def data(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def completion_order(backend: MemoryBackend, n: int) -> list[int]:
    order, guard = [], threading.Lock()
    with IOEngine(CFG, backend=backend) as io:
        for i in range(n):  # (each callback attached at once: a late one on a done future would run in index order)
            io.submit_write(data(100, i), f"/m/{i}", 0).add_done_callback(
                lambda _, i=i: (guard.acquire(), order.append(i), guard.release()))
        io.drain()
    return order


def test_reorder_completes_out_of_order():
    order = completion_order(MemoryBackend(jitter_s=0.002, reorder=True, seed=1), 40)
    assert sorted(order) == list(range(40)) and order != list(range(40))


def test_no_reorder_completes_in_submission_order():
    order = completion_order(MemoryBackend(jitter_s=0.002, reorder=False, seed=1), 40)
    assert order == list(range(40))


def test_reorder_without_jitter_still_shuffles():
    order = completion_order(MemoryBackend(reorder=True, latency_s=0.001, seed=3), 40)
    assert sorted(order) == list(range(40)) and order != list(range(40)), f"completed in submission order: {order}"


def test_latency_is_applied():
    with IOEngine(CFG, backend=MemoryBackend(latency_s=0.05)) as io:
        t0 = time.perf_counter()
        fut = io.submit_write(data(10), "/m/x", 0)
        assert not fut.done()
        fut.wait()
        assert time.perf_counter() - t0 >= 0.05
        assert io.stats.write.latency_max_s >= 0.05


def test_random_roundtrip_with_reordering():
    rng = np.random.default_rng(0)
    backend = MemoryBackend(jitter_s=0.0003, reorder=True)
    with IOEngine(CFG, backend=backend) as io:
        items, ends = [], [0, 0, 0]
        for i in range(200):
            n = int(np.exp(rng.uniform(0, np.log(1 << 20))))
            f = int(rng.integers(3))
            off = ends[f] + int(rng.integers(0, 100))
            ends[f] = off + n
            items.append((data(n, i), f"/m/f{f}", off))
        for fut in [io.submit_write(t, p, o) for t, p, o in items]:
            fut.wait()
        outs = [torch.empty_like(t) for t, _, _ in items]
        for fut in [io.submit_read(o, p, off) for o, (_, p, off) in zip(outs, items)]:
            fut.wait()
    assert all(torch.equal(o, t) for o, (t, _, _) in zip(outs, items))


def test_fail_rules_nth_and_path():
    rules = [FailRule(direction="write", nth=2, errno=errno.ENOSPC),
             FailRule(direction="read", path="/bad/*", errno=errno.EIO)]
    with IOEngine(CFG, backend=MemoryBackend(fail=rules)) as io:
        io.submit_write(data(10), "/bad/a", 0).wait()
        with pytest.raises(IOEngineError, match="No space left") as e:
            io.submit_write(data(10), "/ok/b", 0).wait()
        assert e.value.errno == errno.ENOSPC
        io.submit_write(data(10), "/ok/c", 0).wait()  # only the 2nd
        for _ in range(2):  # every read of /bad/*
            with pytest.raises(IOEngineError, match=r"Input/output error.*/bad/a.*dmesg"):
                io.submit_read(torch.empty(10, dtype=torch.uint8), "/bad/a", 0).wait()
        io.submit_read(torch.empty(10, dtype=torch.uint8), "/ok/c", 0).wait()


def test_fail_callable_can_return_exception():
    def fail(op):
        if op.path.endswith("boom") and op.offset >= 64 << 10:
            return OSError(errno.EDQUOT, "quota exceeded", op.path)
        return None

    with IOEngine(CFG, backend=MemoryBackend(fail=fail)) as io:
        with pytest.raises(IOEngineError, match=r"quota|Disk quota") as e:
            io.submit_write(data(200_000), "/m/boom", 0).wait()
        assert e.value.errno == errno.EDQUOT and "free space" in str(e.value)
        io.submit_write(data(200_000), "/m/fine", 0).wait()


def test_capacity_enospc():
    backend = MemoryBackend(capacity_bytes=100_000)
    with IOEngine(CFG, backend=backend) as io:
        io.submit_write(data(60_000), "/m/a", 0).wait()
        with pytest.raises(IOEngineError, match=r"No space left.*/m/b"):
            io.submit_write(data(60_000), "/m/b", 0).wait()
        io.submit_write(data(30_000), "/m/c", 0).wait()
        assert backend.free_bytes("/m") == 100_000 - 60_000 - 30_000 - len(
            backend.read_file("/m/b"))


def test_missing_and_truncated_files():
    backend = MemoryBackend()
    with IOEngine(CFG, backend=backend) as io:
        with pytest.raises(IOEngineError, match="No such file"):
            io.submit_read(torch.empty(4, dtype=torch.uint8), "/m/none", 0).wait()
        with pytest.raises(IOEngineError, match="No such file"):
            io.submit_write(data(4), "/m/none", 0, create=False).wait()
        io.submit_write(data(1000), "/m/t", 0).wait()
        backend.truncate("/m/t", 500)
        with pytest.raises(IOEngineError, match="short read.*500 bytes"):
            io.submit_read(torch.empty(1000, dtype=torch.uint8), "/m/t", 0).wait()
        backend.remove("/m/t")
        assert "/m/t" not in backend.files


class CountingBackend(MemoryBackend):
    """Records the most blocks it ever held at once."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.now = self.peak = self.submitted = 0
        self.guard = threading.Lock()

    def submit(self, op):
        with self.guard:
            self.submitted += 1
            self.now += 1
            self.peak = max(self.peak, self.now)
        super().submit(op)

    def _execute(self, op):
        with self.guard:
            self.now -= 1
        super()._execute(op)


def test_queue_depth_bounds_blocks_in_flight():
    backend = CountingBackend(latency_s=0.001)
    cfg = IOConfig(block_size=4096, queue_depth=4, threads=2)
    with IOEngine(cfg, backend=backend) as io:
        futs = [io.submit_write(data(40_000, i), f"/m/{i}", 0) for i in range(10)]
        for f in futs:
            f.wait()
    assert backend.peak == 4


def test_failed_request_skips_its_remaining_blocks():
    backend = CountingBackend(fail=lambda op: errno.EIO if op.block == 0 else None)
    cfg = IOConfig(block_size=4096, queue_depth=1, threads=1)
    with IOEngine(cfg, backend=backend) as io:
        with pytest.raises(IOEngineError):
            io.submit_write(data(40_000), "/m/x", 0).wait()
        assert io.stats.write.errors == 1
    assert backend.submitted == 1  # blocks 2..10 never reached the backend


def test_urgent_read_overtakes_queued_writes():
    """Note [urgent lane]: an urgent read waits for the blocks already in flight, not for the whole queue."""
    cfg = IOConfig(block_size=64 << 10, queue_depth=2, threads=2)
    order, guard = [], threading.Lock()
    with IOEngine(cfg, backend=MemoryBackend(latency_s=0.005)) as io:
        io.submit_write(data(1000, 99), "/m/hot", 0).wait()
        chunks = [data(64 << 10, i) for i in range(30)]
        writes = [io.submit_write(c, f"/m/w{i}", 0) for i, c in enumerate(chunks)]
        for i, w in enumerate(writes):
            w.add_done_callback(lambda _, i=i: (guard.acquire(), order.append(f"w{i}"), guard.release()))
        out = torch.empty(1000, dtype=torch.uint8)
        plain = io.submit_read(torch.empty(1000, dtype=torch.uint8), "/m/hot", 0)
        with guard:
            done_before = len(order)
        urgent = io.submit_read(out, "/m/hot", 0, urgent=True)
        for name, f in [("urgent", urgent), ("plain", plain)]:
            f.add_done_callback(lambda _, name=name: (guard.acquire(), order.append(name), guard.release()))
        io.drain()
    assert torch.equal(out, data(1000, 99))
    assert done_before < 20, "the writes finished before the test could queue behind them"
    # behind at most the blocks in flight when it was submitted (one more may have been issued between a
    # block's completion and its callback), where the FIFO would put it after all 30:
    assert order.index("urgent") <= done_before + cfg.queue_depth + 1, (done_before, order)
    assert order.index("plain") == len(order) - 1, order  # the non-urgent read keeps its FIFO place
    assert sorted(order) == sorted(["urgent", "plain"] + [f"w{i}" for i in range(30)])
