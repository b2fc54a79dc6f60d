"""`infinity estimate`'s plans: the fastest combinations of changes that make a run fit, each checked as the job
would run it.

Note [plan search]: when the configured run does not fit, the estimator searches combinations of the changes it
knows, as `--set` lines over the job: the placement (the configured one, every shape of Note [estimate table],
`placement.policy = "auto"`, which replaces the configured tiers: `with_sets`), the ZeRO stage (only at world size >
1: at one rank every stage stores the same), activation checkpointing and its host offload, `optimizer.state_dtype`,
`prefetch.units_ahead = 0`, a smaller `optimizer.sub_group_size` (the update's staging pool) when the optimizer
state is on NVMe, and the micro-batch (`run.batch_size` divided, `train.grad_accum_steps` multiplied: the same
sequences per optimizer step). A "state" (everything but the activations and the micro-batch) is planned once, by
the engine's planner, and pruned when its state and working bytes alone do not fit (an auto state's plan leaves its
activations free, so it is judged at the smallest micro-batch: one that fits only there is kept); its activation
settings and micro-batches are then priced from the trace (Note [activation estimate]) without planning again (an
auto state is planned again for each: its activations change what it places), largest micro-batch first (the first
that fits is the fastest of its state; the smaller ones are priced only when the judge below refuses it, e.g. for
its predicted peak RAM, and tried in turn). On a what-if H200 machine (benchmarks/largest_whatif.py: 139 GiB of
GPU memory, 120 GiB of RAM available, 45 GiB of free disk; 2026-11-28, RESULTS D33) the auto candidate behind the
job's static tiers and its smallest micro-batch took `--largest`'s full fine-tune from 11.8B to 23.4B parameters
(bf16 compute, seq 1024, one sequence a step). The
candidates that fit are ranked by predicted step time (then by fewer changes; a plan that stores the optimizer state
in 16 bits, `optimizer.state_dtype = "bf16"` or `"bf16_master"`, which changes the numerics, is ranked as if 1 / 0.9
times slower: it comes before a plan that keeps fp32 state only when it is faster by a clear margin, 10%: `rank`),
and each is applied in turn (the job's own config loading: `apply`, which refuses what the job would refuse, e.g. a
batch the world size does not divide) and estimated again, as the configured run is, with its budgets and preflight
checks; only the ones that pass are shown (`limit`). When none fits, the last resort is the smallest raise of
`memory.device_budget` / `memory.host_budget` that fits (checked the same way: a budget over the machine is refused,
so it is offered only when the machine has it).

Note [auto within the RAM]: the auto policy fills the budgets it is given, and its "auto" host budget is the RAM
available less memory.headroom; but the run's RAM also holds what no budget counts: the runtime, the data, a unit
materializing at start, and without a GPU the activations' and the allocator's share (Note [peak memory]). So an
auto plan that needs the RAM's last bytes fails the free-RAM check by those, and before 2026-11-28 such a model
got no auto plan at all: only the static shapes, whose tiers are all or nothing (on the 2-core, 23 GiB machine a
7B-wide Llama of 14 blocks, 3.0B parameters: the best plan put every state kind on the disk, 51.7 s a step
predicted). Each auto candidate whose predicted peak RSS is over is tried again with `memory.host_budget` lowered
by the excess (and a sixteenth more, whole kinds of units moving at once; without a GPU `memory.device_budget`
held at what the plan keeps on the device tier with the activations, or the planner would move the state there,
the same RAM), at most LOWERINGS rounds: the planner sends that much more to NVMe, and the plan is shown with
both `--set` lines, which the job applies as it is estimated (the same model then: 46.4 s, part of the gradients
and master in RAM). The activations themselves are left free by the planner (Note [auto placement]).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterator

from infinity.config.sections import Config, ConfigError
from infinity.machine.preflight import Check, preflight, ram_room
from infinity.memory.placement import plan_for_config, reserves_activations
from infinity.memory.plan import PlacementError, Plan, overflows
from infinity.memory.stages import STAGES
from infinity.memory.tier import Tier
from infinity.plan.table import SHAPES, Context, Row, make_row, plan_of, seconds_text, sizes_key
from infinity.plan.traced import WORK_FIELDS
from io_engine import format_size

NOTES = {"optimizer.state_dtype=bf16": "bf16 Adam moments (the master stays fp32)",
         "optimizer.state_dtype=bf16_master": "bf16 master weights and moments (stochastic rounding)",
         "activation.checkpoint=units": "recomputes each unit's forward in backward",
         "activation.offload=host": "checkpoint inputs on host"}


@dataclass
class Applied:
    """A candidate's `--set` lines applied as the job applies them."""

    config: Config
    batch_size: int  # sequences per micro-batch on one rank


