"""Step time of infinity beside plain PyTorch, DeepSpeed ZeRO-3 and FSDP2, on the same model and batch.

    python benchmarks/bench_step.py --dir /path/on/nvme --json step.json
    python benchmarks/bench_step.py --systems torch,infinity:nvme/host/nvme --steps 4
    python benchmarks/bench_step.py --dir /path/on/nvme --device-budget 2GiB --host-budget 2GiB \
        --systems infinity:auto,infinity:fitting --json auto.json     # auto vs the best static placement
    python benchmarks/bench_step.py --world 2 --systems \
        infinity:device/host/host@2,infinity:device/host/host@3,deepspeed:cpu_opt@2,fsdp2:cpu_both  # issue 23

Every system runs in its own process (so its peak RSS is its own), world size 1
unless `--world N` (then N processes under torchrun, gloo on the CPU, `--threads`
per rank: default 2 // N; each rank its own batches; rank 0's step times are reported,
every rank's peak RSS), the same GPT, data, AdamW hyper-parameters, gradient clipping
and thread count.
Reported per system: median step time over the timed steps (after warm-up; a step
runs from its start to the next one's, so infinity's overlapped update is paid by
the step it overlaps, and infinity runs one untimed step more and then drains its
update: `tail_s`),
peak RSS, overlap efficiency (infinity's profiler, when enabled), bytes moved per
step, and the ratio to the in-RAM PyTorch baseline. With infinity on NVMe the
floors are computed in the same run: the compute floor is infinity with all state
on the device tier; the I/O floor is the bytes the plan moves per step over
io_engine's read and write bandwidth, measured on the same directory in this run
(reads and writes share the disk, so the floor adds the two times): the median of
samples taken at the start and right after each infinity placement on NVMe, since
a shared disk's speed drifts within minutes (the first sample's floor is reported too).
Beside it, not instead of it: the floor from a sustained sample (4 GiB each way in
64 MiB requests, `io_floor_sustained_s`), what the disk did during the timed steps
(`disk`: its busy fraction and rates, from the kernel's counters), and the paired
floor (`paired`, `--paired-blocks`; run_paired): the system's steps run again in a
process of their own, each between two burst samples taken seconds before and after
it, each step over the floor of its own samples, the median of those ratios.

System names: `torch`, `infinity:PARAMS/GRADS/OPTIMIZER` (tiers), `infinity:auto`
(`placement.policy = "auto"`; its plan, tier counts per state kind and reasons are
recorded), `infinity:fitting` (expanded by the driver, before any worker starts, into
every static placement `infinity:P/G/O` whose plan fits the budgets, planned on the
meta device by the planner `initialize` uses; the others are listed with the
planner's reason, not run), `deepspeed:OFFLOAD` and `fsdp2:OFFLOAD` with OFFLOAD one
of none | cpu_opt | cpu_both | nvme_opt | nvme_both. DeepSpeed and FSDP2 are skipped
(with the reason) when not installed or failing; an infinity placement that does not
fit fails with the planner's message.

ZeRO stages: a system name ending in `@S` runs at stage S (`infinity:device/host/host@2`:
`zero.stage = 2`; `deepspeed:cpu_opt@2`: DeepSpeed ZeRO-2 with the optimizer on the CPU,
i.e. ZeRO-Offload; DeepSpeed offloads parameters only at stage 3); `--zero-stage S` is
the stage of every infinity and DeepSpeed system without a suffix (default: infinity's
`zero.stage` default, DeepSpeed stage 3). FSDP2 is always fully sharded (stage 3) and
`torch` at `--world` > 1 is DDP. With stage suffixes in the run, `stage_ratios` compares
each infinity `@2` system with its `@3` twin, with `deepspeed:cpu_opt@2` and with
`fsdp2:cpu_both` (issue 23's bar: stage 2 faster than stage 3, <= 0.8 x ZeRO-2 offload).
A `@KEY=VALUE` suffix sets one engine key for that system only: the default systems include
`infinity:nvme/host/nvme@optimizer.state_dtype=bf16` (16-bit optimizer moments, docs/bytes.md), whose
`bytes_moved_per_step` and step sit beside the fp32 state's `infinity:nvme/host/nvme`.

`--device-budget` / `--host-budget` set infinity's `memory.device_budget` /
`memory.host_budget` (default "auto": the free memory detected). Without a GPU the
device tier is RAM too, so both are needed to make everything-on-device not fit.
With `infinity:auto` the payload's `auto_vs_static` compares auto's step with the
best static placement that fits (issue 5's bar: a ratio <= 1.10). `AUTO_BUDGETS`,
2GiB / 2GiB, suit the default 311M-parameter model (fp32: 1.16 GiB of parameters,
1.16 GiB of gradients, 3.47 GiB of optimizer state): everything on host needs
5.79 GiB of host, everything on device 6.06 GiB of device, and the 7 placements
that fit all keep the optimizer state on NVMe (device/host, host/device,
device/nvme, host/nvme, nvme/device, nvme/host and nvme/nvme for params/grads);
auto mixes tiers per unit. They are the default when `infinity:auto` or
`infinity:fitting` is asked for without budgets (`--device-budget auto --host-budget
auto` for the free memory detected).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

DEFAULT_SYSTEMS = [
    "torch",
    "infinity:device/device/device", "infinity:device/device/host", "infinity:host/host/host",
    "infinity:device/host/nvme", "infinity:nvme/host/nvme",
    "infinity:nvme/host/nvme@optimizer.state_dtype=bf16",  # 8 of the 12 optimizer bytes (docs/bytes.md)
    "deepspeed:none", "deepspeed:cpu_opt", "deepspeed:cpu_both", "deepspeed:nvme_opt", "deepspeed:nvme_both",
    "fsdp2:none", "fsdp2:cpu_both",
]
TIERS = ("device", "host", "nvme")
STATIC_PLACEMENTS = tuple(f"{p}/{g}/{o}" for p in TIERS for g in TIERS for o in TIERS)  # all 27
AUTO_BUDGETS = ("2GiB", "2GiB")  # --device-budget, --host-budget for the default model (docstring)


def rank() -> int:
    """This worker's rank under torchrun (0 alone)."""
    return int(os.environ.get("RANK", "0"))


