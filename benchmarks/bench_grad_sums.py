"""Gradient accumulation with the gradients off the compute device: this checkout beside another one, interleaved.

Note [gradient sums ahead] (infinity/runtime/grad_reduce.py): after a window's first backward, each unit's gradient
is added to the window's sum so far, which is read from the gradient store; fetched as the unit's backward starts,
the read runs under that backward instead of after it. On this CPU the store that costs a read is NVMe: each run
trains a GPT with its gradients on NVMe (parameters and optimizer state in host memory) for `--windows` windows of
`--accum` micro-batches, in a fresh process, and reports the median time of a window after the first (forward,
backward, the update), and the training thread's seconds in the sums' fetch in it (`sum_wait_s`: the read's wait
when fetched at the gradient's end; only the rest of it when fetched ahead). With `--before DIR` (a checkout of
another commit, e.g. `git worktree add /tmp/before <commit>`), that checkout's runs alternate with these
(`--repeats` each), and `ratio` is the median of this checkout's windows over the other's.

    python benchmarks/bench_grad_sums.py --dir /path/on/nvme --before /tmp/before --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, median, write_json  # noqa: E402

_RUN = r"""
import json, statistics, sys, time
import torch
import infinity
from infinity.models.gpt import GPT, GPTConfig, gpt_init, synthetic_batch
layers, d_model, seq, batch, accum, windows, swap = sys.argv[1:8]
accum, windows = int(accum), int(windows)
torch.set_num_threads(2)
torch.manual_seed(0)
cfg = GPTConfig(n_layer=int(layers), d_model=int(d_model), n_head=8, vocab_size=4096, seq_len=int(seq))
config = {"placement": {"params": "host", "grads": "nvme", "optimizer": "host"}, "nvme": {"paths": [swap]},
          "train": {"grad_accum_steps": accum}, "optimizer": {"lr": 1e-4, "grad_clip": 1.0}}
from infinity.runtime.grad_reduce import GradReducer
fetch, waited = GradReducer.fetch, [0.0]
def timed_fetch(self, unit, device):  # the training thread's time in the sum's fetch (both checkouts have it)
    start = time.perf_counter()
    try:
        return fetch(self, unit, device)
    finally:
        waited[0] += time.perf_counter() - start
GradReducer.fetch = timed_fetch
g = torch.Generator().manual_seed(1)
data = [synthetic_batch(cfg, int(batch), g) for _ in range(accum)]
seconds, sums = [], []
with infinity.initialize(GPT(cfg), config, init_fn=gpt_init) as engine:
    for _ in range(windows):
        start, waited[0] = time.perf_counter(), 0.0
        for x, y in data:
            engine.backward(engine(x, y))
        engine.step()
        seconds.append(time.perf_counter() - start)
        sums.append(waited[0])
print(json.dumps({"window_s": statistics.median(seconds[1:]), "windows_s": seconds,
                  "sum_wait_s": statistics.median(sums[1:])}))
"""


def run(checkout: str, args) -> dict:
    with tempfile.TemporaryDirectory(dir=args.dir) as swap:
        out = subprocess.run([sys.executable, "-c", _RUN, str(args.layers), str(args.d_model), str(args.seq),
                              str(args.batch), str(args.accum), str(args.windows), swap],
                             cwd=checkout, capture_output=True, text=True, timeout=args.timeout,
                             env={**os.environ, "PYTHONPATH": checkout})
    if out.returncode != 0:
        raise SystemExit(f"the run in {checkout} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="directory on the disk under test (the swap files)")
    ap.add_argument("--before", default=None, help="a checkout of another commit, run alternately")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--windows", type=int, default=4, help="windows per run; the first is not counted")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    checkouts = {"this": here} | ({"before": os.path.abspath(args.before)} if args.before else {})
    runs: dict[str, list[float]] = {name: [] for name in checkouts}
    waits: dict[str, list[float]] = {name: [] for name in checkouts}
    for i in range(args.repeats):
        order = list(checkouts) if i % 2 == 0 else list(reversed(checkouts))  # who goes first alternates
        for name in order:
            result = run(checkouts[name], args)
            runs[name].append(result["window_s"])
            waits[name].append(result["sum_wait_s"])
            print(f"{name}: window {result['window_s']:.3f} s, in the sums' fetch {result['sum_wait_s']:.3f} s",
                  flush=True)
    out = {"benchmark": "grad_sums", "date": time.strftime("%Y-%m-%d"), "machine": machine(),
           "args": {k: v for k, v in vars(args).items() if k != "json"},
           "window_s": {name: median(v) for name, v in runs.items()}, "runs": runs,
           "sum_wait_s": {name: median(v) for name, v in waits.items()}, "sum_wait_runs": waits}
    if args.before:
        out["ratio"] = out["window_s"]["this"] / out["window_s"]["before"]
        print(f"this / before: {out['ratio']:.3f} (median window {out['window_s']['this']:.3f} s vs "
              f"{out['window_s']['before']:.3f} s)")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
