"""Pretrained weights, read unit by unit into the shards: `initialize(model, config, weights=PATH)`.

    with infinity.meta_init():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DIR))
    engine = infinity.initialize(model, config, weights=DIR)

PATH is a `.safetensors` file; a directory in Hugging Face's layout (`model.safetensors`, or
`model.safetensors.index.json` and its shards; `pytorch_model.bin`); or a torch state-dict
file (read with `torch.load(mmap=True, weights_only=True)`: nothing in it can run code).

`open_weights` reads only the files' headers and `match_weights` pairs every parameter
(and persistent buffer) of the model with a key of the file, before anything is written:
missing, unexpected and mis-shaped keys raise `WeightsError` naming them (or, with
`strict=False`, a warning, and the missing ones keep the normal initialization). The
materialization then asks `WeightsPlan.read_shard` for each unit: only the elements of
this rank's shard are read, straight into the shard's fp32 master (any float dtype of
the file cast on the way), so a rank reads what its shards hold and no more.

Names: a tied parameter (an output head sharing the embedding) is one slot with several
names and loads once, from whichever of its names the file has. A PEFT-wrapped model
(`peft.get_peft_model`) loads its base model's checkpoint: `base_model.model.` and the
`.base_layer.` / `.original_module.` / `.modules_to_save.<adapter>.` infixes map to the
base names, and the adapters (`lora_A`, `lora_B`, ...) are never missing: they keep
their own initialization (PEFT's: B = 0, so the wrapped model first computes the base
model; see materialize.py).

Note [reading without mmap]: safetensors' `safe_open` and `torch.load` with `mmap=True` map
the whole file; every page the load touches then counts in the process's resident set
until the file is unmapped, so a 6 GB checkpoint read through a mapping shows 6 GB of
RSS however little is held. The safetensors reader here parses the header (8-byte
length, JSON) itself and `preadv`s each shard's byte range into the destination: the
page cache holds the file, the process only its shard and one cast buffer. A torch
file has no such layout, so it is read through its mapping (its pages do count).
"""

from __future__ import annotations

import json
import os
import re
import warnings
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from infinity.units.tiling import Tiling

if TYPE_CHECKING:
    from infinity.units.sharded_param import ParamSlot
    from infinity.units.unit import Unit

__all__ = ["WeightsError", "WeightsPlan", "base_name", "is_adapter", "match_weights", "open_weights"]

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TORCH_SINGLE = "pytorch_model.bin"
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
_SHOWN = 8  # keys named in a message (then a count)
REF_PIECE = 1 << 24  # elements of a frozen tensor per checksummed read: what a checkpoint load holds of one at a time