def with_stage(option: str, default: int | None) -> tuple[str, int | None]:
    """`OPTION@S` -> (OPTION, S); without a suffix, (OPTION, `default`: --zero-stage)."""
    option, at, stage = option.partition("@")
    return option, int(stage) if at else default


def model_config(args):
    from infinity.models.gpt import GPTConfig
    return GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=args.heads,
                     d_model=args.d_model)


def optimizer_args(args) -> dict:
    return {"lr": args.lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def batches(args, cfg, trailing: int = 0, timed: int | None = None):
    """Warm-up + timed (default `--steps`) batches (+ `trailing` untimed ones), the same for every system
    (each rank of `--world` its own: seeded by the rank)."""
    import torch

    from infinity.models.gpt import synthetic_batch
    g = torch.Generator().manual_seed(1 + rank())
    timed = args.steps if timed is None else timed
    return [synthetic_batch(cfg, args.batch, g) for _ in range(args.warmup + timed + trailing)]


def timed_loop(args, step_fn, data, drain=None) -> dict:
    """Run warm-up + timed steps; step_fn(x, y) -> loss float.

    A step's time runs from its start to the next one's start, so work a system leaves
    in flight (infinity's overlapped update) is paid by the step that waits for it: the
    steady state of a long run. With `drain` (a system that overlaps), `data` holds one
    more batch than warm-up + timed: that trailing step gives the last timed one its
    successor, and `drain()` then waits for what the trailing step left. The trailing
    step plus the drain is reported as `tail_s`, outside the median: a run's end pays
    once for the update no later step overlaps (issue 4's bar is about the steady step;
    before 2026-11-22 the drain was counted in the last timed step).

    `disk`: what the block device under `--dir` did from the first timed step's start to
    the last one's end (common.DiskCounters): how much of that time it had requests in
    flight, and at what rates. A step that keeps the disk busy all along cannot go faster
    than the disk goes at that time, whatever a sample taken before or after says.
    """
    from common import DiskCounters, median, peak_rss_bytes
    times, losses = [], []
    timed_end = len(data) - (1 if drain is not None else 0)
    tail_s = None
    counters = DiskCounters(args.dir)
    disk_before = disk_after = None  # the timed steps' window
    for i, (x, y) in enumerate(data):
        if i == args.warmup:
            disk_before = counters.snapshot()
        if i == timed_end:
            disk_after = counters.snapshot()
        t = time.perf_counter()
        losses.append(step_fn(x, y))
        if i == timed_end:  # the trailing step
            drain()
            tail_s = time.perf_counter() - t
        elif i >= args.warmup:
            times.append(time.perf_counter() - t)
    if drain is None:  # no trailing step: the window ends with the loop
        disk_after = counters.snapshot()
    out = {"step_s": median(times), "step_times": [round(t, 3) for t in times], "losses": losses,
           "peak_rss_GiB": round(peak_rss_bytes() / 2**30, 3), "disk": counters.between(disk_before, disk_after)}
    if tail_s is not None:
        out["tail_s"] = round(tail_s, 3)
    return out


# ----------------------------------------------------------------------------------------- workers
def plain_step(args, model, opt):
    """One training step of a plain PyTorch model and optimizer (the baseline, and FSDP2), with clipping."""
    import torch

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)
    return step


