"""`TrainingArguments(deepspeed=...)` without DeepSpeed: `InfinityTrainingArguments` takes the same `deepspeed=` (a
JSON path or a dict) and InfinityTrainer runs it on the engine (docs/from-deepspeed.md, the HF section).

Note [deepspeed through the Trainer]: transformers resolves a DeepSpeed config against its TrainingArguments
(`HfTrainerDeepSpeedConfig.trainer_config_process` / `trainer_config_finalize` in its integrations package): an
"auto" value takes the argument's value; any other value of a key both have must equal the argument's, or the
Trainer refuses the pair. The same rule here, for the same keys (`ARGUMENT_KEYS`; the scheduler's step counts once
the Trainer knows them), so a config that runs under transformers + DeepSpeed runs here unchanged. The resolved
config then goes through infinity's one translator (infinity/config/deepspeed.py: the same lines, the same refusals
of keys infinity cannot honour, `deepspeed_lenient=True` as `--deepspeed-lenient`). Of what it translates, the keys
the TrainingArguments decide (Note [training arguments win] in arguments.py: lr, betas, eps, weight decay, clipping,
accumulation, precision, activation checkpointing, the micro batch) are already equal to the arguments, so the
engine takes them from there; the rest (ZeRO stage, placement, NVMe paths, ...) becomes the base of the engine's
config, under `infinity_config` (a key both set differently is refused). A DeepSpeed `scheduler` replaces the
Trainer's `lr_scheduler_type`, as under DeepSpeed, and is DeepSpeed's own curve (`deepspeed_schedule`: log or linear
warmup from warmup_min_lr, then constant, linear decay or cosine), built on the engine's optimizer by
InfinityTrainer.create_scheduler; so this route checks the scheduler itself, not through the translator (whose
engine schedule differs: Note [deepspeed translation]). Two things the Trainer settles before translating: a
disabled fp16 / bf16 section's other keys do nothing (a line says so), and an "auto" DeepSpeed buffer size
(reduce_bucket_size, stage3_prefetch_bucket_size, stage3_param_persistence_threshold, which transformers computes
from the model's hidden size) asks for the runtime's own choice: infinity sizes those from its plan (a line says
so). `args.deepspeed` reads None after construction (so neither transformers nor accelerate starts DeepSpeed, which
need not be installed); `args.infinity_deepspeed` holds the config as given.
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from infinity.config.deepspeed import Translation, read, translate
from infinity.config.sections import ConfigError

__all__ = ["DeepSpeedArgumentsMixin", "DeepSpeedPlan", "deepspeed_schedule"]

# the DeepSpeed keys the Trainer fills from its arguments ("auto") or checks against them
# (Note [deepspeed through the Trainer]): DeepSpeed key -> (the TrainingArguments name as the message says it,
# its value from args)
ARGUMENT_KEYS = {
    "train_micro_batch_size_per_gpu": ("per_device_train_batch_size", lambda a: a.per_device_train_batch_size),
    "gradient_accumulation_steps": ("gradient_accumulation_steps", lambda a: a.gradient_accumulation_steps),
    "train_batch_size": ("world_size x per_device_train_batch_size x gradient_accumulation_steps",
                         lambda a: a.world_size * a.per_device_train_batch_size * a.gradient_accumulation_steps),
    "gradient_clipping": ("max_grad_norm", lambda a: a.max_grad_norm),
    "optimizer.params.lr": ("learning_rate", lambda a: a.learning_rate),
    "optimizer.params.betas": ("adam_beta1, adam_beta2", lambda a: [a.adam_beta1, a.adam_beta2]),
    "optimizer.params.eps": ("adam_epsilon", lambda a: a.adam_epsilon),
    "optimizer.params.weight_decay": ("weight_decay", lambda a: a.weight_decay),
    "scheduler.params.warmup_max_lr": ("learning_rate", lambda a: a.learning_rate),
    "fp16.enabled": ("fp16", lambda a: bool(a.fp16 or a.fp16_full_eval)),
    "bf16.enabled": ("bf16", lambda a: bool(a.bf16 or a.bf16_full_eval)),
}
FILLED_ONLY = {"scheduler.params.warmup_min_lr": 0}  # "auto" -> this; any value allowed (not a Trainer argument)
# "auto" buffer sizes transformers computes from the hidden size for DeepSpeed: infinity's plan sizes its own
AUTO_SIZES = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
              "zero_optimization.stage3_param_persistence_threshold")
SCHEDULES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
SCHEDULE_PARAMS = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps",
                   "last_batch_iteration", "cos_min_ratio", "warmup_min_ratio"}
# infinity keys the TrainingArguments decide: equal to the arguments once resolved, so not taken from the translation
DECIDED_BY_ARGUMENTS = {"optimizer.lr", "optimizer.betas", "optimizer.eps", "optimizer.weight_decay",
                        "optimizer.grad_clip", "train.grad_accum_steps", "precision.compute_dtype", "run.batch_size"}
# infinity keys of the lr schedule: the Trainer's scheduler runs it (deepspeed_schedule), not the engine's
SCHEDULE_KEYS = {"optimizer.schedule", "optimizer.warmup_steps", "optimizer.total_steps", "optimizer.min_lr_ratio"}


def _node(tree: dict, dotted: str):
    """(the dict holding the key, the key) of a dotted DeepSpeed key, or (None, key) when a parent is absent."""
    *parents, key = dotted.split(".")
    for p in parents:
        tree = tree.get(p)
        if not isinstance(tree, dict):
            return None, key
    return tree, key


def _equal(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return bool(a) == bool(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a == b


def _fill(ds: dict, key: str, value, what: str, mismatches: list[str], must_match: bool = True) -> None:
    node, name = _node(ds, key)
    if node is None or name not in node:
        return
    if node[name] == "auto":
        node[name] = value
    elif must_match and not _equal(node[name], value):
        mismatches.append(f"{key} = {json.dumps(node[name])} vs TrainingArguments {what} = {json.dumps(value)}")


def _mismatch_error(mismatches: list[str]) -> ConfigError:
    return ConfigError(f"TrainingArguments(deepspeed=...): {'; '.join(mismatches)}: as with transformers' DeepSpeed "
                       f"integration, a DeepSpeed value must equal the Trainer's argument: set it to \"auto\" or to "
                       f"the same value")


def _read(source) -> dict:
    if isinstance(source, dict):
        return copy.deepcopy(source)
    if isinstance(source, (str, os.PathLike)):
        text = str(source)
        if text.lstrip().startswith("{"):  # (transformers also takes the JSON itself as a string)
            try:
                return json.loads(text)
            except ValueError as e:
                raise ConfigError(f"TrainingArguments(deepspeed=...): invalid JSON: {e}") from None
        return read(text, f"TrainingArguments(deepspeed={text!r})")
    raise ConfigError(f"TrainingArguments(deepspeed=...) is a JSON file's path or a dict, not {type(source).__name__}")


@dataclass
class DeepSpeedPlan:
    """A DeepSpeed config as InfinityTrainer runs it (Note [deepspeed through the Trainer])."""

    config: dict  # the DeepSpeed config, "auto" resolved from the arguments (the step counts at create_scheduler)
    translation: Translation
    engine_sets: dict[str, Any]  # "section.key" -> value: the engine config keys the DeepSpeed config decides
    scheduler: dict | None  # {"type": ..., "params": {...}} when it has one

    notes: list[str] = field(default_factory=list)  # what the Trainer settled before translating
    refused: list[str] = field(default_factory=list)  # the translator's refusals and the scheduler's

    def lines(self) -> list[str]:
        runs = ([f"scheduler = {json.dumps(self.scheduler)} -> the Trainer's scheduler runs DeepSpeed's curve "
                 f"(lr_scheduler_type is not used; step counts resolved when training starts)"]
                if self.scheduler is not None else [])
        return ([f"deepspeed: {line}" for line in self.translation.lines + self.notes + runs]
                + [f"deepspeed: not honoured (deepspeed_lenient=True): {line}" for line in self.refused])


def plan_for(args, source, lenient: bool) -> DeepSpeedPlan:
    """Resolve `source` against the TrainingArguments `args` as transformers does, translate it, and split what the
    engine takes from it (Note [deepspeed through the Trainer])."""
    ds = _read(source)
    if not isinstance(ds, dict):
        raise ConfigError(f"TrainingArguments(deepspeed=...): a DeepSpeed config is a JSON object, not "
                          f"{type(ds).__name__}")
    mismatches: list[str] = []
    for key, (what, value) in ARGUMENT_KEYS.items():
        _fill(ds, key, value(args), what, mismatches)
    for key, value in FILLED_ONLY.items():
        _fill(ds, key, value, key, mismatches, must_match=False)
    if mismatches:
        raise _mismatch_error(mismatches)
    notes: list[str] = []
    for kind in ("fp16", "bf16"):
        section = ds.get(kind)
        if isinstance(section, dict) and not section.get("enabled") and set(section) - {"enabled"}:
            notes.append(f"{kind}.{{{', '.join(sorted(set(section) - {'enabled'}))}}} -> nothing to set ({kind} is "
                         f"off)")
            ds[kind] = {"enabled": section.get("enabled", False)}
    for key in AUTO_SIZES:
        node, name = _node(ds, key)
        if node is not None and node.get(name) == "auto":
            del node[name]
            notes.append(f"{key} = \"auto\" -> nothing to set (infinity sizes its buffers from its plan)")
    scheduler = ds.pop("scheduler", None)
    refused = _check_scheduler(scheduler)
    t = translate(ds, world_size=args.world_size)
    refused = t.refused + refused
    if refused and not lenient:
        raise ConfigError(f"TrainingArguments(deepspeed=...): {len(refused)} DeepSpeed key(s) infinity cannot "
                          f"honour: {'; '.join(refused)}. Remove them, or pass deepspeed_lenient=True to train "
                          f"without them (they are printed)")
    if scheduler is not None:
        ds["scheduler"] = scheduler
    sets: dict[str, Any] = {}
    for line in t.sets:
        key, value = line.split("=", 1)
        sets[key] = json.loads(value)
    if sets.get("activation.checkpoint") == "units" and not args.gradient_checkpointing:
        raise ConfigError("TrainingArguments(deepspeed=...): the DeepSpeed config has activation_checkpointing but "
                          "gradient_checkpointing=False: the Trainer decides it; pass gradient_checkpointing=True "
                          "(the engine recomputes whole units), or remove activation_checkpointing")
    engine = {k: v for k, v in sets.items()
              if k not in DECIDED_BY_ARGUMENTS | SCHEDULE_KEYS and k not in ("activation.checkpoint", "run.log_every")}
    honoured = scheduler if isinstance(scheduler, dict) and scheduler.get("type") in SCHEDULES else None
    return DeepSpeedPlan(config=ds, translation=t, engine_sets=engine, scheduler=honoured, notes=notes,
                         refused=refused)


def _check_scheduler(scheduler) -> list[str]:
    """The refusals of a DeepSpeed `scheduler` the Trainer runs (deepspeed_schedule)."""
    if scheduler is None:
        return []
    if not isinstance(scheduler, dict) or scheduler.get("type") not in SCHEDULES:
        kind = scheduler.get("type") if isinstance(scheduler, dict) else scheduler
        return [f"scheduler.type = {json.dumps(kind)}: the schedules run are {', '.join(SCHEDULES)}"]
    params = scheduler.get("params") or {}
    out = [f"scheduler.params.{k} = {json.dumps(v)}: not a parameter of DeepSpeed's {scheduler['type']}"
           for k, v in params.items() if k not in SCHEDULE_PARAMS]
    if params.get("warmup_type", "log") not in ("log", "linear"):
        out.append(f"scheduler.params.warmup_type = {json.dumps(params['warmup_type'])}: log or linear")
    if params.get("last_batch_iteration", -1) != -1:
        out.append(f"scheduler.params.last_batch_iteration = {params['last_batch_iteration']}: the Trainer resumes "
                   f"the schedule from its checkpoint (-1 only)")
    return out


def deepspeed_schedule(plan: DeepSpeedPlan, args, num_training_steps: int):
    """The DeepSpeed scheduler's lr factor per optimizer step (0-based), with its step counts resolved against the
    Trainer's as transformers does ("auto": num_training_steps, max(1, warmup steps)), or None without a scheduler.
    DeepSpeed's curves: warmup from warmup_min_lr to the peak over max(2, warmup_num_steps) steps, log (its
    default: log(step + 1) / log(warmup)) or linear (step / warmup), then WarmupLR constant, WarmupDecayLR linear
    back to warmup_min_lr at total_num_steps; WarmupCosineLR warms up from warmup_min_ratio of the peak, then
    follows a cosine to cos_min_ratio."""
    if plan.scheduler is None:
        return None
    params = plan.scheduler.setdefault("params", {})
    mismatches: list[str] = []
    _fill(plan.config, "scheduler.params.total_num_steps", num_training_steps, "num_training_steps (calculated)",
          mismatches)
    _fill(plan.config, "scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)),
          "warmup_steps", mismatches)
    if mismatches:
        raise _mismatch_error(mismatches)
    kind = plan.scheduler.get("type")
    peak = float(args.learning_rate)  # (= warmup_max_lr: checked equal, or filled from it)
    low = float(params.get("warmup_min_lr", 0.0)) / peak if peak > 0 else 0.0
    if kind == "WarmupCosineLR":  # (its warmup starts at a ratio of the peak, not at a learning rate)
        low = float(params.get("warmup_min_ratio", 0.0))
        warmup = int(params.get("warmup_num_steps", 0))
    else:
        warmup = max(2, int(params.get("warmup_num_steps", 1000)))  # (DeepSpeed's WarmupLR counts at least 2)
    total = int(params.get("total_num_steps", num_training_steps))
    floor = float(params.get("cos_min_ratio", 0.0001))  # (DeepSpeed's default)
    log = params.get("warmup_type", "log") == "log"

    def factor(step: int) -> float:
        if step < warmup:
            rise = math.log(step + 1) / math.log(warmup) if log else step / warmup
            return low + (1.0 - low) * rise
        if kind == "WarmupLR":
            return 1.0
        if kind == "WarmupDecayLR":
            return low + (1.0 - low) * max(0.0, (total - step) / max(1.0, total - warmup))
        done = (step - warmup + 1) / max(1, total - warmup)  # (DeepSpeed counts the first step after warmup as 1)
        return max(0.0, floor + (1.0 - floor) * (1 + math.cos(math.pi * done)) / 2)

    return factor


@dataclass
class DeepSpeedArgumentsMixin:
    """`deepspeed=` for InfinityTrainer without DeepSpeed installed (Note [deepspeed through the Trainer])."""

    deepspeed_lenient: bool = field(default=False, metadata={
        "help": "train without the DeepSpeed keys infinity cannot honour (they are printed), as --deepspeed-lenient"})
    infinity_deepspeed: Any = field(default=None, metadata={
        "help": "the deepspeed= config as given (args.deepspeed reads None: DeepSpeed itself is never started)"})

    def __post_init__(self):
        given = self.deepspeed if self.deepspeed not in (None, "") else None
        if given is not None and self.infinity_deepspeed is not None and given != self.infinity_deepspeed:
            raise ConfigError("TrainingArguments: deepspeed= and infinity_deepspeed= differ: pass deepspeed= only")
        source = given if given is not None else self.infinity_deepspeed
        self.deepspeed = None  # (transformers would start DeepSpeed, and refuses deepspeed= without it)
        super().__post_init__()
        self.infinity_deepspeed = source
        self.deepspeed_plan = None if source is None else plan_for(self, source, self.deepspeed_lenient)
        if self.deepspeed_plan is not None and self.process_index == 0:
            print("\n".join(self.deepspeed_plan.lines()), flush=True)
