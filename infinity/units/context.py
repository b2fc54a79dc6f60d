"""The context a unit runs in: the process group, the compute device and its streams, the profiler, the pool of
unsharded buffers, the ZeRO stage and the chunk size. One per engine (or per estimate), shared by its units."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infinity.device.streams import Streams
from infinity.memory.buffers import UnshardedMemory
from infinity.memory.stages import Stage, stage_for


@dataclass(frozen=True)
class UnitContext:
    """What a unit needs to know of the process group, the device, the profiler and the stage."""

    group: object  # None for a single process
    rank: int
    world_size: int
    device: torch.device
    compute_dtype: torch.dtype
    streams: Streams
    profiler: object = None  # infinity.profile.Profiler or NullProfiler
    unsharded: UnshardedMemory = UnshardedMemory()  # the bytes of unsharded buffers (Note [unsharded memory])
    stage: Stage = stage_for(3)  # what each rank stores of each kind, and the collectives (memory/stages.py)
    sub_group_size: int = 8_388_608  # [optimizer] sub_group_size: the chunks of every stored kind
