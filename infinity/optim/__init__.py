"""CPU optimizer kernels and the learning-rate schedule."""

from infinity.optim.cpu_adam import AdamHyper, adam_step, adam_step_reference
from infinity.optim.schedule import lr_at

__all__ = ["AdamHyper", "adam_step", "adam_step_reference", "lr_at"]
