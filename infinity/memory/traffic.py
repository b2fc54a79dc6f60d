"""The byte model: how many bytes of which kind live where, and move over which link, per step.

One module answers it for a plan, and everyone asks it: the planner (`placement`: what it fits
to the budgets), the auto policy's cost model (`cost_model.predict_step_time` of `plan_traffic`),
`infinity estimate` (its peak terms), the engine's `memory_report()["plan"]` (`plan_report`),
bench_step's I/O floors and the profile-equals-plan test (`bytes_per_step`). Three answers:

Note [working memory]: the buffers a step needs beyond the state, per tier, term by term
(`working_terms`; the plan carries them and the planner fits their sum with the state):

    DEVICE unsharded       the root unit and up to `units_ahead + 1` of the largest other units gathered
                           (the one running and the prefetched ones; one more while a block checkpointed
                           whole recomputes: Note [tiles are units]), compute dtype
           flat_grad       the largest fp32 flat gradient (a unit's trainable prefix, or the whole unit where a
                           reduce-scatter partitions it: Note [trainable flat gradient]) and its reduce-scattered
                           shard (`flat_grad_bytes`)
           grad_sum_ahead  accumulating (grad_accum_steps > 1) with gradients off the device (NVMe without one):
                           the largest non-root unit's gradient sum so far, fetched as its backward starts (Note
                           [gradient sums ahead] in runtime/grad_reduce.py) beside the one being added
           upload_cast     with parameters on the device and an fp32 master in host memory under 16-bit
                           compute, one optimizer chunk's new master on its way up, cast there (Note
                           [async upload] in manager.py; the worker's stream reuses it chunk after chunk)
    HOST   update_staging  the update pipeline's staging pool: a replay of two optimizer steps' buffer
                           requests (OffloadedOptimizer reads UPDATE_READS_AHEAD tasks ahead and keeps at
                           most UPDATE_WRITES_IN_FLIGHT stores pending) over io_engine's size classes
                           (`io_engine.size_class`; the pool keeps every buffer it allocated)
           read_ahead      the state read-ahead (Note [state read-ahead]) beyond those buffers: it holds
                           `plan.read_ahead` bytes of the next update's NVMe state, and the update's
                           write-behind of the chunks taken from it; the pool recycles one into the other
           fresh_params    parameters kept after their write (Note [fresh parameters], fresh.py)
           speculation     the pre-update copies of speculated updates (Note [speculative update]): `plan.speculation`
                           bytes, resolved after the read-ahead from the host memory the plan leaves free
           param_staging   with a GPU, parameters read from NVMe for compute pass through host staging:
                           `units_ahead + 1` of the largest shards (without one they land in the
                           unsharded buffers: Note [unsharded memory])

The read-ahead's budget is part of the plan: "auto" takes half of the host memory the rest of the
plan leaves free under the budgets, so a host budget bounds it (`resolve_read_ahead`).
Activations are not known when planning; `infinity estimate` traces them (Note [peak memory]).

Note [peak memory]: (`peak_terms` in infinity/plan/estimate.py) the predicted peak of one rank's process
memory (RSS without a GPU; with a GPU, `ram` is host memory and `device` the CUDA peak) is the sum of
named terms:

    runtime       RSS of a fresh Python process that imported torch, infinity and what the run imports beside
                  them (transformers' model, its tokenizer, PEFT: models/build.py `runtime_modules`), and
                  that read a sample of each kind of record file the data is in (pyarrow's reader holds ~65 MiB
                  more than its import: data/tokenized.py `reader_modules`), measured once per set and cached
    state         state bytes on the tiers in that memory (device and host share the RAM without a GPU)
    working       the plan's working buffers, term by term as the planner fitted them to the budgets
                  (Note [working memory] above): unsharded units, the flat gradient,
                  the update's staging, the state read-ahead, fresh parameters
    activations   tensors saved for backward in one micro-batch (traced), plus the largest of them
                  again for the transient of its gradient; with `[activation] checkpoint = "units"` the
                  units' inputs, the root's saves and one unit's recompute instead, and with offload =
                  "host" the inputs as `activations_host` in host memory (Note [activation estimate])
    allocator     without a GPU, half of (the device working buffers + activations) again: glibc keeps
                  the heap pages of freed transient tensors (measured ~1.5x their live bytes on Linux
                  within a step; across steps only with `[memory] release_heap`, Note [heap release]);
                  not the unsharded parameters, which the pool maps itself (Note [unsharded memory])
    init          while a unit is materialized: its full fp32 values, its shard and their casts; read from a
                  pretrained directory, only the shard and its cast (the weights are read into the shard; what
                  the directory lacks, LoRA's adapters, is small) (replaces working + activations + allocator
                  when larger)

Note [traffic per step]: what one optimizer step with `accum` micro-batches moves, per unit
(P, G, O = the bytes this rank stores of its params, gradients and optimizer state, each by its
own layout; W = the trainable part of P, what an update rewrites); `unit_traffic`, by phase:

    params     fetched before forward and again before backward: 2 * accum fetches (3 * accum for the units
               of a block checkpointed whole, fetched for its recomputation too: Note [tiles are units])
               (the root unit stays gathered from forward to the end of backward: accum).
               nvme: read P each fetch (+ h2d P with a GPU); host: h2d P with a GPU.
               After the optimizer step the new params are written: nvme: write W (none when they
               alias the master: its write is theirs); the first fetch after it reads the copy kept
               in memory, not the disk (Note [fresh parameters]: the engine's `kept_params` says
               which chunks). With a GPU, new params cross once between where Adam ran and their tier (W;
               from a host-tier master to device parameters in the master's dtype, cast on the device:
               Note [async upload] in manager.py).
    grads      each micro-batch's reduced shard is stored (nvme: write G; with a GPU, d2h G unless on
               the device), micro-batches after the first fetch the sum so far (nvme: read G; h2d G);
               the optimizer reads its update range's part of G (nvme), crossing to where it runs (with a GPU).
    optimizer  nvme: read O and write O, `optimizer_bytes_per_element` per element (the first step reads
               only the master: the moments are zeros, never read); the step runs on the GPU when the
               optimizer state is on the device tier of a GPU, else on the CPU.

One update per step: a speculated window whose clip fires (Note [speculative update]) copies its speculated
units' new parameters to the device a second time (their redo; their state is in memory), which no plan can
predict; the profile counts it.

On a machine without a GPU, device and host are the same memory: no copy is a link. The manager
counts every byte it moves the same way (`TieredMemoryManager.bytes_moved`, d2h / h2d into resident
tiers included); tests/profile/test_profile_traffic.py checks the two agree.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

import torch

from infinity.config.sections import ConfigError, format_size
from infinity.memory.plan import (
    Budgets,
    Plan,
    UnitSizes,
    aliased,
    itemsize,
    optimizer_bytes_per_element,
    state_bytes,
)
from infinity.memory.tier import OPTIMIZER_KINDS, Kind, StateDtype, Tier, uploads_master

LINKS = ("nvme_read", "nvme_write", "h2d", "d2h")  # the keys of memory_report()["bytes_moved"]
# What OffloadedOptimizer holds (its defaults are these): tasks whose reads are issued ahead of the one
# being stepped, and stores left pending before it waits for the oldest.
UPDATE_READS_AHEAD = 1
UPDATE_WRITES_IN_FLIGHT = 4
STAGING_ALIGNMENT = 4096  # the host staging pool's (memory/buffers.py)
_FETCHED = (Kind.MASTER, Kind.EXP_AVG, Kind.EXP_AVG_SQ, Kind.GRADS)


def offloaded_state_bytes(plan: Plan, parked: dict[Kind, Tier]) -> dict[Tier, dict[Kind, int]]:
    """`state_bytes` after `engine.offload_states` parked the DEVICE shards of each kind in `parked` on its tier
    between windows (Note [offloaded states] in parked.py): the device holds none of them; gradients are all
    zero there, so they park as nothing; the other kinds hold what they held (after the first update)."""
    out = state_bytes(plan)
    for kind, tier in parked.items():
        moved, out[Tier.DEVICE][kind] = out[Tier.DEVICE][kind], 0
        out[tier][kind] += 0 if kind is Kind.GRADS else moved
    return out


# ---------------------------------------------------------------- Note [working memory]


def update_staging_bytes(units: tuple[UnitSizes, ...], compute_dtype: torch.dtype,
                         on_nvme: Callable[[int, Kind], bool], aliased: Callable[[int], bool], *,
                         state_dtype: StateDtype = StateDtype.FP32,
                         reads_ahead: int = UPDATE_READS_AHEAD, writes_in_flight: int = UPDATE_WRITES_IN_FLIGHT) -> int:
    """Host staging bytes the pool ends up holding for the update: a replay of two optimizer steps'
    buffer requests as OffloadedOptimizer.step makes them (read `reads_ahead` tasks ahead, at most
    `writes_in_flight` stores pending, the last stores left pending into the next step) over the size
    classes of io_engine's pool, which keeps every buffer it allocated. Only NVMe shards are staged."""
    # the replay depends only on each unit's update chunks, which kinds are on NVMe and the aliasing: one
    # replay per distinct pattern (an estimate's table plans the same units many times over)
    pattern = tuple((sizes.chunks(Kind.MASTER), tuple(on_nvme(u, k) for k in Kind), aliased(u))
                    for u, sizes in enumerate(units))
    if not any(any(nvme) for _, nvme, _ in pattern):
        return 0
    sizes_of = tuple(itemsize(k, state_dtype) for k in _FETCHED)
    return _replay_staging(pattern, compute_dtype.itemsize, sizes_of, reads_ahead, writes_in_flight)


