"""The narrow interface between IOEngine and where bytes live.

The engine splits a request into blocks (``split``), keeps at most queue_depth of them
handed to the backend (``submit``), and the backend reports each block's completion
through the ``complete`` callback given to ``start``. File management calls
(``preallocate``, ``remove``, ``free_bytes``, ``is_dir``) let SwapSpace run unchanged on
the in-memory backend.

Backends: ``ThreadBackend`` (real files, os.preadv/os.pwritev from a thread pool,
O_DIRECT), ``kernel_aio.AioBackend`` (ThreadBackend whose aligned direct blocks go through
Linux kernel AIO; the engine's default where available) and ``MemoryBackend`` (files in
RAM, injectable latency/reordering/failures).
"""

from .base import Backend, BlockOp, Complete, Direction, split_blocks
from .memory import FailRule, MemoryBackend, OpInfo
from .threads import ThreadBackend

__all__ = ["Backend", "BlockOp", "Complete", "Direction", "FailRule", "MemoryBackend", "OpInfo",
           "ThreadBackend", "split_blocks"]