class WeightsError(ValueError):
    """The weights file does not fit the model, or cannot be read: the message names the keys and the fix."""


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class SafetensorsFiles:
    """One or several safetensors files: their headers parsed, byte ranges read with `preadv`
    (Note [reading without mmap]). A tensor read from one can be referenced by a checkpoint
    (file, key, element range, CRC32 of its bytes: Note [pretrained references] in references.py)."""

    referable = True

    def __init__(self, files: list[str], where: str):
        self.where = where
        self.infos: dict[str, TensorInfo] = {}
        self.file_of: dict[str, str] = {}  # key -> the path of the file holding it
        self._at: dict[str, tuple[int, int]] = {}  # key -> (fd, byte offset of its data)
        self._fds: list[int] = []
        try:
            for path in files:
                self._add(path)
        except BaseException:
            self.close()
            raise

    def _add(self, path: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise WeightsError(f"cannot open {path} ({e.strerror}): check the path given as weights=") from e
        self._fds.append(fd)
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(_MAX_HEADER, size - 8):
            raise WeightsError(f"{path} is not a safetensors file (its header length reads {n}, the file has "
                               f"{size} bytes): give a .safetensors file, an HF directory or a torch state dict")
        try:
            header = json.loads(os.pread(fd, n, 8))
        except ValueError as e:
            raise WeightsError(f"{path}: the safetensors header is not valid JSON ({e}); the file is damaged") from e
        base = 8 + n
        for key, meta in header.items():
            if key == "__metadata__":
                continue
            dtype = SAFETENSORS_DTYPES.get(meta.get("dtype"))
            if dtype is None:
                raise WeightsError(f"{path}: tensor {key!r} has dtype {meta.get('dtype')!r}, which infinity does not "
                                   f"read (it reads {sorted(SAFETENSORS_DTYPES)}): convert the checkpoint")
            info = TensorInfo(tuple(meta["shape"]), dtype)
            begin, end = meta["data_offsets"]
            if end - begin != info.numel * dtype.itemsize or base + end > size:
                raise WeightsError(f"{path}: tensor {key!r} ({meta}) does not fit in the file's {size} bytes; "
                                   f"the file is truncated or damaged")
            self.infos[key] = info
            self.file_of[key] = path
            self._at[key] = (fd, base + begin)

    def read(self, key: str, lo: int, hi: int, out: torch.Tensor, checksum: bool = False) -> int | None:
        """Elements [lo, hi) of the flattened tensor `key`, cast into `out`; with `checksum`, returns the CRC32
        of the bytes read (as they are in the file, before the cast)."""
        info = self.infos[key]
        fd, at = self._at[key]
        buf = out if out.dtype == info.dtype else torch.empty(hi - lo, dtype=info.dtype)
        view = memoryview(buf.view(torch.uint8).numpy())
        pos, done = at + lo * info.dtype.itemsize, 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], pos + done)
            if got <= 0:
                raise WeightsError(f"{self.where}: short read of {key!r} at byte {pos + done}; the file is truncated")
            done += got
        crc = zlib.crc32(view) if checksum else None
        if buf is not out:
            out.copy_(buf)
        return crc

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()

    def __del__(self):  # an initialize that fails after the keys were checked (a preflight error) drops it
        self.close()


class TorchStateDict:
    """A state dict of tensors: one given in memory, or a torch.save'd file loaded memory-mapped (its pages count
    in RSS: Note [reading without mmap]). Not referenced by checkpoints: it has no byte ranges to name."""

    referable = False

    def __init__(self, state, where: str):
        if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise WeightsError(f"{where} holds a {type(state).__name__}, not a state dict of tensors: give "
                               f"model.state_dict() itself")
        self.where = where
        self._tensors = dict(state)
        self.infos = {k: TensorInfo(tuple(v.shape), v.dtype) for k, v in self._tensors.items()}

    @classmethod
    def load(cls, path: str) -> TorchStateDict:
        try:
            state = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        except Exception as e:  # noqa: BLE001 - any failure to read it is the user's file, named below
            raise WeightsError(f"cannot load {path} as a torch state dict ({type(e).__name__}: {e}); give a "
                               f"state dict saved by torch.save (zip format), a .safetensors file or an HF "
                               f"directory") from e
        return cls(state, path)

    def read(self, key: str, lo: int, hi: int, out: torch.Tensor, checksum: bool = False) -> None:
        out.copy_(self._tensors[key].detach().reshape(-1)[lo:hi])

    def close(self) -> None:
        self._tensors = {}


def open_weights(path):
    """The source at `path` (a file, an HF directory, or a state dict in memory) with its keys known (headers
    only are read)."""
    if isinstance(path, Mapping):
        return TorchStateDict(path, "the state dict given as weights=")
    if not isinstance(path, (str, os.PathLike)):
        raise WeightsError(f"weights= got a {type(path).__name__}: give a .safetensors file, a torch.save'd "
                           f"state dict, an HF directory (their paths), or a state dict of tensors")
    path = os.fspath(path)
    if os.path.isdir(path):
        index = os.path.join(path, INDEX)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (ValueError, KeyError) as e:
                raise WeightsError(f"{index} is not a safetensors index (no weight_map: {e}); the directory is "
                                   f"damaged") from e
            files = list(dict.fromkeys(os.path.join(path, name) for name in weight_map.values()))
            return SafetensorsFiles(files, path)
        for name, kind in ((SINGLE, SafetensorsFiles), (TORCH_SINGLE, TorchStateDict)):
            if os.path.isfile(os.path.join(path, name)):
                full = os.path.join(path, name)
                return SafetensorsFiles([full], full) if kind is SafetensorsFiles else TorchStateDict.load(full)
        raise WeightsError(f"{path} holds none of {INDEX}, {SINGLE}, {TORCH_SINGLE}: give the directory "
                           f"save_pretrained wrote, or the weights file itself")
    if not os.path.isfile(path):
        raise WeightsError(f"weights={path!r}: no such file or directory")
    if path.endswith(".safetensors"):
        return SafetensorsFiles([path], path)
    return TorchStateDict.load(path)


