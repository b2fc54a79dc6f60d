"""Run configuration: frozen keyword-only dataclasses, TOML / dict loading, validation.

One small dataclass per TOML section; the top-level `Config` holds one of each.
Every field carries its meaning in ``field(metadata={"help": ...})`` so that
``infinity config --defaults`` and the README reference are generated from the
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
import difflib
import math
import re
import textwrap
import tomllib
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, ClassVar, Iterable

__all__ = [
    "Config",
    "ConfigError",
    "OptimizerConfig",
    "PrecisionConfig",
    "PlacementConfig",
    "MemoryConfig",
    "NvmeConfig",
    "IOConfig",
    "PrefetchConfig",
    "OverlapConfig",
    "TrainConfig",
    "ProfileConfig",
    "UnitsConfig",
    "parse_size",
    "format_size",
]


class ConfigError(ValueError):
    """A configuration value a user must change; the message names the key and the fix."""


# ---------------------------------------------------------------- sizes

_BINARY = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50}
_DECIMAL = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15}
_UNITS = {"B": 1, **_BINARY, **_DECIMAL}
_UNITS_LOWER = {u.lower(): u for u in _UNITS}
_SIZE_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: Any, key: str = "size") -> int:
    """Parse a byte size: an int, or a string like "4096", "1MiB", "1.5GiB", "12 GB".

    Binary units (KiB, MiB, GiB, TiB, PiB) are powers of 1024, decimal units
    (KB, MB, GB, TB, PB) powers of 1000; unit case is not significant. Returns
    int bytes (>= 0). Raises ConfigError naming ``key`` on anything else.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(
            f"{key} = {_show(value)}: expected a size such as 4096, \"1MiB\" or \"12GiB\", "
            f"got {type(value).__name__}"
        )
    if isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            raise ConfigError(f"{key} = {_show(value)}: a size must be a whole number of bytes, "
                              f"e.g. 4096 or \"1.5GiB\"")
        value = int(value)
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key} = {value}: a size must be >= 0")
        return value
    text = value.strip()
    if text.startswith("-"):
        raise ConfigError(f"{key} = {_show(value)}: a size must be >= 0, e.g. \"1GiB\"")
    match = _SIZE_RE.match(text)
    unit = (_UNITS_LOWER.get(match.group(2).lower()) if match.group(2) else "B") if match else None
    if unit is None:
        words = re.findall(r"[A-Za-z]+", text)
        hint = _did_you_mean(words[-1], _UNITS, case_insensitive=True) if words else ""
        raise ConfigError(
            f"{key} = {_show(value)}: not a size{hint}; write a number with an optional unit "
            f"({', '.join(_UNITS)}), e.g. \"1MiB\" or \"12GiB\""
        )
    num_bytes = Decimal(match.group(1).replace("_", "")) * _UNITS[unit]  # exact: "1.5GiB" is 1610612736
    if num_bytes != num_bytes.to_integral_value():
        raise ConfigError(f"{key} = {_show(value)}: is {num_bytes} bytes; a size must be a whole number of bytes")
    return int(num_bytes)


def format_size(num_bytes: int, *, exact: bool = True) -> str:
    """Render a byte count: "1MiB", "12GB", "4097"; ``parse_size(format_size(n)) == n``.

    With ``exact=False`` render for humans instead: "11.18GiB" (2 decimals, not round-trippable).
    """
    if exact:  # the exact form with the fewest digits: 12000000000 -> "12GB", 3 * 2**30 -> "3GiB"
        forms = [(num_bytes // scale, unit) for unit, scale in {**_BINARY, **_DECIMAL}.items()
                 if num_bytes >= scale and num_bytes % scale == 0]
        return "{}{}".format(*min(forms)) if forms else str(num_bytes)
    for unit, scale in reversed(_BINARY.items()):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f}{unit}"
    return f"{num_bytes}B"


# ---------------------------------------------------------------- field specs