def update_tasks(pattern: tuple, reads_ahead: int, writes_in_flight: int) -> list[tuple]:
    """The update's tasks (one per chunk: its elements, which kinds are on NVMe, aliased), in order, each run of
    identical units and then each run of identical tasks cut to `2 * window` (Note [working memory]: once the
    replay's window, the tasks read ahead and those whose stores are pending, holds only tasks of one run, every
    further task (unit) of it leaves the pool's counts as the one before did: the cut run replays to the same
    peak; a 70B model's 70,000 chunks replay as a few hundred)."""
    window = reads_ahead + 1 + writes_in_flight + 1
    units: list[tuple] = []  # the same for a run of identical units (a model's blocks): the tasks repeat with
    repeats = 0  # the unit's period, and once the window holds only them the counts repeat each period too
    for unit in pattern:
        repeats = repeats + 1 if units and units[-1] == unit else 1
        if repeats <= 2 * window:
            units.append(unit)
    tasks: list[tuple] = []
    run = 0
    for chunks, nvme, alias in units:
        for n in chunks:
            task = (n, nvme, alias)
            run = run + 1 if tasks and tasks[-1] == task else 1
            if run <= 2 * window:
                tasks.append(task)
    return tasks


@functools.lru_cache(maxsize=64)
def _replay_staging(pattern: tuple, csize: int, fetched_sizes: tuple[int, ...], reads_ahead: int,
                    writes_in_flight: int, cut: bool = True) -> int:
    from io_engine import size_class
    kinds = list(Kind)
    signatures = update_tasks(pattern, reads_ahead, writes_in_flight) if cut else [
        (n, nvme, alias) for chunks, nvme, alias in pattern for n in chunks]

    def on_nvme(u: int, kind: Kind) -> bool:
        return signatures[u][1][kinds.index(kind)]

    def aliased(u: int) -> bool:
        return signatures[u][2]
    live: dict[int, int] = {}
    peak: dict[int, int] = {}

    def get(nbytes: int) -> int | None:
        if nbytes == 0:
            return None
        c = size_class(nbytes, STAGING_ALIGNMENT)
        live[c] = live.get(c, 0) + 1
        peak[c] = max(peak.get(c, 0), live[c])
        return c

    def put(c: int | None) -> None:
        if c is not None:
            live[c] -= 1

    tasks = [(u, n) for u, (n, _, _) in enumerate(signatures)]  # the update's chunks (u: the task's signature)
    left: dict[int, list] = {}  # task -> buffers of its stores still pending from the last step
    for _step in range(2):
        for task, pending in left.items():
            for is_params, c in pending:
                put(c if is_params else None)  # the forward's parameter fetch waits the pending parameter write
            left[task] = [(False, c) for is_params, c in pending if not is_params]
        ahead, writes, nxt = [], [], 0
        for _ in tasks:
            while nxt < len(tasks) and len(ahead) <= reads_ahead:
                u, n = tasks[nxt]
                for _, c in left.pop(nxt, []):
                    put(c)  # fetching a chunk waits its pending write first
                ahead.append((nxt, u, n, {k: get(n * size) if on_nvme(u, k) else None
                                          for k, size in zip(_FETCHED, fetched_sizes)}))
                nxt += 1
            task, u, n, bufs = ahead.pop(0)
            alias = aliased(u)  # the master's buffer is the parameters' (Note [aliased parameters])
            params = get(n * csize) if on_nvme(u, Kind.PARAMS) and not alias else None
            writes += [(task, alias and k is Kind.MASTER, bufs[k]) for k in OPTIMIZER_KINDS]
            if not alias:
                writes.append((task, True, params))
            put(bufs[Kind.GRADS])  # released right after the step
            while len(writes) > writes_in_flight:
                put(writes.pop(0)[2])
        for task, is_params, c in writes:
            left.setdefault(task, []).append((is_params, c))
    return sum(c * n for c, n in peak.items())


