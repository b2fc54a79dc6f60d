"""Hugging Face `Trainer` and TRL's `SFTTrainer` on infinity (`pip install "infinity[hf]"`)."""

from infinity.hf.trainer import InfinityTrainer

__all__ = ["InfinitySFTTrainer", "InfinityTrainer"]


def __getattr__(name):
    if name == "InfinitySFTTrainer":  # (trl imported only when asked for)
        from infinity.hf.sft import InfinitySFTTrainer
        return InfinitySFTTrainer
    raise AttributeError(name)
