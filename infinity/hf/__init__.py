"""Hugging Face `Trainer` and TRL's `SFTTrainer` on infinity (`pip install "infinity[hf]"`)."""

from infinity.hf.arguments import InfinityTrainingArguments
from infinity.hf.trainer import InfinityTrainer

__all__ = ["InfinityAccelerator", "InfinitySFTConfig", "InfinitySFTTrainer", "InfinityTrainer",
           "InfinityTrainingArguments"]


def __getattr__(name):
    if name in ("InfinitySFTTrainer", "InfinitySFTConfig"):  # (trl imported only when asked for)
        from infinity.hf import sft
        return getattr(sft, name)
    if name == "InfinityAccelerator":
        from infinity.hf.accelerate import InfinityAccelerator
        return InfinityAccelerator
    raise AttributeError(name)
