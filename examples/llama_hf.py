"""Llama (Hugging Face transformers, built from a config: nothing downloaded) trained through infinity.

    pip install transformers
    python examples/llama_hf.py                      # a 4-layer Llama with grouped-query attention, state on NVMe
    python examples/llama_hf.py --layers 16 --width 1024 --placement auto

Units are the decoder layers of `model.layers`; the token embedding, the
untied output head and the final RMSNorm form the root unit. Rotary tables are
buffers, so they stay real under `infinity.meta_init()`. With `--placement
auto`, infinity decides per layer where parameters, gradients and optimizer
state go (see `infinity estimate --explain` for why).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile

import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import infinity
from infinity.config.job import VOCAB_SIZE, DataConfig
from infinity.data.batches import Batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--placement", choices=("nvme", "auto"), default="nvme")
    args = ap.parse_args()
    if args.steps < 1:
        ap.error(f"--steps {args.steps}: give 1 or more")

    swap = tempfile.mkdtemp(prefix="infinity-swap-")
    placement = ({"policy": "auto"} if args.placement == "auto"
                 else {"params": "nvme", "grads": "host", "optimizer": "nvme"})
    config = infinity.Config.from_dict({
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1, "grad_clip": 1.0, "schedule": "cosine",
                      "warmup_steps": min(10, args.steps // 10), "total_steps": args.steps},
        "placement": placement,
        "nvme": {"paths": [swap]},
    })
    heads = args.width // 64
    llama_config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=args.width, intermediate_size=8 * args.width // 3,
                               num_hidden_layers=args.layers, num_attention_heads=heads,
                               num_key_value_heads=max(1, heads // 2), max_position_embeddings=args.seq_len,
                               bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with infinity.meta_init():
        model = LlamaForCausalLM(llama_config)
    engine = infinity.initialize(model, config, init_fn=model._init_weights)
    if args.placement == "auto":
        print("\n".join(engine.plan.reasons))
    data = Batches.from_config(DataConfig(), seq_len=args.seq_len, global_batch=args.batch)
    try:
        for step in range(args.steps):
            x, y = data.batch(step, 0)
            logits = engine(input_ids=x).logits
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
