"""The byte model (memory/traffic.py) is the one answer about a plan's bytes: the planner fits, `infinity
estimate` reports and `memory_report` shows the same working bytes for one run, they cover what the run
allocates, and a host budget bounds all of them (the state read-ahead included)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import infinity
from infinity.config.job import ModelConfig
from infinity.memory.cost_model import LinkRates
from infinity.memory.placement import plan_for_config
from infinity.memory.plan import Budgets
from infinity.memory.tier import OPTIMIZER_KINDS, Kind, Tier
from infinity.models.build import build_model
from infinity.plan import estimate as est
from infinity.plan import probe

RATES = LinkRates(nvme_read=2e9, nvme_write=1e9, cpu_adam=5e8, device_adam=5e8, matmul_flops=1e11, source="test")
SMALL = ModelConfig(n_layer=3, d_model=64, n_head=4, seq_len=16, vocab_size=300)
NVME = {"params": "nvme", "grads": "nvme", "optimizer": "nvme"}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path / "cache"))


def _config(swap, host_budget: str, read_ahead="auto", speculation="auto") -> infinity.Config:
    return infinity.Config.from_dict({
        "placement": NVME, "nvme": {"paths": [str(swap)]},
        "optimizer": {"sub_group_size": 2048, "grad_clip": 1.0},
        "memory": {"device_budget": "1GiB", "host_budget": host_budget},
        "overlap": {"optimizer_with_backward": True, "optimizer_read_ahead": read_ahead,
                    "speculation": speculation}})


def test_planner_estimate_and_memory_report_agree_on_one_runs_working_bytes(tmp_path, monkeypatch):
    """One run's host working bytes, term by term, are the same number in the plan the engine made, in
    `infinity estimate`'s peak terms and in memory_report's plan section; the staging pool the run really
    allocated (update pipeline, read-ahead, fresh copies) stays within them, and all of it within the
    host budget. Planted: a plan without its read-ahead term (the pool outgrows it)."""
    monkeypatch.setattr(probe, "runtime_rss", lambda remeasure=False, modules=(), compiled=None: 0)  # no probe process
    config = _config(tmp_path, "16MiB")
    predicted = est.estimate(lambda: build_model(SMALL), config, batch_size=2, seq_len=SMALL.seq_len, rates=RATES)
    bundle = build_model(SMALL)
    with infinity.initialize(bundle.model, config, init_fn=bundle.init_fn) as engine:
        x = torch.randint(0, SMALL.vocab_size, (2, SMALL.seq_len), generator=torch.Generator().manual_seed(0))
        for _ in range(3):
            engine.backward(engine(x, x))
            engine.step()
        engine.synchronize()
        report = engine.memory_report()
        plan = engine.plan
    host = plan.working[Tier.HOST]
    terms = report["working_planned_terms"]["host"]
    assert report["working_planned"]["host"] == host == sum(terms.values()) == predicted.peak_terms["working_host"]
    assert predicted.plan.working_terms == plan.working_terms
    assert report["read_ahead_planned"] == engine.read_ahead_bytes == predicted.peak_terms["read_ahead"] > 0
    assert terms["fresh_params"] == predicted.peak_terms["fresh_params"] > 0
    nvme_optimizer = sum(report["state"]["nvme"][k.value] for k in OPTIMIZER_KINDS)
    assert engine.read_ahead_bytes == nvme_optimizer  # 16 MiB leave room for all of it
    assert 0 < report["staging_host_bytes"] <= host  # what the run allocated is what the plan fitted
    assert plan.tier_totals()[Tier.HOST] <= 16 << 20


@pytest.mark.parametrize("host_mib", [1, 2, 4, 64])
def test_the_host_budget_bounds_every_working_term_and_the_read_ahead(host_mib, tmp_path):
    """Note [working memory]: "auto" read-ahead takes half of what the rest of the plan leaves under the
    host budget (none below one sub-group), and the speculation's journal then takes what it needs of what is
    left (Note [speculative update]), so the plan's host bytes never exceed the budget."""
    config = _config(tmp_path, f"{host_mib}MiB")
    sizes = est.unit_sizes_of(build_model(SMALL).model, config, 1)
    budgets = Budgets(device=1 << 30, host=host_mib << 20, nvme=1 << 40, shared_ram=True, ram=8 << 30)
    plan = plan_for_config(sizes, config, budgets)
    without = plan_for_config(sizes, _config(tmp_path, f"{host_mib}MiB", read_ahead=0, speculation=0), budgets)
    rest = without.tier_totals()[Tier.HOST]
    wanted = sum(plan.state_bytes()[Tier.NVME][k] for k in OPTIMIZER_KINDS)
    chunk = 2048 * 4 * 3
    expected = min(wanted, (budgets.host - rest) // 2)
    assert plan.read_ahead == (expected if expected >= chunk else 0)
    # master, moments, gradient (fp32), each aligned to 64 bytes, of the units whose state is in memory (none here:
    # a fired clip would write NVMe twice)
    per_unit = [4 * (-(-s.numel(Kind.MASTER) * 4 // 64) * 64) for u, s in enumerate(sizes)
                if Tier.NVME not in (plan.tier(u, Kind.MASTER), plan.tier(u, Kind.PARAMS))]
    left = budgets.host - rest - plan.working_terms[Tier.HOST]["read_ahead"]
    fits = per_unit and min(sum(per_unit), left) >= min(per_unit)
    assert plan.speculation == (min(sum(per_unit), left) if fits else 0)
    assert plan.tier_totals()[Tier.HOST] <= budgets.host
    assert {t: v for t, v in plan.working_terms[Tier.HOST].items() if t not in ("read_ahead", "speculation")} == {
        t: v for t, v in without.working_terms[Tier.HOST].items() if t not in ("read_ahead", "speculation")}


def test_staging_is_derived_from_the_optimizer_and_the_pool(tmp_path):
    """The update's staging term is io_engine's size classes of what OffloadedOptimizer holds: with one
    chunk per unit and every kind on NVMe, at most reads-ahead + 1 tasks' four fp32 buffers are live, plus
    the writes in flight (here checked against a bound, and against the optimizer's own defaults)."""
    import inspect

    from infinity.memory import traffic
    from infinity.optim.offloaded import OffloadedOptimizer
    from io_engine import size_class
    defaults = inspect.signature(OffloadedOptimizer.__init__).parameters
    assert defaults["read_ahead"].default == traffic.UPDATE_READS_AHEAD
    assert defaults["max_writes_in_flight"].default == traffic.UPDATE_WRITES_IN_FLIGHT
    from infinity.memory.placement import plan_placement
    from infinity.memory.plan import UnitSizes
    units = tuple(UnitSizes.uniform(f"u{i}", 2 * 3000, 2 * 3000, chunk_numels=(3000, 3000))
                  for i in range(3))
    budgets = Budgets(device=1 << 30, host=64 << 20, nvme=1 << 40, shared_ram=True, ram=8 << 30)
    plan = plan_placement(units, torch.float32, policy="static", static=NVME, budgets=budgets, units_ahead=1)
    staging = plan.working_terms[Tier.HOST]["update_staging"]
    # fp32 parameters alias the master: a task holds four fp32 buffers (master, moments, gradient); the
    # steps hold the tasks read ahead and the one stepped, plus the writes in flight, and from the second step
    # on up to as many writes left pending by the previous step (waited when their chunk is fetched again)
    one, tasks = size_class(3000 * 4, 4096), (traffic.UPDATE_READS_AHEAD + 1) * 4
    assert one == 16384 and staging % one == 0
    assert (
        (tasks + traffic.UPDATE_WRITES_IN_FLIGHT) * one
        <= staging
        <= (tasks + 2 * traffic.UPDATE_WRITES_IN_FLIGHT) * one
    )
    assert est.staging_pool_bytes(plan) == staging


def test_the_bench_out_of_core_budget_flags_reach_the_engine():
    """`--host-budget` / `--device-budget` are the engine's [memory] budgets (parsed as the config does)."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_out_of_core
    cfg = bench_out_of_core.engine_config(bench_out_of_core.parse_args(
        ["--dir", "/x", "--host-budget", "2GiB", "--device-budget", "3GiB"]))
    memory = infinity.Config.from_dict(cfg).memory
    assert (memory.host_budget, memory.device_budget) == (2 << 30, 3 << 30)
    assert "memory" not in bench_out_of_core.engine_config(bench_out_of_core.parse_args(["--dir", "/x"]))


@pytest.mark.parametrize("speculation", ["64MiB", "auto"])
def test_a_speculation_size_that_cannot_act_is_said_in_the_plan(speculation, tmp_path):
    """Every unit's state on NVMe: nothing can be speculated (Note [speculative update]); an explicit size says so
    in the plan's reasons (what `infinity estimate` prints) instead of being ignored; "auto" needs no word."""
    config = _config(tmp_path, "64MiB", speculation=speculation)
    sizes = est.unit_sizes_of(build_model(SMALL).model, config, 1)
    budgets = Budgets(device=1 << 30, host=64 << 20, nvme=1 << 40, shared_ram=False, ram=8 << 30)
    plan = plan_for_config(sizes, config, budgets)
    said = [r for r in plan.reasons if r.startswith("overlap.speculation")]
    assert plan.speculation == 0 and len(said) == (speculation != "auto"), plan.reasons


@pytest.mark.parametrize("compute,optimizer,expected", [("bf16", "host", 4), ("fp32", "host", 0), ("bf16", "nvme", 0),
                                                        ("bf16", "device", 0)])
def test_a_master_cast_on_the_device_takes_one_chunk_there(compute, optimizer, expected):
    """Note [async upload]: with parameters on the GPU and an fp32 master in host memory under bf16 compute, the
    update's new master goes up as it is and is cast on the device: one optimizer chunk of fp32 bytes there (the
    largest), and 4 bytes an element on h2d per step instead of the parameters' 2. Otherwise nothing of it."""
    from infinity.memory.plan import UnitSizes
    from infinity.memory.traffic import plan_traffic, working_terms
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[compute]
    units = tuple(UnitSizes.uniform(f"u{i}", 5000, 5000, chunk_numels=(3000, 2000)) for i in range(3))
    tiers_of = {"params": Tier.DEVICE, "grads": Tier.HOST, "optimizer": Tier(optimizer)}
    terms = working_terms(units, dtype, tiers_of, units_ahead=1, cuda=True)
    assert terms[Tier.DEVICE]["upload_cast"] == 3000 * expected
    assert working_terms(units, dtype, tiers_of, units_ahead=1, cuda=False)[Tier.DEVICE]["upload_cast"] == 0
    if optimizer == "host":
        from infinity.memory.plan import Plan
        plan = Plan(tiers=tuple({k: tiers_of[k.group] for k in Kind} for _ in units), units=units,
                    compute_dtype=dtype)
        up = plan_traffic(plan, cuda=True, accum=1, kept=frozenset()).opt["h2d"]
        assert up == 3 * 5000 * 4  # the master's bytes, whatever the compute dtype


@pytest.mark.parametrize("grads,cuda,accum,held", [("nvme", False, 4, True), ("nvme", False, 1, False),
                                                   ("host", False, 4, False), ("host", True, 4, True),
                                                   ("device", True, 4, False)])
def test_a_gradient_sum_fetched_ahead_is_one_more_units_gradient(grads, cuda, accum, held):
    """Note [gradient sums ahead]: accumulating with the gradients where the add does not run (NVMe; host memory
    beside a GPU), the largest unit's gradient sum is held one backward ahead: 4 bytes an element of its store (not
    the root's, here the largest: it is read when its gradient is done, as before)."""
    from infinity.memory.plan import UnitSizes
    from infinity.memory.traffic import working_terms
    units = tuple(UnitSizes.uniform(f"u{i}", n, n, chunk_numels=(n,)) for i, n in enumerate((9000, 5000, 3000)))
    tiers_of = {"params": Tier.HOST, "grads": Tier(grads), "optimizer": Tier.HOST}
    terms = working_terms(units, torch.float32, tiers_of, units_ahead=1, cuda=cuda, grad_accum_steps=accum)
    assert terms[Tier.DEVICE]["grad_sum_ahead"] == (5000 * 4 if held else 0)
