"""Small file operations every layer needs: durable writes and cold reads.

Note [atomic write]: `atomic_write` writes a temporary file beside the target,
fsyncs it, renames it over the target and fsyncs the directory, so a reader (or
a machine that loses power) sees the old contents or the new, never a part. The
temporary name carries the pid, so concurrent writers (ranks sharing a cache
file) never write into one temporary file; the last rename wins.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_file(path: str | os.PathLike) -> None:
    """Flush `path`'s written data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_page_cache(path: str | os.PathLike) -> None:
    """Flush the file and drop its cached pages, so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or creation inside directory `path` durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, data: str | bytes) -> None:
    """Replace `path`'s contents with `data` (str: UTF-8) atomically and durably (Note [atomic write])."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    payload = data.encode() if isinstance(data, str) else data
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


__all__ = ["atomic_write", "drop_page_cache", "fsync_dir", "fsync_file"]