def _option(default: Any, help: str, kind: str, **rules: Any) -> Any:
    """A config field: its default, its meaning (``help``), its kind and range rules.

    kinds: float, int, bool, str, enum (rules: choices), size, size_or_auto,
    floats / strs (lists; rules: length, unique). Range rules: ge, gt, lt, le.
    """
    if isinstance(default, list):
        default = tuple(default)
    return field(default=default, metadata={"help": help, "kind": kind, **rules})


def _show(value: Any) -> str:
    """A value as the user would have written it in TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    return repr(value) if isinstance(value, int) else f"<{type(value).__name__}>"


def _did_you_mean(name: str, valid: Iterable[str], *, case_insensitive: bool = False) -> str:
    """' (did you mean "x"?)' for the closest valid name, or '' when nothing is close."""
    valid = list(valid)
    if case_insensitive:
        lowered = {v.lower(): v for v in valid}
        close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
        close = [lowered[c] for c in close]
    else:
        close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    return f' (did you mean "{close[0]}"?)' if close else ""


def _check_range(key: str, value: float, meta: dict, example: str) -> None:
    bounds = [("ge", ">=", lambda a, b: a >= b), ("gt", ">", lambda a, b: a > b),
              ("le", "<=", lambda a, b: a <= b), ("lt", "<", lambda a, b: a < b)]
    for rule, word, ok in bounds:
        if rule in meta and not ok(value, meta[rule]):
            raise ConfigError(f"{key} = {_show(value)}: must be {word} {meta[rule]}{example}")


def _coerce(key: str, value: Any, meta: dict) -> Any:
    """Validate one value against its field spec; return the normalized value."""
    kind = meta["kind"]
    short = re.sub(r"\[\d+\]$", "", key.rsplit(".", 1)[-1])  # "optimizer.betas[1]" -> "betas"
    example = f", e.g. {short} = {_show(meta['example'])}" if "example" in meta else ""
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} = {_show(value)}: expected a number{example}")
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{key} = {_show(value)}: must be a finite number{example}")
        _check_range(key, value, meta, example)
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} = {_show(value)}: expected a whole number (int), "
                              f"e.g. {short} = {meta.get('example', 1)}")
        _check_range(key, value, meta, example)
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{key} = {_show(value)}: expected true or false")
        return value
    if kind == "str":
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{key} = {_show(value)}: expected a non-empty string")
        return value
    if kind == "enum":
        choices = meta["choices"]
        if value not in choices:
            hint = _did_you_mean(value, choices, case_insensitive=True) if isinstance(value, str) else ""
            valid = " | ".join(_show(c) for c in choices)
            raise ConfigError(f"{key} = {_show(value)}: not a valid choice{hint}; valid: {valid}")
        return value
    if kind in ("size", "size_or_auto"):
        if kind == "size_or_auto" and value == "auto":
            return value
        if kind == "size_or_auto" and isinstance(value, str) and value.strip().lower() == "auto":
            raise ConfigError(f"{key} = {_show(value)}: write \"auto\" in lower case")
        num_bytes = parse_size(value, key)
        _check_range(key, num_bytes, meta, example)
        return num_bytes
    if kind in ("floats", "strs"):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} = {_show(value)}: expected a list{example}")
        if "length" in meta and len(value) != meta["length"]:
            raise ConfigError(f"{key} = {_show(value)}: expected exactly {meta['length']} values{example}")
        item_meta = {**meta, "kind": kind[:-1]}
        items = tuple(_coerce(f"{key}[{i}]", v, item_meta) for i, v in enumerate(value))
        if meta.get("unique") and len(set(items)) != len(items):
            dupes = sorted({v for v in items if items.count(v) > 1})
            raise ConfigError(f"{key} = {_show(value)}: duplicate entries {_show(dupes)}; list each once")
        return items
    raise AssertionError(f"unknown field kind {kind!r} for {key}")


def _type_name(meta: dict) -> str:
    kind = meta["kind"]
    return {
        "enum": " | ".join(_show(c) for c in meta.get("choices", ())),
        "size": "size",
        "size_or_auto": 'size | "auto"',
        "floats": "list[float]",
        "strs": "list[str]",
    }.get(kind, kind)


def _render_default(value: Any, meta: dict) -> Any:
    """A default as the user would write it (sizes as "1MiB", tuples as lists)."""
    if meta["kind"] in ("size", "size_or_auto") and isinstance(value, int):
        return format_size(value)
    if isinstance(value, tuple):
        return list(value)
    return value


class _Section:
    """Base of every section: validates and normalizes its fields on construction."""

    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = _coerce(f"{self.SECTION}.{f.name}", getattr(self, f.name), f.metadata)
            object.__setattr__(self, f.name, value)  # frozen: normalize in place once
        self._check()

    def _check(self) -> None:
        """Contradictions between keys of this section (override in subclasses)."""

    def _is_default(self, name: str) -> bool:
        f = next(f for f in dataclasses.fields(self) if f.name == name)
        return getattr(self, name) == f.default

    def to_dict(self) -> dict[str, Any]:
        """Plain TOML-ready values (sizes as int bytes, tuples as lists)."""
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in dataclasses.fields(self)}


# ---------------------------------------------------------------- sections

@dataclass(frozen=True, kw_only=True)
class OptimizerConfig(_Section):
    """Adam / AdamW hyperparameters and the learning-rate schedule."""

    SECTION: ClassVar[str] = "optimizer"

    name: str = _option("adamw", '"adamw": decoupled weight decay (torch.optim.AdamW); '
                        '"adam": weight decay added to the gradient as L2 (torch.optim.Adam).',
                        "enum", choices=("adam", "adamw"))
    lr: float = _option(3e-4, "Peak learning rate (after warmup).", "float", gt=0.0, example=3e-4)
    betas: tuple[float, float] = _option((0.9, 0.95), "Adam (beta1, beta2): decay rates of the gradient's "
                                         "first and second moment estimates, each in [0, 1).",
                                         "floats", length=2, ge=0.0, lt=1.0, example=[0.9, 0.95])
    eps: float = _option(1e-8, "Added to the denominator sqrt(v_hat) for numerical stability.", "float",
                         gt=0.0, example=1e-8)
    weight_decay: float = _option(0.0, "Weight decay coefficient (decoupled for adamw, L2 for adam).",
                                  "float", ge=0.0, example=0.1)
    grad_clip: float = _option(0.0, "Maximum global gradient L2 norm; gradients are scaled down to it "
                               "when larger. 0 = no clipping.", "float", ge=0.0, example=1.0)
    schedule: str = _option("constant", "Learning-rate schedule after warmup: constant at lr, or cosine / "
                            "linear decay to lr * min_lr_ratio at total_steps.",
                            "enum", choices=("constant", "cosine", "linear"))
    warmup_steps: int = _option(0, "Optimizer steps of linear warmup from lr / warmup_steps up to lr.",
                                "int", ge=0)
    total_steps: int = _option(0, "Step at which cosine / linear decay reaches lr * min_lr_ratio "
                               "(must exceed warmup_steps; unused by constant).", "int", ge=0)
    min_lr_ratio: float = _option(0.0, "Final learning rate of cosine / linear decay, as a fraction of lr.",
                                  "float", ge=0.0, le=1.0, example=0.1)
    sub_group_size: int = _option(8_388_608, "Elements per optimizer sub-group: the unit streamed through "
                                  "buffers (read, step, write) when optimizer state is on NVMe.", "int", gt=0)

    def _check(self) -> None:
        decaying = self.schedule in ("cosine", "linear")
        if decaying and self.total_steps <= self.warmup_steps:
            raise ConfigError(
                f"optimizer.total_steps = {self.total_steps}: with schedule = {_show(self.schedule)} it must be > "
                f"optimizer.warmup_steps = {self.warmup_steps}; set total_steps to the length of the run"
            )
        if not decaying:
            for name in ("total_steps", "min_lr_ratio"):
                if not self._is_default(name):
                    raise ConfigError(
                        f"optimizer.{name} = {_show(getattr(self, name))}: has no effect with "
                        f'schedule = "constant"; '
                        f'remove it or set optimizer.schedule = "cosine" or "linear"'
                    )


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig(_Section):
    """Compute precision; master weights and gradient reduction are always fp32."""

    SECTION: ClassVar[str] = "precision"

    compute_dtype: str = _option("fp32", "dtype of parameters and activations during forward / backward.",
                                 "enum", choices=("fp32", "bf16", "fp16"))
    initial_loss_scale: float = _option(65536.0, "Starting loss scale of fp16 dynamic loss scaling "
                                        "(fp16 only).", "float", gt=0.0, example=65536.0)
    loss_scale_growth_interval: int = _option(1000, "Steps without overflow after which the fp16 loss scale "
                                              "doubles (fp16 only).", "int", gt=0)

    def _check(self) -> None:
        if self.compute_dtype == "fp16":
            return
        for name in ("initial_loss_scale", "loss_scale_growth_interval"):
            if not self._is_default(name):
                raise ConfigError(
                    f"precision.{name} = {_show(getattr(self, name))}: loss scaling is only used with "
                    f'compute_dtype = "fp16" (here {_show(self.compute_dtype)}); remove it or set '
                    f'precision.compute_dtype = "fp16"'
                )


_TIERS = ("device", "host", "nvme")


@dataclass(frozen=True, kw_only=True)
class PlacementConfig(_Section):
    """Which tier holds each state kind's shards."""

    SECTION: ClassVar[str] = "placement"

    policy: str = _option("static", '"static": use params / grads / optimizer below; "auto": plan tiers from '
                          "the memory budgets (the three keys below must then stay at their defaults).",
                          "enum", choices=("static", "auto"))
    params: str = _option("device", "Tier of the compute-dtype parameter shards.", "enum", choices=_TIERS)
    grads: str = _option("device", "Tier of the fp32 gradient shards.", "enum", choices=_TIERS)
    optimizer: str = _option("device", "Tier of the fp32 master weights, exp_avg and exp_avg_sq.",
                             "enum", choices=_TIERS)

    def _check(self) -> None:
        if self.policy != "auto":
            return
        for name in ("params", "grads", "optimizer"):
            if not self._is_default(name):
                raise ConfigError(
                    f"placement.{name} = {_show(getattr(self, name))}: is ignored with policy = \"auto\", which "
                    f'plans tiers from the budgets; remove it or set placement.policy = "static"'
                )


