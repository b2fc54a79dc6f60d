"""The job of `infinity train`: its own config sections (`[run]`, `[model]`, `[data]`), the job
file with its overrides, the resolved config as TOML, and the models it builds.

A job file is an engine config (every section of `infinity config --defaults`)
plus three sections of its own, `[run]`, `[model]` and `[data]`; keys a file
leaves out take the job's defaults (`TRAIN_DEFAULTS`: parameters and optimizer
state on NVMe under the run directory, AdamW with cosine decay), then the
engine's. `--set section.key=value` overrides either kind of key.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import SECTIONS, Config
from .data import VOCAB_SIZE, DataConfig
from .options import ConfigError, Section, did_you_mean, option, parse_override, render_default, show, type_name

# ---------------------------------------------------------------- job config


@dataclass(frozen=True, kw_only=True)
class RunConfig(Section):
    """The training run of `infinity train`: length, batch, run directory, reporting."""

    SECTION: ClassVar[str] = "run"

    steps: int = option(300, "Optimizer steps to train.", "int", ge=1)
    batch_size: int = option(16, "Sequences per micro-batch over all ranks (each rank takes batch_size / "
                              "world size).", "int", ge=1)
    dir: str = option("runs", "Directory that holds run directories.", "str")
    name: str = option("auto", 'Name of this run\'s directory under run.dir; "auto" = the start time '
                        "(YYYYmmdd-HHMMSS).", "str")
    eval_every: int = option(100, "Steps between validation losses (0 = only at the end).", "int", ge=0)
    eval_batches: int = option(4, "Batches per validation loss.", "int", ge=1)
    log_every: int = option(10, "Steps between progress lines when the output is not a terminal.", "int", ge=1)
    checkpoint: bool = option(True, "Save a final checkpoint into the run directory (when the engine "
                               "supports checkpoints).", "bool")
    checkpoint_every: int = option(0, "Steps between checkpoints saved into checkpoints/step-<N> of the run "
                                    "directory, for `infinity train --resume` after a crash (0 = only the final "
                                    "one; [checkpoint] keep_last limits how many stay).", "int", ge=0)


@dataclass(frozen=True, kw_only=True)
class ModelConfig(Section):
    """The model `infinity train` builds (on the meta device; nothing is downloaded)."""

    SECTION: ClassVar[str] = "model"

    kind: str = option("gpt", '"gpt": infinity.models.GPT; "gpt2" / "llama": the Hugging Face transformers '
                        "model built from a config (pip install transformers).", "enum",
                        choices=("gpt", "gpt2", "llama"))
    n_layer: int = option(4, "Transformer blocks (one unit each).", "int", ge=1)
    d_model: int = option(128, "Hidden size.", "int", ge=8)
    n_head: int = option(4, "Attention heads (must divide d_model).", "int", ge=1)
    n_kv_head: int = option(0, "Key/value heads of llama (grouped-query attention); 0 = n_head.", "int", ge=0)
    ffn_dim: int = option(0, "MLP hidden size; 0 = 4 * d_model (gpt, gpt2) or the llama default.", "int", ge=0)
    seq_len: int = option(128, "Tokens (bytes) per training sequence.", "int", ge=2)
    vocab_size: int = option(VOCAB_SIZE, "Vocabulary size; the data is bytes, so at least 256.", "int",
                              ge=VOCAB_SIZE)

    def _check(self) -> None:
        if self.d_model % self.n_head:
            raise ConfigError(f"model.n_head = {self.n_head}: must divide model.d_model = {self.d_model}; "
                              f"e.g. n_head = {math.gcd(self.d_model, 8) or 1}")
        kv = self.n_kv_head or self.n_head
        if self.kind == "llama" and self.n_head % kv:
            raise ConfigError(f"model.n_kv_head = {self.n_kv_head}: must divide model.n_head = {self.n_head}")
        if self.kind != "llama" and self.n_kv_head:
            raise ConfigError(f"model.n_kv_head = {self.n_kv_head}: only llama has grouped-query attention; "
                              f'remove it or set model.kind = "llama"')


JOB_SECTIONS: dict[str, type[Section]] = {"run": RunConfig, "model": ModelConfig, "data": DataConfig}

# The engine config of `infinity train` where it differs from Config(): state on NVMe, AdamW + cosine.
TRAIN_DEFAULTS = {
    "optimizer": {"lr": 2e-3, "weight_decay": 0.1, "grad_clip": 1.0},
    "placement": {"params": "nvme", "grads": "host", "optimizer": "nvme"},
    "profile": {"enabled": True},  # the overlap efficiency on the progress line, profile/ in the run directory
}
DECAY_DEFAULTS = {"schedule": "cosine", "min_lr_ratio": 0.1}  # applied when the user sets no schedule


@dataclass(frozen=True)
class Job:
    """A validated job: its own sections, and the user's engine keys (resolved by `engine_config`)."""

    run: RunConfig
    model: ModelConfig
    data: DataConfig
    engine_keys: dict  # section -> {key: value}, as the user gave them

    def engine_config(self, run_dir: str) -> Config:
        """The engine Config: user keys over TRAIN_DEFAULTS over Config(). Unless set, swap files go to
        <run_dir>/swap, the profile (spans, overlap summary, chart) to <run_dir>/profile, and the checkpoints
        (for preflight's space check: checkpoint.dir) to <run_dir>."""
        user = self.engine_keys
        merged = {s: dict(v) for s, v in TRAIN_DEFAULTS.items()}
        if user.get("placement", {}).get("policy") == "auto":
            merged.pop("placement")  # auto plans every tier itself
        for section, table in user.items():
            merged.setdefault(section, {}).update(table)
        opt = merged["optimizer"]
        if "schedule" not in user.get("optimizer", {}):
            opt.update(DECAY_DEFAULTS)
            opt.setdefault("warmup_steps", min(20, self.run.steps // 10))
        if opt.get("schedule", "constant") != "constant":
            opt.setdefault("total_steps", max(self.run.steps, opt.get("warmup_steps", 0) + 1))
        merged.setdefault("nvme", {}).setdefault("paths", [os.path.join(run_dir, "swap")])
        merged["profile"].setdefault("trace_dir", os.path.join(run_dir, "profile"))
        if self.run.checkpoint:  # preflight counts keep_last + 1 checkpoints on the run directory's disk
            merged.setdefault("checkpoint", {}).setdefault("dir", run_dir)
        return Config.from_dict(merged)


def load_job(path: str | os.PathLike | None = None, overrides: list[str] = ()) -> Job:
    """Read a job file (or none: the defaults) and apply `section.key=value` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
        except OSError as e:
            raise ConfigError(f"--config {path}: cannot read it ({e.strerror}); give the path of a TOML file") from None
    tables: dict[str, dict] = {}
    for section, table in data.items():
        _check_section(section)
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] = {show(table)}: a section must be a table, e.g. [{section}] on its "
                              f"own line followed by key = value lines")
        tables[section] = dict(table)
    for item in overrides:
        section, key, value = parse_override(item)
        _check_section(section)
        tables.setdefault(section, {})[key] = value
    job_parts = {}
    for name, cls in JOB_SECTIONS.items():
        table = tables.pop(name, {})
        for key in table:
            if key not in {f.name for f in dataclasses.fields(cls)}:
                valid = [f.name for f in dataclasses.fields(cls)]
                raise ConfigError(f"unknown key {name}.{key}{did_you_mean(key, valid)}; valid keys of [{name}]: "
                                  f"{', '.join(valid)}")
        job_parts[name] = cls(**table)
    job = Job(engine_keys=tables, **job_parts)
    job.engine_config(os.path.join(job.run.dir, "<run>"))  # validate now, before any directory exists
    return job


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
            lines.append(f"{f.name} = {show(render_default(f.default, f.metadata))}")
        lines.append("")
    return "\n".join(lines)


def to_toml(config: Config, job: Job) -> str:
    """The resolved config as TOML (engine sections, then the job's)."""
    lines = ["# Resolved by infinity train; train again with: infinity train --config <this file>", ""]
    tables = {**config.to_dict(), **{name: getattr(job, name).to_dict() for name in JOB_SECTIONS}}
    for section, table in tables.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {show(value)}" for key, value in table.items()]
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- models


@dataclass
class ModelBundle:
    """A model on the meta device, how to initialize it, and how to get its loss from a batch."""

    model: nn.Module
    init_fn: Callable[[nn.Module], None] | None
    loss: Callable[[Callable, torch.Tensor, torch.Tensor], torch.Tensor]  # loss(forward, x, y)
    description: str


def _lm_loss(forward, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Loss of a Hugging Face causal LM: cross-entropy of its logits against the next bytes."""
    logits = forward(input_ids=x).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def build_model(cfg: ModelConfig, *, meta: bool = True) -> ModelBundle:
    """The model of `cfg`, created under infinity.meta_init() (no parameter memory) unless `meta=False`."""
    import contextlib

    from .materialize import meta_init
    scope = meta_init() if meta else contextlib.nullcontext()
    if cfg.kind == "gpt":
        from .models.gpt import GPT, GPTConfig, gpt_init
        gcfg = GPTConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, n_layer=cfg.n_layer, n_head=cfg.n_head,
                         d_model=cfg.d_model)
        if cfg.ffn_dim not in (0, 4 * cfg.d_model):
            raise ConfigError(f"model.ffn_dim = {cfg.ffn_dim}: the built-in gpt uses 4 * d_model = "
                              f"{4 * cfg.d_model}; remove it or use model.kind = \"gpt2\" / \"llama\"")
        with scope:
            model = GPT(gcfg)
        return ModelBundle(model, gpt_init, lambda fwd, x, y: fwd(x, y), f"gpt {_count(model)}")
    try:
        import transformers
    except ImportError:
        raise ConfigError(f'model.kind = "{cfg.kind}" needs Hugging Face transformers: pip install transformers '
                          f'(or use model.kind = "gpt")') from None
    if cfg.kind == "gpt2":
        hf_cfg = transformers.GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.seq_len, n_embd=cfg.d_model,
                                         n_layer=cfg.n_layer, n_head=cfg.n_head, n_inner=cfg.ffn_dim or None,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                                         eos_token_id=None)
        cls = transformers.GPT2LMHeadModel
    else:
        ffn = cfg.ffn_dim or 64 * -(-(8 * cfg.d_model // 3) // 64)  # llama's 8/3 d, rounded up to 64
        hf_cfg = transformers.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=ffn,
                                          num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
                                          num_key_value_heads=cfg.n_kv_head or cfg.n_head,
                                          max_position_embeddings=cfg.seq_len, bos_token_id=None, eos_token_id=None,
                                          pad_token_id=None)
        cls = transformers.LlamaForCausalLM
    with scope:
        model = cls(hf_cfg)
    return ModelBundle(model, model._init_weights, _lm_loss, f"{cfg.kind} (transformers) {_count(model)}")


def _count(model: nn.Module) -> str:
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return f"{n / 1e6:.2f}M parameters"
