"""Run configuration: frozen keyword-only dataclasses, TOML / dict loading, validation.

One small dataclass per TOML section; the top-level `Config` holds one of each.
Every field carries its meaning in ``field(metadata={"help": ...})`` so that
``infinity config --defaults`` and the reference in docs/config.md are generated from the
code, never written by hand.

    config = Config.from_file("run.toml")
    config = Config.from_dict({"optimizer": {"lr": 1e-3}}, overrides=["placement.params=host"])
    config = Config().with_overrides(["optimizer.betas=[0.9, 0.99]"])

Note [no silent keys]: an unknown section or key, a value of the wrong type, an
out-of-range value, or a key whose value cannot matter under the rest of the
config (e.g. a loss scale with bf16) raises `ConfigError` naming the dotted key,
the value given and what to change. Values are normalized on construction:
sizes become int bytes, ints given for float keys become floats, lists become
tuples, so a `Config` compares and hashes by value.
"""

from __future__ import annotations

import dataclasses
import os
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterable

from infinity.config.compute import ActivationConfig, CompileConfig
from infinity.config.options import (
    ConfigError,
    Section,
    SettingWarning,
    did_you_mean,
    format_size,
    headroom_bytes,
    option,
    parse_override,
    parse_size,
    read_document,
    render_default,
    show,
    type_name,
)
from infinity.config.overlap import OverlapConfig, PrefetchConfig

__all__ = [
    "Config",
    "ConfigError",
    "SettingWarning",
    "OptimizerConfig",
    "PrecisionConfig",
    "PlacementConfig",
    "MemoryConfig",
    "NvmeConfig",
    "SwapIOConfig",
    "CheckpointConfig",
    "SECTIONS",
    "PrefetchConfig",
    "OverlapConfig",
    "TrainConfig",
    "ProfileConfig",
    "UnitsConfig",
    "ActivationConfig",
    "parse_size",
    "format_size",
]


# ---------------------------------------------------------------- sections

