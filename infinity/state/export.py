"""One consolidated state dict from a sharded checkpoint, streamed tensor by tensor.

    infinity.state.export.export_checkpoint("ckpt/step-1000", "model.safetensors")
    infinity.state.export.export_checkpoint("ckpt/step-1000", "model.pt")          # torch.save format
    infinity.state.export.export_checkpoint("ckpt/step-1000", "hf-dir")            # Hugging Face directory

Each tensor is assembled from the rank files' records (each verified against its
checksum), written, and dropped, so peak memory is the largest tensor plus one
record, whatever the model's size. The keys and their order are the model's
`state_dict()`: parameters (fp32 masters, or cast with `dtype`) and persistent
buffers; a tied parameter appears under each of its names.

Note [torch.save streaming]: the `.pt` file is first written by `torch.save` under
`torch.serialization.skip_data()` with untouched `torch.empty` placeholders (address
space, not memory), then every storage record is filled in place at its offset.
The result is an ordinary torch.save file: `torch.load` reads it.

A path with no suffix is a Hugging Face directory (`write_hf`): safetensors shards
of at most `max_shard_size` and their index, named as `save_pretrained` names them,
so `AutoModelForCausalLM.from_pretrained(DIR)` loads it (once the config is saved
there); for a PEFT model, the adapters alone as PEFT saves them, or (`merge_lora`)
the merged weights under the base model's names.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from typing import Callable, Iterator

import torch
import torch.nn as nn

from infinity.state.checkpoint import VALUE_KINDS, CheckpointError, load_buffers
from infinity.state.checkpoint_load import SavedShards, read_manifest
from infinity.state.weights import base_name, is_adapter
from io_engine import IOConfig, IOEngine, atomic_write, parse_size

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


class _Entry:
    """One key of the consolidated state dict: a parameter slot, a tiled parameter (its tiles' slots, in row
    order: Note [tiles are units] in units/tiling.py) or a buffer."""

    def __init__(self, key: str, shape: tuple, dtype: torch.dtype, slot=None, unit: int = -1, buffer=None,
                 parts: list[tuple[int, dict]] | None = None):
        self.key, self.shape, self.dtype, self.slot, self.unit, self.buffer = key, shape, dtype, slot, unit, buffer
        self.parts = parts if parts is not None else ([(unit, slot)] if slot is not None else [])

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
    tiled = (manifest.get("tiles") or {}).get("origins", {})
    out = []
    for key in manifest.get("state_dict_keys") or list(by_name):
        if key in tiled:
            out.append(_Entry(key, tuple(tiled[key]["shape"]), dtype or torch.float32,
                              parts=[by_name[t] for t in tiled[key]["tiles"]]))
        elif key in by_name:
            u, slot = by_name[key]
            out.append(_Entry(key, tuple(slot["shape"]), dtype or torch.float32, slot=slot, unit=u))
        elif key in buffers:
            out.append(_Entry(key, tuple(buffers[key].shape), buffers[key].dtype, buffer=buffers[key]))
        else:
            raise CheckpointError(f"{path}: state_dict key {key!r} is neither a saved parameter nor a saved buffer")
    return out


class _Reader:
    """Full tensors of a checkpoint's entries, one at a time (records read and verified on the way)."""

    def __init__(self, path: str, manifest: dict):
        self.manifest = manifest
        self.io = IOEngine(IOConfig(block_size=1 << 20, queue_depth=8, threads=4, direct=True, checksum="off"))
        try:
            self.shards = SavedShards(path, manifest, self.io)
        except BaseException:  # e.g. the pretrained files it refers to are missing
            self.io.close()
            raise

    def tensor(self, entry: _Entry) -> torch.Tensor:
        if entry.buffer is not None:
            return entry.buffer
        full = torch.empty(entry.num_bytes // entry.dtype.itemsize, dtype=torch.float32)
        at = 0
        for unit, slot in entry.parts:  # one slot, or a tiled parameter's tiles in row order
            flat_numel = self.manifest["units"][unit]["flat_numel"]
            saved_shard = -(-flat_numel // self.manifest["world_size"])
            numel, offset = math.prod(slot["shape"]), slot["offset"]
            self.shards.read_range(unit, VALUE_KINDS, saved_shard, offset, offset + numel, full.narrow(0, at, numel))
            at += numel
        assert at == full.numel(), (entry.key, at, full.numel())
        return full.view(entry.shape).to(entry.dtype)

    def close(self) -> None:
        self.shards.close()  # (the pretrained files a LoRA checkpoint refers to)
        self.io.close()


def _tensors(path: str, manifest: dict, entries: list[_Entry]) -> Iterator[tuple[_Entry, torch.Tensor]]:
    """Yield each entry's full tensor, one at a time."""
    reader = _Reader(path, manifest)
    try:
        for entry in entries:
            yield entry, reader.tensor(entry)
    finally:
        reader.close()


def write_safetensors_file(out: str, specs: list[tuple[str, tuple, torch.dtype]], tensors: Iterator[torch.Tensor],
                            metadata: dict) -> int:
    """Write one safetensors file from (key, shape, dtype) specs and their tensors in the same order, streaming;
    returns the data bytes."""
    header, pos = {}, 0
    for key, shape, dtype in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    with open(out + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for (key, shape, dtype), tensor in zip(specs, tensors, strict=True):
            assert tuple(tensor.shape) == tuple(shape) and tensor.dtype == dtype, (key, tensor.shape, shape, dtype)
            f.write(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
    os.replace(out + ".tmp", out)
    return pos


def write_safetensors(path: str, manifest: dict, out: str, dtype: torch.dtype | None) -> None:
    entries = _entries(path, manifest, dtype)
    metadata = {"format": "pt", "source": "infinity", "checkpoint": os.path.basename(path)}
    write_safetensors_file(out, [(e.key, e.shape, e.dtype) for e in entries],
                            (t for _, t in _tensors(path, manifest, entries)), metadata)


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
            f.write(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))
            written.add(index)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)


# ----------------------------------------------------------------- Hugging Face directories
HF_SINGLE, HF_INDEX, ADAPTER_FILE = "model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors"
_HF_SHARD = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")


def lora_merges(model) -> dict[str, list[tuple[str, str, float, bool]]]:
    """Base weight name -> (lora_A name, lora_B name, scale, fan_in_fan_out) of each active LoRA adapter
    of a PEFT model's layers (found by duck typing: no peft import). The merged weight is, as PEFT's
    `get_delta_weight`: W + scale * (B @ A), transposed for fan_in_fan_out layers (GPT-2's Conv1D)."""
    merges: dict[str, list] = {}
    for mname, layer in model.named_modules():
        lora_a = getattr(layer, "lora_A", None)
        if not isinstance(lora_a, nn.ModuleDict) or not hasattr(layer, "scaling"):
            continue
        active = [a for a in getattr(layer, "active_adapters", list(lora_a.keys()))]
        for adapter in active:
            unsupported = (adapter in getattr(layer, "lora_embedding_A", {}) or
                           getattr(layer, "use_dora", {}).get(adapter) or getattr(layer, "lora_bias", {}).get(adapter)
                           or (adapter in lora_a and lora_a[adapter].weight.dim() != 2))
            if unsupported:
                raise ValueError(f"merge_lora=True: the adapter {adapter!r} of {mname} is not a plain LoRA of a "
                                 f"Linear / Conv1D layer (embedding, convolution, DoRA or LoRA bias): export the "
                                 f"adapters alone (merge_lora=False) and merge them with PEFT")
            if adapter not in lora_a:
                continue
            merges.setdefault(f"{mname}.base_layer.weight", []).append(
                (f"{mname}.lora_A.{adapter}.weight", f"{mname}.lora_B.{adapter}.weight", float(layer.scaling[adapter]),
                 bool(getattr(layer, "fan_in_fan_out", False))))
    return merges


def _shards(specs: list[tuple], limit: int) -> list[list[tuple]]:
    """Split (key, shape, dtype, ...) specs in order into files of at most `limit` bytes, as save_pretrained
    does: a tensor that does not fit starts the next file; one larger than the limit has a file of its own."""
    groups, size = [[]], 0
    for spec in specs:
        nbytes = math.prod(spec[1]) * spec[2].itemsize
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += nbytes
    return groups


def _remove_stale(out: str, written: set[str], pattern: re.Pattern) -> None:
    """Files of an earlier export into the same directory that this one did not write (another shard count)."""
    for name in os.listdir(out):
        if pattern.match(name) and name not in written:
            os.remove(os.path.join(out, name))


def write_hf(path: str, manifest: dict, out: str, dtype: torch.dtype | None, max_shard_size: int | str,
             merge_lora: bool, model=None, release: Callable[[], None] = lambda: None) -> None:
    """A Hugging Face directory: `model.safetensors`, or `model-0000i-of-0000N.safetensors` and
    `model.safetensors.index.json` when the weights pass `max_shard_size` (decimal "5GB" as transformers
    means it), the model's state_dict names, a tied parameter once under its first name (as save_pretrained
    writes it; from_pretrained ties the other). A PEFT model (`model` has `peft_config`): with `merge_lora`
    the merged weights under the base model's names, otherwise the adapters alone as PEFT saves them. `release`
    runs after each tensor is written (an engine's heap policy: Note [heap release])."""
    limit = parse_size(max_shard_size, "max_shard_size")
    entries = _entries(path, manifest, None)  # fp32 masters: a merge adds in fp32, the cast comes last
    by_key = {e.key: e for e in entries}
    peft = model is not None and bool(getattr(model, "peft_config", None))
    os.makedirs(out, exist_ok=True)
    if peft and not merge_lora:
        return _write_adapters(path, manifest, out, by_key, model, dtype)
    merges = lora_merges(model) if peft else {}
    chosen: dict[str, _Entry] = {}
    for e in entries:
        if e.slot is not None and e.key != e.slot["names"][0]:
            continue  # the second name of a tied parameter
        key = e.key
        if peft:
            if is_adapter(key):
                continue
            key = base_name(key)
            if key in chosen and ".modules_to_save." not in e.key:
                continue  # a module PEFT trains a copy of: the trained copy is the model's
        chosen[key] = e
    specs = [(key, e.shape, (dtype or e.dtype) if e.buffer is None else e.dtype, e) for key, e in chosen.items()]
    reader = _Reader(path, manifest)

    def tensors(group):
        for _, _, out_dtype, e in group:
            t = reader.tensor(e)
            for a, b, scale, fan_in_fan_out in merges.get(e.key, []):  # t += scale * (B @ A) (transposed), in place:
                lora_a, lora_b = reader.tensor(by_key[a]), reader.tensor(by_key[b])  # the weight once in fp32 and
                if fan_in_fan_out:  # its cast, not the four weight-sized temporaries of the expression (2026-11-29)
                    t.addmm_(lora_a.T, lora_b.T, alpha=scale)
                else:
                    t.addmm_(lora_b, lora_a, alpha=scale)
            cast = t.to(out_dtype)
            del t
            yield cast
            del cast
            release()  # (glibc otherwise keeps the freed tensors' pages: +60-110 MiB on a 38M-parameter export)

    groups = _shards(specs, limit)
    names = [HF_SINGLE] if len(groups) == 1 else [f"model-{i:05d}-of-{len(groups):05d}.safetensors"
                                                  for i in range(1, len(groups) + 1)]
    weight_map, total = {}, 0
    try:
        for name, group in zip(names, groups):
            total += write_safetensors_file(os.path.join(out, name), [g[:3] for g in group], tensors(group),
                                             {"format": "pt"})
            weight_map.update({g[0]: name for g in group})
    finally:
        reader.close()
    if len(groups) > 1:
        atomic_write(os.path.join(out, HF_INDEX), json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2).encode())
    _remove_stale(out, set(names) | ({HF_INDEX} if len(groups) > 1 else set()),
                  re.compile(_HF_SHARD.pattern + "|^" + re.escape(HF_INDEX) + "$"))


def _write_adapters(path: str, manifest: dict, out: str, by_key: dict, model, dtype: torch.dtype | None) -> None:
    """The adapters alone, named as PEFT's save_pretrained names them (PEFT's own `get_peft_model_state_dict`
    picks and renames them, given placeholders), and `adapter_config.json` from the model's PEFT config. Prompt
    learning saves one tensor PEFT computes, not a parameter: `_prompt_embeddings` (Note [prompt embeddings])."""
    from peft import get_peft_model_state_dict  # only a PEFT model gets here

    adapter = getattr(model, "active_adapter", "default")
    reader = _Reader(path, manifest)
    try:
        if model.peft_config[adapter].is_prompt_learning:
            value = _prompt_embeddings(reader, by_key, model, adapter)
            specs = [("prompt_embeddings", tuple(value.shape), dtype or value.dtype)]
            values = iter([value.to(specs[0][2])])
        else:
            placeholders = {k: torch.empty(0) for k in by_key}
            picked = get_peft_model_state_dict(model, state_dict=placeholders, adapter_name=adapter,
                                               save_embedding_layers=False)
            name_of = {id(v): k for k, v in placeholders.items()}
            chosen = [(key, by_key[name_of[id(v)]]) for key, v in picked.items()]
            specs = [(key, e.shape, (dtype or e.dtype) if e.buffer is None else e.dtype) for key, e in chosen]
            values = (reader.tensor(e).to(s[2]) for (_, e), s in zip(chosen, specs))
        write_safetensors_file(os.path.join(out, ADAPTER_FILE), specs, values, {"format": "pt"})
    finally:
        reader.close()
    save_adapter_config(model.peft_config[adapter], out)


# Note [prompt embeddings]: for prompt learning (prompt tuning, prefix tuning, P-tuning's prompt encoder) PEFT saves
# `prompt_embeddings`, the prompt encoder's output for the virtual tokens (`get_prompt_embedding_to_save`): a
# fresh tensor computed from the encoder's weights, not one of the model's parameters. The engine's module holds
# no whole weights between steps (Note [parameters between steps]), so a copy of the (small) prompt encoder is
# given the checkpoint's trained values of its parameters, in fp32, and PEFT's own method runs on it.
def _prompt_embeddings(reader, by_key: dict, model, adapter: str) -> torch.Tensor:
    import copy
    import types

    encoder = copy.deepcopy(model.prompt_encoder[adapter])
    prefix = f"prompt_encoder.{adapter}."
    for name, param in encoder.named_parameters():
        entry = by_key.get(prefix + name)
        if entry is None:
            raise KeyError(f"the checkpoint has no {prefix + name}, the prompt encoder's parameter")
        param.data = reader.tensor(entry).to(torch.float32).reshape(param.shape)
    owner = types.SimpleNamespace(prompt_encoder={adapter: encoder}, prompt_tokens=model.prompt_tokens,
                                  peft_config=model.peft_config)
    with torch.no_grad():
        return type(model).get_prompt_embedding_to_save(owner, adapter)


# Note [adapter directory]: LoRA adapters alone are saved as PEFT's save_pretrained (and so TRL's SFTTrainer)
# saves them: adapter_config.json (inference_mode true, base_model_name_or_path naming the base model),
# adapter_model.safetensors and the tokenizer files, and no config.json or generation_config.json of the base
# model: transformers takes a directory with a config.json for a full model (and fails on the missing
# model.safetensors), while without one `AutoModelForCausalLM.from_pretrained(DIR)` finds adapter_config.json,
# loads the base model it names and the adapters through PEFT, as `PeftModel.from_pretrained(base, DIR)` does.
def save_adapter_config(peft_config, out: str) -> None:
    """adapter_config.json as PEFT's save_pretrained writes it: `inference_mode` true, and
    `base_model_name_or_path` as the model's config names the base model (the job and the trainers name it),
    which transformers' `AutoModelForCausalLM.from_pretrained(out)` loads before the adapters (Note [adapter
    directory])."""
    import copy
    peft_config = copy.deepcopy(peft_config)
    peft_config.inference_mode = True
    peft_config.save_pretrained(out)


def export_format(out: str) -> str:
    """"safetensors" for a `.safetensors` path, "hf" (a Hugging Face directory) for a path with no suffix
    or an existing directory, "torch" (torch.save) for any other suffix."""
    out = os.fspath(out)
    if out.endswith(".safetensors"):
        return "safetensors"
    if os.path.isdir(out) or not os.path.splitext(os.path.basename(out.rstrip(os.sep)))[1]:
        return "hf"
    return "torch"


def export_checkpoint(checkpoint: str, out: str, dtype: torch.dtype | None = None, fmt: str | None = None, *,
                      max_shard_size: int | str = "5GB", merge_lora: bool = False, model=None, config=None,
                      release: Callable[[], None] = lambda: None) -> str:
    """Write the checkpoint's full state dict to `out`: `.safetensors` one file, a path with no suffix a
    Hugging Face directory (`write_hf`; `model`, the engine's module, tells a PEFT model's adapters),
    any other suffix torch.save. With a transformers `config`, a Hugging Face directory of full weights gets
    its config.json, saying the dtype written (Note [stand-alone export])."""
    manifest = read_manifest(checkpoint)
    fmt = fmt or export_format(out)
    if fmt == "safetensors":
        write_safetensors(os.path.abspath(checkpoint), manifest, os.fspath(out), dtype)
    elif fmt == "torch":
        write_torch(os.path.abspath(checkpoint), manifest, os.fspath(out), dtype)
    elif fmt == "hf":
        write_hf(os.path.abspath(checkpoint), manifest, os.fspath(out), dtype, max_shard_size, merge_lora, model,
                 release)
        adapters_only = model is not None and bool(getattr(model, "peft_config", None)) and not merge_lora
        if hasattr(config, "save_pretrained") and not adapters_only:
            save_hf_config(config, os.fspath(out), dtype or torch.float32)
    else:
        raise ValueError(f"export format {fmt!r}: use 'safetensors', 'torch' or 'hf'")
    return os.fspath(out)


# ----------------------------------------------------------------- stand-alone Hugging Face directories
EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Note [stand-alone export]: an exported directory is what from_pretrained needs and nothing else: the weights
# in the source's dtype unless told otherwise ("auto" = the config's `dtype` / `torch_dtype`, else fp32),
# config.json saying the dtype the weights were written in, and every generation / tokenizer file of the
# pretrained directory (chat template included). The API's export streams through a temporary checkpoint
# that is removed afterwards, so nothing is left beside the directory.
COMPANION_PATTERN = re.compile(r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)|"
                               r"merges\.txt|chat_template\.(jinja|json)|generation_config\.json|"
                               r"preprocessor_config\.json|spiece\.model|sentencepiece\..*\.model)$")


