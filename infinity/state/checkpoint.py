"""Sharded checkpoints: written straight from the tiers, visible only when complete, verified on load.

Layout of a checkpoint directory::

    manifest.json        format, world size, model layout, resolved config, counters, user state,
                         and the checksum of every rank's index (written last, by rank 0)
    rank00000.bin        this rank's part of the master, exp_avg, exp_avg_sq (fp32 at any state_dtype), and of
                         frozen parameters (in the compute dtype), one record per stored chunk, each at a 4 KiB-
                         aligned offset
                         (one smaller than 4 KiB: 64-byte aligned, so a small model's records are not mostly holes)
    rank00000.json       the records: unit, kind, chunk, element range in the flat buffer, dtype, offset, crc32;
                         and the references to pretrained files that stand for frozen parameters
                         (Note [pretrained references] in references.py; the manifest names the directory)
    rank00000.rng.pt     this rank's RNG states (torch, CUDA, python, numpy), tensors and plain values only
    buffers.pt           the model's persistent buffers (rank 0, if it has any; BatchNorm statistics, masks),
                         restored on load

Note [what is saved]: a checkpoint is taken at an accumulation boundary, where gradients
are zero and the compute-dtype parameters of trainable elements are exactly the cast of the
fp32 masters; so masters and Adam moments, the parameters of frozen elements (which have no
master: Note [stage layouts]), counters and per-parameter step counts are the whole state.
Each element is written once, by the rank whose partition holds it ([r*s, (r+1)*s) of the
flat buffer): every rank stores its own partition of every kind at every stage, and kinds
replicated at stages 0-2 are not written N times. Frozen elements that hold a pretrained
file's values are written as references to it (Note [pretrained references]); the padding
past the last frozen parameter (zeros) is not written.

Note [atomicity]: every rank writes into `<path>.tmp-<token>` (marked as partial); rank 0
writes the manifest after all ranks have fsynced their files, fsyncs, and renames the
directory to `<path>`. A crash at any point leaves either no checkpoint at `<path>` or a
complete one. With `[checkpoint] background = true` the rank files are written by a thread
while training continues; the commit (barrier, manifest, rename) happens at the next
`step()` or `close()`, before the optimizer touches the state being written.

Loading (verified, resharding): checkpoint_load.py.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import threading
import zlib
from dataclasses import dataclass

import torch

from infinity.device.dtypes import dtype_of, name_of
from infinity.device.process_group import any_rank, barrier, broadcast_object
from infinity.device.streams import bind_thread
from infinity.memory.tier import Kind
from infinity.state.checkpoint_files import (  # noqa: F401 - CheckpointError and apply_retention are used through this module
    CheckpointError,
    apply_retention,
    continue_run,
    count_as_written,
    file_crc,
    fsync_path,
    load_buffers,
    load_verified,
    persistent_buffers,
    restore_buffers,
    rng_state,
    save_buffers,
    set_rng_state,
)
from infinity.state.references import REF_KIND, PretrainedRefs, Reference
from io_engine import IOEngine

FORMAT = "infinity-checkpoint/3"
# 1: stage 3 only, record ranges in the saving rank's shard; 2: every record fp32, no references
READABLE = ("infinity-checkpoint/1", "infinity-checkpoint/2", FORMAT)
SAVED_KINDS = (Kind.MASTER, Kind.EXP_AVG, Kind.EXP_AVG_SQ)
VALUE_KINDS = ("master", "params", REF_KIND)  # the records of the model's values: trainable, frozen, referenced
ALIGN = 4096
SMALL_ALIGN = 64  # a record smaller than ALIGN: its offset's alignment
MANIFEST = "manifest.json"
PARTIAL_MARKER = ".infinity-partial"
BUFFERS = "buffers.pt"  # the model's persistent buffers (small; rank 0), so exports load with strict=True
WRITES_IN_FLIGHT = 4


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.bin"


def rank_index(rank: int) -> str:
    return f"rank{rank:05d}.json"


def rank_rng(rank: int) -> str:
    return f"rank{rank:05d}.rng.pt"


def place(offset: int, nbytes: int) -> int:
    """The offset of a record of `nbytes` written at or after `offset` in a rank file."""
    align = ALIGN if nbytes >= ALIGN else SMALL_ALIGN
    return -(-offset // align) * align


def rank_file_bytes(record_bytes) -> int:
    """The size of a rank file holding records of `record_bytes` (in order), each placed by `place`."""
    end = 0
    for nbytes in record_bytes:
        end = place(end, nbytes) + nbytes
    return end


def crc32(t: torch.Tensor) -> int:
    """Checksum of a contiguous CPU tensor's bytes (zlib releases the GIL on large buffers)."""
    return zlib.crc32(memoryview(t.contiguous().view(torch.uint8).numpy()))


