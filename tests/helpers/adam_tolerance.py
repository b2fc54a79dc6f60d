"""How far two training runs that differ only by their device's maths may be apart after Adam steps.

A GPU and a CPU round differently (a matmul's reduction order, a fused multiply-add), and Adam amplifies it:
each element moves by about lr per step whatever the size of its gradient, so where a gradient is near zero
a rounding difference can flip the sign of an update. Per tensor, then: the mean |a - b| stays far under one
step's update (lr / MEAN_SHARE), and the worst element within a few steps' updates (MAX_STEPS_SHARE * steps *
lr). A real bug breaks the mean bound: calibrated in tests/units/test_tiling.py
(test_the_adam_tolerance_passes_other_rounding_and_catches_real_bugs), where a float64 reference is 5,800x
under it and a 1e-6 perturbation of the initial weights 330x, while a learning rate 10% off is 2.3x over it,
a skipped step 5.5x and one tile of nine left un-updated 2x.
"""

from __future__ import annotations

import torch

MEAN_SHARE = 10  # the mean |a - b| of a tensor: at most lr / MEAN_SHARE
MAX_STEPS_SHARE = 2  # the worst element: at most MAX_STEPS_SHARE * steps * lr


def adam_drift(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(mean, max) of |got - want|, in float64 on the CPU."""
    diff = (got.detach().cpu().double() - want.detach().cpu().double()).abs()
    return float(diff.mean()), float(diff.max())


def assert_close_after_adam(got: dict, want: dict, *, steps: int, lr: float) -> None:
    """Every tensor of `want` (a state dict) against the same name in `got`, within the bounds above; the
    failure names the tensor, its mean and max differences and their bounds."""
    mean_bound, max_bound = lr / MEAN_SHARE, MAX_STEPS_SHARE * steps * lr
    assert set(want) <= set(got), f"missing from the run: {sorted(set(want) - set(got))}"
    for name, value in want.items():
        assert got[name].shape == value.shape, f"{name}: shape {tuple(got[name].shape)} != {tuple(value.shape)}"
        mean, worst = adam_drift(got[name], value)
        assert mean <= mean_bound and worst <= max_bound, (
            f"{name}: mean |a - b| = {mean:.3g} (bound lr / {MEAN_SHARE} = {mean_bound:.3g}), max {worst:.3g} "
            f"(bound {MAX_STEPS_SHARE} * {steps} steps * lr = {max_bound:.3g}) after {steps} Adam steps at lr {lr:g}")
