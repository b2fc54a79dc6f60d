"""Learning rate per step: linear warmup, then constant, cosine or linear decay."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infinity.config.sections import OptimizerConfig

__all__ = ["lr_at"]


def lr_at(step: int, cfg: OptimizerConfig) -> float:
    """Learning rate of update number ``step`` (0-based).

    Warmup: ``lr * (step + 1) / warmup_steps`` for ``step < warmup_steps``.
    Then "constant" stays at ``lr``; "cosine" and "linear" decay from ``lr`` at
    ``warmup_steps`` to ``lr * min_lr_ratio`` at ``total_steps`` and stay there.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"lr_at: step must be an int >= 0 (0-based update index), got {step!r}")
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    min_lr = cfg.lr * cfg.min_lr_ratio
    if step >= cfg.total_steps:
        return min_lr
    progress = (step - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps)  # in [0, 1)
    if cfg.schedule == "cosine":
        return min_lr + (cfg.lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if cfg.schedule == "linear":
        return cfg.lr - (cfg.lr - min_lr) * progress
    raise ValueError(f'lr_at: optimizer.schedule = "{cfg.schedule}" is not one of "constant" | "cosine" | "linear"')