@dataclass
class Verdict:
    """The configured run of a config, estimated: its budgeted plan, its row and the preflight checks."""

    plan: Plan | None
    plan_error: str | None
    row: Row | None
    peak_terms: dict[str, int] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.row is not None and self.row.fits and all(c.ok or c.level != "error" for c in self.checks)

    def why_not(self) -> str:
        failed = [f"{c.name}: {c.detail}" for c in self.checks if not c.ok and c.level == "error"]
        return "; ".join(failed) or "; ".join(self.row.over.values() if self.row else [])


@dataclass
class RunPlan:
    """One plan that fits: the `--set` lines over the job, its row (bytes, step), what it costs."""

    sets: tuple[str, ...]
    row: Row
    notes: list[str]
    verdict: Verdict | None = None
    smaller: Iterator["RunPlan"] = field(default_factory=lambda: iter(()), repr=False)  # smaller micro-batches

    def to_json(self) -> dict:
        return {"set": list(self.sets), "step_s": self.row.step_s, "bytes": self.row.bytes,
                "activations": self.row.activations, "notes": self.notes,
                "peak": self.verdict.peak if self.verdict else {}}


def default_apply(config: Config, world_size: int, batch_size: int) -> Callable[[list[str]], Applied]:
    """`apply` for an engine config without a job: engine keys through `with_sets`, `run.batch_size`
    (sequences over all ranks) refused unless the world size divides it, as the job refuses it."""
    def apply(sets: list[str]) -> Applied:
        batch = batch_size
        for s in sets:
            if s.startswith("run.batch_size="):
                total = int(s.split("=", 1)[1])
                if total % world_size:
                    raise ConfigError(f"run.batch_size = {total} is not divisible by the world size {world_size}")
                batch = total // world_size
        return Applied(with_sets(config, [s for s in sets if not s.startswith("run.")]), batch)
    return apply


def _tiers_of(config: Config):
    p = config.placement
    return None if p.policy == "auto" else (p.params, p.grads, p.optimizer)