def run_torch(args) -> dict:
    import torch

    from infinity.models.gpt import GPT
    cfg = model_config(args)
    torch.manual_seed(0)
    model = GPT(cfg)
    if args.world > 1:  # plain data parallelism: DDP over gloo
        from infinity.device.process_group import init_process_group
        init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), fused=True, **optimizer_args(args))
    try:
        return timed_loop(args, plain_step(args, model, opt), batches(args, cfg))
    finally:
        if args.world > 1:
            torch.distributed.destroy_process_group()


def infinity_config(args, placement: str, swap: str) -> dict:
    """The engine config of system `infinity:<placement>` ("P/G/O" tiers, or "auto", optionally "@S" for
    ZeRO stage S) with swap files in `swap`. `@KEY=VALUE` suffixes add engine keys to that system only (two
    systems side by side, e.g. `infinity:host/host/host,infinity:host/host/host@activation.checkpoint=units`)."""
    placement, *suffixes = placement.split("@")
    own_set = [x for x in suffixes if "=" in x]
    placement, stage = with_stage("@".join([placement, *(x for x in suffixes if "=" not in x)]), args.zero_stage)
    config = {
        "optimizer": {"name": "adamw", "lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                      "grad_clip": args.clip},
        "nvme": {"paths": [swap]},
        "prefetch": {"units_ahead": args.units_ahead},
        "overlap": {"optimizer_with_backward": not args.no_overlap},
    }
    if placement == "auto":
        config["placement"] = {"policy": "auto"}  # params / grads / optimizer stay at their defaults
    else:
        params, grads, optim = placement.split("/")
        config["placement"] = {"params": params, "grads": grads, "optimizer": optim}
    memory = {key: value for key, value in (("device_budget", args.device_budget), ("host_budget", args.host_budget))
              if value}
    if memory:
        config["memory"] = memory
    from infinity.config.options import parse_override
    for item in [*args.set, *own_set]:  # e.g. io.checksum=full: one engine key for every infinity system
        section, key, value = parse_override(item)
        config.setdefault(section, {})[key] = value
    if stage is not None:  # the system's @S, else --zero-stage
        config.setdefault("zero", {})["stage"] = stage
    return config


def plan_summary(plan) -> dict:
    """Units per tier for each state group, the bytes per tier and the planner's reasons."""
    from infinity.memory.plan import GROUPS, KINDS_OF_GROUP
    counts = {g: {} for g in GROUPS}
    for unit_tiers in plan.tiers:
        for g in GROUPS:
            tier = unit_tiers[KINDS_OF_GROUP[g][0]].value
            counts[g][tier] = counts[g].get(tier, 0) + 1
    uniform = "/".join(next(iter(counts[g])) for g in GROUPS) if all(len(c) == 1 for c in counts.values()) else None
    return {"units": len(plan.tiers), "tier_counts": counts, "uniform": uniform,  # "P/G/O" when every unit agrees
            "tier_totals_bytes": {t.value: n for t, n in plan.tier_totals().items()}, "reasons": list(plan.reasons)}


def infinity_engine(args, placement: str, swap: str, profile: bool = False):
    """`initialize` of system `infinity:<placement>` with swap files in `swap` (removed if it fails)."""
    import torch

    import infinity
    from infinity.models.gpt import GPT, gpt_init
    config = infinity_config(args, placement, swap)
    if profile and "profile" in infinity.Config.from_dict({}).to_dict():
        config["profile"] = {
            "enabled": True,
            "trace_dir": os.path.join(args.dir, f"trace-{placement.replace('/', '-').replace('@', '-z')}"),
        }
    torch.manual_seed(0)
    try:
        return infinity.initialize(GPT(model_config(args)), config, init_fn=gpt_init)  # a plan that does not fit raises
    except BaseException:
        shutil.rmtree(swap, ignore_errors=True)
        raise


def engine_step(engine):
    """step_fn(x, y) -> loss of an infinity engine: forward, backward, step."""
    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return float(loss.detach())
    return step


def steady_bytes_per_step(engine) -> dict:
    """The bytes a steady step moves, as the plan predicts them (tests/profile/test_profile_traffic checks it
    byte for byte); counters between step starts would split an update that overlaps the next step."""
    from infinity.memory.traffic import bytes_per_step
    return bytes_per_step(engine.plan, grad_accum_steps=1, first_step=False,
                          cuda=engine.env.device.type == "cuda", kept=engine.kept_params)


def run_infinity(args, placement: str) -> dict:
    swap = tempfile.mkdtemp(prefix="bench-step-", dir=args.dir)
    engine = infinity_engine(args, placement, swap, profile=args.profile)
    start = dict(engine.manager.bytes_moved)
    try:
        out = timed_loop(args, engine_step(engine), batches(args, model_config(args), trailing=1),
                         drain=engine.synchronize)
        out["bytes_moved_per_step"] = steady_bytes_per_step(engine)
        out["fresh_params"] = {"hits": engine.manager.fresh.hits, "puts": engine.manager.fresh.puts,
                               "refused": engine.manager.fresh.refused, "budget_bytes": engine.manager.fresh.budget}
        out["bytes_moved_whole_run"] = {k: v - start[k] for k, v in engine.manager.bytes_moved.items()}
        prof = getattr(engine, "profiler", None)
        summary = prof.summary() if prof is not None and hasattr(prof, "summary") else None
        if summary:  # None without the profiler ([profile] enabled = false)
            out["overlap_efficiency"] = (summary.get("median") or {}).get("overlap_efficiency")
            out["profile"] = summary.get("median")
            out["on_demand_per_step"] = [st["on_demand_fetches"] for st in summary["steps"]]
        p = engine.prefetcher
        out["prefetch"] = {"hits": p.hits, "after_update": p.after_update, "on_demand": p.on_demand}
        out["memory_report"] = {k: v for k, v in engine.memory_report().items()
                                if k in ("state", "tier_totals") or k.startswith("activation_")}
        out["plan"] = plan_summary(engine.plan)
    finally:
        engine.close()
        shutil.rmtree(swap, ignore_errors=True)
    return out


def _offload(kind: str) -> tuple[str | None, str | None]:
    """(optimizer device, param device) for an OFFLOAD name."""
    return {"none": (None, None), "cpu_opt": ("cpu", None), "cpu_both": ("cpu", "cpu"),
            "nvme_opt": ("nvme", None), "nvme_both": ("nvme", "nvme")}[kind]


def run_deepspeed(args, kind: str) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29500 + os.getpid() % 1000)), ("RANK", "0"),
                 ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    import deepspeed
    import torch

    from infinity.models.gpt import GPT
    cfg = model_config(args)
    torch.manual_seed(0)
    model = GPT(cfg)
    max_numel = max(p.numel() for p in model.parameters())
    swap = tempfile.mkdtemp(prefix="bench-ds-", dir=args.dir)
    kind, stage = with_stage(kind, args.zero_stage)
    stage = 3 if stage is None else stage
    opt_dev, param_dev = _offload(kind)
    if param_dev and stage != 3:
        raise ValueError(f"deepspeed:{kind}@{stage}: DeepSpeed offloads parameters only at stage 3")
    zero = {"stage": stage}
    if stage == 3:
        zero.update({"stage3_prefetch_bucket_size": 2e6, "stage3_param_persistence_threshold": 0})
    if opt_dev:
        zero["offload_optimizer"] = {"device": opt_dev, "nvme_path": swap, "pin_memory": False, "buffer_count": 4}
    if param_dev:
        zero["offload_param"] = {"device": param_dev, "nvme_path": swap, "pin_memory": False,
                                 "buffer_count": args.ds_param_buffers, "buffer_size": max_numel,
                                 "max_in_cpu": 0}  # docs/benchmarks.md: >= the largest parameter
        if param_dev == "nvme":
            # Once its trace is recorded (step 2 on), ZeRO-3 releases a parameter after its module only if
            # it is not used again within stage3_max_reuse_distance elements of the trace (default 1e9).
            # Every parameter comes back in backward, so with the default nothing is released in the
            # forward: each swapped parameter (>= 1 MiB: 97 in the default GPT) keeps one of buffer_count
            # buffers and the forward fails with "Not enough buffers 0 for swapping 1". 0 releases each
            # parameter after use, as step 1 does (the losses are unchanged).
            zero["stage3_max_reuse_distance"] = 0
    o = optimizer_args(args)
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
        "gradient_clipping": args.clip,
        "optimizer": {"type": "AdamW", "params": {"lr": o["lr"], "betas": list(o["betas"]), "eps": o["eps"],
                                                  "weight_decay": o["weight_decay"]}},
        "zero_optimization": zero,
        "aio": {"block_size": 1048576, "queue_depth": 16, "thread_count": 1, "single_submit": False,
                "overlap_events": True},
        "steps_per_print": 10**9,
    }
    deepspeed.init_distributed(dist_backend="gloo")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return float(loss)
    try:
        return timed_loop(args, step, batches(args, cfg))
    finally:
        shutil.rmtree(swap, ignore_errors=True)