@dataclass(frozen=True, kw_only=True)
class OptimizerConfig(Section):
    """Adam / AdamW hyperparameters and the learning-rate schedule."""

    SECTION: ClassVar[str] = "optimizer"

    name: str = option("adamw", '"adamw": decoupled weight decay (torch.optim.AdamW); '
                        '"adam": weight decay added to the gradient as L2 (torch.optim.Adam).',
                        "enum", choices=("adam", "adamw"))
    lr: float = option(3e-4, "Peak learning rate (after warmup).", "float", gt=0.0, example=3e-4)
    betas: tuple[float, float] = option((0.9, 0.95), "Adam (beta1, beta2): decay rates of the gradient's "
                                         "first and second moment estimates, each in [0, 1).",
                                         "floats", length=2, ge=0.0, lt=1.0, example=[0.9, 0.95])
    eps: float = option(1e-8, "Added to the denominator sqrt(v_hat) for numerical stability.", "float",
                         gt=0.0, example=1e-8)
    weight_decay: float = option(0.0, "Weight decay coefficient (decoupled for adamw, L2 for adam).",
                                  "float", ge=0.0, example=0.1)
    grad_clip: float = option(0.0, "Maximum global gradient L2 norm; gradients are scaled down to it "
                               "when larger. 0 = no clipping.", "float", ge=0.0, example=1.0)
    schedule: str = option("constant", "Learning-rate schedule after warmup: constant at lr, or cosine / "
                            "linear decay to lr * min_lr_ratio at total_steps.",
                            "enum", choices=("constant", "cosine", "linear"))
    warmup_steps: int = option(0, "Optimizer steps of linear warmup from lr / warmup_steps up to lr.",
                                "int", ge=0)
    total_steps: int = option(0, "Step at which cosine / linear decay reaches lr * min_lr_ratio "
                               "(must exceed warmup_steps; unused by constant).", "int", ge=0)
    min_lr_ratio: float = option(0.0, "Final learning rate of cosine / linear decay, as a fraction of lr.",
                                  "float", ge=0.0, le=1.0, example=0.1)
    no_decay: tuple[str, ...] = option((), 'Parameters that get no weight decay (weight_decay 0; the rest get '
                                        'weight_decay): "bias_and_norm" = HF Trainer\'s rule (biases and the '
                                        'weights of normalization layers), any other entry a regular expression '
                                        'searched in the parameter\'s name (model.named_parameters()). '
                                        'initialize(param_groups=...) replaces it.', "strs", unique=True,
                                        example=["bias_and_norm"])
    sub_group_size: int = option(8_388_608, "Elements per optimizer sub-group: the unit streamed through "
                                  "buffers (read, step, write) when optimizer state is on NVMe.", "int", gt=0)
    state_dtype: str = option("fp32", 'What the optimizer state is stored in (the update is computed in fp32 '
                              'in every mode): "fp32": master weights and both Adam moments fp32, 12 bytes '
                              'per trainable parameter; "bf16": the moments bf16 (rounded to nearest), the '
                              'master fp32, 8 bytes; "bf16_master": the master bf16 too, rounded '
                              'stochastically (seeded by train.seed), 6 bytes. Checkpoints hold fp32 either '
                              'way and load across settings (docs/bytes.md).',
                              "enum", choices=("fp32", "bf16", "bf16_master"))

    def _check(self) -> None:
        for rule in self.no_decay:
            try:
                re.compile(rule)
            except re.error as e:
                raise ConfigError(f"optimizer.no_decay: {show(rule)} is not a regular expression ({e}); write "
                                  '"bias_and_norm" or a pattern searched in parameter names, e.g. "\\\\.bias$"'
                                  ) from None
        decaying = self.schedule in ("cosine", "linear")
        if decaying and self.total_steps <= self.warmup_steps:
            raise ConfigError(
                f"optimizer.total_steps = {self.total_steps}: with schedule = {show(self.schedule)} it must be > "
                f"optimizer.warmup_steps = {self.warmup_steps}; set total_steps to the length of the run"
            )
        if not decaying:
            for name in ("total_steps", "min_lr_ratio"):
                if not self._is_default(name):
                    raise ConfigError(
                        f"optimizer.{name} = {show(getattr(self, name))}: has no effect with "
                        f'schedule = "constant"; '
                        f'remove it or set optimizer.schedule = "cosine" or "linear"'
                    )


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig(Section):
    """Compute precision (gradients reduced in fp32; master weights fp32 unless state_dtype = "bf16_master")."""

    SECTION: ClassVar[str] = "precision"

    compute_dtype: str = option("fp32", "dtype of parameters and activations during forward / backward.",
                                 "enum", choices=("fp32", "bf16", "fp16"))
    initial_loss_scale: float = option(65536.0, "Starting loss scale of fp16 dynamic loss scaling "
                                        "(fp16 only).", "float", gt=0.0, example=65536.0)
    loss_scale_growth_interval: int = option(1000, "Steps without overflow after which the fp16 loss scale "
                                              "doubles (fp16 only).", "int", gt=0)

    def _check(self) -> None:
        if self.compute_dtype == "fp16":
            return
        for name in ("initial_loss_scale", "loss_scale_growth_interval"):
            if not self._is_default(name):
                raise ConfigError(
                    f"precision.{name} = {show(getattr(self, name))}: loss scaling is only used with "
                    f'compute_dtype = "fp16" (here {show(self.compute_dtype)}); remove it or set '
                    f'precision.compute_dtype = "fp16"'
                )


_TIERS = ("device", "host", "nvme")


