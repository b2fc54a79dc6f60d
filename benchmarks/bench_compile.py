"""What `[compile] units = true` gains (Note [compiled units]): a GPT's steady step, eager vs compiled units.

A GPT (default: 4 layers x 256, 8 heads, vocab 4096, seq 256, batch 8, fp32) trains through the engine with the
parameters, gradients and optimizer state on one tier (`--tier`; on a CPU machine "device" is the CPU). Each of
`--repeats` fresh processes holds two engines of the same weights, one eager and one with compiled units
(inductor), and steps them in turn on the same batches (who goes first alternating), so the load of a shared
machine hits both alike. The headline is the median over all steps after `--warmup` of compiled / eager step by
step; the medians of each are beside it. The first step (for the compiled engine: the compile, cold in the first
process, from inductor's cache after) is reported apart, with dynamo's count of compiled graphs (1: the blocks
share one) and the largest difference of the two engines' losses.

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
from torch._dynamo.utils import counters
from infinity.models.gpt import GPT, GPTConfig, synthetic_batch
layers, width, heads, seq, batch, steps, tier, swap = sys.argv[1:9]
cfg = GPTConfig(vocab_size=4096, seq_len=int(seq), n_layer=int(layers), n_head=int(heads), d_model=int(width))
engines = {}
for name in ("eager", "compiled"):  # the same weights and data; one engine each, stepped in turn
    torch.manual_seed(0)
    config = {"optimizer": {"lr": 1e-4}, "placement": {"params": tier, "grads": tier, "optimizer": tier},
              "compile": {"units": name == "compiled"}}
    if tier == "nvme":
        config["nvme"] = {"paths": [swap + "/" + name]}
    engines[name] = infinity.initialize(GPT(cfg), config)
g = torch.Generator().manual_seed(1)
out = {name: {"step_s": [], "losses": []} for name in engines}
for step in range(int(steps)):
    x, y = synthetic_batch(cfg, int(batch), g)
    for name in (("eager", "compiled") if step % 2 == 0 else ("compiled", "eager")):  # alternating who goes first
        engine = engines[name]
        t = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        engine.synchronize()  # its update done before the other engine's step: each is timed whole
        out[name]["step_s"].append(time.perf_counter() - t)
        out[name]["losses"].append(loss.item())
for engine in engines.values():
    engine.close()
out["graphs"] = counters["stats"]["unique_graphs"]
print(json.dumps(out))
"""


def run(args, swap: str) -> dict:
    """One process: both engines, stepped in turn on the same batches (a paired comparison: the machine's load
    hits both alike)."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(args.layers), str(args.width), str(args.heads),
                          str(args.seq), str(args.batch), str(args.steps), args.tier, swap],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench_compile: the run failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for name in ("eager", "compiled"):
        result[name]["steady_s"] = statistics.median(result[name]["step_s"][args.warmup:])
        result[name]["first_s"] = result[name]["step_s"][0]
    result["paired_ratios"] = [c / e for c, e in zip(result["compiled"]["step_s"][args.warmup:],
                                                     result["eager"]["step_s"][args.warmup:])]
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
    runs = []
    with tempfile.TemporaryDirectory(dir=args.swap) as swap:
        for i in range(args.repeats):
            os.makedirs(os.path.join(swap, str(i)))
            runs.append(run(args, os.path.join(swap, str(i))))
            if not args.json:
                r = runs[-1]
                print(f"process {i}: steady eager {r['eager']['steady_s']:.4f} s, compiled "
                      f"{r['compiled']['steady_s']:.4f} s (median paired ratio "
                      f"{statistics.median(r['paired_ratios']):.3f}); first step eager {r['eager']['first_s']:.2f} s, "
                      f"compiled {r['compiled']['first_s']:.2f} s; {r['graphs']} compiled graph(s)", flush=True)
    eager = statistics.median(r["eager"]["steady_s"] for r in runs)
    compiled = statistics.median(r["compiled"]["steady_s"] for r in runs)
    ratio = statistics.median(x for r in runs for x in r["paired_ratios"])
    tokens = args.batch * args.seq
    summary = {
        "benchmark": "compile", "args": vars(args), "machine": platform.machine(), "cpus": os.cpu_count(),
        "python": platform.python_version(), "torch": __import__("torch").__version__,
        "load_average": os.getloadavg(),
        "eager_step_s": eager, "compiled_step_s": compiled, "ratio_of_medians": compiled / eager,
        "median_paired_ratio": ratio,  # the headline: compiled over eager, step by step side by side
        "eager_tokens_per_s": tokens / eager, "compiled_tokens_per_s": tokens / compiled,
        "compile_first_step_s": [r["compiled"]["first_s"] for r in runs],
        "eager_first_step_s": [r["eager"]["first_s"] for r in runs],
        "compiled_graphs": [r["graphs"] for r in runs],
        "max_loss_difference": max(abs(a - b) for r in runs
                                   for a, b in zip(r["eager"]["losses"], r["compiled"]["losses"])),
        "runs": runs,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"steady step: eager {eager:.4f} s, compiled units {compiled:.4f} s; compiled / eager, step by step: "
              f"{ratio:.3f}x (medians: {compiled / eager:.3f}x) "
              f"({tokens / eager:.0f} -> {tokens / compiled:.0f} tokens/s); first step of the compiled runs "
              f"{', '.join(f'{t:.1f}' for t in summary['compile_first_step_s'])} s; losses differ by at most "
              f"{summary['max_loss_difference']:.2e}")


if __name__ == "__main__":
    main()
