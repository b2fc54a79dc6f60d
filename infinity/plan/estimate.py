"""`infinity estimate`: bytes per tier and kind, the plan and its reasons, step time, preflight.

Everything is computed without allocating the model: it is built on the meta
device, split into units exactly as `initialize` splits it (rank 0 of
`world_size`; every rank's shard has the same size), planned with the same
`plan_placement`, and one forward + backward is traced on meta tensors to count
the activations saved for backward and the FLOPs.

The predicted peak is Note [peak memory] (memory/traffic.py, with the byte model it sums).

Preflight checks (infinity/machine/preflight.py, shared with `initialize`): the plan fits the
budgets, free RAM for every rank on this node, free disk on each NVMe path and for
the checkpoints, and the locked-memory limit for the pinned / mlock'ed staging buffers.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from infinity.config.sections import ActivationConfig, Config
from infinity.machine import link_rates
from infinity.machine.environment import resolve_budgets
from infinity.machine.preflight import (
    FREE_DISK,
    Check,
    check_disks,
    checkpoint_bytes,
    preflight,
    ram_room,
)
from infinity.memory import cost_model
from infinity.memory.plan import Budgets, Plan
from infinity.memory.tier import Kind, Tier
from infinity.plan import probe
from infinity.plan.traced import Trace, group_counts, trace_step, tracer, unit_sizes_of  # noqa: F401 (its home)
from io_engine import format_size


def activation_terms(trace: Trace, activation) -> dict[str, int]:
    """Note [activation estimate]: the bytes one micro-batch keeps for backward, by `[activation]`:

        none          device = everything the forward saves
        units         device = root + inputs           recompute = the largest unit's saves
        units + host  device = root + 2 * largest input (the one recomputing, the next copied back)
                      host = inputs                    recompute = the largest unit's saves

    root: what the root unit's code saves (the traced total less every unit's); inputs: the units'
    saved inputs, summed. The recompute holds one unit's saves during its backward."""
    if activation.checkpoint == "none":
        return {"saved": trace.activation_bytes, "recompute": 0, "host": 0}
    root = trace.activation_bytes - sum(trace.unit_saved)
    recompute = max(trace.unit_saved, default=0)
    if activation.offload == "host":
        return {"saved": root + 2 * max(trace.unit_inputs, default=0), "recompute": recompute,
                "host": sum(trace.unit_inputs)}
    return {"saved": root + sum(trace.unit_inputs), "recompute": recompute, "host": 0}


def activation_bytes(trace: Trace, activation) -> dict[str, int]:
    """The activations by tier (Note [activation estimate]): saved + recompute + the largest saved tensor on the
    device tier, offloaded checkpoint inputs on host."""
    acts = activation_terms(trace, activation)
    return {"device": acts["saved"] + acts["recompute"] + trace.largest_saved_bytes, "host": acts["host"]}