@dataclass(frozen=True, kw_only=True)
class MemoryConfig(_Section):
    """Memory budgets per tier, per rank."""

    SECTION: ClassVar[str] = "memory"

    device_budget: int | str = _option("auto", 'Device memory for training state: a size ("70GiB") or "auto" '
                                       "(free device memory detected at initialize).", "size_or_auto", gt=0,
                                       example="70GiB")
    host_budget: int | str = _option("auto", 'Host RAM for training state: a size ("100GiB") or "auto" '
                                     "(available RAM detected at initialize).", "size_or_auto", gt=0,
                                     example="100GiB")


@dataclass(frozen=True, kw_only=True)
class NvmeConfig(_Section):
    """NVMe swap space."""

    SECTION: ClassVar[str] = "nvme"

    paths: tuple[str, ...] = _option((), "Directories for swap files; several paths stripe across disks. "
                                     "Required when any state is placed on nvme.", "strs", unique=True,
                                     example=["/mnt/nvme0"])


@dataclass(frozen=True, kw_only=True)
class IOConfig(_Section):
    """Asynchronous file I/O of the NVMe tier."""

    SECTION: ClassVar[str] = "io"

    block_size: int = _option(2**20, "Bytes per I/O request (a power of two, >= 4KiB).", "size",
                              ge=4096, example="1MiB")
    queue_depth: int = _option(16, "Block requests in flight at once (over all I/O threads).", "int", ge=1)
    threads: int = _option(8, "I/O worker threads: with backend \"threads\" they carry every block (8 at queue depth 16 "
                           "measured best here: benchmarks/RESULTS.md); with \"aio\" only unaligned heads and tails.",
                           "int", ge=1)
    backend: str = _option("auto", "How blocks reach the disk: \"aio\" = Linux kernel AIO, the whole queue depth on the "
                           "device at once, one thread reaping completions (faster beside compute: Note [kernel aio]); "
                           "\"threads\" = preadv/pwritev from the worker threads; \"auto\" = aio where the kernel "
                           "offers it, else threads.", "enum", choices=("auto", "aio", "threads"))
    direct: bool = _option(True, "Open swap files with O_DIRECT (bypass the page cache).", "bool")
    checksum: str = _option(
        "sampled", "Checksum swap blocks when written, verify them when read: \"full\" = CRC-32C of every byte; "
        "\"sampled\" = of 64 KiB spread over each 1 MiB block (catches misplaced, stale and lost blocks at "
        "1/7 of the CPU: Note [sampled checksum]); \"off\".", "enum", choices=("full", "sampled", "off"))
    switch_interval_us: float = _option(
        100.0, "Python's thread switch interval while an engine is open (sys.setswitchinterval), in "
        "microseconds; 0 leaves it alone. I/O completions need the GIL: at Python's default 5000 a "
        "Python-heavy forward cut 1 MiB writes from 1.9 to 0.5 GB/s here, and the out-of-core step took "
        "4.5-4.7 s at 100 (also 50, 20) against 5.0-8.4 s at 500 (Note [switch interval]).",
        "float", ge=0)

    def engine_config(self, **overrides: Any):
        """io_engine's IOConfig for this section; ``overrides`` replace fields (checksum="off")."""
        from io_engine import IOConfig as EngineIOConfig

        fields = dict(block_size=self.block_size, queue_depth=self.queue_depth, threads=self.threads,
                      direct=self.direct, checksum=self.checksum, backend=self.backend)
        return EngineIOConfig(**{**fields, **overrides})

    def _check(self) -> None:
        if self.block_size & (self.block_size - 1):
            lower = 1 << (self.block_size.bit_length() - 1)
            raise ConfigError(f"io.block_size = {self.block_size}: must be a power of two, e.g. "
                              f"{_show(format_size(lower))} or {_show(format_size(lower * 2))}")


