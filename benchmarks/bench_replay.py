"""Replay one training step's own NVMe requests with no compute, alone and beside a compute load.

    python benchmarks/bench_replay.py --dir /path/on/nvme --json replay.json
    python benchmarks/bench_replay.py --dir /path/on/nvme --reps 6 --set io.queue_depth=64

bench_step's I/O floor divides a step's bytes by io_engine's rate on one large
sequential request. When a step on NVMe is slower than that floor, two things can
be at fault: the step's access pattern (hundreds of chunk-sized requests over
several swap files, reads and writes mixed) or the CPU its compute takes from the
I/O path (submission, completions, checksums; on a small VM the disk's interrupts
too). This separates them. It trains `--placement` (default nvme/host/nvme) for
warm-up steps, records every request the engine hands io_engine during one steady
step (a step pays its predecessor's overlapped update, as in bench_step), then
replays exactly those requests (direction, file, offset, size, urgency, checksums)
on scratch copies of the swap files, all queued at once in the recorded order:

- `alone`: nothing else running;
- `hog`: beside a `--hog-threads`-thread matmul process (a stand-in for compute
  that never yields: harsher than a step, whose compute pauses).

Arms alternate within each repetition (the disk drifts within seconds), the hog
starting a second before its arm. Reported: the step, its bytes, each arm's
replay times and median, and the median of the per-repetition ratios hog / alone.
A replay near the burst floor says the pattern is not the loss; `hog` well above
`alone` says CPU contention is.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import bench_step  # noqa: E402  (the same model, batch, config and engine as bench_step)
import step_floors  # noqa: E402
import step_systems  # noqa: E402

HOG = ("import torch, sys\ntorch.set_num_threads(int(sys.argv[1]))\na = torch.randn(1024, 1024)\n"
       "while True:\n    a = (a @ a).mul_(1e-3)\n")
FILL_REQUEST = 1 << 30


def record_step(args, swap: str) -> tuple[list[dict], dict[str, int], float, dict]:
    """Warm up, then record the io_engine requests issued during one steady step. Returns (requests,
    swap file sizes, step_s, the plan's bytes per steady step)."""
    from io_engine.engine import Direction
    engine = step_systems.infinity_engine(args, args.placement, swap)
    step = step_systems.engine_step(engine)
    data = step_systems.batches(args, step_systems.model_config(args), timed=2)
    recorded: list[dict] | None = None
    submit = engine.io.submit

    def recording(direction, tensor, path, offset, **kw):
        if recorded is not None:
            recorded.append({"direction": Direction(direction).value, "path": path, "offset": offset,
                             "num_bytes": tensor.numel() * tensor.element_size(),
                             "urgent": kw.get("urgent", False), "pad_tail": kw.get("pad_tail", False)})
        return submit(direction, tensor, path, offset, **kw)

    engine.io.submit = recording  # this engine's only: the instrument of this benchmark
    try:
        for x, y in data[:-1]:
            step(x, y)  # warm-up, then one step so that the recorded one pays an overlapped update
        recorded = []
        t = time.perf_counter()
        step(*data[-1])
        step_s = time.perf_counter() - t
        # start to end, as bench_step times a step: the predecessor's update tail in, its own tail out
        requests, recorded = recorded, None
        planned = step_systems.steady_bytes_per_step(engine)
        engine.synchronize()
        sizes = {p: os.path.getsize(p) for p in engine.swap.files}
    finally:
        engine.close()
    return requests, sizes, step_s, planned


def scratch_copies(io, sizes: dict[str, int], scratch: str, buf) -> dict[str, str]:
    """Same-sized files in `scratch`, written through (a replay overwrites extents, as a step does)."""
    files = {}
    for path, size in sizes.items():
        files[path] = os.path.join(scratch, os.path.basename(path))
        for off in range(0, size, FILL_REQUEST):
            n = -(-min(FILL_REQUEST, size - off) // 4096) * 4096
            io.submit("write", buf[:n], files[path], off).wait()
    return files


def replay(io, requests: list[dict], files: dict[str, str], buf, checksum: str) -> float:
    """Queue every request at once, in the recorded order; seconds until the last lands."""
    t = time.perf_counter()
    futures = []
    for r in requests:
        kw = {"pad_tail": r["pad_tail"], "checksum": checksum}
        if r["direction"] == "read":
            kw["urgent"] = r["urgent"]
        else:
            kw["create"] = False
        futures.append(io.submit(r["direction"], buf[:r["num_bytes"]], files[r["path"]], r["offset"], **kw))
    for f in futures:
        f.wait()
    return time.perf_counter() - t


def run(args) -> dict:
    import torch
    from common import machine, median

    from io_engine import IOEngine, aligned_empty
    torch.set_num_threads(args.threads)
    swap = tempfile.mkdtemp(prefix="bench-replay-", dir=args.dir)
    scratch = tempfile.mkdtemp(prefix="bench-replay-copy-", dir=args.dir)
    try:
        requests, sizes, step_s, planned = record_step(args, swap)
        shutil.rmtree(swap, ignore_errors=True)
        largest = max(max(r["num_bytes"] for r in requests), min(FILL_REQUEST, max(sizes.values())))
        buf = aligned_empty(largest + 8192, torch.uint8)  # one buffer for every request: only timing matters
        buf.fill_(1)
        config = step_floors.io_engine_config(args)
        times: dict[str, list[float]] = {"alone": [], "hog": []}
        with IOEngine(config) as io:
            files = scratch_copies(io, sizes, scratch, buf)
            for rep in range(args.reps):
                for arm in ("alone", "hog") if rep % 2 == 0 else ("hog", "alone"):
                    hog = (subprocess.Popen([sys.executable, "-c", HOG, str(args.hog_threads)])
                           if arm == "hog" else None)
                    try:
                        if hog is not None:
                            time.sleep(1.0)  # the load running before the first request
                        times[arm].append(round(replay(io, requests, files, buf, config.checksum), 3))
                    finally:
                        if hog is not None:
                            hog.kill()
                            hog.wait()
    finally:
        shutil.rmtree(swap, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    read = sum(r["num_bytes"] for r in requests if r["direction"] == "read")
    written = sum(r["num_bytes"] for r in requests if r["direction"] == "write")
    return {
        "machine": machine(), "placement": args.placement, "io_config": str(config),
        "step_s": round(step_s, 3), "requests": len(requests), "read_bytes": read, "write_bytes": written,
        "planned_bytes_per_step": planned,
        "replay_s": times, "median_s": {arm: round(median(v), 3) for arm, v in times.items()},
        "hog_over_alone": round(median([h / a for h, a in zip(times["hog"], times["alone"])]), 3),
    }


UNUSED = ("systems", "steps", "paired_blocks", "io_bytes", "io_sustained_bytes", "ds_param_buffers", "profile",
          "timeout", "worker")  # bench_step's options that mean nothing here


def parser() -> argparse.ArgumentParser:
    ap = bench_step.parser()  # the model, batch, threads and --set of bench_step
    ap.description = __doc__
    ap.add_argument("--placement", default="nvme/host/nvme", help="infinity's P/G/O tiers (some on NVMe)")
    ap.add_argument("--reps", type=int, default=4, help="repetitions of the two arms, alternating")
    ap.add_argument("--hog-threads", type=int, default=2, help="threads of the compute load")
    return ap


def main(argv=None) -> dict:
    from common import write_json
    ap = parser()
    args = ap.parse_args(argv)
    unused = [f"--{k.replace('_', '-')}" for k in UNUSED if getattr(args, k) != ap.get_default(k)]
    if unused:
        raise SystemExit(f"bench_replay does not use {', '.join(unused)} (bench_step's options): drop them")
    if not args.dir:
        raise SystemExit("--dir is required: a directory on the disk under test (swap files and their copies)")
    if "nvme" not in args.placement:
        raise SystemExit(f"--placement {args.placement} puts nothing on NVMe: there is no I/O to replay")
    out = run(args)
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
