"""The run directory of `infinity train`: choosing and creating it, locking it while a job uses it,
removing what a failed start wrote, and the JSON files the job writes into it.

Note [run directory lock]: a job holds an exclusive `fcntl.flock` on `<run>/.lock` (which holds its
pid) from before it writes anything until it ends; the kernel drops the lock when the process dies,
so a crash never leaves a run locked. A second `infinity train` (or `--resume`) of the same run
directory is refused at once, naming the holder's pid, instead of two jobs writing the same
metrics and checkpoints. Under torchrun, rank 0 holds the lock for the job. Holding it, a resumed
job removes the swap files a killed job left in `<run>/swap` (they are never read again, and a few
kills would otherwise fill the disk with them).

Note [failed start]: until training begins, a new run's directory holds nothing the user needs;
a start that fails (a bad model, preflight, no space) removes the directory it created, so the
same run.name can be used again and `--resume` is never offered a run without a checkpoint.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import time
from pathlib import Path

from infinity.config.sections import ConfigError
from io_engine import atomic_write

LOCK = ".lock"  # <run>/.lock: the flock of the job using the run directory
SWAP = "swap"


def _json_default(value):
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "value"):  # enums (Tier, Kind)
        return value.value
    return repr(value)


def write_json(path: Path, data) -> None:
    """`data` as JSON, written whole or not at all (io_engine.atomic_write, Note [atomic write])."""
    atomic_write(path, json.dumps(data, indent=1, default=_json_default) + "\n")


class RunDir:
    """The run directory of this job, locked (rank 0) while the job uses it (Note [run directory lock])."""

    def __init__(self, path: Path, created: bool, fd: int | None, made_parent: bool = False):
        self.path, self.created, self._fd = path, created, fd
        self.made_parent = made_parent  # run.dir did not exist either: a failed start removes it too

    @classmethod
    def new(cls, parent: str, name: str) -> "RunDir":
        """A new run's directory: `name` under `parent` ("auto": the start time, with -2, -3, ... when another
        job took that name in the same second). Refused when it holds a run or another job uses it."""
        made_parent = not os.path.isdir(parent)
        os.makedirs(parent, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for attempt in range(1, 1000):
            path = Path(parent) / (name if name != "auto" else stamp if attempt == 1 else f"{stamp}-{attempt}")
            try:
                os.mkdir(path)  # atomic: of two jobs starting together, one gets each name
                created = True
            except FileExistsError:
                if name == "auto":
                    continue
                created = False
            run = cls(path, created, _lock(path), made_parent=made_parent)
            if not created and any(p.name not in (LOCK, SWAP) for p in path.iterdir()):
                run.release()
                raise ConfigError(f"run directory {path} already holds a run: choose another run.name, leave "
                                  f'run.name = "auto", or continue it with infinity train --resume {path}')
            return run
        raise ConfigError(f"{parent}: 999 runs started in the second {stamp}; set run.name")

    @classmethod
    def existing(cls, path: Path) -> "RunDir":
        """The directory of a run being resumed, locked; swap files a killed job left in its swap folder
        are removed (under the lock no live job uses them, and they would hold the disk's space)."""
        from infinity.machine.preflight import write_error
        if (e := write_error(path)) is not None:
            raise ConfigError(f"run directory {path} is not writable ({e.strerror}): a resumed run writes its "
                              f"config.toml, metrics and checkpoints there; make it writable (chmod u+w, or "
                              f"chattr -i), or train again into a new run: infinity train --config "
                              f"{path / 'config.toml'} --set run.name=<new name>")
        run = cls(path, False, _lock(path))
        swap = path / SWAP
        for stale in swap.glob("*.swp") if swap.is_dir() else ():
            stale.unlink(missing_ok=True)
        return run

    def discard(self) -> None:
        """Note [failed start]: remove what this job wrote into a directory it created."""
        if self.created:
            shutil.rmtree(self.path, ignore_errors=True)
            if self.made_parent:
                try:
                    os.rmdir(self.path.parent)  # only if empty: another job may have started beside us
                except OSError:
                    pass
        self.release()

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the flock
            self._fd = None


def _lock(path: Path) -> int:
    """Take the run directory's lock, or a ConfigError naming the job that holds it."""
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        raise _in_use(path) from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # names the holder in the refusal above
    except OSError:
        pass  # a full disk: the lock holds without the pid
    return fd


def _in_use(path: Path) -> ConfigError:
    try:
        holder = (path / LOCK).read_text().strip() or "?"
    except OSError:
        holder = "?"
    return ConfigError(f"run directory {path} is in use by another infinity train job (pid {holder}): wait for it "
                       f"to finish or stop it (kill {holder}), or choose another run.name")


def refuse_if_in_use(path: Path) -> None:
    """The lock's ConfigError if a live job holds `path` (a resume asks first: a live run that has saved no
    checkpoint yet is in use, not missing one); takes nothing."""
    try:
        fd = os.open(path / LOCK, os.O_RDONLY)
    except OSError:
        return  # no lock file: no job has used it since it was made
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise _in_use(path) from None
        raise
    finally:
        os.close(fd)
