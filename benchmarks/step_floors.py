"""bench_step.py's floors: the I/O floor (burst and sustained samples of the disk under --dir), the paired runs
(each step beside samples of its own), and the ratios the driver reports (floors, stages, peers)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from step_systems import batches, engine_step, infinity_config, infinity_engine, model_config, steady_bytes_per_step

SUSTAINED_REQUEST = 64 << 20  # the sustained sample's request size: a unit's shard is tens of MiB


def io_engine_config(args):
    """io_engine's settings as the infinity systems run it (their `[io]`, `--set io.*` included)."""
    import infinity
    return infinity.Config.from_dict(infinity_config(args, "auto", args.dir)).io.engine_config()


def burst_sample(args, io, path: str, buf=None) -> dict:
    """The I/O floor's sample on an open IOEngine: `--io-bytes` written then read at `path` as one
    request, twice, the faster pass of each direction kept. `buf`: an aligned buffer of that size
    to reuse (default: one allocated here)."""
    import torch

    from io_engine import aligned_empty
    if buf is None:
        buf = aligned_empty(args.io_bytes // 4, torch.float32)
        buf.fill_(1.0)
    out = {}
    for direction in ("write", "read", "write", "read"):
        t = time.perf_counter()
        (io.submit_write if direction == "write" else io.submit_read)(buf, path, 0).wait()
        gbps = args.io_bytes / (time.perf_counter() - t) / 1e9
        out[f"{direction}_GBps"] = max(out.get(f"{direction}_GBps", 0), gbps)
    return out


def run_io_floor(args) -> dict:
    """io_engine's read / write bandwidth on the swap directory, now.

    The burst sample (the I/O floor's): `--io-bytes` (1 GiB) written then read as one
    request, twice, the faster pass of each direction kept. The sustained sample
    (`--io-sustained-bytes`, default 4 GiB; 0 skips it): that many bytes written (untimed:
    a step overwrites extents written before, it does not extend files), overwritten,
    then read back, in 64 MiB requests all queued at once, as a step's update and
    read-ahead stream them, once each; it sees a disk that slows down under sustained
    load where the burst sample would not, and carries no best-of-two.
    """
    import torch

    from io_engine import IOEngine, aligned_empty
    path = os.path.join(args.dir, f"bench-io-{os.getpid()}.bin")
    try:
        with IOEngine(io_engine_config(args)) as io:
            out = burst_sample(args, io, path)
            if args.io_sustained_bytes:
                size = min(SUSTAINED_REQUEST, args.io_sustained_bytes)
                requests = max(1, args.io_sustained_bytes // size)
                chunk = aligned_empty(size // 4, torch.float32)
                chunk.fill_(1.0)
                for direction in ("fill", "write", "read"):  # fill: a step overwrites its swap extents
                    submit = io.submit_read if direction == "read" else io.submit_write
                    t = time.perf_counter()
                    for f in [submit(chunk, path, i * size) for i in range(requests)]:
                        f.wait()
                    gbps = requests * size / (time.perf_counter() - t) / 1e9
                    if direction != "fill":
                        out[f"sustained_{direction}_GBps"] = gbps
    finally:
        os.remove(path)
    return out


def run_paired(args, placement: str) -> dict:
    """Steps of `infinity:<placement>` each bracketed by I/O samples taken seconds before and after it.

    The disk's speed drifts within minutes here, and a sample taken a minute away from the
    steps may see another disk. So, after warm-up: `--paired-blocks` times, drain the
    engine (nothing of ours in flight), take the burst sample (`burst_sample`, the I/O
    floor's), run one untimed step (after a drain it starts without its predecessor's
    overlap) and one timed step (it pays its predecessor's overlapped update, as a steady
    step does); a last drain and sample close the last block. Block i's step lies between
    samples i and i+1; the driver (`floors`) puts it over the floor of each and reports
    the median ratio. Its own process: the sample's buffer is not in the system's peak RSS.
    """
    import torch
    from common import DiskCounters

    from io_engine import IOEngine, aligned_empty
    swap = tempfile.mkdtemp(prefix="bench-paired-", dir=args.dir)
    engine = infinity_engine(args, placement, swap)
    step = engine_step(engine)
    data = batches(args, model_config(args), timed=2 * args.paired_blocks)
    path = os.path.join(args.dir, f"bench-io-{os.getpid()}.bin")
    counters = DiskCounters(args.dir)
    samples, steps = [], []
    try:
        buf = aligned_empty(args.io_bytes // 4, torch.float32)
        buf.fill_(1.0)
        with IOEngine(io_engine_config(args)) as io:
            for x, y in data[:args.warmup]:
                step(x, y)
            blocks = iter(data[args.warmup:])

            def sample() -> None:
                # settled: the update done and the state read-ahead paused (a plain synchronize()
                # resumes it), so the sample has the disk to itself; `disk` shows what else it saw
                with engine.updates.settled():
                    before = counters.snapshot()
                    samples.append(burst_sample(args, io, path, buf))
                    samples[-1]["disk"] = counters.between(before, counters.snapshot())

            for _ in range(args.paired_blocks):
                sample()
                step(*next(blocks))  # untimed: no predecessor in flight
                before, t = counters.snapshot(), time.perf_counter()
                step(*next(blocks))
                steps.append({"step_s": round(time.perf_counter() - t, 3),
                              "disk": counters.between(before, counters.snapshot())})
            sample()
        return {"samples": samples, "steps": steps, "bytes_moved_per_step": steady_bytes_per_step(engine)}
    finally:
        engine.close()
        shutil.rmtree(swap, ignore_errors=True)
        if os.path.exists(path):
            os.remove(path)


def stage_ratios(results: dict) -> dict:
    """Issue 23's comparisons, for each infinity system at stage 2 (`@2`): its step over its `@3` twin's, over
    DeepSpeed ZeRO-2 offload's (`deepspeed:cpu_opt@2`) and over FSDP2 CPU offload's; the bars: < 1 and <= 0.8."""
    out = {}
    for name, r in results.items():
        if not (name.startswith("infinity:") and name.endswith("@2") and r.get("step_s")):
            continue
        twins = {f"{name} / {name[:-2]}@3": (name[:-2] + "@3", 1.0, False),
                 f"{name} / deepspeed:cpu_opt@2": ("deepspeed:cpu_opt@2", 0.8, True),
                 f"{name} / fsdp2:cpu_both": ("fsdp2:cpu_both", None, True)}
        for label, (other, bar, inclusive) in twins.items():
            theirs = results.get(other, {}).get("step_s")
            if theirs:
                ratio = r["step_s"] / theirs
                out[label] = {"step_ratio": round(ratio, 3)}
                if bar is not None:
                    out[label].update(bar=("<= " if inclusive else "< ") + str(bar),
                                      met=ratio <= bar if inclusive else ratio < bar)
    return out


def on_nvme(name: str) -> bool:
    return name.startswith("infinity:") and "nvme" in name


def paired_name(name: str) -> str:
    """The run_paired worker of system `infinity:<placement>`."""
    return "paired:" + name.partition(":")[2]


def io_median(samples: list[dict]) -> dict:
    """The median read / write bandwidth over the samples taken so far (failed samples skipped)."""
    from common import median
    out = {"samples": samples}
    for d in ("read_GBps", "write_GBps", "sustained_read_GBps", "sustained_write_GBps"):
        values = [x[d] for x in samples if d in x]
        if values:
            out[d] = median(values)
    if len(out) == 1:
        out["error"] = samples[-1].get("error", "no sample")
    return out


def floors_of(results: dict) -> dict:
    """For each infinity placement with NVMe: compute floor, I/O floor, and the ratio to the max."""
    io = results.get("io", {})
    compute = results.get("infinity:device/device/device", {}).get("step_s")
    out = {}
    for name, r in results.items():
        if not on_nvme(name) or "step_s" not in r or not io.get("read_GBps"):
            continue
        moved = r.get("bytes_moved_per_step", {})

        def io_floor_of(rates: dict, prefix: str = "") -> float:
            return (moved.get("nvme_read", 0) / 1e9 / rates[prefix + "read_GBps"]
                    + moved.get("nvme_write", 0) / 1e9 / rates[prefix + "write_GBps"])

        def ratio(rates: dict, prefix: str = "") -> tuple[float, float | None]:
            io_floor = io_floor_of(rates, prefix)
            floor = max(compute or 0, io_floor)
            return round(io_floor, 3), round(r["step_s"] / floor, 3) if floor else None

        io_floor, over = ratio(io)
        out[name] = {"compute_floor_s": compute, "io_floor_s": io_floor, "step_over_floor": over}
        first = next((x for x in io.get("samples", []) if "read_GBps" in x), None)
        if first is not None:
            out[name]["io_floor_first_sample_s"], out[name]["step_over_floor_first_sample"] = ratio(first)
        if io.get("sustained_read_GBps") and io.get("sustained_write_GBps"):  # beside the floor, not instead of it
            out[name]["io_floor_sustained_s"], out[name]["step_over_sustained_floor"] = ratio(io, "sustained_")
        paired = paired_floor(results.get(paired_name(name), {}), compute, io_floor_of)
        if paired:
            out[name]["paired"] = paired
        disk = r.get("disk", {})
        if disk.get("busy_fraction") is not None:
            out[name]["disk_busy_fraction"] = disk["busy_fraction"]  # of the timed steps: see timed_loop
    return out


def paired_floor(paired: dict, compute: float | None, io_floor_of) -> dict:
    """run_paired's steps over their own floors: block i's I/O floor is the mean of the I/O
    floors (`io_floor_of(sample)`) of samples i and i+1, taken just before and just after its
    step; the floor is the larger of that and the compute floor. The medians over the blocks,
    and each block's I/O floor and ratio."""
    from common import median
    steps, samples = paired.get("steps", []), paired.get("samples", [])
    if not steps or len(samples) != len(steps) + 1:
        return {"error": paired["error"]} if "error" in paired else {}
    io_floors, ratios = [], []
    for i, s in enumerate(steps):
        io_floor = (io_floor_of(samples[i]) + io_floor_of(samples[i + 1])) / 2
        io_floors.append(round(io_floor, 3))
        floor = max(compute or 0, io_floor)
        ratios.append(round(s["step_s"] / floor, 3) if floor else None)
    timed = [r for r in ratios if r is not None]
    return {"step_s": round(median([s["step_s"] for s in steps]), 3), "io_floor_s": round(median(io_floors), 3),
            "step_over_floor": round(median(timed), 3) if timed else None, "ratios": ratios, "io_floors_s": io_floors}


def peer_ratios(results: dict) -> dict:
    pairs = {"nvme_opt vs deepspeed": ("infinity:device/host/nvme", "deepspeed:nvme_opt"),
             "nvme_both vs deepspeed": ("infinity:nvme/host/nvme", "deepspeed:nvme_both"),
             "cpu_both vs deepspeed": ("infinity:host/host/host", "deepspeed:cpu_both"),
             "cpu_opt vs deepspeed": ("infinity:device/device/host", "deepspeed:cpu_opt"),
             "cpu_both vs fsdp2": ("infinity:host/host/host", "fsdp2:cpu_both")}
    out = {}
    for label, (ours, theirs) in pairs.items():
        a, b = results.get(ours, {}), results.get(theirs, {})
        if a.get("step_s") and b.get("step_s"):
            out[label] = {"step_ratio": round(a["step_s"] / b["step_s"], 3),
                          "rss_ratio": round(a["peak_rss_GiB"] / b["peak_rss_GiB"], 3)}
    return out


