"""One consolidated state dict from a sharded checkpoint, streamed tensor by tensor.

    infinity.export.export_checkpoint("ckpt/step-1000", "model.safetensors")
    infinity.export.export_checkpoint("ckpt/step-1000", "model.pt")          # torch.save format

Each tensor is assembled from the rank files' records (each verified against its
checksum), written, and dropped, so peak memory is the largest tensor plus one
record, whatever the model's size. The keys and their order are the model's
`state_dict()`: parameters (fp32 masters, or cast with `dtype`) and persistent
buffers; a tied parameter appears under each of its names.

Note [torch.save streaming]: the `.pt` file is first written by `torch.save` under
`torch.serialization.skip_data()` with untouched `torch.empty` placeholders (address
space, not memory), then every storage record is filled in place at its offset.
The result is an ordinary torch.save file: `torch.load` reads it.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Iterator

import torch

from io_engine import IOConfig, IOEngine

from .checkpoint import VALUE_KINDS, CheckpointError, SavedShards, load_buffers, read_manifest

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


class _Entry:
    """One key of the consolidated state dict: a parameter slot or a buffer."""

    def __init__(self, key: str, shape: tuple, dtype: torch.dtype, slot=None, unit: int = -1, buffer=None):
        self.key, self.shape, self.dtype, self.slot, self.unit, self.buffer = key, shape, dtype, slot, unit, buffer

    @property
    def num_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def _entries(path: str, manifest: dict, dtype: torch.dtype | None) -> list[_Entry]:
    by_name = {}
    for u, unit in enumerate(manifest["units"]):
        for slot in unit["slots"]:
            for name in slot["names"]:
                by_name[name] = (u, slot)
    buffers = load_buffers(path, manifest)
    out = []
    for key in manifest.get("state_dict_keys") or list(by_name):
        if key in by_name:
            u, slot = by_name[key]
            out.append(_Entry(key, tuple(slot["shape"]), dtype or torch.float32, slot=slot, unit=u))
        elif key in buffers:
            out.append(_Entry(key, tuple(buffers[key].shape), buffers[key].dtype, buffer=buffers[key]))
        else:
            raise CheckpointError(f"{path}: state_dict key {key!r} is neither a saved parameter nor a saved buffer")
    return out


def _tensors(path: str, manifest: dict, entries: list[_Entry]) -> Iterator[tuple[_Entry, torch.Tensor]]:
    """Yield each entry's full tensor, one at a time (records read and verified on the way)."""
    world = manifest["world_size"]
    with IOEngine(IOConfig(block_size=1 << 20, queue_depth=8, threads=4, direct=True, checksum="off")) as io:
        shards = SavedShards(path, manifest, io)
        for entry in entries:
            if entry.buffer is not None:
                yield entry, entry.buffer
                continue
            flat_numel = manifest["units"][entry.unit]["flat_numel"]
            saved_shard = -(-flat_numel // world)
            numel = entry.num_bytes // entry.dtype.itemsize
            full = torch.empty(numel, dtype=torch.float32)
            offset = entry.slot["offset"]
            shards.read_range(entry.unit, VALUE_KINDS, saved_shard, offset, offset + numel, full)
            yield entry, full.view(entry.shape).to(entry.dtype)


def write_safetensors(path: str, manifest: dict, out: str, dtype: torch.dtype | None) -> None:
    entries = _entries(path, manifest, dtype)
    header, pos = {}, 0
    for e in entries:
        header[e.key] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                         "data_offsets": [pos, pos + e.num_bytes]}
        pos += e.num_bytes
    header["__metadata__"] = {"format": "pt", "source": "infinity", "checkpoint": os.path.basename(path)}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    with open(out + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for entry, tensor in _tensors(path, manifest, entries):
            f.write(memoryview(tensor.contiguous().view(torch.uint8).reshape(-1).numpy()))
        f.flush()
        os.fsync(f.fileno())
    os.replace(out + ".tmp", out)


def write_torch(path: str, manifest: dict, out: str, dtype: torch.dtype | None) -> None:
    entries = _entries(path, manifest, dtype)
    placeholders, first = {}, {}
    for e in entries:  # a tied parameter: one storage under several names, as torch.save keeps it
        tied = next((first[n] for n in e.slot["names"] if n in first), None) if e.slot else None
        placeholders[e.key] = tied if tied is not None else torch.empty(e.shape, dtype=e.dtype)
        first.setdefault(e.key, placeholders[e.key])
    tmp = out + ".tmp"
    with torch.serialization.skip_data():
        torch.save(placeholders, tmp)  # layout only: no bytes are read from the placeholders
    reader = torch._C.PyTorchFileReader(tmp)
    records = [r for r in reader.get_all_records() if "data/" in r and r.rsplit("/", 1)[-1].isdigit()]
    offsets = {int(r.rsplit("/", 1)[-1]): reader.get_record_offset(r) for r in records}
    storage_of: dict[int, int] = {}
    for e in entries:  # storages are numbered in order of first appearance (torch.save's id_map)
        storage_of.setdefault(id(placeholders[e.key]), len(storage_of))
    index_of = {e.key: storage_of[id(placeholders[e.key])] for e in entries}
    del reader, placeholders, first
    written = set()
    with open(tmp, "r+b") as f:
        for entry, tensor in _tensors(path, manifest, entries):
            index = index_of[entry.key]
            if index in written:  # the second name of a tied parameter
                continue
            f.seek(offsets[index])
            f.write(memoryview(tensor.contiguous().view(torch.uint8).reshape(-1).numpy()))
            written.add(index)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)


def export_checkpoint(checkpoint: str, out: str, dtype: torch.dtype | None = None, fmt: str | None = None) -> str:
    """Write the checkpoint's full state dict to `out` (`.safetensors`, or torch.save for `.pt` / `.bin`)."""
    manifest = read_manifest(checkpoint)
    fmt = fmt or ("safetensors" if str(out).endswith(".safetensors") else "torch")
    if fmt == "safetensors":
        write_safetensors(os.path.abspath(checkpoint), manifest, os.fspath(out), dtype)
    elif fmt == "torch":
        write_torch(os.path.abspath(checkpoint), manifest, os.fspath(out), dtype)
    else:
        raise ValueError(f"export format {fmt!r}: use 'safetensors' or 'torch'")
    return os.fspath(out)
