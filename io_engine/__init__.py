"""io_engine: asynchronous file I/O of tensors (knows nothing about models).

    with IOEngine(IOConfig(block_size=1 << 20, queue_depth=32, threads=32)) as io:
        io.submit_write(tensor, path, offset).wait()
        io.submit_read(out, path, offset).wait()

SwapSpace manages preallocated, checksummed, striped swap files on top of an engine;
aligned_empty / AlignedBufferPool give page-aligned, locked (pinned with CUDA) buffers;
MemoryBackend replaces the disk in tests; parse_size / format_size are the project's one
meaning of size strings (Note [size strings]); atomic_write, fsync_file and drop_page_cache
the file helpers. Never imports `infinity`. Its names load on first use, so `io_engine.sizes` (the config's
size strings) does not import torch (Note [light package import] in infinity/__init__.py).
"""

from __future__ import annotations

import importlib

_HOMES = {"AlignedBufferPool": "aligned", "aligned_empty": "aligned", "cuda_host_register": "aligned",
          "cuda_host_unregister": "aligned", "size_class": "aligned", "FailRule": "backends", "MemoryBackend":
          "backends", "OpInfo": "backends", "ThreadBackend": "backends", "CHECKSUM_ALGORITHM": "checksums",
          "IOConfig": "engine", "IOEngine": "engine", "IOFuture": "engine", "RequestState": "engine",
          "ChecksumError": "errors", "IOEngineError": "errors", "atomic_write": "files", "drop_page_cache":
          "files", "fsync_file": "files", "SizeError": "sizes", "format_size": "sizes", "parse_size": "sizes",
          "DirectionStats": "stats", "IOStats": "stats", "Extent": "swap_space", "ExtentPart": "swap_space",
          "SwapSpace": "swap_space"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    """A public name, imported from its module on first use."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'io_engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
