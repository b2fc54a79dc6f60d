"""Plain single-process PyTorch training, the reference every engine test is compared with."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from infinity.models.gpt import GPT, GPTConfig, synthetic_batch

TINY = GPTConfig(vocab_size=64, seq_len=16, n_layer=3, n_head=4, d_model=32)


@dataclass(frozen=True)
class Recipe:
    """One training run: model, data, optimizer; shared by the reference and the engine."""

    model: GPTConfig = TINY
    steps: int = 5
    accum: int = 2
    micro_batch: int = 4  # sequences per micro-batch, over all ranks
    lr: float = 1e-3
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 0.5
    seed: int = 0
    optimizer: str = "adamw"
    extra: dict = field(default_factory=dict)

    def build(self) -> GPT:
        torch.manual_seed(self.seed)
        return GPT(self.model)

    def batches(self):
        """[step][micro] -> (x, y) over the whole micro-batch."""
        g = torch.Generator().manual_seed(self.seed + 1)
        return [
            [synthetic_batch(self.model, self.micro_batch, g) for _ in range(self.accum)] for _ in range(self.steps)
        ]

    def config(self, **placement) -> dict:
        return {
            "optimizer": {"name": self.optimizer, "lr": self.lr, "betas": list(self.betas), "eps": self.eps,
                          "weight_decay": self.weight_decay, "grad_clip": self.grad_clip},
            "train": {"grad_accum_steps": self.accum, "seed": self.seed},
            "placement": placement or {"params": "device", "grads": "device", "optimizer": "device"},
            **self.extra,
        }


def reference_run(recipe: Recipe, model=None):
    """Losses per micro-batch, pre-clip grad norms per step, and the final state dict."""
    model = copy.deepcopy(model) if model is not None else recipe.build()
    opt_cls = torch.optim.AdamW if recipe.optimizer == "adamw" else torch.optim.Adam
    opt = opt_cls(model.parameters(), lr=recipe.lr, betas=recipe.betas, eps=recipe.eps,
                  weight_decay=recipe.weight_decay)
    losses, norms = [], []
    for micro_batches in recipe.batches():
        for x, y in micro_batches:
            loss = model(x, y)
            (loss / recipe.accum).backward()
            losses.append(loss.item())
        if recipe.grad_clip > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def plain_adamw(model, batches, loss_of, *, lr: float, betas=(0.9, 0.95), eps: float = 1e-8,
                weight_decay: float = 0.0):
    """Plain PyTorch on a copy of `model`: torch.optim.AdamW over its trainable parameters, one step per batch
    (`loss_of(forward, batch)`). Returns the losses and the final state dict."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=betas, eps=eps,
                            weight_decay=weight_decay)
    losses = []
    for batch in batches:
        loss = loss_of(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model.state_dict()


def engine_losses(engine, batches, loss_of) -> list[float]:
    """The same loop through an infinity engine: one step per batch."""
    losses = []
    for batch in batches:
        loss = loss_of(engine, batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


TRAINABLE = ("attn.proj", "ln")  # parameter names that stay trainable: a LoRA-like handful


@dataclass(frozen=True)
class FrozenRecipe(Recipe):
    """The tiny GPT with everything frozen but the attention projections and the layer norms."""

    def build(self):
        model = super().build()
        for name, p in model.named_parameters():
            p.requires_grad_(any(t in name for t in TRAINABLE))
        return model
