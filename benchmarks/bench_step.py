"""Step time of infinity beside plain PyTorch, DeepSpeed ZeRO-3 and FSDP2, on the same model and batch.

    python benchmarks/bench_step.py --dir /path/on/nvme --json step.json
    python benchmarks/bench_step.py --systems torch,infinity:nvme/host/nvme --steps 4

Every system runs in its own process (so its peak RSS is its own), world size 1,
the same GPT, data, AdamW hyper-parameters, gradient clipping and thread count.
Reported per system: median step time over the timed steps (after warm-up),
peak RSS, overlap efficiency (infinity's profiler, when enabled), bytes moved per
step, and the ratio to the in-RAM PyTorch baseline. With infinity on NVMe the
floors are computed in the same run: the compute floor is infinity with all state
on the device tier; the I/O floor is the bytes the plan moves per step over
io_engine's read and write bandwidth, measured on the same directory in this run
(reads and writes share the disk, so the floor adds the two times).

System names: `torch`, `infinity:PARAMS/GRADS/OPTIMIZER` (tiers), `deepspeed:OFFLOAD`
and `fsdp2:OFFLOAD` with OFFLOAD one of none | cpu_opt | cpu_both | nvme_opt | nvme_both.
DeepSpeed and FSDP2 are skipped (with the reason) when not installed or failing.
"""

from __future__ import annotations

import argparse
import json
import os
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
    "deepspeed:none", "deepspeed:cpu_opt", "deepspeed:cpu_both", "deepspeed:nvme_opt", "deepspeed:nvme_both",
    "fsdp2:none", "fsdp2:cpu_both",
]


def model_config(args):
    from infinity.models.gpt import GPTConfig
    return GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=args.heads,
                     d_model=args.d_model)


def optimizer_args(args) -> dict:
    return {"lr": args.lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def batches(args, cfg):
    import torch
    from infinity.models.gpt import synthetic_batch
    g = torch.Generator().manual_seed(1)
    return [synthetic_batch(cfg, args.batch, g) for _ in range(args.warmup + args.steps)]


def timed_loop(args, step_fn, data) -> dict:
    """Run warm-up + timed steps; step_fn(x, y) -> loss float."""
    from common import median, peak_rss_bytes
    times, losses = [], []
    for i, (x, y) in enumerate(data):
        t = time.perf_counter()
        losses.append(step_fn(x, y))
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    return {"step_s": median(times), "step_times": [round(t, 3) for t in times], "losses": losses,
            "peak_rss_GiB": round(peak_rss_bytes() / 2**30, 3)}


# ----------------------------------------------------------------------------------------- workers
def run_torch(args) -> dict:
    import torch
    from infinity.models.gpt import GPT
    cfg = model_config(args)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), fused=True, **optimizer_args(args))

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)
    return timed_loop(args, step, batches(args, cfg))


def run_infinity(args, placement: str) -> dict:
    import torch
    import infinity
    from infinity.models.gpt import GPT, gpt_init
    params, grads, optim = placement.split("/")
    cfg = model_config(args)
    swap = tempfile.mkdtemp(prefix="bench-step-", dir=args.dir)
    config = {
        "optimizer": {"name": "adamw", "lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                      "grad_clip": args.clip},
        "placement": {"params": params, "grads": grads, "optimizer": optim},
        "nvme": {"paths": [swap]},
        "prefetch": {"units_ahead": args.units_ahead},
        "overlap": {"optimizer_with_backward": not args.no_overlap},
    }
    profile = args.profile and "profile" in infinity.Config.from_dict({}).to_dict()
    if profile:
        config["profile"] = {"enabled": True, "trace_dir": os.path.join(args.dir, f"trace-{placement.replace('/', '-')}")}
    torch.manual_seed(0)
    engine = infinity.initialize(GPT(cfg), config, init_fn=gpt_init)
    moved = []

    def step(x, y):
        before = dict(engine.manager.bytes_moved)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        engine.synchronize()  # a step is done when its update is: the timing must include it
        moved.append({k: v - before[k] for k, v in engine.manager.bytes_moved.items()})
        return float(loss.detach())
    try:
        out = timed_loop(args, step, batches(args, cfg))
        out["bytes_moved_per_step"] = moved[-1]
        prof = getattr(engine, "profiler", None)
        if prof is not None and hasattr(prof, "summary"):
            summary = prof.summary()
            out["overlap_efficiency"] = summary.get("median", {}).get("overlap_efficiency")
            out["profile"] = summary.get("median")
        out["memory_report"] = {k: v for k, v in engine.memory_report().items() if k in ("state", "tier_totals")}
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
    opt_dev, param_dev = _offload(kind)
    zero = {"stage": 3, "stage3_prefetch_bucket_size": 2e6, "stage3_param_persistence_threshold": 0}
    if opt_dev:
        zero["offload_optimizer"] = {"device": opt_dev, "nvme_path": swap, "pin_memory": False, "buffer_count": 4}
    if param_dev:
        zero["offload_param"] = {"device": param_dev, "nvme_path": swap, "pin_memory": False, "buffer_count": 32,
                                 "buffer_size": max_numel, "max_in_cpu": 0}  # PEERS.md: >= the largest parameter
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
    from infinity.models.gpt import GPT
    if kind not in ("none", "cpu_both"):
        raise ValueError("FSDP2 offloads parameters, gradients and optimizer state together: none | cpu_both")
    dist.init_process_group("gloo")
    cfg = model_config(args)
    torch.manual_seed(0)
    model = GPT(cfg)
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if kind == "cpu_both" else {}
    for block in model.blocks:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    opt = torch.optim.AdamW(model.parameters(), **optimizer_args(args))

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)
    try:
        return timed_loop(args, step, batches(args, cfg))
    finally:
        dist.destroy_process_group()


