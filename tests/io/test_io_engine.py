"""IOEngine on real files: byte-exact round trips of every size/offset/dtype/address, the
asyncio face, stats, config validation, aligned buffers."""

import asyncio
import gc
import os
import threading
import warnings

import numpy as np
import pytest
import torch

from io_engine import AlignedBufferPool, IOConfig, IOEngine, IOFuture, IOStats, SizeError, aligned_empty, parse_size
from io_engine import engine as engine_module
from io_engine.backends import kernel_aio
from io_engine.backends import threads as threads_backend

SMALL = IOConfig(block_size=64 << 10, queue_depth=8, threads=4)  # many blocks per request


def all_dtypes() -> list[torch.dtype]:
    """Every dtype torch can allocate and view as bytes (quantized ones excluded)."""
    found = []
    for name in sorted(dir(torch)):
        d = getattr(torch, name)
        if not isinstance(d, torch.dtype) or d in found or d.is_complex is None:
            continue
        if d in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
                torch.empty(2, dtype=d).view(torch.uint8)
        except (RuntimeError, TypeError):
            continue
        found.append(d)
    return found


def filled(nbytes: int, shift: int = 0, seed: int = 0) -> torch.Tensor:
    """uint8 tensor of random bytes whose data starts `shift` bytes into its storage."""
    g = torch.Generator().manual_seed(seed)
    base = torch.empty(nbytes + shift, dtype=torch.uint8)
    base[shift:] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return base[shift:]


def test_all_dtypes_found():
    names = {str(d) for d in all_dtypes()}
    for want in ("torch.bool", "torch.bfloat16", "torch.complex64", "torch.complex128",
                 "torch.float8_e4m3fn", "torch.float8_e5m2", "torch.float16", "torch.int64"):
        assert want in names, f"{want} missing from {sorted(names)}"


BACKENDS = ["threads", "aio"]  # "aio" where the kernel offers it (tests/io/test_io_kernel_aio.py)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("num_bytes,offset,shift", [
    (0, 0, 0), (1, 0, 0), (1, 4095, 0), (511, 1, 3), (512, 512, 0), (4096, 0, 0),
    (4097, 4095, 1), (65536, 0, 5), (65537, 12345, 0), (300_001, 7, 1),
    (1 << 20, 4096, 0), ((1 << 20) + 3, 65536 - 1, 2),
])
def test_roundtrip_edge_cases(tmp_path, backend, direct, num_bytes, offset, shift):
    cfg = IOConfig(block_size=64 << 10, queue_depth=8, threads=4, direct=direct,
                   backend=backend_or_skip(backend))
    path = tmp_path / "data.bin"
    src = filled(num_bytes, shift, seed=num_bytes)
    with IOEngine(cfg) as io:
        io.submit_write(src, path, offset).wait()
        out = filled(num_bytes, (shift + 1) % 7, seed=99)  # different address alignment
        io.submit_read(out, path, offset).wait()
    assert torch.equal(out, src)
    assert os.path.getsize(path) == offset + num_bytes  # no padding past the data


def test_neighbouring_unaligned_writes_do_not_clobber(tmp_path):
    """Concurrent writes sharing 4 KiB blocks at their edges keep each other's bytes."""
    path = tmp_path / "shared.bin"
    pieces, pos = [], 0
    for i in range(200):
        n = 1 + (i * 2654435761) % 9000
        pieces.append((filled(n, i % 5, seed=i), pos))
        pos += n
    with IOEngine(SMALL) as io:
        for f in [io.submit_write(t, path, off) for t, off in pieces]:
            f.wait()
        whole = torch.empty(pos, dtype=torch.uint8)
        io.submit_read(whole, path, 0).wait()
    for t, off in pieces:
        assert torch.equal(whole[off:off + t.numel()], t), f"piece at {off} damaged"


def backend_or_skip(name: str) -> str:
    if name == "aio" and not kernel_aio.available():
        pytest.skip("no kernel AIO here")
    return name


