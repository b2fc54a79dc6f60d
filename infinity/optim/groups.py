"""Parameter groups: torch.optim-style per-group lr / weight_decay / betas / eps over the units' flat shards.

`resolve_groups` turns what the user gave (`initialize(..., param_groups=...)`, or the config's
`[optimizer] no_decay` rules) into `ParamGroups`: one plain dict per group (the parameters' names
and the group's hyper-parameters, missing values filled from `[optimizer]`) and the group of every
trainable parameter, by its canonical name (the first of `model.named_parameters()`).

Note [groups ride on ranges]: parameters of one unit in different groups cost no copy per group.
A unit's flat buffer holds its parameters one after the other, so a group is a set of contiguous
element ranges of it. `UnitSteps.active_ranges` (units/steps.py) cuts the rank's update range at parameter boundaries
into (start, length, adam step, group) runs, merging neighbours of the same step and group, and the
optimizer calls the fused Adam kernel once per (chunk, run) with that group's `AdamHyper`. The bytes
stored, moved and stepped are those of one group; only the number of kernel calls grows (at most one
per parameter, far fewer when groups are contiguous). The update is elementwise, so this is exactly
`torch.optim.AdamW` with the same groups (Note [sub-groups] in cpu_adam.py for the rounding at cuts).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch.nn as nn

from infinity.config.options import ConfigError
from infinity.optim.cpu_adam import AdamHyper
from infinity.optim.schedule import lr_at

if TYPE_CHECKING:
    from infinity.config.sections import OptimizerConfig

__all__ = ["GROUP_KEYS", "BIAS_AND_NORM", "ParamGroups", "decay_parameter_names", "resolve_groups"]

GROUP_KEYS = ("lr", "weight_decay", "betas", "eps")  # what a group may set; the rest comes from [optimizer]
# Keys torch.optim.AdamW / Adam write into every group of `optimizer.param_groups` that say how it computes
# (foreach, fused, capturable: implementations of the same update) or ask for variants: accepted (so a torch
# optimizer's groups can be passed as they are) only with the values of the update infinity runs; "adamw"
# is decoupled weight decay, "adam" is not.
_TORCH_IMPLEMENTATION = ("foreach", "fused", "capturable")
_TORCH_VARIANTS = {"amsgrad": False, "maximize": False, "differentiable": False}
BIAS_AND_NORM = "bias_and_norm"  # the `no_decay` rule name: HF Trainer's default
# transformers' Trainer.get_decay_parameter_names (4.x-5.x): these patterns, searched in the lower-cased
# name, and every parameter inside an nn.LayerNorm, get no weight decay
_HF_NO_DECAY_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")


def decay_parameter_names(model: nn.Module) -> set[str]:
    """The parameter names HF Trainer decays: not inside an nn.LayerNorm, and matching none of its patterns
    (written out from transformers' `Trainer.get_decay_parameter_names`, so transformers is not needed)."""
    patterns = [re.compile(p) for p in _HF_NO_DECAY_PATTERNS]
    in_norm: set[str] = set()
    for mname, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, nn.LayerNorm):
            in_norm.update(f"{mname}.{n}" if mname else n for n, _ in module.named_parameters(remove_duplicate=False))
    return {n for n, _ in model.named_parameters(remove_duplicate=False)
            if n not in in_norm and not any(p.search(n.lower()) for p in patterns)}


