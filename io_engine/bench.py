"""`python -m io_engine.bench`: write-then-read throughput of the engine, next to fio and a
naive baseline, on one directory.

    python -m io_engine.bench --dir /mnt/nvme0/bench --size 1GiB --compare fio,naive \
        --repeats 3 --json bench.json

Throughput is decimal GB/s, the median of --repeats runs, interleaved across contenders
so that drift of the machine hits all alike, page cache bypassed (O_DIRECT; the naive
baseline drops the file's cached pages with posix_fadvise(DONTNEED) before reading). fio
runs the same transfer (libaio, O_DIRECT, same block size) at iodepth 16 and 32 (and the
engine's queue depth), with and without --lockmem; the best is kept. --sweep tries block
sizes x queue depths x threads and prints the best as a TOML [io] snippet.

Note [footprint]: fio moves every block through one buffer of iodepth x bs bytes; a tensor
transfer touches `size` bytes of distinct memory, which costs throughput on some VMs
(benchmarks/history/from-notes.md), so the bench also reports the engine driven like fio
(``io_engine_small_buffer``) to separate engine overhead from memory footprint.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import zlib

import torch

from .aligned import aligned_empty, tensor_memoryview
from .checksums import CHECKSUM_ALGORITHM, checksum, sampled_checksum
from .engine import IOEngine, backend_name
from .files import drop_page_cache, fsync_file
from .io_config import BACKENDS, IOConfig
from .sizes import SizeError, format_size, parse_size
from .swap_space import SwapSpace

_FILL_CHUNK = 16 << 20


def _fill_random(buf: torch.Tensor) -> None:
    """Incompressible bytes, fast: one random chunk tiled over the buffer."""
    gen = torch.Generator().manual_seed(0)
    chunk = torch.randint(0, 256, (min(_FILL_CHUNK, buf.numel()),), dtype=torch.uint8,
                          generator=gen)
    for pos in range(0, buf.numel(), chunk.numel()):
        n = min(chunk.numel(), buf.numel() - pos)
        buf[pos:pos + n] = chunk[:n]


def _median_GBps(num_bytes: int, seconds: list[float]) -> float:
    return num_bytes / statistics.median(seconds) / 1e9


class Contender:
    """One way of moving `size` bytes to a file and back; run() times one transfer."""

    name = ""

    def setup(self) -> None:
        """Untimed preparation (lay the file out)."""

    def run(self, direction: str) -> float:
        """Seconds for one full transfer in `direction` ("write" / "read")."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what setup() acquired."""


class EngineContender(Contender):
    """The whole buffer in one submit_write / submit_read."""

    name = "io_engine"

    def __init__(self, cfg: IOConfig, buf: torch.Tensor, path: str):
        self.cfg, self.buf, self.path = cfg, buf, path

    def setup(self) -> None:
        self.io = IOEngine(self.cfg)
        self.io.submit_write(self.buf, self.path, 0).wait()  # lay the file out, like fio does
        fsync_file(self.path)

    def run(self, direction: str) -> float:
        if direction == "read":
            drop_page_cache(self.path)
        t0 = time.perf_counter()
        if direction == "write":
            self.io.submit_write(self.buf, self.path, 0).wait()
            self._sync()
        else:
            self.io.submit_read(self.buf, self.path, 0).wait()
        return time.perf_counter() - t0

    def _sync(self) -> None:
        """Buffered writes are not done before fsync. Direct writes are (fio does not fsync
        either; an fsync would also wait for other processes' dirty data in ext4's journal)."""
        if not self.cfg.direct:
            fsync_file(self.path)

    def close(self) -> None:
        self.io.close()


class SmallBufferContender(EngineContender):
    """The same file transfer, but every request from/into ONE buffer of queue_depth x
    block_size bytes, as fio does (Note [footprint]); read data is not meaningful."""

    name = "io_engine_small_buffer"

    def __init__(self, cfg: IOConfig, size: int, path: str):
        self.chunk = cfg.block_size * cfg.queue_depth
        buf = aligned_empty(self.chunk, torch.uint8, lock=True)
        _fill_random(buf)
        super().__init__(cfg, buf, path)
        self.size = size

    def setup(self) -> None:
        self.io = IOEngine(self.cfg)
        self.run("write")

    def run(self, direction: str) -> float:
        submit = self.io.submit_write if direction == "write" else self.io.submit_read
        t0 = time.perf_counter()
        futs = [submit(self.buf[:min(self.chunk, self.size - pos)], self.path, pos)
                for pos in range(0, self.size, self.chunk)]
        for f in futs:
            f.wait()  # why: the transfer is timed until its last byte
        if direction == "write":
            self._sync()
        return time.perf_counter() - t0