def config_dtype(config) -> torch.dtype | None:
    """The dtype a transformers config says its weights are in (`dtype`, older `torch_dtype`), or None."""
    for attr in ("dtype", "torch_dtype"):
        value = getattr(config, attr, None) if config is not None else None
        if isinstance(value, str):
            value = getattr(torch, value, None)
        if isinstance(value, torch.dtype):
            return value
    return None


def resolve_export_dtype(dtype, config=None) -> torch.dtype:
    """The dtype an export is written in: a torch dtype as given; "fp32" / "bf16" / "fp16"; "auto" (or None)
    the config's own dtype, else fp32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return config_dtype(config) or torch.float32
    if dtype in EXPORT_DTYPES:
        return EXPORT_DTYPES[dtype]
    raise ValueError(f"export dtype {dtype!r}: use 'auto' (the source's dtype), 'fp32', 'bf16', 'fp16' or a "
                     f"torch dtype")


def save_hf_config(config, out: str, dtype: torch.dtype) -> None:
    """config.json (and the model's generation config, when it has one) into `out`, saying `dtype`."""
    import copy
    config = copy.deepcopy(config)
    config.dtype = dtype
    config.save_pretrained(out)


def copy_companions(source: str, out: str, *, adapters: bool = False) -> list[str]:
    """Copy the pretrained directory's generation and tokenizer files into `out` (into an adapter directory the
    tokenizer files only: Note [adapter directory]); returns their names."""
    import shutil
    copied = []
    for name in sorted(os.listdir(source)):
        if adapters and name == "generation_config.json":
            continue
        if COMPANION_PATTERN.match(name) and os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(out, name))
            copied.append(name)
    return copied


def export_engine(engine, path: str, *, dtype, max_shard_size: int | str, merge_lora: bool) -> str:
    """`Engine.export_state_dict`: a temporary checkpoint beside `path` (all ranks), exported by rank 0 in
    `dtype` (resolve_export_dtype) with the model's config, then removed (Note [stand-alone export])."""
    import shutil
    path = os.fspath(path).rstrip(os.sep)
    module = engine.module
    config = getattr(getattr(module, "base_model", module), "config", None)
    dtype, ckpt = resolve_export_dtype(dtype, config), f"{path}.export-tmp"
    engine.save_checkpoint(ckpt)
    engine.wait_for_checkpoint()
    if engine.rank == 0:
        export_checkpoint(ckpt, path, dtype=dtype, max_shard_size=max_shard_size, merge_lora=merge_lora,
                          model=module, config=config, release=engine.heap.release)  # (Note [heap release])
        shutil.rmtree(ckpt, ignore_errors=True)
    if engine.env.group is not None:
        import torch.distributed as dist
        dist.barrier(group=engine.env.group)  # the file is complete when every rank returns
    return path
