"""Helpers shared by the benchmarks: machine description, peak RSS, JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import psutil
import torch


def bpe_tokenizer(texts, vocab_size: int = 300):
    """A byte-level BPE tokenizer trained here on `texts` (no download), EOS and padding "</s>"."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="</s>")


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
    """Peak resident set size of this process so far: infinity's one measure (Note [peak RSS of a spawned
    process] in infinity/job/progress.py: not ru_maxrss, which a spawned child inherits from its parent)."""
    from infinity.job.progress import peak_rss_bytes as peak
    return peak()


class DiskCounters:
    """The kernel's I/O counters of the block device holding a path (Linux /sys/dev/block/M:m/stat).

    `snapshot()` reads them; `between(a, b)` turns two snapshots into what the device did
    meanwhile: busy fraction (time with at least one request in flight, the kernel's
    io_ticks), bytes and GB/s each way over the wall time, and the mean number of requests
    in flight (time_in_queue). The counters are the whole device's: on a shared disk they
    include other processes' I/O. `reason` says why there are none (not Linux, a path on
    tmpfs or overlay with no block device behind it).
    """

    SECTOR = 512  # the stat file counts 512-byte sectors whatever the device's block size

    def __init__(self, path: str):
        self.stat_file, self.reason = None, None
        st = os.stat(path)
        candidate = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat"
        if os.path.exists(candidate):
            self.stat_file = candidate
            self.device = os.path.basename(os.path.dirname(os.path.realpath(candidate)))
        else:
            self.reason = f"no block device counters for {path} ({candidate} does not exist)"

    def snapshot(self) -> tuple[float, list[int]] | None:
        if self.stat_file is None:
            return None
        with open(self.stat_file) as f:
            return time.perf_counter(), [int(x) for x in f.read().split()]

    def between(self, a, b) -> dict:
        if a is None or b is None:
            return {"error": self.reason}
        wall = b[0] - a[0]
        d = [y - x for x, y in zip(a[1], b[1])]
        read, written = d[2] * self.SECTOR, d[6] * self.SECTOR
        return {"device": self.device, "wall_s": round(wall, 3), "busy_fraction": round(d[9] / 1e3 / wall, 3),
                "read_GB": round(read / 1e9, 3), "write_GB": round(written / 1e9, 3),
                "read_GBps": round(read / 1e9 / wall, 3), "write_GBps": round(written / 1e9 / wall, 3),
                "mean_in_flight": round(d[10] / 1e3 / wall, 1)}


def median(values):
    return statistics.median(values) if values else None


def write_json(path: str | None, payload: dict) -> None:
    text = json.dumps(payload, indent=2, default=str)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