def model_layout(units) -> list[dict]:
    """The structure a checkpoint must match: units, their parameters, shapes and flat offsets."""
    return [{"name": u.name, "flat_numel": u.flat_numel, "trainable_numel": u.trainable_numel,
             "slots": [{"names": list(s.names), "shape": list(s.shape), "offset": s.offset,
                        "requires_grad": s.requires_grad} for s in u.slots]} for u in units]


# --------------------------------------------------------------------------------------- saving
@dataclass
class _Record:
    unit: int
    kind: str
    chunk: int
    start: int  # element offset in what the saving rank stores of the kind
    numel: int
    offset: int  # byte offset in the rank file
    flat: int = 0  # element offset in the unit's flat buffer (Note [resharding])
    crc: int = 0
    dtype: str = "fp32"  # the kind's own dtype (params: the compute dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_of(self.dtype).itemsize


class ShardWriter:
    """Writes one rank's shards, index and RNG states into the partial directory.

    Runs inline or in a background thread; it issues no collectives (those stay on the
    training thread). Errors are kept and re-raised by `PendingCheckpoint.commit`.
    """

    def __init__(self, engine, tmp_dir: str):
        self.engine, self.tmp_dir = engine, tmp_dir
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        # Note [pretrained references]: what this save refers to instead of copying (taken on the training thread)
        self.refs = engine.pretrained.for_save() if engine.config.checkpoint.reference_pretrained else PretrainedRefs()
        self.records, self.references = self._plan()

    def _plan(self) -> tuple[list[_Record], list[Reference]]:
        """Per stored chunk, the part in this rank's own partition (Note [what is saved]): of the optimizer
        kinds, and of the frozen parameters (past the trainable elements, before the padding) the parts no
        reference covers; and the references that cover the rest."""
        m, compute = self.engine.manager, self.engine.compute_dtype
        out, refs, offset = [], {}, 0
        for unit in self.engine.units:
            own_lo, own_hi = unit.shard_range()
            for kind in SAVED_KINDS + (Kind.PARAMS,):
                stored = unit.layout.of(kind)
                frozen = kind is Kind.PARAMS
                lo = max(own_lo, unit.stored_trainable) if frozen else own_lo
                hi = min(own_hi, unit.flat_numel) if frozen else own_hi
                dtype = name_of(compute if frozen else torch.float32)  # optimizer kinds: fp32 at any state_dtype
                for chunk in range(m.num_chunks(unit.index, kind)):
                    start, numel = m.chunk_span(unit.index, chunk, kind)
                    a, b = max(stored.start + start, lo), min(stored.start + start + numel, hi)
                    if a >= b:
                        continue
                    if frozen:
                        refs.update(dict.fromkeys(self.refs.touching(unit.index, a, b)))
                    for pa, pb in self.refs.uncovered(unit.index, a, b) if frozen else [(a, b)]:
                        rec = _Record(unit.index, kind.value, chunk, pa - stored.start, pb - pa, 0, flat=pa,
                                      dtype=dtype)
                        rec.offset = place(offset, rec.nbytes)
                        offset = rec.offset + rec.nbytes
                        out.append(rec)
        return out, list(refs)

    def start(self, background: bool) -> None:
        if background:
            self._thread = threading.Thread(target=self._run, name="infinity-checkpoint", daemon=True)
            self._thread.start()
        else:
            self._run()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()  # the rank files must be complete before the commit
            self._thread = None

    def _run(self) -> None:
        try:
            bind_thread(self.engine.device)  # (a background thread: its device copies go to this rank's GPU)
            self._write()
        except BaseException as e:  # noqa: BLE001 - re-raised on the training thread at commit
            self.error = e

    def _write(self) -> None:
        engine, m = self.engine, self.engine.manager
        rank = engine.rank
        path = os.path.join(self.tmp_dir, rank_file(rank))
        records = self.records
        cfg = engine.config.io
        with IOEngine(cfg.engine_config(checksum="off")) as io:
            in_flight: list = []
            try:
                for rec in records:
                    kind = Kind(rec.kind)
                    buf = m.fetch(rec.unit, kind, rec.chunk, torch.device("cpu")).wait()  # bytes to write
                    chunk_start = m.chunk_span(rec.unit, rec.chunk, kind)[0]
                    data = buf.narrow(0, rec.start - chunk_start, rec.numel).to(dtype_of(rec.dtype))  # (moments: fp32)
                    rec.crc = crc32(data)
                    in_flight.append((io.submit_write(data, path, rec.offset), buf, data))
                    while len(in_flight) > WRITES_IN_FLIGHT:
                        done, used, _ = in_flight.pop(0)
                        done.wait()  # the buffer is reused once its write landed
                        m.release(used)
                while in_flight:
                    done, used, _ = in_flight.pop(0)
                    done.wait()  # every record must be on disk before the index names it
                    m.release(used)
            finally:
                for fut, used, _ in in_flight:  # after a failure: let the other writes finish before their buffers go
                    try:
                        fut.wait()
                    except OSError:
                        pass  # the first error is the one reported
                    m.release(used)
        if not records:
            open(path, "wb").close()
        fsync_path(path)
        index = {"rank": rank, "file": rank_file(rank),
                 "records": [r.__dict__ for r in records] + [ref.record() for ref in self.references]}
        _write_json(os.path.join(self.tmp_dir, rank_index(rank)), index)
        torch.save(rng_state(), os.path.join(self.tmp_dir, rank_rng(rank)))  # plain values (Note [safe loading])
        fsync_path(os.path.join(self.tmp_dir, rank_rng(rank)))


