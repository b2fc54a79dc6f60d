"""Frozen parameters saved as references to the pretrained files they were read from.

Note [pretrained references]: a LoRA run's frozen base weights are nearly all of its state and
never change (no master, no gradient, no update: Note [stage layouts]); copying them into every
checkpoint made a 7B r=16 checkpoint 25 GiB for a few MiB of adapters. So a frozen range whose
values are exactly those the run read from a safetensors source (`initialize(weights=...)`, the
job's `model.pretrained`) is saved as a reference: the file (its name under the source's
directory; the manifest has the directory and each file's size), the tensor's key there, the
element range, and the CRC32 of those elements' bytes as the file holds them.

The checksum is computed while the materialization reads the range (the bytes are in memory
then: no extra pass over the file), and checked when a load reads the range again (it reads
them anyway: no extra pass either). So a flipped byte anywhere in a referenced tensor is found,
and a file that was only copied, moved or touched is still accepted. The other candidates were
weaker or dearer: size + mtime misses an edit within the timestamp's granularity and refuses an
identical copy; the safetensors header stays equal when a weight changes; a whole-file hash is a
pass over every pretrained byte at every save or load. Sizes are checked first, so a missing,
truncated or replaced file is named before anything is loaded. A tensor is referenced in pieces
of at most REF_PIECE elements (weights.py), each with its own checksum, so a load holds one piece
of it at a time, never a whole embedding.

"Exactly those the run read": the ranges the materialization read into frozen parameters or,
after `load_checkpoint`, the references of the loaded checkpoint (each verified as it was
resolved); a loaded checkpoint that holds frozen bytes leaves none, and later saves copy them
too. At a save, a file whose size or mtime changed since it was read is not referenced (its
ranges are copied: the run holds the old values). A load reads the range as the
materialization did (file dtype -> fp32 -> compute dtype), so the values are bitwise those saved.
It looks for the files in the loading engine's own safetensors source directory when it has one
(the job's model.pretrained), else in the directory recorded at save. Frozen parameters from
anywhere else (random init, a torch file or a state dict in memory, or `[checkpoint]
reference_pretrained = false`) are stored in the checkpoint once, in their own dtype (the compute
dtype), not cast to fp32. What is left of a LoRA checkpoint is the adapters' masters and moments
and the small files; those were made smaller too (compact JSON, the RNG keys as 4-byte words, no
buffers file for a model without persistent buffers, records under 4 KiB packed at 64-byte
alignment), so even a tiny model's LoRA checkpoint is a few times its adapters' state.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from infinity.state.checkpoint_files import CheckpointError
from infinity.state.weights import FrozenRead, SafetensorsFiles, WeightsError, WeightsPlan

REF_KIND = "pretrained"  # the kind of a reference record in a rank's index
FIX = ("restore the pretrained directory as it was when the run started (the job's model.pretrained), or point at "
       "an unchanged copy of it (infinity train --resume RUN --set model.pretrained=NEW_DIR; in code, "
       "initialize(weights=NEW_DIR)), or resume from a full checkpoint (one "
       "saved with [checkpoint] reference_pretrained = false, which holds the frozen weights itself)")


@dataclass(frozen=True)
class Reference(FrozenRead):
    """A FrozenRead as a checkpoint keeps it: flat elements [flat, flat + hi - lo) of unit `unit` are elements
    [lo, hi) of tensor `key` in `file`, now a name under the source directory, whose bytes have CRC32 `crc`."""

    @property
    def end(self) -> int:
        return self.flat + self.hi - self.lo

    def record(self) -> dict:
        return {"unit": self.unit, "kind": REF_KIND, "flat": self.flat, "numel": self.hi - self.lo,
                "file": self.file, "key": self.key, "lo": self.lo, "crc": self.crc}

    @classmethod
    def of_record(cls, rec: dict) -> Reference:
        return cls(rec["unit"], rec["flat"], rec["file"], rec["key"], rec["lo"], rec["lo"] + rec["numel"], rec["crc"])


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


class PretrainedRefs:
    """This rank's frozen ranges that hold a safetensors source's values, by unit (what a save references),
    and the source: its directory and files (size, mtime when read)."""

    def __init__(self, root: str | None = None, files: list[str] = (), refs=()):
        self.root = root
        self.stamps = {name: _stamp(os.path.join(root, name)) for name in files} if root else {}
        self.by_unit: dict[int, list[Reference]] = {}
        for ref in sorted(set(refs), key=lambda r: (r.unit, r.flat)):
            self.by_unit.setdefault(ref.unit, []).append(ref)

    @classmethod
    def of_weights(cls, plan: WeightsPlan | None) -> PretrainedRefs:
        """The frozen ranges `plan` read during materialization (none for a torch file or state dict)."""
        if plan is None or not plan.source.referable:
            return cls()
        paths = sorted({os.path.abspath(p) for p in plan.source.file_of.values()})
        if not paths:
            return cls()
        root = os.path.commonpath([os.path.dirname(p) for p in paths])
        refs = [Reference(r.unit, r.flat, os.path.relpath(os.path.abspath(r.file), root), r.key, r.lo, r.hi, r.crc)
                for r in plan.frozen_reads]
        return cls(root, [os.path.relpath(p, root) for p in paths], refs)

    def for_save(self) -> PretrainedRefs:
        """Drop, for good, the references into files changed (size or mtime) since the run read them: those
        ranges are copied into checkpoints from now on (the run holds the old values)."""
        changed = [name for name, st in self.stamps.items()
                   if st is None or _stamp(os.path.join(self.root, name)) != st]
        if changed:
            warnings.warn(f"pretrained files changed since this run read them: {', '.join(changed)} in {self.root}; "
                          f"checkpoints now hold the frozen weights read from them instead of referring to the "
                          f"files (Note [pretrained references])", stacklevel=3)
            for name in changed:
                del self.stamps[name]
            for unit, refs in self.by_unit.items():
                self.by_unit[unit] = [r for r in refs if r.file not in changed]
        return self

    def touching(self, unit: int, a: int, b: int) -> list[Reference]:
        """The references of `unit` overlapping its flat elements [a, b)."""
        return [r for r in self.by_unit.get(unit, ()) if r.flat < b and a < r.end]

    def uncovered(self, unit: int, a: int, b: int) -> list[tuple[int, int]]:
        """The parts of flat elements [a, b) of `unit` that no reference covers (to store as bytes)."""
        out, at = [], a
        for r in self.touching(unit, a, b):
            if r.flat > at:
                out.append((at, r.flat))
            at = max(at, r.end)
        if at < b:
            out.append((at, b))
        return out

    def after_load(self, reader: PretrainedReader | None, refs: list[Reference]) -> PretrainedRefs:
        """What the frozen parameters hold after a load: the loaded checkpoint's references (each verified as
        `reader` resolved it), or none when it held their bytes."""
        if reader is None:
            return PretrainedRefs(self.root, list(self.stamps))
        return PretrainedRefs(reader.root, list(reader.entry["files"]), refs)

    def manifest_entry(self) -> dict | None:
        """The source as a checkpoint's manifest records it: the directory and each file's size."""
        if not self.root:
            return None
        return {"root": self.root, "files": {name: st[0] for name, st in sorted(self.stamps.items())}}


class PretrainedReader:
    """A checkpoint's references resolved: the files opened under the source directory, their sizes checked
    against the manifest, each range read and compared with its CRC32 (Note [pretrained references])."""

    def __init__(self, checkpoint: str, entry: dict, root: str | None, files: set[str]):
        self.checkpoint, self.entry = checkpoint, entry
        self.root = os.path.abspath(root) if root else entry["root"]
        self._open: dict[str, SafetensorsFiles] = {}
        moved = "" if self.root == entry["root"] else f" (saved from {entry['root']})"
        for name in sorted(files):
            path = os.path.join(self.root, name)
            size = entry["files"].get(name)
            if not os.path.isfile(path):
                what = "is missing" if os.path.isdir(self.root) else f"is missing: {self.root} does not exist"
                self._refuse(f"{path}{moved} {what}")
            if size is not None and os.path.getsize(path) != size:
                self._refuse(f"{path}{moved} has {os.path.getsize(path)} bytes, {size} when the checkpoint was "
                             f"saved: the pretrained weights changed")

    def _refuse(self, problem: str):
        raise CheckpointError(f"checkpoint {self.checkpoint} holds the frozen (pretrained) weights as references to "
                              f"the files they were read from, and {problem}. It cannot be loaded without them: "
                              f"{FIX}")

    def read(self, rec: dict) -> torch.Tensor:
        """The referenced elements as fp32 (the materialization's cast), verified."""
        name, key, lo, hi = rec["file"], rec["key"], rec["lo"], rec["lo"] + rec["numel"]
        path = os.path.join(self.root, name)
        source = self._open.get(name)
        if source is None:
            try:
                source = self._open[name] = SafetensorsFiles([path], path)
            except WeightsError as e:
                self._refuse(f"{path} cannot be read as before ({e})")
        info = source.infos.get(key)
        if info is None or info.numel < hi:
            self._refuse(f"{path} no longer holds tensor {key!r} with {hi} elements")
        out = torch.empty(hi - lo, dtype=torch.float32)
        crc = source.read(key, lo, hi, out, checksum=True)
        if crc != rec["crc"]:
            self._refuse(f"the bytes of tensor {key!r} (elements {lo}..{hi}) in {path} differ from those it was "
                         f"saved with (CRC32 {crc:#010x}, saved {rec['crc']:#010x}): the pretrained weights changed")
        return out

    def close(self) -> None:
        for source in self._open.values():
            source.close()
        self._open.clear()
