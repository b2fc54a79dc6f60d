"""Loading a checkpoint: its manifest read and checked against the model (layout, tiles, groups, references),
the saved records of each kind read for the chunks this rank stores (at any world size and stage), verified,
and handed to the tiers; counters, step counts, RNG and buffers restored.

Note [safe loading]: every file is loaded with `torch.load(..., weights_only=True)` (tensors and plain
values; no pickled code runs) after its crc32 in the manifest was checked, so a tampered or garbage
file fails with a CheckpointError that names it, not an unpickling traceback or someone else's code.

Note [resharding]: records carry their element range in the unit's flat buffer (the same at
every world size and stage, up to padding; format 1 carried it in the saving rank's shard of
s elements: r*s + start). Loading at another world size or stage reads, for each chunk the
rank stores, the overlapping parts of the saved records, each verified against its checksum:
the optimizer kinds from their records, parameters outside the update range from the master
records (trainable) overlaid with the params records (frozen).
"""

from __future__ import annotations

import json
import os
import zlib

import torch

from infinity.device.dtypes import dtype_of
from infinity.memory.tier import Kind
from infinity.state.checkpoint import (
    MANIFEST,
    PARTIAL_MARKER,
    READABLE,
    SAVED_KINDS,
    VALUE_KINDS,
    crc32,
    model_layout,
    rank_file,
)
from infinity.state.checkpoint_files import (
    CheckpointError,
    continue_run,
    file_crc,
    load_buffers,
    load_verified,
    restore_buffers,
    saved_step,
    set_rng_state,
)
from infinity.state.references import REF_KIND, PretrainedReader, Reference
from io_engine import IOEngine


