"""Tiers, state kinds and the residency states of one stored shard.

A *shard* is one rank's slice of one unit's flattened state of one kind. Every
shard lives on exactly one tier, decided once by the placement plan. On the
NVMe tier a shard is split into chunks (optimizer sub-groups), each of which
moves between the disk and a staging buffer through the states below.
"""

from __future__ import annotations

import enum

import torch


class Tier(enum.Enum):
    """Where a shard lives."""

    DEVICE = "device"  # GPU HBM; the compute device's memory on a machine without a GPU
    HOST = "host"  # CPU RAM, pinned when CUDA is present
    NVME = "nvme"  # io_engine swap space

    __hash__ = object.__hash__  # (as Kind's)

    @classmethod
    def parse(cls, name: str) -> "Tier":
        return cls(name)


class StateDtype(enum.Enum):
    """`[optimizer] state_dtype`: what the optimizer's state kinds are stored in (Note [16-bit optimizer state]
    in optim/state_update.py). The update itself is computed in fp32 in every mode."""

    FP32 = "fp32"  # master and both moments fp32: 12 bytes per trainable element
    BF16 = "bf16"  # moments bf16 (rounded to nearest), master fp32: 8
    BF16_MASTER = "bf16_master"  # master bf16 too (stochastic rounding), moments bf16: 6


class Kind(enum.Enum):
    """The state kinds of a unit. PARAMS is in the compute dtype, GRADS fp32, the optimizer's kinds as
    `[optimizer] state_dtype` says (`Kind.dtype`: the one answer)."""

    PARAMS = "params"
    GRADS = "grads"
    MASTER = "master"
    EXP_AVG = "exp_avg"
    EXP_AVG_SQ = "exp_avg_sq"

    # members are singletons: hashed by identity, in C (Enum hashes its name in Python, and an estimate's plan
    # search hashes kinds and tiers ~10^6 times)
    __hash__ = object.__hash__

    @property
    def group(self) -> str:
        """The `[placement]` key that places this kind."""
        return "params" if self is Kind.PARAMS else "grads" if self is Kind.GRADS else "optimizer"

    def dtype(self, compute_dtype: torch.dtype, state_dtype: StateDtype) -> torch.dtype:
        """The dtype this kind of state lives in, given the compute dtype and `[optimizer] state_dtype`."""
        if self is Kind.PARAMS:
            return compute_dtype
        if self is Kind.GRADS or state_dtype is StateDtype.FP32:
            return torch.float32
        if self is Kind.MASTER and state_dtype is StateDtype.BF16:
            return torch.float32
        return torch.bfloat16  # the moments in both 16-bit modes, the master with "bf16_master"


OPTIMIZER_KINDS = (Kind.MASTER, Kind.EXP_AVG, Kind.EXP_AVG_SQ)


def params_alias_master(compute_dtype: torch.dtype, master_dtype: torch.dtype, params: Tier, optimizer: Tier,
                        same_layout: bool) -> bool:
    """Whether a unit's parameters are stored as its master (Note [aliased parameters]); `same_layout`:
    the rank stores the same elements in the same chunks of both (`UnitSizes.params_match_update`).

    Note [aliased parameters]: the parameters are the cast of the master weights to
    the compute dtype. When the compute dtype is the master's (fp32 and an fp32 master, or bf16 and a
    bf16 master: `[optimizer] state_dtype = "bf16_master"`) the cast is the identity, so when both live
    on NVMe they are one set of extents: the master's.
    A parameter fetch reads the master's extents; an update writes the master once
    (not the master and then the same bytes again as parameters), and the buffer it
    wrote from is what the fresh copies keep for the next forward (memory/fresh.py).
    Per step that saves one parameter-sized write, its memcpy and its checksum, and
    the parameters take no NVMe space of their own. Only NVMe is aliased: that is
    where the duplicate costs disk bandwidth; on a resident tier it is one memcpy, and
    the module's parameters may be views of the parameter storage itself. Only one layout is
    aliased: where the rank stores parameters it does not update (frozen weights, which have no
    master; the whole unit at stages 1-2, of which it updates a partition) they are their own.
    """
    return compute_dtype == master_dtype and params is Tier.NVME and optimizer is Tier.NVME and same_layout


def uploads_master(params: Tier, optimizer: Tier, cuda: bool) -> bool:
    """Whether an update's new parameters go up to the device as the master's own host bytes, in the master's
    dtype, cast to the compute dtype on the device (Note [async upload] in memory/manager.py): parameters on the
    device, the optimizer state in host memory, a GPU. Per element that moves the master's bytes up (4 for an
    fp32 master under bf16 compute, not 2) and takes the cast off the CPU that runs the update."""
    return cuda and params is Tier.DEVICE and optimizer is Tier.HOST


class Residency(enum.Enum):
    """Lifecycle of one stored chunk.

    Legal transitions (asserted by the manager)::

        ZERO      -> RESIDENT (resident tiers: zeroed on first touch) | WRITING (NVMe store) | ZERO
        RESIDENT  -> READING (NVMe fetch issued) | WRITING (NVMe store) | RESIDENT | ZERO
        READING   -> RESIDENT (read waited) | READING (a second reader)
        WRITING   -> RESIDENT (write waited)

    ZERO means the contents are all zeros and nothing needs to be read: fresh
    optimizer moments and gradients at the start of an accumulation window.
    A chunk is never declared ZERO while a read or write of it is in flight.
    """

    ZERO = "zero"
    RESIDENT = "resident"
    READING = "reading"
    WRITING = "writing"


LEGAL_TRANSITIONS = {
    Residency.ZERO: {Residency.RESIDENT, Residency.WRITING, Residency.ZERO},
    Residency.RESIDENT: {Residency.READING, Residency.WRITING, Residency.RESIDENT, Residency.ZERO},
    Residency.READING: {Residency.RESIDENT, Residency.READING},
    Residency.WRITING: {Residency.RESIDENT},
}


def check_transition(old: Residency, new: Residency, what: str) -> None:
    assert new in LEGAL_TRANSITIONS[old], f"illegal residency transition {old.name} -> {new.name} for {what}"
