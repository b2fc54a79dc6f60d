"""The kernel-AIO backend (Note [kernel aio]): aligned direct blocks go through io_submit,
everything else through the worker threads; byte-exact either way, short transfers
finished on a worker, kernel errors reported like the thread path's, and a clear error
when AIO is asked for where the kernel does not offer it."""

import errno
import os

import numpy as np
import pytest
import torch

from io_engine import IOConfig, IOEngine, IOEngineError, ThreadBackend, aligned_empty
from io_engine.backends import kernel_aio
from tmpfs import tmpfs

pytestmark = pytest.mark.skipif(not kernel_aio.available(), reason="no kernel AIO here")

AIO = IOConfig(block_size=64 << 10, queue_depth=8, threads=2, backend="aio")
PAGE = 4096


def random_aligned(nbytes: int, seed: int) -> torch.Tensor:
    t = aligned_empty(nbytes, torch.uint8, lock=False)
    t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(seed)))
    return t


def test_auto_picks_aio_and_threads_backend_stays_available():
    with IOEngine(IOConfig()) as io:
        assert isinstance(io.backend, kernel_aio.AioBackend)
    with IOEngine(IOConfig(backend="threads")) as io:
        assert type(io.backend) is ThreadBackend


def test_aligned_blocks_through_aio_rest_through_threads(tmp_path):
    path = tmp_path / "a.bin"
    body = 3 * (64 << 10) + 5 * PAGE
    src = random_aligned(body + 100, seed=1)  # a 100-byte tail the kernel cannot take direct
    with IOEngine(AIO) as io:
        io.submit_write(src, path, PAGE).wait()
        assert io.backend.aio_blocks == 3  # the 4th block (5 pages + 100 bytes) is unaligned
        out = random_aligned(body + 100, seed=2)
        io.submit_read(out[:body], path, PAGE).wait()
        assert io.backend.aio_blocks == 7  # a read of whole pages: all 4 blocks by AIO
        io.submit_read(out[body:], path, PAGE + body).wait()
    assert torch.equal(out, src)


