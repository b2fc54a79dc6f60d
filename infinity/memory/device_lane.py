"""The device lane: a second worker steps host-state units on the GPU beside the CPU's, when the update waits for
the global norm or runs during backward. Planned here (its units, their staging, the gradients kept for it); it runs in
optim/worker.py (which units each takes), optim/offloaded.py (the update on the device) and
runtime/update_modes.py (the deferred and eager updates that offer it the units).
"""

from __future__ import annotations

import dataclasses
import itertools

from infinity.memory import traffic
from infinity.memory.plan import Budgets, PlacementError, Plan, fmt_bytes, misfits, with_inert
from infinity.memory.tier import Kind, Tier

# Note [device lane]: with the clip firing (or fp16, or skipped non-finite steps without speculation) no unit can be
# updated before the global norm is known, at backward's end; the CPU's Adam of every host-state unit then runs
# after it, and the next forward covers only part of it (the H100's case b: ~150 ms of CPU Adam after the norm,
# 85 ms of forward: 1.31x the unclipped step). The GPU is idle then, and PCIe's upward direction carries only the
# updated parameters. So a second worker, the lane, steps host-state units on the GPU: their state copied up,
# fused Adam on the device, the master and moments copied back (12 bytes an element in fp32) and the parameters
# written where they live. Up go the moments (8 bytes), the gradient (4) unless the device kept it, and the
# master (4) unless parameters of its dtype on the device hold the same values (optim/offloaded.py: then the
# lane updates them in place). At PCIe's ~55 GB/s each way that is about the CPU's own rate (4-5 G elements/s):
# together they roughly halve what the forward waits for. The two take units from either end of the forward's
# order (optim/worker.py): the CPU the forward's first, the lane its last, until they meet, so the split follows
# the rates the machine has at that moment, nothing measured in advance (where other units' optimizer state is on
# NVMe the CPU's worker merges every ready batch into one pipeline, claiming them all at once: the lane then takes
# only what arrives later). The lane keeps two units in flight (the
# next one's copies up beside this one's down), whose staging the plan fits on the device, and queues at most two
# sub-groups' copies up at a time, so the CPU's uploads for the next forward never wait behind a whole unit's.
# The device also keeps the window's final gradient of the forward's last lane units (`lane_grads`: the ones the
# lane takes first), which backward produced there, so the lane need not copy it up (handed over by the
# GradReducer's `keep_final`; still stored to the host too: the CPU may take the unit, a checkpoint may read it).
# They are held from their unit's backward to the update, beside the activations, so they are at most half of the
# lane units' gradients, within a quarter of the device memory the plan leaves free. Simulated in case b's H100
# proportions (tests/device/test_simulated_schedule.py): the clipped step from 1.26x the unclipped one to 1.065x
# (1.095x with no gradient kept or the master copied up; 1.082x with a whole unit's copies queued at once).
# The lane runs on a stream of its own (Streams.lane), so the worker's parameter uploads never wait behind it; it
# waits for its paced copies by polling (a CUDA event's synchronize would spin a core the CPU's Adam needs), and
# for a kept gradient's copy to the host before the update unscales it in place. A step offers the lane all its
# units at once (`OptimizerWorker.offering`): woken by the first offer, it would otherwise take whichever came
# last so far. On a GPU the lane's units take the GPU's fused Adam (as tail units do: a few ulps from the CPU's)
# and which units it takes depends on timing, so a run with the lane is not bitwise reproducible on a GPU (nor is
# its resume); on the CPU, where the tests force it, it is.
# Without clipping (the eager update: each unit submitted as backward finalizes it) the lane helps the same way
# where the CPU's Adam is the step's largest floor, as with no tail units (the memory-bound case m1,
# benchmarks/bench_offload_bound.py): the units are offered one at a time as their gradients are final, the lane
# takes the earliest offered left (the forward's last), the CPU's worker the forward's first of what it has, and
# after backward they meet as above (simulated in m1's proportions: 0.55x the step without the lane, whose copies
# back then share the d2h direction with backward's gradients, which the simulation leaves out). No gradient is
# kept for it there (the unit's gradient is final when it is offered; the lane copies it up). Keeping the forward's
# last 11 of 23 units' gradients was tried in m1's proportions with 4 micro-batches a step (2026-11-28): the window
# came to 0.867 or 0.840 of torch's speed by whether the lane took 7 or 8 units (its quicker copies up let it take
# one more, whose copies then delay the CPU's uploads for the next forward), against 0.845-0.848 without: no gain
# to count on, so none is kept.
# Only units whose gradients and whole optimizer state are on the host tier, and whose parameters are not on
# NVMe (their writes follow the fresh copies, Note [fresh parameters]); not speculated updates (their journal is
# the CPU's) nor the update on the training thread; nothing without a GPU, where both would be the same cores.
LANE_UNITS_IN_FLIGHT = 2  # units whose copies back may be running (the lane's staging)
LANE_CHUNKS_IN_FLIGHT = 2  # optimizer chunks whose copies up may be queued (what an upload waits behind)
LANE_KINDS = (Kind.MASTER, Kind.EXP_AVG, Kind.EXP_AVG_SQ, Kind.GRADS)  # what a lane update copies up


