"""Bytes each link moves in one optimizer step, predicted from the plan (a pure function).

Per micro-batch, a unit's parameter shard is fetched for its forward and again for
its backward; the root unit once (it stays unsharded through both). Gradients are
written once per micro-batch and read back to accumulate from the second micro-batch
on, and once more by the optimizer (parameter chunks it keeps in memory are not read back by
the next forward: Note [fresh parameters]). The optimizer reads the fp32 master and both
moments (the moments only once they exist: before the first update they are zero
and nothing is read) and writes all three, plus the new compute-dtype parameters
(unless they alias the master: Note [aliased parameters] in tier.py).
On a machine without a GPU, device and host are the same memory: no copy is a link.
The profile's per-link bytes are checked against this exactly (tests/test_profile_traffic.py).
"""

from __future__ import annotations

from .placement import Plan
from .tier import Kind, OPTIMIZER_KINDS, Tier


def bytes_per_step(plan: Plan, *, grad_accum_steps: int, first_step: bool, cuda: bool,
                   kept: frozenset[tuple[int, int]] = frozenset()) -> dict[str, int]:
    """Predicted bytes per link for one optimizer step ("nvme_read", "nvme_write", "h2d", "d2h").
    `kept`: the (unit, chunk)s of parameters whose first fetch after an update reads the copy kept in
    memory, not the disk (Note [fresh parameters]; `Engine.kept_params`)."""
    out = {"nvme_read": 0, "nvme_write": 0, "h2d": 0, "d2h": 0}
    cbytes = plan.compute_dtype.itemsize
    accum = grad_accum_steps
    for index, sizes in enumerate(plan.units):
        shard = sizes.shard_numel
        if shard == 0:
            continue
        tier = {k: plan.tier(index, k) for k in Kind}
        fetches = accum * (1 if index == 0 else 2)
        params = shard * cbytes
        if tier[Kind.PARAMS] is Tier.NVME:
            out["nvme_read"] += fetches * params
            if not first_step:  # the previous step's update kept these chunks: the first fetch reads memory
                out["nvme_read"] -= sum(n for c, n in enumerate(sizes.chunk_numels) if (index, c) in kept) * cbytes
            if not plan.aliases_master(index):  # aliased: the master's write is theirs (Note [aliased parameters])
                out["nvme_write"] += params  # the optimizer's new parameters
            out["h2d"] += fetches * params if cuda else 0
        elif tier[Kind.PARAMS] is Tier.HOST and cuda:
            out["h2d"] += fetches * params
        grads = shard * 4
        if tier[Kind.GRADS] is Tier.NVME:
            out["nvme_write"] += accum * grads
            out["nvme_read"] += (accum - 1) * grads + grads  # accumulation, then the optimizer
        optimizer_state = [k for k in OPTIMIZER_KINDS if tier[k] is Tier.NVME]
        for kind in optimizer_state:
            read = kind is Kind.MASTER or not first_step
            out["nvme_read"] += shard * 4 if read else 0
            out["nvme_write"] += shard * 4
    return out
