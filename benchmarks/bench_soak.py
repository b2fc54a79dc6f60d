"""Soak: many steps with parameters and optimizer state on NVMe; resources must stay flat.

    python benchmarks/bench_soak.py --steps 500 --dir /path/on/nvme --json soak.json
    python benchmarks/bench_soak.py --faults --json soak-faults.json     # as root: faults, see below

Every `--every` steps it samples RSS, open file descriptors, threads, staging
(pinned / locked) bytes, and the swap files' sizes. After warm-up each must stay
flat: the report gives the first and last sample after warm-up and the largest
rise. A checkpoint is saved (keep_last 2) every `--save-every` steps, so saving
is soaked too.

With --faults (benchmarks/soak_faults.py; root, for a small tmpfs): 300 steps with background
checkpoints on a small filesystem that a helper process fills to ENOSPC and frees again, while
the job is SIGKILLed and resumed 5 times; at the end the parameters must equal an undisturbed
run's bit for bit, and RSS and open fds stay flat.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import psutil
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from common import machine, write_json  # noqa: E402

import infinity  # noqa: E402
from infinity.models.gpt import GPT, GPTConfig, gpt_init, synthetic_batch  # noqa: E402


def sample(engine, proc) -> dict:
    swap_bytes = sum(os.path.getsize(f) for f in engine.swap.files) if engine.swap else 0
    return {"rss_MiB": round(proc.memory_info().rss / 2**20, 1), "open_fds": proc.num_fds(),
            "threads": proc.num_threads(), "staging_MiB": round(engine.manager.staging.host_bytes_allocated / 2**20, 1),
            "swap_MiB": round(swap_bytes / 2**20, 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--faults", action="store_true", help="the fault soak (benchmarks/soak_faults.py; root)")
    ap.add_argument("--kills", type=int, default=5)
    args = ap.parse_args(argv)
    if args.faults:
        import soak_faults
        steps = args.steps if "--steps" in (sys.argv if argv is None else argv) else 300
        return soak_faults.main(steps=steps, kills=args.kills, json_path=args.json)
    root = tempfile.mkdtemp(prefix="bench-soak-", dir=args.dir)
    os.makedirs(os.path.join(root, "swap"))
    cfg = GPTConfig(vocab_size=4096, seq_len=64, n_layer=4, n_head=4, d_model=256)
    config = {"optimizer": {"lr": 3e-4, "grad_clip": 1.0}, "nvme": {"paths": [os.path.join(root, "swap")]},
              "placement": {"params": "nvme", "grads": "host", "optimizer": "nvme"},
              "checkpoint": {"keep_last": 2, "background": True}}
    with infinity.meta_init():
        model = GPT(cfg)
    engine = infinity.initialize(model, config, init_fn=gpt_init)
    proc = psutil.Process()
    g = torch.Generator().manual_seed(0)
    samples, losses, t0 = [], [], time.perf_counter()
    try:
        for step in range(args.steps):
            x, y = synthetic_batch(cfg, 4, g)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
            if (step + 1) % args.save_every == 0:
                engine.save_checkpoint(os.path.join(root, "ckpt", f"step-{step + 1}"))
            if (step + 1) % args.every == 0:
                engine.synchronize()
                samples.append({"step": step + 1, **sample(engine, proc)})
    finally:
        engine.close()
        shutil.rmtree(root, ignore_errors=True)
    after = [s for s in samples if s["step"] > args.warmup]
    drift = {k: round(max(s[k] for s in after) - after[0][k], 1) for k in after[0] if k != "step"}
    result = {"benchmark": "soak", "machine": machine(), "steps": args.steps, "params": cfg.num_params(),
              "seconds": round(time.perf_counter() - t0, 1), "first_after_warmup": after[0], "last": after[-1],
              "max_rise_after_warmup": drift, "loss_first_last": [losses[0], losses[-1]], "samples": samples}
    write_json(args.json, result)


if __name__ == "__main__":
    main()