def test_many_aligned_tensors_concurrently_byte_exact(tmp_path):
    """300 page-multiple tensors at page offsets in 4 files, written all at once and read
    back all at once: every block went through the kernel, every byte came back."""
    rng = np.random.default_rng(0)
    sizes = [PAGE * int(np.exp(rng.uniform(0, np.log(1024)))) for _ in range(300)]
    pool = random_aligned(sum(sizes), seed=3)
    files = [tmp_path / f"f{i}.bin" for i in range(4)]
    ends = [0] * len(files)
    items, pos = [], 0
    for n in sizes:
        f = int(rng.integers(len(files)))
        offset = ends[f] + PAGE * int(rng.integers(0, 4))
        ends[f] = offset + n
        items.append((pool[pos:pos + n], files[f], offset))
        pos += n
    blocks = sum(-(-n // AIO.block_size) for n in sizes)
    outs = aligned_empty(pool.numel(), torch.uint8, lock=False)
    with IOEngine(AIO) as io:
        for fut in [io.submit_write(t, p, off) for t, p, off in items]:
            fut.wait()
        futs, pos = [], 0
        for t, p, off in items:
            futs.append(io.submit_read(outs[pos:pos + t.numel()], p, off))
            pos += t.numel()
        for fut in futs:
            fut.wait()
        assert io.backend.aio_blocks == 2 * blocks
    assert torch.equal(outs, pool)


def test_short_read_at_end_of_file_is_finished_on_a_worker(tmp_path):
    """The kernel returns fewer bytes than asked at the end of the file: the rest goes to a
    worker, which raises the thread path's ShortRead; the data that is there is intact."""
    path = tmp_path / "t.bin"
    src = random_aligned(256 << 10, seed=4)
    with IOEngine(AIO) as io:
        io.submit_write(src, path, 0).wait()
        os.truncate(path, (160 << 10) + 100)  # mid-block, not on a page boundary
        out = random_aligned(256 << 10, seed=5)
        with pytest.raises(IOEngineError) as e:
            io.submit_read(out, path, 0).wait()
        msg = str(e.value)
        assert "short read" in msg and str(path) in msg
        head = random_aligned(128 << 10, seed=6)
        io.submit_read(head, path, 0).wait()
        assert torch.equal(head, src[:128 << 10])
        part = aligned_empty(64 << 10, torch.uint8, lock=False)  # the cut block, read whole
        with pytest.raises(IOEngineError, match="short read"):
            io.submit_read(part, path, 128 << 10).wait()
        io.submit_read(part[:(32 << 10) + 100], path, 128 << 10).wait()  # the bytes still there
        assert torch.equal(part[:(32 << 10) + 100], src[128 << 10:(160 << 10) + 100])


def test_disk_full_from_the_kernel_names_path_and_engine_goes_on(tmp_path):
    with tmpfs(tmp_path / "small", "1m") as small, IOEngine(AIO) as io:
        keep = random_aligned(256 << 10, seed=7)
        io.submit_write(keep, small / "keep.bin", 0).wait()
        big = random_aligned(2 << 20, seed=8)
        with pytest.raises(IOEngineError) as e:
            io.submit_write(big, small / "big.bin", 0).wait()
        assert e.value.errno == errno.ENOSPC and str(small / "big.bin") in str(e.value)
        assert "full" in str(e.value)
        out = random_aligned(256 << 10, seed=9)
        io.submit_read(out, small / "keep.bin", 0).wait()
        assert torch.equal(out, keep)
        os.unlink(small / "big.bin")
        again = random_aligned(128 << 10, seed=10)
        io.submit_write(again, small / "again.bin", 0).wait()
        io.submit_read(out[:128 << 10], small / "again.bin", 0).wait()
        assert torch.equal(out[:128 << 10], again)


def test_close_waits_for_blocks_in_the_kernel(tmp_path):
    path = tmp_path / "c.bin"
    src = random_aligned(4 << 20, seed=11)
    io = IOEngine(AIO)
    fut = io.submit_write(src, path, 0)
    io.close()  # must not return (and free the context) while the kernel still writes
    assert fut.done()
    with IOEngine(AIO) as io2:
        out = random_aligned(4 << 20, seed=12)
        io2.submit_read(out, path, 0).wait()
    assert torch.equal(out, src)


def test_aio_asked_for_where_the_kernel_lacks_it(monkeypatch):
    monkeypatch.setattr(kernel_aio, "_SYSCALLS", {})
    kernel_aio.available.cache_clear()
    try:
        with pytest.raises(IOEngineError, match="backend='threads'"):
            IOEngine(IOConfig(backend="aio"))
        with IOEngine(IOConfig(backend="auto")) as io:
            assert type(io.backend) is ThreadBackend
    finally:
        kernel_aio.available.cache_clear()



def test_auto_falls_back_with_a_warning_when_no_context_is_left(monkeypatch):
    """aio-max-nr exhausted (io_setup: EAGAIN): "auto" warns and uses threads, "aio" raises."""
    def refuse(self, slots):
        raise OSError(errno.EAGAIN, "io_setup failed (if EAGAIN, raise /proc/sys/fs/aio-max-nr)")
    assert kernel_aio.available()  # cached before the refusals: the kernel offers AIO
    monkeypatch.setattr(kernel_aio._Context, "__init__", refuse)
    try:
        with pytest.warns(RuntimeWarning, match="aio-max-nr"):
            io = IOEngine(IOConfig(backend="auto"))
        with io:
            assert type(io.backend) is ThreadBackend
        with pytest.raises(IOEngineError, match="aio-max-nr"):
            IOEngine(IOConfig(backend="aio"))
    finally:
        kernel_aio.available.cache_clear()
