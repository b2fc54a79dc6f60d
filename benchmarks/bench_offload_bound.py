"""The memory-bound cases: steps where the training state does not stay on the GPU, beside their floors measured
in the same run (cases m1, m2 and d2).

    python benchmarks/bench_offload_bound.py --cases m1 --json m1.json
    python benchmarks/bench_offload_bound.py --cases m2 --dir /tmp/m2-swap --json m2.json
    python benchmarks/bench_offload_bound.py --cases d2 --json d2.json      # DeepSpeed on m1's model and batch
    python benchmarks/bench_offload_bound.py --tiny --device cpu            # the smoke test (tests/benchmarks)

Case m1: bench_gpu.py's case l model (the 1.12B Llama, bf16 compute) with `placement.tail_units = 0`: every unit's
gradients and optimizer state in pinned host RAM, every element updated by the CPU's Adam. Runs, each in steady
steps (`--steps` back to back, one synchronize at the end): `no_clip`; `clip` (grad_clip 1.0, firing: the update
waits for the norm, Note [speculation default]); `clip_lane` (the same with `overlap.device_lane = "on"`, Note
[device lane]); `accum4` (4 micro-batches accumulated per step; torch's reference accumulates the same 4 on the
device); `accum4_lane` (the same with the device lane: after the last micro-batch the CPU's Adam of every unit is
the update's tail, which the GPU shares; `--m1-runs` picks the runs). Floors: `gpu_compute` (torch's forward and
backward of the same model and batch under bf16 autocast, no optimizer), `cpu_adam` (infinity's CPU Adam kernel over
the elements the plan updates on the host), `pcie` (the step's predicted host<->device bytes,
`traffic.bytes_per_step`, over pinned-copy bandwidth measured here). `ratio` = steady step / max(floors) (bar <=
1.2); `speed` = torch all on the device / ours (bar >= 0.50); `clip_over_no_clip` (bar <= 1.1); `accum4_speed` =
torch's accumulated step / ours (bar >= 0.85; `accum4_lane_speed` the same with the device lane).

Case m2: the largest Llama of the 13B width (the 7B width on a GPU under 100 GiB) whose fp32 training state
(16 bytes a parameter: parameters, gradients, Adam's two moments) is at least 1.2x the GPU's memory and that
`infinity estimate` says trains on this machine with `placement.policy = "auto"` (layers taken off the rung's
shape until it fits), bf16 compute, `--dir` for what goes to the disk; `--steps` steady steps (3 or more); floors
as m1's plus `disk` (the step's predicted NVMe bytes over rates measured on `--dir`); `ratio` (bar <= 1.25),
`tflops` = 6 x parameters x tokens per step / step, `params`.

Case d2: DeepSpeed ZeRO-2 with `offload_optimizer: {device: cpu, pin_memory: true}` (the real ZeRO-Offload: its
CPUAdam op is JIT-built on the machine the first time, which needs a compiler and ninja: docs/benchmarks.md) and
ZeRO-3 with the same offload, on m1's model, batch and AdamW maths (bf16, no clipping on either side), in a child
process; `ratio` = m1's unclipped steady step / ZeRO-2's (bar <= 0.5), `zero3_ratio` the same against ZeRO-3.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_gpu import (  # noqa: E402
    BETAS,
    EPS,
    LANE,
    LR,
    WD,
    cpu_adam_floor,
    deepspeed_config,
    diagnostic,
    disk_floor,
    fast_init,
    llama_config,
    pcie_floor,
    plan_counts,
    release,
    steady,
)
from common import machine, write_json  # noqa: E402

import infinity  # noqa: E402
from infinity.plan.largest import LADDERS, Rung  # noqa: E402

STATE_BYTES = 16  # fp32 parameters, gradients and Adam's two moments, per parameter
OVER_DEVICE = 1.2  # m2's training state over the GPU's memory, at least


def tokens(lcfg, args, micro_batches: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, lcfg.vocab_size, (args.batch, args.seq), generator=g) for _ in range(micro_batches)]


def torch_steps(lcfg, xs: list[torch.Tensor], device, bf16: bool, args, optimizer: bool) -> float:
    """torch all on the device: the steady step accumulating `xs` (fused AdamW when `optimizer`, else forward and
    backward only: the compute floor)."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(lcfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                            fused=device.type == "cuda") if optimizer else None
    on = [x.to(device) for x in xs]

    def step():
        for x in on:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = model(input_ids=x, labels=x).loss / len(on)
            loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
    try:
        return steady(step, device, args.warmup, args.steps)
    finally:
        model = opt = on = None
        release(device)