@dataclass(frozen=True, kw_only=True)
class PrefetchConfig(_Section):
    """How far ahead parameters are fetched."""

    SECTION: ClassVar[str] = "prefetch"

    units_ahead: int = _option(2, "Units fetched ahead of the one computing (0 = fetch on demand).", "int", ge=0)
    max_bytes_in_flight: int = _option(4 * 2**30, "Cap on bytes of prefetched, not yet used units.", "size",
                                       gt=0, example="4GiB")
    keep_written: bool = _option(True, "Parameters on NVMe that the update writes stay in host memory (up to "
                                 "units_ahead + 1 units) until the next forward fetches them, instead of being "
                                 "read back from disk (Note [fresh parameters]).", "bool")


@dataclass(frozen=True, kw_only=True)
class OverlapConfig(_Section):
    """What runs concurrently."""

    SECTION: ClassVar[str] = "overlap"

    optimizer_with_backward: bool = _option(True, "Run the optimizer on a worker thread, overlapped with compute: "
                                            "without clipping or fp16, each unit is updated as soon as its "
                                            "gradients are final, while backward continues; with them, after "
                                            "the global norm, in the next forward's order (each unit's forward "
                                            "waits only for its own update). Exactly the non-overlapped result "
                                            "either way.", "bool")
    optimizer_read_ahead: int | str = _option(
        "auto", "Bytes of NVMe optimizer state the worker may read ahead of the next update, while forward and "
        "backward run (Note [state read-ahead]): a size, 0 for none, or \"auto\": all of this rank's NVMe "
        "optimizer state if it fits in half the host memory the plan leaves free, else that half. Held in "
        "page-locked staging buffers; needs optimizer_with_backward.", "size_or_auto", ge=0, example="8GiB")


