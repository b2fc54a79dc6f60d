"""GPU step times beside their floors (issue 21, Deliver 2): cases a, b, c and d.

    python benchmarks/bench_gpu.py --json benchmarks/results/gpu_<date>.json
    python benchmarks/bench_gpu.py --cases a --layers 12 --d-model 1024 --steps 6
    python benchmarks/bench_gpu.py --cases b,c,d --dir /mnt/nvme/bench --ds-nvme --json OUT
    python benchmarks/bench_gpu.py --tiny --device cpu      # the smoke test (tests/benchmarks/test_bench_gpu.py)

Case a, a model that fits in HBM: infinity with every state kind on the device
against plain PyTorch with torch.optim.AdamW(fused=True), same GPT, batch and
hyper-parameters; `ratio` = infinity / torch (bar: <= 1.10).

Case b, the ZeRO-Offload shape: parameters on the GPU, gradients and optimizer
state in pinned host RAM, CPU Adam; `ratio` = step / max(floors) (bar: <= 1.15) with
floors measured in the same run: `gpu_compute` (the forward and backward of the
same model and batch in plain PyTorch, no optimizer), `cpu_adam` (infinity's CPU
Adam kernel over the model's parameters), `pcie` (the step's gradient bytes down
and parameter bytes up over pinned-memory copy bandwidth measured here). TFLOPS per
GPU = 6 x parameters x tokens per step / step time.

Case c, the ZeRO-Infinity shape (needs `--dir` on the disk under test): c1 puts the
optimizer state on the disk (parameters on the GPU, gradients in pinned host RAM), c2
the parameters too; floors as in b plus `disk`: the step's predicted NVMe bytes
(infinity's byte model, `traffic.bytes_per_step` with the copies the update keeps)
over the read and write rates measured on `--dir` (reads and writes share the disk,
so their times add). `ratio` = step / max(floors).

Case d, DeepSpeed ZeRO-3 with offload_optimizer cpu on the same model, batch and
AdamW maths (gradient clipping off on both), in a child process (its process group
stays out of this one): `ratio` = infinity's step at the same placement (case b's,
run if b was not asked for) / DeepSpeed's (bar: <= 0.8). `--ds-nvme` adds d_nvme:
DeepSpeed's optimizer on `--dir` (its async_io op needs libaio) against case c1.

Case e, `--profile DIR`: cases b, c and l profiled (device-time compute and every link) as
a Chrome trace, summary and timeline PNG under DIR/case_<name>/rank0; in b and l by a run of its own after
the measured ones.

Cases b and l also run: `clip` (grad_clip 1.0 as configured by default: the update waits for the norm, Note
[speculation default]), `clip_lane` (the same with `overlap.device_lane = "on"`: Note [device lane];
`clip_lane_over_no_clip`, bar <= 1.1), `spec_no_fire` (speculating every window, `overlap.speculation` a size
that holds every unit's copies, with a clip that never fires: what the journal costs),
`all_cores` (no clipping, the optimizer worker unbound on every core: the thread budget's effect) and
`bound` (no clipping, the worker's threads bound to its cores, `optimizer_cores = "bind"`: Note [core binding]'s
effect), steady steps.

Case l, a 1.12B Llama (hidden 2048, 22 layers, GQA 16/4, vocab 32000, built from a config) in bf16 at
`--batch` x `--seq`: infinity in the ZeRO-Offload shape (params on the GPU, gradients and optimizer in
pinned host RAM) against torch all on the device (autocast bf16 + fused AdamW), without and with
clipping at 1.0 (`clip_over_no_clip`, bar <= 1.1); `speed` = torch's step / infinity's (bar >= 0.55).

Two step times (issue 41, item 6). `step_s`: the median over `--steps` timed steps after `--warmup`, each
ending with a device synchronize (and infinity's `synchronize`), so queued work is paid by the step that
queued it. `steady_s`: `--steps` steps run back to back, one synchronize at the end, over `--steps`: what a
training loop sees, with the update overlapping the next step. Case b also runs with `grad_clip = 1.0`
(`b_clip`: the speculated update, Note [speculative update]). Ratios against the floors use `steady_s`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine, median, write_json  # noqa: E402

import infinity  # noqa: E402
from infinity.models.gpt import GPT, GPTConfig, gpt_init, synthetic_batch  # noqa: E402
from infinity.optim.cpu_adam import AdamHyper, adam_step  # noqa: E402

LR, BETAS, EPS, WD = 3e-4, (0.9, 0.95), 1e-8, 0.1


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the step's queued work is paid by the step


def timed(step, device: torch.device, warmup: int, steps: int) -> list[float]:
    times = []
    for i in range(warmup + steps):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def steady(step, device: torch.device, warmup: int, steps: int, finish=lambda: None, intervals: list | None = None
           ) -> float:
    """Seconds per step of `steps` steps run back to back after `warmup`, one synchronize at the end (`finish`:
    what else the last step leaves in flight, e.g. infinity's update). With few steps that last drain weighs on
    the mean; `intervals` (a list) receives the host seconds between consecutive steps' returns, whose median is
    the step a long training loop sees."""
    for _ in range(warmup):
        step()
    finish()
    sync(device)
    start = time.perf_counter()
    returned = [start]
    for _ in range(steps):
        step()
        returned.append(time.perf_counter())
    finish()
    sync(device)
    if intervals is not None:
        intervals.extend(b - a for a, b in zip(returned[1:], returned[2:]))
    return (time.perf_counter() - start) / steps


def release(device: torch.device) -> None:
    """Between runs: what the last one left goes back to the device's free memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def random_fill(t: torch.Tensor, std: float = 1.0) -> torch.Tensor:
    """`t` filled with normal values drawn on the GPU when there is one (the CPU's generator draws a 1.3B-element
    model serially, seconds per build: the setup that cut case b short on the first H100 run)."""
    with torch.no_grad():
        source = "cuda" if torch.cuda.is_available() else "cpu"
        return t.copy_(torch.randn(t.shape, device=source).mul_(std))


def fast_init(rest=gpt_init):
    """An `init_fn` for a meta-built model: linear and embedding weights N(0, 0.02) drawn by `random_fill`, biases
    zero (gpt_init's and transformers' Llama's distributions), `rest(module)` for the other modules."""
    def init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            random_fill(module.weight, 0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        else:
            rest(module)
    return init


def torch_step_times(cfg: GPTConfig, batch, device, warmup, steps, optimizer: bool) -> list[float]:
    torch.manual_seed(0)
    with device:
        model = GPT(cfg)  # (built and initialized where it runs)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                            fused=device.type == "cuda") if optimizer else None
    x, y = (t.to(device) for t in batch)

    def step():
        model(x, y).backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
    return timed(step, device, warmup, steps)


def infinity_step_times(cfg: GPTConfig, batch, device, warmup, steps, placement: dict, nvme_dir: str | None = None,
                        nvme_bytes: dict | None = None, profile_dir: str | None = None, grad_clip: float = 0.0,
                        steady_out: dict | None = None, overlap: dict | None = None,
                        synchronized: bool = True) -> list[float]:
    """Step times of infinity at `placement`; with `nvme_bytes` (a dict) it receives the predicted NVMe bytes
    of a steady step; with `profile_dir` the run is profiled (Chrome trace, summary, timeline PNG there:
    case e); with `steady_out` (a dict) its "steady_s" is the back-to-back step (`steady`); `overlap`: the
    config's [overlap] keys; without `synchronized` only the steady step runs (after `warmup` steps)."""
    from infinity.memory.traffic import bytes_per_step
    torch.manual_seed(0)
    config = {"optimizer": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD, "grad_clip": grad_clip},
              "placement": placement, "overlap": dict(overlap or {})}
    if nvme_dir is not None:
        config["nvme"] = {"paths": [nvme_dir]}
    if profile_dir is not None:
        config["profile"] = {"enabled": True, "trace_dir": profile_dir}
    with infinity.meta_init():
        model = GPT(cfg)
    engine = infinity.initialize(model, config, init_fn=fast_init())
    x, y = batch  # CPU tensors: the engine moves them, as a data loader's would be

    def step():
        engine.backward(engine(x, y))
        engine.step()
        engine.synchronize()  # the overlapped update is paid by this step
    with engine:
        times = timed(step, device, warmup, steps) if synchronized else []
        if steady_out is not None:
            intervals: list = []
            steady_out["steady_s"] = steady(lambda: (engine.backward(engine(x, y)), engine.step()), device,
                                            0 if synchronized else warmup, steps, finish=engine.synchronize,
                                            intervals=intervals)
            steady_out["steady_median_s"] = median(intervals) if intervals else None
            steady_out["update_mode"] = type(engine.updates).__name__
            steady_out.update(plan_counts(engine.plan))
        if nvme_bytes is not None:
            nvme_bytes.update(bytes_per_step(engine.plan, grad_accum_steps=1, first_step=False,
                                             cuda=device.type == "cuda", kept=engine.kept_params))
        return times


def plan_counts(plan) -> dict:
    """What the planner kept on the device for a run: tail units (Note [tail units]), the device lane's units and
    the units whose gradient it keeps (Note [device lane])."""
    from infinity.memory.tier import Kind, Tier
    return {"tail_units": sum(plan.tier(u, Kind.MASTER) is Tier.DEVICE for u in range(len(plan.units))),
            "lane_units": len(plan.device_lane), "lane_grads": len(plan.lane_grads)}


def diagnostic(case: str, name: str, run) -> dict:
    """`run()`'s record; a diagnostic run (not no_clip or clip) that fails is logged with its traceback and recorded
    as its error, and the case goes on: one new path must not cost the lease the case's other numbers."""
    if name in ("no_clip", "clip"):
        return run()
    try:
        return run()
    except Exception as e:  # noqa: BLE001 - logged and recorded, not swallowed
        traceback.print_exc()
        print(f"case {case} {name} failed: {e!r}", flush=True)
        return {"error": repr(e)}


def cpu_adam_floor(numel: int, repeats: int = 3) -> float:
    """Seconds of infinity's CPU Adam kernel over `numel` fp32 elements (fp32 grads)."""
    master, grad, m, v = (random_fill(torch.empty(numel)) for _ in range(4))
    v.abs_()
    hyper = AdamHyper(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD, decoupled=True)
    times = []
    for step in range(1, repeats + 1):
        start = time.perf_counter()
        adam_step(master, grad, m, v, step=step, hyper=hyper, grad_scale=None)
        times.append(time.perf_counter() - start)
    return median(times)


def pcie_floor(nbytes_down: int, nbytes_up: int, device: torch.device) -> float:
    """Seconds to move the step's bytes over pinned-memory copies, at the bandwidth measured now."""
    if device.type != "cuda":
        return 0.0
    probe = 256 << 20
    host = torch.empty(probe, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(probe, dtype=torch.uint8, device=device)
    rates = {}
    for name, (dst, src) in {"h2d": (dev, host), "d2h": (host, dev)}.items():
        dst.copy_(src, non_blocking=True)
        sync(device)
        start = time.perf_counter()
        for _ in range(4):
            dst.copy_(src, non_blocking=True)
        sync(device)
        rates[name] = 4 * probe / (time.perf_counter() - start)
    return nbytes_down / rates["d2h"] + nbytes_up / rates["h2d"]


def case_a(cfg, batch, device, args) -> dict:
    ours = median(infinity_step_times(cfg, batch, device, args.warmup, args.steps,
                                      {"params": "device", "grads": "device", "optimizer": "device"}))
    ref = median(torch_step_times(cfg, batch, device, args.warmup, args.steps, optimizer=True))
    return {"step_s": ours, "floors": {"torch_fused_adamw": ref}, "ratio": ours / ref, "bar": 1.10,
            "tflops": tflops(cfg, batch, ours)}


OFFLOAD = {"params": "device", "grads": "host", "optimizer": "host"}  # the ZeRO-Offload shape


def offload(args) -> dict:
    """Cases b and l's placement: the ZeRO-Offload shape, with --tail-units' setting (Note [tail units]; a count
    stands for a device that holds no more, where "auto" would keep more)."""
    return OFFLOAD | {"tail_units": args.tail_units}


RUNS = ("no_clip", "clip", "clip_lane", "spec_no_fire", "all_cores", "bound")  # of cases b and l (--runs)
# (no_clip and clip always run)
ALL_CORES = {"optimizer_threads": torch.get_num_threads(), "optimizer_cores": "none"}
BOUND = {"optimizer_cores": "bind"}  # ("auto" binds nowhere: Note [core binding])
LANE = {"device_lane": "on"}  # Note [device lane]: the GPU takes the forward's last units of a deferred update


def ratios(runs: dict, no_clip_s: float) -> dict:
    """The diagnostic runs' steady steps over the unclipped one (those that ran)."""
    return {f"{name}_over_{'no_clip' if name in ('spec_no_fire', 'clip_lane') else 'auto'}":
            runs[name]["steady_s"] / no_clip_s for name in ("clip_lane", "spec_no_fire", "all_cores", "bound")
            if "steady_s" in runs.get(name, {})}  # (a failed diagnostic run has its error instead)


NEVER_FIRES = 1e9  # a clip that never fires: what speculating costs when it is not needed
SPECULATE = {"speculation": "24GiB"}  # every unit's copies (16 bytes an element: 21 GB for case b, 18 GB for l)


def case_b(cfg, batch, device, args) -> dict:
    with torch.device("meta"):
        numel = sum(p.numel() for p in GPT(cfg).parameters())
    runs = {}
    # no_clip: the eager update (synchronized and steady steps); clip: grad_clip 1.0 as configured by default
    # (the deferred update, Note [speculation default]); clip_lane: the same with the device lane (Note [device
    # lane]: the GPU updates the forward's last units after the norm, the CPU its first); spec_no_fire: speculating
    # every window with a clip that never fires (the journal's cost); all_cores: no clipping, the worker unbound on
    # every core (the thread budget before "auto" left one to the training thread); bound: no clipping, the worker
    # bound to its cores (Note [core binding]: "auto" binds nowhere)
    for name, clip, overlap, sync_too in (("no_clip", 0.0, {}, True), ("clip", 1.0, {}, False),
                                          ("clip_lane", 1.0, LANE, False),
                                          ("spec_no_fire", NEVER_FIRES, SPECULATE, False),
                                          ("all_cores", 0.0, ALL_CORES, False), ("bound", 0.0, BOUND, False)):
        if name not in args.runs:
            continue

        def run(clip=clip, overlap=overlap, sync_too=sync_too) -> dict:
            out: dict = {}
            try:
                times = infinity_step_times(cfg, batch, device, args.warmup, args.steps, offload(args), grad_clip=clip,
                                            steady_out=out, overlap=overlap, synchronized=sync_too)
            finally:
                release(device)
            if times:
                out["step_s"] = median(times)
            return out
        runs[name] = diagnostic("b", name, run)
        print(f"case b {name}: {runs[name]}", flush=True)
    if args.profile:  # after the measured runs (the profile's own costs stay out of them): unclipped and clipping
        for name, clip in (("case_b", 0.0), ("case_b_clip", 1.0)):  # steady steps, as case l's: each update
            # overlapping the next forward (a synchronize per step would show the update after backward alone)
            infinity_step_times(cfg, batch, device, 1, 2, offload(args), profile_dir=os.path.join(args.profile, name),
                                grad_clip=clip, steady_out={}, synchronized=False)
            release(device)
    floors = {
        "gpu_compute": median(torch_step_times(cfg, batch, device, args.warmup, args.steps, optimizer=False)),
        "cpu_adam": cpu_adam_floor(numel),
        "pcie": pcie_floor(numel * 4, numel * 4, device),  # fp32 gradients down, fp32 parameters up
    }
    ours, steady_s = runs["no_clip"]["step_s"], runs["no_clip"]["steady_s"]
    return {"step_s": ours, "steady_s": steady_s, "steady_median_s": runs["no_clip"]["steady_median_s"],
            "floors": floors, "ratio": steady_s / max(floors.values()),
            "ratio_synchronized": ours / max(floors.values()), "bar": 1.2, "tflops": tflops(cfg, batch, steady_s),
            "params": numel, "b_clip": {**runs["clip"], "clip_over_no_clip": runs["clip"]["steady_s"] / steady_s,
                                         "bar": 1.1},
            **ratios(runs, steady_s), "runs": runs}


LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 16,
            "num_key_value_heads": 4, "vocab_size": 32000}


def llama_config(args):
    from transformers import LlamaConfig
    shape = dict(LLAMA_1B)
    if args.tiny:
        shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=args.vocab)
    return LlamaConfig(**shape, max_position_embeddings=args.seq, bos_token_id=None, eos_token_id=None,
                       pad_token_id=None)