def ours(lcfg, xs: list[torch.Tensor], device, args, placement: dict, clip: float = 0.0, overlap: dict | None = None,
         nvme_dir: str | None = None, memory: dict | None = None) -> dict:
    """infinity's steady step at `placement`, accumulating `xs`; with the plan's counts, the elements it updates
    on the host and its predicted bytes per step."""
    from transformers import LlamaForCausalLM

    from infinity.memory.tier import Kind, Tier
    from infinity.memory.traffic import bytes_per_step
    bf16 = device.type == "cuda"
    torch.manual_seed(0)
    with infinity.meta_init():
        model = LlamaForCausalLM(lcfg)
    config = {"optimizer": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD, "grad_clip": clip},
              "placement": placement, "precision": {"compute_dtype": "bf16" if bf16 else "fp32"},
              "overlap": dict(overlap or {}), "train": {"grad_accum_steps": len(xs)}, "memory": dict(memory or {})}
    if nvme_dir is not None:
        config["nvme"] = {"paths": [nvme_dir]}
    engine = None
    try:
        engine = infinity.initialize(model, config, init_fn=fast_init(model._init_weights))

        def step():
            for x in xs:
                engine.backward(engine(input_ids=x, labels=x).loss)
                engine.step()
        with engine:
            seconds = steady(step, device, args.warmup, args.steps, finish=engine.synchronize)
            plan = engine.plan
            host = sum(plan.units[u].shard_numel for u in range(len(plan.units))
                       if plan.tier(u, Kind.MASTER) is not Tier.DEVICE)
            moved = bytes_per_step(plan, grad_accum_steps=len(xs), first_step=False, cuda=device.type == "cuda",
                                   kept=engine.kept_params)
            return {"steady_s": seconds, "update_mode": type(engine.updates).__name__, "host_elements": host,
                    "bytes_per_step": moved, **plan_counts(plan)}
    finally:
        engine = model = None
        release(device)


def floors(lcfg, x, device, args, run: dict, nvme_dir: str | None = None) -> dict:
    """The step's floors, measured now: GPU compute, CPU Adam over the host's elements, PCIe (and the disk)."""
    moved = run["bytes_per_step"]
    out = {"gpu_compute": torch_steps(lcfg, [x], device, device.type == "cuda", args, optimizer=False),
           "cpu_adam": cpu_adam_floor(run["host_elements"]) if run["host_elements"] else 0.0,
           "pcie": pcie_floor(moved.get("d2h", 0), moved.get("h2d", 0), device)}
    if nvme_dir is not None and (moved.get("nvme_read") or moved.get("nvme_write")):
        out["disk"] = disk_floor(moved, nvme_dir, device)
    return out


M1 = {"params": "device", "grads": "host", "optimizer": "host", "tail_units": 0}


def case_m1(device, args) -> dict:
    lcfg = llama_config(args)
    (x,), xs4 = tokens(lcfg, args), tokens(lcfg, args, 4)
    m1_runs = {"no_clip": (0.0, {}, [x]), "clip": (1.0, {}, [x]), "lane": (0.0, LANE, [x]),
               "clip_lane": (1.0, LANE, [x]), "accum4": (0.0, {}, xs4), "accum4_lane": (0.0, LANE, xs4)}
    names = ["no_clip", *(r for r in args.m1_runs.split(",") if r and r != "no_clip")]  # (no_clip: the base)
    if unknown := [n for n in names if n not in m1_runs]:
        raise SystemExit(f"--m1-runs: {', '.join(unknown)} not among {', '.join(m1_runs)}")
    bf16 = device.type == "cuda"
    torch_s = torch_steps(lcfg, [x], device, bf16, args, optimizer=True)
    torch_accum4_s = torch_steps(lcfg, xs4, device, bf16, args, optimizer=True)
    runs = {}
    for name in names:
        clip, overlap, batches = m1_runs[name]
        runs[name] = diagnostic("m1", name, lambda: ours(lcfg, batches, device, args, M1, clip, overlap))
        print(f"case m1 {name}: {runs[name]}", flush=True)
    base = runs["no_clip"]
    measured = floors(lcfg, x, device, args, base)
    step = base["steady_s"]
    params = sum(p.numel() for p in _meta_llama(lcfg).parameters())
    out = {"params": params, "torch_steady_s": torch_s, "torch_accum4_s": torch_accum4_s, "steady_s": step,
           "floors": measured, "ratio": step / max(measured.values()), "bar": 1.2, "speed": torch_s / step,
           "bar_speed": 0.50, "tflops": 6 * params * x.numel() / step / 1e12, "runs": runs}
    measured = {name: run["steady_s"] for name, run in runs.items() if "steady_s" in run}
    if "clip" in measured:
        out.update(clip_over_no_clip=measured["clip"] / step, bar_clip=1.1)
    if "clip_lane" in measured:
        out["clip_lane_over_no_clip"] = measured["clip_lane"] / step
    if "lane" in measured:
        out["lane_speed"] = torch_s / measured["lane"]  # (unclipped, the device lane on: Note [device lane])
    if "accum4" in measured:
        out.update(accum4_speed=torch_accum4_s / measured["accum4"], bar_accum4=0.85)
    if "accum4_lane" in measured:
        out["accum4_lane_speed"] = torch_accum4_s / measured["accum4_lane"]  # (the update's tail on both workers)
    return out


