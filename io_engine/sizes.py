"""Byte sizes as people write them: the one parser and formatter of the project.

Note [size strings]: a size is an int (bytes) or a string of a number and an
optional unit. Binary units KiB, MiB, GiB, TiB, PiB are powers of 1024; decimal
units KB, MB, GB, TB, PB powers of 1000; B is bytes; unit case is not
significant ("1mib" is 1MiB). A bare prefix ("4k", "12 G") is refused: half the
tools that write it mean 1024 and half mean 1000, so the message asks for "4KiB"
or "4KB". Fractions are exact ("1.5GiB" is 1610612736) and must come to a whole
number of bytes. `infinity.config.sections` (every size key) and io_engine (IOConfig, the
benchmarks' flags) parse with `parse_size`, so a size means the same everywhere.
"""

from __future__ import annotations

import difflib
import math
import re
from decimal import Decimal
from typing import Any

BINARY = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50}
DECIMAL = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15}
UNITS = {"B": 1, **BINARY, **DECIMAL}
_UNITS_LOWER = {u.lower(): u for u in UNITS}
_SIZE_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")
_BARE_PREFIX = {"k": ("KiB", "KB"), "m": ("MiB", "MB"), "g": ("GiB", "GB"), "t": ("TiB", "TB"), "p": ("PiB", "PB")}


class SizeError(ValueError):
    """A size that cannot be parsed; the message starts with "<key> = <value>:" and names the fix."""


def _show(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return f"<{type(value).__name__}>"


def parse_size(value: Any, key: str = "size") -> int:
    """Int bytes (>= 0) from an int or a string such as "4096", "1MiB", "1.5GiB", "12 GB" (Note [size strings]).

    Raises SizeError, whose message names `key`, on anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise SizeError(f"{key} = {_show(value)}: expected a size such as 4096, \"1MiB\" or \"12GiB\", "
                        f"got {type(value).__name__}")
    if isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            raise SizeError(f"{key} = {_show(value)}: a size must be a whole number of bytes, e.g. 4096 or \"1.5GiB\"")
        value = int(value)
    if isinstance(value, int):
        if value < 0:
            raise SizeError(f"{key} = {value}: a size must be >= 0")
        return value
    text = value.strip()
    if text.startswith("-"):
        raise SizeError(f"{key} = {_show(value)}: a size must be >= 0, e.g. \"1GiB\"")
    match = _SIZE_RE.match(text)
    unit = (_UNITS_LOWER.get(match.group(2).lower()) if match.group(2) else "B") if match else None
    if unit is None:
        if match and match.group(2).lower() in _BARE_PREFIX:
            binary, decimal = _BARE_PREFIX[match.group(2).lower()]
            number = match.group(1)
            raise SizeError(f"{key} = {_show(value)}: ambiguous unit {match.group(2)!r}; write \"{number}{binary}\" "
                            f"(powers of 1024) or \"{number}{decimal}\" (powers of 1000)")
        words = re.findall(r"[A-Za-z]+", text)
        hint = _did_you_mean(words[-1]) if words else ""
        raise SizeError(f"{key} = {_show(value)}: not a size{hint}; write a number with an optional unit "
                        f"({', '.join(UNITS)}), e.g. \"1MiB\" or \"12GiB\"")
    num_bytes = Decimal(match.group(1).replace("_", "")) * UNITS[unit]  # exact: "1.5GiB" is 1610612736
    if num_bytes != num_bytes.to_integral_value():
        raise SizeError(f"{key} = {_show(value)}: is {num_bytes} bytes; a size must be a whole number of bytes")
    return int(num_bytes)


def _did_you_mean(word: str) -> str:
    lowered = {u.lower(): u for u in UNITS}
    close = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
    return f' (did you mean "{lowered[close[0]]}"?)' if close else ""


def format_size(num_bytes: float, *, exact: bool = True) -> str:
    """Render a byte count: "1MiB", "12GB", "4097"; ``parse_size(format_size(n)) == n``.

    With ``exact=False`` render for people instead: "11.18GiB" (2 decimals, not round-trippable)."""
    num_bytes = int(num_bytes)
    if exact:  # the exact form with the fewest digits: 12000000000 -> "12GB", 3 * 2**30 -> "3GiB"
        forms = [(num_bytes // scale, unit) for unit, scale in {**BINARY, **DECIMAL}.items()
                 if num_bytes >= scale and num_bytes % scale == 0]
        return "{}{}".format(*min(forms)) if forms else str(num_bytes)
    for unit, scale in reversed(BINARY.items()):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f}{unit}"
    return f"{num_bytes}B"


__all__ = ["SizeError", "format_size", "parse_size"]
