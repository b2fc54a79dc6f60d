"""The auto placement policy and its cost model: traffic formulas, step time, search, link-rate cache."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

import infinity
from infinity.machine import link_rates
from infinity.memory import cost_model
from infinity.memory.cost_model import LinkRates, StepTraffic, plan_traffic, predict_step_time, unit_traffic
from infinity.memory.placement import plan_placement, working_bytes
from infinity.memory.plan import GROUPS, KINDS_OF_GROUP, Budgets, Plan, UnitSizes, misfits
from infinity.memory.tier import Tier
from reference import Recipe

GPU_RATES = LinkRates(nvme_read=3e9, nvme_write=2e9, h2d=20e9, d2h=20e9, cpu_adam=1e9, device_adam=50e9,
                      matmul_flops=1e14, source="test")
CPU_RATES = LinkRates(nvme_read=3e9, nvme_write=2e9, cpu_adam=1e9, device_adam=1e9, matmul_flops=1e11, source="test")
D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path / "cache"))


def one(n: int) -> UnitSizes:
    """One unit storing n trainable elements of every kind."""
    return UnitSizes.uniform("u", n)


def units_of(sizes: list[int], chunk: int = 100_000) -> tuple[UnitSizes, ...]:
    names = ["<root>"] + [f"blocks.{i}" for i in range(len(sizes) - 1)]
    return tuple(UnitSizes.uniform(n, s, s, chunk_numels=(chunk,) * (s // chunk) + ((s % chunk,) if s % chunk else ()))
                 for n, s in zip(names, sizes))


def uniform_plan(units, combo, dtype=torch.bfloat16, units_ahead=1) -> Plan:
    tiers_of = dict(zip(GROUPS, combo))
    return Plan(tiers=tuple({k: tiers_of[g] for g in GROUPS for k in KINDS_OF_GROUP[g]} for _ in units), units=units,
                compute_dtype=dtype, working=working_bytes(units, dtype, tiers_of, units_ahead))


def predicted(plan, rates, cuda, accum=1, compute=0.0) -> float:
    return predict_step_time(plan_traffic(plan, cuda=cuda, accum=accum), rates, compute).total


# ---------------------------------------------------------------- traffic formulas


BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize("accum", [1, 3])
def test_traffic_of_everything_on_nvme_without_gpu(accum):
    n, P, G, O = 1000, 2000, 4000, 12000  # elements; bytes of bf16 params, fp32 grads, fp32 optimizer state
    t = unit_traffic(one(n), {"params": N, "grads": N, "optimizer": N}, compute_dtype=BF16, cuda=False, accum=accum,
                     is_root=False)
    fetches = 2 * accum  # before forward and before backward, each micro-batch
    # the first fetch after the update reads the copy it kept in memory (Note [fresh parameters])
    assert t.fb == {"nvme_read": (fetches - 1) * P + (accum - 1) * G, "nvme_write": accum * G, "h2d": 0, "d2h": 0}
    assert t.opt == {"nvme_read": G + O, "nvme_write": O + P, "h2d": 0, "d2h": 0}
    assert (t.adam_cpu, t.adam_device) == (n, 0)
    none_kept = unit_traffic(one(n), {"params": N, "grads": N, "optimizer": N}, compute_dtype=BF16, cuda=False,
                             accum=accum, is_root=False, kept_numel=0)
    assert none_kept.fb["nvme_read"] == fetches * P + (accum - 1) * G


def test_root_unit_is_fetched_once_per_micro_batch():
    t = unit_traffic(one(1000), {"params": N, "grads": H, "optimizer": H}, compute_dtype=FP32, cuda=False, accum=2,
                     is_root=True)
    assert t.fb["nvme_read"] == (2 * 1 - 1) * 4000  # the first of them reads the kept copy


def test_traffic_with_a_gpu_and_everything_on_host():
    n, P, G = 1000, 2000, 4000
    t = unit_traffic(one(n), {"params": H, "grads": H, "optimizer": H}, compute_dtype=BF16, cuda=True, accum=1,
                     is_root=False)
    assert t.fb == {"nvme_read": 0, "nvme_write": 0, "h2d": 2 * P, "d2h": G}  # params in, grads out
    assert t.opt == {"nvme_read": 0, "nvme_write": 0, "h2d": 0, "d2h": 0}  # Adam runs on the CPU, in place
    assert t.adam_cpu == n


def test_optimizer_on_gpu_pulls_host_grads_and_pushes_params_back():
    n, P, G = 1000, 2000, 4000
    t = unit_traffic(one(n), {"params": H, "grads": H, "optimizer": D}, compute_dtype=BF16, cuda=True, accum=1,
                     is_root=False)
    assert t.opt == {"nvme_read": 0, "nvme_write": 0, "h2d": G, "d2h": P}
    assert t.adam_device == n and t.adam_cpu == 0


def test_step_time_is_the_slowest_resource_of_each_phase():
    traffic = StepTraffic(fb={"nvme_read": 6e9, "nvme_write": 2e9, "h2d": 10e9, "d2h": 0},
                          opt={"nvme_read": 3e9, "nvme_write": 4e9, "h2d": 0, "d2h": 0}, adam_cpu=int(1e9),
                          adam_cpu_work=1e9)
    st = predict_step_time(traffic, GPU_RATES, compute_seconds=1.5)
    disk_fb, disk_opt = 6e9 / 3e9 + 2e9 / 2e9, 3e9 / 3e9 + 4e9 / 2e9  # reads and writes share the disk
    assert st.fb_seconds == pytest.approx(max(1.5, disk_fb, 10e9 / 20e9))
    assert st.opt_seconds == pytest.approx(max(1e9 / 1e9, disk_opt))
    assert st.total == pytest.approx(disk_fb + disk_opt)
    assert st.bottlenecks() == ("disk", "disk")
    # fetched on demand (prefetch.units_ahead = 0): forward/backward is the compute and then its fetches, in turn
    # (planted: the same max as with prefetching; this fails)
    serial = predict_step_time(traffic, GPU_RATES, compute_seconds=1.5, units_ahead=0)
    assert serial.fb_seconds == pytest.approx(1.5 + max(disk_fb, 10e9 / 20e9))
    assert serial.opt_seconds == pytest.approx(st.opt_seconds)


@pytest.mark.parametrize("units_ahead", [0, 2])
def test_the_auto_searchs_step_is_the_cost_models(units_ahead):
    """The auto planner's vectorized step time (`_Search`) is `predict_step_time`'s, on demand or prefetching, for
    every uniform placement of a small model (planted: the search's forward/backward without the on-demand sum;
    the units_ahead = 0 case fails)."""
    import numpy as np

    from infinity.memory import placement
    from infinity.memory.tier import StateDtype
    units = units_of([4_000_000] + [2_000_000] * 3, chunk=250_000)
    settings = {"cuda": True, "keep_written": True, "state_dtype": StateDtype.FP32, "grad_accum_steps": 1}
    search = placement._Search(units, BF16, Budgets(device=1 << 40, host=1 << 40, nvme=1 << 40), units_ahead,
                               settings, GPU_RATES, 1, 0.05)
    for c in range(len(placement.COMBOS)):
        combos = np.full(len(units), c)
        assert search.score(combos)[0] == pytest.approx(search.time_of(combos).total), placement.COMBOS[c]


def test_a_16_bit_states_cpu_update_is_priced_at_its_own_speed():
    """The CPU's update of bf16 moments and of a bf16 master runs the fused fp32 kernel on an upcast chunk and rounds
    back (the master stochastically): measured 1.5x and 3x the fp32 kernel's time (CPU_UPDATE_COST, 2026-11-29).
    The step time prices those elements so, on the CPU only (planted: every state dtype at the fp32 rate; this
    fails)."""
    from infinity.memory.tier import StateDtype
    from infinity.memory.traffic import CPU_UPDATE_COST
    n = 1 << 20
    rates = dataclasses.replace(GPU_RATES, cpu_adam=1e6, device_adam=1e9, nvme_read=1e15, nvme_write=1e15)
    for dtype, cost in ((StateDtype.FP32, 1.0), (StateDtype.BF16, 1.5), (StateDtype.BF16_MASTER, 3.0)):
        assert CPU_UPDATE_COST[dtype] == cost
        on_cpu = unit_traffic(one(n), {"params": D, "grads": H, "optimizer": H}, compute_dtype=BF16, cuda=True,
                              accum=1, is_root=False, state_dtype=dtype)
        assert on_cpu.adam_cpu == n  # (elements: what the estimate prints)
        assert predict_step_time(on_cpu, rates).opt["adam"] == pytest.approx(n * cost / 1e6)
        on_gpu = unit_traffic(one(n), {"params": D, "grads": D, "optimizer": D}, compute_dtype=BF16, cuda=True,
                              accum=1, is_root=False, state_dtype=dtype)
        assert predict_step_time(on_gpu, rates).opt["adam"] == pytest.approx(n / 1e9)


def test_traffic_of_a_plan_matches_the_managers_counters(tmp_path):
    """Cost-model bytes per link vs memory_report()["bytes_moved"] per steady-state step (CPU: NVMe links).

    The first two steps read less (Adam's moments start as zeros, which need no read), so steps from the
    third on are compared, by their median: in-flight reads can land on either side of a step boundary.
    """
    import statistics
    recipe = Recipe(steps=8, accum=2)
    for placement in ({"params": "nvme", "grads": "nvme", "optimizer": "nvme"},
                      {"params": "host", "grads": "nvme", "optimizer": "nvme"},
                      {"params": "nvme", "grads": "device", "optimizer": "host"}):
        engine = infinity.initialize(recipe.build(), recipe.config(**placement) | {"nvme": {"paths": [str(tmp_path)]}})
        moved = []
        with engine:
            for micro_batches in recipe.batches():
                for x, y in micro_batches:
                    engine.backward(engine(x, y))
                engine.step()
                moved.append(dict(engine.memory_report()["bytes_moved"]))
            traffic = plan_traffic(engine.plan, cuda=False, accum=recipe.accum, kept=engine.kept_params).total()
        for link in ("nvme_read", "nvme_write"):
            per_step = [moved[i][link] - moved[i - 1][link] for i in range(2, len(moved))]
            assert statistics.median(per_step) == pytest.approx(traffic[link], rel=0.05), (placement, link, per_step)


# ---------------------------------------------------------------- the search


def auto(units, budgets, rates, **kw) -> Plan:
    return plan_placement(units, torch.bfloat16, policy="auto", static={}, budgets=budgets, units_ahead=1,
                          rates=rates, **kw)


def test_everything_on_the_device_when_it_fits():
    units = units_of([4_000_000, 2_000_000, 2_000_000], chunk=250_000)
    plan = auto(units, Budgets(device=1 << 34, host=1 << 34, nvme=1 << 40), GPU_RATES)
    assert not plan.uses(H) and not plan.uses(N)
    assert all("vs host" in r for reasons in plan.unit_reasons for r in reasons.values())


def test_without_a_gpu_ram_before_nvme_and_device_equals_host():
    units = units_of([4_000_000, 2_000_000, 2_000_000], chunk=250_000)
    plan = auto(units, Budgets(device=1 << 34, host=1 << 34, nvme=1 << 40, shared_ram=True), CPU_RATES)
    assert not plan.uses(N)
    reasons = plan.unit_reasons[1]["optimizer"]
    assert "saves" in reasons and "vs nvme" in reasons


@pytest.mark.parametrize("cuda", [True, False])
@pytest.mark.parametrize("ram_factor", [8, 12, 16])
def test_auto_fits_and_beats_every_uniform_placement(cuda, ram_factor):
    units = units_of([4_000_000] + [2_000_000] * 5, chunk=250_000)
    total = sum(u.shard_numel for u in units)
    budgets = Budgets(device=ram_factor * total, host=ram_factor * total // 2, nvme=1 << 40, shared_ram=not cuda)
    rates = GPU_RATES if cuda else CPU_RATES
    plan = auto(units, budgets, rates, compute_seconds=0.002)
    assert not misfits(plan.tier_totals(), budgets), "the plan must fit the budgets"
    mine = predicted(plan, rates, cuda, compute=0.002)
    for combo in itertools.product(Tier, repeat=3):
        other = uniform_plan(units, combo)
        if not misfits(other.tier_totals(), budgets):
            assert mine <= predicted(other, rates, cuda, compute=0.002) * (1 + 1e-9), combo


def brute_force_best(units, budgets, rates, cuda, compute):
    best = math.inf
    for combos in itertools.product(itertools.product(Tier, repeat=3), repeat=len(units)):
        tiers = [dict(zip(GROUPS, c)) for c in combos]
        used = {g: N if any(t[g] is N for t in tiers) else H for g in GROUPS}
        plan = Plan(tiers=tuple({k: t[g] for g in GROUPS for k in KINDS_OF_GROUP[g]} for t in tiers), units=units,
                    compute_dtype=BF16, working=working_bytes(units, torch.bfloat16, used, 1))
        if not misfits(plan.tier_totals(), budgets):
            best = min(best, predicted(plan, rates, cuda, compute=compute))
    return best


@pytest.mark.parametrize("device,host,cuda", [(6, 8, True), (8, 5, True), (10, 8, True), (12, 11, True),
                                              (12, 8, False), (16, 8, False), (18, 11, False)])
def test_auto_matches_exhaustive_search_on_small_models(device, host, cuda):
    """Every assignment of 3 tiers to 3 groups of 2 units (729 plans), against the local search."""
    units = units_of([2_000_000, 2_000_000], chunk=250_000)
    total = sum(u.shard_numel for u in units)
    budgets = Budgets(device=device * total, host=host * total, nvme=1 << 40, shared_ram=not cuda)
    rates = GPU_RATES if cuda else CPU_RATES
    plan = auto(units, budgets, rates, compute_seconds=0.001)
    assert predicted(plan, rates, cuda, compute=0.001) == pytest.approx(
        brute_force_best(units, budgets, rates, cuda, 0.001), rel=1e-9)


def test_no_room_anywhere_names_the_budgets():
    units = units_of([400_000, 200_000])
    with pytest.raises(infinity.PlacementError, match="memory.host_budget.*nvme.paths"):
        auto(units, Budgets(device=1 << 20, host=1 << 20, nvme=0, shared_ram=True), CPU_RATES)


def test_reasons_say_why_a_faster_tier_was_not_used():
    units = units_of([4_000_000] + [2_000_000] * 3, chunk=250_000)
    total = sum(u.shard_numel for u in units)
    plan = auto(units, Budgets(device=8 * total, host=8 * total, nvme=1 << 40), GPU_RATES)
    assert len(plan.unit_reasons) == len(units)
    text = " ".join(r for reasons in plan.unit_reasons for r in reasons.values())
    assert "device: no room" in text
    for reasons in plan.unit_reasons:
        assert set(reasons) == set(GROUPS)
    assert any("predicted step" in line for line in plan.reasons)


def test_engine_with_auto_policy_trains_like_plain_pytorch(tmp_path):
    from engine_runs import engine_run
    from reference import reference_run
    recipe = Recipe(steps=2)
    total = sum(p.numel() for p in recipe.build().parameters())
    extra = {"placement": {"policy": "auto"}, "memory": {"device_budget": str(60 * total),
                                                         "host_budget": str(60 * total)}}
    cfg_losses, _, state, report = engine_run(recipe, {"policy": "auto"}, str(tmp_path), extra=extra)
    ref_losses, _, ref_state = reference_run(recipe)
    assert report["state"] == report["plan"]
    torch.testing.assert_close(torch.tensor(cfg_losses), torch.tensor(ref_losses))
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key])


# ---------------------------------------------------------------- link rates


def test_link_rates_are_measured_once_then_cached(tmp_path, monkeypatch):
    calls = []
    real = link_rates.measure_link_rates

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, disk_bytes=4 << 20, **{k: v for k, v in kwargs.items() if k != "disk_bytes"})
    monkeypatch.setattr(link_rates, "measure_link_rates", counting)
    first = link_rates.link_rates(str(tmp_path))
    second = link_rates.link_rates(str(tmp_path))
    assert len(calls) == 1 and first == second
    assert first.nvme_read > 0 and first.nvme_write > 0 and first.cpu_adam > 0 and first.matmul_flops > 0
    assert link_rates.cached_link_rates(cuda=torch.cuda.is_available()) == first
    link_rates.link_rates(str(tmp_path), remeasure=True)
    assert len(calls) == 2


def test_the_planner_takes_rates_and_never_reads_the_cache(monkeypatch):
    """The caller decides to measure or read the cache (infinity/machine/link_rates.py); the planner with no rates
    plans with cost_model.default_rates, whatever the cache holds."""
    def no_cache():
        raise AssertionError("the planner read the link-rate cache")
    monkeypatch.setattr(link_rates, "_load_cache", no_cache)
    units = units_of([4_000_000, 2_000_000, 2_000_000], chunk=250_000)
    budgets = Budgets(device=100_000_000, host=1 << 34, nvme=1 << 40)
    plan = auto(units, budgets, None)
    assert plan.reasons == auto(units, budgets, cost_model.default_rates(cuda=True)).reasons
    assert "link rates: defaults" in plan.reasons[-1]


def test_without_a_measurement_the_defaults_are_used():
    assert link_rates.cached_link_rates(cuda=False).source == "defaults"
    assert link_rates.cached_link_rates(cuda=False).h2d == math.inf  # no copies without a GPU


@pytest.mark.parametrize("cuda", [True, False])
def test_the_known_activations_are_left_free_on_the_device_tier(cuda):
    """Note [auto placement]: with the activations known (Budgets.activations, as `infinity train` and `infinity
    estimate` plan), the auto policy's device tier (without a GPU: the RAM both tiers share) holds the state and
    working buffers in the budget less them, so the plan fits with the activations it will compute; unknown, the
    whole budget (planted: the search's fit without the reserve: the device tier filled to its budget, or the RAM
    to its limit, with the activations' room; this fails)."""
    units = units_of([1_000_000] * 6, chunk=250_000)
    total = sum(u.shard_numel for u in units)
    acts = 2 * total
    budgets = Budgets(device=10 * total, host=6 * total if cuda else 10 * total, nvme=1 << 40, shared_ram=not cuda)
    rates = GPU_RATES if cuda else CPU_RATES
    blind = auto(units, budgets, rates).tier_totals()
    reserved = auto(units, budgets.reserving(acts), rates).tier_totals()
    limit = budgets.device if cuda else budgets.shared_limit
    used = (lambda t: t[D]) if cuda else (lambda t: t[D] + t[H])
    assert used(blind) + acts > limit, "the case needs a plan that fills the room the activations want"
    assert used(reserved) + acts <= limit, (used(reserved), acts, limit)
    assert reserved[N] > blind[N]  # (what the activations need went to NVMe)