def torch_llama_steady(lcfg, x, device, bf16: bool, args) -> tuple[float, int]:
    """torch all on the device (autocast bf16, fused AdamW): its back-to-back step and the parameter count."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(lcfg)  # (built and initialized where it runs)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                            fused=device.type == "cuda")
    xd = x.to(device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=xd, labels=xd).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steady(step, device, args.warmup, args.steps), sum(p.numel() for p in model.parameters())


def case_l(cfg, batch, device, args) -> dict:
    """The 1.12B Llama in bf16: infinity's offload shape (no clipping and clipping at 1.0) vs torch on the device."""
    from transformers import LlamaForCausalLM
    lcfg = llama_config(args)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, lcfg.vocab_size, (args.batch, args.seq), generator=g)
    bf16 = device.type == "cuda"  # (the CPU smoke test runs it in fp32)

    theirs, numel = torch_llama_steady(lcfg, x, device, bf16, args)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # (torch's model and optimizer are gone)
    out = {"params": numel, "torch_steady_s": theirs}
    runs = (("no_clip", 0.0, {}), ("clip", 1.0, {}), ("clip_lane", 1.0, LANE), ("spec_no_fire", NEVER_FIRES, SPECULATE),
            ("all_cores", 0.0, ALL_CORES), ("bound", 0.0, BOUND))
    runs = tuple(r for r in runs if r[0] in args.runs)
    if args.profile:  # last, after the measured runs: unclipped, and clipping at 1.0 (its deferred schedule)
        runs += (("profiled", 0.0, {}), ("profiled_clip", 1.0, {}))
    def run(name: str, clip: float, overlap: dict) -> dict:
        torch.manual_seed(0)
        with infinity.meta_init():
            model = LlamaForCausalLM(lcfg)
        config = {"optimizer": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD, "grad_clip": clip},
                  "placement": offload(args), "precision": {"compute_dtype": "bf16" if bf16 else "fp32"},
                  "overlap": overlap}
        profiled = name.startswith("profiled")
        if profiled:
            config["profile"] = {"enabled": True, "trace_dir": os.path.join(args.profile, "case_" + name.replace(
                "profiled", "l"))}
        try:
            engine = infinity.initialize(model, config, init_fn=fast_init(model._init_weights))
            intervals: list = []
            with engine:
                ours = steady(lambda: (engine.backward(engine(input_ids=x, labels=x).loss), engine.step()), device,
                              args.warmup, args.steps if not profiled else 2, finish=engine.synchronize,
                              intervals=intervals)
                record = {"update_mode": type(engine.updates).__name__, **plan_counts(engine.plan)}
        finally:
            engine = model = None  # (collected by release)
            release(device)
        return {"steady_s": ours, "speed": theirs / ours, "tflops": 6 * numel * x.numel() / ours / 1e12,
                "steady_median_s": median(intervals) if intervals else None, **record}

    for name, clip, overlap in runs:
        out[name] = diagnostic("l", name, lambda: run(name, clip, overlap))
        print(f"case l {name}: {out[name]}", flush=True)
    out.update(step_s=out["no_clip"]["steady_s"], steady_median_s=out["no_clip"]["steady_median_s"],
               floors={"torch_all_on_device": theirs},
               ratio=out["no_clip"]["steady_s"] / theirs, speed=out["no_clip"]["speed"], bar_speed=0.55,
               clip_over_no_clip=out["clip"]["steady_s"] / out["no_clip"]["steady_s"], bar_clip=1.1,
               **ratios(out, out["no_clip"]["steady_s"]))
    return out


def disk_floor(nbytes: dict, directory: str, device: torch.device) -> float:
    """Seconds for the step's NVMe reads and writes at the rates measured on `directory` (they share the disk)."""
    from infinity.machine.link_rates import link_rates
    rates = link_rates(directory, device)
    return nbytes.get("nvme_read", 0) / rates.nvme_read + nbytes.get("nvme_write", 0) / rates.nvme_write


def case_c(cfg, batch, device, args) -> dict:
    if not args.dir:
        raise SystemExit("case c needs --dir DIR on the disk under test (the swap files go there)")
    with torch.device("meta"):
        numel = sum(p.numel() for p in GPT(cfg).parameters())
    base = {
        "gpu_compute": median(torch_step_times(cfg, batch, device, args.warmup, args.steps, optimizer=False)),
        "cpu_adam": cpu_adam_floor(numel),
        "pcie": pcie_floor(numel * 4, numel * 4, device),
    }
    out = {}
    for name, placement in {"c1": {"params": "device", "grads": "host", "optimizer": "nvme"},
                            "c2": {"params": "nvme", "grads": "host", "optimizer": "nvme"}}.items():
        swap = tempfile.mkdtemp(prefix="bench-gpu-", dir=args.dir)
        nbytes: dict = {}
        profile = os.path.join(args.profile, f"case_{name}") if args.profile else None
        ours = median(infinity_step_times(cfg, batch, device, args.warmup, args.steps, placement, swap, nbytes,
                                          profile_dir=profile))
        floors = {**base, "disk": disk_floor(nbytes, args.dir, device)}
        out[name] = {"placement": placement, "step_s": ours, "floors": floors, "nvme_bytes": nbytes,
                     "ratio": ours / max(floors.values()), "bar": 1.15, "tflops": tflops(cfg, batch, ours),
                     "params": numel}
    return out


def deepspeed_step_times(args, offload: str) -> list[float]:
    """DeepSpeed ZeRO-3, optimizer offloaded to `offload` ("cpu" | "nvme"), in a child process."""
    cmd = [sys.executable, os.path.abspath(__file__), "--ds-worker", offload, "--device", args.device,
           "--layers", str(args.layers), "--d-model", str(args.d_model), "--heads", str(args.heads),
           "--seq", str(args.seq), "--batch", str(args.batch), "--vocab", str(args.vocab),
           "--warmup", str(args.warmup), "--steps", str(args.steps)] + (["--dir", args.dir] if args.dir else [])
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29700 + os.getpid() % 200), "RANK": "0",
           "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    if args.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"DeepSpeed worker failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["times"]


def deepspeed_config(batch: int, stage: int, offload: dict, bf16: bool = False) -> dict:
    """DeepSpeed's config for the comparisons: ZeRO `stage` with the optimizer `offload`ed, AdamW at infinity's
    hyper-parameters, no clipping (as infinity's runs; DeepSpeed clips at 1.0 unless set)."""
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "bf16": {"enabled": bf16},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                      "weight_decay": WD}},
            "zero_optimization": {"stage": stage, "offload_optimizer": offload}, "steps_per_print": 10**9}


def ds_worker(args) -> None:
    """The child: one DeepSpeed ZeRO-3 engine, its step times printed as JSON on the last line."""
    import deepspeed
    device = torch.device(args.device)
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=args.heads,
                    d_model=args.d_model)
    torch.manual_seed(0)
    model = GPT(cfg)
    offload = {"device": args.ds_worker, "pin_memory": device.type == "cuda"}
    if args.ds_worker == "nvme":
        offload.update(nvme_path=tempfile.mkdtemp(prefix="bench-gpu-ds-", dir=args.dir), buffer_count=4)
    ds_config = deepspeed_config(args.batch, 3, offload)
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    x, y = (t.to(engine.device) for t in synthetic_batch(cfg, args.batch, torch.Generator().manual_seed(0)))

    def step():
        engine.backward(engine(x, y))
        engine.step()
    print(json.dumps({"times": timed(step, device, args.warmup, args.steps)}), flush=True)


