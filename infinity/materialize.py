"""Building models without memory: `meta_init()`, and unit-by-unit materialization.

Under `meta_init()` every parameter is created on the meta device (no bytes),
while buffers stay real (a causal mask or rotary table is small, and its
values come from the model's own constructor). `initialize` then materializes
one unit at a time: it creates the unit's parameters on the CPU, runs each
owning module's `reset_parameters()` (or the user's `init_fn(module)`) under a
generator seeded from `[train] seed` and the unit's index, flattens them, hands
the flat buffer to the tiers, and drops it. The same seed gives the same
initial weights whatever the world size or placement (`materialize_units`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn

from .memory.tier import Kind
from .sharded_param import ParamSlot, gather_flat

if TYPE_CHECKING:
    from .memory.manager import TieredMemoryManager
    from .unit import Unit

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


def materialize_flat(unit_name: str, slots: list[ParamSlot], padded_numel: int, seed: int,
                     init_fn: Callable[[nn.Module], None] | None) -> torch.Tensor:
    """The unit's parameters as one fp32 CPU flat buffer (padding zero).

    Parameters still on the meta device are created and initialized here; real
    ones are read as they are. Either way the unit's full copy lives only for
    the duration of this call.
    """
    flat = torch.zeros(padded_numel, dtype=torch.float32)
    pending = [s for s in slots if is_meta(s)]
    if pending:
        _init_meta(unit_name, pending, seed, init_fn)
    gather_flat(slots, flat)
    return flat


def _init_meta(unit_name: str, slots: list[ParamSlot], seed: int, init_fn) -> None:
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
        for module in reversed(modules):
            if init_fn is not None:
                init_fn(module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
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


def store_values(unit: Unit, manager: TieredMemoryManager, flat: torch.Tensor) -> None:
    """Store the unit's full fp32 values `flat` (padded) as this rank's state: the master of its update range
    (and the parameters holding it, their cast), and the cast of every other parameter it stores (frozen
    weights, which have no master; at stages 0-2 the other ranks' partitions). Waits until stored."""
    update, params = unit.layout.update, unit.layout.params  # what this rank stores (Note [stage layouts])
    master = flat[update.start:update.start + update.numel].clone()
    pending = manager.store_master(unit.index, None, master, release=False)
    for chunk in manager.params_not_updated(unit.index):
        start, numel = manager.chunk_span(unit.index, chunk, Kind.PARAMS)
        values = flat[params.start + start:params.start + start + numel].to(unit.comm.compute_dtype)
        pending.append(manager.store(unit.index, Kind.PARAMS, chunk, values, release=False))
    for p in pending:
        p.wait()  # the values must be stored before the caller drops its full copy


def materialize_units(units: list[Unit], manager: TieredMemoryManager, seed: int,
                      init_fn: Callable[[nn.Module], None] | None) -> None:
    """Unit by unit: full fp32 values -> this rank's shard -> tiers; the full copy is dropped."""
    for unit in units:
        for kind in Kind:
            manager.allocate(unit.index, kind)
        flat = materialize_flat(unit.name, unit.slots, unit.padded_numel, unit_seed(seed, unit.index), init_fn)
        store_values(unit, manager, flat)
        del flat
        stored = manager.resident(unit.index, Kind.PARAMS)
        if unit.can_alias(stored):  # the whole unit on the compute device
            unit.alias(stored)
        else:
            unit.install_views()
    manager.drain()
