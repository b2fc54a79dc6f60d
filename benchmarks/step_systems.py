"""The systems bench_step.py times, one worker function each, in the worker process: plain PyTorch, infinity at
a placement, DeepSpeed ZeRO-3 / ZeRO-Infinity, FSDP2 with CPU offload; the model, batches and timed loop they
share (docs/benchmarks.md: the peers are run with the same maths, data and threads)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

TIERS = ("device", "host", "nvme")
STATIC_PLACEMENTS = tuple(f"{p}/{g}/{o}" for p in TIERS for g in TIERS for o in TIERS)  # all 27


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


