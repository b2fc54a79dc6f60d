"""Where each unit's state lives: decided once, by a pure function, read everywhere else.

`plan_placement` takes the shard sizes of every unit, the resolved budgets and
the `[placement]` policy, and returns a `Plan`. The runtime asks the plan
(`plan.tier(unit, Kind.EXP_AVG)`) and never re-decides placement on its own.
Budgets are checked here, before any work: a plan that does not fit raises a
`PlacementError` with the bytes needed, the budget, and a placement that fits.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from .tier import Kind, OPTIMIZER_KINDS, Tier

GROUPS = ("params", "grads", "optimizer")
KINDS_OF_GROUP = {"params": (Kind.PARAMS,), "grads": (Kind.GRADS,), "optimizer": OPTIMIZER_KINDS}
FASTEST_FIRST = (Tier.DEVICE, Tier.HOST, Tier.NVME)


class PlacementError(ValueError):
    """The requested placement cannot fit the budgets; the message says what would."""


@dataclass(frozen=True, kw_only=True)
class UnitSizes:
    """What placement needs to know about one unit (this rank's shard)."""

    name: str
    shard_numel: int  # elements of this rank's shard, padding included
    unsharded_numel: int  # elements of the whole unit, padded to the world size
    chunk_numels: tuple[int, ...]  # the shard split into optimizer sub-groups


@dataclass(frozen=True, kw_only=True)
class Budgets:
    """Resolved byte budgets. `shared_ram` is set when DEVICE and HOST are the same RAM (no GPU)."""

    device: int
    host: int
    nvme: int  # free bytes on the swap paths (0 when none configured)
    shared_ram: bool = False


@dataclass(frozen=True)
class Plan:
    """The tier of every (unit, kind), and the bytes it implies."""

    tiers: tuple[dict[Kind, Tier], ...]  # indexed by unit index
    units: tuple[UnitSizes, ...]
    compute_dtype: torch.dtype
    working: dict[Tier, int] = field(default_factory=dict)  # staging / unsharded buffers, bytes
    reasons: tuple[str, ...] = ()

    def tier(self, unit: int, kind: Kind) -> Tier:
        return self.tiers[unit][kind]

    def uses(self, tier: Tier) -> bool:
        return any(t is tier for unit_tiers in self.tiers for t in unit_tiers.values())

    def state_bytes(self) -> dict[Tier, dict[Kind, int]]:
        """Bytes of state per tier and kind (NVMe extents' alignment not included)."""
        out: dict[Tier, dict[Kind, int]] = {t: {k: 0 for k in Kind} for t in Tier}
        for sizes, unit_tiers in zip(self.units, self.tiers):
            for kind, tier in unit_tiers.items():
                out[tier][kind] += sizes.shard_numel * kind.dtype(self.compute_dtype).itemsize
        return out

    def tier_totals(self) -> dict[Tier, int]:
        per = self.state_bytes()
        return {t: sum(per[t].values()) + self.working.get(t, 0) for t in Tier}


def working_bytes(units: tuple[UnitSizes, ...], compute_dtype: torch.dtype, tiers_of: dict[str, Tier],
                  units_ahead: int, pipeline_depth: int = 3) -> dict[Tier, int]:
    """Buffers the step needs beyond the state itself, per tier.

    DEVICE: unsharded parameters of the root unit and of up to `units_ahead + 1`
    of the largest other units (the one running plus the prefetched ones), plus
    one fp32 flat gradient and its reduce-scattered shard for the largest unit.
    HOST: NVMe staging for `pipeline_depth` optimizer sub-groups of every kind
    that lives on NVMe, plus one full parameter shard being read for a forward.
    """
    csize = compute_dtype.itemsize
    if not units:
        return {}
    root, rest = units[0], sorted((u.unsharded_numel for u in units[1:]), reverse=True)
    largest = max(u.unsharded_numel for u in units)
    largest_shard = max(u.shard_numel for u in units)
    device = root.unsharded_numel * csize + sum(rest[: units_ahead + 1]) * csize
    device += largest * 4 + largest_shard * 4
    host = 0
    largest_chunk = max(max(u.chunk_numels, default=0) for u in units)
    nvme_kinds = [k for g in GROUPS if tiers_of[g] is Tier.NVME for k in KINDS_OF_GROUP[g]]
    for kind in nvme_kinds:
        host += pipeline_depth * largest_chunk * kind.dtype(compute_dtype).itemsize
    if tiers_of["params"] is Tier.NVME:
        host += (units_ahead + 1) * largest_shard * csize
    return {Tier.DEVICE: device, Tier.HOST: host}


def _fits(totals: dict[Tier, int], budgets: Budgets) -> list[str]:
    """The budget violations of `totals`, as readable lines (empty when it fits)."""
    problems = []
    if totals[Tier.DEVICE] > budgets.device:
        problems.append(f"device tier needs {_fmt(totals[Tier.DEVICE])} but memory.device_budget is {_fmt(budgets.device)}")
    if totals[Tier.HOST] > budgets.host:
        problems.append(f"host tier needs {_fmt(totals[Tier.HOST])} but memory.host_budget is {_fmt(budgets.host)}")
    if budgets.shared_ram and totals[Tier.DEVICE] + totals[Tier.HOST] > max(budgets.device, budgets.host):
        problems.append(
            f"device + host tiers share this machine's RAM (no GPU) and need "
            f"{_fmt(totals[Tier.DEVICE] + totals[Tier.HOST])} together, over {_fmt(max(budgets.device, budgets.host))}")
    if totals[Tier.NVME] > budgets.nvme:
        where = "no nvme.paths are set" if budgets.nvme == 0 else f"the nvme.paths have {_fmt(budgets.nvme)} free"
        problems.append(f"nvme tier needs {_fmt(totals[Tier.NVME])} but {where}")
    return problems


def _build(units, compute_dtype, tiers_of: dict[str, Tier], units_ahead: int, reasons=()) -> Plan:
    tiers = tuple({k: tiers_of[g] for g in GROUPS for k in KINDS_OF_GROUP[g]} for _ in units)
    work = working_bytes(units, compute_dtype, tiers_of, units_ahead)
    return Plan(tiers=tiers, units=units, compute_dtype=compute_dtype, working=work, reasons=tuple(reasons))


def plan_placement(units: tuple[UnitSizes, ...], compute_dtype: torch.dtype, *, policy: str,
                   static: dict[str, str], budgets: Budgets, units_ahead: int) -> Plan:
    """Decide the tier of every unit's state kinds and check it against the budgets.

    policy "static": every unit's params / grads / optimizer state on the tiers of
    `static` (the `[placement]` keys). "auto": the fastest tiers that fit, filling
    the device, then the host, then NVMe, in the order params, grads, optimizer
    (params move twice per step, gradients once, optimizer state is touched by the
    CPU only at the step).
    """
    if policy == "static":
        tiers_of = {g: Tier.parse(static[g]) for g in GROUPS}
        plan = _build(units, compute_dtype, tiers_of, units_ahead,
                      [f"{g} on {tiers_of[g].value}: set by placement.{g}" for g in GROUPS])
        problems = _fits(plan.tier_totals(), budgets)
        if problems:
            raise PlacementError(_explain_misfit(problems, units, compute_dtype, budgets, units_ahead))
        return plan
    if policy == "auto":
        return _auto(units, compute_dtype, budgets, units_ahead)
    raise PlacementError(f"placement.policy = {policy!r} is not one of 'static', 'auto'")


def _candidates(units, compute_dtype, budgets, units_ahead):
    """Every uniform placement that fits, fastest first."""
    speed = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.NVME: 2}
    combos = sorted(itertools.product(FASTEST_FIRST, repeat=3),
                    key=lambda c: (3 * speed[c[0]] + 2 * speed[c[1]] + speed[c[2]], c[0].value))
    for combo in combos:
        tiers_of = dict(zip(GROUPS, combo))
        plan = _build(units, compute_dtype, tiers_of, units_ahead)
        if not _fits(plan.tier_totals(), budgets):
            yield tiers_of, plan


