"""Train a GPT whose training state is larger than this machine's RAM, with state on NVMe.

    python benchmarks/bench_out_of_core.py --dir /path/on/fast/disk --json out.json

Default: a 2.07B-parameter GPT (26 layers, d_model 2560) built under
`infinity.meta_init()`, parameters, gradients and optimizer state on NVMe
(33 GB of fp32 training state, plus gradients), 3 AdamW steps on one fixed
batch (so the loss must fall). Reports per step: time, loss, bytes moved per
link; and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import machine, peak_rss_bytes, write_json  # noqa: E402

import infinity  # noqa: E402
from infinity.models.gpt import GPT, GPTConfig, gpt_init, synthetic_batch  # noqa: E402


class RssSampler:
    """Samples this process's RSS every 50 ms; keeps the peak per named phase."""

    def __init__(self):
        self.phase, self.peaks = "init", {}
        self._proc = psutil.Process()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            rss = self._proc.memory_info().rss
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)
            time.sleep(0.05)

    def take(self) -> dict:
        out, self.peaks = {k: round(v / 2**30, 3) for k, v in self.peaks.items()}, {}
        return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="swap directory (default: a temporary one under /tmp)")
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--d-model", type=int, default=2560)
    ap.add_argument("--heads", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--grads", default="nvme", choices=["device", "host", "nvme"])
    ap.add_argument("--sub-group", type=int, default=1 << 23, help="optimizer sub-group size (elements)")
    ap.add_argument("--units-ahead", type=int, default=1, help="units prefetched ahead")
    ap.add_argument("--host-budget", default=None, help='[memory] host_budget, e.g. "2GiB" (default: auto)')
    ap.add_argument("--device-budget", default=None, help='[memory] device_budget, e.g. "2GiB" (default: auto)')
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def engine_config(args: argparse.Namespace, swap_dir: str | None = None) -> dict:
    """The engine's config for these arguments (budgets left out: "auto")."""
    config = {
        "optimizer": {"name": "adamw", "lr": args.lr, "weight_decay": 0.0, "grad_clip": 1.0,
                      "sub_group_size": args.sub_group},
        "precision": {"compute_dtype": args.dtype},
        "placement": {"params": "nvme", "grads": args.grads, "optimizer": "nvme"},
        "nvme": {"paths": [swap_dir or args.dir]},
        "prefetch": {"units_ahead": args.units_ahead},
    }
    budgets = {k: v for k, v in (("host_budget", args.host_budget), ("device_budget", args.device_budget)) if v}
    if budgets:
        config["memory"] = budgets
    return config


def main(argv=None) -> dict:
    args = parse_args(argv)
    swap_dir = args.dir or tempfile.mkdtemp(prefix="infinity-ooc-")
    os.makedirs(swap_dir, exist_ok=True)
    model_cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=args.heads,
                          d_model=args.d_model, bias=True)
    n_params = model_cfg.num_params()
    config = engine_config(args, swap_dir)
    t0 = time.perf_counter()
    with infinity.meta_init():
        model = GPT(model_cfg)
    engine = infinity.initialize(model, config, init_fn=gpt_init)
    init_s = time.perf_counter() - t0
    rss_after_init = peak_rss_bytes()
    x, y = synthetic_batch(model_cfg, args.batch, torch.Generator().manual_seed(0))
    sampler = RssSampler()
    steps = []
    try:
        for step in range(args.steps):
            before = dict(engine.manager.bytes_moved)
            t = time.perf_counter()
            sampler.phase = f"forward {step}"
            loss = engine(x, y)
            t_fwd = time.perf_counter() - t
            sampler.phase = f"backward {step}"
            engine.backward(loss)
            t_bwd = time.perf_counter() - t - t_fwd
            sampler.phase = f"step {step}"
            engine.step()
            dt = time.perf_counter() - t
            moved = {k: v - before[k] for k, v in engine.manager.bytes_moved.items()}
            steps.append({"step": step, "loss": float(loss.detach()), "seconds": round(dt, 2),
                          "forward_s": round(t_fwd, 2), "backward_s": round(t_bwd, 2),
                          "optimizer_s": round(dt - t_fwd - t_bwd, 2), "grad_norm": engine.last_grad_norm,
                          "bytes_moved": moved, "peak_rss_GiB": round(peak_rss_bytes() / 2**30, 3),
                          "rss_peak_by_phase_GiB": sampler.take(),
                          "staging_host_GiB": round(engine.manager.staging.host_bytes_allocated / 2**30, 3)})
            print(f"step {step}: loss {steps[-1]['loss']:.4f} {dt:.1f}s "
                  f"(fwd {t_fwd:.1f} bwd {t_bwd:.1f} opt {dt - t_fwd - t_bwd:.1f}) "
                  f"rss peak {peak_rss_bytes() / 2**30:.2f} GiB", flush=True)
        report = engine.memory_report()
    finally:
        engine.close()
        if args.dir is None:
            shutil.rmtree(swap_dir, ignore_errors=True)
    state_bytes = n_params * (4 * 4 + (4 if args.dtype == "fp32" else 2))
    losses = [s["loss"] for s in steps]
    result = {
        "benchmark": "out_of_core",
        "machine": machine(),
        "model": {"params": n_params, "layers": args.layers, "d_model": args.d_model, "vocab": args.vocab,
                  "seq": args.seq, "batch": args.batch, "dtype": args.dtype},
        "placement": config["placement"],
        "memory": config.get("memory", {"host_budget": "auto", "device_budget": "auto"}),
        "training_state_GB": round(state_bytes / 1e9, 2),
        "ram_GB": round(machine()["ram_GiB"] * 2**30 / 1e9, 2),
        "init_seconds": round(init_s, 1),
        "peak_rss_after_init_GiB": round(rss_after_init / 2**30, 3),
        "peak_rss_GiB": round(peak_rss_bytes() / 2**30, 3),
        "steps": steps,
        "loss_finite_and_falling": all(map(lambda v: v == v and abs(v) != float("inf"), losses))
        and all(b < a for a, b in zip(losses, losses[1:])),
        "memory_report": report,
    }
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
