"""The `[prefetch]` and `[overlap]` sections: what runs beside the training thread (the parameter prefetch, the
optimizer worker, its read-ahead, speculation and device lane). The update mode these settings select is chosen
in update_mode.py."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

from infinity.config.options import ConfigError, Section, option


@dataclass(frozen=True, kw_only=True)
class PrefetchConfig(Section):
    """How far ahead parameters are fetched."""

    SECTION: ClassVar[str] = "prefetch"

    units_ahead: int = option(2, "Units fetched ahead of the one computing (0 = fetch on demand).", "int", ge=0)
    max_bytes_in_flight: int = option(4 * 2**30, "Cap on bytes of prefetched, not yet used units.", "size",
                                       gt=0, example="4GiB")
    keep_written: bool = option(True, "Parameters on NVMe that the update writes stay in host memory (up to "
                                 "units_ahead + 1 units) until the next forward fetches them, instead of being "
                                 "read back from disk (Note [fresh parameters]).", "bool")


@dataclass(frozen=True, kw_only=True)
class OverlapConfig(Section):
    """What runs concurrently."""

    SECTION: ClassVar[str] = "overlap"

    optimizer_with_backward: bool = option(True, "Run the optimizer on a worker thread, overlapped with compute: "
                                            "without clipping or fp16, each unit is updated as soon as its "
                                            "gradients are final, while backward continues; with them, after "
                                            "the global norm, in the next forward's order (each unit's forward "
                                            "waits only for its own update). Exactly the non-overlapped result "
                                            "either way.", "bool")
    optimizer_read_ahead: int | str = option(
        "auto", "Bytes of NVMe optimizer state the worker may read ahead of the next update, while forward and "
        "backward run (Note [state read-ahead]): a size, 0 for none, or \"auto\": all of this rank's NVMe "
        "optimizer state if it fits in half the host memory the plan leaves free, else that half. Held in "
        "page-locked staging buffers; needs optimizer_with_backward.", "size_or_auto", ge=0, example="8GiB")
    optimizer_threads: int | str = option(
        "auto", "Intra-op threads of the optimizer worker's CPU Adam and copies (Note [thread budget]): a count, or "
        "\"auto\": without a GPU torch's own count (every core), as the training thread has; with a GPU one fewer, "
        "the core left to the training thread that launches the kernels. The two threads share the cores: fewer "
        "for the worker leaves more to the training thread.", "int_or_auto", ge=1, example=1)
    optimizer_cores: str = option(
        "auto", "Core binding of the optimizer worker (Note [core binding]): \"bind\" pins the worker and the "
        "intra-op threads it starts to this rank's share of the process's cores (split by LOCAL_RANK), less one "
        "core left to the training thread, which stays unbound (as do data loader processes); \"none\": no "
        "binding; \"auto\": no binding either, as measured (on an H100 machine bound was slower for a 1.12B "
        "Llama, 1.22-1.27x, and no faster for case b; on the 2-core development machine \"bind\" was 1.02-1.27x "
        "faster: docs/tiers.md). With a binding, optimizer_threads = \"auto\" is one thread per bound core.",
        "enum", choices=("auto", "bind", "none"))
    speculation: int | str = option(
        "auto", "Host memory for the pre-update copies that keep updates during backward when the update depends "
        "on the global gradient norm (optimizer.grad_clip > 0 or train.on_nonfinite = \"skip\"; not with fp16 "
        "loss scaling): each unit is updated as soon as its gradients are final, as if the clip will not fire, "
        "and put back from its copy and updated again if it does (Note [speculative update]). A size speculates "
        "every window, with copies of as many units as it holds; 0 or \"auto\": none, the update waits for the "
        "norm (Note [speculation default]: on an H100 speculating cost 2.1-2.5x the unclipped step even when the "
        "clip never fired, waiting 1.1-1.3x). Units whose optimizer runs on a GPU, or whose parameters or "
        "optimizer state are on NVMe, are not speculated; needs optimizer_with_backward.",
        "size_or_auto", ge=0, example="4GiB")
    device_lane: str = option(
        "off", "Where the optimizer worker updates the units (optimizer_with_backward; not a speculated update): "
        "\"on\" lets a second worker update on the GPU the host-state units the next forward uses last, their "
        "state copied up and back over PCIe, while the CPU's worker updates the forward's first units; the two take "
        "units from either end of the forward's order until they meet (Note [device lane]). It pays where the "
        "CPU's Adam paces the step: the update waiting for the global norm (clipping), or no tail units. "
        "Costs the device memory of two units' state and gradients; needs a GPU, optimizer_with_backward, and "
        "gradients and optimizer state on the host tier. Which units the GPU takes depends on timing, and its Adam "
        "differs from the CPU's by a few ulps, so runs with it are not bitwise reproducible on a GPU. \"off\" "
        "(the default until measured on a GPU): the CPU updates every host-state unit.", "enum",
        choices=("off", "on"))

    def _check(self) -> None:
        if self.optimizer_cores == "bind" and not hasattr(os, "sched_setaffinity"):
            raise ConfigError("overlap.optimizer_cores = \"bind\": this platform cannot bind a thread to cores "
                              "(Python has no os.sched_setaffinity here); set it to \"auto\" or \"none\"")