class SwapContender(Contender):
    """SwapSpace write/read of one extent, checksums on."""

    name = "swap_checksummed"

    def __init__(self, cfg: IOConfig, buf: torch.Tensor, directory: str):
        self.cfg, self.buf, self.dir = cfg, buf, directory

    def setup(self) -> None:
        self.io = IOEngine(self.cfg)
        self.swap = SwapSpace([self.dir], self.io, name="io_engine_bench_swap", checksum="full")
        self.swap.reserve(self.buf.numel())
        self.ext = self.swap.allocate(self.buf.numel())
        self.swap.write(self.ext, self.buf).wait()

    def run(self, direction: str) -> float:
        t0 = time.perf_counter()
        op = self.swap.write if direction == "write" else self.swap.read
        op(self.ext, self.buf).wait()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.swap.close()
        self.io.close()


class FioContender(Contender):
    """fio, libaio, O_DIRECT, same block size; optionally --lockmem=size."""

    def __init__(self, path: str, size: int, block_size: int, queue_depth: int, lockmem: bool):
        self.name = f"fio_qd{queue_depth}" + ("_lockmem" if lockmem else "")
        self.cmd = [shutil.which("fio"), "--name=io_engine_bench", f"--filename={path}",
                    f"--size={size}", f"--bs={block_size}", f"--iodepth={queue_depth}",
                    "--ioengine=libaio", "--direct=1", "--output-format=json"]
        if lockmem:
            self.cmd.append(f"--lockmem={size}")
        self.size = size

    def setup(self) -> None:
        self.run("write")  # fio lays the file out on its first run (untimed by fio)

    def run(self, direction: str) -> float:
        out = subprocess.run(self.cmd + [f"--rw={direction}"], capture_output=True, text=True,
                             check=True).stdout
        job = json.loads(out[out.index("{"):])["jobs"][0]
        return self.size / job[direction]["bw_bytes"]  # fio's own timing of the transfer


class NaiveContender(Contender):
    """Plain Python: f.write(tensor.numpy().tobytes()) + fsync; f.read() into fresh bytes."""

    name = "naive"

    def __init__(self, buf: torch.Tensor, path: str):
        self.buf, self.path = buf, path

    def run(self, direction: str) -> float:
        if direction == "write":
            t0 = time.perf_counter()
            with open(self.path, "wb") as f:
                f.write(self.buf.numpy().tobytes())
                f.flush()
                os.fsync(f.fileno())
            return time.perf_counter() - t0
        drop_page_cache(self.path)
        t0 = time.perf_counter()
        with open(self.path, "rb") as f:
            data = f.read()
        elapsed = time.perf_counter() - t0
        assert len(data) == self.buf.numel(), f"naive read {len(data)} of {self.buf.numel()} bytes"
        return elapsed


def measure(contenders: list[Contender], size: int, repeats: int) -> dict:
    """Interleaved runs: each repetition runs every contender once per direction, in a
    rotating order, so drift of the machine (a VM's neighbours) hits all of them alike.
    Returns {name: {"write_GBps": median, "read_GBps": median, "*_runs_GBps": [...]}}."""
    for c in contenders:
        c.setup()
    runs = {c.name: {"write": [], "read": []} for c in contenders}
    try:
        for rep in range(repeats):
            for direction in ("write", "read"):
                k = rep % len(contenders)
                for c in contenders[k:] + contenders[:k]:
                    runs[c.name][direction].append(size / c.run(direction) / 1e9)
    finally:
        for c in contenders:
            c.close()
    out = {}
    for name, r in runs.items():
        out[name] = {}
        for d in ("read", "write"):
            out[name][f"{d}_GBps"] = statistics.median(r[d])
            out[name][f"{d}_runs_GBps"] = r[d]
    return out


def bench_checksum(buf: torch.Tensor, block_size: int) -> dict:
    """Single-thread GB/s of the full checksum, of the sampled one (block bytes covered per
    second: Note [sampled checksum]) and of zlib.crc32 for reference."""
    mv = tensor_memoryview(buf[: min(buf.numel(), 256 << 20)])
    out = {}
    for name, fn in (("in_use", checksum), ("sampled", sampled_checksum), ("zlib.crc32", zlib.crc32)):
        t0 = time.perf_counter()
        for pos in range(0, len(mv), block_size):
            fn(mv[pos:pos + block_size])
        out[f"{name}_GBps"] = len(mv) / (time.perf_counter() - t0) / 1e9
    out["algorithm"] = CHECKSUM_ALGORITHM
    return out