def _write_json(path: str, payload: dict) -> int:
    data = json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()  # (compact: a LoRA checkpoint is small)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())  # durable before the manifest refers to it
    return zlib.crc32(data)


class PendingCheckpoint:
    """A save in progress: `commit()` makes it visible (all ranks call it)."""

    def __init__(self, engine, path: str, tmp_dir: str, writer: ShardWriter, user_state: dict, manifest: dict,
                 hold: int | None):
        self.engine, self.path, self.tmp_dir, self.writer = engine, path, tmp_dir, writer
        self.user_state, self.manifest = user_state, manifest
        self._hold = hold  # rank 0: the flock on the partial's marker (Note [partials in use])

    def _release(self) -> None:
        if self._hold is not None:
            os.close(self._hold)  # closing the descriptor drops the flock
            self._hold = None

    def commit(self) -> str:
        engine = self.engine
        group = engine.env.group
        self.writer.join()
        if any_rank(self.writer.error is not None, group, engine.env.device):  # every rank must agree to commit
            if engine.rank == 0:
                shutil.rmtree(self.tmp_dir, ignore_errors=True)
                self._release()
            barrier(group)
            err = self.writer.error
            if err is None:
                raise CheckpointError(f"checkpoint {self.path} was not saved: another rank failed to write its "
                                      f"shard (see its error); nothing was made visible and no earlier checkpoint "
                                      f"was touched")
            raise CheckpointError(f"checkpoint {self.path} was not saved (rank {engine.rank}): {err}. Nothing was "
                                  f"made visible and no earlier checkpoint was touched") from err
        barrier(group)  # all rank files are durable
        if engine.rank == 0:
            ranks = []
            for r in range(engine.world_size):
                with open(os.path.join(self.tmp_dir, rank_index(r)), "rb") as f:
                    ranks.append({"file": rank_file(r), "index": rank_index(r), "index_crc32": zlib.crc32(f.read()),
                                  "rng": rank_rng(r), "rng_crc32": file_crc(os.path.join(self.tmp_dir, rank_rng(r)))})
            self.manifest["ranks"] = ranks
            if self.manifest.get("buffers"):
                self.manifest["buffers_crc32"] = file_crc(os.path.join(self.tmp_dir, BUFFERS))
            try:
                _write_json(os.path.join(self.tmp_dir, MANIFEST), self.manifest)
                fsync_path(self.tmp_dir)
                os.rename(self.tmp_dir, self.path)  # the checkpoint appears whole, or not at all
            except OSError as e:  # e.g. the disk filled up for the manifest: the partial goes, nothing is visible
                shutil.rmtree(self.tmp_dir, ignore_errors=True)
                self._release()
                raise CheckpointError(f"checkpoint {self.path} was not saved: writing its manifest failed ({e}). "
                                      f"Nothing was made visible and no earlier checkpoint was touched; free space "
                                      f"in {os.path.dirname(self.path)}") from e
            fsync_path(os.path.dirname(os.path.abspath(self.path)))
            os.remove(os.path.join(self.path, PARTIAL_MARKER))  # after the rename: a dying save stays marked stale
            self._release()
        barrier(group)
        return self.path


