"""A DeepSpeed config in infinity's terms: `infinity train --deepspeed ds_config.json` (and `translate` through the
Python API) turns each DeepSpeed key into the infinity key that does the same, as `--set` lines the job reads
before the user's own (so `--config` and `--set` still win), and names every key it cannot honour with the reason.

Note [deepspeed translation]: a key is translated only where infinity does the same thing; where it does a
near thing the line says how it differs (the warmup's first step); where it has no counterpart (a tuning knob of
DeepSpeed's own buffers, a log warmup) the key is refused, and the run does not start unless the user says
`--deepspeed-lenient`, which trains without those keys and prints them. Nothing is dropped in silence. "auto"
values (as the HF integration writes them) take infinity's value for the key, and the line says so; an "auto"
tuning knob with no counterpart (a bucket size) leaves the choice to infinity, which is what "auto" asks.
The table of keys is docs/from-deepspeed.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from infinity.config.options import ConfigError, show

# DeepSpeed keys with no infinity counterpart, and why (refused unless lenient)
NO_COUNTERPART = {
    "zero_optimization.sub_group_size": "infinity streams the optimizer in optimizer.sub_group_size elements "
                                        "(a different unit: set it there if you need it)",
    "zero_optimization.stage3_prefetch_bucket_size": "infinity prefetches whole units (prefetch.units_ahead)",
    "zero_optimization.stage3_max_live_parameters": "infinity keeps prefetch.units_ahead + 1 units gathered",
    "zero_optimization.stage3_max_reuse_distance": "infinity keeps prefetch.units_ahead + 1 units gathered",
    "zero_optimization.stage3_param_persistence_threshold": "infinity gathers every unit the same way",
    "zero_optimization.reduce_bucket_size": "infinity reduces each unit's flat gradient at once",
    "zero_optimization.allgather_bucket_size": "infinity gathers each unit's flat parameters at once",
    "zero_optimization.offload_param.buffer_count": "infinity sizes its staging from the plan",
    "zero_optimization.offload_param.buffer_size": "infinity sizes its staging from the plan",
    "zero_optimization.offload_param.max_in_cpu": "infinity places parameters by [placement], not by a count",
    "zero_optimization.offload_optimizer.buffer_count": "infinity sizes its staging from the plan",
    "zero_optimization.offload_optimizer.ratio": "infinity places whole units (placement.tail_units keeps the "
                                                 "first units' optimizer on the GPU)",
    "zero_optimization.offload_optimizer.fast_init": "infinity initializes state unit by unit always",
    "activation_checkpointing.partition_activations": "infinity's checkpointed inputs are not partitioned",
    "activation_checkpointing.contiguous_memory_optimization": "no counterpart",
    "activation_checkpointing.number_checkpoints": "infinity checkpoints every unit",
    "activation_checkpointing.synchronize_checkpoint_boundary": "no counterpart",
    "activation_checkpointing.profile": "infinity's profile: profile.enabled",
}
# keys that change nothing in what is computed, whatever their value (communication and logging details)
NOTHING_TO_DO = {
    "zero_optimization.overlap_comm": "infinity always overlaps its collectives with compute",
    "zero_optimization.contiguous_gradients": "infinity's gradients are one flat buffer per unit always",
    "zero_optimization.reduce_scatter": "infinity reduce-scatters at stages 2-3 always",
    "zero_optimization.allgather_partitions": "infinity all-gathers partitions always",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "infinity's export gathers the weights always",
    "zero_optimization.round_robin_gradients": "no effect on the result",
    "zero_allow_untested_optimizer": "a DeepSpeed safety switch",
    "wall_clock_breakdown": "infinity's profile is profile.enabled",
    "gradient_predivide_factor": "no effect on the result beyond rounding",
    "prescale_gradients": "no effect on the result beyond rounding",
    "communication_data_type": "infinity reduces gradients in fp32",
}
TIERS = {"none": "device", "cpu": "host", "nvme": "nvme"}


@dataclass
class Translation:
    """What a DeepSpeed config says in infinity's terms."""

    sets: list[str] = field(default_factory=list)  # "section.key=value" lines, in the order translated
    lines: list[str] = field(default_factory=list)  # "ds.key = v -> infinity.key = v (how)" for each
    refused: list[str] = field(default_factory=list)  # "ds.key = v: why" for each key not honoured

    def set(self, ds_key: str, ds_value: Any, key: str, value: Any, how: str = "") -> None:
        self.sets.append(f"{key}={json.dumps(value)}")
        self.lines.append(f"{ds_key} = {show(ds_value)} -> {key} = {show(value)}" + (f" ({how})" if how else ""))

    def refuse(self, ds_key: str, ds_value: Any, why: str) -> None:
        self.refused.append(f"{ds_key} = {show(ds_value)}: {why}")

    def note(self, ds_key: str, ds_value: Any, why: str) -> None:
        self.lines.append(f"{ds_key} = {show(ds_value)} -> nothing to set ({why})")


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name not in ("optimizer.params", "scheduler.params"):
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out


