"""Training beside an inference engine on the same device (RL post-training): the engine's device bytes out and
back (`offload_states` / `reload_states`), and its full parameters streamed unit by unit
(`named_full_parameters`) to the inference engine's `load_weights` or a second module.

Note [offloaded states]'s other half (the shards' own: memory/parked.py): between accumulation windows the
engine holds on the device its DEVICE-tier shards (parameters, gradients, optimizer state), the model's buffers
(rotary tables, masks: whole on every rank), and the memory its unsharded buffers and staging came from (the
CUDA caching allocator's cache; on a CPU compute device, the pool of unsharded buffers). Everything else is
transient inside a step: units are resharded after their backward, staging goes back after each copy, the
flat gradients after their reduction. So `offload` refuses in the middle of a step (a backward pending, an
accumulation window open or closed and not yet stepped), settles the updates in flight (`settled()`) and a
background checkpoint, then parks each DEVICE shard of the kinds asked for, moves the buffers to the host and
empties the pools; `reload` undoes exactly that. The plan, every shard's chunks and their versions are
untouched, and parked bytes come back bit for bit, so training after any sequence of offloads and reloads is
the training without them. While a kind is offloaded the calls that read it are refused naming
`reload_states()` (a forward needs the parameters and buffers only: a reference model's forward may run with
the optimizer state offloaded).
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import torch
import torch.nn as nn

from infinity.device.streams import host_wait
from infinity.memory.tier import OPTIMIZER_KINDS, Kind, Tier
from infinity.profile import Link
from infinity.runtime.materialize import buffers_to
from infinity.state.export import lora_merges
from infinity.state.state_dict import gather_unit_master
from infinity.state.weights import base_name, is_adapter
from infinity.units.unit import UnitState

# what `kinds` may name: the `[placement]` groups, each optimizer kind, and "buffers" (the model's buffers and the
# pools of device memory the engine keeps between steps)
KIND_GROUPS: dict[str, tuple[Kind, ...]] = {
    "params": (Kind.PARAMS,), "grads": (Kind.GRADS,), "optimizer": OPTIMIZER_KINDS,
    **{k.value: (k,) for k in OPTIMIZER_KINDS}, "buffers": ()}
ALL = ("params", "grads", "optimizer", "buffers")
FORWARD = ("params", "buffers")  # what a forward without a backward reads


def parse_kinds(kinds) -> tuple[set[Kind], bool]:
    """The state kinds and whether the buffers are named by `kinds` (None: all)."""
    names = ALL if kinds is None else ([kinds] if isinstance(kinds, str) else list(kinds))
    unknown = [n for n in names if n not in KIND_GROUPS]
    if unknown:
        raise ValueError(f"offload_states(kinds=...): unknown {unknown}; name any of {sorted(KIND_GROUPS)} "
                         f"(or kinds=None for all)")
    return {k for n in names for k in KIND_GROUPS[n]}, "buffers" in names


def parse_tier(tier: str, has_swap: bool) -> Tier:
    if tier not in ("host", "nvme"):
        raise ValueError(f"offload_states(tier={tier!r}): the states go to 'host' (CPU memory) or 'nvme'")
    if tier == "nvme" and not has_swap:
        raise ValueError("offload_states(tier='nvme') needs the engine's swap space: place some state on NVMe "
                         "([placement] params/grads/optimizer = \"nvme\" with [nvme] paths), or use tier='host'")
    return Tier(tier)


class Colocation:
    """Which state kinds are offloaded now, and the moves out and back (Note [offloaded states])."""

    def __init__(self, *, model: nn.Module, units, manager, device: torch.device, unsharded, profiler,
                 mid_step: Callable[[], str | None], settled: Callable):
        self.model, self.units, self.manager, self.device = model, units, manager, device
        self.unsharded, self.profiler, self.mid_step, self.settled = unsharded, profiler, mid_step, settled
        self.offloaded: dict[Kind, Tier] = {}  # state kinds whose DEVICE shards are parked, and where
        self.buffers_offloaded = False

    # ----------------------------------------------------------------- out and back
    def offload(self, kinds, tier: str, non_blocking: bool) -> int:
        """Park the DEVICE shards of `kinds` on `tier`, and (with "buffers") move the buffers to the host and
        empty the pools; returns the bytes moved. Offloaded kinds are left as they are (idempotent)."""
        wanted, buffers = parse_kinds(kinds)
        where = parse_tier(tier, self.manager.swap is not None)
        reason = self.mid_step()
        if reason is not None:
            raise RuntimeError(f"offload_states() in the middle of a step ({reason}): call it between steps, "
                               f"after engine.step()")
        start, moved = time.perf_counter(), 0
        with self.settled():  # the updates in flight write the state: they land first
            self.manager.drain()  # (and the write-behind of the last update)
            for unit in self.units:
                assert unit.state is UnitState.SHARDED or unit.aliased, (unit.name, unit.state)  # between steps
                for kind in sorted(wanted - self.offloaded.keys(), key=lambda k: k.value):
                    if self.manager.stores(unit.index, kind):
                        moved += self.manager.park(unit.index, kind, where, non_blocking=non_blocking)
            self.offloaded |= {k: where for k in wanted if k not in self.offloaded}
            if buffers and not self.buffers_offloaded:
                buffers_to(self.model, torch.device("cpu"))
                self.unsharded.release_free()
                self.buffers_offloaded = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the caching allocator's free blocks go back to the device
        self.profiler.record(f"offload_states {moved} B", Link.D2H, start, time.perf_counter(), num_bytes=moved)
        return moved

    def reload(self) -> int:
        """Bring every offloaded kind and the buffers back to the device; returns the bytes moved."""
        start, moved, copies = time.perf_counter(), 0, []
        for unit in self.units:
            for kind in sorted(self.offloaded, key=lambda k: k.value):
                if self.manager.stores(unit.index, kind) and self.manager.is_parked(unit.index, kind):
                    copies += self.manager.unpark(unit.index, kind)
        for event, host in copies:
            moved += host.numel() * host.element_size()
            host_wait(event, "reload")  # the host copy is dropped next: its copy to the device must have read it
        self.offloaded.clear()
        if self.buffers_offloaded:
            buffers_to(self.model, self.device)
            self.buffers_offloaded = False
        self.profiler.record(f"reload_states {moved} B", Link.H2D, start, time.perf_counter(), num_bytes=moved)
        return moved

    # ----------------------------------------------------------------- while offloaded
    def require(self, what: str, needs=ALL) -> None:
        """Refuse `what` while a kind it reads is offloaded, naming the fix."""
        wanted, buffers = parse_kinds(needs)
        missing = sorted(k.value for k in wanted & self.offloaded.keys()) + (
            ["buffers"] if buffers and self.buffers_offloaded else [])
        if missing:
            raise RuntimeError(f"{what} reads state that is offloaded ({', '.join(missing)}): call "
                               f"engine.reload_states() first")

    def report(self) -> dict:
        """memory_report()'s part: what is offloaded, and where."""
        return {"offloaded": {k.value: t.value for k, t in self.offloaded.items()}
                | ({"buffers": "host"} if self.buffers_offloaded else {})}