@dataclass(frozen=True, kw_only=True)
class PlacementConfig(Section):
    """Which tier holds each state kind's shards."""

    SECTION: ClassVar[str] = "placement"

    policy: str = option("static", '"static": use params / grads / optimizer below; "auto": plan tiers from '
                          "the memory budgets (the three keys below must then stay at their defaults).",
                          "enum", choices=("static", "auto"))
    params: str = option("device", "Tier of the compute-dtype parameter shards.", "enum", choices=_TIERS)
    grads: str = option("device", "Tier of the fp32 gradient shards.", "enum", choices=_TIERS)
    optimizer: str = option("device", "Tier of the fp32 master weights, exp_avg and exp_avg_sq.",
                             "enum", choices=_TIERS)
    tail_units: int | str = option(
        "auto", "Units the next forward uses first whose gradients and optimizer state are kept on the device, so "
        "their update runs on the GPU and the forward does not wait for the CPU's (Note [tail units]): a count, 0 "
        "for none, or \"auto\": on a GPU, the first units up to four fifths of the trainable elements (nineteen "
        "twentieths when the update waits for the global norm: clipping), within half the device memory the plan "
        "and the activations (memory.activation_reserve) leave free (none without a GPU).", "int_or_auto", ge=0,
        example=4)

    def _check(self) -> None:
        if self.policy != "auto":
            return
        for name in ("params", "grads", "optimizer"):
            if not self._is_default(name):
                raise ConfigError(
                    f"placement.{name} = {show(getattr(self, name))}: is ignored with policy = \"auto\", which "
                    f'plans tiers from the budgets; remove it or set placement.policy = "static"'
                )


@dataclass(frozen=True, kw_only=True)
class MemoryConfig(Section):
    """Memory budgets per tier, per rank."""

    SECTION: ClassVar[str] = "memory"

    device_budget: int | str = option("auto", 'Device memory for training state: a size ("70GiB") or "auto" '
                                       "(free device memory detected at initialize).", "size_or_auto", gt=0,
                                       example="70GiB")
    host_budget: int | str = option("auto", 'Host RAM for training state: a size ("100GiB") or "auto" '
                                     "(available RAM detected at initialize).", "size_or_auto", gt=0,
                                     example="100GiB")
    activation_reserve: int | str = option(
        "auto", 'Device memory the planner leaves for activations: before it keeps "auto" tail units on the device '
        '(placement.tail_units, Note [tail units]), and free of state with placement.policy = "auto" (without a '
        'GPU, of the RAM: Note [auto placement]): a size, or "auto": what the forward keeps for backward under '
        "[activation], traced by `infinity train` (on a GPU, or for the auto policy) and by `infinity estimate`; "
        "where nothing traced it (the engine API alone), half of the free device memory for tail units, none for "
        "the auto policy.", "size_or_auto", ge=0, example="20GiB")
    headroom: str = option("10%", 'RAM and disk every plan leaves unused (Note [headroom]): "N%" of the machine\'s RAM '
                           '/ the filesystem\'s size, at least 2GiB, or a size ("4GiB"; "0" for none).', "str",
                           example="10%")
    release_heap: bool = option(False, "Give the C heap's free pages back to the OS once per optimizer step (glibc "
                                "malloc_trim): without a GPU the peak RSS stays at one step's, as `infinity estimate` "
                                "predicts, instead of creeping up as freed activations fragment the heap; costs the "
                                "next step faulting its pages in again (~15% of a small CPU-only step). `infinity "
                                "train` sets it (Note [heap release]).", "bool")

    def _check(self) -> None:
        headroom_bytes(self.headroom, 1 << 40)  # a value that is neither a share nor a size: refused at load

    @property
    def reserved_activations(self) -> int | None:
        """The size set in activation_reserve, or None for "auto" (traced where the job or the estimate can)."""
        return None if self.activation_reserve == "auto" else int(self.activation_reserve)


@dataclass(frozen=True, kw_only=True)
class NvmeConfig(Section):
    """NVMe swap space."""

    SECTION: ClassVar[str] = "nvme"

    paths: tuple[str, ...] = option((), "Directories for swap files; several paths stripe across disks. "
                                     "Required when any state is placed on nvme.", "strs", unique=True,
                                     example=["/mnt/nvme0"])


