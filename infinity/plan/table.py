"""`infinity estimate`'s table: placements x ZeRO stages, fit or not, and a faster row that fits.

Note [estimate table]: every row is one placement shape (params / grads / optimizer tiers) at one ZeRO
stage, planned by the engine's own planner (`plan_placement`, static, unbudgeted so that a row exists
whether it fits or not) over the units `initialize` builds at that stage. Its bytes per tier and rank are
the plan's state + working bytes (Note [state bytes], Note [working memory]) plus the activations
(Note [activation estimate]: saved + recompute + the largest saved tensor on the device tier, offloaded
checkpoint inputs on the host tier). "Fits" is the planner's budget check (`memory/plan.py`'s `overflows`) on
those totals, naming the binding memory; the step time is Note [step time] over the plan's traffic. The
shapes: the configured one, all-device, ZeRO-Offload (params on device, grads + optimizer on host),
all-host, host + optimizer on NVMe, ZeRO-Infinity (everything on NVMe); the auto policy's plan is the
configured row when `placement.policy = "auto"`. The optional state read-ahead is left out (it only
takes memory the rest leaves free).

When the configured row does not fit, Note [plan search] (plan_search.py) finds the plans that do. When
the configured row fits but a faster row fits too, that row is offered.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from infinity.config.sections import Config
from infinity.device.dtypes import dtype_of
from infinity.memory import cost_model
from infinity.memory.placement import plan_for_config, plan_placement
from infinity.memory.plan import Budgets, PlacementError, Plan, overflows
from infinity.memory.stages import STAGES
from infinity.memory.tier import StateDtype, Tier
from io_engine import format_size

UNLIMITED = 1 << 62
SHAPES: dict[str, tuple[str, str, str]] = {  # name -> (params, grads, optimizer)
    "all-device": ("device", "device", "device"),
    "ZeRO-Offload": ("device", "host", "host"),
    "all-host": ("host", "host", "host"),
    "host+nvme-optim": ("host", "host", "nvme"),
    "ZeRO-Infinity": ("nvme", "nvme", "nvme"),
}


@dataclass
class Row:
    shape: str  # a SHAPES name, "configured" or "auto"
    tiers: tuple[str, str, str] | None  # params, grads, optimizer (None: the auto policy's mixed plan)
    stage: int
    bytes: dict[str, int]  # per tier and rank: state + working + activations
    activations: dict[str, int]  # the activation part of `bytes`, per tier
    over: dict[str, str]  # binding memory -> why (empty: fits)
    step_s: float
    bound: tuple[str, str]  # the bottleneck of forward/backward and of the optimizer
    configured: bool = False
    plan: Plan | None = field(default=None, repr=False)

    @property
    def fits(self) -> bool:
        return not self.over

    def sets(self) -> list[str]:
        """The `--set`s that select this row."""
        if self.tiers is None:
            return ["placement.policy=auto", f"zero.stage={self.stage}"]
        return ["placement.policy=static", *(f"placement.{g}={t}" for g, t in
                                             zip(("params", "grads", "optimizer"), self.tiers)),
                f"zero.stage={self.stage}"]

    def to_json(self) -> dict:
        return {"shape": self.shape, "params": self.tiers and self.tiers[0], "grads": self.tiers and self.tiers[1],
                "optimizer": self.tiers and self.tiers[2], "stage": self.stage, "bytes": self.bytes,
                "activations": self.activations, "fits": self.fits, "binding": list(self.over),
                "why": list(self.over.values()), "step_s": self.step_s, "bound_by": list(self.bound),
                "configured": self.configured, "set": self.sets()}


@dataclass
class Context:
    """What a row needs beyond its placement and stage."""

    sizes_of: Callable  # (config, world_size) -> the units initialize builds (estimate.unit_sizes_of)
    activations_of: Callable  # [activation] -> {"device": bytes, "host": bytes} (Note [activation estimate])
    config: Config
    world_size: int
    budgets: Budgets
    trace: object  # estimate.Trace
    rates: cost_model.LinkRates
    cuda: bool
    flops: float  # per micro-batch, traced
    local_world_size: int = 1
    batch_size: int = 1  # sequences per micro-batch on one rank, as traced (activations scale from it)
    budgets_of: Callable | None = None  # Config -> Budgets as initialize resolves them (None: `budgets`)
    runtime: int = 0  # Note [peak memory]'s runtime term
    bytes_of: Callable | None = None  # (Trace, [activation]) -> activations_of's answer for that trace
    peak_of: Callable | None = None  # (Plan, Trace, [activation]) -> (peak terms, peak) (Note [peak memory])
    trace_at: Callable | None = None  # micro-batch (sequences per rank) -> its Trace (estimate.trace_step)
    plan_rates: cost_model.LinkRates | None = None  # what the auto policy plans with (initialize's cached rates)
    frozen_referenced: bool = False  # checkpoints refer to the pretrained files for frozen weights (preflight)
    plans: dict = field(default_factory=dict, repr=False)  # plan_of's plans (shared by copies)
    overridden: dict = field(default_factory=dict, repr=False)  # plan_search's configs with a state's `--set`s


def sizes_key(config: Config, world: int) -> tuple:
    """What the units `initialize` builds depend on: one build per distinct key."""
    return (config.zero.stage, world, config.activation.checkpoint, config.prefetch.units_ahead,
            config.optimizer.sub_group_size, config.units.tile_bytes)


def _activation_bytes(ctx: Context, activation, scale: float = 1.0) -> dict[str, int]:
    acts = ctx.activations_of(activation)
    return {k: int(v * scale) for k, v in acts.items()}


def plan_of(ctx: Context, config: Config, tiers, *, world_size: int | None = None,
            sizes_cache: dict | None = None) -> Plan | None:
    """The plan of a row (`make_row`) without its activations and step: None when the planner refuses it."""
    world = world_size or ctx.world_size
    key = sizes_key(config, world)
    cache = sizes_cache if sizes_cache is not None else {}
    if key not in cache:
        cache[key] = ctx.sizes_of(config, world)
    sizes = cache[key]
    if tiers is None:  # the auto policy plans against the budgets it has (a plan's own memory.*_budget too)
        own = ctx.budgets_of(config) if ctx.budgets_of else ctx.budgets
        budgets = own.reserving(_activation_bytes(ctx, config.activation)["device"])
        return _remembered(ctx, sizes, (repr(config), budgets, id(ctx.rates)),  # (tail units leave the activations)
                           lambda: plan_for_config(sizes, config, budgets, rates=ctx.rates))
    unlimited = dataclasses.replace(ctx.budgets, device=UNLIMITED, host=UNLIMITED, nvme=UNLIMITED, ram=None)
    args = (config.precision.compute_dtype, tuple(tiers), unlimited, config.prefetch.units_ahead,
            config.prefetch.keep_written, config.optimizer.state_dtype)
    return _remembered(ctx, sizes, args, lambda: plan_placement(
        sizes, dtype_of(args[0]), policy="static", static=dict(zip(("params", "grads", "optimizer"), tiers)),
        budgets=unlimited, units_ahead=args[3], keep_written=args[4], state_dtype=StateDtype(args[5])))


def _remembered(ctx: Context, sizes, args: tuple, make: Callable[[], Plan]) -> Plan | None:
    """`make()`'s plan, once per units and planning arguments (the same sizes object: sizes_of caches them; the
    search asks again at each micro-batch and for each activation setting); None when the planner refuses."""
    known = ctx.plans.get((id(sizes), args))
    if known is not None and known[0] is sizes:
        return known[1]
    try:
        plan = make()
    except PlacementError:
        plan = None
    ctx.plans[(id(sizes), args)] = (sizes, plan)
    return plan


def make_row(ctx: Context, config: Config, shape: str, tiers, *, world_size: int | None = None,
             act_scale: float = 1.0, sizes_cache: dict | None = None) -> Row | None:
    """One row: `config` with the placement `tiers` (None: config's own policy, budgeted)."""
    plan = plan_of(ctx, config, tiers, world_size=world_size, sizes_cache=sizes_cache)
    if plan is None:
        return None
    acts = _activation_bytes(ctx, config.activation, act_scale)
    totals = plan.tier_totals()
    totals[Tier.DEVICE] += acts["device"]
    totals[Tier.HOST] += acts["host"]
    accum = config.train.grad_accum_steps
    traffic = cost_model.plan_traffic(plan, cuda=ctx.cuda, accum=accum)
    traffic.add(cost_model.activation_offload_traffic(acts["host"], cuda=ctx.cuda, accum=accum))
    work = ctx.trace.step_work(config.activation.checkpoint).per_batch(act_scale).times(accum)
    compute = cost_model.compute_seconds(work, ctx.rates) if ctx.flops else 0.0
    st = cost_model.predict_step_time(traffic, ctx.rates, compute, units_ahead=config.prefetch.units_ahead)
    return Row(shape=shape, tiers=tiers, stage=config.zero.stage, bytes={t.value: v for t, v in totals.items()},
               activations=acts, over=overflows(totals, ctx.budgets), step_s=st.total, bound=st.bottlenecks(),
               plan=plan)


def _configured_tiers(config: Config):
    p = config.placement
    return None if p.policy == "auto" else (p.params, p.grads, p.optimizer)


def build_table(ctx: Context) -> list[Row]:
    """Every shape (the configured one first) at every stage (at world size 1 the configured stage only: one
    rank stores the same at every stage); the configured row marked."""
    configured = _configured_tiers(ctx.config)
    shapes = [("configured" if configured is None or configured not in SHAPES.values() else
               next(n for n, t in SHAPES.items() if t == configured), configured)]
    shapes += [(n, t) for n, t in SHAPES.items() if t != configured]
    rows, cache = [], {}
    for stage in STAGES if ctx.world_size > 1 else (ctx.config.zero.stage,):  # one rank: every stage stores the same
        staged = ctx.config.with_overrides([f"zero.stage={stage}"])
        for name, tiers in shapes:
            if tiers is None:
                name = "auto"
            row = make_row(ctx, staged, name, tiers, sizes_cache=cache)
            if row is not None:
                row.configured = stage == ctx.config.zero.stage and tiers == configured
                rows.append(row)
    return rows


def configured_row(rows: list[Row]) -> Row | None:
    return next((r for r in rows if r.configured), None)


def faster_row(rows: list[Row]) -> Row | None:
    """A fitting row at least 10% faster than the configured one (which fits), the fastest."""
    me = configured_row(rows)
    if me is None or not me.fits:
        return None
    best = min((r for r in rows if r.fits), key=lambda r: r.step_s)
    return best if best.step_s < 0.9 * me.step_s else None


# ---------------------------------------------------------------- text


def _fmt(n: int) -> str:
    return format_size(n, exact=False)


def seconds_text(s: float) -> str:
    """A step time as the estimate prints it."""
    return f"{s * 1e3:,.1f} ms" if s < 10 else f"{s:,.1f} s"


def format_table(rows: list[Row], faster: Row | None) -> list[str]:
    one_stage = len({r.stage for r in rows}) == 1
    lines = [("placements" if one_stage else "placements x ZeRO stages") + ", bytes per rank and tier (state + "
             "working + activations; * = the configured run" + ("; one rank: every ZeRO stage stores the same"
                                                                  if one_stage else "") + "):",
             f"  {'':1} {'shape':16}{'params/grads/optim':22}{'stage':>6}{'device':>11}{'host':>11}{'nvme':>11}"
             f"  {'fits':16}{'step':>11}  bound (fwd/bwd, optimizer)"]
    for r in rows:
        tiers = "/".join(r.tiers) if r.tiers else "auto plan"
        fits = "yes" if r.fits else "no: " + ",".join(r.over)
        lines.append(f"  {'*' if r.configured else ' '} {r.shape:16}{tiers:22}{r.stage:>6}"
                     + "".join(f"{_fmt(r.bytes[t.value]):>11}" for t in Tier)
                     + f"  {fits:16}{seconds_text(r.step_s):>11}  {r.bound[0]}, {r.bound[1]}")
    me = configured_row(rows)
    if me is not None and not me.fits:
        lines += ["", "the configured run does not fit: " + "; ".join(me.over.values())
                  + f" (activations: {_fmt(me.activations['device'])} on device, "
                  f"{_fmt(me.activations['host'])} on host)"]
    if faster is not None:
        lines += ["", f"a faster row fits too: {faster.shape} at stage {faster.stage}, "
                  f"{seconds_text(faster.step_s)} per step instead of {seconds_text(me.step_s)}: "
                  + " ".join(f"--set {s}" for s in faster.sets())]
    return lines