def largest_nvme_chunk_bytes(units: tuple[UnitSizes, ...], optimizer_on_nvme: Callable[[int, Kind], bool],
                             state_dtype: StateDtype = StateDtype.FP32) -> int:
    """Bytes one optimizer sub-group's NVMe state takes (all its NVMe kinds)."""
    return max((max(sizes.chunks(Kind.MASTER), default=0)
                * sum(itemsize(k, state_dtype) for k in OPTIMIZER_KINDS if optimizer_on_nvme(u, k))
                for u, sizes in enumerate(units)), default=0)


def read_ahead_term(update_staging: int, read_ahead: int, one_kind_chunk: int) -> int:
    """What a read-ahead of `read_ahead` bytes adds to the update's staging: the pool holds the read state
    plus the write-behind of the chunks taken from it, or the pipeline's own buffers, whichever is more."""
    if read_ahead <= 0:
        return 0
    return max(0, read_ahead + UPDATE_WRITES_IN_FLIGHT * one_kind_chunk - update_staging)


def working_terms(units: tuple[UnitSizes, ...], compute_dtype: torch.dtype, tiers_of: dict[str, Tier],
                  units_ahead: int, *, cuda: bool = False, keep_written: bool = True,
                  read_ahead: int = 0, state_dtype: StateDtype = StateDtype.FP32,
                  grad_accum_steps: int = 1) -> dict[Tier, dict[str, int]]:
    """Note [working memory], term by term, for every unit's groups on the tiers of `tiers_of`
    (the planner passes a group's slowest tier of any unit: its staging exists once one unit has it)."""
    if not units:
        return {Tier.DEVICE: {}, Tier.HOST: {}}
    csize = compute_dtype.itemsize
    root, rest = units[0], sorted((u.unsharded_numel for u in units[1:]), reverse=True)
    largest_shard = max(u.shard_numel for u in units)  # the parameters a rank stores (stage 3: its partition)
    held = units_ahead + 1 + any(u.fetches > 2 for u in units[1:])  # (+ a recomputation's unit: Note [tiles are units])
    master_size = itemsize(Kind.MASTER, state_dtype)
    casts_up = uploads_master(tiers_of["params"], tiers_of["optimizer"], cuda) and master_size != csize
    device = {"unsharded": (root.unsharded_numel + sum(rest[:held])) * csize,
              "flat_grad": flat_grad_bytes(units),
              "upload_cast": max(max(u.chunks(Kind.MASTER), default=0) for u in units) * master_size if casts_up else 0}
    grads_tier = tiers_of["grads"]
    sums_staged = grad_accum_steps > 1 and grads_tier is not Tier.DEVICE and (cuda or grads_tier is Tier.NVME)
    ahead = max((u.numel(Kind.GRADS) for u in units[1:]), default=0) * 4  # (never the root's: it has no hook)
    device["grad_sum_ahead"] = ahead if sums_staged else 0
    nvme_kinds = {k: tiers_of[k.group] is Tier.NVME for k in Kind}  # the same for every unit here
    on_nvme = lambda u, k: nvme_kinds[k]  # noqa: E731
    staging = update_staging_bytes(units, compute_dtype, on_nvme,
                                   lambda u: aliased(units[u], tiers_of, compute_dtype, state_dtype),
                                   state_dtype=state_dtype)
    params_nvme = tiers_of["params"] is Tier.NVME
    one_kind = largest_nvme_chunk_bytes(units, lambda u, k: k is Kind.MASTER and on_nvme(u, k), state_dtype)
    host = {"update_staging": staging,
            "read_ahead": read_ahead_term(staging, read_ahead, one_kind),
            "fresh_params": fresh_bytes(units, csize, units_ahead, keep_written, lambda u: params_nvme),
            "param_staging": (units_ahead + 1) * largest_shard * csize if cuda and params_nvme else 0}
    return {Tier.DEVICE: device, Tier.HOST: host}


