"""Building models without memory: `meta_init()`, and unit-by-unit materialization.

Under `meta_init()` every parameter is created on the meta device (no bytes),
while buffers stay real (a causal mask or rotary table is small, and its
values come from the model's own constructor). `initialize` then materializes
one unit at a time: it creates the unit's parameters on the CPU, runs each
owning module's `reset_parameters()` (or the user's `init_fn(module)`;
transformers' `_init_weights` for modules without one; PEFT's own rule for
LoRA adapters, Note [adapter init]) under a generator seeded from
`[train] seed` and the unit's index, keeps this rank's shard of them, hands it
to the tiers, and drops the rest. With `weights=` the parameters the file holds
are read instead, only the shard's part (weights.py). The same seed gives the same
initial weights whatever the world size or placement (`materialize_units`).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn

from infinity.memory.tier import Kind
from infinity.units.sharded_param import ParamSlot

if TYPE_CHECKING:
    from infinity.memory.manager import TieredMemoryManager
    from infinity.state.weights import WeightsPlan
    from infinity.units.unit import Unit

_patch_lock = threading.Lock()


@contextlib.contextmanager
def meta_init():
    """Create parameters on the meta device: nothing is allocated for them.

    Works by intercepting `nn.Module.register_parameter` for the duration of the
    block (one thread at a time).
    """
    with _patch_lock:
        original = nn.Module.register_parameter

        def register_parameter(module, name, param):
            if param is not None and param.device.type != "meta":
                param = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
            original(module, name, param)

        nn.Module.register_parameter = register_parameter
        try:
            yield
        finally:
            nn.Module.register_parameter = original


def is_meta(slot: ParamSlot) -> bool:
    module, attr = slot.owners[0]
    return module._parameters[attr].device.type == "meta"


def unit_seed(seed: int, unit_index: int) -> int:
    """The generator seed of one unit: independent of world size and placement."""
    return (seed * 1_000_003 + unit_index * 7919 + 17) % (2**63 - 1)


def materialize_shard(unit: Unit, seed: int, init_fn: Callable[[nn.Module], None] | None,
                      weights: WeightsPlan | None = None, inits: ModuleInits | None = None) -> torch.Tensor:
    """The parameters this rank stores of the unit (`unit.layout.params`: its partition at stage 3, the whole
    unit at stages 0-2; Note [stage layouts]) as fp32 (padding zero).

    Parameters the weights file holds are read from it, only the shard's part
    (weights.py). The others still on the meta device are created and initialized here
    (whole, as their init needs), real ones are read as they are; either way only their
    part inside the shard is kept.
    """
    start, end = unit.layout.params.start, unit.layout.params.start + unit.layout.params.numel
    master = torch.zeros(end - start, dtype=torch.float32)
    loaded = weights.read_shard(unit.slots, start, end, master, unit.index) if weights is not None else set()
    rest = [s for s in unit.slots if id(s) not in loaded]
    pending = [s for s in rest if is_meta(s)]
    if pending:
        _init_meta(unit.name, pending, seed, init_fn, inits or ModuleInits())
    with torch.no_grad():
        for slot in rest:
            span = slot.overlap(start, end)
            if span is not None:
                module, attr = slot.owners[0]
                value = module._parameters[attr].detach().reshape(-1)[span[0]:span[1]]
                master.narrow(0, slot.offset + span[0] - start, span[1] - span[0]).copy_(value)
    return master


@dataclass
class ModuleInits:
    """The model's own initializers, beside `init_fn` and `reset_parameters()`."""

    adapters: dict = field(default_factory=dict)  # peft_adapter_inits (Note [adapter init])
    # transformers' `model._init_weights(module)`, for its modules with no reset_parameters (RMSNorm, Conv1D)
    fallback: Callable[[nn.Module], None] | None = None

    @classmethod
    def of(cls, model: nn.Module) -> ModuleInits:
        fallback = getattr(model, "_init_weights", None)
        return cls(peft_adapter_inits(model), fallback if callable(fallback) else None)


def peft_adapter_inits(model: nn.Module) -> dict[int, tuple[nn.Module, str, object]]:
    """id(module holding an adapter tensor) -> (its PEFT LoRA layer, adapter name, init_lora_weights).

    Note [adapter init]: PEFT creates its adapters on the device of the base weights, so
    under meta_init they are meta too, and the modules holding them are plain nn.Linear
    (lora_A / lora_B) whose reset_parameters would give B random values. Their init is the
    LoRA layer's own `reset_lora_parameters` (A as nn.Linear's default, B = 0, so the
    wrapped model starts as the base model), found here by duck typing (no peft import).
    """
    configs = getattr(model, "peft_config", None) or {}
    found = {}
    for layer in model.modules():
        if not callable(getattr(layer, "reset_lora_parameters", None)):
            continue
        for dict_name in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
            holder = getattr(layer, dict_name, None)
            if not isinstance(holder, (nn.ModuleDict, nn.ParameterDict)):
                continue
            for adapter in holder.keys():
                init = getattr(configs.get(adapter), "init_lora_weights", True)
                if init not in (True, False, "gaussian"):
                    raise ValueError(f"LoRA adapter {adapter!r} has init_lora_weights={init!r}, which reads the base "
                                     f"weights: infinity creates the model under meta_init, so use True or "
                                     f"'gaussian' (or initialize the adapters yourself through init_fn)")
                owner = holder if isinstance(holder, nn.ParameterDict) else holder[adapter]
                found[id(owner)] = (layer, adapter, init)
    return found