def _meta_llama(lcfg):
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        return LlamaForCausalLM(lcfg)


def m2_base(gpu_bytes: int, tiny: bool) -> Rung:
    """The rung whose width m2 takes: the 13B's on a GPU of 100 GiB or more, the 7B's below (a tiny one for the
    smoke test)."""
    if tiny:
        return Rung("tiny", 64, 4, 4, 2, 128, vocab_size=256)
    return next(r for r in LADDERS["llama"] if r.name == ("llama-13B" if gpu_bytes >= 100 << 30 else "llama-7B"))


def rung_config(rung: Rung, seq: int):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=rung.vocab_size, hidden_size=rung.d_model, intermediate_size=rung.ffn_dim,
                       num_hidden_layers=rung.n_layer, num_attention_heads=rung.n_head,
                       num_key_value_heads=rung.n_kv_head, max_position_embeddings=seq, bos_token_id=None,
                       eos_token_id=None, pad_token_id=None)


def estimate_fits(rung: Rung, args, nvme_dir: str) -> int | None:
    """Does `infinity estimate` say the shape trains here with placement.policy = "auto"? The device bytes of the
    activations it left free for them when it does (memory.activation_reserve for the engine: Note [auto
    placement]), None when not."""
    sets = rung.sets() + [f"model.seq_len={args.seq}", f"run.batch_size={args.batch}", 'placement.policy="auto"',
                          f'nvme.paths=["{nvme_dir}"]'] + (['precision.compute_dtype="bf16"'] if args.device == "cuda"
                                                           else [])
    cmd = [sys.executable, "-m", "infinity", "estimate", "--json"] + [a for s in sets for a in ("--set", s)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"infinity estimate failed ({done.returncode}): {done.stderr[-2000:]}")
    out = json.loads(done.stdout)
    return next(r for r in out["table"] if r["configured"])["activations"]["device"] if out["ok"] else None


def m2_shape(gpu_bytes: int, args, nvme_dir: str) -> tuple[Rung, list[str], int]:
    """The largest shape of m2's width, from the rung's layers down, whose fp32 state is >= 1.2x the GPU and that
    the estimator says fits; the shapes judged (a line each); the activations the estimate left free for it."""
    base, judged = m2_base(gpu_bytes, args.tiny), []
    need = 0 if args.tiny else OVER_DEVICE * gpu_bytes / STATE_BYTES
    one, two = (sum(p.numel() for p in _meta_llama(rung_config(dataclasses.replace(base, n_layer=n), args.seq))
                    .parameters()) for n in (1, 2))  # (the rest is a block's parameters per layer)
    for layers in range(base.n_layer, 0, -1):
        rung = dataclasses.replace(base, name=f"{base.name}-{layers}L", n_layer=layers)
        params = one + (layers - 1) * (two - one)
        if params < need:
            break
        acts = estimate_fits(rung, args, nvme_dir)
        judged.append(f"{rung.name}: {params / 1e9:.2f}B parameters, {'fits' if acts is not None else 'does not fit'}")
        if acts is not None:
            return rung, judged, acts
    raise RuntimeError("no shape of m2's width is both over 1.2x the GPU's memory and fits this machine: "
                       + "; ".join(judged))


def case_m2(device, args) -> dict:
    gpu_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    nvme_dir = tempfile.mkdtemp(prefix="bench-m2-", dir=args.dir)
    rung, judged, acts = m2_shape(gpu_bytes, args, nvme_dir)
    lcfg = rung_config(rung, args.seq)
    (x,) = tokens(lcfg, args)
    # (the engine API does not trace the activations: the estimate's, as `infinity train` would reserve them)
    run = ours(lcfg, [x], device, args, {"policy": "auto"}, nvme_dir=nvme_dir, memory={"activation_reserve": acts})
    measured = floors(lcfg, x, device, args, run, nvme_dir)
    params = sum(p.numel() for p in _meta_llama(lcfg).parameters())
    step = run["steady_s"]
    return {"shape": dataclasses.asdict(rung), "judged": judged, "params": params, "gpu_bytes": gpu_bytes,
            "state_over_gpu": params * STATE_BYTES / gpu_bytes if gpu_bytes else None, "steady_s": step,
            "floors": measured, "ratio": step / max(measured.values()), "bar": 1.25,
            "tflops": 6 * params * x.numel() / step / 1e12, "run": run}