def machine_info(directory: str) -> dict:
    """CPU, memory, kernel, filesystem of the bench directory, versions."""
    info = {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
            "torch": torch.__version__, "machine": platform.machine()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        import psutil
        info["ram_bytes"] = psutil.virtual_memory().total
        best = ("", "", "")
        real = os.path.realpath(directory)
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best[1]):
                    best = (dev, mnt, fstype)
        info["filesystem"] = {"device": best[0], "mount": best[1], "type": best[2]}
    except (OSError, StopIteration, ImportError):
        pass
    return info


def sweep(buf: torch.Tensor, path: str, repeats: int, base: IOConfig) -> tuple[IOConfig, list]:
    """Try block sizes x queue depths (x threads, when the threads carry the blocks); best by
    geometric mean of read and write."""
    results = []
    aio = backend_name(base) == "aio"
    for bs in (256 << 10, 1 << 20, 4 << 20):
        for qd in (8, 16, 32):
            # with aio the threads only carry unaligned pieces: not worth sweeping
            for threads in ((min(base.threads, qd),) if aio else (4, 8, 16, 32)):
                if threads > qd:
                    continue
                cfg = IOConfig(block_size=bs, queue_depth=qd, threads=threads, direct=base.direct,
                               checksum=base.checksum, backend=base.backend)
                r = measure([EngineContender(cfg, buf, path)], buf.numel(), repeats)["io_engine"]
                score = (r["read_GBps"] * r["write_GBps"]) ** 0.5
                results.append({"block_size": bs, "queue_depth": qd, "threads": threads,
                                "read_GBps": r["read_GBps"], "write_GBps": r["write_GBps"],
                                "score": score})
                print(f"  bs={bs >> 10:5d}KiB qd={qd:3d} threads={threads:3d}: read "
                      f"{r['read_GBps']:.2f} write {r['write_GBps']:.2f} GB/s", flush=True)
    top = max(results, key=lambda r: r["score"])
    best = IOConfig(block_size=top["block_size"], queue_depth=top["queue_depth"],
                    threads=top["threads"], direct=base.direct, checksum=base.checksum,
                    backend=base.backend)
    return best, results


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m io_engine.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    default = IOConfig()
    p.add_argument("--dir", required=True, help="directory on the disk to measure (created)")
    p.add_argument("--size", default="1GiB", help="bytes per transfer (default 1GiB)")
    p.add_argument("--block-size", default=None, help=f"default {format_size(default.block_size)}")
    p.add_argument("--queue-depth", type=int, default=default.queue_depth)
    p.add_argument("--threads", type=int, default=default.threads)
    p.add_argument("--backend", default=default.backend, choices=BACKENDS,
                   help="how blocks reach the disk (default auto: kernel AIO where available)")
    p.add_argument("--buffered", action="store_true", help="no O_DIRECT for the engine")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compare", default="fio,naive,swap",
                   help="comma list of fio, naive, swap (checksummed SwapSpace); '' for none")
    p.add_argument("--sweep", action="store_true", help="tune block size, queue depth, threads")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--keep", action="store_true", help="keep the data files")
    a = p.parse_args(argv)
    try:
        size = parse_size(a.size, "--size")
        block_size = parse_size(a.block_size, "--block-size") if a.block_size else default.block_size
    except SizeError as e:
        p.error(str(e))
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    compare = {c.strip() for c in a.compare.split(",") if c.strip()}
    unknown = compare - {"fio", "naive", "swap"}
    if unknown:
        p.error(f"--compare: unknown {sorted(unknown)}; choose from fio, naive, swap")
    cfg = IOConfig(block_size=block_size, queue_depth=a.queue_depth,
                   threads=min(a.threads, a.queue_depth), direct=not a.buffered,
                   backend=a.backend)
    os.makedirs(a.dir, exist_ok=True)
    paths = {k: os.path.join(a.dir, f"io_engine_bench.{k}.dat")
             for k in ("engine", "small", "fio", "naive")}
    report: dict = {"size_bytes": size, "repeats": a.repeats, "machine": machine_info(a.dir)}
    buf = aligned_empty(size, torch.uint8, lock=True)
    _fill_random(buf)
    expected = checksum(tensor_memoryview(buf))
    try:
        if a.sweep:
            print("sweep (median of", a.repeats, "runs each):", flush=True)
            cfg, report["sweep"] = sweep(buf, paths["engine"], a.repeats, cfg)
        report["config"] = {"block_size": cfg.block_size, "queue_depth": cfg.queue_depth,
                            "threads": cfg.threads, "direct": cfg.direct,
                            "backend": backend_name(cfg)}
        contenders: list[Contender] = [EngineContender(cfg, buf, paths["engine"]),
                                       SmallBufferContender(cfg, size, paths["small"])]
        have_fio = shutil.which("fio") is not None
        fio_depths = sorted({16, 32, cfg.queue_depth})  # fio's best over depths 16-32
        if "fio" in compare and have_fio:
            contenders += [FioContender(paths["fio"], size, cfg.block_size, qd, lm)
                           for qd in fio_depths for lm in (False, True)]
        if "naive" in compare:
            contenders.append(NaiveContender(buf, paths["naive"]))
        if "swap" in compare:
            contenders.append(SwapContender(cfg, buf, a.dir))
        results = measure(contenders, size, a.repeats)
        report["io_engine"] = results["io_engine"]
        report["io_engine"]["verified"] = checksum(tensor_memoryview(buf)) == expected
        report["io_engine_small_buffer"] = results["io_engine_small_buffer"]
        for name in ("naive", "swap_checksummed"):
            if name in results:
                report[name] = results[name]
        if "fio" in compare and not have_fio:
            report["fio"] = {"skipped": "fio is not installed (apt-get install -y fio): no fio "
                                        "comparison"}
        elif "fio" in compare:
            variants = {k: v for k, v in results.items() if k.startswith("fio_")}
            report["fio"] = {}
            for d in ("read", "write"):
                best = max(variants, key=lambda k: variants[k][f"{d}_GBps"])
                report["fio"][f"{d}_GBps"] = variants[best][f"{d}_GBps"]
                report["fio"][f"{d}_best_variant"] = best
            report["fio"]["variants"] = variants
            report["fio"]["command"] = (f"fio --ioengine=libaio --direct=1 --bs={cfg.block_size} "
                                        f"--size={size} --iodepth={'|'.join(map(str, fio_depths))}"
                                        f" [--lockmem={size}] --rw=read|write")
        report["checksum"] = bench_checksum(buf, cfg.block_size)
    finally:
        if not a.keep:
            for path in paths.values():
                if os.path.exists(path):
                    os.unlink(path)
    eng = report["io_engine"]
    ratios = {}
    for name in ("fio", "naive"):
        other = report.get(name, {})
        if "read_GBps" in other:
            ratios[f"read_vs_{name}"] = eng["read_GBps"] / other["read_GBps"]
            ratios[f"write_vs_{name}"] = eng["write_GBps"] / other["write_GBps"]
    if "read_GBps" in report.get("fio", {}):
        small, fio = report["io_engine_small_buffer"], report["fio"]
        ratios["small_buffer_read_vs_fio"] = small["read_GBps"] / fio["read_GBps"]
        ratios["small_buffer_write_vs_fio"] = small["write_GBps"] / fio["write_GBps"]
    report["ratios"] = ratios
    _print(report, cfg)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