@dataclass
class Estimate:
    """Everything `infinity estimate` prints, for one rank of `world_size`."""

    world_size: int
    local_world_size: int
    cuda: bool
    num_params: int
    units: int
    budgets: Budgets
    plan: Plan | None
    plan_error: str | None
    rates: cost_model.LinkRates
    trace: Trace
    traffic: cost_model.StepTraffic | None = None
    step_time: cost_model.StepTime | None = None
    peak: dict[str, int] = field(default_factory=dict)  # "ram" (and "device" with a GPU): bytes per rank
    peak_terms: dict[str, int] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    groups: list[dict] = field(default_factory=list)  # per optimizer group: tensors, elements, weight_decay, lr
    activation: ActivationConfig = field(default_factory=ActivationConfig)
    table: list = field(default_factory=list)  # estimate_table.Row: placements x stages (Note [estimate table])
    plans: list = field(default_factory=list)  # plan_search.RunPlan when the configured run does not fit
    budget_raised: bool = False  # the plans raise the memory budgets (Note [plan search]'s last resort)
    searched: bool = False  # the configured run does not fit: the plans were searched (Note [plan search])
    faster: object = None  # a faster fitting row when the configured one fits
    checkpoint_bytes: int | None = None  # one rank's files of one checkpoint (Note [checkpoint space])
    host_s: float = 0.0  # Note [host time]: the engine's host seconds per steady step (the runtime probe's)
    first_extra_s: float = 0.0  # what step 1 adds to a steady step, at least (Note [host time])
    room: dict[str, int] = field(default_factory=dict)  # Note [headroom]: ram_available, ram_headroom (this node),
    # disk_free, disk_headroom (the first swap path's filesystem; absent without nvme.paths)

    @property
    def steady_s(self) -> float | None:
        """The predicted seconds of a steady step (step 2 on): the byte model's step plus the host time."""
        return None if self.step_time is None else self.step_time.total + self.host_s

    @property
    def ok(self) -> bool:
        return all(c.ok or c.level != "error" for c in self.checks)

    def state(self) -> dict[str, dict[str, int]]:
        """Bytes per tier and kind on one rank, as memory_report()["state"]."""
        plan = self.plan
        if plan is None:  # the configured placement's bytes all the same (unbudgeted)
            plan = next((r.plan for r in self.table if r.configured), None)
        if plan is None:
            return {}
        return {t.value: {k.value: v for k, v in kinds.items()} for t, kinds in plan.state_bytes().items()}

    def to_json(self) -> dict:
        st = self.step_time
        return {
            "world_size": self.world_size, "local_world_size": self.local_world_size, "cuda": self.cuda,
            "num_params": self.num_params, "units": self.units, "budgets": dataclasses.asdict(self.budgets),
            "state": self.state(),
            "working": {t.value: v for t, v in self.plan.working.items()} if self.plan else {},
            "working_terms": {t.value: dict(v) for t, v in self.plan.working_terms.items()} if self.plan else {},
            "plan_error": self.plan_error,
            "reasons": list(self.plan.reasons) if self.plan else [],
            "unit_reasons": [{"unit": u.name, **r} for u, r in zip(self.plan.units, self.plan.unit_reasons)]
            if self.plan else [],
            "rates": self.rates.to_json(),
            "activations_bytes": self.trace.activation_bytes, "flops_per_step": self.trace.flops,
            "activations": activation_terms(self.trace, self.activation),
            "traffic_per_step": self.traffic.total() if self.traffic else None,
            "step_time": None if st is None else {
                "total_s": st.total, "forward_backward": st.fb, "optimizer": st.opt, "host_s": self.host_s,
                "steady_s": self.steady_s, "first_step_s": self.steady_s + self.first_extra_s,
                "error": {"step": STEP_ERROR, "peak_rss": PEAK_ERROR, "measured": ERROR_MEASURED}},
            "peak": self.peak, "peak_terms": self.peak_terms,
            "checks": [dataclasses.asdict(c) for c in self.checks], "ok": self.ok, "param_groups": self.groups,
            "table": [r.to_json() for r in self.table], "plans": [p.to_json() for p in self.plans],
            "faster": self.faster.to_json() if self.faster is not None else None,
            "checkpoint_bytes_per_rank": self.checkpoint_bytes, "room": self.room,
        }


# ---------------------------------------------------------------- the estimate


def context_for(ctx, facts, seq_len: int):
    """`ctx` (estimate_table.Context) for another model of the same job (the LoRA-wrapped one, its
    estimate_model facts): its units and trace."""
    trace_at = facts.tracer(ctx.config, seq_len)
    trace = trace_at(ctx.batch_size)
    return dataclasses.replace(ctx, sizes_of=facts.sizes_of, trace=trace, trace_at=trace_at, flops=trace.flops,
                               activations_of=lambda a: activation_bytes(trace, a))


def resolve_budgets_for(config: Config, *, local_world_size: int, cuda: bool, nvme_free: int,
                        check_machine: bool = True) -> Budgets:
    """Budgets exactly as `initialize` resolves them on this machine ("auto" = this rank's share of the free
    memory detected now); `check_machine`: Note [budget check] (off for what-if runs of other machines)."""
    device = torch.device("cuda", torch.cuda.current_device()) if cuda and torch.cuda.is_available() \
        else torch.device("cpu")
    return resolve_budgets(config.memory, device, local_world_size, nvme_free, check_machine=check_machine)