def ds_worker(args) -> None:
    """The child: one DeepSpeed engine at ZeRO stage `--ds-stage` with the optimizer on the CPU; its steady step
    printed as JSON on the last line."""
    import deepspeed
    from transformers import LlamaForCausalLM
    device = torch.device(args.device)
    lcfg = llama_config(args)
    torch.manual_seed(0)
    model = LlamaForCausalLM(lcfg)
    bf16 = device.type == "cuda"
    ds_config = deepspeed_config(args.batch, args.ds_stage, {"device": "cpu", "pin_memory": bf16}, bf16)
    deepspeed.init_distributed(dist_backend="nccl" if bf16 else "gloo")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    (x,) = tokens(lcfg, args)
    x = x.to(engine.device)

    def step():
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    print(json.dumps({"steady_s": steady(step, device, args.warmup, args.steps)}), flush=True)


def deepspeed_steady(args, stage: int) -> float:
    cmd = [sys.executable, os.path.abspath(__file__), "--ds-stage", str(stage), "--device", args.device,
           "--seq", str(args.seq), "--batch", str(args.batch), "--vocab", str(args.vocab),
           "--warmup", str(args.warmup), "--steps", str(args.steps)] + (["--tiny"] if args.tiny else [])
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 200), "RANK": "0",
           "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    if args.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"DeepSpeed ZeRO-{stage} worker failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["steady_s"]


def case_d2(device, args, done: dict) -> dict:
    import importlib.util
    if importlib.util.find_spec("deepspeed") is None:
        raise SystemExit("case d2 needs DeepSpeed: pip install deepspeed (its CPU Adam op is built on first use, "
                         "which needs a compiler and ninja; docs/benchmarks.md), or leave d2 out of --cases")
    if args.m1_steady_s is not None:  # m1's steady step, measured by an earlier process (gpu_check.sh)
        step = args.m1_steady_s
    elif "m1" in done:
        step = done["m1"]["steady_s"]
    else:
        lcfg = llama_config(args)
        step = ours(lcfg, tokens(lcfg, args), device, args, M1)["steady_s"]
    zero2 = deepspeed_steady(args, 2)
    out = {"steady_s": step, "deepspeed_zero2_s": zero2, "ratio": step / zero2, "bar": 0.5}
    zero3 = diagnostic("d2", "zero3", lambda: {"steady_s": deepspeed_steady(args, 3)})
    out["zero3"] = zero3
    if "steady_s" in zero3:
        out["zero3_ratio"] = step / zero3["steady_s"]
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="m1,m2,d2", help="comma-separated: m1, m2, d2")
    ap.add_argument("--dir", default=None, help="m2: a directory on the disk the state may go to (default: /tmp)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000, help="(the tiny model's vocabulary; the Llama's is 32000)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--timeout", type=int, default=900, help="seconds for DeepSpeed's child process")
    ap.add_argument("--tiny", action="store_true", help="tiny models and one timed step (smoke test)")
    ap.add_argument("--m1-runs", default="no_clip,clip,lane,clip_lane,accum4,accum4_lane",
                    help="case m1's runs, comma-separated (no_clip always runs: the others are measured against it): "
                         "no_clip, clip, lane, clip_lane, accum4, accum4_lane (4 micro-batches with the device lane)")
    ap.add_argument("--m1-steady-s", type=float, default=None, help="case d2: infinity's step, m1's unclipped "
                    "steady step measured by an earlier run (gpu_check.sh), instead of running it again")
    ap.add_argument("--ds-stage", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    return ap


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    args.tail_units = 0  # (bench_gpu's llama_config reads args.tiny, args.vocab and args.seq only)
    if args.tiny:
        args.seq, args.batch, args.vocab, args.warmup, args.steps = 16, 2, 256, 1, 1
    if args.ds_stage is not None:
        return ds_worker(args)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # both sides: the comparison is at the same maths
    out = {"machine": machine(), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "model": {"seq": args.seq, "batch": args.batch}}
    done: dict = {}
    cases = {"m1": case_m1, "m2": case_m2, "d2": lambda d, a: case_d2(d, a, done)}
    for name in args.cases.split(","):
        out[name] = done[name] = cases[name](device, args)
        print(f"case {name}: {json.dumps(out[name], default=str)}", flush=True)
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