def _print(report: dict, cfg: IOConfig) -> None:
    print(f"size {report['size_bytes'] / 1e9:.3f} GB, block {format_size(cfg.block_size)}, queue depth "
          f"{cfg.queue_depth}, threads {cfg.threads}, direct {cfg.direct}, backend "
          f"{backend_name(cfg)}")
    for name in ("io_engine", "io_engine_small_buffer", "fio", "naive", "swap_checksummed"):
        r = report.get(name)
        if r is None:
            continue
        if "skipped" in r:
            print(f"  {name:22s} skipped: {r['skipped']}")
        else:
            extra = (f"   (best: read {r['read_best_variant']}, write {r['write_best_variant']})"
                     if name == "fio" else "")
            print(f"  {name:22s} read {r['read_GBps']:6.2f} GB/s   write {r['write_GBps']:6.2f} GB/s"
                  + extra)
    for k, v in report["ratios"].items():
        print(f"  {k}: {v:.3f}")
    c = report["checksum"]
    print(f"  checksum {c['algorithm']}: {c['in_use_GBps']:.2f} GB/s per thread "
          f"(sampled {c['sampled_GBps']:.2f}, zlib.crc32 {c['zlib.crc32_GBps']:.2f})")
    if "sweep" in report:
        print("best config:\n[io]")
        print(f'block_size = "{format_size(cfg.block_size)}"\nqueue_depth = {cfg.queue_depth}\n'
              f"threads = {cfg.threads}\ndirect = {str(cfg.direct).lower()}\n"
              f'backend = "{backend_name(cfg)}"')


if __name__ == "__main__":
    main()
    sys.exit(0)
