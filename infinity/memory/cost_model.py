"""Cost model of a training step: the predicted step time of a plan's traffic, and the link rates.

Link rates (measured once per machine and cached under ~/.cache/infinity, or
`$INFINITY_CACHE_DIR`; `infinity bench-links --remeasure` measures again):

    nvme_read, nvme_write   io_engine throughput on the swap directory's disk (bytes/s)
    h2d, d2h                pinned host <-> GPU copies (bytes/s); free without a GPU
    cpu_adam                fused CPU Adam (elements/s); device_adam the same on the GPU
    matmul_flops            dense matmul throughput of the compute device (FLOP/s)

Bytes per link come from the byte model (memory/traffic.py, Note [traffic per step]).

Note [step time]: forward/backward and the optimizer step are sequential phases.
Within a phase transfers overlap compute (prefetch, read ahead, write behind), so a
phase takes as long as its slowest resource; NVMe reads and writes share the disk:

    t_fb   = max(compute, disk_fb, h2d_fb, d2h_fb)        disk = read/nvme_read + write/nvme_write
    t_opt  = max(adam, disk_opt, h2d_opt, d2h_opt)         adam = elements / adam rate
    step   = t_fb + t_opt

Collectives (all-gather, reduce-scatter) cost the same under every placement and
are left out of the comparison.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .traffic import LINKS, StepTraffic, plan_traffic, unit_traffic  # noqa: F401 - the byte model's, used here

CACHE_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class LinkRates:
    """Throughput of every resource a step uses. h2d / d2h are `math.inf` without a GPU (no copy)."""

    nvme_read: float  # bytes/s
    nvme_write: float  # bytes/s
    h2d: float = math.inf  # bytes/s
    d2h: float = math.inf  # bytes/s
    cpu_adam: float  # elements/s
    device_adam: float  # elements/s (== cpu_adam without a GPU)
    matmul_flops: float  # FLOP/s of the compute device
    source: str = "defaults"  # "measured <date> on <dir>" or "defaults"

    def to_json(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict) -> "LinkRates":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: (math.inf if v is None else v) for k, v in data.items() if k in names})


# Conservative rates used when nothing was measured yet (a SATA-class disk, a laptop CPU).
DEFAULT_RATES = LinkRates(nvme_read=1.0e9, nvme_write=0.8e9, h2d=12e9, d2h=12e9, cpu_adam=2.0e8,
                          device_adam=2.0e10, matmul_flops=5.0e10, source="defaults")


def default_rates(cuda: bool) -> LinkRates:
    if cuda:
        return DEFAULT_RATES
    return dataclasses.replace(DEFAULT_RATES, h2d=math.inf, d2h=math.inf, device_adam=DEFAULT_RATES.cpu_adam)


# ---------------------------------------------------------------- time


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step, by phase and resource (Note [step time])."""

    compute: float
    fb: dict[str, float]  # seconds per resource in forward/backward: compute, disk, h2d, d2h
    opt: dict[str, float]  # seconds per resource in the optimizer step: adam, disk, h2d, d2h

    @property
    def fb_seconds(self) -> float:
        return max(self.fb.values())

    @property
    def opt_seconds(self) -> float:
        return max(self.opt.values())

    @property
    def total(self) -> float:
        return self.fb_seconds + self.opt_seconds

    @property
    def link_seconds(self) -> float:
        """Busy time of every transfer resource, summed (a tie-breaker: less traffic is better)."""
        return sum(v for k, v in self.fb.items() if k != "compute") + sum(
            v for k, v in self.opt.items() if k != "adam")

    def bottlenecks(self) -> tuple[str, str]:
        """The slowest resource of each phase."""
        return max(self.fb, key=self.fb.get), max(self.opt, key=self.opt.get)


def _seconds(num_bytes: float, rate: float) -> float:
    return 0.0 if num_bytes == 0 or math.isinf(rate) else num_bytes / rate