def run_fsdp2(args, kind: str) -> dict:
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(30500 + os.getpid() % 1000)), ("RANK", "0"),
                 ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from infinity.device.process_group import init_process_group
    from infinity.models.gpt import GPT
    kind, stage = with_stage(kind, 3)
    if kind not in ("none", "cpu_both") or stage != 3:
        raise ValueError("FSDP2 shards everything (stage 3) and offloads parameters, gradients and optimizer "
                         "state together: none | cpu_both")
    init_process_group("gloo")  # FSDP2 here: one CPU process
    cfg = model_config(args)
    torch.manual_seed(0)
    model = GPT(cfg)
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if kind == "cpu_both" else {}
    for block in model.blocks:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    opt = torch.optim.AdamW(model.parameters(), **optimizer_args(args))
    try:
        return timed_loop(args, plain_step(args, model, opt), batches(args, cfg))
    finally:
        dist.destroy_process_group()


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
    samples i and i+1; the driver (`_floors`) puts it over the floor of each and reports
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


def worker(args) -> dict:
    import torch
    torch.set_num_threads(args.threads)
    system, _, option = args.worker.partition(":")
    fn = {"torch": lambda: run_torch(args), "infinity": lambda: run_infinity(args, option),
          "deepspeed": lambda: run_deepspeed(args, option), "fsdp2": lambda: run_fsdp2(args, option),
          "io": lambda: run_io_floor(args), "paired": lambda: run_paired(args, option)}[system]
    return fn()


