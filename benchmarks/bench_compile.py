"""What `[compile] units = true` gains (Note [compiled units]): a GPT's steady step, eager vs compiled units.

A GPT (default: 4 layers x 256, 8 heads, vocab 4096, seq 256, batch 8, fp32) trains through the engine with the
parameters, gradients and optimizer state on one tier (`--tier`; on a CPU machine "device" is the CPU), once eager
and once with compiled units (inductor), each variant in its own fresh process, alternating, `--repeats` times.
A process's steady step is the median of its steps after `--warmup`; its first step (the compile, for the
compiled variant: cold in the first process, from inductor's cache after) is reported apart. The ratio is the
median of the compiled processes' steady steps over the eager ones'. The losses of both are printed side by side
(equal within float tolerance).

    python benchmarks/bench_compile.py --json                 # eager vs compiled, device tier
    python benchmarks/bench_compile.py --tier host --json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time, torch, infinity
from infinity.models.gpt import GPT, GPTConfig, synthetic_batch
layers, width, heads, seq, batch, steps, compiled, tier, swap = sys.argv[1:10]
cfg = GPTConfig(vocab_size=4096, seq_len=int(seq), n_layer=int(layers), n_head=int(heads), d_model=int(width))
torch.manual_seed(0)
config = {"optimizer": {"lr": 1e-4}, "placement": {"params": tier, "grads": tier, "optimizer": tier},
          "compile": {"units": compiled == "1"}}
if tier == "nvme":
    config["nvme"] = {"paths": [swap]}
g = torch.Generator().manual_seed(1)
times, losses = [], []
with infinity.initialize(GPT(cfg), config) as engine:
    for _ in range(int(steps)):
        x, y = synthetic_batch(cfg, int(batch), g)
        t = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
print(json.dumps({"step_s": times, "losses": losses}))
"""


def run(args, compiled: bool, swap: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(args.layers), str(args.width), str(args.heads),
                          str(args.seq), str(args.batch), str(args.steps), "1" if compiled else "0", args.tier, swap],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench_compile: the {'compiled' if compiled else 'eager'} run failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["steady_s"] = statistics.median(result["step_s"][args.warmup:])
    result["first_s"] = result["step_s"][0]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of a process's steady median")
    p.add_argument("--repeats", type=int, default=3, help="processes per variant, alternating")
    p.add_argument("--tier", choices=("device", "host", "nvme"), default="device")
    p.add_argument("--swap", default=None, help="swap directory for --tier nvme (default: a temporary one)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    runs: dict[str, list[dict]] = {"eager": [], "compiled": []}
    with tempfile.TemporaryDirectory(dir=args.swap) as swap:
        for i in range(args.repeats):
            for name in ("eager", "compiled"):
                runs[name].append(run(args, name == "compiled", os.path.join(swap, f"{name}{i}")))
                if not args.json:
                    print(f"{name:9s} repeat {i}: steady {runs[name][-1]['steady_s']:.4f} s, first step "
                          f"{runs[name][-1]['first_s']:.2f} s", flush=True)
    eager = statistics.median(r["steady_s"] for r in runs["eager"])
    compiled = statistics.median(r["steady_s"] for r in runs["compiled"])
    tokens = args.batch * args.seq
    summary = {
        "benchmark": "compile", "args": vars(args), "machine": platform.machine(), "cpus": os.cpu_count(),
        "python": platform.python_version(), "torch": __import__("torch").__version__,
        "eager_step_s": eager, "compiled_step_s": compiled, "ratio_compiled_over_eager": compiled / eager,
        "eager_tokens_per_s": tokens / eager, "compiled_tokens_per_s": tokens / compiled,
        "compile_first_step_s": [r["first_s"] for r in runs["compiled"]],
        "eager_first_step_s": [r["first_s"] for r in runs["eager"]],
        "max_loss_difference": max(abs(a - b) for e, c in zip(runs["eager"], runs["compiled"])
                                   for a, b in zip(e["losses"], c["losses"])),
        "runs": runs,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"steady step: eager {eager:.4f} s, compiled units {compiled:.4f} s: {compiled / eager:.3f}x "
              f"({tokens / eager:.0f} -> {tokens / compiled:.0f} tokens/s); first step of the compiled runs "
              f"{', '.join(f'{t:.1f}' for t in summary['compile_first_step_s'])} s; losses differ by at most "
              f"{summary['max_loss_difference']:.2e}")


if __name__ == "__main__":
    main()
