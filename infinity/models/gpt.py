"""A small GPT (nanoGPT-style): token + position embedding, pre-LN blocks, tied output head.

Blocks live in an `nn.ModuleList`, so each becomes one infinity unit; the tied
embedding / head and the final LayerNorm form the root unit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 4096
    seq_len: int = 128
    n_layer: int = 6
    n_head: int = 8
    d_model: int = 512
    dropout: float = 0.0
    bias: bool = True

    def num_params(self) -> int:
        """Parameters, counting the tied embedding / head once."""
        d, v = self.d_model, self.vocab_size
        per_block = 12 * d * d + (13 * d if self.bias else 4 * d)
        final_ln = 2 * d if self.bias else d
        return v * d + self.seq_len * d + self.n_layer * per_block + final_ln


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """`forward(idx, targets=None)` returns the mean cross-entropy loss, or logits without targets."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        # the weights given, not drawn: Embedding's own init (normal_) on the meta device imports torch._dynamo
        # (~1 s of every `infinity train`); gpt_init below (or initialize's init_fn) draws them
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model, _weight=torch.empty(cfg.vocab_size, cfg.d_model))
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model, _weight=torch.empty(cfg.seq_len, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied: one parameter, two names
        if self.wte.weight.device.type != "meta":
            self.apply(gpt_init)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def gpt_init(module: nn.Module, std: float = 0.02) -> None:
    """nanoGPT's initialization, usable as `init_fn` for `infinity.initialize` (one module at a time)."""
    with torch.no_grad():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, std)
        elif isinstance(module, nn.LayerNorm):
            if module.weight is not None:
                nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()


def synthetic_batch(cfg: GPTConfig, batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and next-token targets (for tests and benchmarks)."""
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


