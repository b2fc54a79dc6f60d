"""Block checksums of io_engine: CRC-32C of every byte, or of a sample.

Note [sampled checksum]: a CRC-32C of every byte is a pass over memory the disk just
filled, on cores the compute needs (its cost on a 2-vCPU machine:
benchmarks/history/step-pass-12.md). "sampled" checksums SAMPLE_PIECES pieces of
SAMPLE_BYTES spread from a block's first byte to its last (64 KiB of 1 MiB): swap is per-run scratch, and
what goes wrong with it is a whole block misplaced (a wrong offset), stale (a lost
write: the previous contents read back, and the optimizer changes every element every
step) or cut short, which any piece catches; a flip outside the sample is left to the
drive's own ECC. "full" remains for those who want every byte covered. Blocks no larger
than twice the sample are checksummed whole either way. Checkpoints are always checked
whole (infinity/state/checkpoint.py).
"""

from __future__ import annotations

import zlib

try:  # Note [checksum]: crc32c (~10 GB/s) when installed, else zlib.crc32 (~2 GB/s per core)
    from crc32c import crc32c as _fast_crc
    CHECKSUM_ALGORITHM = "crc32c"
except ImportError:  # pragma: no cover - depends on the environment
    _fast_crc = zlib.crc32
    CHECKSUM_ALGORITHM = "zlib.crc32"


def checksum(data) -> int:
    """Checksum of a bytes-like object (releases the GIL on large buffers)."""
    return _fast_crc(data)


CHECKSUM_MODES = ("full", "sampled", "off")
SAMPLE_PIECES, SAMPLE_BYTES = 8, 8192  # Note [sampled checksum]: 64 KiB of a 1 MiB block


def sampled_checksum(data) -> int:
    """CRC-32C of SAMPLE_PIECES pieces of SAMPLE_BYTES spread evenly over a block, the first
    at its start and the last at its end; the whole block when it is not larger than twice
    the sample. Note [sampled checksum]."""
    mem = memoryview(data).cast("B")
    n = len(mem)
    if n <= 2 * SAMPLE_PIECES * SAMPLE_BYTES:
        return _fast_crc(mem)
    crc = 0
    for k in range(SAMPLE_PIECES):
        start = k * (n - SAMPLE_BYTES) // (SAMPLE_PIECES - 1)
        crc = _fast_crc(mem[start:start + SAMPLE_BYTES], crc)
    return crc


def checksum_mode(value: bool | str | None) -> str:
    """A checksum setting as one of CHECKSUM_MODES: True is "full", False and None "off"."""
    if value is None or value is False:
        return "off"
    if value is True:
        return "full"
    if value not in CHECKSUM_MODES:
        raise ValueError(f"checksum must be one of {' | '.join(CHECKSUM_MODES)} (or true / false), "
                         f"got {value!r}")
    return value
