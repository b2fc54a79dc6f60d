"""GPT-2 (Hugging Face transformers, built from a config: nothing downloaded) trained through infinity.

    pip install transformers
    python examples/gpt2_hf.py                       # a 6-layer GPT-2 on the shipped corpus, state on NVMe
    python examples/gpt2_hf.py --layers 12 --width 768 --steps 500

The model code is transformers' own: infinity splits it into units (the blocks
of `transformer.h`; the tied token embedding / output head, the position
embedding and the final LayerNorm form the root unit) and trains it unchanged.
Under `infinity.meta_init()` nothing is allocated until `initialize`, which
runs the model's own `_init_weights` one unit at a time.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile

import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

import infinity
from infinity.config.job import VOCAB_SIZE, DataConfig
from infinity.data.batches import Batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    if args.steps < 1:
        ap.error(f"--steps {args.steps}: give 1 or more")

    swap = tempfile.mkdtemp(prefix="infinity-swap-")
    config = infinity.Config.from_dict({
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1, "grad_clip": 1.0, "schedule": "cosine",
                      "warmup_steps": min(10, args.steps // 10), "total_steps": args.steps},
        "placement": {"params": "nvme", "grads": "host", "optimizer": "nvme"},
        "nvme": {"paths": [swap]},
    })
    gpt2_config = GPT2Config(vocab_size=VOCAB_SIZE, n_positions=args.seq_len, n_embd=args.width,
                             n_layer=args.layers, n_head=args.width // 64, bos_token_id=None, eos_token_id=None)
    with infinity.meta_init():
        model = GPT2LMHeadModel(gpt2_config)
    engine = infinity.initialize(model, config, init_fn=model._init_weights)
    data = Batches.from_config(DataConfig(), seq_len=args.seq_len, global_batch=args.batch)  # the shipped corpus
    try:
        for step in range(args.steps):
            x, y = data.batch(step, 0)
            logits = engine(input_ids=x).logits  # the model's own forward; engine(...) returns what it returns
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB_SIZE), y.reshape(-1))
            engine.backward(loss)
            engine.step()
            if step % 10 == 0 or step == args.steps - 1:
                print(f"step {step:4d}  loss {loss.item():.4f}  grad norm {engine.last_grad_norm:.3f}")
    finally:
        engine.close()
        shutil.rmtree(swap, ignore_errors=True)


if __name__ == "__main__":
    main()