def _explain_misfit(problems, units, compute_dtype, budgets, units_ahead) -> str:
    msg = "the placement does not fit: " + "; ".join(problems) + "."
    fit = next(_candidates(units, compute_dtype, budgets, units_ahead), None)
    if fit is not None:
        tiers_of, _ = fit
        msg += (" A placement that fits: [placement] " + " ".join(f'{g} = "{t.value}"' for g, t in tiers_of.items())
                + ' (or policy = "auto"), or raise the budgets.')
    else:
        msg += " No placement fits these budgets: raise memory.host_budget / memory.device_budget, or add nvme.paths with more free space."
    return msg


def _auto(units, compute_dtype, budgets: Budgets, units_ahead: int) -> Plan:
    """Greedy per-unit filling of the fastest tier with room left."""
    # Working buffers assume the worst case (everything streamed from NVMe).
    work = working_bytes(units, compute_dtype, {g: Tier.NVME for g in GROUPS}, units_ahead)
    free = {Tier.DEVICE: budgets.device - work[Tier.DEVICE], Tier.HOST: budgets.host - work[Tier.HOST],
            Tier.NVME: budgets.nvme}
    ram_left = max(budgets.device, budgets.host) - work[Tier.DEVICE] - work[Tier.HOST] if budgets.shared_ram else None
    tiers = [dict() for _ in units]
    reasons = []
    order = sorted(range(len(units)), key=lambda i: -units[i].shard_numel)
    for group in GROUPS:
        placed = {t: 0 for t in Tier}
        for i in order:
            need = sum(units[i].shard_numel * k.dtype(compute_dtype).itemsize for k in KINDS_OF_GROUP[group])
            for tier in FASTEST_FIRST:
                ram_ok = ram_left is None or tier is Tier.NVME or need <= ram_left
                if need <= free[tier] and ram_ok:
                    free[tier] -= need
                    if ram_left is not None and tier is not Tier.NVME:
                        ram_left -= need
                    placed[tier] += 1
                    for k in KINDS_OF_GROUP[group]:
                        tiers[i][k] = tier
                    break
            else:
                raise PlacementError(
                    f"placement.policy = \"auto\" found no room for the {group} of unit {units[i].name} "
                    f"({_fmt(need)}): raise memory.host_budget / memory.device_budget or add nvme.paths with more free space.")
        reasons.append(f"{group}: " + ", ".join(f"{n} unit(s) on {t.value}" for t, n in placed.items() if n)
                       + " (fastest tier with room, largest units first)")
    used = {g: Tier.NVME if any(tiers[i][KINDS_OF_GROUP[g][0]] is Tier.NVME for i in range(len(units))) else Tier.HOST
            for g in GROUPS}
    real_work = working_bytes(units, compute_dtype, used, units_ahead)
    return Plan(tiers=tuple(tiers), units=units, compute_dtype=compute_dtype, working=real_work, reasons=tuple(reasons))


def _fmt(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit} ({n} bytes)"
    return f"{n} bytes"