def run_io_floor(args) -> dict:
    """io_engine's read / write bandwidth on the swap directory, now."""
    from io_engine import IOConfig, IOEngine, aligned_empty
    import torch
    path = os.path.join(args.dir, f"bench-io-{os.getpid()}.bin")
    buf = aligned_empty(args.io_bytes // 4, torch.float32)
    buf.fill_(1.0)
    out = {}
    try:
        with IOEngine(IOConfig()) as io:
            for direction in ("write", "read", "write", "read"):
                t = time.perf_counter()
                (io.submit_write if direction == "write" else io.submit_read)(buf, path, 0).wait()
                gbps = args.io_bytes / (time.perf_counter() - t) / 1e9
                out[f"{direction}_GBps"] = max(out.get(f"{direction}_GBps", 0), gbps)
    finally:
        os.remove(path)
    return out


def worker(args) -> dict:
    import torch
    torch.set_num_threads(args.threads)
    system, _, option = args.worker.partition(":")
    fn = {"torch": lambda: run_torch(args), "infinity": lambda: run_infinity(args, option),
          "deepspeed": lambda: run_deepspeed(args, option), "fsdp2": lambda: run_fsdp2(args, option),
          "io": lambda: run_io_floor(args)}[system]
    return fn()


# ----------------------------------------------------------------------------------------- driver
def drive(args) -> dict:
    from common import machine, write_json
    args.dir = os.path.abspath(args.dir or tempfile.mkdtemp(prefix="bench-step-"))
    os.makedirs(args.dir, exist_ok=True)
    systems = args.systems.split(",") if args.systems else DEFAULT_SYSTEMS
    results = {}
    for name in ["io"] + systems:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", name] + _forward(args)
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            results[name] = {"error": f"timed out after {args.timeout} s"}
            continue
        line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
            results[name] = {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
        else:
            results[name] = json.loads(line[len("RESULT "):])
        results[name]["wall_s"] = round(time.perf_counter() - t, 1)
        print(f"{name:32s} " + (f"{results[name]['step_s']:.3f} s/step  rss {results[name]['peak_rss_GiB']:.2f} GiB"
                                if "step_s" in results[name] else str(results[name])[:160]), flush=True)
    base = results.get("torch", {}).get("step_s")
    for name, r in results.items():
        if base and r.get("step_s"):
            r["ratio_to_torch"] = round(r["step_s"] / base, 3)
    floors = _floors(results)
    ratios = _peer_ratios(results)
    payload = {"benchmark": "step", "machine": machine(), "model": vars(model_config(args)),
               "params": model_config(args).num_params(), "batch": args.batch, "clip": args.clip,
               "threads": args.threads, "results": results, "floors": floors, "peer_ratios": ratios}
    write_json(args.json, payload)
    return payload


def _floors(results: dict) -> dict:
    """For each infinity placement with NVMe: compute floor, I/O floor, and the ratio to the max."""
    io = results.get("io", {})
    compute = results.get("infinity:device/device/device", {}).get("step_s")
    out = {}
    for name, r in results.items():
        if not name.startswith("infinity:") or "nvme" not in name or "step_s" not in r or not io.get("read_GBps"):
            continue
        moved = r.get("bytes_moved_per_step", {})
        io_floor = moved.get("nvme_read", 0) / 1e9 / io["read_GBps"] + moved.get("nvme_write", 0) / 1e9 / io["write_GBps"]
        floor = max(compute or 0, io_floor)
        out[name] = {"compute_floor_s": compute, "io_floor_s": round(io_floor, 3),
                     "step_over_floor": round(r["step_s"] / floor, 3) if floor else None}
    return out


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
                "units_ahead", "io_bytes"):
        out += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    out += ["--dir", args.dir]
    if args.profile:
        out.append("--profile")
    if args.no_overlap:
        out.append("--no-overlap")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="", help="comma-separated (default: all)")
    ap.add_argument("--dir", default=None, help="directory on the disk under test (swap files, traces)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--units-ahead", type=int, default=2)
    ap.add_argument("--io-bytes", type=int, default=1 << 30)
    ap.add_argument("--profile", action="store_true", help="enable infinity's profiler (overlap efficiency)")
    ap.add_argument("--no-overlap", action="store_true", help="infinity without the optimizer worker")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(args), default=str), flush=True)
        return None
    return drive(args)


if __name__ == "__main__":
    main()