def lane_units(plan: Plan) -> list[int]:
    """The units whose update the lane may run (Note [device lane])."""
    return [u for u, sizes in enumerate(plan.units) if sizes.numel(Kind.MASTER)
            and all(plan.tier(u, k) is Tier.HOST for k in LANE_KINDS) and plan.tier(u, Kind.PARAMS) is not Tier.NVME]


def lane_staging_bytes(plan: Plan, units: list[int]) -> int:
    """Device bytes of the lane's updates in flight: the largest units' state and gradients, as stored, twice."""
    per_unit = sorted((sum(plan.units[u].numel(k) * plan.dtype(k).itemsize for k in LANE_KINDS) for u in units),
                      reverse=True)
    return sum(per_unit[:LANE_UNITS_IN_FLIGHT])


def with_device_lane(plan: Plan, setting: str, budgets: Budgets, *, defers_update: bool, eager_update: bool) -> Plan:
    """`plan` with its device lane (Note [device lane]) for `overlap.device_lane` = `setting`: the units, and their
    staging as a device working term, when the worker steps the units without a journal (the update waits for the
    norm, `defers_update`, or runs during backward, `eager_update`); the gradients kept on the device for it when it
    waits for the norm; a setting that cannot act is said (Note [inert setting])."""
    if setting == "off":
        return plan
    units = lane_units(plan)
    why_not = ("no GPU (the CPU would run both)" if budgets.shared_ram else
               "the update runs on the training thread (overlap.optimizer_with_backward = false) or speculates (its "
               "journal is the CPU's)" if not (defers_update or eager_update) else
               "no unit has its gradients and optimizer state on the host tier" if not units else None)
    if why_not is not None:
        return with_inert(plan, f"overlap.device_lane = \"on\": nothing is updated on the GPU: {why_not}")
    staging = lane_staging_bytes(plan, units)
    lane = traffic.with_working_term(plan, Tier.DEVICE, "device_lane", staging, device_lane=tuple(units))
    if misfits(lane.tier_totals(), budgets):
        free = budgets.device - plan.tier_totals()[Tier.DEVICE]
        raise PlacementError(
            f"overlap.device_lane = \"on\" needs {fmt_bytes(staging)} of device memory for {LANE_UNITS_IN_FLIGHT} "
            f"units' state and gradients in flight, but the plan leaves {fmt_bytes(free)} under "
            f"memory.device_budget: set it to \"off\", or raise memory.device_budget")
    elements = sum(plan.units[u].numel(Kind.MASTER) for u in units)
    when = "after the global norm" if defers_update else "as backward finalizes them"
    reason = (f"device lane: {when}, units {_ranges(units)} ({elements:,} trainable elements) may be updated on "
              f"the GPU, from the forward's last, while the CPU updates from its first; {fmt_bytes(staging)} of "
              f"device staging (Note [device lane])")
    lane = dataclasses.replace(lane, reasons=lane.reasons + (reason,))
    return with_lane_grads(lane, budgets) if defers_update else lane


def with_lane_grads(plan: Plan, budgets: Budgets) -> Plan:
    """`plan` with the final gradients of its last lane units kept on the device (Note [device lane]): from the
    forward's last, up to half of the lane units' gradient bytes, within a quarter of the device memory left."""
    room = (budgets.device - plan.tier_totals()[Tier.DEVICE]) // 4
    grad_bytes = {u: plan.units[u].numel(Kind.GRADS) * plan.dtype(Kind.GRADS).itemsize for u in plan.device_lane}
    cap = min(room, sum(grad_bytes.values()) // 2)
    kept, taken = [], 0
    for u in reversed(plan.device_lane):
        if taken + grad_bytes[u] > cap:
            break
        kept.append(u)
        taken += grad_bytes[u]
    if not kept:
        return plan
    reason = (f"device lane: the final gradients of units {_ranges(sorted(kept))} ({fmt_bytes(taken)}) stay on the "
              f"device for it, from their backward to the update (Note [device lane])")
    return traffic.with_working_term(plan, Tier.DEVICE, "device_lane_grads", taken, lane_grads=tuple(sorted(kept)),
                                     reasons=plan.reasons + (reason,))


def _ranges(units: list[int]) -> str:
    """`0-3, 5, 7-9` for [0, 1, 2, 3, 5, 7, 8, 9]."""
    runs = []
    for _, group in itertools.groupby(enumerate(units), key=lambda iu: iu[1] - iu[0]):
        members = [u for _, u in group]
        runs.append(f"{members[0]}-{members[-1]}" if len(members) > 1 else f"{members[0]}")
    return ", ".join(runs)