@dataclass(frozen=True, kw_only=True)
class SwapIOConfig(Section):
    """Asynchronous file I/O of the NVMe tier."""

    SECTION: ClassVar[str] = "io"

    block_size: int = option(2**20, "Bytes per I/O request (a power of two, >= 4KiB).", "size",
                              ge=4096, example="1MiB")
    queue_depth: int = option(16, "Block requests in flight at once (over all I/O threads).", "int", ge=1)
    threads: int = option(
        8,
        'I/O worker threads: with backend "threads" they carry every block (8 at queue depth 16 '
        'measured best: benchmarks/history/io-engine-vs-fio.md); with "aio" only unaligned heads and tails.',
        "int",
        ge=1,
    )
    backend: str = option("auto", "How blocks reach the disk: \"aio\" = Linux kernel AIO, the whole queue depth on the "
                           "device at once, one thread reaping completions (faster beside compute: Note [kernel aio]); "
                           "\"threads\" = preadv/pwritev from the worker threads; \"auto\" = aio where the kernel "
                           "offers it, else threads.", "enum", choices=("auto", "aio", "threads"))
    direct: bool = option(True, "Open swap files with O_DIRECT (bypass the page cache).", "bool")
    checksum: str = option(
        "sampled", "Checksum swap blocks when written, verify them when read: \"full\" = CRC-32C of every byte; "
        "\"sampled\" = of 64 KiB spread over each 1 MiB block (catches misplaced, stale and lost blocks at "
        "1/7 of the CPU: Note [sampled checksum]); \"off\".", "enum", choices=("full", "sampled", "off"))
    switch_interval_us: float = option(
        100.0, "Python's thread switch interval while an engine is open (sys.setswitchinterval), in "
        "microseconds; 0 leaves it alone. I/O completions need the GIL, and at Python's default 5000 a "
        "Python-heavy forward starves them (Note [switch interval]; measured: "
        "benchmarks/history/from-notes.md).",
        "float", ge=0)

    def engine_config(self, **overrides: Any):
        """io_engine's IOConfig for this section; ``overrides`` replace fields (checksum="off")."""
        from io_engine.io_config import IOConfig  # torch-free: the config stays below every torch module

        fields = dict(block_size=self.block_size, queue_depth=self.queue_depth, threads=self.threads,
                      direct=self.direct, checksum=self.checksum, backend=self.backend)
        return IOConfig(**{**fields, **overrides})

    def _check(self) -> None:
        if self.block_size & (self.block_size - 1):
            lower = 1 << (self.block_size.bit_length() - 1)
            raise ConfigError(f"io.block_size = {self.block_size}: must be a power of two, e.g. "
                              f"{show(format_size(lower))} or {show(format_size(lower * 2))}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig(Section):
    """Training loop behaviour."""

    SECTION: ClassVar[str] = "train"

    grad_accum_steps: int = option(1, "Micro-batches (backward calls) per optimizer step.", "int", ge=1)
    seed: int = option(0, "Random seed.", "int", ge=0)
    on_nonfinite: str = option("error", "When gradients contain NaN / Inf (outside fp16 loss scaling): "
                                '"error" stops with the step and unit, "skip" skips the step.',
                                "enum", choices=("error", "skip"))


@dataclass(frozen=True, kw_only=True)
class ProfileConfig(Section):
    """Tracing."""

    SECTION: ClassVar[str] = "profile"

    enabled: bool = option(False, "Record spans (fetch, copy, collective, optimizer sub-step, unit compute); "
                            "at close() write the Chrome trace, overlap summary and timeline chart under "
                            "trace_dir/rank<N>.", "bool")
    trace_dir: str = option("runs/trace", "Directory for the Chrome trace and overlap summary.", "str")
    keep_steps: int = option(100, "The latest steps whose spans are kept (Note [profile window]): the summary, "
                             "trace and chart cover them; 0 keeps every step's, which then grow with the run "
                             "(memory, and the time the report takes at the end).", "int", ge=0)


@dataclass(frozen=True, kw_only=True)
class ZeroConfig(Section):
    """Which state kinds are partitioned over the ranks (ZeRO stage), independent of their tiers."""

    SECTION: ClassVar[str] = "zero"

    stage: int = option(3, "0 = DDP (everything replicated, gradients all-reduced); 1 = optimizer state "
                        "partitioned; 2 = optimizer state and gradients partitioned (with the optimizer on host: "
                        "ZeRO-Offload); 3 = parameters partitioned too, all-gathered before each use (with NVMe: "
                        "ZeRO-Infinity). Lower stages hold more bytes per rank and communicate less: "
                        "`infinity estimate --stages` compares them (Note [stage layouts]).", "int",
                        ge=0, le=3, example=2)


@dataclass(frozen=True, kw_only=True)
class UnitsConfig(Section):
    """How the model is split into units (the blocks that move and communicate together)."""

    SECTION: ClassVar[str] = "units"

    classes: tuple[str, ...] = option((), 'Class names of modules that form units, e.g. ["Block"]; empty = '
                                       "the children of each nn.ModuleList.", "strs", unique=True,
                                       example=["Block"])
    tile_bytes: int = option(0, "Memory-centric tiling: every nn.Linear and nn.Embedding (not tied to another "
                                "module) whose parameters take more than this many bytes in the compute dtype runs "
                                "as tiles of its rows (a Linear's outputs, an Embedding's table), each at most this "
                                "size and each its own unit, fetched, used and "
                                "released in turn, so a unit's device working memory is bounded by the tile, not "
                                "the layer (Note [tiles are units] in units/tiling.py); 0 = off. State dicts, "
                                "checkpoints' exports and weights= keep the untiled names.", "size", ge=0,
                             example="256MiB")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig(Section):
    """Checkpoint saving."""

    SECTION: ClassVar[str] = "checkpoint"

    keep_last: int = option(0, "Keep only the newest N checkpoints this run saved (older ones it wrote are "
                             "removed once a newer one is complete); 0 keeps all.", "int", ge=0)
    background: bool = option(False, "Write checkpoint files in a background thread while the next forward "
                               "and backward run; the checkpoint becomes visible (atomic rename) at the next "
                               "step() or close().", "bool")
    reference_pretrained: bool = option(True, "Frozen parameters that hold exactly the values read from a "
                                        "safetensors weights= source (a LoRA run's base model, model.pretrained) "
                                        "are saved as references to its files (name, tensor, CRC32 of the bytes, "
                                        "checked at load), not copied: the checkpoint needs that directory "
                                        "unchanged to load (Note [pretrained references]). false: copy them into "
                                        "every checkpoint (in the compute dtype), which then stands alone.", "bool")
    dir: str = option("", "Directory the checkpoints are saved under (`infinity train` sets it to the run directory, "
                      "and refuses another: its checkpoints live in the run). "
                      "Preflight checks that its disk holds the checkpoints kept (see saves) of every rank on the "
                      "node, besides any swap on the same disk (Note [checkpoint space]); \"\" = not checked.", "path")
    saves: int = option(0, "How many checkpoints the run will save (`infinity train` sets it from run.steps and "
                        "run.checkpoint_every). Preflight counts min(keep_last + 1, saves) of them on the disk, or, "
                        "with keep_last = 0 (keep all), every one; 0 = not known: keep_last + 1.", "int", ge=0)


# ---------------------------------------------------------------- top level

SECTIONS: dict[str, type[Section]] = {
    cls.SECTION: cls
    for cls in (OptimizerConfig, PrecisionConfig, PlacementConfig, MemoryConfig, NvmeConfig, SwapIOConfig,
                PrefetchConfig, OverlapConfig, TrainConfig, ProfileConfig, UnitsConfig, CheckpointConfig, ZeroConfig,
                ActivationConfig, CompileConfig)
}


# The sections of an `infinity train` job file that are not the engine's (infinity.job.spec.JOB_SECTIONS, whose
# names these are: a test keeps the two equal); Config.from_file meeting one says the file is a job file.
JOB_FILE_SECTIONS = ("run", "model", "data")


def unknown_key(name: str, section: str | None) -> ConfigError:
    """Error for an unknown section (section=None) or key, with the closest valid name."""
    if section is None:
        where, valid = f"[{name}]", list(SECTIONS)
        if name in JOB_FILE_SECTIONS:
            return ConfigError(f"unknown section {where}: [run], [model] and [data] make this an `infinity train` "
                               f"job file (a run's config.toml is one), which `infinity train --config FILE` reads; "
                               f"infinity.Config reads the engine's sections only ({', '.join(valid)}): leave the "
                               f"job's sections out, or train with `infinity train --config FILE`")
        owners = [s for s, cls in SECTIONS.items() if name in _keys(cls)]
        hint = f' (did you mean "{owners[0]}.{name}"?)' if owners else did_you_mean(name, valid)
        return ConfigError(f"unknown section {where}{hint}; valid sections: {', '.join(valid)}")
    valid = _keys(SECTIONS[section])
    hint = did_you_mean(name, valid)
    if not hint:
        owners = [s for s, cls in SECTIONS.items() if name in _keys(cls)]
        hint = f' (did you mean "{owners[0]}.{name}"?)' if owners else ""
    return ConfigError(f"unknown key {section}.{name}{hint}; valid keys of [{section}]: {', '.join(valid)}")


def _keys(cls: type[Section]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def key_outside_sections(key: str, value: Any, sections: dict[str, type]) -> ConfigError:
    """Error for a TOML key before any [section] line (`steps = 3` at the top of the file): where it belongs,
    when one of `sections` (name: dataclass) has a key of that name."""
    owners = [s for s, cls in sections.items() if key in _keys(cls)]
    where = (f"it is a key of [{owners[0]}]: write it under [{owners[0]}]" if owners else
             f"no section has a key {key!r}; valid sections: {', '.join(sections)}")
    return ConfigError(f"{key} = {show(value)} is a key outside any section (above the first [section] line); "
                       f"{where}")


@dataclass(frozen=True, kw_only=True)
class Config:
    """The whole run configuration: one validated dataclass per TOML section."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    nvme: NvmeConfig = field(default_factory=NvmeConfig)
    io: SwapIOConfig = field(default_factory=SwapIOConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    units: UnitsConfig = field(default_factory=UnitsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    activation: ActivationConfig = field(default_factory=ActivationConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"Config({name}=...): expected {cls.__name__}, got "
                                  f"{type(getattr(self, name)).__name__}; use Config.from_dict for plain dicts")
        if not self.overlap.optimizer_with_backward and self.overlap.optimizer_read_ahead not in ("auto", 0):
            raise ConfigError(
                f"overlap.optimizer_read_ahead = {show(format_size(self.overlap.optimizer_read_ahead))} needs "
                f"overlap.optimizer_with_backward = true (the worker thread reads ahead); enable it, or set "
                f'optimizer_read_ahead = 0 / "auto"')
        if self.placement.policy == "static" and not self.nvme.paths:
            on_nvme = [k for k in ("params", "grads", "optimizer") if getattr(self.placement, k) == "nvme"]
            if on_nvme:
                raise ConfigError(
                    f'placement.{on_nvme[0]} = "nvme" needs swap directories: nvme.paths is empty; '
                    f'set nvme.paths = ["/path/to/fast/disk"]'
                )

    # -- loading

    @classmethod
    def from_dict(cls, data: dict[str, Any], overrides: Iterable[str] = ()) -> Config:
        """Build from a nested dict (as TOML parses), then apply "section.key=value" overrides."""
        if not isinstance(data, dict):
            raise ConfigError(f"config: expected a table of sections, got {type(data).__name__}")
        merged: dict[str, dict[str, Any]] = {}
        for section, table in data.items():
            if section not in SECTIONS and not isinstance(table, dict):
                raise key_outside_sections(section, table, SECTIONS)
            if section not in SECTIONS:
                raise unknown_key(section, None)
            if not isinstance(table, dict):
                raise ConfigError(f"[{section}] = {show(table)}: a section must be a table, e.g. "
                                  f"[{section}] on its own line followed by key = value lines")
            for key in table:
                if key not in _keys(SECTIONS[section]):
                    raise unknown_key(key, section)
            merged[section] = dict(table)
        if isinstance(overrides, str):
            overrides = [overrides]
        for item in overrides:
            section, key, value = parse_override(item)
            if section not in SECTIONS:
                raise unknown_key(section, None)
            if key not in _keys(SECTIONS[section]):
                raise unknown_key(key, section)
            merged.setdefault(section, {})[key] = value
        return cls(**{section: SECTIONS[section](**table) for section, table in merged.items()})

    @classmethod
    def of(cls, value: "Config | dict | str | os.PathLike | None") -> Config:
        """A Config from what an API takes as one: a Config, a dict, a TOML file's path, or None (defaults)."""
        if value is None or isinstance(value, Config):
            return value if value is not None else cls()
        if isinstance(value, dict):
            return cls.from_dict(value)
        if isinstance(value, (str, os.PathLike)):
            return cls.from_file(value)
        raise ConfigError(f"a config is a Config, a dict or a TOML file's path, not {type(value).__name__}")

    @classmethod
    def from_file(cls, path: str | Path, overrides: Iterable[str] = ()) -> Config:
        """Load a TOML file (see `defaults_text` for every key)."""
        path = Path(path)
        try:
            data = read_document(path)
        except OSError as e:
            raise ConfigError(f"config file {path}: cannot read it ({e.strerror}); give the path of a TOML file "
                              f"(`infinity config --defaults` prints every key)") from None
        try:
            return cls.from_dict(data, overrides)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def with_overrides(self, overrides: Iterable[str]) -> Config:
        """A copy with "section.key=value" overrides applied (values TOML-parsed)."""
        return Config.from_dict(self.to_dict(), overrides)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Nested plain dict (sizes as int bytes); ``Config.from_dict(c.to_dict()) == c``."""
        return {name: getattr(self, name).to_dict() for name in SECTIONS}

    # -- reference

    @staticmethod
    def reference() -> list[tuple[str, str, Any, str]]:
        """Every key as (dotted key, type name, default as written in TOML, meaning)."""
        return [
            (f"{section}.{f.name}", type_name(f.metadata), render_default(f.default, f.metadata),
             f.metadata["help"])
            for section, cls in SECTIONS.items()
            for f in dataclasses.fields(cls)
        ]

    @staticmethod
    def reference_markdown() -> str:
        """The config reference of docs/config.md: one table row per key."""
        rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
        for key, kind_name, default, help_text in Config.reference():
            shown, kind = (text.replace("|", "\\|") for text in (show(default), kind_name))
            rows.append(f"| `{key}` | {kind} | `{shown}` | {help_text} |")
        return "\n".join(rows)

    @staticmethod
    def defaults_text(*, commented: bool = False, values: dict | None = None, header: str = "") -> str:
        """A TOML document of every key at its default, each preceded by a comment of its meaning. `commented`:
        every key line commented out (a copy of the document then sets nothing); `values`: {section: {key:
        value}} shown instead of the default, which is named beside it (a front end's own defaults)."""
        lines = [header or "# infinity configuration: every key at its default value.", ""]
        for section, cls in SECTIONS.items():
            lines.append(f"# {cls.__doc__}")
            lines.append(f"[{section}]")
            for f in dataclasses.fields(cls):
                help_text = f"{f.metadata['help']} ({type_name(f.metadata)})"
                lines.extend(textwrap.wrap(help_text, width=88, initial_indent="# ", subsequent_indent="# "))
                default = show(render_default(f.default, f.metadata))
                own = (values or {}).get(section, {})
                line = (f"{f.name} = {show(own[f.name])}  # the engine's default: {default}" if f.name in own
                        else f"{f.name} = {default}")
                lines.append(("# " if commented else "") + line)
            lines.append("")
        return "\n".join(lines)