# Note [estimate error]: measured / predicted over the model sources of benchmarks/bench_estimate.py --accuracy
# (built-in GPT, a transformers Llama of a given shape, a pretrained directory with and without LoRA; min and max
# of the medians; 2026-11-28, 2-core CPU, 23 GiB), and over larger models trained on the same machine the same day
# (RESULTS D32: a 0.27B GPT, 4 steps; the 3.0B, 3.70B, 4.11B and the 11.44B and 13.03B LoRA Llamas of
# `--largest`, 2-3 steps each): what `infinity estimate` prints as its known error. The small models' steps are
# under-predicted (their engine work, their disk's latency: docs/estimate.md) 1.81-2.86x, the large ones'
# 0.98-1.97x (the LoRA runs fetch on demand, `prefetch.units_ahead = 0`: 1.45x since 26cbda5 prices it; the
# 4.11B's 1.61x at f6f54b8);
# every peak RSS from 0.81x (large models, over-predicted: safe) to 1.05x (the accuracy bench's fifth source, a
# wide pretrained LoRA with its frozen weights on NVMe, 2026-11-29: its export at the end, a tensor at a time,
# a little over its load's peak; 1.16x before the job's export released the heap, 3b4e102).
STEP_ERROR = (0.98, 2.86)
PEAK_ERROR = (0.81, 1.05)
ERROR_MEASURED = ("2026-11-28/29, 2-core CPU, 23 GiB: benchmarks/bench_estimate.py --accuracy and models of "
                  "0.27-13.0B parameters")


