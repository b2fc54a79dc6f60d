"""Note [fresh parameters]: parameters the update writes to NVMe are kept in memory for the next fetch.

The bookkeeping (budget, eviction by forward order, versions, blocking and relief, buffers returned only
once their write has landed) against a hand-made sequence; the prediction of which chunks are kept; and
the engine: bitwise the same training with and without, in every update mode, with fewer disk reads."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine_runs import engine_run
from infinity.memory.fresh import FreshCopies, kept_chunks
from reference import Recipe


class Write:
    """A write-back in flight: done once `land()` is called."""

    def __init__(self, done: bool = True):
        self._done = done

    def land(self):
        self._done = True

    def done(self) -> bool:
        return self._done

    def wait(self):
        assert self._done, "a buffer was released before its write landed"


def buf(numel: int, value: float = 0.0) -> torch.Tensor:
    return torch.full((numel,), float(value), dtype=torch.float32)


def test_take_returns_the_kept_bytes_once_and_only_at_their_version():
    released = []
    fresh = FreshCopies(budget=1000, release=released.append)
    t = buf(10, 3.0)
    assert fresh.put(1, 0, t, version=5, write=Write())
    assert fresh.take(1, 0, version=4) is None  # stored again since: stale, and dropped
    assert released == [t]
    t2 = buf(10, 4.0)
    assert fresh.put(1, 0, t2, version=6, write=Write())
    tensor, write = fresh.take(1, 0, version=6)
    assert tensor is t2 and fresh.take(1, 0, version=6) is None  # taken: gone
    fresh.done_with(tensor, write)
    assert released == [t, t2] and fresh.kept_bytes == 0 and fresh.hits == 1


def test_buffers_go_back_only_after_their_write_lands():
    released = []
    fresh = FreshCopies(budget=1000, release=released.append)
    slow = Write(done=False)
    t = buf(10)
    assert fresh.put(2, 0, t, version=1, write=slow)
    fresh.discard(2, 0)  # stored again: retired, but the disk still reads this buffer
    fresh.put(3, 0, buf(10), version=1, write=Write())  # any later call reaps what it can
    assert released == []
    slow.land()
    fresh.drain()
    assert released == [t]


def test_without_room_the_farthest_in_forward_order_goes():
    released = []
    fresh = FreshCopies(budget=3 * 40, release=released.append)  # three chunks of 10 fp32
    for unit in (9, 7, 5):
        assert fresh.put(unit, 0, buf(10, unit), version=1, write=Write())
    assert fresh.put(2, 0, buf(10, 2), version=1, write=Write())  # nearer: unit 9 is evicted
    assert [float(t[0]) for t in released] == [9.0]
    assert not fresh.put(8, 0, buf(10, 8), version=1, write=Write())  # farther than all kept: refused
    assert fresh.put(3, 0, buf(10, 3), version=1, write=Write())  # evicts 7
    assert {u for u in (2, 3, 5, 7, 9) if fresh.take(u, 0, 1) is not None} == {2, 3, 5}
    assert not fresh.put(1, 0, buf(100), version=1, write=Write())  # larger than the whole budget
    assert fresh.refused == 2


def test_blocking_put_waits_for_a_take_and_relieve_or_unblock_free_it():
    fresh = FreshCopies(budget=2 * 40, release=lambda t: None)
    fresh.begin_update([0, 1, 2, 3, 4], blocking=True, keep=None)
    assert fresh.put(0, 0, buf(10), 1, Write()) and fresh.put(1, 0, buf(10), 1, Write())
    done = threading.Event()

    def worker():
        fresh.put(2, 0, buf(10), 1, Write())  # waits: the forward has not taken 0 or 1 yet
        done.set()
    threading.Thread(target=worker, daemon=True).start()
    time.sleep(0.05)
    assert not done.is_set()
    fresh.take(0, 0, 1)  # the forward uses unit 0: room
    assert done.wait(5)
    # the forward skips unit 1 and waits for unit 3's update: entries put before 3 are dropped
    done.clear()
    threading.Thread(target=lambda: (fresh.put(3, 0, buf(10), 1, Write()), done.set()), daemon=True).start()
    time.sleep(0.05)
    assert not done.is_set()
    fresh.relieve(3)
    assert done.wait(5)
    assert fresh.take(1, 0, 1) is None and fresh.take(3, 0, 1) is not None
    # waiting for everything: puts stop waiting and fall back to eviction
    fresh.put(4, 0, buf(10), 1, Write())
    assert fresh.kept_bytes == 40
    done.clear()
    threading.Thread(target=lambda: (fresh.put(0, 1, buf(20), 1, Write()), done.set()), daemon=True).start()
    time.sleep(0.05)
    assert not done.is_set()
    fresh.unblock()
    assert done.wait(5)
    assert fresh.take(0, 1, 1) is not None and fresh.take(4, 0, 1) is None  # 4 was evicted for the nearer 0


@pytest.mark.parametrize("blocking", [True, False])
def test_kept_chunks_matches_the_copies(blocking):
    """The prediction is the bookkeeping run over one update's puts with no take in between."""
    sizes = {(u, c): 40 * (1 + (u + c) % 3) for u in range(6) for c in range(2)}
    for order in (sorted(sizes), sorted(sizes, reverse=True)):
        fresh = FreshCopies(budget=200, release=lambda t: None)
        fresh.begin_update([u for u, _ in order], blocking=False, keep=None)  # (blocking: would wait forever)
        for unit, chunk in order:
            fresh.put(unit, chunk, buf(sizes[(unit, chunk)] // 4), 1, Write())
        kept = {k for k in sizes if fresh.take(*k, 1) is not None}
        predicted = kept_chunks(sizes, order, 200, blocking=blocking)
        if blocking:
            assert predicted == frozenset(sizes)  # the forward takes as the worker puts: all of them fit
        else:
            assert predicted == kept
            assert sum(sizes[k] for k in kept) <= 200 and kept


def test_an_update_keeps_the_predicted_copies_whatever_the_order_of_puts_and_takes():
    """An eager update's last puts meet the next forward's first takes, and a backlog is stepped in forward order:
    the copies kept are still the prediction's, so a step reads what the byte model says (a loaded machine kept one
    more and read 15 KB less than predicted: tests/units/test_tiling.py)."""
    sizes = {(u, 0): 40 for u in range(6)}
    budget = 3 * 40
    backward = sorted(sizes, reverse=True)  # an eager update's puts, as backward finalizes the units
    keep = kept_chunks(sizes, backward, budget, blocking=False)
    assert keep == {(0, 0), (1, 0), (2, 0)}  # the forward's first three
    fresh = FreshCopies(budget=budget, release=lambda t: None)
    fresh.put(5, 0, buf(10), 0, Write())  # left by the update before, never taken
    fresh.begin_update([u for u, _ in backward], blocking=False, keep=keep)
    assert fresh.take(5, 0, 0) is None  # (its forward has run: it leaves)
    for unit in (5, 4, 0, 1):  # two during backward, then the backlog in forward order once backward ended
        fresh.put(unit, 0, buf(10), 1, Write())
    assert fresh.take(0, 0, 1) is not None  # the next forward's first unit, taken while the update goes on
    for unit in (2, 3):
        fresh.put(unit, 0, buf(10), 1, Write())  # unit 3 would fit now (unit 0 left): not predicted, not kept
    assert {k for k in sizes if fresh.take(*k, 1) is not None} | {(0, 0)} == keep
    assert fresh.kept_bytes == 0


@pytest.mark.parametrize("mode", ["sequential", "deferred", "eager",
                                  pytest.param("speculative", marks=pytest.mark.slow)])
def test_training_is_bitwise_the_same_and_reads_less(mode, tmp_path):
    recipe = Recipe(steps=4, accum=2, grad_clip=0.0 if mode == "eager" else 0.5)  # (0.5 clips: redone)
    placement = {"params": "nvme", "grads": "host", "optimizer": "nvme"}
    runs = {}
    for keep in (False, True):
        # (optimizer_read_ahead 0: a state read ahead that comes too late is read again, so with it the bytes
        # read vary from run to run by more than the kept copies save; without it they are the same every run)
        extra = {"overlap": {"optimizer_with_backward": mode != "sequential", "speculation": "64MiB"
                             if mode == "speculative" else 0, "optimizer_read_ahead": 0},
                 "prefetch": {"keep_written": keep}}
        losses, norms, state, report = engine_run(recipe, placement, str(tmp_path / f"k{keep}"), extra)
        assert report["update_mode"] == {"sequential": "InlineUpdate", "deferred": "DeferredUpdate",
                                         "eager": "EagerUpdate", "speculative": "SpeculativeUpdate"}[mode]
        runs[keep] = (losses, norms, state, report["bytes_moved"]["nvme_read"])
    assert runs[False][0] == runs[True][0] and runs[False][1] == runs[True][1]
    for name, tensor in runs[False][2].items():
        assert torch.equal(tensor, runs[True][2][name]), name
    assert runs[True][3] < runs[False][3]  # some forward fetches read memory instead of the disk
