"""The small files of a checkpoint beside its shards, and which checkpoints a run keeps.

RNG states and persistent buffers are saved as tensors and plain values and loaded with
`torch.load(weights_only=True)` after their crc32 (Note [safe loading] in checkpoint.py).
`keep_last` retention counts the checkpoints of one run, across restarts
(Note [a resumed run keeps its checkpoints in bounds]).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import zlib

import torch

from io_engine import fsync_file

MANIFEST = "manifest.json"


def fsync_path(path: str) -> None:
    fsync_file(path)  # the bytes (or the directory entry) must be durable before the commit


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file and what to do."""



def file_crc(path: str) -> int:
    with open(path, "rb") as f:
        return zlib.crc32(f.read())


def _words(values) -> torch.Tensor:
    """32-bit words (Mersenne Twister keys) as an int32 tensor of the same bits: 4 bytes each in the file."""
    import numpy as np
    return torch.from_numpy(np.asarray(values, dtype=np.uint32).view(np.int32).copy())


def _unsigned(words: torch.Tensor):
    """The uint32 array of `_words` (or of format 2's int64 tensors)."""
    import numpy as np
    return words.numpy().astype(np.int64).astype(np.uint32)


def rng_state() -> dict:
    """The RNG states as tensors and plain values, so that `torch.load(weights_only=True)` reads them."""
    version, keys, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(), "python": (version, _words(keys), gauss)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (name, _words(keys), pos, has_gauss, cached)
    except ImportError:  # numpy is a dependency; keep loading robust anyway
        pass
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(int(k) for k in _unsigned(keys)) if isinstance(keys, torch.Tensor) else keys,
                     gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, _unsigned(keys), pos, has_gauss, cached))


def load_verified(path: str, crc: int | None, what: str):
    """torch.load of a checkpoint file with weights_only=True, after checking its crc32 (Note [safe loading])."""
    try:
        if crc is not None and file_crc(path) != crc:
            raise CheckpointError(f"{path} does not match its checksum in the manifest: the checkpoint's {what} "
                                  f"were changed or damaged and were not loaded; use another checkpoint")
        return torch.load(path, weights_only=True, map_location="cpu")
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - unpickling errors of every kind: the file is not what we wrote
        raise CheckpointError(f"{path} cannot be read as the checkpoint's {what} ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}): the file is damaged or not from "
                              f"infinity; use another checkpoint") from None


def load_buffers(path: str, manifest: dict) -> dict:
    """The persistent buffers saved with the checkpoint at `path` (verified; {} when it has none)."""
    if not manifest.get("buffers"):
        return {}
    state = load_verified(os.path.join(path, manifest["buffers"]), manifest.get("buffers_crc32"), "buffers")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}/{manifest['buffers']} holds no buffer tensors: the checkpoint is damaged; "
                              f"use another one")
    return state


def restore_buffers(module, saved: dict, path: str) -> None:
    """Copy the saved persistent buffers into the module's own (they are not sharded: Note [what is saved])."""
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    with torch.no_grad():
        for key, buf in module.state_dict(keep_vars=True).items():
            if key in params or key not in saved:
                continue
            if tuple(saved[key].shape) != tuple(buf.shape):
                raise CheckpointError(f"checkpoint {path}: buffer {key} has shape {list(saved[key].shape)}, "
                                      f"{list(buf.shape)} in this model: load it into the model it was saved from")
            buf.copy_(saved[key])


def persistent_buffers(module) -> dict:
    """Entries of module.state_dict() that are not parameters (buffers registered as persistent)."""
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    return {k: v.detach().cpu().clone() for k, v in module.state_dict(keep_vars=True).items() if k not in params}


def save_buffers(buffers: dict, path: str) -> None:
    torch.save(buffers, path)
    fsync_path(path)


def apply_retention(saved: list[str], keep_last: int, run_id: str) -> list[str]:
    """Remove the oldest checkpoints this run wrote beyond `keep_last`; returns those kept."""
    if keep_last <= 0:
        return saved
    while len(saved) > keep_last:
        old = saved.pop(0)
        manifest = os.path.join(old, MANIFEST)
        try:
            with open(manifest) as f:
                ours = json.load(f).get("run_id") == run_id
        except (OSError, ValueError):
            ours = False
        if ours:  # only what this run wrote, and only if it still is what we wrote
            shutil.rmtree(old)
    return saved


def continue_run(engine, path: str, manifest: dict) -> None:
    """Note [a resumed run keeps its checkpoints in bounds]: the engine that loads a checkpoint continues
    the run that wrote it: it takes that run's id, and `keep_last` counts the run's checkpoints next to
    the loaded one (up to its step) as already written. Otherwise each restart would start a new count,
    and a job killed and resumed N times would keep N * keep_last checkpoints until the disk is full."""
    run_id = manifest.get("run_id")
    if not run_id:
        return
    engine.run_id = run_id
    parent = os.path.dirname(path)
    count_as_written(engine, [os.path.join(parent, name) for name in os.listdir(parent)], saved_step(manifest))


def saved_step(manifest: dict) -> int:
    """Where in its run a checkpoint was saved: the windows stepped, skipped ones too (two checkpoints around an
    fp16 overflow have the same count of applied updates); a checkpoint from before 2026-11-27 has only that."""
    return manifest.get("windows", manifest.get("optimizer_steps", 0))


def count_as_written(engine, paths: list[str], up_to_step: int) -> None:
    """Those of `paths` that are checkpoints of the engine's run saved at or before step `up_to_step` (windows:
    `saved_step`) count toward `keep_last` as if the engine had written them (oldest first)."""
    earlier = []
    for other in paths:
        try:
            with open(os.path.join(other, MANIFEST)) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            continue
        if saved.get("run_id") == engine.run_id and saved_step(saved) <= up_to_step:
            earlier.append((saved_step(saved), os.path.basename(other) == "checkpoint", other))
    engine._saved_checkpoints = [p for _, _, p in sorted(earlier)]
