"""Before any state is built: the engine's plan, preflight and swap space.

`plan_units` plans the placement exactly as `infinity estimate` plans it (the same unit sizes, budgets and
rates), sizes the state read-ahead, and runs the same preflight checks; `open_swap` opens the swap files the
plan's NVMe state needs.
"""

from __future__ import annotations

import warnings

from infinity.config.sections import Config, SettingWarning
from infinity.machine.environment import ProcessEnv, resolve_budgets
from infinity.memory.placement import plan_for_config
from infinity.memory.plan import Plan
from infinity.memory.tier import Tier
from infinity.optim.read_ahead import resolve_read_ahead
from infinity.units.builder import recomputed_units, unit_sizes
from infinity.units.unit import Unit
from io_engine import IOEngine, SwapSpace


def plan_units(units: list[Unit], regions, cfg: Config, env: ProcessEnv, weights) -> tuple[Plan, int]:
    """The plan and the read-ahead bytes; the checkpoint space leaves out the frozen weights when `weights`
    will be referenced (Note [pretrained references])."""
    from infinity.machine.link_rates import rates_for_plan
    from infinity.machine.preflight import check_nvme_paths, check_trace_dir, preflight, require
    sizes = unit_sizes(units, cfg.optimizer.sub_group_size,
                       recomputed_units(regions, cfg.activation.checkpoint, cfg.prefetch.units_ahead))
    nvme_free = check_nvme_paths(list(cfg.nvme.paths)) if cfg.nvme.paths else 0
    budgets = resolve_budgets(cfg.memory, env.device, env.local_world_size, nvme_free)
    auto = cfg.placement.policy == "auto"  # the swap disk's rates measured once per machine, then cached
    rates = rates_for_plan(cfg, env.device, measure=True) if auto else None
    plan = plan_for_config(sizes, cfg, budgets, rates=rates)
    for line in plan.inert:  # Note [inert setting]
        warnings.warn(f"{line}; the setting does nothing in this run", SettingWarning, stacklevel=2)
    read_ahead = resolve_read_ahead(cfg, plan, budgets)
    referenced = cfg.checkpoint.reference_pretrained and weights is not None and weights.holds_every_frozen(units)
    checks = preflight(plan, None, cfg, local_world_size=env.local_world_size, cuda=env.device.type == "cuda",
                       frozen_referenced=referenced)
    require(checks + ([check_trace_dir(cfg.profile.trace_dir)] if cfg.profile.enabled else []))
    return plan, read_ahead


def open_swap(plan: Plan, cfg: Config, rank: int, n_units: int) -> tuple[IOEngine | None, SwapSpace | None]:
    """The I/O engine and swap space of the plan's NVMe state (None, None when nothing is on NVMe)."""
    if not plan.uses(Tier.NVME):
        return None, None
    io = IOEngine(cfg.io.engine_config())
    swap = SwapSpace(dirs=list(cfg.nvme.paths), io=io, rank=rank, name="infinity", checksum=cfg.io.checksum)
    swap.reserve(sum(plan.state_bytes()[Tier.NVME].values()) + n_units * 5 * 4096 * 2)  # + each extent's alignment
    return io, swap
