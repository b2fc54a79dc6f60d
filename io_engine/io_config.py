"""IOConfig: how an IOEngine moves bytes (validated on construction; imports no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from .checksums import checksum_mode
from .sizes import SizeError, parse_size


@dataclass(frozen=True, kw_only=True)
class IOConfig:
    """How the engine moves bytes. Sizes accept ints or strings like "1MiB"."""

    block_size: int = 1 << 20
    """Bytes per block request; a multiple of 4096. Larger blocks mean fewer syscalls."""
    queue_depth: int = 16
    """Blocks handed to the backend at once (the rest wait in the engine's FIFO)."""
    threads: int = 8
    """Worker threads issuing syscalls. With backend "threads" they carry every block (blocks
    on the device at once = min(threads, queue_depth)); with "aio" only the blocks kernel AIO
    does not take (unaligned heads and tails, buffered files)."""
    backend: str = "auto"
    """"aio": Linux kernel AIO for aligned direct blocks, all queue_depth on the device at once
    (Note [kernel aio]); "threads": preadv/pwritev from the worker threads; "auto": aio
    where the kernel offers it, else threads."""
    direct: bool = True
    """O_DIRECT where the filesystem allows (bypasses the page cache); else buffered."""
    checksum: str = "sampled"
    """Checksum swap extents on write, verify on read (SwapSpace follows this by default):
    "full" (CRC-32C of every byte), "sampled" (of 64 KiB spread over each block: Note
    [sampled checksum]) or "off"; True / False mean "full" / "off"."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "block_size", parse_size(self.block_size, "IOConfig.block_size"))
        except SizeError as e:
            raise ValueError(str(e)) from None
        bs = self.block_size
        if bs < 4096 or bs % 4096 or bs > (1 << 30):
            raise ValueError(f"IOConfig.block_size must be a multiple of 4096 between 4KiB and "
                             f"1GiB, got {bs}: try 1MiB")
        for name, hi in (("queue_depth", 4096), ("threads", 1024)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
                raise ValueError(f"IOConfig.{name} must be an int in [1, {hi}], got {v!r}")
        if self.threads > self.queue_depth:
            raise ValueError(f"IOConfig.threads ({self.threads}) > queue_depth "
                             f"({self.queue_depth}): at most queue_depth blocks are in flight, so "
                             f"the extra threads would idle; raise queue_depth or lower threads")
        if self.backend not in BACKENDS:
            raise ValueError(f"IOConfig.backend must be one of {' | '.join(BACKENDS)}, got "
                             f"{self.backend!r}")
        if not isinstance(self.direct, bool):
            raise ValueError(f"IOConfig.direct must be true or false, got {self.direct!r}")
        try:
            object.__setattr__(self, "checksum", checksum_mode(self.checksum))
        except ValueError as e:
            raise ValueError(f"IOConfig.{e}") from None


BACKENDS = ("auto", "aio", "threads")
