"""A device shard's bytes while the engine is offloaded: a host copy, or NVMe extents.

Note [offloaded states]: `engine.offload_states()` (runtime/colocate.py) empties the device for an
inference engine that shares it (RL post-training: rollouts between updates). Every DEVICE shard is
*parked*: its bytes are copied to a host tensor (page-aligned, pinned with CUDA) or written to NVMe
extents, and its device storage is resized to zero bytes, as a unit's unsharded buffer is resharded. The
shard's tensor object stays, so everything that views it (the parameters of a unit aliased to its stored
shard) sees the same bytes again once `unpark` has resized it back and copied them in. A shard whose
chunks are all ZERO (gradients between windows; moments before the first update) parks as nothing: its
chunks stay ZERO and read as zeros after, so no bytes move either way. The plan is not changed: a parked
shard is still a DEVICE shard (the update and the fetches find it where the plan put it once reloaded);
`memory_report()` counts its bytes on the tier they are parked on, and the byte model's
`offloaded_state_bytes` (traffic.py) predicts the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infinity.device.streams import Streams, host_wait
from infinity.memory.tier import Tier
from io_engine import Extent, SwapSpace, aligned_empty


@dataclass
class Parked:
    """Where a parked shard's bytes are: `host` (HOST), `extent` (NVME), or neither (all zero)."""

    tier: Tier
    nbytes: int = 0
    host: torch.Tensor | None = None
    extent: Extent | None = None
    copied: object = None  # HOST: the event of the copy from the device (non-blocking offload)

    def restore(self, resident: torch.Tensor, streams: Streams, swap: SwapSpace | None) -> list:
        """Issue the copy of the parked bytes into `resident` (its storage already resized back); returns the
        events the caller waits for before the host bytes may go (none when nothing was parked)."""
        if self.nbytes == 0:
            return []
        host = self.host
        if self.extent is not None:
            host = aligned_empty(resident.numel(), resident.dtype, pin=streams.is_cuda, lock=False)
            swap.read(self.extent, host).wait()  # the copy to the device reads these bytes next
            swap.free(self.extent)
        elif self.copied is not None:
            streams.wait_event(self.copied, streams.h2d)  # a non-blocking offload's copy must have landed
        streams.wait_event(streams.record(), streams.h2d)  # the storage was allocated on the compute stream
        with streams.use(streams.h2d):
            resident.copy_(host, non_blocking=streams.is_cuda)
            done = streams.record(streams.h2d)
        streams.wait_event(done)  # compute reads the shard only after its bytes are back (on the device)
        streams.hold(resident, streams.h2d)
        self.host, self.extent = None, None
        return [(done, host)]


def park_bytes(resident: torch.Tensor | None, tier: Tier, streams: Streams, swap: SwapSpace | None, pin: bool,
               *, non_blocking: bool = False) -> Parked:
    """Copy a device shard's bytes (None: all zero, nothing to keep) to `tier`; the caller frees the device
    storage after. `non_blocking` (HOST only): return once the copy is issued; `restore` orders after it."""
    if resident is None:
        return Parked(tier)
    nbytes = resident.numel() * resident.element_size()
    host = aligned_empty(resident.numel(), resident.dtype, pin=pin, lock=False)
    streams.wait_event(streams.record(), streams.d2h)  # the copy must see compute's last writes to the shard
    with streams.use(streams.d2h):
        host.copy_(resident, non_blocking=streams.is_cuda)
        done = streams.record(streams.d2h)
    if tier is Tier.HOST:
        if not non_blocking:
            host_wait(done, "offload to host")  # the caller asked for the bytes to be on the host on return
            done = None
        return Parked(tier, nbytes, host=host, copied=done)
    assert tier is Tier.NVME and swap is not None, f"park on {tier} without a swap space"
    host_wait(done, "offload to NVMe")  # the disk write reads the host copy next
    extent = swap.allocate(nbytes)
    swap.write(extent, host).wait()  # the host copy goes once the disk has its bytes
    return Parked(tier, nbytes, extent=extent)
