"""One parameter's record: where it sits in its unit's flat buffer, and the modules that hold it.

The record lives beside the parameter (a side table), never as attributes on
the `nn.Parameter`. After `install` every owner module holds an `nn.Parameter`
that is a view into the unit's unsharded buffer while the unit is unsharded,
and of one NaN expanded to its shape otherwise (Note [parameters between steps]).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn


@dataclass
class ParamSlot:
    """A parameter of a unit (a tied parameter is one slot with several names)."""

    names: list[str]  # fully qualified names, first = canonical (the state_dict keys)
    owners: list[tuple[nn.Module, str]]  # (module, attribute) pairs that hold it
    shape: torch.Size
    requires_grad: bool
    offset: int = 0  # element offset in the unit's flat buffer
    param: nn.Parameter | None = field(default=None, repr=False)  # the installed view

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def name(self) -> str:
        return self.names[0]

    def overlap(self, start: int, end: int) -> tuple[int, int] | None:
        """The part [lo, hi) of this parameter's flattened elements inside [start, end) of the flat buffer."""
        lo, hi = max(start - self.offset, 0), min(end - self.offset, self.numel)
        return (lo, hi) if lo < hi else None


def collect_slots(named: list[tuple[str, nn.Module, str, nn.Parameter]]) -> list[ParamSlot]:
    """Group (fqn, module, attr, param) entries by parameter identity, keeping first-seen order."""
    by_id: dict[int, ParamSlot] = {}
    for fqn, module, attr, param in named:
        slot = by_id.get(id(param))
        if slot is None:
            slot = by_id[id(param)] = ParamSlot(names=[], owners=[], shape=param.shape,
                                                requires_grad=param.requires_grad)
        slot.names.append(fqn)
        slot.owners.append((module, attr))
    return list(by_id.values())


def layout(slots: list[ParamSlot]) -> int:
    """Assign flat offsets, trainable parameters first (the optimizer steps only that prefix).

    Returns the number of trainable elements.
    """
    slots.sort(key=lambda s: not s.requires_grad)  # stable: keeps module order within each group
    offset = trainable = 0
    for slot in slots:
        slot.offset = offset
        offset += slot.numel
        trainable += slot.numel if slot.requires_grad else 0
    return trainable


RELEASED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> a parameter `release` emptied


def release(slots: list[ParamSlot]) -> None:
    """Note [released parameters]: at the engine's close, a unit whose parameters view its unsharded buffer (not
    a stored tensor: parameters on NVMe, or on the host with a GPU, or partitioned over ranks) has that buffer's
    bytes freed: a parameter read after close (`model.w.sum()`, a call of the model) read freed memory, and
    the process died of a segfault. The modules get parameters on the meta device instead, of the same shapes
    and dtypes (as `meta_init` makes them: counting them still works; their values are gone, and a call of the
    model fails on the meta device); parameters aliasing a stored tensor keep the trained values."""
    for slot in slots:
        released = nn.Parameter(torch.empty(slot.shape, dtype=slot.param.dtype, device="meta"),
                                requires_grad=slot.requires_grad)
        slot.param = released
        for module, attr in slot.owners:
            module._parameters[attr] = released
        RELEASED[id(released)] = released  # initialize refuses a model holding one (by id: == compares values)


# Note [parameters between steps]: a unit's parameters view its unsharded buffer, whose storage holds no memory
# while the unit is sharded (between steps, for parameters on NVMe, on the host beside a GPU or partitioned at stage
# 3). Reading one then (`model.w.sum()` to log a weight norm) read a null storage: the process died of a
# segmentation fault. So a sharded unit's parameters view a placeholder instead: one NaN of their dtype on their
# device, expanded to their shape (shape, dtype and device stay what code asks of a parameter; every value reads as
# NaN, no memory), and view the buffer again when it holds memory (`point_at`, at unshard). Each switch is a
# `.data` assignment (~0.2 us: 400 a step for a 200-parameter model cost 0.08 ms on the CPU); the autograd graph
# keeps the same parameter objects, which view the buffer again before backward reads them. The values are
# `engine.full_state_dict()`'s (docs/loop.md).
_NAN: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def point_away(slots: list[ParamSlot]) -> None:
    """The parameters of a unit whose unsharded buffer holds no memory view a NaN placeholder (Note [parameters
    between steps])."""
    for slot in slots:
        param = slot.param
        key = (param.dtype, param.device)
        nan = _NAN.get(key)
        if nan is None:
            nan = _NAN[key] = torch.full((), float("nan"), dtype=param.dtype, device=param.device)
        param.data = nan.expand(slot.shape)


def point_at(slots: list[ParamSlot], flat: torch.Tensor) -> None:
    """The parameters view `flat`, their unit's unsharded buffer, which holds memory again."""
    for slot in slots:
        slot.param.data = flat.narrow(0, slot.offset, slot.numel).view(slot.shape)


def install(slots: list[ParamSlot], flat: torch.Tensor) -> None:
    """Replace each owner's parameter by an `nn.Parameter` viewing `flat` (once, at initialize)."""
    for slot in slots:
        view = flat.narrow(0, slot.offset, slot.numel).view(slot.shape)
        slot.param = nn.Parameter(view, requires_grad=slot.requires_grad)
        for module, attr in slot.owners:
            module._parameters[attr] = slot.param

