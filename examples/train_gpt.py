"""Train a small GPT through infinity, with parameters and optimizer state on NVMe.

    python examples/train_gpt.py                      # 60 steps, swap files in a temporary directory
    python examples/train_gpt.py --swap-dir /mnt/nvme0 --config examples/gpt_nvme.toml --steps 200
    torchrun --nproc-per-node 2 examples/train_gpt.py # two ranks (gloo on CPU, NCCL on GPUs)

The data is a synthetic token stream from a sparse random Markov chain (each
token has 4 possible successors), so the loss has somewhere to fall to:
from ln(vocab) = 6.2 towards ln(4) = 1.4.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

import infinity
from infinity.models import GPT, GPTConfig, gpt_init


def markov_stream(vocab: int, num_tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 4), generator=g)
    choice = torch.randint(0, 4, (num_tokens,), generator=g)
    out = torch.empty(num_tokens, dtype=torch.long)
    tok = 0
    for i in range(num_tokens):
        tok = int(successors[tok, choice[i]])
        out[i] = tok
    return out


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(here, "gpt_nvme.toml"))
    ap.add_argument("--swap-dir", default=None, help="directory for swap files (default: a temporary one)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=8, help="sequences per micro-batch per rank")
    args = ap.parse_args()

    swap = args.swap_dir or tempfile.mkdtemp(prefix="infinity-swap-")
    config = infinity.Config.from_file(args.config, overrides=[f'nvme.paths=["{swap}"]'])
    model_cfg = GPTConfig(vocab_size=512, seq_len=64, n_layer=4, n_head=4, d_model=128)
    with infinity.meta_init():
        model = GPT(model_cfg)
    engine = infinity.initialize(model, config, init_fn=gpt_init)
    rank, world = engine.rank, engine.world_size
    stream = markov_stream(model_cfg.vocab_size, 200_000, seed=1)
    g = torch.Generator().manual_seed(100 + rank)
    accum = config.train.grad_accum_steps
    if rank == 0:
        print(f"{model_cfg.num_params() / 1e6:.2f}M parameters, {len(engine.units)} units, world size {world}, "
              f"placement {config.placement.params}/{config.placement.grads}/{config.placement.optimizer}, "
              f"swap in {swap}", flush=True)
    t0 = time.perf_counter()
    try:
        for step in range(args.steps):
            total = 0.0
            for _ in range(accum):
                starts = torch.randint(0, len(stream) - model_cfg.seq_len - 1, (args.batch,), generator=g)
                window = torch.stack([stream[s: s + model_cfg.seq_len + 1] for s in starts.tolist()])
                loss = engine(window[:, :-1], window[:, 1:])
                engine.backward(loss)
                total += float(loss.detach()) / accum
            engine.step()
            if world > 1:
                value = torch.tensor(total)
                dist.all_reduce(value)
                total = float(value) / world
            if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
                tokens = (step + 1) * accum * args.batch * world * model_cfg.seq_len
                print(f"step {step:4d}  loss {total:.4f}  grad norm {engine.last_grad_norm:.3f}  "
                      f"{tokens / (time.perf_counter() - t0):,.0f} tokens/s", flush=True)
        report = engine.memory_report()
        if rank == 0:
            print("bytes per tier and kind (this rank):")
            for tier, kinds in report["state"].items():
                print(f"  {tier:6s} " + "  ".join(f"{k}={v / 2**20:.2f}MiB" for k, v in kinds.items() if v))
    finally:
        engine.close()
        if args.swap_dir is None and rank == 0:
            shutil.rmtree(swap, ignore_errors=True)


if __name__ == "__main__":
    main()
