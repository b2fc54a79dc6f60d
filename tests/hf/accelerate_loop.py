"""One accelerate training loop, run by tests/hf/test_accelerate.py under torchrun (2 CPU ranks, gloo): `torch` (a
torch model and AdamW under accelerate's Accelerator: DDP) or `infinity` (the engine under InfinityAccelerator).
Rank 0 writes every rank's micro-batch losses, gathered through accelerate, to OUT as JSON.

    python -m torch.distributed.run --nproc-per-node 2 --standalone tests/hf/accelerate_loop.py torch|infinity OUT
"""

import json
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, get_scheduler

VOCAB, ACCUM, MICRO_STEPS, HYPER = 64, 2, 8, dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-7, weight_decay=0.05)


def main(kind: str, out: str) -> None:
    import faulthandler
    faulthandler.dump_traceback_later(150, exit=True)  # a hang shows every thread's stack in the test's message
    torch.set_num_threads(1)
    if kind == "torch":
        from accelerate import Accelerator as Cls
    else:
        from infinity.hf import InfinityAccelerator as Cls
    accelerator = Cls(gradient_accumulation_steps=ACCUM, cpu=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    if kind == "torch":
        optimizer = torch.optim.AdamW(model.parameters(), **HYPER)
        trained = model
    else:
        import infinity
        trained = infinity.initialize(model, {
            "placement": {"params": "host", "grads": "host", "optimizer": "host"},
            "precision": {"compute_dtype": "fp32"}, "overlap": {"optimizer_with_backward": False},
            "optimizer": {**HYPER, "betas": list(HYPER["betas"]), "grad_clip": 1.0},
            "train": {"grad_accum_steps": ACCUM}})
        optimizer = trained.optimizer
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=1, num_training_steps=MICRO_STEPS // ACCUM)
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, VOCAB, (2 * accelerator.num_processes * MICRO_STEPS, 12), generator=g)
    data = torch.utils.data.DataLoader([{"input_ids": r, "labels": r} for r in rows], batch_size=2)
    clip = list(model.parameters())
    trained, optimizer, data, scheduler = accelerator.prepare(trained, optimizer, data, scheduler)
    losses = []
    for batch in data:
        with accelerator.accumulate(trained):
            loss = trained(**batch).loss
            losses.append(accelerator.gather(loss.detach().reshape(1)).tolist())
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(clip if kind != "torch" else trained.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    if accelerator.is_main_process:
        with open(out, "w") as f:
            json.dump(losses, f)
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
