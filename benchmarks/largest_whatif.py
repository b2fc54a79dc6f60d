"""`infinity estimate --largest` as it would answer on another machine: what this machine's estimator plans for a
GPU box it does not have (a what-if, not a measurement; the GPU check measures it: benchmarks/gpu_check.sh).

    python benchmarks/largest_whatif.py --machine h200 --seq-len 1024 \
        --set precision.compute_dtype=bf16 --set run.batch_size=1 --json largest-whatif.json
    (--size ram_available_gib=240 --size disk_free_gib=900: the same GPU with more RAM and disk)

The machine's sizes are faked where the estimate reads them (psutil's RAM, shutil's disk usage, torch.cuda's free
memory) and its link rates given (the estimate would measure them there); the runtime's RSS is a fixed 600 MiB
(a fresh process importing torch with CUDA). Everything else is the real estimate of the job (`infinity estimate
--largest llama` with the job's `--set` lines): the plan search, the preflight checks with memory.headroom. The
JSON has the machine, each mode's answer (shape, parameters, its share of the machine: state bytes / (free GPU
memory + RAM available + free disk), the plan's `--set` lines, the predicted step) and the seconds it took.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import io
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import redirect_stdout

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import write_json  # noqa: E402

GiB = 1 << 30

# the GPU machine lent to this project's checks (device README: one H200, 128 GiB of RAM, a 64 GiB disk); the
# RAM available and free disk as its earlier runs found them (benchmarks/results/gpu_2026-11-27_call1_env.log:
# 143,771 MiB of GPU memory, 0 used); rates: PCIe 5 pinned copies, the H200's bf16 matmul at half its peak,
# the worker's Adam of 8.4M elements in 2.4 ms (bench_gpu's case l profile), a virtual disk
MACHINES = {
    "h200": {"gpu_total_gib": 140.4, "gpu_free_gib": 139.0, "ram_total_gib": 125.0, "ram_available_gib": 120.0,
             "disk_total_gib": 64.0, "disk_free_gib": 45.0,
             "rates": {"nvme_read": 3e9, "nvme_write": 2e9, "h2d": 50e9, "d2h": 50e9, "cpu_adam": 3.5e9,
                       "device_adam": 2e11, "matmul_flops": 8e14, "memory_bw": 4e12}},
    "h100": {"gpu_total_gib": 79.6, "gpu_free_gib": 79.0, "ram_total_gib": 125.0, "ram_available_gib": 120.0,
             "disk_total_gib": 64.0, "disk_free_gib": 45.0,
             "rates": {"nvme_read": 3e9, "nvme_write": 2e9, "h2d": 50e9, "d2h": 50e9, "cpu_adam": 3.5e9,
                       "device_adam": 2e11, "matmul_flops": 5e14, "memory_bw": 3e12}},
}


def fake_machine(m: dict) -> None:
    """Where the estimate reads the machine: the GPU's free memory, the RAM, the disk, the link rates, the runtime."""
    import psutil
    import torch

    from infinity.machine import link_rates
    from infinity.memory import cost_model
    from infinity.plan import probe
    gib = lambda key: int(m[key] * GiB)  # noqa: E731
    torch.cuda.is_available = lambda: True
    torch.cuda.mem_get_info = lambda *a: (gib("gpu_free_gib"), gib("gpu_total_gib"))
    torch.cuda.current_device = lambda: 0
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_name = lambda *a: "what-if GPU"
    vm = collections.namedtuple("vm", "total available percent used free")
    ram = vm(gib("ram_total_gib"), gib("ram_available_gib"), 0.0, 0, gib("ram_available_gib"))
    psutil.virtual_memory = lambda: ram
    du = collections.namedtuple("du", "total used free")
    disk = du(gib("disk_total_gib"), gib("disk_total_gib") - gib("disk_free_gib"), gib("disk_free_gib"))
    shutil.disk_usage = lambda path: disk
    rates = dataclasses.replace(cost_model.default_rates(True), **m["rates"], source="what-if")
    link_rates.link_rates = lambda *a, **k: rates
    link_rates.cached_link_rates = lambda cuda: rates
    probe.runtime_rss = lambda remeasure=False, modules=(), compiled=None: 600 << 20
    probe.host_time = lambda units, *a, **k: (0.0, 0.0)  # (the host's time per step: not what this answers)
    probe.op_seconds = lambda *a, **k: 5e-6


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--machine", default="h200", choices=sorted(MACHINES))
    ap.add_argument("--size", action="append", default=[], metavar="KEY=GIB",
                    help="one of the machine's sizes instead of the preset's, e.g. --size ram_available_gib=240 "
                         "(gpu_total_gib, gpu_free_gib, ram_total_gib, ram_available_gib, disk_total_gib, "
                         "disk_free_gib)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="the job's own --set lines")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    machine = dict(MACHINES[args.machine])
    for item in args.size:
        key, _, value = item.partition("=")
        if key not in machine or key == "rates":
            raise SystemExit(f"--size {item}: not a size of the machine; one of "
                             f"{', '.join(k for k in machine if k != 'rates')}")
        machine[key] = float(value)
    fake_machine(machine)
    from infinity.job import cli
    with tempfile.TemporaryDirectory(prefix="infinity-whatif-") as root:
        argv = ["estimate", "--largest", "llama", "--seq-len", str(args.seq_len), "--json",
                "--set", f"run.dir={root}", "--set", "run.checkpoint=false", "--set", "run.eval_every=0"]
        argv += [a for s in args.set for a in ("--set", s)]
        start, text = time.perf_counter(), io.StringIO()
        with redirect_stdout(text):
            rc = cli.main(argv)
        seconds = time.perf_counter() - start
    answers = json.loads(text.getvalue())
    out = {"machine": args.machine, **machine, "seq_len": args.seq_len, "set": args.set, "returncode": rc,
           "seconds": round(seconds, 1), "answers": answers}
    for name, a in zip(("full", "lora"), answers):  # (MODES' order: full fine-tuning, LoRA)
        found = a.get("largest") or {}
        out[f"{name}_params"] = found.get("num_params")
        out[f"{name}_share"] = found["state_bytes"] / found["free_bytes"] if found.get("free_bytes") else None
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