def estimate(make_model: Callable, config: Config, *, world_size: int = 1, local_world_size: int | None = None,
             batch_size: int = 1, seq_len: int = 128, rates: cost_model.LinkRates | None = None,
             cuda: bool | None = None, remeasure: bool = False, budgets: Budgets | None = None,
             apply: Callable | None = None, lora: tuple | None = None, depth=None, plans: int = 3,
             runtime_modules: tuple[str, ...] = (), data: dict[str, int] | None = None) -> Estimate:
    """Predict a run of `config` at `world_size` for the model `make_model()` builds (a ModelBundle from
    `infinity.job.train.build_model`, or anything with `.model` on meta and `.loss(forward, x, y)`).

    `batch_size` is sequences per micro-batch on one rank. Link rates for the predicted step time: given,
    else measured on the first NVMe path (once per machine; `remeasure` to measure again), else the cached /
    default ones. The plan itself is made exactly as `initialize` makes it (`plan_for_config`).
    `apply(sets) -> plan_search.Applied`: the job's own loading of `--set` lines over this config; given, a
    run that does not fit gets the plans of Note [plan search] (`default_apply` for an engine config alone);
    `lora = (sets, make_lora_model[, lora_depth])`: the `--set` lines that wrap a pretrained model with LoRA,
    and its model. `depth` (estimate_model.Depth): the model's blocks repeat; it is estimated from shallow
    copies (Note [deepened estimate]). `plans`: how many plans to show (each is judged again). `data`: the data
    pipeline's terms, "data" (while training) and "tokenize" (before it), of one rank (Note [data in the estimate]
    in infinity/data/tokenized.py).
    """
    from infinity.plan.traced import model_facts
    local = local_world_size or world_size
    cuda = torch.cuda.is_available() if cuda is None else cuda
    facts = model_facts(make_model, depth)
    bundle = facts.bundle
    sizes = facts.sizes_of(config, world_size)
    num_params = facts.num_params
    groups = facts.groups(config)
    paths = list(config.nvme.paths)
    path_checks, nvme_free = check_disks(paths, nvme_bytes=0, local_world_size=local,  # free space, less headroom
                                         headroom=config.memory.headroom)
    # (a path that cannot hold swap; too little space is the nvme budget's: free less the headroom, maybe 0)
    unusable = [c for c in path_checks if not c.ok and not c.name.startswith(FREE_DISK)]
    if rates is None:
        existing = next((p for p in paths if os.path.isdir(p)), None)
        if existing is not None or remeasure:
            rates = link_rates.link_rates(existing, remeasure=remeasure, io_config=config.io)
        else:
            rates = link_rates.cached_link_rates(cuda)
    compiled = config.compile.backend if config.compile.units else None  # (the probe compiles as the run does)
    rates = dataclasses.replace(rates, op_seconds=probe.op_seconds(remeasure, runtime_modules, compiled))
    trace_at = facts.tracer(config, seq_len)  # the same model at any micro-batch (Note [plan search])
    trace = trace_at(batch_size)
    work = trace.step_work(config.activation.checkpoint).times(config.train.grad_accum_steps)
    compute = cost_model.compute_seconds(work, rates) if trace.flops else 0.0
    budgets_of = (lambda c: budgets) if budgets else (
        lambda c: resolve_budgets_for(c, local_world_size=local, cuda=cuda, nvme_free=nvme_free,
                                      check_machine=world_size == 1))
    budgets = budgets_of(config)
    from infinity.plan import search as plan_search
    from infinity.plan import table
    # a pretrained model's frozen weights are all read from its safetensors files: its checkpoints refer to them
    # (Note [pretrained references]), as initialize's own preflight counts them (runtime/planning.py)
    loads_weights = getattr(bundle, "weights", None) is not None  # (a pretrained directory's)
    referenced = config.checkpoint.reference_pretrained and loads_weights
    ctx = table.Context(sizes_of=facts.sizes_of, frozen_referenced=referenced,
                        activations_of=lambda a: activation_bytes(trace, a), trace_at=trace_at,
                        config=config, world_size=world_size, budgets=budgets, trace=trace, rates=rates, cuda=cuda,
                        flops=trace.flops, local_world_size=local, batch_size=batch_size, budgets_of=budgets_of,
                        runtime=probe.runtime_rss(remeasure, runtime_modules, compiled),
                        plan_rates=link_rates.cached_link_rates(cuda),
                        bytes_of=activation_bytes)

    def peak_of(plan: Plan, trace: Trace, activation) -> tuple[dict[str, int], dict[str, int]]:
        terms = {**peak_terms(plan, trace, cuda=cuda, runtime=ctx.runtime, activation=activation,
                              loads_weights=loads_weights), **(data or {})}
        return terms, peak_from_terms(terms, cuda)
    ctx.peak_of = peak_of  # as initialize plans
    mine = plan_search.judge(ctx, plan_search.Applied(config, batch_size))
    plan, plan_error = mine.plan, mine.plan_error
    if unusable and (plan is None or plan.uses(Tier.NVME)):  # the swap paths' own failure, not "no space"
        plan, plan_error = None, "; ".join(f"{c.detail} ({c.fix})" for c in unusable)
        mine = plan_search.Verdict(None, plan_error, mine.row)
        mine.checks = preflight(None, plan_error, config, local_world_size=local, cuda=cuda)
    est = Estimate(world_size=world_size, local_world_size=local, cuda=cuda, num_params=num_params, units=len(sizes),
                   budgets=budgets, plan=plan, plan_error=plan_error, rates=rates, trace=trace,
                   activation=config.activation, groups=groups, peak=mine.peak, peak_terms=mine.peak_terms,
                   checks=mine.checks)
    if plan is not None:
        est.checkpoint_bytes = checkpoint_bytes(plan, referenced)
        est.traffic = cost_model.plan_traffic(plan, cuda=cuda, accum=config.train.grad_accum_steps)
        est.traffic.add(cost_model.activation_offload_traffic(activation_terms(trace, config.activation)["host"],
                                                               cuda=cuda, accum=config.train.grad_accum_steps))
        est.step_time = cost_model.predict_step_time(est.traffic, rates, compute,
                                                     units_ahead=config.prefetch.units_ahead)
        est.host_s, est.first_extra_s = probe.host_time(len(plan.units), remeasure, runtime_modules, compiled)
    est.table = table.build_table(ctx)
    if not mine.fits and not unusable and apply is not None:  # over a budget, or the RAM / disk checks fail
        est.searched = True
        est.plans = plan_search.search(ctx, apply, limit=plans)
        if lora is not None:  # a pretrained model fine-tuned whole: LoRA's plans too (Note [plan search])
            lora_facts = model_facts(lora[1], lora[2] if len(lora) > 2 else None)
            lora_ctx = context_for(ctx, lora_facts, seq_len)
            share = sum(g["elements"] for g in lora_facts.groups(config)) / max(1, lora_facts.num_params)
            est.plans = sorted(est.plans + plan_search.search(
                lora_ctx, apply, limit=plans, extra=tuple(lora[0]),
                notes=(f"LoRA trains {share:.2%} of the parameters",)),
                key=plan_search.rank)[:plans]
        if not est.plans:
            est.plans, est.budget_raised = plan_search.budget_raise(ctx, apply), True
    est.faster = table.faster_row(est.table)
    est.room = room(config)
    return est