# ----------------------------------------------------------------------------------------- driver
def fitting_placements(args) -> dict:
    """Which static uniform placements fit the budgets, decided as `initialize` decides it.

    The model is built on the meta device and split into units as `initialize` splits it
    (`infinity.plan.estimate.unit_sizes_of`); the budgets are resolved as the engine resolves them
    (`memory.*_budget`, the free memory detected now, the free space of the swap directory's
    filesystem); each of the 27 placements is planned by `plan_for_config`. Returns
    {"fitting": [P/G/O, ...], "not_fitting": {P/G/O: the planner's message}, "budgets": {...}}.
    """
    import dataclasses

    import torch

    import infinity
    from infinity.machine.preflight import check_nvme_paths
    from infinity.memory.placement import plan_for_config
    from infinity.memory.plan import PlacementError
    from infinity.models.gpt import GPT
    from infinity.plan.estimate import resolve_budgets_for, unit_sizes_of
    with infinity.meta_init():
        model = GPT(model_config(args))
    base = infinity.Config.from_dict(infinity_config(args, "auto", args.dir))
    sizes = unit_sizes_of(model, base, world_size=args.world)
    # each worker's swap directory is a fresh directory under --dir: the same filesystem, the same free space
    budgets = resolve_budgets_for(base, local_world_size=args.world, cuda=torch.cuda.is_available(),
                                  nvme_free=check_nvme_paths([args.dir]))
    fitting, not_fitting = [], {}
    for placement in STATIC_PLACEMENTS:
        config = infinity.Config.from_dict(infinity_config(args, placement, args.dir))
        try:
            plan_for_config(sizes, config, budgets)
            fitting.append(placement)
        except PlacementError as e:
            not_fitting[placement] = str(e)
    return {"fitting": fitting, "not_fitting": not_fitting, "budgets": dataclasses.asdict(budgets)}