# ----------------------------------------------------------------- names
_PEFT_PREFIX = "base_model.model."
_PEFT_INFIX = re.compile(r"\.(base_layer|original_module|modules_to_save\.[^.]+)\.")
_ADAPTER = re.compile(r"(^|\.)(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)(\.|$)")


def base_name(name: str) -> str:
    """The base model's name of a PEFT-wrapped model's parameter (unchanged for other names)."""
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX):]
    while True:
        stripped = _PEFT_INFIX.sub(".", name, count=1)
        if stripped == name:
            return name
        name = stripped


def is_adapter(name: str) -> bool:
    """A PEFT LoRA adapter parameter: not in the base checkpoint, initialized by PEFT's rule."""
    return _ADAPTER.search(name) is not None


def _candidates(names: list[str]) -> list[str]:
    """The file keys that may hold a parameter known by `names` (its own names first, then the base ones)."""
    return list(dict.fromkeys(names + [base_name(n) for n in names]))


# ----------------------------------------------------------------- matching
@dataclass(frozen=True)
class FrozenRead:
    """Elements [lo, hi) of the file tensor `key` (in `file`), read into a frozen parameter at flat offset
    `flat` of unit `unit`; `crc`: the CRC32 of their bytes in the file (Note [pretrained references])."""

    unit: int
    flat: int
    file: str
    key: str
    lo: int
    hi: int
    crc: int


@dataclass
class WeightsPlan:
    """Which file key fills each slot and persistent buffer; read unit by unit."""

    source: object  # SafetensorsFiles | TorchStateDict
    slot_keys: dict[int, tuple[str, int]] = field(default_factory=dict)  # id(slot) -> (key, element offset in it)
    buffer_keys: list[tuple[nn.Module, str, str]] = field(default_factory=list)  # (module, attr, key)
    frozen_reads: list[FrozenRead] = field(default_factory=list)  # what a checkpoint may reference

    def read_shard(self, slots: list[ParamSlot], start: int, end: int, master: torch.Tensor,
                   unit: int = -1) -> set[int]:
        """Fill `master` (elements [start, end) of the unit's flat buffer) from the file for every slot
        the file holds; returns those slots' ids (the others are the caller's to initialize). The reads of
        frozen parameters from safetensors files are kept, with their checksums, in `frozen_reads`."""
        done = set()
        for slot in slots:
            key, base = self.slot_keys.get(id(slot), (None, 0))
            if key is None:
                continue
            done.add(id(slot))
            span = slot.overlap(start, end)
            if span is not None:
                lo, hi = span
                at = slot.offset + lo - start
                if not self.source.referable or slot.requires_grad:
                    self.source.read(key, base + lo, base + hi, master.narrow(0, at, hi - lo))  # (a tile: its rows)
                    continue
                for a in range(lo, hi, REF_PIECE):  # pieces of bounded size, each with its checksum
                    b = min(a + REF_PIECE, hi)
                    crc = self.source.read(key, base + a, base + b, master.narrow(0, at + a - lo, b - a), checksum=True)
                    self.frozen_reads.append(FrozenRead(unit, slot.offset + a, self.source.file_of[key], key,
                                                        base + a, base + b, crc))
        return done

    def holds_every_frozen(self, units: list[Unit]) -> bool:
        """Whether a checkpoint can refer to this source for every frozen parameter (Note [pretrained
        references]): a safetensors source that holds them all."""
        return self.source.referable and all(id(s) in self.slot_keys for u in units for s in u.slots
                                             if not s.requires_grad)

    def load_buffers(self) -> None:
        """Persistent buffers are not sharded: every rank reads them whole, in the buffer's dtype."""
        for module, attr, key in self.buffer_keys:
            buf = module._buffers[attr]
            value = torch.empty(buf.numel(), dtype=buf.dtype)
            self.source.read(key, 0, buf.numel(), value)
            buf.copy_(value.view(buf.shape))  # in place: a buffer shared by several modules stays one

    def close(self) -> None:
        self.source.close()