@dataclass(frozen=True, kw_only=True)
class TrainConfig(_Section):
    """Training loop behaviour."""

    SECTION: ClassVar[str] = "train"

    grad_accum_steps: int = _option(1, "Micro-batches (backward calls) per optimizer step.", "int", ge=1)
    seed: int = _option(0, "Random seed.", "int", ge=0)
    on_nonfinite: str = _option("error", "When gradients contain NaN / Inf (outside fp16 loss scaling): "
                                '"error" stops with the step and unit, "skip" skips the step.',
                                "enum", choices=("error", "skip"))


@dataclass(frozen=True, kw_only=True)
class ProfileConfig(_Section):
    """Tracing."""

    SECTION: ClassVar[str] = "profile"

    enabled: bool = _option(False, "Record spans (fetch, copy, collective, optimizer sub-step, unit compute); "
                            "at close() write the Chrome trace, overlap summary and timeline chart under "
                            "trace_dir/rank<N>.", "bool")
    trace_dir: str = _option("runs/trace", "Directory for the Chrome trace and overlap summary.", "str")


@dataclass(frozen=True, kw_only=True)
class UnitsConfig(_Section):
    """How the model is split into units (the blocks that move and communicate together)."""

    SECTION: ClassVar[str] = "units"

    classes: tuple[str, ...] = _option((), 'Class names of modules that form units, e.g. ["Block"]; empty = '
                                       "the children of each nn.ModuleList.", "strs", unique=True,
                                       example=["Block"])


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig(_Section):
    """Checkpoint saving."""

    SECTION: ClassVar[str] = "checkpoint"

    keep_last: int = _option(0, "Keep only the newest N checkpoints this run saved (older ones it wrote are "
                             "removed once a newer one is complete); 0 keeps all.", "int", ge=0)
    background: bool = _option(False, "Write checkpoint files in a background thread while the next forward "
                               "and backward run; the checkpoint becomes visible (atomic rename) at the next "
                               "step() or close().", "bool")


