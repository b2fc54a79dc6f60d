"""benchmarks/bench_step.py's issue-5 bar: `infinity:auto` beside every static placement that fits tight budgets.

No timing is asserted (a benchmark is not a test): what is checked is that the driver
expands `infinity:fitting` into exactly the static placements the planner accepts, that
auto runs and fits, and that the payload carries the comparison.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

import infinity
from infinity.memory.placement import plan_placement
from infinity.memory.plan import Budgets, PlacementError
from infinity.models.gpt import GPT
from infinity.plan.estimate import unit_sizes_of

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_step  # noqa: E402
import step_systems  # noqa: E402

TINY = {"layers": 2, "d_model": 128, "heads": 4, "vocab": 512, "seq": 64}
UNLIMITED = Budgets(device=1 << 50, host=1 << 50, nvme=1 << 50, shared_ram=True, ram=1 << 50)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path / "cache"))  # the workers inherit it


def bench_args(tmp_path, budget: int | str | None, model: dict | None = TINY) -> argparse.Namespace:
    """The driver's arguments (the bench's defaults, then `model` and the budgets) as it parses them."""
    argv = ["--dir", str(tmp_path)]
    argv += [a for k, v in (model or {}).items() for a in (f"--{k.replace('_', '-')}", str(v))]
    if budget:
        argv += ["--device-budget", str(budget), "--host-budget", str(budget)]
    return bench_step.parser().parse_args(argv)


def unit_sizes(tmp_path):
    args = bench_args(tmp_path, None)
    with infinity.meta_init():
        model = GPT(step_systems.model_config(args))
    return unit_sizes_of(model, infinity.Config.from_dict(step_systems.infinity_config(args, "auto", str(tmp_path))), 1)


def host_bytes_of_everything_on_host(tmp_path) -> int:
    """What host/host/host puts on the host tier (state + working buffers), as the planner counts it."""
    plan = plan_placement(unit_sizes(tmp_path), torch.float32, policy="static",
                          static={"params": "host", "grads": "host", "optimizer": "host"}, budgets=UNLIMITED,
                          units_ahead=2)
    return plan.tier_totals()[infinity.Tier.HOST]


def planner_accepts(tmp_path, budgets: Budgets) -> set[str]:
    """The static placements for which plan_placement(policy="static") does not raise."""
    sizes, out = unit_sizes(tmp_path), set()
    for placement in step_systems.STATIC_PLACEMENTS:
        params, grads, optim = placement.split("/")
        try:
            plan_placement(sizes, torch.float32, policy="static", budgets=budgets, units_ahead=2,
                           static={"params": params, "grads": grads, "optimizer": optim})
            out.add(placement)
        except PlacementError:
            pass
    return out


def test_fitting_expands_to_exactly_the_static_placements_the_planner_accepts(tmp_path):
    budget = int(0.9 * host_bytes_of_everything_on_host(tmp_path))  # everything on host no longer fits
    fit = bench_step.fitting_placements(bench_args(tmp_path, budget))
    b = fit["budgets"]
    assert (b["device"], b["host"]) == (budget, budget) and b["nvme"] > 0
    accepted = planner_accepts(tmp_path, Budgets(**b))
    assert set(fit["fitting"]) == accepted and len(fit["fitting"]) == len(accepted)
    assert set(fit["fitting"]) | set(fit["not_fitting"]) == set(step_systems.STATIC_PLACEMENTS)
    assert "host/host/host" in fit["not_fitting"] and "device/device/device" in fit["not_fitting"]
    assert "memory.host_budget" in fit["not_fitting"]["host/host/host"]  # the planner's reason, kept
    assert fit["fitting"], "some placement must still fit"
    systems = bench_step.expand_systems(["torch", "infinity:auto", "infinity:fitting", "infinity:device/host/host"],
                                        fit)
    assert systems[:2] == ["torch", "infinity:auto"]
    assert systems[2:] == [f"infinity:{p}" for p in fit["fitting"]] + (
        [] if "device/host/host" in fit["fitting"] else ["infinity:device/host/host"])


def test_without_budgets_every_static_placement_fits(tmp_path):
    fit = bench_step.fitting_placements(bench_args(tmp_path, None))
    assert fit["fitting"] == list(step_systems.STATIC_PLACEMENTS) and not fit["not_fitting"]


def test_default_budgets_leave_only_placements_with_the_optimizer_on_nvme_for_the_default_model(tmp_path,
                                                                                              monkeypatch):
    """AUTO_BUDGETS on the bench's 311M-parameter GPT: neither everything on host nor everything on device fits.
    (On a machine with plenty of RAM and disk, which the benchmark needs: this one's are not asked.)"""
    import types

    import infinity.machine.environment
    import infinity.machine.preflight
    monkeypatch.setattr(infinity.machine.preflight, "check_nvme_paths", lambda paths: 1 << 40)
    monkeypatch.setattr(infinity.machine.environment.psutil, "virtual_memory",
                        lambda: types.SimpleNamespace(available=1 << 36, total=1 << 36))
    args = bench_args(tmp_path, None, model=None)
    assert (args.layers, args.d_model, args.vocab) == (24, 1024, 8192)
    args.device_budget, args.host_budget = bench_step.AUTO_BUDGETS
    fit = bench_step.fitting_placements(args)
    assert fit["fitting"] == ["device/host/nvme", "device/nvme/nvme", "host/device/nvme", "host/nvme/nvme",
                              "nvme/device/nvme", "nvme/host/nvme", "nvme/nvme/nvme"]
    assert {"host/host/host", "device/device/device"} <= set(fit["not_fitting"])


def test_auto_config_leaves_the_static_keys_at_their_defaults(tmp_path):
    config = infinity.Config.from_dict(step_systems.infinity_config(bench_args(tmp_path, 4096), "auto", str(tmp_path)))
    assert config.placement.policy == "auto" and config.placement == type(config.placement)(policy="auto")
    assert config.memory.device_budget == 4096 and config.memory.host_budget == 4096


@pytest.mark.slow  # ~60 s: a benchmark run of every fitting placement
def test_driver_runs_auto_beside_every_fitting_static_placement(tmp_path):
    budget = int(0.9 * host_bytes_of_everything_on_host(tmp_path))
    argv = ["--dir", str(tmp_path / "disk"), "--steps", "1", "--warmup", "1", "--io-bytes", str(1 << 20),
            "--io-sustained-bytes", str(1 << 20), "--paired-blocks", "0",
            "--device-budget", str(budget), "--host-budget", str(budget), "--json", str(tmp_path / "out.json"),
            "--systems", "infinity:auto,infinity:fitting", "--timeout", "300"]
    argv += [a for k, v in TINY.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    payload = bench_step.main(argv)
    a = payload["auto_vs_static"]
    assert a["budgets"]["host"] == budget and a["budgets"]["device"] == budget
    fitting = set(a["fitting"])
    assert fitting == planner_accepts(tmp_path, Budgets(**a["budgets"])) and "host/host/host" not in fitting
    assert payload["systems"] == ["infinity:auto"] + [f"infinity:{p}" for p in a["fitting"]]
    assert not a["fitting_not_run"] and set(a["not_fitting"]) == set(step_systems.STATIC_PLACEMENTS) - fitting
    for placement, r in a["fitting"].items():
        assert r.get("step_s"), (placement, r)  # it fit, so it ran
    auto = payload["results"]["infinity:auto"]
    assert a["auto_fits"] and "step_s" in auto, a["auto_error"]
    plan = auto["plan"]
    assert plan["units"] == 3 and plan["reasons"]
    for group in ("params", "grads", "optimizer"):
        assert sum(plan["tier_counts"][group].values()) == 3
    assert plan["tier_totals_bytes"]["host"] <= budget and plan["tier_totals_bytes"]["device"] <= budget
    assert a["best_static"] in fitting and a["best_static_step_s"] == min(r["step_s"] for r in a["fitting"].values())
    assert a["ratio_auto_to_best"] == pytest.approx(a["auto_step_s"] / a["best_static_step_s"], abs=1e-3)
    assert a["within_10pct"] == (a["auto_step_s"] / a["best_static_step_s"] <= 1.10)
    assert (tmp_path / "out.json").exists()


def test_a_placement_that_does_not_fit_is_reported_with_the_planners_message(tmp_path):
    budget = int(0.9 * host_bytes_of_everything_on_host(tmp_path))
    argv = ["--dir", str(tmp_path / "disk"), "--steps", "1", "--warmup", "0", "--io-bytes", str(1 << 20),
            "--io-sustained-bytes", str(1 << 20), "--paired-blocks", "0",
            "--device-budget", str(budget), "--host-budget", str(budget), "--systems", "infinity:host/host/host"]
    argv += [a for k, v in TINY.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    payload = bench_step.main(argv)
    error = payload["results"]["infinity:host/host/host"]["error"]
    assert "PlacementError" in error and "memory.host_budget" in error
    assert "auto_vs_static" not in payload
