"""Parameter-group runs (tests/runtime/test_param_groups.py): the groupings real loops use, written out, and the
same training through plain torch.optim.AdamW and through the engine (one rank of a possibly larger group)."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field

import torch
import torch.nn as nn

import infinity
from engine_runs import train_steps
from reference import Recipe

WD = 0.1


def nanogpt_groups(model: nn.Module) -> list[dict]:
    """nanoGPT's `configure_optimizers`: every 2-D parameter (matmul weights, embeddings) decays, the rest
    (biases, LayerNorm weights: dim < 2) does not."""
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def hf_no_decay_names(model: nn.Module) -> set[str]:
    """HF Trainer's default for this model, written out: no decay on biases and on the parameters of
    nn.LayerNorm modules (the GPT's names hold none of the other 'norm' spellings the rule also catches)."""
    in_norm = {f"{m}.{n}" for m, mod in model.named_modules() if isinstance(mod, nn.LayerNorm)
               for n, _ in mod.named_parameters()}
    return {n for n, _ in model.named_parameters() if n.endswith("bias") or n in in_norm}


def hf_groups(model: nn.Module) -> list[dict]:
    """The reference's groups for `[optimizer] no_decay = ["bias_and_norm"]`."""
    off = hf_no_decay_names(model)
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n not in off]},
            {"params": [p for n, p in named if n in off], "weight_decay": 0.0}]


def two_lr_groups(model: nn.Module, by_name: bool = False) -> list[dict]:
    """Blocks at 3x the learning rate and without decay, the embeddings / head / final norm at [optimizer]'s
    (given as names when `by_name`)."""
    named = list(model.named_parameters())
    pick = (lambda n, p: n) if by_name else (lambda n, p: p)
    return [{"params": [pick(n, p) for n, p in named if n.startswith("blocks.")], "lr": 3e-3, "weight_decay": 0.0,
             "betas": (0.8, 0.99), "eps": 1e-6},
            {"params": [pick(n, p) for n, p in named if not n.startswith("blocks.")]}]


GROUPINGS = {"nanogpt": nanogpt_groups, "hf": hf_groups, "two_lr": two_lr_groups}


@dataclass(frozen=True)
class GroupCase:
    grouping: str  # a key of GROUPINGS; "hf" goes through the config key, the others through param_groups=
    placement: str  # every kind on this tier
    overlap: bool = False
    recipe: Recipe = Recipe(micro_batch=6, steps=3)
    stage: int = 3
    extra: dict = field(default_factory=dict)  # config sections to merge


def engine_config(case: GroupCase, swap_dir: str) -> dict:
    cfg = case.recipe.config(params=case.placement, grads=case.placement, optimizer=case.placement)
    cfg["zero"] = {"stage": case.stage}
    cfg["overlap"] = {"optimizer_with_backward": case.overlap}
    if case.placement == "nvme":
        os.makedirs(swap_dir, exist_ok=True)
        cfg["nvme"] = {"paths": [swap_dir]}
    if case.grouping == "hf":
        cfg["optimizer"]["no_decay"] = ["bias_and_norm"]
    for section, values in case.extra.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def engine_groups(case: GroupCase, model: nn.Module) -> list[dict] | None:
    if case.grouping == "hf":
        return None  # [optimizer] no_decay
    if case.grouping == "two_lr":
        return two_lr_groups(model, by_name=True)
    return GROUPINGS[case.grouping](model)


def group_run(case: GroupCase, swap_dir: str, rank: int = 0, world: int = 1):
    """Losses (rank mean) per micro-batch, the update mode's name and the state dict (rank 0)."""
    model = case.recipe.build()
    engine = infinity.initialize(model, engine_config(case, swap_dir), param_groups=engine_groups(case, model))
    try:
        losses = train_steps(engine, case.recipe, 0, case.recipe.steps, rank, world)
        return losses, type(engine.updates).__name__, engine.full_state_dict()
    finally:
        engine.close()


def groups_on_rank(rank: int, world: int, cases: list[GroupCase], root: str) -> list:
    return [group_run(c, os.path.join(root, f"c{i}-r{rank}"), rank, world) for i, c in enumerate(cases)]


def reference_groups_run(recipe: Recipe, groups_of, *, lr_lambda=None, model: nn.Module | None = None):
    """Plain torch.optim.AdamW with `groups_of(model)`, accumulation and clipping as the recipe says, and a
    LambdaLR(`lr_lambda`) stepped after each update when given."""
    model = copy.deepcopy(model) if model is not None else recipe.build()
    opt = torch.optim.AdamW(groups_of(model), lr=recipe.lr, betas=recipe.betas, eps=recipe.eps,
                            weight_decay=recipe.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda is not None else None
    losses = []
    for micro_batches in recipe.batches():
        for x, y in micro_batches:
            loss = model(x, y)
            (loss / recipe.accum).backward()
            losses.append(loss.item())
        if recipe.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