def read_manifest(path: str) -> dict:
    """The manifest of a complete checkpoint, or a CheckpointError saying what is wrong."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        partial = [n for n in os.listdir(os.path.dirname(path) or ".")
                   if n.startswith(os.path.basename(path) + ".tmp-")] if os.path.isdir(os.path.dirname(path)) else []
        hint = (f" (only an incomplete save, {partial[0]}, is there: that run stopped while saving; load the "
                f"checkpoint before it)") if partial else ""
        raise CheckpointError(f"no checkpoint at {path}{hint}: check the path")
    if ".tmp-" in os.path.basename(path) and os.path.exists(os.path.join(path, PARTIAL_MARKER)):
        raise CheckpointError(f"{path} is an incomplete save (the run stopped before committing it): load the "
                              f"checkpoint before it")
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no {MANIFEST}: it is not a complete infinity checkpoint") from None
    except ValueError as e:
        raise CheckpointError(f"{path}/{MANIFEST} is corrupted ({e}): use another checkpoint") from e
    if manifest.get("format") not in READABLE:
        raise CheckpointError(f"{path} has format {manifest.get('format')!r}, this version reads {READABLE}")
    return manifest


def check_layout(manifest: dict, units, path: str) -> None:
    """The checkpoint must be of this model: same parameters, shapes and unit split."""
    saved = manifest["units"]
    ours = model_layout(units)
    if saved == ours:
        return
    saved_params = {n: tuple(s["shape"]) for u in saved for s in u["slots"] for n in s["names"]}
    our_params = {n: tuple(s["shape"]) for u in ours for s in u["slots"] for n in s["names"]}
    problems = [f"missing in the checkpoint: {n}" for n in our_params if n not in saved_params][:3]
    problems += [f"not in this model: {n}" for n in saved_params if n not in our_params][:3]
    problems += [f"{n}: shape {list(saved_params[n])} in the checkpoint, {list(s)} here"
                 for n, s in our_params.items() if n in saved_params and saved_params[n] != s][:3]
    if not problems:
        problems = ["the same parameters are grouped into different units or orders (units.classes, or frozen "
                    "parameters, differ)"]
    raise CheckpointError(f"checkpoint {path} is from another model: " + "; ".join(problems)
                          + ". Load it into the model (and [units] config) it was saved from")


def check_tiles(manifest: dict, tiling, path: str) -> None:
    """The checkpoint's units must be tiled as this run's are (Note [tiles are units] in units/tiling.py)."""
    saved = manifest.get("tiles") or {"tile_bytes": 0, "origins": {}}
    ours = tiling.record()
    if saved["origins"] == ours["origins"]:
        return
    raise CheckpointError(
        f"checkpoint {path} was saved with [units] tile_bytes = {saved['tile_bytes']} ({len(saved['origins'])} "
        f"tiled parameters), this run has tile_bytes = {ours['tile_bytes']} ({len(ours['origins'])}): its units "
        f"differ. Resume with tile_bytes = {saved['tile_bytes']}; to change the tiling, start a new run from its "
        f"weights (engine.export_state_dict, then initialize(..., weights=) with the new tile_bytes)")


def check_groups(manifest: dict, groups, path: str) -> None:
    """The checkpoint's parameter groups must be this run's (optim/groups.py `ParamGroups.difference`)."""
    why = groups.difference(manifest.get("param_groups"))
    if why is not None:
        raise CheckpointError(f"checkpoint {path} was saved with other parameter groups: {why}. Resume with the "
                              f"param_groups= (or [optimizer] no_decay) of the run that saved it; to change the "
                              f"groups, start a new run from its weights (engine.export_state_dict, then "
                              f"initialize(..., weights=...))")


class SavedShards:
    """Random access to the saved records of one (unit, kind), verified, one record cached. References to
    pretrained files are resolved from `pretrained_root` (the loading engine's source directory) when given,
    else from the directory recorded at save; a missing or resized file is refused here, before any read."""

    def __init__(self, path: str, manifest: dict, io: IOEngine | None, pretrained_root: str | None = None):
        self.path, self.io = path, io
        self.saved_world = manifest["world_size"]
        self.by_key: dict[tuple[int, str], list[tuple[int, dict]]] = {}
        seen: set[Reference] = set()
        for r, entry in enumerate(manifest["ranks"]):
            index_path = os.path.join(path, entry["index"])
            with open(index_path, "rb") as f:
                data = f.read()
            if zlib.crc32(data) != entry["index_crc32"]:
                raise CheckpointError(f"{index_path} does not match its checksum in the manifest: the checkpoint is "
                                      f"corrupted; use another one")
            for rec in json.loads(data)["records"]:
                if rec["kind"] == REF_KIND:  # a tensor spanning partitions is referenced by each rank: read once
                    ref = Reference.of_record(rec)
                    if ref in seen:
                        continue
                    seen.add(ref)
                self.by_key.setdefault((rec["unit"], rec["kind"]), []).append((r, rec))
        self._cached: tuple | None = None
        refs = self.references()
        self.pretrained = None
        if refs:
            if not manifest.get("pretrained"):
                raise CheckpointError(f"{path}: its records refer to pretrained files but its manifest names no "
                                      f"pretrained directory; the checkpoint is damaged, use another one")
            self.pretrained = PretrainedReader(path, manifest["pretrained"], pretrained_root, {r.file for r in refs})

    def references(self) -> list[Reference]:
        """Every rank's references to pretrained files (Note [pretrained references]), each once."""
        return [Reference.of_record(rec) for (_, kind), recs in self.by_key.items() if kind == REF_KIND
                for _, rec in recs]

    def close(self) -> None:
        if self.pretrained is not None:
            self.pretrained.close()

    def read_range(self, unit_index: int, kind: "str | tuple[str, ...]", saved_shard: int, lo: int, hi: int,
                   out: torch.Tensor) -> None:
        """Fill `out` with elements [lo, hi) of the unit's flat buffer from the records of `kind` (several: in
        order, later ones over earlier ones), zeros where nothing was saved. `saved_shard`: the saving run's
        shard, for format 1's records."""
        out.zero_()
        kinds = (kind,) if isinstance(kind, str) else kind
        for r, rec in (item for k in kinds for item in self.by_key.get((unit_index, k), [])):
            rec_lo = rec["flat"] if "flat" in rec else r * saved_shard + rec["start"]
            rec_hi = rec_lo + rec["numel"]
            a, b = max(lo, rec_lo), min(hi, rec_hi)
            if a >= b:
                continue
            data = self._record(r, rec)
            out[a - lo: b - lo].copy_(data[a - rec_lo: b - rec_lo])

    def _record(self, r: int, rec: dict) -> torch.Tensor:
        key = (r, rec["offset"]) if "offset" in rec else (rec["file"], rec["key"], rec["lo"])
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        if rec["kind"] == REF_KIND:
            buf = self.pretrained.read(rec)  # verified against the checksum saved with the reference
            self._cached = (key, buf)
            return buf
        buf = torch.empty(rec["numel"], dtype=dtype_of(rec.get("dtype", "fp32")))
        file = os.path.join(self.path, rank_file(r))
        try:
            self.io.submit_read(buf, file, rec["offset"]).wait()  # the record is verified before use
        except OSError as e:
            raise CheckpointError(f"cannot read {file} at offset {rec['offset']} ({buf.nbytes} bytes, unit "
                                  f"{rec['unit']} {rec['kind']} chunk {rec['chunk']}): {e}. The checkpoint is "
                                  f"damaged; use another one") from e
        if crc32(buf) != rec["crc"]:
            raise CheckpointError(f"checksum mismatch in {file} at offset {rec['offset']} (unit {rec['unit']} "
                                  f"{rec['kind']} chunk {rec['chunk']}): the checkpoint is corrupted and was not "
                                  f"loaded; use another checkpoint")
        self._cached = (key, buf)
        return buf


def verify(path: str) -> str | None:
    """None when every file and record of the checkpoint at `path` matches the checksums its manifest and indexes
    hold (what `load` checks as it reads, read here without loading: Note [damaged checkpoint] in job/resume.py);
    else what does not. References to pretrained files are checked by the load."""
    path = os.path.abspath(os.fspath(path))
    try:
        manifest = read_manifest(path)
        files = [(entry["rng"], entry.get("rng_crc32")) for entry in manifest["ranks"]]
        if manifest.get("buffers"):
            files.append((manifest["buffers"], manifest.get("buffers_crc32")))
        for name, crc in files:
            if crc is not None and file_crc(os.path.join(path, name)) != crc:
                return f"{name} does not match its checksum"
        for entry in manifest["ranks"]:
            with open(os.path.join(path, entry["index"]), "rb") as f:
                index = f.read()
            if zlib.crc32(index) != entry["index_crc32"]:
                return f"{entry['index']} does not match its checksum"
            records = [rec for rec in json.loads(index)["records"] if rec["kind"] != REF_KIND]
            need = max((rec["offset"] + rec["numel"] * dtype_of(rec.get("dtype", "fp32")).itemsize for rec in records),
                       default=0)
            size = os.path.getsize(os.path.join(path, entry["file"]))
            if size < need:  # (longer is not damage: every record is still checked below)
                return f"{entry['file']} is {size} bytes, its records need {need} (truncated)"
            with open(os.path.join(path, entry["file"]), "rb") as f:
                for rec in records:
                    left = rec["numel"] * dtype_of(rec.get("dtype", "fp32")).itemsize
                    f.seek(rec["offset"])
                    crc = 0
                    while left:
                        chunk = f.read(min(left, 64 << 20))
                        if not chunk:
                            return f"{entry['file']} ends before its record at offset {rec['offset']} (truncated)"
                        crc, left = zlib.crc32(chunk, crc), left - len(chunk)
                    if crc != rec["crc"]:
                        return f"{entry['file']} at offset {rec['offset']} does not match its checksum"
    except FileNotFoundError as e:
        return f"{os.path.basename(e.filename or '') or 'a file'} is missing"
    except (CheckpointError, OSError, ValueError, KeyError) as e:
        return str(e) or type(e).__name__
    return None


def check_references(path: str, pretrained_root: str | None = None) -> None:
    """Refuse (CheckpointError) a checkpoint whose references to pretrained files cannot be resolved under
    `pretrained_root` (else the directory recorded at save): missing or resized files. Reads its indexes only."""
    path = os.path.abspath(os.fspath(path))
    SavedShards(path, read_manifest(path), None, pretrained_root).close()


def load(engine, path: str) -> dict:
    """Restore `engine` from `path`; returns the user state saved with it."""
    path = os.path.abspath(os.fspath(path))
    manifest = read_manifest(path)
    check_tiles(manifest, engine.tiling, path)
    check_layout(manifest, engine.units, path)
    check_groups(manifest, engine.groups, path)
    saved_world = manifest["world_size"]
    entry = manifest["ranks"][engine.rank if engine.rank < saved_world else 0]
    rng = load_verified(os.path.join(path, entry["rng"]), entry.get("rng_crc32"), "RNG states")
    buffers = load_buffers(path, manifest)  # both verified before any state changes
    cfg = engine.config.io
    with IOEngine(cfg.engine_config(checksum="off")) as io:
        shards = SavedShards(path, manifest, io, engine.pretrained.root)  # (missing pretrained files: refused here)
        try:
            _load_units(engine, shards, manifest)
        finally:
            shards.close()
    # Note [pretrained references]: the frozen parameters now hold the loaded references' ranges (each verified
    # as it was read), and nothing else of a source
    engine.pretrained = engine.pretrained.after_load(shards.pretrained, shards.references())
    engine.optimizer_steps = manifest["optimizer_steps"]
    engine.groups.restore_lrs(manifest.get("param_groups"))  # as torch's Optimizer.load_state_dict does
    engine.micro_step = manifest["micro_step"]
    engine.window.taken_in_window, engine.window.closed = 0, False  # (saved between windows, after the step)
    engine.window.steps = saved_step(manifest)
    scale = manifest["loss_scale"]
    engine.scaler.scale, engine.scaler._clean_steps = scale["scale"], scale["clean_steps"]
    engine.scaler.skipped_steps = scale["skipped_steps"]
    try:
        set_rng_state(rng)
    except (TypeError, KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}/{entry['rng']} does not hold RNG states ({type(e).__name__}: {e}): the "
                              f"checkpoint is damaged; use another one") from None
    restore_buffers(engine.module, buffers, path)
    continue_run(engine, path, manifest)
    return manifest["user_state"]