def translate(ds: dict, world_size: int = 1) -> Translation:
    """The translation of DeepSpeed config `ds` (as its JSON parses) for a run of `world_size` ranks."""
    if not isinstance(ds, dict):
        raise ConfigError(f"a DeepSpeed config is a JSON object, not {type(ds).__name__}")
    t = Translation()
    flat = _flat(ds)
    done: set[str] = set()

    def take(key: str, default=None):
        done.add(key)
        return flat.get(key, default)

    def auto(key: str) -> bool:
        if flat.get(key) == "auto":
            done.add(key)
            t.note(key, "auto", "infinity's own value for it")
            return True
        return False

    z = "zero_optimization."
    if z + "stage" in flat and not auto(z + "stage"):
        t.set(z + "stage", take(z + "stage"), "zero.stage", int(flat[z + "stage"]))
    paths: list[str] = []
    for part, groups in (("offload_param", ("params",)), ("offload_optimizer", ("optimizer", "grads"))):
        device = take(f"{z}{part}.device")
        if device is not None:
            if device not in TIERS:
                t.refuse(f"{z}{part}.device", device, f"one of {', '.join(TIERS)}")
            else:
                for g in groups:
                    tier = TIERS[device] if g != "grads" else ("host" if device != "none" else "device")
                    t.set(f"{z}{part}.device", device, f"placement.{g}", tier,
                          "the gradients go where the optimizer reads them" if g == "grads" else "")
        path = take(f"{z}{part}.nvme_path")
        if path is not None and path not in paths:
            paths.append(path)
        pin = take(f"{z}{part}.pin_memory")
        if pin is not None:
            if pin:
                t.note(f"{z}{part}.pin_memory", pin, "infinity's host tier is pinned with a GPU")
            else:
                t.refuse(f"{z}{part}.pin_memory", pin, "infinity's host tier is always pinned with a GPU")
    if paths:
        t.set(f"{z}offload_*.nvme_path", paths if len(paths) > 1 else paths[0], "nvme.paths", paths)
    if "gradient_clipping" in flat and not auto("gradient_clipping"):
        t.set("gradient_clipping", take("gradient_clipping"), "optimizer.grad_clip", float(flat["gradient_clipping"]))
    accum = flat.get("gradient_accumulation_steps")
    if accum is not None and not auto("gradient_accumulation_steps"):
        take("gradient_accumulation_steps")
        t.set("gradient_accumulation_steps", accum, "train.grad_accum_steps", int(accum))
    micro = flat.get("train_micro_batch_size_per_gpu")
    if micro is not None and not auto("train_micro_batch_size_per_gpu"):
        take("train_micro_batch_size_per_gpu")
        t.set("train_micro_batch_size_per_gpu", micro, "run.batch_size", int(micro) * world_size,
              f"the job's batch is over all ranks: {micro} x {world_size}")
    total = flat.get("train_batch_size")
    if total is not None and not auto("train_batch_size"):
        take("train_batch_size")
        m = int(micro) if isinstance(micro, int) else None
        a = int(accum) if isinstance(accum, int) else 1
        if m is None:
            if total % (a * world_size):
                t.refuse("train_batch_size", total, f"not a multiple of gradient_accumulation_steps x world size "
                                                    f"({a} x {world_size})")
            else:
                t.set("train_batch_size", total, "run.batch_size", total // a,
                      f"train_batch_size / gradient_accumulation_steps ({a})")
        elif total != m * a * world_size:
            t.refuse("train_batch_size", total, f"DeepSpeed needs it equal to micro batch x accumulation x world "
                                                f"size = {m} x {a} x {world_size} = {m * a * world_size}")
        else:
            t.note("train_batch_size", total, "it equals micro batch x accumulation x world size")
    for kind, dtype in (("bf16", "bf16"), ("fp16", "fp16")):
        enabled = take(f"{kind}.enabled")
        if enabled == "auto":
            t.note(f"{kind}.enabled", "auto", "infinity's own value for it")
        elif enabled:
            t.set(f"{kind}.enabled", enabled, "precision.compute_dtype", dtype, "master weights stay fp32")
    if take("fp16.initial_scale_power") is not None:
        t.set("fp16.initial_scale_power", flat["fp16.initial_scale_power"], "precision.initial_loss_scale",
              float(2 ** int(flat["fp16.initial_scale_power"])))
    if take("fp16.loss_scale_window") is not None:
        t.set("fp16.loss_scale_window", flat["fp16.loss_scale_window"], "precision.loss_scale_growth_interval",
              int(flat["fp16.loss_scale_window"]))
    _optimizer(t, flat, take)
    _scheduler(t, flat, take)
    if any(k.startswith("activation_checkpointing.") for k in flat):
        cpu = take("activation_checkpointing.cpu_checkpointing")
        t.set("activation_checkpointing", "{...}", "activation.checkpoint", "units",
              "infinity recomputes each unit from its saved input")
        if cpu:
            t.set("activation_checkpointing.cpu_checkpointing", cpu, "activation.offload", "host")
    if "steps_per_print" in flat:
        t.set("steps_per_print", take("steps_per_print"), "run.log_every", int(flat["steps_per_print"]))
    for key, value in flat.items():
        if key in done:
            continue
        if key in NOTHING_TO_DO:
            t.note(key, value, NOTHING_TO_DO[key])
        elif key in NO_COUNTERPART and value == "auto":  # (the HF integration's "auto": the runtime chooses)
            t.note(key, value, f"infinity chooses its own: {NO_COUNTERPART[key]}")
        elif key in NO_COUNTERPART:
            t.refuse(key, value, NO_COUNTERPART[key])
        elif not key.startswith("activation_checkpointing."):
            t.refuse(key, value, "not a key infinity translates (docs/from-deepspeed.md lists those it does)")
        else:
            t.refuse(key, value, "no counterpart")
    return t


