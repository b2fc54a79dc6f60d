"""The option machinery of config sections: field specs, validation, TOML rendering, overrides.

`infinity.config.sections` declares the engine's sections with it; `infinity.config.job` declares the
job's (`[run]`, `[model]`, `[model.lora]`, `[data]`) the same way, so
every key of every section is validated, documented and rendered by this one module
(Note [no silent keys] in infinity/config/sections.py). Imports no torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import tomllib
from dataclasses import field
from typing import Any, ClassVar, Iterable

from io_engine import sizes
from io_engine.sizes import format_size

__all__ = ["ConfigError", "Section", "SettingWarning", "check_range", "coerce", "did_you_mean", "format_size",
           "option", "parse_override", "parse_size", "render_default", "show", "type_name"]


def read_document(path) -> dict:
    """A config or job file's tables: TOML, or JSON when its name ends in .json (the same sections and keys, as
    `{"optimizer": {"lr": 1e-3}}`); a file that does not parse is a ConfigError naming where."""
    import json
    import tomllib
    from pathlib import Path
    text = Path(path).read_text()
    if str(path).lower().endswith(".json"):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"{path}: invalid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: a JSON config is an object of sections, e.g. {{\"optimizer\": {{\"lr\": "
                              f"1e-3}}}}, not a {type(data).__name__}")
        return data
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        hint = " (a JSON file must end in .json)" if text.lstrip().startswith("{") else ""
        raise ConfigError(f"{path}: invalid TOML: {e}{hint}") from None


class ConfigError(ValueError):
    """A configuration value a user must change; the message names the key and the fix."""


class SettingWarning(UserWarning):
    """A setting that does nothing in this run (Note [inert setting] in infinity/memory/placement.py): said when
    the engine starts, not ignored; the message names the key, why, and what to change."""


# ---------------------------------------------------------------- sizes


def parse_size(value: Any, key: str = "size") -> int:
    """Int bytes from an int or a string such as "4096", "1MiB", "1.5GiB", "12 GB": io_engine's
    `parse_size` (Note [size strings]: KiB... binary, KB... decimal, a bare "4k" refused), raising
    ConfigError naming ``key``."""
    try:
        return sizes.parse_size(value, key)
    except sizes.SizeError as e:
        raise ConfigError(str(e)) from None


# ---------------------------------------------------------------- field specs

def option(default: Any, help: str, kind: str, **rules: Any) -> Any:
    """A config field: its default, its meaning (``help``), its kind and range rules.

    kinds: float, int, int_or_auto, bool, str, enum (rules: choices), size, size_or_auto,
    path (a string, "" for none), floats / strs (lists; rules: length, unique). Range rules: ge, gt, lt, le.
    """
    if isinstance(default, list):
        default = tuple(default)
    return field(default=default, metadata={"help": help, "kind": kind, **rules})


def show(value: Any) -> str:
    """A value as the user would have written it in TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show(v) for v in value) + "]"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    return repr(value) if isinstance(value, int) else f"<{type(value).__name__}>"


def did_you_mean(name: str, valid: Iterable[str], *, case_insensitive: bool = False) -> str:
    """' (did you mean "x"?)' for the closest valid name, or '' when nothing is close."""
    valid = list(valid)
    if case_insensitive:
        lowered = {v.lower(): v for v in valid}
        close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
        close = [lowered[c] for c in close]
    else:
        close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    return f' (did you mean "{close[0]}"?)' if close else ""


def check_range(key: str, value: float, meta: dict, example: str) -> None:
    bounds = [("ge", ">=", lambda a, b: a >= b), ("gt", ">", lambda a, b: a > b),
              ("le", "<=", lambda a, b: a <= b), ("lt", "<", lambda a, b: a < b)]
    for rule, word, ok in bounds:
        if rule in meta and not ok(value, meta[rule]):
            raise ConfigError(f"{key} = {show(value)}: must be {word} {meta[rule]}{example}")