@dataclass
class ParamGroups:
    """The resolved groups: `groups[i]` is the live dict of group i (`params`: the canonical names; `lr`,
    `weight_decay`, `betas`, `eps`), shared with `engine.param_groups` and `engine.optimizer.param_groups`.
    `base_lrs[i]` is group i's learning rate before any schedule; `group_of` maps a trainable parameter's
    canonical name to its group."""

    groups: list[dict]
    base_lrs: list[float]
    group_of: dict[str, int]
    lrs_set_by_user: bool = False  # engine.set_lr was called (Note [who sets the lr] in optimizer_surface.py)

    def __len__(self) -> int:
        return len(self.groups)

    def hypers(self, decoupled: bool) -> tuple[AdamHyper, ...]:
        """Each group's hyper-parameters as its dict holds them now (its current lr)."""
        return tuple(AdamHyper(lr=float(g["lr"]), beta1=float(g["betas"][0]), beta2=float(g["betas"][1]),
                               eps=float(g["eps"]), weight_decay=float(g["weight_decay"]), decoupled=decoupled)
                     for g in self.groups)

    def scheduled(self, step: int, cfg: OptimizerConfig, lr_schedule: Callable[[int], float | Sequence[float]] | None
                  ) -> list[float]:
        """Each group's learning rate at optimizer step `step` under the built-in rule: `lr_schedule(step)`
        when given (a list: per group; a number: the lr of a group at `optimizer.lr`, the others scaled by
        their lr / optimizer.lr), else `[optimizer] schedule` with each group's lr as its peak."""
        value = lr_schedule(step) if lr_schedule is not None else lr_at(step, cfg)
        if isinstance(value, (list, tuple)):
            if len(value) != len(self.groups):
                raise ValueError(f"lr_schedule({step}) returned {len(value)} learning rates for {len(self.groups)} "
                                 f"parameter groups: return one number, or one per group")
            return [float(v) for v in value]
        factor = float(value) / cfg.lr  # (x / x is exactly 1.0: a constant schedule gives each base lr exactly)
        return [float(value) if base == cfg.lr else factor * base for base in self.base_lrs]

    def record(self) -> list[dict]:
        """What a checkpoint keeps of the groups (JSON): names, hyper-parameters, current lr, and who sets it
        (`lr_set_by_user`; a torch scheduler's "initial_lr")."""
        out = []
        for g in self.groups:
            out.append({"params": sorted(g["params"]), "lr": float(g["lr"]), "weight_decay": float(g["weight_decay"]),
                        "betas": [float(b) for b in g["betas"]], "eps": float(g["eps"]),
                        "lr_set_by_user": self.lrs_set_by_user})
            if "initial_lr" in g:
                out[-1]["initial_lr"] = float(g["initial_lr"])
        return out

    def difference(self, saved: list[dict] | None) -> str | None:
        """Why groups saved by `record` are not these groups (None: the same partition of the parameters into
        groups). The hyper-parameters are this run's, as `[optimizer]`'s were before groups: a run may resume
        with another weight_decay, and an engine built for evaluation loads any checkpoint of its model."""
        mine = self.record()
        if saved is None:  # a checkpoint from before groups: one group, the [optimizer] values
            return None if len(mine) == 1 else f"it was saved with 1 parameter group, this run has {len(mine)}"
        if len(saved) != len(mine):
            return f"it was saved with {len(saved)} parameter groups, this run has {len(mine)}"
        for i, (s, m) in enumerate(zip(saved, mine)):
            if s["params"] != m["params"]:
                moved = sorted(set(s["params"]) ^ set(m["params"]))
                more = " ..." if len(moved) > 5 else ""
                return f"group {i} holds other parameters (differing: {', '.join(moved[:5])}{more})"
        return None

    def restore_lrs(self, saved: list[dict] | None) -> None:
        """Each group's current lr (and a scheduler's "initial_lr") as saved, as torch's
        `Optimizer.load_state_dict` does, and who sets the lrs: a run resumes as it went on."""
        for g, s in zip(self.groups, saved or []):
            g["lr"] = s["lr"]
            if "initial_lr" in s:
                g["initial_lr"] = s["initial_lr"]
            self.lrs_set_by_user = bool(s.get("lr_set_by_user", False))


def _named_parameters(model: nn.Module) -> tuple[dict[str, str], dict[int, str], set[str]]:
    """Every name of a trainable parameter -> its canonical name, id(parameter) -> canonical name (every
    parameter), and the names of the frozen ones."""
    alias: dict[str, str] = {}
    by_id: dict[int, str] = {}
    frozen: set[str] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical = by_id.setdefault(id(p), name)
        (alias.__setitem__(name, canonical) if p.requires_grad else frozen.add(name))
    return alias, by_id, frozen


def _check_value(key: str, value, where: str) -> object:
    bad = None
    if key == "betas":
        if not (isinstance(value, (list, tuple)) and len(value) == 2
                and all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in value)):
            bad = "a pair of numbers in [0, 1)"
        value = tuple(float(b) for b in value) if bad is None else value
    elif not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0 \
            or (key == "eps" and value == 0):
        bad = "a number > 0" if key == "eps" else "a number >= 0"
    else:
        value = float(value)
    if bad:
        raise ConfigError(f"{where}: {key} = {value!r} must be {bad}")
    return value


def _check_torch_keys(spec: dict, where: str, decoupled: bool) -> None:
    """A torch optimizer's own keys in a group must describe the update infinity runs."""
    wanted = {**_TORCH_VARIANTS, "decoupled_weight_decay": decoupled}
    for key, value in wanted.items():
        if key in spec and bool(spec[key]) != value:
            fix = ('set optimizer.name = "adamw"' if key == "decoupled_weight_decay" and spec[key] else
                   'set optimizer.name = "adam"' if key == "decoupled_weight_decay" else f"remove {key!r}")
            raise ConfigError(f"{where}: {key} = {spec[key]!r} is not supported (infinity runs "
                              f"{'AdamW' if decoupled else 'Adam'} with {key} = {value}); {fix}")


