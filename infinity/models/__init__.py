"""Built-in models (for the default training job, tests and benchmarks)."""

from infinity.models.gpt import GPT, GPTConfig, gpt_init

__all__ = ["GPT", "GPTConfig", "gpt_init"]
