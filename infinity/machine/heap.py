"""What happens to the C heap's freed pages between optimizer steps (`[memory] release_heap`).

Note [heap release]: without a GPU, activations and unsharded units are ordinary CPU tensors from
the C library's malloc. glibc keeps the pages of freed chunks resident and, with its dynamic mmap
threshold, serves ever larger transients from its heaps, where tensors freed in a different order
each step (the validation forward under no_grad, the optimizer worker's and the I/O threads' own
arenas) leave holes: the default job (0.84M parameters, validation every 100 steps) measured a
peak RSS of 547-827 MiB over 300 steps against a predicted 474 MiB, and its RSS kept rising until
step ~300. `release_heap = true` calls glibc's malloc_trim(0) once per optimizer step, when the
step's activations have been freed and before the update is issued: every whole free page goes back
to the OS, the peak stays at one step's (the same run: 477-483 MiB), at the cost of faulting the
next step's transient pages in again (+11 s of system time over those 300 steps, about 15% of its
CPU time; with a GPU the transients are device memory and the cost is the host's few). Fixing the
mmap threshold at 128 KiB (MALLOC_MMAP_THRESHOLD_) bounds it as well but cost more (+17 s).

`infinity train` sets it (its peak is what `infinity estimate` predicts and what summary.json
reports); the engine's default keeps the pages (the fastest step on CPU). An engine's export
(`export_state_dict`, state/export.py) releases after each tensor it writes by the same policy: a
38M-parameter LoRA export kept 60-110 MiB of freed pages otherwise (2026-11-29). One type per choice:
`KeepHeap` does nothing, `TrimHeap` trims; `heap_policy` is the one place that picks.
"""

from __future__ import annotations

import ctypes

from infinity.config.sections import ConfigError


class KeepHeap:
    """The C library keeps its freed pages (`release_heap = false`)."""

    def release(self) -> None:
        pass


class TrimHeap:
    """glibc's malloc_trim(0) after each step (`release_heap = true`)."""

    def __init__(self, trim) -> None:
        self._trim = trim

    def release(self) -> None:
        self._trim(0)


def heap_policy(release: bool) -> KeepHeap | TrimHeap:
    """The policy for `[memory] release_heap`; a C library without malloc_trim cannot release."""
    if not release:
        return KeepHeap()
    trim = _malloc_trim()
    if trim is None:
        raise ConfigError("memory.release_heap = true needs glibc's malloc_trim, which this process's C library "
                          "does not have: set memory.release_heap = false")
    return TrimHeap(trim)


def _malloc_trim():
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim
