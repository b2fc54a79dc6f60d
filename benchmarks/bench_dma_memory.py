"""O_DIRECT throughput of io_engine by the kind of memory on the other end (Note [unsharded memory]).

    python benchmarks/bench_dma_memory.py --dir /path/on/nvme --size 256MiB --repeats 5 --json dma.json

The same file range is read into (and written from), in rotating order per repetition:
  pooled       an `aligned_empty` mapping made as PooledUnshardedMemory makes one (page-aligned,
               huge-page advised, not mlock'ed: locked and unlocked warm memory measured equal), reused
  huge_fresh   a new huge-page advised mapping each time (not locked, never touched before)
  torch_fresh  a new `torch.empty` each time (what `storage.resize_` gives an unsharded unit)
  torch_warm   a `torch.empty` filled once, reused
torch's CPU allocator puts data 64 bytes past a page boundary, so the two torch kinds cannot be
O_DIRECT targets: io_engine moves them through a worker's bounce buffer (DMA into a small, hot
buffer, then a memcpy on the worker). The JSON records each kind's address modulo 4096.
Decimal GB/s, the median over --repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from common import machine, write_json  # noqa: E402

from io_engine import IOConfig, IOEngine, aligned_empty, parse_size  # noqa: E402

KINDS = ("pooled", "huge_fresh", "torch_fresh", "torch_warm")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="directory on the disk to measure")
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    size = parse_size(args.size)
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, f"bench-dma-{os.getpid()}.bin")
    pooled = aligned_empty(size, torch.uint8, pin=False, lock=False)  # as infinity.memory.buffers makes them
    pooled.fill_(3)
    warm = torch.empty(size, dtype=torch.uint8)
    warm.fill_(3)
    buffers = {"pooled": lambda: pooled, "torch_warm": lambda: warm,
               "huge_fresh": lambda: aligned_empty(size, torch.uint8, pin=False, lock=False),
               "torch_fresh": lambda: torch.empty(size, dtype=torch.uint8)}
    runs = {f"{k}_{d}": [] for k in KINDS for d in ("read", "write")}
    offsets = {}
    try:
        with IOEngine(IOConfig()) as io:
            io.submit_write(pooled, path, 0).wait()  # lay the file out
            for rep in range(args.repeats):
                k = rep % len(KINDS)
                for kind in KINDS[k:] + KINDS[:k]:
                    for direction in ("read", "write"):
                        buf = buffers[kind]()
                        offsets.setdefault(kind, buf.data_ptr() % 4096)
                        t = time.perf_counter()
                        (io.submit_read if direction == "read" else io.submit_write)(buf, path, 0).wait()
                        runs[f"{kind}_{direction}"].append(size / (time.perf_counter() - t) / 1e9)
                        del buf
    finally:
        if os.path.exists(path):
            os.remove(path)
    results = {name: {"median_GBps": round(statistics.median(v), 3), "runs_GBps": [round(x, 3) for x in v]}
               for name, v in runs.items()}
    for name, r in results.items():
        print(f"{name:18s} {r['median_GBps']:.2f} GB/s   {' '.join(f'{x:.2f}' for x in r['runs_GBps'])}")
    payload = {"benchmark": "dma_memory", "machine": machine(), "size_bytes": size, "repeats": args.repeats,
               "address_mod_4096": offsets, "results": results}
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