def _load_units(engine, shards: SavedShards, manifest: dict) -> None:
    """Every unit's stored kinds from the checkpoint's records (Note [resharding])."""
    m, cpu, saved_world = engine.manager, torch.device("cpu"), manifest["world_size"]
    for unit, layout in zip(engine.units, manifest["units"]):
        saved_padded = -(-layout["flat_numel"] // saved_world) * saved_world if layout["flat_numel"] else 0
        saved_shard = saved_padded // saved_world
        base = unit.layout.update.start  # Note [resharding]: what this rank stores, by its layout
        for kind in SAVED_KINDS:
            for chunk in range(m.num_chunks(unit.index)):
                start, numel = m.chunk_span(unit.index, chunk)
                buf = m.target(unit.index, kind, chunk, cpu)
                shards.read_range(unit.index, kind.value, saved_shard, base + start, base + start + numel, buf)
                # written before the next record reuses memory; with the master, the compute-dtype
                # parameters, its cast (Note [what is saved])
                stores = m.store_master(unit.index, chunk, buf) if kind is Kind.MASTER else [
                    m.store(unit.index, kind, chunk, buf)]
                for pending in stores:
                    pending.wait()
        params_base = unit.layout.params.start
        for chunk in m.params_not_updated(unit.index):  # frozen weights, the other ranks' partitions
            start, numel = m.chunk_span(unit.index, chunk, Kind.PARAMS)
            values = torch.empty(numel, dtype=torch.float32)
            shards.read_range(unit.index, VALUE_KINDS, saved_shard, params_base + start,
                              params_base + start + numel, values)
            m.store(unit.index, Kind.PARAMS, chunk, values.to(engine.compute_dtype), release=False).wait()
        m.mark_zero(unit.index, Kind.GRADS)
        unit.steps.counts = dict(manifest["param_steps"][unit.index])
        unit.grads.slots_with_grad.clear()
