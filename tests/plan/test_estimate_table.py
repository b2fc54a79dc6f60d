"""`infinity estimate`'s table (Note [estimate table]), the budget check
(Note [budget check]) and --stages counting the activations."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest
import torch

import infinity
from infinity.config.job import ModelConfig
from infinity.config.sections import ConfigError, MemoryConfig
from infinity.machine.environment import resolve_budgets
from infinity.memory.cost_model import LinkRates
from infinity.memory.plan import Budgets
from infinity.models.build import build_model
from infinity.plan import estimate as est
from stage_formulas import FORMULAS

RATES = LinkRates(nvme_read=2e9, nvme_write=1e9, cpu_adam=5e8, device_adam=5e8, matmul_flops=1e11, source="test")
# large enough that padding to 8 ranks is well under 1% of each unit
MODEL = ModelConfig(n_layer=2, d_model=256, n_head=4, seq_len=32, vocab_size=512)
BIG = 1 << 50


def run(config: dict, *, world=1, batch=2, budgets=None, seq_len=MODEL.seq_len):
    return est.estimate(lambda: build_model(MODEL), infinity.Config.from_dict(config), world_size=world,
                        batch_size=batch, seq_len=seq_len, rates=RATES, cuda=False,
                        budgets=budgets or Budgets(device=BIG, host=BIG, nvme=BIG))


BF16 = {"precision": {"compute_dtype": "bf16"}}


@pytest.fixture(scope="module")
def table8():
    return run(BF16, world=8).table


@pytest.mark.parametrize("shape,tier_of", [
    ("all-device", {"params": "device", "grads": "device", "optimizer": "device"}),
    ("ZeRO-Offload", {"params": "device", "grads": "host", "optimizer": "host"}),
    ("ZeRO-Infinity", {"params": "nvme", "grads": "nvme", "optimizer": "nvme"}),
])
def test_table_rows_match_the_stage_formulas(table8, shape, tier_of):
    """Every stage of three shapes at 8 ranks: the row's bytes per tier, less its working buffers and the
    activations, are the ZeRO formulas (2 + 4 + 12)Ψ/N etc. split by the shape's tiers."""
    psi = sum(p.numel() for p in {id(p): p for p in build_model(MODEL).model.parameters()}.values())
    n = 8
    per_kind = {  # bytes per rank of each group at each stage, written out: bf16 params, fp32 grads, K = 12
        0: {"params": 2 * psi, "grads": 4 * psi, "optimizer": 12 * psi},
        1: {"params": 2 * psi, "grads": 4 * psi, "optimizer": 12 * psi / n},
        2: {"params": 2 * psi, "grads": 4 * psi / n, "optimizer": 12 * psi / n},
        3: {"params": 2 * psi / n, "grads": 4 * psi / n, "optimizer": 12 * psi / n},
    }
    rows = [r for r in table8 if r.shape == shape]
    assert sorted(r.stage for r in rows) == [0, 1, 2, 3]
    for r in rows:
        assert sum(per_kind[r.stage].values()) == pytest.approx(FORMULAS[r.stage](psi, n))
        expected = {"device": 0.0, "host": 0.0, "nvme": 0.0}
        for group, tier in tier_of.items():
            expected[tier] += per_kind[r.stage][group]
        working = {t.value: v for t, v in r.plan.working.items()}
        for tier in expected:
            state = r.bytes[tier] - working.get(tier, 0) - r.activations.get(tier, 0)
            assert state == pytest.approx(expected[tier], rel=0.01, abs=64 * 1024), (shape, r.stage, tier)
        assert r.fits and r.step_s > 0


def test_json_has_the_rows_and_a_state_when_nothing_fits():
    e = run({}, budgets=Budgets(device=1 << 20, host=1 << 20, nvme=0))
    data = e.to_json()
    assert not e.ok and e.plan is None
    assert data["state"] and data["state"]["device"]["params"] > 0  # the configured placement's bytes
    assert len(data["table"]) == len(e.table) >= 5
    assert {r["stage"] for r in data["table"]} == {infinity.Config.from_dict({}).zero.stage}  # one rank: one stage
    assert sum(r["configured"] for r in data["table"]) == 1
    me = next(r for r in data["table"] if r["configured"])
    assert not me["fits"] and me["binding"]


def test_a_faster_fitting_row_is_offered_and_its_sets_select_it():
    config = {"placement": {"params": "nvme", "grads": "host", "optimizer": "nvme"}, "nvme": {"paths": ["/tmp"]}}
    slow = RATES.__class__(**{**RATES.__dict__, "nvme_read": 1e6, "nvme_write": 1e6})
    e = est.estimate(lambda: build_model(MODEL), infinity.Config.from_dict(config), batch_size=2,
                     seq_len=MODEL.seq_len, rates=slow, cuda=False, budgets=Budgets(device=BIG, host=BIG, nvme=BIG))
    me = next(r for r in e.table if r.configured)
    assert me.fits and e.faster is not None and e.faster.step_s < 0.9 * me.step_s
    assert "a faster row fits too" in est.format_estimate(e)
    cfg = infinity.Config.from_dict(config).with_overrides(e.faster.sets())
    assert (cfg.placement.params, cfg.placement.grads, cfg.placement.optimizer) == e.faster.tiers


def test_budgets_over_the_machine_are_refused_unless_what_if():
    ram = psutil.virtual_memory().total
    too_much = MemoryConfig(device_budget=str(2 * ram), host_budget="auto")
    with pytest.raises(ConfigError, match="more than this machine has"):
        resolve_budgets(too_much, torch.device("cpu"), 1, 0)
    with pytest.raises(ConfigError, match="host_budget"):
        resolve_budgets(MemoryConfig(host_budget=str(2 * ram)), torch.device("cpu"), 1, 0)
    assert resolve_budgets(too_much, torch.device("cpu"), 1, 0, check_machine=False).device == 2 * ram
    assert resolve_budgets(MemoryConfig(device_budget=str(ram // 4)), torch.device("cpu"), 1, 0).device == ram // 4
    out = subprocess.run([sys.executable, "-m", "infinity", "estimate", "--json", "--set",
                          f"memory.host_budget={2 * ram}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "more than this machine has" in out.stderr, out.stderr[-500:]
    assert not out.stdout


def test_stages_count_the_activations():
    from infinity.plan import scaling
    config = infinity.Config.from_dict({"placement": {"params": "device", "grads": "device",
                                                      "optimizer": "device"}})
    # (batch 32: the activations, ~40 MB, well over the state's 34 MB: Note [fused attention] took the margin
    # batch 16 had, ~0.5 MB of attention probabilities, away)
    free = scaling.estimate_stages(lambda: build_model(MODEL), config, scaling.Cluster(1), batch_size=32,
                                   seq_len=MODEL.seq_len, cuda=False,
                                   budgets=Budgets(device=BIG, host=BIG, nvme=BIG))
    state = max(sum(r.state.values()) for r in free.rows)
    tight = scaling.estimate_stages(lambda: build_model(MODEL), config, scaling.Cluster(1), batch_size=32,
                                    seq_len=MODEL.seq_len, cuda=False,
                                    budgets=Budgets(device=2 * state, host=BIG, nvme=BIG))
    assert all(r.fits for r in free.rows)
    assert not any(r.fits for r in tight.rows) and "with activations" in tight.rows[0].error
    assert json.dumps(tight.to_json())