def room(config: Config) -> dict[str, int]:
    """Note [headroom]: the RAM this node has for the job now and the margin `memory.headroom` keeps of it; the same
    for the first swap path's filesystem."""
    import shutil

    from infinity.config.options import headroom_bytes
    from infinity.machine.preflight import existing_parent
    available, margin = ram_room(config.memory.headroom)
    out = {"ram_available": int(available), "ram_headroom": margin}
    if config.nvme.paths:
        usage = shutil.disk_usage(existing_parent(config.nvme.paths[0]))
        out.update(disk_free=int(usage.free), disk_headroom=headroom_bytes(config.memory.headroom, usage.total))
    return out


def traced_activations(make_model: Callable, config: Config, *, batch_size: int, seq_len: int, depth=None) -> int:
    """The device bytes one micro-batch's forward keeps for backward under `config`'s [activation], as the estimate
    counts them (Note [activation estimate]): what "auto" tail units leave free (Note [tail units])."""
    from infinity.plan.traced import model_facts
    trace = model_facts(make_model, depth).tracer(config, seq_len)(batch_size)
    return activation_bytes(trace, config.activation)["device"]


def staging_pool_bytes(plan: Plan) -> int:
    """Host staging bytes the update's pool ends up holding: the plan's `update_staging` term
    (Note [working memory] in memory/traffic.py, a replay of OffloadedOptimizer's buffer requests)."""
    return plan.working_terms.get(Tier.HOST, {}).get("update_staging", 0)


def peak_terms(plan: Plan, trace: Trace, *, cuda: bool, runtime: int, activation=None,
               loads_weights: bool = False) -> dict[str, int]:
    """Note [peak memory], term by term (bytes, one rank); every working term is the plan's; the activations
    as `[activation]` keeps them (Note [activation estimate]); `loads_weights`: the parameters are read from a
    pretrained directory (materializing a unit holds no full fp32 copy)."""
    acts = activation_terms(trace, activation or ActivationConfig())
    device_acts = acts["saved"] + acts["recompute"] + trace.largest_saved_bytes
    state = {t: sum(kinds.values()) for t, kinds in plan.state_bytes().items()}
    largest = max((u.unsharded_numel for u in plan.units), default=0)
    largest_shard = max((u.shard_numel for u in plan.units), default=0)
    csize = plan.compute_dtype.itemsize
    host_terms = plan.working_terms.get(Tier.HOST, {})
    return {
        "runtime": runtime,
        "state_device": state[Tier.DEVICE],
        "state_host": state[Tier.HOST],
        "working_device": plan.working.get(Tier.DEVICE, 0),
        "working_host": plan.working.get(Tier.HOST, 0),
        "read_ahead": plan.read_ahead,  # its working term is part of working_host (Note [state read-ahead])
        "fresh_params": host_terms.get("fresh_params", 0),  # part of working_host (Note [fresh parameters])
        "activations": device_acts,
        "activations_host": acts["host"],  # checkpoint inputs offloaded to host memory
        # materializing one unit: full fp32 values (none when read from a pretrained directory), the fp32 shard,
        # its compute-dtype cast
        "init": largest * 4 * (not loads_weights) + largest_shard * (4 + csize),
        # glibc keeps the heap pages of freed transient tensors (activations, gradients): measured ~1.5x their
        # live bytes on Linux over a few steps, so half of them again; not the unsharded parameters' bytes, which
        # come from the pool's own mappings, kept and reused (Note [unsharded memory]: at 3.70B parameters,
        # 2026-11-28, counting them put the predicted peak RSS at 1.35x the measured)
        "allocator": (plan.working.get(Tier.DEVICE, 0) - plan.working_terms.get(Tier.DEVICE, {}).get("unsharded", 0)
                      + device_acts) // 2 if not cuda else 0,
    }


def peak_from_terms(terms: dict[str, int], cuda: bool) -> dict[str, int]:
    """Sum the terms into the peak of each memory (Note [peak memory]; the data's: Note [data in the estimate])."""
    train_device = terms["working_device"] + terms["activations"]
    data, tokenize = terms.get("data", 0), terms["runtime"] + terms.get("tokenize", 0)
    if cuda:
        return {"ram": max(tokenize, data + terms["runtime"] + terms["state_host"]
                           + max(terms["working_host"] + terms["activations_host"], terms["init"])),
                "device": terms["state_device"] + train_device}
    return {"ram": max(tokenize, data + terms["runtime"] + terms["state_device"] + terms["state_host"]
                       + max(train_device + terms["activations_host"] + terms["working_host"] + terms["allocator"],
                             terms["init"]))}