def _optimizer(t: Translation, flat: dict, take) -> None:
    kind = take("optimizer.type")
    params = take("optimizer.params") or {}
    if kind is None:
        return
    if str(kind).lower() not in ("adam", "adamw"):
        t.refuse("optimizer.type", kind, "infinity's optimizer is Adam or AdamW ([optimizer] name)")
        return
    w_mode = params.get("adam_w_mode", True)
    name = "adamw" if str(kind).lower() == "adamw" or w_mode else "adam"
    t.set("optimizer.type", kind, "optimizer.name", name,
          "DeepSpeed's Adam decouples weight decay unless adam_w_mode is false" if str(kind).lower() == "adam" else "")
    for key, value in params.items():
        where = f"optimizer.params.{key}"
        if value == "auto":
            t.note(where, value, "infinity's own value for it")
        elif key == "lr":
            t.set(where, value, "optimizer.lr", float(value))
        elif key == "betas":
            t.set(where, value, "optimizer.betas", [float(b) for b in value])
        elif key == "eps":
            t.set(where, value, "optimizer.eps", float(value))
        elif key == "weight_decay":
            t.set(where, value, "optimizer.weight_decay", float(value))
        elif key in ("adam_w_mode", "torch_adam", "fused"):
            t.note(where, value, "the implementation: infinity's CPU or fused GPU Adam, the same maths")
        else:
            t.refuse(where, value, "not an Adam parameter infinity has")


