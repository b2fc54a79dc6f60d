"""The interface every backend implements: Direction, BlockOp, Backend, split_blocks."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable


class Direction(str, enum.Enum):
    """Which way bytes move: file -> memory (READ) or memory -> file (WRITE)."""

    READ = "read"
    WRITE = "write"


@dataclass(eq=False)
class BlockOp:
    """One block of a request: ``mem`` (a memoryview of the tensor's bytes) <-> the file
    range [file_offset, file_offset + len(mem)).

    ``addr`` is the address of mem[0]. ``pad_tail``: the bytes after the block's end up to
    the next direct-I/O alignment boundary belong to the same owner (a swap extent), so
    the backend may read/write them whole (through a bounce buffer) instead of treating the
    tail as a partial block. ``request`` and ``index`` are the engine's bookkeeping.
    """

    direction: Direction
    handle: Any
    file_offset: int
    mem: memoryview
    addr: int
    pad_tail: bool
    request: Any
    index: int


Complete = Callable[[BlockOp, "BaseException | None"], None]


class Backend(ABC):
    """Where blocks are executed. Implementations must be thread-safe."""

    @abstractmethod
    def start(self, complete: Complete) -> None:
        """Start workers; each finished block is reported with ``complete(op, error)``."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop workers after the blocks already submitted have completed."""

    @abstractmethod
    def open(self, path: str, direction: Direction, create: bool) -> Any:
        """Open ``path`` for one request; raises OSError (missing file/dir, read-only...)."""

    @abstractmethod
    def close_handle(self, handle: Any) -> None:
        """Release what ``open`` acquired; called once, when the request completed."""

    @abstractmethod
    def split(self, handle: Any, offset: int, num_bytes: int, block_size: int,
              pad_tail: bool) -> list[tuple[int, int]]:
        """Cut [offset, offset + num_bytes) into (file_offset, length) blocks of at most
        block_size bytes. Must be deterministic: a write and a later read of the same range
        give the same blocks (per-block checksums depend on it)."""

    @abstractmethod
    def submit(self, op: BlockOp) -> None:
        """Start ``op`` asynchronously; never blocks on I/O."""

    @abstractmethod
    def preallocate(self, path: str, num_bytes: int, create: bool) -> None:
        """Make ``path`` at least ``num_bytes`` long with the space reserved (posix_fallocate).
        ``create``: create it exclusively (fails if it exists). Raises OSError (ENOSPC...)."""

    @abstractmethod
    def remove(self, path: str) -> None:
        """Delete the file ``path`` (no error if already gone)."""

    @abstractmethod
    def free_bytes(self, directory: str) -> int | None:
        """Bytes available to this process in ``directory``'s filesystem (None if unknown)."""

    @abstractmethod
    def is_dir(self, directory: str) -> bool:
        """Whether ``directory`` exists as a directory."""


def split_blocks(offset: int, num_bytes: int, block_size: int,
                 first_boundary: int | None = None) -> list[tuple[int, int]]:
    """(file_offset, length) pieces of at most block_size; an optional first cut at
    ``first_boundary`` (so the rest start aligned)."""
    end = offset + num_bytes
    blocks = []
    pos = offset
    if first_boundary is not None and offset < first_boundary < end:
        blocks.append((offset, first_boundary - offset))
        pos = first_boundary
    while pos < end:
        length = min(block_size, end - pos)
        blocks.append((pos, length))
        pos += length
    return blocks