def _show(keys: list[str]) -> str:
    shown = ", ".join(keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def _ignored_unexpected(model: nn.Module) -> list[re.Pattern]:
    """transformers' own list of checkpoint keys a model class ignores (e.g. GPT-2's old `attn.bias` masks)."""
    inner = getattr(getattr(model, "base_model", None), "model", None)  # a PEFT model's wrapped model
    found = []
    for m in (model, inner):
        found += list(getattr(m, "_keys_to_ignore_on_load_unexpected", None) or [])
    return [re.compile(p) for p in found]


def match_weights(model: nn.Module, units: list[Unit], source, strict: bool = True,
                  tiling: Tiling | None = None) -> WeightsPlan:
    """Pair the model's parameters and persistent buffers with the file's keys; check before any write.

    A tile's parameter reads its rows of the untiled parameter's key (Note [tiles are units] in units/tiling.py).

    Raises WeightsError naming the missing, unexpected and mis-shaped keys (strict); with
    strict=False warns with the same lists, and what is missing or mis-shaped keeps its init.
    """
    plan = WeightsPlan(source)
    infos = source.infos
    used: set[str] = set()
    missing, mismatched = [], []
    tiling = tiling or Tiling()
    for unit in units:
        for slot in unit.slots:
            part = tiling.parts.get(slot.name)
            names = [part.origin] if part is not None else slot.names
            keys = [k for k in _candidates(names) if k in infos]
            if not keys:
                if not all(is_adapter(n) for n in names):
                    missing.append(names[0])
                continue
            used.update(keys)
            key = keys[0]
            shape = tuple(slot.shape) if part is None else tiling.origins[part.origin][0]
            if infos[key].shape != shape:
                mismatched.append(f"{key} (file {list(infos[key].shape)}, model {list(shape)})")
                continue
            plan.slot_keys[id(slot)] = (key, part.start if part is not None else 0)
    for mname, module in model.named_modules(remove_duplicate=False):
        for attr, buf in module._buffers.items():
            if buf is None or attr in module._non_persistent_buffers_set:
                continue
            name = f"{mname}.{attr}" if mname else attr
            key = next((k for k in _candidates([name]) if k in infos), None)
            if key is None:
                missing.append(name)
                continue
            used.add(key)
            if infos[key].shape != tuple(buf.shape):
                mismatched.append(f"{key} (file {list(infos[key].shape)}, model {list(buf.shape)})")
                continue
            plan.buffer_keys.append((module, attr, key))
    ignore = _ignored_unexpected(model)
    unexpected = [k for k in infos if k not in used and not any(p.search(k) for p in ignore)]
    missing, mismatched = list(dict.fromkeys(missing)), list(dict.fromkeys(mismatched))  # (a layer's tiles: once)
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"missing from the file ({len(missing)}): {_show(missing)}")
        if unexpected:
            parts.append(f"in the file but not in the model ({len(unexpected)}): {_show(unexpected)}")
        if mismatched:
            parts.append(f"shapes differ ({len(mismatched)}): {_show(mismatched)}")
        where = source.where
        if strict:
            source.close()
            raise WeightsError(
                f"weights {where} do not fit the model: " + "; ".join(parts) + ". Build the model from the "
                "checkpoint's own config (e.g. AutoConfig.from_pretrained), or pass strict=False to load the "
                "keys that fit and initialize the rest")
        warnings.warn(f"weights {where}, strict=False: " + "; ".join(parts) + ". Loaded the rest; the missing and "
                      "mis-shaped parameters keep their initialization", stacklevel=3)
    return plan


def plan_weights(path, model: nn.Module, units: list[Unit], strict: bool = True,
                 tiling: Tiling | None = None) -> WeightsPlan:
    """Open `path` and match it against the model (see `match_weights`)."""
    return match_weights(model, units, open_weights(path), strict, tiling)