def flat_grad_bytes(units: tuple[UnitSizes, ...]) -> int:
    """Note [working memory]'s `flat_grad`: the largest fp32 flat gradient a backward fills (the unit's trainable
    prefix, or the whole padded unit where a reduce-scatter partitions it: Note [trainable flat gradient] in
    units/gradients.py) and one more of its size or its rank's shard, whichever is less (the reduce-scatter's
    output; at one rank none is made, but the term stays: the peaks measured with it, RESULTS D26 and D32, are
    within 1.04x, and without it the 4.11B full fine-tune's would be ~1.06x under)."""
    return max((u.layout.flat_grad_numel + min(u.shard_numel, u.layout.flat_grad_numel) for u in units),
               default=0) * 4


def totals(terms: dict[Tier, dict[str, int]]) -> dict[Tier, int]:
    return {t: sum(v.values()) for t, v in terms.items()}


def with_working_term(plan: Plan, tier: Tier, name: str, num_bytes: int, **fields) -> Plan:
    """`plan` with its working term `name` on `tier` set to `num_bytes` (and `fields` replaced)."""
    terms = {t: dict(v) for t, v in plan.working_terms.items()}
    terms.setdefault(tier, {})[name] = num_bytes
    return dataclasses.replace(plan, working_terms=terms, working=totals(terms), **fields)