def expand_systems(systems: list[str], fit: dict | None) -> list[str]:
    """`infinity:fitting` replaced by every fitting static placement (in order, without duplicates)."""
    out = []
    for name in systems:
        names = [f"infinity:{p}" for p in fit["fitting"]] if name == "infinity:fitting" else [name]
        out += [n for n in names if n not in out]
    return out


def drive(args) -> dict:
    from common import machine, write_json
    args.dir = os.path.abspath(args.dir or tempfile.mkdtemp(prefix="bench-step-"))
    os.makedirs(args.dir, exist_ok=True)
    requested = args.systems.split(",") if args.systems else DEFAULT_SYSTEMS
    fit = None
    if "infinity:auto" in requested or "infinity:fitting" in requested:
        if not args.device_budget and not args.host_budget:
            args.device_budget, args.host_budget = AUTO_BUDGETS
            print(f"budgets: --device-budget {AUTO_BUDGETS[0]} --host-budget {AUTO_BUDGETS[1]} (the default with "
                  f"infinity:auto / infinity:fitting)", flush=True)
        fit = fitting_placements(args)
        print(f"budgets: device {_gib(fit['budgets']['device'])}, host {_gib(fit['budgets']['host'])}, "
              f"nvme {_gib(fit['budgets']['nvme'])}; static placements that fit: "
              f"{', '.join(fit['fitting']) or 'none'}", flush=True)
    systems = expand_systems(requested, fit)
    if args.profile:  # the profile's per-link peaks are the link rates cached for this disk (measured once)
        from infinity.machine.link_rates import link_rates
        rates = link_rates(args.dir)
        print(f"link rates ({rates.source}): nvme read {rates.nvme_read / 1e9:.2f} GB/s, write "
              f"{rates.nvme_write / 1e9:.2f} GB/s, cpu adam {rates.cpu_adam / 1e9:.2f} Gelem/s", flush=True)
    results = {}
    io_samples = []
    # the disk's speed drifts by up to 2x within minutes here: the I/O floor uses the median of
    # samples taken at the start and right after each infinity run on NVMe, not one sample
    # and, with --paired-blocks, its steps bracketed by samples seconds away (run_paired)
    runs = ["io"]
    for name in systems:
        runs.append(name)
        if _on_nvme(name):  # the paired floor's steps run alone: one process
            runs += ["io"] + ([_paired_name(name)] if args.paired_blocks and args.world == 1 else [])
    for name in runs:
        result = _run_worker(name, args)
        if name == "io":
            io_samples.append(result)
            results["io"] = _io_median(io_samples)
        else:
            results[name] = result
        if "step_s" in result:
            shown = f"{result['step_s']:.3f} s/step  rss {result['peak_rss_GiB']:.2f} GiB"
        elif "steps" in result:
            shown = "steps " + " ".join(f"{x['step_s']:.3f}" for x in result["steps"]) + " s, bracketed by samples"
        else:
            shown = str(result)[:160]
        print(f"{name:32s} {shown}", flush=True)
    base = results.get("torch", {}).get("step_s")
    for name, r in results.items():
        if base and r.get("step_s"):
            r["ratio_to_torch"] = round(r["step_s"] / base, 3)
    floors = _floors(results)
    ratios = _peer_ratios(results)
    payload = {"benchmark": "step", "machine": machine(), "model": vars(model_config(args)),
               "params": model_config(args).num_params(), "batch": args.batch, "clip": args.clip,
               "threads": args.threads, "world": args.world, "zero_stage": args.zero_stage,
               "stage_ratios": stage_ratios(results), "device_budget": args.device_budget or "auto",
               "host_budget": args.host_budget or "auto", "systems": systems, "results": results, "floors": floors,
               "peer_ratios": ratios}
    if fit is not None:
        payload["auto_vs_static"] = auto_vs_static(results, fit)
    write_json(args.json, payload)
    if fit is not None:
        _print_auto_vs_static(payload["auto_vs_static"])  # after the JSON, so it is what the terminal shows last
    for label, r in payload["stage_ratios"].items():
        print(f"{label:60s} {r['step_ratio']:.3f}" + (f"  (bar {r['bar']}: {'met' if r['met'] else 'NOT met'})"
                                                      if "bar" in r else ""))
    return payload


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


