"""A Hugging Face Trainer script on infinity: the model built under `infinity.meta_init()` (never whole in RAM)
and loaded unit by unit from a pretrained directory; placement from `infinity_config`.

    python examples/hf_trainer.py --pretrained path/to/hf_dir --out runs/hf      # any causal LM directory
    python examples/hf_trainer.py --out runs/hf                                  # a tiny Llama, made here
    torchrun --nproc-per-node 2 examples/hf_trainer.py --pretrained DIR --out runs/hf   # gloo on CPU, NCCL on GPU

The two lines that differ from a plain Trainer script are marked "infinity:".
"""

from __future__ import annotations

import argparse
import json
import os

import datasets
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, TrainingArguments

import infinity
from infinity.hf import InfinityTrainer  # infinity: instead of `from transformers import Trainer`


def tiny_pretrained(path: str) -> str:
    """A tiny random Llama saved as a pretrained directory (stands in for a downloaded model)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pretrained", help="a Hugging Face model directory (default: a tiny Llama made in --out)")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--placement", default="host", choices=("device", "host", "nvme"),
                   help="where parameters and optimizer state live ([placement]); nvme uses --out/swap")
    a = p.parse_args()
    pretrained = a.pretrained or tiny_pretrained(os.path.join(a.out, f"pretrained-{os.environ.get('RANK', '0')}"))

    config = AutoConfig.from_pretrained(pretrained)
    with infinity.meta_init():  # parameters on the meta device: nothing allocated
        model = AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, config.vocab_size, (16,), generator=g).tolist() for _ in range(64)]
    train = datasets.Dataset.from_list([{"input_ids": r, "labels": r} for r in rows])

    args = TrainingArguments(output_dir=a.out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             learning_rate=1e-3, weight_decay=0.1, max_grad_norm=1.0, lr_scheduler_type="cosine",
                             warmup_steps=2, max_steps=a.steps, logging_steps=1, save_steps=10, seed=7,
                             report_to=[], use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
                             dataloader_drop_last=True)
    placement = {"params": a.placement, "grads": "host" if a.placement == "nvme" else a.placement,
                 "optimizer": a.placement}
    infinity_config = {"placement": placement}
    if a.placement == "nvme":
        swap = os.path.join(a.out, "swap")  # (point it at a fast local NVMe disk for real runs)
        os.makedirs(swap, exist_ok=True)
        infinity_config["nvme"] = {"paths": [swap]}
    trainer = InfinityTrainer(model=model, args=args, train_dataset=train,  # infinity: the class, and:
                              infinity_config=infinity_config, infinity_weights=pretrained)
    trainer.train()
    trainer.save_model(os.path.join(a.out, "final"))  # a standalone HF directory: from_pretrained loads it
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        with open(os.path.join(a.out, "losses.json"), "w") as f:
            json.dump(losses, f)
        print(f"losses {losses[0]:.4f} -> {losses[-1]:.4f}; saved {os.path.join(a.out, 'final')}")
    trainer.engine.close()  # removes this run's swap files
    if a.placement == "nvme" and not os.listdir(swap):
        os.rmdir(swap)  # the directory this example made for them: nothing left behind


if __name__ == "__main__":
    main()
