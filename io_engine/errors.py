"""Errors raised by io_engine, and the translation of raw OS errors into
messages that name the file, the byte range and what to change."""

from __future__ import annotations

import errno as _errno
import os


class IOEngineError(OSError):
    """An I/O request failed. Subclass of OSError so ``except OSError`` still works.

    Attributes: ``errno``, ``path``, ``offset``, ``num_bytes``, ``direction``
    ("read" / "write"); any of them may be None when unknown.
    """

    def __init__(self, message: str, *, errno: int | None = None, path: str | None = None,
                 offset: int | None = None, num_bytes: int | None = None,
                 direction: str | None = None):
        if errno is not None:
            super().__init__(errno, message)
        else:
            super().__init__(message)
        self.message = message
        self.path = path
        self.offset = offset
        self.num_bytes = num_bytes
        self.direction = direction

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        return (_rebuild, (type(self), self.message, self.errno, self.path, self.offset,
                           self.num_bytes, self.direction))


def _rebuild(cls, message, errno, path, offset, num_bytes, direction):
    return cls(message, errno=errno, path=path, offset=offset, num_bytes=num_bytes,
               direction=direction)


class ChecksumError(IOEngineError):
    """Bytes read back do not match the checksum recorded when they were written."""


class ShortRead(Exception):
    """Raised by a backend when the file ends before the requested range does.

    Internal: the engine turns it into an IOEngineError with the request's context.
    """

    def __init__(self, file_size: int, needed_end: int):
        super().__init__(f"file is {file_size} bytes, read needs up to byte {needed_end}")
        self.file_size = file_size
        self.needed_end = needed_end


_DISK_FULL = (_errno.ENOSPC, _errno.EDQUOT, _errno.EFBIG)
_NOT_WRITABLE = (_errno.EROFS, _errno.EACCES, _errno.EPERM)


def _where(direction: str, path: str, offset: int, num_bytes: int) -> str:
    verb = "reading" if direction == "read" else "writing"
    return f"{verb} {num_bytes} bytes at offset {offset} of {path}"


def describe_failure(exc: BaseException, *, direction: str, path: str, offset: int,
                     num_bytes: int, context: str = "") -> IOEngineError:
    """Turn whatever a backend raised into an IOEngineError with context and a fix.

    ``offset``/``num_bytes`` describe the failing block; ``context`` (e.g. the whole
    request's range) is appended to the location.
    """
    if isinstance(exc, IOEngineError):
        return exc
    where = _where(direction, path, offset, num_bytes) + context
    if isinstance(exc, ShortRead):
        msg = (f"short read: {where}: the file is only {exc.file_size} bytes but the read needs "
               f"bytes up to {exc.needed_end}. The file was truncated or never written that far "
               f"(check that no other process touches it and that the write before this read "
               f"completed); the data of this range is lost.")
        return IOEngineError(msg, errno=_errno.EIO, path=path, offset=offset,
                             num_bytes=num_bytes, direction=direction)
    if not isinstance(exc, OSError):
        msg = f"internal error while {where}: {type(exc).__name__}: {exc}"
        return IOEngineError(msg, path=path, offset=offset, num_bytes=num_bytes,
                             direction=direction)
    code = exc.errno
    reason = os.strerror(code) if code else str(exc)
    if code in _DISK_FULL:
        hint = (f"the filesystem holding {os.path.dirname(path) or '.'} is full: free space there, "
                f"point the [nvme] paths at a larger disk, or place less state on NVMe")
    elif code == _errno.ENOENT:
        hint = ("the file or its directory does not exist: create the directory (or fix the "
                "[nvme] paths), and check that no other process removed the file")
    elif code in _NOT_WRITABLE:
        hint = ("the location is not writable (read-only mount or permissions): point the "
                "[nvme] paths at a writable directory")
    elif code == _errno.EINVAL:
        hint = ("the kernel rejected the request (direct-I/O alignment?): set [io] direct = false "
                "as a workaround and report this")
    elif code == _errno.EIO:
        hint = "the device reported an I/O error: check `dmesg` and the disk's health"
    elif code == _errno.EBADF:
        hint = "the file was closed underneath the request: do not close the engine while I/O is in flight"
    else:
        hint = "check the file and the disk"
    msg = f"{reason} (errno {code}) while {where}: {hint}."
    err = IOEngineError(msg, errno=code, path=path, offset=offset, num_bytes=num_bytes,
                        direction=direction)
    err.__cause__ = exc
    return err
