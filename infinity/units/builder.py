"""Building units: which modules form units (the repeated blocks, or `[units] classes`; a block holding a tiled
layer split into its children, Note [tiles are units] in tiling.py), which parameters each unit owns (a
parameter shared between units goes to the root), the units themselves (flattened: sharded_param.py), and what
the planner sees of each (`unit_sizes`)."""

from __future__ import annotations

import torch.nn as nn

from infinity.config.sections import ConfigError
from infinity.memory.plan import UnitSizes
from infinity.units.context import UnitContext
from infinity.units.sharded_param import collect_slots, layout
from infinity.units.tiling import TILED, contains_tiles
from infinity.units.unit import Unit


def find_unit_modules(model: nn.Module, classes: list[str]) -> list[tuple[str, nn.Module]]:
    """The modules that form units, in module order.

    With `classes` (from `[units] classes`): every module whose class name is listed
    (not descending into one once found). Otherwise: the children of each
    `nn.ModuleList` that hold parameters (the repeated blocks). Every tile of a TiledLinear or TiledEmbedding
    is a unit, and a block holding one is split into its children that hold parameters, recursively, so that
    units do not nest (Note [tiles are units] in tiling.py).
    """
    return _walk(model, classes)[0]


def split_blocks(model: nn.Module, classes: list[str]) -> list[tuple[str, nn.Module]]:
    """The blocks that would be units but hold a tiled layer, so their children are (outermost only)."""
    return _walk(model, classes)[1]


def activation_modules(model: nn.Module, classes: list[str]) -> list[tuple[str, nn.Module]]:
    """What `[activation] checkpoint = "units"` checkpoints, in module order: each split block whole, and every
    unit outside one (Note [tiles are units] in tiling.py)."""
    units, split = _walk(model, classes)
    inside = {id(m) for _, block in split for m in block.modules()}
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(split + [(n, m) for n, m in units if id(m) not in inside], key=lambda nm: order[id(nm[1])])


def split_regions(model: nn.Module, classes: list[str], units: list[Unit]) -> list[tuple[nn.Module, list[Unit]]]:
    """Each split block with the units inside it, in forward (module) order."""
    regions = []
    for _, block in split_blocks(model, classes):
        inside = {id(m) for m in block.modules()}
        regions.append((block, [u for u in units[1:] if id(u.modules[0]) in inside]))
    return regions


def _walk(model: nn.Module, classes: list[str]) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    found: list[tuple[str, nn.Module]] = []
    split_found: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, module: nn.Module, split: bool = False) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, TILED):
                found.extend((f"{path}.tiles.{i}", tile) for i, tile in enumerate(child.tiles))
                continue
            holds = any(True for _ in child.parameters())
            if classes:
                block = type(child).__name__ in classes
            else:
                block = isinstance(module, nn.ModuleList) and holds
            if (block or (split and holds)) and not contains_tiles(child):
                found.append((path, child))
                continue
            if block and not split:
                split_found.append((path, child))
            walk(path, child, split or block)

    walk("", model)
    if classes and not found:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ConfigError(f"units.classes = {classes} matches no module of the model; its module classes are "
                         f"{present}: list the class of the repeated block (e.g. the transformer layer)")
    return found, split_found


def assign_parameters(model: nn.Module, unit_modules: list[nn.Module]) -> list[list[tuple]]:
    """(fqn, module, attr, param) entries per unit; index 0 is the root unit.

    A parameter used by several units (a tied embedding and output head) goes to
    the root unit, which stays unsharded for the whole forward and backward.
    """
    unit_of_module: dict[int, int] = {}
    for i, um in enumerate(unit_modules, start=1):
        for sub in um.modules():
            unit_of_module.setdefault(id(sub), i)
    entries: dict[int, list] = {}
    units_of_param: dict[int, set] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is None:
                continue
            fqn = f"{mname}.{attr}" if mname else attr
            entries.setdefault(id(param), []).append((fqn, module, attr, param))
            units_of_param.setdefault(id(param), set()).add(unit_of_module.get(id(module), 0))
    per_unit: list[list[tuple]] = [[] for _ in range(len(unit_modules) + 1)]
    for pid, items in entries.items():
        owners = units_of_param[pid]
        per_unit[next(iter(owners)) if len(owners) == 1 else 0].extend(items)
    return per_unit


def build_units(model: nn.Module, classes: list[str], ctx: UnitContext) -> list[Unit]:
    """Split `model` into units (root first). Nothing is allocated: parameters may be on meta."""
    found = find_unit_modules(model, classes)
    per_unit = assign_parameters(model, [m for _, m in found])
    names = ["<root>"] + [n for n, _ in found]
    modules = [[model]] + [[m] for _, m in found]
    units = []
    for i, entries in enumerate(per_unit):
        slots = collect_slots(entries)
        trainable = layout(slots)
        units.append(Unit(i, names[i], modules[i], slots, trainable, ctx))
    return units


def unit_sizes(units: list[Unit], sub_group_size: int | None = None,
               recomputed: frozenset[int] = frozenset()) -> tuple[UnitSizes, ...]:
    """What placement needs to know of each unit on this rank: its layout (chunked by `UnitContext.sub_group_size`,
    which `sub_group_size`, when given, must equal), and its fetches per micro-batch (`recomputed`: the units of
    the blocks checkpointed whole, `recomputed_units`)."""
    assert all(sub_group_size in (None, u.ctx.sub_group_size) for u in units), (
        sub_group_size, {u.ctx.sub_group_size for u in units})
    return tuple(UnitSizes(name=u.name, layout=u.layout, trainable_numel=u.stored_trainable,
                           fetches=3 if u.index in recomputed else 2) for u in units)


def units_in(regions: list[tuple[nn.Module, list[Unit]]]) -> frozenset[int]:
    """The indices of the units inside the split blocks."""
    return frozenset(u.index for _, units in regions for u in units)


def recomputed_units(regions: list[tuple[nn.Module, list[Unit]]], checkpoint: str,
                     units_ahead: int) -> frozenset[int]:
    """The units a whole-block recomputation fetches once more per micro-batch (Note [tiles are units]): all
    of a split block's but its last `units_ahead + 1`, which its backward fetched (and prefetched) before the
    recomputation starts."""
    if checkpoint != "units":
        return frozenset()
    return frozenset(u.index for _, units in regions for u in units[:max(0, len(units) - units_ahead - 1)])
