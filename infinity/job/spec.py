"""The job of `infinity train`: its own config sections (`[run]`, `[model]`, `[model.lora]`, `[data]`),
the job file with its overrides and the resolved config as TOML (the models it builds: build.py; its data as
token ids: tokenized.py).

A job file is an engine config (every section of `infinity config --defaults`)
plus four sections of its own, `[run]`, `[model]`, `[model.lora]` and `[data]`;
keys a file leaves out take the job's defaults (`TRAIN_DEFAULTS`: parameters and
optimizer state on NVMe under the run directory, AdamW with cosine decay), then
the engine's. `--set section.key=value` overrides either kind of key
(`--set model.lora.r=8` for the nested section).

Note [fine-tuning job]: `model.pretrained = DIR` fine-tunes a Hugging Face model: its
kind and shape come from DIR's config.json (AutoConfig), the model is built on the meta
device (AutoModelForCausalLM.from_config) and its weights are streamed from DIR into the
tiers (`initialize(weights=DIR)`), so the job never holds the model in RAM. The shape keys
of [model] must then stay unset (they would be silently ignored otherwise). `[model.lora]
r > 0` wraps the model with PEFT's LoRA (get_peft_model) before it is sharded: the base
weights are frozen and only the adapters get gradients and Adam state. The data is the job's
corpus (`data.path`) in the model's own vocabulary: tokenized by the tokenizer saved in DIR
(AutoTokenizer, `model.tokenizer = "auto"`), since a pretrained model knows its own ids
only: a DIR without one is refused (training it on bytes would ruin it), unless the user says
`model.tokenizer = "bytes"`: then each byte is the token id it is (0..255), which needs a
vocabulary of at least 256 ids (a smaller one is refused). The
corpus is tokenized once per run start, in chunks of lines (a fast tokenizer takes seconds
for the shipped 4 MB). At the end the model is exported into <run>/export as a Hugging Face directory
(merged LoRA weights by default, `model.lora.merge = false` for the adapters alone) with
DIR's config and tokenizer files, loadable with `from_pretrained`. The pretrained path and
the LoRA keys are part of the model a checkpoint was trained with: `--resume` refuses to
change them (resume.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infinity.config.job import JOB_SECTIONS, DataConfig, LoraConfig, ModelConfig, RunConfig
from infinity.config.options import (
    ConfigError,
    SettingWarning,
    did_you_mean,
    parse_override,
    read_document,
    render_default,
    show,
    type_name,
)
from infinity.config.sections import SECTIONS, Config, key_outside_sections

# ---------------------------------------------------------------- job config


def _field(section: str) -> str:
    """The Job attribute of a job section ("model.lora" -> "lora")."""
    return section.rsplit(".", 1)[-1]


# The engine config of `infinity train` where it differs from Config(): state on NVMe, AdamW + cosine.
TRAIN_DEFAULTS = {
    "optimizer": {"lr": 2e-3, "weight_decay": 0.1, "grad_clip": 1.0},
    "placement": {"params": "nvme", "grads": "host", "optimizer": "nvme"},
    "profile": {"enabled": True},  # the overlap efficiency on the progress line, profile/ in the run directory
    "memory": {"release_heap": True},  # the peak RSS summary.json reports is the estimate's (Note [heap release])
}
DECAY_DEFAULTS = {"schedule": "cosine", "min_lr_ratio": 0.1}  # applied when the user sets no schedule
EXPORT = "export"  # <run>/export: the fine-tuned model as a Hugging Face directory (Note [fine-tuning job])


@dataclass(frozen=True)
class Job:
    """A validated job: its own sections, and the user's engine keys (resolved by `engine_config`)."""

    run: RunConfig
    model: ModelConfig
    lora: LoraConfig  # [model.lora]
    data: DataConfig
    engine_keys: dict  # section -> {key: value}, as the user gave them
    given: frozenset = frozenset()  # the job sections' keys the user set ("data.format"), in the file or with --set

    def model_identity(self) -> dict:
        """What a checkpoint's weights were trained as: [model] and [model.lora] (resume refuses a change;
        model.lora.merge only shapes the export)."""
        return {**self.model.to_dict(), **{f"lora.{k}": v for k, v in self.lora.to_dict().items() if k != "merge"}}

    def defaults(self) -> list:
        """The defaults of this model in force, printed at the start: a pretrained one's (Note [fine-tuning
        defaults]), or a wide one's from scratch (Note [from-scratch lr])."""
        from infinity.job.finetune_defaults import pretrained_defaults, scratch_defaults
        if self.model.pretrained:
            return pretrained_defaults(self.model.pretrained, self.lora.r, self.engine_keys)
        return scratch_defaults(self.model.d_model, TRAIN_DEFAULTS["optimizer"]["lr"], self.engine_keys)

    def engine_config(self, run_dir: str, start: int = 0) -> Config:
        """The engine Config: user keys over TRAIN_DEFAULTS over Config(). Unless set, swap files go to
        <run_dir>/swap, the profile (spans, overlap summary, chart) to <run_dir>/profile, and the checkpoints
        (for preflight's space check: checkpoint.dir, with the count of those saved after step `start`) to
        <run_dir> (Note [run paths])."""
        user = self.engine_keys
        merged = {s: dict(v) for s, v in TRAIN_DEFAULTS.items()}
        if user.get("placement", {}).get("policy") == "auto":
            merged.pop("placement")  # auto plans every tier itself
        for d in self.defaults():
            merged.setdefault(d.section, {})[d.key] = d.value
        for section, table in user.items():
            merged.setdefault(section, {}).update(table)
        opt = merged["optimizer"]
        if "schedule" not in user.get("optimizer", {}):  # (a min_lr_ratio the user set stays: it is theirs)
            opt.update({k: v for k, v in DECAY_DEFAULTS.items() if k not in user.get("optimizer", {})})
            opt.setdefault("warmup_steps", min(20, self.run.steps // 10))
        if opt.get("schedule", "constant") != "constant":
            opt.setdefault("total_steps", max(self.run.steps, opt.get("warmup_steps", 0) + 1))
        for section, table in self.run_derived(run_dir, start).items():
            merged.setdefault(section, {}).update(table)
        return Config.from_dict(merged)

    def run_derived(self, run_dir: str, start: int = 0) -> dict[str, dict]:
        """Note [run paths]: the engine keys the job derives from its run where the user set none: the swap
        files in <run>/swap (the only swap path the job creates: one the user names must exist), the profile in
        <run>/profile, the checkpoints in <run> and how many this run saves after step `start` (preflight's space
        check: with keep_last = 0 every one stays). config.toml names them only in comments, so that a run
        trained again from it (`--config runs/<old>/config.toml`) derives its own and never writes into the old
        run's directory, and a resumed run counts the saves still to come."""
        user = self.engine_keys
        derived: dict[str, dict] = {"nvme": {"paths": [os.path.join(run_dir, "swap")]},
                                    "profile": {"trace_dir": os.path.join(run_dir, "profile")}}
        if self.run.checkpoint:
            every, steps = self.run.checkpoint_every, self.run.steps
            periodic = max(0, (steps - 1) // every - start // every) if every else 0  # the last step: the final one
            derived["checkpoint"] = {"dir": run_dir, "saves": periodic + 1}
        return {section: {k: v for k, v in table.items() if k not in user.get(section, {})}
                for section, table in derived.items() if any(k not in user.get(section, {}) for k in table)}

    def created_swap(self, run_dir: str) -> list[str]:
        """The swap paths the job creates at start: its own <run>/swap, unless nvme.paths is set (Note [run
        paths])."""
        return list(self.run_derived(run_dir).get("nvme", {}).get("paths", []))


@dataclass(frozen=True)
class JobLine:
    """What a command line says of the job: its job file (`--config`; None: the defaults) and its `--set` lines,
    in order. The one way the commands turn a command line into a job: `infinity train` (and `--resume`, whose
    run's config.toml the lines then override), `config`, `estimate` and its plans and `--largest` rungs, which
    add lines of their own after the user's (`then`)."""

    config: str | None = None
    sets: tuple[str, ...] = ()

    def then(self, *sets: str) -> JobLine:
        """These lines after the user's (a later line wins)."""
        return JobLine(self.config, self.sets + tuple(sets))

    def job(self) -> Job:
        return load_job(self.config, list(self.sets))


def load_job(path: str | os.PathLike | None = None, overrides: list[str] = (), *, run_config: bool = False) -> Job:
    """Read a job file (or none: the defaults) and apply `section.key=value` overrides. `run_config`: `path` is
    the config.toml of a run directory, as infinity train wrote it (Note [pretrained shape keys])."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = read_document(Path(path))
        except OSError as e:
            raise ConfigError(f"--config {path}: cannot read it ({e.strerror}); give the path of a TOML or JSON "
                              f"file") from None
    tables: dict[str, dict] = {}
    for section, table in data.items():
        if section not in SECTIONS and section not in JOB_SECTIONS and not isinstance(table, dict):
            raise key_outside_sections(section, table, {**JOB_SECTIONS, **SECTIONS})
        _check_section(section)
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] = {show(table)}: a section must be a table, e.g. [{section}] on its "
                              f"own line followed by key = value lines")
        tables[section] = dict(table)
    if isinstance(tables.get("model", {}).get("lora"), dict):
        tables["model.lora"] = tables["model"].pop("lora")  # [model.lora] is a table inside [model] in TOML
    in_file = [k for k in ModelConfig.SHAPE if k in tables.get("model", {})]
    set_shape = []  # model shape keys given with --set
    for item in overrides:
        section, key, value = parse_override(item)
        _check_section(section)
        tables.setdefault(section, {})[key] = value
        if section == "model" and key in ModelConfig.SHAPE:
            set_shape.append(key)
    _refuse_shape_beside_pretrained(tables.get("model", {}), [k for k in in_file if k not in set_shape], set_shape,
                                    path, run_config)
    job_parts = {}
    given = frozenset(f"{name}.{key}" for name in JOB_SECTIONS for key in tables.get(name, {}))
    for name, cls in JOB_SECTIONS.items():
        table = tables.pop(name, {})
        for key in table:
            if key not in {f.name for f in dataclasses.fields(cls)}:
                raise _unknown_job_key(name, key, table[key])
        job_parts[_field(name)] = cls(**table)
    if job_parts["model"].pretrained:  # config.toml (train again, --resume) then names it from anywhere
        job_parts["model"] = dataclasses.replace(job_parts["model"],
                                                 pretrained=os.path.abspath(job_parts["model"].pretrained))
    job = Job(engine_keys=tables, given=given, **job_parts)
    if job.lora.r and not job.model.pretrained:
        raise ConfigError(f"model.lora.r = {job.lora.r} needs model.pretrained = <a Hugging Face model directory>: "
                          f"LoRA adapts a pretrained model's weights (from random weights, train them all: "
                          f"remove model.lora.r)")
    _check_export_keys(job)
    config = job.engine_config(os.path.join(job.run.dir, "<run>"))  # validate now, before any directory exists
    if (warmup := config.optimizer.warmup_steps) > job.run.steps:  # (each optimizer step is one of run.steps)
        warnings.warn(f"optimizer.warmup_steps = {warmup} is more than run.steps = {job.run.steps}: the learning rate "
                      f"never reaches optimizer.lr (the last step's is {job.run.steps}/{warmup} of it); lower "
                      f"warmup_steps or raise run.steps", SettingWarning, stacklevel=2)
    return job


# Note [pretrained shape keys]: with model.pretrained the model's kind and shape come from its config.json, so a
# shape key beside it (model.n_layer, ...) would be ignored: it is refused, at any value, in a job file as with
# --set (a value equal to the built-in model's default is not a sign that it was not meant). `infinity config
# --defaults` and the run's config.toml write the shape keys commented out where they do not apply, so a copy of
# either is a valid job file. A run directory's config.toml written before 2026-11-27 holds them at their
# defaults: read as the run's own (`run_config`, --resume) those are dropped; trained again with --config,
# the message says which lines to remove.
def _refuse_shape_beside_pretrained(model: dict, in_file: list[str], set_shape: list[str], path, run_config: bool):
    pretrained = model.get("pretrained")
    if not pretrained:
        return
    if set_shape:
        raise ConfigError(f"--set model.{set_shape[0]}: with model.pretrained the model's kind and shape come from "
                          f"{pretrained}/config.json; drop {', '.join('--set model.' + k for k in set_shape)}")
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    if run_config:  # (an older infinity train wrote them, at their defaults)
        for key in [k for k in in_file if model[k] == defaults[k]]:
            del model[key]
            in_file.remove(key)
    if in_file:
        raise ConfigError(f"model.{in_file[0]} = {show(model[in_file[0]])} in {path}: with model.pretrained the "
                          f"model's kind and shape come from {pretrained}/config.json; remove "
                          f"{', '.join('model.' + k for k in in_file)} from [model]")


def _check_export_keys(job: Job) -> None:
    """Note [no silent keys]: the export keys act only on a fine-tuned model that is exported."""
    given = [k for k in ("export", "export_dtype") if not job.run._is_default(k)]
    if given and not job.model.pretrained:
        raise ConfigError(f"run.{given[0]} = {show(getattr(job.run, given[0]))} has no effect without "
                          f"model.pretrained (only a fine-tuned pretrained model is exported to <run>/export; export "
                          f"a checkpoint with infinity.state.export.export_checkpoint, docs/export.md): remove it")
    if not job.run.export and not job.run._is_default("export_dtype"):
        raise ConfigError(f"run.export_dtype = {show(job.run.export_dtype)} has no effect with run.export = false: "
                          f"remove one of them")


def _unknown_job_key(section: str, key: str, value: Any) -> ConfigError:
    """Error for a key no job section `section` has; a sub-table's name (model.lora) given as a key says how to
    write the table."""
    tables = [name.rsplit(".", 1)[-1] for name in JOB_SECTIONS if name.startswith(section + ".")]
    if key in tables:
        example = dataclasses.fields(JOB_SECTIONS[f"{section}.{key}"])[0].name
        return ConfigError(f"{section}.{key} = {show(value)}: {section}.{key} is a table, not a key: write "
                           f"[{section}.{key}] on its own line, then its keys, e.g. {example} = {show(value)} "
                           f"(--set {section}.{key}.{example}={show(value)}; `infinity config --defaults` lists them)")
    valid = [f.name for f in dataclasses.fields(JOB_SECTIONS[section])]
    tables_text = "".join(f", and the table [{section}.{t}]" for t in tables)
    return ConfigError(f"unknown key {section}.{key}{did_you_mean(key, valid + tables)}; valid keys of "
                       f"[{section}]: {', '.join(valid)}{tables_text}")


def _check_section(section: str) -> None:
    valid = list(SECTIONS) + list(JOB_SECTIONS)
    if section not in valid:
        raise ConfigError(f"unknown section [{section}]{did_you_mean(section, valid)}; valid sections: "
                          f"{', '.join(valid)}")


def job_defaults_text() -> str:
    """The job's own sections at their defaults, commented (appended to `infinity config --defaults`)."""
    import textwrap

    lines = ["# infinity train: the job's own sections (engine keys above; the job's defaults for them:",
             f"# {json.dumps(TRAIN_DEFAULTS)}, plus {json.dumps(DECAY_DEFAULTS)} with warmup min(20, steps/10)",
             "# and nvme.paths = [<run directory>/swap], profile.trace_dir = <run directory>/profile).", ""]
    for section, cls in JOB_SECTIONS.items():
        lines += [f"# {cls.__doc__}", f"[{section}]"]
        for f in dataclasses.fields(cls):
            lines += textwrap.wrap(f"{f.metadata['help']} ({type_name(f.metadata)})", width=88,
                                   initial_indent="# ", subsequent_indent="# ")
            line = f"{f.name} = {show(render_default(f.default, f.metadata))}"
            lines.append(f"# {line}  # the built-in model's; not with model.pretrained (Note [pretrained shape keys])"
                         if cls is ModelConfig and f.name in ModelConfig.SHAPE else line)
        lines.append("")
    return "\n".join(lines)


def to_toml(config: Config, job: Job, run_dir: str) -> str:
    """The resolved config as TOML (engine sections, then the job's); the paths derived from `run_dir` only as
    comments (Note [run paths])."""
    lines = ["# Resolved by infinity train; train again with: infinity train --config <this file>", ""]
    tables = {**config.to_dict(), **{name: getattr(job, _field(name)).to_dict() for name in JOB_SECTIONS}}
    derived = job.run_derived(run_dir)
    unused = {"model": dict.fromkeys(ModelConfig.SHAPE)} if job.model.pretrained else {}
    for section, table in tables.items():
        lines.append(f"[{section}]")
        lines += [f"# {key} = {show(value)}  (derived for the run: a run trained from this file derives its own)"
                  if key in derived.get(section, {}) else
                  f"# {key} = {show(value)}  (unused: model.pretrained's config.json gives it)"
                  if key in unused.get(section, {}) else f"{key} = {show(value)}" for key, value in table.items()]
        lines.append("")
    return "\n".join(lines)