def case_d(cfg, batch, device, args, done: dict) -> dict:
    if args.b_step_s is not None:  # case b's synchronized step, measured by an earlier process (gpu_check.sh)
        ours = args.b_step_s
    else:
        ours = done["b"]["step_s"] if "b" in done else case_b(cfg, batch, device, args)["step_s"]
    theirs = median(deepspeed_step_times(args, "cpu"))
    out = {"step_s": ours, "deepspeed_step_s": theirs, "floors": {"deepspeed_zero3_offload_cpu": theirs},
           "ratio": ours / theirs, "bar": 0.8, "tflops": tflops(cfg, batch, ours)}
    if args.ds_nvme:
        c1 = done["c"]["c1"]["step_s"] if "c" in done else case_c(cfg, batch, device, args)["c1"]["step_s"]
        theirs_nvme = median(deepspeed_step_times(args, "nvme"))
        out["d_nvme"] = {"step_s": c1, "deepspeed_step_s": theirs_nvme, "ratio": c1 / theirs_nvme, "bar": 0.8}
    return out


def tflops(cfg: GPTConfig, batch, step_s: float) -> float:
    numel = cfg.num_params()
    tokens = batch[0].numel()
    return 6 * numel * tokens / step_s / 1e12


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="a,b", help="comma-separated: a, b, c, d, l")
    ap.add_argument("--dir", default=None, help="a directory on the disk under test (case c, d --ds-nvme)")
    ap.add_argument("--ds-nvme", action="store_true", help="case d also with DeepSpeed's optimizer on --dir")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds for DeepSpeed's child process")
    ap.add_argument("--profile", default=None, metavar="DIR", help="case e: profile cases b, c and l (Chrome trace, "
                    "summary and timeline PNG under DIR/case_<name>/rank0)")
    ap.add_argument("--b-step-s", type=float, default=None, help="case d: infinity's step, case b's synchronized "
                    "step measured by an earlier run (gpu_check.sh), instead of running case b again")
    ap.add_argument("--ds-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="a tiny model and one timed step (smoke test)")
    ap.add_argument("--runs", default=",".join(RUNS), help="cases b and l: which of %s to run (no_clip and clip "
                    "always run)" % ", ".join(RUNS))
    ap.add_argument("--tail-units", default="auto", type=lambda v: v if v == "auto" else int(v),
                    help='cases b and l: placement.tail_units ("auto", or a count: a device that holds no more)')
    ap.add_argument("--json", default=None)
    return ap


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    args.runs = set(args.runs.split(",")) | {"no_clip", "clip"}
    if args.ds_worker:
        return ds_worker(args)
    if args.tiny:
        args.layers, args.d_model, args.heads, args.seq, args.batch, args.vocab = 2, 32, 4, 16, 2, 64
        args.warmup, args.steps = 1, 1
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # both sides: the comparison is at the same maths
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=args.heads,
                    d_model=args.d_model)
    batch = synthetic_batch(cfg, args.batch, torch.Generator().manual_seed(0))
    out = {"machine": machine(), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "model": {"n_layer": cfg.n_layer, "d_model": cfg.d_model, "seq_len": cfg.seq_len, "batch": args.batch}}
    done: dict = {}
    cases = {"a": case_a, "b": case_b, "c": case_c, "d": lambda *a: case_d(*a, done), "l": case_l}
    for name in args.cases.split(","):
        out[name] = done[name] = cases[name](cfg, batch, device, args)
        print(f"case {name}: {out[name]}", flush=True)
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