def coerce(key: str, value: Any, meta: dict) -> Any:
    """Validate one value against its field spec; return the normalized value."""
    kind = meta["kind"]
    short = re.sub(r"\[\d+\]$", "", key.rsplit(".", 1)[-1])  # "optimizer.betas[1]" -> "betas"
    example = f", e.g. {short} = {show(meta['example'])}" if "example" in meta else ""
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} = {show(value)}: expected a number{example}")
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{key} = {show(value)}: must be a finite number{example}")
        check_range(key, value, meta, example)
        return value
    if kind == "int_or_auto" and value == "auto":
        return value
    if kind in ("int", "int_or_auto"):
        if isinstance(value, bool) or not isinstance(value, int):
            either = ' or "auto"' if kind == "int_or_auto" else ""
            raise ConfigError(f"{key} = {show(value)}: expected a whole number (int){either}, "
                              f"e.g. {short} = {meta.get('example', 1)}")
        check_range(key, value, meta, example)
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{key} = {show(value)}: expected true or false")
        return value
    if kind == "str":
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{key} = {show(value)}: expected a non-empty string")
        return value
    if kind == "path":  # a directory, or "" for none
        if not isinstance(value, str):
            raise ConfigError(f"{key} = {show(value)}: expected a path (a string; \"\" for none)")
        return value
    if kind == "enum":
        choices = meta["choices"]
        if value not in choices:
            hint = did_you_mean(value, choices, case_insensitive=True) if isinstance(value, str) else ""
            valid = " | ".join(show(c) for c in choices)
            raise ConfigError(f"{key} = {show(value)}: not a valid choice{hint}; valid: {valid}")
        return value
    if kind in ("size", "size_or_auto"):
        if kind == "size_or_auto" and value == "auto":
            return value
        if kind == "size_or_auto" and isinstance(value, str) and value.strip().lower() == "auto":
            raise ConfigError(f"{key} = {show(value)}: write \"auto\" in lower case")
        num_bytes = parse_size(value, key)
        check_range(key, num_bytes, meta, example)
        return num_bytes
    if kind in ("floats", "strs"):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} = {show(value)}: expected a list{example}")
        if "length" in meta and len(value) != meta["length"]:
            raise ConfigError(f"{key} = {show(value)}: expected exactly {meta['length']} values{example}")
        item_meta = {**meta, "kind": kind[:-1]}
        items = tuple(coerce(f"{key}[{i}]", v, item_meta) for i, v in enumerate(value))
        if meta.get("unique") and len(set(items)) != len(items):
            dupes = sorted({v for v in items if items.count(v) > 1})
            raise ConfigError(f"{key} = {show(value)}: duplicate entries {show(dupes)}; list each once")
        return items
    raise AssertionError(f"unknown field kind {kind!r} for {key}")


def type_name(meta: dict) -> str:
    kind = meta["kind"]
    return {
        "enum": " | ".join(show(c) for c in meta.get("choices", ())),
        "size": "size",
        "path": "path",
        "size_or_auto": 'size | "auto"',
        "int_or_auto": 'int | "auto"',
        "floats": "list[float]",
        "strs": "list[str]",
    }.get(kind, kind)


def render_default(value: Any, meta: dict) -> Any:
    """A default as the user would write it (sizes as "1MiB", tuples as lists)."""
    if meta["kind"] in ("size", "size_or_auto") and isinstance(value, int):
        return format_size(value)
    if isinstance(value, tuple):
        return list(value)
    return value


class Section:
    """Base of every section: validates and normalizes its fields on construction."""

    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = coerce(f"{self.SECTION}.{f.name}", getattr(self, f.name), f.metadata)
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


def parse_override(item: str) -> tuple[str, str, Any]:
    """'section.key=value' -> (section, key, value); value TOML-parsed, else a bare string. A nested section
    ([model.lora]) is named by its dotted path: 'model.lora.r=8' -> ("model.lora", "r", 8)."""
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"override {item!r}: expected section.key=value, e.g. optimizer.lr=1e-3")
    path, text = (part.strip() for part in item.split("=", 1))
    parts = path.split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"override {item!r}: the key must be section.key, e.g. optimizer.lr=1e-3")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word such as host or 12GiB
    return ".".join(parts[:-1]), parts[-1], value


# ---------------------------------------------------------------- one key's values

HEADROOM_FLOOR = 2 << 30


def headroom_bytes(spec: str, total: int) -> int:
    """Note [headroom]: the RAM (of `total` RAM) or disk (of a filesystem of `total` bytes) that `memory.headroom`
    keeps unused: "N%" is N% of `total`, at least 2 GiB (never more than `total`); a size is that size; "0" none.
    The RAM is judged as the machine is: what the kernel could give this job now (MemAvailable: the page cache
    counts as free, what other processes hold does not), less the headroom; the disks by their free bytes less it."""
    text = str(spec).strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1])
        except ValueError:
            share = -1.0
        if not 0 <= share < 100:
            raise ConfigError(f'memory.headroom = "{spec}": a share must be 0% to 99%, e.g. memory.headroom = "10%"')
        return 0 if share == 0 else min(total, max(int(total * share / 100), HEADROOM_FLOOR))
    try:
        return int(parse_size(text, "memory.headroom"))
    except ConfigError:
        raise ConfigError(f'memory.headroom = "{spec}": expected a share of the total ("10%") or a size ("4GiB", '
                          f'"0" for none)') from None
