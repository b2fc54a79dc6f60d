"""CPU Adam throughput: infinity's adam_step on one flat shard vs torch.optim.AdamW variants.

    python benchmarks/bench_cpu_adam.py --json runs/bench_cpu_adam.json --numel 100_000_000 --threads 2

Reports the median seconds per step and Gparam/s (parameters updated per second / 1e9)
of: adam_step (fused kernel, one flat fp32 shard), adam_step_reference (plain torch
ops), and torch.optim.AdamW with fused=True, foreach=True and the for-loop, the last
three over a list of --param-numel sized tensors (as a model's parameters arrive).
The `[optimizer] state_dtype` updates (optim/state_update.py) step the same flat shard
with the state stored in their dtypes: "fp32", "bf16" (moments) and "bf16_master", each
as the engine runs it (Note [chunked upcast]: 2^18 elements at a time) and, for the
16-bit ones, upcast whole as before that Note ("whole run": run-sized fp32 copies).
`--only TEXT` runs the variants whose name contains TEXT.
Memory: about 4 * 4 * numel bytes per variant alive at a time (param, grad, 2 states).

    python benchmarks/bench_cpu_adam.py --json adam.json --numel 12_582_912 --threads 2 --only state_dtype
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from infinity.memory.tier import StateDtype  # noqa: E402
from infinity.optim import AdamHyper, adam_step, adam_step_reference  # noqa: E402
from infinity.optim.state_update import rounding_bits, state_update_for, stochastic_round  # noqa: E402

LR, BETAS, EPS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 1e-8, 0.1


def _time(step_fn, repeats: int) -> list[float]:
    step_fn()  # warm-up: torch.optim allocates its state lazily on the first step
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step_fn()
        times.append(time.perf_counter() - start)
    return times


def bench_flat(kernel, numel: int, repeats: int) -> list[float]:
    master, grad = torch.randn(numel), torch.randn(numel)
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    hyper = AdamHyper(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY, decoupled=True)
    step = 0

    def step_fn():
        nonlocal step
        step += 1
        kernel(master, grad, exp_avg, exp_avg_sq, step=step, hyper=hyper)  # grad_scale=None: grad untouched

    return _time(step_fn, repeats)


def _whole_run(state_dtype: StateDtype):
    """The 16-bit update as it ran before Note [chunked upcast]: the whole run upcast at once (the baseline)."""
    def step(master, grad, exp_avg, exp_avg_sq, *, step, hyper, grad_scale, unit, first):
        p = master.float() if state_dtype is StateDtype.BF16_MASTER else master
        m, v = exp_avg.float(), exp_avg_sq.float()
        adam_step(p, grad, m, v, step=step, hyper=hyper, grad_scale=grad_scale)
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
        if state_dtype is StateDtype.BF16_MASTER:
            bits = rounding_bits(p.numel(), seed=0, unit=unit, step=step, first=first, device=p.device)
            master.copy_(stochastic_round(p, bits))
    return step


def bench_state(state_dtype: StateDtype, numel: int, repeats: int, whole: bool = False) -> list[float]:
    """One `[optimizer] state_dtype` update of a flat shard stored in that mode's dtypes."""
    master_dtype = torch.bfloat16 if state_dtype is StateDtype.BF16_MASTER else torch.float32
    moments_dtype = torch.float32 if state_dtype is StateDtype.FP32 else torch.bfloat16
    master, grad = torch.randn(numel).to(master_dtype), torch.randn(numel)
    exp_avg, exp_avg_sq = torch.zeros(numel, dtype=moments_dtype), torch.zeros(numel, dtype=moments_dtype)
    hyper = AdamHyper(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY, decoupled=True)
    update = _whole_run(state_dtype) if whole else state_update_for(state_dtype, seed=0).step
    step = 0

    def step_fn():
        nonlocal step
        step += 1
        update(master, grad, exp_avg, exp_avg_sq, step=step, hyper=hyper, grad_scale=None, unit=1, first=0)

    return _time(step_fn, repeats)


def bench_torch(mode: str, numel: int, param_numel: int, repeats: int) -> list[float]:
    sizes = [param_numel] * (numel // param_numel) + ([numel % param_numel] if numel % param_numel else [])
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[mode]
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, **flags)
    return _time(opt.step, repeats)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, type=Path, help="write results here")
    parser.add_argument("--numel", type=lambda s: int(s.replace("_", "")), default=100_000_000)
    parser.add_argument("--param-numel", type=lambda s: int(s.replace("_", "")), default=4_194_304,
                        help="elements per parameter tensor for the torch.optim variants")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", default="", help="run only the variants whose name contains this")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    variants = {
        "infinity.adam_step": lambda: bench_flat(adam_step, args.numel, args.repeats),
        "infinity.adam_step_reference": lambda: bench_flat(adam_step_reference, args.numel, args.repeats),
        "torch.AdamW(fused=True)": lambda: bench_torch("fused", args.numel, args.param_numel, args.repeats),
        "torch.AdamW(foreach=True)": lambda: bench_torch("foreach", args.numel, args.param_numel, args.repeats),
        "torch.AdamW(for-loop)": lambda: bench_torch("for-loop", args.numel, args.param_numel, args.repeats),
    }
    for mode in StateDtype:
        variants[f"state_dtype={mode.value}"] = lambda m=mode: bench_state(m, args.numel, args.repeats)
        if mode is not StateDtype.FP32:
            variants[f"state_dtype={mode.value} (whole run)"] = lambda m=mode: bench_state(m, args.numel, args.repeats,
                                                                                           whole=True)
    variants = {name: run for name, run in variants.items() if args.only in name}
    results = {}
    for name, run in variants.items():
        times = run()
        gc.collect()  # free this variant's tensors before the next allocates its own
        median = statistics.median(times)
        results[name] = {"median_s": median, "gparam_per_s": args.numel / median / 1e9, "times_s": times}
        print(f"{name:32s} {median * 1e3:9.1f} ms/step {results[name]['gparam_per_s']:7.3f} Gparam/s", flush=True)

    report = {
        "benchmark": "cpu_adam",
        "numel": args.numel,
        "param_numel": args.param_numel,
        "threads": args.threads,
        "repeats": args.repeats,
        "only": args.only,
        "torch": torch.__version__,
        "results": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
