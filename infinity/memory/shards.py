"""The manager's record of one shard: its chunks (their residency, NVMe extents, versions, the device copies using
their host bytes), its resident storage, and which link a copy crosses (memory/manager.py owns and moves them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from infinity.memory.parked import Parked
from infinity.memory.tier import Kind, Residency, Tier
from io_engine import Extent


@dataclass
class Chunk:
    start: int  # element offset within the shard (what the rank stores of this kind)
    numel: int
    state: Residency = Residency.ZERO
    extent: Extent | None = None  # NVMe only
    write: object = None  # the IOFuture of a write-back in flight (NVMe only)
    version: int = 0  # bumped by every store / mark_zero: a copy read earlier is current iff it matches
    device_use: object = None  # HOST only: the event of the last copy to or from the device of these bytes


@dataclass
class Shard:
    unit: int
    kind: Kind
    tier: Tier
    dtype: torch.dtype
    numel: int
    chunks: list[Chunk] = field(default_factory=list)
    resident: torch.Tensor | None = None  # DEVICE / HOST storage of the whole shard
    parked: "Parked | None" = None  # DEVICE shards while the engine is offloaded (Note [offloaded states])

    def span(self, chunk: "int | range | None") -> tuple[int, int]:
        """(start, numel) within the shard of one chunk, a run of chunks, or the whole shard (None)."""
        ids = self.chunk_ids(chunk)
        if chunk is None or not ids:
            return (0, self.numel) if chunk is None else (0, 0)
        return self.chunks[ids[0]].start, sum(self.chunks[i].numel for i in ids)

    def chunk_ids(self, chunk: "int | range | None") -> range:
        if isinstance(chunk, range):
            return chunk
        return range(len(self.chunks)) if chunk is None else range(chunk, chunk + 1)


def crossing(src: torch.device, dst: torch.device) -> str | None:
    """The link a copy from `src` to `dst` crosses: "h2d", "d2h", or None (same memory)."""
    return None if (src.type == "cpu") == (dst.type == "cpu") else ("h2d" if src.type == "cpu" else "d2h")
