"""io_engine: asynchronous file I/O of tensors (knows nothing about models).

    with IOEngine(IOConfig(block_size=1 << 20, queue_depth=32, threads=32)) as io:
        io.submit_write(tensor, path, offset).wait()
        io.submit_read(out, path, offset).wait()

SwapSpace manages preallocated, checksummed, striped swap files on top of an engine;
aligned_empty / AlignedBufferPool give page-aligned, locked (pinned with CUDA) buffers;
MemoryBackend replaces the disk in tests; parse_size / format_size are the project's one
meaning of size strings (Note [size strings]); atomic_write, fsync_file and drop_page_cache
the file helpers. Never imports `infinity`.
"""

from .aligned import AlignedBufferPool, aligned_empty, cuda_host_register, cuda_host_unregister, size_class
from .backends import FailRule, MemoryBackend, OpInfo, ThreadBackend
from .checksums import CHECKSUM_ALGORITHM
from .engine import IOConfig, IOEngine, IOFuture, RequestState
from .errors import ChecksumError, IOEngineError
from .files import atomic_write, drop_page_cache, fsync_file
from .sizes import SizeError, format_size, parse_size
from .stats import DirectionStats, IOStats
from .swap_space import Extent, ExtentPart, SwapSpace

__all__ = ["AlignedBufferPool", "CHECKSUM_ALGORITHM", "ChecksumError", "DirectionStats", "Extent",
           "ExtentPart", "FailRule", "IOConfig", "IOEngine", "IOEngineError", "IOFuture",
           "IOStats", "MemoryBackend", "OpInfo", "RequestState", "SwapSpace", "ThreadBackend",
           "SizeError", "aligned_empty",
           "cuda_host_register", "cuda_host_unregister", "atomic_write", "drop_page_cache", "format_size",
           "fsync_file", "parse_size",
           "size_class"]
