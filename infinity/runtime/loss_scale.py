"""Dynamic loss scaling for fp16 compute (a constant 1.0 for fp32 and bf16)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossScaler:
    """Scale the loss up so fp16 gradients keep their small values; halve on overflow, double after
    `growth_interval` clean steps."""

    scale: float = 1.0
    dynamic: bool = False
    growth_interval: int = 1000
    min_scale: float = 1.0
    _clean_steps: int = 0
    skipped_steps: int = 0

    @classmethod
    def for_config(cls, precision) -> "LossScaler":
        if precision.compute_dtype != "fp16":
            return cls()
        return cls(scale=float(precision.initial_loss_scale), dynamic=True,
                   growth_interval=int(precision.loss_scale_growth_interval))

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self.scale = max(self.min_scale, self.scale / 2)
            self._clean_steps = 0
            self.skipped_steps += 1
            return
        self._clean_steps += 1
        if self._clean_steps % self.growth_interval == 0:
            self.scale *= 2