@pytest.mark.parametrize("backend", BACKENDS)
def test_thousand_random_tensors_concurrently(tmp_path, backend):
    """1,000 tensors, sizes log-uniform 1 B..16 MiB, every dtype, random offsets and
    addresses, 5 files: all written at once, all read back at once, byte-exact."""
    rng = np.random.default_rng(0)
    dtypes = all_dtypes()
    pool = filled(48 << 20, seed=1)  # sources are views into it: odd addresses, no copies
    pool = aligned_empty(pool.numel(), torch.uint8, lock=False).copy_(pool)  # some page-aligned
    files = [tmp_path / f"f{i}.bin" for i in range(5)]
    ends = [0] * len(files)
    items = []
    for i in range(1000):
        dtype = dtypes[i % len(dtypes)]
        size = dtype.itemsize
        numel = max(1, int(np.exp(rng.uniform(0, np.log(16 << 20)))) // size)
        nbytes = numel * size
        start = int(rng.integers(0, (pool.numel() - nbytes) // size + 1)) * size
        raw = pool[start:start + nbytes]
        f = int(rng.integers(len(files)))
        offset = ends[f] + int(rng.integers(0, 5000))
        ends[f] = offset + nbytes
        items.append((raw, raw.view(dtype), files[f], offset))
    total = sum(raw.numel() for raw, *_ in items)
    assert total < 1.5e9, f"test data grew to {total} bytes"
    arena = torch.empty(total + 16 * len(items), dtype=torch.uint8)  # read targets
    with IOEngine(IOConfig(backend=backend_or_skip(backend))) as io:
        for fut in [io.submit_write(t, p, off) for _, t, p, off in items]:
            fut.wait()
        outs, pos = [], 0
        for k, (raw, t, p, off) in enumerate(items):
            pos += (k % 3) * t.element_size()  # some targets not 4 KiB aligned
            pos += (-pos) % t.element_size()
            out = arena[pos:pos + raw.numel()]
            pos += raw.numel()
            outs.append((out, io.submit_read(out.view(t.dtype), p, off)))
        for _, fut in outs:
            fut.wait()
        stats = io.stats
    for (raw, t, _, off), (out, _) in zip(items, outs):
        assert torch.equal(out, raw), f"{t.dtype} x {t.numel()} at offset {off} differs"
    assert stats.write.ops == stats.read.ops == 1000
    assert stats.write.bytes == stats.read.bytes == total


def test_asyncio_face(tmp_path):
    async def main():
        with IOEngine(SMALL) as io:
            srcs = [filled(10_000 + i, seed=i) for i in range(20)]
            await asyncio.gather(*(io.write(s, tmp_path / f"a{i}", 3) for i, s in enumerate(srcs)))
            outs = [torch.empty_like(s) for s in srcs]
            await asyncio.gather(*(io.read(o, tmp_path / f"a{i}", 3) for i, o in enumerate(outs)))
            assert all(torch.equal(o, s) for o, s in zip(outs, srcs))
            with pytest.raises(OSError, match="missing"):
                await io.read(outs[0], tmp_path / "missing", 0)

    asyncio.run(main())


def test_future_api_and_stats(tmp_path):
    with IOEngine(SMALL) as io:
        src = filled(1 << 20)
        fut = io.submit_write(src, tmp_path / "s.bin", 0)
        assert isinstance(fut, IOFuture)
        seen, called = [], threading.Event()
        fut.add_done_callback(lambda f: (seen.append(f), called.set()))  # (run by the I/O thread after the wake-up)
        assert fut.wait() is None and fut.done() and called.wait(5) and seen == [fut]
        assert fut.exception() is None
        io.submit_read(torch.empty(1 << 20, dtype=torch.uint8), tmp_path / "s.bin", 0).wait()
        io.drain()
        stats = io.stats
    assert isinstance(stats, IOStats)
    for d in ("read", "write"):
        s = stats[d]
        assert (s.bytes, s.ops, s.blocks, s.errors) == (1 << 20, 1, 16, 0)
        assert 0 < s.latency_p50_s <= s.latency_p90_s <= s.latency_p99_s <= s.latency_max_s
        assert s.busy_s >= s.latency_max_s * 0.99 and s.throughput_GBps > 0
    assert "read" in stats.summary()


def test_bad_inputs_rejected_with_fix(tmp_path):
    with IOEngine(SMALL) as io:
        with pytest.raises(ValueError, match="contiguous"):
            io.submit_write(torch.zeros(4, 4).t(), tmp_path / "x", 0)
        with pytest.raises(ValueError, match="meta"):
            io.submit_write(torch.zeros(4, device="meta"), tmp_path / "x", 0)
        with pytest.raises(ValueError, match="offset"):
            io.submit_write(torch.zeros(4), tmp_path / "x", -1)
        with pytest.raises(TypeError):
            io.submit_write([1, 2], tmp_path / "x", 0)
    with pytest.raises(RuntimeError, match="closed"):
        io.submit_write(torch.zeros(4), tmp_path / "x", 0)


@pytest.mark.parametrize("kwargs,field", [
    ({"block_size": 1000}, "block_size"), ({"block_size": "1 potato"}, "block_size"),
    ({"queue_depth": 0}, "queue_depth"), ({"threads": 0}, "threads"),
    ({"threads": 32, "queue_depth": 16}, "threads"), ({"direct": "yes"}, "direct"),
    ({"checksum": 1}, "checksum"), ({"backend": "uring"}, "backend"),
])
def test_config_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        IOConfig(**kwargs)


def test_checksum_modes_normalize():
    assert IOConfig().checksum == "sampled"
    assert IOConfig(checksum=True).checksum == "full" and IOConfig(checksum=False).checksum == "off"
    assert IOConfig(checksum="full").checksum == "full"


def test_sampled_checksum_is_the_crc_of_its_pieces():
    """Note [sampled checksum]: SAMPLE_PIECES pieces spread evenly from the first byte to the
    last, chained, equal the CRC of the pieces laid end to end; small blocks are covered whole."""
    block = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    piece, n = engine_module.SAMPLE_BYTES, len(block)
    pieces = engine_module.SAMPLE_PIECES
    starts = [k * (n - piece) // (pieces - 1) for k in range(pieces)]
    assert starts[0] == 0 and starts[-1] + piece == n
    joined = np.concatenate([block[s:s + piece] for s in starts])
    assert engine_module.sampled_checksum(block) == engine_module.checksum(joined)
    small = block[:2 * engine_module.SAMPLE_PIECES * piece]
    assert engine_module.sampled_checksum(small) == engine_module.checksum(small)
    flipped = block.copy()
    flipped[starts[3] + 5] ^= 1
    assert engine_module.sampled_checksum(flipped) != engine_module.sampled_checksum(block)


def test_config_accepts_size_strings():
    assert IOConfig(block_size="4MiB").block_size == 4 << 20
    assert parse_size("1GiB") == 1 << 30 and parse_size("512MiB") == 512 << 20
    assert parse_size("1 GB") == 10 ** 9 and parse_size(123) == 123 and parse_size("4KiB") == 4096
    with pytest.raises(dataclass_error()):
        IOConfig().block_size = 5  # frozen


def test_one_meaning_of_size_strings():
    """Note [size strings]: io_engine and the config parse sizes with one function, so "4KiB" is 4096 and
    "4KB" 4000 in both, and a bare "4k" (1024 or 1000?) is refused in both with the two spellings to choose."""
    from infinity.config.sections import ConfigError
    from infinity.config.sections import parse_size as config_parse_size
    for text, num_bytes in (("4KiB", 4096), ("4KB", 4000), ("1.5GiB", 3 << 29), ("2 mib", 2 << 20), ("7", 7)):
        assert parse_size(text) == config_parse_size(text, "k") == num_bytes
    for bare in ("4k", "12 G", "1m"):
        with pytest.raises(SizeError, match=r"ambiguous unit.*KiB|ambiguous unit.*GiB|ambiguous unit.*MiB"):
            parse_size(bare)
        with pytest.raises(ConfigError, match=r"^io\.block_size = .*ambiguous"):
            config_parse_size(bare, "io.block_size")
    with pytest.raises(ValueError, match="IOConfig.block_size.*ambiguous"):
        IOConfig(block_size="4k")


def test_atomic_write_replaces_whole_or_not_at_all(tmp_path, monkeypatch):
    """Note [atomic write]: the new contents replace the old in one rename; a failed write leaves the old file
    and no temporary file."""
    from io_engine import atomic_write
    target = tmp_path / "cache.json"
    atomic_write(target, "old")
    atomic_write(target, b"new bytes")
    assert target.read_bytes() == b"new bytes"
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError, match="No space"):
        atomic_write(target, "lost")
    assert target.read_bytes() == b"new bytes" and sorted(p.name for p in tmp_path.iterdir()) == ["cache.json"]


def dataclass_error():
    import dataclasses
    return dataclasses.FrozenInstanceError


def test_direct_unsupported_falls_back_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(threads_backend, "_probe_direct_alignment", lambda d: 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with IOEngine(SMALL) as io:
            for i in range(3):
                src = filled(5000 + i)
                io.submit_write(src, tmp_path / "b.bin", 11).wait()
                out = torch.empty_like(src)
                io.submit_read(out, tmp_path / "b.bin", 11).wait()
                assert torch.equal(out, src)
    msgs = [str(w.message) for w in caught if "O_DIRECT" in str(w.message)]
    assert len(msgs) == 1 and "direct = false" in msgs[0]


@pytest.mark.parametrize("alignment", [512, 4096, 2 << 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.complex128])
def test_aligned_empty(alignment, dtype):
    t = aligned_empty(1000, dtype, alignment=alignment)
    assert t.data_ptr() % alignment == 0 and t.numel() == 1000 and t.dtype == dtype
    assert not t.is_pinned()  # no CUDA here
    t.view(torch.uint8).fill_(1)
    assert aligned_empty(0, dtype).numel() == 0


def test_aligned_empty_is_locked_and_freed():
    def locked_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmLck"))

    before = locked_kib()
    t = aligned_empty(8 << 20, torch.uint8)
    if os.geteuid() == 0:
        assert locked_kib() - before >= 8 << 10
    del t
    gc.collect()
    assert locked_kib() - before < 8 << 10  # unmapped (and unlocked) with the tensor


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_aligned_empty_pinned_with_cuda():
    t = aligned_empty(1 << 20, torch.float16)
    assert t.is_pinned() and t.data_ptr() % 4096 == 0
    assert not aligned_empty(10, pin=False).is_pinned()


def test_buffer_pool_reuses_by_size_class():
    pool = AlignedBufferPool(alignment=4096)
    a = pool.get(1000, torch.float32)
    assert a.data_ptr() % 4096 == 0 and a.numel() == 1000 and a.dtype == torch.float32
    ptr, allocated = a.data_ptr(), pool.bytes_allocated
    pool.put(a)
    b = pool.get(900, torch.float32)  # same size class: same buffer, nothing new allocated
    assert b.data_ptr() == ptr and pool.bytes_allocated == allocated
    c = pool.get(3 << 20, torch.uint8)
    assert pool.bytes_allocated > allocated
    with pytest.raises(ValueError, match="not handed out"):
        pool.put(torch.zeros(3))
    pool.put(b)
    with pytest.raises(ValueError, match="already put back"):
        pool.put(b)
    pool.put(c)
    pool.close()
    assert pool.bytes_allocated == 0


def resident_pages(path) -> int:
    """Pages of the file in the page cache (mincore over a read-only mapping)."""
    import ctypes
    import mmap as _mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long)
    size = os.path.getsize(path)
    pages = -(-size // _mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, _mmap.PROT_READ, _mmap.MAP_SHARED, fd, 0)
        vec = (ctypes.c_ubyte * pages)()
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec)


def fs_type(path) -> str:
    real, best = os.path.realpath(path), ("", "")
    with open("/proc/mounts") as f:
        for line in f:
            _, mnt, kind = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best[0]):
                best = (mnt, kind)
    return best[1]


def test_direct_io_bypasses_page_cache(tmp_path):
    if fs_type(tmp_path) not in ("ext4", "xfs", "btrfs"):
        pytest.skip(f"{tmp_path} is on {fs_type(tmp_path)}, not a block filesystem")
    path = tmp_path / "direct.bin"
    src = aligned_empty(4 << 20, torch.uint8)
    src.fill_(3)
    with IOEngine(SMALL) as io:
        io.submit_write(src, path, 0).wait()
        assert resident_pages(path) == 0  # nothing went through the page cache
        io.submit_read(src, path, 0).wait()
        assert resident_pages(path) == 0
        io.submit_write(src[1:1001], path, 4096 * 3 + 5).wait()  # partial pages: buffered
        assert 1 <= resident_pages(path) <= 2


def test_queue_slot_refilled_before_the_checksum(monkeypatch):
    """Note [checksum off the queue]: a finished block's slot goes to the next block before
    the finished one is checksummed, so the disk is not left a request short meanwhile."""
    from io_engine import MemoryBackend
    backend = MemoryBackend()
    submitted = []
    real_submit = backend.submit
    monkeypatch.setattr(backend, "submit", lambda op: (submitted.append(op.index), real_submit(op)))
    seen_at_checksum = []
    real_checksum = engine_module.checksum
    monkeypatch.setattr(engine_module, "checksum",
                        lambda mem: (seen_at_checksum.append(len(submitted)), real_checksum(mem))[1])
    data = torch.randint(0, 256, (3 * 4096,), dtype=torch.uint8)
    with IOEngine(IOConfig(block_size=4096, queue_depth=1, threads=1), backend=backend) as io:
        fut = io.submit("write", data, "f", 0, checksum=True)
        fut.wait()
        assert fut.checksums == [real_checksum(memoryview(data[i:i + 4096].numpy())) for i in (0, 4096, 8192)]
        back = torch.empty_like(data)
        io.submit("read", back, "f", 0, checksum=True, expected=fut.checksums).wait()
    assert torch.equal(back, data)
    # queue depth 1: block k is checksummed after block k + 1 was handed to the backend
    assert seen_at_checksum[:3] == [2, 3, 3]


@pytest.mark.timeout(60)
def test_failing_checksum_fails_its_request(monkeypatch):
    """A checksum that raises fails the request with that error (and the engine goes on);
    it never leaves the waiter hanging."""
    from io_engine import MemoryBackend

    def broken(mem):
        raise MemoryError("checksum ran out of memory")
    data = torch.randint(0, 256, (2 * 4096,), dtype=torch.uint8)
    with IOEngine(IOConfig(block_size=4096, queue_depth=2, threads=1), backend=MemoryBackend()) as io:
        monkeypatch.setattr(engine_module, "checksum", broken)
        with pytest.raises(Exception, match="checksum ran out of memory"):
            io.submit("write", data, "f", 0, checksum="full").wait()
        monkeypatch.undo()
        io.submit("write", data, "f", 0, checksum="full").wait()