def judge(ctx: Context, applied: Applied) -> Verdict:
    """Note [plan search]'s check, and the configured run's own estimate: the budgeted plan `initialize`
    makes, the row with the activations of `applied.batch_size` sequences, the peak and the preflight checks.
    One figure per quantity: a plan the planner refuses reports the row's bytes (activations included)."""
    config = applied.config
    budgets = ctx.budgets_of(config) if ctx.budgets_of else ctx.budgets
    ctx = dataclasses.replace(at_batch(ctx, applied.batch_size, exact=True), config=config, budgets=budgets)
    sizes = ctx.sizes_of(config, ctx.world_size)
    tiers = _tiers_of(config)
    row = make_row(ctx, config, "configured", tiers, sizes_cache={sizes_key(config, ctx.world_size): sizes})
    try:
        planned = budgets.reserving(ctx.activations_of(config.activation)["device"]) if reserves_activations(
            config, ctx.cuda) else budgets  # (Notes [tail units], [auto placement]: as the job plans)
        plan, error = plan_for_config(sizes, config, planned, rates=ctx.plan_rates or ctx.rates), None
    except (PlacementError, ConfigError) as e:
        plan, error = None, str(e)
        if row is not None and row.over:
            error = "the placement does not fit: " + "; ".join(row.over.values()) + (
                f" (activations included: {_fmt(row.activations['device'])} on device)")
    verdict = Verdict(plan, error, row)
    if plan is not None:
        verdict.peak_terms, verdict.peak = ctx.peak_of(plan, ctx.trace, config.activation)
    verdict.checks = preflight(plan, error, config, local_world_size=ctx.local_world_size, cuda=ctx.cuda,
                               ram_per_rank=verdict.peak.get("ram", 0), device_per_rank=verdict.peak.get("device", 0),
                               frozen_referenced=ctx.frozen_referenced,
                               headroom=config.memory.headroom)  # every plan proposed keeps it (Note [headroom])
    if row is not None and not row.fits and plan is not None:  # the planner fits the state; activations overflow
        verdict.checks.insert(0, Check("with activations", False, "; ".join(row.over.values()) + " (activations "
                                       f"included: {_fmt(row.activations['device'])} on device)",
                                       "apply one of the plans listed under the table"))
    return verdict


def at_batch(ctx: Context, batch: int, *, exact: bool = False) -> Context:
    """`ctx` for `batch` sequences per micro-batch on one rank: traced at it when `exact` (or already traced),
    else interpolated between the traces at 1 and at the configured micro-batch (activations and FLOPs are
    affine in the sequences: a mask or table is the same for every batch; the judge traces exactly)."""
    if batch == ctx.batch_size or ctx.trace_at is None:
        trace = ctx.trace
    elif exact or ctx.batch_size == 1:
        trace = ctx.trace_at(batch)
    else:
        one, full, w = ctx.trace_at(1), ctx.trace, (batch - 1) / (ctx.batch_size - 1)

        def mix(a, b):
            return type(a)(a + (b - a) * w) if not isinstance(a, tuple) else tuple(mix(x, y) for x, y in zip(a, b))
        trace = dataclasses.replace(full, **{f: mix(getattr(one, f), getattr(full, f)) for f in (
            "activation_bytes", "largest_saved_bytes", "flops", "unit_forward_flops", "unit_saved", "unit_inputs",
            *WORK_FIELDS)})
    return dataclasses.replace(ctx, trace=trace, flops=trace.flops, batch_size=batch,
                               activations_of=lambda a: ctx.bytes_of(trace, a))


# ---------------------------------------------------------------- the search


def _placements(config: Config) -> list[tuple[list[str], tuple | None]]:
    """(sets, tiers) of each placement tried: the configured one first, the shapes, the auto policy."""
    mine = _tiers_of(config)
    out = [([], mine)]
    for tiers in SHAPES.values():
        if tiers != mine:
            out.append((["placement.policy=static"] * (mine is None)
                        + [f"placement.{g}={t}" for g, t, now in zip(("params", "grads", "optimizer"), tiers,
                                                                     (config.placement.params, config.placement.grads,
                                                                      config.placement.optimizer))
                           if t != now or mine is None], tiers))
    if mine is not None:
        out.append((["placement.policy=auto"], None))
    return out


def _choices(config: Config, key: str, values) -> list[list[str]]:
    """The `--set` of each value of `section.key` (none for the configured value, which comes first)."""
    section, name = key.split(".")
    now = getattr(getattr(config, section), name)
    return [[]] + [[f"{key}={v}"] for v in values if v != now]


def _batches(per_rank: int) -> list[int]:
    """Micro-batches (sequences per rank) tried, largest first: `per_rank` and the powers of two dividing it."""
    return [b for b in range(per_rank, 0, -1) if per_rank % b == 0 and ((b & (b - 1)) == 0 or b == per_rank)]


