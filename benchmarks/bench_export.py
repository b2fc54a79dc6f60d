"""Peak memory of exporting a large checkpoint to one consolidated file.

    python benchmarks/bench_export.py --dir /path/on/nvme --json export.json

Builds a GPT (default 1.03B parameters) under meta_init with all state on NVMe,
saves a checkpoint, then exports it in a fresh process to torch.save and to
safetensors, each time measuring that process's peak RSS and time. (DeepSpeed's
zero_to_fp32 gathers the whole model in RAM: over 1 TB for an 80B model.)
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


def save(args, ckpt: str) -> dict:
    import infinity
    from infinity.models.gpt import GPT, GPTConfig, gpt_init
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=128, n_layer=args.layers, n_head=16, d_model=args.d_model)
    swap = tempfile.mkdtemp(prefix="bench-export-swap-", dir=args.dir)
    with infinity.meta_init():
        model = GPT(cfg)
    t = time.perf_counter()
    config = {"placement": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"}, "nvme": {"paths": [swap]}}
    with infinity.initialize(model, config, init_fn=gpt_init) as engine:
        init_s = time.perf_counter() - t
        t = time.perf_counter()
        engine.save_checkpoint(ckpt)
        save_s = time.perf_counter() - t
    shutil.rmtree(swap, ignore_errors=True)
    return {"params": cfg.num_params(), "init_s": round(init_s, 1), "save_s": round(save_s, 1)}


def export(ckpt: str, out: str) -> dict:
    from common import peak_rss_bytes

    from infinity.state.export import export_checkpoint
    t = time.perf_counter()
    export_checkpoint(ckpt, out)
    return {"seconds": round(time.perf_counter() - t, 1), "peak_rss_GiB": round(peak_rss_bytes() / 2**30, 3),
            "bytes": os.path.getsize(out)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--export", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.export:
        print("RESULT " + json.dumps(export(*args.export)))
        return
    from common import machine, write_json
    root = tempfile.mkdtemp(prefix="bench-export-", dir=args.dir)
    args.dir = root
    try:
        ckpt = os.path.join(root, "ckpt")
        result = {"benchmark": "export", "machine": machine(), **save(args, ckpt)}
        for name in ("model.pt", "model.safetensors"):
            proc = subprocess.run([sys.executable, __file__, "--export", ckpt, os.path.join(root, name)],
                                  capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            result[name] = json.loads(line[7:]) if line else {"error": proc.stderr[-2000:]}
            if os.path.exists(os.path.join(root, name)):
                os.remove(os.path.join(root, name))
        write_json(args.json, result)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