def fresh_bytes(units: tuple[UnitSizes, ...], compute_itemsize: int, units_ahead: int, keep_written: bool,
                params_on_nvme: Callable[[int], bool]) -> int:
    """Bytes the fresh copies may hold: `units_ahead + 1` of the largest parameter shards on NVMe that an
    update writes (their trainable part; 0 with `[prefetch] keep_written = false`, or no parameters on NVMe)."""
    if not keep_written:
        return 0
    shards = [sizes.written_params for u, sizes in enumerate(units) if params_on_nvme(u)]
    return (units_ahead + 1) * max(shards, default=0) * compute_itemsize


# ---------------------------------------------------------------- the read-ahead's budget


def nvme_optimizer_bytes(plan: Plan) -> int:
    """Bytes of optimizer state on NVMe: all a read-ahead could ever hold."""
    return sum(plan.state_bytes()[Tier.NVME][k] for k in OPTIMIZER_KINDS)


def largest_chunk_bytes(plan: Plan) -> int:
    """Bytes one optimizer sub-group's NVMe state takes: a read-ahead budget below it never reads."""
    return largest_nvme_chunk_bytes(plan.units, lambda u, k: plan.tier(u, k) is Tier.NVME, plan.state_dtype)


def host_slack(plan: Plan, budgets: Budgets) -> int:
    """Host memory the plan leaves free under the budgets (state and every working term counted; without a GPU
    the activations too, when known: Budgets.activations, in the RAM both tiers share)."""
    totals_ = plan.tier_totals()
    slack = budgets.host - totals_[Tier.HOST]
    if budgets.shared_ram:
        slack = min(slack, budgets.shared_limit - (budgets.activations or 0) - totals_[Tier.DEVICE]
                    - totals_[Tier.HOST])
    return max(0, slack)


