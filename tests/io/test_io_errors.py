"""Every I/O failure surfaces from wait() as an IOEngineError naming the path, the offset,
the bytes and the fix; the engine keeps serving other requests and other data is intact."""

import errno
import os

import pytest
import torch

from io_engine import FailRule, IOConfig, IOEngine, IOEngineError, MemoryBackend
from tmpfs import tmpfs

CFG = IOConfig(block_size=64 << 10, queue_depth=8, threads=4)


def data(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def assert_engine_still_works(io: IOEngine, directory) -> None:
    src = data(100_003, seed=7)
    io.submit_write(src, os.path.join(directory, "after.bin"), 13).wait()
    out = torch.empty_like(src)
    io.submit_read(out, os.path.join(directory, "after.bin"), 13).wait()
    assert torch.equal(out, src)


def test_disk_full_real_tmpfs(tmp_path):
    with tmpfs(tmp_path / "small", "1m") as small, IOEngine(CFG) as io:
        keep = data(200_000, seed=1)
        io.submit_write(keep, small / "keep.bin", 0).wait()
        big = data(3 << 20, seed=2)
        with pytest.raises(IOEngineError) as e:
            io.submit_write(big, small / "big.bin", 4096).wait()
        msg = str(e.value)
        assert e.value.errno == errno.ENOSPC
        assert str(small / "big.bin") in msg and "offset" in msg and "full" in msg
        assert "free space" in msg and "[nvme]" in msg
        out = torch.empty_like(keep)
        io.submit_read(out, small / "keep.bin", 0).wait()  # earlier data undamaged
        assert torch.equal(out, keep)
        os.unlink(small / "big.bin")
        assert_engine_still_works(io, small)
        assert_engine_still_works(io, tmp_path)
        assert io.stats.write.errors == 1


def test_disk_full_memory_backend_nth_write():
    backend = MemoryBackend(fail=FailRule(direction="write", nth=3, errno=errno.ENOSPC))
    with IOEngine(CFG, backend=backend) as io:
        srcs = [data(5000 + i, seed=i) for i in range(5)]
        futs = [io.submit_write(s, f"/m/f{i}", 123) for i, s in enumerate(srcs)]
        with pytest.raises(IOEngineError, match=r"No space left.*offset 123 of /m/f2"):
            futs[2].wait()
        for i in (0, 1, 3, 4):
            futs[i].wait()
            out = torch.empty_like(srcs[i])
            io.submit_read(out, f"/m/f{i}", 123).wait()
            assert torch.equal(out, srcs[i])


def test_missing_directory(tmp_path):
    with IOEngine(CFG) as io:
        path = tmp_path / "no_such_dir" / "x.bin"
        with pytest.raises(IOEngineError) as e:
            io.submit_write(data(10), path, 77).wait()
        msg = str(e.value)
        assert str(path) in msg and "offset 77" in msg and "10 bytes" in msg
        assert "create the directory" in msg
        with pytest.raises(IOEngineError, match="does not exist"):
            io.submit_read(torch.empty(10, dtype=torch.uint8), path, 0).wait()
        assert_engine_still_works(io, tmp_path)


def test_read_only_directory_real_mount(tmp_path):
    with tmpfs(tmp_path / "ro", "1m", readonly=True) as ro, IOEngine(CFG) as io:
        with pytest.raises(IOEngineError) as e:
            io.submit_write(data(4096), ro / "x.bin", 8192).wait()
        msg = str(e.value)
        assert e.value.errno == errno.EROFS
        assert str(ro / "x.bin") in msg and "offset 8192" in msg and "writable" in msg
        assert_engine_still_works(io, tmp_path)


def test_read_only_memory_backend():
    backend = MemoryBackend(fail=FailRule(direction="write", path="/ro/*", errno=errno.EROFS))
    with IOEngine(CFG, backend=backend) as io:
        with pytest.raises(IOEngineError, match=r"Read-only.*offset 5 of /ro/a.*writable"):
            io.submit_write(data(100), "/ro/a", 5).wait()
        assert_engine_still_works(io, "/rw")


def test_short_read_truncated_file(tmp_path):
    path = tmp_path / "t.bin"
    with IOEngine(CFG) as io:
        src = data(300_000)
        io.submit_write(src, path, 1000).wait()
        os.truncate(path, 200_000)
        out = torch.empty_like(src)
        with pytest.raises(IOEngineError) as e:
            io.submit_read(out, path, 1000).wait()
        msg = str(e.value)
        assert "short read" in msg and str(path) in msg and "200000 bytes" in msg
        assert "offset 1000" in msg  # the request's offset, with the failing block's
        head = torch.empty(100_000, dtype=torch.uint8)
        io.submit_read(head, path, 1000).wait()  # the part still there is fine
        assert torch.equal(head, src[:100_000])
        assert_engine_still_works(io, tmp_path)


def test_file_removed_underneath(tmp_path):
    path = tmp_path / "gone.bin"
    with IOEngine(CFG) as io:
        io.submit_write(data(5000), path, 0).wait()
        os.unlink(path)
        with pytest.raises(IOEngineError) as e:
            io.submit_read(torch.empty(5000, dtype=torch.uint8), path, 0).wait()
        msg = str(e.value)
        assert e.value.errno == errno.ENOENT and str(path) in msg and "removed" in msg
        assert e.value.path == str(path) and e.value.offset == 0 and e.value.num_bytes == 5000
        assert_engine_still_works(io, tmp_path)


def test_failure_mid_request_names_block_and_request():
    def fail(op):  # third block of the write fails
        return errno.EIO if op.direction == "write" and op.block == 2 else None

    with IOEngine(CFG, backend=MemoryBackend(fail=fail)) as io:
        with pytest.raises(IOEngineError) as e:
            io.submit_write(data(300_000), "/m/x", 1000).wait()
        msg = str(e.value)
        assert f"offset {1000 + 2 * (64 << 10)}" in msg and "offset 1000)" in msg
        assert "block 3 of 5" in msg and "dmesg" in msg


def test_drain_raises_unobserved_failure_once(tmp_path):
    with IOEngine(CFG) as io:
        io.submit_write(data(10), tmp_path / "fine.bin", 0)
        io.submit_write(data(10), tmp_path / "nodir" / "a.bin", 0)
        with pytest.raises(IOEngineError, match="nodir"):
            io.drain()
        io.drain()  # reported once
        fut = io.submit_write(data(10), tmp_path / "nodir" / "b.bin", 0)
        with pytest.raises(IOEngineError):
            fut.wait()
        io.drain()  # already seen through wait()


def test_context_manager_reports_unobserved_failure(tmp_path):
    with pytest.raises(IOEngineError, match="nodir"):
        with IOEngine(CFG) as io:
            io.submit_write(data(10), tmp_path / "nodir" / "a.bin", 0)


def test_error_is_oserror_and_pickles():
    import pickle

    with IOEngine(CFG, backend=MemoryBackend()) as io:
        err = io.submit_read(torch.empty(3, dtype=torch.uint8), "/m/none", 9).exception()
    assert isinstance(err, OSError) and isinstance(err, IOEngineError)
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) and again.offset == 9 and again.path == "/m/none"