def _defaults(cfg: OptimizerConfig) -> dict:
    return {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "betas": tuple(cfg.betas), "eps": cfg.eps}


def _from_no_decay(model: nn.Module, cfg: OptimizerConfig, alias: dict[str, str]) -> list[dict]:
    """The groups `[optimizer] no_decay` asks for: decay (the section's weight_decay) and no decay (0)."""
    rules, canonical = list(cfg.no_decay), list(dict.fromkeys(alias.values()))
    if not rules:
        return [{"params": canonical}]
    decayed = decay_parameter_names(model) if BIAS_AND_NORM in rules else None
    patterns = [re.compile(r) for r in rules if r != BIAS_AND_NORM]
    off = [n for n in canonical if (decayed is not None and n not in decayed) or any(p.search(n) for p in patterns)]
    on = [n for n in canonical if n not in set(off)]
    return [g for g in ({"params": on}, {"params": off, "weight_decay": 0.0}) if g["params"]]


def resolve_groups(model: nn.Module, cfg: OptimizerConfig, param_groups: Sequence[dict] | None) -> ParamGroups:
    """The groups of this run (module docstring); raises ConfigError naming what to change."""
    alias, canonical_of, frozen = _named_parameters(model)
    trainable = set(alias.values())
    if param_groups is not None and cfg.no_decay:
        raise ConfigError(f"both param_groups= and optimizer.no_decay = {list(cfg.no_decay)} are set: the groups "
                          f"passed to initialize replace the key; drop one (put the no-decay parameters in a group "
                          f"with weight_decay 0)")
    if param_groups is None:
        given = _from_no_decay(model, cfg, alias)
    else:
        given = [] if isinstance(param_groups, dict) else list(param_groups)
        if given and all(isinstance(g, nn.Parameter) for g in given):
            given = [{"params": given}]  # torch.optim also takes the parameters themselves: one group
        if not given or not all(isinstance(g, dict) for g in given):
            raise ConfigError("param_groups must be a list of dicts, each with 'params' (parameters of the model or "
                              "their names) and any of " + ", ".join(GROUP_KEYS) + " (as torch.optim takes them)")
    groups: list[dict] = []
    group_of: dict[str, int] = {}
    for i, spec in enumerate(given):
        where = f"param_groups[{i}]"
        _check_torch_keys(spec, where, decoupled=cfg.name == "adamw")
        unknown = sorted(set(spec) - {"params", *GROUP_KEYS, *_TORCH_IMPLEMENTATION, *_TORCH_VARIANTS,
                                      "decoupled_weight_decay"})
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; a group sets only {', '.join(GROUP_KEYS)} (the "
                              f"rest of Adam is [optimizer]'s: name, grad_clip, ...)")
        if "params" not in spec:
            raise ConfigError(f"{where} has no 'params': give the group's parameters (or their names)")
        params = spec["params"]
        params = [params] if isinstance(params, (str, nn.Parameter)) else list(params)
        names = []
        for p in params:
            name = alias.get(p) if isinstance(p, str) else canonical_of.get(id(p))
            if (p in frozen) if isinstance(p, str) else (name is not None and name not in trainable):
                continue  # frozen (requires_grad=False): never stepped, as torch.optim skips a None gradient
            if name is None:
                what = repr(p) if isinstance(p, str) else f"a tensor of shape {tuple(p.shape)}"
                raise ConfigError(f"{where}: {what} is not a trainable parameter of the model: pass the model's own "
                                  f"parameters (model.named_parameters(), before initialize) or their names")
            if name in group_of:
                raise ConfigError(f"parameter {name!r} is in param_groups[{group_of[name]}] and {where}: put every "
                                  f"parameter in exactly one group")
            group_of[name] = i
            names.append(name)
        group = {"params": names, **_defaults(cfg)}
        group.update({k: _check_value(k, spec[k], where) for k in GROUP_KEYS if k in spec})
        groups.append(group)
    missing = [n for n in dict.fromkeys(alias.values()) if n not in group_of]
    if missing:
        raise ConfigError(f"{len(missing)} trainable parameter(s) are in no group: {', '.join(missing[:8])}"
                          f"{' ...' if len(missing) > 8 else ''}; add them to a group (or set requires_grad=False "
                          f"on those that should not train)")
    return ParamGroups(groups=groups, base_lrs=[g["lr"] for g in groups], group_of=group_of)
