"""The plan's types: what a unit stores (`UnitSizes`), the budgets, the `Plan` (the tier of every unit's kinds)
and the bytes of state it implies, and the error a plan that does not fit raises. The planner
(placement.py), the byte model (traffic.py) and the cost model all speak in these.

Note [state bytes]: state bytes per tier and kind. What a rank stores of each kind of a unit
(its `UnitLayout`, Note [stage layouts] in stages.py: the whole unit or a partition, and for
gradients and optimizer state its trainable elements only) takes `numel * itemsize` on its tier
(parameters in the compute dtype, gradients fp32, the optimizer's kinds as `[optimizer] state_dtype`
says: `optimizer_bytes_per_element`, 12 / 8 / 6): frozen weights cost only their parameter bytes.
Parameters that alias the master (Note [aliased parameters] in tier.py) take none of their own.
`group_bytes` applies it to one unit; NVMe extents' alignment is not counted.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

from infinity.memory.stages import KindLayout, UnitLayout
from infinity.memory.tier import OPTIMIZER_KINDS, Kind, StateDtype, Tier, params_alias_master
from io_engine import format_size

GROUPS = ("params", "grads", "optimizer")
KINDS_OF_GROUP = {"params": (Kind.PARAMS,), "grads": (Kind.GRADS,), "optimizer": OPTIMIZER_KINDS}
FASTEST_FIRST = (Tier.DEVICE, Tier.HOST, Tier.NVME)


class PlacementError(ValueError):
    """The requested placement cannot fit the budgets; the message says what would."""


@dataclass(frozen=True, kw_only=True)
class Budgets:
    """Resolved byte budgets. `shared_ram` is set when DEVICE and HOST are the same RAM (no GPU)."""

    device: int
    host: int
    nvme: int  # free bytes on the swap paths (0 when none configured)
    shared_ram: bool = False
    ram: int | None = None  # with shared_ram: the RAM detected for this rank, which device + host must fit together
    activations: int | None = None  # device bytes left for activations by tail units (None: not known)

    def reserving(self, activations: int) -> Budgets:
        """These budgets with the traced `activations` (device bytes) left by tail units, unless a size was set
        (memory.activation_reserve: Note [tail units])."""
        return self if self.activations is not None else dataclasses.replace(self, activations=activations)

    @property
    def shared_limit(self) -> int:
        """What DEVICE + HOST must fit in together when they are the same RAM."""
        return self.ram if self.ram is not None else max(self.device, self.host)


@dataclass(frozen=True)
class Plan:
    """The tier of every (unit, kind), and the bytes it implies."""

    tiers: tuple[dict[Kind, Tier], ...]  # indexed by unit index
    units: tuple[UnitSizes, ...]
    compute_dtype: torch.dtype
    working: dict[Tier, int] = field(default_factory=dict)  # staging / unsharded buffers, bytes (the terms' sums)
    working_terms: dict[Tier, dict[str, int]] = field(default_factory=dict)  # Note [working memory] (traffic.py)
    read_ahead: int = 0  # bytes the state read-ahead may hold (Note [state read-ahead]); in working_terms
    speculation: int = 0  # bytes of pre-update copies (Note [speculative update]); in working_terms
    device_lane: tuple[int, ...] = ()  # units a deferred update may step on the GPU (Note [device lane]); in working
    lane_grads: tuple[int, ...] = ()  # of those, the units whose final gradient the device keeps for it; in working
    reasons: tuple[str, ...] = ()
    inert: tuple[str, ...] = ()  # settings that do nothing in this plan, also in reasons (Note [inert setting])
    unit_reasons: tuple[dict[str, str], ...] = ()  # per unit: group -> why it is on its tier (auto policy)
    state_dtype: StateDtype = StateDtype.FP32  # `[optimizer] state_dtype` (Note [16-bit optimizer state])

    def tier(self, unit: int, kind: Kind) -> Tier:
        return self.tiers[unit][kind]

    def dtype(self, kind: Kind) -> torch.dtype:
        """The dtype `kind` is stored in (`Kind.dtype`, given this plan's compute and state dtypes)."""
        return kind.dtype(self.compute_dtype, self.state_dtype)

    def uses(self, tier: Tier) -> bool:
        return any(t is tier for unit_tiers in self.tiers for t in unit_tiers.values())

    def aliases_master(self, unit: int) -> bool:
        """The unit's parameters are stored as its fp32 master (Note [aliased parameters], tier.py)."""
        tiers = {"params": self.tier(unit, Kind.PARAMS), "optimizer": self.tier(unit, Kind.MASTER)}
        return aliased(self.units[unit], tiers, self.compute_dtype, self.state_dtype)

    def state_bytes(self) -> dict[Tier, dict[Kind, int]]:
        """Bytes of state per tier and kind (Note [state bytes], traffic.py); a fresh copy of the plan's."""
        return {t: dict(kinds) for t, kinds in self._state_bytes.items()}

    @functools.cached_property
    def _state_bytes(self) -> dict[Tier, dict[Kind, int]]:  # once per plan: the estimate's table and search ask often
        return state_bytes(self)

    def tier_totals(self) -> dict[Tier, int]:
        per = self.state_bytes()
        return {t: sum(per[t].values()) + self.working.get(t, 0) for t in Tier}

    def placement_text(self) -> str:
        """Where each `[placement]` group's state is planned, e.g. `params=device grads=host optimizer=nvme`
        (a group over several tiers: `host+nvme`)."""
        groups: dict[str, set[Tier]] = {}
        for unit_tiers in self.tiers:
            for kind, tier in unit_tiers.items():
                groups.setdefault(kind.group, set()).add(tier)
        order = list(Tier)
        return " ".join(f"{g}={'+'.join(t.value for t in sorted(groups[g], key=order.index))}"
                        for g in ("params", "grads", "optimizer") if g in groups)



@dataclass(frozen=True, kw_only=True)
class UnitSizes:
    """What placement needs to know about one unit on this rank: what it stores of each kind (its
    `UnitLayout`, Note [stage layouts] in stages.py) and how many of the unit's elements are trainable."""

    name: str
    layout: UnitLayout
    trainable_numel: int  # elements of the unit's flat buffer [0, T) with gradients and optimizer state
    fetches: int = 2  # parameter fetches per micro-batch: forward, backward (3: a whole-block recomputation's too)

    @classmethod
    def uniform(cls, name: str, shard_numel: int, unsharded_numel: int | None = None,
                chunk_numels: tuple[int, ...] | None = None) -> "UnitSizes":
        """Every kind stores the same all-trainable shard (stage 3's layout of a unit without frozen weights)."""
        unsharded_numel = shard_numel if unsharded_numel is None else unsharded_numel
        chunks = tuple(chunk_numels if chunk_numels is not None else (shard_numel,) if shard_numel else ())
        same = KindLayout(0, shard_numel, chunks, 0, len(chunks))
        return cls(name=name, layout=UnitLayout(params=same, grads=same, update=same, unsharded_numel=unsharded_numel,
                                                flat_grad_numel=unsharded_numel), trainable_numel=unsharded_numel)

    def numel(self, kind: Kind) -> int:
        """Elements this rank stores of `kind`."""
        return self.layout.of(kind).numel

    def chunks(self, kind: Kind) -> tuple[int, ...]:
        return self.layout.of(kind).chunks

    @property
    def unsharded_numel(self) -> int:
        """Elements of the whole unit, padded to the world size."""
        return self.layout.unsharded_numel

    @property
    def shard_numel(self) -> int:
        """Elements this rank stores of the parameters (stage 3: its partition; stages 0-2: the whole unit)."""
        return self.layout.params.numel

    @property
    def written_params(self) -> int:
        """Parameter elements an update rewrites on this rank: the trainable ones it stores (frozen ones never
        change; at stages 1-2 the other ranks' updated partitions arrive by all-gather and are stored too)."""
        p = self.layout.params
        return max(0, min(p.start + p.numel, self.trainable_numel) - p.start)

    @property
    def params_match_update(self) -> bool:
        """The parameters and the update range are the same elements in the same chunks: the condition
        for storing the parameters as the master (Note [aliased parameters], tier.py)."""
        return self.layout.params == self.layout.update



def itemsize(kind: Kind, state_dtype: StateDtype, compute_dtype: torch.dtype = torch.float32) -> int:
    """Bytes per element of `kind` (`Kind.dtype`: the one answer to its dtype)."""
    return kind.dtype(compute_dtype, state_dtype).itemsize


def optimizer_bytes_per_element(state_dtype: StateDtype) -> int:
    """Bytes of optimizer state (master and both moments) per trainable element: 12 (fp32), 8 (bf16 moments),
    6 (bf16 master and moments); Note [16-bit optimizer state] in optim/state_update.py."""
    return sum(itemsize(k, state_dtype) for k in OPTIMIZER_KINDS)


def aliased(sizes: UnitSizes, tiers: dict[str, Tier], compute_dtype: torch.dtype,
            state_dtype: StateDtype = StateDtype.FP32) -> bool:
    """Whether the unit's parameters are stored as its master on `tiers` (Note [aliased parameters])."""
    return params_alias_master(compute_dtype, Kind.MASTER.dtype(compute_dtype, state_dtype), tiers["params"],
                               tiers["optimizer"], sizes.params_match_update)


def group_bytes(sizes: UnitSizes, group: str, tiers: dict[str, Tier], compute_dtype: torch.dtype,
                state_dtype: StateDtype = StateDtype.FP32) -> int:
    """Bytes one unit's `group` takes on its tier (Note [state bytes])."""
    if group == "params" and aliased(sizes, tiers, compute_dtype, state_dtype):
        return 0  # stored as the master (Note [aliased parameters])
    return sum(sizes.numel(kind) * itemsize(kind, state_dtype, compute_dtype) for kind in KINDS_OF_GROUP[group])


def state_bytes(plan: Plan) -> dict[Tier, dict[Kind, int]]:
    """Bytes of state per tier and kind (NVMe extents' alignment not included). Units alike (a model's blocks:
    the same layout on the same tiers) are counted once and multiplied (an estimate plans 80 blocks ~100 times)."""
    out: dict[Tier, dict[Kind, int]] = {t: {k: 0 for k in Kind} for t in Tier}
    alike: dict[tuple, list] = {}  # (layout, tiers) -> [a unit of them, how many]
    for unit, (sizes, unit_tiers) in enumerate(zip(plan.units, plan.tiers)):
        # the layout by identity: repeated blocks share one layout object; equal ones that do not are only
        # counted apart (hashing a layout's chunks per unit and plan was a third of a 70B plan search)
        entry = alike.setdefault((id(sizes.layout), sizes.trainable_numel, tuple(unit_tiers.items())), [unit, 0])
        entry[1] += 1
    for (_, _, unit_tiers), (unit, count) in alike.items():
        sizes = plan.units[unit]
        for kind, tier in unit_tiers:
            if kind is Kind.PARAMS and plan.aliases_master(unit):
                continue
            out[tier][kind] += count * sizes.numel(kind) * plan.dtype(kind).itemsize
    return out


def overflows(totals: dict[Tier, int], budgets: Budgets) -> dict[str, str]:
    """The budget violations of `totals` by binding memory ("device", "host", "ram" when device and host
    share it, "nvme"), each as a readable line; empty when it fits."""
    problems = {}
    if totals[Tier.DEVICE] > budgets.device:
        problems["device"] = (
            f"device tier needs {fmt_bytes(totals[Tier.DEVICE])} but memory.device_budget is "
            f"{fmt_bytes(budgets.device)}"
        )
    if totals[Tier.HOST] > budgets.host:
        problems["host"] = (f"host tier needs {fmt_bytes(totals[Tier.HOST])} but memory.host_budget is "
                            f"{fmt_bytes(budgets.host)}")
    if budgets.shared_ram and totals[Tier.DEVICE] + totals[Tier.HOST] > budgets.shared_limit:
        problems["ram"] = (
            f"device + host tiers share this machine's RAM (no GPU) and need "
            f"{fmt_bytes(totals[Tier.DEVICE] + totals[Tier.HOST])} together, over the "
            f"{fmt_bytes(budgets.shared_limit)} available"
        )
    if totals[Tier.NVME] > budgets.nvme:
        where = ("the nvme.paths have no room (none is set, or their disks are within memory.headroom of full)"
                 if budgets.nvme == 0 else f"the nvme.paths have {fmt_bytes(budgets.nvme)} free")
        problems["nvme"] = f"nvme tier needs {fmt_bytes(totals[Tier.NVME])} but {where}"
    return problems


def misfits(totals: dict[Tier, int], budgets: Budgets) -> list[str]:
    """The budget violations of `totals`, as readable lines (empty when it fits)."""
    return list(overflows(totals, budgets).values())


# Note [inert setting]: a setting the plan cannot act on (overlap.device_lane = "on" without a GPU, or where the
# update does not wait for the norm; an overlap.speculation no unit can use) is not an error: the same job file
# runs on the GPU machine it was written for and on a CPU one trying it. It is not ignored either: the plan says
# it in its reasons (`infinity estimate`), and `initialize` warns with a SettingWarning naming the key and why
# (runtime/planning.py), which the `infinity` command prints as one line, "infinity train: warning: ...".
def with_inert(plan: Plan, line: str) -> Plan:
    """`plan` saying that a setting does nothing in it (Note [inert setting])."""
    return dataclasses.replace(plan, reasons=plan.reasons + (line,), inert=plan.inert + (line,))


def fmt_bytes(n: int) -> str:
    return f"{format_size(n, exact=False)} ({n} bytes)"