# ---------------------------------------------------------------- top level

_SECTIONS: dict[str, type[_Section]] = {
    cls.SECTION: cls
    for cls in (OptimizerConfig, PrecisionConfig, PlacementConfig, MemoryConfig, NvmeConfig, IOConfig,
                PrefetchConfig, OverlapConfig, TrainConfig, ProfileConfig, UnitsConfig, CheckpointConfig)
}


def _unknown(name: str, section: str | None) -> ConfigError:
    """Error for an unknown section (section=None) or key, with the closest valid name."""
    if section is None:
        where, valid = f"[{name}]", list(_SECTIONS)
        owners = [s for s, cls in _SECTIONS.items() if name in _keys(cls)]
        hint = f' (did you mean "{owners[0]}.{name}"?)' if owners else _did_you_mean(name, valid)
        return ConfigError(f"unknown section {where}{hint}; valid sections: {', '.join(valid)}")
    valid = _keys(_SECTIONS[section])
    hint = _did_you_mean(name, valid)
    if not hint:
        owners = [s for s, cls in _SECTIONS.items() if name in _keys(cls)]
        hint = f' (did you mean "{owners[0]}.{name}"?)' if owners else ""
    return ConfigError(f"unknown key {section}.{name}{hint}; valid keys of [{section}]: {', '.join(valid)}")


def _keys(cls: type[_Section]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _parse_override(item: str) -> tuple[str, str, Any]:
    """'section.key=value' -> (section, key, value); value TOML-parsed, else a bare string."""
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"override {item!r}: expected section.key=value, e.g. optimizer.lr=1e-3")
    path, text = (part.strip() for part in item.split("=", 1))
    parts = path.split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"override {item!r}: the key must be section.key, e.g. optimizer.lr=1e-3")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word such as host or 12GiB
    return parts[0], parts[1], value