# ---------------------------------------------------------------- text


def _fmt(n: float) -> str:
    return format_size(n, exact=False)


def _secs(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.1f} ms"


def format_estimate(est: Estimate, *, explain: bool = False) -> str:
    """The human-readable report of `infinity estimate`."""
    lines = [f"model: {est.num_params / 1e6:.2f}M parameters in {est.units} units; world size {est.world_size} "
             f"({est.local_world_size} per node), {'GPU' if est.cuda else 'CPU only'}",
             f"budgets per rank: device {_fmt(est.budgets.device)}, host {_fmt(est.budgets.host)}, "
             f"nvme {_fmt(est.budgets.nvme)}" + (" (device and host share the RAM)" if est.budgets.shared_ram else ""),
             f"optimizer groups: {len(est.groups)} (" + "; ".join(
                 f"{g['tensors']} tensors, {g['elements']:,} elements at weight_decay {g['weight_decay']:g}"
                 for g in est.groups) + "); bytes as with one group",
             ""]
    if est.plan is not None:
        kinds = [k.value for k in Kind]
        lines.append("bytes per rank, per tier and state kind:")
        lines.append("  " + f"{'tier':8}" + "".join(f"{k:>12}" for k in kinds + ["working", "total"]))
        state = est.state()
        for tier in Tier:
            row = [state[tier.value][k] for k in kinds]
            work = est.plan.working.get(tier, 0)
            lines.append("  " + f"{tier.value:8}" + "".join(f"{_fmt(v):>12}" for v in row + [work, sum(row) + work]))
        lines.append("")
        lines.append(f"plan ({'policy ' + ('auto' if est.plan.unit_reasons else 'static')}):")
        lines += [f"  {r}" for r in est.plan.reasons]
        if explain and est.plan.unit_reasons:
            for unit, reasons in zip(est.plan.units, est.plan.unit_reasons):
                lines.append(f"  {unit.name} ({unit.shard_numel:,} elements per rank):")
                lines += [f"    {reasons[g]}" for g in ("params", "grads", "optimizer")]
        lines.append("")
        st, tr = est.step_time, est.traffic
        lines.append(f"predicted steady step (step 2 on): {_secs(est.steady_s)} = forward/backward "
                     f"{_secs(st.fb_seconds)} (bound by {st.bottlenecks()[0]}) + optimizer {_secs(st.opt_seconds)} "
                     f"(bound by {st.bottlenecks()[1]}) + host {_secs(est.host_s)} (the engine's own work per step, "
                     f"measured by the runtime probe)")
        lines.append(f"  step 1 (warm-up) takes longer: at least {_secs(est.steady_s + est.first_extra_s)} (kernels "
                     f"loaded, buffers made); a large model's also faults in its state and creates its swap files "
                     f"(a 29.5M GPT's step 1 took 4.3x its steady step on 2026-11-28)")
        lines.append(f"  known error (measured / predicted, {ERROR_MEASURED}): steady step "
                     f"{STEP_ERROR[0]:.2f}-{STEP_ERROR[1]:.2f}x, peak RSS {PEAK_ERROR[0]:.2f}-{PEAK_ERROR[1]:.2f}x")
        recompute = est.trace.unit_forward_flops if est.activation.checkpoint == "units" else 0.0
        work = est.trace.step_work(est.activation.checkpoint)
        lines.append(f"  compute {st.compute * 1e3:.1f} ms (per micro-batch {est.trace.flops / 1e9:.1f} GFLOP"
                     + (f" + {recompute / 1e9:.1f} recomputed (activation.checkpoint)" if recompute else "")
                     + f" at {cost_model.MATMUL_EFFICIENCY['gpu' if est.rates.on_gpu else 'cpu']:.0%} of the "
                     f"measured matmul rate, {_fmt(work.bytes)} of other operations' reads and writes at "
                     f"the elementwise rate, {work.ops:,.0f} operations at {est.rates.op_seconds * 1e6:.1f} us each: "
                     f"Note [compute time])" if est.trace.flops else "  compute: not traced")
        lines.append("traffic per step and link (this rank):")
        for link in cost_model.LINKS:
            total = tr.fb[link] + tr.opt[link]
            if total:
                rate = getattr(est.rates, link)
                lines.append(f"  {link:10} {_fmt(total):>10}  ({_fmt(tr.fb[link])} forward/backward, "
                             f"{_fmt(tr.opt[link])} optimizer) at {_fmt(rate)}/s")
        if not any(tr.fb[k] + tr.opt[k] for k in cost_model.LINKS):
            lines.append("  none: every state kind stays where it is used")
        lines.append(f"  Adam: {tr.adam_cpu:,} elements on the CPU, {tr.adam_device:,} on the GPU")
        lines.append(f"link rates: {est.rates.source}")
        lines.append("")
        lines.append("predicted peak memory per rank: " + ", ".join(f"{k} {_fmt(v)}" for k, v in est.peak.items())
                     + "  (" + ", ".join(f"{k} {_fmt(v)}" for k, v in est.peak_terms.items()) + ")")
        if est.trace.error:
            lines.append(f"  activations not traced ({est.trace.error})")
        lines.append("")
    from infinity.plan.table import format_table
    lines += format_table(est.table, est.faster)
    from infinity.plan.search import format_plans
    lines += format_plans(est.plans, est.searched, est.budget_raised) + [""]
    lines.append("preflight:")
    lines += [f"  {c.line()}" for c in est.checks]
    return "\n".join(lines)