def begin_save(engine, path: str, user_state: dict | None, background: bool) -> PendingCheckpoint:
    """Start saving `engine`'s state to `path` (all ranks call it at an accumulation boundary)."""
    path = os.path.abspath(os.fspath(path))
    user_state = dict(user_state or {})
    try:
        json.dumps(user_state)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"save_checkpoint(user_state=...) must be JSON-serializable (ints, floats, strings, "
                              f"lists, dicts) such as the data position: {e}") from e
    if not engine.window.between_windows:
        raise CheckpointError(
            f"save_checkpoint at micro-step {engine.micro_step} is inside an accumulation window of "
            f"{engine.config.train.grad_accum_steps}: save right after engine.step() so no gradients are pending")
    group = engine.env.group
    token = broadcast_object(secrets.token_hex(4) if engine.rank == 0 else None, group)
    tmp_dir = f"{path}.tmp-{token}"
    parent = os.path.dirname(path)
    hold = None
    if engine.rank == 0:
        if os.path.exists(path):
            raise CheckpointError(f"checkpoint path {path} already exists: save to a new directory (e.g. one per "
                                  f"step), or remove it first")
        try:
            os.makedirs(parent, exist_ok=True)
            _remove_stale_partials(parent)
            os.makedirs(tmp_dir)
            hold = os.open(os.path.join(tmp_dir, PARTIAL_MARKER), os.O_CREAT | os.O_RDWR, 0o600)
            fcntl.flock(hold, fcntl.LOCK_EX)  # held until the commit (or this process's death)
        except OSError as e:  # e.g. a full disk: nothing is left behind
            if hold is not None:
                os.close(hold)
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise CheckpointError(f"checkpoint {path} was not saved: cannot create {tmp_dir} ({e}); free space "
                                  f"in {parent} or save elsewhere. No earlier checkpoint was touched") from e
    barrier(group)  # the partial directory exists for every rank
    writer = ShardWriter(engine, tmp_dir)
    last = writer.records[-1] if writer.records else None
    need = (last.offset + last.nbytes if last else 0) + (256 << 10)  # + index, RNG, manifest
    free = shutil.disk_usage(parent).free
    if free < need * (engine.env.local_world_size if engine.rank == 0 else 1):
        writer.error = CheckpointError(
            f"not enough space in {parent}: rank {engine.rank} needs {need} bytes, {free} are free "
            f"({need - free} bytes missing); free space or save elsewhere")
    buffers = persistent_buffers(engine.module) if engine.rank == 0 else {}  # (none: no file)
    if buffers and writer.error is None:
        try:
            save_buffers(buffers, os.path.join(tmp_dir, BUFFERS))
        except OSError as e:  # reported by commit(), which removes the partial
            writer.error = e
    if writer.error is None:
        writer.start(background)
    manifest = {
        "format": FORMAT, "world_size": engine.world_size, "compute_dtype": engine.config.precision.compute_dtype,
        "zero_stage": engine.config.zero.stage,
        "units": model_layout(engine.units), "config": engine.config.to_dict(),
        "optimizer_steps": engine.optimizer_steps, "micro_step": engine.micro_step, "windows": engine.window.steps,
        "param_steps": [u.steps.counts for u in engine.units],
        "param_groups": engine.groups.record(),  # names, hyper-parameters, current lrs (checked at load)
        "loss_scale": {"scale": engine.scaler.scale, "clean_steps": engine.scaler._clean_steps,
                       "skipped_steps": engine.scaler.skipped_steps},
        "user_state": user_state, "run_id": engine.run_id,
        "state_dict_keys": engine.tiling.state_dict_keys(engine.module),  # untiled (Note [tiles are units])
        "tiles": engine.tiling.record(),
        "buffers": BUFFERS if buffers else None,
        "pretrained": writer.refs.manifest_entry(),  # the source the references point into (None: no source)
    }
    return PendingCheckpoint(engine, path, tmp_dir, writer, user_state, manifest, hold)


def _remove_stale_partials(parent: str) -> None:
    """Partial directories of saves that never completed (a killed run) are never valid: remove them.

    Note [partials in use]: a save in progress holds an flock on its partial's marker file from
    creation to commit; the kernel drops it when the process dies. Only a marker whose flock can be
    taken (its saver is gone) makes a partial stale: another live process's save is never removed.
    """
    for name in os.listdir(parent):
        full = os.path.join(parent, name)
        marker = os.path.join(full, PARTIAL_MARKER)
        if ".tmp-" not in name or not os.path.isfile(marker):
            continue
        try:
            fd = os.open(marker, os.O_RDWR)
        except OSError:
            continue  # committed or removed meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live save holds it
        finally:
            os.close(fd)
        shutil.rmtree(full, ignore_errors=True)
