"""Helpers shared by the benchmarks: machine description, peak RSS, JSON output."""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics

import psutil
import torch


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "ram_GiB": round(psutil.virtual_memory().total / 2**30, 1),
            "torch": torch.__version__, "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def median(values):
    return statistics.median(values) if values else None


def write_json(path: str | None, payload: dict) -> None:
    text = json.dumps(payload, indent=2, default=str)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
