"""Fine-tune a pretrained Hugging Face model with LoRA through infinity, export it, load it back with transformers.

    pip install transformers peft
    python examples/finetune_lora.py                          # a small random "pretrained" Llama (no download)
    python examples/finetune_lora.py --pretrained DIR --steps 200   # a model of your own (vocabulary >= 256)

1. The "pretrained" model: a Llama with random weights, written by save_pretrained (with --pretrained, yours).
2. The model is built on the meta device from DIR's config.json (nothing allocated) and wrapped with PEFT's
   LoRA; `infinity.initialize(model, config, weights=DIR)` streams the base weights into the tiers, unit by
   unit (the adapters keep PEFT's initialization: B = 0, so the wrapped model starts as the pretrained one).
3. The adapters train on the shipped corpus (King James Bible, bytes as token ids); the base weights are
   frozen, so gradients and Adam state exist for the adapters only.
4. `engine.export_state_dict(OUT, merge_lora=True)` writes a Hugging Face directory (safetensors shards,
   the base model's names, the adapters merged in); with the config beside it, `from_pretrained(OUT)` loads it.
5. The validation loss before (the pretrained model) and after (the exported one), both through transformers.

The job does the same: infinity train --set model.pretrained=DIR --set model.lora.r=8 (README, "Fine-tune a
pretrained model").
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import infinity
from infinity.config.job import VOCAB_SIZE, DataConfig
from infinity.data.batches import Batches


def make_pretrained(path: str, seq_len: int) -> None:
    """A small Llama with random weights, saved as a pretrained model is."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(config).save_pretrained(path)


@torch.no_grad()
def validation_loss(model, data: Batches) -> float:
    """Mean next-byte cross-entropy of a model (transformers' or the engine) on fixed validation batches."""
    losses = []
    for x, y in data.val_batches(4):
        logits = model(input_ids=x).logits
        losses.append(float(F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))))
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> tuple[float, float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pretrained", help="a Hugging Face model directory (default: make a small random Llama)")
    ap.add_argument("--out", help="where to export the fine-tuned model (default: a temporary directory)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank")
    ap.add_argument("--lr", type=float, default=1e-2)
    args = ap.parse_args(argv)

    work = tempfile.mkdtemp(prefix="infinity-finetune-")
    pretrained = args.pretrained or os.path.join(work, "pretrained")
    out = args.out or os.path.join(work, "export")
    if not args.pretrained:
        make_pretrained(pretrained, args.seq_len)
    data = Batches.from_config(DataConfig(), seq_len=args.seq_len, global_batch=args.batch)
    before = validation_loss(AutoModelForCausalLM.from_pretrained(pretrained), data)

    os.makedirs(os.path.join(work, "swap"))
    config = infinity.Config.from_dict({
        "optimizer": {"lr": args.lr, "weight_decay": 0.0, "grad_clip": 1.0},
        "placement": {"params": "nvme", "grads": "host", "optimizer": "nvme"},  # the state out of RAM
        "nvme": {"paths": [os.path.join(work, "swap")]},
    })
    hf_config = AutoConfig.from_pretrained(pretrained)
    with infinity.meta_init():
        model = AutoModelForCausalLM.from_config(hf_config)
    model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {trainable / 1e6:.3f}M trainable "
          f"(LoRA r={args.rank})")
    engine = infinity.initialize(model, config, weights=pretrained)
    try:
        for step in range(args.steps):
            x, y = data.batch(step, 0)
            logits = engine(input_ids=x).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
            engine.backward(loss)
            engine.step()
            if step % 20 == 0 or step == args.steps - 1:
                print(f"step {step:4d}  loss {loss.item():.4f}")
        engine.export_state_dict(out, merge_lora=True)  # a Hugging Face directory: no suffix
        shutil.rmtree(f"{out}.checkpoint", ignore_errors=True)  # the checkpoint the export was read from
        hf_config.save_pretrained(out)
    finally:
        engine.close()
    after = validation_loss(AutoModelForCausalLM.from_pretrained(out), data)
    print(f"validation loss: {before:.4f} before (pretrained), {after:.4f} after (exported, loaded by transformers)")
    print(f"exported to {out}")
    if not args.out:
        shutil.rmtree(work, ignore_errors=True)
    return before, after


if __name__ == "__main__":
    main()