def _scheduler(t: Translation, flat: dict, take) -> None:
    kind = take("scheduler.type")
    params = dict(take("scheduler.params") or {})
    if kind is None:
        return
    if kind not in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        t.refuse("scheduler.type", kind, "infinity's schedules are warmup then constant, linear or cosine decay")
        return
    warmup = params.pop("warmup_num_steps", 1000 if kind != "WarmupCosineLR" else 0)
    wtype = params.pop("warmup_type", "log")  # (DeepSpeed's default for all three)
    if warmup and wtype != "linear":
        t.refuse("scheduler.params.warmup_type", wtype, 'infinity\'s warmup is linear: set "warmup_type": "linear" '
                                                         "(DeepSpeed's default is log)")
    if warmup != "auto":
        t.set("scheduler.params.warmup_num_steps", warmup, "optimizer.warmup_steps", int(warmup),
              "infinity's warmup reaches lr one update earlier: lr x (s + 1) / warmup")
    schedule = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}[kind]
    t.set("scheduler.type", kind, "optimizer.schedule", schedule)
    low = params.pop("warmup_min_lr", 0.0)
    if low not in (0, 0.0, "auto"):
        t.refuse("scheduler.params.warmup_min_lr", low, "infinity's warmup starts from lr / warmup_steps")
    high = params.pop("warmup_max_lr", None)
    if high not in (None, "auto"):
        t.set("scheduler.params.warmup_max_lr", high, "optimizer.lr", float(high), "the peak learning rate")
    total = params.pop("total_num_steps", None)
    if total not in (None, "auto"):
        t.set("scheduler.params.total_num_steps", total, "optimizer.total_steps", int(total))
    if kind == "WarmupDecayLR":
        t.set("scheduler.type", kind, "optimizer.min_lr_ratio", 0.0, "decays to 0 at total_num_steps")
    ratio = params.pop("cos_min_ratio", None)
    if ratio is not None:
        t.set("scheduler.params.cos_min_ratio", ratio, "optimizer.min_lr_ratio", float(ratio))
    start = params.pop("warmup_min_ratio", None)
    if start not in (None, 0, 0.0):
        t.refuse("scheduler.params.warmup_min_ratio", start, "infinity's warmup starts from lr / warmup_steps")
    params.pop("last_batch_iteration", None)
    for key, value in params.items():
        t.refuse(f"scheduler.params.{key}", value, "not a schedule parameter infinity has")


def read(path, where: str | None = None) -> dict:
    """A DeepSpeed config file's JSON; `where` names it in an error (default: the command line's `--deepspeed`)."""
    where = where or f"--deepspeed {path}"
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it ({e.strerror})") from None
    except ValueError as e:
        raise ConfigError(f"{where}: invalid JSON: {e}") from None


def refusal(t: Translation, where: str) -> ConfigError:
    """The error of a translation with refused keys (Note [deepspeed translation])."""
    listed = "; ".join(t.refused)
    return ConfigError(f"{where}: {len(t.refused)} DeepSpeed key(s) infinity cannot honour: {listed}. Remove them, "
                       f"or pass --deepspeed-lenient to train without them (they are printed)")