def predict_step_time(traffic: StepTraffic, rates: LinkRates, compute_seconds: float = 0.0) -> StepTime:
    """Note [step time] applied to `traffic`."""
    def links(phase: dict[str, int]) -> dict[str, float]:
        return {"disk": _seconds(phase["nvme_read"], rates.nvme_read) + _seconds(phase["nvme_write"], rates.nvme_write),
                "h2d": _seconds(phase["h2d"], rates.h2d), "d2h": _seconds(phase["d2h"], rates.d2h)}
    adam = traffic.adam_cpu / rates.cpu_adam + traffic.adam_device / rates.device_adam
    return StepTime(compute=compute_seconds, fb={"compute": compute_seconds, **links(traffic.fb)},
                    opt={"adam": adam, **links(traffic.opt)})


def compute_seconds(flops: float, rates: LinkRates, efficiency: float = 0.5) -> float:
    """Forward + backward time of `flops` FLOPs at `efficiency` of the measured matmul rate."""
    return flops / (rates.matmul_flops * efficiency)


# ---------------------------------------------------------------- measurement


def _machine_key(device: torch.device) -> str:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return f"{socket.gethostname()}|{platform.machine()}|{os.cpu_count()}cpu|{gpu}"


def _disk_key(directory: str) -> str:
    st = os.stat(directory)
    return f"dev{st.st_dev}"


def rates_key(directory: str, device: torch.device) -> str:
    """The cache key of the link rates of this machine and the disk of `directory`."""
    return f"{_machine_key(device)}|{_disk_key(directory)}"


def _measure_disk(directory: str, num_bytes: int, io_config) -> tuple[float, float]:
    """(read, write) bytes/s of io_engine on `directory`: best of 3 transfers of `num_bytes`."""
    from io_engine import IOEngine, aligned_empty
    from io_engine.bench import drop_page_cache, fsync_file

    cfg = io_config.engine_config(threads=min(io_config.threads, io_config.queue_depth), checksum="off")
    buf = aligned_empty(num_bytes // 4, torch.float32, lock=False)
    buf.fill_(1.0)
    fd, path = tempfile.mkstemp(dir=directory, prefix=".infinity-bench-")
    os.close(fd)
    reads, writes = [], []
    try:
        with IOEngine(cfg) as io:
            for _ in range(3):
                t0 = time.perf_counter()
                io.submit_write(buf, path, 0).wait()
                fsync_file(path)  # the write is not done until it is on the disk
                writes.append(time.perf_counter() - t0)
                drop_page_cache(path)
                t0 = time.perf_counter()
                io.submit_read(buf, path, 0).wait()
                reads.append(time.perf_counter() - t0)
    finally:
        os.unlink(path)
    return num_bytes / min(reads), num_bytes / min(writes)


def _best_seconds(fn, repeats: int = 3) -> float:
    fn()  # warm up (allocations, kernel selection)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _measure_adam(device: torch.device, numel: int) -> float:
    """Elements/s of one fused AdamW step on `device`."""
    master, grad, m, v = (torch.rand(numel, device=device) for _ in range(4))
    step = torch.tensor(1.0, device=device)

    def run():
        torch._fused_adamw_([master], [grad], [m], [v], [], [step], lr=1e-3, beta1=0.9, beta2=0.95,
                            weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return numel / _best_seconds(run)


def _measure_matmul(device: torch.device, dtype: torch.dtype, n: int) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)

    def run():
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return 2 * n**3 / _best_seconds(run)


def _measure_copies(device: torch.device, num_bytes: int) -> tuple[float, float]:
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(num_bytes, dtype=torch.uint8, device=device)

    def h2d():
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)

    def d2h():
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize(device)
    return num_bytes / _best_seconds(h2d), num_bytes / _best_seconds(d2h)


