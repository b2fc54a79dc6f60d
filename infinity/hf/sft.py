"""TRL's `SFTTrainer` on the infinity engine: the same overrides as InfinityTrainer (trainer.py)."""

from __future__ import annotations

from trl import SFTTrainer

from infinity.hf.trainer import InfinityTrainerMixin

__all__ = ["InfinitySFTTrainer"]


class InfinitySFTTrainer(InfinityTrainerMixin, SFTTrainer):
    """`trl.SFTTrainer` on the infinity engine: the parent's constructor plus `infinity_config=` and
    `infinity_weights=` (Note [trainer on the engine] in trainer.py)."""
