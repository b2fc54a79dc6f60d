"""io_engine: asynchronous file I/O of tensors (knows nothing about models).

    with IOEngine(IOConfig(block_size=1 << 20, queue_depth=32, threads=32)) as io:
        io.submit_write(tensor, path, offset).wait()
        io.submit_read(out, path, offset).wait()

SwapSpace manages preallocated, checksummed, striped swap files on top of an engine;
aligned_empty / AlignedBufferPool give page-aligned, locked (pinned with CUDA) buffers;
MemoryBackend replaces the disk in tests. Never imports `infinity`.
"""

from .aligned import AlignedBufferPool, aligned_empty, size_class
from .backends import FailRule, MemoryBackend, OpInfo, ThreadBackend
from .engine import CHECKSUM_ALGORITHM, IOConfig, IOEngine, IOFuture, RequestState, parse_size
from .errors import ChecksumError, IOEngineError
from .stats import DirectionStats, IOStats
from .swap_space import Extent, ExtentPart, SwapSpace

__all__ = ["AlignedBufferPool", "CHECKSUM_ALGORITHM", "ChecksumError", "DirectionStats", "Extent",
           "ExtentPart", "FailRule", "IOConfig", "IOEngine", "IOEngineError", "IOFuture",
           "IOStats", "MemoryBackend", "OpInfo", "RequestState", "SwapSpace", "ThreadBackend",
           "aligned_empty", "parse_size", "size_class"]
