"""Where each unit's state lives: decided once, by a pure function, read everywhere else.

`plan_placement` takes the shard sizes of every unit, the resolved budgets and
the `[placement]` policy, and returns a `Plan`. The runtime asks the plan
(`plan.tier(unit, Kind.EXP_AVG)`) and never re-decides placement on its own.
Budgets are checked here, before any work: a plan that does not fit raises a
`PlacementError` with the bytes needed, the budget, and a placement that fits.

Note [auto placement]: `policy = "auto"` places each unit's params, grads and
optimizer state separately. It reserves the worst-case working buffers, puts
every (unit, group) on the slowest tier with room (largest first), then
repeatedly applies the promotion to a faster tier with room that gains the
most predicted step time per byte it occupies (`cost_model`, Note [step time]),
ties broken by the transfer time saved, until no promotion helps. Units of the
same size and tiers are interchangeable, so one of each class is evaluated per
round. Every (unit, group) keeps a reason: what its tier saves over the next
slower one, and why it is not on a faster one (no room, or no gain).
The activations, when known (Budgets.activations: `memory.activation_reserve`, traced by `infinity train` and
`infinity estimate` for this policy), are left free on the device tier (and, without a GPU, of the RAM the
two tiers share): before 2026-11-28 the search filled the device budget with state, so a plan that fit its
budgets did not fit with the activations it would compute (the estimate's row said so; on a GPU the forward
would have run out of memory). The engine API alone does not know them and leaves none.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import torch

from infinity.config.update_mode import Mode, update_mode
from infinity.device.dtypes import dtype_of
from infinity.memory import cost_model, traffic
from infinity.memory.device_lane import with_device_lane
from infinity.memory.plan import (
    FASTEST_FIRST,
    GROUPS,
    KINDS_OF_GROUP,
    Budgets,
    PlacementError,
    Plan,
    UnitSizes,
    fmt_bytes,
    group_bytes,
    misfits,
    with_inert,
)
from infinity.memory.tier import Kind, StateDtype, Tier


def reserves_activations(config, cuda: bool) -> bool:
    """Whether a run of `config` plans with its activations left free (Budgets.reserving), the one answer for
    `infinity train` (which traces them: job/prediction.py) and `infinity estimate`: the auto policy (Note [auto
    placement]) and, on a GPU, "auto" tail units (Note [tail units]); a size in memory.activation_reserve is
    taken as it is by every plan."""
    return config.placement.policy == "auto" or (cuda and config.placement.tail_units == "auto")


def working_bytes(units: tuple[UnitSizes, ...], compute_dtype: torch.dtype, tiers_of: dict[str, Tier],
                  units_ahead: int, **settings) -> dict[Tier, int]:
    """Buffers the step needs beyond the state itself, per tier: the sums of `traffic.working_terms`
    (Note [working memory]); `settings` are its keyword arguments."""
    return traffic.totals(traffic.working_terms(units, compute_dtype, tiers_of, units_ahead, **settings))


def _build(units, compute_dtype, tiers_of: dict[str, Tier], units_ahead: int, settings: dict, reasons=()) -> Plan:
    tiers = tuple({k: tiers_of[g] for g in GROUPS for k in KINDS_OF_GROUP[g]} for _ in units)
    terms = traffic.working_terms(units, compute_dtype, tiers_of, units_ahead, **settings)
    return Plan(tiers=tiers, units=units, compute_dtype=compute_dtype, working=traffic.totals(terms),
                working_terms=terms, reasons=tuple(reasons), state_dtype=settings["state_dtype"])


def plan_placement(units: tuple[UnitSizes, ...], compute_dtype: torch.dtype, *, policy: str,
                   static: dict[str, str], budgets: Budgets, units_ahead: int,
                   rates: cost_model.LinkRates | None = None, grad_accum_steps: int = 1,
                   compute_seconds: float = 0.0, keep_written: bool = True, read_ahead: int | str = 0,
                   speculation: int = 0, tail_units: int | str = 0, device_lane: str = "off",
                   defers_update: bool = False, eager_update: bool = False,
                   state_dtype: StateDtype = StateDtype.FP32) -> Plan:
    """Decide the tier of every unit's state kinds and check it against the budgets.

    policy "static": every unit's params / grads / optimizer state on the tiers of
    `static` (the `[placement]` keys). "auto": Note [auto placement], with the link
    `rates` (default: `cost_model.default_rates`; the planner never measures nor reads a cache: the
    caller passes what `infinity.machine.link_rates` measured or cached),
    `grad_accum_steps` micro-batches per step and `compute_seconds` of forward and
    backward per step (0 when unknown: transfers are then minimized outright).
    Every working buffer of Note [working memory] is fitted with the state: `keep_written` (the fresh
    copies), and `read_ahead`, the state read-ahead's setting ("auto": half of the host memory the rest
    leaves free; bytes: refused with a ConfigError unless they fit; 0 without the optimizer worker), then
    `speculation`, the journal of speculated updates (a size, refused unless it fits in what is left; 0 when none).
    Before them `tail_units` moves the first units' gradients and optimizer state to the device (Note [tail units]).
    Last, `device_lane` ("on"), when the worker steps the units without a journal (the update waits for the global
    norm, `defers_update`, or runs during backward, `eager_update`), names the units a second worker may step on
    the GPU and fits its staging on the device (Note [device lane]).
    `state_dtype`: what the optimizer state is stored in (`[optimizer] state_dtype`; its bytes per element).
    """
    settings = {"cuda": not budgets.shared_ram, "keep_written": keep_written, "state_dtype": state_dtype,
                "grad_accum_steps": grad_accum_steps}
    if policy == "static":
        tiers_of = {g: Tier.parse(static[g]) for g in GROUPS}
        plan = _build(units, compute_dtype, tiers_of, units_ahead, settings,
                      [f"{g} on {tiers_of[g].value}: set by placement.{g}" for g in GROUPS])
        problems = misfits(plan.tier_totals(), budgets)
        if problems:
            raise PlacementError(_explain_misfit(problems, units, compute_dtype, budgets, units_ahead, settings))
    elif policy == "auto":
        plan = _auto(units, compute_dtype, budgets, units_ahead, settings, rates=rates, accum=grad_accum_steps,
                     compute_seconds=compute_seconds)
    else:
        raise PlacementError(f"placement.policy = {policy!r} is not one of 'static', 'auto'")
    plan = with_tail(plan, tail_units, budgets, defers_update)
    plan = traffic.with_read_ahead(plan, traffic.resolve_read_ahead(read_ahead, plan, budgets) if read_ahead else 0)
    plan = traffic.with_speculation(plan, traffic.resolve_speculation(speculation, plan, budgets) if speculation else 0)
    if speculation and not traffic.speculated_units(plan, not budgets.shared_ram):
        plan = with_inert(plan, f"overlap.speculation = {fmt_bytes(int(speculation))}: no unit is speculated (units "
                                f"with parameters or optimizer state on NVMe, or the optimizer on the GPU, never "
                                f"are: Note [speculative update])")
    assert not misfits(plan.tier_totals(), budgets), f"the read-ahead overflows the budgets: {plan.tier_totals()}"
    return with_device_lane(plan, device_lane, budgets, defers_update=defers_update, eager_update=eager_update)


# Note [tail units]: with the optimizer on the host, each unit's update runs on the CPU as its gradients arrive
# during backward; where the CPU's Adam is slower than backward (the H200's case b: 292 ms of Adam for 220 ms of
# backward) a backlog is left when backward ends, and it is the units the next forward uses first: the forward
# waits for the CPU (tests/device/test_simulated_schedule.py: 1.23x the floors). Keeping the gradients and
# optimizer state of those first units on the device makes their update a GPU kernel (it runs where the state
# lives: optim/offloaded.py) and leaves the CPU less to do (the simulation: 6 of 24 units, 1.04x). "auto" takes
# the forward-first units (index order: the root, then the blocks) up to four fifths of the trainable elements,
# within half of the device memory the plan and the activations leave free, on a GPU only; a count is taken as it
# is (a PlacementError if it does not fit beside the activations), without one too. The activations are
# `memory.activation_reserve`: a size, or "auto": `infinity train` on a GPU and `infinity estimate` trace them
# (Budgets.reserving); the engine API alone does not know them and keeps half of the free memory for them, as
# every plan did before 2026-11-27, when a plan that fit without tail units could not fit with them (the 70B of
# docs/scaling.md on 50 GB: 50.08 GiB needed of 46.57; tests/plan/test_estimate_stages.py).
# The share was a quarter, then half (an H100's 1.12B Llama in bf16, bench_gpu's case l: the CPU's update of three
# quarters took 0.29 s of a 0.42 s step), then four fifths after the H200's lease of 2026-11-27: there the same
# Llama's step with half was 1.8x torch's all-on-device step (the CPU's update of the other half, ~250 ms with its
# bf16 cast, paced it) and 0.95x with four fifths; case b's went from 0.357 to 0.351 s (1.04x its floors). A unit
# more on the device costs the GPU ~0.5 ms of fused Adam and takes ~14-22 ms off the CPU.
# Nineteen twentieths when the update waits for the global norm (clipping: Note [speculation default]): then no
# update runs during backward, and the CPU's whole update of the host units must hide behind the forward of the
# tail units instead. On the H200, clipped over unclipped (four fifths): case b 1.05x with four fifths, 1.015x
# with nine tenths, 1.008x with nineteen twentieths; case l 1.27x, 1.10x, 1.03x (benchmarks/RESULTS.md). The
# simulation (tests/device/test_simulated_schedule.py, in the H200's and the H100's proportions) shows the same
# shape, though it does not tell nine tenths from nineteen twentieths (1.00x both; measured 1.10x and 1.03x).
# Memory is the other limit: where the device is short the share is what fits, and the device lane
# (Note [device lane]) helps the clipped step.
TAIL_SHARE = {False: 4 / 5, True: 19 / 20}  # "auto": up to this share of the trainable elements, by defers_update


def with_tail(plan: Plan, setting, budgets: Budgets, defers_update: bool = False) -> Plan:
    """`plan` with the gradients and optimizer state of its first `setting` units on the device (Note [tail
    units]); "auto" decides how many (more when the update waits for the global norm), 0 leaves it as it is."""
    auto = setting == "auto"
    if setting == 0 or (auto and budgets.shared_ram):
        return plan
    free = budgets.device - plan.tier_totals()[Tier.DEVICE]
    acts = budgets.activations
    if auto:  # half of what the activations leave (half of all, for them too, when they are not known)
        room = free // 2 if acts is None else max(0, free - acts) // 2
    else:
        room = free - (acts or 0)
    share = sum(u.numel(Kind.MASTER) for u in plan.units) * TAIL_SHARE[defers_update]
    tiers, taken, elements, last = list(plan.tiers), 0, 0, -1
    for u, sizes in enumerate(plan.units):
        if (not auto and u >= setting) or (auto and elements >= share):
            break
        moved = {g: Tier.DEVICE if g != "params" else tiers[u][Kind.PARAMS] for g in GROUPS}
        cost = sum(group_bytes(sizes, g, moved, plan.compute_dtype, plan.state_dtype)
                   for g in ("grads", "optimizer") if tiers[u][KINDS_OF_GROUP[g][0]] is not Tier.DEVICE)
        if taken + cost > room:
            if auto:
                break
            raise PlacementError(
                f"placement.tail_units = {setting} needs {fmt_bytes(taken + cost)} of device memory for the first "
                f"{u + 1} units' gradients and optimizer state, but the plan leaves {fmt_bytes(free)} under "
                f"memory.device_budget" + (f", {fmt_bytes(acts)} of it for activations" if acts else "") +
                ': lower it, or set it to "auto"')
        tiers[u] = {k: Tier.DEVICE if k is not Kind.PARAMS else t for k, t in tiers[u].items()}
        taken, elements, last = taken + cost, elements + sizes.numel(Kind.MASTER), u
    if last < 0 or taken == 0:
        return plan
    if not auto:
        room_said = f"; placement.tail_units = {setting} is more than the {len(plan.units)} units: all are kept" \
            if setting > len(plan.units) else ""
    elif acts is None:
        room_said = "; half the free device memory left for the activations, not traced"
    else:
        room_said = f"; {fmt_bytes(acts)} left for the activations"
    reason = (f"tail units: gradients and optimizer of units 0-{last} ({elements:,} trainable elements, "
              f"{fmt_bytes(taken)}) on the device: the next forward's first units are updated there (Note [tail units])"
              + room_said)
    return dataclasses.replace(plan, tiers=tuple(tiers), reasons=plan.reasons + (reason,))


def plan_for_config(units: tuple[UnitSizes, ...], config, budgets: Budgets, *,
                    rates: cost_model.LinkRates | None = None) -> Plan:
    """`plan_placement` with every argument taken from a `Config` the way `initialize` takes them, so
    `infinity estimate` and the engine plan the same run identically (the engine should call this)."""
    p, mode = config.placement, update_mode(config)
    return plan_placement(
        units,
        dtype_of(config.precision.compute_dtype),
        policy=p.policy,
        static={"params": p.params, "grads": p.grads, "optimizer": p.optimizer},
        budgets=budgets,
        units_ahead=config.prefetch.units_ahead,
        rates=rates,
        grad_accum_steps=config.train.grad_accum_steps,
        keep_written=config.prefetch.keep_written,
        read_ahead=config.overlap.optimizer_read_ahead if config.overlap.optimizer_with_backward else 0,
        speculation=config.overlap.speculation if mode is Mode.SPECULATIVE else 0,
        tail_units=p.tail_units,
        device_lane=config.overlap.device_lane,
        defers_update=mode is Mode.DEFERRED,
        eager_update=mode is Mode.EAGER,
        state_dtype=StateDtype(config.optimizer.state_dtype),
    )


def _candidates(units, compute_dtype, budgets, units_ahead, settings):
    """Every uniform placement that fits, fastest first."""
    speed = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.NVME: 2}
    combos = sorted(itertools.product(FASTEST_FIRST, repeat=3),
                    key=lambda c: (3 * speed[c[0]] + 2 * speed[c[1]] + speed[c[2]], c[0].value))
    for combo in combos:
        tiers_of = dict(zip(GROUPS, combo))
        plan = _build(units, compute_dtype, tiers_of, units_ahead, settings)
        if not misfits(plan.tier_totals(), budgets):
            yield tiers_of, plan


def _explain_misfit(problems, units, compute_dtype, budgets, units_ahead, settings) -> str:
    msg = "the placement does not fit: " + "; ".join(problems) + "."
    fit = next(_candidates(units, compute_dtype, budgets, units_ahead, settings), None)
    if fit is not None:
        tiers_of, _ = fit
        msg += (" A placement that fits: [placement] " + " ".join(f'{g} = "{t.value}"' for g, t in tiers_of.items())
                + ' (or policy = "auto"), or raise the budgets.')
    else:
        msg += (" No placement fits these budgets: raise memory.host_budget / memory.device_budget, "
                "or add nvme.paths with more free space.")
    return msg


def _auto(units, compute_dtype, budgets: Budgets, units_ahead: int, settings: dict, *, rates, accum: int,
          compute_seconds: float) -> Plan:
    """Note [auto placement]: the per-unit tiers that minimize the predicted step time."""
    rates = rates or cost_model.default_rates(not budgets.shared_ram)
    search = _Search(units, compute_dtype, budgets, units_ahead, settings, rates, accum, compute_seconds)
    starts = search.uniform_starts(limit=4) + [s for s in (search.slowest_fill(),) if s is not None]
    if not starts:
        raise PlacementError(search.misfit())
    combos = min((search.descend(s) for s in starts), key=search.score)
    tiers = [dict(zip(GROUPS, COMBOS[c])) for c in combos]
    kinds = tuple({k: t[g] for g in GROUPS for k in KINDS_OF_GROUP[g]} for t in tiers)
    used = {g: Tier.NVME if any(t[g] is Tier.NVME for t in tiers) else Tier.HOST for g in GROUPS}
    terms = traffic.working_terms(units, compute_dtype, used, units_ahead, **settings)
    predicted = search.time_of(combos)
    return Plan(tiers=kinds, units=units, compute_dtype=compute_dtype, working=traffic.totals(terms),
                working_terms=terms, reasons=_summary(tiers, rates, predicted, compute_seconds),
                unit_reasons=search.reasons(combos), state_dtype=settings["state_dtype"])


SLOWEST_FIRST = (Tier.NVME, Tier.HOST, Tier.DEVICE)
COMBOS = tuple(itertools.product(SLOWEST_FIRST, repeat=3))  # (params, grads, optimizer) tiers of one unit
_TIER_INDEX = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.NVME: 2}


@functools.lru_cache(maxsize=32)
def _unit_tables(units: tuple, compute_dtype, units_ahead: int, settings: tuple, accum: int) -> tuple:
    """`_Search`'s arrays, which no budget changes (read-only: shared by every search over the same units; the
    plan search of Note [plan search] plans the same units under many budgets, one for each micro-batch's
    activations): per unit and combo the traffic of the forward/backward and optimizer phases, the bytes per
    tier and the groups on NVMe, and the working bytes by the mask of groups with some unit on NVMe."""
    import numpy as np
    settings = dict(settings)
    cuda, state_dtype = settings["cuda"], settings["state_dtype"]
    n, k = len(units), len(COMBOS)
    fb, opt = np.zeros((n, k, 4)), np.zeros((n, k, 6))
    state, nvme = np.zeros((n, k, 3)), np.zeros((n, k, 3), dtype=np.int64)
    for u, sizes in enumerate(units):
        for c, combo in enumerate(COMBOS):
            tiers = dict(zip(GROUPS, combo))
            t = cost_model.unit_traffic(sizes, tiers, compute_dtype=compute_dtype, cuda=cuda,
                                        accum=accum, is_root=u == 0, state_dtype=state_dtype)
            fb[u, c] = [t.fb[link] for link in cost_model.LINKS]
            opt[u, c] = [t.opt[link] for link in cost_model.LINKS] + [t.adam_cpu_work, t.adam_device]
            for g, tier in tiers.items():
                state[u, c, _TIER_INDEX[tier]] += group_bytes(sizes, g, tiers, compute_dtype, state_dtype)
                nvme[u, c, GROUPS.index(g)] = tier is Tier.NVME
    work = np.zeros((8, 3))  # by bit mask of the groups with some unit on NVMe
    for mask in range(8):
        tiers_of = {g: Tier.NVME if mask >> i & 1 else Tier.HOST for i, g in enumerate(GROUPS)}
        w = working_bytes(units, compute_dtype, tiers_of, units_ahead, **settings)
        work[mask] = [w.get(Tier.DEVICE, 0), w.get(Tier.HOST, 0), 0]
    for a in (fb, opt, state, nvme, work):
        a.flags.writeable = False
    return fb, opt, state, nvme, work


class _Search:
    """Local search over each unit's (params, grads, optimizer) tiers, on arrays of per-unit costs.

    For unit u and combo c: fb[u, c] / opt[u, c] = traffic per step of the forward/backward
    and optimizer phases (nvme_read, nvme_write, h2d, d2h; opt adds Adam elements on the CPU
    and on the GPU), state[u, c] = bytes per tier, nvme[u, c] = which groups are on NVMe
    (their staging buffers exist only then). Moves change the combos of one or two units;
    units of the same layout, root-ness and combo are interchangeable, so one (or two) of each
    class are tried per round.
    """

    def __init__(self, units, compute_dtype, budgets: Budgets, units_ahead, settings, rates, accum, compute_seconds):
        import numpy as np
        self.np, self.units, self.budgets, self.rates = np, units, budgets, rates
        self.reserve = budgets.activations or 0  # left free on the device tier (Note [auto placement])
        self.units_ahead = units_ahead
        self.compute_seconds = compute_seconds
        self.fb, self.opt, self.state, self.nvme, self.work = _unit_tables(
            tuple(units), compute_dtype, units_ahead, tuple(sorted(settings.items())), accum)
        self.rows = np.arange(len(units))
        self._arrays = (self.fb, self.opt, self.state, self.nvme)  # (the per-unit tables a candidate sums)

    # ---- evaluation (vectorized over leading axes)
    def _eval(self, fb, opt, state, nvme):
        """(predicted seconds, transfer seconds, fits) of totals with trailing axes 4 / 6 / 3 / 3."""
        np, r = self.np, self.rates
        inv = lambda rate: 0.0 if rate == float("inf") else 1.0 / rate  # noqa: E731
        disk_fb = fb[..., 0] / r.nvme_read + fb[..., 1] / r.nvme_write
        disk_opt = opt[..., 0] / r.nvme_read + opt[..., 1] / r.nvme_write
        h2d, d2h = inv(r.h2d), inv(r.d2h)
        compute = self.compute_seconds  # (elementwise maxima and sums below, not stacked reductions: the same
        fetch = np.maximum(np.maximum(disk_fb, fb[..., 2] * h2d), fb[..., 3] * d2h)  # values, no stacked copies)
        t_fb = compute + fetch if self.units_ahead == 0 else np.maximum(compute, fetch)  # (Note [step time])
        adam = opt[..., 4] / r.cpu_adam + opt[..., 5] / r.device_adam
        t_opt = np.maximum(np.maximum(np.maximum(adam, disk_opt), opt[..., 2] * h2d), opt[..., 3] * d2h)
        links = disk_fb + disk_opt + (fb[..., 2] + opt[..., 2]) * h2d + (fb[..., 3] + opt[..., 3]) * d2h
        mask = (nvme[..., 0] > 0) * 1 + (nvme[..., 1] > 0) * 2 + (nvme[..., 2] > 0) * 4
        total = state + self.work[mask]
        b = self.budgets
        fits = (total[..., 0] + self.reserve <= b.device) & (total[..., 1] <= b.host) & (total[..., 2] <= b.nvme)
        if b.shared_ram:
            fits &= total[..., 0] + total[..., 1] + self.reserve <= b.shared_limit
        return t_fb + t_opt, links, fits

    def _totals(self, combos):
        pick = lambda a: a[self.rows, combos].sum(0)  # noqa: E731
        return pick(self.fb), pick(self.opt), pick(self.state), pick(self.nvme)

    def score(self, combos) -> tuple[float, float]:
        t, links, _ = self._eval(*self._totals(combos))
        return float(t), float(links)

    def fits(self, combos) -> bool:
        return bool(self._eval(*self._totals(combos))[2])

    def time_of(self, combos) -> cost_model.StepTime:
        fb, opt, _, _ = self._totals(combos)
        traffic = cost_model.StepTraffic(fb=dict(zip(cost_model.LINKS, fb.tolist())),
                                         opt=dict(zip(cost_model.LINKS, opt[:4].tolist())),
                                         adam_cpu_work=float(opt[4]), adam_device=int(opt[5]))
        return cost_model.predict_step_time(traffic, self.rates, self.compute_seconds, units_ahead=self.units_ahead)

    # ---- starting points
    def uniform_starts(self, limit: int):
        """The `limit` fastest placements with the same tiers for every unit that fit."""
        np = self.np
        fitting = [np.full(len(self.units), c) for c in range(len(COMBOS))]
        fitting = [c for c in fitting if self.fits(c)]
        return sorted(fitting, key=self.score)[:limit]

    def slowest_fill(self):
        """Every (unit, group) on the slowest tier with room, largest first; None if something fits nowhere."""
        np = self.np
        state, nvme = np.zeros(3), np.zeros(3)
        chosen = [[Tier.DEVICE] * 3 for _ in self.units]
        for u, g in sorted(((u, g) for u in range(len(self.units)) for g in range(3)),
                           key=lambda ug: -self.units[ug[0]].shard_numel):
            nbytes = self._group_bytes(u, g)
            for tier in SLOWEST_FIRST:
                trial_state, trial_nvme = state.copy(), nvme.copy()
                trial_state[_TIER_INDEX[tier]] += nbytes
                trial_nvme[g] += tier is Tier.NVME
                if self._eval(np.zeros(4), np.zeros(6), trial_state, trial_nvme)[2]:
                    state, nvme, chosen[u][g] = trial_state, trial_nvme, tier
                    break
            else:
                return None
        return np.array([COMBOS.index(tuple(c)) for c in chosen])

    def _group_bytes(self, u: int, g: int) -> float:
        """Bytes of group g of unit u (whatever its tier)."""
        alone_on_nvme = COMBOS.index(tuple(Tier.NVME if i == g else Tier.DEVICE for i in range(3)))
        return float(self.state[u, alone_on_nvme, 2])

    # ---- descent
    def _classes(self, combos) -> list[list[int]]:
        members: dict[tuple, list[int]] = {}
        for u, sizes in enumerate(self.units):
            members.setdefault((u == 0, sizes.layout, sizes.written_params, int(combos[u])), []).append(u)
        return list(members.values())

    def descend(self, combos):
        """Apply the best move of one or two units until none shortens the step (then the transfers)."""
        combos = combos.copy()
        for _ in range(10 * len(self.units) * 3 + 10):
            now = self.score(combos)
            totals = self._totals(combos)
            classes = self._classes(combos)
            reps = [m[0] for m in classes]
            pairs = [(a, b) for i, a in enumerate(reps) for b in reps[i + 1:]]
            pairs += [(m[0], m[1]) for m in classes if len(m) > 1]
            best = self._best_single(None, totals, combos, reps)  # one unit changes combo
            best = self._best_pair(best, totals, combos, pairs)  # two units together (one frees what the other takes)
            if best is None or not _improves(now, best[0]):
                return combos
            for u, c in best[1].items():
                combos[u] = c
        return combos

    _PAIRS_AT_ONCE = 64  # (pairs evaluated in one batch: 64 x 27 x 27 candidates, ~6 MB of totals)

    def _best_single(self, best, totals, combos, units):
        """`_choose` over the combos of each of `units`, the others as they are."""
        np = self.np
        u = np.array(units)
        cand = [x + (arr[u] - arr[u, combos[u]][:, None]) for x, arr in zip(totals, self._arrays)]
        return self._choose(best, cand, lambda k, i: {units[k]: i})

    def _best_pair(self, best, totals, combos, pairs):
        """`_choose` over the combos of each pair (a, b) changing together, in order, a batch of pairs at a time
        (a Python loop per pair was most of the descent's time: O(units^2) pairs a move)."""
        np = self.np
        for lo in range(0, len(pairs), self._PAIRS_AT_ONCE):
            batch = pairs[lo:lo + self._PAIRS_AT_ONCE]
            a, b = np.array([p[0] for p in batch]), np.array([p[1] for p in batch])
            cand = [x + (arr[a] - arr[a, combos[a]][:, None])[:, :, None]
                    + (arr[b] - arr[b, combos[b]][:, None])[:, None, :] for x, arr in zip(totals, self._arrays)]
            best = self._choose(best, cand, lambda k, i, batch=batch: dict(zip(batch[k], divmod(i, len(COMBOS)))))
        return best

    def _choose(self, best, cand, move):
        """The best candidate of each row of `cand` (its first axis: a unit, or a pair of units; the rest: their
        combos): the lowest time of those that fit, then the fewest link seconds; it replaces `best` only when
        strictly better, rows in order (the first of equal scores stays). `move(row, flat index)`: its combos."""
        np = self.np
        t, links, fits = self._eval(*cand)
        rows = t.shape[0]
        fits = fits.reshape(rows, -1)
        t = np.where(fits, t.reshape(rows, -1), np.inf)
        lowest = t.min(axis=1)
        links = np.where(t <= lowest[:, None] * (1 + 1e-9) + 1e-15, links.reshape(rows, -1), np.inf)
        idx = np.argmin(links, axis=1)
        for k in np.flatnonzero(fits.any(axis=1)):
            score = (float(lowest[k]), float(links[k, idx[k]]))
            if best is None or score < best[0]:
                best = score, move(int(k), int(idx[k]))
        return best

    # ---- explanations
    def misfit(self) -> str:
        np = self.np
        combos = np.full(len(self.units), COMBOS.index((Tier.NVME,) * 3 if self.budgets.nvme else (Tier.HOST,) * 3))
        fb, opt, state, nvme = self._totals(combos)
        total = state + self.work[int(((nvme > 0) * np.array([1, 2, 4])).sum())]
        problems = misfits({Tier.DEVICE: int(total[0]) + self.reserve, Tier.HOST: int(total[1]),
                            Tier.NVME: int(total[2])}, self.budgets)
        acts = f" (the device tier's with {fmt_bytes(self.reserve)} of activations)" if self.reserve else ""
        return ('placement.policy = "auto" found no placement that fits: with everything on the slowest tier, '
                + "; ".join(problems) + acts + ". Raise memory.device_budget / memory.host_budget, add nvme.paths with "
                "more free space, or lower prefetch.units_ahead (unsharded units held on the device).")

    def reasons(self, combos) -> tuple[dict[str, str], ...]:
        """Per unit and group: what its tier saves over the next slower one, and why not a faster one."""
        now = self.score(combos)
        fb, opt, state, nvme = self._totals(combos)
        used = state + self.work[int(((nvme > 0) * self.np.array([1, 2, 4])).sum())]
        free = {Tier.DEVICE: self.budgets.device - self.reserve - used[0], Tier.HOST: self.budgets.host - used[1],
                Tier.NVME: self.budgets.nvme - used[2]}
        out = []
        for u in range(len(self.units)):
            combo = COMBOS[combos[u]]
            why = {}
            for g, group in enumerate(GROUPS):
                tier = combo[g]

                def moved(to: Tier):
                    trial = combos.copy()
                    trial[u] = COMBOS.index(tuple(to if i == g else combo[i] for i in range(3)))
                    return trial
                parts = []
                rank = SLOWEST_FIRST.index(tier)
                if rank > 0:
                    slower = SLOWEST_FIRST[rank - 1]
                    worse = self.score(moved(slower))
                    if worse[0] - now[0] <= 1e-12 and worse[1] - now[1] <= 1e-12:
                        same_ram = " (no GPU: both are RAM)" if self.budgets.shared_ram and slower is Tier.HOST else ""
                        parts.append(f"as fast as {slower.value}{same_ram}")
                    else:
                        parts.append(f"saves {_ms(worse[0] - now[0])}/step of predicted time and "
                                     f"{_ms(worse[1] - now[1])} of transfers vs {slower.value}")
                for faster in SLOWEST_FIRST[rank + 1:]:
                    trial = moved(faster)
                    if not self.fits(trial):
                        parts.append(f"{faster.value}: no room ({fmt_bytes(self._group_bytes(u, g))} needed, "
                                     f"{fmt_bytes(max(0, int(free[faster])))} free)")
                    else:
                        better = self.score(trial)
                        parts.append(f"{faster.value}: not faster ({_ms(better[0] - now[0])}/step predicted)")
                why[group] = f"{group} on {tier.value}: " + ("; ".join(parts) or "fastest tier")
            out.append(why)
        return tuple(out)


def _improves(now: tuple[float, float], new: tuple[float, float]) -> bool:
    """A move helps when it shortens the predicted step, or keeps it and moves fewer bytes."""
    eps_t = 1e-9 * max(now[0], 1e-12)
    return new[0] < now[0] - eps_t or (new[0] <= now[0] + eps_t and new[1] < now[1] - 1e-9 * max(now[1], 1e-12))


def _summary(tiers, rates, predicted, compute_seconds: float) -> tuple[str, ...]:
    lines = []
    for group in GROUPS:
        counts = {t: sum(1 for u in tiers if u[group] is t) for t in Tier}
        lines.append(f"{group}: " + ", ".join(f"{n} unit(s) on {t.value}" for t, n in counts.items() if n))
    fb, opt = predicted.bottlenecks()
    what = "predicted step" if compute_seconds else "predicted step without compute (not known when planning)"
    lines.append(f"{what} {predicted.total * 1e3:.1f} ms (forward/backward bound by {fb}, optimizer by {opt}); "
                 f"link rates: {rates.source}")
    return tuple(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:+.2f} ms" if seconds < 0 else f"{seconds * 1e3:.2f} ms"