def search(ctx: Context, apply: Callable[[list[str]], Applied], *, limit: int = 3,
           extra: tuple[str, ...] = (), notes: tuple[str, ...] = ()) -> list[RunPlan]:
    """Note [plan search]: the fastest `limit` plans that fit, each applied and judged; `extra` sets (and
    their `notes`) prefix every candidate (the LoRA search's `model.lora.r`)."""
    config, world = ctx.config, ctx.world_size
    stages = [[f"zero.stage={s}"] if s != config.zero.stage else [] for s in STAGES] if world > 1 else [[]]
    states = [(p + s + d + c + u + g, tiers)
              for p, tiers in _placements(config) for s in stages
              for d in _choices(config, "optimizer.state_dtype", ("bf16", "bf16_master"))
              for c in _choices(config, "activation.checkpoint", ("units",))
              for u in _choices(config, "prefetch.units_ahead", (0,))
              for g in _choices(config, "optimizer.sub_group_size", (max(1 << 20, config.optimizer.sub_group_size
                                                                             // 8),))]
    found: list[RunPlan] = []
    cache: dict = {}
    batched = functools.cache(lambda b: at_batch(ctx, b))  # traced when a state fits without activations
    rounds: dict[tuple, int] = {}  # the auto policy's candidates with lowered budgets: their round (within_ram)
    for sets, tiers in states:  # (those are added as they are found)
        if "optimizer.sub_group_size" in " ".join(sets) and (tiers[2] if tiers else config.placement.optimizer) \
                != "nvme":
            continue  # the sub-groups only size the NVMe update's staging
        staged = _overridden(ctx, config, sets)
        if staged is None:
            continue
        # its plan alone: most states stop here (the auto policy's leaves the activations free: judged at the
        # smallest micro-batch, whose activations leave it the most, or a state that fits only there is lost)
        least = batched(1) if tiers is None else ctx
        base = plan_of(least, staged, tiers, sizes_cache=cache)
        if base is None or overflows(base.tier_totals(), ctx.budgets):
            continue  # the state and working bytes alone do not fit
        if tiers is None and rounds.get(tuple(sets), 0) < LOWERINGS and (
                lowered := within_ram(least, staged, base, sets)) is not None:
            rounds[tuple(lowered)] = rounds.get(tuple(sets), 0) + 1
            states.append((lowered, None))
        offloads = [[]] if staged.activation.checkpoint == "none" else _choices(staged, "activation.offload", ("host",))
        for o in offloads:
            acted = staged.with_overrides(o) if o else staged

            def fitting(batches, o=o, acted=acted, sets=sets, tiers=tiers):
                """The RunPlans of `batches` (micro-batches, largest first) that fit the budgets, made as asked."""
                for b in batches:
                    k = ctx.batch_size // b
                    mb = [] if k == 1 else [f"run.batch_size={b * world}",
                                            f"train.grad_accum_steps={config.train.grad_accum_steps * k}"]
                    final = acted.with_overrides(mb[1:]) if mb else acted
                    row = make_row(batched(b), final, "plan", tiers, sizes_cache=cache)
                    if row is not None and row.fits:
                        all_sets = (*extra, *sets, *o, *mb)
                        yield RunPlan(all_sets, row, [*notes, *_notes(all_sets, b, k)])
            chain = fitting(_batches(ctx.batch_size))  # the first that fits is its state's fastest; the rest as asked
            head = next(chain, None)
            if head is not None:
                found.append(dataclasses.replace(head, smaller=chain))
    found.sort(key=rank)
    return _verified(ctx, apply, found, limit)


LOWERINGS = 2  # rounds of within_ram per auto candidate (a lowered plan's peak is checked again)


def within_ram(ctx: Context, config: Config, plan: Plan, sets: list[str]) -> list[str] | None:
    """Note [auto within the RAM]: the `--set` lines of `sets` with `memory.host_budget` lowered by what the auto
    policy's `plan` puts over the RAM its run may use (and, where device and host are the same RAM, with
    `memory.device_budget` held at what the plan keeps on the device tier); None when its peak fits (or there is
    no NVMe to spill to)."""
    if ctx.peak_of is None or ctx.budgets.nvme <= 0:
        return None
    available, margin = ram_room(config.memory.headroom)
    peak = ctx.peak_of(plan, ctx.trace, config.activation)[1]["ram"]
    over = peak - (available - margin) // ctx.local_world_size
    if over <= 0:
        return None
    totals = plan.tier_totals()
    host = totals[Tier.HOST] - over - over // 16 - (64 << 20)  # (a little more: whole kinds of units move)
    if host <= 0:
        return None
    keep = [s for s in sets if not s.startswith(("memory.host_budget=", "memory.device_budget="))]
    lines = [f"memory.host_budget={host >> 20}MiB"]
    if ctx.budgets.shared_ram:  # (what the planner leaves for the activations is under this budget too)
        acts = ctx.activations_of(config.activation)["device"]
        lines.append(f"memory.device_budget={_mib(totals[Tier.DEVICE] + acts)}")
    return keep + lines


STATIC_TIERS = ("params", "grads", "optimizer")  # the [placement] keys the auto policy plans itself


def with_sets(config: Config, sets: list[str]) -> Config:
    """`config.with_overrides(sets)`, except that the auto policy's candidate replaces the configured tiers (a
    config, like the job's defaults, that sets them would otherwise refuse it: Note [plan search])."""
    data = config.to_dict()
    if "placement.policy=auto" in sets:
        data["placement"] = {k: v for k, v in data["placement"].items() if k not in STATIC_TIERS}
    return Config.from_dict(data, sets)


def _overridden(ctx: Context, config: Config, sets: list[str]) -> Config | None:
    """`with_sets(config, sets)`, None when refused; once per (config, sets): the LoRA search asks again."""
    key = (id(config), tuple(sets))
    if key not in ctx.overridden or ctx.overridden[key][0] is not config:
        try:
            ctx.overridden[key] = (config, with_sets(config, sets))
        except ConfigError:
            ctx.overridden[key] = (config, None)
    return ctx.overridden[key][1]


LOSSY = ("optimizer.state_dtype=bf16", "optimizer.state_dtype=bf16_master")
LOSSY_MARGIN = 0.9  # a plan with 16-bit optimizer state ranks first only when 10% faster than one without


def rank(plan: RunPlan) -> tuple:
    """Note [plan search]'s order: the predicted step, a plan with 16-bit optimizer state counted 1/0.9 times
    slower (it is ranked before a plan that keeps fp32 state only when faster by a clear margin: 10%), then fewer
    changes."""
    lossy = any(s in LOSSY for s in plan.sets)
    return round(plan.row.step_s / (LOSSY_MARGIN if lossy else 1.0), 4), len(plan.sets)


def _notes(sets, micro: int, k: int) -> list[str]:
    out = [NOTES[s] for s in sets if s in NOTES]
    if k > 1:
        out.append(f"{micro} sequence(s) per micro-batch x {k} accumulated: the same batch per step")
    if "placement.policy=auto" in sets:
        out.append("the auto planner places each unit")
    if any(s.startswith("memory.host_budget=") for s in sets):  # (within_ram's; a raise is noted by its caller)
        out.append("a lower host budget: RAM left for what the run holds beside its state "
                   "(Note [auto within the RAM])")
    return out


def _verified(ctx: Context, apply, found: list[RunPlan], limit: int) -> list[RunPlan]:
    shown: list[RunPlan] = []
    seen: set = set()
    for head in found:
        for plan in itertools.chain([head], head.smaller):  # a smaller micro-batch when the judge refuses one
            if len(shown) >= limit:
                return shown
            key = frozenset(plan.sets)
            if key in seen or any(frozenset(p.sets) < key for p in shown):
                break  # the same, or a shown plan with changes that buy nothing
            seen.add(key)
            try:
                verdict = judge(ctx, apply(list(plan.sets)))
            except ConfigError:
                break  # the job refuses it (e.g. a budget over the machine)
            if verdict.fits:
                plan.verdict, plan.row = verdict, verdict.row
                shown.append(plan)
                break
    return shown


def budget_raise(ctx: Context, apply: Callable[[list[str]], Applied]) -> list[RunPlan]:
    """The last resort: the smallest `memory.*_budget` raise over the smallest-footprint candidate (every
    state, checkpointing with host offload, one sequence per micro-batch) that the job accepts and that fits."""
    config, world = ctx.config, ctx.world_size
    unlimited = dataclasses.replace(ctx.budgets, device=1 << 62, host=1 << 62, ram=None)
    wide = dataclasses.replace(ctx, budgets=unlimited)
    k = ctx.batch_size
    mb = [] if k == 1 else [f"run.batch_size={world}", f"train.grad_accum_steps={config.train.grad_accum_steps * k}"]
    best = []
    for p, tiers in _placements(config):
        if tiers is None:
            continue
        for d in _choices(config, "optimizer.state_dtype", ("bf16",)):
            sets = [*p, *d, "activation.checkpoint=units", "activation.offload=host", *mb]
            try:
                cfg = config.with_overrides([s for s in sets if not s.startswith("run.")])
            except ConfigError:
                continue
            plan = plan_of(wide, cfg, tiers)  # the NVMe bytes have no activations: traced only when they fit
            if plan is None or plan.tier_totals()[Tier.NVME] > ctx.budgets.nvme:
                continue
            row = make_row(at_batch(wide, 1), cfg, "plan", tiers)
            if row is not None and row.bytes["nvme"] <= ctx.budgets.nvme:
                best.append((row.bytes["device"] + row.bytes["host"], row.step_s, sets, row))
    for _, _, sets, row in sorted(best, key=lambda b: (b[0], b[1]))[:3]:
        raise_sets = [*sets, *(f"memory.{t}_budget={_mib(row.bytes[t])}" for t in ("device", "host")
                               if row.bytes[t] > getattr(ctx.budgets, t))]
        if len(raise_sets) == len(sets):
            continue  # it fits the budgets as they are: what it fails (e.g. the free RAM) no raise mends
        found = _verified(ctx, apply, [RunPlan(tuple(raise_sets), row, [*_notes(sets, 1, k),
                                                                         "raises the memory budgets"])], 1)
        if found:
            return found
    return []


def _mib(n: int) -> str:
    return f"{-(-int(n * 1.02) // (1 << 20)) + 1}MiB"  # 2% over the need, rounded up to MiB


def _fmt(n: float) -> str:
    return format_size(n, exact=False)


def format_plans(plans: list[RunPlan], searched: bool, budget_raised: bool) -> list[str]:
    """The plans, ranked: the `--set` lines, the predicted step and the bytes they need, what they cost."""
    if not searched:
        return []
    if not plans:
        return ["no plan fits this machine: add nvme.paths on a larger disk, use a machine with more memory, "
                "or train a smaller model (`infinity estimate --largest llama` names the largest that fits)"]
    head = ("no change of placement, precision, checkpointing or micro-batch fits: the smallest budget raise"
            if budget_raised else "plans that fit (fastest first; each applied and estimated again):")
    lines = [head]
    for i, p in enumerate(plans, 1):
        b = p.row.bytes
        lines.append(f"  {i}. predicted step {seconds_text(p.row.step_s)}; device {_fmt(b['device'])}, "
                     f"host {_fmt(b['host'])}, nvme {_fmt(b['nvme'])}" + (f"; peak RSS {_fmt(p.verdict.peak['ram'])}"
                                                  if p.verdict and p.verdict.peak.get("ram") else ""))
        lines += [f"     --set {s}" for s in p.sets]
        if p.notes:
            lines.append("     (" + "; ".join(p.notes) + ")")
    return lines
