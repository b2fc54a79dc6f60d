"""Note [unsharded memory]: pooled bytes behind units' unsharded buffers on a CPU device."""

from __future__ import annotations

import dataclasses
import mmap

import pytest
import torch

import infinity.memory.buffers as buffers
from engine_runs import engine_run
from infinity.memory.buffers import PooledUnshardedMemory, UnshardedMemory
from reference import TINY, Recipe

NBYTES = 3 * (1 << 20) + 4096  # not a power of two: the pool keeps exact sizes


def storage_with_view(numel: int) -> tuple[torch.UntypedStorage, torch.Tensor]:
    """An empty storage and a parameter-like view over its first `numel` floats (as Unit does)."""
    storage = torch.empty(0).untyped_storage()
    view = torch.empty(0).set_(storage, 0, (numel,), (1,))  # set_ grows the storage ...
    storage.resize_(0)  # ... and a sharded unit holds zero bytes
    return storage, view


@pytest.mark.skipif(not hasattr(torch.UntypedStorage, "_swap_data_ptr_"), reason="torch without _swap_data_ptr_")
def test_pooled_bytes_are_lent_to_the_storage_and_reused():
    pool = PooledUnshardedMemory()
    storage, view = storage_with_view(NBYTES // 4)
    pool.grow("a", storage, NBYTES)
    assert storage.nbytes() >= NBYTES and storage.data_ptr() % mmap.PAGESIZE == 0
    first = storage.data_ptr()
    view.copy_(torch.arange(view.numel(), dtype=torch.float32))  # the view writes the pooled bytes
    assert torch.equal(view[:5], torch.arange(5, dtype=torch.float32))
    pool.shrink("a", storage)
    assert storage.nbytes() == 0
    assert pool.pooled_bytes == NBYTES

    pool.grow("a", storage, NBYTES)  # the same bytes come back: no new mapping, no fresh pages
    assert storage.data_ptr() == first and pool.pooled_bytes == NBYTES
    other, _ = storage_with_view(NBYTES // 4)
    pool.grow("b", other, NBYTES)  # while "a" holds its buffer, "b" gets a second one
    assert other.data_ptr() != first and pool.pooled_bytes == 2 * NBYTES
    pool.shrink("b", other)
    pool.shrink("a", storage)


@pytest.mark.skipif(not hasattr(torch.UntypedStorage, "_swap_data_ptr_"), reason="torch without _swap_data_ptr_")
def test_growing_twice_or_shrinking_what_was_not_grown_is_a_bug_caught_at_once():
    pool = PooledUnshardedMemory()
    storage, _ = storage_with_view(16)
    with pytest.raises(AssertionError, match="holds no pooled bytes"):
        pool.shrink("a", storage)
    pool.grow("a", storage, 4096)
    with pytest.raises(AssertionError, match="grown twice"):
        pool.grow("a", storage, 4096)
    pool.shrink("a", storage)


def test_a_cpu_device_gets_the_pool_and_a_gpu_its_caching_allocator():
    expected = PooledUnshardedMemory if hasattr(torch.UntypedStorage, "_swap_data_ptr_") else UnshardedMemory
    assert type(UnshardedMemory.for_device(torch.device("cpu"))) is expected
    assert type(UnshardedMemory.for_device(torch.device("cuda", 0))) is UnshardedMemory


@pytest.mark.skipif(not hasattr(torch.UntypedStorage, "_swap_data_ptr_"), reason="torch without _swap_data_ptr_")
def test_training_with_pooled_unsharded_buffers_is_bitwise_the_allocators(tmp_path, monkeypatch):
    """Parameters on NVMe, world size 1, CPU: every unit is unsharded from the disk each pass."""
    recipe = Recipe(model=dataclasses.replace(TINY, n_layer=8), steps=3, accum=2)  # 9 units
    placement = {"params": "nvme", "grads": "host", "optimizer": "nvme"}
    pooled = engine_run(recipe, placement, str(tmp_path / "pooled"))
    monkeypatch.setattr(buffers.UnshardedMemory, "for_device", staticmethod(lambda device: UnshardedMemory()))
    resized = engine_run(recipe, placement, str(tmp_path / "resized"))
    assert pooled[0] == resized[0] and pooled[1] == resized[1]
    for name, tensor in pooled[2].items():
        assert torch.equal(tensor, resized[2][name]), name
    assert resized[3]["unsharded_pool_bytes"] == 0
    # the pool holds what is unsharded at once (the root, the unit computing and units_ahead = 2
    # prefetched), not one buffer per unit: buffers were reused across units and steps
    page_rounded = -(-pooled[3]["unsharded_peak_bytes"] // mmap.PAGESIZE) * mmap.PAGESIZE
    assert 0 < pooled[3]["unsharded_pool_bytes"] <= 4 * page_rounded
