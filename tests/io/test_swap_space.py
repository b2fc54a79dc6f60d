"""SwapSpace: aligned extents, reuse, striping, growth, close() hygiene, checksums."""

import errno
import os
import random

import pytest
import torch

from io_engine import ChecksumError, Extent, FailRule, IOConfig, IOEngine, IOEngineError, MemoryBackend, SwapSpace
from tmpfs import tmpfs

CFG = IOConfig(block_size=64 << 10, queue_depth=8, threads=4)


def data(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.fixture
def io():
    with IOEngine(CFG) as engine:
        yield engine


def check_no_overlap(extents):
    spans = sorted((p.path, p.offset, p.offset + p.capacity) for e in extents for p in e.parts)
    for (pa, _, ea), (pb, sb, _) in zip(spans, spans[1:]):
        assert pa != pb or ea <= sb, f"overlap in {pa}: ends {ea}, next starts {sb}"


def test_roundtrip_alignment_and_accounting(tmp_path, io):
    swap = SwapSpace([tmp_path], io, rank=3, alignment=4096)
    swap.reserve(1 << 20)
    assert swap.bytes_reserved == 1 << 20 and len(swap.files) == 1
    assert "rank3" in swap.files[0]
    tensors = [data(n, seed=n).view(torch.uint8) for n in (1, 4095, 4096, 4097, 100_000)]
    tensors += [torch.randn(1000, dtype=torch.float64), torch.ones(7, dtype=torch.bool),
                torch.randn(33, dtype=torch.bfloat16), torch.empty(0)]
    exts = [swap.allocate(t.numel() * t.element_size()) for t in tensors]
    assert all(isinstance(e, Extent) and all(o % 4096 == 0 for o in e.offsets) for e in exts)
    check_no_overlap(exts)
    assert swap.bytes_in_use == sum(-(-e.num_bytes // 4096) * 4096 for e in exts)
    for f in [swap.write(e, t) for e, t in zip(exts, tensors)]:
        f.wait()
    outs = [torch.empty_like(t) for t in tensors]
    for f in [swap.read(e, o) for e, o in zip(exts, outs)]:
        f.wait()
    for t, o in zip(tensors, outs):
        assert torch.equal(t.view(-1).view(torch.uint8), o.view(-1).view(torch.uint8))
    for e in exts:
        swap.free(e)
    assert swap.bytes_in_use == 0
    swap.close()


def test_freed_extents_are_reused_and_never_overlap(tmp_path, io):
    swap = SwapSpace([tmp_path], io)
    a = swap.allocate(10_000)
    b = swap.allocate(10_000)
    swap.free(a)
    c = swap.allocate(9_000)  # fits a's hole
    assert c.offset == a.offset
    rng = random.Random(0)
    live = [b, c]
    for _ in range(300):
        if live and rng.random() < 0.45:
            swap.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(swap.allocate(rng.randint(1, 200_000)))
        check_no_overlap(live)
    capacity = swap.bytes_reserved
    for e in live:
        swap.free(e)
    assert swap.bytes_in_use == 0
    again = swap.allocate(capacity)  # everything coalesced back into one hole
    assert again.offset == 0 and swap.bytes_reserved == capacity
    with pytest.raises(ValueError, match="not allocated"):
        swap.free(c)
    swap.close()


def test_grows_past_reserve(tmp_path, io):
    swap = SwapSpace([tmp_path], io)
    swap.reserve(8192)
    e = swap.allocate(100_000)
    assert swap.bytes_reserved == 102_400  # the 8 KiB reserved + what was missing, aligned
    assert os.path.getsize(swap.files[0]) == swap.bytes_reserved
    t = data(100_000)
    swap.write(e, t).wait()
    out = torch.empty_like(t)
    swap.read(e, out).wait()
    assert torch.equal(out, t)
    swap.close()


def test_striping_across_two_dirs(tmp_path, io):
    d0, d1 = tmp_path / "nvme0", tmp_path / "nvme1"
    d0.mkdir()
    d1.mkdir()
    swap = SwapSpace([d0, d1], io)
    swap.reserve(4 << 20)
    assert len(swap.files) == 2 and {os.path.dirname(f) for f in swap.files} == {str(d0), str(d1)}
    assert swap.bytes_reserved == 4 << 20
    big = swap.allocate(1_000_001)  # >= stripe_min_bytes: one part per dir
    assert len(big.parts) == 2 and set(big.paths) == set(swap.files)
    assert big.parts[0].num_bytes % 4096 == 0 and sum(p.num_bytes for p in big.parts) == 1_000_001
    smalls = [swap.allocate(5000) for _ in range(4)]  # round-robin
    assert [os.path.dirname(s.path) for s in smalls] == [str(d0), str(d1)] * 2
    t = torch.randn(250_000, dtype=torch.float32)
    big2 = swap.allocate(1_000_000)
    swap.write(big2, t).wait()
    out = torch.empty_like(t)
    swap.read(big2, out).wait()
    assert torch.equal(out, t)
    swap.close()


def test_close_removes_only_its_files(tmp_path, io):
    unrelated = tmp_path / "keep_me.txt"
    unrelated.write_text("user data")
    other_swap = tmp_path / "swap.rank0.1.swp"  # looks like ours, is not
    other_swap.write_bytes(b"x")
    swap = SwapSpace([tmp_path], io)
    swap.reserve(1 << 20)
    e = swap.allocate(10)
    swap.write(e, data(10)).wait()
    (mine,) = swap.files
    assert os.path.exists(mine)
    swap.close()
    assert not os.path.exists(mine)
    assert unrelated.read_text() == "user data" and other_swap.read_bytes() == b"x"
    assert tmp_path.is_dir()
    swap.close()  # idempotent


def test_missing_dir_is_clear(tmp_path, io):
    with pytest.raises(IOEngineError, match=r"does not exist.*\[nvme\] paths"):
        SwapSpace([tmp_path / "not_mounted"], io)


def test_flipped_byte_raises_checksum_error(tmp_path, io):
    swap = SwapSpace([tmp_path], io, checksum=True)
    swap.reserve(1 << 20)
    victim, neighbour = swap.allocate(200_000), swap.allocate(50_000)
    t, n = data(200_000, 1), data(50_000, 2)
    swap.write(victim, t).wait()
    swap.write(neighbour, n).wait()
    flip_at = victim.offset + 150_000
    with open(victim.path, "r+b") as f:  # a plain buffered write behind the engine's back
        f.seek(flip_at)
        byte = f.read(1)
        f.seek(flip_at)
        f.write(bytes([byte[0] ^ 0x01]))
    out = torch.empty_like(t)
    with pytest.raises(ChecksumError) as e:
        swap.read(victim, out).wait()
    msg = str(e.value)
    block_start = victim.offset + (150_000 // (64 << 10)) * (64 << 10)
    assert victim.path in msg and f"offset {block_start}" in msg and "checksum mismatch" in msg
    assert e.value.path == victim.path and e.value.offset <= flip_at
    out_n = torch.empty_like(n)
    swap.read(neighbour, out_n).wait()  # other extents unaffected, engine fine
    assert torch.equal(out_n, n)
    swap.write(victim, t).wait()  # rewriting repairs it
    swap.read(victim, out).wait()
    assert torch.equal(out, t)
    swap.close()


def test_sampled_checksum_detects_stale_and_tail_corruption(tmp_path):
    """Note [sampled checksum]: a block whose write was lost (the previous contents read back)
    and a flipped last byte are both caught with 1 MiB blocks checksummed by sample."""
    with IOEngine(IOConfig(block_size=1 << 20, queue_depth=4, threads=2, checksum="sampled")) as io:
        swap = SwapSpace([tmp_path], io)
        assert swap.checksum == "sampled"
        swap.reserve(4 << 20)
        ext = swap.allocate(2 << 20)
        old, new = data(2 << 20, 1), data(2 << 20, 2)
        swap.write(ext, old).wait()
        with open(ext.path, "rb") as f:
            f.seek(ext.offset)
            stale = f.read(1 << 20)
        swap.write(ext, new).wait()
        out = torch.empty_like(new)
        swap.read(ext, out).wait()
        assert torch.equal(out, new)
        with open(ext.path, "r+b") as f:  # the first block's new contents lost: the old ones read back
            f.seek(ext.offset)
            f.write(stale)
        with pytest.raises(ChecksumError, match=rf"checksum mismatch in .* at offset {ext.offset} .*\(sampled\)"):
            swap.read(ext, out).wait()
        swap.write(ext, new).wait()
        last = ext.offset + (2 << 20) - 1
        with open(ext.path, "r+b") as f:
            f.seek(last)
            byte = f.read(1)
            f.seek(last)
            f.write(bytes([byte[0] ^ 0x01]))
        with pytest.raises(ChecksumError, match=f"at offset {ext.offset + (1 << 20)} "):
            swap.read(ext, out).wait()
        swap.close()


def test_truncated_swap_file(tmp_path, io):
    swap = SwapSpace([tmp_path], io, checksum=True)
    swap.reserve(1 << 20)
    first, last = swap.allocate(100_000), swap.allocate(300_000)
    swap.write(first, data(100_000, 1)).wait()
    swap.write(last, data(300_000, 2)).wait()
    os.truncate(last.path, last.offset + 1000)
    with pytest.raises(IOEngineError) as e:
        swap.read(last, torch.empty(300_000, dtype=torch.uint8)).wait()
    assert last.path in str(e.value) and "short read" in str(e.value)
    out = torch.empty(100_000, dtype=torch.uint8)
    swap.read(first, out).wait()
    assert torch.equal(out, data(100_000, 1))
    swap.close()


def test_misuse_is_explained(tmp_path, io):
    swap = SwapSpace([tmp_path], io)
    e = swap.allocate(400)
    with pytest.raises(ValueError, match=r"100 x 4 = 400|holds 400"):
        swap.write(e, torch.zeros(101))
    with pytest.raises(IOEngineError, match="never written"):
        swap.read(e, torch.zeros(100)).wait()
    with pytest.raises(ValueError, match="multiple of 4096"):
        SwapSpace([tmp_path], io, alignment=512)
    swap.close()


def test_reserve_disk_full_real_tmpfs(tmp_path, io):
    with tmpfs(tmp_path / "small", "1m") as small:
        swap = SwapSpace([small], io)
        with pytest.raises(IOEngineError) as e:
            swap.reserve(10 << 20)
        msg = str(e.value)
        assert str(small) in msg and "missing" in msg and "free space" in msg
        assert "[nvme]" in msg and "reduce" in msg
        swap.reserve(256 << 10)  # a smaller reserve still works
        ext = swap.allocate(1000)
        swap.write(ext, data(1000)).wait()
        swap.close()
        assert os.listdir(small) == []


def test_memory_backend_swap_capacity_and_failures():
    backend = MemoryBackend(capacity_bytes=1 << 20, jitter_s=0.001,
                            fail=FailRule(direction="write", nth=2, errno=errno.ENOSPC))
    with IOEngine(CFG, backend=backend) as io:
        swap = SwapSpace(["/nvme0", "/nvme1"], io, checksum=True)
        with pytest.raises(IOEngineError, match=r"missing.*free space"):
            swap.reserve(4 << 20)
        swap.reserve(512 << 10)
        a, b, c = (swap.allocate(100_000) for _ in range(3))
        swap.write(a, data(100_000, 1)).wait()
        with pytest.raises(IOEngineError, match="No space left"):
            swap.write(b, data(100_000, 2)).wait()  # 2nd write fails
        with pytest.raises(IOEngineError, match="never written, or its last write failed"):
            swap.read(b, torch.empty(100_000, dtype=torch.uint8)).wait()
        swap.write(c, data(100_000, 3)).wait()
        backend.flip_byte(c.path, c.offset + 5)
        with pytest.raises(ChecksumError, match=f"{c.path} at offset {c.offset}"):
            swap.read(c, torch.empty(100_000, dtype=torch.uint8)).wait()
        out = torch.empty(100_000, dtype=torch.uint8)
        swap.read(a, out).wait()
        assert torch.equal(out, data(100_000, 1))
        files = swap.files
        swap.close()
        assert not set(files) & set(backend.files)


def test_checksum_off_and_many_concurrent_extents(tmp_path):
    with IOEngine(CFG, backend=MemoryBackend(jitter_s=0.0005)) as io:
        swap = SwapSpace(["/a", "/b"], io, checksum=False)
        tensors = [data(1 + i * 7919, seed=i) for i in range(60)]
        exts = [swap.allocate(t.numel()) for t in tensors]
        for f in [swap.write(e, t) for e, t in zip(exts, tensors)]:
            f.wait()
        outs = [torch.empty_like(t) for t in tensors]
        for f in [swap.read(e, o) for e, o in zip(exts, outs)]:
            f.wait()
        assert all(torch.equal(o, t) for o, t in zip(outs, tensors))
        swap.close()


def test_reads_share_an_extent_and_a_write_excludes_them():
    """Two reads of one extent may be in flight together (an aliased parameter fetch beside the
    optimizer's read-ahead of the same bytes); a write conflicts with either, and either with it."""
    with IOEngine(CFG, backend=MemoryBackend(latency_s=0.3)) as io:
        swap = SwapSpace(["/nvme0"], io, checksum="full")
        e = swap.allocate(100_000)
        swap.write(e, data(100_000, 7)).wait()
        outs = [torch.empty(100_000, dtype=torch.uint8) for _ in range(2)]
        reads = [swap.read(e, out) for out in outs]
        assert not any(r.done() for r in reads)  # both in flight at once
        with pytest.raises(RuntimeError, match=f"extent {e.id} is already being read"):
            swap.write(e, data(100_000, 8))
        for r in reads:
            r.wait()
        assert all(torch.equal(out, data(100_000, 7)) for out in outs)
        write = swap.write(e, data(100_000, 9))
        with pytest.raises(RuntimeError, match=f"extent {e.id} is already being written"):
            swap.read(e, outs[0])
        write.wait()
        swap.read(e, outs[0]).wait()
        assert torch.equal(outs[0], data(100_000, 9))
        swap.close()