def auto_vs_static(results: dict, fit: dict) -> dict:
    """Issue 5's bar: auto fits, and its step is within 10% of the best static placement that fits."""
    static = {}
    for placement in fit["fitting"]:
        r = results.get(f"infinity:{placement}")
        if r is not None:
            static[placement] = {"step_s": r.get("step_s")} if "step_s" in r else {"error": r.get("error")}
    timed = {p: r["step_s"] for p, r in static.items() if r.get("step_s")}
    best = min(timed, key=timed.get) if timed else None
    auto = results.get("infinity:auto", {})
    auto_s = auto.get("step_s")
    ratio = auto_s / timed[best] if auto_s and best else None
    return {"budgets": fit["budgets"], "fitting": static,
            "fitting_not_run": [p for p in fit["fitting"] if p not in static],
            "not_fitting": fit["not_fitting"], "best_static": best, "best_static_step_s": timed.get(best),
            "auto_fits": "step_s" in auto, "auto_error": auto.get("error"), "auto_step_s": auto_s,
            "auto_plan": auto.get("plan"), "ratio_auto_to_best": round(ratio, 3) if ratio else None,
            "within_10pct": ratio <= 1.10 if ratio else None}


def _print_auto_vs_static(a: dict) -> None:
    print(f"auto vs static ({len(a['fitting'])} static placements fit and ran, {len(a['not_fitting'])} do not fit):")
    for placement, r in sorted(a["fitting"].items(), key=lambda kv: kv[1].get("step_s") or float("inf")):
        outcome = f"{r['step_s']:.3f} s/step" if r.get("step_s") else f"failed: {r['error']}"[:160]
        print(f"  {placement:24s} " + outcome)
    if a["auto_fits"]:
        plan = a["auto_plan"] or {}
        counts = "; ".join(f"{g} " + ", ".join(f"{n} on {t}" for t, n in c.items())
                           for g, c in plan.get("tier_counts", {}).items())
        print(f"  {'auto':24s} {a['auto_step_s']:.3f} s/step  plan: {counts}")
    else:
        print(f"  auto failed: {a['auto_error']}")
    if a["ratio_auto_to_best"] is not None:
        verdict = "within" if a["within_10pct"] else "NOT within"
        print(f"  auto / best static ({a['best_static']}) = {a['ratio_auto_to_best']:.3f}: {verdict} 10%")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _run_worker(name: str, args) -> dict:
    """Run one system (or the I/O measurement) in its own process, or `--world` processes under torchrun
    (each rank writes its result to a file of its own: long lines of several ranks would interleave on
    one pipe); rank 0's result with every rank's peak RSS, or an error."""
    distributed = args.world > 1 and name.partition(":")[0] not in ("io", "paired")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world}"]
    cmd = (launcher if distributed else [sys.executable]) + [os.path.abspath(__file__), "--worker", name]
    cmd += _forward(args)
    t = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-ranks-") as ranks:
        env = {**os.environ, RESULT_DIR: ranks} if distributed else None
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {args.timeout} s"}
        if distributed:
            per_rank = [_read_json(os.path.join(ranks, f"rank{r}.json")) for r in range(args.world)]
            result = per_rank[0] if all(per_rank) and proc.returncode == 0 else None
            if result is not None:
                result["peak_rss_GiB_per_rank"] = [r.get("peak_rss_GiB") for r in per_rank]
                result["step_s_per_rank"] = [r.get("step_s") for r in per_rank]
        else:
            line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RESULT ")), None)
            result = json.loads(line[len("RESULT "):]) if proc.returncode == 0 and line is not None else None
    if result is None:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        # under torchrun the last lines are its failure summary: end at the worker's own exception instead
        exception = re.compile(r"(\[rank\d+\]: )?[\w.]+(Error|Exception|Interrupt)\b")
        raised = [i for i, ln in enumerate(lines) if exception.match(ln) and "ChildFailedError" not in ln]
        tail = lines[max(0, raised[-1] - 5):raised[-1] + 1] if distributed and raised else lines[-6:]
        result = {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
    result["wall_s"] = round(time.perf_counter() - t, 1)
    return result


RESULT_DIR = "BENCH_STEP_RESULT_DIR"  # set by the driver for a torchrun worker: where each rank writes its result


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _on_nvme(name: str) -> bool:
    return name.startswith("infinity:") and "nvme" in name


def _paired_name(name: str) -> str:
    """The run_paired worker of system `infinity:<placement>`."""
    return "paired:" + name.partition(":")[2]


def _io_median(samples: list[dict]) -> dict:
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


def _floors(results: dict) -> dict:
    """For each infinity placement with NVMe: compute floor, I/O floor, and the ratio to the max."""
    io = results.get("io", {})
    compute = results.get("infinity:device/device/device", {}).get("step_s")
    out = {}
    for name, r in results.items():
        if not _on_nvme(name) or "step_s" not in r or not io.get("read_GBps"):
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
        paired = _paired_floor(results.get(_paired_name(name), {}), compute, io_floor_of)
        if paired:
            out[name]["paired"] = paired
        disk = r.get("disk", {})
        if disk.get("busy_fraction") is not None:
            out[name]["disk_busy_fraction"] = disk["busy_fraction"]  # of the timed steps: see timed_loop
    return out


def _paired_floor(paired: dict, compute: float | None, io_floor_of) -> dict:
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


def _peer_ratios(results: dict) -> dict:
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


def _forward(args) -> list[str]:
    out = []
    for key in ("layers", "d_model", "heads", "vocab", "seq", "batch", "steps", "warmup", "lr", "clip", "threads",
                "units_ahead", "io_bytes", "io_sustained_bytes", "paired_blocks", "ds_param_buffers", "world"):
        out += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    out += ["--dir", args.dir]
    for key in ("device_budget", "host_budget"):
        if getattr(args, key):
            out += [f"--{key.replace('_', '-')}", getattr(args, key)]
    if args.profile:
        out.append("--profile")
    if args.no_overlap:
        out.append("--no-overlap")
    if args.zero_stage is not None:
        out += ["--zero-stage", str(args.zero_stage)]
    for item in args.set:
        out += ["--set", item]
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="", help="comma-separated (default: all); infinity:auto and infinity:fitting "
                                                  "(every static placement that fits the budgets) compare auto")
    ap.add_argument("--dir", default=None, help="directory on the disk under test (swap files, traces)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6,
                    help="timed steps (infinity runs one more, untimed, then drains: tail_s)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2, help="threads per process (default 2; with --world N and no "
                                                           "--threads, 2 // N, at least 1)")
    ap.add_argument("--world", type=int, default=1, metavar="N",
                    help="ranks per system: N torchrun processes, gloo on the CPU (default 1)")
    ap.add_argument("--zero-stage", type=int, default=None, choices=(0, 1, 2, 3), metavar="S",
                    help="ZeRO stage of the infinity systems (--set zero.stage=S) and DeepSpeed's (default 3) "
                         "without an @S suffix")
    ap.add_argument("--units-ahead", type=int, default=2)
    ap.add_argument("--io-bytes", type=int, default=1 << 30, help="the burst I/O sample's size (the I/O floor's)")
    ap.add_argument("--io-sustained-bytes", type=int, default=4 << 30,
                    help="the sustained I/O sample's size, each way (0: none); reported beside the I/O floor")
    ap.add_argument("--paired-blocks", type=int, default=4,
                    help="steps of each infinity system on NVMe run again, each bracketed by burst I/O samples "
                         "taken seconds before and after it (0: none); their median ratio to the floor is "
                         "reported beside the I/O floor's")
    ap.add_argument("--device-budget", default=None, metavar="SIZE",
                    help='infinity\'s memory.device_budget, e.g. "2GiB" (default "auto": the free memory '
                         'detected; with infinity:auto / infinity:fitting, AUTO_BUDGETS)')
    ap.add_argument("--host-budget", default=None, metavar="SIZE",
                    help='infinity\'s memory.host_budget, e.g. "2GiB" (default as --device-budget)')
    ap.add_argument("--ds-param-buffers", type=int, default=32,
                    help="DeepSpeed offload_param buffer_count (32, docs/benchmarks.md: each parameter, however small,"
                         " takes one buffer of the largest parameter's size)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="engine config key for the infinity systems, e.g. --set io.checksum=full (repeatable)")
    ap.add_argument("--profile", action="store_true", help="enable infinity's profiler (overlap efficiency)")
    ap.add_argument("--no-overlap", action="store_true", help="infinity without the optimizer worker")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.world > 1 and not any(a == "--threads" or a.startswith("--threads=") for a in argv):
        args.threads = max(1, 2 // args.world)  # the same threads per rank for every system (docs/benchmarks.md)
    if args.worker:
        result = json.dumps(worker(args), default=str)
        if os.environ.get(RESULT_DIR):  # one of --world ranks (torchrun)
            with open(os.path.join(os.environ[RESULT_DIR], f"rank{rank()}.json"), "w") as f:
                f.write(result)
        else:
            print("RESULT " + result, flush=True)
        return None
    return drive(args)


if __name__ == "__main__":
    main()
