"""This machine's link rates: measured once per machine and disk, cached under ~/.cache/infinity.

The planner and the cost model (infinity/memory/) only compute with the rates they
are given; the caller decides whether to measure (`link_rates`, a few seconds the
first time), to read what was measured before (`cached_link_rates`,
`cached_rates_for`) or to take `cost_model.default_rates`. The cache is
~/.cache/infinity/link_rates.json (or under `$INFINITY_CACHE_DIR` /
`$XDG_CACHE_HOME`), keyed by host, CPU count, GPU and the swap disk's device;
`infinity bench-links --remeasure` measures again. See cost_model for what each
rate means.
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import tempfile
import time
from pathlib import Path

import torch

from infinity.config.sections import Config, SwapIOConfig
from infinity.memory.cost_model import LinkRates, default_rates
from io_engine import IOEngine, aligned_empty, atomic_write, drop_page_cache, fsync_file

CACHE_VERSION = 2  # (2: the elementwise rate, memory_bw)


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


def _measure_elementwise(device: torch.device, numel: int) -> float:
    """Bytes/s an elementwise operation reads and writes on `device` (an fp32 add: two read, one written)."""
    a, b, out = (torch.rand(numel, device=device) for _ in range(3))

    def run():
        torch.add(a, b, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return 3 * 4 * numel / _best_seconds(run)


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
    io_config = io_config or SwapIOConfig()
    read, write = _measure_disk(directory, disk_bytes, io_config)
    cpu_adam = _measure_adam(torch.device("cpu"), 1 << 22)
    if device.type == "cuda":
        h2d, d2h = _measure_copies(device, 256 << 20)
        device_adam = _measure_adam(device, 1 << 24)
        flops = _measure_matmul(device, compute_dtype, 4096)
        memory_bw = _measure_elementwise(device, 1 << 26)
    else:
        h2d = d2h = math.inf
        device_adam = cpu_adam
        flops = _measure_matmul(device, torch.float32, 1024)
        memory_bw = _measure_elementwise(device, 1 << 23)
    when = time.strftime("%Y-%m-%d %H:%M")
    return LinkRates(nvme_read=read, nvme_write=write, h2d=h2d, d2h=d2h, cpu_adam=cpu_adam,
                     device_adam=device_adam, matmul_flops=flops, memory_bw=memory_bw,
                     source=f"measured {when} on {directory}")


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
        atomic_write(path, json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=1))  # ranks share it
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
    store_rates(directory, device, rates)
    return rates


def store_rates(directory: str, device: torch.device, rates: LinkRates) -> None:
    """Cache `rates` as this machine's for the disk of `directory` (what `link_rates` measured)."""
    entries = _load_cache()
    entries[rates_key(directory, device)] = rates.to_json() | {"machine": _machine_key(device)}
    _store_cache(entries)


def cached_rates_for(directory: str | None, device: torch.device) -> LinkRates | None:
    """The rates measured before for this machine and the disk of `directory` (default: the temp
    dir), or None. Never measures (`infinity bench-links --dir DIR` does)."""
    entry = _load_cache().get(rates_key(directory or tempfile.gettempdir(), device))
    return LinkRates.from_json(entry) if entry is not None else None


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


def cached_measurement(name: str, measure, *, remeasure: bool = False, of_code: bool = False):
    """A JSON-able value measured once per machine (and torch version) and kept in the same cache; `of_code`: a
    value that depends on infinity's own code too (what a run imports), measured again when that code changes."""
    key = f"{_machine_key(torch.device('cpu'))}|torch {torch.__version__}|{name}"
    if of_code:
        key += f"|code {_code_fingerprint()}"
    entries = _load_cache()
    if key in entries and not remeasure:
        return entries[key]["value"]
    value = measure()
    entries = _load_cache()
    entries[key] = {"value": value}
    _store_cache(entries)
    return value


def _code_fingerprint() -> str:
    """infinity's source files as installed (names, sizes, modification times): a stat of each, no reads."""
    import hashlib
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha1()
    for folder, _dirs, files in sorted(os.walk(root)):
        for name in sorted(f for f in files if f.endswith(".py")):
            st = os.stat(os.path.join(folder, name))
            digest.update(f"{os.path.relpath(os.path.join(folder, name), root)}:{st.st_size}:{st.st_mtime_ns};"
                          .encode())
    return digest.hexdigest()[:16]


def rates_for_plan(config: Config, device: torch.device, *, measure: bool) -> LinkRates:
    """The rates a plan of `config` is made with on this machine: with `measure` and swap paths set, the
    swap disk's (measured now unless cached); else this machine's cached measurement, else the defaults."""
    if measure and config.nvme.paths:
        return link_rates(config.nvme.paths[0], device, io_config=config.io)
    return cached_link_rates(device.type == "cuda")


def link_peaks(config: Config, device: torch.device) -> dict[str, float]:
    """The profile's per-link peaks: the link rates measured on this machine and swap disk (cached by
    `infinity bench-links --dir DIR` or the auto policy); none measured = no achieved-vs-peak."""
    from infinity.memory import cost_model
    paths = config.nvme.paths
    if paths and not os.path.isdir(paths[0]):
        return {}  # the plan's preflight names the missing directory
    return cost_model.profile_peaks(cached_rates_for(paths[0] if paths else None, device))