def measure_link_rates(directory: str, device: torch.device, io_config=None, *, disk_bytes: int = 64 << 20,
                       compute_dtype: torch.dtype = torch.float32) -> LinkRates:
    """Measure every rate now (a few seconds): disk on `directory`, copies, Adam and matmul on `device`."""
    from ..config import IOConfig as SectionIO

    io_config = io_config or SectionIO()
    read, write = _measure_disk(directory, disk_bytes, io_config)
    cpu_adam = _measure_adam(torch.device("cpu"), 1 << 22)
    if device.type == "cuda":
        h2d, d2h = _measure_copies(device, 256 << 20)
        device_adam = _measure_adam(device, 1 << 24)
        flops = _measure_matmul(device, compute_dtype, 4096)
    else:
        h2d = d2h = math.inf
        device_adam = cpu_adam
        flops = _measure_matmul(device, torch.float32, 1024)
    when = time.strftime("%Y-%m-%d %H:%M")
    return LinkRates(nvme_read=read, nvme_write=write, h2d=h2d, d2h=d2h, cpu_adam=cpu_adam,
                     device_adam=device_adam, matmul_flops=flops, source=f"measured {when} on {directory}")


# ---------------------------------------------------------------- cache


def cache_path() -> Path:
    """~/.cache/infinity/link_rates.json, or under $INFINITY_CACHE_DIR / $XDG_CACHE_HOME."""
    if os.environ.get("INFINITY_CACHE_DIR"):
        root = Path(os.environ["INFINITY_CACHE_DIR"])
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "infinity"
    return root / "link_rates.json"


def _load_cache() -> dict:
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data.get("entries", {}) if data.get("version") == CACHE_VERSION else {}


def _store_cache(entries: dict) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=1))
        os.replace(tmp, path)  # atomic: concurrent ranks never read half a file
    except OSError:
        pass  # a read-only home only costs a re-measurement next time


def link_rates(directory: str | None = None, device: torch.device | None = None, *, remeasure: bool = False,
               io_config=None) -> LinkRates:
    """This machine's rates for swap files in `directory` (default: the temp dir): cached, else measured."""
    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                        else torch.device("cpu"))
    directory = directory or tempfile.gettempdir()
    cached = None if remeasure else cached_rates_for(directory, device)
    if cached is not None:
        return cached
    rates = measure_link_rates(directory, device, io_config)
    entries = _load_cache()
    entries[rates_key(directory, device)] = rates.to_json() | {"machine": _machine_key(device)}
    _store_cache(entries)
    return rates


def cached_rates_for(directory: str | None, device: torch.device) -> LinkRates | None:
    """The rates measured before for this machine and the disk of `directory` (default: the temp
    dir), or None. Never measures (`infinity bench-links --dir DIR` does)."""
    entry = _load_cache().get(rates_key(directory or tempfile.gettempdir(), device))
    return LinkRates.from_json(entry) if entry is not None else None


def profile_peaks(rates: LinkRates | None) -> dict[str, float]:
    """Decimal GB/s per profiler link (`Link` values) from measured rates, for the profile summary's
    achieved-vs-peak; {} without a measurement. The CPU optimizer's bytes are 16 per element (master,
    gradient and both moments, fp32), as its spans count them."""
    if rates is None or rates.source == "defaults":
        return {}
    peaks = {"nvme_read": rates.nvme_read / 1e9, "nvme_write": rates.nvme_write / 1e9,
             "cpu_optimizer": rates.cpu_adam * 16 / 1e9}
    peaks.update({k: getattr(rates, k) / 1e9 for k in ("h2d", "d2h") if math.isfinite(getattr(rates, k))})
    return peaks


def cached_link_rates(cuda: bool) -> LinkRates:
    """The most recently measured rates of this machine (any disk), else `default_rates`. Never measures."""
    machine = None
    if cuda and torch.cuda.is_available():
        machine = _machine_key(torch.device("cuda", torch.cuda.current_device()))
    elif not cuda:
        machine = _machine_key(torch.device("cpu"))
    mine = [e for e in _load_cache().values() if e.get("machine") == machine and "nvme_read" in e]
    if not mine:
        return default_rates(cuda)
    return LinkRates.from_json(max(mine, key=lambda e: e.get("source", "")))


def cached_measurement(name: str, measure, *, remeasure: bool = False):
    """A JSON-able value measured once per machine (and torch version) and kept in the same cache."""
    key = f"{_machine_key(torch.device('cpu'))}|torch {torch.__version__}|{name}"
    entries = _load_cache()
    if key in entries and not remeasure:
        return entries[key]["value"]
    value = measure()
    entries = _load_cache()
    entries[key] = {"value": value}
    _store_cache(entries)
    return value
