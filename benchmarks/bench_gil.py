"""io_engine write throughput while another thread keeps the GIL busy, at several switch intervals.

Every I/O block completion runs Python (the engine's bookkeeping), so it needs the GIL.
A training thread that runs Python between short torch ops holds it for up to the
interpreter's switch interval (5 ms by default) at a time, while the disk moves a 1 MiB
block in ~0.3 ms. This measures that cost and why the engine sets
`[io] switch_interval_us` (Note [switch interval] in infinity/runtime/engine.py):

    python benchmarks/bench_gil.py --dir /tmp/benchdisk --json gil.json

For each interval, with the busy thread running pure Python (the worst case) and
small torch ops (closer to a forward with hooks): write `--size` bytes as 32 MiB
requests with 4 in flight (the optimizer's write-behind pattern). Median of
`--repeats` runs, decimal GB/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections import deque

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from common import machine, write_json  # noqa: E402

from io_engine import (  # noqa: E402
    IOConfig,
    IOEngine,
    aligned_empty,
    fsync_file,  # noqa: E402
    parse_size,
)


def _busy(kind: str, stop: threading.Event) -> None:
    if kind == "python":
        while not stop.is_set():
            sum(range(100))
    else:
        x, w = torch.randn(64, 1024), torch.randn(1024, 1024)
        while not stop.is_set():
            (x @ w).relu_().mul_(0.5).add_(1.0).sum()


def write_GBps(io: IOEngine, buf: torch.Tensor, path: str, request: int) -> float:
    step = request // buf.element_size()
    pending: deque = deque()
    t0 = time.perf_counter()
    for i in range(buf.numel() // step):
        pending.append(io.submit_write(buf[i * step:(i + 1) * step], path, i * request))
        while len(pending) > 4:
            pending.popleft().wait()
    for f in pending:
        f.wait()
    fsync_file(path)
    return buf.numel() * buf.element_size() / (time.perf_counter() - t0) / 1e9


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="directory on the disk under test")
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--intervals-us", default="5000,500", help="switch intervals to compare (5000 is Python's default)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    size = parse_size(args.size)
    buf = aligned_empty(size // 4, torch.float32)
    buf.fill_(1.0)
    path = os.path.join(args.dir, f"bench-gil-{os.getpid()}.bin")
    saved = sys.getswitchinterval()
    results: dict = {}
    try:
        with IOEngine(IOConfig(block_size=1 << 20, queue_depth=16, threads=8)) as io:
            write_GBps(io, buf, path, 32 << 20)  # allocate the file and warm up
            for busy in ("python", "torch"):
                for interval in (int(v) for v in args.intervals_us.split(",")):
                    sys.setswitchinterval(interval * 1e-6)
                    stop = threading.Event()
                    thread = threading.Thread(target=_busy, args=(busy, stop), daemon=True)
                    thread.start()
                    runs = [write_GBps(io, buf, path, 32 << 20) for _ in range(args.repeats)]
                    stop.set()
                    thread.join()
                    results[f"{busy}_busy_{interval}us"] = {"write_GBps": round(statistics.median(runs), 3),
                                                           "runs_GBps": [round(r, 3) for r in runs]}
                    print(f"busy thread {busy:6s} switch interval {interval:5d} us: "
                          f"{statistics.median(runs):.2f} GB/s (runs {', '.join(f'{r:.2f}' for r in runs)})")
    finally:
        sys.setswitchinterval(saved)
        if os.path.exists(path):
            os.remove(path)
    out = {"benchmark": "gil", "machine": machine(), "size_bytes": size, "results": results}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