# ---------------------------------------------------------------- predicted vs measured


def predicted_vs_measured(est: Estimate, peak_rss: int, step_seconds_of: dict[int, float]) -> dict:
    """Note [estimate error]: summary.json's "predicted" of a run: the estimate's peak RSS and steps beside the
    run's measured ones (its peak RSS; its steps' seconds, step -> seconds), measured / predicted, and the
    estimate's known error."""
    steady = sorted(v for k, v in step_seconds_of.items() if k > 1)
    measured = {"peak_rss_bytes": peak_rss,
                "steady_step_seconds": steady[len(steady) // 2] if steady else None,  # the median of steps 2 on
                "first_step_seconds": step_seconds_of.get(1)}
    predicted = {"peak_rss_bytes": est.peak.get("ram"), "step_seconds": est.steady_s,
                 "host_step_seconds": est.host_s if est.step_time else None,
                 "first_step_seconds": None if est.steady_s is None else est.steady_s + est.first_extra_s}

    def ratio(m, p):
        return m / p if m is not None and p else None
    return {**predicted, "measured": measured, "error": {"step": STEP_ERROR, "peak_rss": PEAK_ERROR},
            "ratio": {"peak_rss": ratio(peak_rss, predicted["peak_rss_bytes"]),
                      "steady_step": ratio(measured["steady_step_seconds"], predicted["step_seconds"]),
                      "first_step": ratio(measured["first_step_seconds"], predicted["first_step_seconds"])}}


def predicted_vs_measured_line(p: dict) -> str:
    """The run's line of predicted vs measured (`predicted_vs_measured`)."""
    m, r = p["measured"], p["ratio"]
    parts = []
    if p["peak_rss_bytes"]:
        parts.append(f"peak RSS {m['peak_rss_bytes'] / 2**20:.0f} MiB measured, {p['peak_rss_bytes'] / 2**20:.0f} "
                     f"MiB predicted ({r['peak_rss']:.2f}x)")
    if p["step_seconds"] and m["steady_step_seconds"]:
        parts.append(f"steady step {_secs(m['steady_step_seconds'])} measured (median of steps 2 on), "
                     f"{_secs(p['step_seconds'])} predicted ({r['steady_step']:.2f}x)")
    if p["first_step_seconds"] and m["first_step_seconds"]:
        parts.append(f"step 1 {_secs(m['first_step_seconds'])} measured, at least "
                     f"{_secs(p['first_step_seconds'])} predicted")
    return ("measured vs predicted: " + "; ".join(parts) + f" (known error: steady step {STEP_ERROR[0]:.2f}-"
            f"{STEP_ERROR[1]:.2f}x, peak RSS {PEAK_ERROR[0]:.2f}-{PEAK_ERROR[1]:.2f}x)") if parts else ""