@dataclass(frozen=True, kw_only=True)
class Config:
    """The whole run configuration: one validated dataclass per TOML section."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    nvme: NvmeConfig = field(default_factory=NvmeConfig)
    io: IOConfig = field(default_factory=IOConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    units: UnitsConfig = field(default_factory=UnitsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"Config({name}=...): expected {cls.__name__}, got "
                                  f"{type(getattr(self, name)).__name__}; use Config.from_dict for plain dicts")
        if not self.overlap.optimizer_with_backward and self.overlap.optimizer_read_ahead not in ("auto", 0):
            raise ConfigError(
                f"overlap.optimizer_read_ahead = {_show(format_size(self.overlap.optimizer_read_ahead))} needs "
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
            if section not in _SECTIONS:
                raise _unknown(section, None)
            if not isinstance(table, dict):
                raise ConfigError(f"[{section}] = {_show(table)}: a section must be a table, e.g. "
                                  f"[{section}] on its own line followed by key = value lines")
            for key in table:
                if key not in _keys(_SECTIONS[section]):
                    raise _unknown(key, section)
            merged[section] = dict(table)
        if isinstance(overrides, str):
            overrides = [overrides]
        for item in overrides:
            section, key, value = _parse_override(item)
            if section not in _SECTIONS:
                raise _unknown(section, None)
            if key not in _keys(_SECTIONS[section]):
                raise _unknown(key, section)
            merged.setdefault(section, {})[key] = value
        return cls(**{section: _SECTIONS[section](**table) for section, table in merged.items()})

    @classmethod
    def from_file(cls, path: str | Path, overrides: Iterable[str] = ()) -> Config:
        """Load a TOML file (see `defaults_text` for every key)."""
        path = Path(path)
        try:
            with path.open("rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
        try:
            return cls.from_dict(data, overrides)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def with_overrides(self, overrides: Iterable[str]) -> Config:
        """A copy with "section.key=value" overrides applied (values TOML-parsed)."""
        return Config.from_dict(self.to_dict(), overrides)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Nested plain dict (sizes as int bytes); ``Config.from_dict(c.to_dict()) == c``."""
        return {name: getattr(self, name).to_dict() for name in _SECTIONS}

    # -- reference

    @staticmethod
    def reference() -> list[tuple[str, str, Any, str]]:
        """Every key as (dotted key, type name, default as written in TOML, meaning)."""
        return [
            (f"{section}.{f.name}", _type_name(f.metadata), _render_default(f.default, f.metadata),
             f.metadata["help"])
            for section, cls in _SECTIONS.items()
            for f in dataclasses.fields(cls)
        ]

    @staticmethod
    def reference_markdown() -> str:
        """The README's config reference: one table row per key."""
        rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
        for key, type_name, default, help_text in Config.reference():
            shown, kind = (text.replace("|", "\\|") for text in (_show(default), type_name))
            rows.append(f"| `{key}` | {kind} | `{shown}` | {help_text} |")
        return "\n".join(rows)

    @staticmethod
    def defaults_text() -> str:
        """A TOML document of every key at its default, each preceded by a comment of its meaning."""
        lines = ["# infinity configuration: every key at its default value.", ""]
        for section, cls in _SECTIONS.items():
            lines.append(f"# {cls.__doc__}")
            lines.append(f"[{section}]")
            for f in dataclasses.fields(cls):
                help_text = f"{f.metadata['help']} ({_type_name(f.metadata)})"
                lines.extend(textwrap.wrap(help_text, width=88, initial_indent="# ", subsequent_indent="# "))
                lines.append(f"{f.name} = {_show(_render_default(f.default, f.metadata))}")
            lines.append("")
        return "\n".join(lines)
