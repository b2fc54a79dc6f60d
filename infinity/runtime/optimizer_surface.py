"""The optimizer as a user's loop sees it: parameter groups, learning rates, a torch Optimizer to schedule.

`LearningRates` owns which learning rate each group's next update uses; `EngineOptimizer` is the
`torch.optim.Optimizer` that `engine.optimizer` returns, so torch's LR schedulers (and transformers'
`get_scheduler`) work on it unchanged. It holds no state: its `param_groups` are the engine's group
dicts themselves, its `step()` is `engine.step()` and its `zero_grad()` does nothing (the engine owns
the gradients).

Note [who sets the lr]: an update uses `param_groups[i]["lr"]` as it is when the update is issued
(inline and deferred: at `engine.step()`; with eager overlap: during the window's last
`engine.backward`, Note [overlap]). Until the user takes the learning rate over, the built-in
schedule (`lr_schedule=` of initialize, else `[optimizer] schedule` / warmup with each group's lr as its
peak) writes each group's lr for the update about to run. The user takes over by calling
`engine.set_lr(...)`, or by building a torch LR scheduler on `engine.optimizer` (torch marks each
group's "initial_lr" then); from then on the learning rates change only when the user (or their
scheduler) writes them. A checkpoint keeps the lrs and who sets them, so a resumed run goes on
the same way. One rule, in one place: `LearningRates.for_update`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from infinity.config.sections import OptimizerConfig
from infinity.optim.cpu_adam import AdamHyper
from infinity.optim.groups import ParamGroups

__all__ = ["EngineOptimizer", "LearningRates"]


class LearningRates:
    """Each group's learning rate: the built-in schedule's, until the user takes over (Note [who sets the lr])."""

    def __init__(self, groups: ParamGroups, cfg: OptimizerConfig,
                 lr_schedule: Callable[[int], float | Sequence[float]] | None):
        self.groups, self.cfg, self.lr_schedule = groups, cfg, lr_schedule
        self.for_update(0)  # the lrs a user (or a scheduler built now) sees before the first update

    def user_controls(self) -> bool:
        """engine.set_lr was called, or a torch LR scheduler was built on engine.optimizer."""
        return self.groups.lrs_set_by_user or any("initial_lr" in g for g in self.groups.groups)

    def for_update(self, step: int) -> tuple[AdamHyper, ...]:
        """The hyper-parameters of optimizer step `step` (0-based), per group; writes the built-in schedule's
        lrs into the groups first unless the user controls them."""
        if not self.user_controls():
            for g, lr in zip(self.groups.groups, self.groups.scheduled(step, self.cfg, self.lr_schedule)):
                g["lr"] = lr
        return self.groups.hypers(decoupled=self.cfg.name == "adamw")

    def current(self, step: int) -> list[float]:
        self.for_update(step)
        return [float(g["lr"]) for g in self.groups.groups]

    def set(self, value: float | Sequence[float]) -> None:
        n = len(self.groups.groups)
        values = list(value) if isinstance(value, (list, tuple)) else [value] * n
        if len(values) != n or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
                                       for v in values):
            raise ValueError(f"engine.set_lr({value!r}): give one learning rate >= 0, or a list of {n} (one per "
                             f"parameter group, in the order of engine.param_groups)")
        for g, v in zip(self.groups.groups, values):
            g["lr"] = float(v)
        self.groups.lrs_set_by_user = True


class EngineOptimizer(torch.optim.Optimizer):
    """`engine.optimizer`: a stateless torch Optimizer over the engine's groups (module docstring)."""

    def __init__(self, groups: ParamGroups, cfg: OptimizerConfig, step: Callable[[], bool]):
        defaults = {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "betas": tuple(cfg.betas), "eps": cfg.eps}
        super().__init__([{"params": []}], defaults)  # (torch requires tensors; the groups hold names)
        self.param_groups = groups.groups  # the same dicts: a scheduler's writes are the engine's lrs
        self._engine_step = step

    def step(self, closure=None) -> bool:  # noqa: D102 - torch's signature
        if closure is not None:
            raise ValueError("engine.optimizer.step(closure): closures are not supported; compute the loss, call "
                             "engine.backward(loss), then step()")
        return self._engine_step()

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "_engine_step"):  # (torch's __init__ adds its placeholder group before)
            raise ValueError("engine.optimizer.add_param_group: the groups are fixed at initialize; pass every group "
                             "to infinity.initialize(model, config, param_groups=[...])")
        # torch's __init__'s placeholder, replaced by the engine's groups at once: not through torch's own
        # add_param_group, whose first call imports torch._dynamo (~1 s of every initialize, and its memory)
        self.param_groups.append(param_group)

    def stepped(self) -> None:
        """engine.step() applied an update: torch's LR schedulers check this flag (their own protocol, set by the
        `step` they wrap) to warn about a scheduler stepped before its optimizer; engine.step() counts too."""
        self._opt_called = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the engine's gradients are consumed by its update."""

    def state_dict(self) -> dict:
        """The groups (names, hyper-parameters); the Adam state is in the engine's checkpoints."""
        return {"state": {}, "param_groups": [dict(g) for g in self.param_groups]}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups):
            raise ValueError(f"the state dict has {len(saved)} parameter groups, engine.optimizer has "
                             f"{len(self.param_groups)}")
        for g, s in zip(self.param_groups, saved):
            g.update({k: v for k, v in s.items() if k != "params"})
