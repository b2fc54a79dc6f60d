"""TRL's `SFTTrainer` on the infinity engine: the same overrides as InfinityTrainer (trainer.py)."""

from __future__ import annotations

from dataclasses import dataclass

from trl import SFTConfig, SFTTrainer

from infinity.hf.deepspeed import DeepSpeedArgumentsMixin
from infinity.hf.trainer import InfinityTrainerMixin

__all__ = ["InfinitySFTConfig", "InfinitySFTTrainer"]


@dataclass
class InfinitySFTConfig(DeepSpeedArgumentsMixin, SFTConfig):
    """TRL's `SFTConfig` that takes `deepspeed=` without DeepSpeed installed (Note [deepspeed through the Trainer]
    in deepspeed.py)."""


class InfinitySFTTrainer(InfinityTrainerMixin, SFTTrainer):
    """`trl.SFTTrainer` on the infinity engine: the parent's constructor plus `infinity_config=` and
    `infinity_weights=` (Note [trainer on the engine] in trainer.py)."""
