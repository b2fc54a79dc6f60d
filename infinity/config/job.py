"""The sections of an `infinity train` job file that are not the engine's: `[run]`, `[model]`, `[model.lora]`
and `[data]` (the job that reads them: infinity/job/spec.py). Declared with the option machinery as the engine's
sections are; torch-free like the rest of the config."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import ClassVar

from infinity.config.options import ConfigError, Section, option, show

VOCAB_SIZE = 256  # byte-level
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")  # run.report_to: job/trackers.py
LATER_TRACKERS = ("comet_ml", "clearml", "dvclive", "swanlab", "neptune", "aim")
SHIPPED = "kjv"


@dataclass(frozen=True, kw_only=True)
class DataConfig(Section):
    """Text corpus and batching of `infinity train` (byte-level tokens, vocabulary 256)."""

    SECTION: ClassVar[str] = "data"

    path: str = option(SHIPPED, 'The data to train on: a text file (plain or .gz), a file of records (.jsonl, '
                        ".json, .parquet, .arrow), a directory of such files or a glob pattern (every file, in "
                        'the order of their paths: docs/data.md), or "kjv" for the corpus shipped in '
                        "infinity/corpus/kjv.txt.gz (King James Bible, public domain).", "str")
    val_fraction: float = option(0.05, "Fraction of the corpus held out for the validation loss: the tail of each "
                                  "file.",
                                  "float", gt=0.0, lt=0.5, example=0.05)
    seed: int = option(1234, "Seed of the batch sampler (independent of train.seed, which seeds the weights).",
                        "int", ge=0)
    format: str = option("text", '"text": data.path is plain text (bytes, or the pretrained tokenizer\'s tokens); '
                          '"completion": records with a prompt and a completion field; "chat": records with a '
                          "list of messages rendered by the tokenizer's chat template (docs/finetune-data.md).",
                          "enum", choices=("text", "completion", "chat"))
    text_field: str = option("text", 'Field of the text in records read as data.format = "text" (a parquet, '
                              "arrow or JSON file of documents, as Hugging Face pretraining datasets hold them).",
                              "str")
    prompt_field: str = option("prompt", 'Field of the prompt in format = "completion" records.', "str")
    completion_field: str = option("completion", 'Field of the completion in format = "completion" records.', "str")
    messages_field: str = option("messages", 'Field of the message list in format = "chat" records.', "str")
    train_on_prompt: bool = option(False, "Score the prompt / non-assistant turns too (false: the loss counts only "
                                    "completions and assistant turns; labels -100 elsewhere).", "bool")
    packing: bool = option(False, "Pack several records in one row of model.seq_len tokens (each sees only "
                            "itself: block-diagonal attention); false: one record per row, padded.", "bool")
    truncation: str = option("right", 'A record longer than model.seq_len + 1 tokens: "right" cuts its end, '
                              '"refuse" stops with the record\'s line.', "enum", choices=("right", "refuse"))
    val_path: str = option("", "The validation records (same format; a file, a directory or a glob pattern as "
                           "data.path); empty: the last data.val_fraction of each file's records.", "path")

    def check_format_keys(self) -> None:
        """Note [no silent keys]: a data key that data.format (resolved: Note [data format from the records])
        does not read is an error when set, not a setting that silently does nothing."""
        unused = {"text": ("prompt_field", "completion_field", "messages_field", "train_on_prompt", "packing",
                           "truncation", "val_path"),
                  "completion": ("messages_field", "text_field"),
                  "chat": ("prompt_field", "completion_field", "text_field")}[self.format]
        given = [k for k in unused + (("val_fraction",) if self.val_path else ()) if not self._is_default(k)]
        if not given:
            return
        key = given[0]
        why = ("data.val_path holds the validation records: no fraction is held out" if key == "val_fraction" else
               "plain text: every token trains, and the last data.val_fraction is held out for validation; the "
               "record keys are for \"completion\" and \"chat\" data" if self.format == "text" else
               "that key is for the other record format")
        raise ConfigError(f'data.{key} = {show(getattr(self, key))} has no effect with data.format = '
                          f'"{self.format}" ({why}): remove {", ".join("data." + k for k in given)}')


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
    report_to: tuple = option((), 'Trackers that get every step\'s metrics beside metrics.jsonl, named as '
                               'transformers names them: "tensorboard" (event files in <run>/tensorboard), '
                               '"wandb" (<run>/wandb; WANDB_MODE=offline without a network), "mlflow" '
                               '(MLFLOW_TRACKING_URI, else '
                               'sqlite <run>/mlflow.db), "trackio" (its local store, TRACKIO_DIR); each its own '
                               'package (pip install -e ".[trackers]"). [] = metrics.jsonl only.', "strs", unique=True)
    time_limit: str = option("none", 'Wall-clock limit of this process\'s run, e.g. "3h50m", "90m", "45s" (a cluster '
                              'job\'s, less its launch): the run stops after the step that would leave too little '
                              'time for one more step and the final checkpoint, saves it and says so ("none": no '
                              "limit). SIGUSR1 (Slurm's --signal) stops it the same way, as SIGINT and SIGTERM do "
                              "(Note [time limit]).", "str")
    export: bool = option(True, "With model.pretrained: at the end, write the trained model into <run>/export as a "
                           "Hugging Face directory (config.json, safetensors shards, the tokenizer files of "
                           "model.pretrained) for from_pretrained.", "bool")
    export_dtype: str = option("auto", 'dtype of the exported weights: "auto" = the pretrained config\'s dtype '
                                '(torch_dtype), else fp32; or "fp32", "bf16", "fp16". config.json says the dtype '
                                'written.', "enum", choices=("auto", "fp32", "bf16", "fp16"))

    def _check(self) -> None:
        parse_duration(self.time_limit, "run.time_limit")
        for name in self.report_to:
            if name not in TRACKERS:
                known = ", ".join(f'"{t}"' for t in TRACKERS)
                later = " (not yet: metrics.jsonl holds the same records)" if name in LATER_TRACKERS else ""
                raise ConfigError(f"run.report_to = {show(list(self.report_to))}: {show(name)} is not a tracker "
                                  f"infinity train writes to{later}; use {known}, or []")
        if "/" in self.name or os.sep in self.name or self.name in (".", ".."):
            raise ConfigError(f"run.name = {show(self.name)}: the name of one directory under run.dir, without "
                              f"'/' (to put runs elsewhere, set run.dir)")


@dataclass(frozen=True, kw_only=True)
class ModelConfig(Section):
    """The model `infinity train` builds (on the meta device; nothing is downloaded)."""

    SECTION: ClassVar[str] = "model"
    SHAPE: ClassVar[tuple[str, ...]] = ("kind", "n_layer", "d_model", "n_head", "n_kv_head", "ffn_dim", "vocab_size")

    pretrained: str = option("", "A Hugging Face model directory (config.json and safetensors weights, as "
                              "save_pretrained writes it) to fine-tune; its config gives the model's kind and shape "
                              "(leave the shape keys below unset), its weights are streamed into the tiers. \"\" = "
                              "train the model below from random weights.", "path")

    kind: str = option("gpt", '"gpt": infinity.models.GPT; "gpt2" / "llama": the Hugging Face transformers '
                        "model built from a config (pip install transformers).", "enum",
                        choices=("gpt", "gpt2", "llama"))
    n_layer: int = option(4, "Transformer blocks (one unit each).", "int", ge=1)
    d_model: int = option(128, "Hidden size.", "int", ge=8)
    n_head: int = option(4, "Attention heads (must divide d_model).", "int", ge=1)
    n_kv_head: int = option(0, "Key/value heads of llama (grouped-query attention); 0 = n_head.", "int", ge=0)
    ffn_dim: int = option(0, "MLP hidden size; 0 = 4 * d_model (gpt, gpt2) or the llama default.", "int", ge=0)
    tokenizer: str = option("auto", 'With model.pretrained: "auto" tokenizes data.path with the tokenizer saved in '
                             'that directory (a directory without one is refused); "bytes": each byte is its own '
                             "token id (0..255; the vocabulary must have at least 256 ids). Without model.pretrained "
                             "the data is always bytes.", "enum", choices=("auto", "bytes"))
    seq_len: int = option(128, "Tokens (bytes, or the pretrained tokenizer's tokens) per training sequence.", "int",
                          ge=2)
    vocab_size: int = option(VOCAB_SIZE, "Vocabulary size; the data is bytes, so at least 256.", "int",
                              ge=VOCAB_SIZE)

    def _check(self) -> None:
        if self.pretrained:
            given = [k for k in self.SHAPE if not self._is_default(k)]
            if given:
                raise ConfigError(f"model.{given[0]} = {show(getattr(self, given[0]))}: with model.pretrained the "
                                  f"model's kind and shape come from {self.pretrained}/config.json; remove "
                                  f"{', '.join('model.' + k for k in given)}")
            return
        if self.d_model % self.n_head:
            raise ConfigError(f"model.n_head = {self.n_head}: must divide model.d_model = {self.d_model}; "
                              f"e.g. n_head = {math.gcd(self.d_model, 8) or 1}")
        kv = self.n_kv_head or self.n_head
        if self.kind == "llama" and self.n_head % kv:
            raise ConfigError(f"model.n_kv_head = {self.n_kv_head}: must divide model.n_head = {self.n_head}")
        if self.kind != "llama" and self.n_kv_head:
            raise ConfigError(f"model.n_kv_head = {self.n_kv_head}: only llama has grouped-query attention; "
                              f'remove it or set model.kind = "llama"')


@dataclass(frozen=True, kw_only=True)
class LoraConfig(Section):
    """LoRA adapters on the pretrained model (PEFT's LoraConfig; pip install peft); r = 0: no LoRA."""

    SECTION: ClassVar[str] = "model.lora"

    r: int = option(0, "Rank of the LoRA adapters; 0 = no LoRA (every weight of the model trains). Needs "
                     "model.pretrained.", "int", ge=0)
    alpha: float = option(16.0, "LoRA scaling numerator (the adapters' output is scaled by alpha / r).", "float",
                          gt=0.0)
    dropout: float = option(0.0, "Dropout on the adapters' input.", "float", ge=0.0, lt=1.0)
    targets: tuple = option((), 'Names of the modules to adapt (PEFT target_modules, e.g. ["q_proj", "v_proj"]); '
                             "[] = PEFT's default for the model's kind.", "strs", unique=True)
    merge: bool = option(True, "Export the adapters merged into the base weights (a plain model); false: the "
                          "adapters alone, as PEFT's save_pretrained writes them.", "bool")

    def _check(self) -> None:
        if not self.r:
            given = [k for k in ("alpha", "dropout", "targets", "merge") if not self._is_default(k)]
            if given:
                raise ConfigError(f"model.lora.{given[0]} = {show(getattr(self, given[0]))} but "
                                  f"model.lora.r = 0 (no LoRA): set model.lora.r (e.g. 8) or remove it")


JOB_SECTIONS: dict[str, type[Section]] = {"run": RunConfig, "model": ModelConfig, "model.lora": LoraConfig,
                                          "data": DataConfig}




_UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_duration(text: str, key: str) -> float | None:
    """Seconds of a duration written as "3h50m", "90m", "1d2h", "45s" or "5400" (seconds); None for "none"."""
    import re
    value = str(text).strip().lower()
    if value in ("none", ""):
        return None
    if re.fullmatch(r"\d+(\.\d+)?", value):
        return float(value)
    parts = re.findall(r"(\d+(?:\.\d+)?)([dhms])", value)
    if not parts or "".join(n + u for n, u in parts) != value:
        raise ConfigError(f'{key} = {show(text)}: not a duration; write it as "3h50m", "90m", "45s" or "none"')
    return sum(float(n) * _UNITS[u] for n, u in parts)