def mid_step(window, backward_pending: bool) -> str | None:
    """Why the engine is in the middle of a step now (None: between steps, Note [accumulation windows])."""
    if backward_pending:
        return "a forward's backward is pending"
    if window.closed:
        return "an accumulation window ended and awaits engine.step()"
    if not window.between_windows:
        return f"{window.taken_in_window} of {window.length} backward passes of an accumulation window taken"
    return None


# ----------------------------------------------------------------- streamed weights
def named_full_parameters(model: nn.Module, units, manager, tiling, dtype: torch.dtype, merge_lora: bool = False,
                          *, settled: Callable) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor in `dtype`) of every parameter, unit by unit (all ranks call it: each unit is
    all-gathered), in the model's own names (a tied parameter once, under its first name; a tiled one whole,
    once its last tile's unit is read). `merge_lora`: a PEFT LoRA model's base weights merged with their active
    adapters (W + scale * B @ A, as PEFT merges) under the base model's names, adapters left out. At most one
    unit's full values exist at a time beside the engine's own (and a tiled parameter's tiles read so far)."""
    merges = lora_merges(model) if merge_lora else {}
    with settled():  # the updates in flight write the masters: they land first
        yield from _streamed(units, manager, tiling, dtype, merges, merge_lora)


def _streamed(units, manager, tiling, dtype: torch.dtype, merges: dict, merge_lora: bool):
    tiles: dict[str, torch.Tensor] = {}  # tile name -> its values, until its untiled parameter is whole
    for unit in units:
        if unit.flat_numel == 0:
            continue
        full = gather_unit_master(unit, manager, every_rank=True)
        values = {slot.name: full.narrow(0, slot.offset, slot.numel).view(slot.shape) for slot in unit.slots}
        for name, value in _named(unit, values, merges, merge_lora):
            origin = tiling.origin_name(name)
            if origin == name:
                yield name, value.to(dtype)
                continue
            tiles[name] = value.clone()
            shape, parts = tiling.origins[origin]
            if all(t in tiles for t in parts):
                yield origin, torch.cat([tiles.pop(t).reshape(-1) for t in parts]).view(shape).to(dtype)
        del full, values


def _named(unit, values: dict[str, torch.Tensor], merges: dict, merge_lora: bool):
    """One unit's (name, fp32 value): its own names, or merged under the base model's."""
    for slot in unit.slots:
        name = slot.name
        if not merge_lora:
            yield name, values[name]
            continue
        if is_adapter(name) or ".original_module." in name:
            continue  # merged into its base weight / the copy PEFT trains is the model's
        value = values[name]
        for a, b, scale, fan_in_fan_out in merges.get(name, []):
            if a not in values or b not in values:
                raise ValueError(f"named_full_parameters(merge_lora=True): the adapters of {name} are not in its "
                                 f"unit {unit.name}; stream them unmerged (merge_lora=False) and merge them there")
            delta = values[b] @ values[a]
            value = value + scale * (delta.T if fan_in_fan_out else delta)
        yield base_name(name), value
