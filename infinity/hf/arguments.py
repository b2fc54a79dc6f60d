"""What `transformers.TrainingArguments` say, as the engine's config: mapped, or refused with the fix.

Note [training arguments win]: the Trainer's own arguments own the optimizer hyper-parameters
(learning_rate, adam_beta1/2, adam_epsilon, weight_decay, max_grad_norm), the accumulation
(gradient_accumulation_steps), the compute dtype (bf16), activation checkpointing
(gradient_checkpointing) and the seed; `infinity_config` owns what the Trainer has no words for
(placement, budgets, NVMe paths, ZeRO stage, prefetch, io, the profiler: its output goes to output_dir/profile
unless `infinity_config` sets profile.trace_dir). A key both could set is taken from the
arguments; an `infinity_config` that sets it to something else is refused (one answer, in one
place), and so is any argument the engine cannot honour: never ignored. `use_cpu=True` is one on a machine
with a GPU: the engine trains on the GPU whenever there is one (machine/environment.py `resolve`), while the
Trainer would keep its loss and inputs on the CPU; on a CPU-only machine it is what runs anyway.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers import TrainingArguments

from infinity.config.sections import Config, ConfigError
from infinity.hf.deepspeed import DeepSpeedArgumentsMixin

__all__ = ["InfinityTrainingArguments", "engine_config_for", "refuse_unsupported"]

ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")  # exactly torch.optim.AdamW's update
PROFILE_DIR = "profile"  # the profiler's output inside output_dir, unless infinity_config sets profile.trace_dir


def _value(args, name: str):
    v = getattr(args, name, None)
    return getattr(v, "value", v)  # (enums such as OptimizerNames)


def refuse_unsupported(args) -> None:
    """Raise a ConfigError naming the first TrainingArguments field the engine cannot honour, and the fix."""
    optim = str(_value(args, "optim"))
    if optim not in ADAMW_OPTIMS:
        raise ConfigError(f"TrainingArguments(optim={optim!r}): infinity runs AdamW (torch.optim.AdamW's update) "
                          f"on its own CPU/GPU optimizer; use optim=\"adamw_torch\" (or \"adamw_torch_fused\"), or "
                          f"[optimizer] name = \"adam\" in infinity_config for Adam")
    refusals = [
        ("fp16", bool(args.fp16), "fp16=True: infinity's mixed precision is bf16 here; use bf16=True "
                                   "(master weights stay fp32)"),
        ("deepspeed", args.deepspeed is not None, "deepspeed=...: infinity runs a DeepSpeed config through "
                                                   "infinity.hf.InfinityTrainingArguments(deepspeed=...) (TRL: "
                                                   "InfinitySFTConfig); use it instead of TrainingArguments"),
        ("fsdp", bool(args.fsdp), "fsdp=...: infinity shards the model itself; remove it and set [zero] stage in "
                                  "infinity_config"),
        ("torch_compile", bool(args.torch_compile), "torch_compile=True: a model compiled whole cannot "
                                                    "run the engine's per-unit hooks; remove it and set [compile] "
                                                    "units = true in infinity_config (docs/compile.md)"),
        ("optim_args", bool(args.optim_args), "optim_args=...: the engine takes only lr / betas / eps / "
                                              "weight_decay; remove it"),
        ("gradient_checkpointing_kwargs", bool(set(args.gradient_checkpointing_kwargs or {}) - CHECKPOINT_KWARGS),
         f"gradient_checkpointing_kwargs={args.gradient_checkpointing_kwargs}: the engine recomputes whole units its "
         f"own way ([activation] checkpoint = \"units\"); of torch.utils.checkpoint's arguments only "
         f"{', '.join(sorted(CHECKPOINT_KWARGS))} is accepted (it does not change the result); remove the others"),
        ("use_liger_kernel", bool(getattr(args, "use_liger_kernel", False)), "use_liger_kernel=True: remove it"),
        ("use_cpu", bool(getattr(args, "use_cpu", False)) and torch.cuda.is_available(),
         "use_cpu=True: this machine has a GPU and the engine trains on it; remove use_cpu, or hide the GPU with "
         "CUDA_VISIBLE_DEVICES= to train on the CPU"),
        ("n_gpu", getattr(args, "_n_gpu", 0) > 1, "more than one GPU in one process (DataParallel): launch one "
                                                  "process per GPU with torchrun instead"),
    ]
    for name, bad, fix in refusals:
        if bad:
            raise ConfigError(f"TrainingArguments({fix})")


# gradient_checkpointing_kwargs the engine accepts: `use_reentrant` picks torch.utils.checkpoint's implementation,
# which the engine does not use (it recomputes each unit's forward before its backward: runtime/recompute.py); either
# value gives the same gradients, so it is accepted (TRL and HF recipes pass it routinely) and means nothing more.
CHECKPOINT_KWARGS = frozenset({"use_reentrant"})


def _mapped(args) -> dict[str, dict[str, Any]]:
    """The engine keys the TrainingArguments decide (Note [training arguments win])."""
    return {
        "optimizer": {"name": "adamw", "lr": float(args.learning_rate),
                      "betas": (float(args.adam_beta1), float(args.adam_beta2)), "eps": float(args.adam_epsilon),
                      "weight_decay": float(args.weight_decay), "grad_clip": max(float(args.max_grad_norm or 0), 0.0),
                      "schedule": "constant", "warmup_steps": 0, "total_steps": 0, "no_decay": ()},
        "precision": {"compute_dtype": "bf16" if args.bf16 else "fp32"},
        "activation": {"checkpoint": "units" if args.gradient_checkpointing else "none"},
        "train": {"grad_accum_steps": int(args.gradient_accumulation_steps), "seed": int(args.seed)},
        "checkpoint": {"background": False, "keep_last": 0},  # the Trainer rotates its checkpoint-N folders
    }


def _as_config(infinity_config) -> Config:
    if infinity_config is None:
        return Config()
    if isinstance(infinity_config, Config):
        return infinity_config
    if isinstance(infinity_config, dict):
        return Config.from_dict(infinity_config)
    try:
        return Config.from_file(infinity_config)
    except ConfigError as e:  # (the file's own error, said as the argument that named it)
        raise ConfigError(f"infinity_config={str(infinity_config)!r}: {e}") from None


def engine_config_for(args, infinity_config=None) -> Config:
    """The engine's Config: `infinity_config` (a Config, a dict, a TOML path or None) with the keys the
    TrainingArguments decide set from them; a conflicting `infinity_config` key is refused."""
    refuse_unsupported(args)
    user = _as_config(infinity_config).to_dict()
    default = Config().to_dict()
    plan = getattr(args, "deepspeed_plan", None)
    if plan is not None:  # the DeepSpeed config's keys under infinity_config's (Note [deepspeed through the Trainer])
        for dotted, value in plan.engine_sets.items():
            section, key = dotted.split(".", 1)
            given, fallback = user[section][key], default[section][key]
            if _same(given, fallback) or _same(given, value):
                user[section][key] = value
                continue
            raise ConfigError(f"infinity_config sets {dotted} = {given!r} but TrainingArguments(deepspeed=...) sets "
                              f"it to {value!r}: set it in one of them")
    for section, keys in _mapped(args).items():
        for key, value in keys.items():
            given, fallback = user[section][key], default[section][key]
            if _same(given, fallback) or _same(given, value):
                user[section][key] = value
                continue
            if key == "name" and given == "adam":  # Adam (L2 decay) instead of AdamW: infinity_config's to choose
                continue
            raise ConfigError(f"infinity_config sets {section}.{key} = {given!r} but the Trainer decides it "
                              f"({value!r} from TrainingArguments): set it in TrainingArguments and remove it "
                              f"from infinity_config")
    if user["profile"]["trace_dir"] == default["profile"]["trace_dir"] and getattr(args, "output_dir", None):
        user["profile"]["trace_dir"] = os.path.join(args.output_dir, PROFILE_DIR)  # (`infinity profile OUTPUT_DIR`)
    return Config.from_dict(user)


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a == b


@dataclass
class InfinityTrainingArguments(DeepSpeedArgumentsMixin, TrainingArguments):
    """`transformers.TrainingArguments` that takes `deepspeed=` (a JSON path or a dict) without DeepSpeed installed:
    InfinityTrainer runs it on the engine (Note [deepspeed through the Trainer] in deepspeed.py)."""
