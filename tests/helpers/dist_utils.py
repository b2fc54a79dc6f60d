"""Run a function in N CPU processes joined by gloo, and collect each rank's return value."""

from __future__ import annotations

import io
import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A port free now, for a launcher that must be told one before it starts (torchrun's multi-node rendezvous):
    another process may take it before the launcher binds it. Where a launcher can choose its own port
    (`torchrun --standalone`) or no port is needed (`run_distributed`'s file store), use that instead."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, store: str, fn, args, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        # the ranks meet in a file, not on a port chosen in advance (which another process can take between
        # the choice and the bind); gloo's own connections then use ports the kernel gives them
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(result, buf)  # bytes, not shared-memory tensor handles that die with this process
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the traceback
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _context():
    """Ranks are forked from a server process that imported torch and infinity once (forkserver, preloaded):
    a spawned rank spent ~2 s of a 2-core machine importing them again. The server has run no torch op, so the
    ranks start with no OpenMP or other threads to inherit (what makes a plain fork of this process unsafe)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "infinity", "dist_utils"])
    return ctx


def run_distributed(fn, world_size: int, *args, timeout: float = 240.0) -> list:
    """`fn(rank, world_size, *args)` on each rank (a module-level function); results by rank."""
    ctx = _context()
    queue = ctx.Queue()
    rendezvous = tempfile.TemporaryDirectory(prefix="infinity-ranks-")
    store = os.path.join(rendezvous.name, "store")
    procs = [ctx.Process(target=_worker, args=(r, world_size, store, fn, args, queue), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
        rendezvous.cleanup()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