def resolve_read_ahead(setting, plan: Plan, budgets: Budgets) -> int:
    """The read-ahead budget for `[overlap] optimizer_read_ahead` = `setting` (0: none; callers pass 0
    without the optimizer worker) given the rest of `plan`: "auto" takes half the host memory the plan
    leaves free (none when that is less than one sub-group's state); an explicit size must fit in it
    (ConfigError otherwise). Either way its working term fits the host budget."""
    wanted, chunk = nvme_optimizer_bytes(plan), largest_chunk_bytes(plan)
    # the read-ahead's write-behind may outgrow the update pipeline's own buffers (few chunks)
    over = read_ahead_term(plan.working_terms.get(Tier.HOST, {}).get("update_staging", 0), 1, _one_kind(plan)) - 1
    free = max(0, host_slack(plan, budgets) - max(0, over))
    if setting == "auto":
        num_bytes = min(wanted, free // 2)
        return num_bytes if num_bytes >= chunk else 0  # too little memory left to hold one sub-group
    num_bytes = _explicit_host_bytes("overlap.optimizer_read_ahead", setting, wanted, free, "optimizer state")
    if 0 < num_bytes < chunk:
        raise ConfigError(
            f"overlap.optimizer_read_ahead = {format_size(num_bytes)} is less than one optimizer sub-group's state "
            f"({format_size(chunk)}), so nothing could be read ahead: raise it to at least that, lower "
            f"optimizer.sub_group_size, or set it to 0")
    return num_bytes


def _one_kind(plan: Plan) -> int:
    """The largest NVMe sub-group of one optimizer state kind."""
    return largest_nvme_chunk_bytes(plan.units, lambda u, k: k is Kind.MASTER and plan.tier(u, k) is Tier.NVME,
                                    plan.state_dtype)


def with_read_ahead(plan: Plan, read_ahead: int) -> Plan:
    """`plan` holding a state read-ahead of `read_ahead` bytes: its working term updated."""
    staging = plan.working_terms.get(Tier.HOST, {}).get("update_staging", 0)
    return with_working_term(plan, Tier.HOST, "read_ahead", read_ahead_term(staging, read_ahead, _one_kind(plan)),
                             read_ahead=read_ahead)


# ---------------------------------------------------------------- the speculation's budget


JOURNAL_KINDS = (*OPTIMIZER_KINDS, Kind.GRADS)  # what a speculated update keeps: master, moments as stored, gradient
JOURNAL_ALIGN = 64  # each kind's copy starts at a multiple of this (a view of any dtype)


def journal_kind_bytes(numel: int, kind: Kind, state_dtype: StateDtype) -> int:
    """The journal's bytes for one unit's `numel` update elements of `kind` (Note [speculative update] in
    optim/journal.py), aligned."""
    return -(-numel * itemsize(kind, state_dtype) // JOURNAL_ALIGN) * JOURNAL_ALIGN


def speculated_units(plan: Plan, cuda: bool) -> list[int]:
    """The units an update may speculate (Note [speculative update]): those whose optimizer runs on the CPU (not a
    GPU's device tier) and whose optimizer state and parameters are in memory (a fired clip would write them to
    NVMe twice, over the slowest link)."""
    return [u for u, sizes in enumerate(plan.units)
            if sizes.numel(Kind.MASTER) and not (cuda and plan.tier(u, Kind.MASTER) is Tier.DEVICE)
            and Tier.NVME not in (plan.tier(u, Kind.MASTER), plan.tier(u, Kind.PARAMS))]


def resolve_speculation(setting: int, plan: Plan, budgets: Budgets) -> int:
    """The journal's bytes for `[overlap] speculation` = `setting`, a size (callers pass 0 when the update needs no
    global norm, runs without the worker, or the setting is "auto": Note [speculation default]), given the rest of
    `plan` (its read-ahead included): what of it the speculated units' copies want, which must fit in the host
    memory the plan leaves free (ConfigError otherwise)."""
    sizes = [sum(journal_kind_bytes(plan.units[u].numel(Kind.MASTER), k, plan.state_dtype) for k in JOURNAL_KINDS)
             for u in speculated_units(plan, not budgets.shared_ram)]
    return _explicit_host_bytes("overlap.speculation", setting, sum(sizes), host_slack(plan, budgets),
                                "pre-update copies")


def _explicit_host_bytes(key: str, setting: int, wanted: int, free: int, what: str) -> int:
    """A size the user set for a host working term: what of it is wanted, refused unless it fits in `free`."""
    num_bytes = min(int(setting), wanted)
    if num_bytes > free:
        raise ConfigError(
            f"{key} = {format_size(setting)} would hold {format_size(num_bytes)} of {what}, but the plan leaves only "
            f'{format_size(free)} of host memory free under memory.host_budget: lower it, or set it to "auto"')
    return num_bytes


def with_speculation(plan: Plan, num_bytes: int) -> Plan:
    """`plan` holding a speculation journal of `num_bytes` (a host working term)."""
    return with_working_term(plan, Tier.HOST, "speculation", num_bytes, speculation=num_bytes)


def plan_report(plan: Plan, parked: dict[Kind, Tier] | None = None) -> dict:
    """memory_report()'s plan section: state per tier and kind (`parked`: while offloaded, Note [offloaded
    states]), working bytes per tier (total and term by term), and the read-ahead's budget; the same numbers
    the planner fitted to the budgets."""
    state = offloaded_state_bytes(plan, parked) if parked else plan.state_bytes()
    return {"plan": {t.value: {k.value: v for k, v in kinds.items()} for t, kinds in state.items()},
            "working_planned": {t.value: v for t, v in plan.working.items()},
            "working_planned_terms": {t.value: dict(v) for t, v in plan.working_terms.items()},
            "read_ahead_planned": plan.read_ahead, "speculation_planned": plan.speculation}


# ---------------------------------------------------------------- Note [traffic per step]


# The CPU's update of one element of each optimizer state dtype, in elements of the fused fp32 kernel (the rate
# `cpu_adam` measures): the 16-bit states' update upcasts a chunk, runs that kernel and rounds back, the master
# stochastically (optim/state_update.py). `benchmarks/bench_cpu_adam.py --only state_dtype`, this 2-core
# machine, 100M elements, two runs on 2026-11-29: fp32 1.50-1.58, bf16 1.01-1.18, bf16_master 0.52-0.56 G
# elements/s (the master 0.19 on 2026-11-28, before its random bits came from a table). On a GPU the 16-bit
# update's cost against its fused kernel is not measured.
CPU_UPDATE_COST = {StateDtype.FP32: 1.0, StateDtype.BF16: 1.5, StateDtype.BF16_MASTER: 3.0}


@dataclass
class StepTraffic:
    """Bytes per link in each phase of one optimizer step, and the Adam elements stepped where."""

    fb: dict[str, int] = dataclasses.field(default_factory=lambda: {k: 0 for k in LINKS})
    opt: dict[str, int] = dataclasses.field(default_factory=lambda: {k: 0 for k in LINKS})
    adam_cpu: int = 0  # elements stepped on the CPU
    adam_device: int = 0  # elements stepped on the GPU
    adam_cpu_work: float = 0.0  # the CPU's update in elements of the fused fp32 kernel (CPU_UPDATE_COST)

    def add(self, other: "StepTraffic", sign: int = 1) -> None:
        for k in LINKS:
            self.fb[k] += sign * other.fb[k]
            self.opt[k] += sign * other.opt[k]
        self.adam_cpu += sign * other.adam_cpu
        self.adam_device += sign * other.adam_device
        self.adam_cpu_work += sign * other.adam_cpu_work

    def total(self) -> dict[str, int]:
        return {k: self.fb[k] + self.opt[k] for k in LINKS}


def activation_offload_traffic(input_bytes: int, *, cuda: bool, accum: int) -> StepTraffic:
    """`[activation] offload = "host"`: each micro-batch's checkpoint inputs go to the host after the unit's
    forward and come back before its backward (Note [activation offload]); no link without a GPU."""
    t = StepTraffic()
    if cuda:
        t.fb["d2h"] = t.fb["h2d"] = input_bytes * accum
    return t


def unit_traffic(sizes: UnitSizes, tiers: dict[str, Tier], *, compute_dtype: torch.dtype, cuda: bool, accum: int,
                 is_root: bool, kept_numel: int | None = None, first_step: bool = False,
                 state_dtype: StateDtype = StateDtype.FP32) -> StepTraffic:
    """One unit's traffic per optimizer step (Note [traffic per step]); `tiers` maps group -> tier.
    `kept_numel`: parameter elements whose first fetch reads a kept copy (None: all written ones).
    `first_step`: no update before it (nothing kept) and the moments are still zeros (never read)."""
    t = StepTraffic()
    compute_bytes = compute_dtype.itemsize
    P, G = sizes.numel(Kind.PARAMS) * compute_bytes, sizes.numel(Kind.GRADS) * 4
    W, O = sizes.written_params * compute_bytes, sizes.numel(Kind.MASTER)
    master_bytes, optimizer_bytes = itemsize(Kind.MASTER, state_dtype), optimizer_bytes_per_element(state_dtype)
    alias = aliased(sizes, tiers, compute_dtype, state_dtype)
    fetches = accum * (1 if is_root else sizes.fetches)
    params, grads, optim = tiers["params"], tiers["grads"], tiers["optimizer"]
    opt_on_gpu = cuda and optim is Tier.DEVICE
    # params: fetched for compute, written back after the step (as the master when aliased)
    if params is Tier.NVME:
        kept = 0 if first_step else sizes.written_params if kept_numel is None else kept_numel
        t.fb["nvme_read"] += fetches * P - kept * compute_bytes
        t.opt["nvme_write"] += 0 if alias else W
    if cuda and params is not Tier.DEVICE:
        t.fb["h2d"] += fetches * P
    if cuda and (params is Tier.DEVICE) != opt_on_gpu:  # new params cross between where Adam ran and their tier
        up = sizes.written_params * master_bytes if uploads_master(params, optim, cuda) else W  # (as the master)
        t.opt["h2d" if params is Tier.DEVICE else "d2h"] += up
    # grads: stored every micro-batch, accumulated from the second on, read by the optimizer
    if grads is Tier.NVME:
        t.fb["nvme_write"] += accum * G
        t.fb["nvme_read"] += (accum - 1) * G
        t.opt["nvme_read"] += O * 4  # the gradients of the update range
    if cuda and grads is not Tier.DEVICE:
        t.fb["d2h"] += accum * G
        t.fb["h2d"] += (accum - 1) * G
    if cuda and (grads is Tier.DEVICE) != opt_on_gpu:
        t.opt["d2h" if grads is Tier.DEVICE else "h2d"] += O * 4
    # optimizer state: streamed through RAM when on NVMe
    if optim is Tier.NVME:
        t.opt["nvme_read"] += O * (master_bytes if first_step else optimizer_bytes)
        t.opt["nvme_write"] += O * optimizer_bytes
    if opt_on_gpu:
        t.adam_device += O
    else:
        t.adam_cpu += O
        t.adam_cpu_work += O * CPU_UPDATE_COST[state_dtype]
    return t


def plan_traffic(plan: Plan, *, cuda: bool, accum: int, kept: frozenset[tuple[int, int]] | None = None,
                 first_step: bool = False) -> StepTraffic:
    """The traffic of every unit of `plan` (unit 0 is the root) per optimizer step. `kept`: the (unit, chunk)s
    of parameters kept in memory after the update (None: all, as with deferred updates)."""
    total = StepTraffic()
    for index, (sizes, kinds) in enumerate(zip(plan.units, plan.tiers)):
        if sizes.shard_numel == 0:
            continue
        tiers = {k.group: t for k, t in kinds.items()}
        kept_numel = None if kept is None else sum(n for c, n in enumerate(sizes.chunks(Kind.PARAMS))
                                                   if (index, c) in kept)
        total.add(unit_traffic(sizes, tiers, compute_dtype=plan.compute_dtype, cuda=cuda, accum=accum,
                               is_root=index == 0, kept_numel=kept_numel, first_step=first_step,
                               state_dtype=plan.state_dtype))
    return total


def bytes_per_step(plan: Plan, *, grad_accum_steps: int, first_step: bool, cuda: bool,
                   kept: frozenset[tuple[int, int]] = frozenset()) -> dict[str, int]:
    """Predicted bytes per link for one optimizer step ("nvme_read", "nvme_write", "h2d", "d2h").
    `kept`: the (unit, chunk)s of parameters whose first fetch after an update reads the copy kept in
    memory, not the disk (Note [fresh parameters]; `Engine.kept_params`)."""
    return plan_traffic(plan, cuda=cuda, accum=grad_accum_steps, kept=kept, first_step=first_step).total()