def _init_meta(unit_name: str, slots: list[ParamSlot], seed: int, init_fn, inits: ModuleInits) -> None:
    modules: list[nn.Module] = []
    for slot in slots:
        module, attr = slot.owners[0]
        dtype = module._parameters[attr].dtype
        real = nn.Parameter(torch.empty(slot.shape, dtype=dtype), requires_grad=slot.requires_grad)
        for owner, owner_attr in slot.owners:
            owner._parameters[owner_attr] = real
            if not any(owner is m for m in modules):
                modules.append(owner)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # Reverse order: a parameter shared by several modules keeps the values its
        # first owner (in module order) gives it, as the last to run wins.
        adapters_done = set()
        for module in reversed(modules):
            if id(module) in inits.adapters:  # Note [adapter init]
                layer, adapter, init = inits.adapters[id(module)]
                if (id(layer), adapter) not in adapters_done:
                    adapters_done.add((id(layer), adapter))
                    layer.reset_lora_parameters(adapter, init)
            elif init_fn is not None:
                init_fn(module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
            elif inits.fallback is not None:
                inits.fallback(module)
            else:
                names = [n for s in slots for (m, _), n in zip(s.owners, s.names) if m is module]
                raise TypeError(
                    f"parameters {names} of unit {unit_name!r} were created under infinity.meta_init(), but their "
                    f"module {type(module).__name__} has no reset_parameters(): give it one, or pass "
                    f"init_fn=lambda module: ... to infinity.initialize to initialize them")
    with torch.no_grad():
        for slot in slots:
            module, attr = slot.owners[0]
            p = module._parameters[attr]
            if p.device.type == "meta":
                raise TypeError(f"parameter {slot.name} of unit {unit_name!r} is still on the meta device after "
                                f"initialization: its init must fill it in place")


def buffers_to(model: nn.Module, device: torch.device) -> None:
    """Move every buffer of `model` (persistent or not: causal masks, rotary tables, BatchNorm
    statistics) to `device`, where the forward reads them. Buffers are not sharded: each rank
    holds them whole. A buffer shared by several modules stays one tensor."""
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = moved.setdefault(id(buf), buf.to(device))


def store_values(unit: Unit, manager: TieredMemoryManager, values: torch.Tensor) -> None:
    """Store fp32 `values` of the parameters this rank stores (`unit.layout.params`' range, which holds its
    update range) as its state: the master of the update range (and the parameters holding it, their cast),
    and the cast of every other parameter it stores (frozen weights, which have no master; at stages 0-2 the
    other ranks' partitions). Waits until stored."""
    update, params = unit.layout.update, unit.layout.params  # what this rank stores (Note [stage layouts])
    master = values[update.start - params.start:update.start - params.start + update.numel].clone()
    pending = manager.store_master(unit.index, None, master, release=False)
    for chunk in manager.params_not_updated(unit.index):
        start, numel = manager.chunk_span(unit.index, chunk, Kind.PARAMS)
        cast = values[start:start + numel].to(unit.ctx.compute_dtype)
        pending.append(manager.store(unit.index, Kind.PARAMS, chunk, cast, release=False))
    for p in pending:
        p.wait()  # the values must be stored before the caller drops its full copy


def materialize_units(units: list[Unit], manager: TieredMemoryManager, seed: int,
                      init_fn: Callable[[nn.Module], None] | None, weights: WeightsPlan | None = None) -> None:
    """Unit by unit: this rank's shard (read from `weights`, or initialized) -> tiers; nothing of the
    model is held beyond one unit. `weights` is closed at the end."""
    inits = ModuleInits.of(units[0].modules[0]) if units else ModuleInits()
    try:
        if weights is not None:
            weights.load_buffers()
        for unit in units:
            for kind in Kind:
                manager.allocate(unit.index, kind)
            values = materialize_shard(unit, unit_seed(seed, unit.index), init_fn, weights, inits)
            store_values(unit, manager, values)  # (before the unit's parameters go away)
            stored = manager.resident(unit.index, Kind.PARAMS)
            if unit.can_alias(stored):  # the whole unit on the compute device
                unit.alias(stored)
            else:
                unit.install_views()
    finally:
        if weights is not None:
            weights.close()
    manager.drain()
