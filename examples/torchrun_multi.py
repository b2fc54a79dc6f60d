"""Several processes (and several machines) with torchrun: each rank holds 1/N of every state shard.

One machine, two processes (gloo on CPU, NCCL on GPUs):

    torchrun --nproc-per-node 2 examples/torchrun_multi.py

Two machines (or two "nodes" on one machine, as the test suite does), rendezvous at HOST:

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/torchrun_multi.py                                       # on node 0
    torchrun --nnodes 2 --node-rank 1 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/torchrun_multi.py                                       # on node 1

`infinity.initialize` joins the process group torchrun describes (its
environment variables). Every rank draws the same global batch and trains on
its own rows of it, so the result does not depend on how the ranks are spread
over machines. Each node keeps its swap files on its own disk (`--swap-dir`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch.distributed as dist

import infinity
from infinity.config.job import VOCAB_SIZE, DataConfig
from infinity.data.batches import Batches
from infinity.models import GPT, GPTConfig, gpt_init


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step over all ranks")
    ap.add_argument("--swap-dir", default=None, help="this node's swap directory (default: a temporary one)")
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    swap = args.swap_dir or os.path.join(tempfile.gettempdir(), f"infinity-swap-{os.getpid()}")
    os.makedirs(swap, exist_ok=True)
    config = infinity.Config.from_dict({
        "optimizer": {"lr": 2e-3, "grad_clip": 1.0},
        "placement": {"params": "nvme", "grads": "host", "optimizer": "nvme"},
        "nvme": {"paths": [swap]},  # each rank writes its own swap files here
    })
    model_config = GPTConfig(vocab_size=VOCAB_SIZE, seq_len=64, n_layer=4, n_head=4, d_model=128)
    with infinity.meta_init():
        model = GPT(model_config)
    engine = infinity.initialize(model, config, init_fn=gpt_init)  # joins torchrun's process group
    rank, world = engine.rank, engine.world_size
    data = Batches.from_config(DataConfig(), seq_len=model_config.seq_len, global_batch=args.batch,
                               rank=rank, world=world)  # this rank's rows of each global batch
    try:
        for step in range(args.steps):
            x, y = (t.to(engine.device) for t in data.batch(step, 0))
            loss = engine(x, y)
            engine.backward(loss)  # gradients are reduce-scattered: each rank keeps the sum for its shard
            engine.step()
            mean = loss.detach().clone()
            if world > 1:
                dist.all_reduce(mean)  # for printing only: the mean loss over all ranks
                mean /= world
            if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
                print(f"step {step:4d}  loss {mean.item():.4f}  (world size {world}, local rank {local_rank})")
    finally:
        engine.close()  # also leaves the process group it joined
        if args.swap_dir is None:
            shutil.rmtree(swap, ignore_errors=True)


if __name__ == "__main__":
    main()
